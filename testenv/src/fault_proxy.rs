//! An HTTPS proxy in front of kube-apiserver that can answer requests itself with 429, 500 or
//! 503 for a while, as an overloaded or failing apiserver does: the fault-injection suite's
//! "apiserver answering 429 and 5xx". testenv's [`crate::proxy::TcpProxy`] can only cut or hang
//! connections; this one speaks HTTP, so it terminates TLS with a certificate of testenv's CA
//! (clients keep their CA file) and forwards each request over a TLS connection of its own,
//! bearer token and all. Clients authenticating by certificate cannot pass through it; every
//! ServiceAccount kubeconfig of testenv uses tokens.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::sync::CancellationToken;

use crate::pki::Pki;

/// The statuses a failing period rotates through.
const INJECTED: [StatusCode; 3] = [
    StatusCode::TOO_MANY_REQUESTS,
    StatusCode::INTERNAL_SERVER_ERROR,
    StatusCode::SERVICE_UNAVAILABLE,
];

type ProxyBody = BoxBody<Bytes, hyper::Error>;

/// Failures starting the proxy.
#[derive(Debug, thiserror::Error)]
pub enum FaultProxyError {
    /// Its certificate could not be issued or loaded.
    #[error("fault proxy certificate: {0}")]
    Certificate(String),
    /// It cannot listen.
    #[error("fault proxy listening: {0}")]
    Listen(#[from] std::io::Error),
}

struct Shared {
    upstream: SocketAddr,
    connector: TlsConnector,
    failing_until: Mutex<Option<Instant>>,
    injected: AtomicUsize,
}

impl Shared {
    fn failing(&self) -> bool {
        let until = self
            .failing_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        until.is_some_and(|u| Instant::now() < u)
    }
}

/// The running proxy; it stops with the token it was started with.
#[derive(Clone)]
pub struct FaultProxy {
    address: SocketAddr,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("address", &self.address)
            .field("upstream", &self.shared.upstream)
            .finish()
    }
}

impl FaultProxy {
    /// Starts a proxy to the apiserver at `upstream` (127.0.0.1) on a free loopback port.
    pub async fn start(
        upstream: SocketAddr,
        pki: &Pki,
        shutdown: CancellationToken,
    ) -> Result<Self, FaultProxyError> {
        let certificate = |e: &dyn std::fmt::Display| FaultProxyError::Certificate(e.to_string());
        let serving = pki
            .serving("fault-proxy", &[])
            .map_err(|e| certificate(&e))?;
        use rustls_pki_types::pem::PemObject;
        let chain = vec![
            CertificateDer::from_pem_slice(serving.cert_pem.as_bytes())
                .map_err(|e| certificate(&e))?,
        ];
        let key = PrivateKeyDer::from_pem_slice(serving.key_pem.as_bytes())
            .map_err(|e| certificate(&e))?;
        let mut server = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| certificate(&e))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| certificate(&e))?;
        // HTTP/1.1 only: Go clients then speak it too, and each request is one exchange.
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(pki.ca_pem().as_bytes()) {
            let cert: CertificateDer<'static> = cert.map_err(|e| certificate(&e))?;
            roots.add(cert).map_err(|e| certificate(&e))?;
        }
        let mut client = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| certificate(&e))?
        .with_root_certificates(roots)
        .with_no_client_auth();
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            connector: TlsConnector::from(Arc::new(client)),
            failing_until: Mutex::new(None),
            injected: AtomicUsize::new(0),
        });
        let acceptor = TlsAcceptor::from(Arc::new(server));
        let serving = Arc::clone(&shared);
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                    () = shutdown.cancelled() => return,
                };
                let (acceptor, shared, token) =
                    (acceptor.clone(), Arc::clone(&serving), shutdown.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(stream).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |request| {
                        forward(Arc::clone(&shared), request)
                    });
                    let connection = hyper::server::conn::http1::Builder::new()
                        .timer(TokioTimer::new())
                        .serve_connection(TokioIo::new(tls), service);
                    tokio::select! {
                        _ = connection => {}
                        () = token.cancelled() => {}
                    }
                });
            }
        });
        Ok(Self { address, shared })
    }

    /// Where clients connect.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Answers every new request for `how_long` with 429, 500 and 503 in turn (429 with
    /// `Retry-After: 1`), instead of forwarding it. Streams already open (watches) go on.
    pub fn fail_for(&self, how_long: Duration) {
        *self
            .shared
            .failing_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now() + how_long);
    }

    /// How many requests it has answered itself.
    pub fn injected(&self) -> usize {
        self.shared.injected.load(Ordering::Relaxed)
    }
}

async fn forward(
    shared: Arc<Shared>,
    request: Request<Incoming>,
) -> Result<Response<ProxyBody>, std::convert::Infallible> {
    if shared.failing() {
        let n = shared.injected.fetch_add(1, Ordering::Relaxed);
        return Ok(injected(INJECTED[n % INJECTED.len()]));
    }
    match upstream(&shared, request).await {
        Ok(response) => Ok(response.map(BodyExt::boxed)),
        Err(e) => Ok(status(
            StatusCode::BAD_GATEWAY,
            &format!("fault proxy: upstream: {e}"),
        )),
    }
}

async fn upstream(
    shared: &Shared,
    request: Request<Incoming>,
) -> Result<Response<Incoming>, Box<dyn std::error::Error + Send + Sync>> {
    let tcp = TcpStream::connect(shared.upstream).await?;
    let name = ServerName::IpAddress(shared.upstream.ip().into());
    let tls = shared.connector.connect(name, tcp).await?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake::<_, Incoming>(TokioIo::new(tls)).await?;
    tokio::spawn(connection);
    Ok(sender.send_request(request).await?)
}

/// The answer of an apiserver in trouble: a `Status` object, as clients parse it.
fn injected(code: StatusCode) -> Response<ProxyBody> {
    let mut response = status(code, "injected by testenv's fault proxy");
    if code == StatusCode::TOO_MANY_REQUESTS {
        response.headers_mut().insert(
            hyper::header::RETRY_AFTER,
            hyper::header::HeaderValue::from_static("1"),
        );
    }
    response
}

fn status(code: StatusCode, message: &str) -> Response<ProxyBody> {
    let reason = match code {
        StatusCode::TOO_MANY_REQUESTS => "TooManyRequests",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailable",
        _ => "InternalError",
    };
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    })
    .to_string();
    let mut response = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = code;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}
