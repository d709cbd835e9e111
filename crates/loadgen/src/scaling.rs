//! The scaling guard: the Create rate, Get p99 and the durable Create rate
//! with a small fleet and with a large one, measured in the same run and
//! compared as ratios, so a slow or busy machine slows both sides alike
//! and only work that grows with the fleet fails the guard.
//!
//! At each size a quarter of the fleet (at most [`FILL_CAP`]) is created
//! first and left IDLE, so the substrate holds VMs as a working fleet
//! does; then the same number of Creates is timed at each size,
//! [`ROUNDS`] times (each round's machines deleted back to SPECULATIVE
//! before the next), and the median round counts. Get p99 is read under
//! the same open-loop load at each size, in [`GET_WINDOWS`] windows, and
//! the median window counts: one window's p99 on a 2-core machine moves
//! by half with what else ran in it, while work that grows with the fleet
//! slows every window.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bigfleet_proto::v1alpha1::MachineState;

use crate::provider::Provider;
use crate::scenarios::{create_req, delete_req, run_concurrently, Bench, Profile};
use crate::stats::us;
use crate::Report;

/// Concurrent callers of the timed Creates, each on its own connection.
const CALLERS: usize = 16;
/// Most machines created before the timed rounds at a large size.
const FILL_CAP: usize = 25_000;
/// Timed rounds per size; the median counts.
const ROUNDS: usize = 9;
/// Offered Get rate while Get p99 is read.
const GET_RPS: u32 = 2000;
/// Windows Get p99 is read in at each size; the median counts.
const GET_WINDOWS: usize = 3;
/// The large size's Create rate must be at least this share of the small
/// size's; its Get p99 at most the inverse times the small size's.
pub const FLOOR: f64 = 2.0 / 3.0;
/// How long the machines of a round may take to land or to go.
const SETTLE_LIMIT: Duration = Duration::from_secs(120);
const SETTLE_POLL: Duration = Duration::from_millis(5);

/// Where the provider keeps its state in one half of the guard.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Memory,
    Sqlite,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::Memory => "memory",
            State::Sqlite => "sqlite",
        }
    }
}

/// What one size measured.
struct Figures {
    creates_per_s: f64,
    get_p99: Duration,
}

/// Runs the guard at `small` and `large`; `Ok(false)` when a ratio is
/// under its floor (every figure and verdict is reported either way).
pub async fn run(
    bin: &Path,
    small: usize,
    large: usize,
    boot_timeout: Duration,
    profile: &Profile,
    report: &mut Report,
) -> Result<bool> {
    if small >= large {
        bail!("the scaling guard needs a small size below the large one ({small} >= {large})");
    }
    let window = timed_creates(small);
    if window == 0 {
        bail!("--sizes {small} leaves no machines for the timed Creates");
    }
    let mut met = true;
    for state in [State::Memory, State::Sqlite] {
        let mut at = Vec::new();
        for size in [small, large] {
            let figures = measure(bin, state, size, window, boot_timeout, profile, report)
                .await
                .with_context(|| format!("scaling guard, {} at {size}", state.name()))?;
            at.push(figures);
        }
        let (s, l) = (&at[0], &at[1]);
        let ratio = l.creates_per_s / s.creates_per_s.max(f64::MIN_POSITIVE);
        met &= verdict(
            report,
            &format!("create_acks state={}", state.name()),
            format!(
                "small_acks_per_s={:.0} large_acks_per_s={:.0}",
                s.creates_per_s, l.creates_per_s
            ),
            ratio,
            small,
            large,
        );
        if state == State::Memory {
            // Latency: the large side's p99 against the small side's, as a
            // rate (small over large), so one floor reads both ways.
            let ratio = s.get_p99.as_secs_f64() / l.get_p99.as_secs_f64().max(1e-9);
            met &= verdict(
                report,
                "get_p99",
                format!(
                    "small_p99_us={} large_p99_us={}",
                    us(s.get_p99),
                    us(l.get_p99)
                ),
                ratio,
                small,
                large,
            );
        }
    }
    Ok(met)
}

/// Creates timed per round: what the small size leaves after its fill and
/// the machines Get reads, the same count at every size.
fn timed_creates(small: usize) -> usize {
    let left = small - fill_count(small);
    // A tenth stays SPECULATIVE for the Gets to read.
    left - left / 10
}

fn fill_count(size: usize) -> usize {
    (size / 4).min(FILL_CAP)
}

fn verdict(
    report: &mut Report,
    what: &str,
    figures: String,
    ratio: f64,
    small: usize,
    large: usize,
) -> bool {
    let met = ratio >= FLOOR;
    report.line(format!(
        "scaling_guard={what} {figures} ratio={ratio:.2} floor={FLOOR:.2} met={met} small={small} large={large}"
    ));
    met
}

