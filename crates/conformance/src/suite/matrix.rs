//! Transition matrix / errors (B201–B215).

use std::collections::HashMap;

use anyhow::{bail, ensure};
use bigfleet_proto::v1alpha1::{MachineRef, MachineState as S, TransitionAck};
use tonic::Code;

use crate::harness::{
    code_of, configure_req, describe, expect_code, expect_fp, expect_ok, expect_rejected_not_fp,
    meta, Outcome, RpcResult, SharedCtx, TestResult, Token,
};

pub async fn b201(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b201");
    let (id, _) = ctx.fresh_configured(&mut s, &meta(&[])).await?;
    expect_rejected_not_fp(&ctx.create(&id, &s.mint()).await, "Create on CONFIGURED")?;
    ctx.assert_stays(&id, S::Configured, "after rejected Create")
        .await?;
    Ok(Outcome::Pass)
}

pub async fn b202(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b202");
    let id = ctx.fresh1().await?;
    expect_rejected_not_fp(
        &ctx.configure(&id, "b202", &meta(&[]), &s.mint()).await,
        "Configure on SPECULATIVE",
    )?;
    let m = ctx
        .assert_stays(&id, S::Speculative, "after rejected Configure")
        .await?;
    ensure!(
        m.cluster.is_empty() && m.shard_metadata.is_empty(),
        "rejected Configure left a binding: {m:?}"
    );
    Ok(Outcome::Pass)
}

pub async fn b203(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b203");
    // Never drained: no Drain op on record.
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    let r = ctx.drain(&id, 0, &s.mint()).await;
    ensure!(
        code_of(&r) != Some(Code::FailedPrecondition),
        "Drain on IDLE: {}",
        describe(&r)
    );
    ctx.assert_stays(&id, S::Idle, "after Drain on IDLE")
        .await?;
    // Drained once: a Drain op is on record; a repeat may be an idempotent no-op.
    ctx.to_configured(&id, &mut s, "b203", &meta(&[])).await?;
    let (op, _) = ctx.drain_to_idle(&id, &mut s).await?;
    let r = ctx.drain(&id, 0, &s.mint()).await;
    match &r {
        Ok(ack) => ensure!(
            ack.operation_id == op,
            "Drain no-op on IDLE minted {} (original {op})",
            ack.operation_id
        ),
        Err(st) => ensure!(
            st.code() != Code::FailedPrecondition,
            "repeat Drain on IDLE: FAILED_PRECONDITION"
        ),
    }
    ctx.assert_stays(&id, S::Idle, "after repeat Drain on IDLE")
        .await?;
    Ok(Outcome::Pass)
}

pub async fn b204(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b204");
    let id = ctx.fresh1().await?;
    let r = ctx.delete(&id, &s.mint()).await;
    ensure!(
        code_of(&r) != Some(Code::FailedPrecondition),
        "Delete on SPECULATIVE: {}",
        describe(&r)
    );
    ctx.assert_stays(&id, S::Speculative, "after Delete on SPECULATIVE")
        .await?;
    let (id, _) = ctx.fresh_configured(&mut s, &meta(&[("k", "v")])).await?;
    let r = ctx.delete(&id, &s.mint()).await;
    if r.is_ok() {
        bail!("Delete on CONFIGURED was accepted");
    }
    ensure!(
        code_of(&r) != Some(Code::FailedPrecondition),
        "Delete on CONFIGURED: {}",
        describe(&r)
    );
    ctx.assert_stays(&id, S::Configured, "after Delete on CONFIGURED")
        .await?;
    Ok(Outcome::Pass)
}

