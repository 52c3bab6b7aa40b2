//! The driver liveness judgement: whether the driver *definitely does not run* on a node, the
//! only ground on which the rescheduler and the capacity clean-up may act and the extender may
//! reject a node. A pure function of what the stores show, plus how long they have shown it.

use std::time::{Duration, Instant};

/// What the CSINode object of a node says about the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CsiNodeState {
    /// No CSINode object.
    Missing,
    /// The CSINode lists the driver.
    WithDriver,
    /// The CSINode exists without the driver.
    WithoutDriver,
}

/// What the node's heartbeat Lease says (only consulted with `--heartbeat-grace`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeartbeatState {
    /// Heartbeats are not used.
    NotUsed,
    /// Renewed within its duration.
    Fresh,
    /// Not renewed within its duration, or no Lease at all.
    Expired,
}

/// What the stores show about one node at one instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeObservation {
    /// The Node object exists.
    pub node_exists: bool,
    /// Its labels match `--node-selector`.
    pub labels_match: bool,
    /// Its CSINode.
    pub csinode: CsiNodeState,
    /// Its heartbeat.
    pub heartbeat: HeartbeatState,
}

/// Why the driver does not run on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DriverlessReason {
    /// The Node object is gone.
    NodeMissing,
    /// The node does not match the selector and its CSINode does not list the driver.
    NotSelectedNoCsiNodeEntry,
    /// The driver's heartbeat Lease has expired.
    HeartbeatExpired,
}

impl DriverlessReason {
    /// A stable label value and message fragment.
    pub fn as_str(self) -> &'static str {
        match self {
            DriverlessReason::NodeMissing => "node-missing",
            DriverlessReason::NotSelectedNoCsiNodeEntry => "not-selected-no-csinode-entry",
            DriverlessReason::HeartbeatExpired => "heartbeat-expired",
        }
    }
}

/// Whether the driver does not run on the node at this instant.
///
/// Both halves of the selector rule are needed: a node that still matches the selector may be
/// about to start the driver, and a CSINode entry may outlive the label for a moment during
/// an uninstall; acting on either alone could let two nodes provision one claim.
pub fn driverless_now(o: &NodeObservation) -> Option<DriverlessReason> {
    if !o.node_exists {
        return Some(DriverlessReason::NodeMissing);
    }
    if !o.labels_match && o.csinode != CsiNodeState::WithDriver {
        return Some(DriverlessReason::NotSelectedNoCsiNodeEntry);
    }
    if o.heartbeat == HeartbeatState::Expired {
        return Some(DriverlessReason::HeartbeatExpired);
    }
    None
}

/// The judgement about one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// The driver may run there.
    MayRun,
    /// Driverless, but not yet for the whole grace period; judge again after `remaining`.
    Suspect {
        /// Why.
        reason: DriverlessReason,
        /// Time left until the grace has passed.
        remaining: Duration,
    },
    /// Driverless continuously for at least the grace period.
    DefinitelyNotRunning(DriverlessReason),
}

/// Judges a node from its observation now and since when it has been driverless (`since`,
/// as remembered from earlier judgements); returns the judgement and the new `since`.
pub fn judge(
    observation: &NodeObservation,
    since: Option<Instant>,
    now: Instant,
    grace: Duration,
) -> (Liveness, Option<Instant>) {
    let Some(reason) = driverless_now(observation) else {
        return (Liveness::MayRun, None);
    };
    let since = since.unwrap_or(now);
    let elapsed = now.saturating_duration_since(since);
    if elapsed >= grace {
        (Liveness::DefinitelyNotRunning(reason), Some(since))
    } else {
        (
            Liveness::Suspect {
                reason,
                remaining: grace - elapsed,
            },
            Some(since),
        )
    }
}

