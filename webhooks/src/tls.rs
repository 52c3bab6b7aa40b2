//! TLS for the webhook server: a rustls configuration restricted to TLS 1.2/1.3 with AEAD
//! suites, and a certificate resolver whose pair can be replaced while the server runs, either
//! from PEMs (the `--self-signed` Secret) or by polling `--tls-cert-file`/`--tls-key-file`.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::crypto::ring::{cipher_suite, default_provider};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ServerConfig, SupportedCipherSuite};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;
use x509_parser::prelude::{FromDer, X509Certificate};

/// How often `--tls-cert-file`/`--tls-key-file` are re-read in production.
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(1);

/// ALPN protocols we offer. Only HTTP/1.1: over h2 the apiserver would multiplex all its
/// admission requests onto one connection, pinning them to one replica behind the Service,
/// and hyper's h2 server has no header read timeout against idle or slow clients.
pub const ALPN_PROTOCOLS: [&[u8]; 1] = [b"http/1.1"];

/// Cipher suites we accept: AEAD only. CBC and SHA-1 MAC suites are not even implemented by the
/// ring provider, but listing them explicitly keeps a future provider default from widening it.
pub static CIPHER_SUITES: &[SupportedCipherSuite] = &[
    cipher_suite::TLS13_AES_256_GCM_SHA384,
    cipher_suite::TLS13_AES_128_GCM_SHA256,
    cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
    cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
    cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
    cipher_suite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
    cipher_suite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
    cipher_suite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
    cipher_suite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
];

/// Which half of a certificate/key pair an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PemKind {
    /// The certificate chain (leaf first).
    Certificate,
    /// The private key of the leaf.
    PrivateKey,
}

impl std::fmt::Display for PemKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PemKind::Certificate => "certificate",
            PemKind::PrivateKey => "private key",
        })
    }
}

/// Why a certificate/key pair could not be loaded or a TLS configuration built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {kind} file {path}: {source}")]
    Read {
        /// Which file.
        kind: PemKind,
        /// The path as given.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// The PEM text is malformed or holds no item of the expected type.
    #[error("parsing {kind} PEM from {origin}: {source}")]
    Pem {
        /// Which half of the pair.
        kind: PemKind,
        /// Where the PEM came from (a path or a Secret).
        origin: String,
        /// The parser's complaint.
        source: rustls_pki_types::pem::Error,
    },
    /// The private key is of a type the ring provider cannot sign with.
    #[error("unsupported private key from {origin}: {source}")]
    UnsupportedKey {
        /// Where the key came from.
        origin: String,
        /// rustls' complaint.
        source: rustls::Error,
    },
    /// The private key does not belong to the leaf certificate.
    #[error("private key from {key_origin} does not match certificate from {cert_origin}")]
    KeyMismatch {
        /// Where the certificate came from.
        cert_origin: String,
        /// Where the key came from.
        key_origin: String,
    },
    /// The leaf certificate is not valid X.509.
    #[error("certificate from {origin} is not valid X.509: {message}")]
    X509 {
        /// Where the certificate came from.
        origin: String,
        /// The parser's complaint.
        message: String,
    },
    /// rustls refused the protocol versions (cannot happen with the ring provider).
    #[error("building the TLS server configuration: {0}")]
    Config(#[source] rustls::Error),
}

/// Facts about a serving certificate, for metrics and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertInfo {
    /// Serial number as lowercase colon-separated hex, as `openssl x509 -serial` shows it.
    pub serial: String,
    /// Start of validity.
    pub not_before: OffsetDateTime,
    /// End of validity.
    pub not_after: OffsetDateTime,
}

impl CertInfo {
    /// Reads serial and validity out of a DER certificate.
    pub fn from_der(der: &[u8], origin: &str) -> Result<Self, TlsError> {
        let (_, cert) = X509Certificate::from_der(der).map_err(|e| TlsError::X509 {
            origin: origin.to_owned(),
            message: e.to_string(),
        })?;
        Ok(CertInfo {
            serial: cert.raw_serial_as_string(),
            not_before: cert.validity().not_before.to_datetime(),
            not_after: cert.validity().not_after.to_datetime(),
        })
    }
}

