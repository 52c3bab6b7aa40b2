//! The volumes of this node: node state plus the backend, with the CreateVolume size and
//! idempotence rules, per-volume serialization, and the start-up repair that makes state and
//! devices agree again after a crash.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{OwnedMutexGuard, watch};

use crate::backend::{Backend, BackendError, Capacity, DeviceMode, align_up};
use crate::error::VolumeError;
use crate::parameters::{self, Origin, Parameters};
use crate::repair;
use crate::state::{StateStore, VolumeState};
use crate::volume_id::volume_id;

/// What CreateVolume asks for, in plain data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreateRequest {
    /// Volume name.
    pub name: String,
    /// `capacity_range.required_bytes` (0 = not given).
    pub required: u64,
    /// `capacity_range.limit_bytes` (0 = no limit).
    pub limit: u64,
    /// Parsed parameters.
    pub parameters: Parameters,
}

/// The size a new volume gets: `required` (or `default` when 0) rounded up to `alignment`,
/// which must not pass a non-zero `limit`.
pub fn new_volume_size(
    required: u64,
    limit: u64,
    default: u64,
    alignment: u64,
) -> Result<u64, VolumeError> {
    if limit > 0 && required > limit {
        return Err(VolumeError::OutOfRange(format!(
            "required_bytes {required} exceeds limit_bytes {limit}"
        )));
    }
    let wanted = if required == 0 { default } else { required };
    let aligned = align_up(wanted, alignment).ok_or_else(|| {
        VolumeError::OutOfRange(format!(
            "required_bytes {required}: {wanted} bytes cannot be rounded up to the alignment of {alignment} bytes"
        ))
    })?;
    if aligned == 0 {
        return Err(VolumeError::OutOfRange(
            "required_bytes 0 and no default size: a volume cannot be empty".into(),
        ));
    }
    if limit > 0 && aligned > limit {
        let aligned_down = limit / alignment * alignment;
        if required == 0 && aligned_down > 0 {
            // No minimum asked: the largest aligned size within the limit serves.
            return Ok(aligned_down);
        }
        return Err(VolumeError::OutOfRange(format!(
            "{wanted} bytes rounded up to the alignment of {alignment} bytes is {aligned}, above limit_bytes {limit}"
        )));
    }
    Ok(aligned)
}

/// The size a volume of `current` bytes has after NodeExpandVolume asks for `required` bytes
/// (0 = not given) within a non-zero `limit`: `required` rounded up to `alignment`, never less
/// than `current` (a volume does not shrink, and a repeated call changes nothing).
pub fn grown_size(
    required: u64,
    limit: u64,
    current: u64,
    alignment: u64,
) -> Result<u64, VolumeError> {
    if limit > 0 && required > limit {
        return Err(VolumeError::OutOfRange(format!(
            "required_bytes {required} exceeds limit_bytes {limit}"
        )));
    }
    let aligned = align_up(required, alignment).ok_or_else(|| {
        VolumeError::OutOfRange(format!(
            "required_bytes {required} cannot be rounded up to the alignment of {alignment} bytes"
        ))
    })?;
    let size = aligned.max(current);
    if i64::try_from(size).is_err() {
        return Err(VolumeError::OutOfRange(format!(
            "required_bytes {required} is more than a volume can hold"
        )));
    }
    if limit > 0 && size > limit {
        return Err(VolumeError::OutOfRange(if current > limit {
            format!("the volume already holds {current} bytes, above limit_bytes {limit}")
        } else {
            format!(
                "required_bytes {required} rounded up to the alignment of {alignment} bytes is {aligned}, above limit_bytes {limit}"
            )
        }));
    }
    Ok(size)
}

/// Whether an existing volume satisfies a repeated CreateVolume: size within the range and the
/// same parameters; otherwise `AlreadyExists` saying what differs.
pub fn judge_existing(existing: &VolumeState, request: &CreateRequest) -> Result<(), VolumeError> {
    let size = u64::try_from(existing.size).unwrap_or(0);
    let stored = Parameters::parse(&existing.parameters, Origin::State)?;
    let mismatch = |existing: String, wanted: String| VolumeError::Mismatch {
        name: request.name.clone(),
        existing,
        wanted,
    };
    if size < request.required {
        return Err(mismatch(
            format!("size {size}"),
            format!("required_bytes {}", request.required),
        ));
    }
    if request.limit > 0 && size > request.limit {
        return Err(mismatch(
            format!("size {size}"),
            format!("limit_bytes {}", request.limit),
        ));
    }
    if !stored.compatible_with(&request.parameters) {
        return Err(mismatch(
            format!("parameters {:?}", existing.parameters),
            format!("parameters {:?}", request.parameters.to_context()),
        ));
    }
    Ok(())
}

