//! What `/readyz` reports: a set of named conditions, each owned by the part of the process that
//! knows whether it holds (stores synced, CSI server serving, …).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The named readiness conditions of one process; cheap to clone and share.
#[derive(Clone, Debug, Default)]
pub struct Readiness {
    conditions: Arc<Mutex<BTreeMap<String, bool>>>,
}

/// One condition of a [`Readiness`], created not ready; its owner flips it.
#[derive(Clone, Debug)]
pub struct ReadyFlag {
    name: String,
    readiness: Readiness,
}

impl Readiness {
    /// Adds a condition named `name`, initially not ready, and returns the handle that sets it.
    pub fn register(&self, name: impl Into<String>) -> ReadyFlag {
        let name = name.into();
        self.lock().insert(name.clone(), false);
        ReadyFlag {
            name,
            readiness: self.clone(),
        }
    }

    /// The names of the conditions that do not hold, sorted; empty means ready.
    pub fn not_ready(&self) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|(_, ready)| !**ready)
            .map(|(name, _)| name.clone())
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, bool>> {
        // A panic while holding this lock cannot leave the map inconsistent (single inserts).
        self.conditions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl ReadyFlag {
    /// Records whether this condition holds now.
    pub fn set(&self, ready: bool) {
        self.readiness.lock().insert(self.name.clone(), ready);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (case, conditions set in order, expected not-ready names)
    type Case = (
        &'static str,
        &'static [(&'static str, bool)],
        &'static [&'static str],
    );

    #[test]
    fn readiness_table() {
        let cases: [Case; 4] = [
            ("no conditions is ready", &[], &[]),
            ("one unset condition", &[("stores", false)], &["stores"]),
            ("all set", &[("stores", true), ("csi", true)], &[]),
            (
                "one of two missing, sorted output",
                &[("stores", false), ("csi", false), ("csi", true)],
                &["stores"],
            ),
        ];
        for (name, sets, want) in cases {
            let r = Readiness::default();
            for (cond, value) in sets {
                r.register(*cond).set(*value);
            }
            assert_eq!(r.not_ready(), want.to_vec(), "{name}");
        }
    }

    #[test]
    fn registered_flag_starts_not_ready() {
        let r = Readiness::default();
        let flag = r.register("stores");
        assert_eq!(r.not_ready(), vec!["stores".to_string()]);
        flag.set(true);
        assert!(r.not_ready().is_empty());
        flag.set(false);
        assert_eq!(r.not_ready(), vec!["stores".to_string()]);
    }
}
