//! The driver processes of simulated nodes: per node a supervised `pmem-csi node` and a
//! supervised csi-provisioner in node-deployment mode, as the node DaemonSet runs them; the
//! node's CSINode lists the driver once the driver serves, as node-driver-registrar and kubelet
//! would arrange.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::storage::v1::CSINode;
use kube::Api;
use kube::api::PostParams;

use crate::manifests::{ManifestError, OurContainer, Overrides, PodFacts, Rendered};
use crate::node_driver::{self, NodeDriverDirs};
use crate::nodes::NodeSpec;
use crate::process::{ProcessSpec, Supervised};
use crate::tools::Tools;
use crate::wait::Timeout;

/// Namespace of the driver's objects (capacity, heartbeats): the manifests'.
pub const DRIVER_NAMESPACE: &str = crate::manifests::NAMESPACE;

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
    /// Changes to the rendered csi-provisioner command line after testenv's own (items as
    /// [`Overrides::from_args`] reads them: benchmarks compare `--kube-api-qps` settings).
    pub provisioner_args: Vec<String>,
}

impl Default for DriverOptions {
    fn default() -> Self {
        Self {
            device_mode: "emulated".into(),
            size: "1Gi".into(),
            extra_args: Vec::new(),
            env: Vec::new(),
            partitionable: false,
            provisioner_args: Vec::new(),
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
    /// The driver's admin port on 127.0.0.1 (`/metrics`).
    pub admin: u16,
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
    /// The manifests do not describe the node's containers as testenv needs.
    #[error("starting the processes of {node}: {source}")]
    Manifest {
        /// Node.
        node: String,
        /// Why.
        source: ManifestError,
    },
    /// The test asks for a test hook the driver binary was built without.
    #[error(
        "{variable} asked for, but {binary} was built without the driver's test-hooks feature \
         (cargo build --workspace, or --features test-hooks); the hook would be ignored"
    )]
    TestHooksMissing {
        /// The hook's environment variable.
        variable: String,
        /// The binary.
        binary: PathBuf,
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

/// The prefix of the driver's test hooks' environment variables (`PMEM_CSI_TEST_DELAY`, …).
const TEST_HOOK_PREFIX: &str = "PMEM_CSI_TEST_";

/// Whether `binary` contains the text `name` (a test hook reads its variable by that name).
/// Answered once per binary and name: the debug binary is some 300 MB.
fn binary_mentions(binary: &Path, name: &str) -> bool {
    type Answers = std::sync::Mutex<std::collections::HashMap<(PathBuf, String), bool>>;
    static ANSWERS: std::sync::OnceLock<Answers> = std::sync::OnceLock::new();
    let key = (binary.to_path_buf(), name.to_string());
    let answers = ANSWERS.get_or_init(Answers::default);
    if let Some(known) = answers
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .get(&key)
    {
        return *known;
    }
    let found = std::fs::read(binary)
        .map(|bytes| memchr::memmem::find(&bytes, name.as_bytes()).is_some())
        .unwrap_or(false);
    answers
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(key, found);
    found
}

/// testenv's overrides of the rendered `pmem-csi node` container for `node` (see
/// [`Overrides`]): its paths, budget and admin port, a 1 s heartbeat, then the test's own flags.
pub fn driver_overrides(dirs: &NodeDriverDirs, options: &DriverOptions) -> Overrides {
    let mut overrides = Overrides::new()
        .set("--endpoint", format!("unix://{}", dirs.socket.display()))
        .set("--device-mode", options.device_mode.clone())
        .set("--emulated-size", options.size.clone())
        .set("--state-dir", dirs.state.display().to_string())
        .set("--admin-address", "127.0.0.1:0")
        .set("--heartbeat-period", "1s");
    overrides = if options.device_mode == "emulated" {
        overrides.set("--emulated-dir", dirs.region.display().to_string())
    } else {
        overrides.remove("--emulated-dir")
    };
    overrides.and(&Overrides::from_args(&options.extra_args))
}

/// testenv's overrides of the rendered csi-provisioner container: the node's socket, a
/// ServiceAccount kubeconfig instead of in-cluster config, short timeouts and delays, and no
/// metrics endpoint (every node shares 127.0.0.1).
pub fn provisioner_overrides(socket: &Path, kubeconfig: &Path) -> Overrides {
    Overrides::new()
        .set("--csi-address", socket.display().to_string())
        .set("--kubeconfig", kubeconfig.display().to_string())
        .set("--timeout", "30s")
        .set("--node-deployment-base-delay", "1s")
        .set("--node-deployment-max-delay", "5s")
        .remove("--metrics-address")
        .remove("--http-endpoint")
}

/// `pmem-csi node` of `node`, its files in `dirs`, as testenv runs it: the rendered container
/// with [`driver_overrides`] (and `--driver-name` when it is not the manifests' default), under
/// the node ServiceAccount's `kubeconfig`, plus the options' extra environment.
pub fn driver_process(
    manifests: &Rendered,
    tools: &Tools,
    driver_name: &str,
    node: &str,
    dirs: &NodeDriverDirs,
    options: &DriverOptions,
    kubeconfig: &Path,
) -> Result<ProcessSpec, ManifestError> {
    let pod = node_pod(manifests, node);
    let mut overrides = Overrides::new();
    if driver_name != crate::nodes::DEFAULT_DRIVER_NAME {
        overrides = overrides.set("--driver-name", driver_name);
    }
    let mut spec = container_process(
        manifests,
        OurContainer::NodeDriver,
        &format!("{node}/pmem-csi"),
        tools.pmem_csi(),
        &pod,
        format!("{node}-pmem-csi.log"),
        &overrides.and(&driver_overrides(dirs, options)),
    )?
    .env("KUBECONFIG", kubeconfig);
    for (k, v) in &options.env {
        spec = spec.env(k, v);
    }
    Ok(spec)
}

/// What a node DaemonSet pod of `manifests` on `node` knows about itself.
fn node_pod(manifests: &Rendered, node: &str) -> PodFacts {
    PodFacts {
        name: format!("{}-node-{node}", manifests.prefix()),
        namespace: manifests.namespace(),
        node_name: node.into(),
    }
}

/// Process `name` of rendered container `which`, as pod `pod` would run it with `overrides`:
/// `program` with the rendered command line and environment.
pub fn container_process(
    manifests: &Rendered,
    which: OurContainer,
    name: &str,
    program: &Path,
    pod: &PodFacts,
    log: impl Into<std::path::PathBuf>,
    overrides: &Overrides,
) -> Result<ProcessSpec, ManifestError> {
    let launch = manifests.launch(which)?;
    let mut spec = ProcessSpec::new(name, program, log).args(launch.command_line(pod, overrides)?);
    for (key, value) in launch.environment(pod)? {
        spec = spec.env(key, value);
    }
    Ok(spec)
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
    /// The rendered manifests the processes are started from.
    pub manifests: std::sync::Arc<Rendered>,
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
            provisioner_args: Vec::new(),
        }
    }
}

