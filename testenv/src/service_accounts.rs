//! Our processes talk to the API server as the manifests' ServiceAccounts, never as admin: the
//! rendered Namespace, CSIDriver, StorageClasses, ServiceAccounts, RBAC and admission policies
//! are applied, and each ServiceAccount gets a kubeconfig whose `tokenFile` holds a TokenRequest
//! token that a background task renews (kube-rs and client-go both re-read token files every
//! minute).
//!
//! A node's processes get a token of the node ServiceAccount bound to their Node object, as
//! kubelet's projected token is bound to the pod (and so to its node): the API server then puts
//! `authentication.kubernetes.io/node-name` into the caller's user info, which the manifests'
//! ValidatingAdmissionPolicy `<driver>-node-leases` matches against the Lease a node writes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::{Scope, pinned_kind};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;

use crate::kubeconfig::{self, Credentials};
use crate::manifests::{APPLIED_KINDS, Rendered};

/// Lifetime of each token; renewed by default at a third of it, so no test sees one expire.
pub const TOKEN_LIFETIME: Duration = Duration::from_secs(3600);

/// What can go wrong applying manifests or issuing tokens.
#[derive(Debug, thiserror::Error)]
pub enum ServiceAccountError {
    /// An object could not be applied.
    #[error("applying {kind} {name}: {source}")]
    Apply {
        /// Its kind.
        kind: String,
        /// Its name.
        name: String,
        /// Why.
        source: kube::Error,
    },
    /// A rendered object is malformed.
    #[error("rendered object {0} has no apiVersion/kind/name")]
    Malformed(String),
    /// A token could not be requested.
    #[error("TokenRequest for {namespace}/{name}: {source}")]
    Token {
        /// Namespace.
        namespace: String,
        /// ServiceAccount.
        name: String,
        /// Why.
        source: kube::Error,
    },
    /// The API answered without a token.
    #[error("TokenRequest for {0} returned no token")]
    EmptyToken(String),
    /// A file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The authorizer never granted what the manifests' RBAC says.
    #[error("RBAC not in effect: {0}")]
    NotAuthorized(String),
    /// A kubeconfig could not be written.
    #[error(transparent)]
    Kubeconfig(#[from] kubeconfig::KubeconfigError),
    /// The manifests' node Lease policy never took effect.
    #[error("admission policy not in effect: {0}")]
    PolicyNotInEffect(String),
    /// A synchronous caller's token could not be issued on a thread of its own.
    #[error("issuing a token off the caller's runtime: {0}")]
    Runtime(std::io::Error),
}

/// Server-side applies the rendered objects of [`APPLIED_KINDS`] as field manager `testenv`,
/// in rendered order (kustomize sorts Namespaces and RBAC first).
pub async fn apply(client: &Client, rendered: &Rendered) -> Result<(), ServiceAccountError> {
    let params = PatchParams::apply("testenv").force();
    for object in rendered.of_kinds(APPLIED_KINDS) {
        let api_version = object["apiVersion"].as_str().unwrap_or_default();
        let kind = object["kind"].as_str().unwrap_or_default();
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        if api_version.is_empty() || kind.is_empty() || name.is_empty() {
            return Err(ServiceAccountError::Malformed(format!("{object:?}")));
        }
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let apply_error = |source| ServiceAccountError::Apply {
            kind: kind.into(),
            name: name.into(),
            source,
        };
        let (resource, capabilities) =
            pinned_kind(client, &GroupVersionKind::gvk(group, version, kind))
                .await
                .map_err(apply_error)?;
        let api: Api<DynamicObject> = match capabilities.scope {
            Scope::Cluster => Api::all_with(client.clone(), &resource),
            Scope::Namespaced => Api::namespaced_with(
                client.clone(),
                object["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or(crate::manifests::NAMESPACE),
                &resource,
            ),
        };
        api.patch(name, &params, &Patch::Apply(object))
            .await
            .map_err(apply_error)?;
    }
    Ok(())
}

/// Waits until the API server's authorizer grants each ServiceAccount in `names` every rule
/// the rendered RBAC gives it. RBAC reaches the authorizer through its informers a moment after
/// the apply; a process started earlier would see (and the audit log record) denials.
pub async fn wait_authorized(
    client: &Client,
    rendered: &Rendered,
    namespace: &str,
    names: &[String],
    timeout: Duration,
) -> Result<(), ServiceAccountError> {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
    };
    let api = Api::<SubjectAccessReview>::all(client.clone());
    for name in names {
        for grant in crate::audit::grants(rendered, namespace, name) {
            let (resource, subresource) = match grant.resource.split_once('/') {
                Some((r, s)) => (r.to_string(), Some(s.to_string())),
                None => (grant.resource.clone(), None),
            };
            let review = SubjectAccessReview {
                spec: SubjectAccessReviewSpec {
                    user: Some(crate::audit::service_account_user(namespace, name)),
                    groups: Some(vec![
                        "system:serviceaccounts".into(),
                        format!("system:serviceaccounts:{namespace}"),
                        "system:authenticated".into(),
                    ]),
                    resource_attributes: Some(ResourceAttributes {
                        verb: Some(grant.verb.clone()),
                        group: Some(grant.group.clone()),
                        resource: Some(resource),
                        subresource,
                        namespace: Some(namespace.to_string()),
                        name: grant.names.first().cloned(),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            let what = format!("{name} may {}", grant.pair());
            crate::wait::until(&what, timeout, || async {
                let answer = api
                    .create(&PostParams::default(), &review)
                    .await
                    .map_err(|e| e.to_string())?;
                if answer.status.is_some_and(|s| s.allowed) {
                    Ok(())
                } else {
                    Err("not yet".to_string())
                }
            })
            .await
            .map_err(|e| ServiceAccountError::NotAuthorized(e.to_string()))?;
        }
    }
    Ok(())
}

/// A token file kept fresh: whose, and the Node it is bound to (if any).
#[derive(Clone, Debug)]
struct TokenFile {
    account: String,
    node: Option<String>,
    path: PathBuf,
}

/// Where kubeconfigs are written and which API server they name.
#[derive(Clone, Debug, Default)]
struct Target {
    namespace: String,
    dir: PathBuf,
    server: String,
    ca_file: PathBuf,
}

impl Target {
    /// Issues the token of `file` and writes the kubeconfig `<dir>/<name>.kubeconfig` that reads
    /// it; returns the kubeconfig's path.
    async fn write(
        &self,
        client: &Client,
        file: &TokenFile,
        name: &str,
    ) -> Result<PathBuf, ServiceAccountError> {
        write_token(client, &self.namespace, file).await?;
        Ok(kubeconfig::write(
            &self.dir,
            name,
            &self.server,
            &self.ca_file,
            Credentials::TokenFile(&file.path),
        )?)
    }
}

/// Kubeconfigs of ServiceAccounts, their tokens kept fresh until `shutdown`.
#[derive(Debug, Default)]
pub struct ServiceAccountKubeconfigs {
    by_name: BTreeMap<String, PathBuf>,
    /// Kubeconfigs of tokens bound to a Node, by (ServiceAccount, node); issued on demand.
    by_node: Mutex<BTreeMap<(String, String), PathBuf>>,
    /// Every token file the background task renews; node-bound ones join as they are issued.
    renewed: Arc<Mutex<Vec<TokenFile>>>,
    target: Target,
}

impl ServiceAccountKubeconfigs {
    /// Issues a token and writes `<dir>/sa-<name>.kubeconfig` for each of `names` in
    /// `namespace` (for API server `server` trusted through `ca_file`), then renews the tokens
    /// every `renewal` until `shutdown`.
    pub async fn issue(
        client: &Client,
        namespace: &str,
        names: &[String],
        dir: &Path,
        (server, ca_file): (&str, &Path),
        renewal: Duration,
        shutdown: CancellationToken,
    ) -> Result<Self, ServiceAccountError> {
        let target = Target {
            namespace: namespace.into(),
            dir: dir.into(),
            server: server.into(),
            ca_file: ca_file.into(),
        };
        let mut by_name = BTreeMap::new();
        let mut files = Vec::new();
        for name in names {
            let file = TokenFile {
                account: name.clone(),
                node: None,
                path: dir.join(format!("sa-{name}.token")),
            };
            let path = target.write(client, &file, &format!("sa-{name}")).await?;
            by_name.insert(name.clone(), path);
            files.push(file);
        }
        let renewed = Arc::new(Mutex::new(files));
        let client = client.clone();
        let namespace = namespace.to_string();
        let listed = renewed.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(renewal) => {}
                }
                // A copy, so that no lock is held across the requests.
                let files = listed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                for file in &files {
                    if let Err(e) = write_token(&client, &namespace, file).await {
                        tracing::warn!("renewing the token of {namespace}/{}: {e}", file.account);
                    }
                }
            }
        });
        Ok(Self {
            by_name,
            by_node: Mutex::default(),
            renewed,
            target,
        })
    }

    /// The kubeconfig of ServiceAccount `name`.
    pub fn get(&self, name: &str) -> Option<&Path> {
        self.by_name.get(name).map(PathBuf::as_path)
    }

    /// The token file of ServiceAccount `name`.
    pub fn token_file(&self, name: &str) -> Option<PathBuf> {
        self.get(name).map(|k| k.with_extension("token"))
    }

    /// The kubeconfig of ServiceAccount `account` with a token bound to Node `node`, as the
    /// processes on that node hold it: issued on first use (the Node must exist), renewed with
    /// the others. The token stops working when that Node is deleted.
    pub async fn bound_to_node(
        &self,
        client: &Client,
        account: &str,
        node: &str,
    ) -> Result<PathBuf, ServiceAccountError> {
        let key = (account.to_string(), node.to_string());
        if let Some(path) = self.bound_to_node_if_issued(account, node) {
            return Ok(path);
        }
        let name = format!("sa-{account}-node-{node}");
        let file = TokenFile {
            account: account.into(),
            node: Some(node.into()),
            path: self.target.dir.join(format!("{name}.token")),
        };
        let path = self.target.write(client, &file, &name).await?;
        // A concurrent caller may have issued it meanwhile: then it is renewed already.
        let first = self
            .by_node
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, path.clone())
            .is_none();
        if first {
            self.renewed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(file);
        }
        Ok(path)
    }

