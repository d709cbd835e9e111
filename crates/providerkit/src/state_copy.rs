//! Moving a whole state from one store to another (`bigfleet-proxmox state
//! copy`, SQLite and PostgreSQL in any direction).
//!
//! A store that can be copied implements [`StateDump`]: it hands out
//! everything it holds without starting a boot generation
//! ([`StateDump::dump`]) and takes a whole state into an empty one in one
//! transaction ([`StateDump::restore`]). [`copy_state`] does both, then
//! reads both sides back and compares everything: a copy that is not exact
//! is reported with what differs, never trusted.

use std::collections::BTreeMap;

use crate::model::MachineRecord;
use crate::store::{Loaded, Store, StoreError};

/// How many differences an error lists before it says how many more there
/// are: enough to see the pattern, short enough for one line.
const DIFFERENCES_SHOWN: usize = 5;

/// A store whose whole state can be read out and written into another.
/// A state read whole, without being written: the source of a copy. Every
/// [`StateDump`] is one; a source that must stay untouched (a state file a
/// rollback still has to read) implements only this.
pub trait StateSource {
    /// Everything the state holds, in one consistent view.
    fn read(&self) -> Result<Loaded, StoreError>;

    /// What messages name the state by.
    fn describe(&self) -> String;
}

impl<T: StateDump + ?Sized> StateSource for T {
    fn read(&self) -> Result<Loaded, StoreError> {
        self.dump()
    }

    fn describe(&self) -> String {
        Store::describe(self)
    }
}

pub trait StateDump: Store {
    /// Everything the state holds, read in one consistent view, without
    /// starting a boot generation (so reading a state never changes it).
    /// `boot_generation` is the last one a boot used (0: never loaded).
    fn dump(&self) -> Result<Loaded, StoreError>;

    /// Write `state` whole into this state, which must hold no machine
    /// record and no fence mark (else [`RestoreError::NotEmpty`] and
    /// nothing is written). One transaction: a restore that fails writes
    /// nothing. The boot generation becomes the greater of the two, so no
    /// operation id either state handed out is handed out again.
    fn restore(&self, state: &Loaded) -> Result<(), RestoreError>;
}

/// Why [`StateDump::restore`] wrote nothing.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The target already holds a state.
    #[error(
        "{target} is not empty: it holds {machines} machine records and {fence_marks} fence marks"
    )]
    NotEmpty {
        target: String,
        machines: u64,
        fence_marks: u64,
    },
    /// The store could not write (or check) the state.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What [`copy_state`] copied and verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyReport {
    pub machines: u64,
    pub fence_marks: u64,
    /// The target's boot generation after the copy (its next boot uses a
    /// greater one).
    pub boot_generation: u64,
}

/// Why a copy failed. Each message names the state concerned and, where
/// the operator has one, the fix.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// The source could not be read.
    #[error("cannot read the source {from}: {source}")]
    ReadSource {
        from: String,
        #[source]
        source: StoreError,
    },
    /// The target could not be read (before the copy, or to verify it).
    #[error("cannot read the target {to}: {source}")]
    ReadTarget {
        to: String,
        #[source]
        source: StoreError,
    },
    /// The target already holds a state; nothing was written.
    #[error(
        "the target {to} is not empty (it holds {machines} machine records and {fence_marks} \
         fence marks); nothing was written: copy into an empty state (a path where no file is, \
         or a PostgreSQL database or schema without the state's tables)"
    )]
    TargetNotEmpty {
        to: String,
        machines: u64,
        fence_marks: u64,
    },
    /// Writing the copy failed; the store wrote nothing.
    #[error("cannot write the copy into {to}: {source}")]
    Write {
        to: String,
        #[source]
        source: StoreError,
    },
    /// The copy, read back, is not the source.
    #[error(
        "the copy in {to} differs from the source {from}: {}; do not use it: empty the target \
         and copy again",
        summary(.differences)
    )]
    Mismatch {
        from: String,
        to: String,
        differences: Vec<String>,
    },
    /// The source changed while it was copied: something still writes it.
    #[error(
        "the source {from} changed while it was copied ({}): a provider is still using it; stop \
         every provider on it, empty the target {to} and copy again",
        summary(.differences)
    )]
    SourceChanged {
        from: String,
        to: String,
        differences: Vec<String>,
    },
}

/// The first differences, and how many more there are.
fn summary(differences: &[String]) -> String {
    let shown = differences
        .iter()
        .take(DIFFERENCES_SHOWN)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join("; ");
    match differences.len().saturating_sub(DIFFERENCES_SHOWN) {
        0 => shown,
        more => format!("{shown}; and {more} more"),
    }
}

