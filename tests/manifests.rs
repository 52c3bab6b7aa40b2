//! The manifests: every kustomization renders with the tool cache's kubectl and passes
//! `kubectl apply --dry-run=server` against testenv's real API server, and the values that must
//! agree across containers do.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml::Value;
use testenv::manifests::{self, OurContainer, Rendered, flag_value};
use testenv::{TestEnv, TestEnvBuilder};

fn env() -> &'static TestEnv {
    fn configure() -> TestEnvBuilder {
        TestEnv::builder().token_renewal(std::time::Duration::from_secs(1))
    }
    TestEnv::shared(configure)
}

fn repo() -> &'static Path {
    testenv::tools::repo_root()
}

/// A scratch kustomization of `resource` plus the scheduler-extender component.
fn with_component(scratch: &Path, name: &str, resource: &str) -> PathBuf {
    let dir = scratch.join(name);
    manifests::write_kustomization(
        &dir,
        &[repo().join(resource)],
        &[repo().join(manifests::COMPONENT)],
    )
    .expect("kustomization");
    dir
}

#[test]
fn every_kustomization_renders_and_the_api_server_accepts_it() {
    let env = env();
    let kubectl = env.tools().go("kubectl");
    let scratch = tempfile::tempdir().expect("scratch");
    let dirs = [
        ("base", repo().join("manifests/base")),
        ("overlays/emulated", repo().join(manifests::OVERLAY)),
        (
            "base + component",
            with_component(scratch.path(), "base-ext", "manifests/base"),
        ),
        (
            "overlays/emulated + component",
            with_component(scratch.path(), "emulated-ext", manifests::OVERLAY),
        ),
        ("overlays/lvm + node-loss-recovery", {
            let dir = scratch.path().join("lvm-node-loss");
            manifests::write_kustomization(
                &dir,
                &[repo().join("manifests/overlays/lvm")],
                &[repo().join(manifests::NODE_LOSS_COMPONENT)],
            )
            .expect("kustomization");
            dir
        }),
        ("overlays/lvm", repo().join("manifests/overlays/lvm")),
        ("overlays/direct", repo().join("manifests/overlays/direct")),
        (
            "overlays/lvm + component",
            with_component(scratch.path(), "lvm-ext", "manifests/overlays/lvm"),
        ),
        (
            "overlays/direct + component",
            with_component(scratch.path(), "direct-ext", "manifests/overlays/direct"),
        ),
        ("examples", repo().join("manifests/examples")),
        // Two ConfigMaps: the alert rules and the Grafana dashboard.
        ("monitoring", repo().join("manifests/monitoring")),
    ];
    for (name, dir) in dirs {
        let least = if name == "monitoring" { 2 } else { 3 };
        let yaml = manifests::kustomize(&kubectl, &dir)
            .unwrap_or_else(|e| panic!("{name} does not render: {e}"));
        let rendered = Rendered::from_yaml(&yaml).expect("YAML");
        assert!(
            rendered.objects().len() >= least,
            "{name}: only {} objects",
            rendered.objects().len()
        );
        let file = scratch
            .path()
            .join(format!("{}.yaml", name.replace(['/', ' ', '+'], "_")));
        std::fs::write(&file, &yaml).expect("write rendering");
        let mut command = Command::new(&kubectl);
        command
            .arg("--kubeconfig")
            .arg(env.admin_kubeconfig())
            .args(["apply", "--dry-run=server", "-f"])
            .arg(&file);
        if name == "examples" {
            // The examples go into the user's namespace.
            command.args(["--namespace", "default"]);
        }
        let output = command.output().expect("kubectl");
        assert!(
            output.status.success(),
            "{name}: kubectl apply --dry-run=server failed:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        // testenv applied the ServiceAccounts and RBAC server-side, so client-side apply
        // notes their missing last-applied annotation; any other warning is ours.
        let stderr = String::from_utf8_lossy(&output.stderr);
        let warnings: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("Warning") && !l.contains("last-applied-configuration"))
            .collect();
        assert!(
            warnings.is_empty(),
            "{name}: the API server warned:\n{}",
            warnings.join("\n")
        );
    }
}

