//! The driver's error type and its one mapping to gRPC status codes.

use tonic::{Code, Status};

use crate::backend::BackendError;
use crate::filesystem::FsError;
use crate::parameters::ParameterError;
use crate::state::StateError;

/// Why a CSI call failed, with what the caller needs to fix it.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// A required request field is empty.
    #[error("{0} is required")]
    Missing(&'static str),
    /// A request field has an unusable value.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// A parameter or context key or value.
    #[error(transparent)]
    Parameter(#[from] ParameterError),
    /// A mount option the driver does not accept.
    #[error(transparent)]
    MountOption(#[from] crate::mount_options::MountOptionError),
    /// No volume with this ID on this node.
    #[error("volume {id} does not exist on this node")]
    Unknown {
        /// Volume ID.
        id: String,
    },
    /// The path is not where the volume is mounted.
    #[error("{path} is not a mount of volume {id}")]
    NotMounted {
        /// Volume ID.
        id: String,
        /// Path.
        path: String,
    },
    /// A volume of this name exists but does not match the request.
    #[error(
        "volume {name} already exists with {existing}, which does not match the request: {wanted}"
    )]
    Mismatch {
        /// Name.
        name: String,
        /// What exists.
        existing: String,
        /// What was asked.
        wanted: String,
    },
    /// The size cannot satisfy the limit.
    #[error("capacity range cannot be satisfied: {0}")]
    OutOfRange(String),
    /// Not enough room on this node.
    #[error("volume {name}: {source}")]
    NoSpace {
        /// Volume name.
        name: String,
        /// The backend's numbers.
        source: BackendError,
    },
    /// The device holds another file system than requested; it is never reformatted.
    #[error("volume {id} holds {existing}, not the requested {wanted}; refusing to reformat")]
    FsMismatch {
        /// Volume ID.
        id: String,
        /// What it holds.
        existing: String,
        /// What was asked.
        wanted: String,
    },
    /// Something must happen first (stage before publish, unmount before delete, …).
    #[error("{0}")]
    Precondition(String),
    /// The same target is already published differently.
    #[error("{0}")]
    Conflict(String),
    /// Node state I/O.
    #[error(transparent)]
    State(#[from] StateError),
    /// Backend failure other than no space.
    #[error(transparent)]
    Backend(BackendError),
    /// File-system tools.
    #[error(transparent)]
    Fs(#[from] FsError),
    /// Other I/O on a path.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Start-up repair refused: recorded devices are missing.
    #[error(transparent)]
    RepairRefused(#[from] crate::repair::Refusal),
    /// Two names hash to the same volume ID.
    #[error("volume ID {id} of {name} is already used by volume {other}")]
    Collision {
        /// The ID.
        id: String,
        /// The requested name.
        name: String,
        /// The existing volume's name.
        other: String,
    },
}

impl VolumeError {
    /// An I/O error on `path`.
    pub fn io(
        op: &'static str,
        path: impl std::fmt::Display,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_string();
        move |source| VolumeError::Io { op, path, source }
    }

    /// A backend error with the volume name for context.
    pub fn backend(name: &str, e: BackendError) -> Self {
        match e {
            BackendError::NoSpace { .. } => VolumeError::NoSpace {
                name: name.to_string(),
                source: e,
            },
            e => VolumeError::Backend(e),
        }
    }

    /// The gRPC code of this error.
    pub fn code(&self) -> Code {
        match self {
            VolumeError::Missing(_)
            | VolumeError::Invalid { .. }
            | VolumeError::Parameter(_)
            | VolumeError::MountOption(_) => Code::InvalidArgument,
            VolumeError::Unknown { .. } | VolumeError::NotMounted { .. } => Code::NotFound,
            VolumeError::Mismatch { .. }
            | VolumeError::FsMismatch { .. }
            | VolumeError::Conflict(_) => Code::AlreadyExists,
            VolumeError::OutOfRange(_) => Code::OutOfRange,
            VolumeError::NoSpace { .. } => Code::ResourceExhausted,
            VolumeError::Precondition(_) | VolumeError::RepairRefused(_) => {
                Code::FailedPrecondition
            }
            VolumeError::Backend(
                BackendError::InUse { .. }
                | BackendError::NoDevices { .. }
                | BackendError::CannotGrow { .. }
                | BackendError::Missing { .. },
            )
            | VolumeError::Fs(FsError::Missing { .. }) => Code::FailedPrecondition,
            // The tool was killed; the call is idempotent, so the caller's retry finishes it.
            VolumeError::Backend(BackendError::TimedOut { .. })
            | VolumeError::Fs(FsError::TimedOut { .. }) => Code::DeadlineExceeded,
            VolumeError::Backend(_)
            | VolumeError::State(_)
            | VolumeError::Fs(_)
            | VolumeError::Io { .. }
            | VolumeError::Collision { .. } => Code::Internal,
        }
    }
}

impl From<VolumeError> for Status {
    fn from(e: VolumeError) -> Self {
        Status::new(e.code(), e.to_string())
    }
}

impl From<ParameterError> for Status {
    fn from(e: ParameterError) -> Self {
        VolumeError::from(e).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::MissingProgram;

    #[test]
    fn code_table() {
        let no_space = BackendError::NoSpace {
            need: 8,
            largest: 4,
            free: 4,
        };
        for (error, code) in [
            (VolumeError::Missing("volume_id"), Code::InvalidArgument),
            (
                VolumeError::Parameter(ParameterError::Kata),
                Code::InvalidArgument,
            ),
            (VolumeError::Unknown { id: "x".into() }, Code::NotFound),
            (VolumeError::OutOfRange("x".into()), Code::OutOfRange),
            (VolumeError::backend("v", no_space), Code::ResourceExhausted),
            (
                VolumeError::backend("v", BackendError::NoDevices { mode: "fake" }),
                Code::FailedPrecondition,
            ),
            (
                VolumeError::backend(
                    "v",
                    BackendError::CannotGrow {
                        mode: "direct",
                        reason: "r",
                    },
                ),
                Code::FailedPrecondition,
            ),
            (
                VolumeError::backend("v", BackendError::io("a", "b", "c")),
                Code::Internal,
            ),
            (
                VolumeError::Fs(FsError::Missing {
                    tool: "mkfs.xfs",
                    device: "/dev/loop0".into(),
                    source: MissingProgram {
                        program: "mkfs.xfs".into(),
                        package: "xfsprogs".into(),
                    },
                }),
                Code::FailedPrecondition,
            ),
            (
                VolumeError::Fs(FsError::Failed {
                    tool: "mkfs.xfs",
                    device: "/dev/loop0".into(),
                    reason: "bad superblock".into(),
                }),
                Code::Internal,
            ),
            (
                VolumeError::backend(
                    "v",
                    BackendError::Missing {
                        op: "creating",
                        what: "logical volume v".into(),
                        source: MissingProgram {
                            program: "lvcreate".into(),
                            package: "lvm2".into(),
                        },
                    },
                ),
                Code::FailedPrecondition,
            ),
            (
                VolumeError::FsMismatch {
                    id: "x".into(),
                    existing: "xfs".into(),
                    wanted: "ext4".into(),
                },
                Code::AlreadyExists,
            ),
        ] {
            let message = error.to_string();
            assert_eq!(Status::from(error).code(), code, "{message}");
        }
    }

    #[test]
    fn no_space_message_has_sizes() {
        let e = VolumeError::backend(
            "pvc-1",
            BackendError::NoSpace {
                need: 8,
                largest: 4,
                free: 6,
            },
        );
        assert_eq!(
            e.to_string(),
            "volume pvc-1: not enough space for 8 bytes: largest free extent is 4 bytes, 6 bytes free in total"
        );
    }
}
