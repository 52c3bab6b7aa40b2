//! A TCP proxy between a simulated node's processes and the apiserver, which a test can cut
//! (every connection dropped, new ones refused) and restore: a network partition of one node.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// A running proxy.
#[derive(Debug)]
pub struct TcpProxy {
    address: SocketAddr,
    cut: Arc<AtomicBool>,
    cut_now: Arc<Notify>,
    shutdown: CancellationToken,
}

impl TcpProxy {
    /// Listens on a free loopback port and forwards to `target`, on the current runtime.
    pub async fn start(target: SocketAddr, shutdown: CancellationToken) -> std::io::Result<Self> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let address = listener.local_addr()?;
        let cut = Arc::new(AtomicBool::new(false));
        let cut_now = Arc::new(Notify::new());
        let (c, n, s) = (cut.clone(), cut_now.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = s.cancelled() => return,
                };
                let Ok((mut client, _)) = accepted else {
                    continue;
                };
                if c.load(Ordering::SeqCst) {
                    // Partitioned: refuse by closing at once.
                    drop(client);
                    continue;
                }
                let (n, s) = (n.clone(), s.clone());
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = n.notified() => {}
                        _ = s.cancelled() => {}
                    }
                });
            }
        });
        Ok(Self {
            address,
            cut,
            cut_now,
            shutdown,
        })
    }

    /// The address clients connect to.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Partitions: drops every open connection and refuses new ones.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.cut_now.notify_waiters();
    }

    /// Heals the partition.
    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}
