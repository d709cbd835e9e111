//! Lifecycle & state machine (B101–B109).

use anyhow::{bail, ensure};
use bigfleet_proto::v1alpha1::MachineState as S;

use crate::harness::{fmt_states, is_transitional, meta, Outcome, SharedCtx, TestResult, Trace};

fn transitional_only(tr: &Trace, allowed: S, what: &str) -> anyhow::Result<()> {
    for st in tr.states() {
        if is_transitional(st) && st != allowed {
            bail!(
                "{what}: observed {:?}; trace {}",
                st,
                fmt_states(&tr.states())
            );
        }
        if st == S::Failed {
            bail!(
                "{what}: observed FAILED; trace {}",
                fmt_states(&tr.states())
            );
        }
    }
    Ok(())
}

fn idle_clean(m: &bigfleet_proto::v1alpha1::Machine, what: &str) -> anyhow::Result<()> {
    ensure!(
        m.state() == S::Idle,
        "{what}: {} is {:?}, not IDLE",
        m.id,
        m.state()
    );
    ensure!(
        m.cluster.is_empty(),
        "{what}: cluster {:?} left at IDLE",
        m.cluster
    );
    ensure!(
        m.shard_metadata.is_empty(),
        "{what}: shard_metadata {:?} left at IDLE",
        m.shard_metadata
    );
    ensure!(
        m.last_error.is_empty(),
        "{what}: last_error {:?} at IDLE",
        m.last_error
    );
    Ok(())
}

pub async fn b101(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b101");
    if !ctx.caps.delete {
        // Without Delete a machine cannot return to SPECULATIVE; use four machines instead.
        let ids = ctx.fresh(4).await?;
        for (i, id) in ids.iter().enumerate() {
            ctx.to_idle(id, &mut s).await?;
            idle_clean(&ctx.get(id).await?, &format!("round {i} after Create"))?;
            ctx.to_configured(id, &mut s, "b101", &meta(&[("round", &i.to_string())]))
                .await?;
            ctx.drain_to_idle(id, &mut s).await?;
            idle_clean(&ctx.get(id).await?, &format!("round {i} after Drain"))?;
        }
        return Ok(Outcome::PassWith(
            "Delete unsupported: four machines, one round-trip each".into(),
        ));
    }
    let id = ctx.fresh1().await?;
    for i in 0..4 {
        ctx.to_idle(&id, &mut s).await?;
        idle_clean(&ctx.get(&id).await?, &format!("round {i} after Create"))?;
        ctx.to_configured(
            &id,
            &mut s,
            &format!("b101-{i}"),
            &meta(&[("round", &i.to_string())]),
        )
        .await?;
        ctx.drain_to_idle(&id, &mut s).await?;
        idle_clean(&ctx.get(&id).await?, &format!("round {i} after Drain"))?;
        ctx.delete_to_spec(&id, &mut s).await?;
    }
    Ok(Outcome::Pass)
}

pub async fn b103(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b103");
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    let (_, tr) = ctx
        .to_configured(&id, &mut s, "b103", &meta(&[("a", "b")]))
        .await?;
    transitional_only(&tr, S::Configuring, "mid-Configure")?;
    ctx.assert_stays(&id, S::Configured, "after Configure")
        .await?;
    Ok(Outcome::Pass)
}

pub async fn b104(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b104");
    let (id, _) = ctx.fresh_configured(&mut s, &meta(&[])).await?;
    let (_, tr) = ctx.drain_to_idle(&id, &mut s).await?;
    transitional_only(&tr, S::Draining, "mid-Drain")?;
    ctx.assert_stays(&id, S::Idle, "after Drain").await?;
    Ok(Outcome::Pass)
}

/// Legal steps of a de-duplicated trace: along an edge, possibly missing the transitional state.
pub fn legal_step(a: S, b: S) -> bool {
    matches!(
        (a, b),
        (S::Speculative, S::Creating)
            | (S::Speculative, S::Idle)
            | (S::Creating, S::Idle)
            | (S::Idle, S::Configuring)
            | (S::Idle, S::Configured)
            | (S::Configuring, S::Configured)
            | (S::Configured, S::Draining)
            | (S::Configured, S::Idle)
            | (S::Draining, S::Idle)
            | (S::Idle, S::Deleting)
            | (S::Idle, S::Speculative)
            | (S::Deleting, S::Speculative)
    )
}

pub fn check_walk(states: &[S]) -> anyhow::Result<()> {
    for w in states.windows(2) {
        if !legal_step(w[0], w[1]) {
            bail!(
                "illegal step {:?}→{:?} in trace {}",
                w[0],
                w[1],
                fmt_states(states)
            );
        }
    }
    Ok(())
}

