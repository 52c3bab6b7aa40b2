//! Node-loss recovery (opt-in with `--node-loss-grace`, leader only): when the node of one of
//! this driver's volumes is lost for good, the claims that opted in
//! ([`RECREATE_ON_NODE_LOSS`]) are released so that their workloads start elsewhere with a
//! new, empty volume — the claim, its volume and the lost node's pods using it are deleted, and
//! the workload's controller (a StatefulSet's, typically) recreates claim and pod. Claims that
//! did not opt in are reported with an Event saying what an operator can do, never touched.
//!
//! A node is lost when its Node object is gone (and, with heartbeats, its driver's heartbeat
//! has expired too: a Node deleted while its driver still renews is being re-registered or was
//! deleted by mistake), or when its driver's heartbeat has expired *and* its kubelet stopped
//! reporting (condition Ready is Unknown): a node whose kubelet still reports — Ready or not —
//! may run pods that use their volumes, however long its driver crash-loops, and deleting a
//! claim there would throw their data away. A silent node may be partitioned rather than dead,
//! still writing: it is acted on only once an operator has fenced it and says so with the
//! `node.kubernetes.io/out-of-service` taint ([`Fence`]), unless `--node-loss-unfenced` waives
//! that. The grace counts from the moment this leader first saw the node lost *that way* (a
//! [`LossClock`]: a Node deleted hours after its driver stopped is lost from its deletion on),
//! never earlier than the liveness view and the kubelet's own transition say; a new leader
//! starts it again.
//!
//! Every action is preceded by uncached reads that must agree, and two brakes hold it back:
//! nothing is deleted while more than half of the driver's nodes look lost — every node that
//! matches the selector, and every deleted node that still holds a volume, judged by the same
//! rule from the liveness view and confirmed by an uncached Node list ([`Headcount`]) — which
//! is an apiserver, network or zone outage rather than lost nodes; and at most
//! `--node-loss-max-nodes-per-hour` nodes are recovered in any hour ([`RecoveryBudget`]).
//!
//! The decision ([`decide`]) is a pure function of plain facts; the controller around it reads
//! the caches, confirms, and writes.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
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
use crate::liveness::{DriverlessReason, HeartbeatState};
use crate::liveness_view::{LivenessView, observation};
use crate::node_summary::NodeSummary;
use crate::reconcile_metrics::ReconcileMetrics;
use crate::stores::{Stores, trim};
use crate::volume_facts::pv_node;
use crate::well_known::{PROVISIONER_FINALIZER, RECREATE_ON_NODE_LOSS, heartbeat_lease_name};

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
/// driver has looked absent), its driver's heartbeat and its kubelet.
pub fn lost_for(
    driverless: Option<(DriverlessReason, Duration)>,
    heartbeat: HeartbeatState,
    kubelet: Kubelet,
) -> Option<(Loss, Duration)> {
    let (reason, driverless_for) = driverless?;
    match (reason, kubelet) {
        // A deleted Node whose driver still renews its heartbeat: its kubelet re-registers it,
        // or it was deleted by mistake while its pods and volumes still serve.
        (_, Kubelet::NodeGone) if heartbeat == HeartbeatState::Fresh => None,
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

/// Whether a silent node may be acted on: a kubelet that stopped reporting may belong to a node
/// that is cut off, not dead, whose pods still write; force-deleting them frees their other
/// volumes to attach elsewhere while it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// The Node carries the `node.kubernetes.io/out-of-service` taint: an operator fenced it.
    Tainted,
    /// No taint: a silent node waits for one.
    Absent,
    /// `--node-loss-unfenced`: silent nodes are acted on without the taint (dangerous).
    Waived,
}

impl Fence {
    /// The fence of `node` (`None`: no Node object), `waived` by `--node-loss-unfenced`.
    pub fn of(node: Option<&NodeSummary>, waived: bool) -> Self {
        match node {
            Some(n) if n.out_of_service => Fence::Tainted,
            _ if waived => Fence::Waived,
            _ => Fence::Absent,
        }
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

    /// Forgets every node for which `keep` says no (nodes that no volume names any more).
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.since.retain(|node, _| keep(node));
    }

    /// How many nodes it remembers.
    pub fn len(&self) -> usize {
        self.since.len()
    }

    /// Whether it remembers none.
    pub fn is_empty(&self) -> bool {
        self.since.is_empty()
    }
}

/// The outage guard's count: the driver's nodes, and how many of them look lost now (by
/// [`lost_for`]'s rule, however briefly: the guard is about how many, not how long).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Headcount {
    /// Every node that matches the selector, and every deleted node that still holds a volume.
    pub nodes: usize,
    /// Those of them that look lost.
    pub lost: usize,
}

impl Headcount {
    /// Counts one node of the driver.
    pub fn add(&mut self, lost: bool) {
        self.nodes += 1;
        self.lost += usize::from(lost);
    }

    /// Whether recovery must hold back: more than half of the driver's nodes look lost at
    /// once. That is an apiserver, network or zone outage, not nodes lost for good.
    pub fn too_many_lost(&self) -> bool {
        self.lost * 2 > self.nodes
    }
}

/// Whether a PV still serves a claim: it has a claimRef and is not Released or Failed (a PV
/// kept by reclaim policy Retain long after its claim and node are gone serves nobody, and
/// must not count its node towards the [`Headcount`] for ever).
pub fn serves_a_claim(pv: &PersistentVolume) -> bool {
    let phase = pv.status.as_ref().and_then(|s| s.phase.as_deref());
    pv.spec.as_ref().is_some_and(|s| s.claim_ref.is_some())
        && !matches!(phase, Some("Released" | "Failed"))
}

