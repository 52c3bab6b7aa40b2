//! Result files and the BENCHMARKS.md they render to.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

/// One run of `just bench`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Results {
    /// UTC date, YYYY-MM-DD.
    pub date: String,
    /// Commit the run measured.
    pub sha: String,
    /// Seconds since the epoch when the run finished; orders runs of one day.
    #[serde(default)]
    pub timestamp: u64,
    /// Where it ran.
    pub machine: Machine,
    /// What it measured.
    pub benchmarks: Vec<Benchmark>,
}

/// The machine a run happened on.
#[derive(Debug, Serialize, Deserialize)]
pub struct Machine {
    /// Logical CPUs.
    pub cpus: usize,
    /// Kernel release.
    pub kernel: String,
}

impl Machine {
    /// This machine.
    pub fn current() -> Self {
        Self {
            cpus: std::thread::available_parallelism().map_or(0, usize::from),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
        }
    }
}

/// One benchmark's raw samples and target.
#[derive(Debug, Serialize, Deserialize)]
pub struct Benchmark {
    /// Stable name.
    pub name: String,
    /// What a sample is.
    pub description: String,
    /// Unit of the samples.
    pub unit: String,
    /// Raw samples of the primary measure.
    pub samples: Vec<f64>,
    /// Raw samples of a secondary measure, if any.
    #[serde(default)]
    pub secondary: Vec<f64>,
    /// What must hold.
    pub target: Target,
    /// Every knob the run used.
    pub flags: serde_json::Value,
}

/// A benchmark's target.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Target {
    /// The median sample must not exceed this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p50_max: Option<f64>,
    /// The 99th percentile must not exceed the sum of other benchmarks' 99th percentiles plus
    /// a constant (a cost measured beside it on the same machine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p99_max: Option<RelativeTarget>,
    /// No sample may exceed this (counts that must stay at zero).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<f64>,
    /// The median must not exceed the median of this benchmark of the same run, unless that
    /// one did not finish (its flags say `"finished": false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p50_at_most_of: Option<String>,
}

/// `p99 ≤ times × Σ p99(of) + plus`, and never above `cap`.
#[derive(Debug, Serialize, Deserialize)]
pub struct RelativeTarget {
    /// Names of benchmarks in the same run.
    pub of: Vec<String>,
    /// Added allowance, in the benchmark's unit.
    pub plus: f64,
    /// Factor on the sum of the others' p99 (1 when absent).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub times: f64,
    /// An absolute limit besides the relative one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap: Option<f64>,
}

fn one() -> f64 {
    1.0
}

fn is_one(x: &f64) -> bool {
    *x == 1.0
}

impl RelativeTarget {
    /// `p99 ≤ plus`.
    pub fn absolute(plus: f64) -> Self {
        Self {
            of: vec![],
            plus,
            times: 1.0,
            cap: None,
        }
    }

    /// `p99 ≤ Σ p99(of) + plus`.
    pub fn sum(of: Vec<String>, plus: f64) -> Self {
        Self {
            of,
            plus,
            times: 1.0,
            cap: None,
        }
    }
}

impl Target {
    /// No target: reported only.
    pub fn none() -> Self {
        Self::default()
    }

    fn is_none(&self) -> bool {
        self.p50_max.is_none()
            && self.p99_max.is_none()
            && self.max.is_none()
            && self.p50_at_most_of.is_none()
    }
}

