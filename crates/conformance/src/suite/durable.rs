//! Durability / restart (B1001–B1007): the runner owns the provider process, boots it with
//! `--state=<dir>/state.json` (named as the published runner names it), drives machines into stable and transitional states, kill -9s it,
//! restarts it on the same state path and asserts what survived. Lost state FAILS.
//! `--durable-state` names another state instead (a `postgres://` URL of an
//! empty database, say).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context as _};
use bigfleet_proto::v1alpha1::MachineState as S;
use tokio::sync::Mutex;

use crate::harness::{
    code_of, describe, expect_fp, expect_ok, id_set, is_stable, is_transitional, meta, probe, Ctx,
    Outcome, SharedCtx, TestResult, Token,
};
use crate::process::ProviderProcess;

/// What was recorded before the kills, plus a live context on the restarted provider.
pub struct DurableRun {
    pub ctx: SharedCtx,
    pub proc: Mutex<ProviderProcess>,
    /// Inventory (id -> state) with everything settled, before the first kill.
    pub inventory: BTreeMap<String, S>,
    /// Inventory as first listed by the final restarted process.
    pub inventory_after: Vec<(String, S)>,
    pub configured_id: String,
    pub cluster: String,
    pub metadata: HashMap<String, String>,
    pub configure_op: String,
    pub idle_id: String,
    pub idle_create_op: String,
    /// The last token applied to `configured_id` (its fencing mark for that shard).
    pub last_token: Token,
    pub ops_before: HashSet<String>,
    pub cursor_before: Vec<u8>,
    /// Machines whose transition was cut by a kill, with the state they were cut in.
    pub cut: Vec<(String, S)>,
    _dir: tempfile::TempDir,
}

pub struct DurableOpts {
    pub bin: PathBuf,
    /// Provider flags other than --addr/--state/--fake-latency (e.g. --use-fake-backend --seed-count 64).
    pub base_args: Vec<String>,
    pub seed: u64,
    pub slow_latency: String,
    /// Where the provider's output goes (kept after the run).
    pub log_dir: PathBuf,
    /// The `--state` to use instead of a fresh `state.json`: it must be
    /// empty (a path that does not exist, a database without the schema).
    pub state: Option<String>,
}

fn args(o: &DurableOpts, state: &str, latency: Option<&str>) -> Vec<String> {
    let mut a = o.base_args.clone();
    // One `--state=PATH` argument, as the published runner passes it.
    a.push(format!("--state={state}"));
    if let Some(l) = latency {
        a.push("--fake-latency".into());
        a.push(l.into());
    }
    a
}

