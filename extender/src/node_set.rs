//! A set of nodes by [`NodeId`], one bit per id.
//!
//! A reserve-all reservation names every candidate, thousands of nodes, and a pod's every
//! /filter replaces its reservation. As a hash set that was thousands of hashed inserts per
//! call and tens of bytes per node per pending pod; node ids are dense (a node's slot in the
//! index), so a bitmap holds 5,000 nodes in 625 bytes, is built by setting bits in order and
//! answers "is node n in it" with one load.

use crate::capacity_index::NodeId;

const BITS: usize = u64::BITS as usize;

/// A set of node ids. Iterates in increasing id order.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct NodeSet {
    /// Bit `i % 64` of word `i / 64` is id `i`; no trailing zero words.
    words: Vec<u64>,
    len: usize,
}

impl std::fmt::Debug for NodeSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

impl NodeSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `id`; `true` when it was not in the set.
    pub fn insert(&mut self, id: NodeId) -> bool {
        let (word, bit) = (id.index() / BITS, 1u64 << (id.index() % BITS));
        if word >= self.words.len() {
            self.words.resize(word + 1, 0);
        }
        let Some(w) = self.words.get_mut(word) else {
            return false;
        };
        let added = *w & bit == 0;
        *w |= bit;
        self.len += usize::from(added);
        added
    }

    /// Whether `id` is in the set.
    #[inline]
    pub fn contains(&self, id: NodeId) -> bool {
        self.words
            .get(id.index() / BITS)
            .is_some_and(|w| w & (1u64 << (id.index() % BITS)) != 0)
    }

    /// How many ids the set holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the set holds no id.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The ids, in increasing order.
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            words: &self.words,
            next_word: 0,
            current: 0,
            base: 0,
            left: self.len,
        }
    }
}

impl FromIterator<NodeId> for NodeSet {
    fn from_iter<I: IntoIterator<Item = NodeId>>(ids: I) -> Self {
        let mut set = NodeSet::new();
        set.extend(ids);
        set
    }
}

impl Extend<NodeId> for NodeSet {
    fn extend<I: IntoIterator<Item = NodeId>>(&mut self, ids: I) {
        for id in ids {
            self.insert(id);
        }
    }
}

impl<'a> IntoIterator for &'a NodeSet {
    type Item = NodeId;
    type IntoIter = Iter<'a>;
    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

/// The ids of a [`NodeSet`], in increasing order.
#[derive(Clone, Debug)]
pub struct Iter<'a> {
    words: &'a [u64],
    /// The word after `current`'s.
    next_word: usize,
    /// The bits of the current word not yet returned.
    current: u64,
    /// The id of bit 0 of `current`.
    base: usize,
    left: usize,
}

impl Iterator for Iter<'_> {
    type Item = NodeId;

    fn next(&mut self) -> Option<NodeId> {
        while self.current == 0 {
            self.current = *self.words.get(self.next_word)?;
            self.base = self.next_word * BITS;
            self.next_word += 1;
        }
        let bit = self.current.trailing_zeros() as usize;
        self.current &= self.current - 1;
        self.left = self.left.saturating_sub(1);
        NodeId::from_index(self.base + bit)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for Iter<'_> {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn id(i: usize) -> NodeId {
        NodeId::from_index(i).expect("test id")
    }

    #[test]
    fn insert_contains_iterate_table() {
        let mut set = NodeSet::new();
        assert!(set.is_empty() && !set.contains(id(0)) && set.iter().next().is_none());
        for (i, added) in [
            (5, true),
            (0, true),
            (5, false),
            (63, true),
            (64, true),
            (700, true),
        ] {
            assert_eq!(set.insert(id(i)), added, "{i}");
        }
        assert_eq!(set.len(), 5);
        let all: Vec<usize> = set.iter().map(NodeId::index).collect();
        assert_eq!(all, [0, 5, 63, 64, 700]);
        assert_eq!(set.iter().len(), 5);
        for i in [1, 62, 65, 699, 701, 100_000] {
            assert!(!set.contains(id(i)), "{i}");
        }
        assert_eq!(format!("{set:?}").matches("NodeId").count(), 5);
    }

    proptest! {
        /// The set behaves like an ordered set of ids.
        #[test]
        fn agrees_with_a_set(ids in prop::collection::vec(0usize..2_000, 0..200)) {
            let set: NodeSet = ids.iter().map(|i| id(*i)).collect();
            let want: BTreeSet<usize> = ids.iter().copied().collect();
            prop_assert_eq!(set.len(), want.len());
            let mut iter = set.iter();
            prop_assert_eq!(iter.len(), want.len());
            let got: Vec<usize> = iter.by_ref().map(NodeId::index).collect();
            prop_assert_eq!(got, want.iter().copied().collect::<Vec<_>>());
            prop_assert_eq!(iter.len(), 0);
            for i in 0..2_100 {
                prop_assert_eq!(set.contains(id(i)), want.contains(&i));
            }
        }
    }
}
