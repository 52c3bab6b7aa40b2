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

use crate::duration::parse_duration;
use crate::leader::{LeaderMetrics, LeaderSettings};
use crate::liveness_view::{LivenessSettings, LivenessView};
use crate::node_selector::NodeSelector;
use crate::readiness::{Readiness, ReadyFlag};
use crate::reconcile_metrics::ReconcileMetrics;
use crate::rescheduler::{Rescheduler, ReschedulerMetrics};
use crate::stores::{self, Stores};

/// Requests per second of the elections' own client: each Lease costs a GET and a PUT per
/// retry period (2 s by default), and an instance runs two or three elections.
const ELECTION_QPS: f64 = 5.0;
/// Burst of the elections' own client.
const ELECTION_BURST: u32 = 10;

/// Flags of `pmem-csi controller`.
#[derive(clap::Args, Debug, Clone)]
pub struct ControllerArgs {
    /// CSI driver name.
    #[arg(
        long,
        env = "PMEM_CSI_DRIVER_NAME",
        default_value = "pmem-csi.intel.com"
    )]
    pub driver_name: String,

    /// Labels of the nodes meant to run the driver: `k=v[,k=v]` or a JSON map. Required.
    #[arg(long)]
    pub node_selector: Option<String>,

    /// How long a node must look driverless before claims selected for it are rescheduled.
    #[arg(long, default_value = "30s")]
    pub reschedule_grace: String,

    /// Also judge a node driverless when its heartbeat Lease has been expired this long.
    #[arg(long)]
    pub heartbeat_grace: Option<String>,

    /// The driver's namespace (heartbeat Leases, Events, leader election Leases).
    #[arg(long, env = "POD_NAMESPACE", default_value = "pmem-csi")]
    pub namespace: String,

    /// Run the rescheduler and the capacity clean-up only while leading (one Lease each).
    #[arg(long)]
    pub leader_election: bool,

    /// How long a leader Lease is valid without renewal.
    #[arg(long, default_value = "15s")]
    pub leader_election_lease_duration: String,

    /// How often the leader renews and standbys check.
    #[arg(long, default_value = "2s")]
    pub leader_election_retry_period: String,

    /// This instance's identity in leader Leases (default: POD_NAME, else host name and pid).
    #[arg(long, env = "POD_NAME")]
    pub leader_election_identity: Option<String>,

    /// Requests per second to the apiserver (client-side token bucket; 0 disables).
    #[arg(long, default_value_t = 20.0)]
    pub kube_api_qps: f64,

    /// Requests the client may send at once before `--kube-api-qps` applies.
    #[arg(long, default_value_t = 40)]
    pub kube_api_burst: u32,
}

/// Validated controller configuration.
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    /// Driver name.
    pub driver_name: String,
    /// Node selector.
    pub node_selector: NodeSelector,
    /// Reschedule grace.
    pub reschedule_grace: Duration,
    /// Heartbeat grace, if heartbeats count.
    pub heartbeat_grace: Option<Duration>,
    /// Driver namespace.
    pub namespace: String,
    /// Leader election timing and identity, when enabled.
    pub leader_election: Option<(Duration, Duration, String)>,
    /// Client rate limit: requests per second and burst.
    pub kube_api: (f64, u32),
}

/// A flag that does not validate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--{flag}: {reason}")]
pub struct ControllerConfigError {
    /// The flag.
    pub flag: &'static str,
    /// Why.
    pub reason: String,
}