/// One provider at `size`: fill, Get p99, then the timed rounds.
async fn measure(
    bin: &Path,
    state: State,
    size: usize,
    window: usize,
    boot_timeout: Duration,
    profile: &Profile,
    report: &mut Report,
) -> Result<Figures> {
    let dir = tempfile::tempdir().context("creating a temp dir for --state")?;
    let path = dir.path().join("state.db");
    let provider = Provider::spawn(
        bin,
        size,
        (state == State::Sqlite).then_some(path.as_path()),
        boot_timeout,
        profile.provider_cpu,
    )
    .await
    .context("booting the provider")?;
    let bench = Bench::connect(&provider.addr, profile, provider.pid()).await?;
    let mut ids = bench.inventory().await?;
    if ids.len() < size {
        bail!("{} SPECULATIVE machines at boot, not {size}", ids.len());
    }
    let fill: Vec<String> = ids.split_off(ids.len() - fill_count(size));
    let filled = Instant::now();
    creates(&bench, fill.clone(), 1).await.context("the fill")?;
    settle(&bench, MachineState::Idle, fill.len()).await?;
    let fill_s = filled.elapsed().as_secs_f64();
    let rounds: Vec<String> = ids.split_off(ids.len() - window);
    let get_p99 = if state == State::Memory {
        let mut windows = Vec::with_capacity(GET_WINDOWS);
        for window in 1..=GET_WINDOWS {
            windows.push(
                bench
                    .open_loop_get(size, &ids, GET_RPS, report)
                    .await
                    .with_context(|| format!("Get p99, window {window}"))?,
            );
        }
        windows.sort();
        windows[windows.len() / 2]
    } else {
        Duration::ZERO
    };
    let mut rates = Vec::with_capacity(ROUNDS);
    for round in 1..=ROUNDS {
        let wall = creates(&bench, rounds.clone(), sequence(round, Op::Create))
            .await
            .with_context(|| format!("round {round}"))?;
        rates.push(window as f64 / wall.as_secs_f64());
        settle(&bench, MachineState::Idle, fill.len() + window).await?;
        if round < ROUNDS {
            deletes(&bench, &rounds, round).await?;
            settle(&bench, MachineState::Idle, fill.len()).await?;
            settle(&bench, MachineState::Speculative, size - fill.len()).await?;
        }
    }
    rates.sort_by(f64::total_cmp);
    let median = rates[rates.len() / 2];
    report.line(format!(
        "scaling_creates_per_s={median:.0} rounds_per_s={} creates_per_round={window} callers={CALLERS} filled={} fill_s={fill_s:.1} size={size} state={}",
        rates
            .iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join("/"),
        fill.len(),
        state.name(),
    ));
    drop(bench);
    provider.kill().await?;
    Ok(Figures {
        creates_per_s: median,
        get_p99,
    })
}

/// The two mutations of a timed round.
enum Op {
    Create,
    Delete,
}

/// The fencing sequence number of `op` in round `round` (from 1): each
/// round's Create and Delete take the next two, so none is stale.
fn sequence(round: usize, op: Op) -> i64 {
    let create = i64::try_from(2 * round - 1).unwrap_or(i64::MAX - 1);
    match op {
        Op::Create => create,
        Op::Delete => create + 1,
    }
}

/// Creates `ids` from [`CALLERS`] callers; the wall time.
async fn creates(bench: &Bench<'_>, ids: Vec<String>, seq: i64) -> Result<Duration> {
    let (_, wall, _) =
        run_concurrently(
            &bench.endpoint,
            CALLERS,
            CALLERS,
            None,
            Arc::new(ids),
            bench.epoch,
            move |mut c, id, epoch| async move {
                c.create(create_req(&id, epoch, seq)).await.map(|_| ())
            },
        )
        .await?;
    Ok(wall)
}

/// Deletes `ids` (IDLE) at the end of round `round`.
async fn deletes(bench: &Bench<'_>, ids: &[String], round: usize) -> Result<()> {
    let seq = sequence(round, Op::Delete);
    run_concurrently(
        &bench.endpoint,
        CALLERS,
        CALLERS,
        None,
        Arc::new(ids.to_vec()),
        bench.epoch,
        move |mut c, id, epoch| async move {
            c.delete(delete_req(&id, epoch, seq)).await.map(|_| ())
        },
    )
    .await?;
    Ok(())
}

/// Waits until exactly `count` machines are in `state`.
async fn settle(bench: &Bench<'_>, state: MachineState, count: usize) -> Result<()> {
    let deadline = Instant::now() + SETTLE_LIMIT;
    loop {
        let now = bench.list_in(state).await?.machines.len();
        if now == count {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{now} machines {state:?} after {SETTLE_LIMIT:?}, waiting for {count}");
        }
        tokio::time::sleep(SETTLE_POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_size_times_the_same_creates_and_keeps_some_for_get() {
        assert_eq!(fill_count(1000), 250);
        assert_eq!(fill_count(100_000), FILL_CAP);
        assert_eq!(timed_creates(1000), 675);
        assert!(100_000 - fill_count(100_000) - timed_creates(1000) > 1000);
    }

    #[test]
    fn each_mutation_of_a_round_is_newer_than_the_last() {
        let all: Vec<i64> = (1..=ROUNDS)
            .flat_map(|r| [sequence(r, Op::Create), sequence(r, Op::Delete)])
            .collect();
        assert!(all.windows(2).all(|w| w[0] < w[1]), "{all:?}");
        // The fill's Creates (1) and round 1's share a number on other machines only.
        assert_eq!(sequence(1, Op::Create), 1);
    }
}
