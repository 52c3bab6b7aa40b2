//! The real PMEM modes, `lvm` and `direct`, on emulated NVDIMMs. These tests run inside the QEMU
//! guest of `just vm-test` (tools/vm-test.sh boots tools/vm-run.sh's guest with two PMEM regions
//! and runs this binary there with `--ignored`); the host has neither NVDIMMs nor
//! device-mapper, so there they are ignored.
//!
//! Each test starts from empty regions ([`reset_pmem`]) and runs the real `pmem-csi node` with
//! the real ndctl and LVM of the guest.

use std::path::{Path, PathBuf};
use std::process::Command;

use controllers::capacity_publisher::{self, Publisher};
use controllers::volume_facts::ClassFacts;
use driver::backend::Backend;
use driver::csi::{CapacityRange, CreateVolumeRequest};
use extender::capacity_index::CapacityIndex;
use extender::fit::{self, NodeView};
use testenv::csi_client::{Harness, block, mount, params};
use testenv::csi_sanity;
use testenv::node_driver::NodeDriverDirs;
use tonic::Code;

const MI: u64 = 1 << 20;

/// csi-sanity's spec count per configuration (csi-test v5.4.0), as on the host.
const SANITY_SPECS: usize = 41;
/// lvm volumes grow: the four NodeExpandVolume specs run too (direct skips them).
const LVM_SANITY_SPECS: usize = SANITY_SPECS + 4;

/// `STATX_ATTR_DAX` (linux/stat.h).
const STATX_ATTR_DAX: u64 = 0x0020_0000;

const DRIVER: &str = "pmem-csi.intel.com";

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_pmem-csi"))
}

