//! The driver processes of simulated nodes: per node a supervised `pmem-csi node` and a
//! supervised csi-provisioner in node-deployment mode, as the node DaemonSet runs them; the
//! node's CSINode lists the driver once the driver serves, as node-driver-registrar and kubelet
//! would arrange.

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::storage::v1::CSINode;
use kube::Api;
use kube::api::PostParams;

use crate::node_driver::{self, NodeDriverDirs};
use crate::nodes::NodeSpec;
use crate::process::{ProcessSpec, Supervised};
use crate::tools::Tools;
use crate::wait::Timeout;

/// Namespace of the driver's objects (capacity, heartbeats) in testenv.
pub const DRIVER_NAMESPACE: &str = "pmem-csi";

/// How simulated nodes run the driver.
#[derive(Clone, Debug)]
pub struct DriverOptions {
    /// `--device-mode`: `emulated` or `fake`.
    pub device_mode: String,
    /// `--emulated-size` of every node.
    pub size: String,
    /// Extra flags for `pmem-csi node`.
    pub extra_args: Vec<String>,
    /// Extra environment of `pmem-csi node` (test hooks such as `PMEM_CSI_TEST_DELAY`).
    pub env: Vec<(String, String)>,
    /// Connect each node's processes through a [`crate::proxy::TcpProxy`] that tests can cut.
    pub partitionable: bool,
}

impl Default for DriverOptions {
    fn default() -> Self {
        Self {
            device_mode: "emulated".into(),
            size: "1Gi".into(),
            extra_args: Vec::new(),
            env: Vec::new(),
            partitionable: false,
        }
    }
}

/// The processes of one node.
#[derive(Debug)]
pub struct NodeProcesses {
    /// Node name.
    pub node: String,
    /// Where the driver keeps its files.
    pub dirs: NodeDriverDirs,
    /// `pmem-csi node`.
    pub driver: Supervised,
    /// `csi-provisioner --node-deployment`.
    pub provisioner: Supervised,
}

/// Failures starting a node's processes.
#[derive(Debug, thiserror::Error)]
pub enum NodeProcessesError {
    /// The driver did not come up.
    #[error("driver of {node} did not serve: {source}")]
    Driver {
        /// Node.
        node: String,
        /// Why.
        source: Timeout,
    },
    /// The CSINode could not be updated.
    #[error("registering the driver in CSINode {node}: {source}")]
    CsiNode {
        /// Node.
        node: String,
        /// Why.
        source: kube::Error,
    },
}

/// Arguments of `pmem-csi node` for `node` as testenv runs it.
pub fn driver_args(node: &str, dirs: &NodeDriverDirs, options: &DriverOptions) -> Vec<String> {
    let mut args = vec![
        "node".to_string(),
        format!("--endpoint=unix://{}", dirs.socket.display()),
        format!("--node-id={node}"),
        format!("--device-mode={}", options.device_mode),
        format!("--emulated-size={}", options.size),
        format!("--state-dir={}", dirs.state.display()),
        format!("--namespace={DRIVER_NAMESPACE}"),
        "--heartbeat-period=1s".into(),
    ];
    if options.device_mode == "emulated" {
        args.push(format!("--emulated-dir={}", dirs.region.display()));
    }
    if !options
        .extra_args
        .iter()
        .any(|a| a.starts_with("--admin-address"))
    {
        args.push("--admin-address=127.0.0.1:0".into());
    }
    args.extend(options.extra_args.iter().cloned());
    args
}

/// Arguments of csi-provisioner in node-deployment mode (tests keep immediate binding on with
/// a 1 s base delay; no `--enable-capacity`: the driver publishes capacity itself).
pub fn provisioner_args(socket: &Path, kubeconfig: &Path) -> Vec<String> {
    vec![
        format!("--csi-address={}", socket.display()),
        format!("--kubeconfig={}", kubeconfig.display()),
        "--node-deployment=true".into(),
        "--strict-topology=true".into(),
        "--immediate-topology=false".into(),
        "--feature-gates=Topology=true".into(),
        "--extra-create-metadata=true".into(),
        "--timeout=30s".into(),
        "--node-deployment-base-delay=1s".into(),
        "--node-deployment-max-delay=5s".into(),
        "--leader-election=false".into(),
        "--v=3".into(),
    ]
}

