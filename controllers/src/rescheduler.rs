//! The PVC rescheduler's decision: remove `volume.kubernetes.io/selected-node` from a pending
//! claim of this driver iff the driver definitely does not run on the selected node, so the
//! scheduler picks another node. Never otherwise: a node that may still start the driver could
//! provision the claim at the same time as the next one, and one of the volumes would leak.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Resource};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::claim_summary::ClaimSummary;
use crate::instrument::Instrument;
use crate::liveness::{DriverlessReason, Liveness};
use crate::liveness_view::LivenessView;
use crate::reconcile_metrics::ReconcileMetrics;
use crate::stores::Stores;
use crate::volume_facts::{ClaimFacts, ClassFacts, provisioner};
use crate::waiting_claims::{
    SCAN_INTERVAL, WaitingClaims, WaitingClaimsMetrics, waits_on_selected_node,
};
use crate::well_known::SELECTED_NODE;

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

/// Decides about `claim` (its class `class`, when it has one that exists) of a driver named
/// `driver`, given the liveness judgement of its selected node.
pub fn decide(
    claim: &ClaimFacts,
    class: Option<&ClassFacts>,
    driver: &str,
    liveness: impl FnOnce(&str) -> Liveness,
) -> Verdict {
    if claim.bound() {
        return Verdict::Keep(KeepReason::Bound);
    }
    if claim.deleting {
        return Verdict::Keep(KeepReason::Deleting);
    }
    let Some(node) = claim.selected_node.as_deref() else {
        return Verdict::Keep(KeepReason::NoSelectedNode);
    };
    match provisioner(class, claim.provisioner_annotation.as_deref()) {
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

/// Which waiting claims to reconcile again. A claim whose selected node's driver may run is kept
/// without a requeue: 10,000 pending claims would otherwise hold 10,000 timers in the
/// controller's scheduler (about 1 KiB each with their keys: more than the claim cache). The
/// scan brings a claim back when its node stops looking like it may run, which is sooner than
/// a requeue after the grace would. A claim judged "may run" by a reconcile between two scans
/// that both saw its node not running (a flip back and forth) is caught by the backstop: a
/// claim on a node that does not look like it may run is due again every `every`.
#[derive(Debug, Default)]
pub struct Retrigger {
    /// Nodes that did not look like they may run at the previous scan.
    not_running: HashSet<String>,
    /// When each claim (UID) on such a node was last made due.
    last: HashMap<String, Instant>,
}

impl Retrigger {
    /// The UIDs due among `waiting` — (claim UID, selected node, whether the driver may run
    /// there) for every claim waiting on its selected node — at `now`.
    pub fn due<'a>(
        &mut self,
        waiting: impl IntoIterator<Item = (&'a str, &'a str, bool)>,
        now: Instant,
        every: Duration,
    ) -> Vec<String> {
        let mut not_running = HashSet::new();
        let mut last = HashMap::new();
        let mut due = Vec::new();
        for (uid, node, may_run) in waiting {
            if may_run {
                continue;
            }
            let newly = !self.not_running.contains(node);
            let at = match self.last.get(uid) {
                Some(at) if !newly && now.saturating_duration_since(*at) < every => *at,
                _ => {
                    due.push(uid.to_string());
                    now
                }
            };
            last.insert(uid.to_string(), at);
            not_running.insert(node.to_string());
        }
        self.not_running = not_running;
        self.last = last;
        due
    }
}

/// How often the claim cache is scanned with a reschedule grace of `grace`: often enough that a
/// node which stops looking like it may run is noticed well within the grace.
pub fn scan_interval(grace: Duration) -> Duration {
    SCAN_INTERVAL.min(grace).max(Duration::from_secs(1))
}

// ---------------------------------------------------------------------------------------------
// The controller around the decision.
// ---------------------------------------------------------------------------------------------

/// The controller's name in metrics and logs.
pub const CONTROLLER: &str = "rescheduler";

/// Failures of one reconcile; the object is retried with exponential back-off.
#[derive(Debug, thiserror::Error)]
pub enum RescheduleError {
    /// An apiserver call failed.
    #[error("{op} PVC {namespace}/{name}: {source}")]
    Api {
        /// What was being done.
        op: &'static str,
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// Why.
        source: kube::Error,
    },
}

/// Counters of the rescheduler (`pmem_csi_rescheduler_decisions_total{verdict,reason}`).
#[derive(Clone, Debug)]
pub struct ReschedulerMetrics {
    decisions: Family<DecisionLabels, Counter>,
    waiting: WaitingClaimsMetrics,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    verdict: String,
    reason: String,
}

impl ReschedulerMetrics {
    /// Registers the counters in `registry`, every combination at zero.
    pub fn register(registry: &mut Registry) -> Self {
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "pmem_csi_rescheduler_decisions",
            "Decisions of the PVC rescheduler by verdict and reason",
            decisions.clone(),
        );
        let keep = [
            KeepReason::Bound,
            KeepReason::Deleting,
            KeepReason::NoSelectedNode,
            KeepReason::OtherDriver,
            KeepReason::UnknownDriver,
            KeepReason::DriverMayRun,
            KeepReason::GraceNotElapsed,
        ];
        for reason in keep.iter().map(|k| k.as_str()).chain(["not-confirmed"]) {
            let _ = decisions.get_or_create(&DecisionLabels {
                verdict: "keep".into(),
                reason: reason.into(),
            });
        }
        for reason in [
            DriverlessReason::NodeMissing,
            DriverlessReason::NotSelectedNoCsiNodeEntry,
            DriverlessReason::HeartbeatExpired,
        ] {
            let _ = decisions.get_or_create(&DecisionLabels {
                verdict: "unset".into(),
                reason: reason.as_str().into(),
            });
        }
        Self {
            decisions,
            waiting: WaitingClaimsMetrics::register(registry),
        }
    }

    fn count(&self, verdict: &str, reason: &str) {
        self.decisions
            .get_or_create(&DecisionLabels {
                verdict: verdict.into(),
                reason: reason.into(),
            })
            .inc();
    }
}

