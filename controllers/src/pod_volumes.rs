//! Which volumes of a pod are pending PMEM demand of this driver, and how large each is.
//!
//! Shared by the pod mutating webhook (is the pod relevant at all?) and the scheduler extender
//! (how much must fit on a node?). Sans-IO: [`gather`] asks a [`Lookup`] for the claims of
//! [`claims_to_look_up`], then for the classes of [`classes_to_look_up`] and the default class,
//! into [`VolumeFacts`]; [`pending_volumes`] decides from them. The webhook's lookup reads its
//! caches and GETs misses under one deadline, the bypass reporting's reads the caches alone,
//! the extender's its index; whatever is still unknown counts as missing.

use std::collections::{BTreeMap, BTreeSet};

use crate::volume_facts::{
    Binding, is_ours, positive_bytes, provisioner_annotation, storage_request,
};
pub use crate::volume_facts::{ClaimFacts, ClaimKey, ClassFacts};
use crate::well_known::INLINE_SIZE;
use k8s_openapi::api::core::v1::{Pod, Volume};

/// Where [`gather`] finds claims and classes: a cache, an index, the apiserver. Batches, so
/// that a lookup over the network can ask for all misses at once.
pub trait Lookup {
    /// The claims `keys` (each asked once), each `None` when not found.
    fn claims(
        &self,
        keys: Vec<ClaimKey>,
    ) -> impl Future<Output = Vec<(ClaimKey, Option<ClaimFacts>)>> + Send;
    /// The classes `names` (each asked once), each `None` when not found.
    fn classes(
        &self,
        names: Vec<String>,
    ) -> impl Future<Output = Vec<(String, Option<ClassFacts>)>> + Send;
    /// The cluster's default class, `None` when there is none.
    fn default_class(&self) -> impl Future<Output = Option<ClassFacts>> + Send;
}

/// The facts about `pod`'s volumes that [`pending_volumes`] needs, from `lookup`: its claims,
/// the classes of its unbound claims and of the templates whose claims do not exist yet, and
/// the default class when a template names none.
pub async fn gather(pod: &Pod, namespace: &str, lookup: &impl Lookup) -> VolumeFacts {
    let mut facts = VolumeFacts::default();
    let claims = claims_to_look_up(pod, namespace);
    if !claims.is_empty() {
        facts.claims.extend(lookup.claims(claims).await);
    }
    let lookups = classes_to_look_up(pod, namespace, &facts);
    if !lookups.names.is_empty() {
        facts.classes.extend(lookup.classes(lookups.names).await);
    }
    if lookups.default_class {
        facts.default_class = Some(lookup.default_class().await);
    }
    facts
}

/// [`gather`] from a lookup that answers at once (a cache or an index), from synchronous code:
/// its futures are ready when first polled, so this never waits. (A lookup that had to wait
/// would block the thread here, never answer from half the facts.)
pub fn gather_now(pod: &Pod, namespace: &str, lookup: &impl Lookup) -> VolumeFacts {
    futures::executor::block_on(gather(pod, namespace, lookup))
}

/// Everything the shell looked up for one pod. An absent map entry and a `None` entry both
/// mean "missing"; keeping `None` lets the shell remember a failed GET.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeFacts {
    /// Claims by key; `None` when not found.
    pub claims: BTreeMap<ClaimKey, Option<ClaimFacts>>,
    /// StorageClasses by name; `None` when not found.
    pub classes: BTreeMap<String, Option<ClassFacts>>,
    /// The cluster's default class: `None` when not looked up, `Some(None)` when there is none.
    pub default_class: Option<Option<ClassFacts>>,
}

/// The StorageClasses the second lookup step needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClassLookups {
    /// Class names, each once, sorted.
    pub names: Vec<String>,
    /// Whether a claim template without a class needs the cluster's default class.
    pub default_class: bool,
}

impl ClassLookups {
    /// Nothing to look up.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty() && !self.default_class
    }
}

/// Where a pending volume comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VolumeSource {
    /// A PersistentVolumeClaim the pod names.
    Claim(ClaimKey),
    /// A generic ephemeral volume; the key is the claim the ephemeral controller creates for it.
    Ephemeral(ClaimKey),
    /// A CSI inline volume of this driver; it exists only in the pod.
    Inline,
}

/// One volume of a pod that this driver still has to provision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingVolume {
    /// The volume's name in `spec.volumes`.
    pub volume: String,
    /// Where it comes from.
    pub source: VolumeSource,
    /// Requested bytes; `None` when absent, zero or unparseable (the caller picks a default).
    pub size: Option<u64>,
}

