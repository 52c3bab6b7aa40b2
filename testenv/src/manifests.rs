//! Our processes as the manifests describe them. testenv renders `manifests/overlays/emulated`
//! plus the `scheduler-extender` component with the tool cache's kubectl, applies the
//! cluster-side objects (Namespace, CSIDriver, StorageClasses, ServiceAccounts, RBAC, admission
//! policies) and starts every process of ours with the command line and environment of its
//! rendered container, changed only through [`Overrides`] — so a flag that the manifests get
//! wrong fails the tests.
//!
//! Sans-IO core: [`Rendered::launch`], [`Overrides::apply`] and [`expand`] are pure; only
//! [`Rendered::render`] runs kubectl.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_yaml::Value;

/// The overlay testenv (and kind) deploy.
pub const OVERLAY: &str = "manifests/overlays/emulated";
/// The opt-in component with the webhook and the extender.
pub const COMPONENT: &str = "manifests/components/scheduler-extender";
/// The opt-in component of the node-loss recovery (rendered with [`COMPONENT`]: its controller
/// runs with `--node-loss-grace=1h`, which tests shorten).
pub const NODE_LOSS_COMPONENT: &str = "manifests/components/node-loss-recovery";
/// The namespace the manifests install into.
pub const NAMESPACE: &str = "pmem-csi";
/// The namespace of a second instance ([`crate::instance`]): the API server audits its
/// ServiceAccounts' requests beside the first's (tests/two_instances.rs judges who wrote what).
pub const SECOND_NAMESPACE: &str = "pmem-csi-second";
/// The ValidatingAdmissionPolicy (and its binding) that lets the node ServiceAccount write only
/// the heartbeat Lease of the node its token is bound to (`manifests/base/node-lease-policy.yaml`).
pub const NODE_LEASE_POLICY: &str = "pmem-csi-intel-com-node-leases";

/// Kinds testenv applies from the rendered manifests: the objects the API server needs for our
/// processes to run as the manifests say. Workloads are not applied (testenv runs their
/// containers itself); the MutatingWebhookConfiguration names a Service testenv cannot route to,
/// so the webhook tests derive theirs from it with a URL instead.
pub const APPLIED_KINDS: &[&str] = &[
    "Namespace",
    "CSIDriver",
    "StorageClass",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
];

/// What can go wrong rendering or reading the manifests.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// kubectl could not be run or failed.
    #[error("kubectl kustomize {dir}: {reason}")]
    Render {
        /// The kustomization.
        dir: PathBuf,
        /// Why.
        reason: String,
    },
    /// helm could not be run or failed.
    #[error("helm template {chart}: {reason}")]
    Helm {
        /// The chart.
        chart: PathBuf,
        /// Why.
        reason: String,
    },
    /// The rendered output is not YAML of objects.
    #[error("rendered manifests: {0}")]
    Parse(String),
    /// A workload or container testenv runs is missing.
    #[error("rendered manifests have no container {container} in {kind} {name}")]
    MissingContainer {
        /// Workload kind.
        kind: &'static str,
        /// Workload name.
        name: String,
        /// Container name.
        container: &'static str,
    },
    /// A container uses something testenv cannot provide.
    #[error("container {container}: {reason}")]
    Unsupported {
        /// Container name.
        container: String,
        /// What.
        reason: String,
    },
}

/// A container of ours that testenv runs as a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OurContainer {
    /// `pmem-csi node` in the node DaemonSet.
    NodeDriver,
    /// external-provisioner in the node DaemonSet.
    Provisioner,
    /// `pmem-csi controller` in the controller Deployment.
    Controller,
    /// external-resizer in the controller Deployment.
    Resizer,
    /// `pmem-csi extender` in the extender DaemonSet (component).
    Extender,
}

impl OurContainer {
    /// (workload kind, workload name, container name) in manifests whose object names start
    /// with `prefix` (the driver name with dashes: `pmem-csi-intel-com`, or a second
    /// instance's, such as `second-pmem-csi-intel-com`).
    pub fn location(self, prefix: &str) -> (&'static str, String, &'static str) {
        let (kind, suffix, container) = match self {
            OurContainer::NodeDriver => ("DaemonSet", "node", "pmem-driver"),
            OurContainer::Provisioner => ("DaemonSet", "node", "external-provisioner"),
            OurContainer::Controller => ("Deployment", "controller", "pmem-driver"),
            OurContainer::Resizer => ("Deployment", "controller", "csi-resizer"),
            OurContainer::Extender => ("DaemonSet", "extender", "pmem-extender"),
        };
        (kind, format!("{prefix}-{suffix}"), container)
    }
}

