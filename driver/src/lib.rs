//! The pmem-csi node driver: CSI Identity, node-local Controller and Node services over a Unix
//! socket, the device backends, and crash-safe node state in PMEM-CSI 1.0's format.

pub mod backend;
pub mod block_device;
pub mod capability;
#[cfg(feature = "test-hooks")]
pub mod client;
pub mod config;
pub mod controller;
pub mod csi;
pub mod device_mode;
pub mod direct;
pub mod emulated;
pub mod error;
pub mod fake;
pub mod faults;
pub mod filesystem;
pub mod identity;
pub mod loopdev;
pub mod lvm;
pub mod metrics;
pub mod mount_options;
pub mod mounts;
pub mod ndctl;
pub mod node;
pub mod parameters;
pub mod program;
pub mod repair;
pub mod resizer_endpoint;
pub mod server;
pub mod state;
pub mod tool;
pub mod volume_id;
pub mod volumes;

use std::sync::Arc;

use controllers::capacity_publisher::{CapacityPublisher, Publisher};
use controllers::concern::Concern;
use controllers::heartbeat;
use controllers::orphan_sweep::{OrphanMetrics, OrphanSweep};
use controllers::readiness::ReadyFlag;
use controllers::reconcile_metrics::ReconcileMetrics;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

pub use config::{ConfigError, NodeArgs, NodeConfig};

/// Why the node driver could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// Flags.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Backend set-up.
    #[error("setting up the {mode} backend: {source}")]
    Backend {
        /// The mode.
        mode: &'static str,
        /// Why.
        source: backend::BackendError,
    },
    /// State or repair.
    #[error("loading node state from {dir}: {source}")]
    State {
        /// State directory.
        dir: std::path::PathBuf,
        /// Why.
        source: Box<error::VolumeError>,
    },
    /// The gRPC server.
    #[error(transparent)]
    Server(#[from] server::ServerError),
    /// No client for the Kubernetes API.
    #[error("connecting to the apiserver{for_what} (use --standalone to run without it): {source}")]
    Client {
        /// Which client.
        for_what: &'static str,
        /// Why.
        source: kube::Error,
    },
}

/// The backend of another device mode, for volumes recorded in it: lvm and direct live on the
/// node's PMEM whatever mode runs now; an emulated region's directory and size, and a fake
/// backend's memory, are known only to the driver that ran them.
fn open_other_mode(
    mode: backend::DeviceMode,
) -> Result<Arc<dyn backend::Backend>, backend::BackendError> {
    match mode {
        backend::DeviceMode::Lvm => Ok(Arc::new(lvm::Lvm::existing()?)),
        backend::DeviceMode::Direct => Ok(Arc::new(direct::Direct::new()?)),
        backend::DeviceMode::Emulated | backend::DeviceMode::Fake => {
            Err(backend::BackendError::io(
                "opening",
                format!("device mode {}", mode.as_str()),
                "its volumes are reachable only from a driver running that mode",
            ))
        }
    }
}

/// A node driver with its state loaded and repaired, its socket bound, ready to serve.
pub struct NodeDriver {
    config: NodeConfig,
    volumes: Arc<volumes::Volumes>,
    metrics: metrics::CsiMetrics,
    listener: tokio::net::UnixListener,
}

