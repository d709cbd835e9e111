//! List: revision-ordered deltas, capped pages, and the rotating walk a
//! capped cursor-less List starts (see [`crate::cursor::Walk`]). The
//! [`Lister`] owns what List alone reads: the cursor codec and where the
//! next cursor-less walk starts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bigfleet_proto::raw::{EncodedMachineList, RawMessage};
use bigfleet_proto::v1alpha1 as pb;
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, WireType};

use super::ledger::Ledger;
use super::machines::Machines;
use super::options::EngineOptions;
use crate::cursor::{Cursor, CursorCodec, Walk};
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

fn wanted(states: &[i32], machine: &MachineRecord) -> bool {
    states.is_empty() || states.contains(&(machine.state.to_wire() as i32))
}

struct WalkPage {
    machines: Vec<Arc<MachineRecord>>,
    /// The revision of the first machine returned.
    head: Option<u64>,
    next: Cursor,
}

/// One page of a [`Walk`]: revisions above `start`, then around to it.
fn scan_walk(table: &Machines, states: &[i32], cap: usize, walk: Walk) -> WalkPage {
    let mut machines = Vec::with_capacity(cap.min(table.len()));
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
        for (rev, machine) in range.into_iter().flat_map(|r| table.by_revision(r)) {
            if machines.len() == cap {
                break;
            }
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
                settled = Some(table.revision());
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

pub(super) struct Lister {
    ledger: Arc<Ledger>,
    cursor: CursorCodec,
    /// Where the next capped, cursor-less List starts: the revision of the
    /// head the previous one returned.
    head: AtomicU64,
    /// Mutant: a capped, cursor-less List always starts at the same head.
    #[cfg(feature = "mutants")]
    frozen_head: bool,
}

impl Lister {
    /// `generation`: the boot's, embedded in every cursor so none is
    /// honoured across a restart. Of `opts` only a mutant is read.
    #[cfg_attr(not(feature = "mutants"), allow(unused_variables))]
    pub(super) fn new(ledger: Arc<Ledger>, generation: u64, opts: &EngineOptions) -> Lister {
        Lister {
            ledger,
            cursor: CursorCodec::new(generation),
            head: AtomicU64::new(0),
            #[cfg(feature = "mutants")]
            frozen_head: opts.mutants.frozen_list_head,
        }
    }

    /// List. With a valid `since_revision` only machines changed after it
    /// are returned, in revision order; when `max_results` cuts the page,
    /// the cursor is the revision of the last machine returned, so the next
    /// page resumes exactly after it: every machine is visited once.
    ///
    /// A capped List without a usable cursor does not always return the
    /// same head: it starts just after the head the previous such List
    /// returned (callers pick machines this way), and its cursor continues
    /// a [`Walk`] around the revision order, so paging stays set-complete.
    pub(super) fn list(&self, states: &[i32], max_results: i32, since_revision: &[u8]) -> ListPage {
        let cap = if max_results > 0 {
            max_results as usize
        } else {
            usize::MAX
        };
        let books = self.ledger.read();
        let table = &books.machines;
        let walk = match self.cursor.decode_cursor(since_revision) {
            Some(Cursor::Since(since)) => return self.list_since(table, states, cap, since),
            None if cap == usize::MAX => return self.list_since(table, states, cap, 0),
            Some(Cursor::Walk(walk)) => walk,
            None => {
                let start = self.head.load(Ordering::Relaxed);
                Walk {
                    start,
                    pos: start,
                    settled: None,
                }
            }
        };
        let fresh = walk.pos == walk.start && walk.settled.is_none();
        let page = scan_walk(table, states, cap, walk);
        if fresh {
            if let Some(head) = page.head {
                if !self.mutant_frozen_head() {
                    self.head.store(head, Ordering::Relaxed);
                }
            }
        }
        ListPage {
            machines: page.machines,
            revision: self.cursor.encode_cursor(page.next),
        }
    }

    fn list_since(&self, table: &Machines, states: &[i32], cap: usize, since: u64) -> ListPage {
        let mut machines = Vec::with_capacity(cap.min(table.len()));
        let mut last_rev = None;
        for (rev, machine) in table.by_revision(since.saturating_add(1)..) {
            if machines.len() == cap {
                break;
            }
            if wanted(states, machine) {
                machines.push(Arc::clone(machine));
                last_rev = Some(rev);
            }
        }
        let cursor_rev = if machines.len() == cap {
            last_rev.unwrap_or(table.revision())
        } else {
            table.revision()
        };
        ListPage {
            machines,
            revision: self.cursor.encode(cursor_rev),
        }
    }

    #[cfg(feature = "mutants")]
    fn mutant_frozen_head(&self) -> bool {
        self.frozen_head
    }

    #[cfg(not(feature = "mutants"))]
    fn mutant_frozen_head(&self) -> bool {
        false
    }
}
