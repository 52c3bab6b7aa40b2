//! AdmissionReview v1 for the pod mutating webhook, decoded and encoded by hand: the request is
//! checked field by field so a malformed review gets a 400 naming the offending field, and the
//! response is built without the kube `admission` feature.

use std::fmt;

use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize;
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value, json};

/// The only AdmissionReview version the webhook registers for.
pub const API_VERSION: &str = "admission.k8s.io/v1";
/// The kind of both request and response documents.
pub const KIND: &str = "AdmissionReview";

/// A request body that is not a usable pod AdmissionReview.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReviewError {
    /// Not JSON, truncated, trailing garbage, out-of-range number or nested too deeply.
    #[error("body is not valid JSON: {0}")]
    NotJson(String),
    /// A field has the wrong JSON type.
    #[error("{field}: expected {expected}, got {got}")]
    WrongType {
        /// Dotted path of the field (`""` is the whole body).
        field: &'static str,
        /// The JSON type required.
        expected: &'static str,
        /// The JSON type found.
        got: &'static str,
    },
    /// A required field is absent or null.
    #[error("{0} is missing")]
    Missing(&'static str),
    /// A required string is empty.
    #[error("{0} must not be empty")]
    Empty(&'static str),
    /// `apiVersion` is not `admission.k8s.io/v1`.
    #[error("apiVersion must be {API_VERSION:?}, got {0:?}")]
    ApiVersion(String),
    /// `kind` is not `AdmissionReview`.
    #[error("kind must be {KIND:?}, got {0:?}")]
    Kind(String),
    /// `request.kind` is not the core v1 Pod.
    #[error(
        "request.kind must be group \"\" version \"v1\" kind \"Pod\", got {group:?} {version:?} {kind:?}"
    )]
    ResourceKind {
        /// `request.kind.group`.
        group: String,
        /// `request.kind.version`.
        version: String,
        /// `request.kind.kind`.
        kind: String,
    },
    /// `request.operation` is not an admission operation.
    #[error("request.operation must be one of CREATE, UPDATE, DELETE, CONNECT, got {0:?}")]
    Operation(String),
    /// `request.object` does not decode as a Pod.
    #[error(
        "request.object{}: {message}",
        if path.is_empty() { String::new() } else { format!(": {path}") }
    )]
    Object {
        /// Where in the object decoding failed, e.g. `spec.containers[0].name`.
        path: String,
        /// What serde found wrong.
        message: String,
    },
}

impl ReviewError {
    /// The body of the HTTP 400 answer to a malformed review.
    pub fn http_body(&self) -> String {
        format!("invalid AdmissionReview: {self}\n")
    }
}

/// `request.operation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    /// `CREATE`.
    Create,
    /// `UPDATE`.
    Update,
    /// `DELETE`.
    Delete,
    /// `CONNECT`.
    Connect,
}

/// The parts of an AdmissionReview request the webhook uses.
#[derive(Clone, Debug, PartialEq)]
pub struct AdmissionRequest {
    /// `request.uid`, echoed in the response.
    pub uid: String,
    /// `request.operation`.
    pub operation: Operation,
    /// `request.namespace` (`""` when absent); stands in for an empty pod namespace.
    pub namespace: String,
    /// `request.name` (`""` when absent, as for pods created with `generateName`).
    pub name: String,
    /// `request.dryRun`.
    pub dry_run: bool,
    /// `request.object`; always present for CREATE.
    pub object: Option<Pod>,
}

/// Decodes a request body into an [`AdmissionRequest`], or says which field is wrong.
pub fn decode_review(body: &[u8]) -> Result<AdmissionRequest, ReviewError> {
    // serde_json's recursion limit (128) turns absurd nesting into an error, not a stack overflow.
    let review: Value =
        serde_json::from_slice(body).map_err(|e| ReviewError::NotJson(e.to_string()))?;
    let review = object(&review, "")?;
    let api_version = required_str(review, "apiVersion", "apiVersion")?;
    if api_version != API_VERSION {
        return Err(ReviewError::ApiVersion(api_version.to_string()));
    }
    let kind = required_str(review, "kind", "kind")?;
    if kind != KIND {
        return Err(ReviewError::Kind(kind.to_string()));
    }
    let request = object(
        present(review.get("request")).ok_or(ReviewError::Missing("request"))?,
        "request",
    )?;
    let uid = required_str(request, "uid", "request.uid")?;
    if uid.is_empty() {
        return Err(ReviewError::Empty("request.uid"));
    }
    check_resource_kind(request)?;
    let operation = match required_str(request, "operation", "request.operation")? {
        "CREATE" => Operation::Create,
        "UPDATE" => Operation::Update,
        "DELETE" => Operation::Delete,
        "CONNECT" => Operation::Connect,
        other => return Err(ReviewError::Operation(other.to_string())),
    };
    let namespace = optional_str(request, "namespace", "request.namespace")?;
    let name = optional_str(request, "name", "request.name")?;
    let dry_run = match present(request.get("dryRun")) {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(wrong_type("request.dryRun", "boolean", other)),
    };
    let object = present(request.get("object")).map(decode_pod).transpose()?;
    if operation == Operation::Create && object.is_none() {
        return Err(ReviewError::Missing("request.object"));
    }
    Ok(AdmissionRequest {
        uid: uid.to_string(),
        operation,
        namespace: namespace.to_string(),
        name: name.to_string(),
        dry_run,
        object,
    })
}

