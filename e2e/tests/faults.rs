//! The fault-injection suite (testenv only): each scenario drives a burst of claims and pods,
//! injects one fault in the middle of it, and checks that the system converges — every pod
//! Running, one volume per claim on its PV's node and no other, no node over-committed, the
//! published capacity true, no reservation left — then runs the scenario's leak check.
//!
//! Faults: kube-apiserver restarted; etcd restarted (its data kept); the extender SIGKILLed
//! during the burst; a node driver SIGKILLed while NodeStage is in flight; the leading
//! controller SIGKILLed while claims wait to be rescheduled off a driverless node; the apiserver
//! answering 429, 500 and 503 to every request of ours for a while (testenv's fault proxy sits
//! between all our ServiceAccounts and the apiserver in this suite).
//!
//! Each scenario prints one `fault-figures` line: the time from the fault to convergence and
//! what was retried on the way (filter calls answered 503, FailedScheduling and
//! ProvisioningFailed events, process restarts); `just faults` runs the suite three times and
//! renders those figures into BENCHMARKS.md.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use controllers::test_objects;
use e2e::{CLASS_NO_ERASE, Cluster, MI, Scenario, node_of, pinned_node, volume_handle};
use futures::future::join_all;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::PostParams;
use rustix::process::Signal;
use testenv::metrics;
use testenv::wait::until;
use testenv::{TestEnv, TestEnvBuilder};

/// Pods per burst: more than any node holds, fewer than the cluster does.
const PODS: i64 = 12;
/// Where NodeStage pauses, so that a SIGKILL lands inside it.
const STAGE_PAUSE: &str = "after-mkfs:800";

fn builder() -> TestEnvBuilder {
    e2e::testenv_builder()
        .drivers(testenv::node_processes::DriverOptions {
            extra_args: vec!["--log-format=json".into()],
            env: vec![(driver::faults::DELAY_ENV.into(), STAGE_PAUSE.into())],
            ..Default::default()
        })
        .http_fault_proxy()
        // Restarting the apiserver and etcd makes it deny granted requests until its
        // authorizer has synced: not a least-privilege finding.
        .private_audit_log()
}

async fn cluster() -> Option<(Cluster, &'static TestEnv)> {
    if std::env::var_os("KUBECONFIG").is_some() {
        eprintln!("skipped: the fault suite injects faults into testenv's processes");
        return None;
    }
    let c = Cluster::connect(builder).await.expect("cluster");
    let env = c.env.expect("testenv");
    Some((c, env))
}

/// Counts that tell what was retried.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Retries {
    /// Requests the fault proxy answered with 429 or 5xx.
    injected: usize,
    filter_503: u64,
    failed_scheduling: usize,
    provisioning_failed: usize,
    restarts: u32,
}

async fn extender_metric(env: &TestEnv, prefix: &str) -> u64 {
    match env.extender_addresses() {
        Some((_, admin)) => {
            metrics::metric_value(&metrics::scrape_metrics(admin.port()).await, prefix)
        }
        None => 0,
    }
}

/// Restarts of every supervised process: node drivers and provisioners, extender, controller.
fn restarts(env: &TestEnv) -> u32 {
    let nodes: u32 = env
        .nodes()
        .iter()
        .filter_map(|n| env.node_restarts(&n.name))
        .map(|(driver, provisioner)| driver + provisioner)
        .sum();
    nodes + env.extender_restarts().unwrap_or(0) + env.controller_restarts().unwrap_or(0)
}

async fn retries(env: &TestEnv, s: &Scenario) -> Retries {
    Retries {
        injected: env.fault_proxy().map_or(0, |p| p.injected()),
        filter_503: extender_metric(
            env,
            "pmem_csi_extender_requests_total{route=\"filter\",code=\"503\"}",
        )
        .await,
        failed_scheduling: s.events("FailedScheduling").await.map_or(0, |e| e.len()),
        provisioning_failed: s.events("ProvisioningFailed").await.map_or(0, |e| e.len()),
        restarts: restarts(env),
    }
}

/// Creates the burst's claims and pods at once; returns the volume size in bytes.
async fn burst(s: &Scenario) -> i64 {
    let budgets: Vec<i64> = s.full.values().copied().collect();
    let size = e2e::burst_size(&budgets, PODS).expect("a burst size for the budgets");
    let creates = (0..PODS).map(|i| async move {
        s.claim_and_pod(
            &format!("burst-{i}"),
            CLASS_NO_ERASE,
            &format!("{}Mi", size / MI),
        )
        .await
    });
    for created in join_all(creates).await {
        created.expect("create");
    }
    size
}

