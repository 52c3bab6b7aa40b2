//! A JSON answer of the extender's routes (`/filter`, `/prioritize`, `/preempt`, `/explain`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// `value` as a 200 `application/json` answer; 500 if it cannot be encoded.
pub fn json(value: &impl serde::Serialize) -> Response {
    encoded(serde_json::to_vec(value))
}

/// An answer already encoded as JSON: 200 `application/json`, or 500 with the error.
pub fn encoded(body: Result<Vec<u8>, serde_json::Error>) -> Response {
    match body {
        Ok(body) => (
            StatusCode::OK,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
