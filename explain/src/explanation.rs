//! The decision: from [`Facts`] to an [`Explanation`] — why the pod is Pending, or where its
//! volumes are. Pure; the JSON of `-o json` is [`Explanation`] serialized, so its field names
//! are a contract: fields are only ever added.

use std::collections::{BTreeMap, BTreeSet};

use controllers::liveness::driverless_now;
use controllers::pod_volumes::{self, ClaimKey, Lookup, VolumeSource};
use controllers::volume_facts::{ClaimFacts, ClassFacts, capacity_node, pv_node};
use extender::capacity_index::published_capacity;
use extender::fit::{self, NodeView};
use extender::pod_view::{NodeFitView, ReservedOn};
use k8s_openapi::api::core::v1::Volume;
use serde::{Deserialize, Serialize};

use crate::facts::{EventFact, ExtenderFacts, Facts};

/// How many recent events the explanation keeps.
pub const RECENT_EVENTS: usize = 10;

/// Why a pod is where it is, in data.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Explanation {
    /// `namespace/name`.
    pub pod: String,
    /// `status.phase` (`Pending`, `Running`, …).
    pub phase: String,
    /// `spec.nodeName`, once scheduled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Why the pod is not running yet, most important first; empty when nothing of ours holds
    /// it back.
    pub findings: Vec<Finding>,
    /// Each volume of the pod.
    pub volumes: Vec<VolumeReport>,
    /// Each node of interest: whether the driver runs, what it published, whether the pod's
    /// pending volumes fit.
    pub nodes: Vec<NodeReport>,
    /// What the scheduler extender said.
    pub extender: ExtenderReport,
    /// The last FailedScheduling message of the pod, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler_message: Option<String>,
    /// Recent events of the pod and its claims, oldest first.
    pub events: Vec<EventReport>,
}

/// One reason the pod is not running.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Finding {
    /// A claim the pod names does not exist.
    ClaimMissing {
        /// `namespace/name`.
        claim: String,
    },
    /// The class of an unbound claim does not exist.
    ClassMissing {
        /// `namespace/name` of the claim.
        claim: String,
        /// The class.
        class: String,
    },
    /// A claim waits for a node on which the driver does not run.
    SelectedNodeWithoutDriver {
        /// `namespace/name` of the claim.
        claim: String,
        /// Its selected node.
        node: String,
        /// The liveness judgement's reason (`node-missing`, …).
        reason: String,
    },
    /// A claim is being provisioned on its selected node.
    WaitingForProvisioning {
        /// `namespace/name` of the claim.
        claim: String,
        /// Its selected node.
        node: String,
        /// The message of its last ProvisioningFailed event, if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        last_error: Option<String>,
    },
    /// No CSIStorageCapacity object exists for a class of the pending volumes: on no node at
    /// all (`nodes` empty), or on these nodes where the driver runs.
    NoCapacityObject {
        /// The class.
        class: String,
        /// The nodes without one; empty: none has one.
        nodes: Vec<String>,
    },
    /// Some pending volume does not fit alone on any node.
    NoNodeWithRoom {
        /// The volumes (pod volume names) that fit alone nowhere.
        volumes: Vec<String>,
        /// Their largest size in bytes.
        bytes: u64,
        /// The largest free pool of any node where the driver runs.
        largest_pool: u64,
    },
    /// Each pending volume fits alone on some node, but no node fits them all together.
    DoNotFitTogether {
        /// How many volumes.
        volumes: usize,
        /// Their total size in bytes.
        bytes: u64,
        /// The nodes whose free bytes would suffice in total, were they not split into pools
        /// and extents.
        fragmented: Vec<String>,
    },
    /// The pools would hold the pod somewhere, but the extender refuses every node (other
    /// pods' reservations, allocations the nodes have not published yet).
    ExtenderRefuses {
        /// Per node, the extender's reason.
        nodes: BTreeMap<String, String>,
    },
    /// The extender's caches lack an object the pod names: it answers "retry".
    ExtenderBehind {
        /// What it lacks.
        unseen: String,
    },
}

