//! Resident memory of pmem-csi's processes at scale (`run --memory-only`, part of the full run):
//! the controller after its first pass (crate::cluster_scale), the node driver idle and with
//! volumes, the extender on thousands of nodes.

use anyhow::Context;
use k8s_openapi::api::storage::v1::CSIStorageCapacity;
use kube::Api;

use crate::report::Benchmark;
use crate::resident::{Resident, mib};

/// How large the memory benchmarks are.
#[derive(Clone, Debug)]
pub struct Scale {
    /// Nodes and pending claims of the controller's first pass.
    pub controller: (usize, usize),
    /// Volumes of the node driver's second measurement.
    pub driver_volumes: usize,
    /// Nodes (each with a capacity object) and claims the extender indexes.
    pub extender: (usize, usize),
}

impl Scale {
    /// Issue 26's sizes.
    pub fn full() -> Self {
        Self {
            controller: (1000, 10_000),
            driver_volumes: 500,
            extender: (5000, 10_000),
        }
    }

    /// Small, to prove the benchmarks run (`just test`).
    pub fn smoke() -> Self {
        Self {
            controller: (20, 200),
            driver_volumes: 20,
            extender: (50, 200),
        }
    }
}

/// Every memory benchmark on one testenv.
pub async fn run(root: &std::path::Path, scale: &Scale) -> anyhow::Result<Vec<Benchmark>> {
    let env = testenv::TestEnv::builder()
        .start()
        .await
        .context("starting testenv")?;
    let result = on(&env, root, scale).await.map(|mut out| {
        // The pass's throughput rows belong to the full run.
        out.retain(|b| !b.name.starts_with("rescheduler-"));
        out
    });
    let leftovers = env.stop().await;
    let remaining = leftovers
        .wait_clean(std::time::Duration::from_secs(20))
        .await;
    anyhow::ensure!(remaining.is_empty(), "left behind: {remaining:?}");
    result
}

/// On `env`: the controller's first pass (its rows, memory included), then the node driver's
/// and the extender's memory, the extender on the pass's nodes and claims.
pub async fn on(
    env: &testenv::TestEnv,
    root: &std::path::Path,
    scale: &Scale,
) -> anyhow::Result<Vec<Benchmark>> {
    let (nodes, claims) = scale.controller;
    let mut out = crate::cluster_scale::rescheduler_pass(env, nodes, claims).await?;
    out.extend(node_driver(env, root, scale.driver_volumes).await?);
    out.push(extender(env, scale.extender.0, nodes, claims).await?);
    Ok(out)
}

const DRIVER: &str = "pmem-csi.intel.com";
const NAMESPACE: &str = "pmem-csi";

/// Waits until the process's admin server on `port` answers `/readyz`.
async fn ready(port: u16, what: &str) -> anyhow::Result<()> {
    let probe = testenv::control_plane::anonymous_probe(&format!("http://127.0.0.1:{port}"), what)?;
    testenv::wait::until(
        &format!("{what} ready"),
        std::time::Duration::from_secs(120),
        || testenv::control_plane::probe_path(&probe, "/readyz"),
    )
    .await?;
    Ok(())
}

