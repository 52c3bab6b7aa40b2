//! Builders of the Kubernetes objects the unit tests of the index and the placement feed in.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, CSIVolumeSource, NodeSelector, NodeSelectorRequirement,
    NodeSelectorTerm, ObjectReference, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource, PersistentVolumeSpec, Pod,
    PodSpec, PodStatus, Volume, VolumeNodeAffinity, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::{CSIStorageCapacity, StorageClass};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::ObjectMeta;

use crate::well_known::{DRIVER_LABEL, SELECTED_NODE};

/// The driver every builder names.
pub const DRIVER: &str = "pmem-csi.intel.com";
/// 1 GiB.
pub const GI: u64 = 1 << 30;
/// 1 MiB.
pub const MI: u64 = 1 << 20;
/// The namespace of claims and pods.
pub const NAMESPACE: &str = "ns";

/// A StorageClass.
pub fn class(name: &str, provisioner: &str, mode: &str) -> StorageClass {
    StorageClass {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        provisioner: provisioner.into(),
        volume_binding_mode: Some(mode.into()),
        ..Default::default()
    }
}

/// A 1 GiB claim in [`NAMESPACE`], selected to `node` and bound to `volume` when given.
pub fn claim(
    name: &str,
    class: &str,
    node: Option<&str>,
    volume: Option<&str>,
) -> PersistentVolumeClaim {
    sized_claim(name, class, "1Gi", node, volume)
}

