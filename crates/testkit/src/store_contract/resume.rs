//! A restart costs no capacity: on the store, every transition the
//! previous process left in flight continues under its operation id and
//! its original deadline, or ends FAILED saying why it could not.
//!
//! Each "process" is a runtime that is dropped with its work still held
//! (what a kill -9 leaves: the acceptance is durable, the outcome never
//! landed); the next one opens the same state.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bigfleet_proto::v1alpha1 as pb;
use parking_lot::Mutex;
use providerkit::{
    Backend, BackendError, CatalogFacts, ConfigureCtx, CreateCtx, DeleteCtx, DrainCtx, Engine,
    EngineOptions, KitError, ResumeOutcome, SlotSpec, State, SubstrateHost, Timeouts, Token,
    TransitionKind,
};

use super::{runtime, StateUnderTest};
use crate::engine::wait_for_state;

/// A substrate whose every step can be held (a "process" dies while it is)
/// and that records what each step was asked.
#[derive(Default)]
struct HeldBackend {
    hold: AtomicBool,
    release: tokio::sync::Notify,
    readiness: bool,
    never_ready: bool,
    creates: Mutex<Vec<CreateCtx>>,
    configures: Mutex<usize>,
    ready_probes: Mutex<usize>,
    drains: Mutex<Vec<Duration>>,
    deletes: Mutex<Vec<String>>,
}

impl HeldBackend {
    fn held() -> Arc<HeldBackend> {
        let b = HeldBackend::default();
        b.hold.store(true, Ordering::SeqCst);
        Arc::new(b)
    }

    async fn step(&self) {
        // Registered before the check, so a release in between is seen.
        let released = self.release.notified();
        if self.hold.load(Ordering::SeqCst) {
            released.await;
        }
    }

    fn let_go(&self) {
        self.hold.store(false, Ordering::SeqCst);
        self.release.notify_waiters();
    }
}

#[async_trait]
impl Backend for HeldBackend {
    async fn describe(&self) -> Result<Vec<SlotSpec>, BackendError> {
        Ok((0..6)
            .map(|i| SlotSpec {
                id: format!("m-{i}"),
                facts: CatalogFacts {
                    instance_type: "small".into(),
                    zone: "z1".into(),
                    capacity_type: pb::CapacityType::OnDemand,
                    ..Default::default()
                }
                .share(),
                host: None,
            })
            .collect())
    }

    async fn create(&self, ctx: CreateCtx) -> Result<SubstrateHost, BackendError> {
        self.creates.lock().push(ctx.clone());
        self.step().await;
        Ok(SubstrateHost {
            host_ref: format!("z1/{}", ctx.machine_id),
        })
    }

    async fn configure(&self, _ctx: &ConfigureCtx) -> Result<(), BackendError> {
        *self.configures.lock() += 1;
        self.step().await;
        Ok(())
    }

    fn supports_readiness(&self) -> bool {
        self.readiness
    }

    async fn node_ready(&self, _ctx: &ConfigureCtx) -> Result<bool, BackendError> {
        *self.ready_probes.lock() += 1;
        self.step().await;
        Ok(!self.never_ready)
    }

    async fn drain(&self, ctx: DrainCtx) -> Result<(), BackendError> {
        self.drains.lock().push(ctx.grace_period);
        self.step().await;
        Ok(())
    }

    fn supports_delete(&self) -> bool {
        true
    }

    async fn delete(&self, ctx: DeleteCtx) -> Result<(), BackendError> {
        self.deletes.lock().push(ctx.host_ref.clone());
        self.step().await;
        Ok(())
    }
}

fn options() -> EngineOptions {
    EngineOptions {
        timeouts: Timeouts {
            create: Duration::from_secs(600),
            configure: Duration::from_secs(600),
            drain: Duration::from_secs(600),
            delete: Duration::from_secs(600),
            readiness_poll: Duration::from_millis(10),
        },
        ..EngineOptions::default()
    }
}

async fn start<S: StateUnderTest>(state: &S, backend: Arc<HeldBackend>) -> Arc<Engine> {
    let store = Arc::new(state.open());
    Engine::start(backend, store, options())
        .await
        .expect("the engine starts")
}

fn tok(seq: i64) -> Token {
    Token::new("s1", 1, seq)
}

fn count(engine: &Engine, kind: TransitionKind, outcome: ResumeOutcome) -> u64 {
    engine
        .resumed_counts()
        .into_iter()
        .find(|(k, o, _)| *k == kind && *o == outcome)
        .map_or(0, |(_, _, n)| n)
}