/// Copy everything `from` holds into `to`, which must be empty, then read
/// both back: the target must hold exactly the source's records and fence
/// marks with at least its boot generation, and the source must not have
/// changed meanwhile.
pub fn copy_state(from: &dyn StateSource, to: &dyn StateDump) -> Result<CopyReport, CopyError> {
    let (from_name, to_name) = (from.describe(), Store::describe(to));
    let read_source = |source| CopyError::ReadSource {
        from: from_name.clone(),
        source,
    };
    let read_target = |source| CopyError::ReadTarget {
        to: to_name.clone(),
        source,
    };
    let source = from.read().map_err(read_source)?;
    let before = to.dump().map_err(read_target)?;
    if !before.machines.is_empty() || !before.fences.is_empty() {
        return Err(CopyError::TargetNotEmpty {
            to: to_name,
            machines: before.machines.len() as u64,
            fence_marks: before.fences.len() as u64,
        });
    }
    to.restore(&source).map_err(|e| match e {
        // Filled between the check above and the restore's own.
        RestoreError::NotEmpty {
            machines,
            fence_marks,
            ..
        } => CopyError::TargetNotEmpty {
            to: to_name.clone(),
            machines,
            fence_marks,
        },
        RestoreError::Store(source) => CopyError::Write {
            to: to_name.clone(),
            source,
        },
    })?;
    let copied = to.dump().map_err(read_target)?;
    let mut differences = differences(&source, &copied);
    let expected_generation = source.boot_generation.max(before.boot_generation);
    if copied.boot_generation != expected_generation {
        differences.push(format!(
            "the boot generation is {} (expected {expected_generation})",
            copied.boot_generation
        ));
    }
    if !differences.is_empty() {
        return Err(CopyError::Mismatch {
            from: from_name,
            to: to_name,
            differences,
        });
    }
    let after = from.read().map_err(read_source)?;
    let mut changed = differences_between(&source, &after);
    if after.boot_generation != source.boot_generation {
        changed.push(format!(
            "its boot generation went from {} to {}",
            source.boot_generation, after.boot_generation
        ));
    }
    if !changed.is_empty() {
        return Err(CopyError::SourceChanged {
            from: from_name,
            to: to_name,
            differences: changed,
        });
    }
    Ok(CopyReport {
        machines: copied.machines.len() as u64,
        fence_marks: copied.fences.len() as u64,
        boot_generation: copied.boot_generation,
    })
}

/// How `found` (the target) differs from `expected` (the source), one line
/// per record or mark, in id order.
pub fn differences(expected: &Loaded, found: &Loaded) -> Vec<String> {
    compare(
        expected,
        found,
        "missing from the target",
        "only in the target",
    )
}

/// How a later read of a state differs from an earlier one.
fn differences_between(earlier: &Loaded, later: &Loaded) -> Vec<String> {
    compare(earlier, later, "removed", "added")
}

fn compare(expected: &Loaded, found: &Loaded, missing: &str, extra: &str) -> Vec<String> {
    let mut out = Vec::new();
    let by_id = |state: &Loaded| -> BTreeMap<String, MachineRecord> {
        state
            .machines
            .iter()
            .map(|m| (m.id.clone(), m.clone()))
            .collect()
    };
    let (want, got) = (by_id(expected), by_id(found));
    for (id, record) in &want {
        match got.get(id) {
            None => out.push(format!("machine {id:?} is {missing}")),
            Some(other) if other != record => out.push(format!(
                "machine {id:?} differs in {}",
                differing_fields(record, other).join(", ")
            )),
            Some(_) => {}
        }
    }
    for id in got.keys().filter(|id| !want.contains_key(*id)) {
        out.push(format!("machine {id:?} is {extra}"));
    }
    let by_key = |state: &Loaded| -> BTreeMap<(String, String), (i64, i64)> {
        state
            .fences
            .iter()
            .map(|f| {
                (
                    (f.shard_id.clone(), f.machine_id.clone()),
                    (f.epoch, f.sequence),
                )
            })
            .collect()
    };
    let (want, got) = (by_key(expected), by_key(found));
    for ((shard, machine), mark) in &want {
        let name = format!("the fence mark of shard {shard:?} on machine {machine:?}");
        match got.get(&(shard.clone(), machine.clone())) {
            None => out.push(format!("{name} is {missing}")),
            Some(other) if other != mark => out.push(format!(
                "{name} is epoch {} sequence {} (expected epoch {} sequence {})",
                other.0, other.1, mark.0, mark.1
            )),
            Some(_) => {}
        }
    }
    for (shard, machine) in got.keys().filter(|key| !want.contains_key(*key)) {
        out.push(format!(
            "the fence mark of shard {shard:?} on machine {machine:?} is {extra}"
        ));
    }
    out
}

