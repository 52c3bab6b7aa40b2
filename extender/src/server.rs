//! `pmem-csi extender`: its flags, the watches that keep the capacity index current, and the
//! plain-HTTP routes kube-scheduler calls on 127.0.0.1. Every decision is made by
//! [`crate::placement`]; this shell decodes, locks, calls and encodes. No network I/O happens
//! on the request path.

use std::collections::HashSet;
use std::fmt::Debug;
use std::hash::Hash;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{CSIStorageCapacity, StorageClass};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Resource, ResourceExt};
use prometheus_client::registry::Registry;
use serde::de::DeserializeOwned;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use controllers::flags::{self, ClientBudget, FlagError, KubeApiArgs, LivenessArgs};
use controllers::liveness_view::{LivenessSettings, LivenessView};
use controllers::readiness::{Readiness, ReadyFlag};
use controllers::stores::NodeStores;

use crate::json_response::json;
use crate::metrics::{ExtenderMetrics, ReservationEvent};
use crate::placement::{ExtenderState, Placement};
use crate::reservation_journal::{ReservationJournal, ReservedRecord};
use crate::score::ScorePolicy;
use controllers::volume_facts::ClaimKey;

/// Body limit of the extender routes: full `Nodes` lists of big clusters are large.
pub const BODY_LIMIT: usize = 64 << 20;
/// How often expired reservations are dropped.
const EXPIRE_EVERY: Duration = Duration::from_secs(10);

/// Flags of `pmem-csi extender`.
#[derive(clap::Args, Debug, Clone)]
pub struct ExtenderOptions {
    /// Where kube-scheduler calls the extender: plain HTTP, loopback only.
    #[arg(long, default_value = "127.0.0.1:10013")]
    pub extender_address: SocketAddr,

    #[command(flatten)]
    #[allow(missing_docs)]
    pub liveness: LivenessArgs,

    /// reserve-all: every node where the pod fits, reserved on each; pin: one node, reserved;
    /// scheduler: every node where it fits, no reservation (racy under bursts).
    #[arg(long, default_value = "reserve-all")]
    pub placement: Placement,

    /// How /prioritize ranks nodes by free PMEM after placing the pod.
    #[arg(long, default_value = "most-free")]
    pub score: ScorePolicy,

    /// How long a reservation lives without its volumes showing up.
    #[arg(long, default_value = "10m", value_parser = flags::duration)]
    pub reservation_ttl: Duration,

    /// Size assumed for a claim or inline volume that states none (the nodes' own default).
    #[arg(long, default_value = "1Gi", value_parser = flags::bytes)]
    pub default_volume_size: u64,

    /// Where reservations are journaled, so that a restart beside a running kube-scheduler
    /// holds them again (a file in an emptyDir). Without it a restart forgets them: pods being
    /// bound at that moment can be over-committed.
    #[arg(long)]
    pub reservations_file: Option<std::path::PathBuf>,

    #[command(flatten)]
    #[allow(missing_docs)]
    pub kube_api: KubeApiArgs,
}

/// Validated extender configuration.
#[derive(Clone, Debug)]
pub struct ExtenderConfig {
    /// Route address (loopback).
    pub address: SocketAddr,
    /// Liveness settings (driver, selector, graces, namespace).
    pub liveness: LivenessSettings,
    /// Placement mode.
    pub placement: Placement,
    /// Score policy.
    pub score: ScorePolicy,
    /// Reservation TTL.
    pub reservation_ttl: Duration,
    /// Default volume size in bytes.
    pub default_volume_size: u64,
    /// The client's budget.
    pub kube_api: ClientBudget,
    /// The reservation journal, if any.
    pub reservations_file: Option<std::path::PathBuf>,
}

