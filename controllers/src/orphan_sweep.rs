//! The node's orphan sweep: a volume created for a claim that went elsewhere — the claim was
//! deleted, bound to another volume, or rescheduled to another node while this node was cut
//! off — is deleted once it is older than `--orphan-grace`, so that rescheduling after a lost
//! node never leaks capacity. The decision is pure; the sweep around it reads the cluster.
//!
//! Cost: every node runs a sweep, so it must not grow with the cluster. The PVs of this driver
//! come from one watch (listed in pages once, then only changes), kept as [`PvIndex`]: name,
//! handle and node of each, about 100 bytes per PV. A volume a PV refers to is kept without
//! further reads; only the others (normally none) cost a GET of their claim, uncached, because
//! a deletion must not act on a stale claim.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::volume_facts::pv_node;
use crate::well_known::SELECTED_NODE;

/// Why a volume stays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepReason {
    /// Its state names no claim (inline volumes, volumes created without extra metadata).
    NoClaimRecorded,
    /// Younger than the grace: its PV may still be on its way.
    Young,
    /// A PV refers to it.
    Referenced,
    /// Its claim is still pending for this node.
    ClaimPendingHere,
}

/// Why a volume goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrphanReason {
    /// The claim no longer exists.
    ClaimGone,
    /// The claim is bound to another volume.
    BoundElsewhere,
    /// The claim is selected for another node.
    SelectedElsewhere,
}

impl OrphanReason {
    /// Stable text for logs and events.
    pub fn as_str(self) -> &'static str {
        match self {
            OrphanReason::ClaimGone => "claim-gone",
            OrphanReason::BoundElsewhere => "claim-bound-elsewhere",
            OrphanReason::SelectedElsewhere => "claim-selected-elsewhere",
        }
    }
}

/// The sweep's decision about one volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrphanVerdict {
    /// Keep it.
    Keep(KeepReason),
    /// Delete it.
    Delete(OrphanReason),
}

/// What the claim of a volume looks like now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimNow {
    /// `spec.volumeName`.
    pub volume_name: Option<String>,
    /// Whether the PV the claim is bound to is this node's volume (same handle and this node
    /// in its node affinity), if that PV exists. PV names and volume IDs both derive from the
    /// claim's UID, so two nodes provisioning one claim after a partition hold volumes of the
    /// same ID recorded under the same PV name: only the PV's node tells them apart.
    pub bound_here: Option<bool>,
    /// The selected-node annotation.
    pub selected_node: Option<String>,
}

/// What the sweep knows about one volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeFacts {
    /// Time since creation.
    pub age: Duration,
    /// `csi.storage.k8s.io/pvc/{namespace,name}` from its state.
    pub claim: Option<(String, String)>,
    /// `csi.storage.k8s.io/pv/name` from its state.
    pub pv_name: Option<String>,
    /// Some PV of this driver has this volume's handle.
    pub referenced: bool,
    /// The claim as it is now (`None`: gone).
    pub claim_now: Option<ClaimNow>,
}

/// Decides about volume `id` of `node`.
pub fn judge(v: &VolumeFacts, node: &str, grace: Duration) -> OrphanVerdict {
    if v.claim.is_none() {
        return OrphanVerdict::Keep(KeepReason::NoClaimRecorded);
    }
    if v.age < grace {
        return OrphanVerdict::Keep(KeepReason::Young);
    }
    if v.referenced {
        return OrphanVerdict::Keep(KeepReason::Referenced);
    }
    let Some(claim) = &v.claim_now else {
        return OrphanVerdict::Delete(OrphanReason::ClaimGone);
    };
    if let Some(bound) = claim.volume_name.as_deref().filter(|b| !b.is_empty()) {
        match claim.bound_here {
            Some(false) => return OrphanVerdict::Delete(OrphanReason::BoundElsewhere),
            Some(true) => return OrphanVerdict::Keep(KeepReason::Referenced),
            None if Some(bound) != v.pv_name.as_deref() => {
                return OrphanVerdict::Delete(OrphanReason::BoundElsewhere);
            }
            None => {}
        }
    }
    if claim.selected_node.as_deref().is_some_and(|n| n != node) {
        return OrphanVerdict::Delete(OrphanReason::SelectedElsewhere);
    }
    OrphanVerdict::Keep(KeepReason::ClaimPendingHere)
}

