//! The `fake` backend: volumes exist only in memory (and in node state), no devices. For scale
//! tests of the control plane; staging and publishing fail with a clear message.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

use crate::backend::{Backend, BackendError, Capacity, DeviceMode, Pool, align_down};
use crate::parameters::Usage;

/// Alignment of fake volumes, as for emulated ones.
pub const FAKE_ALIGNMENT: u64 = 4 << 20;

/// In-memory volumes within a byte budget.
#[derive(Debug)]
pub struct Fake {
    size: u64,
    volumes: Mutex<BTreeMap<String, u64>>,
}

impl Fake {
    /// A fake region of `size` bytes.
    pub fn new(size: u64) -> Self {
        Self {
            size: align_down(size, FAKE_ALIGNMENT),
            volumes: Mutex::new(BTreeMap::new()),
        }
    }

    fn volumes(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, u64>> {
        self.volumes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn free(volumes: &BTreeMap<String, u64>, size: u64) -> u64 {
        size.saturating_sub(volumes.values().sum())
    }
}

impl Backend for Fake {
    fn mode(&self) -> DeviceMode {
        DeviceMode::Fake
    }

    fn alignment(&self) -> u64 {
        FAKE_ALIGNMENT
    }

    fn capacity(&self) -> Result<Capacity, BackendError> {
        let free = Self::free(&self.volumes(), self.size);
        Ok(Capacity::new(
            vec![Pool {
                name: "fake".into(),
                managed: self.size,
                free,
                largest: align_down(free, FAKE_ALIGNMENT),
            }],
            self.size,
        ))
    }

    fn create(&self, id: &str, size: u64, _usage: Usage) -> Result<(), BackendError> {
        let mut volumes = self.volumes();
        if volumes.get(id) == Some(&size) {
            return Ok(());
        }
        let free = Self::free(&volumes, self.size);
        if size > free {
            return Err(BackendError::NoSpace {
                need: size,
                largest: align_down(free, FAKE_ALIGNMENT),
                free,
            });
        }
        volumes.insert(id.to_string(), size);
        Ok(())
    }

    fn growth_refused(&self) -> Option<&'static str> {
        None
    }

    fn grow(&self, id: &str, size: u64) -> Result<(), BackendError> {
        let mut volumes = self.volumes();
        let Some(&existing) = volumes.get(id) else {
            return Err(BackendError::io("growing", id, "no such volume"));
        };
        if existing >= size {
            return Ok(());
        }
        let free = Self::free(&volumes, self.size);
        if size - existing > free {
            return Err(BackendError::NoSpace {
                need: size - existing,
                largest: align_down(free, FAKE_ALIGNMENT),
                free,
            });
        }
        volumes.insert(id.to_string(), size);
        Ok(())
    }

    fn delete(&self, id: &str, _erase: bool) -> Result<(), BackendError> {
        self.volumes().remove(id);
        Ok(())
    }

    fn size_of(&self, id: &str) -> Result<Option<u64>, BackendError> {
        Ok(self.volumes().get(id).copied())
    }

    fn list(&self) -> Result<Vec<String>, BackendError> {
        Ok(self.volumes().keys().cloned().collect())
    }

    fn attach(&self, _id: &str) -> Result<PathBuf, BackendError> {
        Err(BackendError::NoDevices { mode: "fake" })
    }

    fn attached(&self, _id: &str) -> Result<Option<PathBuf>, BackendError> {
        Ok(None)
    }

    fn detach(&self, _id: &str) -> Result<(), BackendError> {
        Ok(())
    }

    fn adopt(&self, id: &str, size: u64) -> bool {
        self.volumes().insert(id.to_string(), size);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_is_enforced_and_freed() {
        let fake = Fake::new(3 * FAKE_ALIGNMENT);
        fake.create("a", 2 * FAKE_ALIGNMENT, Usage::AppDirect)
            .expect("a fits");
        fake.create("a", 2 * FAKE_ALIGNMENT, Usage::AppDirect)
            .expect("repeat is fine");
        let err = fake
            .create("b", 2 * FAKE_ALIGNMENT, Usage::AppDirect)
            .expect_err("b does not fit");
        assert!(matches!(err, BackendError::NoSpace { largest, .. } if largest == FAKE_ALIGNMENT));
        fake.delete("a", true).expect("delete");
        fake.delete("a", true).expect("delete twice");
        fake.create("b", 2 * FAKE_ALIGNMENT, Usage::AppDirect)
            .expect("b fits now");
        assert_eq!(fake.capacity().expect("cap").available(), FAKE_ALIGNMENT);
        assert!(matches!(
            fake.attach("b"),
            Err(BackendError::NoDevices { .. })
        ));
    }

    #[test]
    fn growth_is_bounded_by_the_budget() {
        let fake = Fake::new(4 * FAKE_ALIGNMENT);
        fake.create("a", FAKE_ALIGNMENT, Usage::AppDirect)
            .expect("a fits");
        fake.create("b", FAKE_ALIGNMENT, Usage::AppDirect)
            .expect("b fits");
        fake.grow("a", 2 * FAKE_ALIGNMENT).expect("a grows");
        fake.grow("a", FAKE_ALIGNMENT).expect("smaller is a no-op");
        assert_eq!(fake.size_of("a").expect("size"), Some(2 * FAKE_ALIGNMENT));
        let err = fake.grow("a", 4 * FAKE_ALIGNMENT).expect_err("no room");
        assert!(
            matches!(err, BackendError::NoSpace { need, free, .. } if need == 2 * FAKE_ALIGNMENT && free == FAKE_ALIGNMENT),
            "{err}"
        );
        assert_eq!(fake.size_of("a").expect("size"), Some(2 * FAKE_ALIGNMENT));
        assert!(fake.grow("missing", FAKE_ALIGNMENT).is_err());
    }
}
