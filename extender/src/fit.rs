//! The pool-aware fit of one pod's pending PMEM volumes on one node.
//!
//! Two views of a node's free space are combined, and the smaller wins, so that staleness in
//! either is harmless:
//! - the *cap view*: `managed − allocated − reserved`, from the extender's own index and
//!   reservation book (fresh, but blind to fragmentation);
//! - the *pool view*: the per-pool free bytes the node last published (`free-extents`), into
//!   which the allocations and reservations that the publication does not yet reflect are placed
//!   first, then the pod's volumes, first-fit decreasing, as the node's allocator would.
//!
//! All arithmetic saturates or is checked: sizes come from user-written PVCs and node
//! annotations, and a `u64` overflow must read as "does not fit", never wrap or panic.

use std::cmp::Reverse;

use controllers::volume_cost::{VolumeOverhead, volume_cost};
use smallvec::SmallVec;

/// The reason for a node where the driver definitely does not run.
pub const NOT_RUNNING: &str = "PMEM driver not running";

/// What the extender knows about one node's PMEM.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeView {
    /// Free bytes per pool from the published `free-extents` annotation, in the node's order
    /// (largest first); one pool of `capacity` when the annotation is absent.
    pub pools: Vec<u64>,
    /// Bytes the driver manages on the node.
    pub managed: u64,
    /// Aligned bytes already allocated on the node per the index.
    pub allocated: u64,
    /// Bytes reserved on the node by other pods.
    pub reserved: u64,
    /// Sizes of allocations and other pods' reservations that the published pools do not yet
    /// reflect.
    pub unreflected: Vec<u64>,
    /// Volume sizes round up to a multiple of this; 0 or 1 means no rounding.
    pub alignment: u64,
    /// Metadata each volume keeps in its pool besides its data (charged to the pod's volumes;
    /// `unreflected` sizes come charged already).
    pub overhead: Option<VolumeOverhead>,
}

/// The pod fits on the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fit {
    /// Free bytes left after placing the pod: the smaller of the cap and the pool view.
    pub free_after: u64,
    /// For each demanded volume, in the order given, the index of the pool it lands in.
    pub placement: Vec<usize>,
}

/// The pod's volumes do not fit on the node. Carries only the pod's own numbers, so that the
/// reason is the same string on every node and kube-scheduler's event aggregates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", reason(self))]
pub struct Insufficient {
    /// How many volumes the pod demands.
    pub volumes: usize,
    /// Their total requested size, before alignment (alignment may differ per node, and the
    /// reason must not).
    pub bytes: u64,
}

/// Rounds `size` up to a multiple of `alignment` (0 or 1: unchanged); `None` on overflow.
pub fn align(size: u64, alignment: u64) -> Option<u64> {
    if alignment <= 1 {
        Some(size)
    } else {
        size.checked_next_multiple_of(alignment)
    }
}

/// What a pod's volume of `size` bytes takes from the node's pools: aligned, with the node's
/// per-volume overhead; `None` on overflow.
pub fn cost(size: u64, view: &NodeView) -> Option<u64> {
    volume_cost(size, view.alignment, view.overhead.as_ref())
}

/// The cap view: `managed − allocated − reserved`, never below zero.
pub fn cap(view: &NodeView) -> u64 {
    view.managed
        .saturating_sub(view.allocated)
        .saturating_sub(view.reserved)
}

/// Free capacity of the node before this pod: the smaller of the cap view and the pool view
/// after the unreflected items. Used for scoring and debug logs.
pub fn free(view: &NodeView) -> u64 {
    cap(view).min(pool_sum(&pools_after_unreflected(view)))
}

/// Whether `demand` (the pod's pending volume sizes in bytes) fits on the node, and how.
///
/// Zero volumes always fit. Every volume must be placed in a pool; an unreflected item that
/// fits nowhere is skipped instead, because then the published pools are the stale side.
pub fn fit(view: &NodeView, demand: &[u64]) -> Result<Fit, Insufficient> {
    fit_with(view, demand, true)
}

/// [`fit`] without the placement: only `free_after`. The extender's /filter asks this for
/// thousands of nodes per call, so it allocates nothing for the usual handful of pools.
pub fn free_after(view: &NodeView, demand: &[u64]) -> Result<u64, Insufficient> {
    match demand {
        // The usual pod, on the usual node: no vectors to build or sort at all.
        [size] if view.unreflected.is_empty() => one_free_after(view, *size),
        _ => fit_with(view, demand, false).map(|f| f.free_after),
    }
}

