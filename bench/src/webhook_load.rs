//! Request-path benchmarks of the pod mutating webhook (`/pod/mutate` of `pmem-csi controller`,
//! over TLS) and of the scheduler extender's `/filter`, each on its own testenv and loaded by
//! [`crate::http_load`] from a pool of keep-alive connections.

use std::time::{Duration, Instant};

use anyhow::Context;
use controllers::test_objects;
use futures::{StreamExt, TryStreamExt};
use hyper::body::Bytes;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Secret};
use k8s_openapi::api::storage::v1::CSIStorageCapacity;
use kube::Api;
use kube::api::PostParams;
use testenv::TestEnv;
use testenv::api_calls::create_storage_class;
use testenv::wait::until;

use crate::http_load::{Endpoint, Outcome, Pool, Transport};
use crate::report::{Benchmark, RelativeTarget, Target};

const DRIVER: &str = "pmem-csi.intel.com";
/// The driver namespace, where the controller keeps its Secret and nodes publish capacity.
const NAMESPACE: &str = "pmem-csi";
/// The Secret `--self-signed` keeps the CA and serving certificate in.
const SECRET: &str = "pmem-csi-intel-com-controller-secret";
/// The class of the published capacity objects.
const CAPACITY_CLASS: &str = "pmem-late";
/// Filter requests with this many names carry the filter target.
const FILTER_TARGET_NAMES: usize = 5_000;
/// `/filter` with [`FILTER_TARGET_NAMES`] names: p99 at most this (ms) …
const FILTER_TARGET_MS: f64 = 1.0;
/// … and at most this many times the floor's p99 (bench/src/filter_floor.rs).
const FILTER_TARGET_FLOOR_FACTOR: f64 = 2.0;
/// Waiting for a component to come up or catch up; generous for a loaded 2-core machine.
const WAIT: Duration = Duration::from_secs(120);
const GI: u64 = 1 << 30;
/// How the control plane runs during the load benchmarks (flags of the results).
const CONTROL_PLANE: &str = "SCHED_IDLE: etcd, kube-apiserver, KCM and kube-scheduler get a CPU only when the measured server and the load generator leave one free (their GC bursts otherwise take both CPUs of this machine for milliseconds)";

/// Rates, durations and sizes of the load benchmarks.
#[derive(Debug, Clone)]
pub struct Scale {
    /// Keep-alive connections in the pool.
    pub connections: usize,
    /// Load at the measured rate before measuring, discarded.
    pub warmup: Duration,
    /// Open-loop rate of `/pod/mutate` requests.
    pub mutate_rate: f64,
    /// How long the mutate rate is held per window.
    pub mutate_duration: Duration,
    /// Measured windows per fixed-rate benchmark; the one with the least stolen CPU is kept.
    pub windows: usize,
    /// How long all connections send back-to-back for the maximum mutate rate.
    pub max_rate_duration: Duration,
    /// Node names per `/filter` request, one benchmark each.
    pub filter_names: Vec<usize>,
    /// Open-loop rate of `/filter` requests.
    pub filter_rate: f64,
    /// How long each filter rate is held.
    pub filter_duration: Duration,
}

impl Scale {
    /// The scale `just bench` measures and the targets are about.
    pub fn full() -> Self {
        Self {
            connections: 8,
            warmup: Duration::from_secs(1),
            mutate_rate: 1000.0,
            mutate_duration: Duration::from_secs(10),
            windows: 3,
            max_rate_duration: Duration::from_secs(5),
            filter_names: vec![500, FILTER_TARGET_NAMES],
            filter_rate: 200.0,
            filter_duration: Duration::from_secs(10),
        }
    }

    /// A few seconds per benchmark, only to prove they still run.
    pub fn smoke() -> Self {
        Self {
            connections: 8,
            warmup: Duration::from_millis(500),
            mutate_rate: 100.0,
            mutate_duration: Duration::from_secs(2),
            windows: 1,
            max_rate_duration: Duration::from_secs(1),
            filter_names: vec![50],
            filter_rate: 20.0,
            filter_duration: Duration::from_secs(2),
        }
    }
}

