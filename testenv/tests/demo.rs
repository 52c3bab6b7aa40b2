//! `just demo` end to end: the transcript of `demo --exit-after-demo` has a line for every step
//! of every example pod, and its numbers agree with each other (the extender's node is the PV's
//! and the pod's; CreateVolume durations from the driver's log add up to its histogram); and a
//! demo stopped by SIGINT leaves no process, mount, loop device or directory behind.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const DRIVER: &str = "pmem-csi.intel.com";
const PODS: [&str; 4] = [
    "pmem-csi-app-ext4",
    "pmem-csi-app-block",
    "pmem-csi-app-inline",
    "pmem-csi-app-generic-ephemeral",
];
/// Pods whose volumes are claims (the inline one has none).
const CLAIMS: [(&str, &str); 3] = [
    ("pmem-csi-app-ext4", "pmem-csi-pvc-ext4"),
    ("pmem-csi-app-block", "pmem-csi-pvc-block"),
    (
        "pmem-csi-app-generic-ephemeral",
        "pmem-csi-app-generic-ephemeral-scratch",
    ),
];

/// One transcript line: `[  12.3s] step      text`.
fn parse(line: &str) -> Option<(&str, &str)> {
    let rest = line.strip_prefix('[')?;
    let (_, rest) = rest.split_once("s] ")?;
    let (step, text) = rest.trim_start().split_once(' ')?;
    Some((step, text.trim_start()))
}

#[derive(Default, Debug)]
struct PodSteps {
    webhook: Option<String>,
    extender_node: Option<String>,
    pvs: Vec<(String, String)>,
    creates: usize,
    mounts: usize,
    running_node: Option<String>,
}

fn word_after<'a>(text: &'a str, marker: &str) -> Option<&'a str> {
    text.split_once(marker)?.1.split_whitespace().next()
}

