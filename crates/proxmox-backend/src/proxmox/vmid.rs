//! VMID choice: reservations held by this process, cool-downs for freed ids,
//! and the `nextid` probe loop.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Mutex as AsyncMutex;
use tokio::time::Instant;

use super::api::{err_at, Api};
use super::options::PveOptions;
use crate::substrate::SubstrateError;

#[derive(Default)]
struct VmidState {
    /// Chosen by this process, clone not finished yet.
    reserved: HashSet<u32>,
    /// Cloned by this process (committed): taken in PVE, so a walk over
    /// the range skips them without asking; expiry time. A burst's choices
    /// otherwise asked `nextid?vmid=N` of each clone made before them.
    made: HashMap<u32, std::time::Instant>,
    /// Freed or abandoned recently; expiry time.
    cooldown: HashMap<u32, std::time::Instant>,
    /// Where the next probe starts (ids grow monotonically within the range).
    hint: Option<u32>,
    /// The last choice asked PVE and no guess has collided since: while
    /// another clone of this process is in flight (a burst), the next
    /// choice takes the first id past the hint it does not hold, without
    /// asking (see [`Vmids::reserve`]).
    guessable: bool,
    /// Clones given up as not applied after a lost answer: the request may
    /// still land late, so the id stays blocked and a VM landing there is
    /// checked against a second one for the same machine.
    late: HashMap<u32, LateClone>,
}

/// A clone request whose answer was lost and whose VMID stayed free long
/// enough to be taken as not applied.
#[derive(Clone, Debug)]
pub(super) struct LateClone {
    pub(super) machine_id: String,
    pub(super) operation_id: String,
    /// The node it was aimed at (it may first appear on the template's).
    pub(super) node: String,
    pub(super) until: std::time::Instant,
}

impl VmidState {
    fn blocked(&mut self, id: u32) -> bool {
        let now = std::time::Instant::now();
        self.cooldown.retain(|_, until| *until > now);
        self.late.retain(|_, l| l.until > now);
        self.made.retain(|_, until| *until > now);
        self.reserved.contains(&id)
            || self.cooldown.contains_key(&id)
            || self.late.contains_key(&id)
            || self.made.contains_key(&id)
    }

    /// The late clones still watched, pruning expired ones.
    fn late_clones(&mut self) -> Vec<(u32, LateClone)> {
        let now = std::time::Instant::now();
        self.late.retain(|_, l| l.until > now);
        self.late.iter().map(|(id, l)| (*id, l.clone())).collect()
    }
}

/// VMID choice for this process: what it holds, what cools down, the late
/// clones watched by VMID, and the lock that serialises choices.
pub(super) struct Vmids {
    api: Arc<Api>,
    /// The options this part reads.
    opts: Arc<PveOptions>,
    state: Mutex<VmidState>,
    /// Serialises VMID choice so two clones never probe for the same id.
    choice: AsyncMutex<()>,
}

/// A VMID chosen by this process; returned to the pool (with a cool-down)
/// unless [`VmidHold::commit`] is called, also when the future is dropped.
pub(super) struct VmidHold<'a> {
    owner: &'a Vmids,
    pub(super) vmid: u32,
    committed: bool,
}

impl VmidHold<'_> {
    pub(super) fn commit(mut self) {
        self.committed = true;
        let mut st = self.owner.state.lock();
        st.reserved.remove(&self.vmid);
        st.made.insert(
            self.vmid,
            std::time::Instant::now() + self.owner.opts.vmid_cooldown,
        );
    }
}

impl Drop for VmidHold<'_> {
    fn drop(&mut self) {
        if !self.committed {
            let mut st = self.owner.state.lock();
            st.reserved.remove(&self.vmid);
            st.cooldown.insert(
                self.vmid,
                std::time::Instant::now() + self.owner.opts.vmid_cooldown,
            );
        }
    }
}

impl Vmids {
    pub(super) fn new(api: Arc<Api>, opts: Arc<PveOptions>) -> Vmids {
        Vmids {
            api,
            opts,
            state: Mutex::new(VmidState::default()),
            choice: AsyncMutex::new(()),
        }
    }

    /// A VMID that was just freed or abandoned: not chosen again for the
    /// cool-down (PVE may still be cleaning it up).
    pub(super) fn cool_down(&self, vmid: u32) {
        let mut st = self.state.lock();
        st.made.remove(&vmid);
        st.cooldown
            .insert(vmid, std::time::Instant::now() + self.opts.vmid_cooldown);
    }

    /// Watches a clone given up as not applied: its id is not reused and a
    /// VM landing there is checked against a second one for the machine.
    pub(super) fn watch_late(&self, vmid: u32, late: LateClone) {
        self.state.lock().late.insert(vmid, late);
    }

    /// Stops watching a late clone (adopted, removed, or not ours).
    pub(super) fn unwatch_late(&self, vmid: u32) {
        self.state.lock().late.remove(&vmid);
    }

    /// The late clones still watched.
    pub(super) fn late_clones(&self) -> Vec<(u32, LateClone)> {
        self.state.lock().late_clones()
    }

    /// A chosen id turned out taken (the clone's POST said `VM N already
    /// exists`): the next choice asks PVE again.
    pub(super) fn guessed_wrong(&self) {
        self.state.lock().guessable = false;
    }

