//! The storage guard: a full clone is admitted only when the storages its
//! disks land on can hold them.
//!
//! PVE checks room only when the clone worker allocates (and a thin pool
//! not even then: it overcommits until a write fails inside a guest). So
//! before a full clone the guard reads each target storage's status on the
//! node the clone worker runs on (`GET /nodes/{node}/storage/{id}/status`,
//! its `avail`), subtracts what the provider's clones admitted there and
//! not yet done will take, and refuses the Create when the clone's disks do
//! not fit in `avail x overcommit` (`--storage-overcommit`, 1 unless a
//! thin pool says otherwise). Linked clones are not counted: their delta
//! starts empty.
//!
//! A claim is made at admission (refused there: RESOURCE_EXHAUSTED, nothing
//! cloned) and lives until the clone task ends, when PVE's own figures hold
//! the disks; the Create's clone step rejoins its admission's claim
//! without another read. A shared storage is one pool whichever node reads
//! it, so its claims are counted together.
//!
//! While a clone runs PVE may count its disks already (a thick volume is
//! allocated whole when the worker starts; a thin one grows as it is
//! copied), and its claim still stands: counting both would refuse Creates
//! that fit. So the free space the guard counts from is the smaller of
//!
//! - the last figure read while none of the provider's clones was in flight
//!   there, less what each clone that ended since took (exact, unless
//!   someone else fills the storage meanwhile), and
//! - the figure just read, plus the claims of the clones already started
//!   (PVE may count them whole: an upper bound, which catches someone
//!   else's use),
//!
//! and every claim is subtracted from it.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use providerkit::ErrorKind;
use pve::StorageStatus;
use tokio::time::Instant;

use super::api::{err_at, Api};
use super::inventory::Inventory;
use super::options::PveOptions;
use crate::capacity::{NoSpace, StorageSpace};
use crate::substrate::SubstrateError;

/// A storage as the guard counts it: shared ones by id alone.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct SpaceKey {
    storage: String,
    /// `None`: shared.
    node: Option<String>,
}

/// What is known of one storage's free space.
#[derive(Clone, Copy, Debug)]
struct Seen {
    /// `avail` as last read.
    read: u64,
    /// `avail` as last read while no clone of ours was in flight there,
    /// less what each clone that ended since took.
    clean: u64,
}

#[derive(Default)]
struct Ledger {
    /// Per storage: machine -> (claim id, bytes).
    claims: BTreeMap<SpaceKey, HashMap<String, (u64, u64)>>,
    seen: BTreeMap<SpaceKey, Seen>,
}

impl Ledger {
    fn in_flight(&self, key: &SpaceKey) -> u64 {
        self.claims
            .get(key)
            .map_or(0, |m| m.values().map(|(_, b)| b).sum())
    }

    /// The claims on `key` whose clone has started (`started` says so of a
    /// holder), bytes.
    fn started(&self, key: &SpaceKey, started: &dyn Fn(&str) -> bool) -> u64 {
        self.claims.get(key).map_or(0, |m| {
            m.iter()
                .filter(|(holder, _)| started(holder))
                .map(|(_, (_, b))| b)
                .sum()
        })
    }

    /// Records a fresh read of `key`.
    fn read(&mut self, key: &SpaceKey, avail: u64) {
        let idle = self.claims.get(key).is_none_or(HashMap::is_empty);
        let seen = self.seen.entry(key.clone()).or_insert(Seen {
            read: avail,
            clean: avail,
        });
        seen.read = avail;
        if idle {
            seen.clean = avail;
        }
    }

    /// The free space the guard counts from (see the module's doc).
    fn avail(&self, key: &SpaceKey, started: &dyn Fn(&str) -> bool) -> Option<u64> {
        let seen = self.seen.get(key)?;
        Some(
            seen.clean
                .min(seen.read.saturating_add(self.started(key, started))),
        )
    }

    fn holds(&self, machine_id: &str) -> Option<u64> {
        self.claims
            .values()
            .find_map(|m| m.get(machine_id).map(|(id, _)| *id))
    }
}

