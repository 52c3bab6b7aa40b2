//! `manifests/monitoring/` against the real things: promtool checks the alert rules and runs their
//! unit tests (a firing and a silent case per alert); every vector selector of every dashboard
//! query and alert expression matches at least one series in a real Prometheus (Debian's)
//! scraping every admin server of a testenv with traffic; the dashboard type-checks against
//! Grafana's published schema package (`@grafana/schema`) with `tsc`. The tools come from
//! `tools/ops-tools.sh` (`just tools`).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use controllers::test_objects;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::Api;
use kube::api::PostParams;
use promql_parser::parser::{self, Expr};
use testenv::wait::until;
use testenv::{NodeSpec, TestEnv, http_client};

const CLASS: &str = "pmem-csi-sc-ext4";
const WAIT: Duration = Duration::from_secs(90);

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn monitoring(file: &str) -> PathBuf {
    repo().join("manifests/monitoring").join(file)
}

/// The directory of `tools/ops-tools.sh`, checked for the tools these tests run.
fn ops_tools() -> PathBuf {
    let dir = testenv::tools::ops_tools_dir();
    for tool in [
        "bin/promtool",
        "bin/prometheus",
        "npm/node_modules/.bin/tsc",
    ] {
        assert!(
            dir.join(tool).exists(),
            "{} lacks {tool}: run `just tools`",
            dir.display()
        );
    }
    dir
}

/// Runs `command`, failing the test with its output unless it succeeds; returns stdout.
fn run(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{command:?} failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn yaml(file: &str) -> serde_yaml::Value {
    let text = std::fs::read_to_string(monitoring(file)).expect(file);
    serde_yaml::from_str(&text).expect(file)
}

/// Every alert rule's name and expression.
fn alerts() -> Vec<(String, String)> {
    let rules = yaml("rules.yaml");
    let groups = rules["groups"].as_sequence().cloned().unwrap_or_default();
    groups
        .iter()
        .flat_map(|g| g["rules"].as_sequence().cloned().unwrap_or_default())
        .filter_map(|r| Some((r["alert"].as_str()?.into(), r["expr"].as_str()?.into())))
        .collect()
}

/// Every dashboard query, with Grafana's `$__rate_interval` as Prometheus reads it.
fn dashboard_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(monitoring("dashboard.json")).expect("dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON");
    let panels = dashboard["panels"].as_array().cloned().unwrap_or_default();
    panels
        .iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_string();
            let targets = p["targets"].as_array().cloned().unwrap_or_default();
            targets.into_iter().filter_map(move |t| {
                let expr = t["expr"].as_str()?.replace("$__rate_interval", "1m");
                Some((title.clone(), expr))
            })
        })
        .collect()
}

/// The vector selectors of `expr`, as PromQL text.
fn selectors(expr: &Expr, out: &mut BTreeSet<String>) {
    match expr {
        Expr::Aggregate(a) => {
            selectors(&a.expr, out);
            if let Some(param) = &a.param {
                selectors(param, out);
            }
        }
        Expr::Unary(u) => selectors(&u.expr, out),
        Expr::Binary(b) => {
            selectors(&b.lhs, out);
            selectors(&b.rhs, out);
        }
        Expr::Paren(p) => selectors(&p.expr, out),
        Expr::Subquery(s) => selectors(&s.expr, out),
        Expr::VectorSelector(v) => {
            out.insert(v.to_string());
        }
        Expr::MatrixSelector(m) => {
            out.insert(m.vs.to_string());
        }
        Expr::Call(c) => {
            for arg in &c.args.args {
                selectors(arg, out);
            }
        }
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => {}
    }
}

/// Every vector selector of every dashboard query and alert, each naming where it is used.
fn all_selectors() -> Vec<(String, String)> {
    let mut found = Vec::new();
    let sources = dashboard_queries()
        .into_iter()
        .map(|(title, expr)| (format!("dashboard panel {title:?}"), expr))
        .chain(
            alerts()
                .into_iter()
                .map(|(name, expr)| (format!("alert {name}"), expr)),
        );
    for (source, expr) in sources {
        let parsed = parser::parse(&expr).unwrap_or_else(|e| panic!("{source}: {expr}: {e}"));
        let mut set = BTreeSet::new();
        selectors(&parsed, &mut set);
        assert!(!set.is_empty(), "{source}: no selector in {expr}");
        found.extend(set.into_iter().map(|s| (source.clone(), s)));
    }
    found
}