fn sh(script: &str) -> String {
    let out = Command::new("bash")
        .args(["-c", script])
        .output()
        .unwrap_or_else(|e| panic!("{script}: {e}"));
    assert!(
        out.status.success(),
        "{script}: {:?}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Returns the PMEM to two empty regions, whatever an earlier (failed) test left: mounts of
/// PMEM devices (file systems and raw block binds) go, then PMEM-CSI's volume groups, then
/// every namespace.
fn reset_pmem() {
    sh(
        r#"awk '$1 ~ "^/dev/(pmem|dm-|mapper/|ndbus)" || ($3 == "devtmpfs" && $2 != "/dev") {print $2}' /proc/mounts |
          sort -r | while read -r target; do umount -l "$target"; done
        for vg in $(vgs --noheadings -o vg_name 2>/dev/null); do vgremove -ff -y "$vg" >/dev/null; done
        for pv in $(pvs --noheadings -o pv_name 2>/dev/null); do pvremove -ff -y "$pv" >/dev/null; done
        dmsetup remove_all
        ndctl destroy-namespace all --force >/dev/null 2>&1 || true"#,
    );
    let regions = driver::ndctl::list().expect("ndctl list");
    assert_eq!(regions.len(), 2, "two regions: {regions:?}");
    for region in &regions {
        assert_eq!(
            region.available, region.size,
            "{} not empty: {region:?}",
            region.dev
        );
    }
}

fn driver_args(mode: &str, dirs: &NodeDriverDirs, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "node".to_string(),
        format!("--endpoint=unix://{}", dirs.socket.display()),
        "--node-id=node-1".into(),
        format!("--device-mode={mode}"),
        format!("--state-dir={}", dirs.state.display()),
        "--standalone".into(),
        "--default-volume-size=64Mi".into(),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

async fn harness(mode: &str, extra: &[&str]) -> Harness {
    let root = tempfile::tempdir().expect("tempdir");
    let dirs = NodeDriverDirs::under(root.path());
    let args = driver_args(mode, &dirs, extra);
    Harness::start(bin(), root, dirs, args).await
}

/// Volumes the backend of `mode` holds, read directly from ndctl and LVM.
fn backend_volumes(mode: &str) -> Vec<String> {
    match mode {
        "lvm" => driver::lvm::Lvm::existing().expect("lvm").list(),
        _ => driver::direct::Direct::new().expect("direct").list(),
    }
    .expect("list")
}

async fn sanity(mode: &str, access: &str) {
    reset_pmem();
    let name = format!("{mode} {access}");
    let root = tempfile::tempdir().expect("tempdir");
    let dirs = NodeDriverDirs::under(root.path());
    let args = driver_args(mode, &dirs, &[]);
    let mut extra = vec![
        format!("--csi.testvolumesize={}", 64 * MI),
        format!("--csi.testvolumeexpandsize={}", 128 * MI),
    ];
    if access == "block" {
        extra.push("--csi.testvolumeaccesstype=block".into());
    }
    let floor = if mode == "lvm" {
        LVM_SANITY_SPECS
    } else {
        SANITY_SPECS
    };
    csi_sanity::check(bin(), &name, root.path(), &dirs, args, &extra, floor).await;
    assert!(
        backend_volumes(mode).is_empty(),
        "{name}: volumes left: {:?}",
        backend_volumes(mode)
    );
}

#[tokio::test]
#[ignore = "in the QEMU guest: just vm-test"]
async fn lvm_passes_csi_sanity() {
    sanity("lvm", "mount").await;
    sanity("lvm", "block").await;
}

#[tokio::test]
#[ignore = "in the QEMU guest: just vm-test"]
async fn direct_passes_csi_sanity() {
    sanity("direct", "mount").await;
    sanity("direct", "block").await;
}

/// lvm volumes grow while in use (`lvextend`, then the file system online); direct-mode
/// namespaces cannot, and the node says so instead of offering EXPAND_VOLUME.
#[tokio::test]
#[ignore = "in the QEMU guest: just vm-test"]
async fn lvm_volumes_grow_in_use_and_direct_ones_refuse() {
    reset_pmem();
    let mut h = harness("lvm", &[]).await;
    for fs in ["ext4", "xfs"] {
        let (size, grown) = if fs == "xfs" {
            (320 * MI, 512 * MI)
        } else {
            (64 * MI, 128 * MI)
        };
        let id = h
            .create(&format!("grow-{fs}"), size as i64, &[])
            .await
            .volume_id;
        h.stage(&id, mount(fs)).await.expect("stage");
        let target = h.path("target");
        h.publish(&id, &target, mount(fs), false, &[])
            .await
            .expect("publish");
        std::fs::write(target.join("data"), b"before").expect("write");
        let reported = h.expand(&id, &target, grown as i64).await.expect("expand");
        assert_eq!(reported, grown as i64, "{fs}");
        let s = rustix::fs::statvfs(&target).expect("statvfs");
        let bytes = s.f_blocks * s.f_frsize;
        assert!(
            bytes > size && bytes <= grown,
            "{fs}: {bytes} bytes after growing"
        );
        assert_eq!(std::fs::read(target.join("data")).expect("read"), b"before");
        h.unpublish(&id, &target).await;
        h.unstage(&id).await;
        h.delete(&id).await;
    }
    let id = h.create("grow-raw", 64 * MI as i64, &[]).await.volume_id;
    h.stage(&id, block()).await.expect("stage");
    let target = h.path("raw-target");
    h.publish(&id, &target, block(), false, &[])
        .await
        .expect("publish");
    h.expand(&id, &target, 128 * MI as i64)
        .await
        .expect("expand raw");
    let mut device = std::fs::File::open(&target).expect("open");
    let end = std::io::Seek::seek(&mut device, std::io::SeekFrom::End(0)).expect("seek");
    assert_eq!(end, 128 * MI);
    drop(device);
    h.unpublish(&id, &target).await;
    h.unstage(&id).await;
    h.delete(&id).await;
    h.finish().await;
    assert!(backend_volumes("lvm").is_empty());

    reset_pmem();
    let mut h = harness("direct", &[]).await;
    let id = h.create("no-growth", 64 * MI as i64, &[]).await.volume_id;
    h.stage(&id, mount("ext4")).await.expect("stage");
    let target = h.path("target");
    h.publish(&id, &target, mount("ext4"), false, &[])
        .await
        .expect("publish");
    let err = h
        .expand(&id, &target, 128 * MI as i64)
        .await
        .expect_err("direct volumes cannot grow");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("cannot grow in place"), "{err:?}");
    let capabilities = h
        .node
        .node_get_capabilities(driver::csi::NodeGetCapabilitiesRequest {})
        .await
        .expect("capabilities")
        .into_inner();
    assert!(
        !format!("{capabilities:?}").contains("ExpandVolume")
            && capabilities.capabilities.len() == 2,
        "{capabilities:?}"
    );
    h.unpublish(&id, &target).await;
    h.unstage(&id).await;
    h.delete(&id).await;
    h.finish().await;
    assert!(backend_volumes("direct").is_empty());
}

fn has_dax(file: &Path) -> bool {
    let stat = rustix::fs::statx(
        rustix::fs::CWD,
        file,
        rustix::fs::AtFlags::empty(),
        rustix::fs::StatxFlags::BASIC_STATS,
    )
    .unwrap_or_else(|e| panic!("statx {}: {e}", file.display()));
    assert!(
        stat.stx_attributes_mask.bits() & STATX_ATTR_DAX != 0,
        "the kernel does not report the DAX attribute for {}",
        file.display()
    );
    stat.stx_attributes.bits() & STATX_ATTR_DAX != 0
}

/// AppDirect volumes are mounted with DAX and their files report `STATX_ATTR_DAX`; FileIO
/// volumes (a sector namespace in direct mode, an LV mounted without DAX in lvm mode) do not.
#[tokio::test]
#[ignore = "in the QEMU guest: just vm-test"]
async fn app_direct_files_report_dax_and_file_io_files_do_not() {
    for mode in ["lvm", "direct"] {
        reset_pmem();
        let mut h = harness(mode, &[]).await;
        for fs in ["ext4", "xfs"] {
            for (usage, want) in [("AppDirect", true), ("FileIO", false)] {
                let size = if fs == "xfs" { 320 * MI } else { 64 * MI };
                let volume = h
                    .create(
                        &format!("dax-{fs}-{usage}"),
                        size as i64,
                        &[("usage", usage)],
                    )
                    .await;
                let id = volume.volume_id;
                h.stage(&id, mount(fs)).await.expect("stage");
                let target = h.path("target");
                h.publish(&id, &target, mount(fs), false, &[])
                    .await
                    .expect("publish");
                let file = target.join("data");
                std::fs::write(&file, b"persistent").expect("write");
                assert_eq!(has_dax(&file), want, "{mode} {fs} {usage}");
                h.unpublish(&id, &target).await;
                h.unstage(&id).await;
                h.delete(&id).await;
            }
        }
        h.finish().await;
        assert!(backend_volumes(mode).is_empty(), "{mode}");
    }
}

/// The node's capacity as the extender sees it: the driver's pools, published by the capacity
/// publisher's own function, read back by the extender's index.
fn extender_view(mode: &str) -> NodeView {
    let backend: Box<dyn Backend> = match mode {
        "lvm" => Box::new(driver::lvm::Lvm::existing().expect("lvm")),
        _ => Box::new(driver::direct::Direct::new().expect("direct")),
    };
    let node_capacity = backend
        .capacity()
        .expect("capacity")
        .into_node_capacity(backend.alignment(), backend.overhead());
    let publisher = Publisher {
        driver: DRIVER.into(),
        namespace: "pmem-csi".into(),
        node: "node-1".into(),
    };
    let class = (
        "pmem-csi-sc".to_string(),
        ClassFacts {
            provisioner: DRIVER.into(),
            late_binding: true,
            ..ClassFacts::default()
        },
    );
    let objects = capacity_publisher::desired(&publisher, Some("uid-1"), &[class], &node_capacity);
    assert_eq!(objects.len(), 1);
    let mut index = CapacityIndex::new(DRIVER, 64 * MI);
    index.apply_capacity(&objects[0]);
    let published = index
        .usage("node-1", &[])
        .published
        .expect("published capacity");
    NodeView {
        pools: published.pools,
        managed: published.managed.unwrap_or(0),
        alignment: published.alignment,
        overhead: published.overhead,
        ..NodeView::default()
    }
}

/// With two regions, every pod the extender's fit admits is created by the driver, volume by
/// volume in the fit's (largest first) order, and every pod it rejects meets ResourceExhausted.
/// Sizes are fractions of the published pools, so the table holds whatever the regions' size.
#[tokio::test]
#[ignore = "in the QEMU guest: just vm-test"]
async fn the_extenders_fit_predicts_what_the_driver_creates() {
    for mode in ["direct", "lvm"] {
        reset_pmem();
        let mut h = harness(mode, &[]).await;
        let view = extender_view(mode);
        assert_eq!(view.pools.len(), 2, "{mode}: {view:?}");
        let unit = view.alignment.max(1);
        let (a, b) = (view.pools[0], view.pools[1]);
        let part = |pool: u64, num: u64, den: u64| pool / den * num / unit * unit;
        // Each case costs minutes of LVM and ndctl under TCG: every one checks a different edge.
        let cases: Vec<(&str, Vec<u64>)> = vec![
            ("largest pool exactly", vec![a]),
            ("one unit more than the largest pool", vec![a + unit]),
            ("one per pool", vec![part(a, 9, 10), part(b, 9, 10)]),
            (
                "a third does not fit",
                vec![part(a, 9, 10), part(b, 9, 10), part(a, 1, 5)],
            ),
            (
                "more than any pool, less than both",
                vec![a + part(b, 1, 2)],
            ),
            ("thirds", vec![part(a, 1, 3); 6]),
            ("thirds and one more", vec![part(a, 1, 3); 7]),
        ];
        for (name, demand) in cases {
            let predicted = fit::fit(&view, &demand);
            let mut sizes = demand.clone();
            sizes.sort_unstable_by(|x, y| y.cmp(x));
            let mut created = Vec::new();
            let mut refused = None;
            for (i, size) in sizes.iter().enumerate() {
                let response = h
                    .controller
                    .create_volume(CreateVolumeRequest {
                        name: format!("fit-{i}"),
                        capacity_range: Some(CapacityRange {
                            required_bytes: *size as i64,
                            limit_bytes: 0,
                        }),
                        volume_capabilities: vec![block()],
                        // Erasing gigabytes per case under TCG would cost minutes and
                        // test nothing about fit; csi-sanity's volumes are erased.
                        parameters: params(&[("eraseafter", "false")]),
                        ..Default::default()
                    })
                    .await;
                match response {
                    Ok(r) => created.push(r.into_inner().volume.expect("volume").volume_id),
                    Err(status) => {
                        refused = Some(status);
                        break;
                    }
                }
            }
            match (&predicted, &refused) {
                (Ok(_), None) => {}
                (Err(_), Some(status)) => assert_eq!(
                    status.code(),
                    Code::ResourceExhausted,
                    "{mode} {name}: {status:?}"
                ),
                (Ok(fit), Some(status)) => panic!(
                    "{mode} {name}: the fit placed {sizes:?} as {:?} in {view:?}, but the driver refused volume {}: {status:?}",
                    fit.placement,
                    created.len()
                ),
                (Err(_), None) => panic!(
                    "{mode} {name}: the fit rejected {sizes:?} in {view:?}, but the driver created them all"
                ),
            }
            for id in created {
                h.delete(&id).await;
            }
            // Every case starts from the same pools.
            assert_eq!(
                extender_view(mode),
                view,
                "{mode} {name}: pools not restored"
            );
        }
        h.finish().await;
    }
}

/// A volume created in lvm mode stays usable and deletable after the driver restarts in
/// direct mode (its state records its mode), and the other way round.
#[tokio::test]
#[ignore = "in the QEMU guest: just vm-test"]
async fn volumes_outlive_a_change_of_device_mode() {
    reset_pmem();
    // Half of each region for LVM leaves room for direct-mode namespaces.
    let mut h = harness("lvm", &["--pmem-percentage=50"]).await;
    let lvm_volume = h.create("from-lvm", (64 * MI) as i64, &[]).await.volume_id;
    let args = driver_args("direct", &h.dirs, &[]);
    h.restart(args).await;
    let direct_volume = h
        .create("from-direct", (64 * MI) as i64, &[])
        .await
        .volume_id;
    let mut ids = h.volume_ids().await;
    ids.sort();
    let mut want = vec![lvm_volume.clone(), direct_volume.clone()];
    want.sort();
    assert_eq!(ids, want);
    for id in [&lvm_volume, &direct_volume] {
        h.stage(id, mount("ext4")).await.expect("stage");
        let target = h.path("target");
        h.publish(id, &target, mount("ext4"), false, &[])
            .await
            .expect("publish");
        std::fs::write(target.join("f"), id.as_bytes()).expect("write");
        h.unpublish(id, &target).await;
        h.unstage(id).await;
    }
    let args = driver_args("lvm", &h.dirs, &["--pmem-percentage=50"]);
    h.restart(args).await;
    h.delete(&direct_volume).await;
    h.delete(&lvm_volume).await;
    assert!(h.volume_ids().await.is_empty());
    h.finish().await;
    assert!(backend_volumes("lvm").is_empty());
    assert!(backend_volumes("direct").is_empty());
}

/// A published raw block volume is a bind mount of its device node, which holds no exclusive
/// open of the device: DeleteVolume must still see it in use and refuse before anything is
/// zeroed (before the mount-table check, lvm and direct scrubbed it, then failed to remove it).
#[tokio::test]
#[ignore = "in the QEMU guest: just vm-test"]
async fn a_published_raw_block_volume_is_never_scrubbed() {
    use std::io::{Read, Seek, SeekFrom, Write};
    for mode in ["lvm", "direct"] {
        reset_pmem();
        let mut h = harness(mode, &[]).await;
        let id = h.create("raw", (64 * MI) as i64, &[]).await.volume_id;
        h.stage(&id, block()).await.expect("stage");
        let target = h.path("raw-target");
        h.publish(&id, &target, block(), false, &[])
            .await
            .expect("publish");
        {
            let mut device = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&target)
                .expect("open the published device");
            device.write_all(b"precious").expect("write");
            device.sync_all().expect("sync");
        }
        let err = h
            .controller
            .delete_volume(driver::csi::DeleteVolumeRequest {
                volume_id: id.clone(),
                ..Default::default()
            })
            .await
            .expect_err("in use");
        assert_eq!(
            err.code(),
            Code::FailedPrecondition,
            "{mode}: {}",
            err.message()
        );
        assert!(
            err.message().contains("in use"),
            "{mode}: {}",
            err.message()
        );
        let mut head = [0u8; 8];
        let mut device = std::fs::File::open(&target).expect("open");
        device.seek(SeekFrom::Start(0)).expect("seek");
        device.read_exact(&mut head).expect("read");
        assert_eq!(&head, b"precious", "{mode}: the volume was zeroed");
        drop(device);
        h.unpublish(&id, &target).await;
        h.unstage(&id).await;
        h.delete(&id).await;
        h.finish().await;
        assert!(backend_volumes(mode).is_empty(), "{mode}");
    }
}

/// The repository's test data, where PMEM-CSI 1.0's layouts are scripted.
fn testdata(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata")
        .join(path)
}

/// PMEM-CSI 1.0's on-PMEM layout and node state (laid out by
/// testdata/pmem-csi-1.0/layout.sh as PMEM-CSI 1.0 lays them out, with a file in each
/// volume) is adopted: the volumes are listed, stage and publish with 1.0's volume context
/// and show their data, and delete.
#[tokio::test]
#[ignore = "in the QEMU guest: just vm-test"]
async fn pmem_csi_1_0_layouts_are_adopted() {
    for mode in ["lvm", "direct"] {
        reset_pmem();
        let root = tempfile::tempdir().expect("tempdir");
        let dirs = NodeDriverDirs::under(root.path());
        std::fs::create_dir_all(&dirs.state).expect("state dir");
        let laid_out = sh(&format!(
            "bash {} {mode} {}",
            testdata("pmem-csi-1.0/layout.sh").display(),
            dirs.state.display()
        ));
        let expected: Vec<String> = laid_out.split_whitespace().map(str::to_string).collect();
        assert!(!expected.is_empty(), "{mode}: layout.sh laid out nothing");
        let args = driver_args(mode, &dirs, &[]);
        let mut h = Harness::start(bin(), root, dirs, args).await;
        let mut ids = h.volume_ids().await;
        ids.sort();
        let mut want = expected.clone();
        want.sort();
        assert_eq!(ids, want, "{mode}: adopted volumes");
        for id in &expected {
            h.stage(id, mount("ext4")).await.expect("stage");
            let target = h.path("target");
            // PMEM-CSI 1.0's PVs carry only external-provisioner's identity as context.
            h.publish(
                id,
                &target,
                mount("ext4"),
                false,
                &[(
                    "storage.kubernetes.io/csiProvisionerIdentity",
                    "1600000000000-8081-pmem-csi.intel.com",
                )],
            )
            .await
            .expect("publish");
            let text = std::fs::read_to_string(target.join("written-by-pmem-csi-1.0"))
                .expect("the file PMEM-CSI 1.0's volume holds");
            assert_eq!(text.trim(), id.as_str(), "{mode}");
            h.unpublish(id, &target).await;
            h.unstage(id).await;
            h.delete(id).await;
        }
        assert!(h.volume_ids().await.is_empty());
        h.finish().await;
        assert!(backend_volumes(mode).is_empty(), "{mode}");
    }
}
