//! The kube-scheduler extender wire protocol (`k8s.io/kube-scheduler/extender/v1`).
//!
//! The Go types carry no json tags, so kube-scheduler writes the Go field names (`Pod`,
//! `NodeNames`, …) and decodes answers case-insensitively. Other senders (tests, older tools,
//! hand-written requests) use the lower-case spellings. So every field accepts both spellings on
//! input and is written with the Go field name on output.
//!
//! Decoding is strict where it protects the handler and lenient where Go is lenient:
//! - unknown fields are ignored, like Go's decoder;
//! - `null` for a list or map is the same as absent, like a Go nil slice or map;
//! - bodies and nested protocol objects must be JSON objects (serde would otherwise accept the
//!   array form of a struct, which Go rejects);
//! - a field given under both spellings is rejected as a duplicate (Go would keep the last; no real
//!   sender does this);
//! - an empty candidate list is valid and answered with an empty list: kube-scheduler only calls
//!   with candidates, and an error would turn a harmless corner into a failed scheduling cycle;
//! - when both `NodeNames` and `Nodes` are present, `NodeNames` wins (the shipped configuration is
//!   `nodeCacheCapable: true`), and the answer uses `NodeNames`;
//! - the pod must have `metadata.uid` (reservations are keyed by it) and `metadata.name` (logs and
//!   events name it); every candidate node must have a non-empty name (results are keyed by it).

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use k8s_openapi::List;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

/// Why an extender request body was rejected; the message names the offending field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExtenderApiError {
    /// The body has no JSON value at all.
    #[error("request body is empty")]
    Empty,
    /// The body is a JSON value other than an object.
    #[error("{what} must be a JSON object")]
    NotObject {
        /// The protocol type that was expected.
        what: &'static str,
    },
    /// The body ends in the middle of a JSON value.
    #[error("{what} is truncated: {message}")]
    Truncated {
        /// The protocol type that was expected.
        what: &'static str,
        /// serde_json's description, with line and column.
        message: String,
    },
    /// The body is not JSON (includes nesting deeper than the decoder's recursion limit).
    #[error("{what} is not valid JSON: {message}")]
    Syntax {
        /// The protocol type that was expected.
        what: &'static str,
        /// serde_json's description, with line and column.
        message: String,
    },
    /// The body is JSON but a field has the wrong type or an out-of-range value.
    #[error("{what} does not match the extender protocol: {message}")]
    Data {
        /// The protocol type that was expected.
        what: &'static str,
        /// serde_json's description, with line and column.
        message: String,
    },
    /// `Pod` is absent or `null`.
    #[error("Pod is required")]
    PodMissing,
    /// The pod has no `metadata.uid`.
    #[error("Pod.metadata.uid is required")]
    PodUidMissing,
    /// The pod has no `metadata.name`.
    #[error("Pod.metadata.name is required")]
    PodNameMissing,
    /// Neither `NodeNames` nor `Nodes` is present.
    #[error("NodeNames or Nodes is required")]
    CandidatesMissing,
    /// An entry of `NodeNames` is the empty string.
    #[error("NodeNames[{index}] is empty")]
    EmptyNodeName {
        /// Position in `NodeNames`.
        index: usize,
    },
    /// A node of `Nodes.items` has no `metadata.name`.
    #[error("Nodes.items[{index}].metadata.name is required")]
    NodeNameMissing {
        /// Position in `Nodes.items`.
        index: usize,
    },
    /// Neither victims map of a preemption request is present.
    #[error("NodeNameToVictims or NodeNameToMetaVictims is required")]
    VictimsMissing,
    /// A victims map has an empty node name as key.
    #[error("{field} has an empty node name")]
    VictimsEmptyNode {
        /// `NodeNameToVictims` or `NodeNameToMetaVictims`.
        field: &'static str,
    },
    /// A victim pod has no uid, so it cannot be named in the answer.
    #[error("{field}[{node:?}].Pods[{index}] has no uid")]
    VictimUidMissing {
        /// `NodeNameToVictims` or `NodeNameToMetaVictims`.
        field: &'static str,
        /// The candidate node.
        node: String,
        /// Position in the node's `Pods`.
        index: usize,
    },
}

/// The body of `/filter` and `/prioritize` (Go `ExtenderArgs`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExtenderArgs {
    /// The pod being scheduled.
    #[serde(rename = "Pod", alias = "pod", default)]
    pub pod: Option<Pod>,
    /// Candidate nodes in full; only sent when `nodeCacheCapable` is false (legacy form).
    #[serde(
        rename = "Nodes",
        alias = "nodes",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub nodes: Option<List<Node>>,
    /// Candidate node names; sent when `nodeCacheCapable` is true (the form we ship).
    #[serde(
        rename = "NodeNames",
        alias = "nodenames",
        alias = "nodeNames",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub node_names: Option<NodeNames>,
}

impl From<crate::plain_args::PlainArgs> for ExtenderArgs {
    fn from(args: crate::plain_args::PlainArgs) -> Self {
        ExtenderArgs {
            pod: args.pod,
            nodes: args.nodes,
            node_names: args
                .node_names
                .map(|names| NodeNames::from_parts(names.text, names.ends)),
        }
    }
}

/// The answer of `/filter` (Go `ExtenderFilterResult`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExtenderFilterResult {
    /// Nodes that passed, when the request carried full `Nodes`.
    #[serde(
        rename = "Nodes",
        alias = "nodes",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub nodes: Option<List<Node>>,
    /// Names of nodes that passed, when the request carried `NodeNames`.
    #[serde(
        rename = "NodeNames",
        alias = "nodenames",
        alias = "nodeNames",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub node_names: Option<NodeNames>,
    /// Failed nodes that preemption might make fit: node → reason.
    #[serde(
        rename = "FailedNodes",
        alias = "failedNodes",
        alias = "failednodes",
        default,
        deserialize_with = "null_as_default"
    )]
    pub failed_nodes: BTreeMap<String, String>,
    /// Failed nodes that preemption cannot help: node → reason.
    #[serde(
        rename = "FailedAndUnresolvableNodes",
        alias = "failedAndUnresolvableNodes",
        alias = "failedandunresolvablenodes",
        default,
        deserialize_with = "null_as_default"
    )]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    /// A whole-call failure; kube-scheduler then fails the pod's scheduling attempt.
    #[serde(
        rename = "Error",
        alias = "error",
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "String::is_empty"
    )]
    pub error: String,
}

