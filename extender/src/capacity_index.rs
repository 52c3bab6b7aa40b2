//! What the extender knows about every node's PMEM without asking anyone on the request path:
//! the capacity each node publishes, and what is already allocated there — PVs of this driver,
//! unbound claims with a selected node, and this driver's inline volumes in running pods — kept
//! current by watch events.
//!
//! The index is pure: events are applied as plain objects, queries return plain numbers. Each
//! allocation remembers the event sequence number that added it and each node's capacity the
//! number at which it last changed, so that allocations the published free list cannot reflect
//! yet are known (they are placed into the pools again by the fit).

use controllers::pod_volumes::Lookup;
use controllers::volume_cost::{VolumeOverhead, volume_cost};
use controllers::volume_facts::{
    Binding, ClaimFacts, ClaimKey, ClassFacts, capacity_node, default_class, is_ours,
    positive_bytes, pv_node,
};
use controllers::well_known::{
    ALIGNMENT_BYTES, DRIVER_LABEL, FREE_EXTENTS, INLINE_SIZE, MANAGED_BYTES, VOLUME_OVERHEAD,
    capacity_annotation,
};
use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{CSIStorageCapacity, StorageClass};

use smallvec::SmallVec;

use crate::node_table::NodeTable;

/// One volume, however it is known.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum VolumeKey {
    /// A claim, and the PV bound to it (one volume, whichever is seen first).
    Claim(ClaimKey),
    /// A PV without a claim reference.
    Volume(String),
    /// A CSI inline volume of a pod.
    Inline {
        /// The pod's UID.
        pod_uid: String,
        /// The volume's name in the pod.
        volume: String,
    },
}

/// A node's capacity as its CSIStorageCapacity objects publish it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PublishedCapacity {
    /// Free bytes per pool, largest first (`free-extents`, else one pool of `capacity`).
    pub pools: Vec<u64>,
    /// Bytes the driver manages (`managed-bytes`); `None` when not published.
    pub managed: Option<u64>,
    /// Volume sizes are multiples of this (`alignment-bytes`; 1 when not published).
    pub alignment: u64,
    /// Free bytes over all pools (`capacity`): `free-extents` lists at most 16 of them.
    pub free: u64,
    /// Metadata each volume keeps in its pool (`volume-overhead`; none when not published).
    pub overhead: Option<VolumeOverhead>,
}

/// What the fit needs to know about one node, excluding a pod's own claims.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeUsage {
    /// Published capacity; `None` when the node published none.
    pub published: Option<PublishedCapacity>,
    /// Aligned bytes allocated on the node.
    pub allocated: u64,
    /// Aligned sizes of the allocations the published pools do not reflect yet.
    pub unreflected: Vec<u64>,
}

/// What the index keeps of a pod: only its inline volumes of this driver, so that no full pod
/// cache is needed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodRecord {
    /// `spec.nodeName`.
    pub node: Option<String>,
    /// Succeeded or Failed: its volumes are gone or going.
    pub terminated: bool,
    /// (volume name, bytes) of this driver's inline volumes.
    pub inline: Vec<(String, u64)>,
}

/// A PV of this driver with a node.
#[derive(Clone, Debug, PartialEq, Eq)]
struct PvRecord {
    node: String,
    size: u64,
    /// The claim reference and, when set, its uid.
    claim: Option<(ClaimKey, Option<String>)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Allocation {
    node: String,
    size: u64,
    seq: u64,
    /// Whether the size is a PV's (or a bound claim's asking for more than its PV holds),
    /// not an unbound claim's or an inline volume's.
    bound: bool,
    /// The last growth of a bound volume on its node, which the node's published capacity
    /// reflects only once the node has grown the volume and published again.
    growth: Option<Growth>,
}

/// A volume's growth: its size before, and the event that made it bigger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Growth {
    from: u64,
    seq: u64,
}

#[derive(Clone, Debug)]
struct CapacityRecord {
    /// `published.pools` again, inline: /filter reads it for every candidate, and a separate
    /// allocation per node costs a cache miss each.
    pools: SmallVec<[u64; 4]>,
    published: PublishedCapacity,
    seq: u64,
    /// Capacity object name → its content; a node has one per class, all alike.
    objects: BTreeMap<String, PublishedCapacity>,
}

/// What the fit reads of a node's published capacity, borrowed from the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Published<'a> {
    /// The node's id.
    pub id: NodeId,
    /// Free bytes per pool, largest first.
    pub pools: &'a [u64],
    /// Bytes the driver manages; `None` when not published.
    pub managed: Option<u64>,
    /// Volume sizes are multiples of this.
    pub alignment: u64,
    /// Free bytes over all pools.
    pub free: u64,
    /// Metadata each volume keeps in its pool.
    pub overhead: Option<VolumeOverhead>,
}

impl CapacityRecord {
    fn set_published(&mut self, published: PublishedCapacity) {
        self.pools = SmallVec::from_slice(&published.pools);
        self.published = published;
    }

    fn view(&self, id: NodeId) -> Published<'_> {
        Published {
            id,
            pools: &self.pools,
            managed: self.published.managed,
            alignment: self.published.alignment,
            free: self.published.free,
            overhead: self.published.overhead,
        }
    }
}

/// Identifies a node by number, so that the extender's hot paths (reservations naming thousands
/// of nodes) need not hash names: the node's slot in the index's node table, so ids are dense
/// (0 up to about the number of nodes, which keeps a [`crate::node_set::NodeSet`] small).
///
/// Stable while the index keeps the node: a node whose capacity objects are deleted and
/// published again (a class recreated, a provisioner restarting) keeps it, and so keeps the
/// reservations held on it. Another node gets the number only after
/// [`CapacityIndex::forget_idle_nodes`] forgot this one, which it never does while a
/// reservation holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(u32);

impl NodeId {
    /// The id's position among dense ids (for bitsets).
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The id at `index`, the inverse of [`NodeId::index`]; `None` past `u32`.
    pub fn from_index(index: usize) -> Option<Self> {
        u32::try_from(index).ok().map(NodeId)
    }
}

/// The index. See the module documentation.
#[derive(Debug)]
pub struct CapacityIndex {
    driver: String,
    default_size: u64,
    seq: u64,
    classes: HashMap<String, ClassFacts>,
    claims: HashMap<ClaimKey, ClaimFacts>,
    /// Volume → the name of the PV of this driver (in `pvs`) filed under it.
    volumes: HashMap<VolumeKey, String>,
    /// PV name → its key in `volumes`.
    volume_keys: HashMap<String, VolumeKey>,
    /// PV name → what the index keeps of it, whatever its key.
    pvs: HashMap<String, PvRecord>,
    /// Claim → the PVs whose claim reference names it.
    pvs_by_claim: HashMap<ClaimKey, HashSet<String>>,
    pods: HashMap<String, PodRecord>,
    // Looked up once per candidate node on every /filter: one lookup for both halves, in a
    // table laid out for it.
    nodes: NodeTable<NodeEntry>,
    /// By node id: the node's [`SettledNode`], if it is settled. Derived from `nodes` and
    /// `allocations` by `refresh_settled` after each change of a node.
    settled: Vec<Option<SettledNode>>,
    allocations: HashMap<VolumeKey, Allocation>,
}

