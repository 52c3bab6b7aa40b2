//! How a [`TestEnv`] is built: nodes, drivers, the controller, the extender, the kubelet and
//! the control plane's settings, each a builder method; [`TestEnvBuilder::start`] starts it.

use tokio::runtime::Handle;

use crate::node_processes;
use crate::nodes::{DEFAULT_DRIVER_NAME, NodeSpec};
use crate::scheduler_config::SchedulerConfig;
use crate::service_accounts;
use crate::{TestEnv, TestEnvError};

/// How the controller runs: as the scheduler-extender component configures it (with the pod
/// webhook) or as the base installs it (without), changed by test items.
#[derive(Clone, Debug)]
pub(crate) struct ControllerSetup {
    pub(crate) webhook: bool,
    pub(crate) args: Vec<String>,
    /// csi-resizer beside the controller, on the controller's resizer endpoint.
    pub(crate) resizer: bool,
}

/// How to build a [`TestEnv`].
#[derive(Clone, Debug)]
pub struct TestEnvBuilder {
    pub(crate) nodes: Vec<NodeSpec>,
    pub(crate) driver_name: String,
    pub(crate) scheduler: SchedulerConfig,
    pub(crate) drivers: Option<node_processes::DriverOptions>,
    pub(crate) controller_manager_args: Vec<String>,
    pub(crate) extender: Option<Vec<String>>,
    pub(crate) token_renewal: std::time::Duration,
    pub(crate) idle_control_plane: bool,
    pub(crate) controller: Option<ControllerSetup>,
    pub(crate) kubelet: bool,
    pub(crate) extender_env: Vec<(String, String)>,
    pub(crate) fault_proxy: bool,
    pub(crate) private_audit_log: bool,
    pub(crate) shipped_heartbeat: bool,
}

impl Default for TestEnvBuilder {
    fn default() -> Self {
        Self {
            nodes: Vec::new(),
            driver_name: DEFAULT_DRIVER_NAME.to_string(),
            scheduler: SchedulerConfig::default(),
            drivers: None,
            controller_manager_args: Vec::new(),
            extender: None,
            token_renewal: service_accounts::TOKEN_LIFETIME / 3,
            idle_control_plane: false,
            controller: None,
            kubelet: false,
            extender_env: Vec::new(),
            fault_proxy: false,
            private_audit_log: false,
            shipped_heartbeat: false,
        }
    }
}

