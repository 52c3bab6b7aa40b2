//! Our ServiceAccounts' credentials: set up at start (authorized, with kubeconfigs, through the
//! fault proxy when asked for), and the clients and kubeconfigs tests and our processes use.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{
    ControlPlaneError, TestEnv, TestEnvBuilder, TestEnvError, control_plane, fault_proxy,
    manifests, pki, proxy, service_accounts,
};

/// How long our ServiceAccounts may take to be authorized, and the node lease policy to hold.
const AUTHORIZATION_WAIT: Duration = Duration::from_secs(30);

impl TestEnv {
    /// Our ServiceAccounts as the manifests make them, authorized, and their kubeconfigs
    /// (through the fault proxy when `builder` asks for it); returns once the node lease
    /// policy, if the manifests have one, holds.
    pub(crate) async fn set_up_accounts(
        &mut self,
        client: &kube::Client,
        builder: &TestEnvBuilder,
        pki: &pki::Pki,
    ) -> Result<(), TestEnvError> {
        service_accounts::apply(client, &self.manifests).await?;
        let names = self.our_accounts()?;
        service_accounts::wait_authorized(
            client,
            &self.manifests,
            manifests::NAMESPACE,
            &names,
            AUTHORIZATION_WAIT,
        )
        .await?;
        let server = if builder.fault_proxy {
            self.start_fault_proxy(pki).await?
        } else {
            self.server()
        };
        self.accounts = service_accounts::ServiceAccountKubeconfigs::issue(
            client,
            manifests::NAMESPACE,
            &names,
            &self.dir().join("pki"),
            (&server, &self.dir().join("pki/ca.crt")),
            builder.token_renewal,
            self.shutdown.child_token(),
        )
        .await?;
        self.wait_node_lease_policy().await
    }

    /// The ServiceAccounts our node driver, controller and extender run under.
    fn our_accounts(&self) -> Result<Vec<String>, TestEnvError> {
        let mut names: Vec<String> = [
            manifests::OurContainer::NodeDriver,
            manifests::OurContainer::Controller,
            manifests::OurContainer::Extender,
        ]
        .iter()
        .map(|c| self.manifests.launch(*c).map(|l| l.service_account))
        .collect::<Result<_, _>>()?;
        names.dedup();
        Ok(names)
    }

    /// Starts the fault proxy in front of the apiserver; its URL, which our kubeconfigs name.
    async fn start_fault_proxy(&mut self, pki: &pki::Pki) -> Result<String, TestEnvError> {
        let proxy = fault_proxy::FaultProxy::start(
            self.server_address()?,
            pki,
            self.shutdown.child_token(),
        )
        .await?;
        let server = format!("https://{}", proxy.address());
        self.fault_proxy = Some(proxy);
        Ok(server)
    }

    /// Waits until the manifests' node lease policy, if they have one, holds.
    async fn wait_node_lease_policy(&self) -> Result<(), TestEnvError> {
        if self
            .manifests
            .object("ValidatingAdmissionPolicy", manifests::NODE_LEASE_POLICY)
            .is_none()
        {
            return Ok(());
        }
        // Like RBAC above: no node process may start before the policy holds it.
        let node_client =
            control_plane::client_from(&self.unbound_node_kubeconfig()?, "node").await?;
        service_accounts::wait_node_lease_policy(
            &node_client,
            manifests::NAMESPACE,
            manifests::NODE_LEASE_POLICY,
            AUTHORIZATION_WAIT,
        )
        .await?;
        Ok(())
    }

    /// The apiserver's address, for the proxies in front of it.
    fn server_address(&self) -> Result<SocketAddr, TestEnvError> {
        let server = self.server();
        server
            .trim_start_matches("https://")
            .parse()
            .map_err(|e| TestEnvError::WorkDir {
                parent: PathBuf::from(&server),
                source: std::io::Error::other(e),
            })
    }

    /// An admin client (`system:masters`) on the caller's runtime.
    pub async fn client(&self) -> Result<kube::Client, ControlPlaneError> {
        control_plane::client_from(&self.admin_kubeconfig(), "admin").await
    }

