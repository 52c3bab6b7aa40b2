//! A minimal HTTP/1.1 client for tests of our own servers: one request per new connection
//! (`Connection: close`), over TLS trusting a given CA bundle or over plain TCP, reporting the
//! status, the body and, over TLS, the DER of the certificate the server presented.

use std::net::SocketAddr;
use std::sync::Arc;

use rustls::ClientConfig;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls_pki_types::pem::PemObject;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// An answer.
#[derive(Clone, Debug)]
pub struct Reply {
    /// HTTP status code.
    pub status: u16,
    /// Body (lossy UTF-8).
    pub body: String,
    /// The server's certificate (TLS only).
    pub peer_certificate: Option<Vec<u8>>,
}

/// A client configuration trusting the certificates of `ca_pem` (a bundle is fine), without
/// session resumption: every connection shows the certificate served now.
pub fn trusting(ca_pem: &str) -> Result<Arc<ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        let cert = cert.map_err(|e| format!("CA PEM: {e}"))?;
        roots.add(cert).map_err(|e| format!("CA: {e}"))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(config))
}

/// `method path` with `body` to `addr` over TLS (server name 127.0.0.1).
pub async fn https(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<Reply, String> {
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let name = ServerName::try_from("127.0.0.1").map_err(|e| e.to_string())?;
    let mut tls = TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let peer = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.as_ref().to_vec());
    let mut reply = exchange(&mut tls, method, path, body).await?;
    reply.peer_certificate = peer;
    Ok(reply)
}

/// `method path` with `body` to `addr` over plain HTTP.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<Reply, String> {
    let mut tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    exchange(&mut tcp, method, path, body).await
}

async fn exchange<S>(io: &mut S, method: &str, path: &str, body: &[u8]) -> Result<Reply, String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    io.write_all(head.as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    // A server may answer (413) and close before reading an oversized body.
    let _ = io.write_all(body).await;
    let _ = io.flush().await;
    let mut buf = Vec::new();
    let read = io.read_to_end(&mut buf).await;
    if buf.is_empty() {
        return Err(format!("no response: {read:?}"));
    }
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status line in {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok(Reply {
        status,
        body,
        peer_certificate: None,
    })
}
