//! Watch-fed caches shared by every concern of a process: one watch per kind, managedFields
//! stripped (they are most of an object's bytes and nobody here reads them).

use std::fmt::Debug;
use std::hash::Hash;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, ReflectHandle, Store};
use kube::runtime::watcher;
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio::task::JoinSet;

use crate::claim_summary::ClaimSummary;
use crate::node_summary::NodeSummary;

/// Events a subscriber may lag behind before the shared watch waits for it.
const SUBSCRIBER_BUFFER: usize = 4096;

/// Trims what a cache keeps of each object to what the concerns read: managedFields always; a
/// CSINode's annotations and driver entries but for their names. Claims and Nodes are cached
/// as [`ClaimSummary`] and [`NodeSummary`], which keep what is read already while decoding.
/// Memory grows with the cluster, so this matters at scale (`just bench`'s memory rows show
/// each cache's bytes).
pub fn trim<K: Resource + std::any::Any>(object: &mut K) {
    object.meta_mut().managed_fields = None;
    let any: &mut dyn std::any::Any = object;
    if let Some(csinode) = any.downcast_mut::<CSINode>() {
        csinode.metadata.annotations = None;
        for driver in &mut csinode.spec.drivers {
            driver.allocatable = None;
            driver.topology_keys = None;
            driver.node_id = String::new();
        }
    }
}

/// The caches of `pmem-csi controller`.
#[derive(Clone)]
pub struct Stores {
    /// PersistentVolumeClaims, all namespaces.
    pub claims: Store<ClaimSummary>,
    /// StorageClasses.
    pub classes: Store<StorageClass>,
    /// Nodes.
    pub nodes: Store<NodeSummary>,
    /// CSINodes.
    pub csinodes: Store<CSINode>,
    /// Leases in the driver namespace (heartbeats).
    pub leases: Store<Lease>,
}

/// Starts one shared watch of `api`; returns its cache and a subscription to its events.
pub fn shared<K>(
    api: Api<K>,
    config: watcher::Config,
    tasks: &mut JoinSet<()>,
) -> (Store<K>, ReflectHandle<K>)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    let (reader, writer) = reflector::store_shared(SUBSCRIBER_BUFFER);
    let subscriber = writer
        .subscribe()
        .unwrap_or_else(|| unreachable!("stores made by store_shared accept subscribers"));
    let stream = watcher(api, config)
        .default_backoff()
        .modify(|o: &mut K| trim(o))
        .reflect_shared(writer);
    tasks.spawn(stream.for_each(|_| async {}));
    (reader, subscriber)
}

/// Starts a watch of `api` feeding only a cache.
pub fn cache<K>(api: Api<K>, config: watcher::Config, tasks: &mut JoinSet<()>) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    let (reader, writer) = reflector::store();
    let stream = reflector::reflector(
        writer,
        watcher(api, config)
            .default_backoff()
            .modify(|o: &mut K| trim(o)),
    );
    tasks.spawn(stream.for_each(|_| async {}));
    reader
}

/// The caches the driver liveness judgement reads.
#[derive(Clone)]
pub struct NodeStores {
    /// Nodes.
    pub nodes: Store<NodeSummary>,
    /// CSINodes.
    pub csinodes: Store<CSINode>,
    /// Leases in the driver namespace (heartbeats).
    pub leases: Store<Lease>,
}

impl NodeStores {
    /// Starts the three watches (`namespace`: where the heartbeat Leases live).
    pub fn start(client: &kube::Client, namespace: &str, tasks: &mut JoinSet<()>) -> Self {
        Self {
            nodes: cache(
                Api::<NodeSummary>::all(client.clone()),
                watcher::Config::default(),
                tasks,
            ),
            csinodes: cache(
                Api::<CSINode>::all(client.clone()),
                watcher::Config::default(),
                tasks,
            ),
            leases: cache(
                Api::<Lease>::namespaced(client.clone(), namespace),
                watcher::Config::default(),
                tasks,
            ),
        }
    }

    /// Waits until every cache has listed once.
    pub async fn wait_ready(&self) -> Result<(), reflector::store::WriterDropped> {
        self.nodes.wait_until_ready().await?;
        self.csinodes.wait_until_ready().await?;
        self.leases.wait_until_ready().await?;
        Ok(())
    }
}

impl Stores {
    /// The caches the liveness judgement reads.
    pub fn node_stores(&self) -> NodeStores {
        NodeStores {
            nodes: self.nodes.clone(),
            csinodes: self.csinodes.clone(),
            leases: self.leases.clone(),
        }
    }

    /// Waits until every cache has listed once.
    pub async fn wait_ready(&self) -> Result<(), reflector::store::WriterDropped> {
        self.claims.wait_until_ready().await?;
        self.classes.wait_until_ready().await?;
        self.nodes.wait_until_ready().await?;
        self.csinodes.wait_until_ready().await?;
        self.leases.wait_until_ready().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;

    #[test]
    fn trim_keeps_what_is_read() {
        let mut csinode = CSINode {
            metadata: kube::api::ObjectMeta {
                name: Some("n".into()),
                annotations: Some([("a".to_string(), "b".to_string())].into()),
                managed_fields: Some(vec![ManagedFieldsEntry::default()]),
                ..Default::default()
            },
            spec: k8s_openapi::api::storage::v1::CSINodeSpec {
                drivers: vec![k8s_openapi::api::storage::v1::CSINodeDriver {
                    name: "pmem-csi.intel.com".into(),
                    node_id: "n".into(),
                    topology_keys: Some(vec!["pmem-csi.intel.com/node".into()]),
                    ..Default::default()
                }],
            },
        };
        trim(&mut csinode);
        assert!(
            csinode.metadata.managed_fields.is_none() && csinode.metadata.annotations.is_none()
        );
        assert_eq!(
            csinode.spec.drivers[0],
            k8s_openapi::api::storage::v1::CSINodeDriver {
                name: "pmem-csi.intel.com".into(),
                ..Default::default()
            },
            "the judgement reads only which drivers a CSINode lists"
        );
        let mut class = StorageClass {
            provisioner: "p".into(),
            ..Default::default()
        };
        trim(&mut class);
        assert_eq!(class.provisioner, "p");
    }
}
