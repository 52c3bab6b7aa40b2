//! StorageClasses, claims and PVs.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
    ObjectReference, PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeSpec, VolumeNodeAffinity, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::ObjectMeta;

use super::{DRIVER, NAMESPACE};
use crate::well_known::{SELECTED_NODE, topology_key};

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
        spec: Some(claim_spec(class, size)),
        ..Default::default()
    }
}

/// The spec of [`claim`], which generic ephemeral volumes use as their template too.
pub(super) fn claim_spec(class: &str, size: &str) -> PersistentVolumeClaimSpec {
    PersistentVolumeClaimSpec {
        access_modes: Some(vec!["ReadWriteOnce".into()]),
        storage_class_name: Some(class.into()),
        resources: Some(VolumeResourceRequirements {
            requests: Some(storage(size)),
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

/// `claim` bound to PV `volume`.
pub fn bound_to(mut claim: PersistentVolumeClaim, volume: &str) -> PersistentVolumeClaim {
    claim.spec.get_or_insert_with(Default::default).volume_name = Some(volume.into());
    claim
}

/// A claim of `size` in [`NAMESPACE`], selected for `node` and bound to `volume` when given:
/// [`claim`], [`selected_for`] and [`bound_to`] in one call, for the unit tests' tables.
pub fn sized_claim(
    name: &str,
    class: &str,
    size: &str,
    node: Option<&str>,
    volume: Option<&str>,
) -> PersistentVolumeClaim {
    let mut claim = claim(NAMESPACE, name, class, size);
    if let Some(node) = node {
        claim = selected_for(claim, node);
    }
    if let Some(volume) = volume {
        claim = bound_to(claim, volume);
    }
    claim
}

/// A 4 MiB ReadWriteOnce PV of CSI driver `driver` with volume handle `handle`, pinned to
/// `node` by the driver's topology key (`<driver>/node`) when given, as the provisioner writes
/// them.
pub fn csi_volume(name: &str, driver: &str, handle: &str, node: Option<&str>) -> PersistentVolume {
    PersistentVolume {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(storage("4Mi")),
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

/// A [`csi_volume`] of [`DRIVER`] with handle `name` and `size`, on `node`, bound to claim
/// `claim` of [`NAMESPACE`] when given: the unit tests' shorthand.
pub fn volume(name: &str, node: &str, size: &str, claim: Option<&str>) -> PersistentVolume {
    let mut pv = csi_volume(name, DRIVER, name, Some(node));
    let spec = pv.spec.get_or_insert_with(Default::default);
    spec.capacity = Some(storage(size));
    spec.claim_ref = claim.map(|c| ObjectReference {
        namespace: Some(NAMESPACE.into()),
        name: Some(c.into()),
        ..Default::default()
    });
    pv
}

/// `{storage: size}`, as claims request and PVs offer it.
fn storage(size: &str) -> BTreeMap<String, Quantity> {
    BTreeMap::from([("storage".to_string(), Quantity(size.into()))])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_modifiers() {
        let c = bound_to(
            selected_for(claim("ns", "data", "pmem", "1Gi"), "node-1"),
            "pv-1",
        );
        assert_eq!(
            c.metadata
                .annotations
                .unwrap_or_default()
                .get(SELECTED_NODE)
                .map(String::as_str),
            Some("node-1")
        );
        let spec = c.spec.unwrap_or_default();
        assert_eq!(spec.storage_class_name.as_deref(), Some("pmem"));
        assert_eq!(spec.volume_name.as_deref(), Some("pv-1"));
    }

    #[test]
    fn unit_shorthands_are_the_general_builders() {
        assert_eq!(
            sized_claim("a", "late", "2Gi", Some("n1"), Some("pv-a")),
            bound_to(
                selected_for(claim(NAMESPACE, "a", "late", "2Gi"), "n1"),
                "pv-a"
            )
        );
        assert_eq!(
            sized_claim("a", "late", "2Gi", None, None),
            claim(NAMESPACE, "a", "late", "2Gi")
        );
        let pv = volume("pv-a", "n1", "2Gi", Some("a"));
        let spec = pv.spec.as_ref().expect("spec");
        assert_eq!(spec.capacity, Some(storage("2Gi")));
        assert_eq!(
            spec.claim_ref.as_ref().and_then(|r| r.name.as_deref()),
            Some("a")
        );
        assert_eq!(
            crate::volume_facts::pv_node(&pv, DRIVER).as_deref(),
            Some("n1")
        );
    }
}
