//! Child processes of a testenv: one process group per testenv, guarded by a watchdog that kills
//! the group when the test process dies (a `static` testenv never runs `Drop`), plain components
//! and processes supervised the way kubelet restarts containers.

use std::ffi::OsString;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use backon::BackoffBuilder;
use rustix::process::{Pid, Signal};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// First restart delay of a supervised process (kubelet's CrashLoopBackOff, shortened).
pub const RESTART_BACKOFF_START: Duration = Duration::from_secs(1);
/// Longest restart delay of a supervised process.
pub const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// A process that ran this long before exiting restarts after the first delay again.
const BACKOFF_RESET_AFTER: Duration = Duration::from_secs(10);
/// How long a stopped process gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// What can go wrong starting or stopping processes.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The program could not be started.
    #[error("starting {name} ({program}): {source}")]
    Spawn {
        /// Component name.
        name: String,
        /// Program path.
        program: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The program (or the wrapper testenv starts it with) is not installed.
    #[error("starting {name}: program {program} not found; {hint}")]
    MissingProgram {
        /// Component name.
        name: String,
        /// The program that was not found.
        program: PathBuf,
        /// What installs it.
        hint: &'static str,
    },
    /// The log file could not be created.
    #[error("creating log file {path}: {source}")]
    Log {
        /// The log file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A signal could not be sent.
    #[error("signalling {what}: {source}")]
    Signal {
        /// The target.
        what: String,
        /// Why.
        source: rustix::io::Errno,
    },
    /// The process exited while it was expected to run.
    #[error("{name} exited ({status}); last lines of {log}:\n{tail}")]
    Exited {
        /// Component name.
        name: String,
        /// Exit status.
        status: String,
        /// Its log file.
        log: PathBuf,
        /// The last lines of the log.
        tail: String,
    },
}

/// A process group holding every child of one testenv, and the watchdog that leads it.
///
/// The watchdog is `sh` reading its stdin, a pipe whose only writer is this process: when this
/// process dies for any reason the read returns and the watchdog kills the whole group, itself
/// included.
#[derive(Debug)]
pub struct ProcessGroup {
    pgid: Pid,
    watchdog: std::process::Child,
}

impl ProcessGroup {
    /// Starts the watchdog, which becomes the leader of a new process group.
    pub fn new() -> Result<Self, ProcessError> {
        use std::os::unix::process::CommandExt;
        let watchdog = std::process::Command::new("sh")
            .args(["-c", "read -r _ ; kill -KILL 0"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|source| ProcessError::Spawn {
                name: "watchdog".into(),
                program: "sh".into(),
                source,
            })?;
        let pgid = Pid::from_raw(watchdog.id() as i32).ok_or_else(|| ProcessError::Spawn {
            name: "watchdog".into(),
            program: "sh".into(),
            source: std::io::Error::other("watchdog has pid 0"),
        })?;
        Ok(Self { pgid, watchdog })
    }

    /// The group's id (the watchdog's pid).
    pub fn id(&self) -> i32 {
        self.pgid.as_raw_nonzero().get()
    }

    /// Whether any process of the group still exists (zombies included).
    pub fn alive(&self) -> bool {
        group_alive(self.id())
    }

    /// Kills every process of the group and reaps the watchdog.
    pub fn kill_all(&mut self) {
        // ESRCH means the group is gone already, which is the goal.
        let _ = rustix::process::kill_process_group(self.pgid, Signal::KILL);
        let _ = self.watchdog.wait();
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Whether process group `pgid` has any member left.
pub fn group_alive(pgid: i32) -> bool {
    match Pid::from_raw(pgid) {
        Some(pid) => rustix::process::test_kill_process_group(pid).is_ok(),
        None => false,
    }
}

/// How to run one program.
#[derive(Clone, Debug)]
pub struct ProcessSpec {
    /// Name used in logs and errors (`etcd`, `node-1/pmem-csi`).
    pub name: String,
    /// The program.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment variables.
    pub env: Vec<(OsString, OsString)>,
    /// File receiving stdout and stderr, appended to across restarts.
    pub log: PathBuf,
    /// A directory to mount a tmpfs on, in a mount namespace of the process's own: the mount
    /// cannot outlive the process, whatever happens to the test.
    pub private_tmpfs: Option<PathBuf>,
    /// Run under `SCHED_IDLE` (through `chrt --idle 0`, inherited by every thread): the process
    /// gets a CPU only when nothing else wants it.
    pub idle_priority: bool,
}

impl ProcessSpec {
    /// A spec for `program` logging to `log`.
    pub fn new(
        name: impl Into<String>,
        program: impl Into<PathBuf>,
        log: impl Into<PathBuf>,
    ) -> Self {
        Self {
            name: name.into(),
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            log: log.into(),
            private_tmpfs: None,
            idle_priority: false,
        }
    }

    /// Runs the process under `SCHED_IDLE` when `idle`.
    pub fn idle_priority(mut self, idle: bool) -> Self {
        self.idle_priority = idle;
        self
    }

    /// Runs the process in its own mount namespace with a tmpfs on `dir`.
    pub fn private_tmpfs(mut self, dir: impl Into<PathBuf>) -> Self {
        self.private_tmpfs = Some(dir.into());
        self
    }

    /// Appends arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets an environment variable.
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    fn spawn(&self, group: i32) -> Result<Child, ProcessError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|source| ProcessError::Log {
                path: self.log.clone(),
                source,
            })?;
        let log_err = log.try_clone().map_err(|source| ProcessError::Log {
            path: self.log.clone(),
            source,
        })?;
        let (program, args): (&std::ffi::OsStr, Vec<&std::ffi::OsStr>) = if self.idle_priority {
            let mut args = vec!["--idle".as_ref(), "0".as_ref(), self.program.as_os_str()];
            args.extend(self.args.iter().map(OsString::as_os_str));
            ("chrt".as_ref(), args)
        } else {
            (
                self.program.as_os_str(),
                self.args.iter().map(OsString::as_os_str).collect(),
            )
        };
        let mut command = match &self.private_tmpfs {
            None => {
                let mut c = Command::new(program);
                c.args(&args);
                c
            }
            Some(dir) => {
                // `--propagation private` keeps the tmpfs out of the parent namespace; the
                // namespace, and with it the mount, ends with the process.
                let mut c = Command::new("unshare");
                c.args(["--mount", "--propagation", "private", "--", "sh", "-c"])
                    .arg(r#"mount -t tmpfs -o mode=0700 tmpfs "$1" && shift && exec "$@""#)
                    .arg("sh")
                    .arg(dir)
                    .arg(program)
                    .args(&args);
                c
            }
        };
        command
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .process_group(group)
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| ProcessError::spawn(&self.name, Path::new(program), source))
    }

    /// The last `lines` lines of the log, for error messages.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }
}

impl ProcessError {
    /// Starting `program` for component `name` failed: a program that is not there is named
    /// with what installs it (the wrapper `chrt` or `unshare`, not the component, may be missing).
    pub fn spawn(name: &str, program: &Path, source: std::io::Error) -> Self {
        if source.kind() != std::io::ErrorKind::NotFound {
            return ProcessError::Spawn {
                name: name.to_string(),
                program: program.to_path_buf(),
                source,
            };
        }
        ProcessError::MissingProgram {
            name: name.to_string(),
            program: program.to_path_buf(),
            hint: missing_hint(program),
        }
    }
}

/// What installs `program` when it is not found.
fn missing_hint(program: &Path) -> &'static str {
    match program.file_name().and_then(|n| n.to_str()) {
        Some("chrt" | "unshare" | "losetup" | "nsenter") => {
            "it is in package util-linux, which `just ensure` installs"
        }
        Some("sh") => "it is in package dash, which `just ensure` installs",
        Some("pmem-csi") => "build it with `cargo build` (or set PMEM_CSI_BIN)",
        _ => "build the pinned tools with `just tools`, which also installs missing packages",
    }
}

/// The last `lines` lines of a file (at most its last 64 KiB are read).
pub fn tail(path: &Path, lines: usize) -> String {
    let Ok(mut file) = File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut text = String::new();
    let mut buf = Vec::new();
    if file.read_to_end(&mut buf).is_ok() {
        text = String::from_utf8_lossy(&buf).into_owned();
    }
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A control-plane process: started once, expected to run until teardown.
#[derive(Debug)]
pub struct Component {
    spec: ProcessSpec,
    child: Child,
}

impl Component {
    /// Starts `spec` in `group`.
    pub fn start(spec: ProcessSpec, group: &ProcessGroup) -> Result<Self, ProcessError> {
        let child = spec.spawn(group.id())?;
        Ok(Self { spec, child })
    }

    /// The spec it was started from.
    pub fn spec(&self) -> &ProcessSpec {
        &self.spec
    }

    /// Its pid, while it has not been reaped.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// An error if the process has exited, with the end of its log.
    pub fn check_running(&mut self) -> Result<(), ProcessError> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(ProcessError::Exited {
                name: self.spec.name.clone(),
                status: status.to_string(),
                log: self.spec.log.clone(),
                tail: self.spec.log_tail(20),
            }),
            Err(e) => Err(ProcessError::Exited {
                name: self.spec.name.clone(),
                status: e.to_string(),
                log: self.spec.log.clone(),
                tail: self.spec.log_tail(20),
            }),
        }
    }

    /// Sends SIGTERM and waits up to the stop grace before SIGKILL.
    pub async fn stop(mut self) {
        terminate(&mut self.child, &self.spec.name).await;
    }

    /// Stops it as [`Component::stop`] does and starts it again from the same spec in
    /// process group `group` (fault-injection tests: an apiserver or etcd restart).
    pub async fn restart(&mut self, group: i32) -> Result<(), ProcessError> {
        terminate(&mut self.child, &self.spec.name).await;
        self.child = self.spec.spawn(group)?;
        Ok(())
    }
}

