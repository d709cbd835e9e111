//! Fencing: the newest (epoch, sequence) each shard has shown for each
//! machine. A mutation whose token is not newer than its shard's mark is
//! refused before anything else about it is looked at. Marks are never
//! forgotten (fencing must survive a restart and a reclaim), so the number
//! of shards that may hold a mark on one machine is capped.

use std::collections::HashMap;

use super::options::{echo_prefix, EngineOptions};
use crate::error::KitError;
use crate::fence::Token;
use crate::store::{Change, FenceMark};

pub(super) struct Fences {
    /// shard_id -> machine_id -> (epoch, sequence).
    marks: HashMap<String, HashMap<String, (i64, i64)>>,
    /// machine_id -> how many shards hold a mark on it (for the cap).
    shard_marks: HashMap<String, usize>,
    /// Distinct shards that may hold a mark on one machine.
    cap: usize,
    /// Mutant: one mark per shard, whatever the machine.
    #[cfg(feature = "mutants")]
    per_shard: bool,
}

impl Fences {
    /// The marks as the store holds them.
    pub(super) fn load(stored: Vec<FenceMark>, opts: &EngineOptions) -> Fences {
        let mut fences = Fences {
            marks: HashMap::new(),
            shard_marks: HashMap::new(),
            cap: opts.limits.max_shard_marks_per_machine,
            #[cfg(feature = "mutants")]
            per_shard: opts.mutants.fence_per_shard,
        };
        for mark in stored {
            *fences
                .shard_marks
                .entry(mark.machine_id.clone())
                .or_default() += 1;
            fences
                .marks
                .entry(mark.shard_id)
                .or_default()
                .insert(mark.machine_id, (mark.epoch, mark.sequence));
        }
        fences
    }

    /// Check `token` against its shard's mark on machine `id`, and move the
    /// mark up to it; the new mark is queued in `changes`. An absent token
    /// passes and marks nothing.
    pub(super) fn advance(
        &mut self,
        id: &str,
        token: &Token,
        changes: &mut Vec<Change>,
    ) -> Result<(), KitError> {
        if token.is_absent() {
            return Ok(());
        }
        let mark_key = self.key(id);
        let mark = self
            .marks
            .get(&token.shard_id)
            .and_then(|m| m.get(mark_key))
            .copied();
        if !token.is_newer_than(mark) {
            let (epoch, sequence) = mark.unwrap_or_default();
            return Err(KitError::Fenced(format!(
                "stale fencing token for shard {:?} on machine {id:?}: ({}, {}) is not newer \
                 than ({epoch}, {sequence})",
                token.shard_id, token.epoch, token.sequence
            )));
        }
        let mark = (token.epoch, token.sequence);
        // Keys are allocated only the first time a pair is seen.
        match self
            .marks
            .get_mut(&token.shard_id)
            .and_then(|marks| marks.get_mut(mark_key))
        {
            Some(slot) => *slot = mark,
            None => {
                let cap = self.cap;
                let held = self.shard_marks.get(mark_key).copied().unwrap_or(0);
                if held >= cap {
                    return Err(KitError::InvalidArgument(format!(
                        "machine {} already carries fencing marks from {held} shards; the cap \
                         is {cap} shards per machine: reuse an existing shard_id for it",
                        echo_prefix(id)
                    )));
                }
                *self.shard_marks.entry(mark_key.to_string()).or_default() += 1;
                self.marks
                    .entry(token.shard_id.clone())
                    .or_default()
                    .insert(mark_key.to_string(), mark);
            }
        }
        changes.push(Change::Fence(FenceMark {
            shard_id: token.shard_id.clone(),
            machine_id: mark_key.to_string(),
            epoch: token.epoch,
            sequence: token.sequence,
        }));
        Ok(())
    }

    /// The machine a mark is kept under.
    #[cfg(feature = "mutants")]
    fn key<'a>(&self, id: &'a str) -> &'a str {
        if self.per_shard {
            ""
        } else {
            id
        }
    }

    /// The machine a mark is kept under: the machine itself.
    #[cfg(not(feature = "mutants"))]
    fn key<'a>(&self, id: &'a str) -> &'a str {
        id
    }
}
