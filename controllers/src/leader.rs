//! Leader election on a Lease, opt-in per concern: standbys keep their caches warm and take
//! over when the leader stops renewing; `leader_election_master_status{name}` tells which
//! instance leads.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Timing of one election.
#[derive(Clone, Debug)]
pub struct LeaderSettings {
    /// Lease name.
    pub name: String,
    /// Lease namespace.
    pub namespace: String,
    /// This instance.
    pub identity: String,
    /// How long a lease is valid without renewal.
    pub lease_duration: Duration,
    /// How often the leader renews and standbys look.
    pub retry_period: Duration,
}

/// What to do with the Lease as found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseAction {
    /// None exists: create it, holding it.
    Create,
    /// Ours: renew it.
    Renew,
    /// Someone else's, expired (or released): take it over.
    TakeOver,
    /// Someone else's, valid: stand by.
    Standby,
}

/// Decides from the Lease's spec (`None`: no Lease), judged at `now`.
pub fn decide(spec: Option<&LeaseSpec>, me: &str, now: Timestamp) -> LeaseAction {
    let Some(spec) = spec else {
        return LeaseAction::Create;
    };
    let holder = spec.holder_identity.as_deref().unwrap_or_default();
    if holder == me {
        return LeaseAction::Renew;
    }
    if holder.is_empty() {
        return LeaseAction::TakeOver;
    }
    let duration =
        Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0));
    let renewed = spec
        .renew_time
        .as_ref()
        .or(spec.acquire_time.as_ref())
        .map(|t| t.0);
    match renewed {
        Some(t) if now.duration_since(t).try_into().unwrap_or(Duration::ZERO) <= duration => {
            LeaseAction::Standby
        }
        _ => LeaseAction::TakeOver,
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NameLabel {
    name: String,
}

/// `leader_election_master_status{name}`.
#[derive(Clone, Debug)]
pub struct LeaderMetrics {
    status: Family<NameLabel, Gauge>,
}

impl LeaderMetrics {
    /// Registers the gauge.
    pub fn register(registry: &mut Registry) -> Self {
        let status = Family::<NameLabel, Gauge>::default();
        registry.register(
            "leader_election_master_status",
            "Gauge of whether this instance leads (1) or stands by (0), by Lease name",
            status.clone(),
        );
        Self { status }
    }

    fn set(&self, name: &str, leading: bool) {
        self.status
            .get_or_create(&NameLabel { name: name.into() })
            .set(i64::from(leading));
    }
}

fn spec_for(
    me: &str,
    settings: &LeaderSettings,
    previous: Option<&LeaseSpec>,
    acquire: bool,
) -> LeaseSpec {
    let now = MicroTime(Timestamp::now());
    let mut spec = previous.cloned().unwrap_or_default();
    if acquire {
        spec.acquire_time = Some(now.clone());
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.holder_identity = Some(me.into());
    spec.lease_duration_seconds =
        Some(i32::try_from(settings.lease_duration.as_secs().max(1)).unwrap_or(i32::MAX));
    spec.renew_time = Some(now);
    spec
}

/// Runs the election until `shutdown`, publishing leadership on the returned channel; on
/// shutdown a leader releases the Lease so a standby takes over at once.
pub fn elect(
    client: kube::Client,
    settings: LeaderSettings,
    metrics: LeaderMetrics,
    shutdown: CancellationToken,
) -> (watch::Receiver<bool>, impl Future<Output = ()>) {
    let (tx, rx) = watch::channel(false);
    let task = async move {
        let api = Api::<Lease>::namespaced(client, &settings.namespace);
        let me = settings.identity.clone();
        metrics.set(&settings.name, false);
        let mut last_renewal = None::<std::time::Instant>;
        loop {
            let outcome: Result<bool, kube::Error> = async {
                let existing = api.get_opt(&settings.name).await?;
                let spec = existing.as_ref().and_then(|l| l.spec.as_ref());
                match decide(spec, &me, Timestamp::now()) {
                    LeaseAction::Standby => Ok(false),
                    LeaseAction::Create => {
                        let lease = Lease {
                            metadata: ObjectMeta {
                                name: Some(settings.name.clone()),
                                namespace: Some(settings.namespace.clone()),
                                ..Default::default()
                            },
                            spec: Some(spec_for(&me, &settings, None, true)),
                        };
                        api.create(&PostParams::default(), &lease).await?;
                        Ok(true)
                    }
                    action => {
                        // The resourceVersion of what was read guards the write: of two
                        // standbys taking over at once, only one succeeds.
                        let mut lease = existing.clone().unwrap_or_default();
                        lease.spec = Some(spec_for(
                            &me,
                            &settings,
                            spec,
                            action == LeaseAction::TakeOver,
                        ));
                        api.replace(&settings.name, &PostParams::default(), &lease)
                            .await?;
                        Ok(true)
                    }
                }
            }
            .await;
            let leading = match outcome {
                Ok(true) => {
                    last_renewal = Some(std::time::Instant::now());
                    true
                }
                Ok(false) => false,
                Err(e) => {
                    tracing::warn!(lease = settings.name, "leader election: {e}");
                    // Keep leading only while the last renewal is still valid.
                    *tx.borrow()
                        && last_renewal.is_some_and(|t| t.elapsed() < settings.lease_duration)
                }
            };
            if leading != *tx.borrow() {
                tracing::info!(
                    lease = settings.name,
                    identity = me,
                    leading,
                    "leadership changed"
                );
            }
            tx.send_replace(leading);
            metrics.set(&settings.name, leading);
            tokio::select! {
                _ = tokio::time::sleep(settings.retry_period) => {}
                _ = shutdown.cancelled() => break,
            }
        }
        if *tx.borrow() {
            // Release: an empty holder lets a standby take over without waiting for expiry.
            if let Ok(Some(mut lease)) = api.get_opt(&settings.name).await
                && let Some(spec) = lease
                    .spec
                    .as_mut()
                    .filter(|s| s.holder_identity.as_deref() == Some(me.as_str()))
            {
                spec.holder_identity = None;
                if let Err(e) = api
                    .replace(&settings.name, &PostParams::default(), &lease)
                    .await
                {
                    tracing::warn!(lease = settings.name, "releasing the lease: {e}");
                }
            }
            tx.send_replace(false);
            metrics.set(&settings.name, false);
        }
    };
    (rx, task)
}

/// Runs `concern` while `leading` says so: started on gaining leadership, cancelled on losing
/// it, started again on regaining it; returns on `shutdown`. A channel whose sender is gone
/// keeps its last value for good (an instance without election leads forever).
pub async fn while_leading<F, Fut>(
    mut leading: watch::Receiver<bool>,
    shutdown: CancellationToken,
    concern: F,
) where
    F: Fn(CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    loop {
        let waited = tokio::select! {
            r = leading.wait_for(|l| *l) => r.is_ok(),
            _ = shutdown.cancelled() => return,
        };
        let gained = waited || *leading.borrow();
        if !gained {
            // The election ended without leadership: nothing more to run.
            shutdown.cancelled().await;
            return;
        }
        let term = shutdown.child_token();
        let run = concern(term.clone());
        tokio::pin!(run);
        let mut watch = leading.clone();
        let lost = async move {
            // The guard wait_for returns must not live across the pending await (not Send).
            let lost = watch.wait_for(|l| !*l).await.is_ok();
            if !lost {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            _ = &mut run => {}
            _ = lost => {
                term.cancel();
                run.await;
            }
        }
        if shutdown.is_cancelled() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(holder: Option<&str>, renewed_secs_ago: Option<i64>, duration: i32) -> LeaseSpec {
        let now = Timestamp::now();
        LeaseSpec {
            holder_identity: holder.map(str::to_string),
            renew_time: renewed_secs_ago
                .map(|s| MicroTime(now - k8s_openapi::jiff::SignedDuration::from_secs(s))),
            lease_duration_seconds: Some(duration),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn while_leading_follows_leadership() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (tx, rx) = watch::channel(false);
        let shutdown = CancellationToken::new();
        let starts = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let (s, r) = (starts.clone(), running.clone());
        let task = tokio::spawn(while_leading(rx, shutdown.clone(), move |term| {
            let (s, r) = (s.clone(), r.clone());
            async move {
                s.fetch_add(1, Ordering::SeqCst);
                r.fetch_add(1, Ordering::SeqCst);
                term.cancelled().await;
                r.fetch_sub(1, Ordering::SeqCst);
            }
        }));
        let settle = || async {
            for _ in 0..50 {
                tokio::task::yield_now().await;
            }
        };
        settle().await;
        assert_eq!(
            starts.load(Ordering::SeqCst),
            0,
            "not started while standing by"
        );
        tx.send_replace(true);
        settle().await;
        assert_eq!(
            (
                starts.load(Ordering::SeqCst),
                running.load(Ordering::SeqCst)
            ),
            (1, 1)
        );
        tx.send_replace(false);
        settle().await;
        assert_eq!(
            running.load(Ordering::SeqCst),
            0,
            "stopped on losing leadership"
        );
        tx.send_replace(true);
        settle().await;
        assert_eq!(
            (
                starts.load(Ordering::SeqCst),
                running.load(Ordering::SeqCst)
            ),
            (2, 1)
        );
        drop(tx);
        settle().await;
        assert_eq!(
            running.load(Ordering::SeqCst),
            1,
            "a closed channel keeps its last value"
        );
        shutdown.cancel();
        task.await.expect("ends on shutdown");
        assert_eq!(running.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn decide_table() {
        let now = Timestamp::now();
        for (name, lease, want) in [
            ("no lease", None, LeaseAction::Create),
            (
                "mine",
                Some(spec(Some("me"), Some(1), 15)),
                LeaseAction::Renew,
            ),
            (
                "mine even if expired",
                Some(spec(Some("me"), Some(100), 15)),
                LeaseAction::Renew,
            ),
            (
                "other, valid",
                Some(spec(Some("other"), Some(5), 15)),
                LeaseAction::Standby,
            ),
            (
                "other, expired",
                Some(spec(Some("other"), Some(20), 15)),
                LeaseAction::TakeOver,
            ),
            (
                "released",
                Some(spec(None, Some(1), 15)),
                LeaseAction::TakeOver,
            ),
            (
                "never renewed",
                Some(spec(Some("other"), None, 15)),
                LeaseAction::TakeOver,
            ),
        ] {
            assert_eq!(decide(lease.as_ref(), "me", now), want, "{name}");
        }
    }
}
