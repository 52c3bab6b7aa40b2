//! The image without Docker: `tools/image-rootfs.sh` (`just image-rootfs`) assembles the runtime
//! tree from our binary and Debian's e2fsprogs, xfsprogs, util-linux and mount, and inside that
//! tree, with `chroot`, our binary and the file system tools the driver runs all start. The
//! Dockerfile copies exactly this tree.

use std::path::Path;
use std::process::Command;

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
    // No library is borrowed from the host: the tree alone resolves them (chroot proved it for
    // the commands above); the Dockerfile ships that tree and starts our binary from it.
    let dockerfile = std::fs::read_to_string(repo().join("Dockerfile")).expect("Dockerfile");
    assert!(dockerfile.contains("COPY rootfs/ /"), "{dockerfile}");
    assert!(
        dockerfile.contains(r#"ENTRYPOINT ["/usr/local/bin/pmem-csi"]"#),
        "{dockerfile}"
    );
}
