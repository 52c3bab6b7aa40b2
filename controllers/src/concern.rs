//! The one way a process of pmem-csi hosts what it does: a set of [`Concern`]s, each a name,
//! whether only the leader runs it, and how to run it until a token ends it. The controller, the
//! node and the extender all hand theirs to [`host`]; none starts its loops by hand.

use std::future::Future;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::leader::{LeaderMetrics, LeaderSettings};

/// Starts one run of a concern, given the token that ends it (on shutdown, or when this
/// instance stops leading).
pub type ConcernStart = Box<dyn Fn(CancellationToken) -> BoxFuture<'static, ()> + Send + Sync>;

/// One thing a process does.
pub struct Concern {
    name: String,
    leader_only: bool,
    start: ConcernStart,
}

impl std::fmt::Debug for Concern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Concern")
            .field("name", &self.name)
            .field("leader_only", &self.leader_only)
            .finish_non_exhaustive()
    }
}

impl Concern {
    /// A concern every instance runs, once, until shutdown. Ending earlier is a failure of the
    /// process.
    pub fn everywhere<F, Fut>(name: impl Into<String>, run: F) -> Self
    where
        F: FnOnce(CancellationToken) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        // Started exactly once by [`host`]; the slot only turns the FnOnce into the Fn that
        // leader-only concerns need.
        let slot = std::sync::Mutex::new(Some(run));
        Concern {
            name: name.into(),
            leader_only: false,
            start: Box::new(move |token| {
                let run = slot
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take();
                match run {
                    Some(run) => Box::pin(run(token)),
                    None => Box::pin(async {}),
                }
            }),
        }
    }

    /// A concern only the leader runs: started when this instance gains the Lease
    /// `<prefix>-<name>`, ended when it loses it, started again when it regains it. Without
    /// leader election every instance leads.
    pub fn leader_only<F, Fut>(name: impl Into<String>, run: F) -> Self
    where
        F: Fn(CancellationToken) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        Concern {
            name: name.into(),
            leader_only: true,
            start: Box::new(move |token| Box::pin(run(token))),
        }
    }

    /// The concern's name (its leader Lease is `<prefix>-<name>`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether only the leader runs it.
    pub fn is_leader_only(&self) -> bool {
        self.leader_only
    }
}

/// How the leader-only concerns of a process are elected: one Lease per concern.
#[derive(Clone)]
pub struct Elector {
    /// The elections' own client, so that no other traffic delays a renewal.
    pub client: kube::Client,
    /// The driver name, which prefixes the Lease names.
    pub driver: String,
    /// Where the Leases live.
    pub namespace: String,
    /// This instance's identity.
    pub identity: String,
    /// How long a Lease is valid without renewal.
    pub lease_duration: Duration,
    /// How often the leader renews and standbys check.
    pub retry_period: Duration,
    /// `leader_election_master_status`.
    pub metrics: LeaderMetrics,
}

/// A concern that ended before shutdown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0} stopped unexpectedly")]
pub struct ConcernEnded(pub String);

/// Runs `concerns` until `shutdown`: the everywhere ones once, the leader-only ones while this
/// instance leads their Lease (with `elector`; without, always). Returns once every concern has
/// ended and every election has released its Lease, or with the name of a concern that ended
/// before `shutdown` (the caller stops the process: kubelet restarts it).
pub async fn host(
    concerns: Vec<Concern>,
    elector: Option<Elector>,
    shutdown: CancellationToken,
) -> Result<(), ConcernEnded> {
    let mut running = JoinSet::new();
    let mut elections = JoinSet::new();
    for concern in concerns {
        let Concern {
            name,
            leader_only,
            start,
        } = concern;
        let token = shutdown.clone();
        if !leader_only {
            running.spawn(async move {
                start(token).await;
                name
            });
            continue;
        }
        let leading = match &elector {
            None => tokio::sync::watch::channel(true).1,
            Some(elector) => {
                let (rx, election) = crate::leader::elect(
                    elector.client.clone(),
                    LeaderSettings {
                        name: crate::well_known::leader_lease_name(&elector.driver, &name),
                        namespace: elector.namespace.clone(),
                        identity: elector.identity.clone(),
                        lease_duration: elector.lease_duration,
                        retry_period: elector.retry_period,
                        wall_clock_skew: Default::default(),
                    },
                    elector.metrics.clone(),
                    shutdown.clone(),
                );
                elections.spawn(election);
                rx
            }
        };
        running.spawn(async move {
            // The closure owns `start`: the task outlives this loop.
            #[allow(clippy::redundant_closure)]
            crate::leader::while_leading(leading, token, move |term| start(term)).await;
            name
        });
    }
    let mut ended_early = None;
    while let Some(ended) = running.join_next().await {
        let name = match ended {
            Ok(name) => name,
            Err(e) => format!("a concern that panicked ({e})"),
        };
        if !shutdown.is_cancelled() && ended_early.is_none() {
            tracing::error!(concern = %name, "stopped unexpectedly");
            ended_early = Some(name);
            // One concern down is the process down: end the others, release the Leases.
            shutdown.cancel();
        }
    }
    while elections.join_next().await.is_some() {}
    ended_early.map_or(Ok(()), |name| Err(ConcernEnded(name)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn without_election_every_concern_runs_until_shutdown() {
        let started = Arc::new(AtomicUsize::new(0));
        let concern = |name: &str, leader: bool| {
            let started = started.clone();
            let run = move |token: CancellationToken| {
                let started = started.clone();
                async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    token.cancelled().await;
                }
            };
            if leader {
                Concern::leader_only(name, run)
            } else {
                Concern::everywhere(name, run)
            }
        };
        let shutdown = CancellationToken::new();
        let hosted = tokio::spawn(host(
            vec![concern("a", false), concern("b", true)],
            None,
            shutdown.clone(),
        ));
        while started.load(Ordering::SeqCst) < 2 {
            tokio::task::yield_now().await;
        }
        shutdown.cancel();
        assert_eq!(hosted.await.expect("joins"), Ok(()));
    }

    #[tokio::test]
    async fn a_concern_ending_early_ends_the_others_and_is_named() {
        let shutdown = CancellationToken::new();
        let other_ended = Arc::new(AtomicUsize::new(0));
        let ended = other_ended.clone();
        let result = host(
            vec![
                Concern::everywhere("quitter", |_| async {}),
                Concern::leader_only("patient", move |token: CancellationToken| {
                    let ended = ended.clone();
                    async move {
                        token.cancelled().await;
                        ended.fetch_add(1, Ordering::SeqCst);
                    }
                }),
            ],
            None,
            shutdown.clone(),
        )
        .await;
        assert_eq!(result, Err(ConcernEnded("quitter".into())));
        assert!(shutdown.is_cancelled());
        assert_eq!(other_ended.load(Ordering::SeqCst), 1);
    }
}
