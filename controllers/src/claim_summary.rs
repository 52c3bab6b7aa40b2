//! What the controller keeps of a PersistentVolumeClaim: its identity, deletion, class, bound
//! volume and the three annotations the rescheduler, the webhook and the node-loss recovery read.
//!
//! It is a [`kube::Resource`] of its own (kind PersistentVolumeClaim, core/v1) so that watches,
//! caches and reads decode straight into it: everything else of a claim — managedFields, status,
//! labels, other annotations (`kubectl.kubernetes.io/last-applied-configuration` is a copy of
//! the whole claim) — is skipped by the decoder instead of being built and thrown away. At
//! 10,000 claims that is the difference between a cache of ~19 MiB plus as much allocator
//! garbage from decoding, and ~8 MiB (`just bench`'s `controller-rss-after-pass`). The kept
//! annotations are fields of their own rather than a map in `metadata.annotations`, which stays
//! `None`: a B-tree node of 11 slots would cost ~0.5 KiB per claim for at most three entries.

use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, de};

use crate::well_known::{
    BETA_STORAGE_PROVISIONER, RECREATE_ON_NODE_LOSS, SELECTED_NODE, STORAGE_PROVISIONER,
};

/// A PersistentVolumeClaim as the controller caches and reads it (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClaimSummary {
    /// name, namespace, uid, resourceVersion and deletionTimestamp; nothing else (annotations
    /// included: see [`ClaimSummary::annotations`]).
    pub metadata: ObjectMeta,
    /// The annotations anything here reads, taken from `metadata.annotations` while decoding.
    pub annotations: ClaimAnnotations,
    /// The class and the bound volume; `None` when the claim has no spec.
    pub spec: Option<ClaimSummarySpec>,
}

/// The claim annotations anything here reads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimAnnotations {
    /// `volume.kubernetes.io/selected-node`.
    pub selected_node: Option<String>,
    /// `volume.kubernetes.io/storage-provisioner`, or its beta spelling when only that is set.
    pub provisioner: Option<String>,
    /// `pmem-csi.intel.com/recreate-on-node-loss`.
    pub recreate_on_node_loss: Option<String>,
}

/// The part of a claim's spec a summary keeps (same field names as `PersistentVolumeClaimSpec`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimSummarySpec {
    /// `spec.storageClassName`.
    #[serde(default)]
    pub storage_class_name: Option<String>,
    /// `spec.volumeName`: the PV the claim is bound (or pre-bound) to.
    #[serde(default)]
    pub volume_name: Option<String>,
}

crate::core_resource::core_v1_resource!(
    ClaimSummary,
    "PersistentVolumeClaim",
    "persistentvolumeclaims",
    k8s_openapi::NamespaceResourceScope
);

impl<'de> Deserialize<'de> for ClaimSummary {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let wire = WireClaim::deserialize(deserializer)?;
        let meta = wire.metadata.unwrap_or_default();
        let kept = meta.annotations.unwrap_or_default();
        Ok(ClaimSummary {
            metadata: ObjectMeta {
                name: meta.name,
                namespace: meta.namespace,
                uid: meta.uid,
                resource_version: meta.resource_version,
                deletion_timestamp: meta.deletion_timestamp,
                ..ObjectMeta::default()
            },
            annotations: ClaimAnnotations {
                selected_node: kept.selected_node,
                provisioner: kept.provisioner.or(kept.beta_provisioner),
                recreate_on_node_loss: kept.recreate_on_node_loss,
            },
            spec: wire.spec,
        })
    }
}

/// A claim as decoded: unknown fields (status, managedFields, …) are skipped unbuilt.
#[derive(Deserialize)]
struct WireClaim {
    #[serde(default)]
    metadata: Option<WireMeta>,
    #[serde(default)]
    spec: Option<ClaimSummarySpec>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    deletion_timestamp: Option<Time>,
    #[serde(default)]
    annotations: Option<KeptAnnotations>,
}

/// The annotations of [`ClaimAnnotations`] in an annotations map; other values are skipped,
/// not allocated.
#[derive(Default)]
struct KeptAnnotations {
    selected_node: Option<String>,
    provisioner: Option<String>,
    beta_provisioner: Option<String>,
    recreate_on_node_loss: Option<String>,
}

