//! The image without Docker: `tools/image-rootfs.sh` (`just image-rootfs`) assembles the runtime
//! tree from our binary and Debian's e2fsprogs, xfsprogs, util-linux and mount, and inside that
//! tree, with `chroot`, our binary and the file system tools the driver runs all start. The
//! Dockerfile copies exactly this tree; `tools/image-oci.sh` (`just image-oci`) runs it with
//! Debian's buildah into an OCI archive, whose layers, unpacked, hold the same files and run our
//! binary as the image's entrypoint.

use std::path::Path;
use std::process::Command;

use sha2::{Digest, Sha256};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn the_image_tree_runs_our_binary_and_the_file_system_tools() {
    let tools = testenv::Tools::locate().expect("tools (run `just tools` and `cargo build`)");
    let dir = tempfile::tempdir().expect("tempdir");
    let rootfs = dir.path().join("rootfs");
    let list = dir.path().join("files.txt");
    let out = Command::new("bash")
        .arg(repo().join("tools/image-rootfs.sh"))
        .arg(tools.pmem_csi())
        .arg(&rootfs)
        .arg(&list)
        .output()
        .expect("image-rootfs.sh");
    assert!(
        out.status.success(),
        "image-rootfs.sh failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let files = std::fs::read_to_string(&list).expect("file list");
    for (command, want) in [
        (&["/usr/local/bin/pmem-csi", "--version"][..], "pmem-csi "),
        (&["/sbin/mkfs.ext4", "-V"][..], "mke2fs "),
        (&["/sbin/mkfs.xfs", "-V"][..], "mkfs.xfs version"),
        (
            &["/sbin/losetup", "--version"][..],
            "losetup from util-linux",
        ),
        (&["/sbin/blkid", "--version"][..], "blkid from util-linux"),
        (&["/sbin/wipefs", "--version"][..], "wipefs from util-linux"),
        (&["/sbin/lvm", "version"][..], "LVM version:"),
        (&["/usr/bin/ndctl", "--version"][..], "7"),
    ] {
        assert!(
            files.lines().any(|f| f == command[0]),
            "{} not in the file list",
            command[0]
        );
        let out = Command::new("chroot")
            .arg(&rootfs)
            .args(command)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .output()
            .expect("chroot");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && text.contains(want),
            "{command:?} in the image tree: {:?}\n{text}",
            out.status
        );
    }
    // Every program any device mode runs is on the image's PATH (the Dockerfile's ENV PATH):
    // the node's start-up check would otherwise keep the pod unready.
    for program in driver::program::ALL {
        assert!(
            in_image_path(&rootfs, program.name),
            "{} ({}) not on the image's PATH",
            program.name,
            program.package
        );
    }
    // No library is borrowed from the host: the tree alone resolves them (chroot proved it for
    // the commands above); the Dockerfile ships that tree, checked through the OCI archive below.
    the_oci_archive_holds_the_tree_and_runs_our_binary(dir.path(), &files);
}

