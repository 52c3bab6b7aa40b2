//! The Helm chart (`charts/pmem-csi`) and the kustomize manifests are one source of truth: for
//! every values file of the chart with a kustomize counterpart, `helm template` renders the same
//! objects as `kubectl kustomize` (normalised: the Namespace object, which Helm leaves to
//! `--create-namespace`, and Helm's own labels aside). Every values file passes `helm lint`;
//! the chart's README lists every value with its default; bad values fail the render naming
//! the value. helm comes from `tools/helm.sh` (`just tools`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml::Value;
use testenv::manifests::{self, Rendered};

const NAMESPACE: &str = "pmem-csi";

/// The cluster-scoped kinds the chart and the manifests render.
const CLUSTER_SCOPED: [&str; 7] = [
    "CSIDriver",
    "StorageClass",
    "ClusterRole",
    "ClusterRoleBinding",
    "MutatingWebhookConfiguration",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
];

fn repo() -> &'static Path {
    testenv::tools::repo_root()
}

fn chart() -> PathBuf {
    repo().join("charts/pmem-csi")
}

fn helm() -> PathBuf {
    let helm = testenv::tools::helm();
    assert!(
        helm.exists(),
        "{} is missing: run `just tools`",
        helm.display()
    );
    helm
}

fn kubectl() -> PathBuf {
    testenv::tools::Tools::locate()
        .expect("tools: run `just tools`")
        .go("kubectl")
}

