//! The HTTP server under the webhook (HTTPS), the scheduler extender (plain HTTP on
//! 127.0.0.1) and every process's admin port (plain HTTP): an accept loop around hyper's HTTP/1 connection driver with handshake, header
//! and request deadlines, caps on connections (in all and per peer address) and on requests in
//! flight, and a graceful shutdown that lets in-flight requests finish.
//!
//! The webhook is reachable by every pod of the cluster, and its process also hosts the
//! controller's leader concerns: a client that opens thousands of idle connections, dribbles
//! a 3 MiB body or floods reviews must neither exhaust memory or descriptors nor keep the
//! apiserver from getting answers. Over a cap the server answers at once (a closed connection,
//! or 503 without reading the body) instead of queueing.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::Service;

use crate::tls::{CLIENT_HELLO_PREFIX_LEN, legacy_client_version, protocol_version_alert};

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum HttpsError {
    /// The listening socket could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The socket error.
        source: io::Error,
    },
    /// The bound socket has no local address (should not happen for TCP).
    #[error("reading the local address of the listener bound to {addr}: {source}")]
    LocalAddr {
        /// The address asked for.
        addr: SocketAddr,
        /// The socket error.
        source: io::Error,
    },
}

/// Deadlines and caps of a server; [`Default`] holds the production values of the extender,
/// [`ServeOptions::webhook`] those of the pod webhook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeOptions {
    /// Longest a client may take to complete the TLS handshake.
    pub handshake_timeout: Duration,
    /// Longest a client may take to send a request's headers, also bounding how long an idle
    /// keep-alive connection stays open.
    pub header_read_timeout: Duration,
    /// After shutdown is requested, longest to wait for in-flight requests before dropping
    /// their connections.
    pub drain_timeout: Duration,
    /// If set, a request whose body and handling take longer is abandoned and the client gets
    /// 503 (with `header_read_timeout`, the deadline of a whole request).
    pub request_timeout: Option<Duration>,
    /// Pause after an accept error that is not about one connection (e.g. EMFILE), so a
    /// full file table does not turn the loop into a busy spin.
    pub accept_backoff: Duration,
    /// Open connections at most; a connection over it is closed as soon as it is accepted.
    pub max_connections: usize,
    /// Open connections at most from one peer address, so that one client (a pod) cannot take
    /// every connection the apiserver needs.
    pub max_connections_per_peer: usize,
    /// Requests in flight at most; a request over it is answered 503 at once, its body unread.
    pub max_requests_in_flight: usize,
    /// Body bytes the requests in flight may hold together, each counted by the length its
    /// framing states (in [`BODY_BUDGET_UNIT`]s; a request without a body takes one unit);
    /// a request over it is answered 503 at once,
    /// its body unread. Memory is bounded by bytes, not by a request count that would have to
    /// assume every body is as large as the biggest allowed (and so shed bursts of small ones).
    pub max_body_bytes_in_flight: usize,
    /// The largest body any route accepts: what a request without `Content-Length` (chunked)
    /// is counted as, and where a larger stated length is capped (the route refuses it anyway).
    pub max_body_bytes: usize,
}

/// The granularity of the body budget: a small review counts as one unit.
pub const BODY_BUDGET_UNIT: usize = 64 << 10;

/// Budget units a request with `content_length` takes (`None`: not stated).
fn body_units(content_length: Option<u64>, max_body_bytes: usize) -> u32 {
    let bytes = content_length
        .map_or(max_body_bytes, |n| usize::try_from(n).unwrap_or(usize::MAX))
        .min(max_body_bytes);
    u32::try_from(bytes.div_ceil(BODY_BUDGET_UNIT).max(1)).unwrap_or(u32::MAX)
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(10),
            request_timeout: None,
            accept_backoff: Duration::from_millis(100),
            max_connections: 1024,
            max_connections_per_peer: 256,
            max_requests_in_flight: 64,
            max_body_bytes_in_flight: 256 << 20,
            max_body_bytes: 64 << 20,
        }
    }
}

