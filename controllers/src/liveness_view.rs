//! The liveness judgement of every node, kept current in the background from the stores
//! (observed every second, so that "continuously for the grace period" means what it says),
//! and confirmed with uncached reads before anything is written on its strength.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::storage::v1::CSINode;
use kube::Api;
use kube::runtime::reflector::ObjectRef;
use tokio_util::sync::CancellationToken;

use crate::liveness::{
    self, CsiNodeState, HeartbeatState, Liveness, NodeObservation, RenewalClock,
};
use crate::node_selector::NodeSelector;
use crate::node_summary::NodeSummary;
use crate::stores::NodeStores;
use crate::well_known::heartbeat_lease_name;

/// How often the background task observes every node.
const OBSERVE_EVERY: Duration = Duration::from_secs(1);

/// How long a name that no Node has is still observed after a concern last asked about it:
/// longer than any concern waits between two questions about a claim it keeps (the grace,
/// twice, and a minute).
pub fn forget_after(grace: Duration) -> Duration {
    grace * 2 + Duration::from_secs(60)
}

/// The nodes a background pass observes: every node that exists, and every name a concern
/// asked about within `forget_after` (a claim may name a node that does not exist).
pub fn nodes_to_observe(
    existing: &HashSet<String>,
    asked: &HashMap<String, Instant>,
    now: Instant,
    forget_after: Duration,
) -> std::collections::BTreeSet<String> {
    existing
        .iter()
        .cloned()
        .chain(
            asked
                .iter()
                .filter(|(_, at)| now.saturating_duration_since(**at) < forget_after)
                .map(|(node, _)| node.clone()),
        )
        .collect()
}

/// What the judgement depends on besides the stores.
#[derive(Clone, Debug)]
pub struct LivenessSettings {
    /// Driver name.
    pub driver: String,
    /// `--node-selector`.
    pub selector: NodeSelector,
    /// `--reschedule-grace`.
    pub grace: Duration,
    /// `--heartbeat-grace`: Leases count only when set.
    pub heartbeat: Option<Duration>,
    /// Namespace of the heartbeat Leases.
    pub namespace: String,
}

/// Per-node judgements, shared by the concerns of one process.
#[derive(Clone)]
pub struct LivenessView {
    settings: Arc<LivenessSettings>,
    stores: NodeStores,
    since: Arc<Mutex<HashMap<String, Instant>>>,
    /// When a concern last asked about each node (the background pass does not count).
    asked: Arc<Mutex<HashMap<String, Instant>>>,
    /// The nodes the last background pass judged definitely driverless.
    driverless: Arc<Mutex<Arc<HashSet<String>>>>,
    /// When each heartbeat was seen renewed, on this process's clock.
    renewals: Arc<Mutex<RenewalClock>>,
}

impl LivenessView {
    /// A view over `stores`.
    pub fn new(settings: LivenessSettings, stores: NodeStores) -> Self {
        Self {
            settings: Arc::new(settings),
            stores,
            since: Arc::default(),
            asked: Arc::default(),
            driverless: Arc::default(),
            renewals: Arc::default(),
        }
    }

    /// The settings.
    pub fn settings(&self) -> &LivenessSettings {
        &self.settings
    }

    /// What the stores show about `node` now.
    pub fn observe(&self, node: &str) -> NodeObservation {
        let n = self.stores.nodes.get(&ObjectRef::<NodeSummary>::new(node));
        let csinode = self.stores.csinodes.get(&ObjectRef::<CSINode>::new(node));
        let lease = self.settings.heartbeat.map(|_| {
            self.stores.leases.get(
                &ObjectRef::<Lease>::new(&heartbeat_lease_name(&self.settings.driver, node))
                    .within(&self.settings.namespace),
            )
        });
        let heartbeat = self.heartbeat(node, lease.as_ref().map(|l| l.as_deref()));
        observation(&self.settings, n.as_deref(), csinode.as_deref(), heartbeat)
    }

    /// The heartbeat of `node` from its Lease (`None`: heartbeats not used; `Some(None)`: no
    /// Lease), its renewals dated by this process's clock ([`RenewalClock`]).
    pub fn heartbeat(&self, node: &str, lease: Option<Option<&Lease>>) -> HeartbeatState {
        let (Some(lease), Some(grace)) = (lease, self.settings.heartbeat) else {
            return HeartbeatState::NotUsed;
        };
        let (renewal, duration) = renewal_of(lease);
        self.renewals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .heartbeat(node, renewal.as_deref(), duration + grace, Instant::now())
    }