impl ExtenderOptions {
    /// Validates the flags.
    pub fn validate(&self) -> Result<ExtenderConfig, FlagError> {
        if !self.extender_address.ip().is_loopback() {
            return Err(FlagError::new(
                "extender-address",
                format!(
                    "{} is not a loopback address; the extender speaks plain HTTP and only \
                     kube-scheduler on the same host may call it",
                    self.extender_address
                ),
            ));
        }
        let liveness = self.liveness.settings()?;
        if self.reservation_ttl.is_zero() {
            return Err(FlagError::new("reservation-ttl", "must be above zero"));
        }
        if self.default_volume_size == 0 {
            return Err(FlagError::new("default-volume-size", "must be above zero"));
        }
        Ok(ExtenderConfig {
            address: self.extender_address,
            liveness,
            placement: self.placement,
            score: self.score,
            reservation_ttl: self.reservation_ttl,
            default_volume_size: self.default_volume_size,
            kube_api: self.kube_api.budget(),
            reservations_file: self.reservations_file.clone(),
        })
    }
}

/// Failures starting the extender.
#[derive(Debug, thiserror::Error)]
pub enum ExtenderError {
    /// No usable kubeconfig or in-cluster configuration.
    #[error("connecting to the apiserver: {0}")]
    Client(#[from] kube::Error),
    /// The route address cannot be bound.
    #[error("listening on {address}: {source}")]
    Bind {
        /// Where.
        address: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The server failed.
    #[error("serving the extender routes: {0}")]
    Serve(std::io::Error),
    /// The reservation journal cannot be opened.
    #[error(transparent)]
    Journal(#[from] crate::reservation_journal::JournalError),
}

/// What the routes share.
#[derive(Clone)]
struct Shared {
    state: Arc<Mutex<ExtenderState>>,
    liveness: LivenessView,
    config: Arc<ExtenderConfig>,
    metrics: ExtenderMetrics,
    /// Every watch has listed once: before that the index is half-filled and its fits would
    /// over-commit, so `/filter` answers none.
    synced: Arc<std::sync::atomic::AtomicBool>,
    /// Locked only while `state` is (after it), so that records land in the order of the
    /// changes they describe.
    journal: Arc<Mutex<Option<ReservationJournal>>>,
    /// Reads the pod `GET /explain` names (the index keeps no pod specs). Never used on the
    /// scheduler's routes.
    client: kube::Client,
}

/// The running extender: watches started, routes bound.
pub struct Extender {
    shared: Shared,
    listener: tokio::net::TcpListener,
    tasks: JoinSet<()>,
    node_stores: NodeStores,
    synced: ReadyFlag,
    watches_synced: Vec<tokio::sync::watch::Receiver<bool>>,
    /// What the journal held at start, restored once the caches have synced.
    replayed: Vec<ReservedRecord>,
}

impl Extender {
    /// Connects, starts the watches and binds the route address.
    pub async fn start(
        config: ExtenderConfig,
        registry: &mut Registry,
        readiness: &Readiness,
    ) -> Result<Self, ExtenderError> {
        let client = controllers::rate_limit::client(config.kube_api).await?;
        let (journal, replayed) = match &config.reservations_file {
            Some(path) => {
                let (journal, replayed) = ReservationJournal::open(path)?;
                if replayed.malformed > 0 {
                    tracing::warn!(
                        path = %path.display(),
                        lines = replayed.malformed,
                        "reservation journal: skipped lines that do not decode (a torn last line after a kill is expected)"
                    );
                }
                (Some(journal), replayed.reservations)
            }
            None => (None, Vec::new()),
        };
        let listener = tokio::net::TcpListener::bind(config.address)
            .await
            .map_err(|source| ExtenderError::Bind {
                address: config.address,
                source,
            })?;
        let mut tasks = JoinSet::new();
        let namespace = config.liveness.namespace.clone();
        let node_stores = NodeStores::start(&client, &namespace, &mut tasks);
        let liveness = LivenessView::new(config.liveness.clone(), node_stores.clone());
        let state = Arc::new(Mutex::new(ExtenderState::new(
            &config.liveness.driver,
            config.default_volume_size,
            config.reservation_ttl,
        )));
        let shared = Shared {
            state,
            liveness,
            config: Arc::new(config),
            metrics: ExtenderMetrics::register(registry),
            synced: Arc::default(),
            journal: Arc::new(Mutex::new(journal)),
            client: client.clone(),
        };
        let mut watches_synced = Vec::new();
        let driver_label = format!(
            "{}={}",
            controllers::well_known::DRIVER_LABEL,
            shared.config.liveness.driver
        );
        watches_synced.push(feed(
            Api::<StorageClass>::all(client.clone()),
            watcher::Config::default(),
            shared.clone(),
            &mut tasks,
        ));
        watches_synced.push(feed(
            Api::<PersistentVolumeClaim>::all(client.clone()),
            watcher::Config::default(),
            shared.clone(),
            &mut tasks,
        ));
        watches_synced.push(feed(
            Api::<PersistentVolume>::all(client.clone()),
            watcher::Config::default(),
            shared.clone(),
            &mut tasks,
        ));
        // Our nodes publish into the driver's namespace only, so a Role suffices.
        watches_synced.push(feed(
            Api::<CSIStorageCapacity>::namespaced(client.clone(), &namespace),
            watcher::Config::default().labels(&driver_label),
            shared.clone(),
            &mut tasks,
        ));
        watches_synced.push(feed(
            Api::<Pod>::all(client.clone()),
            watcher::Config::default(),
            shared.clone(),
            &mut tasks,
        ));
        Ok(Self {
            shared,
            listener,
            tasks,
            node_stores,
            synced: readiness.register("extender-caches-synced"),
            watches_synced,
            replayed,
        })
    }

    /// The bound route address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// The read-only routes the process's admin server adds for the extender: `GET /explain`
    /// (what `/filter` would decide about a pod, and what it holds for it).
    pub fn admin_routes(&self) -> Router {
        crate::explain_route::router(self.shared.explain_source())
    }

    /// The extender as the process hosts it: one concern, serving until shutdown.
    pub fn concerns(self) -> Vec<controllers::concern::Concern> {
        vec![controllers::concern::Concern::everywhere_fallible(
            "extender",
            move |token| self.run(token),
        )]
    }

    /// Serves `/filter`, `/prioritize` and `/preempt` until `shutdown`.
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<(), ExtenderError> {
        let shared = self.shared.clone();
        self.tasks
            .spawn(shared.liveness.clone().run(shutdown.clone()));
        let expiring = shared.clone();
        let token = shutdown.clone();
        self.tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(EXPIRE_EVERY) => {}
                    _ = token.cancelled() => return,
                }
                let mut state = expiring.lock();
                let expired = state.expire(Instant::now());
                for pod in &expired {
                    tracing::warn!(pod = %pod, "reservation expired: the scheduler neither bound nor re-filtered the pod");
                }
                expiring
                    .metrics
                    .reservation(ReservationEvent::Expired, expired.len() as u64);
                expiring.metrics.set_reserved(state.reserved_bytes());
                state.forget_idle_nodes();
                expiring.rewrite_journal(&state, false);
            }
        });
        // Ready once every watch has listed: answers from a half-filled index would
        // over-commit.
        let synced = self.synced.clone();
        let answering = Arc::clone(&shared.synced);
        let stores = self.node_stores.clone();
        let mut waits = std::mem::take(&mut self.watches_synced);
        let replayed = std::mem::take(&mut self.replayed);
        let restoring = shared.clone();
        let token = shutdown.clone();
        self.tasks.spawn(async move {
            let all = async {
                for w in &mut waits {
                    if w.wait_for(|s| *s).await.is_err() {
                        return false;
                    }
                }
                stores.wait_ready().await.is_ok()
            };
            tokio::select! {
                ok = all => {
                    if ok {
                        restoring.restore(replayed);
                        tracing::info!("caches synced");
                        answering.store(true, std::sync::atomic::Ordering::Release);
                        synced.set(true);
                    }
                }
                _ = token.cancelled() => {}
            }
        });
        let router = router(shared);
        let result = axum::serve(self.listener, router)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
            .map_err(ExtenderError::Serve);
        self.tasks.abort_all();
        result
    }
}

