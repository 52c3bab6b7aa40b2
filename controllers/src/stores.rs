//! Watch-fed caches shared by every concern of a process: one watch per kind, managedFields
//! stripped (they are most of an object's bytes and nobody here reads them).

use std::fmt::Debug;
use std::hash::Hash;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::{CSINode, StorageClass};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, ReflectHandle, Store};
use kube::runtime::watcher;
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio::task::JoinSet;

/// Events a subscriber may lag behind before the shared watch waits for it.
const SUBSCRIBER_BUFFER: usize = 4096;

/// The caches of `pmem-csi controller`.
#[derive(Clone)]
pub struct Stores {
    /// PersistentVolumeClaims, all namespaces.
    pub claims: Store<PersistentVolumeClaim>,
    /// StorageClasses.
    pub classes: Store<StorageClass>,
    /// Nodes.
    pub nodes: Store<Node>,
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
        .modify(|o: &mut K| {
            o.meta_mut().managed_fields = None;
        })
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
        watcher(api, config).default_backoff().modify(|o: &mut K| {
            o.meta_mut().managed_fields = None;
        }),
    );
    tasks.spawn(stream.for_each(|_| async {}));
    reader
}

impl Stores {
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