impl std::fmt::Debug for NodeDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeDriver")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl NodeDriver {
    /// Opens the backend and state (repairing what a crash left), registers the metrics in
    /// `registry` and binds the socket.
    pub fn start(config: NodeConfig, registry: &mut Registry) -> Result<Self, DriverError> {
        tool::set_timeout(config.tool_timeout);
        let backend: Arc<dyn backend::Backend> =
            match config.device_mode {
                backend::DeviceMode::Emulated => {
                    let dir = config.emulated_dir.clone().unwrap_or_default();
                    Arc::new(emulated::Emulated::new(dir, config.emulated_size).map_err(
                        |source| DriverError::Backend {
                            mode: "emulated",
                            source,
                        },
                    )?)
                }
                backend::DeviceMode::Fake => Arc::new(fake::Fake::new(config.emulated_size)),
                backend::DeviceMode::Lvm => {
                    Arc::new(lvm::Lvm::new(config.pmem_percentage).map_err(|source| {
                        DriverError::Backend {
                            mode: "lvm",
                            source,
                        }
                    })?)
                }
                backend::DeviceMode::Direct => Arc::new(direct::Direct::new().map_err(
                    |source| DriverError::Backend {
                        mode: "direct",
                        source,
                    },
                )?),
            };
        let state_error = |source: error::VolumeError| DriverError::State {
            dir: config.state_dir.clone(),
            source: Box::new(source),
        };
        let state = state::StateStore::open(&config.state_dir)
            .map_err(|e| state_error(error::VolumeError::from(e)))?;
        let volumes = Arc::new(
            volumes::Volumes::open(backend, state, config.default_volume_size)
                .map_err(state_error)?
                .with_other_modes(Box::new(open_other_mode)),
        );
        let metrics = metrics::CsiMetrics::register(
            registry,
            &config.driver_name,
            &config.node_id,
            volumes.clone(),
        );
        let listener = server::bind(&config.socket)?;
        Ok(Self {
            config,
            volumes,
            metrics,
            listener,
        })
    }

    /// The node's volumes (for the capacity publisher).
    pub fn volumes(&self) -> &Arc<volumes::Volumes> {
        &self.volumes
    }

    /// The validated configuration.
    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// The node process's concerns: the CSI server and, unless `--standalone`, the capacity
    /// publisher, the heartbeat (with `--heartbeat-period` above zero) and the orphan sweep.
    /// `serving` turns ready when the CSI server starts.
    pub async fn concerns(
        self,
        registry: &mut Registry,
        serving: ReadyFlag,
    ) -> Result<Vec<Concern>, DriverError> {
        let config = self.config.clone();
        let volumes = self.volumes.clone();
        let mut concerns = vec![Concern::everywhere_fallible(
            "csi-server",
            move |token| async move {
                serving.set(true);
                self.serve(token).await
            },
        )];
        if config.standalone {
            return Ok(concerns);
        }
        let client = |for_what| move |source| DriverError::Client { for_what, source };
        let api = controllers::rate_limit::client(config.kube_api)
            .await
            .map_err(client(""))?;
        let publisher = CapacityPublisher::new(
            api.clone(),
            Publisher {
                driver: config.driver_name.clone(),
                namespace: config.namespace.clone(),
                node: config.node_id.clone(),
            },
            volumes.clone(),
            ReconcileMetrics::register(registry),
        );
        concerns.push(Concern::everywhere("capacity-publisher", move |token| {
            publisher.run(token)
        }));
        if let Some(period) = config.heartbeat_period {
            // Its own client: a node busy publishing and sweeping never delays a renewal.
            let own = controllers::rate_limit::client(heartbeat::client_budget(period))
                .await
                .map_err(client(" for the heartbeat"))?;
            let (driver, node, namespace) = (
                config.driver_name.clone(),
                config.node_id.clone(),
                config.namespace.clone(),
            );
            concerns.push(Concern::everywhere("heartbeat", move |token| {
                heartbeat::run(own, driver, node, namespace, period, token)
            }));
        }
        let sweep = OrphanSweep {
            client: api,
            driver: config.driver_name.clone(),
            node: config.node_id.clone(),
            grace: config.orphan_grace,
            period: (config.orphan_grace / 2).clamp(
                std::time::Duration::from_secs(1),
                std::time::Duration::from_secs(60),
            ),
            metrics: OrphanMetrics::register(registry),
        };
        concerns.push(Concern::everywhere("orphan-sweep", move |token| {
            sweep.run(volumes, token)
        }));
        Ok(concerns)
    }

    /// Serves CSI until `shutdown`, then lets in-flight RPCs finish.
    pub async fn serve(self, shutdown: CancellationToken) -> Result<(), DriverError> {
        let topology_key = controllers::well_known::topology_key(&self.config.driver_name);
        let identity = identity::IdentityService {
            name: self.config.driver_name.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            online_expansion: self.volumes.backend().growth_refused().is_none(),
        };
        let controller = controller::ControllerService {
            volumes: self.volumes.clone(),
            node_id: self.config.node_id.clone(),
            topology_key: topology_key.clone(),
        };
        let node = node::NodeService {
            volumes: self.volumes.clone(),
            node_id: self.config.node_id.clone(),
            topology_key,
            default_fs: self.config.default_fs_type,
        };
        server::serve(
            self.listener,
            &self.config.socket,
            identity,
            controller,
            node,
            self.metrics,
            shutdown,
        )
        .await
        .map_err(DriverError::from)
    }
}
