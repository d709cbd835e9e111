//! Engine rules, one test per rule of the wire contract.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bigfleet_proto::v1alpha1 as pb;
use parking_lot::Mutex;
use provider_testkit::engine::{start, start_on, wait_for_state};
use provider_testkit::wait::elapse;
use providerkit::{
    Admission, AdmitCtx, Backend, BackendError, CatalogFacts, ConfigureCtx, CreateCtx, DeleteCtx,
    DrainCtx, Engine, KitError, MemoryStore, SlotSpec, State, SubstrateHost, Token, TransitionKind,
};
use tokio::sync::Notify;

/// What a scripted backend does for one transition kind.
#[derive(Clone)]
enum Script {
    Ok,
    Fail(&'static str),
    /// Wait for the notify, then succeed.
    Gate(Arc<Notify>),
    /// Take this long (virtual time in paused tests), then succeed.
    Delay(Duration),
}

struct ScriptedBackend {
    slots: Mutex<Vec<SlotSpec>>,
    scripts: Mutex<HashMap<TransitionKind, Script>>,
    calls: Mutex<HashMap<TransitionKind, usize>>,
    delete: bool,
    readiness: Option<Arc<AtomicUsize>>,
    ready_after: usize,
    next_vm: AtomicUsize,
    /// Creates admitted at once (claims held); `room` of them fit.
    admitted: Arc<AtomicUsize>,
    room: Option<usize>,
    admissions_asked: AtomicUsize,
}

/// One admitted Create's claim: counted while held.
struct Claim(Arc<AtomicUsize>);

impl Drop for Claim {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn slot(id: &str) -> SlotSpec {
    SlotSpec {
        id: id.to_string(),
        facts: CatalogFacts {
            instance_type: "pve.small".into(),
            zone: "pve-a".into(),
            capacity_type: pb::CapacityType::OnDemand,
            price_per_hour: 0.01,
            interruption_probability: 0.0,
            resources: HashMap::from([("cpu".into(), "1".into())]),
            allocatable: HashMap::from([("cpu".into(), "2".into())]),
            labels: HashMap::new(),
        }
        .share(),
        host: None,
    }
}

impl ScriptedBackend {
    fn new(n: usize) -> ScriptedBackend {
        ScriptedBackend {
            slots: Mutex::new((0..n).map(|i| slot(&format!("m-{i:04}"))).collect()),
            scripts: Mutex::new(HashMap::new()),
            calls: Mutex::new(HashMap::new()),
            delete: true,
            readiness: None,
            ready_after: 0,
            next_vm: AtomicUsize::new(100),
            admitted: Arc::new(AtomicUsize::new(0)),
            room: None,
            admissions_asked: AtomicUsize::new(0),
        }
    }

    fn script(&self, kind: TransitionKind, script: Script) {
        self.scripts.lock().insert(kind, script);
    }

    fn calls(&self, kind: TransitionKind) -> usize {
        self.calls.lock().get(&kind).copied().unwrap_or(0)
    }