/// The `q`-quantile (nearest rank) of `samples`; 0 for none.
pub fn quantile(samples: &[f64], q: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

impl Benchmark {
    /// The limit its p99 must stay under, if it has a relative target.
    fn p99_limit(&self, run: &[Benchmark]) -> Option<f64> {
        let rel = self.target.p99_max.as_ref()?;
        let base: f64 = rel
            .of
            .iter()
            .map(|name| {
                run.iter()
                    .find(|b| &b.name == name)
                    .map_or(f64::INFINITY, |b| quantile(&b.samples, 0.99))
            })
            .sum::<f64>();
        let relative = if rel.of.is_empty() {
            rel.plus
        } else {
            rel.times * base + rel.plus
        };
        Some(rel.cap.map_or(relative, |cap| relative.min(cap)))
    }

    /// Why it misses its target, if it does.
    fn miss(&self, run: &[Benchmark]) -> Option<String> {
        let p50 = quantile(&self.samples, 0.5);
        if let Some(max) = self.target.p50_max
            && p50 > max
        {
            return Some(format!(
                "{}: p50 {p50:.3}{} > {max}{}",
                self.name, self.unit, self.unit
            ));
        }
        if let Some(max) = self.target.max {
            let worst = quantile(&self.samples, 1.0);
            if worst > max {
                return Some(format!(
                    "{}: max {worst:.3}{} > {max}{}",
                    self.name, self.unit, self.unit
                ));
            }
        }
        if let Some(other) = &self.target.p50_at_most_of {
            let base = run.iter().find(|b| &b.name == other);
            let unfinished = base.is_some_and(|b| b.flags["finished"] == false);
            let limit = base.map_or(f64::NEG_INFINITY, |b| quantile(&b.samples, 0.5));
            if !unfinished && p50 > limit {
                return Some(format!(
                    "{}: p50 {p50:.3}{} > p50({other}) {limit:.3}{}",
                    self.name, self.unit, self.unit
                ));
            }
        }
        let p99 = quantile(&self.samples, 0.99);
        if let Some(limit) = self.p99_limit(run)
            && p99 > limit
        {
            return Some(format!(
                "{}: p99 {p99:.3}{} > {limit:.3}{}",
                self.name, self.unit, self.unit
            ));
        }
        None
    }

    fn describe_target(&self, run: &[Benchmark]) -> String {
        if let Some(max) = self.target.max {
            return format!("max ≤ {max}{}", self.unit);
        }
        if let Some(other) = &self.target.p50_at_most_of {
            return format!("p50 ≤ p50({other}) unless it did not finish");
        }
        match (&self.target.p50_max, &self.target.p99_max) {
            (Some(max), _) => format!("p50 ≤ {max}{}", self.unit),
            (None, Some(rel)) if rel.of.is_empty() => format!("p99 ≤ {}{}", rel.plus, self.unit),
            (None, Some(rel)) => {
                let factor = if rel.times == 1.0 {
                    String::new()
                } else {
                    format!("{} × ", rel.times)
                };
                let plus = if rel.plus == 0.0 {
                    String::new()
                } else {
                    format!(" + {}{}", rel.plus, self.unit)
                };
                let cap = rel
                    .cap
                    .map_or(String::new(), |c| format!("{c}{} and ", self.unit));
                format!(
                    "p99 ≤ {cap}{factor}p99({}){plus} = {:.3}{}",
                    rel.of.join(") + p99("),
                    self.p99_limit(run).unwrap_or(f64::NAN),
                    self.unit
                )
            }
            (None, None) => "–".into(),
        }
    }
}

impl Results {
    /// Descriptions of missed targets.
    pub fn missed(&self) -> Vec<String> {
        self.benchmarks
            .iter()
            .filter_map(|b| b.miss(&self.benchmarks))
            .collect()
    }

    /// Writes `<dir>/<date>-<sha>.json`.
    pub fn write(&self, dir: &Path) -> anyhow::Result<PathBuf> {
        self.write_to(dir, format!("{}-{}.json", self.date, self.sha))
    }

    /// Writes `<dir>/<date>-<sha>-<what>.json` (results of another kind than `just bench`'s,
    /// which must not replace a bench run of the same commit).
    pub fn write_named(&self, dir: &Path, what: &str) -> anyhow::Result<PathBuf> {
        self.write_to(dir, format!("{}-{}-{what}.json", self.date, self.sha))
    }

    fn write_to(&self, dir: &Path, file: String) -> anyhow::Result<PathBuf> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(file);
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(&path, text + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }
}

/// BENCHMARKS.md for every result file in `dir`: the newest run of each benchmark, then the
/// history.
pub fn render(dir: &Path) -> anyhow::Result<String> {
    let files: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .collect(),
        Err(_) => Vec::new(),
    };
    let mut runs = Vec::new();
    for file in &files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let results: Results =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", file.display()))?;
        runs.push((file_name(file), results));
    }
    runs.sort_by(|(fa, a), (fb, b)| (&a.date, a.timestamp, fa).cmp(&(&b.date, b.timestamp, fb)));
    let mut out = String::from(
        "# Benchmarks\n\nRendered by `just bench` from `bench/results/*.json` (raw samples, machine \
         and flags are in those files); do not edit by hand. `just test` runs every benchmark \
         with `--smoke` and checks that this file matches the results.\n\n",
    );
    if runs.is_empty() {
        out.push_str("No results yet.\n");
        return Ok(out);
    }
    out.push_str(
        "| benchmark | run | samples | p50 | p99 | max | secondary p50 | target | met |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    // The newest run of each benchmark; older runs are listed below as history.
    let mut shown = std::collections::BTreeSet::new();
    for (file, results) in runs.iter().rev() {
        for b in &results.benchmarks {
            if !shown.insert(b.name.clone()) {
                continue;
            }
            let met = match b.miss(&results.benchmarks) {
                None if b.target.is_none() => "–",
                None => "yes",
                Some(_) => "**no**",
            };
            out.push_str(&format!(
                "| {} | {} ({} CPUs) | {} | {} | {} | {} | {} | {} | {} |\n",
                b.name,
                file,
                results.machine.cpus,
                b.samples.len(),
                fmt(quantile(&b.samples, 0.5), &b.unit),
                fmt(quantile(&b.samples, 0.99), &b.unit),
                fmt(quantile(&b.samples, 1.0), &b.unit),
                if b.secondary.is_empty() {
                    "–".to_string()
                } else {
                    fmt(quantile(&b.secondary, 0.5), &b.unit)
                },
                b.describe_target(&results.benchmarks),
                met,
            ));
        }
    }
    out.push('\n');
    let mut described = std::collections::BTreeMap::new();
    for (_, results) in &runs {
        for b in &results.benchmarks {
            described.insert(b.name.clone(), b.description.clone());
        }
    }
    for (name, description) in described {
        out.push_str(&format!("- `{name}`: {description}\n"));
    }
    // Every knob of the newest run of each benchmark, QPS and burst of every component
    // included, so that a number is never read without how it was obtained.
    out.push_str("\n## Flags of the newest runs\n\n");
    let mut flagged = std::collections::BTreeSet::new();
    for (file, results) in runs.iter().rev() {
        for b in &results.benchmarks {
            if b.flags.as_object().is_some_and(|o| !o.is_empty()) && flagged.insert(b.name.clone())
            {
                out.push_str(&format!("- `{}` ({file}): `{}`\n", b.name, b.flags));
            }
        }
    }
    out.push_str("\n## Runs\n\n");
    for (file, results) in runs.iter().rev() {
        let missed = results.missed();
        out.push_str(&format!(
            "- `{file}`: {} benchmarks, {}\n",
            results.benchmarks.len(),
            if missed.is_empty() {
                "all targets met".to_string()
            } else {
                format!("missed: {}", missed.join("; "))
            }
        ));
    }
    Ok(out)
}

