//! Leadership between replicas that share a PostgreSQL state: one leader
//! serves `CapacityProvider` and `Admin`, reconciles and talks to Proxmox;
//! the others are standbys that answer UNAVAILABLE naming the leader, and
//! take over once its lease expires.
//!
//! Three parts, each owning its state:
//! - [`Term`]: the moment until which this replica may act ([`Term::admits`]),
//!   extended by every renewal. It is the Proxmox client's request gate, so
//!   no request leaves once the term has run out, whatever task sends it,
//!   and the database refuses the commits of a lost lease by itself (see
//!   `pg_store::Lease`).
//! - [`Switched`]: a gRPC service that forwards to the leader's server while
//!   this replica leads and answers UNAVAILABLE otherwise ([`Standby`]).
//! - [`wait_for_lease`] and [`hold_lease`]: the standby's and the leader's
//!   loops over the lease row.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use parking_lot::{Mutex, RwLock};
use pg_store::{Lease, LeaseState, OwnName};
use tonic::server::NamedService;
use tower::ServiceExt;

use crate::plan::LeaseConfig;

/// How long this replica may act: until the end of its current term.
#[derive(Default)]
pub struct Term {
    ends: Mutex<Option<Instant>>,
}

impl Term {
    /// A lease acquired or renewed by a statement sent at `sent`: the
    /// database's expiry is at least `sent + ttl`. A tenth is kept back for
    /// clocks that run at slightly different rates.
    pub fn extend(&self, sent: Instant, ttl: Duration) {
        let ends = sent + ttl - ttl / 10;
        let mut current = self.ends.lock();
        *current = Some(current.map_or(ends, |c| c.max(ends)));
    }

    /// The term is over (lost, given up, or never started).
    pub fn end(&self) {
        *self.ends.lock() = None;
    }

    pub fn ends(&self) -> Option<Instant> {
        *self.ends.lock()
    }

    pub fn admits(&self) -> bool {
        self.ends().is_some_and(|ends| Instant::now() < ends)
    }
}

/// Why the Proxmox client refused to send a request.
#[derive(Debug, thiserror::Error)]
#[error(
    "this replica no longer holds the leader lease: a replica that lost it sends nothing to \
     Proxmox"
)]
pub struct NotLeader;

impl pve::RequestGate for Term {
    fn admit(&self) -> Result<(), Box<dyn std::error::Error + Send + Sync + 'static>> {
        if self.admits() {
            Ok(())
        } else {
            Err(Box::new(NotLeader))
        }
    }
}

/// What a standby says when it refuses an RPC: which replica leads, as the
/// last look at the lease found it.
/// While start-up runs, what it is waiting for instead.
#[derive(Clone)]
pub struct Standby {
    replica: Arc<str>,
    leader: Arc<RwLock<Option<(String, i64)>>>,
    starting: Arc<RwLock<Option<String>>>,
}

impl Standby {
    pub fn new(replica: &str) -> Standby {
        Standby {
            replica: replica.into(),
            leader: Arc::default(),
            starting: Arc::default(),
        }
    }

    /// Start-up is waiting for `what` (opening the state, the Proxmox
    /// preflight): every RPC is refused saying so, at once, rather than
    /// hanging on a port that answers nothing.
    pub fn starting(&self, what: impl Into<String>) {
        *self.starting.write() = Some(what.into());
    }

    /// Start-up ended (the term serves, or it failed and a standby waits
    /// for the lease again).
    pub fn started(&self) {
        *self.starting.write() = None;
    }

    /// The lease was last seen held by `holder` under `epoch`.
    pub fn saw(&self, holder: &str, epoch: i64) {
        *self.leader.write() = Some((holder.to_string(), epoch));
    }

    /// This replica lost the lease: who holds it now is known at the next
    /// look.
    pub fn lost(&self) {
        *self.leader.write() = None;
    }

    pub fn status(&self) -> tonic::Status {
        if let Some(what) = &*self.starting.read() {
            return tonic::Status::unavailable(format!(
                "the provider is starting and serves nothing yet: {what}; nothing was changed, \
                 retry (gRPC health answers NOT_SERVING until start-up ends)"
            ));
        }
        let leader = match &*self.leader.read() {
            Some((holder, epoch)) if !holder.is_empty() => {
                format!("the leader is replica {holder} (lease epoch {epoch})")
            }
            _ => "no replica is known to hold the leader lease yet".to_string(),
        };
        tonic::Status::unavailable(format!(
            "replica {} is a standby: {leader}; retry through the Service, which routes to the \
             leader (a standby takes over once the leader's lease expires)",
            self.replica
        ))
    }
}

