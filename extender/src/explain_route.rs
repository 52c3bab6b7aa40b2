//! `GET /explain?namespace=NS&pod=NAME` on the extender's admin port: what `/filter` would
//! decide about that pod now and what the extender holds for it ([`crate::pod_view::PodView`]),
//! for `pmem-csi explain`. Read-only: it reserves, ends and journals nothing. It is on the
//! admin port because the extender's own port is loopback-only, and `explain` reaches an
//! extender through the apiserver's pod proxy.
//!
//! Each ask lists a pod from the apiserver on the extender's only client, whose watches feed
//! scheduling: the route has a budget of its own ([`ExplainBudget`]: two at once, two a second
//! with a burst of ten) and answers 429 with `Retry-After` when it is spent, instead of queueing
//! behind the watches or delaying them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use controllers::rate_limit::TokenBucket;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use tokio::sync::Semaphore;

use crate::json_response::json;
use crate::pod_view::PodView;

/// The query parameters `/explain` takes.
pub const PARAMETERS: [&str; 2] = ["namespace", "pod"];

/// The view of a pod from the locked state; `None` while the caches have not synced.
pub type ViewOf = Arc<dyn Fn(&Pod) -> Option<PodView> + Send + Sync>;

/// What the route reads: the pod from the apiserver, then the extender's state.
#[derive(Clone)]
pub struct ExplainSource {
    /// Reads the pod (the index keeps no pod specs).
    pub client: kube::Client,
    /// The extender's view of a pod.
    pub view: ViewOf,
    /// How many asks may read the apiserver, at once and per second.
    pub budget: Arc<ExplainBudget>,
}

/// The route's own budget of apiserver reads: a few asks at once and a few a second.
#[derive(Debug)]
pub struct ExplainBudget {
    in_flight: Arc<Semaphore>,
    rate: Mutex<TokenBucket>,
}

impl ExplainBudget {
    /// `at_once` asks in flight, `per_second` a second with a burst of `burst`.
    pub fn new(at_once: usize, per_second: f64, burst: u32) -> Self {
        Self {
            in_flight: Arc::new(Semaphore::new(at_once)),
            rate: Mutex::new(TokenBucket::new(per_second, burst, Instant::now())),
        }
    }

    /// The shipped budget: two at once, two a second, bursts of ten (an operator's `explain`
    /// asks once; a dashboard polling every few seconds fits).
    pub fn shipped() -> Self {
        Self::new(2, 2.0, 10)
    }

    /// A place for one ask, or how long to wait for one.
    fn admit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, ExplainRouteError> {
        let permit = Arc::clone(&self.in_flight)
            .try_acquire_owned()
            .map_err(|_| ExplainRouteError::Busy {
                retry_after: Duration::from_secs(1),
            })?;
        self.rate
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .try_take(Instant::now())
            .map_err(|wait| ExplainRouteError::Busy { retry_after: wait })?;
        Ok(permit)
    }
}

/// Why `/explain` gives no view. Each maps to one status in [`ExplainRouteError::status`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ExplainRouteError {
    /// A required parameter is absent or empty.
    #[error("query parameter {0:?} is required")]
    Missing(&'static str),
    /// A parameter is not a valid object name.
    #[error("query parameter {name:?}: {value:?} is not a valid Kubernetes name")]
    Invalid {
        /// The parameter.
        name: &'static str,
        /// Its value.
        value: String,
    },
    /// A parameter the route does not take (a typo would otherwise be ignored silently).
    #[error("unknown query parameter {0:?}; expected namespace and pod")]
    Unknown(String),
    /// No such pod.
    #[error("pod {namespace}/{pod} not found (query parameters \"namespace\" and \"pod\")")]
    NotFound {
        /// Namespace.
        namespace: String,
        /// Pod name.
        pod: String,
    },
    /// The apiserver did not answer the pod's read.
    #[error("reading pod {namespace}/{pod}: {message}")]
    Apiserver {
        /// Namespace.
        namespace: String,
        /// Pod name.
        pod: String,
        /// The client's error.
        message: String,
    },
    /// The watches have not listed yet: a view now would be a guess.
    #[error("the extender's caches have not synced yet; ask again shortly")]
    NotSynced,
    /// The route's budget of apiserver reads is spent.
    #[error(
        "too many asks: /explain answers two at once and two a second; retry after {}s",
        retry_after_secs(*retry_after)
    )]
    Busy {
        /// How long until the budget has room.
        retry_after: Duration,
    },
}

/// Whole seconds to put in `Retry-After` (at least 1).
fn retry_after_secs(wait: Duration) -> u64 {
    wait.as_secs_f64().ceil().max(1.0) as u64
}

impl ExplainRouteError {
    /// The HTTP status of the error.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Missing(_) | Self::Invalid { .. } | Self::Unknown(_) => StatusCode::BAD_REQUEST,
            Self::NotFound { .. } => StatusCode::NOT_FOUND,
            Self::Apiserver { .. } => StatusCode::BAD_GATEWAY,
            Self::NotSynced => StatusCode::SERVICE_UNAVAILABLE,
            Self::Busy { .. } => StatusCode::TOO_MANY_REQUESTS,
        }
    }
}

