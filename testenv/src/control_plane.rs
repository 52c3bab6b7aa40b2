//! etcd, kube-apiserver, kube-controller-manager and kube-scheduler as local processes on
//! 127.0.0.1, each under its own identity, each polled until ready.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use kube::Api;

use crate::audit;
use crate::kubeconfig::{self, Credentials, KubeconfigError};
use crate::pki::{Pki, PkiError};
use crate::ports::free_port;
use crate::process::{Component, ProcessError, ProcessGroup, ProcessSpec};
use crate::scheduler_config::SchedulerConfig;
use crate::tools::Tools;

/// How long one component may take to become ready on a loaded 2-core machine.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Polling interval of readiness probes.
const POLL: Duration = Duration::from_millis(200);

/// The controllers kube-controller-manager runs: volume binding, protection finalizers, generic
/// ephemeral volumes, garbage collection, namespace deletion, and StatefulSets (the workload
/// the node-loss recovery is for). Never node-lifecycle: without kubelets it would mark every
/// node NotReady and evict the pods.
pub const KCM_CONTROLLERS: &str = "persistentvolume-binder-controller,ephemeral-volume-controller,persistentvolumeclaim-protection-controller,persistentvolume-protection-controller,garbage-collector-controller,namespace-controller,statefulset-controller";

