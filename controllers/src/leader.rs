//! Leader election on a Lease, opt-in per concern: standbys keep their caches warm and take
//! over when the leader stops renewing; `leader_election_master_status{name}` tells which
//! instance leads.
//!
//! The semantics are client-go's, so that two instances never act as leader at once:
//! - a standby judges expiry by its own monotonic clock, from when it last saw the Lease
//!   change, never from the holder's `renewTime` (written by another node's wall clock, which
//!   may be off by any amount);
//! - every attempt has a deadline, so a hung connection cannot keep a loop waiting;
//! - a leader steps down once its last successful renewal *started* longer ago than the renew
//!   deadline (two thirds of the lease), while any other candidate waits at least the whole
//!   lease after the last change it saw: the difference is the margin for concerns to stop.

use std::future::Future;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
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
    /// Added to the times this candidate writes into the Lease: zero in production; tests
    /// simulate a node whose wall clock is off (which must not matter).
    pub wall_clock_skew: SignedDuration,
}

impl LeaderSettings {
    /// How long a leader keeps leading without a successful renewal: [`renew_deadline`].
    pub fn renew_deadline(&self) -> Duration {
        renew_deadline(self.lease_duration)
    }
}

/// Two thirds of the lease (client-go's defaults: 10 s of 15 s): a leader that could not renew
/// for this long steps down, a whole lease before anyone else may take over.
pub fn renew_deadline(lease_duration: Duration) -> Duration {
    lease_duration * 2 / 3
}

/// What a candidate last saw of the Lease (`None`: no Lease) and when, by its own clock.
#[derive(Clone, Debug, PartialEq)]
pub struct Observation {
    /// The Lease's spec as read.
    pub spec: Option<LeaseSpec>,
    /// When this candidate first saw it so.
    pub at: Instant,
}

/// The observation after reading `spec` at `now`: unchanged (and so still dated from when it
/// was first seen) if the Lease is as `previous` saw it, otherwise new.
pub fn observe(
    previous: Option<Observation>,
    spec: Option<&LeaseSpec>,
    now: Instant,
) -> Observation {
    match previous {
        Some(p) if p.spec.as_ref() == spec => p,
        _ => Observation {
            spec: spec.cloned(),
            at: now,
        },
    }
}