/// One volume of the pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeReport {
    /// Its name in `spec.volumes`.
    pub volume: String,
    /// `claim`, `ephemeral` (a generic ephemeral volume's claim), `inline` (CSI inline) or
    /// `other` (not a PMEM volume of this driver).
    pub kind: String,
    /// `namespace/name` of its claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
    /// The claim's StorageClass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// Requested bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested: Option<u64>,
    /// Where it stands.
    pub state: VolumeState,
    /// The claim's selected node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selected_node: Option<String>,
    /// The bound PV.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pv: Option<String>,
    /// The node the volume lives on (the PV's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The PV's capacity in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u64>,
    /// The last ProvisioningFailed message of an unbound claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// Where a volume stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VolumeState {
    /// Bound to a PV.
    Bound,
    /// Selected for a node, being provisioned there.
    Provisioning,
    /// Waiting for the scheduler to choose a node.
    Unscheduled,
    /// The claim does not exist (an ephemeral one: not created yet).
    ClaimMissing,
    /// The claim's class does not exist.
    ClassMissing,
    /// A CSI inline volume: made on the node when the pod starts.
    Inline,
    /// Not a PMEM volume of this driver.
    NotOurs,
}

/// One node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeReport {
    /// Node name.
    pub node: String,
    /// The driver may run there (the liveness judgement, now, without a grace).
    pub driver_running: bool,
    /// Why it does not (`node-missing`, `not-selected-no-csinode-entry`, `heartbeat-expired`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driverless_reason: Option<String>,
    /// The classes it published capacity for.
    pub published_classes: Vec<String>,
    /// Free bytes per pool as published, largest first.
    pub pools: Vec<u64>,
    /// Volume sizes round up to a multiple of this.
    pub alignment: u64,
    /// Per pending volume: fits alone into the published pools.
    pub alone: Vec<VolumeFit>,
    /// All pending volumes fit together into the published pools; `None` without pending
    /// volumes or published capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fits_together: Option<bool>,
    /// The extender's verdict for the node, when it answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extender: Option<NodeFitView>,
    /// Bytes the extender holds on the node for this pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_for_pod: Option<u64>,
    /// Volumes of the pod that live or are being made here.
    pub volumes: Vec<String>,
}

/// One pending volume on one node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeFit {
    /// The pod's volume name.
    pub volume: String,
    /// Bytes it needs.
    pub bytes: u64,
    /// It fits into the node's published pools on its own.
    pub fits: bool,
}

/// What the extender said.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderReport {
    /// `answered`, `not_installed` or `unreachable`.
    pub status: String,
    /// Why it is unreachable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Its `--placement`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<String>,
    /// The reservation it holds for the pod, per node.
    pub reserved: Vec<ReservedOn>,
    /// Age of that reservation in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation_age_seconds: Option<u64>,
}

/// One recent event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventReport {
    /// `Pod/name` or `PersistentVolumeClaim/name`.
    pub object: String,
    /// `Normal` or `Warning`.
    #[serde(rename = "type")]
    pub type_: String,
    /// The reason.
    pub reason: String,
    /// The message.
    pub message: String,
    /// Who reported it.
    pub source: String,
    /// How often.
    pub count: u32,
    /// When last (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<String>,
}

/// The facts a claim volume resolves to.
struct ClaimState<'a> {
    key: ClaimKey,
    facts: Option<ClaimFacts>,
    object: Option<&'a k8s_openapi::api::core::v1::PersistentVolumeClaim>,
}