/// The manifests' object-name prefix for driver `driver_name`: its dots become dashes
/// (`pmem-csi.intel.com` → `pmem-csi-intel-com`), as the manifests and the chart name them.
pub fn object_prefix(driver_name: &str) -> String {
    driver_name.replace('.', "-")
}

/// Where an environment variable's value comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnvValue {
    /// `value:`.
    Literal(String),
    /// `valueFrom.fieldRef.fieldPath`.
    Field(String),
}

/// A rendered container, ready to become a process: its command line after the binary, its
/// environment and its ServiceAccount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Arguments after the program (`node --endpoint=…` for ours).
    pub args: Vec<String>,
    /// Environment, in order.
    pub env: Vec<(String, EnvValue)>,
    /// The pod's `serviceAccountName`.
    pub service_account: String,
}

/// What the pod would know about itself: the values of the `fieldRef`s testenv supports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFacts {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace`.
    pub namespace: String,
    /// `spec.nodeName`.
    pub node_name: String,
}

impl Launch {
    /// The environment with `fieldRef`s resolved from `pod`.
    pub fn environment(&self, pod: &PodFacts) -> Result<Vec<(String, String)>, ManifestError> {
        self.env
            .iter()
            .map(|(key, value)| {
                let value = match value {
                    EnvValue::Literal(v) => v.clone(),
                    EnvValue::Field(path) => match path.as_str() {
                        "metadata.name" => pod.name.clone(),
                        "metadata.namespace" => pod.namespace.clone(),
                        "spec.nodeName" => pod.node_name.clone(),
                        other => {
                            return Err(ManifestError::Unsupported {
                                container: key.clone(),
                                reason: format!("fieldRef {other} is not simulated"),
                            });
                        }
                    },
                };
                Ok((key.clone(), value))
            })
            .collect()
    }

    /// The command line for `pod`: `$(VAR)` references expanded from the environment as the
    /// kubelet does, then `overrides` applied.
    pub fn command_line(
        &self,
        pod: &PodFacts,
        overrides: &Overrides,
    ) -> Result<Vec<String>, ManifestError> {
        let env: BTreeMap<String, String> = self.environment(pod)?.into_iter().collect();
        let expanded = self
            .args
            .iter()
            .map(|a| expand(a, &env))
            .collect::<Vec<_>>();
        Ok(overrides.apply(&expanded))
    }
}