/// Waits until the burst has converged and checks what convergence means; returns the time
/// it took from `fault`.
async fn converged(
    env: &TestEnv,
    s: &Scenario,
    pods: &[String],
    size: i64,
    fault: Instant,
) -> Duration {
    let mut used: BTreeMap<String, i64> = BTreeMap::new();
    let mut handles: BTreeMap<String, String> = BTreeMap::new();
    for name in pods {
        let (pod, pv) = s
            .running_with_volume(name, name)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        *used.entry(node_of(&pod)).or_default() += size;
        let node = pinned_node(&pv).expect("pinned");
        let previous = handles.insert(volume_handle(&pv), node);
        assert!(previous.is_none(), "two PVs share the volume of {name}");
    }
    let took = fault.elapsed();
    for (node, bytes) in &used {
        assert!(
            s.full.get(node).is_some_and(|budget| bytes <= budget),
            "{node} holds {bytes} bytes of {:?}",
            s.full.get(node)
        );
    }
    // Every volume on a node is a PV of this burst, on the node the PV names: none lost, none
    // duplicated on a second node.
    let mut on_nodes: BTreeSet<(String, String)> = BTreeSet::new();
    for node in s.full.keys() {
        for id in e2e::node_volumes(env, node).await.expect("volumes") {
            on_nodes.insert((id, node.clone()));
        }
    }
    let expected: BTreeSet<(String, String)> = handles.into_iter().collect();
    assert_eq!(on_nodes, expected, "volumes on the nodes vs. the PVs");
    let want: BTreeMap<String, i64> = s
        .full
        .iter()
        .map(|(node, full)| (node.clone(), full - used.get(node).copied().unwrap_or(0)))
        .collect();
    until("the published capacity to be true", e2e::WAIT, || async {
        let now = s.cluster.capacity().await.map_err(|e| e.to_string())?;
        (now == want)
            .then_some(())
            .ok_or(format!("published {now:?}, true {want:?}"))
    })
    .await
    .expect("capacity");
    until("no reservation left", e2e::WAIT, || async {
        let reserved = extender_metric(env, "pmem_csi_reserved_bytes").await;
        (reserved == 0)
            .then_some(())
            .ok_or(format!("{reserved} bytes reserved"))
    })
    .await
    .expect("reservations");
    took
}

/// Where `just faults` collects the figures of its runs (one JSON object per line), which
/// `pmem-csi-bench import-faults` turns into a result file for BENCHMARKS.md.
const FIGURES_ENV: &str = "PMEM_CSI_FAULT_FIGURES";

fn report(fault: &str, pods: usize, took: Duration, before: &Retries, after: &Retries) {
    let figures = serde_json::json!({
        "fault": fault,
        "pods": pods,
        "converged_s": took.as_secs_f64(),
        "injected_429_5xx": after.injected.saturating_sub(before.injected),
        // The extender's counter restarts with it: after its SIGKILL this counts the new
        // process's 503s only.
        "filter_503": after.filter_503.saturating_sub(before.filter_503),
        "failed_scheduling": after.failed_scheduling.saturating_sub(before.failed_scheduling),
        "provisioning_failed": after.provisioning_failed.saturating_sub(before.provisioning_failed),
        "restarts": after.restarts.saturating_sub(before.restarts),
    });
    eprintln!("fault-figures {figures}");
    if let Some(path) = std::env::var_os(FIGURES_ENV) {
        use std::io::Write;
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{figures}"));
        if let Err(e) = written {
            panic!(
                "writing the figures to {}: {e}",
                std::path::Path::new(&path).display()
            );
        }
    }
}

/// A burst with `inject` run once the burst is created; checks convergence and reports.
async fn burst_with_fault<F, Fut>(fault: &str, inject: F)
where
    F: FnOnce(&'static TestEnv) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let Some((c, env)) = cluster().await else {
        return;
    };
    let s = c.scenario("fault").await.expect("scenario");
    let before = retries(env, &s).await;
    let size = burst(&s).await;
    let started = Instant::now();
    inject(env).await;
    let pods: Vec<String> = (0..PODS).map(|i| format!("burst-{i}")).collect();
    let took = converged(env, &s, &pods, size, started).await;
    let after = retries(env, &s).await;
    report(fault, pods.len(), took, &before, &after);
    s.finish().await.expect("leak check");
}

async fn wait_some_selected(env: &TestEnv, namespace: &str) {
    let client = env.client().await.expect("client");
    let claims = kube::Api::<PersistentVolumeClaim>::namespaced(client, namespace);
    until(
        "a claim of the burst to get its node",
        e2e::WAIT,
        || async {
            let list = claims
                .list(&Default::default())
                .await
                .map_err(|e| e.to_string())?;
            list.items
                .iter()
                .any(|c| {
                    c.metadata
                        .annotations
                        .as_ref()
                        .is_some_and(|a| a.contains_key("volume.kubernetes.io/selected-node"))
                })
                .then_some(())
                .ok_or("none yet".to_string())
        },
    )
    .await
    .expect("selected");
}

