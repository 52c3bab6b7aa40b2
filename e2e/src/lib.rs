//! End-to-end scenarios of distributed provisioning, run against testenv by default and against
//! any cluster with the driver installed when `KUBECONFIG` is set (so kind runs the same tests).
//!
//! A [`Scenario`] owns a namespace; [`Scenario::finish`] deletes it, waits until its pods,
//! claims and volumes are gone and runs the leak check: on testenv, no volume, mount or loop
//! device of ours is left on any node; on any cluster, the published capacity is back to what it
//! was before the scenario.

use controllers::test_objects::{self, claim_volume, runnable};
use controllers::volume_facts::capacity_node;
use controllers::well_known::{DRIVER_LABEL, PROVISIONER_FINALIZER};
use std::collections::BTreeMap;
use std::time::Duration;

use driver::csi::controller_client::ControllerClient;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    Event, Namespace, PersistentVolume, PersistentVolumeClaim, Pod, Volume,
};
use k8s_openapi::api::storage::v1::CSIStorageCapacity;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use testenv::wait::until;
use testenv::{NodeSpec, TestEnv, TestEnvBuilder};

/// The driver name the scenarios expect (the manifests').
pub const DRIVER: &str = testenv::DEFAULT_DRIVER_NAME;
/// The manifests' late-binding ext4 class.
pub const CLASS: &str = "pmem-csi-sc-ext4";
/// The manifests' late-binding class without erasing on delete.
pub const CLASS_NO_ERASE: &str = "pmem-csi-sc-ext4-no-erase";
/// How long scenarios wait for the cluster to converge.
pub const WAIT: Duration = Duration::from_secs(120);
/// Mebibytes.
pub const MI: i64 = 1 << 20;
/// The environment variable naming the workload image of the pods (real clusters pull or have
/// imported it; testenv's simulated kubelet never runs it).
pub const IMAGE_VAR: &str = "PMEM_CSI_E2E_IMAGE";
/// The workload image when [`IMAGE_VAR`] is unset.
pub const DEFAULT_IMAGE: &str = "docker.io/library/busybox:1.37";

/// The workload image of the scenarios' pods: a busybox with `sh`, `cat`, `grep` and `sleep`.
pub fn image() -> String {
    std::env::var(IMAGE_VAR).unwrap_or_else(|_| DEFAULT_IMAGE.to_string())
}

/// PMEM budget of the testenv nodes: different per node, so placement by capacity shows.
pub const BUDGETS: [(&str, i64); 3] = [("node-1", 512), ("node-2", 768), ("node-3", 1024)];
/// The testenv node without the driver (neither labels nor CSINode entry).
pub const DRIVERLESS: &str = "node-4";

