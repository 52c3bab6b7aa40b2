//! csi-sanity, the upstream CSI conformance suite, against the real `pmem-csi node` binary:
//! zero failures, no skip list, and never fewer specs than recorded here.

use std::path::Path;
use std::process::Command;

use testenv::node_driver::{self, NodeDriverDirs};
use testenv::{ProcessGroup, Tools};

/// Specs each configuration ran when these floors were recorded (csi-test v5.4.0); fewer
/// means the driver stopped advertising something or the suite changed under us.
const MOUNT_SPECS: usize = 41;
const BLOCK_SPECS: usize = 41;
const XFS_SPECS: usize = 41;
const FAKE_CONTROLLER_SPECS: usize = 19;

const MI: u64 = 1 << 20;

#[derive(Debug)]
struct SanityRun {
    ran: usize,
    passed: usize,
    failed: usize,
    output: String,
}

fn number_before(text: &str, marker: &str) -> Option<usize> {
    let end = text.find(marker)?;
    text[..end].split_whitespace().last()?.parse().ok()
}

fn number_after(text: &str, marker: &str) -> Option<usize> {
    let start = text.find(marker)? + marker.len();
    text[start..].split_whitespace().next()?.parse().ok()
}

fn csi_sanity(tools: &Tools, root: &Path, socket: &Path, extra: &[String]) -> SanityRun {
    let output = Command::new(tools.go("csi-sanity"))
        .arg(format!("--csi.endpoint={}", socket.display()))
        .arg(format!("--csi.mountdir={}", root.join("mnt").display()))
        .arg(format!(
            "--csi.stagingdir={}",
            root.join("staging").display()
        ))
        .arg("--ginkgo.no-color")
        .args(extra)
        .output()
        .expect("run csi-sanity");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let run = SanityRun {
        ran: number_after(&text, "Ran ").unwrap_or(0),
        passed: number_before(&text, " Passed").unwrap_or(0),
        failed: number_before(&text, " Failed").unwrap_or(usize::MAX),
        output: text,
    };
    assert_eq!(
        output.status.success(),
        run.failed == 0,
        "exit status and summary disagree:\n{}",
        run.output
    );
    run
}

/// Starts a driver with `args`, runs csi-sanity with `extra`, checks the result and that the
/// suite left no volume, loop device or mount behind.
async fn sanity(
    name: &str,
    driver_args: &[&str],
    emulated: bool,
    extra: Vec<String>,
    floor: usize,
) {
    let tools = Tools::locate().expect("tools");
    let root = tempfile::tempdir().expect("tempdir");
    let dirs = NodeDriverDirs::under(root.path());
    let group = ProcessGroup::new().expect("process group");
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
    let driver = node_driver::start(
        Path::new(env!("CARGO_BIN_EXE_pmem-csi")),
        args,
        &dirs,
        &group,
        &[],
    )
    .await
    .expect("driver starts");
    let run = csi_sanity(&tools, root.path(), &dirs.socket, &extra);
    driver.stop().await;
    println!(
        "{name}: csi-sanity ran {} specs, {} passed, {} failed",
        run.ran, run.passed, run.failed
    );
    assert_eq!(
        run.failed, 0,
        "{name}: csi-sanity failures:\n{}",
        run.output
    );
    assert!(
        run.ran >= floor,
        "{name}: csi-sanity ran {} specs, fewer than the recorded {floor}:\n{}",
        run.ran,
        run.output
    );
    assert_eq!(run.passed, run.ran, "{name}:\n{}", run.output);
    let leftovers = testenv::Leftovers::new(i32::MAX, root.path().to_path_buf()).find();
    assert!(leftovers.is_empty(), "{name}: left behind {leftovers:?}");
    let volumes: Vec<_> = std::fs::read_dir(&dirs.state)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        volumes.is_empty(),
        "{name}: volumes left in state: {volumes:?}"
    );
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

#[test]
fn summary_parsing() {
    let text = "Ran 41 of 92 Specs in 0.4 seconds\nSUCCESS! -- 41 Passed | 0 Failed | 1 Pending";
    assert_eq!(number_after(text, "Ran "), Some(41));
    assert_eq!(number_before(text, " Passed"), Some(41));
    assert_eq!(number_before(text, " Failed"), Some(0));
}
