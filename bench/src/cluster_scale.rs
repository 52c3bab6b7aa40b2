//! Cluster benchmarks on testenv: the rescheduler's first pass over many pending claims
//! (throughput and memory of a real `pmem-csi controller`), and how fast a CreateVolume shows
//! in the node's CSIStorageCapacity object.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use driver::csi::controller_client::ControllerClient;
use driver::csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use driver::csi::{CapacityRange, CreateVolumeRequest, VolumeCapability};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::CSIStorageCapacity;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::Api;
use kube::api::{ObjectMeta, PostParams};
use testenv::node_driver::NodeDriverDirs;
use testenv::{NodeSpec, TestEnv};

use crate::report::{Benchmark, Target};
use crate::resident::Resident;

const DRIVER: &str = "pmem-csi.intel.com";

async fn class(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    testenv::api_calls::create_storage_class(client, name, DRIVER, "WaitForFirstConsumer").await?;
    Ok(())
}

fn metric(text: &str, prefix: &str) -> u64 {
    testenv::metrics::metric_value(text, prefix)
}

/// How long after the pass its memory is measured: what an operator sees a moment later, once
/// the pass's last reconciles and requeues have settled.
const SETTLE: Duration = Duration::from_secs(3);

/// Controllers started one after another over the same objects: each is a sample of the pass's
/// time and memory. One is not enough: resident memory after the pass moves by up to ~10 MiB
/// between processes (where glibc's arenas happen to keep the freed decode buffers).
const PASSES: usize = 3;

/// The controller's memory target after the first pass (issue 26).
const CONTROLLER_RSS_TARGET_MIB: f64 = 40.0;

/// Starts a controller as the manifests run it (the rescheduler with a long grace, so that it
/// only judges), with its admin server on a port of its own; returns it and a client of that
/// port.
fn start_controller(
    env: &TestEnv,
    log: &str,
) -> anyhow::Result<(testenv::Supervised, kube::Client)> {
    let port = testenv::ports::free_port()?;
    let controller = env.supervise(
        env.our_process(
            testenv::manifests::OurContainer::Controller,
            "bench/controller",
            log,
            &testenv::manifests::Overrides::new()
                .set("--reschedule-grace", "10m")
                .set("--admin-address", format!("127.0.0.1:{port}")),
        )?
        .env("RUST_LOG", "warn"),
    );
    let probe =
        testenv::control_plane::anonymous_probe(&format!("http://127.0.0.1:{port}"), "metrics")?;
    Ok((controller, probe))
}

/// The controller's resident memory once its caches have synced on the cluster as it is (the
/// testenv's own objects only): runtime, TLS, binary and empty caches.
async fn controller_idle(env: &TestEnv) -> anyhow::Result<Resident> {
    let (controller, probe) = start_controller(env, "bench-controller-idle.log")?;
    testenv::wait::until("the idle controller ready", Duration::from_secs(60), || {
        testenv::control_plane::probe_path(&probe, "/readyz")
    })
    .await?;
    let idle = controller
        .state()
        .pid
        .map_or_else(Resident::default, Resident::of);
    controller.stop().await;
    Ok(idle)
}

/// Driver nodes `scale-node-<i>` for each `i` of `range`, with their CSINodes.
pub async fn create_nodes(
    client: &kube::Client,
    range: std::ops::Range<usize>,
) -> anyhow::Result<()> {
    // Creating objects is not what is measured; a few dozen requests in flight keep it short.
    futures::stream::iter(range.map(|i| {
        let client = client.clone();
        async move {
            NodeSpec::with_driver(format!("scale-node-{i}"))
                .create(&client, DRIVER)
                .await
        }
    }))
    .buffer_unordered(32)
    .try_collect::<Vec<()>>()
    .await
    .context("creating nodes")?;
    Ok(())
}

