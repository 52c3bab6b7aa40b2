//! Client-side rate limiting of apiserver requests (`--kube-api-qps`, `--kube-api-burst`), as
//! client-go's token bucket does: kube-rs has none, and a node driver per node multiplies every
//! request rate by the cluster size.

use crate::flags::ClientBudget;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// A token bucket: `burst` tokens, refilled at `qps` per second.
#[derive(Debug)]
pub struct TokenBucket {
    qps: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(qps: f64, burst: u32, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        Self {
            qps,
            burst,
            tokens: burst,
            last: now,
        }
    }

    /// Takes one token at `now` and returns how long the caller must wait before using it
    /// (zero when one was available). Tokens may go negative: waiters queue up in order.
    pub fn take(&mut self, now: Instant) -> Duration {
        if self.qps <= 0.0 {
            return Duration::ZERO;
        }
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.qps).min(self.burst);
        self.tokens -= 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.qps)
        }
    }
}

impl TokenBucket {
    /// Takes one token at `now` if one is there; otherwise takes nothing and says how long
    /// until one will be (for callers that refuse rather than queue).
    pub fn try_take(&mut self, now: Instant) -> Result<(), Duration> {
        if self.qps <= 0.0 {
            return Ok(());
        }
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.qps).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - self.tokens) / self.qps))
        }
    }
}

/// A tower layer delaying requests to keep within the bucket.
#[derive(Clone, Debug)]
pub struct RateLimitLayer {
    bucket: Arc<Mutex<TokenBucket>>,
}

impl RateLimitLayer {
    /// `qps` ≤ 0 disables limiting.
    pub fn new(qps: f64, burst: u32) -> Self {
        Self {
            bucket: Arc::new(Mutex::new(TokenBucket::new(qps, burst, Instant::now()))),
        }
    }
}

impl<S> tower::Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            bucket: self.bucket.clone(),
            wait: None,
            permitted: false,
        }
    }
}

/// The service [`RateLimitLayer`] wraps: it becomes ready only when a token is due.
#[derive(Debug)]
pub struct RateLimit<S> {
    inner: S,
    bucket: Arc<Mutex<TokenBucket>>,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
    permitted: bool,
}

impl<S, R> tower::Service<R> for RateLimit<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if !self.permitted {
            if self.wait.is_none() {
                let wait = self
                    .bucket
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take(Instant::now());
                if wait.is_zero() {
                    self.permitted = true;
                } else {
                    self.wait = Some(Box::pin(tokio::time::sleep(wait)));
                }
            }
            if let Some(sleep) = self.wait.as_mut() {
                if sleep.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.wait = None;
                self.permitted = true;
            }
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        // The token taken in poll_ready pays for this request.
        self.permitted = false;
        self.inner.call(request)
    }
}

/// A kube client for the default configuration (in-cluster or `KUBECONFIG`) within `budget`.
pub async fn client(budget: ClientBudget) -> Result<kube::Client, kube::Error> {
    let config = kube::Config::infer()
        .await
        .map_err(kube::Error::InferConfig)?;
    let builder = kube::client::ClientBuilder::try_from(config)?;
    Ok(builder
        .with_layer(&RateLimitLayer::new(budget.qps, budget.burst))
        .build())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_table() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10.0, 3, t0);
        assert_eq!(b.take(t0), Duration::ZERO);
        assert_eq!(b.take(t0), Duration::ZERO);
        assert_eq!(b.take(t0), Duration::ZERO);
        assert_eq!(
            b.take(t0),
            Duration::from_millis(100),
            "burst spent: wait for a refill"
        );
        assert_eq!(
            b.take(t0),
            Duration::from_millis(200),
            "queued behind the previous waiter"
        );
        // After a long pause the bucket is full again, never fuller.
        let later = t0 + Duration::from_secs(60);
        for _ in 0..3 {
            assert_eq!(b.take(later), Duration::ZERO);
        }
        assert!(b.take(later) > Duration::ZERO);
        let mut unlimited = TokenBucket::new(0.0, 1, t0);
        for _ in 0..100 {
            assert_eq!(unlimited.take(t0), Duration::ZERO);
        }
    }

    #[test]
    fn try_take_refuses_without_queueing() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(2.0, 2, t0);
        assert_eq!(b.try_take(t0), Ok(()));
        assert_eq!(b.try_take(t0), Ok(()));
        assert_eq!(b.try_take(t0), Err(Duration::from_millis(500)));
        assert_eq!(
            b.try_take(t0),
            Err(Duration::from_millis(500)),
            "a refusal takes nothing"
        );
        assert_eq!(b.try_take(t0 + Duration::from_millis(500)), Ok(()));
        assert!(b.try_take(t0 + Duration::from_millis(600)).is_err());
    }
}
