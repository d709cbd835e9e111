//! List: revision-ordered deltas, capped pages, and the rotating walk a
//! capped cursor-less List starts (see [`crate::cursor::Walk`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bigfleet_proto::raw::{EncodedMachineList, RawMessage};
use bigfleet_proto::v1alpha1 as pb;
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, WireType};

use super::{Engine, Inner};
use crate::cursor::{Cursor, Walk};
use crate::model::MachineRecord;

/// The answer to a List: a snapshot of the matching records, taken under
/// the lock and encoded after it is released.
#[derive(Clone, Debug)]
pub struct ListPage {
    pub machines: Vec<Arc<MachineRecord>>,
    pub revision: Vec<u8>,
}

impl ListPage {
    /// The `MachineList` encoding, built in one buffer.
    pub fn encode(&self) -> EncodedMachineList {
        let lens: Vec<usize> = self.machines.iter().map(|m| m.wire_len()).collect();
        let body: usize = lens
            .iter()
            .map(|&len| 1 + encoded_len_varint(len as u64) + len)
            .sum();
        let mut buf = Vec::with_capacity(
            body + 2 + encoded_len_varint(self.revision.len() as u64) + self.revision.len(),
        );
        for (machine, len) in self.machines.iter().zip(lens) {
            encode_key(1, WireType::LengthDelimited, &mut buf);
            encode_varint(len as u64, &mut buf);
            machine.encode_wire(&mut buf);
        }
        if !self.revision.is_empty() {
            prost::encoding::bytes::encode(2, &self.revision, &mut buf);
        }
        RawMessage(buf.into())
    }

    /// The page as message trees (tests and tools).
    pub fn to_wire(&self) -> pb::MachineList {
        pb::MachineList {
            machines: self.machines.iter().map(|m| m.to_wire()).collect(),
            revision: self.revision.clone(),
        }
    }
}

pub(super) fn wanted(states: &[i32], machine: &MachineRecord) -> bool {
    states.is_empty() || states.contains(&(machine.state.to_wire() as i32))
}

pub(super) struct WalkPage {
    machines: Vec<Arc<MachineRecord>>,
    /// The revision of the first machine returned.
    head: Option<u64>,
    next: Cursor,
}

/// One page of a [`Walk`]: revisions above `start`, then around to it.
pub(super) fn scan_walk(inner: &Inner, states: &[i32], cap: usize, walk: Walk) -> WalkPage {
    let mut machines = Vec::with_capacity(cap.min(inner.machines.len()));
    let mut head = None;
    let Walk {
        start,
        mut pos,
        mut settled,
    } = walk;
    loop {
        // BTreeMap::range panics on an inverted range: phase two is empty
        // once it has reached `start`.
        let range = match settled {
            None => Some(pos.saturating_add(1)..=u64::MAX),
            Some(_) => (pos < start).then(|| pos + 1..=start),
        };
        for (&rev, &slot) in range.into_iter().flat_map(|r| inner.by_rev.range(r)) {
            if machines.len() == cap {
                break;
            }
            let machine = &inner.machines[slot];
            if wanted(states, machine) {
                machines.push(Arc::clone(machine));
                head.get_or_insert(rev);
                pos = rev;
            }
        }
        if machines.len() == cap {
            let next = Cursor::Walk(Walk {
                start,
                pos,
                settled,
            });
            return WalkPage {
                machines,
                head,
                next,
            };
        }
        match settled {
            None => {
                settled = Some(inner.revision);
                pos = 0;
            }
            Some(at) => {
                return WalkPage {
                    machines,
                    head,
                    next: Cursor::Since(at),
                }
            }
        }
    }
}

impl Engine {
    /// List. With a valid `since_revision` only machines changed after it
    /// are returned, in revision order; when `max_results` cuts the page,
    /// the cursor is the revision of the last machine returned, so the next
    /// page resumes exactly after it: every machine is visited once.
    ///
    /// A capped List without a usable cursor does not always return the
    /// same head: it starts just after the head the previous such List
    /// returned (callers pick machines this way), and its cursor continues
    /// a [`Walk`] around the revision order, so paging stays set-complete.
    pub fn list(&self, states: &[i32], max_results: i32, since_revision: &[u8]) -> ListPage {
        let cap = if max_results > 0 {
            max_results as usize
        } else {
            usize::MAX
        };
        let inner = self.inner.read();
        let walk = match self.cursor.decode_cursor(since_revision) {
            Some(Cursor::Since(since)) => return self.list_since(&inner, states, cap, since),
            None if cap == usize::MAX => return self.list_since(&inner, states, cap, 0),
            Some(Cursor::Walk(walk)) => walk,
            None => {
                let start = self.list_head.load(Ordering::Relaxed);
                Walk {
                    start,
                    pos: start,
                    settled: None,
                }
            }
        };
        let fresh = walk.pos == walk.start && walk.settled.is_none();
        let page = scan_walk(&inner, states, cap, walk);
        if fresh {
            if let Some(head) = page.head {
                if !self.mutant_frozen_list_head() {
                    self.list_head.store(head, Ordering::Relaxed);
                }
            }
        }
        ListPage {
            machines: page.machines,
            revision: self.cursor.encode_cursor(page.next),
        }
    }

    pub(super) fn list_since(
        &self,
        inner: &Inner,
        states: &[i32],
        cap: usize,
        since: u64,
    ) -> ListPage {
        let mut machines = Vec::with_capacity(cap.min(inner.machines.len()));
        let mut last_rev = None;
        for (&rev, &slot) in inner.by_rev.range(since.saturating_add(1)..) {
            if machines.len() == cap {
                break;
            }
            let machine = &inner.machines[slot];
            if wanted(states, machine) {
                machines.push(Arc::clone(machine));
                last_rev = Some(rev);
            }
        }
        let cursor_rev = if machines.len() == cap {
            last_rev.unwrap_or(inner.revision)
        } else {
            inner.revision
        };
        ListPage {
            machines,
            revision: self.cursor.encode(cursor_rev),
        }
    }
}
