//! A testenv leaves nothing behind: not after a graceful stop, and not when the test process
//! is killed (the watchdog takes the process group down).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use testenv::{Leftovers, ProcessSpec, TestEnv};

const CLEAN_WITHIN: Duration = Duration::from_secs(20);

#[tokio::test]
async fn graceful_stop_leaves_nothing() {
    let env = TestEnv::builder().nodes(1).start().await.expect("testenv");
    let supervised =
        env.supervise(ProcessSpec::new("teardown/sleep", "sleep", "sleep.log").args(["600"]));
    supervised
        .wait_for(Duration::from_secs(10), |s| s.pid.is_some())
        .await
        .expect("supervised sleep runs");
    let dir = env.dir().to_path_buf();
    let leftovers = env.stop().await;
    let remaining = leftovers.wait_clean(CLEAN_WITHIN).await;
    assert!(remaining.is_empty(), "left behind: {remaining:?}");
    assert!(
        !dir.exists(),
        "work directory {} not removed",
        dir.display()
    );
}

/// What `killed_owner_leaves_no_process_or_mount` kills: this test binary, running only
/// [`owner_process`], which holds a testenv with a node driver and waits forever.
#[tokio::test]
#[ignore = "run in a child process by killed_owner_leaves_no_process_or_mount"]
async fn owner_process() {
    let env = TestEnv::builder()
        .nodes(1)
        .drivers(testenv::node_processes::DriverOptions::default())
        .start()
        .await
        .expect("testenv");
    println!("work dir: {}", env.dir().display());
    println!("process group: {}", env.process_group_id());
    std::future::pending::<()>().await;
}

/// A process holding a testenv is SIGKILLed, as a test harness could be killed: the watchdog
/// must take every process and mount of its testenv with it.
#[test]
fn killed_owner_leaves_no_process_or_mount() {
    let mut owner = Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "owner_process",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the owner process");
    let stdout = owner.stdout.take().expect("stdout");
    let mut pgid = None;
    let mut dir = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("read the owner's output");
        // libtest writes "test owner_process ... " in front of the owner's first line.
        if let Some((_, v)) = line.split_once("process group: ") {
            pgid = v.trim().parse::<i32>().ok();
            break;
        }
        if let Some((_, v)) = line.split_once("work dir:") {
            dir = Some(PathBuf::from(v.trim()));
        }
    }
    let (pgid, dir) = match (pgid, dir) {
        (Some(p), Some(d)) => (p, d),
        other => {
            let _ = owner.kill();
            panic!("the owner did not print its process group and work dir: {other:?}");
        }
    };
    let leftovers = Leftovers::new(pgid, dir.clone());
    assert!(
        !leftovers.find().is_empty(),
        "the testenv should be running before the kill"
    );
    owner.kill().expect("SIGKILL the owner");
    owner.wait().expect("reap the owner");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let remaining = runtime.block_on(leftovers.wait_clean(CLEAN_WITHIN));
    assert!(
        remaining.is_empty(),
        "left behind after SIGKILL: {remaining:?}"
    );
    // The directory itself remains (nobody ran the teardown); the next testenv removes it.
    testenv::leftovers::remove_stale_work_dirs(&std::env::temp_dir());
    assert!(
        !dir.exists(),
        "stale work directory {} not removed",
        dir.display()
    );
}
