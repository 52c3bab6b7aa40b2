//! A map from node name to a value, laid out for the extender's `/filter`, which looks up
//! thousands of candidate names per call.
//!
//! A `HashMap<String, T>` keeps every name in its own heap allocation, placed wherever the
//! allocator had room while the watch events arrived: each lookup's key comparison then misses
//! the cache on a different page, and on a loaded machine those misses were most of a /filter's
//! time. Here the names live back to back in one arena, the values in one dense vector, and the
//! hash table holds only 4-byte slot numbers, so a lookup touches a few cache lines that the
//! previous lookups have most likely brought in already.

use std::fmt;
use std::hash::BuildHasher;

use hashbrown::HashTable;

/// The hasher of maps keyed by node name on the /filter path: fast (node names come from the
/// API server, not from the request's author alone, and kube-scheduler sends only names of
/// nodes it knows).
pub type NodeHasher = foldhash::quality::RandomState;

/// Dead arena bytes tolerated before the arena is rewritten (and at most half of it).
const GARBAGE_SLACK: usize = 64 * 1024;

/// Where a slot's name is in the arena; `len == usize::MAX` marks an empty slot. Kept apart
/// from the values so that the name checks of a lookup read a dense array.
#[derive(Clone, Copy)]
struct Span {
    start: usize,
    len: usize,
    hash: u64,
}

const EMPTY: Span = Span {
    start: 0,
    len: usize::MAX,
    hash: 0,
};

/// Node name → `T`. Names are arbitrary strings; iteration order is unspecified.
pub struct NodeTable<T> {
    hasher: NodeHasher,
    /// Slot numbers, hashed by their names.
    table: HashTable<u32>,
    names: String,
    spans: Vec<Span>,
    values: Vec<Option<T>>,
    /// Empty slots, reused before the vector grows.
    free: Vec<u32>,
    /// Arena bytes of removed names.
    garbage: usize,
}

impl<T> Default for NodeTable<T> {
    fn default() -> Self {
        Self {
            hasher: NodeHasher::default(),
            table: HashTable::new(),
            names: String::new(),
            spans: Vec::new(),
            values: Vec::new(),
            free: Vec::new(),
            garbage: 0,
        }
    }
}

