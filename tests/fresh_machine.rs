//! The README's quick start on a fresh machine: `./just` installs just, `just ensure`
//! (tools/ensure.sh, a dependency of every recipe that runs something) finds what a machine lacks
//! and names its package. Checked on minimal PATHs, so the check holds on a machine that has
//! everything.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn script(path: &Path, body: &str) {
    std::fs::write(path, body).expect("write script");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// Links the real `names` (found on this process's PATH) into `dir`.
fn link_real(dir: &Path, names: &[&str]) {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in names {
        let real =
            driver::program::find_in(name, &path).unwrap_or_else(|| panic!("{name} not on PATH"));
        std::os::unix::fs::symlink(real, dir.join(name)).expect("symlink");
    }
}

fn ensure(path: &Path, home: &Path, args: &[&str]) -> Output {
    Command::new("/bin/bash")
        .arg(root().join("tools/ensure.sh"))
        .args(args)
        .env_clear()
        .env("PATH", path)
        .env("HOME", home)
        .output()
        .expect("run tools/ensure.sh")
}

/// (program, package) pairs of `tools/ensure.sh --list`.
fn ensure_table() -> BTreeSet<(String, String)> {
    let out = Command::new("bash")
        .arg(root().join("tools/ensure.sh"))
        .arg("--list")
        .output()
        .expect("run tools/ensure.sh --list");
    assert!(out.status.success(), "{}", text(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| {
            let (program, package) = line.split_once(' ').expect("program package");
            (program.to_string(), package.to_string())
        })
        .collect()
}

#[test]
fn ensure_covers_every_program_the_driver_runs() {
    let table = ensure_table();
    for p in driver::program::ALL {
        assert!(
            table.contains(&(p.name.to_string(), p.package.to_string())),
            "tools/ensure.sh does not list {} ({}): {table:?}",
            p.name,
            p.package
        );
    }
}

#[test]
fn ensure_on_a_bare_path_names_every_package_and_just() {
    let bin = tempfile::tempdir().expect("tempdir");
    let home = tempfile::tempdir().expect("home");
    // What ensure.sh itself needs to look at Go; nothing it is meant to install.
    link_real(bin.path(), &["go", "sort"]);
    let out = ensure(bin.path(), home.path(), &["--dry-run"]);
    let output = text(&out);
    assert!(out.status.success(), "{output}");
    let packages: BTreeSet<String> = ensure_table()
        .into_iter()
        .filter(|(program, _)| {
            !matches!(
                program.as_str(),
                "ndctl"
                    | "lvcreate"
                    | "lvextend"
                    | "lvremove"
                    | "lvs"
                    | "vgs"
                    | "vgcreate"
                    | "vgextend"
                    | "pvs"
            )
        })
        .map(|(_, package)| package)
        .collect();
    let line = output
        .lines()
        .find(|l| l.starts_with("ensure: would install Debian packages: "))
        .unwrap_or_else(|| panic!("no install line in:\n{output}"));
    let listed: BTreeSet<String> = line
        .trim_start_matches("ensure: would install Debian packages: ")
        .split_whitespace()
        .map(str::to_string)
        .collect();
    for package in packages.iter().chain(&["npm".to_string()]) {
        assert!(listed.contains(package), "{package} not in {line:?}");
    }
    for want in [
        "ensure: mkfs.xfs is missing (package xfsprogs)",
        "ensure: would install just with cargo",
        "ensure: error: cargo is missing",
    ] {
        assert!(output.contains(want), "no {want:?} in:\n{output}");
    }
    // The guest-only programs are listed for the driver's table, never installed here.
    assert!(
        !listed.contains("lvm2") && !listed.contains("ndctl"),
        "{line}"
    );
}

#[test]
fn ensure_fails_clearly_without_go() {
    let bin = tempfile::tempdir().expect("tempdir");
    let home = tempfile::tempdir().expect("home");
    let out = ensure(bin.path(), home.path(), &[]);
    let output = text(&out);
    assert!(!out.status.success(), "{output}");
    assert!(
        output.contains("ensure: error: go is missing: install Go >= 1.26"),
        "{output}"
    );
}

/// `just test` depends on `just ensure`, so on the machine running this suite nothing may be
/// missing: a program added to the table but not installed fails here, not in a newcomer's run.
#[test]
fn this_machine_is_ensured() {
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let out = ensure(Path::new(&path), &home, &["--dry-run"]);
    let output = text(&out);
    assert!(out.status.success(), "{output}");
    assert!(
        output.contains("ensure: would install Debian packages: none") && !output.contains("error"),
        "{output}"
    );
}

/// The root `./just` installs just with cargo when it is missing, then runs it on the
/// repository's justfile; a real just already installed is used as it is, and the wrapper never
/// mistakes itself for it.
#[test]
fn just_wrapper_bootstraps_just() {
    let bin = tempfile::tempdir().expect("tempdir");
    let home = tempfile::tempdir().expect("home");
    link_real(bin.path(), &["bash", "dirname", "realpath"]);
    let record = home.path().join("cargo-args");
    // A cargo that "installs" a just which prints its arguments.
    script(
        &bin.path().join("cargo"),
        &format!(
            "#!/bin/bash\necho \"$*\" >> '{record}'\n/bin/mkdir -p \"$HOME/.cargo/bin\"\nprintf '#!/bin/bash\\necho \"fake-just $*\"\\n' > \"$HOME/.cargo/bin/just\"\n/bin/chmod +x \"$HOME/.cargo/bin/just\"\n",
            record = record.display()
        ),
    );
    // The repository root on PATH too: the wrapper must not find itself as the real just.
    let path = std::env::join_paths([bin.path(), root()]).expect("join");
    let run = || {
        Command::new(root().join("just"))
            .arg("ensure")
            .env_clear()
            .env("PATH", &path)
            .env("HOME", home.path())
            .output()
            .expect("run ./just")
    };
    let first = run();
    let output = text(&first);
    assert!(first.status.success(), "{output}");
    assert!(
        output.contains("just: installing just from crates.io"),
        "{output}"
    );
    let root = root().canonicalize().expect("root");
    let want = format!(
        "fake-just --justfile {0}/justfile --working-directory {0} ensure",
        root.display()
    );
    assert!(
        String::from_utf8_lossy(&first.stdout).contains(&want),
        "{output}"
    );
    assert_eq!(
        std::fs::read_to_string(&record).expect("cargo ran"),
        "install --locked --quiet just\n"
    );
    let second = run();
    assert!(second.status.success(), "{}", text(&second));
    assert!(!text(&second).contains("installing"), "{}", text(&second));
    assert_eq!(
        std::fs::read_to_string(&record).expect("cargo ran"),
        "install --locked --quiet just\n",
        "cargo ran again"
    );
}
