//! Node driver benchmarks: CreateVolume and DeleteVolume latency and throughput over the real
//! socket for `fake` and `emulated`, with the costs they cannot avoid measured beside them on
//! the same disk, one sample right before each create: a crash-safe state write (fsync of the
//! file and of its directory) and the allocation of a volume file (`fallocate`).

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use driver::csi::controller_client::ControllerClient;
use driver::csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use driver::csi::{CapacityRange, CreateVolumeRequest, DeleteVolumeRequest, VolumeCapability};
use testenv::ProcessGroup;
use testenv::node_driver::{self, NodeDriverDirs};

use crate::report::{Benchmark, RelativeTarget, Target};

const VOLUME_SIZE: u64 = 4 << 20;
/// Volumes alive at once: creates and deletes alternate in batches of this many, so the region
/// never grows past it.
const BATCH: usize = 50;
/// Unmeasured create/delete pairs before each measured series.
const WARM_UP: usize = 20;

fn ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1000.0
}

/// The unavoidable cost a create is compared with, measured right before each create so that
/// both see the same disk (journal commits, writeback and stolen CPU come and go within a run).
#[derive(Clone, Copy)]
enum Baseline {
    /// A crash-safe small-file write as node state does it.
    Fsync,
    /// The allocation of one volume file.
    Fallocate,
}

impl Baseline {
    /// One sample in `dir`, in ms.
    fn sample(self, dir: &Path, i: usize) -> anyhow::Result<f64> {
        match self {
            Baseline::Fsync => {
                let d = std::fs::File::open(dir)?;
                let start = Instant::now();
                let tmp = dir.join(format!("f{i}.json.tmp"));
                let mut f = std::fs::File::create(&tmp)?;
                f.write_all(&[b'x'; 200])?;
                f.sync_all()?;
                std::fs::rename(&tmp, dir.join(format!("f{i}.json")))?;
                d.sync_all()?;
                Ok(ms(start))
            }
            Baseline::Fallocate => {
                let path = dir.join(format!("v{i}.pmem"));
                let start = Instant::now();
                let f = std::fs::File::create(&path)?;
                rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, VOLUME_SIZE)?;
                let took = ms(start);
                drop(f);
                std::fs::remove_file(&path)?;
                Ok(took)
            }
        }
    }
}

fn capability() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume::default())),
    }
}

fn create_request(name: String) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name,
        capacity_range: Some(CapacityRange {
            required_bytes: VOLUME_SIZE as i64,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![capability()],
        ..Default::default()
    }
}

/// What one device mode measured.
struct ModeSamples {
    creates: Vec<f64>,
    deletes: Vec<f64>,
    /// Creates plus deletes per second, baseline samples excluded.
    throughput: f64,
    /// The baseline, one sample before each create.
    baseline: Vec<f64>,
}

/// Create and delete latency (ms) and combined throughput (ops/s) of one device mode, with a
/// `baseline` sample in `probe` before each create.
async fn driver_samples(
    binary: &Path,
    root: &Path,
    mode: &str,
    n: usize,
    baseline: Baseline,
    probe: &Path,
) -> anyhow::Result<ModeSamples> {
    let mut dirs = NodeDriverDirs::under(root);
    // In a pod the driver's stderr is a pipe to the container runtime. A log file on the state
    // directory's file system would instead join every state fsync's journal commit (ext4
    // data=ordered writes the log's new blocks first), a cost a deployed driver does not pay.
    let logs = tempfile::tempdir_in("/dev/shm").context("log directory on tmpfs")?;
    dirs.log = logs.path().join("driver.log");
    let group = ProcessGroup::new()?;
    let mut args = vec![
        "node".to_string(),
        format!("--endpoint=unix://{}", dirs.socket.display()),
        "--node-id=bench".into(),
        format!("--device-mode={mode}"),
        format!("--state-dir={}", dirs.state.display()),
        "--emulated-size=4Gi".into(),
        "--standalone".into(),
    ];
    if mode == "emulated" {
        args.push(format!("--emulated-dir={}", dirs.region.display()));
    }
    let driver = node_driver::start(binary, args, &dirs, &group, &[])
        .await
        .with_context(|| format!("starting pmem-csi node --device-mode={mode}"))?;
    let mut client = ControllerClient::new(driver::client::connect(&dirs.socket).await?);
    // Warm-up, not measured: the first calls pay for the connection, lazy initialisation in
    // the driver and a cold directory cache.
    for i in 0..WARM_UP {
        let volume = client
            .create_volume(create_request(format!("pvc-warm-up-{i}")))
            .await?
            .into_inner()
            .volume
            .context("no volume in the response")?;
        client
            .delete_volume(DeleteVolumeRequest {
                volume_id: volume.volume_id,
                ..Default::default()
            })
            .await?;
    }
    let mut creates = Vec::with_capacity(n);
    let mut deletes = Vec::with_capacity(n);
    let mut baselines = Vec::with_capacity(n);
    let mut baseline_time = 0.0;
    let total = Instant::now();
    let mut done = 0;
    while done < n {
        let batch = BATCH.min(n - done);
        let mut ids = Vec::with_capacity(batch);
        for i in 0..batch {
            let took = baseline.sample(probe, done + i)?;
            baseline_time += took;
            baselines.push(took);
            let start = Instant::now();
            let volume = client
                .create_volume(create_request(format!("pvc-bench-{}", done + i)))
                .await?
                .into_inner()
                .volume
                .context("no volume in the response")?;
            creates.push(ms(start));
            ids.push(volume.volume_id);
        }
        for id in ids {
            let start = Instant::now();
            client
                .delete_volume(DeleteVolumeRequest {
                    volume_id: id,
                    ..Default::default()
                })
                .await?;
            deletes.push(ms(start));
        }
        done += batch;
    }
    let elapsed = total.elapsed().as_secs_f64() - baseline_time / 1000.0;
    let throughput = (2 * n) as f64 / elapsed;
    driver.stop().await;
    Ok(ModeSamples {
        creates,
        deletes,
        throughput,
        baseline: baselines,
    })
}

