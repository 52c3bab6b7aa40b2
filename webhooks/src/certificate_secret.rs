//! `--self-signed`: the leader keeps an own CA and the webhook's serving certificate in a
//! Secret and the CA in the MutatingWebhookConfiguration's `caBundle`; every replica serves
//! what the Secret holds. The rules live in [`crate::self_signed`]; this is the shell that reads
//! the Secret and the bundle, applies them, and writes.
//!
//! Writes are ordered so that the apiserver trusts a CA before any replica serves a leaf of it,
//! and stops trusting one only after no replica does:
//! 1. the Secret, holding the current CA and every CA still trusted besides it, is written first
//!    (so the CA's key is stored before anything depends on it);
//! 2. then the bundle (current and previous CAs) is injected;
//! 3. a leaf of a CA is issued into the Secret (from which every replica reloads) only on a pass
//!    that found the bundle already carrying that CA, [`TRUST_SETTLE`] after it was injected.
//!
//! A deleted or corrupted Secret is written back from what this process last saw of it (every
//! replica remembers, so a newly elected leader does too); when nobody knows the CA's key, a
//! new CA is added to the bundle next to the old one, under rule 3.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
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
    self, CaChoice, CaPem, LeafAction, LeafPem, LeafState, SelfSignedError, SubjectNames, Trust,
    Validity,
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
/// Secret key of the CAs replaced by a rotation, renewal or repair, trusted until the new leaf
/// is everywhere.
pub const PREVIOUS_CA: &str = "ca-previous.crt";
/// Longest time the replaced CAs stay in the bundle after a leaf of the new CA was issued:
/// replicas reload from the Secret within seconds. Shorter with short-lived leaves
/// ([`CertificateSecret::overlap`]).
pub const PREVIOUS_CA_KEPT: time::Duration = time::Duration::minutes(5);
/// How long after injecting a bundle with a new CA the leader waits before issuing a leaf of
/// it: the apiserver picks up webhook configuration changes through a watch, within
/// milliseconds normally, and HA apiservers each on their own.
pub const TRUST_SETTLE: Duration = Duration::from_secs(5);

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

/// What the Secret holds when it is intact: what the leader writes and every replica remembers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contents {
    /// The current CA; new leaves are signed by it.
    pub ca: CaPem,
    /// CAs still trusted besides it (a PEM bundle, empty outside a rotation).
    pub previous: String,
    /// The serving certificate every replica serves; `None` before the first is issued.
    pub leaf: Option<LeafPem>,
}

impl Contents {
    /// The Secret's `data`.
    pub fn to_data(&self) -> BTreeMap<String, ByteString> {
        let mut data = BTreeMap::from([
            (CA_CERT.to_owned(), self.ca.cert_pem.clone()),
            (CA_KEY.to_owned(), self.ca.key_pem.clone()),
        ]);
        if !self.previous.is_empty() {
            data.insert(PREVIOUS_CA.to_owned(), self.previous.clone());
        }
        if let Some(leaf) = &self.leaf {
            data.insert(TLS_CERT.to_owned(), leaf.cert_pem.clone());
            data.insert(TLS_KEY.to_owned(), leaf.key_pem.clone());
        }
        data.into_iter()
            .map(|(k, v)| (k, ByteString(v.into_bytes())))
            .collect()
    }
}

/// The Secret as read, each part kept only when usable, so that garbage in one key neither
/// blocks the leader nor hides the intact parts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoredSecret {
    /// The CA, when its certificate is a CA and the key is its own.
    pub ca: Option<CaPem>,
    /// The serving certificate, when it parses and the key is its own.
    pub leaf: Option<LeafPem>,
    /// The raw texts of `ca.crt` and `ca-previous.crt`: every readable CA in them stays
    /// trusted (even a CA whose key was lost still verifies the leaves replicas serve).
    pub ca_texts: Vec<String>,
}