/// How the extender identifies one entry of a pod's demand across requests (and in its
/// reservation journal: `{"kind": "claim", "namespace", "name"}` or
/// `{"kind": "inline", "pod_uid", "volume"}`).
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum DemandKey {
    /// A claim (named or ephemeral): its reservation ends when the claim shows a selected node.
    Claim(ClaimKey),
    /// An inline volume: it has no object of its own, so the pod's uid scopes it.
    Inline {
        /// `metadata.uid` of the pod.
        pod_uid: String,
        /// The volume's name in `spec.volumes`.
        volume: String,
    },
}

impl PendingVolume {
    /// The key under which the extender books this volume for the pod with `pod_uid`.
    pub fn key(&self, pod_uid: &str) -> DemandKey {
        match &self.source {
            VolumeSource::Claim(key) | VolumeSource::Ephemeral(key) => {
                DemandKey::Claim(key.clone())
            }
            VolumeSource::Inline => DemandKey::Inline {
                pod_uid: pod_uid.to_string(),
                volume: self.volume.clone(),
            },
        }
    }
}

/// The name of the claim the ephemeral volume controller creates for `volume` of `pod_name`.
pub fn ephemeral_claim_name(pod_name: &str, volume: &str) -> String {
    format!("{pod_name}-{volume}")
}

/// Step 1: the claims the pod refers to, each once, in volume order. Ephemeral claims are
/// included only when the pod has a name: at CREATE with `generateName` the claim cannot exist.
pub fn claims_to_look_up(pod: &Pod, namespace: &str) -> Vec<ClaimKey> {
    let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
    let mut seen = BTreeSet::new();
    volumes(pod)
        .iter()
        .filter_map(|volume| match classify(volume) {
            Kind::Claim(name) => Some(ClaimKey::new(namespace, name)),
            Kind::Ephemeral if !pod_name.is_empty() => Some(ClaimKey::new(
                namespace,
                ephemeral_claim_name(pod_name, &volume.name),
            )),
            _ => None,
        })
        .filter(|key| seen.insert(key.clone()))
        .collect()
}

/// Of [`claims_to_look_up`], those worth a GET when the cache misses them: the claims the pod
/// names. A generic ephemeral volume's claim is created by the ephemeral volume controller only
/// after the pod exists, so at the pod's admission it is never there to fetch.
pub fn claims_to_fetch(pod: &Pod, namespace: &str) -> BTreeSet<ClaimKey> {
    volumes(pod)
        .iter()
        .filter_map(|volume| match classify(volume) {
            Kind::Claim(name) => Some(ClaimKey::new(namespace, name)),
            _ => None,
        })
        .collect()
}

/// Step 2: the classes named by the pod's unbound claims (as found in `facts`) and by the
/// templates of ephemeral volumes whose claim does not exist yet, minus those already in
/// `facts`; and whether the default class is needed and not yet known.
pub fn classes_to_look_up(pod: &Pod, namespace: &str, facts: &VolumeFacts) -> ClassLookups {
    let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
    let mut names = BTreeSet::new();
    let mut default_class = false;
    for volume in volumes(pod) {
        match classify(volume) {
            Kind::Claim(name) => {
                if let Some(class) = claim_facts(facts, namespace, name)
                    .filter(|c| !c.bound())
                    .and_then(|c| c.class.as_deref())
                {
                    names.insert(class.to_string());
                }
            }
            Kind::Ephemeral => {
                let claim_name = ephemeral_claim_name(pod_name, &volume.name);
                match (!pod_name.is_empty())
                    .then(|| claim_facts(facts, namespace, &claim_name))
                    .flatten()
                {
                    Some(claim) => {
                        if let Some(class) = claim.class.as_deref().filter(|_| !claim.bound()) {
                            names.insert(class.to_string());
                        }
                    }
                    None => match template_class_name(volume) {
                        TemplateClass::Named(class) => {
                            names.insert(class.to_string());
                        }
                        TemplateClass::Default => default_class = true,
                        TemplateClass::None => {}
                    },
                }
            }
            Kind::Inline(_) | Kind::Other => {}
        }
    }
    ClassLookups {
        names: names
            .into_iter()
            .filter(|name| !facts.classes.contains_key(name))
            .collect(),
        default_class: default_class && facts.default_class.is_none(),
    }
}

