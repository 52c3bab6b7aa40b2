//! Least privilege for node identities: the node ServiceAccount's Role may write every Lease in
//! the namespace, and the manifests' ValidatingAdmissionPolicy (`manifests/base/
//! node-lease-policy.yaml`) narrows that to the heartbeat Lease of the node its token is bound
//! to. Here, against testenv's real API server with the rendered policy applied, a node's
//! identity writes its own heartbeat and is refused, in the policy's name, another node's
//! heartbeat and the controller's leader Lease, created or updated; a token bound to no node
//! writes no Lease at all. Likewise for PersistentVolumes (`manifests/base/volume-policy.yaml`):
//! a node's identity writes only this driver's PVs pinned to its node, the controller's only
//! this driver's.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::PersistentVolume;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;
use testenv::manifests::{NAMESPACE, NODE_LEASE_POLICY};
use testenv::{NodeSpec, TestEnv, TestEnvBuilder};

use controllers::heartbeat;
use controllers::well_known::heartbeat_lease_name;

const DRIVER: &str = "pmem-csi.intel.com";
const PERIOD: std::time::Duration = std::time::Duration::from_secs(10);
/// Node names long enough that their heartbeat Lease name is hash-shortened, sharing the first
/// 28 characters (all the shortened name keeps of a node name).
const LONG_A: &str = "pmem-node-with-a-rather-long-name-in-pool-a-000001";
const LONG_B: &str = "pmem-node-with-a-rather-long-name-in-pool-a-000002";

fn env() -> &'static TestEnv {
    fn configure() -> TestEnvBuilder {
        // Node objects only: the tokens are bound to them; no driver runs.
        TestEnv::builder()
            .nodes(2)
            .node(NodeSpec::with_driver(LONG_A))
            .node(NodeSpec::with_driver(LONG_B))
    }
    TestEnv::shared(configure)
}

/// A Lease API in the driver namespace as the node ServiceAccount of `node` (its token bound to
/// that Node, as on a cluster), or with a token bound to no node (`None`).
async fn leases_as(env: &TestEnv, node: Option<&str>) -> Api<Lease> {
    Api::namespaced(node_client(env, node).await, NAMESPACE)
}

/// A client as the node ServiceAccount of `node` (its token bound to that Node, as on a
/// cluster), or with a token bound to no node (`None`).
async fn node_client(env: &TestEnv, node: Option<&str>) -> kube::Client {
    let (kubeconfig, name) = match node {
        Some(node) => (
            env.node_identity_kubeconfig(node)
                .await
                .expect("node token"),
            node.to_string(),
        ),
        None => (
            env.service_account_kubeconfig("pmem-csi-intel-com-node")
                .expect("node ServiceAccount kubeconfig")
                .to_path_buf(),
            "unbound".to_string(),
        ),
    };
    testenv::control_plane::client_from(&kubeconfig, &name)
        .await
        .expect("client")
}

async fn admin_leases(env: &TestEnv) -> Api<Lease> {
    Api::namespaced(env.client().await.expect("admin"), NAMESPACE)
}

/// The heartbeat Lease of `node` as its driver writes it (`previous`: renewed).
fn heartbeat_of(node: &str, previous: Option<&Lease>) -> Lease {
    heartbeat::lease(DRIVER, node, NAMESPACE, PERIOD, previous)
}

/// A leader Lease as the controller holds it (controllers/src/leader.rs).
fn leader(name: &str, holder: &str) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(15),
            ..Default::default()
        }),
    }
}

/// `lease` taken over by `holder`: what a node forging it would write.
fn taken_over(mut lease: Lease, holder: &str) -> Lease {
    let spec = lease.spec.get_or_insert_with(Default::default);
    spec.holder_identity = Some(holder.into());
    spec.renew_time = heartbeat_of(holder, None).spec.and_then(|s| s.renew_time);
    lease
}

/// Panics unless `result` is the policy's refusal; returns its message.
fn refused_by_policy(what: &str, result: Result<Lease, kube::Error>) -> String {
    let by = format!("ValidatingAdmissionPolicy '{NODE_LEASE_POLICY}'");
    match result {
        Err(kube::Error::Api(status)) if status.code == 403 && status.message.contains(&by) => {
            status.message
        }
        Err(e) => panic!("{what}: refused, but not by {by}: {e}"),
        Ok(_) => panic!("{what}: allowed, but {by} must refuse it"),
    }
}