impl<T: fmt::Debug> fmt::Debug for NodeTable<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<T> NodeTable<T> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many names the table holds.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether the table holds no name.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    fn name_of(&self, slot: u32) -> Option<&str> {
        let span = self.spans.get(slot as usize)?;
        self.names
            .get(span.start..span.start.checked_add(span.len)?)
    }

    /// The slot of `name`: its value's position, stable while the name stays and handed to
    /// another name only after it was removed.
    pub fn slot(&self, name: &str) -> Option<u32> {
        self.find(name)
    }

    /// The value in `slot`, if the slot is occupied.
    pub fn get_at(&self, slot: u32) -> Option<&T> {
        self.values.get(slot as usize)?.as_ref()
    }

    /// The name in `slot`, if the slot is occupied.
    pub fn name_at(&self, slot: u32) -> Option<&str> {
        self.name_of(slot)
    }

    fn find(&self, name: &str) -> Option<u32> {
        if self.table.is_empty() {
            return None;
        }
        let hash = self.hasher.hash_one(name);
        self.table
            .find(hash, |slot| self.name_of(*slot) == Some(name))
            .copied()
    }

    /// The value of `name`.
    pub fn get(&self, name: &str) -> Option<&T> {
        let slot = self.find(name)?;
        self.values.get(slot as usize)?.as_ref()
    }

    /// The value of `name`, mutable.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut T> {
        let slot = self.find(name)?;
        self.values.get_mut(slot as usize)?.as_mut()
    }

    /// The value of `name`, inserting `make(slot)` first when there is none (`slot`: where it
    /// goes, see [`NodeTable::slot`]).
    pub fn get_or_insert_with(&mut self, name: &str, make: impl FnOnce(u32) -> T) -> &mut T {
        let slot = match self.find(name) {
            Some(slot) => slot,
            None => {
                let slot = self
                    .free
                    .last()
                    .copied()
                    .unwrap_or_else(|| u32::try_from(self.spans.len()).unwrap_or(u32::MAX));
                self.insert_new(name, make(slot))
            }
        };
        match self.values.get_mut(slot as usize) {
            Some(Some(value)) => value,
            // insert_new just filled this slot.
            _ => unreachable!("slot {slot} of a present name is empty"),
        }
    }

    fn insert_new(&mut self, name: &str, value: T) -> u32 {
        let hash = self.hasher.hash_one(name);
        let start = self.names.len();
        self.names.push_str(name);
        let span = Span {
            start,
            len: name.len(),
            hash,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                if let (Some(s), Some(v)) = (
                    self.spans.get_mut(slot as usize),
                    self.values.get_mut(slot as usize),
                ) {
                    *s = span;
                    *v = Some(value);
                }
                slot
            }
            None => {
                self.spans.push(span);
                self.values.push(Some(value));
                u32::try_from(self.spans.len() - 1).unwrap_or(u32::MAX)
            }
        };
        let spans = &self.spans;
        self.table
            .insert_unique(hash, slot, |s| spans.get(*s as usize).map_or(0, |s| s.hash));
        slot
    }

    /// Removes `name`, returning its value.
    pub fn remove(&mut self, name: &str) -> Option<T> {
        if self.table.is_empty() {
            return None;
        }
        let hash = self.hasher.hash_one(name);
        let (spans, names) = (&self.spans, &self.names);
        let entry = self
            .table
            .find_entry(hash, |slot| {
                spans
                    .get(*slot as usize)
                    .and_then(|s| names.get(s.start..s.start.checked_add(s.len)?))
                    == Some(name)
            })
            .ok()?;
        let (slot, _) = entry.remove();
        let span = std::mem::replace(self.spans.get_mut(slot as usize)?, EMPTY);
        let removed = self.values.get_mut(slot as usize)?.take();
        self.free.push(slot);
        self.garbage += span.len;
        if self.garbage > GARBAGE_SLACK && self.garbage * 2 > self.names.len() {
            self.compact();
        }
        removed
    }

    /// Rewrites the arena without the removed names; slot numbers and hashes stay.
    fn compact(&mut self) {
        let mut names = String::with_capacity(self.names.len() - self.garbage);
        for span in self.spans.iter_mut().filter(|s| s.len != usize::MAX) {
            let start = names.len();
            names.push_str(
                self.names
                    .get(span.start..span.start + span.len)
                    .unwrap_or_default(),
            );
            span.start = start;
        }
        self.names = names;
        self.garbage = 0;
    }

    /// Every name with its value.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &T)> {
        self.values.iter().enumerate().filter_map(|(slot, value)| {
            let name = self.name_of(u32::try_from(slot).ok()?)?;
            Some((name, value.as_ref()?))
        })
    }

    /// Every name with its value, mutable.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&str, &mut T)> {
        let (names, spans) = (&self.names, &self.spans);
        self.values
            .iter_mut()
            .zip(spans)
            .filter_map(move |(value, s)| {
                let name = names.get(s.start..s.start.checked_add(s.len)?)?;
                Some((name, value.as_mut()?))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[test]
    fn insert_get_remove_table() {
        let mut table = NodeTable::new();
        assert!(table.is_empty());
        assert_eq!(table.get("a"), None);
        assert_eq!(table.remove("a"), None);
        *table.get_or_insert_with("a", |_| 1) += 10;
        assert_eq!(
            *table.get_or_insert_with("a", |_| 99),
            11,
            "present: not made"
        );
        table.get_or_insert_with("", |_| 2);
        table.get_or_insert_with("ä-node", |_| 3);
        assert_eq!(table.len(), 3);
        assert_eq!(
            (table.get("a"), table.get(""), table.get("ä-node")),
            (Some(&11), Some(&2), Some(&3))
        );
        assert_eq!(table.get("b"), None);
        if let Some(v) = table.get_mut("") {
            *v = 20;
        }
        assert_eq!(table.remove(""), Some(20));
        assert_eq!(table.get(""), None);
        // The slot is reused, the other names are untouched.
        table.get_or_insert_with("c", |_| 4);
        let all: BTreeMap<&str, i32> = table.iter().map(|(n, v)| (n, *v)).collect();
        assert_eq!(all, BTreeMap::from([("a", 11), ("c", 4), ("ä-node", 3)]));
        for (_, v) in table.iter_mut() {
            *v += 1;
        }
        assert_eq!(table.get("c"), Some(&5));
    }

    #[test]
    fn many_removals_compact_the_arena() {
        let mut table = NodeTable::new();
        for i in 0..20_000 {
            table.get_or_insert_with(&format!("node-{i:08}"), |_| i);
        }
        let full = table.names.len();
        for i in (0..20_000).filter(|i| i % 4 != 0) {
            assert_eq!(table.remove(&format!("node-{i:08}")), Some(i));
        }
        assert!(table.names.len() < full / 2, "arena rewritten");
        assert_eq!(table.len(), 5_000);
        for i in 0..20_000 {
            let want = (i % 4 == 0).then_some(i);
            assert_eq!(table.get(&format!("node-{i:08}")).copied(), want, "{i}");
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u8, u16),
        Remove(u8),
    }

    proptest! {
        /// The table behaves like a map, whatever the order of inserts and removals.
        #[test]
        fn agrees_with_a_map(ops in prop::collection::vec(
            prop_oneof![
                (0..40u8, any::<u16>()).prop_map(|(n, v)| Op::Insert(n, v)),
                (0..40u8).prop_map(Op::Remove),
            ],
            0..300,
        )) {
            let mut table = NodeTable::new();
            let mut map = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(n, v) => {
                        let name = format!("n{n}");
                        let mut made = None;
                        *table.get_or_insert_with(&name, |slot| { made = Some(slot); v }) = v;
                        if let Some(slot) = made {
                            prop_assert_eq!(table.slot(&name), Some(slot));
                        }
                        map.insert(name, v);
                    }
                    Op::Remove(n) => {
                        let name = format!("n{n}");
                        prop_assert_eq!(table.remove(&name), map.remove(&name));
                    }
                }
                prop_assert_eq!(table.len(), map.len());
            }
            for n in 0..40u8 {
                let name = format!("n{n}");
                prop_assert_eq!(table.get(&name), map.get(&name));
                let named = table.slot(&name).and_then(|slot| table.name_at(slot));
                prop_assert_eq!(named, map.contains_key(&name).then_some(name.as_str()));
                let at = table.slot(&name).and_then(|slot| table.get_at(slot));
                prop_assert_eq!(at, map.get(&name));
            }
            let all: BTreeMap<String, u16> = table.iter().map(|(n, v)| (n.to_owned(), *v)).collect();
            prop_assert_eq!(all, map);
        }
    }
}
