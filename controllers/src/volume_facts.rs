//! What pmem-csi reads of claims, classes and PVs, in one shape each, and the rules over them
//! that several concerns share: whose claim it is, which class is the default, which node a PV
//! lives on. The rescheduler, the webhook, the extender and the node's sweep all read these;
//! none defines them again.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::{CSIStorageCapacity, StorageClass};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;

use crate::claim_summary::ClaimSummary;
use crate::well_known::{
    BETA_DEFAULT_CLASS, BETA_STORAGE_PROVISIONER, DEFAULT_CLASS, IMMEDIATE, SELECTED_NODE,
    STORAGE_PROVISIONER, topology_key,
};

/// A PersistentVolumeClaim's identity.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct ClaimKey {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
}

impl ClaimKey {
    /// A key from its parts.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        ClaimKey {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// The key of `claim`; `None` without namespace or name.
    pub fn of(claim: &PersistentVolumeClaim) -> Option<Self> {
        Some(ClaimKey::new(
            claim.metadata.namespace.clone()?,
            claim.metadata.name.clone()?,
        ))
    }
}

impl std::fmt::Display for ClaimKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What pmem-csi reads of one PersistentVolumeClaim.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimFacts {
    /// `spec.storageClassName`; `None` when absent or empty (both mean "no class").
    pub class: Option<String>,
    /// `spec.volumeName`; `None` when absent or empty.
    pub volume_name: Option<String>,
    /// The selected-node annotation.
    pub selected_node: Option<String>,
    /// The storage-provisioner annotation (or its beta predecessor).
    pub provisioner_annotation: Option<String>,
    /// `spec.resources.requests["storage"]` in bytes; `None` when absent, zero or unparseable.
    pub request: Option<u64>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// `metadata.uid`, to tell a claim from an earlier one of the same name.
    pub uid: Option<String>,
    /// A growth of the claim failed or was refused: `status.allocatedResourceStatuses.storage`
    /// says `…Failed` or `…Infeasible`, or a resize-error condition holds (kubelet reports a
    /// refusal from the node as `NodeResizeError`).
    pub growth_failed: bool,
}

impl ClaimFacts {
    /// The facts of `claim`.
    pub fn of(claim: &PersistentVolumeClaim) -> Self {
        let spec = claim.spec.as_ref();
        ClaimFacts {
            request: spec.and_then(|s| storage_request(s.resources.as_ref()?.requests.as_ref())),
            growth_failed: growth_failed(claim),
            ..ClaimFacts::of_parts(
                &claim.metadata,
                spec.and_then(|s| s.storage_class_name.as_deref()),
                spec.and_then(|s| s.volume_name.as_deref()),
                claim
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(SELECTED_NODE))
                    .cloned(),
                provisioner_annotation(&claim.metadata),
            )
        }
    }

    /// The facts of a cached claim: as [`ClaimFacts::of`] but without `request` and
    /// `growth_failed`, which a summary does not keep.
    pub fn of_summary(claim: &ClaimSummary) -> Self {
        let spec = claim.spec.as_ref();
        ClaimFacts::of_parts(
            &claim.metadata,
            spec.and_then(|s| s.storage_class_name.as_deref()),
            spec.and_then(|s| s.volume_name.as_deref()),
            claim.annotations.selected_node.clone(),
            claim.annotations.provisioner.clone(),
        )
    }

    fn of_parts(
        meta: &ObjectMeta,
        class: Option<&str>,
        volume_name: Option<&str>,
        selected_node: Option<String>,
        provisioner_annotation: Option<String>,
    ) -> Self {
        ClaimFacts {
            class: non_empty(class),
            volume_name: non_empty(volume_name),
            selected_node,
            provisioner_annotation,
            request: None,
            deleting: meta.deletion_timestamp.is_some(),
            uid: meta.uid.clone(),
            growth_failed: false,
        }
    }

    /// `spec.volumeName` is set: the claim has (or is getting) its volume.
    pub fn bound(&self) -> bool {
        self.volume_name.is_some()
    }
}

/// Whether the claim's last growth failed or was refused (see [`ClaimFacts::growth_failed`]).
fn growth_failed(claim: &PersistentVolumeClaim) -> bool {
    let Some(status) = claim.status.as_ref() else {
        return false;
    };
    let resize_status = status
        .allocated_resource_statuses
        .as_ref()
        .and_then(|s| s.get("storage"))
        .is_some_and(|s| s.ends_with("Failed") || s.ends_with("Infeasible"));
    let error_condition = status.conditions.iter().flatten().any(|c| {
        c.status == "True" && (c.type_ == "NodeResizeError" || c.type_ == "ControllerResizeError")
    });
    resize_status || error_condition
}

