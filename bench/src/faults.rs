//! The fault-injection suite's figures (`e2e/tests/faults.rs`, run by `just faults`) as
//! benchmarks: per fault, the time from the fault to convergence over the runs, with what was
//! retried in each run kept in the flags.

use std::collections::BTreeMap;

use anyhow::Context;
use serde::Deserialize;

use crate::report::{Benchmark, Target};

/// One scenario's line in the figures file.
#[derive(Debug, Deserialize)]
struct Figures {
    fault: String,
    /// Claims and pods of the burst.
    pods: u64,
    converged_s: f64,
    /// Requests of ours the fault proxy answered with 429 or 5xx (absent in older figures).
    #[serde(default)]
    injected_429_5xx: u64,
    filter_503: u64,
    failed_scheduling: u64,
    provisioning_failed: u64,
    restarts: u64,
}

/// A benchmark name for `fault`: `fault-` and its words joined by dashes.
fn name(fault: &str) -> String {
    let words: Vec<String> = fault
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .collect();
    format!("fault-{}", words.join("-"))
}

/// The benchmarks of a figures file's text (one JSON object per line).
pub fn import(text: &str) -> anyhow::Result<Vec<Benchmark>> {
    let mut by_fault: BTreeMap<String, Vec<Figures>> = BTreeMap::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let figures: Figures =
            serde_json::from_str(line).with_context(|| format!("line {}: {line}", i + 1))?;
        by_fault
            .entry(figures.fault.clone())
            .or_default()
            .push(figures);
    }
    anyhow::ensure!(!by_fault.is_empty(), "no figures");
    Ok(by_fault
        .into_iter()
        .map(|(fault, runs)| Benchmark {
            name: name(&fault),
            description: format!(
                "{fault} in the middle of a burst of {} claims and pods on testenv: seconds until \
                 every pod runs with its volume (one per claim, on its PV's node), the published \
                 capacity is true and no reservation is left (e2e/tests/faults.rs, `just faults`)",
                runs.first().map_or(0, |r| r.pods)
            ),
            unit: "s".into(),
            samples: runs.iter().map(|r| r.converged_s).collect(),
            secondary: Vec::new(),
            target: Target::none(),
            flags: serde_json::json!({
                "retried per run": runs
                    .iter()
                    .map(|r| format!(
                        "injected 429/5xx {}, filter 503 {}, FailedScheduling {}, ProvisioningFailed {}, restarts {}",
                        r.injected_429_5xx, r.filter_503, r.failed_scheduling, r.provisioning_failed, r.restarts
                    ))
                    .collect::<Vec<_>>(),
            }),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_become_one_benchmark_per_fault() {
        let text = r#"{"fault":"etcd restarted","pods":12,"converged_s":9.5,"filter_503":0,"failed_scheduling":2,"provisioning_failed":0,"restarts":0}
{"fault":"kube-apiserver restarted","pods":12,"converged_s":12.0,"filter_503":0,"failed_scheduling":6,"provisioning_failed":3,"restarts":0}
{"fault":"etcd restarted","pods":12,"converged_s":9.0,"filter_503":1,"failed_scheduling":2,"provisioning_failed":0,"restarts":0}
"#;
        let benchmarks = import(text).expect("imports");
        let names: Vec<&str> = benchmarks.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(
            names,
            ["fault-etcd-restarted", "fault-kube-apiserver-restarted"]
        );
        assert_eq!(benchmarks[0].samples, [9.5, 9.0]);
        assert_eq!(
            benchmarks[0].flags["retried per run"][1],
            "injected 429/5xx 0, filter 503 1, FailedScheduling 2, ProvisioningFailed 0, restarts 0"
        );
        assert!(import("").is_err());
        assert!(import("{not json").is_err());
    }

    #[test]
    fn names_table() {
        for (fault, want) in [
            (
                "node driver SIGKILLed during NodeStage",
                "fault-node-driver-sigkilled-during-nodestage",
            ),
            ("kube-apiserver restarted", "fault-kube-apiserver-restarted"),
        ] {
            assert_eq!(name(fault), want);
        }
    }
}
