//! Component tests of `pmem-csi node` over its real socket, with real loop devices, file
//! systems and mounts: the volume life cycle, raw block, xfs, inline ephemeral volumes,
//! read-only publish, bad input, and PMEM-CSI 1.0 compatibility.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use driver::csi::*;
use testenv::csi_client::{Harness, block, mount, mount_with, params};
use tonic::Code;

const MI: i64 = 1 << 20;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_pmem-csi"))
}

fn mount_of(path: &Path) -> Option<driver::mounts::MountInfo> {
    driver::mounts::at(path).expect("mountinfo")
}

async fn life_cycle(fs: &str, size: i64) {
    let mut h = Harness::emulated(bin(), &[], |_| {}).await;
    let volume = h.create("life", size, &[]).await;
    assert_eq!(volume.capacity_bytes, size);
    let id = volume.volume_id;
    let target = h.path("target");
    h.stage(&id, mount(fs)).await.expect("stage");
    h.stage(&id, mount(fs)).await.expect("stage is idempotent");
    let staged = mount_of(&h.path("staging")).expect("staging mounted");
    assert_eq!(staged.fs_type, fs);
    assert!(staged.source.starts_with("/dev/loop"), "{staged:?}");
    assert!(
        !staged.super_options.iter().any(|o| o.starts_with("dax")),
        "loop devices never get dax"
    );
    h.publish(&id, &target, mount(fs), false, &[])
        .await
        .expect("publish");
    h.publish(&id, &target, mount(fs), false, &[])
        .await
        .expect("publish is idempotent");
    std::fs::write(target.join("data"), b"persistent memory")
        .expect("write through the pod's mount");
    h.unpublish(&id, &target).await;
    assert!(!target.exists(), "unpublish removes the target");
    h.unstage(&id).await;
    h.unstage(&id).await;
    assert!(mount_of(&h.path("staging")).is_none());
    assert!(
        driver::loopdev::attached()
            .iter()
            .all(|(_, b)| !b.starts_with(&h.dirs.region)),
        "loop detached"
    );

    h.stage(&id, mount(fs)).await.expect("stage again");
    h.publish(&id, &target, mount(fs), false, &[])
        .await
        .expect("publish again");
    assert_eq!(
        std::fs::read(target.join("data")).expect("read back"),
        b"persistent memory"
    );
    h.unpublish(&id, &target).await;
    h.unstage(&id).await;
    h.delete(&id).await;
    h.delete(&id).await;
    assert!(h.volume_ids().await.is_empty());
    h.finish().await;
}

#[tokio::test]
async fn ext4_life_cycle_keeps_data_across_restaging() {
    life_cycle("ext4", 64 * MI).await;
}

#[tokio::test]
async fn xfs_life_cycle_keeps_data_across_restaging() {
    life_cycle("xfs", 320 * MI).await;
}

#[tokio::test]
async fn raw_block_volume_is_the_device() {
    let mut h = Harness::emulated(bin(), &[], |_| {}).await;
    let id = h.create("raw", 8 * MI, &[]).await.volume_id;
    h.stage(&id, block()).await.expect("stage block");
    let target = h.path("block-target");
    h.publish(&id, &target, block(), false, &[])
        .await
        .expect("publish block");
    assert!(
        mount_of(&target).is_some_and(|m| m.fs_type == "devtmpfs"),
        "device node bound on the target"
    );
    {
        let mut device = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&target)
            .expect("open device");
        device.seek(SeekFrom::Start(4 * MI as u64)).expect("seek");
        device.write_all(b"raw bytes").expect("write");
        device.sync_all().expect("sync");
        device.seek(SeekFrom::Start(4 * MI as u64)).expect("seek");
        let mut back = [0u8; 9];
        device.read_exact(&mut back).expect("read");
        assert_eq!(&back, b"raw bytes");
        assert_eq!(device.seek(SeekFrom::End(0)).expect("size"), 8 * MI as u64);
    }
    let stats = h
        .node
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: target.display().to_string(),
            ..Default::default()
        })
        .await
        .expect("stats")
        .into_inner();
    assert_eq!(stats.usage.len(), 1, "block volumes report bytes only");
    assert_eq!(stats.usage[0].total, 8 * MI);
    h.unpublish(&id, &target).await;
    assert!(!target.exists());
    h.unstage(&id).await;
    h.delete(&id).await;
    h.finish().await;
}

