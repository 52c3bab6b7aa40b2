//! Least privilege, measured: testenv runs the API server with a Metadata-level audit policy for
//! our ServiceAccounts; [`usage`] reads back which (verb, resource) pairs each one used, and
//! [`unused_grants`] lists the granted pairs nobody used. Pure functions over the audit log and
//! the rendered RBAC; the test that judges them is `tests/least_privilege.rs`.

use std::collections::{BTreeMap, BTreeSet};

use serde::Deserialize;
use serde_yaml::Value;

use crate::manifests::Rendered;

/// Where each test binary's API server writes its audit log (one file per testenv), when set.
pub const AUDIT_DIR_ENV: &str = "PMEM_CSI_AUDIT_DIR";

/// The audit policy: request metadata of the ServiceAccounts in `namespaces`, nothing else.
pub fn policy(namespaces: &[&str]) -> String {
    let groups = namespaces
        .iter()
        .map(|n| format!("\"system:serviceaccounts:{n}\""))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "apiVersion: audit.k8s.io/v1\n\
         kind: Policy\n\
         omitStages: [RequestReceived]\n\
         rules:\n\
         - level: Metadata\n  userGroups: [{groups}]\n\
         - level: None\n"
    )
}

/// One audited request, reduced to what RBAC decides on.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Request {
    /// `system:serviceaccount:<ns>:<name>`.
    pub user: String,
    /// API verb (`get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, …).
    pub verb: String,
    /// API group (`""` for core).
    pub group: String,
    /// Resource, with `/subresource` when there is one.
    pub resource: String,
    /// Object name, when the request names one.
    pub name: String,
    /// The object's namespace (empty for cluster-scoped objects and cluster-wide lists).
    pub namespace: String,
    /// The authorizer's decision (`allow`, `forbid`), when recorded.
    pub decision: String,
    /// HTTP status code of the response.
    pub code: u16,
}

#[derive(Deserialize)]
struct RawEvent {
    #[serde(default)]
    verb: String,
    #[serde(default)]
    user: RawUser,
    #[serde(default, rename = "objectRef")]
    object_ref: Option<RawObjectRef>,
    #[serde(default, rename = "responseStatus")]
    response_status: Option<RawStatus>,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
    #[serde(default, rename = "requestURI")]
    request_uri: String,
}

#[derive(Default, Deserialize)]
struct RawUser {
    #[serde(default)]
    username: String,
}

#[derive(Deserialize)]
struct RawObjectRef {
    #[serde(default)]
    resource: String,
    #[serde(default)]
    subresource: String,
    #[serde(default, rename = "apiGroup")]
    api_group: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: String,
}

#[derive(Deserialize)]
struct RawStatus {
    #[serde(default)]
    code: u16,
}

/// Parses a JSON-lines audit log. Requests without an object (discovery, `/version`) keep
/// their URI as the resource so denials of them are still seen. Unreadable lines are returned
/// as errors (a truncated last line of a killed API server is one).
pub fn parse_log(text: &str) -> (Vec<Request>, Vec<String>) {
    let mut requests = Vec::new();
    let mut errors = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str::<RawEvent>(line) {
            Ok(event) => {
                let (group, resource, name, namespace) = match event.object_ref {
                    Some(o) => {
                        let resource = if o.subresource.is_empty() {
                            o.resource
                        } else {
                            format!("{}/{}", o.resource, o.subresource)
                        };
                        (o.api_group, resource, o.name, o.namespace)
                    }
                    None => (
                        String::new(),
                        event.request_uri,
                        String::new(),
                        String::new(),
                    ),
                };
                requests.push(Request {
                    user: event.user.username,
                    verb: event.verb,
                    group,
                    resource,
                    name,
                    namespace,
                    decision: event
                        .annotations
                        .get("authorization.k8s.io/decision")
                        .cloned()
                        .unwrap_or_default(),
                    code: event.response_status.map_or(0, |s| s.code),
                });
            }
            Err(e) => errors.push(format!("{e}: {}", truncate(line))),
        }
    }
    (requests, errors)
}

fn truncate(line: &str) -> &str {
    line.get(..200).unwrap_or(line)
}

