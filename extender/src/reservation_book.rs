//! The reservation book: capacity the extender promised to pods it let through `/filter`, until
//! the node's own allocation shows up in the index.
//!
//! A reservation belongs to one pod (by uid) and holds one entry per pending volume, reserved on
//! every node the filter returned. Entries end one by one, each at the moment the index starts
//! counting the same bytes as `allocated`:
//! - a claim entry when its PVC shows `volume.kubernetes.io/selected-node`, or its PV appears
//!   first ([`ReservationBook::claim_selected`]);
//! - an inline entry when its pod is bound ([`ReservationBook::pod_bound`]).
//!
//! **Hand-over rule for callers:** the book and the index must be updated under the same lock,
//! in the same critical section: remove the entry here and add its size to `allocated` there.
//! Otherwise a concurrent `/filter` sees the bytes twice (too pessimistic) or not at all (an
//! overcommit, the race the book exists to prevent).
//!
//! A reservation ends when all its entries have, when its pod is deleted or filtered again
//! (replaced), or at its expiry. An expiry means an entry never saw its hand-over, so callers
//! count it as a bug signal.
//!
//! Time is an [`Instant`] passed in; the book never reads a clock.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::capacity_index::NodeId;
use crate::node_set::NodeSet;
use controllers::volume_facts::ClaimKey;

/// How long a reservation lives when nothing ends it (`--reservation-ttl` default).
pub const DEFAULT_TTL: Duration = Duration::from_secs(10 * 60);

/// What one reserved volume is: a pod's demand entry (its journal form is `kind` plus the
/// key's fields).
pub use controllers::pod_volumes::DemandKey as EntryKey;

/// One reserved volume.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Entry {
    /// Which volume.
    #[serde(flatten)]
    pub key: EntryKey,
    /// Its requested size in bytes; each node's fit rounds it up to that node's alignment.
    pub size: u64,
}

/// A reservation as reported when it ends other than by its entries (for logs and counters).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReservationSummary {
    /// The owning pod's uid.
    pub pod_uid: String,
    /// The nodes it was held on.
    pub nodes: NodeSet,
    /// The entries still open.
    pub entries: Vec<Entry>,
    /// When it was made.
    pub created: Instant,
}

#[derive(Clone, Debug)]
struct Reservation {
    // A bitmap: `reserved_on` asks once per candidate node, thousands per /filter, and a
    // reserve-all reservation is rebuilt on every /filter of its pod.
    nodes: NodeSet,
    entries: BTreeMap<EntryKey, u64>,
    created: Instant,
    /// `None`: the TTL does not fit into an `Instant`, so it never expires.
    expires: Option<Instant>,
}

impl Reservation {
    fn entries(&self) -> impl Iterator<Item = Entry> {
        self.entries.iter().map(|(key, size)| Entry {
            key: key.clone(),
            size: *size,
        })
    }

    fn bytes(&self) -> u64 {
        self.entries
            .values()
            .fold(0, |sum: u64, s| sum.saturating_add(*s))
    }

    /// Moves the nodes out instead of copying them: a reserve-all reservation can name
    /// thousands, and every /filter of a pod replaces the previous one.
    fn into_summary(self, pod_uid: &str) -> ReservationSummary {
        ReservationSummary {
            pod_uid: pod_uid.to_owned(),
            entries: self.entries().collect(),
            nodes: self.nodes,
            created: self.created,
        }
    }
}

/// The open reservations but one pod's ([`ReservationBook::others`]).
#[derive(Debug)]
pub struct OtherReservations<'a>(Vec<&'a Reservation>);

impl OtherReservations<'_> {
    /// Whether any of these reservations is held on `node`.
    #[inline]
    pub fn hold(&self, node: NodeId) -> bool {
        self.0.iter().any(|r| r.nodes.contains(node))
    }

    /// Bytes these reservations hold on `node`, their entries' sizes appended to `sizes` (no
    /// allocation on the extender's per-node path); returns their total.
    #[inline]
    pub fn reserved_into(&self, node: NodeId, sizes: &mut Vec<u64>) -> u64 {
        let mut total = 0u64;
        for r in self.0.iter().filter(|r| r.nodes.contains(node)) {
            for size in r.entries.values() {
                total = total.saturating_add(*size);
                sizes.push(*size);
            }
        }
        total
    }
}

