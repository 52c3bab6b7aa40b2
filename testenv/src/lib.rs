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
pub mod objects;
pub mod pki;
pub mod ports;
pub mod process;
pub mod proxy;
pub mod registrar;
pub mod scheduler_config;
pub mod service_accounts;
pub mod tools;
pub mod wait;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

use builder::ControllerSetup;
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
    nodes: Vec<NodeSpec>,
    control_plane: Option<ControlPlane>,
    runtime: Handle,
    node_processes: std::sync::Mutex<Vec<node_processes::NodeProcesses>>,
    proxies: Vec<(String, proxy::TcpProxy)>,
    extender: Option<ExtenderProcess>,
    controller: Option<ControllerProcess>,
    kubelet: Option<kubelet::Kubelet>,
    /// `overlays/emulated` rendered.
    manifests_base: std::sync::Arc<manifests::Rendered>,
    /// `overlays/emulated` with the scheduler-extender component rendered.
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

    pub(crate) async fn start(
        mut builder: TestEnvBuilder,
        runtime: Handle,
    ) -> Result<Self, TestEnvError> {
        let tools = Tools::locate()?;
        let parent = std::env::temp_dir();
        leftovers::remove_stale_work_dirs(&parent);
        let dir = tempfile::Builder::new()
            .prefix(&leftovers::work_dir_prefix())
            .tempdir_in(&parent)
            .map_err(|source| TestEnvError::WorkDir {
                parent: parent.clone(),
                source,
            })?;
        let group = ProcessGroup::new()?;
        let pki = pki::Pki::new()?;
        tracing::info!(dir = %dir.path().display(), "starting testenv");
        let extender_ports = match &builder.extender {
            Some(_) => {
                let (route, admin) = (ports::free_port()?, ports::free_port()?);
                builder.scheduler = builder
                    .scheduler
                    .clone()
                    .manifest_extender(route, &builder.driver_name)?;
                Some((route, admin))
            }
            None => None,
        };
        let kubectl = tools.go("kubectl");
        let manifests_base = std::sync::Arc::new(manifests::Rendered::render(
            &kubectl,
            tools::repo_root(),
            dir.path(),
            false,
        )?);
        let manifests = std::sync::Arc::new(manifests::Rendered::render(
            &kubectl,
            tools::repo_root(),
            dir.path(),
            true,
        )?);
        let control_plane = ControlPlane::start(
            dir.path(),
            &tools,
            &pki,
            &group,
            &builder.scheduler,
            builder.idle_control_plane,
            !builder.private_audit_log,
        )
        .await?;
        let mut env = Self {
            dir,
            tools,
            driver_name: builder.driver_name,
            nodes: builder.nodes,
            control_plane: Some(control_plane),
            runtime,
            node_processes: Default::default(),
            proxies: Vec::new(),
            extender: None,
            controller: None,
            kubelet: None,
            manifests_base,
            manifests,
            accounts: Default::default(),
            fault_proxy: None,
            shutdown: CancellationToken::new(),
            group,
        };
        let client = env.client().await?;
        service_accounts::apply(&client, &env.manifests).await?;
        let mut names: Vec<String> = [
            manifests::OurContainer::NodeDriver,
            manifests::OurContainer::Controller,
            manifests::OurContainer::Extender,
        ]
        .iter()
        .map(|c| env.manifests.launch(*c).map(|l| l.service_account))
        .collect::<Result<_, _>>()?;
        names.dedup();
        service_accounts::wait_authorized(
            &client,
            &env.manifests,
            manifests::NAMESPACE,
            &names,
            std::time::Duration::from_secs(30),
        )
        .await?;
        let mut server = env.server();
        if builder.fault_proxy {
            let upstream: SocketAddr =
                server.trim_start_matches("https://").parse().map_err(|e| {
                    TestEnvError::WorkDir {
                        parent: PathBuf::from(&server),
                        source: std::io::Error::other(e),
                    }
                })?;
            let proxy =
                fault_proxy::FaultProxy::start(upstream, &pki, env.shutdown.child_token()).await?;
            server = format!("https://{}", proxy.address());
            env.fault_proxy = Some(proxy);
        }
        env.accounts = service_accounts::ServiceAccountKubeconfigs::issue(
            &client,
            manifests::NAMESPACE,
            &names,
            &env.dir().join("pki"),
            (&server, &env.dir().join("pki/ca.crt")),
            builder.token_renewal,
            env.shutdown.child_token(),
        )
        .await?;
        if env
            .manifests
            .object("ValidatingAdmissionPolicy", manifests::NODE_LEASE_POLICY)
            .is_some()
        {
            // Like RBAC above: no node process may start before the policy holds it.
            let node_client =
                control_plane::client_from(&env.unbound_node_kubeconfig()?, "node").await?;
            service_accounts::wait_node_lease_policy(
                &node_client,
                manifests::NAMESPACE,
                manifests::NODE_LEASE_POLICY,
                std::time::Duration::from_secs(30),
            )
            .await?;
        }
        if let (Some(args), Some((route, admin))) = (builder.extender.take(), extender_ports) {
            let address = SocketAddr::from(([127, 0, 0, 1], route));
            let admin = SocketAddr::from(([127, 0, 0, 1], admin));
            // The manifests' emptyDir, as a directory of this testenv: it outlives restarts of
            // the supervised extender as the emptyDir outlives container restarts.
            let state = env.dir().join("extender-state");
            std::fs::create_dir_all(&state).map_err(|source| TestEnvError::WorkDir {
                parent: state.clone(),
                source,
            })?;
            let overrides = manifests::Overrides::new()
                .set("--extender-address", address.to_string())
                .set("--admin-address", admin.to_string())
                .set(
                    "--reservations-file",
                    state.join("reservations.jsonl").display().to_string(),
                )
                .and(&env.driver_name_override())
                .and(&manifests::Overrides::from_args(&args));
            let mut spec = env.our_process(
                manifests::OurContainer::Extender,
                "extender",
                "extender.log",
                &overrides,
            )?;
            for (key, value) in &builder.extender_env {
                spec = spec.env(key, value);
            }
            let process = env.supervise(spec);
            env.extender = Some(ExtenderProcess {
                process,
                address,
                admin,
            });
        }
        for node in &env.nodes {
            // With driver processes, the CSINode lists the driver only once it serves.
            let mut spec = node.clone();
            if builder.drivers.is_some() {
                spec.csinode_driver = false;
            }
            spec.create(&client, &env.driver_name).await?;
        }
        if let Some(options) = builder.drivers {
            let launcher = node_processes::NodeLauncher {
                client: client.clone(),
                tools: env.tools.clone(),
                root: env.dir().to_path_buf(),
                manifests: env.manifests.clone(),
                driver_name: env.driver_name.clone(),
                options,
            };
            let driver_nodes: Vec<NodeSpec> =
                env.nodes.iter().filter(|n| n.driver).cloned().collect();
            for node in &driver_nodes {
                let kubeconfig = if launcher.options.partitionable {
                    env.partitionable_kubeconfig(&node.name).await?
                } else {
                    env.node_identity_kubeconfig(&node.name).await?
                };
                let processes = launcher
                    .start(node, &kubeconfig, |spec| env.supervise(spec))
                    .await?;
                env.node_processes
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(processes);
            }
        }
        if let Some(setup) = builder.controller.take() {
            env.controller = Some(env.start_controller(&client, &setup).await?);
        }
        if builder.kubelet {
            let nodes = env
                .node_processes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .map(|p| kubelet::KubeletNode {
                    name: p.node.clone(),
                    socket: p.dirs.socket.clone(),
                    dirs: env.kubelet_dirs(&p.node),
                })
                .collect();
            let _guard = env.runtime.enter();
            env.kubelet = Some(kubelet::Kubelet::spawn(
                client.clone(),
                &env.driver_name,
                nodes,
                env.shutdown.child_token(),
            ));
        }
        Ok(env)
    }

    /// The controller with its webhook on 127.0.0.1, the manifests' webhook configuration
    /// pointing at it; returns once the leader has injected its CA and the webhook answers.
    async fn start_controller(
        &self,
        client: &kube::Client,
        setup: &ControllerSetup,
    ) -> Result<ControllerProcess, TestEnvError> {
        use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
        let (webhook, admin) = (ports::free_port()?, ports::free_port()?);
        let with_webhook = setup.webhook;
        let mut all = vec![format!("--admin-address=127.0.0.1:{admin}")];
        if with_webhook {
            all.push(format!("--webhook-address=127.0.0.1:{webhook}"));
            all.push("--self-signed-san=127.0.0.1".to_string());
        } else {
            // The base's container has no webhook flags; `!` removes one should a test give it.
            all.push("!--webhook-address".to_string());
        }
        all.extend(setup.args.iter().cloned());
        let spec = self.our_process(
            manifests::OurContainer::Controller,
            "controller",
            "controller.log",
            &manifests::Overrides::from_args(&all),
        )?;
        let process = self.supervise(spec);
        if !with_webhook {
            return Ok(ControllerProcess {
                process,
                webhook,
                admin,
            });
        }
        let configuration = controller::pod_webhook_configuration(
            &self.manifests,
            &[(
                "pod-hook.pmem-csi.intel.com",
                format!("https://127.0.0.1:{webhook}/pod/mutate"),
            )],
            None,
        )
        .map_err(|reason| {
            TestEnvError::Manifests(manifests::ManifestError::Unsupported {
                container: "controller".into(),
                reason,
            })
        })?;
        let hooks = kube::Api::<MutatingWebhookConfiguration>::all(client.clone());
        api_calls::apply(&hooks, &configuration).await?;
        let name = configuration.metadata.name.clone().unwrap_or_default();
        wait::until(
            "the controller's webhook to serve with its CA injected",
            std::time::Duration::from_secs(60),
            || async {
                let config = hooks.get(&name).await.map_err(|e| e.to_string())?;
                let injected = config.webhooks.unwrap_or_default().iter().all(|w| {
                    w.client_config
                        .ca_bundle
                        .as_ref()
                        .is_some_and(|b| !b.0.is_empty())
                });
                if !injected {
                    return Err("no caBundle yet".into());
                }
                tokio::net::TcpStream::connect(("127.0.0.1", webhook))
                    .await
                    .map(|_| ())
                    .map_err(|e| format!("webhook port: {e}"))
            },
        )
        .await
        .map_err(|e| {
            TestEnvError::Process(process::ProcessError::Log {
                path: self.dir().join("logs/controller.log"),
                source: std::io::Error::other(e.to_string()),
            })
        })?;
        Ok(ControllerProcess {
            process,
            webhook,
            admin,
        })
    }

    /// The kubelet directories of simulated node `node`.
    pub fn kubelet_dirs(&self, node: &str) -> kubelet::KubeletDirs {
        kubelet::KubeletDirs {
            root: self.dir().join("nodes").join(node).join("kubelet"),
        }
    }

    /// Copies the logs to `<tmp>/<name>-<pid>`, which outlives the work directory (for a failure
    /// found after the testenv is no longer needed); the copy's path, if it worked.
    pub fn keep_logs(&self, name: &str) -> Option<PathBuf> {
        let kept = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        std::process::Command::new("cp")
            .arg("-a")
            .arg(self.dir().join("logs"))
            .arg(&kept)
            .status()
            .is_ok_and(|s| s.success())
            .then_some(kept)
    }

    /// The simulated kubelet, when testenv runs it.
    pub fn kubelet(&self) -> Option<&kubelet::Kubelet> {
        self.kubelet.as_ref()
    }

    /// The controller's webhook and admin ports, when testenv runs it.
    pub fn controller_ports(&self) -> Option<(u16, u16)> {
        self.controller.as_ref().map(|c| (c.webhook, c.admin))
    }

    /// Takes the controller process out of the testenv's hands (to stop or kill it).
    pub fn take_controller(&mut self) -> Option<Supervised> {
        self.controller.take().map(|c| c.process)
    }

    /// A shared testenv for all tests of one test binary, started on first use with
    /// `configure` on a runtime of its own (each `#[tokio::test]` has its own runtime, which
    /// ends with the test). Its processes die with the test process through the watchdog.
    pub fn shared(configure: fn() -> TestEnvBuilder) -> &'static TestEnv {
        static SHARED: OnceLock<TestEnv> = OnceLock::new();
        SHARED.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name("testenv".into())
                .spawn(move || {
                    let runtime = match tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(2)
                        .enable_all()
                        .build()
                    {
                        Ok(r) => r,
                        Err(e) => {
                            let _ = tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                    let env = runtime.block_on(configure().start());
                    let _ = tx.send(env.map_err(|e| e.to_string()));
                    // Keep the runtime, and the supervisors on it, alive for the process.
                    runtime.block_on(std::future::pending::<()>());
                })
                .unwrap_or_else(|e| panic!("spawning the testenv thread: {e}"));
            match rx.recv() {
                Ok(Ok(env)) => env,
                Ok(Err(e)) => panic!("starting the shared testenv: {e}"),
                Err(e) => panic!("the testenv thread died: {e}"),
            }
        })
    }

    /// An admin client (`system:masters`) on the caller's runtime.
    pub async fn client(&self) -> Result<kube::Client, ControlPlaneError> {
        control_plane::client_from(&self.admin_kubeconfig(), "admin").await
    }

    /// The apiserver's audit log of our ServiceAccounts' requests.
    pub fn audit_log(&self) -> PathBuf {
        self.control_plane()
            .map(|c| c.audit_log.clone())
            .unwrap_or_default()
    }

    /// The admin kubeconfig.
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.control_plane()
            .map(|c| c.admin_kubeconfig.clone())
            .unwrap_or_default()
    }

    /// `https://127.0.0.1:<port>` of kube-apiserver.
    pub fn server(&self) -> String {
        self.control_plane()
            .map(|c| c.server.clone())
            .unwrap_or_default()
    }

    fn control_plane(&self) -> Option<&ControlPlane> {
        self.control_plane.as_ref()
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

    /// Starts a supervised `pmem-csi node` for `node`, its files in `dirs`, as testenv's own
    /// node processes run: the rendered container under the node ServiceAccount, with a token
    /// bound to Node `node` (which must exist).
    pub fn supervise_node_driver(
        &self,
        node: &str,
        dirs: &node_driver::NodeDriverDirs,
        options: &node_processes::DriverOptions,
    ) -> Result<Supervised, TestEnvError> {
        let spec = node_processes::driver_process(
            &self.manifests,
            &self.tools,
            &self.driver_name,
            node,
            dirs,
            options,
            &self.node_kubeconfig(node)?,
        )?;
        Ok(self.supervise(spec))
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

    /// The kubeconfig of ServiceAccount `name` of the manifests.
    pub fn service_account_kubeconfig(&self, name: &str) -> Option<&Path> {
        self.accounts.get(name)
    }

    /// The token file behind [`TestEnv::service_account_kubeconfig`].
    pub fn service_account_token_file(&self, name: &str) -> Option<PathBuf> {
        self.accounts.token_file(name)
    }

    /// The node ServiceAccount's kubeconfig with a token bound to no node: what the policy
    /// `manifests::NODE_LEASE_POLICY` lets write no Lease.
    fn unbound_node_kubeconfig(&self) -> Result<PathBuf, TestEnvError> {
        self.account_kubeconfig(&self.node_account()?, "pmem-driver")
    }

    /// The ServiceAccount the node DaemonSet's containers run under.
    fn node_account(&self) -> Result<String, TestEnvError> {
        Ok(self
            .manifests
            .launch(manifests::OurContainer::NodeDriver)?
            .service_account)
    }

    /// The kubeconfig `node`'s processes run with: the node ServiceAccount's, its token bound
    /// to Node `node` (which must exist), as kubelet's projected token of a DaemonSet pod on
    /// that node is, so that the API server names the node in the caller's user info. Issued
    /// on first use and renewed with the other tokens.
    pub async fn node_identity_kubeconfig(&self, node: &str) -> Result<PathBuf, TestEnvError> {
        let account = self.node_account()?;
        if let Some(path) = self.accounts.bound_to_node_if_issued(&account, node) {
            return Ok(path);
        }
        let client = self.client().await?;
        Ok(self.accounts.bound_to_node(&client, &account, node).await?)
    }

    /// [`TestEnv::node_identity_kubeconfig`] for synchronous callers. The token is requested
    /// on a thread and runtime of its own: the caller may be on a current-thread runtime that
    /// it blocks while waiting here.
    fn node_kubeconfig(&self, node: &str) -> Result<PathBuf, TestEnvError> {
        if let Some(path) = self
            .accounts
            .bound_to_node_if_issued(&self.node_account()?, node)
        {
            return Ok(path);
        }
        let runtime_error = |e: std::io::Error| {
            TestEnvError::ServiceAccounts(service_accounts::ServiceAccountError::Runtime(e))
        };
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .map_err(runtime_error)?
                        .block_on(self.node_identity_kubeconfig(node))
                })
                .join()
                .unwrap_or_else(|_| {
                    Err(runtime_error(std::io::Error::other(
                        "the thread issuing the token panicked",
                    )))
                })
        })
    }

    /// The kubeconfig of ServiceAccount `account`, which `container` runs under.
    fn account_kubeconfig(&self, account: &str, container: &str) -> Result<PathBuf, TestEnvError> {
        self.accounts
            .get(account)
            .map(Path::to_path_buf)
            .ok_or_else(|| {
                TestEnvError::Manifests(manifests::ManifestError::Unsupported {
                    container: container.into(),
                    reason: format!("no kubeconfig for ServiceAccount {account}"),
                })
            })
    }

    fn driver_name_override(&self) -> manifests::Overrides {
        if self.driver_name == DEFAULT_DRIVER_NAME {
            manifests::Overrides::new()
        } else {
            manifests::Overrides::new().set("--driver-name", self.driver_name.clone())
        }
    }

    /// Process `name` of our rendered container `which` (controller or extender) with
    /// `overrides`, under its ServiceAccount, logging to `logs/<log>`.
    pub fn our_process(
        &self,
        which: manifests::OurContainer,
        name: &str,
        log: &str,
        overrides: &manifests::Overrides,
    ) -> Result<ProcessSpec, TestEnvError> {
        let rendered = if which == manifests::OurContainer::Controller
            && !overrides.gives("--webhook-address")
        {
            // Without the webhook the controller runs as the base installs it.
            &self.manifests_base
        } else {
            &self.manifests
        };
        let launch = rendered.launch(which)?;
        let kubeconfig = self.account_kubeconfig(&launch.service_account, name)?;
        let pod = manifests::PodFacts {
            name: name.into(),
            namespace: manifests::NAMESPACE.into(),
            node_name: "control-plane".into(),
        };
        let overrides = manifests::Overrides::new()
            .set("--admin-address", "127.0.0.1:0")
            .and(&self.driver_name_override())
            .and(overrides);
        Ok(node_processes::container_process(
            rendered,
            which,
            name,
            self.tools.pmem_csi(),
            &pod,
            log,
            &overrides,
        )?
        .env("KUBECONFIG", kubeconfig))
    }

    /// A proxy to the apiserver for `node`'s processes and a kubeconfig through it.
    async fn partitionable_kubeconfig(&mut self, node: &str) -> Result<PathBuf, TestEnvError> {
        let server = self.server();
        let target: std::net::SocketAddr =
            server
                .trim_start_matches("https://")
                .parse()
                .map_err(|e| TestEnvError::WorkDir {
                    parent: PathBuf::from(&server),
                    source: std::io::Error::other(e),
                })?;
        let proxy = proxy::TcpProxy::start(target, self.shutdown.child_token())
            .await
            .map_err(|source| TestEnvError::WorkDir {
                parent: PathBuf::from(&server),
                source,
            })?;
        let own = self.node_identity_kubeconfig(node).await?;
        let admin = std::fs::read_to_string(&own).map_err(|source| TestEnvError::WorkDir {
            parent: own.clone(),
            source,
        })?;
        let path = self.dir().join(format!("pki/{node}-via-proxy.kubeconfig"));
        std::fs::write(
            &path,
            admin.replace(&server, &format!("https://{}", proxy.address())),
        )
        .map_err(|source| TestEnvError::WorkDir {
            parent: path.clone(),
            source,
        })?;
        self.proxies.push((node.to_string(), proxy));
        Ok(path)
    }

    /// The proxy between `node`'s processes and the apiserver (with partitionable drivers).
    pub fn proxy(&self, node: &str) -> Option<&proxy::TcpProxy> {
        self.proxies.iter().find(|(n, _)| n == node).map(|(_, p)| p)
    }

    /// Starts a supervised `pmem-csi controller` as the manifests run it, changed by
    /// `overrides` (test items as [`manifests::Overrides::from_args`] reads them), logging to
    /// `logs/<name>.log`. When they give `--webhook-address` it runs as the scheduler-extender
    /// component configures it, otherwise (also when they remove it) as the base does.
    pub fn supervise_controller(
        &self,
        name: &str,
        overrides: &[&str],
    ) -> Result<Supervised, TestEnvError> {
        let spec = self.our_process(
            manifests::OurContainer::Controller,
            name,
            &format!("{name}.log"),
            &manifests::Overrides::from_args(overrides),
        )?;
        Ok(self.supervise(spec))
    }

    /// The extender's route and admin addresses, when it runs.
    pub fn extender_addresses(&self) -> Option<(SocketAddr, SocketAddr)> {
        self.extender.as_ref().map(|e| (e.address, e.admin))
    }

    /// Takes the extender process out of the testenv's hands (to stop or kill it).
    pub fn take_extender(&mut self) -> Option<Supervised> {
        self.extender.take().map(|e| e.process)
    }

    /// Takes the processes of `node` out of the testenv's hands (to stop or kill them).
    pub fn take_node_processes(&self, node: &str) -> Option<node_processes::NodeProcesses> {
        let mut all = self
            .node_processes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let i = all.iter().position(|p| p.node == node)?;
        Some(all.remove(i))
    }

    /// Sends `signal` to the driver of `node` (its supervisor restarts it, as kubelet would).
    pub fn signal_node_driver(
        &self,
        node: &str,
        signal: rustix::process::Signal,
    ) -> Result<(), process::ProcessError> {
        let all = self
            .node_processes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match all.iter().find(|p| p.node == node) {
            Some(p) => p.driver.signal(signal),
            None => Err(process::ProcessError::Signal {
                what: format!("driver of {node}"),
                source: rustix::io::Errno::SRCH,
            }),
        }
    }

    /// Sends `signal` to the extender, which its supervisor restarts (fault tests).
    pub fn signal_extender(
        &self,
        signal: rustix::process::Signal,
    ) -> Result<(), process::ProcessError> {
        match &self.extender {
            Some(e) => e.process.signal(signal),
            None => Err(process::ProcessError::Signal {
                what: "extender".into(),
                source: rustix::io::Errno::SRCH,
            }),
        }
    }

    /// Sends `signal` to the controller testenv runs, which its supervisor restarts.
    pub fn signal_controller(
        &self,
        signal: rustix::process::Signal,
    ) -> Result<(), process::ProcessError> {
        match &self.controller {
            Some(c) => c.process.signal(signal),
            None => Err(process::ProcessError::Signal {
                what: "controller".into(),
                source: rustix::io::Errno::SRCH,
            }),
        }
    }

    /// The proxy between our ServiceAccounts and the apiserver, with
    /// [`TestEnvBuilder::http_fault_proxy`].
    pub fn fault_proxy(&self) -> Option<&fault_proxy::FaultProxy> {
        self.fault_proxy.as_ref()
    }

    /// How often the extender's supervisor restarted it, when testenv runs it.
    pub fn extender_restarts(&self) -> Option<u32> {
        self.extender.as_ref().map(|e| e.process.state().restarts)
    }

    /// How often the controller's supervisor restarted it, when testenv runs it.
    pub fn controller_restarts(&self) -> Option<u32> {
        self.controller.as_ref().map(|c| c.process.state().restarts)
    }

    /// Restarts control-plane component `name` (see [`ControlPlane::restart`]).
    pub async fn restart_control_plane(&self, name: &str) -> Result<(), ControlPlaneError> {
        match self.control_plane() {
            Some(c) => c.restart(name).await,
            None => Err(ControlPlaneError::Unknown(name.to_owned())),
        }
    }

    /// The restart counts of `node`'s driver and provisioner, if testenv runs them.
    pub fn node_restarts(&self, node: &str) -> Option<(u32, u32)> {
        self.node_processes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .find(|p| p.node == node)
            .map(|p| (p.driver.state().restarts, p.provisioner.state().restarts))
    }

    /// The admin (metrics) port of `node`'s driver, if testenv runs it.
    pub fn driver_admin_port(&self, node: &str) -> Option<u16> {
        self.node_processes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .find(|p| p.node == node)
            .map(|p| p.admin)
    }

    /// The driver socket of `node`, if testenv runs its driver.
    pub fn driver_socket(&self, node: &str) -> Option<PathBuf> {
        self.node_processes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .find(|p| p.node == node)
            .map(|p| p.dirs.socket.clone())
    }

    /// Stops every process gracefully, kills what remains of the group and removes the work
    /// directory. Returns what to check for leftovers.
    pub async fn stop(mut self) -> Leftovers {
        if let Some(kubelet) = self.kubelet.take() {
            // Unmounted while the drivers still serve, so no mount or loop device outlives them.
            kubelet
                .unmount_all(std::time::Duration::from_secs(30))
                .await;
        }
        let processes: Vec<_> = std::mem::take(
            &mut *self
                .node_processes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for p in processes {
            // Provisioners first, so nothing provisions against a stopping driver.
            p.provisioner.stop().await;
            p.driver.stop().await;
        }
        if let Some(extender) = self.extender.take() {
            extender.process.stop().await;
        }
        if let Some(controller) = self.controller.take() {
            controller.process.stop().await;
        }
        self.shutdown.cancel();
        if let Some(control_plane) = self.control_plane.take() {
            control_plane.stop().await;
        }
        self.group.kill_all();
        let leftovers = Leftovers::new(self.group.id(), self.dir.path().to_path_buf());
        if let Err(e) = std::fs::remove_dir_all(self.dir.path()) {
            tracing::warn!(dir = %self.dir.path().display(), "removing the work directory: {e}");
        }
        leftovers
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        // A failing test drops the testenv without `stop`; its logs are what explains the
        // failure, so they are kept and their place printed.
        if std::thread::panicking() {
            let logs = self.dir.path().join("logs");
            let kept = std::env::temp_dir().join(format!(
                "pmem-csi-failed-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis())
            ));
            if std::fs::rename(&logs, &kept).is_ok() {
                eprintln!("testenv logs kept in {}", kept.display());
            }
        }
    }
}

/// The controller testenv runs, with its webhook.
#[derive(Debug)]
struct ControllerProcess {
    process: Supervised,
    webhook: u16,
    admin: u16,
}

/// The extender testenv runs beside kube-scheduler.
#[derive(Debug)]
struct ExtenderProcess {
    process: Supervised,
    address: SocketAddr,
    admin: SocketAddr,
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
