//! Crash test of `pmem-csi node --device-mode=emulated`: thousands of creates, deletes and
//! stage/unstage cycles while the driver is killed with SIGKILL, at random moments and at named
//! fault points. After every kill the driver restarts and the interrupted call is retried, as
//! external-provisioner and kubelet retry. Throughout and at the end, the volumes that exist are
//! exactly those created and not deleted, and no loop device or mount outlives an unstage.
//! Between some starts a state file is corrupted or the emulated directory is empty for one
//! start: no device's content may change, and no state may be lost.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use driver::csi::controller_client::ControllerClient;
use driver::csi::node_client::NodeClient;
use driver::csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use driver::csi::*;
use testenv::node_driver::{self, NodeDriverDirs};
use testenv::process::Component;
use testenv::{Leftovers, ProcessGroup};
use tonic::transport::Channel;

const OPERATIONS: usize = 3000;
const MIN_KILLS: usize = 300;
const VOLUME_SIZE: i64 = 4 << 20;
/// Stop creating beyond this many volumes, so one region listing stays cheap.
const MAX_VOLUMES: usize = 60;

/// The fault points of create, delete and stage, and the operation that reaches each (a
/// growth's are exercised by tests/expansion.rs).
const FAULT_POINTS: &[(&str, Op)] = &[
    ("after-state-write", Op::Create),
    ("after-allocation-open", Op::Create),
    ("after-allocation", Op::Create),
    ("after-loop-attach", Op::Stage),
    ("after-mkfs", Op::Stage),
    ("after-mount", Op::Stage),
    ("before-state-removal", Op::Delete),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Create,
    Delete,
    Stage,
}

/// xorshift64*: reproducible from the printed seed, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

struct Cluster {
    root: PathBuf,
    dirs: NodeDriverDirs,
    group: ProcessGroup,
    driver: Option<Component>,
    controller: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    /// The fault point the running driver dies at, if any.
    fault: Option<&'static str>,
    kills: usize,
    fault_kills: usize,
    restarts: usize,
    /// Corrupt states and empty regions survived.
    disturbances: usize,
}

fn mount() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
    }
}

async fn launch(
    dirs: &NodeDriverDirs,
    group: &ProcessGroup,
    fault: Option<&str>,
) -> (Component, ControllerClient<Channel>, NodeClient<Channel>) {
    let env: Vec<(&str, &str)> = fault
        .map(|f| vec![(driver::faults::FAULT_POINT_ENV, f)])
        .unwrap_or_default();
    let args = node_driver::emulated_args("node-1", dirs, "1Gi");
    let component = node_driver::start(
        Path::new(env!("CARGO_BIN_EXE_pmem-csi")),
        args,
        dirs,
        group,
        &env,
    )
    .await
    .unwrap_or_else(|e| panic!("driver restart failed: {e}"));
    let channel = driver::client::connect(&dirs.socket)
        .await
        .expect("connect");
    (
        component,
        ControllerClient::new(channel.clone()),
        NodeClient::new(channel),
    )
}