/// Re-Create on IDLE and re-Configure on CONFIGURED: (changed-nothing, same-op) checks.
async fn noop_retries(
    ctx: &SharedCtx,
    label: &str,
) -> anyhow::Result<(Vec<(String, String)>, Vec<String>)> {
    let mut s = ctx.session(label);
    let mut ops = Vec::new();
    let mut changes = Vec::new();
    let (id, op) = ctx.fresh_idle(&mut s).await?;
    let before = ctx.get(&id).await?;
    let ack = expect_ok(ctx.create(&id, &s.mint()).await, "re-Create on IDLE")?;
    ops.push((op, ack.operation_id));
    let after = ctx.assert_stays(&id, S::Idle, "after re-Create").await?;
    if after != before {
        changes.push(format!(
            "re-Create changed the machine: {before:?} -> {after:?}"
        ));
    }
    let md = meta(&[("x", "1")]);
    let (op, _) = ctx.to_configured(&id, &mut s, "noop", &md).await?;
    let before = ctx.get(&id).await?;
    let ack = expect_ok(
        ctx.configure(&id, "noop", &md, &s.mint()).await,
        "re-Configure on CONFIGURED",
    )?;
    ops.push((op, ack.operation_id));
    let after = ctx
        .assert_stays(&id, S::Configured, "after re-Configure")
        .await?;
    if after != before {
        changes.push(format!(
            "re-Configure changed the machine: {before:?} -> {after:?}"
        ));
    }
    Ok((ops, changes))
}

pub async fn b205(ctx: SharedCtx) -> TestResult {
    let (_, changes) = noop_retries(&ctx, "b205").await?;
    ensure!(changes.is_empty(), "{}", changes.join("; "));
    Ok(Outcome::Pass)
}

pub async fn b206(ctx: SharedCtx) -> TestResult {
    let (ops, _) = noop_retries(&ctx, "b206").await?;
    for (orig, again) in ops {
        ensure!(!orig.is_empty(), "empty operation_id");
        ensure!(orig == again, "no-op minted {again}, original was {orig}");
    }
    Ok(Outcome::Pass)
}

pub async fn b207(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b207");
    for tok in [Token::none(), s.mint()] {
        let id = ctx.unknown_id("b207");
        expect_code(
            &ctx.create(&id, &tok).await,
            &[Code::NotFound],
            "Create(unknown)",
        )?;
        let t2 = if tok.shard.is_empty() {
            tok.clone()
        } else {
            s.mint()
        };
        expect_code(
            &ctx.configure(&id, "c", &meta(&[]), &t2).await,
            &[Code::NotFound],
            "Configure(unknown)",
        )?;
        let t3 = if tok.shard.is_empty() {
            tok.clone()
        } else {
            s.mint()
        };
        expect_code(
            &ctx.drain(&id, 0, &t3).await,
            &[Code::NotFound],
            "Drain(unknown)",
        )?;
        let g = ctx.c().get(MachineRef { id: id.clone() }).await;
        expect_code(
            &g,
            &[Code::NotFound],
            "Get after mutations on an unknown id (silent create?)",
        )?;
    }
    Ok(Outcome::Pass)
}

pub async fn b208(ctx: SharedCtx) -> TestResult {
    let t = Token::none();
    let ia = [Code::InvalidArgument];
    expect_code(
        &ctx.c().get(MachineRef { id: String::new() }).await,
        &ia,
        "Get(\"\")",
    )?;
    expect_code(&ctx.create("", &t).await, &ia, "Create(\"\")")?;
    expect_code(
        &ctx.configure("", "c", &meta(&[]), &t).await,
        &ia,
        "Configure(\"\")",
    )?;
    expect_code(&ctx.drain("", 0, &t).await, &ia, "Drain(\"\")")?;
    Ok(Outcome::Pass)
}

