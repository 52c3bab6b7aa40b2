//! The same objects built from their JSON forms, as the pod webhook receives them.

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
