//! Property / fuzz (B1201–B1205), seeded and replayable with `--seed`.

use std::collections::{HashMap, HashSet};

use anyhow::{bail, ensure};
use bigfleet_proto::v1alpha1::{MachineRef, MachineState as S};
use rand::seq::IndexedRandom;
use rand::Rng;
use tonic::Code;

use crate::harness::{
    code_of, configure_req, describe, expect_code, expect_ok, expect_rejected_not_fp, meta,
    Outcome, RpcResult, SharedCtx, TestResult, Token,
};

pub async fn b1201(ctx: SharedCtx) -> TestResult {
    let id = ctx.fresh1().await?;
    let mut rng = ctx.rng("B1201");
    for round in 0..4 {
        let s = ctx.session(&format!("b1201-{round}"));
        let n = rng.random_range(10..40);
        crate::suite::fencing::token_stream_oracle(&ctx, &id, &s.shard, &mut rng, n).await?;
    }
    Ok(Outcome::Pass)
}

fn random_utf8(rng: &mut impl Rng, max: usize) -> String {
    let n = rng.random_range(0..=max);
    (0..n)
        .map(|_| match rng.random_range(0..4) {
            0 => rng.random_range(0u32..0x20),
            1 => rng.random_range(0x20u32..0x7f),
            2 => rng.random_range(0x80u32..0xd800),
            _ => rng.random_range(0x1_0000u32..0x10_ffff),
        })
        .filter_map(char::from_u32)
        .collect()
}

pub async fn b1202(ctx: SharedCtx) -> TestResult {
    let mut rng = ctx.rng("B1202");
    let mut s = ctx.session("b1202");
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    for round in 0..4 {
        let n = rng.random_range(0..30);
        let md: HashMap<String, String> = (0..n)
            .map(|_| (random_utf8(&mut rng, 24), random_utf8(&mut rng, 64)))
            .collect();
        ctx.to_configured(&id, &mut s, &format!("b1202-{round}"), &md)
            .await?;
        let m = ctx.get(&id).await?;
        ensure!(
            m.shard_metadata == md,
            "round {round}: random map ({} keys) did not round-trip",
            md.len()
        );
        ctx.drain_to_idle(&id, &mut s).await?;
    }
    Ok(Outcome::Pass)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Create,
    Configure,
    Drain,
    Delete,
}

pub async fn b1203(ctx: SharedCtx) -> TestResult {
    let mut rng = ctx.rng("B1203");
    let mut s = ctx.session("b1203");
    let id = ctx.fresh1().await?;
    let mut ops = vec![Op::Create, Op::Configure, Op::Drain];
    if ctx.caps.delete {
        ops.push(Op::Delete);
    }
    let mut state = S::Speculative;
    // Kinds applied at least once: repeating one while at its target may be an idempotent no-op.
    let mut applied: HashSet<String> = HashSet::new();
    for step in 0..16 {
        let op = *ops.choose(&mut rng).unwrap_or(&Op::Create);
        let legal = matches!(
            (op, state),
            (Op::Create, S::Speculative)
                | (Op::Configure, S::Idle)
                | (Op::Drain, S::Configured)
                | (Op::Delete, S::Idle)
        );
        let target = match op {
            Op::Create | Op::Drain => S::Idle,
            Op::Configure => S::Configured,
            Op::Delete => S::Speculative,
        };
        let noop_ok = applied.contains(&format!("{op:?}")) && target == state;
        let t = s.mint();
        let r = match op {
            Op::Create => ctx.create(&id, &t).await,
            Op::Configure => {
                ctx.configure(&id, "b1203", &meta(&[("step", &step.to_string())]), &t)
                    .await
            }
            Op::Drain => ctx.drain(&id, 0, &t).await,
            Op::Delete => ctx.delete(&id, &t).await,
        };
        let what = format!("step {step}: {op:?} on {state:?}");
        if legal {
            expect_ok(r, &what)?;
            state = target;
            ctx.wait_for(&id, state).await?;
            applied.insert(format!("{op:?}"));
        } else if noop_ok && r.is_ok() {
            ctx.assert_stays(&id, state, &format!("{what} (idempotent no-op)"))
                .await?;
        } else {
            expect_rejected_not_fp(&r, &what)?;
            let m = ctx.get(&id).await?;
            ensure!(
                m.state() == state,
                "{what}: rejected call moved the machine to {:?}",
                m.state()
            );
        }
    }
    Ok(Outcome::Pass)
}

