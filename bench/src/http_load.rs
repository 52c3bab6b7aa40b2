//! An HTTP/1.1 load generator for our own servers: a pool of persistent keep-alive connections
//! (TLS trusting a given CA with server name 127.0.0.1, or plain TCP), each driven by its own
//! task, sending one fixed POST either open-loop at a fixed rate or back-to-back at the maximum
//! rate.
//!
//! Open loop: request `i` is due at `t0 + i/rate` whether or not earlier answers came back, and
//! its latency runs from that due time to the end of the response body. A slow answer therefore
//! shows in every request queued behind it instead of silently lowering the rate (coordinated
//! omission).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{Mutex, mpsc};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::ClientConfig;
use tokio_rustls::rustls::pki_types::ServerName;

/// How long before a request's due time the open loop's dispatcher stops sleeping and spins, at
/// most: never more than a tenth of the interval between requests, so that the spin takes at
/// most a tenth of a CPU from the server under test.
const SPIN_BEFORE_DUE: Duration = Duration::from_micros(200);

/// How connections reach the server.
#[derive(Clone)]
pub enum Transport {
    /// Plain HTTP.
    Plain,
    /// HTTPS with this client configuration (see [`testenv::http_client::trusting`]); the
    /// server must present a certificate for 127.0.0.1.
    Tls(Arc<ClientConfig>),
}

/// The one request a load run repeats: `POST path` with a JSON `body` to `addr`.
#[derive(Clone)]
pub struct Endpoint {
    /// Server address.
    pub addr: SocketAddr,
    /// Plain or TLS.
    pub transport: Transport,
    /// Request path.
    pub path: String,
    /// Request body (JSON).
    pub body: Bytes,
}

/// What one load run measured.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Per request, milliseconds from its due time (open loop) or its send (max rate) to the end
    /// of the response body; failed requests included.
    pub latencies_ms: Vec<f64>,
    /// Per request, milliseconds from handing it to a connection to the end of the response
    /// body: the server's share, without the time it waited for a free connection.
    pub service_ms: Vec<f64>,
    /// Requests that got a non-2xx answer or an error.
    pub failures: u64,
    /// The first failure, for the report.
    pub first_failure: Option<String>,
    /// From the start of the run to the last answer.
    pub elapsed: Duration,
}

impl Outcome {
    /// Completed requests per second.
    pub fn rate(&self) -> f64 {
        let seconds = self.elapsed.as_secs_f64();
        if seconds > 0.0 {
            self.latencies_ms.len() as f64 / seconds
        } else {
            0.0
        }
    }

    /// An error naming the failures, if there were any.
    pub fn ensure_no_failures(&self, what: &str) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.failures == 0,
            "{what}: {} of {} requests failed, first: {}",
            self.failures,
            self.latencies_ms.len(),
            self.first_failure.as_deref().unwrap_or("?")
        );
        Ok(())
    }

    fn merge(&mut self, other: WorkerOutcome) {
        self.latencies_ms.extend(other.latencies_ms);
        self.service_ms.extend(other.service_ms);
        self.failures += other.failures;
        if self.first_failure.is_none() {
            self.first_failure = other.first_failure;
        }
    }
}

type Sender = SendRequest<Full<Bytes>>;

/// One connection of the pool; `None` after an error until the next request reconnects.
struct Connection {
    sender: Option<Sender>,
}

/// What one connection's task measured.
#[derive(Default)]
struct WorkerOutcome {
    latencies_ms: Vec<f64>,
    service_ms: Vec<f64>,
    failures: u64,
    first_failure: Option<String>,
}

impl WorkerOutcome {
    fn record(&mut self, due: Instant, sent: Instant, result: Result<(), String>) {
        let done = Instant::now();
        self.latencies_ms
            .push(done.duration_since(due).as_secs_f64() * 1000.0);
        self.service_ms
            .push(done.duration_since(sent).as_secs_f64() * 1000.0);
        if let Err(e) = result {
            self.failures += 1;
            self.first_failure.get_or_insert(e);
        }
    }
}

/// A pool of persistent keep-alive connections to one endpoint.
pub struct Pool {
    endpoint: Arc<Endpoint>,
    connections: Vec<Connection>,
}

