//! The capacity publisher of a real `pmem-csi node` (fake backend) against testenv: objects per
//! late-binding class with labels, annotations and the Node as owner; capacity follows creates;
//! bursts are coalesced; objects go with their class, with the CSI server, and with the Node.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use driver::csi::controller_client::ControllerClient;
use driver::csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use driver::csi::{CapacityRange, CreateVolumeRequest, VolumeCapability};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::storage::v1::{CSIStorageCapacity, StorageClass};
use kube::Api;
use kube::api::DeleteParams;
use kube::runtime::watcher;
use testenv::node_driver::NodeDriverDirs;
use testenv::node_processes::DriverOptions;
use testenv::wait::until;
use testenv::{NodeSpec, Supervised, TestEnv, TestEnvBuilder};
use testenv::{api_calls, metrics, wait};

const DRIVER: &str = "pmem-csi.intel.com";
const NAMESPACE: &str = "pmem-csi";
const WAIT: Duration = Duration::from_secs(60);
const MI: u64 = 1 << 20;

fn env() -> &'static TestEnv {
    fn configure() -> TestEnvBuilder {
        TestEnv::builder().nodes(2)
    }
    TestEnv::shared(configure)
}

async fn class(client: &kube::Client, name: &str, mode: &str) {
    api_calls::create_storage_class(client, name, DRIVER, mode)
        .await
        .expect("class");
}

/// A supervised fake-backend node driver publishing for `node`.
fn node_driver(env: &TestEnv, node: &str, dirs: &NodeDriverDirs) -> Supervised {
    env.supervise_node_driver(node, dirs, &DriverOptions::fake("1Gi", &[]))
        .expect("node driver")
}

fn capability() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume::default())),
    }
}

async fn create(client: &mut ControllerClient<tonic::transport::Channel>, name: &str, size: u64) {
    client
        .create_volume(CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: size as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![capability()],
            ..Default::default()
        })
        .await
        .expect("create volume");
}

async fn capacity_of(api: &Api<CSIStorageCapacity>, name: &str) -> Result<u64, String> {
    let o = api
        .get_opt(name)
        .await
        .map_err(|e| e.to_string())?
        .ok_or("no object yet")?;
    o.capacity
        .and_then(|q| controllers::quantity::parse_bytes(&q.0).ok())
        .ok_or_else(|| "no capacity".to_string())
}

