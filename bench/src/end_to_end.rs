//! End-to-end benchmarks on testenv with every piece running (drivers and provisioners, the
//! controller with its webhook, the extender beside kube-scheduler, the simulated kubelet):
//!
//! - **pod start-up**: a burst of pods with one claim each on 10 nodes, against the same burst of
//!   pods without volumes: the whole burst's time, claim created → bound, and each stage
//!   (created → selected-node, CreateVolume, selected-node → PV created, PV created → bound,
//!   bound → Running), observed by watches as they happen;
//! - **storage-bound A/B**: 10 nodes of 1 GiB, 190 pods of 50 MiB (every node holds exactly 19),
//!   (a) capacity tracking alone (no webhook, no extender) against (b) webhook + extender; each
//!   arm stopped at a deadline.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use controllers::test_objects;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use testenv::node_processes::DriverOptions;
use testenv::{NodeSpec, SchedulerConfig, TestEnv, TestEnvBuilder};
use tokio_util::sync::CancellationToken;

use crate::report::{Benchmark, Target};

const CLASS_NO_ERASE: &str = "pmem-csi-sc-ext4-no-erase";
use controllers::well_known::SELECTED_NODE as SELECTED;

/// Sizes of a run.
#[derive(Clone, Debug)]
pub struct Scale {
    /// Nodes of the start-up benchmark.
    pub startup_nodes: usize,
    /// Pods of the start-up benchmark.
    pub startup_pods: usize,
    /// Nodes of the storage-bound benchmark.
    pub bound_nodes: usize,
    /// Pods per node that exactly fill a node of the storage-bound benchmark.
    pub bound_pods_per_node: usize,
    /// How long an arm of the storage-bound benchmark may take.
    pub arm_deadline: Duration,
    /// Runs of each storage-bound arm, alternating (both arms wait on the same throttled
    /// provisioners, so one run each compared noise with noise).
    pub bound_samples: usize,
}

impl Scale {
    /// What `just bench` runs.
    pub fn full() -> Self {
        Self {
            startup_nodes: 10,
            startup_pods: 100,
            bound_nodes: 10,
            bound_pods_per_node: 19,
            arm_deadline: Duration::from_secs(15 * 60),
            bound_samples: 3,
        }
    }

    /// The start-up burst alone with `pods` pods on `nodes` nodes.
    pub fn startup(nodes: usize, pods: usize) -> Self {
        Self {
            startup_nodes: nodes,
            startup_pods: pods,
            ..Self::full()
        }
    }

    /// What `just test` smoke-runs.
    pub fn smoke() -> Self {
        Self {
            startup_nodes: 2,
            startup_pods: 4,
            bound_nodes: 2,
            bound_pods_per_node: 2,
            arm_deadline: Duration::from_secs(180),
            bound_samples: 1,
        }
    }
}

/// Volume size of the storage-bound benchmark; the driver aligns it to 4 MiB (52 MiB), so 19
/// fill 1 GiB (988 MiB) and a 20th does not fit.
const BOUND_VOLUME: &str = "50Mi";
const BOUND_ALIGNED_MIB: usize = 52;

/// When each thing was first seen, per claim or pod name.
#[derive(Default)]
struct Timeline {
    created: HashMap<String, Instant>,
    selected: HashMap<String, Instant>,
    pv_created: HashMap<String, Instant>,
    bound: HashMap<String, Instant>,
    running: HashMap<String, Instant>,
}

type Shared = Arc<Mutex<Timeline>>;

fn lock(t: &Shared) -> std::sync::MutexGuard<'_, Timeline> {
    t.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Watches claims, PVs and pods of `namespace`, recording first sightings into `timeline`.
