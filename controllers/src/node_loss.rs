//! Node-loss recovery (opt-in with `--node-loss-grace`, leader only): when the node of one of
//! this driver's volumes is lost for good, the claims that opted in
//! ([`RECREATE_ON_NODE_LOSS`]) are released so that their workloads start elsewhere with a
//! new, empty volume — the claim, its volume and the lost node's pods using it are deleted, and
//! the workload's controller (a StatefulSet's, typically) recreates claim and pod. Claims that
//! did not opt in are reported with an Event saying what an operator can do, never touched.
//!
//! A node is lost when its Node object is gone, or when its driver's heartbeat has expired
//! *and* its kubelet stopped reporting (condition Ready is Unknown): a node whose kubelet still
//! reports — Ready or not — may run pods that use their volumes, however long its driver
//! crash-loops, and deleting a claim there would throw their data away. The grace counts from
//! the moment this leader first saw the node lost *that way* (a [`LossClock`]: a Node deleted
//! hours after its driver stopped is lost from its deletion on), never earlier than the
//! liveness view and the kubelet's own transition say; a new leader starts it again. Every
//! action is preceded by uncached reads that must agree, and nothing is deleted while more
//! than half of the driver's nodes look lost (an apiserver or zone outage, not lost nodes).
//!
//! The decision ([`decide`]) is a pure function of plain facts; the controller around it reads
//! the caches, confirms, and writes.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolume, Pod};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::WatchStreamExt;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::watcher;
use kube::{Api, Resource};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::claim_summary::ClaimSummary;
use crate::instrument::Instrument;
use crate::liveness::DriverlessReason;
use crate::liveness_view::LivenessView;
use crate::node_summary::NodeSummary;
use crate::reconcile_metrics::ReconcileMetrics;
use crate::stores::{Stores, trim};
use crate::volume_facts::pv_node;
use crate::well_known::{PROVISIONER_FINALIZER, RECREATE_ON_NODE_LOSS};

/// The controller's name in metrics and logs.
pub const CONTROLLER: &str = "node-loss-recovery";

/// Longest time between two looks at a volume whose node is not (yet) lost: a Node deletion
/// triggers no PV event, and the liveness view forgets a deleted node's name unless asked about
/// it within a minute.
const CHECK_AT_MOST_EVERY: Duration = Duration::from_secs(30);

/// How a node is lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loss {
    /// Its Node object is gone.
    NodeDeleted,
    /// Its driver's heartbeat expired and its kubelet does not report Ready.
    Silent,
}

impl Loss {
    /// A stable label value and message fragment.
    pub fn as_str(self) -> &'static str {
        match self {
            Loss::NodeDeleted => "node-deleted",
            Loss::Silent => "driver-and-kubelet-silent",
        }
    }
}

/// What the Node object says about its kubelet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kubelet {
    /// No Node object.
    NodeGone,
    /// Condition Ready is True or False, or absent: a kubelet that reports (a False Ready comes
    /// from a running kubelet whose runtime or network is unwell, its pods may still run).
    Reporting,
    /// Condition Ready is Unknown: the kubelet stopped reporting; `for_`: since its last
    /// transition, when known.
    Silent {
        /// How long ago Ready last changed.
        for_: Option<Duration>,
    },
}

/// Whether and for how long a node has been lost, from its liveness (why and for how long the
/// driver has looked absent) and its kubelet.
pub fn lost_for(
    driverless: Option<(DriverlessReason, Duration)>,
    kubelet: Kubelet,
) -> Option<(Loss, Duration)> {
    let (reason, driverless_for) = driverless?;
    match (reason, kubelet) {
        (DriverlessReason::NodeMissing | DriverlessReason::HeartbeatExpired, Kubelet::NodeGone) => {
            Some((Loss::NodeDeleted, driverless_for))
        }
        (DriverlessReason::HeartbeatExpired, Kubelet::Silent { for_ }) => Some((
            Loss::Silent,
            for_.map_or(driverless_for, |f| f.min(driverless_for)),
        )),
        // A label removed by an operator is no loss; a kubelet that reports runs pods that may
        // use their volumes; a Node the caches miss but the API server has is a race.
        _ => None,
    }
}

/// What the Node object says about its kubelet (`now`: the wall clock, for the transition).
pub fn kubelet_of(node: Option<&NodeSummary>, now: k8s_openapi::jiff::Timestamp) -> Kubelet {
    let Some(node) = node else {
        return Kubelet::NodeGone;
    };
    match &node.ready {
        Some(c) if c.status == "Unknown" => Kubelet::Silent {
            for_: c
                .last_transition_time
                .as_ref()
                .and_then(|t| now.duration_since(t.0).try_into().ok()),
        },
        _ => Kubelet::Reporting,
    }
}

/// Since when this leader has seen each node lost, and how. The liveness view's clock starts at
/// the first sign of driverlessness of any kind; a Node deleted hours after its label was
/// removed or its driver stopped would otherwise count as lost for hours at once.
#[derive(Debug, Default)]
pub struct LossClock {
    since: HashMap<String, (Loss, Instant)>,
}

impl LossClock {
    /// Records what `node` looks like at `now` (`lost`, from [`lost_for`]); returns it with its
    /// duration capped by how long this clock has seen that kind of loss.
    pub fn observe(
        &mut self,
        node: &str,
        lost: Option<(Loss, Duration)>,
        now: Instant,
    ) -> Option<(Loss, Duration)> {
        let Some((loss, lost_for)) = lost else {
            self.since.remove(node);
            return None;
        };
        let entry = self.since.entry(node.to_string()).or_insert((loss, now));
        if entry.0 != loss {
            *entry = (loss, now);
        }
        Some((loss, lost_for.min(now.saturating_duration_since(entry.1))))
    }