/// One node's score in the answer of `/prioritize` (Go `HostPriority`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPriority {
    /// The node name.
    #[serde(rename = "Host", alias = "host")]
    pub host: String,
    /// 0 (worst) to 10 (best); kube-scheduler scales it by the extender's weight.
    #[serde(rename = "Score", alias = "score")]
    pub score: i64,
}

/// The answer of `/prioritize` (Go `HostPriorityList`).
pub type HostPriorityList = Vec<HostPriority>;

/// The pods that would be evicted from one node, in full (Go `Victims`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Victims {
    /// The victim pods.
    #[serde(
        rename = "Pods",
        alias = "pods",
        default,
        deserialize_with = "objects_or_null"
    )]
    pub pods: Vec<Pod>,
    /// How many PodDisruptionBudgets the eviction would violate.
    #[serde(
        rename = "NumPDBViolations",
        alias = "numPDBViolations",
        alias = "numpdbviolations",
        default
    )]
    pub num_pdb_violations: i64,
}

/// A victim pod named only by uid (Go `MetaPod`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaPod {
    /// The pod's `metadata.uid`.
    #[serde(rename = "UID", alias = "uid", alias = "Uid", default)]
    pub uid: String,
}

/// The pods that would be evicted from one node, by uid (Go `MetaVictims`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaVictims {
    /// The victim pods.
    #[serde(
        rename = "Pods",
        alias = "pods",
        default,
        deserialize_with = "objects_or_null"
    )]
    pub pods: Vec<MetaPod>,
    /// How many PodDisruptionBudgets the eviction would violate.
    #[serde(
        rename = "NumPDBViolations",
        alias = "numPDBViolations",
        alias = "numpdbviolations",
        default
    )]
    pub num_pdb_violations: i64,
}

/// The body of `/preempt` (Go `ExtenderPreemptionArgs`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExtenderPreemptionArgs {
    /// The pod that would preempt.
    #[serde(rename = "Pod", alias = "pod", default)]
    pub pod: Option<Pod>,
    /// Candidate nodes → victims in full; sent when `nodeCacheCapable` is false.
    #[serde(
        rename = "NodeNameToVictims",
        alias = "nodeNameToVictims",
        alias = "nodenametovictims",
        default,
        deserialize_with = "opt_object_map",
        skip_serializing_if = "Option::is_none"
    )]
    pub node_name_to_victims: Option<BTreeMap<String, Victims>>,
    /// Candidate nodes → victims by uid; sent when `nodeCacheCapable` is true.
    #[serde(
        rename = "NodeNameToMetaVictims",
        alias = "nodeNameToMetaVictims",
        alias = "nodenametometavictims",
        default,
        deserialize_with = "opt_object_map",
        skip_serializing_if = "Option::is_none"
    )]
    pub node_name_to_meta_victims: Option<BTreeMap<String, MetaVictims>>,
}

/// The answer of `/preempt` (Go `ExtenderPreemptionResult`); always by uid, whatever the request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtenderPreemptionResult {
    /// Candidate nodes that stay → their victims, unchanged from the request.
    #[serde(
        rename = "NodeNameToMetaVictims",
        alias = "nodeNameToMetaVictims",
        alias = "nodenametometavictims",
        default,
        deserialize_with = "null_as_default"
    )]
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}

/// A list of node names (`NodeNames` of requests and answers), stored back to back in one
/// buffer: a /filter names thousands, and the fit reads them right after decoding, often on
/// another core, where thousands of separate small allocations each cost a cache miss.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct NodeNames {
    text: String,
    /// End of each name in `text`.
    ends: Vec<usize>,
}

impl NodeNames {
    /// The names, in order.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        let mut start = 0;
        self.ends.iter().map(move |end| {
            let name = self.text.get(start..*end).unwrap_or_default();
            start = *end;
            name
        })
    }

    /// How many names.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The list of the names in `text` ending at `ends` (non-decreasing, within `text`, on
    /// character boundaries: names are `text[previous end..end]`).
    pub(crate) fn from_parts(text: String, ends: Vec<usize>) -> NodeNames {
        NodeNames { text, ends }
    }

    /// Appends a name.
    pub fn push(&mut self, name: &str) {
        self.text.push_str(name);
        self.ends.push(self.text.len());
    }

    /// The names for which `keep` is true, in order; `keep` is asked once per name, in order.
    /// When it keeps every name, the list itself is returned, not a copy (a /filter where the
    /// pod fits everywhere answers thousands of names).
    pub fn retain(self, mut keep: impl FnMut(&str) -> bool) -> NodeNames {
        let kept: Vec<bool> = self.iter().map(&mut keep).collect();
        if kept.iter().all(|k| *k) {
            return self;
        }
        let mut list = NodeNames {
            text: String::with_capacity(self.text.len()),
            ends: Vec::with_capacity(kept.iter().filter(|k| **k).count()),
        };
        for (name, _) in self.iter().zip(&kept).filter(|(_, k)| **k) {
            list.push(name);
        }
        list
    }

    /// Appends the names as a JSON array to `out`, as `serde_json` would write them.
    pub fn write_json(&self, out: &mut Vec<u8>) {
        out.reserve(self.text.len() + 3 * self.len() + 2);
        out.push(b'[');
        // Node names are DNS subdomains in practice: one pass over all of them proves that none
        // needs escaping, and then each is copied as is; serde_json's per-byte escape lookup
        // was a tenth of a 5,000-name /filter.
        let plain = self.text.bytes().fold(true, |plain, b| {
            plain & (b >= 0x20 && b != b'"' && b != b'\\')
        });
        for (i, name) in self.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            if plain {
                out.push(b'"');
                out.extend_from_slice(name.as_bytes());
                out.push(b'"');
            } else {
                // Writing a str into a Vec cannot fail.
                let _ = serde_json::to_writer(&mut *out, name);
            }
        }
        out.push(b']');
    }
}

