//! The pod mutating webhook of `pmem-csi controller`: its flags, the HTTPS server on
//! `/pod/mutate`, and the lookups the decision needs (shared caches first, then GETs for the
//! misses, in parallel under one deadline). The decision itself is [`crate::mutation::decide`].

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use controllers::well_known::name_prefix;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::Api;
use kube::runtime::reflector::{ObjectRef, Store};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use controllers::claim_summary::ClaimSummary;
use controllers::flags::{self, FlagError};
use controllers::stores::Stores;

use crate::admission;
use crate::https::HttpsServer;
use crate::mutation::{self, Decision, WebhookPolicy};
use crate::tls::{CertFiles, CertResolver};
use controllers::pod_volumes::{self, ClaimFacts, ClaimKey, ClassFacts};
use controllers::volume_facts::default_class;

/// The apiserver's own request limit; a review is never larger.
pub const BODY_LIMIT: usize = 3 << 20;
/// The route, also the `webhook` label of controller-runtime's metrics.
pub const ROUTE: &str = "/pod/mutate";
/// Deadline of all GETs of one review together (claims, then classes): below the server's
/// request deadline (`ServeOptions::webhook`, 2 s), so that a review whose lookups hang is
/// still answered, as if the objects were not found.
pub const LOOKUPS_DEADLINE: Duration = Duration::from_millis(1500);
/// GETs of one review in flight at once: a pod with hundreds of claims missing from the cache
/// must not send hundreds of requests at once.
pub const PARALLEL_LOOKUPS: usize = 8;

/// Webhook flags of `pmem-csi controller` (the scheduler-extender component sets them).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct WebhookOptions {
    /// HTTPS address of the pod mutating webhook (`/pod/mutate`); without it no webhook runs
    /// and none of the other webhook flags may be given.
    #[arg(long)]
    pub webhook_address: Option<SocketAddr>,

    /// Pods of these schedulers are mutated (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub scheduler_names: Vec<String>,

    /// Serving certificate (PEM), reloaded when the file changes.
    #[arg(long)]
    pub tls_cert_file: Option<PathBuf>,

    /// Its private key (PEM), reloaded with it.
    #[arg(long)]
    pub tls_key_file: Option<PathBuf>,

    /// Keep an own CA and serving certificate in a Secret (written by the leader, read by
    /// every replica) and inject the CA into the MutatingWebhookConfiguration.
    #[arg(long)]
    pub self_signed: bool,

    /// Extra DNS names or IP addresses of the self-signed serving certificate (repeatable).
    #[arg(long)]
    pub self_signed_san: Vec<String>,

    /// The Secret holding the self-signed CA and certificate (default `<prefix>-controller-secret`,
    /// `<prefix>` being the driver name with dots replaced by dashes).
    #[arg(long)]
    pub self_signed_secret: Option<String>,

    /// The webhook's Service, whose names the certificate covers (default `<prefix>-webhook`).
    #[arg(long)]
    pub webhook_service: Option<String>,

    /// The MutatingWebhookConfiguration that gets the CA (default `<prefix>-hook`).
    #[arg(long)]
    pub webhook_configuration: Option<String>,

    /// Validity of self-signed serving certificates; re-issued at 2/3 (tests shorten it).
    #[arg(long, default_value = "2160h", hide = true, value_parser = flags::duration)]
    pub self_signed_leaf_validity: Duration,

    /// Validity of the self-signed CA (tests shorten it).
    #[arg(long, default_value = "87600h", hide = true, value_parser = flags::duration)]
    pub self_signed_ca_validity: Duration,

    /// How often certificate files are checked for changes.
    #[arg(long, default_value = "1s", hide = true, value_parser = flags::duration)]
    pub tls_reload_interval: Duration,
}

/// Where the serving certificate comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CertificateSource {
    /// `--tls-cert-file` / `--tls-key-file`.
    Files(CertFiles),
    /// `--self-signed`.
    SelfSigned(SelfSignedConfig),
}