/// A gRPC service that forwards to the server of the current leader term,
/// or answers UNAVAILABLE while this replica is not the leader.
pub struct Switched<S> {
    current: Arc<RwLock<Option<S>>>,
    standby: Standby,
}

impl<S> Clone for Switched<S> {
    fn clone(&self) -> Switched<S> {
        Switched {
            current: Arc::clone(&self.current),
            standby: self.standby.clone(),
        }
    }
}

impl<S> Switched<S> {
    pub fn new(standby: Standby) -> Switched<S> {
        Switched {
            current: Arc::new(RwLock::new(None)),
            standby,
        }
    }

    /// What this service answers while no term serves.
    pub fn standby(&self) -> &Standby {
        &self.standby
    }

    /// Serve through `server` from now on (a term started).
    pub fn lead(&self, server: S) {
        *self.current.write() = Some(server);
    }

    /// Answer UNAVAILABLE from now on (the term ended).
    pub fn stand_by(&self) {
        *self.current.write() = None;
    }
}

impl<S: NamedService> NamedService for Switched<S> {
    const NAME: &'static str = S::NAME;
}

type Request = http::Request<tonic::body::Body>;
type Response = http::Response<tonic::body::Body>;

impl<S> tower::Service<Request> for Switched<S>
where
    S: tower::Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Readiness is the chosen server's, awaited by `oneshot` per call.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let server = self.current.read().clone();
        match server {
            Some(server) => Box::pin(server.oneshot(request)),
            None => {
                let status = self.standby.status();
                Box::pin(async move { Ok(status.into_http()) })
            }
        }
    }
}

/// How often a standby looks at the lease: a dead leader's lease is
/// taken within this long of its expiry.
pub fn standby_poll(ttl: Duration) -> Duration {
    (ttl / 5).clamp(Duration::from_millis(200), Duration::from_secs(1))
}

/// How often the leader renews: three chances before the lease expires.
pub fn renew_every(ttl: Duration) -> Duration {
    ttl / 3
}

/// Try the lease until this replica holds it; returns the epoch, with the
/// term started. Failures to reach the database are logged once per change
/// and retried.
pub async fn wait_for_lease(
    lease: Arc<Lease>,
    config: LeaseConfig,
    term: Arc<Term>,
    standby: Standby,
    own_name: OwnName,
) -> i64 {
    let mut last_seen: Option<String> = None;
    let mut tick = tokio::time::interval(standby_poll(config.ttl));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let attempt = tokio::time::timeout(
            config.ttl,
            lease.try_acquire(&config.replica, config.ttl, own_name),
        );
        let seen = match attempt.await {
            Ok(Ok(LeaseState::Acquired { epoch, sent })) => {
                term.extend(sent, config.ttl);
                standby.saw(&config.replica, epoch);
                return epoch;
            }
            Ok(Ok(LeaseState::Held {
                holder,
                epoch,
                expires_in,
            })) => {
                standby.saw(&holder, epoch);
                let seen = format!("held by {holder} (epoch {epoch})");
                if last_seen.as_deref() != Some(seen.as_str()) {
                    tracing::info!(
                        replica = %config.replica,
                        leader = %holder,
                        epoch,
                        expires_in_ms = expires_in.as_millis() as u64,
                        "standby: another replica holds the leader lease"
                    );
                }
                seen
            }
            Ok(Err(e)) => {
                let seen = e.to_string();
                if last_seen.as_deref() != Some(seen.as_str()) {
                    tracing::warn!(error = %e, "standby: cannot reach the leader lease; retrying");
                }
                seen
            }
            Err(_) => {
                let seen = "timeout".to_string();
                if last_seen.as_deref() != Some(seen.as_str()) {
                    tracing::warn!(
                        timeout_ms = config.ttl.as_millis() as u64,
                        "standby: the leader lease did not answer in time; retrying"
                    );
                }
                seen
            }
        };
        last_seen = Some(seen);
    }
}