/// The rescheduler: reconciles pending claims from the shared claim cache.
pub struct Rescheduler {
    client: kube::Client,
    stores: Stores,
    liveness: LivenessView,
    recorder: Recorder,
    metrics: ReschedulerMetrics,
    instrument: Instrument<ClaimSummary>,
}

/// The facts of `claim`, and of its class when `classes` has it.
pub fn claim_facts(
    claim: &ClaimSummary,
    classes: &Store<StorageClass>,
) -> (ClaimFacts, Option<ClassFacts>) {
    let facts = ClaimFacts::of_summary(claim);
    let class = facts
        .class
        .as_deref()
        .and_then(|c| classes.get(&ObjectRef::new(c)))
        .map(|c| ClassFacts::of(&c));
    (facts, class)
}

impl Rescheduler {
    /// A rescheduler writing with `client`.
    pub fn new(
        client: kube::Client,
        stores: Stores,
        liveness: LivenessView,
        reporter: Reporter,
        metrics: ReschedulerMetrics,
        reconciles: ReconcileMetrics,
    ) -> Self {
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            stores,
            liveness,
            metrics,
            instrument: Instrument::new(CONTROLLER, reconciles),
        }
    }

    /// Runs until `shutdown`, triggered by claims from the shared claim watch.
    pub async fn run(
        self,
        trigger: impl futures::Stream<Item = Arc<ClaimSummary>> + Send + 'static,
        shutdown: CancellationToken,
    ) {
        let claims = self.stores.claims.clone();
        let (again, again_rx) = mpsc::channel(RETRIGGER_BUFFER);
        let scan = scan_waiting(
            self.stores.clone(),
            self.liveness.clone(),
            self.metrics.waiting.clone(),
            again,
            shutdown.clone(),
        );
        let trigger = futures::stream::select(
            trigger,
            tokio_stream::wrappers::ReceiverStream::new(again_rx),
        );
        let controller = Controller::for_shared_stream(trigger, claims)
            .graceful_shutdown_on(shutdown.cancelled_owned())
            .run(reconcile, error_policy, Arc::new(self))
            .for_each(|_| async {});
        tokio::join!(controller, scan);
    }

    async fn reconcile(&self, claim: &ClaimSummary) -> Result<Action, RescheduleError> {
        let driver = self.liveness.settings().driver.clone();
        let grace = self.liveness.settings().grace;
        let (facts, class) = claim_facts(claim, &self.stores.classes);
        let mut remaining = grace;
        let verdict = decide(&facts, class.as_ref(), &driver, |node| {
            let l = self.liveness.judge(node);
            if let Liveness::Suspect { remaining: r, .. } = l {
                remaining = r;
            }
            l
        });
        let (node, reason) = match verdict {
            Verdict::Keep(reason) => {
                self.metrics.count("keep", reason.as_str());
                return Ok(match reason {
                    // Judge again once the grace has passed.
                    KeepReason::GraceNotElapsed => {
                        Action::requeue(remaining + Duration::from_millis(100))
                    }
                    // Node and CSINode changes do not trigger claims; the scan does once the node
                    // stops looking like it may run (see `Retrigger`).
                    KeepReason::DriverMayRun => Action::await_change(),
                    _ => Action::await_change(),
                });
            }
            Verdict::Unset { node, reason } => (node, reason),
        };
        let namespace = claim.metadata.namespace.clone().unwrap_or_default();
        let name = claim.metadata.name.clone().unwrap_or_default();
        let api_err = |op| {
            let (namespace, name) = (namespace.clone(), name.clone());
            move |source| RescheduleError::Api {
                op,
                namespace,
                name,
                source,
            }
        };
        // Confirm with uncached reads: the claim as it is now, and the node's objects.
        let api = Api::<ClaimSummary>::namespaced(self.client.clone(), &namespace);
        let Some(fresh) = api.get_opt(&name).await.map_err(api_err("reading"))? else {
            return Ok(Action::await_change());
        };
        let (facts, class) = claim_facts(&fresh, &self.stores.classes);
        if decide(&facts, class.as_ref(), &driver, |_| {
            Liveness::DefinitelyNotRunning(reason)
        }) != (Verdict::Unset {
            node: node.clone(),
            reason,
        }) {
            return Ok(Action::requeue(Duration::ZERO));
        }
        let confirmed = self
            .liveness
            .confirm(&self.client, &node)
            .await
            .map_err(api_err("confirming the node of"))?;
        if confirmed.is_none() {
            self.metrics.count("keep", "not-confirmed");
            return Ok(Action::requeue(grace.max(Duration::from_secs(1))));
        }
        let patch = serde_json::json!({
            "metadata": {
                // A merge patch carrying resourceVersion fails with 409 if the claim changed
                // since it was read: the scheduler may have moved on in between.
                "resourceVersion": fresh.metadata.resource_version,
                "annotations": { SELECTED_NODE: null },
            }
        });
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_err("removing selected-node from"))?;
        self.metrics.count("unset", reason.as_str());
        tracing::info!(claim = %format!("{namespace}/{name}"), node, reason = reason.as_str(), "rescheduled");
        let event = Event {
            type_: EventType::Normal,
            reason: "Rescheduled".into(),
            note: Some(format!(
                "removed {SELECTED_NODE}={node}: the PMEM-CSI driver does not run there ({})",
                reason.as_str()
            )),
            action: "Reschedule".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &fresh.object_ref(&())).await {
            tracing::warn!("publishing the Rescheduled event: {e}");
        }
        Ok(Action::await_change())
    }
}

