//! The pod webhook's concerns in the controller process: its HTTPS server, its certificate
//! (files watched, or the self-signed Secret kept by the leader and followed by every replica),
//! readiness once a certificate is there to serve, and the bypass reporting of pods admitted
//! while the webhook was unreachable (leader only).

use std::sync::Arc;
use std::time::Duration;

use controllers::ControllerProcess;
use controllers::concern::Concern;
use controllers::readiness::Readiness;
use prometheus_client::registry::Registry;

use crate::certificate_secret::CertificateSecret;
use crate::https::{HttpsServer, ServeOptions};
use crate::tls::CertResolver;
use crate::webhook::{self, CertificateSource, WebhookConfig, WebhookMetrics};

/// How often a replica waiting for its first certificate looks again.
const CERTIFICATE_POLL: Duration = Duration::from_millis(200);

/// Why the webhook could not start.
#[derive(Debug, thiserror::Error)]
pub enum WebhookStartError {
    /// `--tls-cert-file` / `--tls-key-file` do not load.
    #[error("loading the webhook certificate: {0}")]
    Certificate(String),
    /// `--webhook-address` cannot be bound.
    #[error("binding the webhook address: {0}")]
    Bind(crate::https::HttpsError),
    /// The lookups' API client cannot be made (no in-cluster config, no `KUBECONFIG`).
    #[error("the webhook's API client: {0}")]
    Client(kube::Error),
}

/// The webhook's own client budget for the claim and class GETs of its reviews. Every pod's
/// admission waits for them, and a claim created right before its pod is not in the cache yet:
/// under the controller's shared budget (20/s, burst 40) a burst of 100 such pods queued its
/// GETs for up to seconds (the start-up benchmark summed 16 s of admission time over 100 pods).
/// A bucket of its own keeps reconciles and admissions from waiting for each other.
const LOOKUP_BUDGET: controllers::flags::ClientBudget = controllers::flags::ClientBudget {
    qps: 50.0,
    burst: 100,
};

/// Adds the webhook's concerns to `process`, its metrics to `registry` and its certificate to
/// `readiness`; binds the webhook address now, so that a taken port fails the start.
pub async fn add(
    process: &mut ControllerProcess,
    config: WebhookConfig,
    registry: &mut Registry,
    readiness: &Readiness,
) -> Result<(), WebhookStartError> {
    let resolver = Arc::new(CertResolver::new());
    match &config.certificate {
        CertificateSource::Files(files) => {
            resolver
                .load_files(files)
                .map_err(|e| WebhookStartError::Certificate(e.to_string()))?;
            let (resolver, files, interval) =
                (resolver.clone(), files.clone(), config.reload_interval);
            process.add_concern(Concern::everywhere(
                "webhook-certificate-files",
                move |token| resolver.watch_files(files, interval, token),
            ));
        }
        CertificateSource::SelfSigned(self_signed) => {
            let secret = CertificateSecret::new(
                process.client(),
                process.config().namespace(),
                self_signed.clone(),
            );
            let keeper = secret.clone();
            process.add_concern(Concern::leader_only("webhook-certificate", move |term| {
                keeper.clone().keep(term)
            }));
            let follower = resolver.clone();
            process.add_concern(Concern::everywhere(
                "webhook-certificate-follower",
                move |token| secret.follow(follower, token),
            ));
        }
    }
    // Ready once a certificate is there to serve (followers wait for the leader's Secret).
    let certificate = readiness.register("webhook-certificate");
    let watched = resolver.clone();
    process.add_concern(Concern::everywhere(
        "webhook-certificate-ready",
        move |token| async move {
            while watched.current().is_none() {
                tokio::select! {
                    _ = tokio::time::sleep(CERTIFICATE_POLL) => {}
                    _ = token.cancelled() => return,
                }
            }
            certificate.set(true);
            token.cancelled().await;
        },
    ));
    let server = HttpsServer::bind(config.address)
        .await
        .map_err(WebhookStartError::Bind)?
        .with_options(ServeOptions::webhook());
    tracing::info!(address = %server.local_addr(), "pod webhook listening");
    let lookups = controllers::rate_limit::client(LOOKUP_BUDGET)
        .await
        .map_err(WebhookStartError::Client)?;
    let router = webhook::router(
        lookups,
        process.stores(),
        config.policy.clone(),
        WebhookMetrics::register(registry),
    );
    process.add_concern(Concern::everywhere_fallible(
        "webhook-server",
        move |token| webhook::serve(server, router, resolver, token),
    ));
    // Pods admitted while the webhook was unreachable: reported by the leader.
    let relevance = webhook::pod_relevance(process.stores(), config.policy.clone());
    let (client, driver, reconciles, reporter) = (
        process.client(),
        config.policy.driver.clone(),
        process.reconciles(),
        process.config().reporter(),
    );
    let metrics = controllers::bypass::BypassMetrics::register(registry);
    process.add_concern(Concern::leader_only("bypass", move |term| {
        controllers::bypass::Bypass::new(
            client.clone(),
            driver.clone(),
            relevance.clone(),
            reporter.clone(),
            metrics.clone(),
            reconciles.clone(),
        )
        .run(term)
    }));
    Ok(())
}