/// `p99 ≤ ms`.
fn p99_at_most(ms: f64) -> Target {
    Target {
        p50_max: None,
        p99_max: Some(RelativeTarget::absolute(ms)),
        ..Target::none()
    }
}

/// Stops `env` and fails when it left processes or mounts behind.
async fn stop(env: TestEnv) -> anyhow::Result<()> {
    let leftovers = env.stop().await;
    let remaining = leftovers.wait_clean(Duration::from_secs(20)).await;
    anyhow::ensure!(remaining.is_empty(), "left behind: {remaining:?}");
    Ok(())
}

/// CPU time the hypervisor gave to other guests (`steal` of `/proc/stat`, all CPUs), in
/// milliseconds; `None` where the kernel does not report it.
fn steal_ms() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: f64 = stat
        .lines()
        .find(|l| l.starts_with("cpu "))?
        .split_whitespace()
        .nth(8)?
        .parse()
        .ok()?;
    // USER_HZ is 100 on every Linux architecture we run on.
    Some(ticks * 10.0)
}

/// One measured window and the CPU time stolen from this machine meanwhile.
struct Window {
    outcome: Outcome,
    steal_ms: Option<f64>,
}

/// Warm-up, then `scale.windows` open-loop windows at `rate`; fails on any failed request.
/// Returns the window with the least stolen CPU time (on a shared virtual machine a window
/// can lose 10 % of its CPU time to other guests, milliseconds at a time, which is not the
/// server's latency) and, for the results, every window's p99 and steal.
async fn measured_run(
    pool: &mut Pool,
    what: &str,
    rate: f64,
    scale: &Scale,
    duration: Duration,
) -> anyhow::Result<(Outcome, serde_json::Value)> {
    let warmup = pool.open_loop(rate, scale.warmup).await?;
    warmup.ensure_no_failures(&format!("{what} warm-up"))?;
    let mut windows = Vec::new();
    for _ in 0..scale.windows.max(1) {
        let before = steal_ms();
        let outcome = pool.open_loop(rate, duration).await?;
        outcome.ensure_no_failures(what)?;
        let steal_ms = before.zip(steal_ms()).map(|(b, a)| a - b);
        println!(
            "{what}: {} requests at {rate} req/s ({:.0} achieved) over {} connections: p50 {:.3} p99 {:.3} max {:.3} ms (from actual send: p50 {:.3} p99 {:.3} ms), {} ms CPU stolen",
            outcome.latencies_ms.len(),
            outcome.rate(),
            pool.size(),
            crate::report::quantile(&outcome.latencies_ms, 0.5),
            crate::report::quantile(&outcome.latencies_ms, 0.99),
            crate::report::quantile(&outcome.latencies_ms, 1.0),
            crate::report::quantile(&outcome.service_ms, 0.5),
            crate::report::quantile(&outcome.service_ms, 0.99),
            steal_ms.map_or("?".into(), |s| format!("{s:.0}")),
        );
        windows.push(Window { outcome, steal_ms });
    }
    let summary = serde_json::json!(
        windows
            .iter()
            .map(|w| serde_json::json!({
                "p99_ms": crate::report::quantile(&w.outcome.latencies_ms, 0.99),
                "steal_ms": w.steal_ms,
            }))
            .collect::<Vec<_>>()
    );
    let kept = windows
        .into_iter()
        .min_by(|a, b| {
            let steal = |w: &Window| w.steal_ms.unwrap_or(0.0);
            steal(a).total_cmp(&steal(b))
        })
        .context("no window measured")?;
    Ok((kept.outcome, summary))
}

/// An AdmissionReview v1 of creating `pod`, as the apiserver sends it.
fn admission_review(pod: &k8s_openapi::api::core::v1::Pod) -> anyhow::Result<Bytes> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let review = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "5f0e3a52-7c1d-4b8e-9a3f-2d6c1b0e4a71",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod.metadata.name,
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "bench", "groups": ["system:authenticated"]},
            "object": pod,
            "dryRun": false,
        },
    });
    Ok(serde_json::to_vec(&review)?.into())
}