/// [`claim`] requesting `size`.
pub fn sized_claim(
    name: &str,
    class: &str,
    size: &str,
    node: Option<&str>,
    volume: Option<&str>,
) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            namespace: Some(NAMESPACE.into()),
            name: Some(name.into()),
            annotations: node.map(|n| [(SELECTED_NODE.to_string(), n.to_string())].into()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            storage_class_name: Some(class.into()),
            volume_name: volume.map(Into::into),
            resources: Some(VolumeResourceRequirements {
                requests: Some([("storage".to_string(), Quantity(size.into()))].into()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A PV of [`DRIVER`] on `node`, bound to claim `claim` of [`NAMESPACE`] when given.
pub fn volume(name: &str, node: &str, size: &str, claim: Option<&str>) -> PersistentVolume {
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some([("storage".to_string(), Quantity(size.into()))].into()),
            csi: Some(CSIPersistentVolumeSource {
                driver: DRIVER.into(),
                volume_handle: name.into(),
                ..Default::default()
            }),
            claim_ref: claim.map(|c| ObjectReference {
                namespace: Some(NAMESPACE.into()),
                name: Some(c.into()),
                ..Default::default()
            }),
            node_affinity: Some(VolumeNodeAffinity {
                required: Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_expressions: Some(vec![NodeSelectorRequirement {
                            key: crate::well_known::topology_key(DRIVER),
                            operator: "In".into(),
                            values: Some(vec![node.into()]),
                        }]),
                        ..Default::default()
                    }],
                }),
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A pod with a 2 GiB inline volume of [`DRIVER`] and one of another driver.
pub fn inline_pod(uid: &str, node: Option<&str>, phase: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            uid: Some(uid.into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: node.map(Into::into),
            volumes: Some(vec![
                Volume {
                    name: "mine".into(),
                    csi: Some(CSIVolumeSource {
                        driver: DRIVER.into(),
                        volume_attributes: Some([("size".to_string(), "2Gi".to_string())].into()),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                Volume {
                    name: "other".into(),
                    csi: Some(CSIVolumeSource {
                        driver: "other.example.com".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            ]),
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some(phase.into()),
            ..Default::default()
        }),
    }
}

/// A pending pod `name` (uid `uid-<name>`) in [`NAMESPACE`] using claim `name`.
pub fn claim_pod(name: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            namespace: Some(NAMESPACE.into()),
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            ..Default::default()
        },
        spec: Some(PodSpec {
            volumes: Some(vec![Volume {
                name: "data".into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: name.into(),
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A capacity object of `node` with `free` bytes, managing 10 GiB in 4 MiB extents.
pub fn capacity(name: &str, node: &str, free: &str, extents: Option<&str>) -> CSIStorageCapacity {
    managed_capacity(name, node, free, extents, Some(10 * GI))
}

/// [`capacity`] managing `managed` bytes (`None`: no `managed-bytes` annotation).
pub fn managed_capacity(
    name: &str,
    node: &str,
    free: &str,
    extents: Option<&str>,
    managed: Option<u64>,
) -> CSIStorageCapacity {
    let mut annotations =
        BTreeMap::from([(format!("{DRIVER}/alignment-bytes"), (4 * MI).to_string())]);
    if let Some(m) = managed {
        annotations.insert(format!("{DRIVER}/managed-bytes"), m.to_string());
    }
    if let Some(e) = extents {
        annotations.insert(format!("{DRIVER}/free-extents"), e.into());
    }
    CSIStorageCapacity {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some([(DRIVER_LABEL.to_string(), DRIVER.to_string())].into()),
            annotations: Some(annotations),
            ..Default::default()
        },
        storage_class_name: "c".into(),
        node_topology: Some(LabelSelector {
            match_labels: Some(
                [(crate::well_known::topology_key(DRIVER), node.to_string())].into(),
            ),
            ..Default::default()
        }),
        capacity: Some(Quantity(free.into())),
        ..Default::default()
    }
}

/// The same objects built from their JSON forms, as the pod webhook receives them.
pub mod json {
    use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
    use serde_json::{Value, json};

    pub use super::DRIVER;

    /// A pod with one container and the given volumes (as JSON).
    pub fn pod(volumes: Vec<Value>) -> Pod {
        pod_json(json!({
            "metadata": {"name": "app", "namespace": "ns", "uid": "uid-1"},
            "spec": {"containers": [{"name": "c", "image": "busybox"}], "volumes": volumes},
        }))
    }

    /// A pod from its JSON form.
    pub fn pod_json(value: Value) -> Pod {
        serde_json::from_value(value).expect("test pod decodes")
    }

    /// A pod volume naming claim `claim`.
    pub fn pvc_volume(name: &str, claim: &str) -> Value {
        json!({"name": name, "persistentVolumeClaim": {"claimName": claim}})
    }

    /// A CSI inline volume of `driver`, sized by its `size` attribute when given.
    pub fn inline_volume(name: &str, driver: &str, size: Option<&str>) -> Value {
        let mut csi = json!({"driver": driver});
        if let Some(size) = size {
            csi["volumeAttributes"] = json!({"size": size});
        }
        json!({"name": name, "csi": csi})
    }

    /// A generic ephemeral volume whose claim template names `class` and requests `size`.
    pub fn ephemeral_volume(name: &str, class: Option<&str>, size: Option<&str>) -> Value {
        let mut spec = json!({"accessModes": ["ReadWriteOnce"]});
        if let Some(class) = class {
            spec["storageClassName"] = json!(class);
        }
        if let Some(size) = size {
            spec["resources"] = json!({"requests": {"storage": size}});
        }
        json!({"name": name, "ephemeral": {"volumeClaimTemplate": {"spec": spec}}})
    }

    /// A claim in namespace `ns`.
    pub fn claim(
        name: &str,
        class: Option<&str>,
        volume_name: Option<&str>,
        annotation: Option<&str>,
        size: Option<&str>,
    ) -> PersistentVolumeClaim {
        let mut value = json!({"metadata": {"name": name, "namespace": "ns"}, "spec": {}});
        if let Some(class) = class {
            value["spec"]["storageClassName"] = json!(class);
        }
        if let Some(volume) = volume_name {
            value["spec"]["volumeName"] = json!(volume);
        }
        if let Some(provisioner) = annotation {
            value["metadata"]["annotations"] =
                json!({crate::well_known::STORAGE_PROVISIONER: provisioner});
        }
        if let Some(size) = size {
            value["spec"]["resources"] = json!({"requests": {"storage": size}});
        }
        serde_json::from_value(value).expect("test claim decodes")
    }
}
