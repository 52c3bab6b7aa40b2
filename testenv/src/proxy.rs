//! A TCP proxy between a simulated node's processes and the apiserver, which a test can cut
//! (every connection dropped, new ones refused) and restore: a network partition of one node;
//! or hang (connections stay open, nothing more is forwarded): an apiserver that stopped
//! answering behind a connection that looks alive.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// A running proxy.
#[derive(Debug)]
pub struct TcpProxy {
    address: SocketAddr,
    // A watch, not a Notify: a connection task still connecting to the target when the cut
    // comes must see it once it gets to wait, or it would forward through the partition.
    cut: watch::Sender<bool>,
    hung: watch::Sender<bool>,
    shutdown: CancellationToken,
}

impl TcpProxy {
    /// Listens on a free loopback port and forwards to `target`, on the current runtime.
    pub async fn start(target: SocketAddr, shutdown: CancellationToken) -> std::io::Result<Self> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let address = listener.local_addr()?;
        let (cut, cut_seen) = watch::channel(false);
        let (hung, hung_seen) = watch::channel(false);
        let s = shutdown.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = s.cancelled() => return,
                };
                let Ok((mut client, _)) = accepted else {
                    continue;
                };
                if *cut_seen.borrow() {
                    // Partitioned: refuse by closing at once.
                    drop(client);
                    continue;
                }
                let (mut cut_seen, mut hung_seen, s) =
                    (cut_seen.clone(), hung_seen.clone(), s.clone());
                tokio::spawn(async move {
                    let forward = async {
                        // Hung: the connection is held open and nothing is forwarded.
                        let hung_now = *hung_seen.borrow();
                        if hung_now {
                            return std::future::pending::<()>().await;
                        }
                        let Ok(mut server) = TcpStream::connect(target).await else {
                            return;
                        };
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                            // The guard wait_for returns must not live across the await below.
                            () = async { drop(hung_seen.wait_for(|hung| *hung).await) } => {
                                // Both ends stay open until the cut or the end of the test.
                                let _held = (server, &client);
                                std::future::pending::<()>().await
                            }
                        }
                    };
                    tokio::select! {
                        () = forward => {}
                        _ = cut_seen.wait_for(|cut| *cut) => {}
                        _ = s.cancelled() => {}
                    }
                });
            }
        });
        Ok(Self {
            address,
            cut,
            hung,
            shutdown,
        })
    }

    /// The address clients connect to.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Partitions: drops every open connection and refuses new ones.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Heals the partition.
    pub fn restore(&self) {
        self.cut.send_replace(false);
    }

    /// Stops forwarding without closing anything: open connections and new ones stay open and
    /// silent, as behind an apiserver that hangs. [`TcpProxy::cut`] then drops them.
    pub fn hang(&self) {
        self.hung.send_replace(true);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}