/// Runs the whole boot / drive / kill -9 / restart scenario.
pub async fn prepare(o: &DurableOpts) -> anyhow::Result<Arc<DurableRun>> {
    let dir = tempfile::tempdir().context("creating the durable-lane state dir")?;
    // The published runner names the state file `*.json`; the provider
    // must take that name as it is.
    let state = match &o.state {
        Some(state) => state.clone(),
        None => dir.path().join("state.json").display().to_string(),
    };
    let log = o.log_dir.join("provider-durable.log");
    let ready = Duration::from_secs(60);
    let (mut proc, client) =
        ProviderProcess::spawn(&o.bin, &args(o, &state, None), &log, ready).await?;
    let caps = probe(&client).await?;
    let ctx = Arc::new(Ctx::new(proc.addr.clone(), None, client, caps, o.seed));

    // Phase 1: stable states with everything settled.
    let mut s = ctx.session("dur");
    let metadata = crate::suite::metadata::tricky_map();
    let cluster = "durable-cluster".to_string();
    let ids = ctx.fresh(4).await?;
    let (configured_id, idle_id, cut_cfg, cut_create) = (
        ids[0].clone(),
        ids[1].clone(),
        ids[2].clone(),
        ids[3].clone(),
    );
    let mut ops_before = HashSet::new();
    ops_before.insert(ctx.to_idle(&configured_id, &mut s).await?.0);
    let (configure_op, _) = ctx
        .to_configured(&configured_id, &mut s, &cluster, &metadata)
        .await?;
    ops_before.insert(configure_op.clone());
    // The mark of (shard, configured_id) is the Configure token.
    let last_token = s.last();
    let (idle_create_op, _) = ctx.to_idle(&idle_id, &mut s).await?;
    ops_before.insert(idle_create_op.clone());
    let full = ctx.list_all().await?;
    let inventory: BTreeMap<String, S> = id_set(&full.machines)?;
    let cursor_before = full.revision;
    proc.kill9()?;

    // Phase 2: restart slow and cut transitions with a kill -9. The cut machines are created in
    // this phase (a fake substrate need not remember hosts across restarts): one is caught
    // mid-Create, the other is walked to IDLE and caught mid-Configure.
    let client = proc
        .restart(&args(o, &state, Some(&o.slow_latency)), ready)
        .await?;
    let ctx2 = Arc::new(Ctx::new(
        proc.addr.clone(),
        None,
        client,
        ctx.caps.clone(),
        o.seed,
    ));
    ctx2.reserve(ids.iter().cloned());
    let mut cut = Vec::new();
    let (op, _) = ctx2
        .to_idle(&cut_cfg, &mut s)
        .await
        .context("walking the to-be-cut machine to IDLE after the first restart")?;
    ops_before.insert(op);
    let a = expect_ok(
        ctx2.configure(&cut_cfg, "cut", &meta(&[("cut", "1")]), &s.mint())
            .await,
        "Configure to be cut",
    )?;
    ops_before.insert(a.operation_id);
    let a = expect_ok(
        ctx2.create(&cut_create, &s.mint()).await,
        "Create to be cut",
    )?;
    ops_before.insert(a.operation_id);
    for id in [&cut_cfg, &cut_create] {
        let m = ctx2.get(id).await?;
        ensure!(
            is_transitional(m.state()),
            "{id} not caught mid-transition ({:?}, last_error {:?}); is --fake-latency honoured?",
            m.state(),
            m.last_error
        );
        cut.push((id.clone(), m.state()));
    }
    proc.kill9()?;

    // Phase 3: restart normally; everything below is asserted against this process.
    let client = proc.restart(&args(o, &state, None), ready).await?;
    let inventory_after = client
        .clone()
        .list(bigfleet_proto::v1alpha1::ListFilter::default())
        .await
        .context("first List after restart")?
        .into_inner()
        .machines
        .into_iter()
        .map(|m| (m.id.clone(), m.state()))
        .collect();
    let caps = probe(&client).await?;
    let ctx3 = Arc::new(Ctx::new(proc.addr.clone(), None, client, caps, o.seed));
    // Never hand out machines this scenario already used.
    ctx3.reserve(ids.iter().cloned());
    ops_before.retain(|o| !o.is_empty());
    Ok(Arc::new(DurableRun {
        ctx: ctx3,
        proc: Mutex::new(proc),
        inventory,
        inventory_after,
        configured_id,
        cluster,
        metadata,
        configure_op,
        idle_id,
        idle_create_op,
        last_token,
        ops_before,
        cursor_before,
        cut,
        _dir: dir,
    }))
}

pub async fn b1001(r: Arc<DurableRun>) -> TestResult {
    let ctx = &r.ctx;
    let res = ctx
        .configure(&r.configured_id, &r.cluster, &r.metadata, &r.last_token)
        .await;
    expect_fp(&res, "pre-restart last token replayed after restart")?;
    let older = Token::new(
        &r.last_token.shard,
        r.last_token.epoch,
        r.last_token.seq - 1,
    );
    expect_fp(
        &ctx.configure(&r.configured_id, &r.cluster, &r.metadata, &older)
            .await,
        "older token after restart",
    )?;
    Ok(Outcome::Pass)
}

pub async fn b1002(r: Arc<DurableRun>) -> TestResult {
    let ctx = &r.ctx;
    let mut s = ctx.session("dur-retry");
    let a = expect_ok(
        ctx.configure(&r.configured_id, &r.cluster, &r.metadata, &s.mint())
            .await,
        "Configure retry after restart",
    )?;
    ensure!(
        a.operation_id == r.configure_op,
        "Configure retry returned {} (pre-restart {})",
        a.operation_id,
        r.configure_op
    );
    let a = expect_ok(
        ctx.create(&r.idle_id, &s.mint()).await,
        "Create retry after restart",
    )?;
    ensure!(
        a.operation_id == r.idle_create_op,
        "Create retry returned {} (pre-restart {})",
        a.operation_id,
        r.idle_create_op
    );
    Ok(Outcome::Pass)
}

pub async fn b1003(r: Arc<DurableRun>) -> TestResult {
    let m = r.ctx.get(&r.configured_id).await?;
    ensure!(
        m.state() == S::Configured,
        "{} is {:?} after restart, was CONFIGURED",
        m.id,
        m.state()
    );
    ensure!(
        m.cluster == r.cluster,
        "cluster after restart {:?}, was {:?}",
        m.cluster,
        r.cluster
    );
    ensure!(
        m.shard_metadata == r.metadata,
        "metadata not verbatim after restart ({} of {} keys)",
        m.shard_metadata.len(),
        r.metadata.len()
    );
    let l = r.ctx.list(&[S::Configured], 0, &[]).await?;
    let lm = l.machines.into_iter().find(|x| x.id == r.configured_id);
    ensure!(
        lm.map(|x| (x.cluster, x.shard_metadata)) == Some((r.cluster.clone(), r.metadata.clone())),
        "List(CONFIGURED) binding differs after restart"
    );
    Ok(Outcome::Pass)
}

