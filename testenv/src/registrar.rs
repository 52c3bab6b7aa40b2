//! A node-driver registrar for real-node test clusters: the Go module proxy does not serve
//! kubernetes-csi/node-driver-registrar, so the image the DaemonSet's `driver-registrar`
//! container runs there is this, with the same flags (`--csi-address`,
//! `--kubelet-registration-path`, `--timeout`, `--http-endpoint`). It asks the driver its name,
//! serves kubelet's plugin registration API on `<registration-dir>/<driver>-reg.sock`, and
//! answers `/healthz` only while that socket exists (kubelet's plugin watcher removes nothing,
//! but a lost registration directory must make the pod restart, as upstream's does).
//!
//! Test-only by choice: users run upstream's image, which the manifests name; shipping a second
//! registrar would be one more component to keep without a user asking for it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// Generated from `proto/pluginregistration.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod api {
    tonic::include_proto!("pluginregistration");
}

/// What kubelet is told about the plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// The CSI driver name (from the driver's GetPluginInfo).
    pub driver: String,
    /// The driver's socket as kubelet sees it.
    pub endpoint: String,
}

impl Registration {
    /// The socket name in kubelet's plugins_registry directory, as node-driver-registrar
    /// names it.
    pub fn socket_name(&self) -> String {
        format!("{}-reg.sock", self.driver)
    }

    /// The answer to kubelet's GetInfo.
    pub fn info(&self) -> api::PluginInfo {
        api::PluginInfo {
            r#type: "CSIPlugin".into(),
            name: self.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: vec!["1.0.0".into()],
        }
    }
}

/// Why the registrar stopped.
#[derive(Debug, thiserror::Error)]
pub enum RegistrarError {
    /// The driver did not answer GetPluginInfo in time.
    #[error("driver at {socket} did not answer GetPluginInfo within {timeout:?}: {last}")]
    Driver {
        /// The CSI socket.
        socket: PathBuf,
        /// How long we tried.
        timeout: Duration,
        /// The last error.
        last: String,
    },
    /// Socket or HTTP I/O.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        source: std::io::Error,
    },
    /// kubelet refused the registration.
    #[error("kubelet refused the registration of {driver}: {error}")]
    Refused {
        /// Driver name.
        driver: String,
        /// kubelet's reason.
        error: String,
    },
    /// The gRPC server failed.
    #[error("registration server: {0}")]
    Server(#[from] tonic::transport::Error),
}

/// Asks the driver on `socket` its name, retrying until `timeout`: the driver container may
/// start after this one.
pub async fn driver_name(socket: &Path, timeout: Duration) -> Result<String, RegistrarError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let attempt = async {
            let channel = driver::client::connect(socket.to_path_buf())
                .await
                .map_err(|e| e.to_string())?;
            let mut identity = driver::csi::identity_client::IdentityClient::new(channel);
            identity
                .get_plugin_info(driver::csi::GetPluginInfoRequest {})
                .await
                .map(|r| r.into_inner().name)
                .map_err(|e| e.to_string())
        };
        let last = match tokio::time::timeout(Duration::from_secs(5), attempt).await {
            Ok(Ok(name)) if !name.is_empty() => return Ok(name),
            Ok(Ok(_)) => "empty driver name".to_string(),
            Ok(Err(e)) => e,
            Err(_) => "GetPluginInfo timed out".to_string(),
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(RegistrarError::Driver {
                socket: socket.to_path_buf(),
                timeout,
                last,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

struct Service {
    registration: Registration,
    refused: tokio::sync::mpsc::Sender<String>,
}

#[tonic::async_trait]
impl api::registration_server::Registration for Service {
    async fn get_info(
        &self,
        _: tonic::Request<api::InfoRequest>,
    ) -> Result<tonic::Response<api::PluginInfo>, tonic::Status> {
        tracing::info!(driver = self.registration.driver, "kubelet asked GetInfo");
        Ok(tonic::Response::new(self.registration.info()))
    }

    async fn notify_registration_status(
        &self,
        request: tonic::Request<api::RegistrationStatus>,
    ) -> Result<tonic::Response<api::RegistrationStatusResponse>, tonic::Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(driver = self.registration.driver, "registered with kubelet");
        } else {
            tracing::error!(
                driver = self.registration.driver,
                error = status.error,
                "kubelet refused the registration"
            );
            let _ = self.refused.try_send(status.error);
        }
        Ok(tonic::Response::new(api::RegistrationStatusResponse {}))
    }
}

/// Serves the registration on `dir`/`<driver>-reg.sock` (and `/healthz` on `http`, if given)
/// until `stop`; removes the socket when it stops. kubelet refusing the registration ends it with
/// an error, so that the container restarts, as upstream's registrar does.
pub async fn serve(
    registration: Registration,
    dir: PathBuf,
    http: Option<std::net::SocketAddr>,
    stop: CancellationToken,
) -> Result<(), RegistrarError> {
    let socket = dir.join(registration.socket_name());
    let io = |what: String| move |source| RegistrarError::Io { what, source };
    match std::fs::remove_file(&socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(format!("removing stale {}", socket.display()))(e)),
    }
    let listener = tokio::net::UnixListener::bind(&socket)
        .map_err(io(format!("listening on {}", socket.display())))?;
    tracing::info!(socket = %socket.display(), driver = registration.driver, "registration socket ready");
    if let Some(addr) = http {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(io(format!("listening on {addr}")))?;
        tokio::spawn(health(listener, socket.clone(), stop.clone()));
    }
    let (refused_tx, mut refused_rx) = tokio::sync::mpsc::channel(1);
    let driver_name = registration.driver.clone();
    let service = Service {
        registration,
        refused: refused_tx,
    };
    let refused = CancellationToken::new();
    let reason = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
    {
        let refused = refused.clone();
        let reason = reason.clone();
        tokio::spawn(async move {
            if let Some(error) = refused_rx.recv().await {
                *reason
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(error);
                refused.cancel();
            }
        });
    }
    let until = {
        let stop = stop.clone();
        let refused = refused.clone();
        async move {
            tokio::select! {
                () = stop.cancelled() => {}
                () = refused.cancelled() => {}
            }
        }
    };
    let served = tonic::transport::Server::builder()
        .add_service(api::registration_server::RegistrationServer::new(service))
        .serve_with_incoming_shutdown(authority_fixed(listener), until)
        .await;
    let _ = std::fs::remove_file(&socket);
    served?;
    if refused.is_cancelled() {
        let error = reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .unwrap_or_default();
        return Err(RegistrarError::Refused {
            driver: driver_name,
            error,
        });
    }
    Ok(())
}

