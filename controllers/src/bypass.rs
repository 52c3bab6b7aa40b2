//! The bypass reconciler: warns about pending pods that use this driver's pending volumes but
//! lack the extended resource `<driver>/scheduler`. The pod webhook adds that resource; when the
//! webhook was unreachable (`failurePolicy: Ignore`) the pod was admitted without it, and
//! kube-scheduler never consults the scheduler extender for it, so its volumes may land on a
//! node without enough PMEM. Each such pod gets one Warning Event and is counted in
//! `pmem_csi_pods_bypassed`. Pods are never modified: the resources of an existing pod cannot
//! gain an extended resource, only recreating the pod can.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Container, Pod};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::instrument::Instrument;
use crate::reconcile_metrics::ReconcileMetrics;
use crate::well_known::scheduler_resource;

/// The controller's name in metrics and logs.
pub const CONTROLLER: &str = "bypass";
/// The reason of the Warning Event on a bypassed pod.
pub const REASON: &str = "SchedulerExtenderBypassed";
/// How often a pending pod without the resource is judged again: whether it uses pending
/// volumes depends on claims and classes, which change without the pod changing.
const RECHECK: Duration = Duration::from_secs(60);

/// Whether a pod uses this driver's pending volumes: the webhook's relevance rule, supplied by
/// the binary (this crate cannot call the webhook's volume rules). It should include the
/// webhook's screen (opt-out label, scheduler names), so that pods the webhook would leave
/// alone are not reported.
pub type PodRelevance = Arc<dyn Fn(&Pod) -> bool + Send + Sync>;

/// What the bypass decision needs to know about one pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodFacts {
    /// Not yet scheduled: no `spec.nodeName`, phase `Pending` or unset, no deletionTimestamp.
    pub pending: bool,
    /// Some container or init container requests or limits `<driver>/scheduler`.
    pub has_resource: bool,
    /// The pod uses pending volumes of this driver ([`PodRelevance`]); only asked, and otherwise
    /// `false`, when the pod is pending and unmarked.
    pub uses_pending_volumes: bool,
}

/// Why a pod is not reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FineReason {
    /// It is scheduled, finished or terminating: the scheduler is done with it.
    NotPending,
    /// It carries the resource, so kube-scheduler consults the extender.
    HasResource,
    /// It needs no PMEM provisioned, so the extender has nothing to say about it.
    NoPendingVolumes,
}

/// The bypass decision about one pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Pending, uses our pending volumes, but the extender will not see it.
    Bypassed,
    /// Nothing to report.
    Fine(FineReason),
}

/// Decides about one pod. The facts are already resolved against the driver name (see
/// [`pod_facts`]), so the decision needs nothing else.
pub fn judge(facts: &PodFacts) -> Verdict {
    if !facts.pending {
        Verdict::Fine(FineReason::NotPending)
    } else if facts.has_resource {
        Verdict::Fine(FineReason::HasResource)
    } else if !facts.uses_pending_volumes {
        Verdict::Fine(FineReason::NoPendingVolumes)
    } else {
        Verdict::Bypassed
    }
}

/// The facts of `pod` for a driver named `driver`; `relevance` is asked only when the answer
/// can matter, because it may look at claims and classes.
pub fn pod_facts(pod: &Pod, driver: &str, relevance: impl FnOnce(&Pod) -> bool) -> PodFacts {
    let spec = pod.spec.as_ref();
    let pending = spec
        .and_then(|s| s.node_name.as_deref())
        .is_none_or(str::is_empty)
        && pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_none_or(|phase| phase == "Pending")
        && pod.metadata.deletion_timestamp.is_none();
    // kube-scheduler's own rule (HTTPExtender.IsInterested): the extender is consulted when any
    // container or init container requests or limits a managed resource. The webhook only
    // writes containers[0], but a pod marked elsewhere is not bypassed.
    let resource = scheduler_resource(driver);
    let marks = |c: &Container| {
        c.resources.as_ref().is_some_and(|r| {
            [r.requests.as_ref(), r.limits.as_ref()]
                .into_iter()
                .flatten()
                .any(|m| m.contains_key(&resource))
        })
    };
    let has_resource = spec.is_some_and(|s| {
        s.containers.iter().any(marks) || s.init_containers.iter().flatten().any(marks)
    });
    PodFacts {
        pending,
        has_resource,
        uses_pending_volumes: pending && !has_resource && relevance(pod),
    }
}

