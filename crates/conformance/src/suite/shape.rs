//! Field shape & cost (B801–B807).

use anyhow::ensure;
use bigfleet_proto::v1alpha1::{CapacityType, Machine, MachineState as S};

use crate::harness::{is_stable, meta, Outcome, SharedCtx, TestResult};

const HIDDEN_LABEL_KEYS: &[&str] = &[
    "instance_type",
    "instance-type",
    "instancetype",
    "node.kubernetes.io/instance-type",
    "beta.kubernetes.io/instance-type",
    "zone",
    "topology.kubernetes.io/zone",
    "failure-domain.beta.kubernetes.io/zone",
    "capacity_type",
    "capacity-type",
    "capacitytype",
    "karpenter.sh/capacity-type",
];

pub fn field_shape(m: &Machine) -> anyhow::Result<()> {
    ensure!(m.state() != S::Unspecified, "{}: state UNSPECIFIED", m.id);
    ensure!(!m.instance_type.is_empty(), "{}: empty instance_type", m.id);
    for k in m.labels.keys() {
        let lk = k.to_ascii_lowercase();
        ensure!(
            !HIDDEN_LABEL_KEYS.contains(&lk.as_str()),
            "{}: label {k:?} hides a top-level field",
            m.id
        );
    }
    Ok(())
}

pub async fn b801(ctx: SharedCtx) -> TestResult {
    let l = ctx.list_all().await?;
    ensure!(!l.machines.is_empty(), "empty fleet");
    for m in &l.machines {
        field_shape(m)?;
    }
    Ok(Outcome::Pass)
}

pub fn cost_shape(m: &Machine) -> anyhow::Result<()> {
    ensure!(
        m.price_per_hour.is_finite() && m.price_per_hour >= 0.0,
        "{}: price_per_hour {}",
        m.id,
        m.price_per_hour
    );
    let p = m.interruption_probability;
    ensure!(
        p.is_finite() && (0.0..=1.0).contains(&p),
        "{}: interruption_probability {p}",
        m.id
    );
    Ok(())
}

pub async fn b802(ctx: SharedCtx) -> TestResult {
    let l = ctx.list_all().await?;
    let mut spot = 0;
    for m in &l.machines {
        cost_shape(m)?;
        if m.capacity_type() == CapacityType::Spot {
            spot += 1;
            if ctx.claims_profile("spot") {
                ensure!(
                    m.interruption_probability > 0.0,
                    "SPOT {} has interruption_probability 0",
                    m.id
                );
            }
        }
    }
    if ctx.claims_profile("spot") {
        Ok(Outcome::Pass)
    } else {
        Ok(Outcome::PassWith(format!(
            "spot profile not claimed: SPOT > 0 part skipped-as-pass ({spot} SPOT machines listed)"
        )))
    }
}

fn binding_rule(m: &Machine) -> anyhow::Result<()> {
    crate::suite::lifecycle::host_rule(m)?;
    match m.state() {
        S::Speculative | S::Idle => ensure!(
            m.cluster.is_empty(),
            "{:?} {} has cluster {:?}",
            m.state(),
            m.id,
            m.cluster
        ),
        S::Configured => ensure!(!m.cluster.is_empty(), "CONFIGURED {} has no cluster", m.id),
        _ => {}
    }
    Ok(())
}

pub async fn b803(ctx: SharedCtx) -> TestResult {
    for m in ctx.list_all().await?.machines {
        binding_rule(&m)?;
    }
    let mut s = ctx.session("b803");
    let id = ctx.fresh1().await?;
    binding_rule(&ctx.get(&id).await?)?;
    ctx.to_idle(&id, &mut s).await?;
    binding_rule(&ctx.get(&id).await?)?;
    ctx.to_configured(&id, &mut s, "b803", &meta(&[])).await?;
    binding_rule(&ctx.get(&id).await?)?;
    Ok(Outcome::Pass)
}

pub fn density_rule(m: &Machine) -> anyhow::Result<()> {
    if let Some(a) = &m.allocatable {
        ensure!(
            !a.resources.is_empty(),
            "{}: allocatable set but empty",
            m.id
        );
    }
    if let Some(r) = &m.resources {
        ensure!(!r.resources.is_empty(), "{}: resources set but empty", m.id);
    }
    Ok(())
}

pub async fn b804(ctx: SharedCtx) -> TestResult {
    for m in ctx.list_all().await?.machines {
        density_rule(&m)?;
    }
    Ok(Outcome::Pass)
}

pub async fn b805(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b805");
    let id = ctx.fresh1().await?;
    let mut tr = ctx.to_idle(&id, &mut s).await?.1;
    tr.extend(ctx.to_configured(&id, &mut s, "b805", &meta(&[])).await?.1);
    tr.extend(ctx.drain_to_idle(&id, &mut s).await?.1);
    let provs: std::collections::BTreeSet<_> = tr
        .snapshots
        .iter()
        .filter_map(|m| m.host.as_ref())
        .map(|h| h.provider.clone())
        .collect();
    ensure!(
        provs.len() == 1,
        "HostRef.provider varied across observations: {provs:?}"
    );
    ensure!(
        provs.iter().all(|p| !p.is_empty()),
        "empty HostRef.provider"
    );
    Ok(Outcome::Pass)
}

fn placement_rule(m: &Machine) -> anyhow::Result<()> {
    if is_stable(m.state()) && m.host.is_some() {
        ensure!(
            m.capacity_type() != CapacityType::Unspecified,
            "{}: capacity_type UNSPECIFIED",
            m.id
        );
        ensure!(!m.zone.is_empty(), "{}: empty zone", m.id);
    }
    Ok(())
}

pub async fn b806(ctx: SharedCtx) -> TestResult {
    let mut s = ctx.session("b806");
    let (id, _) = ctx.fresh_idle(&mut s).await?;
    let m = ctx.get(&id).await?;
    ensure!(m.host.is_some(), "IDLE machine has no host");
    placement_rule(&m)?;
    for m in ctx.list_all().await?.machines {
        placement_rule(&m)?;
    }
    Ok(Outcome::Pass)
}

pub async fn b807(ctx: SharedCtx) -> TestResult {
    if !ctx.caps.delete {
        return Ok(Outcome::Skip("Delete unsupported (UNIMPLEMENTED)".into()));
    }
    let mut s = ctx.session("b807");
    let (id, _) = ctx.fresh_configured(&mut s, &meta(&[("k", "v")])).await?;
    ctx.drain_to_idle(&id, &mut s).await?;
    ctx.delete_to_spec(&id, &mut s).await?;
    let m = ctx.get(&id).await?;
    ensure!(m.host.is_none(), "host {:?} after Delete", m.host);
    ensure!(
        m.cluster.is_empty() && m.shard_metadata.is_empty(),
        "binding after Delete: {:?} {:?}",
        m.cluster,
        m.shard_metadata
    );
    Ok(Outcome::Pass)
}