impl ServeOptions {
    /// The pod webhook's: the TLS handshake within 1 s, headers within 1.5 s (also how long
    /// an idle keep-alive connection stays; Go's client retries a request on a connection the
    /// server closed while idle) and body plus answer within 2 s: together below the 5 s
    /// `timeoutSeconds` of the shipped webhook configuration, so that a slow client is cut off
    /// before the apiserver would give up.
    ///
    /// The caps must not shed the apiserver's own bursts: it opens one connection per
    /// concurrent admission (up to its `--max-mutating-requests-inflight`, 200 by default) from
    /// one address, and a shed review means a pod admitted unmarked (`failurePolicy: Ignore`).
    /// So 256 connections per peer and 256 reviews in flight, bounded in memory by 48 MiB of
    /// bodies: at most twelve 3 MiB reviews at once (a quarter of the budget is kept for
    /// reviews under 64 KiB, which an ordinary pod's is), and hundreds of ordinary ones.
    pub fn webhook() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(1),
            header_read_timeout: Duration::from_millis(1500),
            request_timeout: Some(Duration::from_secs(2)),
            max_connections: 1024,
            max_connections_per_peer: 256,
            max_requests_in_flight: 256,
            max_body_bytes_in_flight: 48 << 20,
            max_body_bytes: 3 << 20,
            ..Self::default()
        }
    }
}

impl ServeOptions {
    /// The admin servers' (`/healthz`, `/readyz`, `/metrics`, the extender's `/explain`) of
    /// every process: reachable by anything on the node network (the extender's and, with host
    /// networking, the node driver's on the host's address), whose only legitimate clients are
    /// kubelet's probes, a Prometheus or two and an operator's `explain`. A few thousand slow
    /// clients must not take the file descriptors the CSI socket and state files need, nor
    /// stall the extender's scheduling: headers within 5 s, a whole request within 30 s (an
    /// `/explain` reads the apiserver), 128 connections, 32 per peer, bodies of 64 KiB.
    pub fn admin() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(5),
            request_timeout: Some(Duration::from_secs(30)),
            max_connections: 128,
            max_connections_per_peer: 32,
            max_requests_in_flight: 64,
            max_body_bytes_in_flight: 4 << 20,
            max_body_bytes: 64 << 10,
            ..Self::default()
        }
    }
}

/// Serves `admin`'s routes over plain HTTP with `options` (production: [`ServeOptions::admin`])
/// until `shutdown`: the one way every pmem-csi process serves its admin port.
pub async fn serve_admin(
    admin: controllers::AdminServer,
    options: ServeOptions,
    shutdown: CancellationToken,
) -> Result<(), HttpsError> {
    let (listener, router) = admin.into_parts();
    let address = listener.local_addr().ok();
    tracing::info!(?address, "admin server listening");
    HttpsServer::from_listener(listener)?
        .with_options(options)
        .serve_plain(router, shutdown)
        .await;
    Ok(())
}

/// What requests in flight may take together: a count and body bytes.
#[derive(Debug)]
struct RequestBudget {
    count: Arc<Semaphore>,
    body_units: Arc<Semaphore>,
    /// All units of `body_units`.
    body_total: usize,
}

/// The part of the body budget (one in this many) only one-unit requests may take.
pub const SMALL_BODY_SHARE: usize = 4;

impl RequestBudget {
    /// One request holding `units` of body budget, or `None` when either is exhausted. A request
    /// of more than one unit must also leave [`SMALL_BODY_SHARE`] of the budget free, so that big
    /// bodies (anyone's to send) never shed the ordinary reviews of the apiserver.
    fn admit(&self, units: u32) -> Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)> {
        if units > 1 {
            let reserve = self.body_total / SMALL_BODY_SHARE;
            let needed = usize::try_from(units).unwrap_or(usize::MAX);
            // Checked before taking: two big requests racing past it together take at most one
            // unit-sized bite each out of the reserve, which is harmless.
            if self.body_units.available_permits() < needed.saturating_add(reserve) {
                return None;
            }
        }
        let count = Arc::clone(&self.count).try_acquire_owned().ok()?;
        let body = Arc::clone(&self.body_units)
            .try_acquire_many_owned(units)
            .ok()?;
        Some((count, body))
    }
}

/// Open connections per peer address, counted while their [`PeerSlot`] lives.
#[derive(Debug, Default)]
struct PeerCounts(Mutex<HashMap<IpAddr, usize>>);

/// One counted connection of a peer; dropping it uncounts it (and forgets a peer with none, so
/// the map holds only peers with open connections).
#[derive(Debug)]
struct PeerSlot {
    counts: Arc<PeerCounts>,
    peer: IpAddr,
}