impl From<&PersistentVolumeClaim> for ClaimFacts {
    fn from(claim: &PersistentVolumeClaim) -> Self {
        ClaimFacts::of(claim)
    }
}

impl From<&ClaimSummary> for ClaimFacts {
    fn from(claim: &ClaimSummary) -> Self {
        ClaimFacts::of_summary(claim)
    }
}

/// What pmem-csi reads of one StorageClass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClassFacts {
    /// `provisioner`.
    pub provisioner: String,
    /// `volumeBindingMode` is set and is not `Immediate` (absent defaults to `Immediate`).
    pub late_binding: bool,
    /// Annotated as the cluster default (either spelling, value `"true"`).
    pub default: bool,
    /// `metadata.creationTimestamp`, to choose among several defaults.
    pub created: Option<Timestamp>,
}

impl ClassFacts {
    /// The facts of `class`.
    pub fn of(class: &StorageClass) -> Self {
        ClassFacts {
            provisioner: class.provisioner.clone(),
            late_binding: class
                .volume_binding_mode
                .as_deref()
                .is_some_and(|mode| mode != IMMEDIATE),
            default: is_default_class(&class.metadata),
            created: class.metadata.creation_timestamp.as_ref().map(|t| t.0),
        }
    }
}

impl From<&StorageClass> for ClassFacts {
    fn from(class: &StorageClass) -> Self {
        ClassFacts::of(class)
    }
}

/// The provisioner of a claim (or claim template): its class decides; only without a class
/// object does the storage-provisioner annotation (which kube-controller-manager copies from the
/// class) stand in for it.
pub fn provisioner<'a>(
    class: Option<&'a ClassFacts>,
    annotation: Option<&'a str>,
) -> Option<&'a str> {
    match class {
        Some(class) => Some(class.provisioner.as_str()),
        None => annotation,
    }
}

/// Which binding modes [`is_ours`] accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binding {
    /// Any: the rescheduler acts on every claim of the driver with a selected node (an
    /// Immediate claim gets one only from a user, and is stuck all the same on a dead node).
    Any,
    /// Late binding only: the webhook and the extender place volumes, and an Immediate claim is
    /// provisioned before its pod is scheduled, so it is never pending demand of a pod.
    Late,
}

/// Whether a claim (or claim template) with `class` (resolved; `None` when it has none or the
/// class is not known) and `annotation` is this `driver`'s, for the concerns that accept
/// `binding`. Without a class object the annotation is the only witness; it is set only for
/// classes that wait, or for claims already handed to the provisioner, so it counts as late
/// binding. What else a concern requires stays with it: the webhook looks only at unbound
/// claims, the extender counts bound ones too, the rescheduler skips bound and deleted ones.
pub fn is_ours(
    class: Option<&ClassFacts>,
    annotation: Option<&str>,
    driver: &str,
    binding: Binding,
) -> bool {
    match class {
        Some(class) => {
            class.provisioner == driver && (binding == Binding::Any || class.late_binding)
        }
        None => annotation == Some(driver),
    }
}

/// The storage-provisioner annotation of an object (either spelling).
pub fn provisioner_annotation(meta: &ObjectMeta) -> Option<String> {
    let annotations = meta.annotations.as_ref()?;
    annotations
        .get(STORAGE_PROVISIONER)
        .or_else(|| annotations.get(BETA_STORAGE_PROVISIONER))
        .cloned()
}

/// The `storage` request in bytes; `None` when absent, zero or unparseable.
pub fn storage_request(requests: Option<&BTreeMap<String, Quantity>>) -> Option<u64> {
    positive_bytes(&requests?.get("storage")?.0)
}

/// A quantity in bytes; `None` when zero or unparseable.
pub fn positive_bytes(text: &str) -> Option<u64> {
    crate::quantity::parse_bytes(text).ok().filter(|&n| n > 0)
}

/// Whether an object carries a default-class annotation with value `"true"`.
pub fn is_default_class(meta: &ObjectMeta) -> bool {
    meta.annotations.as_ref().is_some_and(|a| {
        [DEFAULT_CLASS, BETA_DEFAULT_CLASS]
            .iter()
            .any(|key| a.get(*key).is_some_and(|v| v == "true"))
    })
}

