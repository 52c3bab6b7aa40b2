//! The simulated nodes testenv runs: their Node and CSINode objects, their driver processes
//! and the simulated kubelet, started in that order, and what tests do with them.

use std::path::PathBuf;
use std::sync::{MutexGuard, PoisonError};

use crate::node_processes::{DriverOptions, NodeLauncher, NodeProcesses};
use crate::{
    NodeSpec, Supervised, TestEnv, TestEnvError, kubelet, node_driver, node_processes, process,
    signal_running,
};

impl TestEnv {
    /// Creates the Node and CSINode objects of every node; `with_drivers`: the CSINode lists
    /// the driver only once its process serves.
    pub(crate) async fn create_nodes(
        &self,
        client: &kube::Client,
        with_drivers: bool,
    ) -> Result<(), TestEnvError> {
        for node in &self.nodes {
            let mut spec = node.clone();
            if with_drivers {
                spec.csinode_driver = false;
            }
            spec.create(client, &self.driver_name).await?;
        }
        Ok(())
    }

    /// Starts the driver and csi-provisioner of every node meant for the driver, each with a
    /// token bound to its node (through a proxy of its own when `options` make the node
    /// partitionable).
    pub(crate) async fn start_node_processes(
        &mut self,
        client: &kube::Client,
        options: DriverOptions,
    ) -> Result<(), TestEnvError> {
        let launcher = NodeLauncher {
            client: client.clone(),
            tools: self.tools.clone(),
            root: self.dir().to_path_buf(),
            manifests: self.manifests.clone(),
            driver_name: self.driver_name.clone(),
            options,
        };
        let driver_nodes: Vec<NodeSpec> = self.nodes.iter().filter(|n| n.driver).cloned().collect();
        for node in &driver_nodes {
            let kubeconfig = if launcher.options.partitionable {
                self.partitionable_kubeconfig(&node.name).await?
            } else {
                self.node_identity_kubeconfig(&node.name).await?
            };
            let processes = launcher
                .start(node, &kubeconfig, |spec| self.supervise(spec))
                .await?;
            self.running_node_processes().push(processes);
        }
        Ok(())
    }

    /// Starts the simulated kubelet for the nodes whose driver runs.
    pub(crate) fn start_kubelet(&mut self, client: &kube::Client) {
        let nodes = self
            .running_node_processes()
            .iter()
            .map(|p| kubelet::KubeletNode {
                name: p.node.clone(),
                socket: p.dirs.socket.clone(),
                dirs: self.kubelet_dirs(&p.node),
            })
            .collect();
        let _guard = self.runtime.enter();
        self.kubelet = Some(kubelet::Kubelet::spawn(
            client.clone(),
            &self.driver_name,
            nodes,
            self.shutdown.child_token(),
        ));
    }

    /// The node processes testenv runs. A test that panicked while holding them left the list
    /// whole (nothing changes it halfway), so a poisoned lock is used as it is.
    pub(crate) fn running_node_processes(&self) -> MutexGuard<'_, Vec<NodeProcesses>> {
        self.node_processes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The simulated kubelet, when testenv runs it.
    pub fn kubelet(&self) -> Option<&kubelet::Kubelet> {
        self.kubelet.as_ref()
    }

    /// The kubelet directories of simulated node `node`.
    pub fn kubelet_dirs(&self, node: &str) -> kubelet::KubeletDirs {
        kubelet::KubeletDirs {
            root: self.dir().join("nodes").join(node).join("kubelet"),
        }
    }

    /// Starts a supervised `pmem-csi node` for `node`, its files in `dirs`, as testenv's own
    /// node processes run: the rendered container under the node ServiceAccount, with a token
    /// bound to Node `node` (which must exist).
    pub fn supervise_node_driver(
        &self,
        node: &str,
        dirs: &node_driver::NodeDriverDirs,
        options: &node_processes::DriverOptions,
    ) -> Result<Supervised, TestEnvError> {
        let spec = node_processes::driver_process(
            &self.manifests,
            &self.tools,
            &self.driver_name,
            node,
            dirs,
            options,
            &self.node_kubeconfig(node)?,
        )?;
        Ok(self.supervise(spec))
    }

    /// Takes the processes of `node` out of the testenv's hands (to stop or kill them).
    pub fn take_node_processes(&self, node: &str) -> Option<node_processes::NodeProcesses> {
        let mut all = self.running_node_processes();
        let i = all.iter().position(|p| p.node == node)?;
        Some(all.remove(i))
    }

    /// Sends `signal` to the driver of `node` (its supervisor restarts it, as kubelet would).
    pub fn signal_node_driver(
        &self,
        node: &str,
        signal: rustix::process::Signal,
    ) -> Result<(), process::ProcessError> {
        let all = self.running_node_processes();
        let driver = all.iter().find(|p| p.node == node).map(|p| &p.driver);
        signal_running(driver, format!("driver of {node}"), signal)
    }

    /// The restart counts of `node`'s driver and provisioner, if testenv runs them.
    pub fn node_restarts(&self, node: &str) -> Option<(u32, u32)> {
        self.running_node_processes()
            .iter()
            .find(|p| p.node == node)
            .map(|p| (p.driver.state().restarts, p.provisioner.state().restarts))
    }

    /// The admin (metrics) port of `node`'s driver, if testenv runs it.
    pub fn driver_admin_port(&self, node: &str) -> Option<u16> {
        self.running_node_processes()
            .iter()
            .find(|p| p.node == node)
            .map(|p| p.admin)
    }

    /// The driver socket of `node`, if testenv runs its driver.
    pub fn driver_socket(&self, node: &str) -> Option<PathBuf> {
        self.running_node_processes()
            .iter()
            .find(|p| p.node == node)
            .map(|p| p.dirs.socket.clone())
    }
}
