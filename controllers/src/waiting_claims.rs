//! How long claims of this driver have waited for their volume on the node kube-scheduler
//! selected (`pmem_csi_pvc_selected_unbound_oldest_seconds`): a claim that waits long is one no
//! node provisions and the rescheduler did not move, which only an operator can resolve.
//!
//! The objects carry no time of selection, so waits are measured from when the leader first saw
//! a claim waiting, by a periodic scan of the shared claim cache: a new leader starts from zero.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use crate::volume_facts::{Binding, ClaimFacts, ClassFacts, is_ours};

/// How often the claim cache is scanned.
pub const SCAN_INTERVAL: Duration = Duration::from_secs(10);

/// Whether a claim of `driver` waits for its volume on its selected node: unbound, not being
/// deleted, selected, and this driver's (by class; without one, by the provisioner annotation).
pub fn waits_on_selected_node(
    claim: &ClaimFacts,
    class: Option<&ClassFacts>,
    driver: &str,
) -> bool {
    !claim.bound()
        && !claim.deleting
        && claim.selected_node.is_some()
        && is_ours(
            class,
            claim.provisioner_annotation.as_deref(),
            driver,
            Binding::Any,
        )
}

/// When each waiting claim was first seen waiting, by a 64-bit hash of its UID: the map holds
/// every waiting claim (10,000 in the benchmark: ~1 MiB as owned UIDs, 0.3 MiB so), and a
/// collision would only merge two claims' waits in a gauge.
#[derive(Debug, Default)]
pub struct WaitingClaims {
    since: HashMap<u64, Instant>,
}

impl WaitingClaims {
    /// Replaces the waiting set with `waiting` (UIDs) as seen at `now`; returns the longest wait.
    pub fn observe<'a>(
        &mut self,
        waiting: impl IntoIterator<Item = &'a str>,
        now: Instant,
    ) -> Duration {
        let mut next = HashMap::with_capacity(self.since.len());
        for uid in waiting {
            let key = uid_key(uid);
            let since = self.since.get(&key).copied().unwrap_or(now);
            next.insert(key, since);
        }
        self.since = next;
        self.since
            .values()
            .map(|since| now.saturating_duration_since(*since))
            .max()
            .unwrap_or_default()
    }
}

/// The same key for the same UID within this process (the keys never leave its memory).
fn uid_key(uid: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    uid.hash(&mut hasher);
    hasher.finish()
}

/// The gauge `pmem_csi_pvc_selected_unbound_oldest_seconds`.
#[derive(Clone, Debug, Default)]
pub struct WaitingClaimsMetrics {
    oldest: Gauge<f64, AtomicU64>,
}

impl WaitingClaimsMetrics {
    /// Registers the gauge in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "pmem_csi_pvc_selected_unbound_oldest_seconds",
            "How long the longest-waiting claim of this driver has had a selected node without \
             being bound, as seen by the leading controller",
            m.oldest.clone(),
        );
        m
    }

    /// Sets the gauge.
    pub fn set(&self, oldest: Duration) {
        self.oldest.set(oldest.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DRIVER: &str = "pmem-csi.intel.com";

    fn waiting() -> (ClaimFacts, Option<ClassFacts>) {
        let claim = ClaimFacts {
            class: Some("sc".into()),
            selected_node: Some("n1".into()),
            ..ClaimFacts::default()
        };
        let class = ClassFacts {
            provisioner: DRIVER.into(),
            ..ClassFacts::default()
        };
        (claim, Some(class))
    }

    #[test]
    fn waits_table() {
        type Edit = fn(&mut (ClaimFacts, Option<ClassFacts>));
        let cases: [(&str, Edit, bool); 7] = [
            ("selected, unbound, ours", |_| {}, true),
            ("bound", |(c, _)| c.volume_name = Some("pv".into()), false),
            ("deleting", |(c, _)| c.deleting = true, false),
            ("not selected", |(c, _)| c.selected_node = None, false),
            (
                "another driver's class",
                |(_, class)| {
                    *class = Some(ClassFacts {
                        provisioner: "other".into(),
                        ..ClassFacts::default()
                    })
                },
                false,
            ),
            (
                "class gone, ours by annotation",
                |(c, class)| {
                    *class = None;
                    c.provisioner_annotation = Some(DRIVER.into());
                },
                true,
            ),
            ("no class, no annotation", |(_, class)| *class = None, false),
        ];
        for (name, edit, want) in cases {
            let mut case = waiting();
            edit(&mut case);
            let (claim, class) = case;
            assert_eq!(
                waits_on_selected_node(&claim, class.as_ref(), DRIVER),
                want,
                "{name}"
            );
        }
    }

    #[test]
    fn the_longest_wait_is_measured_from_first_sight() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let mut claims = WaitingClaims::default();
        assert_eq!(claims.observe(["a"], at(0)), Duration::ZERO);
        assert_eq!(claims.observe(["a", "b"], at(10)), Duration::from_secs(10));
        assert_eq!(
            claims.observe(["b"], at(30)),
            Duration::from_secs(20),
            "a got bound: b is the oldest"
        );
        assert_eq!(
            claims.observe(["a"], at(40)),
            Duration::ZERO,
            "a waits again: from now"
        );
        assert_eq!(claims.observe(Vec::new(), at(50)), Duration::ZERO);
    }
}
