//! Switching from the reference implementation: its state is one JSON
//! document (its providerkit's file store), which is imported once into a
//! new database that then replaces it at the same path; the original is
//! kept next to it as `<path>.reference-backup`.
//!
//! The document, as published: an object with `machines` (objects keyed by
//! field name: `ID`, `State` by name, `Host` {`Provider`, `Ref`},
//! `InstanceType`, `Zone`, `CapacityType` by name, `PricePerHour`,
//! `InterruptionProbability`, `Resources`, `Allocatable`, `Labels`,
//! `Cluster`, `ShardMetadata`, `LastError`), `fences` (a list of
//! {`shard_id`, `machine_id`, `epoch`, `sequence`}; earlier versions kept
//! one mark per shard, an object of shard id to {`Epoch`, `Sequence`}),
//! `ops` (a list of {`machine_id`, `kind`, `operation_id`}), `rev` and
//! `next_op`. Empty lists and maps may be `null`. `rev` and `next_op` are
//! not imported: revisions are renumbered here, and operation ids this
//! provider mints embed its boot generation, so they never collide with
//! imported ones.

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bigfleet_proto::v1alpha1 as pb;
use providerkit::{
    CatalogFacts, Change, FenceMark, MachineRecord, State, StoreError, TransitionKind,
};
use rusqlite::Connection;
use serde::Deserialize;

use crate::error::{invalid, io_error, sql_error, NOT_A_STATE_FIX};
use crate::lock::StateLock;
use crate::schema::{build_new, sibling, sync_dir, OPEN_FLAGS};

/// What an import brought over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Imported {
    /// Where the original JSON file was kept.
    pub backup: PathBuf,
    pub operation_ids: u64,
}