/// What failed in a scenario's plumbing (assertions panic instead).
#[derive(Debug, thiserror::Error)]
pub enum E2eError {
    /// An API call.
    #[error("{what}: {source}")]
    Api {
        /// The call.
        what: String,
        /// Why.
        source: kube::Error,
    },
    /// A condition did not hold in time.
    #[error(transparent)]
    Timeout(#[from] testenv::wait::Timeout),
    /// testenv did not start or the cluster is unreachable.
    #[error("cluster: {0}")]
    Cluster(String),
}

fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> E2eError {
    let what = what.into();
    move |source| E2eError::Api { what, source }
}

/// A node that ran the driver, as the API server shows it: Node, CSINode, a heartbeat Lease
/// renewed `renewed_ago` ago by a driver renewing every 10 s (as the DaemonSet's does; `None`:
/// no Lease, a driver that stopped and whose Lease is gone), and its capacity object for
/// [`CLASS`] (256 MiB free). Nothing runs there: deleting the Node loses it. The controller
/// dates a renewal by when it sees the Lease change, whatever its renewTime says: a Lease
/// created here looks fresh for its 10 s and the heartbeat grace after it is first seen.
pub async fn driver_node(
    client: &kube::Client,
    node: &str,
    renewed_ago: Option<Duration>,
) -> Result<(), E2eError> {
    let namespace = testenv::manifests::NAMESPACE;
    NodeSpec::with_driver(node)
        .create(client, DRIVER)
        .await
        .map_err(|e| E2eError::Cluster(e.to_string()))?;
    if let Some(renewed_ago) = renewed_ago {
        let mut lease =
            controllers::heartbeat::lease(DRIVER, node, namespace, Duration::from_secs(10), None);
        if let Some(spec) = lease.spec.as_mut() {
            let renewed = k8s_openapi::jiff::Timestamp::now()
                - k8s_openapi::jiff::SignedDuration::try_from(renewed_ago).unwrap_or_default();
            spec.renew_time = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                renewed,
            ));
        }
        Api::<Lease>::namespaced(client.clone(), namespace)
            .create(&PostParams::default(), &lease)
            .await
            .map_err(api(format!("creating the heartbeat Lease of {node}")))?;
    }
    let free = 256 << 20;
    Api::<CSIStorageCapacity>::namespaced(client.clone(), namespace)
        .create(
            &PostParams::default(),
            &test_objects::published_capacity(namespace, DRIVER, node, CLASS, &[free], free),
        )
        .await
        .map_err(api(format!("creating the capacity of {node}")))?;
    Ok(())
}

/// A volume provisioned on `node` for `claim`: the claim created pre-bound to a PV pinned to
/// the node (reclaim policy Delete, external-provisioner's finalizer), which the PV binder
/// binds. Returns the PV's name.
pub async fn volume_on(
    client: &kube::Client,
    node: &str,
    mut claim: PersistentVolumeClaim,
) -> Result<String, E2eError> {
    let claim_namespace = claim.metadata.namespace.clone().unwrap_or_default();
    let claim_name = claim.metadata.name.clone().unwrap_or_default();
    let pv_name = format!("{claim_namespace}-{claim_name}");
    let spec = claim.spec.get_or_insert_with(Default::default);
    spec.volume_name = Some(pv_name.clone());
    let class = spec.storage_class_name.clone();
    let size = spec
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage").cloned());
    let mut pv = test_objects::csi_volume(&pv_name, DRIVER, &pv_name, Some(node));
    pv.metadata.finalizers = Some(vec![PROVISIONER_FINALIZER.to_string()]);
    let pv_spec = pv.spec.get_or_insert_with(Default::default);
    pv_spec.storage_class_name = class;
    pv_spec.persistent_volume_reclaim_policy = Some("Delete".into());
    if let Some(size) = size {
        pv_spec.capacity = Some(BTreeMap::from([("storage".to_string(), size)]));
    }
    pv_spec.claim_ref = Some(k8s_openapi::api::core::v1::ObjectReference {
        namespace: Some(claim_namespace.clone()),
        name: Some(claim_name.clone()),
        ..Default::default()
    });
    Api::<PersistentVolume>::all(client.clone())
        .create(&PostParams::default(), &pv)
        .await
        .map_err(api(format!("creating PV {pv_name}")))?;
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), &claim_namespace)
        .create(&PostParams::default(), &claim)
        .await
        .map_err(api(format!("creating claim {claim_name}")))?;
    Ok(pv_name)
}

/// This driver's capacity objects, in every namespace.
async fn capacity_objects(client: &kube::Client) -> Result<Vec<CSIStorageCapacity>, E2eError> {
    Ok(Api::<CSIStorageCapacity>::all(client.clone())
        .list(&ListParams::default().labels(&format!("{DRIVER_LABEL}={DRIVER}")))
        .await
        .map_err(api("listing CSIStorageCapacity"))?
        .items)
}

/// Names of this driver's capacity objects that describe `node`.
pub async fn capacity_objects_of(
    client: &kube::Client,
    node: &str,
) -> Result<Vec<String>, E2eError> {
    Ok(capacity_objects(client)
        .await?
        .into_iter()
        .filter(|c| capacity_node(c, DRIVER).as_deref() == Some(node))
        .filter_map(|c| c.metadata.name)
        .collect())
}