impl StoredSecret {
    /// Reads a Secret's `data` (absent Secret: empty map).
    pub fn read(data: &BTreeMap<String, ByteString>) -> Self {
        let text = |key: &str| {
            data.get(key)
                .and_then(|v| std::str::from_utf8(&v.0).ok())
                .map(str::to_owned)
        };
        let pair = |cert, key| Some((text(cert)?, text(key)?));
        Self {
            ca: pair(CA_CERT, CA_KEY).and_then(|(c, k)| self_signed::usable_ca(&c, &k)),
            leaf: pair(TLS_CERT, TLS_KEY).and_then(|(c, k)| self_signed::usable_leaf(&c, &k)),
            ca_texts: [CA_CERT, PREVIOUS_CA]
                .into_iter()
                .filter_map(text)
                .collect(),
        }
    }
}

/// What one leader pass knows.
#[derive(Debug, Clone)]
pub struct PassInput<'a> {
    /// The Secret as read.
    pub stored: &'a StoredSecret,
    /// The contents this process last saw intact, if any.
    pub remembered: Option<&'a Contents>,
    /// The `caBundle` of each webhook of the configuration; `None` without a configuration.
    pub injected: Option<&'a [Option<String>]>,
    /// The names the serving certificate must cover.
    pub names: &'a SubjectNames,
    /// Now.
    pub now: OffsetDateTime,
    /// Lifetime of a new CA.
    pub ca_validity: time::Duration,
    /// Lifetime of a new serving certificate.
    pub leaf_validity: time::Duration,
    /// How long replaced CAs stay trusted after a leaf of the current CA was issued.
    pub overlap: time::Duration,
}

/// What one leader pass writes: the Secret first, then the bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassPlan {
    /// The Secret's contents.
    pub contents: Contents,
    /// The `caBundle` for every webhook of the configuration.
    pub bundle: String,
    /// Where the CA came from.
    pub ca: CaChoice,
    /// What happened to the serving certificate.
    pub leaf: LeafAction,
}

/// The apiserver's trust in `ca_pem` over all webhooks of the configuration: a webhook whose
/// bundle lacks it would fail calls, so one such is enough for [`Trust::NotYet`].
pub fn trust_in(ca_pem: &str, injected: Option<&[Option<String>]>) -> Trust {
    let Some(bundles) = injected else {
        return Trust::NoBundle;
    };
    let each: Vec<Trust> = bundles
        .iter()
        .map(|b| self_signed::trust_of(ca_pem, b.as_deref()))
        .collect();
    if each.contains(&Trust::NotYet) {
        Trust::NotYet
    } else if each.contains(&Trust::Trusted) {
        Trust::Trusted
    } else {
        Trust::NoBundle
    }
}

/// Plans one leader pass from what it read: the rules of [`crate::self_signed`] applied in
/// order (CA, leaf, previous CAs). Issues certificates (key generation needs randomness) but
/// does no I/O.
pub fn plan_pass(input: &PassInput<'_>) -> Result<PassPlan, SelfSignedError> {
    let now = input.now;
    let validity = |ca: &CaPem| {
        self_signed::parse_cert(&ca.cert_pem, "CA")
            .ok()
            .map(|f| Validity::from(&f))
    };
    let stored_ca = input.stored.ca.as_ref();
    let choice = self_signed::choose_ca(
        stored_ca.and_then(validity),
        input.remembered.map(|r| &r.ca).and_then(validity),
        now,
    );
    // Replicas load every usable leaf the Secret holds and keep theirs otherwise, so the
    // Secret's leaf, else the remembered one, is what they serve.
    let leaf = input
        .stored
        .leaf
        .clone()
        .or_else(|| input.remembered.and_then(|r| r.leaf.clone()));
    let ca = match (choice, stored_ca, input.remembered) {
        (CaChoice::Keep, Some(ca), _) => ca.clone(),
        (CaChoice::Restore, _, Some(remembered)) => remembered.ca.clone(),
        // Renew, Issue: the leaf of the old CA stays until the bundle trusts the new one.
        _ => self_signed::issue_ca("pmem-csi webhook CA", now, input.ca_validity)?,
    };

    let trust = trust_in(&ca.cert_pem, input.injected);
    let state = leaf
        .as_ref()
        .and_then(|l| LeafState::read(&l.cert_pem, &ca.cert_pem).ok());
    let verdict = self_signed::judge_leaf(state.as_ref(), input.names, now);
    let action = self_signed::plan_leaf(verdict, trust);
    let (leaf, current_leaf) = match action {
        LeafAction::Issue(_) => (
            Some(self_signed::issue_leaf(
                &ca,
                input.names,
                now,
                input.leaf_validity,
            )?),
            Some(now),
        ),
        LeafAction::Keep | LeafAction::AwaitTrust(_) => (
            leaf,
            state
                .filter(|s| s.signed_by_ca)
                .map(|s| self_signed::issued_at(&s.facts)),
        ),
    };

    let previous = if self_signed::keep_previous(current_leaf, now, input.overlap) {
        let mut sources: Vec<&str> = input.stored.ca_texts.iter().map(String::as_str).collect();
        if let Some(r) = input.remembered {
            sources.extend([r.ca.cert_pem.as_str(), r.previous.as_str()]);
        }
        sources.extend(
            input
                .injected
                .into_iter()
                .flatten()
                .flatten()
                .map(String::as_str),
        );
        self_signed::trusted_besides(&ca.cert_pem, &sources, now)
    } else {
        String::new()
    };
    let bundle = self_signed::ca_bundle(&ca.cert_pem, Some(&previous))?;
    Ok(PassPlan {
        contents: Contents { ca, previous, leaf },
        bundle,
        ca: choice,
        leaf: action,
    })
}