/// Runs blocking file and device I/O without stalling the other requests on this worker.
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// Opens the backend of a device mode other than the driver's own, for volumes recorded in it
/// (a driver restarted in another mode still stages and deletes its old volumes).
pub type OtherModes =
    Box<dyn Fn(DeviceMode) -> Result<Arc<dyn Backend>, BackendError> + Send + Sync>;

type LockMap = HashMap<String, Arc<tokio::sync::Mutex<()>>>;

/// One volume's lock, held while an operation runs on it. Dropping it forgets the volume's entry
/// when nobody else holds or waits for it, so that the map never outgrows the volumes in use
/// (IDs of deleted volumes, and made-up IDs of failed calls, used to stay for ever).
#[derive(Debug)]
pub struct VolumeGuard {
    guard: Option<OwnedMutexGuard<()>>,
    id: String,
    locks: Arc<Mutex<LockMap>>,
}

impl Drop for VolumeGuard {
    fn drop(&mut self) {
        // Under the map's lock nobody can clone the entry anew; a waiter already holds a clone,
        // so a count of one (the map's own) after releasing means no one needs it.
        let mut locks = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
        drop(self.guard.take());
        if locks
            .get(&self.id)
            .is_some_and(|l| Arc::strong_count(l) == 1)
        {
            locks.remove(&self.id);
        }
    }
}

/// This node's volumes.
pub struct Volumes {
    backend: Arc<dyn Backend>,
    other_modes: Option<OtherModes>,
    opened: Mutex<HashMap<DeviceMode, Arc<dyn Backend>>>,
    state: StateStore,
    index: Mutex<BTreeMap<String, VolumeState>>,
    locks: Arc<Mutex<LockMap>>,
    default_size: u64,
    changes: watch::Sender<u64>,
    last_capacity: Mutex<Option<(Capacity, std::time::Instant)>>,
    repair_report: Mutex<repair::RepairReport>,
}

/// How old the capacity a metrics scrape is served may be: a scrape must not run `vgs` or
/// `ndctl` (seconds each under load, serialized with volume operations) every time it comes,
/// while figures no create or delete changed stay close to the truth for what else uses the
/// pools.
pub const CAPACITY_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(30);

impl Volumes {
    /// Opens the state, repairs what a crash left and returns the volumes.
    pub fn open(
        backend: Arc<dyn Backend>,
        state: StateStore,
        default_size: u64,
    ) -> Result<Self, VolumeError> {
        let (changes, _) = watch::channel(0);
        let volumes = Self {
            backend,
            other_modes: None,
            opened: Mutex::new(HashMap::new()),
            state,
            index: Mutex::new(BTreeMap::new()),
            locks: Arc::default(),
            default_size,
            last_capacity: Mutex::new(None),
            repair_report: Mutex::default(),
            changes,
        };
        volumes.repair()?;
        Ok(volumes)
    }

    /// Lets volumes of other device modes be reached through `open`.
    pub fn with_other_modes(mut self, open: OtherModes) -> Self {
        self.other_modes = Some(open);
        self
    }

    /// The backend volume `id` lives in: the one of the mode its state records (opened on
    /// first use), the driver's own for a volume it does not know.
    pub fn backend_of(&self, id: &str) -> Result<Arc<dyn Backend>, VolumeError> {
        let own = self.backend.mode();
        let recorded = self
            .get(id)
            .and_then(|v| v.parameters.get(parameters::DEVICE_MODE).cloned());
        let Some(recorded) = recorded else {
            return Ok(self.backend.clone());
        };
        let mode = DeviceMode::parse(&recorded).ok_or_else(|| {
            VolumeError::Precondition(format!(
                "volume {id} records unknown device mode {recorded:?}"
            ))
        })?;
        if mode == own {
            return Ok(self.backend.clone());
        }
        let mut opened = self.opened.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(backend) = opened.get(&mode) {
            return Ok(backend.clone());
        }
        let refused = |why: String| {
            VolumeError::Precondition(format!(
                "volume {id} lives in device mode {}, this driver runs {}: {why}",
                mode.as_str(),
                own.as_str()
            ))
        };
        let open = self
            .other_modes
            .as_ref()
            .ok_or_else(|| refused("other modes are not enabled".into()))?;
        let backend = blocking(|| open(mode)).map_err(|e| refused(e.to_string()))?;
        tracing::info!(
            id,
            mode = mode.as_str(),
            "opened the backend of another device mode"
        );
        opened.insert(mode, backend.clone());
        Ok(backend)
    }