#[tokio::test]
async fn inline_ephemeral_volume_lives_from_publish_to_unpublish() {
    let mut h = Harness::emulated(bin(), &[], |_| {}).await;
    let handle = "csi-5b2b0a3c4d1e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8";
    let target = h.path("inline");
    let context = [
        ("csi.storage.k8s.io/ephemeral", "true"),
        ("csi.storage.k8s.io/pod.name", "app"),
        ("csi.storage.k8s.io/pod.namespace", "default"),
        ("size", "16Mi"),
        ("eraseafter", "false"),
    ];
    h.publish(handle, &target, mount(""), false, &context)
        .await
        .expect("publish inline");
    h.publish(handle, &target, mount(""), false, &context)
        .await
        .expect("idempotent");
    assert_eq!(
        mount_of(&target).map(|m| m.fs_type),
        Some("ext4".to_string())
    );
    std::fs::write(target.join("scratch"), b"x").expect("write");
    assert_eq!(
        h.volume_ids().await,
        vec![driver::volume_id::volume_id(handle)]
    );
    h.unpublish(handle, &target).await;
    assert!(
        h.volume_ids().await.is_empty(),
        "unpublish deletes the inline volume"
    );
    h.unpublish(handle, &target).await;
    let err = h
        .publish(
            handle,
            &target,
            mount(""),
            false,
            &[("csi.storage.k8s.io/ephemeral", "true")],
        )
        .await
        .expect_err("size is required");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("size"), "{}", err.message());
    assert!(h.volume_ids().await.is_empty());
    h.finish().await;
}

#[tokio::test]
async fn read_only_publish_refuses_writes() {
    let mut h = Harness::emulated(bin(), &[], |_| {}).await;
    let id = h.create("ro", 16 * MI, &[]).await.volume_id;
    h.stage(&id, mount("ext4")).await.expect("stage");
    let target = h.path("ro-target");
    h.publish(&id, &target, mount("ext4"), true, &[])
        .await
        .expect("publish ro");
    assert!(mount_of(&target).is_some_and(|m| m.read_only()));
    let err = std::fs::write(target.join("nope"), b"x").expect_err("read-only");
    assert_eq!(err.raw_os_error(), Some(30), "EROFS, got {err}");
    let conflict = h
        .publish(&id, &target, mount("ext4"), false, &[])
        .await
        .expect_err("rw over ro");
    assert_eq!(conflict.code(), Code::AlreadyExists);
    h.unpublish(&id, &target).await;
    h.unstage(&id).await;
    h.delete(&id).await;
    h.finish().await;
}