/// Creates `lease` as admin unless it exists; returns it as stored.
async fn ensure(admin: &Api<Lease>, lease: &Lease) -> Lease {
    let name = lease.metadata.name.clone().unwrap_or_default();
    match admin.get_opt(&name).await.expect("get") {
        Some(existing) => existing,
        None => admin
            .create(&PostParams::default(), lease)
            .await
            .expect("admin creates the Lease"),
    }
}

#[tokio::test]
async fn a_node_writes_its_own_heartbeat_lease() {
    let env = env();
    let pp = PostParams::default();
    for node in ["node-1", LONG_A] {
        let leases = leases_as(env, Some(node)).await;
        let name = heartbeat_lease_name(DRIVER, node);
        let created = leases
            .create(&pp, &heartbeat_of(node, None))
            .await
            .unwrap_or_else(|e| panic!("{node} creating its heartbeat {name}: {e}"));
        leases
            .replace(&name, &pp, &heartbeat_of(node, Some(&created)))
            .await
            .unwrap_or_else(|e| panic!("{node} renewing its heartbeat {name}: {e}"));
    }
}

#[tokio::test]
async fn a_node_cannot_write_another_nodes_or_a_leader_lease() {
    let env = env();
    let pp = PostParams::default();
    let admin = admin_leases(env).await;
    // (the writer's node, the Lease as its rightful holder writes it, what the writer tries to
    // create before that holder has it, what the case is about)
    let cases = [
        (
            "node-1",
            heartbeat_of("node-2", None),
            taken_over(heartbeat_of("node-2", None), "node-1"),
            "another node's heartbeat",
        ),
        (
            "node-1",
            leader("pmem-csi-intel-com-rescheduler", "controller-0"),
            taken_over(
                leader("pmem-csi-intel-com-rescheduler", "controller-0"),
                "node-1",
            ),
            "the rescheduler's leader Lease",
        ),
        (
            "node-1",
            leader("pmem-csi-intel-com-capacity-cleanup", "controller-0"),
            taken_over(
                leader("pmem-csi-intel-com-capacity-cleanup", "controller-0"),
                "node-1",
            ),
            "the capacity clean-up's leader Lease",
        ),
        // The name is hash-shortened and both names keep the same prefix, so the policy cannot
        // tell them apart by name: the holder decides. Created in the other node's name (the
        // forgery a holder-aware reader would believe); created with the writer as holder is
        // what the policy cannot refuse (docs/install-and-operate.md, "Node identities").
        (
            LONG_A,
            heartbeat_of(LONG_B, None),
            heartbeat_of(LONG_B, None),
            "a hash-shortened heartbeat of another node",
        ),
    ];
    for (writer, lease, forged, about) in cases {
        let leases = leases_as(env, Some(writer)).await;
        let name = lease.metadata.name.clone().unwrap_or_default();
        // Create: the Lease does not exist yet (a leader Lease before the controller started,
        // a heartbeat before that node's driver ran).
        let message = refused_by_policy(
            &format!("{writer} creating {about} {name}"),
            leases.create(&pp, &forged).await,
        );
        println!("create {name} as {writer}: {message}");
        // Update: the rightful holder has it; the node tries to take it over.
        let stored = ensure(&admin, &lease).await;
        let message = refused_by_policy(
            &format!("{writer} updating {about} {name}"),
            leases
                .replace(&name, &pp, &taken_over(stored, writer))
                .await,
        );
        println!("update {name} as {writer}: {message}");
    }
}

#[tokio::test]
async fn a_token_bound_to_no_node_writes_no_lease() {
    let env = env();
    let leases = leases_as(env, None).await;
    // A heartbeat no other test writes, so that only the policy can refuse it.
    let lease = heartbeat_of("node-3", None);
    let message = refused_by_policy(
        "a token bound to no node creating a heartbeat",
        leases
            .create(
                &PostParams {
                    dry_run: true,
                    ..Default::default()
                },
                &lease,
            )
            .await,
    );
    assert!(message.contains("bound to no node"), "{message}");
}

/// The manifests' policy on PersistentVolumes (`manifests/base/volume-policy.yaml`).
const NODE_VOLUMES: &str = "pmem-csi-intel-com-node-volumes";
const CONTROLLER_VOLUMES: &str = "pmem-csi-intel-com-controller-volumes";