/// One node of the index ([`CapacityIndex::node`]).
#[derive(Clone, Copy, Debug)]
pub struct NodeRef<'a>(&'a NodeEntry);

/// Pools a [`SettledNode`] holds inline; a node publishing more takes the general path.
const SETTLED_POOLS: usize = 4;

/// What the fit reads of a *settled* node: one that published capacity and whose published
/// pools reflect every allocation on it (nothing unreflected), the usual node between bursts.
///
/// Kept by node id in one dense vector beside the node table and derived from the node's entry
/// after every change to its capacity or allocations ([`CapacityIndex::settled`]): /filter
/// reads one small record per candidate instead of the entry's parts scattered over several
/// cache lines, which on a loaded machine are mostly cold between two calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SettledNode {
    pools: [u64; SETTLED_POOLS],
    pool_count: u8,
    /// Bytes the driver manages (`u64::MAX` when not published).
    pub managed: u64,
    /// Aligned bytes allocated on the node, every allocation counted.
    pub allocated: u64,
    /// Volume sizes are multiples of this.
    pub alignment: u64,
    /// Metadata each volume keeps in its pool.
    pub overhead: Option<VolumeOverhead>,
}

impl SettledNode {
    /// Free bytes per pool, largest first.
    pub fn pools(&self) -> &[u64] {
        self.pools
            .get(..usize::from(self.pool_count))
            .unwrap_or_default()
    }

    /// The cap view before reservations: `managed − allocated`.
    pub fn cap(&self) -> u64 {
        self.managed.saturating_sub(self.allocated)
    }

    fn of(published: Published<'_>, allocated: u64) -> Option<Self> {
        let mut pools = [0; SETTLED_POOLS];
        pools
            .get_mut(..published.pools.len())?
            .copy_from_slice(published.pools);
        Some(SettledNode {
            pools,
            pool_count: u8::try_from(published.pools.len()).ok()?,
            managed: published.managed.unwrap_or(u64::MAX),
            allocated,
            alignment: published.alignment,
            overhead: published.overhead,
        })
    }
}

/// What the index keeps per node.
#[derive(Debug)]
struct NodeEntry {
    id: NodeId,
    capacity: Option<CapacityRecord>,
    /// The allocations on the node.
    volumes: HashSet<VolumeKey>,
}

impl CapacityIndex {
    /// An empty index for `driver`; claims and inline volumes without a size count as
    /// `default_size` (the node driver's `--default-volume-size`).
    pub fn new(driver: impl Into<String>, default_size: u64) -> Self {
        Self {
            driver: driver.into(),
            default_size,
            seq: 0,
            classes: HashMap::new(),
            claims: HashMap::new(),
            volumes: HashMap::new(),
            volume_keys: HashMap::new(),
            pvs: HashMap::new(),
            pvs_by_claim: HashMap::new(),
            pods: HashMap::new(),
            nodes: NodeTable::new(),
            settled: Vec::new(),
            allocations: HashMap::new(),
        }
    }

    /// The driver name.
    pub fn driver(&self) -> &str {
        &self.driver
    }

    /// The size assumed for volumes that state none.
    pub fn default_size(&self) -> u64 {
        self.default_size
    }

    /// Adds or updates a StorageClass.
    pub fn apply_class(&mut self, class: &StorageClass) {
        let Some(name) = class.metadata.name.clone() else {
            return;
        };
        self.classes.insert(name, ClassFacts::of(class));
        // A class decides whether its unbound claims are ours.
        let keys: Vec<ClaimKey> = self.claims.keys().cloned().collect();
        self.bump();
        for key in keys {
            self.derive(&VolumeKey::Claim(key));
        }
    }

    /// Removes a StorageClass.
    pub fn delete_class(&mut self, name: &str) {
        self.classes.remove(name);
    }

    /// A class by name.
    pub fn class(&self, name: &str) -> Option<&ClassFacts> {
        self.classes.get(name)
    }

    /// The cluster's default class, by [`default_class`]'s rule.
    pub fn default_class(&self) -> Option<&ClassFacts> {
        default_class(
            self.classes
                .iter()
                .map(|(name, class)| (name.as_str(), class)),
        )
        .map(|(_, class)| class)
    }

    /// Adds or updates a claim. The caller then ends the claim's reservation entry if
    /// [`CapacityIndex::counted_on`] names a node, in the same locked update.
    pub fn apply_claim(&mut self, claim: &PersistentVolumeClaim) {
        let Some(key) = ClaimKey::of(claim) else {
            return;
        };
        self.claims.insert(key.clone(), ClaimFacts::of(claim));
        self.bump();
        self.place_pvs_of_claim(&key);
        self.derive(&VolumeKey::Claim(key));
    }

    /// The node a volume counts on as allocated, if it counts anywhere.
    pub fn counted_on(&self, key: &VolumeKey) -> Option<&str> {
        self.allocations.get(key).map(|a| a.node.as_str())
    }

    /// Removes a claim.
    pub fn delete_claim(&mut self, key: &ClaimKey) {
        self.claims.remove(key);
        self.bump();
        self.place_pvs_of_claim(key);
        self.derive(&VolumeKey::Claim(key.clone()));
    }

    /// A claim by key.
    pub fn claim(&self, key: &ClaimKey) -> Option<&ClaimFacts> {
        self.claims.get(key)
    }

    /// Whether a claim, bound or not, is this driver's and not being deleted: its class (or,
    /// the class missing, its provisioner annotation) names this driver with late binding.
    fn is_late_binding_ours(&self, claim: &ClaimFacts) -> bool {
        let class = claim.class.as_deref().and_then(|c| self.classes.get(c));
        !claim.deleting
            && is_ours(
                class,
                claim.provisioner_annotation.as_deref(),
                &self.driver,
                Binding::Late,
            )
    }

    /// Adds or updates a PV.
    pub fn apply_volume(&mut self, pv: &PersistentVolume) {
        let Some(name) = pv.metadata.name.clone() else {
            return;
        };
        self.forget_pv(&name);
        if let Some(record) = self.pv_record(pv) {
            if let Some((claim, _)) = &record.claim {
                self.pvs_by_claim
                    .entry(claim.clone())
                    .or_default()
                    .insert(name.clone());
            }
            self.pvs.insert(name.clone(), record);
        }
        self.bump();
        self.place_pv(&name);
    }

    /// Removes a PV.
    pub fn delete_volume(&mut self, name: &str) {
        self.forget_pv(name);
        self.bump();
        self.place_pv(name);
    }

    fn forget_pv(&mut self, name: &str) {
        if let Some((key, _)) = self.pvs.remove(name).and_then(|r| r.claim)
            && let Some(names) = self.pvs_by_claim.get_mut(&key)
        {
            names.remove(name);
            if names.is_empty() {
                self.pvs_by_claim.remove(&key);
            }
        }
    }

