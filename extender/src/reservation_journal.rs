//! The reservation journal: the extender's reservations written to a local file before
//! kube-scheduler reads the `/filter` answer that made them, so that an extender restarted
//! beside a running scheduler gets them back.
//!
//! Why a file: between a `/filter` answer and the moment the pod's claims show their
//! selected-node (kube-scheduler's PreBind), the bytes are held only by the reservation. An
//! extender that restarts in that window and forgets it lets the next pods into the same room:
//! an over-commit that only shows later as a failed CreateVolume. Nothing in the cluster says
//! which pods the scheduler is binding right now, so the extender must remember. The scheduler
//! and the extender fail over together, so a journal on the extender's own host (an `emptyDir`)
//! is enough: when the host goes, so do the scheduler's bindings in flight.
//!
//! One JSON object per line: a reservation (the pod's latest replaces the earlier ones) or its
//! end. Ends that the cluster itself shows (a claim selected, a pod bound or deleted) are not
//! written: replay checks them against the synced index instead. A torn last line (the process
//! killed mid-write) is skipped. The file is rewritten from the live book (temporary file,
//! rename) when appends have made it much larger than what it describes.
//!
//! The encoding and the replay are pure; [`ReservationJournal`] is the thin file shell.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::reservation_book::Entry;

/// Appends never trigger a rewrite below this size.
const REWRITE_FLOOR: u64 = 8 << 20;
/// A rewrite happens once the file is this many times what it held after the last one.
const REWRITE_FACTOR: u64 = 4;

/// One line of the journal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "lowercase")]
pub enum JournalRecord {
    /// A pod's reservation, as the book holds it.
    Reserved(ReservedRecord),
    /// The pod's reservation ended in a way the cluster does not show (filtered again and
    /// fitting nowhere, or placed with `--placement=scheduler`).
    Ended {
        /// The pod's uid.
        pod: String,
    },
}

/// Reservations held on more nodes than this are written as held on every node: a reserve-all
/// reservation in a cluster of 5,000 nodes would otherwise write 60 KiB per `/filter`. Restored
/// on every node that published capacity, it is a superset of what it was, which can only make
/// fits more pessimistic, and only until the pod is filtered again.
pub const NODE_LIST_LIMIT: usize = 256;

/// A reservation as written to the journal: nodes by name (ids do not outlive the process),
/// expiry as wall-clock time (an `Instant` neither).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservedRecord {
    /// The pod's uid.
    pub pod: String,
    /// The open entries.
    pub entries: Vec<Entry>,
    /// The nodes it is held on (empty with `all_nodes`).
    pub nodes: Vec<String>,
    /// Held on more than [`NODE_LIST_LIMIT`] nodes: restored on every node.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub all_nodes: bool,
    /// When it expires, in milliseconds since the Unix epoch; `None`: never.
    pub expires_unix_ms: Option<u64>,
}

impl JournalRecord {
    /// The pod the record is about.
    pub fn pod(&self) -> &str {
        match self {
            JournalRecord::Reserved(r) => &r.pod,
            JournalRecord::Ended { pod } => pod,
        }
    }
}

/// The wall-clock expiry of a reservation expiring at `expires` (`None`: never), judged from
/// the pair `(now, wall)` read at the same moment.
pub fn expiry_to_wall(expires: Option<Instant>, now: Instant, wall: SystemTime) -> Option<u64> {
    let at = wall.checked_add(expires?.saturating_duration_since(now))?;
    let ms = at.duration_since(UNIX_EPOCH).ok()?.as_millis();
    Some(u64::try_from(ms).unwrap_or(u64::MAX))
}

/// The `Instant` of a wall-clock expiry, judged from `(now, wall)`; `Some(None)`: never
/// expires; `None`: already expired.
pub fn expiry_from_wall(
    expires_unix_ms: Option<u64>,
    now: Instant,
    wall: SystemTime,
) -> Option<Option<Instant>> {
    let Some(ms) = expires_unix_ms else {
        return Some(None);
    };
    let at = UNIX_EPOCH.checked_add(Duration::from_millis(ms))?;
    let left = at.duration_since(wall).ok().filter(|d| !d.is_zero())?;
    Some(now.checked_add(left))
}

/// What a journal's text describes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    /// The reservations still open at the end of the text, in the order of their last record.
    pub reservations: Vec<ReservedRecord>,
    /// Lines that did not decode (a torn last line after a kill; anything else is a bug).
    pub malformed: usize,
}

