//! Rust types and service traits generated from `proto/csi.proto` (CSI v1.12, `csi.v1`).

#![allow(missing_docs, clippy::all, clippy::pedantic)]

tonic::include_proto!("csi.v1");
