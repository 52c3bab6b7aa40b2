//! A JSON answer of the extender's routes (`/filter`, `/prioritize`, `/preempt`, `/explain`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// `value` as a 200 `application/json` answer; 500 if it cannot be encoded.
pub fn json(value: &impl serde::Serialize) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => (
            StatusCode::OK,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
