//! A `pmem-csi node` under test with CSI clients on its socket: the calls a test makes over and
//! over (create, stage, publish, …) with the capabilities they take. Shared by the host's
//! component tests (emulated) and the QEMU guest's (lvm, direct).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use driver::csi::controller_client::ControllerClient;
use driver::csi::node_client::NodeClient;
use driver::csi::volume_capability::{
    AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode,
};
use driver::csi::*;
use tonic::transport::Channel;

use crate::node_driver::{self, NodeDriverDirs};
use crate::process::Component;
use crate::{Leftovers, ProcessGroup};

/// A running driver and its clients.
pub struct Harness {
    root: tempfile::TempDir,
    /// The driver's directories.
    pub dirs: NodeDriverDirs,
    binary: PathBuf,
    driver: Option<Component>,
    /// Controller client.
    pub controller: ControllerClient<Channel>,
    /// Node client.
    pub node: NodeClient<Channel>,
    group: ProcessGroup,
}

impl Harness {
    /// Starts `binary` as an emulated driver (1 GiB) with `extra` flags, after `prepare` has
    /// seen the (empty) directories.
    pub async fn emulated(
        binary: &Path,
        extra: &[&str],
        prepare: impl FnOnce(&NodeDriverDirs),
    ) -> Self {
        let root = tempfile::tempdir().expect("tempdir");
        let dirs = NodeDriverDirs::under(root.path());
        prepare(&dirs);
        let mut args = node_driver::emulated_args("node-1", &dirs, "1Gi");
        args.extend(extra.iter().map(|a| a.to_string()));
        Self::start(binary, root, dirs, args).await
    }

    /// Starts `binary` with `args` (which name `dirs`' socket and state directory).
    pub async fn start(
        binary: &Path,
        root: tempfile::TempDir,
        dirs: NodeDriverDirs,
        args: Vec<String>,
    ) -> Self {
        Self::start_with_env(binary, root, dirs, args, &[]).await
    }

    /// [`Harness::start`] with `env` added to the driver's environment (a `PATH` of chosen
    /// tools, say).
    pub async fn start_with_env(
        binary: &Path,
        root: tempfile::TempDir,
        dirs: NodeDriverDirs,
        args: Vec<String>,
        env: &[(&str, &str)],
    ) -> Self {
        let group = ProcessGroup::new().expect("group");
        let driver = node_driver::start(binary, args, &dirs, &group, env)
            .await
            .expect("driver starts");
        let channel = driver::client::connect(&dirs.socket)
            .await
            .expect("connect");
        Self {
            root,
            dirs,
            binary: binary.to_path_buf(),
            driver: Some(driver),
            controller: ControllerClient::new(channel.clone()),
            node: NodeClient::new(channel),
            group,
        }
    }

    /// Stops the driver and starts it again with `args` (same directories).
    pub async fn restart(&mut self, args: Vec<String>) {
        if let Some(driver) = self.driver.take() {
            driver.stop().await;
        }
        let driver = node_driver::start(&self.binary, args, &self.dirs, &self.group, &[])
            .await
            .expect("driver restarts");
        let channel = driver::client::connect(&self.dirs.socket)
            .await
            .expect("connect");
        self.driver = Some(driver);
        self.controller = ControllerClient::new(channel.clone());
        self.node = NodeClient::new(channel);
    }

    /// Stops the driver and starts it with `args`, expecting it to refuse to start; returns
    /// what it said (the end of its log). The harness has no driver afterwards until
    /// [`Harness::restart`].
    pub async fn restart_refused(&mut self, args: Vec<String>) -> String {
        if let Some(driver) = self.driver.take() {
            driver.stop().await;
        }
        match node_driver::start(&self.binary, args, &self.dirs, &self.group, &[]).await {
            Ok(driver) => {
                driver.stop().await;
                panic!("the driver started");
            }
            // The whole log: the error's tail may be a backtrace.
            Err(e) => format!(
                "{e}\n{}",
                std::fs::read_to_string(&self.dirs.log).unwrap_or_default()
            ),
        }
    }

    /// A path under the test's root.
    pub fn path(&self, name: &str) -> PathBuf {
        self.root.path().join(name)
    }

