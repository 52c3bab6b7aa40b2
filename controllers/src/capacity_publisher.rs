//! The capacity publisher of `pmem-csi node`: one CSIStorageCapacity per WaitForFirstConsumer
//! StorageClass of this driver, in the driver's namespace, describing this node's capacity, so
//! that kube-scheduler only selects nodes with room. What to write is a pure function of the
//! classes, the Node and the capacity; the controller around it applies the difference.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::{CSIStorageCapacity, StorageClass};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;

use crate::capacity_source::{CapacitySource, NodeCapacity};
use crate::instrument::Instrument;
use crate::quantity;
use crate::reconcile_metrics::ReconcileMetrics;
use crate::stores;
use crate::volume_facts::ClassFacts;
use crate::well_known::{
    ALIGNMENT_BYTES, DRIVER_LABEL, FREE_EXTENTS, MANAGED_BY_LABEL, MANAGED_BYTES, VOLUME_OVERHEAD,
    capacity_annotation, capacity_object_name as object_name, managed_by, topology_key,
};

/// The controller's name in metrics and logs.
pub const CONTROLLER: &str = "capacity-publisher";
/// At most this many pools are listed in the free-extents annotation.
pub const MAX_EXTENTS: usize = 16;
/// Periodic re-publication even without changes.
pub const RESYNC: Duration = Duration::from_secs(300);

/// Who publishes: the driver, its namespace, this node and its Node object's UID.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Publisher {
    /// Driver name.
    pub driver: String,
    /// Namespace of the objects.
    pub namespace: String,
    /// Node name.
    pub node: String,
}

/// The annotations the extender reads: managed bytes, alignment, free bytes per pool and, where
/// volumes keep metadata in the pool, its size.
fn annotations(
    publisher: &Publisher,
    capacity: &NodeCapacity,
    extents: &[String],
) -> BTreeMap<String, String> {
    let key = |name: &str| capacity_annotation(&publisher.driver, name);
    let mut annotations = BTreeMap::from([
        (key(MANAGED_BYTES), capacity.managed().to_string()),
        (key(ALIGNMENT_BYTES), capacity.alignment.to_string()),
        (key(FREE_EXTENTS), extents.join(",")),
    ]);
    if let Some(overhead) = &capacity.overhead {
        annotations.insert(key(VOLUME_OVERHEAD), overhead.to_string());
    }
    annotations
}

/// The capacity objects that should exist for this node (`node_uid`: the Node's UID, the
/// owner; objects without a Node are not wanted at all).
pub fn desired(
    publisher: &Publisher,
    node_uid: Option<&str>,
    classes: &[(String, ClassFacts)],
    capacity: &NodeCapacity,
) -> Vec<CSIStorageCapacity> {
    let Some(uid) = node_uid else {
        return Vec::new();
    };
    let mut wanted: Vec<&str> = classes
        .iter()
        .filter(|(_, c)| c.provisioner == publisher.driver && c.late_binding)
        .map(|(name, _)| name.as_str())
        .collect();
    wanted.sort_unstable();
    let mut pools = capacity.pools.clone();
    pools.sort_by_key(|p| std::cmp::Reverse(p.free));
    let extents: Vec<String> = pools
        .iter()
        .take(MAX_EXTENTS)
        .map(|p| p.free.to_string())
        .collect();
    wanted
        .into_iter()
        .map(|class| CSIStorageCapacity {
            metadata: ObjectMeta {
                name: Some(object_name(&publisher.node, class)),
                namespace: Some(publisher.namespace.clone()),
                labels: Some(BTreeMap::from([
                    (DRIVER_LABEL.to_string(), publisher.driver.clone()),
                    (MANAGED_BY_LABEL.to_string(), managed_by(&publisher.node)),
                    ("app.kubernetes.io/name".into(), "pmem-csi-node".into()),
                    ("app.kubernetes.io/part-of".into(), "pmem-csi".into()),
                    ("app.kubernetes.io/component".into(), "node".into()),
                    (
                        "app.kubernetes.io/instance".into(),
                        publisher.driver.clone(),
                    ),
                ])),
                annotations: Some(annotations(publisher, capacity, &extents)),
                // The Node owns them: deleting the Node lets the garbage collector remove them.
                // No blockOwnerDeletion: that would need delete permission on Nodes' finalizers.
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Node".into(),
                    name: publisher.node.clone(),
                    uid: uid.to_string(),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            storage_class_name: class.to_string(),
            node_topology: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([(
                    topology_key(&publisher.driver),
                    publisher.node.clone(),
                )])),
                ..Default::default()
            }),
            capacity: Some(Quantity(capacity.available().to_string())),
            maximum_volume_size: Some(Quantity(capacity.maximum_volume_size().to_string())),
        })
        .collect()
}

