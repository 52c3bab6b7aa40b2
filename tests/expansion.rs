//! Component tests of NodeExpandVolume on `pmem-csi node --device-mode=emulated`, with real
//! loop devices, file systems and mounts: ext4 and xfs grow while mounted and keep their data,
//! raw block volumes grow, capacity follows, a growth without room changes nothing, and an
//! interrupted growth is finished or undone at start-up.

use std::io::{Seek, SeekFrom};
use std::path::{Path, PathBuf};

use driver::csi::*;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use testenv::csi_client::{Harness, block, mount};
use tonic::Code;

const MI: i64 = 1 << 20;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_pmem-csi"))
}

/// Bytes the file system mounted at `path` holds in all.
fn fs_bytes(path: &Path) -> i64 {
    let s = rustix::fs::statvfs(path).expect("statvfs");
    i64::try_from(s.f_blocks * s.f_frsize).expect("size")
}

fn volume_file(h: &Harness, id: &str) -> PathBuf {
    h.dirs.region.join(format!("{id}.pmem"))
}

fn file_size(path: &Path) -> i64 {
    i64::try_from(std::fs::metadata(path).expect("stat").len()).expect("size")
}

async fn grows_online(fs: &str, size: i64, grown: i64) {
    let mut h = Harness::emulated(bin(), &[], |_| {}).await;
    let id = h.create("grow", size, &[]).await.volume_id;
    let target = h.path("target");
    h.stage(&id, mount(fs)).await.expect("stage");
    h.publish(&id, &target, mount(fs), false, &[])
        .await
        .expect("publish");
    std::fs::write(target.join("data"), b"written before the growth").expect("write");
    let before = fs_bytes(&target);
    assert!(before <= size, "{fs}: {before} > {size}");
    let available = h.available().await;

    let reported = h.expand(&id, &target, grown).await.expect("expand");
    assert_eq!(reported, grown);
    let after = fs_bytes(&target);
    assert!(
        after > size && after <= grown,
        "{fs}: the mounted file system holds {after} bytes, not grown from {before} toward {grown}"
    );
    assert_eq!(file_size(&volume_file(&h, &id)), grown);
    assert_eq!(
        h.available().await,
        available - (grown - size),
        "capacity drops by the growth"
    );
    assert_eq!(
        std::fs::read(target.join("data")).expect("read"),
        b"written before the growth"
    );
    // Writable beyond the old size: a file as large as the growth fits now.
    std::fs::write(target.join("big"), vec![1u8; (grown - size) as usize / 2]).expect("fill");

    assert_eq!(
        h.expand(&id, &target, grown).await.expect("again"),
        grown,
        "a repeated call changes nothing"
    );
    assert_eq!(
        h.expand(&id, &target, size).await.expect("smaller"),
        grown,
        "a volume never shrinks"
    );
    assert_eq!(fs_bytes(&target), after);

    h.unpublish(&id, &target).await;
    h.unstage(&id).await;
    h.stage(&id, mount(fs)).await.expect("stage again");
    h.publish(&id, &target, mount(fs), false, &[])
        .await
        .expect("publish again");
    assert_eq!(fs_bytes(&target), after, "the growth survives restaging");
    h.unpublish(&id, &target).await;
    h.unstage(&id).await;
    h.delete(&id).await;
    h.finish().await;
}

/// ext4's online resize needs CAP_SYS_RESOURCE. Where the tests run without it (this machine's
/// sandbox), the call must say so before anything changes; where they have it (the QEMU
/// guest's `tests/vm_guest.rs` grows ext4 too) the file system grows.
#[tokio::test]
async fn ext4_grows_while_mounted_or_says_why_not() {
    if driver::filesystem::online_growth_refused("ext4").is_none() {
        grows_online("ext4", 64 * MI, 128 * MI).await;
        return;
    }
    let mut h = Harness::emulated(bin(), &[], |_| {}).await;
    let id = h.create("grow", 64 * MI, &[]).await.volume_id;
    let target = h.path("target");
    h.stage(&id, mount("ext4")).await.expect("stage");
    h.publish(&id, &target, mount("ext4"), false, &[])
        .await
        .expect("publish");
    let before = fs_bytes(&target);
    let err = h
        .expand(&id, &target, 128 * MI)
        .await
        .expect_err("no CAP_SYS_RESOURCE");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("CAP_SYS_RESOURCE"), "{err:?}");
    assert_eq!(fs_bytes(&target), before);
    assert_eq!(
        file_size(&volume_file(&h, &id)),
        64 * MI,
        "the device did not grow"
    );
    h.unpublish(&id, &target).await;
    h.unstage(&id).await;
    h.delete(&id).await;
    h.finish().await;
}