impl PeerCounts {
    fn admit(self: &Arc<Self>, peer: IpAddr, limit: usize) -> Option<PeerSlot> {
        let mut counts = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let open = counts.entry(peer).or_default();
        if *open >= limit {
            return None;
        }
        *open += 1;
        Some(PeerSlot {
            counts: Arc::clone(self),
            peer,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut counts = self.counts.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(open) = counts.get_mut(&self.peer) {
            *open = open.saturating_sub(1);
            if *open == 0 {
                counts.remove(&self.peer);
            }
        }
    }
}

/// What a connection holds while open: its place under both caps.
#[derive(Debug)]
struct Admission {
    _total: OwnedSemaphorePermit,
    _peer: PeerSlot,
}

/// A bound listener that serves an axum [`Router`] over HTTPS or plain HTTP/1.1.
#[derive(Debug)]
pub struct HttpsServer {
    listener: TcpListener,
    local_addr: SocketAddr,
    options: ServeOptions,
}

impl HttpsServer {
    /// Binds `addr` (port 0 picks a free port; see [`HttpsServer::local_addr`]).
    pub async fn bind(addr: SocketAddr) -> Result<Self, HttpsError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| HttpsError::Bind { addr, source })?;
        Self::on(listener, addr)
    }

    /// Serves on a listener bound elsewhere.
    pub fn from_listener(listener: TcpListener) -> Result<Self, HttpsError> {
        Self::on(listener, SocketAddr::from(([0, 0, 0, 0], 0)))
    }

    /// Serves on `listener`, bound when asked for `addr` (for errors).
    fn on(listener: TcpListener, addr: SocketAddr) -> Result<Self, HttpsError> {
        let local_addr = listener
            .local_addr()
            .map_err(|source| HttpsError::LocalAddr { addr, source })?;
        Ok(Self {
            listener,
            local_addr,
            options: ServeOptions::default(),
        })
    }

    /// Replaces the timeouts.
    pub fn with_options(mut self, options: ServeOptions) -> Self {
        self.options = options;
        self
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves `router` over TLS until `shutdown`, then drains. The certificate is resolved per
    /// handshake from `tls`, so a reloaded certificate applies to new connections only.
    pub async fn serve(self, router: Router, tls: Arc<ServerConfig>, shutdown: CancellationToken) {
        self.accept_loop(router, Some(TlsAcceptor::from(tls)), shutdown)
            .await;
    }

    /// Serves `router` over plain HTTP until `shutdown`, then drains (the scheduler extender,
    /// which kube-scheduler reaches on 127.0.0.1).
    pub async fn serve_plain(self, router: Router, shutdown: CancellationToken) {
        self.accept_loop(router, None, shutdown).await;
    }

    async fn accept_loop(
        self,
        router: Router,
        tls: Option<TlsAcceptor>,
        shutdown: CancellationToken,
    ) {
        let Self {
            listener,
            local_addr,
            options,
        } = self;
        let options = Arc::new(options);
        let connection_slots = Arc::new(Semaphore::new(options.max_connections));
        let peers = Arc::new(PeerCounts::default());
        let body_total = options
            .max_body_bytes_in_flight
            .div_ceil(BODY_BUDGET_UNIT)
            .min(Semaphore::MAX_PERMITS);
        let requests = Arc::new(RequestBudget {
            count: Arc::new(Semaphore::new(options.max_requests_in_flight)),
            body_units: Arc::new(Semaphore::new(body_total)),
            body_total,
        });
        let mut connections = JoinSet::new();
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                Some(joined) = connections.join_next(), if !connections.is_empty() => {
                    if let Err(e) = joined {
                        tracing::error!(error = %e, "connection task failed");
                    }
                }
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let admission = Arc::clone(&connection_slots)
                            .try_acquire_owned()
                            .ok()
                            .and_then(|total| {
                                let peer_slot =
                                    peers.admit(peer.ip(), options.max_connections_per_peer)?;
                                Some(Admission { _total: total, _peer: peer_slot })
                            });
                        let Some(admission) = admission else {
                            // Closed at once: the client learns now, not after a timeout, and
                            // holds nothing of ours.
                            tracing::debug!(%peer, "connection over the cap; closed");
                            drop(stream);
                            continue;
                        };
                        connections.spawn(handle_connection(
                            stream,
                            peer,
                            tls.clone(),
                            router.clone(),
                            Arc::clone(&options),
                            Arc::clone(&requests),
                            shutdown.clone(),
                            admission,
                        ));
                    }
                    // The peer gave up between SYN and accept; nothing wrong with us.
                    Err(e) if is_per_connection(&e) => {
                        tracing::debug!(error = %e, "accept failed for one connection");
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, %local_addr, "accept failed; backing off");
                        tokio::select! {
                            () = shutdown.cancelled() => break,
                            () = tokio::time::sleep(options.accept_backoff) => {}
                        }
                    }
                },
            }
        }
        // Close the socket first so new connections are refused rather than queued behind
        // a server that no longer accepts.
        drop(listener);
        let in_flight = connections.len();
        let drained = tokio::time::timeout(options.drain_timeout, async {
            while connections.join_next().await.is_some() {}
        })
        .await;
        match drained {
            Ok(()) => tracing::debug!(%local_addr, in_flight, "server drained"),
            Err(_) => {
                tracing::warn!(
                    %local_addr,
                    remaining = connections.len(),
                    "connections still open after the drain timeout; dropping them"
                );
                connections.shutdown().await;
            }
        }
    }
}