/// Runs `command`; its stdout, or its stderr as the error.
fn run(command: &mut Command) -> Result<String, String> {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// `helm template` of the chart with `values` (a file under `ci/`) and `--set` items.
fn template(values: Option<&str>, set: &[&str]) -> Result<String, String> {
    let mut command = Command::new(helm());
    command
        .args(["template", "pmem-csi"])
        .arg(chart())
        .args(["--namespace", NAMESPACE]);
    if let Some(values) = values {
        command.arg("--values").arg(chart().join("ci").join(values));
    }
    for item in set {
        command.args(["--set", item]);
    }
    run(&mut command)
}

/// `kubectl kustomize` of `resources` (paths under the repository) with `components`.
fn kustomize(scratch: &Path, name: &str, resources: &[&str], components: &[&str]) -> String {
    let dir = scratch.join(name);
    let paths = |list: &[&str]| list.iter().map(|p| repo().join(p)).collect::<Vec<_>>();
    manifests::write_kustomization(&dir, &paths(resources), &paths(components))
        .expect("kustomization");
    manifests::kustomize(&kubectl(), &dir).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Objects by `kind namespace/name`, without the Namespace object and Helm's labels.
fn normalised(yaml: &str) -> BTreeMap<String, Value> {
    let rendered = Rendered::from_yaml(yaml).expect("YAML");
    let mut objects = BTreeMap::new();
    for object in rendered.objects() {
        let kind = object["kind"].as_str().unwrap_or_default().to_string();
        if kind == "Namespace" {
            continue;
        }
        let mut object = object.clone();
        if let Some(labels) = object
            .get_mut("metadata")
            .and_then(|m| m.get_mut("labels"))
            .and_then(Value::as_mapping_mut)
        {
            labels.remove("helm.sh/chart");
            labels.remove("app.kubernetes.io/managed-by");
        }
        // kustomize's namespace transformer does not know ValidatingAdmissionPolicy is
        // cluster-scoped and gives it the namespace, which kubectl drops on apply.
        if CLUSTER_SCOPED.contains(&kind.as_str())
            && let Some(meta) = object.get_mut("metadata").and_then(Value::as_mapping_mut)
        {
            meta.remove("namespace");
        }
        let meta = &object["metadata"];
        let key = format!(
            "{kind} {}/{}",
            meta["namespace"].as_str().unwrap_or_default(),
            meta["name"].as_str().unwrap_or_default()
        );
        assert!(objects.insert(key.clone(), object).is_none(), "{key} twice");
    }
    objects
}

/// The differences between two renderings, in words (empty when equal).
fn differences(helm: &BTreeMap<String, Value>, kustomize: &BTreeMap<String, Value>) -> Vec<String> {
    let mut found = Vec::new();
    for key in kustomize.keys().filter(|k| !helm.contains_key(*k)) {
        found.push(format!("only kustomize renders {key}"));
    }
    for key in helm.keys().filter(|k| !kustomize.contains_key(*k)) {
        found.push(format!("only the chart renders {key}"));
    }
    for (key, ours) in helm {
        if let Some(theirs) = kustomize.get(key)
            && ours != theirs
        {
            found.push(format!(
                "{key} differs:\n--- chart\n{}\n--- kustomize\n{}",
                serde_yaml::to_string(ours).unwrap_or_default(),
                serde_yaml::to_string(theirs).unwrap_or_default()
            ));
        }
    }
    found
}

#[test]
fn the_chart_renders_what_kustomize_renders() {
    let scratch = tempfile::tempdir().expect("scratch");
    let extender = "manifests/components/scheduler-extender";
    let node_loss = manifests::NODE_LOSS_COMPONENT;
    let cases: [(&str, &[&str], &[&str]); 6] = [
        ("emulated-values.yaml", &[manifests::OVERLAY], &[]),
        ("lvm-values.yaml", &["manifests/overlays/lvm"], &[]),
        ("direct-values.yaml", &["manifests/overlays/direct"], &[]),
        (
            "emulated-extender-values.yaml",
            &[manifests::OVERLAY],
            &[extender],
        ),
        (
            "lvm-all-values.yaml",
            &["manifests/overlays/lvm"],
            &[extender, node_loss],
        ),
        (
            "monitoring-values.yaml",
            &[
                manifests::OVERLAY,
                "manifests/monitoring",
                "manifests/monitoring/prometheus-operator",
            ],
            &[],
        ),
    ];
    let mut failures = Vec::new();
    for (values, resources, components) in cases {
        let ours =
            normalised(&template(Some(values), &[]).unwrap_or_else(|e| panic!("{values}: {e}")));
        let theirs = normalised(&kustomize(scratch.path(), values, resources, components));
        assert!(
            theirs.len() >= 20,
            "{values}: kustomize rendered {}",
            theirs.len()
        );
        for difference in differences(&ours, &theirs) {
            failures.push(format!("{values}: {difference}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn the_comparison_sees_a_drift() {
    // A value that changes one field must show as exactly that object's difference.
    let ours = normalised(&template(None, &["controller.replicas=3"]).expect("renders"));
    let theirs = normalised(&template(None, &[]).expect("renders"));
    let found = differences(&ours, &theirs);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("Deployment pmem-csi/pmem-csi-intel-com-controller differs"),
        "{found:?}"
    );
}

#[test]
fn every_values_file_lints_and_renders() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(chart().join("ci"))
        .expect("ci/")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    assert!(files.len() >= 9, "values files: {files:?}");
    for file in &files {
        run(Command::new(helm())
            .args(["lint", "--strict", "--namespace", NAMESPACE])
            .arg(chart())
            .arg("--values")
            .arg(file))
        .unwrap_or_else(|e| panic!("helm lint {}: {e}", file.display()));
        let name = file
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let yaml = template(Some(name), &[]).unwrap_or_else(|e| panic!("{name}: {e}"));
        let objects = normalised(&yaml);
        assert!(objects.len() >= 20, "{name}: {} objects", objects.len());
    }
}

/// What the values files without a kustomize counterpart change, object by object.
#[test]
fn certificates_and_a_second_instance_render_as_documented() {
    let objects = normalised(&template(Some("cert-manager-values.yaml"), &[]).expect("renders"));
    let certificate = &objects["Certificate pmem-csi/pmem-csi-intel-com-webhook"];
    assert_eq!(
        certificate["spec"]["dnsNames"][0].as_str(),
        Some("pmem-csi-intel-com-webhook.pmem-csi.svc")
    );
    assert!(objects.contains_key("Issuer pmem-csi/pmem-csi-intel-com-webhook"));
    let hook = &objects["MutatingWebhookConfiguration /pmem-csi-intel-com-hook"];
    assert_eq!(
        hook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].as_str(),
        Some("pmem-csi/pmem-csi-intel-com-webhook")
    );
    let args = container_args(&objects, "pmem-driver");
    assert!(
        args.contains(&"--tls-cert-file=/certs/tls.crt".to_string()),
        "{args:?}"
    );
    assert!(!args.contains(&"--self-signed".to_string()), "{args:?}");
    assert!(
        !objects.contains_key("Role pmem-csi/pmem-csi-intel-com-webhook"),
        "no Secret rights without the self-signed CA"
    );

    let objects = normalised(&template(Some("existing-secret-values.yaml"), &[]).expect("renders"));
    let hook = &objects["MutatingWebhookConfiguration /pmem-csi-intel-com-hook"];
    assert!(hook["webhooks"][0]["clientConfig"]["caBundle"].is_string());
    let deployment = &objects["Deployment pmem-csi/pmem-csi-intel-com-controller"];
    let volumes = &deployment["spec"]["template"]["spec"]["volumes"];
    assert_eq!(
        volumes[1]["secret"]["secretName"].as_str(),
        Some("my-webhook-tls")
    );

    // A second instance shares no name with the default one, except objects that are
    // namespaced in its own namespace under the same names (none here).
    let first = normalised(&template(Some("lvm-all-values.yaml"), &[]).expect("renders"));
    let second = normalised(&template(Some("second-instance-values.yaml"), &[]).expect("renders"));
    let cluster_wide = |objects: &BTreeMap<String, Value>| -> Vec<String> {
        objects
            .iter()
            .filter(|(_, o)| o["metadata"]["namespace"].is_null())
            .map(|(k, _)| k.clone())
            .collect()
    };
    for key in cluster_wide(&second) {
        assert!(!first.contains_key(&key), "{key} would collide");
    }
    let driver = &second["CSIDriver /second.pmem-csi.intel.com"];
    assert_eq!(driver["spec"]["storageCapacity"].as_bool(), Some(true));
    let class = &second["StorageClass /second-pmem-csi-sc-ext4"];
    assert_eq!(
        class["provisioner"].as_str(),
        Some("second.pmem-csi.intel.com")
    );
}

fn container_args(objects: &BTreeMap<String, Value>, container: &str) -> Vec<String> {
    objects
        .values()
        .filter(|o| o["kind"].as_str() == Some("Deployment"))
        .flat_map(|o| {
            o["spec"]["template"]["spec"]["containers"]
                .as_sequence()
                .cloned()
                .unwrap_or_default()
        })
        .filter(|c| c["name"].as_str() == Some(container))
        .flat_map(|c| c["args"].as_sequence().cloned().unwrap_or_default())
        .filter_map(|a| a.as_str().map(str::to_string))
        .collect()
}

#[test]
fn bad_values_fail_naming_the_value() {
    for (set, value) in [
        ("deviceMode=pmem", "deviceMode"),
        ("webhook.certificates=vault", "webhook.certificates"),
        (
            "schedulerExtender.enabled=true,webhook.certificates=existingSecret",
            "webhook.existingSecret",
        ),
        ("nodeSelector=null", "nodeSelector"),
    ] {
        let error = template(None, &[set]).expect_err(set);
        assert!(error.contains(value), "{set}: {error}");
    }
}

/// The leaf keys of `value` as dotted paths with their defaults (lists and empty maps are
/// leaves).
fn leaves(prefix: &str, value: &Value, out: &mut BTreeMap<String, String>) {
    match value {
        Value::Mapping(map) if !map.is_empty() => {
            for (key, value) in map {
                let key = key.as_str().unwrap_or_default();
                let path = if prefix.is_empty() {
                    key.to_string()
                } else {
                    format!("{prefix}.{key}")
                };
                leaves(&path, value, out);
            }
        }
        other => {
            let text = serde_json::to_string(other).unwrap_or_default();
            out.insert(prefix.to_string(), text);
        }
    }
}

#[test]
fn the_readme_lists_every_value_with_its_default() {
    let values: Value = serde_yaml::from_str(
        &std::fs::read_to_string(chart().join("values.yaml")).expect("values.yaml"),
    )
    .expect("YAML");
    let mut want = BTreeMap::new();
    leaves("", &values, &mut want);
    let readme = std::fs::read_to_string(chart().join("README.md")).expect("README.md");
    // Rows: | `key` | `default` | meaning |
    let mut have = BTreeMap::new();
    for line in readme.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split(" | ").collect();
        let key = cells[0].trim_start_matches("| ").trim_matches('`');
        let default = cells
            .get(1)
            .map(|c| c.trim_matches('`'))
            .unwrap_or_default();
        have.insert(key.to_string(), default.to_string());
    }
    let missing: Vec<String> = want
        .iter()
        .filter(|(k, v)| have.get(*k) != Some(*v))
        .map(|(k, v)| format!("| `{k}` | `{v}` | … |"))
        .collect();
    let extra: Vec<&String> = have.keys().filter(|k| !want.contains_key(*k)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "charts/pmem-csi/README.md is out of date.\nmissing or wrong rows:\n{}\nrows of no value: {extra:?}",
        missing.join("\n")
    );
}
