//! `pmem-csi controller`: its flags, and the process that hosts the cluster-level concerns on
//! one client and one set of shared caches.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use kube::Api;
use kube::runtime::events::Reporter;
use kube::runtime::reflector::ReflectHandle;
use kube::runtime::watcher;
use prometheus_client::registry::Registry;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::claim_summary::ClaimSummary;
use crate::concern::{Concern, ConcernError, Elector};
use crate::flags::{ClientBudget, FlagError, KubeApiArgs, LivenessArgs, duration};
use crate::leader::LeaderMetrics;
use crate::liveness_view::{LivenessSettings, LivenessView};
use crate::node_loss::{
    DEFAULT_MAX_NODES_PER_HOUR, NodeLossMetrics, NodeLossRecovery, NodeLossSettings,
};
use crate::node_summary::NodeSummary;
use crate::readiness::{Readiness, ReadyFlag};
use crate::reconcile_metrics::ReconcileMetrics;
use crate::rescheduler::{Rescheduler, ReschedulerMetrics};
use crate::stores::{self, Stores};

/// The elections' own client: each Lease costs a GET and a PUT per retry period (2 s by
/// default), and an instance runs two or three elections.
const ELECTION_BUDGET: ClientBudget = ClientBudget {
    qps: 5.0,
    burst: 10,
};

/// Flags of `pmem-csi controller`.
#[derive(clap::Args, Debug, Clone)]
pub struct ControllerArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub liveness: LivenessArgs,

    /// Run the rescheduler and the capacity clean-up only while leading (one Lease each).
    #[arg(long)]
    pub leader_election: bool,

    /// How long a leader Lease is valid without renewal.
    #[arg(long, default_value = "15s", value_parser = duration)]
    pub leader_election_lease_duration: Duration,

    /// How often the leader renews and standbys check.
    #[arg(long, default_value = "2s", value_parser = duration)]
    pub leader_election_retry_period: Duration,

    /// This instance's identity in leader Leases (default: --pod-name, else host name and pid).
    #[arg(long)]
    pub leader_election_identity: Option<String>,

    /// This replica's pod name (the downward API's POD_NAME): the reporting instance of its
    /// Events and the default leader identity.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,

    /// Recover claims whose node has been lost this long (deleted, or its driver's heartbeat
    /// expired while its kubelet is not Ready): those that opted in (annotation
    /// pmem-csi.intel.com/recreate-on-node-loss=true on the claim or its StorageClass) are
    /// deleted with their volume and the lost node's pods using them, others get an Event.
    /// Off when unset; needs the RBAC of components/node-loss-recovery.
    #[arg(long, value_parser = duration)]
    pub node_loss_grace: Option<Duration>,

    /// With --node-loss-grace: only report (Events, logs, metrics) what the recovery would do.
    #[arg(long)]
    pub node_loss_dry_run: bool,

    /// With --node-loss-grace: recover at most this many nodes in any hour (a node counts from
    /// the recovery's first deletion on it); claims of further lost nodes wait, reported
    /// [default: 2].
    #[arg(long)]
    pub node_loss_max_nodes_per_hour: Option<u32>,

    /// With --node-loss-grace, DANGEROUS: also recover nodes whose driver and kubelet went
    /// silent without the node.kubernetes.io/out-of-service taint, i.e. without an operator
    /// saying the node is fenced. A node cut off by a network partition may still run the pods
    /// whose claims are deleted, and write to their other volumes once those attach elsewhere.
    #[arg(long)]
    pub node_loss_unfenced: bool,

    #[command(flatten)]
    #[allow(missing_docs)]
    pub kube_api: KubeApiArgs,
}

/// Leader election timing and identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderElection {
    /// How long a Lease is valid without renewal.
    pub lease_duration: Duration,
    /// How often the leader renews and standbys check.
    pub retry_period: Duration,
    /// This instance's holder identity.
    pub identity: String,
}