/// kubelet's plugin watcher dials the registration socket with its bare path as the gRPC target
/// (pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go `dial`, unlike its CSI
/// client, which sets `grpc.WithAuthority("localhost")`), so grpc-go sends that path as
/// `:authority`. h2 refuses it ("malformed authority") with RST_STREAM PROTOCOL_ERROR, and
/// kubelet never registers the driver. Each accepted connection therefore passes through a pump
/// that rewrites the `:authority` of every HEADERS frame to `localhost` before tonic reads it.
fn authority_fixed(
    listener: tokio::net::UnixListener,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<tokio::io::DuplexStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                () = tx.closed() => return,
                accepted = listener.accept() => accepted,
            };
            let (unix, _) = match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    continue;
                }
            };
            let (ours, theirs) = tokio::io::duplex(64 * 1024);
            if tx.send(Ok(theirs)).await.is_err() {
                return;
            }
            tokio::spawn(async move {
                let (mut unix_read, mut unix_write) = unix.into_split();
                let (mut duplex_read, mut duplex_write) = tokio::io::split(ours);
                let inbound = async {
                    let result = rewrite_authority(&mut unix_read, &mut duplex_write).await;
                    let _ = duplex_write.shutdown().await;
                    result
                };
                let outbound = async {
                    let result = tokio::io::copy(&mut duplex_read, &mut unix_write).await;
                    let _ = unix_write.shutdown().await;
                    result.map(|_| ())
                };
                let _ = tokio::join!(inbound, outbound);
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Copies an HTTP/2 client stream frame by frame, re-encoding `:authority` (static table index
/// 1, any literal representation) in HEADERS frames that carry a whole header block.
async fn rewrite_authority<R, W>(from: &mut R, to: &mut W) -> std::io::Result<()>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    let mut preface = [0u8; 24];
    from.read_exact(&mut preface).await?;
    to.write_all(&preface).await?;
    loop {
        let mut head = [0u8; 9];
        match from.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; len];
        from.read_exact(&mut payload).await?;
        // HEADERS with END_HEADERS
        if head[3] == 0x1
            && head[4] & 0x4 != 0
            && let Some(fixed) = fixed_headers(head[4], &payload)
        {
            let n = fixed.len() as u32;
            head[..3].copy_from_slice(&n.to_be_bytes()[1..]);
            payload = fixed;
        }
        to.write_all(&head).await?;
        to.write_all(&payload).await?;
    }
}

/// HPACK integer with an `n`-bit prefix at `block[*at]`.
fn hpack_int(block: &[u8], at: &mut usize, n: u8) -> Option<usize> {
    let max = (1usize << n) - 1;
    let mut value = (*block.get(*at)? as usize) & max;
    *at += 1;
    if value < max {
        return Some(value);
    }
    let mut shift = 0;
    loop {
        let b = *block.get(*at)?;
        *at += 1;
        value += ((b & 0x7f) as usize) << shift;
        shift += 7;
        if b & 0x80 == 0 || shift > 28 {
            return Some(value);
        }
    }
}

/// The HEADERS payload with `:authority` replaced by `localhost`; None when it has none (or
/// cannot be parsed: then it passes unchanged).
fn fixed_headers(flags: u8, payload: &[u8]) -> Option<Vec<u8>> {
    let mut start = 0;
    let mut end = payload.len();
    if flags & 0x8 != 0 {
        // PADDED
        end = end.checked_sub(*payload.first()? as usize)?;
        start += 1;
    }
    if flags & 0x20 != 0 {
        // PRIORITY
        start += 5;
    }
    let block = payload.get(start..end)?;
    let mut at = 0;
    let mut out = Vec::with_capacity(block.len());
    let mut changed = false;
    while at < block.len() {
        let first = at;
        let b = block[at];
        if b & 0x80 != 0 {
            hpack_int(block, &mut at, 7)?;
            out.extend_from_slice(&block[first..at]);
            continue;
        }
        if b & 0xe0 == 0x20 {
            hpack_int(block, &mut at, 5)?;
            out.extend_from_slice(&block[first..at]);
            continue;
        }
        let prefix = if b & 0xc0 == 0x40 { 6 } else { 4 };
        let index = hpack_int(block, &mut at, prefix)?;
        if index == 0 {
            let name_len = hpack_int(block, &mut at, 7)?;
            at = at.checked_add(name_len)?;
        }
        let name_end = at;
        let value_len = hpack_int(block, &mut at, 7)?;
        at = at.checked_add(value_len)?;
        if at > block.len() {
            return None;
        }
        out.extend_from_slice(&block[first..name_end]);
        if index == 1 {
            out.push(9);
            out.extend_from_slice(b"localhost");
            changed = true;
        } else {
            out.extend_from_slice(&block[name_end..at]);
        }
    }
    if !changed {
        return None;
    }
    let mut fixed = Vec::with_capacity(start + out.len());
    if flags & 0x8 != 0 {
        fixed.push(0); // padding dropped
        fixed.extend_from_slice(&payload[1..start]);
    } else {
        fixed.extend_from_slice(&payload[..start]);
    }
    fixed.extend_from_slice(&out);
    Some(fixed)
}

/// `/healthz`: 200 while the registration socket exists, 503 once it is gone.
async fn health(listener: tokio::net::TcpListener, socket: PathBuf, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((mut stream, _)) = accepted else {
            continue;
        };
        let socket = socket.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1024];
            let _ = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await;
            let (status, body) = if socket.exists() {
                ("200 OK", "ok".to_string())
            } else {
                (
                    "503 Service Unavailable",
                    format!("registration socket {} is gone", socket.display()),
                )
            };
            let reply = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(reply.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::registration_client::RegistrationClient;

    #[tokio::test]
    async fn kubelet_sees_the_plugin_and_a_refusal_ends_the_registrar() {
        let dir = tempfile::tempdir().expect("tempdir");
        let registration = Registration {
            driver: "pmem-csi.intel.com".into(),
            endpoint: "/var/lib/kubelet/plugins/pmem-csi.intel.com/csi.sock".into(),
        };
        let port = crate::ports::free_port().expect("port");
        let http = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve(
            registration.clone(),
            dir.path().to_path_buf(),
            Some(http),
            stop.clone(),
        ));
        let socket = dir.path().join("pmem-csi.intel.com-reg.sock");
        crate::node_driver::wait_for_path(&socket, Duration::from_secs(10))
            .await
            .expect("socket");
        let channel = driver::client::connect(socket.clone())
            .await
            .expect("connect");
        let mut kubelet = RegistrationClient::new(channel);
        let info = kubelet
            .get_info(api::InfoRequest {})
            .await
            .expect("GetInfo")
            .into_inner();
        assert_eq!(info, registration.info());
        assert_eq!(info.r#type, "CSIPlugin");
        let health = crate::http_client::http(http, "GET", "/healthz", b"")
            .await
            .expect("healthz");
        assert_eq!(health.status, 200, "{}", health.body);
        kubelet
            .notify_registration_status(api::RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            })
            .await
            .expect("notify");
        assert!(!server.is_finished());
        kubelet
            .notify_registration_status(api::RegistrationStatus {
                plugin_registered: false,
                error: "version 0.3 not supported".into(),
            })
            .await
            .expect("notify");
        let ended = tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("registrar ends")
            .expect("join");
        assert!(
            matches!(&ended, Err(RegistrarError::Refused { error, .. }) if error == "version 0.3 not supported"),
            "{ended:?}"
        );
        assert!(!socket.exists(), "socket left behind");
        let health = crate::http_client::http(http, "GET", "/healthz", b"")
            .await
            .expect("healthz");
        assert_eq!(health.status, 503, "{}", health.body);
        stop.cancel();
    }
}
