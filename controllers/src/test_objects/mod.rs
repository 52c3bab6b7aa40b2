//! Builders of the Kubernetes objects tests feed in or create, in one place for every crate:
//! the unit tests of the index, the placement and the webhook, and the integration tests, the
//! end-to-end scenarios and the benchmarks that create them on testenv or a cluster. Pure: no
//! client, no I/O.
//!
//! Each kind of object is written once; what tests vary beyond the arguments is a modifier on
//! the built object ([`selected_for`], [`bound_to`], [`runnable`], [`with_script`],
//! [`with_scheduler_resource`]), and the unit tests' shorthands ([`sized_claim`], [`volume`],
//! [`claim_pod`]) are those builders with this module's [`NAMESPACE`] and [`DRIVER`].

mod capacity;
pub mod json;
mod pods;
mod storage;

pub use capacity::{capacity, managed_capacity, published_capacity};
pub use pods::{
    claim_pod, claim_volume, generic_ephemeral_volume, inline_pod, inline_volume, pod,
    pod_with_claim, pod_with_inline_volume, runnable, with_scheduler_resource, with_script,
};
pub use storage::{bound_to, claim, csi_volume, selected_for, sized_claim, storage_class, volume};

/// The driver the unit tests' shorthands name.
pub const DRIVER: &str = "pmem-csi.intel.com";
/// 1 GiB.
pub const GI: u64 = 1 << 30;
/// 1 MiB.
pub const MI: u64 = 1 << 20;
/// The namespace of the unit tests' claims and pods.
pub const NAMESPACE: &str = "ns";
