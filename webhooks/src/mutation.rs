//! The pod mutating webhook's decision: a pod that will need the scheduler extender (it has a
//! pending volume of this driver) gets the extended resource `<driver>/scheduler: 1` in
//! `containers[0]`, because kube-scheduler consults an extender with `managedResources` only
//! for pods that request one of them.

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation, ReplaceOperation};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Value, json};
use std::collections::BTreeMap;

use crate::admission::Operation;
use controllers::pod_volumes::{VolumeFacts, pending_volumes};
pub use controllers::well_known::{WEBHOOK_OPT_OUT_LABEL as OPT_OUT_LABEL, scheduler_resource};

/// The value of [`OPT_OUT_LABEL`] that opts out.
pub const OPT_OUT_VALUE: &str = "ignore";
/// What an empty `spec.schedulerName` means.
pub const DEFAULT_SCHEDULER: &str = "default-scheduler";
/// The value of the extended resource: one unit marks the pod, the amount means nothing.
pub const MARK: &str = "1";

/// The webhook's settings from the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WebhookPolicy {
    /// The CSI driver name, e.g. `pmem-csi.intel.com`.
    pub driver: String,
    /// `--scheduler-names`: only pods of these schedulers are mutated.
    pub scheduler_names: Vec<String>,
}

/// Why a pod is admitted as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unchanged {
    /// The operation is not CREATE (extended resources of existing pods cannot change).
    NotCreate,
    /// The pod carries the opt-out label.
    OptedOut,
    /// The pod names a scheduler that does not use our extender.
    OtherScheduler,
    /// The pod has no container to carry the resource (validation will reject it anyway).
    NoContainers,
    /// No volume of the pod is pending for this driver.
    NoPendingVolume,
    /// Both requests and limits already carry the mark.
    AlreadyMarked,
}

impl Unchanged {
    /// A stable label value for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Unchanged::NotCreate => "not-create",
            Unchanged::OptedOut => "opted-out",
            Unchanged::OtherScheduler => "other-scheduler",
            Unchanged::NoContainers => "no-containers",
            Unchanged::NoPendingVolume => "no-pending-volume",
            Unchanged::AlreadyMarked => "already-marked",
        }
    }
}

/// What the webhook answers.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Allow as is.
    Unchanged(Unchanged),
    /// Allow with this JSON patch (never empty).
    Patch(Patch),
}

/// The namespace the pod's claims live in: the pod's own, or the request's when the pod has
/// none (the apiserver fills it in only after admission).
pub fn pod_namespace<'a>(pod: &'a Pod, request_namespace: &'a str) -> &'a str {
    pod.metadata
        .namespace
        .as_deref()
        .filter(|ns| !ns.is_empty())
        .unwrap_or(request_namespace)
}

/// The checks that need no claim or class: the shell calls this first and skips the lookups
/// when it returns a reason.
pub fn screen(pod: &Pod, operation: &Operation, policy: &WebhookPolicy) -> Option<Unchanged> {
    if *operation != Operation::Create {
        return Some(Unchanged::NotCreate);
    }
    let opted_out = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|labels| labels.get(OPT_OUT_LABEL))
        .is_some_and(|v| v == OPT_OUT_VALUE);
    if opted_out {
        return Some(Unchanged::OptedOut);
    }
    let spec = pod.spec.as_ref();
    let scheduler = spec
        .and_then(|s| s.scheduler_name.as_deref())
        .filter(|name| !name.is_empty())
        .unwrap_or(DEFAULT_SCHEDULER);
    if !policy.scheduler_names.iter().any(|name| name == scheduler) {
        return Some(Unchanged::OtherScheduler);
    }
    if spec.is_none_or(|s| s.containers.is_empty()) {
        return Some(Unchanged::NoContainers);
    }
    None
}