async fn terminate(child: &mut Child, name: &str) {
    if let Some(pid) = child.id().and_then(|p| Pid::from_raw(p as i32)) {
        let _ = rustix::process::kill_process(pid, Signal::TERM);
        if tokio::time::timeout(STOP_GRACE, child.wait()).await.is_ok() {
            return;
        }
        tracing::warn!(name, "did not stop within {STOP_GRACE:?}, killing");
    }
    let _ = child.kill().await;
}

/// Observable state of a supervised process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SupervisedState {
    /// Pid of the running instance, if one runs.
    pub pid: Option<u32>,
    /// How often it was restarted after exiting.
    pub restarts: u32,
    /// Whether it was stopped for good.
    pub stopped: bool,
}

/// A process restarted with back-off whenever it exits, as kubelet restarts a container, until
/// it is stopped for good.
#[derive(Debug)]
pub struct Supervised {
    name: String,
    state: watch::Receiver<SupervisedState>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Supervised {
    /// Starts supervising `spec` in `group` on the current tokio runtime; cancelling
    /// `shutdown` stops it as [`Supervised::stop`] does.
    pub fn start(spec: ProcessSpec, group: &ProcessGroup, shutdown: &CancellationToken) -> Self {
        let (tx, state) = watch::channel(SupervisedState::default());
        let stop = shutdown.child_token();
        let name = spec.name.clone();
        let task = tokio::spawn(supervise(spec, group.id(), tx, stop.clone()));
        Self {
            name,
            state,
            stop,
            task,
        }
    }

    /// The process's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The current state.
    pub fn state(&self) -> SupervisedState {
        self.state.borrow().clone()
    }

    /// Sends `signal` to the running instance (for tests that crash a process).
    pub fn signal(&self, signal: Signal) -> Result<(), ProcessError> {
        let pid = self
            .state()
            .pid
            .and_then(|p| Pid::from_raw(p as i32))
            .ok_or_else(|| ProcessError::Signal {
                what: self.name.clone(),
                source: rustix::io::Errno::SRCH,
            })?;
        rustix::process::kill_process(pid, signal).map_err(|source| ProcessError::Signal {
            what: self.name.clone(),
            source,
        })
    }

    /// Waits until a running instance satisfies `pred`, or `timeout` passes.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        pred: impl Fn(&SupervisedState) -> bool,
    ) -> Option<SupervisedState> {
        let mut rx = self.state.clone();
        let found = tokio::time::timeout(timeout, rx.wait_for(|s| pred(s))).await;
        match found {
            Ok(Ok(state)) => Some(state.clone()),
            _ => None,
        }
    }

