//! The pure parts of `--self-signed`: issuing the CA and the webhook's serving certificate,
//! reading facts back out of PEMs, deciding when the serving certificate is re-issued, and
//! building the `caBundle` that the MutatingWebhookConfiguration trusts.
//!
//! It also holds the rules of the certificates' life cycle, as pure functions of plain facts:
//! which CA the Secret holds next ([`choose_ca`]: kept, restored from memory, renewed or issued),
//! when a serving certificate of it may be served ([`plan_leaf`]: only once the apiserver
//! trusts its CA), and how long replaced CAs stay trusted ([`keep_previous`]).
//!
//! The leader keeps all of this in a Secret; this module neither reads nor writes it.

use std::collections::BTreeSet;
use std::net::IpAddr;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, DnsName};
use time::{Duration, OffsetDateTime};
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

/// Default lifetime of the CA; renewed at 2/3 of it ([`ca_due`]) or by `pmem-csi controller
/// rotate-ca`.
pub const CA_VALIDITY: Duration = Duration::days(3650);

/// Default lifetime of the serving certificate; re-issued at 2/3 of it (after 60 days).
pub const LEAF_VALIDITY: Duration = Duration::days(90);

/// How far `not_before` is backdated, so that a verifier whose clock is behind the leader's
/// accepts a certificate issued a moment ago (Kubernetes' own self-signed helpers do the same).
pub const BACKDATE: Duration = Duration::hours(1);

/// Why a certificate could not be issued or read.
#[derive(Debug, thiserror::Error)]
pub enum SelfSignedError {
    /// rcgen refused to generate a key or sign a certificate.
    #[error("{what}: {source}")]
    Generate {
        /// What was being generated.
        what: &'static str,
        /// rcgen's complaint.
        source: rcgen::Error,
    },
    /// A PEM text is malformed or holds no certificate.
    #[error("parsing {what} PEM: {source}")]
    Pem {
        /// Which PEM.
        what: &'static str,
        /// The parser's complaint.
        source: rustls_pki_types::pem::Error,
    },
    /// A certificate is not valid X.509.
    #[error("{what} is not a valid X.509 certificate: {message}")]
    X509 {
        /// Which certificate.
        what: &'static str,
        /// The parser's complaint.
        message: String,
    },
    /// A subject alternative name is not a valid DNS name (nor an IP address).
    #[error("{name:?} is neither a valid DNS name nor an IP address")]
    InvalidName {
        /// The name as given.
        name: String,
    },
    /// There is no name to issue the serving certificate for.
    #[error("a serving certificate needs at least one DNS name or IP address")]
    NoNames,
}

/// A CA certificate and its private key, as stored in the Secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaPem {
    /// The CA certificate.
    pub cert_pem: String,
    /// Its PKCS#8 private key.
    pub key_pem: String,
}

/// A serving certificate and its private key, as stored in the Secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafPem {
    /// The leaf certificate (the CA is published separately in the `caBundle`).
    pub cert_pem: String,
    /// Its PKCS#8 private key.
    pub key_pem: String,
}

/// The DNS names and IP addresses a serving certificate covers, normalised (DNS names in
/// lower case, both sorted and deduplicated) so that two sets compare equal iff they mean the same.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubjectNames {
    /// DNS names.
    pub dns: BTreeSet<String>,
    /// IP addresses.
    pub ips: BTreeSet<IpAddr>,
}

impl SubjectNames {
    /// Names for the webhook Services `services` in `namespace` (`<svc>.<ns>.svc` and
    /// `<svc>.<ns>.svc.cluster.local`, the names the apiserver dials for a service reference)
    /// plus `--self-signed-san` values, each a DNS name or an IP address.
    pub fn for_services(services: &[&str], namespace: &str, extra_sans: &[String]) -> Self {
        let mut names = Self::default();
        for service in services {
            names.add(&format!("{service}.{namespace}.svc"));
            names.add(&format!("{service}.{namespace}.svc.cluster.local"));
        }
        for san in extra_sans {
            names.add(san);
        }
        names
    }