/// One (verb, group, resource) a ServiceAccount may use, with the names it is limited to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Grant {
    /// Verb.
    pub verb: String,
    /// API group.
    pub group: String,
    /// Resource (with `/subresource`).
    pub resource: String,
    /// `resourceNames` of the rule (empty: any).
    pub names: Vec<String>,
    /// The Role or ClusterRole granting it (`ClusterRole/x`).
    pub role: String,
}

impl Grant {
    /// Whether `request` is covered by this grant.
    pub fn covers(&self, request: &Request) -> bool {
        (self.verb == "*" || self.verb == request.verb)
            && (self.group == "*" || self.group == request.group)
            && (self.resource == "*" || self.resource == request.resource)
            && (self.names.is_empty() || self.names.contains(&request.name))
    }

    /// `verb group/resource` as the RBAC table of docs/install-and-operate.md writes it.
    pub fn pair(&self) -> String {
        let group = if self.group.is_empty() {
            "core"
        } else {
            &self.group
        };
        format!("{} {}/{}", self.verb, group, self.resource)
    }
}

/// The audit user name of ServiceAccount `namespace/name`.
pub fn service_account_user(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}

/// Every (verb, group, resource) the rendered RBAC grants to ServiceAccount
/// `namespace/name`, one [`Grant`] per combination.
pub fn grants(rendered: &Rendered, namespace: &str, name: &str) -> Vec<Grant> {
    let mut out = BTreeSet::new();
    for binding in rendered.of_kinds(&["RoleBinding", "ClusterRoleBinding"]) {
        let binds_us = binding["subjects"]
            .as_sequence()
            .into_iter()
            .flatten()
            .any(|s| {
                s["kind"].as_str() == Some("ServiceAccount")
                    && s["name"].as_str() == Some(name)
                    && s["namespace"].as_str() == Some(namespace)
            });
        if !binds_us {
            continue;
        }
        let role_kind = binding["roleRef"]["kind"].as_str().unwrap_or_default();
        let role_name = binding["roleRef"]["name"].as_str().unwrap_or_default();
        let role = rendered.objects().iter().find(|o| {
            o["kind"].as_str() == Some(role_kind)
                && o["metadata"]["name"].as_str() == Some(role_name)
                && (role_kind == "ClusterRole"
                    || o["metadata"]["namespace"] == binding["metadata"]["namespace"])
        });
        let Some(role) = role else { continue };
        for rule in role["rules"].as_sequence().into_iter().flatten() {
            let list = |v: &Value| -> Vec<String> {
                v.as_sequence()
                    .into_iter()
                    .flatten()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            };
            let names = list(&rule["resourceNames"]);
            for verb in list(&rule["verbs"]) {
                for group in list(&rule["apiGroups"]) {
                    for resource in list(&rule["resources"]) {
                        out.insert(Grant {
                            verb: verb.clone(),
                            group: group.clone(),
                            resource,
                            names: names.clone(),
                            role: format!("{role_kind}/{role_name}"),
                        });
                    }
                }
            }
        }
    }
    out.into_iter().collect()
}

/// The grants no request of `user` used.
pub fn unused_grants<'a>(grants: &'a [Grant], requests: &[Request], user: &str) -> Vec<&'a Grant> {
    grants
        .iter()
        .filter(|g| !requests.iter().any(|r| r.user == user && g.covers(r)))
        .collect()
}

/// Requests the authorizer refused (decision `forbid`). A 403 that RBAC allowed (an Event into
/// a namespace being deleted) is not a denial.
pub fn denials<'a>(requests: &'a [Request], user: &str) -> Vec<&'a Request> {
    requests
        .iter()
        .filter(|r| r.user == user && r.decision == "forbid")
        .collect()
}