    fn index(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, VolumeState>> {
        self.index.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes state and backend agree: state without a device is a create that crashed before
    /// the device existed (or a delete after it was gone) and is dropped; a device without
    /// state cannot come from a completed create (state is written first) and is deleted;
    /// loop devices nothing mounts are detached.
    /// Start-up repair (rules in `repair.rs`): gathers the facts, lets [`repair::plan`] decide,
    /// applies the plan.
    fn repair(&self) -> Result<(), VolumeError> {
        let mode = self.backend.mode().as_str();
        let (stored, corrupt) = self.state.load_all()?;
        let mut quarantined_ids = std::collections::BTreeSet::new();
        for e in corrupt {
            let crate::state::StateError::Corrupt { path, .. } = &e else {
                return Err(e.into());
            };
            let id = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(repair::id_of_state_file)
                .map(str::to_string);
            let moved = self.state.quarantine(path)?;
            tracing::error!(
                moved = %moved.display(),
                "{e}; quarantined, its device is kept"
            );
            quarantined_ids.extend(id);
        }
        let mut index = BTreeMap::new();
        let mut recorded = Vec::new();
        for volume in stored {
            let in_mode = volume
                .parameters
                .get(parameters::DEVICE_MODE)
                .map(String::as_str)
                .unwrap_or(mode);
            if in_mode != mode {
                tracing::warn!(
                    id = volume.id,
                    recorded = in_mode,
                    mode,
                    "volume of another device mode kept as is"
                );
                index.insert(volume.id.clone(), volume);
                continue;
            }
            let size = u64::try_from(volume.size).unwrap_or(0);
            let device = self
                .backend
                .size_of(&volume.id)
                .map_err(VolumeError::Backend)?;
            // Only the fake backend adopts (its memory went with the process); asked only when
            // the device is missing.
            let adoptable = device.is_none() && self.backend.adopt(&volume.id, size);
            recorded.push(repair::Recorded {
                id: volume.id.clone(),
                size,
                device,
                adoptable,
                growing_from: volume.growing_from.and_then(|s| u64::try_from(s).ok()),
            });
            index.insert(volume.id.clone(), volume);
        }
        let devices = self
            .backend
            .list()
            .map_err(VolumeError::Backend)?
            .into_iter()
            .collect();
        let has_pools = !self
            .backend
            .capacity()
            .map_err(VolumeError::Backend)?
            .pools
            .is_empty();
        let plan = repair::plan(
            &recorded,
            &self.state.pending()?,
            &quarantined_ids,
            &devices,
            has_pools,
            self.backend.partial_creates(),
        )?;
        for id in &plan.short {
            tracing::warn!(
                id,
                recorded = index[id].size,
                "repair: the volume's device is shorter than its state records, and no create was under way; kept as it is"
            );
        }
        for id in &plan.complete {
            let volume = &index[id];
            let size = u64::try_from(volume.size).unwrap_or(0);
            tracing::info!(id, size, "repair: completing an interrupted allocation");
            let usage = Parameters::parse(&volume.parameters, Origin::State)
                .map(|p| p.usage())
                .unwrap_or_default();
            self.backend
                .create(id, size, usage)
                .map_err(|e| VolumeError::backend(id, e))?;
        }
        for id in &plan.finish_growth {
            let volume = &index[id];
            let size = u64::try_from(volume.size).unwrap_or(0);
            let settled = match self.backend.grow(id, size) {
                Ok(()) => {
                    tracing::info!(id, size, "repair: finished an interrupted growth");
                    VolumeState {
                        growing_from: None,
                        ..volume.clone()
                    }
                }
                // No room (or a mode that cannot grow): undone, the device kept its old size.
                // Anything else may pass (a tool failing once): the start fails and is retried,
                // the growth still recorded.
                Err(e @ (BackendError::NoSpace { .. } | BackendError::CannotGrow { .. })) => {
                    let old = volume.growing_from.unwrap_or(volume.size);
                    tracing::warn!(
                        id,
                        size,
                        old,
                        "repair: an interrupted growth cannot finish ({e}); the volume keeps its old size, and the next NodeExpandVolume says why"
                    );
                    VolumeState {
                        size: old,
                        growing_from: None,
                        ..volume.clone()
                    }
                }
                Err(e) => return Err(VolumeError::backend(id, e)),
            };
            self.state.write(&settled)?;
            index.insert(id.clone(), settled);
        }
        for id in &plan.forget {
            tracing::info!(
                id,
                "repair: removing the state of a volume whose create or delete was interrupted without a device"
            );
            self.state.remove(id)?;
            index.remove(id);
        }
        for id in &plan.clear_pending {
            self.state.clear_pending(id)?;
        }
        let report = repair::RepairReport {
            unrecorded: plan.unrecorded,
            quarantined: plan.quarantined,
        };
        for (id, advice) in repair::advice(&report) {
            tracing::warn!(id, mode, "repair: {advice}");
        }
        for released in self
            .backend
            .release_unused(&|id| index.contains_key(id))
            .map_err(VolumeError::Backend)?
        {
            tracing::info!(device = released, "repair: detached an unused loop device");
        }
        tracing::info!(
            volumes = index.len(),
            unrecorded = report.unrecorded.len(),
            quarantined = report.quarantined.len(),
            mode,
            "node state loaded"
        );
        *self.index() = index;
        *self
            .repair_report
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = report;
        Ok(())
    }

    /// The devices start-up kept without a usable state (for metrics).
    pub fn repair_report(&self) -> repair::RepairReport {
        self.repair_report
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Serializes operations on one volume; different volumes proceed concurrently.
    pub async fn lock(&self, id: &str) -> VolumeGuard {
        let lock = {
            let mut locks = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
            locks.entry(id.to_string()).or_default().clone()
        };
        VolumeGuard {
            guard: Some(lock.lock_owned().await),
            id: id.to_string(),
            locks: self.locks.clone(),
        }
    }

    /// How many volumes have a lock entry: those locked or waited for right now.
    pub fn lock_entries(&self) -> usize {
        self.locks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The stored volume `id`.
    pub fn get(&self, id: &str) -> Option<VolumeState> {
        self.index().get(id).cloned()
    }

    /// Every volume, sorted by ID.
    pub fn list(&self) -> Vec<VolumeState> {
        self.index().values().cloned().collect()
    }

    /// Current capacity.
    pub fn capacity(&self) -> Result<Capacity, VolumeError> {
        let capacity = blocking(|| self.backend.capacity()).map_err(VolumeError::Backend)?;
        *self
            .last_capacity
            .lock()
            .unwrap_or_else(PoisonError::into_inner) =
            Some((capacity.clone(), std::time::Instant::now()));
        Ok(capacity)
    }

    /// The last capacity read, if a create or delete has not changed it since and it is younger
    /// than `max_age`; otherwise read anew (for `/metrics`).
    pub fn recent_capacity(&self, max_age: std::time::Duration) -> Result<Capacity, VolumeError> {
        if let Some((capacity, at)) = self
            .last_capacity
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            && at.elapsed() < max_age
        {
            return Ok(capacity.clone());
        }
        self.capacity()
    }

    /// A receiver that changes after every create and delete (for the capacity publisher).
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn changed(&self) {
        *self
            .last_capacity
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
        self.changes.send_modify(|generation| *generation += 1);
    }

    /// CreateVolume: returns the existing matching volume or creates a new one; state is
    /// written before the device exists and removed if creating the device fails.
    pub async fn create(&self, request: CreateRequest) -> Result<VolumeState, VolumeError> {
        let id = volume_id(&request.name);
        let _guard = self.lock(&id).await;
        if let Some(existing) = self.get(&id) {
            let other = existing
                .parameters
                .get(parameters::NAME)
                .cloned()
                .unwrap_or_default();
            if other != request.name {
                return Err(VolumeError::Collision {
                    id,
                    name: request.name,
                    other,
                });
            }
            judge_existing(&existing, &request)?;
            return Ok(existing);
        }
        let size = new_volume_size(
            request.required,
            request.limit,
            self.default_size,
            self.backend.alignment(),
        )?;
        let mut parameters = request.parameters.clone();
        parameters.name = Some(request.name.clone());
        parameters.device_mode = Some(self.backend.mode().as_str().to_string());
        let volume = VolumeState {
            id: id.clone(),
            size: i64::try_from(size).map_err(|_| {
                VolumeError::OutOfRange(format!(
                    "required_bytes {}: {size} bytes after rounding up to the alignment is more than a volume can hold",
                    request.required
                ))
            })?,
            parameters: parameters.to_context(),
            growing_from: None,
        };
        blocking(|| {
            // Fail fast without touching the state directory when it cannot fit.
            let capacity = self.backend.capacity().map_err(VolumeError::Backend)?;
            if size > capacity.max_volume_size() {
                return Err(VolumeError::backend(
                    &request.name,
                    crate::backend::BackendError::NoSpace {
                        need: size,
                        largest: capacity.max_volume_size(),
                        free: capacity.available(),
                    },
                ));
            }
            // The marker tells start-up that a missing device is this create's, not a loss;
            // the state's directory sync below makes it durable with the state.
            self.state.mark_pending(&id, false)?;
            self.state.write(&volume)?;
            crate::faults::point("after-state-write");
            if let Err(e) = self.backend.create(&id, size, request.parameters.usage()) {
                if let Err(cleanup) = self.state.remove(&id) {
                    tracing::error!(id, "removing state after a failed create: {cleanup}");
                }
                let _ = self.state.clear_pending(&id);
                return Err(VolumeError::backend(&request.name, e));
            }
            crate::faults::point("after-allocation");
            self.state.clear_pending(&id)?;
            Ok(())
        })?;
        self.index().insert(id.clone(), volume.clone());
        self.changed();
        tracing::info!(id, name = request.name, size, "volume created");
        Ok(volume)
    }

    /// NodeExpandVolume's growth, for a caller that holds the volume's lock: the device grows
    /// to [`grown_size`]. The state records the new size with the old one before the device
    /// grows (start-up finishes or undoes a growth a crash cut short), and the old size alone
    /// again when the backend refuses, which then has changed nothing.
    pub fn expand_locked(
        &self,
        id: &str,
        required: u64,
        limit: u64,
    ) -> Result<VolumeState, VolumeError> {
        let volume = self
            .get(id)
            .ok_or_else(|| VolumeError::Unknown { id: id.into() })?;
        let backend = self.backend_of(id)?;
        let current = u64::try_from(volume.size).unwrap_or(0);
        let size = grown_size(required, limit, current, backend.alignment())?;
        if size == current {
            return Ok(volume);
        }
        if let Some(reason) = backend.growth_refused() {
            return Err(VolumeError::Backend(BackendError::CannotGrow {
                mode: backend.mode().as_str(),
                reason,
            }));
        }
        let settled = VolumeState {
            size: i64::try_from(size).unwrap_or(i64::MAX),
            // A state a failed settling left growing is settled by this growth too.
            growing_from: None,
            ..volume.clone()
        };
        let growing = VolumeState {
            growing_from: Some(volume.size),
            ..settled.clone()
        };
        blocking(|| {
            self.state.write(&growing)?;
            crate::faults::point("after-growth-state-write");
            if let Err(e) = backend.grow(id, size) {
                // Unless the old size is recorded again, start-up would finish this growth
                // later: the call must then fail as retriable, not as refused.
                self.state.write(&volume)?;
                // No room is OUT_OF_RANGE, which kubelet takes as final (the user may ask
                // for less) instead of retrying for ever.
                return Err(match e {
                    BackendError::NoSpace { .. } => VolumeError::OutOfRange(format!(
                        "volume {id} cannot grow from {current} to {size} bytes on this node: {e}"
                    )),
                    e => VolumeError::backend(id, e),
                });
            }
            crate::faults::point("after-growth");
            self.state.write(&settled).map_err(VolumeError::from)
        })?;
        self.index().insert(id.to_string(), settled.clone());
        self.changed();
        tracing::info!(id, from = current, to = size, "volume grown");
        Ok(settled)
    }

    /// DeleteVolume: an unknown ID succeeds. The device is removed (scrubbed per `eraseafter`)
    /// before the state, under a pending marker, so a crash in between leaves state that
    /// start-up repair drops.
    pub async fn delete(&self, id: &str) -> Result<(), VolumeError> {
        let _guard = self.lock(id).await;
        self.delete_locked(id)
    }

    /// [`Volumes::delete`] for a caller that holds the volume's lock.
    pub fn delete_locked(&self, id: &str) -> Result<(), VolumeError> {
        let Some(volume) = self.get(id) else {
            return Ok(());
        };
        let stored = Parameters::parse(&volume.parameters, Origin::State)?;
        let backend = self.backend_of(id)?;
        blocking(|| {
            self.state.mark_pending(id, true)?;
            if let Err(e) = backend.delete(id, stored.erase_after()) {
                // The volume lives on (in use, say): no marker may suggest otherwise.
                let _ = self.state.clear_pending(id);
                return Err(VolumeError::backend(id, e));
            }
            crate::faults::point("before-state-removal");
            self.state.remove(id)?;
            self.state.clear_pending(id).map_err(VolumeError::from)
        })?;
        self.index().remove(id);
        self.changed();
        tracing::info!(id, erased = stored.erase_after(), "volume deleted");
        Ok(())
    }
}

impl std::fmt::Debug for Volumes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Volumes")
            .field("backend", &self.backend)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl controllers::CapacitySource for Volumes {
    type Error = VolumeError;

    fn capacity(&self) -> Result<controllers::NodeCapacity, VolumeError> {
        Ok(Volumes::capacity(self)?
            .into_node_capacity(self.backend.alignment(), self.backend.overhead()))
    }

    fn changes(&self) -> watch::Receiver<u64> {
        Volumes::changes(self)
    }
}

impl controllers::orphan_sweep::SweepTarget for Volumes {
    fn candidates(&self) -> Vec<controllers::orphan_sweep::SweepCandidate> {
        let mode = self.backend.mode().as_str();
        self.list()
            .into_iter()
            .filter(|v| {
                v.parameters
                    .get(parameters::DEVICE_MODE)
                    .is_none_or(|m| m == mode)
                    && v.parameters
                        .get(parameters::PERSISTENCY_MODEL)
                        .map(String::as_str)
                        != Some("ephemeral")
            })
            .map(|v| {
                let age = self
                    .state
                    .written_at(&v.id)
                    .and_then(|t| t.elapsed().ok())
                    .unwrap_or_default();
                let get = |k: &str| v.parameters.get(k).cloned();
                controllers::orphan_sweep::SweepCandidate {
                    claim: get(parameters::PVC_NAMESPACE).zip(get(parameters::PVC_NAME)),
                    pv_name: get(parameters::PV_NAME),
                    id: v.id,
                    age,
                }
            })
            .collect()
    }

    async fn delete(&self, id: &str) -> Result<(), String> {
        Volumes::delete(self, id).await.map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{FAKE_ALIGNMENT, Fake};
    use crate::parameters::Usage;
    use std::path::PathBuf;

    const MI: u64 = 1 << 20;
    const A: u64 = 4 * MI;

    #[test]
    fn new_volume_size_table() {
        for (required, limit, want) in [
            (0, 0, Ok(8 * MI)),
            (1, 0, Ok(A)),
            (A, 0, Ok(A)),
            (A + 1, 0, Ok(2 * A)),
            (A + 1, 2 * A, Ok(2 * A)),
            (A + 1, A + 2, Err("above limit_bytes")),
            (2 * A, A, Err("exceeds limit_bytes")),
            (0, A, Ok(A)),
            (0, 3 * MI, Err("above limit_bytes")),
            (
                u64::MAX,
                0,
                Err(
                    "required_bytes 18446744073709551615: 18446744073709551615 bytes cannot be rounded up",
                ),
            ),
        ] {
            let got = new_volume_size(required, limit, 8 * MI, A);
            match (got, want) {
                (Ok(g), Ok(w)) => assert_eq!(g, w, "{required} {limit}"),
                (Err(e), Err(w)) => {
                    assert_eq!(e.code(), tonic::Code::OutOfRange);
                    assert!(e.to_string().contains(w), "{required} {limit}: {e}");
                }
                (g, w) => panic!("{required} {limit}: got {g:?}, want {w:?}"),
            }
        }
    }

    fn existing(size: i64, params: &[(&str, &str)]) -> VolumeState {
        VolumeState {
            id: "id".into(),
            size,
            parameters: params
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            growing_from: None,
        }
    }

    fn request(required: u64, limit: u64, parameters: Parameters) -> CreateRequest {
        CreateRequest {
            name: "v".into(),
            required,
            limit,
            parameters,
        }
    }

    #[test]
    fn judge_existing_table() {
        let no_erase = Parameters {
            erase_after: Some(false),
            ..Default::default()
        };
        for (name, volume, req, ok) in [
            (
                "same size",
                existing(8, &[("name", "v")]),
                request(8, 0, Parameters::default()),
                true,
            ),
            (
                "larger than required",
                existing(8, &[]),
                request(4, 0, Parameters::default()),
                true,
            ),
            (
                "smaller than required",
                existing(8, &[]),
                request(12, 0, Parameters::default()),
                false,
            ),
            (
                "above limit",
                existing(8, &[]),
                request(4, 6, Parameters::default()),
                false,
            ),
            (
                "within limit",
                existing(8, &[]),
                request(4, 8, Parameters::default()),
                true,
            ),
            (
                "other parameters",
                existing(8, &[("eraseafter", "true")]),
                request(8, 0, no_erase.clone()),
                false,
            ),
            (
                "same explicit parameters",
                existing(8, &[("eraseafter", "false")]),
                request(8, 0, no_erase),
                true,
            ),
        ] {
            let got = judge_existing(&volume, &req);
            assert_eq!(got.is_ok(), ok, "{name}: {got:?}");
            if let Err(e) = got {
                assert_eq!(e.code(), tonic::Code::AlreadyExists, "{name}");
            }
        }
    }

    fn volumes(dir: &std::path::Path, size: u64) -> Volumes {
        Volumes::open(
            Arc::new(Fake::new(size)),
            StateStore::open(dir).expect("state"),
            FAKE_ALIGNMENT,
        )
        .expect("open")
    }

    #[tokio::test]
    async fn create_is_idempotent_and_state_survives_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let v = volumes(dir.path(), 16 * MI);
        let req = request(MI, 0, Parameters::default());
        let first = v.create(req.clone()).await.expect("create");
        assert_eq!(first.size, A as i64);
        assert_eq!(first.id, volume_id("v"));
        assert_eq!(
            first.parameters.get("deviceMode").map(String::as_str),
            Some("fake")
        );
        assert_eq!(first.parameters.get("name").map(String::as_str), Some("v"));
        assert_eq!(v.create(req).await.expect("again"), first);
        let mut changes = v.changes();
        assert!(!changes.has_changed().expect("open"));
        drop(v);
        let reopened = volumes(dir.path(), 16 * MI);
        assert_eq!(
            reopened.get(&first.id),
            Some(first.clone()),
            "fake adopts state"
        );
        changes = reopened.changes();
        reopened.delete(&first.id).await.expect("delete");
        assert!(
            changes.has_changed().expect("open"),
            "a delete is announced"
        );
        reopened.delete(&first.id).await.expect("delete unknown");
        assert!(reopened.list().is_empty());
    }

    #[test]
    fn grown_size_table() {
        for (case, required, limit, current, want) in [
            ("grows to the aligned size", A + 1, 0, A, Ok(2 * A)),
            ("exactly aligned", 3 * A, 0, A, Ok(3 * A)),
            ("never shrinks", A, 0, 2 * A, Ok(2 * A)),
            ("no size asked: as is", 0, 0, 2 * A, Ok(2 * A)),
            ("within the limit", A + 1, 2 * A, A, Ok(2 * A)),
            (
                "required above limit",
                3 * A,
                2 * A,
                A,
                Err("exceeds limit_bytes"),
            ),
            (
                "aligned above limit",
                A + 1,
                A + 2,
                A,
                Err("above limit_bytes"),
            ),
            ("already above limit", A, A, 2 * A, Err("already holds")),
            ("overflow", u64::MAX, 0, A, Err("cannot be rounded up")),
            (
                "above i64",
                u64::MAX / 2 + A,
                0,
                A,
                Err("more than a volume can hold"),
            ),
        ] {
            match (grown_size(required, limit, current, A), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{case}"),
                (Err(e), Err(want)) => {
                    assert!(matches!(e, VolumeError::OutOfRange(_)), "{case}: {e}");
                    assert!(e.to_string().contains(want), "{case}: {e}");
                }
                (got, want) => panic!("{case}: got {got:?}, want {want:?}"),
            }
        }
    }

    fn stored(dir: &std::path::Path, id: &str) -> serde_json::Value {
        let text = std::fs::read(dir.join(format!("{id}.json"))).expect("state file");
        serde_json::from_slice(&text).expect("JSON")
    }

    #[tokio::test]
    async fn growth_is_recorded_and_bounded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let v = volumes(dir.path(), 16 * MI);
        let created = v.create(request(4 * MI, 0, Parameters::default())).await;
        let id = created.expect("create").id;
        let other = v.create(CreateRequest {
            name: "w".into(),
            ..request(4 * MI, 0, Parameters::default())
        });
        other.await.expect("second volume");
        let mut changes = v.changes();
        changes.mark_unchanged();

        let grown = v.expand_locked(&id, 8 * MI, 0).expect("grows");
        assert_eq!((grown.size, grown.growing_from), (8 * MI as i64, None));
        assert!(
            changes.has_changed().expect("open"),
            "a growth is announced"
        );
        assert_eq!(stored(dir.path(), &id)["size"], serde_json::json!(8 * MI));
        assert_eq!(stored(dir.path(), &id).get("growingFrom"), None);
        assert_eq!(v.capacity().expect("capacity").available(), 4 * MI);
        assert_eq!(v.expand_locked(&id, 8 * MI, 0).expect("again"), grown);

        let err = v.expand_locked(&id, 16 * MI, 0).expect_err("no room");
        assert!(matches!(err, VolumeError::OutOfRange(_)), "{err}");
        assert!(err.to_string().contains("4194304 bytes free"), "{err}");
        assert!(
            err.to_string().contains("from 8388608 to 16777216 bytes"),
            "{err}"
        );
        assert_eq!(stored(dir.path(), &id)["size"], serde_json::json!(8 * MI));
        assert_eq!(stored(dir.path(), &id).get("growingFrom"), None);
        assert_eq!(v.get(&id), Some(grown));

        let err = v.expand_locked("nope", MI, 0).expect_err("unknown");
        assert!(matches!(err, VolumeError::Unknown { .. }), "{err}");
    }

    #[tokio::test]
    async fn start_up_settles_an_interrupted_growth() {
        let dir = tempfile::tempdir().expect("tempdir");
        let v = volumes(dir.path(), 16 * MI);
        let created = v.create(request(4 * MI, 0, Parameters::default())).await;
        let volume = created.expect("create");
        drop(v);
        let growing = VolumeState {
            size: 8 * MI as i64,
            growing_from: Some(volume.size),
            ..volume.clone()
        };
        StateStore::open(dir.path())
            .expect("state")
            .write(&growing)
            .expect("write");
        let reopened = volumes(dir.path(), 16 * MI);
        let settled = VolumeState {
            growing_from: None,
            ..growing
        };
        assert_eq!(reopened.get(&volume.id), Some(settled));
        assert_eq!(stored(dir.path(), &volume.id).get("growingFrom"), None);
    }

    /// Locks of deleted and made-up IDs are forgotten; a lock someone waits for is not.
    #[tokio::test]
    async fn lock_entries_do_not_outlive_their_use() {
        let dir = tempfile::tempdir().expect("tempdir");
        let v = Arc::new(volumes(dir.path(), 16 * MI));
        for i in 0..50 {
            let mut req = request(MI, 0, Parameters::default());
            req.name = format!("v{i}");
            let created = v.create(req).await.expect("create");
            v.delete(&created.id).await.expect("delete");
            v.delete(&format!("no-such-volume-{i}"))
                .await
                .expect("unknown");
        }
        assert_eq!(
            v.lock_entries(),
            0,
            "entries of deleted or unknown IDs left"
        );

        let held = v.lock("a").await;
        let waiter = {
            let v = v.clone();
            tokio::spawn(async move {
                let _second = v.lock("a").await;
                v.lock_entries()
            })
        };
        // The waiter has cloned the entry once it is queued behind the held guard.
        while Arc::strong_count(
            v.locks
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get("a")
                .expect("entry"),
        ) < 3
        {
            tokio::task::yield_now().await;
        }
        drop(held);
        assert_eq!(
            waiter.await.expect("join"),
            1,
            "the waiter's entry survived the first guard"
        );
        assert_eq!(v.lock_entries(), 0);
    }

    /// A fake backend that counts its capacity reads (each a `vgs` or `ndctl list` on PMEM).
    #[derive(Debug)]
    struct CountingReads {
        inner: Fake,
        reads: std::sync::atomic::AtomicUsize,
    }

    impl Backend for CountingReads {
        fn mode(&self) -> DeviceMode {
            self.inner.mode()
        }
        fn alignment(&self) -> u64 {
            self.inner.alignment()
        }
        fn capacity(&self) -> Result<Capacity, BackendError> {
            self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.inner.capacity()
        }
        fn create(&self, id: &str, size: u64, usage: Usage) -> Result<(), BackendError> {
            self.inner.create(id, size, usage)
        }
        fn delete(&self, id: &str, erase: bool) -> Result<(), BackendError> {
            self.inner.delete(id, erase)
        }
        fn size_of(&self, id: &str) -> Result<Option<u64>, BackendError> {
            self.inner.size_of(id)
        }
        fn list(&self) -> Result<Vec<String>, BackendError> {
            self.inner.list()
        }
        fn attach(&self, id: &str) -> Result<PathBuf, BackendError> {
            self.inner.attach(id)
        }
        fn attached(&self, id: &str) -> Result<Option<PathBuf>, BackendError> {
            self.inner.attached(id)
        }
        fn detach(&self, id: &str) -> Result<(), BackendError> {
            self.inner.detach(id)
        }
    }

    /// Scrapes are served the last figures until a create or delete changes them or they age.
    #[tokio::test]
    async fn recent_capacity_reads_the_backend_once_per_change() {
        let dir = tempfile::tempdir().expect("tempdir");
        let backend = Arc::new(CountingReads {
            inner: Fake::new(16 * MI),
            reads: Default::default(),
        });
        let v = Volumes::open(
            backend.clone(),
            StateStore::open(dir.path()).expect("state"),
            FAKE_ALIGNMENT,
        )
        .expect("open");
        let reads = || backend.reads.load(std::sync::atomic::Ordering::SeqCst);
        let hour = std::time::Duration::from_secs(3600);
        let start = reads();
        for _ in 0..10 {
            assert_eq!(
                v.recent_capacity(hour).expect("capacity").available(),
                16 * MI
            );
        }
        assert_eq!(reads() - start, 1, "ten scrapes, one read");
        v.create(request(MI, 0, Parameters::default()))
            .await
            .expect("create");
        let after_create = reads();
        for _ in 0..10 {
            assert_eq!(
                v.recent_capacity(hour).expect("capacity").available(),
                12 * MI
            );
        }
        assert_eq!(reads() - after_create, 1, "a create invalidates once");
        v.recent_capacity(std::time::Duration::ZERO)
            .expect("capacity");
        assert_eq!(reads() - after_create, 2, "an aged figure is read anew");
    }

    #[tokio::test]
    async fn capacity_source_reports_pools_and_changes() {
        use controllers::CapacitySource;
        let dir = tempfile::tempdir().expect("tempdir");
        let v = volumes(dir.path(), 16 * MI);
        let changes = CapacitySource::changes(&v);
        let before = CapacitySource::capacity(&v).expect("capacity");
        assert_eq!(
            (before.available(), before.alignment, before.pools.len()),
            (16 * MI, A, 1)
        );
        v.create(request(MI, 0, Parameters::default()))
            .await
            .expect("create");
        assert!(
            changes.has_changed().expect("open"),
            "a create is announced"
        );
        let after = CapacitySource::capacity(&v).expect("capacity");
        assert_eq!(after.available(), 12 * MI);
        assert_eq!(after.maximum_volume_size(), 12 * MI);
    }

    #[tokio::test]
    async fn no_space_leaves_no_state() {
        let dir = tempfile::tempdir().expect("tempdir");
        let v = volumes(dir.path(), 8 * MI);
        let err = v
            .create(request(12 * MI, 0, Parameters::default()))
            .await
            .expect_err("too big");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted);
        assert!(err.to_string().contains("12582912"), "{err}");
        assert!(
            StateStore::open(dir.path())
                .expect("state")
                .load_all()
                .expect("load")
                .0
                .is_empty()
        );
    }
}
