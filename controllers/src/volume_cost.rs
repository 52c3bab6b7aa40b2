//! What a volume of a given size takes from a pool: its size plus, where the backend keeps
//! metadata beside the data on the device (the direct mode's fsdax namespaces keep a `struct
//! page` per 4 KiB page), that metadata, rounded up to the node's alignment. The node driver
//! sizes its devices with it and publishes the overhead; the extender's fit charges volumes with
//! the same function, so that both agree to the byte.

use std::fmt;
use std::str::FromStr;

/// Per-volume metadata on the device:
/// `align_up(ceil(size / page) × per_page + fixed, granule)` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VolumeOverhead {
    /// Metadata bytes per page of data.
    pub per_page: u64,
    /// Page size in bytes.
    pub page: u64,
    /// Metadata bytes per volume besides the per-page ones.
    pub fixed: u64,
    /// The metadata is rounded up to a multiple of this.
    pub granule: u64,
}

/// A published overhead that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("volume overhead {text:?}: {reason}")]
pub struct OverheadError {
    /// The published text.
    pub text: String,
    /// What is wrong with it.
    pub reason: String,
}

impl VolumeOverhead {
    /// fsdax with `--map=dev`: 64 bytes of `struct page` per 4 KiB page and an 8 KiB info block,
    /// in the 2 MiB huge-page alignment of the data that follows.
    pub const FSDAX_MAP_DEV: Self = Self {
        per_page: 64,
        page: 4096,
        fixed: 8192,
        granule: 2 << 20,
    };

    /// Metadata bytes for a volume of `size` data bytes; `None` on overflow.
    pub fn bytes(&self, size: u64) -> Option<u64> {
        let pages = size.div_ceil(self.page.max(1));
        let raw = pages.checked_mul(self.per_page)?.checked_add(self.fixed)?;
        round_up(raw, self.granule)
    }
}

fn round_up(size: u64, unit: u64) -> Option<u64> {
    if unit <= 1 {
        Some(size)
    } else {
        size.checked_next_multiple_of(unit)
    }
}

/// What a volume of `size` bytes takes from a pool of a node with `alignment` and `overhead`;
/// `None` on overflow (it fits nowhere).
pub fn volume_cost(size: u64, alignment: u64, overhead: Option<&VolumeOverhead>) -> Option<u64> {
    let raw = match overhead {
        Some(o) => size.checked_add(o.bytes(size)?)?,
        None => size,
    };
    round_up(raw, alignment)
}

impl fmt::Display for VolumeOverhead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "per-page={},page={},fixed={},granule={}",
            self.per_page, self.page, self.fixed, self.granule
        )
    }
}

impl FromStr for VolumeOverhead {
    type Err = OverheadError;

    fn from_str(text: &str) -> Result<Self, OverheadError> {
        let error = |reason: String| OverheadError {
            text: text.to_string(),
            reason,
        };
        let (mut per_page, mut page, mut fixed, mut granule) = (None, None, None, None);
        for part in text.split(',') {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| error(format!("{part:?} is not key=value")))?;
            let value: u64 = value
                .trim()
                .parse()
                .map_err(|_| error(format!("{key}: {value:?} is not a byte count")))?;
            let slot = match key.trim() {
                "per-page" => &mut per_page,
                "page" => &mut page,
                "fixed" => &mut fixed,
                "granule" => &mut granule,
                other => return Err(error(format!("unknown key {other:?}"))),
            };
            *slot = Some(value);
        }
        let need = |v: Option<u64>, key: &str| v.ok_or_else(|| error(format!("{key} missing")));
        let overhead = Self {
            per_page: need(per_page, "per-page")?,
            page: need(page, "page")?,
            fixed: need(fixed, "fixed")?,
            granule: need(granule, "granule")?,
        };
        if overhead.page == 0 {
            return Err(error("page must be larger than 0".into()));
        }
        Ok(overhead)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MI: u64 = 1 << 20;

    #[test]
    fn fsdax_costs() {
        let fsdax = Some(&VolumeOverhead::FSDAX_MAP_DEV);
        for (size, alignment, overhead, want) in [
            (64 * MI, 4 * MI, None, Some(64 * MI)),
            (MI + 1, 4 * MI, None, Some(4 * MI)),
            (4 * MI + 1, 4 * MI, None, Some(8 * MI)),
            (5, 1, None, Some(5)),
            (64 * MI, 16 * MI, fsdax, Some(80 * MI)),
            (62 * MI, 16 * MI, fsdax, Some(64 * MI)),
            (14 * MI, 16 * MI, fsdax, Some(16 * MI)),
            (1006 * MI, 16 * MI, fsdax, Some(1024 * MI)),
            (1024 * MI, 16 * MI, fsdax, Some(1056 * MI)),
            (0, 16 * MI, fsdax, Some(16 * MI)),
            (u64::MAX, 16 * MI, fsdax, None),
            (u64::MAX - 10, 1, None, Some(u64::MAX - 10)),
        ] {
            assert_eq!(
                volume_cost(size, alignment, overhead),
                want,
                "{size} {alignment} {overhead:?}"
            );
        }
    }

    #[test]
    fn annotation_round_trip_and_errors() {
        let text = VolumeOverhead::FSDAX_MAP_DEV.to_string();
        assert_eq!(text, "per-page=64,page=4096,fixed=8192,granule=2097152");
        assert_eq!(text.parse(), Ok(VolumeOverhead::FSDAX_MAP_DEV));
        for (bad, reason) in [
            ("", "is not key=value"),
            ("per-page=64,page=4096,fixed=8192", "granule missing"),
            (
                "per-page=64,page=0,fixed=8192,granule=1",
                "page must be larger than 0",
            ),
            ("per-page=x,page=1,fixed=1,granule=1", "is not a byte count"),
            ("per-page=1,page=1,fixed=1,granule=1,extra=2", "unknown key"),
        ] {
            let err = bad.parse::<VolumeOverhead>().expect_err(bad);
            assert!(err.to_string().contains(reason), "{bad}: {err}");
        }
    }
}