/// Every driver benchmark, `n` samples each, on a disk-backed directory under `work`.
pub async fn run(binary: &Path, work: &Path, n: usize) -> anyhow::Result<Vec<Benchmark>> {
    let root = tempfile::tempdir_in(work).context("work directory")?;
    let fs_type = rustix::fs::statfs(root.path()).map(|s| format!("{:#x}", s.f_type as u64))?;
    anyhow::ensure!(
        fs_type != "0x1021994",
        "{} is on tmpfs; the benchmark needs a disk",
        work.display()
    );
    let flags = serde_json::json!({
        "volume_size_bytes": VOLUME_SIZE,
        "batch": BATCH,
        "warm_up_pairs": WARM_UP,
        "samples": n,
        "filesystem_magic": fs_type,
        "binary": binary.display().to_string(),
    });
    let probe = root.path().join("probe");
    std::fs::create_dir_all(&probe)?;
    let fake = driver_samples(
        binary,
        &root.path().join("fake"),
        "fake",
        n,
        Baseline::Fsync,
        &probe,
    )
    .await?;
    let emulated = driver_samples(
        binary,
        &root.path().join("emulated"),
        "emulated",
        n,
        Baseline::Fallocate,
        &probe,
    )
    .await?;
    let (fsync, fallocate) = (fake.baseline, emulated.baseline);
    let (fake_create, fake_delete, fake_tp) = (fake.creates, fake.deletes, fake.throughput);
    let (emu_create, emu_delete, emu_tp) =
        (emulated.creates, emulated.deletes, emulated.throughput);
    let bench =
        |name: &str, description: &str, unit: &str, samples: Vec<f64>, target: Target| Benchmark {
            name: name.into(),
            description: description.into(),
            unit: unit.into(),
            samples,
            secondary: vec![],
            target,
            flags: flags.clone(),
        };
    let relative = |of: &[&str], plus: f64| Target {
        p50_max: None,
        p99_max: Some(RelativeTarget::sum(
            of.iter().map(|s| s.to_string()).collect(),
            plus,
        )),
        ..Target::none()
    };
    Ok(vec![
        bench(
            "fsync-file-and-dir",
            "write 200 bytes to a temporary file, fsync it, rename it, fsync the directory (ms); one sample right before each fake create",
            "ms",
            fsync,
            Target::none(),
        ),
        bench(
            "fallocate-4MiB",
            "create a file and fallocate 4 MiB (ms); one sample right before each emulated create",
            "ms",
            fallocate,
            Target::none(),
        ),
        bench(
            "fake-create",
            "CreateVolume of 4 MiB on fake over the socket (ms)",
            "ms",
            fake_create,
            relative(&["fsync-file-and-dir"], 0.5),
        ),
        bench(
            "fake-delete",
            "DeleteVolume on fake over the socket (ms)",
            "ms",
            fake_delete,
            Target::none(),
        ),
        bench(
            "fake-throughput",
            "creates plus deletes per second on fake, one client, sequential",
            "ops/s",
            vec![fake_tp],
            Target::none(),
        ),
        bench(
            "emulated-create",
            "CreateVolume of 4 MiB on emulated over the socket (ms)",
            "ms",
            emu_create,
            relative(&["fallocate-4MiB", "fsync-file-and-dir"], 5.0),
        ),
        bench(
            "emulated-delete",
            "DeleteVolume with eraseafter on emulated over the socket (ms)",
            "ms",
            emu_delete,
            Target::none(),
        ),
        bench(
            "emulated-throughput",
            "creates plus deletes per second on emulated, one client, sequential",
            "ops/s",
            vec![emu_tp],
            Target::none(),
        ),
    ])
}
