//! A second driver instance beside testenv's own, installed from the Helm chart as an operator
//! would install it: `helm template` of `charts/pmem-csi` (tests/helm_chart.rs holds the chart
//! to the kustomize manifests), its Namespace and cluster-side objects applied, its node driver
//! and csi-provisioner started on every driver node of the testenv from its own rendered
//! DaemonSet — own namespace, ServiceAccount (tokens bound to the node), driver name, emulated
//! region and topology label — and its controller from its rendered Deployment; then uninstalled
//! again as `helm uninstall` and the namespace's deletion would.
//!
//! testenv runs the containers itself, so what helm would not do is done here in the kubelet's
//! and node-driver-registrar's stead: the second driver is registered in each CSINode and with
//! the simulated kubelet, and its topology label is put on the nodes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::Api;
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::core::{DynamicObject, GroupVersionKind};
use kube::discovery::{Scope, pinned_kind};
use tokio_util::sync::CancellationToken;

use crate::manifests::{self, OurContainer, Overrides, PodFacts, Rendered};
use crate::node_processes::{DriverOptions, NodeLauncher, NodeProcesses};
use crate::process::Supervised;
use crate::service_accounts::{self, ServiceAccountError, ServiceAccountKubeconfigs};
use crate::{TestEnv, TestEnvError, control_plane, node_processes, wait};

pub use crate::manifests::SECOND_NAMESPACE;

/// How long RBAC, the lease policy and the namespace's deletion may take.
const WAIT: Duration = Duration::from_secs(60);

/// A driver instance installed from the chart (see the module documentation).
#[derive(Debug)]
pub struct Instance {
    release: String,
    rendered: Arc<Rendered>,
    accounts: ServiceAccountKubeconfigs,
    nodes: Vec<NodeProcesses>,
    controller: Option<Supervised>,
    /// Ends the renewal of the instance's tokens (its ServiceAccounts go with it).
    renewal: CancellationToken,
}

impl Instance {
    /// The instance's driver name.
    pub fn driver_name(&self) -> &str {
        self.rendered.driver_name()
    }

    /// The namespace it is installed into.
    pub fn namespace(&self) -> String {
        self.rendered.namespace()
    }

    /// Its rendered objects.
    pub fn rendered(&self) -> &Rendered {
        &self.rendered
    }

    /// The release name.
    pub fn release(&self) -> &str {
        &self.release
    }

    /// The kubeconfig of the instance's ServiceAccount `name`.
    pub fn service_account_kubeconfig(&self, name: &str) -> Option<&Path> {
        self.accounts.get(name)
    }

    /// The processes of `node`, while the instance runs there.
    pub fn node_processes(&self, node: &str) -> Option<&NodeProcesses> {
        self.nodes.iter().find(|p| p.node == node)
    }

    /// Uninstalls the instance: its controller stops, then on every node its provisioner and
    /// driver (after which kubelet forgets the driver and its CSINode entry goes), then every
    /// rendered object is deleted and the namespace with what the running driver created in it
    /// (Leases, capacity objects); returns once the namespace is gone. Volumes are not touched:
    /// as with `helm uninstall`, delete them first. The topology label stays on the nodes, as
    /// kubelet leaves it.
    pub async fn uninstall(mut self, env: &TestEnv) -> Result<(), TestEnvError> {
        let client = env.client().await?;
        let driver = self.driver_name().to_string();
        if let Some(controller) = self.controller.take() {
            controller.stop().await;
        }
        if let Some(kubelet) = env.kubelet() {
            kubelet.forget_driver(&driver);
        }
        // Every process stops before anything can fail, so none is left running.
        let nodes: Vec<String> = self.nodes.iter().map(|p| p.node.clone()).collect();
        for processes in std::mem::take(&mut self.nodes) {
            processes.provisioner.stop().await;
            processes.driver.stop().await;
        }
        let mut unregistered = Ok(());
        for node in &nodes {
            if let Err(e) = node_processes::unregister(&client, &driver, node).await {
                unregistered = unregistered.and(Err(e));
            }
        }
        unregistered?;
        let deleted: Vec<&serde_yaml::Value> = self.rendered.objects().iter().rev().collect();
        for object in deleted {
            delete(&client, object).await?;
        }
        let namespaces = Api::<Namespace>::all(client.clone());
        let namespace = self.namespace();
        match namespaces
            .delete(&namespace, &DeleteParams::default())
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
        wait::wait_gone(&namespaces, &namespace, WAIT).await?;
        self.renewal.cancel();
        Ok(())
    }
}