/// All open reservations of one extender instance, on nodes identified by the capacity index's
/// [`NodeId`] (a reserve-all reservation names thousands of nodes, and every /filter of a pod
/// replaces it, so node names would be allocated, hashed and freed thousands of times per call).
#[derive(Clone, Debug)]
pub struct ReservationBook {
    ttl: Duration,
    by_pod: BTreeMap<String, Reservation>,
    /// Which pod's reservation holds each claim: a claim is held at most once, even when several
    /// pending pods use it, so that it is never counted twice.
    claims: BTreeMap<ClaimKey, String>,
}

impl Default for ReservationBook {
    fn default() -> Self {
        Self::new(DEFAULT_TTL)
    }
}

impl ReservationBook {
    /// An empty book whose reservations expire `ttl` after they are made.
    pub fn new(ttl: Duration) -> Self {
        ReservationBook {
            ttl,
            by_pod: BTreeMap::new(),
            claims: BTreeMap::new(),
        }
    }

    /// Reserves `entries` for the pod on each of `nodes`, replacing the pod's previous
    /// reservation (a pod filtered again). Returns the replaced reservation, if any.
    ///
    /// Nothing is stored when there are no entries or no nodes (a pod without pending demand, or
    /// fitting nowhere, holds nothing). A claim already held by another pod's reservation moves
    /// to this one; duplicate keys keep the last size.
    pub fn reserve(
        &mut self,
        pod_uid: &str,
        nodes: impl IntoIterator<Item = NodeId>,
        entries: impl IntoIterator<Item = Entry>,
        now: Instant,
    ) -> Option<ReservationSummary> {
        let expires = now.checked_add(self.ttl);
        self.reserve_until(pod_uid, nodes, entries, now, expires)
    }

    /// [`ReservationBook::reserve`] with the expiry given (`None`: never), for a reservation
    /// brought back after a restart, which keeps the expiry it had.
    pub fn reserve_until(
        &mut self,
        pod_uid: &str,
        nodes: impl IntoIterator<Item = NodeId>,
        entries: impl IntoIterator<Item = Entry>,
        now: Instant,
        expires: Option<Instant>,
    ) -> Option<ReservationSummary> {
        let replaced = self.remove(pod_uid);
        let nodes: NodeSet = nodes.into_iter().collect();
        let entries: BTreeMap<EntryKey, u64> =
            entries.into_iter().map(|e| (e.key, e.size)).collect();
        if nodes.is_empty() || entries.is_empty() {
            return replaced;
        }
        for key in entries.keys() {
            if let EntryKey::Claim(claim) = key
                && let Some(holder) = self.claims.insert(claim.clone(), pod_uid.to_owned())
            {
                self.drop_entry(&holder, key);
            }
        }
        self.by_pod.insert(
            pod_uid.to_owned(),
            Reservation {
                nodes,
                entries,
                created: now,
                expires,
            },
        );
        replaced
    }

    /// The claim `namespace/name` shows selected-node `node`: its entry leaves the book and
    /// `(node, size)` is returned, which the caller adds to `allocated` of that node **in the same
    /// locked update**. The node need not be one the reservation was held on; the claim will be
    /// provisioned there regardless. `None` when no reservation holds the claim.
    pub fn claim_selected(&mut self, claim: &ClaimKey, node: &str) -> Option<(String, u64)> {
        let holder = self.claims.remove(claim)?;
        let key = EntryKey::Claim(claim.clone());
        let size = self.drop_entry(&holder, &key)?;
        Some((node.to_owned(), size))
    }

    /// The pod was bound to `node`: its inline entries end (returned, for the caller to add to
    /// `allocated` of `node` in the same locked update) and its remaining claim entries are held
    /// on `node` only, because that is where they will be provisioned. `None`: a node the caller
    /// cannot identify (one without published capacity, where no fit could count them anyway):
    /// the claim entries are held nowhere until their selected-node hands them over.
    pub fn pod_bound(&mut self, pod_uid: &str, node: Option<NodeId>) -> Vec<Entry> {
        let Some(reservation) = self.by_pod.get_mut(pod_uid) else {
            return Vec::new();
        };
        let inline: Vec<EntryKey> = reservation
            .entries
            .keys()
            .filter(|k| matches!(k, EntryKey::Inline { .. }))
            .cloned()
            .collect();
        let ended = inline
            .into_iter()
            .filter_map(|key| {
                let size = reservation.entries.remove(&key)?;
                Some(Entry { key, size })
            })
            .collect();
        reservation.nodes = node.into_iter().collect();
        if reservation.entries.is_empty() {
            self.by_pod.remove(pod_uid);
        }
        ended
    }