/// The workloads of the rendered manifests (with the scheduler-extender component).
const WORKLOADS: [(&str, &str); 3] = [
    ("DaemonSet", "pmem-csi-intel-com-node"),
    ("Deployment", "pmem-csi-intel-com-controller"),
    ("DaemonSet", "pmem-csi-intel-com-extender"),
];

fn containers<'a>(rendered: &'a Rendered, kind: &str, name: &str) -> Vec<&'a Value> {
    rendered
        .pod_spec(kind, name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))["containers"]
        .as_sequence()
        .into_iter()
        .flatten()
        .collect()
}

fn args(container: &Value) -> Vec<String> {
    ["command", "args"]
        .iter()
        .flat_map(|k| container[*k].as_sequence().cloned().unwrap_or_default())
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect()
}

fn port_of(address: &str) -> Option<u16> {
    address.rsplit_once(':').and_then(|(_, p)| p.parse().ok())
}

/// A probe's port: a number, or the name of one of the container's ports.
fn probe_port(container: &Value, probe: &Value) -> Option<u16> {
    let port = &probe["httpGet"]["port"];
    if let Some(n) = port.as_u64() {
        return u16::try_from(n).ok();
    }
    let name = port.as_str()?;
    container["ports"]
        .as_sequence()?
        .iter()
        .find(|p| p["name"].as_str() == Some(name))
        .and_then(|p| p["containerPort"].as_u64())
        .and_then(|n| u16::try_from(n).ok())
}

/// Every container runs without privilege and without capabilities, except the node driver,
/// which mounts and makes devices (privileged).
#[test]
fn containers_drop_every_capability_except_the_node_driver() {
    let rendered = env().manifests();
    let workloads = WORKLOADS;
    let mut checked = 0;
    for (kind, name) in workloads {
        for container in containers(rendered, kind, name) {
            let cname = container["name"].as_str().unwrap_or_default();
            let security = &container["securityContext"];
            if kind == "DaemonSet" && name.ends_with("-node") && cname == "pmem-driver" {
                assert_eq!(security["privileged"].as_bool(), Some(true), "{cname}");
                continue;
            }
            checked += 1;
            let what = format!("{kind} {name} container {cname}");
            assert_ne!(security["privileged"].as_bool(), Some(true), "{what}");
            assert_eq!(
                security["allowPrivilegeEscalation"].as_bool(),
                Some(false),
                "{what}: allowPrivilegeEscalation"
            );
            let drops: Vec<&str> = security["capabilities"]["drop"]
                .as_sequence()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str())
                .collect();
            assert_eq!(drops, ["ALL"], "{what}: capabilities.drop");
            assert!(
                security["capabilities"]["add"].is_null(),
                "{what}: capabilities.add"
            );
        }
    }
    assert!(checked >= 5, "only {checked} containers checked");
}