/// Decides whether and how to mutate `pod`, given what the shell found about its claims and
/// classes.
pub fn decide(
    pod: &Pod,
    operation: &Operation,
    request_namespace: &str,
    policy: &WebhookPolicy,
    facts: &VolumeFacts,
) -> Decision {
    if let Some(reason) = screen(pod, operation, policy) {
        return Decision::Unchanged(reason);
    }
    let namespace = pod_namespace(pod, request_namespace);
    if pending_volumes(pod, namespace, &policy.driver, facts).is_empty() {
        return Decision::Unchanged(Unchanged::NoPendingVolume);
    }
    let resources = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.resources.as_ref());
    let key = scheduler_resource(&policy.driver);
    let ops = match resources {
        None => vec![add(
            pointer([]),
            json!({"requests": {&key: MARK}, "limits": {&key: MARK}}),
        )],
        Some(resources) => [
            ("requests", resources.requests.as_ref()),
            ("limits", resources.limits.as_ref()),
        ]
        .into_iter()
        .filter_map(|(map, entries)| mark(map, entries, &key))
        .collect(),
    };
    if ops.is_empty() {
        Decision::Unchanged(Unchanged::AlreadyMarked)
    } else {
        Decision::Patch(Patch(ops))
    }
}

/// The operation that makes `entries[key]` equal to [`MARK`] in the map `map` of
/// `containers[0].resources`, if any is needed.
fn mark(
    map: &str,
    entries: Option<&BTreeMap<String, Quantity>>,
    key: &str,
) -> Option<PatchOperation> {
    match entries {
        // Go omits empty maps, so the member may be absent even when the pod declared `{}`.
        None => Some(add(pointer([map]), json!({key: MARK}))),
        Some(entries) => match entries.get(key) {
            Some(Quantity(value)) if value == MARK => None,
            Some(_) => Some(PatchOperation::Replace(ReplaceOperation {
                path: pointer([map, key]),
                value: json!(MARK),
            })),
            None => Some(add(pointer([map, key]), json!(MARK))),
        },
    }
}

/// `/spec/containers/0/resources` followed by `tokens`, each escaped as RFC 6901 requires.
fn pointer<const N: usize>(tokens: [&str; N]) -> PointerBuf {
    let mut path = PointerBuf::from_tokens(["spec", "containers", "0", "resources"]);
    for token in tokens {
        path.push_back(token);
    }
    path
}