    /// The judgement of `node` now; remembers since when it has looked driverless.
    pub fn judge(&self, node: &str) -> Liveness {
        self.asked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(node.to_string(), Instant::now());
        self.judge_quietly(node)
    }

    /// Why and for how long `node` has looked driverless without a break (judging it now, as
    /// [`LivenessView::judge`] does); `None` while the driver may run there.
    pub fn driverless_for(&self, node: &str) -> Option<(liveness::DriverlessReason, Duration)> {
        let reason = match self.judge(node) {
            Liveness::MayRun => return None,
            Liveness::Suspect { reason, .. } | Liveness::DefinitelyNotRunning(reason) => reason,
        };
        let since = self
            .since
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(node)
            .copied()?;
        Some((reason, Instant::now().saturating_duration_since(since)))
    }

    /// How many nodes the view keeps state for (every node that exists, plus names concerns
    /// asked about recently).
    pub fn tracked(&self) -> usize {
        self.since
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
            .max(
                self.asked
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .len(),
            )
    }

    /// The nodes to observe now ([`nodes_to_observe`]); forgets every other name, so that the
    /// view holds only nodes that exist or that concerns ask about (a claim's made-up
    /// selected-node, a node deleted long ago, are dropped).
    fn prune(
        &self,
        existing: &HashSet<String>,
        now: Instant,
        forget_after: Duration,
    ) -> std::collections::BTreeSet<String> {
        let mut asked = self.asked.lock().unwrap_or_else(PoisonError::into_inner);
        let nodes = nodes_to_observe(existing, &asked, now, forget_after);
        asked.retain(|node, _| nodes.contains(node));
        self.since
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|node, _| nodes.contains(node));
        // A heartbeat is remembered while its Lease exists, whatever happened to the Node: a
        // deleted node's stale Lease seen anew would be dated now and look fresh, and a Node
        // deleted while its heartbeat is fresh is not lost.
        self.renewals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|node| nodes.contains(node) || self.lease_exists(node));
        nodes
    }

    /// Whether the caches hold `node`'s heartbeat Lease.
    fn lease_exists(&self, node: &str) -> bool {
        self.stores
            .leases
            .get(
                &ObjectRef::<Lease>::new(&heartbeat_lease_name(&self.settings.driver, node))
                    .within(&self.settings.namespace),
            )
            .is_some()
    }

    /// [`LivenessView::judge`] without counting as a concern's question (the background pass).
    fn judge_quietly(&self, node: &str) -> Liveness {
        let observation = self.observe(node);
        let mut since = self.since.lock().unwrap_or_else(PoisonError::into_inner);
        let (liveness, new_since) = liveness::judge(
            &observation,
            since.get(node).copied(),
            Instant::now(),
            self.settings.grace,
        );
        match new_since {
            Some(t) => since.insert(node.to_string(), t),
            None => since.remove(node),
        };
        liveness
    }

    /// The nodes the latest background pass ([`LivenessView::run`]) judged definitely
    /// driverless: a snapshot for hot paths (the extender's /filter asks about thousands of nodes
    /// per call and must not observe each), at most a pass old.
    pub fn driverless_nodes(&self) -> Arc<HashSet<String>> {
        self.driverless
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Observes every known node (and every node judged before) once per second until
    /// `shutdown`, so that a recovery between two reconciles resets the grace.
    pub async fn run(self, shutdown: CancellationToken) {
        let forget_after = forget_after(self.settings.grace);
        loop {
            let existing: HashSet<String> = self
                .stores
                .nodes
                .state()
                .iter()
                .map(|n| n.metadata.name.clone().unwrap_or_default())
                .collect();
            let nodes = self.prune(&existing, Instant::now(), forget_after);
            let mut driverless = HashSet::new();
            for node in nodes {
                if let Liveness::DefinitelyNotRunning(_) = self.judge_quietly(&node) {
                    driverless.insert(node);
                }
            }
            *self
                .driverless
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Arc::new(driverless);
            tokio::select! {
                _ = tokio::time::sleep(OBSERVE_EVERY) => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }

    /// Reads Node, CSINode and Lease of `node` from the apiserver, bypassing the caches, and
    /// tells whether the driver still looks absent. Writes are only based on this.
    pub async fn confirm(
        &self,
        client: &kube::Client,
        node: &str,
    ) -> Result<Option<liveness::DriverlessReason>, kube::Error> {
        Ok(self.confirm_node(client, node).await?.0)
    }

    /// [`LivenessView::confirm`], the heartbeat it judged and the Node object it read (for
    /// callers that judge its status too, without reading it again).
    pub async fn confirm_node(
        &self,
        client: &kube::Client,
        node: &str,
    ) -> Result<
        (
            Option<liveness::DriverlessReason>,
            HeartbeatState,
            Option<NodeSummary>,
        ),
        kube::Error,
    > {
        let n = Api::<NodeSummary>::all(client.clone())
            .get_opt(node)
            .await?;
        let csinode = Api::<CSINode>::all(client.clone()).get_opt(node).await?;
        let lease = match self.settings.heartbeat {
            Some(_) => Some(
                Api::<Lease>::namespaced(client.clone(), &self.settings.namespace)
                    .get_opt(&heartbeat_lease_name(&self.settings.driver, node))
                    .await?,
            ),
            None => None,
        };
        let heartbeat = self.heartbeat(node, lease.as_ref().map(Option::as_ref));
        let o = observation(&self.settings, n.as_ref(), csinode.as_ref(), heartbeat);
        Ok((liveness::driverless_now(&o), heartbeat, n))
    }
}

/// Builds the observation from objects and the node's heartbeat.
pub fn observation(
    settings: &LivenessSettings,
    node: Option<&NodeSummary>,
    csinode: Option<&CSINode>,
    heartbeat: HeartbeatState,
) -> NodeObservation {
    let csinode = match csinode {
        None => CsiNodeState::Missing,
        Some(c) if c.spec.drivers.iter().any(|d| d.name == settings.driver) => {
            CsiNodeState::WithDriver
        }
        Some(_) => CsiNodeState::WithoutDriver,
    };
    NodeObservation {
        node_exists: node.is_some(),
        labels_match: node.is_some_and(|n| settings.selector.matches(n.metadata.labels.as_ref())),
        csinode,
        heartbeat,
    }
}

/// A Lease's latest renewal as written (`None`: no Lease, or never renewed) and how long it
/// holds by its own duration.
pub fn renewal_of(lease: Option<&Lease>) -> (Option<String>, Duration) {
    let spec = lease.and_then(|l| l.spec.as_ref());
    let renewal = spec
        .and_then(|s| s.renew_time.as_ref())
        .map(|t| t.0.to_string());
    let duration = spec
        .and_then(|s| s.lease_duration_seconds)
        .map_or(Duration::ZERO, |s| {
            Duration::from_secs(u64::try_from(s).unwrap_or(0))
        });
    (renewal, duration)
}

/// The heartbeat as one look at a Lease tells it, by the wall clock (`explain`, which sees one
/// instant and says that it compares the node's clock with its own): expired when `renewTime`
/// is older than the Lease's duration plus `grace`.
pub fn heartbeat_by_wall_clock(lease: Option<&Lease>, grace: Duration) -> HeartbeatState {
    let (_, duration) = renewal_of(lease);
    let renewed = lease
        .and_then(|l| l.spec.as_ref())
        .and_then(|s| s.renew_time.as_ref())
        .map(|t| t.0);
    let expired = renewed.is_none_or(|renewed| age_of(renewed) > duration + grace);
    if expired {
        HeartbeatState::Expired
    } else {
        HeartbeatState::Fresh
    }
}

/// How long ago `t` was, by the wall clock (zero if in the future).
fn age_of(t: k8s_openapi::jiff::Timestamp) -> Duration {
    let now = k8s_openapi::jiff::Timestamp::now();
    now.duration_since(t).try_into().unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_to_observe_table() {
        let t0 = Instant::now();
        let forget = forget_after(Duration::from_secs(30));
        assert_eq!(forget, Duration::from_secs(120));
        let existing: HashSet<String> = ["a", "b"].map(String::from).into();
        let asked: HashMap<String, Instant> = [
            ("a", t0),
            ("made-up", t0 + Duration::from_secs(100)),
            ("gone-long-ago", t0),
        ]
        .map(|(n, t)| (n.to_string(), t))
        .into();
        let now = t0 + Duration::from_secs(150);
        let nodes: Vec<String> = nodes_to_observe(&existing, &asked, now, forget)
            .into_iter()
            .collect();
        // "a" exists (however long ago it was asked about), "b" exists, "made-up" was asked
        // 50 s ago; nobody asked about "gone-long-ago" for 150 s and no Node has that name.
        assert_eq!(nodes, ["a", "b", "made-up"]);
    }

    /// A selected node with its CSINode entry and a heartbeat Lease renewed at `renewed`.
    fn stores_with_lease(
        renewed: k8s_openapi::jiff::Timestamp,
    ) -> (NodeStores, kube::runtime::reflector::store::Writer<Lease>) {
        use k8s_openapi::api::coordination::v1::LeaseSpec;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
        use kube::runtime::{reflector, watcher};
        let (nodes, mut node_writer) = reflector::store::<NodeSummary>();
        let mut node = NodeSummary::default();
        node.metadata.name = Some("n1".into());
        node.metadata.labels = Some([("storage".to_string(), "pmem".to_string())].into());
        node_writer.apply_watcher_event(&watcher::Event::Apply(node));
        let (leases, mut lease_writer) = reflector::store::<Lease>();
        let mut lease = Lease::default();
        lease.metadata.name = Some(heartbeat_lease_name("pmem-csi.intel.com", "n1"));
        lease.metadata.namespace = Some("pmem-csi".into());
        lease.spec = Some(LeaseSpec {
            renew_time: Some(MicroTime(renewed)),
            lease_duration_seconds: Some(10),
            ..LeaseSpec::default()
        });
        lease_writer.apply_watcher_event(&watcher::Event::Apply(lease));
        let stores = NodeStores {
            nodes,
            csinodes: reflector::store().0,
            leases,
        };
        (stores, lease_writer)
    }

    #[tokio::test]
    async fn a_node_clock_behind_does_not_expire_its_heartbeat() {
        let ninety_behind =
            k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(90);
        let (stores, _writer) = stores_with_lease(ninety_behind);
        let view = LivenessView::new(
            LivenessSettings {
                driver: "pmem-csi.intel.com".into(),
                selector: NodeSelector::parse("storage=pmem").expect("selector"),
                grace: Duration::from_secs(30),
                // The shipped grace: 90 s behind is more than the Lease's 10 s and the grace.
                heartbeat: Some(Duration::from_secs(60)),
                namespace: "pmem-csi".into(),
            },
            stores,
        );
        assert_eq!(
            view.observe("n1").heartbeat,
            HeartbeatState::Fresh,
            "a renewal is dated when it is seen, not by the node's clock"
        );
        assert_eq!(view.judge("n1"), Liveness::MayRun);
        // explain's one look by the wall clock says what it compares.
        let lease = view
            .stores
            .leases
            .state()
            .first()
            .cloned()
            .expect("the Lease");
        assert_eq!(
            heartbeat_by_wall_clock(Some(&lease), Duration::from_secs(60)),
            HeartbeatState::Expired
        );
        assert_eq!(
            heartbeat_by_wall_clock(None, Duration::from_secs(60)),
            HeartbeatState::Expired
        );
    }

    #[tokio::test]
    async fn a_made_up_name_is_tracked_only_while_asked_about() {
        use kube::runtime::reflector;
        let stores = NodeStores {
            nodes: reflector::store().0,
            csinodes: reflector::store().0,
            leases: reflector::store().0,
        };
        let view = LivenessView::new(
            LivenessSettings {
                driver: "pmem-csi.intel.com".into(),
                selector: NodeSelector::parse("storage=pmem").expect("selector"),
                grace: Duration::from_secs(30),
                heartbeat: None,
                namespace: "pmem-csi".into(),
            },
            stores,
        );
        let grace = Duration::from_secs(30);
        let none = HashSet::new();
        assert!(matches!(view.judge("made-up"), Liveness::Suspect { .. }));
        assert_eq!(view.tracked(), 1);
        let soon = Instant::now() + Duration::from_secs(1);
        assert_eq!(view.prune(&none, soon, forget_after(grace)).len(), 1);
        assert_eq!(view.tracked(), 1, "still asked about: kept");
        let later = Instant::now() + forget_after(grace);
        assert!(view.prune(&none, later, forget_after(grace)).is_empty());
        assert_eq!(view.tracked(), 0, "nobody asks any more: forgotten");
    }
}
