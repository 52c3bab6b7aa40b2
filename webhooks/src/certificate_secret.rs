//! `--self-signed`: the leader keeps an own CA and the webhook's serving certificate in a
//! Secret and the CA in the MutatingWebhookConfiguration's `caBundle`; every replica serves
//! what the Secret holds. `pmem-csi controller rotate-ca` replaces the CA; the old one stays
//! in the bundle until the new serving certificate has been out for [`PREVIOUS_CA_KEPT`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::{ObjectMeta, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;

use crate::self_signed::{
    self, CaPem, LeafState, LeafVerdict, ReissueReason, SelfSignedError, SubjectNames,
};
use crate::tls::CertResolver;
use crate::webhook::SelfSignedConfig;

/// Secret key of the CA certificate.
pub const CA_CERT: &str = "ca.crt";
/// Secret key of the CA's private key.
pub const CA_KEY: &str = "ca.key";
/// Secret key of the serving certificate.
pub const TLS_CERT: &str = "tls.crt";
/// Secret key of the serving key.
pub const TLS_KEY: &str = "tls.key";
/// Secret key of the CA replaced by `rotate-ca`, trusted until the new leaf is everywhere.
pub const PREVIOUS_CA: &str = "ca-previous.crt";
/// How long the replaced CA stays in the bundle after a leaf of the new CA was issued: replicas
/// reload from the Secret within seconds, and keep-alive connections of the apiserver carry
/// the old leaf until they close.
pub const PREVIOUS_CA_KEPT: time::Duration = time::Duration::minutes(5);

/// Failures keeping the Secret.
#[derive(Debug, thiserror::Error)]
pub enum CertificateSecretError {
    /// An API call failed.
    #[error("{what}: {source}")]
    Api {
        /// What was attempted.
        what: String,
        /// Why it failed.
        source: kube::Error,
    },
    /// Issuing or reading certificates failed.
    #[error(transparent)]
    Certificate(#[from] SelfSignedError),
    /// The Secret has no CA to rotate.
    #[error("Secret {0} holds no CA to rotate; the leader creates one first")]
    NoCa(String),
}

fn api_error(what: impl Into<String>) -> impl FnOnce(kube::Error) -> CertificateSecretError {
    let what = what.into();
    move |source| CertificateSecretError::Api { what, source }
}

/// The Secret and what is derived from it.
#[derive(Clone)]
pub struct CertificateSecret {
    client: kube::Client,
    namespace: String,
    config: SelfSignedConfig,
}

impl CertificateSecret {
    /// The Secret of `config` in `namespace`.
    pub fn new(client: kube::Client, namespace: &str, config: SelfSignedConfig) -> Self {
        Self {
            client,
            namespace: namespace.to_string(),
            config,
        }
    }

    fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn names(&self) -> SubjectNames {
        SubjectNames::for_services(
            &[self.config.service.as_str()],
            &self.namespace,
            &self.config.sans,
        )
    }

    /// How often the leader checks the Secret and the `caBundle` (an apply that wipes the
    /// bundle is repaired within this).
    pub fn period(&self) -> Duration {
        (self.config.leaf_validity / 30).clamp(Duration::from_secs(1), Duration::from_secs(60))
    }

    /// The leader's loop until `term`.
    pub async fn keep(self, term: CancellationToken) {
        loop {
            if let Err(e) = self.reconcile(OffsetDateTime::now_utc()).await {
                tracing::warn!(secret = %self.config.secret, "keeping the webhook certificate: {e}");
            }
            tokio::select! {
                _ = tokio::time::sleep(self.period()) => {}
                _ = term.cancelled() => return,
            }
        }
    }

