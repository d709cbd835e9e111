//! Clone slots: how many clones run at once per (target node, storage
//! key), the unit PVE serialises on (the storage's lock) and whose
//! bandwidth the copies share; shared by Creates and replica stagings.
//!
//! Fixed, a key has `--max-parallel-clones` slots. Adaptive (the default),
//! a key starts at [`ADAPTIVE_START`] and moves within 1 and
//! `--max-parallel-clones` by what its clones show, as TCP Vegas moves a
//! window by round-trip times: a copy runs at the lesser of what one stream
//! reaches and its share of the storage's bandwidth, so while clones take
//! about as long as the shortest lately seen of their template, the storage
//! has bandwidth to spare and a waiting clone gets one more slot; once they
//! take half again as long, the copies only share it and the key gives one
//! back; a storage-lock timeout (PVE's allocation lock queued past its
//! 10 s) halves it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::substrate::SubstrateError;

/// Where an adaptive key starts: two clones at once, the old fixed default.
pub(super) const ADAPTIVE_START: usize = 2;

/// A clone this much longer than the shortest lately seen still found
/// bandwidth to spare (the allocation's queue and a late look are noise).
const SPARE: f64 = 1.25;

/// A clone this much longer only shared the storage's bandwidth.
const CROWDED: f64 = 1.5;

/// Clones of a template remembered per key for the shortest time: old
/// enough samples go, so a storage that got slower for good is learnt.
const WINDOW: usize = 32;

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

/// The clone slots of every key, made on first use.
pub(super) struct CloneSlots {
    most: usize,
    adaptive: bool,
    keys: Mutex<HashMap<(String, String), Arc<Key>>>,
}

/// One key's slots: a fair semaphore whose permits are the current limit.
struct Key {
    node: String,
    storage: String,
    sem: Arc<Semaphore>,
    state: Mutex<KeyState>,
}

#[derive(Default)]
struct KeyState {
    limit: usize,
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
}

impl CloneSlots {
    /// At most `most` slots per (node, storage key) (at least one); fixed
    /// at `most`, or adaptive from [`ADAPTIVE_START`].
    pub(super) fn new(most: usize, adaptive: bool) -> CloneSlots {
        CloneSlots {
            most: most.max(1),
            adaptive,
            keys: Mutex::new(HashMap::new()),
        }
    }

    fn key(&self, node: &str, storage: &str) -> Arc<Key> {
        let limit = if self.adaptive {
            ADAPTIVE_START.min(self.most)
        } else {
            self.most
        };
        Arc::clone(
            self.keys
                .lock()
                .entry((node.to_string(), storage.to_string()))
                .or_insert_with(|| {
                    Arc::new(Key {
                        node: node.to_string(),
                        storage: storage.to_string(),
                        sem: Arc::new(Semaphore::new(limit)),
                        state: Mutex::new(KeyState {
                            limit,
                            ..KeyState::default()
                        }),
                    })
                }),
        )
    }

    /// The slots (`node`, `storage`) has now.
    #[cfg(test)]
    pub(super) fn limit(&self, node: &str, storage: &str) -> usize {
        self.key(node, storage).state.lock().limit
    }

    /// Waits for a slot on (`node`, `storage`); held until the permit drops.
    pub(super) async fn permit(
        &self,
        node: &str,
        storage: &str,
    ) -> Result<ClonePermit, SubstrateError> {
        let key = self.key(node, storage);
        key.state.lock().waiting += 1;
        let permit = Arc::clone(&key.sem).acquire_owned().await;
        key.state.lock().waiting -= 1;
        let permit = permit.map_err(|_| SubstrateError::new("clone slots closed"))?;
        Ok(ClonePermit {
            key,
            permit: Some(permit),
            acquired: Instant::now(),
            most: self.most,
            adaptive: self.adaptive,
        })
    }
}

/// A held clone slot; it tells its key how the clone went.
pub(super) struct ClonePermit {
    key: Arc<Key>,
    permit: Option<OwnedSemaphorePermit>,
    acquired: Instant,
    most: usize,
    adaptive: bool,
}

impl ClonePermit {
    /// The clone of `template` ended well after `took` (its POST to its
    /// task's end): a slot more while clones wait and the storage has
    /// bandwidth to spare, one fewer once the copies only share it.
    pub(super) fn finished(&self, template: u32, took: Duration) {
        if !self.adaptive {
            return;
        }
        let mut st = self.key.state.lock();
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
        let ratio = took.as_secs_f64() / shortest.as_secs_f64().max(1e-3);
        if ratio <= SPARE && st.waiting > 0 && st.limit < self.most {
            st.limit += 1;
            st.changed = Some(Instant::now());
            self.key.sem.add_permits(1);
            self.changed(st.limit, "clones take their shortest time and more wait");
        } else if ratio > CROWDED {
            let fewer = st.limit.saturating_sub(1);
            if self.lower(&mut st, fewer) {
                self.changed(st.limit, "clones take half again their shortest time");
            }
        }
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
        if self.lower(&mut st, half) {
            self.changed(st.limit, "a storage-lock timeout");
        }
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
        let forgotten = self.key.sem.forget_permits(cut);
        st.owed += cut - forgotten;
        true
    }