/// What the sweep keeps of one PV of this driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PvFacts {
    /// The CSI volume handle.
    pub handle: String,
    /// The node of its node affinity (`<driver>/node`), if it has one.
    pub node: Option<String>,
}

impl PvFacts {
    /// What the sweep keeps of `pv`; `None` for PVs of other drivers.
    pub fn of(pv: &PersistentVolume, driver: &str) -> Option<PvFacts> {
        let spec = pv.spec.as_ref()?;
        let handle = spec
            .csi
            .as_ref()
            .filter(|c| c.driver == driver)?
            .volume_handle
            .clone();
        Some(PvFacts {
            handle,
            node: pv_node(pv, driver),
        })
    }

    /// Whether this PV is volume `id` of `node`. A PV without node affinity is taken to mean
    /// this node: never delete on a guess.
    pub fn is_volume_of(&self, id: &str, node: &str) -> bool {
        self.handle == id && self.node.as_deref().is_none_or(|n| n == node)
    }
}

/// The PVs of this driver by name, and their names by handle.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PvIndex {
    by_name: HashMap<String, PvFacts>,
    by_handle: HashMap<String, HashSet<String>>,
}

impl PvIndex {
    /// Adds or replaces PV `name`.
    pub fn apply(&mut self, name: &str, facts: PvFacts) {
        self.delete(name);
        self.by_handle
            .entry(facts.handle.clone())
            .or_default()
            .insert(name.to_owned());
        self.by_name.insert(name.to_owned(), facts);
    }

    /// Removes PV `name`.
    pub fn delete(&mut self, name: &str) {
        let Some(old) = self.by_name.remove(name) else {
            return;
        };
        if let Some(names) = self.by_handle.get_mut(&old.handle) {
            names.remove(name);
            if names.is_empty() {
                self.by_handle.remove(&old.handle);
            }
        }
    }

    /// PV `name`, if it is one of this driver's.
    pub fn get(&self, name: &str) -> Option<&PvFacts> {
        self.by_name.get(name)
    }

    /// Whether some PV is volume `id` of `node`.
    pub fn references(&self, id: &str, node: &str) -> bool {
        self.by_handle.get(id).is_some_and(|names| {
            names
                .iter()
                .filter_map(|n| self.by_name.get(n))
                .any(|pv| pv.is_volume_of(id, node))
        })
    }

    /// How many PVs it holds.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

/// One of this node's volumes, as the sweep sees it.
#[derive(Clone, Debug)]
pub struct SweepCandidate {
    /// Volume ID (the PV's volume handle).
    pub id: String,
    /// Time since creation.
    pub age: Duration,
    /// Claim namespace and name, if recorded.
    pub claim: Option<(String, String)>,
    /// PV name, if recorded.
    pub pv_name: Option<String>,
}

/// The node driver's side: its volumes and how to delete one.
pub trait SweepTarget: Send + Sync + 'static {
    /// Volumes that might be orphans.
    fn candidates(&self) -> Vec<SweepCandidate>;
    /// Deletes volume `id` (honouring its eraseafter).
    fn delete(&self, id: &str) -> impl std::future::Future<Output = Result<(), String>> + Send;
}

/// `pmem_csi_orphans_deleted_total`, `pmem_csi_orphan_sweeps_total` and
/// `pmem_csi_orphan_sweep_known_pvs`.
#[derive(Clone, Debug, Default)]
pub struct OrphanMetrics {
    deleted: Counter,
    passes: Counter,
    known_pvs: prometheus_client::metrics::gauge::Gauge,
}

impl OrphanMetrics {
    /// Registers the counters.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "pmem_csi_orphans_deleted",
            "Volumes deleted by the orphan sweep",
            m.deleted.clone(),
        );
        registry.register(
            "pmem_csi_orphan_sweeps",
            "Orphan sweep passes completed",
            m.passes.clone(),
        );
        registry.register(
            "pmem_csi_orphan_sweep_known_pvs",
            "PVs of this driver in the orphan sweep's cache at its last pass",
            m.known_pvs.clone(),
        );
        m
    }
}

