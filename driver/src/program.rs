//! The external programs the driver runs and the packages that provide them: a missing program
//! is named with its package wherever it is met (a CSI call answers `FailedPrecondition`, start-up
//! logs it and stays unready), instead of surfacing as "No such file or directory" on a device.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use crate::device_mode::DeviceMode;

/// An external program and the Debian/Ubuntu package that installs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Program {
    /// The name looked up in `PATH`.
    pub name: &'static str,
    /// The package providing it.
    pub package: &'static str,
}

const fn program(name: &'static str, package: &'static str) -> Program {
    Program { name, package }
}

/// Every program the driver may run, by any mode. `tools/ensure.sh` installs the same packages
/// (tests/fresh_machine.rs keeps the two lists in step).
pub const ALL: &[Program] = &[
    program("blkid", "util-linux"),
    program("losetup", "util-linux"),
    program("wipefs", "util-linux"),
    program("mkfs.ext4", "e2fsprogs"),
    program("mkfs.xfs", "xfsprogs"),
    program("resize2fs", "e2fsprogs"),
    program("xfs_growfs", "xfsprogs"),
    program("ndctl", "ndctl"),
    program("lvcreate", "lvm2"),
    program("lvextend", "lvm2"),
    program("lvremove", "lvm2"),
    program("lvs", "lvm2"),
    program("vgs", "lvm2"),
    program("vgcreate", "lvm2"),
    program("vgextend", "lvm2"),
    program("pvs", "lvm2"),
];

/// The programs a driver in `mode` runs: staging makes file systems on every mode with devices;
/// `fake` has none and runs nothing.
pub fn needed(mode: DeviceMode) -> Vec<Program> {
    let names: &[&str] = match mode {
        DeviceMode::Fake => &[],
        DeviceMode::Emulated => &[
            "blkid",
            "losetup",
            "mkfs.ext4",
            "mkfs.xfs",
            "resize2fs",
            "xfs_growfs",
        ],
        // Direct-mode volumes never grow.
        DeviceMode::Direct => &["blkid", "mkfs.ext4", "mkfs.xfs", "ndctl"],
        DeviceMode::Lvm => &[
            "blkid",
            "mkfs.ext4",
            "mkfs.xfs",
            "resize2fs",
            "xfs_growfs",
            "ndctl",
            "wipefs",
            "lvcreate",
            "lvextend",
            "lvremove",
            "lvs",
            "vgs",
            "vgcreate",
            "vgextend",
            "pvs",
        ],
    };
    ALL.iter()
        .filter(|p| names.contains(&p.name))
        .copied()
        .collect()
}

/// The package of `name`, if it is one of the driver's programs.
pub fn package_of(name: &str) -> Option<&'static str> {
    ALL.iter().find(|p| p.name == name).map(|p| p.package)
}

/// A program that is not installed where the driver runs.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "program {program} is not installed (package {package}); install {package} on the node, or run the pmem-csi image, which has it"
)]
pub struct MissingProgram {
    /// The program.
    pub program: String,
    /// The package that provides it.
    pub package: String,
}

impl MissingProgram {
    /// The missing-program error for starting `program` failed with `error`, or `None` when the
    /// failure is something else (permissions, a broken binary).
    pub fn from_spawn(program: &str, error: &std::io::Error) -> Option<Self> {
        if error.kind() != std::io::ErrorKind::NotFound {
            return None;
        }
        let name = Path::new(program)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| program.to_string());
        Some(MissingProgram {
            package: package_of(&name).unwrap_or("unknown").to_string(),
            program: name,
        })
    }
}

/// Where `name` is found in the directories of `path` (a `PATH` value), as `execvp` would.
pub fn find_in(name: &str, path: &OsStr) -> Option<PathBuf> {
    std::env::split_paths(path)
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The programs of `mode` that `path` lacks.
pub fn missing_in(mode: DeviceMode, path: &OsStr) -> Vec<MissingProgram> {
    needed(mode)
        .into_iter()
        .filter(|p| find_in(p.name, path).is_none())
        .map(|p| MissingProgram {
            program: p.name.to_string(),
            package: p.package.to_string(),
        })
        .collect()
}

/// The start-up check: logs each program `mode` lacks in this process's `PATH` and keeps
/// `/readyz` failing with a condition naming it and its package. The driver still serves:
/// volumes that need no missing program keep working, and calls that do answer
/// `FailedPrecondition` with the same text.
pub fn check(mode: DeviceMode, readiness: &controllers::Readiness) -> Vec<MissingProgram> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    check_in(mode, &path, readiness)
}