fn observe(client: &kube::Client, namespace: &str, timeline: &Shared, stop: &CancellationToken) {
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), namespace);
    let pods = Api::<Pod>::namespaced(client.clone(), namespace);
    let pvs = Api::<PersistentVolume>::all(client.clone());
    let ns = namespace.to_string();
    let t = timeline.clone();
    let s = stop.clone();
    tokio::spawn(async move {
        let mut events = watcher::watcher(claims, watcher::Config::default())
            .applied_objects()
            .boxed();
        loop {
            let claim = tokio::select! {
                _ = s.cancelled() => return,
                c = events.next() => c,
            };
            let Some(Ok(claim)) = claim else {
                continue;
            };
            let now = Instant::now();
            let name = claim.metadata.name.clone().unwrap_or_default();
            let mut t = lock(&t);
            if claim
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(SELECTED))
            {
                t.selected.entry(name.clone()).or_insert(now);
            }
            if claim.status.and_then(|s| s.phase).as_deref() == Some("Bound") {
                t.bound.entry(name).or_insert(now);
            }
        }
    });
    let t = timeline.clone();
    let s = stop.clone();
    tokio::spawn(async move {
        let mut events = watcher::watcher(pvs, watcher::Config::default())
            .applied_objects()
            .boxed();
        loop {
            let pv = tokio::select! {
                _ = s.cancelled() => return,
                p = events.next() => p,
            };
            let Some(Ok(pv)) = pv else {
                continue;
            };
            let Some(claim) = pv.spec.and_then(|s| s.claim_ref) else {
                continue;
            };
            if claim.namespace.as_deref() == Some(ns.as_str()) {
                lock(&t)
                    .pv_created
                    .entry(claim.name.unwrap_or_default())
                    .or_insert_with(Instant::now);
            }
        }
    });
    let t = timeline.clone();
    let s = stop.clone();
    tokio::spawn(async move {
        let mut events = watcher::watcher(pods, watcher::Config::default())
            .applied_objects()
            .boxed();
        loop {
            let pod = tokio::select! {
                _ = s.cancelled() => return,
                p = events.next() => p,
            };
            let Some(Ok(pod)) = pod else {
                continue;
            };
            if pod.status.and_then(|s| s.phase).as_deref() == Some("Running") {
                lock(&t)
                    .running
                    .entry(pod.metadata.name.unwrap_or_default())
                    .or_insert_with(Instant::now);
            }
        }
    });
}

/// Creates `pods` pods (each with a claim of `size` when given) in one burst, 20 requests in
/// flight, recording when each claim was created; then waits until all run or `deadline`.
/// Returns the burst's duration and whether every pod runs.
async fn burst(
    client: &kube::Client,
    namespace: &str,
    pods: usize,
    size: Option<&str>,
    timeline: &Shared,
    deadline: Duration,
) -> anyhow::Result<(Duration, bool)> {
    let start = Instant::now();
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), namespace);
    let pod_api = Api::<Pod>::namespaced(client.clone(), namespace);
    futures::stream::iter((0..pods).map(|i| {
        let (claims, pod_api, timeline) = (claims.clone(), pod_api.clone(), timeline.clone());
        async move {
            let name = format!("p{i}");
            let pod = match size {
                Some(size) => {
                    claims
                        .create(
                            &Default::default(),
                            &test_objects::claim(namespace, &name, CLASS_NO_ERASE, size),
                        )
                        .await?;
                    lock(&timeline).created.insert(name.clone(), Instant::now());
                    test_objects::pod_with_claim(namespace, &name, &name)
                }
                None => {
                    let mut pod = test_objects::pod_with_claim(namespace, &name, "none");
                    if let Some(spec) = pod.spec.as_mut() {
                        spec.volumes = None;
                    }
                    lock(&timeline).created.insert(name.clone(), Instant::now());
                    pod
                }
            };
            pod_api.create(&Default::default(), &pod).await?;
            anyhow::Ok(())
        }
    }))
    .buffer_unordered(20)
    .try_collect::<Vec<()>>()
    .await
    .context("creating the burst")?;
    let all = testenv::wait::until("every pod to run", deadline, || async {
        let n = lock(timeline).running.len();
        if n >= pods {
            Ok(())
        } else {
            Err(format!("{n} of {pods} running"))
        }
    })
    .await
    .is_ok();
    Ok((start.elapsed(), all))
}

