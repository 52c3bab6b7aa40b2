//! The scheduler extender beside a real kube-scheduler, configured from
//! `manifests/scheduler/`. The tests play the nodes' capacity publishers (they write the
//! CSIStorageCapacity objects a node would) so that every budget is exact; provisioning is not
//! involved: what is asserted is where kube-scheduler places pods and which claims it selects a
//! node for.

use std::collections::BTreeMap;
use std::time::Duration;

use controllers::test_objects;
use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity, NodeSelectorRequirement, NodeSelectorTerm, PersistentVolumeClaim, Pod,
    PreferredSchedulingTerm, ResourceRequirements,
};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::api::storage::v1::CSIStorageCapacity;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::Api;
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use rustix::process::Signal;
use testenv::wait::until;
use testenv::{NodeSpec, TestEnv};
use testenv::{api_calls, metrics};

const DRIVER: &str = "pmem-csi.intel.com";
const CLASS: &str = "pmem-extender";
const GI: u64 = 1 << 30;
const WAIT: Duration = Duration::from_secs(60);

/// Three nodes running the driver and node-4 without it; the extender with `args`.
async fn start(args: &[&str]) -> (TestEnv, kube::Client) {
    let env = TestEnv::builder()
        .nodes(3)
        .node(NodeSpec::driverless("node-4"))
        .extender(
            // No grace: a pod failing once is not retried until the cluster changes, so the
            // first filter must already see node-4 as driverless.
            ["--reschedule-grace=0s"]
                .iter()
                .chain(args)
                .map(|s| s.to_string()),
        )
        .start()
        .await
        .expect("testenv");
    let client = env.client().await.expect("client");
    api_calls::create_storage_class(&client, CLASS, DRIVER, "WaitForFirstConsumer")
        .await
        .expect("class");
    let (_, admin) = env.extender_addresses().expect("extender");
    until("the extender to be ready", WAIT, || async {
        let text = metrics::scrape_metrics(admin.port()).await;
        (!text.is_empty())
            .then_some(())
            .ok_or("no metrics yet".to_string())
    })
    .await
    .expect("extender up");
    (env, client)
}

/// Publishes `pools` (free bytes per pool) for each node, like the nodes' publishers of nodes
/// with nothing allocated (the extender reads `managed − Σ free` as what the node allocated).
async fn publish(client: &kube::Client, budgets: &[(&str, &[u64])]) {
    let api = Api::<CSIStorageCapacity>::namespaced(client.clone(), "pmem-csi");
    for (node, pools) in budgets {
        let managed = pools.iter().sum();
        api_calls::apply(
            &api,
            &test_objects::published_capacity("pmem-csi", DRIVER, node, CLASS, pools, managed),
        )
        .await
        .expect("capacity");
    }
}

fn pod_with_claims(namespace: &str, name: &str, claims: &[&str]) -> Pod {
    let volumes = claims
        .iter()
        .map(|c| test_objects::claim_volume(c, c))
        .collect();
    test_objects::with_scheduler_resource(test_objects::pod(namespace, name, volumes), DRIVER)
}

fn inline_pod(namespace: &str, name: &str, size: &str) -> Pod {
    test_objects::with_scheduler_resource(
        test_objects::pod_with_inline_volume(namespace, name, DRIVER, size),
        DRIVER,
    )
}

async fn create_claims(client: &kube::Client, namespace: &str, claims: &[(&str, &str)]) {
    let api = Api::<PersistentVolumeClaim>::namespaced(client.clone(), namespace);
    for (name, size) in claims {
        api.create(
            &PostParams::default(),
            &test_objects::claim(namespace, name, CLASS, size),
        )
        .await
        .expect("claim");
    }
}

async fn create_pod(client: &kube::Client, pod: &Pod) {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    Api::<Pod>::namespaced(client.clone(), &namespace)
        .create(&PostParams::default(), pod)
        .await
        .expect("pod");
}