/// The Secret and what is derived from it.
#[derive(Clone)]
pub struct CertificateSecret {
    client: kube::Client,
    namespace: String,
    config: SelfSignedConfig,
    /// The contents last seen intact, by the leader's writes or the replica's watch: what a
    /// deleted or corrupted Secret is restored from without changing the CA.
    remembered: Arc<Mutex<Option<Contents>>>,
}

impl CertificateSecret {
    /// The Secret of `config` in `namespace`.
    pub fn new(client: kube::Client, namespace: &str, config: SelfSignedConfig) -> Self {
        Self {
            client,
            namespace: namespace.to_string(),
            config,
            remembered: Arc::default(),
        }
    }

    fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn configurations(&self) -> Api<MutatingWebhookConfiguration> {
        Api::all(self.client.clone())
    }

    fn names(&self) -> SubjectNames {
        SubjectNames::for_services(
            &[self.config.service.as_str()],
            &self.namespace,
            &self.config.sans,
        )
    }

    fn remembered(&self) -> Option<Contents> {
        self.remembered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn remember(&self, contents: Contents) {
        *self
            .remembered
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(contents);
    }

    /// How often the leader checks the Secret and the `caBundle` (an apply that wipes the
    /// bundle, a deleted or corrupted Secret is repaired within this).
    pub fn period(&self) -> Duration {
        (self.config.leaf_validity / 30).clamp(Duration::from_secs(1), Duration::from_secs(60))
    }

    /// How long replaced CAs stay trusted after a leaf of the current CA was issued: five
    /// passes (replicas reload within one), at most [`PREVIOUS_CA_KEPT`].
    pub fn overlap(&self) -> time::Duration {
        to_time(self.period() * 5).min(PREVIOUS_CA_KEPT)
    }

    /// The leader's loop until `term`.
    pub async fn keep(self, term: CancellationToken) {
        loop {
            let wait = match self.reconcile(OffsetDateTime::now_utc()).await {
                // A new CA went into the bundle: come back as soon as the apiserver has
                // surely picked it up, to issue its leaf.
                Ok(Some(plan)) if matches!(plan.leaf, LeafAction::AwaitTrust(_)) => TRUST_SETTLE,
                Ok(_) => self.period(),
                Err(e) => {
                    tracing::warn!(secret = %self.config.secret, "keeping the webhook certificate: {e}");
                    self.period()
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = term.cancelled() => return,
            }
        }
    }

    /// One pass of the leader: the Secret written (CA present, previous CAs kept, leaf valid
    /// for the wanted names), then the bundle injected. Returns the plan it carried out
    /// (`None`: no change was needed).
    pub async fn reconcile(
        &self,
        now: OffsetDateTime,
    ) -> Result<Option<PassPlan>, CertificateSecretError> {
        let existing = self
            .secrets()
            .get_opt(&self.config.secret)
            .await
            .map_err(api_error(format!("reading Secret {}", self.config.secret)))?;
        let name = &self.config.configuration;
        let configuration = self
            .configurations()
            .get_opt(name)
            .await
            .map_err(api_error(format!(
                "reading MutatingWebhookConfiguration {name}"
            )))?;
        let raw = existing
            .as_ref()
            .and_then(|s| s.data.clone())
            .unwrap_or_default();
        let stored = StoredSecret::read(&raw);
        let injected: Option<Vec<Option<String>>> = configuration.as_ref().map(|c| {
            c.webhooks
                .iter()
                .flatten()
                .map(|w| {
                    let bundle = w.client_config.ca_bundle.as_ref()?;
                    String::from_utf8(bundle.0.clone()).ok()
                })
                .collect()
        });
        let remembered = self.remembered();
        let names = self.names();
        let plan = plan_pass(&PassInput {
            stored: &stored,
            remembered: remembered.as_ref(),
            injected: injected.as_deref(),
            names: &names,
            now,
            ca_validity: to_time(self.config.ca_validity),
            leaf_validity: to_time(self.config.leaf_validity),
            overlap: self.overlap(),
        })?;
        let data = plan.contents.to_data();
        let write = existing.is_none() || raw != data;
        if write {
            tracing::info!(
                secret = %self.config.secret,
                ca = ?plan.ca,
                leaf = ?plan.leaf,
                repaired = existing.is_some() && stored.ca.is_none(),
                "writing the webhook certificate Secret"
            );
            self.write(existing, data).await?;
        }
        // Remembered once stored: a repair never brings back what was not written.
        self.remember(plan.contents.clone());
        let injected = match configuration {
            Some(configuration) => self.inject(configuration, &plan.bundle).await?,
            None => {
                tracing::debug!(%name, "no MutatingWebhookConfiguration to inject the CA into");
                false
            }
        };
        if let LeafAction::AwaitTrust(reason) = plan.leaf {
            tracing::info!(
                ?reason,
                "a new serving certificate waits for the apiserver to trust its CA"
            );
        }
        Ok((write || injected).then_some(plan))
    }

    /// Puts `bundle` into every webhook of `configuration`. Returns whether it changed any.
    async fn inject(
        &self,
        mut configuration: MutatingWebhookConfiguration,
        bundle: &str,
    ) -> Result<bool, CertificateSecretError> {
        let name = &self.config.configuration;
        let want = ByteString(bundle.as_bytes().to_vec());
        let mut changed = false;
        for webhook in configuration.webhooks.iter_mut().flatten() {
            if webhook.client_config.ca_bundle.as_ref() != Some(&want) {
                webhook.client_config.ca_bundle = Some(want.clone());
                changed = true;
            }
        }
        if changed {
            // Replace carries the resourceVersion read at the start of the pass: a concurrent
            // apply makes this fail and the next pass retries with what the apply left.
            self.configurations()
                .replace(name, &PostParams::default(), &configuration)
                .await
                .map_err(api_error(format!("injecting the CA into {name}")))?;
            tracing::info!(
                %name,
                cas = bundle.matches("BEGIN CERTIFICATE").count(),
                "injected the webhook CA bundle"
            );
        }
        Ok(changed)
    }

    async fn write(
        &self,
        existing: Option<Secret>,
        bytes: BTreeMap<String, ByteString>,
    ) -> Result<(), CertificateSecretError> {
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

    /// Every replica: serves the leaf the Secret holds, reloading on every change, and
    /// remembers the intact contents, until `shutdown`. A deleted Secret or an unusable leaf
    /// leaves the served one in place.
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
            let stored = StoredSecret::read(&secret.data.unwrap_or_default());
            match &stored.leaf {
                Some(leaf) => match resolver.set(leaf.cert_pem.as_bytes(), leaf.key_pem.as_bytes())
                {
                    Ok(info) => {
                        tracing::info!(serial = %info.serial, "serving the webhook certificate from the Secret")
                    }
                    Err(e) => tracing::warn!("the webhook Secret's certificate is not usable: {e}"),
                },
                None => tracing::warn!(
                    "the webhook Secret holds no usable certificate; serving the previous one"
                ),
            }
            if let Some(ca) = stored.ca {
                let previous = self_signed::trusted_besides(
                    &ca.cert_pem,
                    &stored
                        .ca_texts
                        .iter()
                        .map(String::as_str)
                        .collect::<Vec<_>>(),
                    OffsetDateTime::now_utc(),
                );
                // What this replica serves: the Secret's leaf, or the one it kept.
                let leaf = stored
                    .leaf
                    .or_else(|| self.remembered().and_then(|r| r.leaf));
                self.remember(Contents { ca, previous, leaf });
            }
        }
    }

    /// `rotate-ca`: a new CA replaces the current one, which stays trusted as a previous CA
    /// until the leader has issued and spread a leaf of the new one.
    pub async fn rotate_ca(&self, now: OffsetDateTime) -> Result<(), CertificateSecretError> {
        let existing = self
            .secrets()
            .get_opt(&self.config.secret)
            .await
            .map_err(api_error(format!("reading Secret {}", self.config.secret)))?;
        let raw = existing
            .as_ref()
            .and_then(|s| s.data.clone())
            .unwrap_or_default();
        let stored = StoredSecret::read(&raw);
        if stored.ca.is_none() {
            return Err(CertificateSecretError::NoCa(self.config.secret.clone()));
        }
        let ca =
            self_signed::issue_ca("pmem-csi webhook CA", now, to_time(self.config.ca_validity))?;
        // Keep every CA a replica may still serve a leaf of: the current one and, if an
        // earlier rotation is still in progress, its predecessors too.
        let sources: Vec<&str> = stored.ca_texts.iter().map(String::as_str).collect();
        let previous = self_signed::trusted_besides(&ca.cert_pem, &sources, now);
        let contents = Contents {
            ca,
            previous,
            leaf: stored.leaf,
        };
        self.write(existing, contents.to_data()).await
    }
}

fn to_time(d: Duration) -> time::Duration {
    time::Duration::try_from(d).unwrap_or(time::Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::self_signed::{CA_VALIDITY, LEAF_VALIDITY, ReissueReason};
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;

    fn ders(pem: &str) -> Vec<Vec<u8>> {
        CertificateDer::pem_slice_iter(pem.as_bytes())
            .map(|c| c.expect("parses").to_vec())
            .collect()
    }

    fn der(pem: &str) -> Vec<u8> {
        ders(pem).remove(0)
    }

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, ByteString> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
            .collect()
    }

    /// Which CA a plan's certificate is: one of the fixtures, or one issued by the plan.
    #[derive(Debug, PartialEq, Eq, Clone, Copy)]
    enum Ca {
        A,
        B,
        Due,
        New,
    }

    /// name, stored, remembered, injected, later, then the wanted CA choice, CA, leaf action,
    /// leaf signer (`Some(None)`: no leaf), whether the leaf is kept as is, and the bundle.
    type Case = (
        &'static str,
        StoredSecret,
        Option<Contents>,
        Option<Vec<Option<String>>>,
        time::Duration,
        CaChoice,
        Ca,
        LeafAction,
        Option<Option<Ca>>,
        bool,
        Vec<Ca>,
    );

    #[test]
    fn plan_pass_table() {
        let now = OffsetDateTime::now_utc().replace_nanosecond(0).expect("ns");
        let day = time::Duration::days(1);
        let names = SubjectNames::for_services(&["wh"], "ns", &["127.0.0.1".to_owned()]);
        let a = self_signed::issue_ca("A", now - day, CA_VALIDITY).expect("A");
        let b = self_signed::issue_ca("B", now - day, CA_VALIDITY).expect("B");
        // 2/3 of 30 days passed.
        let due = self_signed::issue_ca("due", now - day * 21, day * 30).expect("due");
        let leaf =
            |ca: &CaPem, at| self_signed::issue_leaf(ca, &names, at, LEAF_VALIDITY).expect("leaf");
        let la = leaf(&a, now - day);
        let lb_now = leaf(&b, now);
        let l_due = leaf(&due, now - day);
        let overlap = time::Duration::minutes(5);
        let contents = |ca: &CaPem, previous: &str, leaf: Option<&LeafPem>| Contents {
            ca: ca.clone(),
            previous: previous.to_owned(),
            leaf: leaf.cloned(),
        };
        let intact = |c: &Contents| StoredSecret::read(&c.to_data());
        let garbage = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let steady = contents(&a, "", Some(&la));
        let remembered_a = Some(steady.clone());
        let rotated = contents(&b, &a.cert_pem, Some(&la));
        let which = |pem: &str| {
            let d = der(pem);
            [(Ca::A, &a), (Ca::B, &b), (Ca::Due, &due)]
                .into_iter()
                .find(|(_, c)| der(&c.cert_pem) == d)
                .map_or(Ca::New, |(w, _)| w)
        };
        let signer = |leaf: &Option<LeafPem>, plan_ca: &CaPem| {
            leaf.as_ref().map(|l| {
                [
                    (Ca::A, &a),
                    (Ca::B, &b),
                    (Ca::Due, &due),
                    (Ca::New, plan_ca),
                ]
                .into_iter()
                .find(|(_, c)| self_signed::is_signed_by(&l.cert_pem, &c.cert_pem).expect("check"))
                .map(|(w, _)| w)
            })
        };
        use LeafAction::*;
        use ReissueReason::*;
        #[rustfmt::skip]
        let cases: Vec<Case> = vec![
            // name, stored, remembered, injected, later,
            //   ca choice, CA, leaf action, leaf signer (Some(None): no leaf), leaf kept as is, bundle
            ("fresh install", StoredSecret::default(), None, None, time::Duration::ZERO,
                CaChoice::Issue, Ca::New, Issue(Missing), Some(Some(Ca::New)), false, vec![Ca::New]),
            ("fresh install, empty bundle", StoredSecret::default(), None, Some(vec![None]), time::Duration::ZERO,
                CaChoice::Issue, Ca::New, Issue(Missing), Some(Some(Ca::New)), false, vec![Ca::New]),
            ("steady", intact(&steady), remembered_a.clone(), Some(vec![Some(a.cert_pem.clone())]), time::Duration::ZERO,
                CaChoice::Keep, Ca::A, Keep, Some(Some(Ca::A)), true, vec![Ca::A]),
            ("bundle wiped by an apply", intact(&steady), None, Some(vec![None, None]), time::Duration::ZERO,
                CaChoice::Keep, Ca::A, Keep, Some(Some(Ca::A)), true, vec![Ca::A]),
            ("deleted, remembered", StoredSecret::default(), remembered_a.clone(), Some(vec![Some(a.cert_pem.clone())]), time::Duration::ZERO,
                CaChoice::Restore, Ca::A, Keep, Some(Some(Ca::A)), true, vec![Ca::A]),
            ("all garbage, remembered",
                StoredSecret::read(&data(&[(CA_CERT, "x"), (CA_KEY, "y"), (TLS_CERT, garbage), (TLS_KEY, "z"), (PREVIOUS_CA, garbage)])),
                remembered_a.clone(), Some(vec![Some(a.cert_pem.clone())]), time::Duration::ZERO,
                CaChoice::Restore, Ca::A, Keep, Some(Some(Ca::A)), true, vec![Ca::A]),
            ("another CA's key, remembered",
                StoredSecret::read(&data(&[(CA_CERT, &a.cert_pem), (CA_KEY, &b.key_pem), (TLS_CERT, &la.cert_pem), (TLS_KEY, &la.key_pem)])),
                remembered_a.clone(), Some(vec![Some(a.cert_pem.clone())]), time::Duration::ZERO,
                CaChoice::Restore, Ca::A, Keep, Some(Some(Ca::A)), true, vec![Ca::A]),
            ("key lost: a new CA, trusted next to the old, leaf of the old kept",
                StoredSecret::read(&data(&[(CA_CERT, &a.cert_pem), (CA_KEY, "garbage"), (TLS_CERT, &la.cert_pem), (TLS_KEY, &la.key_pem)])),
                None, Some(vec![Some(a.cert_pem.clone())]), time::Duration::ZERO,
                CaChoice::Issue, Ca::New, AwaitTrust(OtherCa), Some(Some(Ca::A)), true, vec![Ca::New, Ca::A]),
            ("deleted, forgotten: replicas keep their leaf", StoredSecret::default(), None, Some(vec![Some(a.cert_pem.clone())]), time::Duration::ZERO,
                CaChoice::Issue, Ca::New, AwaitTrust(Missing), Some(None), true, vec![Ca::New, Ca::A]),
            ("rotate-ca, bundle not updated yet", intact(&rotated), remembered_a.clone(), Some(vec![Some(a.cert_pem.clone())]), time::Duration::ZERO,
                CaChoice::Keep, Ca::B, AwaitTrust(OtherCa), Some(Some(Ca::A)), true, vec![Ca::B, Ca::A]),
            ("rotate-ca, bundle trusts both", intact(&rotated), None,
                Some(vec![Some(format!("{}{}", b.cert_pem, a.cert_pem))]), time::Duration::ZERO,
                CaChoice::Keep, Ca::B, Issue(OtherCa), Some(Some(Ca::B)), false, vec![Ca::B, Ca::A]),
            ("new leaf out, overlap running", intact(&contents(&b, &a.cert_pem, Some(&lb_now))), None,
                Some(vec![Some(format!("{}{}", b.cert_pem, a.cert_pem))]), overlap - time::Duration::seconds(1),
                CaChoice::Keep, Ca::B, Keep, Some(Some(Ca::B)), true, vec![Ca::B, Ca::A]),
            ("overlap over: old CA dropped", intact(&contents(&b, &a.cert_pem, Some(&lb_now))), None,
                Some(vec![Some(format!("{}{}", b.cert_pem, a.cert_pem))]), overlap,
                CaChoice::Keep, Ca::B, Keep, Some(Some(Ca::B)), true, vec![Ca::B]),
            ("CA due: renewed, old trusted, its leaf kept", intact(&contents(&due, "", Some(&l_due))), None,
                Some(vec![Some(due.cert_pem.clone())]), time::Duration::ZERO,
                CaChoice::Renew, Ca::New, AwaitTrust(OtherCa), Some(Some(Ca::Due)), true, vec![Ca::New, Ca::Due]),
            ("garbage previous dropped",
                StoredSecret::read(&data(&[(CA_CERT, &a.cert_pem), (CA_KEY, &a.key_pem), (TLS_CERT, &la.cert_pem), (TLS_KEY, &la.key_pem), (PREVIOUS_CA, garbage)])),
                None, Some(vec![Some(a.cert_pem.clone())]), time::Duration::ZERO,
                CaChoice::Keep, Ca::A, Keep, Some(Some(Ca::A)), true, vec![Ca::A]),
            ("two webhooks, one without the new CA", intact(&rotated), None,
                Some(vec![Some(format!("{}{}", b.cert_pem, a.cert_pem)), Some(a.cert_pem.clone())]), time::Duration::ZERO,
                CaChoice::Keep, Ca::B, AwaitTrust(OtherCa), Some(Some(Ca::A)), true, vec![Ca::B, Ca::A]),
        ];
        for (
            name,
            stored,
            remembered,
            injected,
            later,
            want_choice,
            want_ca,
            want_action,
            want_signer,
            kept,
            want_bundle,
        ) in cases
        {
            let plan = plan_pass(&PassInput {
                stored: &stored,
                remembered: remembered.as_ref(),
                injected: injected.as_deref(),
                names: &names,
                now: now + later,
                ca_validity: CA_VALIDITY,
                leaf_validity: LEAF_VALIDITY,
                overlap,
            })
            .expect(name);
            assert_eq!(plan.ca, want_choice, "{name}");
            assert_eq!(which(&plan.contents.ca.cert_pem), want_ca, "{name}");
            assert_eq!(plan.leaf, want_action, "{name}");
            if let Some(want) = want_signer {
                assert_eq!(
                    signer(&plan.contents.leaf, &plan.contents.ca),
                    want.map(Some),
                    "{name}"
                );
            }
            let before = stored
                .leaf
                .clone()
                .or_else(|| remembered.as_ref().and_then(|r| r.leaf.clone()));
            assert_eq!(plan.contents.leaf == before, kept, "{name}: leaf kept");
            let bundle: Vec<Ca> = ders(&plan.bundle)
                .into_iter()
                .map(|d| {
                    [(Ca::A, &a), (Ca::B, &b), (Ca::Due, &due)]
                        .into_iter()
                        .find(|(_, c)| der(&c.cert_pem) == d)
                        .map_or(Ca::New, |(w, _)| w)
                })
                .collect();
            assert_eq!(bundle, want_bundle, "{name}: bundle");
            // The rule the whole design rests on: the CA of the leaf replicas will serve is
            // in the bundle, unless the apiserver trusts nothing yet.
            let trusts_nothing =
                trust_in(&plan.contents.ca.cert_pem, injected.as_deref()) == Trust::NoBundle;
            if let Some(leaf) = &plan.contents.leaf
                && !trusts_nothing
            {
                let signed_by_trusted = injected.iter().flatten().flatten().any(|bundle| {
                    ders(bundle).iter().any(|d| {
                        ders(&plan.bundle).contains(d)
                            && [&a, &b, &due, &plan.contents.ca].iter().any(|c| {
                                der(&c.cert_pem) == *d
                                    && self_signed::is_signed_by(&leaf.cert_pem, &c.cert_pem)
                                        .unwrap_or(false)
                            })
                    })
                });
                assert!(
                    signed_by_trusted,
                    "{name}: leaf served before the apiserver trusts its CA"
                );
            }
        }
    }

    #[test]
    fn stored_secret_reads_intact_parts() {
        let now = OffsetDateTime::now_utc();
        let a = self_signed::issue_ca("A", now, CA_VALIDITY).expect("A");
        let names = SubjectNames::for_services(&["wh"], "ns", &[]);
        let la = self_signed::issue_leaf(&a, &names, now, LEAF_VALIDITY).expect("leaf");
        let intact = Contents {
            ca: a.clone(),
            previous: String::new(),
            leaf: Some(la.clone()),
        };
        for (name, data, ca, leaf) in [
            ("intact", intact.to_data(), true, true),
            ("empty", BTreeMap::new(), false, false),
            (
                "leaf key garbage",
                data(&[
                    (CA_CERT, &a.cert_pem),
                    (CA_KEY, &a.key_pem),
                    (TLS_CERT, &la.cert_pem),
                    (TLS_KEY, "x"),
                ]),
                true,
                false,
            ),
            (
                "CA key is the leaf's",
                data(&[
                    (CA_CERT, &a.cert_pem),
                    (CA_KEY, &la.key_pem),
                    (TLS_CERT, &la.cert_pem),
                    (TLS_KEY, &la.key_pem),
                ]),
                false,
                true,
            ),
            (
                "CA and leaf swapped",
                data(&[
                    (CA_CERT, &la.cert_pem),
                    (CA_KEY, &la.key_pem),
                    (TLS_CERT, &a.cert_pem),
                    (TLS_KEY, &a.key_pem),
                ]),
                false,
                false,
            ),
            (
                "not UTF-8",
                BTreeMap::from([
                    (CA_CERT.to_owned(), ByteString(vec![0xff, 0xfe])),
                    (
                        CA_KEY.to_owned(),
                        ByteString(a.key_pem.clone().into_bytes()),
                    ),
                ]),
                false,
                false,
            ),
        ] {
            let got = StoredSecret::read(&data);
            assert_eq!(got.ca.is_some(), ca, "{name}");
            assert_eq!(got.leaf.is_some(), leaf, "{name}");
        }
        assert_eq!(StoredSecret::read(&intact.to_data()).ca, Some(a));
    }
}