/// Deletes node `node`'s Node and CSINode objects, as an operator removing a dead machine does
/// (its Lease and capacity objects stay, as on a cluster).
pub async fn delete_node(client: &kube::Client, node: &str) -> Result<(), E2eError> {
    Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
        .delete(node, &DeleteParams::default())
        .await
        .map_err(api(format!("deleting node {node}")))?;
    Api::<k8s_openapi::api::storage::v1::CSINode>::all(client.clone())
        .delete(node, &DeleteParams::default())
        .await
        .map_err(api(format!("deleting CSINode {node}")))?;
    Ok(())
}

/// Drops every finalizer of PV `name` (what external-provisioner does once it deleted the
/// volume), asks for its deletion, and waits until it is gone.
pub async fn drop_finalizers_until_gone(client: &kube::Client, name: &str) -> Result<(), E2eError> {
    let pvs = Api::<PersistentVolume>::all(client.clone());
    pvs.patch(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
    )
    .await
    .map_err(api(format!("dropping the finalizers of PV {name}")))?;
    match pvs.delete(name, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => return Err(api(format!("deleting PV {name}"))(e)),
    }
    testenv::wait::wait_gone(&pvs, name, WAIT).await?;
    Ok(())
}

/// Deletes the heartbeat Lease of `node` (the end of a scenario that made one).
pub async fn delete_lease(client: &kube::Client, node: &str) {
    let _ = Api::<Lease>::namespaced(client.clone(), testenv::manifests::NAMESPACE)
        .delete(
            &controllers::well_known::heartbeat_lease_name(DRIVER, node),
            &DeleteParams::default(),
        )
        .await;
}

/// The testenv the scenarios run on: the budgets above plus a driverless node, every piece of
/// the scheduler-extender component (webhook, extender), the controller with short graces (the
/// node-loss recovery's included, and room for every scenario's lost node in its hourly
/// budget) but the shipped `--heartbeat-grace`, and the simulated kubelet.
pub fn testenv_builder() -> TestEnvBuilder {
    let mut builder = TestEnv::builder();
    for (node, mib) in BUDGETS {
        builder = builder.node(NodeSpec::with_driver(node).budget(format!("{mib}Mi")));
    }
    builder
        .node(NodeSpec::driverless(DRIVERLESS))
        .drivers(testenv::node_processes::DriverOptions {
            // Scenarios read what the drivers did (erased volumes) from their JSON logs.
            extra_args: vec!["--log-format=json".into()],
            ..Default::default()
        })
        .extender(["--reschedule-grace=2s"])
        // Every node-loss scenario recovers a node of its own within the hour.
        .controller([
            "--reschedule-grace=2s",
            "--node-loss-grace=4s",
            "--node-loss-max-nodes-per-hour=20",
        ])
        .shipped_heartbeat()
        .kubelet()
}

/// The cluster under test.
#[derive(Clone)]
pub struct Cluster {
    /// Admin client.
    pub client: kube::Client,
    /// testenv, when the scenarios run on it (not on an external cluster).
    pub env: Option<&'static TestEnv>,
}

impl Cluster {
    /// The cluster of `KUBECONFIG` when it is set, otherwise the shared testenv of this test
    /// binary built by `configure`.
    pub async fn connect(configure: fn() -> TestEnvBuilder) -> Result<Self, E2eError> {
        if std::env::var_os("KUBECONFIG").is_some() {
            let client = kube::Client::try_default()
                .await
                .map_err(|e| E2eError::Cluster(e.to_string()))?;
            return Ok(Self { client, env: None });
        }
        let env = TestEnv::shared(configure);
        let client = env
            .client()
            .await
            .map_err(|e| E2eError::Cluster(e.to_string()))?;
        Ok(Self {
            client,
            env: Some(env),
        })
    }