/// Explains the pod of `facts`.
pub fn explain(facts: &Facts) -> Explanation {
    let pod = &facts.pod;
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    let scheduled_on = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    let phase = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_else(|| "Pending".into());
    let driverless = |node: &str| match facts.nodes.get(node) {
        Some(o) => driverless_now(o).map(|r| r.as_str().to_string()),
        // A name no Node has, as a claim's selected node may be.
        None => Some(
            controllers::liveness::DriverlessReason::NodeMissing
                .as_str()
                .to_string(),
        ),
    };
    let volume_facts = pod_volumes::gather_now(pod, &namespace, &FactsLookup(facts));
    let pending: Vec<_> =
        pod_volumes::pending_volumes(pod, &namespace, &facts.driver, &volume_facts);
    let view = match &facts.extender {
        ExtenderFacts::View(v) => Some(v.as_ref()),
        _ => None,
    };

    let mut findings = Vec::new();
    let mut volumes = Vec::new();
    // (pod volume name, bytes, class) of the volumes still to be placed on a node.
    let mut to_place: Vec<(String, u64, Option<String>)> = Vec::new();
    let mut on_node: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for volume in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        let pending_volume = pending.iter().find(|p| p.volume == volume.name);
        let claim = claim_of(volume, &namespace, &pod_name).map(|key| ClaimState {
            facts: facts.claims.get(&key.name).map(ClaimFacts::of),
            object: facts.claims.get(&key.name),
            key,
        });
        let mut report = VolumeReport {
            volume: volume.name.clone(),
            kind: kind_of(volume).into(),
            claim: claim.as_ref().map(|c| c.key.to_string()),
            class: None,
            requested: None,
            state: VolumeState::NotOurs,
            selected_node: None,
            pv: None,
            node: None,
            capacity: None,
            last_error: None,
        };
        match &claim {
            Some(ClaimState {
                key,
                facts: None,
                object: None,
            }) => {
                report.class = template_class(volume);
                report.requested = pending_volume.and_then(|p| p.size);
                if report.kind == "claim" {
                    report.state = VolumeState::ClaimMissing;
                    findings.push(Finding::ClaimMissing {
                        claim: key.to_string(),
                    });
                } else if let Some(p) = pending_volume {
                    // The ephemeral volume controller creates the claim once the pod exists;
                    // until then the template is the demand.
                    report.state = VolumeState::ClaimMissing;
                    to_place.push((
                        volume.name.clone(),
                        p.size.unwrap_or(facts.default_volume_size),
                        report.class.clone(),
                    ));
                }
            }
            Some(ClaimState {
                key,
                facts: Some(claim),
                ..
            }) => {
                report.class = claim.class.clone();
                report.requested = claim.request;
                report.selected_node = claim.selected_node.clone();
                let class_known = claim
                    .class
                    .as_ref()
                    .is_none_or(|c| facts.classes.contains_key(c));
                if let Some(pv_name) = &claim.volume_name {
                    report.state = VolumeState::Bound;
                    report.pv = Some(pv_name.clone());
                    if let Some(pv) = facts.volumes.get(pv_name) {
                        report.node = pv_node(pv, &facts.driver);
                        report.capacity = pv
                            .spec
                            .as_ref()
                            .and_then(|s| s.capacity.as_ref())
                            .and_then(|c| c.get("storage"))
                            .and_then(|q| controllers::volume_facts::positive_bytes(&q.0));
                        if pv_node(pv, &facts.driver).is_none() {
                            report.state = VolumeState::NotOurs;
                        }
                    }
                } else if !class_known {
                    report.state = VolumeState::ClassMissing;
                    findings.push(Finding::ClassMissing {
                        claim: key.to_string(),
                        class: claim.class.clone().unwrap_or_default(),
                    });
                } else if pending_volume.is_none() {
                    report.state = VolumeState::NotOurs;
                } else if let Some(node) = &claim.selected_node {
                    report.state = VolumeState::Provisioning;
                    report.last_error = last_provisioning_error(facts, &key.name);
                    match driverless(node) {
                        Some(reason) => findings.push(Finding::SelectedNodeWithoutDriver {
                            claim: key.to_string(),
                            node: node.clone(),
                            reason,
                        }),
                        None => findings.push(Finding::WaitingForProvisioning {
                            claim: key.to_string(),
                            node: node.clone(),
                            last_error: report.last_error.clone(),
                        }),
                    }
                } else {
                    report.state = VolumeState::Unscheduled;
                    report.last_error = last_provisioning_error(facts, &key.name);
                    to_place.push((
                        volume.name.clone(),
                        claim.request.unwrap_or(facts.default_volume_size),
                        claim.class.clone(),
                    ));
                }
            }
            _ => {
                if let Some(p) = pending_volume
                    && p.source == VolumeSource::Inline
                {
                    report.state = VolumeState::Inline;
                    report.requested = p.size;
                    report.node = scheduled_on.clone();
                    if scheduled_on.is_none() {
                        to_place.push((
                            volume.name.clone(),
                            p.size.unwrap_or(facts.default_volume_size),
                            None,
                        ));
                    }
                }
            }
        }
        if let Some(node) = report.node.clone().or(report.selected_node.clone())
            && report.state != VolumeState::NotOurs
        {
            on_node.entry(node).or_default().push(volume.name.clone());
        }
        volumes.push(report);
    }

    // Which classes each node published for, and its numbers (every class of a node publishes
    // the same pools).
    let mut published: BTreeMap<String, (BTreeSet<String>, NodeView)> = BTreeMap::new();
    for object in &facts.capacities {
        let Some(node) = capacity_node(object, &facts.driver) else {
            continue;
        };
        let capacity = published_capacity(&facts.driver, object);
        let entry = published.entry(node).or_insert_with(|| {
            (
                BTreeSet::new(),
                NodeView {
                    pools: capacity.pools.clone(),
                    // The pools already reflect what the node allocated; the extender's view
                    // adds what they do not reflect yet.
                    managed: u64::MAX,
                    alignment: capacity.alignment,
                    overhead: capacity.overhead,
                    ..NodeView::default()
                },
            )
        });
        entry.0.insert(object.storage_class_name.clone());
    }
    let mut names: BTreeSet<String> = facts.nodes.keys().cloned().collect();
    names.extend(published.keys().cloned());
    names.extend(on_node.keys().cloned());
    if let Some(v) = view {
        names.extend(v.nodes.iter().map(|n| n.node.clone()));
    }
    let scheduling = scheduled_on.is_none() && !to_place.is_empty();
    let sizes: Vec<u64> = to_place.iter().map(|(_, b, _)| *b).collect();
    let nodes: Vec<NodeReport> = names
        .iter()
        .map(|node| {
            let reason = driverless(node);
            let (classes, node_view) = published
                .get(node)
                .map(|(c, v)| (c.iter().cloned().collect::<Vec<_>>(), Some(v)))
                .unwrap_or_default();
            let (alone, fits_together) = match node_view.filter(|_| scheduling) {
                Some(v) => (
                    to_place
                        .iter()
                        .map(|(name, bytes, _)| VolumeFit {
                            volume: name.clone(),
                            bytes: *bytes,
                            fits: fit::fit(v, &[*bytes]).is_ok(),
                        })
                        .collect(),
                    Some(fit::fit(v, &sizes).is_ok()),
                ),
                None => (Vec::new(), None),
            };
            NodeReport {
                node: node.clone(),
                driver_running: reason.is_none(),
                driverless_reason: reason,
                published_classes: classes,
                pools: node_view.map(|v| v.pools.clone()).unwrap_or_default(),
                alignment: node_view.map_or(1, |v| v.alignment.max(1)),
                alone,
                fits_together,
                extender: view.and_then(|v| v.nodes.iter().find(|n| &n.node == node).cloned()),
                reserved_for_pod: view
                    .and_then(|v| v.reservation.as_ref())
                    .and_then(|r| r.nodes.iter().find(|n| &n.node == node))
                    .map(|n| n.bytes),
                volumes: on_node.get(node).cloned().unwrap_or_default(),
            }
        })
        .collect();

    if scheduling {
        findings.extend(placement_findings(facts, &to_place, &nodes, view));
    }
    if let Some(unseen) = view.and_then(|v| v.unseen.clone())
        && scheduled_on.is_none()
    {
        findings.push(Finding::ExtenderBehind { unseen });
    }

    let extender = match &facts.extender {
        ExtenderFacts::View(v) => ExtenderReport {
            status: "answered".into(),
            message: None,
            placement: Some(v.placement.clone()),
            reserved: v
                .reservation
                .as_ref()
                .map(|r| r.nodes.clone())
                .unwrap_or_default(),
            reservation_age_seconds: v.reservation.as_ref().map(|r| r.age_seconds),
        },
        ExtenderFacts::NotInstalled => ExtenderReport {
            status: "not_installed".into(),
            message: None,
            placement: None,
            reserved: Vec::new(),
            reservation_age_seconds: None,
        },
        ExtenderFacts::Unreachable(message) => ExtenderReport {
            status: "unreachable".into(),
            message: Some(message.clone()),
            placement: None,
            reserved: Vec::new(),
            reservation_age_seconds: None,
        },
    };
    let mut events: Vec<&EventFact> = facts.events.iter().collect();
    events.sort_by(|a, b| a.last_seen.cmp(&b.last_seen));
    let scheduler_message = if scheduled_on.is_none() {
        events
            .iter()
            .rev()
            .find(|e| e.kind == "Pod" && e.reason == "FailedScheduling")
            .map(|e| e.message.clone())
    } else {
        None
    };
    let skip = events.len().saturating_sub(RECENT_EVENTS);
    Explanation {
        pod: format!("{namespace}/{pod_name}"),
        phase,
        node: scheduled_on,
        findings,
        volumes,
        nodes,
        extender,
        scheduler_message,
        events: events
            .into_iter()
            .skip(skip)
            .map(|e| EventReport {
                object: format!("{}/{}", e.kind, e.name),
                type_: e.type_.clone(),
                reason: e.reason.clone(),
                message: e.message.clone(),
                source: e.source.clone(),
                count: e.count,
                last_seen: e.last_seen.clone(),
            })
            .collect(),
    }
}