fn fmt(value: f64, unit: &str) -> String {
    if value >= 100.0 {
        format!("{value:.0}{unit}")
    } else if value >= 1.0 {
        format!("{value:.2}{unit}")
    } else {
        format!("{value:.3}{unit}")
    }
}

fn file_name(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Today's UTC date.
pub fn today() -> anyhow::Result<String> {
    command_output(std::process::Command::new("date").args(["-u", "+%Y-%m-%d"]))
}

/// The short sha of HEAD in `root`.
pub fn git_sha(root: &Path) -> anyhow::Result<String> {
    command_output(std::process::Command::new("git").arg("-C").arg(root).args([
        "rev-parse",
        "--short=12",
        "HEAD",
    ]))
}

fn command_output(command: &mut std::process::Command) -> anyhow::Result<String> {
    let out = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    anyhow::ensure!(out.status.success(), "{command:?} failed");
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_table() {
        for (samples, q, want) in [
            (vec![], 0.5, 0.0),
            (vec![3.0], 0.5, 3.0),
            (vec![5.0, 1.0, 3.0], 0.5, 3.0),
            (vec![1.0, 2.0, 3.0, 4.0], 0.5, 2.0),
            (vec![1.0, 2.0, 3.0, 4.0], 0.9, 4.0),
            (vec![1.0, 2.0, 3.0, 4.0], 1.0, 4.0),
        ] {
            assert_eq!(quantile(&samples, q), want, "{samples:?} q={q}");
        }
    }

    #[test]
    fn render_shows_missed_targets_and_empty_state() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(
            render(dir.path())
                .expect("render")
                .contains("No results yet.")
        );
        let results = Results {
            date: "2026-01-01".into(),
            sha: "abc".into(),
            timestamp: 0,
            machine: Machine {
                cpus: 2,
                kernel: "k".into(),
            },
            benchmarks: vec![Benchmark {
                name: "b".into(),
                description: "d".into(),
                unit: "s".into(),
                samples: vec![2.0, 4.0],
                secondary: vec![],
                target: Target {
                    p50_max: Some(1.0),
                    ..Target::none()
                },
                flags: serde_json::json!({}),
            }],
        };
        assert_eq!(results.missed().len(), 1);
        results.write(dir.path()).expect("write");
        let md = render(dir.path()).expect("render");
        assert!(
            md.contains("| b | 2026-01-01-abc (2 CPUs) | 2 | 2.00s |"),
            "{md}"
        );
        assert!(md.contains("**no**"), "{md}");
    }

    fn bench(name: &str, samples: Vec<f64>, target: Target) -> Benchmark {
        Benchmark {
            name: name.into(),
            description: String::new(),
            unit: "ms".into(),
            samples,
            secondary: vec![],
            target,
            flags: serde_json::json!({}),
        }
    }

    #[test]
    fn relative_targets() {
        let rel = |plus| Target {
            p99_max: Some(RelativeTarget::sum(
                vec!["fsync".into(), "fallocate".into()],
                plus,
            )),
            ..Target::none()
        };
        let run = vec![
            bench("fsync", vec![1.0, 2.0], Target::none()),
            bench("fallocate", vec![0.5, 1.0], Target::none()),
            bench("ok", vec![3.0, 3.4], rel(0.5)),
            bench("slow", vec![3.0, 3.6], rel(0.5)),
        ];
        assert_eq!(run[2].miss(&run), None);
        assert!(run[3].miss(&run).is_some_and(|m| m.contains("slow")));
        assert_eq!(run[0].miss(&run), None, "no target, never missed");
        let missing = vec![bench(
            "x",
            vec![1.0],
            Target {
                p99_max: Some(RelativeTarget::sum(vec!["absent".into()], 0.0)),
                ..Target::none()
            },
        )];
        let floor = |cap| Target {
            p99_max: Some(RelativeTarget {
                times: 2.0,
                cap,
                ..RelativeTarget::sum(vec!["floor".into()], 0.0)
            }),
            ..Target::none()
        };
        let run = vec![
            bench("floor", vec![0.3, 0.4], Target::none()),
            bench("twice", vec![0.7, 0.8], floor(None)),
            bench("more", vec![0.7, 0.81], floor(None)),
            bench("capped", vec![0.7, 0.8], floor(Some(0.75))),
        ];
        assert_eq!(run[1].miss(&run), None, "0.8 ≤ 2 × 0.4");
        assert!(run[2].miss(&run).is_some(), "0.81 > 2 × 0.4");
        assert!(run[3].miss(&run).is_some(), "0.8 > the cap 0.75");
        assert_eq!(
            run[3].describe_target(&run),
            "p99 ≤ 0.75ms and 2 × p99(floor) = 0.750ms"
        );
        assert_eq!(
            missing[0].miss(&missing),
            None,
            "an absent base is an infinite limit"
        );
    }

    #[test]
    fn max_and_no_slower_than_targets() {
        let zero = || Target {
            max: Some(0.0),
            ..Target::none()
        };
        let no_slower = || Target {
            p50_at_most_of: Some("a".into()),
            ..Target::none()
        };
        let mut a = bench("a", vec![10.0], Target::none());
        let run = vec![
            bench("zero", vec![0.0, 0.0], zero()),
            bench("one", vec![0.0, 1.0], zero()),
            bench("faster", vec![9.0], no_slower()),
            bench("slower", vec![11.0], no_slower()),
        ];
        let mut with_a = vec![bench("a", vec![10.0], Target::none())];
        with_a.extend(run);
        assert_eq!(with_a[1].miss(&with_a), None);
        assert!(with_a[2].miss(&with_a).is_some_and(|m| m.contains("max 1")));
        assert_eq!(with_a[3].miss(&with_a), None);
        assert!(
            with_a[4]
                .miss(&with_a)
                .is_some_and(|m| m.contains("p50(a)"))
        );
        // (a) did not finish: (b) cannot be slower than it.
        a.flags = serde_json::json!({"finished": false});
        with_a[0] = a;
        assert_eq!(with_a[4].miss(&with_a), None);
        assert_eq!(
            with_a[4].describe_target(&with_a),
            "p50 ≤ p50(a) unless it did not finish"
        );
    }
}