impl Pool {
    /// Opens `size` connections (TLS handshakes included) before any run starts, so that no
    /// measurement pays for them.
    pub async fn connect(endpoint: Endpoint, size: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(size > 0, "a pool needs at least one connection");
        let mut connections = Vec::with_capacity(size);
        for i in 0..size {
            let sender = connect(&endpoint)
                .await
                .with_context(|| format!("connection {i} to {}", endpoint.addr))?;
            connections.push(Connection {
                sender: Some(sender),
            });
        }
        Ok(Self {
            endpoint: Arc::new(endpoint),
            connections,
        })
    }

    /// Connections in the pool.
    pub fn size(&self) -> usize {
        self.connections.len()
    }

    /// Sends `rate × duration` requests open-loop: request `i` is due at `t0 + i/rate` and goes
    /// to whichever connection is free; latency counts from the due time.
    pub async fn open_loop(&mut self, rate: f64, duration: Duration) -> anyhow::Result<Outcome> {
        anyhow::ensure!(
            rate.is_finite() && rate > 0.0,
            "rate must be above zero: {rate}"
        );
        let total = (rate * duration.as_secs_f64()).round() as u64;
        let (due_tx, due_rx) = mpsc::unbounded_channel::<Instant>();
        let due_rx = Arc::new(Mutex::new(due_rx));
        // A head start so that the first due times are not already past when the dispatcher
        // thread and the connection tasks get going.
        let t0 = Instant::now() + Duration::from_millis(20);
        // The schedule runs on its own thread with the OS's sleep: tokio's timer has a 1 ms
        // granularity, which alone would add up to a millisecond to every latency.
        let spin = SPIN_BEFORE_DUE.min(Duration::from_secs_f64(0.1 / rate));
        let dispatcher = tokio::task::spawn_blocking(move || {
            for i in 0..total {
                let due = t0 + Duration::from_secs_f64(i as f64 / rate);
                // The OS's sleep wakes up to a timer slack (50 µs) and a VM's wake-up latency
                // late, which would count against the server: sleep until shortly before, then
                // spin to the due time.
                let now = Instant::now();
                if let Some(ahead) = due
                    .checked_sub(spin)
                    .and_then(|wake| wake.checked_duration_since(now))
                {
                    std::thread::sleep(ahead);
                }
                while Instant::now() < due {
                    std::hint::spin_loop();
                }
                if due_tx.send(due).is_err() {
                    break;
                }
            }
        });
        let workers = self.spawn(move |endpoint, mut connection| {
            let due_rx = due_rx.clone();
            async move {
                let mut outcome = WorkerOutcome::default();
                loop {
                    // The lock is held only while waiting for the next due request; whoever
                    // waits is free, so the request goes to a free connection.
                    let due = due_rx.lock().await.recv().await;
                    let Some(due) = due else { break };
                    let sent = Instant::now();
                    let result = connection.exchange(&endpoint).await;
                    outcome.record(due, sent, result);
                }
                (connection, outcome)
            }
        });
        let outcome = self.collect(workers, t0).await?;
        dispatcher.await.context("load dispatcher")?;
        Ok(outcome)
    }

    /// Every connection sends back-to-back for `duration`; [`Outcome::rate`] is the achieved
    /// maximum rate.
    pub async fn max_rate(&mut self, duration: Duration) -> anyhow::Result<Outcome> {
        let start = Instant::now();
        let deadline = start + duration;
        let workers = self.spawn(move |endpoint, mut connection| async move {
            let mut outcome = WorkerOutcome::default();
            while Instant::now() < deadline {
                let sent = Instant::now();
                let result = connection.exchange(&endpoint).await;
                outcome.record(sent, sent, result);
            }
            (connection, outcome)
        });
        self.collect(workers, start).await
    }

