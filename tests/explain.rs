//! `pmem-csi explain` against testenv: two nodes running the emulated driver (1 GiB each, one
//! pool), node-3 without the driver, the extender beside the real kube-scheduler, the real
//! external-provisioner and the simulated kubelet. Each Pending cause is made for real and
//! explained from what the cluster and the extender show; the transcript test runs the binary,
//! once as a kubectl plugin.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use controllers::test_objects;
use explain::explanation::{Explanation, Finding, VolumeState};
use explain::options::{ExplainConfig, ExtenderAccess, Output};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::Api;
use kube::api::PostParams;
use testenv::wait::until;
use testenv::{NodeSpec, TestEnv, TestEnvBuilder};

const DRIVER: &str = "pmem-csi.intel.com";
const CLASS: &str = "pmem-explain";
/// A class whose parameter the driver refuses: CreateVolume fails, the claim gets
/// ProvisioningFailed events.
const KATA_CLASS: &str = "pmem-explain-kata";
const WAIT: Duration = Duration::from_secs(90);

fn builder() -> TestEnvBuilder {
    TestEnv::builder()
        .nodes(2)
        .node(NodeSpec::driverless("node-3"))
        .drivers(testenv::node_processes::DriverOptions::default())
        .extender(["--reschedule-grace=0s"])
        .kubelet()
}

/// The shared testenv, its client, and the classes and the unpublished node-4 (labelled and
/// registered for the driver, but no driver process publishes for it).
async fn cluster() -> (&'static TestEnv, kube::Client) {
    let env = TestEnv::shared(builder);
    let client = env.client().await.expect("client");
    let classes = Api::<StorageClass>::all(client.clone());
    let mut kata = test_objects::storage_class(KATA_CLASS, DRIVER, "WaitForFirstConsumer");
    kata.parameters = Some(BTreeMap::from([(
        "kataContainers".to_string(),
        "true".to_string(),
    )]));
    for class in [
        test_objects::storage_class(CLASS, DRIVER, "WaitForFirstConsumer"),
        kata,
    ] {
        testenv::api_calls::apply(&classes, &class)
            .await
            .expect("class");
    }
    // Once per testenv: the tests share it.
    let nodes = Api::<k8s_openapi::api::core::v1::Node>::all(client.clone());
    if nodes.get_opt("node-4").await.expect("node-4").is_none() {
        NodeSpec::custom("node-4", true, true)
            .create(&client, DRIVER)
            .await
            .expect("node-4");
        // As a driver that has just started: its heartbeat is fresh, nothing published yet.
        let mut lease = k8s_openapi::api::coordination::v1::Lease::default();
        lease.metadata.name = Some(controllers::well_known::heartbeat_lease_name(
            DRIVER, "node-4",
        ));
        lease.spec = Some(k8s_openapi::api::coordination::v1::LeaseSpec {
            holder_identity: Some("node-4".into()),
            lease_duration_seconds: Some(3600),
            renew_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                k8s_openapi::jiff::Timestamp::now(),
            )),
            ..Default::default()
        });
        Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), "pmem-csi")
            .create(&PostParams::default(), &lease)
            .await
            .expect("node-4's heartbeat");
        // A node whose driver never renewed a heartbeat (crash-looping, or not installed).
        NodeSpec::custom("node-5", true, true)
            .create(&client, DRIVER)
            .await
            .expect("node-5");
    }
    // Both running nodes publish for our class before any case starts.
    until("node-1 and node-2 to publish", WAIT, || async {
        let published = Api::<k8s_openapi::api::storage::v1::CSIStorageCapacity>::namespaced(
            client.clone(),
            "pmem-csi",
        )
        .list(&Default::default())
        .await
        .map_err(|e| e.to_string())?
        .items
        .iter()
        .filter(|c| c.storage_class_name == CLASS)
        .count();
        (published >= 2)
            .then_some(())
            .ok_or(format!("{published} objects"))
    })
    .await
    .expect("published");
    (env, client)
}