    fn ran_under_current_limit(&self, st: &KeyState) -> bool {
        st.changed.is_none_or(|at| self.acquired >= at)
    }

    fn changed(&self, slots: usize, why: &str) {
        tracing::info!(node = %self.key.node, storage = %self.key.storage, slots, why, "clone slots changed");
    }
}

impl Drop for ClonePermit {
    fn drop(&mut self) {
        // Under the key's lock, so a concurrent lowering counts it rightly.
        let mut st = self.key.state.lock();
        let Some(permit) = self.permit.take() else {
            return;
        };
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
        let held = slots.permit("pve1", "local-lvm").await.unwrap();
        // Another key is not bound by the first.
        let _other = slots.permit("pve2", "local-lvm").await.unwrap();
        let waiting = slots.permit("pve1", "local-lvm");
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

    #[tokio::test]
    async fn adaptive_grows_while_clones_take_the_shortest_time_and_some_wait() {
        let slots = CloneSlots::new(4, true);
        let limit = || slots.limit("pve1", "ceph");
        assert_eq!(limit(), ADAPTIVE_START);
        let a = slots.permit("pve1", "ceph").await.unwrap();
        let _b = slots.permit("pve1", "ceph").await.unwrap();
        let mut third = Box::pin(slots.permit("pve1", "ceph"));
        assert!(
            try_now(&mut third).await.is_none(),
            "two slots to start with"
        );
        a.finished(9000, S(4));
        assert_eq!(limit(), 3, "a clone waits and the storage has room");
        let c = try_now(&mut third).await.expect("the new slot, at once");
        a.finished(9000, S(4));
        let mut fourth = Box::pin(slots.permit("pve1", "ceph"));
        assert!(try_now(&mut fourth).await.is_none());
        assert_eq!(limit(), 3, "a clone from before the change moves nothing");
        c.finished(9000, Duration::from_millis(4900));
        assert_eq!(limit(), 4, "within a quarter of the shortest still grows");
        let d = try_now(&mut fourth).await.expect("the fourth slot");
        let mut fifth = Box::pin(slots.permit("pve1", "ceph"));
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
        let a = slots.permit("pve1", "ceph").await.unwrap();
        a.finished(9000, S(4));
        a.finished(9000, S(4));
        assert_eq!(slots.limit("pve1", "ceph"), ADAPTIVE_START);
    }

    #[tokio::test]
    async fn adaptive_gives_slots_back_when_clones_crowd_and_on_lock_timeouts() {
        let slots = CloneSlots::new(8, true);
        let limit = || slots.limit("pve1", "ceph");
        let a = slots.permit("pve1", "ceph").await.unwrap();
        let b = slots.permit("pve1", "ceph").await.unwrap();
        let mut waiting = Box::pin(slots.permit("pve1", "ceph"));
        assert!(try_now(&mut waiting).await.is_none());
        a.finished(9000, S(4));
        let c = try_now(&mut waiting).await.expect("3 slots");
        c.finished(9000, Duration::from_millis(5500));
        assert_eq!(limit(), 3, "1.4x the shortest: hold");
        c.finished(9000, S(7));
        assert_eq!(limit(), 2, "1.75x: the copies only share the storage");
        c.finished(9000, S(7));
        assert_eq!(limit(), 2, "once a round: c ran before the change");
        // Three held against a limit of two: the first back is not handed on.
        let mut next = Box::pin(slots.permit("pve1", "ceph"));
        drop(b);
        assert!(
            try_now(&mut next).await.is_none(),
            "two held, a limit of two"
        );
        drop(c);
        let e = try_now(&mut next).await.expect("a slot of the two");
        // Another template's clones are timed against their own shortest.
        e.finished(9001, S(20));
        assert_eq!(limit(), 2);
        e.lock_timeout();
        assert_eq!(limit(), 1, "a lock timeout halves");
        a.lock_timeout();
        assert_eq!(limit(), 1, "never below one, and a is from before");
        let mut last = Box::pin(slots.permit("pve1", "ceph"));
        drop(a);
        assert!(try_now(&mut last).await.is_none(), "e holds the one slot");
        drop(e);
        assert!(try_now(&mut last).await.is_some(), "now it is free");
    }

    #[tokio::test]
    async fn fixed_slots_never_move() {
        let slots = CloneSlots::new(3, false);
        assert_eq!(slots.limit("pve1", "ceph"), 3);
        let a = slots.permit("pve1", "ceph").await.unwrap();
        a.finished(9000, S(4));
        a.finished(9000, S(40));
        a.lock_timeout();
        assert_eq!(slots.limit("pve1", "ceph"), 3);
    }
}
