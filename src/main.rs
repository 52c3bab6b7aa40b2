//! `pmem-csi`: one binary for every role of the driver, chosen by subcommand.

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use controllers::concern::host;
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
    /// Why a pod is Pending, or where its PMEM volumes are (`explain pod/NAME`); also
    /// `kubectl pmem-csi explain` when installed as `kubectl-pmem_csi`.
    Explain(explain::ExplainArgs),
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
    #[command(flatten)]
    resizer: driver::resizer_endpoint::ResizerArgs,
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
    let cli = Cli::parse_from(kubectl_plugin_args(std::env::args_os()));
    if let Mode::Explain(args) = &cli.mode {
        let config = args.validate()?;
        print!("{}", explain::run(&config).await?);
        return Ok(());
    }
    let (mode, admin_address, log_format) = match &cli.mode {
        Mode::Node(c) => ("node", c.common.admin(10010), c.common.log_format),
        Mode::Controller(c) => ("controller", c.common.admin(10011), c.common.log_format),
        Mode::Extender(c) => ("extender", c.common.admin(10012), c.common.log_format),
        Mode::Explain(_) => return Ok(()),
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
        let concerns = node.concerns(&mut registry, serving).await?;
        work.spawn(host(concerns, None, shutdown.clone()).map(|r| r.map_err(anyhow::Error::from)));
    }
    if let Mode::Controller(c) = &cli.mode
        && let Some(ControllerAction::RotateCa(args)) = &c.action
    {
        return rotate_ca(args).await;
    }
    if let Mode::Controller(c) = &cli.mode {
        let config = c.controller.validate()?;
        let webhook = c.webhook.validate(config.driver_name())?;
        let mut process =
            controllers::ControllerProcess::start(config, &mut registry, &readiness).await?;
        if let Some(webhook) = webhook {
            webhooks::controller_concerns::add(&mut process, webhook, &mut registry, &readiness)
                .await?;
        }
        if let Some(socket) = &c.resizer.resizer_endpoint {
            let endpoint = driver::resizer_endpoint::ResizerEndpoint::bind(
                socket,
                process.config().driver_name(),
            )?;
            process.add_concern(controllers::concern::Concern::everywhere_fallible(
                "resizer-endpoint",
                move |token| endpoint.serve(token),
            ));
        }
        work.spawn(
            process
                .run(shutdown.clone())
                .map(|r| r.map_err(anyhow::Error::from)),
        );
    }
    let mut admin_routes = None;
    if let Mode::Extender(c) = &cli.mode {
        let config = c.extender.validate()?;
        let extender = extender::Extender::start(config, &mut registry, &readiness).await?;
        admin_routes = Some(extender.admin_routes());
        work.spawn(
            host(extender.concerns(), None, shutdown.clone())
                .map(|r| r.map_err(anyhow::Error::from)),
        );
    }
    let admin = AdminServer::bind(admin_address, registry, readiness)
        .await
        .context("starting the admin server")?;
    let admin = match admin_routes {
        Some(routes) => admin.with_routes(routes),
        None => admin,
    };
    let token = shutdown.clone();
    work.spawn(async move {
        webhooks::https::serve_admin(admin, webhooks::https::ServeOptions::admin(), token)
            .await
            .map_err(anyhow::Error::from)
    });

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

/// The arguments with argv[0] as `pmem-csi` names itself: kubectl runs a plugin
/// `kubectl-pmem_csi` for `kubectl pmem-csi`, and clap would otherwise print that file name
/// in its usage.
fn kubectl_plugin_args(
    args: impl Iterator<Item = std::ffi::OsString>,
) -> impl Iterator<Item = std::ffi::OsString> {
    args.enumerate().map(|(i, arg)| {
        let plugin = std::path::Path::new(&arg)
            .file_name()
            .is_some_and(|name| name == "kubectl-pmem_csi");
        if i == 0 && plugin {
            "kubectl pmem-csi".into()
        } else {
            arg
        }
    })
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