fn config(env: &TestEnv, pod: &str) -> ExplainConfig {
    let (_, admin) = env.extender_addresses().expect("extender");
    ExplainConfig {
        pod: pod.into(),
        namespace: None,
        output: Output::Text,
        extender: ExtenderAccess::Url(format!("http://{admin}")),
        driver: DRIVER.into(),
        driver_namespace: "pmem-csi".into(),
        node_selector: controllers::node_selector::NodeSelector::parse("storage=pmem")
            .expect("selector"),
        heartbeat_grace: Some(Duration::from_secs(60)),
        default_volume_size: 1 << 30,
    }
}

async fn explain_pod(env: &TestEnv, client: &kube::Client, ns: &str, pod: &str) -> Explanation {
    let facts = explain::gather::gather(client, &config(env, pod), ns, pod)
        .await
        .expect("gather");
    explain::explain(&facts)
}

/// Creates claims `(name, class, size)` and a pod using them, routed through the extender.
async fn create(client: &kube::Client, ns: &str, pod: &str, claims: &[(&str, &str, &str)]) {
    let objects = claims
        .iter()
        .map(|(name, class, size)| test_objects::claim(ns, name, class, size))
        .collect();
    create_with(client, ns, pod, objects).await;
}

/// Creates `claims` and a pod using them (each as a volume named after it), routed through the
/// extender.
async fn create_with(
    client: &kube::Client,
    ns: &str,
    pod: &str,
    claims: Vec<PersistentVolumeClaim>,
) {
    let api = Api::<PersistentVolumeClaim>::namespaced(client.clone(), ns);
    let mut volumes = Vec::new();
    for claim in claims {
        let name = claim.metadata.name.clone().unwrap_or_default();
        api.create(&PostParams::default(), &claim)
            .await
            .expect("claim");
        volumes.push(test_objects::claim_volume(&name, &name));
    }
    let object = test_objects::with_scheduler_resource(test_objects::pod(ns, pod, volumes), DRIVER);
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &object)
        .await
        .expect("pod");
}

/// Explains `pod` until `check` accepts the explanation (the scheduler, the provisioner and the
/// kubelet act in their own time); returns it.
async fn explained_until(
    env: &TestEnv,
    client: &kube::Client,
    ns: &str,
    pod: &str,
    what: &str,
    check: impl Fn(&Explanation) -> bool,
) -> Explanation {
    until(what, WAIT, || async {
        let e = explain_pod(env, client, ns, pod).await;
        if check(&e) {
            Ok(e)
        } else {
            Err(explain::render::render(&e))
        }
    })
    .await
    .unwrap_or_else(|timeout| panic!("{what}: {timeout:?}"))
}

fn has(e: &Explanation, pred: impl Fn(&Finding) -> bool) -> bool {
    e.findings.iter().any(pred)
}