/// What can go wrong starting the control plane.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    /// Certificates.
    #[error(transparent)]
    Pki(#[from] PkiError),
    /// Kubeconfig files.
    #[error(transparent)]
    Kubeconfig(#[from] KubeconfigError),
    /// A process failed to start or died.
    #[error(transparent)]
    Process(#[from] ProcessError),
    /// No component of that name.
    #[error("no control-plane component {0:?}")]
    Unknown(String),
    /// No free port.
    #[error("allocating a port: {0}")]
    Port(std::io::Error),
    /// A file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A client could not be built.
    #[error("building a client for {what}: {source}")]
    Client {
        /// For which component.
        what: String,
        /// Why.
        source: kube::Error,
    },
    /// A probe URL is malformed (a bug).
    #[error("invalid URL {url}: {reason}")]
    Url {
        /// The URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// A component did not become ready in time.
    #[error(
        "{name} not ready after {timeout:?} (last probe: {last}); last lines of {log}:\n{tail}"
    )]
    NotReady {
        /// Component.
        name: String,
        /// How long we waited.
        timeout: Duration,
        /// The last probe result.
        last: String,
        /// Its log file.
        log: PathBuf,
        /// The end of its log.
        tail: String,
    },
}

/// The running control plane.
#[derive(Debug)]
pub struct ControlPlane {
    /// `https://127.0.0.1:<port>` of kube-apiserver.
    pub server: String,
    /// The CA certificate file every client trusts.
    pub ca_file: PathBuf,
    /// Admin kubeconfig (client certificate in `system:masters`).
    pub admin_kubeconfig: PathBuf,
    /// The audit log of our ServiceAccounts' requests ([`audit::parse_log`] reads it).
    pub audit_log: PathBuf,
    // Behind a lock: a shared testenv (`&'static`) restarts components in fault tests.
    components: tokio::sync::Mutex<Vec<Component>>,
    log_paths: Vec<PathBuf>,
    group: i32,
}

/// How the control plane runs, besides the scheduler's configuration.
#[derive(Clone, Debug, Default)]
pub struct ControlPlaneOptions {
    /// Every component under `SCHED_IDLE`.
    pub idle: bool,
    /// The audit log goes where `PMEM_CSI_AUDIT_DIR` says (the least-privilege check reads
    /// it), otherwise into the work directory.
    pub shared_audit: bool,
    /// Extra kube-controller-manager flags (benchmarks compare `--kube-api-qps` settings).
    pub controller_manager_args: Vec<String>,
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver, kube-controller-manager and kube-scheduler under `dir`, as
    /// `options` say.
    pub async fn start(
        dir: &Path,
        tools: &Tools,
        pki: &Pki,
        group: &ProcessGroup,
        scheduler: &SchedulerConfig,
        options: &ControlPlaneOptions,
    ) -> Result<Self, ControlPlaneError> {
        let (idle, shared_audit) = (options.idle, options.shared_audit);
        let certs = dir.join("pki");
        let logs = dir.join("logs");
        for d in [&certs, &logs] {
            std::fs::create_dir_all(d).map_err(|source| ControlPlaneError::Write {
                path: d.clone(),
                source,
            })?;
        }
        let files = pki.write_control_plane_files(&certs)?;
        let port = || free_port().map_err(ControlPlaneError::Port);
        let mut components = Vec::new();

        // etcd, its data in the work directory.
        let (etcd_client, etcd_peer) = (port()?, port()?);
        let etcd_data = dir.join("etcd");
        mkdir(&etcd_data)?;
        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer}");
        let etcd = Component::start(
            ProcessSpec::new("etcd", tools.go("etcd"), logs.join("etcd.log"))
                .idle_priority(idle)
                .args([
                    "--name=testenv".to_string(),
                    format!("--data-dir={}", etcd_data.display()),
                    format!("--listen-client-urls={etcd_url}"),
                    format!("--advertise-client-urls={etcd_url}"),
                    format!("--listen-peer-urls={peer_url}"),
                    format!("--initial-advertise-peer-urls={peer_url}"),
                    format!("--initial-cluster=testenv={peer_url}"),
                    // Its data in the page cache rather than on a private tmpfs: fast all the
                    // same, and it survives a restart of etcd (tests/faults.rs).
                    "--unsafe-no-fsync=true".into(),
                    "--log-level=warn".into(),
                ]),
            group,
        )?;
        components.push(etcd);
        let probe = anonymous_probe(&etcd_url, "etcd")?;
        wait_ready(components.last_mut(), "etcd", || {
            probe_path(&probe, "/health")
        })
        .await?;

        // kube-apiserver, auditing our ServiceAccounts' requests (tests/least_privilege.rs).
        let audit_policy = certs.join("audit-policy.yaml");
        std::fs::write(
            &audit_policy,
            audit::policy(&[
                crate::manifests::NAMESPACE,
                crate::manifests::SECOND_NAMESPACE,
            ]),
        )
        .map_err(|source| ControlPlaneError::Write {
            path: audit_policy.clone(),
            source,
        })?;
        let audit_log = if shared_audit {
            audit_log_path(&logs)?
        } else {
            logs.join("audit.log")
        };
        let api_port = port()?;
        let server = format!("https://127.0.0.1:{api_port}");
        let apiserver = Component::start(
            ProcessSpec::new(
                "kube-apiserver",
                tools.go("kube-apiserver"),
                logs.join("kube-apiserver.log"),
            )
            .idle_priority(idle)
            .args([
                format!("--etcd-servers={etcd_url}"),
                "--bind-address=127.0.0.1".into(),
                "--advertise-address=127.0.0.1".into(),
                format!("--secure-port={api_port}"),
                format!("--tls-cert-file={}", files.apiserver_cert.display()),
                format!("--tls-private-key-file={}", files.apiserver_key.display()),
                format!("--client-ca-file={}", files.ca.display()),
                "--service-cluster-ip-range=10.0.0.0/24".into(),
                format!("--service-account-issuer={server}"),
                format!(
                    "--service-account-key-file={}",
                    files.service_account_public.display()
                ),
                format!(
                    "--service-account-signing-key-file={}",
                    files.service_account_private.display()
                ),
                "--authorization-mode=RBAC".into(),
                // ServiceAccount admission wants token volumes nobody mounts here;
                // TaintNodesByCondition would taint every new Node not-ready, and no
                // node-lifecycle controller runs to remove the taint.
                "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition".into(),
                // No loopback address in the `kubernetes` Service's endpoints.
                "--endpoint-reconciler-type=none".into(),
                "--allow-privileged=true".into(),
                "--profiling=false".into(),
                format!("--audit-policy-file={}", audit_policy.display()),
                format!("--audit-log-path={}", audit_log.display()),
                "--audit-log-format=json".into(),
                "--audit-log-mode=blocking".into(),
            ]),
            group,
        )?;
        components.push(apiserver);

        let admin = pki.client("admin", Some("system:masters"))?;
        let admin_kubeconfig = kubeconfig::write(
            &certs,
            "admin",
            &server,
            &files.ca,
            Credentials::Certificate(&admin),
        )?;
        let admin_client = client_from(&admin_kubeconfig, "admin").await?;
        wait_ready(components.last_mut(), "kube-apiserver", || async {
            match probe_path(&admin_client, "/readyz").await {
                Ok(()) => namespaces_exist(&admin_client).await,
                Err(e) => Err(e),
            }
        })
        .await?;

        // kube-controller-manager: its own identity reads, and each controller writes as its
        // kube-system ServiceAccount (the bootstrap role of the identity cannot write).
        let kcm_identity = pki.client("system:kube-controller-manager", None)?;
        let kcm_kubeconfig = kubeconfig::write(
            &certs,
            "kube-controller-manager",
            &server,
            &files.ca,
            Credentials::Certificate(&kcm_identity),
        )?;
        let kcm_port = port()?;
        let kcm = Component::start(
            ProcessSpec::new(
                "kube-controller-manager",
                tools.go("kube-controller-manager"),
                logs.join("kube-controller-manager.log"),
            )
            .idle_priority(idle)
            .args([
                format!("--kubeconfig={}", kcm_kubeconfig.display()),
                format!("--authentication-kubeconfig={}", kcm_kubeconfig.display()),
                format!("--authorization-kubeconfig={}", kcm_kubeconfig.display()),
                "--leader-elect=false".into(),
                "--use-service-account-credentials=true".into(),
                format!("--controllers={KCM_CONTROLLERS}"),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={kcm_port}"),
                format!("--root-ca-file={}", files.ca.display()),
            ])
            .args(options.controller_manager_args.iter()),
            group,
        )?;
        components.push(kcm);
        let kcm_probe = anonymous_probe(&format!("https://127.0.0.1:{kcm_port}"), "kcm")?;
        wait_ready(components.last_mut(), "kube-controller-manager", || {
            probe_path(&kcm_probe, "/healthz")
        })
        .await?;

        // kube-scheduler.
        let sched_identity = pki.client("system:kube-scheduler", None)?;
        let sched_kubeconfig = kubeconfig::write(
            &certs,
            "kube-scheduler",
            &server,
            &files.ca,
            Credentials::Certificate(&sched_identity),
        )?;
        let config_path = dir.join("kube-scheduler-config.yaml");
        let config_text = serde_yaml::to_string(&scheduler.render(&sched_kubeconfig))
            .map_err(KubeconfigError::from)?;
        std::fs::write(&config_path, config_text).map_err(|source| ControlPlaneError::Write {
            path: config_path.clone(),
            source,
        })?;
        let sched_port = port()?;
        let sched = Component::start(
            ProcessSpec::new(
                "kube-scheduler",
                tools.go("kube-scheduler"),
                logs.join("kube-scheduler.log"),
            )
            .idle_priority(idle)
            .args([
                format!("--config={}", config_path.display()),
                format!("--authentication-kubeconfig={}", sched_kubeconfig.display()),
                format!("--authorization-kubeconfig={}", sched_kubeconfig.display()),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={sched_port}"),
            ]),
            group,
        )?;
        components.push(sched);
        let sched_probe = anonymous_probe(&format!("https://127.0.0.1:{sched_port}"), "sched")?;
        wait_ready(components.last_mut(), "kube-scheduler", || {
            probe_path(&sched_probe, "/readyz")
        })
        .await?;

        Ok(Self {
            server,
            ca_file: files.ca,
            admin_kubeconfig,
            audit_log,
            log_paths: components.iter().map(|c| c.spec().log.clone()).collect(),
            components: tokio::sync::Mutex::new(components),
            group: group.id(),
        })
    }

    /// An error naming the first component that has exited, with the end of its log.
    pub fn check_running(&mut self) -> Result<(), ProcessError> {
        self.components
            .get_mut()
            .iter_mut()
            .try_for_each(Component::check_running)
    }

    /// Log files of every component, for failure messages.
    pub fn logs(&self) -> Vec<PathBuf> {
        self.log_paths.clone()
    }

    /// Restarts component `name` (`etcd`, `kube-apiserver`, `kube-controller-manager`,
    /// `kube-scheduler`): SIGTERM, then the same command line again. etcd keeps its data
    /// directory. Returns without waiting for it to serve: what recovers, and how fast, is what
    /// a fault test measures.
    pub async fn restart(&self, name: &str) -> Result<(), ControlPlaneError> {
        let mut components = self.components.lock().await;
        let component = components
            .iter_mut()
            .find(|c| c.spec().name == name)
            .ok_or_else(|| ControlPlaneError::Unknown(name.to_owned()))?;
        component.restart(self.group).await?;
        Ok(())
    }

    /// Stops the components in reverse start order (scheduler first, etcd last).
    pub async fn stop(self) {
        let mut components = self.components.into_inner();
        while let Some(component) = components.pop() {
            component.stop().await;
        }
    }
}

