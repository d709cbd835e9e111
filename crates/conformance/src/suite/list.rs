//! List, revision & pagination (B901–B909).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure};
use bigfleet_proto::v1alpha1::MachineState as S;

use crate::harness::{expect_ok, id_set, meta, Client, Outcome, SharedCtx, TestResult};

const ALL_STATES: [S; 8] = [
    S::Speculative,
    S::Creating,
    S::Idle,
    S::Configuring,
    S::Configured,
    S::Draining,
    S::Deleting,
    S::Failed,
];

fn gate(ctx: &SharedCtx) -> Option<Outcome> {
    (!ctx.caps.since_revision)
        .then(|| Outcome::Skip("since_revision cursor not supported by the endpoint".into()))
}

pub async fn b901(ctx: SharedCtx) -> TestResult {
    let mut singles: BTreeMap<S, BTreeSet<String>> = BTreeMap::new();
    for st in ALL_STATES {
        let l = ctx.list(&[st], 0, &[]).await?;
        for m in &l.machines {
            ensure!(
                m.state() == st,
                "List([{st:?}]) returned {} in {:?}",
                m.id,
                m.state()
            );
        }
        singles.insert(st, id_set(&l.machines)?.into_keys().collect());
    }
    // Serial lane: no client mutates meanwhile, so the union must be exact.
    for combo in [
        vec![S::Speculative, S::Idle],
        vec![S::Idle, S::Configured, S::Failed],
        ALL_STATES.to_vec(),
    ] {
        let l = ctx.list(&combo, 0, &[]).await?;
        let got: BTreeSet<String> = id_set(&l.machines)?.into_keys().collect();
        let want: BTreeSet<String> = combo
            .iter()
            .flat_map(|s| singles[s].iter().cloned())
            .collect();
        if got != want {
            let missing: Vec<_> = want.difference(&got).take(5).collect();
            let extra: Vec<_> = got.difference(&want).take(5).collect();
            bail!("List({combo:?}) is not the union: missing {missing:?}, extra {extra:?}");
        }
    }
    Ok(Outcome::Pass)
}

pub async fn b902(ctx: SharedCtx) -> TestResult {
    for k in 1..=3 {
        let l = ctx.list(&[], k, &[]).await?;
        ensure!(
            l.machines.len() <= k as usize,
            "max_results={k} returned {}",
            l.machines.len()
        );
        ensure!(
            !l.machines.is_empty(),
            "max_results={k} returned nothing from a non-empty fleet"
        );
    }
    let full = ctx.list(&[], 0, &[]).await?;
    ensure!(
        full.machines.len() == ctx.caps.fleet_size,
        "max_results=0 returned {} of {} machines",
        full.machines.len(),
        ctx.caps.fleet_size
    );
    Ok(Outcome::Pass)
}

pub async fn b903(ctx: SharedCtx) -> TestResult {
    if let Some(o) = gate(&ctx) {
        return Ok(o);
    }
    let mut s = ctx.session("b903");
    let id = ctx.fresh1().await?;
    let c0 = ctx.list_all().await?.revision;
    expect_ok(ctx.create(&id, &s.mint()).await, "Create")?;
    let c1 = ctx.list_all().await?.revision;
    ensure!(c1 != c0, "revision did not advance after a mutation");
    let d = ctx.list(&[], 0, &c0).await?;
    ensure!(
        d.machines.iter().any(|m| m.id == id),
        "delta since the prior cursor misses mutated {id}"
    );
    ctx.wait_for(&id, S::Idle).await?;
    Ok(Outcome::Pass)
}

pub async fn b904(ctx: SharedCtx) -> TestResult {
    if let Some(o) = gate(&ctx) {
        return Ok(o);
    }
    let c = ctx.list_all().await?.revision;
    let d = ctx.list(&[], 0, &c).await?;
    ensure!(
        d.machines.is_empty(),
        "delta since the current revision returned {} machines (e.g. {:?})",
        d.machines.len(),
        d.machines.first().map(|m| &m.id)
    );
    Ok(Outcome::Pass)
}

pub async fn b905(ctx: SharedCtx) -> TestResult {
    if let Some(o) = gate(&ctx) {
        return Ok(o);
    }
    let mut s = ctx.session("b905");
    let ids = ctx.fresh(2).await?;
    let mut cursors: Vec<(Vec<u8>, usize)> = Vec::new();
    let mut mutated: Vec<String> = Vec::new();
    let plan: Vec<(usize, &str)> = vec![
        (0, "create"),
        (1, "create"),
        (0, "configure"),
        (1, "configure"),
        (0, "drain"),
        (1, "drain"),
    ];
    for (i, kind) in plan {
        cursors.push((ctx.list_all().await?.revision, mutated.len()));
        let id = &ids[i];
        match kind {
            "create" => drop(ctx.to_idle(id, &mut s).await?),
            "configure" => drop(ctx.to_configured(id, &mut s, "b905", &meta(&[])).await?),
            _ => drop(ctx.drain_to_idle(id, &mut s).await?),
        }
        mutated.push(id.clone());
    }
    cursors.push((ctx.list_all().await?.revision, mutated.len()));
    for w in cursors.windows(2) {
        ensure!(w[0].0 != w[1].0, "cursor did not advance across a mutation");
    }
    let mut prev: Option<BTreeSet<String>> = None;
    for (c, from) in &cursors {
        let d: BTreeSet<String> = ctx
            .list(&[], 0, c)
            .await?
            .machines
            .into_iter()
            .map(|m| m.id)
            .collect();
        for id in &mutated[*from..] {
            ensure!(
                d.contains(id),
                "delta from cursor #{from} misses {id}, mutated after it"
            );
        }
        if let Some(p) = &prev {
            ensure!(
                d.is_subset(p),
                "a later cursor's delta is not contained in an earlier one's (non-monotonic)"
            );
        }
        prev = Some(d);
    }
    Ok(Outcome::Pass)
}

