//! A network partition: a node's processes lose the apiserver while their CreateVolume is in
//! flight. The controller (heartbeat mode) judges the node driverless and reschedules the
//! claim, another node provisions it; after the partition heals, the first node's volume is
//! removed again and exactly one PV is left for the claim.

use std::time::Duration;

use controllers::test_objects;
use driver::csi::controller_client::ControllerClient;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use kube::Api;
use kube::api::{ListParams, PostParams};
use testenv::api_calls;
use testenv::node_processes::DriverOptions;
use testenv::wait::until;
use testenv::{Supervised, TestEnv, TestEnvBuilder};

const DRIVER: &str = "pmem-csi.intel.com";
const WAIT: Duration = Duration::from_secs(120);

struct Fixture {
    env: &'static TestEnv,
    _controller: Supervised,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: std::sync::OnceLock<Fixture> = std::sync::OnceLock::new();
    FIXTURE.get_or_init(|| {
        fn configure() -> TestEnvBuilder {
            TestEnv::builder().nodes(2).drivers(DriverOptions {
                device_mode: "fake".into(),
                size: "1Gi".into(),
                extra_args: vec!["--orphan-grace=3s".into()],
                // Every CreateVolume stays in flight for 3 s after its state is written.
                env: vec![(
                    driver::faults::DELAY_ENV.into(),
                    "after-state-write:3000".into(),
                )],
                partitionable: true,
                ..Default::default()
            })
        }
        let env = TestEnv::shared(configure);
        let controller = env
            .supervise_controller(
                "controller",
                &["--reschedule-grace=2s", "--heartbeat-grace=1s"],
            )
            .expect("controller");
        Fixture {
            env,
            _controller: controller,
        }
    })
}

async fn volumes_on(env: &TestEnv, node: &str) -> Vec<String> {
    let Some(socket) = env.driver_socket(node) else {
        return Vec::new();
    };
    let Ok(channel) = driver::client::connect(&socket).await else {
        return Vec::new();
    };
    driver::client::volume_ids(&mut ControllerClient::new(channel))
        .await
        .unwrap_or_default()
}

fn state_files(env: &TestEnv, node: &str) -> usize {
    std::fs::read_dir(env.dir().join("nodes").join(node).join("state"))
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
                .count()
        })
        .unwrap_or(0)
}

#[tokio::test]
async fn partitioned_node_loses_the_claim_and_its_volume() {
    let f = fixture();
    let env = f.env;
    let client = env.client().await.expect("client");
    let pp = PostParams::default();
    let ns = testenv::test_namespace(&client, "partition")
        .await
        .expect("ns");
    let class = format!("{ns}-pmem");
    api_calls::create_storage_class(&client, &class, DRIVER, "WaitForFirstConsumer")
        .await
        .expect("class");
    let capacities = Api::<k8s_openapi::api::storage::v1::CSIStorageCapacity>::namespaced(
        client.clone(),
        "pmem-csi",
    );
    until("capacity of both nodes", WAIT, || async {
        let n = capacities
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items
            .iter()
            .filter(|c| c.storage_class_name == class)
            .count();
        if n == 2 { Ok(()) } else { Err(format!("{n}")) }
    })
    .await
    .expect("capacity");

    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns);
    claims
        .create(&pp, &test_objects::claim(&ns, "data", &class, "64Mi"))
        .await
        .expect("claim");
    Api::<Pod>::namespaced(client.clone(), &ns)
        .create(&pp, &test_objects::pod_with_claim(&ns, "app", "data"))
        .await
        .expect("pod");

    // The first node's CreateVolume has written its state and is held in flight: cut it off.
    let first = until("a CreateVolume in flight", WAIT, || async {
        ["node-1", "node-2"]
            .into_iter()
            .find(|n| state_files(env, n) > 0)
            .map(str::to_string)
            .ok_or_else(|| "none yet".to_string())
    })
    .await
    .expect("in flight");
    let proxy = env.proxy(&first).expect("proxy");
    proxy.cut();
    let other = if first == "node-1" {
        "node-2"
    } else {
        "node-1"
    };

    let pv_name = until("the claim to be bound", WAIT, || async {
        claims
            .get("data")
            .await
            .map_err(|e| e.to_string())?
            .spec
            .and_then(|s| s.volume_name)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| "pending".to_string())
    })
    .await
    .expect("bound");
    let pv = Api::<PersistentVolume>::all(client.clone())
        .get(&pv_name)
        .await
        .expect("pv");
    let handle = pv
        .spec
        .and_then(|s| s.csi)
        .map(|c| c.volume_handle)
        .expect("csi pv");
    assert_eq!(
        volumes_on(env, other).await,
        vec![handle.clone()],
        "{other} provisioned the claim"
    );

    proxy.restore();
    until(
        &format!("the volume on {first} to be removed"),
        WAIT,
        || async {
            match volumes_on(env, &first).await {
                v if v.is_empty() => Ok(()),
                v => Err(format!("still {v:?}")),
            }
        },
    )
    .await
    .expect("no leak on the partitioned node");
    let pvs = until("exactly one PV for the claim", WAIT, || async {
        let pvs: Vec<String> = Api::<PersistentVolume>::all(client.clone())
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items
            .into_iter()
            .filter(|pv| {
                pv.spec
                    .as_ref()
                    .and_then(|s| s.claim_ref.as_ref())
                    .is_some_and(|c| {
                        c.namespace.as_deref() == Some(ns.as_str())
                            && c.name.as_deref() == Some("data")
                    })
            })
            .filter_map(|pv| pv.metadata.name)
            .collect();
        if pvs.len() == 1 {
            Ok(pvs)
        } else {
            Err(format!("{pvs:?}"))
        }
    })
    .await
    .expect("no duplicate PV");
    assert_eq!(pvs, vec![pv_name]);
}
