//! The gRPC server on a Unix socket, with every RPC timed, counted and logged.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;

use crate::controller::ControllerService;
use crate::csi::controller_server::ControllerServer;
use crate::csi::identity_server::IdentityServer;
use crate::csi::node_server::NodeServer;
use crate::identity::IdentityService;
use crate::metrics::CsiMetrics;
use crate::node::NodeService;

/// Largest request the server decodes; CSI requests are a few KiB at most.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// Server failures.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The socket path holds something that is not a socket.
    #[error("{0} exists and is not a socket; refusing to remove it")]
    NotASocket(PathBuf),
    /// Socket setup.
    #[error("{op} {path}: {source}")]
    Socket {
        /// What was being done.
        op: &'static str,
        /// The socket.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("serving CSI on {path}: {source}")]
    Serve {
        /// The socket.
        path: PathBuf,
        /// Why.
        source: tonic::transport::Error,
    },
}

/// Binds `socket` (removing a stale socket a previous instance left), mode 0600.
pub fn bind(socket: &Path) -> Result<UnixListener, ServerError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let err = |op| {
        move |source| ServerError::Socket {
            op,
            path: socket.to_path_buf(),
            source,
        }
    };
    match std::fs::symlink_metadata(socket) {
        Ok(m) if m.file_type().is_socket() => {
            tracing::info!(socket = %socket.display(), "removing stale socket");
            std::fs::remove_file(socket).map_err(err("removing"))?;
        }
        Ok(_) => return Err(ServerError::NotASocket(socket.to_path_buf())),
        Err(_) => {}
    }
    if let Some(parent) = socket.parent() {
        std::fs::create_dir_all(parent).map_err(err("creating the directory of"))?;
    }
    let listener = UnixListener::bind(socket).map_err(err("binding"))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .map_err(err("setting the mode of"))?;
    Ok(listener)
}

/// Serves the three CSI services on `listener` until `shutdown`, then lets in-flight RPCs
/// finish and removes the socket.
pub async fn serve(
    listener: UnixListener,
    socket: &Path,
    identity: IdentityService,
    controller: ControllerService,
    node: NodeService,
    metrics: CsiMetrics,
    shutdown: CancellationToken,
) -> Result<(), ServerError> {
    tracing::info!(socket = %socket.display(), "serving CSI");
    let result = tonic::transport::Server::builder()
        .layer(ObserveLayer { metrics })
        .add_service(IdentityServer::new(identity).max_decoding_message_size(MAX_REQUEST_BYTES))
        .add_service(ControllerServer::new(controller).max_decoding_message_size(MAX_REQUEST_BYTES))
        .add_service(NodeServer::new(node).max_decoding_message_size(MAX_REQUEST_BYTES))
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(listener),
            shutdown.cancelled_owned(),
        )
        .await;
    let _ = std::fs::remove_file(socket);
    result.map_err(|source| ServerError::Serve {
        path: socket.to_path_buf(),
        source,
    })
}

/// Times, counts and logs every RPC.
#[derive(Clone, Debug)]
pub struct ObserveLayer {
    metrics: CsiMetrics,
}

impl<S> tower::Layer<S> for ObserveLayer {
    type Service = Observe<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Observe {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

/// The service [`ObserveLayer`] wraps around the CSI services.
#[derive(Clone, Debug)]
pub struct Observe<S> {
    inner: S,
    metrics: CsiMetrics,
}

/// Polled often by sidecars and kubelet; logged at debug level only.
fn chatty(method: &str) -> bool {
    method.ends_with("/Probe")
        || method.ends_with("/GetCapacity")
        || method.ends_with("Capabilities")
        || method.ends_with("/GetPluginInfo")
        || method.ends_with("/NodeGetInfo")
}

impl<S, B, RB> tower::Service<http::Request<B>> for Observe<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>> + Send,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let method = request.uri().path().to_string();
        let start = Instant::now();
        let future = self.inner.call(request);
        let metrics = self.metrics.clone();
        Box::pin(async move {
            let response = future.await;
            // Errors of unary calls travel as trailers-only responses: the status is in the
            // headers. A success keeps it in the trailers, and no header means OK.
            let (code, message) = match &response {
                Ok(r) => (
                    r.headers()
                        .get("grpc-status")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<i32>().ok())
                        .map_or(tonic::Code::Ok, tonic::Code::from),
                    r.headers()
                        .get("grpc-message")
                        .and_then(|v| v.to_str().ok())
                        .map(percent_decode)
                        .unwrap_or_default(),
                ),
                Err(_) => (tonic::Code::Unknown, "transport error".to_string()),
            };
            let elapsed = start.elapsed();
            metrics.observe(&method, code, elapsed);
            let status = crate::metrics::code_name(code);
            if chatty(&method) && code == tonic::Code::Ok {
                tracing::debug!(method, status, ?elapsed, "rpc");
            } else if code == tonic::Code::Ok {
                tracing::info!(method, status, ?elapsed, "rpc");
            } else {
                tracing::warn!(method, status, ?elapsed, message, "rpc failed");
            }
            response
        })
    }
}

/// gRPC percent-encodes `grpc-message`.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Some(b) = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decode_table() {
        for (input, want) in [
            ("plain", "plain"),
            ("a%20b", "a b"),
            ("100%25", "100%"),
            ("bad%zz", "bad%zz"),
            ("end%2", "end%2"),
        ] {
            assert_eq!(percent_decode(input), want, "{input}");
        }
    }

    #[test]
    fn chatty_table() {
        for (method, want) in [
            ("/csi.v1.Identity/Probe", true),
            ("/csi.v1.Controller/GetCapacity", true),
            ("/csi.v1.Node/NodeGetCapabilities", true),
            ("/csi.v1.Controller/CreateVolume", false),
            ("/csi.v1.Node/NodeStageVolume", false),
        ] {
            assert_eq!(chatty(method), want, "{method}");
        }
    }
}