    /// How many nodes look lost, and how many of them are deleted.
    pub fn lost(&self) -> (usize, usize) {
        let deleted = self
            .since
            .values()
            .filter(|(loss, _)| *loss == Loss::NodeDeleted)
            .count();
        (self.since.len(), deleted)
    }
}

/// Whether recovery must hold back: more than half of the driver's nodes look lost at once
/// (`lost` of `selected` nodes that exist and match the selector, plus `deleted` ones that are
/// gone). That is an apiserver, network or zone outage, not nodes lost for good.
pub fn too_many_lost(lost: usize, deleted: usize, selected: usize) -> bool {
    lost * 2 > selected + deleted
}

/// Where a claim's opt-in comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptIn {
    /// The claim's own annotation.
    Claim,
    /// Its StorageClass's annotation.
    Class,
}

/// Whether a claim opted in, from the values of [`RECREATE_ON_NODE_LOSS`] on the claim and its
/// class: the claim's own value wins, and only `"true"` opts in.
pub fn opt_in(claim: Option<&str>, class: Option<&str>) -> Option<OptIn> {
    match (claim, class) {
        (Some("true"), _) => Some(OptIn::Claim),
        (Some(_), _) => None,
        (None, Some("true")) => Some(OptIn::Class),
        (None, _) => None,
    }
}

/// The facts of one PV.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeFacts {
    /// The PV's name.
    pub name: String,
    /// Its node, for this driver's PVs.
    pub node: Option<String>,
    /// `persistentVolumeReclaimPolicy: Delete`.
    pub reclaim_delete: bool,
    /// Being deleted.
    pub deleting: bool,
    /// external-provisioner's finalizer is on it.
    pub provisioner_finalizer: bool,
    /// Its claimRef: namespace, name, uid.
    pub claim: Option<(String, String, Option<String>)>,
}

impl VolumeFacts {
    /// The facts of `pv` for `driver`.
    pub fn of(pv: &PersistentVolume, driver: &str) -> Self {
        let spec = pv.spec.as_ref();
        Self {
            name: pv.metadata.name.clone().unwrap_or_default(),
            node: pv_node(pv, driver),
            reclaim_delete: spec
                .and_then(|s| s.persistent_volume_reclaim_policy.as_deref())
                .is_some_and(|p| p == "Delete"),
            deleting: pv.metadata.deletion_timestamp.is_some(),
            provisioner_finalizer: pv
                .metadata
                .finalizers
                .iter()
                .flatten()
                .any(|f| f == PROVISIONER_FINALIZER),
            claim: spec
                .and_then(|s| s.claim_ref.as_ref())
                .and_then(|r| Some((r.namespace.clone()?, r.name.clone()?, r.uid.clone()))),
        }
    }
}

/// The state of a PV's claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimState {
    /// No claim of that name and uid.
    Gone,
    /// The claim exists and is bound to this volume.
    Present {
        /// Whether and how it opted in.
        opt_in: Option<OptIn>,
    },
    /// A claim of that name (and uid, when the PV records one) exists, but is not bound to
    /// this volume: not ours to judge.
    Elsewhere,
}

/// The decision about one PV.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not one to judge: another driver's, without node or without claim.
    Ignore,
    /// Nothing (more) to do.
    Done,
    /// The node is not lost; look again later.
    Alive,
    /// The node is lost, but not yet for the grace; look again after this.
    Wait(Duration),
    /// The node is lost and the claim did not opt in: report, touch nothing.
    Report {
        /// How the node is lost.
        loss: Loss,
    },
    /// The node is lost and the claim opted in: delete the claim and the lost node's pods
    /// using it, then the volume.
    Recover {
        /// How the node is lost.
        loss: Loss,
        /// Where the opt-in comes from.
        opt_in: OptIn,
        /// The volume goes too (reclaim policy Delete).
        delete_volume: bool,
        /// Remove external-provisioner's finalizer (only where the node is gone).
        remove_finalizer: bool,
    },
    /// The claim is gone and the volume's reclaim policy is Delete, which nobody on a lost node
    /// carries out: delete the PV.
    Release {
        /// How the node is lost.
        loss: Loss,
        /// Request the deletion (the PV is not being deleted yet).
        delete: bool,
        /// Remove external-provisioner's finalizer (only where the node is gone).
        remove_finalizer: bool,
    },
}

/// Decides about the PV of `volume` whose claim is in state `claim`, its node lost as
/// `lost` says ([`lost_for`]), with recovery after `grace`.
pub fn decide(
    volume: &VolumeFacts,
    claim: ClaimState,
    lost: Option<(Loss, Duration)>,
    grace: Duration,
) -> Verdict {
    if volume.node.is_none() || volume.claim.is_none() {
        return Verdict::Ignore;
    }
    let Some((loss, lost_for)) = lost else {
        return Verdict::Alive;
    };
    if lost_for < grace {
        return Verdict::Wait(grace - lost_for);
    }
    let remove_finalizer = |v: &VolumeFacts| removes_finalizer(loss, v);
    match claim {
        ClaimState::Elsewhere => Verdict::Done,
        ClaimState::Present { opt_in: None } => Verdict::Report { loss },
        ClaimState::Present {
            opt_in: Some(opt_in),
        } => Verdict::Recover {
            loss,
            opt_in,
            delete_volume: volume.reclaim_delete,
            remove_finalizer: remove_finalizer(volume),
        },
        ClaimState::Gone if !volume.reclaim_delete => Verdict::Done,
        ClaimState::Gone if volume.deleting && !remove_finalizer(volume) => Verdict::Done,
        ClaimState::Gone => Verdict::Release {
            loss,
            delete: !volume.deleting,
            remove_finalizer: remove_finalizer(volume),
        },
    }
}

