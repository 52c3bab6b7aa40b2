//! Pods and their volumes.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIVolumeSource, Container, EphemeralVolumeSource, PersistentVolumeClaimTemplate,
    PersistentVolumeClaimVolumeSource, Pod, PodSpec, PodStatus, Volume, VolumeDevice, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::ObjectMeta;

use super::storage::claim_spec;
use super::{DRIVER, NAMESPACE};
use crate::well_known::scheduler_resource;

/// A one-container pod (`app`) with `volumes`, which its container neither mounts nor could
/// pull the image of: enough for the API server, the webhook, the scheduler and testenv's
/// simulated kubelet ([`runnable`] makes one a real kubelet runs).
pub fn pod(namespace: &str, name: &str, volumes: Vec<Volume>) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "app".into(),
                image: Some("registry.invalid/app".into()),
                ..Default::default()
            }],
            volumes: (!volumes.is_empty()).then_some(volumes),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A [`pod`] mounting claim `claim` as volume `data`.
pub fn pod_with_claim(namespace: &str, name: &str, claim: &str) -> Pod {
    pod(namespace, name, vec![claim_volume("data", claim)])
}

/// A [`pod`] with one CSI inline volume `scratch` of `driver` of `size` (a quantity).
pub fn pod_with_inline_volume(namespace: &str, name: &str, driver: &str, size: &str) -> Pod {
    pod(
        namespace,
        name,
        vec![inline_volume("scratch", driver, Some(size), None)],
    )
}

/// A pending [`pod_with_claim`] `name` (uid `uid-<name>`) in [`NAMESPACE`] using claim `name`:
/// the unit tests' shorthand.
pub fn claim_pod(name: &str) -> Pod {
    let mut pod = pod_with_claim(NAMESPACE, name, name);
    pod.metadata.uid = Some(format!("uid-{name}"));
    pod
}

/// A pod with a 2 GiB inline volume of [`DRIVER`] and one of another driver, on `node` when
/// given, in `phase`.
pub fn inline_pod(uid: &str, node: Option<&str>, phase: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            uid: Some(uid.into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: node.map(Into::into),
            volumes: Some(vec![
                inline_volume("mine", DRIVER, Some("2Gi"), None),
                inline_volume("other", "other.example.com", None, None),
            ]),
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some(phase.into()),
            ..Default::default()
        }),
    }
}

/// `pod` as a real kubelet runs it: its container runs `image` sleeping, mounts each volume at
/// `/data<i>` (maps those named in `block` at `/dev/block<i>`), and the pod stops within a
/// second.
pub fn runnable(mut pod: Pod, image: &str, block: &[&str]) -> Pod {
    let Some(spec) = pod.spec.as_mut() else {
        return pod;
    };
    let volumes = spec.volumes.as_deref().unwrap_or_default();
    let is_block = |v: &Volume| block.contains(&v.name.as_str());
    let mounts: Vec<VolumeMount> = volumes
        .iter()
        .enumerate()
        .filter(|(_, v)| !is_block(v))
        .map(|(i, v)| VolumeMount {
            name: v.name.clone(),
            mount_path: format!("/data{i}"),
            ..Default::default()
        })
        .collect();
    let devices: Vec<VolumeDevice> = volumes
        .iter()
        .enumerate()
        .filter(|(_, v)| is_block(v))
        .map(|(i, v)| VolumeDevice {
            name: v.name.clone(),
            device_path: format!("/dev/block{i}"),
        })
        .collect();
    if let Some(container) = spec.containers.first_mut() {
        container.image = Some(image.into());
        container.command = Some(vec!["sleep".into(), "1000000".into()]);
        container.volume_mounts = (!mounts.is_empty()).then_some(mounts);
        container.volume_devices = (!devices.is_empty()).then_some(devices);
    }
    spec.termination_grace_period_seconds = Some(1);
    pod
}