/// Replays a journal's text: each pod's last record wins.
pub fn replay(text: &str) -> Replayed {
    let mut malformed = 0;
    let mut last: BTreeMap<String, (usize, JournalRecord)> = BTreeMap::new();
    for (seq, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<JournalRecord>(line) {
            Ok(record) => {
                last.insert(record.pod().to_owned(), (seq, record));
            }
            Err(_) => malformed += 1,
        }
    }
    let mut open: Vec<(usize, ReservedRecord)> = last
        .into_values()
        .filter_map(|(seq, record)| match record {
            JournalRecord::Reserved(r) => Some((seq, r)),
            JournalRecord::Ended { .. } => None,
        })
        .collect();
    open.sort_by_key(|(seq, _)| *seq);
    Replayed {
        reservations: open.into_iter().map(|(_, r)| r).collect(),
        malformed,
    }
}

/// One record as a journal line.
pub fn encode(record: &JournalRecord) -> Vec<u8> {
    // Serializing plain strings and numbers cannot fail.
    let mut line = serde_json::to_vec(record).unwrap_or_default();
    line.push(b'\n');
    line
}

/// Failures of the journal file.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The file cannot be read, written or replaced.
    #[error("reservation journal {path}: {source}")]
    Io {
        /// Which file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// The journal file, open for appending.
#[derive(Debug)]
pub struct ReservationJournal {
    path: PathBuf,
    file: File,
    size: u64,
    rewrite_at: u64,
}

impl ReservationJournal {
    /// Opens (creating) the journal at `path` and replays what it holds.
    pub fn open(path: &Path) -> Result<(Self, Replayed), JournalError> {
        let io = |source| JournalError::Io {
            path: path.to_owned(),
            source,
        };
        let text = match std::fs::read(path) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(e)),
        };
        let replayed = replay(&text);
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io)?;
        let size = text.len() as u64;
        Ok((
            Self {
                path: path.to_owned(),
                file,
                size,
                rewrite_at: REWRITE_FLOOR.max(size.saturating_mul(REWRITE_FACTOR)),
            },
            replayed,
        ))
    }

    /// Where the journal is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `record`. One `write` per record: a kill leaves at most the last line torn.
    pub fn append(&mut self, record: &JournalRecord) -> Result<(), JournalError> {
        let line = encode(record);
        self.file
            .write_all(&line)
            .map_err(|source| JournalError::Io {
                path: self.path.clone(),
                source,
            })?;
        self.size += line.len() as u64;
        Ok(())
    }

    /// Whether appends have grown the file enough to rewrite it.
    pub fn wants_rewrite(&self) -> bool {
        self.size >= self.rewrite_at
    }

    /// Replaces the file by `records` (the live book): written beside it, then renamed over
    /// it, so that a kill leaves either the old journal or the new one.
    pub fn rewrite(
        &mut self,
        records: impl IntoIterator<Item = JournalRecord>,
    ) -> Result<(), JournalError> {
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| JournalError::Io { path, source }
        };
        let tmp = self.path.with_extension("rewrite");
        let mut text = Vec::new();
        for record in records {
            text.extend_from_slice(&encode(&record));
        }
        std::fs::write(&tmp, &text).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &self.path).map_err(io(&self.path))?;
        self.file = OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(io(&self.path))?;
        self.size = text.len() as u64;
        self.rewrite_at = REWRITE_FLOOR.max(self.size.saturating_mul(REWRITE_FACTOR));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reservation_book::EntryKey;

    fn reserved(pod: &str, nodes: &[&str], expires: Option<u64>) -> JournalRecord {
        JournalRecord::Reserved(ReservedRecord {
            pod: pod.into(),
            entries: vec![
                Entry {
                    key: EntryKey::Claim(controllers::volume_facts::ClaimKey::new(
                        "ns",
                        format!("{pod}-data"),
                    )),
                    size: 1 << 30,
                },
                Entry {
                    key: EntryKey::Inline {
                        pod_uid: pod.into(),
                        volume: "scratch".into(),
                    },
                    size: 64 << 20,
                },
            ],
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            all_nodes: false,
            expires_unix_ms: expires,
        })
    }

    fn text(records: &[JournalRecord]) -> String {
        records
            .iter()
            .map(|r| String::from_utf8(encode(r)).expect("utf-8"))
            .collect()
    }

    fn pods(replayed: &Replayed) -> Vec<&str> {
        replayed
            .reservations
            .iter()
            .map(|r| r.pod.as_str())
            .collect()
    }

    #[test]
    fn a_record_survives_its_encoding() {
        let record = reserved("uid-a", &["node-1", "node-2"], Some(1_700_000_000_000));
        let line = encode(&record);
        assert_eq!(line.last(), Some(&b'\n'));
        let back: JournalRecord = serde_json::from_slice(&line).expect("decodes");
        assert_eq!(back, record);
        let ended = JournalRecord::Ended {
            pod: "uid-a".into(),
        };
        let back: JournalRecord = serde_json::from_slice(&encode(&ended)).expect("decodes");
        assert_eq!(back, ended);
    }

    #[test]
    fn replay_table() {
        let a1 = reserved("a", &["node-1"], None);
        let a2 = reserved("a", &["node-2"], None);
        let b = reserved("b", &["node-1"], None);
        let end_a = JournalRecord::Ended { pod: "a".into() };
        let cases: Vec<(&str, String, Vec<&str>, usize)> = vec![
            ("empty", String::new(), vec![], 0),
            ("one", text(std::slice::from_ref(&a1)), vec!["a"], 0),
            (
                "the last record of a pod wins",
                text(&[a1.clone(), a2.clone()]),
                vec!["a"],
                0,
            ),
            ("ended", text(&[a1.clone(), end_a.clone()]), vec![], 0),
            (
                "reserved again after its end",
                text(&[a1.clone(), end_a.clone(), a2.clone()]),
                vec!["a"],
                0,
            ),
            (
                "order of the last records",
                text(&[a1.clone(), b.clone(), a2.clone()]),
                vec!["b", "a"],
                0,
            ),
            (
                "a torn last line is skipped",
                {
                    let mut t = text(&[a1.clone(), b.clone()]);
                    let torn = text(std::slice::from_ref(&end_a));
                    t.push_str(&torn[..torn.len() / 2]);
                    t
                },
                vec!["a", "b"],
                1,
            ),
            ("garbage", "not json\n{}\n".into(), vec![], 2),
        ];
        for (name, text, want, malformed) in cases {
            let replayed = replay(&text);
            assert_eq!(pods(&replayed), want, "{name}");
            assert_eq!(replayed.malformed, malformed, "{name}");
        }
        let replayed = replay(&text(&[a1, a2.clone()]));
        assert_eq!(replayed.reservations[0].nodes, vec!["node-2"]);
    }

    #[test]
    fn expiry_round_trip_table() {
        let now = Instant::now();
        let wall = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let in_a_minute = now + Duration::from_secs(60);
        let ms = expiry_to_wall(Some(in_a_minute), now, wall).expect("in the future");
        assert_eq!(ms, 1_800_000_060_000);
        // Ten seconds later, on a restarted process with its own Instant.
        let later_now = Instant::now();
        let later_wall = wall + Duration::from_secs(10);
        let back = expiry_from_wall(Some(ms), later_now, later_wall)
            .expect("not expired")
            .expect("expires");
        assert_eq!(back - later_now, Duration::from_secs(50));
        assert_eq!(expiry_to_wall(None, now, wall), None);
        assert_eq!(expiry_from_wall(None, now, wall), Some(None));
        // At or past the expiry: gone.
        assert_eq!(
            expiry_from_wall(Some(ms), now, wall + Duration::from_secs(60)),
            None
        );
        assert_eq!(
            expiry_from_wall(Some(ms), now, wall + Duration::from_secs(61)),
            None
        );
    }

    #[test]
    fn the_file_appends_replays_and_rewrites() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("reservations.jsonl");
        let (mut journal, replayed) = ReservationJournal::open(&path).expect("open");
        assert_eq!(replayed, Replayed::default());
        journal
            .append(&reserved("a", &["node-1"], None))
            .expect("append");
        journal
            .append(&reserved("b", &["node-2"], None))
            .expect("append");
        journal
            .append(&JournalRecord::Ended { pod: "a".into() })
            .expect("append");
        drop(journal);
        let (mut journal, replayed) = ReservationJournal::open(&path).expect("reopen");
        assert_eq!(pods(&replayed), vec!["b"]);
        journal
            .rewrite(vec![reserved("c", &["node-3"], None)])
            .expect("rewrite");
        journal
            .append(&reserved("d", &["node-3"], None))
            .expect("append");
        drop(journal);
        let (_, replayed) = ReservationJournal::open(&path).expect("reopen");
        assert_eq!(pods(&replayed), vec!["c", "d"]);
        assert!(!path.with_extension("rewrite").exists());
    }

    #[test]
    fn an_unwritable_place_names_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("missing-dir/reservations.jsonl");
        let err = ReservationJournal::open(&path).expect_err("no directory");
        assert!(err.to_string().contains("missing-dir"), "{err}");
    }
}
