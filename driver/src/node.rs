//! The CSI Node service: staging (file system on the volume's device, mounted once per node),
//! publishing (bind mounts into pods, read-only honoured; raw block as a bound device node),
//! volume statistics, and CSI inline ephemeral volumes created in NodePublish.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::capability::{Access, access};
use crate::csi::node_server::Node;
use crate::csi::node_service_capability::{self, rpc};
use crate::csi::*;
use crate::error::VolumeError;
use crate::filesystem::{self, FsType};
use crate::mount_options::MountOptions;
use crate::mounts::{self, MountInfo};
use crate::parameters::{self, Origin, Parameters, Persistency, Usage};
use crate::volume_id::volume_id;
use crate::volumes::{CreateRequest, Volumes, blocking};
use crate::{faults, loopdev};

/// The Node service of one node.
#[derive(Clone, Debug)]
pub struct NodeService {
    /// The node's volumes.
    pub volumes: Arc<Volumes>,
    /// This node's name.
    pub node_id: String,
    /// `<driver>/node`.
    pub topology_key: String,
    /// File system when the capability names none (`--default-fs-type`).
    pub default_fs: FsType,
}

fn required<'a>(value: &'a str, field: &'static str) -> Result<&'a str, VolumeError> {
    if value.is_empty() {
        Err(VolumeError::Missing(field))
    } else {
        Ok(value)
    }
}

fn non_negative(value: i64, field: &'static str) -> Result<u64, VolumeError> {
    u64::try_from(value).map_err(|_| VolumeError::Invalid {
        field,
        reason: format!("{value} is negative"),
    })
}

fn mount_at(path: &Path) -> Result<Option<MountInfo>, VolumeError> {
    mounts::at(path).map_err(VolumeError::io("reading mountinfo for", path.display()))
}

/// File-system options beyond the capability's: `dax` where the device supports it and the
/// volume is meant for AppDirect (loop devices never support it).
fn extra_fs_options(device: &Path, usage: Usage) -> &'static [&'static str] {
    if usage == Usage::AppDirect && loopdev::supports_dax(device) {
        &["dax"]
    } else {
        &[]
    }
}

impl NodeService {
    /// Makes `fs` on `device` unless it already holds it; another file system is an error,
    /// never a reformat.
    fn ensure_fs(id: &str, device: &Path, fs: FsType) -> Result<(), VolumeError> {
        match filesystem::detect(device)? {
            None => {
                filesystem::make(device, fs)?;
                faults::point("after-mkfs");
                Ok(())
            }
            Some(existing) if existing == fs.as_str() => Ok(()),
            Some(existing) => Err(VolumeError::FsMismatch {
                id: id.to_string(),
                existing,
                wanted: fs.as_str().to_string(),
            }),
        }
    }

    /// The device of volume `id` and its mount at `path` (a staged or published file system,
    /// or the bound device node of a raw block volume); `NotMounted` when it is not there.
    fn available_at(&self, id: &str, path: &Path) -> Result<(PathBuf, MountInfo), VolumeError> {
        let not_mounted = || VolumeError::NotMounted {
            id: id.to_string(),
            path: path.display().to_string(),
        };
        let device = self
            .volumes
            .backend_of(id)?
            .attached(id)
            .map_err(VolumeError::Backend)?
            .ok_or_else(not_mounted)?;
        let mount = mount_at(path)?
            .filter(|m| m.shows_device(&device))
            .ok_or_else(not_mounted)?;
        Ok((device, mount))
    }

    /// Attaches, formats if empty and mounts volume `id` at `target`.
    fn mount_fs(
        &self,
        id: &str,
        target: &Path,
        fs: Option<FsType>,
        flags: &[String],
        usage: Usage,
        read_only: bool,
    ) -> Result<(), VolumeError> {
        let fs = fs.unwrap_or(self.default_fs);
        let device = self
            .volumes
            .backend_of(id)?
            .attach(id)
            .map_err(|e| VolumeError::backend(id, e))?;
        faults::point("after-loop-attach");
        if let Some(existing) = mount_at(target)? {
            if existing.shows_device(&device) {
                return Ok(());
            }
            return Err(VolumeError::Conflict(format!(
                "{} is already mounted from {}",
                target.display(),
                existing.source
            )));
        }
        let options = MountOptions::parse(flags)?;
        Self::ensure_fs(id, &device, fs)?;
        std::fs::create_dir_all(target).map_err(VolumeError::io("creating", target.display()))?;
        mounts::mount_device(
            &device,
            target,
            fs.as_str(),
            read_only,
            &options,
            extra_fs_options(&device, usage),
        )
        .map_err(VolumeError::io("mounting", target.display()))?;
        faults::point("after-mount");
        Ok(())
    }