    /// The pod was deleted: its reservation ends. Returns it, if there was one.
    pub fn pod_deleted(&mut self, pod_uid: &str) -> Option<ReservationSummary> {
        self.remove(pod_uid)
    }

    /// Ends every reservation whose expiry is at or before `now` and returns them.
    pub fn expire(&mut self, now: Instant) -> Vec<ReservationSummary> {
        let expired: Vec<String> = self
            .by_pod
            .iter()
            .filter(|(_, r)| r.expires.is_some_and(|e| e <= now))
            .map(|(uid, _)| uid.clone())
            .collect();
        expired.iter().filter_map(|uid| self.remove(uid)).collect()
    }

    /// Bytes reserved on `node` by every pod except `excluding_pod` (a pod filtered again must not
    /// see its own reservation), as the total and the sizes of the entries.
    pub fn reserved_on(&self, node: NodeId, excluding_pod: &str) -> (u64, Vec<u64>) {
        let mut sizes = Vec::new();
        let total = self.reserved_into(node, excluding_pod, &mut sizes);
        (total, sizes)
    }

    /// [`ReservationBook::reserved_on`] appending the sizes to `sizes`; returns their total.
    pub fn reserved_into(&self, node: NodeId, excluding_pod: &str, sizes: &mut Vec<u64>) -> u64 {
        self.others(excluding_pod).reserved_into(node, sizes)
    }