/// Why the volumes still to be placed find no node: missing capacity objects, a volume too big
/// for every node, volumes that fit only one at a time, or the extender's refusal.
fn placement_findings(
    facts: &Facts,
    to_place: &[(String, u64, Option<String>)],
    nodes: &[NodeReport],
    view: Option<&extender::pod_view::PodView>,
) -> Vec<Finding> {
    let mut findings = Vec::new();
    let running: Vec<&NodeReport> = nodes.iter().filter(|n| n.driver_running).collect();
    let classes: BTreeSet<&str> = to_place
        .iter()
        .filter_map(|(_, _, class)| class.as_deref())
        .collect();
    for class in classes {
        let publishing = |n: &NodeReport| n.published_classes.iter().any(|c| c == class);
        if !nodes.iter().any(publishing) {
            findings.push(Finding::NoCapacityObject {
                class: class.to_string(),
                nodes: Vec::new(),
            });
            continue;
        }
        // Nodes where the driver runs and that published for some class, or that hold volumes
        // of the pod, are expected to publish for this one too.
        let lacking: Vec<String> = running
            .iter()
            .filter(|n| {
                !publishing(n)
                    && (!n.published_classes.is_empty() || expected_to_publish(facts, &n.node))
            })
            .map(|n| n.node.clone())
            .collect();
        if !lacking.is_empty() {
            findings.push(Finding::NoCapacityObject {
                class: class.to_string(),
                nodes: lacking,
            });
        }
    }
    let candidates: Vec<&NodeReport> = running
        .iter()
        .copied()
        .filter(|n| n.fits_together.is_some())
        .collect();
    if candidates.is_empty() {
        return findings;
    }
    let fits_somewhere = candidates.iter().any(|n| n.fits_together == Some(true));
    if !fits_somewhere {
        let alone_nowhere: Vec<&(String, u64, Option<String>)> = to_place
            .iter()
            .filter(|(name, ..)| {
                !candidates
                    .iter()
                    .any(|n| n.alone.iter().any(|a| &a.volume == name && a.fits))
            })
            .collect();
        let largest_pool = candidates
            .iter()
            .filter_map(|n| n.pools.first().copied())
            .max()
            .unwrap_or(0);
        if alone_nowhere.is_empty() {
            let bytes = to_place
                .iter()
                .fold(0u64, |s, (_, b, _)| s.saturating_add(*b));
            findings.push(Finding::DoNotFitTogether {
                volumes: to_place.len(),
                bytes,
                fragmented: candidates
                    .iter()
                    .filter(|n| {
                        let aligned = to_place.iter().fold(0u64, |s, (_, b, _)| {
                            s.saturating_add(fit::align(*b, n.alignment).unwrap_or(u64::MAX))
                        });
                        n.pools.iter().fold(0u64, |s, p| s.saturating_add(*p)) >= aligned
                    })
                    .map(|n| n.node.clone())
                    .collect(),
            });
        } else {
            findings.push(Finding::NoNodeWithRoom {
                volumes: alone_nowhere.iter().map(|(n, ..)| n.clone()).collect(),
                bytes: alone_nowhere.iter().map(|(_, b, _)| *b).max().unwrap_or(0),
                largest_pool,
            });
        }
    } else if let Some(view) = view
        && !view.nodes.is_empty()
        && view.unseen.is_none()
        && !view.nodes.iter().any(|n| n.fits)
    {
        findings.push(Finding::ExtenderRefuses {
            nodes: view
                .nodes
                .iter()
                .map(|n| (n.node.clone(), n.reason.clone().unwrap_or_default()))
                .collect(),
        });
    }
    findings
}