/// The class the DefaultStorageClass admission plugin would assign: among the default-annotated
/// classes the newest by creationTimestamp, ties broken by the smaller name (as Kubernetes does).
/// Takes and returns (name, class).
pub fn default_class<'a>(
    classes: impl IntoIterator<Item = (&'a str, &'a ClassFacts)>,
) -> Option<(&'a str, &'a ClassFacts)> {
    classes
        .into_iter()
        .filter(|(_, class)| class.default)
        .max_by(|(an, a), (bn, b)| a.created.cmp(&b.created).then_with(|| bn.cmp(an)))
}

/// The node a PV of `driver` lives on: the value of its required node affinity's
/// `<driver>/node In [...]` expression. `None` for other drivers' PVs and PVs without it.
pub fn pv_node(pv: &PersistentVolume, driver: &str) -> Option<String> {
    let spec = pv.spec.as_ref()?;
    if spec.csi.as_ref()?.driver != driver {
        return None;
    }
    let key = topology_key(driver);
    spec.node_affinity
        .as_ref()?
        .required
        .as_ref()?
        .node_selector_terms
        .iter()
        .flat_map(|t| t.match_expressions.iter().flatten())
        .find(|e| e.key == key && e.operator == "In")
        .and_then(|e| e.values.as_ref()?.first().cloned())
}

/// The node a CSIStorageCapacity object of `driver` describes: its `nodeTopology`'s
/// `<driver>/node` label.
pub fn capacity_node(object: &CSIStorageCapacity, driver: &str) -> Option<String> {
    object
        .node_topology
        .as_ref()?
        .match_labels
        .as_ref()?
        .get(&topology_key(driver))
        .cloned()
}