async fn node_of(client: &kube::Client, namespace: &str, pod: &str) -> Option<String> {
    Api::<Pod>::namespaced(client.clone(), namespace)
        .get(pod)
        .await
        .ok()?
        .spec?
        .node_name
}

/// Waits until pod `name` is bound and returns its node.
async fn wait_bound(client: &kube::Client, namespace: &str, name: &str) -> String {
    until(&format!("pod {name} to be bound"), WAIT, || async {
        node_of(client, namespace, name)
            .await
            .ok_or("not bound".to_string())
    })
    .await
    .expect("bound")
}

/// Waits until a FailedScheduling event of pod `name` contains `text`; returns the message.
/// On timeout the extender's log tail is part of the failure.
async fn wait_failed(
    env: &TestEnv,
    client: &kube::Client,
    namespace: &str,
    name: &str,
    text: &str,
) -> String {
    let found = until(
        &format!("pod {name} to fail with {text:?}"),
        WAIT,
        || async {
            let messages = api_calls::failed_scheduling(client, namespace, name)
                .await
                .map_err(|e| e.to_string())?;
            messages
                .iter()
                .find(|m| m.contains(text))
                .cloned()
                .ok_or(format!("events so far: {messages:?}"))
        },
    )
    .await;
    match found {
        Ok(m) => m,
        Err(e) => panic!(
            "{e:?}\n{}",
            testenv::process::tail(&env.dir().join("logs/extender.log"), 60)
        ),
    }
}

async fn selected(client: &kube::Client, namespace: &str, claims: &[&str]) -> Vec<Option<String>> {
    let api = Api::<PersistentVolumeClaim>::namespaced(client.clone(), namespace);
    let mut out = Vec::new();
    for claim in claims {
        out.push(api_calls::selected_node(&api, claim).await);
    }
    out
}

async fn extender_metric(env: &TestEnv, prefix: &str) -> u64 {
    let (_, admin) = env.extender_addresses().expect("extender");
    metric(admin, prefix).await
}

/// Deletes the namespace's pods and claims and waits until they are gone, so that the next
/// scenario starts from free nodes.
async fn clean(client: &kube::Client, namespace: &str) {
    let pods = Api::<Pod>::namespaced(client.clone(), namespace);
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), namespace);
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    pods.delete_collection(&now, &Default::default())
        .await
        .expect("delete pods");
    claims
        .delete_collection(&now, &Default::default())
        .await
        .expect("delete claims");
    until("pods and claims to be gone", WAIT, || async {
        let p = pods
            .list(&Default::default())
            .await
            .map_err(|e| e.to_string())?;
        let c = claims
            .list(&Default::default())
            .await
            .map_err(|e| e.to_string())?;
        (p.items.is_empty() && c.items.is_empty())
            .then_some(())
            .ok_or(format!(
                "{} pods, {} claims left",
                p.items.len(),
                c.items.len()
            ))
    })
    .await
    .expect("clean");
}

