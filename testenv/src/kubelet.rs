//! A simulated kubelet for testenv's nodes: for every pod bound to one of them it stages and
//! publishes the pod's volumes of our driver through that node's CSI socket (PVC volumes:
//! NodeStage then NodePublish; CSI inline volumes: NodePublish only, with kubelet's volume id and
//! pod information), then reports the pod Running; when the pod is deleted it unpublishes,
//! unstages and removes the pod object. Paths follow kubelet's layout under a per-node root, so
//! the whole volume life cycle runs on real loop devices and mounts.
//!
//! The decision of what to mount ([`pod_volumes`]) is a pure function over the pod and the
//! claims and volumes it names; the watcher around it stays thin.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use driver::csi::node_client::NodeClient;
use driver::csi::volume_capability::{
    AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode,
};
use driver::csi::{
    NodePublishVolumeRequest, NodeStageVolumeRequest, NodeUnpublishVolumeRequest,
    NodeUnstageVolumeRequest, VolumeCapability,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::watcher;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

/// `volume_context` keys kubelet adds on NodePublish when the CSIDriver has `podInfoOnMount`.
pub const POD_NAME: &str = "csi.storage.k8s.io/pod.name";
/// See [`POD_NAME`].
pub const POD_NAMESPACE: &str = "csi.storage.k8s.io/pod.namespace";
/// See [`POD_NAME`].
pub const POD_UID: &str = "csi.storage.k8s.io/pod.uid";
/// See [`POD_NAME`].
pub const POD_SERVICE_ACCOUNT: &str = "csi.storage.k8s.io/serviceAccount.name";
/// See [`POD_NAME`]: `"true"` for CSI inline volumes, `"false"` otherwise.
pub const EPHEMERAL: &str = "csi.storage.k8s.io/ephemeral";

/// Retry back-off of mount and unmount attempts, as kubelet retries its volume operations.
const FIRST_RETRY: Duration = Duration::from_millis(200);
const LAST_RETRY: Duration = Duration::from_secs(2);

/// Where kubelet of one node keeps pod and plugin directories.
#[derive(Clone, Debug)]
pub struct KubeletDirs {
    /// The node's `/var/lib/kubelet`.
    pub root: PathBuf,
}

impl KubeletDirs {
    /// `pods/<uid>`.
    pub fn pod(&self, uid: &str) -> PathBuf {
        self.root.join("pods").join(uid)
    }

    /// Publish target of a file-system volume named `dir` (the PV name, or the pod volume's
    /// name for inline volumes).
    pub fn mount_target(&self, uid: &str, dir: &str) -> PathBuf {
        self.pod(uid)
            .join("volumes/kubernetes.io~csi")
            .join(dir)
            .join("mount")
    }

    /// Staging path of a file-system PV: kubelet hashes the volume handle.
    pub fn mount_staging(&self, driver: &str, volume_handle: &str) -> PathBuf {
        self.root
            .join("plugins/kubernetes.io/csi")
            .join(driver)
            .join(hex::encode(Sha256::digest(volume_handle.as_bytes())))
            .join("globalmount")
    }

    /// Staging path of a raw block PV.
    pub fn block_staging(&self, pv: &str) -> PathBuf {
        self.root
            .join("plugins/kubernetes.io/csi/volumeDevices/staging")
            .join(pv)
    }

    /// Publish target of a raw block PV for pod `uid` (a file the driver creates).
    pub fn block_target(&self, pv: &str, uid: &str) -> PathBuf {
        self.root
            .join("plugins/kubernetes.io/csi/volumeDevices/publish")
            .join(pv)
            .join(uid)
    }
}

/// Kubelet's volume id of CSI inline volume `volume` of pod `uid`:
/// `csi-<sha256(uid + volume)>`.
pub fn inline_volume_id(uid: &str, volume: &str) -> String {
    let mut hash = Sha256::new();
    hash.update(uid.as_bytes());
    hash.update(volume.as_bytes());
    format!("csi-{}", hex::encode(hash.finalize()))
}

/// One volume of our driver in a pod, as kubelet mounts it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodVolume {
    /// The CSI driver that serves it.
    pub driver: String,
    /// The pod's name for the volume.
    pub name: String,
    /// The CSI volume id.
    pub volume_id: String,
    /// The PV, for claim volumes; `None` for CSI inline volumes (not staged).
    pub pv: Option<String>,
    /// NodeStage's path (claim volumes only).
    pub staging: Option<PathBuf>,
    /// NodePublish's target.
    pub target: PathBuf,
    /// Raw block rather than a file system.
    pub block: bool,
    /// File system type (empty: the driver's default).
    pub fs_type: String,
    /// Mount options of the PV.
    pub mount_flags: Vec<String>,
    /// Published read-only.
    pub read_only: bool,
    /// The PV's volume attributes, for NodeStage.
    pub stage_context: BTreeMap<String, String>,
    /// NodePublish's volume context: the attributes plus the pod's information.
    pub publish_context: BTreeMap<String, String>,
}

