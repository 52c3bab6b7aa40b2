//! The node's orphan sweep: a volume created for a claim that went elsewhere — the claim was
//! deleted, bound to another volume, or rescheduled to another node while this node was cut
//! off — is deleted once it is older than `--orphan-grace`, so that rescheduling after a lost
//! node never leaks capacity. The decision is pure; the sweep around it reads the cluster.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::Api;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::rescheduler::SELECTED_NODE;

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

/// `pmem_csi_orphans_deleted_total`.
#[derive(Clone, Debug, Default)]
pub struct OrphanMetrics {
    deleted: Counter,
}

impl OrphanMetrics {
    /// Registers the counter.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "pmem_csi_orphans_deleted",
            "Volumes deleted by the orphan sweep",
            m.deleted.clone(),
        );
        m
    }
}

/// The sweep of one node's volumes.
#[derive(Clone)]
pub struct OrphanSweep {
    /// Client for PVs and claims.
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

impl OrphanSweep {
    /// Sweeps `target` every period until `shutdown`.
    pub async fn run<T: SweepTarget>(self, target: std::sync::Arc<T>, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.period) => {}
                _ = shutdown.cancelled() => return,
            }
            if let Err(e) = sweep(
                &self.client,
                &self.driver,
                &self.node,
                self.grace,
                target.as_ref(),
                &self.metrics,
            )
            .await
            {
                tracing::warn!("orphan sweep: {e}");
            }
        }
    }
}

async fn sweep<T: SweepTarget>(
    client: &kube::Client,
    driver: &str,
    node: &str,
    grace: Duration,
    target: &T,
    metrics: &OrphanMetrics,
) -> Result<(), kube::Error> {
    let candidates: Vec<SweepCandidate> = target
        .candidates()
        .into_iter()
        .filter(|c| c.claim.is_some() && c.age >= grace)
        .collect();
    if candidates.is_empty() {
        return Ok(());
    }
    // PV name → (volume handle, node of its node affinity), for this driver's PVs.
    let topology_key = format!("{driver}/node");
    let pvs: BTreeMap<String, (String, Option<String>)> =
        Api::<PersistentVolume>::all(client.clone())
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .filter_map(|pv| {
                let spec = pv.spec?;
                let handle = spec.csi.filter(|c| c.driver == driver)?.volume_handle;
                let pv_node = spec
                    .node_affinity
                    .and_then(|a| a.required)
                    .into_iter()
                    .flat_map(|r| r.node_selector_terms)
                    .flat_map(|t| t.match_expressions.unwrap_or_default())
                    .find(|e| e.key == topology_key)
                    .and_then(|e| e.values.unwrap_or_default().into_iter().next());
                Some((pv.metadata.name?, (handle, pv_node)))
            })
            .collect();
    // A PV without node affinity is taken to mean this node: never delete on a guess.
    let is_ours = |id: &str, (handle, pv_node): &(String, Option<String>)| {
        handle == id && pv_node.as_deref().is_none_or(|n| n == node)
    };
    for c in candidates {
        let claim_now = match &c.claim {
            Some((ns, name)) => Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
                .get_opt(name)
                .await?
                .map(|pvc| {
                    let volume_name = pvc.spec.and_then(|s| s.volume_name);
                    ClaimNow {
                        bound_here: volume_name
                            .as_ref()
                            .and_then(|n| pvs.get(n))
                            .map(|pv| is_ours(&c.id, pv)),
                        volume_name,
                        selected_node: pvc
                            .metadata
                            .annotations
                            .and_then(|a| a.get(SELECTED_NODE).cloned()),
                    }
                }),
            None => None,
        };
        let facts = VolumeFacts {
            age: c.age,
            claim: c.claim.clone(),
            pv_name: c.pv_name.clone(),
            referenced: pvs.values().any(|pv| is_ours(&c.id, pv)),
            claim_now,
        };
        if let OrphanVerdict::Delete(reason) = judge(&facts, node, grace) {
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
}