    /// One pass of the leader: CA present, bundle injected, leaf valid for the wanted names.
    pub async fn reconcile(&self, now: OffsetDateTime) -> Result<(), CertificateSecretError> {
        let existing = self
            .secrets()
            .get_opt(&self.config.secret)
            .await
            .map_err(api_error(format!("reading Secret {}", self.config.secret)))?;
        let mut data = existing.as_ref().map(secret_strings).unwrap_or_default();
        let mut changed = false;
        let ca = match (data.get(CA_CERT), data.get(CA_KEY)) {
            (Some(cert), Some(key)) if self_signed::parse_cert(cert, "CA").is_ok() => CaPem {
                cert_pem: cert.clone(),
                key_pem: key.clone(),
            },
            _ => {
                tracing::info!(secret = %self.config.secret, "issuing a new webhook CA");
                let ca = self_signed::issue_ca(
                    "pmem-csi webhook CA",
                    now,
                    to_time(self.config.ca_validity),
                )?;
                data.insert(CA_CERT.into(), ca.cert_pem.clone());
                data.insert(CA_KEY.into(), ca.key_pem.clone());
                changed = true;
                ca
            }
        };
        let bundle =
            self_signed::ca_bundle(&ca.cert_pem, data.get(PREVIOUS_CA).map(String::as_str))?;
        let trusted_before = self.inject(&bundle).await?;
        let leaf = match (data.get(TLS_CERT), data.get(TLS_KEY)) {
            (Some(cert), Some(_)) => LeafState::read(cert, &ca.cert_pem).ok(),
            _ => None,
        };
        match self_signed::judge_leaf(leaf.as_ref(), &self.names(), now) {
            LeafVerdict::Keep => {
                // The new leaf has been out long enough: stop trusting the replaced CA.
                if let Some(leaf) = &leaf
                    && data.contains_key(PREVIOUS_CA)
                    && now >= leaf.facts.not_before + self_signed::BACKDATE + PREVIOUS_CA_KEPT
                {
                    data.remove(PREVIOUS_CA);
                    changed = true;
                }
            }
            // A leaf of a new CA is served only once the apiserver was told to trust that CA
            // (the bundle was already in place when this pass began).
            LeafVerdict::Reissue(ReissueReason::OtherCa) if trusted_before == Some(false) => {
                tracing::info!("waiting one pass for the new CA to reach the apiserver");
            }
            LeafVerdict::Reissue(reason) => {
                tracing::info!(?reason, "issuing the webhook serving certificate");
                let leaf = self_signed::issue_leaf(
                    &ca,
                    &self.names(),
                    now,
                    to_time(self.config.leaf_validity),
                )?;
                data.insert(TLS_CERT.into(), leaf.cert_pem);
                data.insert(TLS_KEY.into(), leaf.key_pem);
                changed = true;
            }
        }
        if changed {
            self.write(existing, data).await?;
        }
        Ok(())
    }

    /// Puts `bundle` into every webhook of the configuration. Returns whether it was already
    /// there (`None`: no such configuration, so nobody needs to trust it yet).
    async fn inject(&self, bundle: &str) -> Result<Option<bool>, CertificateSecretError> {
        let api = Api::<MutatingWebhookConfiguration>::all(self.client.clone());
        let name = &self.config.configuration;
        let Some(mut configuration) = api.get_opt(name).await.map_err(api_error(format!(
            "reading MutatingWebhookConfiguration {name}"
        )))?
        else {
            tracing::debug!(%name, "no MutatingWebhookConfiguration to inject the CA into");
            return Ok(None);
        };
        let want = ByteString(bundle.as_bytes().to_vec());
        let mut already = true;
        for webhook in configuration.webhooks.iter_mut().flatten() {
            if webhook.client_config.ca_bundle.as_ref() != Some(&want) {
                webhook.client_config.ca_bundle = Some(want.clone());
                already = false;
            }
        }
        if !already {
            // Replace carries the resourceVersion: a concurrent apply makes this fail and the
            // next pass retries with what the apply left.
            api.replace(name, &PostParams::default(), &configuration)
                .await
                .map_err(api_error(format!("injecting the CA into {name}")))?;
            tracing::info!(%name, "injected the webhook CA bundle");
        }
        Ok(Some(already))
    }

