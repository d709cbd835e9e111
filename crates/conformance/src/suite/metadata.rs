//! Metadata (B501–B505).

use std::collections::HashMap;

use anyhow::ensure;
use bigfleet_proto::v1alpha1::MachineState as S;

use crate::harness::{configure_req, expect_ok, meta, Outcome, SharedCtx, TestResult};

/// 55 keys: NUL, control bytes, unicode, empty values, unknown-looking keys.
pub fn tricky_map() -> HashMap<String, String> {
    let mut m = HashMap::new();
    m.insert("nul\u{0}key".into(), "v\u{0}al\u{0}".into());
    m.insert("ctrl".into(), "\u{1}\u{2}\u{7}\u{1b}[0m\t\r\n\u{7f}".into());
    m.insert(
        "unicode-ключ-鍵-🔑".into(),
        "значение 值 ✓ \u{200d}\u{feff} é".into(),
    );
    m.insert("empty".into(), String::new());
    m.insert(String::new(), "empty-key".into());
    m.insert("  spaced  ".into(), "  ".into());
    m.insert(
        "bigfleet.io/unknown-key".into(),
        "{\"json\": [1,2,3]}".into(),
    );
    for i in 0..48 {
        m.insert(
            format!("k{i:02}"),
            if i % 3 == 0 {
                String::new()
            } else {
                format!("v{i}\u{0}\u{1f}")
            },
        );
    }
    m
}

pub async fn b501(ctx: SharedCtx) -> TestResult {
    let md = tricky_map();
    ensure!(md.len() == 55, "fixture has {} keys", md.len());
    let mut s = ctx.session("b501");
    let (id, _) = ctx.fresh_configured(&mut s, &md).await?;
    for i in 0..3 {
        let m = ctx.get(&id).await?;
        ensure!(
            m.shard_metadata == md,
            "Get #{i}: metadata differs: {:?}",
            diff(&md, &m.shard_metadata)
        );
        let l = ctx.list(&[S::Configured], 0, &[]).await?;
        let lm = l.machines.into_iter().find(|x| x.id == id);
        let lmd = lm.map(|x| x.shard_metadata).unwrap_or_default();
        ensure!(
            lmd == md,
            "List(CONFIGURED) #{i}: metadata differs: {:?}",
            diff(&md, &lmd)
        );
    }
    Ok(Outcome::Pass)
}

fn diff(want: &HashMap<String, String>, got: &HashMap<String, String>) -> Vec<String> {
    let mut out = Vec::new();
    for (k, v) in want {
        match got.get(k) {
            None => out.push(format!("missing {k:?}")),
            Some(g) if g != v => out.push(format!("{k:?}: {v:?} != {g:?}")),
            _ => {}
        }
    }
    for k in got.keys() {
        if !want.contains_key(k) {
            out.push(format!("extra {k:?}"));
        }
    }
    out.truncate(5);
    out
}

pub async fn b502(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b502");
    let m1 = meta(&[("old-a", "1"), ("old-b", "2")]);
    let (id, _) = ctx.fresh_configured(&mut s, &m1).await?;
    ctx.drain_to_idle(&id, &mut s).await?;
    let m = ctx.get(&id).await?;
    ensure!(
        m.shard_metadata.is_empty() && m.cluster.is_empty(),
        "not cleared at IDLE: {:?} {:?}",
        m.cluster,
        m.shard_metadata
    );
    let m2 = meta(&[("new-c", "3")]);
    ctx.to_configured(&id, &mut s, "b502-second", &m2).await?;
    let m = ctx.get(&id).await?;
    ensure!(
        m.shard_metadata == m2,
        "second Configure metadata {:?}, want exactly {:?}",
        m.shard_metadata,
        m2
    );
    ensure!(m.cluster == "b502-second", "cluster {:?}", m.cluster);
    Ok(Outcome::Pass)
}

pub async fn b503(ctx: SharedCtx) -> TestResult {
    let md: HashMap<String, String> = (0..6000)
        .map(|i| {
            (
                format!("bigfleet.io/many-{i:05}"),
                format!("{i}-{}", "z".repeat(i % 40)),
            )
        })
        .collect();
    crate::suite::matrix::oversized_meta(&ctx, "b503", md).await
}

pub async fn b504(ctx: SharedCtx) -> TestResult {
    let md = tricky_map();
    let mut s = ctx.session("b504");
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    let (_, tr) = ctx.to_configured(&id, &mut s, "b504", &md).await?;
    let mut saw_window = false;
    for m in &tr.snapshots {
        if matches!(m.state(), S::Configuring | S::Configured) {
            saw_window |= m.state() == S::Configuring;
            ensure!(
                m.shard_metadata == md,
                "{:?} snapshot metadata differs: {:?}",
                m.state(),
                diff(&md, &m.shard_metadata)
            );
        }
    }
    if saw_window {
        Ok(Outcome::Pass)
    } else {
        Ok(Outcome::PassWith(
            "no CONFIGURING window observed; verbatim once CONFIGURED".into(),
        ))
    }
}

pub async fn b505(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b505");
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    let mut md = meta(&[("stable", "1"), ("mutate-me", "before")]);
    let sent = md.clone();
    let mut req = configure_req(&id, "b505", &md, &s.mint());
    let ack = expect_ok(
        ctx.c().configure(req.clone()).await.map(|r| r.into_inner()),
        "Configure",
    )?;
    md.insert("mutate-me".into(), "after".into());
    md.insert("added".into(), "x".into());
    req.shard_metadata = md;
    drop(req);
    ensure!(!ack.operation_id.is_empty(), "empty operation_id");
    ctx.wait_for(&id, S::Configured).await?;
    let m = ctx.get(&id).await?;
    ensure!(
        m.shard_metadata == sent,
        "stored copy changed: {:?}",
        m.shard_metadata
    );
    Ok(Outcome::Pass)
}
