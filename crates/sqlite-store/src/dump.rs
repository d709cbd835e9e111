//! The whole state out and into an empty state, for `state copy`
//! (providerkit's [`StateDump`]): a read that starts no boot generation,
//! and a restore that checks the state is empty and writes everything in
//! one transaction.

use std::sync::Arc;

use providerkit::{Change, ChangeBatch, Loaded, RestoreError, StateDump, Store, StoreError};
use rusqlite::TransactionBehavior;

use crate::error::sql_error;
use crate::{decode, schema, writer, SqliteStore};

impl StateDump for SqliteStore {
    fn dump(&self) -> Result<Loaded, StoreError> {
        let path = &self.path;
        let mut conn = self.conn.lock();
        // One read transaction: the records, the marks and the generation
        // are one moment's.
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Deferred)
            .map_err(|e| sql_error(path, "cannot start the read transaction", e))?;
        let loaded = decode::load_state(path, &tx)?;
        // Nothing was written: ending the read is all the commit does.
        tx.commit()
            .map_err(|e| sql_error(path, "cannot end the read transaction", e))?;
        Ok(loaded)
    }

    fn restore(&self, state: &Loaded) -> Result<(), RestoreError> {
        let path = &self.path;
        let mut conn = self.conn.lock();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| sql_error(path, "cannot start the restore transaction", e))?;
        let (machines, fence_marks) = schema::counts(path, &tx)?;
        if machines > 0 || fence_marks > 0 {
            return Err(RestoreError::NotEmpty {
                target: self.describe(),
                machines,
                fence_marks,
            });
        }
        let mut batch = ChangeBatch::default();
        batch.merge(
            state
                .machines
                .iter()
                .map(|m| Change::Machine(Arc::new(m.clone())))
                .chain(state.fences.iter().cloned().map(Change::Fence))
                .collect(),
        );
        writer::write_rows(&tx, &batch)
            .map_err(|e| sql_error(path, "cannot write the restored state", e))?;
        // SQLite integers are signed; a generation past i64 is never real.
        let generation = i64::try_from(state.boot_generation).unwrap_or(i64::MAX);
        tx.execute(
            "UPDATE meta SET boot_generation = max(boot_generation, ?1)",
            [generation],
        )
        .map_err(|e| sql_error(path, "cannot write the boot generation", e))?;
        tx.commit()
            .map_err(|e| sql_error(path, "cannot commit the restored state", e))?;
        Ok(())
    }
}