/// A Create's claim on its storages; given back on drop (by whichever of
/// its holders drops first: the clone step's, when the clone task ends, or
/// the admission's, when the Create's outcome lands).
pub(super) struct StorageClaim {
    ledger: Arc<Mutex<Ledger>>,
    machine_id: String,
    id: u64,
}

impl std::fmt::Debug for StorageClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StorageClaim({})", self.machine_id)
    }
}

impl Ledger {
    /// Ends claim `id` of `holder`: what it held, by storage.
    fn end(&mut self, holder: &str, id: u64) -> Vec<(SpaceKey, u64)> {
        let mut ended = Vec::new();
        for (key, per) in self.claims.iter_mut() {
            if per.get(holder).is_some_and(|(held, _)| *held == id) {
                if let Some((_, bytes)) = per.remove(holder) {
                    ended.push((key.clone(), bytes));
                }
            }
        }
        self.claims.retain(|_, per| !per.is_empty());
        ended
    }
}

impl StorageClaim {
    /// The clone task ended well: PVE holds the disks now, so the free
    /// space known clean is lowered by what the claim held (an estimate
    /// until the next read with nothing in flight: a thin pool holds
    /// less), and the claim ends.
    pub(super) fn landed(self) {
        let mut ledger = self.ledger.lock();
        for (key, bytes) in ledger.end(&self.machine_id, self.id) {
            if let Some(seen) = ledger.seen.get_mut(&key) {
                seen.clean = seen.clean.saturating_sub(bytes);
            }
        }
    }
}

impl Drop for StorageClaim {
    fn drop(&mut self) {
        self.ledger.lock().end(&self.machine_id, self.id);
    }
}

/// Why a claim was not made.
#[derive(Debug)]
pub(super) enum SpaceError {
    NoSpace(NoSpace),
    /// A storage could not be read, or cannot be used at all.
    Unread(SubstrateError),
}

impl From<SubstrateError> for SpaceError {
    fn from(e: SubstrateError) -> SpaceError {
        SpaceError::Unread(e)
    }
}

impl SpaceError {
    /// As the clone step fails with it: no room is not a passing fault
    /// there (the Create was admitted, or the guard could not check then).
    pub(super) fn into_substrate(self) -> SubstrateError {
        match self {
            SpaceError::NoSpace(no_space) => SubstrateError::caused_by(
                ErrorKind::Permanent,
                "the storage guard refused the clone",
                no_space,
            ),
            SpaceError::Unread(e) => e,
        }
    }
}

/// What one Create asks of the guard.
pub(super) struct SpaceRequest<'a> {
    /// Whose claim it is: a machine id, or a replica being staged.
    pub(super) holder: &'a str,
    /// The node the clone worker runs on (where the storages are read).
    pub(super) node: &'a str,
    /// Bytes per storage id.
    pub(super) needs: &'a BTreeMap<String, u64>,
    /// What needs them, for the refusal (naming the machine).
    pub(super) what: String,
}

pub(super) struct StorageGuard {
    api: Arc<Api>,
    opts: Arc<PveOptions>,
    /// Whose clone has started (a machine with a VMID in progress).
    inventory: Arc<Inventory>,
    ledger: Arc<Mutex<Ledger>>,
    next_id: AtomicU64,
    /// The token may not read storage status (no `Datastore.Audit` or
    /// `Datastore.AllocateSpace` there): nothing is checked.
    status_refused: AtomicBool,
}

impl StorageGuard {
    pub(super) fn new(
        api: Arc<Api>,
        opts: Arc<PveOptions>,
        inventory: Arc<Inventory>,
    ) -> StorageGuard {
        StorageGuard {
            api,
            opts,
            inventory,
            ledger: Arc::default(),
            next_id: AtomicU64::new(1),
            status_refused: AtomicBool::new(false),
        }
    }

    fn overcommit(&self, storage: &str) -> f64 {
        self.opts
            .storage_overcommit
            .get(storage)
            .copied()
            .unwrap_or(1.0)
    }

