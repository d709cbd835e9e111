//! The way out of FAILED: reconcile re-attaches (or clears) a FAILED
//! machine's host, reclaim returns it to SPECULATIVE, and the automatic
//! sweeper reclaims after the hold period.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bigfleet_proto::v1alpha1 as pb;
use parking_lot::Mutex;
use provider_testkit::engine::{start, start_on, wait_for_state};
use providerkit::{
    Backend, BackendError, CatalogFacts, ConfigureCtx, CreateCtx, DeleteCtx, DrainCtx, Engine,
    KitError, MemoryStore, ReclaimCtx, ReclaimError, ReclaimOutcome, ReclaimSweeper, SlotSpec,
    State, SubstrateHost, Token,
};

/// A substrate of marked VMs: machine id -> host refs, in creation order.
#[derive(Default)]
struct Marked {
    vms: Mutex<BTreeMap<String, Vec<String>>>,
    next_vm: Mutex<u32>,
    fail_create_after_clone: Mutex<bool>,
    fail_configure: Mutex<bool>,
    fail_reclaim: Mutex<Option<&'static str>>,
    reclaims: Mutex<Vec<ReclaimCtx>>,
}

fn facts() -> providerkit::SharedFacts {
    CatalogFacts {
        instance_type: "pve.small".into(),
        zone: "pve-a".into(),
        capacity_type: pb::CapacityType::OnDemand,
        price_per_hour: 0.01,
        interruption_probability: 0.0,
        resources: HashMap::new(),
        allocatable: HashMap::new(),
        labels: HashMap::new(),
    }
    .share()
}

struct TestBackend {
    facts: providerkit::SharedFacts,
    ids: Vec<String>,
    marked: Marked,
}

impl TestBackend {
    fn new(n: usize) -> Arc<TestBackend> {
        Arc::new(TestBackend {
            facts: facts(),
            ids: (0..n).map(|i| format!("m-{i}")).collect(),
            marked: Marked::default(),
        })
    }

    fn clone_vm(&self, machine_id: &str) -> String {
        let mut next = self.marked.next_vm.lock();
        *next += 1;
        let host = format!("pve-a/{}", 100 + *next);
        self.marked
            .vms
            .lock()
            .entry(machine_id.to_string())
            .or_default()
            .push(host.clone());
        host
    }

    fn vms_of(&self, machine_id: &str) -> Vec<String> {
        self.marked
            .vms
            .lock()
            .get(machine_id)
            .cloned()
            .unwrap_or_default()
    }

    fn destroy_all(&self, machine_id: &str) {
        self.marked.vms.lock().remove(machine_id);
    }
}

#[async_trait]
impl Backend for TestBackend {
    async fn describe(&self) -> Result<Vec<SlotSpec>, BackendError> {
        let vms = self.marked.vms.lock();
        Ok(self
            .ids
            .iter()
            .map(|id| SlotSpec {
                id: id.clone(),
                facts: self.facts.clone(),
                host: vms.get(id).and_then(|v| v.first()).map(|h| SubstrateHost {
                    host_ref: h.clone(),
                }),
            })
            .collect())
    }
    async fn create(&self, ctx: CreateCtx) -> Result<SubstrateHost, BackendError> {
        let host_ref = self.clone_vm(&ctx.machine_id);
        if *self.marked.fail_create_after_clone.lock() {
            // The VM exists and is marked, but the Create reports failure
            // (a guest agent that never answered, say).
            return Err(BackendError::new("guest agent did not answer"));
        }
        Ok(SubstrateHost { host_ref })
    }
    async fn configure(&self, _ctx: &ConfigureCtx) -> Result<(), BackendError> {
        if *self.marked.fail_configure.lock() {
            return Err(BackendError::new("bootstrap hook exited 1"));
        }
        Ok(())
    }
    async fn drain(&self, _ctx: DrainCtx) -> Result<(), BackendError> {
        Ok(())
    }
    fn supports_delete(&self) -> bool {
        true
    }
    async fn delete(&self, ctx: DeleteCtx) -> Result<(), BackendError> {
        self.destroy_all(&ctx.machine_id);
        Ok(())
    }
    async fn reclaim(&self, ctx: ReclaimCtx) -> Result<(), BackendError> {
        self.marked.reclaims.lock().push(ctx.clone());
        if let Some(message) = *self.marked.fail_reclaim.lock() {
            return Err(BackendError::new(message));
        }
        self.destroy_all(&ctx.machine_id);
        Ok(())
    }
}

