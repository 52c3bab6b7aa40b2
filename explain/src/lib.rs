//! `pmem-csi explain pod/NAME`: why a pod is Pending, or where its PMEM volumes are, in plain
//! words or as JSON.
//!
//! Sans-IO core: [`gather`] reads the pod, its claims, classes, PVs, the driver's capacity
//! objects, node liveness, recent events and the scheduler extender's view into
//! [`facts::Facts`]; [`explanation::explain`] decides from them alone; [`render::render`] puts
//! the decision in words.

pub mod explanation;
pub mod extender_view;
pub mod facts;
pub mod gather;
pub mod options;
pub mod render;

pub use explanation::{Explanation, explain};
pub use options::{ExplainArgs, ExplainConfig, Output};

/// Why `explain` could not explain.
#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    /// The target is not `pod/NAME`.
    #[error("expected pod/NAME, got {given:?}")]
    Target {
        /// What was given.
        given: String,
    },
    /// `--extender` is not a plain-HTTP URL.
    #[error("--extender {url:?}: expected http://HOST:PORT of the extender's admin server")]
    ExtenderUrl {
        /// What was given.
        url: String,
    },
    /// No usable kubeconfig.
    #[error("connecting to the apiserver with your kubeconfig: {0}")]
    Client(#[source] kube::Error),
    /// The pod does not exist.
    #[error("pod {namespace}/{name} not found")]
    PodNotFound {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// A read failed (often: the user may not read that; docs/explain.md lists what it needs).
    #[error("reading {what}: {source}")]
    Read {
        /// What was being read.
        what: String,
        /// Why it failed.
        source: kube::Error,
    },
    /// The JSON output could not be written.
    #[error("encoding the explanation as JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Runs `explain` with the user's kubeconfig and returns what to print.
pub async fn run(config: &ExplainConfig) -> Result<String, ExplainError> {
    let client = kube::Client::try_default()
        .await
        .map_err(ExplainError::Client)?;
    let namespace = config
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_string());
    let facts = gather::gather(&client, config, &namespace, &config.pod).await?;
    let explanation = explain(&facts);
    match config.output {
        Output::Text => Ok(render::render(&explanation)),
        Output::Json => Ok(serde_json::to_string_pretty(&explanation)? + "\n"),
    }
}