    /// Free bytes per node for [`CLASS`], from the CSIStorageCapacity objects of our driver.
    pub async fn capacity(&self) -> Result<BTreeMap<String, i64>, E2eError> {
        Ok(capacity_objects(&self.client)
            .await?
            .into_iter()
            .filter(|c| c.storage_class_name == CLASS)
            .filter_map(|c| {
                let node = capacity_node(&c, DRIVER)?;
                let bytes = c
                    .capacity
                    .and_then(|q| controllers::quantity::parse_bytes(&q.0).ok())?;
                Some((node, i64::try_from(bytes).unwrap_or(i64::MAX)))
            })
            .collect())
    }

    /// Starts a scenario in a fresh namespace `<name>-<random>`, after recording the capacity
    /// it must give back (waiting until every node of testenv publishes).
    pub async fn scenario(&self, name: &str) -> Result<Scenario, E2eError> {
        let expected = self.env.map_or(0, |env| {
            env.nodes()
                .iter()
                .filter(|n| n.driver && env.driver_socket(&n.name).is_some())
                .count()
        });
        let full = until("every node to publish capacity", WAIT, || async {
            let capacity = self.capacity().await.map_err(|e| e.to_string())?;
            if capacity.len() >= expected.max(1) {
                Ok(capacity)
            } else {
                Err(format!("{capacity:?}"))
            }
        })
        .await?;
        let namespace = testenv::test_namespace(&self.client, name)
            .await
            .map_err(api("creating the namespace"))?;
        Ok(Scenario {
            cluster: self.clone(),
            claims: Api::namespaced(self.client.clone(), &namespace),
            pods: Api::namespaced(self.client.clone(), &namespace),
            namespace,
            full,
            finished: false,
        })
    }
}

/// One scenario's namespace and what it must leave as it found it.
pub struct Scenario {
    /// The cluster.
    pub cluster: Cluster,
    /// The namespace.
    pub namespace: String,
    /// Claims of the namespace.
    pub claims: Api<PersistentVolumeClaim>,
    /// Pods of the namespace.
    pub pods: Api<Pod>,
    /// Capacity per node before the scenario.
    pub full: BTreeMap<String, i64>,
    finished: bool,
}

impl Drop for Scenario {
    /// A scenario that failed before [`Scenario::finish`] still removes its namespace (and
    /// so its pods, claims and volumes) before the next scenario's leak check: one failure
    /// must not fail every scenario after it.
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let namespace = self.namespace.clone();
        let kubeconfig = self.cluster.env.map(TestEnv::admin_kubeconfig);
        // The test's runtime is unwinding; a thread with its own runtime and client cleans up.
        let cleanup = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async {
                let client = match kubeconfig {
                    Some(path) => testenv::control_plane::client_from(&path, "admin")
                        .await
                        .map_err(|e| e.to_string())?,
                    None => kube::Client::try_default()
                        .await
                        .map_err(|e| e.to_string())?,
                };
                let namespaces = Api::<Namespace>::all(client);
                namespaces
                    .delete(&namespace, &DeleteParams::default())
                    .await
                    .map_err(|e| e.to_string())?;
                testenv::wait::wait_gone(&namespaces, &namespace, WAIT)
                    .await
                    .map_err(|e| e.to_string())
            })
        });
        match cleanup.join() {
            Ok(Ok(())) => eprintln!("scenario failed; namespace {} removed", self.namespace),
            Ok(Err(e)) => eprintln!("scenario failed; removing {}: {e}", self.namespace),
            Err(_) => eprintln!("scenario failed; removing {} panicked", self.namespace),
        }
    }
}

