//! Start-up repair as a decision over plain facts: what the state directory records, what the
//! backend shows, and which volumes were in the middle of a create or delete. Its rules put the
//! user's data first:
//! - a device is never deleted at start: one without state is kept and reported (an operator
//!   decides), and so is the device of a corrupt, quarantined state file;
//! - a state is forgotten only when its pending marker proves that its device was being made or
//!   removed when the driver stopped;
//! - when recorded devices are missing without such proof (PMEM regions not yet visible, a
//!   volume group not activated, an emptied emulated directory), nothing is repaired at all and
//!   the driver does not start, saying which volumes it misses.

use std::collections::{BTreeMap, BTreeSet};

/// What start-up knows of one recorded volume of the running mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recorded {
    /// Volume ID.
    pub id: String,
    /// Size in the state.
    pub size: u64,
    /// Size of its device, `None` when the backend shows none.
    pub device: Option<u64>,
    /// Whether the backend adopts a volume without device (the fake backend's memory, gone
    /// with the process).
    pub adoptable: bool,
    /// The size before a growth the state records as unfinished.
    pub growing_from: Option<u64>,
}

/// What to do.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RepairPlan {
    /// Volumes to index as they are.
    pub keep: Vec<String>,
    /// Volumes whose interrupted allocation is finished, then indexed.
    pub complete: Vec<String>,
    /// Volumes whose interrupted growth is finished (or, when the backend refuses, undone:
    /// the device still has its old size then), then indexed.
    pub finish_growth: Vec<String>,
    /// States to remove: their create or delete was interrupted before the device existed or
    /// after it was gone.
    pub forget: Vec<String>,
    /// Pending markers to clear (every marker once the plan is applied).
    pub clear_pending: Vec<String>,
    /// Devices without state: kept and reported.
    pub unrecorded: Vec<String>,
    /// Devices whose state file was corrupt and moved aside: kept and reported.
    pub quarantined: Vec<String>,
    /// Volumes whose device is shorter than recorded although no create was interrupted (a
    /// file truncated by hand, a restored backup): kept as they are and reported, never
    /// re-allocated (which on a full file system fails, and a failed create cleans up).
    pub short: Vec<String>,
}

/// Why start-up refuses to repair.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The backend shows no pool at all while volumes are recorded.
    #[error(
        "the backend shows no PMEM pool while {recorded} volume(s) are recorded; refusing to repair (PMEM not visible yet? regions disabled, volume groups inactive, the emulated directory not mounted?)"
    )]
    NoPools {
        /// Recorded volumes of this mode.
        recorded: usize,
    },
    /// Recorded devices are missing and no pending marker explains it.
    #[error(
        "{} recorded volume(s) have no device and were not being created or deleted: {}; refusing to repair so that their state is kept (if a device is gone for good, move its state file <id>.json out of the state directory)",
        .ids.len(),
        .ids.join(", ")
    )]
    MissingDevices {
        /// The volumes.
        ids: Vec<String>,
    },
}

/// Decides start-up repair. `recorded` are the states of this mode, `pending` the IDs with a
/// pending marker, `corrupt` the IDs whose state file did not parse, `devices` what the backend
/// lists, `partial_creates` whether an allocation can be left half done (emulated files).
pub fn plan(
    recorded: &[Recorded],
    pending: &BTreeSet<String>,
    corrupt: &BTreeSet<String>,
    devices: &BTreeSet<String>,
    has_pools: bool,
    partial_creates: bool,
) -> Result<RepairPlan, Refusal> {
    let mut plan = RepairPlan::default();
    if !recorded.is_empty() && !has_pools {
        return Err(Refusal::NoPools {
            recorded: recorded.len(),
        });
    }
    let mut missing = Vec::new();
    for volume in recorded {
        let pending = pending.contains(&volume.id);
        let present = volume.device.is_some() || volume.adoptable;
        if present && volume.growing_from.is_some() {
            plan.finish_growth.push(volume.id.clone());
            continue;
        }
        match volume.device {
            // Direct-mode namespaces may hold a little more than asked for (or, made by
            // PMEM-CSI 1.0, less).
            Some(actual) if actual >= volume.size || !partial_creates => {
                plan.keep.push(volume.id.clone())
            }
            // Only a pending marker proves that the allocation was under way.
            Some(_) if pending => plan.complete.push(volume.id.clone()),
            Some(_) => {
                plan.keep.push(volume.id.clone());
                plan.short.push(volume.id.clone());
            }
            None if volume.adoptable => plan.keep.push(volume.id.clone()),
            None if pending => plan.forget.push(volume.id.clone()),
            None => missing.push(volume.id.clone()),
        }
    }
    if !missing.is_empty() {
        return Err(Refusal::MissingDevices { ids: missing });
    }
    let known: BTreeSet<&String> = recorded.iter().map(|v| &v.id).collect();
    for id in devices {
        if known.contains(id) {
            continue;
        }
        if corrupt.contains(id) {
            plan.quarantined.push(id.clone());
        } else {
            plan.unrecorded.push(id.clone());
        }
    }
    plan.clear_pending = pending.iter().cloned().collect();
    Ok(plan)
}

