//! The node driver's heartbeat: a Lease `<driver>-node-<node>` in the driver namespace, renewed
//! while the CSI server serves. With `--heartbeat-grace` the controller treats a Lease expired
//! that long as a node without driver, which catches a driver that crashed or lost its node
//! while the Node object and its labels stay.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::PostParams;
use tokio_util::sync::CancellationToken;

use crate::flags::ClientBudget;
use crate::well_known::heartbeat_lease_name;

/// A Lease is valid for this many renew periods, so one late renewal does not expire it.
pub const PERIODS_PER_LEASE: u32 = 3;

/// The budget of the heartbeat's own client for renewals every `period`.
/// It has its own, so that a node busy with the publisher and the sweep (which share the
/// node's `--kube-api-qps`) never queues a renewal behind them. A renewal is two requests (read,
/// then write); twice that per period leaves room for a retry.
pub fn client_budget(period: Duration) -> ClientBudget {
    ClientBudget {
        qps: 4.0 / period.as_secs_f64().max(0.001),
        burst: 4,
    }
}

/// The Lease object for `node` renewed now.
pub fn lease(
    driver: &str,
    node: &str,
    namespace: &str,
    period: Duration,
    previous: Option<&Lease>,
) -> Lease {
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    let mut lease = previous.cloned().unwrap_or_else(|| Lease {
        metadata: ObjectMeta {
            name: Some(heartbeat_lease_name(driver, node)),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([
                (
                    "app.kubernetes.io/name".to_string(),
                    "pmem-csi-node".to_string(),
                ),
                ("app.kubernetes.io/part-of".into(), "pmem-csi".into()),
                ("app.kubernetes.io/component".into(), "node".into()),
                ("app.kubernetes.io/instance".into(), driver.into()),
            ])),
            ..Default::default()
        },
        spec: Some(LeaseSpec::default()),
    });
    let spec = lease.spec.get_or_insert_with(Default::default);
    if spec.holder_identity.as_deref() != Some(node) || spec.acquire_time.is_none() {
        spec.acquire_time = Some(now.clone());
    }
    spec.holder_identity = Some(node.into());
    spec.lease_duration_seconds =
        Some(i32::try_from((period * PERIODS_PER_LEASE).as_secs().max(1)).unwrap_or(i32::MAX));
    spec.renew_time = Some(now);
    lease
}

/// Renews the heartbeat every `period` until `shutdown`.
pub async fn run(
    client: kube::Client,
    driver: String,
    node: String,
    namespace: String,
    period: Duration,
    shutdown: CancellationToken,
) {
    let api = Api::<Lease>::namespaced(client, &namespace);
    let name = heartbeat_lease_name(&driver, &node);
    // Renewals start every period, however long the last one took: sleeping a period after
    // each would make every renewal late by the time the one before it took.
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        // A renewal that takes longer than a period is abandoned (a hung connection), so the
        // next one starts on time; the Lease lasts several periods.
        let renewal = async {
            match api.get_opt(&name).await {
                Ok(None) => api
                    .create(
                        &PostParams::default(),
                        &lease(&driver, &node, &namespace, period, None),
                    )
                    .await
                    .map(|_| ()),
                // The resourceVersion carried over makes a concurrent writer's change fail this
                // renewal instead of being overwritten; the next tick reads it again.
                Ok(Some(existing)) => api
                    .replace(
                        &name,
                        &PostParams::default(),
                        &lease(&driver, &node, &namespace, period, Some(&existing)),
                    )
                    .await
                    .map(|_| ()),
                Err(e) => Err(e),
            }
        };
        match tokio::time::timeout(period, renewal).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(lease = name, "renewing the heartbeat: {e}"),
            Err(_) => tracing::warn!(lease = name, ?period, "renewing the heartbeat timed out"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_budget_table() {
        for (period, qps) in [(10, 0.4), (1, 4.0), (2, 2.0)] {
            let got = client_budget(Duration::from_secs(period));
            assert!((got.qps - qps).abs() < 1e-9, "{period}s: {got:?}");
            assert_eq!(got.burst, 4);
        }
    }

    #[test]
    fn lease_shape() {
        let l = lease(
            "pmem-csi.intel.com",
            "node-1",
            "pmem-csi",
            Duration::from_secs(10),
            None,
        );
        assert_eq!(
            l.metadata.name.as_deref(),
            Some("pmem-csi-intel-com-node-node-1")
        );
        let spec = l.spec.clone().expect("spec");
        assert_eq!(spec.holder_identity.as_deref(), Some("node-1"));
        assert_eq!(spec.lease_duration_seconds, Some(30));
        assert!(spec.renew_time.is_some() && spec.acquire_time.is_some());
        let acquired = spec.acquire_time.clone();
        let renewed = lease(
            "pmem-csi.intel.com",
            "node-1",
            "pmem-csi",
            Duration::from_secs(10),
            Some(&l),
        );
        assert_eq!(
            renewed.spec.clone().expect("spec").acquire_time,
            acquired,
            "renewal keeps the acquire time"
        );
        let long = heartbeat_lease_name("pmem-csi.intel.com", &"n".repeat(80));
        assert!(long.len() <= 63, "{long}");
    }
}
