//! The one way a process of pmem-csi hosts what it does: a set of [`Concern`]s, each a name,
//! whether only the leader runs it, and how to run it until a token ends it. The controller, the
//! node and the extender all hand theirs to [`host`]; none starts its loops by hand.

use std::future::Future;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::leader::{LeaderMetrics, LeaderSettings};

/// One run of an every-instance concern, until its token ends it; an error ends the process.
type RunOnce = Box<dyn FnOnce(CancellationToken) -> BoxFuture<'static, Result<(), String>> + Send>;

/// Starts one run of a leader-only concern, given the token that ends it (on shutdown, or when
/// this instance stops leading).
type RunWhileLeading = Box<dyn Fn(CancellationToken) -> BoxFuture<'static, ()> + Send + Sync>;

enum Run {
    Everywhere(RunOnce),
    LeaderOnly(RunWhileLeading),
}

/// One thing a process does.
pub struct Concern {
    name: String,
    run: Run,
}

impl std::fmt::Debug for Concern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Concern")
            .field("name", &self.name)
            .field("leader_only", &self.is_leader_only())
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
        Concern {
            name: name.into(),
            run: Run::Everywhere(Box::new(move |token| {
                Box::pin(async move {
                    run(token).await;
                    Ok(())
                })
            })),
        }
    }

    /// [`Concern::everywhere`] for a server that can fail: its error ends the process with a
    /// failure, also when it comes while shutting down.
    pub fn everywhere_fallible<F, Fut, E>(name: impl Into<String>, run: F) -> Self
    where
        F: FnOnce(CancellationToken) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: std::fmt::Display,
    {
        Concern {
            name: name.into(),
            run: Run::Everywhere(Box::new(move |token| {
                Box::pin(async move { run(token).await.map_err(|e| e.to_string()) })
            })),
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
            run: Run::LeaderOnly(Box::new(move |token| Box::pin(run(token)))),
        }
    }

    /// The concern's name (its leader Lease is `<prefix>-<name>`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether only the leader runs it.
    pub fn is_leader_only(&self) -> bool {
        matches!(self.run, Run::LeaderOnly(_))
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

/// Why hosting ended other than by shutdown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConcernError {
    /// A concern returned before shutdown.
    #[error("{0} stopped unexpectedly")]
    Stopped(String),
    /// A concern failed.
    #[error("{name}: {error}")]
    Failed {
        /// The concern.
        name: String,
        /// Its error.
        error: String,
    },
}

/// Runs `concerns` until `shutdown`: the everywhere ones once, the leader-only ones while this
/// instance leads their Lease (with `elector`; without, always). Returns once every concern has
/// ended and every election has released its Lease, or with the first concern that failed or
/// ended before `shutdown` (the caller stops the process: kubelet restarts it). A leader-only
/// concern that returns while still leading is started again, as after a regained leadership.
pub async fn host(
    concerns: Vec<Concern>,
    elector: Option<Elector>,
    shutdown: CancellationToken,
) -> Result<(), ConcernError> {
    let mut running = JoinSet::new();
    let mut elections = JoinSet::new();
    for Concern { name, run } in concerns {
        let token = shutdown.clone();
        let start = match run {
            Run::Everywhere(run) => {
                running.spawn(async move {
                    let result = run(token).await;
                    (name, result)
                });
                continue;
            }
            Run::LeaderOnly(start) => start,
        };
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
            (name, Ok(()))
        });
    }
    let mut first_error = None;
    while let Some(ended) = running.join_next().await {
        let error = match ended {
            Ok((name, Err(error))) => ConcernError::Failed { name, error },
            Ok((_, Ok(()))) if shutdown.is_cancelled() => continue,
            Ok((name, Ok(()))) => ConcernError::Stopped(name),
            Err(e) => ConcernError::Failed {
                name: "a concern".into(),
                error: format!("panicked: {e}"),
            },
        };
        tracing::error!("{error}");
        // One concern down is the process down: end the others, release the Leases.
        shutdown.cancel();
        first_error.get_or_insert(error);
    }
    while elections.join_next().await.is_some() {}
    first_error.map_or(Ok(()), Err)
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
        assert_eq!(result, Err(ConcernError::Stopped("quitter".into())));
        assert!(shutdown.is_cancelled());
        assert_eq!(other_ended.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_failure_during_shutdown_still_fails_the_process() {
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        let result = host(
            vec![Concern::everywhere_fallible(
                "server",
                |token: CancellationToken| async move {
                    token.cancelled().await;
                    Err::<(), _>("draining failed")
                },
            )],
            None,
            shutdown,
        )
        .await;
        assert_eq!(
            result,
            Err(ConcernError::Failed {
                name: "server".into(),
                error: "draining failed".into()
            })
        );
    }
}
