//! Free loopback ports for the components (never their well-known defaults, which collide
//! between parallel testenvs).

use std::net::{SocketAddr, TcpListener};

/// Asks the kernel for a free port on 127.0.0.1.
///
/// The port is released before the component binds it; another process could take it in
/// between, which makes that component fail to start with "address in use" in its log.
pub fn free_port() -> std::io::Result<u16> {
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    Ok(listener.local_addr()?.port())
}