    /// Adds one name, an IP address if it parses as one, else a DNS name.
    pub fn add(&mut self, name: &str) {
        match name.parse::<IpAddr>() {
            Ok(ip) => {
                self.ips.insert(ip);
            }
            Err(_) => {
                self.dns.insert(name.to_ascii_lowercase());
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.dns.is_empty() && self.ips.is_empty()
    }
}

/// What the module needs to know about a certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFacts {
    /// Serial number as lowercase colon-separated hex.
    pub serial: String,
    /// Start of validity.
    pub not_before: OffsetDateTime,
    /// End of validity.
    pub not_after: OffsetDateTime,
    /// Subject alternative names.
    pub names: SubjectNames,
    /// Whether basicConstraints marks it as a CA.
    pub is_ca: bool,
}

/// Reads the first certificate of `pem`. `what` names it in errors ("CA", "serving certificate").
pub fn parse_cert(pem: &str, what: &'static str) -> Result<CertFacts, SelfSignedError> {
    let der = first_der(pem, what)?;
    let cert = x509(&der, what)?;
    let mut names = SubjectNames::default();
    let san = cert
        .subject_alternative_name()
        .map_err(|e| SelfSignedError::X509 {
            what,
            message: e.to_string(),
        })?;
    for name in san.iter().flat_map(|san| &san.value.general_names) {
        match name {
            GeneralName::DNSName(dns) => {
                names.dns.insert(dns.to_ascii_lowercase());
            }
            GeneralName::IPAddress(bytes) => {
                let ip = match **bytes {
                    [a, b, c, d] => Some(IpAddr::from([a, b, c, d])),
                    _ => <[u8; 16]>::try_from(*bytes).ok().map(IpAddr::from),
                };
                names.ips.extend(ip);
            }
            _ => {}
        }
    }
    Ok(CertFacts {
        serial: cert.raw_serial_as_string(),
        not_before: cert.validity().not_before.to_datetime(),
        not_after: cert.validity().not_after.to_datetime(),
        names,
        is_ca: cert.is_ca(),
    })
}

/// Whether the first certificate in `leaf_pem` was issued by the CA in `ca_pem`: its issuer
/// is the CA's subject and its signature verifies with the CA's key. The name check matters
/// after `rotate-ca`, which keeps the CA's name but not its key, and the other way round.
pub fn is_signed_by(leaf_pem: &str, ca_pem: &str) -> Result<bool, SelfSignedError> {
    let leaf_der = first_der(leaf_pem, "serving certificate")?;
    let ca_der = first_der(ca_pem, "CA")?;
    let leaf = x509(&leaf_der, "serving certificate")?;
    let ca = x509(&ca_der, "CA")?;
    Ok(leaf.issuer().as_raw() == ca.subject().as_raw()
        && leaf.verify_signature(Some(ca.public_key())).is_ok())
}

fn first_der(pem: &str, what: &'static str) -> Result<CertificateDer<'static>, SelfSignedError> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .map_err(|source| SelfSignedError::Pem { what, source })
}

fn x509<'a>(der: &'a [u8], what: &'static str) -> Result<X509Certificate<'a>, SelfSignedError> {
    X509Certificate::from_der(der)
        .map(|(_, cert)| cert)
        .map_err(|e| SelfSignedError::X509 {
            what,
            message: e.to_string(),
        })
}

fn generate(what: &'static str) -> impl Fn(rcgen::Error) -> SelfSignedError {
    move |source| SelfSignedError::Generate { what, source }
}

/// Issues a new CA (ECDSA P-256) named `common_name`, valid from `now - BACKDATE` to
/// `now + validity`. It may sign end-entity certificates only (path length 0).
pub fn issue_ca(
    common_name: &str,
    now: OffsetDateTime,
    validity: Duration,
) -> Result<CaPem, SelfSignedError> {
    let key = KeyPair::generate().map_err(generate("generating the CA key"))?;
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = now - BACKDATE;
    params.not_after = now + validity;
    let cert = params
        .self_signed(&key)
        .map_err(generate("signing the CA certificate"))?;
    Ok(CaPem {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Issues a serving certificate (fresh ECDSA P-256 key) for `names`, signed by `ca`, valid
/// from `now - BACKDATE` to `now + validity` but never beyond the CA: a leaf outliving its CA
/// fails verification anyway, and ending with the CA makes [`leaf_due`] re-issue it in time
/// under a rotated CA.
pub fn issue_leaf(
    ca: &CaPem,
    names: &SubjectNames,
    now: OffsetDateTime,
    validity: Duration,
) -> Result<LeafPem, SelfSignedError> {
    if names.is_empty() {
        return Err(SelfSignedError::NoNames);
    }
    let mut sans = Vec::new();
    for dns in &names.dns {
        // Validated here rather than by rcgen, which accepts any ASCII; a malformed name
        // would only surface as every client rejecting the certificate.
        DnsName::try_from(dns.as_str())
            .map_err(|_| SelfSignedError::InvalidName { name: dns.clone() })?;
        let ia5 = dns
            .as_str()
            .try_into()
            .map_err(|_| SelfSignedError::InvalidName { name: dns.clone() })?;
        sans.push(SanType::DnsName(ia5));
    }
    sans.extend(names.ips.iter().copied().map(SanType::IpAddress));

    let ca_facts = parse_cert(&ca.cert_pem, "CA")?;
    let ca_key = KeyPair::from_pem(&ca.key_pem).map_err(generate("reading the CA key"))?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key)
        .map_err(generate("reading the CA certificate"))?;

    let key = KeyPair::generate().map_err(generate("generating the serving key"))?;
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    let common_name = names
        .dns
        .first()
        .cloned()
        .or_else(|| names.ips.first().map(IpAddr::to_string))
        .unwrap_or_default();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.subject_alt_names = sans;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = now - BACKDATE;
    params.not_after = (now + validity).min(ca_facts.not_after);
    let cert = params
        .signed_by(&key, &issuer)
        .map_err(generate("signing the serving certificate"))?;
    Ok(LeafPem {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Whether a certificate valid from `not_before` to `not_after` should be replaced at `now`:
/// once 2/3 of its life have passed (leaving a third for followers and the apiserver to pick
/// up the new one), when it has expired, or when it is not valid yet (a clock far behind the
/// issuer's; verifiers with that clock reject it).
pub fn leaf_due(
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
    now: OffsetDateTime,
) -> bool {
    // Our certificates are backdated against clock skew; their life counts from issuance, or
    // a short-lived leaf would expire before 2/3 of the backdated span had passed.
    let issued = (not_before + BACKDATE).min(not_after);
    let life = not_after - issued;
    now < not_before || now >= issued + life * 2 / 3
}

/// What [`judge_leaf`] knows about the serving certificate in the Secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafState {
    /// Facts read from the certificate.
    pub facts: CertFacts,
    /// Whether the current CA signed it ([`is_signed_by`]).
    pub signed_by_ca: bool,
}

impl LeafState {
    /// Reads the state of `leaf_pem` relative to `ca_pem`.
    pub fn read(leaf_pem: &str, ca_pem: &str) -> Result<Self, SelfSignedError> {
        Ok(Self {
            facts: parse_cert(leaf_pem, "serving certificate")?,
            signed_by_ca: is_signed_by(leaf_pem, ca_pem)?,
        })
    }
}

/// Why the serving certificate is issued anew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReissueReason {
    /// The Secret holds none, or one that cannot be read.
    Missing,
    /// It was signed by another CA (after `rotate-ca`).
    OtherCa,
    /// 2/3 of its life have passed, it expired, or it is not valid yet ([`leaf_due`]).
    Due,
    /// The Services or `--self-signed-san` changed.
    NamesChanged,
}

/// Whether the serving certificate is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeafVerdict {
    /// Keep serving it.
    Keep,
    /// Issue a new one.
    Reissue(ReissueReason),
}

/// Decides whether the leader re-issues the serving certificate. `leaf` is `None` when the
/// Secret has no readable one.
pub fn judge_leaf(
    leaf: Option<&LeafState>,
    want: &SubjectNames,
    now: OffsetDateTime,
) -> LeafVerdict {
    let Some(leaf) = leaf else {
        return LeafVerdict::Reissue(ReissueReason::Missing);
    };
    if !leaf.signed_by_ca {
        LeafVerdict::Reissue(ReissueReason::OtherCa)
    } else if leaf.facts.names != *want {
        LeafVerdict::Reissue(ReissueReason::NamesChanged)
    } else if leaf_due(leaf.facts.not_before, leaf.facts.not_after, now) {
        LeafVerdict::Reissue(ReissueReason::Due)
    } else {
        LeafVerdict::Keep
    }
}

/// The `caBundle` for the MutatingWebhookConfiguration: the current CA, then the certificates
/// of `previous` (a CA or an earlier bundle) that differ from it. During `rotate-ca` the
/// apiserver must trust both until every replica serves a leaf of the new CA. Certificates
/// are compared by DER, so re-encoded PEM (line endings, wrapping) does not duplicate them.
pub fn ca_bundle(current_ca_pem: &str, previous: Option<&str>) -> Result<String, SelfSignedError> {
    let mut seen = BTreeSet::new();
    let mut bundle = String::new();
    for (text, what) in [
        (current_ca_pem, "CA"),
        (previous.unwrap_or(""), "previous CA"),
    ] {
        for block in pem_blocks(text, what)? {
            if seen.insert(block.der) {
                bundle.push_str(&block.text);
                bundle.push('\n');
            }
        }
    }
    if bundle.is_empty() {
        return Err(SelfSignedError::Pem {
            what: "CA",
            source: rustls_pki_types::pem::Error::NoItemsFound,
        });
    }
    Ok(bundle)
}

/// Whether the CA valid from `not_before` to `not_after` is renewed at `now`: by the same rule
/// as the serving certificate ([`leaf_due`]), once 2/3 of its life have passed. The third that
/// is left covers the overlap in which the bundle trusts both CAs and every leaf of the old one
/// is replaced; a leaf never outlives its CA ([`issue_leaf`]), so waiting longer would shorten
/// the leaves issued meanwhile.
pub fn ca_due(not_before: OffsetDateTime, not_after: OffsetDateTime, now: OffsetDateTime) -> bool {
    leaf_due(not_before, not_after, now)
}

/// Whether `key_pem` is the private key of the first certificate in `cert_pem`. A Secret whose
/// CA certificate parses but whose key is garbage (or another CA's) cannot sign anything.
pub fn key_matches(cert_pem: &str, key_pem: &str) -> bool {
    use rcgen::PublicKeyData;
    let (Ok(der), Ok(key)) = (
        first_der(cert_pem, "certificate"),
        KeyPair::from_pem(key_pem),
    ) else {
        return false;
    };
    x509(&der, "certificate")
        .is_ok_and(|cert| cert.public_key().subject_public_key.data.as_ref() == key.der_bytes())
}

/// `cert_pem` and `key_pem` as a CA, when the certificate is a CA and the key is its own.
pub fn usable_ca(cert_pem: &str, key_pem: &str) -> Option<CaPem> {
    let facts = parse_cert(cert_pem, "CA").ok()?;
    (facts.is_ca && key_matches(cert_pem, key_pem)).then(|| CaPem {
        cert_pem: cert_pem.to_owned(),
        key_pem: key_pem.to_owned(),
    })
}

/// `cert_pem` and `key_pem` as a serving certificate, when the certificate parses, is not a CA
/// and the key is its own (what a replica can load).
pub fn usable_leaf(cert_pem: &str, key_pem: &str) -> Option<LeafPem> {
    let facts = parse_cert(cert_pem, "serving certificate").ok()?;
    (!facts.is_ca && key_matches(cert_pem, key_pem)).then(|| LeafPem {
        cert_pem: cert_pem.to_owned(),
        key_pem: key_pem.to_owned(),
    })
}

/// Where a certificate's validity starts and ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    /// Start of validity.
    pub not_before: OffsetDateTime,
    /// End of validity.
    pub not_after: OffsetDateTime,
}

impl From<&CertFacts> for Validity {
    fn from(facts: &CertFacts) -> Self {
        Self {
            not_before: facts.not_before,
            not_after: facts.not_after,
        }
    }
}

/// Which CA the leader's pass writes into the Secret.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaChoice {
    /// The Secret's CA, usable and not due.
    Keep,
    /// The Secret's CA is due ([`ca_due`]): a new one, the old one trusted as previous.
    Renew,
    /// The Secret lost its CA (deleted, or certificate or key unreadable) but this process
    /// remembers the contents it last saw: write them back, so that nothing changes for the
    /// apiserver or the replicas.
    Restore,
    /// The Secret lost its CA and nobody remembers its key: a new one, trusted next to
    /// whatever the bundle held, and served only once the apiserver trusts it.
    Issue,
}

/// Decides the CA of this pass from the Secret's usable CA and the one this process remembers.
/// A usable CA in the Secret always wins over memory: it may come from `rotate-ca`.
pub fn choose_ca(
    stored: Option<Validity>,
    remembered: Option<Validity>,
    now: OffsetDateTime,
) -> CaChoice {
    match (stored, remembered) {
        (Some(ca), _) if ca_due(ca.not_before, ca.not_after, now) => CaChoice::Renew,
        (Some(_), _) => CaChoice::Keep,
        // A remembered CA that is due is restored all the same; the next pass renews it with
        // the full overlap, which a new CA issued now could not offer.
        (None, Some(_)) => CaChoice::Restore,
        (None, None) => CaChoice::Issue,
    }
}

/// Whether the apiserver trusts the CA of this pass, judged from the `caBundle` as it was
/// before this pass injected anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trust {
    /// The bundle holds the CA.
    Trusted,
    /// The bundle holds other CAs only: a leaf of this CA would fail every call.
    NotYet,
    /// There is no configuration or it holds no CA (a fresh install, or an apply wiped it):
    /// the apiserver cannot call any replica successfully, so no leaf can break a call.
    NoBundle,
}