/// One write the publisher makes.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// Create this object.
    Create(CSIStorageCapacity),
    /// Replace an existing object (resourceVersion carried over, so a concurrent change fails).
    Replace(CSIStorageCapacity),
    /// Delete the object of this name.
    Delete(String),
}

/// Whether `existing` already says what `wanted` says (the fields the publisher owns).
/// Quantities compare by value: the apiserver returns them in canonical form ("1099431936k"
/// for the "1099431936000" written), and comparing text would rewrite the object forever.
fn same(existing: &CSIStorageCapacity, wanted: &CSIStorageCapacity) -> bool {
    let bytes = |q: &Option<Quantity>| q.as_ref().map(|q| quantity::parse_bytes(&q.0).ok());
    let owned = |o: &CSIStorageCapacity| {
        (
            o.metadata.labels.clone(),
            o.metadata.annotations.clone(),
            o.metadata.owner_references.clone(),
            o.storage_class_name.clone(),
            o.node_topology.clone(),
            bytes(&o.capacity),
            bytes(&o.maximum_volume_size),
        )
    };
    owned(existing) == owned(wanted)
}

/// The writes that turn `existing` (this node's objects) into `wanted`.
pub fn plan(wanted: &[CSIStorageCapacity], existing: &[CSIStorageCapacity]) -> Vec<Change> {
    let by_name: BTreeMap<&str, &CSIStorageCapacity> = existing
        .iter()
        .filter_map(|o| o.metadata.name.as_deref().map(|n| (n, o)))
        .collect();
    let mut changes = Vec::new();
    for w in wanted {
        let name = w.metadata.name.as_deref().unwrap_or_default();
        match by_name.get(name) {
            None => changes.push(Change::Create(w.clone())),
            Some(e) if !same(e, w) => {
                let mut replacement = w.clone();
                replacement.metadata.resource_version = e.metadata.resource_version.clone();
                changes.push(Change::Replace(replacement));
            }
            Some(_) => {}
        }
    }
    let wanted_names: std::collections::BTreeSet<&str> = wanted
        .iter()
        .filter_map(|w| w.metadata.name.as_deref())
        .collect();
    for name in by_name.keys() {
        if !wanted_names.contains(name) {
            changes.push(Change::Delete(name.to_string()));
        }
    }
    changes
}

// ---------------------------------------------------------------------------------------------
// The controller around the plan.
// ---------------------------------------------------------------------------------------------

/// Failures of one publication; retried with back-off.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The capacity could not be read.
    #[error("reading capacity: {0}")]
    Capacity(String),
    /// An apiserver call failed.
    #[error("{op} CSIStorageCapacity {name}: {source}")]
    Api {
        /// What was being done.
        op: &'static str,
        /// Object name.
        name: String,
        /// Why.
        source: kube::Error,
    },
}

/// Publishes this node's capacity until shut down, then withdraws it.
pub struct CapacityPublisher<S: CapacitySource> {
    client: kube::Client,
    publisher: Publisher,
    source: Arc<S>,
    instrument: Instrument<Node>,
}

struct Context<S: CapacitySource> {
    instrument: Instrument<Node>,
    client: kube::Client,
    publisher: Publisher,
    source: Arc<S>,
    classes: Store<StorageClass>,
    own: Store<CSIStorageCapacity>,
}

