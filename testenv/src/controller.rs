//! The controller testenv runs: its start with the pod webhook registered and serving, the
//! webhook configuration that points the API server at replicas on 127.0.0.1, and what tests do
//! with the controller.

use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, WebhookClientConfig,
};

use crate::builder::ControllerSetup;
use crate::manifests::Rendered;
use crate::{
    ProcessSpec, Supervised, TestEnv, TestEnvError, api_calls, manifests, ports, process,
    signal_running, wait,
};

/// The name testenv's controller serves the pod webhook under.
const POD_WEBHOOK: &str = "pod-hook.pmem-csi.intel.com";
/// How long the controller may take to inject its CA and serve the webhook.
const WEBHOOK_WAIT: Duration = Duration::from_secs(60);

/// The controller testenv runs, with its webhook.
#[derive(Debug)]
pub(crate) struct ControllerProcess {
    process: Supervised,
    webhook: u16,
    admin: u16,
    /// csi-resizer, when the setup asks for it: held so that it runs beside the controller.
    _resizer: Option<Supervised>,
}

/// The manifests' MutatingWebhookConfiguration as testenv can use it: its webhook (rules,
/// opt-out selectors, side effects, timeout) once per `(name, url)` — one per replica, since
/// replicas on 127.0.0.1 have ports of their own and no Service routes to them — with a URL
/// instead of the Service, and `failure_policy` when given (tests use `Fail` to count failed
/// calls; `None` keeps the manifests').
pub fn pod_webhook_configuration(
    rendered: &Rendered,
    webhooks: &[(&str, String)],
    failure_policy: Option<&str>,
) -> Result<MutatingWebhookConfiguration, String> {
    let object = rendered
        .of_kinds(&["MutatingWebhookConfiguration"])
        .next()
        .ok_or("the manifests have no MutatingWebhookConfiguration")?;
    let mut configuration: MutatingWebhookConfiguration =
        serde_yaml::from_value(object.clone()).map_err(|e| e.to_string())?;
    let template = configuration
        .webhooks
        .as_ref()
        .and_then(|w| w.first())
        .cloned()
        .ok_or("the MutatingWebhookConfiguration has no webhook")?;
    configuration.webhooks = Some(
        webhooks
            .iter()
            .map(|(name, url)| {
                let mut webhook = template.clone();
                webhook.name = (*name).into();
                webhook.client_config = WebhookClientConfig {
                    url: Some(url.clone()),
                    ..Default::default()
                };
                if let Some(policy) = failure_policy {
                    webhook.failure_policy = Some(policy.into());
                }
                webhook
            })
            .collect(),
    );
    Ok(configuration)
}

impl TestEnv {
    /// The controller as `setup` asks for it; with the webhook, the manifests' webhook
    /// configuration points at it on 127.0.0.1 and this returns once the leader has injected
    /// its CA and the webhook answers.
    pub(crate) async fn start_controller(
        &self,
        client: &kube::Client,
        setup: &ControllerSetup,
    ) -> Result<ControllerProcess, TestEnvError> {
        let (webhook, admin) = (ports::free_port()?, ports::free_port()?);
        let process = self.supervise(self.controller_process(setup, webhook, admin)?);
        let resizer = if setup.resizer {
            Some(self.supervise(self.resizer_process()?))
        } else {
            None
        };
        if setup.webhook {
            self.register_pod_webhook(client, webhook).await?;
        }
        Ok(ControllerProcess {
            process,
            webhook,
            admin,
            _resizer: resizer,
        })
    }

    /// Where the controller serves the resizer's endpoint.
    fn resizer_socket(&self) -> std::path::PathBuf {
        self.dir().join("controller-resizer.sock")
    }

    /// csi-resizer as the controller Deployment runs it, under the controller's
    /// ServiceAccount, on the controller's socket. It waits for the socket itself.
    fn resizer_process(&self) -> Result<ProcessSpec, TestEnvError> {
        let launch = self.manifests.launch(manifests::OurContainer::Resizer)?;
        let kubeconfig = self.account_kubeconfig(&launch.service_account, "csi-resizer")?;
        let pod = manifests::PodFacts {
            name: "csi-resizer".into(),
            namespace: manifests::NAMESPACE.into(),
            node_name: "control-plane".into(),
        };
        let overrides = manifests::Overrides::new()
            .set("--csi-address", self.resizer_socket().display().to_string())
            .set("--kubeconfig", kubeconfig.display().to_string())
            .remove("--http-endpoint")
            .remove("--metrics-address");
        Ok(crate::node_processes::container_process(
            &self.manifests,
            manifests::OurContainer::Resizer,
            "csi-resizer",
            &self.tools.go("csi-resizer"),
            &pod,
            "csi-resizer.log",
            &overrides,
        )?)
    }

