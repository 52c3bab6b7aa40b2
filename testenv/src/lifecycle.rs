//! How a [`TestEnv`] ends: shared by a test binary until the process exits, stopped
//! gracefully, or dropped by a failing test, whose logs it keeps.

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::{Leftovers, TestEnv, TestEnvBuilder};

impl TestEnv {
    /// A shared testenv for all tests of one test binary, started on first use with
    /// `configure` on a runtime of its own (each `#[tokio::test]` has its own runtime, which
    /// ends with the test). Its processes die with the test process through the watchdog.
    pub fn shared(configure: fn() -> TestEnvBuilder) -> &'static TestEnv {
        static SHARED: OnceLock<TestEnv> = OnceLock::new();
        SHARED.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name("testenv".into())
                .spawn(move || {
                    let runtime = match tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(2)
                        .enable_all()
                        .build()
                    {
                        Ok(r) => r,
                        Err(e) => {
                            let _ = tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                    let env = runtime.block_on(configure().start());
                    let _ = tx.send(env.map_err(|e| e.to_string()));
                    // Keep the runtime, and the supervisors on it, alive for the process.
                    runtime.block_on(std::future::pending::<()>());
                })
                .unwrap_or_else(|e| panic!("spawning the testenv thread: {e}"));
            match rx.recv() {
                Ok(Ok(env)) => env,
                Ok(Err(e)) => panic!("starting the shared testenv: {e}"),
                Err(e) => panic!("the testenv thread died: {e}"),
            }
        })
    }

    /// Stops every process gracefully, kills what remains of the group and removes the work
    /// directory. Returns what to check for leftovers.
    pub async fn stop(mut self) -> Leftovers {
        if let Some(kubelet) = self.kubelet.take() {
            // Unmounted while the drivers still serve, so no mount or loop device outlives them.
            kubelet
                .unmount_all(std::time::Duration::from_secs(30))
                .await;
        }
        let processes = std::mem::take(&mut *self.running_node_processes());
        for p in processes {
            // Provisioners first, so nothing provisions against a stopping driver.
            p.provisioner.stop().await;
            p.driver.stop().await;
        }
        if let Some(extender) = self.take_extender() {
            extender.stop().await;
        }
        if let Some(controller) = self.take_controller() {
            controller.stop().await;
        }
        self.shutdown.cancel();
        if let Some(control_plane) = self.control_plane.take() {
            control_plane.stop().await;
        }
        self.group.kill_all();
        let leftovers = Leftovers::new(self.group.id(), self.dir.path().to_path_buf());
        if let Err(e) = std::fs::remove_dir_all(self.dir.path()) {
            tracing::warn!(dir = %self.dir.path().display(), "removing the work directory: {e}");
        }
        leftovers
    }

    /// Copies the logs to `<tmp>/<name>-<pid>`, which outlives the work directory (for a failure
    /// found after the testenv is no longer needed); the copy's path, if it worked.
    pub fn keep_logs(&self, name: &str) -> Option<PathBuf> {
        let kept = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        std::process::Command::new("cp")
            .arg("-a")
            .arg(self.dir().join("logs"))
            .arg(&kept)
            .status()
            .is_ok_and(|s| s.success())
            .then_some(kept)
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        // A failing test drops the testenv without `stop`; its logs are what explains the
        // failure, so they are kept and their place printed.
        if std::thread::panicking() {
            let logs = self.dir.path().join("logs");
            let kept = std::env::temp_dir().join(format!(
                "pmem-csi-failed-{}-{}",
                std::process::id(),
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis())
            ));
            if std::fs::rename(&logs, &kept).is_ok() {
                eprintln!("testenv logs kept in {}", kept.display());
            }
        }
    }
}
