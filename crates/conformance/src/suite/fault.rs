//! Timeouts & failure (B701–B708), run against the fault-injecting provider
//! (`src/bin/fault-provider.rs`), steered over its line-based control endpoint.

use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context as _};
use bigfleet_proto::v1alpha1::MachineState as S;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::harness::{
    expect_ok, expect_rejected_not_fp, fmt_states, meta, wait_for_state, Outcome, ShardSession,
    SharedCtx, TestResult, Trace,
};

/// Sends one control command (`SET <id> <op> <mode> [ms]` or `READY <id>`) and expects `OK`.
pub async fn control(addr: &str, cmd: &str) -> anyhow::Result<()> {
    let mut s = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to fault control {addr}"))?;
    s.write_all(format!("{cmd}\n").as_bytes()).await?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).await?;
    ensure!(
        line.trim() == "OK",
        "fault control refused {cmd:?}: {line:?}"
    );
    Ok(())
}

fn ctl(ctx: &SharedCtx) -> anyhow::Result<String> {
    ctx.fault_control
        .clone()
        .ok_or_else(|| anyhow!("fault lane context has no control endpoint"))
}

async fn wait_failed(ctx: &SharedCtx, id: &str, budget: Duration) -> anyhow::Result<Trace> {
    wait_for_state(&ctx.client, id, S::Failed, budget, ctx.timing.poll).await
}

fn failed_budget(ctx: &SharedCtx) -> Duration {
    ctx.timing.configure + Duration::from_secs(5)
}

/// A fresh IDLE machine with `op` set to fail in `mode`.
async fn idle_with_fault(
    ctx: &SharedCtx,
    label: &str,
    op: &str,
    mode: &str,
) -> anyhow::Result<(String, ShardSession)> {
    let mut s = ctx.session(label);
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    control(&ctl(ctx)?, &format!("SET {id} {op} {mode}")).await?;
    Ok((id, s))
}

pub async fn b701(ctx: SharedCtx) -> TestResult {
    let (id, mut s) = idle_with_fault(&ctx, "b701", "configure", "error").await?;
    expect_ok(
        ctx.configure(&id, "b701", &meta(&[]), &s.mint()).await,
        "Configure",
    )?;
    let tr = wait_failed(&ctx, &id, failed_budget(&ctx)).await?;
    let m = tr.last().cloned().unwrap_or_default();
    ensure!(!m.last_error.is_empty(), "FAILED with an empty last_error");
    let after = ctx.observe(&id, ctx.timing.stability).await?;
    ensure!(
        after.states() == [S::Failed],
        "lingering after failure: {}",
        fmt_states(&after.states())
    );
    Ok(Outcome::Pass)
}

pub async fn b702(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b702");
    let id = ctx.fresh1().await?;
    control(&ctl(&ctx)?, &format!("SET {id} create error")).await?;
    expect_ok(ctx.create(&id, &s.mint()).await, "Create")?;
    let tr = wait_failed(&ctx, &id, failed_budget(&ctx)).await?;
    ensure!(
        !tr.last().map(|m| m.last_error.is_empty()).unwrap_or(true),
        "FAILED with an empty last_error"
    );
    Ok(Outcome::Pass)
}

pub fn timeout_shaped(e: &str) -> bool {
    let l = e.to_ascii_lowercase();
    ["timeout", "timed out", "deadline"]
        .iter()
        .any(|w| l.contains(w))
}

pub async fn b703(ctx: SharedCtx) -> TestResult {
    let (id, mut s) = idle_with_fault(&ctx, "b703", "configure", "hang").await?;
    expect_ok(
        ctx.configure(&id, "b703", &meta(&[]), &s.mint()).await,
        "Configure",
    )?;
    let tr = wait_failed(&ctx, &id, failed_budget(&ctx)).await?;
    let st = tr.states();
    ensure!(
        !st.contains(&S::Idle) && !st.contains(&S::Configured),
        "silent revert/advance: {}",
        fmt_states(&st)
    );
    let e = tr.last().map(|m| m.last_error.clone()).unwrap_or_default();
    ensure!(
        timeout_shaped(&e),
        "last_error is not timeout-shaped: {e:?}"
    );
    Ok(Outcome::Pass)
}

pub async fn b704(ctx: SharedCtx) -> TestResult {
    let late = ctx.timing.configure.as_millis() as u64 + 1500;
    let (id, mut s) = idle_with_fault(&ctx, "b704", "configure", &format!("late {late}")).await?;
    let start = std::time::Instant::now();
    expect_ok(
        ctx.configure(&id, "b704", &meta(&[]), &s.mint()).await,
        "Configure",
    )?;
    let tr = wait_failed(&ctx, &id, failed_budget(&ctx)).await?;
    let err = tr.last().map(|m| m.last_error.clone()).unwrap_or_default();
    // Watch past the late completion.
    let remaining = Duration::from_millis(late + 1000).saturating_sub(start.elapsed());
    let after = ctx
        .observe(&id, remaining.max(ctx.timing.stability))
        .await?;
    ensure!(
        after.states() == [S::Failed],
        "late completion was applied: {}",
        fmt_states(&after.states())
    );
    ensure!(
        after.snapshots.iter().all(|m| m.last_error == err),
        "last_error changed after the late completion"
    );
    Ok(Outcome::Pass)
}

