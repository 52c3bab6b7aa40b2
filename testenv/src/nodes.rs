//! Simulated nodes: the Node and CSINode objects kubelet and node-driver-registrar would
//! create, since neither runs here.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeCondition, NodeStatus};
use k8s_openapi::api::storage::v1::{CSINode, CSINodeDriver, CSINodeSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;

/// The driver name every simulated node's driver registers under by default.
pub const DEFAULT_DRIVER_NAME: &str = "pmem-csi.intel.com";
/// The node-selector label of nodes meant to run the driver (the manifests' default).
pub const DEFAULT_NODE_SELECTOR: (&str, &str) = ("storage", "pmem");

/// What can go wrong creating node objects.
#[derive(Debug, thiserror::Error)]
pub enum NodesError {
    /// The apiserver refused an object.
    #[error("creating {kind} {name}: {source}")]
    Create {
        /// Object kind.
        kind: &'static str,
        /// Object name.
        name: String,
        /// Why.
        source: kube::Error,
    },
}

/// One simulated node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeSpec {
    /// Node name (`node-1`, …).
    pub name: String,
    /// Whether the driver is meant to run here: the node then carries the node-selector label and
    /// the topology label.
    pub driver: bool,
    /// Whether its CSINode lists the driver (as node-driver-registrar would once it runs).
    pub csinode_driver: bool,
    /// `--emulated-size` of its driver, instead of the [`crate::node_processes::DriverOptions`]'.
    pub size: Option<String>,
}

impl NodeSpec {
    /// A node meant to run the driver.
    pub fn with_driver(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            driver: true,
            csinode_driver: true,
            size: None,
        }
    }

    /// A node whose selector label and CSINode entry are set independently (the states the
    /// liveness judgement distinguishes).
    pub fn custom(name: impl Into<String>, selector_label: bool, csinode_driver: bool) -> Self {
        Self {
            name: name.into(),
            driver: selector_label,
            csinode_driver,
            size: None,
        }
    }

    /// A node without the driver: neither the selector label nor a CSINode driver entry.
    pub fn driverless(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            driver: false,
            csinode_driver: false,
            size: None,
        }
    }

    /// The same node with a PMEM budget (`--emulated-size`) of its own.
    pub fn budget(mut self, size: impl Into<String>) -> Self {
        self.size = Some(size.into());
        self
    }

    /// The Node object, with the status a Ready kubelet would report.
    pub fn node(&self, driver: &str) -> Node {
        let mut labels = BTreeMap::from([
            ("kubernetes.io/hostname".to_string(), self.name.clone()),
            ("kubernetes.io/os".to_string(), "linux".to_string()),
        ]);
        if self.driver {
            labels.insert(
                DEFAULT_NODE_SELECTOR.0.to_string(),
                DEFAULT_NODE_SELECTOR.1.to_string(),
            );
            labels.insert(
                controllers::well_known::topology_key(driver),
                self.name.clone(),
            );
        }
        let resources = BTreeMap::from([
            ("pods".to_string(), Quantity("110".into())),
            ("cpu".to_string(), Quantity("8".into())),
            ("memory".to_string(), Quantity("32Gi".into())),
            ("ephemeral-storage".to_string(), Quantity("100Gi".into())),
        ]);
        Node {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(labels),
                ..Default::default()
            },
            // The node strategy keeps status on create; later changes need the subresource.
            status: Some(NodeStatus {
                capacity: Some(resources.clone()),
                allocatable: Some(resources),
                conditions: Some(vec![NodeCondition {
                    type_: "Ready".into(),
                    status: "True".into(),
                    reason: Some("KubeletReady".into()),
                    message: Some("simulated by testenv".into()),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The CSINode object; it lists the driver only where it runs.
    pub fn csi_node(&self, driver: &str) -> CSINode {
        let drivers = if self.csinode_driver {
            vec![CSINodeDriver {
                name: driver.to_string(),
                node_id: self.name.clone(),
                topology_keys: Some(vec![controllers::well_known::topology_key(driver)]),
                ..Default::default()
            }]
        } else {
            Vec::new()
        };
        CSINode {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                ..Default::default()
            },
            spec: CSINodeSpec { drivers },
        }
    }

    /// Creates the Node and CSINode objects.
    pub async fn create(&self, client: &kube::Client, driver: &str) -> Result<(), NodesError> {
        let pp = PostParams::default();
        Api::<Node>::all(client.clone())
            .create(&pp, &self.node(driver))
            .await
            .map_err(|source| NodesError::Create {
                kind: "Node",
                name: self.name.clone(),
                source,
            })?;
        Api::<CSINode>::all(client.clone())
            .create(&pp, &self.csi_node(driver))
            .await
            .map_err(|source| NodesError::Create {
                kind: "CSINode",
                name: self.name.clone(),
                source,
            })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_nodes_carry_selector_topology_and_csinode_entry() {
        let driver = "pmem-csi.intel.com";
        for (spec, want_labels, want_drivers) in [
            (NodeSpec::with_driver("node-1"), true, 1),
            (NodeSpec::driverless("node-2"), false, 0),
        ] {
            let node = spec.node(driver);
            let labels = node.metadata.labels.clone().unwrap_or_default();
            assert_eq!(
                labels.get("kubernetes.io/hostname"),
                Some(&spec.name),
                "{spec:?}"
            );
            assert_eq!(labels.contains_key("storage"), want_labels, "{spec:?}");
            assert_eq!(
                labels.get(&controllers::well_known::topology_key(DEFAULT_DRIVER_NAME)),
                want_labels.then_some(&spec.name),
                "{spec:?}"
            );
            let status = node.status.unwrap_or_default();
            assert_eq!(
                status.allocatable.unwrap_or_default().get("pods"),
                Some(&Quantity("110".into()))
            );
            assert!(node.spec.is_none_or(|s| s.taints.is_none()), "no taints");
            assert_eq!(spec.csi_node(driver).spec.drivers.len(), want_drivers);
        }
    }
}
