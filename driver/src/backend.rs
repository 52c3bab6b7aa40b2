//! The device backends behind one trait: where a volume's bytes live, how much room is left per
//! pool, and how a volume becomes a block device for staging.

use std::path::PathBuf;

use crate::parameters::Usage;

pub use crate::device_mode::DeviceMode;

/// Room in one pool (an LVM volume group, a PMEM region; emulated and fake have one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    /// Pool name.
    pub name: String,
    /// Bytes managed by the driver in this pool.
    pub managed: u64,
    /// Bytes not yet allocated to volumes.
    pub free: u64,
    /// Largest volume that fits in this pool (aligned down).
    pub largest: u64,
}

/// Capacity of a node, derived from its pools.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Capacity {
    /// Per pool, largest free first.
    pub pools: Vec<Pool>,
    /// All PMEM of the node, including what the driver does not manage.
    pub total: u64,
}

impl Capacity {
    /// Builds the capacity view, sorting pools by free space, largest first.
    pub fn new(mut pools: Vec<Pool>, total: u64) -> Self {
        pools.sort_by(|a, b| b.free.cmp(&a.free).then_with(|| a.name.cmp(&b.name)));
        Self { pools, total }
    }

    /// Sum of free bytes.
    pub fn available(&self) -> u64 {
        self.pools.iter().map(|p| p.free).sum()
    }

    /// The largest volume that can be created.
    pub fn max_volume_size(&self) -> u64 {
        self.pools.iter().map(|p| p.largest).max().unwrap_or(0)
    }

    /// Sum of managed bytes.
    pub fn managed(&self) -> u64 {
        self.pools.iter().map(|p| p.managed).sum()
    }

    /// What the capacity publisher writes for a node whose backend has `alignment` and
    /// `overhead`.
    pub fn into_node_capacity(
        self,
        alignment: u64,
        overhead: Option<controllers::VolumeOverhead>,
    ) -> controllers::NodeCapacity {
        controllers::NodeCapacity {
            pools: self
                .pools
                .into_iter()
                .map(|p| controllers::PoolCapacity {
                    name: p.name,
                    managed: p.managed,
                    free: p.free,
                    largest: p.largest,
                })
                .collect(),
            total: self.total,
            alignment,
            overhead,
        }
    }
}

/// Backend failures, mapped to gRPC codes at the CSI boundary.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// Not enough room.
    #[error(
        "not enough space for {need} bytes: largest free extent is {largest} bytes, {free} bytes free in total"
    )]
    NoSpace {
        /// Requested bytes (aligned).
        need: u64,
        /// Largest volume that fits.
        largest: u64,
        /// Free bytes in total.
        free: u64,
    },
    /// The volume's device is mounted or open elsewhere.
    #[error("device {device} of volume {id} is in use")]
    InUse {
        /// Volume ID.
        id: String,
        /// Device.
        device: String,
    },
    /// Volumes of this mode cannot grow.
    #[error("volumes in device mode {mode} cannot grow: {reason}")]
    CannotGrow {
        /// The mode.
        mode: &'static str,
        /// Why not.
        reason: &'static str,
    },
    /// The backend has no block devices.
    #[error("device mode {mode} has no block devices: volumes cannot be staged or published")]
    NoDevices {
        /// The mode.
        mode: &'static str,
    },
    /// A program the backend runs is not installed.
    #[error("{op} {what}: {source}")]
    Missing {
        /// What was being done.
        op: &'static str,
        /// On what.
        what: String,
        /// The program and its package.
        source: crate::program::MissingProgram,
    },
    /// A tool did not finish within `--tool-timeout` and was killed.
    #[error("{op} {what}: {source}")]
    TimedOut {
        /// What was being done.
        op: &'static str,
        /// On what.
        what: String,
        /// The command and the timeout.
        source: Box<crate::tool::ToolError>,
    },
    /// A system call or tool failed.
    #[error("{op} {what}: {reason}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On what.
        what: String,
        /// Why.
        reason: String,
    },
}

impl BackendError {
    /// A failed tool run: a missing program stays recognisable (`FailedPrecondition`), any
    /// other failure is I/O.
    pub fn tool(op: &'static str, what: impl std::fmt::Display, e: crate::tool::ToolError) -> Self {
        match e {
            crate::tool::ToolError::Missing(source) => BackendError::Missing {
                op,
                what: what.to_string(),
                source,
            },
            e @ crate::tool::ToolError::TimedOut { .. } => BackendError::TimedOut {
                op,
                what: what.to_string(),
                source: Box::new(e),
            },
            e => BackendError::io(op, what, e),
        }
    }

    /// An I/O failure.
    pub fn io(
        op: &'static str,
        what: impl std::fmt::Display,
        reason: impl std::fmt::Display,
    ) -> Self {
        BackendError::Io {
            op,
            what: what.to_string(),
            reason: reason.to_string(),
        }
    }
}

