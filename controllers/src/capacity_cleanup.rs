//! Capacity clean-up (leader): deletes this driver's CSIStorageCapacity objects that nobody
//! will update any more — those of nodes where the driver definitely does not run, and those of
//! StorageClasses that no longer exist — so the scheduler stops trusting stale capacity.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::storage::v1::{CSIStorageCapacity, StorageClass};
use kube::Api;
use kube::api::DeleteParams;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;

use crate::instrument::Instrument;
use crate::liveness::{DriverlessReason, Liveness};
use crate::liveness_view::LivenessView;
use crate::reconcile_metrics::ReconcileMetrics;
use crate::stores::Stores;
use crate::volume_facts::capacity_node;
use crate::well_known::DRIVER_LABEL;

/// The controller's name in metrics and logs.
pub const CONTROLLER: &str = "capacity-cleanup";

/// Why an object goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CleanupReason {
    /// Its StorageClass is gone.
    ClassDeleted,
    /// Its node has no driver.
    Driverless(DriverlessReason),
}

/// The decision about one capacity object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CleanupVerdict {
    /// Leave it; judge again after the given time (`None`: on change only).
    Keep(Option<Duration>),
    /// Delete it.
    Delete(CleanupReason),
}

/// Decides about an object of `class` (existing or not) for `node` (from its topology).
pub fn decide(
    class_exists: bool,
    node: Option<&str>,
    liveness: impl FnOnce(&str) -> Liveness,
    grace: Duration,
) -> CleanupVerdict {
    if !class_exists {
        return CleanupVerdict::Delete(CleanupReason::ClassDeleted);
    }
    let Some(node) = node else {
        // Not one of ours in shape: never delete what we cannot attribute to a node.
        return CleanupVerdict::Keep(None);
    };
    match liveness(node) {
        Liveness::MayRun => CleanupVerdict::Keep(Some(grace.max(Duration::from_secs(1)))),
        Liveness::Suspect { remaining, .. } => {
            CleanupVerdict::Keep(Some(remaining + Duration::from_millis(100)))
        }
        Liveness::DefinitelyNotRunning(reason) => {
            CleanupVerdict::Delete(CleanupReason::Driverless(reason))
        }
    }
}

/// Failures of one clean-up.
#[derive(Debug, thiserror::Error)]
#[error("{op} CSIStorageCapacity {name}: {source}")]
pub struct CleanupError {
    op: &'static str,
    name: String,
    source: kube::Error,
}

struct Context {
    instrument: Instrument<CSIStorageCapacity>,
    client: kube::Client,
    stores: Stores,
    liveness: LivenessView,
}

/// Runs the clean-up over this driver's capacity objects in `namespace` until `shutdown`.
pub async fn run(
    client: kube::Client,
    stores: Stores,
    liveness: LivenessView,
    reconciles: ReconcileMetrics,
    shutdown: CancellationToken,
) {
    let settings = liveness.settings().clone();
    let api = Api::<CSIStorageCapacity>::namespaced(client.clone(), &settings.namespace);
    let ctx = Arc::new(Context {
        instrument: Instrument::new(CONTROLLER, reconciles),
        client,
        stores,
        liveness,
    });
    Controller::new(
        api,
        watcher::Config::default().labels(&format!("{DRIVER_LABEL}={}", settings.driver)),
    )
    .graceful_shutdown_on(shutdown.cancelled_owned())
    .run(
        reconcile,
        |object, e: &CleanupError, ctx: Arc<Context>| ctx.instrument.error_policy(&object, e),
        ctx,
    )
    .for_each(|_| async {})
    .await;
}

async fn reconcile(
    object: Arc<CSIStorageCapacity>,
    ctx: Arc<Context>,
) -> Result<Action, CleanupError> {
    ctx.instrument
        .reconcile(&object, clean(&object, &ctx))
        .await
}

async fn clean(object: &CSIStorageCapacity, ctx: &Context) -> Result<Action, CleanupError> {
    let settings = ctx.liveness.settings();
    let class_exists = ctx
        .stores
        .classes
        .get(&ObjectRef::<StorageClass>::new(&object.storage_class_name))
        .is_some();
    let node = capacity_node(object, &settings.driver);
    let name = object.metadata.name.clone().unwrap_or_default();
    let err = |op| {
        let name = name.clone();
        move |source| CleanupError { op, name, source }
    };
    let verdict = decide(
        class_exists,
        node.as_deref(),
        |n| ctx.liveness.judge(n),
        settings.grace,
    );
    let reason = match verdict {
        // Class deletions do not trigger capacity objects: look again after a while.
        CleanupVerdict::Keep(Some(after)) => return Ok(Action::requeue(after)),
        CleanupVerdict::Keep(None) => return Ok(Action::await_change()),
        CleanupVerdict::Delete(reason) => reason,
    };
    // Confirm with uncached reads before deleting.
    let confirmed = match reason {
        CleanupReason::ClassDeleted => Api::<StorageClass>::all(ctx.client.clone())
            .get_opt(&object.storage_class_name)
            .await
            .map_err(err("confirming the class of"))?
            .is_none(),
        CleanupReason::Driverless(_) => match node.as_deref() {
            Some(n) => ctx
                .liveness
                .confirm(&ctx.client, n)
                .await
                .map_err(err("confirming the node of"))?
                .is_some(),
            None => false,
        },
    };
    if !confirmed {
        return Ok(Action::requeue(settings.grace.max(Duration::from_secs(1))));
    }
    let api = Api::<CSIStorageCapacity>::namespaced(ctx.client.clone(), &settings.namespace);
    match api.delete(&name, &DeleteParams::default()).await {
        Ok(_) => tracing::info!(name, ?reason, "deleted stale capacity"),
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => return Err(err("deleting")(e)),
    }
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decide_table() {
        let grace = Duration::from_secs(5);
        let gone = Liveness::DefinitelyNotRunning(DriverlessReason::NodeMissing);
        for (name, class_exists, node, liveness, want) in [
            (
                "class gone",
                false,
                Some("n1"),
                Liveness::MayRun,
                CleanupVerdict::Delete(CleanupReason::ClassDeleted),
            ),
            (
                "driverless",
                true,
                Some("n1"),
                gone,
                CleanupVerdict::Delete(CleanupReason::Driverless(DriverlessReason::NodeMissing)),
            ),
            (
                "driver may run",
                true,
                Some("n1"),
                Liveness::MayRun,
                CleanupVerdict::Keep(Some(grace)),
            ),
            (
                "suspect",
                true,
                Some("n1"),
                Liveness::Suspect {
                    reason: DriverlessReason::NodeMissing,
                    remaining: Duration::from_secs(2),
                },
                CleanupVerdict::Keep(Some(Duration::from_millis(2100))),
            ),
            (
                "no node in topology",
                true,
                None,
                gone,
                CleanupVerdict::Keep(None),
            ),
        ] {
            assert_eq!(
                decide(class_exists, node, |_| liveness, grace),
                want,
                "{name}"
            );
        }
    }
}
