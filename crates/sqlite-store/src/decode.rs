//! The load path: machine rows are scanned on one thread and decoded on
//! several, fence marks are read as they are.

use std::path::Path;

use providerkit::{FactsInterner, FenceMark, InFlight, Loaded, MachineRecord, StoreError};

use crate::error::{invalid, sql_error};

/// Rows handed to a decoder thread at a time.
const DECODE_CHUNK: usize = 512;

/// Machine rows as stored, copied into one buffer per chunk so the scanning
/// thread does one allocation per chunk and every allocation of the decoded
/// records happens (and stays) on the decoder thread.
#[derive(Default)]
struct RawChunk {
    bytes: Vec<u8>,
    rows: Vec<RawRow>,
}

struct RawRow {
    rev: u64,
    id: std::ops::Range<usize>,
    record: std::ops::Range<usize>,
    ops: [Option<std::ops::Range<usize>>; 4],
    in_flight: Option<InFlight>,
}

impl RawChunk {
    fn push_bytes(&mut self, data: &[u8]) -> std::ops::Range<usize> {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(data);
        start..self.bytes.len()
    }

    fn push(&mut self, path: &Path, row: &rusqlite::Row<'_>) -> Result<(), StoreError> {
        let text = |i: usize| -> rusqlite::Result<Option<&[u8]>> {
            Ok(row.get_ref(i)?.as_str_or_null()?.map(str::as_bytes))
        };
        let id_bytes = text(0)
            .ok()
            .flatten()
            .ok_or_else(|| invalid(path, "a machine row has no valid id".to_string()))?;
        let id = self.push_bytes(id_bytes);
        let bad = |chunk: &RawChunk, what: &str, e: rusqlite::Error| {
            let id = String::from_utf8_lossy(&chunk.bytes[id.clone()]).into_owned();
            invalid(path, format!("machine {id:?} has an invalid {what}: {e}")).with_source(e)
        };
        let rev: u64 = match row.get(1) {
            Ok(rev) => rev,
            Err(e) => return Err(bad(self, "revision", e)),
        };
        let record = match row.get_ref(2).and_then(|v| Ok(v.as_blob()?)) {
            Ok(blob) => self.push_bytes(blob),
            Err(e) => return Err(bad(self, "record", e)),
        };
        let mut ops: [Option<std::ops::Range<usize>>; 4] = Default::default();
        for (i, op) in ops.iter_mut().enumerate() {
            match text(3 + i) {
                Ok(value) => *op = value.map(|v| self.push_bytes(v)),
                Err(e) => return Err(bad(self, "operation id", e)),
            }
        }
        let ms = |i: usize| -> rusqlite::Result<Option<u64>> {
            Ok(row
                .get::<_, Option<i64>>(i)?
                .map(|v| u64::try_from(v).unwrap_or(0)))
        };
        let window = (|| -> rusqlite::Result<Option<InFlight>> {
            Ok(match (ms(7)?, ms(8)?, ms(9)?) {
                (Some(started_ms), Some(deadline_ms), grace) => Some(InFlight {
                    started_ms,
                    deadline_ms,
                    grace_ms: grace.unwrap_or(0),
                }),
                _ => None,
            })
        })();
        let in_flight = match window {
            Ok(window) => window,
            Err(e) => return Err(bad(self, "transition window", e)),
        };
        self.rows.push(RawRow {
            rev,
            id,
            record,
            ops,
            in_flight,
        });
        Ok(())
    }

    fn decode(
        self,
        path: &Path,
        out: &mut Vec<MachineRecord>,
        interner: &mut FactsInterner,
    ) -> Result<(), StoreError> {
        let text = |range: &std::ops::Range<usize>| {
            // Came out of SQLite as TEXT, which the scan checked is UTF-8.
            String::from_utf8_lossy(&self.bytes[range.clone()]).into_owned()
        };
        for row in &self.rows {
            let id = &self.bytes[row.id.clone()];
            let ops = [
                row.ops[0].as_ref().map(text),
                row.ops[1].as_ref().map(text),
                row.ops[2].as_ref().map(text),
                row.ops[3].as_ref().map(text),
            ];
            let mut record =
                MachineRecord::decode_wire(&self.bytes[row.record.clone()], row.rev, ops, interner)
                    .map_err(|e| {
                        invalid(
                            path,
                            format!("machine {:?} has an invalid record: {e}", text(&row.id)),
                        )
                        .with_source(e)
                    })?;
            if record.id.as_bytes() != id {
                return Err(invalid(
                    path,
                    format!(
                        "machine row {:?} holds the record of {:?}",
                        text(&row.id),
                        record.id
                    ),
                ));
            }
            record.in_flight = row.in_flight;
            out.push(record);
        }
        Ok(())
    }
}

