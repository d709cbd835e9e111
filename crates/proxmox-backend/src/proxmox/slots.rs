//! Clone slots: how many clones run at once per domain, the unit PVE
//! serialises on (the storage's lock) and whose bandwidth the copies
//! share; shared by Creates and replica stagings. A domain is the storages
//! a clone writes to ([`SlotDomain`]): on one node for local storage, and,
//! adaptive, the whole cluster for a shared one, whose lock (pve-storage
//! `cluster_lock_storage`) and bandwidth every node's clones share.
//!
//! Fixed, a (node, storage) has `--max-parallel-clones` slots. Adaptive
//! (the default), a domain starts at [`ADAPTIVE_START`] per node cloning to
//! it and moves within 1 and `--max-parallel-clones` per such node by what
//! its clones show, as TCP Vegas moves a window by round-trip times: a
//! copy runs at the lesser of what one stream reaches and its share of the
//! storage's bandwidth. From a clone's time against the shortest lately
//! seen of its template, and the clones it ran among (the domain's mean
//! held slots over its time, Little's law), Vegas's estimate of the copies
//! the storage did not need follows: `among * (1 - shortest / took)`.
//! Under [`ALPHA`] the storage had bandwidth to spare and a waiting clone
//! gets one more slot; over [`BETA`] more than one copy only shared it and
//! the domain gives one back. Between, the domain keeps one clone beyond
//! what fills the storage, which allocates under the storage's lock while
//! the others copy, so the disk does not idle through each allocation. A
//! storage-lock timeout (PVE's allocation lock queued past its 10 s)
//! halves the slots. A node never holds more than `--max-parallel-clones`
//! of a shared domain's slots: each copy is a `qemu-img` process on its
//! node.
//!
//! A node's own storage (adaptive) first learns ([`learn`]): its first
//! clone copies alone, then one more at a time, each reading its copy's
//! progress from its task's log, until the copies slow one another. That
//! gives one copy's rate alone and the disk's whole rate, so its fill (the
//! copies at once it holds) and its time per clone. From then on the
//! domain has one slot more than the fill and starts a clone each time
//! per clone (a pace, as GCRA spaces cells): clones end one after another
//! instead of in rounds whose copies shared the disk and ended together.
//! Vegas then only gives slots back (crowding, lock timeouts). A domain
//! whose clones show no progress (linked clones, fixed-duration test
//! doubles) gives learning up after its first clone and adapts as above.
//! What it learnt is kept for the process's life, in percent of the
//! template it learnt from.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::substrate::{CloneSlotsView, SubstrateError};

mod learn;
pub(super) use learn::Read;
use learn::{Learner, Learnt};

/// Where an adaptive domain starts, per node cloning to it: two clones at
/// once, the old fixed default.
pub(super) const ADAPTIVE_START: usize = 2;

/// Fewer copies than this beyond what the storage needed: it had
/// bandwidth to spare. Two clones on a storage one copy fills (one copies
/// while the other allocates) come to about 0.9, and two on one that two
/// fill to about 0: the first holds, the second grows.
const ALPHA: f64 = 0.5;

/// More than this beyond what the storage needed: one copy more than the
/// one that hides an allocation. Three on a storage one copy fills come to
/// about 1.8, three on one that two fill to about 0.9.
const BETA: f64 = 1.5;

/// Clones of a template remembered per domain for the shortest time: old
/// enough samples go, so a storage that got slower for good is learnt.
const WINDOW: usize = 32;

/// The node of a cluster-wide domain's key, as logs and metrics show it.
const CLUSTER: &str = "(cluster)";

/// Clone-slot key for a template's disk storages (sorted, deduplicated): one
/// storage is its id; several are joined into one stable key, so templates
/// spanning the same set of storages share a bound; none (a diskless
/// template) is a fixed placeholder.
pub(super) fn storage_key(storages: &[String]) -> String {
    if storages.is_empty() {
        "(no disks)".to_string()
    } else {
        storages.join("+")
    }
}

/// Where a clone's slots are counted: the storages it writes to, and
/// whether every one of them is shared by the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct SlotDomain {
    /// The storages as one key ([`storage_key`]).
    pub(super) storage: String,
    /// Shared: the lock is cluster-wide and the bandwidth one pool.
    pub(super) shared: bool,
}

