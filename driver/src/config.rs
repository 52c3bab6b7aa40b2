//! `pmem-csi node` flags and their validation into one [`NodeConfig`].

use std::path::PathBuf;

use crate::backend::DeviceMode;
use crate::filesystem::FsType;
use std::time::Duration;

use controllers::flags::{self, ClientBudget};

/// Flags of `pmem-csi node`.
#[derive(clap::Args, Debug, Clone)]
pub struct NodeArgs {
    /// CSI endpoint, `unix:///path/to/socket`.
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    pub endpoint: String,

    /// This node's name (the topology value and the node ID of NodeGetInfo).
    #[arg(long, env = "NODE_NAME")]
    pub node_id: Option<String>,

    /// CSI driver name.
    #[arg(
        long,
        env = "PMEM_CSI_DRIVER_NAME",
        default_value = "pmem-csi.intel.com"
    )]
    pub driver_name: String,

    /// Where volumes live.
    #[arg(long, value_enum)]
    pub device_mode: Option<DeviceMode>,

    /// Node state directory (default `/var/lib/<driver-name>`).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,

    /// Directory of the emulated region (emulated mode).
    #[arg(long)]
    pub emulated_dir: Option<PathBuf>,

    /// Size of the emulated (or fake) region, a quantity such as `4Gi`.
    #[arg(long, value_parser = flags::bytes)]
    pub emulated_size: Option<u64>,

    /// Percentage of each PMEM region the `lvm` mode puts in its volume group (0 to 100;
    /// default 100). A restart with a larger value adds the difference.
    #[arg(long)]
    pub pmem_percentage: Option<u8>,

    /// Size of a volume created without a capacity range, a quantity.
    #[arg(long, default_value = "1Gi", value_parser = flags::bytes)]
    pub default_volume_size: u64,

    /// File system when a volume capability names none.
    #[arg(long, value_enum, default_value_t = FsType::Ext4)]
    pub default_fs_type: FsType,

    /// Run without the Kubernetes API: no capacity objects (for csi-sanity and local tests).
    #[arg(long)]
    pub standalone: bool,

    /// The driver's namespace (capacity objects, heartbeat Lease).
    #[arg(long, env = "POD_NAMESPACE", default_value = "pmem-csi")]
    pub namespace: String,

    /// How often the heartbeat Lease is renewed (`0s` disables the heartbeat).
    #[arg(long, default_value = "10s", value_parser = flags::duration)]
    pub heartbeat_period: Duration,

    /// Age after which a volume whose claim went elsewhere is deleted by the orphan sweep.
    #[arg(long, default_value = "10m", value_parser = flags::duration)]
    pub orphan_grace: Duration,

    /// How long one run of lvm, ndctl, mkfs, blkid or losetup may take before it is killed and
    /// its call fails with DeadlineExceeded (a hung tool would hold the node's backend lock).
    #[arg(long, default_value = "2m", value_parser = flags::duration)]
    pub tool_timeout: Duration,

    /// Requests per second to the apiserver (client-side token bucket; 0 disables). Every
    /// node runs a driver, so this multiplies by the cluster size.
    #[arg(long, default_value_t = 5.0)]
    pub kube_api_qps: f64,

    /// Requests the client may send at once before `--kube-api-qps` applies.
    #[arg(long, default_value_t = 10)]
    pub kube_api_burst: u32,
}

/// Validated node configuration.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// Socket path.
    pub socket: PathBuf,
    /// Node name.
    pub node_id: String,
    /// Driver name.
    pub driver_name: String,
    /// Backend.
    pub device_mode: DeviceMode,
    /// State directory.
    pub state_dir: PathBuf,
    /// Emulated region directory (emulated mode only).
    pub emulated_dir: Option<PathBuf>,
    /// Region size in bytes (emulated and fake).
    pub emulated_size: u64,
    /// Share of each region for the `lvm` mode's volume groups, in percent.
    pub pmem_percentage: u8,
    /// Default volume size in bytes.
    pub default_volume_size: u64,
    /// Default file system.
    pub default_fs_type: FsType,
    /// No Kubernetes API.
    pub standalone: bool,
    /// Namespace of the capacity objects.
    pub namespace: String,
    /// Heartbeat renew period; `None` disables it.
    pub heartbeat_period: Option<std::time::Duration>,
    /// Orphan sweep grace.
    pub orphan_grace: std::time::Duration,
    /// The client's budget.
    pub kube_api: ClientBudget,
    /// Timeout of one tool run.
    pub tool_timeout: std::time::Duration,
}

