//! Where the real Kubernetes binaries and our own `pmem-csi` binary are.
//!
//! The Go tools are built by `tools/build.sh` (`just tools`) into a per-machine cache; testenv
//! never builds them itself, so a missing tool fails fast with the command that fixes it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Every Go tool testenv or the suites use.
pub const GO_TOOLS: &[&str] = &[
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "csi-provisioner",
    "csi-resizer",
    "csi-sanity",
];

/// What can go wrong locating tools.
#[derive(Debug, thiserror::Error)]
pub enum ToolsError {
    /// `tools/build.sh --print-dir` could not be run.
    #[error("running {script} --print-dir: {reason}")]
    Script {
        /// The script.
        script: PathBuf,
        /// Why.
        reason: String,
    },
    /// A binary is not where it should be.
    #[error("{name} not found at {path}; run `just tools` to build the pinned Kubernetes tools")]
    Missing {
        /// The tool.
        name: String,
        /// Where it was expected.
        path: PathBuf,
    },
    /// Our own binary is not built.
    #[error("pmem-csi binary not found at {path}; run `cargo build` first or set PMEM_CSI_BIN")]
    MissingOwn {
        /// Where it was expected.
        path: PathBuf,
    },
}

/// Paths of the binaries testenv runs.
#[derive(Clone, Debug)]
pub struct Tools {
    go_bin: PathBuf,
    pmem_csi: PathBuf,
}

/// The repository root (this crate lives in `<root>/testenv`).
pub fn repo_root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

impl Tools {
    /// Locates the tools: `PMEM_CSI_TOOLS_DIR` or the pinned cache directory for the Go tools,
    /// `PMEM_CSI_BIN` or the cargo target directory of the running executable for ours.
    pub fn locate() -> Result<Self, ToolsError> {
        let go_bin = match std::env::var_os("PMEM_CSI_TOOLS_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => {
                let script = repo_root().join("tools/build.sh");
                let out = Command::new("bash")
                    .arg(&script)
                    .arg("--print-dir")
                    .output()
                    .map_err(|e| ToolsError::Script {
                        script: script.clone(),
                        reason: e.to_string(),
                    })?;
                if !out.status.success() {
                    return Err(ToolsError::Script {
                        script,
                        reason: String::from_utf8_lossy(&out.stderr).into_owned(),
                    });
                }
                PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
            }
        };
        for name in GO_TOOLS {
            let path = go_bin.join(name);
            if !path.is_file() {
                return Err(ToolsError::Missing {
                    name: (*name).to_string(),
                    path,
                });
            }
        }
        let pmem_csi = match std::env::var_os("PMEM_CSI_BIN") {
            Some(path) => PathBuf::from(path),
            None => own_binary_beside_current_exe(),
        };
        if !pmem_csi.is_file() {
            return Err(ToolsError::MissingOwn { path: pmem_csi });
        }
        Ok(Self { go_bin, pmem_csi })
    }

    /// The path of Go tool `name` (one of [`GO_TOOLS`]).
    pub fn go(&self, name: &str) -> PathBuf {
        self.go_bin.join(name)
    }

    /// The `pmem-csi` binary.
    pub fn pmem_csi(&self) -> &Path {
        &self.pmem_csi
    }
}

/// The directory of `tools/ops-tools.sh` (Prometheus, promtool, shellcheck, tsc):
/// `PMEM_CSI_OPS_TOOLS_DIR`, else what the script prints (empty when it cannot run).
pub fn ops_tools_dir() -> PathBuf {
    cached_tool_dir("PMEM_CSI_OPS_TOOLS_DIR", "ops-tools.sh")
}

/// The helm binary of `tools/helm.sh`: under `PMEM_CSI_HELM_DIR`, else under what the script
/// prints (a path that does not exist when it cannot run).
pub fn helm() -> PathBuf {
    cached_tool_dir("PMEM_CSI_HELM_DIR", "helm.sh").join("helm")
}

/// The cache directory of a `tools/<script>` that takes `--print-dir`: `variable` when set (the
/// justfile exports them), else what the script prints (empty when it cannot run).
fn cached_tool_dir(variable: &str, script: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os(variable) {
        return PathBuf::from(dir);
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tools")
        .join(script);
    std::process::Command::new("bash")
        .arg(script)
        .arg("--print-dir")
        .output()
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        .unwrap_or_default()
}

/// Test executables live in `target/<profile>/deps`, binaries in `target/<profile>`.
fn own_binary_beside_current_exe() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join("pmem-csi")
}