/// [`check`] against the directories of `path`.
pub fn check_in(
    mode: DeviceMode,
    path: &OsStr,
    readiness: &controllers::Readiness,
) -> Vec<MissingProgram> {
    let missing = missing_in(mode, path);
    for m in &missing {
        tracing::error!(
            program = m.program,
            package = m.package,
            mode = mode.as_str(),
            "a program this device mode runs is not installed: {m}"
        );
        // Registered not ready and never set: only a restart with the program installed clears it.
        readiness.register(format!(
            "{} not installed (package {})",
            m.program, m.package
        ));
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn executable(dir: &Path, name: &str) {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(name);
        std::fs::write(&path, "#!/bin/sh\n").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }

    #[test]
    fn every_needed_program_has_a_package() {
        for mode in [
            DeviceMode::Emulated,
            DeviceMode::Fake,
            DeviceMode::Lvm,
            DeviceMode::Direct,
        ] {
            for p in needed(mode) {
                assert_eq!(package_of(p.name), Some(p.package), "{mode:?} {}", p.name);
            }
        }
        assert!(needed(DeviceMode::Fake).is_empty());
        assert_eq!(needed(DeviceMode::Lvm).len(), 15);
    }

    #[test]
    fn missing_table() {
        let full = tempfile::tempdir().expect("tempdir");
        let partial = tempfile::tempdir().expect("tempdir");
        for p in ALL {
            executable(full.path(), p.name);
        }
        for name in ["blkid", "losetup", "mkfs.ext4", "resize2fs", "xfs_growfs"] {
            executable(partial.path(), name);
        }
        // Not executable: execvp skips it, so must we.
        std::fs::write(partial.path().join("mkfs.xfs"), "").expect("write");
        let names = |m: Vec<MissingProgram>| {
            m.into_iter()
                .map(|m| format!("{}:{}", m.program, m.package))
                .collect::<Vec<_>>()
        };
        for (case, mode, path, want) in [
            (
                "all present",
                DeviceMode::Emulated,
                full.path().as_os_str().to_owned(),
                vec![],
            ),
            (
                "xfs missing (not executable)",
                DeviceMode::Emulated,
                partial.path().as_os_str().to_owned(),
                vec!["mkfs.xfs:xfsprogs"],
            ),
            (
                "found in the second directory",
                DeviceMode::Emulated,
                std::env::join_paths([partial.path(), full.path()]).expect("join"),
                vec![],
            ),
            (
                "direct needs ndctl",
                DeviceMode::Direct,
                partial.path().as_os_str().to_owned(),
                vec!["mkfs.xfs:xfsprogs", "ndctl:ndctl"],
            ),
            ("fake needs nothing", DeviceMode::Fake, "".into(), vec![]),
            (
                "empty PATH",
                DeviceMode::Emulated,
                "".into(),
                vec![
                    "blkid:util-linux",
                    "losetup:util-linux",
                    "mkfs.ext4:e2fsprogs",
                    "mkfs.xfs:xfsprogs",
                    "resize2fs:e2fsprogs",
                    "xfs_growfs:xfsprogs",
                ],
            ),
        ] {
            assert_eq!(names(missing_in(mode, &path)), want, "{case}");
        }
    }

    #[test]
    fn check_holds_readiness() {
        let readiness = controllers::Readiness::default();
        let bin = tempfile::tempdir().expect("tempdir");
        for name in ["blkid", "losetup", "mkfs.ext4", "resize2fs", "xfs_growfs"] {
            executable(bin.path(), name);
        }
        let missing = check_in(DeviceMode::Emulated, bin.path().as_os_str(), &readiness);
        assert_eq!(missing.len(), 1);
        assert_eq!(
            readiness.not_ready(),
            vec!["mkfs.xfs not installed (package xfsprogs)".to_string()]
        );
        let readiness = controllers::Readiness::default();
        assert!(check_in(DeviceMode::Fake, "".as_ref(), &readiness).is_empty());
        assert!(readiness.not_ready().is_empty());
    }

    #[test]
    fn spawn_errors() {
        let not_found = std::io::Error::from(std::io::ErrorKind::NotFound);
        let denied = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        assert_eq!(
            MissingProgram::from_spawn("mkfs.xfs", &not_found),
            Some(MissingProgram {
                program: "mkfs.xfs".into(),
                package: "xfsprogs".into()
            })
        );
        assert_eq!(
            MissingProgram::from_spawn("/usr/sbin/lvcreate", &not_found)
                .map(|m| m.to_string())
                .as_deref(),
            Some(
                "program lvcreate is not installed (package lvm2); install lvm2 on the node, or run the pmem-csi image, which has it"
            )
        );
        assert_eq!(
            MissingProgram::from_spawn("frobnicate", &not_found).map(|m| m.package),
            Some("unknown".into())
        );
        assert_eq!(MissingProgram::from_spawn("mkfs.xfs", &denied), None);
    }
}