/// Expands `$(VAR)` from `env` as the kubelet does: `$$` is a literal `$`, an unknown
/// reference stays as written.
pub fn expand(arg: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = String::with_capacity(arg.len());
    let mut rest = arg;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(stripped) = after.strip_prefix('$') {
            out.push('$');
            rest = stripped;
        } else if let Some(body) = after.strip_prefix('(')
            && let Some(end) = body.find(')')
        {
            let name = &body[..end];
            match env.get(name) {
                Some(value) => out.push_str(value),
                None => {
                    out.push_str("$(");
                    out.push_str(name);
                    out.push(')');
                }
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The one documented way testenv changes a rendered command line. Each entry names a flag
/// (`--name`) and either replaces its value in place (all its occurrences become one), adds it
/// at the end when absent, adds one more occurrence of a repeatable flag, or removes it. What
/// testenv itself overrides, and why:
///
/// | flag | why |
/// |---|---|
/// | `--endpoint`, `--csi-address`, `--state-dir`, `--emulated-dir` | per-node paths under the work directory (no container file system) |
/// | `--emulated-size` | per-node budgets of the scenario |
/// | `--admin-address`, `--extender-address`, `--webhook-address`, `--http-endpoint`, `--metrics-address` | ports: every process shares 127.0.0.1 |
/// | `--kubeconfig` | the provisioner's credentials (ours read `KUBECONFIG`): a ServiceAccount token instead of in-cluster config |
/// | `--timeout`, `--node-deployment-base-delay`, `--node-deployment-max-delay`, `--heartbeat-period` | short test values |
/// | `--heartbeat-grace` (controller) | removed unless [`crate::TestEnvBuilder::shipped_heartbeat`]: simulated nodes without a running driver have no heartbeat Lease |
///
/// Tests add their own short values (`--reschedule-grace`, `--heartbeat-grace`, certificate
/// validity, `--placement`, `--score`, …) through the same map.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    entries: Vec<(String, Override)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Override {
    Set(String),
    Add(String),
    Switch,
    Remove,
}

impl Overrides {
    /// No changes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses `--flag=value` / `--flag` / `!--flag` (remove) / `+--flag=value` (one more
    /// occurrence of a repeatable flag) items, as tests write them.
    pub fn from_args<I, S>(items: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut overrides = Self::new();
        for item in items {
            let item = item.as_ref();
            if let Some(flag) = item.strip_prefix('!') {
                overrides = overrides.remove(flag);
            } else if let Some(item) = item.strip_prefix('+') {
                overrides = match item.split_once('=') {
                    Some((flag, value)) => overrides.add(flag, value),
                    // Nothing to repeat without a value: the switch once.
                    None => overrides.switch(item),
                };
            } else if let Some((flag, value)) = item.split_once('=') {
                overrides = overrides.set(flag, value);
            } else {
                overrides = overrides.switch(item);
            }
        }
        overrides
    }

    /// `flag` gets `value` (replaced where it is, appended when absent).
    pub fn set(mut self, flag: &str, value: impl Into<String>) -> Self {
        self.entries
            .push((normalize(flag), Override::Set(value.into())));
        self
    }

    /// One more `flag=value` after the present ones, for repeatable flags
    /// (`--self-signed-san`, `--scheduler-names`); [`Overrides::set`] would collapse them.
    pub fn add(mut self, flag: &str, value: impl Into<String>) -> Self {
        self.entries
            .push((normalize(flag), Override::Add(value.into())));
        self
    }

    /// `flag` without a value (a boolean switch), appended when absent.
    pub fn switch(mut self, flag: &str) -> Self {
        self.entries.push((normalize(flag), Override::Switch));
        self
    }

    /// `flag` is dropped wherever it appears.
    pub fn remove(mut self, flag: &str) -> Self {
        self.entries.push((normalize(flag), Override::Remove));
        self
    }

    /// `self` followed by `later` (later entries win).
    pub fn and(mut self, later: &Overrides) -> Self {
        self.entries.extend(later.entries.iter().cloned());
        self
    }

    /// Whether the map leaves `flag` given: its last entry sets or switches it, not removes it.
    pub fn gives(&self, flag: &str) -> bool {
        let flag = normalize(flag);
        self.entries
            .iter()
            .rev()
            .find(|(f, _)| *f == flag)
            .is_some_and(|(_, action)| *action != Override::Remove)
    }

    /// The value the map last sets `flag` to, if its last entry for `flag` sets one.
    pub fn value_of(&self, flag: &str) -> Option<&str> {
        let flag = normalize(flag);
        match self.entries.iter().rev().find(|(f, _)| *f == flag) {
            Some((_, Override::Set(value))) => Some(value),
            _ => None,
        }
    }

    /// The flags this map touches.
    pub fn flags(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(f, _)| f.as_str())
    }

    /// `args` with every entry applied in order. Arguments are `--flag=value` or `--flag`
    /// (the manifests' style); anything else is kept as it is.
    pub fn apply(&self, args: &[String]) -> Vec<String> {
        let mut out: Vec<String> = args.to_vec();
        for (flag, action) in &self.entries {
            let position = out.iter().position(|a| flag_name(a) == Some(flag.as_str()));
            match action {
                Override::Remove => out.retain(|a| flag_name(a) != Some(flag.as_str())),
                Override::Set(value) => {
                    let item = format!("{flag}={value}");
                    out.retain({
                        let mut first = true;
                        move |a| {
                            // Keep the first occurrence (replaced below), drop repeats.
                            if flag_name(a) == Some(flag.as_str()) {
                                std::mem::replace(&mut first, false)
                            } else {
                                true
                            }
                        }
                    });
                    match position {
                        Some(_) => {
                            if let Some(slot) =
                                out.iter_mut().find(|a| flag_name(a) == Some(flag.as_str()))
                            {
                                *slot = item;
                            }
                        }
                        None => out.push(item),
                    }
                }
                Override::Add(value) => {
                    let item = format!("{flag}={value}");
                    let last = out
                        .iter()
                        .rposition(|a| flag_name(a) == Some(flag.as_str()));
                    match last {
                        Some(i) => out.insert(i + 1, item),
                        None => out.push(item),
                    }
                }
                Override::Switch => {
                    // A present `--flag=false` must not survive a request for `--flag`.
                    out.retain(|a| flag_name(a) != Some(flag.as_str()) || a == flag);
                    if !out.iter().any(|a| a == flag) {
                        match position {
                            Some(i) => out.insert(i.min(out.len()), flag.clone()),
                            None => out.push(flag.clone()),
                        }
                    }
                }
            }
        }
        out
    }
}

fn normalize(flag: &str) -> String {
    if flag.starts_with("--") {
        flag.to_string()
    } else {
        format!("--{}", flag.trim_start_matches('-'))
    }
}

/// `--name` of `--name=value` or `--name`; `None` for anything else.
pub fn flag_name(arg: &str) -> Option<&str> {
    if !arg.starts_with("--") {
        return None;
    }
    Some(arg.split_once('=').map_or(arg, |(name, _)| name))
}

/// The value of `flag` in `args` (`--flag=value`).
pub fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .find(|a| flag_name(a) == Some(flag))
        .and_then(|a| a.split_once('=').map(|(_, v)| v))
}

