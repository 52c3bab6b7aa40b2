//! The real control plane does what the driver relies on: the scheduler honours storage
//! capacity, kube-controller-manager works under its own credentials, and supervised processes
//! restart like kubelet containers.

use std::collections::BTreeMap;
use std::time::Duration;

use controllers::test_objects;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{CSIDriver, CSIDriverSpec, CSIStorageCapacity, StorageClass};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, OwnerReference};
use kube::Api;
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use rustix::process::Signal;
use testenv::wait::until;
use testenv::{ProcessSpec, TestEnv, TestEnvBuilder};

const WAIT: Duration = Duration::from_secs(60);

fn env() -> &'static TestEnv {
    fn configure() -> TestEnvBuilder {
        TestEnv::builder().nodes(3)
    }
    TestEnv::shared(configure)
}

fn meta(name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        ..Default::default()
    }
}

fn meta_in(name: &str, ns: &str) -> ObjectMeta {
    ObjectMeta {
        namespace: Some(ns.to_string()),
        ..meta(name)
    }
}

/// A late-binding class of `provisioner` whose CSIDriver opts into capacity tracking.
async fn capacity_tracked_class(client: &kube::Client, name: &str) {
    let pp = PostParams::default();
    Api::<CSIDriver>::all(client.clone())
        .create(
            &pp,
            &CSIDriver {
                metadata: meta(name),
                spec: CSIDriverSpec {
                    storage_capacity: Some(true),
                    attach_required: Some(false),
                    ..Default::default()
                },
            },
        )
        .await
        .expect("create CSIDriver");
    Api::<StorageClass>::all(client.clone())
        .create(
            &pp,
            &test_objects::storage_class(name, name, "WaitForFirstConsumer"),
        )
        .await
        .expect("create StorageClass");
}

async fn claim_and_pod(client: &kube::Client, ns: &str, class: &str, size: &str) {
    let pp = PostParams::default();
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
        .create(&pp, &test_objects::claim(ns, "data", class, size))
        .await
        .expect("create PVC");
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&pp, &test_objects::pod_with_claim(ns, "app", "data"))
        .await
        .expect("create Pod");
}

async fn selected_node(client: &kube::Client, ns: &str) -> Option<String> {
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns)
        .get("data")
        .await
        .ok()?
        .metadata
        .annotations?
        .get("volume.kubernetes.io/selected-node")
        .cloned()
}

#[tokio::test]
async fn scheduler_selects_the_only_node_with_capacity() {
    let client = env().client().await.expect("client");
    let ns = testenv::test_namespace(&client, "capacity")
        .await
        .expect("ns");
    let class = format!("{ns}.capacity.test");
    capacity_tracked_class(&client, &class).await;
    // Enough on node-2 only; node-1 has some, but less than the claim.
    for (node, capacity) in [("node-1", "500Mi"), ("node-2", "10Gi")] {
        Api::<CSIStorageCapacity>::namespaced(client.clone(), &ns)
            .create(
                &PostParams::default(),
                &CSIStorageCapacity {
                    metadata: meta_in(node, &ns),
                    storage_class_name: class.clone(),
                    node_topology: Some(LabelSelector {
                        match_labels: Some(BTreeMap::from([(
                            "kubernetes.io/hostname".to_string(),
                            node.to_string(),
                        )])),
                        ..Default::default()
                    }),
                    capacity: Some(Quantity(capacity.into())),
                    maximum_volume_size: Some(Quantity(capacity.into())),
                },
            )
            .await
            .expect("create CSIStorageCapacity");
    }
    claim_and_pod(&client, &ns, &class, "1Gi").await;
    let node = until("selected-node on the PVC", WAIT, || async {
        selected_node(&client, &ns)
            .await
            .ok_or_else(|| "no selected-node annotation yet".to_string())
    })
    .await
    .expect("scheduler selects a node");
    assert_eq!(node, "node-2");
}

#[tokio::test]
async fn scheduler_explains_when_no_node_has_capacity() {
    let client = env().client().await.expect("client");
    let ns = testenv::test_namespace(&client, "nocapacity")
        .await
        .expect("ns");
    let class = format!("{ns}.capacity.test");
    capacity_tracked_class(&client, &class).await;
    claim_and_pod(&client, &ns, &class, "1Gi").await;
    let message = until("a FailedScheduling event", WAIT, || async {
        testenv::api_calls::events(&client, &ns, "reason=FailedScheduling")
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .next()
            .and_then(|e| e.message)
            .ok_or_else(|| "no FailedScheduling event yet".to_string())
    })
    .await
    .expect("FailedScheduling event");
    assert!(
        message.contains("did not have enough free storage"),
        "unexpected reason: {message}"
    );
    assert_eq!(
        selected_node(&client, &ns).await,
        None,
        "no node may be selected without capacity"
    );
}