#[derive(Deserialize)]
struct Document {
    #[serde(default)]
    machines: Option<Vec<RefMachine>>,
    #[serde(default)]
    fences: Option<RefFences>,
    #[serde(default)]
    ops: Option<Vec<RefOp>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RefMachine {
    #[serde(rename = "ID")]
    id: String,
    state: String,
    #[serde(default)]
    host: Option<RefHost>,
    #[serde(default)]
    instance_type: String,
    #[serde(default)]
    zone: String,
    #[serde(default)]
    capacity_type: String,
    #[serde(default)]
    price_per_hour: f64,
    #[serde(default)]
    interruption_probability: f64,
    #[serde(default)]
    resources: Option<HashMap<String, String>>,
    #[serde(default)]
    allocatable: Option<HashMap<String, String>>,
    #[serde(default)]
    labels: Option<HashMap<String, String>>,
    #[serde(default)]
    cluster: String,
    #[serde(default)]
    shard_metadata: Option<HashMap<String, String>>,
    #[serde(default)]
    last_error: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RefHost {
    #[serde(default)]
    provider: String,
    #[serde(default)]
    r#ref: String,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RefFences {
    PerMachine(Vec<RefFence>),
    PerShard(HashMap<String, RefShardMark>),
}

#[derive(Deserialize)]
struct RefFence {
    shard_id: String,
    machine_id: String,
    epoch: i64,
    sequence: i64,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct RefShardMark {
    epoch: i64,
    sequence: i64,
}

#[derive(Deserialize)]
struct RefOp {
    machine_id: String,
    kind: String,
    operation_id: String,
}

fn unreadable(path: &Path, detail: impl std::fmt::Display) -> StoreError {
    StoreError::corrupt(format!(
        "state file {} looks like the reference implementation's JSON state but cannot be \
         imported: {detail}; {NOT_A_STATE_FIX}",
        path.display()
    ))
}

fn state_named(name: &str) -> Option<State> {
    Some(match name {
        "Speculative" => State::Speculative,
        "Creating" => State::Creating,
        "Idle" => State::Idle,
        "Configuring" => State::Configuring,
        "Configured" => State::Configured,
        "Draining" => State::Draining,
        "Deleting" => State::Deleting,
        "Failed" => State::Failed,
        _ => return None,
    })
}

fn capacity_named(name: &str) -> pb::CapacityType {
    match name {
        "BareMetal" => pb::CapacityType::BareMetal,
        "Reserved" => pb::CapacityType::Reserved,
        "OnDemand" => pb::CapacityType::OnDemand,
        "Spot" => pb::CapacityType::Spot,
        _ => pb::CapacityType::Unspecified,
    }
}

fn kind_named(name: &str) -> Option<TransitionKind> {
    Some(match name {
        "create" => TransitionKind::Create,
        "configure" => TransitionKind::Configure,
        "drain" => TransitionKind::Drain,
        "delete" => TransitionKind::Delete,
        _ => return None,
    })
}

/// The keys the reference writes at the top level (always all of them).
const TOP_LEVEL: [&str; 5] = ["machines", "fences", "ops", "rev", "next_op"];

/// Only a document shaped like the reference's is imported: any other JSON
/// object (another program's file) would otherwise be taken for an empty
/// state and replaced.
fn check_shape(path: &Path, value: &serde_json::Value) -> Result<(), StoreError> {
    let foreign = |why: String| {
        invalid(
            path,
            format!("it is JSON but not the reference implementation's state ({why})"),
        )
    };
    let Some(object) = value.as_object() else {
        return Err(foreign("not an object".into()));
    };
    if let Some(key) = object.keys().find(|k| !TOP_LEVEL.contains(&k.as_str())) {
        return Err(foreign(format!("unexpected key {key:?}")));
    }
    for key in ["machines", "fences"] {
        if !object.contains_key(key) {
            return Err(foreign(format!("no {key:?} key")));
        }
    }
    Ok(())
}

/// The document as changes for this store, and the number of operation ids.
fn convert(path: &Path, doc: Document) -> Result<(Vec<Change>, u64), StoreError> {
    let mut records: Vec<MachineRecord> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for (i, m) in doc.machines.unwrap_or_default().into_iter().enumerate() {
        if m.id.is_empty() {
            return Err(unreadable(path, format!("machine #{} has no ID", i + 1)));
        }
        if index.contains_key(&m.id) {
            return Err(unreadable(
                path,
                format!("machine {:?} is listed twice", m.id),
            ));
        }
        let state = state_named(&m.state).ok_or_else(|| {
            unreadable(
                path,
                format!("machine {:?} has an unknown state {:?}", m.id, m.state),
            )
        })?;
        let facts = CatalogFacts {
            instance_type: m.instance_type,
            zone: m.zone,
            capacity_type: capacity_named(&m.capacity_type),
            price_per_hour: m.price_per_hour,
            interruption_probability: m.interruption_probability,
            resources: m.resources.unwrap_or_default(),
            allocatable: m.allocatable.unwrap_or_default(),
            labels: m.labels.unwrap_or_default(),
        }
        .share();
        // Revisions in file order, starting at 1 like a fresh state.
        let mut record = MachineRecord::new(m.id.clone(), facts, i as u64 + 1);
        record.state = state;
        record.host = m
            .host
            .filter(|h| !(h.provider.is_empty() && h.r#ref.is_empty()))
            .map(|h| pb::HostRef {
                provider: h.provider,
                r#ref: h.r#ref,
            });
        record.cluster = m.cluster;
        record.shard_metadata = m.shard_metadata.unwrap_or_default();
        record.last_error = m.last_error;
        index.insert(m.id, records.len());
        records.push(record);
    }

    let mut operation_ids = 0;
    for op in doc.ops.unwrap_or_default() {
        let kind = kind_named(&op.kind).ok_or_else(|| {
            unreadable(
                path,
                format!(
                    "operation {:?} has an unknown kind {:?}",
                    op.operation_id, op.kind
                ),
            )
        })?;
        // An id for a machine the file does not list has nothing to attach
        // to: nothing can retry against a machine that does not exist.
        let Some(&at) = index.get(&op.machine_id) else {
            tracing::warn!(
                path = %path.display(),
                machine = %op.machine_id,
                operation_id = %op.operation_id,
                "reference state: skipping the operation id of a machine it does not list"
            );
            continue;
        };
        records[at].ops[kind.index()] = Some(op.operation_id);
        operation_ids += 1;
    }

    let mut fences: Vec<FenceMark> = Vec::new();
    match doc.fences {
        None => {}
        Some(RefFences::PerMachine(list)) => {
            let mut seen = HashSet::new();
            for f in list {
                if !seen.insert((f.shard_id.clone(), f.machine_id.clone())) {
                    return Err(unreadable(
                        path,
                        format!(
                            "the fence mark of shard {:?} on machine {:?} is listed twice",
                            f.shard_id, f.machine_id
                        ),
                    ));
                }
                fences.push(FenceMark {
                    shard_id: f.shard_id,
                    machine_id: f.machine_id,
                    epoch: f.epoch,
                    sequence: f.sequence,
                });
            }
        }
        // One mark per shard fenced every machine at once; the same mark on
        // every machine keeps exactly those tokens out.
        Some(RefFences::PerShard(marks)) => {
            for (shard, mark) in marks {
                for record in &records {
                    fences.push(FenceMark {
                        shard_id: shard.clone(),
                        machine_id: record.id.clone(),
                        epoch: mark.epoch,
                        sequence: mark.sequence,
                    });
                }
            }
        }
    }

    let mut changes: Vec<Change> = records
        .into_iter()
        .map(|r| Change::Machine(Arc::new(r)))
        .collect();
    changes.extend(fences.into_iter().map(Change::Fence));
    Ok((changes, operation_ids))
}

fn read_all(path: &Path, mut file: &File) -> Result<Vec<u8>, StoreError> {
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| io_error(path, "cannot read", e))?;
    Ok(bytes)
}

/// Keep the original at `backup`: a second link to the same file where the
/// filesystem allows it, a synced copy otherwise. A backup left by an
/// import that was interrupted is reused if it holds the same bytes.
fn keep_backup(path: &Path, backup: &Path, original: &[u8]) -> Result<(), StoreError> {
    if let Ok(existing) = std::fs::read(backup) {
        if existing == original {
            return Ok(());
        }
        return Err(StoreError::inaccessible(format!(
            "state file {}: cannot keep the reference implementation's state as {}: that file \
             exists and differs; move it away",
            path.display(),
            backup.display()
        )));
    }
    if std::fs::hard_link(path, backup).is_err() {
        std::fs::write(backup, original)
            .and_then(|()| File::open(backup)?.sync_all())
            .map_err(|e| io_error(path, &format!("cannot write {}", backup.display()), e))?;
    }
    sync_dir(path)
}

/// Import the reference implementation's JSON state at `path` (held by
/// `lock`) and put the new database in its place, moving the lock to it.
pub(crate) fn import(path: &Path, lock: &mut StateLock) -> Result<Imported, StoreError> {
    let original = read_all(path, lock.file())?;
    let value: serde_json::Value =
        serde_json::from_slice(&original).map_err(|e| unreadable(path, &e).with_source(e))?;
    check_shape(path, &value)?;
    let doc: Document =
        serde_json::from_value(value).map_err(|e| unreadable(path, &e).with_source(e))?;
    let (changes, operation_ids) = convert(path, doc)?;

    let temp = sibling(path, &format!(".importing-{}", std::process::id()));
    let result = write_new(path, &temp, changes).and_then(|()| {
        let mut name = OsString::from(path.as_os_str());
        name.push(".reference-backup");
        let backup = PathBuf::from(name);
        keep_backup(path, &backup, &original)?;
        // Lock the new file before it takes the name, so no other process
        // can find it unlocked at `path`.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&temp)
            .map_err(|e| io_error(path, "cannot open the imported database", e))?;
        lock.adopt(path, file)?;
        std::fs::rename(&temp, path).map_err(|e| {
            io_error(
                path,
                &format!(
                    "cannot move the imported database {} into place",
                    temp.display()
                ),
                e,
            )
        })?;
        sync_dir(path)?;
        Ok(Imported {
            backup,
            operation_ids,
        })
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    result
}

/// A complete database holding `changes` at `temp`, synced.
fn write_new(path: &Path, temp: &Path, changes: Vec<Change>) -> Result<(), StoreError> {
    build_new(path, temp)?;
    let mut conn = Connection::open_with_flags(temp, OPEN_FLAGS)
        .map_err(|e| sql_error(path, "cannot open the imported database", e))?;
    conn.execute_batch("PRAGMA synchronous = FULL;")
        .map_err(|e| sql_error(path, "cannot configure the imported database", e))?;
    crate::writer::write_changes(&mut conn, changes)
        .map_err(|e| sql_error(path, "cannot write the imported state", e))?;
    conn.close()
        .map_err(|(_, e)| sql_error(path, "cannot close the imported database", e))?;
    File::open(temp)
        .and_then(|f| f.sync_all())
        .map_err(|e: io::Error| io_error(path, "cannot sync the imported database", e))
}
