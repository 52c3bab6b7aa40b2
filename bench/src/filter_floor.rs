//! The floor of `/filter`: what any extender must do for a request — decode kube-scheduler's
//! ExtenderArgs, look up each named node, encode the answer — and nothing else: no fit, no
//! liveness, no reservation, no metrics, no lock. It runs as a process of its own on the same
//! HTTP stack as `pmem-csi extender` (axum on hyper, tokio's default runtime) with the same
//! decoder and answer encoder, so that `extender-filter-<n>-names` minus
//! `extender-filter-floor-<n>-names` is the cost of deciding.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use extender::api::{Candidates, ExtenderFilterResult, decode_request};

/// Free bytes per node, as an index would hold them.
type Table = Arc<HashMap<String, u64>>;

/// Serves `/filter` on `address` for nodes named by `node_name(0..nodes)` until killed.
pub async fn serve(
    address: SocketAddr,
    nodes: usize,
    node_name: fn(usize) -> String,
) -> anyhow::Result<()> {
    let table: Table = Arc::new((0..nodes).map(|i| (node_name(i), 96 << 30)).collect());
    let router = Router::new()
        .route("/filter", post(filter))
        .with_state(table);
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("binding {address}"))?;
    axum::serve(listener, router).await.context("serving")
}

async fn filter(State(table): State<Table>, body: Bytes) -> Response {
    let request = match decode_request(&body) {
        Ok(request) => request,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let Candidates::Names(names) = request.candidates else {
        return (StatusCode::BAD_REQUEST, "the floor takes NodeNames only").into_response();
    };
    let passed = names.retain(|name| table.get(name).is_some_and(|free| *free > 0));
    extender::json_response::encoded(
        ExtenderFilterResult {
            node_names: Some(passed),
            ..ExtenderFilterResult::default()
        }
        .to_json(),
    )
}