#[tokio::test]
async fn xfs_grows_while_mounted() {
    grows_online("xfs", 320 * MI, 512 * MI).await;
}

#[tokio::test]
async fn raw_block_volume_grows() {
    let mut h = Harness::emulated(bin(), &[], |_| {}).await;
    let id = h.create("raw", 8 * MI, &[]).await.volume_id;
    h.stage(&id, block()).await.expect("stage");
    let target = h.path("block-target");
    h.publish(&id, &target, block(), false, &[])
        .await
        .expect("publish");
    let reported = h.expand(&id, &target, 16 * MI).await.expect("expand");
    assert_eq!(reported, 16 * MI);
    let mut device = std::fs::File::open(&target).expect("open device");
    assert_eq!(
        device.seek(SeekFrom::End(0)).expect("size"),
        16 * MI as u64,
        "the device shows the new size without being re-attached"
    );
    drop(device);
    h.unpublish(&id, &target).await;
    h.unstage(&id).await;
    h.delete(&id).await;
    h.finish().await;
}

#[tokio::test]
async fn bad_or_impossible_growth_changes_nothing() {
    let mut h = Harness::emulated(bin(), &[], |_| {}).await;
    let id = h.create("small", 320 * MI, &[]).await.volume_id;
    let target = h.path("target");
    h.stage(&id, mount("xfs")).await.expect("stage");
    h.publish(&id, &target, mount("xfs"), false, &[])
        .await
        .expect("publish");
    let before = fs_bytes(&target);
    let available = h.available().await;

    let err = h
        .expand(&id, &target, 2048 * MI)
        .await
        .expect_err("more than the node has");
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
    assert!(
        err.message()
            .contains(&format!("{} bytes free in total", available)),
        "the error names the free bytes: {}",
        err.message()
    );
    assert_eq!(fs_bytes(&target), before);
    assert_eq!(file_size(&volume_file(&h, &id)), 320 * MI);
    assert_eq!(h.available().await, available);
    let state = std::fs::read_to_string(h.dirs.state.join(format!("{id}.json"))).expect("state");
    assert!(
        state.contains(&format!("\"size\":{}", 320 * MI)) && !state.contains("growingFrom"),
        "{state}"
    );

    let expand = |volume_id: &str, volume_path: &Path, required: i64| NodeExpandVolumeRequest {
        volume_id: volume_id.into(),
        volume_path: volume_path.display().to_string(),
        capacity_range: Some(CapacityRange {
            required_bytes: required,
            limit_bytes: 0,
        }),
        ..Default::default()
    };
    let elsewhere = h.path("elsewhere");
    std::fs::create_dir_all(&elsewhere).expect("mkdir");
    for (case, request, code, words) in [
        (
            "no volume id",
            expand("", &target, 384 * MI),
            Code::InvalidArgument,
            "volume_id",
        ),
        (
            "no volume path",
            NodeExpandVolumeRequest {
                volume_path: String::new(),
                ..expand(&id, &target, 384 * MI)
            },
            Code::InvalidArgument,
            "volume_path",
        ),
        (
            "unknown volume",
            expand("pvc-00-unknown", Path::new("some/path"), 384 * MI),
            Code::NotFound,
            "does not exist",
        ),
        (
            "not mounted there",
            expand(&id, &elsewhere, 384 * MI),
            Code::NotFound,
            "is not a mount of volume",
        ),
        (
            "negative size",
            expand(&id, &target, -1),
            Code::InvalidArgument,
            "capacity_range.required_bytes",
        ),
        (
            "above the limit",
            NodeExpandVolumeRequest {
                capacity_range: Some(CapacityRange {
                    required_bytes: 384 * MI,
                    limit_bytes: 352 * MI,
                }),
                ..expand(&id, &target, 0)
            },
            Code::OutOfRange,
            "limit_bytes",
        ),
    ] {
        let err = h.node.node_expand_volume(request).await.expect_err(case);
        assert_eq!(err.code(), code, "{case}: {err:?}");
        assert!(err.message().contains(words), "{case}: {}", err.message());
    }
    assert_eq!(fs_bytes(&target), before);
    assert_eq!(file_size(&volume_file(&h, &id)), 320 * MI);

    let capabilities = h
        .node
        .node_get_capabilities(NodeGetCapabilitiesRequest {})
        .await
        .expect("capabilities")
        .into_inner()
        .capabilities;
    assert!(
        capabilities.iter().any(|c| matches!(
            c.r#type,
            Some(node_service_capability::Type::Rpc(node_service_capability::Rpc { r#type }))
                if r#type == node_service_capability::rpc::Type::ExpandVolume as i32
        )),
        "{capabilities:?}"
    );
    h.unpublish(&id, &target).await;
    h.unstage(&id).await;
    h.delete(&id).await;
    h.finish().await;
}

/// A growth the driver recorded but did not finish (it died between the state write and the
/// allocation): start-up finishes it when there is room, and otherwise keeps the old size.
#[tokio::test]
async fn start_up_finishes_or_undoes_an_interrupted_growth() {
    let mut h = Harness::emulated(bin(), &[], |_| {}).await;
    let args = testenv::node_driver::emulated_args("node-1", &h.dirs, "1Gi");
    let fits = h.create("fits", 64 * MI, &[]).await.volume_id;
    let too_big = h.create("too-big", 64 * MI, &[]).await.volume_id;
    let state_dir = h.dirs.state.clone();
    let state = |id: &str| state_dir.join(format!("{id}.json"));
    let record_growth = |path: PathBuf, id: &str, name: &str, to: i64| {
        std::fs::write(
            path,
            serde_json::to_vec(&serde_json::json!({
                "id": id, "size": to, "growingFrom": 64 * MI,
                "parameters": {"name": name, "deviceMode": "emulated"}
            }))
            .expect("json"),
        )
        .expect("write state");
    };
    record_growth(state(&fits), &fits, "fits", 128 * MI);
    record_growth(state(&too_big), &too_big, "too-big", 4096 * MI);
    h.restart(args).await;

    assert_eq!(file_size(&volume_file(&h, &fits)), 128 * MI, "finished");
    assert_eq!(file_size(&volume_file(&h, &too_big)), 64 * MI, "undone");
    for (id, size) in [(&fits, 128 * MI), (&too_big, 64 * MI)] {
        let text = std::fs::read_to_string(state(id)).expect("state");
        assert!(
            text.contains(&format!("\"size\":{size}")) && !text.contains("growingFrom"),
            "{id}: {text}"
        );
    }
    h.delete(&fits).await;
    h.delete(&too_big).await;
    h.finish().await;
}

/// The endpoint `pmem-csi controller --resizer-endpoint` serves for csi-resizer: what
/// external-resizer v2 asks at start, answered so that it leaves growth to the node.
#[tokio::test]
async fn answers_what_external_resizer_asks_and_nothing_else() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("resizer.sock");
    let endpoint = driver::resizer_endpoint::ResizerEndpoint::bind(&socket, "pmem-csi.example.com")
        .expect("bind");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let served = tokio::spawn(endpoint.serve(shutdown.clone()));
    let channel = driver::client::connect(&socket).await.expect("connect");
    let mut identity = driver::csi::identity_client::IdentityClient::new(channel.clone());
    let mut controller = driver::csi::controller_client::ControllerClient::new(channel.clone());
    let mut node = driver::csi::node_client::NodeClient::new(channel);

    let info = identity
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .expect("info")
        .into_inner();
    assert_eq!(info.name, "pmem-csi.example.com");
    let plugin = identity
        .get_plugin_capabilities(GetPluginCapabilitiesRequest {})
        .await
        .expect("plugin capabilities")
        .into_inner();
    assert_eq!(plugin.capabilities.len(), 2, "{plugin:?}");
    let probe = identity.probe(ProbeRequest {}).await.expect("probe");
    assert_eq!(probe.into_inner().ready, Some(true));
    let controller_caps = controller
        .controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await
        .expect("controller capabilities")
        .into_inner();
    assert!(controller_caps.capabilities.is_empty());
    let node_caps = node
        .node_get_capabilities(NodeGetCapabilitiesRequest {})
        .await
        .expect("node capabilities")
        .into_inner();
    assert_eq!(node_caps.capabilities.len(), 1);
    let refused = controller
        .controller_expand_volume(ControllerExpandVolumeRequest::default())
        .await
        .expect_err("no volume passes through this endpoint");
    assert_eq!(refused.code(), tonic::Code::Unimplemented);
    let refused = node
        .node_expand_volume(NodeExpandVolumeRequest::default())
        .await
        .expect_err("no volume passes through this endpoint");
    assert_eq!(refused.code(), tonic::Code::Unimplemented);

    shutdown.cancel();
    served.await.expect("join").expect("served");
    assert!(!socket.exists(), "the socket is removed at shutdown");
}

/// The real csi-resizer beside `pmem-csi controller --resizer-endpoint`, against a real API
/// server and the PV binder: a bound claim of the driver that asks for more gets its PV raised
/// and "FileSystemResizePending", so that kubelet grows it on its node; the claim's capacity
/// stays until then, and no CSI call reaches a node.
#[tokio::test]
async fn the_central_resizer_leaves_growth_to_the_node() {
    use controllers::test_objects::{bound_to, claim, csi_volume, storage_class};
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use k8s_openapi::api::storage::v1::StorageClass;
    use kube::api::{Api, Patch, PatchParams, PostParams};
    use std::time::Duration;

    const DRIVER: &str = "pmem-csi.intel.com";
    let env = testenv::TestEnv::builder()
        .controller_without_webhook(Vec::<String>::new())
        .with_resizer()
        .start()
        .await
        .expect("testenv");
    let client = env.client().await.expect("client");
    let mut class = storage_class("grow", DRIVER, "WaitForFirstConsumer");
    class.allow_volume_expansion = Some(true);
    Api::<StorageClass>::all(client.clone())
        .create(&PostParams::default(), &class)
        .await
        .expect("class");
    let mut pv = csi_volume("pv-grow", DRIVER, "pvc-grow-0123", Some("node-1"));
    if let Some(spec) = pv.spec.as_mut() {
        spec.capacity = Some([("storage".to_string(), Quantity("1Gi".into()))].into());
        spec.storage_class_name = Some("grow".into());
        // Retain: deleting the test's objects must not call a provisioner.
        spec.persistent_volume_reclaim_policy = Some("Retain".into());
        spec.claim_ref = Some(k8s_openapi::api::core::v1::ObjectReference {
            namespace: Some("default".into()),
            name: Some("grow".into()),
            ..Default::default()
        });
    }
    let pvs = Api::<PersistentVolume>::all(client.clone());
    pvs.create(&PostParams::default(), &pv).await.expect("pv");
    let claims = Api::<PersistentVolumeClaim>::namespaced(client.clone(), "default");
    claims
        .create(
            &PostParams::default(),
            &bound_to(claim("default", "grow", "grow", "1Gi"), "pv-grow"),
        )
        .await
        .expect("claim");
    testenv::wait::until(
        "the binder to bind the claim",
        Duration::from_secs(60),
        || {
            let claims = claims.clone();
            async move {
                let phase = claims.get("grow").await.map_err(|e| e.to_string())?;
                match phase.status.and_then(|s| s.phase).as_deref() {
                    Some("Bound") => Ok(()),
                    other => Err(format!("phase {other:?}")),
                }
            }
        },
    )
    .await
    .expect("bound");

    claims
        .patch(
            "grow",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "spec": {"resources": {"requests": {"storage": "3Gi"}}}
            })),
        )
        .await
        .expect("grow the claim");
    let claim = testenv::wait::until(
        "csi-resizer to leave the growth to the node",
        Duration::from_secs(60),
        || {
            let (claims, pvs) = (claims.clone(), pvs.clone());
            async move {
                let pv = pvs.get("pv-grow").await.map_err(|e| e.to_string())?;
                let capacity = pv
                    .spec
                    .and_then(|s| s.capacity)
                    .and_then(|c| c.get("storage").cloned());
                if capacity != Some(Quantity("3Gi".into())) {
                    return Err(format!("PV capacity {capacity:?}"));
                }
                let claim = claims.get("grow").await.map_err(|e| e.to_string())?;
                let pending = claim
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "FileSystemResizePending"));
                if pending {
                    Ok(claim)
                } else {
                    Err(format!("claim status {:?}", claim.status))
                }
            }
        },
    )
    .await
    .expect("the PV raised and the claim waiting for its node");
    let status = claim.status.expect("status");
    assert_eq!(
        status.capacity.and_then(|c| c.get("storage").cloned()),
        Some(Quantity("1Gi".into())),
        "the claim's capacity changes only when the node has grown the volume"
    );
    let log = std::fs::read_to_string(env.dir().join("logs/csi-resizer.log")).expect("log");
    assert!(
        log.contains("trivial resizer") || log.contains("trivial"),
        "csi-resizer took its node-only path:\n{log}"
    );
}