/// `logs/audit.log`, or with `PMEM_CSI_AUDIT_DIR` a file of its own there that outlives the
/// work directory (shared testenvs are never stopped, only killed with their test binary).
fn audit_log_path(logs: &Path) -> Result<PathBuf, ControlPlaneError> {
    let Some(dir) = std::env::var_os(audit::AUDIT_DIR_ENV) else {
        return Ok(logs.join("audit.log"));
    };
    let dir = PathBuf::from(dir);
    mkdir(&dir)?;
    let binary = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "testenv".into());
    let unique = logs
        .parent()
        .and_then(Path::file_name)
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(dir.join(format!("{binary}-{unique}.log")))
}

fn mkdir(dir: &Path) -> Result<(), ControlPlaneError> {
    std::fs::create_dir_all(dir).map_err(|source| ControlPlaneError::Write {
        path: dir.to_path_buf(),
        source,
    })
}

/// A client for `kubeconfig` on the current runtime.
pub async fn client_from(kubeconfig: &Path, what: &str) -> Result<kube::Client, ControlPlaneError> {
    let err = |source| ControlPlaneError::Client {
        what: what.to_string(),
        source,
    };
    let raw = kube::config::Kubeconfig::read_from(kubeconfig)
        .map_err(|e| err(kube::Error::InferKubeconfig(e)))?;
    let config = kube::Config::from_custom_kubeconfig(raw, &Default::default())
        .await
        .map_err(|e| err(kube::Error::InferKubeconfig(e)))?;
    kube::Client::try_from(config).map_err(err)
}