async fn failed_machine(
    ctx: &SharedCtx,
    label: &str,
) -> anyhow::Result<(String, ShardSession, String)> {
    let (id, mut s) = idle_with_fault(ctx, label, "configure", "error").await?;
    expect_ok(
        ctx.configure(&id, label, &meta(&[]), &s.mint()).await,
        "Configure",
    )?;
    let tr = wait_failed(ctx, &id, failed_budget(ctx)).await?;
    let err = tr.last().map(|m| m.last_error.clone()).unwrap_or_default();
    ensure!(!err.is_empty(), "FAILED with an empty last_error");
    Ok((id, s, err))
}

pub async fn b705(ctx: SharedCtx) -> TestResult {
    let (id, mut s, err) = failed_machine(&ctx, "b705").await?;
    expect_rejected_not_fp(&ctx.create(&id, &s.mint()).await, "Create on FAILED")?;
    expect_rejected_not_fp(
        &ctx.configure(&id, "b705", &meta(&[]), &s.mint()).await,
        "Configure on FAILED",
    )?;
    expect_rejected_not_fp(&ctx.drain(&id, 0, &s.mint()).await, "Drain on FAILED")?;
    let d = ctx.delete(&id, &s.mint()).await;
    if ctx.caps.delete {
        expect_rejected_not_fp(&d, "Delete on FAILED")?;
    }
    let m = ctx
        .assert_stays(&id, S::Failed, "after mutations on FAILED")
        .await?;
    ensure!(
        m.last_error == err,
        "last_error changed: {:?} -> {:?}",
        err,
        m.last_error
    );
    Ok(Outcome::Pass)
}

pub async fn b706(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b706");
    let (id, _) = ctx.fresh_configured(&mut s, &meta(&[])).await?;
    control(&ctl(&ctx)?, &format!("SET {id} drain error")).await?;
    expect_ok(ctx.drain(&id, 0, &s.mint()).await, "Drain(grace=0)")?;
    let deadline = std::time::Instant::now() + ctx.timing.drain + Duration::from_secs(5);
    loop {
        let m = ctx.get(&id).await?;
        match m.state() {
            S::Idle => return Ok(Outcome::PassWith("ended IDLE".into())),
            S::Failed => {
                ensure!(!m.last_error.is_empty(), "FAILED with an empty last_error");
                return Ok(Outcome::PassWith("ended FAILED with last_error".into()));
            }
            S::Draining | S::Configured if std::time::Instant::now() < deadline => {}
            other => bail!("Drain against a failing actuator ended in {other:?}"),
        }
        tokio::time::sleep(ctx.timing.poll).await;
    }
}

pub async fn b707(ctx: SharedCtx) -> TestResult {
    let (id, _, err) = failed_machine(&ctx, "b707").await?;
    for i in 0..3 {
        let m = ctx.get(&id).await?;
        ensure!(
            m.state() == S::Failed && m.last_error == err,
            "Get #{i}: {:?} {:?}",
            m.state(),
            m.last_error
        );
        for filter in [vec![S::Failed], vec![]] {
            let l = ctx.list(&filter, 0, &[]).await?;
            let lm = l
                .machines
                .iter()
                .find(|x| x.id == id)
                .ok_or_else(|| anyhow!("List({filter:?}) misses FAILED {id}"))?;
            ensure!(
                lm.last_error == err,
                "List last_error {:?}, Get said {:?}",
                lm.last_error,
                err
            );
        }
    }
    Ok(Outcome::Pass)
}

pub async fn b708(ctx: SharedCtx) -> TestResult {
    // Readiness held until released over the control channel.
    let (id, mut s) = idle_with_fault(&ctx, "b708", "ready", "hold").await?;
    expect_ok(
        ctx.configure(&id, "b708", &meta(&[]), &s.mint()).await,
        "Configure",
    )?;
    wait_for_state(
        &ctx.client,
        &id,
        S::Configuring,
        Duration::from_secs(2),
        ctx.timing.poll,
    )
    .await?;
    let held = ctx.observe(&id, Duration::from_millis(700)).await?;
    ensure!(
        held.states() == [S::Configuring],
        "not held in CONFIGURING before Ready: {}",
        fmt_states(&held.states())
    );
    control(&ctl(&ctx)?, &format!("READY {id}")).await?;
    ctx.wait_for(&id, S::Configured).await?;
    // Readiness never arrives: FAILED with last_error within the Configure timeout.
    let (id2, mut s2) = idle_with_fault(&ctx, "b708n", "ready", "never").await?;
    expect_ok(
        ctx.configure(&id2, "b708", &meta(&[]), &s2.mint()).await,
        "Configure",
    )?;
    let tr = wait_failed(&ctx, &id2, failed_budget(&ctx)).await?;
    ensure!(
        !tr.states().contains(&S::Configured),
        "reached CONFIGURED without readiness: {}",
        fmt_states(&tr.states())
    );
    ensure!(
        !tr.last().map(|m| m.last_error.is_empty()).unwrap_or(true),
        "FAILED with an empty last_error"
    );
    Ok(Outcome::Pass)
}