/// The response allowing the request, with `patch` (a JSON patch document) applied if given.
pub fn allow_response(uid: &str, patch: Option<&str>) -> Vec<u8> {
    let mut response = Map::new();
    response.insert("uid".into(), json!(uid));
    response.insert("allowed".into(), json!(true));
    if let Some(patch) = patch {
        response.insert("patchType".into(), json!("JSONPatch"));
        response.insert("patch".into(), json!(base64(patch.as_bytes())));
    }
    json!({"apiVersion": API_VERSION, "kind": KIND, "response": response})
        .to_string()
        .into_bytes()
}

fn check_resource_kind(request: &Map<String, Value>) -> Result<(), ReviewError> {
    let kind = object(
        present(request.get("kind")).ok_or(ReviewError::Missing("request.kind"))?,
        "request.kind",
    )?;
    // The apiserver omits an empty group, so absence and "" are the same.
    let group = optional_str(kind, "group", "request.kind.group")?;
    let version = required_str(kind, "version", "request.kind.version")?;
    let name = required_str(kind, "kind", "request.kind.kind")?;
    if (group, version, name) != ("", "v1", "Pod") {
        return Err(ReviewError::ResourceKind {
            group: group.to_string(),
            version: version.to_string(),
            kind: name.to_string(),
        });
    }
    Ok(())
}

fn decode_pod(value: &Value) -> Result<Pod, ReviewError> {
    Pod::deserialize(Tracked {
        value,
        path: &Path::Root,
    })
    .map_err(|e| ReviewError::Object {
        path: e.path.unwrap_or_default(),
        message: e.message,
    })
}

/// `None` for absent and for `null`: the apiserver may send either for an unset field.
fn present(value: Option<&Value>) -> Option<&Value> {
    value.filter(|v| !v.is_null())
}

fn object<'a>(
    value: &'a Value,
    field: &'static str,
) -> Result<&'a Map<String, Value>, ReviewError> {
    value
        .as_object()
        .ok_or_else(|| wrong_type(field, "object", value))
}

fn required_str<'a>(
    map: &'a Map<String, Value>,
    key: &str,
    field: &'static str,
) -> Result<&'a str, ReviewError> {
    match present(map.get(key)) {
        None => Err(ReviewError::Missing(field)),
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(wrong_type(field, "string", other)),
    }
}

fn optional_str<'a>(
    map: &'a Map<String, Value>,
    key: &str,
    field: &'static str,
) -> Result<&'a str, ReviewError> {
    match present(map.get(key)) {
        None => Ok(""),
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(wrong_type(field, "string", other)),
    }
}

fn wrong_type(field: &'static str, expected: &'static str, got: &Value) -> ReviewError {
    let field = if field.is_empty() { "body" } else { field };
    ReviewError::WrongType {
        field,
        expected,
        got: match got {
            Value::Null => "null",
            Value::Bool(_) => "boolean",
            Value::Number(_) => "number",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::Object(_) => "object",
        },
    }
}

/// Standard base64 with padding, as Kubernetes expects for `[]byte` fields.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Where in `request.object` the deserializer is; rendered only when decoding fails.
enum Path<'a> {
    Root,
    Key(&'a Path<'a>, &'a str),
    Index(&'a Path<'a>, usize),
}

impl fmt::Display for Path<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Path::Root => Ok(()),
            Path::Key(parent, key) => {
                write!(f, "{parent}")?;
                let plain = !key.is_empty()
                    && key
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
                match (plain, matches!(parent, Path::Root)) {
                    (true, true) => write!(f, "{key}"),
                    (true, false) => write!(f, ".{key}"),
                    (false, _) => write!(f, "[{key:?}]"),
                }
            }
            Path::Index(parent, index) => write!(f, "{parent}[{index}]"),
        }
    }
}