/// [`free_after`] of one volume on a node without unreflected items, in one pass over the
/// pools; the same answer as the general path, overflow cases included.
fn one_free_after(view: &NodeView, size: u64) -> Result<u64, Insufficient> {
    one_volume_free_after(
        &view.pools,
        cap(view),
        view.alignment,
        view.overhead.as_ref(),
        size,
    )
}

/// [`free_after`] of one volume of `size` bytes on a node without unreflected items, from the
/// parts of its [`NodeView`] (`cap` as [`cap`] computes it), for callers that have them at hand
/// without building a view: the extender's /filter on a node with nothing allocated or reserved.
#[inline]
pub fn one_volume_free_after(
    pools: &[u64],
    cap: u64,
    alignment: u64,
    overhead: Option<&VolumeOverhead>,
    size: u64,
) -> Result<u64, Insufficient> {
    let insufficient = Insufficient {
        volumes: 1,
        bytes: size,
    };
    let aligned = volume_cost(size, alignment, overhead).ok_or(insufficient)?;
    let cap_after = cap.checked_sub(aligned).ok_or(insufficient)?;
    let mut placed = false;
    let mut pools_after = 0u64;
    for pool in pools {
        let left = if !placed && *pool >= aligned {
            placed = true;
            pool - aligned
        } else {
            *pool
        };
        pools_after = pools_after.saturating_add(left);
    }
    if placed {
        Ok(cap_after.min(pools_after))
    } else {
        Err(insufficient)
    }
}

type Small<T> = SmallVec<[T; 8]>;

fn fit_with(view: &NodeView, demand: &[u64], record: bool) -> Result<Fit, Insufficient> {
    let insufficient = Insufficient {
        volumes: demand.len(),
        bytes: demand.iter().fold(0, |sum: u64, s| sum.saturating_add(*s)),
    };
    let aligned: Small<u64> = demand
        .iter()
        .map(|s| cost(*s, view))
        .collect::<Option<_>>()
        .ok_or(insufficient)?;
    let total = aligned
        .iter()
        .try_fold(0u64, |sum, s| sum.checked_add(*s))
        .ok_or(insufficient)?;
    let cap_after = cap(view).checked_sub(total).ok_or(insufficient)?;

    let mut pools = pools_after_unreflected(view);
    let mut order: Small<usize> = (0..aligned.len()).collect();
    // Stable sort: equal sizes keep their order, so the placement is deterministic.
    order.sort_by_key(|i| Reverse(aligned.get(*i).copied().unwrap_or_default()));
    let mut placement = if record {
        vec![0; aligned.len()]
    } else {
        Vec::new()
    };
    for i in order {
        let size = aligned.get(i).copied().unwrap_or_default();
        let pool = place(&mut pools, size).ok_or(insufficient)?;
        if let Some(slot) = placement.get_mut(i) {
            *slot = pool;
        }
    }
    Ok(Fit {
        free_after: cap_after.min(pool_sum(&pools)),
        placement,
    })
}

/// The stable rejection reason, e.g. "insufficient PMEM for 2 volumes (3.0GiB)".
pub fn reason(insufficient: &Insufficient) -> String {
    let noun = if insufficient.volumes == 1 {
        "volume"
    } else {
        "volumes"
    };
    format!(
        "insufficient PMEM for {} {noun} ({})",
        insufficient.volumes,
        format_bytes(insufficient.bytes)
    )
}

/// Formats bytes in binary units with one decimal ("512.0MiB"); below 1 KiB as plain bytes.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes}B");
    }
    // Bytes beyond f64's 53-bit mantissa lose precision far below the one printed decimal.
    #[allow(clippy::cast_precision_loss)]
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    // 1023.95 would print as "1024.0"; move to the next unit instead.
    while value >= 1023.95 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1}{}", UNITS.get(unit).copied().unwrap_or("EiB"))
}

fn pools_after_unreflected(view: &NodeView) -> Small<u64> {
    let mut pools: Small<u64> = view.pools.iter().copied().collect();
    let mut items: Small<u64> = view
        .unreflected
        .iter()
        .map(|s| align(*s, view.alignment).unwrap_or(u64::MAX))
        .collect();
    items.sort_unstable_by_key(|s| Reverse(*s));
    for size in items {
        // No room anywhere means the publication already reflects it (or is otherwise stale);
        // the cap view still counts it.
        let _ = place(&mut pools, size);
    }
    pools
}

