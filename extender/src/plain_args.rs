//! `ExtenderArgs` in the shape kube-scheduler writes them, decoded without serde's per-element
//! cost for the candidate names.
//!
//! A `/filter` of a 5,000-node cluster carries ~90 KB of `NodeNames`; decoding them one serde
//! string at a time was a fifth of the extender's time per call. Here the top-level object is
//! walked by hand, the names are copied straight into one buffer, and `Pod` and
//! `Nodes` still go through their serde types. Anything off the common shape — an escape or a
//! control character in a name or key, an unknown or repeated key, `null` names, a syntax
//! error — answers `None`, and the caller decodes the body the general way, which also words
//! every error. So this path only ever returns what the general decoder would.

use k8s_openapi::List;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Deserialize;

/// The fields of `ExtenderArgs` (`crate::api::ExtenderArgs` is built from them).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlainArgs {
    /// `Pod`.
    pub pod: Option<Pod>,
    /// `Nodes`.
    pub nodes: Option<List<Node>>,
    /// `NodeNames`.
    pub node_names: Option<PlainNames>,
}

/// Node names back to back: name `i` is `text[ends[i - 1]..ends[i]]` (from 0 for the first);
/// every end is a character boundary of `text`, and they do not decrease.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlainNames {
    /// The names, concatenated.
    pub text: String,
    /// Where each name ends in `text`.
    pub ends: Vec<usize>,
}

/// The body's fields as the general decoder (`crate::api::decode_args_general`) would decode
/// them, if it has the common shape; `None` otherwise (then nothing is known about it).
pub fn decode_plain(body: &[u8]) -> Option<PlainArgs> {
    let mut at = Cursor { body, pos: 0 };
    let mut args = PlainArgs::default();
    let (mut pod, mut nodes, mut names) = (false, false, false);
    at.skip_ws();
    at.eat(b'{')?;
    at.skip_ws();
    if at.peek()? != b'}' {
        loop {
            let key = at.plain_string()?;
            at.skip_ws();
            at.eat(b':')?;
            at.skip_ws();
            match key {
                b"Pod" | b"pod" if !pod => {
                    pod = true;
                    args.pod = at.value::<Option<Pod>>()?;
                }
                b"Nodes" | b"nodes" if !nodes => {
                    nodes = true;
                    args.nodes = at.value::<Option<List<Node>>>()?;
                }
                b"NodeNames" | b"nodenames" | b"nodeNames" if !names => {
                    names = true;
                    args.node_names = Some(at.names()?);
                }
                // Unknown or repeated: the general decoder decides.
                _ => return None,
            }
            at.skip_ws();
            match at.next()? {
                b',' => at.skip_ws(),
                b'}' => break,
                _ => return None,
            }
        }
    } else {
        at.pos += 1;
    }
    at.skip_ws();
    (at.pos == body.len()).then_some(args)
}