/// Settings of `--self-signed`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelfSignedConfig {
    /// Secret name (in the driver namespace).
    pub secret: String,
    /// Service name the certificate is for.
    pub service: String,
    /// MutatingWebhookConfiguration name.
    pub configuration: String,
    /// Extra names.
    pub sans: Vec<String>,
    /// Leaf validity.
    pub leaf_validity: Duration,
    /// CA validity.
    pub ca_validity: Duration,
}

/// Validated webhook configuration.
#[derive(Clone, Debug)]
pub struct WebhookConfig {
    /// HTTPS address.
    pub address: SocketAddr,
    /// Mutation policy (driver, scheduler names).
    pub policy: WebhookPolicy,
    /// Certificate source.
    pub certificate: CertificateSource,
    /// Certificate file polling interval.
    pub reload_interval: Duration,
}

impl WebhookOptions {
    /// Validates the flags for `driver`; `None` when the webhook is not enabled.
    pub fn validate(&self, driver: &str) -> Result<Option<WebhookConfig>, FlagError> {
        let err = |flag, reason: &str| FlagError::new(flag, reason);
        let Some(address) = self.webhook_address else {
            let given = [
                ("scheduler-names", !self.scheduler_names.is_empty()),
                ("tls-cert-file", self.tls_cert_file.is_some()),
                ("tls-key-file", self.tls_key_file.is_some()),
                ("self-signed", self.self_signed),
                ("self-signed-san", !self.self_signed_san.is_empty()),
                ("self-signed-secret", self.self_signed_secret.is_some()),
                ("webhook-service", self.webhook_service.is_some()),
                (
                    "webhook-configuration",
                    self.webhook_configuration.is_some(),
                ),
            ];
            if let Some((flag, _)) = given.iter().find(|(_, set)| *set) {
                return Err(err(flag, "needs --webhook-address"));
            }
            return Ok(None);
        };
        let prefix = name_prefix(driver);
        let certificate = match (&self.tls_cert_file, &self.tls_key_file, self.self_signed) {
            (Some(cert), Some(key), false) => CertificateSource::Files(CertFiles {
                cert: cert.clone(),
                key: key.clone(),
            }),
            (None, None, true) => {
                let above_zero = |flag, d: Duration| {
                    if d.is_zero() {
                        Err(err(flag, "must be above zero"))
                    } else {
                        Ok(d)
                    }
                };
                let leaf_validity =
                    above_zero("self-signed-leaf-validity", self.self_signed_leaf_validity)?;
                let ca_validity =
                    above_zero("self-signed-ca-validity", self.self_signed_ca_validity)?;
                if ca_validity < leaf_validity {
                    return Err(err(
                        "self-signed-ca-validity",
                        "must not be shorter than --self-signed-leaf-validity",
                    ));
                }
                CertificateSource::SelfSigned(SelfSignedConfig {
                    secret: self
                        .self_signed_secret
                        .clone()
                        .unwrap_or_else(|| format!("{prefix}-controller-secret")),
                    service: self
                        .webhook_service
                        .clone()
                        .unwrap_or_else(|| format!("{prefix}-webhook")),
                    configuration: self
                        .webhook_configuration
                        .clone()
                        .unwrap_or_else(|| format!("{prefix}-hook")),
                    sans: self.self_signed_san.clone(),
                    leaf_validity,
                    ca_validity,
                })
            }
            (_, _, true) => {
                return Err(err(
                    "self-signed",
                    "excludes --tls-cert-file and --tls-key-file",
                ));
            }
            (Some(_), None, false) => {
                return Err(err("tls-key-file", "required with --tls-cert-file"));
            }
            (None, Some(_), false) => {
                return Err(err("tls-cert-file", "required with --tls-key-file"));
            }
            (None, None, false) => {
                return Err(err(
                    "webhook-address",
                    "needs a certificate: --tls-cert-file and --tls-key-file, or --self-signed",
                ));
            }
        };
        if !self.self_signed {
            for (flag, set) in [
                ("self-signed-san", !self.self_signed_san.is_empty()),
                ("self-signed-secret", self.self_signed_secret.is_some()),
                (
                    "webhook-configuration",
                    self.webhook_configuration.is_some(),
                ),
                ("webhook-service", self.webhook_service.is_some()),
            ] {
                if set {
                    return Err(err(flag, "only applies with --self-signed"));
                }
            }
        }
        let reload_interval = self.tls_reload_interval;
        let scheduler_names = if self.scheduler_names.is_empty() {
            vec![mutation::DEFAULT_SCHEDULER.to_string()]
        } else {
            self.scheduler_names.clone()
        };
        if scheduler_names.iter().any(|n| n.trim().is_empty()) {
            return Err(err("scheduler-names", "names must not be empty"));
        }
        Ok(Some(WebhookConfig {
            address,
            policy: WebhookPolicy {
                driver: driver.to_string(),
                scheduler_names,
            },
            certificate,
            reload_interval,
        }))
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WebhookCode {
    webhook: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WebhookLabel {
    webhook: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Lookup {
    kind: String,
    source: String,
}

/// The webhook's metrics: controller-runtime's request counter and latency, and where lookups
/// were answered from.
#[derive(Clone, Debug)]
pub struct WebhookMetrics {
    requests: Family<WebhookCode, Counter>,
    latency: Family<WebhookLabel, Histogram>,
    lookups: Family<Lookup, Counter>,
}

impl WebhookMetrics {
    /// Registers the families in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            requests: Family::default(),
            latency: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0001, 2.0, 16))
            }),
            lookups: Family::default(),
        };
        registry.register(
            "controller_runtime_webhook_requests",
            "Total number of admission requests by HTTP status code",
            m.requests.clone(),
        );
        registry.register(
            "controller_runtime_webhook_latency_seconds",
            "Histogram of the latency of processing admission requests",
            m.latency.clone(),
        );
        registry.register(
            "pmem_csi_webhook_lookups",
            "Claim and class lookups of the webhook by where they were answered",
            m.lookups.clone(),
        );
        m
    }

    fn request(&self, code: u16, took: Duration) {
        self.requests
            .get_or_create(&WebhookCode {
                webhook: ROUTE.into(),
                code: code.to_string(),
            })
            .inc();
        self.latency
            .get_or_create(&WebhookLabel {
                webhook: ROUTE.into(),
            })
            .observe(took.as_secs_f64());
    }

    fn lookup(&self, kind: &str, source: &str) {
        self.lookups
            .get_or_create(&Lookup {
                kind: kind.into(),
                source: source.into(),
            })
            .inc();
    }
}

