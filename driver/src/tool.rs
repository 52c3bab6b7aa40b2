//! Running the standard PMEM and LVM tools (`ndctl`, `lvm`, `wipefs`): one place that turns a
//! failed run into an error naming the command, its exit status and what it printed.

use std::ffi::OsStr;
use std::os::unix::process::CommandExt;
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use crate::program::MissingProgram;

/// A tool run that failed.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// The program is not installed.
    #[error(transparent)]
    Missing(MissingProgram),
    /// The program could not be started.
    #[error("running {command}: {source}")]
    Spawn {
        /// The command line.
        command: String,
        /// Why.
        source: std::io::Error,
    },
    /// The program did not finish in time; it and its children were killed.
    #[error("{command} did not finish within {after:?} and was killed (--tool-timeout)")]
    TimedOut {
        /// The command line.
        command: String,
        /// The timeout.
        after: Duration,
    },
    /// The program exited unsuccessfully.
    #[error("{command} failed ({status}): {stderr}")]
    Failed {
        /// The command line.
        command: String,
        /// Exit status as text.
        status: String,
        /// What it printed on stderr (trimmed).
        stderr: String,
    },
}

impl ToolError {
    /// What the tool printed on stderr; empty when it did not run.
    pub fn stderr(&self) -> &str {
        match self {
            ToolError::Missing(_) | ToolError::Spawn { .. } | ToolError::TimedOut { .. } => "",
            ToolError::Failed { stderr, .. } => stderr,
        }
    }
}

/// How long one tool run may take before it is killed, unless `--tool-timeout` set it. A hung
/// `lvcreate` or `ndctl` would otherwise hold the backend's lock, and with it every volume
/// operation of the node, for ever.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

// Set once at start from the node's configuration (`--tool-timeout`); the tools run deep inside
// the backends, and threading one duration through every call would touch them all.
static TIMEOUT: OnceLock<Duration> = OnceLock::new();

/// Sets the timeout of every tool run; the first call wins.
pub fn set_timeout(timeout: Duration) {
    let _ = TIMEOUT.set(timeout);
}

fn timeout() -> Duration {
    TIMEOUT.get().copied().unwrap_or(DEFAULT_TIMEOUT)
}

/// Runs `program` with `args`, returning its standard output.
pub fn run(program: &str, args: &[&str]) -> Result<String, ToolError> {
    let command = || format!("{program} {}", args.join(" "));
    let out = output(program, args)?;
    if !out.status.success() {
        return Err(ToolError::Failed {
            command: command(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `program` with `args` under the tool timeout and returns what it printed and its exit
/// status, whatever that is (callers that read exit codes, such as blkid's 2 for "nothing
/// found", judge it themselves).
pub fn output<S: AsRef<OsStr>>(program: &str, args: &[S]) -> Result<Output, ToolError> {
    run_within(program, args, timeout())
}

fn run_within<S: AsRef<OsStr>>(
    program: &str,
    args: &[S],
    timeout: Duration,
) -> Result<Output, ToolError> {
    let command = || {
        let args: Vec<_> = args
            .iter()
            .map(|a| a.as_ref().to_string_lossy().into_owned())
            .collect();
        format!("{program} {}", args.join(" "))
    };
    tracing::debug!(command = command(), "running");
    let child = Command::new(program)
        .args(args)
        // LVM warns about every file descriptor it inherits; the driver's sockets are not its
        // business, and its locale must not change the output we parse.
        .env("LVM_SUPPRESS_FD_WARNINGS", "1")
        // In a container no udev answers LVM's requests to create /dev/<vg>/<lv> (lvcreate
        // would succeed and the path never appear); libdevmapper then creates the nodes itself.
        // Where the host's udev also runs, the nodes it makes are the same.
        .env("DM_DISABLE_UDEV", "1")
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so that a timeout kills what it started too.
        .process_group(0)
        .spawn()
        .map_err(
            |source| match MissingProgram::from_spawn(program, &source) {
                Some(missing) => ToolError::Missing(missing),
                None => ToolError::Spawn {
                    command: command(),
                    source,
                },
            },
        )?;
    let group = rustix::process::Pid::from_child(&child);
    let (done, finished) = std::sync::mpsc::channel();
    // wait_with_output drains both pipes while waiting; the thread ends when the tool does,
    // which the kill below guarantees.
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match finished.recv_timeout(timeout) {
        Ok(result) => result.map_err(|source| ToolError::Spawn {
            command: command(),
            source,
        }),
        Err(_) => {
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
            // Reaped by the thread; waiting here keeps no zombie and no open pipe behind.
            let _ = finished.recv();
            tracing::error!(
                command = command(),
                ?timeout,
                "tool timed out and was killed"
            );
            Err(ToolError::TimedOut {
                command: command(),
                after: timeout,
            })
        }
    }
}

/// What `tool` printed in a recorded run, `testdata/<tool>/<name>`: the parsers and error
/// classifiers are tested against real output of the real tools.
#[cfg(test)]
pub(crate) fn recorded(tool: &str, name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata")
        .join(tool)
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_name_the_command_and_carry_stderr() {
        let err = run("sh", &["-c", "echo oops >&2; exit 3"]).expect_err("fails");
        assert_eq!(err.stderr(), "oops");
        let text = err.to_string();
        assert!(
            text.contains("sh -c") && text.contains("exit status: 3"),
            "{text}"
        );
        assert_eq!(run("sh", &["-c", "echo fine"]).expect("runs"), "fine\n");
        let err = run("/nonexistent/tool", &[]).expect_err("missing");
        assert!(
            matches!(&err, ToolError::Missing(m) if m.program == "tool"),
            "{err}"
        );
        let err = run("/dev/null", &[]).expect_err("not executable");
        assert!(err.to_string().starts_with("running /dev/null"), "{err}");
    }

    #[test]
    fn a_hung_tool_and_its_children_are_killed_at_the_timeout() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pid_file = dir.path().join("child.pid");
        let script = format!("sleep 60 & echo $! > {}; wait", pid_file.display());
        let start = std::time::Instant::now();
        let err =
            run_within("sh", &["-c", &script], Duration::from_millis(300)).expect_err("hangs");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
        assert!(
            matches!(&err, ToolError::TimedOut { after, .. } if *after == Duration::from_millis(300)),
            "{err}"
        );
        assert!(err.to_string().contains("sh -c sleep 60"), "{err}");
        let child: i32 = std::fs::read_to_string(&pid_file)
            .expect("pid")
            .trim()
            .parse()
            .expect("number");
        // The grandchild was in the tool's group and is gone (reaped by init, or a zombie). On
        // a loaded machine it may still show with the SIGKILL pending for a moment (CI saw
        // "State: R" with SIGKILL in ShdPnd), so it is given until the deadline to go.
        let gone = || {
            let status =
                std::fs::read_to_string(format!("/proc/{child}/status")).unwrap_or_default();
            (status.is_empty() || status.contains("State:\tZ"), status)
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut state = gone();
        while !state.0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
            state = gone();
        }
        assert!(state.0, "sleep {child} survived: {}", state.1);
        let fast = run_within("sh", &["-c", "echo ok"], Duration::from_secs(10)).expect("fast");
        assert_eq!(String::from_utf8_lossy(&fast.stdout), "ok\n");
    }
}