/// The clone slots of every domain, made on first use.
pub(super) struct CloneSlots {
    most: usize,
    adaptive: bool,
    /// Adaptive, a node's own storage first learns its rate and fill from
    /// its clones' progress and then paces them ([`learn`]).
    learn: bool,
    keys: Mutex<HashMap<(String, String), Arc<Key>>>,
}

/// One domain's slots: a fair semaphore whose permits are the current limit.
struct Key {
    /// The node, or [`CLUSTER`] for a cluster-wide domain.
    node: String,
    storage: String,
    sem: Arc<Semaphore>,
    state: Mutex<KeyState>,
    /// Bumped when its learning moves on (see [`Read::OnChange`]).
    changes: watch::Sender<u64>,
}

#[derive(Default)]
struct KeyState {
    limit: usize,
    /// The nodes that cloned to the domain (one for a node's own), each
    /// with its bound of `--max-parallel-clones` of the domain's slots
    /// (a copy is a `qemu-img` process on its node). The limit reaches
    /// at most the sum of them.
    nodes: HashMap<String, Arc<Semaphore>>,
    /// Permits to drop rather than return, for a limit lowered below what
    /// clones hold.
    owed: usize,
    /// Clones waiting for a slot: more slots help only when some wait.
    waiting: usize,
    /// Recent clone times by template.
    recent: HashMap<u32, VecDeque<Duration>>,
    /// When the limit last changed: only a clone that got its slot since
    /// ran under the new limit and may move it again (as Vegas moves once a
    /// round trip), or one crowded round would give back every slot.
    changed: Option<Instant>,
    /// Slots held now. Counted here rather than read off the semaphore
    /// (`used` in [`CloneSlots::view`]): a permit leaves the semaphore
    /// before this lock is taken, and the slot-seconds up to that moment
    /// must not count it yet.
    held: usize,
    /// Slot-seconds held since the domain was made, as of `counted`: a
    /// clone's mean company is its difference over the clone's time.
    held_seconds: f64,
    counted: Option<Instant>,
    /// While the domain learns its storage ([`learn`]): it sets the limit.
    learner: Option<Learner>,
    /// Once learnt: one clone starts each `every`, the next at `next`.
    pace: Option<Pace>,
    /// Numbers the permits, for the learner.
    serial: u64,
}

/// A learnt domain's pace: clones start one each `every`.
struct Pace {
    every: Duration,
    next: Instant,
}

impl KeyState {
    /// Counts the slot-seconds held up to `now`; the total.
    fn held_seconds_at(&mut self, now: Instant) -> f64 {
        if let Some(counted) = self.counted {
            self.held_seconds += self.held as f64 * now.duration_since(counted).as_secs_f64();
        }
        self.counted = Some(now);
        self.held_seconds
    }
}

impl CloneSlots {
    /// At most `most` slots per node and domain (at least one); fixed at
    /// `most`, or adaptive from [`ADAPTIVE_START`].
    pub(super) fn new(most: usize, adaptive: bool) -> CloneSlots {
        CloneSlots {
            most: most.max(1),
            adaptive,
            learn: false,
            keys: Mutex::new(HashMap::new()),
        }
    }

    /// Adaptive slots whose node-own domains learn their storage before
    /// they pace (see [`learn`]); the clones must then report their copy's
    /// progress ([`ClonePermit::sample`]). A shared storage's domain adapts
    /// as before: its pool is filled by many streams, and its clones end
    /// one after another already.
    pub(super) fn learning(mut self) -> CloneSlots {
        self.learn = self.adaptive;
        self
    }

    /// The key for a clone on `node` to `domain`: the node's own, or the
    /// cluster's for a shared storage (adaptive only: fixed slots are per
    /// node, as `--max-parallel-clones` says); and the node's bound there.
    fn key(&self, node: &str, domain: &SlotDomain) -> (Arc<Key>, Arc<Semaphore>) {
        let scope = if self.adaptive && domain.shared {
            CLUSTER
        } else {
            node
        };
        let key = Arc::clone(
            self.keys
                .lock()
                .entry((scope.to_string(), domain.storage.clone()))
                .or_insert_with(|| {
                    Arc::new(Key {
                        node: scope.to_string(),
                        storage: domain.storage.clone(),
                        sem: Arc::new(Semaphore::new(0)),
                        state: Mutex::new(KeyState::default()),
                        changes: watch::channel(0).0,
                    })
                }),
        );
        let bound = self.join(&key, node, self.learn && !domain.shared);
        (key, bound)
    }

