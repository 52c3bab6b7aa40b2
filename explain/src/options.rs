//! The flags of `pmem-csi explain` and the configuration validated from them.

use std::time::Duration;

use controllers::flags;
use controllers::node_selector::NodeSelector;

use crate::ExplainError;

/// Flags of `pmem-csi explain`.
#[derive(clap::Args, Debug, Clone)]
pub struct ExplainArgs {
    /// What to explain: `pod/NAME`.
    pub target: String,

    /// The pod's namespace (default: the kubeconfig context's).
    #[arg(short = 'n', long)]
    pub namespace: Option<String>,

    /// Output: plain words, or the same as JSON.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
    pub output: Output,

    /// The extender's admin server (`http://127.0.0.1:10012`); default: an extender pod of the
    /// driver's namespace, through the apiserver's pod proxy.
    #[arg(long)]
    pub extender: Option<String>,

    /// CSI driver name.
    #[arg(
        long,
        env = "PMEM_CSI_DRIVER_NAME",
        default_value = "pmem-csi.intel.com"
    )]
    pub driver_name: String,

    /// The driver's namespace (capacity objects, heartbeat Leases, the extender).
    #[arg(long, default_value = "pmem-csi")]
    pub driver_namespace: String,

    /// The driver's `--node-selector` (nodes meant to run it).
    #[arg(long, default_value = "storage=pmem", value_parser = flags::node_selector)]
    pub node_selector: NodeSelector,

    /// Judge the nodes' heartbeat Leases as the controller's `--heartbeat-grace` does (the
    /// shipped controller's value by default).
    #[arg(long, default_value = "1m", value_parser = flags::duration)]
    pub heartbeat_grace: Duration,

    /// Do not read heartbeat Leases (as a controller without `--heartbeat-grace`).
    #[arg(long)]
    pub ignore_heartbeats: bool,

    /// The size assumed for a volume that states none (the driver's `--default-volume-size`).
    #[arg(long, default_value = "1Gi", value_parser = flags::bytes)]
    pub default_volume_size: u64,
}

/// The output format.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Plain words.
    Text,
    /// [`crate::explanation::Explanation`] as JSON.
    Json,
}

/// How to reach the extender.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtenderAccess {
    /// Its admin server's URL.
    Url(String),
    /// Through the apiserver's pod proxy.
    PodProxy,
}

/// Validated configuration of one `explain` run.
#[derive(Clone, Debug)]
pub struct ExplainConfig {
    /// The pod's name.
    pub pod: String,
    /// Its namespace, when given.
    pub namespace: Option<String>,
    /// Output format.
    pub output: Output,
    /// How to reach the extender.
    pub extender: ExtenderAccess,
    /// Driver name.
    pub driver: String,
    /// Driver namespace.
    pub driver_namespace: String,
    /// Node selector.
    pub node_selector: NodeSelector,
    /// Heartbeat grace, when Leases are judged.
    pub heartbeat_grace: Option<Duration>,
    /// Default volume size.
    pub default_volume_size: u64,
}

impl ExplainArgs {
    /// Validates the flags.
    pub fn validate(&self) -> Result<ExplainConfig, ExplainError> {
        let pod = parse_target(&self.target)?;
        let extender = match &self.extender {
            Some(url) if url.starts_with("http://") => ExtenderAccess::Url(url.clone()),
            Some(url) => {
                return Err(ExplainError::ExtenderUrl { url: url.clone() });
            }
            None => ExtenderAccess::PodProxy,
        };
        Ok(ExplainConfig {
            pod,
            namespace: self.namespace.clone().filter(|n| !n.is_empty()),
            output: self.output,
            extender,
            driver: self.driver_name.clone(),
            driver_namespace: self.driver_namespace.clone(),
            node_selector: self.node_selector.clone(),
            heartbeat_grace: (!self.ignore_heartbeats).then_some(self.heartbeat_grace),
            default_volume_size: self.default_volume_size,
        })
    }
}

/// The pod name of `pod/NAME` (`pods/NAME`, `po/NAME` as kubectl accepts them).
pub fn parse_target(target: &str) -> Result<String, ExplainError> {
    match target.split_once('/') {
        Some(("pod" | "pods" | "po", name)) if !name.is_empty() && !name.contains('/') => {
            Ok(name.to_string())
        }
        _ => Err(ExplainError::Target {
            given: target.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_target_table() {
        for (given, want) in [
            ("pod/web-0", Some("web-0")),
            ("pods/web-0", Some("web-0")),
            ("po/a", Some("a")),
            ("web-0", None),
            ("pod/", None),
            ("deployment/web", None),
            ("pod/a/b", None),
        ] {
            assert_eq!(parse_target(given).ok().as_deref(), want, "{given}");
        }
    }
}
