//! Loop devices through the standard `losetup` tool, and their backing files through sysfs.

use crate::backend::BackendError;
use crate::tool;
use std::path::{Path, PathBuf};

/// Loop devices and their backing files, read from `/sys/block/loop*/loop/backing_file`.
pub fn attached() -> Vec<(PathBuf, PathBuf)> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with("loop") {
                return None;
            }
            let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            let backing = backing.trim().trim_end_matches(" (deleted)");
            Some((
                PathBuf::from(format!("/dev/{name}")),
                PathBuf::from(backing),
            ))
        })
        .collect()
}

/// The loop device backed by `file`, if any.
pub fn find(file: &Path) -> Option<PathBuf> {
    attached()
        .into_iter()
        .find(|(_, backing)| backing == file)
        .map(|(device, _)| device)
}

/// Attaches `file` to a free loop device and returns it.
pub fn attach(file: &Path) -> Result<PathBuf, BackendError> {
    let out = tool::output(
        "losetup",
        &["--find".as_ref(), "--show".as_ref(), file.as_os_str()],
    )
    .map_err(|e| BackendError::tool("running losetup for", file.display(), e))?;
    if !out.status.success() {
        return Err(BackendError::io(
            "attaching a loop device to",
            file.display(),
            String::from_utf8_lossy(&out.stderr).trim(),
        ));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// Makes the kernel re-read the size of `device`'s backing file (after it grew).
pub fn refresh_capacity(device: &Path) -> Result<(), BackendError> {
    losetup("--set-capacity", "refreshing the size of", device)
}

/// Detaches `device`.
pub fn detach(device: &Path) -> Result<(), BackendError> {
    losetup("--detach", "detaching", device)
}

/// `losetup <option> <device>`, failing with `op` and losetup's message.
fn losetup(option: &str, op: &'static str, device: &Path) -> Result<(), BackendError> {
    let out = tool::output("losetup", &[option.as_ref(), device.as_os_str()])
        .map_err(|e| BackendError::tool("running losetup for", device.display(), e))?;
    if !out.status.success() {
        return Err(BackendError::io(
            op,
            device.display(),
            String::from_utf8_lossy(&out.stderr).trim(),
        ));
    }
    Ok(())
}

/// Whether the kernel reports DAX support for block `device` (loop devices never do). Found by
/// device number: a logical volume's paths (`/dev/<vg>/<lv>`, `/dev/mapper/…`) are not the
/// `dm-N` name /sys/block knows.
pub fn supports_dax(device: &Path) -> bool {
    let queue = match crate::mounts::block_device_number(device) {
        Some(rdev) => {
            let (major, minor) = (rustix::fs::major(rdev), rustix::fs::minor(rdev));
            Path::new("/sys/dev/block").join(format!("{major}:{minor}"))
        }
        None => match device.file_name() {
            Some(name) => Path::new("/sys/block").join(name),
            None => return false,
        },
    };
    std::fs::read_to_string(queue.join("queue/dax")).is_ok_and(|v| v.trim() == "1")
}