/// Accept errors that concern one connection only (see `man 2 accept`: the listener stays fine).
fn is_per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::Interrupted
    )
}

#[allow(clippy::too_many_arguments)] // one connection's whole context, passed once
async fn handle_connection(
    stream: TcpStream,
    peer: SocketAddr,
    tls: Option<TlsAcceptor>,
    router: Router,
    options: Arc<ServeOptions>,
    requests: Arc<RequestBudget>,
    shutdown: CancellationToken,
    _admission: Admission,
) {
    // Responses are small and latency matters to the scheduler, which waits on each.
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
    }
    let Some(acceptor) = tls else {
        serve_connection(stream, peer, router, &options, requests, &shutdown).await;
        return;
    };
    let handshake = async {
        let stream = reject_legacy_versions(stream).await?;
        acceptor.accept(stream).await
    };
    let handshake = tokio::select! {
        () = shutdown.cancelled() => return,
        handshake = tokio::time::timeout(options.handshake_timeout, handshake) => handshake,
    };
    match handshake {
        Ok(Ok(stream)) => {
            serve_connection(stream, peer, router, &options, requests, &shutdown).await;
        }
        // Scanners, health checks that only open TCP, and clients that reject our certificate
        // all end here; none of them is our problem, so keep them out of the default log level.
        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
        Err(_) => {
            tracing::debug!(%peer, timeout = ?options.handshake_timeout, "TLS handshake timed out")
        }
    }
}

/// Reads the start of the ClientHello and answers clients limited to TLS 1.1 or older with a
/// `protocol_version` alert, which rustls would answer with `handshake_failure` (see
/// [`legacy_client_version`]); otherwise hands back the stream with the bytes put back.
async fn reject_legacy_versions(mut stream: TcpStream) -> io::Result<Replay<TcpStream>> {
    // Every TLS client sends far more than this in its first flight, so this cannot wait for
    // bytes that never come; anything else is bounded by the handshake timeout around it.
    let mut prefix = vec![0; CLIENT_HELLO_PREFIX_LEN];
    stream.read_exact(&mut prefix).await?;
    if let Some(version) = legacy_client_version(&prefix) {
        stream.write_all(&protocol_version_alert(version)).await?;
        stream.shutdown().await?;
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("client offers at most TLS version {version:#06x}; TLS 1.2 is required"),
        ));
    }
    Ok(Replay {
        prefix,
        pos: 0,
        inner: stream,
    })
}

