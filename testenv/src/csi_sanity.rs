//! csi-sanity, the upstream CSI conformance suite, against a running `pmem-csi node`: one run,
//! its summary, and the checks every configuration shares (zero failures, never fewer specs than
//! recorded, nothing left behind). Used on the host (emulated, fake) and in the QEMU guest (lvm,
//! direct).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::Tools;
use crate::node_driver::{self, NodeDriverDirs};
use crate::process::ProcessGroup;

/// The outcome of one csi-sanity run.
#[derive(Debug)]
pub struct SanityRun {
    /// Specs run.
    pub ran: usize,
    /// Specs passed.
    pub passed: usize,
    /// Specs failed (`usize::MAX` when the summary is missing).
    pub failed: usize,
    /// Everything it printed.
    pub output: String,
}

fn number_before(text: &str, marker: &str) -> Option<usize> {
    let end = text.find(marker)?;
    text[..end].split_whitespace().last()?.parse().ok()
}

fn number_after(text: &str, marker: &str) -> Option<usize> {
    let start = text.find(marker)? + marker.len();
    text[start..].split_whitespace().next()?.parse().ok()
}

/// Runs csi-sanity against `socket` with its mount and staging directories under `root`.
pub fn run(tools: &Tools, root: &Path, socket: &Path, extra: &[String]) -> SanityRun {
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
    // The counts come from ginkgo's summary line: a failure's report earlier in the output may
    // also say "Failed".
    let summary = text
        .lines()
        .rev()
        .find(|l| l.starts_with("SUCCESS!") || l.starts_with("FAIL!"))
        .unwrap_or("")
        .to_string();
    let run = SanityRun {
        ran: number_after(&text, "Ran ").unwrap_or(0),
        passed: number_before(&summary, " Passed").unwrap_or(0),
        failed: number_before(&summary, " Failed").unwrap_or(usize::MAX),
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

/// Starts `binary` as a node driver with `args` (in `dirs`, under `root`), runs csi-sanity
/// with `extra`, and checks: zero failures, at least `floor` specs, all passed, no loop device
/// or mount left under `root`, no volume left in the state directory.
pub async fn check(
    binary: &Path,
    name: &str,
    root: &Path,
    dirs: &NodeDriverDirs,
    args: Vec<String>,
    extra: &[String],
    floor: usize,
) {
    let tools = Tools::locate().expect("tools");
    let group = ProcessGroup::new().expect("process group");
    let driver = node_driver::start(binary, args, dirs, &group, &[])
        .await
        .expect("driver starts");
    let run = run(&tools, root, &dirs.socket, extra);
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
    let leftovers = crate::Leftovers::new(i32::MAX, root.to_path_buf()).find();
    assert!(leftovers.is_empty(), "{name}: left behind {leftovers:?}");
    let volumes: Vec<PathBuf> = std::fs::read_dir(&dirs.state)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(
        volumes.is_empty(),
        "{name}: volumes left in state: {volumes:?}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_parsing() {
        let text =
            "Ran 41 of 92 Specs in 0.4 seconds\nSUCCESS! -- 41 Passed | 0 Failed | 1 Pending";
        assert_eq!(number_after(text, "Ran "), Some(41));
        assert_eq!(number_before(text, " Passed"), Some(41));
        assert_eq!(number_before(text, " Failed"), Some(0));
        assert_eq!(number_before("no summary", " Failed"), None);
    }
}