/// Whether `name` is an executable file in one of the image's PATH directories, its symbolic
/// links resolved inside `rootfs` (an absolute link must not be followed onto the host).
fn in_image_path(rootfs: &Path, name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    [
        "/usr/local/sbin",
        "/usr/local/bin",
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
    ]
    .iter()
    .any(|dir| {
        let mut path = rootfs.join(dir.trim_start_matches('/')).join(name);
        for _ in 0..8 {
            match std::fs::read_link(&path) {
                Ok(target) if target.is_absolute() => {
                    path = rootfs.join(target.strip_prefix("/").expect("absolute"));
                }
                Ok(target) => {
                    path = path.parent().expect("parent").join(target);
                }
                Err(_) => break,
            }
        }
        std::fs::symlink_metadata(&path)
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// Builds the OCI archive from `context` (holding `rootfs/`) and checks it against `files`.
fn the_oci_archive_holds_the_tree_and_runs_our_binary(context: &Path, files: &str) {
    let buildah = testenv::tools::ops_tools_dir().join("bin/buildah");
    assert!(buildah.exists(), "{}: run `just tools`", buildah.display());
    let out_dir = tempfile::tempdir().expect("tempdir");
    let archive = out_dir.path().join("pmem-csi.oci.tar");
    run(Command::new("bash")
        .arg(repo().join("tools/image-oci.sh"))
        .arg(&buildah)
        .arg(context)
        .arg(&archive)
        .arg("localhost/pmem-csi:test"));
    let oci = out_dir.path().join("oci");
    std::fs::create_dir(&oci).expect("mkdir");
    run(Command::new("tar")
        .arg("-xf")
        .arg(&archive)
        .arg("-C")
        .arg(&oci));

    let index = json(&oci.join("index.json"));
    let manifests = index["manifests"]
        .as_array()
        .expect("index.json: manifests");
    assert_eq!(manifests.len(), 1, "{index}");
    assert_eq!(
        manifests[0]["annotations"]["org.opencontainers.image.ref.name"], "localhost/pmem-csi:test",
        "{index}"
    );
    let manifest = json(&blob(&oci, &manifests[0]));
    let config = json(&blob(&oci, &manifest["config"]));
    assert_eq!(
        config["config"]["Entrypoint"],
        serde_json::json!(["/usr/local/bin/pmem-csi"]),
        "{config}"
    );
    let path = config["config"]["Env"]
        .as_array()
        .and_then(|env| env.iter().find_map(|e| e.as_str()?.strip_prefix("PATH=")))
        .unwrap_or_else(|| panic!("no PATH in the image's Env: {config}"));
    assert!(path.split(':').any(|d| d == "/sbin"), "{path}");

    let unpacked = out_dir.path().join("unpacked");
    std::fs::create_dir(&unpacked).expect("mkdir");
    let layers = manifest["layers"].as_array().expect("manifest: layers");
    assert!(!layers.is_empty(), "{manifest}");
    for layer in layers {
        // GNU tar detects a compressed layer by itself.
        run(Command::new("tar")
            .arg("-xf")
            .arg(blob(&oci, layer))
            .arg("-C")
            .arg(&unpacked));
    }
    let listing = run(Command::new("find")
        .arg(".")
        .args(["-mindepth", "1", "(", "-type", "f", "-o", "-type", "l", ")"])
        .current_dir(&unpacked));
    let mut image_files: Vec<&str> = listing
        .lines()
        .map(|f| f.strip_prefix('.').unwrap_or(f))
        .collect();
    image_files.sort_unstable();
    let want: Vec<&str> = files.lines().collect();
    assert_eq!(
        image_files, want,
        "the image's files differ from the tree's"
    );

    let entrypoint = config["config"]["Entrypoint"][0]
        .as_str()
        .expect("Entrypoint");
    let mut command = Command::new("chroot");
    command
        .arg(&unpacked)
        .arg(entrypoint)
        .arg("--version")
        .env_clear()
        .env("PATH", path);
    let version = run(&mut command);
    assert!(version.starts_with("pmem-csi "), "{version}");
}

/// The blob a descriptor names, after checking its digest and size.
fn blob(oci: &Path, descriptor: &serde_json::Value) -> std::path::PathBuf {
    let digest = descriptor["digest"].as_str().expect("descriptor: digest");
    let hex = digest
        .strip_prefix("sha256:")
        .unwrap_or_else(|| panic!("{digest}: not sha256"));
    let path = oci.join("blobs/sha256").join(hex);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(
        Some(bytes.len() as u64),
        descriptor["size"].as_u64(),
        "{digest}: size"
    );
    let actual: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(actual, hex, "{digest}: content");
    path
}

fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs a command that must succeed; its standard output.
fn run(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        out.status.success(),
        "{command:?}: {:?}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