/// The sweep of one node's volumes.
#[derive(Clone)]
pub struct OrphanSweep {
    /// Client for the PV watch and claim reads.
    pub client: kube::Client,
    /// Driver name (PVs of other drivers are ignored).
    pub driver: String,
    /// This node.
    pub node: String,
    /// `--orphan-grace`.
    pub grace: Duration,
    /// Time between passes.
    pub period: Duration,
    /// Its counter.
    pub metrics: OrphanMetrics,
}

/// The PV index as the watch keeps it: `None` until the first list is complete, so that no
/// pass judges from half a list.
type SharedPvs = Arc<Mutex<Option<PvIndex>>>;

impl OrphanSweep {
    /// Watches this driver's PVs and sweeps `target` every period until `shutdown`.
    pub async fn run<T: SweepTarget>(self, target: std::sync::Arc<T>, shutdown: CancellationToken) {
        let pvs: SharedPvs = Arc::default();
        let watch = tokio::spawn(watch_pvs(
            Api::<PersistentVolume>::all(self.client.clone()),
            self.driver.clone(),
            Arc::clone(&pvs),
        ));
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.period) => {}
                _ = shutdown.cancelled() => break,
            }
            let snapshot = pvs.lock().unwrap_or_else(PoisonError::into_inner).clone();
            let Some(snapshot) = snapshot else {
                tracing::debug!("orphan sweep: the PV watch has not listed yet; pass skipped");
                continue;
            };
            match sweep(
                &self.client,
                &self.driver,
                &snapshot,
                &self.node,
                self.grace,
                target.as_ref(),
                &self.metrics,
            )
            .await
            {
                Ok(()) => {
                    self.metrics.passes.inc();
                    self.metrics
                        .known_pvs
                        .set(i64::try_from(snapshot.len()).unwrap_or(i64::MAX));
                }
                Err(e) => tracing::warn!("orphan sweep: {e}"),
            }
        }
        watch.abort();
    }
}

/// Keeps `pvs` current from a watch of every PV (pages of 500 on each list), keeping this
/// driver's only. A relist builds a new index and swaps it in when complete, so PVs deleted
/// while the watch was down disappear and a pass never sees a partial list.
async fn watch_pvs(api: Api<PersistentVolume>, driver: String, pvs: SharedPvs) {
    let config = watcher::Config::default().page_size(500);
    let mut events = std::pin::pin!(watcher::watcher(api, config).default_backoff());
    let mut listing = PvIndex::default();
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                tracing::warn!("orphan sweep: PV watch: {e}");
                continue;
            }
        };
        match event {
            Event::Init => listing = PvIndex::default(),
            Event::InitApply(pv) => {
                if let (Some(name), Some(facts)) = (&pv.metadata.name, PvFacts::of(&pv, &driver)) {
                    listing.apply(name, facts);
                }
            }
            Event::InitDone => {
                let complete = std::mem::take(&mut listing);
                *pvs.lock().unwrap_or_else(PoisonError::into_inner) = Some(complete);
            }
            Event::Apply(pv) => {
                let Some(name) = pv.metadata.name.as_deref() else {
                    continue;
                };
                let mut guard = pvs.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some(index) = guard.as_mut() {
                    match PvFacts::of(&pv, &driver) {
                        Some(facts) => index.apply(name, facts),
                        None => index.delete(name),
                    }
                }
            }
            Event::Delete(pv) => {
                if let Some(name) = pv.metadata.name.as_deref() {
                    let mut guard = pvs.lock().unwrap_or_else(PoisonError::into_inner);
                    if let Some(index) = guard.as_mut() {
                        index.delete(name);
                    }
                }
            }
        }
    }
}

