//! What the driver liveness judgement keeps of a Node: its name, labels (the node selector
//! matches them), its Ready condition (the node-loss recovery's view of the kubelet) and
//! whether it carries the `node.kubernetes.io/out-of-service` taint (an operator's word that
//! the node is fenced).
//!
//! Like [`crate::claim_summary::ClaimSummary`], it is a [`kube::Resource`] of its own (kind
//! Node, core/v1) so that watches, caches and reads decode straight into it. A real Node is
//! mostly status — the images the kubelet holds (often tens of KiB), addresses, capacity,
//! daemon endpoints, node info — and managedFields; the decoder skips all of it instead of
//! building it per node and trimming it afterwards. The controller and the extender both watch
//! every Node of the cluster.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::Deserialize;
use serde::de::{Deserializer, SeqAccess, Visitor};

/// A Node as the liveness judgement caches and reads it (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeSummary {
    /// name, uid, resourceVersion, deletionTimestamp and labels; nothing else.
    pub metadata: ObjectMeta,
    /// The `Ready` condition of its status; `None` when the kubelet never reported one.
    pub ready: Option<ReadyCondition>,
    /// It carries the [`OUT_OF_SERVICE`] taint (any value or effect).
    pub out_of_service: bool,
}

/// Kubernetes' taint for a node that an operator has shut down or fenced (non-graceful node
/// shutdown): its pods and volumes may be moved away without waiting for its kubelet.
pub const OUT_OF_SERVICE: &str = "node.kubernetes.io/out-of-service";

/// A Node's `Ready` condition, as far as it is read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadyCondition {
    /// `True`, `False` or `Unknown` (the kubelet stopped reporting).
    pub status: String,
    /// When the status last changed.
    pub last_transition_time: Option<Time>,
}

crate::core_resource::core_v1_resource!(
    NodeSummary,
    "Node",
    "nodes",
    k8s_openapi::ClusterResourceScope
);

impl<'de> Deserialize<'de> for NodeSummary {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let wire = WireNode::deserialize(deserializer)?;
        let meta = wire.metadata.unwrap_or_default();
        Ok(NodeSummary {
            metadata: ObjectMeta {
                name: meta.name,
                uid: meta.uid,
                resource_version: meta.resource_version,
                deletion_timestamp: meta.deletion_timestamp,
                labels: meta.labels,
                ..ObjectMeta::default()
            },
            ready: wire.status.and_then(|s| s.conditions).and_then(|c| c.0),
            out_of_service: wire
                .spec
                .and_then(|s| s.taints)
                .is_some_and(|t| t.iter().any(|t| t.key == OUT_OF_SERVICE)),
        })
    }
}

/// A Node as decoded: unknown fields (spec, managedFields, annotations, images, …) are
/// skipped unbuilt.
#[derive(Deserialize)]
struct WireNode {
    #[serde(default)]
    metadata: Option<WireMeta>,
    #[serde(default)]
    spec: Option<WireSpec>,
    #[serde(default)]
    status: Option<WireStatus>,
}

#[derive(Deserialize)]
struct WireSpec {
    #[serde(default)]
    taints: Option<Vec<WireTaint>>,
}

#[derive(Deserialize)]
struct WireTaint {
    key: String,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    deletion_timestamp: Option<Time>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
struct WireStatus {
    #[serde(default)]
    conditions: Option<ReadyOnly>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireCondition {
    #[serde(rename = "type")]
    type_: String,
    status: String,
    #[serde(default)]
    last_transition_time: Option<Time>,
}

/// The `Ready` entry of a conditions list (the first one, should a list repeat it, as the
/// judgement read it from the full type).
struct ReadyOnly(Option<ReadyCondition>);

impl<'de> Deserialize<'de> for ReadyOnly {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_seq(ReadyVisitor)
    }
}

struct ReadyVisitor;

impl<'de> Visitor<'de> for ReadyVisitor {
    type Value = ReadyOnly;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of node conditions")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut ready = None;
        while let Some(condition) = seq.next_element::<WireCondition>()? {
            if condition.type_ == "Ready" && ready.is_none() {
                ready = Some(ReadyCondition {
                    status: condition.status,
                    last_transition_time: condition.last_transition_time,
                });
            }
        }
        Ok(ReadyOnly(ready))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Node;
    use kube::Resource;
    use serde_json::json;

