//! The PVC rescheduler's decision: remove `volume.kubernetes.io/selected-node` from a pending
//! claim of this driver iff the driver definitely does not run on the selected node, so the
//! scheduler picks another node. Never otherwise: a node that may still start the driver could
//! provision the claim at the same time as the next one, and one of the volumes would leak.

use crate::liveness::{DriverlessReason, Liveness};

/// The annotation the scheduler sets and the rescheduler removes.
pub const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
/// The annotation kube-controller-manager sets to the class's provisioner.
pub const STORAGE_PROVISIONER: &str = "volume.kubernetes.io/storage-provisioner";
/// Its deprecated predecessor, still set by kube-controller-manager.
pub const BETA_STORAGE_PROVISIONER: &str = "volume.beta.kubernetes.io/storage-provisioner";

/// What the rescheduler needs to know about one claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimFacts {
    /// `spec.volumeName` is set.
    pub bound: bool,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// The selected-node annotation.
    pub selected_node: Option<String>,
    /// The provisioner of the claim's StorageClass, if the class exists.
    pub class_provisioner: Option<String>,
    /// The storage-provisioner annotation (or its beta predecessor).
    pub provisioner_annotation: Option<String>,
}

/// Why a claim is left alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepReason {
    /// It has a volume.
    Bound,
    /// It is being deleted.
    Deleting,
    /// No node is selected.
    NoSelectedNode,
    /// Another driver provisions it.
    OtherDriver,
    /// Neither class nor annotation says which driver provisions it.
    UnknownDriver,
    /// The driver may run on the selected node.
    DriverMayRun,
    /// The node looks driverless, but not yet for the whole grace period.
    GraceNotElapsed,
}

impl KeepReason {
    /// A stable label value.
    pub fn as_str(self) -> &'static str {
        match self {
            KeepReason::Bound => "bound",
            KeepReason::Deleting => "deleting",
            KeepReason::NoSelectedNode => "no-selected-node",
            KeepReason::OtherDriver => "other-driver",
            KeepReason::UnknownDriver => "unknown-driver",
            KeepReason::DriverMayRun => "driver-may-run",
            KeepReason::GraceNotElapsed => "grace-not-elapsed",
        }
    }
}

/// The rescheduler's decision about one claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Leave the claim alone.
    Keep(KeepReason),
    /// Remove the selected-node annotation.
    Unset {
        /// The node the claim was selected for.
        node: String,
        /// Why the driver does not run there.
        reason: DriverlessReason,
    },
}