    /// Counts `node` in `key`'s domain (its ceiling grows by the node's
    /// most and, until the domain has moved on what its clones showed, its
    /// limit by the node's start); the node's bound there.
    fn join(&self, key: &Key, node: &str, learn: bool) -> Arc<Semaphore> {
        let mut st = key.state.lock();
        if let Some(bound) = st.nodes.get(node) {
            return Arc::clone(bound);
        }
        let bound = Arc::new(Semaphore::new(self.most));
        st.nodes.insert(node.to_string(), Arc::clone(&bound));
        let start = if learn && st.nodes.len() == 1 {
            // One copy alone first: the learner admits more.
            st.learner = Some(Learner::new(self.most));
            1
        } else if self.adaptive {
            ADAPTIVE_START.min(self.most)
        } else {
            self.most
        };
        if st.changed.is_none() {
            st.limit += start;
            key.sem.add_permits(start);
        }
        bound
    }

    /// The slots a clone on `node` to `domain` has now.
    #[cfg(test)]
    pub(super) fn limit(&self, node: &str, domain: &SlotDomain) -> usize {
        self.key(node, domain).0.state.lock().limit
    }

    /// Every domain's slots, used slots and waiting clones, for the metrics.
    pub(super) fn view(&self) -> Vec<CloneSlotsView> {
        let keys: Vec<Arc<Key>> = self.keys.lock().values().cloned().collect();
        let mut out: Vec<CloneSlotsView> = keys
            .iter()
            .map(|k| {
                let st = k.state.lock();
                CloneSlotsView {
                    node: k.node.clone(),
                    storage: k.storage.clone(),
                    limit: st.limit,
                    used: (st.limit + st.owed).saturating_sub(k.sem.available_permits()),
                    waiting: st.waiting,
                    pace: st.pace.as_ref().map(|p| p.every),
                }
            })
            .collect();
        out.sort_by(|a, b| (&a.node, &a.storage).cmp(&(&b.node, &b.storage)));
        out
    }

    /// Waits for a slot for a clone on `node` to `domain`; held until the
    /// permit drops.
    pub(super) async fn permit(
        &self,
        node: &str,
        domain: &SlotDomain,
    ) -> Result<ClonePermit, SubstrateError> {
        let (key, bound) = self.key(node, domain);
        let waiting = Waiting::new(&key);
        let closed = |_| SubstrateError::new("clone slots closed");
        let node_slot = bound.acquire_owned().await.map_err(closed)?;
        let permit = Arc::clone(&key.sem).acquire_owned().await.map_err(closed)?;
        drop(waiting);
        let now = Instant::now();
        let (id, learning, start) = {
            let mut st = key.state.lock();
            st.serial += 1;
            let id = st.serial;
            key.learn(&mut st, self.most, |l| (l.join(id), ()));
            // Still learning after it joined: its progress counts.
            let learning = st.learner.is_some();
            // A learnt domain's pace: this clone starts at the next turn.
            let start = st.pace.as_mut().map_or(now, |p| {
                let start = p.next.max(now);
                p.next = start + p.every;
                start
            });
            (id, learning, start)
        };
        // Its slot is held while it waits for its turn (the slot wait).
        if start > now {
            tokio::time::sleep_until(start).await;
        }
        let acquired = Instant::now();
        let held_seconds_before = {
            let mut st = key.state.lock();
            let before = st.held_seconds_at(acquired);
            st.held += 1;
            before
        };
        Ok(ClonePermit {
            key,
            permit: Some(permit),
            _node_slot: node_slot,
            acquired,
            held_seconds_before,
            most: self.most,
            adaptive: self.adaptive,
            id,
            learning,
        })
    }
}

/// A clone counted as waiting on its key until this drops (it got its
/// slot, or its Create was given up while it waited).
struct Waiting(Arc<Key>);

impl Waiting {
    fn new(key: &Arc<Key>) -> Waiting {
        key.state.lock().waiting += 1;
        Waiting(Arc::clone(key))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.state.lock().waiting -= 1;
    }
}