/// What every node's processes share.
#[derive(Clone)]
pub struct NodeLauncher {
    /// Admin client (CSINode updates).
    pub client: kube::Client,
    /// The binaries.
    pub tools: Tools,
    /// The testenv's work directory.
    pub root: std::path::PathBuf,
    /// Kubeconfig the processes use.
    pub kubeconfig: std::path::PathBuf,
    /// Driver name.
    pub driver_name: String,
    /// How the driver runs.
    pub options: DriverOptions,
}

impl DriverOptions {
    /// The fake backend with a region of `size` and extra flags.
    pub fn fake(size: &str, extra_args: &[&str]) -> Self {
        Self {
            device_mode: "fake".into(),
            size: size.into(),
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            env: Vec::new(),
            partitionable: false,
        }
    }
}

impl NodeLauncher {
    /// Starts the processes of `node` and registers the driver in its CSINode once it serves;
    /// they reach the apiserver with `kubeconfig` (the launcher's when `None`).
    pub async fn start(
        &self,
        node: &NodeSpec,
        kubeconfig: Option<&Path>,
        supervise: impl Fn(ProcessSpec) -> Supervised,
    ) -> Result<NodeProcesses, NodeProcessesError> {
        let kubeconfig = kubeconfig.unwrap_or(&self.kubeconfig);
        let dirs = NodeDriverDirs::under(&self.root.join("nodes").join(&node.name));
        let mut spec = ProcessSpec::new(
            format!("{}/pmem-csi", node.name),
            self.tools.pmem_csi(),
            format!("{}-pmem-csi.log", node.name),
        )
        .args(driver_args(&node.name, &dirs, &self.options))
        .env("KUBECONFIG", kubeconfig);
        for (k, v) in &self.options.env {
            spec = spec.env(k, v);
        }
        let driver = supervise(spec);
        node_driver::wait_for_path(&dirs.socket, Duration::from_secs(60))
            .await
            .map_err(|source| NodeProcessesError::Driver {
                node: node.name.clone(),
                source,
            })?;
        if node.csinode_driver {
            register(&self.client, &self.driver_name, &node.name)
                .await
                .map_err(|source| NodeProcessesError::CsiNode {
                    node: node.name.clone(),
                    source,
                })?;
        }
        let provisioner = supervise(
            ProcessSpec::new(
                format!("{}/csi-provisioner", node.name),
                self.tools.go("csi-provisioner"),
                format!("{}-csi-provisioner.log", node.name),
            )
            .args(provisioner_args(&dirs.socket, kubeconfig))
            .env("NODE_NAME", &node.name),
        );
        Ok(NodeProcesses {
            node: node.name.clone(),
            dirs,
            driver,
            provisioner,
        })
    }
}

/// Adds the driver to the node's CSINode, as kubelet does after registration.
pub async fn register(
    client: &kube::Client,
    driver_name: &str,
    node: &str,
) -> Result<(), kube::Error> {
    let api = Api::<CSINode>::all(client.clone());
    let wanted = NodeSpec::with_driver(node).csi_node(driver_name);
    match api.get_opt(node).await? {
        None => api
            .create(&PostParams::default(), &wanted)
            .await
            .map(|_| ()),
        Some(mut existing) => {
            if existing.spec.drivers.iter().any(|d| d.name == driver_name) {
                return Ok(());
            }
            existing.spec.drivers.extend(wanted.spec.drivers);
            api.replace(node, &PostParams::default(), &existing)
                .await
                .map(|_| ())
        }
    }
}

/// Removes the driver from the node's CSINode, as kubelet does when the plugin goes away.
pub async fn unregister(
    client: &kube::Client,
    driver_name: &str,
    node: &str,
) -> Result<(), kube::Error> {
    let api = Api::<CSINode>::all(client.clone());
    if let Some(mut existing) = api.get_opt(node).await? {
        existing.spec.drivers.retain(|d| d.name != driver_name);
        api.replace(node, &PostParams::default(), &existing).await?;
    }
    Ok(())
}
