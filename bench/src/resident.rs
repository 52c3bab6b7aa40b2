//! How memory is measured: `/proc/<pid>/status` of the real processes (RssAnon: heap, stacks;
//! RssFile: the mapped binary), and the bytes each watch cache holds, measured by building the
//! same caches in this process from the same objects with the same trimming under a counting
//! allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

use anyhow::Context;
use controllers::claim_summary::ClaimSummary;
use controllers::node_summary::NodeSummary;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::storage::v1::{CSINode, CSIStorageCapacity, StorageClass};
use kube::api::ListParams;
use kube::runtime::reflector;
use kube::runtime::watcher;
use kube::{Api, Resource};

use serde::de::DeserializeOwned;

/// Counts live heap bytes while [`Counting::measure`] runs; otherwise the system allocator
/// with one relaxed load per call (the load benchmarks' floor server shares this binary).
pub struct Counting;

static ON: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicI64 = AtomicI64::new(0);

fn count(delta: i64) {
    if ON.load(Ordering::Relaxed) {
        LIVE.fetch_add(delta, Ordering::Relaxed);
    }
}

// The workspace denies unsafe code; a global allocator cannot be written without it. This one
// forwards every call to `System` unchanged and only adds counters. (stats_alloc would need no
// unsafe here, but it counts every call on shared atomics, which would slow the /filter floor
// server this binary also runs.)
// SAFETY: every call is forwarded to `System` with the caller's arguments; nothing else
// touches the memory.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as i64));
        // SAFETY: the caller's contract is passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as i64);
        }
        p
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract is passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as i64 - layout.size() as i64);
        }
        p
    }
}

impl Counting {
    /// The heap bytes that `build` leaves allocated (what it returns holds; it is dropped
    /// after the count). Other threads allocating meanwhile are counted too: measure while
    /// nothing else runs.
    pub async fn measure<T, F: Future<Output = anyhow::Result<T>>>(
        build: impl FnOnce() -> F,
    ) -> anyhow::Result<i64> {
        LIVE.store(0, Ordering::SeqCst);
        ON.store(true, Ordering::SeqCst);
        let built = build().await;
        let bytes = LIVE.load(Ordering::SeqCst);
        ON.store(false, Ordering::SeqCst);
        drop(built?);
        Ok(bytes)
    }
}

/// What `/proc/<pid>/status` says of a process's resident memory, in bytes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Resident {
    /// VmRSS.
    pub total: u64,
    /// RssAnon: heap, stacks, anonymous mappings.
    pub anon: u64,
    /// RssFile: mapped files (the binary's pages in use).
    pub file: u64,
}

impl Resident {
    /// Of process `pid` (zeros when it is gone).
    pub fn of(pid: u32) -> Self {
        let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .map_or(0, |kib| kib * 1024)
        };
        Self {
            total: field("VmRSS:"),
            anon: field("RssAnon:"),
            file: field("RssFile:"),
        }
    }

    /// As JSON, in MiB.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "rss_mib": mib(self.total),
            "anon_mib": mib(self.anon),
            "file_mib": mib(self.file),
        })
    }
}

/// `bytes` in MiB, rounded to 0.01.
pub fn mib(bytes: u64) -> f64 {
    (bytes as f64 / (1024.0 * 1024.0) * 100.0).round() / 100.0
}

/// Bytes a kube-runtime cache of every `K` of `api` holds, trimmed as the controller trims it.
async fn cache_bytes<K>(api: Api<K>) -> anyhow::Result<(usize, i64)>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
{
    let mut objects = 0;
    let bytes = Counting::measure(|| async {
        let (reader, mut writer) = reflector::store::<K>();
        let list = api.list(&ListParams::default()).await?;
        objects = list.items.len();
        writer.apply_watcher_event(&watcher::Event::Init);
        for mut object in list.items {
            controllers::stores::trim(&mut object);
            writer.apply_watcher_event(&watcher::Event::InitApply(object));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        anyhow::Ok((reader, writer))
    })
    .await?;
    Ok((objects, bytes))
}

/// The bytes of each cache the controller keeps (`namespace`: where its heartbeat Leases
/// live), as JSON: kind → {objects, mib}.
pub async fn controller_caches(
    client: &kube::Client,
    namespace: &str,
) -> anyhow::Result<serde_json::Value> {
    let mut out = serde_json::Map::new();
    let mut add = |kind: &str, (objects, bytes): (usize, i64)| {
        out.insert(
            kind.into(),
            serde_json::json!({"objects": objects, "mib": mib(bytes.max(0) as u64)}),
        );
    };
    add(
        "PersistentVolumeClaim",
        cache_bytes(Api::<ClaimSummary>::all(client.clone()))
            .await
            .context("claims")?,
    );
    add(
        "Node",
        cache_bytes(Api::<NodeSummary>::all(client.clone()))
            .await
            .context("nodes")?,
    );
    add(
        "CSINode",
        cache_bytes(Api::<CSINode>::all(client.clone()))
            .await
            .context("csinodes")?,
    );
    add(
        "Lease",
        cache_bytes(Api::<Lease>::namespaced(client.clone(), namespace))
            .await
            .context("leases")?,
    );
    add(
        "StorageClass",
        cache_bytes(Api::<StorageClass>::all(client.clone()))
            .await
            .context("classes")?,
    );
    add(
        "CSIStorageCapacity",
        cache_bytes(Api::<CSIStorageCapacity>::namespaced(
            client.clone(),
            namespace,
        ))
        .await
        .context("capacity")?,
    );
    Ok(serde_json::Value::Object(out))
}