    /// Stops the process for good: SIGTERM, then SIGKILL after a grace period. When this
    /// returns, the supervisor has ended, so nothing can start the process again.
    pub async fn stop(self) -> SupervisedState {
        self.stop.cancel();
        // The supervisor only ends by this token; a panic inside it is a testenv bug.
        if let Err(e) = self.task.await {
            tracing::error!(name = self.name, "supervisor task failed: {e}");
        }
        self.state.borrow().clone()
    }
}

async fn supervise(
    spec: ProcessSpec,
    group: i32,
    state: watch::Sender<SupervisedState>,
    stop: CancellationToken,
) {
    // kubelet's CrashLoopBackOff, shortened: doubling from the start to the maximum.
    let schedule = || {
        backon::ExponentialBuilder::new()
            .with_min_delay(RESTART_BACKOFF_START)
            .with_max_delay(RESTART_BACKOFF_MAX)
            .with_factor(2.0)
            .without_max_times()
            .build()
    };
    let mut delays = schedule();
    let mut backoff = delays.next().unwrap_or(RESTART_BACKOFF_MAX);
    loop {
        let started = Instant::now();
        let outcome = match spec.spawn(group) {
            Ok(mut child) => {
                let pid = child.id();
                state.send_modify(|s| s.pid = pid);
                tracing::debug!(name = spec.name, ?pid, "started");
                tokio::select! {
                    status = child.wait() => {
                        state.send_modify(|s| s.pid = None);
                        match status {
                            Ok(status) => status.to_string(),
                            Err(e) => e.to_string(),
                        }
                    }
                    _ = stop.cancelled() => {
                        terminate(&mut child, &spec.name).await;
                        break;
                    }
                }
            }
            Err(e) => e.to_string(),
        };
        if started.elapsed() >= BACKOFF_RESET_AFTER {
            delays = schedule();
            backoff = delays.next().unwrap_or(RESTART_BACKOFF_MAX);
        }
        tracing::warn!(
            name = spec.name,
            outcome,
            ?backoff,
            "process exited, restarting after back-off"
        );
        append_marker(
            &spec.log,
            &format!(
                "testenv: {} exited ({outcome}), restarting in {backoff:?}",
                spec.name
            ),
        );
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.cancelled() => break,
        }
        backoff = delays.next().unwrap_or(RESTART_BACKOFF_MAX);
        state.send_modify(|s| s.restarts += 1);
    }
    state.send_modify(|s| {
        s.pid = None;
        s.stopped = true;
    });
    append_marker(&spec.log, &format!("testenv: {} stopped", spec.name));
}

