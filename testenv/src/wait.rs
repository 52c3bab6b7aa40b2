//! Polling with a deadline, for conditions tests and the harness wait for.

use std::future::Future;
use std::time::{Duration, Instant};

use kube::{Api, Resource};
use serde::de::DeserializeOwned;

/// The condition did not hold in time.
#[derive(Debug, thiserror::Error)]
#[error("timed out after {timeout:?} waiting for {what}; last observation: {last}")]
pub struct Timeout {
    /// What was awaited.
    pub what: String,
    /// How long.
    pub timeout: Duration,
    /// The last thing the check reported.
    pub last: String,
}

/// Calls `check` every 100 ms until it returns `Ok`, or fails after `timeout` with the last
/// `Err` it returned (which should say what was observed instead).
pub async fn until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T, Timeout>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let start = Instant::now();
    loop {
        let last = match check().await {
            Ok(value) => return Ok(value),
            Err(last) => last,
        };
        if start.elapsed() >= timeout {
            return Err(Timeout {
                what: what.to_string(),
                timeout,
                last,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until object `name` no longer exists.
pub async fn wait_gone<K>(api: &Api<K>, name: &str, timeout: Duration) -> Result<(), Timeout>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    until(&format!("{name} to be gone"), timeout, || async {
        match api.get_opt(name).await.map_err(|e| e.to_string())? {
            None => Ok(()),
            Some(_) => Err("still there".to_string()),
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn until_returns_value_and_reports_last_observation() {
        let mut n = 0;
        let v = until("n reaches 3", Duration::from_secs(5), || {
            n += 1;
            let n = n;
            async move { if n >= 3 { Ok(n) } else { Err(format!("n={n}")) } }
        })
        .await
        .expect("reaches 3");
        assert_eq!(v, 3);
        let err = until::<(), _, _>("never", Duration::ZERO, || async { Err("nope".into()) })
            .await
            .expect_err("times out");
        assert_eq!(err.last, "nope");
        assert!(err.to_string().contains("never"));
    }
}