impl Scenario {
    /// Creates claim `name` of `class` and `size` (`Block` mode when `block`).
    pub async fn claim(
        &self,
        name: &str,
        class: &str,
        size: &str,
        block: bool,
    ) -> Result<PersistentVolumeClaim, E2eError> {
        let mut claim = test_objects::claim(&self.namespace, name, class, size);
        if block && let Some(spec) = claim.spec.as_mut() {
            spec.volume_mode = Some("Block".into());
        }
        self.claims
            .create(&PostParams::default(), &claim)
            .await
            .map_err(api(format!("creating claim {name}")))
    }

    /// Creates `pod`.
    pub async fn pod(&self, pod: &Pod) -> Result<Pod, E2eError> {
        self.pods
            .create(&PostParams::default(), pod)
            .await
            .map_err(api(format!(
                "creating pod {}",
                pod.metadata.name.as_deref().unwrap_or_default()
            )))
    }

    /// Pod `name` of this scenario's namespace as the cluster under test runs it: the
    /// [`runnable`] [`test_objects::pod`] of the workload [`image`] with `volumes` (those named
    /// in `block` as devices).
    pub fn workload(&self, name: &str, volumes: Vec<Volume>, block: &[&str]) -> Pod {
        runnable(
            test_objects::pod(&self.namespace, name, volumes),
            &image(),
            block,
        )
    }

    /// Creates pod `name` mounting claim `claim` as volume `data`.
    pub async fn pod_using(&self, name: &str, claim: &str) -> Result<Pod, E2eError> {
        self.pod(&self.workload(name, vec![claim_volume("data", claim)], &[]))
            .await
    }

    /// Creates claim `name` of `class` and `size` and pod `name` using it.
    pub async fn claim_and_pod(
        &self,
        name: &str,
        class: &str,
        size: &str,
    ) -> Result<Pod, E2eError> {
        self.claim(name, class, size, false).await?;
        self.pod_using(name, name).await
    }

    /// Waits until pod `name` runs and checks that the PV of its claim `claim` is pinned to
    /// the pod's node; returns the pod and the PV.
    pub async fn running_with_volume(
        &self,
        name: &str,
        claim: &str,
    ) -> Result<(Pod, PersistentVolume), E2eError> {
        let running = self.running(name).await?;
        let pv = self.volume_of(claim).await?;
        if pinned_node(&pv) != Some(node_of(&running)) {
            return Err(E2eError::Cluster(format!(
                "the PV of {claim} is pinned to {:?}, pod {name} runs on {}",
                pinned_node(&pv),
                node_of(&running)
            )));
        }
        Ok((running, pv))
    }

    /// The output of pod `name`'s script ([`test_objects::with_script`]), once its container is Ready (real
    /// clusters only: testenv's simulated kubelet runs no containers).
    pub async fn output(&self, name: &str) -> Result<String, E2eError> {
        until(
            &format!("pod {name}'s container to be Ready"),
            WAIT,
            || async {
                let pod = self.pods.get(name).await.map_err(|e| e.to_string())?;
                let statuses = pod
                    .status
                    .and_then(|s| s.container_statuses)
                    .unwrap_or_default();
                match statuses.first() {
                    Some(c) if c.ready && c.restart_count == 0 => Ok(()),
                    Some(c) => Err(format!("ready {}, {} restarts", c.ready, c.restart_count)),
                    None => Err("no container status".into()),
                }
            },
        )
        .await?;
        self.pods
            .logs(name, &Default::default())
            .await
            .map_err(api(format!("reading the log of pod {name}")))
    }

    /// Waits until pod `name` is Running; returns it.
    pub async fn running(&self, name: &str) -> Result<Pod, E2eError> {
        Ok(until(&format!("pod {name} to run"), WAIT, || async {
            let pod = self.pods.get(name).await.map_err(|e| e.to_string())?;
            let phase = pod.status.as_ref().and_then(|s| s.phase.clone());
            if phase.as_deref() == Some("Running") {
                Ok(pod)
            } else {
                Err(format!(
                    "phase {phase:?}, node {:?}",
                    pod.spec.as_ref().and_then(|s| s.node_name.clone())
                ))
            }
        })
        .await?)
    }

