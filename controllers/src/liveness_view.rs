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

use crate::liveness::{self, CsiNodeState, HeartbeatState, Liveness, NodeObservation};
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
        observation(
            &self.settings,
            n.as_deref(),
            csinode.as_deref(),
            lease.as_ref().map(|l| l.as_deref()),
        )
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
        nodes
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
        Ok(self.confirm_with_node(client, node).await?.0)
    }

    /// [`LivenessView::confirm`], and the Node object it read (for callers that judge its
    /// status too, without reading it again).
    pub async fn confirm_with_node(
        &self,
        client: &kube::Client,
        node: &str,
    ) -> Result<(Option<liveness::DriverlessReason>, Option<NodeSummary>), kube::Error> {
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
        let o = observation(
            &self.settings,
            n.as_ref(),
            csinode.as_ref(),
            lease.as_ref().map(Option::as_ref),
        );
        Ok((liveness::driverless_now(&o), n))
    }
}

/// Builds the observation from objects (`lease`: `None` = heartbeats not used).
pub fn observation(
    settings: &LivenessSettings,
    node: Option<&NodeSummary>,
    csinode: Option<&CSINode>,
    lease: Option<Option<&Lease>>,
) -> NodeObservation {
    let csinode = match csinode {
        None => CsiNodeState::Missing,
        Some(c) if c.spec.drivers.iter().any(|d| d.name == settings.driver) => {
            CsiNodeState::WithDriver
        }
        Some(_) => CsiNodeState::WithoutDriver,
    };
    let heartbeat = match (lease, settings.heartbeat) {
        (None, _) | (_, None) => HeartbeatState::NotUsed,
        (Some(lease), Some(grace)) => {
            // The Lease's own duration plus the grace: the holder may renew late by design.
            let renewed = lease
                .and_then(|l| l.spec.as_ref())
                .and_then(|s| s.renew_time.as_ref())
                .map(|t| t.0);
            let duration = lease
                .and_then(|l| l.spec.as_ref())
                .and_then(|s| s.lease_duration_seconds)
                .map_or(Duration::ZERO, |s| {
                    Duration::from_secs(u64::try_from(s).unwrap_or(0))
                });
            let expired = match renewed {
                None => true,
                Some(renewed) => {
                    let age = age_of(renewed);
                    age > duration + grace
                }
            };
            if expired {
                HeartbeatState::Expired
            } else {
                HeartbeatState::Fresh
            }
        }
    };
    NodeObservation {
        node_exists: node.is_some(),
        labels_match: node.is_some_and(|n| settings.selector.matches(n.metadata.labels.as_ref())),
        csinode,
        heartbeat,
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