/// What the handler shares.
#[derive(Clone)]
struct Shared {
    client: kube::Client,
    stores: Stores,
    policy: Arc<WebhookPolicy>,
    metrics: WebhookMetrics,
}

/// The webhook's routes over the shared caches.
pub fn router(
    client: kube::Client,
    stores: Stores,
    policy: WebhookPolicy,
    metrics: WebhookMetrics,
) -> Router {
    Router::new()
        .route(ROUTE, post(mutate))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(Shared {
            client,
            stores,
            policy: Arc::new(policy),
            metrics,
        })
}

/// Serves `router` over HTTPS with certificates from `resolver` until `shutdown`.
pub async fn serve(
    server: HttpsServer,
    router: Router,
    resolver: Arc<CertResolver>,
    shutdown: CancellationToken,
) -> Result<(), crate::tls::TlsError> {
    let config = crate::tls::server_config(resolver)?;
    server.serve(router, config, shutdown).await;
    Ok(())
}

async fn mutate(State(shared): State<Shared>, body: Bytes) -> Response {
    let started = Instant::now();
    let answer = match admission::decode_review(&body) {
        Err(e) => Err(e),
        Ok(request) => {
            let decision = decide(&shared, &request).await;
            let patch = match decision {
                Decision::Patch(patch) => Some(patch),
                Decision::Unchanged(reason) => {
                    tracing::debug!(uid = %request.uid, reason = reason.as_str(), "pod unchanged");
                    None
                }
            };
            admission::allow_response(&request, patch)
        }
    };
    let response = match answer {
        Ok(body) => (
            StatusCode::OK,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Err(e) => {
            if e.http_status() >= 500 {
                tracing::error!(error = %e, "answering a review");
            }
            let status =
                StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            (status, e.http_body()).into_response()
        }
    };
    shared
        .metrics
        .request(response.status().as_u16(), started.elapsed());
    response
}

async fn decide(shared: &Shared, request: &admission::AdmissionRequest) -> Decision {
    let Some(pod) = &request.object else {
        return Decision::Unchanged(mutation::Unchanged::NotCreate);
    };
    if let Some(reason) = mutation::screen(pod, &request.operation, &shared.policy) {
        return Decision::Unchanged(reason);
    }
    let request_namespace = request.namespace.as_deref().unwrap_or_default();
    let namespace = mutation::pod_namespace(pod, request_namespace).to_string();
    let lookup = ReviewLookup {
        shared,
        fetchable: pod_volumes::claims_to_fetch(pod, &namespace),
        deadline: tokio::time::Instant::now() + LOOKUPS_DEADLINE,
    };
    let facts = pod_volumes::gather(pod, &namespace, &lookup).await;
    mutation::decide(
        pod,
        &request.operation,
        request_namespace,
        &shared.policy,
        &facts,
    )
}

/// `fetch` for every key, at most [`PARALLEL_LOOKUPS`] at once, until `deadline`: keys not
/// answered by then count as not found.
async fn fetch_all<'a, K, T, F, Fut>(
    keys: Vec<K>,
    deadline: tokio::time::Instant,
    fetch: F,
) -> Vec<(K, Option<T>)>
where
    K: Clone + Ord + 'a,
    F: Fn(K) -> Fut,
    Fut: std::future::Future<Output = Option<T>> + 'a,
{
    use futures::StreamExt;
    let mut pending: BTreeSet<K> = keys.iter().cloned().collect();
    let mut answers = futures::stream::iter(keys)
        .map(|key| {
            let fetched = fetch(key.clone());
            async move { (key, fetched.await) }
        })
        .buffer_unordered(PARALLEL_LOOKUPS);
    let mut out = Vec::new();
    while let Ok(Some((key, found))) = tokio::time::timeout_at(deadline, answers.next()).await {
        pending.remove(&key);
        out.push((key, found));
    }
    if !pending.is_empty() {
        tracing::warn!(
            unanswered = pending.len(),
            deadline = ?LOOKUPS_DEADLINE,
            "lookups unanswered at the deadline count as not found"
        );
    }
    out.extend(pending.into_iter().map(|key| (key, None)));
    out
}

