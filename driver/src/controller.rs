//! The node-local CSI Controller: CreateVolume, DeleteVolume, ValidateVolumeCapabilities,
//! ListVolumes and GetCapacity for this node's volumes. Everything else is unimplemented:
//! volumes need no attach step and have no snapshots or expansion.

use std::collections::HashMap;
use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::capability::access_all;
use crate::csi::controller_server::Controller;
use crate::csi::controller_service_capability::{self, rpc};
use crate::csi::*;
use crate::error::VolumeError;
use crate::parameters::{Origin, Parameters};
use crate::volumes::{CreateRequest, Volumes};

/// The Controller service of one node.
#[derive(Clone, Debug)]
pub struct ControllerService {
    /// The node's volumes.
    pub volumes: Arc<Volumes>,
    /// This node's name.
    pub node_id: String,
    /// `<driver>/node`.
    pub topology_key: String,
}

impl ControllerService {
    /// This node's topology segment.
    pub fn topology(&self) -> Topology {
        Topology {
            segments: HashMap::from([(self.topology_key.clone(), self.node_id.clone())]),
        }
    }

    /// Whether `topology` names this node (a topology without our key names no node).
    fn is_this_node(&self, topology: &Topology) -> bool {
        topology.segments.get(&self.topology_key) == Some(&self.node_id)
    }
}

fn unimplemented<T>(what: &str) -> Result<Response<T>, Status> {
    Err(Status::unimplemented(format!(
        "{what} is not supported: volumes are node-local"
    )))
}

/// PMEM-CSI's volume_context: the parameters as given plus `name`; no `deviceMode` or `size`,
/// which PMEM-CSI 1.0 does not accept in a PV's context, so a rollback can still stage.
fn volume_context(parameters: &Parameters, name: &str) -> HashMap<String, String> {
    let mut context = Parameters {
        name: Some(name.to_string()),
        ..parameters.clone()
    }
    .to_context();
    context.remove(crate::parameters::DEVICE_MODE);
    context.remove(crate::parameters::SIZE);
    context.into_iter().collect()
}