/// Whether `node` is meant to run the driver though it published nothing: its CSINode lists
/// the driver (node-driver-registrar registered it).
fn expected_to_publish(facts: &Facts, node: &str) -> bool {
    facts
        .nodes
        .get(node)
        .is_some_and(|o| o.csinode == controllers::liveness::CsiNodeState::WithDriver)
}

/// The message of the claim's latest ProvisioningFailed event.
fn last_provisioning_error(facts: &Facts, claim: &str) -> Option<String> {
    facts
        .events
        .iter()
        .filter(|e| {
            e.kind == "PersistentVolumeClaim" && e.name == claim && e.reason == "ProvisioningFailed"
        })
        .max_by(|a, b| a.last_seen.cmp(&b.last_seen))
        .map(|e| e.message.clone())
}

fn kind_of(volume: &Volume) -> &'static str {
    if volume.persistent_volume_claim.is_some() {
        "claim"
    } else if volume.ephemeral.is_some() {
        "ephemeral"
    } else if volume.csi.is_some() {
        "inline"
    } else {
        "other"
    }
}

fn claim_of(volume: &Volume, namespace: &str, pod: &str) -> Option<ClaimKey> {
    if let Some(source) = &volume.persistent_volume_claim {
        return Some(ClaimKey::new(namespace, source.claim_name.clone()));
    }
    volume.ephemeral.as_ref().map(|_| {
        ClaimKey::new(
            namespace,
            pod_volumes::ephemeral_claim_name(pod, &volume.name),
        )
    })
}

