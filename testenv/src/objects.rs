//! Builders and helpers for the Kubernetes objects tests create, in one place instead of a copy
//! per test file.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

use crate::wait::{Timeout, until};

pub use controllers::well_known::SELECTED_NODE;
use controllers::well_known::{
    ALIGNMENT_BYTES, DRIVER_LABEL, FREE_EXTENTS, MANAGED_BY_LABEL, MANAGED_BYTES,
    capacity_annotation, capacity_object_name, managed_by, scheduler_resource, topology_key,
};

/// Creates StorageClass `name` of `provisioner` with `binding_mode` (reclaim policy Delete).
pub async fn create_storage_class(
    client: &kube::Client,
    name: &str,
    provisioner: &str,
    binding_mode: &str,
) -> Result<StorageClass, kube::Error> {
    Api::<StorageClass>::all(client.clone())
        .create(
            &PostParams::default(),
            &storage_class(name, provisioner, binding_mode),
        )
        .await
}

/// A StorageClass of `provisioner` with `binding_mode` and reclaim policy Delete.
pub fn storage_class(name: &str, provisioner: &str, binding_mode: &str) -> StorageClass {
    StorageClass {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        provisioner: provisioner.into(),
        volume_binding_mode: Some(binding_mode.into()),
        reclaim_policy: Some("Delete".into()),
        ..Default::default()
    }
}