/// The rendered manifests of `overlays/emulated` plus the component.
#[derive(Clone, Debug)]
pub struct Rendered {
    objects: Vec<Value>,
}

impl Rendered {
    /// Renders `overlays/emulated`, with both components ([`COMPONENT`],
    /// [`NODE_LOSS_COMPONENT`]) when `with_component`, using `kubectl kustomize` (the
    /// components through a scratch kustomization under `scratch`).
    pub fn render(
        kubectl: &Path,
        repo: &Path,
        scratch: &Path,
        with_component: bool,
    ) -> Result<Self, ManifestError> {
        if !with_component {
            return Self::from_yaml(&kustomize(kubectl, &repo.join(OVERLAY))?);
        }
        let dir = scratch.join("kustomize");
        write_kustomization(
            &dir,
            &[repo.join(OVERLAY)],
            &[repo.join(COMPONENT), repo.join(NODE_LOSS_COMPONENT)],
        )?;
        Self::from_yaml(&kustomize(kubectl, &dir)?)
    }

    /// Parses `kubectl kustomize` output.
    pub fn from_yaml(text: &str) -> Result<Self, ManifestError> {
        let mut objects = Vec::new();
        for document in serde_yaml::Deserializer::from_str(text) {
            let value =
                Value::deserialize(document).map_err(|e| ManifestError::Parse(e.to_string()))?;
            if !value.is_null() {
                objects.push(value);
            }
        }
        Ok(Self { objects })
    }

    /// Every rendered object.
    pub fn objects(&self) -> &[Value] {
        &self.objects
    }

    /// The objects of `kinds`, in rendered order.
    pub fn of_kinds<'a>(&'a self, kinds: &'a [&str]) -> impl Iterator<Item = &'a Value> + 'a {
        self.objects
            .iter()
            .filter(move |o| kinds.contains(&o["kind"].as_str().unwrap_or_default()))
    }

    /// The object of `kind` named `name`.
    pub fn object(&self, kind: &str, name: &str) -> Option<&Value> {
        self.objects.iter().find(|o| {
            o["kind"].as_str() == Some(kind) && o["metadata"]["name"].as_str() == Some(name)
        })
    }

    /// The pod template of workload `kind`/`name`.
    pub fn pod_spec(&self, kind: &str, name: &str) -> Option<&Value> {
        self.object(kind, name)
            .map(|o| &o["spec"]["template"]["spec"])
            .filter(|s| !s.is_null())
    }

    /// The driver name of the rendered CSIDriver (the default's when there is none).
    pub fn driver_name(&self) -> &str {
        self.of_kinds(&["CSIDriver"])
            .next()
            .and_then(|o| o["metadata"]["name"].as_str())
            .unwrap_or(crate::nodes::DEFAULT_DRIVER_NAME)
    }

    /// The prefix of the rendered objects' names (see [`object_prefix`]).
    pub fn prefix(&self) -> String {
        object_prefix(self.driver_name())
    }

    /// The namespace the rendered workloads install into (the node DaemonSet's; [`NAMESPACE`]
    /// when it names none).
    pub fn namespace(&self) -> String {
        let (kind, name, _) = OurContainer::NodeDriver.location(&self.prefix());
        self.object(kind, &name)
            .and_then(|o| o["metadata"]["namespace"].as_str())
            .unwrap_or(NAMESPACE)
            .to_string()
    }

    /// The container `which`, as a process would run it.
    pub fn launch(&self, which: OurContainer) -> Result<Launch, ManifestError> {
        let (kind, name, container) = which.location(&self.prefix());
        let missing = || ManifestError::MissingContainer {
            kind,
            name: name.clone(),
            container,
        };
        let spec = self.pod_spec(kind, &name).ok_or_else(missing)?;
        let c = spec["containers"]
            .as_sequence()
            .into_iter()
            .flatten()
            .find(|c| c["name"].as_str() == Some(container))
            .ok_or_else(missing)?;
        launch_of(c, spec)
    }
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|v| match v {
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            Value::Bool(b) => Some(b.to_string()),
            _ => None,
        })
        .collect()
}