/// Whether external-provisioner's finalizer is to be removed from `volume` of a node lost as
/// `loss`: only where the Node is gone (external-provisioner on a node that still exists removes
/// it itself once the driver returns), and only from a volume whose reclaim policy says Delete.
pub fn removes_finalizer(loss: Loss, volume: &VolumeFacts) -> bool {
    loss == Loss::NodeDeleted && volume.reclaim_delete && volume.provisioner_finalizer
}

/// Whether `pod` uses the claim `claim` of its namespace (as a claim volume, or as the
/// generic ephemeral volume `<pod>-<volume>`).
pub fn uses_claim(pod: &Pod, claim: &str) -> bool {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .any(|v| {
            v.persistent_volume_claim
                .as_ref()
                .is_some_and(|c| c.claim_name == claim)
                || (v.ephemeral.is_some() && format!("{name}-{}", v.name) == claim)
        })
}

/// How long to wait before looking at a volume again whose node is not lost (yet).
pub fn check_every(grace: Duration) -> Duration {
    (grace / 10).clamp(Duration::from_secs(1), CHECK_AT_MOST_EVERY)
}

// ---------------------------------------------------------------------------------------------
// The controller around the decision.
// ---------------------------------------------------------------------------------------------

/// `--node-loss-grace` and `--node-loss-dry-run`, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeLossSettings {
    /// How long a node must be lost before its opted-in claims are recovered.
    pub grace: Duration,
    /// Only report what would be done.
    pub dry_run: bool,
}

/// What the recovery did, by action
/// (`pmem_csi_node_loss_actions_total{action}`): `reported` (a claim that did not opt in),
/// `dry-run` (what would have been done), `refused` (more than half of the nodes look lost),
/// `claim-deleted`, `pod-deleted`, `volume-deleted`, `finalizer-removed`.
#[derive(Clone, Debug)]
pub struct NodeLossMetrics {
    actions: Family<ActionLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabels {
    action: String,
}

/// Every action label, so that dashboards see each series at zero.
const ACTIONS: [&str; 7] = [
    "reported",
    "dry-run",
    "refused",
    "claim-deleted",
    "pod-deleted",
    "volume-deleted",
    "finalizer-removed",
];

impl NodeLossMetrics {
    /// Registers the counter in `registry`, every action at zero.
    pub fn register(registry: &mut Registry) -> Self {
        let actions = Family::<ActionLabels, Counter>::default();
        registry.register(
            "pmem_csi_node_loss_actions",
            "Actions of the node-loss recovery (reported: a claim that did not opt in)",
            actions.clone(),
        );
        for action in ACTIONS {
            let _ = actions.get_or_create(&ActionLabels {
                action: action.into(),
            });
        }
        Self { actions }
    }

    fn count(&self, action: &str) {
        self.actions
            .get_or_create(&ActionLabels {
                action: action.into(),
            })
            .inc();
    }
}

/// Failures of one reconcile; the PV is retried with exponential back-off.
#[derive(Debug, thiserror::Error)]
#[error("{op} (PV {volume}): {source}")]
pub struct NodeLossError {
    op: String,
    volume: String,
    source: kube::Error,
}

struct Context {
    client: kube::Client,
    stores: Stores,
    liveness: LivenessView,
    settings: NodeLossSettings,
    recorder: Recorder,
    metrics: NodeLossMetrics,
    instrument: Instrument<PersistentVolume>,
    /// What was already reported this term, one Event each: `<kind>/<claim uid or volume>`.
    reported: Mutex<HashSet<String>>,
    /// Since when each node has looked lost, and how.
    clock: Mutex<LossClock>,
    /// Uncached confirmations per node, reused for a few seconds: a lost node with many
    /// volumes is read once, not once per volume.
    confirmed: Mutex<HashMap<String, Confirmation>>,
}

/// An uncached confirmation of a node: when, why it is driverless (if it is), its kubelet.
type Confirmation = (Instant, Option<DriverlessReason>, Kubelet);

/// How long an uncached confirmation of a node is reused.
const CONFIRMATION_REUSED_FOR: Duration = Duration::from_secs(5);

/// The recovery's dependencies.
pub struct NodeLossRecovery {
    /// The process client.
    pub client: kube::Client,
    /// The shared caches.
    pub stores: Stores,
    /// The liveness view.
    pub liveness: LivenessView,
    /// Grace and dry-run.
    pub settings: NodeLossSettings,
    /// Who writes the Events.
    pub reporter: Reporter,
    /// The action counter.
    pub metrics: NodeLossMetrics,
    /// The reconcile metrics.
    pub reconciles: ReconcileMetrics,
}

impl NodeLossRecovery {
    /// Runs over every PV (its own watch, trimmed, for this term only) until `shutdown`.
    pub async fn run(self, shutdown: CancellationToken) {
        let api = Api::<PersistentVolume>::all(self.client.clone());
        let (reader, writer) = reflector::store();
        let stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .modify(|pv: &mut PersistentVolume| trim(pv))
            .reflect(writer)
            .applied_objects();
        let ctx = Arc::new(Context {
            recorder: Recorder::new(self.client.clone(), self.reporter),
            client: self.client,
            stores: self.stores,
            liveness: self.liveness,
            settings: self.settings,
            metrics: self.metrics,
            instrument: Instrument::new(CONTROLLER, self.reconciles),
            reported: Mutex::default(),
            clock: Mutex::default(),
            confirmed: Mutex::default(),
        });
        tracing::info!(
            grace = ?self.settings.grace,
            dry_run = self.settings.dry_run,
            "node-loss recovery running"
        );
        Controller::for_stream(stream, reader)
            .graceful_shutdown_on(shutdown.cancelled_owned())
            .run(
                reconcile,
                |pv, e: &NodeLossError, ctx: Arc<Context>| ctx.instrument.error_policy(&pv, e),
                ctx,
            )
            .for_each(|_| async {})
            .await;
    }
}

async fn reconcile(pv: Arc<PersistentVolume>, ctx: Arc<Context>) -> Result<Action, NodeLossError> {
    ctx.instrument.reconcile(&pv, recover(&pv, &ctx)).await
}

impl Context {
    fn driver(&self) -> &str {
        &self.liveness.settings().driver
    }