/// A ReadWriteOnce claim of `size` in class `class`.
pub fn claim(namespace: &str, name: &str, class: &str, size: &str) -> PersistentVolumeClaim {
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            storage_class_name: Some(class.into()),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([(
                    "storage".to_string(),
                    Quantity(size.into()),
                )])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A 4 MiB PV of CSI driver `driver` with volume handle `handle`, pinned to `node` by the
/// driver's topology key (`<driver>/node`) when given, as the provisioner writes them.
pub fn csi_volume(
    name: &str,
    driver: &str,
    handle: &str,
    node: Option<&str>,
) -> k8s_openapi::api::core::v1::PersistentVolume {
    use k8s_openapi::api::core::v1::{
        CSIPersistentVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
        PersistentVolume, PersistentVolumeSpec, VolumeNodeAffinity,
    };
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(BTreeMap::from([(
                "storage".to_string(),
                Quantity("4Mi".into()),
            )])),
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            csi: Some(CSIPersistentVolumeSource {
                driver: driver.into(),
                volume_handle: handle.into(),
                ..Default::default()
            }),
            node_affinity: node.map(|node| VolumeNodeAffinity {
                required: Some(NodeSelector {
                    node_selector_terms: vec![NodeSelectorTerm {
                        match_expressions: Some(vec![NodeSelectorRequirement {
                            key: topology_key(driver),
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

/// `claim` as if the scheduler had selected `node` for it.
pub fn selected_for(mut claim: PersistentVolumeClaim, node: &str) -> PersistentVolumeClaim {
    claim
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(SELECTED_NODE.into(), node.into());
    claim
}

/// A one-container pod mounting claim `claim` (no kubelet runs it: it is only scheduled).
pub fn pod_with_claim(namespace: &str, name: &str, claim: &str) -> k8s_openapi::api::core::v1::Pod {
    use k8s_openapi::api::core::v1::{
        Container, PersistentVolumeClaimVolumeSource, Pod, PodSpec, Volume,
    };
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
            volumes: Some(vec![Volume {
                name: "data".into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.into(),
                    read_only: None,
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The selected node of claim `name`, if any (and if the claim exists).
pub async fn selected_node(api: &Api<PersistentVolumeClaim>, name: &str) -> Option<String> {
    api.get(name)
        .await
        .ok()?
        .metadata
        .annotations?
        .get(SELECTED_NODE)
        .cloned()
}

/// `pod` as the pod webhook leaves it: `<driver>/scheduler: 1` in requests and limits of its
/// first container, which makes kube-scheduler call the extender for it.
pub fn with_scheduler_resource(
    mut pod: k8s_openapi::api::core::v1::Pod,
    driver: &str,
) -> k8s_openapi::api::core::v1::Pod {
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

/// A one-container pod with one CSI inline volume of `driver` of `size` (a quantity).
pub fn pod_with_inline_volume(
    namespace: &str,
    name: &str,
    driver: &str,
    size: &str,
) -> k8s_openapi::api::core::v1::Pod {
    use k8s_openapi::api::core::v1::{CSIVolumeSource, Volume};
    let mut pod = pod_with_claim(namespace, name, "unused");
    if let Some(spec) = pod.spec.as_mut() {
        spec.volumes = Some(vec![Volume {
            name: "scratch".into(),
            csi: Some(CSIVolumeSource {
                driver: driver.into(),
                volume_attributes: Some(BTreeMap::from([("size".to_string(), size.to_string())])),
                ..Default::default()
            }),
            ..Default::default()
        }]);
    }
    pod
}

/// A CSIStorageCapacity of `driver` for `node` and `class` as the node's capacity publisher
/// writes it: `capacity` = the sum of the pools' free bytes, `maximumVolumeSize` = the largest,
/// and the `managed-bytes`, `alignment-bytes` (4 MiB) and `free-extents` annotations.
pub fn published_capacity(
    namespace: &str,
    driver: &str,
    node: &str,
    class: &str,
    pools: &[u64],
    managed: u64,
) -> k8s_openapi::api::storage::v1::CSIStorageCapacity {
    use k8s_openapi::api::storage::v1::CSIStorageCapacity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    let mut sorted = pools.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    CSIStorageCapacity {
        metadata: ObjectMeta {
            name: Some(capacity_object_name(node, class)),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([
                (DRIVER_LABEL.to_string(), driver.to_string()),
                (MANAGED_BY_LABEL.to_string(), managed_by(node)),
            ])),
            annotations: Some(BTreeMap::from([
                (
                    capacity_annotation(driver, MANAGED_BYTES),
                    managed.to_string(),
                ),
                (
                    capacity_annotation(driver, ALIGNMENT_BYTES),
                    (4u64 << 20).to_string(),
                ),
                (
                    capacity_annotation(driver, FREE_EXTENTS),
                    sorted
                        .iter()
                        .map(u64::to_string)
                        .collect::<Vec<_>>()
                        .join(","),
                ),
            ])),
            ..Default::default()
        },
        storage_class_name: class.into(),
        node_topology: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(topology_key(driver), node.to_string())])),
            ..Default::default()
        }),
        capacity: Some(Quantity(sorted.iter().sum::<u64>().to_string())),
        maximum_volume_size: Some(Quantity(sorted.first().copied().unwrap_or(0).to_string())),
    }
}

/// Creates or replaces `object` (server-side apply by "testenv").
pub async fn apply<K>(api: &Api<K>, object: &K) -> Result<K, kube::Error>
where
    K: Resource + Clone + DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let name = object.meta().name.clone().unwrap_or_default();
    api.patch(
        &name,
        &kube::api::PatchParams::apply("testenv").force(),
        &kube::api::Patch::Apply(object),
    )
    .await
}

/// The Events in `namespace` that match field selector `fields` (such as
/// `reason=Rescheduled`).
pub async fn events(
    client: &kube::Client,
    namespace: &str,
    fields: &str,
) -> Result<Vec<k8s_openapi::api::core::v1::Event>, kube::Error> {
    let list = Api::namespaced(client.clone(), namespace)
        .list(&kube::api::ListParams::default().fields(fields))
        .await?;
    Ok(list.items)
}

/// The messages of the `FailedScheduling` Events of pod `name`, newest last.
pub async fn failed_scheduling(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Result<Vec<String>, kube::Error> {
    let events = events(
        client,
        namespace,
        &format!("involvedObject.name={name},reason=FailedScheduling"),
    )
    .await?;
    Ok(events.into_iter().filter_map(|e| e.message).collect())
}

/// The manifests' MutatingWebhookConfiguration as testenv can use it: its webhook (rules,
/// opt-out selectors, side effects, timeout) once per `(name, url)` — one per replica, since
/// replicas on 127.0.0.1 have ports of their own and no Service routes to them — with a URL
/// instead of the Service, and `failure_policy` when given (tests use `Fail` to count failed
/// calls; `None` keeps the manifests').
pub fn pod_webhook_configuration(
    rendered: &crate::manifests::Rendered,
    webhooks: &[(&str, String)],
    failure_policy: Option<&str>,
) -> Result<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration, String> {
    use k8s_openapi::api::admissionregistration::v1::{
        MutatingWebhookConfiguration, WebhookClientConfig,
    };
    let object = rendered
        .of_kinds(&["MutatingWebhookConfiguration"])
        .next()
        .ok_or("the manifests have no MutatingWebhookConfiguration")?;
    let mut configuration: MutatingWebhookConfiguration =
        serde_yaml::from_value(object.clone()).map_err(|e| e.to_string())?;
    let template = configuration
        .webhooks
        .as_ref()
        .and_then(|w| w.first())
        .cloned()
        .ok_or("the MutatingWebhookConfiguration has no webhook")?;
    configuration.webhooks = Some(
        webhooks
            .iter()
            .map(|(name, url)| {
                let mut webhook = template.clone();
                webhook.name = (*name).into();
                webhook.client_config = WebhookClientConfig {
                    url: Some(url.clone()),
                    ..Default::default()
                };
                if let Some(policy) = failure_policy {
                    webhook.failure_policy = Some(policy.into());
                }
                webhook
            })
            .collect(),
    );
    Ok(configuration)
}

/// Waits until object `name` no longer exists.
pub async fn wait_gone<K>(api: &Api<K>, name: &str, timeout: Duration) -> Result<(), Timeout>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    until(&format!("{name} to be gone"), timeout, || async {
        match api.get_opt(name).await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(_) => Err("still there".to_string()),
        }
    })
    .await
}

/// The text of `http://127.0.0.1:<port>/metrics` (empty if unreachable).
pub async fn scrape_metrics(port: u16) -> String {
    let Ok(client) =
        crate::control_plane::anonymous_probe(&format!("http://127.0.0.1:{port}"), "metrics")
    else {
        return String::new();
    };
    let Ok(request) = http::Request::get("/metrics").body(Vec::new()) else {
        return String::new();
    };
    client.request_text(request).await.unwrap_or_default()
}

/// `(count, sum)` of the node driver's CreateVolume calls that ended with gRPC status
/// `status` (`"OK"`, `"ResourceExhausted"`, …), from its `/metrics` text.
pub fn create_volume_calls(text: &str, status: &str) -> (u64, f64) {
    let code = format!("grpc_status_code=\"{status}\"");
    let pick = |suffix: &str| {
        let name = format!("csi_plugin_operations_seconds_{suffix}{{");
        text.lines()
            .filter(|l| l.starts_with(&name) && l.contains("CreateVolume") && l.contains(&code))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            // Not sum(): an empty f64 sum is -0.0, printed as "-0.0000".
            .fold(0.0, |total, v| total + v)
    };
    (pick("count") as u64, pick("sum"))
}

/// The sum of the samples whose line starts with `prefix` (a metric name with labels).
pub fn metric_value(text: &str, prefix: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_builders() {
        let c = selected_for(claim("ns", "data", "pmem", "1Gi"), "node-1");
        assert_eq!(
            c.metadata
                .annotations
                .unwrap_or_default()
                .get(SELECTED_NODE)
                .map(String::as_str),
            Some("node-1")
        );
        assert_eq!(
            c.spec.and_then(|s| s.storage_class_name).as_deref(),
            Some("pmem")
        );
    }

    #[test]
    fn create_volume_calls_by_status() {
        let text = "\
csi_plugin_operations_seconds_sum{driver_name=\"d\",method_name=\"/csi.v1.Controller/CreateVolume\",grpc_status_code=\"OK\"} 0.5
csi_plugin_operations_seconds_count{driver_name=\"d\",method_name=\"/csi.v1.Controller/CreateVolume\",grpc_status_code=\"OK\"} 2
csi_plugin_operations_seconds_count{driver_name=\"d\",method_name=\"/csi.v1.Controller/CreateVolume\",grpc_status_code=\"ResourceExhausted\"} 7
csi_plugin_operations_seconds_count{driver_name=\"d\",method_name=\"/csi.v1.Node/NodeStageVolume\",grpc_status_code=\"OK\"} 3
";
        assert_eq!(create_volume_calls(text, "OK"), (2, 0.5));
        assert_eq!(create_volume_calls(text, "ResourceExhausted").0, 7);
        let (none, sum) = create_volume_calls(text, "Internal");
        assert_eq!(none, 0);
        assert!(sum.is_sign_positive(), "0.0, not -0.0");
    }

    #[test]
    fn metric_value_sums_matching_lines() {
        let text = "a_total{x=\"1\"} 2\na_total{x=\"2\"} 3\nb_total 7\n";
        assert_eq!(metric_value(text, "a_total"), 5);
        assert_eq!(metric_value(text, "b_total"), 7);
        assert_eq!(metric_value(text, "c_total"), 0);
    }
}