/// Claims the scan may hand back to the rescheduler before it waits for the controller to take
/// them.
const RETRIGGER_BUFFER: usize = 4096;

/// Scans the claim cache for claims waiting on their selected node until `shutdown`: reports
/// the longest wait, and hands back to the rescheduler (`again`) the claims [`Retrigger`] finds
/// due; then zeroes the gauge: only the leader reports.
async fn scan_waiting(
    stores: Stores,
    liveness: LivenessView,
    gauge: WaitingClaimsMetrics,
    again: mpsc::Sender<Arc<ClaimSummary>>,
    shutdown: CancellationToken,
) {
    let driver = liveness.settings().driver.clone();
    let grace = liveness.settings().grace;
    let mut claims = WaitingClaims::default();
    let mut retrigger = Retrigger::default();
    let mut tick = tokio::time::interval(scan_interval(grace));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        let waiting: Vec<Arc<ClaimSummary>> = stores
            .claims
            .state()
            .into_iter()
            .filter(|c| {
                let (facts, class) = claim_facts(c, &stores.classes);
                facts.uid.is_some() && waits_on_selected_node(&facts, class.as_ref(), &driver)
            })
            .collect();
        // Borrowed from the cached claims: the scan allocates nothing per claim it keeps.
        let keyed = || {
            waiting.iter().filter_map(|c| {
                let uid = c.metadata.uid.as_deref()?;
                let node = c.annotations.selected_node.as_deref()?;
                Some((c, uid, node))
            })
        };
        let now = Instant::now();
        gauge.set(claims.observe(keyed().map(|(_, uid, _)| uid), now));
        // One judgement per node, not per claim: a node may have thousands waiting on it.
        let mut may_run: HashMap<&str, bool> = HashMap::new();
        for (_, _, node) in keyed() {
            may_run
                .entry(node)
                .or_insert_with(|| liveness.judge(node) == Liveness::MayRun);
        }
        let due: HashSet<String> = retrigger
            .due(
                keyed()
                    .map(|(_, uid, node)| (uid, node, may_run.get(node).copied().unwrap_or(true))),
                now,
                grace,
            )
            .into_iter()
            .collect();
        for (claim, uid, _) in keyed() {
            if !due.contains(uid) {
                continue;
            }
            // Waits for room rather than drop: `Retrigger` counts every due claim as handed
            // back. The controller drains the channel meanwhile (both run under one join).
            tokio::select! {
                sent = again.send(claim.clone()) => if sent.is_err() { break },
                _ = shutdown.cancelled() => break,
            }
        }
    }
    gauge.set(Duration::ZERO);
}

