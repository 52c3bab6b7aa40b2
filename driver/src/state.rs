//! Node state: one JSON file per volume in `--state-dir`, in PMEM-CSI 1.0's format, written
//! crash-safely (temporary file, fsync, rename, fsync of the directory), so that after a crash
//! every file is either the old or the new version, never a torn one.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Suffix of temporary files; never loaded, removed at start.
const TMP_SUFFIX: &str = ".tmp";

/// Suffix of a volume's pending marker, `<id>.pending`: present while its device is being made
/// or removed, so that start-up can tell an interrupted create or delete (the device may be
/// missing) from a device that went missing (which must never cost the state).
const PENDING_SUFFIX: &str = ".pending";

/// Suffix a corrupt state file is renamed to: kept for an operator, never loaded.
pub const QUARANTINE_SUFFIX: &str = ".quarantined";

/// One volume as PMEM-CSI 1.0 stores it in `<state-dir>/<id>.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeState {
    /// Volume ID.
    pub id: String,
    /// Size in bytes (aligned, as created).
    pub size: i64,
    /// Parameters as a volume context (includes `name` and `deviceMode`).
    #[serde(default)]
    pub parameters: BTreeMap<String, String>,
    /// The size before a growth to `size` that has not finished: written before the device
    /// grows and dropped after, so start-up can finish or undo it. Absent otherwise, so the
    /// file stays PMEM-CSI 1.0's (whose decoder ignores the field while it is present).
    #[serde(
        default,
        rename = "growingFrom",
        skip_serializing_if = "Option::is_none"
    )]
    pub growing_from: Option<i64>,
}

/// State I/O failures.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// A file or directory operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A state file does not parse; it is left alone for an operator to inspect.
    #[error("state file {path} is corrupt: {source}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// A volume ID that cannot be a file name.
    #[error("volume ID {0:?} cannot name a state file")]
    BadId(String),
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StateError + 'a {
    move |source| StateError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// The state directory of one driver.
#[derive(Clone, Debug)]
pub struct StateStore {
    dir: PathBuf,
}

impl StateStore {
    /// Opens (creating) `dir` and removes temporary files a crash left behind.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self, StateError> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
        for entry in std::fs::read_dir(&dir).map_err(io("reading", &dir))? {
            let entry = entry.map_err(io("reading", &dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(TMP_SUFFIX) {
                tracing::info!(file = %entry.path().display(), "repair: removing temporary state file left by a crash");
                std::fs::remove_file(entry.path()).map_err(io("removing", &entry.path()))?;
            }
        }
        Ok(Self { dir })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, id: &str) -> Result<PathBuf, StateError> {
        if id.is_empty() || id.contains('/') || id.starts_with('.') || id.contains('\0') {
            return Err(StateError::BadId(id.to_string()));
        }
        Ok(self.dir.join(format!("{id}.json")))
    }

    /// Writes `volume` durably: on return the file survives a crash.
    pub fn write(&self, volume: &VolumeState) -> Result<(), StateError> {
        let path = self.path(&volume.id)?;
        let tmp = self.dir.join(format!("{}.json{TMP_SUFFIX}", volume.id));
        // Byte for byte what PMEM-CSI 1.0 writes: Go's json.Encoder ends with a newline.
        let mut text = serde_json::to_vec(volume).map_err(|source| StateError::Corrupt {
            path: path.clone(),
            source,
        })?;
        text.push(b'\n');
        {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)
                .map_err(io("creating", &tmp))?;
            f.write_all(&text).map_err(io("writing", &tmp))?;
            f.sync_all().map_err(io("syncing", &tmp))?;
        }
        std::fs::rename(&tmp, &path).map_err(io("renaming", &tmp))?;
        self.sync_dir()
    }

    /// Removes the state of `id` durably; a missing file is not an error.
    pub fn remove(&self, id: &str) -> Result<(), StateError> {
        let path = self.path(id)?;
        match std::fs::remove_file(&path) {
            Ok(()) => self.sync_dir(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("removing", &path)(e)),
        }
    }

