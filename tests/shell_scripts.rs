//! Every shell script of the repository passes Debian's shellcheck (from `tools/ops-tools.sh`):
//! the kind e2e script cannot run on CI machines, so this is what keeps it honest there.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn shell_scripts_pass_shellcheck() {
    let dir = testenv::tools::ops_tools_dir();
    let shellcheck = dir.join("bin/shellcheck");
    assert!(
        shellcheck.exists(),
        "{}: run `just tools`",
        shellcheck.display()
    );
    let mut scripts: Vec<PathBuf> = ["tools", "e2e-kind", "testdata/pmem-csi-1.0"]
        .iter()
        .flat_map(|d| std::fs::read_dir(repo().join(d)).expect("dir"))
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "sh"))
        .collect();
    scripts.push(repo().join(".ci/run"));
    // The quick start's bootstrap at the repository root.
    scripts.push(repo().join("just"));
    scripts.sort();
    assert!(scripts.len() >= 4, "{scripts:?}");
    let out = Command::new(&shellcheck)
        .args(&scripts)
        .output()
        .expect("shellcheck");
    assert!(
        out.status.success(),
        "shellcheck:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