/// Validated controller configuration.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// Driver, node selector, graces and namespace of the liveness judgement.
    pub liveness: LivenessSettings,
    /// Leader election, when enabled.
    pub leader_election: Option<LeaderElection>,
    /// The process client's budget.
    pub kube_api: ClientBudget,
    /// This replica's pod name, when known.
    pub pod_name: Option<String>,
    /// The node-loss recovery, when enabled.
    pub node_loss: Option<NodeLossSettings>,
}

impl ControllerConfig {
    /// The driver name.
    pub fn driver_name(&self) -> &str {
        &self.liveness.driver
    }

    /// The driver namespace.
    pub fn namespace(&self) -> &str {
        &self.liveness.namespace
    }

    /// Who writes this replica's Events.
    pub fn reporter(&self) -> Reporter {
        Reporter {
            controller: "pmem-csi-controller".into(),
            instance: self.pod_name.clone(),
        }
    }
}

impl ControllerArgs {
    /// Validates the flags.
    pub fn validate(&self) -> Result<ControllerConfig, FlagError> {
        let liveness = self.liveness.settings()?;
        let leader_election = if self.leader_election {
            let lease_duration = self.leader_election_lease_duration;
            let retry_period = self.leader_election_retry_period;
            // A leader renews at least once before its renew deadline.
            if retry_period.is_zero()
                || retry_period >= crate::leader::renew_deadline(lease_duration)
            {
                return Err(FlagError::new(
                    "leader-election-retry-period",
                    "must be above zero and below two thirds of --leader-election-lease-duration (the renew deadline)",
                ));
            }
            let identity = self
                .leader_election_identity
                .clone()
                .or_else(|| self.pod_name.clone())
                .unwrap_or_else(|| {
                    let host =
                        std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
                    format!("{}-{}", host.trim(), std::process::id())
                });
            Some(LeaderElection {
                lease_duration,
                retry_period,
                identity,
            })
        } else {
            None
        };
        let node_loss = match (self.node_loss_grace, self.node_loss_dry_run) {
            (None, dry_run) => {
                let without_grace = [
                    ("node-loss-dry-run", dry_run),
                    (
                        "node-loss-max-nodes-per-hour",
                        self.node_loss_max_nodes_per_hour.is_some(),
                    ),
                    ("node-loss-unfenced", self.node_loss_unfenced),
                ];
                if let Some((flag, _)) = without_grace.iter().find(|(_, given)| *given) {
                    return Err(FlagError::new(
                        flag,
                        "needs --node-loss-grace (the recovery it configures)",
                    ));
                }
                None
            }
            (Some(_), _) if self.node_loss_max_nodes_per_hour == Some(0) => {
                return Err(FlagError::new(
                    "node-loss-max-nodes-per-hour",
                    "must be at least 1 (leave --node-loss-grace unset to turn the recovery off)",
                ));
            }
            // Recovery acts on what the rescheduler already gave up on: never before it.
            (Some(grace), _) if grace < liveness.grace => {
                return Err(FlagError::new(
                    "node-loss-grace",
                    "must not be shorter than --reschedule-grace",
                ));
            }
            (Some(grace), dry_run) => Some(NodeLossSettings {
                grace,
                dry_run,
                max_nodes_per_hour: self
                    .node_loss_max_nodes_per_hour
                    .unwrap_or(DEFAULT_MAX_NODES_PER_HOUR),
                unfenced: self.node_loss_unfenced,
            }),
        };
        Ok(ControllerConfig {
            liveness,
            leader_election,
            kube_api: self.kube_api.budget(),
            pod_name: self.pod_name.clone(),
            node_loss,
        })
    }
}