#[tokio::test]
async fn controller_manager_removes_protection_finalizer_of_unused_claim() {
    let client = env().client().await.expect("client");
    let ns = testenv::test_namespace(&client, "protection")
        .await
        .expect("ns");
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns);
    let claim = claims
        .create(
            &PostParams::default(),
            &test_objects::claim(&ns, "unused", "no-such-class", "1Gi"),
        )
        .await
        .expect("create PVC");
    // StorageObjectInUseProtection admission adds the finalizer; only KCM's
    // pvc-protection controller, acting as its own ServiceAccount, can take it off.
    assert_eq!(
        claim.metadata.finalizers,
        Some(vec!["kubernetes.io/pvc-protection".to_string()])
    );
    claims
        .delete("unused", &DeleteParams::default())
        .await
        .expect("delete PVC");
    until("the PVC to disappear", WAIT, || async {
        match claims.get_opt("unused").await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(c) => Err(format!(
                "still there, finalizers {:?}",
                c.metadata.finalizers
            )),
        }
    })
    .await
    .expect("protection finalizer removed");
}

#[tokio::test]
async fn garbage_collector_deletes_dependents() {
    let client = env().client().await.expect("client");
    let ns = testenv::test_namespace(&client, "gc").await.expect("ns");
    let maps = Api::<ConfigMap>::namespaced(client.clone(), &ns);
    let owner = maps
        .create(
            &PostParams::default(),
            &ConfigMap {
                metadata: meta_in("owner", &ns),
                ..Default::default()
            },
        )
        .await
        .expect("owner");
    maps.create(
        &PostParams::default(),
        &ConfigMap {
            metadata: ObjectMeta {
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "ConfigMap".into(),
                    name: "owner".into(),
                    uid: owner.metadata.uid.clone().unwrap_or_default(),
                    ..Default::default()
                }]),
                ..meta_in("dependent", &ns)
            },
            ..Default::default()
        },
    )
    .await
    .expect("dependent");
    maps.delete("owner", &DeleteParams::background())
        .await
        .expect("delete owner");
    until("the dependent to be collected", WAIT, || async {
        match maps.get_opt("dependent").await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(_) => Err("dependent still exists".to_string()),
        }
    })
    .await
    .expect("garbage collected");
}

#[tokio::test]
async fn supervised_process_restarts_after_sigkill_and_stays_stopped_when_stopped() {
    let env = env();
    let port = testenv::ports::free_port().expect("port");
    let supervised = env.supervise(
        ProcessSpec::new(
            "supervision-test/pmem-csi",
            env.tools().pmem_csi(),
            "supervision-test.log",
        )
        // A node driver on the fake backend: a real long-running process with an admin
        // server, needing nothing from the cluster.
        .args([
            "node".to_string(),
            format!("--admin-address=127.0.0.1:{port}"),
            format!(
                "--endpoint=unix://{}",
                env.dir().join("supervision-test.sock").display()
            ),
            "--node-id=supervision-test".into(),
            "--device-mode=fake".into(),
            "--emulated-size=1Gi".into(),
            "--standalone".into(),
            format!(
                "--state-dir={}",
                env.dir().join("supervision-test-state").display()
            ),
        ]),
    );
    let probe = testenv::control_plane::anonymous_probe(&format!("http://127.0.0.1:{port}"), "p")
        .expect("probe client");
    let healthy = || async { testenv::control_plane::probe_path(&probe, "/healthz").await };
    until("the first instance to serve", WAIT, healthy)
        .await
        .expect("serves");
    let first = supervised.state();
    let first_pid = first.pid.expect("running");
    assert_eq!(first.restarts, 0);

    supervised.signal(Signal::KILL).expect("SIGKILL");
    let second = supervised
        .wait_for(WAIT, |s| {
            s.restarts == 1 && s.pid.is_some_and(|p| p != first_pid)
        })
        .await
        .unwrap_or_else(|| panic!("not restarted: {:?}", supervised.state()));
    until("the restarted instance to serve", WAIT, healthy)
        .await
        .expect("serves again");

    let stopped = supervised.stop().await;
    assert!(stopped.stopped, "{stopped:?}");
    assert_eq!(stopped.pid, None);
    assert_eq!(stopped.restarts, 1, "stopping is not a restart");
    let second_pid = second.pid.expect("second pid");
    let gone = rustix::process::Pid::from_raw(second_pid as i32)
        .is_none_or(|pid| rustix::process::test_kill_process(pid).is_err());
    assert!(gone, "pid {second_pid} still exists after stop");
    // The supervisor has ended (stop awaited it), so nothing can start the process again;
    // the port is free for anyone.
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("port released after stop");
}
