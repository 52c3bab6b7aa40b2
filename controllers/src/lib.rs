//! pmem-csi's cluster-side building blocks: the admin server every subcommand runs, its logging
//! setup and, as they land, the reconcile framework and the controllers built on it.

pub mod admin;
pub mod capacity_source;
pub mod liveness;
pub mod logging;
pub mod readiness;
pub mod rescheduler;

pub use admin::{AdminError, AdminServer};
pub use capacity_source::{CapacitySource, NodeCapacity, PoolCapacity};
pub use logging::LogFormat;
pub use readiness::{Readiness, ReadyFlag};
