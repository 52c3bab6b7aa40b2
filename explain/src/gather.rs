//! The thin shell: reads [`Facts`] from the apiserver (with the user's credentials) and asks
//! the scheduler extender. Decides nothing; a read the user may not make fails with what was
//! being read.

use std::collections::{BTreeMap, BTreeSet};

use controllers::liveness::HeartbeatState;
use controllers::liveness_view::{LivenessSettings, heartbeat_by_wall_clock, observation};
use controllers::node_summary::NodeSummary;
use controllers::pod_volumes;
use controllers::volume_facts::{capacity_node, pv_node};
use controllers::well_known::{DRIVER_LABEL, SELECTED_NODE, heartbeat_lease_name};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::events::v1::Event as NewEvent;
use k8s_openapi::api::storage::v1::{CSINode, CSIStorageCapacity, StorageClass};
use kube::api::ListParams;
use kube::{Api, Client, ResourceExt};

use crate::ExplainError;
use crate::extender_view;
use crate::facts::{EventFact, Facts};
use crate::options::ExplainConfig;

/// Reads everything [`crate::explanation::explain`] needs about pod `name` in `namespace`.
pub async fn gather(
    client: &Client,
    config: &ExplainConfig,
    namespace: &str,
    name: &str,
) -> Result<Facts, ExplainError> {
    let pod = Api::<Pod>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(read(format!("pod {namespace}/{name}")))?
        .ok_or_else(|| ExplainError::PodNotFound {
            namespace: namespace.into(),
            name: name.into(),
        })?;
    let claims_api = Api::<PersistentVolumeClaim>::namespaced(client.clone(), namespace);
    let mut claims = BTreeMap::new();
    for key in pod_volumes::claims_to_look_up(&pod, namespace) {
        if let Some(claim) = claims_api
            .get_opt(&key.name)
            .await
            .map_err(read(format!("claim {key}")))?
        {
            claims.insert(key.name, claim);
        }
    }
    let classes: BTreeMap<String, StorageClass> = Api::<StorageClass>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(read("StorageClasses".into()))?
        .items
        .into_iter()
        .map(|c| (c.name_any(), c))
        .collect();
    let pv_api = Api::<PersistentVolume>::all(client.clone());
    let mut volumes = BTreeMap::new();
    for claim in claims.values() {
        let Some(pv) = claim.spec.as_ref().and_then(|s| s.volume_name.clone()) else {
            continue;
        };
        if let Some(object) = pv_api
            .get_opt(&pv)
            .await
            .map_err(read(format!("PersistentVolume {pv}")))?
        {
            volumes.insert(pv, object);
        }
    }
    let capacities =
        Api::<CSIStorageCapacity>::namespaced(client.clone(), &config.driver_namespace)
            .list(&ListParams::default().labels(&format!("{DRIVER_LABEL}={}", config.driver)))
            .await
            .map_err(read(format!(
                "CSIStorageCapacity objects in namespace {}",
                config.driver_namespace
            )))?
            .items;
    let nodes = observations(client, config, &pod, &claims, &volumes, &capacities).await?;
    let mut events = Vec::new();
    events.extend(object_events(client, namespace, "Pod", name).await?);
    for claim in claims.keys() {
        events.extend(object_events(client, namespace, "PersistentVolumeClaim", claim).await?);
    }
    let extender = extender_view::ask(client, config, namespace, name).await;
    Ok(Facts {
        driver: config.driver.clone(),
        default_volume_size: config.default_volume_size,
        pod,
        claims,
        classes,
        volumes,
        capacities,
        nodes,
        events,
        extender,
    })
}

/// RFC 3339 with a fixed six-digit fraction, so that the strings sort as the instants do
/// (core/v1 timestamps have whole seconds, events.k8s.io ones microseconds).
fn stamp(t: &k8s_openapi::jiff::Timestamp) -> String {
    format!("{t:.6}")
}

fn read(what: String) -> impl FnOnce(kube::Error) -> ExplainError {
    move |source| ExplainError::Read { what, source }
}