impl TestEnv {
    /// Installs the chart under `repo/charts/pmem-csi` as release `release` into `namespace`
    /// with `values` files (see the module documentation) and waits until its driver serves on
    /// every driver node. The namespace should be [`SECOND_NAMESPACE`], whose requests the API
    /// server audits.
    pub async fn install_instance(
        &self,
        repo: &Path,
        release: &str,
        namespace: &str,
        values: &[PathBuf],
    ) -> Result<Instance, TestEnvError> {
        let rendered = Arc::new(manifests::helm_template(
            &crate::tools::helm(),
            &repo.join("charts/pmem-csi"),
            release,
            namespace,
            values,
        )?);
        let client = self.client().await?;
        let namespaces = Api::<Namespace>::all(client.clone());
        let object = Namespace {
            metadata: ObjectMeta {
                name: Some(namespace.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        match namespaces.create(&PostParams::default(), &object).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
        service_accounts::apply(&client, &rendered).await?;
        let node_account = rendered.launch(OurContainer::NodeDriver)?.service_account;
        let controller_account = rendered.launch(OurContainer::Controller)?.service_account;
        let names = vec![node_account.clone(), controller_account.clone()];
        service_accounts::wait_authorized(&client, &rendered, namespace, &names, WAIT).await?;
        let root = self.dir().join("instances").join(release);
        let pki = root.join("pki");
        std::fs::create_dir_all(&pki).map_err(|source| TestEnvError::WorkDir {
            parent: pki.clone(),
            source,
        })?;
        let renewal = self.shutdown.child_token();
        let accounts = ServiceAccountKubeconfigs::issue(
            &client,
            namespace,
            &names,
            &pki,
            (&self.server(), &self.dir().join("pki/ca.crt")),
            service_accounts::TOKEN_LIFETIME / 3,
            renewal.clone(),
        )
        .await?;
        let unbound = accounts
            .get(&node_account)
            .ok_or_else(|| missing_account(&node_account))?;
        let node_client = control_plane::client_from(unbound, "node").await?;
        service_accounts::wait_node_lease_policy(
            &node_client,
            namespace,
            &format!("{}-node-leases", rendered.prefix()),
            WAIT,
        )
        .await?;

        let driver = rendered.driver_name().to_string();
        let launcher = NodeLauncher {
            client: client.clone(),
            tools: self.tools.clone(),
            root,
            manifests: rendered.clone(),
            driver_name: driver.clone(),
            options: DriverOptions::default(),
        };
        let mut nodes = Vec::new();
        for node in self.nodes.iter().filter(|n| n.driver) {
            label_topology(&client, &driver, &node.name).await?;
            let kubeconfig = accounts
                .bound_to_node(&client, &node_account, &node.name)
                .await?;
            nodes.push(
                launcher
                    .start(node, &kubeconfig, |spec| self.supervise(spec))
                    .await?,
            );
        }
        if let Some(kubelet) = self.kubelet() {
            kubelet.serve_driver(
                &driver,
                nodes
                    .iter()
                    .map(|p| (p.node.clone(), p.dirs.socket.clone())),
            );
        }

        let kubeconfig = accounts
            .get(&controller_account)
            .ok_or_else(|| missing_account(&controller_account))?;
        let pod = PodFacts {
            name: format!("{release}-controller"),
            namespace: namespace.into(),
            node_name: "control-plane".into(),
        };
        // As testenv runs its own controller: a port of its own, no csi-resizer socket, no
        // webhook (the values decide whether the Deployment has one; testenv cannot route to it).
        let overrides = Overrides::new()
            .set("--admin-address", "127.0.0.1:0")
            .remove("--resizer-endpoint")
            .remove("--webhook-address");
        let spec = node_processes::container_process(
            &rendered,
            OurContainer::Controller,
            &format!("{release}-controller"),
            self.tools.pmem_csi(),
            &pod,
            format!("{release}-controller.log"),
            &overrides,
        )?
        .env("KUBECONFIG", kubeconfig);
        let controller = Some(self.supervise(spec));
        Ok(Instance {
            release: release.into(),
            rendered,
            accounts,
            nodes,
            controller,
            renewal,
        })
    }
}

fn missing_account(account: &str) -> TestEnvError {
    TestEnvError::ServiceAccounts(ServiceAccountError::Malformed(format!(
        "no kubeconfig issued for ServiceAccount {account}"
    )))
}

/// Puts `driver`'s topology label on Node `node`, as kubelet does when the driver registers.
async fn label_topology(client: &kube::Client, driver: &str, node: &str) -> kube::Result<()> {
    let patch = serde_json::json!({"metadata": {"labels": {
        controllers::well_known::topology_key(driver): node,
    }}});
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|_| ())
}

/// Deletes the rendered `object` (gone already is fine).
async fn delete(client: &kube::Client, object: &serde_yaml::Value) -> Result<(), TestEnvError> {
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    let kind = object["kind"].as_str().unwrap_or_default();
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let (resource, capabilities) =
        pinned_kind(client, &GroupVersionKind::gvk(group, version, kind)).await?;
    let api: Api<DynamicObject> = match capabilities.scope {
        Scope::Cluster => Api::all_with(client.clone(), &resource),
        Scope::Namespaced => Api::namespaced_with(
            client.clone(),
            object["metadata"]["namespace"].as_str().unwrap_or_default(),
            &resource,
        ),
    };
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}