/// StorageClass `mountOptions` such as `noatime` are mount flags, not file-system data (ext4
/// refused "noatime" as data, so such a class could never be staged); a publish, read-only or
/// not, keeps `nosuid` and `nodev`.
#[tokio::test]
async fn mount_options_are_flags_and_publish_keeps_nosuid_nodev() {
    let mut h = Harness::emulated(bin(), &[], |_| {}).await;
    let id = h.create("options", 16 * MI, &[]).await.volume_id;
    let capability = mount_with("ext4", &["noatime", "discard"]);
    h.stage(&id, capability.clone()).await.expect("stage");
    let staged = mount_of(&h.path("staging")).expect("staged");
    for want in ["noatime", "nosuid", "nodev"] {
        assert!(
            staged.options.iter().any(|o| o == want),
            "{want}: {staged:?}"
        );
    }
    assert!(
        staged.super_options.iter().any(|o| o == "discard"),
        "{staged:?}"
    );
    for (name, read_only, want) in [
        (
            "rw-target",
            false,
            &["rw", "noatime", "nosuid", "nodev"][..],
        ),
        ("ro-target", true, &["ro", "noatime", "nosuid", "nodev"][..]),
    ] {
        let target = h.path(name);
        h.publish(&id, &target, capability.clone(), read_only, &[])
            .await
            .expect(name);
        let published = mount_of(&target).expect(name);
        for option in want {
            assert!(
                published.options.iter().any(|o| o == option),
                "{name}: {option} missing in {:?}",
                published.options
            );
        }
        h.unpublish(&id, &target).await;
    }
    h.unstage(&id).await;

    // Options that would lift nosuid/nodev are refused by name, before anything is mounted,
    // and CreateVolume refuses them too (a class whose options no stage could mount).
    let err = h
        .stage(&id, mount_with("ext4", &["noatime", "suid"]))
        .await
        .expect_err("suid");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message()
            .contains("volume_capability.mount.mount_flags: \"suid\" is not allowed"),
        "{}",
        err.message()
    );
    assert!(mount_of(&h.path("staging")).is_none());
    let err = h
        .controller
        .create_volume(CreateVolumeRequest {
            name: "bad-options".into(),
            volume_capabilities: vec![mount_with("ext4", &["dev"])],
            ..Default::default()
        })
        .await
        .expect_err("dev");
    assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
    assert!(err.message().contains("mount_flags"), "{}", err.message());
    h.delete(&id).await;
    assert_eq!(h.volume_ids().await, Vec::<String>::new());
    h.finish().await;
}