/// The ring provider cut down to [`CIPHER_SUITES`].
pub fn crypto_provider() -> Arc<CryptoProvider> {
    Arc::new(CryptoProvider {
        cipher_suites: CIPHER_SUITES.to_vec(),
        ..default_provider()
    })
}

/// A server configuration for our HTTPS servers: TLS 1.2 and 1.3, AEAD suites, no client
/// authentication (the apiserver does not present one to webhooks by default), ALPN http/1.1,
/// the certificate taken from `resolver` on every handshake.
pub fn server_config(resolver: Arc<dyn ResolvesServerCert>) -> Result<Arc<ServerConfig>, TlsError> {
    let mut config = ServerConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(TlsError::Config)?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = ALPN_PROTOCOLS.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// How many leading bytes of a connection [`legacy_client_version`] needs: the record header
/// (5), the handshake header (4) and the ClientHello's `client_version` (2).
pub const CLIENT_HELLO_PREFIX_LEN: usize = 11;

/// The `client_version` of a ClientHello that offers nothing newer than TLS 1.1, given the
/// first [`CLIENT_HELLO_PREFIX_LEN`] bytes of a connection; `None` for anything else (newer
/// clients, non-TLS bytes, fragments too short to tell), which rustls then judges itself.
///
/// rustls rejects such clients too, but because their hello lacks the signature_algorithms
/// extension (only defined from TLS 1.2) it answers `handshake_failure`, which tells the
/// operator of an old client nothing. Go's crypto/tls, which PMEM-CSI 1.0 used, and OpenSSL
/// answer `protocol_version`. A client that can do TLS 1.3 must send 0x0303 here (RFC 8446
/// 4.1.2) and list its versions in supported_versions, so a lower value is its maximum.
pub fn legacy_client_version(prefix: &[u8]) -> Option<u16> {
    const HANDSHAKE_RECORD: u8 = 22;
    const CLIENT_HELLO: u8 = 1;
    const TLS12: u16 = 0x0303;
    let prefix = prefix.get(..CLIENT_HELLO_PREFIX_LEN)?;
    let record_len = u16::from_be_bytes([prefix[3], prefix[4]]);
    if prefix[0] != HANDSHAKE_RECORD
        || prefix[1] != 3
        || prefix[5] != CLIENT_HELLO
        || record_len < 6
    {
        return None;
    }
    let version = u16::from_be_bytes([prefix[9], prefix[10]]);
    (version >> 8 == 3 && version < TLS12).then_some(version)
}

/// A fatal `protocol_version` alert record (RFC 5246 7.2). Pass the client's `client_version`:
/// OpenSSL drops records whose version differs from the one it offered, reporting "wrong
/// version number" instead of the alert.
pub fn protocol_version_alert(record_version: u16) -> [u8; 7] {
    const ALERT_RECORD: u8 = 21;
    const FATAL: u8 = 2;
    const PROTOCOL_VERSION: u8 = 70;
    let [major, minor] = record_version.to_be_bytes();
    [ALERT_RECORD, major, minor, 0, 2, FATAL, PROTOCOL_VERSION]
}

/// Paths of the PEM certificate chain and private key (`--tls-cert-file`, `--tls-key-file`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    /// Certificate chain, leaf first.
    pub cert: PathBuf,
    /// Private key of the leaf (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

impl CertFiles {
    /// Reads both files, certificate first.
    pub fn read(&self) -> Result<(Vec<u8>, Vec<u8>), TlsError> {
        let read = |kind, path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                kind,
                path: path.to_owned(),
                source,
            })
        };
        Ok((
            read(PemKind::Certificate, &self.cert)?,
            read(PemKind::PrivateKey, &self.key)?,
        ))
    }
}

/// A parsed pair together with the PEM it came from, so a reload can tell whether the content
/// changed without parsing it again.
#[derive(Debug)]
struct Loaded {
    key: Arc<CertifiedKey>,
    info: CertInfo,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
}

