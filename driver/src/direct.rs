//! The `direct` backend, as PMEM-CSI's direct (ndctl) mode: one namespace per volume, named by
//! its volume ID, fsdax with its page metadata on the device for `usage: AppDirect`, sector
//! (4 KiB, BTT) for `FileIO`, in the first region with room, sized in the region's alignment.
//!
//! Unlike PMEM-CSI (its issue #933), a volume's usable size is never smaller than requested:
//! the namespace is made large enough to hold its own metadata too.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use controllers::volume_cost::{VolumeOverhead, volume_cost};

use crate::backend::{Backend, BackendError, Capacity, DeviceMode, Pool, align_down};
use crate::block_device;
use crate::mounts::{self, MountInfo};
use crate::ndctl::{self, FSDAX_ALIGNMENT, Namespace, NamespaceMode, Region};
use crate::parameters::Usage;
use crate::volume_id::looks_like_volume_id;

/// What each volume keeps beside its data: an fsdax namespace's page metadata (`--map=dev`).
/// A sector (BTT) namespace keeps less (about 1 MiB plus 0.1 %, see the recorded sizes in the
/// tests), so the same charge covers both modes and the extender, which does not know a
/// volume's usage, charges every volume of the node alike.
pub const OVERHEAD: VolumeOverhead = VolumeOverhead::FSDAX_MAP_DEV;

/// Raw namespace bytes for a volume of `size` bytes on a node aligned to `alignment`: the
/// charge the extender's fit makes for it, to the byte.
pub fn raw_size(size: u64, alignment: u64) -> Option<u64> {
    volume_cost(size, alignment, Some(&OVERHEAD))
}

/// The largest volume, a multiple of `alignment`, whose namespace fits in `raw` bytes.
pub fn usable_in(raw: u64, alignment: u64) -> u64 {
    // raw_size is monotonic: binary search over multiples of the alignment.
    let unit = alignment.max(1);
    let (mut lo, mut hi) = (0u64, raw / unit);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        match raw_size(mid * unit, alignment) {
            Some(r) if r <= raw => lo = mid,
            _ => hi = mid - 1,
        }
    }
    lo * unit
}

/// The namespace mode of a volume's usage.
pub fn mode_for(usage: Usage) -> NamespaceMode {
    match usage {
        Usage::AppDirect => NamespaceMode::Fsdax,
        Usage::FileIO => NamespaceMode::Sector,
    }
}

/// One namespace per volume.
#[derive(Debug)]
pub struct Direct {
    alignment: u64,
    // ndctl's library is not safe for concurrent use on one bus (pmem/ndctl#96), and the fit
    // check must see the namespace of the volume before it.
    lock: Mutex<()>,
}

fn ndctl_err(
    op: &'static str,
    what: impl std::fmt::Display,
) -> impl FnOnce(ndctl::NdctlError) -> BackendError {
    move |e| e.into_backend(op, what)
}

