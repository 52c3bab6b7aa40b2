//! The device mode (`--device-mode`): which backend a driver runs, recorded per volume.

/// Which backend (`--device-mode`); the string is recorded per volume as `deviceMode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum DeviceMode {
    /// Files on loop devices in a budgeted directory (development, kind, tests).
    Emulated,
    /// In memory, no devices (scale tests of the control plane).
    Fake,
    /// Logical volumes in PMEM-CSI's volume groups on `pmem-csi` fsdax namespaces.
    Lvm,
    /// One PMEM namespace per volume.
    Direct,
}

impl DeviceMode {
    /// The `deviceMode` string.
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceMode::Emulated => "emulated",
            DeviceMode::Fake => "fake",
            DeviceMode::Lvm => "lvm",
            DeviceMode::Direct => "direct",
        }
    }

    /// The mode a recorded `deviceMode` names; PMEM-CSI's old `ndctl` means `direct`.
    pub fn parse(recorded: &str) -> Option<Self> {
        match recorded {
            "emulated" => Some(DeviceMode::Emulated),
            "fake" => Some(DeviceMode::Fake),
            "lvm" => Some(DeviceMode::Lvm),
            "direct" | "ndctl" => Some(DeviceMode::Direct),
            _ => None,
        }
    }
}