    fn class_value(&self, claim: &ClaimSummary) -> Option<String> {
        let class = claim.spec.as_ref()?.storage_class_name.as_deref()?;
        let class = self
            .stores
            .classes
            .get(&ObjectRef::<StorageClass>::new(class))?;
        class
            .metadata
            .annotations
            .as_ref()?
            .get(RECREATE_ON_NODE_LOSS)
            .cloned()
    }

    fn claim_state(
        &self,
        claim: Option<&ClaimSummary>,
        uid: Option<&str>,
        volume: &str,
    ) -> ClaimState {
        let Some(claim) = claim.filter(|c| uid.is_none() || c.metadata.uid.as_deref() == uid)
        else {
            return ClaimState::Gone;
        };
        // A PV pre-bound by name (no uid) matches any claim of that name: only one bound to
        // this very volume is judged.
        if claim.spec.as_ref().and_then(|s| s.volume_name.as_deref()) != Some(volume) {
            return ClaimState::Elsewhere;
        }
        let own = claim.annotations.recreate_on_node_loss.as_deref();
        ClaimState::Present {
            opt_in: opt_in(own, self.class_value(claim).as_deref()),
        }
    }

    /// The clock's view of `node` now (see [`LossClock::observe`]).
    fn observe(&self, node: &str, lost: Option<(Loss, Duration)>) -> Option<(Loss, Duration)> {
        self.clock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .observe(node, lost, Instant::now())
    }

    /// Whether more than half of the driver's nodes look lost now.
    fn too_many_lost(&self) -> bool {
        let (lost, deleted) = self
            .clock
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .lost();
        let selector = &self.liveness.settings().selector;
        let selected = self
            .stores
            .nodes
            .state()
            .iter()
            .filter(|n| selector.matches(n.metadata.labels.as_ref()))
            .count();
        too_many_lost(lost, deleted, selected)
    }

    /// Uncached: why the driver does not run on `node` and what its kubelet says (reused for
    /// [`CONFIRMATION_REUSED_FOR`]).
    async fn confirm(
        &self,
        node: &str,
    ) -> Result<(Option<DriverlessReason>, Kubelet), kube::Error> {
        let now = Instant::now();
        if let Some((at, reason, kubelet)) = self
            .confirmed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(node)
            && now.saturating_duration_since(*at) < CONFIRMATION_REUSED_FOR
        {
            return Ok((*reason, *kubelet));
        }
        let (reason, fresh) = self.liveness.confirm_with_node(&self.client, node).await?;
        let kubelet = kubelet_of(fresh.as_ref(), k8s_openapi::jiff::Timestamp::now());
        let mut confirmed = self
            .confirmed
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        confirmed
            .retain(|_, (at, _, _)| now.saturating_duration_since(*at) < CONFIRMATION_REUSED_FOR);
        confirmed.insert(node.to_string(), (now, reason, kubelet));
        Ok((reason, kubelet))
    }

    /// Whether `key` was reported this term.
    fn was_reported(&self, key: &str) -> bool {
        self.reported
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(key)
    }

    /// Records `key` as reported; false when it already was this term.
    fn first_report(&self, key: &str) -> bool {
        self.reported
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.to_string())
    }

    async fn publish(&self, claim: &ClaimSummary, reason: &str, note: String) {
        let event = Event {
            type_: EventType::Warning,
            reason: reason.into(),
            // events.k8s.io notes are limited to 1 kB.
            note: Some(note.chars().take(1000).collect()),
            action: "NodeLossRecovery".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&event, &claim.object_ref(&())).await {
            tracing::warn!("publishing the {reason} event: {e}");
        }
    }
}