/// A held clone slot; it tells its key how the clone went.
pub(super) struct ClonePermit {
    key: Arc<Key>,
    permit: Option<OwnedSemaphorePermit>,
    /// One of the node's `--max-parallel-clones` in the domain.
    _node_slot: OwnedSemaphorePermit,
    acquired: Instant,
    /// The domain's slot-seconds held when this one was taken.
    held_seconds_before: f64,
    /// `--max-parallel-clones`: the ceiling per node in the domain.
    most: usize,
    adaptive: bool,
    /// Its number among the domain's permits.
    id: u64,
    /// Taken while the domain learnt its storage: its progress counts.
    learning: bool,
}

impl ClonePermit {
    /// The clone of `template` ended well after `took` (its POST to its
    /// task's end): a slot more while clones wait and the storage has
    /// bandwidth to spare, one fewer once more than one copy only shared
    /// it.
    pub(super) fn finished(&self, template: u32, took: Duration) {
        if !self.adaptive {
            return;
        }
        let mut st = self.key.state.lock();
        if self.learning {
            self.key
                .learn(&mut st, self.most, |l| (l.left(self.id, true), ()));
        }
        let recent = st.recent.entry(template).or_default();
        recent.push_back(took);
        if recent.len() > WINDOW {
            recent.pop_front();
        }
        let Some(shortest) = recent.iter().min().copied() else {
            return;
        };
        if !self.ran_under_current_limit(&st) {
            return;
        }
        let now = Instant::now();
        let held_for = now.duration_since(self.acquired).as_secs_f64();
        let held_seconds = st.held_seconds_at(now) - self.held_seconds_before;
        // The clones it ran among, itself included.
        let among = if held_for > 0.0 {
            (held_seconds / held_for).max(1.0)
        } else {
            1.0
        };
        let unneeded = among * (1.0 - shortest.as_secs_f64() / took.as_secs_f64().max(1e-3));
        let ceiling = self.most * st.nodes.len();
        // Learning, the learner sets the limit; paced, the pace starts
        // clones and more slots would only let them crowd.
        let steered = st.learner.is_some() || st.pace.is_some();
        if unneeded < ALPHA && st.waiting > 0 && st.limit < ceiling && !steered {
            st.limit += 1;
            st.changed = Some(now);
            self.key.sem.add_permits(1);
            self.changed(
                st.limit,
                "the storage had bandwidth to spare and clones wait",
            );
        } else if unneeded > BETA && st.learner.is_none() {
            let fewer = st.limit.saturating_sub(1);
            if self.key.lower(&mut st, fewer) {
                self.changed(st.limit, "more copies than the storage needed");
            }
        }
    }

    /// When this clone is first to report its copy's progress
    /// ([`ClonePermit::sample`]): `None` unless its domain is learning its
    /// storage.
    pub(super) fn first_read(&self) -> Option<Duration> {
        self.learning().then_some(learn::READ_SOONEST)
    }

    /// The clone's copy was `percent` done (`None`: its log shows no
    /// progress yet) as its task's log was read now. When to read it
    /// next; `None` once its domain needs no more.
    ///
    /// `seen` (from [`ClonePermit::changes`]) is marked up to date under
    /// the domain's lock: a change this read made does not wake its own
    /// wait, and one made by another clone after it does.
    pub(super) fn sample(&self, percent: Option<f64>, seen: &mut watch::Receiver<u64>) -> Read {
        let mut st = self.key.state.lock();
        let Some(next) = self.key.learn(&mut st, self.most, |l| {
            l.sample(self.id, Instant::now(), percent)
        }) else {
            return Read::Done;
        };
        seen.borrow_and_update();
        if st.learner.is_some() {
            next
        } else {
            Read::Done
        }
    }

    /// Whether this clone is still to report its copy's progress.
    pub(super) fn learning(&self) -> bool {
        self.learning && self.key.state.lock().learner.is_some()
    }

    /// Tells when its domain's learning moves on ([`Read::OnChange`]).
    pub(super) fn changes(&self) -> watch::Receiver<u64> {
        self.key.changes.subscribe()
    }