    /// The reservations of every pod except `excluding_pod`, set aside once for asking about
    /// many nodes (a /filter asks about thousands; comparing the pod's uid with each
    /// reservation's on every node cost more than the rest of the lookup).
    pub fn others(&self, excluding_pod: &str) -> OtherReservations<'_> {
        OtherReservations(
            self.by_pod
                .iter()
                .filter(|(uid, _)| uid.as_str() != excluding_pod)
                .map(|(_, r)| r)
                .collect(),
        )
    }

    /// Bytes withheld from nodes' capacity, summed over nodes (a pod reserving 1 GiB on three
    /// nodes counts 3 GiB): the value of the `pmem_csi_reserved_bytes` gauge.
    pub fn total_reserved(&self) -> u64 {
        self.by_pod.values().fold(0, |sum: u64, r| {
            let nodes = u64::try_from(r.nodes.len()).unwrap_or(u64::MAX);
            sum.saturating_add(r.bytes().saturating_mul(nodes))
        })
    }

    /// How many reservations are open.
    pub fn len(&self) -> usize {
        self.by_pod.len()
    }

    /// Whether no reservation is open.
    pub fn is_empty(&self) -> bool {
        self.by_pod.is_empty()
    }

    /// Every open reservation: the pod's uid, its nodes, its entries and its expiry.
    pub fn iter(
        &self,
    ) -> impl Iterator<
        Item = (
            &str,
            impl ExactSizeIterator<Item = NodeId>,
            impl Iterator<Item = Entry>,
            Option<Instant>,
        ),
    > {
        self.by_pod
            .iter()
            .map(|(uid, r)| (uid.as_str(), r.nodes.iter(), r.entries(), r.expires))
    }

    /// The pod's open reservation, as [`ReservationBook::iter`] shows it, without copying it.
    pub fn reservation(
        &self,
        pod_uid: &str,
    ) -> Option<(
        impl ExactSizeIterator<Item = NodeId>,
        impl Iterator<Item = Entry>,
        Option<Instant>,
    )> {
        self.by_pod
            .get(pod_uid)
            .map(|r| (r.nodes.iter(), r.entries(), r.expires))
    }

    /// The nodes some open reservation is held on (with repetitions).
    pub fn held_on(&self) -> impl Iterator<Item = NodeId> {
        self.by_pod.values().flat_map(|r| r.nodes.iter())
    }

    /// Whether the pod holds an open reservation.
    pub fn contains(&self, pod_uid: &str) -> bool {
        self.by_pod.contains_key(pod_uid)
    }

    /// The open reservation of a pod, if any.
    pub fn get(&self, pod_uid: &str) -> Option<ReservationSummary> {
        self.by_pod
            .get(pod_uid)
            .map(|r| r.clone().into_summary(pod_uid))
    }

    fn remove(&mut self, pod_uid: &str) -> Option<ReservationSummary> {
        let reservation = self.by_pod.remove(pod_uid)?;
        for key in reservation.entries.keys() {
            if let EntryKey::Claim(claim) = key
                && self.claims.get(claim).is_some_and(|h| h == pod_uid)
            {
                self.claims.remove(claim);
            }
        }
        Some(reservation.into_summary(pod_uid))
    }

    /// Removes one entry of a pod's reservation, ending the reservation with its last entry.
    fn drop_entry(&mut self, pod_uid: &str, key: &EntryKey) -> Option<u64> {
        let reservation = self.by_pod.get_mut(pod_uid)?;
        let size = reservation.entries.remove(key);
        if reservation.entries.is_empty() {
            self.by_pod.remove(pod_uid);
        }
        size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GI: u64 = 1 << 30;

    fn claim(name: &str, size: u64) -> Entry {
        Entry {
            key: EntryKey::Claim(ClaimKey::new("ns", name)),
            size,
        }
    }

    fn inline(pod: &str, volume: &str, size: u64) -> Entry {
        Entry {
            key: EntryKey::Inline {
                pod_uid: pod.into(),
                volume: volume.into(),
            },
            size,
        }
    }

    /// The node named by one letter: "a" is id 0, "b" id 1, …
    fn n(name: &str) -> NodeId {
        let letter = name.bytes().next().expect("test name");
        NodeId::from_index(usize::from(letter - b'a')).expect("test id")
    }

    fn nodes(names: &[&str]) -> Vec<NodeId> {
        names.iter().map(|name| n(name)).collect()
    }

    /// The book plus a toy index, updated together as the caller must.
    struct World {
        book: ReservationBook,
        allocated: BTreeMap<String, u64>,
    }

    impl World {
        fn new() -> Self {
            World {
                book: ReservationBook::default(),
                allocated: BTreeMap::new(),
            }
        }

        fn select(&mut self, name: &str, node: &str) {
            if let Some((node, size)) = self.book.claim_selected(&ClaimKey::new("ns", name), node) {
                *self.allocated.entry(node).or_default() += size;
            }
        }

        fn bind(&mut self, pod: &str, node: &str) {
            for entry in self.book.pod_bound(pod, Some(n(node))) {
                *self.allocated.entry(node.to_owned()).or_default() += entry.size;
            }
        }

        fn seen(&self, node: &str) -> u64 {
            self.book.reserved_on(n(node), "").0 + self.allocated.get(node).copied().unwrap_or(0)
        }
    }

    #[test]
    fn reserve_table() {
        let t0 = Instant::now();
        let mut book = ReservationBook::default();
        assert!(book.is_empty());

        assert_eq!(
            book.reserve(
                "p1",
                nodes(&["a", "b"]),
                [claim("c1", GI), inline("p1", "v", 2 * GI)],
                t0
            ),
            None
        );
        assert_eq!(book.len(), 1);
        assert_eq!(book.reserved_on(n("a"), ""), (3 * GI, vec![GI, 2 * GI]));
        assert_eq!(book.reserved_on(n("b"), "p2"), (3 * GI, vec![GI, 2 * GI]));
        assert_eq!(book.reserved_on(n("c"), ""), (0, vec![]));
        assert_eq!(
            book.reserved_on(n("a"), "p1"),
            (0, vec![]),
            "own reservation is not seen"
        );
        assert_eq!(book.total_reserved(), 6 * GI);

        // Filtered again: replaced, not added.
        let replaced = book
            .reserve("p1", nodes(&["b"]), [claim("c1", GI)], t0)
            .unwrap_or_else(|| panic!("replaced"));
        let held: Vec<NodeId> = replaced.nodes.iter().collect();
        assert_eq!(held, nodes(&["a", "b"]));
        assert_eq!(replaced.entries.len(), 2);
        assert_eq!(book.reserved_on(n("a"), ""), (0, vec![]));
        assert_eq!(book.reserved_on(n("b"), ""), (GI, vec![GI]));
        assert_eq!(book.total_reserved(), GI);

        // No nodes or no entries: nothing held, the old one is gone.
        assert!(
            book.reserve("p1", nodes(&[]), [claim("c1", GI)], t0)
                .is_some()
        );
        assert!(book.is_empty());
        assert_eq!(book.reserve("p1", nodes(&["a"]), [], t0), None);
        assert!(book.is_empty());
        assert_eq!(
            book.claim_selected(&ClaimKey::new("ns", "c1"), "a"),
            None,
            "claim index cleaned up"
        );

        // Duplicate keys: last size wins.
        book.reserve(
            "p1",
            nodes(&["a"]),
            [claim("c1", GI), claim("c1", 2 * GI)],
            t0,
        );
        assert_eq!(book.reserved_on(n("a"), ""), (2 * GI, vec![2 * GI]));
    }

    #[test]
    fn shared_claim_is_held_once() {
        let t0 = Instant::now();
        let mut book = ReservationBook::default();
        book.reserve(
            "p1",
            nodes(&["a"]),
            [claim("shared", GI), claim("own", GI)],
            t0,
        );
        book.reserve("p2", nodes(&["a"]), [claim("shared", GI)], t0);
        assert_eq!(book.reserved_on(n("a"), ""), (2 * GI, vec![GI, GI]));
        assert_eq!(
            book.get("p1").map(|r| r.entries),
            Some(vec![claim("own", GI)])
        );
        // p1 filtered again takes it back; p2's reservation had only it and ends.
        book.reserve(
            "p1",
            nodes(&["a"]),
            [claim("shared", GI), claim("own", GI)],
            t0,
        );
        assert_eq!(book.get("p2"), None);
        assert_eq!(book.reserved_on(n("a"), ""), (2 * GI, vec![GI, GI]));
        // p2 deleted later must not release p1's hold.
        assert_eq!(book.pod_deleted("p2"), None);
        assert_eq!(
            book.claim_selected(&ClaimKey::new("ns", "shared"), "a"),
            Some(("a".into(), GI))
        );
    }

    #[test]
    fn claim_selected_table() {
        let t0 = Instant::now();
        for (name, ns, claim_name, node, want, left) in [
            (
                "held claim",
                "ns",
                "c1",
                "a",
                Some(("a".to_owned(), GI)),
                2 * GI,
            ),
            (
                "other node still hands over",
                "ns",
                "c1",
                "z",
                Some(("z".to_owned(), GI)),
                2 * GI,
            ),
            ("unknown claim", "ns", "nope", "a", None, 3 * GI),
            ("other namespace", "other", "c1", "a", None, 3 * GI),
            ("inline is not a claim", "ns", "v", "a", None, 3 * GI),
        ] {
            let mut book = ReservationBook::default();
            book.reserve(
                "p1",
                nodes(&["a", "b"]),
                [claim("c1", GI), inline("p1", "v", 2 * GI)],
                t0,
            );
            assert_eq!(
                book.claim_selected(&ClaimKey::new(ns, claim_name), node),
                want,
                "{name}"
            );
            assert_eq!(book.reserved_on(n("a"), "").0, left, "{name}");
            assert_eq!(
                book.claim_selected(&ClaimKey::new(ns, claim_name), node),
                None,
                "{name}: only once"
            );
        }
    }

    #[test]
    fn reservation_ends_with_its_last_entry() {
        let t0 = Instant::now();
        let mut book = ReservationBook::default();
        book.reserve("p1", nodes(&["a"]), [claim("c1", GI), claim("c2", GI)], t0);
        book.claim_selected(&ClaimKey::new("ns", "c1"), "a");
        assert_eq!(book.len(), 1);
        book.claim_selected(&ClaimKey::new("ns", "c2"), "a");
        assert!(book.is_empty());
        assert_eq!(book.total_reserved(), 0);
    }

    #[test]
    fn pod_bound_table() {
        let t0 = Instant::now();
        let mut book = ReservationBook::default();
        book.reserve(
            "p1",
            nodes(&["a", "b"]),
            [claim("c1", GI), inline("p1", "v", 2 * GI)],
            t0,
        );
        assert_eq!(
            book.pod_bound("p1", Some(n("b"))),
            vec![inline("p1", "v", 2 * GI)]
        );
        assert_eq!(
            book.reserved_on(n("a"), ""),
            (0, vec![]),
            "released on nodes not chosen"
        );
        assert_eq!(
            book.reserved_on(n("b"), ""),
            (GI, vec![GI]),
            "claim stays until selected"
        );
        assert_eq!(book.pod_bound("p1", Some(n("b"))), vec![], "idempotent");
        assert_eq!(book.pod_bound("unknown", Some(n("b"))), vec![]);

        book.reserve("p2", nodes(&["a"]), [inline("p2", "v", GI)], t0);
        assert_eq!(book.pod_bound("p2", Some(n("a"))).len(), 1);
        assert_eq!(book.get("p2"), None, "only inline entries: ends");

        // Bound to a node the reservation was not on: the claims follow the pod.
        book.reserve("p3", nodes(&["a"]), [claim("c3", GI)], t0);
        book.pod_bound("p3", Some(n("z")));
        assert_eq!(book.reserved_on(n("z"), ""), (GI, vec![GI]));
        assert_eq!(book.reserved_on(n("a"), ""), (0, vec![]));

        // Bound to a node the caller cannot identify: the claim is held nowhere, yet still
        // hands over once selected.
        book.reserve("p4", nodes(&["a"]), [claim("c4", GI)], t0);
        assert_eq!(book.pod_bound("p4", None), vec![]);
        assert_eq!(book.reserved_on(n("a"), ""), (0, vec![]));
        assert_eq!(book.total_reserved(), 2 * GI, "p1's claim on b, p3's on z");
        assert_eq!(
            book.claim_selected(&ClaimKey::new("ns", "c4"), "y"),
            Some(("y".to_owned(), GI))
        );
        assert_eq!(book.get("p4"), None);
    }

    #[test]
    fn pod_deleted_table() {
        let t0 = Instant::now();
        let mut book = ReservationBook::default();
        book.reserve("p1", nodes(&["a"]), [claim("c1", GI)], t0);
        let gone = book.pod_deleted("p1").unwrap_or_else(|| panic!("had one"));
        assert_eq!(
            (gone.pod_uid.as_str(), gone.entries.len(), gone.created),
            ("p1", 1, t0)
        );
        assert!(book.is_empty());
        assert_eq!(book.pod_deleted("p1"), None);
        assert_eq!(book.claim_selected(&ClaimKey::new("ns", "c1"), "a"), None);
    }

    #[test]
    fn expire_table() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(600);
        let mut book = ReservationBook::new(ttl);
        book.reserve("old", nodes(&["a"]), [claim("c1", GI)], t0);
        book.reserve(
            "new",
            nodes(&["a"]),
            [claim("c2", GI)],
            t0 + Duration::from_secs(60),
        );
        assert_eq!(book.expire(t0 + ttl - Duration::from_secs(1)), vec![]);
        let expired = book.expire(t0 + ttl);
        assert_eq!(
            expired
                .iter()
                .map(|s| s.pod_uid.as_str())
                .collect::<Vec<_>>(),
            ["old"]
        );
        assert_eq!(
            book.claim_selected(&ClaimKey::new("ns", "c1"), "a"),
            None,
            "claim index cleaned up"
        );
        // Re-filtering restarts the clock.
        book.reserve("new", nodes(&["a"]), [claim("c2", GI)], t0 + ttl);
        assert_eq!(book.expire(t0 + ttl + Duration::from_secs(61)), vec![]);
        assert_eq!(book.expire(t0 + 2 * ttl).len(), 1);
        assert!(book.is_empty());

        let mut forever = ReservationBook::new(Duration::MAX);
        forever.reserve("p", nodes(&["a"]), [claim("c", GI)], t0);
        assert_eq!(forever.expire(t0 + Duration::from_secs(1 << 40)), vec![]);
    }

    #[test]
    fn totals_saturate() {
        let t0 = Instant::now();
        let mut book = ReservationBook::default();
        book.reserve(
            "p1",
            nodes(&["a", "b"]),
            [claim("c1", u64::MAX), claim("c2", u64::MAX)],
            t0,
        );
        book.reserve("p2", nodes(&["a"]), [claim("c3", 1)], t0);
        assert_eq!(book.reserved_on(n("a"), "").0, u64::MAX);
        assert_eq!(book.total_reserved(), u64::MAX);
    }

    #[test]
    fn hand_over_never_double_counts_or_drops() {
        let t0 = Instant::now();
        let mut world = World::new();
        world.book.reserve(
            "p1",
            nodes(&["a", "b"]),
            [
                claim("c1", GI),
                claim("c2", 2 * GI),
                inline("p1", "v", 4 * GI),
            ],
            t0,
        );
        assert_eq!((world.seen("a"), world.seen("b")), (7 * GI, 7 * GI));

        world.select("c1", "a");
        assert_eq!(
            world.seen("a"),
            7 * GI,
            "c1 moved from reserved to allocated on a"
        );
        assert_eq!(world.seen("b"), 6 * GI, "b no longer holds c1");

        world.bind("p1", "a");
        assert_eq!(world.seen("a"), 7 * GI, "inline moved to allocated on a");
        assert_eq!(world.seen("b"), 0, "b released");

        world.select("c2", "a");
        assert_eq!(world.seen("a"), 7 * GI);
        assert!(world.book.is_empty());

        // A selection seen twice (a resync) must not count twice.
        world.select("c2", "a");
        assert_eq!(world.seen("a"), 7 * GI);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Select(usize, usize),
        Bind(usize, usize),
    }

    proptest! {
        /// Whatever order selections and bindings arrive in, each volume is counted exactly once
        /// on the node it lands on.
        #[test]
        fn hand_over_invariant(ops in prop::collection::vec(
            prop_oneof![
                (0..3usize, 0..2usize).prop_map(|(c, n)| Op::Select(c, n)),
                (0..2usize, 0..2usize).prop_map(|(p, n)| Op::Bind(p, n)),
            ],
            0..12,
        )) {
            let t0 = Instant::now();
            let node_names = ["a", "b"];
            let mut world = World::new();
            // p0: c0, c1, inline; p1: c2, inline.
            world.book.reserve("p0", nodes(&node_names), [claim("c0", 1), claim("c1", 2), inline("p0", "v", 4)], t0);
            world.book.reserve("p1", nodes(&node_names), [claim("c2", 8), inline("p1", "v", 16)], t0);
            // Where each volume ended up (None: still only reserved).
            let mut landed: BTreeMap<&str, &str> = BTreeMap::new();
            let mut bound: BTreeMap<usize, &str> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Select(c, n) => {
                        let name = ["c0", "c1", "c2"][c];
                        landed.entry(name).or_insert(node_names[n]);
                        world.select(name, node_names[n]);
                    }
                    Op::Bind(p, n) => {
                        // A pod binds once; the scheduler never rebinds.
                        let node = *bound.entry(p).or_insert(node_names[n]);
                        landed.entry(["i0", "i1"][p]).or_insert(node);
                        world.bind(["p0", "p1"][p], node);
                    }
                }
            }
            let size = |v: &str| match v { "c0" => 1, "c1" => 2, "i0" => 4, "c2" => 8, _ => 16 };
            let owner = |v: &str| if ["c0", "c1", "i0"].contains(&v) { 0 } else { 1 };
            for node in node_names {
                let allocated: u64 = landed.iter().filter(|(_, n)| **n == node).map(|(v, _)| size(v)).sum();
                prop_assert_eq!(world.allocated.get(node).copied().unwrap_or(0), allocated);
                // Still reserved here: volumes not landed whose pod is unbound or bound here.
                let reserved: u64 = ["c0", "c1", "i0", "c2", "i1"]
                    .iter()
                    .filter(|v| !landed.contains_key(*v))
                    .filter(|v| bound.get(&owner(v)).is_none_or(|b| *b == node))
                    .map(|v| size(v))
                    .sum();
                prop_assert_eq!(world.book.reserved_on(n(node), "").0, reserved);
            }
        }
    }
}