/// Parses a PEM pair into a rustls key, checking that the key belongs to the leaf.
fn parse_pair(
    cert_pem: &[u8],
    key_pem: &[u8],
    cert_origin: &str,
    key_origin: &str,
) -> Result<(Arc<CertifiedKey>, CertInfo), TlsError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            kind: PemKind::Certificate,
            origin: cert_origin.to_owned(),
            source,
        })?;
    let Some(leaf) = chain.first() else {
        return Err(TlsError::Pem {
            kind: PemKind::Certificate,
            origin: cert_origin.to_owned(),
            source: rustls_pki_types::pem::Error::NoItemsFound,
        });
    };
    let info = CertInfo::from_der(leaf, cert_origin)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|source| TlsError::Pem {
        kind: PemKind::PrivateKey,
        origin: key_origin.to_owned(),
        source,
    })?;
    let signing_key = default_provider()
        .key_provider
        .load_private_key(key)
        .map_err(|source| TlsError::UnsupportedKey {
            origin: key_origin.to_owned(),
            source,
        })?;
    let certified = CertifiedKey::new(chain, signing_key);
    // Unlike `CertifiedKey::from_der`, treat "cannot tell" as a mismatch too: ring always knows
    // the public key of the types it loads, and serving an unchecked pair would fail every
    // handshake until the next change.
    certified.keys_match().map_err(|_| TlsError::KeyMismatch {
        cert_origin: cert_origin.to_owned(),
        key_origin: key_origin.to_owned(),
    })?;
    Ok((Arc::new(certified), info))
}

/// The serving certificate of a running server, replaceable without restarting it.
#[derive(Debug, Default)]
pub struct CertResolver {
    current: RwLock<Option<Arc<Loaded>>>,
    reloads: AtomicU64,
    reload_failures: AtomicU64,
}

impl CertResolver {
    /// A resolver without a certificate; handshakes fail until [`CertResolver::set`] succeeds.
    pub fn new() -> Self {
        Self::default()
    }

    /// Replaces the pair with PEMs (the `--self-signed` Secret). On error the old pair stays.
    pub fn set(&self, cert_pem: &[u8], key_pem: &[u8]) -> Result<CertInfo, TlsError> {
        self.install(cert_pem, key_pem, "PEM certificate", "PEM private key")
    }

    /// Replaces the pair with the content of `files`. On error the old pair stays.
    pub fn load_files(&self, files: &CertFiles) -> Result<CertInfo, TlsError> {
        let (cert_pem, key_pem) = files.read()?;
        self.install(
            &cert_pem,
            &key_pem,
            &files.cert.display().to_string(),
            &files.key.display().to_string(),
        )
    }

    fn install(
        &self,
        cert_pem: &[u8],
        key_pem: &[u8],
        cert_origin: &str,
        key_origin: &str,
    ) -> Result<CertInfo, TlsError> {
        let (key, info) = parse_pair(cert_pem, key_pem, cert_origin, key_origin)?;
        let loaded = Arc::new(Loaded {
            key,
            info: info.clone(),
            cert_pem: cert_pem.to_vec(),
            key_pem: key_pem.to_vec(),
        });
        // A poisoned lock only means a writer panicked between two pointer stores; the value is
        // still one whole pair, so keep serving rather than propagate the panic.
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Some(loaded);
        Ok(info)
    }

    fn loaded(&self) -> Option<Arc<Loaded>> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Serial and validity of the certificate currently served, if any.
    pub fn current(&self) -> Option<CertInfo> {
        self.loaded().map(|l| l.info.clone())
    }

    /// How many times [`CertResolver::watch_files`] swapped in a changed pair.
    pub fn reloads(&self) -> u64 {
        self.reloads.load(Ordering::Relaxed)
    }

    /// How many changed-but-invalid pairs or new read errors [`CertResolver::watch_files`]
    /// rejected (each distinct content or error counts once).
    pub fn reload_failures(&self) -> u64 {
        self.reload_failures.load(Ordering::Relaxed)
    }

