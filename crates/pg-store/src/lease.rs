//! The leader lease: one row in the state's database says which replica
//! may serve, reconcile and write, until when, and under which epoch.
//!
//! Expiry is the database's clock (`now()`), so replicas never compare
//! their own clocks. Every new holder gets the next epoch, and every commit
//! of a [`crate::PgStore`] opened with that epoch checks it in its own
//! transaction under the lease lock in shared mode
//! (`commit::SHARE_LEASE_LOCK`). Taking the lease holds that lock
//! exclusively while it changes the epoch ([`TAKE_LEASE_LOCK`]): it waits
//! for the commits in flight, and a commit that comes after finds the new
//! epoch and writes nothing. A replica that lost the lease can therefore
//! not write, whatever its own clock or scheduler did. Renewing and
//! releasing leave the epoch as it is and take no lock, so commits never
//! hold a renewal back.
//!
//! The holder must also stop acting before the lease can have expired: it
//! counts its term from the moment it *sent* the statement that acquired or
//! renewed the lease, which is no later than the database's `now()` for it.

use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use providerkit::StoreError;

use crate::error::{pg_error, pool_error};
use crate::pool::{build_pool, PgOptions};
use crate::schema;
use crate::target::Target;

/// Take the lease when it has expired, or (`$3`) when the replica asking
/// already holds it under its name (a replica restarted in place takes its
/// own lease back without waiting for it to expire).
const ACQUIRE: &str = "UPDATE bigfleet_lease
     SET epoch = epoch + 1, holder = $1, expires_at = now() + make_interval(secs => $2)
     WHERE id = 1 AND (expires_at <= now() OR (holder = $1 AND $3))
     RETURNING epoch";

/// Held from before the epoch changes until the change commits; taken
/// only when the lease can be taken, so a standby's attempts never stall
/// the leader's commits.
const TAKE_LEASE_LOCK: &str = concat!("SELECT pg_advisory_xact_lock(", lease_lock_key!(), ")");

const RENEW: &str = "UPDATE bigfleet_lease SET expires_at = now() + make_interval(secs => $2)
     WHERE id = 1 AND epoch = $1
     RETURNING (SELECT schema_version FROM bigfleet_meta WHERE id = 1)";

const RELEASE: &str = "UPDATE bigfleet_lease SET expires_at = '-infinity'
     WHERE id = 1 AND epoch = $1";

const READ: &str = "SELECT epoch, holder,
            CASE WHEN expires_at <= now() THEN 0::float8
                 ELSE EXTRACT(EPOCH FROM expires_at - now())::float8 END
     FROM bigfleet_lease WHERE id = 1";

/// Connections the lease keeps: it runs one statement at a time, apart
/// from the state's own pool so a busy writer never delays a renewal.
const LEASE_POOL_SIZE: usize = 2;

/// Whether a replica takes back a lease still running under its own name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnName {
    /// At once: the holder of that name is this replica's previous life
    /// (restarted in place, its lease not yet expired).
    TakeBack,
    /// Only once it expires: another live replica runs under the same name
    /// (a misconfiguration), and taking it back would depose it each time.
    WaitForExpiry,
}

/// What an attempt to take the lease found.
#[derive(Clone, Debug, PartialEq)]
pub enum LeaseState {
    /// This replica holds the lease under `epoch` until `sent` + the TTL.
    Acquired { epoch: i64, sent: Instant },
    /// Another replica holds it.
    Held {
        holder: String,
        epoch: i64,
        /// How long until it expires unless renewed.
        expires_in: Duration,
    },
}

/// The lease row of one state database.
pub struct Lease {
    pool: Pool,
    target: String,
    created: bool,
}

impl Lease {
    /// Connect and create or migrate the schema (the lease row is part of
    /// it). Runs on the caller's runtime.
    pub async fn connect(target: &Target, options: &PgOptions) -> Result<Lease, StoreError> {
        let name = target.display().to_string();
        let pool = build_pool(target, options, LEASE_POOL_SIZE)?;
        let mut client = pool
            .get()
            .await
            .map_err(|e| pool_error(&name, "cannot connect", e))?;
        let opened = schema::prepare(&name, &mut client, true).await?;
        drop(client);
        Ok(Lease {
            pool,
            target: name,
            created: opened.created,
        })
    }