/// The pod's volumes that this driver still has to provision, in volume order, each claim once.
/// `namespace` is the pod's (the webhook substitutes the request's when the pod has none).
pub fn pending_volumes(
    pod: &Pod,
    namespace: &str,
    driver: &str,
    facts: &VolumeFacts,
) -> Vec<PendingVolume> {
    let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
    let mut seen = BTreeSet::new();
    let mut pending = Vec::new();
    for volume in volumes(pod) {
        let found = match classify(volume) {
            Kind::Claim(name) => claim_facts(facts, namespace, name)
                .filter(|claim| claim_is_ours(claim, driver, facts))
                .map(|claim| {
                    (
                        VolumeSource::Claim(ClaimKey::new(namespace, name)),
                        claim.request,
                    )
                }),
            Kind::Ephemeral => {
                let key = ClaimKey::new(namespace, ephemeral_claim_name(pod_name, &volume.name));
                // Once the claim exists it is the truth: its class was resolved when it was
                // created, and a bound one needs nothing more.
                let existing = (!pod_name.is_empty())
                    .then(|| claim_facts(facts, &key.namespace, &key.name))
                    .flatten();
                match existing {
                    Some(claim) => claim_is_ours(claim, driver, facts).then_some(claim.request),
                    None => template_is_ours(volume, driver, facts).then(|| template_size(volume)),
                }
                .map(|size| (VolumeSource::Ephemeral(key), size))
            }
            Kind::Inline(csi) => (csi.driver == driver).then(|| {
                let size = csi
                    .volume_attributes
                    .as_ref()
                    .and_then(|attrs| attrs.get(INLINE_SIZE))
                    .and_then(|text| positive_bytes(text));
                (VolumeSource::Inline, size)
            }),
            Kind::Other => None,
        };
        let Some((source, size)) = found else {
            continue;
        };
        if let VolumeSource::Claim(key) | VolumeSource::Ephemeral(key) = &source
            && !seen.insert(key.clone())
        {
            continue;
        }
        pending.push(PendingVolume {
            volume: volume.name.clone(),
            source,
            size,
        });
    }
    pending
}

/// Something a pod's volumes name that the looked-up facts lack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unseen {
    /// A claim the pod names.
    Claim(ClaimKey),
    /// The class of an unbound claim the pod names.
    Class(String),
}

impl std::fmt::Display for Unseen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unseen::Claim(key) => write!(f, "PersistentVolumeClaim {}/{}", key.namespace, key.name),
            Unseen::Class(name) => write!(f, "StorageClass {name}"),
        }
    }
}

/// The first claim, or class of an unbound claim, that the pod names and `facts` lack.
/// [`pending_volumes`] reads a missing one as "not ours"; a caller whose facts come from
/// watches alone must not, when its asker has seen them (kube-scheduler calls its extenders
/// only after its own volume binding found every claim and class). Generic ephemeral volumes
/// are not listed: their template stands in for a claim not seen yet.
pub fn first_unseen(pod: &Pod, namespace: &str, facts: &VolumeFacts) -> Option<Unseen> {
    volumes(pod).iter().find_map(|volume| {
        let Kind::Claim(name) = classify(volume) else {
            return None;
        };
        let Some(claim) = claim_facts(facts, namespace, name) else {
            return Some(Unseen::Claim(ClaimKey::new(namespace, name)));
        };
        let class = claim.class.as_ref().filter(|_| !claim.bound())?;
        let known = facts.classes.get(class).is_some_and(Option::is_some);
        (!known).then(|| Unseen::Class(class.clone()))
    })
}

enum Kind<'a> {
    Claim(&'a str),
    Ephemeral,
    Inline(&'a k8s_openapi::api::core::v1::CSIVolumeSource),
    Other,
}

fn classify(volume: &Volume) -> Kind<'_> {
    if let Some(claim) = volume
        .persistent_volume_claim
        .as_ref()
        .filter(|c| !c.claim_name.is_empty())
    {
        Kind::Claim(&claim.claim_name)
    } else if volume
        .ephemeral
        .as_ref()
        .is_some_and(|e| e.volume_claim_template.is_some())
    {
        Kind::Ephemeral
    } else if let Some(csi) = volume.csi.as_ref() {
        Kind::Inline(csi)
    } else {
        Kind::Other
    }
}

fn volumes(pod: &Pod) -> &[Volume] {
    pod.spec
        .as_ref()
        .and_then(|spec| spec.volumes.as_deref())
        .unwrap_or_default()
}

fn claim_facts<'a>(facts: &'a VolumeFacts, namespace: &str, name: &str) -> Option<&'a ClaimFacts> {
    facts
        .claims
        .get(&ClaimKey::new(namespace, name))
        .and_then(Option::as_ref)
}

