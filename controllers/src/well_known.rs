//! The names pmem-csi shares with Kubernetes, external-provisioner and its own components:
//! annotations, labels, and the object names derived from the driver and node names. Every one
//! is defined here once; concerns import them from here, never from each other.

use crate::names::shorten;

/// The annotation kube-scheduler sets on a late-binding claim once it chose a node, and the
/// rescheduler removes.
pub const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
/// The annotation kube-controller-manager sets on a claim to its class's provisioner.
pub const STORAGE_PROVISIONER: &str = "volume.kubernetes.io/storage-provisioner";
/// The pre-1.23 spelling of [`STORAGE_PROVISIONER`], still set by kube-controller-manager.
pub const BETA_STORAGE_PROVISIONER: &str = "volume.beta.kubernetes.io/storage-provisioner";
/// The annotation that marks a StorageClass as the cluster default.
pub const DEFAULT_CLASS: &str = "storageclass.kubernetes.io/is-default-class";
/// Its beta predecessor, still honoured by the DefaultStorageClass admission plugin.
pub const BETA_DEFAULT_CLASS: &str = "storageclass.beta.kubernetes.io/is-default-class";
/// The binding mode that provisions before a pod is scheduled (also a class's default).
pub const IMMEDIATE: &str = "Immediate";
/// The volume attribute that sizes a CSI inline volume.
pub const INLINE_SIZE: &str = "size";
/// Label naming the driver on CSIStorageCapacity objects (external-provisioner's key).
pub const DRIVER_LABEL: &str = "csi.storage.k8s.io/drivername";
/// Label naming the publisher of a CSIStorageCapacity object (external-provisioner's key, our
/// value: [`managed_by`]).
pub const MANAGED_BY_LABEL: &str = "csi.storage.k8s.io/managed-by";
/// The label that opts a pod (or, through the webhook configuration, a namespace) out of the
/// pod webhook, with value `ignore`. PMEM-CSI 1.0's name, whatever the driver is called.
pub const WEBHOOK_OPT_OUT_LABEL: &str = "pmem-csi.intel.com/webhook";
/// The annotation that opts a claim (or, on its StorageClass, every claim of the class) into
/// node-loss recovery: with `"true"`, once the claim's node is lost for the controller's
/// `--node-loss-grace`, the claim, its volume and the lost node's pods using it are deleted so
/// that the workload's controller recreates them elsewhere with a new, empty volume. `"false"`
/// on a claim opts it out of its class's opt-in. PMEM-CSI 1.0 had no such recovery; the prefix
/// is its, whatever the driver is called, as for [`WEBHOOK_OPT_OUT_LABEL`].
pub const RECREATE_ON_NODE_LOSS: &str = "pmem-csi.intel.com/recreate-on-node-loss";
/// The finalizer external-provisioner puts on the PVs it provisions and removes once the
/// volume is deleted (its `finalizerPVProtection`, from 3.x on); on a node that is gone nobody
/// ever removes it.
pub const PROVISIONER_FINALIZER: &str = "external-provisioner.volume.kubernetes.io/finalizer";
/// A capacity annotation: bytes the driver manages on the node.
pub const MANAGED_BYTES: &str = "managed-bytes";
/// A capacity annotation: volume sizes are multiples of this.
pub const ALIGNMENT_BYTES: &str = "alignment-bytes";
/// A capacity annotation: free bytes per pool, largest first, comma-separated.
pub const FREE_EXTENTS: &str = "free-extents";
/// A capacity annotation: the page metadata each volume keeps beside its data (direct mode).
pub const VOLUME_OVERHEAD: &str = "volume-overhead";

/// The topology key of the driver's volumes and nodes: `<driver>/node`, whose value is the node
/// name (PV node affinity, CSIStorageCapacity `nodeTopology`, the node label).
pub fn topology_key(driver: &str) -> String {
    format!("{driver}/node")
}

/// A capacity annotation's key: `<driver>/<name>` for one of [`MANAGED_BYTES`],
/// [`ALIGNMENT_BYTES`], [`FREE_EXTENTS`], [`VOLUME_OVERHEAD`].
pub fn capacity_annotation(driver: &str, name: &str) -> String {
    format!("{driver}/{name}")
}

/// The extended resource the webhook adds to a pod so that it goes through the extender:
/// `<driver>/scheduler`.
pub fn scheduler_resource(driver: &str) -> String {
    format!("{driver}/scheduler")
}

/// The prefix of the driver's object names: the driver name with dots as dashes
/// (`pmem-csi-intel-com`), as PMEM-CSI 1.0 names its objects.
pub fn name_prefix(driver: &str) -> String {
    driver.replace('.', "-")
}

/// The heartbeat Lease of `node`'s driver: `<prefix>-node-<node>`, hash-shortened past 63.
pub fn heartbeat_lease_name(driver: &str, node: &str) -> String {
    shorten(&format!("{}-node-{node}", name_prefix(driver)), 63)
}

/// The leader-election Lease of `concern`: `<prefix>-<concern>`, hash-shortened past 63.
pub fn leader_lease_name(driver: &str, concern: &str) -> String {
    shorten(&format!("{}-{concern}", name_prefix(driver)), 63)
}

/// The `managed-by` label value of `node`'s capacity objects: never external-provisioner's
/// `external-provisioner-<node>`, so the two can never fight over objects.
pub fn managed_by(node: &str) -> String {
    shorten(&format!("pmem-csi-{node}"), 63)
}

/// The name of `node`'s capacity object for `class`.
pub fn capacity_object_name(node: &str, class: &str) -> String {
    shorten(&format!("pmem-csi-{node}-{class}"), 253)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_names() {
        let driver = "pmem-csi.intel.com";
        assert_eq!(topology_key(driver), "pmem-csi.intel.com/node");
        assert_eq!(scheduler_resource(driver), "pmem-csi.intel.com/scheduler");
        assert_eq!(
            capacity_annotation(driver, FREE_EXTENTS),
            "pmem-csi.intel.com/free-extents"
        );
        assert_eq!(name_prefix(driver), "pmem-csi-intel-com");
        assert_eq!(
            heartbeat_lease_name(driver, "n1"),
            "pmem-csi-intel-com-node-n1"
        );
        assert_eq!(
            leader_lease_name(driver, "rescheduler"),
            "pmem-csi-intel-com-rescheduler"
        );
        assert_eq!(managed_by("n1"), "pmem-csi-n1");
        assert_eq!(capacity_object_name("n1", "sc"), "pmem-csi-n1-sc");
    }

    #[test]
    fn long_names_stay_within_limits() {
        let node = "n".repeat(300);
        assert!(heartbeat_lease_name("pmem-csi.intel.com", &node).len() <= 63);
        assert!(leader_lease_name(&"d".repeat(80), "rescheduler").len() <= 63);
        assert!(managed_by(&node).len() <= 63);
        assert!(capacity_object_name(&node, "sc").len() <= 253);
        assert_ne!(
            managed_by(&format!("{node}a")),
            managed_by(&format!("{node}b"))
        );
    }
}