    /// Unmounts `target` (if mounted) and removes it.
    fn unmount_and_remove(target: &Path) -> Result<(), VolumeError> {
        if mount_at(target)?.is_some() {
            mounts::unmount(target).map_err(VolumeError::io("unmounting", target.display()))?;
        }
        match std::fs::symlink_metadata(target) {
            Ok(m) if m.is_dir() => std::fs::remove_dir(target),
            Ok(_) => std::fs::remove_file(target),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
        .map_err(VolumeError::io("removing", target.display()))
    }

    /// Releases the volume's device if nothing mounts it any more.
    fn release_device(&self, id: &str) -> Result<(), VolumeError> {
        match self.volumes.backend_of(id)?.detach(id) {
            Ok(()) => Ok(()),
            // Still staged or published elsewhere: the device stays until the last user goes.
            Err(crate::backend::BackendError::InUse { .. }) => Ok(()),
            Err(e) => Err(VolumeError::Backend(e)),
        }
    }

    /// Where an existing mount at `target` of volume `id` leaves a repeated publish.
    fn check_published(
        &self,
        id: &str,
        target: &Path,
        existing: &MountInfo,
        read_only: bool,
    ) -> Result<(), VolumeError> {
        let device = self
            .volumes
            .backend_of(id)?
            .attached(id)
            .map_err(VolumeError::Backend)?;
        if device.as_deref().is_some_and(|d| existing.shows_device(d))
            && existing.read_only() == read_only
        {
            return Ok(());
        }
        Err(VolumeError::Conflict(format!(
            "{} is already published with other settings (source {}, read-only {})",
            target.display(),
            existing.source,
            existing.read_only()
        )))
    }

    async fn publish_ephemeral(
        &self,
        r: &NodePublishVolumeRequest,
        access: &Access,
    ) -> Result<(), VolumeError> {
        let Access::Mount { fs, flags } = access else {
            return Err(VolumeError::Invalid {
                field: "volume_capability",
                reason: "inline ephemeral volumes must be mounted, not raw block".into(),
            });
        };
        // An inline volume is named by kubelet's volume handle.
        if let Some(reason) = crate::volume_id::name_problem(&r.volume_id) {
            return Err(VolumeError::Invalid {
                field: "volume_id",
                reason,
            });
        }
        let params = Parameters::parse(
            &r.volume_context.clone().into_iter().collect(),
            Origin::Ephemeral,
        )?;
        let target = PathBuf::from(&r.target_path);
        let volume = self
            .volumes
            .create(CreateRequest {
                name: r.volume_id.clone(),
                required: params.size.unwrap_or(0),
                limit: 0,
                parameters: params.clone(),
            })
            .await?;
        let id = volume.id;
        let _guard = self.volumes.lock(&id).await;
        blocking(|| {
            // Idempotent: a repeated publish of a mounted inline volume only checks it.
            if let Some(existing) = mount_at(&target)? {
                return self.check_published(&id, &target, &existing, r.readonly);
            }
            let result = self.mount_fs(&id, &target, *fs, flags, params.usage(), r.readonly);
            if result.is_err() {
                // Nobody else knows this volume: remove it rather than leak it.
                let _ = Self::unmount_and_remove(&target);
                let _ = self.release_device(&id);
                if let Err(cleanup) = self.volumes.delete_locked(&id) {
                    tracing::error!(
                        id,
                        "removing inline volume after a failed publish: {cleanup}"
                    );
                }
            }
            result
        })
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let r = request.into_inner();
        let id = required(&r.volume_id, "volume_id")?.to_string();
        let staging = PathBuf::from(required(&r.staging_target_path, "staging_target_path")?);
        let capability = r
            .volume_capability
            .as_ref()
            .ok_or(VolumeError::Missing("volume_capability"))?;
        let access = access(capability)?;
        Parameters::parse(
            &r.volume_context.clone().into_iter().collect(),
            Origin::Context,
        )?;
        let _guard = self.volumes.lock(&id).await;
        let volume = self
            .volumes
            .get(&id)
            .ok_or(VolumeError::Unknown { id: id.clone() })?;
        let stored = Parameters::parse(&volume.parameters, Origin::State)?;
        match access {
            // Raw block needs no file system; the device is bound in NodePublish.
            Access::Block => {}
            Access::Mount { fs, flags } => {
                blocking(|| self.mount_fs(&id, &staging, fs, &flags, stored.usage(), false))?;
            }
        }
        Ok(Response::new(NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let r = request.into_inner();
        let id = required(&r.volume_id, "volume_id")?.to_string();
        let staging = PathBuf::from(required(&r.staging_target_path, "staging_target_path")?);
        let _guard = self.volumes.lock(&id).await;
        // A volume this driver does not know (its state quarantined, or never ours) may still
        // be mounted here: unmount it and answer OK, or kubelet could never finish the pod.
        let known = self.volumes.get(&id).is_some();
        blocking(|| {
            if mount_at(&staging)?.is_some() {
                mounts::unmount(&staging)
                    .map_err(VolumeError::io("unmounting", staging.display()))?;
            }
            if !known {
                tracing::warn!(id, staging = %staging.display(), "unstaged a volume without state");
                return Ok(());
            }
            self.release_device(&id)
        })?;
        Ok(Response::new(NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let r = request.into_inner();
        required(&r.volume_id, "volume_id")?;
        let target = PathBuf::from(required(&r.target_path, "target_path")?);
        let capability = r
            .volume_capability
            .as_ref()
            .ok_or(VolumeError::Missing("volume_capability"))?;
        let access = access(capability)?;
        if r.volume_context
            .get(parameters::EPHEMERAL)
            .map(String::as_str)
            == Some("true")
        {
            self.publish_ephemeral(&r, &access).await?;
            return Ok(Response::new(NodePublishVolumeResponse {}));
        }
        let id = r.volume_id.clone();
        Parameters::parse(
            &r.volume_context.clone().into_iter().collect(),
            Origin::Context,
        )?;
        let _guard = self.volumes.lock(&id).await;
        if self.volumes.get(&id).is_none() {
            return Err(VolumeError::Unknown { id }.into());
        }
        blocking(|| -> Result<(), VolumeError> {
            if let Some(existing) = mount_at(&target)? {
                return self.check_published(&id, &target, &existing, r.readonly);
            }
            let meta = std::fs::symlink_metadata(&target).ok();
            match access {
                Access::Mount { flags, .. } => {
                    let options = MountOptions::parse(&flags)?;
                    let staging =
                        PathBuf::from(required(&r.staging_target_path, "staging_target_path")?);
                    let device = self
                        .volumes
                        .backend_of(&id)?
                        .attached(&id)
                        .map_err(VolumeError::Backend)?;
                    let staged = mount_at(&staging)?
                        .zip(device)
                        .is_some_and(|(m, d)| m.shows_device(&d));
                    if !staged {
                        return Err(VolumeError::Precondition(format!(
                            "volume {id} is not staged at {}",
                            staging.display()
                        )));
                    }
                    if meta.as_ref().is_some_and(|m| !m.is_dir()) {
                        return Err(VolumeError::Invalid {
                            field: "target_path",
                            reason: format!("{} exists and is not a directory", target.display()),
                        });
                    }
                    std::fs::create_dir_all(&target)
                        .map_err(VolumeError::io("creating", target.display()))?;
                    mounts::bind_file_system(&staging, &target, r.readonly, &options)
                        .map_err(VolumeError::io("bind-mounting", target.display()))?;
                }
                Access::Block => {
                    if meta.as_ref().is_some_and(|m| m.is_dir()) {
                        return Err(VolumeError::Invalid {
                            field: "target_path",
                            reason: format!(
                                "{} is a directory; raw block volumes are published on a file",
                                target.display()
                            ),
                        });
                    }
                    let device = self
                        .volumes
                        .backend_of(&id)?
                        .attach(&id)
                        .map_err(|e| VolumeError::backend(&id, e))?;
                    std::fs::OpenOptions::new()
                        .create(true)
                        .truncate(false)
                        .write(true)
                        .open(&target)
                        .map_err(VolumeError::io("creating", target.display()))?;
                    if let Err(e) = mounts::bind(&device, &target, r.readonly) {
                        let _ = std::fs::remove_file(&target);
                        let _ = self.release_device(&id);
                        return Err(VolumeError::io("bind-mounting", target.display())(e));
                    }
                }
            }
            Ok(())
        })?;
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let r = request.into_inner();
        required(&r.volume_id, "volume_id")?;
        let target = PathBuf::from(required(&r.target_path, "target_path")?);
        // Inline volumes are known by the ID derived from kubelet's handle.
        let id = if self.volumes.get(&r.volume_id).is_some() {
            r.volume_id.clone()
        } else {
            volume_id(&r.volume_id)
        };
        let _guard = self.volumes.lock(&id).await;
        let volume = self.volumes.get(&id);
        blocking(|| -> Result<(), VolumeError> {
            Self::unmount_and_remove(&target)?;
            let Some(volume) = volume else {
                return Ok(());
            };
            let stored = Parameters::parse(&volume.parameters, Origin::State)?;
            self.release_device(&id)?;
            if stored.persistency == Some(Persistency::Ephemeral) {
                self.volumes.delete_locked(&id)?;
            }
            Ok(())
        })?;
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let r = request.into_inner();
        let id = required(&r.volume_id, "volume_id")?.to_string();
        let path = PathBuf::from(required(&r.volume_path, "volume_path")?);
        let volume = self
            .volumes
            .get(&id)
            .ok_or(VolumeError::Unknown { id: id.clone() })?;
        let (_, mount) = self.available_at(&id, &path)?;
        let usage = if mount.fs_type == "devtmpfs" {
            vec![VolumeUsage {
                total: volume.size,
                unit: volume_usage::Unit::Bytes as i32,
                ..Default::default()
            }]
        } else {
            let s = rustix::fs::statvfs(&path)
                .map_err(|e| VolumeError::io("statvfs", path.display())(e.into()))?;
            let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            vec![
                VolumeUsage {
                    available: int(s.f_bavail.saturating_mul(s.f_frsize)),
                    total: int(s.f_blocks.saturating_mul(s.f_frsize)),
                    used: int(s
                        .f_blocks
                        .saturating_sub(s.f_bfree)
                        .saturating_mul(s.f_frsize)),
                    unit: volume_usage::Unit::Bytes as i32,
                },
                VolumeUsage {
                    available: int(s.f_favail),
                    total: int(s.f_files),
                    used: int(s.f_files.saturating_sub(s.f_ffree)),
                    unit: volume_usage::Unit::Inodes as i32,
                },
            ]
        };
        Ok(Response::new(NodeGetVolumeStatsResponse {
            usage,
            volume_condition: None,
        }))
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let r = request.into_inner();
        let id = required(&r.volume_id, "volume_id")?.to_string();
        let path = PathBuf::from(required(&r.volume_path, "volume_path")?);
        let (required_bytes, limit) = match &r.capacity_range {
            None => (0, 0),
            Some(range) => (
                non_negative(range.required_bytes, "capacity_range.required_bytes")?,
                non_negative(range.limit_bytes, "capacity_range.limit_bytes")?,
            ),
        };
        let _guard = self.volumes.lock(&id).await;
        let capacity_bytes = blocking(|| -> Result<i64, VolumeError> {
            if self.volumes.get(&id).is_none() {
                return Err(VolumeError::Unknown { id: id.clone() });
            }
            // Online only: the volume must be staged and published where the call says, so
            // that its file system grows with it.
            let (device, mount) = self.available_at(&id, &path)?;
            if let Some(reason) = filesystem::online_growth_refused(&mount.fs_type) {
                return Err(VolumeError::Precondition(format!(
                    "volume {id} cannot grow: {reason}"
                )));
            }
            let grown = self.volumes.expand_locked(&id, required_bytes, limit)?;
            // A raw block volume is its device, which has grown; a file system grows now, and
            // again harmlessly when the call is repeated after a failure here.
            if mount.fs_type != "devtmpfs" {
                filesystem::grow(&mount.fs_type, &device, &path)?;
            }
            Ok(grown.size)
        })?;
        Ok(Response::new(NodeExpandVolumeResponse { capacity_bytes }))
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        let capability = |t: rpc::Type| NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(
                node_service_capability::Rpc { r#type: t as i32 },
            )),
        };
        let mut capabilities = vec![
            capability(rpc::Type::StageUnstageVolume),
            capability(rpc::Type::GetVolumeStats),
        ];
        // Direct-mode namespaces cannot grow: kubelet must not be told otherwise.
        if self.volumes.backend().growth_refused().is_none() {
            capabilities.push(capability(rpc::Type::ExpandVolume));
        }
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _request: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: Some(Topology {
                segments: HashMap::from([(self.topology_key.clone(), self.node_id.clone())]),
            }),
        }))
    }
}