/// Configure with an oversized map: verbatim echo or INVALID_ARGUMENT with nothing applied.
pub async fn oversized_meta(
    ctx: &SharedCtx,
    label: &str,
    md: HashMap<String, String>,
) -> TestResult {
    let mut s = ctx.session(label);
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    let r = ctx.configure(&id, label, &md, &s.mint()).await;
    match r {
        Ok(ack) => {
            if let Some(m) = &ack.machine {
                if matches!(m.state(), S::Configuring | S::Configured) {
                    ensure!(
                        m.shard_metadata == md,
                        "ack snapshot metadata differs ({} of {} keys)",
                        m.shard_metadata.len(),
                        md.len()
                    );
                }
            }
            ctx.wait_for(&id, S::Configured).await?;
            let m = ctx.get(&id).await?;
            ensure!(
                m.shard_metadata == md,
                "metadata not verbatim: {} of {} keys",
                m.shard_metadata.len(),
                md.len()
            );
            let l = ctx.list(&[S::Configured], 0, &[]).await?;
            let lm = l.machines.iter().find(|x| x.id == id);
            ensure!(
                lm.map(|x| &x.shard_metadata) == Some(&md),
                "List(CONFIGURED) metadata not verbatim"
            );
            Ok(Outcome::PassWith(format!(
                "accepted whole ({} keys)",
                md.len()
            )))
        }
        Err(st) if st.code() == Code::InvalidArgument => {
            let m = ctx
                .assert_stays(&id, S::Idle, "after rejected oversized Configure")
                .await?;
            ensure!(
                m.cluster.is_empty() && m.shard_metadata.is_empty(),
                "partial transition: {m:?}"
            );
            Ok(Outcome::PassWith(format!(
                "rejected INVALID_ARGUMENT: {}",
                st.message()
            )))
        }
        Err(st) => bail!(
            "oversized metadata: expected OK or INVALID_ARGUMENT, got {:?}: {}",
            st.code(),
            st.message()
        ),
    }
}

pub async fn b209(ctx: SharedCtx) -> TestResult {
    let md: HashMap<String, String> = (0..1024)
        .map(|i| (format!("k{i:05}"), "v".repeat(256)))
        .collect();
    oversized_meta(&ctx, "b209", md).await
}

pub async fn b210(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b210");
    let (id, _) = ctx.fresh_configured(&mut s, &meta(&[])).await?;
    expect_code(
        &ctx.drain(&id, -1, &s.mint()).await,
        &[Code::InvalidArgument],
        "Drain(grace=-1)",
    )?;
    ctx.assert_stays(&id, S::Configured, "after negative-grace Drain")
        .await?;
    Ok(Outcome::Pass)
}

pub async fn b211(ctx: SharedCtx) -> TestResult {
    // Every token below is first contact for its (shard, machine): strict
    // (INVALID_ARGUMENT) or lenient (accepted) are both allowed, never
    // FAILED_PRECONDITION. The corrected spec asks for lenient, since
    // B1201/B1204 order negative values once a mark exists.
    let id = ctx.fresh1().await?;
    let tokens = [(-1, 1), (1, -1), (-5, -5), (i64::MIN, 1), (3, i64::MIN)];
    let not_fp = |r: &RpcResult<TransitionAck>, what: &str| -> anyhow::Result<()> {
        ensure!(
            code_of(r) != Some(Code::FailedPrecondition),
            "{what}: a first-contact negative token got FAILED_PRECONDITION: {}",
            describe(r)
        );
        Ok(())
    };
    for (e, q) in tokens {
        // Out of position on SPECULATIVE: rejected, but never as fencing.
        let t = Token::new(&ctx.session("b211").shard, e, q);
        not_fp(
            &ctx.configure(&id, "c", &meta(&[]), &t).await,
            &format!("Configure token ({e},{q})"),
        )?;
        let t = Token::new(&ctx.session("b211").shard, e, q);
        not_fp(
            &ctx.drain(&id, 0, &t).await,
            &format!("Drain token ({e},{q})"),
        )?;
        // Unknown machine: NOT_FOUND (lenient) or INVALID_ARGUMENT (strict).
        let t = Token::new(&ctx.session("b211").shard, e, q);
        expect_code(
            &ctx.create(&ctx.unknown_id("b211"), &t).await,
            &[Code::NotFound, Code::InvalidArgument],
            &format!("Create(unknown) token ({e},{q})"),
        )?;
    }
    ctx.assert_stays(&id, S::Speculative, "after out-of-position negative tokens")
        .await?;
    // A legal Create with a negative first-contact token.
    let s = ctx.session("b211");
    let r = ctx.create(&id, &Token::new(&s.shard, -2, -7)).await;
    match code_of(&r) {
        Some(Code::InvalidArgument) => {
            ctx.assert_stays(&id, S::Speculative, "after a strict rejection")
                .await?;
            Ok(Outcome::PassWith(
                "strict: negative tokens are INVALID_ARGUMENT".into(),
            ))
        }
        None => {
            ctx.wait_for(&id, S::Idle).await?;
            // Lenient: the token set the mark like any other.
            expect_fp(
                &ctx.create(&id, &Token::new(&s.shard, -2, -7)).await,
                "a replay of the accepted negative token",
            )?;
            expect_ok(
                ctx.create(&id, &Token::new(&s.shard, -2, -6)).await,
                "a newer negative token (idempotent Create on IDLE)",
            )?;
            Ok(Outcome::Pass)
        }
        _ => bail!(
            "Create with a first-contact negative token: {}",
            describe(&r)
        ),
    }
}