async fn reconcile(
    claim: Arc<ClaimSummary>,
    ctx: Arc<Rescheduler>,
) -> Result<Action, RescheduleError> {
    ctx.instrument
        .reconcile(&claim, ctx.reconcile(&claim))
        .await
}

fn error_policy(
    claim: Arc<ClaimSummary>,
    error: &RescheduleError,
    ctx: Arc<Rescheduler>,
) -> Action {
    ctx.instrument.error_policy(&claim, error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retrigger_table() {
        let t0 = Instant::now();
        let every = Duration::from_secs(60);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let w = |uid: &'static str, node: &'static str, may_run: bool| (uid, node, may_run);
        let mut r = Retrigger::default();
        // (scan, waiting claims, due)
        type Waiting = Vec<(&'static str, &'static str, bool)>;
        let steps: Vec<(&str, u64, Waiting, Vec<&str>)> = vec![
            ("may run: nothing due", 0, vec![w("a", "n1", true)], vec![]),
            (
                "node stops: due at once",
                10,
                vec![w("a", "n1", false), w("b", "n2", true)],
                vec!["a"],
            ),
            (
                "still stopped: not again before `every`",
                20,
                vec![w("a", "n1", false)],
                vec![],
            ),
            (
                "new claim on a stopped node: due",
                30,
                vec![w("a", "n1", false), w("c", "n1", false)],
                vec!["c"],
            ),
            (
                "backstop after `every`",
                70,
                vec![w("a", "n1", false), w("c", "n1", false)],
                vec!["a"],
            ),
            (
                "node runs again",
                80,
                vec![w("a", "n1", true), w("c", "n1", true)],
                vec![],
            ),
            (
                "and stops again: both due at once",
                85,
                vec![w("a", "n1", false), w("c", "n1", false)],
                vec!["a", "c"],
            ),
            (
                "claim gone, node still stopped",
                90,
                vec![w("c", "n1", false)],
                vec![],
            ),
            (
                "gone claim back: due (forgotten)",
                95,
                vec![w("a", "n1", false), w("c", "n1", false)],
                vec!["a"],
            ),
        ];
        for (name, second, waiting, want) in steps {
            let due = r.due(waiting, at(second), every);
            assert_eq!(due, want, "{name}");
        }
    }

    #[test]
    fn scan_interval_follows_short_graces() {
        assert_eq!(scan_interval(Duration::from_secs(600)), SCAN_INTERVAL);
        assert_eq!(
            scan_interval(Duration::from_secs(3)),
            Duration::from_secs(3)
        );
        assert_eq!(scan_interval(Duration::ZERO), Duration::from_secs(1));
    }
    use std::time::Duration;

    const DRIVER: &str = "pmem-csi.intel.com";

    fn claim() -> ClaimFacts {
        ClaimFacts {
            class: Some("sc".into()),
            selected_node: Some("n1".into()),
            provisioner_annotation: Some(DRIVER.into()),
            ..ClaimFacts::default()
        }
    }

    fn class(provisioner: &str) -> Option<ClassFacts> {
        Some(ClassFacts {
            provisioner: provisioner.into(),
            ..ClassFacts::default()
        })
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
        let ours = || class(DRIVER);
        let bound = ClaimFacts {
            volume_name: Some("pv".into()),
            ..claim()
        };
        let cases: Vec<(&str, ClaimFacts, Option<ClassFacts>, Liveness, Verdict)> = vec![
            (
                "driverless node",
                claim(),
                ours(),
                gone,
                unset(DriverlessReason::NodeMissing),
            ),
            (
                "heartbeat expired",
                claim(),
                ours(),
                Liveness::DefinitelyNotRunning(DriverlessReason::HeartbeatExpired),
                unset(DriverlessReason::HeartbeatExpired),
            ),
            (
                "driver may run",
                claim(),
                ours(),
                Liveness::MayRun,
                Verdict::Keep(KeepReason::DriverMayRun),
            ),
            (
                "grace not elapsed",
                claim(),
                ours(),
                suspect,
                Verdict::Keep(KeepReason::GraceNotElapsed),
            ),
            (
                "bound",
                bound,
                ours(),
                gone,
                Verdict::Keep(KeepReason::Bound),
            ),
            (
                "deleting",
                ClaimFacts {
                    deleting: true,
                    ..claim()
                },
                ours(),
                gone,
                Verdict::Keep(KeepReason::Deleting),
            ),
            (
                "no selected node",
                ClaimFacts {
                    selected_node: None,
                    ..claim()
                },
                ours(),
                gone,
                Verdict::Keep(KeepReason::NoSelectedNode),
            ),
            (
                "other driver's class",
                ClaimFacts {
                    provisioner_annotation: None,
                    ..claim()
                },
                class("other.csi"),
                gone,
                Verdict::Keep(KeepReason::OtherDriver),
            ),
            (
                "class wins over a stale annotation",
                claim(),
                class("other.csi"),
                gone,
                Verdict::Keep(KeepReason::OtherDriver),
            ),
            (
                "an immediate class of ours counts too",
                claim(),
                Some(ClassFacts {
                    provisioner: DRIVER.into(),
                    late_binding: false,
                    ..ClassFacts::default()
                }),
                gone,
                unset(DriverlessReason::NodeMissing),
            ),
            (
                "class missing, annotation names us",
                claim(),
                None,
                gone,
                unset(DriverlessReason::NodeMissing),
            ),
            (
                "class missing, annotation names another",
                ClaimFacts {
                    provisioner_annotation: Some("other.csi".into()),
                    ..claim()
                },
                None,
                gone,
                Verdict::Keep(KeepReason::OtherDriver),
            ),
            (
                "class and annotation missing",
                ClaimFacts {
                    provisioner_annotation: None,
                    ..claim()
                },
                None,
                gone,
                Verdict::Keep(KeepReason::UnknownDriver),
            ),
        ];
        for (name, c, class, liveness, want) in cases {
            assert_eq!(
                decide(&c, class.as_ref(), DRIVER, |_| liveness),
                want,
                "{name}"
            );
        }
    }

    #[test]
    fn liveness_is_asked_about_the_selected_node_only_when_needed() {
        let mut asked = None;
        decide(&claim(), class(DRIVER).as_ref(), DRIVER, |n| {
            asked = Some(n.to_string());
            Liveness::MayRun
        });
        assert_eq!(asked.as_deref(), Some("n1"));
        let mut asked = false;
        decide(
            &ClaimFacts {
                volume_name: Some("pv".into()),
                ..claim()
            },
            class(DRIVER).as_ref(),
            DRIVER,
            |_| {
                asked = true;
                Liveness::MayRun
            },
        );
        assert!(!asked, "bound claims need no judgement");
    }
}
