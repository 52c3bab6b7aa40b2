//! Which volume capabilities the driver supports: node-local volumes, so single-node access
//! modes only; mount with ext4 or xfs, or raw block.

use crate::csi::VolumeCapability;
use crate::csi::volume_capability::{AccessType, access_mode::Mode};
use crate::error::VolumeError;
use crate::filesystem::FsType;

/// How a validated capability wants the volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Access {
    /// A file system, with mount flags.
    Mount {
        /// `fs_type`, `None` = the driver's default.
        fs: Option<FsType>,
        /// `mount_flags`.
        flags: Vec<String>,
    },
    /// The raw block device.
    Block,
}

/// Checks one capability and says how it accesses the volume.
pub fn access(capability: &VolumeCapability) -> Result<Access, VolumeError> {
    let mode = capability
        .access_mode
        .as_ref()
        .ok_or(VolumeError::Missing("volume_capability.access_mode"))?
        .mode;
    match Mode::try_from(mode) {
        Ok(
            Mode::SingleNodeWriter
            | Mode::SingleNodeReaderOnly
            | Mode::SingleNodeSingleWriter
            | Mode::SingleNodeMultiWriter,
        ) => {}
        Ok(other) => {
            return Err(VolumeError::Invalid {
                field: "volume_capability.access_mode",
                reason: format!(
                    "{} is not supported: volumes are local to one node",
                    other.as_str_name()
                ),
            });
        }
        Err(_) => {
            return Err(VolumeError::Invalid {
                field: "volume_capability.access_mode",
                reason: format!("unknown access mode {mode}"),
            });
        }
    }
    match &capability.access_type {
        Some(AccessType::Block(_)) => Ok(Access::Block),
        Some(AccessType::Mount(m)) => {
            let fs = if m.fs_type.is_empty() {
                None
            } else {
                Some(
                    FsType::parse(&m.fs_type).ok_or_else(|| VolumeError::Invalid {
                        field: "volume_capability.mount.fs_type",
                        reason: format!("{:?} is not supported (ext4, xfs)", m.fs_type),
                    })?,
                )
            };
            // Checked here so that CreateVolume already refuses options no stage could mount.
            crate::mount_options::MountOptions::parse(&m.mount_flags)?;
            Ok(Access::Mount {
                fs,
                flags: m.mount_flags.clone(),
            })
        }
        None => Err(VolumeError::Missing("volume_capability.access_type")),
    }
}

/// Checks every capability of a list that must not be empty.
pub fn access_all(capabilities: &[VolumeCapability]) -> Result<Vec<Access>, VolumeError> {
    if capabilities.is_empty() {
        return Err(VolumeError::Missing("volume_capabilities"));
    }
    capabilities.iter().map(access).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csi::volume_capability::{AccessMode, BlockVolume, MountVolume};

    fn cap(mode: Mode, access_type: Option<AccessType>) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode { mode: mode as i32 }),
            access_type,
        }
    }

    fn mount(fs: &str) -> Option<AccessType> {
        Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: vec!["noatime".into()],
            volume_mount_group: String::new(),
        }))
    }

    #[test]
    fn access_table() {
        for (name, capability, want) in [
            (
                "mount default fs",
                cap(Mode::SingleNodeWriter, mount("")),
                Ok(Access::Mount {
                    fs: None,
                    flags: vec!["noatime".into()],
                }),
            ),
            (
                "mount xfs",
                cap(Mode::SingleNodeWriter, mount("xfs")),
                Ok(Access::Mount {
                    fs: Some(FsType::Xfs),
                    flags: vec!["noatime".into()],
                }),
            ),
            (
                "block",
                cap(
                    Mode::SingleNodeReaderOnly,
                    Some(AccessType::Block(BlockVolume {})),
                ),
                Ok(Access::Block),
            ),
            (
                "other fs",
                cap(Mode::SingleNodeWriter, mount("btrfs")),
                Err("volume_capability.mount.fs_type"),
            ),
            (
                "multi node",
                cap(Mode::MultiNodeMultiWriter, mount("")),
                Err("volume_capability.access_mode"),
            ),
            (
                "no access type",
                cap(Mode::SingleNodeWriter, None),
                Err("volume_capability.access_type"),
            ),
            (
                "no access mode",
                VolumeCapability {
                    access_mode: None,
                    access_type: mount(""),
                },
                Err("volume_capability.access_mode"),
            ),
        ] {
            match (access(&capability), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{name}"),
                (Err(e), Err(field)) => {
                    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{name}");
                    assert!(e.to_string().contains(field), "{name}: {e}");
                }
                (got, want) => panic!("{name}: got {got:?}, want {want:?}"),
            }
        }
        assert!(access_all(&[]).is_err());
    }
}
