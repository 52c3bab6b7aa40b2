//! testenv: a real Kubernetes control plane on 127.0.0.1 for pmem-csi's integration tests and
//! demo — etcd, kube-apiserver, kube-controller-manager and kube-scheduler built from the Go
//! module proxy at pinned versions, simulated nodes, and processes supervised as kubelet would.
//! No containers, no kubelet.

pub mod api_calls;
pub mod audit;
pub mod builder;
pub mod control_plane;
pub mod controller;
pub mod csi_client;
pub mod csi_sanity;
pub mod fault_proxy;
pub mod http_client;
pub mod instance;
pub mod json_log;
pub mod kubeconfig;
pub mod kubelet;
pub mod leftovers;
pub mod manifests;
pub mod metrics;
pub mod mutations;
pub mod node_driver;
pub mod node_processes;
pub mod nodes;
pub mod pki;
pub mod ports;
pub mod process;
pub mod proxy;
pub mod registrar;
pub mod scheduler_config;
pub mod service_accounts;
pub mod tools;
pub mod wait;

mod credentials;
mod extender;
mod lifecycle;
mod our_containers;
mod running_nodes;
mod start;

use std::path::{Path, PathBuf};

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

pub use builder::TestEnvBuilder;
pub use control_plane::{ControlPlane, ControlPlaneError};
pub use leftovers::Leftovers;
pub use nodes::{DEFAULT_DRIVER_NAME, NodeSpec};
pub use process::{ProcessGroup, ProcessSpec, Supervised, SupervisedState};
pub use scheduler_config::SchedulerConfig;
pub use tools::Tools;