/// The volume ID a state file name stands for (`<id>.json`).
pub fn id_of_state_file(name: &str) -> Option<&str> {
    name.strip_suffix(".json").filter(|id| !id.is_empty())
}

/// Counts for metrics and logs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// Devices kept without state.
    pub unrecorded: Vec<String>,
    /// Devices kept with their state quarantined.
    pub quarantined: Vec<String>,
}

/// One line per kept device, for the start-up log: what it is and how an operator clears it.
pub fn advice(report: &RepairReport) -> BTreeMap<String, &'static str> {
    let mut lines = BTreeMap::new();
    for id in &report.unrecorded {
        lines.insert(
            id.clone(),
            "device without state kept: restore its <id>.json if a volume needs it, or remove the device by hand (rm the emulated file, lvremove, ndctl destroy-namespace)",
        );
    }
    for id in &report.quarantined {
        lines.insert(
            id.clone(),
            "state file did not parse and was moved to <id>.json.quarantined; device kept: repair the file and move it back, or remove the device and the file by hand",
        );
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, size: u64, device: Option<u64>) -> Recorded {
        Recorded {
            id: id.into(),
            size,
            device,
            adoptable: false,
            growing_from: None,
        }
    }

    fn set(ids: &[&str]) -> BTreeSet<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    /// (case, recorded, pending, corrupt, devices, has pools, partial creates, want)
    type Case = (
        &'static str,
        Vec<Recorded>,
        &'static [&'static str],
        &'static [&'static str],
        &'static [&'static str],
        bool,
        bool,
        Result<RepairPlan, Refusal>,
    );

    #[test]
    fn plan_table() {
        let cases: Vec<Case> = vec![
            (
                "all present",
                vec![rec("a", 8, Some(8)), rec("b", 8, Some(8))],
                &[],
                &[],
                &["a", "b"],
                true,
                true,
                Ok(RepairPlan {
                    keep: ids(&["a", "b"]),
                    ..Default::default()
                }),
            ),
            (
                "nothing recorded, nothing there",
                vec![],
                &[],
                &[],
                &[],
                false,
                true,
                Ok(RepairPlan::default()),
            ),
            (
                "device without state is kept and reported, never deleted",
                vec![rec("a", 8, Some(8))],
                &[],
                &[],
                &["a", "stray"],
                true,
                true,
                Ok(RepairPlan {
                    keep: ids(&["a"]),
                    unrecorded: ids(&["stray"]),
                    ..Default::default()
                }),
            ),
            (
                "corrupt state: its device is quarantined, not deleted",
                vec![],
                &[],
                &["bad"],
                &["bad"],
                true,
                true,
                Ok(RepairPlan {
                    quarantined: ids(&["bad"]),
                    ..Default::default()
                }),
            ),
            (
                "create interrupted before the device: state forgotten",
                vec![rec("a", 8, None)],
                &["a"],
                &[],
                &[],
                true,
                true,
                Ok(RepairPlan {
                    forget: ids(&["a"]),
                    clear_pending: ids(&["a"]),
                    ..Default::default()
                }),
            ),
            (
                "create interrupted during allocation: completed",
                vec![rec("a", 8, Some(4))],
                &["a"],
                &[],
                &["a"],
                true,
                true,
                Ok(RepairPlan {
                    complete: ids(&["a"]),
                    clear_pending: ids(&["a"]),
                    ..Default::default()
                }),
            ),
            (
                "short device, no create interrupted: kept and reported, never re-allocated",
                vec![rec("a", 8, Some(4))],
                &[],
                &[],
                &["a"],
                true,
                true,
                Ok(RepairPlan {
                    keep: ids(&["a"]),
                    short: ids(&["a"]),
                    ..Default::default()
                }),
            ),
            (
                "short device without partial creates (PMEM-CSI 1.0 namespace): kept",
                vec![rec("a", 8, Some(4))],
                &[],
                &[],
                &["a"],
                true,
                false,
                Ok(RepairPlan {
                    keep: ids(&["a"]),
                    ..Default::default()
                }),
            ),
            (
                "create or delete interrupted with the device there: kept, marker cleared",
                vec![rec("a", 8, Some(8))],
                &["a"],
                &[],
                &["a"],
                true,
                true,
                Ok(RepairPlan {
                    keep: ids(&["a"]),
                    clear_pending: ids(&["a"]),
                    ..Default::default()
                }),
            ),
            (
                "a device gone without marker: refuse, keep every state",
                vec![rec("a", 8, Some(8)), rec("b", 8, None), rec("c", 8, None)],
                &["c"],
                &[],
                &["a"],
                true,
                true,
                Err(Refusal::MissingDevices { ids: ids(&["b"]) }),
            ),
            (
                "backend empty (ndctl list empty while modules load): refuse",
                vec![rec("a", 8, None), rec("b", 8, None)],
                &[],
                &[],
                &[],
                true,
                true,
                Err(Refusal::MissingDevices {
                    ids: ids(&["a", "b"]),
                }),
            ),
            (
                "no pools at all: refuse before looking at devices",
                vec![rec("a", 8, None)],
                &["a"],
                &[],
                &[],
                false,
                true,
                Err(Refusal::NoPools { recorded: 1 }),
            ),
            (
                "an interrupted growth is finished, whatever the device's size",
                vec![
                    Recorded {
                        growing_from: Some(4),
                        ..rec("a", 8, Some(4))
                    },
                    Recorded {
                        growing_from: Some(4),
                        ..rec("b", 8, Some(8))
                    },
                    rec("c", 8, Some(8)),
                ],
                &[],
                &[],
                &["a", "b", "c"],
                true,
                false,
                Ok(RepairPlan {
                    keep: ids(&["c"]),
                    finish_growth: ids(&["a", "b"]),
                    ..Default::default()
                }),
            ),
            (
                "a growing volume without device is missing, not forgotten",
                vec![Recorded {
                    growing_from: Some(4),
                    ..rec("a", 8, None)
                }],
                &[],
                &[],
                &[],
                true,
                true,
                Err(Refusal::MissingDevices { ids: ids(&["a"]) }),
            ),
            (
                "fake backend adopts volumes without device",
                vec![Recorded {
                    adoptable: true,
                    ..rec("a", 8, None)
                }],
                &[],
                &[],
                &[],
                true,
                true,
                Ok(RepairPlan {
                    keep: ids(&["a"]),
                    ..Default::default()
                }),
            ),
            (
                "a stale marker without state is cleared",
                vec![],
                &["gone"],
                &[],
                &[],
                true,
                true,
                Ok(RepairPlan {
                    clear_pending: ids(&["gone"]),
                    ..Default::default()
                }),
            ),
        ];
        for (case, recorded, pending, corrupt, devices, pools, partial, want) in cases {
            assert_eq!(
                plan(
                    &recorded,
                    &set(pending),
                    &set(corrupt),
                    &set(devices),
                    pools,
                    partial
                ),
                want,
                "{case}"
            );
        }
    }

    #[test]
    fn refusals_say_what_to_do() {
        let e = Refusal::MissingDevices {
            ids: ids(&["a", "b"]),
        };
        let text = e.to_string();
        assert!(
            text.starts_with("2 recorded volume(s) have no device"),
            "{text}"
        );
        assert!(
            text.contains("a, b") && text.contains("move its state file"),
            "{text}"
        );
        assert!(
            Refusal::NoPools { recorded: 3 }
                .to_string()
                .contains("3 volume(s) are recorded")
        );
    }

    #[test]
    fn state_file_names() {
        assert_eq!(id_of_state_file("pvc-a6-123.json"), Some("pvc-a6-123"));
        assert_eq!(id_of_state_file(".json"), None);
        assert_eq!(id_of_state_file("x.json.quarantined"), None);
    }
}
