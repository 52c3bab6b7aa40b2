//! Mounts: reading `/proc/self/mountinfo`, and mounting through system calls.

use std::path::{Path, PathBuf};

use rustix::mount::{MountFlags, UnmountFlags};

use crate::mount_options::MountOptions;

/// One line of mountinfo.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountInfo {
    /// Root of the mount within its file system (`/` or, for a bind of a device node,
    /// the node's path within devtmpfs).
    pub root: String,
    /// Mount point.
    pub mount_point: PathBuf,
    /// Per-mount options (`rw`, `ro`, …).
    pub options: Vec<String>,
    /// File system type.
    pub fs_type: String,
    /// Source (a device path for block file systems).
    pub source: String,
    /// Per-superblock options (`dax=always`, …).
    pub super_options: Vec<String>,
}

impl MountInfo {
    /// Whether the mount is read-only.
    pub fn read_only(&self) -> bool {
        self.options.iter().any(|o| o == "ro")
    }

    /// Whether this mount shows `device`: a file system on it, or the device node itself
    /// bind-mounted (raw block publish). The same device can have several paths (a logical
    /// volume's `/dev/<vg>/<lv>`, `/dev/mapper/…`, `/dev/dm-N`), so beyond the path given, the
    /// device numbers decide where the nodes exist.
    pub fn shows_device(&self, device: &Path) -> bool {
        if Path::new(&self.source) == device {
            return true;
        }
        let resolved = std::fs::canonicalize(device).unwrap_or_else(|_| device.to_path_buf());
        if Path::new(&self.source) == resolved {
            return true;
        }
        let node = block_device_number(&resolved);
        if self.fs_type == "devtmpfs" {
            // A bind of the node: the mount point is the node.
            if node.is_some() && block_device_number(&self.mount_point) == node {
                return true;
            }
            let Some(name) = resolved.file_name() else {
                return false;
            };
            return Path::new(&self.root) == Path::new("/").join(name);
        }
        node.is_some() && block_device_number(Path::new(&self.source)) == node
    }
}

/// The device number of block device `path`, if it is one.
pub fn block_device_number(path: &Path) -> Option<u64> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::metadata(path).ok()?;
    meta.file_type().is_block_device().then(|| meta.rdev())
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(field: &str) -> String {
    field
        .replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// Parses mountinfo text; malformed lines are skipped.
pub fn parse(text: &str) -> Vec<MountInfo> {
    text.lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            let pre: Vec<&str> = pre.split(' ').collect();
            let post: Vec<&str> = post.split(' ').collect();
            if pre.len() < 6 || post.len() < 3 {
                return None;
            }
            Some(MountInfo {
                root: unescape(pre[3]),
                mount_point: PathBuf::from(unescape(pre[4])),
                options: pre[5].split(',').map(str::to_string).collect(),
                fs_type: post[0].to_string(),
                source: unescape(post[1]),
                super_options: post[2].split(',').map(str::to_string).collect(),
            })
        })
        .collect()
}

/// The current mount table.
pub fn table() -> std::io::Result<Vec<MountInfo>> {
    Ok(parse(&std::fs::read_to_string("/proc/self/mountinfo")?))
}

/// The top-most mount at exactly `path`, if any.
pub fn at(path: &Path) -> std::io::Result<Option<MountInfo>> {
    Ok(table()?.into_iter().rev().find(|m| m.mount_point == path))
}

/// Mounts file system `fs_type` on `device` at `target` with `options` (`nosuid` and `nodev`
/// among their flags), read-only if asked, `extra` appended to the file system's data.
pub fn mount_device(
    device: &Path,
    target: &Path,
    fs_type: &str,
    read_only: bool,
    options: &MountOptions,
    extra: &[&str],
) -> std::io::Result<()> {
    let mut flags = options.flags;
    if read_only {
        flags |= MountFlags::RDONLY;
    }
    let data = std::ffi::CString::new(options.data_with(extra)).map_err(std::io::Error::other)?;
    rustix::mount::mount(device, target, fs_type, flags, data.as_c_str()).map_err(Into::into)
}

