//! The `lvm` backend, laid out as PMEM-CSI lays it out so that its volumes carry over: per
//! enabled PMEM region one fsdax namespace named `pmem-csi` (sized by `--pmem-percentage`), in a
//! volume group named `<bus><region>fsdax`; each volume a logical volume named by its volume
//! ID, in 4 MiB extents, on the group with the most free space.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::Value;

use crate::backend::{Backend, BackendError, Capacity, DeviceMode, Pool, align_down};
use crate::block_device;
use crate::ndctl::{self, NamespaceMode, PMEM_CSI_NAMESPACE, Region};
use crate::parameters::Usage;
use crate::tool::{self, ToolError};

/// Logical volumes are multiples of LVM's default extent, as in PMEM-CSI.
pub const LVM_ALIGNMENT: u64 = 4 << 20;

/// The volume group PMEM-CSI puts a region's `pmem-csi` namespaces in.
pub fn vg_name(region: &Region) -> String {
    format!("{}{}fsdax", region.bus, region.dev)
}

/// One volume group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeGroup {
    /// Name.
    pub name: String,
    /// Bytes in its physical volumes.
    pub size: u64,
    /// Bytes in free extents.
    pub free: u64,
}

/// One logical volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogicalVolume {
    /// Name (the volume ID).
    pub name: String,
    /// Its volume group.
    pub vg: String,
    /// Bytes.
    pub size: u64,
    /// Device path (`/dev/<vg>/<lv>`).
    pub path: PathBuf,
}

fn lvm_output(what: impl Into<String>, text: &str) -> BackendError {
    BackendError::io(
        "parsing lvm output",
        what.into(),
        text.chars().take(400).collect::<String>(),
    )
}

/// The rows of an LVM JSON report (`--reportformat json`) of `kind` (`vg`, `lv`, `pv`).
fn report_rows<'a>(root: &'a Value, kind: &str) -> Vec<&'a Value> {
    root.get("report")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|r| r.get(kind).and_then(Value::as_array))
        .flatten()
        .collect()
}

fn field<'a>(row: &'a Value, name: &str, text: &str) -> Result<&'a str, BackendError> {
    row.get(name)
        .and_then(Value::as_str)
        .ok_or_else(|| lvm_output(format!("no {name:?}"), text))
}

fn bytes(row: &Value, name: &str, text: &str) -> Result<u64, BackendError> {
    field(row, name, text)?
        .parse()
        .map_err(|_| lvm_output(format!("{name:?} is not a byte count"), text))
}

fn parse_json(text: &str) -> Result<Value, BackendError> {
    serde_json::from_str(text).map_err(|e| lvm_output(format!("not JSON: {e}"), text))
}

/// Parses `vgs --reportformat json --units b --nosuffix -o vg_name,vg_size,vg_free`.
pub fn parse_vgs(text: &str) -> Result<Vec<VolumeGroup>, BackendError> {
    let root = parse_json(text)?;
    report_rows(&root, "vg")
        .into_iter()
        .map(|row| {
            Ok(VolumeGroup {
                name: field(row, "vg_name", text)?.to_string(),
                size: bytes(row, "vg_size", text)?,
                free: bytes(row, "vg_free", text)?,
            })
        })
        .collect()
}

/// Parses `lvs --reportformat json --units b --nosuffix -o lv_name,vg_name,lv_size,lv_path`.
pub fn parse_lvs(text: &str) -> Result<Vec<LogicalVolume>, BackendError> {
    let root = parse_json(text)?;
    report_rows(&root, "lv")
        .into_iter()
        .map(|row| {
            Ok(LogicalVolume {
                name: field(row, "lv_name", text)?.to_string(),
                vg: field(row, "vg_name", text)?.to_string(),
                size: bytes(row, "lv_size", text)?,
                path: PathBuf::from(field(row, "lv_path", text)?),
            })
        })
        .collect()
}

/// The device path LVM gives logical volume `lv` of group `vg` (what `lvs -o lv_path` reports).
pub fn lv_path(vg: &str, lv: &str) -> PathBuf {
    Path::new("/dev").join(vg).join(lv)
}

/// The group a new volume of `size` bytes goes to: the one with the most free space (which
/// the node publishes first, so that the extender's fit places a lone volume the same way),
/// ties by name.
pub fn choose_vg(vgs: &[VolumeGroup], size: u64) -> Option<&VolumeGroup> {
    vgs.iter()
        .filter(|vg| vg.free >= size)
        .max_by(|a, b| a.free.cmp(&b.free).then_with(|| b.name.cmp(&a.name)))
}

