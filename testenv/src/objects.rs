//! The builders' old paths, for bench/src/webhook_load.rs alone: it is being changed in
//! parallel, and moves to `controllers::test_objects` and [`crate::api_calls`] with that
//! change; then this module goes.

pub use crate::api_calls::create_storage_class;
pub use controllers::test_objects::{
    claim, pod_with_claim, pod_with_inline_volume, published_capacity, with_scheduler_resource,
};