/// Whether a leader whose last successful renewal started at `renewed` still leads at `now`.
pub fn still_leading(renewed: Option<Instant>, now: Instant, renew_deadline: Duration) -> bool {
    renewed.is_some_and(|r| now.saturating_duration_since(r) < renew_deadline)
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

/// Decides from the Lease as `observed`, judged at `now` (this candidate's monotonic clock).
pub fn decide(observed: &Observation, me: &str, now: Instant) -> LeaseAction {
    let Some(spec) = &observed.spec else {
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
    if now.saturating_duration_since(observed.at) < duration {
        LeaseAction::Standby
    } else {
        LeaseAction::TakeOver
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
    let now = MicroTime(Timestamp::now() + settings.wall_clock_skew);
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
        let renew_deadline = settings.renew_deadline();
        let mut observed = None::<Observation>;
        // When the last successful renewal (or acquisition) started.
        let mut renewed = None::<Instant>;
        loop {
            let started = Instant::now();
            let was_leading = *tx.borrow();
            // A leader's attempt may only run until its renew deadline; a standby's for as
            // long, so that a hung connection is given up in time either way.
            let limit = if was_leading {
                renewed
                    .map(|r| (r + renew_deadline).saturating_duration_since(started))
                    .unwrap_or_default()
            } else {
                renew_deadline
            };
            let attempt = async {
                let existing = api.get_opt(&settings.name).await?;
                let spec = existing.as_ref().and_then(|l| l.spec.as_ref());
                let seen = observe(observed.take(), spec, Instant::now());
                let action = decide(&seen, &me, Instant::now());
                observed = Some(seen);
                match action {
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
            };
            let outcome: Result<Result<bool, kube::Error>, _> =
                tokio::time::timeout(limit, attempt).await;
            let leading = match outcome {
                Ok(Ok(true)) => {
                    renewed = Some(started);
                    true
                }
                Ok(Ok(false)) => false,
                // Someone else wrote the Lease since it was read: whatever they did, it is
                // not ours to keep acting on.
                Ok(Err(kube::Error::Api(e))) if e.code == 409 => {
                    tracing::warn!(
                        lease = settings.name,
                        "leader election: the Lease changed under us: {e}"
                    );
                    false
                }
                Ok(Err(e)) => {
                    tracing::warn!(lease = settings.name, "leader election: {e}");
                    was_leading && still_leading(renewed, Instant::now(), renew_deadline)
                }
                Err(_) => {
                    tracing::warn!(
                        lease = settings.name,
                        ?limit,
                        "leader election: no answer from the apiserver in time"
                    );
                    was_leading && still_leading(renewed, Instant::now(), renew_deadline)
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
            // A leader wakes at its renew deadline at the latest, to step down on time.
            let mut next = Instant::now() + settings.retry_period;
            if leading && let Some(r) = renewed {
                next = next.min(r + renew_deadline);
            }
            tokio::select! {
                _ = tokio::time::sleep_until(next.into()) => {}
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
            renew_time: renewed_secs_ago.map(|s| MicroTime(now - SignedDuration::from_secs(s))),
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
        let t0 = Instant::now();
        let secs = Duration::from_secs;
        for (name, lease, seen_for, want) in [
            ("no lease", None, secs(0), LeaseAction::Create),
            (
                "mine",
                Some(spec(Some("me"), Some(1), 15)),
                secs(0),
                LeaseAction::Renew,
            ),
            (
                "mine, unchanged for long",
                Some(spec(Some("me"), Some(100), 15)),
                secs(100),
                LeaseAction::Renew,
            ),
            (
                "other, just changed",
                Some(spec(Some("other"), Some(5), 15)),
                secs(0),
                LeaseAction::Standby,
            ),
            (
                "other, unchanged for less than the lease",
                Some(spec(Some("other"), Some(5), 15)),
                secs(14),
                LeaseAction::Standby,
            ),
            (
                "other, unchanged for the lease",
                Some(spec(Some("other"), Some(5), 15)),
                secs(15),
                LeaseAction::TakeOver,
            ),
            // The holder's clock is 30 s behind: its fresh renewals carry old times. Judged
            // by when they were seen, it is alive (the old rule took over here: two leaders).
            (
                "other, renewTime 30 s old but just changed",
                Some(spec(Some("other"), Some(30), 15)),
                secs(1),
                LeaseAction::Standby,
            ),
            // The holder's clock is 30 s ahead: its renewTime lies in the future. It is
            // still taken over once nothing changed for the lease.
            (
                "other, renewTime in the future, unchanged for the lease",
                Some(spec(Some("other"), Some(-30), 15)),
                secs(15),
                LeaseAction::TakeOver,
            ),
            (
                "released",
                Some(spec(None, Some(1), 15)),
                secs(0),
                LeaseAction::TakeOver,
            ),
            (
                "never renewed, just seen",
                Some(spec(Some("other"), None, 15)),
                secs(0),
                LeaseAction::Standby,
            ),
        ] {
            let observed = Observation {
                spec: lease,
                at: t0,
            };
            assert_eq!(decide(&observed, "me", t0 + seen_for), want, "{name}");
        }
    }

    #[test]
    fn observations_date_from_the_last_change() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(10);
        let a = spec(Some("a"), Some(1), 15);
        let first = observe(None, Some(&a), t0);
        assert_eq!(first.at, t0);
        let same = observe(Some(first.clone()), Some(&a), later);
        assert_eq!(same.at, t0, "an unchanged Lease keeps its date");
        let mut renewed = a.clone();
        renewed.renew_time = Some(MicroTime(Timestamp::now()));
        assert_eq!(observe(Some(same.clone()), Some(&renewed), later).at, later);
        assert_eq!(observe(Some(same), None, later).at, later, "deleted");
    }

    #[test]
    fn a_leader_steps_down_at_the_renew_deadline() {
        let t0 = Instant::now();
        let deadline = renew_deadline(Duration::from_secs(15));
        assert_eq!(deadline, Duration::from_secs(10));
        assert!(still_leading(
            Some(t0),
            t0 + Duration::from_secs(9),
            deadline
        ));
        assert!(!still_leading(Some(t0), t0 + deadline, deadline));
        assert!(!still_leading(None, t0, deadline), "never renewed");
    }
}
