//! A volume capability's `mount_flags` (a StorageClass's `mountOptions`) split as mount(8)
//! splits them: generic options such as `noatime`, `nosuid` or `ro` are flags of the mount(2)
//! call, only the rest is the file system's own data. Passed whole as data, ext4 and xfs refuse
//! `noatime` ("Unknown parameter"), so a class with common options could never be staged.

use rustix::mount::MountFlags;

/// The field every rejection names.
pub const FIELD: &str = "volume_capability.mount.mount_flags";

/// Mount options, split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountOptions {
    /// Flags to set. `nosuid` and `nodev` are always among them: volumes never carry set-uid
    /// programs or device nodes that take effect.
    pub flags: MountFlags,
    /// The file system's own options, in the order given.
    pub data: Vec<String>,
}

/// An option the driver does not accept.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MountOptionError {
    /// Empty, or holding a NUL byte.
    #[error("{FIELD}: {option:?} is not a mount option")]
    Malformed {
        /// The option.
        option: String,
    },
    /// An option that would lift what the driver always enforces or change what it mounts.
    #[error("{FIELD}: {option:?} is not allowed: {reason}")]
    NotAllowed {
        /// The option.
        option: String,
        /// Why.
        reason: &'static str,
    },
}

/// The flags of mount(8)'s generic options that set a flag.
const SETS: &[(&str, MountFlags)] = &[
    ("ro", MountFlags::RDONLY),
    ("noexec", MountFlags::NOEXEC),
    ("nosuid", MountFlags::NOSUID),
    ("nodev", MountFlags::NODEV),
    ("sync", MountFlags::SYNCHRONOUS),
    ("dirsync", MountFlags::DIRSYNC),
    ("noatime", MountFlags::NOATIME),
    ("nodiratime", MountFlags::NODIRATIME),
    ("relatime", MountFlags::RELATIME),
    ("strictatime", MountFlags::STRICTATIME),
    ("lazytime", MountFlags::LAZYTIME),
    ("silent", MountFlags::SILENT),
];

/// Generic options that clear a flag (or only restate a default).
const CLEARS: &[(&str, MountFlags)] = &[
    ("rw", MountFlags::RDONLY),
    ("exec", MountFlags::NOEXEC),
    ("async", MountFlags::SYNCHRONOUS),
    ("atime", MountFlags::NOATIME),
    ("diratime", MountFlags::NODIRATIME),
    ("norelatime", MountFlags::RELATIME),
    ("nostrictatime", MountFlags::STRICTATIME),
    ("nolazytime", MountFlags::LAZYTIME),
    ("loud", MountFlags::SILENT),
    ("defaults", MountFlags::empty()),
];

/// The access-time modes, of which one applies.
const ATIME_MODES: MountFlags = MountFlags::NOATIME
    .union(MountFlags::RELATIME)
    .union(MountFlags::STRICTATIME);

/// Per-mount flags: the ones a bind mount can carry (`MS_REMOUNT | MS_BIND` changes only these;
/// `sync`, `dirsync` and `lazytime` belong to the file system and were set at staging).
const PER_MOUNT: MountFlags = MountFlags::RDONLY
    .union(MountFlags::NOSUID)
    .union(MountFlags::NODEV)
    .union(MountFlags::NOEXEC)
    .union(MountFlags::NOATIME)
    .union(MountFlags::NODIRATIME)
    .union(MountFlags::RELATIME)
    .union(MountFlags::STRICTATIME);

impl MountOptions {
    /// Splits `options` (each entry may itself be a comma-separated list, as in a StorageClass),
    /// later options overriding earlier ones as in mount(8).
    pub fn parse(options: &[String]) -> Result<Self, MountOptionError> {
        let mut flags = MountFlags::NOSUID | MountFlags::NODEV;
        let mut data = Vec::new();
        for option in options.iter().flat_map(|o| o.split(',')) {
            let option = option.trim();
            if option.is_empty() || option.contains('\0') {
                return Err(MountOptionError::Malformed {
                    option: option.to_string(),
                });
            }
            if let Some((_, flag)) = SETS.iter().find(|(name, _)| *name == option) {
                // The access-time options choose one mode: the last one given wins, as in
                // mount(8) (the kernel would let noatime win over a later relatime).
                if ATIME_MODES.contains(*flag) {
                    flags -= ATIME_MODES;
                }
                flags |= *flag;
                continue;
            }
            if let Some((_, flag)) = CLEARS.iter().find(|(name, _)| *name == option) {
                flags -= *flag;
                continue;
            }
            let not_allowed = |reason| MountOptionError::NotAllowed {
                option: option.to_string(),
                reason,
            };
            match option {
                "suid" | "dev" => {
                    return Err(not_allowed("the driver always mounts volumes nosuid,nodev"));
                }
                "bind" | "rbind" | "remount" | "move" | "loop" | "owner" | "user" | "users"
                | "nouser" | "auto" | "noauto" | "nofail" | "_netdev" => {
                    return Err(not_allowed(
                        "it is an option of mount(8) or fstab, not of the mount itself",
                    ));
                }
                "mand" | "nomand" => {
                    return Err(not_allowed("mandatory locking is gone from Linux"));
                }
                _ if option.starts_with("x-") => {
                    return Err(not_allowed("x- options are for fstab tools"));
                }
                _ => data.push(option.to_string()),
            }
        }
        Ok(Self { flags, data })
    }