/// The lookups of one review: the caches first; a claim the pod names and the cache misses
/// (created right before its pod), and a missing class, by GET, at most
/// [`PARALLEL_LOOKUPS`] at once and all before `deadline`.
struct ReviewLookup<'a> {
    shared: &'a Shared,
    /// The claims worth a GET: a generic ephemeral volume's claim is made after its pod, so at
    /// admission it cannot exist.
    fetchable: BTreeSet<ClaimKey>,
    deadline: tokio::time::Instant,
}

impl ReviewLookup<'_> {
    /// Each key from the cache; the misses `fetchable` allows by `fetch`, under the review's
    /// deadline; the other misses as not found.
    async fn cache_then_fetch<K, T, Fut>(
        &self,
        keys: Vec<K>,
        cached: impl Fn(&K) -> Option<T>,
        fetchable: impl Fn(&K) -> bool,
        fetch: impl Fn(K) -> Fut,
    ) -> Vec<(K, Option<T>)>
    where
        K: Clone + Ord,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let mut found = Vec::with_capacity(keys.len());
        let mut missing = Vec::new();
        for key in keys {
            match cached(&key) {
                Some(value) => found.push((key, Some(value))),
                None if fetchable(&key) => missing.push(key),
                None => found.push((key, None)),
            }
        }
        found.extend(fetch_all(missing, self.deadline, fetch).await);
        found
    }
}