pub async fn b906(ctx: SharedCtx) -> TestResult {
    let n = ctx.caps.fleet_size;
    for (name, cur) in [
        ("garbage", b"\xde\xad\xbe\xef garbage".to_vec()),
        ("zero bytes", vec![0u8; 8]),
        ("single zero", vec![0u8]),
        ("text", b"not-a-cursor".to_vec()),
        ("long", vec![0xffu8; 512]),
    ] {
        let l = ctx.list(&[], 0, &cur).await?;
        ensure!(
            l.machines.len() == n,
            "since_revision={name}: {} of {n} machines",
            l.machines.len()
        );
    }
    Ok(Outcome::Pass)
}

/// Pages the fleet via max_results + since_revision; returns ids in visit order.
pub async fn page_fleet(c: &Client, page: i32, limit_pages: usize) -> anyhow::Result<Vec<String>> {
    let mut c = c.clone();
    let mut cursor: Vec<u8> = Vec::new();
    let mut out = Vec::new();
    for _ in 0..limit_pages {
        let l = c
            .list(bigfleet_proto::v1alpha1::ListFilter {
                states: vec![],
                max_results: page,
                since_revision: cursor.clone(),
            })
            .await?
            .into_inner();
        ensure!(
            l.machines.len() <= page as usize,
            "page of {} exceeds max_results {page}",
            l.machines.len()
        );
        if l.machines.is_empty() {
            return Ok(out);
        }
        out.extend(l.machines.into_iter().map(|m| m.id));
        cursor = l.revision;
    }
    bail!(
        "paging did not terminate within {limit_pages} pages ({} ids so far)",
        out.len()
    )
}

pub fn check_pages(visited: &[String], full: &BTreeSet<String>) -> anyhow::Result<()> {
    let mut seen = BTreeSet::new();
    for id in visited {
        ensure!(seen.insert(id.clone()), "paging visited {id} twice");
    }
    if &seen != full {
        let skipped: Vec<_> = full.difference(&seen).take(5).collect();
        let extra: Vec<_> = seen.difference(full).take(5).collect();
        bail!(
            "paging skipped {} machines (e.g. {skipped:?}), extra {extra:?}",
            full.difference(&seen).count()
        );
    }
    Ok(())
}

pub async fn b907(ctx: SharedCtx) -> TestResult {
    if let Some(o) = gate(&ctx) {
        return Ok(o);
    }
    let full: BTreeSet<String> = id_set(&ctx.list_all().await?.machines)?
        .into_keys()
        .collect();
    for page in [7, 64] {
        let visited = page_fleet(&ctx.client, page, full.len() / page as usize + 20).await?;
        check_pages(&visited, &full)?;
    }
    Ok(Outcome::Pass)
}

pub async fn b908(ctx: SharedCtx) -> TestResult {
    if let Some(o) = gate(&ctx) {
        return Ok(o);
    }
    let c = ctx.list_all().await?.revision;
    let end = Instant::now() + Duration::from_secs(3);
    let mut polls = 0;
    while Instant::now() < end {
        let d = ctx.list(&[], 0, &c).await?;
        ensure!(
            d.machines.is_empty(),
            "quiescent delta returned {} machines after {polls} polls (e.g. {:?})",
            d.machines.len(),
            d.machines.first().map(|m| (&m.id, m.state()))
        );
        polls += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let c2 = ctx.list_all().await?.revision;
    ensure!(c2 == c, "revision moved without client mutations");
    Ok(Outcome::Pass)
}

pub async fn b909(ctx: SharedCtx) -> TestResult {
    if let Some(o) = gate(&ctx) {
        return Ok(o);
    }
    let n = ctx.caps.fleet_size;
    let c = ctx.list_all().await?.revision;
    ensure!(!c.is_empty(), "empty revision cursor");
    let exact = ctx.list(&[], 0, &c).await?;
    ensure!(
        exact.machines.len() < n,
        "the exact cursor was not honoured (full list returned)"
    );
    let mut variants = Vec::new();
    for i in [0, c.len() / 2, c.len().saturating_sub(1)] {
        let mut m = c.clone();
        m[i] ^= 0x01;
        variants.push(m);
    }
    let mut longer = c.clone();
    longer.push(0);
    variants.push(longer);
    variants.push(c[..c.len().saturating_sub(1)].to_vec());
    for v in variants {
        if v == c {
            continue;
        }
        let l = ctx.list(&[], 0, &v).await?;
        ensure!(
            l.machines.len() == n,
            "byte-mutated cursor {v:?} returned {} of {n} machines (not a full list)",
            l.machines.len()
        );
    }
    Ok(Outcome::Pass)
}
