//! What the controller keeps of a PersistentVolumeClaim: its identity, deletion, class, bound
//! volume and the annotations the rescheduler, the webhook and the node-loss recovery read.
//!
//! It is a [`kube::Resource`] of its own (kind PersistentVolumeClaim, core/v1) so that watches,
//! caches and reads decode straight into it: everything else of a claim — managedFields, status,
//! labels, other annotations (`kubectl.kubernetes.io/last-applied-configuration` is a copy of
//! the whole claim) — is skipped by the decoder instead of being built and thrown away. At
//! 10,000 claims that is the difference between a cache of ~19 MiB plus as much allocator
//! garbage from decoding, and a few MiB (`just bench`'s `controller-rss-after-pass`).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::Resource;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, de};

use crate::well_known::{
    BETA_STORAGE_PROVISIONER, RECREATE_ON_NODE_LOSS, SELECTED_NODE, STORAGE_PROVISIONER,
};

/// The claim annotations anything here reads; a summary keeps these only.
pub const KEPT_ANNOTATIONS: [&str; 4] = [
    RECREATE_ON_NODE_LOSS,
    SELECTED_NODE,
    STORAGE_PROVISIONER,
    BETA_STORAGE_PROVISIONER,
];

/// A PersistentVolumeClaim as the controller caches and reads it (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct ClaimSummary {
    /// name, namespace, uid, resourceVersion, deletionTimestamp and the [`KEPT_ANNOTATIONS`].
    #[serde(default, deserialize_with = "summary_meta")]
    pub metadata: ObjectMeta,
    /// The class and the bound volume; `None` when the claim has no spec.
    #[serde(default)]
    pub spec: Option<ClaimSummarySpec>,
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

impl Resource for ClaimSummary {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "PersistentVolumeClaim".into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        "persistentvolumeclaims".into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The metadata fields a summary keeps, decoded; the rest of ObjectMeta is skipped unbuilt.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SummaryMeta {
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

fn summary_meta<'de, D: Deserializer<'de>>(deserializer: D) -> Result<ObjectMeta, D::Error> {
    let meta = SummaryMeta::deserialize(deserializer)?;
    Ok(ObjectMeta {
        name: meta.name,
        namespace: meta.namespace,
        uid: meta.uid,
        resource_version: meta.resource_version,
        deletion_timestamp: meta.deletion_timestamp,
        annotations: meta
            .annotations
            .and_then(|a| (!a.0.is_empty()).then_some(a.0)),
        ..ObjectMeta::default()
    })
}

/// The [`KEPT_ANNOTATIONS`] of an annotations map; other values are skipped, not allocated.
struct KeptAnnotations(BTreeMap<String, String>);

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
        let mut kept = BTreeMap::new();
        while let Some(key) = map.next_key_seed(KeptKey)? {
            match key {
                Some(key) => {
                    kept.insert(key.to_string(), map.next_value::<String>()?);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(KeptAnnotations(kept))
    }
}

/// An annotation key: which of the [`KEPT_ANNOTATIONS`] it is, compared without allocating.
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
        Ok(KEPT_ANNOTATIONS.iter().find(|k| **k == key).copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;
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
                    "volume.kubernetes.io/storage-provisioner": "pmem-csi.intel.com",
                    "volume.beta.kubernetes.io/storage-provisioner": "pmem-csi.intel.com",
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

    #[test]
    fn keeps_what_is_read_and_nothing_else() {
        let summary: ClaimSummary = serde_json::from_value(full_claim()).expect("decodes");
        let full: PersistentVolumeClaim = serde_json::from_value(full_claim()).expect("decodes");
        let expected_annotations: BTreeMap<String, String> = KEPT_ANNOTATIONS
            .iter()
            .map(|k| {
                (
                    k.to_string(),
                    full.metadata.annotations.as_ref().expect("set")[*k].clone(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            ClaimSummary {
                metadata: ObjectMeta {
                    name: Some("data".into()),
                    namespace: Some("app".into()),
                    uid: Some("u-1".into()),
                    resource_version: Some("42".into()),
                    deletion_timestamp: full.metadata.deletion_timestamp.clone(),
                    annotations: Some(expected_annotations),
                    ..ObjectMeta::default()
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
    fn absent_and_null_parts() {
        let cases: [(&str, serde_json::Value, ClaimSummary); 5] = [
            ("empty object", json!({}), ClaimSummary::default()),
            (
                "null annotations and spec",
                json!({"metadata": {"name": "a", "annotations": null}, "spec": null}),
                ClaimSummary {
                    metadata: ObjectMeta {
                        name: Some("a".into()),
                        ..ObjectMeta::default()
                    },
                    spec: None,
                },
            ),
            (
                "only other annotations",
                json!({"metadata": {"annotations": {"other": "x"}}}),
                ClaimSummary::default(),
            ),
            (
                "empty spec",
                json!({"spec": {}}),
                ClaimSummary {
                    spec: Some(ClaimSummarySpec::default()),
                    ..ClaimSummary::default()
                },
            ),
            (
                "escaped key",
                serde_json::from_str(
                    r#"{"metadata": {"annotations": {"volume.kubernetes.io\/selected-node": "n"}}}"#,
                )
                .expect("valid JSON"),
                ClaimSummary {
                    metadata: ObjectMeta {
                        annotations: Some([(SELECTED_NODE.to_string(), "n".to_string())].into()),
                        ..ObjectMeta::default()
                    },
                    spec: None,
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
        assert_eq!(
            summary.metadata.annotations,
            Some([(SELECTED_NODE.to_string(), "n".to_string())].into())
        );
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