/// A flag is missing, malformed or does not fit the mode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--{flag}: {reason}")]
pub struct ConfigError {
    /// The flag.
    pub flag: &'static str,
    /// Why.
    pub reason: String,
}

fn invalid(flag: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        flag,
        reason: reason.into(),
    }
}

impl NodeArgs {
    /// Validates the flags.
    pub fn validate(&self) -> Result<NodeConfig, ConfigError> {
        let socket = self
            .endpoint
            .strip_prefix("unix://")
            .filter(|p| p.starts_with('/'))
            .map(PathBuf::from)
            .ok_or_else(|| {
                invalid(
                    "endpoint",
                    format!("{:?} is not unix:///absolute/path", self.endpoint),
                )
            })?;
        let node_id = self
            .node_id
            .clone()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| invalid("node-id", "required (or set NODE_NAME)"))?;
        if self.driver_name.is_empty() || self.driver_name.len() > 63 {
            return Err(invalid("driver-name", "must be 1 to 63 characters"));
        }
        let device_mode = self
            .device_mode
            .ok_or_else(|| invalid("device-mode", "required (emulated, fake, lvm or direct)"))?;
        let simulated = matches!(device_mode, DeviceMode::Emulated | DeviceMode::Fake);
        let emulated_size = match (self.emulated_size, simulated) {
            (Some(size), true) => size,
            (None, true) => {
                return Err(invalid(
                    "emulated-size",
                    format!("required with --device-mode={}", device_mode.as_str()),
                ));
            }
            (Some(_), false) => {
                return Err(invalid(
                    "emulated-size",
                    "only used with --device-mode=emulated or fake",
                ));
            }
            (None, false) => 0,
        };
        if simulated && emulated_size == 0 {
            return Err(invalid("emulated-size", "must be larger than 0"));
        }
        let emulated_dir = match (device_mode, &self.emulated_dir) {
            (DeviceMode::Emulated, Some(dir)) => Some(dir.clone()),
            (DeviceMode::Emulated, None) => {
                return Err(invalid(
                    "emulated-dir",
                    "required with --device-mode=emulated",
                ));
            }
            (_, Some(_)) => {
                return Err(invalid(
                    "emulated-dir",
                    "only used with --device-mode=emulated",
                ));
            }
            (_, None) => None,
        };
        let pmem_percentage = match (self.pmem_percentage, device_mode) {
            (Some(p), _) if p > 100 => {
                return Err(invalid(
                    "pmem-percentage",
                    format!("{p} is not a percentage (0 to 100)"),
                ));
            }
            (Some(p), DeviceMode::Lvm) => p,
            (Some(_), _) => {
                return Err(invalid(
                    "pmem-percentage",
                    "only used with --device-mode=lvm",
                ));
            }
            (None, _) => 100,
        };
        let default_volume_size = self.default_volume_size;
        if default_volume_size == 0 {
            return Err(invalid("default-volume-size", "must be larger than 0"));
        }
        Ok(NodeConfig {
            socket,
            node_id,
            driver_name: self.driver_name.clone(),
            device_mode,
            state_dir: self
                .state_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from("/var/lib").join(&self.driver_name)),
            emulated_dir,
            emulated_size,
            pmem_percentage,
            default_volume_size,
            default_fs_type: self.default_fs_type,
            standalone: self.standalone,
            namespace: self.namespace.clone(),
            heartbeat_period: (!self.heartbeat_period.is_zero()).then_some(self.heartbeat_period),
            orphan_grace: self.orphan_grace,
            kube_api: ClientBudget {
                qps: self.kube_api_qps,
                burst: self.kube_api_burst,
            },
            tool_timeout: {
                if self.tool_timeout.is_zero() {
                    return Err(invalid("tool-timeout", "must be above zero"));
                }
                self.tool_timeout
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> NodeArgs {
        NodeArgs {
            endpoint: "unix:///tmp/x.sock".into(),
            node_id: Some("node-1".into()),
            driver_name: "pmem-csi.intel.com".into(),
            device_mode: Some(DeviceMode::Emulated),
            state_dir: None,
            emulated_dir: Some("/tmp/pmem".into()),
            emulated_size: Some(1 << 30),
            pmem_percentage: None,
            default_volume_size: 64 << 20,
            default_fs_type: FsType::Ext4,
            standalone: true,
            namespace: "pmem-csi".into(),
            heartbeat_period: Duration::from_secs(10),
            orphan_grace: Duration::from_secs(600),
            kube_api_qps: 5.0,
            kube_api_burst: 10,
            tool_timeout: Duration::from_secs(120),
        }
    }

    #[test]
    fn validate_table() {
        type Edit = fn(&mut NodeArgs);
        let cases: [(&str, Edit, Option<&str>); 16] = [
            ("valid", |_| {}, None),
            (
                "tcp endpoint",
                |a| a.endpoint = "tcp://1.2.3.4:5".into(),
                Some("endpoint"),
            ),
            (
                "relative socket",
                |a| a.endpoint = "unix://x.sock".into(),
                Some("endpoint"),
            ),
            ("no node", |a| a.node_id = None, Some("node-id")),
            ("no mode", |a| a.device_mode = None, Some("device-mode")),
            ("no size", |a| a.emulated_size = None, Some("emulated-size")),
            (
                "emulated without dir",
                |a| a.emulated_dir = None,
                Some("emulated-dir"),
            ),
            (
                "fake with dir",
                |a| a.device_mode = Some(DeviceMode::Fake),
                Some("emulated-dir"),
            ),
            (
                "lvm",
                |a| {
                    a.device_mode = Some(DeviceMode::Lvm);
                    a.emulated_dir = None;
                    a.emulated_size = None;
                    a.pmem_percentage = Some(50);
                },
                None,
            ),
            (
                "lvm with a region size",
                |a| {
                    a.device_mode = Some(DeviceMode::Lvm);
                    a.emulated_dir = None;
                },
                Some("emulated-size"),
            ),
            (
                "direct with a region dir",
                |a| {
                    a.device_mode = Some(DeviceMode::Direct);
                    a.emulated_size = None;
                },
                Some("emulated-dir"),
            ),
            (
                "percentage over 100",
                |a| {
                    a.device_mode = Some(DeviceMode::Lvm);
                    a.emulated_dir = None;
                    a.emulated_size = None;
                    a.pmem_percentage = Some(101);
                },
                Some("pmem-percentage"),
            ),
            (
                "zero tool timeout",
                |a| a.tool_timeout = Duration::ZERO,
                Some("tool-timeout"),
            ),
            (
                "percentage in direct mode",
                |a| {
                    a.device_mode = Some(DeviceMode::Direct);
                    a.emulated_dir = None;
                    a.emulated_size = None;
                    a.pmem_percentage = Some(50);
                },
                Some("pmem-percentage"),
            ),
            (
                "emulated with a percentage",
                |a| a.pmem_percentage = Some(50),
                Some("pmem-percentage"),
            ),
            (
                "zero default size",
                |a| a.default_volume_size = 0,
                Some("default-volume-size"),
            ),
        ];
        for (name, edit, flag) in cases {
            let mut a = args();
            edit(&mut a);
            match (a.validate(), flag) {
                (Ok(_), None) => {}
                (Err(e), Some(flag)) => {
                    assert_eq!(e.flag, flag, "{name}");
                    assert!(
                        e.to_string().starts_with(&format!("--{flag}: ")),
                        "{name}: {e}"
                    );
                }
                (got, want) => panic!("{name}: got {got:?}, want error on {want:?}"),
            }
        }
        let config = args().validate().expect("valid");
        assert_eq!(
            config.state_dir,
            PathBuf::from("/var/lib/pmem-csi.intel.com")
        );
        assert_eq!(config.socket, PathBuf::from("/tmp/x.sock"));
    }

    #[test]
    fn malformed_values_are_refused_naming_their_flag() {
        use clap::Parser;
        #[derive(Parser, Debug)]
        struct Cli {
            #[command(flatten)]
            args: NodeArgs,
        }
        for (flag, value) in [
            ("--emulated-size", "lots"),
            ("--tool-timeout", "30"),
            ("--heartbeat-period", "soon"),
            ("--default-volume-size", "big"),
        ] {
            let message = Cli::try_parse_from(["test", flag, value])
                .expect_err("refused")
                .to_string();
            assert!(message.contains(flag), "{flag} {value}: {message}");
        }
    }
}