/// A stream that first yields bytes already read from it.
#[derive(Debug)]
struct Replay<S> {
    prefix: Vec<u8>,
    pos: usize,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Replay<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(rest) = this.prefix.get(this.pos..).filter(|r| !r.is_empty()) {
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.pos += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Replay<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

async fn serve_connection<I>(
    io: I,
    peer: SocketAddr,
    router: Router,
    options: &ServeOptions,
    requests: Arc<RequestBudget>,
    shutdown: &CancellationToken,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let request_timeout = options.request_timeout;
    let max_body_bytes = options.max_body_bytes;
    let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
        let mut router = router.clone();
        request.extensions_mut().insert(ConnectInfo(peer));
        // Taken before the body is read, so that shedding costs no memory. hyper's size hint is
        // exact for a stated Content-Length and 0 for a request with no body at all (no
        // Content-Length, no Transfer-Encoding: RFC 9112 §6.3); reading the header alone
        // charged such a request (a probe's GET) as the largest body, so that four of them at
        // once were shed.
        let declared = hyper::body::Body::size_hint(request.body()).exact();
        let slot = requests.admit(body_units(declared, max_body_bytes));
        async move {
            let Some(_slot) = slot else {
                tracing::debug!(%peer, "too many requests in flight; answered 503");
                return Ok(overloaded());
            };
            // Router is always ready, so calling without poll_ready is fine (axum does the same).
            let response = router.call(request);
            let response = match request_timeout {
                None => response.await,
                Some(limit) => match tokio::time::timeout(limit, response).await {
                    Ok(response) => response,
                    Err(_) => {
                        tracing::warn!(%peer, ?limit, "request timed out");
                        Ok(timed_out())
                    }
                },
            };
            Ok::<_, Infallible>(response.unwrap_or_else(|never| match never {}))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout)
        .keep_alive(true);
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = shutdown.cancelled() => {
            // Finishes the request in flight (if any), then closes instead of keeping alive.
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

fn overloaded() -> Response<Body> {
    let mut response = Response::new(Body::from("too many requests in flight; try again\n"));
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    // The body was not read: the connection cannot carry another request.
    response.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    response
}

fn timed_out() -> Response<Body> {
    let mut response = Response::new(Body::from("request timed out\n"));
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn webhook_deadlines_end_before_the_apiservers() {
        // manifests/components/scheduler-extender/webhook-configuration.yaml: timeoutSeconds.
        let webhook_timeout = Duration::from_secs(5);
        let o = ServeOptions::webhook();
        let whole = o.handshake_timeout
            + o.header_read_timeout
            + o.request_timeout.unwrap_or(Duration::MAX / 2);
        assert!(whole < webhook_timeout, "{whole:?}");
        assert!(o.max_connections_per_peer < o.max_connections);
        // Twelve reviews of the largest size fit the body budget at once, beside the share
        // kept for ordinary ones.
        let big = o.max_body_bytes_in_flight * (SMALL_BODY_SHARE - 1) / SMALL_BODY_SHARE;
        assert_eq!(big / o.max_body_bytes, 12);
    }

    #[test]
    fn body_units_table() {
        const MAX: usize = 3 << 20;
        let unit = BODY_BUDGET_UNIT as u64;
        let cases: [(Option<u64>, u32); 7] = [
            (Some(0), 1),
            (Some(1), 1),
            (Some(unit), 1),
            (Some(unit + 1), 2),
            // Stated above what any route accepts: counted as the largest.
            (Some(u64::MAX), 48),
            // Chunked: could be as large as the largest.
            (None, 48),
            (Some(3 << 20), 48),
        ];
        for (length, units) in cases {
            assert_eq!(body_units(length, MAX), units, "{length:?}");
        }
    }

    #[test]
    fn peer_slots_cap_and_forget() {
        let counts = Arc::new(PeerCounts::default());
        let a: IpAddr = [10, 0, 0, 1].into();
        let b: IpAddr = [10, 0, 0, 2].into();
        let first = counts.admit(a, 2).expect("first");
        let second = counts.admit(a, 2).expect("second");
        assert!(counts.admit(a, 2).is_none(), "a third from the same peer");
        let other = counts.admit(b, 2).expect("another peer is not affected");
        drop(first);
        let again = counts.admit(a, 2).expect("a slot freed");
        drop((second, again, other));
        assert!(
            counts.0.lock().expect("lock").is_empty(),
            "peers without connections are forgotten"
        );
    }

    #[tokio::test]
    async fn replay_yields_prefix_then_inner() {
        let (mut client, server) = tokio::io::duplex(64);
        client.write_all(b"world").await.expect("write");
        drop(client);
        let mut replay = Replay {
            prefix: b"hello ".to_vec(),
            pos: 0,
            inner: server,
        };
        let mut small = [0u8; 4];
        replay.read_exact(&mut small).await.expect("read");
        assert_eq!(&small, b"hell");
        let mut rest = Vec::new();
        replay.read_to_end(&mut rest).await.expect("read");
        assert_eq!(rest, b"o world");
    }
}