impl<S: AsRef<str>> FromIterator<S> for NodeNames {
    fn from_iter<I: IntoIterator<Item = S>>(names: I) -> Self {
        let mut list = NodeNames::default();
        for name in names {
            list.push(name.as_ref());
        }
        list
    }
}

impl fmt::Debug for NodeNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Serialize for NodeNames {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for NodeNames {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ListVisitor;
        impl<'de> Visitor<'de> for ListVisitor {
            type Value = NodeNames;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a list of node names")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<NodeNames, A::Error> {
                let mut list = NodeNames::default();
                // The hint comes from the sender: bounded, so a lying one cannot make us
                // reserve more than the body could hold anyway.
                list.ends.reserve(seq.size_hint().unwrap_or(0).min(1 << 16));
                while seq.next_element_seed(AppendName(&mut list.text))?.is_some() {
                    list.ends.push(list.text.len());
                }
                Ok(list)
            }
        }
        deserializer.deserialize_seq(ListVisitor)
    }
}

/// Decodes one JSON string straight into the end of a [`NodeNames`] buffer.
struct AppendName<'a>(&'a mut String);

impl<'de> DeserializeSeed<'de> for AppendName<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for AppendName<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a node name")
    }
    fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<(), E> {
        self.0.push_str(name);
        Ok(())
    }
}

/// The candidate nodes of a request, in the form the answer must use.
#[derive(Clone, Debug, PartialEq)]
pub enum Candidates {
    /// `NodeNames` (`nodeCacheCapable: true`).
    Names(NodeNames),
    /// Full `Nodes` (legacy); the answer returns the passing node objects.
    Nodes(Vec<Node>),
}

/// Why a candidate node fails the filter; the variant picks the answer's map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// Goes to `FailedNodes`: preemption may help.
    Resolvable(String),
    /// Goes to `FailedAndUnresolvableNodes`: kube-scheduler skips the node when preempting.
    Unresolvable(String),
}

/// A validated `/filter` or `/prioritize` request.
#[derive(Clone, Debug, PartialEq)]
pub struct ExtenderRequest {
    /// The pod being scheduled; `metadata.uid` and `metadata.name` are present.
    pub pod: Pod,
    /// The pod's uid (copied out of `pod` for convenience).
    pub pod_uid: String,
    /// The candidate nodes.
    pub candidates: Candidates,
}

/// A validated `/preempt` request.
#[derive(Clone, Debug, PartialEq)]
pub struct PreemptionRequest {
    /// The preempting pod; `metadata.uid` and `metadata.name` are present.
    pub pod: Pod,
    /// The pod's uid (copied out of `pod` for convenience).
    pub pod_uid: String,
    /// Candidate node → victims by uid (full victims are reduced to their uids, which is all the
    /// answer may carry).
    pub victims: BTreeMap<String, MetaVictims>,
}

/// Decodes and validates a `/filter` or `/prioritize` body.
pub fn decode_args(body: &[u8]) -> Result<ExtenderArgs, ExtenderApiError> {
    let args = decode_args_general(body)?;
    args.validate()?;
    Ok(args)
}

/// Decodes and validates a `/filter` or `/prioritize` body into its checked form.
pub fn decode_request(body: &[u8]) -> Result<ExtenderRequest, ExtenderApiError> {
    match crate::plain_args::decode_plain(body) {
        Some(args) => ExtenderArgs::from(args).into_request(),
        None => decode_args_general(body)?.into_request(),
    }
}

/// Decodes a `/filter` or `/prioritize` body through serde, without validating it: every shape
/// and every error's wording ([`crate::plain_args`] takes the common shape faster).
pub(crate) fn decode_args_general(body: &[u8]) -> Result<ExtenderArgs, ExtenderApiError> {
    decode_object(body, "ExtenderArgs")
}

/// Decodes and validates a `/preempt` body.
pub fn decode_preemption_args(body: &[u8]) -> Result<ExtenderPreemptionArgs, ExtenderApiError> {
    let args: ExtenderPreemptionArgs = decode_object(body, "ExtenderPreemptionArgs")?;
    args.validate()?;
    Ok(args)
}

/// Decodes and validates a `/preempt` body into its checked form.
pub fn decode_preemption_request(body: &[u8]) -> Result<PreemptionRequest, ExtenderApiError> {
    decode_object::<ExtenderPreemptionArgs>(body, "ExtenderPreemptionArgs")?.into_request()
}

impl ExtenderArgs {
    /// Checks the rules of the module documentation without consuming the request.
    pub fn validate(&self) -> Result<(), ExtenderApiError> {
        pod_uid(self.pod.as_ref())?;
        match (&self.node_names, &self.nodes) {
            (Some(names), _) => check_names(names),
            (None, Some(nodes)) => check_nodes(&nodes.items),
            (None, None) => Err(ExtenderApiError::CandidatesMissing),
        }
    }

    /// Validates and splits the request into the pod and its candidates.
    pub fn into_request(self) -> Result<ExtenderRequest, ExtenderApiError> {
        let pod_uid = pod_uid(self.pod.as_ref())?;
        let candidates = match (self.node_names, self.nodes) {
            (Some(names), _) => {
                check_names(&names)?;
                Candidates::Names(names)
            }
            (None, Some(nodes)) => {
                check_nodes(&nodes.items)?;
                Candidates::Nodes(nodes.items)
            }
            (None, None) => return Err(ExtenderApiError::CandidatesMissing),
        };
        let pod = self.pod.ok_or(ExtenderApiError::PodMissing)?;
        Ok(ExtenderRequest {
            pod,
            pod_uid,
            candidates,
        })
    }
}