/// Judges [`Trust`] of `ca_pem` from the configuration's bundle (`None`: no configuration).
/// Unreadable blocks of the bundle are ignored, as the apiserver would reject them.
pub fn trust_of(ca_pem: &str, injected: Option<&str>) -> Trust {
    let injected = lenient_blocks(injected.unwrap_or(""));
    if injected.is_empty() {
        return Trust::NoBundle;
    }
    let Ok(ca) = first_der(ca_pem, "CA") else {
        return Trust::NotYet;
    };
    if injected.iter().any(|b| b.der == ca.as_ref()) {
        Trust::Trusted
    } else {
        Trust::NotYet
    }
}

/// What the leader does with the serving certificate this pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeafAction {
    /// Keep the one the Secret holds.
    Keep,
    /// Issue a new one now.
    Issue(ReissueReason),
    /// A new one is due but the apiserver does not trust the CA yet: keep what replicas serve
    /// (even an older CA's leaf), inject the bundle, and issue on a later pass.
    AwaitTrust(ReissueReason),
}

/// Decides the serving certificate from [`judge_leaf`]'s verdict and the CA's [`Trust`]: a leaf
/// of a CA reaches the Secret (hence the replicas) only after the bundle carrying that CA was
/// in place when the pass began.
pub fn plan_leaf(verdict: LeafVerdict, trust: Trust) -> LeafAction {
    match (verdict, trust) {
        (LeafVerdict::Keep, _) => LeafAction::Keep,
        (LeafVerdict::Reissue(reason), Trust::Trusted | Trust::NoBundle) => {
            LeafAction::Issue(reason)
        }
        (LeafVerdict::Reissue(reason), Trust::NotYet) => LeafAction::AwaitTrust(reason),
    }
}

