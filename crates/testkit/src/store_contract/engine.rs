//! The engine on the store survives a restart: ops, fences, binding,
//! metadata and inventory come back, and an interrupted transition is FAILED.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use bigfleet_proto::v1alpha1 as pb;
use providerkit::{
    Backend, BackendError, CatalogFacts, ConfigureCtx, CreateCtx, DrainCtx, Engine, EngineOptions,
    KitError, SlotSpec, State, SubstrateHost, Token,
};

use super::{runtime, StateUnderTest};
use crate::engine::wait_for_state;

/// Three slots; configure of `m-hang` never finishes (the "crash" window).
pub struct TinyBackend;

#[async_trait]
impl Backend for TinyBackend {
    async fn describe(&self) -> Result<Vec<SlotSpec>, BackendError> {
        Ok(["m-1", "m-2", "m-hang"]
            .iter()
            .map(|id| SlotSpec {
                id: id.to_string(),
                facts: CatalogFacts {
                    instance_type: "small".into(),
                    zone: "z1".into(),
                    capacity_type: pb::CapacityType::OnDemand,
                    price_per_hour: 0.1,
                    resources: HashMap::from([("cpu".into(), "2".into())]),
                    ..Default::default()
                }
                .share(),
                host: None,
            })
            .collect())
    }

    async fn create(&self, ctx: CreateCtx) -> Result<SubstrateHost, BackendError> {
        Ok(SubstrateHost {
            host_ref: format!("pve1/{}", ctx.machine_id),
        })
    }

