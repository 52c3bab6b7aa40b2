//! Two driver instances in one cluster (issue 25): testenv's own, from the kustomize manifests
//! (`pmem-csi.intel.com` in `pmem-csi`), and a second installed from the Helm chart with
//! `charts/pmem-csi/ci/second-instance-values.yaml` (`second.pmem-csi.intel.com` in
//! `pmem-csi-second`) on the same nodes. Both provision for one pod on one node, each counts only
//! its own capacity, the API server's audit log shows neither writing the other's objects, and
//! uninstalling the second leaves nothing of it while the first goes on provisioning.

use std::collections::BTreeMap;
use std::time::Duration;

use controllers::test_objects;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::api::storage::v1::{CSIDriver, CSINode, CSIStorageCapacity, StorageClass};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use testenv::audit;
use testenv::instance::SECOND_NAMESPACE;
use testenv::manifests::NAMESPACE;
use testenv::node_processes::DriverOptions;
use testenv::wait::{until, wait_gone};
use testenv::{DEFAULT_DRIVER_NAME, TestEnv};

const WAIT: Duration = Duration::from_secs(90);
const FIRST_CLASS: &str = "pmem-csi-sc-ext4";
const SECOND_CLASS: &str = "second-pmem-csi-sc-ext4";
const SECOND_DRIVER: &str = "second.pmem-csi.intel.com";
const NODES: [&str; 2] = ["node-1", "node-2"];

/// Capacity object name → capacity, of `class` in `namespace`, once every node publishes one.
async fn published(
    client: &kube::Client,
    namespace: &str,
    class: &str,
) -> BTreeMap<String, (String, String)> {
    let api = Api::<CSIStorageCapacity>::namespaced(client.clone(), namespace);
    until(
        &format!("{class} published in {namespace} for every node"),
        WAIT,
        || async {
            let list = api
                .list(&ListParams::default())
                .await
                .map_err(|e| e.to_string())?;
            let found: BTreeMap<String, (String, String)> = list
                .items
                .iter()
                .filter(|c| c.storage_class_name == class)
                .map(|c| {
                    let node = c
                        .node_topology
                        .as_ref()
                        .and_then(|t| t.match_labels.as_ref())
                        .and_then(|l| l.values().next().cloned())
                        .unwrap_or_default();
                    let free = c.capacity.as_ref().map(|q| q.0.clone()).unwrap_or_default();
                    (node, (c.metadata.name.clone().unwrap_or_default(), free))
                })
                .collect();
            if NODES.iter().all(|n| found.contains_key(*n)) {
                Ok(found)
            } else {
                Err(format!("{found:?}"))
            }
        },
    )
    .await
    .expect("capacity published")
}

/// Waits until `class` in `namespace` publishes exactly `want` (node → (object, capacity)).
async fn publishes(
    client: &kube::Client,
    namespace: &str,
    class: &str,
    want: &BTreeMap<String, (String, String)>,
    what: &str,
) {
    until(what, WAIT, || async {
        let got = published(client, namespace, class).await;
        if &got == want {
            Ok(())
        } else {
            Err(format!("{got:?}, want {want:?}"))
        }
    })
    .await
    .expect(what);
}

/// Pod `name` once it runs.
async fn running_pod(pods: &Api<Pod>, name: &str) -> Pod {
    until(&format!("pod {name} Running"), WAIT, || async {
        let pod = pods.get(name).await.map_err(|e| e.to_string())?;
        match pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
            Some("Running") => Ok(pod),
            other => Err(format!("phase {other:?}")),
        }
    })
    .await
    .expect("running")
}

fn bytes(quantity: &str) -> i64 {
    let bytes = controllers::quantity::parse_bytes(quantity).expect("quantity");
    i64::try_from(bytes).expect("capacity fits i64")
}

