//! Fencing (B301–B312).

use anyhow::{bail, ensure};
use bigfleet_proto::v1alpha1::MachineState as S;
use rand::Rng;
use tonic::Code;

use crate::harness::{
    code_of, describe, expect_code, expect_fp, expect_ok, expect_rejected_not_fp, meta, Outcome,
    RpcResult, SharedCtx, TestResult, Token,
};

/// Accepted (passed the fence) iff the code is anything but FAILED_PRECONDITION.
fn fenced<T>(r: &RpcResult<T>) -> bool {
    code_of(r) == Some(Code::FailedPrecondition)
}

pub async fn b301(ctx: SharedCtx) -> TestResult {
    let s = ctx.session("b301");
    let id = ctx.unknown_id("b301");
    expect_code(
        &ctx.create(&id, &Token::new(&s.shard, 3, 10)).await,
        &[Code::NotFound],
        "first token on unknown id",
    )?;
    expect_fp(
        &ctx.create(&id, &Token::new(&s.shard, 3, 10)).await,
        "equal token on unknown id",
    )?;
    expect_fp(
        &ctx.create(&id, &Token::new(&s.shard, 3, 9)).await,
        "older token on unknown id",
    )?;
    expect_fp(
        &ctx.drain(&id, 0, &Token::new(&s.shard, 2, 99)).await,
        "older-epoch Drain on unknown id",
    )?;
    Ok(Outcome::Pass)
}

pub async fn b302(ctx: SharedCtx) -> TestResult {
    let a = ctx.session("b302a");
    let b = ctx.session("b302b");
    // Picked as the authoritative harness picks, all three before any mutation.
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = ctx.pick_speculative(&ids).await?;
        ids.push(id);
    }
    let (m1, m2, m3) = (&ids[0], &ids[1], &ids[2]);
    expect_ok(
        ctx.create(m1, &Token::new(&a.shard, 9, 100)).await,
        "A(9,100) on m1",
    )?;
    let r = ctx.create(m1, &Token::new(&b.shard, 1, 1)).await;
    ensure!(
        !fenced(&r),
        "shard B's first token on m1 fenced by shard A's mark: {}",
        describe(&r)
    );
    let r = ctx.create(m2, &Token::new(&a.shard, 1, 1)).await;
    ensure!(
        !fenced(&r),
        "A(1,1) on m2 fenced by A's mark on m1: {}",
        describe(&r)
    );
    // A negative token on a third machine is first contact there.
    let r = ctx.create(m3, &Token::new(&a.shard, -4, -4)).await;
    ensure!(
        !fenced(&r),
        "A(-4,-4) on m3 fenced by A's marks on m1/m2: {}",
        describe(&r)
    );
    expect_fp(
        &ctx.create(m1, &Token::new(&a.shard, 9, 100)).await,
        "A's own stale token on m1",
    )?;
    expect_fp(
        &ctx.create(m1, &Token::new(&b.shard, 1, 1)).await,
        "B's own stale token on m1",
    )?;
    expect_fp(
        &ctx.create(m2, &Token::new(&a.shard, 1, 1)).await,
        "A's own stale token on m2",
    )?;
    expect_fp(
        &ctx.create(m3, &Token::new(&a.shard, -4, -5)).await,
        "A's own older negative token on m3",
    )?;
    Ok(Outcome::Pass)
}

pub async fn b303(ctx: SharedCtx) -> TestResult {
    let s = ctx.session("b303");
    let id = ctx.fresh1().await?;
    // (token, expected accept) against a running mark.
    let steps: &[((i64, i64), bool)] = &[
        ((2, 5), true),
        ((2, 5), false),
        ((2, 4), false),
        ((1, 9), false),
        ((1, 1000), false),
        ((2, 6), true),
        ((3, 0), true),
        ((3, 0), false),
        ((2, 100), false),
        ((3, 1), true),
        ((7, 1), true),
        ((6, i64::MAX), false),
        ((7, 2), true),
        // Signed values are ordered like any other.
        ((7, -5), false),
        ((8, -3), true),
        ((8, -4), false),
        ((8, -2), true),
        ((-1, i64::MAX), false),
        ((9, i64::MIN), true),
        ((9, i64::MIN), false),
    ];
    for ((e, q), want) in steps {
        let r = ctx.create(&id, &Token::new(&s.shard, *e, *q)).await;
        if *want && fenced(&r) {
            bail!(
                "strictly-newer token ({e},{q}) was fenced: {}",
                describe(&r)
            );
        }
        if !*want && !fenced(&r) {
            bail!(
                "not-strictly-newer token ({e},{q}) was not FAILED_PRECONDITION: {}",
                describe(&r)
            );
        }
    }
    Ok(Outcome::Pass)
}

pub async fn b305(ctx: SharedCtx) -> TestResult {
    let s = ctx.session("b305");
    let id = ctx.fresh1().await?;
    expect_ok(
        ctx.create(&id, &Token::new(&s.shard, 5, 5)).await,
        "Create at (5,5)",
    )?;
    for i in 0..20 {
        expect_fp(
            &ctx.create(&id, &Token::new(&s.shard, 5, i % 5)).await,
            "stale Create",
        )?;
        ctx.get(&id).await?;
        expect_fp(
            &ctx.drain(&id, 0, &Token::new(&s.shard, 4, i)).await,
            "stale Drain",
        )?;
        let l = ctx.list(&[], 3, &[]).await?;
        ensure!(l.machines.len() <= 3, "List broke max_results");
    }
    ctx.wait_for(&id, S::Idle).await?;
    Ok(Outcome::Pass)
}