impl PodVolume {
    fn capability(&self) -> VolumeCapability {
        let access_type = if self.block {
            AccessType::Block(BlockVolume {})
        } else {
            AccessType::Mount(MountVolume {
                fs_type: self.fs_type.clone(),
                mount_flags: self.mount_flags.clone(),
                ..Default::default()
            })
        };
        VolumeCapability {
            access_type: Some(access_type),
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
        }
    }
}

/// Why a pod's volumes cannot be mounted yet (kubelet waits and retries).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Pending {
    /// The pod has no UID, name or namespace yet.
    #[error("the pod has no uid, name or namespace")]
    Incomplete,
    /// A claim the pod uses does not exist.
    #[error("claim {0} does not exist")]
    ClaimMissing(String),
    /// A claim the pod uses is not bound.
    #[error("claim {0} is not bound")]
    ClaimUnbound(String),
    /// The PV of a bound claim does not exist.
    #[error("volume {0} does not exist")]
    VolumeMissing(String),
}

/// The volumes of `drivers` that kubelet of `dirs` mounts for `pod`, in the pod's order, given
/// the claims of the pod's namespace and the PVs by name. Volumes of other drivers and kinds are
/// not kubelet's business here.
pub fn pod_volumes(
    pod: &Pod,
    drivers: &[&str],
    dirs: &KubeletDirs,
    claims: &BTreeMap<String, PersistentVolumeClaim>,
    pvs: &BTreeMap<String, PersistentVolume>,
) -> Result<Vec<PodVolume>, Pending> {
    let (Some(uid), Some(name), Some(namespace)) = (
        pod.metadata.uid.as_deref(),
        pod.metadata.name.as_deref(),
        pod.metadata.namespace.as_deref(),
    ) else {
        return Err(Pending::Incomplete);
    };
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(Vec::new());
    };
    let pod_info = |ephemeral: bool| {
        BTreeMap::from([
            (POD_NAME.to_string(), name.to_string()),
            (POD_NAMESPACE.to_string(), namespace.to_string()),
            (POD_UID.to_string(), uid.to_string()),
            (
                POD_SERVICE_ACCOUNT.to_string(),
                spec.service_account_name
                    .clone()
                    .unwrap_or_else(|| "default".into()),
            ),
            (EPHEMERAL.to_string(), ephemeral.to_string()),
        ])
    };
    let mut out = Vec::new();
    for volume in spec.volumes.iter().flatten() {
        if let Some(csi) = volume.csi.as_ref() {
            if !drivers.contains(&csi.driver.as_str()) {
                continue;
            }
            let attributes = csi.volume_attributes.clone().unwrap_or_default();
            let mut publish_context = attributes;
            publish_context.extend(pod_info(true));
            out.push(PodVolume {
                driver: csi.driver.clone(),
                name: volume.name.clone(),
                volume_id: inline_volume_id(uid, &volume.name),
                pv: None,
                staging: None,
                target: dirs.mount_target(uid, &volume.name),
                block: false,
                fs_type: csi.fs_type.clone().unwrap_or_default(),
                mount_flags: Vec::new(),
                read_only: csi.read_only.unwrap_or(false),
                stage_context: BTreeMap::new(),
                publish_context,
            });
            continue;
        }
        let (claim_name, read_only) = if let Some(source) = &volume.persistent_volume_claim {
            (source.claim_name.clone(), source.read_only.unwrap_or(false))
        } else if volume.ephemeral.is_some() {
            // Generic ephemeral volumes: the ephemeral-volume controller names the claim.
            (format!("{name}-{}", volume.name), false)
        } else {
            continue;
        };
        let claim = claims
            .get(&claim_name)
            .ok_or_else(|| Pending::ClaimMissing(claim_name.clone()))?;
        let pv_name = claim
            .spec
            .as_ref()
            .and_then(|s| s.volume_name.clone())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| Pending::ClaimUnbound(claim_name.clone()))?;
        let pv = pvs
            .get(&pv_name)
            .ok_or_else(|| Pending::VolumeMissing(pv_name.clone()))?;
        let Some(pv_spec) = pv.spec.as_ref() else {
            return Err(Pending::VolumeMissing(pv_name));
        };
        let Some(source) = pv_spec
            .csi
            .as_ref()
            .filter(|c| drivers.contains(&c.driver.as_str()))
        else {
            continue;
        };
        let block = pv_spec.volume_mode.as_deref() == Some("Block");
        let attributes = source.volume_attributes.clone().unwrap_or_default();
        let mut publish_context = attributes.clone();
        publish_context.extend(pod_info(false));
        let (staging, target) = if block {
            (
                dirs.block_staging(&pv_name),
                dirs.block_target(&pv_name, uid),
            )
        } else {
            (
                dirs.mount_staging(&source.driver, &source.volume_handle),
                dirs.mount_target(uid, &pv_name),
            )
        };
        out.push(PodVolume {
            driver: source.driver.clone(),
            name: volume.name.clone(),
            volume_id: source.volume_handle.clone(),
            pv: Some(pv_name),
            staging: Some(staging),
            target,
            block,
            fs_type: source.fs_type.clone().unwrap_or_default(),
            mount_flags: pv_spec.mount_options.clone().unwrap_or_default(),
            read_only: read_only || source.read_only.unwrap_or(false),
            stage_context: attributes,
            publish_context,
        });
    }
    Ok(out)
}