fn host(m: &pb::Machine) -> Option<&str> {
    m.host.as_ref().map(|h| h.r#ref.as_str())
}

fn revision(engine: &Engine) -> u64 {
    engine
        .list(&[], 0, &[])
        .machines
        .iter()
        .map(|m| m.rev)
        .max()
        .unwrap_or(0)
}

/// A machine FAILED by a Create whose VM exists and is marked.
async fn failed_with_marked_vm(engine: &Arc<Engine>, backend: &TestBackend, id: &str) {
    *backend.marked.fail_create_after_clone.lock() = true;
    engine.create(id, Token::new("s", 1, 1)).await.unwrap();
    let m = wait_for_state(engine, id, State::Failed).await;
    *backend.marked.fail_create_after_clone.lock() = false;
    assert_eq!(host(&m), None, "a failed Create records no host");
    assert_eq!(backend.vms_of(id).len(), 1);
}

#[tokio::test]
async fn reconcile_reattaches_failed_machines_only_and_is_then_quiet() {
    let backend = TestBackend::new(3);
    let engine = start(backend.clone()).await;
    failed_with_marked_vm(&engine, &backend, "m-0").await;

    // An IDLE machine whose substrate host differs keeps the engine's.
    engine.create("m-1", Token::absent()).await.unwrap();
    let idle = wait_for_state(&engine, "m-1", State::Idle).await;
    backend.destroy_all("m-1");
    backend.clone_vm("m-1");

    let before = revision(&engine);
    let report = engine.reconcile().await.unwrap();
    assert_eq!(report.reattached, 1, "{report:?}");
    assert_eq!(report.detached, 0, "{report:?}");
    let m0 = engine.get("m-0").unwrap();
    assert_eq!(m0.state, pb::MachineState::Failed as i32);
    assert_eq!(host(&m0), backend.vms_of("m-0").first().map(String::as_str));
    assert!(!m0.last_error.is_empty(), "last_error is kept");
    assert!(
        engine.get_record("m-0").unwrap().rev > before,
        "re-attach bumps"
    );
    let m1 = engine.get("m-1").unwrap();
    assert_eq!(
        host(&m1),
        host(&idle),
        "an IDLE machine's host is the engine's"
    );

    // B908: an unchanged reconcile bumps nothing.
    let rev = revision(&engine);
    let again = engine.reconcile().await.unwrap();
    assert_eq!(again, Default::default());
    assert_eq!(revision(&engine), rev);

    // The VM disappears: the FAILED machine's host is cleared, once.
    backend.destroy_all("m-0");
    let report = engine.reconcile().await.unwrap();
    assert_eq!((report.reattached, report.detached), (0, 1));
    assert_eq!(host(&engine.get("m-0").unwrap()), None);
    let rev = revision(&engine);
    assert_eq!(engine.reconcile().await.unwrap(), Default::default());
    assert_eq!(revision(&engine), rev);
}

#[tokio::test]
async fn startup_reattaches_a_machine_failed_by_a_restart() {
    let store = Arc::new(MemoryStore::retaining());
    let backend = TestBackend::new(1);
    let first = start_on(backend.clone(), store.clone()).await;
    first.create("m-0", Token::absent()).await.unwrap();
    wait_for_state(&first, "m-0", State::Idle).await;
    *backend.marked.fail_configure.lock() = true;
    // Configure fails: FAILED with its host; then the VM vanishes and a
    // second VM is marked for the machine (a clone nobody recorded).
    first
        .configure("m-0", Token::absent(), "c".into(), vec![], HashMap::new())
        .await
        .unwrap();
    wait_for_state(&first, "m-0", State::Failed).await;
    backend.destroy_all("m-0");
    let stray = backend.clone_vm("m-0");
    drop(first);
    let second = start_on(backend.clone(), store).await;
    let m = second.get("m-0").unwrap();
    assert_eq!(m.state, pb::MachineState::Failed as i32);
    assert_eq!(host(&m), Some(stray.as_str()));
}

#[tokio::test]
async fn reclaim_returns_failed_to_speculative_and_keeps_fences() {
    let store = Arc::new(MemoryStore::retaining());
    let backend = TestBackend::new(2);
    let engine = start_on(backend.clone(), store.clone()).await;
    failed_with_marked_vm(&engine, &backend, "m-0").await;
    engine.reconcile().await.unwrap();
    let failed = engine.get_record("m-0").unwrap();

    // B705 still holds: the shard's mutations are refused on FAILED.
    let err = engine
        .create("m-0", Token::new("s", 1, 2))
        .await
        .unwrap_err();
    assert!(matches!(err, KitError::Conflict(_)), "{err:?}");

    let outcome = engine.reclaim("m-0").await.unwrap();
    let ReclaimOutcome::Reclaimed(m) = outcome else {
        panic!("not reclaimed: {outcome:?}");
    };
    assert_eq!(m.state(), State::Speculative);
    assert_eq!(m.host, None);
    assert!(m.last_error.is_empty());
    assert!(m.rev > failed.rev, "reclaim bumps the revision");
    assert!(backend.vms_of("m-0").is_empty(), "marked VMs destroyed");
    let ctx = backend.marked.reclaims.lock().last().cloned().unwrap();
    assert_eq!(ctx.machine_id, "m-0");
    assert_eq!(ctx.host_ref, failed.host.as_ref().map(|h| h.r#ref.clone()));

    // Idempotent: a second reclaim changes nothing and succeeds.
    let again = engine.reclaim("m-0").await.unwrap();
    assert!(matches!(again, ReclaimOutcome::AlreadySpeculative(_)));
    assert_eq!(engine.get_record("m-0").unwrap().rev, m.rev);

    // Fence marks kept: the stale token is still stale, a newer one works.
    let err = engine
        .create("m-0", Token::new("s", 1, 2))
        .await
        .unwrap_err();
    assert!(matches!(err, KitError::Fenced(_)), "{err:?}");
    engine.create("m-0", Token::new("s", 1, 3)).await.unwrap();
    wait_for_state(&engine, "m-0", State::Idle).await;

    // Durable: a restart sees what the reclaim wrote.
    drop(engine);
    let second = start_on(backend.clone(), store).await;
    assert_eq!(
        second.get("m-0").unwrap().state,
        pb::MachineState::Idle as i32
    );
}

#[tokio::test]
async fn reclaim_refuses_what_is_not_failed_and_survives_substrate_errors() {
    let backend = TestBackend::new(2);
    let engine = start(backend.clone()).await;
    engine.create("m-1", Token::absent()).await.unwrap();
    wait_for_state(&engine, "m-1", State::Idle).await;
    let err = engine.reclaim("m-1").await.unwrap_err();
    assert!(
        matches!(
            err,
            ReclaimError::NotFailed {
                state: State::Idle,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(err.to_string().contains("not FAILED"), "{err}");
    assert!(matches!(
        engine.reclaim("nope").await.unwrap_err(),
        ReclaimError::NotFound(_)
    ));
    assert!(matches!(
        engine.reclaim("").await.unwrap_err(),
        ReclaimError::InvalidArgument(_)
    ));
    assert!(backend.marked.reclaims.lock().is_empty());

    failed_with_marked_vm(&engine, &backend, "m-0").await;
    *backend.marked.fail_reclaim.lock() = Some("node pve-a is offline");
    let before = engine.get_record("m-0").unwrap();
    let err = engine.reclaim("m-0").await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert!(err.to_string().contains("node pve-a is offline"), "{err}");
    assert!(err.to_string().contains("reclaim again"), "{err}");
    let after = engine.get_record("m-0").unwrap();
    assert_eq!(after.state(), State::Failed);
    assert_eq!(after.rev, before.rev, "a failed reclaim changes nothing");
    assert_eq!(backend.vms_of("m-0").len(), 1);

    *backend.marked.fail_reclaim.lock() = None;
    assert!(matches!(
        engine.reclaim("m-0").await.unwrap(),
        ReclaimOutcome::Reclaimed(_)
    ));
}

#[tokio::test]
async fn concurrent_reclaims_of_one_machine_destroy_once() {
    let backend = TestBackend::new(1);
    let engine = start(backend.clone()).await;
    failed_with_marked_vm(&engine, &backend, "m-0").await;
    let a = engine.start_reclaim("m-0").unwrap();
    let b = engine.start_reclaim("m-0").unwrap();
    assert!(a.started() && b.started());
    let (a, b) = (a.wait().await.unwrap(), b.wait().await.unwrap());
    let reclaimed = [&a, &b]
        .iter()
        .filter(|o| matches!(o, ReclaimOutcome::Reclaimed(_)))
        .count();
    assert_eq!(reclaimed, 1, "{a:?} {b:?}");
    assert_eq!(backend.marked.reclaims.lock().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn sweeper_reclaims_after_the_hold_period_only() {
    let backend = TestBackend::new(2);
    let engine = start(backend.clone()).await;
    failed_with_marked_vm(&engine, &backend, "m-0").await;
    let hold = Duration::from_secs(60);
    let mut sweeper = ReclaimSweeper::new(hold);
    assert_eq!(sweeper.period(), Duration::from_secs(15));
    assert_eq!(sweeper.sweep(&engine).await, 0);
    tokio::time::advance(Duration::from_secs(59)).await;
    assert_eq!(sweeper.sweep(&engine).await, 0);
    assert_eq!(engine.get_record("m-0").unwrap().state(), State::Failed);
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(sweeper.sweep(&engine).await, 1);
    assert_eq!(
        engine.get_record("m-0").unwrap().state(),
        State::Speculative
    );
    assert!(backend.vms_of("m-0").is_empty());

    // A refused reclaim starts the hold over.
    failed_with_marked_vm(&engine, &backend, "m-1").await;
    *backend.marked.fail_reclaim.lock() = Some("refused");
    assert_eq!(sweeper.sweep(&engine).await, 0);
    tokio::time::advance(hold).await;
    assert_eq!(sweeper.sweep(&engine).await, 0);
    assert_eq!(backend.marked.reclaims.lock().len(), 2);
    *backend.marked.fail_reclaim.lock() = None;
    tokio::time::advance(hold / 2).await;
    assert_eq!(sweeper.sweep(&engine).await, 0, "hold restarted");
    tokio::time::advance(hold / 2).await;
    assert_eq!(sweeper.sweep(&engine).await, 1);
}

#[tokio::test]
async fn census_counts_every_state_of_every_zone() {
    let backend = TestBackend::new(3);
    let engine = start(backend.clone()).await;
    failed_with_marked_vm(&engine, &backend, "m-0").await;
    let census = engine.census(&["pve-a".to_string(), "pve-b".to_string()]);
    assert_eq!(census.counts.len(), 16, "8 states x 2 zones");
    assert_eq!(census.get("pve-a", State::Failed), 1);
    assert_eq!(census.get("pve-a", State::Speculative), 2);
    assert_eq!(census.get("pve-b", State::Idle), 0);
    assert_eq!(census.counts.values().sum::<u64>(), 3);
}
