//! The load path: machine rows decoded into records (the transition window
//! from its columns), fence marks as they are.

use futures::TryStreamExt;
use providerkit::{FactsInterner, FenceMark, InFlight, Loaded, MachineRecord, StoreError};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Row, Transaction};

use crate::error::pg_error;

/// The state holds something this build cannot read.
fn invalid(target: &str, detail: impl std::fmt::Display) -> StoreError {
    StoreError::corrupt(format!(
        "PostgreSQL state {target} is not a valid state: {detail}; restore a backup or point \
         --state at another database"
    ))
}

/// The whole state as `tx` sees it: the boot generation, every record in
/// revision order and every fence mark (a load and a dump read the same).
pub(crate) async fn load_state(target: &str, tx: &Transaction<'_>) -> Result<Loaded, StoreError> {
    let generation: i64 = tx
        .query_one(
            "SELECT boot_generation FROM bigfleet_meta WHERE id = 1",
            &[],
        )
        .await
        .map_err(|e| pg_error(target, "cannot read the boot generation", e))?
        .get(0);
    let mut machines = load_machines(target, tx).await?;
    machines.sort_unstable_by_key(|m| m.rev);
    let fences = load_fences(target, tx).await?;
    Ok(Loaded {
        machines,
        fences,
        boot_generation: u64::try_from(generation).unwrap_or(0),
    })
}

pub(crate) async fn load_machines(
    target: &str,
    tx: &Transaction<'_>,
) -> Result<Vec<MachineRecord>, StoreError> {
    let read = |e| pg_error(target, "cannot read machines", e);
    // Rows are decoded as they arrive rather than collected first: at 100k
    // machines the rows' raw bytes would otherwise be held beside every
    // decoded record until the last one is read.
    let rows = tx
        .query_raw(
            "SELECT id, rev, record, op_create, op_configure, op_drain, op_delete,
                    started_ms, deadline_ms, grace_ms FROM bigfleet_machines",
            std::iter::empty::<&(dyn ToSql + Sync)>(),
        )
        .await
        .map_err(read)?;
    futures::pin_mut!(rows);
    let mut interner = FactsInterner::new();
    let mut machines = Vec::new();
    while let Some(row) = rows.try_next().await.map_err(read)? {
        machines.push(decode_machine(target, &row, &mut interner)?);
    }
    Ok(machines)
}

fn decode_machine(
    target: &str,
    row: &Row,
    interner: &mut FactsInterner,
) -> Result<MachineRecord, StoreError> {
    let id: String = row
        .try_get(0)
        .map_err(|e| invalid(target, format!("a machine row has no valid id: {e}")))?;
    let bad = |what: &str, e: tokio_postgres::Error| {
        invalid(target, format!("machine {id:?} has an invalid {what}: {e}")).with_source(e)
    };
    let rev: i64 = row.try_get(1).map_err(|e| bad("revision", e))?;
    let blob: &[u8] = row.try_get(2).map_err(|e| bad("record", e))?;
    let mut ops: [Option<String>; 4] = Default::default();
    for (i, op) in ops.iter_mut().enumerate() {
        *op = row.try_get(3 + i).map_err(|e| bad("operation id", e))?;
    }
    let ms = |i: usize| -> Result<Option<u64>, StoreError> {
        Ok(row
            .try_get::<_, Option<i64>>(i)
            .map_err(|e| bad("transition window", e))?
            .map(|v| u64::try_from(v).unwrap_or(0)))
    };
    let in_flight = match (ms(7)?, ms(8)?, ms(9)?) {
        (Some(started_ms), Some(deadline_ms), grace) => Some(InFlight {
            started_ms,
            deadline_ms,
            grace_ms: grace.unwrap_or(0),
        }),
        _ => None,
    };
    let rev = u64::try_from(rev)
        .map_err(|_| invalid(target, format!("machine {id:?} has a negative revision")))?;
    let mut record = MachineRecord::decode_wire(blob, rev, ops, interner).map_err(|e| {
        invalid(target, format!("machine {id:?} has an invalid record: {e}")).with_source(e)
    })?;
    if record.id != id {
        return Err(invalid(
            target,
            format!("machine row {id:?} holds the record of {:?}", record.id),
        ));
    }
    record.in_flight = in_flight;
    Ok(record)
}

pub(crate) async fn load_fences(
    target: &str,
    tx: &Transaction<'_>,
) -> Result<Vec<FenceMark>, StoreError> {
    let rows = tx
        .query(
            "SELECT shard_id, machine_id, epoch, sequence FROM bigfleet_fences",
            &[],
        )
        .await
        .map_err(|e| pg_error(target, "cannot read fencing marks", e))?;
    rows.iter()
        .map(|row| {
            let text = |i: usize| -> Result<String, String> {
                let bytes: Vec<u8> = row.try_get(i).map_err(|e| e.to_string())?;
                String::from_utf8(bytes).map_err(|e| e.to_string())
            };
            let mark = (|| {
                Ok::<_, String>(FenceMark {
                    shard_id: text(0)?,
                    machine_id: text(1)?,
                    epoch: row.try_get(2).map_err(|e| e.to_string())?,
                    sequence: row.try_get(3).map_err(|e| e.to_string())?,
                })
            })();
            mark.map_err(|e| invalid(target, format!("a fencing mark row is malformed: {e}")))
        })
        .collect()
}
