//! `/prioritize`: scores 0–10 per node from the free capacity left after placing the pod.
//!
//! Scores are relative among the nodes of one request: linear between the smallest and the
//! largest free capacity of the nodes where the pod fits, so the spread always uses the whole
//! range whatever the node sizes. Nodes where the pod does not fit score 0 (kube-scheduler only
//! asks about nodes that passed `/filter`, so this is a fallback). When all fitting nodes have
//! the same free capacity, they all score 10 under either policy: there is nothing to prefer, and
//! a uniform score leaves the choice to the other plugins.

use std::fmt;
use std::str::FromStr;

use crate::api::{HostPriority, HostPriorityList};

/// The best score an extender may give (kube-scheduler's `MaxExtenderPriority`).
pub const MAX_SCORE: i64 = 10;

/// Which nodes `/prioritize` prefers (`--score`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScorePolicy {
    /// Spread: prefer the node with the most PMEM left after the pod.
    #[default]
    MostFree,
    /// Pack: prefer the node with the least PMEM left, keeping large free nodes for large pods.
    LeastFree,
}

/// A `--score` value that is not a policy.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown score policy {0:?}, expected \"most-free\" or \"least-free\"")]
pub struct UnknownPolicy(pub String);

impl FromStr for ScorePolicy {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "most-free" => Ok(ScorePolicy::MostFree),
            "least-free" => Ok(ScorePolicy::LeastFree),
            other => Err(UnknownPolicy(other.to_owned())),
        }
    }
}

impl fmt::Display for ScorePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScorePolicy::MostFree => "most-free",
            ScorePolicy::LeastFree => "least-free",
        })
    }
}

/// Scores each node, in input order. `free_after` is fit's `free_after` for the node, or `None`
/// where the pod does not fit.
pub fn scores<'a>(
    policy: ScorePolicy,
    nodes: impl IntoIterator<Item = (&'a str, Option<u64>)>,
) -> HostPriorityList {
    let nodes: Vec<(&str, Option<u64>)> = nodes.into_iter().collect();
    let fitting = nodes.iter().filter_map(|(_, free)| *free);
    let min = fitting.clone().min().unwrap_or(0);
    let max = fitting.max().unwrap_or(0);
    nodes
        .into_iter()
        .map(|(host, free)| HostPriority {
            host: host.to_owned(),
            score: free.map_or(0, |free| score(policy, free, min, max)),
        })
        .collect()
}

/// The node `--placement=pin` picks: the highest score, the first in input order on ties;
/// `None` when the pod fits nowhere.
pub fn best<'a>(
    policy: ScorePolicy,
    nodes: impl IntoIterator<Item = (&'a str, Option<u64>)>,
) -> Option<&'a str> {
    let nodes: Vec<(&'a str, Option<u64>)> = nodes.into_iter().collect();
    let scored = scores(policy, nodes.iter().copied());
    nodes
        .iter()
        .zip(&scored)
        .filter(|((_, free), _)| free.is_some())
        // max_by_key keeps the last maximum; reversing keeps the first.
        .rev()
        .max_by_key(|(_, s)| s.score)
        .map(|((name, _), _)| *name)
}

