//! `pmem-csi`: one binary for every role of the driver, chosen by subcommand.

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use controllers::{AdminServer, LogFormat, Readiness};
use prometheus_client::registry::Registry;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Kubernetes CSI driver for node-local persistent memory with distributed provisioning.
#[derive(Parser, Debug)]
#[command(name = "pmem-csi", version)]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// Per-node CSI driver (DaemonSet on every PMEM node).
    Node(Common<10010>),
    /// Cluster-level controllers (Deployment).
    Controller(Common<10011>),
    /// Scheduler extender beside kube-scheduler (host-network DaemonSet on control-plane nodes).
    Extender(Common<10012>),
}

/// Flags every mode takes; the admin port default differs per mode so that modes sharing a
/// host network namespace (the extender and a node on a control-plane node) do not collide.
#[derive(Args, Debug)]
struct Common<const PORT: u16> {
    /// Listen address of the admin server (/healthz, /readyz, /metrics).
    #[arg(long, env = "PMEM_CSI_ADMIN_ADDRESS", default_value_t = SocketAddr::from(([0, 0, 0, 0], PORT)))]
    admin_address: SocketAddr,

    /// Log line format.
    #[arg(long, env = "PMEM_CSI_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let (mode, admin_address, log_format) = match &cli.mode {
        Mode::Node(c) => ("node", c.admin_address, c.log_format),
        Mode::Controller(c) => ("controller", c.admin_address, c.log_format),
        Mode::Extender(c) => ("extender", c.admin_address, c.log_format),
    };
    controllers::logging::init(log_format).map_err(anyhow::Error::msg)?;
    tracing::info!(mode, version = env!("CARGO_PKG_VERSION"), "starting");

    let shutdown = CancellationToken::new();
    let readiness = Readiness::default();
    let admin = AdminServer::bind(admin_address, Registry::default(), readiness)
        .await
        .context("starting the admin server")?;
    let server = tokio::spawn(admin.serve(shutdown.clone()));

    wait_for_termination().await?;
    tracing::info!(mode, "terminating");
    shutdown.cancel();
    server.await.context("admin server task")??;
    Ok(())
}

async fn wait_for_termination() -> anyhow::Result<()> {
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
    Ok(())
}
