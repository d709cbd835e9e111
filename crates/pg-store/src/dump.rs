//! The whole state out and into an empty state, for `state copy`
//! (providerkit's [`StateDump`]): a read in one snapshot that starts no
//! boot generation, and a restore that checks the state is empty and
//! writes everything in one transaction.
//!
//! The restore's rows are plain inserts (a conflict would mean the state
//! was not empty), sent in chunks so a state of 100k machines is a few
//! statements, not 100k round trips, stamped 0 (older than anything a
//! writer sends). It also advances the writer generation: a writer without
//! a lease that is (wrongly) running on the target finds it moved at its
//! next commit and fails it, rather than writing over the restored state.

use providerkit::{FenceMark, Loaded, MachineRecord, RestoreError, StateDump, Store, StoreError};
use tokio_postgres::IsolationLevel;

use crate::error::{pg_error, pool_error};
use crate::rows::{int, send_fences, send_machines, ROWS_PER_STATEMENT};
use crate::{decode, PgStore};

const INSERT_MACHINES: &str = "INSERT INTO bigfleet_machines
     (id, rev, record, op_create, op_configure, op_drain, op_delete,
      started_ms, deadline_ms, grace_ms, round)
     SELECT * FROM UNNEST($1::text[], $2::int8[], $3::bytea[], $4::text[], $5::text[],
                          $6::text[], $7::text[], $8::int8[], $9::int8[], $10::int8[],
                          $11::int8[])";

const INSERT_FENCES: &str = "INSERT INTO bigfleet_fences
     (shard_id, machine_id, epoch, sequence, round)
     SELECT * FROM UNNEST($1::bytea[], $2::bytea[], $3::int8[], $4::int8[], $5::int8[])";

impl StateDump for PgStore {
    fn dump(&self) -> Result<Loaded, StoreError> {
        let pool = self.pool.clone();
        let name = self.target.clone();
        self.run(async move {
            let mut client = pool
                .get()
                .await
                .map_err(|e| pool_error(&name, "cannot connect", e))?;
            // One snapshot: the records, the marks and the generation are
            // one moment's.
            let tx = client
                .build_transaction()
                .isolation_level(IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await
                .map_err(|e| pg_error(&name, "cannot start the read transaction", e))?;
            let loaded = decode::load_state(&name, &tx).await?;
            tx.commit()
                .await
                .map_err(|e| pg_error(&name, "cannot end the read transaction", e))?;
            Ok(loaded)
        })
    }

    fn restore(&self, state: &Loaded) -> Result<(), RestoreError> {
        let pool = self.pool.clone();
        let name = self.target.clone();
        let described = self.describe();
        let state = state.clone();
        let outcome = self.run(async move {
            let mut client = pool
                .get()
                .await
                .map_err(|e| pool_error(&name, "cannot connect", e))?;
            let tx = client
                .transaction()
                .await
                .map_err(|e| pg_error(&name, "cannot start the restore transaction", e))?;
            // The meta row's lock keeps the commits of a writer without a
            // lease out until this transaction ends, so the counts stay
            // true (a leader's rows would make an insert conflict, and
            // then nothing is written).
            tx.execute("SELECT 1 FROM bigfleet_meta WHERE id = 1 FOR UPDATE", &[])
                .await
                .map_err(|e| pg_error(&name, "cannot lock the state", e))?;
            let row = tx
                .query_one(
                    "SELECT (SELECT count(*) FROM bigfleet_machines),
                            (SELECT count(*) FROM bigfleet_fences)",
                    &[],
                )
                .await
                .map_err(|e| pg_error(&name, "cannot count the state", e))?;
            let count = |i: usize| u64::try_from(row.get::<_, i64>(i)).unwrap_or(0);
            let (machines, fence_marks) = (count(0), count(1));
            if machines > 0 || fence_marks > 0 {
                return Ok(Some((machines, fence_marks)));
            }
            let write =
                |e: tokio_postgres::Error| pg_error(&name, "cannot write the restored state", e);
            for chunk in state.machines.chunks(ROWS_PER_STATEMENT) {
                let records: Vec<(i64, &MachineRecord)> = chunk.iter().map(|r| (0, r)).collect();
                send_machines(&tx, INSERT_MACHINES, &records)
                    .await
                    .map_err(write)?;
            }
            for chunk in state.fences.chunks(ROWS_PER_STATEMENT) {
                let marks: Vec<(i64, &FenceMark)> = chunk.iter().map(|m| (0, m)).collect();
                send_fences(&tx, INSERT_FENCES, &marks)
                    .await
                    .map_err(write)?;
            }
            tx.execute(
                "UPDATE bigfleet_meta SET boot_generation = GREATEST(boot_generation, $1),
                     writer_generation = writer_generation + 1 WHERE id = 1",
                &[&int(state.boot_generation)],
            )
            .await
            .map_err(|e| pg_error(&name, "cannot write the boot generation", e))?;
            tx.commit()
                .await
                .map_err(|e| pg_error(&name, "cannot commit the restored state", e))?;
            Ok(None)
        })?;
        match outcome {
            Some((machines, fence_marks)) => Err(RestoreError::NotEmpty {
                target: described,
                machines,
                fence_marks,
            }),
            None => Ok(()),
        }
    }
}