// ---------------------------------------------------------------------------------------------
// What the reconciler remembers between reconciles.
// ---------------------------------------------------------------------------------------------

/// Per pod UID: whether it is bypassed now, whether its Event went out, and whether it waits
/// for the scheduler carrying the extender's resource.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Flag {
    bypassed: bool,
    published: bool,
    marked: bool,
}

/// The pods judged bypassed, by UID, and which of them got their Event. In memory only: a new
/// leader warns again once about each pod that is still bypassed.
#[derive(Debug, Default)]
pub struct FlaggedPods {
    pods: HashMap<String, Flag>,
    /// UIDs seen since the watch started a re-list; `None` outside a re-list.
    listing: Option<HashSet<String>>,
}

impl FlaggedPods {
    /// Records the verdict about pod `uid`; returns whether its Event must be published now.
    /// It stays "must publish" until [`FlaggedPods::published`], so a failed publication is
    /// retried, and once published it is never published again for that UID.
    pub fn observe(&mut self, uid: &str, verdict: &Verdict) -> bool {
        match verdict {
            Verdict::Bypassed => {
                let flag = self.pods.entry(uid.to_string()).or_default();
                flag.bypassed = true;
                flag.marked = false;
                !flag.published
            }
            Verdict::Fine(FineReason::HasResource) => {
                let flag = self.pods.entry(uid.to_string()).or_default();
                flag.bypassed = false;
                flag.marked = true;
                false
            }
            Verdict::Fine(_) => {
                // Keep the "published" mark while the pod exists: a pod whose claims flip
                // between pending and not must not warn twice.
                if let Some(flag) = self.pods.get_mut(uid) {
                    flag.bypassed = false;
                    flag.marked = false;
                    if !flag.published {
                        self.pods.remove(uid);
                    }
                }
                false
            }
        }
    }

    /// Records that the Event of pod `uid` was published.
    pub fn published(&mut self, uid: &str) {
        if let Some(flag) = self.pods.get_mut(uid) {
            flag.published = true;
        }
    }

    /// Forgets pod `uid`: it is gone or scheduled.
    pub fn forget(&mut self, uid: &str) {
        self.pods.remove(uid);
    }

    /// How many pods are bypassed now.
    pub fn count(&self) -> usize {
        self.pods.values().filter(|f| f.bypassed).count()
    }

    /// How many pending pods carry the extender's resource now.
    pub fn marked(&self) -> usize {
        self.pods.values().filter(|f| f.marked).count()
    }