/// The command line after the program: `command[1..]` then `args` (kubelet's rule: `args`
/// follow `command`; without `command` the image's entrypoint — our binary — runs them).
fn launch_of(container: &Value, pod_spec: &Value) -> Result<Launch, ManifestError> {
    let name = container["name"].as_str().unwrap_or_default().to_string();
    let command = strings(&container["command"]);
    let mut args: Vec<String> = command.into_iter().skip(1).collect();
    args.extend(strings(&container["args"]));
    let mut env = Vec::new();
    for item in container["env"].as_sequence().into_iter().flatten() {
        let key = item["name"].as_str().unwrap_or_default().to_string();
        let value = if let Some(v) = item.get("value") {
            EnvValue::Literal(v.as_str().map(str::to_string).unwrap_or_else(|| {
                serde_yaml::to_string(v)
                    .unwrap_or_default()
                    .trim()
                    .to_string()
            }))
        } else if let Some(path) = item["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            EnvValue::Field(path.to_string())
        } else {
            return Err(ManifestError::Unsupported {
                container: name,
                reason: format!("env {key} has a source testenv does not simulate"),
            });
        };
        env.push((key, value));
    }
    if container.get("envFrom").is_some() {
        return Err(ManifestError::Unsupported {
            container: name,
            reason: "envFrom is not simulated".into(),
        });
    }
    Ok(Launch {
        args,
        env,
        service_account: pod_spec["serviceAccountName"]
            .as_str()
            .unwrap_or("default")
            .to_string(),
    })
}

/// Writes `<dir>/kustomization.yaml` (creating `dir`) with `resources` and `components`.
/// Absolute entries are written relative to `dir`, because kustomize refuses absolute paths;
/// relative ones are taken as relative to `dir` already.
pub fn write_kustomization(
    dir: &Path,
    resources: &[PathBuf],
    components: &[PathBuf],
) -> Result<(), ManifestError> {
    let error = |reason: String| ManifestError::Render {
        dir: dir.to_path_buf(),
        reason,
    };
    std::fs::create_dir_all(dir).map_err(|e| error(e.to_string()))?;
    let base = dir
        .canonicalize()
        .map_err(|e| error(format!("{}: {e}", dir.display())))?;
    let entry = |path: &PathBuf| -> Result<String, ManifestError> {
        if !path.is_absolute() {
            return Ok(format!("- {}\n", path.display()));
        }
        let path = path
            .canonicalize()
            .map_err(|e| error(format!("{}: {e}", path.display())))?;
        Ok(format!("- {}\n", relative(&base, &path).display()))
    };
    let mut text =
        String::from("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n");
    for (key, list) in [("resources", resources), ("components", components)] {
        if !list.is_empty() {
            text.push_str(key);
            text.push_str(":\n");
            for path in list {
                text.push_str(&entry(path)?);
            }
        }
    }
    std::fs::write(dir.join("kustomization.yaml"), text).map_err(|e| error(e.to_string()))
}

/// `target` as a path relative to directory `from` (both absolute): up to the root, then down.
pub fn relative(from: &Path, target: &Path) -> PathBuf {
    let mut path = PathBuf::new();
    for _ in from.components().skip(1) {
        path.push("..");
    }
    path.join(target.strip_prefix("/").unwrap_or(target))
}