impl NodeLauncher {
    /// Starts the processes of `node` and registers the driver in its CSINode once it serves;
    /// they reach the apiserver with `kubeconfig` (the node ServiceAccount's, its token bound
    /// to that node: see [`crate::TestEnv::node_identity_kubeconfig`]).
    pub async fn start(
        &self,
        node: &NodeSpec,
        kubeconfig: &Path,
        supervise: impl Fn(ProcessSpec) -> Supervised,
    ) -> Result<NodeProcesses, NodeProcessesError> {
        let dirs = NodeDriverDirs::under(&self.root.join("nodes").join(&node.name));
        let manifest_error = |source| NodeProcessesError::Manifest {
            node: node.name.clone(),
            source,
        };
        // A pause or fault point the binary lacks is silently ignored: the test would pass
        // without testing what it means to. Say so instead.
        if let Some((variable, _)) = self
            .options
            .env
            .iter()
            .find(|(k, _)| k.starts_with(TEST_HOOK_PREFIX))
        {
            let binary = self.tools.pmem_csi();
            if !binary_mentions(binary, variable) {
                return Err(NodeProcessesError::TestHooksMissing {
                    variable: variable.clone(),
                    binary: binary.to_path_buf(),
                });
            }
        }
        let mut options = self.options.clone();
        if let Some(size) = &node.size {
            options.size = size.clone();
        }
        // A known admin port, for metrics; a test's own --admin-address still wins.
        let admin = crate::ports::free_port().map_err(|e| NodeProcessesError::Driver {
            node: node.name.clone(),
            source: Timeout {
                what: "a free admin port".into(),
                timeout: Duration::ZERO,
                last: e.to_string(),
            },
        })?;
        options
            .extra_args
            .insert(0, format!("--admin-address=127.0.0.1:{admin}"));
        let spec = driver_process(
            &self.manifests,
            &self.tools,
            &self.driver_name,
            &node.name,
            &dirs,
            &options,
            kubeconfig,
        )
        .map_err(manifest_error)?;
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
            container_process(
                &self.manifests,
                OurContainer::Provisioner,
                &format!("{}/csi-provisioner", node.name),
                &self.tools.go("csi-provisioner"),
                &node_pod(&self.manifests, &node.name),
                format!("{}-csi-provisioner.log", node.name),
                &provisioner_overrides(&dirs.socket, kubeconfig)
                    .and(&Overrides::from_args(&self.options.provisioner_args)),
            )
            .map_err(manifest_error)?,
        );
        let admin = Overrides::from_args(&options.extra_args)
            .value_of("--admin-address")
            .and_then(|a| a.rsplit(':').next().and_then(|p| p.parse().ok()))
            .unwrap_or(admin);
        Ok(NodeProcesses {
            node: node.name.clone(),
            admin,
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
