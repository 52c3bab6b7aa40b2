//! The webhook's lookups of objects missing from its caches, against an apiserver that accepts
//! connections and never answers: a review of a pod with 20 uncached claims and two generic
//! ephemeral volumes is still answered well within the webhook timeout (all GETs share one
//! deadline), at most `PARALLEL_LOOKUPS` GETs are in flight, and none is spent on the
//! ephemeral volumes' claims (which cannot exist at admission).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use controllers::stores::Stores;
use http::Request;
use kube::runtime::reflector;
use serde_json::json;
use tokio::net::TcpListener;
use tower::ServiceExt;
use webhooks::mutation::WebhookPolicy;
use webhooks::webhook::{PARALLEL_LOOKUPS, ROUTE, WebhookMetrics, router};

/// The shipped webhook configuration's `timeoutSeconds`.
const WEBHOOK_TIMEOUT: Duration = Duration::from_secs(5);

fn review(claims: usize) -> serde_json::Value {
    let mut volumes: Vec<serde_json::Value> = (0..claims)
        .map(|i| json!({"name": format!("v{i}"), "persistentVolumeClaim": {"claimName": format!("c{i}")}}))
        .collect();
    for name in ["scratch-a", "scratch-b"] {
        volumes.push(
            json!({"name": name, "ephemeral": {"volumeClaimTemplate": {"spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "pmem-csi-sc-ext4",
                "resources": {"requests": {"storage": "64Mi"}}
            }}}}),
        );
    }
    json!({
        "kind": "AdmissionReview",
        "apiVersion": "admission.k8s.io/v1",
        "request": {
            "uid": "7b0e3c5e-0000-4000-8000-000000000001",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "app",
            "namespace": "ns",
            "operation": "CREATE",
            "userInfo": {"username": "test"},
            "object": {
                "kind": "Pod",
                "apiVersion": "v1",
                "metadata": {"name": "app", "namespace": "ns"},
                "spec": {
                    "schedulerName": "default-scheduler",
                    "containers": [{"name": "app", "image": "busybox"}],
                    "volumes": volumes
                }
            }
        }
    })
}

#[tokio::test]
async fn lookups_against_a_silent_apiserver_end_at_one_deadline() {
    // Accepts and holds every connection; never sends a byte (the TLS handshake never ends).
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&connections);
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            held.push(stream);
        }
    });
    let mut config = kube::Config::new(format!("https://{addr}").parse().expect("url"));
    config.accept_invalid_certs = true;
    let client = kube::Client::try_from(config).expect("client");

    // Empty caches: every claim and class misses.
    let stores = Stores {
        claims: reflector::store().0,
        classes: reflector::store().0,
        nodes: reflector::store().0,
        csinodes: reflector::store().0,
        leases: reflector::store().0,
    };
    let mut registry = prometheus_client::registry::Registry::default();
    let app = router(
        client,
        stores,
        WebhookPolicy {
            driver: "pmem-csi.intel.com".into(),
            scheduler_names: vec!["default-scheduler".into()],
        },
        WebhookMetrics::register(&mut registry),
    );
    let request = Request::post(ROUTE)
        .header("content-type", "application/json")
        .body(Body::from(review(20).to_string()))
        .expect("request");
    let started = Instant::now();
    let response = tokio::time::timeout(WEBHOOK_TIMEOUT, app.oneshot(request))
        .await
        .expect("answered within the webhook timeout")
        .expect("infallible");
    let took = started.elapsed();
    assert_eq!(response.status(), 200);
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .expect("body");
    let answer: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    assert!(
        answer["response"].get("patch").is_none(),
        "nothing found, nothing to mark: {answer}"
    );

    let opened = connections.load(Ordering::SeqCst);
    assert!(
        (1..=PARALLEL_LOOKUPS).contains(&opened),
        "{opened} connections for 20 hanging GETs, at most {PARALLEL_LOOKUPS} at once"
    );
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("metrics");
    let lookups = |source: &str| {
        text.lines()
            .find(|l| {
                l.starts_with("pmem_csi_webhook_lookups_total")
                    && l.contains("kind=\"claim\"")
                    && l.contains(&format!("source=\"{source}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert_eq!(
        lookups("missing"),
        2.0,
        "the ephemeral claims, from the cache alone:\n{text}"
    );
    assert_eq!(lookups("api"), 0.0, "{text}");
    eprintln!("answered in {took:?} with {opened} connections to the silent apiserver");
}