pub async fn b1004(r: Arc<DurableRun>) -> TestResult {
    let mut after = BTreeMap::new();
    for (id, st) in &r.inventory_after {
        ensure!(
            after.insert(id.clone(), *st).is_none(),
            "{id} listed twice after restart"
        );
    }
    let before_ids: HashSet<_> = r.inventory.keys().collect();
    let after_ids: HashSet<_> = after.keys().collect();
    let lost: Vec<_> = before_ids.difference(&after_ids).take(5).collect();
    let extra: Vec<_> = after_ids.difference(&before_ids).take(5).collect();
    ensure!(
        lost.is_empty() && extra.is_empty(),
        "inventory changed over restart: lost {lost:?}, new {extra:?}"
    );
    let cut: HashSet<&String> = r.cut.iter().map(|(i, _)| i).collect();
    let mut changed = Vec::new();
    for (id, st) in &r.inventory {
        if !cut.contains(id) && after.get(id) != Some(st) {
            changed.push(format!("{id}: {st:?} -> {:?}", after.get(id)));
        }
    }
    ensure!(
        changed.is_empty(),
        "{} machine states not recovered, e.g. {:?}",
        changed.len(),
        &changed[..changed.len().min(5)]
    );
    Ok(Outcome::Pass)
}

pub async fn b1005(r: Arc<DurableRun>) -> TestResult {
    let ctx = &r.ctx;
    let mut s = ctx.session("dur-new");
    let id = ctx.fresh1().await?;
    let c0 = ctx.list_all().await?.revision;
    ensure!(!c0.is_empty(), "empty revision after restart");
    let (op, _) = ctx.to_idle(&id, &mut s).await?;
    ensure!(!op.is_empty(), "empty operation_id after restart");
    ensure!(
        !r.ops_before.contains(&op),
        "operation_id {op} reused from before the restart"
    );
    let (op2, _) = ctx
        .to_configured(&id, &mut s, "dur-new", &meta(&[]))
        .await?;
    ensure!(
        op2 != op && !r.ops_before.contains(&op2),
        "operation_id {op2} reused"
    );
    let d = ctx.list(&[], 0, &c0).await?;
    ensure!(
        d.machines.iter().any(|m| m.id == id),
        "post-restart delta misses mutated {id}"
    );
    // A pre-restart cursor must not silently miss records changed since.
    let old = ctx.list(&[], 0, &r.cursor_before).await?;
    let got: HashSet<_> = old.machines.iter().map(|m| m.id.clone()).collect();
    for (cid, _) in &r.cut {
        ensure!(
            got.contains(cid),
            "delta since a pre-restart cursor misses {cid}, changed after it"
        );
    }
    ensure!(
        got.contains(&id),
        "delta since a pre-restart cursor misses {id}"
    );
    Ok(Outcome::Pass)
}

pub async fn b1006(r: Arc<DurableRun>) -> TestResult {
    let mut notes = Vec::new();
    for (id, cut_in) in &r.cut {
        // Allow a bounded recovery window, then it must be FAILED or stable.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let m = loop {
            let m = r.ctx.get(id).await?;
            if !is_transitional(m.state()) || std::time::Instant::now() >= deadline {
                break m;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        match m.state() {
            S::Failed => ensure!(
                !m.last_error.is_empty(),
                "{id} recovered FAILED with an empty last_error"
            ),
            st if is_stable(st) => {}
            st => bail!("{id} (cut in {cut_in:?}) left {st:?} after restart"),
        }
        notes.push(format!("{id}: {cut_in:?} -> {:?}", m.state()));
    }
    Ok(Outcome::PassWith(notes.join("; ")))
}

pub async fn b1007(r: Arc<DurableRun>) -> TestResult {
    let ctx = &r.ctx;
    let id = ctx.fresh1().await?;
    let t = Token::new(&format!("brand-new-shard-{}", ctx.run_tag), 1, 1);
    expect_ok(
        ctx.create(&id, &t).await,
        "new shard's first (1,1) token after restart",
    )?;
    // And on a machine that already has marks from other shards.
    let res = ctx
        .create(
            &r.idle_id,
            &Token::new(&format!("another-new-shard-{}", ctx.run_tag), 1, 1),
        )
        .await;
    ensure!(
        code_of(&res) != Some(tonic::Code::FailedPrecondition),
        "new shard fenced on {}: {}",
        r.idle_id,
        describe(&res)
    );
    Ok(Outcome::Pass)
}
