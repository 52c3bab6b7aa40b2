//! The driver liveness judgement: whether the driver *definitely does not run* on a node, the
//! only ground on which the rescheduler and the capacity clean-up may act and the extender may
//! reject a node. A pure function of what the stores show, plus how long they have shown it.

use std::collections::HashMap;
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

/// When this process saw each node's heartbeat Lease change, on its own monotonic clock.
///
/// A Lease's `renewTime` is written by the node's wall clock: a node whose clock runs 90 s
/// behind would look expired under a one-minute grace while it renews every few seconds. As
/// client-go's leader election does, a renewal is dated by when it was *observed* to change,
/// so only the controller's own clock measures its age; a Lease first seen is dated now (after a
/// restart a silent node is judged one duration and grace later, never earlier).
#[derive(Debug, Default)]
pub struct RenewalClock {
    seen: HashMap<String, Renewal>,
}

/// The latest renewal seen of one Lease, when it was seen, and the one before it.
#[derive(Debug)]
struct Renewal {
    latest: String,
    at: Instant,
    /// The cache and an uncached read may disagree for a while: seeing the previous value
    /// again is a stale read, not a renewal (else two readers alternating would keep a dead
    /// node fresh).
    previous: Option<String>,
}

impl RenewalClock {
    /// The heartbeat of `node` at `now`, whose Lease's latest renewal reads `renewal` (`None`:
    /// no Lease, or never renewed) and holds for `valid_for` (its duration plus the grace).
    pub fn heartbeat(
        &mut self,
        node: &str,
        renewal: Option<&str>,
        valid_for: Duration,
        now: Instant,
    ) -> HeartbeatState {
        let Some(renewal) = renewal else {
            self.seen.remove(node);
            return HeartbeatState::Expired;
        };
        let observed = match self.seen.get_mut(node) {
            Some(seen) if seen.latest == renewal || seen.previous.as_deref() == Some(renewal) => {
                seen.at
            }
            Some(seen) => {
                let previous = std::mem::replace(&mut seen.latest, renewal.to_string());
                seen.previous = Some(previous);
                seen.at = now;
                now
            }
            None => {
                self.seen.insert(
                    node.to_string(),
                    Renewal {
                        latest: renewal.to_string(),
                        at: now,
                        previous: None,
                    },
                );
                now
            }
        };
        if lease_expired(Some(observed), valid_for, now) {
            HeartbeatState::Expired
        } else {
            HeartbeatState::Fresh
        }
    }

    /// Forgets every node for which `keep` says no.
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.seen.retain(|node, _| keep(node));
    }

    /// How many nodes it remembers.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether it remembers none.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
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

    #[test]
    fn renewals_are_dated_when_observed_not_by_the_node_clock() {
        let t0 = Instant::now();
        let valid = Duration::from_secs(70);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut clock = RenewalClock::default();
        // A node 90 s behind writes renewTimes 90 s in the past; each change is fresh when seen.
        let behind = "2026-12-07T12:00:00Z";
        assert_eq!(clock.heartbeat("n", Some(behind), valid, at(0)), Fresh);
        assert_eq!(clock.heartbeat("n", Some(behind), valid, at(70)), Fresh);
        assert_eq!(
            clock.heartbeat("n", Some("2026-12-07T12:00:10Z"), valid, at(71)),
            Fresh,
            "renewed: dated now"
        );
        // No change for longer than the Lease's duration plus the grace: expired.
        assert_eq!(
            clock.heartbeat("n", Some("2026-12-07T12:00:10Z"), valid, at(141)),
            Fresh
        );
        assert_eq!(
            clock.heartbeat("n", Some("2026-12-07T12:00:10Z"), valid, at(142)),
            Expired
        );
        // A clock that goes backwards still renews: any new value is a renewal.
        assert_eq!(
            clock.heartbeat("n", Some("2026-12-07T11:00:00Z"), valid, at(143)),
            Fresh
        );
        // A stale read (the previous value again, from a lagging cache) is no renewal: two
        // readers alternating cannot keep a silent node fresh.
        let mut stale = RenewalClock::default();
        assert_eq!(stale.heartbeat("s", Some("r1"), valid, at(0)), Fresh);
        assert_eq!(stale.heartbeat("s", Some("r2"), valid, at(1)), Fresh);
        for t in [30, 60, 70] {
            assert_eq!(stale.heartbeat("s", Some("r1"), valid, at(t)), Fresh);
            assert_eq!(stale.heartbeat("s", Some("r2"), valid, at(t)), Fresh);
        }
        assert_eq!(stale.heartbeat("s", Some("r1"), valid, at(72)), Expired);
        assert_eq!(stale.heartbeat("s", Some("r2"), valid, at(72)), Expired);
        // No Lease, or never renewed: expired at once, and forgotten.
        assert_eq!(clock.heartbeat("n", None, valid, at(144)), Expired);
        assert!(clock.is_empty());
        // A Lease first seen long after its renewTime (a restarted controller) is dated now.
        assert_eq!(
            clock.heartbeat("m", Some("2020-01-01T00:00:00Z"), valid, at(200)),
            Fresh
        );
        assert_eq!(clock.len(), 1);
        clock.retain(|n| n != "m");
        assert!(clock.is_empty());
    }
}