/// Decides about `claim` of a driver named `driver`, given the liveness judgement of its
/// selected node.
pub fn decide(
    claim: &ClaimFacts,
    driver: &str,
    liveness: impl FnOnce(&str) -> Liveness,
) -> Verdict {
    if claim.bound {
        return Verdict::Keep(KeepReason::Bound);
    }
    if claim.deleting {
        return Verdict::Keep(KeepReason::Deleting);
    }
    let Some(node) = claim.selected_node.as_deref() else {
        return Verdict::Keep(KeepReason::NoSelectedNode);
    };
    // The class decides; only without a class does the annotation (which KCM copies from the
    // class) stand in for it.
    let provisioner = claim
        .class_provisioner
        .as_deref()
        .or(claim.provisioner_annotation.as_deref());
    match provisioner {
        None => return Verdict::Keep(KeepReason::UnknownDriver),
        Some(p) if p != driver => return Verdict::Keep(KeepReason::OtherDriver),
        Some(_) => {}
    }
    match liveness(node) {
        Liveness::MayRun => Verdict::Keep(KeepReason::DriverMayRun),
        Liveness::Suspect { .. } => Verdict::Keep(KeepReason::GraceNotElapsed),
        Liveness::DefinitelyNotRunning(reason) => Verdict::Unset {
            node: node.to_string(),
            reason,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const DRIVER: &str = "pmem-csi.intel.com";

    fn claim() -> ClaimFacts {
        ClaimFacts {
            bound: false,
            deleting: false,
            selected_node: Some("n1".into()),
            class_provisioner: Some(DRIVER.into()),
            provisioner_annotation: Some(DRIVER.into()),
        }
    }

    fn unset(reason: DriverlessReason) -> Verdict {
        Verdict::Unset {
            node: "n1".into(),
            reason,
        }
    }

    #[test]
    fn decide_table() {
        let gone = Liveness::DefinitelyNotRunning(DriverlessReason::NodeMissing);
        let suspect = Liveness::Suspect {
            reason: DriverlessReason::NodeMissing,
            remaining: Duration::from_secs(3),
        };
        let cases: Vec<(&str, ClaimFacts, Liveness, Verdict)> = vec![
            (
                "driverless node",
                claim(),
                gone,
                unset(DriverlessReason::NodeMissing),
            ),
            (
                "heartbeat expired",
                claim(),
                Liveness::DefinitelyNotRunning(DriverlessReason::HeartbeatExpired),
                unset(DriverlessReason::HeartbeatExpired),
            ),
            (
                "driver may run",
                claim(),
                Liveness::MayRun,
                Verdict::Keep(KeepReason::DriverMayRun),
            ),
            (
                "grace not elapsed",
                claim(),
                suspect,
                Verdict::Keep(KeepReason::GraceNotElapsed),
            ),
            (
                "bound",
                ClaimFacts {
                    bound: true,
                    ..claim()
                },
                gone,
                Verdict::Keep(KeepReason::Bound),
            ),
            (
                "deleting",
                ClaimFacts {
                    deleting: true,
                    ..claim()
                },
                gone,
                Verdict::Keep(KeepReason::Deleting),
            ),
            (
                "no selected node",
                ClaimFacts {
                    selected_node: None,
                    ..claim()
                },
                gone,
                Verdict::Keep(KeepReason::NoSelectedNode),
            ),
            (
                "other driver's class",
                ClaimFacts {
                    class_provisioner: Some("other.csi".into()),
                    ..claim()
                },
                gone,
                Verdict::Keep(KeepReason::OtherDriver),
            ),
            (
                "class wins over a stale annotation",
                ClaimFacts {
                    class_provisioner: Some("other.csi".into()),
                    provisioner_annotation: Some(DRIVER.into()),
                    ..claim()
                },
                gone,
                Verdict::Keep(KeepReason::OtherDriver),
            ),
            (
                "class missing, annotation names us",
                ClaimFacts {
                    class_provisioner: None,
                    ..claim()
                },
                gone,
                unset(DriverlessReason::NodeMissing),
            ),
            (
                "class missing, annotation names another",
                ClaimFacts {
                    class_provisioner: None,
                    provisioner_annotation: Some("other.csi".into()),
                    ..claim()
                },
                gone,
                Verdict::Keep(KeepReason::OtherDriver),
            ),
            (
                "class and annotation missing",
                ClaimFacts {
                    class_provisioner: None,
                    provisioner_annotation: None,
                    ..claim()
                },
                gone,
                Verdict::Keep(KeepReason::UnknownDriver),
            ),
        ];
        for (name, c, liveness, want) in cases {
            assert_eq!(decide(&c, DRIVER, |_| liveness), want, "{name}");
        }
    }

    #[test]
    fn liveness_is_asked_about_the_selected_node_only_when_needed() {
        let mut asked = None;
        decide(&claim(), DRIVER, |n| {
            asked = Some(n.to_string());
            Liveness::MayRun
        });
        assert_eq!(asked.as_deref(), Some("n1"));
        let mut asked = false;
        decide(
            &ClaimFacts {
                bound: true,
                ..claim()
            },
            DRIVER,
            |_| {
                asked = true;
                Liveness::MayRun
            },
        );
        assert!(!asked, "bound claims need no judgement");
    }
}