impl IntoResponse for ExplainRouteError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), format!("{self}\n")).into_response();
        if let Self::Busy { retry_after } = self {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                header::HeaderValue::from(retry_after_secs(retry_after)),
            );
        }
        response
    }
}

/// The validated parameters: (namespace, pod).
pub fn parameters(query: &BTreeMap<String, String>) -> Result<(String, String), ExplainRouteError> {
    if let Some(unknown) = query.keys().find(|k| !PARAMETERS.contains(&k.as_str())) {
        return Err(ExplainRouteError::Unknown(unknown.clone()));
    }
    let [namespace, pod] = PARAMETERS.map(|name| {
        let value = query
            .get(name)
            .filter(|v| !v.is_empty())
            .ok_or(ExplainRouteError::Missing(name))?;
        // The name goes into a field selector: a comma or `=` would change what it selects.
        if value.len() > 253
            || !value
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        {
            return Err(ExplainRouteError::Invalid {
                name,
                value: value.clone(),
            });
        }
        Ok(value.clone())
    });
    Ok((namespace?, pod?))
}

/// The route on its own router, to be merged into the admin server's.
pub fn router(source: ExplainSource) -> Router {
    Router::new()
        .route("/explain", get(explain))
        .with_state(source)
}

async fn explain(
    State(source): State<ExplainSource>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    match view(&source, &query).await {
        Ok(view) => json(&view),
        Err(e) => e.into_response(),
    }
}

async fn view(
    source: &ExplainSource,
    query: &BTreeMap<String, String>,
) -> Result<PodView, ExplainRouteError> {
    let (namespace, pod) = parameters(query)?;
    let _permit = source.budget.admit()?;
    // A list by name needs only the `list` the extender's watch already has, not `get`.
    let listed = Api::<Pod>::namespaced(source.client.clone(), &namespace)
        .list(&ListParams::default().fields(&format!("metadata.name={pod}")))
        .await
        .map_err(|e| ExplainRouteError::Apiserver {
            namespace: namespace.clone(),
            pod: pod.clone(),
            message: e.to_string(),
        })?;
    let Some(object) = listed.items.into_iter().next() else {
        return Err(ExplainRouteError::NotFound { namespace, pod });
    };
    (source.view)(&object).ok_or(ExplainRouteError::NotSynced)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[tokio::test]
    async fn the_budget_answers_429_when_spent() {
        let budget = ExplainBudget::new(1, 1.0, 1);
        let held = budget.admit().expect("the first ask");
        let busy = budget.admit().expect_err("one at once");
        assert!(matches!(busy, ExplainRouteError::Busy { .. }), "{busy:?}");
        drop(held);
        let busy = budget.admit().expect_err("one a second");
        let ExplainRouteError::Busy { retry_after } = busy else {
            panic!("{busy:?}");
        };
        assert!(retry_after > Duration::ZERO && retry_after <= Duration::from_secs(1));
        let response = ExplainRouteError::Busy { retry_after }.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(
            response
                .headers()
                .get(header::RETRY_AFTER)
                .map(|v| v.as_bytes()),
            Some(&b"1"[..])
        );
        assert_eq!(retry_after_secs(Duration::from_millis(1500)), 2);
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
    }

    #[test]
    fn parameters_table() {
        let invalid = |name, value: &str| ExplainRouteError::Invalid {
            name,
            value: value.into(),
        };
        for (name, pairs, want) in [
            (
                "both",
                &[("namespace", "demo"), ("pod", "web-0")][..],
                Ok(("demo".to_string(), "web-0".to_string())),
            ),
            (
                "no namespace",
                &[("pod", "web-0")],
                Err(ExplainRouteError::Missing("namespace")),
            ),
            (
                "empty pod",
                &[("namespace", "demo"), ("pod", "")],
                Err(ExplainRouteError::Missing("pod")),
            ),
            (
                "selector injection",
                &[("namespace", "demo"), ("pod", "a,metadata.name=b")],
                Err(invalid("pod", "a,metadata.name=b")),
            ),
            (
                "upper case namespace",
                &[("namespace", "Demo"), ("pod", "x")],
                Err(invalid("namespace", "Demo")),
            ),
            (
                "typo",
                &[("namespace", "demo"), ("pods", "x")],
                Err(ExplainRouteError::Unknown("pods".into())),
            ),
        ] {
            assert_eq!(parameters(&query(pairs)), want, "{name}");
        }
    }

    #[test]
    fn statuses_are_client_errors_for_bad_parameters() {
        assert_eq!(
            ExplainRouteError::Missing("pod").status(),
            StatusCode::BAD_REQUEST
        );
        let message = ExplainRouteError::Missing("pod").to_string();
        assert!(message.contains("\"pod\""), "{message}");
        assert_eq!(
            ExplainRouteError::NotFound {
                namespace: "a".into(),
                pod: "b".into()
            }
            .status(),
            StatusCode::NOT_FOUND
        );
    }
}
