//! When to ping a guest agent after this provider started its VM: a boot
//! costs about one ping, not one per poll interval.
//!
//! - **Learnt** ([`FirstLook`]): the first ping after a start comes at a
//!   tracked high quantile of how long agents on the node took to answer,
//!   so about one boot in ten needs a second ping; a miss is followed by
//!   pings an eighth of the estimate apart (at most a poll interval), each
//!   through the node's `WaitGate` (`guest/gate.rs`). PVE holds a
//!   ping to a booting guest until its agent is up (up to 3 s), so a first
//!   ping answered only after a wait longer than that eighth came early,
//!   and is learnt as a miss.
//! - **Nothing learnt anywhere** (the first wave after a start-up): the
//!   oldest boot waited on pings every poll interval, and learns; the
//!   others ping every [`FOLLOWER_PERIOD`] poll intervals until it has,
//!   then ping at what it learnt. A first wave of N boots costs one boot
//!   pinged through, not N. A follower is never held by its scout: it
//!   pings on its own, only less often, and any boot that answers teaches
//!   every other.

use std::collections::HashMap;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::proxmox::estimate::FirstLook;

/// While nothing is learnt, a boot other than the oldest pings this many
/// poll intervals apart.
pub(super) const FOLLOWER_PERIOD: u32 = 4;

/// What is known of boots after a start, cluster-wide.
#[derive(Default)]
pub(super) struct Boots {
    /// When, after a start, to ping first.
    pub(super) first_ping: FirstLook,
    /// Boots waited on now, by VMID, with when each started.
    in_flight: Mutex<HashMap<u32, Instant>>,
}

/// One boot waited on, in [`Boots::in_flight`] until dropped.
pub(super) struct Boot<'a> {
    boots: &'a Boots,
    vmid: u32,
    pub(super) started: Instant,
}

impl Drop for Boot<'_> {
    fn drop(&mut self) {
        self.boots.in_flight.lock().remove(&self.vmid);
    }
}

impl Boots {
    /// A boot of VM `vmid` starting now.
    pub(super) fn begin(&self, vmid: u32) -> Boot<'_> {
        let started = Instant::now();
        self.in_flight.lock().insert(vmid, started);
        Boot {
            boots: self,
            vmid,
            started,
        }
    }

    /// Whether `boot` is the oldest waited on: the one that pings every
    /// poll interval while nothing is learnt.
    pub(super) fn is_scout(&self, boot: &Boot<'_>) -> bool {
        let in_flight = self.in_flight.lock();
        in_flight
            .iter()
            .all(|(vmid, started)| (*started, *vmid) >= (boot.started, boot.vmid))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_boot_is_the_scout_until_it_ends() {
        let boots = Boots::default();
        let first = boots.begin(101);
        let second = boots.begin(102);
        assert!(boots.is_scout(&first));
        assert!(!boots.is_scout(&second));
        drop(first);
        assert!(boots.is_scout(&second));
    }
}