pub async fn b1204(ctx: SharedCtx) -> TestResult {
    let mut rng = ctx.rng("B1204");
    let mut ids = ctx.fresh(2).await?;
    ids.push(ctx.unknown_id("b1204"));
    let shards: Vec<String> = (0..3)
        .map(|i| ctx.session(&format!("b1204-{i}")).shard)
        .collect();
    let mut marks: HashMap<(usize, usize), (i64, i64)> = HashMap::new();
    let mut seen_codes = HashSet::new();
    for step in 0..80 {
        let si = rng.random_range(0..shards.len());
        let mi = rng.random_range(0..ids.len());
        let tok = (
            crate::suite::fencing::random_signed(&mut rng),
            crate::suite::fencing::random_signed(&mut rng),
        );
        let want_pass = marks.get(&(si, mi)).is_none_or(|m| tok > *m);
        let t = Token::new(&shards[si], tok.0, tok.1);
        let id = &ids[mi];
        let r = match rng.random_range(0..3) {
            0 => ctx.create(id, &t).await,
            1 => ctx.configure(id, "b1204", &meta(&[]), &t).await,
            _ => ctx.drain(id, 0, &t).await,
        };
        let fp = code_of(&r) == Some(Code::FailedPrecondition);
        if fp == want_pass {
            bail!("step {step}: shard {si} machine {mi} token {tok:?} mark {:?}: expected fenced={}, got {}", marks.get(&(si, mi)), !want_pass, describe(&r));
        }
        if let Some(c) = code_of(&r) {
            seen_codes.insert(format!("{c:?}"));
        }
        if want_pass {
            marks.insert((si, mi), tok);
        }
    }
    Ok(Outcome::PassWith(format!("codes seen: {seen_codes:?}")))
}

pub async fn b1205(ctx: SharedCtx) -> TestResult {
    let mut rng = ctx.rng("B1205");
    let s = ctx.session("b1205");
    for step in 0..60 {
        let shape = rng.random_range(0..8);
        let unknown = ctx.unknown_id("b1205");
        let tok = Token::new(&s.shard, 1, step + 1);
        let (what, r, allowed): (&str, RpcResult<()>, &[Code]) = match shape {
            0 => (
                "Get(\"\")",
                ctx.c()
                    .get(MachineRef { id: String::new() })
                    .await
                    .map(|_| ()),
                &[Code::InvalidArgument],
            ),
            1 => (
                "Create(\"\")",
                ctx.create("", &tok).await.map(|_| ()),
                &[Code::InvalidArgument],
            ),
            2 => (
                "Get(unknown)",
                ctx.c().get(MachineRef { id: unknown }).await.map(|_| ()),
                &[Code::NotFound],
            ),
            3 => (
                "Delete(unknown)",
                ctx.delete(&unknown, &tok).await.map(|_| ()),
                &[Code::NotFound, Code::Unimplemented],
            ),
            4 => (
                "Drain(unknown, grace<0)",
                ctx.drain(&unknown, -rng.random_range(1..1000), &tok)
                    .await
                    .map(|_| ()),
                &[Code::InvalidArgument, Code::NotFound],
            ),
            5 => {
                let mut req = configure_req(&unknown, "c", &meta(&[]), &tok);
                req.bootstrap_blob = vec![0u8; 2 * 1024 * 1024];
                (
                    "Configure(unknown, 2MiB blob)",
                    ctx.c().configure(req).await.map(|_| ()),
                    &[Code::InvalidArgument, Code::NotFound],
                )
            }
            6 => {
                // First contact: a negative token is accepted (lenient) or
                // INVALID_ARGUMENT (strict); the machine is unknown either way.
                let bad = Token::new(&s.shard, -rng.random_range(1..i64::MAX), 1);
                (
                    "Create(unknown, negative epoch)",
                    ctx.create(&unknown, &bad).await.map(|_| ()),
                    &[Code::InvalidArgument, Code::NotFound],
                )
            }
            _ => {
                let bad = Token::new(&s.shard, 1, -rng.random_range(1..i64::MAX));
                (
                    "Drain(\"\", negative sequence)",
                    ctx.drain("", 0, &bad).await.map(|_| ()),
                    &[Code::InvalidArgument],
                )
            }
        };
        expect_code(&r, allowed, &format!("step {step}: {what}"))?;
    }
    Ok(Outcome::Pass)
}
