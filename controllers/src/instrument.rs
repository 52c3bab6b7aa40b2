//! What every reconciler of pmem-csi does around its own work, once: count the reconcile in
//! controller-runtime's metrics (result, errors, duration, active workers), reset the object's
//! back-off after a success, and after a failure log it and requeue the object after its
//! back-off.

use std::fmt::Display;
use std::future::Future;
use std::hash::Hash;

use kube::Resource;
use kube::runtime::controller::Action;

use crate::error_backoff::ErrorBackoff;
use crate::reconcile_metrics::{ReconcileMetrics, ReconcileResult};

/// The metrics and back-off of one controller.
pub struct Instrument<K: Resource>
where
    K::DynamicType: Eq + Hash,
{
    controller: &'static str,
    metrics: ReconcileMetrics,
    backoff: ErrorBackoff<K>,
}

impl<K: Resource> Instrument<K>
where
    K::DynamicType: Eq + Hash + Default,
{
    /// The instrument of `controller` (its label in the metrics, whose series it creates at
    /// zero so that dashboards and alerts see the controller before its first reconcile).
    pub fn new(controller: &'static str, metrics: ReconcileMetrics) -> Self {
        metrics.precreate(controller);
        Instrument {
            controller,
            metrics,
            backoff: ErrorBackoff::default(),
        }
    }

    /// Runs one reconcile of `object`, counted; a success resets the object's back-off.
    pub async fn reconcile<E>(
        &self,
        object: &K,
        work: impl Future<Output = Result<Action, E>>,
    ) -> Result<Action, E> {
        let active = self.metrics.start(self.controller);
        let result = work.await;
        if result.is_ok() {
            self.backoff.succeeded(object);
        }
        active.finish(match &result {
            Ok(action) if *action == Action::await_change() => ReconcileResult::Success,
            Ok(_) => ReconcileResult::RequeueAfter,
            Err(_) => ReconcileResult::Error,
        });
        result
    }

    /// The error policy: log `error` and requeue `object` after its back-off.
    pub fn error_policy(&self, object: &K, error: &impl Display) -> Action {
        let delay = self.backoff.failed(object);
        tracing::warn!(
            controller = self.controller,
            "{error}; retrying in {delay:?}"
        );
        Action::requeue(delay)
    }

    /// How many objects are backing off.
    pub fn backing_off(&self) -> usize {
        self.backoff.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;
    use prometheus_client::registry::Registry;
    use std::time::Duration;

    fn object() -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some("a".into()),
                namespace: Some("ns".into()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    fn text(registry: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).expect("encodes");
        text
    }

    #[tokio::test]
    async fn counts_results_and_backs_off_per_object() {
        let mut registry = Registry::default();
        let metrics = ReconcileMetrics::register(&mut registry);
        let instrument = Instrument::<ConfigMap>::new("test", metrics);
        assert!(
            text(&registry).contains(
                "controller_runtime_reconcile_total{controller=\"test\",result=\"error\"} 0"
            ),
            "{}",
            text(&registry)
        );
        let failed: Result<Action, String> = instrument
            .reconcile(&object(), async { Err("boom".to_string()) })
            .await;
        let error = failed.expect_err("fails");
        assert_eq!(
            instrument.error_policy(&object(), &error),
            Action::requeue(Duration::from_millis(500))
        );
        assert_eq!(
            instrument.error_policy(&object(), &error),
            Action::requeue(Duration::from_secs(1)),
            "doubles"
        );
        assert_eq!(instrument.backing_off(), 1);
        let ok: Result<Action, String> = instrument
            .reconcile(&object(), async { Ok(Action::await_change()) })
            .await;
        assert!(ok.is_ok());
        assert_eq!(instrument.backing_off(), 0, "a success resets the back-off");
        let text = text(&registry);
        for (result, n) in [("error", 1), ("success", 1), ("requeue_after", 0)] {
            assert!(
                text.contains(&format!(
                    "controller_runtime_reconcile_total{{controller=\"test\",result=\"{result}\"}} {n}"
                )),
                "{result}: {text}"
            );
        }
    }
}
