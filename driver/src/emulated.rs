//! The `emulated` backend: a region of `--emulated-size` bytes under `--emulated-dir`; each
//! volume a fully allocated file (no overcommit: what is reported free can be written), attached
//! to a loop device while it is staged or published.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rustix::fs::FallocateFlags;

use crate::backend::{Backend, BackendError, Capacity, DeviceMode, Pool, align_down};
use crate::parameters::Usage;
use crate::{loopdev, mounts};

/// Volume sizes are multiples of 4 MiB, as LVM extents in PMEM-CSI's LVM mode.
pub const EMULATED_ALIGNMENT: u64 = 4 << 20;
const SUFFIX: &str = ".pmem";

/// Files in a budgeted directory.
#[derive(Debug)]
pub struct Emulated {
    dir: PathBuf,
    size: u64,
    // Serializes the budget check with the allocation, so concurrent creates cannot both
    // take the last free bytes.
    allocation: Mutex<()>,
}

impl Emulated {
    /// The region of `size` bytes in `dir` (created if missing).
    pub fn new(dir: impl Into<PathBuf>, size: u64) -> Result<Self, BackendError> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir)
            .map_err(|e| BackendError::io("creating", dir.display(), e))?;
        // Loop devices store the canonical path of their backing file.
        let dir = dir
            .canonicalize()
            .map_err(|e| BackendError::io("resolving", dir.display(), e))?;
        Ok(Self {
            dir,
            size: align_down(size, EMULATED_ALIGNMENT),
            allocation: Mutex::new(()),
        })
    }

    fn file(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}{SUFFIX}"))
    }

    fn id_of(&self, file: &Path) -> Option<String> {
        if file.parent() != Some(self.dir.as_path()) {
            return None;
        }
        file.file_name()?
            .to_str()?
            .strip_suffix(SUFFIX)
            .map(str::to_string)
    }

    fn used_except(&self, except: Option<&str>) -> Result<u64, BackendError> {
        let mut used = 0;
        for id in self.list()? {
            if Some(id.as_str()) == except {
                continue;
            }
            used += self.size_of(&id)?.unwrap_or(0);
        }
        Ok(used)
    }

    /// Free bytes: the budget minus what volumes use, but never more than the file system
    /// under the directory can still allocate.
    fn free(&self, used: u64) -> Result<u64, BackendError> {
        let budget = self.size.saturating_sub(used);
        let fs = rustix::fs::statvfs(&self.dir)
            .map_err(|e| BackendError::io("statvfs", self.dir.display(), e))?;
        Ok(budget.min(fs.f_bavail.saturating_mul(fs.f_frsize)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.allocation
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn in_use(device: &Path) -> Result<bool, BackendError> {
        let table = mounts::table().map_err(|e| BackendError::io("reading", "mountinfo", e))?;
        Ok(table.iter().any(|m| m.shows_device(device)))
    }
}

impl Backend for Emulated {
    fn mode(&self) -> DeviceMode {
        DeviceMode::Emulated
    }

    fn alignment(&self) -> u64 {
        EMULATED_ALIGNMENT
    }

    fn partial_creates(&self) -> bool {
        // fallocate can be interrupted part way.
        true
    }

    fn capacity(&self) -> Result<Capacity, BackendError> {
        let free = self.free(self.used_except(None)?)?;
        Ok(Capacity::new(
            vec![Pool {
                name: "emulated".into(),
                managed: self.size,
                free,
                largest: align_down(free, EMULATED_ALIGNMENT),
            }],
            self.size,
        ))
    }

    fn create(&self, id: &str, size: u64, _usage: Usage) -> Result<(), BackendError> {
        let _guard = self.lock();
        let path = self.file(id);
        let existing = self.size_of(id)?;
        if existing == Some(size) {
            return Ok(());
        }
        let free = self.free(self.used_except(Some(id))?)?;
        if size > free {
            return Err(BackendError::NoSpace {
                need: size,
                largest: align_down(free, EMULATED_ALIGNMENT),
                free,
            });
        }
        // A file of another size is a creation that a crash interrupted; allocating again
        // completes it (fallocate only ever grows the file here).
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(existing.is_some_and(|e| e > size))
            .open(&path)
            .map_err(|e| BackendError::io("creating", path.display(), e))?;
        crate::faults::point("after-allocation-open");
        if let Err(e) = rustix::fs::fallocate(&file, FallocateFlags::empty(), 0, size) {
            drop(file);
            let _ = std::fs::remove_file(&path);
            return Err(if e == rustix::io::Errno::NOSPC {
                BackendError::NoSpace {
                    need: size,
                    largest: 0,
                    free: 0,
                }
            } else {
                BackendError::io("allocating", path.display(), e)
            });
        }
        Ok(())
    }

    fn growth_refused(&self) -> Option<&'static str> {
        None
    }

    fn grow(&self, id: &str, size: u64) -> Result<(), BackendError> {
        let _guard = self.lock();
        let path = self.file(id);
        let Some(existing) = self.size_of(id)? else {
            return Err(BackendError::io(
                "growing",
                path.display(),
                "no such volume file",
            ));
        };
        if existing < size {
            let need = size - existing;
            let free = self.free(self.used_except(None)?)?;
            if need > free {
                return Err(BackendError::NoSpace {
                    need,
                    largest: align_down(free, EMULATED_ALIGNMENT),
                    free,
                });
            }
            let file = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(|e| BackendError::io("opening", path.display(), e))?;
            if let Err(e) = rustix::fs::fallocate(&file, FallocateFlags::empty(), 0, size) {
                // fallocate may have extended the file part of the way: back to the old size,
                // whose blocks it did not touch.
                if let Err(undo) = file.set_len(existing) {
                    tracing::error!(file = %path.display(), "undoing a failed growth: {undo}");
                }
                return Err(if e == rustix::io::Errno::NOSPC {
                    BackendError::NoSpace {
                        need,
                        largest: 0,
                        free: 0,
                    }
                } else {
                    BackendError::io("growing", path.display(), e)
                });
            }
            crate::faults::point("after-growth-allocation");
        }
        // Also when the file had grown already: a crash may have come before the loop device
        // learnt its new size.
        match loopdev::find(&path) {
            Some(device) => loopdev::refresh_capacity(&device),
            None => Ok(()),
        }
    }

    fn delete(&self, id: &str, erase: bool) -> Result<(), BackendError> {
        let path = self.file(id);
        if !path.exists() {
            return Ok(());
        }
        self.detach(id)?;
        if erase {
            // Zeroing the range drops the old blocks: nothing of the volume can be read back,
            // without writing every byte.
            let file = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(|e| BackendError::io("opening", path.display(), e))?;
            let len = file
                .metadata()
                .map_err(|e| BackendError::io("stat", path.display(), e))?
                .len();
            if len > 0 {
                rustix::fs::fallocate(&file, FallocateFlags::ZERO_RANGE, 0, len)
                    .map_err(|e| BackendError::io("erasing", path.display(), e))?;
            }
        }
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(BackendError::io("removing", path.display(), e)),
        }
    }

    fn size_of(&self, id: &str) -> Result<Option<u64>, BackendError> {
        let path = self.file(id);
        match std::fs::metadata(&path) {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(BackendError::io("stat", path.display(), e)),
        }
    }

    fn list(&self) -> Result<Vec<String>, BackendError> {
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|e| BackendError::io("reading", self.dir.display(), e))?;
        let mut ids: Vec<String> = entries
            .flatten()
            .filter_map(|e| self.id_of(&e.path()))
            .collect();
        ids.sort();
        Ok(ids)
    }

    fn attach(&self, id: &str) -> Result<PathBuf, BackendError> {
        let path = self.file(id);
        if let Some(device) = loopdev::find(&path) {
            return Ok(device);
        }
        if !path.exists() {
            return Err(BackendError::io(
                "attaching",
                path.display(),
                "no such volume file",
            ));
        }
        loopdev::attach(&path)
    }

    fn attached(&self, id: &str) -> Result<Option<PathBuf>, BackendError> {
        Ok(loopdev::find(&self.file(id)))
    }

    fn detach(&self, id: &str) -> Result<(), BackendError> {
        let Some(device) = loopdev::find(&self.file(id)) else {
            return Ok(());
        };
        // losetup --detach on an open device only marks it for auto-clear and succeeds, so the
        // mount check must come first.
        if Self::in_use(&device)? {
            return Err(BackendError::InUse {
                id: id.to_string(),
                device: device.display().to_string(),
            });
        }
        loopdev::detach(&device)
    }

    fn release_unused(&self, recorded: &dyn Fn(&str) -> bool) -> Result<Vec<String>, BackendError> {
        let mut released = Vec::new();
        for (device, backing) in loopdev::attached() {
            // Only volumes of this node's own state: nodes sharing one kernel (testenv, kind,
            // the real-node cluster) see each other's loop devices, often under the same
            // backing path in their own mount namespaces, and another node's raw-block volume
            // is mounted only in that node's namespace, where `in_use` cannot see it.
            if !self.id_of(&backing).is_some_and(|id| recorded(&id)) || Self::in_use(&device)? {
                continue;
            }
            loopdev::detach(&device)?;
            released.push(format!("{} ({})", device.display(), backing.display()));
        }
        Ok(released)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two nodes on one kernel with the same `--emulated-dir` path each see the other's loop
    /// devices; only volumes of a node's own state may be detached by its start-up repair
    /// (here: two volumes in one directory, one of them recorded).
    #[test]
    fn release_unused_detaches_only_recorded_volumes() {
        let dir = tempfile::tempdir().expect("dir");
        let backend = Emulated::new(dir.path(), 64 << 20).expect("backend");
        for id in ["ours", "theirs"] {
            backend
                .create(id, 4 << 20, Usage::AppDirect)
                .expect("create");
            backend.attach(id).expect("attach");
        }
        let released = backend.release_unused(&|id| id == "ours").expect("release");
        let ours = backend.attached("ours").expect("ours");
        let theirs = backend.attached("theirs").expect("theirs");
        // Clean up before asserting: loop devices outlive the test process.
        for id in ["ours", "theirs"] {
            backend.detach(id).expect("detach");
        }
        assert_eq!(released.len(), 1, "{released:?}");
        assert!(ours.is_none(), "our unused device is released");
        assert!(theirs.is_some(), "another node's device stays attached");
    }
}
