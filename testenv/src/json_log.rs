//! Reading what our processes log with `--log-format=json` (one flattened object per line):
//! the extender's filter decisions and the node driver's CreateVolume calls, for the demo's
//! narration and the end-to-end benchmarks.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

/// JSON log lines of `path` (the supervisor's own lines are not JSON and are skipped).
pub fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Field `name` of a log line as text: `--log-format=json` flattens fields into the line.
pub fn field<'a>(line: &'a Value, name: &str) -> Option<&'a str> {
    line.get(name)?.as_str()
}

/// The extender's last filter decision for `pod` (`namespace/name`) that passed a node:
/// the first node it passed and its per-node verdicts (debug level of `extender::server` and
/// `extender::placement`).
pub fn extender_decision(log: &Path, pod: &str) -> Option<(String, String)> {
    lines(log)
        .iter()
        .rev()
        .filter(|l| field(l, "message") == Some("filter") && field(l, "pod") == Some(pod))
        .find(|l| l.get("passed").and_then(Value::as_u64) > Some(0))
        .map(|l| {
            let nodes = field(l, "nodes").unwrap_or_default();
            let details = field(l, "details").unwrap_or_default();
            (first_quoted(nodes), details.to_string())
        })
}

/// The first quoted name of a Debug-printed `Some(["node-2", …])`, else the text itself.
fn first_quoted(nodes: &str) -> String {
    nodes
        .split('"')
        .nth(1)
        .map_or_else(|| nodes.to_string(), str::to_string)
}

/// `(size, duration)` of the CreateVolume that created volume `name`, from a node driver's
/// log: its "volume created" line and the rpc line that follows it (the demo creates one
/// volume at a time).
pub fn create_volume_of(log: &Path, name: &str) -> Option<(u64, Duration)> {
    let lines = lines(log);
    let created = lines.iter().position(|l| {
        field(l, "message") == Some("volume created") && field(l, "name") == Some(name)
    })?;
    let size = lines[created]
        .get("size")
        .and_then(Value::as_u64)
        .unwrap_or_default();
    let rpc = lines[created..]
        .iter()
        .find(|l| is_ok_rpc(l, "CreateVolume"))?;
    Some((size, parse_debug_duration(field(rpc, "elapsed")?)?))
}

/// Whether the node driver's log says volume `id` was deleted, and if so whether it was
/// scrubbed first (`eraseafter`).
pub fn volume_deleted(log: &Path, id: &str) -> Option<bool> {
    lines(log)
        .iter()
        .find(|l| field(l, "message") == Some("volume deleted") && field(l, "id") == Some(id))
        .map(|l| l.get("erased").and_then(Value::as_bool).unwrap_or(false))
}

/// Durations of every successful RPC whose method ends with `method` in a node driver's log.
pub fn rpc_durations(log: &Path, method: &str) -> Vec<Duration> {
    lines(log)
        .iter()
        .filter(|l| is_ok_rpc(l, method))
        .filter_map(|l| parse_debug_duration(field(l, "elapsed")?))
        .collect()
}

fn is_ok_rpc(line: &Value, method: &str) -> bool {
    field(line, "message") == Some("rpc")
        && field(line, "status") == Some("OK")
        && field(line, "method").is_some_and(|m| m.ends_with(method))
}

/// A `Duration`'s Debug form (`1.5s`, `12.3ms`, `812µs`, `40ns`).
pub fn parse_debug_duration(text: &str) -> Option<Duration> {
    let (number, unit) = text.split_at(text.find(|c: char| c.is_alphabetic() || c == 'µ')?);
    let value: f64 = number.parse().ok()?;
    let seconds = match unit {
        "s" => value,
        "ms" => value / 1e3,
        "µs" | "us" => value / 1e6,
        "ns" => value / 1e9,
        _ => return None,
    };
    Some(Duration::from_secs_f64(seconds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_durations() {
        for (text, want) in [
            ("1.5s", Some(1.5)),
            ("12.25ms", Some(0.01225)),
            ("812µs", Some(0.000812)),
            ("40ns", Some(0.00000004)),
            ("3m", None),
            ("ms", None),
        ] {
            assert_eq!(
                parse_debug_duration(text).map(|d| (d.as_secs_f64() * 1e9).round()),
                want.map(|w: f64| (w * 1e9).round()),
                "{text}"
            );
        }
    }

    #[test]
    fn driver_and_extender_lines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let driver = dir.path().join("driver.log");
        std::fs::write(
            &driver,
            [
                r#"{"message":"rpc","method":"/csi.v1.Controller/CreateVolume","status":"ResourceExhausted","elapsed":"1ms"}"#,
                "testenv: pmem-csi node exited, restarting in 1s",
                r#"{"message":"volume created","id":"pvc-ab-1","name":"pvc-ab","size":4194304}"#,
                r#"{"message":"rpc","method":"/csi.v1.Node/NodeStageVolume","status":"OK","elapsed":"9ms"}"#,
                r#"{"message":"rpc","method":"/csi.v1.Controller/CreateVolume","status":"OK","elapsed":"12.5ms"}"#,
            ]
            .join("\n"),
        )
        .expect("write");
        assert_eq!(
            create_volume_of(&driver, "pvc-ab"),
            Some((4 << 20, Duration::from_micros(12_500)))
        );
        assert_eq!(create_volume_of(&driver, "pvc-other"), None);
        let deleted = dir.path().join("deleted.log");
        std::fs::write(
            &deleted,
            [
                r#"{"message":"volume deleted","id":"a","erased":true}"#,
                r#"{"message":"volume deleted","id":"b","erased":false}"#,
            ]
            .join("\n"),
        )
        .expect("write");
        assert_eq!(volume_deleted(&deleted, "a"), Some(true));
        assert_eq!(volume_deleted(&deleted, "b"), Some(false));
        assert_eq!(volume_deleted(&deleted, "c"), None);
        assert_eq!(
            rpc_durations(&driver, "CreateVolume"),
            vec![Duration::from_micros(12_500)]
        );
        let extender = dir.path().join("extender.log");
        std::fs::write(
            &extender,
            [
                r#"{"message":"filter","pod":"demo/a","passed":1,"nodes":"Some([\"node-2\"])","details":"{\"node-2\": \"fits\"}"}"#,
                r#"{"message":"filter","pod":"demo/a","passed":0,"nodes":"Some([])","details":"{}"}"#,
            ]
            .join("\n"),
        )
        .expect("write");
        assert_eq!(
            extender_decision(&extender, "demo/a"),
            Some(("node-2".to_string(), "{\"node-2\": \"fits\"}".to_string()))
        );
        assert_eq!(extender_decision(&extender, "demo/b"), None);
    }
}
