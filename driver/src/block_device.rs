//! Whole block devices of the real PMEM backends: claiming one exclusively (so that a device
//! still mounted or open elsewhere is refused, not scrubbed under its user) and zeroing it.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::{Mode, OFlags};

use crate::backend::BackendError;

/// Opens `device` for writing with `O_EXCL`, which for a block device fails with `EBUSY` while
/// it is mounted or claimed by another exclusive opener.
pub fn claim(id: &str, device: &Path) -> Result<File, BackendError> {
    let fd: OwnedFd = rustix::fs::open(
        device,
        OFlags::WRONLY | OFlags::EXCL | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| {
        if e == rustix::io::Errno::BUSY {
            BackendError::InUse {
                id: id.to_string(),
                device: device.display().to_string(),
            }
        } else {
            BackendError::io("opening", device.display(), e)
        }
    })?;
    Ok(File::from(fd))
}

/// Bytes zeroed at the start of a new volume, or of a deleted one that is not erased, so that
/// an old file system signature on the same extents is never taken for a new volume's.
pub const HEADER_BYTES: u64 = 4096;

/// Claims volume `id`'s device at `path` ([`claim`]) and zeros it: all `size` bytes when
/// `erase`, else its header.
pub fn scrub(id: &str, path: &Path, size: u64, erase: bool) -> Result<(), BackendError> {
    let mut device = claim(id, path)?;
    let bytes = if erase { size } else { size.min(HEADER_BYTES) };
    zero(&mut device, path, bytes)
}

/// Writes zeros over the first `bytes` of `device` (already claimed) and flushes them.
pub fn zero(device: &mut File, path: &Path, bytes: u64) -> Result<(), BackendError> {
    const CHUNK: usize = 1 << 20;
    let zeros = vec![0u8; CHUNK];
    let mut left = bytes;
    while left > 0 {
        let n = usize::try_from(left.min(CHUNK as u64)).unwrap_or(CHUNK);
        device
            .write_all(&zeros[..n])
            .map_err(|e| BackendError::io("zeroing", path.display(), e))?;
        left -= n as u64;
    }
    device
        .sync_all()
        .map_err(|e| BackendError::io("flushing", path.display(), e))
}

/// The size of block device `device` in bytes.
pub fn size(device: &Path) -> Result<u64, BackendError> {
    use std::io::{Seek, SeekFrom};
    let mut f = File::open(device).map_err(|e| BackendError::io("opening", device.display(), e))?;
    f.seek(SeekFrom::End(0))
        .map_err(|e| BackendError::io("sizing", device.display(), e))
}