impl ControllerArgs {
    /// Validates the flags.
    pub fn validate(&self) -> Result<ControllerConfig, ControllerConfigError> {
        let err = |flag, reason: String| ControllerConfigError { flag, reason };
        let selector = self.node_selector.as_deref().ok_or_else(|| {
            err(
                "node-selector",
                "required (for example storage=pmem)".into(),
            )
        })?;
        let node_selector =
            NodeSelector::parse(selector).map_err(|e| err("node-selector", e.reason))?;
        let reschedule_grace =
            parse_duration(&self.reschedule_grace).map_err(|e| err("reschedule-grace", e))?;
        let heartbeat_grace = self
            .heartbeat_grace
            .as_deref()
            .map(parse_duration)
            .transpose()
            .map_err(|e| err("heartbeat-grace", e))?;
        if self.namespace.is_empty() {
            return Err(err("namespace", "must not be empty".into()));
        }
        let leader_election = if self.leader_election {
            let duration = parse_duration(&self.leader_election_lease_duration)
                .map_err(|e| err("leader-election-lease-duration", e))?;
            let retry = parse_duration(&self.leader_election_retry_period)
                .map_err(|e| err("leader-election-retry-period", e))?;
            // A leader renews at least once before its renew deadline.
            if retry.is_zero() || retry >= crate::leader::renew_deadline(duration) {
                return Err(err(
                    "leader-election-retry-period",
                    "must be above zero and below two thirds of --leader-election-lease-duration (the renew deadline)".into(),
                ));
            }
            let identity = self.leader_election_identity.clone().unwrap_or_else(|| {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
                format!("{}-{}", host.trim(), std::process::id())
            });
            Some((duration, retry, identity))
        } else {
            None
        };
        Ok(ControllerConfig {
            driver_name: self.driver_name.clone(),
            node_selector,
            reschedule_grace,
            heartbeat_grace,
            namespace: self.namespace.clone(),
            leader_election,
            kube_api: (self.kube_api_qps, self.kube_api_burst),
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
        let client = crate::rate_limit::client(config.kube_api.0, config.kube_api.1).await?;
        // Elections get a client of their own (own connections, own token bucket), so that a
        // burst of webhook lookups or reconciles never delays a renewal past its deadline.
        let election_client = crate::rate_limit::client(ELECTION_QPS, ELECTION_BURST).await?;
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
                Api::<Lease>::namespaced(client.clone(), &config.namespace),
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
        let liveness = LivenessView::new(
            LivenessSettings {
                driver: self.config.driver_name.clone(),
                selector: self.config.node_selector.clone(),
                grace: self.config.reschedule_grace,
                heartbeat: self.config.heartbeat_grace,
                namespace: self.config.namespace.clone(),
            },
            self.stores.node_stores(),
        );
        self.tasks.spawn(liveness.clone().run(shutdown.clone()));
        let reporter = Reporter {
            controller: "pmem-csi-controller".into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        // Leader-only concerns; without leader election every instance leads.
        let leading =
            |concern: &str, tasks: &mut JoinSet<()>| -> tokio::sync::watch::Receiver<bool> {
                match &self.config.leader_election {
                    None => tokio::sync::watch::channel(true).1,
                    Some((duration, retry, identity)) => {
                        let (rx, election) = crate::leader::elect(
                            self.election_client.clone(),
                            LeaderSettings {
                                name: crate::well_known::leader_lease_name(
                                    &self.config.driver_name,
                                    concern,
                                ),
                                namespace: self.config.namespace.clone(),
                                identity: identity.clone(),
                                lease_duration: *duration,
                                retry_period: *retry,
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

    fn args() -> ControllerArgs {
        ControllerArgs {
            driver_name: "pmem-csi.intel.com".into(),
            node_selector: Some("storage=pmem".into()),
            reschedule_grace: "30s".into(),
            heartbeat_grace: None,
            namespace: "pmem-csi".into(),
            leader_election: false,
            leader_election_lease_duration: "15s".into(),
            leader_election_retry_period: "2s".into(),
            leader_election_identity: None,
            kube_api_qps: 20.0,
            kube_api_burst: 40,
        }
    }

    #[test]
    fn validate_table() {
        type Edit = fn(&mut ControllerArgs);
        let cases: [(&str, Edit, Option<&str>); 8] = [
            ("valid", |_| {}, None),
            (
                "retry below the renew deadline",
                |a| {
                    a.leader_election = true;
                    a.leader_election_retry_period = "9s".into();
                },
                None,
            ),
            (
                "retry at the renew deadline",
                |a| {
                    a.leader_election = true;
                    a.leader_election_retry_period = "10s".into();
                },
                Some("leader-election-retry-period"),
            ),
            (
                "no selector",
                |a| a.node_selector = None,
                Some("node-selector"),
            ),
            (
                "empty selector",
                |a| a.node_selector = Some("".into()),
                Some("node-selector"),
            ),
            (
                "bad grace",
                |a| a.reschedule_grace = "soon".into(),
                Some("reschedule-grace"),
            ),
            (
                "bad heartbeat",
                |a| a.heartbeat_grace = Some("1x".into()),
                Some("heartbeat-grace"),
            ),
            (
                "empty namespace",
                |a| a.namespace = String::new(),
                Some("namespace"),
            ),
        ];
        for (name, edit, flag) in cases {
            let mut a = args();
            edit(&mut a);
            match (a.validate(), flag) {
                (Ok(_), None) => {}
                (Err(e), Some(flag)) => assert_eq!(e.flag, flag, "{name}"),
                (got, want) => panic!("{name}: got {got:?}, want error on {want:?}"),
            }
        }
        assert_eq!(
            args().validate().expect("valid").reschedule_grace,
            Duration::from_secs(30)
        );
    }
}