/// A decoding error of `request.object`, with the path of the innermost failing value.
#[derive(Debug)]
struct ObjectError {
    path: Option<String>,
    message: String,
}

impl fmt::Display for ObjectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ObjectError {}

impl de::Error for ObjectError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        ObjectError {
            path: None,
            message: msg.to_string(),
        }
    }
}

/// A deserializer over a parsed JSON value that remembers where an error happened, because
/// serde_json reports only line and column, which mean nothing inside an embedded object.
struct Tracked<'de, 'p> {
    value: &'de Value,
    path: &'p Path<'p>,
}

impl Tracked<'_, '_> {
    fn at_path<T>(&self, result: Result<T, ObjectError>) -> Result<T, ObjectError> {
        result.map_err(|mut e| {
            // The innermost value sees the error first; outer levels keep its path.
            if e.path.is_none() {
                e.path = Some(self.path.to_string());
            }
            e
        })
    }
}

impl<'de> de::Deserializer<'de> for Tracked<'de, '_> {
    type Error = ObjectError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ObjectError> {
        let result = match self.value {
            Value::Null => visitor.visit_unit(),
            Value::Bool(b) => visitor.visit_bool(*b),
            Value::Number(n) => {
                if let Some(u) = n.as_u64() {
                    visitor.visit_u64(u)
                } else if let Some(i) = n.as_i64() {
                    visitor.visit_i64(i)
                } else {
                    visitor.visit_f64(n.as_f64().unwrap_or(f64::NAN))
                }
            }
            Value::String(s) => visitor.visit_borrowed_str(s),
            Value::Array(items) => visitor.visit_seq(Elements {
                items: items.iter().enumerate(),
                path: self.path,
            }),
            Value::Object(map) => visitor.visit_map(Entries {
                entries: map.iter(),
                value: None,
                path: self.path,
            }),
        };
        self.at_path(result)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ObjectError> {
        if self.value.is_null() {
            visitor.visit_none()
        } else {
            let path = self.path;
            let result = visitor.visit_some(Tracked {
                value: self.value,
                path,
            });
            self.at_path(result)
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, ObjectError> {
        let result = visitor.visit_newtype_struct(Tracked {
            value: self.value,
            path: self.path,
        });
        self.at_path(result)
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, ObjectError> {
        visitor.visit_unit()
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct seq tuple tuple_struct map struct enum identifier
    }
}

struct Elements<'de, 'p> {
    items: std::iter::Enumerate<std::slice::Iter<'de, Value>>,
    path: &'p Path<'p>,
}

impl<'de> SeqAccess<'de> for Elements<'de, '_> {
    type Error = ObjectError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, ObjectError> {
        let Some((index, value)) = self.items.next() else {
            return Ok(None);
        };
        let path = Path::Index(self.path, index);
        seed.deserialize(Tracked { value, path: &path }).map(Some)
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.items.len())
    }
}

struct Entries<'de, 'p> {
    entries: serde_json::map::Iter<'de>,
    value: Option<(&'de str, &'de Value)>,
    path: &'p Path<'p>,
}

impl<'de> MapAccess<'de> for Entries<'de, '_> {
    type Error = ObjectError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, ObjectError> {
        let Some((key, value)) = self.entries.next() else {
            return Ok(None);
        };
        self.value = Some((key, value));
        seed.deserialize(de::value::BorrowedStrDeserializer::<ObjectError>::new(key))
            .map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, ObjectError> {
        let (key, value) = self
            .value
            .take()
            .ok_or_else(|| de::Error::custom("value requested before key"))?;
        let path = Path::Key(self.path, key);
        seed.deserialize(Tracked { value, path: &path })
    }

    fn size_hint(&self) -> Option<usize> {
        Some(self.entries.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    use serde_json::json;

    fn testdata(dir: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata/webhook")
            .join(dir)
    }

    fn review(request: Value) -> Vec<u8> {
        json!({"apiVersion": API_VERSION, "kind": KIND, "request": request})
            .to_string()
            .into_bytes()
    }

    fn pod_request(object: Value) -> Value {
        json!({
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": "default",
            "object": object,
        })
    }

    fn minimal_pod() -> Value {
        json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}})
    }

    #[test]
    fn decode_errors_table() {
        let with = |key: &str, value: Value| {
            let mut request = pod_request(minimal_pod());
            request[key] = value;
            review(request)
        };
        let without = |key: &str| {
            let mut request = pod_request(minimal_pod());
            request.as_object_mut().map(|r| r.remove(key));
            review(request)
        };
        let object = |object: Value| review(pod_request(object));
        for (name, body, want) in [
            (
                "empty",
                b"".to_vec(),
                "body is not valid JSON: EOF while parsing a value at line 1 column 0",
            ),
            ("array", b"[]".to_vec(), "body: expected object, got array"),
            (
                "wrong apiVersion",
                json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": KIND})
                    .to_string()
                    .into_bytes(),
                "apiVersion must be \"admission.k8s.io/v1\", got \"admission.k8s.io/v1beta1\"",
            ),
            (
                "apiVersion number",
                json!({"apiVersion": 1}).to_string().into_bytes(),
                "apiVersion: expected string, got number",
            ),
            (
                "kind",
                json!({"apiVersion": API_VERSION, "kind": "Review"})
                    .to_string()
                    .into_bytes(),
                "kind must be \"AdmissionReview\", got \"Review\"",
            ),
            (
                "request missing",
                json!({"apiVersion": API_VERSION, "kind": KIND})
                    .to_string()
                    .into_bytes(),
                "request is missing",
            ),
            ("uid missing", without("uid"), "request.uid is missing"),
            (
                "uid empty",
                with("uid", json!("")),
                "request.uid must not be empty",
            ),
            (
                "uid number",
                with("uid", json!(5)),
                "request.uid: expected string, got number",
            ),
            (
                "kind deployment",
                with(
                    "kind",
                    json!({"group": "apps", "version": "v1", "kind": "Deployment"}),
                ),
                "request.kind must be group \"\" version \"v1\" kind \"Pod\", got \"apps\" \"v1\" \"Deployment\"",
            ),
            (
                "operation missing",
                without("operation"),
                "request.operation is missing",
            ),
            (
                "operation unknown",
                with("operation", json!("PATCH")),
                "request.operation must be one of CREATE, UPDATE, DELETE, CONNECT, got \"PATCH\"",
            ),
            (
                "object missing",
                without("object"),
                "request.object is missing",
            ),
            (
                "object null",
                with("object", Value::Null),
                "request.object is missing",
            ),
            (
                "dryRun string",
                with("dryRun", json!("yes")),
                "request.dryRun: expected boolean, got string",
            ),
            (
                "container name number",
                object(json!({"spec": {"containers": [{"name": 1}]}})),
                "request.object: spec.containers[0].name: invalid type: integer `1`, expected a string",
            ),
            (
                "label value number",
                object(json!({"metadata": {"labels": {"app.kubernetes.io/name": 2}}})),
                "request.object: metadata.labels[\"app.kubernetes.io/name\"]: invalid type: integer `2`, expected a string",
            ),
            (
                "object is array",
                object(json!([])),
                "request.object: invalid type: sequence, expected Pod",
            ),
            (
                "object kind",
                object(json!({"kind": "Deployment"})),
                "request.object: invalid value: string \"Deployment\", expected Pod",
            ),
            (
                "huge integer",
                object(json!({"spec": {"containers": [], "terminationGracePeriodSeconds": 1e30}})),
                "request.object: spec.terminationGracePeriodSeconds: invalid type: floating point `1000000000000000000000000000000.0`, expected i64",
            ),
        ] {
            let err = decode_review(&body).expect_err(name);
            assert_eq!(err.to_string(), want, "{name}");
        }
    }

    #[test]
    fn decode_good_review() {
        let mut request = pod_request(minimal_pod());
        request["dryRun"] = json!(true);
        request["kind"] = json!({"version": "v1", "kind": "Pod"});
        let decoded = decode_review(&review(request)).expect("decodes");
        assert_eq!(decoded.uid, "705ab4f5-6393-11e8-b7cc-42010a800002");
        assert_eq!(decoded.operation, Operation::Create);
        assert_eq!(decoded.namespace, "default");
        assert!(decoded.dry_run);
        let pod = decoded.object.expect("object");
        assert_eq!(pod.metadata.name.as_deref(), Some("p"));

        let mut delete = pod_request(Value::Null);
        delete["operation"] = json!("DELETE");
        let decoded = decode_review(&review(delete)).expect("DELETE without object decodes");
        assert_eq!(
            (decoded.operation, decoded.object),
            (Operation::Delete, None)
        );
    }

    #[test]
    fn every_bad_body_is_rejected() {
        let mut count = 0;
        let mut entries: Vec<_> = std::fs::read_dir(testdata("bad"))
            .expect("testdata/webhook/bad exists")
            .map(|e| e.expect("dir entry").path())
            .collect();
        entries.sort();
        for path in entries {
            let body = std::fs::read(&path).expect("readable");
            let name = path.display();
            assert!(body.len() < 200 * 1024, "{name} is too large");
            match decode_review(&body) {
                Ok(request) => panic!("{name} decoded: {request:?}"),
                Err(e) => {
                    assert!(!e.to_string().is_empty(), "{name}: empty message");
                    assert!(e.http_body().starts_with("invalid AdmissionReview: "));
                }
            }
            count += 1;
        }
        assert!(count >= 55, "only {count} bad bodies");
    }

    #[test]
    fn every_good_body_is_accepted() {
        let mut count = 0;
        for entry in std::fs::read_dir(testdata("good")).expect("testdata/webhook/good exists") {
            let path = entry.expect("dir entry").path();
            let body = std::fs::read(&path).expect("readable");
            if let Err(e) = decode_review(&body) {
                panic!("{}: {e}", path.display());
            }
            count += 1;
        }
        assert!(count >= 3, "only {count} good bodies");
    }

    #[test]
    fn response_encoding() {
        for (name, patch, want) in [
            (
                "unchanged",
                None,
                json!({"apiVersion": API_VERSION, "kind": KIND, "response": {"uid": "u1", "allowed": true}}),
            ),
            (
                "patched",
                Some(r#"[{"op":"add"}]"#),
                json!({"apiVersion": API_VERSION, "kind": KIND, "response": {
                    "uid": "u1", "allowed": true, "patchType": "JSONPatch",
                    "patch": "W3sib3AiOiJhZGQifV0="}}),
            ),
        ] {
            let got: Value =
                serde_json::from_slice(&allow_response("u1", patch)).expect("response is JSON");
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn base64_table() {
        // RFC 4648 section 10 test vectors.
        for (input, want) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(input.as_bytes()), want, "{input:?}");
        }
        assert_eq!(base64(&[0xff, 0xfe, 0xfd]), "//79");
    }

    #[derive(Clone, Debug)]
    enum Mutation {
        Flip(usize, u8),
        Truncate(usize),
        Insert(usize, Vec<u8>),
        Remove(usize, usize),
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        let interesting = prop::sample::select(b"{}[]\",:0-9e.tfn\\ \x00\xff".to_vec());
        prop_oneof![
            (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
            (any::<usize>(), interesting).prop_map(|(i, b)| Mutation::Flip(i, b)),
            any::<usize>().prop_map(Mutation::Truncate),
            (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8))
                .prop_map(|(i, b)| Mutation::Insert(i, b)),
            (any::<usize>(), 1usize..32).prop_map(|(i, n)| Mutation::Remove(i, n)),
        ]
    }

    fn apply(body: &mut Vec<u8>, mutation: &Mutation) {
        let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
        match mutation {
            Mutation::Flip(i, b) => {
                let i = at(*i, body.len());
                if let Some(byte) = body.get_mut(i) {
                    *byte = *b;
                }
            }
            Mutation::Truncate(i) => body.truncate(at(*i, body.len() + 1)),
            Mutation::Insert(i, bytes) => {
                let i = at(*i, body.len() + 1);
                body.splice(i..i, bytes.iter().copied());
            }
            Mutation::Remove(i, n) => {
                let i = at(*i, body.len() + 1);
                let end = (i + n).min(body.len());
                body.drain(i..end);
            }
        }
    }

    #[test]
    fn mutated_reviews_never_panic() {
        let mut bases: Vec<Vec<u8>> = std::fs::read_dir(testdata("good"))
            .expect("testdata/webhook/good exists")
            .map(|e| std::fs::read(e.expect("dir entry").path()).expect("readable"))
            .collect();
        bases.sort();
        let config = Config {
            cases: 512,
            failure_persistence: None,
            ..Config::default()
        };
        let mut runner =
            TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]));
        let strategy = (0..bases.len(), prop::collection::vec(mutation(), 1..6));
        let outcome = runner.run(&strategy, |(base, mutations)| {
            let mut body = bases[base].clone();
            for m in &mutations {
                apply(&mut body, m);
            }
            if let Err(e) = decode_review(&body) {
                prop_assert!(!e.to_string().is_empty());
            }
            Ok(())
        });
        if let Err(e) = outcome {
            panic!("{e}");
        }
    }
}