impl<'de> Deserialize<'de> for KeptAnnotations {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(KeptVisitor)
    }
}

struct KeptVisitor;

impl<'de> Visitor<'de> for KeptVisitor {
    type Value = KeptAnnotations;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a map of annotations")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut kept = KeptAnnotations::default();
        while let Some(key) = map.next_key_seed(KeptKey)? {
            let slot = match key {
                Some(SELECTED_NODE) => &mut kept.selected_node,
                Some(STORAGE_PROVISIONER) => &mut kept.provisioner,
                Some(BETA_STORAGE_PROVISIONER) => &mut kept.beta_provisioner,
                Some(RECREATE_ON_NODE_LOSS) => &mut kept.recreate_on_node_loss,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    continue;
                }
            };
            *slot = Some(map.next_value::<String>()?);
        }
        Ok(kept)
    }
}

/// An annotation key: which of the kept ones it is, compared without allocating.
struct KeptKey;

impl<'de> DeserializeSeed<'de> for KeptKey {
    type Value = Option<&'static str>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeptKey {
    type Value = Option<&'static str>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an annotation key")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Self::Value, E> {
        Ok([
            SELECTED_NODE,
            STORAGE_PROVISIONER,
            BETA_STORAGE_PROVISIONER,
            RECREATE_ON_NODE_LOSS,
        ]
        .into_iter()
        .find(|k| *k == key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;
    use kube::Resource;
    use serde_json::json;

    fn full_claim() -> serde_json::Value {
        json!({
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {
                "name": "data",
                "namespace": "app",
                "uid": "u-1",
                "resourceVersion": "42",
                "generation": 3,
                "creationTimestamp": "2026-12-01T10:00:00Z",
                "deletionTimestamp": "2026-12-01T11:00:00Z",
                "labels": {"app": "db"},
                "finalizers": ["kubernetes.io/pvc-protection"],
                "annotations": {
                    "kubectl.kubernetes.io/last-applied-configuration": "{\"apiVersion\":\"v1\"}",
                    "volume.kubernetes.io/selected-node": "node-1",
                    "volume.beta.kubernetes.io/storage-provisioner": "beta.example.com",
                    "volume.kubernetes.io/storage-provisioner": "pmem-csi.intel.com",
                    "pmem-csi.intel.com/recreate-on-node-loss": "true",
                    "other": "x",
                },
                "managedFields": [{
                    "manager": "kube-controller-manager",
                    "operation": "Update",
                    "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:metadata": {"f:annotations": {".": {}}}},
                }],
            },
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Gi"}},
                "storageClassName": "pmem-csi-sc",
                "volumeMode": "Filesystem",
                "volumeName": "pvc-1",
            },
            "status": {"phase": "Bound", "capacity": {"storage": "1Gi"}},
        })
    }

    fn annotated(annotations: serde_json::Value) -> ClaimSummary {
        serde_json::from_value(json!({"metadata": {"annotations": annotations}})).expect("decodes")
    }

    #[test]
    fn keeps_what_is_read_and_nothing_else() {
        let summary: ClaimSummary = serde_json::from_value(full_claim()).expect("decodes");
        let full: PersistentVolumeClaim = serde_json::from_value(full_claim()).expect("decodes");
        assert_eq!(
            summary,
            ClaimSummary {
                metadata: ObjectMeta {
                    name: Some("data".into()),
                    namespace: Some("app".into()),
                    uid: Some("u-1".into()),
                    resource_version: Some("42".into()),
                    deletion_timestamp: full.metadata.deletion_timestamp.clone(),
                    ..ObjectMeta::default()
                },
                annotations: ClaimAnnotations {
                    selected_node: Some("node-1".into()),
                    provisioner: Some("pmem-csi.intel.com".into()),
                    recreate_on_node_loss: Some("true".into()),
                },
                spec: Some(ClaimSummarySpec {
                    storage_class_name: Some("pmem-csi-sc".into()),
                    volume_name: Some("pvc-1".into()),
                }),
            }
        );
        assert!(summary.metadata.deletion_timestamp.is_some());
    }