/// A tool that hangs is killed at `--tool-timeout`: the call answers DeadlineExceeded naming
/// the command, and the volume's lock is free again for the next call.
#[tokio::test]
async fn a_hung_tool_is_killed_and_releases_the_volume() {
    let root = tempfile::tempdir().expect("tempdir");
    let dirs = testenv::node_driver::NodeDriverDirs::under(root.path());
    let tools = root.path().join("bin");
    std::fs::create_dir_all(&tools).expect("bin");
    let path = std::env::var_os("PATH").unwrap_or_default();
    for name in ["blkid", "losetup", "mkfs.ext4", "sleep"] {
        let real = driver::program::find_in(name, &path).expect(name);
        std::os::unix::fs::symlink(real, tools.join(name)).expect("symlink");
    }
    let hung = tools.join("mkfs.xfs");
    std::fs::write(&hung, "#!/bin/sh\nsleep 600\n").expect("script");
    std::fs::set_permissions(&hung, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let mut args = testenv::node_driver::emulated_args("node-1", &dirs, "1Gi");
    args.push("--tool-timeout=1s".into());
    let tools_path = tools.display().to_string();
    let mut h =
        Harness::start_with_env(bin(), root, dirs, args, &[("PATH", tools_path.as_str())]).await;
    let id = h.create("hung", 320 * MI, &[]).await.volume_id;
    let start = std::time::Instant::now();
    let err = h
        .stage(&id, mount("xfs"))
        .await
        .expect_err("mkfs.xfs hangs");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{}", err.message());
    assert!(
        err.message().contains("mkfs.xfs -q -f")
            && err.message().contains("did not finish within 1s"),
        "{}",
        err.message()
    );
    assert!(start.elapsed() < std::time::Duration::from_secs(30));
    // The same volume's lock is free: unstaging (nothing mounted) and deleting proceed.
    h.unstage(&id).await;
    h.delete(&id).await;
    assert!(h.volume_ids().await.is_empty());
    h.finish().await;
}

fn digest(path: &Path) -> String {
    use sha2::Digest;
    hex_digest(&sha2::Sha256::digest(std::fs::read(path).expect("read")))
}

fn hex_digest(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Start-up repair never destroys data: a corrupt state file is quarantined and its device kept
/// (and a staged mount of it can still be unstaged), a device without state is kept and
/// reported, and recorded devices that went missing stop the start instead of costing their
/// state. Before these rules, the restart below erased both devices and dropped the state.
#[tokio::test]
async fn start_up_repair_never_destroys_data() {
    let port = testenv::ports::free_port().expect("port");
    let admin = format!("--admin-address=127.0.0.1:{port}");
    let mut h = Harness::emulated(bin(), &[&admin], |_| {}).await;
    let args = {
        let mut a = testenv::node_driver::emulated_args("node-1", &h.dirs, "1Gi");
        a.push(admin.clone());
        a
    };
    let kept = h.create("kept", 16 * MI, &[]).await.volume_id;
    h.stage(&kept, mount("ext4")).await.expect("stage");
    std::fs::write(h.path("staging").join("data"), "precious").expect("write");
    let state_file = h.dirs.state.join(format!("{kept}.json"));
    let device_file = h.dirs.region.join(format!("{kept}.pmem"));
    // A device no state records, with content.
    let stray = h.dirs.region.join("pvc-00-stray.pmem");
    std::fs::write(&stray, vec![7u8; 4 << 20]).expect("stray");
    let stray_digest = digest(&stray);

    std::fs::write(&state_file, b"{\"id\": \"truncat").expect("corrupt the state");
    let restart_args = args.clone();
    h.restart(restart_args).await;
    assert!(!state_file.exists(), "corrupt state left in place");
    let quarantined = h.dirs.state.join(format!("{kept}.json.quarantined"));
    assert!(quarantined.exists(), "corrupt state not quarantined");
    assert!(
        device_file.exists(),
        "the quarantined volume's device was deleted"
    );
    assert_eq!(digest(&stray), stray_digest, "the stray device changed");
    assert!(h.volume_ids().await.is_empty());
    let text = testenv::metrics::scrape_metrics(port).await;
    assert!(!text.is_empty(), "scrape /metrics");
    for line in [
        "pmem_csi_unrecorded_devices{node=\"node-1\",driver_name=\"pmem-csi.intel.com\"} 1",
        "pmem_csi_quarantined_volumes{node=\"node-1\",driver_name=\"pmem-csi.intel.com\"} 1",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    // kubelet can still unstage the volume the driver no longer knows.
    assert!(mount_of(&h.path("staging")).is_some());
    h.unstage(&kept).await;
    assert!(mount_of(&h.path("staging")).is_none());
    // The operator restores the state: the volume and its data are back.
    std::fs::rename(&quarantined, &state_file).expect("restore");
    std::fs::write(
        &state_file,
        serde_json::to_vec(&serde_json::json!({
            "id": kept, "size": 16 * MI,
            "parameters": {"name": "kept", "deviceMode": "emulated"}
        }))
        .expect("json"),
    )
    .expect("repaired state");
    let restart_args = args.clone();
    h.restart(restart_args).await;
    assert_eq!(h.volume_ids().await, vec![kept.clone()]);
    h.stage(&kept, mount("ext4")).await.expect("stage again");
    assert_eq!(
        std::fs::read_to_string(h.path("staging").join("data")).expect("read back"),
        "precious"
    );
    h.unstage(&kept).await;

    // Devices that went missing (an emptied region) stop the start, and the state stays.
    let away = h.path("away");
    std::fs::create_dir_all(&away).expect("away");
    std::fs::rename(&device_file, away.join("kept.pmem")).expect("hide device");
    let restart_args = args.clone();
    let refused = h.restart_refused(restart_args).await;
    assert!(
        refused.contains("1 recorded volume(s) have no device") && refused.contains(&kept),
        "{refused}"
    );
    assert!(
        state_file.exists(),
        "the state of a missing device was removed"
    );
    std::fs::rename(away.join("kept.pmem"), &device_file).expect("device back");
    let restart_args = args.clone();
    h.restart(restart_args).await;
    assert_eq!(h.volume_ids().await, vec![kept.clone()]);
    h.delete(&kept).await;
    std::fs::remove_file(&stray).expect("operator removes the stray device");
    h.finish().await;
}

#[tokio::test]
async fn bad_input_gets_specific_errors() {
    let mut h = Harness::emulated(bin(), &[], |_| {}).await;
    let id = h.create("good", 8 * MI, &[]).await.volume_id;
    let file_target = h.path("a-file");
    std::fs::write(&file_target, b"").expect("file");
    h.stage(&id, mount("ext4")).await.expect("stage");

    let create = |name: &str, size: i64, caps: Vec<VolumeCapability>, p: &[(&str, &str)]| {
        CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: size,
                limit_bytes: 0,
            }),
            volume_capabilities: caps,
            parameters: params(p),
            ..Default::default()
        }
    };
    let mut c = h.controller.clone();
    let cases: Vec<(&str, Result<(), tonic::Status>, Code, &str)> = vec![
        (
            "unknown parameter",
            c.create_volume(create("v1", MI, vec![mount("")], &[("foo", "bar")]))
                .await
                .map(|_| ()),
            Code::InvalidArgument,
            "\"foo\"",
        ),
        (
            "kata containers",
            c.create_volume(create(
                "v2",
                MI,
                vec![mount("")],
                &[("kataContainers", "true")],
            ))
            .await
            .map(|_| ()),
            Code::InvalidArgument,
            "Kata Containers volumes are not supported",
        ),
        (
            "absurd size",
            c.create_volume(create("v3", 1 << 50, vec![mount("")], &[]))
                .await
                .map(|_| ()),
            Code::ResourceExhausted,
            "1125899906842624",
        ),
        (
            "missing capability",
            c.create_volume(create("v4", MI, vec![], &[]))
                .await
                .map(|_| ()),
            Code::InvalidArgument,
            "volume_capabilities",
        ),
        (
            "unsupported fs",
            c.create_volume(create("v5", MI, vec![mount("btrfs")], &[]))
                .await
                .map(|_| ()),
            Code::InvalidArgument,
            "btrfs",
        ),
        (
            "unknown volume",
            h.stage("no-such-volume", mount("ext4")).await,
            Code::NotFound,
            "no-such-volume",
        ),
        (
            "target is a file",
            h.publish(&id, &file_target, mount("ext4"), false, &[])
                .await,
            Code::InvalidArgument,
            "target_path",
        ),
        (
            "unknown context key",
            h.publish(&id, &h.path("t2"), mount("ext4"), false, &[("bogus", "1")])
                .await,
            Code::InvalidArgument,
            "\"bogus\"",
        ),
        (
            "bad list token",
            c.list_volumes(ListVolumesRequest {
                max_entries: 0,
                starting_token: "x".into(),
            })
            .await
            .map(|_| ()),
            Code::Aborted,
            "starting_token",
        ),
    ];
    for (name, result, code, fragment) in cases {
        let err = result.expect_err(name);
        assert_eq!(err.code(), code, "{name}: {}", err.message());
        assert!(
            err.message().contains(fragment),
            "{name}: {:?} lacks {fragment:?}",
            err.message()
        );
    }
    assert_eq!(
        h.volume_ids().await,
        vec![id.clone()],
        "failed creates left nothing"
    );
    h.unstage(&id).await;
    h.delete(&id).await;
    h.finish().await;
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/pmem-csi-1.0")
        .join(name)
}

