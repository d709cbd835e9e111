//! Records and marks as the column arrays one `INSERT ... SELECT * FROM
//! UNNEST(...)` takes, so a batch is one statement rather than a round trip
//! per row. The writer's upserts and the restore's inserts send the same
//! columns in the same order.

use deadpool_postgres::GenericClient;
use providerkit::{FenceMark, InFlight, MachineRecord};
use tokio_postgres::ToStatement;

/// Rows per statement when a batch is large (a seeding boot, a restore):
/// each statement's column arrays are encoded, and held until sent, one
/// statement at a time, so a state of 100k machines never has all of its
/// rows encoded at once. A few dozen statements cost a few dozen round
/// trips, nothing beside the rows' own transfer.
pub(crate) const ROWS_PER_STATEMENT: usize = 5_000;

/// Postgres integers are signed; a revision, window or generation past
/// i64 is never real.
pub(crate) fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Send `rows` (each a record and its stamp, see `commit`) as the eleven
/// machine columns (id, rev, record, the four operation ids, the three
/// window fields, the stamp) of `statement`.
pub(crate) async fn send_machines<S: ?Sized + ToStatement + Sync + Send>(
    tx: &impl GenericClient,
    statement: &S,
    rows: &[(i64, &MachineRecord)],
) -> Result<u64, tokio_postgres::Error> {
    let stamps: Vec<i64> = rows.iter().map(|(stamp, _)| *stamp).collect();
    let records: Vec<&MachineRecord> = rows.iter().map(|(_, r)| *r).collect();
    let encoded: Vec<_> = records.iter().map(|r| r.encoded()).collect();
    let ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
    let revs: Vec<i64> = records.iter().map(|r| int(r.rev)).collect();
    let blobs: Vec<&[u8]> = encoded.iter().map(|e| e.as_bytes()).collect();
    let op =
        |i: usize| -> Vec<Option<&str>> { records.iter().map(|r| r.ops[i].as_deref()).collect() };
    let window = |f: fn(&InFlight) -> u64| -> Vec<Option<i64>> {
        records
            .iter()
            .map(|r| r.in_flight.as_ref().map(|w| int(f(w))))
            .collect()
    };
    let (create, configure, drain, delete) = (op(0), op(1), op(2), op(3));
    let started = window(|w| w.started_ms);
    let deadline = window(|w| w.deadline_ms);
    let grace = window(|w| w.grace_ms);
    tx.execute(
        statement,
        &[
            &ids, &revs, &blobs, &create, &configure, &drain, &delete, &started, &deadline, &grace,
            &stamps,
        ],
    )
    .await
}

/// Send `rows` (each a mark and its stamp) as the five fence columns
/// (shard id, machine id, epoch, sequence, the stamp) of `statement`.
pub(crate) async fn send_fences<S: ?Sized + ToStatement + Sync + Send>(
    tx: &impl GenericClient,
    statement: &S,
    rows: &[(i64, &FenceMark)],
) -> Result<u64, tokio_postgres::Error> {
    let stamps: Vec<i64> = rows.iter().map(|(stamp, _)| *stamp).collect();
    let marks: Vec<&FenceMark> = rows.iter().map(|(_, m)| *m).collect();
    let shards: Vec<&[u8]> = marks.iter().map(|m| m.shard_id.as_bytes()).collect();
    let machine_ids: Vec<&[u8]> = marks.iter().map(|m| m.machine_id.as_bytes()).collect();
    let epochs: Vec<i64> = marks.iter().map(|m| m.epoch).collect();
    let sequences: Vec<i64> = marks.iter().map(|m| m.sequence).collect();
    tx.execute(
        statement,
        &[&shards, &machine_ids, &epochs, &sequences, &stamps],
    )
    .await
}
