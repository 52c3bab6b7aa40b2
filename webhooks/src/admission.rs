//! AdmissionReview v1 for the pod mutating webhook, in kube's `admission` types. The request is
//! decoded through `serde_path_to_error`, so a malformed review gets a 400 naming the offending
//! field, then checked for what the types leave open (version, kind, resource, uid, object).

use std::fmt::Write as _;

use k8s_openapi::api::core::v1::Pod;
use kube::core::TypeMeta;
pub use kube::core::admission::{AdmissionResponse, Operation};
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::error::Category;
use serde_path_to_error::Segment;

/// The only AdmissionReview version the webhook registers for.
pub const API_VERSION: &str = kube::core::admission::META_API_VERSION_V1;
/// The kind of both request and response documents.
pub const KIND: &str = kube::core::admission::META_KIND;

/// A review of a pod, as the webhook receives it.
pub type AdmissionRequest = kube::core::admission::AdmissionRequest<Pod>;

/// A request body that is not a usable pod AdmissionReview, or an answer that cannot be encoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReviewError {
    /// Not JSON, truncated, trailing garbage, out-of-range number or nested too deeply.
    #[error("body is not valid JSON: {0}")]
    NotJson(String),
    /// A field has the wrong type or value, or a required field is absent.
    #[error("{field}: {message}")]
    Field {
        /// Dotted path of the field, e.g. `request.object.spec.containers[0].name` (`body` for
        /// the document itself).
        field: String,
        /// What serde found wrong, with the position in the body.
        message: String,
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
    /// The answer could not be encoded (a bug: the webhook answers 500).
    #[error("the AdmissionReview response could not be encoded: {0}")]
    Response(String),
}

impl ReviewError {
    /// The HTTP status of the answer: 400 for a malformed review, 500 for our own failure.
    pub fn http_status(&self) -> u16 {
        match self {
            ReviewError::Response(_) => 500,
            _ => 400,
        }
    }

    /// The body of the HTTP answer.
    pub fn http_body(&self) -> String {
        match self {
            ReviewError::Response(_) => format!("{self}\n"),
            _ => format!("invalid AdmissionReview: {self}\n"),
        }
    }

    fn from_serde(body: &[u8], error: serde_path_to_error::Error<serde_json::Error>) -> Self {
        let field = field_path(error.path());
        match error.inner().classify() {
            Category::Data => ReviewError::Field {
                field,
                message: error.into_inner().to_string(),
            },
            // serde_json reports some wrong types as syntax errors (`"operation": null` is
            // "expected value"); when the body itself is well-formed JSON, it is the field.
            Category::Syntax if serde_json::from_slice::<IgnoredAny>(body).is_ok() => {
                ReviewError::Field {
                    field,
                    message: format!("wrong type of value ({})", error.into_inner()),
                }
            }
            Category::Syntax | Category::Eof | Category::Io => {
                ReviewError::NotJson(error.into_inner().to_string())
            }
        }
    }
}

/// The review's own fields. kube's `AdmissionReview` flattens `apiVersion` and `kind` into
/// it, and serde reports errors of flattened fields without their name; decoding them here
/// keeps every error naming its field.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", expecting = "an AdmissionReview object")]
struct Envelope {
    api_version: String,
    kind: String,
    request: Option<AdmissionRequest>,
}

/// Decodes a request body into an [`AdmissionRequest`], or says which field is wrong.
pub fn decode_review(body: &[u8]) -> Result<AdmissionRequest, ReviewError> {
    // serde's derived structs also accept a JSON array of their fields in order; a review
    // never is one.
    if body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
        return Err(ReviewError::Field {
            field: "body".into(),
            message: "invalid type: sequence, expected an AdmissionReview object".into(),
        });
    }
    // serde_json's recursion limit (128) turns absurd nesting into an error, not a stack overflow.
    let mut json = serde_json::Deserializer::from_slice(body);
    let envelope: Envelope = serde_path_to_error::deserialize(&mut json)
        .map_err(|e| ReviewError::from_serde(body, e))?;
    json.end()
        .map_err(|e| ReviewError::NotJson(e.to_string()))?;
    if envelope.api_version != API_VERSION {
        return Err(ReviewError::ApiVersion(envelope.api_version));
    }
    if envelope.kind != KIND {
        return Err(ReviewError::Kind(envelope.kind));
    }
    let mut request = envelope.request.ok_or(ReviewError::Missing("request"))?;
    if request.uid.is_empty() {
        return Err(ReviewError::Empty("request.uid"));
    }
    let kind = &request.kind;
    if (
        kind.group.as_str(),
        kind.version.as_str(),
        kind.kind.as_str(),
    ) != ("", "v1", "Pod")
    {
        return Err(ReviewError::ResourceKind {
            group: kind.group.clone(),
            version: kind.version.clone(),
            kind: kind.kind.clone(),
        });
    }
    if request.operation == Operation::Create && request.object.is_none() {
        return Err(ReviewError::Missing("request.object"));
    }
    // The response takes its apiVersion and kind from here.
    request.types = TypeMeta {
        api_version: envelope.api_version,
        kind: envelope.kind,
    };
    Ok(request)
}

/// The encoded review allowing `request`, with `patch` applied if given.
pub fn allow_response(
    request: &AdmissionRequest,
    patch: Option<json_patch::Patch>,
) -> Result<Vec<u8>, ReviewError> {
    let mut response = AdmissionResponse::from(request);
    if let Some(patch) = patch {
        response = response
            .with_patch(patch)
            .map_err(|e| ReviewError::Response(e.to_string()))?;
    }
    serde_json::to_vec(&response.into_review()).map_err(|e| ReviewError::Response(e.to_string()))
}