    /// Whether `holder`'s clone has started (PVE may count its disks).
    fn started(&self) -> impl Fn(&str) -> bool + '_ {
        |holder| self.inventory.pending(holder).is_some()
    }

    /// One storage as the guard counts it now.
    fn space(&self, ledger: &Ledger, key: &SpaceKey) -> Option<StorageSpace> {
        Some(StorageSpace {
            storage: key.storage.clone(),
            node: key.node.clone(),
            avail_bytes: ledger.avail(key, &self.started())?,
            in_flight_bytes: ledger.in_flight(key),
            overcommit: self.overcommit(&key.storage),
        })
    }

    /// Each storage as last checked, with what is in flight there now.
    pub(super) fn spaces(&self) -> Vec<StorageSpace> {
        let ledger = self.ledger.lock();
        ledger
            .seen
            .keys()
            .filter_map(|key| self.space(&ledger, key))
            .collect()
    }

    /// Another holder of the machine's claim, if it has one (its
    /// admission's, when its clone step runs).
    fn rejoin(&self, machine_id: &str) -> Option<StorageClaim> {
        let id = self.ledger.lock().holds(machine_id)?;
        Some(StorageClaim {
            ledger: Arc::clone(&self.ledger),
            machine_id: machine_id.to_string(),
            id,
        })
    }

    /// Reads `storage` on `node`. `Ok(None)`: nothing to check (the token
    /// may not read it, or PVE gives no `avail`).
    async fn read(
        &self,
        node: &str,
        storage: &str,
        deadline: Instant,
    ) -> Result<Option<StorageStatus>, SubstrateError> {
        let st = match self
            .api
            .retry_raw(Some(node), deadline, |pve| pve.storage_status(node, storage))
            .await
        {
            Ok(st) => st,
            Err(e) if e.is_forbidden() => {
                if !self.status_refused.swap(true, Ordering::Relaxed) {
                    tracing::warn!(node, storage, error = %e,
                        "the API token may not read storage status; room is not checked before cloning \
                         (grant Datastore.AllocateSpace or Datastore.Audit on /storage/<id>)");
                }
                return Ok(None);
            }
            Err(e) if e.is_storage_missing() => {
                return Err(SubstrateError::caused_by(
                    ErrorKind::Permanent,
                    format!(
                        "storage {storage} does not exist on node {node} (or the API token may not use it): \
                         fix --node-storage or the instance type's `storage`"
                    ),
                    e,
                ))
            }
            Err(e) => {
                return Err(err_at(
                    format!("reading the free space of storage {storage} on node {node}"),
                    Some(node),
                    &e,
                ))
            }
        };
        // pve-storage reports a storage it could not use on this node with
        // `enabled` or `active` 0 and every size 0: that is no answer about
        // room, and cloning there fails whatever the size.
        if st.enabled == Some(false) {
            return Err(SubstrateError::new(format!(
                "storage {storage} is disabled on node {node} (storage.cfg leaves the node out of its `nodes`, \
                or disables it): enable it for node {node} (Datacenter > Storage), or point the instance \
                type (catalog `storage`) or the node (--node-storage) at a storage enabled there"
            )));
        }
        if st.active == Some(false) {
            return Err(SubstrateError::with_kind(
                ErrorKind::Transient,
                format!(
                    "storage {storage} is not active on node {node} (PVE could not activate it: its server \
                    or device is out of reach; `pvesm status` on {node} says why); a Create succeeds again once it is back"
                ),
            ));
        }
        Ok(st.avail.is_some().then_some(st))
    }

    /// Checks that the clone's disks fit on their storages beside the
    /// clones in flight, and claims them. A machine that already holds a
    /// claim (admitted) shares it, unchecked. `Ok(None)`: nothing to check.
    pub(super) async fn claim(
        &self,
        req: &SpaceRequest<'_>,
        deadline: Instant,
    ) -> Result<Option<StorageClaim>, SpaceError> {
        if let Some(held) = self.rejoin(req.holder) {
            return Ok(Some(held));
        }
        if self.status_refused.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let mut read = Vec::new();
        for (storage, bytes) in req.needs.iter().filter(|(_, b)| **b > 0) {
            let Some(st) = self
                .read(req.node, storage, deadline)
                .await
                .map_err(SpaceError::Unread)?
            else {
                continue;
            };
            let key = SpaceKey {
                storage: storage.clone(),
                node: (!st.shared).then(|| req.node.to_string()),
            };
            read.push((key, st.avail.unwrap_or(0), *bytes));
        }
        if read.is_empty() {
            return Ok(None);
        }
        let mut ledger = self.ledger.lock();
        for (key, avail, _) in &read {
            ledger.read(key, *avail);
        }
        for (key, _, bytes) in &read {
            let Some(space) = self.space(&ledger, key) else {
                continue;
            };
            if space.in_flight_bytes.saturating_add(*bytes) > space.allowed_bytes() {
                return Err(SpaceError::NoSpace(NoSpace {
                    space,
                    needed_bytes: *bytes,
                    what: req.what.clone(),
                }));
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        for (key, _, bytes) in read {
            ledger
                .claims
                .entry(key)
                .or_default()
                .insert(req.holder.to_string(), (id, bytes));
        }
        Ok(Some(StorageClaim {
            ledger: Arc::clone(&self.ledger),
            machine_id: req.holder.to_string(),
            id,
        }))
    }

    /// Reads `storage` on `node` for the gauge and the start-up line,
    /// claiming nothing; a storage that cannot be read is left as it was.
    pub(super) async fn observe(&self, node: &str, storage: &str, deadline: Instant) {
        if self.status_refused.load(Ordering::Relaxed) {
            return;
        }
        match self.read(node, storage, deadline).await {
            Ok(Some(st)) => {
                let key = SpaceKey {
                    storage: storage.to_string(),
                    node: (!st.shared).then(|| node.to_string()),
                };
                self.ledger.lock().read(&key, st.avail.unwrap_or(0));
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(node, storage, error = %e, "cannot read the storage's free space; it is checked by the next Create there");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn key() -> SpaceKey {
        SpaceKey {
            storage: "local-lvm".into(),
            node: Some("pve1".into()),
        }
    }

    fn claim(ledger: &mut Ledger, holder: &str, id: u64, bytes: u64) {
        ledger
            .claims
            .entry(key())
            .or_default()
            .insert(holder.into(), (id, bytes));
    }

    /// A clone PVE already counts is counted once, by its claim; a figure
    /// read while clones run does not replace the clean one; someone
    /// else's use shows through the fresh figure.
    #[test]
    fn a_running_clone_is_counted_once() {
        let mut ledger = Ledger::default();
        let none = |_: &str| false;
        ledger.read(&key(), 104 * GIB);
        claim(&mut ledger, "a", 1, 32 * GIB);
        claim(&mut ledger, "b", 2, 32 * GIB);
        // `a` started, and PVE allocated its disk whole.
        let a_started = |h: &str| h == "a";
        ledger.read(&key(), 72 * GIB);
        assert_eq!(ledger.avail(&key(), &a_started), Some(104 * GIB));
        assert_eq!(ledger.in_flight(&key()), 64 * GIB);
        // Had it not started, the 32 GiB gone are someone else's.
        assert_eq!(ledger.avail(&key(), &none), Some(72 * GIB));
        // Someone else took 50 GiB meanwhile: the fresh figure bounds it.
        ledger.read(&key(), 22 * GIB);
        assert_eq!(ledger.avail(&key(), &a_started), Some(54 * GIB));
        assert_eq!(
            ledger.seen[&key()].clean,
            104 * GIB,
            "not clean while in flight"
        );
        // With nothing in flight, a read is clean again.
        ledger.claims.clear();
        ledger.read(&key(), 40 * GIB);
        assert_eq!(ledger.avail(&key(), &none), Some(40 * GIB));
    }
}