/// The whole state as `tx` sees it: the boot generation, every record in
/// revision order and every fence mark (a load and a dump read the same).
pub(crate) fn load_state(
    path: &Path,
    tx: &rusqlite::Transaction<'_>,
) -> Result<Loaded, StoreError> {
    let boot_generation: u64 = tx
        .query_row("SELECT boot_generation FROM meta", [], |r| r.get(0))
        .map_err(|e| sql_error(path, "cannot read the boot generation", e))?;
    let mut machines = load_machines(path, tx)?;
    machines.sort_unstable_by_key(|m| m.rev);
    let fences = load_fences(path, tx)?;
    Ok(Loaded {
        machines,
        fences,
        boot_generation,
    })
}

/// Scan every machine row while decoder threads turn the records into
/// messages: decoding (allocation-heavy maps) dominates restart time, so it
/// runs on every core alongside the scan.
pub(crate) fn load_machines(
    path: &Path,
    tx: &rusqlite::Transaction<'_>,
) -> Result<Vec<MachineRecord>, StoreError> {
    let mut stmt = tx
        .prepare(
            "SELECT id, rev, record, op_create, op_configure, op_drain, op_delete, \
             started_ms, deadline_ms, grace_ms FROM machines",
        )
        .map_err(|e| sql_error(path, "cannot read machines", e))?;
    let mut rows = stmt
        .query([])
        .map_err(|e| sql_error(path, "cannot read machines", e))?;
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get().clamp(1, 4));
    std::thread::scope(|scope| {
        let mut senders = Vec::with_capacity(workers);
        let mut decoders = Vec::with_capacity(workers);
        for _ in 0..workers {
            let (send, receive) = std::sync::mpsc::sync_channel::<RawChunk>(4);
            senders.push(send);
            decoders.push(scope.spawn(move || {
                let mut out = Vec::new();
                let mut interner = FactsInterner::new();
                for chunk in receive {
                    chunk.decode(path, &mut out, &mut interner)?;
                }
                Ok::<_, StoreError>(out)
            }));
        }
        let scanned = (|| {
            let mut chunk = RawChunk::default();
            let mut next = 0;
            while let Some(row) = rows
                .next()
                .map_err(|e| sql_error(path, "cannot read machines", e))?
            {
                chunk.push(path, row)?;
                if chunk.rows.len() == DECODE_CHUNK {
                    // A closed channel means that decoder already failed;
                    // its error is collected below.
                    if senders[next % workers]
                        .send(std::mem::take(&mut chunk))
                        .is_err()
                    {
                        return Ok(());
                    }
                    next += 1;
                }
            }
            if !chunk.rows.is_empty() {
                // As above: a failed send surfaces as the decoder's error.
                let _ = senders[next % workers].send(chunk);
            }
            Ok(())
        })();
        drop(senders);
        let mut first_error = scanned.err();
        let mut machines = Vec::new();
        for decoder in decoders {
            match decoder.join() {
                Ok(Ok(mut part)) => machines.append(&mut part),
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                Err(_) => {
                    first_error.get_or_insert_with(|| {
                        StoreError::unavailable(format!(
                            "state file {}: a record decoder thread panicked",
                            path.display()
                        ))
                    });
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(machines),
        }
    })
}

pub(crate) fn load_fences(
    path: &Path,
    tx: &rusqlite::Transaction<'_>,
) -> Result<Vec<FenceMark>, StoreError> {
    let mut fences = Vec::new();
    let mut stmt = tx
        .prepare("SELECT shard_id, machine_id, epoch, sequence FROM fences")
        .map_err(|e| sql_error(path, "cannot read fencing marks", e))?;
    let mut rows = stmt
        .query([])
        .map_err(|e| sql_error(path, "cannot read fencing marks", e))?;
    while let Some(row) = rows
        .next()
        .map_err(|e| sql_error(path, "cannot read fencing marks", e))?
    {
        let mark = (|| {
            Ok::<_, rusqlite::Error>(FenceMark {
                shard_id: row.get(0)?,
                machine_id: row.get(1)?,
                epoch: row.get(2)?,
                sequence: row.get(3)?,
            })
        })()
        .map_err(|e| {
            invalid(path, format!("a fencing mark row is malformed: {e}")).with_source(e)
        })?;
        fences.push(mark);
    }
    Ok(fences)
}