/// Raw bytes for a new `pmem-csi` namespace in `region`: `percentage` of the region, less what
/// its `pmem-csi` namespaces already hold (`own_raw`), within its largest free extent, aligned
/// down so that ndctl's rounding up can never exceed the extent.
pub fn namespace_budget(region: &Region, percentage: u8, own_raw: u64) -> u64 {
    let allowed = u64::try_from(u128::from(region.size) * u128::from(percentage) / 100)
        .unwrap_or(u64::MAX)
        .saturating_sub(own_raw)
        .min(region.available)
        .min(region.max_extent);
    let aligned = align_down(allowed, region.namespace_alignment());
    // A namespace smaller than one alignment unit holds no extent worth a volume group.
    if aligned < region.namespace_alignment() {
        0
    } else {
        aligned
    }
}

/// Whether a failed `lvcreate` ran out of room (rather than failing otherwise).
pub fn is_no_space(stderr: &str) -> bool {
    stderr.contains("Insufficient free space") || stderr.contains("insufficient free space")
}

/// Whether a failed `lvs`/`lvremove` names a volume that does not exist.
pub fn is_missing(stderr: &str) -> bool {
    stderr.contains("Failed to find logical volume") || stderr.contains("not found")
}

const LV_FIELDS: &str = "lv_name,vg_name,lv_size,lv_path";
const VG_FIELDS: &str = "vg_name,vg_size,vg_free";

/// Runs an LVM report command (`vgs`, `lvs`) over `groups` in JSON with sizes in bytes.
fn report(command: &str, fields: &str, groups: &[String]) -> Result<String, ToolError> {
    let mut args = vec![
        "--reportformat",
        "json",
        "--units",
        "b",
        "--nosuffix",
        "-o",
        fields,
    ];
    args.extend(groups.iter().map(String::as_str));
    tool::run(command, &args)
}

/// Logical volumes in PMEM-CSI's volume groups on this node's PMEM.
#[derive(Debug)]
pub struct Lvm {
    vgs: Vec<String>,
    total: u64,
    // Serializes LVM commands, as PMEM-CSI does: concurrent lvcreate/lvremove on the same
    // group behaved inconsistently in its stress tests, and the fit check must see the
    // allocation of the volume before it.
    lock: Mutex<()>,
}

fn tool_err(
    op: &'static str,
    what: impl std::fmt::Display,
) -> impl FnOnce(ToolError) -> BackendError {
    move |e| BackendError::tool(op, what, e)
}

fn ndctl_err(e: ndctl::NdctlError) -> BackendError {
    e.into_backend("reading PMEM regions", "ndctl")
}

impl Lvm {
    /// Sets up the layout (idempotent: a restart adds only what `percentage` newly allows) and
    /// returns the backend over every volume group it finds.
    pub fn new(percentage: u8) -> Result<Self, BackendError> {
        let regions = ndctl::list().map_err(ndctl_err)?;
        let total = regions.iter().map(|r| r.size).sum();
        let mut vgs = Vec::new();
        for region in regions.iter().filter(|r| r.usable()) {
            Self::set_up_region(region, percentage)?;
            let name = vg_name(region);
            if Self::vg_exists(&name)? {
                vgs.push(name);
            }
        }
        tracing::info!(?vgs, total, percentage, "lvm backend ready");
        Ok(Self {
            vgs,
            total,
            lock: Mutex::new(()),
        })
    }

    /// Adopts existing groups only (a driver started in another mode deleting or staging old
    /// volumes: PMEM-CSI creates no namespace then either).
    pub fn existing() -> Result<Self, BackendError> {
        Self::new(0)
    }

