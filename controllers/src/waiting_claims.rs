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

use crate::rescheduler::ClaimFacts;

/// How often the claim cache is scanned.
pub const SCAN_INTERVAL: Duration = Duration::from_secs(10);

/// Whether a claim of `driver` waits for its volume on its selected node: unbound, not being
/// deleted, selected, and this driver's (by class; without one, by the provisioner annotation).
pub fn waits_on_selected_node(claim: &ClaimFacts, driver: &str) -> bool {
    !claim.bound
        && !claim.deleting
        && claim.selected_node.is_some()
        && claim.provisioner() == Some(driver)
}

/// When each waiting claim (by UID) was first seen waiting.
#[derive(Debug, Default)]
pub struct WaitingClaims {
    since: HashMap<String, Instant>,
}

impl WaitingClaims {
    /// Replaces the waiting set with `waiting` (UIDs) as seen at `now`; returns the longest wait.
    pub fn observe(&mut self, waiting: impl IntoIterator<Item = String>, now: Instant) -> Duration {
        let mut next = HashMap::new();
        for uid in waiting {
            let since = self.since.get(&uid).copied().unwrap_or(now);
            next.insert(uid, since);
        }
        self.since = next;
        self.since
            .values()
            .map(|since| now.saturating_duration_since(*since))
            .max()
            .unwrap_or_default()
    }
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

    fn waiting() -> ClaimFacts {
        ClaimFacts {
            bound: false,
            deleting: false,
            selected_node: Some("n1".into()),
            class_provisioner: Some(DRIVER.into()),
            provisioner_annotation: None,
        }
    }

    #[test]
    fn waits_table() {
        type Edit = fn(&mut ClaimFacts);
        let cases: [(&str, Edit, bool); 7] = [
            ("selected, unbound, ours", |_| {}, true),
            ("bound", |c| c.bound = true, false),
            ("deleting", |c| c.deleting = true, false),
            ("not selected", |c| c.selected_node = None, false),
            (
                "another driver's class",
                |c| c.class_provisioner = Some("other".into()),
                false,
            ),
            (
                "class gone, ours by annotation",
                |c| {
                    c.class_provisioner = None;
                    c.provisioner_annotation = Some(DRIVER.into());
                },
                true,
            ),
            (
                "no class, no annotation",
                |c| c.class_provisioner = None,
                false,
            ),
        ];
        for (name, edit, want) in cases {
            let mut claim = waiting();
            edit(&mut claim);
            assert_eq!(waits_on_selected_node(&claim, DRIVER), want, "{name}");
        }
    }

    #[test]
    fn the_longest_wait_is_measured_from_first_sight() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let mut claims = WaitingClaims::default();
        assert_eq!(claims.observe(["a".to_string()], at(0)), Duration::ZERO);
        assert_eq!(
            claims.observe(["a".to_string(), "b".to_string()], at(10)),
            Duration::from_secs(10)
        );
        assert_eq!(
            claims.observe(["b".to_string()], at(30)),
            Duration::from_secs(20),
            "a got bound: b is the oldest"
        );
        assert_eq!(
            claims.observe(["a".to_string()], at(40)),
            Duration::ZERO,
            "a waits again: from now"
        );
        assert_eq!(claims.observe(Vec::new(), at(50)), Duration::ZERO);
    }
}