    /// Files PV `name` under its key (again) and recomputes the allocations it left and joined.
    /// A PV counts as its claim's volume unless that claim is a later one of the same name (a
    /// StatefulSet's claim re-created while the old PV is Released or retained): then it is a
    /// volume of its own, and the new claim counts on its own selected node.
    fn place_pv(&mut self, name: &str) {
        let old = self.volume_keys.remove(name);
        if let Some(key) = &old {
            self.volumes.remove(key);
        }
        let claim = self.pvs.get(name).map(|record| record.claim.clone());
        let new = claim.map(|claim| {
            let key = match &claim {
                Some((claim, uid)) => {
                    let current = self.claims.get(claim);
                    let key = VolumeKey::Claim(claim.clone());
                    let same_claim = match (uid, current.and_then(|c| c.uid.as_ref())) {
                        (Some(a), Some(b)) => a == b,
                        _ => true,
                    };
                    // Two PVs naming one claim: the second is a volume of its own.
                    let taken = self.volumes.contains_key(&key);
                    if same_claim && !taken {
                        key
                    } else {
                        VolumeKey::Volume(name.to_string())
                    }
                }
                None => VolumeKey::Volume(name.to_string()),
            };
            self.volume_keys.insert(name.to_string(), key.clone());
            self.volumes.insert(key.clone(), name.to_string());
            key
        });
        for key in old.iter().chain(new.iter()) {
            self.derive(key);
        }
    }

    /// Places again the PVs whose claim reference names `claim`.
    fn place_pvs_of_claim(&mut self, claim: &ClaimKey) {
        let names: Vec<String> = self
            .pvs_by_claim
            .get(claim)
            .map(|n| n.iter().cloned().collect())
            .unwrap_or_default();
        for pv in names {
            self.place_pv(&pv);
        }
    }

    fn pv_record(&self, pv: &PersistentVolume) -> Option<PvRecord> {
        let spec = pv.spec.as_ref()?;
        if spec.csi.as_ref()?.driver != self.driver {
            return None;
        }
        let node = pv_node(pv, &self.driver)?;
        let size = spec
            .capacity
            .as_ref()
            .and_then(|c| c.get("storage"))
            .and_then(|q| controllers::quantity::parse_bytes(&q.0).ok())
            .unwrap_or(0);
        let claim = spec.claim_ref.as_ref().and_then(|r| {
            let key = ClaimKey::new(r.namespace.clone()?, r.name.clone()?);
            Some((key, r.uid.clone()))
        });
        Some(PvRecord { node, size, claim })
    }

    /// Adds or updates a pod (only its inline volumes of this driver are kept). Returns whether
    /// the pod is bound to a node, so that the caller ends its inline reservation entries.
    pub fn apply_pod(&mut self, pod: &Pod) -> bool {
        let Some(uid) = pod.metadata.uid.clone() else {
            return false;
        };
        let record = self.pod_record(pod);
        let bound = record.node.is_some();
        let old: Vec<String> = self
            .pods
            .get(&uid)
            .map(|r| r.inline.iter().map(|(v, _)| v.clone()).collect())
            .unwrap_or_default();
        let keep = !record.inline.is_empty() || !old.is_empty();
        let volumes: Vec<String> = record.inline.iter().map(|(v, _)| v.clone()).collect();
        if keep {
            self.pods.insert(uid.clone(), record);
        }
        self.bump();
        for volume in old.into_iter().chain(volumes) {
            self.derive(&VolumeKey::Inline {
                pod_uid: uid.clone(),
                volume,
            });
        }
        bound
    }

    /// Removes a pod.
    pub fn delete_pod(&mut self, uid: &str) {
        if let Some(record) = self.pods.remove(uid) {
            self.bump();
            for (volume, _) in record.inline {
                self.derive(&VolumeKey::Inline {
                    pod_uid: uid.to_string(),
                    volume,
                });
            }
        }
    }

    /// What the index keeps of `pod`: its inline volumes of this driver and their sizes.
    pub fn pod_record(&self, pod: &Pod) -> PodRecord {
        let spec = pod.spec.as_ref();
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        PodRecord {
            node: spec.and_then(|s| s.node_name.clone()),
            terminated: matches!(phase, Some("Succeeded" | "Failed")),
            inline: spec
                .and_then(|s| s.volumes.as_ref())
                .into_iter()
                .flatten()
                .filter_map(|v| {
                    let csi = v.csi.as_ref()?;
                    (csi.driver == self.driver).then(|| {
                        let size = csi
                            .volume_attributes
                            .as_ref()
                            .and_then(|a| a.get(INLINE_SIZE))
                            .and_then(|s| positive_bytes(s))
                            .unwrap_or(self.default_size);
                        (v.name.clone(), size)
                    })
                })
                .collect(),
        }
    }

    /// The kept record of pod `uid` (pods with inline volumes of this driver only).
    pub fn pod(&self, uid: &str) -> Option<&PodRecord> {
        self.pods.get(uid)
    }

    /// Adds or updates a CSIStorageCapacity object (others' objects are ignored).
    pub fn apply_capacity(&mut self, object: &CSIStorageCapacity) {
        let Some(name) = object.metadata.name.clone() else {
            return;
        };
        let labels = object.metadata.labels.as_ref();
        if labels.and_then(|l| l.get(DRIVER_LABEL)) != Some(&self.driver) {
            return;
        }
        let Some(node) = capacity_node(object, &self.driver) else {
            return;
        };
        let published = published_capacity(&self.driver, object);
        self.bump();
        let seq = self.seq;
        let entry = self.entry(&node);
        let record = entry.capacity.get_or_insert_with(|| CapacityRecord {
            pools: SmallVec::from_slice(&published.pools),
            published: published.clone(),
            seq,
            objects: BTreeMap::new(),
        });
        record.objects.insert(name, published.clone());
        if record.published != published {
            record.set_published(published);
            record.seq = seq;
        }
        self.refresh_settled(&node);
    }

    /// Removes a CSIStorageCapacity object.
    pub fn delete_capacity(&mut self, name: &str) {
        let mut changed = Vec::new();
        for (node, entry) in self.nodes.iter_mut() {
            let Some(record) = entry.capacity.as_mut() else {
                continue;
            };
            if record.objects.remove(name).is_some() {
                match record.objects.values().next() {
                    Some(other) => {
                        let other = other.clone();
                        record.set_published(other);
                    }
                    None => entry.capacity = None,
                }
                changed.push(node.to_owned());
            }
        }
        for node in &changed {
            self.refresh_settled(node);
        }
        self.bump();
    }

    /// The node `id` if it is settled (see [`SettledNode`]).
    #[inline]
    pub fn settled(&self, id: NodeId) -> Option<&SettledNode> {
        self.settled.get(id.index())?.as_ref()
    }

