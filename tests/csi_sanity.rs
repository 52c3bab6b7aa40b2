//! csi-sanity, the upstream CSI conformance suite, against the real `pmem-csi node` binary:
//! zero failures, no skip list, and never fewer specs than recorded here.

use std::path::Path;

use testenv::csi_sanity;
use testenv::node_driver::{self, NodeDriverDirs};

/// Specs each configuration ran when these floors were recorded (csi-test v5.4.0); fewer
/// means the driver stopped advertising something or the suite changed under us.
const MOUNT_SPECS: usize = 41;
const BLOCK_SPECS: usize = 41;
const XFS_SPECS: usize = 41;
const FAKE_CONTROLLER_SPECS: usize = 19;

const MI: u64 = 1 << 20;

/// Starts a driver with `args`, runs csi-sanity with `extra` and checks the result.
async fn sanity(
    name: &str,
    driver_args: &[&str],
    emulated: bool,
    extra: Vec<String>,
    floor: usize,
) {
    let root = tempfile::tempdir().expect("tempdir");
    let dirs = NodeDriverDirs::under(root.path());
    let mut args = if emulated {
        node_driver::emulated_args("node-1", &dirs, "2Gi")
    } else {
        vec![
            "node".to_string(),
            format!("--endpoint=unix://{}", dirs.socket.display()),
            "--node-id=node-1".into(),
            "--device-mode=fake".into(),
            "--emulated-size=1Ti".into(),
            format!("--state-dir={}", dirs.state.display()),
            "--standalone".into(),
        ]
    };
    args.extend(driver_args.iter().map(|a| a.to_string()));
    csi_sanity::check(
        Path::new(env!("CARGO_BIN_EXE_pmem-csi")),
        name,
        root.path(),
        &dirs,
        args,
        &extra,
        floor,
    )
    .await;
}

#[tokio::test]
async fn emulated_mount_ext4() {
    sanity(
        "emulated mount ext4",
        &["--default-volume-size=64Mi"],
        true,
        vec![format!("--csi.testvolumesize={}", 64 * MI)],
        MOUNT_SPECS,
    )
    .await;
}

#[tokio::test]
async fn emulated_block() {
    sanity(
        "emulated block",
        &["--default-volume-size=64Mi"],
        true,
        vec![
            format!("--csi.testvolumesize={}", 64 * MI),
            "--csi.testvolumeaccesstype=block".into(),
        ],
        BLOCK_SPECS,
    )
    .await;
}

#[tokio::test]
async fn emulated_mount_xfs_by_default() {
    // xfsprogs refuses file systems below 300 MiB.
    sanity(
        "emulated xfs",
        &["--default-volume-size=320Mi", "--default-fs-type=xfs"],
        true,
        vec![format!("--csi.testvolumesize={}", 320 * MI)],
        XFS_SPECS,
    )
    .await;
}

/// fake has no devices, so only the Controller specs apply.
#[tokio::test]
async fn fake_controller() {
    sanity(
        "fake controller",
        &["--default-volume-size=64Mi"],
        false,
        vec![
            format!("--csi.testvolumesize={}", 64 * MI),
            "--ginkgo.focus=Controller".into(),
        ],
        FAKE_CONTROLLER_SPECS,
    )
    .await;
}
