//! `pmem-csi`: one binary for every role of the driver, chosen by subcommand.

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use controllers::{AdminServer, LogFormat, Readiness};
use futures::FutureExt;
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
    Node(NodeCommand),
    /// Cluster-level controllers (Deployment).
    Controller(ControllerCommand),
    /// Scheduler extender beside kube-scheduler (host-network DaemonSet on control-plane nodes).
    Extender(ExtenderCommand),
}

/// `pmem-csi node`.
#[derive(Args, Debug)]
struct NodeCommand {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    driver: driver::NodeArgs,
}

/// `pmem-csi controller`.
#[derive(Args, Debug)]
struct ControllerCommand {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    controller: controllers::ControllerArgs,
}

/// `pmem-csi extender`.
#[derive(Args, Debug)]
struct ExtenderCommand {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    extender: webhooks::extender::ExtenderOptions,
}

/// Flags every mode takes.
#[derive(Args, Debug)]
struct Common {
    /// Listen address of the admin server (/healthz, /readyz, /metrics); default 0.0.0.0 port
    /// 10010 (node), 10011 (controller), 10012 (extender), so that modes sharing a host network
    /// namespace (the extender and a node on a control-plane node) do not collide.
    // Not a const-generic default: clap caches defaults in statics shared by every
    // instantiation, so all three modes got the node's port.
    #[arg(long, env = "PMEM_CSI_ADMIN_ADDRESS")]
    admin_address: Option<SocketAddr>,

    /// Log line format.
    #[arg(long, env = "PMEM_CSI_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

impl Common {
    fn admin(&self, default_port: u16) -> SocketAddr {
        self.admin_address
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], default_port)))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let (mode, admin_address, log_format) = match &cli.mode {
        Mode::Node(c) => ("node", c.common.admin(10010), c.common.log_format),
        Mode::Controller(c) => ("controller", c.common.admin(10011), c.common.log_format),
        Mode::Extender(c) => ("extender", c.common.admin(10012), c.common.log_format),
    };
    controllers::logging::init(log_format).map_err(anyhow::Error::msg)?;
    tracing::info!(mode, version = env!("CARGO_PKG_VERSION"), "starting");

    let shutdown = CancellationToken::new();
    let readiness = Readiness::default();
    let mut registry = Registry::default();
    let mut work = tokio::task::JoinSet::new();
    if let Mode::Node(c) = &cli.mode {
        // Validate and repair before anything listens: a node that cannot serve must not
        // look alive.
        let config = c.driver.validate()?;
        let serving = readiness.register("csi-server");
        let node = driver::NodeDriver::start(config, &mut registry)?;
        if !node.config().standalone {
            let (qps, burst) = node.config().kube_api;
            let client = controllers::rate_limit::client(qps, burst)
                .await
                .context("connecting to the apiserver (use --standalone to run without it)")?;
            let publisher = controllers::capacity_publisher::CapacityPublisher::new(
                client.clone(),
                controllers::capacity_publisher::Publisher {
                    driver: node.config().driver_name.clone(),
                    namespace: node.config().namespace.clone(),
                    node: node.config().node_id.clone(),
                },
                node.volumes().clone(),
                controllers::reconcile_metrics::ReconcileMetrics::register(&mut registry),
            );
            if let Some(period) = node.config().heartbeat_period {
                let c = node.config();
                work.spawn(
                    controllers::heartbeat::run(
                        client.clone(),
                        c.driver_name.clone(),
                        c.node_id.clone(),
                        c.namespace.clone(),
                        period,
                        shutdown.clone(),
                    )
                    .map(Ok),
                );
            }
            {
                let c = node.config();
                let grace = c.orphan_grace;
                let period = (grace / 2).clamp(
                    std::time::Duration::from_secs(1),
                    std::time::Duration::from_secs(60),
                );
                let sweep = controllers::orphan_sweep::OrphanSweep {
                    client: client.clone(),
                    driver: c.driver_name.clone(),
                    node: c.node_id.clone(),
                    grace,
                    period,
                    metrics: controllers::orphan_sweep::OrphanMetrics::register(&mut registry),
                };
                work.spawn(sweep.run(node.volumes().clone(), shutdown.clone()).map(Ok));
            }
            let token = shutdown.clone();
            work.spawn(async move {
                publisher.run(token.clone()).await;
                anyhow::ensure!(
                    token.is_cancelled(),
                    "the capacity publisher stopped unexpectedly"
                );
                Ok(())
            });
        }
        serving.set(true);
        let token = shutdown.clone();
        work.spawn(async move { node.serve(token).await.map_err(anyhow::Error::from) });
    }
    if let Mode::Controller(c) = &cli.mode {
        let config = c.controller.validate()?;
        let process =
            controllers::ControllerProcess::start(config, &mut registry, &readiness).await?;
        let token = shutdown.clone();
        work.spawn(async move {
            process.run(token.clone()).await;
            // The concerns only end on shutdown; ending earlier is a failure.
            anyhow::ensure!(token.is_cancelled(), "the controller stopped unexpectedly");
            Ok(())
        });
    }
    if let Mode::Extender(c) = &cli.mode {
        let config = c.extender.validate()?;
        let extender =
            webhooks::extender::Extender::start(config, &mut registry, &readiness).await?;
        let token = shutdown.clone();
        work.spawn(async move {
            extender.run(token.clone()).await?;
            anyhow::ensure!(token.is_cancelled(), "the extender stopped unexpectedly");
            Ok(())
        });
    }
    let admin = AdminServer::bind(admin_address, registry, readiness)
        .await
        .context("starting the admin server")?;
    let token = shutdown.clone();
    work.spawn(async move { admin.serve(token).await.map_err(anyhow::Error::from) });

    // The first of: a signal, or a server ending by itself (an error, or a bug).
    let early = tokio::select! {
        signal = wait_for_termination() => { signal?; None }
        ended = work.join_next() => ended,
    };
    tracing::info!(mode, "terminating");
    shutdown.cancel();
    if let Some(ended) = early {
        ended.context("server task")??;
        anyhow::bail!("a server stopped unexpectedly");
    }
    while let Some(ended) = work.join_next().await {
        ended.context("server task")??;
    }
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