    /// Moves each connection into its own task running `work`.
    fn spawn<F, Fut>(
        &mut self,
        work: F,
    ) -> Vec<tokio::task::JoinHandle<(Connection, WorkerOutcome)>>
    where
        F: Fn(Arc<Endpoint>, Connection) -> Fut,
        Fut: Future<Output = (Connection, WorkerOutcome)> + Send + 'static,
    {
        std::mem::take(&mut self.connections)
            .into_iter()
            .map(|connection| tokio::spawn(work(self.endpoint.clone(), connection)))
            .collect()
    }

    /// Waits for the tasks, takes the connections back and merges what they measured.
    async fn collect(
        &mut self,
        workers: Vec<tokio::task::JoinHandle<(Connection, WorkerOutcome)>>,
        start: Instant,
    ) -> anyhow::Result<Outcome> {
        let mut outcome = Outcome::default();
        for worker in workers {
            let (connection, measured) = worker.await.context("load connection task")?;
            self.connections.push(connection);
            outcome.merge(measured);
        }
        outcome.elapsed = Instant::now().saturating_duration_since(start);
        Ok(outcome)
    }
}

impl Connection {
    /// One request on this connection, reconnecting first after an earlier error.
    async fn exchange(&mut self, endpoint: &Endpoint) -> Result<(), String> {
        let mut sender = match self.sender.take() {
            Some(sender) => sender,
            None => connect(endpoint)
                .await
                .map_err(|e| format!("reconnect: {e:#}"))?,
        };
        let result = request(&mut sender, endpoint).await;
        if result.is_ok() || !sender.is_closed() {
            // A non-2xx answer leaves the connection usable; an error on the wire does not.
            self.sender = Some(sender);
        }
        result.map(|_| ())
    }
}

/// Sends the endpoint's request and reads the whole answer; non-2xx is an error. Returns the
/// body.
async fn request(sender: &mut Sender, endpoint: &Endpoint) -> Result<Bytes, String> {
    sender
        .ready()
        .await
        .map_err(|e| format!("connection: {e}"))?;
    let request = http::Request::post(endpoint.path.as_str())
        .header(http::header::HOST, "127.0.0.1")
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(endpoint.body.clone()))
        .map_err(|e| format!("request: {e}"))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    if !status.is_success() {
        let text = String::from_utf8_lossy(&body);
        return Err(format!(
            "status {status}: {}",
            text.chars().take(200).collect::<String>()
        ));
    }
    Ok(body)
}

/// Sends the endpoint's request once on a fresh connection and returns the body of a 2xx
/// answer (to check what the server says before loading it).
pub async fn once(endpoint: &Endpoint) -> anyhow::Result<Bytes> {
    let mut sender = connect(endpoint).await?;
    request(&mut sender, endpoint)
        .await
        .map_err(|e| anyhow::anyhow!("{} {}: {e}", endpoint.addr, endpoint.path))
}

async fn connect(endpoint: &Endpoint) -> anyhow::Result<Sender> {
    let tcp = TcpStream::connect(endpoint.addr)
        .await
        .with_context(|| format!("connecting to {}", endpoint.addr))?;
    // Small requests and answers: Nagle's algorithm would hold them back for the ACK.
    tcp.set_nodelay(true).context("TCP_NODELAY")?;
    match &endpoint.transport {
        Transport::Plain => handshake(tcp).await,
        Transport::Tls(config) => {
            let name = ServerName::try_from("127.0.0.1").context("server name")?;
            let tls = TlsConnector::from(config.clone())
                .connect(name, tcp)
                .await
                .context("TLS handshake")?;
            handshake(tls).await
        }
    }
}