    async fn write(
        &self,
        existing: Option<Secret>,
        data: BTreeMap<String, String>,
    ) -> Result<(), CertificateSecretError> {
        let bytes: BTreeMap<String, ByteString> = data
            .into_iter()
            .map(|(k, v)| (k, ByteString(v.into_bytes())))
            .collect();
        match existing {
            Some(mut secret) => {
                secret.data = Some(bytes);
                secret.string_data = None;
                self.secrets()
                    .replace(&self.config.secret, &PostParams::default(), &secret)
                    .await
                    .map_err(api_error(format!("updating Secret {}", self.config.secret)))?;
            }
            None => {
                let secret = Secret {
                    metadata: ObjectMeta {
                        name: Some(self.config.secret.clone()),
                        namespace: Some(self.namespace.clone()),
                        labels: Some(BTreeMap::from([
                            ("app.kubernetes.io/part-of".into(), "pmem-csi".into()),
                            ("app.kubernetes.io/component".into(), "controller".into()),
                        ])),
                        ..Default::default()
                    },
                    data: Some(bytes),
                    ..Default::default()
                };
                self.secrets()
                    .create(&PostParams::default(), &secret)
                    .await
                    .map_err(api_error(format!("creating Secret {}", self.config.secret)))?;
            }
        }
        Ok(())
    }

    /// Every replica: serves the leaf the Secret holds, reloading on every change, until
    /// `shutdown`.
    pub async fn follow(self, resolver: Arc<CertResolver>, shutdown: CancellationToken) {
        let config =
            watcher::Config::default().fields(&format!("metadata.name={}", self.config.secret));
        let mut events = std::pin::pin!(watcher::watcher(self.secrets(), config).default_backoff());
        loop {
            let event = tokio::select! {
                e = events.next() => e,
                _ = shutdown.cancelled() => return,
            };
            let Some(event) = event else { return };
            let secret = match event {
                Ok(watcher::Event::Apply(s) | watcher::Event::InitApply(s)) => s,
                Ok(_) => continue,
                Err(e) => {
                    tracing::warn!("watching the webhook Secret: {e}");
                    continue;
                }
            };
            let data = secret_strings(&secret);
            if let (Some(cert), Some(key)) = (data.get(TLS_CERT), data.get(TLS_KEY)) {
                match resolver.set(cert.as_bytes(), key.as_bytes()) {
                    Ok(info) => {
                        tracing::info!(serial = %info.serial, "serving the webhook certificate from the Secret")
                    }
                    Err(e) => tracing::warn!("the webhook Secret's certificate is not usable: {e}"),
                }
            }
        }
    }

    /// `rotate-ca`: a new CA replaces the current one, which stays trusted as the previous CA
    /// until the leader has issued and spread a leaf of the new one.
    pub async fn rotate_ca(&self, now: OffsetDateTime) -> Result<(), CertificateSecretError> {
        let existing = self
            .secrets()
            .get_opt(&self.config.secret)
            .await
            .map_err(api_error(format!("reading Secret {}", self.config.secret)))?;
        let mut data = existing.as_ref().map(secret_strings).unwrap_or_default();
        let Some(current) = data.get(CA_CERT).cloned() else {
            return Err(CertificateSecretError::NoCa(self.config.secret.clone()));
        };
        let ca =
            self_signed::issue_ca("pmem-csi webhook CA", now, to_time(self.config.ca_validity))?;
        // Keep every CA a replica may still serve a leaf of: the current one and, if an
        // earlier rotation is still in progress, its predecessor too.
        let previous = self_signed::ca_bundle(&current, data.get(PREVIOUS_CA).map(String::as_str))?;
        data.insert(PREVIOUS_CA.into(), previous);
        data.insert(CA_CERT.into(), ca.cert_pem);
        data.insert(CA_KEY.into(), ca.key_pem);
        self.write(existing, data).await
    }
}

fn secret_strings(secret: &Secret) -> BTreeMap<String, String> {
    secret
        .data
        .iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.clone(), String::from_utf8(v.0.clone()).ok()?)))
        .collect()
}

fn to_time(d: Duration) -> time::Duration {
    time::Duration::try_from(d).unwrap_or(time::Duration::MAX)
}