pub async fn b212(ctx: SharedCtx) -> TestResult {
    let s = ctx.session("b212");
    let id = ctx.fresh1().await?;
    let max = Token::new(&s.shard, i64::MAX, i64::MAX);
    expect_ok(
        ctx.create(&id, &max).await,
        "Create at (MAX,MAX) from a fresh shard",
    )?;
    expect_fp(
        &ctx.create(&id, &max).await,
        "replay of (MAX,MAX): mark not set",
    )?;
    expect_fp(
        &ctx.create(&id, &Token::new(&s.shard, i64::MAX, i64::MAX - 1))
            .await,
        "(MAX,MAX-1) after (MAX,MAX)",
    )?;
    expect_fp(
        &ctx.create(&id, &Token::new(&s.shard, 1, 1)).await,
        "(1,1) after (MAX,MAX) (overflow?)",
    )?;
    ctx.wait_for(&id, S::Idle).await?;
    Ok(Outcome::Pass)
}

pub async fn b213(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b213");
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    let mut req = configure_req(&id, "b213", &meta(&[]), &s.mint());
    req.bootstrap_blob = vec![b'x'; 3 * 1024 * 1024];
    match ctx.c().configure(req).await {
        Ok(_) => {
            ctx.wait_for(&id, S::Configured).await?;
            Ok(Outcome::PassWith("3 MiB blob accepted".into()))
        }
        Err(st) if st.code() == Code::InvalidArgument => {
            let m = ctx
                .assert_stays(&id, S::Idle, "after rejected blob")
                .await?;
            ensure!(
                m.cluster.is_empty(),
                "partial transition: cluster {:?}",
                m.cluster
            );
            Ok(Outcome::PassWith(format!(
                "rejected INVALID_ARGUMENT: {}",
                st.message()
            )))
        }
        Err(st) => bail!(
            "oversized blob: expected OK or INVALID_ARGUMENT, got {:?}: {}",
            st.code(),
            st.message()
        ),
    }
}

pub async fn b214(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b214");
    let id = ctx.fresh1().await?;
    let mut ops = vec![ctx.to_idle(&id, &mut s).await?.0];
    ops.push(ctx.to_configured(&id, &mut s, "b214", &meta(&[])).await?.0);
    ops.push(ctx.drain_to_idle(&id, &mut s).await?.0);
    ops.push(ctx.to_configured(&id, &mut s, "b214", &meta(&[])).await?.0);
    ops.push(ctx.drain_to_idle(&id, &mut s).await?.0);
    if ctx.caps.delete {
        ops.push(ctx.delete_to_spec(&id, &mut s).await?.0);
        ops.push(ctx.to_idle(&id, &mut s).await?.0);
    }
    let mut seen = std::collections::HashSet::new();
    for op in &ops {
        ensure!(!op.is_empty(), "empty operation_id");
        ensure!(
            seen.insert(op.clone()),
            "operation_id {op} reused across distinct transitions: {ops:?}"
        );
    }
    Ok(Outcome::Pass)
}

pub async fn b215(ctx: SharedCtx) -> TestResult {
    let g = ctx
        .c()
        .get(MachineRef {
            id: ctx.unknown_id("b215"),
        })
        .await;
    expect_code(&g, &[Code::NotFound], "Get(unknown)")?;
    let d = ctx.delete(&ctx.unknown_id("b215"), &Token::none()).await;
    expect_code(
        &d,
        &[Code::NotFound, Code::Unimplemented],
        "Delete(unknown)",
    )?;
    Ok(Outcome::Pass)
}
