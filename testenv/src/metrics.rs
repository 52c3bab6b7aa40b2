//! Reading our processes' Prometheus `/metrics`: scraping a port and picking samples.

/// The text of `http://127.0.0.1:<port>/metrics` (empty if unreachable).
pub async fn scrape_metrics(port: u16) -> String {
    let Ok(client) =
        crate::control_plane::anonymous_probe(&format!("http://127.0.0.1:{port}"), "metrics")
    else {
        return String::new();
    };
    let Ok(request) = http::Request::get("/metrics").body(Vec::new()) else {
        return String::new();
    };
    client.request_text(request).await.unwrap_or_default()
}

/// `(count, sum)` of the node driver's CreateVolume calls that ended with gRPC status
/// `status` (`"OK"`, `"ResourceExhausted"`, …), from its `/metrics` text.
pub fn create_volume_calls(text: &str, status: &str) -> (u64, f64) {
    let code = format!("grpc_status_code=\"{status}\"");
    let pick = |suffix: &str| {
        let name = format!("csi_plugin_operations_seconds_{suffix}{{");
        text.lines()
            .filter(|l| l.starts_with(&name) && l.contains("CreateVolume") && l.contains(&code))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            // Not sum(): an empty f64 sum is -0.0, printed as "-0.0000".
            .fold(0.0, |total, v| total + v)
    };
    (pick("count") as u64, pick("sum"))
}

/// The sum of the samples whose line starts with `prefix` (a metric name with labels).
pub fn metric_value(text: &str, prefix: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_volume_calls_by_status() {
        let text = "\
csi_plugin_operations_seconds_sum{driver_name=\"d\",method_name=\"/csi.v1.Controller/CreateVolume\",grpc_status_code=\"OK\"} 0.5
csi_plugin_operations_seconds_count{driver_name=\"d\",method_name=\"/csi.v1.Controller/CreateVolume\",grpc_status_code=\"OK\"} 2
csi_plugin_operations_seconds_count{driver_name=\"d\",method_name=\"/csi.v1.Controller/CreateVolume\",grpc_status_code=\"ResourceExhausted\"} 7
csi_plugin_operations_seconds_count{driver_name=\"d\",method_name=\"/csi.v1.Node/NodeStageVolume\",grpc_status_code=\"OK\"} 3
";
        assert_eq!(create_volume_calls(text, "OK"), (2, 0.5));
        assert_eq!(create_volume_calls(text, "ResourceExhausted").0, 7);
        let (none, sum) = create_volume_calls(text, "Internal");
        assert_eq!(none, 0);
        assert!(sum.is_sign_positive(), "0.0, not -0.0");
    }

    #[test]
    fn metric_value_sums_matching_lines() {
        let text = "a_total{x=\"1\"} 2\na_total{x=\"2\"} 3\nb_total 7\n";
        assert_eq!(metric_value(text, "a_total"), 5);
        assert_eq!(metric_value(text, "b_total"), 7);
        assert_eq!(metric_value(text, "c_total"), 0);
    }
}