/// Failures starting the controller.
#[derive(Debug, thiserror::Error)]
pub enum ControllerProcessError {
    /// No usable kubeconfig or in-cluster configuration.
    #[error("connecting to the apiserver: {0}")]
    Client(#[from] kube::Error),
}

/// The controller process: caches started, concerns ready to be hosted.
pub struct ControllerProcess {
    concerns: Vec<Concern>,
    config: ControllerConfig,
    client: kube::Client,
    election_client: kube::Client,
    stores: Stores,
    /// Taken by the claim forwarder when the caches have synced.
    claim_events: Option<ReflectHandle<ClaimSummary>>,
    tasks: JoinSet<()>,
    synced: ReadyFlag,
    rescheduler_metrics: ReschedulerMetrics,
    reconciles: ReconcileMetrics,
    leader_metrics: LeaderMetrics,
    node_loss_metrics: Option<NodeLossMetrics>,
}

impl ControllerProcess {
    /// Connects, registers metrics and starts the shared watches.
    pub async fn start(
        config: ControllerConfig,
        registry: &mut Registry,
        readiness: &Readiness,
    ) -> Result<Self, ControllerProcessError> {
        let client = crate::rate_limit::client(config.kube_api).await?;
        // Elections get a client of their own (own connections, own token bucket), so that a
        // burst of webhook lookups or reconciles never delays a renewal past its deadline.
        let election_client = crate::rate_limit::client(ELECTION_BUDGET).await?;
        let mut tasks = JoinSet::new();
        let (claims, claim_events) = stores::shared(
            Api::<ClaimSummary>::all(client.clone()),
            watcher::Config::default(),
            &mut tasks,
        );
        let stores = Stores {
            claims,
            classes: stores::cache(
                Api::<StorageClass>::all(client.clone()),
                watcher::Config::default(),
                &mut tasks,
            ),
            nodes: stores::cache(
                Api::<NodeSummary>::all(client.clone()),
                watcher::Config::default(),
                &mut tasks,
            ),
            csinodes: stores::cache(
                Api::<CSINode>::all(client.clone()),
                watcher::Config::default(),
                &mut tasks,
            ),
            leases: stores::cache(
                Api::<Lease>::namespaced(client.clone(), config.namespace()),
                watcher::Config::default(),
                &mut tasks,
            ),
        };
        Ok(Self {
            concerns: Vec::new(),
            client,
            election_client,
            stores,
            claim_events: Some(claim_events),
            tasks,
            synced: readiness.register("stores-synced"),
            rescheduler_metrics: ReschedulerMetrics::register(registry),
            reconciles: ReconcileMetrics::register(registry),
            leader_metrics: LeaderMetrics::register(registry),
            node_loss_metrics: config
                .node_loss
                .map(|_| NodeLossMetrics::register(registry)),
            config,
        })
    }

    /// The process's client (rate-limited as configured).
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// The shared caches (filled once [`Self::run`] has waited for them).
    pub fn stores(&self) -> Stores {
        self.stores.clone()
    }

    /// The process's reconcile metrics (registered once; concerns added from outside share them).
    pub fn reconciles(&self) -> ReconcileMetrics {
        self.reconciles.clone()
    }

    /// The validated configuration.
    pub fn config(&self) -> &ControllerConfig {
        &self.config
    }

    /// Adds a concern: an every-instance one (a server) is hosted at once, a leader-only one
    /// with the built-in ones once the caches have synced.
    pub fn add_concern(&mut self, concern: Concern) {
        self.concerns.push(concern);
    }

    /// Hosts every concern until `shutdown` (see [`crate::concern::host`]): the added
    /// every-instance ones (the webhook's server and certificate) at once; once the caches have
    /// synced the rest: the liveness observer, the claim forwarder, the rescheduler and the
    /// capacity clean-up, and the added leader-only ones, which act on what the caches hold.
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<(), ConcernError> {
        let (at_once, after_sync): (Vec<Concern>, Vec<Concern>) =
            std::mem::take(&mut self.concerns)
                .into_iter()
                .partition(|c| !c.is_leader_only());
        let serving = tokio::spawn(crate::concern::host(at_once, None, shutdown.clone()));
        let hosted = self.run_after_sync(after_sync, &shutdown).await;
        // The servers end on the same shutdown (hosting cancels it when one of them fails).
        shutdown.cancel();
        let served = serving.await.unwrap_or_else(|e| {
            Err(ConcernError::Failed {
                name: "the servers".into(),
                error: format!("panicked: {e}"),
            })
        });
        self.tasks.abort_all();
        served.and(hosted)
    }