    /// Derives `node`'s [`SettledNode`] again from its entry; called after every change of
    /// its capacity or allocations.
    fn refresh_settled(&mut self, node: &str) {
        let Some(id) = self.node_id(node) else {
            return;
        };
        let mut unreflected = Vec::new();
        let (published, allocated) = self.usage_of(self.node_by_id(id), &[], &mut unreflected);
        let settled = published
            .filter(|_| unreflected.is_empty())
            .and_then(|p| SettledNode::of(p, allocated));
        if self.settled.len() <= id.index() {
            self.settled.resize(id.index() + 1, None);
        }
        if let Some(slot) = self.settled.get_mut(id.index()) {
            *slot = settled;
        }
    }

    /// What `node` has allocated, leaving out `own_claims` (the filtered pod's, which count as
    /// its demand instead).
    pub fn usage(&self, node: &str, own_claims: &[ClaimKey]) -> NodeUsage {
        let mut unreflected = Vec::new();
        let (published, allocated) = self.usage_into(node, own_claims, &mut unreflected);
        NodeUsage {
            published: published.map(|p| PublishedCapacity {
                pools: p.pools.to_vec(),
                managed: p.managed,
                alignment: p.alignment,
                free: p.free,
                overhead: p.overhead,
            }),
            allocated,
            unreflected,
        }
    }

    /// [`CapacityIndex::usage`] without allocating: the node's id and published capacity by
    /// reference, the allocated bytes, and the unreflected sizes appended to `unreflected` (the
    /// extender's /filter asks for thousands of nodes per call).
    #[inline]
    pub fn usage_into(
        &self,
        node: &str,
        own_claims: &[ClaimKey],
        unreflected: &mut Vec<u64>,
    ) -> (Option<Published<'_>>, u64) {
        self.usage_of(self.node(node), own_claims, unreflected)
    }

    /// The index's entry of `node`, looked up once for several questions (/filter asks about
    /// thousands of nodes per call); `None` for a node the index has not seen.
    #[inline]
    pub fn node(&self, node: &str) -> Option<NodeRef<'_>> {
        self.nodes.get(node).map(NodeRef)
    }

    /// [`CapacityIndex::node`] by id.
    #[inline]
    pub fn node_by_id(&self, id: NodeId) -> Option<NodeRef<'_>> {
        self.nodes.get_at(id.0).map(NodeRef)
    }

    /// [`CapacityIndex::usage_into`] of a node already looked up.
    #[inline]
    pub fn usage_of<'a>(
        &'a self,
        node: Option<NodeRef<'a>>,
        own_claims: &[ClaimKey],
        unreflected: &mut Vec<u64>,
    ) -> (Option<Published<'a>>, u64) {
        let entry = node.map(|n| n.0);
        let record = entry.and_then(|e| e.capacity.as_ref());
        let alignment = record.map(|r| r.published.alignment).unwrap_or(1);
        let overhead = record.and_then(|r| r.published.overhead);
        let from = unreflected.len();
        let mut allocated = 0u64;
        for key in entry.map(|e| &e.volumes).into_iter().flatten() {
            if let VolumeKey::Claim(claim) = key
                && own_claims.contains(claim)
            {
                continue;
            }
            let Some(allocation) = self.allocations.get(key) else {
                continue;
            };
            let size =
                volume_cost(allocation.size, alignment, overhead.as_ref()).unwrap_or(u64::MAX);
            allocated = allocated.saturating_add(size);
            match record {
                // Published with its old size: a growth since is not in the pools yet.
                Some(r) if allocation.seq <= r.seq => {
                    if let Some(growth) = allocation.growth
                        && growth.seq > r.seq
                    {
                        let before = volume_cost(growth.from, alignment, overhead.as_ref())
                            .unwrap_or(u64::MAX);
                        unreflected.push(size.saturating_sub(before));
                    }
                }
                _ => unreflected.push(size),
            }
        }
        // Event order alone can call a volume unreflected that the node did publish (its PV seen
        // after the publication that counted it), and on a node that then changes no more it
        // stays so, hiding a free slot for good. The node's own numbers bound it: it published
        // `managed − free` as allocated, so no more than the index's excess over that can be
        // missing from its pools. (Volumes the index does not know, such as orphans, make this
        // optimistic; the cap view still holds.)
        if let Some(r) = record
            && let Some(managed) = r.published.managed
        {
            let mut excess = allocated.saturating_sub(managed.saturating_sub(r.published.free));
            let mut kept = from;
            for i in from..unreflected.len() {
                let size = unreflected[i];
                if size <= excess {
                    excess -= size;
                    unreflected[kept] = size;
                    kept += 1;
                }
            }
            unreflected.truncate(kept);
        }
        let id = entry.map(|e| e.id);
        (record.zip(id).map(|(r, id)| r.view(id)), allocated)
    }

    /// The id of a node the index has seen (capacity or allocations), if any.
    #[inline]
    pub fn node_id(&self, node: &str) -> Option<NodeId> {
        // The id is the slot: the lookup need not touch the entry.
        self.nodes.slot(node).map(NodeId)
    }

    /// The id of `node`, assigned now when the index has not seen it yet (a pod bound to a
    /// node that has not published: its reservations must count once it does).
    pub fn intern_node(&mut self, node: &str) -> NodeId {
        self.entry(node).id
    }

    /// The name of the node with `id`, while the index keeps it.
    pub fn node_name(&self, id: NodeId) -> Option<&str> {
        self.nodes.name_at(id.0)
    }

    /// Forgets the nodes that hold nothing any more: no published capacity, no allocation, and
    /// not `held` (the nodes reservations are held on, whose ids must stay stable). Without
    /// this, every node name ever seen (nodes replaced under new names, selected-node values of
    /// deleted claims) would stay for the extender's lifetime. Returns how many were forgotten.
    pub fn forget_idle_nodes(&mut self, held: impl Fn(NodeId) -> bool) -> usize {
        let idle: Vec<String> = self
            .nodes
            .iter()
            .filter(|(_, e)| e.capacity.is_none() && e.volumes.is_empty() && !held(e.id))
            .map(|(name, _)| name.to_owned())
            .collect();
        for name in &idle {
            if let Some(slot) = self
                .node_id(name)
                .and_then(|id| self.settled.get_mut(id.index()))
            {
                *slot = None;
            }
            self.nodes.remove(name);
        }
        idle.len()
    }

    /// How many nodes the index keeps (published or not).
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// The entry of `node`, created with a fresh id when absent. An entry stays while the node
    /// has capacity, allocations or reservations ([`CapacityIndex::forget_idle_nodes`]), so its
    /// id is stable for as long as anything refers to it.
    fn entry(&mut self, node: &str) -> &mut NodeEntry {
        self.nodes.get_or_insert_with(node, |slot| NodeEntry {
            id: NodeId(slot),
            capacity: None,
            volumes: HashSet::new(),
        })
    }

    /// Names of the nodes that published capacity.
    pub fn nodes(&self) -> impl Iterator<Item = &str> {
        self.nodes
            .iter()
            .filter(|(_, e)| e.capacity.is_some())
            .map(|(name, _)| name)
    }

    fn bump(&mut self) {
        self.seq += 1;
    }

    /// (node, bytes) of the PV filed under `key`, if any.
    fn filed_volume(&self, key: &VolumeKey) -> Option<(String, u64)> {
        let record = self.pvs.get(self.volumes.get(key)?)?;
        Some((record.node.clone(), record.size))
    }

    /// Recomputes the allocation of `key` from its sources, and what is derived from it.
    fn derive(&mut self, key: &VolumeKey) {
        let before = self.allocations.get(key).map(|a| a.node.clone());
        self.derive_allocation(key);
        let after = self.allocations.get(key).map(|a| a.node.clone());
        for node in before
            .iter()
            .chain(after.iter().filter(|a| Some(*a) != before.as_ref()))
        {
            self.refresh_settled(node);
        }
    }

    fn derive_allocation(&mut self, key: &VolumeKey) {
        let (wanted, bound) = match key {
            VolumeKey::Claim(claim) => match self.filed_volume(key) {
                // A bound claim asking for more than its PV holds is being expanded: the room
                // the growth needs counts from the moment the claim asks (the resizer raises
                // the PV's size next, and the node grows the volume later still).
                // A growth the node refused (no room) counts no more: the room it would need
                // does not exist, and counting it would turn every new volume away from the node.
                Some((node, size)) => {
                    let asked = self
                        .claims
                        .get(claim)
                        .filter(|c| !c.growth_failed)
                        .and_then(|c| c.request);
                    (Some((node, size.max(asked.unwrap_or(0)))), true)
                }
                // Bound claims count too while their PV is unseen: the binder's update of the
                // claim arrives on another watch than the PV's creation and can overtake it,
                // and a claim counting nowhere in between let a /filter over-commit the node.
                None => (
                    self.claims
                        .get(claim)
                        .filter(|c| self.is_late_binding_ours(c))
                        .and_then(|c| {
                            let node = c.selected_node.clone()?;
                            Some((node, c.request.unwrap_or(self.default_size)))
                        }),
                    false,
                ),
            },
            VolumeKey::Volume(_) => (self.filed_volume(key), true),
            VolumeKey::Inline { pod_uid, volume } => (
                self.pods.get(pod_uid).and_then(|p| {
                    let node = p.node.clone().filter(|_| !p.terminated)?;
                    let (_, size) = p.inline.iter().find(|(v, _)| v == volume)?;
                    Some((node, *size))
                }),
                false,
            ),
        };
        let current = self.allocations.get(key).map(|a| (a.node.clone(), a.size));
        if current == wanted {
            // A claim's PV appearing with the claim's size: the same allocation, now a PV's.
            if let Some(allocation) = self.allocations.get_mut(key) {
                allocation.bound = bound;
            }
            return;
        }
        // A volume that stays on its node (a claim whose PV appears, with the size the node
        // really allocated) is as reflected as before: a new number would count it twice in
        // the pool view until the node happened to publish again.
        let seq = match (self.allocations.get(key), &wanted) {
            (Some(old), Some((node, _))) if old.node == *node => old.seq,
            _ => self.seq,
        };
        let growth = match (self.allocations.get(key), &wanted) {
            (Some(old), Some((node, size))) if old.node == *node && old.bound && bound => {
                // The base is the size the node last published with: the old size, or the
                // base of an earlier growth it has not published yet.
                let published_at = self
                    .nodes
                    .get(node)
                    .and_then(|e| e.capacity.as_ref())
                    .map_or(0, |r| r.seq);
                let pending = old.growth.filter(|g| g.seq > published_at);
                let from = pending.map_or(old.size, |g| g.from.min(old.size));
                if *size > from {
                    Some(Growth {
                        from,
                        seq: if *size > old.size {
                            self.seq
                        } else {
                            pending.map_or(self.seq, |g| g.seq)
                        },
                    })
                } else {
                    None
                }
            }
            _ => None,
        };
        if let Some(old) = self.allocations.remove(key)
            && let Some(entry) = self.nodes.get_mut(&old.node)
        {
            entry.volumes.remove(key);
        }
        if let Some((node, size)) = wanted {
            self.entry(&node).volumes.insert(key.clone());
            self.allocations.insert(
                key.clone(),
                Allocation {
                    node,
                    size,
                    seq,
                    bound,
                    growth,
                },
            );
        }
    }
}

