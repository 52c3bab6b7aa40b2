//! Test PKI, servers and a raw HTTPS client shared by the `tls_*` integration tests.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    SerialNumber,
};
use rustls::ClientConfig;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;
use webhooks::https::{HttpsServer, ServeOptions};
use webhooks::tls::{CertResolver, server_config};

/// A test CA that issues leaves for 127.0.0.1.
pub struct Ca {
    pub cert_pem: String,
    pub cert_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
}

/// A leaf issued by [`Ca`].
#[derive(Clone)]
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
    /// As `webhooks::tls::CertInfo::serial` shows it.
    pub serial: String,
}

impl Ca {
    pub fn new() -> Self {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params
            .distinguished_name
            .push(DnType::CommonName, "tls test CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).expect("CA cert");
        Self {
            cert_pem: cert.pem(),
            cert_der: cert.der().clone(),
            issuer: Issuer::new(params, key),
        }
    }

    /// An ECDSA P-256 leaf for 127.0.0.1 with the given serial.
    pub fn leaf(&self, serial: u8) -> Leaf {
        self.leaf_with_key(serial, KeyPair::generate().expect("leaf key"))
    }

    /// A leaf for 127.0.0.1 with the given key (e.g. an RSA key made by openssl).
    pub fn leaf_with_key(&self, serial: u8, key: KeyPair) -> Leaf {
        let mut params = CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("params");
        params
            .distinguished_name
            .push(DnType::CommonName, format!("leaf {serial}"));
        // Leading 0x01 keeps the DER integer positive and two bytes long whatever `serial` is.
        params.serial_number = Some(SerialNumber::from_slice(&[0x01, serial]));
        let cert = params.signed_by(&key, &self.issuer).expect("leaf");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            serial: format!("01:{serial:02x}"),
        }
    }

    /// A client configuration that trusts only this CA and does a full handshake on every
    /// connection. With resumption a reconnecting client keeps the certificate identity of its
    /// first session and never sees a rotated one (the apiserver's Go client keeps no session
    /// cache, so it always does full handshakes).
    pub fn client_config(&self) -> Arc<ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.cert_der.clone()).expect("add CA");
        let mut config =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("versions")
                .with_root_certificates(roots)
                .with_no_client_auth();
        config.resumption = rustls::client::Resumption::disabled();
        Arc::new(config)
    }
}

/// A directory laid out like a Kubernetes Secret volume: `tls.crt` and `tls.key` are symlinks
/// through `..data`, which points at a timestamped directory and is swapped atomically.
pub struct SecretDir {
    pub dir: tempfile::TempDir,
    generation: u32,
}

impl SecretDir {
    pub fn new(cert_pem: &str, key_pem: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut secret = Self { dir, generation: 0 };
        secret.swap(cert_pem, key_pem);
        for name in ["tls.crt", "tls.key"] {
            std::os::unix::fs::symlink(
                Path::new("..data").join(name),
                secret.dir.path().join(name),
            )
            .expect("file symlink");
        }
        secret
    }

    pub fn cert_path(&self) -> PathBuf {
        self.dir.path().join("tls.crt")
    }

    pub fn key_path(&self) -> PathBuf {
        self.dir.path().join("tls.key")
    }

    /// What the kubelet's AtomicWriter does: write a new directory, point a temporary symlink
    /// at it, rename the symlink over `..data`.
    pub fn swap(&mut self, cert_pem: &str, key_pem: &str) {
        self.generation += 1;
        let name = format!("..gen_{}", self.generation);
        let data = self.dir.path().join(&name);
        std::fs::create_dir(&data).expect("data dir");
        std::fs::write(data.join("tls.crt"), cert_pem).expect("write cert");
        std::fs::write(data.join("tls.key"), key_pem).expect("write key");
        let tmp = self.dir.path().join("..data_tmp");
        std::os::unix::fs::symlink(&name, &tmp).expect("tmp symlink");
        std::fs::rename(&tmp, self.dir.path().join("..data")).expect("rename ..data");
    }
}

/// A router answering `GET /` with "ok".
pub fn ok_router() -> Router {
    Router::new().route("/", get(|| async { "ok" }))
}

/// A running HTTPS server.
pub struct Running {
    pub addr: SocketAddr,
    pub shutdown: CancellationToken,
    pub task: JoinHandle<()>,
}

pub async fn start_https(
    router: Router,
    resolver: Arc<CertResolver>,
    options: ServeOptions,
) -> Running {
    let server = HttpsServer::bind("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind")
        .with_options(options);
    let addr = server.local_addr();
    let shutdown = CancellationToken::new();
    let config = server_config(resolver).expect("server config");
    let task = tokio::spawn(server.serve(router, config, shutdown.clone()));
    Running {
        addr,
        shutdown,
        task,
    }
}

pub async fn start_plain(router: Router, options: ServeOptions) -> Running {
    let server = HttpsServer::bind("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind")
        .with_options(options);
    let addr = server.local_addr();
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(server.serve_plain(router, shutdown.clone()));
    Running {
        addr,
        shutdown,
        task,
    }
}

/// What one request over a fresh TLS connection saw.
#[derive(Debug)]
pub struct Reply {
    /// Serial of the certificate the server presented.
    pub serial: String,
    /// Raw HTTP response.
    pub response: String,
}

/// Opens a new TCP and TLS connection, sends `GET path` with `Connection: close`, reads the
/// whole response.
pub async fn https_get(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    path: &str,
) -> Result<Reply, String> {
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let name = ServerName::try_from("127.0.0.1").map_err(|e| e.to_string())?;
    let mut tls = TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let leaf = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .ok_or("no peer certificate")?;
    let serial = webhooks::tls::CertInfo::from_der(leaf, "peer")
        .map_err(|e| e.to_string())?
        .serial;
    let response = exchange(&mut tls, path).await?;
    Ok(Reply { serial, response })
}

/// Sends `GET path` with `Connection: close` over `io` and reads until the server closes.
pub async fn exchange<S>(io: &mut S, path: &str) -> Result<String, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    io.write_all(request.as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut buf = Vec::new();
    io.read_to_end(&mut buf)
        .await
        .map_err(|e| format!("read: {e}"))?;
    String::from_utf8(buf).map_err(|e| e.to_string())
}

/// Polls `check` every 20 ms until it returns true; panics with `what` after `limit`.
pub async fn until<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if check().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