impl<S: CapacitySource> CapacityPublisher<S> {
    /// A publisher for `publisher.node`.
    pub fn new(
        client: kube::Client,
        publisher: Publisher,
        source: Arc<S>,
        reconciles: ReconcileMetrics,
    ) -> Self {
        Self {
            client,
            publisher,
            source,
            instrument: Instrument::new(CONTROLLER, reconciles),
        }
    }

    /// Publishes until `shutdown`, then deletes this node's objects (best effort): a node whose
    /// driver stops serving must not keep attracting volumes.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut tasks = tokio::task::JoinSet::new();
        let own_selector = format!("{MANAGED_BY_LABEL}={}", managed_by(&self.publisher.node));
        let (classes, class_events) = stores::shared(
            Api::<StorageClass>::all(self.client.clone()),
            watcher::Config::default(),
            &mut tasks,
        );
        let (own, own_events) = stores::shared(
            Api::<CSIStorageCapacity>::namespaced(self.client.clone(), &self.publisher.namespace),
            watcher::Config::default().labels(&own_selector),
            &mut tasks,
        );
        let node = self.publisher.node.clone();
        let node_ref = move || ObjectRef::<Node>::new(&node);
        let (to_node_a, to_node_b, to_node_c) =
            (node_ref.clone(), node_ref.clone(), node_ref.clone());
        let changes = tokio_stream::wrappers::WatchStream::new(self.source.changes())
            .map(move |_| to_node_c());
        let ctx = Arc::new(Context {
            instrument: self.instrument,
            client: self.client.clone(),
            publisher: self.publisher.clone(),
            source: self.source.clone(),
            classes,
            own,
        });
        Controller::new(
            Api::<Node>::all(self.client.clone()),
            watcher::Config::default().fields(&format!("metadata.name={}", self.publisher.node)),
        )
        // Coalesces bursts: one write per object however many creates happen meanwhile.
        .with_config(ControllerConfig::default().debounce(Duration::from_millis(500)))
        .watches_shared_stream(class_events, move |_| Some(to_node_a()))
        .watches_shared_stream(own_events, move |_| Some(to_node_b()))
        .reconcile_on(changes)
        .graceful_shutdown_on(shutdown.cancelled_owned())
        .run(reconcile::<S>, error_policy::<S>, ctx)
        .for_each(|_| async {})
        .await;
        tasks.abort_all();
        withdraw(&self.client, &self.publisher).await;
    }
}

/// Deletes every capacity object of this node.
async fn withdraw(client: &kube::Client, publisher: &Publisher) {
    let api = Api::<CSIStorageCapacity>::namespaced(client.clone(), &publisher.namespace);
    let selector = format!("{MANAGED_BY_LABEL}={}", managed_by(&publisher.node));
    match api.list(&ListParams::default().labels(&selector)).await {
        Ok(list) => {
            for o in list.items {
                let name = o.metadata.name.unwrap_or_default();
                if let Err(e) = api.delete(&name, &DeleteParams::default()).await {
                    tracing::warn!(name, "withdrawing capacity: {e}");
                }
            }
            tracing::info!(node = publisher.node, "capacity withdrawn");
        }
        Err(e) => tracing::warn!("listing capacity objects to withdraw: {e}"),
    }
}

async fn reconcile<S: CapacitySource>(
    node: Arc<Node>,
    ctx: Arc<Context<S>>,
) -> Result<Action, PublishError> {
    ctx.instrument.reconcile(&node, publish(&node, &ctx)).await
}