#[tokio::test]
async fn f1_apiserver_restarted_during_a_burst() {
    burst_with_fault("kube-apiserver restarted", |env| async move {
        env.restart_control_plane("kube-apiserver")
            .await
            .expect("restart");
    })
    .await;
}

#[tokio::test]
async fn f2_etcd_restarted_during_a_burst() {
    burst_with_fault("etcd restarted", |env| async move {
        env.restart_control_plane("etcd").await.expect("restart");
    })
    .await;
}

#[tokio::test]
async fn f3_extender_killed_during_a_burst() {
    let Some((c, env)) = cluster().await else {
        return;
    };
    let s = c.scenario("fault").await.expect("scenario");
    let before = retries(env, &s).await;
    let size = burst(&s).await;
    // In the middle of it: some claims selected (reservations handed over), others not.
    wait_some_selected(env, &s.namespace).await;
    let started = Instant::now();
    env.signal_extender(Signal::KILL).expect("SIGKILL");
    let pods: Vec<String> = (0..PODS).map(|i| format!("burst-{i}")).collect();
    let took = converged(env, &s, &pods, size, started).await;
    let after = retries(env, &s).await;
    assert!(
        env.extender_restarts().unwrap_or(0) >= 1,
        "the extender was restarted"
    );
    report("extender SIGKILLed", pods.len(), took, &before, &after);
    s.finish().await.expect("leak check");
}

#[tokio::test]
async fn f4_node_driver_killed_during_node_stage() {
    burst_with_fault("node driver SIGKILLed during NodeStage", |env| async move {
        // The drivers pause inside NodeStage (after mkfs): kill node-3's (the largest, so it
        // stages some of the burst) as soon as its log shows it inside.
        let log = env.dir().join("logs/node-3-pmem-csi.log");
        let pauses = || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .matches("\"test delay\"")
                .count()
        };
        // The log holds earlier scenarios' stages too: wait for one that starts now.
        let earlier = pauses();
        until("node-3 to be inside NodeStage", e2e::WAIT, || async {
            (pauses() > earlier)
                .then_some(())
                .ok_or(format!("not yet ({})", log.display()))
        })
        .await
        .expect("inside NodeStage");
        env.signal_node_driver("node-3", Signal::KILL)
            .expect("SIGKILL");
    })
    .await;
}

#[tokio::test]
async fn f5_leading_controller_killed_while_claims_wait_for_rescheduling() {
    let Some((c, env)) = cluster().await else {
        return;
    };
    let s = c.scenario("fault").await.expect("scenario");
    let before = retries(env, &s).await;
    // Claims selected for the driverless node, as a scheduler working from stale caches would
    // leave them: only the controller's rescheduler frees them.
    let stranded = 4;
    let budgets: Vec<i64> = s.full.values().copied().collect();
    let size = e2e::burst_size(&budgets, PODS).expect("size");
    let claims = kube::Api::<PersistentVolumeClaim>::namespaced(c.client.clone(), &s.namespace);
    for i in 0..stranded {
        let name = format!("burst-{i}");
        claims
            .create(
                &PostParams::default(),
                &test_objects::selected_for(
                    test_objects::claim(
                        &s.namespace,
                        &name,
                        CLASS_NO_ERASE,
                        &format!("{}Mi", size / MI),
                    ),
                    e2e::DRIVERLESS,
                ),
            )
            .await
            .expect("stranded claim");
        s.pod_using(&name, &name).await.expect("pod");
    }
    let started = Instant::now();
    env.signal_controller(Signal::KILL).expect("SIGKILL");
    let pods: Vec<String> = (0..stranded).map(|i| format!("burst-{i}")).collect();
    let took = converged(env, &s, &pods, size, started).await;
    let after = retries(env, &s).await;
    assert!(
        after.restarts > before.restarts,
        "the controller restarted: {after:?}"
    );
    report(
        "leading controller SIGKILLed while claims wait for rescheduling",
        pods.len(),
        took,
        &before,
        &after,
    );
    s.finish().await.expect("leak check");
}

#[tokio::test]
async fn f6_apiserver_answers_429_and_5xx_for_a_while() {
    burst_with_fault(
        "apiserver answering 429 and 5xx for 6 s",
        |env| async move {
            let proxy = env.fault_proxy().expect("fault proxy");
            let before = proxy.injected();
            proxy.fail_for(Duration::from_secs(6));
            until("requests of ours to be refused", e2e::WAIT, || async {
                (proxy.injected() > before)
                    .then_some(())
                    .ok_or("none refused yet".to_string())
            })
            .await
            .expect("refused");
        },
    )
    .await;
}