    async fn act(&self, kind: TransitionKind) -> Result<(), BackendError> {
        *self.calls.lock().entry(kind).or_default() += 1;
        let script = self
            .scripts
            .lock()
            .get(&kind)
            .cloned()
            .unwrap_or(Script::Ok);
        match script {
            Script::Ok => Ok(()),
            Script::Fail(m) => Err(BackendError::new(m)),
            Script::Gate(n) => {
                n.notified().await;
                Ok(())
            }
            Script::Delay(d) => {
                // The scripted backend's own latency, on the test's paused
                // clock: the slow backend is the scenario, not a wait.
                tokio::time::sleep(d).await;
                Ok(())
            }
        }
    }
}

#[async_trait]
impl Backend for ScriptedBackend {
    async fn describe(&self) -> Result<Vec<SlotSpec>, BackendError> {
        Ok(self.slots.lock().clone())
    }
    async fn admit_create(&self, ctx: &AdmitCtx) -> Result<Admission, BackendError> {
        self.admissions_asked.fetch_add(1, Ordering::SeqCst);
        let Some(room) = self.room else {
            return Ok(Admission::unguarded());
        };
        if self.admitted.fetch_add(1, Ordering::SeqCst) >= room {
            self.admitted.fetch_sub(1, Ordering::SeqCst);
            return Err(BackendError::new(format!(
                "zone {} is full: no room for {}",
                ctx.zone, ctx.machine_id
            )));
        }
        Ok(Admission::holding(Claim(Arc::clone(&self.admitted))))
    }
    async fn create(&self, _ctx: CreateCtx) -> Result<SubstrateHost, BackendError> {
        self.act(TransitionKind::Create).await?;
        let vm = self.next_vm.fetch_add(1, Ordering::SeqCst);
        Ok(SubstrateHost {
            host_ref: format!("pve-a/{vm}"),
        })
    }
    async fn configure(&self, _ctx: &ConfigureCtx) -> Result<(), BackendError> {
        self.act(TransitionKind::Configure).await
    }
    async fn drain(&self, _ctx: DrainCtx) -> Result<(), BackendError> {
        self.act(TransitionKind::Drain).await
    }
    fn supports_delete(&self) -> bool {
        self.delete
    }
    async fn delete(&self, _ctx: DeleteCtx) -> Result<(), BackendError> {
        self.act(TransitionKind::Delete).await
    }
    fn supports_readiness(&self) -> bool {
        self.readiness.is_some()
    }
    async fn node_ready(&self, _ctx: &ConfigureCtx) -> Result<bool, BackendError> {
        let probes = self
            .readiness
            .as_ref()
            .map(|c| c.fetch_add(1, Ordering::SeqCst) + 1);
        Ok(probes.is_some_and(|p| self.ready_after > 0 && p >= self.ready_after))
    }
    fn readiness_detail(&self, host_ref: &str) -> Option<String> {
        self.readiness
            .as_ref()
            .map(|c| format!("probe {} of {host_ref} said no", c.load(Ordering::SeqCst)))
    }
}

fn state_of(engine: &Engine, id: &str) -> State {
    State::from_wire(engine.get(id).unwrap().state).unwrap()
}

fn none() -> Token {
    Token::absent()
}

fn tok(shard: &str, e: i64, s: i64) -> Token {
    Token::new(shard, e, s)
}

async fn configure(
    engine: &Arc<Engine>,
    id: &str,
    token: Token,
) -> Result<providerkit::Ack, KitError> {
    engine
        .configure(
            id,
            token,
            "cluster-1".into(),
            b"blob".to_vec(),
            HashMap::from([("k".into(), "v".into())]),
        )
        .await
}

async fn to_idle(engine: &Arc<Engine>, id: &str) {
    engine.create(id, none()).await.unwrap();
    wait_for_state(engine, id, State::Idle).await;
}

async fn to_configured(engine: &Arc<Engine>, id: &str) {
    to_idle(engine, id).await;
    configure(engine, id, none()).await.unwrap();
    wait_for_state(engine, id, State::Configured).await;
}

#[tokio::test]
async fn full_lifecycle_sets_and_clears_host_binding_metadata() {
    let engine = start(Arc::new(ScriptedBackend::new(2))).await;
    let id = "m-0000";
    let m = engine.get(id).unwrap();
    assert_eq!(m.state, pb::MachineState::Speculative as i32);
    assert!(m.host.is_none());
    let create = engine.create(id, none()).await.unwrap();
    assert!(!create.operation_id.is_empty());
    let idle = wait_for_state(&engine, id, State::Idle).await;
    assert_eq!(idle.host.as_ref().unwrap().provider, "proxmox");
    assert!(idle.cluster.is_empty());
    let ack = configure(&engine, id, none()).await.unwrap();
    // Binding visible from acceptance.
    assert_eq!(ack.machine.cluster, "cluster-1");
    assert_eq!(ack.machine.shard_metadata["k"], "v");
    let configured = wait_for_state(&engine, id, State::Configured).await;
    assert_eq!(configured.cluster, "cluster-1");
    engine.drain(id, none(), 30).await.unwrap();
    let drained = wait_for_state(&engine, id, State::Idle).await;
    assert!(drained.cluster.is_empty() && drained.shard_metadata.is_empty());
    assert!(drained.host.is_some());
    let del = engine.delete(id, none()).await.unwrap();
    let gone = wait_for_state(&engine, id, State::Speculative).await;
    assert!(gone.host.is_none() && gone.cluster.is_empty() && gone.last_error.is_empty());
    // A new cycle mints a fresh id.
    let again = engine.create(id, none()).await.unwrap();
    assert_ne!(again.operation_id, create.operation_id);
    assert_ne!(again.operation_id, del.operation_id);
}

#[tokio::test]
async fn a_create_without_room_is_refused_before_anything_and_its_claim_ends_when_it_lands() {
    let gate = Arc::new(Notify::new());
    let backend = Arc::new(ScriptedBackend {
        room: Some(1),
        ..ScriptedBackend::new(3)
    });
    backend.script(TransitionKind::Create, Script::Gate(Arc::clone(&gate)));
    let engine = start(backend.clone()).await;
    engine.create("m-0000", tok("s", 1, 1)).await.expect("fits");
    provider_testkit::wait::until("the first Create runs", Duration::from_secs(5), || {
        backend.calls(TransitionKind::Create) == 1
    })
    .await;
    assert_eq!(
        backend.admitted.load(Ordering::SeqCst),
        1,
        "held while it runs"
    );
    // A repeat of an accepted Create is not asked about room again.
    let asked = backend.admissions_asked.load(Ordering::SeqCst);
    engine
        .create("m-0000", tok("s", 1, 2))
        .await
        .expect("idempotent");
    assert_eq!(backend.admissions_asked.load(Ordering::SeqCst), asked);

    let err = engine.create("m-0001", tok("s", 1, 1)).await.unwrap_err();
    assert!(matches!(err, KitError::Exhausted(_)), "{err:?}");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    assert_eq!(err.to_string(), "zone pve-a is full: no room for m-0001");
    let refused = engine.get("m-0001").unwrap();
    assert_eq!(state_of(&engine, "m-0001"), State::Speculative);
    assert!(refused.last_error.is_empty() && refused.host.is_none());
    assert_eq!(backend.calls(TransitionKind::Create), 1, "nothing started");
    // Fencing still answers first, and the refused call advanced the mark.
    let err = engine.create("m-0001", tok("s", 1, 1)).await.unwrap_err();
    assert!(matches!(err, KitError::Fenced(_)), "{err:?}");

    // Landing gives the claim back: the next Create fits.
    gate.notify_one();
    wait_for_state(&engine, "m-0000", State::Idle).await;
    provider_testkit::wait::until("the claim is given back", Duration::from_secs(5), || {
        backend.admitted.load(Ordering::SeqCst) == 0
    })
    .await;
    gate.notify_one();
    engine
        .create("m-0001", tok("s", 1, 2))
        .await
        .expect("room again");
    wait_for_state(&engine, "m-0001", State::Idle).await;
}

#[tokio::test]
async fn fence_runs_before_not_found_and_advances_on_failure() {
    let engine = start(Arc::new(ScriptedBackend::new(1))).await;
    // First contact with an unknown machine: accepted by the fence, then NOT_FOUND.
    let err = engine.create("nope", tok("s", 1, 5)).await.unwrap_err();
    assert!(matches!(err, KitError::NotFound(_)), "{err:?}");
    // The mark advanced: the same token is now stale, even for an unknown machine.
    let err = engine.create("nope", tok("s", 1, 5)).await.unwrap_err();
    assert!(matches!(err, KitError::Fenced(_)), "{err:?}");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    // Out-of-position op still advances the mark (B311).
    let err = engine.drain("m-0000", tok("s", 1, 1), 0).await.unwrap_err();
    assert!(matches!(err, KitError::Conflict(_)));
    assert_ne!(err.code(), tonic::Code::FailedPrecondition);
    let err = engine.drain("m-0000", tok("s", 1, 1), 0).await.unwrap_err();
    assert!(matches!(err, KitError::Fenced(_)));
}

#[tokio::test]
async fn fence_is_per_shard_and_machine_and_lexicographic() {
    let engine = start(Arc::new(ScriptedBackend::new(3))).await;
    engine.create("m-0000", tok("a", 5, 100)).await.unwrap();
    // Another shard on the same machine is not fenced by shard a's mark.
    engine.create("m-0000", tok("b", 1, 1)).await.unwrap();
    // A lower token on another machine of the same shard is accepted.
    engine.create("m-0001", tok("a", 1, 1)).await.unwrap();
    // Each pair's own stale tokens are rejected.
    for (e, s) in [(5, 100), (5, 99), (4, 1_000_000), (0, 0)] {
        let err = engine.create("m-0000", tok("a", e, s)).await.unwrap_err();
        assert!(matches!(err, KitError::Fenced(_)), "({e},{s}) {err:?}");
    }
    // A higher epoch with a low sequence advances.
    engine.create("m-0000", tok("a", 6, 0)).await.unwrap();
    let err = engine
        .create("m-0000", tok("a", 5, i64::MAX))
        .await
        .unwrap_err();
    assert!(matches!(err, KitError::Fenced(_)));
}

#[tokio::test]
async fn randomized_token_stream_matches_running_max_oracle() {
    let engine = start(Arc::new(ScriptedBackend::new(1))).await;
    let mut rng_state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        rng_state
    };
    let mut max: Option<(i64, i64)> = None;
    for _ in 0..500 {
        let e = (next() % 4) as i64;
        let s = (next() % 6) as i64;
        let result = engine.get("m-0000").map(|_| ());
        assert!(result.is_ok());
        let res = engine.drain("m-0000", tok("x", e, s), 0).await;
        let accepted_by_fence = !matches!(res, Err(KitError::Fenced(_)));
        let oracle = max.is_none_or(|m| (e, s) > m);
        assert_eq!(accepted_by_fence, oracle, "token ({e},{s}) vs mark {max:?}");
        if oracle {
            max = Some((e, s));
        }
    }
}

#[tokio::test]
async fn int64_max_tokens_do_not_overflow() {
    let engine = start(Arc::new(ScriptedBackend::new(1))).await;
    engine
        .create("m-0000", tok("fresh", i64::MAX, i64::MAX))
        .await
        .unwrap();
    let err = engine
        .create("m-0000", tok("fresh", i64::MAX, i64::MAX))
        .await
        .unwrap_err();
    assert!(matches!(err, KitError::Fenced(_)));
}

#[tokio::test]
async fn negative_tokens_are_ordered_like_any_other() {
    let engine = start(Arc::new(ScriptedBackend::new(2))).await;
    // First contact with a negative token is accepted (lenient) and sets the mark.
    engine.create("m-0000", tok("s", 6, 1)).await.unwrap();
    let stale = [
        (6, -1),
        (6, 1),
        (5, i64::MAX),
        (-3, 7),
        (i64::MIN, i64::MIN),
    ];
    for (e, q) in stale {
        let err = engine.create("m-0000", tok("s", e, q)).await.unwrap_err();
        assert!(matches!(err, KitError::Fenced(_)), "({e},{q}): {err:?}");
    }
    // A higher epoch with a negative sequence is newer.
    engine.create("m-0000", tok("s", 7, -3)).await.unwrap();
    engine.create("m-0000", tok("s", 7, -2)).await.unwrap();
    let err = engine.create("m-0000", tok("s", 7, -3)).await.unwrap_err();
    assert!(matches!(err, KitError::Fenced(_)));
    // Negative epochs on first contact, then ordered among themselves.
    engine.create("m-0001", tok("n", -5, -5)).await.unwrap();
    engine.create("m-0001", tok("n", -5, -4)).await.unwrap();
    engine
        .create("m-0001", tok("n", -1, i64::MIN))
        .await
        .unwrap();
    let err = engine
        .create("m-0001", tok("n", -5, 100))
        .await
        .unwrap_err();
    assert!(matches!(err, KitError::Fenced(_)));
}

#[tokio::test]
async fn capped_cursorless_lists_rotate_and_walks_stay_set_complete() {
    let engine = start(Arc::new(ScriptedBackend::new(50))).await;
    let speculative = [pb::MachineState::Speculative as i32];
    // Successive picks with max_results=1 are distinct until the set wraps.
    let mut picks = Vec::new();
    for _ in 0..50 {
        let page = engine.list(&speculative, 1, &[]);
        assert_eq!(page.machines.len(), 1);
        picks.push(page.machines[0].id.clone());
    }
    let distinct: std::collections::HashSet<_> = picks.iter().collect();
    assert_eq!(distinct.len(), 50, "picks repeated before the set wrapped");
    // The 51st pick wraps to the first.
    assert_eq!(engine.list(&speculative, 1, &[]).machines[0].id, picks[0]);

    // Paging from a rotated start visits every machine exactly once, for
    // page sizes that do and do not divide the fleet.
    for size in [1, 7, 10, 49, 50, 51] {
        engine.list(&speculative, 3, &[]); // move the rotation point
        let mut seen = std::collections::HashSet::new();
        let mut cursor = Vec::new();
        loop {
            let page = engine.list(&[], size, &cursor);
            assert!(page.machines.len() <= size as usize);
            for m in &page.machines {
                assert!(seen.insert(m.id.clone()), "size {size}: duplicate {}", m.id);
            }
            cursor = page.revision;
            if page.machines.len() < size as usize {
                break;
            }
        }
        assert_eq!(seen.len(), 50, "size {size}");
        // The walk ends in a plain cursor: nothing changed, empty delta.
        assert!(engine.list(&[], 0, &cursor).machines.is_empty());
    }

    // A machine changed in the middle of a walk is not lost: it is either
    // in the rest of the walk or in the delta after it.
    engine.list(&speculative, 25, &[]);
    let first = engine.list(&[], 20, &[]);
    let mut seen: Vec<String> = first.machines.iter().map(|m| m.id.clone()).collect();
    let changed = seen[0].clone();
    engine.create(&changed, none()).await.unwrap();
    let mut cursor = first.revision;
    let mut after_change = Vec::new();
    loop {
        let page = engine.list(&[], 20, &cursor);
        after_change.extend(page.machines.iter().map(|m| m.id.clone()));
        cursor = page.revision;
        if page.machines.len() < 20 {
            break;
        }
    }
    let delta = engine.list(&[], 0, &cursor);
    seen.extend(after_change.iter().cloned());
    let distinct: std::collections::HashSet<_> = seen.iter().collect();
    assert_eq!(distinct.len(), 50);
    assert!(
        after_change.contains(&changed) || delta.machines.iter().any(|m| m.id == changed),
        "a change made mid-walk was neither in the walk nor in the next delta"
    );
}

#[tokio::test]
async fn token_shape_and_input_validation() {
    let engine = start(Arc::new(ScriptedBackend::new(1))).await;
    // A token with an epoch or sequence but no shard is malformed.
    for t in [tok("", 1, 1), tok("", -1, 0), tok("", 0, -1)] {
        let err = engine.create("m-0000", t).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
    }
    assert_eq!(
        engine.create("", none()).await.unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    assert_eq!(
        engine.get("").unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    assert_eq!(engine.get("zz").unwrap_err().code(), tonic::Code::NotFound);
    // Two zero tokens are both accepted (absent token bypasses fencing).
    engine.create("m-0000", none()).await.unwrap();
    engine.create("m-0000", none()).await.unwrap();
    wait_for_state(&engine, "m-0000", State::Idle).await;
    assert_eq!(
        engine.drain("m-0000", none(), -1).await.unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    // Configure caps: rejected whole, no transition, nothing stored.
    let too_many: HashMap<String, String> = (0..2000)
        .map(|i| (format!("k{i}"), String::new()))
        .collect();
    let err = engine
        .configure("m-0000", none(), "c".into(), vec![], too_many)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let big_blob = vec![0u8; 2 * 1024 * 1024];
    let err = engine
        .configure("m-0000", none(), "c".into(), big_blob, HashMap::new())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let err = engine
        .configure("m-0000", none(), String::new(), vec![], HashMap::new())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    let m = engine.get("m-0000").unwrap();
    assert_eq!(m.state, pb::MachineState::Idle as i32);
    assert!(m.cluster.is_empty() && m.shard_metadata.is_empty());
}

/// Every client-supplied string and map has a cap; over it the request is
/// INVALID_ARGUMENT whose message repeats only a short prefix of the value,
/// and nothing is stored (not even a fencing mark).
#[tokio::test]
async fn every_client_string_and_map_is_capped_with_a_short_echo() {
    let engine = start(Arc::new(ScriptedBackend::new(1))).await;
    let limits = providerkit::Limits::default();
    let short_echo = |err: &KitError, what: &str| {
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{what}: {err}");
        assert!(err.to_string().len() < 300, "{what} echoed too much: {err}");
        assert!(
            err.to_string().contains("cap"),
            "{what} names no cap: {err}"
        );
    };
    let huge = "x".repeat(1024 * 1024);
    // machine_id, on every RPC that takes one.
    short_echo(
        &engine.create(&huge, none()).await.unwrap_err(),
        "Create id",
    );
    short_echo(&engine.get(&huge).unwrap_err(), "Get id");
    short_echo(
        &engine.drain(&huge, none(), 0).await.unwrap_err(),
        "Drain id",
    );
    short_echo(
        &engine.delete(&huge, none()).await.unwrap_err(),
        "Delete id",
    );
    let at_cap = "m".repeat(limits.max_machine_id_bytes);
    assert_eq!(
        engine.get(&at_cap).unwrap_err().code(),
        tonic::Code::NotFound
    );
    // shard_id: refused before a mark is written.
    let err = engine.create("m-0000", tok(&huge, 1, 1)).await.unwrap_err();
    short_echo(&err, "shard_id");
    // cluster_id, metadata key, value.
    let err = engine
        .configure("m-0000", none(), huge.clone(), vec![], HashMap::new())
        .await
        .unwrap_err();
    short_echo(&err, "cluster_id");
    let err = engine
        .configure(
            "m-0000",
            none(),
            "c".into(),
            vec![],
            HashMap::from([(huge[..2000].to_string(), "v".into())]),
        )
        .await
        .unwrap_err();
    short_echo(&err, "metadata key");
    let err = engine
        .configure(
            "m-0000",
            none(),
            "c".into(),
            vec![],
            HashMap::from([("k".into(), huge[..100_000].to_string())]),
        )
        .await
        .unwrap_err();
    short_echo(&err, "metadata value");
    // Shard marks per machine: the 65th distinct shard is refused, known
    // shards keep advancing.
    for i in 0..limits.max_shard_marks_per_machine {
        engine
            .create("m-0000", tok(&format!("s{i}"), 1, 1))
            .await
            .unwrap();
    }
    let err = engine
        .create("m-0000", tok("one-too-many", 1, 1))
        .await
        .unwrap_err();
    short_echo(&err, "shard marks");
    engine.create("m-0000", tok("s0", 1, 2)).await.unwrap();
}

#[tokio::test]
async fn parallel_identical_creates_collapse_to_one_operation() {
    let backend = Arc::new(ScriptedBackend::new(1));
    let gate = Arc::new(Notify::new());
    backend.script(TransitionKind::Create, Script::Gate(gate.clone()));
    let engine = start(backend.clone()).await;
    let mut tasks = Vec::new();
    for i in 0..32 {
        let engine = engine.clone();
        tasks.push(tokio::spawn(async move {
            engine.create("m-0000", tok("s", 1, i + 1)).await
        }));
    }
    let mut ops = std::collections::HashSet::new();
    let mut fenced = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(ack) => {
                assert_eq!(ack.machine.state, State::Creating);
                ops.insert(ack.operation_id);
            }
            // Tokens raced: an older one arriving after a newer one is stale.
            Err(KitError::Fenced(_)) => fenced += 1,
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(ops.len(), 1, "{ops:?}");
    assert!(fenced < 32);
    gate.notify_one();
    wait_for_state(&engine, "m-0000", State::Idle).await;
    assert_eq!(backend.calls(TransitionKind::Create), 1);
    // A retry at the target returns the same id, no new work.
    let again = engine.create("m-0000", none()).await.unwrap();
    assert!(ops.contains(&again.operation_id));
    assert_eq!(backend.calls(TransitionKind::Create), 1);
}

/// Drive a fresh machine into each of the 8 states, gating the backend so
/// transitional states hold still.
async fn machine_in(state: State) -> (Arc<Engine>, Arc<ScriptedBackend>, Arc<Notify>) {
    let backend = Arc::new(ScriptedBackend::new(1));
    let gate = Arc::new(Notify::new());
    let engine = start(backend.clone()).await;
    let id = "m-0000";
    let hold = |kind| backend.script(kind, Script::Gate(gate.clone()));
    match state {
        State::Speculative => {}
        State::Creating => {
            hold(TransitionKind::Create);
            engine.create(id, none()).await.unwrap();
        }
        State::Idle => to_idle(&engine, id).await,
        State::Configuring => {
            to_idle(&engine, id).await;
            hold(TransitionKind::Configure);
            configure(&engine, id, none()).await.unwrap();
        }
        State::Configured => to_configured(&engine, id).await,
        State::Draining => {
            to_configured(&engine, id).await;
            hold(TransitionKind::Drain);
            engine.drain(id, none(), 0).await.unwrap();
        }
        State::Deleting => {
            to_idle(&engine, id).await;
            hold(TransitionKind::Delete);
            engine.delete(id, none()).await.unwrap();
        }
        State::Failed => {
            backend.script(TransitionKind::Create, Script::Fail("clone exploded"));
            engine.create(id, none()).await.unwrap();
            wait_for_state(&engine, id, State::Failed).await;
        }
    }
    assert_eq!(state_of(&engine, id), state);
    (engine, backend, gate)
}

#[tokio::test]
async fn position_matrix_all_states_by_all_rpcs() {
    for state in State::ALL {
        for kind in TransitionKind::ALL {
            let (engine, _backend, _gate) = machine_in(state).await;
            let id = "m-0000";
            let before = engine.get(id).unwrap();
            let result = match kind {
                TransitionKind::Create => engine.create(id, none()).await,
                TransitionKind::Configure => configure(&engine, id, none()).await,
                TransitionKind::Drain => engine.drain(id, none(), 0).await,
                TransitionKind::Delete => engine.delete(id, none()).await,
            };
            let legal = state == kind.from_state();
            // Idempotent when the same kind is in flight or at its target
            // and on record (Create on a settled IDLE reached by Create too).
            let idempotent = (state == kind.via_state() || state == kind.to_state())
                && matches!(
                    (state, kind),
                    (State::Creating | State::Idle, TransitionKind::Create)
                        | (
                            State::Configuring | State::Configured,
                            TransitionKind::Configure
                        )
                        | (State::Draining, TransitionKind::Drain)
                        | (State::Deleting, TransitionKind::Delete)
                );
            match result {
                Ok(ack) => {
                    assert!(
                        legal || idempotent,
                        "{kind:?} on {state} was accepted but must be rejected"
                    );
                    if legal {
                        assert_eq!(ack.machine.state, kind.via_state());
                    } else {
                        assert_eq!(
                            ack.machine.to_wire(),
                            before,
                            "idempotent no-op changed the machine"
                        );
                    }
                }
                Err(err) => {
                    assert!(
                        !legal && !idempotent,
                        "{kind:?} on {state} was rejected: {err:?}"
                    );
                    assert_eq!(err.code(), tonic::Code::Aborted, "{kind:?} on {state}");
                    assert_eq!(
                        engine.get(id).unwrap(),
                        before,
                        "rejection changed the machine"
                    );
                }
            }
        }
    }
}

#[tokio::test]
async fn failed_is_terminal_and_keeps_last_error_verbatim() {
    let (engine, _b, _g) = machine_in(State::Failed).await;
    let before = engine.get("m-0000").unwrap();
    assert_eq!(before.last_error, "clone exploded");
    for kind in TransitionKind::ALL {
        let err = match kind {
            TransitionKind::Create => engine.create("m-0000", tok("s", 1, 1 + kind as i64)).await,
            TransitionKind::Configure => configure(&engine, "m-0000", none()).await,
            TransitionKind::Drain => engine.drain("m-0000", none(), 0).await,
            TransitionKind::Delete => engine.delete("m-0000", none()).await,
        }
        .unwrap_err();
        assert_ne!(err.code(), tonic::Code::FailedPrecondition);
    }
    assert_eq!(engine.get("m-0000").unwrap(), before);
}

#[tokio::test(start_paused = true)]
async fn timeout_lands_failed_and_late_completion_is_discarded() {
    let backend = Arc::new(ScriptedBackend::new(1));
    // Would complete at 8 s; the Configure deadline is 5 s.
    let engine = start(backend.clone()).await;
    to_idle(&engine, "m-0000").await;
    backend.script(
        TransitionKind::Configure,
        Script::Delay(Duration::from_secs(8)),
    );
    configure(&engine, "m-0000", none()).await.unwrap();
    elapse(Duration::from_millis(4900)).await;
    assert_eq!(state_of(&engine, "m-0000"), State::Configuring);
    let failed = wait_for_state(&engine, "m-0000", State::Failed).await;
    assert!(
        failed.last_error.contains("timed out"),
        "{}",
        failed.last_error
    );
    elapse(Duration::from_secs(10)).await;
    let later = engine.get("m-0000").unwrap();
    assert_eq!(later.state, pb::MachineState::Failed as i32);
    assert_eq!(later.last_error, failed.last_error);
}

#[tokio::test(start_paused = true)]
async fn readiness_gate_holds_configuring_until_ready_or_timeout() {
    let mut b = ScriptedBackend::new(2);
    b.readiness = Some(Arc::new(AtomicUsize::new(0)));
    b.ready_after = 5;
    let engine = start(Arc::new(b)).await;
    to_idle(&engine, "m-0000").await;
    configure(&engine, "m-0000", none()).await.unwrap();
    elapse(Duration::from_millis(250)).await;
    assert_eq!(state_of(&engine, "m-0000"), State::Configuring);
    wait_for_state(&engine, "m-0000", State::Configured).await;

    let mut never = ScriptedBackend::new(1);
    never.readiness = Some(Arc::new(AtomicUsize::new(0)));
    never.ready_after = 0;
    let engine = start(Arc::new(never)).await;
    to_idle(&engine, "m-0000").await;
    configure(&engine, "m-0000", none()).await.unwrap();
    let failed = wait_for_state(&engine, "m-0000", State::Failed).await;
    assert!(
        failed.last_error.contains("timed out")
            && failed
                .last_error
                .contains("waiting for the node to become ready; probe ")
            && failed.last_error.contains("said no"),
        "the last probe is quoted: {}",
        failed.last_error
    );
}

#[tokio::test]
async fn metadata_is_stored_byte_for_byte_as_a_copy() {
    let engine = start(Arc::new(ScriptedBackend::new(1))).await;
    to_idle(&engine, "m-0000").await;
    let mut meta: HashMap<String, String> = HashMap::new();
    meta.insert("nul\0key\u{0}".into(), "v\u{0}\u{1}\u{7f}".into());
    meta.insert("empty".into(), String::new());
    meta.insert("unicode-ключ-🚀".into(), "値\r\n\t".into());
    meta.insert(String::new(), "empty key".into());
    for i in 0..51 {
        meta.insert(format!("k{i}"), "x".repeat(i));
    }
    let mut caller = meta.clone();
    engine
        .configure("m-0000", none(), "c1".into(), vec![1, 2, 3], caller.clone())
        .await
        .unwrap();
    caller.insert("later".into(), "change".into());
    let m = wait_for_state(&engine, "m-0000", State::Configured).await;
    assert_eq!(m.shard_metadata, meta);
    let page = engine.list(&[pb::MachineState::Configured as i32], 0, &[]);
    assert_eq!(page.machines[0].shard_metadata, meta);
    engine.drain("m-0000", none(), 0).await.unwrap();
    wait_for_state(&engine, "m-0000", State::Idle).await;
    let disjoint = HashMap::from([("only".to_string(), "this".to_string())]);
    engine
        .configure("m-0000", none(), "c2".into(), vec![], disjoint.clone())
        .await
        .unwrap();
    let m = wait_for_state(&engine, "m-0000", State::Configured).await;
    assert_eq!(m.shard_metadata, disjoint);
    assert_eq!(m.cluster, "c2");
}

#[tokio::test]
async fn cursor_deltas_and_set_complete_paging() {
    let engine = start(Arc::new(ScriptedBackend::new(5000))).await;
    let full = engine.list(&[], 0, &[]);
    assert_eq!(full.machines.len(), 5000);
    // Nothing changed: empty delta, repeatedly.
    for _ in 0..3 {
        assert!(engine.list(&[], 0, &full.revision).machines.is_empty());
    }
    // Garbage / empty / mutated cursors: full list.
    assert_eq!(engine.list(&[], 0, b"garbage").machines.len(), 5000);
    let mut mutated = full.revision.clone();
    mutated[10] ^= 0xff;
    assert_eq!(engine.list(&[], 0, &mutated).machines.len(), 5000);
    // Page through with max_results + cursor: every machine exactly once.
    let mut seen = std::collections::HashSet::new();
    let mut cursor = Vec::new();
    loop {
        let page = engine.list(&[], 7, &cursor);
        assert!(page.machines.len() <= 7);
        if page.machines.is_empty() {
            break;
        }
        for m in page.machines {
            assert!(seen.insert(m.id.clone()), "duplicate {}", m.id);
        }
        cursor = page.revision;
    }
    assert_eq!(seen.len(), 5000);
    // A mutation shows up in the delta, and only it.
    let before = engine.list(&[], 0, &[]).revision;
    engine.create("m-0042", none()).await.unwrap();
    let delta = engine.list(&[], 0, &before);
    assert!(delta.machines.iter().all(|m| m.id == "m-0042"));
    assert!(!delta.machines.is_empty());
    assert_ne!(delta.revision, before);
    // State filter: exact union.
    wait_for_state(&engine, "m-0042", State::Idle).await;
    let both = engine.list(
        &[
            pb::MachineState::Idle as i32,
            pb::MachineState::Speculative as i32,
        ],
        0,
        &[],
    );
    assert_eq!(both.machines.len(), 5000);
    let idle = engine.list(&[pb::MachineState::Idle as i32], 0, &[]);
    assert_eq!(idle.machines.len(), 1);
}

#[tokio::test]
async fn reconcile_bumps_nothing_when_nothing_changed() {
    let backend = Arc::new(ScriptedBackend::new(3));
    let engine = start(backend.clone()).await;
    to_configured(&engine, "m-0001").await;
    let rev = engine.list(&[], 0, &[]).revision;
    let report = engine.reconcile().await.unwrap();
    assert_eq!(report, providerkit::ReconcileReport::default());
    assert!(engine.list(&[], 0, &rev).machines.is_empty());
    // New slot and a changed price: added and refreshed, lifecycle kept.
    {
        let mut slots = backend.slots.lock();
        slots.push(slot("m-new"));
        for s in slots.iter_mut() {
            s.facts = CatalogFacts {
                price_per_hour: 0.02,
                ..(**s.facts).clone()
            }
            .share();
            // A host reported by the substrate never overrides our state.
            s.host = Some(SubstrateHost {
                host_ref: "elsewhere/1".into(),
            });
        }
    }
    let report = engine.reconcile().await.unwrap();
    assert_eq!(report.added, 1);
    assert_eq!(report.refreshed, 3);
    let m = engine.get("m-0001").unwrap();
    assert_eq!(m.state, pb::MachineState::Configured as i32);
    assert_eq!(m.cluster, "cluster-1");
    assert_ne!(m.host.unwrap().r#ref, "elsewhere/1");
    assert_eq!(m.price_per_hour, 0.02);
    // The new slot arrives with its host: adopted as IDLE.
    assert_eq!(state_of(&engine, "m-new"), State::Idle);
}

#[tokio::test]
async fn restart_recovers_interrupted_transitions_and_keeps_everything() {
    let store = Arc::new(MemoryStore::retaining());
    let backend = Arc::new(ScriptedBackend::new(3));
    let gate = Arc::new(Notify::new());
    let first = start_on(backend.clone(), store.clone()).await;
    let create_op = first
        .create("m-0000", tok("s", 1, 1))
        .await
        .unwrap()
        .operation_id;
    wait_for_state(&first, "m-0000", State::Idle).await;
    let cfg_op = first
        .configure(
            "m-0000",
            tok("s", 1, 2),
            "c".into(),
            vec![],
            HashMap::from([("a\0".into(), "b".into())]),
        )
        .await
        .unwrap()
        .operation_id;
    wait_for_state(&first, "m-0000", State::Configured).await;
    backend.script(TransitionKind::Create, Script::Gate(gate.clone()));
    let creates = backend.calls(TransitionKind::Create);
    let interrupted_op = first.create("m-0001", none()).await.unwrap().operation_id;
    let old_rev = first.list(&[], 0, &[]).revision;
    // Its substrate call has begun (and holds the first gate) before the
    // script changes.
    while backend.calls(TransitionKind::Create) == creates {
        tokio::task::yield_now().await;
    }

    // The first engine's Create stays held (as if its process died); the
    // second one's resumed Create waits on a gate of its own.
    let resumed_gate = Arc::new(Notify::new());
    backend.script(TransitionKind::Create, Script::Gate(resumed_gate.clone()));
    let second = start_on(backend.clone(), store).await;
    let m0 = second.get("m-0000").unwrap();
    assert_eq!(m0.state, pb::MachineState::Configured as i32);
    assert_eq!(m0.cluster, "c");
    assert_eq!(m0.shard_metadata["a\0"], "b");
    // Idempotent retry returns the pre-restart operation id.
    let retry = second
        .configure("m-0000", tok("s", 1, 3), "c".into(), vec![], HashMap::new())
        .await
        .unwrap();
    assert_eq!(retry.operation_id, cfg_op);
    // Fence marks survived.
    let err = second.create("m-0000", tok("s", 1, 3)).await.unwrap_err();
    assert!(matches!(err, KitError::Fenced(_)));
    // Interrupted Create: resumed under its pre-restart operation id (a
    // retry sees that id), not FAILED for the restart alone.
    let m1 = second.get("m-0001").unwrap();
    assert_eq!(m1.state, pb::MachineState::Creating as i32);
    let retry = second.create("m-0001", none()).await.unwrap();
    assert_eq!(retry.operation_id, interrupted_op);
    // Released, the resumed Create lands IDLE under that same id, counted.
    resumed_gate.notify_one();
    wait_for_state(&second, "m-0001", State::Idle).await;
    let landed = second
        .resumed_counts()
        .into_iter()
        .find(|(kind, outcome, _)| {
            *kind == TransitionKind::Create && *outcome == providerkit::ResumeOutcome::Landed
        })
        .map(|(_, _, n)| n);
    assert_eq!(landed, Some(1));
    let retry = second.create("m-0001", none()).await.unwrap();
    assert_eq!(retry.operation_id, interrupted_op);
    // Old cursor: full re-list. New op ids never reuse old ones.
    assert_eq!(second.list(&[], 0, &old_rev).machines.len(), 3);
    second.create("m-0002", none()).await.unwrap();
    let fresh = second.get("m-0002").unwrap();
    assert_eq!(fresh.state, pb::MachineState::Creating as i32);
    let new_op = second.create("m-0002", none()).await.unwrap().operation_id;
    assert_ne!(new_op, create_op);
    assert_ne!(new_op, cfg_op);
}

#[tokio::test]
async fn unimplemented_delete_and_distinct_operation_ids() {
    let mut b = ScriptedBackend::new(1);
    b.delete = false;
    let engine = start(Arc::new(b)).await;
    assert_eq!(
        engine.delete("m-0000", none()).await.unwrap_err().code(),
        tonic::Code::Unimplemented
    );
    assert_eq!(
        engine.delete("unknown", none()).await.unwrap_err().code(),
        tonic::Code::Unimplemented
    );
    let a = engine.create("m-0000", none()).await.unwrap().operation_id;
    wait_for_state(&engine, "m-0000", State::Idle).await;
    let b = configure(&engine, "m-0000", none())
        .await
        .unwrap()
        .operation_id;
    wait_for_state(&engine, "m-0000", State::Configured).await;
    let c = engine
        .drain("m-0000", none(), 0)
        .await
        .unwrap()
        .operation_id;
    assert!(a != b && b != c && a != c);
}

#[tokio::test]
async fn served_encodings_decode_to_the_message_trees() {
    use prost::Message;
    let engine = start(Arc::new(ScriptedBackend::new(5))).await;
    to_configured(&engine, "m-0001").await;
    to_idle(&engine, "m-0002").await;
    let page = engine.list(&[], 0, &[]);
    let decoded = pb::MachineList::decode(page.encode().as_bytes()).unwrap();
    assert_eq!(decoded, page.to_wire());
    assert_eq!(decoded.machines.len(), 5);
    assert_eq!(decoded.revision, page.revision);
    for m in &decoded.machines {
        let one = pb::Machine::decode(engine.get_encoded(&m.id).unwrap().as_bytes()).unwrap();
        assert_eq!(&one, m);
    }
    let configured = &decoded.machines[decoded.machines.len() - 1];
    assert_eq!(configured.id, "m-0002");
    let m1 = decoded.machines.iter().find(|m| m.id == "m-0001").unwrap();
    assert_eq!(m1.cluster, "cluster-1");
    assert_eq!(m1.shard_metadata["k"], "v");
    assert_eq!(m1.resources.as_ref().unwrap().resources["cpu"], "1");
    assert_eq!(m1.allocatable.as_ref().unwrap().resources["cpu"], "2");
    // An empty page still carries its cursor.
    let empty = engine.list(&[], 0, &page.revision);
    let decoded = pb::MachineList::decode(empty.encode().as_bytes()).unwrap();
    assert!(decoded.machines.is_empty());
    assert_eq!(decoded.revision, page.revision);
}

#[tokio::test]
async fn list_snapshot_is_unchanged_by_later_mutations() {
    let engine = start(Arc::new(ScriptedBackend::new(2))).await;
    to_configured(&engine, "m-0000").await;
    let snapshot = engine.list(&[], 0, &[]);
    let before = snapshot.to_wire();
    engine.drain("m-0000", none(), 0).await.unwrap();
    wait_for_state(&engine, "m-0000", State::Idle).await;
    assert_eq!(snapshot.to_wire(), before);
    let now = engine.get("m-0000").unwrap();
    assert_eq!(now.state, pb::MachineState::Idle as i32);
    assert!(now.cluster.is_empty());
}

#[tokio::test]
async fn equal_facts_from_another_source_are_shared_without_a_bump() {
    let backend = Arc::new(ScriptedBackend::new(3));
    let engine = start(backend.clone()).await;
    let rev = engine.list(&[], 0, &[]).revision;
    // Same content, new allocations (as a store load produces).
    let fresh: Vec<SlotSpec> = (0..3).map(|i| slot(&format!("m-{i:04}"))).collect();
    *backend.slots.lock() = fresh.clone();
    assert_eq!(
        engine.reconcile().await.unwrap(),
        providerkit::ReconcileReport::default()
    );
    assert!(engine.list(&[], 0, &rev).machines.is_empty());
    for spec in &fresh {
        let record = engine.get_record(&spec.id).unwrap();
        assert!(Arc::ptr_eq(&record.facts, &spec.facts));
    }
}
