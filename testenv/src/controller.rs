//! The configuration that sends pods to the controller's webhook, as testenv can use it.

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, WebhookClientConfig,
};

use crate::manifests::Rendered;

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
