//! VMID choice: reservations held by this process, cool-downs for freed ids,
//! and the `nextid` probe loop.

use std::collections::{HashMap, HashSet};

use super::{err, PveSubstrate};
use crate::substrate::SubstrateError;

/// `nextid` probes per reservation.
pub(super) const VMID_PROBES: u32 = 32;

#[derive(Default)]
pub(super) struct VmidState {
    /// Chosen by this process, clone not finished yet.
    pub(super) reserved: HashSet<u32>,
    /// Freed or abandoned recently; expiry time.
    pub(super) cooldown: HashMap<u32, std::time::Instant>,
    /// Where the next probe starts (ids grow monotonically within the range).
    pub(super) hint: Option<u32>,
}

impl VmidState {
    pub(super) fn blocked(&mut self, id: u32) -> bool {
        let now = std::time::Instant::now();
        self.cooldown.retain(|_, until| *until > now);
        self.reserved.contains(&id) || self.cooldown.contains_key(&id)
    }

    pub(super) fn next_unblocked(&mut self, from: u32, range: (u32, u32)) -> u32 {
        let mut id = from.max(range.0);
        while id <= range.1 && self.blocked(id) {
            id += 1;
        }
        if id > range.1 {
            range.0
        } else {
            id
        }
    }
}

/// A VMID chosen by this process; returned to the pool (with a cool-down)
/// unless [`Reservation::commit`] is called, also when the future is dropped.
pub(super) struct Reservation<'a> {
    pub(super) owner: &'a PveSubstrate,
    pub(super) vmid: u32,
    pub(super) committed: bool,
}

impl Reservation<'_> {
    pub(super) fn commit(mut self) {
        self.committed = true;
        self.owner.vmids.lock().reserved.remove(&self.vmid);
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if !self.committed {
            let mut st = self.owner.vmids.lock();
            st.reserved.remove(&self.vmid);
            st.cooldown.insert(
                self.vmid,
                std::time::Instant::now() + self.owner.opts.vmid_cooldown,
            );
        }
    }
}

impl PveSubstrate {
    /// Picks a VMID no other clone of this process is using and PVE reports free.
    pub(super) async fn reserve_vmid(&self) -> Result<Reservation<'_>, SubstrateError> {
        let _choice = self.vmid_choice.lock().await;
        let range = self.opts.vmid_range;
        let mut candidate = self.vmids.lock().hint;
        let mut tried_first_free = false;
        for _ in 0..VMID_PROBES {
            match self.client.next_id(candidate).await {
                Ok(id) => {
                    let mut st = self.vmids.lock();
                    if id >= range.0 && id <= range.1 && !st.blocked(id) {
                        st.reserved.insert(id);
                        st.hint = if id < range.1 { Some(id + 1) } else { None };
                        return Ok(Reservation {
                            owner: self,
                            vmid: id,
                            committed: false,
                        });
                    }
                    candidate = Some(st.next_unblocked(id.saturating_add(1), range));
                }
                Err(e) if e.is_already_exists() => {
                    // Taken: ask for PVE's first free id once, then walk upwards.
                    candidate = match candidate {
                        Some(_) if !tried_first_free => {
                            tried_first_free = true;
                            None
                        }
                        Some(c) => Some(self.vmids.lock().next_unblocked(c + 1, range)),
                        None => Some(range.0),
                    };
                }
                Err(e) => return Err(err("choosing a free VMID", &e)),
            }
        }
        Err(SubstrateError::new(format!(
            "no free VMID found in {}-{} after {VMID_PROBES} probes",
            range.0, range.1
        )))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn vmid_state_skips_reserved_and_cooling_ids() {
        let mut st = VmidState::default();
        st.reserved.insert(100);
        st.cooldown
            .insert(101, std::time::Instant::now() + Duration::from_secs(60));
        st.cooldown
            .insert(102, std::time::Instant::now() - Duration::from_secs(1));
        assert_eq!(st.next_unblocked(100, (100, 999)), 102);
        assert!(
            !st.cooldown.contains_key(&102),
            "expired entries are pruned"
        );
        assert_eq!(st.next_unblocked(999, (100, 999)), 999);
        st.reserved.insert(999);
        assert_eq!(st.next_unblocked(999, (100, 999)), 100);
    }
}