impl pod_volumes::Lookup for ReviewLookup<'_> {
    async fn claims(&self, keys: Vec<ClaimKey>) -> Vec<(ClaimKey, Option<ClaimFacts>)> {
        let fetchable = |key: &ClaimKey| {
            let fetchable = self.fetchable.contains(key);
            if !fetchable {
                self.shared.metrics.lookup("claim", "missing");
            }
            fetchable
        };
        self.cache_then_fetch(
            keys,
            |key| cached_claim(self.shared, key),
            fetchable,
            |key| fetch_claim(self.shared, key),
        )
        .await
    }

    async fn classes(&self, names: Vec<String>) -> Vec<(String, Option<ClassFacts>)> {
        let cached = |name: &String| cached_class(self.shared, name);
        self.cache_then_fetch(
            names,
            cached,
            |_| true,
            |name| fetch_class(self.shared, name),
        )
        .await
    }

    async fn default_class(&self) -> Option<ClassFacts> {
        cached_default_class(&self.shared.stores.classes)
    }
}

/// The lookups of the bypass reporting: the caches alone (a miss counts as not found).
struct CacheLookup<'a> {
    stores: &'a Stores,
}

impl pod_volumes::Lookup for CacheLookup<'_> {
    async fn claims(&self, keys: Vec<ClaimKey>) -> Vec<(ClaimKey, Option<ClaimFacts>)> {
        keys.into_iter()
            .map(|key| {
                let claim = self
                    .stores
                    .claims
                    .get(&ObjectRef::<ClaimSummary>::new(&key.name).within(&key.namespace))
                    .map(|c| ClaimFacts::from(c.as_ref()));
                (key, claim)
            })
            .collect()
    }

    async fn classes(&self, names: Vec<String>) -> Vec<(String, Option<ClassFacts>)> {
        names
            .into_iter()
            .map(|name| {
                let class = self
                    .stores
                    .classes
                    .get(&ObjectRef::<StorageClass>::new(&name))
                    .map(|c| ClassFacts::from(c.as_ref()));
                (name, class)
            })
            .collect()
    }

    async fn default_class(&self) -> Option<ClassFacts> {
        cached_default_class(&self.stores.classes)
    }
}

/// The cluster's default class among the cached ones.
fn cached_default_class(classes: &Store<StorageClass>) -> Option<ClassFacts> {
    let all: Vec<(String, ClassFacts)> = classes
        .state()
        .iter()
        .filter_map(|c| Some((c.metadata.name.clone()?, ClassFacts::of(c))))
        .collect();
    default_class(all.iter().map(|(name, class)| (name.as_str(), class))).map(|(_, c)| c.clone())
}

fn cached_claim(shared: &Shared, key: &pod_volumes::ClaimKey) -> Option<ClaimFacts> {
    let claim = shared
        .stores
        .claims
        .get(&ObjectRef::<ClaimSummary>::new(&key.name).within(&key.namespace))?;
    shared.metrics.lookup("claim", "cache");
    Some(ClaimFacts::from(claim.as_ref()))
}

/// A claim the cache has not seen yet (created right before its pod).
async fn fetch_claim(shared: &Shared, key: pod_volumes::ClaimKey) -> Option<ClaimFacts> {
    let (namespace, name) = (&key.namespace, &key.name);
    let api = Api::<PersistentVolumeClaim>::namespaced(shared.client.clone(), namespace);
    match api.get_opt(name).await {
        Ok(Some(claim)) => {
            shared.metrics.lookup("claim", "api");
            Some(ClaimFacts::from(&claim))
        }
        Ok(None) => {
            shared.metrics.lookup("claim", "missing");
            None
        }
        Err(e) => {
            tracing::warn!(namespace, name, "looking up claim: {e}");
            shared.metrics.lookup("claim", "error");
            None
        }
    }
}

fn cached_class(shared: &Shared, name: &str) -> Option<ClassFacts> {
    let class = shared
        .stores
        .classes
        .get(&ObjectRef::<StorageClass>::new(name))?;
    shared.metrics.lookup("class", "cache");
    Some(ClassFacts::from(class.as_ref()))
}

async fn fetch_class(shared: &Shared, name: String) -> Option<ClassFacts> {
    let api = Api::<StorageClass>::all(shared.client.clone());
    match api.get_opt(&name).await {
        Ok(Some(class)) => {
            shared.metrics.lookup("class", "api");
            Some(ClassFacts::from(&class))
        }
        Ok(None) => {
            shared.metrics.lookup("class", "missing");
            None
        }
        Err(e) => {
            tracing::warn!(name, "looking up class: {e}");
            shared.metrics.lookup("class", "error");
            None
        }
    }
}

