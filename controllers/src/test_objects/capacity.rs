//! CSIStorageCapacity objects as the nodes' capacity publishers write them.

use std::collections::BTreeMap;

use k8s_openapi::api::storage::v1::CSIStorageCapacity;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::ObjectMeta;

use super::{DRIVER, GI, MI};
use crate::well_known::{
    ALIGNMENT_BYTES, DRIVER_LABEL, FREE_EXTENTS, MANAGED_BY_LABEL, MANAGED_BYTES,
    capacity_annotation, capacity_object_name, managed_by, topology_key,
};

/// The alignment every builder here announces.
const ALIGNMENT: u64 = 4 * MI;

/// A capacity object of [`DRIVER`] for `node` and class `c` with `free` bytes, managing 10 GiB
/// in 4 MiB extents.
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
    let mut object = capacity_object(name, DRIVER, node, "c", free);
    let annotations = object
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    if let Some(m) = managed {
        annotations.insert(capacity_annotation(DRIVER, MANAGED_BYTES), m.to_string());
    }
    if let Some(e) = extents {
        annotations.insert(capacity_annotation(DRIVER, FREE_EXTENTS), e.into());
    }
    object
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
) -> CSIStorageCapacity {
    let mut sorted = pools.to_vec();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    let free = sorted.iter().sum::<u64>().to_string();
    let mut object = capacity_object(
        &capacity_object_name(node, class),
        driver,
        node,
        class,
        &free,
    );
    object.metadata.namespace = Some(namespace.into());
    object
        .metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert(MANAGED_BY_LABEL.to_string(), managed_by(node));
    let annotations = object
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    annotations.insert(
        capacity_annotation(driver, MANAGED_BYTES),
        managed.to_string(),
    );
    annotations.insert(
        capacity_annotation(driver, FREE_EXTENTS),
        sorted
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(","),
    );
    object.maximum_volume_size = Some(Quantity(sorted.first().copied().unwrap_or(0).to_string()));
    object
}

/// What every capacity object of `driver` has: its label, the node's topology, the class, the
/// free bytes and the alignment annotation.
fn capacity_object(
    name: &str,
    driver: &str,
    node: &str,
    class: &str,
    free: &str,
) -> CSIStorageCapacity {
    CSIStorageCapacity {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([(
                DRIVER_LABEL.to_string(),
                driver.to_string(),
            )])),
            annotations: Some(BTreeMap::from([(
                capacity_annotation(driver, ALIGNMENT_BYTES),
                ALIGNMENT.to_string(),
            )])),
            ..Default::default()
        },
        storage_class_name: class.into(),
        node_topology: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(topology_key(driver), node.to_string())])),
            ..Default::default()
        }),
        capacity: Some(Quantity(free.into())),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_capacity_sums_and_sorts_the_pools() {
        let c = published_capacity("pmem-csi", DRIVER, "n1", "pmem", &[1, 3, 2], 10);
        assert_eq!(c.capacity, Some(Quantity("6".into())));
        assert_eq!(c.maximum_volume_size, Some(Quantity("3".into())));
        let annotations = c.metadata.annotations.unwrap_or_default();
        assert_eq!(
            annotations.get(&capacity_annotation(DRIVER, FREE_EXTENTS)),
            Some(&"3,2,1".to_string())
        );
        assert_eq!(
            annotations.get(&capacity_annotation(DRIVER, ALIGNMENT_BYTES)),
            Some(&(4u64 << 20).to_string())
        );
        assert_eq!(c.metadata.labels.unwrap_or_default().len(), 2);
    }
}