    /// Whether the served pair is exactly these PEM bytes.
    fn is_current(&self, cert_pem: &[u8], key_pem: &[u8]) -> bool {
        self.loaded()
            .is_some_and(|l| l.cert_pem == cert_pem && l.key_pem == key_pem)
    }

    /// Polls `files` every `interval` until `shutdown`, swapping the pair when the content
    /// changed and the new pair is valid. Kubernetes updates Secret volumes by re-pointing a
    /// `..data` symlink, which inotify on the file paths does not report reliably; re-reading
    /// through the paths sees the swap. Reading the two files is not atomic, so a poll may see
    /// a new certificate with the old key: that pair is rejected with a warning, the old one
    /// keeps serving, and the next poll reads the consistent pair.
    pub async fn watch_files(
        self: Arc<Self>,
        files: CertFiles,
        interval: Duration,
        shutdown: CancellationToken,
    ) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Remember what was rejected last, so a broken pair is reported once, not every poll.
        let mut rejected: Option<(Vec<u8>, Vec<u8>)> = None;
        let mut last_read_error: Option<String> = None;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = ticker.tick() => {}
            }
            let (cert_pem, key_pem) = match files.read() {
                Ok(pair) => {
                    last_read_error = None;
                    pair
                }
                Err(e) => {
                    let message = e.to_string();
                    if last_read_error.as_deref() != Some(message.as_str()) {
                        tracing::warn!(error = %message, "cannot read TLS files; keeping the current certificate");
                        last_read_error = Some(message);
                        self.reload_failures.fetch_add(1, Ordering::Relaxed);
                    }
                    continue;
                }
            };
            if self.is_current(&cert_pem, &key_pem)
                || rejected
                    .as_ref()
                    .is_some_and(|(c, k)| *c == cert_pem && *k == key_pem)
            {
                continue;
            }
            match self.install(
                &cert_pem,
                &key_pem,
                &files.cert.display().to_string(),
                &files.key.display().to_string(),
            ) {
                Ok(info) => {
                    rejected = None;
                    self.reloads.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(serial = %info.serial, not_after = %info.not_after, "reloaded TLS certificate");
                }
                Err(e) => {
                    tracing::warn!(error = %e, "TLS files changed but do not form a valid pair; keeping the current certificate");
                    rejected = Some((cert_pem, key_pem));
                    self.reload_failures.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.loaded().map(|l| Arc::clone(&l.key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(cn: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().expect("key");
        let params = rcgen::CertificateParams::new(vec![cn.to_owned()]).expect("params");
        let cert = params.self_signed(&key).expect("cert");
        (cert.pem(), key.serialize_pem())
    }

    #[test]
    fn set_table() {
        let (cert_a, key_a) = pair("a.example");
        let (cert_b, key_b) = pair("b.example");
        let garbage = "-----BEGIN CERTIFICATE-----\n!!!\n-----END CERTIFICATE-----\n";
        type Check = fn(&TlsError) -> bool;
        let ok: Option<Check> = None;
        for (name, cert, key, want) in [
            ("matching pair", cert_a.as_str(), key_a.as_str(), ok),
            ("other matching pair", &cert_b, &key_b, ok),
            (
                "key of another cert",
                &cert_b,
                &key_a,
                Some((|e| matches!(e, TlsError::KeyMismatch { .. })) as Check),
            ),
            (
                "empty cert",
                "",
                &key_a,
                Some(|e| {
                    matches!(
                        e,
                        TlsError::Pem {
                            kind: PemKind::Certificate,
                            ..
                        }
                    )
                }),
            ),
            (
                "broken base64",
                garbage,
                &key_a,
                Some(|e| matches!(e, TlsError::Pem { .. })),
            ),
            (
                "cert as key",
                &cert_a,
                &cert_a,
                Some(|e| {
                    matches!(
                        e,
                        TlsError::Pem {
                            kind: PemKind::PrivateKey,
                            ..
                        }
                    )
                }),
            ),
            (
                "truncated key",
                &cert_a,
                &key_a[..key_a.len() / 2],
                Some(|e| matches!(e, TlsError::Pem { .. })),
            ),
        ] {
            let resolver = CertResolver::new();
            resolver
                .set(cert_a.as_bytes(), key_a.as_bytes())
                .expect("initial");
            let before = resolver.current();
            let got = resolver.set(cert.as_bytes(), key.as_bytes());
            match (want, got) {
                (None, Ok(info)) => assert_eq!(resolver.current(), Some(info), "{name}"),
                (Some(check), Err(e)) => {
                    assert!(check(&e), "{name}: unexpected error {e}");
                    assert_eq!(resolver.current(), before, "{name}: old pair must stay");
                }
                (want, got) => panic!("{name}: want error {}, got {got:?}", want.is_some()),
            }
        }
    }

    #[test]
    fn cert_info_reads_serial_and_validity() {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(vec!["x".to_owned()]).expect("params");
        params.serial_number = Some(rcgen::SerialNumber::from_slice(&[0x0a, 0xbc]));
        params.not_before = rcgen::date_time_ymd(2024, 1, 2);
        params.not_after = rcgen::date_time_ymd(2025, 3, 4);
        let cert = params.self_signed(&key).expect("cert");
        let info = CertInfo::from_der(cert.der(), "test").expect("info");
        assert_eq!(info.serial, "0a:bc");
        assert_eq!(info.not_before, rcgen::date_time_ymd(2024, 1, 2));
        assert_eq!(info.not_after, rcgen::date_time_ymd(2025, 3, 4));
    }

    #[test]
    fn legacy_client_version_table() {
        // Record header, handshake header, client_version, then the rest of a hello.
        fn hello(record: [u8; 2], len: u16, kind: u8, version: [u8; 2]) -> Vec<u8> {
            let [l0, l1] = len.to_be_bytes();
            vec![
                22, record[0], record[1], l0, l1, kind, 0, 0, 40, version[0], version[1], 9, 9,
            ]
        }
        for (name, bytes, want) in [
            ("TLS 1.0 hello", hello([3, 1], 200, 1, [3, 1]), Some(0x0301)),
            ("TLS 1.1 hello", hello([3, 1], 200, 1, [3, 2]), Some(0x0302)),
            ("SSL 3.0 hello", hello([3, 0], 200, 1, [3, 0]), Some(0x0300)),
            ("TLS 1.2 hello", hello([3, 1], 200, 1, [3, 3]), None),
            (
                "TLS 1.3 hello (legacy 1.2)",
                hello([3, 1], 512, 1, [3, 3]),
                None,
            ),
            ("future version", hello([3, 3], 200, 1, [3, 4]), None),
            ("not a ClientHello", hello([3, 1], 200, 2, [3, 1]), None),
            (
                "fragment too short to hold the version",
                hello([3, 1], 5, 1, [3, 1]),
                None,
            ),
            ("odd record major", hello([2, 0], 200, 1, [3, 1]), None),
            ("odd hello major", hello([3, 1], 200, 1, [2, 0]), None),
            ("plain HTTP", b"GET / HTTP/1.1\r\n".to_vec(), None),
            (
                "SSLv2-compatible hello",
                vec![0x80, 0x2e, 1, 3, 1, 0, 21, 0, 0, 0, 16],
                None,
            ),
            ("too short", vec![22, 3, 1, 0, 200, 1], None),
        ] {
            assert_eq!(legacy_client_version(&bytes), want, "{name}");
        }
    }

    #[test]
    fn protocol_version_alert_bytes() {
        assert_eq!(protocol_version_alert(0x0302), [21, 3, 2, 0, 2, 2, 70]);
    }

    #[test]
    fn empty_resolver_has_no_certificate() {
        assert_eq!(CertResolver::new().current(), None);
    }

    #[test]
    fn config_offers_only_tls12_and_tls13_aead() {
        let config = server_config(Arc::new(CertResolver::new())).expect("config");
        assert!(
            config
                .crypto_provider()
                .cipher_suites
                .iter()
                .all(|s| CIPHER_SUITES.contains(s))
        );
        assert_eq!(config.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }
}