#[test]
fn alert_rules_pass_promtool_with_a_firing_and_a_silent_case_each() {
    let promtool = ops_tools().join("bin/promtool");
    run(Command::new(&promtool)
        .args(["check", "rules"])
        .arg(monitoring("rules.yaml")));
    run(Command::new(&promtool)
        .args(["test", "rules"])
        .arg(monitoring("rules-test.yaml"))
        .current_dir(monitoring("")));
    let tests = yaml("rules-test.yaml");
    let mut firing = BTreeSet::new();
    let mut silent = BTreeSet::new();
    for test in tests["tests"].as_sequence().cloned().unwrap_or_default() {
        for case in test["alert_rule_test"]
            .as_sequence()
            .cloned()
            .unwrap_or_default()
        {
            let name = case["alertname"].as_str().unwrap_or_default().to_string();
            match case["exp_alerts"].as_sequence() {
                Some(expected) if !expected.is_empty() => firing.insert(name),
                _ => silent.insert(name),
            };
        }
    }
    let names: Vec<String> = alerts().into_iter().map(|(name, _)| name).collect();
    assert!(names.len() >= 11, "{names:?}");
    for name in names {
        assert!(firing.contains(&name), "{name}: no case where it fires");
        assert!(
            silent.contains(&name),
            "{name}: no case where it stays silent"
        );
    }
}

#[test]
fn dashboard_type_checks_against_grafanas_schema() {
    let tools = ops_tools();
    let dir = tempfile::tempdir().expect("tempdir");
    let json = std::fs::read_to_string(monitoring("dashboard.json")).expect("dashboard");
    // An object literal checked with `satisfies` keeps its literals' types, so enum-like
    // string fields are checked against their unions; excess properties are errors.
    let source = format!(
        "import type {{ Dashboard }} from '@grafana/schema';\nexport const dashboard = {} satisfies Dashboard;\n",
        json.trim_end()
    );
    std::fs::write(dir.path().join("dashboard.ts"), source).expect("write");
    std::fs::write(
        dir.path().join("tsconfig.json"),
        r#"{"compilerOptions": {"strict": true, "noEmit": true, "target": "es2022",
            "module": "es2022", "moduleResolution": "bundler", "skipLibCheck": true},
            "files": ["dashboard.ts"]}"#,
    )
    .expect("write");
    std::os::unix::fs::symlink(
        tools.join("npm/node_modules"),
        dir.path().join("node_modules"),
    )
    .expect("symlink");
    run(Command::new(tools.join("npm/node_modules/.bin/tsc"))
        .args(["-p", "tsconfig.json"])
        .current_dir(dir.path()));
}

#[test]
fn queries_parse_and_name_only_our_series() {
    let ours = [
        "controller_runtime_",
        "leader_election_master_status",
        "csi_plugin_operations_seconds",
        "pmem_amount_",
        "pmem_csi_",
    ];
    let found = all_selectors();
    assert!(found.len() > 30, "{}", found.len());
    for (source, selector) in found {
        assert!(
            ours.iter().any(|p| selector.starts_with(p)),
            "{source}: {selector} is not a series pmem-csi emits"
        );
    }
}

