//! The extender's metrics (DESIGN.md §5): requests and their latency per route, node
//! rejections by reason, reservation events and the bytes currently reserved.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteCode {
    route: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Route {
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Event {
    event: String,
}

/// What happened to a reservation, as counted in `pmem_csi_reservations_total{event}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReservationEvent {
    /// A pod's demand was reserved.
    Reserved,
    /// A pod without pending demand passed every node.
    NoDemand,
    /// An entry moved to `allocated` (its claim shows the selected node).
    HandedOver,
    /// A pod was bound: its inline entries ended.
    Bound,
    /// The pod was deleted while it held a reservation.
    Released,
    /// The TTL ran out: a bug signal (the scheduler neither bound nor retried the pod).
    Expired,
    /// Held again after a restart, from the reservation journal.
    Restored,
}

impl ReservationEvent {
    fn as_str(self) -> &'static str {
        match self {
            ReservationEvent::Reserved => "reserved",
            ReservationEvent::NoDemand => "no-demand",
            ReservationEvent::HandedOver => "handed-over",
            ReservationEvent::Bound => "bound",
            ReservationEvent::Released => "released",
            ReservationEvent::Expired => "expired",
            ReservationEvent::Restored => "restored",
        }
    }
}

/// The extender's metrics.
#[derive(Clone, Debug)]
pub struct ExtenderMetrics {
    requests: Family<RouteCode, Counter>,
    duration: Family<Route, Histogram>,
    rejections: Family<Reason, Counter>,
    reservations: Family<Event, Counter>,
    reserved_bytes: Gauge,
    deferred: Counter,
    journal_errors: Counter,
}

impl ExtenderMetrics {
    /// Registers the families in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            requests: Family::default(),
            duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.0001, 2.0, 16))
            }),
            rejections: Family::default(),
            reservations: Family::default(),
            reserved_bytes: Gauge::default(),
            deferred: Counter::default(),
            journal_errors: Counter::default(),
        };
        // Every event exists from the start, at zero: `expired` is alerted on, and a counter
        // that appears only with its first increment hides that increment from rate().
        for event in [
            ReservationEvent::Reserved,
            ReservationEvent::NoDemand,
            ReservationEvent::HandedOver,
            ReservationEvent::Bound,
            ReservationEvent::Released,
            ReservationEvent::Expired,
            ReservationEvent::Restored,
        ] {
            let _ = m.reservations.get_or_create(&Event {
                event: event.as_str().into(),
            });
        }
        // Counters are registered without `_total`; the encoder appends it.
        registry.register(
            "pmem_csi_extender_requests",
            "Extender requests by route and HTTP status code",
            m.requests.clone(),
        );
        registry.register(
            "pmem_csi_extender_request_duration_seconds",
            "Time to answer an extender request",
            m.duration.clone(),
        );
        registry.register(
            "pmem_csi_extender_node_rejections",
            "Nodes the extender filtered out, by reason",
            m.rejections.clone(),
        );
        registry.register(
            "pmem_csi_reservations",
            "Reservation events",
            m.reservations.clone(),
        );
        registry.register(
            "pmem_csi_reserved_bytes",
            "Bytes currently reserved for pods being scheduled",
            m.reserved_bytes.clone(),
        );
        registry.register(
            "pmem_csi_extender_deferred_pods",
            "Filter calls answered with a retry error: a claim or class of the pod had not reached the extender's caches yet",
            m.deferred.clone(),
        );
        registry.register(
            "pmem_csi_extender_journal_errors",
            "Reservation journal writes that failed: a restart in the following minutes can over-commit",
            m.journal_errors.clone(),
        );
        m
    }

    /// Counts one failed reservation-journal write.
    pub fn journal_error(&self) {
        self.journal_errors.inc();
    }

    /// Counts one pod told to retry because the caches were behind.
    pub fn deferred(&self) {
        self.deferred.inc();
    }

    /// Counts one request.
    pub fn request(&self, route: &str, code: u16, took: Duration) {
        self.requests
            .get_or_create(&RouteCode {
                route: route.into(),
                code: code.to_string(),
            })
            .inc();
        self.duration
            .get_or_create(&Route {
                route: route.into(),
            })
            .observe(took.as_secs_f64());
    }

    /// Counts `n` nodes rejected for `reason`.
    pub fn rejected(&self, reason: &str, n: u64) {
        if n > 0 {
            self.rejections
                .get_or_create(&Reason {
                    reason: reason.into(),
                })
                .inc_by(n);
        }
    }

    /// Counts `n` reservation events.
    pub fn reservation(&self, event: ReservationEvent, n: u64) {
        if n > 0 {
            self.reservations
                .get_or_create(&Event {
                    event: event.as_str().into(),
                })
                .inc_by(n);
        }
    }

    /// Sets the reserved-bytes gauge.
    pub fn set_reserved(&self, bytes: u64) {
        self.reserved_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;

    #[test]
    fn names_and_labels() {
        let mut registry = Registry::default();
        let m = ExtenderMetrics::register(&mut registry);
        m.request("filter", 200, Duration::from_millis(1));
        m.rejected("PMEM driver not running", 2);
        m.rejected("ignored", 0);
        m.reservation(ReservationEvent::NoDemand, 1);
        m.set_reserved(u64::MAX);
        m.deferred();
        let mut text = String::new();
        encode(&mut text, &registry).expect("encode");
        for want in [
            r#"pmem_csi_extender_requests_total{route="filter",code="200"} 1"#,
            r#"pmem_csi_extender_request_duration_seconds_count{route="filter"} 1"#,
            r#"pmem_csi_extender_node_rejections_total{reason="PMEM driver not running"} 2"#,
            r#"pmem_csi_reservations_total{event="no-demand"} 1"#,
            "pmem_csi_reserved_bytes 9223372036854775807",
            "pmem_csi_extender_deferred_pods_total 1",
            r#"pmem_csi_reservations_total{event="expired"} 0"#,
        ] {
            assert!(text.contains(want), "{want} missing in\n{text}");
        }
        assert!(!text.contains("ignored"));
    }
}