    fn full_node() -> serde_json::Value {
        json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": "worker-1",
                "uid": "u-1",
                "resourceVersion": "7",
                "creationTimestamp": "2026-12-01T10:00:00Z",
                "labels": {"storage": "pmem", "kubernetes.io/hostname": "worker-1"},
                "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                "managedFields": [{"manager": "kubelet", "operation": "Update"}],
            },
            "spec": {"podCIDR": "10.0.0.0/24", "taints": [{"key": "k", "effect": "NoSchedule"}]},
            "status": {
                "conditions": [
                    {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory"},
                    {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                     "message": "Kubelet stopped posting node status.",
                     "lastHeartbeatTime": "2026-12-01T10:59:00Z",
                     "lastTransitionTime": "2026-12-01T11:00:00Z"},
                ],
                "images": [{"names": ["registry.k8s.io/pause:3.10"], "sizeBytes": 320368}],
                "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
                "nodeInfo": {"kubeletVersion": "v1.35.0"},
            },
        })
    }

    #[test]
    fn keeps_what_is_read_and_nothing_else() {
        let summary: NodeSummary = serde_json::from_value(full_node()).expect("decodes");
        let full: Node = serde_json::from_value(full_node()).expect("decodes");
        let ready = full
            .status
            .and_then(|s| s.conditions)
            .and_then(|c| c.into_iter().find(|c| c.type_ == "Ready"))
            .expect("a Ready condition");
        assert_eq!(
            summary,
            NodeSummary {
                metadata: ObjectMeta {
                    name: Some("worker-1".into()),
                    uid: Some("u-1".into()),
                    resource_version: Some("7".into()),
                    labels: full.metadata.labels.clone(),
                    ..ObjectMeta::default()
                },
                ready: Some(ReadyCondition {
                    status: "Unknown".into(),
                    last_transition_time: ready.last_transition_time,
                }),
                out_of_service: false,
            }
        );
    }

    #[test]
    fn out_of_service_table() {
        for (name, spec, want) in [
            ("no spec", json!(null), false),
            ("no taints", json!({}), false),
            (
                "another taint",
                json!({"taints": [{"key": "k", "effect": "NoSchedule"}]}),
                false,
            ),
            (
                "out of service, NoExecute",
                json!({"taints": [{"key": "k", "effect": "NoSchedule"},
                    {"key": OUT_OF_SERVICE, "value": "nodeshutdown", "effect": "NoExecute"}]}),
                true,
            ),
            (
                "out of service, NoSchedule",
                json!({"taints": [{"key": OUT_OF_SERVICE, "effect": "NoSchedule"}]}),
                true,
            ),
        ] {
            let summary: NodeSummary = serde_json::from_value(json!({"spec": spec})).expect(name);
            assert_eq!(summary.out_of_service, want, "{name}");
        }
    }

    #[test]
    fn ready_table() {
        let cases: [(&str, serde_json::Value, Option<&str>); 7] = [
            ("no status", json!({}), None),
            ("null status", json!({"status": null}), None),
            ("no conditions", json!({"status": {}}), None),
            (
                "null conditions",
                json!({"status": {"conditions": null}}),
                None,
            ),
            (
                "no Ready among them",
                json!({"status": {"conditions": [{"type": "DiskPressure", "status": "True"}]}}),
                None,
            ),
            (
                "Ready without a time",
                json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}),
                Some("True"),
            ),
            (
                "the first of two Ready",
                json!({"status": {"conditions": [
                    {"type": "Ready", "status": "False"},
                    {"type": "Ready", "status": "True"},
                ]}}),
                Some("False"),
            ),
        ];
        for (name, value, expected) in cases {
            let summary: NodeSummary = serde_json::from_value(value).expect(name);
            assert_eq!(
                summary.ready.as_ref().map(|r| r.status.as_str()),
                expected,
                "{name}"
            );
        }
    }

    #[test]
    fn wrong_types_fail() {
        for (name, value) in [
            (
                "conditions an object",
                json!({"status": {"conditions": {}}}),
            ),
            (
                "condition without a type",
                json!({"status": {"conditions": [{"status": "True"}]}}),
            ),
            (
                "condition without a status",
                json!({"status": {"conditions": [{"type": "Ready"}]}}),
            ),
            ("labels a list", json!({"metadata": {"labels": []}})),
        ] {
            assert!(
                serde_json::from_value::<NodeSummary>(value).is_err(),
                "{name} must not decode"
            );
        }
    }

    #[test]
    fn same_resource_as_a_node() {
        assert_eq!(NodeSummary::url_path(&(), None), Node::url_path(&(), None));
        let summary: NodeSummary = serde_json::from_value(full_node()).expect("decodes");
        let full: Node = serde_json::from_value(full_node()).expect("decodes");
        assert_eq!(summary.object_ref(&()), full.object_ref(&()));
    }
}
