//! Store-level cases: persistence, group commit, boot generations, load
//! speed, a whole state's dump and restore (`state copy`).

use std::sync::Arc;

use providerkit::{Change, InFlight, Loaded, MachineRecord, RestoreError, State, StateDump, Store};

use super::{machine, mark, record, runtime, sorted_fences, StateUnderTest};

/// Records and fence marks written in one batch come back after a reopen;
/// the later of two versions in a batch wins; an empty batch reuses the
/// latest ticket.
pub fn round_trip_survives_reopen<S: StateUnderTest>(state: S) {
    let expected_machines = vec![
        record("m-1", 1, State::Idle),
        record("m-2", 2, State::Configured),
        record("m-3", 3, State::Failed),
    ];
    // A shard id is the client's text: a NUL in it is kept too.
    let expected_fences = vec![mark("s1", "m-1", 1, 2), mark("s2\0x", "m-2", 3, 4)];
    runtime().block_on(async {
        let store = state.open();
        let loaded = store.load().expect("load");
        assert!(loaded.machines.is_empty() && loaded.fences.is_empty());
        let mut stale = record("m-2", 0, State::Idle);
        stale.cluster = "stale".into();
        let mut changes = vec![machine(stale)];
        changes.extend(expected_machines.iter().cloned().map(machine));
        changes.push(Change::Fence(mark("s1", "m-1", 1, 1)));
        changes.extend(expected_fences.iter().cloned().map(Change::Fence));
        let ticket = store.submit(changes);
        store.durable(ticket).await.expect("durable");
        assert_eq!(
            store.submit(Vec::new()),
            ticket,
            "empty batch reuses the latest ticket"
        );
    });
    let store = state.open();
    let loaded = store.load().expect("load after reopen");
    assert_eq!(loaded.machines, expected_machines);
    assert_eq!(sorted_fences(loaded.fences), expected_fences);
    assert!(
        store.describe().starts_with(&state.describe_prefix()),
        "{}",
        store.describe()
    );
}

/// 64 callers submitting at once share commits.
pub fn group_commit_batches_concurrent_submits<S: StateUnderTest>(state: S) {
    let store = Arc::new(state.open());
    store.load().expect("load");
    const TASKS: usize = 64;
    const ROUNDS: usize = 10;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
        let mut handles = Vec::new();
        for t in 0..TASKS {
            let store = Arc::clone(&store);
            let barrier = Arc::clone(&barrier);
            handles.push(tokio::spawn(async move {
                for round in 0..ROUNDS {
                    barrier.wait().await;
                    let rev = (round * TASKS + t + 1) as u64;
                    let ticket =
                        store.submit(vec![machine(record(&format!("m-{t}"), rev, State::Idle))]);
                    store.durable(ticket).await.expect("durable");
                }
            }));
        }
        for h in handles {
            h.await.expect("submitter");
        }
    });
    let submits = (TASKS * ROUNDS) as u64;
    let commits = S::commits(&store);
    assert!(commits >= 1);
    assert!(
        commits * 4 <= submits,
        "{commits} commits for {submits} submits: group commit is not batching"
    );
    let loaded = store.load().expect("load");
    assert_eq!(loaded.machines.len(), TASKS);
    assert!(loaded
        .machines
        .iter()
        .all(|m| m.rev > ((ROUNDS - 1) * TASKS) as u64));
}

/// Every load starts a boot generation no earlier one used.
pub fn boot_generation_increases_across_opens_and_loads<S: StateUnderTest>(state: S) {
    let first = state.open().load().expect("load").boot_generation;
    let store = state.open();
    let second = store.load().expect("load").boot_generation;
    let third = store.load().expect("load").boot_generation;
    assert!(first >= 1);
    assert!(second > first && third > second, "{first} {second} {third}");
}

/// 20,000 machines load within seconds even in a debug build.
pub fn load_of_many_machines_is_fast<S: StateUnderTest>(state: S) {
    const N: usize = 20_000;
    {
        let store = state.open();
        store.load().expect("load");
        let changes = (0..N)
            .map(|i| machine(record(&format!("m-{i:06}"), i as u64 + 1, State::Idle)))
            .collect();
        let t = store.submit(changes);
        futures::executor::block_on(store.durable(t)).expect("durable");
    }
    let store = state.open();
    let started = std::time::Instant::now();
    let loaded = store.load().expect("load");
    let took = started.elapsed();
    assert_eq!(loaded.machines.len(), N);
    // Generous for a debug build; the release benchmark reports the real figure.
    assert!(took.as_secs() < 5, "loading {N} machines took {took:?}");
}

/// `state copy`'s two halves on this store: a whole state (records with
/// their transition windows, fence marks, a boot generation) restored into
/// the empty state dumps back exactly; a dump starts no boot generation; a
/// second restore is refused with nothing written; the next boot starts a
/// generation past the restored one. Chunked writes are crossed: more
/// records than one insert carries.
pub fn a_whole_state_restores_and_dumps_back_exactly<S: StateUnderTest>(state: S) {
    const N: usize = 12_000;
    let mut machines: Vec<MachineRecord> = (0..N)
        .map(|i| record(&format!("m-{i:06}"), i as u64 + 1, State::Idle))
        .collect();
    machines[1].state = State::Creating;
    machines[1].in_flight = Some(InFlight {
        started_ms: 1_700_000_000_000,
        deadline_ms: 1_700_000_480_000,
        grace_ms: 0,
    });
    machines[2].state = State::Draining;
    machines[2].in_flight = Some(InFlight {
        started_ms: 1_700_000_001_000,
        deadline_ms: 1_700_000_901_000,
        grace_ms: 30_000,
    });
    let whole = Loaded {
        machines,
        fences: vec![
            mark("s1", "m-000001", 1, 2),
            mark("s2\0x", "m-000002", 3, 4),
        ],
        boot_generation: 7,
    };
    {
        let store = state.open();
        store.restore(&whole).expect("restore into the empty state");
        let dumped = store.dump().expect("dump");
        assert_eq!(dumped.boot_generation, 7);
        assert_eq!(by_id(dumped.machines), by_id(whole.machines.clone()));
        assert_eq!(
            sorted_fences(dumped.fences),
            sorted_fences(whole.fences.clone())
        );
        assert_eq!(
            store.dump().expect("dump").boot_generation,
            7,
            "a dump starts no boot generation"
        );
        match store.restore(&whole) {
            Err(RestoreError::NotEmpty {
                machines,
                fence_marks,
                ..
            }) => assert_eq!((machines, fence_marks), (N as u64, 2)),
            other => panic!("a second restore must be refused: {other:?}"),
        }
    }
    let store = state.open();
    let loaded = store.load().expect("load after reopen");
    assert_eq!(loaded.boot_generation, 8);
    assert_eq!(loaded.machines.len(), N);
    assert_eq!(loaded.fences.len(), 2);
}

fn by_id(mut machines: Vec<MachineRecord>) -> Vec<MachineRecord> {
    machines.sort_by(|a, b| a.id.cmp(&b.id));
    machines
}