async fn recover(pv: &PersistentVolume, ctx: &Context) -> Result<Action, NodeLossError> {
    let volume = VolumeFacts::of(pv, ctx.driver());
    let err = |op: &str| {
        let (op, volume) = (op.to_string(), volume.name.clone());
        move |source| NodeLossError { op, volume, source }
    };
    let (Some(node), Some((namespace, name, uid))) = (volume.node.clone(), volume.claim.clone())
    else {
        return Ok(Action::await_change());
    };
    let grace = ctx.settings.grace;
    let check = check_every(grace);
    // First from the caches (the Node cache keeps its Ready condition).
    let cached_claim = ctx
        .stores
        .claims
        .get(&ObjectRef::<ClaimSummary>::new(&name).within(&namespace));
    let cached_node = ctx.stores.nodes.get(&ObjectRef::<NodeSummary>::new(&node));
    let now = k8s_openapi::jiff::Timestamp::now();
    let driverless = ctx.liveness.driverless_for(&node);
    let lost = ctx.observe(
        &node,
        lost_for(driverless, kubelet_of(cached_node.as_deref(), now)),
    );
    let cached = decide(
        &volume,
        ctx.claim_state(cached_claim.as_deref(), uid.as_deref(), &volume.name),
        lost,
        grace,
    );
    match cached {
        Verdict::Ignore | Verdict::Done => return Ok(Action::await_change()),
        Verdict::Alive => return Ok(Action::requeue(check)),
        Verdict::Wait(left) => return Ok(Action::requeue(left.min(check))),
        // Reported already: the uncached reads would only say so again, for every volume of a
        // lost node every few seconds, as long as their claims stay.
        Verdict::Report { .. } if reported(ctx, "report", cached_claim.as_deref()) => {
            return Ok(Action::requeue(check));
        }
        Verdict::Recover { .. } | Verdict::Release { .. }
            if ctx.settings.dry_run && ctx.was_reported(&format!("dry-run/{}", volume.name)) =>
        {
            return Ok(Action::requeue(check));
        }
        Verdict::Report { .. } | Verdict::Recover { .. } | Verdict::Release { .. } => {}
    }
    // Then from uncached reads, which must agree before anything is written.
    let (confirmed, kubelet) = ctx
        .confirm(&node)
        .await
        .map_err(err("confirming the node's loss"))?;
    let claims = Api::<ClaimSummary>::namespaced(ctx.client.clone(), &namespace);
    let fresh_claim = claims
        .get_opt(&name)
        .await
        .map_err(err("reading the claim"))?;
    let lost = ctx.observe(
        &node,
        lost_for(confirmed.zip(driverless.map(|(_, d)| d)), kubelet),
    );
    let claim_state = ctx.claim_state(fresh_claim.as_ref(), uid.as_deref(), &volume.name);
    let verdict = decide(&volume, claim_state, lost, grace);
    let claim_label = format!("{namespace}/{name}");
    let deletes = matches!(verdict, Verdict::Recover { .. } | Verdict::Release { .. });
    if deletes && !ctx.settings.dry_run && ctx.too_many_lost() {
        ctx.metrics.count("refused");
        tracing::warn!(node, volume = %volume.name, "more than half of the driver's nodes look lost: an outage, not lost nodes; nothing deleted");
        if let Some(claim) = fresh_claim.as_ref()
            && ctx.first_report(&format!("refused/{}", uid_or(claim, &claim_label)))
        {
            ctx.publish(
                claim,
                "NodeLossRecoveryRefused",
                format!(
                    "node {node} looks lost, but so do more than half of the nodes of the driver: \
                     an apiserver, network or zone outage rather than lost nodes; nothing is \
                     deleted while it lasts"
                ),
            )
            .await;
        }
        return Ok(Action::requeue(check));
    }
    match verdict {
        Verdict::Ignore | Verdict::Done => Ok(Action::await_change()),
        Verdict::Alive => Ok(Action::requeue(check)),
        Verdict::Wait(left) => Ok(Action::requeue(left.min(check))),
        Verdict::Report { loss } => {
            let Some(claim) = fresh_claim.as_ref() else {
                return Ok(Action::requeue(check));
            };
            if ctx.first_report(&format!("report/{}", uid_or(claim, &claim_label))) {
                ctx.metrics.count("reported");
                tracing::warn!(claim = %claim_label, node, loss = loss.as_str(), volume = %volume.name, "node lost; claim not opted in, left alone");
                ctx.publish(
                    claim,
                    "NodeLost",
                    format!(
                        "node {node} is lost ({}, longer than {}): volume {} cannot be used again. \
                         To let pmem-csi delete this claim, its volume and the pods using it on \
                         {node} so that the workload starts elsewhere with a new, empty volume, \
                         annotate the claim (or its StorageClass) with {RECREATE_ON_NODE_LOSS}=true; \
                         or delete them yourself",
                        loss.as_str(),
                        crate::duration::format(grace),
                        volume.name
                    ),
                )
                .await;
            }
            Ok(Action::requeue(check))
        }
        Verdict::Recover {
            loss,
            opt_in,
            delete_volume,
            remove_finalizer: _,
        } => {
            let Some(claim) = fresh_claim.as_ref() else {
                return Ok(Action::requeue(check));
            };
            let pods: Vec<Pod> = Api::<Pod>::namespaced(ctx.client.clone(), &namespace)
                .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
                .await
                .map_err(err("listing the lost node's pods"))?
                .items
                .into_iter()
                .filter(|p| uses_claim(p, &name))
                .collect();
            let pod_names: Vec<String> = pods
                .iter()
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            let what = format!(
                "claim {claim_label}, pods {pod_names:?} on {node} and{} volume {}",
                if delete_volume {
                    ""
                } else {
                    " not (reclaim policy Retain) its"
                },
                volume.name
            );
            let why = format!(
                "node {node} is lost ({}, longer than {}) and the claim opted in ({RECREATE_ON_NODE_LOSS} on its {})",
                loss.as_str(),
                crate::duration::format(grace),
                match opt_in {
                    OptIn::Claim => "claim",
                    OptIn::Class => "StorageClass",
                }
            );
            if ctx.settings.dry_run {
                if ctx.first_report(&format!("dry-run/{}", volume.name)) {
                    ctx.metrics.count("dry-run");
                    tracing::warn!(claim = %claim_label, node, "dry run: would delete {what}: {why}");
                    ctx.publish(
                        claim,
                        "NodeLossRecoveryDryRun",
                        format!(
                            "would delete {what}: {why} (--node-loss-dry-run: nothing changed)"
                        ),
                    )
                    .await;
                }
                return Ok(Action::requeue(check));
            }
            if ctx.first_report(&format!("recover/{}", uid_or(claim, &claim_label))) {
                tracing::warn!(claim = %claim_label, node, "deleting {what}: {why}");
                ctx.publish(
                    claim,
                    "NodeLossRecovery",
                    format!("deleting {what}: {why}; its workload's controller recreates them elsewhere with a new, empty volume"),
                )
                .await;
            }
            if claim.metadata.deletion_timestamp.is_none() {
                // The claim first: a StatefulSet recreating its pod waits while the claim is
                // being deleted, instead of starting the new pod on the old claim.
                if delete(&claims, &name, claim.metadata.uid.clone(), None)
                    .await
                    .map_err(err("deleting the claim"))?
                {
                    ctx.metrics.count("claim-deleted");
                }
            }
            let pod_api = Api::<Pod>::namespaced(ctx.client.clone(), &namespace);
            for pod in &pods {
                let pod_name = pod.metadata.name.clone().unwrap_or_default();
                // No kubelet will ever confirm a graceful deletion on a lost node.
                if delete(&pod_api, &pod_name, pod.metadata.uid.clone(), Some(0))
                    .await
                    .map_err(err("deleting a pod of the lost node"))?
                {
                    ctx.metrics.count("pod-deleted");
                    tracing::info!(pod = %format!("{namespace}/{pod_name}"), node, "deleted pod of a lost node");
                }
            }
            if delete_volume {
                release(ctx, &volume.name, &node, loss)
                    .await
                    .map_err(err("deleting the volume"))?;
            }
            Ok(Action::requeue(check))
        }
        Verdict::Release { loss, .. } => {
            if ctx.settings.dry_run {
                if ctx.first_report(&format!("dry-run/{}", volume.name)) {
                    ctx.metrics.count("dry-run");
                    tracing::warn!(node, volume = %volume.name, loss = loss.as_str(), "dry run: would delete the released volume of a lost node");
                }
                return Ok(Action::requeue(check));
            }
            tracing::info!(node, volume = %volume.name, loss = loss.as_str(), "deleting the released volume of a lost node");
            release(ctx, &volume.name, &node, loss)
                .await
                .map_err(err("deleting the released volume"))?;
            Ok(Action::requeue(check))
        }
    }
}