/// Whether a node counts towards the [`Headcount`]: a Node that exists and matches the
/// selector, or a node without a Node object that a volume of the driver still serving a
/// claim names.
pub fn counted(exists: bool, selected: bool, holds_volumes: bool) -> bool {
    if exists { selected } else { holds_volumes }
}

/// The nodes recovered in the last hour (`--node-loss-max-nodes-per-hour`): an absolute brake
/// beside the [`Headcount`], for losses that come one after another rather than at once.
#[derive(Debug, Default)]
pub struct RecoveryBudget {
    started: HashMap<String, Instant>,
}

/// The window of [`RecoveryBudget`].
pub const BUDGET_WINDOW: Duration = Duration::from_secs(3600);

impl RecoveryBudget {
    /// Whether recovery may act on `node` at `now` with at most `per_hour` nodes in any hour;
    /// records it when it may. A node begun within the hour goes on (its other volumes).
    pub fn admit(&mut self, node: &str, now: Instant, per_hour: u32) -> bool {
        self.started
            .retain(|_, at| now.saturating_duration_since(*at) < BUDGET_WINDOW);
        if self.started.contains_key(node) {
            return true;
        }
        if self.started.len() >= usize::try_from(per_hour).unwrap_or(usize::MAX) {
            return false;
        }
        self.started.insert(node.to_string(), now);
        true
    }
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
    /// The node is silent and something would be deleted, but it is not fenced (no
    /// out-of-service taint): report what the operator can do, touch nothing.
    AwaitFence,
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
/// `lost` says ([`lost_for`]) and fenced as `fence` says, with recovery after `grace`.
pub fn decide(
    volume: &VolumeFacts,
    claim: ClaimState,
    lost: Option<(Loss, Duration)>,
    fence: Fence,
    grace: Duration,
) -> Verdict {
    let verdict = decide_unfenced(volume, claim, lost, grace);
    match verdict {
        Verdict::Recover {
            loss: Loss::Silent, ..
        }
        | Verdict::Release {
            loss: Loss::Silent, ..
        } if fence == Fence::Absent => Verdict::AwaitFence,
        verdict => verdict,
    }
}

/// [`decide`] as if every silent node were fenced.
fn decide_unfenced(
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

/// The recovery's flags, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeLossSettings {
    /// How long a node must be lost before its opted-in claims are recovered
    /// (`--node-loss-grace`).
    pub grace: Duration,
    /// Only report what would be done (`--node-loss-dry-run`).
    pub dry_run: bool,
    /// At most this many nodes recovered in any hour (`--node-loss-max-nodes-per-hour`).
    pub max_nodes_per_hour: u32,
    /// Act on silent nodes without the out-of-service taint (`--node-loss-unfenced`).
    pub unfenced: bool,
}

/// The default of `--node-loss-max-nodes-per-hour`.
pub const DEFAULT_MAX_NODES_PER_HOUR: u32 = 2;

/// What the recovery did, by action
/// (`pmem_csi_node_loss_actions_total{action}`): `reported` (a claim that did not opt in),
/// `dry-run` (what would have been done), `refused` (more than half of the nodes look lost),
/// `capped` (the hourly node budget is spent), `awaiting-fence` (a silent node without the
/// out-of-service taint), `claim-deleted`, `pod-deleted`, `volume-deleted`,
/// `finalizer-removed`.
#[derive(Clone, Debug)]
pub struct NodeLossMetrics {
    actions: Family<ActionLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabels {
    action: String,
}

/// Every action label, so that dashboards see each series at zero.
const ACTIONS: [&str; 9] = [
    "reported",
    "dry-run",
    "refused",
    "capped",
    "awaiting-fence",
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
    /// This term's PVs (the recovery's own watch).
    volumes: reflector::Store<PersistentVolume>,
    liveness: LivenessView,
    settings: NodeLossSettings,
    recorder: Recorder,
    metrics: NodeLossMetrics,
    instrument: Instrument<PersistentVolume>,
    /// What was already reported this term, one Event each: `<kind>/<claim uid or volume>`,
    /// with the PV it was about (forgotten when that PV is gone).
    reported: Mutex<HashMap<String, String>>,
    /// Since when each node has looked lost, and how.
    clock: Mutex<LossClock>,
    /// Uncached confirmations per node, reused for a few seconds: a lost node with many
    /// volumes is read once, not once per volume.
    confirmed: Mutex<HashMap<String, Confirmation>>,
    /// The latest uncached [`Headcount`], reused for a few seconds like a confirmation.
    headcount: Mutex<Option<(Instant, Headcount)>>,
    /// The nodes recovered in the last hour.
    budget: Mutex<RecoveryBudget>,
    /// When `reported` and `clock` were last pruned.
    pruned: Mutex<Option<Instant>>,
}

/// An uncached confirmation of a node: when, why it is driverless (if it is), its heartbeat,
/// its kubelet and its fence.
type Confirmation = (Instant, NodeLook);

/// What is known of one node at one instant.
#[derive(Clone, Copy, Debug)]
struct NodeLook {
    reason: Option<DriverlessReason>,
    heartbeat: HeartbeatState,
    kubelet: Kubelet,
    fence: Fence,
}

/// How long an uncached confirmation of a node is reused.
const CONFIRMATION_REUSED_FOR: Duration = Duration::from_secs(5);

/// Why a deletion was held back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Brake {
    /// More than half of the driver's nodes look lost.
    Outage(Headcount),
    /// The hourly node budget is spent.
    Budget(u32),
}

/// The recovery's dependencies.
pub struct NodeLossRecovery {
    /// The process client.
    pub client: kube::Client,
    /// The shared caches.
    pub stores: Stores,
    /// The liveness view.
    pub liveness: LivenessView,
    /// Grace, dry-run and brakes.
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
            volumes: reader.clone(),
            liveness: self.liveness,
            settings: self.settings,
            metrics: self.metrics,
            instrument: Instrument::new(CONTROLLER, self.reconciles),
            reported: Mutex::default(),
            clock: Mutex::default(),
            confirmed: Mutex::default(),
            headcount: Mutex::default(),
            budget: Mutex::default(),
            pruned: Mutex::default(),
        });
        tracing::info!(
            grace = ?self.settings.grace,
            dry_run = self.settings.dry_run,
            max_nodes_per_hour = self.settings.max_nodes_per_hour,
            unfenced = self.settings.unfenced,
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Context {
    fn driver(&self) -> &str {
        &self.liveness.settings().driver
    }

    /// The class's opt-in value, from the cache.
    fn cached_class_value(&self, claim: &ClaimSummary) -> Option<String> {
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

    /// The class's opt-in value, read uncached: an operator who just took the class's opt-in
    /// back must not lose a claim to a stale cache.
    async fn fresh_class_value(&self, claim: &ClaimSummary) -> Result<Option<String>, kube::Error> {
        let Some(class) = claim
            .spec
            .as_ref()
            .and_then(|s| s.storage_class_name.as_deref())
        else {
            return Ok(None);
        };
        let class = Api::<StorageClass>::all(self.client.clone())
            .get_opt(class)
            .await?;
        Ok(class.and_then(|c| {
            c.metadata
                .annotations
                .and_then(|mut a| a.remove(RECREATE_ON_NODE_LOSS))
        }))
    }

    /// The state of `claim` (cached or fresh), whose class's opt-in value is `class_value`.
    fn claim_state(
        &self,
        claim: Option<&ClaimSummary>,
        uid: Option<&str>,
        volume: &str,
        class_value: Option<&str>,
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
            opt_in: opt_in(own, class_value),
        }
    }

    /// The clock's view of `node` now (see [`LossClock::observe`]).
    fn observe(&self, node: &str, lost: Option<(Loss, Duration)>) -> Option<(Loss, Duration)> {
        lock(&self.clock).observe(node, lost, Instant::now())
    }

    /// The nodes that this driver's volumes name (`serving`: only volumes that still serve a
    /// claim, [`serves_a_claim`]).
    fn volume_nodes(&self, serving: bool) -> HashSet<String> {
        let driver = self.driver();
        self.volumes
            .state()
            .iter()
            .filter(|pv| !serving || serves_a_claim(pv))
            .filter_map(|pv| pv_node(pv, driver))
            .collect()
    }

    /// The [`Headcount`] from the caches and the liveness view.
    fn cached_headcount(&self) -> Headcount {
        let selector = &self.liveness.settings().selector;
        let now = k8s_openapi::jiff::Timestamp::now();
        let mut count = Headcount::default();
        let mut existing = HashSet::new();
        for node in self.stores.nodes.state() {
            let name = node.metadata.name.clone().unwrap_or_default();
            if counted(true, selector.matches(node.metadata.labels.as_ref()), false) {
                let heartbeat = self.liveness.observe(&name).heartbeat;
                let kubelet = kubelet_of(Some(&node), now);
                count.add(
                    lost_for(self.liveness.driverless_for(&name), heartbeat, kubelet).is_some(),
                );
            }
            existing.insert(name);
        }
        for name in self.volume_nodes(true).difference(&existing) {
            let heartbeat = self.liveness.observe(name).heartbeat;
            let driverless = self.liveness.driverless_for(name);
            count.add(lost_for(driverless, heartbeat, Kubelet::NodeGone).is_some());
        }
        count
    }

    /// The [`Headcount`] from an uncached list of Nodes (and heartbeat Leases), reused for
    /// [`CONFIRMATION_REUSED_FOR`].
    async fn fresh_headcount(&self) -> Result<Headcount, kube::Error> {
        let now = Instant::now();
        if let Some((at, count)) = *lock(&self.headcount)
            && now.saturating_duration_since(at) < CONFIRMATION_REUSED_FOR
        {
            return Ok(count);
        }
        let settings = self.liveness.settings();
        let nodes = Api::<NodeSummary>::all(self.client.clone())
            .list(&ListParams::default())
            .await?
            .items;
        let leases: HashMap<String, Lease> = match settings.heartbeat {
            Some(_) => Api::<Lease>::namespaced(self.client.clone(), &settings.namespace)
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .filter_map(|l| Some((l.metadata.name.clone()?, l)))
                .collect(),
            None => HashMap::new(),
        };
        let heartbeat = |node: &str| {
            self.liveness.heartbeat(
                node,
                settings
                    .heartbeat
                    .map(|_| leases.get(&heartbeat_lease_name(&settings.driver, node))),
            )
        };
        let wall = k8s_openapi::jiff::Timestamp::now();
        let mut count = Headcount::default();
        let mut existing = HashSet::new();
        for node in &nodes {
            let name = node.metadata.name.clone().unwrap_or_default();
            if counted(
                true,
                settings.selector.matches(node.metadata.labels.as_ref()),
                false,
            ) {
                let heartbeat = heartbeat(&name);
                let reason = crate::liveness::driverless_now(&observation(
                    settings,
                    Some(node),
                    None,
                    heartbeat,
                ));
                let lost = lost_for(
                    reason.map(|r| (r, Duration::ZERO)),
                    heartbeat,
                    kubelet_of(Some(node), wall),
                );
                count.add(lost.is_some());
            }
            existing.insert(name);
        }
        for name in self.volume_nodes(true).difference(&existing) {
            let driverless = Some((DriverlessReason::NodeMissing, Duration::ZERO));
            count.add(lost_for(driverless, heartbeat(name), Kubelet::NodeGone).is_some());
        }
        *lock(&self.headcount) = Some((now, count));
        Ok(count)
    }

    /// Whether a deletion on `node` must be held back: an outage by the caches, then by an
    /// uncached count; then the hourly budget (which this records `node` in when it admits).
    async fn brake(&self, node: &str) -> Result<Option<Brake>, kube::Error> {
        let cached = self.cached_headcount();
        if cached.too_many_lost() {
            return Ok(Some(Brake::Outage(cached)));
        }
        let fresh = self.fresh_headcount().await?;
        if fresh.too_many_lost() {
            return Ok(Some(Brake::Outage(fresh)));
        }
        let per_hour = self.settings.max_nodes_per_hour;
        if !lock(&self.budget).admit(node, Instant::now(), per_hour) {
            return Ok(Some(Brake::Budget(per_hour)));
        }
        Ok(None)
    }

    /// Uncached: why the driver does not run on `node`, its heartbeat, its kubelet and its
    /// fence (reused for [`CONFIRMATION_REUSED_FOR`]).
    async fn confirm(&self, node: &str) -> Result<NodeLook, kube::Error> {
        let now = Instant::now();
        if let Some((at, look)) = lock(&self.confirmed).get(node)
            && now.saturating_duration_since(*at) < CONFIRMATION_REUSED_FOR
        {
            return Ok(*look);
        }
        let (reason, heartbeat, fresh) = self.liveness.confirm_node(&self.client, node).await?;
        let look = NodeLook {
            reason,
            heartbeat,
            kubelet: kubelet_of(fresh.as_ref(), k8s_openapi::jiff::Timestamp::now()),
            fence: Fence::of(fresh.as_ref(), self.settings.unfenced),
        };
        let mut confirmed = lock(&self.confirmed);
        confirmed.retain(|_, (at, _)| now.saturating_duration_since(*at) < CONFIRMATION_REUSED_FOR);
        confirmed.insert(node.to_string(), (now, look));
        Ok(look)
    }

    /// Whether `key` was reported this term.
    fn was_reported(&self, key: &str) -> bool {
        lock(&self.reported).contains_key(key)
    }

    /// Records `key` as reported about `volume`; false when it already was this term.
    fn first_report(&self, key: &str, volume: &str) -> bool {
        lock(&self.reported)
            .insert(key.to_string(), volume.to_string())
            .is_none()
    }

    /// Forgets reports about PVs that are gone and loss clocks of nodes that no PV names, at
    /// most every [`CHECK_AT_MOST_EVERY`].
    fn prune(&self) {
        let now = Instant::now();
        {
            let mut pruned = lock(&self.pruned);
            if pruned.is_some_and(|at| now.saturating_duration_since(at) < CHECK_AT_MOST_EVERY) {
                return;
            }
            *pruned = Some(now);
        }
        let volumes: HashSet<String> = self
            .volumes
            .state()
            .iter()
            .filter_map(|pv| pv.metadata.name.clone())
            .collect();
        lock(&self.reported).retain(|_, volume| volumes.contains(volume));
        let nodes = self.volume_nodes(false);
        lock(&self.clock).retain(|node| nodes.contains(node));
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

/// One PV's volume, with its node and claim.
struct Subject {
    volume: VolumeFacts,
    node: String,
    namespace: String,
    name: String,
    uid: Option<String>,
}

impl Subject {
    fn claim_label(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    fn err(&self, op: &str) -> impl FnOnce(kube::Error) -> NodeLossError + use<> {
        let (op, volume) = (op.to_string(), self.volume.name.clone());
        move |source| NodeLossError { op, volume, source }
    }
}

async fn recover(pv: &PersistentVolume, ctx: &Context) -> Result<Action, NodeLossError> {
    ctx.prune();
    let volume = VolumeFacts::of(pv, ctx.driver());
    let (Some(node), Some((namespace, name, uid))) = (volume.node.clone(), volume.claim.clone())
    else {
        return Ok(Action::await_change());
    };
    let s = Subject {
        volume,
        node,
        namespace,
        name,
        uid,
    };
    let check = check_every(ctx.settings.grace);
    if let Some(action) = judge_cached(&s, ctx) {
        return Ok(action);
    }
    // Then from uncached reads, which must agree before anything is written.
    let (verdict, fresh_claim) = judge_fresh(&s, ctx).await?;
    let deletes = matches!(verdict, Verdict::Recover { .. } | Verdict::Release { .. });
    if deletes && !ctx.settings.dry_run {
        let brake = ctx
            .brake(&s.node)
            .await
            .map_err(s.err("counting the driver's lost nodes"))?;
        if let Some(brake) = brake {
            held_back(&s, ctx, brake, fresh_claim.as_ref()).await;
            return Ok(Action::requeue(check));
        }
    }
    match verdict {
        Verdict::Ignore | Verdict::Done => Ok(Action::await_change()),
        Verdict::Alive => Ok(Action::requeue(check)),
        Verdict::Wait(left) => Ok(Action::requeue(left.min(check))),
        Verdict::Report { loss } => {
            if let Some(claim) = fresh_claim.as_ref() {
                report(&s, ctx, claim, loss).await;
            }
            Ok(Action::requeue(check))
        }
        Verdict::AwaitFence => {
            if let Some(claim) = fresh_claim.as_ref() {
                await_fence(&s, ctx, claim).await;
            }
            Ok(Action::requeue(check))
        }
        Verdict::Recover {
            loss,
            opt_in,
            delete_volume,
            remove_finalizer: _,
        } => {
            if let Some(claim) = fresh_claim.as_ref() {
                recover_claim(&s, ctx, claim, loss, opt_in, delete_volume).await?;
            }
            Ok(Action::requeue(check))
        }
        Verdict::Release { loss, .. } => {
            release_volume(&s, ctx, loss).await?;
            Ok(Action::requeue(check))
        }
    }
}

/// The verdict from the caches, when it settles the reconcile without uncached reads: the
/// action to return.
fn judge_cached(s: &Subject, ctx: &Context) -> Option<Action> {
    let check = check_every(ctx.settings.grace);
    let cached_claim = ctx
        .stores
        .claims
        .get(&ObjectRef::<ClaimSummary>::new(&s.name).within(&s.namespace));
    // The Node cache keeps its Ready condition and taints.
    let cached_node = ctx
        .stores
        .nodes
        .get(&ObjectRef::<NodeSummary>::new(&s.node));
    let now = k8s_openapi::jiff::Timestamp::now();
    let heartbeat = ctx.liveness.observe(&s.node).heartbeat;
    let lost = ctx.observe(
        &s.node,
        lost_for(
            ctx.liveness.driverless_for(&s.node),
            heartbeat,
            kubelet_of(cached_node.as_deref(), now),
        ),
    );
    let class_value = cached_claim
        .as_deref()
        .and_then(|c| ctx.cached_class_value(c));
    let cached = decide(
        &s.volume,
        ctx.claim_state(
            cached_claim.as_deref(),
            s.uid.as_deref(),
            &s.volume.name,
            class_value.as_deref(),
        ),
        lost,
        Fence::of(cached_node.as_deref(), ctx.settings.unfenced),
        ctx.settings.grace,
    );
    match cached {
        Verdict::Ignore | Verdict::Done => Some(Action::await_change()),
        Verdict::Alive => Some(Action::requeue(check)),
        Verdict::Wait(left) => Some(Action::requeue(left.min(check))),
        // Reported already: the uncached reads would only say so again, for every volume of a
        // lost node every few seconds, as long as their claims stay.
        Verdict::Report { .. } if reported(ctx, "report", cached_claim.as_deref()) => {
            Some(Action::requeue(check))
        }
        Verdict::AwaitFence if reported(ctx, "unfenced", cached_claim.as_deref()) => {
            Some(Action::requeue(check))
        }
        Verdict::Recover { .. } | Verdict::Release { .. }
            if ctx.settings.dry_run && ctx.was_reported(&format!("dry-run/{}", s.volume.name)) =>
        {
            Some(Action::requeue(check))
        }
        Verdict::Report { .. }
        | Verdict::AwaitFence
        | Verdict::Recover { .. }
        | Verdict::Release { .. } => None,
    }
}

/// The verdict from uncached reads of the node, the claim and its class, with the claim read.
async fn judge_fresh(
    s: &Subject,
    ctx: &Context,
) -> Result<(Verdict, Option<ClaimSummary>), NodeLossError> {
    let look = ctx
        .confirm(&s.node)
        .await
        .map_err(s.err("confirming the node's loss"))?;
    let fresh_claim = Api::<ClaimSummary>::namespaced(ctx.client.clone(), &s.namespace)
        .get_opt(&s.name)
        .await
        .map_err(s.err("reading the claim"))?;
    let class_value = match fresh_claim.as_ref() {
        Some(claim) => ctx
            .fresh_class_value(claim)
            .await
            .map_err(s.err("reading the claim's StorageClass"))?,
        None => None,
    };
    let driverless = ctx.liveness.driverless_for(&s.node);
    let lost = ctx.observe(
        &s.node,
        lost_for(
            look.reason.zip(driverless.map(|(_, d)| d)),
            look.heartbeat,
            look.kubelet,
        ),
    );
    let claim_state = ctx.claim_state(
        fresh_claim.as_ref(),
        s.uid.as_deref(),
        &s.volume.name,
        class_value.as_deref(),
    );
    let verdict = decide(&s.volume, claim_state, lost, look.fence, ctx.settings.grace);
    Ok((verdict, fresh_claim))
}

/// Reports (once per claim and brake) that a deletion was held back.
async fn held_back(s: &Subject, ctx: &Context, brake: Brake, claim: Option<&ClaimSummary>) {
    let node = &s.node;
    let (action, key, note) = match brake {
        Brake::Outage(count) => (
            "refused",
            "refused",
            format!(
                "node {node} looks lost, but so do {} of the driver's {} nodes (more than half): \
                 an apiserver, network or zone outage rather than lost nodes; nothing is deleted \
                 while it lasts",
                count.lost, count.nodes
            ),
        ),
        Brake::Budget(per_hour) => (
            "capped",
            "capped",
            format!(
                "node {node} is lost, but {per_hour} nodes were recovered within the last hour \
                 (--node-loss-max-nodes-per-hour): nothing is deleted on it until the hour frees \
                 a place, or an operator deletes the claim"
            ),
        ),
    };
    tracing::warn!(node, volume = %s.volume.name, count = ?brake, "node-loss recovery held back: {note}");
    let Some(claim) = claim else {
        return;
    };
    if ctx.first_report(
        &format!("{key}/{}", uid_or(claim, &s.claim_label())),
        &s.volume.name,
    ) {
        ctx.metrics.count(action);
        ctx.publish(claim, "NodeLossRecoveryRefused", note).await;
    }
}

/// Reports (once) that the node is lost and `claim` did not opt in.
async fn report(s: &Subject, ctx: &Context, claim: &ClaimSummary, loss: Loss) {
    let (node, label) = (&s.node, s.claim_label());
    if !ctx.first_report(&format!("report/{}", uid_or(claim, &label)), &s.volume.name) {
        return;
    }
    ctx.metrics.count("reported");
    tracing::warn!(claim = %label, node, loss = loss.as_str(), volume = %s.volume.name, "node lost; claim not opted in, left alone");
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
            crate::duration::format(ctx.settings.grace),
            s.volume.name
        ),
    )
    .await;
}

/// Reports (once) that the node is silent but not fenced.
async fn await_fence(s: &Subject, ctx: &Context, claim: &ClaimSummary) {
    let (node, label) = (&s.node, s.claim_label());
    if !ctx.first_report(
        &format!("unfenced/{}", uid_or(claim, &label)),
        &s.volume.name,
    ) {
        return;
    }
    ctx.metrics.count("awaiting-fence");
    tracing::warn!(claim = %label, node, volume = %s.volume.name, "node silent but not fenced; nothing deleted");
    ctx.publish(
        claim,
        "NodeLostNotFenced",
        format!(
            "node {node} looks lost (its driver and kubelet stopped reporting longer than {}), \
             but it may be cut off rather than dead, its pods still writing: nothing is deleted. \
             Once it is fenced (powered off, or cut off from its storage and network), taint it \
             with {}=nodeshutdown:NoExecute and the recovery goes on",
            crate::duration::format(ctx.settings.grace),
            crate::node_summary::OUT_OF_SERVICE,
        ),
    )
    .await;
}

/// Deletes `claim`, the lost node's pods using it and (`delete_volume`) its volume; only
/// reports that it would with `--node-loss-dry-run`.
async fn recover_claim(
    s: &Subject,
    ctx: &Context,
    claim: &ClaimSummary,
    loss: Loss,
    opt_in: OptIn,
    delete_volume: bool,
) -> Result<(), NodeLossError> {
    let (node, label) = (&s.node, s.claim_label());
    let pods: Vec<Pod> = Api::<Pod>::namespaced(ctx.client.clone(), &s.namespace)
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await
        .map_err(s.err("listing the lost node's pods"))?
        .items
        .into_iter()
        .filter(|p| uses_claim(p, &s.name))
        .collect();
    let pod_names: Vec<String> = pods
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let what = format!(
        "claim {label}, pods {pod_names:?} on {node} and{} volume {}",
        if delete_volume {
            ""
        } else {
            " not (reclaim policy Retain) its"
        },
        s.volume.name
    );
    let why = format!(
        "node {node} is lost ({}, longer than {}) and the claim opted in ({RECREATE_ON_NODE_LOSS} on its {})",
        loss.as_str(),
        crate::duration::format(ctx.settings.grace),
        match opt_in {
            OptIn::Claim => "claim",
            OptIn::Class => "StorageClass",
        }
    );
    if ctx.settings.dry_run {
        if ctx.first_report(&format!("dry-run/{}", s.volume.name), &s.volume.name) {
            ctx.metrics.count("dry-run");
            tracing::warn!(claim = %label, node, "dry run: would delete {what}: {why}");
            ctx.publish(
                claim,
                "NodeLossRecoveryDryRun",
                format!("would delete {what}: {why} (--node-loss-dry-run: nothing changed)"),
            )
            .await;
        }
        return Ok(());
    }
    if ctx.first_report(
        &format!("recover/{}", uid_or(claim, &label)),
        &s.volume.name,
    ) {
        tracing::warn!(claim = %label, node, "deleting {what}: {why}");
        ctx.publish(
            claim,
            "NodeLossRecovery",
            format!("deleting {what}: {why}; its workload's controller recreates them elsewhere with a new, empty volume"),
        )
        .await;
    }
    if claim.metadata.deletion_timestamp.is_none() {
        // The claim first: a StatefulSet recreating its pod waits while the claim is being
        // deleted, instead of starting the new pod on the old claim. The fresh read's
        // resourceVersion: a claim changed since (its opt-in taken back) is judged again.
        let claims = Api::<ClaimSummary>::namespaced(ctx.client.clone(), &s.namespace);
        let preconditions = Preconditions {
            uid: claim.metadata.uid.clone(),
            resource_version: claim.metadata.resource_version.clone(),
        };
        match delete(&claims, &s.name, preconditions, None)
            .await
            .map_err(s.err("deleting the claim"))?
        {
            Deletion::Deleted => ctx.metrics.count("claim-deleted"),
            Deletion::Gone => {}
            // Its opt-in may have been taken back: neither its pods nor its volume go before
            // the next reconcile has judged the claim as it is now.
            Deletion::Changed => {
                tracing::info!(claim = %label, "the claim changed since it was read; judged again");
                return Ok(());
            }
        }
    }
    let pod_api = Api::<Pod>::namespaced(ctx.client.clone(), &s.namespace);
    for pod in &pods {
        let pod_name = pod.metadata.name.clone().unwrap_or_default();
        let preconditions = Preconditions {
            uid: pod.metadata.uid.clone(),
            resource_version: None,
        };
        // No kubelet will ever confirm a graceful deletion on a lost node.
        if delete(&pod_api, &pod_name, preconditions, Some(0))
            .await
            .map_err(s.err("deleting a pod of the lost node"))?
            == Deletion::Deleted
        {
            ctx.metrics.count("pod-deleted");
            tracing::info!(pod = %format!("{}/{pod_name}", s.namespace), node, "deleted pod of a lost node");
        }
    }
    if delete_volume {
        release(ctx, &s.volume.name, node, loss)
            .await
            .map_err(s.err("deleting the volume"))?;
    }
    Ok(())
}

/// Deletes the released volume of a lost node; only reports that it would with
/// `--node-loss-dry-run`.
async fn release_volume(s: &Subject, ctx: &Context, loss: Loss) -> Result<(), NodeLossError> {
    let (node, volume) = (&s.node, &s.volume.name);
    if ctx.settings.dry_run {
        if ctx.first_report(&format!("dry-run/{volume}"), volume) {
            ctx.metrics.count("dry-run");
            tracing::warn!(
                node,
                volume,
                loss = loss.as_str(),
                "dry run: would delete the released volume of a lost node"
            );
        }
        return Ok(());
    }
    tracing::info!(
        node,
        volume,
        loss = loss.as_str(),
        "deleting the released volume of a lost node"
    );
    release(ctx, volume, node, loss)
        .await
        .map_err(s.err("deleting the released volume"))
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

/// What a deletion with preconditions did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Deletion {
    /// Deleted (or marked for deletion).
    Deleted,
    /// It was gone already.
    Gone,
    /// It was replaced or changed since the read the decision was made on (a precondition
    /// failed): nothing was deleted, and nothing that follows from it may be.
    Changed,
}

/// Deletes `name` if `preconditions` still hold.
async fn delete<K>(
    api: &Api<K>,
    name: &str,
    preconditions: Preconditions,
    grace_period_seconds: Option<u32>,
) -> Result<Deletion, kube::Error>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = DeleteParams {
        grace_period_seconds,
        preconditions: Some(preconditions),
        ..DeleteParams::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(Deletion::Deleted),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(Deletion::Gone),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(Deletion::Changed),
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
            // With heartbeats expired or not used, the rule is the same.
            for heartbeat in [HeartbeatState::Expired, HeartbeatState::NotUsed] {
                assert_eq!(lost_for(driverless, heartbeat, kubelet), want, "{name}");
            }
        }
    }

    #[test]
    fn a_node_deleted_while_its_driver_renews_is_not_lost() {
        use HeartbeatState::*;
        for (name, driverless, heartbeat, kubelet, want) in [
            (
                "deleted, heartbeat fresh: re-registering, or deleted by mistake",
                Some((NodeMissing, S(600))),
                Fresh,
                Kubelet::NodeGone,
                None,
            ),
            (
                "deleted, heartbeat expired",
                Some((NodeMissing, S(600))),
                Expired,
                Kubelet::NodeGone,
                Some((Loss::NodeDeleted, S(600))),
            ),
            (
                "deleted, heartbeats not used",
                Some((NodeMissing, S(600))),
                NotUsed,
                Kubelet::NodeGone,
                Some((Loss::NodeDeleted, S(600))),
            ),
        ] {
            assert_eq!(lost_for(driverless, heartbeat, kubelet), want, "{name}");
        }
    }

    #[test]
    fn fence_of_a_node() {
        let node = |out_of_service| NodeSummary {
            out_of_service,
            ..NodeSummary::default()
        };
        for (name, n, waived, want) in [
            ("tainted", Some(node(true)), false, Fence::Tainted),
            ("tainted and waived", Some(node(true)), true, Fence::Tainted),
            ("no taint", Some(node(false)), false, Fence::Absent),
            ("no taint, waived", Some(node(false)), true, Fence::Waived),
            ("no Node", None, false, Fence::Absent),
        ] {
            assert_eq!(Fence::of(n.as_ref(), waived), want, "{name}");
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
            // A silent node here is fenced; a deleted node needs no fence.
            for fence in [Fence::Tainted, Fence::Waived] {
                assert_eq!(decide(volume, claim, lost, fence, grace), want, "{name}");
            }
            if lost.is_some_and(|(loss, _)| loss == Loss::NodeDeleted) {
                assert_eq!(
                    decide(volume, claim, lost, Fence::Absent, grace),
                    want,
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn a_silent_node_waits_for_its_fence() {
        let grace = S(60);
        let silent = Some((Loss::Silent, S(600)));
        let opted = ClaimState::Present {
            opt_in: Some(OptIn::Claim),
        };
        let v = volume(true, false, true);
        for (name, claim, fence, want) in [
            (
                "opted in, not fenced",
                opted,
                Fence::Absent,
                Verdict::AwaitFence,
            ),
            (
                "claim gone, not fenced",
                ClaimState::Gone,
                Fence::Absent,
                Verdict::AwaitFence,
            ),
            (
                "opted in, fenced",
                opted,
                Fence::Tainted,
                Verdict::Recover {
                    loss: Loss::Silent,
                    opt_in: OptIn::Claim,
                    delete_volume: true,
                    remove_finalizer: false,
                },
            ),
            (
                "not opted in, not fenced: reported as lost",
                ClaimState::Present { opt_in: None },
                Fence::Absent,
                Verdict::Report { loss: Loss::Silent },
            ),
        ] {
            assert_eq!(decide(&v, claim, silent, fence, grace), want, "{name}");
        }
        assert_eq!(
            decide(&v, opted, Some((Loss::Silent, S(10))), Fence::Absent, grace),
            Verdict::Wait(S(50)),
            "within the grace it waits as any loss"
        );
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
        assert_eq!(clock.len(), 1);
        // Another kind of loss starts again; a node back is forgotten.
        assert_eq!(
            clock.observe("n1", Some((Loss::Silent, S(900))), t0 + S(100)),
            Some((Loss::Silent, S(0)))
        );
        assert_eq!(clock.observe("n1", None, t0 + S(110)), None);
        assert_eq!(
            clock.observe("n1", Some((Loss::Silent, S(900))), t0 + S(120)),
            Some((Loss::Silent, S(0)))
        );
        // Pruned once no volume names the node.
        clock.observe("n2", Some((Loss::NodeDeleted, S(9))), t0 + S(120));
        clock.retain(|n| n == "n2");
        assert_eq!(clock.len(), 1);
        clock.retain(|_| false);
        assert!(clock.is_empty());
    }

    /// One node as the guard sees it: (Node exists, matches the selector, holds a volume,
    /// looks lost).
    type GuardNode = (bool, bool, bool, bool);

    fn headcount(nodes: &[GuardNode]) -> Headcount {
        let mut count = Headcount::default();
        for &(exists, selected, holds, lost) in nodes {
            if counted(exists, selected, holds) {
                count.add(lost);
            }
        }
        count
    }

    #[test]
    fn headcount_table() {
        // Selected nodes that exist: silent ones with and without volumes.
        let silent = (true, true, false, true);
        let silent_holding = (true, true, true, true);
        let alive = (true, true, false, false);
        let alive_holding = (true, true, true, false);
        let deleted_holding = (false, false, true, true);
        let deleted_empty = (false, false, false, true);
        let unselected_silent = (true, false, true, true);
        let cases: [(&str, Vec<GuardNode>, Headcount, bool); 7] = [
            (
                // The reviewer's case: the old rule counted 3 lost (those holding volumes) of
                // 10 and deleted claims during an outage.
                "ten nodes, six silent, three of them holding volumes",
                [
                    vec![silent_holding; 3],
                    vec![silent; 3],
                    vec![alive_holding; 2],
                    vec![alive; 2],
                ]
                .concat(),
                Headcount { nodes: 10, lost: 6 },
                true,
            ),
            (
                "three of five silent, one holding a volume",
                [vec![silent_holding], vec![silent; 2], vec![alive; 2]].concat(),
                Headcount { nodes: 5, lost: 3 },
                true,
            ),
            (
                "one silent of three",
                vec![silent_holding, alive, alive_holding],
                Headcount { nodes: 3, lost: 1 },
                false,
            ),
            (
                "half is not more than half",
                vec![silent_holding, alive],
                Headcount { nodes: 2, lost: 1 },
                false,
            ),
            (
                "a deleted node counts while it holds volumes, not after",
                vec![deleted_holding, deleted_empty, alive, alive],
                Headcount { nodes: 3, lost: 1 },
                false,
            ),
            (
                "an unselected node does not count",
                vec![unselected_silent, silent_holding, alive],
                Headcount { nodes: 2, lost: 1 },
                false,
            ),
            ("no nodes", vec![], Headcount::default(), false),
        ];
        for (name, nodes, want, refuse) in cases {
            let count = headcount(&nodes);
            assert_eq!(count, want, "{name}");
            assert_eq!(count.too_many_lost(), refuse, "{name}");
        }
    }

    #[test]
    fn a_volume_serves_a_claim_until_it_is_released() {
        use k8s_openapi::api::core::v1::{ObjectReference, PersistentVolumeStatus};
        let pv = |claim: bool, phase: Option<&str>| {
            let mut pv = crate::test_objects::csi_volume("pv", "d", "h", Some("n"));
            if let Some(spec) = pv.spec.as_mut() {
                spec.claim_ref = claim.then(ObjectReference::default);
            }
            pv.status = phase.map(|p| PersistentVolumeStatus {
                phase: Some(p.into()),
                ..Default::default()
            });
            pv
        };
        for (claim, phase, want) in [
            (true, Some("Bound"), true),
            (true, Some("Pending"), true),
            (true, None, true),
            (true, Some("Released"), false),
            (true, Some("Failed"), false),
            (false, Some("Available"), false),
        ] {
            assert_eq!(serves_a_claim(&pv(claim, phase)), want, "{claim} {phase:?}");
        }
    }

    #[test]
    fn the_budget_admits_so_many_nodes_an_hour() {
        let t0 = Instant::now();
        let mut budget = RecoveryBudget::default();
        assert!(budget.admit("a", t0, 2));
        assert!(budget.admit("a", t0 + S(10), 2), "a node begun goes on");
        assert!(budget.admit("b", t0 + S(20), 2));
        assert!(
            !budget.admit("c", t0 + S(30), 2),
            "the third node within the hour"
        );
        assert!(budget.admit("b", t0 + S(40), 2));
        assert!(!budget.admit("c", t0 + S(3599), 2));
        assert!(budget.admit("c", t0 + S(3600), 2), "a's hour is over");
        assert!(
            !budget.admit("d", t0 + S(3601), 2),
            "b and c within the hour"
        );
        assert!(budget.admit("d", t0 + S(3620), 2));
        let mut one = RecoveryBudget::default();
        assert!(one.admit("a", t0, 1));
        assert!(!one.admit("b", t0, 1));
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