fn add(path: PointerBuf, value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation { path, value })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::decode_review;
    use controllers::pod_volumes::{
        ClaimFacts, ClaimKey, ClassFacts, claims_to_look_up, classes_to_look_up,
    };
    use controllers::test_objects::json::*;
    use serde_json::json;

    const KEY: &str = "pmem-csi.intel.com/scheduler";

    fn policy() -> WebhookPolicy {
        WebhookPolicy {
            driver: DRIVER.into(),
            scheduler_names: vec![DEFAULT_SCHEDULER.into(), "my-scheduler".into()],
        }
    }

    fn late() -> Option<ClassFacts> {
        Some(ClassFacts {
            provisioner: DRIVER.into(),
            late_binding: true,
            ..ClassFacts::default()
        })
    }

    fn immediate() -> Option<ClassFacts> {
        Some(ClassFacts {
            provisioner: DRIVER.into(),
            late_binding: false,
            ..ClassFacts::default()
        })
    }

    fn other_driver() -> Option<ClassFacts> {
        Some(ClassFacts {
            provisioner: "other.csi".into(),
            late_binding: true,
            ..ClassFacts::default()
        })
    }

    /// Facts for claim `c1` in `ns` and class `pmem`.
    fn facts_for(claim: Option<ClaimFacts>, class: Option<ClassFacts>) -> VolumeFacts {
        VolumeFacts {
            claims: [(ClaimKey::new("ns", "c1"), claim)].into(),
            classes: [("pmem".to_string(), class)].into(),
            default_class: Some(late()),
        }
    }

    fn unbound() -> Option<ClaimFacts> {
        Some(ClaimFacts {
            class: Some("pmem".into()),
            ..ClaimFacts::default()
        })
    }

    fn pvc_pod() -> Pod {
        pod(vec![pvc_volume("data", "c1")])
    }

    /// A PVC pod whose first container has `resources` (JSON) and the given extra changes.
    fn pvc_pod_with(change: impl FnOnce(&mut Value)) -> Pod {
        let mut value = json!({
            "metadata": {"name": "app", "namespace": "ns"},
            "spec": {"containers": [{"name": "c"}, {"name": "sidecar"}],
                     "volumes": [pvc_volume("data", "c1")]},
        });
        change(&mut value);
        pod_json(value)
    }

    /// Applies the decision's patch as the apiserver would, failing on a `replace` of nothing.
    fn apply_patch(doc: &mut Value, decision: &Decision) {
        if let Decision::Patch(patch) = decision {
            json_patch::patch(doc, patch).expect("the patch applies");
        }
    }

    /// The decision's patch as the JSON document the webhook sends.
    fn patch_json(decision: &Decision) -> Option<Value> {
        match decision {
            Decision::Patch(patch) => Some(serde_json::to_value(patch).expect("patch serializes")),
            Decision::Unchanged(_) => None,
        }
    }

    /// Runs `decide`, applies its patch to the pod's JSON and returns the result.
    fn mutate(pod: &Pod, facts: &VolumeFacts) -> (Decision, Value) {
        let decision = decide(pod, &Operation::Create, "ns", &policy(), facts);
        let mut value = serde_json::to_value(pod).expect("pod serializes");
        apply_patch(&mut value, &decision);
        (decision, value)
    }

    fn assert_marked(name: &str, value: &Value) {
        for map in ["requests", "limits"] {
            let entries = &value["spec"]["containers"][0]["resources"][map];
            let marks: Vec<_> = entries
                .as_object()
                .unwrap_or_else(|| panic!("{name}: {map} missing"))
                .iter()
                .filter(|(k, _)| k.as_str() == KEY)
                .map(|(_, v)| v.clone())
                .collect();
            assert_eq!(marks, vec![json!(MARK)], "{name}: {map}");
        }
        assert_eq!(
            value["spec"]["containers"][1].get("resources"),
            None,
            "{name}: other containers untouched"
        );
    }

    #[test]
    fn unchanged_table() {
        let with_label = |value: &str| {
            let mut pod = pvc_pod();
            pod.metadata.labels = Some([(OPT_OUT_LABEL.to_string(), value.to_string())].into());
            pod
        };
        let with_scheduler = |name: &str| {
            let mut pod = pvc_pod();
            if let Some(spec) = pod.spec.as_mut() {
                spec.scheduler_name = Some(name.into());
            }
            pod
        };
        let no_containers = pod_json(json!({
            "metadata": {"name": "app", "namespace": "ns"},
            "spec": {"containers": [], "volumes": [pvc_volume("data", "c1")]},
        }));
        let good = facts_for(unbound(), late());
        let bound = Some(ClaimFacts {
            volume_name: Some("pv".into()),
            ..unbound().expect("claim")
        });
        for (name, pod, operation, facts, want) in [
            (
                "UPDATE",
                pvc_pod(),
                Operation::Update,
                good.clone(),
                Unchanged::NotCreate,
            ),
            (
                "DELETE",
                pvc_pod(),
                Operation::Delete,
                good.clone(),
                Unchanged::NotCreate,
            ),
            (
                "opted out",
                with_label("ignore"),
                Operation::Create,
                good.clone(),
                Unchanged::OptedOut,
            ),
            (
                "other scheduler",
                with_scheduler("volcano"),
                Operation::Create,
                good.clone(),
                Unchanged::OtherScheduler,
            ),
            (
                "no containers",
                no_containers,
                Operation::Create,
                good.clone(),
                Unchanged::NoContainers,
            ),
            (
                "no volumes",
                pod(vec![]),
                Operation::Create,
                good.clone(),
                Unchanged::NoPendingVolume,
            ),
            (
                "only another driver's PVC",
                pvc_pod(),
                Operation::Create,
                facts_for(unbound(), other_driver()),
                Unchanged::NoPendingVolume,
            ),
            (
                "already bound PVC only",
                pvc_pod(),
                Operation::Create,
                facts_for(bound, late()),
                Unchanged::NoPendingVolume,
            ),
            (
                "Immediate class",
                pvc_pod(),
                Operation::Create,
                facts_for(unbound(), immediate()),
                Unchanged::NoPendingVolume,
            ),
            (
                "missing claim",
                pvc_pod(),
                Operation::Create,
                facts_for(None, late()),
                Unchanged::NoPendingVolume,
            ),
            (
                "class and annotation missing",
                pvc_pod(),
                Operation::Create,
                facts_for(unbound(), None),
                Unchanged::NoPendingVolume,
            ),
            (
                "inline of another driver",
                pod(vec![inline_volume("i", "other.csi", None)]),
                Operation::Create,
                good.clone(),
                Unchanged::NoPendingVolume,
            ),
            (
                "emptyDir",
                pod(vec![json!({"name": "e", "emptyDir": {}})]),
                Operation::Create,
                good.clone(),
                Unchanged::NoPendingVolume,
            ),
            (
                "ephemeral, no default class",
                pod(vec![ephemeral_volume("t", None, None)]),
                Operation::Create,
                VolumeFacts {
                    default_class: Some(None),
                    ..good.clone()
                },
                Unchanged::NoPendingVolume,
            ),
            (
                "already marked",
                pvc_pod_with(|v| {
                    v["spec"]["containers"][0]["resources"] =
                        json!({"requests": {KEY: "1"}, "limits": {KEY: "1"}})
                }),
                Operation::Create,
                good.clone(),
                Unchanged::AlreadyMarked,
            ),
        ] {
            assert_eq!(
                decide(&pod, &operation, "ns", &policy(), &facts),
                Decision::Unchanged(want),
                "{name}"
            );
        }
    }

    #[test]
    fn patched_table() {
        let good = facts_for(unbound(), late());
        let annotated = Some(ClaimFacts {
            provisioner_annotation: Some(DRIVER.into()),
            ..unbound().expect("claim")
        });
        let resources =
            |r: Value| pvc_pod_with(move |v| v["spec"]["containers"][0]["resources"] = r);
        let mut labelled = pvc_pod();
        labelled.metadata.labels = Some([(OPT_OUT_LABEL.to_string(), "no".to_string())].into());
        for (name, pod, facts, ops) in [
            ("resources absent", pvc_pod_with(|_| {}), good.clone(), 1),
            ("resources empty", resources(json!({})), good.clone(), 2),
            (
                "requests present",
                resources(json!({"requests": {"cpu": "1"}})),
                good.clone(),
                2,
            ),
            (
                "limits present",
                resources(json!({"limits": {"memory": "1Gi"}})),
                good.clone(),
                2,
            ),
            (
                "requests already set",
                resources(json!({"requests": {KEY: "1"}})),
                good.clone(),
                1,
            ),
            (
                "both set to another value",
                resources(json!({"requests": {KEY: "2"}, "limits": {KEY: "2"}})),
                good.clone(),
                2,
            ),
            (
                "class missing, annotation names us",
                pvc_pod(),
                facts_for(annotated, None),
                1,
            ),
            (
                "inline volume of ours",
                pod(vec![inline_volume("i", DRIVER, Some("1Gi"))]),
                VolumeFacts::default(),
                1,
            ),
            (
                "ephemeral with default class",
                pod(vec![ephemeral_volume("t", None, Some("1Gi"))]),
                good.clone(),
                1,
            ),
            (
                "opt-out label with another value",
                labelled,
                good.clone(),
                1,
            ),
            (
                "named scheduler in the list",
                {
                    let mut pod = pvc_pod();
                    if let Some(spec) = pod.spec.as_mut() {
                        spec.scheduler_name = Some("my-scheduler".into());
                    }
                    pod
                },
                good.clone(),
                1,
            ),
        ] {
            let (decision, value) = mutate(&pod, &facts);
            match &decision {
                Decision::Patch(got) => assert_eq!(got.len(), ops, "{name}: {got:?}"),
                other => panic!("{name}: {other:?}"),
            }
            assert_marked(name, &value);
        }
    }

    #[test]
    fn keeps_other_resources() {
        let pod = pvc_pod_with(|v| {
            v["spec"]["containers"][0]["resources"] =
                json!({"requests": {"cpu": "100m", KEY: "3"}, "limits": {"memory": "1Gi"}})
        });
        let (_, value) = mutate(&pod, &facts_for(unbound(), late()));
        assert_eq!(
            value["spec"]["containers"][0]["resources"],
            json!({"requests": {"cpu": "100m", KEY: "1"}, "limits": {"memory": "1Gi", KEY: "1"}})
        );
    }

    #[test]
    fn patch_paths_are_escaped() {
        let pod =
            pvc_pod_with(|v| v["spec"]["containers"][0]["resources"] = json!({"requests": {}}));
        let decision = decide(
            &pod,
            &Operation::Create,
            "ns",
            &policy(),
            &facts_for(unbound(), late()),
        );
        assert_eq!(
            patch_json(&decision),
            Some(json!([
                {"op": "add", "path": "/spec/containers/0/resources/requests/pmem-csi.intel.com~1scheduler", "value": "1"},
                {"op": "add", "path": "/spec/containers/0/resources/limits", "value": {KEY: "1"}},
            ]))
        );
        assert_eq!(
            pointer(["a~b/c"]).as_str(),
            "/spec/containers/0/resources/a~0b~1c"
        );
    }

    #[test]
    fn empty_pod_namespace_uses_request_namespace() {
        let mut pod = pvc_pod();
        pod.metadata.namespace = None;
        let facts = facts_for(unbound(), late());
        for (request_namespace, patched) in [("ns", true), ("elsewhere", false)] {
            let decision = decide(
                &pod,
                &Operation::Create,
                request_namespace,
                &policy(),
                &facts,
            );
            assert_eq!(
                matches!(decision, Decision::Patch(_)),
                patched,
                "{request_namespace}"
            );
        }
        pod.metadata.namespace = Some(String::new());
        assert_eq!(pod_namespace(&pod, "req"), "req");
        pod.metadata.namespace = Some("own".into());
        assert_eq!(pod_namespace(&pod, "req"), "own");
    }

    #[test]
    fn empty_scheduler_name_is_default() {
        let mut pod = pvc_pod();
        if let Some(spec) = pod.spec.as_mut() {
            spec.scheduler_name = Some(String::new());
        }
        let only_default = WebhookPolicy {
            scheduler_names: vec![DEFAULT_SCHEDULER.into()],
            ..policy()
        };
        assert_eq!(screen(&pod, &Operation::Create, &only_default), None);
        let only_custom = WebhookPolicy {
            scheduler_names: vec!["my-scheduler".into()],
            ..policy()
        };
        assert_eq!(
            screen(&pod, &Operation::Create, &only_custom),
            Some(Unchanged::OtherScheduler)
        );
    }

    /// The good reviews end to end: decode, look up from a fake cluster, decide, patch.
    #[test]
    fn good_reviews_end_to_end() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/webhook/good");
        let claim = claim(
            "pmem-csi-pvc-late-binding",
            Some("pmem-csi-sc-late-binding"),
            None,
            None,
            Some("4Gi"),
        );
        for (file, want_patch) in [
            ("pod-with-pvc.json", true),
            ("pod-with-inline-volume.json", true),
            ("pod-with-ephemeral-volume.json", true),
            ("update-pod.json", false),
            ("pod-zero-containers.json", false),
        ] {
            let body = std::fs::read(dir.join(file)).expect("readable");
            let request = decode_review(&body).expect("decodes");
            let pod = request.object.expect("object");
            let request_namespace = request.namespace.as_deref().unwrap_or_default();
            let namespace = pod_namespace(&pod, request_namespace).to_string();
            let mut facts = VolumeFacts::default();
            for key in claims_to_look_up(&pod, &namespace) {
                let found =
                    (key.name == "pmem-csi-pvc-late-binding").then(|| ClaimFacts::from(&claim));
                facts.claims.insert(key, found);
            }
            let classes = classes_to_look_up(&pod, &namespace, &facts);
            for name in classes.names {
                let found = (name == "pmem-csi-sc-late-binding").then(late).flatten();
                facts.classes.insert(name, found);
            }
            if classes.default_class {
                facts.default_class = Some(None);
            }
            let decision = decide(
                &pod,
                &request.operation,
                request_namespace,
                &policy(),
                &facts,
            );
            assert_eq!(
                matches!(decision, Decision::Patch(_)),
                want_patch,
                "{file}: {decision:?}"
            );
            if want_patch {
                let mut value = serde_json::to_value(&pod).expect("serializes");
                apply_patch(&mut value, &decision);
                assert_marked(file, &value);
            }
        }
    }

    #[test]
    fn unchanged_reasons_have_distinct_labels() {
        let all = [
            Unchanged::NotCreate,
            Unchanged::OptedOut,
            Unchanged::OtherScheduler,
            Unchanged::NoContainers,
            Unchanged::NoPendingVolume,
            Unchanged::AlreadyMarked,
        ];
        let labels: std::collections::BTreeSet<_> = all.iter().map(|u| u.as_str()).collect();
        assert_eq!(labels.len(), all.len());
    }
}