impl Direct {
    /// Checks that the regions can be read and changed; volume sizes are multiples of every
    /// usable region's namespace alignment.
    pub fn new() -> Result<Self, BackendError> {
        ensure_writable_sys(Path::new("/sys"), Path::new("/host-sys"))?;
        let regions = ndctl::list().map_err(ndctl_err("listing", "PMEM regions"))?;
        // A multiple of every region's alignment, so that any volume fits any region's rules.
        let alignment = regions
            .iter()
            .filter(|r| r.usable())
            .map(Region::namespace_alignment)
            .fold(FSDAX_ALIGNMENT, ndctl::lcm);
        tracing::info!(
            regions = regions.iter().filter(|r| r.usable()).count(),
            alignment,
            "direct backend ready"
        );
        Ok(Self {
            alignment,
            lock: Mutex::new(()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn regions() -> Result<Vec<Region>, BackendError> {
        ndctl::list().map_err(ndctl_err("listing", "PMEM regions"))
    }

    /// Volume namespaces: those named like a volume ID. Others (an administrator's, the lvm
    /// mode's `pmem-csi`) are never listed, so start-up repair cannot take them for orphans.
    fn volumes(regions: &[Region]) -> impl Iterator<Item = &Namespace> {
        regions
            .iter()
            .flat_map(|r| &r.namespaces)
            .filter(|ns| ns.size > 0)
            .filter(|ns| ns.name.as_deref().is_some_and(looks_like_volume_id))
    }

    fn find(regions: &[Region], id: &str) -> Option<Namespace> {
        Self::volumes(regions)
            .find(|ns| ns.name.as_deref() == Some(id))
            .cloned()
    }

    /// A region as a pool: its free bytes raw (the extender charges volumes their metadata),
    /// its largest volume as data bytes.
    fn pool(&self, region: &Region) -> Pool {
        let free = align_down(region.available, self.alignment);
        Pool {
            name: region.dev.clone(),
            managed: region.size,
            free,
            largest: usable_in(region.max_extent.min(free), self.alignment),
        }
    }

    /// Creates the namespace in the region with the most room that can take it (the one the
    /// node publishes first, so that the extender's fit places a volume the same way).
    pub fn create_in_mode(
        &self,
        id: &str,
        size: u64,
        mode: NamespaceMode,
    ) -> Result<(), BackendError> {
        let _guard = self.lock();
        let regions = Self::regions()?;
        if let Some(ns) = Self::find(&regions, id) {
            if ns.size >= size && ns.mode == mode {
                // Adopted by a retried create: scrubbed as a new one would be (see lvm.rs).
                let Some(device) = ns.device() else {
                    return Err(BackendError::io(
                        "creating",
                        format!("namespace {id}"),
                        "it has no block device",
                    ));
                };
                return block_device::scrub(id, Path::new(&device), size, false);
            }
            return Err(BackendError::io(
                "creating",
                format!("namespace {id}"),
                format!(
                    "{} exists with {} usable bytes in mode {}",
                    ns.dev,
                    ns.size,
                    ns.mode.as_str()
                ),
            ));
        }
        let usable: Vec<&Region> = regions.iter().filter(|r| r.usable()).collect();
        let mut raw = raw_size(size, self.alignment).unwrap_or(u64::MAX);
        let Some(region) = usable
            .iter()
            .filter(|r| raw <= r.max_extent)
            .max_by(|a, b| {
                a.available
                    .cmp(&b.available)
                    .then_with(|| b.dev.cmp(&a.dev))
            })
        else {
            let pools: Vec<Pool> = usable.iter().map(|r| self.pool(r)).collect();
            return Err(BackendError::NoSpace {
                need: size,
                largest: pools.iter().map(|p| p.largest).max().unwrap_or(0),
                free: pools.iter().map(|p| p.free).sum(),
            });
        };
        loop {
            let ns = ndctl::create(&region.dev, mode, raw, id)
                .map_err(ndctl_err("creating namespace for volume", id))?;
            if ns.size >= size {
                let device = PathBuf::from(ns.device().ok_or_else(|| {
                    BackendError::io(
                        "creating",
                        format!("namespace {id}"),
                        "it has no block device",
                    )
                })?);
                return block_device::scrub(id, &device, size, false);
            }
            // The kernel kept more metadata than estimated: one step larger, if there is room.
            ndctl::destroy(&ns.dev)
                .map_err(ndctl_err("destroying undersized namespace", &ns.dev))?;
            tracing::warn!(
                id,
                raw,
                usable = ns.size,
                size,
                "namespace smaller than requested; growing it"
            );
            raw = raw.saturating_add(self.alignment);
            if raw > region.max_extent {
                return Err(BackendError::NoSpace {
                    need: size,
                    largest: self.pool(region).largest,
                    free: self.pool(region).free,
                });
            }
        }
    }
}

/// Whether the mount at `sys` in `table` is read-only (`None`: nothing mounted there).
pub fn sys_read_only(table: &[MountInfo], sys: &Path) -> Option<bool> {
    table
        .iter()
        .rev()
        .find(|m| m.mount_point == sys)
        .map(MountInfo::read_only)
}

/// ndctl changes namespaces by writing to /sys. Some container runtimes mount it read-only
/// even for privileged containers (PMEM-CSI #786, containerd #3221); the host's /sys, mounted
/// at `host_sys` by the direct overlay, is then bound over it, as PMEM-CSI does.
fn ensure_writable_sys(sys: &Path, host_sys: &Path) -> Result<(), BackendError> {
    let table =
        || mounts::table().map_err(|e| BackendError::io("reading", "/proc/self/mountinfo", e));
    if sys_read_only(&table()?, sys) != Some(true) {
        return Ok(());
    }
    if !host_sys.exists() {
        return Err(BackendError::io(
            "checking",
            sys.display(),
            format!(
                "it is mounted read-only and {} does not exist to bind over it",
                host_sys.display()
            ),
        ));
    }
    mounts::bind(host_sys, sys, false).map_err(|e| {
        BackendError::io(
            "bind-mounting",
            format!("{} on {}", host_sys.display(), sys.display()),
            e,
        )
    })?;
    tracing::info!(
        "{} was read-only: bound {} over it",
        sys.display(),
        host_sys.display()
    );
    if sys_read_only(&table()?, sys) == Some(true) {
        return Err(BackendError::io(
            "checking",
            sys.display(),
            "still read-only after binding the host's over it",
        ));
    }
    Ok(())
}

impl Backend for Direct {
    fn mode(&self) -> DeviceMode {
        DeviceMode::Direct
    }

    fn growth_refused(&self) -> Option<&'static str> {
        Some(
            "an fsdax namespace cannot grow in place (its StorageClasses say allowVolumeExpansion: false)",
        )
    }

    fn alignment(&self) -> u64 {
        self.alignment
    }

    fn overhead(&self) -> Option<VolumeOverhead> {
        Some(OVERHEAD)
    }

    fn capacity(&self) -> Result<Capacity, BackendError> {
        let regions = Self::regions()?;
        let total = regions.iter().map(|r| r.size).sum();
        let pools = regions
            .iter()
            .filter(|r| r.usable())
            .map(|r| self.pool(r))
            .collect();
        Ok(Capacity::new(pools, total))
    }

    fn create(&self, id: &str, size: u64, usage: Usage) -> Result<(), BackendError> {
        self.create_in_mode(id, size, mode_for(usage))
    }

    fn delete(&self, id: &str, erase: bool) -> Result<(), BackendError> {
        let _guard = self.lock();
        let regions = Self::regions()?;
        let Some(ns) = Self::find(&regions, id) else {
            return Ok(());
        };
        if let Some(device) = ns.device() {
            block_device::scrub(id, Path::new(&device), ns.size, erase)?;
        }
        ndctl::destroy(&ns.dev).map_err(ndctl_err("destroying namespace", &ns.dev))
    }

    fn size_of(&self, id: &str) -> Result<Option<u64>, BackendError> {
        Ok(Self::find(&Self::regions()?, id).map(|ns| align_down(ns.size, self.alignment)))
    }

    fn list(&self) -> Result<Vec<String>, BackendError> {
        let regions = Self::regions()?;
        Ok(Self::volumes(&regions)
            .filter_map(|ns| ns.name.clone())
            .collect())
    }

    fn attach(&self, id: &str) -> Result<PathBuf, BackendError> {
        self.attached(id)?.ok_or_else(|| {
            BackendError::io(
                "staging",
                format!("namespace {id}"),
                "it does not exist or has no block device",
            )
        })
    }

    fn attached(&self, id: &str) -> Result<Option<PathBuf>, BackendError> {
        Ok(Self::find(&Self::regions()?, id)
            .and_then(|ns| ns.device())
            .map(PathBuf::from))
    }

    fn detach(&self, _id: &str) -> Result<(), BackendError> {
        // A namespace is a device for as long as it exists.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MI: u64 = 1 << 20;

    #[test]
    fn raw_sizes_hold_their_metadata() {
        for (size, align, want) in [
            (64 * MI, 16 * MI, 80 * MI),
            (1024 * MI, 16 * MI, 1056 * MI),
            (2 * MI, 2 * MI, 4 * MI),
            (48 * MI, 16 * MI, 64 * MI),
        ] {
            assert_eq!(raw_size(size, align), Some(want), "{size}");
        }
        assert_eq!(raw_size(u64::MAX, 16 * MI), None);
    }

    /// The charge never undercuts the kernel: for each namespace ndctl created in the guest
    /// (testdata/ndctl, region alignment 16 MiB), fsdax and sector alike, the raw size charged
    /// for its usable size is at least the raw size it was created with.
    #[test]
    fn charges_cover_recorded_namespaces() {
        for (raw, usable) in [
            (64 * MI, 65011712),
            (48 * MI, 48234496),
            (32 * MI, 31457280),
            (16 * MI, 14680064),
            (1024 * MI, 1054867456),
            (32 * MI, 32440320),
            (48 * MI, 49201152),
            (64 * MI, 65961984),
        ] {
            let charged = raw_size(usable, 16 * MI).expect("finite");
            assert!(charged >= raw, "{usable}: charged {charged} < {raw}");
        }
    }

    #[test]
    fn read_only_sys_is_detected_on_the_last_mount() {
        let table = crate::mounts::parse(
            "22 1 0:21 / /sys ro,nosuid - sysfs sysfs ro\n\
             23 22 0:21 / /sys rw,relatime - sysfs sysfs rw\n\
             24 1 0:22 / /proc rw - proc proc rw\n",
        );
        assert_eq!(sys_read_only(&table, Path::new("/sys")), Some(false));
        assert_eq!(sys_read_only(&table[..1], Path::new("/sys")), Some(true));
        assert_eq!(sys_read_only(&table, Path::new("/host-sys")), None);
    }

    #[test]
    fn usable_is_the_inverse_of_raw() {
        for raw in [0, 16 * MI, 80 * MI, 95 * MI, 4096 * MI] {
            let usable = usable_in(raw, 16 * MI);
            assert_eq!(usable % (16 * MI), 0);
            if usable > 0 {
                assert!(raw_size(usable, 16 * MI).expect("fits") <= raw, "{raw}");
            }
            let next = raw_size(usable + 16 * MI, 16 * MI).expect("finite");
            assert!(next > raw, "{raw}: {usable} is not the largest");
        }
    }
}