fn seconds_between(from: &HashMap<String, Instant>, to: &HashMap<String, Instant>) -> Vec<f64> {
    from.iter()
        .filter_map(|(name, a)| Some(to.get(name)?.saturating_duration_since(*a).as_secs_f64()))
        .collect()
}

fn full_stack(nodes: Vec<NodeSpec>, bind_timeout: u64) -> TestEnvBuilder {
    let mut builder = TestEnv::builder();
    for node in nodes {
        builder = builder.node(node);
    }
    builder
        .drivers(DriverOptions {
            extra_args: vec!["--log-format=json".into()],
            ..Default::default()
        })
        .scheduler(SchedulerConfig::default().bind_timeout_seconds(bind_timeout))
        .kubelet()
}

/// The client-side QPS/burst of every component, as configured or defaulted, for the flags.
fn qps_flags(env: &TestEnv) -> serde_json::Value {
    let rendered = |which| {
        env.manifests()
            .launch(which)
            .map(|l| {
                l.args
                    .into_iter()
                    .filter(|a| a.contains("qps") || a.contains("burst"))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
    };
    use testenv::manifests::OurContainer;
    serde_json::json!({
        "pmem-csi node": or_default(rendered(OurContainer::NodeDriver), "--kube-api-qps=5 --kube-api-burst=10 (defaults)"),
        "csi-provisioner": or_default(rendered(OurContainer::Provisioner), "--kube-api-qps=5 --kube-api-burst=10 (defaults)"),
        "pmem-csi controller": or_default(rendered(OurContainer::Controller), "--kube-api-qps=20 --kube-api-burst=40 (defaults)"),
        "pmem-csi extender": "watches only (kube-rs, no client-side limit)",
        "kube-scheduler": "clientConnection qps 50, burst 100 (KubeSchedulerConfiguration defaults)",
        "kube-controller-manager": "--kube-api-qps=20 --kube-api-burst=30 (defaults)",
        "kube-apiserver": "--max-requests-inflight=400 --max-mutating-requests-inflight=200 (defaults)",
        "simulated kubelet": "admin client, no limit",
        "benchmark client": "20 creates in flight",
    })
}

fn or_default(args: Vec<String>, default: &str) -> serde_json::Value {
    if args.is_empty() {
        default.into()
    } else {
        args.join(" ").into()
    }
}

/// CreateVolume calls that ended in ResourceExhausted, summed over the drivers' metrics.
async fn exhausted_creates(env: &TestEnv) -> u64 {
    let mut total = 0;
    for node in env.nodes() {
        if let Some(port) = env.driver_admin_port(&node.name) {
            let text = testenv::metrics::scrape_metrics(port).await;
            total += testenv::metrics::create_volume_calls(&text, "ResourceExhausted").0;
        }
    }
    total
}

async fn stop(env: TestEnv) -> anyhow::Result<()> {
    let leftovers = env.stop().await;
    let remaining = leftovers.wait_clean(Duration::from_secs(30)).await;
    anyhow::ensure!(remaining.is_empty(), "left behind: {remaining:?}");
    Ok(())
}

/// The pmem-csi share of the start-up benchmark's target: time inside our components on the
/// claims' critical path, in percent of their created → Running time.
const OWN_SHARE_TARGET_PERCENT: f64 = 5.0;

/// Sum of the samples of every series of metric `name` (a `_sum` or `_count`) in `text` (no
/// series yet: nothing observed, 0).
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter(|l| l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Seconds our webhook and extender spent answering, from their metrics (an error when either
/// does not run or its metrics cannot be read: the share would silently shrink).
async fn served_seconds(env: &TestEnv) -> anyhow::Result<(f64, f64)> {
    let (_, controller) = env.controller_ports().context("no controller runs")?;
    let (_, extender) = env.extender_addresses().context("no extender runs")?;
    let scrape = |port: u16, what: &'static str| async move {
        let text = testenv::metrics::scrape_metrics(port).await;
        anyhow::ensure!(!text.is_empty(), "no metrics from the {what}");
        Ok(text)
    };
    Ok((
        metric_sum(
            &scrape(controller, "controller").await?,
            "controller_runtime_webhook_latency_seconds_sum",
        ),
        metric_sum(
            &scrape(extender.port(), "extender").await?,
            "pmem_csi_extender_request_duration_seconds_sum",
        ),
    ))
}

/// The seconds of successful `method` calls in every node driver's JSON log.
fn driver_rpc_seconds(env: &TestEnv, method: &str) -> Vec<f64> {
    env.nodes()
        .iter()
        .flat_map(|n| {
            testenv::json_log::rpc_durations(
                &env.dir().join(format!("logs/{}-pmem-csi.log", n.name)),
                method,
            )
        })
        .map(|d| d.as_secs_f64())
        .collect()
}

/// Requests of the node ServiceAccount (the drivers and csi-provisioners) the API server has
/// audited so far.
fn node_account_requests(env: &TestEnv) -> anyhow::Result<usize> {
    let user = testenv::audit::service_account_user(
        testenv::manifests::NAMESPACE,
        "pmem-csi-intel-com-node",
    );
    let path = env.audit_log();
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading the audit log {}", path.display()))?;
    Ok(testenv::audit::parse_log(&text)
        .0
        .iter()
        .filter(|r| r.user == user)
        .count())
}

/// One setting of the csi-provisioner sidecar and kube-controller-manager for
/// [`pod_startup_with`].
#[derive(Clone, Debug)]
pub struct StartupSetting {
    /// Short name for the benchmark rows (`shipped`, `provisioner-qps-20-burst-40`, …).
    pub label: String,
    /// Changes to the shipped csi-provisioner container's command line (empty: as shipped).
    pub provisioner_args: Vec<String>,
    /// Extra kube-controller-manager flags (empty: its defaults, qps 20, burst 30).
    pub controller_manager_args: Vec<String>,
}

impl StartupSetting {
    /// The shipped manifests' settings, kube-controller-manager's defaults.
    pub fn shipped() -> Self {
        Self {
            label: "shipped".into(),
            provisioner_args: Vec::new(),
            controller_manager_args: Vec::new(),
        }
    }

    /// What `--startup-sweep` compares: the shipped settings first (csi-provisioner at 20/s,
    /// burst 40), then client-go's default budget (5/s, burst 10), a larger one with more
    /// workers, and kube-controller-manager (whose PV binder binds every claim) at 100/s.
    pub fn sweep() -> Vec<Self> {
        let strings = |args: &[&str]| args.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        let setting = |label: &str, provisioner: &[&str], kcm: &[&str]| Self {
            label: label.into(),
            provisioner_args: strings(provisioner),
            controller_manager_args: strings(kcm),
        };
        vec![
            Self::shipped(),
            setting(
                "provisioner-qps-5-burst-10",
                &["--kube-api-qps=5", "--kube-api-burst=10"],
                &[],
            ),
            setting(
                "provisioner-qps-50-burst-100-workers-10",
                &[
                    "--kube-api-qps=50",
                    "--kube-api-burst=100",
                    "--worker-threads=10",
                ],
                &[],
            ),
            setting(
                "kcm-qps-100-burst-200",
                &[],
                &["--kube-api-qps=100", "--kube-api-burst=200"],
            ),
        ]
    }

    fn is_shipped(&self) -> bool {
        self.provisioner_args.is_empty() && self.controller_manager_args.is_empty()
    }
}

/// The pod start-up benchmark: with claims, then without volumes, on the same testenv.
pub async fn pod_startup(scale: &Scale) -> anyhow::Result<Vec<Benchmark>> {
    pod_startup_with(scale, &StartupSetting::shipped(), true).await
}

/// The start-up benchmark under each of `settings` in turn, the first one also without volumes.
pub async fn startup_sweep(
    scale: &Scale,
    settings: &[StartupSetting],
) -> anyhow::Result<Vec<Benchmark>> {
    let mut out = Vec::new();
    for (i, setting) in settings.iter().enumerate() {
        out.extend(pod_startup_with(scale, setting, i == 0).await?);
    }
    Ok(out)
}

/// The pod start-up benchmark under provisioner `setting`: the burst with claims, its stages
/// and pmem-csi's own share of it, and (`baseline`) the same burst without volumes.
pub async fn pod_startup_with(
    scale: &Scale,
    setting: &StartupSetting,
    baseline: bool,
) -> anyhow::Result<Vec<Benchmark>> {
    let nodes = (1..=scale.startup_nodes)
        .map(|i| NodeSpec::with_driver(format!("node-{i}")))
        .collect();
    let mut builder = full_stack(nodes, 600);
    if let Some(options) = builder.driver_options_mut() {
        options
            .provisioner_args
            .clone_from(&setting.provisioner_args);
    }
    let env = builder
        .controller_manager_args(setting.controller_manager_args.clone())
        .extender(Vec::<String>::new())
        .controller(Vec::<String>::new())
        .start()
        .await
        .context("starting testenv")?;
    let client = env.client().await?;
    let size = "16Mi";
    let mut out = Vec::new();
    let mut totals = Vec::new();
    let runs: &[bool] = if baseline { &[true, false] } else { &[true] };
    // The 10-node burst keeps the names it has always had; other sizes say theirs.
    let scaled = |name: &str| match scale.startup_nodes {
        1..=10 => name.to_string(),
        nodes => format!("{name}-{nodes}-nodes"),
    };
    let row = |name: &str| {
        if setting.is_shipped() {
            scaled(name)
        } else {
            format!("{}-{}", scaled(name), setting.label)
        }
    };
    let mut flags = qps_flags(&env);
    flags["changed"] = serde_json::json!({
        "csi-provisioner": setting.provisioner_args.join(" "),
        "kube-controller-manager": setting.controller_manager_args.join(" "),
    });
    for &with_claims in runs {
        let served_before = served_seconds(&env).await?;
        let requests_before = node_account_requests(&env)?;
        let ns = testenv::test_namespace(&client, "startup").await?;
        let timeline = Shared::default();
        let watching = CancellationToken::new();
        observe(&client, &ns, &timeline, &watching);
        // The watches list before the burst starts, so no first sighting is late.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (took, all) = burst(
            &client,
            &ns,
            scale.startup_pods,
            with_claims.then_some(size),
            &timeline,
            Duration::from_secs(600),
        )
        .await?;
        watching.cancel();
        anyhow::ensure!(all, "not every pod of the burst ran within 10 minutes");
        totals.push(took.as_secs_f64());
        let served_after = served_seconds(&env).await?;
        let requests = node_account_requests(&env)? - requests_before;
        let t = lock(&timeline);
        if with_claims {
            out.push(own_share(
                &env,
                &t,
                (
                    served_after.0 - served_before.0,
                    served_after.1 - served_before.1,
                ),
                &row("startup-own-share"),
                scale,
                flags.clone(),
            ));
            out.push(Benchmark {
                name: row("startup-node-account-requests-per-s"),
                description: format!(
                    "API requests per second of the node ServiceAccount (drivers and csi-provisioners of all {} nodes) over the burst with claims (audit log)",
                    scale.startup_nodes
                ),
                unit: "req/s".into(),
                samples: vec![requests as f64 / took.as_secs_f64()],
                secondary: Vec::new(),
                target: Target::none(),
                flags: {
                    let mut flags = flags.clone();
                    flags["requests"] = requests.into();
                    flags["burst_s"] = took.as_secs_f64().into();
                    flags
                },
            });
            let stages = [
                (
                    "startup-claim-created-to-bound",
                    "claim created → Bound, per claim of the burst",
                    seconds_between(&t.created, &t.bound),
                ),
                (
                    "startup-stage-selected-node",
                    "claim created → selected-node set (webhook, scheduler with the extender's filter), per claim",
                    seconds_between(&t.created, &t.selected),
                ),
                (
                    "startup-stage-pv-created",
                    "selected-node → PV created (external-provisioner and CreateVolume on the node), per claim",
                    seconds_between(&t.selected, &t.pv_created),
                ),
                (
                    "startup-stage-bound",
                    "PV created → claim Bound (kube-controller-manager's PV binder), per claim",
                    seconds_between(&t.pv_created, &t.bound),
                ),
                (
                    "startup-stage-running",
                    "claim Bound → pod Running (scheduler's bind, kubelet's NodeStage and NodePublish), per pod",
                    seconds_between(&t.bound, &t.running),
                ),
            ];
            for (name, description, samples) in stages {
                out.push(Benchmark {
                    name: row(name),
                    description: format!(
                        "{description}; {} pods on {} nodes in one burst",
                        scale.startup_pods, scale.startup_nodes
                    ),
                    unit: "s".into(),
                    samples,
                    secondary: Vec::new(),
                    target: Target::none(),
                    flags: flags.clone(),
                });
            }
        } else {
            out.push(Benchmark {
                name: "startup-pod-without-volumes-created-to-running".into(),
                description: format!(
                    "pod created → Running without volumes, per pod; {} pods on {} nodes in one burst",
                    scale.startup_pods, scale.startup_nodes
                ),
                unit: "s".into(),
                samples: seconds_between(&t.created, &t.running),
                secondary: Vec::new(),
                target: Target::none(),
                flags: qps_flags(&env),
            });
        }
    }
    let create_volume = driver_rpc_seconds(&env, "CreateVolume");
    out.push(Benchmark {
        name: row("startup-stage-create-volume"),
        description: format!(
            "CreateVolume in the node driver (its own log), per claim of the burst ({size}, ext4 class without erase)"
        ),
        unit: "s".into(),
        samples: create_volume,
        secondary: Vec::new(),
        target: Target::none(),
        flags: flags.clone(),
    });
    out.push(Benchmark {
        name: row("startup-burst-total"),
        description: format!(
            "first create → every pod Running for {} pods with one {size} claim each on {} nodes; secondary: the same pods without volumes",
            scale.startup_pods, scale.startup_nodes
        ),
        unit: "s".into(),
        samples: vec![totals[0]],
        secondary: totals.get(1).copied().into_iter().collect(),
        target: Target::none(),
        flags,
    });
    stop(env).await?;
    Ok(out)
}

/// pmem-csi's share of the burst: the seconds our webhook and extender spent answering
/// (`served`, from their metrics), CreateVolume, NodeStageVolume and NodePublishVolume in the
/// drivers (their logs), against the sum of every claim's created → Running. Each of those is
/// on a claim's critical path (the scheduler waits for the extender, the provisioner for
/// CreateVolume, kubelet for the node calls); the capacity publisher is not (it runs beside).
fn own_share(
    env: &TestEnv,
    t: &Timeline,
    (webhook, extender): (f64, f64),
    name: &str,
    scale: &Scale,
    mut flags: serde_json::Value,
) -> Benchmark {
    let create: f64 = driver_rpc_seconds(env, "CreateVolume").iter().sum();
    let stage: f64 = driver_rpc_seconds(env, "NodeStageVolume").iter().sum();
    let publish: f64 = driver_rpc_seconds(env, "NodePublishVolume").iter().sum();
    let total: f64 = seconds_between(&t.created, &t.running).iter().sum();
    let ours = webhook + extender + create + stage + publish;
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    flags["own_seconds"] = serde_json::json!({
        "webhook": round(webhook), "extender": round(extender),
        "create_volume": round(create), "node_stage": round(stage),
        "node_publish": round(publish), "total": round(ours),
    });
    flags["claims_created_to_running_seconds_summed"] = round(total).into();
    Benchmark {
        name: name.into(),
        description: format!(
            "pmem-csi's own share of the burst's {} claims' created → Running time: seconds inside our webhook and extender (their latency metrics), CreateVolume, NodeStageVolume and NodePublishVolume (the drivers' logs), in percent of the claims' summed created → Running; {} nodes",
            scale.startup_pods, scale.startup_nodes
        ),
        unit: "%".into(),
        samples: vec![if total > 0.0 {
            100.0 * ours / total
        } else {
            0.0
        }],
        secondary: Vec::new(),
        target: Target {
            p50_max: Some(OWN_SHARE_TARGET_PERCENT),
            ..Target::none()
        },
        flags,
    }
}

/// One arm of the storage-bound benchmark.
struct Arm {
    took: Duration,
    running: usize,
    finished: bool,
    exhausted: u64,
    provisioning_failed: usize,
    expired: u64,
    flags: serde_json::Value,
}

async fn storage_bound_arm(scale: &Scale, with_extender: bool) -> anyhow::Result<Arm> {
    let budget = format!(
        "{}Mi",
        1024.min(BOUND_ALIGNED_MIB * scale.bound_pods_per_node + 36)
    );
    let nodes = (1..=scale.bound_nodes)
        .map(|i| NodeSpec::with_driver(format!("node-{i}")).budget(budget.clone()))
        .collect();
    let builder = full_stack(nodes, 600);
    let builder = if with_extender {
        builder
            .extender(Vec::<String>::new())
            .controller(Vec::<String>::new())
    } else {
        builder.controller_without_webhook(Vec::<String>::new())
    };
    let env = builder.start().await.context("starting testenv")?;
    let client = env.client().await?;
    let ns = testenv::test_namespace(&client, "bound").await?;
    let pods = scale.bound_nodes * scale.bound_pods_per_node;
    let timeline = Shared::default();
    let watching = CancellationToken::new();
    observe(&client, &ns, &timeline, &watching);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (took, finished) = burst(
        &client,
        &ns,
        pods,
        Some(BOUND_VOLUME),
        &timeline,
        scale.arm_deadline,
    )
    .await?;
    watching.cancel();
    let running = lock(&timeline).running.len();
    let exhausted = exhausted_creates(&env).await;
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(client.clone(), &ns)
        .list(&kube::api::ListParams::default().fields("reason=ProvisioningFailed"))
        .await?;
    let expired = match env.extender_addresses() {
        Some((_, admin)) => {
            let text = testenv::metrics::scrape_metrics(admin.port()).await;
            text.lines()
                .filter(|l| l.contains("reservation") && l.contains("expired"))
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .fold(0.0, |a, b| a + b) as u64
        }
        None => 0,
    };
    if exhausted > 0 || !finished {
        // The work directory goes with the testenv; these logs explain the failures.
        let arm = if with_extender {
            "extender"
        } else {
            "capacity-tracking"
        };
        if let Some(kept) = env.keep_logs(&format!("pmem-csi-bench-logs-{arm}")) {
            eprintln!("storage-bound arm: logs kept in {}", kept.display());
        }
    }
    let flags = serde_json::json!({
        "nodes": scale.bound_nodes,
        "budget per node": budget,
        "pods": pods,
        "volume": BOUND_VOLUME,
        "class": CLASS_NO_ERASE,
        "bindTimeoutSeconds": 600,
        "deadline_s": scale.arm_deadline.as_secs(),
        "finished": finished,
        "running": running,
        "resource_exhausted_creates": exhausted,
        "provisioning_failed_events": events.items.len(),
        "expired_reservations": expired,
        "qps": qps_flags(&env),
    });
    stop(env).await?;
    Ok(Arm {
        took,
        running,
        finished,
        exhausted,
        provisioning_failed: events.items.len(),
        expired,
        flags,
    })
}

/// The storage-bound A/B benchmark.
pub async fn storage_bound(scale: &Scale) -> anyhow::Result<Vec<Benchmark>> {
    let pods = scale.bound_nodes * scale.bound_pods_per_node;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..scale.bound_samples.max(1) {
        a.push(storage_bound_arm(scale, false).await?);
        b.push(storage_bound_arm(scale, true).await?);
    }
    let a_name = "storage-bound-capacity-tracking";
    let setting = format!(
        "{pods} pods with one {BOUND_VOLUME} claim each on {} nodes that hold exactly {} each, {} runs per arm alternating",
        scale.bound_nodes,
        scale.bound_pods_per_node,
        a.len()
    );
    let not_running = |arm: &Arm| (pods - arm.running.min(pods)) as u64;
    let list = |arms: &[Arm], f: &dyn Fn(&Arm) -> u64| {
        arms.iter()
            .map(|arm| f(arm).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    Ok(vec![
        Benchmark {
            name: a_name.into(),
            description: format!(
                "(a) capacity tracking alone (no webhook, no extender): first create → every pod Running, or the deadline; {setting}; secondary: ResourceExhausted CreateVolume results per run (not running: {}; ProvisioningFailed events: {})",
                list(&a, &not_running),
                list(&a, &|arm| arm.provisioning_failed as u64),
            ),
            unit: "s".into(),
            samples: a.iter().map(|arm| arm.took.as_secs_f64()).collect(),
            secondary: a.iter().map(|arm| arm.exhausted as f64).collect(),
            target: Target::none(),
            flags: arm_flags(&a),
        },
        Benchmark {
            name: "storage-bound-extender".into(),
            description: format!(
                "(b) webhook + extender: first create → every pod Running; {setting}; p50 no slower than (a)'s unless (a) did not finish"
            ),
            unit: "s".into(),
            samples: b.iter().map(|arm| arm.took.as_secs_f64()).collect(),
            secondary: Vec::new(),
            target: Target {
                p50_at_most_of: Some(a_name.into()),
                ..Target::none()
            },
            flags: arm_flags(&b),
        },
        Benchmark {
            name: "storage-bound-extender-failures".into(),
            description: format!(
                "(b) per run: pods not Running + ResourceExhausted CreateVolume results + expired reservations (must all be 0): not running {}; exhausted {}; expired {}",
                list(&b, &not_running),
                list(&b, &|arm| arm.exhausted),
                list(&b, &|arm| arm.expired),
            ),
            unit: "".into(),
            samples: b
                .iter()
                .map(|arm| (not_running(arm) + arm.exhausted + arm.expired) as f64)
                .collect(),
            secondary: Vec::new(),
            target: Target {
                max: Some(0.0),
                ..Target::none()
            },
            flags: serde_json::json!({"finished": b.iter().all(|arm| arm.finished)}),
        },
    ])
}

/// The flags of an arm's runs: the first run's, with `finished` true only when every run
/// finished and the per-run outcomes listed.
fn arm_flags(arms: &[Arm]) -> serde_json::Value {
    let mut flags = arms
        .first()
        .map(|arm| arm.flags.clone())
        .unwrap_or_default();
    if let Some(map) = flags.as_object_mut() {
        map.insert(
            "finished".into(),
            arms.iter().all(|arm| arm.finished).into(),
        );
        for key in [
            "running",
            "resource_exhausted_creates",
            "provisioning_failed_events",
            "expired_reservations",
        ] {
            let runs: Vec<serde_json::Value> = arms
                .iter()
                .map(|arm| arm.flags.get(key).cloned().unwrap_or_default())
                .collect();
            map.insert(key.into(), runs.into());
        }
    }
    flags
}