    async fn run_after_sync(
        &mut self,
        added: Vec<Concern>,
        shutdown: &CancellationToken,
    ) -> Result<(), ConcernError> {
        tokio::select! {
            ready = self.stores.wait_ready() => {
                if ready.is_err() {
                    return Err(ConcernError::Stopped("a watch of the shared caches".into()));
                }
            }
            _ = shutdown.cancelled() => return Ok(()),
        }
        self.synced.set(true);
        tracing::info!("caches synced");
        let liveness = LivenessView::new(self.config.liveness.clone(), self.stores.node_stores());
        let observer = liveness.clone();
        let mut concerns = vec![Concern::everywhere("liveness", move |token| {
            observer.run(token)
        })];
        let (client, stores, cleanup_liveness, reconciles) = (
            self.client.clone(),
            self.stores.clone(),
            liveness.clone(),
            self.reconciles.clone(),
        );
        concerns.push(Concern::leader_only("capacity-cleanup", move |term| {
            crate::capacity_cleanup::run(
                client.clone(),
                stores.clone(),
                cleanup_liveness.clone(),
                reconciles.clone(),
                term,
            )
        }));
        let (client, stores, metrics, reconciles, reporter) = (
            self.client.clone(),
            self.stores.clone(),
            self.rescheduler_metrics.clone(),
            self.reconciles.clone(),
            self.config.reporter(),
        );
        let claims = self.stores.claims.clone();
        let liveness_for_recovery = liveness.clone();
        let Some(claim_events) = self.claim_events.take() else {
            return Err(ConcernError::Stopped("the shared claim watch".into()));
        };
        concerns.extend(rescheduler_concerns(claim_events, claims, move || {
            Rescheduler::new(
                client.clone(),
                stores.clone(),
                liveness.clone(),
                reporter.clone(),
                metrics.clone(),
                reconciles.clone(),
            )
        }));
        if let (Some(settings), Some(metrics)) =
            (self.config.node_loss, self.node_loss_metrics.clone())
        {
            let (client, stores, liveness, reconciles, reporter) = (
                self.client.clone(),
                self.stores.clone(),
                liveness_for_recovery,
                self.reconciles.clone(),
                self.config.reporter(),
            );
            concerns.push(Concern::leader_only("node-loss-recovery", move |term| {
                NodeLossRecovery {
                    client: client.clone(),
                    stores: stores.clone(),
                    liveness: liveness.clone(),
                    settings,
                    reporter: reporter.clone(),
                    metrics: metrics.clone(),
                    reconciles: reconciles.clone(),
                }
                .run(term)
            }));
        }
        concerns.extend(added);
        let elector = self.config.leader_election.as_ref().map(|e| Elector {
            client: self.election_client.clone(),
            driver: self.config.driver_name().to_string(),
            namespace: self.config.namespace().to_string(),
            identity: e.identity.clone(),
            lease_duration: e.lease_duration,
            retry_period: e.retry_period,
            metrics: self.leader_metrics.clone(),
        });
        crate::concern::host(concerns, elector, shutdown.clone()).await
    }
}

/// The rescheduler (leader only; `make` builds one per leadership term) and the forwarder that
/// feeds it from the shared claim watch (everywhere: the watch must always be drained, or it
/// would stall every cache of the process; its events reach the rescheduler only while it
/// leads). A new leader starts from every claim in `claims`, not only from what changes next.
fn rescheduler_concerns(
    claim_events: ReflectHandle<ClaimSummary>,
    claims: kube::runtime::reflector::Store<ClaimSummary>,
    make: impl Fn() -> Rescheduler + Send + Sync + 'static,
) -> [Concern; 2] {
    type Slot = Arc<Mutex<Option<mpsc::Sender<Arc<ClaimSummary>>>>>;
    let term_sender: Slot = Arc::default();
    let forward_to = term_sender.clone();
    let forwarder = Concern::everywhere("claim-forwarder", move |token| {
        let mut events = claim_events;
        async move {
            loop {
                let claim = tokio::select! {
                    claim = events.next() => claim,
                    _ = token.cancelled() => return,
                };
                let Some(claim) = claim else {
                    // The shared watch ends only when its task is aborted, after shutdown.
                    token.cancelled().await;
                    return;
                };
                let sender = forward_to
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                if let Some(sender) = sender {
                    let _ = sender.send(claim).await;
                }
            }
        }
    });
    let rescheduler = Concern::leader_only("rescheduler", move |term| {
        let (tx, rx) = mpsc::channel(4096);
        let seed = tx.clone();
        let existing = claims.state();
        tokio::spawn(async move {
            for claim in existing {
                if seed.send(claim).await.is_err() {
                    return;
                }
            }
        });
        *term_sender.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
        let rescheduler = make();
        let slot = term_sender.clone();
        async move {
            rescheduler
                .run(tokio_stream::wrappers::ReceiverStream::new(rx), term)
                .await;
            *slot.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }
    });
    [forwarder, rescheduler]
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        args: ControllerArgs,
    }

