//! File systems on volumes: detecting what a device holds and making ext4 or xfs, through the
//! standard tools (`blkid`, `mkfs.ext4`, `mkfs.xfs`).

use crate::program::MissingProgram;
use crate::tool::{self, ToolError};
use std::path::Path;

/// File systems the driver makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FsType {
    /// ext4.
    Ext4,
    /// xfs.
    Xfs,
}

impl FsType {
    /// The kernel's name.
    pub fn as_str(self) -> &'static str {
        match self {
            FsType::Ext4 => "ext4",
            FsType::Xfs => "xfs",
        }
    }

    /// Parses a volume capability's `fs_type`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "ext4" => Some(FsType::Ext4),
            "xfs" => Some(FsType::Xfs),
            _ => None,
        }
    }
}

/// A file-system tool failed.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// The tool is not installed: its package is named, and the call is refused with
    /// `FailedPrecondition` (the device was not the problem).
    #[error("{tool} on {device}: {source}")]
    Missing {
        /// The tool.
        tool: &'static str,
        /// The device.
        device: String,
        /// The program and its package.
        source: MissingProgram,
    },
    /// The tool did not finish within `--tool-timeout` and was killed.
    #[error("{tool} on {device}: {source}")]
    TimedOut {
        /// The tool.
        tool: &'static str,
        /// The device.
        device: String,
        /// The command and the timeout.
        source: Box<ToolError>,
    },
    /// The tool ran and failed, or could not be started for another reason.
    #[error("{tool} on {device}: {reason}")]
    Failed {
        /// The tool.
        tool: &'static str,
        /// The device.
        device: String,
        /// Why.
        reason: String,
    },
}

impl FsError {
    fn run(tool: &'static str, device: &Path, e: ToolError) -> Self {
        let device = device.display().to_string();
        match e {
            ToolError::Missing(source) => FsError::Missing {
                tool,
                device,
                source,
            },
            e @ ToolError::TimedOut { .. } => FsError::TimedOut {
                tool,
                device,
                source: Box::new(e),
            },
            e => FsError::Failed {
                tool,
                device,
                reason: e.to_string(),
            },
        }
    }
}

/// The file-system (or other) signature on `device`, `None` when it is empty.
pub fn detect(device: &Path) -> Result<Option<String>, FsError> {
    let err = |reason: String| FsError::Failed {
        tool: "blkid",
        device: device.display().to_string(),
        reason,
    };
    // -p probes the device itself instead of trusting blkid's cache.
    let args = [
        "-p".as_ref(),
        "-o".as_ref(),
        "value".as_ref(),
        "-s".as_ref(),
        "TYPE".as_ref(),
        device.as_os_str(),
    ];
    let out = tool::output("blkid", &args).map_err(|e| FsError::run("blkid", device, e))?;
    match out.status.code() {
        Some(0) => {
            let kind = String::from_utf8_lossy(&out.stdout).trim().to_string();
            Ok(Some(if kind.is_empty() {
                "unknown".into()
            } else {
                kind
            }))
        }
        // 2: nothing found.
        Some(2) => Ok(None),
        _ => Err(err(String::from_utf8_lossy(&out.stderr).trim().to_string())),
    }
}

/// Makes `fs` on `device`, with PMEM-CSI's layout options: 4 KiB blocks; for ext4 2 MiB
/// stripes so that DAX mappings can use huge pages. xfs gets no stripe unit: current xfsprogs
/// derives a 2 MiB log stripe from it and refuses (its maximum is 256 KiB); PMEM-CSI's 2 MiB
/// `extsize` hint for xfs is not carried over.
pub fn make(device: &Path, fs: FsType) -> Result<(), FsError> {
    let (tool, options): (&'static str, &[&str]) = match fs {
        FsType::Ext4 => (
            "mkfs.ext4",
            &[
                "-q",
                "-F",
                "-b",
                "4096",
                "-E",
                "stride=512,stripe_width=512",
            ],
        ),
        FsType::Xfs => (
            "mkfs.xfs",
            &["-q", "-f", "-b", "size=4096", "-m", "reflink=0"],
        ),
    };
    let mut args: Vec<&std::ffi::OsStr> = options.iter().map(|o| o.as_ref()).collect();
    args.push(device.as_os_str());
    run(tool, &args, device)
}

/// Runs `tool` with `args` on `device`'s behalf, failing with its message.
fn run(tool: &'static str, args: &[&std::ffi::OsStr], device: &Path) -> Result<(), FsError> {
    let out = tool::output(tool, args).map_err(|e| FsError::run(tool, device, e))?;
    if !out.status.success() {
        return Err(FsError::Failed {
            tool,
            device: device.display().to_string(),
            reason: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// `CAP_SYS_RESOURCE` (linux/capability.h).
const CAP_SYS_RESOURCE: u32 = 24;

/// Why the file system `fs_type` (a mount's type; `devtmpfs` is a raw block volume) cannot grow
/// while mounted here, if it cannot: checked before the device grows, so that a refusal changes
/// nothing.
pub fn online_growth_refused(fs_type: &str) -> Option<String> {
    match fs_type {
        // The kernel's EXT4_IOC_RESIZE_FS demands it; xfs_growfs needs CAP_SYS_ADMIN, which
        // mounting needed already.
        "ext4" if !has_effective_capability(CAP_SYS_RESOURCE) => Some(
            "growing a mounted ext4 file system needs CAP_SYS_RESOURCE, which the node driver's process lacks (run its container privileged, as the manifests do)".into(),
        ),
        "ext4" | "xfs" | "devtmpfs" => None,
        other => Some(format!("the driver cannot grow a mounted {other} file system")),
    }
}

/// Whether this process has capability `bit` in its effective set (`CapEff` of
/// /proc/self/status); false when that cannot be read.
fn has_effective_capability(bit: u32) -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
            u64::from_str_radix(hex.trim(), 16).ok()
        })
        .is_some_and(|set| set & (1 << bit) != 0)
}

/// Grows the file system `fs_type` mounted at `mount_point` from `device` to fill the device,
/// online: `resize2fs` for ext4 (on the device), `xfs_growfs` for xfs (on the mount point).
/// Both do nothing, successfully, when there is nothing to grow, so a retry is harmless.
pub fn grow(fs_type: &str, device: &Path, mount_point: &Path) -> Result<(), FsError> {
    let (tool, target) = match fs_type {
        "ext4" => ("resize2fs", device),
        "xfs" => ("xfs_growfs", mount_point),
        other => {
            return Err(FsError::Failed {
                tool: "growing",
                device: device.display().to_string(),
                reason: format!("the driver cannot grow a {other} file system"),
            });
        }
    };
    run(tool, &[target.as_os_str()], device)
}