    /// Picks a VMID in the allowed range that no other clone of this process
    /// is using and PVE reports free. In a burst (another clone of this
    /// process in flight, and the last choice asked PVE), the first id past
    /// the last one chosen that this process does not hold is taken without
    /// asking: PVE's `nextid` would name it unless someone else took it
    /// meanwhile, and then the clone's POST refuses it at once, and the
    /// choice after asks again ([`Vmids::guessed_wrong`]). One `nextid` call in the common case
    /// (PVE's first free id is in range and not ours); otherwise a walk over
    /// the range from where the last choice ended, wrapping once, that only
    /// gives up when every id in the range was found taken or blocked.
    /// Transient failures are retried until `deadline`.
    pub(super) async fn reserve(&self, deadline: Instant) -> Result<VmidHold<'_>, SubstrateError> {
        let _choice = self.choice.lock().await;
        let api = &self.api;
        let range = self.opts.vmid_range;
        let size = u64::from(range.1 - range.0) + 1;
        {
            let mut st = self.state.lock();
            if st.guessable && !st.reserved.is_empty() {
                if let Some(hint) = st.hint {
                    let past = (hint..=range.1).find(|id| !st.blocked(*id));
                    if let Some(id) = past {
                        return Ok(self.take(&mut st, id));
                    }
                }
            }
        }
        // PVE searches only datacenter.cfg's `next-id` range: full, it
        // says so (a 500), while --vmid-range may still have room, so the
        // walk below looks there, one `?vmid=N` at a time.
        let first = match api.retry_raw(None, deadline, |pve| pve.next_id(None)).await {
            Ok(first) => Some(first),
            Err(e) if e.is_next_id_range_full() => {
                tracing::debug!(error = %e, "the datacenter's next-id range is full; walking --vmid-range");
                None
            }
            Err(e) => return Err(err_at("choosing a free VMID", None, &e)),
        };
        let start = {
            let mut st = self.state.lock();
            match first {
                Some(first) if first >= range.0 && first <= range.1 => {
                    if !st.blocked(first) {
                        st.guessable = true;
                        return Ok(self.take(&mut st, first));
                    }
                    first
                }
                _ => st.hint.unwrap_or(range.0).clamp(range.0, range.1),
            }
        };
        // Every id of the range is visited at most once, wrapping at the end;
        // ids this process holds or recently freed are skipped without a call.
        // When PVE's first free id was one this process holds (a burst's
        // Creates, one after another), the first id past it that this
        // process does not hold is taken without asking: the clone's own
        // POST refuses a taken id at once (`VM N already exists`, checked
        // cluster-wide), and the Create then chooses again with that id
        // cooling, so asking first would only cost every such Create a read.
        let mut guess = first.is_some();
        for i in 0..size {
            let offset = (u64::from(start - range.0) + i) % size;
            let Ok(candidate) = u32::try_from(u64::from(range.0) + offset) else {
                break;
            };
            if self.state.lock().blocked(candidate) {
                continue;
            }
            if !std::mem::take(&mut guess) && api.vmid_taken(candidate, deadline).await? {
                continue;
            }
            let mut st = self.state.lock();
            if !st.blocked(candidate) {
                return Ok(self.take(&mut st, candidate));
            }
        }
        Err(SubstrateError::new(format!(
            "no free VMID in {}-{}: every id is taken or reserved by this process; \
             widen --vmid-range or free some VMIDs",
            range.0, range.1
        )))
    }

    fn take(&self, st: &mut VmidState, id: u32) -> VmidHold<'_> {
        let range = self.opts.vmid_range;
        st.reserved.insert(id);
        st.hint = if id < range.1 { Some(id + 1) } else { None };
        VmidHold {
            owner: self,
            vmid: id,
            committed: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn vmid_state_blocks_reserved_and_cooling_ids() {
        let mut st = VmidState::default();
        st.reserved.insert(100);
        st.cooldown
            .insert(101, std::time::Instant::now() + Duration::from_secs(60));
        st.cooldown
            .insert(102, std::time::Instant::now() - Duration::from_secs(1));
        assert!(st.blocked(100) && st.blocked(101));
        assert!(!st.blocked(102));
        assert!(
            !st.cooldown.contains_key(&102),
            "expired entries are pruned"
        );
        let late = |secs: i64| LateClone {
            machine_id: "m".into(),
            operation_id: "op".into(),
            node: "pve1".into(),
            until: if secs > 0 {
                std::time::Instant::now() + Duration::from_secs(secs.unsigned_abs())
            } else {
                std::time::Instant::now() - Duration::from_secs(secs.unsigned_abs())
            },
        };
        st.late.insert(103, late(60));
        st.late.insert(104, late(-1));
        assert!(st.blocked(103), "a late clone's id is not reused");
        assert!(!st.blocked(104));
        assert_eq!(st.late_clones().len(), 1, "expired late clones are pruned");
        st.made
            .insert(105, std::time::Instant::now() + Duration::from_secs(60));
        st.made
            .insert(106, std::time::Instant::now() - Duration::from_secs(1));
        assert!(st.blocked(105), "a clone this process made is known taken");
        assert!(!st.blocked(106), "until it expires");
    }
}