    fn set_up_region(region: &Region, percentage: u8) -> Result<(), BackendError> {
        let own: Vec<_> = region
            .namespaces
            .iter()
            .filter(|ns| ns.name.as_deref() == Some(PMEM_CSI_NAMESPACE))
            .collect();
        // What the region holds outside its free space and foreign namespaces is ours; ndctl
        // lists usable sizes only, which undercount fsdax namespaces by their page metadata.
        let used = region.size.saturating_sub(region.available);
        let foreign: u64 = region
            .namespaces
            .iter()
            .filter(|ns| ns.name.as_deref() != Some(PMEM_CSI_NAMESPACE))
            .map(|ns| ns.size)
            .sum();
        let own_raw = if own.is_empty() {
            0
        } else {
            used.saturating_sub(foreign)
        };
        let budget = namespace_budget(region, percentage, own_raw);
        let mut devices: Vec<String> = own
            .iter()
            .filter(|ns| ns.enabled && ns.mode == NamespaceMode::Fsdax)
            .filter_map(|ns| ns.device())
            .collect();
        if budget > 0 {
            let ns = ndctl::create(
                &region.dev,
                NamespaceMode::Fsdax,
                budget,
                PMEM_CSI_NAMESPACE,
            )
            .map_err(|e| e.into_backend("creating a pmem-csi namespace in", &region.dev))?;
            let device = ns.device().ok_or_else(|| {
                BackendError::io(
                    "creating a pmem-csi namespace in",
                    &region.dev,
                    "no block device",
                )
            })?;
            // A namespace re-created over old extents may carry an old PV label, which would
            // make LVM see a duplicate of a group.
            tool::run("wipefs", &["--all", "--force", &device])
                .map_err(tool_err("wiping", &device))?;
            tracing::info!(
                region = region.dev,
                device,
                budget,
                "created pmem-csi namespace"
            );
            devices.push(device);
        }
        let mut unused = Vec::new();
        for device in devices {
            let owner = tool::run("pvs", &["--noheadings", "-o", "vg_name", &device]);
            match owner {
                Ok(vg) if !vg.trim().is_empty() => {}
                _ => unused.push(device),
            }
        }
        if unused.is_empty() {
            return Ok(());
        }
        let vg = vg_name(region);
        let verb = if Self::vg_exists(&vg)? {
            "vgextend"
        } else {
            "vgcreate"
        };
        let mut args = vec!["--force", vg.as_str()];
        args.extend(unused.iter().map(String::as_str));
        tool::run(verb, &args).map_err(tool_err("setting up volume group", &vg))?;
        tracing::info!(vg, ?unused, verb, "volume group set up");
        Ok(())
    }

    fn vg_exists(name: &str) -> Result<bool, BackendError> {
        Ok(Self::groups(&[name.to_string()])?
            .iter()
            .any(|vg| vg.name == name))
    }

