//! Certificate rotation through `--tls-cert-file`/`--tls-key-file` laid out like a Secret
//! volume: swapping the `..data` symlink under load fails no request and new connections see
//! the new certificate; a half-written pair keeps the old one serving.

#[allow(dead_code)]
mod tls_common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tls_common::{Ca, SecretDir, https_get, ok_router, start_https, until};
use tokio_util::sync::CancellationToken;
use webhooks::https::ServeOptions;
use webhooks::tls::{CertFiles, CertResolver};

const POLL: Duration = Duration::from_millis(50);
const WAIT: Duration = Duration::from_secs(10);

fn files(secret: &SecretDir) -> CertFiles {
    CertFiles {
        cert: secret.cert_path(),
        key: secret.key_path(),
    }
}

fn start_watch(resolver: &Arc<CertResolver>, secret: &SecretDir) -> CancellationToken {
    let stop = CancellationToken::new();
    tokio::spawn(Arc::clone(resolver).watch_files(files(secret), POLL, stop.clone()));
    stop
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rotation_under_load_loses_no_request() {
    let ca = Ca::new();
    let (a, b) = (ca.leaf(0xa), ca.leaf(0xb));
    let mut secret = SecretDir::new(&a.cert_pem, &a.key_pem);
    let resolver = Arc::new(CertResolver::new());
    let info = resolver.load_files(&files(&secret)).expect("initial load");
    assert_eq!(info.serial, a.serial);
    let stop_watch = start_watch(&resolver, &secret);
    let server = start_https(ok_router(), Arc::clone(&resolver), ServeOptions::default()).await;

    let client = ca.client_config();
    let done = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop_load = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..8 {
        let (client, done, failures, stop) = (
            Arc::clone(&client),
            Arc::clone(&done),
            Arc::clone(&failures),
            Arc::clone(&stop_load),
        );
        let addr = server.addr;
        // Each worker returns the serials it saw, in order.
        workers.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match https_get(addr, Arc::clone(&client), "/").await {
                    Ok(reply)
                        if reply.response.starts_with("HTTP/1.1 200")
                            && reply.response.ends_with("ok") =>
                    {
                        seen.push(reply.serial);
                    }
                    Ok(reply) => failures
                        .lock()
                        .expect("lock")
                        .push(format!("bad response {reply:?}")),
                    Err(e) => failures.lock().expect("lock").push(e),
                }
                done.fetch_add(1, Ordering::Relaxed);
            }
            seen
        }));
    }

    let count = || done.load(Ordering::Relaxed);
    until(WAIT, "200 requests with certificate A", || async {
        count() >= 200
    })
    .await;
    secret.swap(&b.cert_pem, &b.key_pem);
    let probe = ca.client_config();
    until(WAIT, "a new connection to see certificate B", || {
        let probe = Arc::clone(&probe);
        let want = b.serial.clone();
        async move {
            https_get(server.addr, probe, "/")
                .await
                .is_ok_and(|r| r.serial == want)
        }
    })
    .await;
    assert_eq!(resolver.current().map(|i| i.serial), Some(b.serial.clone()));
    let after_swap = count();
    until(WAIT, "200 more requests after the swap", || async {
        count() >= after_swap + 200
    })
    .await;
    stop_load.store(true, Ordering::Relaxed);

    let mut all = BTreeSet::new();
    for worker in workers {
        let seen = worker.await.expect("worker");
        // The resolver is read once per handshake, so once a worker's connection got B no
        // later connection of the same worker may get A.
        let first_b = seen
            .iter()
            .position(|s| *s == b.serial)
            .unwrap_or(seen.len());
        assert!(
            seen[first_b..].iter().all(|s| *s == b.serial),
            "a worker saw A after B: {seen:?}"
        );
        all.extend(seen);
    }
    let failures = failures.lock().expect("lock").clone();
    assert!(
        failures.is_empty(),
        "{} failed requests: {failures:?}",
        failures.len()
    );
    assert_eq!(all, BTreeSet::from([a.serial.clone(), b.serial.clone()]));
    assert_eq!(resolver.reloads(), 1);
    assert_eq!(resolver.reload_failures(), 0);

    stop_watch.cancel();
    server.shutdown.cancel();
    server.task.await.expect("server");
}

#[tokio::test]
async fn half_written_pair_keeps_the_old_certificate() {
    let ca = Ca::new();
    let (a, b) = (ca.leaf(0xa), ca.leaf(0xb));
    let mut secret = SecretDir::new(&a.cert_pem, &a.key_pem);
    let resolver = Arc::new(CertResolver::new());
    resolver.load_files(&files(&secret)).expect("initial load");
    let stop_watch = start_watch(&resolver, &secret);
    let server = start_https(ok_router(), Arc::clone(&resolver), ServeOptions::default()).await;
    let client = ca.client_config();
    let serial = || {
        let client = Arc::clone(&client);
        async move {
            https_get(server.addr, client, "/")
                .await
                .expect("request")
                .serial
        }
    };
    assert_eq!(serial().await, a.serial);

    for (name, cert, key) in [
        ("new cert, old key", &b.cert_pem, &a.key_pem),
        ("old cert, new key", &a.cert_pem, &b.key_pem),
        (
            "truncated cert",
            &b.cert_pem[..b.cert_pem.len() / 2].to_owned(),
            &b.key_pem,
        ),
        ("empty key", &b.cert_pem, &String::new()),
    ] {
        let failures = resolver.reload_failures();
        secret.swap(cert, key);
        until(WAIT, &format!("{name}: rejection"), || async {
            resolver.reload_failures() > failures
        })
        .await;
        assert_eq!(serial().await, a.serial, "{name}");
        assert_eq!(
            resolver.current().map(|i| i.serial),
            Some(a.serial.clone()),
            "{name}"
        );
    }
    assert_eq!(resolver.reloads(), 0);

    // Completing the pair is picked up without any other signal.
    secret.swap(&b.cert_pem, &b.key_pem);
    until(WAIT, "certificate B after the pair is complete", || async {
        serial().await == b.serial
    })
    .await;
    assert_eq!(resolver.reloads(), 1);

    stop_watch.cancel();
    server.shutdown.cancel();
    server.task.await.expect("server");
}

#[tokio::test]
async fn missing_files_keep_the_old_certificate() {
    let ca = Ca::new();
    let a = ca.leaf(0xa);
    let secret = SecretDir::new(&a.cert_pem, &a.key_pem);
    let resolver = Arc::new(CertResolver::new());
    resolver.load_files(&files(&secret)).expect("initial load");
    let stop_watch = start_watch(&resolver, &secret);
    std::fs::remove_file(secret.dir.path().join("..data")).expect("remove ..data");
    until(WAIT, "read error to be noticed", || async {
        resolver.reload_failures() > 0
    })
    .await;
    assert_eq!(resolver.current().map(|i| i.serial), Some(a.serial));
    stop_watch.cancel();
}

#[test]
fn load_files_reports_the_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = CertFiles {
        cert: dir.path().join("nope.crt"),
        key: dir.path().join("nope.key"),
    };
    let err = CertResolver::new()
        .load_files(&missing)
        .expect_err("missing files");
    let message = err.to_string();
    assert!(
        message.contains("certificate file") && message.contains("nope.crt"),
        "{message}"
    );
}