/// The writes in `requests` by the ServiceAccounts of `namespace`.
fn writes_by<'a>(requests: &'a [audit::Request], namespace: &str) -> Vec<&'a audit::Request> {
    let prefix = format!("system:serviceaccount:{namespace}:");
    requests
        .iter()
        .filter(|r| r.user.starts_with(&prefix))
        .filter(|r| {
            matches!(
                r.verb.as_str(),
                "create" | "update" | "patch" | "delete" | "deletecollection"
            )
        })
        .collect()
}

#[tokio::test]
async fn a_second_instance_from_the_chart_provisions_beside_the_first_and_uninstalls_cleanly() {
    let env = TestEnv::builder()
        .nodes(2)
        .drivers(DriverOptions::default())
        .kubelet()
        .controller_without_webhook(Vec::<String>::new())
        .start()
        .await
        .expect("testenv");
    let client = env.client().await.expect("client");
    let first = published(&client, NAMESPACE, FIRST_CLASS).await;

    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let no_extender = env.dir().join("no-extender-values.yaml");
    // testenv cannot route to a webhook Service, so the second instance runs without the
    // extender component (the chart comparison covers its objects).
    std::fs::write(&no_extender, "schedulerExtender:\n  enabled: false\n").expect("values");
    let second = env
        .install_instance(
            repo,
            "second",
            SECOND_NAMESPACE,
            &[
                repo.join("charts/pmem-csi/ci/second-instance-values.yaml"),
                no_extender,
            ],
        )
        .await
        .expect("install the second instance");
    assert_eq!(second.driver_name(), SECOND_DRIVER);

    // Each counts only its own: the second publishes its whole region, in its own namespace,
    // and the first's objects do not move.
    let second_free = published(&client, SECOND_NAMESPACE, SECOND_CLASS).await;
    for node in NODES {
        assert_eq!(
            second_free[node].1, first[node].1,
            "both regions are as large, so both publish the same on {node}"
        );
        assert_ne!(second_free[node].0, first[node].0);
    }
    publishes(
        &client,
        NAMESPACE,
        FIRST_CLASS,
        &first,
        "the first's capacity unchanged",
    )
    .await;
    let first_ns = Api::<CSIStorageCapacity>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default())
        .await
        .expect("list");
    assert!(
        first_ns
            .items
            .iter()
            .all(|c| !c.storage_class_name.starts_with("second-")),
        "the second instance published into the first's namespace"
    );

    // One pod with a claim of each: the scheduler finds a node where both have room, each
    // instance's provisioner on that node creates its volume, kubelet mounts each through its
    // own driver.
    let pp = PostParams::default();
    let ns = testenv::test_namespace(&client, "two-instances")
        .await
        .expect("ns");
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns);
    claims
        .create(
            &pp,
            &test_objects::claim(&ns, "data-a", FIRST_CLASS, "64Mi"),
        )
        .await
        .expect("claim a");
    claims
        .create(
            &pp,
            &test_objects::claim(&ns, "data-b", SECOND_CLASS, "64Mi"),
        )
        .await
        .expect("claim b");
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    let pod = test_objects::pod(
        &ns,
        "app",
        vec![
            test_objects::claim_volume("a", "data-a"),
            test_objects::claim_volume("b", "data-b"),
        ],
    );
    pods.create(&pp, &pod).await.expect("pod");
    let running = running_pod(&pods, "app").await;
    let node = running
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .expect("node");
    let uid = running.metadata.uid.clone().expect("uid");
    let mounted = env.kubelet().expect("kubelet").mounted(&uid);
    let mut drivers: Vec<&str> = mounted.iter().map(|m| m.volume.driver.as_str()).collect();
    drivers.sort_unstable();
    assert_eq!(drivers, vec![DEFAULT_DRIVER_NAME, SECOND_DRIVER]);
    let pvs = Api::<PersistentVolume>::all(client.clone());
    let mut volumes = BTreeMap::new();
    for claim in ["data-a", "data-b"] {
        let bound = claims.get(claim).await.expect("claim");
        let pv_name = bound.spec.and_then(|s| s.volume_name).expect("bound claim");
        let pv = pvs.get(&pv_name).await.expect("pv");
        let csi = pv.spec.as_ref().and_then(|s| s.csi.clone()).expect("csi");
        let pinned = format!("{:?}", pv.spec.as_ref().map(|s| &s.node_affinity));
        assert!(
            pinned.contains(&node),
            "{pv_name} of {claim} is pinned to the pod's node {node}: {pinned}"
        );
        volumes.insert(claim, (pv_name, csi.driver));
    }
    assert_eq!(volumes["data-a"].1, DEFAULT_DRIVER_NAME);
    assert_eq!(volumes["data-b"].1, SECOND_DRIVER);

    // Each instance's capacity on that node went down by its own volume only.
    let used = |before: &BTreeMap<String, (String, String)>,
                after: &BTreeMap<String, (String, String)>| {
        bytes(&before[&node].1) - bytes(&after[&node].1)
    };
    let after = until("both instances to count their volume", WAIT, || async {
        let a = published(&client, NAMESPACE, FIRST_CLASS).await;
        let b = published(&client, SECOND_NAMESPACE, SECOND_CLASS).await;
        if used(&first, &a) > 0 && used(&second_free, &b) > 0 {
            Ok((a, b))
        } else {
            Err(format!("{a:?} {b:?}"))
        }
    })
    .await
    .expect("capacity counted");
    assert_eq!(
        used(&first, &after.0),
        used(&second_free, &after.1),
        "one 64Mi volume each: neither counts the other's"
    );
    let other = NODES.iter().find(|n| **n != node).expect("other node");
    assert_eq!(after.0[*other], first[*other]);
    assert_eq!(after.1[*other], second_free[*other]);

    pods.delete("app", &DeleteParams::default())
        .await
        .expect("delete pod");
    wait_gone(&pods, "app", WAIT).await.expect("pod gone");
    for claim in ["data-a", "data-b"] {
        claims
            .delete(claim, &DeleteParams::default())
            .await
            .expect("delete claim");
    }
    for (pv, _) in volumes.values() {
        // Deleted by its own instance's provisioner.
        wait_gone(&pvs, pv, WAIT).await.expect("pv gone");
    }
    publishes(
        &client,
        NAMESPACE,
        FIRST_CLASS,
        &first,
        "the first's room back",
    )
    .await;
    publishes(
        &client,
        SECOND_NAMESPACE,
        SECOND_CLASS,
        &second_free,
        "the second's room back",
    )
    .await;

    // Uninstalled, the second leaves nothing; the first goes on.
    let rendered_classes: Vec<String> = second
        .rendered()
        .of_kinds(&["StorageClass"])
        .filter_map(|o| o["metadata"]["name"].as_str().map(str::to_string))
        .collect();
    assert!(rendered_classes.iter().any(|c| c == SECOND_CLASS));
    second.uninstall(&env).await.expect("uninstall");
    assert!(
        Api::<CSIDriver>::all(client.clone())
            .get_opt(SECOND_DRIVER)
            .await
            .expect("get")
            .is_none()
    );
    let classes = Api::<StorageClass>::all(client.clone());
    for class in &rendered_classes {
        assert!(
            classes.get_opt(class).await.expect("get").is_none(),
            "{class} left"
        );
    }
    assert!(classes.get_opt(FIRST_CLASS).await.expect("get").is_some());
    let leftover_roles: Vec<String> = Api::<ClusterRole>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("roles")
        .items
        .into_iter()
        .chain(
            Api::<ClusterRoleBinding>::all(client.clone())
                .list(&ListParams::default())
                .await
                .expect("bindings")
                .items
                .into_iter()
                .map(|b| ClusterRole {
                    metadata: b.metadata,
                    ..Default::default()
                }),
        )
        .filter_map(|r| r.metadata.name)
        .filter(|n| n.starts_with("second-"))
        .collect();
    assert!(leftover_roles.is_empty(), "left: {leftover_roles:?}");
    for node in NODES {
        let csinode = Api::<CSINode>::all(client.clone())
            .get(node)
            .await
            .expect("csinode");
        let names: Vec<&str> = csinode
            .spec
            .drivers
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(names, vec![DEFAULT_DRIVER_NAME], "CSINode {node}");
    }
    let left: Vec<String> = pvs
        .list(&ListParams::default())
        .await
        .expect("pvs")
        .items
        .into_iter()
        .filter(|pv| {
            pv.spec
                .as_ref()
                .and_then(|s| s.csi.as_ref())
                .is_some_and(|c| c.driver == SECOND_DRIVER)
        })
        .filter_map(|pv| pv.metadata.name)
        .collect();
    assert!(left.is_empty(), "volumes of the second left: {left:?}");

    // Neither wrote the other's objects: its namespace, its claim or its volume (read after the
    // uninstall, so that the requests of the second's shutdown count too).
    let log = std::fs::read_to_string(env.audit_log()).expect("audit log");
    let (requests, _) = audit::parse_log(&log);
    let second_writes = writes_by(&requests, SECOND_NAMESPACE);
    assert!(
        second_writes
            .iter()
            .any(|r| r.resource == "csistoragecapacities" && r.namespace == SECOND_NAMESPACE),
        "the audit log holds the second instance's writes"
    );
    assert!(
        second_writes
            .iter()
            .any(|r| r.resource == "persistentvolumes" && r.name == volumes["data-b"].0),
        "the audit log holds the second instance's provisioning"
    );
    assert!(
        writes_by(&requests, NAMESPACE)
            .iter()
            .any(|r| r.resource == "persistentvolumes" && r.name == volumes["data-a"].0),
        "the audit log holds the first instance's provisioning"
    );
    for (writer, others_namespace, others_claim, others_volume) in [
        (
            NAMESPACE,
            SECOND_NAMESPACE,
            "data-b",
            volumes["data-b"].0.as_str(),
        ),
        (
            SECOND_NAMESPACE,
            NAMESPACE,
            "data-a",
            volumes["data-a"].0.as_str(),
        ),
    ] {
        let trespasses: Vec<_> = writes_by(&requests, writer)
            .into_iter()
            .filter(|r| {
                let claim = r.resource.starts_with("persistentvolumeclaims");
                let volume = r.resource == "persistentvolumes"
                    || r.resource.starts_with("persistentvolumes/");
                r.namespace == others_namespace
                    || (claim && r.name == others_claim)
                    || (volume && r.name == others_volume)
            })
            .collect();
        assert!(
            trespasses.is_empty(),
            "the instance in {writer} wrote the other's objects: {trespasses:?}"
        );
    }

    // The chart's RBAC is enough for the second instance (the kustomize instance's is judged by
    // tests/least_privilege.rs over the whole run).
    for account in [
        "second-pmem-csi-intel-com-node",
        "second-pmem-csi-intel-com-controller",
    ] {
        let user = audit::service_account_user(SECOND_NAMESPACE, account);
        assert!(
            requests.iter().any(|r| r.user == user),
            "{account} made no request"
        );
        let denied = audit::denials(&requests, &user);
        assert!(denied.is_empty(), "{account} was denied: {denied:?}");
    }

    claims
        .create(&pp, &test_objects::claim(&ns, "after", FIRST_CLASS, "64Mi"))
        .await
        .expect("claim after");
    pods.create(&pp, &test_objects::pod_with_claim(&ns, "after", "after"))
        .await
        .expect("pod after");
    // The first still provisions.
    running_pod(&pods, "after").await;
    pods.delete("after", &DeleteParams::default())
        .await
        .expect("delete");
    claims
        .delete("after", &DeleteParams::default())
        .await
        .expect("delete");

    let leftovers = env.stop().await;
    let left = leftovers.wait_clean(Duration::from_secs(30)).await;
    assert!(left.is_empty(), "left behind: {left:?}");
}