    #[test]
    fn annotations_table() {
        let cases: [(&str, serde_json::Value, ClaimAnnotations); 6] = [
            ("null", json!(null), ClaimAnnotations::default()),
            (
                "none kept",
                json!({"other": "x", "nested": {"a": [1]}}),
                ClaimAnnotations::default(),
            ),
            (
                "beta provisioner alone",
                json!({BETA_STORAGE_PROVISIONER: "b"}),
                ClaimAnnotations {
                    provisioner: Some("b".into()),
                    ..ClaimAnnotations::default()
                },
            ),
            (
                "GA provisioner wins, either order",
                json!({STORAGE_PROVISIONER: "ga", BETA_STORAGE_PROVISIONER: "b"}),
                ClaimAnnotations {
                    provisioner: Some("ga".into()),
                    ..ClaimAnnotations::default()
                },
            ),
            (
                "selected node",
                json!({SELECTED_NODE: "n"}),
                ClaimAnnotations {
                    selected_node: Some("n".into()),
                    ..ClaimAnnotations::default()
                },
            ),
            (
                "recreate",
                json!({RECREATE_ON_NODE_LOSS: "false"}),
                ClaimAnnotations {
                    recreate_on_node_loss: Some("false".into()),
                    ..ClaimAnnotations::default()
                },
            ),
        ];
        for (name, annotations, expected) in cases {
            let summary = annotated(annotations);
            assert_eq!(summary.annotations, expected, "{name}");
            assert_eq!(summary.metadata.annotations, None, "{name}");
        }
    }

    #[test]
    fn absent_and_null_parts() {
        let cases: [(&str, serde_json::Value, ClaimSummary); 4] = [
            ("empty object", json!({}), ClaimSummary::default()),
            (
                "null metadata",
                json!({"metadata": null}),
                ClaimSummary::default(),
            ),
            (
                "null annotations and spec",
                json!({"metadata": {"name": "a", "annotations": null}, "spec": null}),
                ClaimSummary {
                    metadata: ObjectMeta {
                        name: Some("a".into()),
                        ..ObjectMeta::default()
                    },
                    ..ClaimSummary::default()
                },
            ),
            (
                "empty spec",
                json!({"spec": {}}),
                ClaimSummary {
                    spec: Some(ClaimSummarySpec::default()),
                    ..ClaimSummary::default()
                },
            ),
        ];
        for (name, value, expected) in cases {
            let summary: ClaimSummary = serde_json::from_value(value).expect(name);
            assert_eq!(summary, expected, "{name}");
        }
    }

    #[test]
    fn escaped_key_from_bytes() {
        // Lists and watch events are decoded from bytes, where an escaped key is not borrowed.
        let body = br#"{"metadata": {"annotations": {"volume.kubernetes.io\/selected-node": "n", "x": {"nested": [1]}}}}"#;
        let summary: ClaimSummary = serde_json::from_slice(body).expect("decodes");
        assert_eq!(summary.annotations.selected_node.as_deref(), Some("n"));
    }

    #[test]
    fn wrong_types_fail() {
        for (name, value) in [
            (
                "annotations a list",
                json!({"metadata": {"annotations": []}}),
            ),
            (
                "kept value a number",
                json!({"metadata": {"annotations": {SELECTED_NODE: 1}}}),
            ),
            ("class a number", json!({"spec": {"storageClassName": 1}})),
            ("metadata a string", json!({"metadata": "x"})),
        ] {
            assert!(
                serde_json::from_value::<ClaimSummary>(value).is_err(),
                "{name} must not decode"
            );
        }
    }

    #[test]
    fn same_resource_as_a_claim() {
        assert_eq!(
            ClaimSummary::url_path(&(), Some("app")),
            PersistentVolumeClaim::url_path(&(), Some("app"))
        );
        let summary: ClaimSummary = serde_json::from_value(full_claim()).expect("decodes");
        let full: PersistentVolumeClaim = serde_json::from_value(full_claim()).expect("decodes");
        let reference = summary.object_ref(&());
        assert_eq!(reference, full.object_ref(&()));
        assert_eq!(reference.kind.as_deref(), Some("PersistentVolumeClaim"));
        assert_eq!(reference.api_version.as_deref(), Some("v1"));
    }
}
