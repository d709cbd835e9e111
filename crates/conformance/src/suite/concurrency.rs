//! Concurrency & idempotency (B401–B409).

use std::collections::HashSet;

use anyhow::{bail, ensure};
use bigfleet_proto::v1alpha1::{MachineState as S, TransitionAck};
use futures::future::join_all;
use tonic::Code;

use crate::harness::{
    burst, code_of, connections, create_req, describe, expect_fp, expect_ok, meta, Outcome,
    RpcResult, ShardSession, SharedCtx, TestResult, Token,
};

const N: usize = 16;
static NONE: Token = Token {
    shard: String::new(),
    epoch: 0,
    seq: 0,
};

fn one_op(acks: &[RpcResult<TransitionAck>], what: &str) -> anyhow::Result<String> {
    let mut ops = HashSet::new();
    for a in acks {
        match a {
            Ok(a) => {
                ops.insert(a.operation_id.clone());
            }
            Err(s) => bail!(
                "{what}: a parallel identical call failed: {:?}: {}",
                s.code(),
                s.message()
            ),
        }
    }
    ensure!(
        ops.len() == 1,
        "{what}: {} distinct operation_ids: {ops:?}",
        ops.len()
    );
    let op = ops.into_iter().next().unwrap_or_default();
    ensure!(!op.is_empty(), "{what}: empty operation_id");
    Ok(op)
}

pub async fn b401(ctx: SharedCtx) -> TestResult {
    let id = ctx.fresh1().await?;
    let acks = burst(N, |_| ctx.create(&id, &NONE)).await;
    one_op(&acks, "parallel Creates")?;
    let tr = ctx.wait_for(&id, S::Idle).await?;
    crate::suite::lifecycle::check_walk(&tr.states())?;
    ctx.assert_stays(&id, S::Idle, "after parallel Creates")
        .await?;
    Ok(Outcome::Pass)
}

pub async fn b402(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b402");
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    let md = meta(&[("k", "v")]);
    let acks = burst(N, |_| ctx.configure(&id, "b402", &md, &NONE)).await;
    let op = one_op(&acks, "parallel Configures")?;
    ctx.wait_for(&id, S::Configured).await?;
    ctx.assert_stays(&id, S::Configured, "after parallel Configures")
        .await?;
    let again = expect_ok(ctx.configure(&id, "b402", &md, &NONE).await, "late retry")?;
    ensure!(
        again.operation_id == op,
        "operation_id not stable: {} then {}",
        op,
        again.operation_id
    );
    Ok(Outcome::Pass)
}

pub async fn b403(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b403");
    let (id, _) = ctx.fresh_configured(&mut s, &meta(&[("k", "v")])).await?;
    let acks = burst(N, |_| ctx.drain(&id, 0, &NONE)).await;
    one_op(&acks, "parallel Drains")?;
    ctx.wait_for(&id, S::Idle).await?;
    let m = ctx
        .assert_stays(&id, S::Idle, "after parallel Drains")
        .await?;
    ensure!(
        m.cluster.is_empty() && m.shard_metadata.is_empty(),
        "binding left at IDLE: {:?} {:?}",
        m.cluster,
        m.shard_metadata
    );
    Ok(Outcome::Pass)
}

pub async fn b404(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b404");
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    let md = meta(&[("race", "1")]);
    let cfg = burst(N / 2, |_| ctx.configure(&id, "b404", &md, &NONE));
    let drn = burst(N / 2, |_| ctx.drain(&id, 0, &NONE));
    let (cfg, drn) = futures::join!(cfg, drn);
    for r in cfg.iter().chain(drn.iter()) {
        ensure!(
            code_of(r) != Some(Code::FailedPrecondition),
            "racing mutation got FAILED_PRECONDITION: {}",
            describe(r)
        );
    }
    let cfg_ops: HashSet<_> = cfg
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .map(|a| a.operation_id.clone())
        .collect();
    let drn_ok: Vec<_> = drn.iter().filter_map(|r| r.as_ref().ok()).collect();
    let drn_ops: HashSet<_> = drn_ok.iter().map(|a| a.operation_id.clone()).collect();
    ensure!(
        cfg_ops.len() <= 1 && drn_ops.len() <= 1,
        "racing calls minted several ops: {cfg_ops:?} {drn_ops:?}"
    );
    // A Drain may only succeed if it serialized after the Configure landed (its snapshot left CONFIGURED).
    for a in &drn_ok {
        let st = a
            .machine
            .as_ref()
            .map(|m| m.state())
            .unwrap_or(S::Unspecified);
        ensure!(
            matches!(st, S::Draining | S::Idle) && !cfg_ops.is_empty(),
            "a Drain succeeded from a non-CONFIGURED position (snapshot {st:?}, configure ops {cfg_ops:?})"
        );
    }
    let expect = if drn_ops.is_empty() && !cfg_ops.is_empty() {
        S::Configured
    } else {
        S::Idle
    };
    ctx.wait_for(&id, expect).await?;
    let m = ctx
        .assert_stays(&id, expect, "end state of the race")
        .await?;
    match expect {
        S::Configured => ensure!(
            m.cluster == "b404" && m.shard_metadata == md,
            "CONFIGURED without its binding: {m:?}"
        ),
        _ => ensure!(
            m.cluster.is_empty() && m.shard_metadata.is_empty(),
            "IDLE with a binding: {m:?}"
        ),
    }
    Ok(Outcome::Pass)
}

