//! Per-object exponential back-off after failed reconciles (500 ms, 1 s, 2 s, … 5 min), reset
//! by a success: one failing object backs off without slowing the others, and a persistent
//! failure does not hammer the apiserver.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use kube::Resource;
use kube::runtime::reflector::ObjectRef;

/// The first delay.
pub const FIRST: Duration = Duration::from_millis(500);
/// The longest delay.
pub const MAX: Duration = Duration::from_secs(300);

/// Failure counts per object.
pub struct ErrorBackoff<K: Resource>
where
    K::DynamicType: Eq + Hash,
{
    failures: Mutex<HashMap<ObjectRef<K>, u32>>,
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

/// The delay after `failures` consecutive failures (≥ 1).
pub fn delay(failures: u32) -> Duration {
    FIRST
        .saturating_mul(1u32 << failures.saturating_sub(1).min(20))
        .min(MAX)
}

impl<K: Resource> ErrorBackoff<K>
where
    K::DynamicType: Eq + Hash + Default,
{
    /// Records a failure of `object`; returns how long to wait before the next attempt.
    pub fn failed(&self, object: &K) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        let n = failures.entry(ObjectRef::from_obj(object)).or_insert(0);
        *n = n.saturating_add(1);
        delay(*n)
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
        let cm = |name: &str| ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(b.failed(&cm("a")), FIRST);
        assert_eq!(b.failed(&cm("a")), FIRST * 2);
        assert_eq!(b.failed(&cm("b")), FIRST, "objects back off independently");
        b.succeeded(&cm("a"));
        assert_eq!(b.failed(&cm("a")), FIRST, "a success resets");
    }
}
