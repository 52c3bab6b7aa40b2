//! The test registrar's entry point, with node-driver-registrar's flags (see
//! `testenv::registrar`): the real-node cluster's image for the DaemonSet's `driver-registrar`
//! container.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tokio_util::sync::CancellationToken;

/// node-driver-registrar's flags that pmem-csi's DaemonSet sets.
#[derive(Parser, Debug)]
#[command(name = "csi-node-driver-registrar", version)]
struct Args {
    /// The driver's CSI socket inside this container.
    #[arg(long)]
    csi_address: PathBuf,
    /// The same socket as kubelet sees it on the host.
    #[arg(long)]
    kubelet_registration_path: String,
    /// How long to wait for the driver's GetPluginInfo (e.g. `10s`, `1m`).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    timeout: Duration,
    /// `/healthz` listen address.
    #[arg(long)]
    http_endpoint: Option<SocketAddr>,
    /// Where kubelet's plugin watcher looks for registration sockets (in the container).
    #[arg(long, default_value = "/registration")]
    plugin_registration_path: PathBuf,
    /// Log verbosity (accepted for compatibility; logs are always at info).
    #[arg(long = "v", default_value_t = 0)]
    verbosity: u8,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = text
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| text.split_at(i))
        .ok_or_else(|| format!("{text:?} has no unit (s, m)"))?;
    let n: u64 = number.parse().map_err(|e| format!("{text:?}: {e}"))?;
    match unit {
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("{text:?}: unit must be s or m")),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_target(false).init();
    let args = Args::parse();
    let driver = testenv::registrar::driver_name(&args.csi_address, args.timeout).await?;
    let stop = CancellationToken::new();
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            stop.cancel();
        });
    }
    testenv::registrar::serve(
        testenv::registrar::Registration {
            driver,
            endpoint: args.kubelet_registration_path,
        },
        args.plugin_registration_path,
        args.http_endpoint,
        stop,
    )
    .await?;
    Ok(())
}