    async fn configure(&self, ctx: &ConfigureCtx) -> Result<(), BackendError> {
        if ctx.machine_id == "m-hang" {
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    async fn drain(&self, _ctx: DrainCtx) -> Result<(), BackendError> {
        Ok(())
    }
}

async fn start<S: StateUnderTest>(state: &S) -> Arc<Engine> {
    let store = Arc::new(state.open());
    Engine::start(Arc::new(TinyBackend), store, EngineOptions::default())
        .await
        .expect("the engine starts")
}

/// A second and a third life on the state see what the first left.
pub fn engine_state_survives_restart<S: StateUnderTest>(state: S) {
    let metadata = HashMap::from([
        ("role".to_string(), "worker".to_string()),
        (
            "note".to_string(),
            "  spaces and \u{1F680} kept verbatim ".to_string(),
        ),
    ]);

    // First life: m-1 configured, m-hang stuck in CONFIGURING at the "crash".
    let rt = runtime();
    let (create_op, configure_op, before) = rt.block_on(async {
        let engine = start(&state).await;
        assert_eq!(engine.machine_count(), 3);
        let create = engine.create("m-1", Token::new("s1", 1, 1)).await.unwrap();
        wait_for_state(&engine, "m-1", State::Idle).await;
        let configure = engine
            .configure(
                "m-1",
                Token::new("s1", 1, 2),
                "cluster-a".into(),
                b"secret".to_vec(),
                metadata.clone(),
            )
            .await
            .unwrap();
        let before = wait_for_state(&engine, "m-1", State::Configured).await;

        engine
            .create("m-hang", Token::new("s1", 2, 1))
            .await
            .unwrap();
        wait_for_state(&engine, "m-hang", State::Idle).await;
        let ack = engine
            .configure(
                "m-hang",
                Token::new("s1", 2, 2),
                "cluster-b".into(),
                Vec::new(),
                HashMap::new(),
            )
            .await
            .unwrap();
        assert_eq!(ack.machine.state, State::Configuring);
        (create.operation_id, configure.operation_id, before)
    });
    // The "crash": every task (and with it the engine and store) is dropped
    // while m-hang's configure is still in flight.
    drop(rt);

    let rt = runtime();
    rt.block_on(async {
        let engine = start(&state).await;
        assert_eq!(engine.machine_count(), 3, "no machine lost or duplicated");

        let m1 = engine.get("m-1").unwrap();
        assert_eq!(m1, before, "binding, host and metadata are kept verbatim");
        assert_eq!(m1.cluster, "cluster-a");
        assert_eq!(m1.shard_metadata, metadata);
        assert_eq!(m1.host.as_ref().unwrap().r#ref, "pve1/m-1");

        // Idempotency map: a retry (with a newer token) returns the same ids.
        let again = engine
            .configure(
                "m-1",
                Token::new("s1", 1, 3),
                "cluster-a".into(),
                b"secret".to_vec(),
                metadata.clone(),
            )
            .await
            .unwrap();
        assert_eq!(again.operation_id, configure_op);
        let again = engine.create("m-1", Token::new("s1", 1, 4)).await;
        // CONFIGURED is past Create's target: out of position, not a new op.
        assert!(matches!(again, Err(KitError::Conflict(_))), "{again:?}");
        assert_ne!(create_op, configure_op);

        // Fence marks: the old token is stale now; a new shard starts low.
        let stale = engine
            .configure(
                "m-1",
                Token::new("s1", 1, 3),
                "cluster-a".into(),
                Vec::new(),
                HashMap::new(),
            )
            .await;
        assert!(matches!(stale, Err(KitError::Fenced(_))), "{stale:?}");
        let fresh = engine
            .configure(
                "m-1",
                Token::new("s-new", 0, 1),
                "cluster-a".into(),
                b"secret".to_vec(),
                metadata.clone(),
            )
            .await
            .unwrap();
        assert_eq!(fresh.operation_id, configure_op);

        // The interrupted transition is FAILED with a reason, not CONFIGURING.
        let hang = engine.get("m-hang").unwrap();
        assert_eq!(hang.state, State::Failed.to_wire() as i32);
        assert!(
            hang.last_error
                .contains("interrupted by a provider restart"),
            "{}",
            hang.last_error
        );
        assert!(
            hang.last_error.contains("CONFIGURING"),
            "{}",
            hang.last_error
        );

        let untouched = engine.get("m-2").unwrap();
        assert_eq!(untouched.state, State::Speculative.to_wire() as i32);
    });
    drop(rt);

    // The recovery itself was made durable: a third life still sees FAILED.
    let rt = runtime();
    rt.block_on(async {
        let engine = start(&state).await;
        let hang = engine.get("m-hang").unwrap();
        assert_eq!(hang.state, State::Failed.to_wire() as i32);
        let m1 = engine.get("m-1").unwrap();
        assert_eq!(m1.state, State::Configured.to_wire() as i32);
    });
}

/// A mutation whose acceptance `store` cannot commit (`fail` made it so)
/// is refused UNAVAILABLE saying nothing was changed, and the machine stays
/// as it was, never FAILED; once `heal` lets the store commit again, the
/// caller's retry with a new token lands. The mutation is a Configure with
/// 200 KiB of shard metadata (four 50 KiB values), so a store that is full (no page left for
/// it) fails as a store on a full disk does. Returns the engine, for the
/// store's own test to restart on the state.
pub async fn a_mutation_the_store_cannot_commit_costs_no_machine(
    store: Arc<dyn providerkit::Store>,
    fail: impl FnOnce(),
    heal: impl FnOnce(),
) -> Arc<Engine> {
    let engine = Engine::start(
        Arc::new(TinyBackend),
        store.clone(),
        EngineOptions::default(),
    )
    .await
    .expect("the engine starts");
    engine
        .create("m-1", Token::new("shard-a", 1, 1))
        .await
        .expect("Create with a healthy store");
    wait_for_state(&engine, "m-1", State::Idle).await;
    // Four values of 50 KiB: under the per-value and the total caps.
    let metadata: HashMap<String, String> = (0..4)
        .map(|i| (format!("bulk-{i}"), "x".repeat(50 * 1024)))
        .collect();
    let configure = |sequence| {
        engine.configure(
            "m-1",
            Token::new("shard-a", 1, sequence),
            "cluster-1".to_string(),
            b"join".to_vec(),
            metadata.clone(),
        )
    };
    fail();
    let refused = configure(2)
        .await
        .expect_err("a Configure the store cannot commit is not acknowledged");
    assert!(
        matches!(refused, KitError::NotCommitted { .. }),
        "{refused:?}"
    );
    assert!(
        refused.to_string().contains("nothing was changed"),
        "{refused}"
    );
    // Withdrawn at once, in memory: Get answers throughout.
    let back = wait_for_state(&engine, "m-1", State::Idle).await;
    assert!(back.last_error.is_empty(), "{back:?}");
    assert!(back.shard_metadata.is_empty(), "{back:?}");
    // The store keeps retrying the waiting changes; the withdrawal replaced
    // the acceptance's row, so a store that refused only for its size may
    // already commit again here.
    heal();
    crate::wait::Wait::new("the store to commit again", crate::engine::STATE_WAIT)
        .ok(|| store.health())
        .await;
    configure(3)
        .await
        .expect("the retry with a new token is accepted");
    let landed = wait_for_state(&engine, "m-1", State::Configured).await;
    assert!(landed.last_error.is_empty(), "{landed:?}");
    engine
}