/// `/pod/mutate` of a real `pmem-csi controller` (self-signed certificate, caches of a real
/// apiserver) for a pod using an unbound late-binding claim of the driver, which it patches:
/// latency at a fixed rate, then the maximum rate.
pub async fn mutate(scale: &Scale) -> anyhow::Result<Vec<Benchmark>> {
    let start = Instant::now();
    let env = TestEnv::builder()
        .control_plane_at_idle_priority()
        .start()
        .await
        .context("starting testenv")?;
    let result = mutate_on(&env, scale).await;
    // Stopped on failure too, so that a failed run leaves no processes behind.
    stop(env).await?;
    println!(
        "webhook-mutate: {:.1} s with testenv start and stop",
        start.elapsed().as_secs_f64()
    );
    result
}

async fn mutate_on(env: &TestEnv, scale: &Scale) -> anyhow::Result<Vec<Benchmark>> {
    let client = env.client().await?;
    let ns = testenv::test_namespace(&client, "mutate-load").await?;
    let class = format!("{ns}-pmem");
    create_storage_class(&client, &class, DRIVER, "WaitForFirstConsumer").await?;
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &test_objects::claim(&ns, "data", &class, "1Gi"),
        )
        .await
        .context("creating the claim")?;
    let (admin, webhook) = (testenv::ports::free_port()?, testenv::ports::free_port()?);
    let args = [
        format!("--admin-address=127.0.0.1:{admin}"),
        format!("--webhook-address=127.0.0.1:{webhook}"),
        "--self-signed-san=127.0.0.1".into(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let controller = env.supervise_controller("bench-webhook-controller", &args)?;
    let body = admission_review(&test_objects::pod_with_claim(&ns, "app", "data"))?;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], webhook));
    let secrets = Api::<Secret>::namespaced(client.clone(), NAMESPACE);
    // Ready when the Secret holds the CA and the webhook, trusting only that CA, patches the
    // pod (its caches then know the claim and the class).
    let endpoint = until("the webhook to patch the pod", WAIT, || {
        let (secrets, body) = (secrets.clone(), body.clone());
        async move {
            let ca = secrets
                .get_opt(SECRET)
                .await
                .map_err(|e| e.to_string())?
                .and_then(|s| s.data)
                .and_then(|d| d.get("ca.crt").cloned())
                .ok_or("no ca.crt in the Secret yet")?;
            let config = testenv::http_client::trusting(&String::from_utf8_lossy(&ca.0))?;
            let endpoint = Endpoint {
                addr,
                transport: Transport::Tls(config),
                path: "/pod/mutate".into(),
                body,
            };
            let answer = crate::http_load::once(&endpoint)
                .await
                .map_err(|e| format!("{e:#}"))?;
            let text = String::from_utf8_lossy(&answer);
            if !text.contains("\"patch\"") {
                return Err(format!("answer without a patch: {text}"));
            }
            Ok(endpoint)
        }
    })
    .await?;
    let mut pool = Pool::connect(endpoint, scale.connections).await?;
    let rate = scale.mutate_rate;
    let name = format!("webhook-mutate-{rate}rps");
    let (fixed, windows) =
        measured_run(&mut pool, &name, rate, scale, scale.mutate_duration).await?;
    let max = pool.max_rate(scale.max_rate_duration).await?;
    max.ensure_no_failures("webhook-mutate-max-rate")?;
    println!(
        "webhook-mutate-max-rate: {:.0} req/s over {} connections ({} requests, p50 {:.3} p99 {:.3} ms)",
        max.rate(),
        pool.size(),
        max.latencies_ms.len(),
        crate::report::quantile(&max.latencies_ms, 0.5),
        crate::report::quantile(&max.latencies_ms, 0.99),
    );
    drop(pool);
    controller.stop().await;
    let flags = |extra: serde_json::Value| {
        let mut flags = serde_json::json!({
            "connections": scale.connections,
            "keep_alive": true,
            "transport": "https (TLS, self-signed CA from the Secret)",
            "control_plane": CONTROL_PLANE,
            "request": "AdmissionReview v1, pod CREATE with one unbound WaitForFirstConsumer claim of the driver (answer: 200 with a patch)",
            "warmup_s": scale.warmup.as_secs_f64(),
        });
        if let (Some(flags), serde_json::Value::Object(extra)) = (flags.as_object_mut(), extra) {
            flags.extend(extra);
        }
        flags
    };
    Ok(vec![
        Benchmark {
            name: format!("webhook-mutate-{rate}rps"),
            description: format!(
                "ms from a /pod/mutate request's scheduled send (open loop, {rate} req/s released on time by a spin over the last 200 µs at most, {} keep-alive TLS connections, the {} s window of {} with the least CPU stolen by the hypervisor; control plane at SCHED_IDLE) to the end of the answer; `secondary`: from its actual send",
                scale.connections,
                scale.mutate_duration.as_secs_f64(),
                scale.windows
            ),
            unit: "ms".into(),
            samples: fixed.latencies_ms.clone(),
            secondary: fixed.service_ms.clone(),
            target: p99_at_most(2.0),
            flags: flags(serde_json::json!({
                "rate_per_s": rate,
                "duration_s": scale.mutate_duration.as_secs_f64(),
                "achieved_rate_per_s": fixed.rate(),
                "failures": fixed.failures,
                "windows": windows,
            })),
        },
        Benchmark {
            name: "webhook-mutate-max-rate".into(),
            description: format!(
                "/pod/mutate answers per second with {} keep-alive TLS connections sending back-to-back for {} s (higher is better; one sample)",
                scale.connections,
                scale.max_rate_duration.as_secs_f64()
            ),
            unit: "req/s".into(),
            samples: vec![max.rate()],
            secondary: vec![],
            target: Target::none(),
            flags: flags(serde_json::json!({
                "duration_s": scale.max_rate_duration.as_secs_f64(),
                "requests": max.latencies_ms.len(),
                "latency_p50_ms": crate::report::quantile(&max.latencies_ms, 0.5),
                "latency_p99_ms": crate::report::quantile(&max.latencies_ms, 0.99),
                "failures": max.failures,
            })),
        },
    ])
}