impl ExtenderPreemptionArgs {
    /// Checks the rules of the module documentation without consuming the request.
    pub fn validate(&self) -> Result<(), ExtenderApiError> {
        pod_uid(self.pod.as_ref())?;
        match (&self.node_name_to_meta_victims, &self.node_name_to_victims) {
            (Some(meta), _) => check_meta_victims(meta),
            (None, Some(full)) => full_to_meta(full).map(drop),
            (None, None) => Err(ExtenderApiError::VictimsMissing),
        }
    }

    /// Validates the request and reduces its victims to uids.
    pub fn into_request(self) -> Result<PreemptionRequest, ExtenderApiError> {
        let pod_uid = pod_uid(self.pod.as_ref())?;
        let victims = match (self.node_name_to_meta_victims, self.node_name_to_victims) {
            (Some(meta), _) => {
                check_meta_victims(&meta)?;
                meta
            }
            (None, Some(full)) => full_to_meta(&full)?,
            (None, None) => return Err(ExtenderApiError::VictimsMissing),
        };
        let pod = self.pod.ok_or(ExtenderApiError::PodMissing)?;
        Ok(PreemptionRequest {
            pod,
            pod_uid,
            victims,
        })
    }
}

impl Candidates {
    /// The candidate node names, in request order.
    pub fn names(&self) -> Vec<&str> {
        match self {
            Candidates::Names(names) => names.iter().collect(),
            Candidates::Nodes(nodes) => nodes.iter().map(node_name).collect(),
        }
    }

    /// How many candidates the request carried.
    pub fn len(&self) -> usize {
        match self {
            Candidates::Names(names) => names.len(),
            Candidates::Nodes(nodes) => nodes.len(),
        }
    }

    /// Whether the request carried no candidates (valid; the answer is an empty list).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Builds the `/filter` answer in the request's form: `judge` is asked once per candidate,
    /// in the request's order (callers rely on it to line decisions up by position), `None`
    /// keeps the node.
    pub fn into_filter_result(
        self,
        mut judge: impl FnMut(&str) -> Option<Rejection>,
    ) -> ExtenderFilterResult {
        let mut result = ExtenderFilterResult::default();
        let mut verdict = |name: &str| match judge(name) {
            None => true,
            Some(Rejection::Resolvable(reason)) => {
                result.failed_nodes.insert(name.to_owned(), reason);
                false
            }
            Some(Rejection::Unresolvable(reason)) => {
                result
                    .failed_and_unresolvable_nodes
                    .insert(name.to_owned(), reason);
                false
            }
        };
        match self {
            Candidates::Names(names) => {
                result.node_names = Some(names.retain(verdict));
            }
            Candidates::Nodes(nodes) => {
                let items = nodes
                    .into_iter()
                    .filter(|n| verdict(node_name(n)))
                    .collect();
                result.nodes = Some(List {
                    items,
                    ..List::default()
                });
            }
        }
        result
    }
}

impl ExtenderFilterResult {
    /// A whole-call failure: kube-scheduler fails this scheduling attempt of the pod.
    pub fn from_error(message: impl Into<String>) -> Self {
        ExtenderFilterResult {
            error: message.into(),
            ..ExtenderFilterResult::default()
        }
    }

    /// The answer as JSON, byte for byte what `serde_json::to_vec` writes, with the names of
    /// `NodeNames` written by [`NodeNames::write_json`].
    pub fn to_json(&self) -> Result<Vec<u8>, serde_json::Error> {
        let Some(names) = self.node_names.as_ref().filter(|_| self.nodes.is_none()) else {
            return serde_json::to_vec(self);
        };
        let mut out = Vec::new();
        out.extend_from_slice(b"{\"NodeNames\":");
        names.write_json(&mut out);
        out.extend_from_slice(b",\"FailedNodes\":");
        serde_json::to_writer(&mut out, &self.failed_nodes)?;
        out.extend_from_slice(b",\"FailedAndUnresolvableNodes\":");
        serde_json::to_writer(&mut out, &self.failed_and_unresolvable_nodes)?;
        if !self.error.is_empty() {
            out.extend_from_slice(b",\"Error\":");
            serde_json::to_writer(&mut out, &self.error)?;
        }
        out.push(b'}');
        Ok(out)
    }
}

impl PreemptionRequest {
    /// The `/preempt` answer keeping the candidates for which `keep` is true, victims unchanged
    /// (kube-scheduler maps them back to its own pods and fails on any it did not send).
    pub fn into_result(
        self,
        mut keep: impl FnMut(&str, &MetaVictims) -> bool,
    ) -> ExtenderPreemptionResult {
        ExtenderPreemptionResult {
            node_name_to_meta_victims: self
                .victims
                .into_iter()
                .filter(|(node, victims)| keep(node, victims))
                .collect(),
        }
    }
}

fn node_name(node: &Node) -> &str {
    node.metadata.name.as_deref().unwrap_or_default()
}

fn pod_uid(pod: Option<&Pod>) -> Result<String, ExtenderApiError> {
    let pod = pod.ok_or(ExtenderApiError::PodMissing)?;
    let uid = pod
        .metadata
        .uid
        .as_deref()
        .filter(|u| !u.is_empty())
        .ok_or(ExtenderApiError::PodUidMissing)?;
    if pod.metadata.name.as_deref().is_none_or(str::is_empty) {
        return Err(ExtenderApiError::PodNameMissing);
    }
    Ok(uid.to_owned())
}

fn check_names(names: &NodeNames) -> Result<(), ExtenderApiError> {
    match names.iter().position(str::is_empty) {
        Some(index) => Err(ExtenderApiError::EmptyNodeName { index }),
        None => Ok(()),
    }
}

fn check_nodes(nodes: &[Node]) -> Result<(), ExtenderApiError> {
    match nodes.iter().position(|n| node_name(n).is_empty()) {
        Some(index) => Err(ExtenderApiError::NodeNameMissing { index }),
        None => Ok(()),
    }
}

const META_FIELD: &str = "NodeNameToMetaVictims";
const FULL_FIELD: &str = "NodeNameToVictims";

