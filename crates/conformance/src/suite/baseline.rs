//! Baseline (the floor): the minimal contract every provider must pass.

use anyhow::{bail, ensure};
use bigfleet_proto::v1alpha1::MachineState as S;
use tonic::Code;

use crate::harness::{
    code_of, describe, expect_code, expect_fp, expect_ok, meta, Outcome, SharedCtx, TestResult,
    Token,
};

pub async fn full_lifecycle(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("bl-life");
    let id = ctx.fresh1().await?;
    let (op1, _) = ctx.to_idle(&id, &mut s).await?;
    let (op2, _) = ctx
        .to_configured(&id, &mut s, "bl-cluster", &meta(&[("k", "v")]))
        .await?;
    let (op3, _) = ctx.drain_to_idle(&id, &mut s).await?;
    ensure!(
        !op1.is_empty() && !op2.is_empty() && !op3.is_empty(),
        "empty operation_id: {op1:?} {op2:?} {op3:?}"
    );
    if !ctx.caps.delete {
        return Ok(Outcome::PassWith(
            "Delete unsupported: lifecycle ended at IDLE".into(),
        ));
    }
    let (op4, _) = ctx.delete_to_spec(&id, &mut s).await?;
    ensure!(!op4.is_empty(), "Delete returned an empty operation_id");
    Ok(Outcome::Pass)
}

pub async fn create_idempotent(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("bl-idem");
    let id = ctx.fresh1().await?;
    let a = expect_ok(ctx.create(&id, &s.mint()).await, "first Create")?;
    let b = expect_ok(ctx.create(&id, &s.mint()).await, "second Create")?;
    ensure!(!a.operation_id.is_empty(), "empty operation_id");
    ensure!(
        a.operation_id == b.operation_id,
        "Create twice: {} vs {}",
        a.operation_id,
        b.operation_id
    );
    ctx.wait_for(&id, S::Idle).await?;
    Ok(Outcome::Pass)
}

pub async fn get_unknown(ctx: SharedCtx) -> TestResult {
    let r = ctx
        .c()
        .get(bigfleet_proto::v1alpha1::MachineRef {
            id: ctx.unknown_id("bl"),
        })
        .await;
    expect_code(&r, &[Code::NotFound], "Get(unknown)")?;
    Ok(Outcome::Pass)
}

pub async fn delete_unknown(ctx: SharedCtx) -> TestResult {
    let r = ctx.delete(&ctx.unknown_id("bl"), &Token::none()).await;
    expect_code(
        &r,
        &[Code::NotFound, Code::Unimplemented],
        "Delete(unknown)",
    )?;
    Ok(Outcome::Pass)
}

pub async fn list_idle_filter(ctx: SharedCtx) -> TestResult {
    let l = ctx.list(&[S::Idle], 0, &[]).await?;
    for m in &l.machines {
        ensure!(
            m.state() == S::Idle,
            "List(states=[IDLE]) returned {} in {:?}",
            m.id,
            m.state()
        );
    }
    Ok(Outcome::Pass)
}

pub async fn list_max_one(ctx: SharedCtx) -> TestResult {
    let l = ctx.list(&[], 1, &[]).await?;
    ensure!(
        l.machines.len() <= 1,
        "List(max_results=1) returned {}",
        l.machines.len()
    );
    Ok(Outcome::Pass)
}

pub async fn list_shape(ctx: SharedCtx) -> TestResult {
    let l = ctx.list_all().await?;
    ensure!(!l.machines.is_empty(), "List returned no machines");
    for m in &l.machines {
        ensure!(
            !m.instance_type.is_empty(),
            "{} has an empty instance_type",
            m.id
        );
        ensure!(
            m.state() != S::Unspecified,
            "{} has state UNSPECIFIED",
            m.id
        );
    }
    Ok(Outcome::Pass)
}

pub async fn revision_changes(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("bl-rev");
    let id = ctx.fresh1().await?;
    let r0 = ctx.list_all().await?.revision;
    ctx.to_idle(&id, &mut s).await?;
    let r1 = ctx.list_all().await?.revision;
    ensure!(r0 != r1, "revision unchanged after a mutation ({r0:?})");
    Ok(Outcome::Pass)
}

pub async fn drain_speculative(ctx: SharedCtx) -> TestResult {
    let id = ctx.fresh1().await?;
    let r = ctx.drain(&id, 0, &ctx.session("bl-drain").mint()).await;
    if r.is_ok() {
        bail!("Drain on SPECULATIVE {id} succeeded");
    }
    Ok(Outcome::Pass)
}

pub async fn fencing_stale(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("bl-fence");
    let id = ctx.fresh1().await?;
    let t = s.mint();
    expect_ok(ctx.create(&id, &t).await, "Create")?;
    expect_fp(&ctx.create(&id, &t).await, "replayed token")?;
    Ok(Outcome::Pass)
}

pub async fn fencing_per_machine(ctx: SharedCtx) -> TestResult {
    let s = ctx.session("bl-pm");
    let ids = ctx.fresh(2).await?;
    expect_ok(
        ctx.create(&ids[0], &Token::new(&s.shard, 1, 50)).await,
        "Create m1 at (1,50)",
    )?;
    let r = ctx.create(&ids[1], &Token::new(&s.shard, 1, 2)).await;
    ensure!(
        code_of(&r) != Some(Code::FailedPrecondition),
        "a mark on {} fenced {}: {}",
        ids[0],
        ids[1],
        describe(&r)
    );
    Ok(Outcome::Pass)
}

pub async fn fence_before_not_found(ctx: SharedCtx) -> TestResult {
    let s = ctx.session("bl-fnf");
    let id = ctx.unknown_id("bl-fnf");
    expect_code(
        &ctx.create(&id, &Token::new(&s.shard, 1, 5)).await,
        &[Code::NotFound],
        "first token on unknown",
    )?;
    expect_fp(
        &ctx.create(&id, &Token::new(&s.shard, 1, 5)).await,
        "stale token on unknown",
    )?;
    Ok(Outcome::Pass)
}

pub async fn fence_before_idempotency(ctx: SharedCtx) -> TestResult {
    let s = ctx.session("bl-fbi");
    let id = ctx.fresh1().await?;
    expect_ok(ctx.create(&id, &Token::new(&s.shard, 1, 2)).await, "Create")?;
    expect_fp(
        &ctx.create(&id, &Token::new(&s.shard, 1, 2)).await,
        "idempotent retry with a stale token",
    )?;
    Ok(Outcome::Pass)
}

pub async fn metadata_echo_clear(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("bl-meta");
    let md = meta(&[("bigfleet.io/shard", "s-1"), ("empty", "")]);
    let (id, _) = ctx.fresh_configured(&mut s, &md).await?;
    let m = ctx.get(&id).await?;
    ensure!(
        m.shard_metadata == md,
        "metadata not echoed: {:?}",
        m.shard_metadata
    );
    ctx.drain_to_idle(&id, &mut s).await?;
    let m = ctx.get(&id).await?;
    ensure!(
        m.shard_metadata.is_empty(),
        "metadata not cleared by Drain: {:?}",
        m.shard_metadata
    );
    Ok(Outcome::Pass)
}

pub async fn readiness_gate(ctx: SharedCtx) -> TestResult {
    if ctx.fault_control.is_none() {
        return Ok(Outcome::Skip(
            "node readiness is not observable black-box on this endpoint; asserted by B708 in the fault lane".into(),
        ));
    }
    crate::suite::fault::b708(ctx).await
}