/// The node names of the filter benchmarks.
/// The name of the `i`-th published node of the `/filter` load.
pub(crate) fn node_name(i: usize) -> String {
    format!("load-node-{i:05}")
}

/// ExtenderArgs for a pod with one 1 GiB CSI inline volume of the driver and `names` nodes.
fn extender_args(names: usize) -> anyhow::Result<Bytes> {
    let mut pod = test_objects::with_scheduler_resource(
        test_objects::pod_with_inline_volume("filter-load", "app", DRIVER, "1Gi"),
        DRIVER,
    );
    // Reservations are keyed by the UID: every request re-filters the same pod, as the
    // scheduler does when it retries.
    pod.metadata.uid = Some("0c7f1d2e-3b4a-4f5e-8d6c-9a0b1c2d3e4f".into());
    let args = serde_json::json!({
        "Pod": pod,
        "Nodes": null,
        "NodeNames": (0..names).map(node_name).collect::<Vec<_>>(),
    });
    Ok(serde_json::to_vec(&args)?.into())
}

/// `/filter` of a real `pmem-csi extender` whose index holds the published capacity of as many
/// nodes as the largest request names: latency at a fixed rate per request size.
pub async fn filter(scale: &Scale) -> anyhow::Result<Vec<Benchmark>> {
    let start = Instant::now();
    // A long grace: the named nodes have no Node objects and must not be judged driverless,
    // so that the fit runs for every one of them.
    let env = TestEnv::builder()
        .extender(["--reschedule-grace=24h"])
        .control_plane_at_idle_priority()
        .start()
        .await
        .context("starting testenv")?;
    let result = filter_on(&env, scale).await;
    stop(env).await?;
    println!(
        "extender-filter: {:.1} s with testenv start and stop",
        start.elapsed().as_secs_f64()
    );
    result
}

/// A capacity object of the driver for each node of `names` in class `class`, 96 GiB free in two
/// extents, as the node drivers publish them.
pub async fn publish_capacity(
    client: &kube::Client,
    names: &[String],
    class: &str,
) -> anyhow::Result<()> {
    let api = Api::<CSIStorageCapacity>::namespaced(client.clone(), NAMESPACE);
    // Creating the objects is not measured; a few dozen requests in flight keep it short.
    futures::stream::iter(names.iter().map(|node| {
        let api = api.clone();
        async move {
            let capacity = test_objects::published_capacity(
                NAMESPACE,
                DRIVER,
                node,
                class,
                &[64 * GI, 32 * GI],
                // Nothing allocated when published: every claim counts as unreflected, the
                // general path of the fit.
                96 * GI,
            );
            api.create(&PostParams::default(), &capacity)
                .await
                .map(|_| ())
        }
    }))
    .buffer_unordered(32)
    .try_collect::<Vec<()>>()
    .await
    .context("publishing capacity")?;
    Ok(())
}