    fn groups(names: &[String]) -> Result<Vec<VolumeGroup>, BackendError> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        match report("vgs", VG_FIELDS, names) {
            Ok(text) => parse_vgs(&text),
            // vgs fails for a name it does not know but still reports the others.
            Err(e) if e.stderr().contains("not found") => {
                let known: Vec<String> = names
                    .iter()
                    .filter(|n| !e.stderr().contains(&format!("\"{n}\" not found")))
                    .cloned()
                    .collect();
                if known.len() == names.len() {
                    return Err(BackendError::tool(
                        "listing volume groups",
                        names.join(" "),
                        e,
                    ));
                }
                Self::groups(&known)
            }
            Err(e) => Err(BackendError::tool(
                "listing volume groups",
                names.join(" "),
                e,
            )),
        }
    }

    fn volumes(&self) -> Result<Vec<LogicalVolume>, BackendError> {
        if self.vgs.is_empty() {
            return Ok(Vec::new());
        }
        parse_lvs(
            &report("lvs", LV_FIELDS, &self.vgs)
                .map_err(tool_err("listing logical volumes in", self.vgs.join(" ")))?,
        )
    }

    fn volume(&self, id: &str) -> Result<Option<LogicalVolume>, BackendError> {
        Ok(self.volumes()?.into_iter().find(|lv| lv.name == id))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Backend for Lvm {
    fn mode(&self) -> DeviceMode {
        DeviceMode::Lvm
    }

    fn alignment(&self) -> u64 {
        LVM_ALIGNMENT
    }

    fn capacity(&self) -> Result<Capacity, BackendError> {
        let pools = Self::groups(&self.vgs)?
            .into_iter()
            .map(|vg| Pool {
                largest: align_down(vg.free, LVM_ALIGNMENT),
                free: align_down(vg.free, LVM_ALIGNMENT),
                managed: vg.size,
                name: vg.name,
            })
            .collect();
        Ok(Capacity::new(pools, self.total))
    }

    fn create(&self, id: &str, size: u64, _usage: Usage) -> Result<(), BackendError> {
        let _guard = self.lock();
        if let Some(lv) = self.volume(id)? {
            if lv.size == size {
                // Left by a create that failed or was cut short before its scrub, and adopted
                // by the retry: its extents may still show an old volume's file system.
                return block_device::scrub(id, &lv.path, size, false);
            }
            return Err(BackendError::io(
                "creating",
                format!("logical volume {id}"),
                format!("it exists with {} bytes instead of {size}", lv.size),
            ));
        }
        let groups = Self::groups(&self.vgs)?;
        let Some(vg) = choose_vg(&groups, size) else {
            return Err(BackendError::NoSpace {
                need: size,
                largest: groups
                    .iter()
                    .map(|g| align_down(g.free, LVM_ALIGNMENT))
                    .max()
                    .unwrap_or(0),
                free: groups.iter().map(|g| g.free).sum(),
            });
        };
        let bytes = format!("{size}B");
        match tool::run("lvcreate", &["-Zn", "-L", &bytes, "-n", id, &vg.name]) {
            Ok(_) => {}
            Err(e) if is_no_space(e.stderr()) => {
                return Err(BackendError::NoSpace {
                    need: size,
                    largest: align_down(vg.free, LVM_ALIGNMENT),
                    free: groups.iter().map(|g| g.free).sum(),
                });
            }
            Err(e) => {
                return Err(BackendError::tool(
                    "creating",
                    format!("logical volume {id} in {}", vg.name),
                    e,
                ));
            }
        }
        // lvcreate returns once the device node exists (after udev settles, or made by
        // libdevmapper itself without udev), at LVM's fixed path: no second lvs under the lock.
        let path = lv_path(&vg.name, id);
        block_device::scrub(id, &path, size, false)
    }

    fn growth_refused(&self) -> Option<&'static str> {
        None
    }

    fn grow(&self, id: &str, size: u64) -> Result<(), BackendError> {
        let _guard = self.lock();
        let Some(lv) = self.volume(id)? else {
            return Err(BackendError::io(
                "growing",
                format!("logical volume {id}"),
                "it does not exist",
            ));
        };
        if lv.size >= size {
            return Ok(());
        }
        let need = size - lv.size;
        // A logical volume grows within its own group only.
        let free = Self::groups(std::slice::from_ref(&lv.vg))?
            .first()
            .map_or(0, |g| g.free);
        let no_space = || BackendError::NoSpace {
            need,
            largest: align_down(free, LVM_ALIGNMENT),
            free,
        };
        if need > align_down(free, LVM_ALIGNMENT) {
            return Err(no_space());
        }
        let target = format!("{}/{}", lv.vg, lv.name);
        match tool::run("lvextend", &["-L", &format!("{size}B"), &target]) {
            Ok(_) => Ok(()),
            Err(e) if is_no_space(e.stderr()) => Err(no_space()),
            Err(e) => Err(BackendError::tool(
                "growing",
                format!("logical volume {target}"),
                e,
            )),
        }
    }

    fn delete(&self, id: &str, erase: bool) -> Result<(), BackendError> {
        let _guard = self.lock();
        let Some(lv) = self.volume(id)? else {
            return Ok(());
        };
        // Scrubbed (and closed) before lvremove, which refuses an open volume.
        block_device::scrub(id, &lv.path, lv.size, erase)?;
        let target = format!("{}/{}", lv.vg, lv.name);
        match tool::run("lvremove", &["-fy", &target]) {
            Ok(_) => Ok(()),
            Err(e) if is_missing(e.stderr()) => Ok(()),
            Err(e) => Err(BackendError::tool(
                "removing",
                format!("logical volume {target}"),
                e,
            )),
        }
    }

    fn size_of(&self, id: &str) -> Result<Option<u64>, BackendError> {
        Ok(self.volume(id)?.map(|lv| lv.size))
    }

    fn list(&self) -> Result<Vec<String>, BackendError> {
        Ok(self.volumes()?.into_iter().map(|lv| lv.name).collect())
    }

    fn attach(&self, id: &str) -> Result<PathBuf, BackendError> {
        self.attached(id)?.ok_or_else(|| {
            BackendError::io(
                "staging",
                format!("logical volume {id}"),
                "it does not exist",
            )
        })
    }

    fn attached(&self, id: &str) -> Result<Option<PathBuf>, BackendError> {
        Ok(self.volume(id)?.map(|lv| lv.path))
    }

    fn detach(&self, _id: &str) -> Result<(), BackendError> {
        // A logical volume is a device for as long as it exists.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MI: u64 = 1 << 20;

    fn vg(name: &str, free: u64) -> VolumeGroup {
        VolumeGroup {
            name: name.into(),
            size: 1024 * MI,
            free,
        }
    }

    #[test]
    fn the_group_with_most_room_takes_the_volume() {
        let groups = [
            vg("ndbus0region0fsdax", 100 * MI),
            vg("ndbus0region1fsdax", 200 * MI),
        ];
        for (size, want) in [
            (4 * MI, Some("ndbus0region1fsdax")),
            (200 * MI, Some("ndbus0region1fsdax")),
            (204 * MI, None),
        ] {
            assert_eq!(
                choose_vg(&groups, size).map(|g| g.name.as_str()),
                want,
                "{size}"
            );
        }
        let tie = [vg("b", 8 * MI), vg("a", 8 * MI)];
        assert_eq!(choose_vg(&tie, 8 * MI).map(|g| g.name.as_str()), Some("a"));
        assert_eq!(choose_vg(&[], 0), None);
    }

    fn region(size: u64, available: u64, max_extent: u64) -> Region {
        Region {
            bus: "ndbus0".into(),
            dev: "region1".into(),
            size,
            available,
            max_extent,
            align: Some(16 * MI),
            interleave_ways: 1,
            kind: "pmem".into(),
            enabled: true,
            namespaces: Vec::new(),
        }
    }

    #[test]
    fn namespace_budget_table() {
        const GI: u64 = 1 << 30;
        for (name, r, pct, own, want) in [
            (
                "all of a fresh region",
                region(4 * GI, 4 * GI, 4 * GI),
                100,
                0,
                4 * GI,
            ),
            ("half", region(4 * GI, 4 * GI, 4 * GI), 50, 0, 2 * GI),
            (
                "restart: already there",
                region(4 * GI, 0, 0),
                100,
                4 * GI,
                0,
            ),
            (
                "grown percentage",
                region(4 * GI, 2 * GI, 2 * GI),
                100,
                2 * GI,
                2 * GI,
            ),
            (
                "capped by the free extent",
                region(4 * GI, 3 * GI, GI),
                100,
                0,
                GI,
            ),
            (
                "aligned down",
                region(4 * GI, 4 * GI, 4 * GI),
                33,
                0,
                1344 * MI,
            ),
            (
                "less than one unit",
                region(4 * GI, 4 * GI, 4 * GI),
                100,
                4 * GI - 8 * MI,
                0,
            ),
            ("zero percent", region(4 * GI, 4 * GI, 4 * GI), 0, 0, 0),
        ] {
            assert_eq!(namespace_budget(&r, pct, own), want, "{name}");
        }
    }

    fn recorded(name: &str) -> String {
        crate::tool::recorded("lvm", name)
    }

    #[test]
    fn recorded_reports_parse() {
        let groups = parse_vgs(&recorded("vgs-2-vg.json")).expect("vgs");
        assert_eq!(
            groups,
            [
                VolumeGroup {
                    name: "ndbus0region0fsdax".into(),
                    size: 1052770304,
                    free: 880803840
                },
                VolumeGroup {
                    name: "ndbus0region1fsdax".into(),
                    size: 524288000,
                    free: 490733568
                },
            ]
        );
        assert!(
            parse_vgs(&recorded("vgs-no-vg.json"))
                .expect("none")
                .is_empty()
        );
        assert!(
            parse_vgs(&recorded("vgs-missing-vg.json"))
                .expect("missing")
                .is_empty()
        );
        let volumes = parse_lvs(&recorded("lvs-2-lv.json")).expect("lvs");
        assert_eq!(volumes.len(), 2);
        assert_eq!(volumes[1].name, "vol2");
        assert_eq!(volumes[1].size, 100 * MI);
        assert_eq!(volumes[1].path, Path::new("/dev/ndbus0region0fsdax/vol2"));
        for lv in &volumes {
            assert_eq!(lv_path(&lv.vg, &lv.name), lv.path, "{lv:?}");
        }
        assert!(
            parse_lvs(&recorded("lvs-0-lv.json"))
                .expect("empty")
                .is_empty()
        );
        for bad in ["", "[]x", r#"{"report":[{"lv":[{"lv_name":"a"}]}]}"#] {
            assert!(parse_lvs(bad).is_err(), "{bad:?}");
        }
        let bad_size = r#"{"report":[{"vg":[{"vg_name":"a","vg_size":"1.5g","vg_free":"0"}]}]}"#;
        assert!(parse_vgs(bad_size).is_err());
    }

    #[test]
    fn recorded_errors_classify() {
        let stderr = |f: &str| recorded(f).trim().to_string();
        assert!(is_no_space(&stderr("lvcreate-insufficient.stderr")));
        assert!(!is_no_space(&stderr("lvcreate-exists.stderr")));
        assert!(!is_no_space(&stderr("lvcreate-missing-vg.stderr")));
        assert!(is_missing(&stderr("lvremove-missing.stderr")));
        assert!(!is_missing(&stderr("lvcreate-insufficient.stderr")));
    }

    #[test]
    fn vg_names_are_pmem_csis() {
        assert_eq!(vg_name(&region(0, 0, 0)), "ndbus0region1fsdax");
    }
}