fn check_meta_victims(map: &BTreeMap<String, MetaVictims>) -> Result<(), ExtenderApiError> {
    for (node, victims) in map {
        if node.is_empty() {
            return Err(ExtenderApiError::VictimsEmptyNode { field: META_FIELD });
        }
        if let Some(index) = victims.pods.iter().position(|p| p.uid.is_empty()) {
            return Err(ExtenderApiError::VictimUidMissing {
                field: META_FIELD,
                node: node.clone(),
                index,
            });
        }
    }
    Ok(())
}

fn full_to_meta(
    map: &BTreeMap<String, Victims>,
) -> Result<BTreeMap<String, MetaVictims>, ExtenderApiError> {
    let mut out = BTreeMap::new();
    for (node, victims) in map {
        if node.is_empty() {
            return Err(ExtenderApiError::VictimsEmptyNode { field: FULL_FIELD });
        }
        let mut pods = Vec::with_capacity(victims.pods.len());
        for (index, pod) in victims.pods.iter().enumerate() {
            match pod.metadata.uid.as_deref().filter(|u| !u.is_empty()) {
                Some(uid) => pods.push(MetaPod {
                    uid: uid.to_owned(),
                }),
                None => {
                    return Err(ExtenderApiError::VictimUidMissing {
                        field: FULL_FIELD,
                        node: node.clone(),
                        index,
                    });
                }
            }
        }
        out.insert(
            node.clone(),
            MetaVictims {
                pods,
                num_pdb_violations: victims.num_pdb_violations,
            },
        );
    }
    Ok(out)
}

/// Decodes a body that must be one JSON object of type `T`, mapping serde's errors once.
fn decode_object<T: for<'de> Deserialize<'de>>(
    body: &[u8],
    what: &'static str,
) -> Result<T, ExtenderApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ExtenderApiError::Empty);
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    // A body that does not start with an object fails on its first token; saying so plainly beats
    // serde's "invalid type: sequence, expected a JSON object at line 1 column 1".
    let object = body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    MapOnly::<T>::deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v.0))
        .map_err(|e| json_error(what, object, &e))
}

fn json_error(what: &'static str, object: bool, e: &serde_json::Error) -> ExtenderApiError {
    use serde_json::error::Category;
    let message = e.to_string();
    match e.classify() {
        Category::Eof => ExtenderApiError::Truncated { what, message },
        Category::Syntax | Category::Io => ExtenderApiError::Syntax { what, message },
        Category::Data if !object => ExtenderApiError::NotObject { what },
        Category::Data => ExtenderApiError::Data { what, message },
    }
}

/// Deserializes `T` only from a JSON object. Derived struct impls also accept the array form
/// (`[pod, nodes, names]`), which Go rejects and which would let positional garbage through.
struct MapOnly<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for MapOnly<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(PhantomData<T>);

        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
            type Value = T;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }

        deserializer
            .deserialize_map(ObjectVisitor(PhantomData))
            .map(MapOnly)
    }
}

/// `null` means the same as an absent field, like a nil map, slice or string in Go.
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// A list of protocol objects, `null` meaning empty; each element must be a JSON object.
fn objects_or_null<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    let items: Option<Vec<MapOnly<T>>> = Option::deserialize(deserializer)?;
    Ok(items.unwrap_or_default().into_iter().map(|i| i.0).collect())
}

