//! The PVC rescheduler in a real `pmem-csi controller` process against testenv: it removes
//! `volume.kubernetes.io/selected-node` exactly when the driver definitely does not run on the
//! selected node, with an Event and counted decisions, and leaves every other claim alone.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;

use controllers::test_objects;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::Api;
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use testenv::wait::until;
use testenv::{NodeSpec, Supervised, TestEnv, TestEnvBuilder};
use testenv::{api_calls, metrics, wait};

const DRIVER: &str = "pmem-csi.intel.com";
use controllers::well_known::SELECTED_NODE as SELECTED;
const WAIT: Duration = Duration::from_secs(60);

struct Fixture {
    env: &'static TestEnv,
    metrics_port: u16,
    _controller: Supervised,
}

/// node-1: the driver runs (selector label, CSINode entry). node-2: driverless (neither).
/// node-3: selector label, no CSINode entry (driver starting). node-4: no label, CSINode entry
/// (driver being uninstalled).
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        fn configure() -> TestEnvBuilder {
            TestEnv::builder()
                .node(NodeSpec::with_driver("node-1"))
                .node(NodeSpec::driverless("node-2"))
                .node(NodeSpec::custom("node-3", true, false))
                .node(NodeSpec::custom("node-4", false, true))
        }
        let env = TestEnv::shared(configure);
        let metrics_port = testenv::ports::free_port().expect("port");
        let admin = format!("--admin-address=127.0.0.1:{metrics_port}");
        let controller = env
            .supervise_controller("controller", &["--reschedule-grace=2s", &admin])
            .expect("controller");
        Fixture {
            env,
            metrics_port,
            _controller: controller,
        }
    })
}

fn claim(
    name: &str,
    ns: &str,
    class: &str,
    node: Option<&str>,
    volume: Option<&str>,
) -> PersistentVolumeClaim {
    let mut c = test_objects::claim(ns, name, class, "1Gi");
    if let Some(node) = node {
        c = test_objects::selected_for(c, node);
    }
    if let Some(volume) = volume {
        c = test_objects::bound_to(c, volume);
    }
    c
}

async fn class(client: &kube::Client, name: &str, provisioner: &str) {
    api_calls::create_storage_class(client, name, provisioner, "WaitForFirstConsumer")
        .await
        .expect("class");
}

async fn selected(api: &Api<PersistentVolumeClaim>, name: &str) -> Option<String> {
    api_calls::selected_node(api, name).await
}

async fn metrics(port: u16) -> String {
    metrics::scrape_metrics(port).await
}

fn counter(text: &str, prefix: &str) -> u64 {
    metrics::metric_value(text, prefix)
}