    /// Follows the pod watch (unscheduled pods only): a deleted event means the pod is gone or
    /// got a node; after a re-list, pods that were not listed vanished while the watch was
    /// down, and no deleted event will ever come for them.
    pub fn on_watch_event(&mut self, event: &watcher::Event<Pod>) {
        match event {
            watcher::Event::Init => self.listing = Some(HashSet::new()),
            watcher::Event::InitApply(pod) => {
                if let (Some(listing), Some(uid)) =
                    (self.listing.as_mut(), pod.metadata.uid.as_ref())
                {
                    listing.insert(uid.clone());
                }
            }
            watcher::Event::InitDone => {
                if let Some(listed) = self.listing.take() {
                    self.pods.retain(|uid, _| listed.contains(uid));
                }
            }
            watcher::Event::Delete(pod) => {
                if let Some(uid) = pod.metadata.uid.as_deref() {
                    self.forget(uid);
                }
            }
            watcher::Event::Apply(_) => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The controller around the decision.
// ---------------------------------------------------------------------------------------------

/// Failures of one reconcile; the pod is retried with exponential back-off.
#[derive(Debug, thiserror::Error)]
pub enum BypassError {
    /// Publishing the Warning Event failed.
    #[error("publishing the {REASON} event for pod {namespace}/{name}: {source}")]
    Event {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// Why.
        source: kube::Error,
    },
}

/// The bypass gauges (`pmem_csi_pods_bypassed`, `pmem_csi_pods_pending_with_scheduler_resource`).
#[derive(Clone, Debug, Default)]
pub struct BypassMetrics {
    pods_bypassed: Gauge,
    pods_marked: Gauge,
}

impl BypassMetrics {
    /// Registers the gauge in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "pmem_csi_pods_bypassed",
            "Pending pods that use PMEM-CSI volumes but were admitted without the scheduler \
             extender's resource while the pod webhook was unreachable",
            m.pods_bypassed.clone(),
        );
        // With the extender missing from kube-scheduler's configuration these pods fit no
        // node; alerting on them needs no kube-state-metrics.
        registry.register(
            "pmem_csi_pods_pending_with_scheduler_resource",
            "Unscheduled pods carrying the scheduler extender's resource, which kube-scheduler \
             places only through the extender",
            m.pods_marked.clone(),
        );
        m
    }
}

/// The flagged pods and the gauge that mirrors them, changed together.
#[derive(Debug)]
struct Tally {
    flagged: Mutex<FlaggedPods>,
    metrics: BypassMetrics,
}

impl Tally {
    fn update<R>(&self, change: impl FnOnce(&mut FlaggedPods) -> R) -> R {
        let mut flagged = self.flagged.lock().unwrap_or_else(PoisonError::into_inner);
        let result = change(&mut flagged);
        self.metrics
            .pods_bypassed
            .set(i64::try_from(flagged.count()).unwrap_or(i64::MAX));
        self.metrics
            .pods_marked
            .set(i64::try_from(flagged.marked()).unwrap_or(i64::MAX));
        result
    }
}

/// The bypass reconciler for one leadership term: watches unscheduled pods and warns about
/// those the scheduler extender will not see.
pub struct Bypass {
    client: kube::Client,
    driver: String,
    relevance: PodRelevance,
    recorder: Recorder,
    tally: Tally,
    instrument: Instrument<Pod>,
}

/// A [`Bypass`] with the cache its watch fills.
struct Term {
    bypass: Bypass,
    pods: Store<Pod>,
}

impl Bypass {
    /// A reconciler for driver `driver`, publishing Events with `client` as `reporter`.
    pub fn new(
        client: kube::Client,
        driver: String,
        relevance: PodRelevance,
        reporter: Reporter,
        metrics: BypassMetrics,
        reconciles: ReconcileMetrics,
    ) -> Self {
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            driver,
            relevance,
            tally: Tally {
                flagged: Mutex::default(),
                metrics,
            },
            instrument: Instrument::new(CONTROLLER, reconciles),
        }
    }

    /// Runs until `shutdown`, then zeroes the gauge: only the leader reports.
    pub async fn run(self, shutdown: CancellationToken) {
        // Only unscheduled pods: the apiserver filters, and sends a deleted event when a pod
        // gets its node, so the cache stays as small as the scheduling queue.
        let api = Api::<Pod>::all(self.client.clone());
        let config = watcher::Config::default().fields("spec.nodeName=");
        let (pods, writer) = reflector::store();
        let term = Arc::new(Term { bypass: self, pods });
        // A re-list replaces the cache only at its end, and a pod first seen in it finds no
        // cache entry when its reconcile runs; reconciling everything after each re-list
        // catches those.
        let (relisted, relists) = mpsc::channel(1);
        let watching = term.clone();
        let events = watcher(api, config)
            .default_backoff()
            .modify(|pod| pod.metadata.managed_fields = None)
            .reflect(writer)
            .inspect_ok(move |event| {
                watching.bypass.tally.update(|f| f.on_watch_event(event));
                if matches!(event, watcher::Event::InitDone) {
                    // Full means a reconcile of everything is already due.
                    let _ = relisted.try_send(());
                }
            })
            .applied_objects();
        Controller::for_stream(events, term.pods.clone())
            .reconcile_all_on(tokio_stream::wrappers::ReceiverStream::new(relists))
            .graceful_shutdown_on(shutdown.cancelled_owned())
            .run(reconcile, error_policy, term.clone())
            .for_each(|result| async move {
                if let Err(controller::Error::QueueError(e)) = result {
                    tracing::warn!("watching unscheduled pods: {e}");
                }
            })
            .await;
        term.bypass.tally.update(|f| *f = FlaggedPods::default());
    }
}

impl Term {
    /// Whether the cache still holds pod `uid`. A reconcile may run for a pod whose deleted
    /// event was already handled; counting it then would leave it in the gauge for good.
    fn cached(&self, pod: &Pod, uid: &str) -> bool {
        self.pods
            .get(&ObjectRef::from_obj(pod))
            .is_some_and(|p| p.metadata.uid.as_deref() == Some(uid))
    }

