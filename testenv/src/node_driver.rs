//! A `pmem-csi node` process with its own region, state directory and socket, for tests that
//! talk CSI to the real binary (csi-sanity, component and crash tests, simulated nodes).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::process::{Component, ProcessError, ProcessGroup, ProcessSpec};
use crate::wait::{Timeout, until};

/// How long a driver may take to bind its socket (it repairs state first).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Where one driver instance keeps its files.
#[derive(Clone, Debug)]
pub struct NodeDriverDirs {
    /// Socket path.
    pub socket: PathBuf,
    /// `--state-dir`.
    pub state: PathBuf,
    /// `--emulated-dir`.
    pub region: PathBuf,
    /// Log file.
    pub log: PathBuf,
}

impl NodeDriverDirs {
    /// The layout under `root`.
    pub fn under(root: &Path) -> Self {
        Self {
            socket: root.join("csi.sock"),
            state: root.join("state"),
            region: root.join("region"),
            log: root.join("driver.log"),
        }
    }
}

/// Failures starting a driver.
#[derive(Debug, thiserror::Error)]
pub enum NodeDriverError {
    /// The process failed.
    #[error(transparent)]
    Process(#[from] ProcessError),
    /// The socket did not appear.
    #[error("{0}")]
    Timeout(#[from] Timeout),
}

/// Arguments of `pmem-csi node --standalone` for an emulated region of `size` under `dirs`; the admin
/// server listens on a port of the kernel's choice unless the caller adds `--admin-address`.
pub fn emulated_args(node: &str, dirs: &NodeDriverDirs, size: &str) -> Vec<String> {
    vec![
        "node".into(),
        format!("--endpoint=unix://{}", dirs.socket.display()),
        format!("--node-id={node}"),
        "--device-mode=emulated".into(),
        format!("--emulated-dir={}", dirs.region.display()),
        format!("--emulated-size={size}"),
        format!("--state-dir={}", dirs.state.display()),
        "--standalone".into(),
    ]
}

/// Starts `pmem-csi` with `args` in `group` and waits until its socket accepts connections.
pub async fn start(
    binary: &Path,
    args: Vec<String>,
    dirs: &NodeDriverDirs,
    group: &ProcessGroup,
    env: &[(&str, &str)],
) -> Result<Component, NodeDriverError> {
    let _ = std::fs::remove_file(&dirs.socket);
    if let Some(parent) = dirs.log.parent() {
        std::fs::create_dir_all(parent).map_err(|source| ProcessError::Log {
            path: dirs.log.clone(),
            source,
        })?;
    }
    let mut args = args;
    if !args.iter().any(|a| a.starts_with("--admin-address")) {
        args.push("--admin-address=127.0.0.1:0".into());
    }
    let mut spec = ProcessSpec::new("pmem-csi node", binary, &dirs.log).args(args);
    for (k, v) in env {
        spec = spec.env(*k, *v);
    }
    let mut component = Component::start(spec, group)?;
    wait_for_socket(&mut component, &dirs.socket).await?;
    Ok(component)
}

/// Waits until `socket` accepts a connection, failing early if the process exits.
pub async fn wait_for_socket(
    component: &mut Component,
    socket: &Path,
) -> Result<(), NodeDriverError> {
    let start = std::time::Instant::now();
    loop {
        component.check_running()?;
        if tokio::net::UnixStream::connect(socket).await.is_ok() {
            return Ok(());
        }
        if start.elapsed() > START_TIMEOUT {
            return Err(Timeout {
                what: format!("socket {}", socket.display()),
                timeout: START_TIMEOUT,
                last: component.spec().log_tail(10),
            }
            .into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `path` exists (helper for callers polling files).
pub async fn wait_for_path(path: &Path, timeout: Duration) -> Result<(), Timeout> {
    until(&format!("{}", path.display()), timeout, || async {
        if path.exists() {
            Ok(())
        } else {
            Err("missing".to_string())
        }
    })
    .await
}