/// Whether the CAs replaced by a rotation, renewal or repair stay in the bundle. `current_leaf`
/// is when the Secret's serving certificate was issued, `None` when it is not signed by the
/// current CA (replicas may still serve an older CA's leaf). They go once the leaf of the
/// current CA has been in the Secret for `overlap`: replicas reload it within seconds, and
/// connections opened with an older leaf keep their handshake.
pub fn keep_previous(
    current_leaf: Option<OffsetDateTime>,
    now: OffsetDateTime,
    overlap: Duration,
) -> bool {
    current_leaf.is_none_or(|issued| now < issued + overlap)
}

/// When a serving certificate was issued: its `not_before` without the backdating.
pub fn issued_at(facts: &CertFacts) -> OffsetDateTime {
    (facts.not_before + BACKDATE).min(facts.not_after)
}

/// The CAs to keep trusting besides `current_ca_pem`: every readable CA certificate in
/// `sources` (the Secret's previous CAs, what the process remembers, the bundle the apiserver
/// holds now), deduplicated, without the current CA, expired ones (they verify nothing) and
/// garbage (a corrupted Secret must not break the bundle). A repair thereby never drops a CA
/// that the apiserver trusts and a replica may still serve a leaf of.
pub fn trusted_besides(current_ca_pem: &str, sources: &[&str], now: OffsetDateTime) -> String {
    let current = first_der(current_ca_pem, "CA").ok();
    let mut seen: BTreeSet<Vec<u8>> = current.iter().map(|c| c.to_vec()).collect();
    let mut out = String::new();
    for block in sources.iter().flat_map(|text| lenient_blocks(text)) {
        let keep = x509(&block.der, "previous CA")
            .is_ok_and(|cert| cert.is_ca() && cert.validity().not_after.to_datetime() > now);
        if keep && seen.insert(block.der.clone()) {
            out.push_str(&block.text);
            out.push('\n');
        }
    }
    out
}

