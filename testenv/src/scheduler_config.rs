//! The `KubeSchedulerConfiguration` kube-scheduler runs with; callers add extenders and plugin
//! arguments before the testenv starts.

use std::path::Path;

use serde_json::{Value, json};

/// VolumeBinding's bind timeout in tests: long enough for provisioning on a loaded 2-core
/// machine, short enough that a failure shows within a test (benchmarks use 600, the default).
pub const TEST_BIND_TIMEOUT_SECONDS: u64 = 30;

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