/// The driver killed at each point of a growth (state written; file allocated but the loop
/// device not told; everything done but the state settled): the call fails, the restart's
/// repair finishes the growth, and kubelet's retry grows the file system; the data stays.
#[tokio::test]
async fn a_growth_cut_short_by_a_crash_is_finished() {
    for point in [
        "after-growth-state-write",
        "after-growth-allocation",
        "after-growth",
    ] {
        let root = tempfile::tempdir().expect("tempdir");
        let dirs = testenv::node_driver::NodeDriverDirs::under(root.path());
        let args = testenv::node_driver::emulated_args("node-1", &dirs, "1Gi");
        let mut h = Harness::start_with_env(
            bin(),
            root,
            dirs,
            args.clone(),
            &[(driver::faults::FAULT_POINT_ENV, point)],
        )
        .await;
        let id = h.create("crash", 320 * MI, &[]).await.volume_id;
        let target = h.path("target");
        h.stage(&id, mount("xfs")).await.expect("stage");
        h.publish(&id, &target, mount("xfs"), false, &[])
            .await
            .expect("publish");
        std::fs::write(target.join("data"), b"before the crash").expect("write");
        let before = fs_bytes(&target);
        h.expand(&id, &target, 512 * MI)
            .await
            .expect_err(&format!("the driver dies at {point}"));
        h.restart(args).await;
        assert_eq!(
            file_size(&volume_file(&h, &id)),
            512 * MI,
            "{point}: start-up finished the growth"
        );
        let state =
            std::fs::read_to_string(h.dirs.state.join(format!("{id}.json"))).expect("state");
        assert!(
            state.contains(&format!("\"size\":{}", 512 * MI)) && !state.contains("growingFrom"),
            "{point}: {state}"
        );
        assert_eq!(
            h.expand(&id, &target, 512 * MI)
                .await
                .expect("kubelet retries"),
            512 * MI,
            "{point}"
        );
        assert!(fs_bytes(&target) > before, "{point}: the file system grew");
        assert_eq!(
            std::fs::read(target.join("data")).expect("read"),
            b"before the crash",
            "{point}"
        );
        h.unpublish(&id, &target).await;
        h.unstage(&id).await;
        h.delete(&id).await;
        h.finish().await;
    }
}