    /// The kubeconfig [`ServiceAccountKubeconfigs::bound_to_node`] issued, if it did.
    pub fn bound_to_node_if_issued(&self, account: &str, node: &str) -> Option<PathBuf> {
        self.by_node
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(account.to_string(), node.to_string()))
            .cloned()
    }
}

/// Waits until the ValidatingAdmissionPolicy `policy` (the manifests' `<driver>-node-leases`)
/// is in effect: until a dry-run Lease create in `namespace` by `node_client`, the node
/// ServiceAccount with a token bound to no node, is refused in its name. A policy reaches the
/// admission plugin through an informer a moment after it is applied, and until then a node
/// could write any Lease.
pub async fn wait_node_lease_policy(
    node_client: &Client,
    namespace: &str,
    policy: &str,
    timeout: Duration,
) -> Result<(), ServiceAccountError> {
    use k8s_openapi::api::coordination::v1::Lease;
    let api = Api::<Lease>::namespaced(node_client.clone(), namespace);
    let probe = Lease {
        metadata: kube::api::ObjectMeta {
            name: Some(format!("{policy}-probe")),
            ..Default::default()
        },
        spec: None,
    };
    let params = PostParams {
        dry_run: true,
        ..Default::default()
    };
    crate::wait::until(&format!("{policy} to refuse"), timeout, || async {
        match api.create(&params, &probe).await {
            Err(kube::Error::Api(status)) if status.message.contains(policy) => Ok(()),
            Err(e) => Err(e.to_string()),
            Ok(_) => Err("a token bound to no node may still create a Lease".to_string()),
        }
    })
    .await
    .map_err(|e| ServiceAccountError::PolicyNotInEffect(e.to_string()))
}

/// Requests a token for `file` (its ServiceAccount in `namespace`, bound to its Node if it
/// names one) and replaces the file with it atomically.
async fn write_token(
    client: &Client,
    namespace: &str,
    file: &TokenFile,
) -> Result<(), ServiceAccountError> {
    let name = &file.account;
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(TOKEN_LIFETIME.as_secs() as i64),
            bound_object_ref: file.node.as_ref().map(|node| BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(node.clone()),
                uid: None,
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let answer = Api::<ServiceAccount>::namespaced(client.clone(), namespace)
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .map_err(|source| ServiceAccountError::Token {
            namespace: namespace.into(),
            name: name.into(),
            source,
        })?;
    let token = answer
        .status
        .and_then(|s| s.token)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| ServiceAccountError::EmptyToken(format!("{namespace}/{name}")))?;
    let temporary = file.path.with_extension("token.new");
    let write_error = |source| ServiceAccountError::Write {
        path: file.path.clone(),
        source,
    };
    std::fs::write(&temporary, token).map_err(write_error)?;
    std::fs::rename(&temporary, &file.path).map_err(write_error)
}