    /// The PV bound to claim `name`.
    pub async fn volume_of(&self, name: &str) -> Result<PersistentVolume, E2eError> {
        let claim = self
            .claims
            .get(name)
            .await
            .map_err(api(format!("reading claim {name}")))?;
        let pv = claim
            .spec
            .and_then(|s| s.volume_name)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| E2eError::Cluster(format!("claim {name} is not bound")))?;
        Api::<PersistentVolume>::all(self.cluster.client.clone())
            .get(&pv)
            .await
            .map_err(api(format!("reading PV {pv}")))
    }

    /// Messages of the namespace's Events with `reason`.
    pub async fn events(&self, reason: &str) -> Result<Vec<String>, E2eError> {
        let list = Api::<Event>::namespaced(self.cluster.client.clone(), &self.namespace)
            .list(&ListParams::default().fields(&format!("reason={reason}")))
            .await
            .map_err(api("listing Events"))?;
        Ok(list
            .items
            .into_iter()
            .map(|e| {
                format!(
                    "{}: {}",
                    e.involved_object.name.unwrap_or_default(),
                    e.message.unwrap_or_default()
                )
            })
            .collect())
    }

    /// PVs whose claim is in this namespace.
    pub async fn volumes(&self) -> Result<Vec<PersistentVolume>, E2eError> {
        let list = Api::<PersistentVolume>::all(self.cluster.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(api("listing PVs"))?;
        Ok(list
            .items
            .into_iter()
            .filter(|pv| {
                pv.spec
                    .as_ref()
                    .and_then(|s| s.claim_ref.as_ref())
                    .and_then(|r| r.namespace.as_deref())
                    == Some(self.namespace.as_str())
            })
            .collect())
    }

    /// Waits until no PV of the namespace's claims is left.
    pub async fn volumes_gone(&self) -> Result<(), E2eError> {
        until("the namespace's PVs to be gone", WAIT, || async {
            let left = self.volumes().await.map_err(|e| e.to_string())?;
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("{} left", left.len()))
            }
        })
        .await?;
        Ok(())
    }

    /// Deletes the namespace, waits until it and its PVs are gone, then checks for leaks.
    pub async fn finish(self) -> Result<(), E2eError> {
        self.finish_keeping(&[]).await
    }

    /// [`Scenario::finish`], except that the volumes `kept` (ids, on testenv) may remain.
    pub async fn finish_keeping(mut self, kept: &[String]) -> Result<(), E2eError> {
        self.finished = true;
        let namespaces = Api::<Namespace>::all(self.cluster.client.clone());
        namespaces
            .delete(&self.namespace, &DeleteParams::default())
            .await
            .map_err(api("deleting the namespace"))?;
        until("the namespace to be gone", WAIT, || async {
            match namespaces.get_opt(&self.namespace).await {
                Ok(None) => Ok(()),
                Ok(Some(ns)) => Err(format!("{:?}", ns.status.and_then(|s| s.conditions))),
                Err(e) => Err(e.to_string()),
            }
        })
        .await?;
        self.volumes_gone().await?;
        if let Some(env) = self.cluster.env {
            leak_check(env, kept).await?;
        }
        let full = &self.full;
        until("capacity to be back to full", WAIT, || async {
            let now = self.cluster.capacity().await.map_err(|e| e.to_string())?;
            let short: Vec<String> = full
                .iter()
                .filter(|(node, bytes)| now.get(*node).is_some_and(|n| n < *bytes))
                .map(|(node, bytes)| format!("{node}: {:?} of {bytes}", now.get(node)))
                .collect();
            if short.is_empty() {
                Ok(())
            } else {
                Err(short.join(", "))
            }
        })
        .await?;
        Ok(())
    }
}