/// A PV API as the node ServiceAccount of `node` (or with a token bound to no node).
async fn volumes_as(env: &TestEnv, node: Option<&str>) -> Api<PersistentVolume> {
    Api::all(node_client(env, node).await)
}

/// Panics unless `result` is `policy`'s refusal.
fn refused_by<T: std::fmt::Debug>(policy: &str, what: &str, result: Result<T, kube::Error>) {
    let by = format!("ValidatingAdmissionPolicy '{policy}'");
    match result {
        Err(kube::Error::Api(status)) if status.code == 403 && status.message.contains(&by) => {}
        Err(e) => panic!("{what}: refused, but not by {by}: {e}"),
        Ok(_) => panic!("{what}: allowed, but {by} must refuse it"),
    }
}

/// A node's identity writes only this driver's PVs pinned to its own node; the controller's
/// only this driver's PVs. Each refusal is the policy's, and its control (the same write of an
/// allowed PV) succeeds.
#[tokio::test]
async fn volumes_are_written_only_by_their_node_and_driver() {
    use controllers::test_objects::csi_volume;
    let env = env();
    let pp = PostParams::default();
    let admin = Api::<PersistentVolume>::all(env.client().await.expect("admin"));
    let node1 = volumes_as(env, Some("node-1")).await;
    // The policy takes a moment to hold after the manifests are applied.
    let on_node2 = csi_volume("policy-on-node-2", DRIVER, "h2", Some("node-2"));
    testenv::wait::until(
        "the volume policy to hold",
        std::time::Duration::from_secs(30),
        || async {
            match node1.create(&pp, &on_node2).await {
                Err(kube::Error::Api(s)) if s.code == 403 => Ok(()),
                Ok(_) => {
                    let _ = admin.delete("policy-on-node-2", &Default::default()).await;
                    Err("allowed".to_string())
                }
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await
    .expect("policy holds");
    refused_by(
        NODE_VOLUMES,
        "node-1 creating a PV of node-2",
        node1.create(&pp, &on_node2).await,
    );
    let other_driver = csi_volume(
        "policy-other-driver",
        "other.csi.example.com",
        "h3",
        Some("node-1"),
    );
    refused_by(
        NODE_VOLUMES,
        "node-1 creating another driver's PV",
        node1.create(&pp, &other_driver).await,
    );
    let unbound = volumes_as(env, None).await;
    let own = csi_volume("policy-on-node-1", DRIVER, "h1", Some("node-1"));
    refused_by(
        NODE_VOLUMES,
        "a token bound to no node",
        unbound.create(&pp, &own).await,
    );
    node1
        .create(&pp, &own)
        .await
        .expect("node-1 creates its own PV");
    // node-2 may not delete node-1's volume; node-1 may.
    let node2 = volumes_as(env, Some("node-2")).await;
    refused_by(
        NODE_VOLUMES,
        "node-2 deleting node-1's PV",
        node2.delete("policy-on-node-1", &Default::default()).await,
    );

    // The controller: patches this driver's PVs, not another's.
    let controller = Api::<PersistentVolume>::all(
        testenv::control_plane::client_from(
            env.service_account_kubeconfig("pmem-csi-intel-com-controller")
                .expect("controller ServiceAccount kubeconfig"),
            "controller",
        )
        .await
        .expect("client"),
    );
    admin
        .create(&pp, &other_driver)
        .await
        .expect("admin creates another driver's PV");
    let label =
        kube::api::Patch::Merge(serde_json::json!({"metadata": {"labels": {"touched": "yes"}}}));
    refused_by(
        CONTROLLER_VOLUMES,
        "the controller patching another driver's PV",
        controller
            .patch(
                "policy-other-driver",
                &kube::api::PatchParams::default(),
                &label,
            )
            .await,
    );
    controller
        .patch(
            "policy-on-node-1",
            &kube::api::PatchParams::default(),
            &label,
        )
        .await
        .expect("the controller patches this driver's PV");
    node1
        .delete("policy-on-node-1", &Default::default())
        .await
        .expect("node-1 deletes its own PV");
    admin
        .delete("policy-other-driver", &Default::default())
        .await
        .expect("admin deletes");
}