/// Which pods use each staged volume of a node: kubelet stages a volume once however many
/// pods use it, and unstages it after the last one is gone.
#[derive(Debug, Default)]
pub struct StageUsers {
    users: HashMap<(String, String), std::collections::BTreeSet<String>>,
}

impl StageUsers {
    /// Records that pod `uid` uses `volume` staged on `node`; true the first time this pod
    /// does (repeating it changes nothing).
    pub fn add(&mut self, node: &str, volume: &str, uid: &str) -> bool {
        self.users
            .entry((node.to_string(), volume.to_string()))
            .or_default()
            .insert(uid.to_string())
    }

    /// Pod `uid` no longer uses `volume` on `node`; true when no pod does any more (time to
    /// unstage).
    pub fn remove(&mut self, node: &str, volume: &str, uid: &str) -> bool {
        let key = (node.to_string(), volume.to_string());
        let Some(users) = self.users.get_mut(&key) else {
            return true;
        };
        users.remove(uid);
        if users.is_empty() {
            self.users.remove(&key);
            true
        } else {
            false
        }
    }
}

/// A node the kubelet serves.
#[derive(Clone, Debug)]
pub struct KubeletNode {
    /// Node name.
    pub name: String,
    /// The socket of the kubelet's first driver on that node.
    pub socket: PathBuf,
    /// The node's kubelet directories.
    pub dirs: KubeletDirs,
}

/// A volume kubelet has set up for a pod, with how long each step took.
#[derive(Clone, Debug)]
pub struct Mounted {
    /// Node.
    pub node: String,
    /// The volume.
    pub volume: PodVolume,
    /// NodeStage's duration (claim volumes).
    pub staged_in: Option<Duration>,
    /// NodePublish's duration.
    pub published_in: Duration,
}

#[derive(Default)]
struct PodState {
    node: String,
    setup: Option<CancellationToken>,
    setup_task: Option<tokio::task::JoinHandle<()>>,
    tearing_down: bool,
    /// Volumes set up, with timings (for callers).
    mounted: Vec<Mounted>,
    /// Volumes NodePublish was tried for: all are unpublished on teardown (idempotent), also
    /// those whose publish failed half-way.
    attempted: Vec<PodVolume>,
    /// Volumes staged for this pod (the pod is among their [`StageUsers`]).
    staged: Vec<PodVolume>,
}

#[derive(Default)]
struct Shared {
    pods: HashMap<String, PodState>,
    staged: StageUsers,
}

/// The CSI sockets kubelet knows: per driver, per node (what node-driver-registrar registers).
type Sockets = BTreeMap<String, BTreeMap<String, PathBuf>>;

/// The simulated kubelet of a set of nodes (see the module documentation).
#[derive(Clone)]
pub struct Kubelet {
    client: kube::Client,
    driver: String,
    sockets: Arc<Mutex<Sockets>>,
    nodes: Arc<BTreeMap<String, KubeletNode>>,
    shared: Arc<Mutex<Shared>>,
    shutdown: CancellationToken,
    /// Stops watching (and so setting up) pods; [`Kubelet::unmount_all`] cancels it first.
    watching: CancellationToken,
}

