//! `just demo`: a 3-node testenv that runs until Ctrl-C, then leaves nothing behind.

use std::time::Duration;

use anyhow::Context;
use testenv::TestEnv;
use tokio::signal::unix::{SignalKind, signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube_client=off".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let nodes = std::env::var("TESTENV_NODES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3);
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    let env = tokio::select! {
        env = TestEnv::builder()
            .nodes(nodes)
            .drivers(testenv::node_processes::DriverOptions::default())
            .start() => env.context("starting testenv")?,
        _ = int.recv() => return Ok(()),
        _ = term.recv() => return Ok(()),
    };
    let kubectl = env.tools().go("kubectl");
    let names: Vec<&str> = env.nodes().iter().map(|n| n.name.as_str()).collect();
    println!(
        "\ntestenv is up: a real control plane on 127.0.0.1 (etcd, kube-apiserver, \
         kube-controller-manager, kube-scheduler), and on every node pmem-csi node (emulated, 1 GiB) \
         with csi-provisioner, started from manifests/overlays/emulated under its ServiceAccounts; \
         StorageClass pmem-csi-sc-ext4 (or -xfs, WaitForFirstConsumer) provisions a claim once a pod \
         using it is scheduled (no kubelet runs the pod).\n\n  \
         export KUBECONFIG={}\n  \
         alias kubectl={}\n  \
         kubectl get nodes   # {}\n\n  \
         apiserver:  {}\n  work dir:   {}\n  logs:       {}/logs\n  process group: {}\n\n\
         Press Ctrl-C to stop; everything is removed.",
        env.admin_kubeconfig().display(),
        kubectl.display(),
        names.join(", "),
        env.server(),
        env.dir().display(),
        env.dir().display(),
        env.process_group_id(),
    );
    tokio::select! {
        _ = int.recv() => {},
        _ = term.recv() => {},
    }
    eprintln!("stopping testenv");
    let leftovers = env.stop().await;
    let remaining = leftovers.wait_clean(Duration::from_secs(10)).await;
    anyhow::ensure!(remaining.is_empty(), "left behind: {remaining:?}");
    eprintln!("testenv stopped; nothing left behind");
    Ok(())
}