/// One controller's first pass over `claims` pending claims: its time, and its resident memory
/// when the pass ends and [`SETTLE`] later.
async fn one_pass(
    env: &TestEnv,
    claims: usize,
    run: usize,
) -> anyhow::Result<(Duration, Resident, Resident)> {
    let start = Instant::now();
    let (controller, probe) = start_controller(env, &format!("bench-controller-{run}.log"))?;
    let keep = "pmem_csi_rescheduler_decisions_total{verdict=\"keep\",reason=\"driver-may-run\"}";
    let mut pass = None;
    while start.elapsed() < Duration::from_secs(600) {
        let text = probe
            .request_text(http::Request::get("/metrics").body(Vec::new())?)
            .await
            .unwrap_or_default();
        if metric(&text, keep) >= claims as u64 {
            pass = Some(start.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pass = pass.context("the first pass did not finish within 10 minutes")?;
    let pid = controller.state().pid;
    let at_pass = pid.map_or_else(Resident::default, Resident::of);
    tokio::time::sleep(SETTLE).await;
    let after = pid.map_or_else(Resident::default, Resident::of);
    controller.stop().await;
    Ok((pass, at_pass, after))
}

/// `nodes` Nodes with the driver and `claims` pending claims selected for them; the
/// controller's first pass over them, [`PASSES`] times.
pub async fn rescheduler_pass(
    env: &TestEnv,
    nodes: usize,
    claims: usize,
) -> anyhow::Result<Vec<Benchmark>> {
    let client = env.client().await?;
    let idle = controller_idle(env).await?;
    let ns = testenv::test_namespace(&client, "scale").await?;
    let class_name = format!("{ns}-pmem");
    class(&client, &class_name).await?;
    create_nodes(&client, 0..nodes).await?;
    let api = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns);
    futures::stream::iter((0..claims).map(|i| {
        let api = api.clone();
        let (ns, class_name) = (ns.clone(), class_name.clone());
        async move {
            let claim = PersistentVolumeClaim {
                metadata: ObjectMeta {
                    name: Some(format!("claim-{i}")),
                    namespace: Some(ns),
                    annotations: Some(BTreeMap::from([(
                        controllers::well_known::SELECTED_NODE.to_string(),
                        format!("scale-node-{}", i % nodes),
                    )])),
                    ..Default::default()
                },
                spec: Some(PersistentVolumeClaimSpec {
                    access_modes: Some(vec!["ReadWriteOnce".into()]),
                    storage_class_name: Some(class_name),
                    resources: Some(VolumeResourceRequirements {
                        requests: Some(BTreeMap::from([(
                            "storage".to_string(),
                            Quantity("1Gi".into()),
                        )])),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            };
            api.create(&PostParams::default(), &claim).await.map(|_| ())
        }
    }))
    .buffer_unordered(32)
    .try_collect::<Vec<()>>()
    .await
    .context("creating claims")?;

    let mut passes = Vec::new();
    let (mut at_pass, mut settled) = (Vec::new(), Vec::new());
    for run in 0..PASSES {
        let (pass, at, after) = one_pass(env, claims, run).await?;
        passes.push(pass.as_secs_f64());
        at_pass.push(at);
        settled.push(after);
    }
    let caches = crate::resident::controller_caches(&client, testenv::manifests::NAMESPACE).await?;
    let flags = serde_json::json!({
        "nodes": nodes, "claims": claims, "reschedule_grace": "10m",
        "kube_api_qps": 20, "kube_api_burst": 40, "pass_includes_process_start_and_cache_sync": true,
        "passes": PASSES,
        "at_pass": at_pass.iter().map(Resident::json).collect::<Vec<_>>(),
        "settled_after_pass": settled.iter().map(Resident::json).collect::<Vec<_>>(),
        "settle_s": SETTLE.as_secs(),
        "idle_before_objects": idle.json(),
        "cache_heap_bytes_by_kind": caches,
    });
    Ok(vec![
        Benchmark {
            name: "rescheduler-first-pass".into(),
            description: format!("seconds from controller start to {claims} pending claims on {nodes} nodes judged (keep)"),
            unit: "s".into(),
            samples: passes.clone(),
            secondary: vec![],
            target: Target { p50_max: Some(30.0), ..Target::none() },
            flags: flags.clone(),
        },
        Benchmark {
            name: "rescheduler-keep-rate".into(),
            description: "claims judged per second over the first pass (target: at least 5,000/s, shown as ms per 1,000 claims ≤ 200)".into(),
            unit: "ms/1k".into(),
            samples: passes.iter().map(|p| p * 1000.0 / (claims as f64 / 1000.0)).collect(),
            secondary: vec![],
            target: Target { p50_max: Some(200.0), ..Target::none() },
            flags: flags.clone(),
        },
        Benchmark {
            name: "controller-rss-after-pass".into(),
            description: format!("resident memory of pmem-csi controller 3 s after its first pass over {claims} claims on {nodes} nodes (MiB; one sample per controller, {PASSES} started one after another); secondary: the same process started on the cluster before those objects existed; where the bytes go in the flags (RssAnon/RssFile, and each cache's heap bytes rebuilt in the benchmark with the controller's trimming)"),
            unit: "MiB".into(),
            samples: settled.iter().map(|r| crate::resident::mib(r.total)).collect(),
            secondary: vec![crate::resident::mib(idle.total)],
            target: Target { p50_max: Some(CONTROLLER_RSS_TARGET_MIB), ..Target::none() },
            flags,
        },
    ])
}

/// CreateVolume of a single-node file-system volume `name` of `bytes`.
pub fn mount_volume(name: String, bytes: i64) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name,
        capacity_range: Some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(AccessType::Mount(MountVolume::default())),
        }],
        ..Default::default()
    }
}

/// Latency from CreateVolume returning to the node's capacity object showing it.
pub async fn capacity_latency(
    env: &TestEnv,
    work: &Path,
    samples: usize,
) -> anyhow::Result<Benchmark> {
    let client = env.client().await?;
    let ns = testenv::test_namespace(&client, "capacity-latency").await?;
    let class_name = format!("{ns}-pmem");
    class(&client, &class_name).await?;
    let node = format!("{ns}-node");
    NodeSpec::with_driver(&node).create(&client, DRIVER).await?;
    let root = tempfile::tempdir_in(work)?;
    let dirs = NodeDriverDirs::under(root.path());
    let mut options = testenv::node_processes::DriverOptions::fake("1Ti", &[]);
    options.env.push(("RUST_LOG".into(), "warn".into()));
    let driver = env.supervise_node_driver(&node, &dirs, &options)?;
    testenv::node_driver::wait_for_path(&dirs.socket, Duration::from_secs(60)).await?;
    let mut csi = ControllerClient::new(driver::client::connect(&dirs.socket).await?);
    let api = Api::<CSIStorageCapacity>::namespaced(client.clone(), "pmem-csi");
    let name = controllers::well_known::capacity_object_name(&node, &class_name);
    let capacity = |o: Option<CSIStorageCapacity>| {
        o.and_then(|o| o.capacity)
            .and_then(|q| controllers::quantity::parse_bytes(&q.0).ok())
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while capacity(api.get_opt(&name).await?).is_none() {
        anyhow::ensure!(Instant::now() < deadline, "capacity never published");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut latencies = Vec::with_capacity(samples);
    for i in 0..samples {
        let before = capacity(api.get_opt(&name).await?).unwrap_or(0);
        csi.create_volume(mount_volume(format!("latency-{i}"), 4 << 20))
            .await?;
        let created = Instant::now();
        loop {
            if capacity(api.get_opt(&name).await?).is_some_and(|c| c + (4 << 20) == before) {
                latencies.push(created.elapsed().as_secs_f64());
                break;
            }
            if created.elapsed() > Duration::from_secs(30) {
                let now = capacity(api.get_opt(&name).await?);
                anyhow::bail!(
                    "capacity did not follow create {i}: object says {now:?}, expected {} (before {before})",
                    before - (4 << 20),
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    driver.stop().await;
    Ok(Benchmark {
        name: "create-to-capacity".into(),
        description: "seconds from CreateVolume returning to the CSIStorageCapacity object showing it (polled every 10 ms)".into(),
        unit: "s".into(),
        samples: latencies,
        secondary: vec![],
        target: Target {
            p50_max: None,
            p99_max: Some(crate::report::RelativeTarget::absolute(2.0)),
            ..Target::none()
        },
        flags: serde_json::json!({"debounce_ms": 500, "poll_ms": 10, "backend": "fake"}),
    })
}

/// A node holding `volumes` volumes, each referenced by a PV, in a cluster of `pvs` PVs of the
/// driver (the others on other nodes): what the node's apiserver requests cost per minute over
/// `window` once it has started, and how late its heartbeat gets. The orphan grace is 2 s, so
/// that every volume is judged every second (the production grace of 10 minutes judges them
/// once a minute).
pub async fn sweep_cost(
    env: &TestEnv,
    work: &Path,
    volumes: usize,
    pvs: usize,
    window: Duration,
) -> anyhow::Result<Vec<Benchmark>> {
    use k8s_openapi::api::coordination::v1::Lease;
    use k8s_openapi::api::core::v1::PersistentVolume;
    let client = env.client().await?;
    let ns = testenv::test_namespace(&client, "sweep-cost").await?;
    let node = format!("{ns}-node");
    NodeSpec::with_driver(&node).create(&client, DRIVER).await?;
    let root = tempfile::tempdir_in(work)?;
    let dirs = NodeDriverDirs::under(root.path());
    let period = Duration::from_secs(1);
    let admin = testenv::ports::free_port()?;
    let admin_flag = format!("--admin-address=127.0.0.1:{admin}");
    let mut options =
        testenv::node_processes::DriverOptions::fake("1Ti", &["--orphan-grace=2s", &admin_flag]);
    options.env.push(("RUST_LOG".into(), "warn".into()));
    let driver = env.supervise_node_driver(&node, &dirs, &options)?;
    testenv::node_driver::wait_for_path(&dirs.socket, Duration::from_secs(60)).await?;
    let mut csi = ControllerClient::new(driver::client::connect(&dirs.socket).await?);
    let pv = |name: String, handle: String, on: &str| {
        controllers::test_objects::csi_volume(&name, DRIVER, &handle, Some(on))
    };
    let pv_api = Api::<PersistentVolume>::all(client.clone());
    // This node's volumes, each with its PV (created first, as the sweep would otherwise be
    // right to delete a volume without one).
    for i in 0..volumes {
        let name = format!("{ns}-pv-{i}");
        let id = driver::volume_id::volume_id(&name);
        pv_api
            .create(&PostParams::default(), &pv(name.clone(), id, &node))
            .await?;
        csi.create_volume(CreateVolumeRequest {
            name: name.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 4 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![VolumeCapability {
                access_mode: Some(AccessMode {
                    mode: Mode::SingleNodeWriter as i32,
                }),
                access_type: Some(AccessType::Mount(MountVolume::default())),
            }],
            parameters: std::collections::HashMap::from([
                (
                    "csi.storage.k8s.io/pvc/name".to_string(),
                    format!("claim-{i}"),
                ),
                ("csi.storage.k8s.io/pvc/namespace".to_string(), ns.clone()),
                ("csi.storage.k8s.io/pv/name".to_string(), name),
            ]),
            ..Default::default()
        })
        .await?;
    }
    // The rest of the cluster's PVs, on other nodes.
    futures::stream::iter((volumes..pvs).map(|i| {
        let (pv_api, name) = (pv_api.clone(), format!("{ns}-pv-{i}"));
        let object = pv(
            name.clone(),
            format!("elsewhere-{i}"),
            &format!("{ns}-other-{}", i % 100),
        );
        async move {
            pv_api
                .create(&PostParams::default(), &object)
                .await
                .map(|_| ())
        }
    }))
    .buffer_unordered(32)
    .try_collect::<Vec<()>>()
    .await
    .context("creating PVs")?;

    // Steady state first: the sweep's cache holds every PV (a watch catching up with
    // thousands of new PVs is a transient, checked below only for what it must not do).
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let text = testenv::metrics::scrape_metrics(admin).await;
        if metric(&text, "pmem_csi_orphan_sweep_known_pvs") >= pvs as u64 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the sweep's cache never held all {pvs} PVs"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The window: the node's audited requests, and the heartbeat's renewals.
    let user = testenv::audit::service_account_user("pmem-csi", "pmem-csi-intel-com-node");
    let audited = || -> anyhow::Result<Vec<testenv::audit::Request>> {
        let text = std::fs::read_to_string(env.audit_log()).context("audit log")?;
        Ok(testenv::audit::parse_log(&text)
            .0
            .into_iter()
            .filter(|r| r.user == user)
            .collect())
    };
    let before = audited()?.len();
    let leases = Api::<Lease>::namespaced(client.clone(), "pmem-csi");
    let lease = controllers::well_known::heartbeat_lease_name(DRIVER, &node);
    let mut renewals: Vec<k8s_openapi::jiff::Timestamp> = Vec::new();
    let start = Instant::now();
    while start.elapsed() < window {
        if let Some(t) = leases
            .get_opt(&lease)
            .await?
            .and_then(|l| l.spec?.renew_time)
            && renewals.last() != Some(&t.0)
        {
            renewals.push(t.0);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let in_window: Vec<testenv::audit::Request> = audited()?.split_off(before);
    let kept = driver::client::volume_ids(&mut csi).await?.len();
    driver.stop().await;
    anyhow::ensure!(
        kept == volumes,
        "the orphan sweep deleted {} of the node's {volumes} volumes, all referenced by PVs",
        volumes - kept.min(volumes)
    );
    let minutes = window.as_secs_f64() / 60.0;
    let heartbeat = |r: &testenv::audit::Request| r.resource == "leases";
    let other = in_window.iter().filter(|r| !heartbeat(r)).count();
    let claims_read: std::collections::BTreeSet<&str> = in_window
        .iter()
        .filter(|r| r.resource == "persistentvolumeclaims")
        .map(|r| r.name.as_str())
        .collect();
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    for r in &in_window {
        *by_kind
            .entry(format!("{} {}", r.verb, r.resource))
            .or_default() += 1;
    }
    let delays: Vec<f64> = renewals
        .windows(2)
        .map(|w| {
            let gap = Duration::try_from(w[1] - w[0]).unwrap_or(Duration::MAX);
            gap.saturating_sub(period).as_secs_f64()
        })
        .collect();
    anyhow::ensure!(
        !delays.is_empty(),
        "no heartbeat renewals seen in {window:?}"
    );
    let flags = serde_json::json!({
        "volumes_on_node": volumes, "pvs_in_cluster": pvs, "window_s": window.as_secs(),
        "orphan_grace": "2s", "heartbeat_period": "1s", "requests_in_window": by_kind,
        "claims_read": claims_read.iter().take(10).collect::<Vec<_>>(),
    });
    Ok(vec![
        Benchmark {
            name: "sweep-node-requests-per-minute".into(),
            description: format!("apiserver requests per minute of a node with {volumes} volumes (all referenced by PVs) in a cluster of {pvs} PVs, besides its heartbeat: the orphan sweep judging every volume each second and the capacity publisher, once started (audit log)"),
            unit: "req/min".into(),
            samples: vec![other as f64 / minutes],
            secondary: vec![],
            target: Target { p50_max: Some(10.0), ..Target::none() },
            flags: flags.clone(),
        },
        Benchmark {
            name: "sweep-node-heartbeat-delay".into(),
            description: "seconds each heartbeat renewal came later than its period (1 s) on that node, from the Lease's renewTime".into(),
            unit: "s".into(),
            samples: delays,
            secondary: vec![],
            target: Target { max: Some(1.0), ..Target::none() },
            flags,
        },
    ])
}