/// A place volumes live in. Calls may block (file and device I/O); callers run them off the
/// async executor and serialize calls per volume.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// The mode, recorded per volume.
    fn mode(&self) -> DeviceMode;
    /// Sizes are multiples of this.
    fn alignment(&self) -> u64;
    /// Current capacity.
    fn capacity(&self) -> Result<Capacity, BackendError>;
    /// Creates volume `id` of `size` bytes (already aligned) for `usage` (the direct mode picks
    /// the namespace mode by it); an existing volume of that size (left by a crash) is accepted.
    fn create(&self, id: &str, size: u64, usage: Usage) -> Result<(), BackendError>;
    /// Deletes volume `id`, scrubbing it first if `erase`; a missing volume is not an error.
    fn delete(&self, id: &str, erase: bool) -> Result<(), BackendError>;
    /// The size of volume `id` if it exists.
    fn size_of(&self, id: &str) -> Result<Option<u64>, BackendError>;
    /// Grows volume `id` to `size` bytes (already aligned) within its pool, all or nothing: the
    /// room is checked before anything changes, and a failed growth leaves the old size. A
    /// volume already that large is not an error. An attached device shows the new size on
    /// return.
    fn grow(&self, id: &str, size: u64) -> Result<(), BackendError> {
        let _ = (id, size);
        Err(BackendError::CannotGrow {
            mode: self.mode().as_str(),
            reason: self
                .growth_refused()
                .unwrap_or("the mode does not support it"),
        })
    }
    /// Why volumes of this mode cannot grow; `None` when [`Backend::grow`] grows them (the
    /// node then offers NodeExpandVolume).
    fn growth_refused(&self) -> Option<&'static str> {
        Some("the mode does not support it")
    }
    /// IDs of every volume the backend holds.
    fn list(&self) -> Result<Vec<String>, BackendError>;
    /// A block device for volume `id`, attaching one if needed (idempotent).
    fn attach(&self, id: &str) -> Result<PathBuf, BackendError>;
    /// The block device of volume `id` if one is attached.
    fn attached(&self, id: &str) -> Result<Option<PathBuf>, BackendError>;
    /// Releases the block device of volume `id` if one is attached and unused.
    fn detach(&self, id: &str) -> Result<(), BackendError>;
    /// Metadata each volume keeps in its pool besides its data (published, so that the
    /// extender charges it); `None` where a volume takes exactly its aligned size.
    fn overhead(&self) -> Option<controllers::VolumeOverhead> {
        None
    }
    /// Whether a create can be cut short by a crash, leaving a volume smaller than asked for
    /// that start-up repair must complete. Not so for `lvcreate` and `ndctl create-namespace`,
    /// whose volumes exist whole or not at all, and may be smaller than recorded when PMEM-CSI
    /// 1.0 created them (direct mode: its issue #933).
    fn partial_creates(&self) -> bool {
        false
    }
    /// Adopts volume `id` of `size` bytes known only from node state (backends without
    /// persistent devices); returns false if the backend cannot adopt volumes.
    fn adopt(&self, _id: &str, _size: u64) -> bool {
        false
    }
    /// Detaches devices of this backend's volumes that `recorded` (this node's state index)
    /// knows and no mount holds (left by a crash between attach and mount, or between unmount
    /// and detach); returns what it released, for the repair log.
    fn release_unused(
        &self,
        _recorded: &dyn Fn(&str) -> bool,
    ) -> Result<Vec<String>, BackendError> {
        Ok(Vec::new())
    }
}

/// Rounds `size` up to a multiple of `alignment`; `None` on overflow.
pub fn align_up(size: u64, alignment: u64) -> Option<u64> {
    if alignment == 0 {
        return Some(size);
    }
    size.checked_add(alignment - 1)
        .map(|s| s / alignment * alignment)
}

/// Rounds `size` down to a multiple of `alignment`.
pub fn align_down(size: u64, alignment: u64) -> u64 {
    size.checked_div(alignment).map_or(size, |n| n * alignment)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn align_table() {
        const A: u64 = 4 << 20;
        for (size, up, down) in [
            (0, Some(0), 0),
            (1, Some(A), 0),
            (A, Some(A), A),
            (A + 1, Some(2 * A), A),
            (u64::MAX, None, u64::MAX / A * A),
        ] {
            assert_eq!(align_up(size, A), up, "{size}");
            assert_eq!(align_down(size, A), down, "{size}");
        }
    }

    #[test]
    fn capacity_derivations() {
        let c = Capacity::new(
            vec![
                Pool {
                    name: "b".into(),
                    managed: 10,
                    free: 2,
                    largest: 2,
                },
                Pool {
                    name: "a".into(),
                    managed: 10,
                    free: 6,
                    largest: 4,
                },
            ],
            30,
        );
        assert_eq!(c.pools[0].name, "a", "largest free first");
        assert_eq!(
            (c.available(), c.max_volume_size(), c.managed(), c.total),
            (8, 4, 20, 30)
        );
        assert_eq!(Capacity::default().max_volume_size(), 0);
    }
}