/// The names of the fields in which two records of one machine differ.
fn differing_fields(a: &MachineRecord, b: &MachineRecord) -> Vec<&'static str> {
    let checks: [(&'static str, bool); 10] = [
        ("id", a.id == b.id),
        ("state", a.state == b.state),
        ("host", a.host == b.host),
        ("facts", a.facts == b.facts),
        ("last_error", a.last_error == b.last_error),
        ("cluster", a.cluster == b.cluster),
        ("shard_metadata", a.shard_metadata == b.shard_metadata),
        ("rev", a.rev == b.rev),
        ("operation ids", a.ops == b.ops),
        ("transition window", a.in_flight == b.in_flight),
    ];
    checks
        .into_iter()
        .filter(|(_, same)| !same)
        .map(|(name, _)| name)
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::memory_store::MemoryStore;
    use crate::model::{CatalogFacts, InFlight, State};
    use crate::store::{Change, FenceMark};

    fn record(id: &str, rev: u64, state: State) -> MachineRecord {
        let facts = CatalogFacts {
            instance_type: "small".into(),
            ..Default::default()
        }
        .share();
        let mut r = MachineRecord::new(id.to_string(), facts, rev);
        r.state = state;
        r
    }

    fn mark(shard: &str, machine: &str, epoch: i64, sequence: i64) -> FenceMark {
        FenceMark {
            shard_id: shard.into(),
            machine_id: machine.into(),
            epoch,
            sequence,
        }
    }

    /// A retaining store holding three machines (one mid-Create with its
    /// window) and two fence marks, after `boots` boots.
    fn source(boots: u64) -> MemoryStore {
        let store = MemoryStore::retaining();
        let mut creating = record("m-2", 2, State::Creating);
        creating.in_flight = Some(InFlight {
            started_ms: 1_000,
            deadline_ms: 61_000,
            grace_ms: 0,
        });
        store.submit(vec![
            Change::Machine(Arc::new(record("m-1", 1, State::Idle))),
            Change::Machine(Arc::new(creating)),
            Change::Machine(Arc::new(record("m-3", 3, State::Failed))),
            Change::Fence(mark("s1", "m-1", 1, 2)),
            Change::Fence(mark("s2", "m-2", 3, 4)),
        ]);
        for _ in 0..boots {
            store.load().expect("load");
        }
        store
    }

    #[test]
    fn a_copy_holds_everything_and_keeps_the_boot_generation() {
        let from = source(2);
        let generation = from.dump().expect("dump").boot_generation;
        let to = MemoryStore::retaining();
        let report = copy_state(&from, &to).expect("copy");
        assert_eq!(
            report,
            CopyReport {
                machines: 3,
                fence_marks: 2,
                boot_generation: generation
            }
        );
        let (a, b) = (from.dump().expect("dump"), to.dump().expect("dump"));
        assert!(differences(&a, &b).is_empty());
        assert_eq!(to.load().expect("load").boot_generation, generation + 1);
    }

    #[test]
    fn a_target_that_is_not_empty_is_refused_and_left_as_it_was() {
        let from = source(1);
        let to = MemoryStore::retaining();
        to.submit(vec![Change::Fence(mark("other", "m-9", 1, 1))]);
        let e = copy_state(&from, &to).expect_err("refused");
        assert!(
            matches!(
                e,
                CopyError::TargetNotEmpty {
                    machines: 0,
                    fence_marks: 1,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("copy into an empty state"), "{e}");
        let left = to.dump().expect("dump");
        assert!(left.machines.is_empty() && left.fences.len() == 1);
    }

    #[test]
    fn a_restore_refuses_a_state_that_is_not_empty() {
        let to = source(0);
        let e = to
            .restore(&source(0).dump().expect("dump"))
            .expect_err("refused");
        assert!(
            matches!(
                e,
                RestoreError::NotEmpty {
                    machines: 3,
                    fence_marks: 2,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[test]
    fn a_target_that_used_more_boot_generations_keeps_its_own() {
        // The source never booted; the target did (a provider started on
        // it once, with no machines yet).
        let from = source(0);
        let to = MemoryStore::retaining();
        to.load().expect("load");
        let ahead = to.dump().expect("dump").boot_generation;
        assert!(ahead > from.dump().expect("dump").boot_generation);
        let report = copy_state(&from, &to).expect("copy");
        assert_eq!(report.boot_generation, ahead);
    }

    /// A target that loses a record, changes a window and drops a mark on
    /// the way: the verification names each.
    struct Lossy(MemoryStore);

    impl Store for Lossy {
        fn load(&self) -> Result<Loaded, StoreError> {
            self.0.load()
        }
        fn submit(&self, changes: Vec<Change>) -> crate::store::Ticket {
            self.0.submit(changes)
        }
        fn durable(
            &self,
            ticket: crate::store::Ticket,
        ) -> futures::future::BoxFuture<'static, Result<(), StoreError>> {
            self.0.durable(ticket)
        }
        fn describe(&self) -> String {
            "lossy".into()
        }
    }

    impl StateDump for Lossy {
        fn dump(&self) -> Result<Loaded, StoreError> {
            self.0.dump()
        }
        fn restore(&self, state: &Loaded) -> Result<(), RestoreError> {
            let mut state = state.clone();
            state.machines.retain(|m| m.id != "m-1");
            for m in &mut state.machines {
                m.in_flight = None;
            }
            state.fences.retain(|f| f.shard_id != "s2");
            self.0.restore(&state)
        }
    }

    #[test]
    fn a_copy_that_differs_says_how() {
        let from = source(1);
        let e = copy_state(&from, &Lossy(MemoryStore::retaining())).expect_err("mismatch");
        let CopyError::Mismatch { differences, .. } = &e else {
            panic!("{e:?}");
        };
        assert_eq!(
            differences,
            &vec![
                "machine \"m-1\" is missing from the target".to_string(),
                "machine \"m-2\" differs in transition window".to_string(),
                "the fence mark of shard \"s2\" on machine \"m-2\" is missing from the target"
                    .to_string(),
            ]
        );
        let text = e.to_string();
        assert!(
            text.starts_with("the copy in lossy differs from the source memory: machine \"m-1\""),
            "{text}"
        );
        assert!(text.contains("empty the target and copy again"), "{text}");
    }

    /// A target whose restore stands for a provider still writing the
    /// source meanwhile.
    struct WhileWritten {
        target: MemoryStore,
        source: Arc<MemoryStore>,
    }

    impl Store for WhileWritten {
        fn load(&self) -> Result<Loaded, StoreError> {
            self.target.load()
        }
        fn submit(&self, changes: Vec<Change>) -> crate::store::Ticket {
            self.target.submit(changes)
        }
        fn durable(
            &self,
            ticket: crate::store::Ticket,
        ) -> futures::future::BoxFuture<'static, Result<(), StoreError>> {
            self.target.durable(ticket)
        }
        fn describe(&self) -> String {
            "target".into()
        }
    }

    impl StateDump for WhileWritten {
        fn dump(&self) -> Result<Loaded, StoreError> {
            self.target.dump()
        }
        fn restore(&self, state: &Loaded) -> Result<(), RestoreError> {
            self.source
                .submit(vec![Change::Fence(mark("s1", "m-1", 1, 3))]);
            self.target.restore(state)
        }
    }

    #[test]
    fn a_source_written_during_the_copy_is_reported() {
        let from = Arc::new(source(1));
        let to = WhileWritten {
            target: MemoryStore::retaining(),
            source: Arc::clone(&from),
        };
        let e = copy_state(&*from, &to).expect_err("changed");
        let text = e.to_string();
        assert!(matches!(e, CopyError::SourceChanged { .. }), "{e:?}");
        assert!(
            text.contains(
                "the fence mark of shard \"s1\" on machine \"m-1\" is epoch 1 sequence 3"
            ),
            "{text}"
        );
        assert!(text.contains("a provider is still using it"), "{text}");
    }

    #[test]
    fn long_lists_of_differences_are_cut() {
        let many: Vec<String> = (0..8).map(|i| format!("d{i}")).collect();
        assert_eq!(summary(&many), "d0; d1; d2; d3; d4; and 3 more");
        assert_eq!(summary(&many[..2]), "d0; d1");
    }

    #[test]
    fn fence_marks_that_differ_name_both_values() {
        let a = Loaded {
            fences: vec![mark("s", "m", 1, 2)],
            ..Loaded::default()
        };
        let b = Loaded {
            fences: vec![mark("s", "m", 1, 3), mark("t", "m", 1, 1)],
            ..Loaded::default()
        };
        assert_eq!(
            differences(&a, &b),
            vec![
                "the fence mark of shard \"s\" on machine \"m\" is epoch 1 sequence 3 (expected \
                 epoch 1 sequence 2)"
                    .to_string(),
                "the fence mark of shard \"t\" on machine \"m\" is only in the target".to_string(),
            ]
        );
    }
}