    /// The clone met a storage-lock timeout: too many allocations queue on
    /// the storage's lock; halve the key's slots.
    pub(super) fn lock_timeout(&self) {
        if !self.adaptive {
            return;
        }
        let mut st = self.key.state.lock();
        if !self.ran_under_current_limit(&st) {
            return;
        }
        let half = st.limit / 2;
        if self.key.lower(&mut st, half) {
            self.changed(st.limit, "a storage-lock timeout");
        }
    }

    fn ran_under_current_limit(&self, st: &KeyState) -> bool {
        st.changed.is_none_or(|at| self.acquired >= at)
    }

    fn changed(&self, slots: usize, why: &str) {
        self.key.changed(slots, why);
    }
}

impl Key {
    fn changed(&self, slots: usize, why: &str) {
        tracing::info!(node = %self.node, storage = %self.storage, slots, why, "clone slots changed");
    }

    /// Lowers the key's limit to `to` (at least one): free permits go now,
    /// held ones as they come back. Whether it went lower.
    fn lower(&self, st: &mut KeyState, to: usize) -> bool {
        let to = to.max(1);
        if to >= st.limit {
            return false;
        }
        let cut = st.limit - to;
        st.limit = to;
        st.changed = Some(Instant::now());
        let forgotten = self.sem.forget_permits(cut);
        st.owed += cut - forgotten;
        true
    }

    /// Raises the key's limit to `to`; whether it went higher.
    fn raise(&self, st: &mut KeyState, to: usize) -> bool {
        if to <= st.limit {
            return false;
        }
        let more = to - st.limit;
        // Permits owed back for an earlier lowering are kept instead.
        let kept = more.min(st.owed);
        st.owed -= kept;
        self.sem.add_permits(more - kept);
        st.limit = to;
        st.changed = Some(Instant::now());
        true
    }

    /// Tells the domain's learner something (`tell`, which gives its
    /// verdict, if any, and what else it answers), when the domain learns:
    /// wakes the clones waiting on [`Read::OnChange`] if the learner moved
    /// on, and acts on the verdict. `None` when the domain does not learn.
    fn learn<R>(
        &self,
        st: &mut KeyState,
        most: usize,
        tell: impl FnOnce(&mut Learner) -> (Option<Learnt>, R),
    ) -> Option<R> {
        let learner = st.learner.as_mut()?;
        let before = learner.generation();
        let (verdict, answer) = tell(learner);
        if learner.generation() != before {
            self.changes.send_modify(|g| *g += 1);
        }
        if let Some(v) = verdict {
            self.apply(st, v, most);
        }
        Some(answer)
    }

    /// Acts on what the learner says (see [`learn`]); `most` is the
    /// ceiling per node.
    fn apply(&self, st: &mut KeyState, verdict: Learnt, most: usize) {
        if matches!(verdict, Learnt::Known { .. } | Learnt::GaveUp) {
            // The clones waiting to be read are read no more.
            self.changes.send_modify(|g| *g += 1);
        }
        match verdict {
            Learnt::Stage(n) => {
                if self.raise(st, n) {
                    self.changed(n, "learning the storage: one copy more at once");
                }
            }
            Learnt::Known { every, fill } => {
                st.learner = None;
                st.pace = Some(Pace {
                    every,
                    next: Instant::now(),
                });
                // As many as fill the storage, and one allocating beside them.
                let to = (fill + 1).min(most.max(1));
                if !self.raise(st, to) {
                    self.lower(st, to);
                }
                tracing::info!(
                    node = %self.node,
                    storage = %self.storage,
                    fill,
                    every_ms = every.as_millis() as u64,
                    slots = st.limit,
                    "clone slots learnt the storage: a clone starts each `every`"
                );
            }
            Learnt::GaveUp => {
                st.learner = None;
                let to = ADAPTIVE_START.min(most.max(1));
                self.raise(st, to);
                self.changed(
                    st.limit,
                    "learning the storage gave up (no progress to read)",
                );
            }
        }
    }
}