#[tokio::test]
async fn adopts_pmem_csi_1_0_state_and_contexts() {
    let emulated_name = "pvc-a63bc7db-3cbd-404d-9c9d-d7b1969cbaa8";
    let emulated_id = driver::volume_id::volume_id(emulated_name);
    let lvm_id = driver::volume_id::volume_id("pvc-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0");
    assert_eq!(
        emulated_id,
        "pvc-a6-d3bf70885af9aa7fe39e0007671b912cf9749730ad814c8694225c2a"
    );
    let mut h = Harness::emulated(bin(), &[], |dirs| {
        std::fs::create_dir_all(&dirs.state).expect("state dir");
        std::fs::create_dir_all(&dirs.region).expect("region dir");
        for id in [&emulated_id, &lvm_id] {
            let file = format!("{id}.json");
            std::fs::copy(fixture(&file), dirs.state.join(&file)).expect("copy state fixture");
        }
        // The device of the emulated volume, as the backend would have left it.
        std::fs::File::create(dirs.region.join(format!("{emulated_id}.pmem")))
            .and_then(|f| f.set_len(64 << 20))
            .expect("region file");
    })
    .await;
    let mut ids = h.volume_ids().await;
    ids.sort();
    let mut want = vec![emulated_id.clone(), lvm_id.clone()];
    want.sort();
    assert_eq!(ids, want, "both volumes adopted");

    let attributes: HashMap<String, String> = serde_json::from_slice(
        &std::fs::read(fixture("pv-volume-attributes.json")).expect("fixture"),
    )
    .expect("json");
    let context: Vec<(&str, &str)> = attributes
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    h.node
        .node_stage_volume(NodeStageVolumeRequest {
            volume_id: emulated_id.clone(),
            staging_target_path: h.path("staging").display().to_string(),
            volume_capability: Some(mount("ext4")),
            volume_context: params(&context),
            ..Default::default()
        })
        .await
        .expect("stage with PMEM-CSI 1.0's PV context");
    let target = h.path("target");
    h.publish(&emulated_id, &target, mount("ext4"), false, &context)
        .await
        .expect("publish with PMEM-CSI 1.0's PV context");
    h.unpublish(&emulated_id, &target).await;
    h.unstage(&emulated_id).await;

    let legacy = h
        .create("legacy-none", 4 * MI, &[("persistencyModel", "none")])
        .await;
    assert_eq!(
        legacy
            .volume_context
            .get("persistencyModel")
            .map(String::as_str),
        Some("normal")
    );

    let err = h
        .controller
        .delete_volume(DeleteVolumeRequest {
            volume_id: lvm_id.clone(),
            ..Default::default()
        })
        .await
        .expect_err("an lvm volume cannot be deleted by an emulated driver");
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("lvm"), "{}", err.message());
    h.delete(&emulated_id).await;
    h.delete(&legacy.volume_id).await;
    h.finish().await;
}