async fn publish<S: CapacitySource>(node: &Node, ctx: &Context<S>) -> Result<Action, PublishError> {
    let capacity = ctx
        .source
        .capacity()
        .map_err(|e| PublishError::Capacity(e.to_string()))?;
    let classes: Vec<(String, ClassFacts)> = ctx
        .classes
        .state()
        .iter()
        .filter_map(|c| Some((c.metadata.name.clone()?, ClassFacts::of(c))))
        .collect();
    // A Node being deleted is not an owner to publish under.
    let uid = node
        .metadata
        .uid
        .as_deref()
        .filter(|_| node.metadata.deletion_timestamp.is_none());
    let wanted = desired(&ctx.publisher, uid, &classes, &capacity);
    let existing: Vec<CSIStorageCapacity> = ctx.own.state().iter().map(|o| (**o).clone()).collect();
    let api = Api::<CSIStorageCapacity>::namespaced(ctx.client.clone(), &ctx.publisher.namespace);
    for change in plan(&wanted, &existing) {
        let (op, name, result) = match &change {
            Change::Create(o) => {
                let name = o.metadata.name.clone().unwrap_or_default();
                let r = api.create(&PostParams::default(), o).await.map(|_| ());
                // Created meanwhile by an earlier attempt whose answer was lost: the next
                // reconcile, fed by the watch, replaces it.
                let r = match r {
                    Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
                    other => other,
                };
                ("creating", name, r)
            }
            Change::Replace(o) => {
                let name = o.metadata.name.clone().unwrap_or_default();
                let r = match api.replace(&name, &PostParams::default(), o).await {
                    // Deleted meanwhile (the controller's clean-up while this node was cut
                    // off): create it afresh instead of retrying a replace forever.
                    Err(kube::Error::Api(e)) if e.code == 404 => {
                        let mut fresh = o.clone();
                        fresh.metadata.resource_version = None;
                        api.create(&PostParams::default(), &fresh).await.map(|_| ())
                    }
                    other => other.map(|_| ()),
                };
                ("replacing", name, r)
            }
            Change::Delete(name) => {
                let r = match api.delete(name, &DeleteParams::default()).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                    Err(e) => Err(e),
                };
                ("deleting", name.clone(), r)
            }
        };
        tracing::debug!(op, name, ok = result.is_ok(), "capacity object write");
        result.map_err(|source| PublishError::Api { op, name, source })?;
    }
    Ok(Action::requeue(RESYNC))
}

