//! The node-loss recovery's dry run (testenv only: a controller of its own with
//! `--node-loss-dry-run`): an opted-in claim whose node is deleted gets an Event saying what
//! would be deleted, the counter says so, and nothing changes — claim, pod and volume stay,
//! external-provisioner's finalizer too — however often the recovery looks again.

use std::time::Duration;

use controllers::test_objects;
use controllers::well_known::{PROVISIONER_FINALIZER, RECREATE_ON_NODE_LOSS};
use e2e::{CLASS_NO_ERASE, WAIT};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use testenv::wait::until;
use testenv::{TestEnv, TestEnvBuilder, api_calls, metrics};

fn builder() -> TestEnvBuilder {
    TestEnv::builder().nodes(1).controller([
        "--reschedule-grace=1s",
        "--node-loss-grace=2s",
        "--node-loss-dry-run",
    ])
}

const ACTIONS: &str = "pmem_csi_node_loss_actions_total";

async fn action_count(port: u16, action: &str) -> u64 {
    let text = metrics::scrape_metrics(port).await;
    assert!(
        text.contains(ACTIONS),
        "the controller counts node-loss actions"
    );
    metrics::metric_value(&text, &format!("{ACTIONS}{{action=\"{action}\"}}"))
}

async fn reconciles(port: u16) -> u64 {
    let text = metrics::scrape_metrics(port).await;
    metrics::metric_value(
        &text,
        "controller_runtime_reconcile_total{controller=\"node-loss-recovery\"",
    )
}

#[tokio::test]
async fn dry_run_reports_and_changes_nothing() {
    if std::env::var_os("KUBECONFIG").is_some() {
        eprintln!("skipped: needs a controller of its own in dry-run mode (testenv)");
        return;
    }
    let env = TestEnv::shared(builder);
    let client = env.client().await.expect("client");
    let (_, admin) = env.controller_ports().expect("controller");
    let ns = testenv::test_namespace(&client, "dry-run")
        .await
        .expect("namespace");
    let lost = format!("{ns}-lost");
    e2e::driver_node(&client, &lost, Some(Duration::ZERO))
        .await
        .expect("node");
    let mut claim = test_objects::claim(&ns, "data", CLASS_NO_ERASE, "64Mi");
    claim
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(RECREATE_ON_NODE_LOSS.into(), "true".into());
    let pv = e2e::volume_on(&client, &lost, claim).await.expect("volume");
    let mut pod = test_objects::pod_with_claim(&ns, "app", "data");
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_name = Some(lost.clone());
    }
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("pod");
    e2e::delete_node(&client, &lost)
        .await
        .expect("node deleted");

    let reported = until("the dry run's event", WAIT, || async {
        let events = api_calls::events(&client, &ns, "reason=NodeLossRecoveryDryRun")
            .await
            .map_err(|e| e.to_string())?;
        events
            .into_iter()
            .find_map(|e| e.message)
            .ok_or("none yet".to_string())
    })
    .await
    .expect("reported");
    for part in [
        "would delete",
        "claim",
        "data",
        "app",
        &pv,
        &lost,
        "nothing changed",
    ] {
        assert!(reported.contains(part), "{part:?} in {reported}");
    }
    assert_eq!(
        action_count(admin, "dry-run").await,
        1,
        "one report per volume"
    );
    // Several more looks at the volume, each judging it lost past the grace.
    let seen = reconciles(admin).await;
    until("three more reconciles of the volume", WAIT, || async {
        let now = reconciles(admin).await;
        (now >= seen + 3).then_some(()).ok_or(format!("{now}"))
    })
    .await
    .expect("reconciled again");
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns);
    let kept = claims.get("data").await.expect("claim kept");
    assert!(
        kept.metadata.deletion_timestamp.is_none(),
        "claim not deleted"
    );
    let kept_pod = pods.get("app").await.expect("pod kept");
    assert!(
        kept_pod.metadata.deletion_timestamp.is_none(),
        "pod not deleted"
    );
    let pvs = Api::<PersistentVolume>::all(client.clone());
    let volume = pvs.get(&pv).await.expect("PV kept");
    assert!(
        volume.metadata.deletion_timestamp.is_none(),
        "PV not deleted"
    );
    assert!(
        volume
            .metadata
            .finalizers
            .iter()
            .flatten()
            .any(|f| f == PROVISIONER_FINALIZER),
        "finalizer kept"
    );
    for action in [
        "claim-deleted",
        "pod-deleted",
        "volume-deleted",
        "finalizer-removed",
    ] {
        assert_eq!(action_count(admin, action).await, 0, "{action}");
    }

    // Clean up by hand what a dry run leaves.
    pods.delete("app", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete pod");
    claims
        .delete("data", &DeleteParams::default())
        .await
        .expect("delete claim");
    e2e::drop_finalizers_until_gone(&client, &pv)
        .await
        .expect("PV gone");
    e2e::delete_lease(&client, &lost).await;
    let _ = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .delete(&ns, &DeleteParams::default())
        .await;
}