impl Cluster {
    /// Replaces the driver (stopping it if it still runs) with one dying at `fault`, if given;
    /// start-up repair runs each time.
    async fn restart(&mut self, fault: Option<&'static str>) {
        if let Some(old) = self.driver.take() {
            old.stop().await;
        }
        let (driver, controller, node) = launch(&self.dirs, &self.group, fault).await;
        self.driver = Some(driver);
        self.controller = controller;
        self.node = node;
        self.fault = fault;
        self.restarts += 1;
        let tmp = std::fs::read_dir(&self.dirs.state)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
                    .count()
            })
            .unwrap_or(0);
        assert_eq!(tmp, 0, "start-up repair must remove temporary state files");
    }

    fn driver_exited(&mut self) -> bool {
        self.driver
            .as_mut()
            .is_some_and(|d| d.check_running().is_err())
    }

    /// Waits up to `wait` for the driver to have died; if it has, counts the kill and starts
    /// a fresh driver.
    async fn restart_if_dead(&mut self, wait: Duration) -> bool {
        let deadline = std::time::Instant::now() + wait;
        loop {
            if self.driver_exited() {
                self.kills += 1;
                if self.fault.is_some() {
                    self.fault_kills += 1;
                }
                self.restart(None).await;
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Retries `call` as external-provisioner and kubelet do, until it succeeds; a failure is
    /// only acceptable when the driver died during the call.
    async fn retry<F, Fut>(&mut self, what: &str, mut call: F)
    where
        F: FnMut(ControllerClient<Channel>, NodeClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<(), tonic::Status>>,
    {
        for attempt in 0..20 {
            match call(self.controller.clone(), self.node.clone()).await {
                Ok(()) => return,
                Err(status) => {
                    let died = self.restart_if_dead(Duration::from_secs(2)).await;
                    assert!(
                        died,
                        "{what} failed on a running driver (attempt {attempt}): {status:?}"
                    );
                }
            }
        }
        panic!("{what} did not succeed after 20 attempts");
    }

    /// The SHA-256 of every region file's head (where ext4 keeps its superblocks and an erase
    /// starts) and its length: a device's content must survive every restart. Whole files
    /// would cost a minute of hashing per check in a debug build.
    fn region_digests(&self) -> BTreeMap<String, String> {
        use sha2::Digest;
        use std::io::Read;
        std::fs::read_dir(&self.dirs.region)
            .expect("region")
            .flatten()
            .map(|e| {
                let mut bytes = Vec::new();
                std::fs::File::open(e.path())
                    .and_then(|f| f.take(256 << 10).read_to_end(&mut bytes))
                    .expect("read region file");
                let len = e.metadata().expect("stat").len();
                bytes.extend_from_slice(&len.to_le_bytes());
                let hex: String = sha2::Sha256::digest(&bytes)
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                (e.file_name().to_string_lossy().into_owned(), hex)
            })
            .collect()
    }

    /// A state file turns to garbage between two starts: the volume is quarantined, its device
    /// kept byte for byte; the operator puts the state back and the volume returns.
    async fn corrupt_one_state(&mut self, model: &BTreeMap<String, String>) {
        let Some(id) = model.values().next().cloned() else {
            return;
        };
        if let Some(old) = self.driver.take() {
            old.stop().await;
        }
        let before = self.region_digests();
        let state = self.dirs.state.join(format!("{id}.json"));
        let saved = std::fs::read(&state).expect("state");
        std::fs::write(&state, &saved[..saved.len() / 2]).expect("truncate state");
        self.restart(None).await;
        let mut without: Vec<String> = expected(model);
        without.retain(|v| *v != id);
        assert_eq!(self.list().await, without, "{id} quarantined");
        assert_eq!(self.region_digests(), before, "a device changed at start");
        let quarantined = self.dirs.state.join(format!("{id}.json.quarantined"));
        assert!(quarantined.exists(), "{id}: no quarantined state");
        if let Some(old) = self.driver.take() {
            old.stop().await;
        }
        std::fs::remove_file(&quarantined).expect("operator clears the quarantine");
        std::fs::write(&state, &saved).expect("operator restores the state");
        self.restart(None).await;
        assert_eq!(self.list().await, expected(model), "{id} restored");
        self.disturbances += 1;
    }

    /// The emulated directory is empty for one start (a hostPath not mounted yet): the driver
    /// refuses to start and keeps every state; with the files back it starts with all volumes.
    async fn start_with_an_empty_region(&mut self, model: &BTreeMap<String, String>) {
        if model.is_empty() {
            return;
        }
        if let Some(old) = self.driver.take() {
            old.stop().await;
        }
        let before = self.region_digests();
        let aside = self.root.join("region-aside");
        std::fs::rename(&self.dirs.region, &aside).expect("hide the region");
        std::fs::create_dir_all(&self.dirs.region).expect("empty region");
        let args = node_driver::emulated_args("node-1", &self.dirs, "1Gi");
        let refused = node_driver::start(
            Path::new(env!("CARGO_BIN_EXE_pmem-csi")),
            args,
            &self.dirs,
            &self.group,
            &[],
        )
        .await;
        assert!(
            refused.is_err(),
            "the driver started with every device missing"
        );
        let states = std::fs::read_dir(&self.dirs.state)
            .expect("state")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
            .count();
        assert_eq!(
            states,
            model.len(),
            "states lost while the region was empty"
        );
        std::fs::remove_dir(&self.dirs.region).expect("remove the empty region");
        std::fs::rename(&aside, &self.dirs.region).expect("region back");
        self.restart(None).await;
        assert_eq!(
            self.list().await,
            expected(model),
            "volumes after the region came back"
        );
        assert_eq!(self.region_digests(), before, "a device changed at start");
        self.disturbances += 1;
    }

    async fn list(&mut self) -> Vec<String> {
        let mut ids = driver::client::volume_ids(&mut self.controller)
            .await
            .expect("list volumes");
        ids.sort();
        ids
    }
}

fn expected(model: &BTreeMap<String, String>) -> Vec<String> {
    let mut ids: Vec<String> = model.values().cloned().collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn survives_sigkill_at_random_moments_and_fault_points() {
    let seed = std::env::var("CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
                | 1
        });
    println!("crash test seed {seed} (CRASH_SEED={seed} reproduces the operation sequence)");
    let mut rng = Rng(seed);
    let root = tempfile::tempdir().expect("tempdir");
    let dirs = NodeDriverDirs::under(root.path());
    let group = ProcessGroup::new().expect("group");
    let (driver, controller, node) = launch(&dirs, &group, None).await;
    let mut c = Cluster {
        root: root.path().to_path_buf(),
        dirs,
        group,
        driver: Some(driver),
        controller,
        node,
        fault: None,
        kills: 0,
        fault_kills: 0,
        restarts: 0,
        disturbances: 0,
    };
    // name → volume id of every volume created and not deleted.
    let mut model: BTreeMap<String, String> = BTreeMap::new();
    let mut next_name = 0usize;
    let mut fault_rotation = 0usize;
    let staging = c.root.join("staging");

    for op_index in 0..OPERATIONS {
        // About one operation in eight ends in a kill; half of those at a named fault point.
        let kill = rng.below(8) == 0;
        let fault = kill && rng.below(2) == 0;
        let mut op = match rng.below(100) {
            _ if model.is_empty() => Op::Create,
            n if n < 45 && model.len() < MAX_VOLUMES => Op::Create,
            n if n < 88 => Op::Delete,
            _ => Op::Stage,
        };
        if fault {
            let (point, point_op) = FAULT_POINTS[fault_rotation % FAULT_POINTS.len()];
            fault_rotation += 1;
            op = point_op;
            c.restart(Some(point)).await;
        }
        let (name, fresh) = match op {
            Op::Create => {
                next_name += 1;
                (format!("pvc-crash-{next_name:05}"), true)
            }
            // mkfs only runs on an empty device: stage faults need a fresh volume. A delete
            // fault drawn while no volume exists needs one too (a fault forces the op whatever
            // the model holds).
            _ if fault && (op == Op::Stage || model.is_empty()) => {
                next_name += 1;
                let name = format!("pvc-crash-{next_name:05}");
                let id = create_once(&mut c, &name).await;
                model.insert(name.clone(), id);
                (name, false)
            }
            _ => {
                let pick = rng.below(model.len() as u64) as usize;
                (model.keys().nth(pick).cloned().unwrap_or_default(), false)
            }
        };
        let killer = (kill && !fault).then(|| {
            // A random moment: SIGKILL lands while the call below is in flight, or just after.
            let pid = c.driver.as_ref().and_then(|d| d.pid());
            let delay = Duration::from_micros(rng.below(3000));
            let task = tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                if let Some(pid) = pid.and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            });
            (pid, task)
        });
        match op {
            Op::Create => {
                let id = create_once(&mut c, &name).await;
                assert!(fresh);
                model.insert(name, id);
            }
            Op::Delete => {
                let id = model.remove(&name).unwrap_or_default();
                c.retry("DeleteVolume", |mut controller, _| {
                    let id = id.clone();
                    async move {
                        controller
                            .delete_volume(DeleteVolumeRequest {
                                volume_id: id,
                                ..Default::default()
                            })
                            .await
                            .map(|_| ())
                    }
                })
                .await;
            }
            Op::Stage => {
                let id = model.get(&name).cloned().unwrap_or_default();
                let path = staging.display().to_string();
                c.retry("NodeStageVolume", |_, mut node| {
                    let (id, path) = (id.clone(), path.clone());
                    async move {
                        node.node_stage_volume(NodeStageVolumeRequest {
                            volume_id: id,
                            staging_target_path: path,
                            volume_capability: Some(mount()),
                            ..Default::default()
                        })
                        .await
                        .map(|_| ())
                    }
                })
                .await;
                c.retry("NodeUnstageVolume", |_, mut node| {
                    let (id, path) = (id.clone(), path.clone());
                    async move {
                        node.node_unstage_volume(NodeUnstageVolumeRequest {
                            volume_id: id,
                            staging_target_path: path,
                        })
                        .await
                        .map(|_| ())
                    }
                })
                .await;
            }
        }
        // A random kill may land after the call completed. Once it has been sent, the driver
        // that received it (if it is still the current one) is certainly dying: restart it
        // here, so that every kill is followed by start-up repair and the next call (or the
        // list below) never meets a dying driver.
        if let Some((pid, task)) = killer {
            let _ = task.await;
            if c.driver.as_ref().and_then(|d| d.pid()) == pid {
                c.restart_if_dead(Duration::from_secs(5)).await;
            }
        }
        if fault && c.fault.is_some() {
            // The point was not reached by this call: retire the fault-armed driver.
            c.restart(None).await;
        }
        if op_index % 50 == 0 {
            assert_eq!(
                c.list().await,
                expected(&model),
                "volumes after {op_index} operations"
            );
        }
        // Now and then, what an operator's node can do to the driver between two starts.
        if op_index % 300 == 150 {
            if (op_index / 300) % 2 == 0 {
                c.corrupt_one_state(&model).await;
            } else {
                c.start_with_an_empty_region(&model).await;
            }
        }
    }

    c.restart(None).await;
    let want = expected(&model);
    assert_eq!(
        c.list().await,
        want,
        "volumes present are exactly those created and not deleted"
    );
    let mut files: Vec<String> = std::fs::read_dir(&c.dirs.region)
        .expect("region")
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_string_lossy()
                .strip_suffix(".pmem")
                .map(str::to_string)
        })
        .collect();
    files.sort();
    assert_eq!(files, want, "region files match the surviving volumes");
    println!(
        "crash test: {OPERATIONS} operations, {} SIGKILLs ({} at fault points), {} restarts, {} corrupt-state or empty-region starts, {} volumes left",
        c.kills,
        c.fault_kills,
        c.restarts,
        c.disturbances,
        want.len()
    );
    assert!(c.kills >= MIN_KILLS, "only {} kills", c.kills);
    assert!(
        c.disturbances >= 6,
        "only {} corrupt-state or empty-region starts",
        c.disturbances
    );
    for id in &want {
        c.controller
            .delete_volume(DeleteVolumeRequest {
                volume_id: id.clone(),
                ..Default::default()
            })
            .await
            .expect("clean up");
    }
    if let Some(d) = c.driver.take() {
        d.stop().await;
    }
    let leftovers = Leftovers::new(i32::MAX, c.root.clone()).find();
    assert!(
        leftovers.is_empty(),
        "no loop device or mount may outlive an unstage: {leftovers:?}"
    );
}

async fn create_once(c: &mut Cluster, name: &str) -> String {
    let request = CreateVolumeRequest {
        name: name.to_string(),
        capacity_range: Some(CapacityRange {
            required_bytes: VOLUME_SIZE,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount()],
        ..Default::default()
    };
    c.retry("CreateVolume", |mut controller, _| {
        let request = request.clone();
        async move { controller.create_volume(request).await.map(|_| ()) }
    })
    .await;
    driver::volume_id::volume_id(name)
}