struct PemBlock {
    text: String,
    der: Vec<u8>,
}

/// Splits `text` into its CERTIFICATE blocks, each with its normalised text and DER.
fn pem_blocks(text: &str, what: &'static str) -> Result<Vec<PemBlock>, SelfSignedError> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let mut blocks = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(BEGIN) {
        let Some(len) = rest[start..].find(END) else {
            return Err(SelfSignedError::Pem {
                what,
                source: rustls_pki_types::pem::Error::MissingSectionEnd {
                    end_marker: END.as_bytes().to_vec(),
                },
            });
        };
        let end = start + len + END.len();
        let block = &rest[start..end];
        let der = first_der(block, what)?;
        // Verifying each block parses as X.509 keeps a corrupt CA out of the bundle, where
        // the apiserver would reject the whole webhook configuration.
        x509(&der, what)?;
        let text = block
            .lines()
            .map(str::trim_end)
            .collect::<Vec<_>>()
            .join("\n");
        blocks.push(PemBlock {
            text,
            der: der.to_vec(),
        });
        rest = &rest[end..];
    }
    Ok(blocks)
}

/// The readable CERTIFICATE blocks of `text`, skipping garbage between and inside them.
fn lenient_blocks(text: &str) -> Vec<PemBlock> {
    const END: &str = "-----END CERTIFICATE-----";
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    text.split_inclusive(END)
        // From the last BEGIN of each chunk, so that a truncated block does not swallow the
        // intact one after it.
        .filter_map(|chunk| pem_blocks(&chunk[chunk.rfind(BEGIN)?..], "certificate").ok())
        .flatten()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(days: i64) -> OffsetDateTime {
        OffsetDateTime::UNIX_EPOCH + Duration::days(20_000 + days)
    }

    fn names(list: &[&str]) -> SubjectNames {
        let mut names = SubjectNames::default();
        for name in list {
            names.add(name);
        }
        names
    }

    #[test]
    fn subject_names_for_services() {
        let got = SubjectNames::for_services(
            &["pmem-csi-intel-com-webhook", "pmem-csi-intel-com-scheduler"],
            "pmem-csi",
            &[
                "127.0.0.1".to_owned(),
                "Webhook.Example".to_owned(),
                "::1".to_owned(),
            ],
        );
        assert_eq!(
            got,
            names(&[
                "pmem-csi-intel-com-webhook.pmem-csi.svc",
                "pmem-csi-intel-com-webhook.pmem-csi.svc.cluster.local",
                "pmem-csi-intel-com-scheduler.pmem-csi.svc",
                "pmem-csi-intel-com-scheduler.pmem-csi.svc.cluster.local",
                "webhook.example",
                "127.0.0.1",
                "::1",
            ])
        );
        assert_eq!(got.ips.len(), 2);
        assert_eq!(got.dns.len(), 5);
    }

    #[test]
    fn leaf_due_table() {
        // Issued on day 0 (backdated), 90 days: due from day 60 on.
        let (nb, na) = (at(0) - BACKDATE, at(90));
        for (name, now, want) in [
            ("just issued", at(0), false),
            ("half way", at(45), false),
            ("a second before 2/3", at(60) - Duration::seconds(1), false),
            ("at 2/3", at(60), true),
            ("after 2/3", at(80), true),
            ("expired", at(91), true),
            ("not valid yet", at(-1), true),
        ] {
            assert_eq!(leaf_due(nb, na, now), want, "{name}");
        }
        // A 60 s leaf is due after 40 s, long before it expires.
        let (nb, na) = (at(0) - BACKDATE, at(0) + Duration::seconds(60));
        assert!(!leaf_due(nb, na, at(0) + Duration::seconds(39)));
        assert!(leaf_due(nb, na, at(0) + Duration::seconds(40)));
    }

    #[test]
    fn judge_leaf_table() {
        let want = names(&["svc.ns.svc", "127.0.0.1"]);
        let state = |signed_by_ca, list: &[&str], not_before, not_after| LeafState {
            facts: CertFacts {
                serial: "01".to_owned(),
                not_before,
                not_after,
                names: names(list),
                is_ca: false,
            },
            signed_by_ca,
        };
        let good = &["svc.ns.svc", "127.0.0.1"];
        for (name, leaf, want_verdict) in [
            (
                "missing",
                None,
                LeafVerdict::Reissue(ReissueReason::Missing),
            ),
            (
                "fresh",
                Some(state(true, good, at(0), at(90))),
                LeafVerdict::Keep,
            ),
            (
                "names compare case-insensitively",
                Some(state(true, &["SVC.ns.svc", "127.0.0.1"], at(0), at(90))),
                LeafVerdict::Keep,
            ),
            (
                "other CA",
                Some(state(false, good, at(0), at(90))),
                LeafVerdict::Reissue(ReissueReason::OtherCa),
            ),
            (
                "SAN added",
                Some(state(true, &["svc.ns.svc"], at(0), at(90))),
                LeafVerdict::Reissue(ReissueReason::NamesChanged),
            ),
            (
                "SAN removed",
                Some(state(
                    true,
                    &["svc.ns.svc", "127.0.0.1", "old.example"],
                    at(0),
                    at(90),
                )),
                LeafVerdict::Reissue(ReissueReason::NamesChanged),
            ),
            (
                "2/3 elapsed",
                Some(state(true, good, at(-61), at(29))),
                LeafVerdict::Reissue(ReissueReason::Due),
            ),
            (
                "expired",
                Some(state(true, good, at(-100), at(-10))),
                LeafVerdict::Reissue(ReissueReason::Due),
            ),
        ] {
            assert_eq!(
                judge_leaf(leaf.as_ref(), &want, at(0)),
                want_verdict,
                "{name}"
            );
        }
    }

    #[test]
    fn issued_certificates_read_back() {
        let now = OffsetDateTime::now_utc().replace_nanosecond(0).expect("ns");
        let ca = issue_ca("pmem-csi CA", now, CA_VALIDITY).expect("CA");
        let other_ca = issue_ca("pmem-csi CA", now, CA_VALIDITY).expect("other CA");
        let want = SubjectNames::for_services(&["wh"], "ns", &["127.0.0.1".to_owned()]);
        let leaf = issue_leaf(&ca, &want, now, LEAF_VALIDITY).expect("leaf");

        let ca_facts = parse_cert(&ca.cert_pem, "CA").expect("parse CA");
        assert!(ca_facts.is_ca);
        assert_eq!(ca_facts.not_before, now - BACKDATE);
        assert_eq!(ca_facts.not_after, now + CA_VALIDITY);

        let state = LeafState::read(&leaf.cert_pem, &ca.cert_pem).expect("leaf state");
        assert!(!state.facts.is_ca);
        assert!(state.signed_by_ca);
        assert_eq!(state.facts.names, want);
        assert_eq!(state.facts.not_before, now - BACKDATE);
        assert_eq!(state.facts.not_after, now + LEAF_VALIDITY);
        assert_eq!(judge_leaf(Some(&state), &want, now), LeafVerdict::Keep);
        assert_eq!(
            judge_leaf(Some(&state), &want, now + Duration::days(61)),
            LeafVerdict::Reissue(ReissueReason::Due)
        );

        // Same name, other key: the signature decides.
        assert!(!is_signed_by(&leaf.cert_pem, &other_ca.cert_pem).expect("check"));
        let state = LeafState::read(&leaf.cert_pem, &other_ca.cert_pem).expect("leaf state");
        assert_eq!(
            judge_leaf(Some(&state), &want, now),
            LeafVerdict::Reissue(ReissueReason::OtherCa)
        );
        // A CA is not signed by a leaf.
        assert!(!is_signed_by(&ca.cert_pem, &leaf.cert_pem).expect("check"));
        // Each issuance uses a new key, hence a new serial.
        let again = issue_leaf(&ca, &want, now, LEAF_VALIDITY).expect("leaf");
        assert_ne!(
            parse_cert(&again.cert_pem, "leaf").expect("parse").serial,
            state.facts.serial
        );
    }

    #[test]
    fn leaf_never_outlives_its_ca() {
        let now = OffsetDateTime::now_utc().replace_nanosecond(0).expect("ns");
        let ca = issue_ca("short CA", now, Duration::days(30)).expect("CA");
        let leaf = issue_leaf(&ca, &names(&["a.example"]), now, LEAF_VALIDITY).expect("leaf");
        let facts = parse_cert(&leaf.cert_pem, "leaf").expect("parse");
        assert_eq!(facts.not_after, now + Duration::days(30));
    }

    #[test]
    fn issue_leaf_rejects_bad_names() {
        let now = OffsetDateTime::now_utc();
        let ca = issue_ca("CA", now, CA_VALIDITY).expect("CA");
        for (name, list) in [
            ("space", &["bad name.example"][..]),
            ("empty label", &["a..example"][..]),
            ("leading hyphen", &["-a.example"][..]),
        ] {
            let got = issue_leaf(&ca, &names(list), now, LEAF_VALIDITY);
            assert!(
                matches!(got, Err(SelfSignedError::InvalidName { .. })),
                "{name}: {got:?}"
            );
        }
        assert!(matches!(
            issue_leaf(&ca, &SubjectNames::default(), now, LEAF_VALIDITY),
            Err(SelfSignedError::NoNames)
        ));
    }

    #[test]
    fn ca_bundle_table() {
        let now = OffsetDateTime::now_utc();
        let a = issue_ca("A", now, CA_VALIDITY).expect("A").cert_pem;
        let b = issue_ca("B", now, CA_VALIDITY).expect("B").cert_pem;
        let c = issue_ca("C", now, CA_VALIDITY).expect("C").cert_pem;
        let crlf = |s: &str| s.replace('\n', "\r\n");
        let count = |s: &str| s.matches("BEGIN CERTIFICATE").count();
        let ders = |s: &str| {
            CertificateDer::pem_slice_iter(s.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .expect("bundle parses")
        };
        let der = |s: &str| ders(s).remove(0);
        let ab = format!("{a}{b}");
        for (name, current, previous, want) in [
            ("current only", a.clone(), None, vec![der(&a)]),
            (
                "rotation",
                b.clone(),
                Some(a.clone()),
                vec![der(&b), der(&a)],
            ),
            (
                "previous is current",
                a.clone(),
                Some(a.clone()),
                vec![der(&a)],
            ),
            (
                "same CA re-encoded",
                a.clone(),
                Some(crlf(&a)),
                vec![der(&a)],
            ),
            (
                "previous bundle holds current",
                b.clone(),
                Some(ab.clone()),
                vec![der(&b), der(&a)],
            ),
            (
                "second rotation keeps all",
                c.clone(),
                Some(format!("{b}\n\n{a}")),
                vec![der(&c), der(&b), der(&a)],
            ),
        ] {
            let bundle = ca_bundle(&current, previous.as_deref()).expect(name);
            assert_eq!(ders(&bundle), want, "{name}");
            assert_eq!(count(&bundle), want.len(), "{name}");
            assert!(!bundle.contains('\r'), "{name}: {bundle:?}");
        }
        for (name, current, previous) in [
            ("empty", String::new(), None),
            ("truncated current", a[..a.len() - 10].to_owned(), None),
            (
                "garbage previous",
                a.clone(),
                Some("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".to_owned()),
            ),
        ] {
            assert!(ca_bundle(&current, previous.as_deref()).is_err(), "{name}");
        }
    }

    #[test]
    fn choose_ca_table() {
        let ca = |from: i64, to: i64| {
            Some(Validity {
                not_before: at(from) - BACKDATE,
                not_after: at(to),
            })
        };
        for (name, stored, remembered, want) in [
            ("fresh CA", ca(0, 3000), None, CaChoice::Keep),
            (
                "memory does not override the Secret",
                ca(0, 3000),
                ca(-5, 10),
                CaChoice::Keep,
            ),
            ("a day before 2/3", ca(-1999, 1001), None, CaChoice::Keep),
            ("2/3 elapsed", ca(-2000, 1000), None, CaChoice::Renew),
            ("expired", ca(-3000, -1), None, CaChoice::Renew),
            ("not valid yet", ca(1, 3000), None, CaChoice::Renew),
            ("lost, remembered", None, ca(0, 3000), CaChoice::Restore),
            (
                "lost, remembered but due",
                None,
                ca(-2000, 1000),
                CaChoice::Restore,
            ),
            ("lost, forgotten", None, None, CaChoice::Issue),
        ] {
            assert_eq!(choose_ca(stored, remembered, at(0)), want, "{name}");
        }
    }

    #[test]
    fn plan_leaf_table() {
        use LeafAction::*;
        use ReissueReason::*;
        for (name, verdict, trust, want) in [
            ("keep, trusted", LeafVerdict::Keep, Trust::Trusted, Keep),
            (
                "keep, CA not in the bundle yet",
                LeafVerdict::Keep,
                Trust::NotYet,
                Keep,
            ),
            (
                "due, trusted",
                LeafVerdict::Reissue(Due),
                Trust::Trusted,
                Issue(Due),
            ),
            (
                "new CA not trusted yet",
                LeafVerdict::Reissue(OtherCa),
                Trust::NotYet,
                AwaitTrust(OtherCa),
            ),
            (
                "new CA trusted",
                LeafVerdict::Reissue(OtherCa),
                Trust::Trusted,
                Issue(OtherCa),
            ),
            (
                "missing, CA not trusted",
                LeafVerdict::Reissue(Missing),
                Trust::NotYet,
                AwaitTrust(Missing),
            ),
            (
                "fresh install",
                LeafVerdict::Reissue(Missing),
                Trust::NoBundle,
                Issue(Missing),
            ),
            (
                "names, bundle wiped",
                LeafVerdict::Reissue(NamesChanged),
                Trust::NoBundle,
                Issue(NamesChanged),
            ),
        ] {
            assert_eq!(plan_leaf(verdict, trust), want, "{name}");
        }
    }

    #[test]
    fn keep_previous_table() {
        let overlap = Duration::minutes(5);
        for (name, leaf, now, want) in [
            ("leaf of an older CA", None, at(10), true),
            ("new leaf just out", Some(at(0)), at(0), true),
            (
                "a second before the overlap ends",
                Some(at(0)),
                at(0) + overlap - Duration::seconds(1),
                true,
            ),
            ("overlap over", Some(at(0)), at(0) + overlap, false),
            ("long after", Some(at(0)), at(30), false),
        ] {
            assert_eq!(keep_previous(leaf, now, overlap), want, "{name}");
        }
    }

    #[test]
    fn key_matches_table() {
        let now = OffsetDateTime::now_utc();
        let a = issue_ca("A", now, CA_VALIDITY).expect("A");
        let b = issue_ca("B", now, CA_VALIDITY).expect("B");
        let leaf = issue_leaf(&a, &names(&["a.example"]), now, LEAF_VALIDITY).expect("leaf");
        for (name, cert, key, matches, ca, serving) in [
            ("CA", &a.cert_pem, &a.key_pem, true, true, false),
            (
                "CA with another CA's key",
                &a.cert_pem,
                &b.key_pem,
                false,
                false,
                false,
            ),
            (
                "CA with garbage key",
                &a.cert_pem,
                &"garbage".to_owned(),
                false,
                false,
                false,
            ),
            (
                "garbage certificate",
                &"garbage".to_owned(),
                &a.key_pem,
                false,
                false,
                false,
            ),
            ("leaf", &leaf.cert_pem, &leaf.key_pem, true, false, true),
            (
                "leaf with the CA's key",
                &leaf.cert_pem,
                &a.key_pem,
                false,
                false,
                false,
            ),
        ] {
            assert_eq!(key_matches(cert, key), matches, "{name}");
            assert_eq!(usable_ca(cert, key).is_some(), ca, "{name}");
            assert_eq!(usable_leaf(cert, key).is_some(), serving, "{name}");
        }
    }

    #[test]
    fn trust_of_and_trusted_besides() {
        let now = OffsetDateTime::now_utc();
        let a = issue_ca("A", now, CA_VALIDITY).expect("A").cert_pem;
        let b = issue_ca("B", now, CA_VALIDITY).expect("B").cert_pem;
        let expired = issue_ca("old", now - Duration::days(20), Duration::days(10))
            .expect("expired")
            .cert_pem;
        let leaf = issue_leaf(
            &issue_ca("L", now, CA_VALIDITY).expect("L"),
            &names(&["a.example"]),
            now,
            LEAF_VALIDITY,
        )
        .expect("leaf")
        .cert_pem;
        let garbage = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let truncated = &b[..b.len() - 30];
        for (name, bundle, want) in [
            ("no configuration", None, Trust::NoBundle),
            ("wiped", Some(String::new()), Trust::NoBundle),
            ("garbage only", Some(garbage.to_owned()), Trust::NoBundle),
            ("holds it", Some(format!("{b}{a}")), Trust::Trusted),
            (
                "holds it after garbage",
                Some(format!("{garbage}{a}")),
                Trust::Trusted,
            ),
            ("holds another", Some(b.clone()), Trust::NotYet),
        ] {
            assert_eq!(trust_of(&a, bundle.as_deref()), want, "{name}");
        }

        let ders = |s: &str| {
            CertificateDer::pem_slice_iter(s.as_bytes())
                .map(|c| c.expect("parses").to_vec())
                .collect::<Vec<_>>()
        };
        let der = |s: &str| ders(s).remove(0);
        for (name, sources, want) in [
            ("nothing", vec![], vec![]),
            ("current only", vec![a.clone()], vec![]),
            ("old CA kept", vec![b.clone(), a.clone()], vec![der(&b)]),
            (
                "deduplicated across sources",
                vec![b.clone(), format!("{a}{b}")],
                vec![der(&b)],
            ),
            (
                "expired dropped",
                vec![format!("{expired}{b}")],
                vec![der(&b)],
            ),
            ("leaf is no CA", vec![leaf.clone()], vec![]),
            (
                "garbage skipped",
                vec![format!("{garbage}junk{b}")],
                vec![der(&b)],
            ),
            (
                "truncated block skipped",
                vec![format!("{truncated}{a}"), b.clone()],
                vec![der(&b)],
            ),
        ] {
            let refs: Vec<&str> = sources.iter().map(String::as_str).collect();
            let got = trusted_besides(&a, &refs, now);
            assert_eq!(ders(&got), want, "{name}");
            // The result always makes a valid bundle with the current CA.
            ca_bundle(&a, Some(&got)).expect(name);
        }
    }
}