async fn handshake<S>(io: S) -> anyhow::Result<Sender>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .context("HTTP/1.1 handshake")?;
    // The connection's own task reads and writes the socket; its errors reach the sender.
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::post;

    /// A plain server: `/ok` answers at once, `/fail` with 500, `/slow` after 50 ms.
    async fn server() -> SocketAddr {
        let router = Router::new()
            .route("/ok", post(|| async { "ok" }))
            .route(
                "/fail",
                post(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "boom") }),
            )
            .route(
                "/slow",
                post(|| async {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    "slow"
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        tokio::spawn(async move { axum::serve(listener, router).await });
        addr
    }

    fn endpoint(addr: SocketAddr, path: &str) -> Endpoint {
        Endpoint {
            addr,
            transport: Transport::Plain,
            path: path.into(),
            body: Bytes::from_static(b"{}"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn open_loop_holds_the_rate_and_records_every_request() {
        let addr = server().await;
        let mut pool = Pool::connect(endpoint(addr, "/ok"), 4).await.expect("pool");
        let outcome = pool
            .open_loop(200.0, Duration::from_secs(1))
            .await
            .expect("run");
        assert_eq!(outcome.latencies_ms.len(), 200);
        assert_eq!(outcome.service_ms.len(), 200);
        assert_eq!(outcome.failures, 0, "{:?}", outcome.first_failure);
        // The last request is due after 995 ms: the run cannot be shorter, and on any machine
        // far from ten times longer.
        assert!(
            outcome.elapsed >= Duration::from_millis(995)
                && outcome.elapsed < Duration::from_secs(10),
            "{:?}",
            outcome.elapsed
        );
        assert!(
            outcome
                .latencies_ms
                .iter()
                .zip(&outcome.service_ms)
                .all(|(l, s)| l.is_finite() && *s >= 0.0 && l >= s),
            "latency from the due time includes the service time"
        );
        // The pool survives the run: a second one on the same connections works.
        let again = pool
            .max_rate(Duration::from_millis(200))
            .await
            .expect("run");
        assert!(!again.latencies_ms.is_empty());
        assert_eq!(again.failures, 0, "{:?}", again.first_failure);
        assert!(again.rate() > 0.0);
        assert_eq!(pool.size(), 4);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queueing_behind_a_slow_server_counts() {
        let addr = server().await;
        let mut pool = Pool::connect(endpoint(addr, "/slow"), 1)
            .await
            .expect("pool");
        // 20 requests due within 200 ms, each taking at least 50 ms on one connection: the
        // last one waits for the 19 before it.
        let outcome = pool
            .open_loop(100.0, Duration::from_millis(200))
            .await
            .expect("run");
        assert_eq!(outcome.latencies_ms.len(), 20);
        assert!(outcome.service_ms.iter().all(|s| *s >= 50.0));
        let worst = outcome.latencies_ms.iter().copied().fold(0.0, f64::max);
        assert!(worst >= 19.0 * 50.0 - 190.0, "worst latency {worst} ms");
    }

    #[tokio::test]
    async fn non_2xx_answers_are_failures() {
        let addr = server().await;
        let mut pool = Pool::connect(endpoint(addr, "/fail"), 2)
            .await
            .expect("pool");
        let outcome = pool
            .open_loop(100.0, Duration::from_millis(100))
            .await
            .expect("run");
        assert_eq!(outcome.failures, 10);
        assert!(
            outcome
                .first_failure
                .as_deref()
                .is_some_and(|f| f.contains("500") && f.contains("boom")),
            "{:?}",
            outcome.first_failure
        );
        assert!(outcome.ensure_no_failures("fail").is_err());
        let missing = pool.max_rate(Duration::from_millis(50)).await.expect("run");
        assert_eq!(missing.failures as usize, missing.latencies_ms.len());
        assert!(
            once(&endpoint(addr, "/fail")).await.is_err(),
            "once reports a 500"
        );
        assert_eq!(
            once(&endpoint(addr, "/ok")).await.expect("ok").as_ref(),
            b"ok"
        );
    }

    #[tokio::test]
    async fn a_dead_server_is_a_failure_not_a_hang() {
        let addr = server().await;
        let mut pool = Pool::connect(endpoint(addr, "/ok"), 1).await.expect("pool");
        // Nothing listens on port 1: pointing the pool there makes every reconnect fail.
        pool.endpoint = Arc::new(endpoint(SocketAddr::from(([127, 0, 0, 1], 1)), "/ok"));
        pool.connections[0].sender = None;
        let outcome = pool
            .open_loop(50.0, Duration::from_millis(100))
            .await
            .expect("run");
        assert_eq!(outcome.failures, 5);
        assert!(
            outcome
                .first_failure
                .as_deref()
                .is_some_and(|f| f.contains("reconnect")),
            "{:?}",
            outcome.first_failure
        );
    }
}
