//! The orphan sweep of a real `pmem-csi node` (fake backend) against testenv: volumes whose
//! claim is gone or went to another node are deleted after `--orphan-grace`; volumes a PV
//! refers to, or whose claim is still pending here, stay.

use std::collections::HashMap;
use std::time::Duration;

use controllers::test_objects;
use driver::csi::controller_client::ControllerClient;
use driver::csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
use driver::csi::{CapacityRange, CreateVolumeRequest, VolumeCapability};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use kube::Api;
use kube::api::PostParams;
use testenv::metrics;
use testenv::node_driver::NodeDriverDirs;
use testenv::node_processes::DriverOptions;
use testenv::wait::until;
use testenv::{TestEnv, TestEnvBuilder};
use tonic::transport::Channel;

const DRIVER: &str = "pmem-csi.intel.com";
const WAIT: Duration = Duration::from_secs(60);

fn env() -> &'static TestEnv {
    fn configure() -> TestEnvBuilder {
        TestEnv::builder().nodes(1)
    }
    TestEnv::shared(configure)
}

fn claim(ns: &str, name: &str, node: &str) -> PersistentVolumeClaim {
    test_objects::selected_for(test_objects::claim(ns, name, "no-such-class", "4Mi"), node)
}

async fn create(csi: &mut ControllerClient<Channel>, ns: &str, claim: &str) -> String {
    csi.create_volume(CreateVolumeRequest {
        name: format!("pvc-{ns}-{claim}"),
        capacity_range: Some(CapacityRange {
            required_bytes: 4 << 20,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(AccessType::Mount(MountVolume::default())),
        }],
        parameters: HashMap::from([
            ("csi.storage.k8s.io/pvc/name".to_string(), claim.to_string()),
            (
                "csi.storage.k8s.io/pvc/namespace".to_string(),
                ns.to_string(),
            ),
            (
                "csi.storage.k8s.io/pv/name".to_string(),
                format!("pvc-{ns}-{claim}"),
            ),
        ]),
        ..Default::default()
    })
    .await
    .expect("create")
    .into_inner()
    .volume
    .expect("volume")
    .volume_id
}

async fn ids(csi: &mut ControllerClient<Channel>) -> Vec<String> {
    driver::client::volume_ids(csi).await.expect("list")
}

#[tokio::test]
async fn deletes_orphans_keeps_the_rest() {
    let env = env();
    let client = env.client().await.expect("client");
    let ns = testenv::test_namespace(&client, "orphans")
        .await
        .expect("ns");
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns);
    let pp = PostParams::default();
    claims
        .create(&pp, &claim(&ns, "pending", "node-1"))
        .await
        .expect("claim");
    claims
        .create(&pp, &claim(&ns, "moved", "node-2"))
        .await
        .expect("claim");

    let root = tempfile::tempdir().expect("tempdir");
    let dirs = NodeDriverDirs::under(root.path());
    let port = testenv::ports::free_port().expect("port");
    let admin = format!("--admin-address=127.0.0.1:{port}");
    let driver = env
        .supervise_node_driver(
            "node-1",
            &dirs,
            &DriverOptions::fake("1Gi", &["--orphan-grace=2s", &admin]),
        )
        .expect("node driver");
    testenv::node_driver::wait_for_path(&dirs.socket, WAIT)
        .await
        .expect("socket");
    let mut csi = ControllerClient::new(
        driver::client::connect(&dirs.socket)
            .await
            .expect("connect"),
    );
    // The PV exists before its volume does: with a 2 s grace, a PV written after the volume
    // on a loaded machine could come too late to save it.
    let referenced_id = driver::volume_id::volume_id(&format!("pvc-{ns}-referenced"));
    Api::<PersistentVolume>::all(client.clone())
        .create(
            &pp,
            &test_objects::csi_volume(
                &format!("pvc-{ns}-referenced"),
                DRIVER,
                &referenced_id,
                None,
            ),
        )
        .await
        .expect("pv");
    let gone = create(&mut csi, &ns, "gone").await;
    let moved = create(&mut csi, &ns, "moved").await;
    let pending = create(&mut csi, &ns, "pending").await;
    let referenced = create(&mut csi, &ns, "referenced").await;
    assert_eq!(referenced, referenced_id, "the PV names the volume's id");

    until("the orphans to be swept", WAIT, || async {
        let mut c = csi.clone();
        let now = ids(&mut c).await;
        if now.contains(&gone) || now.contains(&moved) {
            Err(format!("still {now:?}"))
        } else {
            Ok(())
        }
    })
    .await
    .expect("swept");
    let left = ids(&mut csi).await;
    assert!(
        left.contains(&pending),
        "a claim pending here keeps its volume: {left:?}"
    );
    assert!(
        left.contains(&referenced),
        "a volume with a PV stays: {left:?}"
    );
    let metrics =
        testenv::control_plane::anonymous_probe(&format!("http://127.0.0.1:{port}"), "metrics")
            .expect("client")
            .request_text(
                http::Request::get("/metrics")
                    .body(Vec::new())
                    .expect("request"),
            )
            .await
            .expect("metrics");
    assert!(
        metrics.contains("pmem_csi_orphans_deleted_total 2"),
        "{metrics}"
    );

    // What it cost the apiserver: PVs listed once and then watched, however many passes ran;
    // no claim read for a volume a PV refers to.
    let swept_at = metrics::metric_value(&metrics, "pmem_csi_orphan_sweeps_total");
    let metrics_url = format!("http://127.0.0.1:{port}");
    until("three more sweep passes", WAIT, || async {
        let text = testenv::control_plane::anonymous_probe(&metrics_url, "metrics")
            .map_err(|e| e.to_string())?
            .request_text(
                http::Request::get("/metrics")
                    .body(Vec::new())
                    .map_err(|e| e.to_string())?,
            )
            .await
            .map_err(|e| e.to_string())?;
        let passes = metrics::metric_value(&text, "pmem_csi_orphan_sweeps_total");
        (passes >= swept_at + 3)
            .then_some(())
            .ok_or(format!("{passes} passes"))
    })
    .await
    .expect("passes");
    driver.stop().await;
    let log = std::fs::read_to_string(env.audit_log()).expect("audit log");
    let (requests, _) = testenv::audit::parse_log(&log);
    let node = testenv::audit::service_account_user("pmem-csi", "pmem-csi-intel-com-node");
    let count = |verb: &str, resource: &str, name: &str| {
        requests
            .iter()
            .filter(|r| {
                r.user == node
                    && r.verb == verb
                    && r.resource == resource
                    && (name.is_empty() || r.name == name)
            })
            .count()
    };
    assert_eq!(count("list", "persistentvolumes", ""), 1, "PV lists");
    // One watch: audited when its response starts and again when it ends (the driver stopped).
    assert!(
        count("watch", "persistentvolumes", "") <= 2,
        "PV watches: {}",
        count("watch", "persistentvolumes", "")
    );
    assert_eq!(
        count("get", "persistentvolumeclaims", "referenced"),
        0,
        "claim reads for a referenced volume"
    );
    assert!(
        count("get", "persistentvolumeclaims", "pending") >= 3,
        "the unreferenced pending volume's claim is read on every pass: {}",
        count("get", "persistentvolumeclaims", "pending")
    );
}
