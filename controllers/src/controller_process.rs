//! `pmem-csi controller`: its flags, and the process that hosts the cluster-level concerns on
//! one client and one set of shared caches.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use tokio::sync::mpsc;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use kube::Api;
use kube::runtime::events::Reporter;
use kube::runtime::reflector::ReflectHandle;
use kube::runtime::watcher;
use prometheus_client::registry::Registry;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::flags::{ClientBudget, FlagError, KubeApiArgs, LivenessArgs, duration};
use crate::leader::{LeaderMetrics, LeaderSettings};
use crate::liveness_view::{LivenessSettings, LivenessView};
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
        Ok(ControllerConfig {
            liveness,
            leader_election,
            kube_api: self.kube_api.budget(),
            pod_name: self.pod_name.clone(),
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

/// Starts one run of a concern that another crate adds, given the token that ends it (on
/// shutdown, or when this instance stops leading).
pub type ConcernStart = Box<dyn Fn(CancellationToken) -> BoxFuture<'static, ()> + Send + Sync>;

/// The controller process: caches started, concerns ready to run.
pub struct ControllerProcess {
    extra: Vec<(String, bool, ConcernStart)>,
    config: ControllerConfig,
    client: kube::Client,
    election_client: kube::Client,
    stores: Stores,
    claim_events: ReflectHandle<PersistentVolumeClaim>,
    tasks: JoinSet<()>,
    synced: ReadyFlag,
    rescheduler_metrics: ReschedulerMetrics,
    reconciles: ReconcileMetrics,
    leader_metrics: LeaderMetrics,
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
            Api::<PersistentVolumeClaim>::all(client.clone()),
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
                Api::<Node>::all(client.clone()),
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
            extra: Vec::new(),
            config,
            client,
            election_client,
            stores,
            claim_events,
            tasks,
            synced: readiness.register("stores-synced"),
            rescheduler_metrics: ReschedulerMetrics::register(registry),
            reconciles: ReconcileMetrics::register(registry),
            leader_metrics: LeaderMetrics::register(registry),
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

    /// Adds a concern hosted like the built-in ones: with `leader_only`, it runs only while this
    /// instance holds the Lease `<driver>-<name>` (always, without leader election); otherwise
    /// it runs on every replica. `start` is called again after each regained leadership.
    pub fn add_concern(&mut self, name: &str, leader_only: bool, start: ConcernStart) {
        self.extra.push((name.to_string(), leader_only, start));
    }

    /// Runs every concern until `shutdown`.
    pub async fn run(mut self, shutdown: CancellationToken) {
        tokio::select! {
            ready = self.stores.wait_ready() => {
                if ready.is_err() {
                    tracing::error!("a watch ended before its cache was ready");
                    return;
                }
            }
            _ = shutdown.cancelled() => return,
        }
        self.synced.set(true);
        tracing::info!("caches synced");
        let liveness = LivenessView::new(self.config.liveness.clone(), self.stores.node_stores());
        self.tasks.spawn(liveness.clone().run(shutdown.clone()));
        let reporter = self.config.reporter();
        // Leader-only concerns; without leader election every instance leads.
        let leading =
            |concern: &str, tasks: &mut JoinSet<()>| -> tokio::sync::watch::Receiver<bool> {
                match &self.config.leader_election {
                    None => tokio::sync::watch::channel(true).1,
                    Some(settings) => {
                        let (rx, election) = crate::leader::elect(
                            self.election_client.clone(),
                            LeaderSettings {
                                name: crate::well_known::leader_lease_name(
                                    self.config.driver_name(),
                                    concern,
                                ),
                                namespace: self.config.namespace().to_string(),
                                identity: settings.identity.clone(),
                                lease_duration: settings.lease_duration,
                                retry_period: settings.retry_period,
                                wall_clock_skew: Default::default(),
                            },
                            self.leader_metrics.clone(),
                            shutdown.clone(),
                        );
                        tasks.spawn(election);
                        rx
                    }
                }
            };
        let mut elections = JoinSet::new();
        for (name, leader_only, start) in std::mem::take(&mut self.extra) {
            if leader_only {
                let rx = leading(&name, &mut elections);
                self.tasks.spawn(crate::leader::while_leading(
                    rx,
                    shutdown.clone(),
                    // The closure owns `start`: the task outlives this loop.
                    #[allow(clippy::redundant_closure)]
                    move |term| start(term),
                ));
            } else {
                self.tasks.spawn(start(shutdown.clone()));
            }
        }
        let cleanup_leading = leading("capacity-cleanup", &mut elections);
        let rescheduler_leading = leading("rescheduler", &mut elections);
        let (client, stores, cleanup_liveness, reconciles) = (
            self.client.clone(),
            self.stores.clone(),
            liveness.clone(),
            self.reconciles.clone(),
        );
        self.tasks.spawn(crate::leader::while_leading(
            cleanup_leading,
            shutdown.clone(),
            move |term| {
                crate::capacity_cleanup::run(
                    client.clone(),
                    stores.clone(),
                    cleanup_liveness.clone(),
                    reconciles.clone(),
                    term,
                )
            },
        ));
        // The shared claim watch must always be drained, or it would stall every cache of the
        // process; its events go to the rescheduler only while it leads.
        let term_sender: Arc<Mutex<Option<mpsc::Sender<Arc<PersistentVolumeClaim>>>>> =
            Arc::default();
        let forward_to = term_sender.clone();
        let mut claim_events = self.claim_events;
        self.tasks.spawn(async move {
            while let Some(claim) = claim_events.next().await {
                let sender = forward_to
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                if let Some(sender) = sender {
                    let _ = sender.send(claim).await;
                }
            }
        });
        let (client, stores, metrics, reconciles) = (
            self.client.clone(),
            self.stores.clone(),
            self.rescheduler_metrics.clone(),
            self.reconciles.clone(),
        );
        crate::leader::while_leading(rescheduler_leading, shutdown.clone(), move |term| {
            let (tx, rx) = mpsc::channel(4096);
            // A new leader starts from everything cached, not only from what changes next.
            let seed = tx.clone();
            let existing = stores.claims.state();
            tokio::spawn(async move {
                for claim in existing {
                    if seed.send(claim).await.is_err() {
                        return;
                    }
                }
            });
            *term_sender.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
            let rescheduler = Rescheduler::new(
                client.clone(),
                stores.clone(),
                liveness.clone(),
                reporter.clone(),
                metrics.clone(),
                reconciles.clone(),
            );
            let slot = term_sender.clone();
            async move {
                rescheduler
                    .run(tokio_stream::wrappers::ReceiverStream::new(rx), term)
                    .await;
                *slot.lock().unwrap_or_else(PoisonError::into_inner) = None;
            }
        })
        .await;
        // Let the elections release their Leases.
        while elections.join_next().await.is_some() {}
        self.tasks.abort_all();
    }
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
        let cases: [(&str, &[&str], Option<&str>); 4] = [
            ("valid", &[], None),
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