fn non_empty(text: Option<&str>) -> Option<String> {
    text.filter(|t| !t.is_empty()).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const DRIVER: &str = "pmem-csi.intel.com";

    fn class(provisioner: &str, late: bool) -> ClassFacts {
        ClassFacts {
            provisioner: provisioner.into(),
            late_binding: late,
            ..ClassFacts::default()
        }
    }

    #[test]
    fn is_ours_table() {
        let ours_late = class(DRIVER, true);
        let ours_immediate = class(DRIVER, false);
        let other = class("other", true);
        // (class, annotation, binding, want)
        let cases = [
            (Some(&ours_late), None, Binding::Late, true),
            (Some(&ours_late), None, Binding::Any, true),
            (Some(&ours_immediate), None, Binding::Late, false),
            (Some(&ours_immediate), None, Binding::Any, true),
            // The class decides over the annotation.
            (Some(&other), Some(DRIVER), Binding::Any, false),
            (Some(&ours_late), Some("other"), Binding::Late, true),
            (None, Some(DRIVER), Binding::Late, true),
            (None, Some(DRIVER), Binding::Any, true),
            (None, Some("other"), Binding::Any, false),
            (None, None, Binding::Any, false),
        ];
        for (i, (class, annotation, binding, want)) in cases.into_iter().enumerate() {
            assert_eq!(
                is_ours(class, annotation, DRIVER, binding),
                want,
                "case {i}"
            );
        }
        assert_eq!(provisioner(Some(&other), Some(DRIVER)), Some("other"));
        assert_eq!(provisioner(None, Some(DRIVER)), Some(DRIVER));
        assert_eq!(provisioner(None, None), None);
    }

    #[test]
    fn claim_facts_of_a_claim() {
        let claim: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "u1",
                "deletionTimestamp": "2026-01-01T00:00:00Z",
                "annotations": {SELECTED_NODE: "n1", BETA_STORAGE_PROVISIONER: DRIVER}},
            "spec": {"storageClassName": "", "volumeName": "pv1",
                "resources": {"requests": {"storage": "1Gi"}}}
        }))
        .expect("claim");
        let facts = ClaimFacts::of(&claim);
        assert_eq!(
            facts,
            ClaimFacts {
                class: None,
                volume_name: Some("pv1".into()),
                selected_node: Some("n1".into()),
                provisioner_annotation: Some(DRIVER.into()),
                request: Some(1 << 30),
                deleting: true,
                uid: Some("u1".into()),
                growth_failed: false,
            }
        );
        assert!(facts.bound());
        assert_eq!(ClaimKey::of(&claim), Some(ClaimKey::new("ns", "c")));
        let empty: PersistentVolumeClaim =
            serde_json::from_value(json!({"spec": {"resources": {"requests": {"storage": "0"}}}}))
                .expect("claim");
        assert_eq!(ClaimFacts::of(&empty), ClaimFacts::default());
    }

    #[test]
    fn a_summary_has_the_same_facts_but_request_and_growth() {
        let claims = [
            json!({
                "metadata": {"name": "c", "namespace": "ns", "uid": "u1",
                    "deletionTimestamp": "2026-01-01T00:00:00Z",
                    "annotations": {SELECTED_NODE: "n1", BETA_STORAGE_PROVISIONER: DRIVER,
                        STORAGE_PROVISIONER: "other", "x": "y"}},
                "spec": {"storageClassName": "", "volumeName": "pv1",
                    "resources": {"requests": {"storage": "1Gi"}}},
                "status": {"conditions": [{"type": "NodeResizeError", "status": "True"}]}
            }),
            json!({"spec": {"storageClassName": "sc"}}),
            json!({"metadata": {"annotations": {STORAGE_PROVISIONER: DRIVER}}}),
            json!({"metadata": {"annotations": {BETA_STORAGE_PROVISIONER: DRIVER, "a": "b"}}}),
            json!({}),
        ];
        for value in claims {
            let full: PersistentVolumeClaim = serde_json::from_value(value.clone()).expect("claim");
            let summary: ClaimSummary = serde_json::from_value(value.clone()).expect("summary");
            assert_eq!(
                ClaimFacts::of_summary(&summary),
                ClaimFacts {
                    request: None,
                    growth_failed: false,
                    ..ClaimFacts::of(&full)
                },
                "{value}"
            );
        }
    }

    #[test]
    fn a_failed_or_refused_growth_is_seen() {
        for (case, status, want) in [
            ("no status", json!(null), false),
            (
                "growing",
                json!({"allocatedResourceStatuses": {"storage": "NodeResizePending"}}),
                false,
            ),
            (
                "infeasible",
                json!({"allocatedResourceStatuses": {"storage": "NodeResizeInfeasible"}}),
                true,
            ),
            (
                "failed",
                json!({"allocatedResourceStatuses": {"storage": "ControllerResizeFailed"}}),
                true,
            ),
            (
                "refused by the node",
                json!({"allocatedResourceStatuses": {"storage": "NodeResizeInProgress"},
                       "conditions": [{"type": "NodeResizeError", "status": "True"}]}),
                true,
            ),
            (
                "an old error",
                json!({"conditions": [{"type": "NodeResizeError", "status": "False"}]}),
                false,
            ),
        ] {
            let claim: PersistentVolumeClaim =
                serde_json::from_value(json!({"status": status})).expect("claim");
            assert_eq!(ClaimFacts::of(&claim).growth_failed, want, "{case}");
        }
    }

    #[test]
    fn default_class_is_the_newest_then_the_smaller_name() {
        let at = |s: &str| Some(s.parse::<Timestamp>().expect("time"));
        let mut old = class(DRIVER, true);
        old.default = true;
        old.created = at("2026-01-01T00:00:00Z");
        let mut new_a = class("a", true);
        new_a.default = true;
        new_a.created = at("2026-02-01T00:00:00Z");
        let mut new_b = new_a.clone();
        new_b.provisioner = "b".into();
        let mut newest_not_default = class("x", true);
        newest_not_default.created = at("2026-03-01T00:00:00Z");
        let classes = [
            ("old", &old),
            ("b", &new_b),
            ("a", &new_a),
            ("x", &newest_not_default),
        ];
        assert_eq!(
            default_class(classes.iter().copied()).map(|(name, _)| name),
            Some("a")
        );
        assert_eq!(default_class([("x", &newest_not_default)]), None);
        let meta = |key: &str, value: &str| ObjectMeta {
            annotations: Some([(key.to_string(), value.to_string())].into()),
            ..ObjectMeta::default()
        };
        assert!(is_default_class(&meta(DEFAULT_CLASS, "true")));
        assert!(is_default_class(&meta(BETA_DEFAULT_CLASS, "true")));
        assert!(!is_default_class(&meta(DEFAULT_CLASS, "yes")));
    }

    #[test]
    fn pv_node_reads_the_driver_topology_only() {
        let pv = |driver: &str, key: &str, operator: &str| -> PersistentVolume {
            serde_json::from_value(json!({"spec": {
                "csi": {"driver": driver, "volumeHandle": "h"},
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "other/key", "operator": "In", "values": ["x"]},
                    {"key": key, "operator": operator, "values": ["n1"]}
                ]}]}}
            }}))
            .expect("pv")
        };
        let key = topology_key(DRIVER);
        assert_eq!(pv_node(&pv(DRIVER, &key, "In"), DRIVER), Some("n1".into()));
        assert_eq!(pv_node(&pv("other", &key, "In"), DRIVER), None);
        assert_eq!(pv_node(&pv(DRIVER, &key, "NotIn"), DRIVER), None);
        assert_eq!(pv_node(&pv(DRIVER, "other/key2", "In"), DRIVER), None);
    }
}