#[tokio::test]
async fn transcript_names_every_step_and_its_numbers_agree() {
    let output = tokio::time::timeout(
        Duration::from_secs(600),
        Command::new(env!("CARGO_BIN_EXE_demo"))
            .arg("--exit-after-demo")
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("the demo finishes")
    .expect("the demo runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "demo failed:\n{stdout}\n{stderr}");
    println!("{stdout}");

    let mut pods: BTreeMap<String, PodSteps> = BTreeMap::new();
    let mut current = String::new();
    // node -> (sum of CreateVolume durations, count) from the transcript, and the histogram.
    let mut creates: BTreeMap<String, (f64, u64)> = BTreeMap::new();
    let mut histograms: BTreeMap<String, (f64, u64)> = BTreeMap::new();
    let mut applied = 0;
    let mut stopped = false;
    for (step, text) in stdout.lines().filter_map(parse) {
        let pod_of = |t: &str| {
            t.split(':')
                .next()
                .and_then(|p| p.strip_prefix("demo/"))
                .map(str::to_string)
        };
        match step {
            "apply" => applied += 1,
            "webhook" => {
                let pod = pod_of(text).expect("pod in webhook line");
                pods.entry(pod.clone()).or_default().webhook = Some(text.to_string());
                current = pod;
            }
            "extender" => {
                let pod = pod_of(text).expect("pod in extender line");
                let node = word_after(text, "chose ").expect("chosen node");
                pods.entry(pod).or_default().extender_node = Some(node.to_string());
            }
            "pv" => {
                let node = word_after(text, "pinned to ").expect("pinned node");
                let claim = text
                    .strip_prefix("demo/")
                    .and_then(|t| t.split_whitespace().next())
                    .expect("claim");
                pods.entry(current.clone())
                    .or_default()
                    .pvs
                    .push((claim.to_string(), node.to_string()));
            }
            "create" => {
                let node = text.split_whitespace().next().expect("node").to_string();
                let seconds: f64 = text
                    .rsplit(": ")
                    .next()
                    .and_then(|t| t.strip_suffix(" s"))
                    .and_then(|t| t.parse().ok())
                    .expect("duration");
                let entry = creates.entry(node).or_default();
                entry.0 += seconds;
                entry.1 += 1;
                pods.entry(current.clone()).or_default().creates += 1;
            }
            "mount" => {
                let pod = text
                    .split_whitespace()
                    .nth(1)
                    .and_then(|p| p.strip_prefix("demo/"))
                    .expect("pod in mount line");
                assert!(text.contains("NodePublishVolume"), "{text}");
                pods.entry(pod.to_string()).or_default().mounts += 1;
            }
            "running" => {
                let pod = text
                    .split_whitespace()
                    .next()
                    .and_then(|p| p.strip_prefix("demo/"))
                    .expect("pod in running line");
                let node = word_after(text, " on ").expect("node");
                pods.entry(pod.to_string()).or_default().running_node =
                    Some(node.trim_end_matches(',').to_string());
            }
            "histogram" => {
                let node = text.split_whitespace().next().expect("node").to_string();
                let count: u64 = word_after(text, "count ")
                    .and_then(|c| c.trim_end_matches(',').parse().ok())
                    .expect("count");
                let sum: f64 = word_after(text, "sum ")
                    .and_then(|s| s.parse().ok())
                    .expect("sum");
                histograms.insert(node, (sum, count));
            }
            "stopped" => stopped = text.contains("nothing left behind"),
            _ => {}
        }
    }

    assert_eq!(applied, 4, "one apply line per example");
    for pod in PODS {
        let steps = pods
            .get(pod)
            .unwrap_or_else(|| panic!("no lines for {pod}"));
        let webhook = steps.webhook.as_deref().unwrap_or_default();
        assert!(
            webhook.contains(&format!("requests {DRIVER}/scheduler=1")),
            "{pod}: the webhook marked it: {webhook:?}"
        );
        let node = steps
            .extender_node
            .clone()
            .unwrap_or_else(|| panic!("{pod}: no extender line"));
        assert_eq!(
            steps.running_node.as_deref(),
            Some(node.as_str()),
            "{pod} runs where the extender put it"
        );
        assert!(steps.mounts >= 1, "{pod}: a stage/publish line");
    }
    for (pod, claim) in CLAIMS {
        let steps = &pods[pod];
        let node = steps.extender_node.clone().unwrap_or_default();
        assert_eq!(
            steps.pvs,
            vec![(claim.to_string(), node.clone())],
            "{pod}: the PV's node affinity is the extender's node"
        );
        assert_eq!(steps.creates, 1, "{pod}: one CreateVolume line");
    }
    assert!(!histograms.is_empty(), "histogram lines");
    for (node, (sum, count)) in &histograms {
        let (logged, logged_count) = creates.get(node).copied().unwrap_or_default();
        assert_eq!(
            *count, logged_count,
            "{node}: CreateVolume calls in the histogram vs the transcript"
        );
        // The transcript rounds each duration to 0.1 ms.
        assert!(
            (sum - logged).abs() <= 0.0001 * (*count as f64) + 1e-9,
            "{node}: histogram sum {sum} s vs transcript {logged} s"
        );
    }
    assert!(stopped, "the demo says it left nothing behind");
}

#[tokio::test]
async fn sigint_leaves_nothing_behind() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_demo"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("the demo starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut group = None;
    let mut logs = None;
    let waiting = async {
        while let Some(line) = lines.next_line().await.expect("read") {
            if let Some(g) = line.trim().strip_prefix("process group: ") {
                group = g.trim().parse::<i32>().ok();
            }
            if let Some(l) = line.trim().strip_prefix("logs:") {
                logs = Some(PathBuf::from(l.trim()));
            }
            if line.contains("Press Ctrl-C") {
                return true;
            }
        }
        false
    };
    let up = tokio::time::timeout(Duration::from_secs(600), waiting)
        .await
        .expect("the demo gets to waiting for Ctrl-C");
    assert!(up, "the demo ended before waiting for Ctrl-C");
    let group = group.expect("the demo prints its process group");
    let dir = logs
        .and_then(|l| l.parent().map(PathBuf::from))
        .expect("the demo prints its work directory");
    let pid = rustix::process::Pid::from_raw(child.id().expect("pid") as i32).expect("pid");
    rustix::process::kill_process(pid, rustix::process::Signal::INT).expect("SIGINT");
    // Drain stdout so the demo never blocks writing its last lines.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let status = tokio::time::timeout(Duration::from_secs(120), child.wait())
        .await
        .expect("the demo exits after SIGINT")
        .expect("wait");
    assert!(status.success(), "demo exit status {status}");
    let left = testenv::Leftovers::new(group, dir.clone())
        .wait_clean(Duration::from_secs(10))
        .await;
    assert!(left.is_empty(), "left behind: {left:?}");
    assert!(!dir.exists(), "{} removed", dir.display());
}