pub async fn b405(ctx: SharedCtx) -> TestResult {
    let mut live = ctx.session("b405");
    let mut zombie = live.clone();
    let id = ctx.fresh1().await?;
    expect_ok(
        ctx.create(&id, &zombie.mint()).await,
        "epoch-1 Create before the new epoch",
    )?;
    live.new_epoch();
    for i in 0..12 {
        let l = live.mint();
        let z = zombie.mint();
        // Alternate which one goes first.
        if i % 2 == 0 {
            expect_ok(ctx.create(&id, &l).await, "live-epoch token")?;
            expect_fp(&ctx.create(&id, &z).await, "zombie-epoch token")?;
        } else {
            expect_fp(&ctx.create(&id, &z).await, "zombie-epoch token")?;
            expect_ok(ctx.create(&id, &l).await, "live-epoch token")?;
        }
    }
    ctx.wait_for(&id, S::Idle).await?;
    Ok(Outcome::Pass)
}

pub async fn b406(ctx: SharedCtx) -> TestResult {
    let conns = connections(&ctx, 8).await?;
    let id = ctx.fresh1().await?;
    let base = ctx.session("b406");
    let acks = join_all(conns.iter().enumerate().map(|(i, c)| {
        let mut c = c.clone();
        // Retries are re-stamped: each connection uses its own shard's first token.
        let req = create_req(&id, &Token::new(&format!("{}-{i}", base.shard), 1, 1));
        async move { c.create(req).await.map(|r| r.into_inner()) }
    }))
    .await;
    one_op(&acks, "Creates over distinct connections")?;
    ctx.wait_for(&id, S::Idle).await?;
    Ok(Outcome::Pass)
}

pub async fn b407(ctx: SharedCtx) -> TestResult {
    const K: usize = 8;
    let ids = ctx.fresh(K).await?;
    let base = ctx.session("b407");
    let results = join_all(ids.iter().map(|id| {
        let ctx = ctx.clone();
        let mut s = ShardSession::new(format!("{}-{id}", base.shard));
        let id = id.clone();
        async move {
            let ack = expect_ok(ctx.create(&id, &s.mint()).await, &format!("Create({id})"))?;
            ensure!(
                ack.machine.as_ref().map(|m| m.id.as_str()) == Some(id.as_str()),
                "ack for {id} carries machine {:?}",
                ack.machine.as_ref().map(|m| &m.id)
            );
            ctx.wait_for(&id, S::Idle).await?;
            anyhow::Ok(ack.operation_id)
        }
    }))
    .await;
    let mut ops = HashSet::new();
    for r in results {
        let op = r?;
        ensure!(
            ops.insert(op.clone()),
            "operation_id {op} shared by two machines"
        );
    }
    let mut hosts = HashSet::new();
    for id in &ids {
        let m = ctx.get(id).await?;
        ensure!(
            m.state() == S::Idle && m.cluster.is_empty(),
            "{id} bled: {:?} cluster {:?}",
            m.state(),
            m.cluster
        );
        let h = m.host.map(|h| (h.provider, h.r#ref)).unwrap_or_default();
        ensure!(hosts.insert(h.clone()), "host {h:?} shared by two machines");
    }
    Ok(Outcome::Pass)
}

pub async fn b408(ctx: SharedCtx) -> TestResult {
    let id = ctx.fresh1().await?;
    let acks = burst(N, |_| ctx.create(&id, &NONE)).await;
    for a in &acks {
        let a = expect_ok(a.clone(), "burst Create")?;
        let m = a.machine.unwrap_or_default();
        ensure!(m.id == id, "ack snapshot for {:?}, wanted {id}", m.id);
        ensure!(
            matches!(m.state(), S::Creating | S::Idle),
            "torn snapshot: Create ack shows {:?}",
            m.state()
        );
    }
    ctx.wait_for(&id, S::Idle).await?;
    let md = meta(&[("a", "b")]);
    let acks = burst(N, |_| ctx.configure(&id, "b408", &md, &NONE)).await;
    for a in &acks {
        let a = expect_ok(a.clone(), "burst Configure")?;
        let m = a.machine.unwrap_or_default();
        ensure!(
            matches!(m.state(), S::Configuring | S::Configured),
            "torn snapshot: Configure ack shows {:?}",
            m.state()
        );
        ensure!(
            m.cluster == "b408",
            "torn snapshot: Configure ack cluster {:?}",
            m.cluster
        );
    }
    ctx.wait_for(&id, S::Configured).await?;
    Ok(Outcome::Pass)
}

pub async fn b409(ctx: SharedCtx) -> TestResult {
    if !ctx.caps.delete {
        return Ok(Outcome::Skip("Delete unsupported (UNIMPLEMENTED)".into()));
    }
    let mut s = ctx.session("b409");
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    let acks = burst(N, |_| ctx.delete(&id, &NONE)).await;
    one_op(&acks, "parallel Deletes")?;
    let tr = ctx.wait_for(&id, S::Speculative).await?;
    crate::suite::lifecycle::check_walk(&tr.states())?;
    ctx.assert_stays(&id, S::Speculative, "after parallel Deletes")
        .await?;
    Ok(Outcome::Pass)
}
