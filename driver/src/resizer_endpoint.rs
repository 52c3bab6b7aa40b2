//! The CSI endpoint the one central csi-resizer talks to, served by `pmem-csi controller`:
//! identity, and capabilities that say that volumes grow on their node only. external-resizer
//! then takes its "trivial resizer" path — it raises the PV's size and marks the claim's file
//! system for resizing, and kubelet calls NodeExpandVolume on the volume's node — so it needs
//! no per-node instance (upstream has no node-deployment mode) and no volume of ours ever
//! passes through this endpoint. Every other call answers Unimplemented.
//!
//! external-resizer v2 requires, at start: Probe; GetPluginInfo; the CONTROLLER_SERVICE plugin
//! capability; ControllerGetCapabilities without EXPAND_VOLUME (and without MODIFY_VOLUME);
//! NodeGetCapabilities with EXPAND_VOLUME on the same socket.

use std::path::{Path, PathBuf};

use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::csi::controller_server::{Controller, ControllerServer};
use crate::csi::identity_server::{Identity, IdentityServer};
use crate::csi::node_server::{Node, NodeServer};
use crate::csi::node_service_capability::{self, rpc};
use crate::csi::plugin_capability::{self, service, volume_expansion};
use crate::csi::*;
use crate::server::{MAX_REQUEST_BYTES, ServerError};

/// `--resizer-endpoint` of `pmem-csi controller`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct ResizerArgs {
    /// Serve the CSI endpoint for csi-resizer on this Unix socket (`unix:///path`); off when
    /// not given.
    #[arg(long = "resizer-endpoint", value_parser = unix_socket)]
    pub resizer_endpoint: Option<PathBuf>,
}

/// Parses `unix:///absolute/path`.
fn unix_socket(value: &str) -> Result<PathBuf, String> {
    value
        .strip_prefix("unix://")
        .filter(|p| p.starts_with('/'))
        .map(PathBuf::from)
        .ok_or_else(|| format!("{value:?} is not unix:///absolute/path"))
}

/// The endpoint, bound to its socket.
#[derive(Debug)]
pub struct ResizerEndpoint {
    listener: UnixListener,
    socket: PathBuf,
    service: ResizerService,
}

impl ResizerEndpoint {
    /// Binds `socket` (a stale socket is removed) for driver `driver_name`.
    pub fn bind(socket: &Path, driver_name: &str) -> Result<Self, ServerError> {
        Ok(Self {
            listener: crate::server::bind(socket)?,
            socket: socket.to_path_buf(),
            service: ResizerService {
                driver_name: driver_name.to_string(),
            },
        })
    }

    /// Serves until `shutdown`, then removes the socket.
    pub async fn serve(self, shutdown: CancellationToken) -> Result<(), ServerError> {
        tracing::info!(socket = %self.socket.display(), "serving the CSI endpoint for csi-resizer");
        let result = tonic::transport::Server::builder()
            .add_service(
                IdentityServer::new(self.service.clone())
                    .max_decoding_message_size(MAX_REQUEST_BYTES),
            )
            .add_service(
                ControllerServer::new(self.service.clone())
                    .max_decoding_message_size(MAX_REQUEST_BYTES),
            )
            .add_service(NodeServer::new(self.service).max_decoding_message_size(MAX_REQUEST_BYTES))
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(self.listener),
                shutdown.cancelled_owned(),
            )
            .await;
        let _ = std::fs::remove_file(&self.socket);
        result.map_err(|source| ServerError::Serve {
            path: self.socket,
            source,
        })
    }
}

/// The three services of the endpoint.
#[derive(Clone, Debug)]
struct ResizerService {
    driver_name: String,
}

#[tonic::async_trait]
impl Identity for ResizerService {
    async fn get_plugin_info(
        &self,
        _request: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: self.driver_name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _request: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: vec![
                PluginCapability {
                    r#type: Some(plugin_capability::Type::Service(
                        plugin_capability::Service {
                            r#type: service::Type::ControllerService as i32,
                        },
                    )),
                },
                PluginCapability {
                    r#type: Some(plugin_capability::Type::VolumeExpansion(
                        plugin_capability::VolumeExpansion {
                            r#type: volume_expansion::Type::Online as i32,
                        },
                    )),
                },
            ],
        }))
    }

    async fn probe(
        &self,
        _request: Request<ProbeRequest>,
    ) -> Result<Response<ProbeResponse>, Status> {
        Ok(Response::new(ProbeResponse { ready: Some(true) }))
    }
}

#[tonic::async_trait]
impl Controller for ResizerService {
    async fn controller_get_capabilities(
        &self,
        _request: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        // No EXPAND_VOLUME: that is what makes external-resizer leave the growth to the node.
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities: Vec::new(),
        }))
    }
}

#[tonic::async_trait]
impl Node for ResizerService {
    async fn node_get_capabilities(
        &self,
        _request: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(NodeGetCapabilitiesResponse {
            capabilities: vec![NodeServiceCapability {
                r#type: Some(node_service_capability::Type::Rpc(
                    node_service_capability::Rpc {
                        r#type: rpc::Type::ExpandVolume as i32,
                    },
                )),
            }],
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_flag_table() {
        for (value, want) in [
            ("unix:///run/csi/resizer.sock", Ok("/run/csi/resizer.sock")),
            ("unix://relative.sock", Err("is not unix:///absolute/path")),
            ("/run/csi/resizer.sock", Err("is not unix:///absolute/path")),
            ("tcp://1.2.3.4:5", Err("is not unix:///absolute/path")),
        ] {
            match (unix_socket(value), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, PathBuf::from(want), "{value}"),
                (Err(e), Err(want)) => assert!(e.contains(want), "{value}: {e}"),
                (got, want) => panic!("{value}: got {got:?}, want {want:?}"),
            }
        }
    }
}