async fn filter_on(env: &TestEnv, scale: &Scale) -> anyhow::Result<Vec<Benchmark>> {
    let (route, _) = env
        .extender_addresses()
        .context("the testenv runs no extender")?;
    let client = env.client().await?;
    create_storage_class(&client, CAPACITY_CLASS, DRIVER, "WaitForFirstConsumer").await?;
    let nodes = scale.filter_names.iter().copied().max().unwrap_or(0);
    let names: Vec<String> = (0..nodes).map(node_name).collect();
    publish_capacity(&client, &names, CAPACITY_CLASS).await?;
    // Ready when every published node passes a filter naming them all: the index has them.
    let all = Endpoint {
        addr: route,
        transport: Transport::Plain,
        path: "/filter".into(),
        body: extender_args(nodes)?,
    };
    until("the extender to index every node", WAIT, || async {
        let answer = crate::http_load::once(&all)
            .await
            .map_err(|e| format!("{e:#}"))?;
        let answer: serde_json::Value =
            serde_json::from_slice(&answer).map_err(|e| format!("answer: {e}"))?;
        let passed = answer["NodeNames"].as_array().map_or(0, Vec::len);
        (passed == nodes)
            .then_some(())
            .ok_or(format!("{passed} of {nodes} nodes pass"))
    })
    .await?;
    let mut out = Vec::new();
    for &names in &scale.filter_names {
        let endpoint = Endpoint {
            body: extender_args(names)?,
            ..all.clone()
        };
        let name = format!("extender-filter-{names}-names");
        let target = if names == FILTER_TARGET_NAMES {
            Target {
                p99_max: Some(RelativeTarget {
                    times: FILTER_TARGET_FLOOR_FACTOR,
                    cap: Some(FILTER_TARGET_MS),
                    ..RelativeTarget::sum(vec![floor_name(names)], 0.0)
                }),
                ..Target::none()
            }
        } else {
            Target::none()
        };
        out.push(filter_load(endpoint, &name, "all fitting", scale, target, nodes).await?);
    }
    out.extend(floor(scale, nodes, &allocator_env(env)?).await?);
    Ok(out)
}

/// The allocator settings (`MALLOC_*`) of the manifests' extender container, which the floor
/// runs with too: the floor's point is what decoding, lookup and encoding cost with the
/// extender's own setup.
fn allocator_env(env: &TestEnv) -> anyhow::Result<Vec<(String, String)>> {
    let launch = env
        .manifests()
        .launch(testenv::manifests::OurContainer::Extender)
        .context("the manifests' extender container")?;
    Ok(launch
        .env
        .into_iter()
        .filter_map(|(key, value)| match value {
            testenv::manifests::EnvValue::Literal(v) if key.starts_with("MALLOC_") => {
                Some((key, v))
            }
            _ => None,
        })
        .collect())
}

fn floor_name(names: usize) -> String {
    format!("extender-filter-floor-{names}-names")
}

/// The same load against the floor of `/filter` (bench/src/filter_floor.rs), a process of this
/// binary's own knowing `nodes` nodes, with the extender's `allocator_env`.
async fn floor(
    scale: &Scale,
    nodes: usize,
    allocator_env: &[(String, String)],
) -> anyhow::Result<Vec<Benchmark>> {
    let port = testenv::ports::free_port().context("a port for the floor")?;
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let _server = tokio::process::Command::new(std::env::current_exe()?)
        .args(["filter-floor", "--address", &addr.to_string(), "--nodes"])
        .arg(nodes.to_string())
        .envs(allocator_env.iter().map(|(k, v)| (k, v)))
        .kill_on_drop(true)
        .spawn()
        .context("starting the floor server")?;
    let all = Endpoint {
        addr,
        transport: Transport::Plain,
        path: "/filter".into(),
        body: extender_args(nodes)?,
    };
    until("the floor server to answer", WAIT, || async {
        crate::http_load::once(&all)
            .await
            .map(|_| ())
            .map_err(|e| format!("{e:#}"))
    })
    .await?;
    let mut out = Vec::new();
    for &names in &scale.filter_names {
        let endpoint = Endpoint {
            body: extender_args(names)?,
            ..all.clone()
        };
        out.push(
            filter_load(
                endpoint,
                &floor_name(names),
                "decoded, looked up and encoded only: no fit, no lock, no metrics (the floor; the extender container's MALLOC_* settings)",
                scale,
                Target::none(),
                nodes,
            )
            .await?,
        );
    }
    Ok(out)
}

