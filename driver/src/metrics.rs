//! The node driver's metrics: PMEM-CSI's `pmem_amount_*` gauges, computed from the backend on
//! every scrape, and `csi_plugin_operations_seconds` per RPC.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::volumes::Volumes;

/// Labels of `pmem_amount_*` (PMEM-CSI's constant labels).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    node: String,
    driver_name: String,
}

/// Labels of `csi_plugin_operations_seconds`, as Kubernetes' CSI metrics name them.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    driver_name: String,
    method_name: String,
    grpc_status_code: String,
}

/// Buckets of Kubernetes' CSI operation histograms (seconds).
const BUCKETS: [f64; 13] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 25.0, 50.0, 120.0, 300.0, 600.0,
];

/// RPC latency, shared by the server layer.
#[derive(Clone, Debug)]
pub struct CsiMetrics {
    driver_name: String,
    operations: Family<OperationLabels, Histogram>,
}

impl CsiMetrics {
    /// Registers the metrics of the node driver in `registry`.
    pub fn register(
        registry: &mut Registry,
        driver_name: &str,
        node: &str,
        volumes: Arc<Volumes>,
    ) -> Self {
        let operations =
            Family::<OperationLabels, Histogram>::new_with_constructor(|| Histogram::new(BUCKETS));
        registry.register(
            "csi_plugin_operations_seconds",
            "Duration of CSI operations served by the plugin, by method and gRPC status code",
            operations.clone(),
        );
        registry.register_collector(Box::new(CapacityCollector {
            labels: NodeLabels {
                node: node.to_string(),
                driver_name: driver_name.to_string(),
            },
            volumes,
        }));
        Self {
            driver_name: driver_name.to_string(),
            operations,
        }
    }

    /// Records one RPC.
    pub fn observe(&self, method: &str, code: tonic::Code, elapsed: Duration) {
        self.operations
            .get_or_create(&OperationLabels {
                driver_name: self.driver_name.clone(),
                method_name: method.to_string(),
                grpc_status_code: code_name(code).to_string(),
            })
            .observe(elapsed.as_secs_f64());
    }
}

/// Go's names of gRPC codes, which Kubernetes' CSI metrics use as label values.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "Canceled",
        Unknown => "Unknown",
        InvalidArgument => "InvalidArgument",
        DeadlineExceeded => "DeadlineExceeded",
        NotFound => "NotFound",
        AlreadyExists => "AlreadyExists",
        PermissionDenied => "PermissionDenied",
        ResourceExhausted => "ResourceExhausted",
        FailedPrecondition => "FailedPrecondition",
        Aborted => "Aborted",
        OutOfRange => "OutOfRange",
        Unimplemented => "Unimplemented",
        Internal => "Internal",
        Unavailable => "Unavailable",
        DataLoss => "DataLoss",
        Unauthenticated => "Unauthenticated",
    }
}

#[derive(Debug)]
struct CapacityCollector {
    labels: NodeLabels,
    volumes: Arc<Volumes>,
}

impl prometheus_client::collector::Collector for CapacityCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // Devices start-up kept without a usable state: an operator must look at them.
        let report = self.volumes.repair_report();
        for (name, help, value) in [
            (
                "pmem_csi_unrecorded_devices",
                "Devices the driver found at start without a state file; kept, never deleted automatically.",
                report.unrecorded.len(),
            ),
            (
                "pmem_csi_quarantined_volumes",
                "Volumes whose state file did not parse, moved to <id>.json.quarantined; their devices are kept.",
                report.quarantined.len(),
            ),
        ] {
            let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            let family = metric.encode_family(&self.labels)?;
            ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(family)?;
        }
        let capacity = match self
            .volumes
            .recent_capacity(crate::volumes::CAPACITY_MAX_AGE)
        {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("capacity for metrics: {e}");
                return Ok(());
            }
        };
        for (name, help, value) in [
            (
                "pmem_amount_max_volume_size",
                "The size of the largest PMEM volume that can be created.",
                capacity.max_volume_size(),
            ),
            (
                "pmem_amount_available",
                "Remaining amount of PMEM on the host that can be used for new volumes.",
                capacity.available(),
            ),
            (
                "pmem_amount_managed",
                "Amount of PMEM on the host that is managed by PMEM-CSI.",
                capacity.managed(),
            ),
            (
                "pmem_amount_total",
                "Total amount of PMEM on the host.",
                capacity.total,
            ),
        ] {
            let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            let family = metric.encode_family(&self.labels)?;
            ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(family)?;
        }
        Ok(())
    }
}