    /// The database had no state schema: connecting created it.
    pub fn created_the_state(&self) -> bool {
        self.created
    }

    /// Take the lease for `holder` for `ttl` if nobody else holds it (or,
    /// with [`OwnName::TakeBack`], if it is held under `holder`'s name).
    pub async fn try_acquire(
        &self,
        holder: &str,
        ttl: Duration,
        own_name: OwnName,
    ) -> Result<LeaseState, StoreError> {
        let mut client = self.client().await?;
        let held = self.read(&client).await?;
        let take_back = own_name == OwnName::TakeBack;
        if let LeaseState::Held {
            holder: ref current,
            expires_in,
            ..
        } = held
        {
            let takeable = expires_in.is_zero() || (take_back && current == holder);
            if !takeable {
                return Ok(held);
            }
        }
        // The term counts from before BEGIN, whose time is the `now()` the
        // expiry is computed from, however long the lock takes.
        let sent = Instant::now();
        let take = |e| self.error("cannot take the leader lease", e);
        let tx = client.transaction().await.map_err(take)?;
        tx.execute(TAKE_LEASE_LOCK, &[]).await.map_err(take)?;
        let row = tx
            .query_opt(ACQUIRE, &[&holder, &ttl.as_secs_f64(), &take_back])
            .await
            .map_err(take)?;
        tx.commit().await.map_err(take)?;
        match row {
            Some(row) => Ok(LeaseState::Acquired {
                epoch: row.get(0),
                sent,
            }),
            // Another replica took it between the read and the take.
            None => self.read(&client).await,
        }
    }

    /// Who holds the lease now, as [`LeaseState::Held`] (an expired lease
    /// has `expires_in` zero).
    pub async fn current(&self) -> Result<LeaseState, StoreError> {
        let client = self.client().await?;
        self.read(&client).await
    }

    async fn read(&self, client: &deadpool_postgres::Object) -> Result<LeaseState, StoreError> {
        let row = client
            .query_one(READ, &[])
            .await
            .map_err(|e| self.error("cannot read the leader lease", e))?;
        let seconds: f64 = row.get(2);
        Ok(LeaseState::Held {
            epoch: row.get(0),
            holder: row.get(1),
            expires_in: Duration::try_from_secs_f64(seconds).unwrap_or_default(),
        })
    }

    /// Extend the lease held under `epoch` by `ttl` from now. `Ok(Some(sent))`
    /// when it was extended (the term counts from `sent`), `Ok(None)` when
    /// another replica has taken it.
    pub async fn renew(&self, epoch: i64, ttl: Duration) -> Result<Option<Instant>, StoreError> {
        let client = self.client().await?;
        let sent = Instant::now();
        let renewed = client
            .query_opt(RENEW, &[&epoch, &ttl.as_secs_f64()])
            .await
            .map_err(|e| self.error("cannot renew the leader lease", e))?;
        let Some(row) = renewed else {
            return Ok(None);
        };
        // A replica of a newer release may have migrated the schema while
        // this one led (it migrates when it opens the state); a leader that
        // kept committing would write rows the newer schema reads wrongly.
        let version: Option<i64> = row.get(0);
        if let Some(version) = version.filter(|v| *v > crate::schema::SCHEMA_VERSION) {
            return Err(StoreError::incompatible(format!(
                "PostgreSQL state {} now has schema {version}, written by a newer release (this \
                 one knows up to {}): this replica stops leading; upgrade it",
                self.target,
                crate::schema::SCHEMA_VERSION
            )));
        }
        Ok(Some(sent))
    }

    /// Give the lease held under `epoch` up, so a standby takes it at its
    /// next attempt instead of waiting for it to expire. Does nothing when
    /// another replica holds it already.
    pub async fn release(&self, epoch: i64) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .execute(RELEASE, &[&epoch])
            .await
            .map_err(|e| self.error("cannot release the leader lease", e))?;
        Ok(())
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool
            .get()
            .await
            .map_err(|e| pool_error(&self.target, "cannot connect", e))
    }

    fn error(&self, action: &str, e: tokio_postgres::Error) -> StoreError {
        pg_error(&self.target, action, e)
    }
}