/// The distinct `verb group/resource` pairs `user` used, for the RBAC table of docs/install-and-operate.md.
pub fn used_pairs(requests: &[Request], user: &str) -> BTreeSet<String> {
    requests
        .iter()
        .filter(|r| r.user == user && !r.resource.starts_with('/'))
        .map(|r| {
            let group = if r.group.is_empty() { "core" } else { &r.group };
            format!("{} {}/{}", r.verb, group, r.resource)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = r#"{"verb":"watch","user":{"username":"system:serviceaccount:pmem-csi:node"},"objectRef":{"resource":"persistentvolumes","apiGroup":""},"responseStatus":{"code":200},"annotations":{"authorization.k8s.io/decision":"allow"}}
{"verb":"update","user":{"username":"system:serviceaccount:pmem-csi:node"},"objectRef":{"resource":"leases","apiGroup":"coordination.k8s.io","name":"hb-node-1","namespace":"pmem-csi"},"responseStatus":{"code":200}}
{"verb":"get","user":{"username":"system:serviceaccount:pmem-csi:node"},"objectRef":{"resource":"secrets","name":"x"},"responseStatus":{"code":403},"annotations":{"authorization.k8s.io/decision":"forbid"}}
{"verb":"patch","user":{"username":"system:serviceaccount:pmem-csi:node"},"objectRef":{"resource":"pods","subresource":"status"},"responseStatus":{"code":200}}
{"verb":"get","user":{"username":"system:serviceaccount:pmem-csi:node"},"requestURI":"/version","responseStatus":{"code":200}}
{"verb":"create","user":{"username":"system:serviceaccount:pmem-csi:node"},"objectRef":{"resource":"events","namespace":"gone"},"responseStatus":{"code":403},"annotations":{"authorization.k8s.io/decision":"allow"}}
{"verb":"get","user":{"username":"admin"},"objectRef":{"resource":"nodes"}}
{"verb":"li"#;

    const RBAC: &str = r#"
kind: ClusterRole
metadata: {name: node-runner}
rules:
- apiGroups: [""]
  resources: [persistentvolumes]
  verbs: [get, watch]
- apiGroups: [""]
  resources: [pods/status]
  verbs: [patch]
---
kind: Role
metadata: {name: node-cfg, namespace: pmem-csi}
rules:
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  resourceNames: [hb-node-1]
  verbs: [update]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  resourceNames: [other]
  verbs: [update]
---
kind: Role
metadata: {name: node-cfg, namespace: elsewhere}
rules:
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
---
kind: ClusterRoleBinding
metadata: {name: node-runner}
roleRef: {kind: ClusterRole, name: node-runner}
subjects: [{kind: ServiceAccount, name: node, namespace: pmem-csi}]
---
kind: RoleBinding
metadata: {name: node-cfg, namespace: pmem-csi}
roleRef: {kind: Role, name: node-cfg}
subjects: [{kind: ServiceAccount, name: node, namespace: pmem-csi}]
---
kind: ClusterRoleBinding
metadata: {name: other}
roleRef: {kind: ClusterRole, name: node-runner}
subjects: [{kind: ServiceAccount, name: controller, namespace: pmem-csi}]
"#;

    #[test]
    fn log_is_parsed_and_truncation_reported() {
        let (requests, errors) = parse_log(LOG);
        assert_eq!(requests.len(), 7);
        assert_eq!(errors.len(), 1, "the truncated last line");
        assert_eq!(requests[3].resource, "pods/status");
        assert_eq!(requests[4].resource, "/version");
        assert_eq!(requests[1].name, "hb-node-1");
        assert_eq!(requests[1].namespace, "pmem-csi");
        assert_eq!(requests[4].namespace, "");
    }

    #[test]
    fn unused_and_denied() {
        let (requests, _) = parse_log(LOG);
        let rendered = Rendered::from_yaml(RBAC).expect("rbac");
        let user = service_account_user("pmem-csi", "node");
        let granted = grants(&rendered, "pmem-csi", "node");
        let pairs: Vec<String> = granted.iter().map(Grant::pair).collect();
        assert_eq!(
            pairs,
            vec![
                "get core/persistentvolumes",
                "patch core/pods/status",
                "update coordination.k8s.io/leases",
                "update coordination.k8s.io/leases",
                "watch core/persistentvolumes",
            ]
        );
        let unused: Vec<String> = unused_grants(&granted, &requests, &user)
            .iter()
            .map(|g| format!("{} {:?}", g.pair(), g.names))
            .collect();
        assert_eq!(
            unused,
            vec![
                "get core/persistentvolumes []",
                "update coordination.k8s.io/leases [\"other\"]"
            ]
        );
        let denied = denials(&requests, &user);
        assert_eq!(denied.len(), 1);
        assert_eq!(denied[0].resource, "secrets");
        assert!(denials(&requests, "admin").is_empty());
        assert!(used_pairs(&requests, &user).contains("watch core/persistentvolumes"));
        assert!(
            !used_pairs(&requests, &user)
                .iter()
                .any(|p| p.contains("version"))
        );
        assert!(grants(&rendered, "pmem-csi", "nobody").is_empty());
    }
}