/// Bind-mounts `source` on `target`, read-only if asked (a second, remounting step: the kernel
/// ignores `MS_RDONLY` on the initial bind). For device nodes and /sys: no `nodev` here, which
/// would make a raw block volume's node unusable.
pub fn bind(source: &Path, target: &Path, read_only: bool) -> std::io::Result<()> {
    rustix::mount::mount_bind(source, target)?;
    if read_only {
        remount_bind(target, MountFlags::RDONLY)?;
    }
    Ok(())
}

/// Bind-mounts the staged file system `source` on `target` with the per-mount flags of
/// `options` (and read-only if asked): the kernel ignores flags on the initial bind, and a
/// remount sets exactly the flags it is given, so `nosuid` and `nodev` are always restated
/// (a plain read-only remount would drop them).
pub fn bind_file_system(
    source: &Path,
    target: &Path,
    read_only: bool,
    options: &MountOptions,
) -> std::io::Result<()> {
    rustix::mount::mount_bind(source, target)?;
    remount_bind(target, options.bind_flags(read_only))
}

fn remount_bind(target: &Path, flags: MountFlags) -> std::io::Result<()> {
    let result = rustix::mount::mount_remount(target, MountFlags::BIND | flags, c"");
    if let Err(e) = result {
        let _ = rustix::mount::unmount(target, UnmountFlags::empty());
        return Err(e.into());
    }
    Ok(())
}

/// Unmounts `target`; not mounted is not an error.
pub fn unmount(target: &Path) -> std::io::Result<()> {
    match rustix::mount::unmount(target, UnmountFlags::empty()) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
36 35 98:0 / /mnt/staging rw,noatime master:1 - ext4 /dev/loop3 rw,errors=continue
37 35 98:0 / /pods/a\\040b rw shared:2 - ext4 /dev/loop3 rw
38 35 0:5 /loop4 /pods/block ro,nosuid - devtmpfs udev rw,size=10m
bogus line";

    #[test]
    fn parse_sample() {
        let m = parse(SAMPLE);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].mount_point, PathBuf::from("/mnt/staging"));
        assert_eq!(m[0].source, "/dev/loop3");
        assert_eq!(m[0].fs_type, "ext4");
        assert!(!m[0].read_only());
        assert_eq!(m[1].mount_point, PathBuf::from("/pods/a b"));
        assert!(m[2].read_only());
    }

    #[test]
    fn shows_device_table() {
        let m = parse(SAMPLE);
        for (i, device, want) in [
            (0, "/dev/loop3", true),
            (0, "/dev/loop4", false),
            (2, "/dev/loop4", true),
            (2, "/dev/loop3", false),
        ] {
            assert_eq!(m[i].shows_device(Path::new(device)), want, "{i} {device}");
        }
    }

    #[test]
    fn a_symlinked_device_is_recognised_by_its_node() {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = dir.path().join("dm-7");
        std::fs::write(&node, b"").expect("node");
        let link = dir.path().join("pvc-1a-volume");
        std::os::unix::fs::symlink(&node, &link).expect("symlink");
        let bind = MountInfo {
            root: "/dm-7".into(),
            mount_point: "/target".into(),
            options: vec!["rw".into()],
            fs_type: "devtmpfs".into(),
            source: "udev".into(),
            super_options: Vec::new(),
        };
        assert!(bind.shows_device(&link));
        assert!(!bind.shows_device(&dir.path().join("missing")));
        let fs = MountInfo {
            root: "/".into(),
            fs_type: "ext4".into(),
            source: node.display().to_string(),
            ..bind
        };
        assert!(
            fs.shows_device(&link),
            "mounted through the node's own path"
        );
    }
}
