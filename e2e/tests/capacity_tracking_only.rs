//! Scenario 12: `manifests/base` without the scheduler-extender component (the controller
//! without its webhook, no extender) and kube-scheduler without our extender — a late-binding
//! claim and its pod reach Running through capacity tracking alone. testenv only: an external
//! cluster's scheduler cannot be reconfigured from here.

use e2e::{CLASS, Cluster};
use testenv::{TestEnv, TestEnvBuilder};

fn base_only() -> TestEnvBuilder {
    TestEnv::builder()
        .nodes(2)
        .drivers(testenv::node_processes::DriverOptions::default())
        .controller_without_webhook(Vec::<String>::new())
        .kubelet()
}

#[tokio::test]
async fn s12_capacity_tracking_alone() {
    if std::env::var_os("KUBECONFIG").is_some() {
        eprintln!("skipped: needs a scheduler without the extender (testenv)");
        return;
    }
    let c = Cluster::connect(base_only).await.expect("cluster");
    let env = c.env.expect("testenv");
    assert!(
        env.extender_addresses().is_none(),
        "no extender in this configuration"
    );
    let (_, admin) = env.controller_ports().expect("controller");
    let s = c.scenario("base-only").await.expect("scenario");
    s.claim("data", CLASS, "64Mi", false).await.expect("claim");
    let created = s.pod_using("app", "data").await.expect("pod");
    let resources = created
        .spec
        .as_ref()
        .and_then(|s| s.containers[0].resources.clone());
    assert!(
        resources
            .and_then(|r| r.requests)
            .is_none_or(|r| r.is_empty()),
        "no webhook mutated the pod"
    );
    s.running_with_volume("app", "data")
        .await
        .expect("running, the PV pinned to the pod's node");
    testenv::wait::until(
        "the base controller to serve metrics",
        e2e::WAIT,
        || async {
            let text = testenv::metrics::scrape_metrics(admin).await;
            text.contains("# EOF")
                .then_some(())
                .ok_or_else(|| "no metrics yet".to_string())
        },
    )
    .await
    .expect("the controller runs");
    s.finish().await.expect("leak check");
}
