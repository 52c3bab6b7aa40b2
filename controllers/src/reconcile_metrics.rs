//! Reconcile metrics under controller-runtime's names, so its dashboards work unchanged:
//! `controller_runtime_reconcile_total{controller,result}`,
//! `controller_runtime_reconcile_errors_total{controller}`,
//! `controller_runtime_reconcile_time_seconds{controller}`,
//! `controller_runtime_active_workers{controller}`.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    controller: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabel {
    controller: String,
}

/// How a reconcile ended, as controller-runtime labels it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReconcileResult {
    /// Done; wait for the next change.
    Success,
    /// Done; run again after a delay.
    RequeueAfter,
    /// Failed.
    Error,
}

impl ReconcileResult {
    fn as_str(self) -> &'static str {
        match self {
            ReconcileResult::Success => "success",
            ReconcileResult::RequeueAfter => "requeue_after",
            ReconcileResult::Error => "error",
        }
    }
}

/// The reconcile metrics of every controller of a process.
#[derive(Clone, Debug)]
pub struct ReconcileMetrics {
    total: Family<ResultLabels, Counter>,
    errors: Family<ControllerLabel, Counter>,
    time: Family<ControllerLabel, Histogram>,
    active: Family<ControllerLabel, Gauge>,
}

impl ReconcileMetrics {
    /// Registers the families in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            total: Family::default(),
            errors: Family::default(),
            time: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.005, 2.0, 12))
            }),
            active: Family::default(),
        };
        // Counters are registered without `_total`; the encoder appends it.
        registry.register(
            "controller_runtime_reconcile",
            "Total number of reconciliations per controller",
            m.total.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_errors",
            "Total number of reconciliation errors per controller",
            m.errors.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_time_seconds",
            "Length of time per reconciliation per controller",
            m.time.clone(),
        );
        registry.register(
            "controller_runtime_active_workers",
            "Number of currently used workers per controller",
            m.active.clone(),
        );
        m
    }

    /// Creates every label combination of `controller` at zero, so dashboards and alerts see
    /// the series before the first reconcile.
    pub fn precreate(&self, controller: &str) {
        for result in [
            ReconcileResult::Success,
            ReconcileResult::RequeueAfter,
            ReconcileResult::Error,
        ] {
            let _ = self.total.get_or_create(&ResultLabels {
                controller: controller.into(),
                result: result.as_str().into(),
            });
        }
        let label = ControllerLabel {
            controller: controller.into(),
        };
        let _ = self.errors.get_or_create(&label);
        let _ = self.time.get_or_create(&label);
        let _ = self.active.get_or_create(&label);
    }

    /// Marks a reconcile as started; the returned guard records it when finished.
    pub fn start(&self, controller: &str) -> ActiveReconcile {
        let label = ControllerLabel {
            controller: controller.into(),
        };
        self.active.get_or_create(&label).inc();
        ActiveReconcile {
            metrics: self.clone(),
            controller: controller.to_string(),
            started: std::time::Instant::now(),
            done: false,
        }
    }

    fn finish(&self, controller: &str, result: ReconcileResult, elapsed: Duration) {
        let label = ControllerLabel {
            controller: controller.into(),
        };
        self.active.get_or_create(&label).dec();
        self.time
            .get_or_create(&label)
            .observe(elapsed.as_secs_f64());
        self.total
            .get_or_create(&ResultLabels {
                controller: controller.into(),
                result: result.as_str().into(),
            })
            .inc();
        if result == ReconcileResult::Error {
            self.errors.get_or_create(&label).inc();
        }
    }
}

/// One reconcile in progress.
#[derive(Debug)]
pub struct ActiveReconcile {
    metrics: ReconcileMetrics,
    controller: String,
    started: std::time::Instant,
    done: bool,
}

impl ActiveReconcile {
    /// Records how it ended.
    pub fn finish(mut self, result: ReconcileResult) {
        self.done = true;
        self.metrics
            .finish(&self.controller, result, self.started.elapsed());
    }
}

impl Drop for ActiveReconcile {
    fn drop(&mut self) {
        // A reconcile future dropped mid-way (shutdown) still leaves the worker gauge.
        if !self.done {
            self.metrics.finish(
                &self.controller,
                ReconcileResult::Error,
                self.started.elapsed(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precreated_and_counted() {
        let mut registry = Registry::default();
        let m = ReconcileMetrics::register(&mut registry);
        m.precreate("rescheduler");
        m.start("rescheduler").finish(ReconcileResult::Success);
        m.start("rescheduler").finish(ReconcileResult::Error);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        for line in [
            "controller_runtime_reconcile_total{controller=\"rescheduler\",result=\"success\"} 1",
            "controller_runtime_reconcile_total{controller=\"rescheduler\",result=\"requeue_after\"} 0",
            "controller_runtime_reconcile_total{controller=\"rescheduler\",result=\"error\"} 1",
            "controller_runtime_reconcile_errors_total{controller=\"rescheduler\"} 1",
            "controller_runtime_active_workers{controller=\"rescheduler\"} 0",
            "controller_runtime_reconcile_time_seconds_count{controller=\"rescheduler\"} 2",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }
}