/// What can go wrong starting a testenv.
#[derive(Debug, thiserror::Error)]
pub enum TestEnvError {
    /// Tools are missing.
    #[error(transparent)]
    Tools(#[from] tools::ToolsError),
    /// Certificates.
    #[error(transparent)]
    Pki(#[from] pki::PkiError),
    /// The control plane.
    #[error(transparent)]
    ControlPlane(#[from] ControlPlaneError),
    /// Processes.
    #[error(transparent)]
    Process(#[from] process::ProcessError),
    /// Node objects.
    #[error(transparent)]
    Nodes(#[from] nodes::NodesError),
    /// Node processes.
    #[error(transparent)]
    NodeProcesses(#[from] node_processes::NodeProcessesError),
    /// The scheduler manifest.
    #[error(transparent)]
    SchedulerManifest(#[from] scheduler_config::ManifestError),
    /// No free port.
    #[error("finding a free port: {0}")]
    Port(#[from] std::io::Error),
    /// The manifests could not be rendered or read.
    #[error(transparent)]
    Manifests(#[from] manifests::ManifestError),
    /// The manifests' objects or ServiceAccount tokens.
    #[error(transparent)]
    ServiceAccounts(#[from] service_accounts::ServiceAccountError),
    /// The fault proxy did not start.
    #[error(transparent)]
    FaultProxy(#[from] fault_proxy::FaultProxyError),
    /// An API call during start-up.
    #[error("setting up the cluster: {0}")]
    Api(#[from] kube::Error),
    /// Something testenv waited for did not happen.
    #[error(transparent)]
    Timeout(#[from] wait::Timeout),
    /// The work directory.
    #[error("creating work directory under {parent}: {source}")]
    WorkDir {
        /// Where.
        parent: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// A running testenv. Dropping it kills every process it started; [`TestEnv::stop`] stops them
/// gracefully and removes its directory.
#[derive(Debug)]
pub struct TestEnv {
    dir: tempfile::TempDir,
    tools: Tools,
    driver_name: String,
    /// Controllers keep the manifests' `--heartbeat-grace` ([`TestEnvBuilder::shipped_heartbeat`]).
    shipped_heartbeat: bool,
    nodes: Vec<NodeSpec>,
    control_plane: Option<ControlPlane>,
    runtime: Handle,
    node_processes: std::sync::Mutex<Vec<node_processes::NodeProcesses>>,
    proxies: Vec<(String, proxy::TcpProxy)>,
    extender: Option<extender::ExtenderProcess>,
    controller: Option<controller::ControllerProcess>,
    kubelet: Option<kubelet::Kubelet>,
    /// `overlays/emulated` rendered.
    manifests_base: std::sync::Arc<manifests::Rendered>,
    /// `overlays/emulated` with the scheduler-extender and node-loss-recovery components rendered.
    manifests: std::sync::Arc<manifests::Rendered>,
    /// Kubeconfigs of the manifests' ServiceAccounts.
    accounts: service_accounts::ServiceAccountKubeconfigs,
    fault_proxy: Option<fault_proxy::FaultProxy>,
    /// Cancelled first on stop, so that no supervisor restarts what teardown kills.
    shutdown: CancellationToken,
    // Declared last: dropped after the components, so their graceful stop comes first.
    group: ProcessGroup,
}

impl TestEnv {
    /// A builder with no nodes.
    pub fn builder() -> TestEnvBuilder {
        TestEnvBuilder::default()
    }

    /// The testenv's work directory (logs, certificates, per-node state).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The tools it runs.
    pub fn tools(&self) -> &Tools {
        &self.tools
    }

    /// The driver name.
    pub fn driver_name(&self) -> &str {
        &self.driver_name
    }

    /// The simulated nodes.
    pub fn nodes(&self) -> &[NodeSpec] {
        &self.nodes
    }

    /// The process group holding every child.
    pub fn process_group_id(&self) -> i32 {
        self.group.id()
    }

    /// Starts `spec` supervised (restarted with back-off when it exits) in this testenv's
    /// process group, on the testenv's runtime. `spec.log` relative paths are under `logs/`.
    pub fn supervise(&self, mut spec: ProcessSpec) -> Supervised {
        if spec.log.is_relative() {
            spec.log = self.dir().join("logs").join(&spec.log);
        }
        let _guard = self.runtime.enter();
        Supervised::start(spec, &self.group, &self.shutdown)
    }

    /// Log files of the control plane, for failure messages.
    pub fn logs(&self) -> Vec<PathBuf> {
        self.control_plane()
            .map(ControlPlane::logs)
            .unwrap_or_default()
    }

    /// An error naming the first control-plane component that has exited.
    pub fn check_running(&mut self) -> Result<(), process::ProcessError> {
        match self.control_plane.as_mut() {
            Some(c) => c.check_running(),
            None => Ok(()),
        }
    }

    /// The rendered manifests testenv runs: `overlays/emulated` with the scheduler-extender
    /// component.
    pub fn manifests(&self) -> &manifests::Rendered {
        &self.manifests
    }

    /// `overlays/emulated` alone, as installed where the scheduler cannot be configured.
    pub fn manifests_base(&self) -> &manifests::Rendered {
        &self.manifests_base
    }

    /// `https://127.0.0.1:<port>` of kube-apiserver.
    pub fn server(&self) -> String {
        self.control_plane()
            .map(|c| c.server.clone())
            .unwrap_or_default()
    }

    /// The apiserver's audit log of our ServiceAccounts' requests.
    pub fn audit_log(&self) -> PathBuf {
        self.control_plane()
            .map(|c| c.audit_log.clone())
            .unwrap_or_default()
    }

    fn control_plane(&self) -> Option<&ControlPlane> {
        self.control_plane.as_ref()
    }

    /// Restarts control-plane component `name` (see [`ControlPlane::restart`]).
    pub async fn restart_control_plane(&self, name: &str) -> Result<(), ControlPlaneError> {
        match self.control_plane() {
            Some(c) => c.restart(name).await,
            None => Err(ControlPlaneError::Unknown(name.to_owned())),
        }
    }
}

/// Sends `signal` to `process`, or says that `what` does not run.
fn signal_running(
    process: Option<&Supervised>,
    what: impl Into<String>,
    signal: rustix::process::Signal,
) -> Result<(), process::ProcessError> {
    match process {
        Some(p) => p.signal(signal),
        None => Err(process::ProcessError::Signal {
            what: what.into(),
            source: rustix::io::Errno::SRCH,
        }),
    }
}

/// A namespace for one test, named `<prefix>-<random>`; tests sharing a testenv stay apart.
pub async fn test_namespace(client: &kube::Client, prefix: &str) -> Result<String, kube::Error> {
    use k8s_openapi::api::core::v1::Namespace;
    use kube::api::{ObjectMeta, PostParams};
    let ns = Namespace {
        metadata: ObjectMeta {
            generate_name: Some(format!("{prefix}-")),
            ..Default::default()
        },
        ..Default::default()
    };
    let created = kube::Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    Ok(created.metadata.name.unwrap_or_default())
}
