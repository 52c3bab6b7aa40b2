//! csi-sanity, the upstream CSI conformance suite, against the real `pmem-csi node` binary:
//! zero failures, no skip list (but the one spec a missing capability rules out, below), and
//! never fewer specs than recorded here.

use std::path::Path;

use testenv::csi_sanity;
use testenv::node_driver::{self, NodeDriverDirs};

/// Specs each configuration ran when these floors were recorded (csi-test v5.4.0); fewer
/// means the driver stopped advertising something or the suite changed under us. The four
/// NodeExpandVolume specs run since the node offers EXPAND_VOLUME.
const MOUNT_SPECS: usize = 45;
const BLOCK_SPECS: usize = 45;
const XFS_SPECS: usize = 45;
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

/// Growing a mounted ext4 needs CAP_SYS_RESOURCE. Without it (this machine's sandbox) the one
/// spec that grows a published volume is left out here — the driver refuses it up front, as
/// `tests/expansion.rs` checks — and runs in the xfs and block runs and, on ext4, in the guest.
#[tokio::test]
async fn emulated_mount_ext4() {
    let mut extra = vec![
        format!("--csi.testvolumesize={}", 64 * MI),
        format!("--csi.testvolumeexpandsize={}", 128 * MI),
    ];
    let mut floor = MOUNT_SPECS;
    if driver::filesystem::online_growth_refused("ext4").is_some() {
        println!("no CAP_SYS_RESOURCE: ext4 cannot grow online here");
        extra.push("--ginkgo.skip=should work if node-expand is called after node-publish".into());
        floor -= 1;
    }
    sanity(
        "emulated mount ext4",
        &["--default-volume-size=64Mi"],
        true,
        extra,
        floor,
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
            format!("--csi.testvolumeexpandsize={}", 128 * MI),
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
        vec![
            format!("--csi.testvolumesize={}", 320 * MI),
            format!("--csi.testvolumeexpandsize={}", 512 * MI),
        ],
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

/// A node without xfsprogs: every spec that stages an xfs volume fails with a
/// `FailedPrecondition` naming the program and its package (not "No such file or directory" on
/// the loop device), `/readyz` names them too, and nothing is left behind.
#[tokio::test]
async fn emulated_without_mkfs_xfs() {
    let root = tempfile::tempdir().expect("tempdir");
    let dirs = NodeDriverDirs::under(root.path());
    // A PATH with every program emulated mode runs but mkfs.xfs.
    let bin = root.path().join("bin");
    std::fs::create_dir_all(&bin).expect("bin dir");
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in ["blkid", "losetup", "mkfs.ext4", "resize2fs", "xfs_growfs"] {
        let real = driver::program::find_in(name, &path)
            .unwrap_or_else(|| panic!("{name} not on PATH; run `just ensure`"));
        std::os::unix::fs::symlink(&real, bin.join(name)).expect("symlink");
    }
    let admin = std::net::SocketAddr::from((
        [127, 0, 0, 1],
        testenv::ports::free_port().expect("free port"),
    ));
    let mut args = node_driver::emulated_args("node-1", &dirs, "2Gi");
    args.extend([
        "--default-volume-size=320Mi".into(),
        "--default-fs-type=xfs".into(),
        format!("--admin-address={admin}"),
    ]);
    let group = testenv::ProcessGroup::new().expect("process group");
    let bin_path = bin.display().to_string();
    let driver = node_driver::start(
        Path::new(env!("CARGO_BIN_EXE_pmem-csi")),
        args,
        &dirs,
        &group,
        &[("PATH", bin_path.as_str())],
    )
    .await
    .expect("driver starts");

    let ready = testenv::http_client::http(admin, "GET", "/readyz", b"")
        .await
        .expect("/readyz");
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert!(
        ready
            .body
            .contains("mkfs.xfs not installed (package xfsprogs)"),
        "{}",
        ready.body
    );

    let tools = testenv::Tools::locate().expect("tools");
    let run = csi_sanity::run(
        &tools,
        root.path(),
        &dirs.socket,
        &[
            format!("--csi.testvolumesize={}", 320 * MI),
            format!("--csi.testvolumeexpandsize={}", 512 * MI),
            "--ginkgo.focus=Node Service".into(),
        ],
    );
    driver.stop().await;
    println!(
        "without mkfs.xfs: csi-sanity ran {} specs, {} failed",
        run.ran, run.failed
    );
    assert!(
        run.failed > 0 && run.failed != usize::MAX,
        "staging must fail:\n{}",
        run.output
    );
    let want = "code = FailedPrecondition desc = mkfs.xfs on /dev/loop";
    assert!(run.output.contains(want), "no {want:?} in:\n{}", run.output);
    let want = "program mkfs.xfs is not installed (package xfsprogs)";
    assert!(run.output.contains(want), "no {want:?} in:\n{}", run.output);
    let leftovers = testenv::Leftovers::new(i32::MAX, root.path().to_path_buf()).find();
    assert!(leftovers.is_empty(), "left behind {leftovers:?}");
}