/// The webhook's relevance rule from the caches alone (a miss counts as not found), for the
/// bypass reconciler: would the webhook have marked this pod?
pub fn pod_relevance(stores: Stores, policy: WebhookPolicy) -> controllers::bypass::PodRelevance {
    Arc::new(move |pod| {
        if mutation::screen(pod, &admission::Operation::Create, &policy).is_some() {
            return false;
        }
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let facts = pod_volumes::gather_now(pod, &namespace, &CacheLookup { stores: &stores });
        !pod_volumes::pending_volumes(pod, &namespace, &policy.driver, &facts).is_empty()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files() -> WebhookOptions {
        WebhookOptions {
            webhook_address: Some(SocketAddr::from(([127, 0, 0, 1], 8443))),
            tls_cert_file: Some("/c".into()),
            tls_key_file: Some("/k".into()),
            self_signed_leaf_validity: Duration::from_secs(2160 * 3600),
            self_signed_ca_validity: Duration::from_secs(87600 * 3600),
            tls_reload_interval: Duration::from_secs(1),
            ..Default::default()
        }
    }

    #[test]
    fn validate_table() {
        type Edit = fn(&mut WebhookOptions);
        let cases: [(&str, Edit, Option<&str>); 10] = [
            ("files", |_| {}, None),
            (
                "self-signed",
                |o| {
                    o.tls_cert_file = None;
                    o.tls_key_file = None;
                    o.self_signed = true;
                },
                None,
            ),
            (
                "no address, no flags",
                |o| {
                    o.webhook_address = None;
                    o.tls_cert_file = None;
                    o.tls_key_file = None;
                },
                None,
            ),
            (
                "cert without address",
                |o| o.webhook_address = None,
                Some("tls-cert-file"),
            ),
            (
                "key missing",
                |o| o.tls_key_file = None,
                Some("tls-key-file"),
            ),
            (
                "no certificate",
                |o| {
                    o.tls_cert_file = None;
                    o.tls_key_file = None;
                },
                Some("webhook-address"),
            ),
            (
                "both sources",
                |o| o.self_signed = true,
                Some("self-signed"),
            ),
            (
                "san without self-signed",
                |o| o.self_signed_san = vec!["x".into()],
                Some("self-signed-san"),
            ),
            (
                "empty scheduler name",
                |o| o.scheduler_names = vec![" ".into()],
                Some("scheduler-names"),
            ),
            (
                "ca shorter than leaf",
                |o| {
                    o.tls_cert_file = None;
                    o.tls_key_file = None;
                    o.self_signed = true;
                    o.self_signed_ca_validity = Duration::from_secs(3600);
                },
                Some("self-signed-ca-validity"),
            ),
        ];
        for (name, edit, flag) in cases {
            let mut o = files();
            edit(&mut o);
            match (o.validate("pmem-csi.intel.com"), flag) {
                (Ok(_), None) => {}
                (Err(e), Some(flag)) => assert_eq!(e.flag, flag, "{name}"),
                (got, want) => panic!("{name}: got {got:?}, want error on {want:?}"),
            }
        }
        let mut o = files();
        o.tls_cert_file = None;
        o.tls_key_file = None;
        o.self_signed = true;
        let config = o
            .validate("pmem-csi.intel.com")
            .expect("valid")
            .expect("enabled");
        assert_eq!(config.policy.scheduler_names, ["default-scheduler"]);
        match config.certificate {
            CertificateSource::SelfSigned(s) => assert_eq!(
                (
                    s.secret.as_str(),
                    s.service.as_str(),
                    s.configuration.as_str()
                ),
                (
                    "pmem-csi-intel-com-controller-secret",
                    "pmem-csi-intel-com-webhook",
                    "pmem-csi-intel-com-hook"
                )
            ),
            other => panic!("{other:?}"),
        }
    }
}
