//! The pod mutating webhook (HTTPS, in `pmem-csi controller`) and the scheduler extender
//! (`pmem-csi extender`, plain HTTP on 127.0.0.1 beside kube-scheduler).
//!
//! Sans-IO cores (which volumes of a pod are pending PMEM demand, the mutation, the fit, the
//! reservation book, the score) are pure functions over plain data; the servers around them
//! stay thin.

pub mod admission;
pub mod capacity_index;
pub mod certificate_secret;
pub mod extender;
pub mod extender_api;
pub mod extender_metrics;
pub mod fit;
pub mod https;
pub mod mutation;
pub mod node_table;
pub mod placement;
pub mod pod_volumes;
pub mod reservation_book;
pub mod reservation_journal;
pub mod score;
pub mod self_signed;
#[cfg(test)]
pub(crate) mod test_objects;
pub mod tls;
pub mod webhook;

/// Time as the certificate functions take it.
pub use time::OffsetDateTime;