impl Drop for ClonePermit {
    fn drop(&mut self) {
        // Under the key's lock, so a concurrent lowering counts it rightly.
        let mut st = self.key.state.lock();
        if self.learning {
            // Given up or failed before its verdict (a clone that ended
            // well has left already).
            self.key
                .learn(&mut st, self.most, |l| (l.left(self.id, false), ()));
        }
        let Some(permit) = self.permit.take() else {
            return;
        };
        st.held_seconds_at(Instant::now());
        st.held -= 1;
        if st.owed > 0 {
            st.owed -= 1;
            permit.forget();
        } else {
            drop(permit);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_keys() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(storage_key(&s(&["local-lvm"])), "local-lvm");
        assert_eq!(
            storage_key(&s(&["ceph-pool", "local-lvm"])),
            "ceph-pool+local-lvm"
        );
        assert_eq!(storage_key(&[]), "(no disks)");
        // `disk_storages` sorts, so the key does not depend on disk order.
        let cfg: pve::VmConfig = serde_json::from_value(serde_json::json!({
            "virtio0": "local-lvm:base-1-disk-1", "scsi0": "ceph-pool:base-1-disk-0",
            "scsi1": "local-lvm:base-1-disk-2", "ide2": "none,media=cdrom"
        }))
        .unwrap();
        assert_eq!(storage_key(&cfg.disk_storages()), "ceph-pool+local-lvm");
    }

    #[tokio::test]
    async fn slots_bound_each_key_alone() {
        let slots = CloneSlots::new(1, false);
        let lvm = local("local-lvm");
        let held = slots.permit("pve1", &lvm).await.unwrap();
        // Another key is not bound by the first.
        let _other = slots.permit("pve2", &lvm).await.unwrap();
        let waiting = slots.permit("pve1", &lvm);
        tokio::pin!(waiting);
        assert!(
            futures::poll!(&mut waiting).is_pending(),
            "the second clone on one key waits"
        );
        drop(held);
        assert!(waiting.await.is_ok(), "and gets the slot once it is free");
    }

    /// Polls a waiting permit once: the permit if it came.
    async fn try_now(
        fut: &mut std::pin::Pin<
            Box<impl std::future::Future<Output = Result<ClonePermit, SubstrateError>>>,
        >,
    ) -> Option<ClonePermit> {
        match futures::poll!(fut.as_mut()) {
            std::task::Poll::Ready(r) => Some(r.expect("slots stay open")),
            std::task::Poll::Pending => None,
        }
    }

    const S: fn(u64) -> Duration = Duration::from_secs;

    /// A domain on one node's own storage (or, for these tests, a storage
    /// whose sharing does not matter).
    fn local(storage: &str) -> SlotDomain {
        SlotDomain {
            storage: storage.into(),
            shared: false,
        }
    }

    fn shared(storage: &str) -> SlotDomain {
        SlotDomain {
            storage: storage.into(),
            shared: true,
        }
    }

    #[tokio::test]
    async fn a_shared_storage_has_one_domain_for_the_cluster() {
        let slots = CloneSlots::new(3, true);
        let ceph = shared("ceph");
        assert_eq!(slots.limit("pve1", &ceph), ADAPTIVE_START);
        assert_eq!(
            slots.limit("pve2", &ceph),
            2 * ADAPTIVE_START,
            "each node cloning to it brings its start"
        );
        // Four clones from pve1 take all four of the cluster's slots: the
        // storage's lock and bandwidth are the cluster's.
        let a = slots.permit("pve1", &ceph).await.unwrap();
        let _b = slots.permit("pve1", &ceph).await.unwrap();
        let _c = slots.permit("pve1", &ceph).await.unwrap();
        let mut fourth = Box::pin(slots.permit("pve1", &ceph));
        assert!(
            try_now(&mut fourth).await.is_none(),
            "a node holds at most --max-parallel-clones of them"
        );
        let d = slots.permit("pve2", &ceph).await.unwrap();
        let mut from_pve2 = Box::pin(slots.permit("pve2", &ceph));
        assert!(try_now(&mut from_pve2).await.is_none(), "four of four used");
        let view = slots.view();
        assert_eq!(
            view,
            vec![CloneSlotsView {
                node: CLUSTER.into(),
                storage: "ceph".into(),
                limit: 4,
                used: 4,
                waiting: 2,
                pace: None,
            }]
        );
        // It grows, once a round, to 3 per node that cloned there.
        d.finished(9000, S(4));
        assert_eq!(
            slots.limit("pve1", &ceph),
            5,
            "clones wait, the storage has room"
        );
        let e = try_now(&mut from_pve2)
            .await
            .expect("pve2 gets the new slot");
        assert!(
            try_now(&mut fourth).await.is_none(),
            "pve1 still holds its most"
        );
        a.finished(9000, S(4));
        assert_eq!(slots.limit("pve1", &ceph), 5, "a ran before the change");
        e.finished(9000, S(4));
        assert_eq!(slots.limit("pve1", &ceph), 6);
        let f = slots.permit("pve2", &ceph).await.unwrap();
        f.finished(9000, S(4));
        assert_eq!(slots.limit("pve1", &ceph), 6, "never past 3 per node");
        // A local storage of the same name on a node is that node's own.
        assert_eq!(slots.limit("pve1", &local("ceph")), ADAPTIVE_START);
        // Fixed slots stay per node, as --max-parallel-clones says.
        let fixed = CloneSlots::new(3, false);
        assert_eq!(fixed.limit("pve1", &ceph), 3);
        assert_eq!(fixed.limit("pve2", &ceph), 3);
    }

    #[tokio::test]
    async fn a_clone_given_up_while_waiting_no_longer_counts_as_waiting() {
        let slots = CloneSlots::new(1, true);
        let ceph = local("ceph");
        let held = slots.permit("pve1", &ceph).await.unwrap();
        let mut waiting = Box::pin(slots.permit("pve1", &ceph));
        assert!(try_now(&mut waiting).await.is_none());
        assert_eq!(slots.view()[0].waiting, 1);
        drop(waiting);
        assert_eq!(slots.view()[0].waiting, 0, "its Create was given up");
        assert_eq!(slots.view()[0].used, 1);
        drop(held);
        assert_eq!(slots.view()[0].used, 0);
    }

    /// Two clones holding the two slots an adaptive domain starts with on
    /// pve1, and a third polled once, so it counts as waiting.
    async fn two_held_one_waiting<'a>(
        slots: &'a CloneSlots,
        domain: &'a SlotDomain,
    ) -> (
        ClonePermit,
        ClonePermit,
        std::pin::Pin<
            Box<impl std::future::Future<Output = Result<ClonePermit, SubstrateError>> + 'a>,
        >,
    ) {
        assert_eq!(slots.limit("pve1", domain), ADAPTIVE_START);
        let a = slots.permit("pve1", domain).await.unwrap();
        let b = slots.permit("pve1", domain).await.unwrap();
        let mut third = Box::pin(slots.permit("pve1", domain));
        assert!(
            try_now(&mut third).await.is_none(),
            "two slots to start with"
        );
        (a, b, third)
    }

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[tokio::test(start_paused = true)]
    async fn adaptive_grows_while_clones_take_the_shortest_time_and_some_wait() {
        let slots = CloneSlots::new(4, true);
        let ceph = local("ceph");
        let limit = || slots.limit("pve1", &ceph);
        let (a, b, mut third) = two_held_one_waiting(&slots, &ceph).await;
        tokio::time::advance(S(4)).await;
        a.finished(9000, S(4));
        assert_eq!(limit(), 3, "a clone waits and the storage has room");
        let c = try_now(&mut third).await.expect("the new slot, at once");
        b.finished(9000, S(4));
        let mut fourth = Box::pin(slots.permit("pve1", &ceph));
        assert!(try_now(&mut fourth).await.is_none());
        assert_eq!(limit(), 3, "a clone from before the change moves nothing");
        // Among three for all its time, an eighth over the shortest: a
        // third of a copy more than the storage needed, still room.
        tokio::time::advance(MS(4500)).await;
        c.finished(9000, MS(4500));
        assert_eq!(limit(), 4, "room to spare still grows");
        let d = try_now(&mut fourth).await.expect("the fourth slot");
        let mut fifth = Box::pin(slots.permit("pve1", &ceph));
        assert!(try_now(&mut fifth).await.is_none());
        d.finished(9000, S(4));
        assert_eq!(limit(), 4, "never past --max-parallel-clones");
        drop(fifth);
        d.finished(9000, S(4));
        assert_eq!(limit(), 4);
    }