#[test]
fn probes_selectors_and_sockets_agree() {
    let rendered = env().manifests();
    let workloads = WORKLOADS;
    let mut probed = 0;
    for (kind, name) in workloads {
        for container in containers(rendered, kind, name) {
            let cname = container["name"].as_str().unwrap_or_default();
            let line = args(container);
            let admin = flag_value(&line, "--admin-address")
                .or_else(|| flag_value(&line, "--http-endpoint"))
                .and_then(port_of);
            for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
                let probe = &container[probe];
                if probe.is_null() {
                    continue;
                }
                probed += 1;
                assert_eq!(
                    probe_port(container, probe),
                    admin,
                    "{kind} {name} container {cname}: probe port and admin port differ"
                );
            }
        }
    }
    assert!(probed >= 6, "only {probed} probes found");

    let selector: BTreeMap<String, String> = serde_yaml::from_value(
        rendered
            .pod_spec("DaemonSet", "pmem-csi-intel-com-node")
            .expect("node DaemonSet")["nodeSelector"]
            .clone(),
    )
    .expect("nodeSelector");
    assert!(
        !selector.is_empty(),
        "the node DaemonSet needs a nodeSelector"
    );
    for which in [OurContainer::Controller, OurContainer::Extender] {
        let launch = rendered.launch(which).expect("container");
        let value = flag_value(&launch.args, "--node-selector")
            .unwrap_or_else(|| panic!("{which:?} has no --node-selector"));
        let parsed: BTreeMap<String, String> = value
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(parsed, selector, "{which:?} --node-selector={value}");
    }
    let controller_base = env()
        .manifests_base()
        .launch(OurContainer::Controller)
        .expect("base controller");
    assert_eq!(
        flag_value(&controller_base.args, "--node-selector"),
        flag_value(
            &rendered.launch(OurContainer::Controller).expect("c").args,
            "--node-selector"
        ),
        "the component must not change the selector"
    );

    let driver = rendered.launch(OurContainer::NodeDriver).expect("driver");
    let endpoint = flag_value(&driver.args, "--endpoint").expect("--endpoint");
    let socket = endpoint.strip_prefix("unix://").expect("unix endpoint");
    for container in containers(rendered, "DaemonSet", "pmem-csi-intel-com-node") {
        let line = args(container);
        if let Some(address) = flag_value(&line, "--csi-address") {
            assert_eq!(
                address.trim_start_matches("unix://"),
                socket,
                "{} --csi-address",
                container["name"].as_str().unwrap_or_default()
            );
        }
    }
}