/// `pod` whose container runs the shell `script` first and then sleeps; a script that fails
/// ends the container, so the pod never becomes Ready with the output of a failed script.
pub fn with_script(mut pod: Pod, script: &str) -> Pod {
    if let Some(container) = pod.spec.as_mut().and_then(|s| s.containers.first_mut()) {
        container.command = Some(vec![
            "sh".into(),
            "-c".into(),
            format!("{script} && exec sleep 1000000"),
        ]);
    }
    pod
}

/// `pod` as the pod webhook leaves it: `<driver>/scheduler: 1` in requests and limits of its
/// first container, which makes kube-scheduler call the extender for it.
pub fn with_scheduler_resource(mut pod: Pod, driver: &str) -> Pod {
    let resource = scheduler_resource(driver);
    if let Some(container) = pod.spec.as_mut().and_then(|s| s.containers.first_mut()) {
        let resources = container.resources.get_or_insert_with(Default::default);
        for map in [&mut resources.requests, &mut resources.limits] {
            map.get_or_insert_with(Default::default)
                .insert(resource.clone(), Quantity("1".into()));
        }
    }
    pod
}

/// A pod volume using claim `claim`.
pub fn claim_volume(name: &str, claim: &str) -> Volume {
    Volume {
        name: name.into(),
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: claim.into(),
            read_only: None,
        }),
        ..Default::default()
    }
}

/// A CSI inline volume of `driver`, with its `size` attribute and `fs_type` when given.
pub fn inline_volume(
    name: &str,
    driver: &str,
    size: Option<&str>,
    fs_type: Option<&str>,
) -> Volume {
    Volume {
        name: name.into(),
        csi: Some(CSIVolumeSource {
            driver: driver.into(),
            fs_type: fs_type.map(Into::into),
            volume_attributes: size
                .map(|size| BTreeMap::from([("size".to_string(), size.to_string())])),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A generic ephemeral volume whose claim template is a [`super::claim`] of `class` and `size`.
pub fn generic_ephemeral_volume(name: &str, class: &str, size: &str) -> Volume {
    Volume {
        name: name.into(),
        ephemeral: Some(EphemeralVolumeSource {
            volume_claim_template: Some(PersistentVolumeClaimTemplate {
                metadata: None,
                spec: claim_spec(class, size),
            }),
        }),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_run_before_sleeping() {
        let p = with_script(
            runnable(pod("ns", "app", vec![]), "img", &[]),
            "cat /data0/x",
        );
        let command = p.spec.expect("spec").containers[0]
            .command
            .clone()
            .expect("command");
        assert_eq!(command, ["sh", "-c", "cat /data0/x && exec sleep 1000000"]);
    }

    #[test]
    fn runnable_pods_mount_and_map_devices() {
        let p = runnable(
            pod(
                "ns",
                "app",
                vec![claim_volume("data", "c"), claim_volume("dev", "d")],
            ),
            "img",
            &["dev"],
        );
        let spec = p.spec.as_ref().expect("spec");
        assert_eq!(spec.termination_grace_period_seconds, Some(1));
        let c = &spec.containers[0];
        assert_eq!(c.image.as_deref(), Some("img"));
        let mounts = c.volume_mounts.clone().unwrap_or_default();
        let devices = c.volume_devices.clone().unwrap_or_default();
        assert_eq!(mounts.len(), 1);
        assert_eq!(mounts[0].name, "data");
        assert_eq!(mounts[0].mount_path, "/data0");
        assert_eq!(devices.len(), 1);
        assert_eq!(devices[0].name, "dev");
        assert_eq!(devices[0].device_path, "/dev/block1");
    }

    #[test]
    fn pods_without_volumes_have_none() {
        let p = runnable(pod("ns", "app", vec![]), "img", &[]);
        let spec = p.spec.expect("spec");
        assert_eq!(spec.volumes, None);
        assert_eq!(spec.containers[0].volume_mounts, None);
        assert_eq!(spec.containers[0].volume_devices, None);
    }
}