fn error_policy<S: CapacitySource>(
    node: Arc<Node>,
    error: &PublishError,
    ctx: Arc<Context<S>>,
) -> Action {
    // Conflicts resolve once the watch delivers the newer object; the first retry is quick.
    ctx.instrument.error_policy(&node, error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capacity_source::PoolCapacity;

    fn publisher() -> Publisher {
        Publisher {
            driver: "pmem-csi.intel.com".into(),
            namespace: "pmem-csi".into(),
            node: "node-1".into(),
        }
    }

    fn class(name: &str, provisioner: &str, mode: &str) -> (String, ClassFacts) {
        let class: StorageClass = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "provisioner": provisioner,
            "volumeBindingMode": mode,
        }))
        .expect("class");
        (name.into(), ClassFacts::of(&class))
    }

    fn capacity() -> NodeCapacity {
        NodeCapacity {
            pools: vec![
                PoolCapacity {
                    name: "b".into(),
                    managed: 8 << 30,
                    free: 1 << 30,
                    largest: 1 << 30,
                },
                PoolCapacity {
                    name: "a".into(),
                    managed: 8 << 30,
                    free: 3 << 30,
                    largest: 2 << 30,
                },
            ],
            total: 16 << 30,
            alignment: 4 << 20,
            overhead: None,
        }
    }

    #[test]
    fn volume_overhead_is_published_only_where_volumes_keep_metadata() {
        let publisher = publisher();
        let classes = [class("late", "pmem-csi.intel.com", "WaitForFirstConsumer")];
        let key = "pmem-csi.intel.com/volume-overhead";
        let plain = desired(&publisher, Some("uid-1"), &classes, &capacity());
        let annotations = plain[0].metadata.annotations.clone().unwrap_or_default();
        assert_eq!(annotations.get(key), None);
        let mut direct = capacity();
        direct.overhead = Some(crate::VolumeOverhead::FSDAX_MAP_DEV);
        let objects = desired(&publisher, Some("uid-1"), &classes, &direct);
        let annotations = objects[0].metadata.annotations.clone().unwrap_or_default();
        assert_eq!(
            annotations.get(key).map(|v| v.parse()),
            Some(Ok(crate::VolumeOverhead::FSDAX_MAP_DEV))
        );
    }

    #[test]
    fn desired_only_late_binding_classes_of_this_driver() {
        let classes = [
            class("wffc", "pmem-csi.intel.com", "WaitForFirstConsumer"),
            class("immediate", "pmem-csi.intel.com", "Immediate"),
            class("other", "other.csi", "WaitForFirstConsumer"),
            class("a-wffc", "pmem-csi.intel.com", "WaitForFirstConsumer"),
        ];
        let objects = desired(&publisher(), Some("uid-1"), &classes, &capacity());
        let names: Vec<&str> = objects
            .iter()
            .map(|o| o.storage_class_name.as_str())
            .collect();
        assert_eq!(names, ["a-wffc", "wffc"]);
        let o = &objects[1];
        assert_eq!(o.metadata.name.as_deref(), Some("pmem-csi-node-1-wffc"));
        assert_eq!(o.metadata.namespace.as_deref(), Some("pmem-csi"));
        assert_eq!(o.capacity, Some(Quantity((4u64 << 30).to_string())));
        assert_eq!(
            o.maximum_volume_size,
            Some(Quantity((2u64 << 30).to_string()))
        );
        let labels = o.metadata.labels.clone().unwrap_or_default();
        assert_eq!(
            labels.get(DRIVER_LABEL).map(String::as_str),
            Some("pmem-csi.intel.com")
        );
        assert_eq!(
            labels.get(MANAGED_BY_LABEL).map(String::as_str),
            Some("pmem-csi-node-1")
        );
        let annotations = o.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(
            annotations
                .get("pmem-csi.intel.com/free-extents")
                .map(String::as_str),
            Some("3221225472,1073741824")
        );
        assert_eq!(
            annotations
                .get("pmem-csi.intel.com/managed-bytes")
                .map(String::as_str),
            Some("17179869184")
        );
        assert_eq!(
            annotations
                .get("pmem-csi.intel.com/alignment-bytes")
                .map(String::as_str),
            Some("4194304")
        );
        let owner = &o.metadata.owner_references.clone().unwrap_or_default()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("Node", "node-1", "uid-1")
        );
        assert_eq!(owner.block_owner_deletion, None);
        let topology = o
            .node_topology
            .clone()
            .and_then(|t| t.match_labels)
            .unwrap_or_default();
        assert_eq!(
            topology.get("pmem-csi.intel.com/node").map(String::as_str),
            Some("node-1")
        );
        assert!(
            desired(&publisher(), None, &classes, &capacity()).is_empty(),
            "no Node, no objects"
        );
    }

    #[test]
    fn managed_by_is_ours_and_short() {
        assert_eq!(managed_by("n"), "pmem-csi-n");
        let long = managed_by(&"n".repeat(80));
        assert!(long.len() <= 63 && long.starts_with("pmem-csi-"), "{long}");
        assert!(!managed_by("n").starts_with("external-provisioner"));
    }

    #[test]
    fn plan_table() {
        let classes = [
            class("c1", "pmem-csi.intel.com", "WaitForFirstConsumer"),
            class("c2", "pmem-csi.intel.com", "WaitForFirstConsumer"),
        ];
        let wanted = desired(&publisher(), Some("uid"), &classes, &capacity());
        let with_rv = |mut o: CSIStorageCapacity, rv: &str| {
            o.metadata.resource_version = Some(rv.into());
            o
        };
        // Nothing exists: create both.
        let p = plan(&wanted, &[]);
        assert!(
            matches!(p.as_slice(), [Change::Create(_), Change::Create(_)]),
            "{p:?}"
        );
        // Up to date: nothing.
        let existing = vec![
            with_rv(wanted[0].clone(), "1"),
            with_rv(wanted[1].clone(), "2"),
        ];
        assert!(plan(&wanted, &existing).is_empty());
        // Capacity changed: replace, keeping the resourceVersion as precondition.
        let mut stale = existing.clone();
        stale[1].capacity = Some(Quantity("1".into()));
        match plan(&wanted, &stale).as_slice() {
            [Change::Replace(o)] => assert_eq!(o.metadata.resource_version.as_deref(), Some("2")),
            other => panic!("{other:?}"),
        }
        // A class went away: delete its object.
        let p = plan(&wanted[..1], &existing);
        assert_eq!(p, vec![Change::Delete("pmem-csi-node-1-c2".into())]);
    }
}
