//! `just demo`: a 3-node testenv with every piece running (drivers and provisioners, controller
//! and webhook, extender beside kube-scheduler, simulated kubelet). It applies the examples of
//! `manifests/examples` one by one and narrates each pod's way to Running — the webhook's
//! mutation, the extender's decision, CreateVolume on the chosen node, stage and publish — then
//! keeps the cluster up until Ctrl-C (or stops at once with `--exit-after-demo`) and leaves
//! nothing behind.
//!
//! Transcript lines start with `[<seconds>s] <step>`; `tests/demo.rs` checks them.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use kube::Api;
use testenv::wait::until;
use testenv::{TestEnv, json_log};
use tokio::signal::unix::{SignalKind, signal};

const NAMESPACE: &str = "demo";
const EXAMPLES: [&str; 4] = [
    "pvc-late-binding.yaml",
    "pvc-block.yaml",
    "pod-inline-ephemeral.yaml",
    "pod-generic-ephemeral.yaml",
];
const WAIT: Duration = Duration::from_secs(120);
const BUDGET: &str = "2Gi";

struct Narrator {
    start: Instant,
}

impl Narrator {
    fn say(&self, step: &str, text: impl std::fmt::Display) {
        println!(
            "[{:>6.1}s] {step:<9} {text}",
            self.start.elapsed().as_secs_f64()
        );
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,kube_client=off".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let exit_after_demo = std::env::args().any(|a| a == "--exit-after-demo");
    if let Some(other) = std::env::args().skip(1).find(|a| a != "--exit-after-demo") {
        bail!("unknown argument {other:?}; the only option is --exit-after-demo");
    }
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    let n = Narrator {
        start: Instant::now(),
    };
    n.say(
        "start",
        format!(
            "testenv: etcd, kube-apiserver, kube-controller-manager, kube-scheduler with the \
             extender (--placement=pin, so that its decision is one node), 3 nodes with \
             {BUDGET} of emulated PMEM each, the controller with its webhook, simulated kubelet"
        ),
    );
    let options = testenv::node_processes::DriverOptions {
        size: BUDGET.into(),
        extra_args: vec!["--log-format=json".into()],
        ..Default::default()
    };
    let env = tokio::select! {
        env = TestEnv::builder()
            .nodes(3)
            .drivers(options)
            .extender(["--placement=pin", "--log-format=json"])
            .extender_env("RUST_LOG", "info,extender::server=debug,extender::placement=debug")
            .controller(Vec::<String>::new())
            .kubelet()
            .start() => env.context("starting testenv")?,
        _ = int.recv() => return Ok(()),
        _ = term.recv() => return Ok(()),
    };
    n.say("ready", "cluster up");
    let outcome = tokio::select! {
        outcome = run(&env, &n) => outcome,
        _ = int.recv() => Ok(()),
        _ = term.recv() => Ok(()),
    };
    if let Err(e) = &outcome {
        // The work directory goes with the testenv; the logs explain the failure.
        let kept = env.keep_logs("pmem-csi-demo-logs");
        eprintln!(
            "demo failed: {e:#}{}",
            kept.map(|k| format!("; logs kept in {}", k.display()))
                .unwrap_or_default()
        );
    } else if !exit_after_demo {
        print_access(&env);
        tokio::select! {
            _ = int.recv() => {},
            _ = term.recv() => {},
        }
    }
    eprintln!("stopping testenv");
    let leftovers = env.stop().await;
    let remaining = leftovers.wait_clean(Duration::from_secs(10)).await;
    anyhow::ensure!(remaining.is_empty(), "left behind: {remaining:?}");
    n.say("stopped", "testenv stopped; nothing left behind");
    outcome
}

async fn run(env: &TestEnv, n: &Narrator) -> anyhow::Result<()> {
    let client = env.client().await?;
    testenv::api_calls::apply(
        &Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone()),
        &serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}
        }))?,
    )
    .await
    .context("namespace")?;
    for example in EXAMPLES {
        let path = testenv::tools::repo_root()
            .join("manifests/examples")
            .join(example);
        let pods = apply(env, &path)?;
        n.say(
            "apply",
            format!("manifests/examples/{example}: pods {pods:?}"),
        );
        for pod in pods {
            narrate_pod(env, n, &client, &pod)
                .await
                .with_context(|| format!("pod {NAMESPACE}/{pod}"))?;
        }
    }
    for node in env.nodes() {
        let Some(port) = env.driver_admin_port(&node.name) else {
            continue;
        };
        let text = testenv::metrics::scrape_metrics(port).await;
        let (count, sum) = testenv::metrics::create_volume_calls(&text, "OK");
        n.say(
            "histogram",
            format!(
                "{} csi_plugin_operations_seconds CreateVolume OK: count {count}, sum {sum:.4} s",
                node.name
            ),
        );
    }
    n.say("done", "every example pod is Running");
    Ok(())
}

/// `kubectl apply -f path -n demo`; returns the pods it created.
fn apply(env: &TestEnv, path: &Path) -> anyhow::Result<Vec<String>> {
    let output = std::process::Command::new(env.tools().go("kubectl"))
        .arg("--kubeconfig")
        .arg(env.admin_kubeconfig())
        .args(["apply", "-n", NAMESPACE, "-f"])
        .arg(path)
        .output()
        .context("running kubectl")?;
    if !output.status.success() {
        bail!(
            "kubectl apply -f {}: {}",
            path.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("pod/"))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect())
}