/// The first process: m-0 IDLE, m-1 CONFIGURED, m-2 IDLE; then, held:
/// m-3 CREATING, m-0 DELETING, m-1 DRAINING (grace 7 s), m-2 CONFIGURING.
/// Returns the operation ids of the held transitions.
fn first_life<S: StateUnderTest>(state: &S) -> HashMap<&'static str, String> {
    let rt = runtime();
    rt.block_on(async {
        let backend = Arc::new(HeldBackend::default());
        let engine = start(state, backend.clone()).await;
        for (i, id) in ["m-0", "m-1", "m-2"].iter().enumerate() {
            engine.create(id, tok(10 * i as i64 + 1)).await.unwrap();
            wait_for_state(&engine, id, State::Idle).await;
        }
        engine
            .configure(
                "m-1",
                tok(12),
                "cluster-a".into(),
                b"secret".to_vec(),
                HashMap::from([("role".into(), "worker".into())]),
            )
            .await
            .unwrap();
        wait_for_state(&engine, "m-1", State::Configured).await;
        backend.hold.store(true, Ordering::SeqCst);
        let mut ops = HashMap::new();
        ops.insert(
            "create",
            engine.create("m-3", tok(40)).await.unwrap().operation_id,
        );
        ops.insert(
            "delete",
            engine.delete("m-0", tok(2)).await.unwrap().operation_id,
        );
        ops.insert(
            "drain",
            engine.drain("m-1", tok(13), 7).await.unwrap().operation_id,
        );
        ops.insert(
            "configure",
            engine
                .configure(
                    "m-2",
                    tok(22),
                    "cluster-b".into(),
                    b"blob".to_vec(),
                    HashMap::new(),
                )
                .await
                .unwrap()
                .operation_id,
        );
        ops
    })
    // The runtime drops here with every held step still running: a crash.
}

