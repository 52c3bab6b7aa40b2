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
    Controller(Box<ControllerCommand>),
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
#[command(args_conflicts_with_subcommands = true)]
struct ControllerCommand {
    #[command(subcommand)]
    action: Option<ControllerAction>,
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    controller: controllers::ControllerArgs,
    #[command(flatten)]
    webhook: webhooks::webhook::WebhookOptions,
}

/// One-shot actions of `pmem-csi controller`.
#[derive(Subcommand, Debug)]
enum ControllerAction {
    /// Replace the self-signed webhook CA: the old one stays trusted until every replica serves
    /// a certificate of the new one (run with the controller's kubeconfig or in-cluster).
    RotateCa(RotateCaArgs),
}

/// Flags of `pmem-csi controller rotate-ca`.
#[derive(Args, Debug)]
struct RotateCaArgs {
    /// CSI driver name (names the Secret by default).
    #[arg(
        long,
        env = "PMEM_CSI_DRIVER_NAME",
        default_value = "pmem-csi.intel.com"
    )]
    driver_name: String,
    /// The driver's namespace.
    #[arg(long, env = "POD_NAMESPACE", default_value = "pmem-csi")]
    namespace: String,
    /// The Secret (default `<prefix>-controller-secret`).
    #[arg(long)]
    self_signed_secret: Option<String>,
    /// Validity of the new CA.
    #[arg(long, default_value = "87600h", value_parser = controllers::flags::duration)]
    self_signed_ca_validity: std::time::Duration,
}

/// `pmem-csi extender`.
#[derive(Args, Debug)]
struct ExtenderCommand {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    extender: extender::ExtenderOptions,
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
        driver::program::check(config.device_mode, &readiness);
        let serving = readiness.register("csi-server");
        let node = driver::NodeDriver::start(config, &mut registry)?;
        if !node.config().standalone {
            let client = controllers::rate_limit::client(node.config().kube_api)
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
                let budget = controllers::heartbeat::client_budget(period);
                let own = controllers::rate_limit::client(budget)
                    .await
                    .context("connecting to the apiserver for the heartbeat")?;
                work.spawn(
                    controllers::heartbeat::run(
                        own,
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
    if let Mode::Controller(c) = &cli.mode
        && let Some(ControllerAction::RotateCa(args)) = &c.action
    {
        return rotate_ca(args).await;
    }
    if let Mode::Controller(c) = &cli.mode {
        let config = c.controller.validate()?;
        let webhook = c.webhook.validate(config.driver_name())?;
        let namespace = config.namespace().to_string();
        let mut process =
            controllers::ControllerProcess::start(config, &mut registry, &readiness).await?;
        if let Some(webhook) = webhook {
            start_webhook(
                webhook,
                &mut process,
                &namespace,
                &mut registry,
                &readiness,
                &mut work,
                &shutdown,
            )
            .await?;
        }
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
        let extender = extender::Extender::start(config, &mut registry, &readiness).await?;
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

/// Starts the pod webhook's certificate source and HTTPS server beside the controller's
/// concerns.
async fn start_webhook(
    webhook: webhooks::webhook::WebhookConfig,
    process: &mut controllers::ControllerProcess,
    namespace: &str,
    registry: &mut Registry,
    readiness: &Readiness,
    work: &mut tokio::task::JoinSet<anyhow::Result<()>>,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    use webhooks::webhook::CertificateSource;
    let resolver = std::sync::Arc::new(webhooks::tls::CertResolver::new());
    match &webhook.certificate {
        CertificateSource::Files(files) => {
            resolver
                .load_files(files)
                .context("loading the webhook certificate")?;
            work.spawn(
                resolver
                    .clone()
                    .watch_files(files.clone(), webhook.reload_interval, shutdown.clone())
                    .map(Ok),
            );
        }
        CertificateSource::SelfSigned(config) => {
            let secret = webhooks::certificate_secret::CertificateSecret::new(
                process.client(),
                namespace,
                config.clone(),
            );
            let keeper = secret.clone();
            process.add_concern(
                "webhook-certificate",
                true,
                Box::new(move |term| Box::pin(keeper.clone().keep(term))),
            );
            work.spawn(secret.follow(resolver.clone(), shutdown.clone()).map(Ok));
        }
    }
    // Ready once a certificate is there to serve (followers wait for the leader's Secret).
    let certificate = readiness.register("webhook-certificate");
    let watched = resolver.clone();
    let token = shutdown.clone();
    work.spawn(async move {
        while watched.current().is_none() {
            tokio::select! {
                _ = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
                _ = token.cancelled() => return Ok(()),
            }
        }
        certificate.set(true);
        // Every task of `work` lives until shutdown; one ending early stops the process.
        token.cancelled().await;
        Ok(())
    });
    let server = webhooks::https::HttpsServer::bind(webhook.address)
        .await
        .context("binding the webhook address")?
        .with_options(webhooks::https::ServeOptions::webhook());
    tracing::info!(address = %server.local_addr(), "pod webhook listening");
    let router = webhooks::webhook::router(
        process.client(),
        process.stores(),
        webhook.policy.clone(),
        webhooks::webhook::WebhookMetrics::register(registry),
    );
    // Pods admitted while the webhook was unreachable: reported by the leader.
    let relevance = webhooks::webhook::pod_relevance(process.stores(), webhook.policy.clone());
    let (client, driver, reconciles) = (
        process.client(),
        webhook.policy.driver.clone(),
        process.reconciles(),
    );
    let metrics = controllers::bypass::BypassMetrics::register(registry);
    let reporter = process.config().reporter();
    process.add_concern(
        "bypass",
        true,
        Box::new(move |term| {
            Box::pin(
                controllers::bypass::Bypass::new(
                    client.clone(),
                    driver.clone(),
                    relevance.clone(),
                    reporter.clone(),
                    metrics.clone(),
                    reconciles.clone(),
                )
                .run(term),
            )
        }),
    );
    let token = shutdown.clone();
    work.spawn(async move {
        webhooks::webhook::serve(server, router, resolver, token)
            .await
            .context("serving the webhook")
    });
    Ok(())
}

/// `pmem-csi controller rotate-ca`.
async fn rotate_ca(args: &RotateCaArgs) -> anyhow::Result<()> {
    let validity = args.self_signed_ca_validity;
    let prefix = controllers::well_known::name_prefix(&args.driver_name);
    let config = webhooks::webhook::SelfSignedConfig {
        secret: args
            .self_signed_secret
            .clone()
            .unwrap_or_else(|| format!("{prefix}-controller-secret")),
        service: format!("{prefix}-webhook"),
        configuration: format!("{prefix}-hook"),
        sans: Vec::new(),
        leaf_validity: validity,
        ca_validity: validity,
    };
    let client = kube::Client::try_default()
        .await
        .context("connecting to the apiserver")?;
    webhooks::certificate_secret::CertificateSecret::new(client, &args.namespace, config)
        .rotate_ca(time_now())
        .await
        .context("rotating the CA")?;
    println!("rotated; the controller leader re-issues the serving certificate next");
    Ok(())
}

fn time_now() -> webhooks::OffsetDateTime {
    webhooks::OffsetDateTime::now_utc()
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
