//! Kubeconfig files, one per identity (admin, each control-plane component, each of our
//! processes), referring to certificate files on disk.

use std::path::{Path, PathBuf};

use crate::pki::CertifiedKey;

/// What can go wrong writing a kubeconfig.
#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    /// A file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Serialization failed (a bug).
    #[error("serializing kubeconfig: {0}")]
    Yaml(#[from] serde_yaml::Error),
}

/// How a kubeconfig authenticates.
#[derive(Debug)]
pub enum Credentials<'a> {
    /// A client certificate; the PEM files are written beside the kubeconfig.
    Certificate(&'a CertifiedKey),
    /// A bearer token (service accounts).
    Token(&'a str),
    /// A file holding a bearer token, re-read by clients as it is renewed.
    TokenFile(&'a Path),
}

/// Writes `<dir>/<name>.kubeconfig` for `server`, trusting `ca_file`, and returns its path.
pub fn write(
    dir: &Path,
    name: &str,
    server: &str,
    ca_file: &Path,
    credentials: Credentials<'_>,
) -> Result<PathBuf, KubeconfigError> {
    let write_file = |path: PathBuf, contents: &str| {
        std::fs::write(&path, contents)
            .map(|()| path.clone())
            .map_err(|source| KubeconfigError::Write { path, source })
    };
    let user = match credentials {
        Credentials::Certificate(pair) => {
            let cert = write_file(dir.join(format!("{name}.crt")), &pair.cert_pem)?;
            let key = write_file(dir.join(format!("{name}.key")), &pair.key_pem)?;
            serde_json::json!({
                "client-certificate": cert,
                "client-key": key,
            })
        }
        Credentials::Token(token) => serde_json::json!({ "token": token }),
        Credentials::TokenFile(file) => serde_json::json!({ "tokenFile": file }),
    };
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "testenv", "cluster": {
            "server": server,
            "certificate-authority": ca_file,
        }}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": "testenv", "context": {"cluster": "testenv", "user": name}}],
        "current-context": "testenv",
    });
    let text = serde_yaml::to_string(&config)?;
    write_file(dir.join(format!("{name}.kubeconfig")), &text)
}