    fn sync_dir(&self) -> Result<(), StateError> {
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io("syncing", &self.dir))
    }

    /// Marks `id` pending: its device is about to be made or removed. `durable` syncs the
    /// directory (a delete needs it: after a power loss a state without device and without
    /// marker would stop the next start); a create's marker becomes durable with the state
    /// file written after it.
    pub fn mark_pending(&self, id: &str, durable: bool) -> Result<(), StateError> {
        let path = self.pending_path(id)?;
        File::create(&path).map_err(io("creating", &path))?;
        if durable {
            self.sync_dir()?;
        }
        Ok(())
    }

    /// Clears the pending marker of `id`. Not synced: a marker that comes back after a power
    /// loss only makes start-up look at a volume whose device is there.
    pub fn clear_pending(&self, id: &str) -> Result<(), StateError> {
        let path = self.pending_path(id)?;
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("removing", &path)(e)),
        }
    }

    /// IDs with a pending marker.
    pub fn pending(&self) -> Result<std::collections::BTreeSet<String>, StateError> {
        Ok(std::fs::read_dir(&self.dir)
            .map_err(io("reading", &self.dir))?
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()?
                    .strip_suffix(PENDING_SUFFIX)
                    .map(str::to_string)
            })
            .collect())
    }

    fn pending_path(&self, id: &str) -> Result<PathBuf, StateError> {
        self.path(id)?;
        Ok(self.dir.join(format!("{id}{PENDING_SUFFIX}")))
    }

    /// Moves the corrupt state file `path` aside to `<file>.quarantined` (durably) and returns
    /// the new path; the volume's device is kept for an operator to decide.
    pub fn quarantine(&self, path: &Path) -> Result<PathBuf, StateError> {
        let mut target = path.as_os_str().to_owned();
        target.push(QUARANTINE_SUFFIX);
        let target = PathBuf::from(target);
        std::fs::rename(path, &target).map_err(io("quarantining", path))?;
        self.sync_dir()?;
        Ok(target)
    }

    /// When the state of `id` was written (its creation: state is written once per volume).
    pub fn written_at(&self, id: &str) -> Option<std::time::SystemTime> {
        std::fs::metadata(self.path(id).ok()?)
            .and_then(|m| m.modified())
            .ok()
    }

    /// Every stored volume, plus the files that could not be parsed (left in place).
    pub fn load_all(&self) -> Result<(Vec<VolumeState>, Vec<StateError>), StateError> {
        let mut volumes = Vec::new();
        let mut corrupt = Vec::new();
        let mut entries: Vec<_> = std::fs::read_dir(&self.dir)
            .map_err(io("reading", &self.dir))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect();
        entries.sort();
        for path in entries {
            let text = std::fs::read(&path).map_err(io("reading", &path))?;
            match serde_json::from_slice::<VolumeState>(&text) {
                Ok(v) => volumes.push(v),
                Err(source) => corrupt.push(StateError::Corrupt { path, source }),
            }
        }
        Ok((volumes, corrupt))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(id: &str) -> VolumeState {
        VolumeState {
            id: id.into(),
            size: 4 << 20,
            parameters: BTreeMap::from([("name".into(), "pvc-1".into())]),
            growing_from: None,
        }
    }

    #[test]
    fn write_load_remove() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateStore::open(dir.path()).expect("open");
        store.write(&volume("a")).expect("write a");
        store.write(&volume("b")).expect("write b");
        let mut updated = volume("a");
        updated.size = 8 << 20;
        store.write(&updated).expect("overwrite a");
        let (all, corrupt) = store.load_all().expect("load");
        assert!(corrupt.is_empty());
        assert_eq!(all, vec![updated, volume("b")]);
        store.remove("a").expect("remove");
        store.remove("a").expect("remove twice is fine");
        assert_eq!(store.load_all().expect("load").0, vec![volume("b")]);
    }

    #[test]
    fn open_removes_temporary_files_and_reports_corrupt_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("x.json.tmp"), b"{").expect("tmp");
        std::fs::write(dir.path().join("y.json"), b"{not json").expect("corrupt");
        let store = StateStore::open(dir.path()).expect("open");
        assert!(!dir.path().join("x.json.tmp").exists());
        let (all, corrupt) = store.load_all().expect("load");
        assert!(all.is_empty());
        assert_eq!(corrupt.len(), 1);
        assert!(corrupt[0].to_string().contains("y.json"), "{}", corrupt[0]);
        assert!(dir.path().join("y.json").exists(), "corrupt files are kept");
    }

    #[test]
    fn ids_that_escape_the_directory_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = StateStore::open(dir.path()).expect("open");
        for id in ["", "../x", "a/b", ".hidden"] {
            assert!(
                matches!(store.write(&volume(id)), Err(StateError::BadId(_))),
                "{id:?}"
            );
        }
    }

    #[test]
    fn pmem_csi_format() {
        let v: VolumeState = serde_json::from_str(
            r#"{"id":"pvc-01-abc","size":4194304,"parameters":{"eraseafter":"true","name":"pvc-0123"}}"#,
        )
        .expect("parse");
        assert_eq!(v.size, 4194304);
        let text = serde_json::to_string(&v).expect("serialize");
        assert!(
            text.starts_with(r#"{"id":"pvc-01-abc","size":4194304,"parameters":{"#),
            "{text}"
        );
        assert!(!text.contains("growingFrom"), "{text}");
        let growing = VolumeState {
            growing_from: Some(4194304),
            size: 8388608,
            ..v
        };
        let text = serde_json::to_string(&growing).expect("serialize");
        assert!(text.ends_with(r#","growingFrom":4194304}"#), "{text}");
        assert_eq!(
            serde_json::from_str::<VolumeState>(&text).expect("parse"),
            growing
        );
    }
}