fn score(policy: ScorePolicy, free: u64, min: u64, max: u64) -> i64 {
    let span = u128::from(max - min);
    if span == 0 {
        return MAX_SCORE;
    }
    let above_min = u128::from(free.saturating_sub(min));
    let numerator = match policy {
        ScorePolicy::MostFree => above_min,
        ScorePolicy::LeastFree => span.saturating_sub(above_min),
    };
    // Rounded to the nearest integer; u128 keeps `numerator * 10` exact for any u64 span.
    let scaled = (numerator * u128::from(MAX_SCORE.unsigned_abs()) + span / 2) / span;
    i64::try_from(scaled).unwrap_or(MAX_SCORE).min(MAX_SCORE)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: u64 = 1 << 30;

    #[test]
    fn scores_table() {
        use ScorePolicy::{LeastFree, MostFree};
        let max = u64::MAX;
        for (name, policy, nodes, want) in [
            ("no nodes", MostFree, vec![], vec![]),
            ("one node", MostFree, vec![("a", Some(GI))], vec![10]),
            ("one node least", LeastFree, vec![("a", Some(GI))], vec![10]),
            (
                "all equal most",
                MostFree,
                vec![("a", Some(GI)), ("b", Some(GI))],
                vec![10, 10],
            ),
            (
                "all equal least",
                LeastFree,
                vec![("a", Some(GI)), ("b", Some(GI))],
                vec![10, 10],
            ),
            (
                "all zero",
                MostFree,
                vec![("a", Some(0)), ("b", Some(0))],
                vec![10, 10],
            ),
            (
                "none fit",
                MostFree,
                vec![("a", None), ("b", None)],
                vec![0, 0],
            ),
            (
                "linear most",
                MostFree,
                vec![
                    ("a", Some(0)),
                    ("b", Some(5 * GI)),
                    ("c", Some(10 * GI)),
                    ("d", Some(2 * GI)),
                ],
                vec![0, 5, 10, 2],
            ),
            (
                "linear least",
                LeastFree,
                vec![
                    ("a", Some(0)),
                    ("b", Some(5 * GI)),
                    ("c", Some(10 * GI)),
                    ("d", Some(2 * GI)),
                ],
                vec![10, 5, 0, 8],
            ),
            (
                "relative, not absolute",
                MostFree,
                vec![("a", Some(100 * GI)), ("b", Some(101 * GI))],
                vec![0, 10],
            ),
            (
                "rounding",
                MostFree,
                vec![("a", Some(0)), ("b", Some(15)), ("c", Some(100))],
                vec![0, 2, 10],
            ),
            (
                "not fitting scores 0 and is not in the range",
                LeastFree,
                vec![("a", Some(4 * GI)), ("b", None), ("c", Some(8 * GI))],
                vec![10, 0, 0],
            ),
            (
                "huge values",
                MostFree,
                vec![("a", Some(0)), ("b", Some(max / 2)), ("c", Some(max))],
                vec![0, 5, 10],
            ),
            (
                "huge values least",
                LeastFree,
                vec![("a", Some(max - 1)), ("b", Some(max))],
                vec![10, 0],
            ),
        ] {
            let got: Vec<i64> = scores(policy, nodes.clone())
                .into_iter()
                .map(|h| h.score)
                .collect();
            assert_eq!(got, want, "{name}");
            let hosts: Vec<String> = scores(policy, nodes.clone())
                .into_iter()
                .map(|h| h.host)
                .collect();
            assert_eq!(
                hosts,
                nodes
                    .iter()
                    .map(|(n, _)| (*n).to_owned())
                    .collect::<Vec<_>>(),
                "{name}"
            );
        }
    }

    #[test]
    fn best_table() {
        use ScorePolicy::{LeastFree, MostFree};
        for (name, policy, nodes, want) in [
            ("none", MostFree, vec![], None),
            ("none fit", MostFree, vec![("a", None)], None),
            (
                "most",
                MostFree,
                vec![("a", Some(1)), ("b", Some(3)), ("c", Some(2))],
                Some("b"),
            ),
            (
                "least",
                LeastFree,
                vec![("a", Some(2)), ("b", Some(3)), ("c", Some(1))],
                Some("c"),
            ),
            (
                "tie: first",
                MostFree,
                vec![("a", Some(1)), ("b", Some(1))],
                Some("a"),
            ),
            (
                "skips unfit",
                LeastFree,
                vec![("a", None), ("b", Some(5))],
                Some("b"),
            ),
            (
                "minimum fitting beats unfit",
                MostFree,
                vec![("a", None), ("b", Some(0)), ("c", Some(9))],
                Some("c"),
            ),
            (
                "lone fitting with score 0 tie",
                LeastFree,
                vec![("x", None), ("b", Some(9)), ("c", Some(0))],
                Some("c"),
            ),
        ] {
            assert_eq!(best(policy, nodes), want, "{name}");
        }
    }

    #[test]
    fn policy_strings() {
        for policy in [ScorePolicy::MostFree, ScorePolicy::LeastFree] {
            assert_eq!(policy.to_string().parse::<ScorePolicy>(), Ok(policy));
        }
        assert_eq!(ScorePolicy::default(), ScorePolicy::MostFree);
        assert_eq!("most-free".parse(), Ok(ScorePolicy::MostFree));
        let err = "MostFree".parse::<ScorePolicy>().expect_err("not a policy");
        assert_eq!(
            err.to_string(),
            r#"unknown score policy "MostFree", expected "most-free" or "least-free""#
        );
    }
}