/// Whether a Lease renewed at `renewed` for `duration` has expired at `now` (`None`: no Lease
/// or never renewed).
pub fn lease_expired(renewed: Option<Instant>, duration: Duration, now: Instant) -> bool {
    match renewed {
        Some(renewed) => now.saturating_duration_since(renewed) > duration,
        None => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use CsiNodeState::*;
    use DriverlessReason::*;
    use HeartbeatState::*;

    fn obs(
        node_exists: bool,
        labels_match: bool,
        csinode: CsiNodeState,
        heartbeat: HeartbeatState,
    ) -> NodeObservation {
        NodeObservation {
            node_exists,
            labels_match,
            csinode,
            heartbeat,
        }
    }

    #[test]
    fn driverless_now_every_combination() {
        for node_exists in [false, true] {
            for labels_match in [false, true] {
                for csinode in [Missing, WithDriver, WithoutDriver] {
                    for heartbeat in [NotUsed, Fresh, Expired] {
                        let o = obs(node_exists, labels_match, csinode, heartbeat);
                        let want = if !node_exists {
                            Some(NodeMissing)
                        } else if !labels_match && csinode != WithDriver {
                            Some(NotSelectedNoCsiNodeEntry)
                        } else if heartbeat == Expired {
                            Some(HeartbeatExpired)
                        } else {
                            None
                        };
                        assert_eq!(driverless_now(&o), want, "{o:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn driverless_now_named_cases() {
        for (name, o, want) in [
            (
                "node deleted",
                obs(false, true, WithDriver, Fresh),
                Some(NodeMissing),
            ),
            (
                "labels match, no CSINode: driver may be starting",
                obs(true, true, Missing, NotUsed),
                None,
            ),
            (
                "CSINode lists the driver, labels gone: may be uninstalling",
                obs(true, false, WithDriver, NotUsed),
                None,
            ),
            (
                "neither",
                obs(true, false, WithoutDriver, NotUsed),
                Some(NotSelectedNoCsiNodeEntry),
            ),
            (
                "CSINode missing, labels gone",
                obs(true, false, Missing, NotUsed),
                Some(NotSelectedNoCsiNodeEntry),
            ),
            (
                "heartbeat expired on a selected node",
                obs(true, true, WithDriver, Expired),
                Some(HeartbeatExpired),
            ),
            ("heartbeat fresh", obs(true, true, WithDriver, Fresh), None),
        ] {
            assert_eq!(driverless_now(&o), want, "{name}");
        }
    }

    #[test]
    fn judge_needs_the_whole_grace_continuously() {
        let grace = Duration::from_secs(30);
        let t0 = Instant::now();
        let bad = obs(false, false, Missing, NotUsed);
        let good = obs(true, true, WithDriver, Fresh);
        let (l, since) = judge(&bad, None, t0, grace);
        assert_eq!(
            l,
            Liveness::Suspect {
                reason: NodeMissing,
                remaining: grace
            }
        );
        let (l, since) = judge(&bad, since, t0 + Duration::from_secs(29), grace);
        assert_eq!(
            l,
            Liveness::Suspect {
                reason: NodeMissing,
                remaining: Duration::from_secs(1)
            }
        );
        let (l, since2) = judge(&bad, since, t0 + grace, grace);
        assert_eq!(l, Liveness::DefinitelyNotRunning(NodeMissing));
        assert_eq!(since2, Some(t0));
        // Recovery resets the clock.
        let (l, since) = judge(&good, since2, t0 + Duration::from_secs(31), grace);
        assert_eq!((l, since), (Liveness::MayRun, None));
        let (l, _) = judge(&bad, since, t0 + Duration::from_secs(32), grace);
        assert!(matches!(l, Liveness::Suspect { .. }), "{l:?}");
        // A zero grace judges at once.
        assert_eq!(
            judge(&bad, None, t0, Duration::ZERO).0,
            Liveness::DefinitelyNotRunning(NodeMissing)
        );
    }

    #[test]
    fn lease_expiry() {
        let t0 = Instant::now();
        let d = Duration::from_secs(10);
        assert!(!lease_expired(Some(t0), d, t0 + d));
        assert!(lease_expired(
            Some(t0),
            d,
            t0 + d + Duration::from_millis(1)
        ));
        assert!(lease_expired(None, d, t0));
    }
}