#[tokio::test]
async fn pending_causes_and_a_running_pod() {
    let (env, client) = cluster().await;
    let ns = testenv::test_namespace(&client, "explain")
        .await
        .expect("namespace");

    // (1) No node with room: 2 GiB on nodes of 1 GiB.
    create(&client, &ns, "big", &[("big", CLASS, "2Gi")]).await;
    let e = explained_until(env, &client, &ns, "big", "no node with room", |e| {
        has(
            e,
            |f| matches!(f, Finding::NoNodeWithRoom { volumes, .. } if volumes == &["big"]),
        )
    })
    .await;
    assert_eq!(e.extender.status, "answered");
    let node1 = e.nodes.iter().find(|n| n.node == "node-1").expect("node-1");
    assert_eq!(node1.alone.first().map(|a| a.fits), Some(false));
    assert!(
        node1
            .extender
            .as_ref()
            .and_then(|x| x.reason.clone())
            .as_deref()
            == Some("insufficient PMEM for 1 volume (2.0GiB)"),
        "{node1:?}"
    );

    // (2) Each claim alone fits a node, together they do not.
    create(
        &client,
        &ns,
        "pair",
        &[("pair-a", CLASS, "600Mi"), ("pair-b", CLASS, "600Mi")],
    )
    .await;
    let e = explained_until(env, &client, &ns, "pair", "do not fit together", |e| {
        has(e, |f| {
            matches!(f, Finding::DoNotFitTogether { volumes: 2, .. })
        })
    })
    .await;
    assert!(!has(&e, |f| matches!(f, Finding::NoNodeWithRoom { .. })));
    let node2 = e.nodes.iter().find(|n| n.node == "node-2").expect("node-2");
    assert_eq!(
        (node2.alone.iter().all(|a| a.fits), node2.fits_together),
        (true, Some(false))
    );

    // (3) A claim whose selected node has no driver: not meant for it, or its heartbeat is not
    // renewed.
    for (node, reason) in [
        ("node-3", "not-selected-no-csinode-entry"),
        ("node-5", "heartbeat-expired"),
    ] {
        let claim = format!("on-{node}");
        let selected =
            test_objects::selected_for(test_objects::claim(&ns, &claim, CLASS, "100Mi"), node);
        create_with(&client, &ns, &claim, vec![selected]).await;
        let e = explain_pod(env, &client, &ns, &claim).await;
        assert!(
            has(
                &e,
                |f| matches!(f, Finding::SelectedNodeWithoutDriver { node: n, reason: r, .. }
                if n == node && r == reason)
            ),
            "{e:#?}"
        );
    }

    // (4) A node meant for the driver that has not published: node-4 is labelled and
    // registered, but no driver process publishes for it.
    let e = explain_pod(env, &client, &ns, "big").await;
    assert!(
        has(
            &e,
            |f| matches!(f, Finding::NoCapacityObject { class, nodes }
            if class == CLASS && nodes == &["node-4"])
        ),
        "{:?}",
        e.findings
    );

    // (5) A provisioning error: the driver refuses the class's parameter.
    create(&client, &ns, "kata", &[("kata", KATA_CLASS, "100Mi")]).await;
    let e = explained_until(env, &client, &ns, "kata", "provisioning error", |e| {
        has(e, |f| {
            matches!(f, Finding::WaitingForProvisioning { last_error: Some(m), .. }
            if m.contains("Kata Containers volumes are not supported"))
        })
    })
    .await;
    assert_eq!(e.volumes[0].state, VolumeState::Provisioning);

    // A reservation the extender holds: a pod no scheduler picks up, filtered as kube-scheduler
    // would filter it (reserve-all: held on every node where it fits).
    let (route, _) = env.extender_addresses().expect("extender");
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &test_objects::claim(&ns, "held", CLASS, "100Mi"),
        )
        .await
        .expect("claim");
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    let mut held = test_objects::with_scheduler_resource(
        test_objects::pod(
            &ns,
            "held-pod",
            vec![test_objects::claim_volume("held", "held")],
        ),
        DRIVER,
    );
    if let Some(spec) = held.spec.as_mut() {
        spec.scheduler_name = Some("nobody".into());
    }
    let held = pods
        .create(&PostParams::default(), &held)
        .await
        .expect("pod");
    let body = serde_json::json!({ "Pod": held, "NodeNames": ["node-1", "node-2"] }).to_string();
    until("the extender to reserve", WAIT, || async {
        let reply = testenv::http_client::http(route, "POST", "/filter", body.as_bytes()).await?;
        (reply.status == 200 && reply.body.contains("node-1") && reply.body.contains("node-2"))
            .then_some(())
            .ok_or(reply.body)
    })
    .await
    .expect("reserved");
    let e = explain_pod(env, &client, &ns, "held-pod").await;
    let reserved: Vec<(&str, u64)> = e
        .extender
        .reserved
        .iter()
        .map(|r| (r.node.as_str(), r.bytes))
        .collect();
    assert_eq!(reserved, [("node-1", 100 << 20), ("node-2", 100 << 20)]);
    let text = explain::render::render(&e);
    assert!(
        text.contains("it holds a reservation for this pod")
            && text.contains("100.0MiB on node-1, 100.0MiB on node-2"),
        "{text}"
    );
    pods.delete("held-pod", &Default::default())
        .await
        .expect("delete");

    // A Running pod: where its volume is.
    create(&client, &ns, "runs", &[("runs", CLASS, "100Mi")]).await;
    let e = explained_until(env, &client, &ns, "runs", "Running", |e| {
        e.phase == "Running"
    })
    .await;
    let v = &e.volumes[0];
    assert_eq!(v.state, VolumeState::Bound);
    assert_eq!(v.node, e.node, "the volume is on the pod's node");
    assert!(
        v.pv.is_some() && v.capacity.is_some_and(|c| c >= 100 << 20),
        "{v:?}"
    );
    assert!(e.findings.is_empty(), "{:?}", e.findings);
}