/// The node driver (fake backend, so that hundreds of volumes cost no disk) once it serves and
/// has published its capacity, then with `volumes` volumes of 4 MiB created over its socket.
pub async fn node_driver(
    env: &testenv::TestEnv,
    work: &std::path::Path,
    volumes: usize,
) -> anyhow::Result<Vec<Benchmark>> {
    use driver::csi::controller_client::ControllerClient;

    let client = env.client().await?;
    let class = "bench-memory-pmem";
    testenv::api_calls::create_storage_class(&client, class, DRIVER, "WaitForFirstConsumer")
        .await?;
    let node = "memory-node";
    testenv::NodeSpec::with_driver(node)
        .create(&client, DRIVER)
        .await?;
    let root = tempfile::tempdir_in(work)?;
    let dirs = testenv::node_driver::NodeDriverDirs::under(root.path());
    let admin = testenv::ports::free_port()?;
    let mut options = testenv::node_processes::DriverOptions::fake(
        "1Ti",
        &[&format!("--admin-address=127.0.0.1:{admin}")],
    );
    options.env.push(("RUST_LOG".into(), "warn".into()));
    let process = env.supervise_node_driver(node, &dirs, &options)?;
    testenv::node_driver::wait_for_path(&dirs.socket, std::time::Duration::from_secs(60)).await?;
    ready(admin, "node driver").await?;
    let capacities = Api::<CSIStorageCapacity>::namespaced(client.clone(), NAMESPACE);
    let name = controllers::well_known::capacity_object_name(node, class);
    let free = || async {
        capacities
            .get_opt(&name)
            .await
            .ok()
            .flatten()
            .and_then(|o| o.capacity)
            .and_then(|q| controllers::quantity::parse_bytes(&q.0).ok())
    };
    let initial = testenv::wait::until(
        "the node's capacity published",
        std::time::Duration::from_secs(60),
        || async { free().await.ok_or_else(|| "not yet".to_string()) },
    )
    .await?;
    let pid = process.state().pid.context("the node driver runs")?;
    let idle = Resident::of(pid);
    let mut csi = ControllerClient::new(driver::client::connect(&dirs.socket).await?);
    const SIZE: u64 = 4 << 20;
    for i in 0..volumes {
        csi.create_volume(crate::cluster_scale::mount_volume(
            format!("memory-{i}"),
            SIZE as i64,
        ))
        .await?;
    }
    // Measured once the publisher has caught up, as a node in service would be.
    let want = initial - volumes as u64 * SIZE;
    testenv::wait::until(
        "the capacity to show every volume",
        std::time::Duration::from_secs(60),
        || async {
            match free().await {
                Some(now) if now == want => Ok(()),
                other => Err(format!("{other:?}, want {want}")),
            }
        },
    )
    .await?;
    let loaded = Resident::of(pid);
    process.stop().await;
    let flags = serde_json::json!({
        "backend": "fake", "volume_size_bytes": SIZE, "volumes": volumes,
        "idle": idle.json(), "with_volumes": loaded.json(),
    });
    Ok(vec![
        Benchmark {
            name: "node-driver-rss-idle".into(),
            description: "resident memory of pmem-csi node (fake backend) serving, its capacity published, no volumes (MiB)".into(),
            unit: "MiB".into(),
            samples: vec![mib(idle.total)],
            secondary: vec![],
            target: crate::report::Target::none(),
            flags: flags.clone(),
        },
        Benchmark {
            name: format!("node-driver-rss-{volumes}-volumes"),
            description: format!("resident memory of pmem-csi node (fake backend) with {volumes} volumes of 4 MiB created over its socket and published (MiB)"),
            unit: "MiB".into(),
            samples: vec![mib(loaded.total)],
            secondary: vec![mib(idle.total)],
            target: crate::report::Target::none(),
            flags,
        },
    ])
}

/// The extender started on a cluster of `nodes` driver nodes, each with a capacity object,
/// and the `claims` claims already there (nodes `existing..nodes` are added); measured once its
/// caches have synced (`/readyz`).
pub async fn extender(
    env: &testenv::TestEnv,
    nodes: usize,
    existing: usize,
    claims: usize,
) -> anyhow::Result<Benchmark> {
    let client = env.client().await?;
    let class = "bench-memory-pmem";
    crate::cluster_scale::create_nodes(&client, existing..nodes).await?;
    let names: Vec<String> = (0..nodes).map(|i| format!("scale-node-{i}")).collect();
    crate::webhook_load::publish_capacity(&client, &names, class).await?;
    let (route, admin) = (testenv::ports::free_port()?, testenv::ports::free_port()?);
    let state = tempfile::tempdir_in(env.dir())?;
    let process = env.supervise(
        env.our_process(
            testenv::manifests::OurContainer::Extender,
            "bench/extender",
            "bench-extender.log",
            &testenv::manifests::Overrides::new()
                .set("--extender-address", format!("127.0.0.1:{route}"))
                .set("--admin-address", format!("127.0.0.1:{admin}"))
                .set(
                    "--reservations-file",
                    state
                        .path()
                        .join("reservations.jsonl")
                        .display()
                        .to_string(),
                )
                .set("--reschedule-grace", "24h"),
        )?
        .env("RUST_LOG", "warn"),
    );
    ready(admin, "extender").await?;
    let resident = process
        .state()
        .pid
        .map_or_else(Resident::default, Resident::of);
    process.stop().await;
    Ok(Benchmark {
        name: "extender-rss-at-scale".into(),
        description: format!(
            "resident memory of pmem-csi extender once its caches have synced on {nodes} driver nodes, each with a capacity object, and {claims} pending claims (MiB)"
        ),
        unit: "MiB".into(),
        samples: vec![mib(resident.total)],
        secondary: vec![],
        target: crate::report::Target::none(),
        flags: serde_json::json!({
            "nodes": nodes, "capacity_objects": nodes, "claims": claims,
            "resident": resident.json(),
        }),
    })
}
