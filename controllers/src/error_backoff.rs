//! Per-object exponential back-off after failed reconciles (500 ms, 1 s, 2 s, … 5 min, backon's
//! schedule), reset by a success: one failing object backs off without slowing the others, and a
//! persistent failure does not hammer the apiserver. An object that stopped failing without a success (it
//! was deleted, or is no longer reconciled) is forgotten after [`FORGET_AFTER`], so the map
//! holds only objects that are still failing.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use kube::Resource;
use kube::runtime::reflector::ObjectRef;

/// The first delay.
pub const FIRST: Duration = Duration::from_millis(500);
/// The longest delay.
pub const MAX: Duration = Duration::from_secs(300);
/// An object still failing fails again within [`MAX`] of its last failure; one whose last
/// failure is this old was deleted or is no longer reconciled.
pub const FORGET_AFTER: Duration = Duration::from_secs(2 * 300);

/// The delays still ahead of one object and when its last failure was.
#[derive(Debug)]
struct Failures {
    delays: ExponentialBackoff,
    last: Instant,
}

/// Failure counts per object.
pub struct ErrorBackoff<K: Resource>
where
    K::DynamicType: Eq + Hash,
{
    failures: Mutex<HashMap<ObjectRef<K>, Failures>>,
}

impl<K: Resource> Default for ErrorBackoff<K>
where
    K::DynamicType: Eq + Hash,
{
    fn default() -> Self {
        Self {
            failures: Mutex::default(),
        }
    }
}

/// The delays after one, two, … consecutive failures: doubling from [`FIRST`] to [`MAX`], no
/// jitter (kube-runtime's reconciler runs each object once at a time), without end.
pub fn schedule() -> ExponentialBackoff {
    ExponentialBuilder::new()
        .with_min_delay(FIRST)
        .with_max_delay(MAX)
        .with_factor(2.0)
        .without_max_times()
        .build()
}

/// The delay after `failures` consecutive failures (≥ 1).
pub fn delay(failures: u32) -> Duration {
    // Past 64 doublings every delay is MAX.
    let skip = usize::try_from(failures.saturating_sub(1).min(64)).unwrap_or(64);
    schedule().nth(skip).unwrap_or(MAX)
}

impl<K: Resource> ErrorBackoff<K>
where
    K::DynamicType: Eq + Hash + Default,
{
    /// Records a failure of `object`; returns how long to wait before the next attempt.
    pub fn failed(&self, object: &K) -> Duration {
        self.failed_at(object, Instant::now())
    }

    fn failed_at(&self, object: &K, now: Instant) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        failures.retain(|_, f| now.saturating_duration_since(f.last) < FORGET_AFTER);
        let f = failures
            .entry(ObjectRef::from_obj(object))
            .or_insert_with(|| Failures {
                delays: schedule(),
                last: now,
            });
        f.last = now;
        f.delays.next().unwrap_or(MAX)
    }

    /// How many objects are backing off.
    pub fn len(&self) -> usize {
        self.failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether no object is backing off.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records a success of `object`, resetting its back-off.
    pub fn succeeded(&self, object: &K) {
        self.failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&ObjectRef::from_obj(object));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    fn cm(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn delay_table() {
        for (n, want) in [
            (1, 500),
            (2, 1000),
            (3, 2000),
            (10, 256_000),
            (11, 300_000),
            (99, 300_000),
        ] {
            assert_eq!(delay(n), Duration::from_millis(want), "{n}");
        }
    }

    #[test]
    fn per_object_and_reset() {
        let b = ErrorBackoff::<ConfigMap>::default();
        assert_eq!(b.failed(&cm("a")), FIRST);
        assert_eq!(b.failed(&cm("a")), FIRST * 2);
        assert_eq!(b.failed(&cm("b")), FIRST, "objects back off independently");
        b.succeeded(&cm("a"));
        assert_eq!(b.failed(&cm("a")), FIRST, "a success resets");
    }

    #[test]
    fn objects_that_stopped_failing_are_forgotten() {
        let b = ErrorBackoff::<ConfigMap>::default();
        let t0 = Instant::now();
        b.failed_at(&cm("deleted"), t0);
        b.failed_at(&cm("failing"), t0);
        // Still failing: fails again within MAX each time.
        for i in 1..=4u32 {
            b.failed_at(&cm("failing"), t0 + MAX * i);
        }
        assert_eq!(b.len(), 1, "the deleted object's entry was dropped");
        assert_eq!(
            b.failed_at(&cm("failing"), t0 + MAX * 5),
            delay(6),
            "the failing one kept its count"
        );
        assert_eq!(
            b.failed_at(&cm("deleted"), t0 + MAX * 5),
            FIRST,
            "a forgotten object starts over"
        );
    }
}