struct Cursor<'a> {
    body: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.body.get(self.pos).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.pos += 1;
        Some(b)
    }

    fn eat(&mut self, want: u8) -> Option<()> {
        (self.next()? == want).then_some(())
    }

    /// JSON's whitespace.
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    /// A string without escapes or control characters, its bytes between the quotes (not
    /// checked for UTF-8: callers check what they keep).
    fn plain_string(&mut self) -> Option<&'a [u8]> {
        self.eat(b'"')?;
        let rest = self.body.get(self.pos..)?;
        let len = memchr::memchr(b'"', rest)?;
        let string = rest.get(..len)?;
        // An escaped quote ends the search early, but then its backslash is in `string`.
        if !is_plain(string) {
            return None;
        }
        self.pos += len + 1;
        Some(string)
    }

    /// One JSON value decoded as `T` by serde_json, as the derived decoder of the field would.
    fn value<T: for<'de> Deserialize<'de>>(&mut self) -> Option<T> {
        let rest = self.body.get(self.pos..)?;
        let mut values = serde_json::Deserializer::from_slice(rest).into_iter::<T>();
        let value = values.next()?.ok()?;
        self.pos += values.byte_offset();
        Some(value)
    }

    /// A list of plain strings, copied back to back.
    fn names(&mut self) -> Option<PlainNames> {
        self.eat(b'[')?;
        self.skip_ws();
        if let Some(names) = self.compact_names() {
            return Some(names);
        }
        // The names take at most what is left of the body: one allocation, no regrowth.
        let mut text = Vec::with_capacity(self.body.len().saturating_sub(self.pos));
        let mut ends = Vec::new();
        if self.peek()? == b']' {
            self.pos += 1;
        } else {
            loop {
                text.extend_from_slice(self.plain_string()?);
                ends.push(text.len());
                self.skip_ws();
                match self.next()? {
                    b',' => self.skip_ws(),
                    b']' => break,
                    _ => return None,
                }
            }
        }
        plain_names(text, ends)
    }

    /// The rest of a non-empty list of names written compactly (`"a","b"]`, as kube-scheduler's
    /// encoder writes it): one search per name for its closing quote, and one check of all the
    /// list's bytes instead of one per name (whose bytes are too few to vectorize: that check
    /// was 60 % of the decoder's time at 5,000 names). `None`, the cursor unmoved,
    /// for anything else (whitespace between elements, escapes, control characters), which
    /// the per-name loop then reads.
    fn compact_names(&mut self) -> Option<PlainNames> {
        let rest = self.body.get(self.pos..)?;
        if rest.first() != Some(&b'"') {
            return None;
        }
        let mut text = Vec::with_capacity(rest.len());
        let mut ends = Vec::new();
        let mut open = 0;
        let run = loop {
            let start = open + 1;
            let close = start + memchr::memchr(b'"', rest.get(start..)?)?;
            text.extend_from_slice(rest.get(start..close)?);
            ends.push(text.len());
            match rest.get(close + 1..close + 3)? {
                [b']', ..] => break close + 2,
                [b',', b'"'] => open = close + 2,
                _ => return None,
            }
        };
        // A quote inside a name would be escaped, so its backslash lies within `run` (the
        // quotes, commas and bracket are neither control characters nor backslashes).
        if !is_plain(rest.get(..run)?) {
            return None;
        }
        let names = plain_names(text, ends)?;
        self.pos += run;
        Some(names)
    }
}

/// Whether `bytes` hold no control character and no backslash, in one pass without branches
/// that the compiler vectorizes (a per-byte `all` or a fold over `bool`s stays scalar).
fn is_plain(bytes: &[u8]) -> bool {
    bytes.iter().fold(0u8, |bad, b| {
        bad | u8::from(*b < 0x20) | u8::from(*b == b'\\')
    }) == 0
}