    /// The admin kubeconfig.
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.control_plane()
            .map(|c| c.admin_kubeconfig.clone())
            .unwrap_or_default()
    }

    /// The kubeconfig of ServiceAccount `name` of the manifests.
    pub fn service_account_kubeconfig(&self, name: &str) -> Option<&Path> {
        self.accounts.get(name)
    }

    /// The token file behind [`TestEnv::service_account_kubeconfig`].
    pub fn service_account_token_file(&self, name: &str) -> Option<PathBuf> {
        self.accounts.token_file(name)
    }

    /// The kubeconfig `node`'s processes run with: the node ServiceAccount's, its token bound
    /// to Node `node` (which must exist), as kubelet's projected token of a DaemonSet pod on
    /// that node is, so that the API server names the node in the caller's user info. Issued
    /// on first use and renewed with the other tokens.
    pub async fn node_identity_kubeconfig(&self, node: &str) -> Result<PathBuf, TestEnvError> {
        let account = self.node_account()?;
        if let Some(path) = self.accounts.bound_to_node_if_issued(&account, node) {
            return Ok(path);
        }
        let client = self.client().await?;
        Ok(self.accounts.bound_to_node(&client, &account, node).await?)
    }

    /// [`TestEnv::node_identity_kubeconfig`] for synchronous callers. The token is requested
    /// on a thread and runtime of its own: the caller may be on a current-thread runtime that
    /// it blocks while waiting here.
    pub(crate) fn node_kubeconfig(&self, node: &str) -> Result<PathBuf, TestEnvError> {
        if let Some(path) = self
            .accounts
            .bound_to_node_if_issued(&self.node_account()?, node)
        {
            return Ok(path);
        }
        let runtime_error = |e: std::io::Error| {
            TestEnvError::ServiceAccounts(service_accounts::ServiceAccountError::Runtime(e))
        };
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .map_err(runtime_error)?
                        .block_on(self.node_identity_kubeconfig(node))
                })
                .join()
                .unwrap_or_else(|_| {
                    Err(runtime_error(std::io::Error::other(
                        "the thread issuing the token panicked",
                    )))
                })
        })
    }

    /// The node ServiceAccount's kubeconfig with a token bound to no node: what the policy
    /// `manifests::NODE_LEASE_POLICY` lets write no Lease.
    fn unbound_node_kubeconfig(&self) -> Result<PathBuf, TestEnvError> {
        self.account_kubeconfig(&self.node_account()?, "pmem-driver")
    }

    /// The ServiceAccount the node DaemonSet's containers run under.
    fn node_account(&self) -> Result<String, TestEnvError> {
        Ok(self
            .manifests
            .launch(manifests::OurContainer::NodeDriver)?
            .service_account)
    }

    /// The kubeconfig of ServiceAccount `account`, which `container` runs under.
    pub(crate) fn account_kubeconfig(
        &self,
        account: &str,
        container: &str,
    ) -> Result<PathBuf, TestEnvError> {
        self.accounts
            .get(account)
            .map(Path::to_path_buf)
            .ok_or_else(|| {
                TestEnvError::Manifests(manifests::ManifestError::Unsupported {
                    container: container.into(),
                    reason: format!("no kubeconfig for ServiceAccount {account}"),
                })
            })
    }

    /// A proxy to the apiserver for `node`'s processes and a kubeconfig through it.
    pub(crate) async fn partitionable_kubeconfig(
        &mut self,
        node: &str,
    ) -> Result<PathBuf, TestEnvError> {
        let server = self.server();
        let proxy = proxy::TcpProxy::start(self.server_address()?, self.shutdown.child_token())
            .await
            .map_err(|source| TestEnvError::WorkDir {
                parent: PathBuf::from(&server),
                source,
            })?;
        let own = self.node_identity_kubeconfig(node).await?;
        let admin = std::fs::read_to_string(&own).map_err(|source| TestEnvError::WorkDir {
            parent: own.clone(),
            source,
        })?;
        let path = self.dir().join(format!("pki/{node}-via-proxy.kubeconfig"));
        std::fs::write(
            &path,
            admin.replace(&server, &format!("https://{}", proxy.address())),
        )
        .map_err(|source| TestEnvError::WorkDir {
            parent: path.clone(),
            source,
        })?;
        self.proxies.push((node.to_string(), proxy));
        Ok(path)
    }

    /// The proxy between `node`'s processes and the apiserver (with partitionable drivers).
    pub fn proxy(&self, node: &str) -> Option<&proxy::TcpProxy> {
        self.proxies.iter().find(|(n, _)| n == node).map(|(_, p)| p)
    }

    /// The proxy between our ServiceAccounts and the apiserver, with
    /// [`TestEnvBuilder::http_fault_proxy`].
    pub fn fault_proxy(&self) -> Option<&fault_proxy::FaultProxy> {
        self.fault_proxy.as_ref()
    }
}