#[tokio::test]
async fn unsets_selected_node_only_where_the_driver_definitely_does_not_run() {
    let f = fixture();
    let client = f.env.client().await.expect("client");
    let ns = testenv::test_namespace(&client, "rescheduler")
        .await
        .expect("ns");
    let pmem = format!("{ns}-pmem");
    let other = format!("{ns}-other");
    class(&client, &pmem, DRIVER).await;
    class(&client, &other, "other.csi.example.com").await;
    // node-5 runs the driver until its Node object is deleted.
    NodeSpec::with_driver(format!("{ns}-node-5"))
        .create(&client, DRIVER)
        .await
        .expect("node-5");
    let node5 = format!("{ns}-node-5");

    let api = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns);
    let pp = PostParams::default();
    let claims = [
        (
            "keep-driver-runs",
            claim("keep-driver-runs", &ns, &pmem, Some("node-1"), None),
        ),
        (
            "keep-labels-match",
            claim("keep-labels-match", &ns, &pmem, Some("node-3"), None),
        ),
        (
            "keep-csinode-lists-driver",
            claim(
                "keep-csinode-lists-driver",
                &ns,
                &pmem,
                Some("node-4"),
                None,
            ),
        ),
        (
            "keep-bound",
            claim(
                "keep-bound",
                &ns,
                &pmem,
                Some("node-2"),
                Some("pv-that-does-not-exist"),
            ),
        ),
        (
            "keep-other-driver",
            claim("keep-other-driver", &ns, &other, Some("node-2"), None),
        ),
        (
            "unset-driverless",
            claim("unset-driverless", &ns, &pmem, Some("node-2"), None),
        ),
        (
            "unset-node-deleted",
            claim("unset-node-deleted", &ns, &pmem, Some(&node5), None),
        ),
    ];
    for (_, c) in &claims {
        api.create(&pp, c).await.expect("create claim");
    }
    Api::<Node>::all(client.clone())
        .delete(&node5, &DeleteParams::default())
        .await
        .expect("delete node-5");

    for name in ["unset-driverless", "unset-node-deleted"] {
        until(&format!("{name} to lose {SELECTED}"), WAIT, || async {
            match selected(&api, name).await {
                None => Ok(()),
                Some(n) => Err(format!("still selected for {n}")),
            }
        })
        .await
        .expect("rescheduled");
    }
    // Every claim was created before the unset ones were judged past their grace, so the
    // others have been judged just as long: they must still be selected.
    for (name, c) in &claims {
        if name.starts_with("keep-") {
            let want = c
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(SELECTED))
                .cloned();
            assert_eq!(
                selected(&api, name).await,
                want,
                "{name} must be left alone"
            );
        }
    }
    let rescheduled = until("Rescheduled events for both claims", WAIT, || async {
        let objects: Vec<String> = api_calls::events(&client, &ns, "reason=Rescheduled")
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .filter_map(|e| e.involved_object.name)
            .collect();
        if objects.contains(&"unset-driverless".to_string())
            && objects.contains(&"unset-node-deleted".to_string())
        {
            Ok(objects)
        } else {
            Err(format!("events so far for {objects:?}"))
        }
    })
    .await
    .expect("events");
    assert_eq!(
        rescheduled.len(),
        2,
        "one event per rescheduled claim: {rescheduled:?}"
    );

    let text = metrics(f.metrics_port).await;
    assert!(
        counter(
            &text,
            "pmem_csi_rescheduler_decisions_total{verdict=\"unset\",reason=\"not-selected-no-csinode-entry\"}"
        ) >= 1,
        "{text}"
    );
    assert!(
        counter(
            &text,
            "pmem_csi_rescheduler_decisions_total{verdict=\"unset\",reason=\"node-missing\"}"
        ) >= 1,
        "{text}"
    );
    let reconciles = counter(
        &text,
        "controller_runtime_reconcile_total{controller=\"rescheduler\",result=\"success\"}",
    ) + counter(
        &text,
        "controller_runtime_reconcile_total{controller=\"rescheduler\",result=\"requeue_after\"}",
    );
    assert!(
        reconciles >= claims.len() as u64,
        "{reconciles} reconciles for {} claims:\n{text}",
        claims.len()
    );
}

fn capacity_object(
    name: &str,
    class: &str,
    node: &str,
) -> k8s_openapi::api::storage::v1::CSIStorageCapacity {
    k8s_openapi::api::storage::v1::CSIStorageCapacity {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("pmem-csi".into()),
            labels: Some(BTreeMap::from([(
                controllers::well_known::DRIVER_LABEL.to_string(),
                DRIVER.to_string(),
            )])),
            ..Default::default()
        },
        storage_class_name: class.into(),
        node_topology: Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector {
                match_labels: Some(BTreeMap::from([(
                    controllers::well_known::topology_key(DRIVER),
                    node.to_string(),
                )])),
                ..Default::default()
            },
        ),
        capacity: Some(Quantity("1Gi".into())),
        maximum_volume_size: None,
    }
}

#[tokio::test]
async fn cleans_up_capacity_of_driverless_nodes_and_deleted_classes() {
    use k8s_openapi::api::storage::v1::CSIStorageCapacity;
    let f = fixture();
    let client = f.env.client().await.expect("client");
    let ns = testenv::test_namespace(&client, "cleanup")
        .await
        .expect("ns");
    let pmem = format!("{ns}-pmem");
    class(&client, &pmem, DRIVER).await;
    let api = Api::<CSIStorageCapacity>::namespaced(client.clone(), "pmem-csi");
    let keep = format!("{ns}-keep");
    let driverless = format!("{ns}-driverless");
    let no_class = format!("{ns}-no-class");
    for o in [
        capacity_object(&keep, &pmem, "node-1"),
        capacity_object(&driverless, &pmem, "node-2"),
        capacity_object(&no_class, &format!("{ns}-deleted-class"), "node-1"),
    ] {
        api.create(&PostParams::default(), &o)
            .await
            .expect("capacity object");
    }
    for name in [&driverless, &no_class] {
        wait::wait_gone(&api, name, WAIT).await.expect("cleaned up");
    }
    let text = metrics(f.metrics_port).await;
    let reconciles = counter(
        &text,
        "controller_runtime_reconcile_total{controller=\"capacity-cleanup\",result=\"success\"}",
    ) + counter(
        &text,
        "controller_runtime_reconcile_total{controller=\"capacity-cleanup\",result=\"requeue_after\"}",
    );
    assert!(
        reconciles >= 3,
        "{reconciles} clean-up reconciles for 3 objects:\n{text}"
    );
    assert!(
        api.get_opt(&keep).await.expect("get").is_some(),
        "capacity of a node with the driver stays"
    );
}
