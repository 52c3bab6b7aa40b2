//! The admin HTTP server every pmem-csi process runs: `/healthz` (the process serves),
//! `/readyz` (every registered condition holds) and `/metrics` (OpenMetrics text).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::readiness::Readiness;

/// The content type of the OpenMetrics text exposition format.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What can go wrong running the admin server.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The listen address is taken or not allowed.
    #[error("admin server cannot listen on {address}: {source}")]
    Bind {
        /// The address from `--admin-address`.
        address: SocketAddr,
        /// Why binding failed.
        source: std::io::Error,
    },
}

/// The bound admin server and its routes, ready to be served ([`AdminServer::into_parts`]).
pub struct AdminServer {
    listener: TcpListener,
    address: SocketAddr,
    state: Arc<AdminState>,
    /// Routes a mode adds (the extender's read-only `/explain`).
    extra: Router,
}

struct AdminState {
    registry: Registry,
    readiness: Readiness,
}

impl AdminServer {
    /// Binds `address` now, so a taken port fails start-up instead of the first probe.
    pub async fn bind(
        address: SocketAddr,
        registry: Registry,
        readiness: Readiness,
    ) -> Result<Self, AdminError> {
        let listener = TcpListener::bind(address)
            .await
            .map_err(|source| AdminError::Bind { address, source })?;
        let address = listener
            .local_addr()
            .map_err(|source| AdminError::Bind { address, source })?;
        Ok(Self {
            listener,
            address,
            state: Arc::new(AdminState {
                registry,
                readiness,
            }),
            extra: Router::new(),
        })
    }

    /// Serves `routes` beside `/healthz`, `/readyz` and `/metrics` (which they must not
    /// repeat: axum panics on a duplicate path).
    pub fn with_routes(mut self, routes: Router) -> Self {
        self.extra = self.extra.merge(routes);
        self
    }

    /// The address actually bound (differs from the requested one for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.address
    }

    /// The bound listener and every route, for a server with deadlines and connection caps to
    /// serve (`webhooks::https::serve_admin`): a plain `axum::serve` has neither, and a few
    /// thousand clients that never finish their headers would hold its file descriptors.
    pub fn into_parts(self) -> (TcpListener, Router) {
        (self.listener, router(self.state).merge(self.extra))
    }
}

fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<Arc<AdminState>>) -> Response {
    let not_ready = state.readiness.not_ready();
    if not_ready.is_empty() {
        (StatusCode::OK, "ok").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}", not_ready.join(", ")),
        )
            .into_response()
    }
}

async fn metrics(State(state): State<Arc<AdminState>>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &state.registry) {
        Ok(()) => ([(header::CONTENT_TYPE, OPENMETRICS)], body).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics failed: {e}"),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use prometheus_client::metrics::counter::Counter;
    use tower::ServiceExt;

    async fn get_path(state: Arc<AdminState>, path: &str) -> (StatusCode, String, Option<String>) {
        let response = router(state)
            .oneshot(Request::get(path).body(Body::empty()).expect("request"))
            .await
            .expect("infallible");
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        (
            status,
            String::from_utf8_lossy(&body).into_owned(),
            content_type,
        )
    }

    fn state_with(readiness: Readiness) -> Arc<AdminState> {
        let mut registry = Registry::default();
        let counter = Counter::<u64>::default();
        counter.inc();
        registry.register("pmem_csi_test_events", "test events", counter);
        Arc::new(AdminState {
            registry,
            readiness,
        })
    }

    #[tokio::test]
    async fn healthz_is_ok_even_when_not_ready() {
        let readiness = Readiness::default();
        let _flag = readiness.register("stores");
        let (status, body, _) = get_path(state_with(readiness), "/healthz").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
    }

    #[tokio::test]
    async fn readyz_names_what_is_missing() {
        let readiness = Readiness::default();
        let stores = readiness.register("stores");
        let _csi = readiness.register("csi-server");
        let state = state_with(readiness);
        let (status, body, _) = get_path(state.clone(), "/readyz").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body, "not ready: csi-server, stores");
        stores.set(true);
        let (_, body, _) = get_path(state, "/readyz").await;
        assert_eq!(body, "not ready: csi-server");
    }

    #[tokio::test]
    async fn metrics_are_openmetrics() {
        let (status, body, content_type) =
            get_path(state_with(Readiness::default()), "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(content_type.as_deref(), Some(OPENMETRICS));
        assert!(body.contains("pmem_csi_test_events_total 1"), "{body}");
        assert!(body.ends_with("# EOF\n"), "{body}");
    }

    #[tokio::test]
    async fn unknown_path_is_404() {
        let (status, _, _) = get_path(state_with(Readiness::default()), "/nope").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn bind_reports_taken_address() {
        let first = AdminServer::bind(
            "127.0.0.1:0".parse().expect("addr"),
            Registry::default(),
            Readiness::default(),
        )
        .await
        .expect("bind");
        let taken = first.local_addr();
        let err = AdminServer::bind(taken, Registry::default(), Readiness::default())
            .await
            .err()
            .expect("second bind must fail");
        assert!(err.to_string().contains(&taken.to_string()), "{err}");
    }
}