    async fn reconcile(&self, pod: &Pod) -> Result<Action, BypassError> {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return Ok(Action::await_change());
        };
        let bypass = &self.bypass;
        let verdict = judge(&pod_facts(pod, &bypass.driver, &*bypass.relevance));
        // The cache check and the update share the lock the watch handler takes after the
        // cache changed, so a removal is seen either here or by the handler afterwards.
        let publish = bypass.tally.update(|f| {
            if self.cached(pod, uid) {
                f.observe(uid, &verdict)
            } else {
                f.forget(uid);
                false
            }
        });
        let action = match verdict {
            // Claims and classes decide these, and they change without the pod changing.
            Verdict::Bypassed | Verdict::Fine(FineReason::NoPendingVolumes) => {
                Action::requeue(RECHECK)
            }
            Verdict::Fine(FineReason::NotPending | FineReason::HasResource) => {
                Action::await_change()
            }
        };
        if !publish {
            return Ok(action);
        }
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let resource = scheduler_resource(&bypass.driver);
        tracing::warn!(pod = %format!("{namespace}/{name}"), "admitted without {resource}: the scheduler extender does not see it");
        let event = Event {
            type_: EventType::Warning,
            reason: REASON.into(),
            note: Some(format!(
                "admitted without the extended resource {resource} while the PMEM-CSI pod \
                 webhook was unreachable, so kube-scheduler does not consult the PMEM-CSI \
                 scheduler extender and may pick a node without enough PMEM for its volumes; \
                 delete and recreate the pod to get the resource"
            )),
            action: "Schedule".into(),
            secondary: None,
        };
        bypass
            .recorder
            .publish(&event, &pod.object_ref(&()))
            .await
            .map_err(|source| BypassError::Event {
                namespace,
                name,
                source,
            })?;
        bypass.tally.update(|f| f.published(uid));
        Ok(action)
    }
}

async fn reconcile(pod: Arc<Pod>, ctx: Arc<Term>) -> Result<Action, BypassError> {
    ctx.bypass
        .instrument
        .reconcile(&pod, ctx.reconcile(&pod))
        .await
}

