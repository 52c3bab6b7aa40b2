//! The scheduler extender (`pmem-csi extender`, plain HTTP on 127.0.0.1 beside kube-scheduler):
//! which nodes have room for a pod's pending PMEM volumes, reservations so that a burst of pods
//! never over-commits a node, and the score.
//!
//! Sans-IO cores (the capacity index, the fit, the reservation book, the score, the placement
//! over them) are pure functions over plain data; [`server`] decodes, locks, calls and encodes.

pub mod api;
pub mod capacity_index;
pub mod explain_route;
pub mod fit;
pub mod json_response;
pub mod metrics;
pub mod node_set;
pub mod node_table;
pub mod placement;
pub mod plain_args;
pub mod pod_view;
pub mod reservation_book;
pub mod reservation_journal;
pub mod score;
pub mod server;

pub use server::{Extender, ExtenderOptions};
