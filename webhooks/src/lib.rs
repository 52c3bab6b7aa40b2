//! The pod mutating webhook (HTTPS, in `pmem-csi controller`): which pods to mark for the
//! scheduler extender, its AdmissionReview decoding, and its TLS (rustls, file reload, the
//! self-signed CA and its Secret).
//!
//! Sans-IO cores (the mutation decision, the certificate rules) are pure functions over plain
//! data; the server around them stays thin.

pub mod admission;
pub mod certificate_secret;
pub mod controller_concerns;
pub mod https;
pub mod mutation;
pub mod self_signed;
pub mod tls;
pub mod webhook;

/// Time as the certificate functions take it.
pub use time::OffsetDateTime;