/// The chart's objects as `helm install release chart -n namespace -f values…` would create
/// them: `helm template` (whose output is what install sends, hooks aside: the chart has none).
pub fn helm_template(
    helm: &Path,
    chart: &Path,
    release: &str,
    namespace: &str,
    values: &[PathBuf],
) -> Result<Rendered, ManifestError> {
    let mut command = Command::new(helm);
    command
        .args(["template", release])
        .arg(chart)
        .args(["--namespace", namespace]);
    for file in values {
        command.arg("--values").arg(file);
    }
    let error = |reason: String| ManifestError::Helm {
        chart: chart.to_path_buf(),
        reason,
    };
    let output = command
        .output()
        .map_err(|e| error(format!("{}: {e}", helm.display())))?;
    if !output.status.success() {
        return Err(error(
            String::from_utf8_lossy(&output.stderr).trim().to_string(),
        ));
    }
    Rendered::from_yaml(&String::from_utf8_lossy(&output.stdout))
}

/// Runs `kubectl kustomize dir`.
pub fn kustomize(kubectl: &Path, dir: &Path) -> Result<String, ManifestError> {
    let output = Command::new(kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .map_err(|e| ManifestError::Render {
            dir: dir.to_path_buf(),
            reason: format!("{}: {e}", kubectl.display()),
        })?;
    if !output.status.success() {
        return Err(ManifestError::Render {
            dir: dir.to_path_buf(),
            reason: String::from_utf8_lossy(&output.stderr).trim().to_string(),
        });
    }
    String::from_utf8(output.stdout).map_err(|e| ManifestError::Parse(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn gives_follows_the_last_entry() {
        for (items, want) in [
            (vec!["--webhook-address=127.0.0.1:1"], true),
            (vec!["webhook-address=127.0.0.1:1"], true),
            (vec!["--webhook-address"], true),
            (vec!["!--webhook-address"], false),
            (vec!["--webhook-address=x", "!--webhook-address"], false),
            (vec!["+--webhook-address=x"], true),
            (vec!["+--webhook-address"], true),
            (vec!["!--webhook-address", "--webhook-address=x"], true),
            (vec!["--webhook-address-other=x"], false),
            (vec![], false),
        ] {
            assert_eq!(
                Overrides::from_args(&items).gives("--webhook-address"),
                want,
                "{items:?}"
            );
        }
    }

    #[test]
    fn overrides_replace_add_and_remove() {
        type Case = (&'static str, Vec<String>, Overrides, Vec<&'static str>);
        let base = args(&["node", "--a=1", "--b", "--c=3"]);
        let cases: Vec<Case> = vec![
            (
                "none",
                base.clone(),
                Overrides::new(),
                vec!["node", "--a=1", "--b", "--c=3"],
            ),
            (
                "replace in place",
                base.clone(),
                Overrides::new().set("--a", "9"),
                vec!["node", "--a=9", "--b", "--c=3"],
            ),
            (
                "add at the end",
                base.clone(),
                Overrides::new().set("d", "4"),
                vec!["node", "--a=1", "--b", "--c=3", "--d=4"],
            ),
            (
                "value for a switch",
                base.clone(),
                Overrides::new().set("--b", "false"),
                vec!["node", "--a=1", "--b=false", "--c=3"],
            ),
            (
                "remove",
                base.clone(),
                Overrides::new().remove("--c").remove("--b"),
                vec!["node", "--a=1"],
            ),
            (
                "add after the last occurrence",
                args(&["node", "--s=x", "--a=1", "--s=y", "--c=3"]),
                Overrides::new().add("--s", "z"),
                vec!["node", "--s=x", "--a=1", "--s=y", "--s=z", "--c=3"],
            ),
            (
                "add an absent flag at the end",
                base.clone(),
                Overrides::new().add("s", "z").add("--s", "w"),
                vec!["node", "--a=1", "--b", "--c=3", "--s=z", "--s=w"],
            ),
            (
                "set collapses repeats, add repeats again",
                args(&["node", "--s=x", "--s=y"]),
                Overrides::from_args(["--s=v", "+--s=w"]),
                vec!["node", "--s=v", "--s=w"],
            ),
            (
                "switch replaces a value in place",
                args(&["node", "--b=false", "--c=3"]),
                Overrides::new().switch("--b"),
                vec!["node", "--b", "--c=3"],
            ),
            (
                "switch present stays once",
                base.clone(),
                Overrides::new().switch("--b"),
                vec!["node", "--a=1", "--b", "--c=3"],
            ),
            (
                "later wins",
                base.clone(),
                Overrides::new().set("--a", "2").set("--a", "3"),
                vec!["node", "--a=3", "--b", "--c=3"],
            ),
            (
                "repeats collapse to the first position",
                args(&["--x=1", "--y", "--x=2"]),
                Overrides::new().set("--x", "5"),
                vec!["--x=5", "--y"],
            ),
            (
                "prefix is not a match",
                args(&["--ab=1"]),
                Overrides::new().remove("--a"),
                vec!["--ab=1"],
            ),
            (
                "from test items",
                base.clone(),
                Overrides::from_args(["--a=7", "!--c", "--e"]),
                vec!["node", "--a=7", "--b", "--e"],
            ),
        ];
        for (name, input, overrides, want) in cases {
            assert_eq!(overrides.apply(&input), args(&want), "{name}");
        }
    }

    #[test]
    fn expansion_follows_the_kubelet() {
        let env = BTreeMap::from([
            ("NODE_NAME".to_string(), "node-1".to_string()),
            ("DIR".to_string(), "/var/lib/kubelet".to_string()),
        ]);
        for (input, want) in [
            ("--node-id=$(NODE_NAME)", "--node-id=node-1"),
            (
                "$(DIR)/plugins/$(NODE_NAME)",
                "/var/lib/kubelet/plugins/node-1",
            ),
            ("$$(NODE_NAME)", "$(NODE_NAME)"),
            ("$(MISSING)", "$(MISSING)"),
            ("cost $5", "cost $5"),
            ("$(unterminated", "$(unterminated"),
            ("$", "$"),
        ] {
            assert_eq!(expand(input, &env), want, "{input}");
        }
    }

    const RENDERED: &str = r#"
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: pmem-csi-intel-com-node
spec:
  template:
    spec:
      serviceAccountName: pmem-csi-intel-com-node
      containers:
      - name: pmem-driver
        command: [pmem-csi]
        args: [node, --node-id=$(NODE_NAME), --admin-address=:10011]
        env:
        - name: NODE_NAME
          valueFrom:
            fieldRef: {fieldPath: spec.nodeName}
        - name: PORT
          value: "1"
      - name: external-provisioner
        args: ["--csi-address=/csi/csi.sock"]
        env:
        - name: SECRET
          valueFrom:
            secretKeyRef: {name: s, key: k}
---
apiVersion: v1
kind: Namespace
metadata:
  name: pmem-csi
"#;

    #[test]
    fn launch_from_rendered_container() {
        let rendered = Rendered::from_yaml(RENDERED).expect("parse");
        assert_eq!(rendered.objects().len(), 2);
        assert_eq!(rendered.of_kinds(&["Namespace"]).count(), 1);
        let launch = rendered.launch(OurContainer::NodeDriver).expect("driver");
        assert_eq!(launch.service_account, "pmem-csi-intel-com-node");
        let pod = PodFacts {
            name: "p".into(),
            namespace: "pmem-csi".into(),
            node_name: "node-7".into(),
        };
        let line = launch
            .command_line(
                &pod,
                &Overrides::new().set("--admin-address", "127.0.0.1:0"),
            )
            .expect("command line");
        assert_eq!(
            line,
            args(&["node", "--node-id=node-7", "--admin-address=127.0.0.1:0"])
        );
        assert_eq!(
            launch.environment(&pod).expect("env"),
            vec![
                ("NODE_NAME".to_string(), "node-7".to_string()),
                ("PORT".to_string(), "1".to_string())
            ]
        );
        let err = rendered
            .launch(OurContainer::Provisioner)
            .expect_err("secret env is not simulated");
        assert!(err.to_string().contains("SECRET"), "{err}");
        let err = rendered
            .launch(OurContainer::Controller)
            .expect_err("no controller");
        assert!(
            err.to_string().contains("pmem-csi-intel-com-controller"),
            "{err}"
        );
    }

    #[test]
    fn relative_paths_go_up_to_the_root() {
        assert_eq!(
            relative(
                Path::new("/tmp/x/kustomize"),
                Path::new("/work/main/manifests")
            ),
            PathBuf::from("../../../work/main/manifests")
        );
        assert_eq!(
            relative(Path::new("/"), Path::new("/a")),
            PathBuf::from("a")
        );
    }

    #[test]
    fn flag_helpers() {
        let line = args(&["node", "--a=1", "--b", "-c"]);
        assert_eq!(flag_value(&line, "--a"), Some("1"));
        assert_eq!(flag_value(&line, "--b"), None);
        assert_eq!(flag_name("--b"), Some("--b"));
        assert_eq!(flag_name("-c"), None);
        assert_eq!(flag_name("node"), None);
    }
}