/// Whether a PV refers to volume `c` of `node`, read from the apiserver: its recorded PV by
/// name, or, when no name was recorded, every PV (in pages; deletions are rare).
async fn referenced_now(
    client: &kube::Client,
    driver: &str,
    c: &SweepCandidate,
    node: &str,
) -> Result<bool, kube::Error> {
    let api = Api::<PersistentVolume>::all(client.clone());
    if let Some(name) = &c.pv_name {
        return Ok(api
            .get_opt(name)
            .await?
            .and_then(|pv| PvFacts::of(&pv, driver))
            .is_some_and(|pv| pv.is_volume_of(&c.id, node)));
    }
    let mut params = kube::api::ListParams::default().limit(500);
    loop {
        let page = api.list(&params).await?;
        if page
            .items
            .iter()
            .filter_map(|pv| PvFacts::of(pv, driver))
            .any(|pv| pv.is_volume_of(&c.id, node))
        {
            return Ok(true);
        }
        match page.metadata.continue_.filter(|t| !t.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(false),
        }
    }
}

async fn sweep<T: SweepTarget>(
    client: &kube::Client,
    driver: &str,
    pvs: &PvIndex,
    node: &str,
    grace: Duration,
    target: &T,
    metrics: &OrphanMetrics,
) -> Result<(), kube::Error> {
    let candidates = target
        .candidates()
        .into_iter()
        .filter(|c| c.claim.is_some() && c.age >= grace);
    for c in candidates {
        // Checked first: a referenced volume stays whatever its claim says (see `judge`), and
        // that is nearly every volume of a healthy node.
        let referenced = pvs.references(&c.id, node);
        let claim_now = match (&c.claim, referenced) {
            (Some((ns, name)), false) => {
                Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
                    .get_opt(name)
                    .await?
                    .map(|pvc| {
                        let volume_name = pvc.spec.and_then(|s| s.volume_name);
                        ClaimNow {
                            bound_here: volume_name
                                .as_ref()
                                .and_then(|n| pvs.get(n))
                                .map(|pv| pv.is_volume_of(&c.id, node)),
                            volume_name,
                            selected_node: pvc
                                .metadata
                                .annotations
                                .and_then(|a| a.get(SELECTED_NODE).cloned()),
                        }
                    })
            }
            _ => None,
        };
        let facts = VolumeFacts {
            age: c.age,
            claim: c.claim.clone(),
            pv_name: c.pv_name.clone(),
            referenced,
            claim_now,
        };
        if let OrphanVerdict::Delete(reason) = judge(&facts, node, grace) {
            // The watch can lag (a relist in a cluster of many PVs): a deletion is confirmed
            // by reading the PVs afresh, so that a stale cache never deletes a live volume.
            if referenced_now(client, driver, &c, node).await? {
                tracing::info!(
                    id = c.id,
                    "a PV the cache had not seen yet refers to the volume; kept"
                );
                continue;
            }
            match target.delete(&c.id).await {
                Ok(()) => {
                    metrics.deleted.inc();
                    tracing::warn!(id = c.id, claim = ?c.claim, reason = reason.as_str(), "deleted an orphaned volume");
                }
                Err(e) => tracing::warn!(id = c.id, "deleting an orphaned volume: {e}"),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_objects::{DRIVER, csi_volume};

    const GRACE: Duration = Duration::from_secs(600);

    fn facts() -> VolumeFacts {
        VolumeFacts {
            age: GRACE,
            claim: Some(("ns".into(), "data".into())),
            pv_name: Some("pvc-1".into()),
            referenced: false,
            claim_now: Some(ClaimNow {
                volume_name: None,
                bound_here: None,
                selected_node: Some("n1".into()),
            }),
        }
    }

    #[test]
    fn judge_table() {
        let claim = |volume_name: Option<&str>, selected: Option<&str>| {
            Some(ClaimNow {
                volume_name: volume_name.map(str::to_string),
                bound_here: None,
                selected_node: selected.map(str::to_string),
            })
        };
        let bound = |here: bool| {
            Some(ClaimNow {
                volume_name: Some("pvc-1".into()),
                bound_here: Some(here),
                selected_node: Some("n1".into()),
            })
        };
        for (name, v, want) in [
            (
                "no claim recorded",
                VolumeFacts {
                    claim: None,
                    claim_now: None,
                    ..facts()
                },
                OrphanVerdict::Keep(KeepReason::NoClaimRecorded),
            ),
            (
                "young",
                VolumeFacts {
                    age: GRACE - Duration::from_secs(1),
                    claim_now: None,
                    ..facts()
                },
                OrphanVerdict::Keep(KeepReason::Young),
            ),
            (
                "referenced by a PV",
                VolumeFacts {
                    referenced: true,
                    claim_now: None,
                    ..facts()
                },
                OrphanVerdict::Keep(KeepReason::Referenced),
            ),
            (
                "claim gone",
                VolumeFacts {
                    claim_now: None,
                    ..facts()
                },
                OrphanVerdict::Delete(OrphanReason::ClaimGone),
            ),
            (
                "bound elsewhere",
                VolumeFacts {
                    claim_now: claim(Some("pvc-2"), None),
                    ..facts()
                },
                OrphanVerdict::Delete(OrphanReason::BoundElsewhere),
            ),
            (
                "bound to ours (PV not yet seen)",
                VolumeFacts {
                    claim_now: claim(Some("pvc-1"), Some("n1")),
                    ..facts()
                },
                OrphanVerdict::Keep(KeepReason::ClaimPendingHere),
            ),
            (
                "selected elsewhere",
                VolumeFacts {
                    claim_now: claim(None, Some("n2")),
                    ..facts()
                },
                OrphanVerdict::Delete(OrphanReason::SelectedElsewhere),
            ),
            (
                "pending here",
                facts(),
                OrphanVerdict::Keep(KeepReason::ClaimPendingHere),
            ),
            (
                "pending, no node yet",
                VolumeFacts {
                    claim_now: claim(None, None),
                    ..facts()
                },
                OrphanVerdict::Keep(KeepReason::ClaimPendingHere),
            ),
            (
                "same PV name, another node's handle (two provisioners after a partition)",
                VolumeFacts {
                    claim_now: bound(false),
                    ..facts()
                },
                OrphanVerdict::Delete(OrphanReason::BoundElsewhere),
            ),
            (
                "bound to a PV with this volume's handle",
                VolumeFacts {
                    claim_now: bound(true),
                    ..facts()
                },
                OrphanVerdict::Keep(KeepReason::Referenced),
            ),
        ] {
            assert_eq!(judge(&v, "n1", GRACE), want, "{name}");
        }
    }

    #[test]
    fn pv_facts_table() {
        let cases = [
            (
                "ours on n1",
                csi_volume("a", DRIVER, "h", Some("n1")),
                Some(("h", Some("n1"))),
            ),
            (
                "ours without affinity",
                csi_volume("a", DRIVER, "h", None),
                Some(("h", None)),
            ),
            (
                "another driver's",
                csi_volume("a", "other.csi", "h", Some("n1")),
                None,
            ),
            ("no spec", PersistentVolume::default(), None),
        ];
        for (name, pv, want) in cases {
            let got = PvFacts::of(&pv, DRIVER);
            let want = want.map(|(handle, node)| PvFacts {
                handle: handle.into(),
                node: node.map(Into::into),
            });
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn pv_index_references_table() {
        let mut index = PvIndex::default();
        let mut add = |name: &str, handle: &str, node: Option<&str>| {
            let facts = PvFacts::of(&csi_volume(name, DRIVER, handle, node), DRIVER).expect("ours");
            index.apply(name, facts);
        };
        add("pv-here", "h-here", Some("n1"));
        add("pv-there", "h-there", Some("n2"));
        add("pv-loose", "h-loose", None);
        // Two nodes provisioned one claim after a partition: same handle, one PV, on n2.
        add("pv-split", "h-split", Some("n2"));
        for (id, want) in [
            ("h-here", true),
            ("h-there", false),
            ("h-loose", true),
            ("h-split", false),
            ("h-none", false),
        ] {
            assert_eq!(index.references(id, "n1"), want, "{id}");
        }
        // A PV that changes its handle (never in practice; the index must not keep the old one).
        index.apply(
            "pv-here",
            PvFacts {
                handle: "h-new".into(),
                node: Some("n1".into()),
            },
        );
        assert!(!index.references("h-here", "n1"));
        assert!(index.references("h-new", "n1"));
        index.delete("pv-here");
        index.delete("pv-here");
        assert!(!index.references("h-new", "n1"));
        assert_eq!(index.len(), 3);
        assert_eq!(
            index.get("pv-there").and_then(|p| p.node.as_deref()),
            Some("n2")
        );
    }
}
