//! CSI Identity: who the plugin is, what it offers, whether it is ready.

use tonic::{Request, Response, Status};

use crate::csi::identity_server::Identity;
use crate::csi::plugin_capability::{self, service};
use crate::csi::{
    GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse, GetPluginInfoRequest,
    GetPluginInfoResponse, PluginCapability, ProbeRequest, ProbeResponse,
};

/// The Identity service.
#[derive(Clone, Debug)]
pub struct IdentityService {
    /// Plugin (driver) name.
    pub name: String,
    /// Vendor version.
    pub version: String,
    /// Whether volumes grow while in use (the node's NodeExpandVolume; direct mode cannot).
    pub online_expansion: bool,
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _request: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: self.name.clone(),
            vendor_version: self.version.clone(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _request: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        let capability = |t: service::Type| PluginCapability {
            r#type: Some(plugin_capability::Type::Service(
                plugin_capability::Service { r#type: t as i32 },
            )),
        };
        let mut capabilities = vec![
            capability(service::Type::ControllerService),
            capability(service::Type::VolumeAccessibilityConstraints),
        ];
        // ONLINE, not OFFLINE: the spec ties OFFLINE to ControllerExpandVolume, which the
        // driver does not offer; growth happens on the node, mounted.
        if self.online_expansion {
            capabilities.push(PluginCapability {
                r#type: Some(plugin_capability::Type::VolumeExpansion(
                    plugin_capability::VolumeExpansion {
                        r#type: plugin_capability::volume_expansion::Type::Online as i32,
                    },
                )),
            });
        }
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn probe(
        &self,
        _request: Request<ProbeRequest>,
    ) -> Result<Response<ProbeResponse>, Status> {
        // The server only starts serving after node state was loaded and repaired, so a
        // process that answers is ready.
        Ok(Response::new(ProbeResponse { ready: Some(true) }))
    }
}
