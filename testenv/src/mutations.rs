//! Deterministic (fixed-seed) proptest mutations of valid request bodies, for replaying
//! damaged input against our servers: byte flips, truncation, insertion, deletion and
//! duplication of ranges.

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

#[derive(Clone, Debug)]
enum Edit {
    Flip { at: usize, value: u8 },
    Truncate { at: usize },
    Insert { at: usize, bytes: Vec<u8> },
    Delete { at: usize, len: usize },
    Duplicate { at: usize, len: usize },
}

fn edit() -> impl Strategy<Value = Edit> {
    // Positions are fractions of the body (per mille), so one strategy fits every sample.
    prop_oneof![
        (0usize..1000, any::<u8>()).prop_map(|(at, value)| Edit::Flip { at, value }),
        (0usize..1000).prop_map(|at| Edit::Truncate { at }),
        (
            0usize..1000,
            prop::collection::vec(
                prop_oneof![
                    Just(b'{'),
                    Just(b'}'),
                    Just(b'['),
                    Just(b'"'),
                    Just(b','),
                    Just(b':'),
                    Just(b'9'),
                    any::<u8>()
                ],
                1..16
            )
        )
            .prop_map(|(at, bytes)| Edit::Insert { at, bytes }),
        (0usize..1000, 1usize..64).prop_map(|(at, len)| Edit::Delete { at, len }),
        (0usize..1000, 1usize..64).prop_map(|(at, len)| Edit::Duplicate { at, len }),
    ]
}

fn apply(body: &mut Vec<u8>, edit: &Edit) {
    let pos = |per_mille: usize, len: usize| len * per_mille / 1000;
    match edit {
        Edit::Flip { at, value } => {
            let i = pos(*at, body.len());
            if let Some(b) = body.get_mut(i) {
                *b = *value;
            }
        }
        Edit::Truncate { at } => body.truncate(pos(*at, body.len())),
        Edit::Insert { at, bytes } => {
            let i = pos(*at, body.len());
            body.splice(i..i, bytes.iter().copied());
        }
        Edit::Delete { at, len } => {
            let i = pos(*at, body.len());
            let end = (i + len).min(body.len());
            body.drain(i..end);
        }
        Edit::Duplicate { at, len } => {
            let i = pos(*at, body.len());
            let end = (i + len).min(body.len());
            let copy = body[i..end].to_vec();
            body.splice(end..end, copy);
        }
    }
}

/// `n` mutated copies of `samples`, the same for the same `seed`.
pub fn mutations(samples: &[Vec<u8>], n: usize, seed: u8) -> Vec<Vec<u8>> {
    if samples.is_empty() {
        return Vec::new();
    }
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
    );
    let strategy = (0..samples.len(), prop::collection::vec(edit(), 1..5));
    (0..n)
        .filter_map(|_| {
            let (which, edits) = strategy.new_tree(&mut runner).ok()?.current();
            let mut body = samples.get(which)?.clone();
            for e in &edits {
                apply(&mut body, e);
            }
            Some(body)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_different() {
        let samples = vec![br#"{"a":[1,2,3],"b":"text"}"#.to_vec()];
        let first = mutations(&samples, 50, 7);
        assert_eq!(first.len(), 50);
        assert_eq!(first, mutations(&samples, 50, 7), "same seed, same bodies");
        assert_ne!(first, mutations(&samples, 50, 8));
        assert!(first.iter().any(|b| b != &samples[0]));
    }
}
