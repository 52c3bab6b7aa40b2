//! The test hooks (fault points, pauses, the CSI client module) reach the tests and never the
//! shipped binary: the `test-hooks` feature of the driver is enabled only through dev-dependencies
//! and the test crates, so a build of `pmem-csi` alone (the image's `cargo build --release --bin
//! pmem-csi`) has none of it. `just image-rootfs` also refuses a release binary that carries the
//! hooks' environment variable names.

use std::process::Command;

/// The driver's features in the dependency graph of the root package over `edges`.
fn driver_features(edges: &str) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "tree",
            "--offline",
            "-p",
            "pmem-csi",
            "-i",
            "driver",
            "-e",
            edges,
        ])
        .output()
        .expect("cargo tree");
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_shipped_binary_is_built_without_test_hooks() {
    let shipped = driver_features("normal,build,features");
    assert!(
        shipped.contains("driver v") && !shipped.contains("\"test-hooks\""),
        "the binary's own dependency graph enables test-hooks:\n{shipped}"
    );
    let tests = driver_features("normal,build,dev,features");
    assert!(
        tests.contains("\"test-hooks\""),
        "the tests' graph lacks test-hooks (they need the fault points):\n{tests}"
    );
}