fn template_class(volume: &Volume) -> Option<String> {
    volume
        .ephemeral
        .as_ref()?
        .volume_claim_template
        .as_ref()?
        .spec
        .storage_class_name
        .clone()
}

/// [`Facts`] as the [`Lookup`] the shared pending-volume rules read.
struct FactsLookup<'a>(&'a Facts);

impl Lookup for FactsLookup<'_> {
    async fn claims(&self, keys: Vec<ClaimKey>) -> Vec<(ClaimKey, Option<ClaimFacts>)> {
        keys.into_iter()
            .map(|key| {
                let found = self.0.claims.get(&key.name).map(ClaimFacts::of);
                (key, found)
            })
            .collect()
    }

    async fn classes(&self, names: Vec<String>) -> Vec<(String, Option<ClassFacts>)> {
        names
            .into_iter()
            .map(|name| {
                let found = self.0.classes.get(&name).map(ClassFacts::of);
                (name, found)
            })
            .collect()
    }

    async fn default_class(&self) -> Option<ClassFacts> {
        let facts: Vec<(String, ClassFacts)> = self
            .0
            .classes
            .iter()
            .map(|(n, c)| (n.clone(), ClassFacts::of(c)))
            .collect();
        controllers::volume_facts::default_class(facts.iter().map(|(n, c)| (n.as_str(), c)))
            .map(|(_, c)| c.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use controllers::liveness::{CsiNodeState, HeartbeatState, NodeObservation};
    use controllers::test_objects::{
        DRIVER, GI, MI, NAMESPACE, bound_to, claim, claim_volume, pod, published_capacity,
        selected_for, storage_class, volume,
    };
    use extender::pod_view::PodView;
    use k8s_openapi::api::core::v1::{PersistentVolumeClaim, PodStatus};

    const CLASS: &str = "pmem";
    const RUNS: NodeObservation = NodeObservation {
        node_exists: true,
        labels_match: true,
        csinode: CsiNodeState::WithDriver,
        heartbeat: HeartbeatState::NotUsed,
    };

    /// A pending pod `p` using `claims`, nodes `nodes` (driver running) publishing `pools` for
    /// class [`CLASS`].
    fn facts(claims: Vec<PersistentVolumeClaim>, nodes: &[(&str, &[u64])]) -> Facts {
        let volumes = claims
            .iter()
            .map(|c| {
                let name = c.metadata.name.clone().unwrap_or_default();
                claim_volume(&name, &name)
            })
            .collect();
        Facts {
            driver: DRIVER.into(),
            default_volume_size: GI,
            pod: pod(NAMESPACE, "p", volumes),
            claims: claims
                .into_iter()
                .map(|c| (c.metadata.name.clone().unwrap_or_default(), c))
                .collect(),
            classes: [CLASS, "fresh"]
                .iter()
                .map(|c| {
                    (
                        c.to_string(),
                        storage_class(c, DRIVER, "WaitForFirstConsumer"),
                    )
                })
                .collect(),
            volumes: BTreeMap::new(),
            capacities: nodes
                .iter()
                .map(|(n, pools)| published_capacity("pmem-csi", DRIVER, n, CLASS, pools, 10 * GI))
                .collect(),
            nodes: nodes.iter().map(|(n, _)| (n.to_string(), RUNS)).collect(),
            events: Vec::new(),
            extender: ExtenderFacts::NotInstalled,
        }
    }

    fn pvc(name: &str, size: &str) -> PersistentVolumeClaim {
        claim(NAMESPACE, name, CLASS, size)
    }

    fn failed(claim: &str, message: &str) -> EventFact {
        EventFact {
            kind: "PersistentVolumeClaim".into(),
            name: claim.into(),
            type_: "Warning".into(),
            reason: "ProvisioningFailed".into(),
            message: message.into(),
            count: 1,
            last_seen: Some("2026-01-01T00:00:00Z".into()),
            ..Default::default()
        }
    }

    #[test]
    fn findings_table() {
        let one_gi: &[u64] = &[GI];
        let split: &[u64] = &[700 * MI, 500 * MI];
        let cases: Vec<(&str, Facts, Vec<Finding>)> = vec![
            (
                "no node with room",
                facts(
                    vec![pvc("data", "2Gi")],
                    &[("n1", one_gi), ("n2", &[GI / 2])],
                ),
                vec![Finding::NoNodeWithRoom {
                    volumes: vec!["data".into()],
                    bytes: 2 * GI,
                    largest_pool: GI,
                }],
            ),
            (
                "fragmented: each alone fits, together not",
                facts(vec![pvc("a", "600Mi"), pvc("b", "600Mi")], &[("n1", split)]),
                vec![Finding::DoNotFitTogether {
                    volumes: 2,
                    bytes: 1200 * MI,
                    fragmented: vec!["n1".into()],
                }],
            ),
            (
                "together they fit",
                facts(vec![pvc("a", "600Mi"), pvc("b", "400Mi")], &[("n1", split)]),
                vec![],
            ),
            (
                "selected node gone",
                facts(
                    vec![selected_for(pvc("data", "1Gi"), "gone")],
                    &[("n1", one_gi)],
                ),
                vec![Finding::SelectedNodeWithoutDriver {
                    claim: "ns/data".into(),
                    node: "gone".into(),
                    reason: "node-missing".into(),
                }],
            ),
            (
                "selected node not meant for the driver",
                {
                    let mut f = facts(vec![selected_for(pvc("data", "1Gi"), "n2")], &[]);
                    f.nodes.insert(
                        "n2".into(),
                        NodeObservation {
                            labels_match: false,
                            csinode: CsiNodeState::Missing,
                            ..RUNS
                        },
                    );
                    f
                },
                vec![Finding::SelectedNodeWithoutDriver {
                    claim: "ns/data".into(),
                    node: "n2".into(),
                    reason: "not-selected-no-csinode-entry".into(),
                }],
            ),
            (
                "no capacity object for a fresh class",
                facts(
                    vec![claim(NAMESPACE, "data", "fresh", "1Gi")],
                    &[("n1", one_gi)],
                ),
                vec![Finding::NoCapacityObject {
                    class: "fresh".into(),
                    nodes: vec![],
                }],
            ),
            (
                "a node has not published yet",
                {
                    let mut f = facts(vec![pvc("data", "2Gi")], &[("n1", one_gi)]);
                    f.nodes.insert("n2".into(), RUNS);
                    f
                },
                vec![
                    Finding::NoCapacityObject {
                        class: CLASS.into(),
                        nodes: vec!["n2".into()],
                    },
                    Finding::NoNodeWithRoom {
                        volumes: vec!["data".into()],
                        bytes: 2 * GI,
                        largest_pool: GI,
                    },
                ],
            ),
            (
                "provisioning failed",
                {
                    let mut f = facts(
                        vec![selected_for(pvc("data", "1Gi"), "n1")],
                        &[("n1", one_gi)],
                    );
                    f.events.push(failed("data", "rpc error: InvalidArgument"));
                    f
                },
                vec![Finding::WaitingForProvisioning {
                    claim: "ns/data".into(),
                    node: "n1".into(),
                    last_error: Some("rpc error: InvalidArgument".into()),
                }],
            ),
            (
                "claim missing",
                {
                    let mut f = facts(vec![], &[("n1", one_gi)]);
                    f.pod = pod(NAMESPACE, "p", vec![claim_volume("data", "nope")]);
                    f
                },
                vec![Finding::ClaimMissing {
                    claim: "ns/nope".into(),
                }],
            ),
            (
                "class missing",
                facts(
                    vec![claim(NAMESPACE, "data", "gone", "1Gi")],
                    &[("n1", one_gi)],
                ),
                vec![Finding::ClassMissing {
                    claim: "ns/data".into(),
                    class: "gone".into(),
                }],
            ),
            (
                "pools have room, the extender refuses",
                {
                    let mut f = facts(vec![pvc("data", "1Gi")], &[("n1", one_gi)]);
                    f.extender = ExtenderFacts::View(Box::new(PodView {
                        nodes: vec![NodeFitView {
                            node: "n1".into(),
                            reason: Some("insufficient PMEM for 1 volume (1.0GiB)".into()),
                            ..Default::default()
                        }],
                        ..Default::default()
                    }));
                    f
                },
                vec![Finding::ExtenderRefuses {
                    nodes: BTreeMap::from([(
                        "n1".into(),
                        "insufficient PMEM for 1 volume (1.0GiB)".into(),
                    )]),
                }],
            ),
        ];
        for (name, facts, want) in cases {
            assert_eq!(explain(&facts).findings, want, "{name}");
        }
    }

    #[test]
    fn running_pod_shows_where_each_volume_is() {
        let mut f = facts(
            vec![bound_to(selected_for(pvc("data", "1Gi"), "n1"), "pv-1")],
            &[("n1", &[GI])],
        );
        f.volumes
            .insert("pv-1".into(), volume("pv-1", "n1", "1Gi", Some("data")));
        let spec = f.pod.spec.get_or_insert_with(Default::default);
        spec.node_name = Some("n1".into());
        f.pod.status = Some(PodStatus {
            phase: Some("Running".into()),
            ..Default::default()
        });
        let e = explain(&f);
        assert_eq!(e.findings, []);
        assert_eq!(e.node.as_deref(), Some("n1"));
        let v = &e.volumes[0];
        assert_eq!(
            (v.state, v.pv.as_deref(), v.node.as_deref(), v.capacity),
            (VolumeState::Bound, Some("pv-1"), Some("n1"), Some(GI))
        );
        assert_eq!(e.nodes[0].volumes, ["data"]);
        let text = crate::render::render(&e);
        assert!(
            text.starts_with("Pod ns/p is Running on node n1."),
            "{text}"
        );
        assert!(
            text.contains(
                "data: claim ns/data, class pmem, 1.0GiB, bound to PV pv-1 on node n1 (1.0GiB)"
            ),
            "{text}"
        );
    }

    #[test]
    fn ephemeral_and_inline_volumes_count_before_their_claims_exist() {
        use controllers::test_objects::{generic_ephemeral_volume, inline_volume};
        let mut f = facts(vec![], &[("n1", &[GI])]);
        f.pod = pod(
            NAMESPACE,
            "p",
            vec![
                generic_ephemeral_volume("scratch", CLASS, "2Gi"),
                inline_volume("fast", DRIVER, Some("512Mi"), None),
                inline_volume("other", "other.driver", Some("1Gi"), None),
            ],
        );
        let e = explain(&f);
        let states: Vec<(&str, &str, VolumeState, Option<&str>)> = e
            .volumes
            .iter()
            .map(|v| {
                (
                    v.volume.as_str(),
                    v.kind.as_str(),
                    v.state,
                    v.claim.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            states,
            [
                (
                    "scratch",
                    "ephemeral",
                    VolumeState::ClaimMissing,
                    Some("ns/p-scratch")
                ),
                ("fast", "inline", VolumeState::Inline, None),
                ("other", "inline", VolumeState::NotOurs, None),
            ]
        );
        assert_eq!(
            e.findings,
            [Finding::NoNodeWithRoom {
                volumes: vec!["scratch".into()],
                bytes: 2 * GI,
                largest_pool: GI,
            }]
        );
        let alone: Vec<(&str, bool)> = e.nodes[0]
            .alone
            .iter()
            .map(|a| (a.volume.as_str(), a.fits))
            .collect();
        assert_eq!(alone, [("scratch", false), ("fast", true)]);
    }

    #[test]
    fn the_extender_report_says_what_it_holds_or_why_it_is_silent() {
        use extender::pod_view::{ReservationView, ReservedOn};
        let mut f = facts(vec![pvc("data", "1Gi")], &[("n1", &[2 * GI])]);
        f.extender = ExtenderFacts::View(Box::new(PodView {
            placement: "reserve-all".into(),
            reservation: Some(ReservationView {
                age_seconds: 3,
                nodes: vec![ReservedOn {
                    node: "n1".into(),
                    bytes: GI,
                }],
                entries: Vec::new(),
            }),
            ..Default::default()
        }));
        let e = explain(&f);
        assert_eq!(e.nodes[0].reserved_for_pod, Some(GI));
        let text = crate::render::render(&e);
        assert!(
            text.contains("Extender: answered; it holds a reservation for this pod (made 3s ago): 1.0GiB on n1."),
            "{text}"
        );
        f.extender = ExtenderFacts::Unreachable("GET …: connection refused".into());
        let text = crate::render::render(&explain(&f));
        assert!(
            text.contains("Extender: not reachable (GET …: connection refused); the rest of this explanation does without its view."),
            "{text}"
        );
    }

    #[test]
    fn json_field_names_are_stable() {
        let e = explain(&facts(vec![pvc("data", "2Gi")], &[("n1", &[GI])]));
        let json = serde_json::to_value(&e).expect("serializes");
        assert_eq!(json["findings"][0]["kind"], "no_node_with_room");
        assert_eq!(json["volumes"][0]["state"], "unscheduled");
        assert_eq!(json["nodes"][0]["alone"][0]["fits"], false);
        assert_eq!(json["extender"]["status"], "not_installed");
        let back: Explanation = serde_json::from_value(json).expect("round trip");
        assert_eq!(back, e);
    }
}