/// `request.object.spec.containers[0].name`; a key that is not a plain name in brackets, as
/// label keys hold dots and slashes: `metadata.labels["app.kubernetes.io/name"]`.
fn field_path(path: &serde_path_to_error::Path) -> String {
    let mut out = String::new();
    for segment in path.iter() {
        let name = match segment {
            Segment::Seq { index } => {
                let _ = write!(out, "[{index}]");
                continue;
            }
            Segment::Map { key } => key.as_str(),
            Segment::Enum { variant } => variant.as_str(),
            Segment::Unknown => "?",
        };
        let plain = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '?');
        match (plain, out.is_empty()) {
            (true, true) => out.push_str(name),
            (true, false) => {
                out.push('.');
                out.push_str(name);
            }
            (false, _) => {
                let _ = write!(out, "[{name:?}]");
            }
        }
    }
    if out.is_empty() {
        out.push_str("body");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    use serde_json::{Value, json};

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
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
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
            (
                "array",
                b"[]".to_vec(),
                "body: invalid type: sequence, expected an AdmissionReview object",
            ),
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
                "apiVersion: invalid type: integer `1`, expected a string at line 1 column 15",
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
            (
                "uid missing",
                without("uid"),
                "request: missing field `uid` at line 1 column 374",
            ),
            (
                "uid empty",
                with("uid", json!("")),
                "request.uid must not be empty",
            ),
            (
                "uid number",
                with("uid", json!(5)),
                "request.uid: invalid type: integer `5`, expected a string at line 1 column 299",
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
                "request: missing field `operation` at line 1 column 398",
            ),
            (
                "operation unknown",
                with("operation", json!("PATCH")),
                "request.operation: unknown variant `PATCH`, expected one of `CREATE`, `UPDATE`, `DELETE`, `CONNECT` at line 1 column 233",
            ),
            (
                "operation null",
                with("operation", Value::Null),
                "request.operation: wrong type of value (expected value at line 1 column 227)",
            ),
            (
                "userInfo missing",
                without("userInfo"),
                "request: missing field `userInfo` at line 1 column 337",
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
                "request.dryRun: invalid type: string \"yes\", expected a boolean at line 1 column 86",
            ),
            (
                "container name number",
                object(json!({"spec": {"containers": [{"name": 1}]}})),
                "request.object.spec.containers[0].name: invalid type: integer `1`, expected a string at line 1 column 183",
            ),
            (
                "label value number",
                object(json!({"metadata": {"labels": {"app.kubernetes.io/name": 2}}})),
                "request.object.metadata.labels[\"app.kubernetes.io/name\"]: invalid type: integer `2`, expected a string at line 1 column 200",
            ),
            (
                "object is array",
                object(json!([])),
                "request.object: invalid type: sequence, expected Pod at line 1 column 153",
            ),
            (
                "object kind",
                object(json!({"kind": "Deployment"})),
                "request.object: invalid value: string \"Deployment\", expected Pod at line 1 column 172",
            ),
            (
                "huge integer",
                object(json!({"spec": {"containers": [], "terminationGracePeriodSeconds": 1e30}})),
                "request.object.spec.terminationGracePeriodSeconds: invalid type: floating point `1e+30`, expected i64 at line 1 column 213",
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
        let decoded = decode_review(&review(request)).expect("decodes");
        assert_eq!(decoded.uid, "705ab4f5-6393-11e8-b7cc-42010a800002");
        assert_eq!(decoded.operation, Operation::Create);
        assert_eq!(decoded.namespace.as_deref(), Some("default"));
        assert_eq!(
            (
                decoded.types.api_version.as_str(),
                decoded.types.kind.as_str()
            ),
            (API_VERSION, KIND)
        );
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

        let mut no_group = pod_request(minimal_pod());
        no_group["kind"] = json!({"version": "v1", "kind": "Pod"});
        let err = decode_review(&review(no_group)).expect_err("the apiserver always sends group");
        assert!(
            err.to_string()
                .starts_with("request.kind: missing field `group`"),
            "{err}"
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
        let request = decode_review(&review(pod_request(minimal_pod()))).expect("decodes");
        let patch: json_patch::Patch =
            serde_json::from_value(json!([{"op": "add", "path": "/spec/priority", "value": 1}]))
                .expect("patch");
        for (name, patch, want_patch) in [
            ("unchanged", None, None),
            (
                "patched",
                Some(patch),
                Some(json!([{"op": "add", "path": "/spec/priority", "value": 1}])),
            ),
        ] {
            let got: Value =
                serde_json::from_slice(&allow_response(&request, patch).expect("encodes"))
                    .expect("response is JSON");
            assert_eq!(got["apiVersion"], json!(API_VERSION), "{name}");
            assert_eq!(got["kind"], json!(KIND), "{name}");
            assert_eq!(got.get("request"), None, "{name}");
            let response = &got["response"];
            assert_eq!(response["uid"], json!(request.uid), "{name}");
            assert_eq!(response["allowed"], json!(true), "{name}");
            // kube encodes the patch bytes as a JSON array of numbers, which the apiserver's
            // []byte decoding accepts as well as base64 (the e2e tests go through a real one).
            let sent = response.get("patch").map(|bytes| {
                let bytes: Vec<u8> = serde_json::from_value(bytes.clone()).expect("byte array");
                serde_json::from_slice::<Value>(&bytes).expect("patch is JSON")
            });
            assert_eq!(sent, want_patch, "{name}");
            let patch_type = response.get("patchType").cloned();
            assert_eq!(
                patch_type,
                want_patch.as_ref().map(|_| json!("JSONPatch")),
                "{name}"
            );
        }
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
