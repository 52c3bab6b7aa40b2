//! `--self-signed` end to end with real verifiers: a serving certificate issued by
//! `self_signed` is accepted by rustls (webpki) under its Service names and 127.0.0.1, and by
//! `openssl verify -purpose sslserver`; after a CA rotation the bundle trusts old and new
//! leaves while the old CA alone rejects the new one.

#[allow(dead_code)]
mod tls_common;

use std::sync::Arc;

use rustls::ClientConfig;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls_pki_types::pem::PemObject;
use time::OffsetDateTime;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use webhooks::https::ServeOptions;
use webhooks::self_signed::{
    CA_VALIDITY, LEAF_VALIDITY, SubjectNames, ca_bundle, issue_ca, issue_leaf,
};
use webhooks::tls::CertResolver;

fn trusting(bundle: &str) -> Arc<ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for der in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
        roots.add(der.expect("bundle PEM")).expect("add root");
    }
    let mut config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
    config.resumption = rustls::client::Resumption::disabled();
    Arc::new(config)
}

async fn handshake(
    addr: std::net::SocketAddr,
    config: Arc<ClientConfig>,
    name: &str,
) -> Result<(), String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = ServerName::try_from(name.to_owned()).map_err(|e| e.to_string())?;
    let mut tls = TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let response = tls_common::exchange(&mut tls, "/").await?;
    response.ends_with("ok").then_some(()).ok_or(response)
}

fn openssl_verify(bundle: &str, leaf: &str) -> (bool, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("ca.pem"), bundle).expect("write");
    std::fs::write(dir.path().join("leaf.pem"), leaf).expect("write");
    let out = std::process::Command::new("/usr/bin/openssl")
        .env("OPENSSL_CONF", "/dev/null")
        .args(["verify", "-purpose", "sslserver", "-CAfile"])
        .arg(dir.path().join("ca.pem"))
        .arg(dir.path().join("leaf.pem"))
        .output()
        .expect("openssl verify");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test]
async fn issued_leaf_verifies_and_bundle_spans_rotation() {
    let now = OffsetDateTime::now_utc();
    let names = SubjectNames::for_services(&["wh"], "ns", &["127.0.0.1".to_owned()]);
    let old_ca = issue_ca("pmem-csi CA", now, CA_VALIDITY).expect("old CA");
    let new_ca = issue_ca("pmem-csi CA", now, CA_VALIDITY).expect("new CA");
    let old_leaf = issue_leaf(&old_ca, &names, now, LEAF_VALIDITY).expect("old leaf");
    let new_leaf = issue_leaf(&new_ca, &names, now, LEAF_VALIDITY).expect("new leaf");
    let bundle = ca_bundle(&new_ca.cert_pem, Some(&old_ca.cert_pem)).expect("bundle");

    let resolver = Arc::new(CertResolver::new());
    let server = tls_common::start_https(
        tls_common::ok_router(),
        Arc::clone(&resolver),
        ServeOptions::default(),
    )
    .await;

    for (leaf_name, leaf) in [("old leaf", &old_leaf), ("new leaf", &new_leaf)] {
        resolver
            .set(leaf.cert_pem.as_bytes(), leaf.key_pem.as_bytes())
            .expect("set");
        for (trust_name, trust, want_ok) in [
            ("bundle", &bundle, true),
            ("old CA", &old_ca.cert_pem, std::ptr::eq(leaf, &old_leaf)),
            ("new CA", &new_ca.cert_pem, std::ptr::eq(leaf, &new_leaf)),
        ] {
            for host in ["127.0.0.1", "wh.ns.svc", "wh.ns.svc.cluster.local"] {
                let got = handshake(server.addr, trusting(trust), host).await;
                assert_eq!(
                    got.is_ok(),
                    want_ok,
                    "{leaf_name} via {host} trusting {trust_name}: {got:?}"
                );
            }
            let (ok, out) = openssl_verify(trust, &leaf.cert_pem);
            assert_eq!(
                ok, want_ok,
                "openssl: {leaf_name} trusting {trust_name}: {out}"
            );
        }
        // A name outside the SANs is rejected even with the right CA.
        let got = handshake(server.addr, trusting(&bundle), "other.ns.svc").await;
        let err = got.expect_err("a name outside the SANs was accepted");
        assert!(err.contains("not valid for name"), "{leaf_name}: {err}");
    }
    server.shutdown.cancel();
    server.task.await.expect("server");
}