/// The liveness observation of every Node and of every node name the pod's objects mention.
async fn observations(
    client: &Client,
    config: &ExplainConfig,
    pod: &Pod,
    claims: &BTreeMap<String, PersistentVolumeClaim>,
    volumes: &BTreeMap<String, PersistentVolume>,
    capacities: &[CSIStorageCapacity],
) -> Result<BTreeMap<String, controllers::liveness::NodeObservation>, ExplainError> {
    let nodes: BTreeMap<String, NodeSummary> = Api::<NodeSummary>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(read("Nodes".into()))?
        .items
        .into_iter()
        .map(|n| (n.name_any(), n))
        .collect();
    let csinodes: BTreeMap<String, CSINode> = Api::<CSINode>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(read("CSINodes".into()))?
        .items
        .into_iter()
        .map(|n| (n.name_any(), n))
        .collect();
    let leases: BTreeMap<String, Lease> = if config.heartbeat_grace.is_some() {
        Api::<Lease>::namespaced(client.clone(), &config.driver_namespace)
            .list(&ListParams::default())
            .await
            .map_err(read(format!(
                "Leases in namespace {}",
                config.driver_namespace
            )))?
            .items
            .into_iter()
            .map(|l| (l.name_any(), l))
            .collect()
    } else {
        BTreeMap::new()
    };
    let mut names: BTreeSet<String> = nodes.keys().cloned().collect();
    names.extend(pod.spec.as_ref().and_then(|s| s.node_name.clone()));
    names.extend(
        claims
            .values()
            .filter_map(|c| c.metadata.annotations.as_ref()?.get(SELECTED_NODE).cloned()),
    );
    names.extend(
        volumes
            .values()
            .filter_map(|pv| pv_node(pv, &config.driver)),
    );
    names.extend(
        capacities
            .iter()
            .filter_map(|c| capacity_node(c, &config.driver)),
    );
    let settings = LivenessSettings {
        driver: config.driver.clone(),
        selector: config.node_selector.clone(),
        grace: std::time::Duration::ZERO,
        heartbeat: config.heartbeat_grace,
        namespace: config.driver_namespace.clone(),
    };
    Ok(names
        .into_iter()
        .map(|name| {
            // One look: the Lease's renewTime by the wall clock (the controller dates renewals
            // by when it saw them change, which a one-shot command cannot).
            let heartbeat = config
                .heartbeat_grace
                .map_or(HeartbeatState::NotUsed, |grace| {
                    heartbeat_by_wall_clock(
                        leases.get(&heartbeat_lease_name(&config.driver, &name)),
                        grace,
                    )
                });
            let o = observation(&settings, nodes.get(&name), csinodes.get(&name), heartbeat);
            (name, o)
        })
        .collect())
}

/// The events about one object, from core/v1 and events.k8s.io (the same objects seen
/// through two APIs: kept once, by uid).
async fn object_events(
    client: &Client,
    namespace: &str,
    kind: &str,
    name: &str,
) -> Result<Vec<EventFact>, ExplainError> {
    let what = || format!("events of {kind} {namespace}/{name}");
    let core = Api::<Event>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().fields(&format!(
            "involvedObject.kind={kind},involvedObject.name={name}"
        )))
        .await
        .map_err(read(what()))?;
    let new = Api::<NewEvent>::namespaced(client.clone(), namespace)
        .list(
            &ListParams::default().fields(&format!("regarding.kind={kind},regarding.name={name}")),
        )
        .await
        .map_err(read(what()))?;
    let mut by_uid: BTreeMap<String, EventFact> = BTreeMap::new();
    for e in core.items {
        let last_seen = e
            .last_timestamp
            .as_ref()
            .map(|t| stamp(&t.0))
            .or_else(|| e.event_time.as_ref().map(|t| stamp(&t.0)))
            .or_else(|| e.first_timestamp.as_ref().map(|t| stamp(&t.0)));
        let source = e
            .reporting_component
            .clone()
            .filter(|s| !s.is_empty())
            .or_else(|| e.source.as_ref().and_then(|s| s.component.clone()))
            .unwrap_or_default();
        by_uid.insert(
            e.metadata.uid.clone().unwrap_or_else(|| e.name_any()),
            EventFact {
                kind: kind.into(),
                name: name.into(),
                type_: e.type_.clone().unwrap_or_default(),
                reason: e.reason.clone().unwrap_or_default(),
                message: e.message.clone().unwrap_or_default(),
                source,
                count: e.count.and_then(|c| u32::try_from(c).ok()).unwrap_or(1),
                last_seen,
            },
        );
    }
    for e in new.items {
        let uid = e.metadata.uid.clone().unwrap_or_else(|| e.name_any());
        if by_uid.contains_key(&uid) {
            continue;
        }
        let series = e.series.as_ref();
        let last_seen = series
            .map(|s| stamp(&s.last_observed_time.0))
            .or_else(|| e.event_time.as_ref().map(|t| stamp(&t.0)))
            .or_else(|| e.deprecated_last_timestamp.as_ref().map(|t| stamp(&t.0)));
        by_uid.insert(
            uid,
            EventFact {
                kind: kind.into(),
                name: name.into(),
                type_: e.type_.clone().unwrap_or_default(),
                reason: e.reason.clone().unwrap_or_default(),
                message: e.note.clone().unwrap_or_default(),
                source: e.reporting_controller.clone().unwrap_or_default(),
                count: series
                    .and_then(|s| u32::try_from(s.count).ok())
                    .unwrap_or(1),
                last_seen,
            },
        );
    }
    Ok(by_uid.into_values().collect())
}