fn append_marker(log: &Path, line: &str) {
    use std::io::Write;
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(log)
    {
        let _ = writeln!(f, "{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_returns_last_lines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log");
        std::fs::write(&path, "a\nb\nc\nd\n").expect("write");
        assert_eq!(tail(&path, 2), "c\nd");
        assert_eq!(tail(&path, 10), "a\nb\nc\nd");
        assert!(tail(&dir.path().join("missing"), 2).starts_with("(no log at"));
    }

    #[test]
    fn a_missing_program_is_named_with_what_installs_it() {
        let not_found = || std::io::Error::from(std::io::ErrorKind::NotFound);
        for (program, want) in [
            (
                "chrt",
                "starting etcd: program chrt not found; it is in package util-linux, which `just ensure` installs",
            ),
            (
                "/cache/bin/etcd",
                "starting etcd: program /cache/bin/etcd not found; build the pinned tools with `just tools`, which also installs missing packages",
            ),
            (
                "/target/debug/pmem-csi",
                "starting etcd: program /target/debug/pmem-csi not found; build it with `cargo build` (or set PMEM_CSI_BIN)",
            ),
        ] {
            let e = ProcessError::spawn("etcd", Path::new(program), not_found());
            assert_eq!(e.to_string(), want);
        }
        let denied = ProcessError::spawn(
            "etcd",
            Path::new("/bin/etcd"),
            std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        );
        assert!(matches!(denied, ProcessError::Spawn { .. }), "{denied}");
    }

    #[tokio::test]
    async fn idle_priority_reaches_the_program_and_its_threads() {
        let group = ProcessGroup::new().expect("group");
        let dir = tempfile::tempdir().expect("tempdir");
        for (idle, want) in [(true, "SCHED_IDLE"), (false, "SCHED_OTHER")] {
            let log = dir.path().join(format!("{idle}.log"));
            // The program itself and a child it forks both report their policy.
            let script = "chrt -p $$; sh -c 'chrt -p $$'; echo done";
            let _shell = Component::start(
                ProcessSpec::new("sh", "sh", &log)
                    .args(["-c", script])
                    .idle_priority(idle),
                &group,
            )
            .expect("start");
            let text = crate::wait::until("the script to finish", Duration::from_secs(20), || {
                let log = log.clone();
                async move {
                    let text = std::fs::read_to_string(&log).map_err(|e| e.to_string())?;
                    text.contains("done")
                        .then_some(text)
                        .ok_or("not done yet".to_string())
                }
            })
            .await
            .expect("script output");
            let policies: Vec<&str> = text.lines().filter(|l| l.contains("policy")).collect();
            assert_eq!(policies.len(), 2, "{text}");
            assert!(
                policies.iter().all(|l| l.contains(want)),
                "idle={idle}: {text}"
            );
        }
    }

    #[tokio::test]
    async fn group_dies_with_kill_all() {
        let mut group = ProcessGroup::new().expect("group");
        let dir = tempfile::tempdir().expect("tempdir");
        let sleeper = Component::start(
            ProcessSpec::new("sleep", "sleep", dir.path().join("sleep.log")).args(["600"]),
            &group,
        )
        .expect("start");
        assert!(group.alive());
        group.kill_all();
        sleeper.stop().await; // reaps the killed child
        let deadline = Instant::now() + Duration::from_secs(10);
        while group.alive() && Instant::now() < deadline {
            tokio::task::yield_now().await;
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            !group.alive(),
            "process group {} still has members",
            group.id()
        );
    }
}