    fn args(extra: &[&str]) -> ControllerArgs {
        let base = [
            "test",
            "--node-selector",
            "storage=pmem",
            "--pod-name",
            "pod-1",
        ];
        Cli::try_parse_from(base.iter().chain(extra))
            .expect("flags parse")
            .args
    }

    #[test]
    fn validate_table() {
        let cases: [(&str, &[&str], Option<&str>); 12] = [
            ("valid", &[], None),
            ("node-loss recovery", &["--node-loss-grace", "1h"], None),
            (
                "node budget alone",
                &["--node-loss-max-nodes-per-hour", "3"],
                Some("node-loss-max-nodes-per-hour"),
            ),
            (
                "unfenced alone",
                &["--node-loss-unfenced"],
                Some("node-loss-unfenced"),
            ),
            (
                "a zero node budget",
                &[
                    "--node-loss-grace",
                    "1h",
                    "--node-loss-max-nodes-per-hour",
                    "0",
                ],
                Some("node-loss-max-nodes-per-hour"),
            ),
            (
                "a node budget",
                &[
                    "--node-loss-grace",
                    "1h",
                    "--node-loss-max-nodes-per-hour",
                    "5",
                ],
                None,
            ),
            (
                "unfenced",
                &["--node-loss-grace", "1h", "--node-loss-unfenced"],
                None,
            ),
            (
                "dry run alone",
                &["--node-loss-dry-run"],
                Some("node-loss-dry-run"),
            ),
            (
                "recovery before rescheduling",
                &["--node-loss-grace", "10s"],
                Some("node-loss-grace"),
            ),
            (
                "retry below the renew deadline",
                &["--leader-election", "--leader-election-retry-period", "9s"],
                None,
            ),
            (
                "retry at the renew deadline",
                &["--leader-election", "--leader-election-retry-period", "10s"],
                Some("leader-election-retry-period"),
            ),
            ("empty namespace", &["--namespace", ""], Some("namespace")),
        ];
        for (name, extra, flag) in cases {
            match (args(extra).validate(), flag) {
                (Ok(_), None) => {}
                (Err(e), Some(flag)) => assert_eq!(e.flag, flag, "{name}"),
                (got, want) => panic!("{name}: got {got:?}, want error on {want:?}"),
            }
        }
        let recovery = args(&["--node-loss-grace", "1h"])
            .validate()
            .expect("valid")
            .node_loss
            .expect("recovery on");
        assert_eq!(
            (recovery.max_nodes_per_hour, recovery.unfenced),
            (DEFAULT_MAX_NODES_PER_HOUR, false),
            "the safe defaults"
        );
        let config = args(&["--leader-election"]).validate().expect("valid");
        assert_eq!(config.liveness.grace, Duration::from_secs(30));
        assert_eq!(
            config.leader_election.as_ref().map(|e| e.identity.as_str()),
            Some("pod-1"),
            "the pod name is the default identity"
        );
        assert_eq!(config.reporter().instance.as_deref(), Some("pod-1"));
        let own = args(&["--leader-election", "--leader-election-identity", "me"]);
        assert_eq!(
            own.validate()
                .expect("valid")
                .leader_election
                .map(|e| e.identity)
                .as_deref(),
            Some("me")
        );
    }
}