pub fn every_interrupted_transition_resumes_under_its_operation_id<S: StateUnderTest>(state: S) {
    let ops = first_life(&state);

    let rt = runtime();
    rt.block_on(async {
        let backend = Arc::new(HeldBackend {
            readiness: true,
            ..HeldBackend::default()
        });
        let engine = start(&state, backend.clone()).await;
        let idle = wait_for_state(&engine, "m-3", State::Idle).await;
        assert_eq!(idle.host.unwrap().r#ref, "z1/m-3");
        let spec = wait_for_state(&engine, "m-0", State::Speculative).await;
        assert!(spec.host.is_none());
        let drained = wait_for_state(&engine, "m-1", State::Idle).await;
        assert!(drained.cluster.is_empty() && drained.shard_metadata.is_empty());
        let configured = wait_for_state(&engine, "m-2", State::Configured).await;
        assert_eq!(configured.cluster, "cluster-b");

        // The substrate was asked again, as a resumption, with what the
        // shard asked for: the Create flagged, the Drain's grace kept, the
        // Delete of the host on record; the blob was not delivered again
        // (it was never stored), readiness was probed instead.
        let creates = backend.creates.lock().clone();
        assert_eq!(creates.len(), 1);
        assert!(creates[0].resumed);
        assert_eq!(creates[0].operation_id, ops["create"]);
        assert_eq!(*backend.drains.lock(), vec![Duration::from_secs(7)]);
        assert_eq!(*backend.deletes.lock(), vec!["z1/m-0".to_string()]);
        assert_eq!(*backend.configures.lock(), 0);
        assert!(*backend.ready_probes.lock() >= 1);

        // Retries of the pre-restart mutations see the same operation ids.
        let again = engine.create("m-3", tok(41)).await.unwrap();
        assert_eq!(again.operation_id, ops["create"]);
        let again = engine
            .configure(
                "m-2",
                tok(23),
                "cluster-b".into(),
                b"blob".to_vec(),
                HashMap::new(),
            )
            .await
            .unwrap();
        assert_eq!(again.operation_id, ops["configure"]);
        // Fence marks from before the restart still hold.
        let stale = engine.create("m-3", tok(39)).await;
        assert!(matches!(stale, Err(KitError::Fenced(_))), "{stale:?}");

        for kind in TransitionKind::ALL {
            assert_eq!(count(&engine, kind, ResumeOutcome::Landed), 1, "{kind:?}");
            assert_eq!(count(&engine, kind, ResumeOutcome::Failed), 0, "{kind:?}");
        }
    });
}

pub fn a_restart_after_the_deadline_fails_the_transition_as_timed_out<S: StateUnderTest>(state: S) {
    first_life(&state);
    state.expire_windows();

    let rt = runtime();
    rt.block_on(async {
        let backend = Arc::new(HeldBackend::default());
        let engine = start(&state, backend.clone()).await;
        let m = engine.get("m-3").unwrap();
        assert_eq!(m.state, pb::MachineState::Failed as i32);
        assert_eq!(
            m.last_error,
            "Create timed out after 0ms (deadline exceeded while the provider was restarting)"
        );
        assert!(engine
            .get("m-0")
            .unwrap()
            .last_error
            .starts_with("Delete timed out"));
        assert_eq!(
            count(&engine, TransitionKind::Create, ResumeOutcome::TimedOut),
            1
        );
        // Nothing was resumed: the substrate was not asked.
        assert!(backend.creates.lock().is_empty());
        assert!(backend.deletes.lock().is_empty());
    });
}

pub fn a_configure_without_a_readiness_check_cannot_resume_and_says_why<S: StateUnderTest>(
    state: S,
) {
    first_life(&state);

    let rt = runtime();
    rt.block_on(async {
        let backend = HeldBackend::held();
        let engine = start(&state, backend.clone()).await;
        let m = engine.get("m-2").unwrap();
        assert_eq!(m.state, pb::MachineState::Failed as i32);
        assert!(
            m.last_error.contains("the bootstrap blob is never stored")
                && m.last_error.contains("no readiness check"),
            "{}",
            m.last_error
        );
        assert_eq!(
            count(
                &engine,
                TransitionKind::Configure,
                ResumeOutcome::NotResumable
            ),
            1
        );
        assert_eq!(
            *backend.configures.lock(),
            0,
            "the blob is gone: never re-sent"
        );
        // The others resumed and are running again (held).
        assert_eq!(engine.transitions_running(), 3);
        assert_eq!(
            engine.get("m-3").unwrap().state,
            pb::MachineState::Creating as i32
        );
    });
}

pub fn a_record_stored_without_a_window_is_failed_as_before<S: StateUnderTest>(state: S) {
    first_life(&state);
    state.forget_windows();

    let rt = runtime();
    rt.block_on(async {
        let engine = start(&state, HeldBackend::held()).await;
        let m = engine.get("m-3").unwrap();
        assert_eq!(m.state, pb::MachineState::Failed as i32);
        assert_eq!(
            m.last_error,
            "interrupted by a provider restart while CREATING; the substrate may hold a partial \
             result"
        );
        assert_eq!(
            count(&engine, TransitionKind::Create, ResumeOutcome::NotResumable),
            1
        );
    });
}

pub fn shutdown_refuses_mutations_and_waits_for_transitions_to_land<S: StateUnderTest>(state: S) {
    let rt = runtime();
    rt.block_on(async {
        let backend = HeldBackend::held();
        let engine = start(&state, backend.clone()).await;
        engine.create("m-0", tok(1)).await.unwrap();
        assert_eq!(engine.transitions_running(), 1);
        engine.stop_accepting();
        let refused = engine.create("m-1", tok(2)).await.unwrap_err();
        assert!(matches!(refused, KitError::ShuttingDown(_)), "{refused:?}");
        assert!(refused.to_string().contains("shutting down"), "{refused}");
        assert_eq!(
            engine.get("m-1").unwrap().state,
            pb::MachineState::Speculative as i32
        );
        // Still held: the bound passes with it running (it resumes later).
        assert_eq!(engine.quiesce(Duration::from_millis(50)).await, 1);
        // Released: it lands, and the wait ends with nothing running.
        backend.let_go();
        assert_eq!(engine.quiesce(Duration::from_secs(30)).await, 0);
        assert_eq!(
            engine.get("m-0").unwrap().state,
            pb::MachineState::Idle as i32
        );
    });
}

pub fn a_resumed_configure_whose_node_never_gets_ready_says_the_outcome_is_unknown<
    S: StateUnderTest,
>(
    state: S,
) {
    first_life(&state);
    // What is left of the Configure's window: 300 ms from now.
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    state.set_deadline_ms("m-2", now_ms + 300);

    let rt = runtime();
    rt.block_on(async {
        let backend = Arc::new(HeldBackend {
            readiness: true,
            never_ready: true,
            ..HeldBackend::default()
        });
        let engine = start(&state, backend.clone()).await;
        let m = wait_for_state(&engine, "m-2", State::Failed).await;
        assert!(
            m.last_error.starts_with("Configure timed out after ")
                && m.last_error
                    .contains("after a provider restart; the bootstrap's outcome is unknown"),
            "{}",
            m.last_error
        );
        assert!(*backend.ready_probes.lock() >= 1);
        assert_eq!(*backend.configures.lock(), 0);
        assert_eq!(
            count(&engine, TransitionKind::Configure, ResumeOutcome::Failed),
            1
        );
    });
}