/// Runs `program args…` with the admin kubeconfig; returns stdout, failing on a non-zero exit.
fn run(env: &TestEnv, program: &Path, args: &[&str], path: Option<&Path>) -> String {
    let mut command = std::process::Command::new(program);
    command.args(args).env("KUBECONFIG", env.admin_kubeconfig());
    if let Some(dir) = path {
        let old = std::env::var_os("PATH").unwrap_or_default();
        let mut paths = vec![dir.to_path_buf()];
        paths.extend(std::env::split_paths(&old));
        command.env("PATH", std::env::join_paths(paths).expect("PATH"));
    }
    let output = command.output().expect("runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{program:?} {args:?}: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test]
async fn transcript_of_the_binary_and_the_kubectl_plugin() {
    let (env, client) = cluster().await;
    let ns = testenv::test_namespace(&client, "explain-cli")
        .await
        .expect("namespace");
    create(&client, &ns, "big", &[("big", CLASS, "2Gi")]).await;
    create(&client, &ns, "runs", &[("runs", CLASS, "100Mi")]).await;
    // The scheduler has judged `big` and the kubelet started `runs`.
    explained_until(env, &client, &ns, "big", "big judged", |e| {
        e.scheduler_message.is_some()
    })
    .await;
    explained_until(env, &client, &ns, "runs", "runs Running", |e| {
        e.phase == "Running"
    })
    .await;

    let (_, admin) = env.extender_addresses().expect("extender");
    let extender = format!("http://{admin}");
    let binary = Path::new(env!("CARGO_BIN_EXE_pmem-csi"));
    let bin_dir = env.dir().join("explain-bin");
    std::fs::create_dir_all(&bin_dir).expect("bin dir");
    let plugin = bin_dir.join("kubectl-pmem_csi");
    if !plugin.exists() {
        std::os::unix::fs::symlink(binary, &plugin).expect("symlink");
    }
    let kubectl = env.tools().go("kubectl");
    let mut transcript = String::new();
    let mut record = |command: String, output: &str| {
        let normalised = output
            .replace(&ns, "NS")
            .replace(&admin.to_string(), "EXTENDER");
        transcript.push_str(&format!(
            "$ {}\n{normalised}\n",
            command
                .replace(&ns, "NS")
                .replace(&admin.to_string(), "EXTENDER")
        ));
        normalised
    };

    let args = ["explain", "pod/big", "-n", &ns, "--extender", &extender];
    let big = record(
        format!("pmem-csi {}", args.join(" ")),
        &run(env, binary, &args, None),
    );
    assert!(
        big.starts_with("Pod NS/big is Pending: no node has been chosen for it."),
        "{big}"
    );
    assert!(
        big.contains("no node has room: volume big (2.0GiB) fits on no node where the driver runs; the largest free pool is"),
        "{big}"
    );
    assert!(
        big.contains("node node-4 has not published capacity for StorageClass pmem-explain yet."),
        "{big}"
    );
    assert!(
        big.contains("extender: insufficient PMEM for 1 volume (2.0GiB)"),
        "{big}"
    );
    assert!(big.contains("The scheduler says:"), "{big}");

    // Through kubectl, which finds the plugin on PATH; the extender through the apiserver's pod
    // proxy finds no extender pod in testenv (it runs as a process), which it says.
    let args = ["pmem-csi", "explain", "pod/runs", "-n", &ns];
    let runs = record(
        format!("kubectl {}", args.join(" ")),
        &run(env, &kubectl, &args, Some(&bin_dir)),
    );
    assert!(
        runs.starts_with("Pod NS/runs is Running on node node-"),
        "{runs}"
    );
    assert!(
        runs.contains("runs: claim NS/runs, class pmem-explain, 100.0MiB, bound to PV pvc-"),
        "{runs}"
    );
    assert!(runs.contains("Extender: not installed"), "{runs}");
    assert_eq!(
        runs.lines().filter(|l| l.starts_with("  node-")).count(),
        1,
        "only the pod's node: {runs}"
    );

    let args = [
        "explain",
        "pod/big",
        "-n",
        &ns,
        "--extender",
        &extender,
        "-o",
        "json",
    ];
    let json = record(
        format!("pmem-csi {}", args.join(" ")),
        &run(env, binary, &args, None),
    );
    let value: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(value["pod"], "NS/big");
    assert_eq!(value["phase"], "Pending");
    assert_eq!(value["extender"]["status"], "answered");
    assert_eq!(value["volumes"][0]["state"], "unscheduled");
    let kinds: Vec<&str> = value["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .filter_map(|f| f["kind"].as_str())
        .collect();
    assert!(kinds.contains(&"no_node_with_room"), "{kinds:?}");
    let parsed: Explanation = serde_json::from_value(value).expect("the documented schema");
    assert!(
        parsed
            .nodes
            .iter()
            .any(|n| n.node == "node-1" && n.extender.is_some())
    );

    // The route names a bad parameter.
    let reply = testenv::http_client::http(admin, "GET", &format!("/explain?namespace={ns}"), b"")
        .await
        .expect("answer");
    assert_eq!(
        (reply.status, reply.body.trim()),
        (400, "query parameter \"pod\" is required")
    );

    let file = env.dir().join("explain-transcript.txt");
    std::fs::write(&file, &transcript).expect("transcript");
    println!("transcript in {}:\n{transcript}", file.display());
}

/// The RBAC block of docs/explain.md, as objects.
fn documented_rbac() -> (
    k8s_openapi::api::rbac::v1::ClusterRole,
    k8s_openapi::api::rbac::v1::Role,
) {
    let doc = std::fs::read_to_string(testenv::tools::repo_root().join("docs/explain.md"))
        .expect("docs/explain.md");
    let block = doc
        .split("<!-- explain-rbac:begin -->")
        .nth(1)
        .and_then(|rest| rest.split("<!-- explain-rbac:end -->").next())
        .expect("the RBAC block");
    let yaml = block
        .trim()
        .trim_start_matches("```yaml")
        .trim_end_matches("```");
    let mut cluster_role = None;
    let mut role = None;
    for part in yaml.split("\n---\n") {
        let value: serde_yaml::Value = serde_yaml::from_str(part).expect("YAML");
        match value["kind"].as_str() {
            Some("ClusterRole") => cluster_role = serde_yaml::from_value(value).ok(),
            Some("Role") => role = serde_yaml::from_value(value).ok(),
            other => panic!("unexpected {other:?} in the RBAC block"),
        }
    }
    (cluster_role.expect("a ClusterRole"), role.expect("a Role"))
}

/// A client of the apiserver authenticated as ServiceAccount `name` of `ns` (created here).
async fn service_account_client(
    env: &TestEnv,
    client: &kube::Client,
    ns: &str,
    name: &str,
) -> kube::Client {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::ServiceAccount;
    let accounts = Api::<ServiceAccount>::namespaced(client.clone(), ns);
    let mut account = ServiceAccount::default();
    account.metadata.name = Some(name.into());
    accounts
        .create(&PostParams::default(), &account)
        .await
        .expect("ServiceAccount");
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    let token = accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .expect("token")
        .status
        .and_then(|s| s.token)
        .expect("a token");
    let kubeconfig =
        kube::config::Kubeconfig::read_from(env.admin_kubeconfig()).expect("kubeconfig");
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("config");
    config.auth_info = kube::config::AuthInfo {
        token: Some(token.into()),
        ..Default::default()
    };
    kube::Client::try_from(config).expect("client")
}

#[tokio::test]
async fn the_documented_role_suffices_and_is_needed() {
    use k8s_openapi::api::rbac::v1::{
        ClusterRole, ClusterRoleBinding, Role, RoleBinding, RoleRef, Subject,
    };
    let (env, client) = cluster().await;
    let ns = testenv::test_namespace(&client, "explain-rbac")
        .await
        .expect("namespace");
    create(&client, &ns, "big", &[("big", CLASS, "2Gi")]).await;
    let restricted = service_account_client(env, &client, &ns, "explainer").await;
    let mut through_proxy = config(env, "big");
    through_proxy.extender = ExtenderAccess::PodProxy;

    let refused = explain::gather::gather(&restricted, &through_proxy, &ns, "big")
        .await
        .expect_err("no role bound yet");
    assert!(
        refused
            .to_string()
            .starts_with(&format!("reading pod {ns}/big: ")),
        "{refused}"
    );

    let (cluster_role, role) = documented_rbac();
    let subject = Subject {
        kind: "ServiceAccount".into(),
        name: "explainer".into(),
        namespace: Some(ns.clone()),
        ..Default::default()
    };
    let mut binding = ClusterRoleBinding {
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: cluster_role.metadata.name.clone().unwrap_or_default(),
        },
        subjects: Some(vec![subject.clone()]),
        ..Default::default()
    };
    binding.metadata.name = Some(format!("explain-{ns}"));
    let mut role_binding = RoleBinding {
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: role.metadata.name.clone().unwrap_or_default(),
        },
        subjects: Some(vec![subject]),
        ..Default::default()
    };
    role_binding.metadata.name = Some(format!("explain-{ns}"));
    role_binding.metadata.namespace = Some("pmem-csi".into());
    testenv::api_calls::apply(&Api::<ClusterRole>::all(client.clone()), &cluster_role)
        .await
        .expect("ClusterRole");
    testenv::api_calls::apply(&Api::<Role>::namespaced(client.clone(), "pmem-csi"), &role)
        .await
        .expect("Role");
    testenv::api_calls::apply(&Api::<ClusterRoleBinding>::all(client.clone()), &binding)
        .await
        .expect("ClusterRoleBinding");
    testenv::api_calls::apply(
        &Api::<RoleBinding>::namespaced(client.clone(), "pmem-csi"),
        &role_binding,
    )
    .await
    .expect("RoleBinding");

    // RBAC takes effect when the authorizer's informers see it.
    let facts = until("the documented role to take effect", WAIT, || async {
        explain::gather::gather(&restricted, &through_proxy, &ns, "big")
            .await
            .map_err(|e| e.to_string())
    })
    .await
    .expect("explains with the documented role");
    let e = explain::explain(&facts);
    assert_eq!(e.extender.status, "not_installed", "{:?}", e.extender);
    assert!(
        has(&e, |f| matches!(f, Finding::NoNodeWithRoom { .. })),
        "{:?}",
        e.findings
    );
}