/// First fit: the first pool with room takes the item.
fn place(pools: &mut [u64], size: u64) -> Option<usize> {
    let (index, pool) = pools.iter_mut().enumerate().find(|(_, p)| **p >= size)?;
    *pool -= size;
    Some(index)
}

fn pool_sum(pools: &[u64]) -> u64 {
    pools.iter().fold(0, |sum: u64, p| sum.saturating_add(*p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MI: u64 = 1 << 20;
    const GI: u64 = 1 << 30;

    fn view(pools: &[u64], managed: u64) -> NodeView {
        NodeView {
            pools: pools.to_vec(),
            managed,
            ..NodeView::default()
        }
    }

    fn ok(free_after: u64, placement: &[usize]) -> Result<Fit, Insufficient> {
        Ok(Fit {
            free_after,
            placement: placement.to_vec(),
        })
    }

    fn no(demand: &[u64]) -> Result<Fit, Insufficient> {
        Err(Insufficient {
            volumes: demand.len(),
            bytes: demand.iter().fold(0, |s: u64, d| s.saturating_add(*d)),
        })
    }

    type Case = (&'static str, NodeView, Vec<u64>, Result<Fit, Insufficient>);

    #[test]
    fn fit_table() {
        let max = u64::MAX;
        let cases: Vec<Case> = vec![
            (
                "zero demand fits",
                view(&[4 * GI], 4 * GI),
                vec![],
                ok(4 * GI, &[]),
            ),
            (
                "zero demand fits a full node",
                view(&[], 0),
                vec![],
                ok(0, &[]),
            ),
            (
                "one volume in one pool",
                view(&[4 * GI], 4 * GI),
                vec![GI],
                ok(3 * GI, &[0]),
            ),
            (
                "exact fit",
                view(&[4 * GI], 4 * GI),
                vec![4 * GI],
                ok(0, &[0]),
            ),
            (
                "fits in sum but not in one pool",
                view(&[2 * GI, 2 * GI], 4 * GI),
                vec![3 * GI],
                no(&[3 * GI]),
            ),
            (
                "two volumes only in two pools",
                view(&[2 * GI, 2 * GI], 4 * GI),
                vec![2 * GI, 2 * GI],
                ok(0, &[0, 1]),
            ),
            (
                "decreasing order matters",
                view(&[3 * GI, 2 * GI], 5 * GI),
                vec![GI, 2 * GI, 2 * GI],
                // 2G→pool0, 2G→pool1 (pool0 has 1G left), 1G→pool0.
                ok(0, &[0, 0, 1]),
            ),
            (
                "cap smaller than pools",
                NodeView {
                    allocated: 3 * GI,
                    ..view(&[4 * GI], 4 * GI)
                },
                vec![2 * GI],
                no(&[2 * GI]),
            ),
            (
                "stale pools larger than cap",
                NodeView {
                    allocated: GI,
                    ..view(&[8 * GI], 4 * GI)
                },
                vec![2 * GI],
                ok(GI, &[0]),
            ),
            (
                "reservations lower the cap",
                NodeView {
                    reserved: 2 * GI,
                    ..view(&[4 * GI], 4 * GI)
                },
                vec![3 * GI],
                no(&[3 * GI]),
            ),
            (
                "reserved plus allocated beyond managed",
                NodeView {
                    allocated: 3 * GI,
                    reserved: 3 * GI,
                    ..view(&[4 * GI], 4 * GI)
                },
                vec![1],
                no(&[1]),
            ),
            ("no pools", view(&[], 4 * GI), vec![GI], no(&[GI])),
            ("empty pools", view(&[0, 0], 4 * GI), vec![GI], no(&[GI])),
            (
                "zero-size volume needs a pool",
                view(&[], 4 * GI),
                vec![0],
                no(&[0]),
            ),
            (
                "zero-size volume in an empty pool",
                view(&[0], 0),
                vec![0],
                ok(0, &[0]),
            ),
            (
                "alignment rounds up",
                NodeView {
                    alignment: GI,
                    ..view(&[2 * GI], 2 * GI)
                },
                vec![GI + 1],
                ok(0, &[0]),
            ),
            (
                "alignment makes it not fit",
                NodeView {
                    alignment: GI,
                    ..view(&[2 * GI, 2 * GI], 4 * GI)
                },
                vec![GI + 1, GI + 1, GI + 1],
                no(&[GI + 1, GI + 1, GI + 1]),
            ),
            (
                "alignment 1 is none",
                NodeView {
                    alignment: 1,
                    ..view(&[GI], GI)
                },
                vec![GI],
                ok(0, &[0]),
            ),
            (
                "unreflected item consumes a pool",
                NodeView {
                    unreflected: vec![3 * GI],
                    ..view(&[4 * GI, 2 * GI], 8 * GI)
                },
                vec![2 * GI],
                ok(GI, &[1]),
            ),
            (
                "unreflected items leave no pool big enough",
                NodeView {
                    unreflected: vec![3 * GI, GI],
                    ..view(&[4 * GI, 2 * GI], 8 * GI)
                },
                vec![2 * GI + 1],
                no(&[2 * GI + 1]),
            ),
            (
                "unreflected item fitting nowhere is skipped",
                NodeView {
                    unreflected: vec![16 * GI],
                    ..view(&[4 * GI], 32 * GI)
                },
                vec![4 * GI],
                ok(0, &[0]),
            ),
            (
                "unreflected are aligned",
                NodeView {
                    alignment: GI,
                    unreflected: vec![1],
                    ..view(&[2 * GI], 2 * GI)
                },
                vec![2 * GI],
                no(&[2 * GI]),
            ),
            (
                "huge demand",
                view(&[max], max),
                vec![max, max],
                no(&[max, max]),
            ),
            (
                "demand sum overflows",
                view(&[max, max], max),
                vec![max, 1],
                no(&[max, 1]),
            ),
            (
                "alignment overflows",
                NodeView {
                    alignment: GI,
                    ..view(&[max], max)
                },
                vec![max - 1],
                no(&[max - 1]),
            ),
            (
                "huge pools sum saturates",
                view(&[max, max], max),
                vec![1],
                ok(max - 1, &[0]),
            ),
            (
                "huge unreflected",
                NodeView {
                    unreflected: vec![max, max],
                    ..view(&[max], max)
                },
                vec![1],
                no(&[1]),
            ),
        ];
        for (name, view, demand, want) in cases {
            assert_eq!(fit(&view, &demand), want, "{name}");
        }
    }

    #[test]
    fn free_table() {
        for (name, view, want) in [
            ("pools", view(&[2 * GI, GI], 4 * GI), 3 * GI),
            (
                "cap",
                NodeView {
                    allocated: 3 * GI,
                    ..view(&[2 * GI, GI], 4 * GI)
                },
                GI,
            ),
            (
                "unreflected",
                NodeView {
                    unreflected: vec![GI],
                    ..view(&[2 * GI, GI], 4 * GI)
                },
                2 * GI,
            ),
            ("nothing", view(&[], 0), 0),
            (
                "saturating",
                view(&[u64::MAX, u64::MAX], u64::MAX),
                u64::MAX,
            ),
        ] {
            assert_eq!(free(&view), want, "{name}");
        }
    }

    #[test]
    fn reason_table() {
        for (volumes, bytes, want) in [
            (2, 3 * GI, "insufficient PMEM for 2 volumes (3.0GiB)"),
            (1, 512 * MI, "insufficient PMEM for 1 volume (512.0MiB)"),
            (1, 1536 * MI, "insufficient PMEM for 1 volume (1.5GiB)"),
            (3, 100, "insufficient PMEM for 3 volumes (100B)"),
            (1, 1024, "insufficient PMEM for 1 volume (1.0KiB)"),
            (1, GI - 1, "insufficient PMEM for 1 volume (1.0GiB)"),
            (
                1,
                GI - 60 * (1 << 10),
                "insufficient PMEM for 1 volume (1023.9MiB)",
            ),
            (1, u64::MAX, "insufficient PMEM for 1 volume (16.0EiB)"),
        ] {
            assert_eq!(reason(&Insufficient { volumes, bytes }), want);
            assert_eq!(Insufficient { volumes, bytes }.to_string(), want);
        }
    }

    /// A node whose volumes keep metadata in the pool (direct mode's fsdax namespaces) is
    /// charged data + metadata, aligned: two halves of a 1 GiB region fit only if their
    /// metadata does too.
    #[test]
    fn volumes_are_charged_their_overhead() {
        let region = NodeView {
            alignment: 16 * MI,
            overhead: Some(VolumeOverhead::FSDAX_MAP_DEV),
            ..view(&[1024 * MI, 512 * MI], 1536 * MI)
        };
        assert_eq!(cost(504 * MI, &region), Some(512 * MI));
        assert_eq!(cost(505 * MI, &region), Some(528 * MI));
        assert_eq!(fit(&region, &[504 * MI, 504 * MI]), ok(512 * MI, &[0, 0]));
        assert_eq!(fit(&region, &[504 * MI; 3]), ok(0, &[0, 0, 1]));
        assert_eq!(
            fit(&region, &[505 * MI, 504 * MI, 504 * MI]),
            no(&[505 * MI, 504 * MI, 504 * MI])
        );
        assert_eq!(free_after(&region, &[1008 * MI]), Ok(512 * MI));
        assert!(free_after(&region, &[1009 * MI]).is_err());
        // Unreflected sizes arrive charged: they are not charged again.
        let charged = NodeView {
            unreflected: vec![512 * MI],
            ..region.clone()
        };
        assert_eq!(fit(&charged, &[504 * MI, 504 * MI]), ok(0, &[0, 1]));
    }

    #[test]
    fn reason_does_not_depend_on_the_node() {
        let demand = [GI + 1, GI];
        let a = fit(
            &NodeView {
                alignment: GI,
                ..view(&[GI], GI)
            },
            &demand,
        );
        let b = fit(&view(&[], 0), &demand);
        assert_eq!(a.map_err(|e| reason(&e)), b.map_err(|e| reason(&e)));
    }

    fn arb_view() -> impl Strategy<Value = NodeView> {
        let size = prop_oneof![
            0..64u64,
            0..(64 * GI),
            Just(u64::MAX),
            (u64::MAX - 8)..=u64::MAX
        ];
        (
            prop::collection::vec(size.clone(), 0..5),
            size.clone(),
            0..(64 * GI),
            0..(64 * GI),
            prop::collection::vec(size, 0..5),
            prop_oneof![Just(0u64), Just(1), Just(4096), Just(2 * MI), Just(GI)],
            prop_oneof![Just(None), Just(Some(VolumeOverhead::FSDAX_MAP_DEV))],
        )
            .prop_map(
                |(pools, managed, allocated, reserved, unreflected, alignment, overhead)| {
                    NodeView {
                        pools,
                        managed,
                        allocated,
                        reserved,
                        unreflected,
                        alignment,
                        overhead,
                    }
                },
            )
    }

    proptest! {
        #[test]
        fn placement_is_a_valid_packing(
            view in arb_view(),
            demand in prop::collection::vec(prop_oneof![0..(16 * GI), Just(u64::MAX)], 0..6),
        ) {
            if let Ok(fit) = fit(&view, &demand) {
                prop_assert_eq!(fit.placement.len(), demand.len());
                let mut placed = vec![0u128; view.pools.len()];
                let mut total = 0u128;
                for (size, pool) in demand.iter().zip(&fit.placement) {
                    let aligned = u128::from(cost(*size, &view).expect("test value"));
                    prop_assert!(*pool < view.pools.len());
                    placed[*pool] += aligned;
                    total += aligned;
                }
                for (free, placed) in view.pools.iter().zip(&placed) {
                    prop_assert!(*placed <= u128::from(*free), "pool overfilled: {placed} > {free}");
                }
                prop_assert!(total <= u128::from(cap(&view)));
                prop_assert!(u128::from(fit.free_after) + total <= u128::from(cap(&view)));
                prop_assert!(fit.free_after <= free(&view));
            } else {
                prop_assert!(!demand.is_empty());
            }
        }

        #[test]
        fn one_volume_shortcut_agrees_with_the_general_fit(
            view in arb_view(),
            size in prop_oneof![0..(16 * GI), (u64::MAX - 8 * GI)..=u64::MAX],
        ) {
            let view = NodeView { unreflected: Vec::new(), ..view };
            prop_assert_eq!(
                one_free_after(&view, size),
                fit_with(&view, &[size], false).map(|f| f.free_after)
            );
        }
    }
}
