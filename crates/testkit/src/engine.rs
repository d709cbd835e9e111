//! Driving an in-process [`Engine`] in tests: deadlines short enough for a
//! test to reach, and waiting for a machine to land in a state (transitions
//! land in background tasks and the engine has no change notification to
//! await, so the state is polled).

use std::sync::Arc;
use std::time::Duration;

use bigfleet_proto::v1alpha1 as pb;
use providerkit::{Backend, Engine, EngineOptions, MemoryStore, State, Store, Timeouts};

use crate::wait::Wait;

/// How long a machine may take to reach the awaited state: longer than the
/// transition deadlines tests set (5 s in [`short_deadlines`], up to 20 s
/// elsewhere), so a transition that times out lands FAILED before the wait
/// gives up.
pub const STATE_WAIT: Duration = Duration::from_secs(30);

/// Engine options whose transitions time out after 5 s and whose readiness
/// gate probes every 100 ms.
pub fn short_deadlines() -> EngineOptions {
    EngineOptions {
        timeouts: Timeouts {
            create: Duration::from_secs(5),
            configure: Duration::from_secs(5),
            drain: Duration::from_secs(5),
            delete: Duration::from_secs(5),
            readiness_poll: Duration::from_millis(100),
        },
        ..EngineOptions::default()
    }
}

/// An engine over `backend` with [`short_deadlines`] and a fresh in-memory
/// store.
pub async fn start(backend: Arc<dyn Backend>) -> Arc<Engine> {
    start_on(backend, Arc::new(MemoryStore::new())).await
}

/// An engine over `backend` with [`short_deadlines`] on `store` (a
/// retaining store is how a test restarts the engine on its state).
pub async fn start_on(backend: Arc<dyn Backend>, store: Arc<dyn Store>) -> Arc<Engine> {
    Engine::start(backend, store, short_deadlines())
        .await
        .unwrap_or_else(|e| panic!("the engine did not start: {e}"))
}

/// Waits until machine `id` is in `want` and returns it; panics naming the
/// state it is in instead after [`STATE_WAIT`] (tokio time).
pub async fn wait_for_state(engine: &Engine, id: &str, want: State) -> pb::Machine {
    Wait::new(format!("{id} to reach {want}"), STATE_WAIT)
        .try_ok(|| {
            let m = engine
                .get(id)
                .unwrap_or_else(|e| panic!("{id} is not in the inventory: {e}"));
            if m.state == want.to_wire() as i32 {
                Ok(m)
            } else {
                Err(m.state)
            }
        })
        .await
        .unwrap_or_else(|t| {
            panic!(
                "{id} never reached {want}; is {} ({t})",
                State::from_wire(t.last)
                    .map_or_else(|| format!("wire state {}", t.last), |s| s.to_string())
            )
        })
}