#[test]
fn kubelet_dir_is_set_in_one_place() {
    // What docs/install-and-operate.md tells users: a Component patching the ConfigMap, then kubelet-dir again.
    let kubectl = env().tools().go("kubectl");
    let scratch = tempfile::tempdir().expect("scratch");
    let dir = scratch.path();
    std::fs::create_dir_all(dir.join("set")).expect("component dir");
    std::fs::write(
        dir.join("set/kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1alpha1\nkind: Component\npatches:\n- patch: |-\n    apiVersion: v1\n    kind: ConfigMap\n    metadata:\n      name: pmem-csi-kubelet-dir\n      namespace: pmem-csi\n    data:\n      kubeletDir: /data/kubelet\n",
    )
    .expect("component");
    manifests::write_kustomization(
        dir,
        &[repo().join(manifests::OVERLAY)],
        &[
            PathBuf::from("set"),
            repo().join("manifests/components/kubelet-dir"),
        ],
    )
    .expect("kustomization");
    let yaml = manifests::kustomize(&kubectl, dir).expect("render");
    assert!(
        !yaml.contains("/var/lib/kubelet"),
        "a path still names the default kubelet dir"
    );
    let rendered = Rendered::from_yaml(&yaml).expect("YAML");
    assert!(
        rendered
            .object("ConfigMap", "pmem-csi-kubelet-dir")
            .is_none(),
        "the ConfigMap is local configuration, never applied"
    );
    let spec = rendered
        .pod_spec("DaemonSet", "pmem-csi-intel-com-node")
        .expect("node DaemonSet");
    let host_paths: Vec<&str> = spec["volumes"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .filter(|p| p.contains("kubelet"))
        .collect();
    assert_eq!(host_paths.len(), 4, "{host_paths:?}");
    assert!(
        host_paths.iter().all(|p| p.starts_with("/data/kubelet/")),
        "{host_paths:?}"
    );
    let registrar = containers(&rendered, "DaemonSet", "pmem-csi-intel-com-node")
        .into_iter()
        .find(|c| c["name"].as_str() == Some("driver-registrar"))
        .expect("registrar");
    let kubelet_dir = registrar["env"]
        .as_sequence()
        .into_iter()
        .flatten()
        .find(|e| e["name"].as_str() == Some("KUBELET_DIR"))
        .and_then(|e| e["value"].as_str());
    assert_eq!(kubelet_dir, Some("/data/kubelet"));
}

#[tokio::test]
async fn service_account_tokens_are_renewed_and_identify_the_account() {
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
    let env = env();
    let account = "pmem-csi-intel-com-node";
    let file = env.service_account_token_file(account).expect("token file");
    let first = std::fs::read_to_string(&file).expect("token");
    testenv::wait::until(
        "the token to be renewed",
        std::time::Duration::from_secs(60),
        || async {
            let now = std::fs::read_to_string(&file).map_err(|e| e.to_string())?;
            if now != first && !now.is_empty() {
                Ok(())
            } else {
                Err("unchanged".to_string())
            }
        },
    )
    .await
    .expect("renewal");
    let kubeconfig = env.service_account_kubeconfig(account).expect("kubeconfig");
    let client = testenv::control_plane::client_from(kubeconfig, account)
        .await
        .expect("client");
    // The renewed token authenticates as that account, not as admin. Asked through
    // SelfSubjectReview, which every authenticated user may create and no rule of ours grants,
    // so this test marks no grant used for tests/least_privilege.rs and provokes no denial.
    let review = kube::Api::<SelfSubjectReview>::all(client)
        .create(&Default::default(), &SelfSubjectReview::default())
        .await
        .expect("SelfSubjectReview");
    let user = review
        .status
        .and_then(|s| s.user_info)
        .and_then(|u| u.username);
    assert_eq!(
        user.as_deref(),
        Some("system:serviceaccount:pmem-csi:pmem-csi-intel-com-node")
    );
}

/// The node driver's arguments in each overlay are ones `pmem-csi node` accepts, in the
/// overlay's device mode (the flag validation that would otherwise fail only on a node).
#[test]
fn overlays_give_the_driver_valid_flags_for_their_mode() {
    /// `pmem-csi node`'s flags: the driver's, and the admin server's and logging's every
    /// subcommand shares (src/main.rs).
    #[derive(clap::Parser)]
    struct Node {
        #[command(flatten)]
        args: driver::NodeArgs,
        #[arg(long)]
        _admin_address: Option<std::net::SocketAddr>,
        #[arg(long)]
        _log_format: Option<String>,
    }
    let kubectl = testenv::Tools::locate()
        .expect("tools (run `just tools`)")
        .go("kubectl");
    for (overlay, mode) in [
        ("emulated", driver::backend::DeviceMode::Emulated),
        ("lvm", driver::backend::DeviceMode::Lvm),
        ("direct", driver::backend::DeviceMode::Direct),
    ] {
        let dir = repo().join("manifests/overlays").join(overlay);
        let yaml = manifests::kustomize(&kubectl, &dir)
            .unwrap_or_else(|e| panic!("{overlay} does not render: {e}"));
        let rendered = Rendered::from_yaml(&yaml).expect("YAML");
        let driver = containers(&rendered, "DaemonSet", "pmem-csi-intel-com-node")
            .into_iter()
            .find(|c| c["name"].as_str() == Some("pmem-driver"))
            .unwrap_or_else(|| panic!("{overlay}: no pmem-driver container"));
        let command = args(driver);
        let node = command
            .iter()
            .position(|a| a == "node")
            .unwrap_or_else(|| panic!("{overlay}: no `node` subcommand in {command:?}"));
        let mut argv = vec!["pmem-csi".to_string()];
        argv.extend(
            command[node + 1..]
                .iter()
                .map(|a| a.replace("$(NODE_NAME)", "node-1")),
        );
        let parsed = <Node as clap::Parser>::try_parse_from(&argv)
            .unwrap_or_else(|e| panic!("{overlay}: {argv:?}: {e}"));
        let config = parsed
            .args
            .validate()
            .unwrap_or_else(|e| panic!("{overlay}: {argv:?}: {e}"));
        assert_eq!(config.device_mode, mode, "{overlay}");
        let mounts: Vec<&str> = driver["volumeMounts"]
            .as_sequence()
            .into_iter()
            .flatten()
            .filter_map(|m| m["mountPath"].as_str())
            .collect();
        for needed in ["/dev", "/sys", "/var/lib/pmem-csi.intel.com"] {
            assert!(
                mounts.contains(&needed),
                "{overlay}: {needed} not mounted: {mounts:?}"
            );
        }
        assert_eq!(
            mounts.contains(&"/host-sys"),
            overlay == "direct",
            "{overlay}: /host-sys is for the direct mode's read-only /sys fallback"
        );
    }
}