/// Names copied back to back, if each is UTF-8 on its own.
fn plain_names(text: Vec<u8>, ends: Vec<usize>) -> Option<PlainNames> {
    // serde_json checks each string on its own: a character split across two names is valid
    // in the joined text but not in either name.
    let text = String::from_utf8(text).ok()?;
    if !ends.iter().all(|end| text.is_char_boundary(*end)) {
        return None;
    }
    Some(PlainNames { text, ends })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ExtenderArgs, decode_args_general as decode_args};

    /// What `decode_request` takes from this path.
    fn fast(body: &[u8]) -> Option<ExtenderArgs> {
        decode_plain(body).map(ExtenderArgs::from)
    }
    use proptest::prelude::*;
    use serde_json::json;

    fn pod() -> serde_json::Value {
        json!({"metadata": {"name": "p", "namespace": "ns", "uid": "u-1"},
               "spec": {"containers": [{"name": "c", "image": "i"}]}})
    }

    /// What kube-scheduler sends with `nodeCacheCapable: true`.
    fn scheduler_body(names: &[&str]) -> Vec<u8> {
        serde_json::to_vec(&json!({"Pod": pod(), "Nodes": null, "NodeNames": names}))
            .expect("test value")
    }

    #[test]
    fn the_scheduler_shape_takes_this_path_and_decodes_as_the_general_way() {
        for (name, body) in [
            ("names", scheduler_body(&["n1", "node-2.example.com", "né"])),
            ("no names", scheduler_body(&[])),
            (
                "spaced, lower case, any order",
                b" {\n \"nodenames\" : [ \"a\" ,\t\"b\" ] , \"pod\" :\r {\"metadata\":{\"name\":\"p\",\"uid\":\"u\"}} } "
                    .to_vec(),
            ),
            ("empty object", b"{}".to_vec()),
            (
                "compact, then a space between names",
                br#"{"NodeNames":["a","b", "c"]}"#.to_vec(),
            ),
            (
                "full nodes",
                serde_json::to_vec(&json!({"Pod": pod(), "Nodes": {"items": [{"metadata": {"name": "n1"}}]}}))
                    .expect("test value"),
            ),
        ] {
            let fast = fast(&body);
            assert!(fast.is_some(), "{name}: took the general path");
            assert_eq!(fast, decode_args(&body).ok(), "{name}");
        }
    }

    #[test]
    fn anything_else_is_left_to_the_general_decoder() {
        for (name, body) in [
            ("escape in a name", br#"{"NodeNames":["a\"b"]}"#.to_vec()),
            (
                "escaped backslash ending a name",
                br#"{"NodeNames":["a","b\\","c"]}"#.to_vec(),
            ),
            ("unicode escape", br#"{"NodeNames":["\u0061"]}"#.to_vec()),
            ("control character", b"{\"NodeNames\":[\"a\tb\"]}".to_vec()),
            ("null names", br#"{"NodeNames":null}"#.to_vec()),
            ("number name", br#"{"NodeNames":[1]}"#.to_vec()),
            (
                "repeated key",
                br#"{"NodeNames":[],"nodeNames":[]}"#.to_vec(),
            ),
            ("unknown key", br#"{"Extra":1,"NodeNames":[]}"#.to_vec()),
            ("escaped key", br#"{"Node\u004eames":[]}"#.to_vec()),
            ("trailing comma", br#"{"NodeNames":["a",]}"#.to_vec()),
            ("trailing data", br#"{"NodeNames":[]} x"#.to_vec()),
            ("truncated", br#"{"NodeNames":["a""#.to_vec()),
            ("not UTF-8", b"{\"NodeNames\":[\"\xff\"]}".to_vec()),
            (
                "a character split across two names",
                b"{\"NodeNames\":[\"\xc3\",\"\xa9\"]}".to_vec(),
            ),
            ("array body", b"[]".to_vec()),
            ("bad pod", br#"{"Pod":[1]}"#.to_vec()),
            ("empty", b"".to_vec()),
        ] {
            assert_eq!(fast(&body), None, "{name}");
        }
    }

    /// A body built from `parts`: each a key spelling and its value's JSON text.
    fn body_of(parts: &[(String, String)], ws: &str) -> Vec<u8> {
        let fields: Vec<String> = parts
            .iter()
            .map(|(k, v)| format!("{ws}{k}{ws}:{ws}{v}{ws}"))
            .collect();
        format!("{ws}{{{}}}{ws}", fields.join(",")).into_bytes()
    }

    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("\"Pod\""),
            Just("\"pod\""),
            Just("\"Nodes\""),
            Just("\"NodeNames\""),
            Just("\"nodeNames\""),
            Just("\"nodenames\""),
            Just("\"Other\""),
            Just("\"Pod\\u0020\""),
        ]
        .prop_map(str::to_owned)
    }

    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("null".to_owned()),
            Just(pod().to_string()),
            Just("{\"items\":[]}".to_owned()),
            Just("[1]".to_owned()),
            prop::collection::vec(any::<String>(), 0..4)
                .prop_map(|names| serde_json::to_string(&names).expect("test value")),
            prop::collection::vec("[a-z0-9.é-]{0,12}", 0..4)
                .prop_map(|names| serde_json::to_string(&names).expect("test value")),
            Just("[\"a\",\"b\"".to_owned()),
        ]
    }

    proptest! {
        #[test]
        fn well_formed_bodies_take_this_path(
            names in prop::collection::vec("[a-z0-9.é-]{0,12}", 0..6),
            with_pod in any::<bool>(),
            nodes_null in any::<bool>(),
            ws in prop_oneof![Just(""), Just(" "), Just("\n\t")],
        ) {
            let mut parts = vec![(
                "\"NodeNames\"".to_owned(),
                serde_json::to_string(&names).expect("test value"),
            )];
            if with_pod {
                parts.insert(0, ("\"Pod\"".to_owned(), pod().to_string()));
            }
            if nodes_null {
                parts.push(("\"Nodes\"".to_owned(), "null".to_owned()));
            }
            let body = body_of(&parts, ws);
            let fast = fast(&body);
            prop_assert!(fast.is_some());
            prop_assert_eq!(fast, decode_args(&body).ok());
        }

        #[test]
        fn whatever_this_path_returns_the_general_decoder_returns(
            parts in prop::collection::vec((key(), value()), 0..4),
            ws in prop_oneof![Just(""), Just(" "), Just("\n\t")],
        ) {
            let body = body_of(&parts, ws);
            if let Some(fast) = fast(&body) {
                prop_assert_eq!(Some(fast), decode_args(&body).ok());
            }
        }
    }
}