/// Two pods in one burst, each needing 60 % of node-3, the only node with room: exactly one
/// claim gets node-3, the other pod fails with our reason. `reps` times.
async fn race(env: &TestEnv, client: &kube::Client, reps: usize) {
    publish(
        client,
        &[("node-1", &[0]), ("node-2", &[0]), ("node-3", &[10 * GI])],
    )
    .await;
    for rep in 0..reps {
        let ns = testenv::test_namespace(client, &format!("race-{rep}"))
            .await
            .expect("namespace");
        create_claims(client, &ns, &[("a", "6Gi"), ("b", "6Gi")]).await;
        let pods = [
            pod_with_claims(&ns, "pod-a", &["a"]),
            pod_with_claims(&ns, "pod-b", &["b"]),
        ];
        futures::future::join_all(pods.iter().map(|p| create_pod(client, p))).await;
        let (winner, loser) = until("one claim to get node-3", WAIT, || async {
            match selected(client, &ns, &["a", "b"]).await.as_slice() {
                [Some(n), None] if n == "node-3" => Ok(("pod-a", "pod-b")),
                [None, Some(n)] if n == "node-3" => Ok(("pod-b", "pod-a")),
                other => Err(format!("selected: {other:?}")),
            }
        })
        .await
        .expect("one selected");
        let message = wait_failed(
            env,
            client,
            &ns,
            loser,
            "insufficient PMEM for 1 volume (6.0GiB)",
        )
        .await;
        assert!(!message.contains(winner), "{message}");
        let both = selected(client, &ns, &["a", "b"]).await;
        assert_eq!(
            both.iter().filter(|s| s.is_some()).count(),
            1,
            "rep {rep}: exactly one claim may be selected: {both:?}"
        );
        clean(client, &ns).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_all() {
    let (env, client) = start(&[]).await;
    let ns = testenv::test_namespace(&client, "extender")
        .await
        .expect("namespace");

    // Two 2 GiB volumes: node-1 has 4 GiB but in pools of 3 and 1, node-2 one pool of 3 GiB
    // (enough for each volume, which is all kube-scheduler checks), node-3 one of 4 GiB.
    publish(
        &client,
        &[
            ("node-1", &[3 * GI, GI]),
            ("node-2", &[3 * GI]),
            ("node-3", &[4 * GI]),
        ],
    )
    .await;
    create_claims(&client, &ns, &[("x", "2Gi"), ("y", "2Gi")]).await;
    create_pod(&client, &pod_with_claims(&ns, "together", &["x", "y"])).await;
    until("both claims to get node-3", WAIT, || async {
        let s = selected(&client, &ns, &["x", "y"]).await;
        (s == [Some("node-3".to_string()), Some("node-3".to_string())])
            .then_some(())
            .ok_or(format!("{s:?}"))
    })
    .await
    .expect("joint fit");
    clean(&client, &ns).await;

    // Fits nowhere: the driverless node fails as such, the others with the stable reason.
    create_pod(&client, &inline_pod(&ns, "huge", "100Gi")).await;
    let message = wait_failed(&env, &client, &ns, "huge", "PMEM driver not running").await;
    assert!(
        message.contains("insufficient PMEM for 1 volume (100.0GiB)"),
        "{message}\n{}",
        testenv::process::tail(&env.dir().join("logs/extender.log"), 40)
    );
    assert!(
        extender_metric(
            &env,
            "pmem_csi_extender_node_rejections_total{reason=\"PMEM driver not running\"}"
        )
        .await
            >= 1
    );
    clean(&client, &ns).await;

    // Preferred node affinity wins where several nodes fit: reserve-all leaves the choice to
    // the scheduler.
    publish(
        &client,
        &[
            ("node-1", &[4 * GI]),
            ("node-2", &[4 * GI]),
            ("node-3", &[8 * GI]),
        ],
    )
    .await;
    let mut pod = inline_pod(&ns, "prefers-node-2", "1Gi");
    if let Some(spec) = pod.spec.as_mut() {
        spec.affinity = Some(Affinity {
            node_affinity: Some(NodeAffinity {
                preferred_during_scheduling_ignored_during_execution: Some(vec![
                    PreferredSchedulingTerm {
                        weight: 100,
                        preference: NodeSelectorTerm {
                            match_expressions: Some(vec![NodeSelectorRequirement {
                                key: "kubernetes.io/hostname".into(),
                                operator: "In".into(),
                                values: Some(vec!["node-2".into()]),
                            }]),
                            ..Default::default()
                        },
                    },
                ]),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    create_pod(&client, &pod).await;
    assert_eq!(wait_bound(&client, &ns, "prefers-node-2").await, "node-2");
    clean(&client, &ns).await;

    // An inline volume counts on its node as soon as the pod is bound, before any publish.
    publish(
        &client,
        &[("node-1", &[0]), ("node-2", &[0]), ("node-3", &[4 * GI])],
    )
    .await;
    create_pod(&client, &inline_pod(&ns, "first", "3Gi")).await;
    assert_eq!(wait_bound(&client, &ns, "first").await, "node-3");
    create_pod(&client, &inline_pod(&ns, "second", "2Gi")).await;
    wait_failed(
        &env,
        &client,
        &ns,
        "second",
        "insufficient PMEM for 1 volume (2.0GiB)",
    )
    .await;
    assert_eq!(node_of(&client, &ns, "second").await, None);
    clean(&client, &ns).await;

    // A high-priority PMEM pod does not preempt pods of a node without PMEM: node-4 is full of
    // CPU, which preemption could free, but the pod's volume cannot be placed there anyway.
    let priorities = Api::<PriorityClass>::all(client.clone());
    priorities
        .create(
            &PostParams::default(),
            &PriorityClass {
                metadata: ObjectMeta {
                    name: Some("extender-high".into()),
                    ..Default::default()
                },
                value: Some(1_000_000),
                ..Default::default()
            },
        )
        .await
        .expect("priority class");
    let mut low = test_objects::pod_with_claim(&ns, "low", "unused");
    if let Some(spec) = low.spec.as_mut() {
        spec.volumes = None;
        spec.node_name = Some("node-4".into());
        spec.containers[0].resources = Some(cpu("8"));
    }
    create_pod(&client, &low).await;
    let preempts_before =
        extender_metric(&env, "pmem_csi_extender_requests_total{route=\"preempt\"").await;
    let mut high = inline_pod(&ns, "high", "100Gi");
    if let Some(spec) = high.spec.as_mut() {
        spec.priority_class_name = Some("extender-high".into());
        let resources = spec.containers[0]
            .resources
            .get_or_insert_with(Default::default);
        resources
            .requests
            .get_or_insert_with(Default::default)
            .insert("cpu".into(), Quantity("1".into()));
    }
    create_pod(&client, &high).await;
    until(
        "the extender to be asked about preemption",
        WAIT,
        || async {
            let n =
                extender_metric(&env, "pmem_csi_extender_requests_total{route=\"preempt\"").await;
            (n > preempts_before)
                .then_some(())
                .ok_or(format!("{n} preempt calls"))
        },
    )
    .await
    .expect("preempt called");
    wait_failed(&env, &client, &ns, "high", "insufficient PMEM").await;
    let low_now = Api::<Pod>::namespaced(client.clone(), &ns)
        .get("low")
        .await
        .expect("the low-priority pod survives");
    assert!(low_now.metadata.deletion_timestamp.is_none());
    let high_now = Api::<Pod>::namespaced(client.clone(), &ns)
        .get("high")
        .await
        .expect("high");
    assert_eq!(
        high_now.status.and_then(|s| s.nominated_node_name),
        None,
        "no node may be nominated for preemption"
    );
    clean(&client, &ns).await;
    priorities
        .delete("extender-high", &Default::default())
        .await
        .expect("delete priority class");

    race(&env, &client, 20).await;
    assert!(extender_metric(&env, "pmem_csi_reservations_total{event=\"reserved\"}").await >= 20);
    assert_eq!(
        extender_metric(&env, "pmem_csi_reservations_total{event=\"expired\"}").await,
        0
    );
    let leftovers = env.stop().await;
    assert_eq!(
        leftovers.wait_clean(Duration::from_secs(10)).await,
        Vec::<String>::new()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pin() {
    let (env, client) = start(&["--placement=pin"]).await;
    race(&env, &client, 20).await;
    // Pin returns one node even where several fit: the most free one by default.
    publish(
        &client,
        &[
            ("node-1", &[4 * GI]),
            ("node-2", &[8 * GI]),
            ("node-3", &[2 * GI]),
        ],
    )
    .await;
    let ns = testenv::test_namespace(&client, "pin")
        .await
        .expect("namespace");
    create_pod(&client, &inline_pod(&ns, "most-free", "1Gi")).await;
    assert_eq!(wait_bound(&client, &ns, "most-free").await, "node-2");
    let leftovers = env.stop().await;
    assert_eq!(
        leftovers.wait_clean(Duration::from_secs(10)).await,
        Vec::<String>::new()
    );
}

/// Every recorded bad body of every route gets a 4xx with a message; fixed-seed mutations of
/// the good bodies get 200 or a 4xx, never a 5xx or a dropped connection; the extender stays
/// healthy.
async fn bad_input(env: &TestEnv) {
    let (route, _) = env.extender_addresses().expect("extender");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/extender");
    for path in ["filter", "prioritize", "preempt"] {
        let mut cases = 0;
        for entry in std::fs::read_dir(root.join("bad").join(path)).expect("bad cases") {
            let file = entry.expect("entry").path();
            let body = std::fs::read(&file).expect("read");
            let reply = testenv::http_client::http(route, "POST", &format!("/{path}"), &body)
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            assert!(
                (400..500).contains(&reply.status) && !reply.body.trim().is_empty(),
                "{}: {} {:?}",
                file.display(),
                reply.status,
                reply.body
            );
            cases += 1;
        }
        assert!(cases >= 50, "{path}: {cases} cases");
        let over_limit = vec![b' '; (64 << 20) + 1];
        let reply = testenv::http_client::http(route, "POST", &format!("/{path}"), &over_limit)
            .await
            .expect("over-limit body");
        assert_eq!(reply.status, 413, "{path}");
    }
    let good = |name: &str| std::fs::read(root.join("good").join(name)).expect("good sample");
    for (path, samples) in [
        (
            "filter",
            vec![good("filter-nodenames.json"), good("filter-nodes.json")],
        ),
        ("prioritize", vec![good("prioritize.json")]),
        (
            "preempt",
            vec![good("preempt.json"), good("preempt-full-victims.json")],
        ),
    ] {
        for sample in &samples {
            let reply = testenv::http_client::http(route, "POST", &format!("/{path}"), sample)
                .await
                .expect("good sample");
            assert_eq!(reply.status, 200, "{path}: {}", reply.body);
        }
        for (i, body) in testenv::mutations::mutations(&samples, 200, 11)
            .iter()
            .enumerate()
        {
            let reply = testenv::http_client::http(route, "POST", &format!("/{path}"), body)
                .await
                .unwrap_or_else(|e| panic!("{path} mutation {i}: {e}"));
            assert!(
                reply.status == 200
                    || ((400..500).contains(&reply.status) && !reply.body.is_empty()),
                "{path} mutation {i}: {} {:?}\n{}",
                reply.status,
                reply.body,
                String::from_utf8_lossy(body)
            );
        }
    }
    let status = testenv::http_client::http(route, "GET", "/status", b"")
        .await
        .expect("status");
    assert_eq!((status.status, status.body.as_str()), (200, "ok"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduler_placement_and_least_free_score() {
    let (env, client) = start(&["--placement=scheduler", "--score=least-free"]).await;
    publish(
        &client,
        &[
            ("node-1", &[2 * GI]),
            ("node-2", &[8 * GI]),
            ("node-3", &[4 * GI]),
        ],
    )
    .await;
    let ns = testenv::test_namespace(&client, "least-free")
        .await
        .expect("namespace");
    // 3 GiB fits on node-2 and node-3; least free after placing it is node-3.
    create_pod(&client, &inline_pod(&ns, "least-free", "3Gi")).await;
    assert_eq!(wait_bound(&client, &ns, "least-free").await, "node-3");
    assert_eq!(
        extender_metric(&env, "pmem_csi_reservations_total{event=\"reserved\"}").await,
        0,
        "--placement=scheduler reserves nothing"
    );
    assert!(
        extender_metric(
            &env,
            "pmem_csi_extender_requests_total{route=\"filter\",code=\"200\"}"
        )
        .await
            >= 1
    );
    assert!(
        extender_metric(
            &env,
            "pmem_csi_extender_requests_total{route=\"prioritize\",code=\"200\"}"
        )
        .await
            >= 1
    );
    bad_input(&env).await;
    let leftovers = env.stop().await;
    assert_eq!(
        leftovers.wait_clean(Duration::from_secs(10)).await,
        Vec::<String>::new()
    );
}

fn cpu(amount: &str) -> ResourceRequirements {
    let q = BTreeMap::from([("cpu".to_string(), Quantity(amount.into()))]);
    ResourceRequirements {
        requests: Some(q.clone()),
        limits: Some(q),
        ..Default::default()
    }
}

/// An extender whose caches cannot sync (its apiserver accepts connections and never answers)
/// answers no fit: `/filter` gets 503, which kube-scheduler (`ignorable: false`) turns into a
/// retry, instead of fits judged from an empty index. The same holds right after a restart,
/// until the watches have listed the pods bound since.
#[tokio::test]
async fn no_fits_before_the_caches_have_synced() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let silent_addr = silent.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: silent\n  cluster:\n    server: https://{silent_addr}\n    insecure-skip-tls-verify: true\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: c\n  context:\n    cluster: silent\n    user: u\ncurrent-context: c\n"
        ),
    )
    .expect("kubeconfig");
    let route = testenv::ports::free_port().expect("port");
    let admin = testenv::ports::free_port().expect("port");
    let mut extender = std::process::Command::new(env!("CARGO_BIN_EXE_pmem-csi"))
        .args([
            "extender",
            "--node-selector=storage=pmem",
            &format!("--extender-address=127.0.0.1:{route}"),
            &format!("--admin-address=127.0.0.1:{admin}"),
        ])
        .env("KUBECONFIG", &kubeconfig)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("pmem-csi extender");
    let body = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("testdata/extender/good/filter-nodenames.json"),
    )
    .expect("filter request");
    let route = std::net::SocketAddr::from(([127, 0, 0, 1], route));
    let answer = until("an answer from /filter", WAIT, || {
        testenv::http_client::http(route, "POST", "/filter", &body)
    })
    .await;
    let _ = extender.kill();
    let _ = extender.wait();
    let answer = answer.expect("answered");
    assert_eq!(
        answer.status, 503,
        "a fit before the caches synced: {}",
        answer.body
    );
    assert!(answer.body.contains("not synced"), "{}", answer.body);
}

async fn metric(admin: std::net::SocketAddr, prefix: &str) -> u64 {
    metrics::metric_value(&metrics::scrape_metrics(admin.port()).await, prefix)
}

/// `/filter` of `pod` (as it is now in the API) over `nodes`, as kube-scheduler sends it: the
/// status and the nodes that passed.
async fn filter_directly(
    route: std::net::SocketAddr,
    client: &kube::Client,
    namespace: &str,
    pod: &str,
    nodes: &[&str],
) -> Result<Vec<String>, String> {
    let pod = Api::<Pod>::namespaced(client.clone(), namespace)
        .get(pod)
        .await
        .map_err(|e| e.to_string())?;
    let body = serde_json::json!({ "Pod": pod, "NodeNames": nodes }).to_string();
    let reply = testenv::http_client::http(route, "POST", "/filter", body.as_bytes()).await?;
    if reply.status != 200 {
        return Err(format!("status {}: {}", reply.status, reply.body));
    }
    let answer: serde_json::Value =
        serde_json::from_str(&reply.body).map_err(|e| format!("{e}: {}", reply.body))?;
    if let Some(error) = answer["Error"].as_str().filter(|e| !e.is_empty()) {
        return Err(error.to_string());
    }
    Ok(answer["NodeNames"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str().map(str::to_owned))
        .collect())
}

/// The window a restart must not open: kube-scheduler got a fit for pod-a on node-1 and is
/// binding it (its claim does not show the selected node yet) when the extender is SIGKILLed.
/// The restarted extender must still count pod-a's reservation, or it lets pod-b into the same
/// room: an over-commit. The test plays kube-scheduler (the pods name a scheduler that does not
/// exist), so that the window stays open as long as the test needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_the_reservations_of_pods_being_bound() {
    let (mut env, client) = start(&[]).await;
    // Kept: the restarted extender serves where it did.
    let (route, admin) = env.extender_addresses().expect("extender");
    let ns = testenv::test_namespace(&client, "restart")
        .await
        .expect("namespace");
    publish(
        &client,
        &[("node-1", &[10 * GI]), ("node-2", &[0]), ("node-3", &[0])],
    )
    .await;
    create_claims(&client, &ns, &[("a", "6Gi"), ("b", "6Gi")]).await;
    for name in ["a", "b"] {
        let mut pod = pod_with_claims(&ns, &format!("pod-{name}"), &[name]);
        if let Some(spec) = pod.spec.as_mut() {
            spec.scheduler_name = Some("played-by-the-test".into());
        }
        create_pod(&client, &pod).await;
    }
    let passed = until("pod-a to fit node-1", WAIT, || {
        filter_directly(route, &client, &ns, "pod-a", &["node-1"])
    })
    .await
    .expect("pod-a filtered");
    assert_eq!(passed, ["node-1"]);
    let before = filter_directly(route, &client, &ns, "pod-b", &["node-1"])
        .await
        .expect("pod-b filtered");
    assert!(before.is_empty(), "pod-a's reservation holds: {before:?}");

    let extender = env.take_extender().expect("extender");
    extender.signal(Signal::KILL).expect("SIGKILL the extender");
    extender
        .wait_for(WAIT, |s| s.restarts >= 1 && s.pid.is_some())
        .await
        .expect("restarted");
    // 503 until the restarted extender has synced; then pod-a's reservation must be back.
    let after = until("the restarted extender to answer", WAIT, || {
        filter_directly(route, &client, &ns, "pod-b", &["node-1"])
    })
    .await
    .expect("pod-b filtered after the restart");
    assert!(
        after.is_empty(),
        "pod-b fits node-1 after the restart: pod-a's reservation was forgotten\n{}",
        testenv::process::tail(&env.dir().join("logs/extender.log"), 40)
    );
    assert_eq!(
        metric(admin, "pmem_csi_reservations_total{event=\"restored\"}").await,
        1
    );

    // The scheduler's PreBind lands: pod-a's claim shows node-1, which now counts it as
    // allocated; pod-b still does not fit. Once pod-a and its claim are gone, it does.
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns)
        .patch(
            "a",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"metadata": {"annotations": {
                controllers::well_known::SELECTED_NODE: "node-1"
            }}})),
        )
        .await
        .expect("select node-1");
    until("pod-a's entry to be handed over", WAIT, || async {
        let n = metric(admin, "pmem_csi_reservations_total{event=\"handed-over\"}").await;
        (n == 1).then_some(()).ok_or(format!("handed over: {n}"))
    })
    .await
    .expect("handed over");
    let selected = filter_directly(route, &client, &ns, "pod-b", &["node-1"])
        .await
        .expect("pod-b filtered");
    assert!(selected.is_empty(), "{selected:?}");
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    Api::<Pod>::namespaced(client.clone(), &ns)
        .delete("pod-a", &now)
        .await
        .expect("delete pod-a");
    Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns)
        .delete("a", &now)
        .await
        .expect("delete claim a");
    until("pod-b to fit node-1", WAIT, || async {
        let passed = filter_directly(route, &client, &ns, "pod-b", &["node-1"]).await?;
        (passed == ["node-1"])
            .then_some(())
            .ok_or(format!("passed: {passed:?}"))
    })
    .await
    .expect("room again");
    extender.stop().await;
    clean(&client, &ns).await;
    let leftovers = env.stop().await;
    assert_eq!(
        leftovers.wait_clean(Duration::from_secs(10)).await,
        Vec::<String>::new()
    );
}