impl Shared {
    fn explain_source(&self) -> crate::explain_route::ExplainSource {
        let state = Arc::clone(&self.state);
        let liveness = self.liveness.clone();
        let synced = Arc::clone(&self.synced);
        let placement = self.config.placement;
        crate::explain_route::ExplainSource {
            budget: Arc::new(crate::explain_route::ExplainBudget::shipped()),
            client: self.client.clone(),
            view: Arc::new(move |pod: &Pod| {
                if !synced.load(std::sync::atomic::Ordering::Acquire) {
                    return None;
                }
                let driverless = judge_driverless(&liveness);
                let state = state.lock().unwrap_or_else(PoisonError::into_inner);
                Some(state.explain(pod, &driverless, placement, Instant::now()))
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ExtenderState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Writes the pod's reservation as `state` holds it now. Called with the state locked and
    /// before the answer leaves: kube-scheduler may bind on it at once.
    fn journal(&self, state: &ExtenderState, pod_uid: &str) {
        let mut journal = self.journal.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(journal) = journal.as_mut() else {
            return;
        };
        let (now, wall) = (Instant::now(), std::time::SystemTime::now());
        let record = state.journal_record(pod_uid, now, wall);
        let written = journal.append(&record).and_then(|()| {
            // Here too, not only every EXPIRE_EVERY: a busy scheduler could otherwise fill the
            // emptyDir's size limit between two ticks.
            if journal.wants_rewrite() {
                journal.rewrite(state.journal_snapshot(now, wall))?;
            }
            Ok(())
        });
        if let Err(e) = written {
            self.metrics.journal_error();
            tracing::error!("{e}; a restart would forget this reservation");
        }
    }

    /// Rewrites the journal from the live book when appends have grown it (or `always`).
    fn rewrite_journal(&self, state: &ExtenderState, always: bool) {
        let mut journal = self.journal.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(journal) = journal.as_mut() else {
            return;
        };
        if !always && !journal.wants_rewrite() {
            return;
        }
        let records = state.journal_snapshot(Instant::now(), std::time::SystemTime::now());
        if let Err(e) = journal.rewrite(records) {
            self.metrics.journal_error();
            tracing::error!("{e}");
        }
    }

    /// Holds again what the journal kept, then rewrites it to just that. Runs once, after the
    /// caches synced and before `/filter` answers fits.
    fn restore(&self, replayed: Vec<ReservedRecord>) {
        let mut state = self.lock();
        if !replayed.is_empty() {
            let restored = state.restore(replayed, Instant::now(), std::time::SystemTime::now());
            tracing::info!(
                restored = restored.restored,
                pod_gone = restored.pod_gone,
                expired = restored.expired,
                handed_over = restored.handed_over,
                "reservations from before the restart"
            );
            self.metrics
                .reservation(ReservationEvent::Restored, restored.restored as u64);
            self.metrics.set_reserved(state.reserved_bytes());
        }
        self.rewrite_journal(&state, true);
    }
}

/// The extender's routes (public for the load benchmark and the bad-input tests).
fn router(shared: Shared) -> Router {
    Router::new()
        .route("/filter", post(filter))
        .route("/prioritize", post(prioritize))
        .route("/preempt", post(preempt))
        .route("/status", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(shared)
}

/// A decoded request failed validation: 400 with the message.
fn bad_request(message: String) -> Response {
    (StatusCode::BAD_REQUEST, message).into_response()
}

/// Reads the background judgement (DESIGN.md §4: the extender never observes on the request
/// path).
fn judge_driverless(liveness: &LivenessView) -> impl Fn(&str) -> bool + use<> {
    let driverless = liveness.driverless_nodes();
    move |node| driverless.contains(node)
}

async fn filter(State(shared): State<Shared>, body: Bytes) -> Response {
    let started = Instant::now();
    if !shared.synced.load(std::sync::atomic::Ordering::Acquire) {
        // kube-scheduler (ignorable: false) keeps the pod Pending and retries: better than a
        // fit judged from a half-listed index, or one that forgot a restart's reservations
        // before the Pods watch brought back the bound pods.
        let response = (
            StatusCode::SERVICE_UNAVAILABLE,
            "the extender's caches have not synced yet; no fits are answered before they have\n",
        )
            .into_response();
        shared
            .metrics
            .request("filter", response.status().as_u16(), started.elapsed());
        return response;
    }
    let response = match crate::api::decode_request(&body) {
        Err(e) => bad_request(e.to_string()),
        Ok(request) => {
            let driverless = judge_driverless(&shared.liveness);
            let uid = request.pod_uid.clone();
            let mut state = shared.lock();
            let held_before = state.holds_reservation(&uid);
            let outcome = state.filter(
                request,
                &driverless,
                shared.config.placement,
                shared.config.score,
                Instant::now(),
            );
            // Most pods hold no PMEM: only a reservation made or ended is written.
            if held_before || outcome.event == Some(ReservationEvent::Reserved) {
                shared.journal(&state, &uid);
            }
            shared.metrics.set_reserved(state.reserved_bytes());
            drop(state);
            for (reason, n) in &outcome.rejections {
                shared.metrics.rejected(reason, *n);
            }
            if let Some(event) = outcome.event {
                shared.metrics.reservation(event, 1);
            }
            if let Some(unseen) = &outcome.deferred {
                shared.metrics.deferred();
                tracing::info!(pod = %outcome.pod, %unseen, "filter deferred: caches behind");
            }
            tracing::debug!(
                pod = %outcome.pod,
                passed = outcome.result_nodes,
                nodes = ?outcome.result.node_names.as_ref().map(|n| n.iter().collect::<Vec<_>>()),
                details = ?outcome.details,
                "filter"
            );
            crate::json_response::encoded(outcome.result.to_json())
        }
    };
    shared
        .metrics
        .request("filter", response.status().as_u16(), started.elapsed());
    response
}

async fn prioritize(State(shared): State<Shared>, body: Bytes) -> Response {
    let started = Instant::now();
    let response = match crate::api::decode_request(&body) {
        Err(e) => bad_request(e.to_string()),
        Ok(request) => {
            let state = shared.lock();
            let scores = state.prioritize(&request, shared.config.score);
            drop(state);
            json(&scores)
        }
    };
    shared
        .metrics
        .request("prioritize", response.status().as_u16(), started.elapsed());
    response
}

async fn preempt(State(shared): State<Shared>, body: Bytes) -> Response {
    let started = Instant::now();
    let response = match crate::api::decode_preemption_request(&body) {
        Err(e) => bad_request(e.to_string()),
        Ok(request) => {
            let state = shared.lock();
            let result = state.preempt(request);
            drop(state);
            json(&result)
        }
    };
    shared
        .metrics
        .request("preempt", response.status().as_u16(), started.elapsed());
    response
}

/// One kind of object the index is fed with.
trait Indexed: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static {
    /// The key remembered to notice objects deleted while the watch was down.
    fn key(&self) -> String;
    /// Applies the object (and, for claims and pods, ends reservation entries in the same
    /// locked update).
    fn apply(&self, state: &mut ExtenderState, metrics: &ExtenderMetrics);
    /// Removes the object with `key`.
    fn remove(key: &str, state: &mut ExtenderState, metrics: &ExtenderMetrics);
}

impl Indexed for StorageClass {
    fn key(&self) -> String {
        self.name_any()
    }
    fn apply(&self, state: &mut ExtenderState, _: &ExtenderMetrics) {
        state.index.apply_class(self);
    }
    fn remove(key: &str, state: &mut ExtenderState, _: &ExtenderMetrics) {
        state.index.delete_class(key);
    }
}

impl Indexed for PersistentVolumeClaim {
    fn key(&self) -> String {
        format!(
            "{}/{}",
            self.namespace().unwrap_or_default(),
            self.name_any()
        )
    }
    fn apply(&self, state: &mut ExtenderState, metrics: &ExtenderMetrics) {
        if state.apply_claim(self) {
            metrics.reservation(ReservationEvent::HandedOver, 1);
        }
    }
    fn remove(key: &str, state: &mut ExtenderState, _: &ExtenderMetrics) {
        if let Some((namespace, name)) = key.split_once('/') {
            state.index.delete_claim(&ClaimKey::new(namespace, name));
        }
    }
}

impl Indexed for PersistentVolume {
    fn key(&self) -> String {
        self.name_any()
    }
    fn apply(&self, state: &mut ExtenderState, metrics: &ExtenderMetrics) {
        if state.apply_volume(self) {
            metrics.reservation(ReservationEvent::HandedOver, 1);
        }
    }
    fn remove(key: &str, state: &mut ExtenderState, _: &ExtenderMetrics) {
        state.index.delete_volume(key);
    }
}

impl Indexed for CSIStorageCapacity {
    fn key(&self) -> String {
        self.name_any()
    }
    fn apply(&self, state: &mut ExtenderState, _: &ExtenderMetrics) {
        state.index.apply_capacity(self);
    }
    fn remove(key: &str, state: &mut ExtenderState, _: &ExtenderMetrics) {
        state.index.delete_capacity(key);
    }
}

impl Indexed for Pod {
    fn key(&self) -> String {
        self.uid().unwrap_or_default()
    }
    fn apply(&self, state: &mut ExtenderState, metrics: &ExtenderMetrics) {
        if state.apply_pod(self) {
            metrics.reservation(ReservationEvent::Bound, 1);
        }
    }
    fn remove(key: &str, state: &mut ExtenderState, metrics: &ExtenderMetrics) {
        if state.delete_pod(key) {
            metrics.reservation(ReservationEvent::Released, 1);
        }
    }
}

/// Watches `api` into the index; the returned flag turns true after the first full list.
fn feed<K: Indexed>(
    api: Api<K>,
    config: watcher::Config,
    shared: Shared,
    tasks: &mut JoinSet<()>,
) -> tokio::sync::watch::Receiver<bool>
where
    K::DynamicType: Default + Eq + Hash + Clone,
{
    let (synced_tx, synced_rx) = tokio::sync::watch::channel(false);
    tasks.spawn(async move {
        let mut known: HashSet<String> = HashSet::new();
        let mut listing: HashSet<String> = HashSet::new();
        let mut events = std::pin::pin!(watcher::watcher(api, config).default_backoff());
        while let Some(event) = events.next().await {
            let event = match event {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!(kind = %K::kind(&Default::default()), "watch: {e}");
                    continue;
                }
            };
            let mut state = shared.lock();
            match event {
                Event::Apply(object) => {
                    known.insert(object.key());
                    object.apply(&mut state, &shared.metrics);
                }
                Event::Delete(object) => {
                    let key = object.key();
                    known.remove(&key);
                    K::remove(&key, &mut state, &shared.metrics);
                }
                Event::Init => listing.clear(),
                Event::InitApply(object) => {
                    listing.insert(object.key());
                    object.apply(&mut state, &shared.metrics);
                }
                Event::InitDone => {
                    // Objects deleted while the watch was down send no Delete.
                    for gone in known.difference(&listing) {
                        K::remove(gone, &mut state, &shared.metrics);
                    }
                    known = std::mem::take(&mut listing);
                    drop(state);
                    let _ = synced_tx.send(true);
                    continue;
                }
            }
            shared.metrics.set_reserved(state.reserved_bytes());
        }
    });
    synced_rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        options: ExtenderOptions,
    }

    fn options(extra: &[&str]) -> Result<ExtenderOptions, clap::Error> {
        use clap::Parser;
        let base = ["test", "--node-selector", "storage=pmem"];
        Cli::try_parse_from(base.iter().chain(extra)).map(|cli| cli.options)
    }

    #[test]
    fn validate_table() {
        let cases: [(&str, &[&str], Option<&str>); 4] = [
            ("valid", &[], None),
            (
                "not loopback",
                &["--extender-address", "0.0.0.0:1"],
                Some("extender-address"),
            ),
            (
                "zero ttl",
                &["--reservation-ttl", "0s"],
                Some("reservation-ttl"),
            ),
            ("empty namespace", &["--namespace", ""], Some("namespace")),
        ];
        for (name, extra, flag) in cases {
            match (options(extra).expect("parses").validate(), flag) {
                (Ok(_), None) => {}
                (Err(e), Some(flag)) => assert_eq!(e.flag, flag, "{name}"),
                (got, want) => panic!("{name}: got {got:?}, want error on {want:?}"),
            }
        }
        for (extra, flag) in [
            (&["--reschedule-grace", "x"][..], "--reschedule-grace"),
            (&["--default-volume-size", "big"], "--default-volume-size"),
        ] {
            let message = options(extra).expect_err("refused").to_string();
            assert!(message.contains(flag), "{extra:?}: {message}");
        }
        let config = options(&[]).expect("parses").validate().expect("valid");
        assert_eq!(
            (config.reservation_ttl, config.default_volume_size),
            (Duration::from_secs(600), 1 << 30)
        );
    }
}