/// The index answers a pod's lookups from what its watches have seen (no request ever waits
/// for the apiserver on the /filter path).
impl Lookup for CapacityIndex {
    async fn claims(&self, keys: Vec<ClaimKey>) -> Vec<(ClaimKey, Option<ClaimFacts>)> {
        keys.into_iter()
            .map(|key| {
                let found = self.claim(&key).cloned();
                (key, found)
            })
            .collect()
    }

    async fn classes(&self, names: Vec<String>) -> Vec<(String, Option<ClassFacts>)> {
        names
            .into_iter()
            .map(|name| {
                let found = self.class(&name).cloned();
                (name, found)
            })
            .collect()
    }

    async fn default_class(&self) -> Option<ClassFacts> {
        CapacityIndex::default_class(self).cloned()
    }
}

/// Rounds `size` up to a multiple of `alignment` (saturating).
pub fn align(size: u64, alignment: u64) -> u64 {
    if alignment <= 1 {
        return size;
    }
    size.div_ceil(alignment).saturating_mul(alignment)
}

/// Reads a capacity object of `driver` into plain numbers.
pub fn published_capacity(driver: &str, object: &CSIStorageCapacity) -> PublishedCapacity {
    let annotations = object.metadata.annotations.as_ref();
    let annotation =
        |name: &str| annotations.and_then(|a| a.get(&capacity_annotation(driver, name)));
    let capacity = object
        .capacity
        .as_ref()
        .and_then(|q| controllers::quantity::parse_bytes(&q.0).ok())
        .unwrap_or(0);
    let mut pools: Vec<u64> = annotation(FREE_EXTENTS)
        .map(|list| {
            list.split(',')
                .filter(|s| !s.trim().is_empty())
                .filter_map(|s| s.trim().parse().ok())
                .collect()
        })
        .unwrap_or_else(|| vec![capacity]);
    pools.sort_unstable_by(|a, b| b.cmp(a));
    PublishedCapacity {
        pools,
        free: capacity,
        managed: annotation(MANAGED_BYTES).and_then(|v| v.parse().ok()),
        alignment: annotation(ALIGNMENT_BYTES)
            .and_then(|v| v.parse().ok())
            .filter(|a| *a > 0)
            .unwrap_or(1),
        overhead: annotation(VOLUME_OVERHEAD).and_then(|v| match v.parse() {
            Ok(overhead) => Some(overhead),
            Err(e) => {
                // Charging no overhead would let the fit admit what the node refuses; the cap
                // view and the node's own ResourceExhausted still hold.
                tracing::warn!("{e}; the node's volumes are charged without it");
                None
            }
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use controllers::test_objects::{
        DRIVER, GI, capacity, inline_pod, managed_capacity, sized_claim, storage_class, volume,
    };

    #[test]
    fn published_overhead_is_read_and_a_malformed_one_ignored() {
        let mut object = capacity("c-n1", "n1", "2Gi", None);
        let annotations = object
            .metadata
            .annotations
            .get_or_insert_with(Default::default);
        annotations.insert(
            format!("{DRIVER}/volume-overhead"),
            VolumeOverhead::FSDAX_MAP_DEV.to_string(),
        );
        assert_eq!(
            published_capacity(DRIVER, &object).overhead,
            Some(VolumeOverhead::FSDAX_MAP_DEV)
        );
        let annotations = object
            .metadata
            .annotations
            .get_or_insert_with(Default::default);
        annotations.insert(format!("{DRIVER}/volume-overhead"), "per-page=lots".into());
        assert_eq!(published_capacity(DRIVER, &object).overhead, None);
        let plain = capacity("c-n1", "n1", "2Gi", None);
        assert_eq!(published_capacity(DRIVER, &plain).overhead, None);
    }

    fn index() -> CapacityIndex {
        let mut index = CapacityIndex::new(DRIVER, GI);
        index.apply_class(&storage_class("late", DRIVER, "WaitForFirstConsumer"));
        index.apply_class(&storage_class("now", DRIVER, "Immediate"));
        index.apply_class(&storage_class(
            "theirs",
            "other.example.com",
            "WaitForFirstConsumer",
        ));
        index
    }

    fn counted_on<'a>(index: &'a CapacityIndex, claim: &str) -> Option<&'a str> {
        index.counted_on(&VolumeKey::Claim(ClaimKey::new("ns", claim)))
    }

    #[test]
    fn claims_count_on_their_selected_node_only_when_ours() {
        let mut index = index();
        for (name, object, counts) in [
            (
                "late, selected",
                sized_claim("a", "late", "1Gi", Some("n1"), None),
                true,
            ),
            (
                "late, not selected",
                sized_claim("b", "late", "1Gi", None, None),
                false,
            ),
            (
                "immediate",
                sized_claim("c", "now", "1Gi", Some("n1"), None),
                false,
            ),
            (
                "another driver's",
                sized_claim("d", "theirs", "1Gi", Some("n1"), None),
                false,
            ),
            (
                "bound, its PV not seen yet",
                sized_claim("e", "late", "1Gi", Some("n1"), Some("pv-e")),
                true,
            ),
        ] {
            index.apply_claim(&object);
            let key = object.metadata.name.as_deref().unwrap_or_default();
            assert_eq!(counted_on(&index, key).is_some(), counts, "{name}");
        }
        assert_eq!(index.usage("n1", &[]).allocated, 2 * GI);
        assert_eq!(
            index.usage("n1", &[ClaimKey::new("ns", "a")]).allocated,
            GI,
            "the filtered pod's own claims are its demand, not allocations"
        );
        index.delete_claim(&ClaimKey::new("ns", "a"));
        assert_eq!(index.usage("n1", &[]).allocated, GI);
        let mut deleting = sized_claim("e", "late", "1Gi", Some("n1"), Some("pv-e"));
        deleting.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
        );
        index.apply_claim(&deleting);
        assert_eq!(index.usage("n1", &[]).allocated, 0, "being deleted");
    }

    #[test]
    fn claim_and_its_volume_count_once_across_binding() {
        let mut index = index();
        index.apply_claim(&sized_claim("a", "late", "1Gi", Some("n1"), None));
        // The provisioner creates the PV before the binder updates the claim.
        index.apply_volume(&volume("pv-a", "n1", "2Gi", Some("a")));
        assert_eq!(
            index.usage("n1", &[]).allocated,
            2 * GI,
            "the PV's real size wins"
        );
        index.apply_claim(&sized_claim("a", "late", "1Gi", Some("n1"), Some("pv-a")));
        assert_eq!(index.usage("n1", &[]).allocated, 2 * GI);
        assert_eq!(counted_on(&index, "a"), Some("n1"));
        // Claim deleted, PV still there (reclaim pending): still allocated.
        index.delete_claim(&ClaimKey::new("ns", "a"));
        assert_eq!(index.usage("n1", &[]).allocated, 2 * GI);
        index.delete_volume("pv-a");
        assert_eq!(index.usage("n1", &[]), NodeUsage::default());
        // A PV without claim, and one of another node.
        index.apply_volume(&volume("pv-x", "n1", "1Gi", None));
        index.apply_volume(&volume("pv-y", "n2", "1Gi", None));
        assert_eq!(index.usage("n1", &[]).allocated, GI);
    }

    #[test]
    fn a_bound_claim_counts_until_its_late_volume_arrives() {
        // The binder's claim update overtook the PV's creation event.
        let mut index = index();
        index.apply_claim(&sized_claim("a", "late", "1Gi", Some("n1"), None));
        index.apply_claim(&sized_claim("a", "late", "1Gi", Some("n1"), Some("pv-a")));
        assert_eq!(index.usage("n1", &[]).allocated, GI, "no gap");
        index.apply_volume(&volume("pv-a", "n1", "1028Mi", Some("a")));
        assert_eq!(index.usage("n1", &[]).allocated, 1028 << 20);
    }

    #[test]
    fn a_volume_replacing_its_claim_on_the_same_node_stays_reflected() {
        let mut index = index();
        index.apply_claim(&sized_claim("a", "late", "1Gi", Some("n1"), None));
        index.apply_capacity(&capacity("cap-n1", "n1", "9Gi", None));
        assert!(index.usage("n1", &[]).unreflected.is_empty());
        // The PV carries the size the node really allocated: same volume, same node.
        index.apply_volume(&volume("pv-a", "n1", "1028Mi", Some("a")));
        let usage = index.usage("n1", &[]);
        assert_eq!(usage.allocated, 1028 << 20);
        assert!(usage.unreflected.is_empty(), "{usage:?}");
        // Moved to another node (a rescheduled claim's new PV): not reflected there yet.
        index.apply_capacity(&capacity("cap-n2", "n2", "10Gi", None));
        index.apply_volume(&volume("pv-a", "n2", "1028Mi", Some("a")));
        assert_eq!(index.usage("n2", &[]).unreflected, vec![1028 << 20]);
    }

    #[test]
    fn a_growing_volume_counts_its_new_size_until_the_node_publishes_it() {
        let mut index = index();
        index.apply_claim(&sized_claim("a", "late", "1Gi", Some("n1"), Some("pv-a")));
        index.apply_volume(&volume("pv-a", "n1", "1Gi", Some("a")));
        index.apply_capacity(&managed_capacity(
            "cap-n1",
            "n1",
            "9Gi",
            None,
            Some(10 * GI),
        ));
        let usage = index.usage("n1", &[]);
        assert_eq!((usage.allocated, usage.unreflected.len()), (GI, 0));
        // The user asks for 3 GiB: counted at once, the 2 GiB more not in the pools yet.
        index.apply_claim(&sized_claim("a", "late", "3Gi", Some("n1"), Some("pv-a")));
        let usage = index.usage("n1", &[]);
        assert_eq!(usage.allocated, 3 * GI);
        assert_eq!(usage.unreflected, vec![2 * GI]);
        // The resizer raises the PV: still the same growth.
        index.apply_volume(&volume("pv-a", "n1", "3Gi", Some("a")));
        let usage = index.usage("n1", &[]);
        assert_eq!(usage.allocated, 3 * GI);
        assert_eq!(usage.unreflected, vec![2 * GI]);
        // The node grows the volume and publishes: nothing is missing from its pools.
        index.apply_capacity(&managed_capacity(
            "cap-n1",
            "n1",
            "7Gi",
            None,
            Some(10 * GI),
        ));
        let usage = index.usage("n1", &[]);
        assert_eq!((usage.allocated, usage.unreflected.len()), (3 * GI, 0));
        // A growth the node refuses (kubelet marks the claim) counts no more.
        let mut refused = sized_claim("a", "late", "9Gi", Some("n1"), Some("pv-a"));
        refused.status = Some(k8s_openapi::api::core::v1::PersistentVolumeClaimStatus {
            allocated_resource_statuses: Some(
                [("storage".to_string(), "NodeResizeInfeasible".to_string())].into(),
            ),
            ..Default::default()
        });
        index.apply_claim(&refused);
        assert_eq!(index.usage("n1", &[]).allocated, 3 * GI);
        // A claim's PV arriving with its aligned size is not a growth.
        index.apply_claim(&sized_claim("b", "late", "1Gi", Some("n1"), None));
        index.apply_capacity(&managed_capacity(
            "cap-n1",
            "n1",
            "6Gi",
            None,
            Some(10 * GI),
        ));
        index.apply_volume(&volume("pv-b", "n1", "1028Mi", Some("b")));
        assert!(index.usage("n1", &[]).unreflected.is_empty());
    }

    #[test]
    fn the_published_numbers_bound_what_is_unreflected() {
        // 10 GiB managed; `free` published after `before` claims were selected, then `after`.
        for (name, before, free, after, want) in [
            ("all selected before the publication", 2, "8Gi", 0, vec![]),
            ("one selected after it", 1, "9Gi", 1, vec![GI]),
            ("two after it, one already created", 0, "9Gi", 2, vec![GI]),
            ("three after it, two already created", 0, "8Gi", 3, vec![GI]),
            (
                "three after it, none created",
                0,
                "10Gi",
                3,
                vec![GI, GI, GI],
            ),
        ] {
            let mut index = index();
            for i in 0..before {
                index.apply_claim(&sized_claim(
                    &format!("b{i}"),
                    "late",
                    "1Gi",
                    Some("n1"),
                    None,
                ));
            }
            index.apply_capacity(&capacity("cap-n1", "n1", free, None));
            for i in 0..after {
                index.apply_claim(&sized_claim(
                    &format!("a{i}"),
                    "late",
                    "1Gi",
                    Some("n1"),
                    None,
                ));
            }
            assert_eq!(index.usage("n1", &[]).unreflected, want, "{name}");
        }
    }

    #[test]
    fn a_volume_of_an_earlier_claim_of_the_same_name_counts_apart() {
        let with_uid = |mut pv: PersistentVolume, uid: &str| {
            if let Some(r) = pv.spec.as_mut().and_then(|s| s.claim_ref.as_mut()) {
                r.uid = Some(uid.into());
            }
            pv
        };
        let new_claim = || {
            let mut c = sized_claim("a", "late", "1Gi", Some("n2"), None);
            c.metadata.uid = Some("u2".into());
            c
        };
        // Either order: the retained PV of the old claim (u1) on n1, the new claim on n2.
        for pv_first in [true, false] {
            let mut index = index();
            let old = with_uid(volume("pv-old", "n1", "1Gi", Some("a")), "u1");
            if pv_first {
                index.apply_volume(&old);
                index.apply_claim(&new_claim());
            } else {
                index.apply_claim(&new_claim());
                index.apply_volume(&old);
            }
            assert_eq!(index.usage("n1", &[]).allocated, GI, "the old volume stays");
            assert_eq!(index.usage("n2", &[]).allocated, GI, "the new claim");
            assert_eq!(counted_on(&index, "a"), Some("n2"), "pv first: {pv_first}");
            // The new claim's own PV on n2: counted once there.
            index.apply_volume(&with_uid(volume("pv-new", "n2", "1Gi", Some("a")), "u2"));
            assert_eq!(index.usage("n2", &[]).allocated, GI);
            assert_eq!(index.usage("n1", &[]).allocated, GI);
            index.delete_volume("pv-old");
            assert_eq!(index.usage("n1", &[]).allocated, 0);
            assert_eq!(counted_on(&index, "a"), Some("n2"));
        }
    }

    #[test]
    fn the_bound_reads_free_bytes_over_all_pools() {
        // 4 GiB managed, 2096 MiB of it allocated when the node published 2000 MiB free in 20
        // pools of 100 MiB, of which free-extents lists 16 (1600 MiB).
        let extents = vec![(100u64 << 20).to_string(); 16].join(",");
        let mut index = index();
        index.apply_claim(&sized_claim("b", "late", "2096Mi", Some("n1"), None));
        index.apply_capacity(&managed_capacity(
            "cap-n1",
            "n1",
            "2000Mi",
            Some(&extents),
            Some(4 * GI),
        ));
        index.apply_claim(&sized_claim("a", "late", "1Gi", Some("n1"), None));
        // Read from the 16 listed pools, the node would seem to have allocated 2496 MiB and the
        // new claim would be dropped as already published.
        assert_eq!(index.usage("n1", &[]).unreflected, vec![GI]);
    }

    #[test]
    fn a_late_class_makes_existing_claims_count() {
        let mut index = CapacityIndex::new(DRIVER, GI);
        index.apply_claim(&sized_claim("a", "late", "1Gi", Some("n1"), None));
        assert_eq!(
            index.usage("n1", &[]).allocated,
            0,
            "class unknown, no annotation"
        );
        index.apply_class(&storage_class("late", DRIVER, "WaitForFirstConsumer"));
        assert_eq!(index.usage("n1", &[]).allocated, GI);
    }

    #[test]
    fn inline_volumes_count_while_the_pod_runs_on_a_node() {
        let mut index = index();
        assert!(!index.apply_pod(&inline_pod("u1", None, "Pending")));
        assert_eq!(index.usage("n1", &[]).allocated, 0, "not bound yet");
        assert!(index.apply_pod(&inline_pod("u1", Some("n1"), "Pending")));
        assert_eq!(
            index.usage("n1", &[]).allocated,
            2 * GI,
            "only our driver's volume"
        );
        index.apply_pod(&inline_pod("u1", Some("n1"), "Succeeded"));
        assert_eq!(index.usage("n1", &[]).allocated, 0, "terminated");
        index.apply_pod(&inline_pod("u1", Some("n1"), "Running"));
        index.delete_pod("u1");
        assert_eq!(index.usage("n1", &[]).allocated, 0);
        // A pod without our volumes is not kept at all.
        let mut plain = inline_pod("u2", Some("n1"), "Running");
        if let Some(spec) = plain.spec.as_mut() {
            spec.volumes = None;
        }
        index.apply_pod(&plain);
        assert!(index.pods.is_empty());
    }

    #[test]
    fn capacity_objects_and_unreflected_allocations() {
        let mut index = index();
        index.apply_claim(&sized_claim("a", "late", "1Gi", Some("n1"), None));
        let usage = index.usage("n1", &[]);
        assert_eq!((usage.published, usage.unreflected), (None, vec![GI]));
        index.apply_capacity(&managed_capacity(
            "cap-n1-c",
            "n1",
            "3Gi",
            Some("1073741824,2147483648"),
            Some(4 * GI),
        ));
        let usage = index.usage("n1", &[]);
        let published = usage.published.clone().expect("published");
        assert_eq!(published.pools, vec![2 * GI, GI], "largest first");
        assert_eq!(
            (published.managed, published.alignment),
            (Some(4 * GI), 4 << 20)
        );
        assert!(
            usage.unreflected.is_empty(),
            "published after the claim was selected"
        );
        index.apply_claim(&sized_claim("b", "late", "1Gi", Some("n1"), None));
        assert_eq!(index.usage("n1", &[]).unreflected, vec![GI]);
        // The same content again (another class's object) changes nothing.
        index.apply_capacity(&managed_capacity(
            "cap-n1-d",
            "n1",
            "3Gi",
            Some("1073741824,2147483648"),
            Some(4 * GI),
        ));
        assert_eq!(index.usage("n1", &[]).unreflected, vec![GI]);
        index.apply_capacity(&managed_capacity(
            "cap-n1-c",
            "n1",
            "2Gi",
            None,
            Some(4 * GI),
        ));
        let usage = index.usage("n1", &[]);
        assert!(usage.unreflected.is_empty());
        assert_eq!(usage.published.map(|p| p.pools), Some(vec![2 * GI]));
        index.delete_capacity("cap-n1-c");
        assert!(
            index.usage("n1", &[]).published.is_some(),
            "one object left"
        );
        index.delete_capacity("cap-n1-d");
        assert!(index.usage("n1", &[]).published.is_none());
        // Another driver's object is ignored.
        let mut theirs = capacity("x", "n2", "1Gi", None);
        theirs.metadata.labels = None;
        index.apply_capacity(&theirs);
        assert_eq!(index.nodes().count(), 0);
    }

    #[test]
    fn a_node_is_settled_while_its_pools_reflect_every_allocation() {
        use controllers::test_objects::published_capacity;
        const MI: u64 = 1 << 20;
        let mut index = index();
        let publish = |index: &mut CapacityIndex, pools: &[u64]| {
            index.apply_capacity(&published_capacity(
                "default",
                DRIVER,
                "n1",
                "late",
                pools,
                4 * GI,
            ))
        };
        let settled = |index: &CapacityIndex| {
            index
                .node_id("n1")
                .and_then(|id| index.settled(id))
                .map(|s| (s.pools().to_vec(), s.cap()))
        };
        assert_eq!(settled(&index), None, "unknown");
        publish(&mut index, &[3 * GI, GI]);
        assert_eq!(
            settled(&index),
            Some((vec![3 * GI, GI], 4 * GI)),
            "published"
        );
        index.apply_claim(&sized_claim("a", "late", "512Mi", Some("n1"), None));
        assert_eq!(settled(&index), None, "an allocation the pools do not show");
        publish(&mut index, &[3 * GI - 512 * MI, GI]);
        assert_eq!(
            settled(&index),
            Some((vec![3 * GI - 512 * MI, GI], 4 * GI - 512 * MI)),
            "published again, showing it"
        );
        index.apply_claim(&sized_claim("a", "late", "512Mi", Some("n2"), None));
        assert_eq!(
            settled(&index).map(|(_, cap)| cap),
            Some(4 * GI),
            "moved away (cap view only: the pools show it until the node publishes)"
        );
        index.delete_capacity(&controllers::well_known::capacity_object_name("n1", "late"));
        assert_eq!(settled(&index), None, "capacity deleted");
        publish(&mut index, &[GI; 5]);
        assert_eq!(settled(&index), None, "more pools than held inline");
        publish(&mut index, &[GI; 4]);
        assert_eq!(settled(&index), Some((vec![GI; 4], 4 * GI)));
    }

    #[test]
    fn node_ids_are_stable_per_name() {
        let mut index = index();
        assert_eq!(index.node_id("n1"), None);
        index.apply_capacity(&capacity("cap-n1-c", "n1", "3Gi", None));
        index.apply_capacity(&capacity("cap-n2-c", "n2", "3Gi", None));
        let (n1, n2) = (index.node_id("n1"), index.node_id("n2"));
        assert!(n1.is_some() && n2.is_some() && n1 != n2);
        assert_eq!(
            index.usage_into("n1", &[], &mut Vec::new()).0.map(|p| p.id),
            n1
        );
        // Updates and a second object keep the id.
        index.apply_capacity(&capacity("cap-n1-c", "n1", "1Gi", None));
        index.apply_capacity(&capacity("cap-n1-d", "n1", "1Gi", None));
        index.delete_capacity("cap-n1-c");
        assert_eq!(index.node_id("n1"), n1);
        // Gone and back (a class recreated): the same id, so reservations on it still count.
        index.delete_capacity("cap-n1-d");
        assert!(index.usage_into("n1", &[], &mut Vec::new()).0.is_none());
        assert_eq!(index.node_id("n1"), n1);
        index.apply_capacity(&capacity("cap-n1-c", "n1", "3Gi", None));
        assert_eq!(index.node_id("n1"), n1);
        // A node first seen through a bound pod gets an id its later capacity keeps.
        let n3 = index.intern_node("n3");
        assert!(Some(n3) != n1 && Some(n3) != n2);
        assert_eq!(index.intern_node("n3"), n3);
        index.apply_capacity(&capacity("cap-n3-c", "n3", "3Gi", None));
        assert_eq!(
            index.usage_into("n3", &[], &mut Vec::new()).0.map(|p| p.id),
            Some(n3)
        );
    }

    #[test]
    fn align_table() {
        for (size, alignment, want) in [
            (0, 4, 0),
            (1, 4, 4),
            (4, 4, 4),
            (5, 1, 5),
            (5, 0, 5),
            (u64::MAX, 4 << 20, u64::MAX - (4 << 20) + 1),
        ] {
            let got = align(size, alignment);
            assert!(got >= size.min(u64::MAX - (4 << 20)), "{size} {alignment}");
            if size != u64::MAX {
                assert_eq!(got, want, "{size} {alignment}");
            }
        }
    }
}