pub async fn b105(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b105");
    let id = ctx.fresh1().await?;
    let mut tr = Trace::default();
    tr.push(ctx.get(&id).await?);
    tr.extend(ctx.to_idle(&id, &mut s).await?.1);
    tr.extend(ctx.to_configured(&id, &mut s, "b105", &meta(&[])).await?.1);
    tr.extend(ctx.drain_to_idle(&id, &mut s).await?.1);
    let st = tr.states();
    ensure!(
        st.first() == Some(&S::Speculative),
        "trace does not start SPECULATIVE: {}",
        fmt_states(&st)
    );
    ensure!(
        st.last() == Some(&S::Idle),
        "trace does not end IDLE: {}",
        fmt_states(&st)
    );
    check_walk(&st)?;
    Ok(Outcome::Pass)
}

pub async fn b106(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b106");
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    let (_, tr) = ctx
        .to_configured(&id, &mut s, "b106-cluster", &meta(&[]))
        .await?;
    for m in &tr.snapshots {
        if matches!(m.state(), S::Configuring | S::Configured) {
            ensure!(
                m.cluster == "b106-cluster",
                "cluster {:?} while {:?}",
                m.cluster,
                m.state()
            );
        }
    }
    let (_, tr) = ctx.drain_to_idle(&id, &mut s).await?;
    let last = tr.last().cloned().unwrap_or_default();
    ensure!(
        last.cluster.is_empty(),
        "cluster {:?} once Drain settled",
        last.cluster
    );
    ensure!(
        ctx.get(&id).await?.cluster.is_empty(),
        "cluster set on a later Get after Drain"
    );
    Ok(Outcome::Pass)
}

pub fn host_rule(m: &bigfleet_proto::v1alpha1::Machine) -> anyhow::Result<()> {
    match m.state() {
        S::Speculative => ensure!(
            m.host.is_none(),
            "SPECULATIVE {} has host {:?}",
            m.id,
            m.host
        ),
        S::Idle | S::Configured => {
            ensure!(m.host.is_some(), "{:?} {} has no host", m.state(), m.id)
        }
        _ => {}
    }
    Ok(())
}

pub async fn b107(ctx: SharedCtx) -> TestResult {
    for m in ctx.list_all().await?.machines {
        host_rule(&m)?;
    }
    let mut s = ctx.session("b107");
    let id = ctx.fresh1().await?;
    host_rule(&ctx.get(&id).await?)?;
    ctx.to_idle(&id, &mut s).await?;
    for _ in 0..5 {
        let m = ctx.get(&id).await?;
        ensure!(m.state() == S::Idle, "settled Get showed {:?}", m.state());
        host_rule(&m)?;
    }
    ctx.to_configured(&id, &mut s, "b107", &meta(&[])).await?;
    for _ in 0..5 {
        let m = ctx.get(&id).await?;
        ensure!(
            m.state() == S::Configured,
            "settled Get showed {:?}",
            m.state()
        );
        host_rule(&m)?;
    }
    Ok(Outcome::Pass)
}

pub async fn b108(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b108");
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    ctx.assert_stays(&id, S::Idle, "after Create settled")
        .await?;
    ctx.to_configured(&id, &mut s, "b108", &meta(&[])).await?;
    ctx.assert_stays(&id, S::Configured, "after Configure settled")
        .await?;
    ctx.drain_to_idle(&id, &mut s).await?;
    ctx.assert_stays(&id, S::Idle, "after Drain settled")
        .await?;
    Ok(Outcome::Pass)
}

pub async fn b109(ctx: SharedCtx) -> TestResult {
    if !ctx.caps.delete {
        return Ok(Outcome::Skip("Delete unsupported (UNIMPLEMENTED)".into()));
    }
    let mut s = ctx.session("b109");
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    let (_, tr) = ctx.delete_to_spec(&id, &mut s).await?;
    transitional_only(&tr, S::Deleting, "mid-Delete")?;
    ctx.assert_stays(&id, S::Speculative, "after Delete")
        .await?;
    Ok(Outcome::Pass)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_accepts_legal_edges_and_missed_transitionals() {
        check_walk(&[
            S::Speculative,
            S::Creating,
            S::Idle,
            S::Configuring,
            S::Configured,
            S::Draining,
            S::Idle,
        ])
        .unwrap();
        check_walk(&[
            S::Speculative,
            S::Idle,
            S::Configured,
            S::Idle,
            S::Speculative,
        ])
        .unwrap();
    }

    #[test]
    fn walk_rejects_skipped_stable_states_and_reverts() {
        assert!(check_walk(&[S::Speculative, S::Configured]).is_err());
        assert!(check_walk(&[S::Creating, S::Speculative]).is_err());
        assert!(check_walk(&[S::Configuring, S::Idle]).is_err());
        assert!(check_walk(&[S::Idle, S::Failed]).is_err());
    }
}