/// Why a leader's term ended without being asked to.
#[derive(Debug)]
pub enum LeaseLost {
    /// Another replica holds the lease now.
    Taken,
    /// Another live replica runs under this replica's `--replica-name` and
    /// took the lease as its own (a replica restarted in place does that;
    /// this one is alive, so the name is not unique).
    TakenUnderThisName { replica: String, epoch: i64 },
    /// No renewal succeeded before the term ran out.
    Expired { last_error: Option<String> },
    /// A replica of a newer release raised the state's schema: this one
    /// stops committing at once.
    NewerSchema { message: String },
}

impl std::fmt::Display for LeaseLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeaseLost::Taken => f.write_str("another replica took the leader lease"),
            LeaseLost::NewerSchema { message } => f.write_str(message),
            LeaseLost::TakenUnderThisName { replica, epoch } => write!(
                f,
                "another live replica runs under this replica's name {replica} and took the \
                 leader lease (epoch {epoch}); this one no longer takes a running lease back by \
                 name: give every replica its own --replica-name"
            ),
            LeaseLost::Expired { last_error: None } => {
                f.write_str("the leader lease could not be renewed before it ran out")
            }
            LeaseLost::Expired {
                last_error: Some(e),
            } => write!(
                f,
                "the leader lease could not be renewed before it ran out (last error: {e})"
            ),
        }
    }
}

/// Renew the lease held under `epoch` until it is lost; the term ends at
/// once then. Runs until dropped while the term lasts.
pub async fn hold_lease(lease: &Lease, config: &LeaseConfig, term: &Term, epoch: i64) -> LeaseLost {
    let mut last_error: Option<String> = None;
    let mut tick = tokio::time::interval(renew_every(config.ttl));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        let Some(ends) = term.ends() else {
            return LeaseLost::Expired { last_error };
        };
        let ends = tokio::time::Instant::from_std(ends);
        // A renewal that hangs must not outlive the term: the deadline
        // fires whatever the database does.
        let renewed = tokio::select! {
            () = tokio::time::sleep_until(ends) => {
                term.end();
                return LeaseLost::Expired { last_error };
            }
            renewed = async {
                tick.tick().await;
                lease.renew(epoch, config.ttl).await
            } => renewed,
        };
        match renewed {
            Ok(Some(sent)) => {
                term.extend(sent, config.ttl);
                last_error = None;
            }
            Ok(None) => {
                term.end();
                return who_took_it(lease, config).await;
            }
            Err(e) if e.kind() == providerkit::StoreErrorKind::Incompatible => {
                term.end();
                return LeaseLost::NewerSchema {
                    message: e.to_string(),
                };
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot renew the leader lease; retrying until it runs out");
                last_error = Some(e.to_string());
            }
        }
    }
}

/// [`LeaseLost::Taken`], or [`LeaseLost::TakenUnderThisName`] when the
/// lease now names this replica: only another process under the same name
/// takes a running lease that way. A failed read says `Taken`: the lease is
/// lost either way, only the diagnosis is missing.
async fn who_took_it(lease: &Lease, config: &LeaseConfig) -> LeaseLost {
    match tokio::time::timeout(config.ttl, lease.current()).await {
        Ok(Ok(LeaseState::Held { holder, epoch, .. })) if holder == config.replica => {
            LeaseLost::TakenUnderThisName {
                replica: holder,
                epoch,
            }
        }
        _ => LeaseLost::Taken,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_term_admits_until_it_ends() {
        let term = Term::default();
        assert!(!term.admits(), "no term before the lease is taken");
        term.extend(Instant::now(), Duration::from_secs(10));
        assert!(term.admits());
        term.end();
        assert!(!term.admits());
    }

    #[test]
    fn a_term_from_a_renewal_sent_too_long_ago_does_not_admit() {
        let term = Term::default();
        let long_ago = Instant::now()
            .checked_sub(Duration::from_secs(20))
            .expect("the monotonic clock is past 20 s");
        term.extend(long_ago, Duration::from_secs(10));
        assert!(
            !term.admits(),
            "a term counts from when its renewal was sent"
        );
    }

    #[test]
    fn the_standby_names_the_leader() {
        let standby = Standby::new("replica-b");
        let before = standby.status();
        assert_eq!(before.code(), tonic::Code::Unavailable);
        assert!(before
            .message()
            .contains("no replica is known to hold the leader lease yet"));
        standby.saw("replica-a", 7);
        let status = standby.status();
        assert!(
            status.message().contains(
                "replica replica-b is a standby: the leader is replica replica-a (lease epoch 7)"
            ),
            "{}",
            status.message()
        );
    }
}
