//! Distributed provisioning on testenv with the real pieces: per node a supervised
//! `pmem-csi node` (emulated) and a real csi-provisioner in node-deployment mode; the real
//! scheduler picks a node from the published capacity, the node's provisioner creates the
//! volume through our driver, kube-controller-manager binds, and deletion cleans up.

use std::time::Duration;

use controllers::test_objects;
use driver::csi::controller_client::ControllerClient;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::CSIStorageCapacity;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use testenv::api_calls;
use testenv::node_processes::DriverOptions;
use testenv::wait::until;
use testenv::{TestEnv, TestEnvBuilder};

const DRIVER: &str = "pmem-csi.intel.com";
const WAIT: Duration = Duration::from_secs(90);

fn env() -> &'static TestEnv {
    fn configure() -> TestEnvBuilder {
        TestEnv::builder()
            .nodes(2)
            .drivers(DriverOptions::default())
    }
    TestEnv::shared(configure)
}

async fn volumes_on(env: &TestEnv, node: &str) -> Vec<String> {
    let socket = env.driver_socket(node).expect("driver socket");
    let mut csi = ControllerClient::new(driver::client::connect(&socket).await.expect("connect"));
    driver::client::volume_ids(&mut csi).await.expect("list")
}

#[tokio::test]
async fn late_binding_claim_is_provisioned_on_the_scheduled_node_and_cleaned_up() {
    let env = env();
    let client = env.client().await.expect("client");
    let pp = PostParams::default();
    let ns = testenv::test_namespace(&client, "provisioning")
        .await
        .expect("ns");
    let class = format!("{ns}-pmem");
    api_calls::create_storage_class(&client, &class, DRIVER, "WaitForFirstConsumer")
        .await
        .expect("class");
    let capacities = Api::<CSIStorageCapacity>::namespaced(client.clone(), "pmem-csi");
    until("capacity published by both nodes", WAIT, || async {
        let list = capacities
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let n = list
            .items
            .iter()
            .filter(|c| c.storage_class_name == class)
            .count();
        if n == 2 {
            Ok(())
        } else {
            Err(format!("{n} objects"))
        }
    })
    .await
    .expect("capacity");

    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns);
    claims
        .create(&pp, &test_objects::claim(&ns, "data", &class, "64Mi"))
        .await
        .expect("claim");
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    pods.create(&pp, &test_objects::pod_with_claim(&ns, "app", "data"))
        .await
        .expect("pod");

    let node = until("the pod to be bound to a node", WAIT, || async {
        pods.get("app")
            .await
            .map_err(|e| e.to_string())?
            .spec
            .and_then(|s| s.node_name)
            .ok_or_else(|| "not scheduled yet".to_string())
    })
    .await
    .expect("scheduled");
    let pv_name = claims
        .get("data")
        .await
        .expect("claim")
        .spec
        .and_then(|s| s.volume_name)
        .expect("the claim is bound before the pod is");
    let pv = Api::<PersistentVolume>::all(client.clone())
        .get(&pv_name)
        .await
        .expect("pv");
    let spec = pv.spec.expect("pv spec");
    let csi = spec.csi.expect("csi source");
    assert_eq!(csi.driver, DRIVER);
    let terms = spec
        .node_affinity
        .and_then(|a| a.required)
        .map(|r| r.node_selector_terms)
        .unwrap_or_default();
    let affinity: Vec<(String, Vec<String>)> = terms
        .iter()
        .flat_map(|t| t.match_expressions.clone().unwrap_or_default())
        .map(|e| (e.key, e.values.unwrap_or_default()))
        .collect();
    assert_eq!(
        affinity,
        vec![(format!("{DRIVER}/node"), vec![node.clone()])],
        "PV pinned to the pod's node"
    );
    assert_eq!(
        volumes_on(env, &node).await,
        vec![csi.volume_handle.clone()],
        "the volume lives on {node}"
    );
    let other = if node == "node-1" { "node-2" } else { "node-1" };
    assert!(
        volumes_on(env, other).await.is_empty(),
        "nothing on {other}"
    );

    pods.delete(
        "app",
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        },
    )
    .await
    .expect("delete pod");
    claims
        .delete("data", &DeleteParams::default())
        .await
        .expect("delete claim");
    until("the volume to be deleted on its node", WAIT, || async {
        let left = volumes_on(env, &node).await;
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("still {left:?}"))
        }
    })
    .await
    .expect("deleted");
}

#[tokio::test]
async fn claim_selected_for_a_node_without_room_goes_back_to_the_scheduler() {
    let env = env();
    let client = env.client().await.expect("client");
    let ns = testenv::test_namespace(&client, "noroom")
        .await
        .expect("ns");
    let class = format!("{ns}-pmem");
    api_calls::create_storage_class(&client, &class, DRIVER, "WaitForFirstConsumer")
        .await
        .expect("class");
    // Every node has 1Gi: the node's provisioner gets ResourceExhausted from CreateVolume and
    // hands the claim back by removing selected-node (an update under the node's account).
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns);
    claims
        .create(
            &PostParams::default(),
            &test_objects::selected_for(test_objects::claim(&ns, "big", &class, "4Gi"), "node-1"),
        )
        .await
        .expect("claim");
    until("selected-node to be removed", WAIT, || async {
        match api_calls::selected_node(&claims, "big").await {
            None => Ok(()),
            Some(node) => Err(format!("still selected for {node}")),
        }
    })
    .await
    .expect("handed back");
    let claim = claims.get("big").await.expect("claim");
    assert!(
        claim.spec.and_then(|s| s.volume_name).is_none(),
        "nothing was provisioned"
    );
}
