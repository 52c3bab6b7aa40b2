//! What a testenv may leave behind, and the checks that it left nothing: processes of its
//! group, mounts and loop devices under its work directory, stale work directories.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The work directory prefix of testenvs of this process: `pmem-csi-testenv-<pid>-`.
pub fn work_dir_prefix() -> String {
    format!("{WORK_DIR_PREFIX}{}-", std::process::id())
}

const WORK_DIR_PREFIX: &str = "pmem-csi-testenv-";

/// Removes work directories of testenvs whose process is gone (a shared testenv is never
/// dropped, so its directory outlives the test binary). Mounts and loop devices a dead owner
/// left under one (a scenario's volumes when its test binary died) go first: nothing of that
/// testenv runs any more to use them.
pub fn remove_stale_work_dirs(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(WORK_DIR_PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let path = entry.path();
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        release_mounts_and_loops(&path);
        match std::fs::remove_dir_all(&path) {
            Ok(()) => tracing::info!(dir = %path.display(), "removed stale testenv directory"),
            Err(e) => {
                tracing::warn!(dir = %path.display(), "removing stale testenv directory: {e}")
            }
        }
    }
}

/// What one testenv created, to check that nothing of it remains after teardown.
#[derive(Clone, Debug)]
pub struct Leftovers {
    pgid: i32,
    root: PathBuf,
}

impl Leftovers {
    /// Leftovers of process group `pgid` and work directory `root`.
    pub fn new(pgid: i32, root: PathBuf) -> Self {
        Self { pgid, root }
    }

    /// Everything that still exists, one line each; empty means clean.
    pub fn find(&self) -> Vec<String> {
        let mut found = Vec::new();
        if crate::process::group_alive(self.pgid) {
            found.push(format!(
                "processes of group {}: {:?}",
                self.pgid,
                group_members(self.pgid)
            ));
        }
        for mount in mounts_under(&self.root) {
            found.push(format!("mount {mount}"));
        }
        for (device, backing) in loop_devices_under(&self.root) {
            found.push(format!("loop device {device} backed by {backing}"));
        }
        found
    }

    /// Polls [`Leftovers::find`] until it is empty or `timeout` passes (processes take a moment
    /// to be reaped after SIGKILL); returns what remains.
    pub async fn wait_clean(&self, timeout: Duration) -> Vec<String> {
        let start = Instant::now();
        loop {
            let found = self.find();
            if found.is_empty() || start.elapsed() >= timeout {
                return found;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Pids whose process group is `pgid`, read from /proc.
fn group_members(pgid: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| stat_pgrp(&stat))
                == Some(pgid)
        })
        .collect()
}

/// The process group field of /proc/<pid>/stat (after the parenthesized command name, which
/// may itself contain spaces and parentheses).
fn stat_pgrp(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(2)?.parse().ok()
}

/// Mount points at or under `root` in this process's mount namespace.
pub fn mounts_under(root: &Path) -> Vec<String> {
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape_mount_path)
        .filter(|mount| Path::new(mount).starts_with(root))
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape_mount_path(field: &str) -> String {
    field
        .replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// Lazily unmounts every mount under `root` (deepest first) and detaches the loop devices
/// backed by files under it.
fn release_mounts_and_loops(root: &Path) {
    let mut mounts = mounts_under(root);
    // Deeper paths sort after their parents; undo in reverse.
    mounts.sort();
    for mount in mounts.iter().rev() {
        match rustix::mount::unmount(mount.as_str(), rustix::mount::UnmountFlags::DETACH) {
            Ok(()) => tracing::info!(%mount, "unmounted a stale testenv mount"),
            Err(e) => tracing::warn!(%mount, "unmounting a stale testenv mount: {e}"),
        }
    }
    for (device, backing) in loop_devices_under(root) {
        let detached = std::process::Command::new("losetup")
            .args(["--detach", &device])
            .status()
            .is_ok_and(|s| s.success());
        if detached {
            tracing::info!(%device, %backing, "detached a stale testenv loop device");
        } else {
            tracing::warn!(%device, %backing, "could not detach a stale testenv loop device");
        }
    }
}

/// Loop devices whose backing file is under `root`, as (device, backing file).
pub fn loop_devices_under(root: &Path) -> Vec<(String, String)> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let device = e.file_name().to_string_lossy().into_owned();
            let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            let backing = backing.trim().trim_end_matches(" (deleted)").to_string();
            Path::new(&backing)
                .starts_with(root)
                .then(|| (format!("/dev/{device}"), backing))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_pgrp_table() {
        for (stat, want) in [
            ("123 (sleep) S 1 123 123 0 -1", Some(123)),
            ("124 (a b) c) S 1 777 777 0", Some(777)),
            ("garbage", None),
        ] {
            assert_eq!(stat_pgrp(stat), want, "{stat}");
        }
    }

    #[test]
    fn unescape_table() {
        assert_eq!(unescape_mount_path("/a\\040b"), "/a b");
        assert_eq!(unescape_mount_path("/a\\134b"), "/a\\b");
    }

    #[test]
    fn stale_directory_goes_with_its_mounts() {
        let parent = tempfile::tempdir().expect("tempdir");
        // Above any pid_max: an owner that is surely gone.
        let stale = parent.path().join(format!("{WORK_DIR_PREFIX}4194305-x"));
        let mount = stale.join("nodes/n/mnt");
        std::fs::create_dir_all(&mount).expect("dirs");
        rustix::mount::mount(
            "tmpfs",
            &mount,
            "tmpfs",
            rustix::mount::MountFlags::empty(),
            None,
        )
        .expect("tmpfs (tests run as root)");
        let alive = parent
            .path()
            .join(format!("{WORK_DIR_PREFIX}{}-y", std::process::id()));
        std::fs::create_dir_all(&alive).expect("dir");
        remove_stale_work_dirs(parent.path());
        assert!(mounts_under(&stale).is_empty(), "unmounted");
        assert!(!stale.exists(), "stale directory removed");
        assert!(alive.exists(), "a live owner's directory stays");
    }

    #[test]
    fn clean_directory_has_no_leftovers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let leftovers = Leftovers::new(i32::MAX, dir.path().to_path_buf());
        assert_eq!(leftovers.find(), Vec::<String>::new());
    }

    #[test]
    fn own_group_is_reported() {
        let pgid = rustix::process::getpgrp().as_raw_nonzero().get();
        let leftovers = Leftovers::new(pgid, PathBuf::from("/nonexistent-root"));
        let found = leftovers.find();
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].contains(&std::process::id().to_string()),
            "{found:?}"
        );
    }
}