#[tokio::test]
async fn publishes_follows_coalesces_and_withdraws() {
    let env = env();
    let client = env.client().await.expect("client");
    let ns = testenv::test_namespace(&client, "publisher")
        .await
        .expect("ns");
    let late = format!("{ns}-late");
    let immediate = format!("{ns}-immediate");
    class(&client, &late, "WaitForFirstConsumer").await;
    class(&client, &immediate, "Immediate").await;
    let root = tempfile::tempdir().expect("tempdir");
    let dirs = NodeDriverDirs::under(root.path());
    let port = testenv::ports::free_port().expect("port");
    let admin = format!("--admin-address=127.0.0.1:{port}");
    let driver = env
        .supervise_node_driver("node-1", &dirs, &DriverOptions::fake("1Gi", &[&admin]))
        .expect("node driver");
    testenv::node_driver::wait_for_path(&dirs.socket, WAIT)
        .await
        .expect("socket");
    let mut csi = ControllerClient::new(
        driver::client::connect(&dirs.socket)
            .await
            .expect("connect"),
    );

    let api = Api::<CSIStorageCapacity>::namespaced(client.clone(), NAMESPACE);
    let name = controllers::well_known::capacity_object_name("node-1", &late);
    let capacity = until(
        "the capacity object of the late-binding class",
        WAIT,
        || capacity_of(&api, &name),
    )
    .await
    .expect("published");
    assert_eq!(capacity, 1 << 30);
    let object = api.get(&name).await.expect("object");
    let labels = object.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get("csi.storage.k8s.io/drivername")
            .map(String::as_str),
        Some(DRIVER)
    );
    assert_eq!(
        labels
            .get("csi.storage.k8s.io/managed-by")
            .map(String::as_str),
        Some("pmem-csi-node-1")
    );
    let annotations = object.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations
            .get("pmem-csi.intel.com/managed-bytes")
            .map(String::as_str),
        Some("1073741824")
    );
    assert_eq!(
        annotations
            .get("pmem-csi.intel.com/alignment-bytes")
            .map(String::as_str),
        Some("4194304")
    );
    assert_eq!(
        annotations
            .get("pmem-csi.intel.com/free-extents")
            .map(String::as_str),
        Some("1073741824")
    );
    let owner = object.metadata.owner_references.clone().unwrap_or_default();
    assert_eq!(
        owner.first().map(|o| (o.kind.as_str(), o.name.as_str())),
        Some(("Node", "node-1"))
    );
    let immediate_name = controllers::well_known::capacity_object_name("node-1", &immediate);
    assert!(
        api.get_opt(&immediate_name).await.expect("get").is_none(),
        "no object for Immediate classes"
    );

    create(&mut csi, &format!("{ns}-one"), 64 * MI).await;
    until("capacity to drop by 64 MiB", WAIT, || async {
        match capacity_of(&api, &name).await? {
            c if c == (1 << 30) - 64 * MI => Ok(()),
            c => Err(format!("capacity {c}")),
        }
    })
    .await
    .expect("capacity follows the create");

    // A burst of 50 creates: count the writes the watch sees.
    let writes = Arc::new(AtomicUsize::new(0));
    let counter = writes.clone();
    let listed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let listed_flag = listed.clone();
    // The last capacity the watch delivered: a GET can see the final write before the watch
    // event carrying it arrives, so the count is read only once the watch has seen it.
    let watched_capacity = Arc::new(AtomicU64::new(0));
    let seen_by_watch = watched_capacity.clone();
    let watched = api.clone();
    let field = format!("metadata.name={name}");
    let watch = tokio::spawn(async move {
        let mut events = watcher(watched, watcher::Config::default().fields(&field)).boxed();
        let mut last_rv = None;
        while let Some(Ok(event)) = events.next().await {
            if let watcher::Event::Apply(o) = event {
                if last_rv.is_some() && last_rv != o.metadata.resource_version {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
                last_rv = o.metadata.resource_version.clone();
                if let Some(c) = o
                    .capacity
                    .and_then(|q| controllers::quantity::parse_bytes(&q.0).ok())
                {
                    seen_by_watch.store(c, Ordering::SeqCst);
                }
            } else if let watcher::Event::InitApply(o) = event {
                last_rv = o.metadata.resource_version.clone();
            } else if let watcher::Event::InitDone = event {
                listed_flag.store(true, Ordering::SeqCst);
            }
        }
    });
    // The watch lists the object first, so that it only counts what follows.
    until("the watch to list the object", WAIT, || async {
        if listed.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("listing".to_string())
        }
    })
    .await
    .expect("watch ready");
    for i in 0..50 {
        create(&mut csi, &format!("{ns}-burst-{i}"), 4 * MI).await;
    }
    let after_burst = (1 << 30) - 64 * MI - 50 * 4 * MI;
    until(
        "the watch to deliver the capacity after the burst",
        WAIT,
        || async {
            match watched_capacity.load(Ordering::SeqCst) {
                c if c == after_burst => Ok(()),
                c => Err(format!("capacity {c}")),
            }
        },
    )
    .await
    .expect("capacity after the burst");
    let burst_writes = writes.load(Ordering::SeqCst);
    watch.abort();
    println!("50 creates caused {burst_writes} writes to the capacity object");
    let text = metrics::scrape_metrics(port).await;
    let reconciles = metrics::metric_value(
        &text,
        "controller_runtime_reconcile_total{controller=\"capacity-publisher\",result=\"success\"}",
    ) + metrics::metric_value(
        &text,
        "controller_runtime_reconcile_total{controller=\"capacity-publisher\",result=\"requeue_after\"}",
    );
    assert!(
        reconciles >= 1,
        "the publisher reconciled its Node:\n{text}"
    );
    assert!(
        burst_writes <= 10,
        "50 creates caused {burst_writes} writes"
    );
    assert!(burst_writes >= 1, "the burst must be published");

    Api::<StorageClass>::all(client.clone())
        .delete(&late, &DeleteParams::default())
        .await
        .expect("delete class");
    wait::wait_gone(&api, &name, WAIT)
        .await
        .expect("object of a deleted class removed");

    // Stopping the CSI server withdraws the node's objects.
    class(&client, &late, "WaitForFirstConsumer").await;
    until("the object to come back with the class", WAIT, || {
        capacity_of(&api, &name)
    })
    .await
    .expect("back");
    let stopped = driver.stop().await;
    assert!(stopped.stopped);
    assert!(
        api.get_opt(&name).await.expect("get").is_none(),
        "withdrawn on stop"
    );
}

#[tokio::test]
async fn objects_follow_their_node_to_the_garbage_collector() {
    let env = env();
    let client = env.client().await.expect("client");
    let ns = testenv::test_namespace(&client, "publisher-gc")
        .await
        .expect("ns");
    let node = format!("{ns}-node");
    NodeSpec::with_driver(&node)
        .create(&client, DRIVER)
        .await
        .expect("node");
    let late = format!("{ns}-late");
    class(&client, &late, "WaitForFirstConsumer").await;
    let root = tempfile::tempdir().expect("tempdir");
    let dirs = NodeDriverDirs::under(root.path());
    let driver = node_driver(env, &node, &dirs);
    let api = Api::<CSIStorageCapacity>::namespaced(client.clone(), NAMESPACE);
    let name = controllers::well_known::capacity_object_name(&node, &late);
    until("published", WAIT, || capacity_of(&api, &name))
        .await
        .expect("published");
    // The driver stays up; only the Node goes: the garbage collector takes the objects.
    Api::<Node>::all(client.clone())
        .delete(&node, &DeleteParams::background())
        .await
        .expect("delete node");
    // The garbage collector removes objects whose owner is gone.
    wait::wait_gone(&api, &name, WAIT)
        .await
        .expect("collected with the node");
    driver.stop().await;
}