/// One `/filter` benchmark: `scale`'s open-loop windows against `endpoint`.
async fn filter_load(
    endpoint: Endpoint,
    name: &str,
    what: &str,
    scale: &Scale,
    target: Target,
    nodes: usize,
) -> anyhow::Result<Benchmark> {
    let names = endpoint_names(&endpoint)?;
    let mut pool = Pool::connect(endpoint, scale.connections).await?;
    let rate = scale.filter_rate;
    let (outcome, windows) =
        measured_run(&mut pool, name, rate, scale, scale.filter_duration).await?;
    Ok(Benchmark {
        name: name.to_string(),
        description: format!(
            "ms from a /filter request's scheduled send (open loop, {rate} req/s released on time by a spin over the last 200 µs at most, {} keep-alive connections, the {} s window of {} with the least CPU stolen by the hypervisor; control plane at SCHED_IDLE; {names} node names, {what}) to the end of the answer; `secondary`: from its actual send",
            scale.connections,
            scale.filter_duration.as_secs_f64(),
            scale.windows
        ),
        unit: "ms".into(),
        samples: outcome.latencies_ms.clone(),
        secondary: outcome.service_ms.clone(),
        target,
        flags: serde_json::json!({
            "names": names,
            "published_nodes": nodes,
            "rate_per_s": rate,
            "duration_s": scale.filter_duration.as_secs_f64(),
            "warmup_s": scale.warmup.as_secs_f64(),
            "connections": scale.connections,
            "keep_alive": true,
            "transport": "http",
            "request": "ExtenderArgs with NodeNames; pod with one 1Gi CSI inline volume of the driver, same UID every request",
            "extender_args": ["--reschedule-grace=24h"],
            "control_plane": CONTROL_PLANE,
            "placement": "reserve-all (default)",
            "achieved_rate_per_s": outcome.rate(),
            "failures": outcome.failures,
            "windows": windows,
        }),
    })
}

/// How many node names the request of `endpoint` carries.
fn endpoint_names(endpoint: &Endpoint) -> anyhow::Result<usize> {
    let args: serde_json::Value = serde_json::from_slice(&endpoint.body)?;
    Ok(args["NodeNames"].as_array().map_or(0, Vec::len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steal_is_read_and_never_decreases() {
        let first = steal_ms().expect("/proc/stat reports steal");
        let second = steal_ms().expect("/proc/stat reports steal");
        assert!(first >= 0.0 && second >= first, "{first} then {second}");
    }

    #[test]
    fn bodies_are_what_the_servers_decode() {
        let review = webhooks::admission::decode_review(
            &admission_review(&test_objects::pod_with_claim("ns", "app", "data")).expect("review"),
        )
        .expect("the webhook decodes the review");
        assert_eq!(review.namespace.as_deref(), Some("ns"));
        assert!(review.object.is_some());
        let args = extender::api::decode_request(&extender_args(3).expect("args"))
            .expect("the extender decodes the args");
        assert!(!args.pod_uid.is_empty());
        let raw: serde_json::Value =
            serde_json::from_slice(&extender_args(3).expect("args")).expect("JSON");
        assert_eq!(
            raw["NodeNames"],
            serde_json::json!(["load-node-00000", "load-node-00001", "load-node-00002"])
        );
        assert_eq!(
            raw["Pod"]["spec"]["volumes"][0]["csi"]["driver"],
            serde_json::json!(DRIVER)
        );
    }
}