fn claim_is_ours(claim: &ClaimFacts, driver: &str, facts: &VolumeFacts) -> bool {
    if claim.bound() {
        return false;
    }
    let class = claim
        .class
        .as_ref()
        .and_then(|name| facts.classes.get(name))
        .and_then(Option::as_ref);
    is_ours(
        class,
        claim.provisioner_annotation.as_deref(),
        driver,
        Binding::Late,
    )
}

enum TemplateClass<'a> {
    Named(&'a str),
    Default,
    None,
}

fn template_class_name(volume: &Volume) -> TemplateClass<'_> {
    let spec = volume
        .ephemeral
        .as_ref()
        .and_then(|e| e.volume_claim_template.as_ref())
        .map(|t| &t.spec);
    match spec.and_then(|s| s.storage_class_name.as_deref()) {
        None => TemplateClass::Default,
        Some("") => TemplateClass::None,
        Some(name) => TemplateClass::Named(name),
    }
}

fn template_is_ours(volume: &Volume, driver: &str, facts: &VolumeFacts) -> bool {
    let class = match template_class_name(volume) {
        TemplateClass::Named(name) => facts.classes.get(name).and_then(Option::as_ref),
        TemplateClass::Default => facts.default_class.as_ref().and_then(Option::as_ref),
        TemplateClass::None => None,
    };
    let annotation = volume
        .ephemeral
        .as_ref()
        .and_then(|e| e.volume_claim_template.as_ref())
        .and_then(|t| t.metadata.as_ref())
        .and_then(provisioner_annotation);
    is_ours(class, annotation.as_deref(), driver, Binding::Late)
}