    #[tokio::test]
    async fn adaptive_grows_only_while_clones_wait() {
        let slots = CloneSlots::new(4, true);
        let ceph = local("ceph");
        let a = slots.permit("pve1", &ceph).await.unwrap();
        a.finished(9000, S(4));
        a.finished(9000, S(4));
        assert_eq!(slots.limit("pve1", &ceph), ADAPTIVE_START);
    }

    /// A storage one copy fills: a copy alone takes 2.5 s, two at once
    /// 4.5 s each (one copies while the other allocates, then they share),
    /// three 6.5 s. Two is what it needs; by the ratio to the shortest
    /// alone (1.8x) two look crowded, and giving one back would leave the
    /// disk idle through every allocation.
    #[tokio::test(start_paused = true)]
    async fn a_storage_one_copy_fills_keeps_a_second_clone_allocating_beside_the_copy() {
        let slots = CloneSlots::new(8, true);
        let lvm = local("local-lvm");
        let limit = || slots.limit("pve1", &lvm);
        let alone = slots.permit("pve1", &lvm).await.unwrap();
        tokio::time::advance(MS(2500)).await;
        alone.finished(9000, MS(2500));
        drop(alone);
        assert_eq!(limit(), 2, "nobody waited, nothing moves");
        let (a, b, _waiting) = two_held_one_waiting(&slots, &lvm).await;
        tokio::time::advance(MS(4500)).await;
        a.finished(9000, MS(4500));
        b.finished(9000, MS(4500));
        assert_eq!(limit(), 2, "one copying, one allocating: hold");
        // Three at once, had the limit been three, hold a copy more than
        // the storage needs beside the allocating one: give it back.
        let slots = CloneSlots::new(8, true);
        let (a, b, mut third) = two_held_one_waiting(&slots, &lvm).await;
        tokio::time::advance(MS(2500)).await;
        a.finished(9000, MS(2500));
        assert_eq!(slots.limit("pve1", &lvm), 3);
        let c = try_now(&mut third).await.expect("the third slot");
        let d = Box::pin(slots.permit("pve1", &lvm));
        drop(a);
        let d = d.await.unwrap();
        tokio::time::advance(MS(6500)).await;
        c.finished(9000, MS(6500));
        assert_eq!(slots.limit("pve1", &lvm), 2, "three at once: one too many");
        drop((b, d));
    }

