//! The `KubeSchedulerConfiguration` kube-scheduler runs with; callers add extenders and plugin
//! arguments before the testenv starts.

use std::path::Path;

use serde_json::{Value, json};

/// VolumeBinding's bind timeout in tests: long enough for provisioning on a loaded 2-core
/// machine, short enough that a failure shows within a test (benchmarks use 600, the default).
pub const TEST_BIND_TIMEOUT_SECONDS: u64 = 30;

/// The scheduler manifest could not be read.
#[derive(Debug, thiserror::Error)]
#[error("reading the scheduler manifest: {0}")]
pub struct ManifestError(String);

/// A kube-scheduler configuration under construction.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    bind_timeout_seconds: u64,
    extenders: Vec<Value>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            bind_timeout_seconds: TEST_BIND_TIMEOUT_SECONDS,
            extenders: Vec::new(),
        }
    }
}

impl SchedulerConfig {
    /// Sets VolumeBinding's `bindTimeoutSeconds`.
    pub fn bind_timeout_seconds(mut self, seconds: u64) -> Self {
        self.bind_timeout_seconds = seconds;
        self
    }

    /// Adds an entry to `extenders` (the `Extender` type of `kubescheduler.config.k8s.io/v1`).
    pub fn extender(mut self, extender: Value) -> Self {
        self.extenders.push(extender);
        self
    }

    /// Adds the extender entry of `manifests/scheduler/scheduler-config.yaml`, pointed at
    /// `127.0.0.1:<port>` and renamed for `driver`, so that tests run what users deploy.
    pub fn manifest_extender(self, port: u16, driver: &str) -> Result<Self, ManifestError> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../manifests/scheduler/scheduler-config.yaml");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| ManifestError(format!("{}: {e}", path.display())))?;
        let document: Value = serde_yaml::from_str(&text)
            .map_err(|e| ManifestError(format!("{}: {e}", path.display())))?;
        let mut extender = document["extenders"][0].clone();
        if !extender.is_object() {
            return Err(ManifestError(format!(
                "{}: no extenders[0]",
                path.display()
            )));
        }
        extender["urlPrefix"] = json!(format!("http://127.0.0.1:{port}"));
        extender["managedResources"][0]["name"] =
            json!(controllers::well_known::scheduler_resource(driver));
        Ok(self.extender(extender))
    }

    /// The configuration document, with the scheduler's kubeconfig.
    pub fn render(&self, kubeconfig: &Path) -> Value {
        json!({
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": kubeconfig},
            // Flags such as --leader-elect are ignored once --config is given.
            "leaderElection": {"leaderElect": false},
            // Retry unschedulable pods quickly: tests change capacity and expect a reaction.
            "podInitialBackoffSeconds": 1,
            "podMaxBackoffSeconds": 2,
            "percentageOfNodesToScore": 100,
            "profiles": [{
                "schedulerName": "default-scheduler",
                "pluginConfig": [{
                    "name": "VolumeBinding",
                    "args": {"bindTimeoutSeconds": self.bind_timeout_seconds},
                }],
            }],
            "extenders": self.extenders,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_extender_is_the_shipped_one_on_a_test_port() {
        let config = SchedulerConfig::default()
            .manifest_extender(4321, "example.com")
            .expect("manifest")
            .render(Path::new("/k"));
        let extender = &config["extenders"][0];
        assert_eq!(extender["urlPrefix"], "http://127.0.0.1:4321");
        assert_eq!(
            extender["managedResources"][0]["name"],
            "example.com/scheduler"
        );
        assert_eq!(extender["managedResources"][0]["ignoredByScheduler"], true);
        assert_eq!(extender["nodeCacheCapable"], true);
        assert_eq!(extender["ignorable"], false);
        assert_eq!(extender["preemptVerb"], "preempt");
    }

    #[test]
    fn render_carries_bind_timeout_and_extenders() {
        let config = SchedulerConfig::default()
            .bind_timeout_seconds(600)
            .extender(json!({"urlPrefix": "http://127.0.0.1:1"}))
            .render(Path::new("/k"));
        assert_eq!(config["clientConnection"]["kubeconfig"], "/k");
        assert_eq!(
            config["profiles"][0]["pluginConfig"][0]["args"]["bindTimeoutSeconds"],
            600
        );
        assert_eq!(config["extenders"][0]["urlPrefix"], "http://127.0.0.1:1");
        assert_eq!(
            SchedulerConfig::default().render(Path::new("/k"))["profiles"][0]["pluginConfig"][0]["args"]
                ["bindTimeoutSeconds"],
            TEST_BIND_TIMEOUT_SECONDS
        );
    }
}