impl TestEnvBuilder {
    /// Runs `pmem-csi controller` as the scheduler-extender component configures it (webhook
    /// included, its MutatingWebhookConfiguration pointing at it), changed by `args` (test items
    /// as [`manifests::Overrides::from_args`] reads them); start waits until the webhook serves
    /// with its CA injected, so that no pod created afterwards bypasses it.
    pub fn controller<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.controller = Some(ControllerSetup {
            webhook: true,
            args: args.into_iter().map(Into::into).collect(),
            resizer: false,
        });
        self
    }

    /// Runs `pmem-csi controller` as the base installs it: no webhook (capacity tracking alone),
    /// changed by `args` as in [`TestEnvBuilder::controller`].
    pub fn controller_without_webhook<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.controller = Some(ControllerSetup {
            webhook: false,
            args: args.into_iter().map(Into::into).collect(),
            resizer: false,
        });
        self
    }

    /// Runs csi-resizer beside the controller (which must be configured first), as the
    /// controller Deployment does: the controller serves its endpoint on a socket of its own.
    pub fn with_resizer(mut self) -> Self {
        if let Some(setup) = self.controller.as_mut() {
            setup.resizer = true;
        }
        self
    }

    /// Runs every controller with the manifests' `--heartbeat-grace` (testenv removes it by
    /// default: simulated nodes without a running driver have no heartbeat Lease, so most tests'
    /// nodes would count as driverless). Its nodes must then all run their driver, or the test
    /// must give them a Lease.
    pub fn shipped_heartbeat(mut self) -> Self {
        self.shipped_heartbeat = true;
        self
    }

    /// Puts a [`fault_proxy::FaultProxy`] between every ServiceAccount of ours (controller,
    /// extender, node drivers, csi-provisioner) and the apiserver, so that a test can make the
    /// apiserver answer 429 and 5xx for a while ([`TestEnv::fault_proxy`]).
    pub fn http_fault_proxy(mut self) -> Self {
        self.fault_proxy = true;
        self
    }

    /// Keeps this testenv's audit log out of `PMEM_CSI_AUDIT_DIR`, so that the least-privilege
    /// check does not read it: fault tests restart the apiserver and etcd, and an apiserver
    /// whose authorizer has not synced yet denies requests that RBAC grants.
    pub fn private_audit_log(mut self) -> Self {
        self.private_audit_log = true;
        self
    }

    /// Sets environment variable `key` of the extender (for example `RUST_LOG`).
    pub fn extender_env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extender_env.push((key.into(), value.into()));
        self
    }

    /// Runs the simulated kubelet ([`kubelet::Kubelet`]) for the nodes whose driver testenv
    /// runs (needs [`TestEnvBuilder::drivers`]).
    pub fn kubelet(mut self) -> Self {
        self.kubelet = true;
        self
    }

    /// Adds `n` nodes that run the driver, named `node-1` … `node-n` after those already added.
    pub fn nodes(mut self, n: usize) -> Self {
        let start = self.nodes.len();
        self.nodes
            .extend((start + 1..=start + n).map(|i| NodeSpec::with_driver(format!("node-{i}"))));
        self
    }

    /// Adds one node.
    pub fn node(mut self, node: NodeSpec) -> Self {
        self.nodes.push(node);
        self
    }

    /// Sets the CSI driver name (default `pmem-csi.intel.com`).
    pub fn driver_name(mut self, name: impl Into<String>) -> Self {
        self.driver_name = name.into();
        self
    }

    /// Runs, on every node meant for the driver, a supervised `pmem-csi node` and a supervised
    /// csi-provisioner in node-deployment mode.
    pub fn drivers(mut self, options: node_processes::DriverOptions) -> Self {
        self.drivers = Some(options);
        self
    }

    /// Extra kube-controller-manager flags (benchmarks compare its `--kube-api-qps`).
    pub fn controller_manager_args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.controller_manager_args = args.into_iter().map(Into::into).collect();
        self
    }

    /// The options given to [`TestEnvBuilder::drivers`], to change them afterwards.
    pub fn driver_options_mut(&mut self) -> Option<&mut node_processes::DriverOptions> {
        self.drivers.as_mut()
    }

    /// Runs a supervised `pmem-csi extender` with `args` (besides address, driver name and node
    /// selector) and configures kube-scheduler with the extender entry of
    /// `manifests/scheduler/`, on a free port.
    pub fn extender<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.extender = Some(args.into_iter().map(Into::into).collect());
        self
    }

    /// How often the ServiceAccount tokens are renewed (default a third of their lifetime;
    /// tests shorten it to see renewal work).
    pub fn token_renewal(mut self, every: std::time::Duration) -> Self {
        self.token_renewal = every;
        self
    }

    /// Runs etcd, kube-apiserver, kube-controller-manager and kube-scheduler under
    /// `SCHED_IDLE`, so that they run only when our processes leave a CPU free. For latency
    /// benchmarks on small machines: there the control plane's garbage-collection bursts take
    /// both CPUs for milliseconds and land in the measured latencies of our servers, which in a
    /// cluster do not share two CPUs with an API server.
    pub fn control_plane_at_idle_priority(mut self) -> Self {
        self.idle_control_plane = true;
        self
    }

    /// Replaces the kube-scheduler configuration.
    pub fn scheduler(mut self, config: SchedulerConfig) -> Self {
        self.scheduler = config;
        self
    }

    /// Starts everything on the current tokio runtime.
    pub async fn start(self) -> Result<TestEnv, TestEnvError> {
        TestEnv::start(self, Handle::current()).await
    }
}