/// A Prometheus scraping `targets` every second, stopped on drop.
struct Prometheus {
    child: Child,
    address: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(binary: &Path, targets: &[(String, u16)]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let static_configs: Vec<serde_json::Value> = targets
            .iter()
            .map(|(component, port)| {
                serde_json::json!({
                    "targets": [format!("127.0.0.1:{port}")],
                    "labels": {"component": component},
                })
            })
            .collect();
        let config = serde_json::json!({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "pmem-csi", "static_configs": static_configs}],
        });
        // JSON is YAML.
        let config_file = dir.path().join("prometheus.yml");
        std::fs::write(&config_file, config.to_string()).expect("config");
        let port = testenv::ports::free_port().expect("port");
        let address = SocketAddr::from(([127, 0, 0, 1], port));
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log");
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={address}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("prometheus");
        Prometheus {
            child,
            address,
            _dir: dir,
        }
    }

    /// How many series `selector` matches now. An instant `count()`: its answer is small enough
    /// to come without chunked encoding, which the test client does not decode.
    async fn series(&self, selector: &str) -> Result<u64, String> {
        let query = format!("count({selector})");
        let path = format!("/api/v1/query?query={}", url_encode(&query));
        let reply = http_client::http(self.address, "GET", &path, b"").await?;
        let short: String = reply.body.chars().take(300).collect();
        if reply.status != 200 {
            return Err(format!("{}: {short}", reply.status));
        }
        let body: serde_json::Value =
            serde_json::from_str(&reply.body).map_err(|e| format!("{e}: {short}"))?;
        // [{"metric": {}, "value": [<time>, "<count>"]}], or [] when nothing matches.
        Ok(body["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0) as u64)
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Traffic that makes every series of the dashboard and the alerts exist: pods with claims
/// through webhook, extender, provisioning and the kubelet; a pod too large for any node (node
/// rejections); bad requests to the webhook and the extender (error codes); a bad CSI call
/// (an error status).
async fn traffic(env: &TestEnv, client: &kube::Client) {
    let ns = testenv::test_namespace(client, "monitoring")
        .await
        .expect("namespace");
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), &ns);
    let pods = Api::<Pod>::namespaced(client.clone(), &ns);
    for (name, size) in [("a", "64Mi"), ("b", "64Mi")] {
        claims
            .create(
                &PostParams::default(),
                &test_objects::claim(&ns, name, CLASS, size),
            )
            .await
            .expect("claim");
        pods.create(
            &PostParams::default(),
            &test_objects::pod_with_claim(&ns, name, name),
        )
        .await
        .expect("pod");
    }
    for name in ["a", "b"] {
        until(&format!("pod {name} Running"), WAIT, || async {
            let pod = pods.get(name).await.map_err(|e| e.to_string())?;
            let status = pod.status.unwrap_or_default();
            let phase = status.phase.unwrap_or_default();
            let why: Vec<String> = status
                .conditions
                .into_iter()
                .flatten()
                .filter_map(|c| c.message)
                .collect();
            (phase == "Running")
                .then_some(())
                .ok_or(format!("{phase} {why:?}"))
        })
        .await
        .expect("running");
    }

    // Inline volumes are not capacity-checked by kube-scheduler, so the extender judges every
    // node for this one: all reject it (the driverless node for its own reason).
    pods.create(
        &PostParams::default(),
        &test_objects::pod_with_inline_volume(&ns, "huge", env.driver_name(), "100Gi"),
    )
    .await
    .expect("pod");
    let (extender, _) = env.extender_addresses().expect("extender");
    let reply = http_client::http(extender, "POST", "/filter", b"not json")
        .await
        .expect("extender");
    assert_eq!(reply.status, 400, "{}", reply.body);

    let (webhook, _) = env.controller_ports().expect("controller");
    let configs = Api::<MutatingWebhookConfiguration>::all(client.clone());
    let ca = until("the webhook's CA bundle", WAIT, || async {
        let list = configs
            .list(&Default::default())
            .await
            .map_err(|e| e.to_string())?;
        list.items
            .iter()
            .flat_map(|c| c.webhooks.iter().flatten())
            .find_map(|w| w.client_config.ca_bundle.clone())
            .ok_or("no caBundle".to_string())
    })
    .await
    .expect("caBundle");
    let config = http_client::trusting(&String::from_utf8_lossy(&ca.0)).expect("CA");
    let reply = http_client::https(
        SocketAddr::from(([127, 0, 0, 1], webhook)),
        config,
        "POST",
        "/pod/mutate",
        b"not json",
    )
    .await
    .expect("webhook");
    assert!((400..500).contains(&reply.status), "{}", reply.status);

    let node = env
        .nodes()
        .iter()
        .find(|n| n.driver)
        .map(|n| n.name.clone())
        .expect("a node with a driver");
    let socket = env.driver_socket(&node).expect("socket");
    let channel = driver::client::connect(&socket).await.expect("connect");
    let status = driver::csi::node_client::NodeClient::new(channel)
        .node_get_volume_stats(driver::csi::NodeGetVolumeStatsRequest::default())
        .await
        .expect_err("a request without volume id");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_selector_matches_a_series_of_a_running_cluster() {
    let tools = ops_tools();
    let env = TestEnv::builder()
        .nodes(2)
        .node(NodeSpec::driverless("node-3"))
        .drivers(testenv::node_processes::DriverOptions::default())
        .extender(Vec::<String>::new())
        .controller(Vec::<String>::new())
        .kubelet()
        .start()
        .await
        .expect("testenv");
    let client = env.client().await.expect("client");
    traffic(&env, &client).await;

    let mut targets: Vec<(String, u16)> = env
        .nodes()
        .iter()
        .filter_map(|n| Some(("node".to_string(), env.driver_admin_port(&n.name)?)))
        .collect();
    let (_, controller) = env.controller_ports().expect("controller");
    let (_, extender) = env.extender_addresses().expect("extender");
    targets.push(("controller".into(), controller));
    targets.push(("extender".into(), extender.port()));
    let prometheus = Prometheus::start(&tools.join("bin/prometheus"), &targets);

    let selectors = all_selectors();
    until("every selector to match a series", WAIT, || async {
        let mut missing = Vec::new();
        for (source, selector) in &selectors {
            match prometheus.series(selector).await {
                Ok(n) if n > 0 => {}
                Ok(_) => missing.push(format!("{source}: {selector}")),
                Err(e) => missing.push(format!("{source}: {selector}: {e}")),
            }
        }
        missing
            .is_empty()
            .then_some(())
            .ok_or_else(|| missing.join("\n"))
    })
    .await
    .expect("selectors");
    drop(prometheus);
    let leftovers = env.stop().await;
    let left = leftovers.wait_clean(Duration::from_secs(30)).await;
    assert!(left.is_empty(), "{left:?}");
}