/// An unauthenticated client for a component's own health endpoints; their serving
/// certificates are self-signed by the component, so they are not verified.
pub fn anonymous_probe(url: &str, what: &str) -> Result<kube::Client, ControlPlaneError> {
    let err = |source| ControlPlaneError::Client {
        what: what.to_string(),
        source,
    };
    let uri = url
        .parse()
        .map_err(|e: http::uri::InvalidUri| ControlPlaneError::Url {
            url: url.to_string(),
            reason: e.to_string(),
        })?;
    let mut config = kube::Config::new(uri);
    config.accept_invalid_certs = true;
    kube::Client::try_from(config).map_err(err)
}

/// GETs `path` and succeeds on a 2xx answer.
pub async fn probe_path(client: &kube::Client, path: &str) -> Result<(), String> {
    let request = http::Request::get(path)
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    client
        .request_text(request)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

async fn namespaces_exist(client: &kube::Client) -> Result<(), String> {
    let api: Api<Namespace> = Api::all(client.clone());
    for ns in ["default", "kube-system"] {
        api.get(ns)
            .await
            .map_err(|e| format!("namespace {ns}: {e}"))?;
    }
    Ok(())
}

/// Polls `probe` until it succeeds; fails early with the component's log when it exits.
async fn wait_ready<F, Fut>(
    component: Option<&mut Component>,
    name: &str,
    probe: F,
) -> Result<(), ControlPlaneError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let Some(component) = component else {
        return Ok(());
    };
    let start = Instant::now();
    let mut last = String::from("never probed");
    while start.elapsed() < READY_TIMEOUT {
        component.check_running()?;
        match tokio::time::timeout(Duration::from_secs(5), probe()).await {
            Ok(Ok(())) => {
                tracing::info!(name, elapsed = ?start.elapsed(), "ready");
                return Ok(());
            }
            Ok(Err(e)) => last = e,
            Err(_) => last = "probe timed out".into(),
        }
        tokio::time::sleep(POLL).await;
    }
    Err(ControlPlaneError::NotReady {
        name: name.to_string(),
        timeout: READY_TIMEOUT,
        last,
        log: component.spec().log.clone(),
        tail: component.spec().log_tail(20),
    })
}
