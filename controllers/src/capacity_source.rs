//! What the capacity publisher needs from the node driver: this node's capacity per pool, and
//! a signal after every change. Defined here, implemented by the `driver` crate, so that the
//! publisher never depends on the driver's internals.

use tokio::sync::watch;

/// Room in one pool (an LVM volume group, a PMEM region; emulated and fake have one).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolCapacity {
    /// Pool name.
    pub name: String,
    /// Bytes the driver manages in this pool.
    pub managed: u64,
    /// Bytes free for new volumes.
    pub free: u64,
    /// Largest volume that fits in this pool.
    pub largest: u64,
}

/// A node's capacity as the publisher writes it into CSIStorageCapacity objects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeCapacity {
    /// Per pool, largest free first.
    pub pools: Vec<PoolCapacity>,
    /// All PMEM of the node, managed or not.
    pub total: u64,
    /// Volume sizes are multiples of this.
    pub alignment: u64,
    /// Metadata each volume keeps beside its data in the pool (`free` counts it; `largest` is
    /// the largest volume's data).
    pub overhead: Option<crate::VolumeOverhead>,
}

impl NodeCapacity {
    /// Free bytes over all pools (`capacity`).
    pub fn available(&self) -> u64 {
        self.pools.iter().map(|p| p.free).sum()
    }

    /// The largest volume that fits (`maximumVolumeSize`).
    pub fn maximum_volume_size(&self) -> u64 {
        self.pools.iter().map(|p| p.largest).max().unwrap_or(0)
    }

    /// Managed bytes over all pools.
    pub fn managed(&self) -> u64 {
        self.pools.iter().map(|p| p.managed).sum()
    }
}

/// A source of this node's capacity.
pub trait CapacitySource: Send + Sync + 'static {
    /// The error reading capacity can fail with.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The current capacity.
    fn capacity(&self) -> Result<NodeCapacity, Self::Error>;

    /// A receiver whose value changes after every create and delete.
    fn changes(&self) -> watch::Receiver<u64>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_values() {
        let c = NodeCapacity {
            pools: vec![
                PoolCapacity {
                    name: "a".into(),
                    managed: 10,
                    free: 6,
                    largest: 4,
                },
                PoolCapacity {
                    name: "b".into(),
                    managed: 10,
                    free: 2,
                    largest: 2,
                },
            ],
            total: 30,
            alignment: 2,
            overhead: None,
        };
        assert_eq!(
            (c.available(), c.maximum_volume_size(), c.managed()),
            (8, 4, 20)
        );
        assert_eq!(NodeCapacity::default().maximum_volume_size(), 0);
    }
}