fn u64_of(bytes: i64, field: &'static str) -> Result<u64, VolumeError> {
    u64::try_from(bytes).map_err(|_| VolumeError::Invalid {
        field,
        reason: format!("{bytes} is negative"),
    })
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let r = request.into_inner();
        if r.name.is_empty() {
            return Err(VolumeError::Missing("name").into());
        }
        if let Some(reason) = crate::volume_id::name_problem(&r.name) {
            return Err(VolumeError::Invalid {
                field: "name",
                reason,
            }
            .into());
        }
        access_all(&r.volume_capabilities)?;
        if r.volume_content_source.is_some() {
            return Err(VolumeError::Invalid {
                field: "volume_content_source",
                reason: "snapshots and clones are not supported".into(),
            }
            .into());
        }
        let parameters =
            Parameters::parse(&r.parameters.into_iter().collect(), Origin::CreateVolume)
                .map_err(VolumeError::from)?;
        if let Some(req) = &r.accessibility_requirements
            && !req.requisite.is_empty()
            && !req.requisite.iter().any(|t| self.is_this_node(t))
        {
            return Err(Status::resource_exhausted(format!(
                "volumes of this driver instance can only be created on node {} ({}={}); requisite topology excludes it",
                self.node_id, self.topology_key, self.node_id
            )));
        }
        let range = r.capacity_range.unwrap_or_default();
        let volume = self
            .volumes
            .create(CreateRequest {
                name: r.name.clone(),
                required: u64_of(range.required_bytes, "capacity_range.required_bytes")?,
                limit: u64_of(range.limit_bytes, "capacity_range.limit_bytes")?,
                parameters: parameters.clone(),
            })
            .await?;
        Ok(Response::new(CreateVolumeResponse {
            volume: Some(Volume {
                capacity_bytes: volume.size,
                volume_id: volume.id,
                volume_context: volume_context(&parameters, &r.name),
                content_source: None,
                accessible_topology: vec![self.topology()],
            }),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let r = request.into_inner();
        if r.volume_id.is_empty() {
            return Err(VolumeError::Missing("volume_id").into());
        }
        self.volumes.delete(&r.volume_id).await?;
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        _request: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        unimplemented("ControllerPublishVolume")
    }

    async fn controller_unpublish_volume(
        &self,
        _request: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        unimplemented("ControllerUnpublishVolume")
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let r = request.into_inner();
        if r.volume_id.is_empty() {
            return Err(VolumeError::Missing("volume_id").into());
        }
        if r.volume_capabilities.is_empty() {
            return Err(VolumeError::Missing("volume_capabilities").into());
        }
        if self.volumes.get(&r.volume_id).is_none() {
            return Err(VolumeError::Unknown { id: r.volume_id }.into());
        }
        let response = match access_all(&r.volume_capabilities) {
            Ok(_) => ValidateVolumeCapabilitiesResponse {
                confirmed: Some(validate_volume_capabilities_response::Confirmed {
                    volume_context: r.volume_context,
                    volume_capabilities: r.volume_capabilities,
                    parameters: r.parameters,
                    mutable_parameters: Default::default(),
                }),
                message: String::new(),
            },
            Err(e) => ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: e.to_string(),
            },
        };
        Ok(Response::new(response))
    }

    async fn list_volumes(
        &self,
        request: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        let r = request.into_inner();
        let max = usize::try_from(r.max_entries).map_err(|_| VolumeError::Invalid {
            field: "max_entries",
            reason: format!("{} is negative", r.max_entries),
        })?;
        let volumes = self.volumes.list();
        // The token is an offset into the list sorted by ID: volumes created or deleted
        // between pages shift it by at most what changed, which is what callers expect.
        let start = if r.starting_token.is_empty() {
            0
        } else {
            match r.starting_token.parse::<usize>() {
                Ok(n) if n <= volumes.len() => n,
                _ => {
                    return Err(Status::aborted(format!(
                        "starting_token {:?} is not valid (expected an offset up to {})",
                        r.starting_token,
                        volumes.len()
                    )));
                }
            }
        };
        let end = if max == 0 {
            volumes.len()
        } else {
            (start + max).min(volumes.len())
        };
        let entries = volumes[start..end]
            .iter()
            .map(|v| list_volumes_response::Entry {
                volume: Some(Volume {
                    capacity_bytes: v.size,
                    volume_id: v.id.clone(),
                    ..Default::default()
                }),
                status: None,
            })
            .collect();
        Ok(Response::new(ListVolumesResponse {
            entries,
            next_token: if end < volumes.len() {
                end.to_string()
            } else {
                String::new()
            },
        }))
    }

    async fn get_capacity(
        &self,
        request: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        let r = request.into_inner();
        Parameters::parse(&r.parameters.into_iter().collect(), Origin::CreateVolume)
            .map_err(VolumeError::from)?;
        for capability in &r.volume_capabilities {
            crate::capability::access(capability)?;
        }
        if let Some(topology) = &r.accessible_topology
            && !self.is_this_node(topology)
        {
            return Ok(Response::new(GetCapacityResponse {
                available_capacity: 0,
                maximum_volume_size: Some(0),
                minimum_volume_size: None,
            }));
        }
        let capacity = self.volumes.capacity()?;
        let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        Ok(Response::new(GetCapacityResponse {
            available_capacity: int(capacity.available()),
            maximum_volume_size: Some(int(capacity.max_volume_size())),
            minimum_volume_size: None,
        }))
    }

    async fn controller_get_capabilities(
        &self,
        _request: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        let capability = |t: rpc::Type| ControllerServiceCapability {
            r#type: Some(controller_service_capability::Type::Rpc(
                controller_service_capability::Rpc { r#type: t as i32 },
            )),
        };
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities: vec![
                capability(rpc::Type::CreateDeleteVolume),
                capability(rpc::Type::ListVolumes),
                capability(rpc::Type::GetCapacity),
            ],
        }))
    }

    async fn create_snapshot(
        &self,
        _request: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        unimplemented("CreateSnapshot")
    }

    async fn delete_snapshot(
        &self,
        _request: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        unimplemented("DeleteSnapshot")
    }

    async fn list_snapshots(
        &self,
        _request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        unimplemented("ListSnapshots")
    }

    async fn get_snapshot(
        &self,
        _request: Request<GetSnapshotRequest>,
    ) -> Result<Response<GetSnapshotResponse>, Status> {
        unimplemented("GetSnapshot")
    }

    async fn controller_expand_volume(
        &self,
        _request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        unimplemented("ControllerExpandVolume")
    }

    async fn controller_get_volume(
        &self,
        _request: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        unimplemented("ControllerGetVolume")
    }

    async fn controller_modify_volume(
        &self,
        _request: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        unimplemented("ControllerModifyVolume")
    }
}
