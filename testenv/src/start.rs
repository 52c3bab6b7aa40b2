//! Starting a [`TestEnv`]: its work directory, the rendered manifests and the control plane,
//! then in the order a cluster has them our ServiceAccounts' credentials, the extender, the
//! nodes and their driver processes, the controller and the simulated kubelet.

use std::path::Path;
use std::sync::Arc;

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

use crate::builder::TestEnvBuilder;
use crate::{
    ControlPlane, ProcessGroup, TestEnv, TestEnvError, Tools, extender, leftovers, manifests, pki,
    tools,
};

impl TestEnv {
    /// Starts what `builder` asks for, its supervisors on `runtime`; what
    /// [`TestEnvBuilder::start`] does.
    pub(crate) async fn start(
        mut builder: TestEnvBuilder,
        runtime: Handle,
    ) -> Result<Self, TestEnvError> {
        let tools = Tools::locate()?;
        let dir = work_dir()?;
        let group = ProcessGroup::new()?;
        let pki = pki::Pki::new()?;
        tracing::info!(dir = %dir.path().display(), "starting testenv");
        let extender_ports = extender::reserve_ports(&mut builder)?;
        let (manifests_base, manifests) = render_manifests(&tools, dir.path())?;
        let control_plane = ControlPlane::start(
            dir.path(),
            &tools,
            &pki,
            &group,
            &builder.scheduler,
            &crate::control_plane::ControlPlaneOptions {
                idle: builder.idle_control_plane,
                shared_audit: !builder.private_audit_log,
                controller_manager_args: builder.controller_manager_args.clone(),
            },
        )
        .await?;
        let mut env = Self {
            dir,
            tools,
            driver_name: builder.driver_name.clone(),
            shipped_heartbeat: builder.shipped_heartbeat,
            nodes: builder.nodes.clone(),
            control_plane: Some(control_plane),
            runtime,
            node_processes: Default::default(),
            proxies: Vec::new(),
            extender: None,
            controller: None,
            kubelet: None,
            manifests_base,
            manifests,
            accounts: Default::default(),
            fault_proxy: None,
            shutdown: CancellationToken::new(),
            group,
        };
        let client = env.client().await?;
        env.set_up_accounts(&client, &builder, &pki).await?;
        if let (Some(args), Some(ports)) = (&builder.extender, extender_ports) {
            env.extender = Some(env.start_extender(args, ports, &builder.extender_env)?);
        }
        env.create_nodes(&client, builder.drivers.is_some()).await?;
        if let Some(options) = builder.drivers.take() {
            env.start_node_processes(&client, options).await?;
        }
        if let Some(setup) = &builder.controller {
            env.controller = Some(env.start_controller(&client, setup).await?);
        }
        if builder.kubelet {
            env.start_kubelet(&client);
        }
        Ok(env)
    }
}

/// A fresh work directory under the system's temporary directory, after removing those that
/// killed test processes left.
fn work_dir() -> Result<tempfile::TempDir, TestEnvError> {
    let parent = std::env::temp_dir();
    leftovers::remove_stale_work_dirs(&parent);
    tempfile::Builder::new()
        .prefix(&leftovers::work_dir_prefix())
        .tempdir_in(&parent)
        .map_err(|source| TestEnvError::WorkDir {
            parent: parent.clone(),
            source,
        })
}

/// `overlays/emulated` rendered, without and with the scheduler-extender component.
fn render_manifests(
    tools: &Tools,
    dir: &Path,
) -> Result<(Arc<manifests::Rendered>, Arc<manifests::Rendered>), TestEnvError> {
    let kubectl = tools.go("kubectl");
    let render = |with_extender| {
        manifests::Rendered::render(&kubectl, tools::repo_root(), dir, with_extender).map(Arc::new)
    };
    Ok((render(false)?, render(true)?))
}
