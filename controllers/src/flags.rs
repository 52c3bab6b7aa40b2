//! Flags that several subcommands share, defined once and parsed by clap into typed values:
//! the apiserver client's budget and the driver liveness judgement (controller and extender),
//! and the value parsers for durations and node selectors every subcommand uses.

use std::time::Duration;

use crate::liveness_view::LivenessSettings;
use crate::node_selector::NodeSelector;

/// A flag whose value parses but does not make sense with the others.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--{flag}: {reason}")]
pub struct FlagError {
    /// The flag, without dashes.
    pub flag: &'static str,
    /// Why.
    pub reason: String,
}

impl FlagError {
    /// An error about `flag`.
    pub fn new(flag: &'static str, reason: impl Into<String>) -> Self {
        FlagError {
            flag,
            reason: reason.into(),
        }
    }
}

/// clap value parser of durations: `500ms`, `30s`, `10m`, `1h`, `1m30s`.
pub fn duration(text: &str) -> Result<Duration, String> {
    crate::duration::parse_duration(text)
}

/// clap value parser of node selectors: `k=v[,k=v]` or PMEM-CSI 1.0's JSON map.
pub fn node_selector(text: &str) -> Result<NodeSelector, String> {
    NodeSelector::parse(text).map_err(|e| e.reason)
}

/// clap value parser of byte sizes: a Kubernetes quantity (`1Gi`, `512Mi`, `1000000`).
pub fn bytes(text: &str) -> Result<u64, String> {
    crate::quantity::parse_bytes(text).map_err(|e| e.to_string())
}

/// How many requests a client may send: a token bucket as client-go has (kube-rs has none).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClientBudget {
    /// Requests per second; 0 disables the limit.
    pub qps: f64,
    /// Requests that may go at once before `qps` applies.
    pub burst: u32,
}

/// `--kube-api-qps` and `--kube-api-burst` of the controller and the extender.
#[derive(clap::Args, Debug, Clone)]
pub struct KubeApiArgs {
    /// Requests per second to the apiserver (client-side token bucket; 0 disables).
    #[arg(long, default_value_t = 20.0)]
    pub kube_api_qps: f64,

    /// Requests the client may send at once before `--kube-api-qps` applies.
    #[arg(long, default_value_t = 40)]
    pub kube_api_burst: u32,
}

impl KubeApiArgs {
    /// The client's budget.
    pub fn budget(&self) -> ClientBudget {
        ClientBudget {
            qps: self.kube_api_qps,
            burst: self.kube_api_burst,
        }
    }
}

/// The flags of the driver liveness judgement, which the controller (rescheduler, clean-up)
/// and the extender (driverless nodes filtered out) make alike.
#[derive(clap::Args, Debug, Clone)]
pub struct LivenessArgs {
    /// CSI driver name.
    #[arg(
        long,
        env = "PMEM_CSI_DRIVER_NAME",
        default_value = "pmem-csi.intel.com"
    )]
    pub driver_name: String,

    /// Labels of the nodes meant to run the driver: `k=v[,k=v]` or a JSON map. Required.
    #[arg(long, value_parser = node_selector)]
    pub node_selector: Option<NodeSelector>,

    /// How long a node must look driverless before it counts as such (its claims are
    /// rescheduled, the extender filters it out).
    #[arg(long, default_value = "30s", value_parser = duration)]
    pub reschedule_grace: Duration,

    /// Also judge a node driverless when its heartbeat Lease has been expired this long.
    #[arg(long, value_parser = duration)]
    pub heartbeat_grace: Option<Duration>,

    /// The driver's namespace (heartbeat and leader Leases, capacity objects).
    #[arg(long, env = "POD_NAMESPACE", default_value = "pmem-csi")]
    pub namespace: String,
}

impl LivenessArgs {
    /// The judgement's settings.
    pub fn settings(&self) -> Result<LivenessSettings, FlagError> {
        let selector = self.node_selector.clone().ok_or_else(|| {
            FlagError::new("node-selector", "required (for example storage=pmem)")
        })?;
        if self.namespace.is_empty() {
            return Err(FlagError::new("namespace", "must not be empty"));
        }
        Ok(LivenessSettings {
            driver: self.driver_name.clone(),
            selector,
            grace: self.reschedule_grace,
            heartbeat: self.heartbeat_grace,
            namespace: self.namespace.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        liveness: LivenessArgs,
        #[command(flatten)]
        kube_api: KubeApiArgs,
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("test").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_and_typed_values() {
        let cli = parse(&[
            "--node-selector",
            "storage=pmem",
            "--heartbeat-grace",
            "1m30s",
        ])
        .expect("parses");
        let settings = cli.liveness.settings().expect("valid");
        assert_eq!(settings.driver, "pmem-csi.intel.com");
        assert_eq!(settings.grace, Duration::from_secs(30));
        assert_eq!(settings.heartbeat, Some(Duration::from_secs(90)));
        assert_eq!(
            settings.selector,
            NodeSelector::parse("storage=pmem").expect("selector")
        );
        assert_eq!(
            cli.kube_api.budget(),
            ClientBudget {
                qps: 20.0,
                burst: 40
            }
        );
    }

    #[test]
    fn bad_values_name_their_flag() {
        for (args, flag) in [
            (&["--reschedule-grace", "soon"][..], "--reschedule-grace"),
            (&["--heartbeat-grace", "1x"], "--heartbeat-grace"),
            (&["--node-selector", ""], "--node-selector"),
            (&["--kube-api-burst", "many"], "--kube-api-burst"),
        ] {
            let message = parse(args).expect_err("refused").to_string();
            assert!(message.contains(flag), "{args:?}: {message}");
        }
        for (args, flag) in [
            (&[][..], "node-selector"),
            (&["--node-selector", "a=b", "--namespace", ""], "namespace"),
        ] {
            let cli = parse(args).expect("parses");
            assert_eq!(cli.liveness.settings().expect_err("invalid").flag, flag);
        }
    }
}