impl std::fmt::Debug for Kubelet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kubelet")
            .field("driver", &self.driver)
            .field("nodes", &self.nodes.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Kubelet {
    /// Starts watching pods for `nodes` on the current runtime until `shutdown`.
    pub fn spawn(
        client: kube::Client,
        driver: &str,
        nodes: Vec<KubeletNode>,
        shutdown: CancellationToken,
    ) -> Self {
        let sockets = BTreeMap::from([(
            driver.to_string(),
            nodes
                .iter()
                .map(|n| (n.name.clone(), n.socket.clone()))
                .collect(),
        )]);
        let kubelet = Self {
            client,
            driver: driver.to_string(),
            sockets: Arc::new(Mutex::new(sockets)),
            nodes: Arc::new(nodes.into_iter().map(|n| (n.name.clone(), n)).collect()),
            shared: Arc::default(),
            watching: shutdown.child_token(),
            shutdown,
        };
        tokio::spawn(kubelet.clone().watch());
        kubelet
    }

    /// Serves the volumes of one more driver, through `sockets` (node, socket), as kubelet does
    /// once a second driver's node-driver-registrar registers it; pods whose set-up began
    /// before are not revisited.
    pub fn serve_driver(&self, driver: &str, sockets: impl IntoIterator<Item = (String, PathBuf)>) {
        self.lock_sockets()
            .insert(driver.to_string(), sockets.into_iter().collect());
    }

    /// Stops serving `driver`'s volumes, as kubelet does when its plugin goes away.
    pub fn forget_driver(&self, driver: &str) {
        self.lock_sockets().remove(driver);
    }

    fn lock_sockets(&self) -> std::sync::MutexGuard<'_, Sockets> {
        self.sockets.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The socket of `driver` on `node`.
    fn socket(&self, driver: &str, node: &str) -> Result<PathBuf, String> {
        self.lock_sockets()
            .get(driver)
            .and_then(|nodes| nodes.get(node))
            .cloned()
            .ok_or_else(|| {
                format!(
                    "driver name {driver} not found in the list of registered CSI drivers on {node}"
                )
            })
    }

    /// The volumes set up for pod `uid` so far.
    pub fn mounted(&self, uid: &str) -> Vec<Mounted> {
        self.lock()
            .pods
            .get(uid)
            .map(|p| p.mounted.clone())
            .unwrap_or_default()
    }

    /// Pods the kubelet still tracks (set up, or being torn down).
    pub fn pods(&self) -> Vec<String> {
        self.lock().pods.keys().cloned().collect()
    }

    /// Stops watching pods and unpublishes and unstages every volume set up so far (leaving
    /// the pod objects alone), as a node draining its pods would, so that the drivers can stop
    /// with nothing mounted; gives up on a volume after `timeout`.
    pub async fn unmount_all(&self, timeout: Duration) {
        self.watching.cancel();
        let pods: Vec<(
            String,
            Option<CancellationToken>,
            Option<tokio::task::JoinHandle<()>>,
        )> = {
            let mut shared = self.lock();
            shared
                .pods
                .iter_mut()
                .map(|(uid, p)| {
                    p.tearing_down = true;
                    (uid.clone(), p.setup.take(), p.setup_task.take())
                })
                .collect()
        };
        let work = async {
            for (uid, cancel, task) in pods {
                if let Some(cancel) = cancel {
                    cancel.cancel();
                }
                if let Some(task) = task {
                    let _ = task.await;
                }
                let node = self.lock().pods.get(&uid).map(|p| p.node.clone());
                if let Some(node) = node.and_then(|n| self.nodes.get(&n)) {
                    self.release_volumes(node, &uid, &uid).await;
                }
            }
        };
        if tokio::time::timeout(timeout, work).await.is_err() {
            tracing::warn!("kubelet: volumes still mounted after {timeout:?}");
        }
    }

    /// The kubelet directories of `node`.
    pub fn dirs(&self, node: &str) -> Option<&KubeletDirs> {
        self.nodes.get(node).map(|n| &n.dirs)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    async fn watch(self) {
        let pods = Api::<Pod>::all(self.client.clone());
        let mut events = watcher(pods, watcher::Config::default()).boxed();
        loop {
            let event = tokio::select! {
                _ = self.watching.cancelled() => return,
                event = events.next() => event,
            };
            match event {
                None => return,
                Some(Err(e)) => tracing::debug!("kubelet: pod watch: {e}"),
                Some(Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod))) => {
                    self.observe(pod, false);
                }
                Some(Ok(watcher::Event::Delete(pod))) => self.observe(pod, true),
                Some(Ok(_)) => {}
            }
        }
    }

    fn observe(&self, pod: Pod, gone: bool) {
        let Some(node) = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .and_then(|n| self.nodes.get(n))
            .cloned()
        else {
            return;
        };
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        let deleting = gone || pod.metadata.deletion_timestamp.is_some();
        let mut shared = self.lock();
        let state = shared.pods.entry(uid.clone()).or_default();
        state.node.clone_from(&node.name);
        if deleting {
            if state.tearing_down {
                return;
            }
            state.tearing_down = true;
            if let Some(setup) = state.setup.take() {
                setup.cancel();
            }
            drop(shared);
            tokio::spawn(self.clone().tear_down(node, pod, uid, !gone));
        } else if state.setup.is_none() && !state.tearing_down {
            let token = self.shutdown.child_token();
            state.setup = Some(token.clone());
            state.setup_task = Some(tokio::spawn(self.clone().set_up(node, pod, uid, token)));
        }
    }

    /// Mounts the pod's volumes, retrying until they are mounted or the pod goes away, then
    /// reports the pod Running.
    async fn set_up(self, node: KubeletNode, pod: Pod, uid: String, cancel: CancellationToken) {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let waiting = format!("pod {namespace}/{name} waiting for its volumes");
        let Some(volumes) = retry(&cancel, &waiting, || self.plan(&node, &pod, &namespace)).await
        else {
            return;
        };
        for volume in volumes {
            match self.lock().pods.get_mut(&uid) {
                Some(state) => state.attempted.push(volume.clone()),
                None => return,
            }
            let what = format!(
                "mounting {} of {namespace}/{name} on {}",
                volume.name, node.name
            );
            let Some(mounted) = retry(&cancel, &what, || self.mount(&node, &uid, &volume)).await
            else {
                return;
            };
            match self.lock().pods.get_mut(&uid) {
                Some(state) => state.mounted.push(mounted),
                None => return,
            }
            if cancel.is_cancelled() {
                return;
            }
        }
        let what = format!("reporting {namespace}/{name} Running");
        let report = || async { gone_is_done(self.report_running(&pod, &namespace, &name).await) };
        if retry(&cancel, &what, report).await.is_none() {
            return;
        }
        tracing::info!(pod = %name, namespace = %namespace, node = %node.name, "kubelet: pod Running");
    }

    async fn plan(
        &self,
        node: &KubeletNode,
        pod: &Pod,
        namespace: &str,
    ) -> Result<Vec<PodVolume>, String> {
        let mut claims = BTreeMap::new();
        let mut pvs = BTreeMap::new();
        let claim_api = Api::<PersistentVolumeClaim>::namespaced(self.client.clone(), namespace);
        let pv_api = Api::<PersistentVolume>::all(self.client.clone());
        // Fetch what the pure planner asks for until it stops asking.
        let drivers: Vec<String> = self.lock_sockets().keys().cloned().collect();
        let drivers: Vec<&str> = drivers.iter().map(String::as_str).collect();
        loop {
            match pod_volumes(pod, &drivers, &node.dirs, &claims, &pvs) {
                Ok(v) => return Ok(v),
                Err(Pending::ClaimMissing(c)) if !claims.contains_key(&c) => {
                    match claim_api.get_opt(&c).await.map_err(|e| e.to_string())? {
                        Some(claim) => claims.insert(c, claim),
                        None => return Err(Pending::ClaimMissing(c).to_string()),
                    };
                }
                Err(Pending::VolumeMissing(v)) if !pvs.contains_key(&v) => {
                    match pv_api.get_opt(&v).await.map_err(|e| e.to_string())? {
                        Some(pv) => pvs.insert(v, pv),
                        None => return Err(Pending::VolumeMissing(v).to_string()),
                    };
                }
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    async fn mount(
        &self,
        node: &KubeletNode,
        uid: &str,
        volume: &PodVolume,
    ) -> Result<Mounted, String> {
        let socket = self.socket(&volume.driver, &node.name)?;
        let channel = driver::client::connect(&socket)
            .await
            .map_err(|e| format!("connecting to {}: {e}", socket.display()))?;
        let mut csi = NodeClient::new(channel);
        let mut staged_in = None;
        if let Some(staging) = &volume.staging {
            // Kubelet creates the staging directory; for raw block too.
            create_dir(staging)?;
            let start = Instant::now();
            csi.node_stage_volume(NodeStageVolumeRequest {
                volume_id: volume.volume_id.clone(),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(volume.capability()),
                volume_context: volume.stage_context.clone().into_iter().collect(),
                ..Default::default()
            })
            .await
            .map_err(|e| format!("NodeStageVolume {}: {e}", volume.volume_id))?;
            staged_in = Some(start.elapsed());
            let mut shared = self.lock();
            let Shared { pods, staged } = &mut *shared;
            if let Some(state) = pods.get_mut(uid)
                && staged.add(&node.name, &volume.volume_id, uid)
            {
                state.staged.push(volume.clone());
            }
        }
        if let Some(parent) = volume.target.parent() {
            create_dir(parent)?;
        }
        let start = Instant::now();
        let published = csi
            .node_publish_volume(NodePublishVolumeRequest {
                volume_id: volume.volume_id.clone(),
                staging_target_path: volume
                    .staging
                    .as_ref()
                    .map(|s| s.display().to_string())
                    .unwrap_or_default(),
                target_path: volume.target.display().to_string(),
                volume_capability: Some(volume.capability()),
                readonly: volume.read_only,
                volume_context: volume.publish_context.clone().into_iter().collect(),
                ..Default::default()
            })
            .await;
        if let Err(e) = published {
            // Still staged and counted: the retry stages again (idempotent), teardown unstages.
            return Err(format!("NodePublishVolume {}: {e}", volume.volume_id));
        }
        tracing::debug!(pod = %uid, volume = %volume.name, "kubelet: published");
        Ok(Mounted {
            node: node.name.clone(),
            volume: volume.clone(),
            staged_in,
            published_in: start.elapsed(),
        })
    }

    async fn report_running(&self, pod: &Pod, namespace: &str, name: &str) -> kube::Result<()> {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let containers: Vec<serde_json::Value> = pod
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .map(|c| {
                serde_json::json!({
                    "name": c.name,
                    "image": c.image.clone().unwrap_or_default(),
                    "imageID": "",
                    "containerID": format!("testenv://{}", c.name),
                    "ready": true,
                    "started": true,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": now}},
                })
            })
            .collect();
        let condition =
            |t: &str| serde_json::json!({"type": t, "status": "True", "lastTransitionTime": now});
        let status = serde_json::json!({
            "status": {
                "phase": "Running",
                "startTime": now,
                "hostIP": "127.0.0.1",
                "podIP": "127.0.0.1",
                "conditions": [
                    condition("PodScheduled"),
                    condition("Initialized"),
                    condition("ContainersReady"),
                    condition("Ready"),
                ],
                "containerStatuses": containers,
            }
        });
        Api::<Pod>::namespaced(self.client.clone(), namespace)
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .map(|_| ())
    }

    /// Unpublishes and unstages what set-up mounted (waiting for an ongoing set-up to stop),
    /// removes the pod's directory, then, when the pod object still exists, deletes it with no
    /// grace (precondition: its UID).
    async fn tear_down(self, node: KubeletNode, pod: Pod, uid: String, delete_object: bool) {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        // Set-up stops after the CSI call in flight, which it records: wait for it, so that
        // nothing it publishes escapes the unpublishing below.
        let setup = self
            .lock()
            .pods
            .get_mut(&uid)
            .and_then(|p| p.setup_task.take());
        if let Some(task) = setup {
            let _ = task.await;
        }
        self.release_volumes(&node, &uid, &format!("{namespace}/{name}"))
            .await;
        let _ = std::fs::remove_dir_all(node.dirs.pod(&uid));
        if delete_object {
            let params = DeleteParams {
                grace_period_seconds: Some(0),
                preconditions: Some(Preconditions {
                    uid: Some(uid.clone()),
                    resource_version: None,
                }),
                ..Default::default()
            };
            let api = Api::<Pod>::namespaced(self.client.clone(), &namespace);
            let what = format!("deleting pod {namespace}/{name}");
            let delete = || async { gone_is_done(api.delete(&name, &params).await.map(|_| ())) };
            retry(&self.shutdown, &what, delete).await;
        }
        self.lock().pods.remove(&uid);
        tracing::info!(pod = %name, namespace = %namespace, node = %node.name, "kubelet: pod removed");
    }

    /// Unpublishes every volume set-up tried to publish for pod `uid`, then unstages those it
    /// staged that no other pod uses.
    async fn release_volumes(&self, node: &KubeletNode, uid: &str, pod: &str) {
        let (attempted, staged) = match self.lock().pods.get_mut(uid) {
            Some(p) => {
                p.mounted.clear();
                (
                    std::mem::take(&mut p.attempted),
                    std::mem::take(&mut p.staged),
                )
            }
            None => return,
        };
        for volume in attempted.iter().rev() {
            let what = format!("unpublishing {} of {pod} on {}", volume.name, node.name);
            retry(&self.shutdown, &what, || self.unpublish(node, volume)).await;
        }
        for volume in &staged {
            let last = self
                .lock()
                .staged
                .remove(&node.name, &volume.volume_id, uid);
            if last {
                let what = format!("unstaging {} of {pod} on {}", volume.name, node.name);
                retry(&self.shutdown, &what, || self.unstage(node, volume)).await;
            }
        }
    }

    async fn unpublish(&self, node: &KubeletNode, volume: &PodVolume) -> Result<(), String> {
        let socket = self.socket(&volume.driver, &node.name)?;
        let channel = driver::client::connect(&socket)
            .await
            .map_err(|e| format!("connecting to {}: {e}", socket.display()))?;
        NodeClient::new(channel)
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: volume.volume_id.clone(),
                target_path: volume.target.display().to_string(),
            })
            .await
            .map_err(|e| format!("NodeUnpublishVolume {}: {e}", volume.volume_id))?;
        // Kubelet removes the volume's directory once the driver has unpublished.
        if let Some(dir) = volume.target.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
        Ok(())
    }

    async fn unstage(&self, node: &KubeletNode, volume: &PodVolume) -> Result<(), String> {
        let Some(staging) = &volume.staging else {
            return Ok(());
        };
        let socket = self.socket(&volume.driver, &node.name)?;
        let channel = driver::client::connect(&socket)
            .await
            .map_err(|e| format!("connecting to {}: {e}", socket.display()))?;
        NodeClient::new(channel)
            .node_unstage_volume(NodeUnstageVolumeRequest {
                volume_id: volume.volume_id.clone(),
                staging_target_path: staging.display().to_string(),
            })
            .await
            .map_err(|e| format!("NodeUnstageVolume {}: {e}", volume.volume_id))?;
        let dir = if volume.block {
            staging.clone()
        } else {
            staging
                .parent()
                .map_or_else(|| staging.clone(), Path::to_path_buf)
        };
        let _ = std::fs::remove_dir_all(dir);
        Ok(())
    }
}

fn create_dir(path: &Path) -> Result<(), String> {
    std::fs::create_dir_all(path).map_err(|e| format!("creating {}: {e}", path.display()))
}

/// Calls `attempt` until it succeeds, logging each failure as `what` and backing off as
/// kubelet does between volume operations; `None` when `cancel` fires first.
async fn retry<T, F, Fut>(cancel: &CancellationToken, what: &str, mut attempt: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let mut delay = FIRST_RETRY;
    loop {
        match attempt().await {
            Ok(value) => return Some(value),
            Err(e) => tracing::warn!("kubelet: {what}: {e}"),
        }
        if !pause(cancel, &mut delay).await {
            return None;
        }
    }
}

/// An API write whose object is gone (404) or changed identity (409: UID precondition) has
/// nothing left to do.
fn gone_is_done(result: kube::Result<()>) -> Result<(), String> {
    match result {
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(()),
        other => other.map_err(|e| e.to_string()),
    }
}

/// Waits `delay` (doubled up to [`LAST_RETRY`] for next time); false when cancelled first.
async fn pause(cancel: &CancellationToken, delay: &mut Duration) -> bool {
    let wait = *delay;
    *delay = (*delay * 2).min(LAST_RETRY);
    tokio::select! {
        _ = cancel.cancelled() => false,
        _ = tokio::time::sleep(wait) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use controllers::test_objects;
    use k8s_openapi::api::core::v1::{
        CSIPersistentVolumeSource, EphemeralVolumeSource, PersistentVolumeClaimSpec,
        PersistentVolumeSpec, PodSpec, Volume,
    };
    use kube::api::ObjectMeta;

    const DRIVER: &str = "pmem-csi.intel.com";

    fn dirs() -> KubeletDirs {
        KubeletDirs {
            root: PathBuf::from("/k"),
        }
    }

    fn pod(volumes: Vec<Volume>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("app".into()),
                namespace: Some("ns".into()),
                uid: Some("u1".into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                volumes: Some(volumes),
                service_account_name: Some("sa".into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// A [`test_objects::claim_volume`] that says whether it is read-only.
    fn claim_volume(name: &str, claim: &str, read_only: bool) -> Volume {
        let mut volume = test_objects::claim_volume(name, claim);
        if let Some(source) = volume.persistent_volume_claim.as_mut() {
            source.read_only = Some(read_only);
        }
        volume
    }

    fn inline(name: &str, driver: &str) -> Volume {
        test_objects::inline_volume(name, driver, Some("1Gi"), Some("xfs"))
    }

    fn claim(name: &str, pv: Option<&str>) -> (String, PersistentVolumeClaim) {
        (
            name.into(),
            PersistentVolumeClaim {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    ..Default::default()
                },
                spec: Some(PersistentVolumeClaimSpec {
                    volume_name: pv.map(str::to_string),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
    }

    fn pv(name: &str, driver: &str, mode: Option<&str>) -> (String, PersistentVolume) {
        (
            name.into(),
            PersistentVolume {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    ..Default::default()
                },
                spec: Some(PersistentVolumeSpec {
                    volume_mode: mode.map(str::to_string),
                    mount_options: Some(vec!["noatime".into()]),
                    csi: Some(CSIPersistentVolumeSource {
                        driver: driver.into(),
                        volume_handle: format!("handle-{name}"),
                        fs_type: Some("ext4".into()),
                        volume_attributes: Some(BTreeMap::from([(
                            "eraseafter".into(),
                            "true".into(),
                        )])),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
    }

    #[test]
    fn each_volume_goes_to_its_own_driver_and_others_are_left_alone() {
        const SECOND: &str = "second.pmem-csi.intel.com";
        let pod = pod(vec![
            claim_volume("a", "data-a", false),
            claim_volume("b", "data-b", false),
            inline("c", SECOND),
            inline("d", "other.example.com"),
        ]);
        let claims = BTreeMap::from([claim("data-a", Some("pv-a")), claim("data-b", Some("pv-b"))]);
        let pvs = BTreeMap::from([pv("pv-a", DRIVER, None), pv("pv-b", SECOND, None)]);
        let both = pod_volumes(&pod, &[DRIVER, SECOND], &dirs(), &claims, &pvs).expect("planned");
        let drivers: Vec<(&str, &str)> = both
            .iter()
            .map(|v| (v.name.as_str(), v.driver.as_str()))
            .collect();
        assert_eq!(drivers, vec![("a", DRIVER), ("b", SECOND), ("c", SECOND)]);
        assert_eq!(
            both[1].staging,
            Some(dirs().mount_staging(SECOND, "handle-pv-b")),
            "staged under its own driver's directory"
        );
        let first = pod_volumes(&pod, &[DRIVER], &dirs(), &claims, &pvs).expect("planned");
        assert_eq!(
            first.len(),
            1,
            "volumes of a driver this kubelet does not serve are not its business: {first:?}"
        );
    }

    #[test]
    fn a_volume_is_unstaged_after_its_last_pod() {
        let mut users = StageUsers::default();
        assert!(users.add("n1", "v", "a"), "first use by a");
        assert!(!users.add("n1", "v", "a"), "a again: nothing new");
        assert!(users.add("n1", "v", "b"), "first use by b");
        assert!(users.add("n2", "v", "a"), "another node is another volume");
        assert!(!users.remove("n1", "v", "a"), "b still uses it");
        assert!(!users.remove("n1", "v", "a"), "a twice: b still uses it");
        assert!(users.remove("n1", "v", "b"), "last user gone");
        assert!(users.remove("n1", "v", "b"), "unknown: nothing holds it");
        assert!(users.remove("n2", "v", "a"));
    }

    #[test]
    fn inline_volume_id_is_kubelets() {
        // sha256("u1" + "scratch"), computed independently (Python hashlib).
        assert_eq!(
            inline_volume_id("u1", "scratch"),
            format!("csi-{}", hex::encode(Sha256::digest(b"u1scratch")))
        );
        assert_ne!(inline_volume_id("u1", "a"), inline_volume_id("u2", "a"));
        assert_eq!(inline_volume_id("u1", "a").len(), 4 + 64);
    }

    #[test]
    fn claim_and_inline_volumes_are_planned_with_kubelets_paths_and_context() {
        let pod = pod(vec![
            claim_volume("data", "c1", true),
            inline("scratch", DRIVER),
            inline("other", "other.example.com"),
            Volume {
                name: "token".into(),
                ..Default::default()
            },
        ]);
        let claims = BTreeMap::from([claim("c1", Some("pv1"))]);
        let pvs = BTreeMap::from([pv("pv1", DRIVER, None)]);
        let planned = pod_volumes(&pod, &[DRIVER], &dirs(), &claims, &pvs).expect("planned");
        assert_eq!(planned.len(), 2);
        let data = &planned[0];
        assert_eq!(data.volume_id, "handle-pv1");
        assert_eq!(data.pv.as_deref(), Some("pv1"));
        assert_eq!(
            data.staging.as_deref(),
            Some(dirs().mount_staging(DRIVER, "handle-pv1").as_path())
        );
        assert!(
            data.staging
                .as_ref()
                .is_some_and(|s| s.ends_with("globalmount"))
        );
        assert_eq!(
            data.target,
            PathBuf::from("/k/pods/u1/volumes/kubernetes.io~csi/pv1/mount")
        );
        assert!(data.read_only && !data.block);
        assert_eq!(data.fs_type, "ext4");
        assert_eq!(data.mount_flags, vec!["noatime".to_string()]);
        assert_eq!(
            data.stage_context,
            BTreeMap::from([("eraseafter".to_string(), "true".to_string())])
        );
        assert_eq!(data.publish_context[EPHEMERAL], "false");
        assert_eq!(data.publish_context[POD_UID], "u1");
        assert_eq!(data.publish_context["eraseafter"], "true");
        let scratch = &planned[1];
        assert_eq!(scratch.volume_id, inline_volume_id("u1", "scratch"));
        assert_eq!(scratch.staging, None);
        assert_eq!(scratch.fs_type, "xfs");
        assert_eq!(scratch.publish_context[EPHEMERAL], "true");
        assert_eq!(scratch.publish_context[POD_NAME], "app");
        assert_eq!(scratch.publish_context[POD_NAMESPACE], "ns");
        assert_eq!(scratch.publish_context[POD_SERVICE_ACCOUNT], "sa");
        assert_eq!(scratch.publish_context["size"], "1Gi");
        assert_eq!(
            scratch.target,
            PathBuf::from("/k/pods/u1/volumes/kubernetes.io~csi/scratch/mount")
        );
    }

    #[test]
    fn block_and_generic_ephemeral_volumes() {
        let pod = pod(vec![Volume {
            name: "dev".into(),
            ephemeral: Some(EphemeralVolumeSource::default()),
            ..Default::default()
        }]);
        let claims = BTreeMap::from([claim("app-dev", Some("pv2"))]);
        let pvs = BTreeMap::from([pv("pv2", DRIVER, Some("Block"))]);
        let planned = pod_volumes(&pod, &[DRIVER], &dirs(), &claims, &pvs).expect("planned");
        assert_eq!(planned.len(), 1);
        assert!(planned[0].block);
        assert_eq!(planned[0].staging, Some(dirs().block_staging("pv2")));
        assert_eq!(
            planned[0].target,
            PathBuf::from("/k/plugins/kubernetes.io/csi/volumeDevices/publish/pv2/u1")
        );
        assert!(matches!(
            planned[0].capability().access_type,
            Some(AccessType::Block(_))
        ));
    }

    type Case<'a> = (
        &'a Pod,
        BTreeMap<String, PersistentVolumeClaim>,
        BTreeMap<String, PersistentVolume>,
        Result<usize, Pending>,
    );

    #[test]
    fn what_is_missing_is_named() {
        let with_claim = pod(vec![claim_volume("data", "c1", false)]);
        let none = BTreeMap::new();
        let cases: Vec<Case> = vec![
            (
                &with_claim,
                none.clone(),
                BTreeMap::new(),
                Err(Pending::ClaimMissing("c1".into())),
            ),
            (
                &with_claim,
                BTreeMap::from([claim("c1", None)]),
                BTreeMap::new(),
                Err(Pending::ClaimUnbound("c1".into())),
            ),
            (
                &with_claim,
                BTreeMap::from([claim("c1", Some(""))]),
                BTreeMap::new(),
                Err(Pending::ClaimUnbound("c1".into())),
            ),
            (
                &with_claim,
                BTreeMap::from([claim("c1", Some("pv1"))]),
                BTreeMap::new(),
                Err(Pending::VolumeMissing("pv1".into())),
            ),
            // A PV of another driver is not ours to mount.
            (
                &with_claim,
                BTreeMap::from([claim("c1", Some("pv1"))]),
                BTreeMap::from([pv("pv1", "other.example.com", None)]),
                Ok(0),
            ),
            (
                &with_claim,
                BTreeMap::from([claim("c1", Some("pv1"))]),
                BTreeMap::from([pv("pv1", DRIVER, None)]),
                Ok(1),
            ),
        ];
        for (pod, claims, pvs, want) in cases {
            let got = pod_volumes(pod, &[DRIVER], &dirs(), &claims, &pvs).map(|v| v.len());
            assert_eq!(got, want, "claims {:?}", claims.keys().collect::<Vec<_>>());
        }
        let mut anonymous = with_claim.clone();
        anonymous.metadata.uid = None;
        assert_eq!(
            pod_volumes(&anonymous, &[DRIVER], &dirs(), &none, &BTreeMap::new()),
            Err(Pending::Incomplete)
        );
    }
}
