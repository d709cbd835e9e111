//! The identity check in front of the services: [`IdentityGuard`] applies
//! [`crate::identity`] to a call's verified client certificate, counts and
//! logs each refusal, and answers PERMISSION_DENIED; [`GuardedCapacity`]
//! runs it before every CapacityProvider call reaches the engine, so a
//! refused mutation is never validated, fenced or applied and advances no
//! fence mark. The Admin service asks the guard itself. gRPC health and
//! reflection are not guarded: any client whose certificate chains to
//! `--tls-ca` may call them.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bigfleet_proto::raw::{EncodedMachine, EncodedMachineList};
use bigfleet_proto::serving as pb;
use bigfleet_proto::serving::capacity_provider_server::{CapacityProvider, CapacityProviderServer};
use providerkit::service::{CapacityService, MAX_DECODING_MESSAGE_SIZE};
use tokio::time::Instant;
use tonic::{Request, Response, Status};
use zeroize::Zeroize;

use crate::identity::{self, IdentityCheck, Need, Reason};
use crate::metrics::Metrics;

/// The RPCs the guard checks, with what each needs (a mutation's
/// `shard_id` is the request's; any one stands for the kind here).
pub const GUARDED: [(&str, Need<'static>); 9] = [
    ("Create", Need::ActFor { shard_id: "" }),
    ("Configure", Need::ActFor { shard_id: "" }),
    ("Drain", Need::ActFor { shard_id: "" }),
    ("Delete", Need::ActFor { shard_id: "" }),
    ("Get", Need::Read),
    ("List", Need::Read),
    ("Reclaim", Need::Admin),
    ("NodeMemory", Need::Read),
    ("Timeline", Need::Read),
];

/// At most one refusal line per RPC and reason in this period; the next
/// line says how many were not logged.
pub const REFUSAL_LOG_PERIOD: Duration = Duration::from_secs(10);

/// Rate limit of log lines, per key: the first line of a key in each
/// period is written, the next one written says how many were not. Each
/// user keeps its keys bounded (fixed sets of RPCs, reasons, codes), since
/// a key's window is never forgotten.
#[derive(Debug)]
pub struct RateLimit<K> {
    period: Duration,
    windows: Mutex<HashMap<K, Window>>,
}

/// Rate limit of the refusal lines, per (RPC, reason): a misconfigured
/// client retrying in a loop yields one line per period, not one per call.
/// The keys are bounded (the RPCs and reasons are fixed sets).
pub type RefusalLog = RateLimit<(&'static str, Reason)>;

#[derive(Debug)]
struct Window {
    logged_at: Instant,
    suppressed: u64,
}

impl<K: Eq + Hash> RateLimit<K> {
    pub fn new(period: Duration) -> RateLimit<K> {
        RateLimit {
            period,
            windows: Mutex::default(),
        }
    }

    /// Whether a line for `key` at `now` is written; if so, how many lines
    /// of the same key were not since the last one.
    pub fn admit_key(&self, key: K, now: Instant) -> Option<u64> {
        // A panic while holding the lock leaves only counters behind.
        let mut windows = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        match windows.get_mut(&key) {
            None => {
                windows.insert(
                    key,
                    Window {
                        logged_at: now,
                        suppressed: 0,
                    },
                );
                Some(0)
            }
            Some(window) if now.duration_since(window.logged_at) >= self.period => {
                window.logged_at = now;
                Some(std::mem::take(&mut window.suppressed))
            }
            Some(window) => {
                window.suppressed += 1;
                None
            }
        }
    }
}

impl RefusalLog {
    /// Whether a refusal at `now` is logged; if so, how many refusals of
    /// the same key were not logged since the last line.
    pub fn admit(&self, rpc: &'static str, reason: Reason, now: Instant) -> Option<u64> {
        self.admit_key((rpc, reason), now)
    }
}

/// The identity check of one listener, shared by its services.
pub struct IdentityGuard {
    check: IdentityCheck,
    metrics: Arc<Metrics>,
    log: RefusalLog,
}

impl IdentityGuard {
    pub fn new(check: IdentityCheck, metrics: Arc<Metrics>) -> Arc<IdentityGuard> {
        if check == IdentityCheck::Bigfleet {
            for (rpc, need) in GUARDED {
                for reason in Reason::possible_for(need) {
                    metrics.expect_identity_rejection(rpc, reason.name());
                }
            }
        }
        Arc::new(IdentityGuard {
            check,
            metrics,
            log: RefusalLog::new(REFUSAL_LOG_PERIOD),
        })
    }

    /// Ok when the call's caller may make it; else PERMISSION_DENIED naming
    /// the identity seen and the one needed. Only under mTLS with
    /// `--tls-client-identity bigfleet` is anything checked.
    pub fn admit<T>(
        &self,
        request: &Request<T>,
        rpc: &'static str,
        need: Need<'_>,
    ) -> Result<(), Status> {
        if self.check != IdentityCheck::Bigfleet {
            return Ok(());
        }
        let certs = request.peer_certs();
        let verdict = match certs.as_deref().and_then(|chain| chain.first()) {
            Some(leaf) => identity::check(leaf, rpc, need),
            // The verifier requires a certificate under mTLS, so a call
            // without one is refused as having no identity.
            None => Err(identity::anonymous(rpc, need)),
        };
        self.verdict(rpc, verdict)
    }

    /// The part of [`IdentityGuard::admit`] that needs no request body, run
    /// before the body is read: for a mutation, whether the caller may act
    /// for any shard at all (its `shard_id` is checked once decoded); for
    /// the other RPCs, the whole check.
    pub fn admit_before_body(
        &self,
        certs: Option<&[rustls::pki_types::CertificateDer<'static>]>,
        rpc: &'static str,
        need: Need<'_>,
    ) -> Result<(), Status> {
        if self.check != IdentityCheck::Bigfleet {
            return Ok(());
        }
        let Some(leaf) = certs.and_then(|chain| chain.first()) else {
            return self.verdict(rpc, Err(identity::anonymous(rpc, need)));
        };
        let verdict = match need {
            Need::ActFor { .. } => identity::may_act_for_some_shard(leaf, rpc),
            Need::Read | Need::Admin => identity::check(leaf, rpc, need),
        };
        self.verdict(rpc, verdict)
    }

    /// Count, log (rate-limited) and word a refusal.
    fn verdict(
        &self,
        rpc: &'static str,
        verdict: Result<(), identity::Refusal>,
    ) -> Result<(), Status> {
        let Err(refusal) = verdict else {
            return Ok(());
        };
        self.metrics
            .observe_identity_rejected(rpc, refusal.reason.name());
        if let Some(suppressed) = self.log.admit(rpc, refusal.reason, Instant::now()) {
            // The identity and the RPC only: the request's token and blob
            // stay out of the log.
            tracing::warn!(
                rpc,
                identity = %refusal.seen,
                reason = refusal.reason.name(),
                suppressed,
                "caller identity refused"
            );
        }
        Err(Status::permission_denied(refusal.to_string()))
    }
}

/// CapacityProvider with the identity check in front of every call.
pub struct GuardedCapacity {
    inner: CapacityService,
    guard: Arc<IdentityGuard>,
}

impl GuardedCapacity {
    pub fn new(inner: CapacityService, guard: Arc<IdentityGuard>) -> GuardedCapacity {
        GuardedCapacity { inner, guard }
    }

    pub fn into_server(self) -> CapacityProviderServer<GuardedCapacity> {
        CapacityProviderServer::new(self).max_decoding_message_size(MAX_DECODING_MESSAGE_SIZE)
    }
}

#[tonic::async_trait]
impl CapacityProvider for GuardedCapacity {
    async fn create(
        &self,
        request: Request<pb::CreateRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let shard_id = request.get_ref().shard_id.as_str();
        self.guard
            .admit(&request, "Create", Need::ActFor { shard_id })?;
        self.inner.create(request).await
    }

    async fn configure(
        &self,
        request: Request<pb::ConfigureRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let shard_id = request.get_ref().shard_id.as_str();
        if let Err(refused) = self
            .guard
            .admit(&request, "Configure", Need::ActFor { shard_id })
        {
            // The engine wipes the blob of every Configure it is given;
            // a refused one never reaches it, so it is wiped here.
            request.into_inner().bootstrap_blob.zeroize();
            return Err(refused);
        }
        self.inner.configure(request).await
    }

    async fn drain(
        &self,
        request: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let shard_id = request.get_ref().shard_id.as_str();
        self.guard
            .admit(&request, "Drain", Need::ActFor { shard_id })?;
        self.inner.drain(request).await
    }

    async fn delete(
        &self,
        request: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::TransitionAck>, Status> {
        let shard_id = request.get_ref().shard_id.as_str();
        self.guard
            .admit(&request, "Delete", Need::ActFor { shard_id })?;
        self.inner.delete(request).await
    }

    async fn get(
        &self,
        request: Request<pb::MachineRef>,
    ) -> Result<Response<EncodedMachine>, Status> {
        self.guard.admit(&request, "Get", Need::Read)?;
        self.inner.get(request).await
    }

    async fn list(
        &self,
        request: Request<pb::ListFilter>,
    ) -> Result<Response<EncodedMachineList>, Status> {
        self.guard.admit(&request, "List", Need::Read)?;
        self.inner.list(request).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_lines_are_limited_per_rpc_and_reason() {
        let log = RefusalLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(log.admit("List", Reason::ClusterIdentity, at(0)), Some(0));
        assert_eq!(log.admit("List", Reason::ClusterIdentity, at(1)), None);
        assert_eq!(log.admit("List", Reason::ClusterIdentity, at(9)), None);
        // Another key has a window of its own.
        assert_eq!(log.admit("Get", Reason::ClusterIdentity, at(9)), Some(0));
        assert_eq!(log.admit("List", Reason::NoIdentity, at(9)), Some(0));
        // The period over: one line, saying two were not logged.
        assert_eq!(log.admit("List", Reason::ClusterIdentity, at(10)), Some(2));
        assert_eq!(log.admit("List", Reason::ClusterIdentity, at(11)), None);
        assert_eq!(log.admit("List", Reason::ClusterIdentity, at(25)), Some(1));
    }

    #[test]
    fn nothing_is_checked_unless_identities_are() {
        let request = Request::new(());
        for check in [IdentityCheck::Off, IdentityCheck::ChainOnly] {
            let guard = IdentityGuard::new(check, Metrics::new());
            assert!(guard.admit(&request, "Reclaim", Need::Admin).is_ok());
        }
        // Checked, a call without a certificate has no identity.
        let metrics = Metrics::new();
        let guard = IdentityGuard::new(IdentityCheck::Bigfleet, metrics.clone());
        let status = guard
            .admit(&request, "Reclaim", Need::Admin)
            .expect_err("no certificate");
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        let text = metrics
            .encode(crate::metrics::Format::Text)
            .unwrap_or_default();
        assert!(
            text.contains(
                "bigfleet_proxmox_identity_rejected_total{rpc=\"Reclaim\",reason=\"no_identity\"} 1"
            ),
            "{text}"
        );
        assert!(text.contains(
            "bigfleet_proxmox_identity_rejected_total{rpc=\"Create\",reason=\"wrong_shard\"} 0"
        ));
    }
}
