//! A CSI client over a Unix socket, for tests and the simulated kubelet.

use std::path::PathBuf;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

/// Connects to the CSI server on `socket`.
pub async fn connect(socket: impl Into<PathBuf>) -> Result<Channel, tonic::transport::Error> {
    let socket = socket.into();
    // The URI is required by the API but unused: the connector dials the socket.
    Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(
                    tokio::net::UnixStream::connect(socket).await?,
                ))
            }
        }))
        .await
}

/// The IDs of every volume the driver lists (one unpaged ListVolumes call).
pub async fn volume_ids(
    client: &mut crate::csi::controller_client::ControllerClient<Channel>,
) -> Result<Vec<String>, tonic::Status> {
    Ok(client
        .list_volumes(crate::csi::ListVolumesRequest::default())
        .await?
        .into_inner()
        .entries
        .into_iter()
        .filter_map(|e| e.volume.map(|v| v.volume_id))
        .collect())
}