fn error_policy(pod: Arc<Pod>, error: &BypassError, ctx: Arc<Term>) -> Action {
    ctx.bypass.instrument.error_policy(&pod, error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodSpec, PodStatus, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use kube::api::ObjectMeta;
    use std::collections::BTreeMap;

    const DRIVER: &str = "pmem-csi.intel.com";

    fn facts(pending: bool, has_resource: bool, uses_pending_volumes: bool) -> PodFacts {
        PodFacts {
            pending,
            has_resource,
            uses_pending_volumes,
        }
    }

    #[test]
    fn judge_table() {
        use FineReason::*;
        for (name, f, want) in [
            ("bypassed", facts(true, false, true), Verdict::Bypassed),
            (
                "not pending",
                facts(false, false, true),
                Verdict::Fine(NotPending),
            ),
            (
                "marked",
                facts(true, true, true),
                Verdict::Fine(HasResource),
            ),
            (
                "no pending volumes",
                facts(true, false, false),
                Verdict::Fine(NoPendingVolumes),
            ),
            (
                "not pending wins over marked",
                facts(false, true, false),
                Verdict::Fine(NotPending),
            ),
            (
                "marked wins over no volumes",
                facts(true, true, false),
                Verdict::Fine(HasResource),
            ),
        ] {
            assert_eq!(judge(&f), want, "{name}");
        }
    }

    /// A pending pod builder: one container, optionally with resource maps.
    struct PodBuilder(Pod);

    impl PodBuilder {
        fn new() -> Self {
            Self(Pod {
                metadata: ObjectMeta {
                    name: Some("p".into()),
                    namespace: Some("ns".into()),
                    uid: Some("u1".into()),
                    ..Default::default()
                },
                spec: Some(PodSpec {
                    containers: vec![Container {
                        name: "c".into(),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
                status: Some(PodStatus {
                    phase: Some("Pending".into()),
                    ..Default::default()
                }),
            })
        }
        fn spec(&mut self) -> &mut PodSpec {
            self.0.spec.get_or_insert_with(Default::default)
        }
        fn node(mut self, node: &str) -> Self {
            self.spec().node_name = Some(node.into());
            self
        }
        fn phase(mut self, phase: Option<&str>) -> Self {
            self.0.status = phase.map(|p| PodStatus {
                phase: Some(p.into()),
                ..Default::default()
            });
            self
        }
        fn deleting(mut self) -> Self {
            self.0.metadata.deletion_timestamp = Some(Time(Default::default()));
            self
        }
        fn resources(requests: &[&str], limits: &[&str]) -> Option<ResourceRequirements> {
            let map = |names: &[&str]| {
                (!names.is_empty()).then(|| {
                    names
                        .iter()
                        .map(|n| (n.to_string(), Quantity("1".into())))
                        .collect::<BTreeMap<_, _>>()
                })
            };
            Some(ResourceRequirements {
                requests: map(requests),
                limits: map(limits),
                ..Default::default()
            })
        }
        fn container(mut self, index: usize, requests: &[&str], limits: &[&str]) -> Self {
            let containers = &mut self.spec().containers;
            containers.resize_with(index + 1, Default::default);
            containers[index].resources = Self::resources(requests, limits);
            self
        }
        fn init_container(mut self, requests: &[&str]) -> Self {
            self.spec().init_containers = Some(vec![Container {
                name: "init".into(),
                resources: Self::resources(requests, &[]),
                ..Default::default()
            }]);
            self
        }
    }

    #[test]
    fn pod_facts_table() {
        let ours = "pmem-csi.intel.com/scheduler";
        let other = "other.csi/scheduler";
        for (name, pod, want) in [
            (
                "unmarked pending",
                PodBuilder::new(),
                facts(true, false, true),
            ),
            (
                "phase unset",
                PodBuilder::new().phase(None),
                facts(true, false, true),
            ),
            (
                "scheduled",
                PodBuilder::new().node("n1"),
                facts(false, false, false),
            ),
            (
                "empty node name",
                PodBuilder::new().node(""),
                facts(true, false, true),
            ),
            (
                "running",
                PodBuilder::new().phase(Some("Running")),
                facts(false, false, false),
            ),
            (
                "failed",
                PodBuilder::new().phase(Some("Failed")),
                facts(false, false, false),
            ),
            (
                "terminating",
                PodBuilder::new().deleting(),
                facts(false, false, false),
            ),
            (
                "requests",
                PodBuilder::new().container(0, &[ours], &[ours]),
                facts(true, true, false),
            ),
            (
                "limits only",
                PodBuilder::new().container(0, &[], &[ours]),
                facts(true, true, false),
            ),
            (
                "second container",
                PodBuilder::new().container(1, &[ours], &[]),
                facts(true, true, false),
            ),
            (
                "init container",
                PodBuilder::new().init_container(&[ours]),
                facts(true, true, false),
            ),
            (
                "other driver's mark",
                PodBuilder::new().container(0, &[other], &[other]),
                facts(true, false, true),
            ),
        ] {
            let relevance = |_: &Pod| true;
            assert_eq!(pod_facts(&pod.0, DRIVER, relevance), want, "{name}");
        }
        let irrelevant = |_: &Pod| false;
        assert_eq!(
            pod_facts(&PodBuilder::new().0, DRIVER, irrelevant),
            facts(true, false, false)
        );
        let asked = std::sync::atomic::AtomicBool::new(false);
        let spy = |_: &Pod| {
            asked.store(true, std::sync::atomic::Ordering::Relaxed);
            true
        };
        pod_facts(&PodBuilder::new().node("n1").0, DRIVER, spy);
        assert!(
            !asked.load(std::sync::atomic::Ordering::Relaxed),
            "scheduled pods need no volume lookups"
        );
    }

    #[test]
    fn event_once_per_uid_and_count_follows() {
        let mut f = FlaggedPods::default();
        let fine = Verdict::Fine(FineReason::NoPendingVolumes);
        assert!(f.observe("a", &Verdict::Bypassed), "first sight publishes");
        assert!(f.observe("a", &Verdict::Bypassed), "unpublished: retried");
        f.published("a");
        assert!(!f.observe("a", &Verdict::Bypassed), "published once");
        assert!(f.observe("b", &Verdict::Bypassed));
        assert_eq!(f.count(), 2);
        assert!(!f.observe("c", &fine));
        assert_eq!(f.count(), 2, "fine pods are not counted");
        assert!(!f.observe("a", &fine));
        assert_eq!(f.count(), 1, "no longer bypassed");
        assert!(
            !f.observe("a", &Verdict::Bypassed),
            "still the same pod: no second event"
        );
        assert_eq!(f.count(), 2);
        f.forget("a");
        f.forget("b");
        assert_eq!(f.count(), 0);
        assert!(
            f.observe("a", &Verdict::Bypassed),
            "a forgotten UID starts over"
        );
        assert!(
            !f.observe("b", &fine),
            "fine before the event: nothing to publish"
        );
        assert_eq!(f.count(), 1);
    }

    fn pod(uid: &str) -> Pod {
        let mut p = PodBuilder::new().0;
        p.metadata.uid = Some(uid.into());
        p
    }

    #[test]
    fn watch_events_forget_gone_pods() {
        let mut f = FlaggedPods::default();
        for uid in ["a", "b", "c"] {
            f.observe(uid, &Verdict::Bypassed);
        }
        f.on_watch_event(&watcher::Event::Apply(pod("a")));
        assert_eq!(f.count(), 3, "changes are the reconciler's business");
        f.on_watch_event(&watcher::Event::Delete(pod("a")));
        assert_eq!(f.count(), 2, "deleted or scheduled");
        f.on_watch_event(&watcher::Event::Init);
        f.on_watch_event(&watcher::Event::InitApply(pod("b")));
        assert_eq!(f.count(), 2, "nothing is forgotten before the re-list ends");
        f.on_watch_event(&watcher::Event::InitDone);
        assert_eq!(f.count(), 1, "c vanished while the watch was down");
        f.on_watch_event(&watcher::Event::InitDone);
        assert_eq!(f.count(), 1, "InitDone without Init changes nothing");
    }

    /// The host boxes the run as a `BoxFuture<'static, ()>`, which needs `Send`.
    fn run_future(b: Bypass, t: CancellationToken) -> impl Future<Output = ()> + Send + 'static {
        b.run(t)
    }

    #[test]
    fn run_future_is_send() {
        let _ = run_future;
    }

    #[test]
    fn gauge_follows_and_is_named() {
        let mut registry = Registry::default();
        let metrics = BypassMetrics::register(&mut registry);
        let tally = Tally {
            flagged: Mutex::default(),
            metrics,
        };
        let encode = |registry: &Registry| {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, registry).expect("encode");
            text
        };
        let text = encode(&registry);
        assert!(
            text.contains("# TYPE pmem_csi_pods_bypassed gauge"),
            "{text}"
        );
        assert!(text.contains("\npmem_csi_pods_bypassed 0\n"), "{text}");
        tally.update(|f| {
            f.observe("a", &Verdict::Bypassed);
            f.observe("b", &Verdict::Bypassed);
        });
        assert!(encode(&registry).contains("\npmem_csi_pods_bypassed 2\n"));
        tally.update(|f| f.on_watch_event(&watcher::Event::Delete(pod("a"))));
        assert!(encode(&registry).contains("\npmem_csi_pods_bypassed 1\n"));
        tally.update(|f| {
            f.observe("m", &Verdict::Fine(FineReason::HasResource));
        });
        let text = encode(&registry);
        assert!(
            text.contains("\npmem_csi_pods_pending_with_scheduler_resource 1\n"),
            "{text}"
        );
    }

    #[test]
    fn marked_pods_are_counted_while_they_wait() {
        let mut f = FlaggedPods::default();
        let marked = Verdict::Fine(FineReason::HasResource);
        assert!(!f.observe("a", &marked), "no event for marked pods");
        f.observe("b", &marked);
        assert_eq!((f.marked(), f.count()), (2, 0));
        f.observe("a", &Verdict::Fine(FineReason::NotPending));
        assert_eq!(f.marked(), 1, "scheduled");
        f.on_watch_event(&watcher::Event::Delete(pod("b")));
        assert_eq!(f.marked(), 0, "gone");
        f.observe("c", &marked);
        f.on_watch_event(&watcher::Event::Init);
        f.on_watch_event(&watcher::Event::InitDone);
        assert_eq!(f.marked(), 0, "vanished while the watch was down");
    }
}
