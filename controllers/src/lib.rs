//! pmem-csi's cluster-side building blocks: the admin server every subcommand runs, its logging
//! setup and, as they land, the reconcile framework and the controllers built on it.

pub mod admin;
pub mod bypass;
pub mod capacity_cleanup;
pub mod capacity_publisher;
pub mod capacity_source;
pub mod claim_summary;
pub mod concern;
pub mod controller_process;
mod core_resource;
pub mod duration;
pub mod error_backoff;
pub mod flags;
pub mod heartbeat;
pub mod instrument;
pub mod leader;
pub mod liveness;
pub mod liveness_view;
pub mod logging;
pub mod names;
pub mod node_loss;
pub mod node_selector;
pub mod node_summary;
pub mod orphan_sweep;
pub mod pod_volumes;
pub mod quantity;
pub mod rate_limit;
pub mod readiness;
pub mod reconcile_metrics;
pub mod rescheduler;
pub mod stores;
#[cfg(any(test, feature = "test-objects"))]
pub mod test_objects;
pub mod volume_cost;
pub mod volume_facts;
pub mod waiting_claims;
pub mod well_known;

pub use admin::{AdminError, AdminServer};
pub use capacity_source::{CapacitySource, NodeCapacity, PoolCapacity};
pub use controller_process::{ControllerArgs, ControllerProcess};
pub use logging::LogFormat;
pub use readiness::{Readiness, ReadyFlag};
pub use volume_cost::{VolumeOverhead, volume_cost};