    /// CreateVolume of `size` bytes with `parameters` (mount capability); panics on failure.
    pub async fn create(&mut self, name: &str, size: i64, parameters: &[(&str, &str)]) -> Volume {
        self.controller
            .create_volume(CreateVolumeRequest {
                name: name.into(),
                capacity_range: Some(CapacityRange {
                    required_bytes: size,
                    limit_bytes: 0,
                }),
                volume_capabilities: vec![mount("")],
                parameters: params(parameters),
                ..Default::default()
            })
            .await
            .expect("create")
            .into_inner()
            .volume
            .expect("volume")
    }

    /// NodeStageVolume at the harness's staging path.
    pub async fn stage(
        &mut self,
        id: &str,
        capability: VolumeCapability,
    ) -> Result<(), tonic::Status> {
        let staging = self.path("staging");
        self.node
            .node_stage_volume(NodeStageVolumeRequest {
                volume_id: id.into(),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(capability),
                ..Default::default()
            })
            .await
            .map(|_| ())
    }

    /// NodeUnstageVolume; panics on failure.
    pub async fn unstage(&mut self, id: &str) {
        let staging = self.path("staging");
        self.node
            .node_unstage_volume(NodeUnstageVolumeRequest {
                volume_id: id.into(),
                staging_target_path: staging.display().to_string(),
            })
            .await
            .expect("unstage");
    }

    /// NodePublishVolume at `target`.
    pub async fn publish(
        &mut self,
        id: &str,
        target: &Path,
        capability: VolumeCapability,
        readonly: bool,
        context: &[(&str, &str)],
    ) -> Result<(), tonic::Status> {
        let staging = self.path("staging");
        self.node
            .node_publish_volume(NodePublishVolumeRequest {
                volume_id: id.into(),
                staging_target_path: staging.display().to_string(),
                target_path: target.display().to_string(),
                volume_capability: Some(capability),
                readonly,
                volume_context: params(context),
                ..Default::default()
            })
            .await
            .map(|_| ())
    }

    /// NodeUnpublishVolume; panics on failure.
    pub async fn unpublish(&mut self, id: &str, target: &Path) {
        self.node
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: id.into(),
                target_path: target.display().to_string(),
            })
            .await
            .expect("unpublish");
    }

    /// NodeExpandVolume of the volume available at `path` to `required` bytes; the size it
    /// reports.
    pub async fn expand(
        &mut self,
        id: &str,
        path: &Path,
        required: i64,
    ) -> Result<i64, tonic::Status> {
        let staging = self.path("staging");
        self.node
            .node_expand_volume(NodeExpandVolumeRequest {
                volume_id: id.into(),
                volume_path: path.display().to_string(),
                capacity_range: Some(CapacityRange {
                    required_bytes: required,
                    limit_bytes: 0,
                }),
                staging_target_path: staging.display().to_string(),
                ..Default::default()
            })
            .await
            .map(|r| r.into_inner().capacity_bytes)
    }

    /// GetCapacity's available bytes; panics on failure.
    pub async fn available(&mut self) -> i64 {
        self.controller
            .get_capacity(GetCapacityRequest::default())
            .await
            .expect("capacity")
            .into_inner()
            .available_capacity
    }

    /// DeleteVolume; panics on failure.
    pub async fn delete(&mut self, id: &str) {
        self.controller
            .delete_volume(DeleteVolumeRequest {
                volume_id: id.into(),
                ..Default::default()
            })
            .await
            .expect("delete");
    }

    /// Every volume ID ListVolumes returns.
    pub async fn volume_ids(&mut self) -> Vec<String> {
        driver::client::volume_ids(&mut self.controller)
            .await
            .expect("list")
    }

    /// Stops the driver and checks that no loop device or mount of this test remains.
    pub async fn finish(mut self) {
        if let Some(driver) = self.driver.take() {
            driver.stop().await;
        }
        let leftovers = Leftovers::new(i32::MAX, self.root.path().to_path_buf()).find();
        assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
    }
}

/// A string map from pairs.
pub fn params(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A single-node-writer mount capability with file system `fs` (empty: the default).
pub fn mount(fs: &str) -> VolumeCapability {
    mount_with(fs, &[])
}

/// [`mount`] with `mount_flags` (a StorageClass's `mountOptions`).
pub fn mount_with(fs: &str, flags: &[&str]) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: flags.iter().map(|f| f.to_string()).collect(),
            ..Default::default()
        })),
    }
}

/// A single-node-writer raw block capability.
pub fn block() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}
