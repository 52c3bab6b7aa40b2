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
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            until,
        )
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