fn template_size(volume: &Volume) -> Option<u64> {
    let template = volume.ephemeral.as_ref()?.volume_claim_template.as_ref()?;
    storage_request(template.spec.resources.as_ref()?.requests.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_objects::json::*;
    use crate::test_objects::{GI, storage_class};
    use crate::well_known::{
        BETA_DEFAULT_CLASS, BETA_STORAGE_PROVISIONER, DEFAULT_CLASS, IMMEDIATE,
    };
    use k8s_openapi::api::core::v1::PersistentVolumeClaim;
    use k8s_openapi::api::storage::v1::StorageClass;
    use serde_json::{Value, json};

    /// A [`storage_class`] whose binding mode may be absent.
    fn class(name: &str, provisioner: &str, mode: Option<&str>) -> StorageClass {
        StorageClass {
            volume_binding_mode: mode.map(Into::into),
            ..storage_class(name, provisioner, "")
        }
    }

    fn default_marked(name: &str, created: &str, beta: bool) -> StorageClass {
        let key = if beta {
            BETA_DEFAULT_CLASS
        } else {
            DEFAULT_CLASS
        };
        serde_json::from_value(json!({
            "metadata": {"name": name, "creationTimestamp": created, "annotations": {key: "true"}},
            "provisioner": DRIVER,
        }))
        .expect("test class decodes")
    }

    fn late() -> Option<ClassFacts> {
        Some(ClassFacts::from(&class(
            "pmem",
            DRIVER,
            Some("WaitForFirstConsumer"),
        )))
    }

    /// Facts with the given claims (in `ns`) and classes.
    fn facts(
        claims: Vec<(&str, Option<PersistentVolumeClaim>)>,
        classes: Vec<(&str, Option<ClassFacts>)>,
        default_class: Option<Option<ClassFacts>>,
    ) -> VolumeFacts {
        VolumeFacts {
            claims: claims
                .into_iter()
                .map(|(n, c)| (ClaimKey::new("ns", n), c.as_ref().map(ClaimFacts::from)))
                .collect(),
            classes: classes
                .into_iter()
                .map(|(n, c)| (n.to_string(), c))
                .collect(),
            default_class,
        }
    }

    fn claim_pending(name: &str, volume: &str, size: Option<u64>) -> PendingVolume {
        PendingVolume {
            volume: volume.into(),
            source: VolumeSource::Claim(ClaimKey::new("ns", name)),
            size,
        }
    }

    fn ephemeral_pending(volume: &str, size: Option<u64>) -> PendingVolume {
        PendingVolume {
            volume: volume.into(),
            source: VolumeSource::Ephemeral(ClaimKey::new("ns", format!("app-{volume}"))),
            size,
        }
    }

    fn inline_pending(volume: &str, size: Option<u64>) -> PendingVolume {
        PendingVolume {
            volume: volume.into(),
            source: VolumeSource::Inline,
            size,
        }
    }

    #[test]
    fn pending_volumes_table() {
        let immediate = Some(ClassFacts::from(&class("imm", DRIVER, Some(IMMEDIATE))));
        let absent_mode = Some(ClassFacts::from(&class("imm", DRIVER, None)));
        let other = Some(ClassFacts::from(&class(
            "other",
            "other.csi",
            Some("WaitForFirstConsumer"),
        )));
        let cases: Vec<(&str, Pod, VolumeFacts, Vec<PendingVolume>)> = vec![
            ("no volumes", pod(vec![]), VolumeFacts::default(), vec![]),
            (
                "unbound claim, late class of ours",
                pod(vec![pvc_volume("data", "c1")]),
                facts(
                    vec![(
                        "c1",
                        Some(claim("c1", Some("pmem"), None, None, Some("2Gi"))),
                    )],
                    vec![("pmem", late())],
                    None,
                ),
                vec![claim_pending("c1", "data", Some(2 * GI))],
            ),
            (
                "empty volumeName counts as unbound",
                pod(vec![pvc_volume("data", "c1")]),
                facts(
                    vec![("c1", Some(claim("c1", Some("pmem"), Some(""), None, None)))],
                    vec![("pmem", late())],
                    None,
                ),
                vec![claim_pending("c1", "data", None)],
            ),
            (
                "bound claim",
                pod(vec![pvc_volume("data", "c1")]),
                facts(
                    vec![(
                        "c1",
                        Some(claim("c1", Some("pmem"), Some("pv-1"), None, None)),
                    )],
                    vec![("pmem", late())],
                    None,
                ),
                vec![],
            ),
            (
                "Immediate class",
                pod(vec![pvc_volume("data", "c1")]),
                facts(
                    vec![("c1", Some(claim("c1", Some("imm"), None, None, None)))],
                    vec![("imm", immediate.clone())],
                    None,
                ),
                vec![],
            ),
            (
                "absent binding mode means Immediate",
                pod(vec![pvc_volume("data", "c1")]),
                facts(
                    vec![("c1", Some(claim("c1", Some("imm"), None, None, None)))],
                    vec![("imm", absent_mode)],
                    None,
                ),
                vec![],
            ),
            (
                "class of another driver, annotation ignored when class exists",
                pod(vec![pvc_volume("data", "c1")]),
                facts(
                    vec![(
                        "c1",
                        Some(claim("c1", Some("other"), None, Some(DRIVER), None)),
                    )],
                    vec![("other", other.clone())],
                    None,
                ),
                vec![],
            ),
            (
                "class missing, annotation names us",
                pod(vec![pvc_volume("data", "c1")]),
                facts(
                    vec![(
                        "c1",
                        Some(claim("c1", Some("gone"), None, Some(DRIVER), Some("1Gi"))),
                    )],
                    vec![("gone", None)],
                    None,
                ),
                vec![claim_pending("c1", "data", Some(GI))],
            ),
            (
                "class missing, annotation names another driver",
                pod(vec![pvc_volume("data", "c1")]),
                facts(
                    vec![(
                        "c1",
                        Some(claim("c1", Some("gone"), None, Some("x.csi"), None)),
                    )],
                    vec![],
                    None,
                ),
                vec![],
            ),
            (
                "class missing, no annotation",
                pod(vec![pvc_volume("data", "c1")]),
                facts(
                    vec![("c1", Some(claim("c1", Some("gone"), None, None, None)))],
                    vec![("gone", None)],
                    None,
                ),
                vec![],
            ),
            (
                "empty class name, no annotation",
                pod(vec![pvc_volume("data", "c1")]),
                facts(
                    vec![("c1", Some(claim("c1", Some(""), None, None, None)))],
                    vec![("pmem", late())],
                    Some(late()),
                ),
                vec![],
            ),
            (
                "empty class name, annotation names us",
                pod(vec![pvc_volume("data", "c1")]),
                facts(
                    vec![("c1", Some(claim("c1", Some(""), None, Some(DRIVER), None)))],
                    vec![],
                    None,
                ),
                vec![claim_pending("c1", "data", None)],
            ),
            (
                "claim missing",
                pod(vec![pvc_volume("data", "c1")]),
                facts(vec![("c1", None)], vec![("pmem", late())], None),
                vec![],
            ),
            (
                "claim never looked up",
                pod(vec![pvc_volume("data", "c1")]),
                VolumeFacts::default(),
                vec![],
            ),
            (
                "claim in another namespace does not count",
                pod(vec![pvc_volume("data", "c1")]),
                VolumeFacts {
                    claims: [(
                        ClaimKey::new("other", "c1"),
                        Some(ClaimFacts::from(&claim(
                            "c1",
                            Some("pmem"),
                            None,
                            None,
                            None,
                        ))),
                    )]
                    .into(),
                    classes: [("pmem".to_string(), late())].into(),
                    default_class: None,
                },
                vec![],
            ),
            (
                "same claim twice counts once",
                pod(vec![pvc_volume("a", "c1"), pvc_volume("b", "c1")]),
                facts(
                    vec![(
                        "c1",
                        Some(claim("c1", Some("pmem"), None, None, Some("1Gi"))),
                    )],
                    vec![("pmem", late())],
                    None,
                ),
                vec![claim_pending("c1", "a", Some(GI))],
            ),
            (
                "zero and unparseable sizes are unknown",
                pod(vec![pvc_volume("a", "c1"), pvc_volume("b", "c2")]),
                facts(
                    vec![
                        ("c1", Some(claim("c1", Some("pmem"), None, None, Some("0")))),
                        (
                            "c2",
                            Some(claim("c2", Some("pmem"), None, None, Some("lots"))),
                        ),
                    ],
                    vec![("pmem", late())],
                    None,
                ),
                vec![
                    claim_pending("c1", "a", None),
                    claim_pending("c2", "b", None),
                ],
            ),
            (
                "inline of ours with size",
                pod(vec![inline_volume("scratch", DRIVER, Some("500Mi"))]),
                VolumeFacts::default(),
                vec![inline_pending("scratch", Some(500 << 20))],
            ),
            (
                "inline of ours without size",
                pod(vec![inline_volume("scratch", DRIVER, None)]),
                VolumeFacts::default(),
                vec![inline_pending("scratch", None)],
            ),
            (
                "inline of another driver",
                pod(vec![inline_volume("scratch", "other.csi", Some("1Gi"))]),
                VolumeFacts::default(),
                vec![],
            ),
            (
                "ephemeral, named late class of ours",
                pod(vec![ephemeral_volume("tmp", Some("pmem"), Some("4Gi"))]),
                facts(vec![("app-tmp", None)], vec![("pmem", late())], None),
                vec![ephemeral_pending("tmp", Some(4 * GI))],
            ),
            (
                "ephemeral, default class of ours",
                pod(vec![ephemeral_volume("tmp", None, Some("1Gi"))]),
                facts(vec![], vec![], Some(late())),
                vec![ephemeral_pending("tmp", Some(GI))],
            ),
            (
                "ephemeral, no default class",
                pod(vec![ephemeral_volume("tmp", None, Some("1Gi"))]),
                facts(vec![], vec![], Some(None)),
                vec![],
            ),
            (
                "ephemeral, default class Immediate",
                pod(vec![ephemeral_volume("tmp", None, None)]),
                facts(vec![], vec![], Some(immediate.clone())),
                vec![],
            ),
            (
                "ephemeral, empty class name",
                pod(vec![ephemeral_volume("tmp", Some(""), None)]),
                facts(vec![], vec![], Some(late())),
                vec![],
            ),
            (
                "ephemeral, class of another driver",
                pod(vec![ephemeral_volume("tmp", Some("other"), None)]),
                facts(vec![], vec![("other", other)], None),
                vec![],
            ),
            (
                "ephemeral, claim exists and is bound",
                pod(vec![ephemeral_volume("tmp", Some("pmem"), Some("1Gi"))]),
                facts(
                    vec![(
                        "app-tmp",
                        Some(claim("app-tmp", Some("pmem"), Some("pv"), None, None)),
                    )],
                    vec![("pmem", late())],
                    None,
                ),
                vec![],
            ),
            (
                "ephemeral, claim exists unbound: the claim's size wins",
                pod(vec![ephemeral_volume("tmp", Some("pmem"), Some("1Gi"))]),
                facts(
                    vec![(
                        "app-tmp",
                        Some(claim("app-tmp", Some("pmem"), None, None, Some("3Gi"))),
                    )],
                    vec![("pmem", late())],
                    None,
                ),
                vec![ephemeral_pending("tmp", Some(3 * GI))],
            ),
            (
                "mixed: order follows the pod",
                pod(vec![
                    inline_volume("i", DRIVER, Some("1Gi")),
                    pvc_volume("p", "c1"),
                    json!({"name": "e", "emptyDir": {}}),
                    ephemeral_volume("tmp", Some("pmem"), None),
                ]),
                facts(
                    vec![(
                        "c1",
                        Some(claim("c1", Some("pmem"), None, None, Some("2Gi"))),
                    )],
                    vec![("pmem", late())],
                    None,
                ),
                vec![
                    inline_pending("i", Some(GI)),
                    claim_pending("c1", "p", Some(2 * GI)),
                    ephemeral_pending("tmp", None),
                ],
            ),
        ];
        for (name, pod, facts, want) in cases {
            assert_eq!(pending_volumes(&pod, "ns", DRIVER, &facts), want, "{name}");
        }
    }

    #[test]
    fn ephemeral_without_pod_name_uses_the_template() {
        let mut pod = pod(vec![ephemeral_volume("tmp", Some("pmem"), None)]);
        pod.metadata.name = None;
        assert_eq!(claims_to_look_up(&pod, "ns"), vec![]);
        let facts = facts(vec![], vec![("pmem", late())], None);
        assert_eq!(pending_volumes(&pod, "ns", DRIVER, &facts).len(), 1);
    }

    #[test]
    fn first_unseen_table() {
        let known = |claim: PersistentVolumeClaim| {
            let name = claim.metadata.name.clone().unwrap_or_default();
            (name, Some(claim))
        };
        type Case = (
            &'static str,
            Vec<Value>,
            Vec<(String, Option<PersistentVolumeClaim>)>,
            Option<Unseen>,
        );
        let cases: Vec<Case> = vec![
            ("no volumes", vec![], vec![], None),
            (
                "claim not seen",
                vec![pvc_volume("a", "c1")],
                vec![],
                Some(Unseen::Claim(ClaimKey::new("ns", "c1"))),
            ),
            (
                "claim looked up, not found",
                vec![pvc_volume("a", "c1")],
                vec![("c1".into(), None)],
                Some(Unseen::Claim(ClaimKey::new("ns", "c1"))),
            ),
            (
                "unbound claim of a class not seen",
                vec![pvc_volume("a", "c1")],
                vec![known(claim("c1", Some("new"), None, None, None))],
                Some(Unseen::Class("new".into())),
            ),
            (
                "bound claim of a class not seen",
                vec![pvc_volume("a", "c1")],
                vec![known(claim("c1", Some("new"), Some("pv"), None, None))],
                None,
            ),
            (
                "unbound claim of a known class",
                vec![pvc_volume("a", "c1")],
                vec![known(claim("c1", Some("pmem"), None, None, None))],
                None,
            ),
            (
                "claim without class",
                vec![pvc_volume("a", "c1")],
                vec![known(claim("c1", None, None, None, None))],
                None,
            ),
            (
                "the first of several",
                vec![
                    pvc_volume("a", "c1"),
                    pvc_volume("b", "c2"),
                    pvc_volume("c", "c3"),
                ],
                vec![known(claim("c1", Some("pmem"), None, None, None))],
                Some(Unseen::Claim(ClaimKey::new("ns", "c2"))),
            ),
            (
                "ephemeral claim not seen: its template stands in",
                vec![ephemeral_volume("e", Some("pmem"), Some("1Gi"))],
                vec![],
                None,
            ),
            (
                "inline",
                vec![inline_volume("i", DRIVER, None)],
                vec![],
                None,
            ),
        ];
        for (name, volumes, claims, want) in cases {
            let facts = VolumeFacts {
                claims: claims
                    .into_iter()
                    .map(|(n, c)| (ClaimKey::new("ns", n), c.as_ref().map(ClaimFacts::from)))
                    .collect(),
                classes: [("pmem".to_string(), late())].into(),
                default_class: None,
            };
            assert_eq!(first_unseen(&pod(volumes), "ns", &facts), want, "{name}");
        }
        assert_eq!(
            Unseen::Claim(ClaimKey::new("ns", "c1")).to_string(),
            "PersistentVolumeClaim ns/c1"
        );
        assert_eq!(Unseen::Class("x".into()).to_string(), "StorageClass x");
    }

    #[test]
    fn lookup_steps_table() {
        let pod = pod(vec![
            pvc_volume("a", "c1"),
            pvc_volume("b", "bound"),
            pvc_volume("c", "c1"),
            pvc_volume("d", "gone"),
            ephemeral_volume("named", Some("tmpl"), None),
            ephemeral_volume("dflt", None, None),
            ephemeral_volume("none", Some(""), None),
            ephemeral_volume("exists", Some("ignored"), None),
            inline_volume("i", DRIVER, None),
        ]);
        assert_eq!(
            claims_to_look_up(&pod, "ns"),
            [
                "c1",
                "bound",
                "gone",
                "app-named",
                "app-dflt",
                "app-none",
                "app-exists"
            ]
            .map(|n| ClaimKey::new("ns", n))
            .to_vec()
        );
        // Only the named claims are worth a GET: ephemeral ones cannot exist at admission.
        assert_eq!(
            claims_to_fetch(&pod, "ns"),
            ["c1", "bound", "gone"]
                .map(|n| ClaimKey::new("ns", n))
                .into_iter()
                .collect::<BTreeSet<_>>()
        );
        let step1 = facts(
            vec![
                ("c1", Some(claim("c1", Some("pmem"), None, None, None))),
                (
                    "bound",
                    Some(claim("bound", Some("b"), Some("pv"), None, None)),
                ),
                ("gone", None),
                (
                    "app-exists",
                    Some(claim("app-exists", Some("real"), None, None, None)),
                ),
            ],
            vec![],
            None,
        );
        for (name, facts, want) in [
            (
                "after step 1",
                step1.clone(),
                ClassLookups {
                    names: vec!["pmem".into(), "real".into(), "tmpl".into()],
                    default_class: true,
                },
            ),
            (
                "classes and default already known",
                VolumeFacts {
                    classes: [("pmem".into(), late()), ("real".into(), None)].into(),
                    default_class: Some(None),
                    ..step1.clone()
                },
                ClassLookups {
                    names: vec!["tmpl".into()],
                    default_class: false,
                },
            ),
        ] {
            assert_eq!(classes_to_look_up(&pod, "ns", &facts), want, "{name}");
        }
        assert!(
            classes_to_look_up(
                &self::pod(vec![inline_volume("i", DRIVER, None)]),
                "ns",
                &step1
            )
            .is_empty()
        );
    }

    #[test]
    fn default_class_table() {
        let plain = class("plain", DRIVER, None);
        for (name, classes, want) in [
            ("none", vec![plain.clone()], None),
            (
                "one",
                vec![
                    plain.clone(),
                    default_marked("a", "2024-01-01T00:00:00Z", false),
                ],
                Some("a"),
            ),
            (
                "newest wins",
                vec![
                    default_marked("old", "2024-01-01T00:00:00Z", false),
                    default_marked("new", "2024-06-01T00:00:00Z", true),
                ],
                Some("new"),
            ),
            (
                "same time: smaller name wins",
                vec![
                    default_marked("b", "2024-01-01T00:00:00Z", false),
                    default_marked("a", "2024-01-01T00:00:00Z", false),
                    default_marked("c", "2024-01-01T00:00:00Z", false),
                ],
                Some("a"),
            ),
        ] {
            let facts: Vec<(String, ClassFacts)> = classes
                .iter()
                .map(|c| {
                    (
                        c.metadata.name.clone().unwrap_or_default(),
                        ClassFacts::of(c),
                    )
                })
                .collect();
            let got =
                crate::volume_facts::default_class(facts.iter().map(|(n, c)| (n.as_str(), c)))
                    .map(|(name, _)| name);
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn demand_keys() {
        assert_eq!(
            claim_pending("c1", "data", None).key("u"),
            DemandKey::Claim(ClaimKey::new("ns", "c1"))
        );
        assert_eq!(
            ephemeral_pending("tmp", None).key("u"),
            DemandKey::Claim(ClaimKey::new("ns", "app-tmp"))
        );
        assert_eq!(
            inline_pending("i", None).key("u"),
            DemandKey::Inline {
                pod_uid: "u".into(),
                volume: "i".into()
            }
        );
    }

    #[test]
    fn claim_and_class_facts() {
        assert_eq!(
            ClaimFacts::from(&claim(
                "c",
                Some("pmem"),
                Some("pv"),
                Some(DRIVER),
                Some("1Gi")
            )),
            ClaimFacts {
                class: Some("pmem".into()),
                volume_name: Some("pv".into()),
                provisioner_annotation: Some(DRIVER.into()),
                request: Some(GI),
                ..ClaimFacts::default()
            }
        );
        let beta: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": "c", "annotations": {BETA_STORAGE_PROVISIONER: "x"}},
        }))
        .expect("decodes");
        assert_eq!(
            ClaimFacts::from(&beta),
            ClaimFacts {
                provisioner_annotation: Some("x".into()),
                ..ClaimFacts::default()
            }
        );
        for (mode, late) in [
            (None, false),
            (Some(IMMEDIATE), false),
            (Some("WaitForFirstConsumer"), true),
        ] {
            assert_eq!(
                ClassFacts::from(&class("c", DRIVER, mode)).late_binding,
                late,
                "{mode:?}"
            );
        }
    }
}