#[tokio::test]
async fn metrics_report_capacity_and_operations() {
    let port = testenv::ports::free_port().expect("port");
    let admin = format!("--admin-address=127.0.0.1:{port}");
    let mut h = Harness::emulated(bin(), &[&admin], |_| {}).await;
    let id = h.create("metered", 8 * MI, &[]).await.volume_id;
    let client =
        testenv::control_plane::anonymous_probe(&format!("http://127.0.0.1:{port}"), "metrics")
            .expect("client");
    let text = client
        .request_text(
            http::Request::get("/metrics")
                .body(Vec::new())
                .expect("request"),
        )
        .await
        .expect("scrape /metrics");
    let managed = 1u64 << 30;
    for line in [
        format!(
            "pmem_amount_managed{{node=\"node-1\",driver_name=\"pmem-csi.intel.com\"}} {managed}"
        ),
        format!(
            "pmem_amount_total{{node=\"node-1\",driver_name=\"pmem-csi.intel.com\"}} {managed}"
        ),
        format!(
            "pmem_amount_available{{node=\"node-1\",driver_name=\"pmem-csi.intel.com\"}} {}",
            managed - (8 << 20)
        ),
    ] {
        assert!(text.contains(&line), "missing {line:?} in:\n{text}");
    }
    assert!(
        text.contains("csi_plugin_operations_seconds_count{driver_name=\"pmem-csi.intel.com\",method_name=\"/csi.v1.Controller/CreateVolume\",grpc_status_code=\"OK\"} 1"),
        "{text}"
    );
    let ready = client
        .request_text(
            http::Request::get("/readyz")
                .body(Vec::new())
                .expect("request"),
        )
        .await
        .expect("ready");
    assert_eq!(ready, "ok");
    h.delete(&id).await;
    h.finish().await;
}
