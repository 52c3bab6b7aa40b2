//! Connection handling of `HttpsServer`: graceful shutdown lets a request in flight finish
//! and refuses new connections, the drain is bounded, idle and silent clients are cut off by
//! timeouts without blocking others, and the plain-HTTP variant serves the same router.

#[allow(dead_code)]
mod tls_common;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use tls_common::{Ca, Running, exchange, https_get, ok_router, start_https, start_plain, until};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::{Notify, mpsc};
use webhooks::https::ServeOptions;
use webhooks::tls::CertResolver;

const WAIT: Duration = Duration::from_secs(10);

/// A router whose `/slow` reports that it started, then waits until `release` is notified.
fn slow_router(started: mpsc::UnboundedSender<()>, release: Arc<Notify>) -> Router {
    ok_router().route(
        "/slow",
        get(move || {
            let (started, release) = (started.clone(), Arc::clone(&release));
            async move {
                let _ = started.send(());
                release.notified().await;
                "slow done"
            }
        }),
    )
}

fn resolver_for(ca: &Ca) -> Arc<CertResolver> {
    let leaf = ca.leaf(1);
    let resolver = Arc::new(CertResolver::new());
    resolver
        .set(leaf.cert_pem.as_bytes(), leaf.key_pem.as_bytes())
        .expect("set");
    resolver
}

async fn refuses_connections(server: &Running) -> bool {
    TcpStream::connect(server.addr).await.is_err()
}

#[tokio::test]
async fn in_flight_request_finishes_after_cancel() {
    let ca = Ca::new();
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let release = Arc::new(Notify::new());
    let server = start_https(
        slow_router(started_tx, Arc::clone(&release)),
        resolver_for(&ca),
        ServeOptions::default(),
    )
    .await;
    let request = tokio::spawn(https_get(server.addr, ca.client_config(), "/slow"));
    tokio::time::timeout(WAIT, started.recv())
        .await
        .expect("handler started")
        .expect("channel");

    server.shutdown.cancel();
    until(WAIT, "the listener to close", || {
        refuses_connections(&server)
    })
    .await;
    assert!(
        !server.task.is_finished(),
        "server returned with a request in flight"
    );

    release.notify_one();
    let reply = tokio::time::timeout(WAIT, request)
        .await
        .expect("request finished")
        .expect("task")
        .expect("request succeeded");
    assert!(
        reply.response.starts_with("HTTP/1.1 200"),
        "{}",
        reply.response
    );
    assert!(reply.response.ends_with("slow done"), "{}", reply.response);
    tokio::time::timeout(WAIT, server.task)
        .await
        .expect("server returned after draining")
        .expect("server task");
}

#[tokio::test]
async fn drain_is_bounded() {
    let ca = Ca::new();
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let server = start_https(
        slow_router(started_tx, Arc::new(Notify::new())),
        resolver_for(&ca),
        ServeOptions {
            drain_timeout: Duration::from_millis(200),
            ..ServeOptions::default()
        },
    )
    .await;
    let request = tokio::spawn(https_get(server.addr, ca.client_config(), "/slow"));
    tokio::time::timeout(WAIT, started.recv())
        .await
        .expect("handler started")
        .expect("channel");
    server.shutdown.cancel();
    // The handler never finishes; the server must give up on it after the drain timeout.
    tokio::time::timeout(WAIT, server.task)
        .await
        .expect("server returned despite a stuck request")
        .expect("server task");
    let result = tokio::time::timeout(WAIT, request)
        .await
        .expect("client saw the connection close")
        .expect("task");
    assert!(result.is_err(), "stuck request got a response: {result:?}");
}

#[tokio::test]
async fn idle_keep_alive_connection_does_not_delay_shutdown() {
    let server = start_plain(ok_router(), ServeOptions::default()).await;
    let mut idle = TcpStream::connect(server.addr).await.expect("connect");
    // One keep-alive request, then leave the connection idle.
    use tokio::io::AsyncWriteExt;
    idle.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut buf = [0u8; 256];
    let n = idle.read(&mut buf).await.expect("read");
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );

    server.shutdown.cancel();
    // Well within the 10 s drain timeout: hyper closes idle connections at once.
    tokio::time::timeout(Duration::from_secs(5), server.task)
        .await
        .expect("server returned with an idle connection open")
        .expect("server task");
    let n = tokio::time::timeout(WAIT, idle.read(&mut buf))
        .await
        .expect("idle connection closed")
        .expect("read");
    assert_eq!(n, 0, "expected EOF");
}

#[tokio::test]
async fn silent_client_is_dropped_after_handshake_timeout() {
    let ca = Ca::new();
    let server = start_https(
        ok_router(),
        resolver_for(&ca),
        ServeOptions {
            handshake_timeout: Duration::from_millis(300),
            ..ServeOptions::default()
        },
    )
    .await;
    let mut silent = TcpStream::connect(server.addr).await.expect("connect");
    // Others are served while the silent client holds its connection.
    let reply = https_get(server.addr, ca.client_config(), "/")
        .await
        .expect("request beside a silent client");
    assert!(reply.response.ends_with("ok"));
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(WAIT, silent.read(&mut buf))
        .await
        .expect("server closed the silent connection")
        .unwrap_or(0);
    assert_eq!(n, 0, "expected EOF, got {:?}", &buf[..n]);
    server.shutdown.cancel();
    server.task.await.expect("server task");
}

#[tokio::test]
async fn request_timeout_answers_503() {
    let (started_tx, _started) = mpsc::unbounded_channel();
    let server = start_plain(
        slow_router(started_tx, Arc::new(Notify::new())),
        ServeOptions {
            request_timeout: Some(Duration::from_millis(200)),
            ..ServeOptions::default()
        },
    )
    .await;
    let mut conn = TcpStream::connect(server.addr).await.expect("connect");
    let response = tokio::time::timeout(WAIT, exchange(&mut conn, "/slow"))
        .await
        .expect("response")
        .expect("exchange");
    assert!(response.starts_with("HTTP/1.1 503"), "{response}");
    let mut conn = TcpStream::connect(server.addr).await.expect("connect");
    let response = exchange(&mut conn, "/").await.expect("exchange");
    assert!(
        response.starts_with("HTTP/1.1 200") && response.ends_with("ok"),
        "{response}"
    );
    server.shutdown.cancel();
    server.task.await.expect("server task");
}

#[tokio::test]
async fn plain_http_rejects_nothing_tls_specific() {
    let server = start_plain(ok_router(), ServeOptions::default()).await;
    let mut conn = TcpStream::connect(server.addr).await.expect("connect");
    let response = exchange(&mut conn, "/").await.expect("exchange");
    assert!(
        response.starts_with("HTTP/1.1 200") && response.ends_with("ok"),
        "{response}"
    );
    let mut conn = TcpStream::connect(server.addr).await.expect("connect");
    let response = exchange(&mut conn, "/missing").await.expect("exchange");
    assert!(response.starts_with("HTTP/1.1 404"), "{response}");
    server.shutdown.cancel();
    server.task.await.expect("server task");
}