    /// The controller's process: its admin server on `admin`, its webhook on `webhook` when
    /// `setup` asks for it, changed by `setup`'s test items.
    fn controller_process(
        &self,
        setup: &ControllerSetup,
        webhook: u16,
        admin: u16,
    ) -> Result<ProcessSpec, TestEnvError> {
        let mut all = vec![format!("--admin-address=127.0.0.1:{admin}")];
        if setup.resizer {
            all.push(format!(
                "--resizer-endpoint=unix://{}",
                self.resizer_socket().display()
            ));
        }
        if setup.webhook {
            all.push(format!("--webhook-address=127.0.0.1:{webhook}"));
            all.push("--self-signed-san=127.0.0.1".to_string());
        } else {
            // The base's container has no webhook flags; `!` removes one should a test give it.
            all.push("!--webhook-address".to_string());
        }
        all.extend(setup.args.iter().cloned());
        self.our_process(
            manifests::OurContainer::Controller,
            "controller",
            "controller.log",
            &manifests::Overrides::from_args(&all),
        )
    }

    /// Points the pod webhook at the controller's `webhook` port and waits until it serves
    /// with its CA injected, so that no pod created afterwards bypasses it.
    async fn register_pod_webhook(
        &self,
        client: &kube::Client,
        webhook: u16,
    ) -> Result<(), TestEnvError> {
        let configuration = pod_webhook_configuration(
            &self.manifests,
            &[(
                POD_WEBHOOK,
                format!("https://127.0.0.1:{webhook}/pod/mutate"),
            )],
            None,
        )
        .map_err(|reason| {
            TestEnvError::Manifests(manifests::ManifestError::Unsupported {
                container: "controller".into(),
                reason,
            })
        })?;
        let hooks = kube::Api::<MutatingWebhookConfiguration>::all(client.clone());
        api_calls::apply(&hooks, &configuration).await?;
        let name = configuration.metadata.name.clone().unwrap_or_default();
        wait::until(
            "the controller's webhook to serve with its CA injected",
            WEBHOOK_WAIT,
            || webhook_serves(&hooks, &name, webhook),
        )
        .await
        .map_err(|e| {
            TestEnvError::Process(process::ProcessError::Log {
                path: self.dir().join("logs/controller.log"),
                source: std::io::Error::other(e.to_string()),
            })
        })
    }

    /// Starts a supervised `pmem-csi controller` as the manifests run it, changed by
    /// `overrides` (test items as [`manifests::Overrides::from_args`] reads them), logging to
    /// `logs/<name>.log`. When they give `--webhook-address` it runs as the scheduler-extender
    /// component configures it, otherwise (also when they remove it) as the base does.
    pub fn supervise_controller(
        &self,
        name: &str,
        overrides: &[&str],
    ) -> Result<Supervised, TestEnvError> {
        let spec = self.our_process(
            manifests::OurContainer::Controller,
            name,
            &format!("{name}.log"),
            &manifests::Overrides::from_args(overrides),
        )?;
        Ok(self.supervise(spec))
    }

    /// The controller's webhook and admin ports, when testenv runs it.
    pub fn controller_ports(&self) -> Option<(u16, u16)> {
        self.controller.as_ref().map(|c| (c.webhook, c.admin))
    }

    /// Takes the controller process out of the testenv's hands (to stop or kill it).
    pub fn take_controller(&mut self) -> Option<Supervised> {
        self.controller.take().map(|c| c.process)
    }

    /// Sends `signal` to the controller testenv runs, which its supervisor restarts.
    pub fn signal_controller(
        &self,
        signal: rustix::process::Signal,
    ) -> Result<(), process::ProcessError> {
        signal_running(
            self.controller.as_ref().map(|c| &c.process),
            "controller",
            signal,
        )
    }

    /// How often the controller's supervisor restarted it, when testenv runs it.
    pub fn controller_restarts(&self) -> Option<u32> {
        self.controller.as_ref().map(|c| c.process.state().restarts)
    }
}

/// Whether every webhook of `configuration` carries a CA bundle: the controller's leader has
/// injected its CA.
pub fn ca_injected(configuration: &MutatingWebhookConfiguration) -> bool {
    configuration.webhooks.iter().flatten().all(|w| {
        w.client_config
            .ca_bundle
            .as_ref()
            .is_some_and(|b| !b.0.is_empty())
    })
}

/// Whether webhook configuration `name` has its CA injected and its webhook accepts
/// connections on `port`; what it lacks otherwise.
async fn webhook_serves(
    hooks: &kube::Api<MutatingWebhookConfiguration>,
    name: &str,
    port: u16,
) -> Result<(), String> {
    let config = hooks.get(name).await.map_err(|e| e.to_string())?;
    if !ca_injected(&config) {
        return Err("no caBundle yet".into());
    }
    tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map(|_| ())
        .map_err(|e| format!("webhook port: {e}"))
}