    /// Whether these options make the mount read-only.
    pub fn read_only(&self) -> bool {
        self.flags.contains(MountFlags::RDONLY)
    }

    /// The flags a bind mount of the staged file system gets: the per-mount ones, plus
    /// read-only when asked. `nosuid` and `nodev` are always kept (a plain read-only remount
    /// would drop them).
    pub fn bind_flags(&self, read_only: bool) -> MountFlags {
        let mut flags = self.flags & PER_MOUNT;
        if read_only {
            flags |= MountFlags::RDONLY;
        }
        flags
    }

    /// The data string, with `extra` (such as `dax`) appended.
    pub fn data_with(&self, extra: &[&str]) -> String {
        self.data
            .iter()
            .map(String::as_str)
            .chain(extra.iter().copied())
            .collect::<Vec<_>>()
            .join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parse_table() {
        let base = MountFlags::NOSUID | MountFlags::NODEV;
        for (case, options, flags, data) in [
            ("nothing", &[][..], base, &[][..]),
            (
                "noatime is a flag",
                &["noatime"][..],
                base | MountFlags::NOATIME,
                &[][..],
            ),
            (
                "comma list in one entry, data kept in order",
                &["noatime,discard", "nodiratime", "errors=remount-ro"][..],
                base | MountFlags::NOATIME | MountFlags::NODIRATIME,
                &["discard", "errors=remount-ro"][..],
            ),
            ("ro", &["ro"][..], base | MountFlags::RDONLY, &[][..]),
            ("rw after ro wins", &["ro", "rw"][..], base, &[][..]),
            (
                "atime after noatime wins",
                &["noatime", "atime", "relatime"][..],
                base | MountFlags::RELATIME,
                &[][..],
            ),
            (
                "relatime after noatime wins",
                &["noatime", "relatime"][..],
                base | MountFlags::RELATIME,
                &[][..],
            ),
            (
                "noatime after strictatime wins",
                &["strictatime", "noatime"][..],
                base | MountFlags::NOATIME,
                &[][..],
            ),
            (
                "restating the enforced flags",
                &["nosuid", "nodev", "noexec", "defaults"][..],
                base | MountFlags::NOEXEC,
                &[][..],
            ),
            (
                "superblock flags",
                &["sync", "dirsync", "lazytime"][..],
                base | MountFlags::SYNCHRONOUS | MountFlags::DIRSYNC | MountFlags::LAZYTIME,
                &[][..],
            ),
            (
                "spaces around list items",
                &["noatime, discard"][..],
                base | MountFlags::NOATIME,
                &["discard"][..],
            ),
        ] {
            let got = MountOptions::parse(&strings(options)).expect(case);
            assert_eq!(got.flags, flags, "{case}");
            assert_eq!(got.data, strings(data), "{case}");
        }
    }

    #[test]
    fn rejections_name_the_field_and_the_option() {
        for (options, want) in [
            (
                &["suid"][..],
                "volume_capability.mount.mount_flags: \"suid\" is not allowed: the driver always mounts volumes nosuid,nodev",
            ),
            (
                &["noatime", "dev"][..],
                "volume_capability.mount.mount_flags: \"dev\" is not allowed: the driver always mounts volumes nosuid,nodev",
            ),
            (
                &["bind"][..],
                "volume_capability.mount.mount_flags: \"bind\" is not allowed: it is an option of mount(8) or fstab, not of the mount itself",
            ),
            (
                &["noatime,,discard"][..],
                "volume_capability.mount.mount_flags: \"\" is not a mount option",
            ),
            (
                &["a\0b"][..],
                "volume_capability.mount.mount_flags: \"a\\0b\" is not a mount option",
            ),
            (
                &["x-systemd.automount"][..],
                "volume_capability.mount.mount_flags: \"x-systemd.automount\" is not allowed: x- options are for fstab tools",
            ),
        ] {
            let err = MountOptions::parse(&strings(options)).expect_err(want);
            assert_eq!(err.to_string(), want);
        }
    }

    #[test]
    fn bind_flags_keep_nosuid_nodev_and_drop_superblock_flags() {
        let o = MountOptions::parse(&strings(&["noatime", "sync", "discard"])).expect("parse");
        assert_eq!(
            o.bind_flags(false),
            MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOATIME
        );
        assert_eq!(
            o.bind_flags(true),
            MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOATIME | MountFlags::RDONLY
        );
        let ro = MountOptions::parse(&strings(&["ro"])).expect("parse");
        assert!(ro.read_only());
        assert!(ro.bind_flags(false).contains(MountFlags::RDONLY));
        assert_eq!(o.data_with(&["dax"]), "discard,dax");
        assert_eq!(MountOptions::parse(&[]).expect("parse").data_with(&[]), "");
    }
}