/// Whether `claim` (from the cache) was reported as `kind` this term.
fn reported(ctx: &Context, kind: &str, claim: Option<&ClaimSummary>) -> bool {
    claim
        .and_then(|c| c.metadata.uid.as_deref())
        .is_some_and(|uid| ctx.was_reported(&format!("{kind}/{uid}")))
}

fn uid_or(claim: &ClaimSummary, fallback: &str) -> String {
    claim
        .metadata
        .uid
        .clone()
        .unwrap_or_else(|| fallback.to_string())
}

/// Deletes `name` if its uid is still `uid`; false when it was gone or replaced already.
async fn delete<K>(
    api: &Api<K>,
    name: &str,
    uid: Option<String>,
    grace_period_seconds: Option<u32>,
) -> Result<bool, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = DeleteParams {
        grace_period_seconds,
        preconditions: uid.map(|uid| Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(true),
        // Gone, or replaced by a new object of the same name (uid precondition): not ours.
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Deletes the PV `name` of lost node `node` and, where the Node is gone, removes
/// external-provisioner's finalizer — decided again on a fresh read of the PV (an operator may
/// have switched it to Retain since the caches saw it), and written with its uid and
/// resourceVersion as preconditions.
async fn release(ctx: &Context, name: &str, node: &str, loss: Loss) -> Result<(), kube::Error> {
    let api = Api::<PersistentVolume>::all(ctx.client.clone());
    let Some(fresh) = api.get_opt(name).await? else {
        return Ok(());
    };
    let facts = VolumeFacts::of(&fresh, ctx.driver());
    if !facts.reclaim_delete || facts.node.as_deref() != Some(node) {
        tracing::info!(
            volume = name,
            "not deleted: its reclaim policy or node changed"
        );
        return Ok(());
    }
    let preconditions = Preconditions {
        uid: fresh.metadata.uid.clone(),
        resource_version: fresh.metadata.resource_version.clone(),
    };
    let mut resource_version = fresh.metadata.resource_version.clone();
    if !facts.deleting {
        let params = DeleteParams {
            preconditions: Some(preconditions),
            ..DeleteParams::default()
        };
        match api.delete(name, &params).await {
            Ok(either) => {
                ctx.metrics.count("volume-deleted");
                // The finalizers keep it, now marked as being deleted, at a new version.
                resource_version = either
                    .left()
                    .and_then(|pv| pv.metadata.resource_version)
                    .or(resource_version);
            }
            // Gone, or changed since the read: the next reconcile decides again.
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    if !removes_finalizer(loss, &facts) {
        return Ok(());
    }
    let finalizers: Vec<String> = fresh
        .metadata
        .finalizers
        .iter()
        .flatten()
        .filter(|f| *f != PROVISIONER_FINALIZER)
        .cloned()
        .collect();
    // The resourceVersion makes the patch fail rather than drop a finalizer added since.
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": resource_version,
            "finalizers": finalizers,
        }
    });
    match api
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {
            ctx.metrics.count("finalizer-removed");
            tracing::info!(
                volume = name,
                "removed {PROVISIONER_FINALIZER}: its node is gone"
            );
            Ok(())
        }
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use DriverlessReason::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn lost_for_table() {
        let silent = |s: Option<u64>| Kubelet::Silent { for_: s.map(S) };
        for (name, driverless, kubelet, want) in [
            ("driver may run", None, Kubelet::NodeGone, None),
            (
                "node deleted",
                Some((NodeMissing, S(50))),
                Kubelet::NodeGone,
                Some((Loss::NodeDeleted, S(50))),
            ),
            (
                "deleted after its heartbeat stopped",
                Some((HeartbeatExpired, S(70))),
                Kubelet::NodeGone,
                Some((Loss::NodeDeleted, S(70))),
            ),
            (
                "heartbeat expired, kubelet reporting (Ready or not): not lost",
                Some((HeartbeatExpired, S(7000))),
                Kubelet::Reporting,
                None,
            ),
            (
                "heartbeat expired, kubelet not ready for less",
                Some((HeartbeatExpired, S(7000))),
                silent(Some(30)),
                Some((Loss::Silent, S(30))),
            ),
            (
                "kubelet not ready for longer than the heartbeat",
                Some((HeartbeatExpired, S(20))),
                silent(Some(300)),
                Some((Loss::Silent, S(20))),
            ),
            (
                "kubelet silent since an unknown time",
                Some((HeartbeatExpired, S(20))),
                silent(None),
                Some((Loss::Silent, S(20))),
            ),
            (
                "label removed: no loss",
                Some((NotSelectedNoCsiNodeEntry, S(9000))),
                silent(None),
                None,
            ),
            (
                "caches say gone, API server has it",
                Some((NodeMissing, S(9000))),
                silent(Some(9000)),
                None,
            ),
        ] {
            assert_eq!(lost_for(driverless, kubelet), want, "{name}");
        }
    }

    #[test]
    fn kubelet_of_reads_the_ready_condition() {
        use crate::node_summary::ReadyCondition;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let now = k8s_openapi::jiff::Timestamp::now();
        let node = |status: Option<&str>| NodeSummary {
            ready: status.map(|s| ReadyCondition {
                status: s.into(),
                last_transition_time: Some(Time(
                    now - k8s_openapi::jiff::SignedDuration::from_secs(90),
                )),
            }),
            ..Default::default()
        };
        assert_eq!(kubelet_of(None, now), Kubelet::NodeGone);
        assert_eq!(
            kubelet_of(Some(&node(Some("True"))), now),
            Kubelet::Reporting
        );
        assert_eq!(
            kubelet_of(Some(&node(Some("False"))), now),
            Kubelet::Reporting,
            "a False Ready comes from a kubelet that runs"
        );
        assert_eq!(
            kubelet_of(Some(&node(Some("Unknown"))), now),
            Kubelet::Silent { for_: Some(S(90)) }
        );
        assert_eq!(kubelet_of(Some(&node(None)), now), Kubelet::Reporting);
    }

    #[test]
    fn opt_in_table() {
        for (claim, class, want) in [
            (None, None, None),
            (Some("true"), None, Some(OptIn::Claim)),
            (Some("true"), Some("false"), Some(OptIn::Claim)),
            (Some("false"), Some("true"), None),
            (Some("yes"), Some("true"), None),
            (None, Some("true"), Some(OptIn::Class)),
            (None, Some("TRUE"), None),
        ] {
            assert_eq!(opt_in(claim, class), want, "{claim:?} {class:?}");
        }
    }

    fn volume(reclaim_delete: bool, deleting: bool, finalizer: bool) -> VolumeFacts {
        VolumeFacts {
            name: "pvc-1".into(),
            node: Some("n1".into()),
            reclaim_delete,
            deleting,
            provisioner_finalizer: finalizer,
            claim: Some(("ns".into(), "data".into(), Some("u1".into()))),
        }
    }

    #[test]
    fn decide_table() {
        let grace = S(3600);
        let deleted = Some((Loss::NodeDeleted, S(3600)));
        let silent = Some((Loss::Silent, S(4000)));
        let opted = ClaimState::Present {
            opt_in: Some(OptIn::Class),
        };
        let not_opted = ClaimState::Present { opt_in: None };
        let v = volume(true, false, true);
        let other_driver = VolumeFacts {
            node: None,
            ..v.clone()
        };
        let unclaimed = VolumeFacts {
            claim: None,
            ..v.clone()
        };
        for (name, volume, claim, lost, want) in [
            (
                "other driver",
                &other_driver,
                opted,
                deleted,
                Verdict::Ignore,
            ),
            ("no claimRef", &unclaimed, opted, deleted, Verdict::Ignore),
            ("alive", &v, opted, None, Verdict::Alive),
            (
                "lost, within the grace",
                &v,
                opted,
                Some((Loss::NodeDeleted, S(600))),
                Verdict::Wait(S(3000)),
            ),
            (
                "not opted in",
                &v,
                not_opted,
                deleted,
                Verdict::Report {
                    loss: Loss::NodeDeleted,
                },
            ),
            (
                "opted in, node deleted",
                &v,
                opted,
                deleted,
                Verdict::Recover {
                    loss: Loss::NodeDeleted,
                    opt_in: OptIn::Class,
                    delete_volume: true,
                    remove_finalizer: true,
                },
            ),
            (
                "opted in, node silent: the finalizer stays for its driver",
                &v,
                opted,
                silent,
                Verdict::Recover {
                    loss: Loss::Silent,
                    opt_in: OptIn::Class,
                    delete_volume: true,
                    remove_finalizer: false,
                },
            ),
            (
                "opted in, Retain: the volume stays",
                &volume(false, false, true),
                opted,
                deleted,
                Verdict::Recover {
                    loss: Loss::NodeDeleted,
                    opt_in: OptIn::Class,
                    delete_volume: false,
                    remove_finalizer: false,
                },
            ),
            (
                "claim gone, Delete",
                &v,
                ClaimState::Gone,
                deleted,
                Verdict::Release {
                    loss: Loss::NodeDeleted,
                    delete: true,
                    remove_finalizer: true,
                },
            ),
            (
                "claim gone, being deleted, finalizer left on a deleted node",
                &volume(true, true, true),
                ClaimState::Gone,
                deleted,
                Verdict::Release {
                    loss: Loss::NodeDeleted,
                    delete: false,
                    remove_finalizer: true,
                },
            ),
            (
                "claim gone, being deleted, node silent: its driver finishes",
                &volume(true, true, true),
                ClaimState::Gone,
                silent,
                Verdict::Done,
            ),
            (
                "claim gone, node silent: deletion requested",
                &v,
                ClaimState::Gone,
                silent,
                Verdict::Release {
                    loss: Loss::Silent,
                    delete: true,
                    remove_finalizer: false,
                },
            ),
            (
                "claim of that name bound to another volume",
                &v,
                ClaimState::Elsewhere,
                deleted,
                Verdict::Done,
            ),
            (
                "claim gone, Retain",
                &volume(false, false, true),
                ClaimState::Gone,
                deleted,
                Verdict::Done,
            ),
            (
                "claim gone, finalizer already removed",
                &volume(true, true, false),
                ClaimState::Gone,
                deleted,
                Verdict::Done,
            ),
        ] {
            assert_eq!(decide(volume, claim, lost, grace), want, "{name}");
        }
    }

    #[test]
    fn the_loss_clock_counts_from_the_loss_it_sees() {
        let t0 = Instant::now();
        let mut clock = LossClock::default();
        // Driverless for hours (label removed, heartbeat gone), deleted only now: lost for 0 s.
        assert_eq!(
            clock.observe("n1", Some((Loss::NodeDeleted, S(7200))), t0),
            Some((Loss::NodeDeleted, S(0)))
        );
        assert_eq!(
            clock.observe("n1", Some((Loss::NodeDeleted, S(7260))), t0 + S(60)),
            Some((Loss::NodeDeleted, S(60)))
        );
        // The view's own duration stays the bound where it is shorter.
        assert_eq!(
            clock.observe("n1", Some((Loss::NodeDeleted, S(30))), t0 + S(90)),
            Some((Loss::NodeDeleted, S(30)))
        );
        assert_eq!(clock.lost(), (1, 1));
        // Another kind of loss starts again; a node back is forgotten.
        assert_eq!(
            clock.observe("n1", Some((Loss::Silent, S(900))), t0 + S(100)),
            Some((Loss::Silent, S(0)))
        );
        assert_eq!(clock.lost(), (1, 0));
        assert_eq!(clock.observe("n1", None, t0 + S(110)), None);
        assert_eq!(
            clock.observe("n1", Some((Loss::Silent, S(900))), t0 + S(120)),
            Some((Loss::Silent, S(0)))
        );
    }

    #[test]
    fn too_many_lost_table() {
        // (lost, of them deleted, nodes that exist and match the selector, hold back)
        for (lost, deleted, selected, want) in [
            (1, 1, 3, false),
            (1, 1, 1, false),
            (2, 2, 1, true),
            (2, 0, 4, false),
            (3, 0, 4, true),
            (0, 0, 0, false),
        ] {
            assert_eq!(
                too_many_lost(lost, deleted, selected),
                want,
                "{lost} lost ({deleted} deleted) of {selected}"
            );
        }
    }

    #[test]
    fn uses_claim_table() {
        use crate::test_objects::{claim_volume, generic_ephemeral_volume, pod};
        let p = pod(
            "ns",
            "web-0",
            vec![
                claim_volume("data", "data-web-0"),
                generic_ephemeral_volume("scratch", "sc", "1Gi"),
            ],
        );
        assert!(uses_claim(&p, "data-web-0"));
        assert!(uses_claim(&p, "web-0-scratch"));
        assert!(!uses_claim(&p, "data"));
        assert!(!uses_claim(&p, "web-0-data"));
    }

    #[test]
    fn check_every_is_bounded() {
        assert_eq!(check_every(S(3600)), S(30));
        assert_eq!(check_every(S(100)), S(10));
        assert_eq!(check_every(S(2)), S(1));
    }

    #[test]
    fn volume_facts_of_a_provisioned_pv() {
        let mut pv =
            crate::test_objects::csi_volume("pvc-1", "pmem-csi.intel.com", "h", Some("n1"));
        pv.metadata.finalizers = Some(vec![
            "kubernetes.io/pv-protection".into(),
            PROVISIONER_FINALIZER.into(),
        ]);
        let spec = pv.spec.get_or_insert_with(Default::default);
        spec.persistent_volume_reclaim_policy = Some("Delete".into());
        spec.claim_ref = Some(k8s_openapi::api::core::v1::ObjectReference {
            namespace: Some("ns".into()),
            name: Some("data".into()),
            uid: Some("u1".into()),
            ..Default::default()
        });
        assert_eq!(
            VolumeFacts::of(&pv, "pmem-csi.intel.com"),
            VolumeFacts {
                name: "pvc-1".into(),
                node: Some("n1".into()),
                reclaim_delete: true,
                deleting: false,
                provisioner_finalizer: true,
                claim: Some(("ns".into(), "data".into(), Some("u1".into()))),
            }
        );
        assert_eq!(VolumeFacts::of(&pv, "other.driver").node, None);
    }
}
