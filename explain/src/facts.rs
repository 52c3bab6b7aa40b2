//! Everything `explain` read about one pod, as plain data: what [`crate::gather`] fills from the
//! apiserver and the extender, and what [`crate::explanation::explain`] decides from. Tests
//! build it directly.

use std::collections::BTreeMap;

use controllers::liveness::NodeObservation;
use extender::pod_view::PodView;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{CSIStorageCapacity, StorageClass};

/// What explain knows about one pod.
#[derive(Clone, Debug)]
pub struct Facts {
    /// The CSI driver's name.
    pub driver: String,
    /// Size assumed for a volume that states none (the driver's `--default-volume-size`).
    pub default_volume_size: u64,
    /// The pod.
    pub pod: Pod,
    /// The pod's claims that exist, by name (the pod's namespace).
    pub claims: BTreeMap<String, PersistentVolumeClaim>,
    /// Every StorageClass, by name.
    pub classes: BTreeMap<String, StorageClass>,
    /// The PVs the pod's claims are bound to, by name.
    pub volumes: BTreeMap<String, PersistentVolume>,
    /// The driver's CSIStorageCapacity objects.
    pub capacities: Vec<CSIStorageCapacity>,
    /// What the Node, CSINode and heartbeat Lease of each node of interest show (every Node,
    /// and every name a claim, PV or capacity object refers to).
    pub nodes: BTreeMap<String, NodeObservation>,
    /// Recent Events of the pod and its claims.
    pub events: Vec<EventFact>,
    /// What the scheduler extender says.
    pub extender: ExtenderFacts,
}

/// One Event, from core/v1 or events.k8s.io.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventFact {
    /// Kind of the object it is about (`Pod`, `PersistentVolumeClaim`).
    pub kind: String,
    /// Name of that object.
    pub name: String,
    /// `Normal` or `Warning`.
    pub type_: String,
    /// The reason (`FailedScheduling`, `ProvisioningFailed`, …).
    pub reason: String,
    /// The message.
    pub message: String,
    /// Who reported it (`default-scheduler`, the provisioner).
    pub source: String,
    /// How often it happened.
    pub count: u32,
    /// When it last happened (RFC 3339), when known; orders the events.
    pub last_seen: Option<String>,
}

/// What asking the scheduler extender gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtenderFacts {
    /// The extender's view of the pod.
    View(Box<PodView>),
    /// No extender pod is installed in the driver's namespace.
    NotInstalled,
    /// An extender exists but did not answer; the message says why.
    Unreachable(String),
}