async fn narrate_pod(
    env: &TestEnv,
    n: &Narrator,
    client: &kube::Client,
    name: &str,
) -> anyhow::Result<()> {
    let pods = Api::<Pod>::namespaced(client.clone(), NAMESPACE);
    let driver = env.driver_name().to_string();
    let created = pods.get(name).await?;
    let resource = controllers::well_known::scheduler_resource(&driver);
    let marked = created
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.resources.as_ref()?.requests.as_ref()?.get(&resource))
        .map(|q| q.0.clone());
    match marked {
        Some(v) => n.say(
            "webhook",
            format!("{NAMESPACE}/{name}: containers[0] requests {resource}={v}"),
        ),
        None => n.say("webhook", format!("{NAMESPACE}/{name}: not mutated")),
    }
    let node = until("the pod to be scheduled", WAIT, || async {
        pods.get(name)
            .await
            .map_err(|e| e.to_string())?
            .spec
            .and_then(|s| s.node_name)
            .ok_or_else(|| "not scheduled".to_string())
    })
    .await?;
    let pod_key = format!("{NAMESPACE}/{name}");
    let decision = until("the extender's decision in its log", WAIT, || async {
        json_log::extender_decision(&env.dir().join("logs/extender.log"), &pod_key)
            .map(|(node, details)| format!("chose {node} from {details}"))
            .ok_or_else(|| "no filter line yet".to_string())
    })
    .await?;
    n.say("extender", format!("{pod_key}: {decision}"));
    let spec = created.spec.clone().unwrap_or_default();
    for volume in spec.volumes.iter().flatten() {
        let claim = if let Some(c) = &volume.persistent_volume_claim {
            c.claim_name.clone()
        } else if volume.ephemeral.is_some() {
            format!("{name}-{}", volume.name)
        } else {
            continue;
        };
        let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), NAMESPACE);
        let pv_name = until("the claim to bind", WAIT, || async {
            claims
                .get(&claim)
                .await
                .map_err(|e| e.to_string())?
                .spec
                .and_then(|s| s.volume_name)
                .filter(|v| !v.is_empty())
                .ok_or_else(|| "unbound".to_string())
        })
        .await?;
        let pv = Api::<PersistentVolume>::all(client.clone())
            .get(&pv_name)
            .await?;
        let pinned = controllers::volume_facts::pv_node(&pv, &driver).unwrap_or_default();
        n.say(
            "pv",
            format!("{NAMESPACE}/{claim} -> {pv_name} pinned to {pinned}"),
        );
        let log = env.dir().join(format!("logs/{pinned}-pmem-csi.log"));
        let (size, elapsed) = until("CreateVolume in the driver's log", WAIT, || async {
            json_log::create_volume_of(&log, &pv_name).ok_or_else(|| "not logged yet".to_string())
        })
        .await?;
        n.say(
            "create",
            format!(
                "{pinned} CreateVolume {pv_name} ({size} bytes): {:.4} s",
                elapsed.as_secs_f64()
            ),
        );
    }
    let running = until("the pod to run", WAIT, || async {
        let pod = pods.get(name).await.map_err(|e| e.to_string())?;
        let phase = pod.status.as_ref().and_then(|s| s.phase.clone());
        (phase.as_deref() == Some("Running"))
            .then_some(pod)
            .ok_or_else(|| format!("{phase:?}"))
    })
    .await?;
    let uid = running.metadata.uid.clone().unwrap_or_default();
    if let Some(kubelet) = env.kubelet() {
        for m in kubelet.mounted(&uid) {
            let stage = m.staged_in.map_or_else(
                || "no NodeStageVolume (inline: created by NodePublishVolume)".to_string(),
                |d| format!("NodeStageVolume {:.4} s", d.as_secs_f64()),
            );
            n.say(
                "mount",
                format!(
                    "{} {pod_key} {}: {stage}, NodePublishVolume {:.4} s",
                    m.node,
                    m.volume.name,
                    m.published_in.as_secs_f64()
                ),
            );
        }
    }
    let since = running
        .metadata
        .creation_timestamp
        .map(|t| {
            let now = k8s_openapi::jiff::Timestamp::now();
            now.duration_since(t.0).as_secs_f64()
        })
        .unwrap_or_default();
    n.say(
        "running",
        format!("{pod_key} on {node}, {since:.1} s after creation"),
    );
    Ok(())
}

fn print_access(env: &TestEnv) {
    let kubectl = env.tools().go("kubectl");
    let mut metrics: Vec<String> = env
        .nodes()
        .iter()
        .filter_map(|node| {
            env.driver_admin_port(&node.name)
                .map(|p| format!("  {:<10} http://127.0.0.1:{p}/metrics", node.name))
        })
        .collect();
    if let Some((_, admin)) = env.controller_ports() {
        metrics.push(format!("  controller http://127.0.0.1:{admin}/metrics"));
    }
    if let Some((_, admin)) = env.extender_addresses() {
        metrics.push(format!("  extender   http://{admin}/metrics"));
    }
    println!(
        "\nThe cluster stays up; the demo's objects are in namespace {NAMESPACE}.\n\n  \
         export KUBECONFIG={}\n  \
         alias kubectl={}\n  \
         kubectl get pods,pvc -n {NAMESPACE} -o wide\n\n\
         metrics:\n{}\n\n  \
         apiserver:  {}\n  work dir:   {}\n  logs:       {}/logs\n  process group: {}\n\n\
         Press Ctrl-C to stop; everything is removed.",
        env.admin_kubeconfig().display(),
        kubectl.display(),
        metrics.join("\n"),
        env.server(),
        env.dir().display(),
        env.dir().display(),
        env.process_group_id(),
    );
}