pub async fn b306(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b306");
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    let t = s.mint();
    expect_ok(
        ctx.configure(&id, "b306", &meta(&[]), &t).await,
        "Configure",
    )?;
    ctx.wait_for(&id, S::Configured).await?;
    expect_fp(
        &ctx.configure(&id, "b306", &meta(&[]), &t).await,
        "stale replay of an applied Configure",
    )?;
    Ok(Outcome::Pass)
}

pub async fn b307(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b307");
    let (id, _) = ctx.fresh_configured(&mut s, &meta(&[])).await?;
    let t = s.mint();
    expect_ok(ctx.drain(&id, 0, &t).await, "Drain")?;
    ctx.wait_for(&id, S::Idle).await?;
    expect_fp(
        &ctx.drain(&id, 0, &t).await,
        "stale replay of an applied Drain",
    )?;
    Ok(Outcome::Pass)
}

pub async fn b308(ctx: SharedCtx) -> TestResult {
    let id = ctx.fresh1().await?;
    let a = expect_ok(
        ctx.create(&id, &Token::none()).await,
        "first zero-token Create",
    )?;
    let b = expect_ok(
        ctx.create(&id, &Token::none()).await,
        "second zero-token Create",
    )?;
    ensure!(
        a.operation_id == b.operation_id,
        "zero-token retries minted {} and {}",
        a.operation_id,
        b.operation_id
    );
    ctx.wait_for(&id, S::Idle).await?;
    Ok(Outcome::Pass)
}

pub async fn b309(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b309");
    let id = ctx.fresh1().await?;
    ctx.to_idle(&id, &mut s).await?;
    ctx.to_configured(&id, &mut s, "b309", &meta(&[])).await?;
    ctx.drain_to_idle(&id, &mut s).await?;
    ctx.to_configured(&id, &mut s, "b309", &meta(&[])).await?;
    ctx.drain_to_idle(&id, &mut s).await?;
    Ok(Outcome::Pass)
}

pub async fn b310(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b310");
    let id = ctx.fresh1().await?;
    for _ in 0..3 {
        expect_ok(ctx.create(&id, &s.mint()).await, "epoch-1 Create")?;
    }
    let old = s.mint(); // minted before the restart, never sent
    s.new_epoch();
    let new = s.mint();
    expect_ok(ctx.create(&id, &new).await, "new-epoch token (2,1)")?;
    expect_fp(
        &ctx.create(&id, &old).await,
        "pre-restart token after the new epoch",
    )?;
    expect_ok(ctx.create(&id, &s.mint()).await, "new-epoch (2,2)")?;
    ctx.wait_for(&id, S::Idle).await?;
    Ok(Outcome::Pass)
}

pub async fn b311(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b311");
    let id = ctx.fresh1().await?;
    let t = s.mint();
    expect_rejected_not_fp(
        &ctx.configure(&id, "b311", &meta(&[]), &t).await,
        "out-of-position Configure",
    )?;
    expect_fp(
        &ctx.configure(&id, "b311", &meta(&[]), &t).await,
        "retry of the failed op with its own token",
    )?;
    Ok(Outcome::Pass)
}

/// Drives a random token stream at one (shard, machine) and checks the running-max oracle.
/// A token component: mostly small signed values, so that streams cross
/// zero often, now and then an extreme.
pub fn random_signed(rng: &mut impl Rng) -> i64 {
    match rng.random_range(0..16) {
        0 => i64::MIN,
        1 => i64::MAX,
        _ => rng.random_range(-4..5i64),
    }
}

pub async fn token_stream_oracle(
    ctx: &SharedCtx,
    id: &str,
    shard: &str,
    rng: &mut impl Rng,
    n: usize,
) -> anyhow::Result<()> {
    let mut mark: Option<(i64, i64)> = None;
    for step in 0..n {
        let tok = (random_signed(rng), random_signed(rng));
        let want = mark.is_none_or(|m| tok > m);
        let r = ctx.create(id, &Token::new(shard, tok.0, tok.1)).await;
        let got = !fenced(&r);
        if want != got {
            bail!("step {step}: token {tok:?} vs mark {mark:?}: oracle says accept={want}, endpoint said {}", describe(&r));
        }
        // An accepted token on a machine being created is the Create or its
        // idempotent repeat: anything but OK (INVALID_ARGUMENT for a sign,
        // say) means the token was not taken as valid.
        if want && r.is_err() {
            bail!(
                "step {step}: strictly-newer token {tok:?} vs mark {mark:?} was not accepted: {}",
                describe(&r)
            );
        }
        if want {
            mark = Some(tok);
        }
    }
    Ok(())
}

pub async fn b312(ctx: SharedCtx) -> TestResult {
    let s = ctx.session("b312");
    let id = ctx.fresh1().await?;
    let mut rng = ctx.rng("B312");
    token_stream_oracle(&ctx, &id, &s.shard, &mut rng, 60).await?;
    Ok(Outcome::Pass)
}