/// The volumes the driver of `node` lists.
pub async fn node_volumes(env: &TestEnv, node: &str) -> Result<Vec<String>, String> {
    let socket = env
        .driver_socket(node)
        .ok_or_else(|| format!("no driver on {node}"))?;
    let channel = driver::client::connect(&socket)
        .await
        .map_err(|e| format!("connecting to {node}: {e}"))?;
    let mut csi = ControllerClient::new(channel);
    driver::client::volume_ids(&mut csi)
        .await
        .map_err(|e| format!("ListVolumes on {node}: {e}"))
}

/// No volume (beyond `kept`), mount or loop device of ours on any testenv node.
pub async fn leak_check(env: &TestEnv, kept: &[String]) -> Result<(), E2eError> {
    let nodes: Vec<String> = env
        .nodes()
        .iter()
        .filter(|n| env.driver_socket(&n.name).is_some())
        .map(|n| n.name.clone())
        .collect();
    until("no volume, mount or loop device left", WAIT, || async {
        let mut found = Vec::new();
        for node in &nodes {
            for id in node_volumes(env, node).await? {
                if !kept.contains(&id) {
                    found.push(format!("volume {id} on {node}"));
                }
            }
        }
        found.extend(
            testenv::leftovers::mounts_under(env.dir())
                .into_iter()
                .map(|m| format!("mount {m}")),
        );
        found.extend(
            testenv::leftovers::loop_devices_under(env.dir())
                .into_iter()
                .map(|(d, b)| format!("loop device {d} ({b})")),
        );
        if found.is_empty() {
            Ok(())
        } else {
            Err(found.join("; "))
        }
    })
    .await?;
    Ok(())
}

/// The volume size (bytes) for a burst of `pods` volumes that exceeds every one of `budgets`
/// (bytes per node) together but fits all of them under any greedy placement: the smallest
/// multiple of 4 MiB, at least 64 MiB, that divides every budget (so no node is left with a
/// useless remainder) with `pods` of them more than the largest budget and at most the total.
pub fn burst_size(budgets: &[i64], pods: i64) -> Option<i64> {
    const ALIGN: i64 = 4 * MI;
    let largest = budgets.iter().copied().max()?;
    let total: i64 = budgets.iter().sum();
    (64 * MI..=largest)
        .step_by(usize::try_from(ALIGN).ok()?)
        .find(|size| {
            budgets.iter().all(|b| b % size == 0)
                && pods
                    .checked_mul(*size)
                    .is_some_and(|burst| burst > largest && burst <= total)
        })
}

/// The node a pod runs on.
pub fn node_of(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default()
}

/// The node a PV is pinned to by its node affinity (`<driver>/node`).
pub fn pinned_node(pv: &PersistentVolume) -> Option<String> {
    controllers::volume_facts::pv_node(pv, DRIVER)
}

/// The CSI volume id of a PV.
pub fn volume_handle(pv: &PersistentVolume) -> String {
    pv.spec
        .as_ref()
        .and_then(|s| s.csi.as_ref())
        .map(|c| c.volume_handle.clone())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_sizes() {
        let cases: [(&[i64], i64, Option<i64>); 6] = [
            // testenv's budgets: 20 × 64 MiB exceed 1 GiB, fit in 2.25 GiB.
            (&[512, 768, 1024], 20, Some(64)),
            // two equal 4 GiB nodes: 20 × 256 MiB = 5 GiB.
            (&[4096, 4096], 20, Some(256)),
            // one node: a burst can never exceed it and fit.
            (&[4096], 20, None),
            (&[], 20, None),
            // no common divisor of at least 64 MiB.
            (&[100, 4096], 20, None),
            // too few pods to exceed the largest node.
            (&[512, 512], 1, None),
        ];
        for (budgets, pods, want) in cases {
            let bytes: Vec<i64> = budgets.iter().map(|b| b * MI).collect();
            assert_eq!(
                burst_size(&bytes, pods),
                want.map(|w| w * MI),
                "{budgets:?} MiB, {pods} pods"
            );
        }
    }
}
