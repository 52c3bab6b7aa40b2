//! The pmem-csi node driver: CSI Identity, node-local Controller and Node services over a Unix
//! socket, the device backends, and crash-safe node state in PMEM-CSI 1.0's format.

pub mod backend;
pub mod emulated;
pub mod error;
pub mod fake;
pub mod faults;
pub mod filesystem;
pub mod loopdev;
pub mod mounts;
pub mod parameters;
pub mod quantity;
pub mod state;
pub mod volume_id;
pub mod volumes;
