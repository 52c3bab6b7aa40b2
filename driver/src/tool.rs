//! Running the standard PMEM and LVM tools (`ndctl`, `lvm`, `wipefs`): one place that turns a
//! failed run into an error naming the command, its exit status and what it printed.

use std::process::Command;

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
            ToolError::Missing(_) | ToolError::Spawn { .. } => "",
            ToolError::Failed { stderr, .. } => stderr,
        }
    }
}

/// Runs `program` with `args`, returning its standard output.
pub fn run(program: &str, args: &[&str]) -> Result<String, ToolError> {
    let command = || format!("{program} {}", args.join(" "));
    tracing::debug!(command = command(), "running");
    let out = Command::new(program)
        .args(args)
        // LVM warns about every file descriptor it inherits; the driver's sockets are not its
        // business, and its locale must not change the output we parse.
        .env("LVM_SUPPRESS_FD_WARNINGS", "1")
        // In a container no udev answers LVM's requests to create /dev/<vg>/<lv> (lvcreate
        // would succeed and the path never appear); libdevmapper then creates the nodes itself.
        // Where the host's udev also runs, the nodes it makes are the same.
        .env("DM_DISABLE_UDEV", "1")
        .env("LC_ALL", "C")
        .output()
        .map_err(
            |source| match MissingProgram::from_spawn(program, &source) {
                Some(missing) => ToolError::Missing(missing),
                None => ToolError::Spawn {
                    command: command(),
                    source,
                },
            },
        )?;
    if !out.status.success() {
        return Err(ToolError::Failed {
            command: command(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
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
}
