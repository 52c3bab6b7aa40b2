//! What the extender would decide about one pod, as `GET /explain` on its admin port reports it
//! to `pmem-csi explain`: the pod's demand, the reservation it holds, and per node the fit that
//! `/filter` would judge now. The JSON field names are a contract with `explain` (which may run
//! a different version than the extender): fields are only ever added.

use serde::{Deserialize, Serialize};

use crate::reservation_book::EntryKey;

/// The extender's view of one pod.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodView {
    /// `namespace/name` of the pod.
    pub pod: String,
    /// The pod's uid, which reservations are held under.
    pub uid: String,
    /// The extender's `--placement`.
    pub placement: String,
    /// What the pod names that the extender's caches lack: `/filter` would answer "retry".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unseen: Option<String>,
    /// The pod's pending volumes as the fit counts them.
    #[serde(default)]
    pub demand: Vec<DemandView>,
    /// The reservation the pod holds, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<ReservationView>,
    /// Every node that published capacity (and every node the pod holds a reservation on),
    /// with the fit `/filter` would judge now; by name.
    #[serde(default)]
    pub nodes: Vec<NodeFitView>,
}

/// One pending volume of the pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DemandView {
    /// The claim or inline volume.
    pub key: EntryKey,
    /// Requested bytes (the extender's default size when the volume states none).
    pub bytes: u64,
    /// The claim already has a selected node: it counts there, not as a reservation.
    pub selected: bool,
}

/// A reservation held for the pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationView {
    /// Seconds since it was made (it expires after `--reservation-ttl`).
    pub age_seconds: u64,
    /// Per node, the bytes it holds there (each entry aligned as that node allocates).
    pub nodes: Vec<ReservedOn>,
    /// The entries still open (those whose claims have no selected node yet).
    pub entries: Vec<crate::reservation_book::Entry>,
}

/// Bytes a reservation holds on one node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservedOn {
    /// Node name.
    pub node: String,
    /// Bytes held there.
    pub bytes: u64,
}

/// The fit of the pod's demand on one node, as `/filter` would judge it now.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeFitView {
    /// Node name.
    pub node: String,
    /// The liveness judgement says the driver definitely does not run there.
    pub driverless: bool,
    /// The node published capacity.
    pub published: bool,
    /// Free bytes per pool as published, largest first.
    #[serde(default)]
    pub pools: Vec<u64>,
    /// Bytes the driver manages there (`managed-bytes`), when published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub managed: Option<u64>,
    /// Aligned bytes allocated there (PVs, selected claims, inline volumes), the pod's own
    /// claims left out.
    pub allocated: u64,
    /// Bytes other pods' reservations hold there.
    pub reserved_by_others: u64,
    /// Volume sizes round up to a multiple of this.
    pub alignment: u64,
    /// `/filter` would pass the node.
    pub fits: bool,
    /// Free bytes left after placing the pod, when it fits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_after: Option<u64>,
    /// `/filter`'s rejection reason, when it does not fit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}