    #[tokio::test(start_paused = true)]
    async fn adaptive_gives_slots_back_when_clones_crowd_and_on_lock_timeouts() {
        let slots = CloneSlots::new(8, true);
        let ceph = local("ceph");
        let limit = || slots.limit("pve1", &ceph);
        let (a, b, mut waiting) = two_held_one_waiting(&slots, &ceph).await;
        tokio::time::advance(S(2)).await;
        a.finished(9000, S(2));
        let c = try_now(&mut waiting).await.expect("3 slots");
        // Among three (a, b, c) for all its time.
        tokio::time::advance(S(6)).await;
        c.finished(9000, S(3));
        assert_eq!(limit(), 3, "one copy beyond what the storage needed: hold");
        c.finished(9000, S(6));
        assert_eq!(limit(), 2, "two beyond: the copies only share the storage");
        c.finished(9000, S(6));
        assert_eq!(limit(), 2, "once a round: c ran before the change");
        // Three held against a limit of two: the first back is not handed on.
        let mut next = Box::pin(slots.permit("pve1", &ceph));
        drop(b);
        assert!(
            try_now(&mut next).await.is_none(),
            "two held, a limit of two"
        );
        drop(c);
        let e = try_now(&mut next).await.expect("a slot of the two");
        // Another template's clones are timed against their own shortest.
        tokio::time::advance(S(20)).await;
        e.finished(9001, S(20));
        assert_eq!(limit(), 2);
        e.lock_timeout();
        assert_eq!(limit(), 1, "a lock timeout halves");
        a.lock_timeout();
        assert_eq!(limit(), 1, "never below one, and a is from before");
        let mut last = Box::pin(slots.permit("pve1", &ceph));
        drop(a);
        assert!(try_now(&mut last).await.is_none(), "e holds the one slot");
        drop(e);
        assert!(try_now(&mut last).await.is_some(), "now it is free");
    }

    #[tokio::test]
    async fn fixed_slots_never_move() {
        let slots = CloneSlots::new(3, false);
        let ceph = local("ceph");
        assert_eq!(slots.limit("pve1", &ceph), 3);
        let a = slots.permit("pve1", &ceph).await.unwrap();
        a.finished(9000, S(4));
        a.finished(9000, S(40));
        a.lock_timeout();
        assert_eq!(slots.limit("pve1", &ceph), 3);
    }
}