/// A map of node name → protocol object; each value must be a JSON object (a `null` value would
/// be a nil pointer that kube-scheduler itself could not handle).
fn opt_object_map<'de, D, T>(deserializer: D) -> Result<Option<BTreeMap<String, T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    let map: Option<BTreeMap<String, MapOnly<T>>> = Option::deserialize(deserializer)?;
    Ok(map.map(|m| m.into_iter().map(|(k, v)| (k, v.0)).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::Path;

    const BAD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/extender/bad");
    const GOOD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/extender/good");

    fn pod() -> serde_json::Value {
        json!({"metadata": {"name": "p", "namespace": "ns", "uid": "u1"}})
    }

    fn body(v: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&v).expect("test value")
    }

    fn rejects_all_in(dir: &str, decode: fn(&[u8]) -> Result<(), ExtenderApiError>) {
        let dir = Path::new(BAD).join(dir);
        let mut count = 0;
        let mut accepted = Vec::new();
        for entry in std::fs::read_dir(&dir).expect("test value") {
            let path = entry.expect("test value").path();
            let bytes = std::fs::read(&path).expect("test value");
            match decode(&bytes) {
                Ok(()) => accepted.push(path.display().to_string()),
                Err(e) => assert!(!e.to_string().is_empty(), "{}", path.display()),
            }
            count += 1;
        }
        assert_eq!(accepted, Vec::<String>::new(), "accepted");
        assert!(count >= 50, "{}: only {count} files", dir.display());
    }

    #[test]
    fn bad_filter_bodies_are_rejected() {
        rejects_all_in("filter", |b| decode_request(b).map(drop));
    }

    #[test]
    fn bad_prioritize_bodies_are_rejected() {
        rejects_all_in("prioritize", |b| decode_args(b).map(drop));
    }

    #[test]
    fn bad_preempt_bodies_are_rejected() {
        rejects_all_in("preempt", |b| decode_preemption_request(b).map(drop));
    }

    #[test]
    fn good_bodies_decode() {
        let read = |name: &str| std::fs::read(Path::new(GOOD).join(name)).expect("test value");

        let names = decode_request(&read("filter-nodenames.json")).expect("test value");
        assert_eq!(names.pod_uid, "6b1c0bd4-7f1e-4c52-9d8a-0c5e3f0a1b01");
        assert_eq!(
            names.candidates.names(),
            ["worker-1", "worker-2", "worker-3"]
        );
        assert!(matches!(names.candidates, Candidates::Names(_)));

        let nodes = decode_request(&read("filter-nodes.json")).expect("test value");
        assert_eq!(nodes.candidates.names(), ["worker-1", "worker-2"]);
        assert!(matches!(nodes.candidates, Candidates::Nodes(_)));

        let prio = decode_request(&read("prioritize.json")).expect("test value");
        assert_eq!(prio.candidates.len(), 2);

        let preempt = decode_preemption_request(&read("preempt.json")).expect("test value");
        assert_eq!(preempt.victims.len(), 2);
        assert_eq!(preempt.victims["worker-1"].pods[0].uid, "victim-1");

        let preempt_full =
            decode_preemption_request(&read("preempt-full-victims.json")).expect("test value");
        assert_eq!(preempt_full.victims["worker-2"].pods[0].uid, "victim-2");
        assert_eq!(preempt_full.victims["worker-2"].num_pdb_violations, 1);
    }

    #[test]
    fn validation_table() {
        use ExtenderApiError as E;
        let no_uid = json!({"metadata": {"name": "p"}});
        let no_name = json!({"metadata": {"uid": "u"}});
        for (name, input, want) in [
            ("names", json!({"Pod": pod(), "NodeNames": ["a"]}), Ok(())),
            (
                "lower case",
                json!({"pod": pod(), "nodenames": ["a"]}),
                Ok(()),
            ),
            (
                "camel case",
                json!({"pod": pod(), "nodeNames": ["a"]}),
                Ok(()),
            ),
            (
                "full nodes",
                json!({"Pod": pod(), "Nodes": {"items": [{"metadata": {"name": "a"}}]}}),
                Ok(()),
            ),
            (
                "empty names valid",
                json!({"Pod": pod(), "NodeNames": []}),
                Ok(()),
            ),
            (
                "empty nodes valid",
                json!({"Pod": pod(), "Nodes": {}}),
                Ok(()),
            ),
            (
                "nodes items null",
                json!({"Pod": pod(), "Nodes": {"items": null}}),
                Ok(()),
            ),
            (
                "go nulls",
                json!({"Pod": pod(), "Nodes": null, "NodeNames": ["a"]}),
                Ok(()),
            ),
            (
                "unknown fields ignored",
                json!({"Pod": pod(), "NodeNames": ["a"], "Extra": [[1]]}),
                Ok(()),
            ),
            (
                "pod missing",
                json!({"NodeNames": ["a"]}),
                Err(E::PodMissing),
            ),
            (
                "pod null",
                json!({"Pod": null, "NodeNames": ["a"]}),
                Err(E::PodMissing),
            ),
            (
                "pod no uid",
                json!({"Pod": no_uid, "NodeNames": ["a"]}),
                Err(E::PodUidMissing),
            ),
            (
                "pod empty uid",
                json!({"Pod": {"metadata": {"name": "p", "uid": ""}}, "NodeNames": []}),
                Err(E::PodUidMissing),
            ),
            (
                "pod no name",
                json!({"Pod": no_name, "NodeNames": ["a"]}),
                Err(E::PodNameMissing),
            ),
            (
                "no candidates",
                json!({"Pod": pod()}),
                Err(E::CandidatesMissing),
            ),
            (
                "null candidates",
                json!({"Pod": pod(), "NodeNames": null, "Nodes": null}),
                Err(E::CandidatesMissing),
            ),
            (
                "empty name",
                json!({"Pod": pod(), "NodeNames": ["a", ""]}),
                Err(E::EmptyNodeName { index: 1 }),
            ),
            (
                "nameless node",
                json!({"Pod": pod(), "Nodes": {"items": [{"metadata": {}}]}}),
                Err(E::NodeNameMissing { index: 0 }),
            ),
        ] {
            assert_eq!(decode_args(&body(input)).map(drop), want, "{name}");
        }
    }

    #[test]
    fn decode_error_kinds() {
        use ExtenderApiError as E;
        let deep = "[".repeat(10_000);
        let deep_in_pod = format!(r#"{{"Pod": {{"metadata": {{"labels": {deep}"#);
        for (name, input, check) in [
            (
                "empty",
                "".as_bytes(),
                (|e| *e == E::Empty) as fn(&E) -> bool,
            ),
            ("blank", b" \n\t ".as_slice(), |e| *e == E::Empty),
            ("null", b"null", |e| matches!(e, E::NotObject { .. })),
            ("array", b"[{}, null, []]", |e| {
                matches!(e, E::NotObject { .. })
            }),
            ("truncated", br#"{"Pod": {"metadata""#, |e| {
                matches!(e, E::Truncated { .. })
            }),
            ("garbage", b"\xff\xfe\x00", |e| {
                matches!(e, E::Syntax { .. })
            }),
            ("trailing", br#"{"NodeNames": []} x"#, |e| {
                matches!(e, E::Syntax { .. })
            }),
            ("deep", deep.as_bytes(), |e| {
                matches!(e, E::NotObject { .. })
            }),
            ("deep in pod", deep_in_pod.as_bytes(), |e| {
                matches!(e, E::Data { .. } | E::Syntax { .. })
            }),
            ("wrong type", br#"{"NodeNames": "a"}"#, |e| {
                matches!(e, E::Data { .. })
            }),
            ("duplicate spelling", br#"{"Pod": {}, "pod": {}}"#, |e| {
                matches!(e, E::Data { .. })
            }),
        ] {
            let err = decode_args(input).expect_err("rejected");
            assert!(check(&err), "{name}: {err:?}");
        }
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let deep = format!(r#"{{"NodeNames": {}"#, "[".repeat(10_000));
        let err = decode_args(deep.as_bytes()).expect_err("rejected");
        assert!(err.to_string().contains("ExtenderArgs"), "{err}");
        let deep_map = format!(
            r#"{{"NodeNameToMetaVictims": {}"#,
            r#"{"n": "#.repeat(10_000)
        );
        assert!(decode_preemption_args(deep_map.as_bytes()).is_err());
        // managedFields[].fieldsV1 is free-form JSON, the one place serde_json recurses freely.
        let nested = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
        let deep_json = format!(
            r#"{{"Pod": {{"metadata": {{"name": "p", "uid": "u", "managedFields": [{{"fieldsV1": {nested}}}]}}}}, "NodeNames": []}}"#
        );
        let err = decode_args(deep_json.as_bytes()).expect_err("rejected");
        assert!(
            err.to_string().contains("recursion limit exceeded"),
            "{err}"
        );
        // Unknown fields are skipped without recursion, so deep ones are harmless.
        let unknown = format!(
            r#"{{"Pod": {}, "NodeNames": [], "Extra": {nested}}}"#,
            pod()
        );
        assert!(decode_args(unknown.as_bytes()).is_ok());
    }

    #[test]
    fn node_names_table() {
        for (name, json, want) in [
            ("plain", r#"["a","bb",""]"#, Ok(vec!["a", "bb", ""])),
            (
                "escapes",
                r#"["n\u00e9-1","x\"y"]"#,
                Ok(vec!["né-1", "x\"y"]),
            ),
            ("empty", "[]", Ok(vec![])),
            (
                "number",
                "[1]",
                Err("invalid type: integer `1`, expected a node name"),
            ),
            ("null element", r#"["a",null]"#, Err("expected a node name")),
            ("object", "{}", Err("expected a list of node names")),
        ] {
            let got = serde_json::from_str::<NodeNames>(json);
            match (got, want) {
                (Ok(names), Ok(want)) => {
                    assert_eq!(names.iter().collect::<Vec<_>>(), want, "{name}");
                    assert_eq!(names.len(), want.len(), "{name}");
                    assert_eq!(names, NodeNames::from_iter(&want), "{name}");
                    let again: NodeNames =
                        serde_json::from_str(&serde_json::to_string(&names).expect("test value"))
                            .expect("test value");
                    assert_eq!(again, names, "{name}: round trip");
                }
                (Err(e), Err(want)) => assert!(e.to_string().contains(want), "{name}: {e}"),
                (got, want) => panic!("{name}: got {got:?}, want {want:?}"),
            }
        }
        assert_eq!(
            format!("{:?}", NodeNames::from_iter(["a", "b"])),
            r#"["a", "b"]"#
        );
        assert!(NodeNames::default().is_empty());
    }

    #[test]
    fn retain_keeps_in_order_and_asks_once_per_name() {
        let names = || NodeNames::from_iter(["a", "bb", "", "né", "c"]);
        for (name, keep, want) in [
            ("all", vec![true; 5], vec!["a", "bb", "", "né", "c"]),
            ("none", vec![false; 5], vec![]),
            (
                "some",
                vec![false, true, true, false, true],
                vec!["bb", "", "c"],
            ),
            (
                "last only",
                vec![false, false, false, false, true],
                vec!["c"],
            ),
        ] {
            let mut asked = Vec::new();
            let mut verdicts = keep.iter();
            let kept = names().retain(|n| {
                asked.push(n.to_owned());
                *verdicts.next().expect("asked once per name")
            });
            assert_eq!(asked, ["a", "bb", "", "né", "c"], "{name}: asked");
            assert_eq!(kept.iter().collect::<Vec<_>>(), want, "{name}");
            assert_eq!(
                kept,
                NodeNames::from_iter(&want),
                "{name}: same value as built"
            );
        }
    }

    #[test]
    fn filter_answer_json_is_what_serde_writes() {
        let reasons = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>()
        };
        let names = |list: &[&str]| Some(NodeNames::from_iter(list));
        for (name, result) in [
            ("default", ExtenderFilterResult::default()),
            ("error", ExtenderFilterResult::from_error("no \"luck\"\n")),
            (
                "plain names",
                ExtenderFilterResult {
                    node_names: names(&["n1", "node-2.example.com", ""]),
                    ..ExtenderFilterResult::default()
                },
            ),
            (
                "empty names",
                ExtenderFilterResult {
                    node_names: names(&[]),
                    ..ExtenderFilterResult::default()
                },
            ),
            (
                "names needing escapes, failures and an error",
                ExtenderFilterResult {
                    node_names: names(&[
                        "a\"b",
                        "back\\slash",
                        "tab\there",
                        "\u{1}",
                        "né",
                        "\u{7f}/",
                    ]),
                    failed_nodes: reasons(&[("x", "not \"running\""), ("é", "")]),
                    failed_and_unresolvable_nodes: reasons(&[("y", "too small\n")]),
                    error: "partial".into(),
                    ..ExtenderFilterResult::default()
                },
            ),
            (
                "nodes and names",
                ExtenderFilterResult {
                    nodes: Some(List::default()),
                    node_names: names(&["n1"]),
                    ..ExtenderFilterResult::default()
                },
            ),
        ] {
            let want = serde_json::to_vec(&result).expect("test value");
            let got = result.to_json().expect("encodes");
            assert_eq!(
                String::from_utf8_lossy(&got),
                String::from_utf8_lossy(&want),
                "{name}"
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn filter_answer_json_is_what_serde_writes_for_any_names(
            list in proptest::collection::vec(proptest::prelude::any::<String>(), 0..8),
            keep in proptest::collection::vec(proptest::prelude::any::<bool>(), 8),
        ) {
            let mut verdicts = keep.iter();
            let result = ExtenderFilterResult {
                node_names: Some(NodeNames::from_iter(&list).retain(|_| *verdicts.next().unwrap_or(&true))),
                ..ExtenderFilterResult::default()
            };
            let want = serde_json::to_vec(&result).expect("test value");
            proptest::prop_assert_eq!(result.to_json().expect("encodes"), want);
        }
    }

    #[test]
    fn filter_answer_uses_request_form_and_go_names() {
        let request = decode_request(&body(json!({"pod": pod(), "nodenames": ["a", "b", "c"]})))
            .expect("test value");
        let result = request.candidates.into_filter_result(|n| match n {
            "a" => None,
            "b" => Some(Rejection::Resolvable("PMEM driver not running".into())),
            _ => Some(Rejection::Unresolvable("insufficient".into())),
        });
        assert_eq!(
            serde_json::to_value(&result).expect("test value"),
            json!({
                "NodeNames": ["a"],
                "FailedNodes": {"b": "PMEM driver not running"},
                "FailedAndUnresolvableNodes": {"c": "insufficient"},
            })
        );

        let nodes = json!({"items": [{"metadata": {"name": "a"}}, {"metadata": {"name": "b"}}]});
        let request =
            decode_request(&body(json!({"Pod": pod(), "Nodes": nodes}))).expect("test value");
        let result = request
            .candidates
            .into_filter_result(|n| (n == "b").then(|| Rejection::Unresolvable("x".into())));
        let wire = serde_json::to_value(&result).expect("test value");
        assert_eq!(wire["Nodes"]["items"][0]["metadata"]["name"], "a");
        assert_eq!(
            wire["Nodes"]["items"].as_array().expect("test value").len(),
            1
        );
        assert!(wire.get("NodeNames").is_none());

        let empty =
            decode_request(&body(json!({"Pod": pod(), "NodeNames": []}))).expect("test value");
        let wire = serde_json::to_value(empty.candidates.into_filter_result(|_| None))
            .expect("test value");
        assert_eq!(wire["NodeNames"], json!([]));
    }

    #[test]
    fn names_win_over_nodes() {
        let both = json!({"Pod": pod(), "NodeNames": ["a"], "Nodes": {"items": [{"metadata": {"name": "b"}}]}});
        let request = decode_request(&body(both)).expect("test value");
        assert_eq!(
            request.candidates,
            Candidates::Names(NodeNames::from_iter(["a"]))
        );
    }

    #[test]
    fn other_answers_use_go_names_and_decode_back() {
        let prio: HostPriorityList = vec![HostPriority {
            host: "a".into(),
            score: 10,
        }];
        let wire = serde_json::to_value(&prio).expect("test value");
        assert_eq!(wire, json!([{"Host": "a", "Score": 10}]));
        let back: HostPriorityList =
            serde_json::from_value(json!([{"host": "a", "score": 10}])).expect("test value");
        assert_eq!(back, prio);

        let error =
            serde_json::to_value(ExtenderFilterResult::from_error("boom")).expect("test value");
        assert_eq!(
            error,
            json!({"FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": "boom"})
        );
        let go: ExtenderFilterResult = serde_json::from_value(
            json!({"Nodes": null, "NodeNames": ["a"], "FailedNodes": null, "FailedAndUnresolvableNodes": null, "Error": ""}),
        )
        .expect("test value");
        assert_eq!(go.node_names, Some(NodeNames::from_iter(["a"])));
    }

    #[test]
    fn preemption_table() {
        use ExtenderApiError as E;
        let victim = json!({"metadata": {"name": "v", "uid": "v1"}});
        for (name, input, want) in [
            (
                "meta",
                json!({"Pod": pod(), "NodeNameToMetaVictims": {"a": {"Pods": [{"UID": "v1"}], "NumPDBViolations": 0}}}),
                Ok(1),
            ),
            (
                "meta lower",
                json!({"pod": pod(), "nodeNameToMetaVictims": {"a": {"pods": [{"uid": "v1"}], "numPDBViolations": 2}}}),
                Ok(1),
            ),
            (
                "full",
                json!({"Pod": pod(), "NodeNameToVictims": {"a": {"Pods": [victim], "NumPDBViolations": 0}, "b": {"Pods": null}}}),
                Ok(2),
            ),
            (
                "empty map valid",
                json!({"Pod": pod(), "NodeNameToMetaVictims": {}}),
                Ok(0),
            ),
            (
                "go nulls",
                json!({"Pod": pod(), "NodeNameToVictims": null, "NodeNameToMetaVictims": {"a": {"Pods": null}}}),
                Ok(1),
            ),
            (
                "no pod",
                json!({"NodeNameToMetaVictims": {}}),
                Err(E::PodMissing),
            ),
            ("no maps", json!({"Pod": pod()}), Err(E::VictimsMissing)),
            (
                "empty node",
                json!({"Pod": pod(), "NodeNameToMetaVictims": {"": {}}}),
                Err(E::VictimsEmptyNode { field: META_FIELD }),
            ),
            (
                "meta no uid",
                json!({"Pod": pod(), "NodeNameToMetaVictims": {"a": {"Pods": [{}]}}}),
                Err(E::VictimUidMissing {
                    field: META_FIELD,
                    node: "a".into(),
                    index: 0,
                }),
            ),
            (
                "full no uid",
                json!({"Pod": pod(), "NodeNameToVictims": {"a": {"Pods": [{"metadata": {}}]}}}),
                Err(E::VictimUidMissing {
                    field: FULL_FIELD,
                    node: "a".into(),
                    index: 0,
                }),
            ),
        ] {
            let got = decode_preemption_request(&body(input.clone())).map(|r| r.victims.len());
            assert_eq!(got, want, "{name}");
            assert_eq!(
                decode_preemption_args(&body(input)).map(drop),
                want.map(drop),
                "{name}"
            );
        }
    }

    #[test]
    fn preemption_answer_keeps_victims() {
        let input = json!({"Pod": pod(), "NodeNameToMetaVictims": {
            "a": {"Pods": [{"UID": "v1"}], "NumPDBViolations": 1},
            "b": {"Pods": [{"UID": "v2"}], "NumPDBViolations": 0},
        }});
        let request = decode_preemption_request(&body(input)).expect("test value");
        let result = request.into_result(|node, _| node == "a");
        assert_eq!(
            serde_json::to_value(result).expect("test value"),
            json!({"NodeNameToMetaVictims": {"a": {"Pods": [{"UID": "v1"}], "NumPDBViolations": 1}}})
        );
    }

    #[test]
    fn nested_protocol_objects_must_be_objects() {
        for input in [
            json!({"Pod": pod(), "NodeNameToMetaVictims": {"a": [[{"UID": "v"}], 0]}}),
            json!({"Pod": pod(), "NodeNameToMetaVictims": {"a": {"Pods": [["v"]]}}}),
            json!({"Pod": pod(), "NodeNameToMetaVictims": {"a": null}}),
            json!({"Pod": pod(), "NodeNameToVictims": {"a": {"Pods": [null]}}}),
        ] {
            assert!(
                decode_preemption_args(&body(input.clone())).is_err(),
                "{input}"
            );
        }
    }
}
