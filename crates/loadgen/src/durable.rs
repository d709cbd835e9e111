//! The PostgreSQL scenario (issue #24's benchmarks): durable Create acks
//! at 16 callers with the state in SQLite and then in PostgreSQL, at each
//! inventory size; takeover between two replicas sharing a PostgreSQL
//! state at the largest size (kill -9 of the leader to the standby's
//! `/readyz` 200); and the peak RSS of the PostgreSQL-backed provider.
//!
//! Every PostgreSQL boot gets a database of its own on the server named by
//! `--state-url`, created here and dropped at the end, so no run sees
//! another's state.

use std::ffi::OsStr;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use tokio_postgres::NoTls;

use crate::machine::{span_fields, CpuTicks};
use crate::provider::{Launch, Provider, STANDBY_MARKER};
use crate::scenarios::{create_req, full_filter, run_concurrently, Bench, Profile};
use crate::stats::{ms, us};
use crate::Report;

/// Concurrent callers of the durable Create runs, each on its own
/// connection (as the store benchmark's 16 clients).
const CALLERS: usize = 16;
/// Issue #24's goals.
const PG_ACKS_GOAL: f64 = 2000.0;
const TAKEOVER_GOAL: Duration = Duration::from_secs(10);
/// How long a standby may take to become ready before the run is broken.
const TAKEOVER_LIMIT: Duration = Duration::from_secs(60);
/// Poll period of the standby's `/readyz` while it takes over.
const READY_POLL: Duration = Duration::from_millis(10);

/// Where a provider keeps its state in one durable run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum StateKind {
    Sqlite,
    Postgres,
}

impl StateKind {
    fn name(self) -> &'static str {
        match self {
            StateKind::Sqlite => "sqlite",
            StateKind::Postgres => "postgres",
        }
    }
}

/// The PostgreSQL server the scenario creates its databases on.
struct Server {
    /// The URL as given, handed to the provider (with the database
    /// replaced).
    url: String,
    /// A plain connection to the URL's own database, for CREATE/DROP.
    admin: tokio_postgres::Client,
}

/// A database of one run's own.
struct Database {
    name: String,
    /// `--state` for the provider.
    state_url: String,
    /// A connection of ours to it, to read the store's last committed round.
    reader_url: String,
}

impl Server {
    async fn connect(url: &str) -> Result<Server> {
        let admin = connect(&client_url(url)).await?;
        Ok(Server {
            url: url.to_string(),
            admin,
        })
    }

    /// A fresh, empty database.
    async fn fresh(&self, label: &str) -> Result<Database> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "bf_bench_{}_{}_{label}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        self.admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .with_context(|| format!("CREATE DATABASE {name}"))?;
        let state_url = with_database(&self.url, &name)?;
        Ok(Database {
            reader_url: client_url(&state_url),
            state_url,
            name,
        })
    }

    /// Drop a run's database once its providers are gone; a failure is
    /// only reported (the server is a throwaway one).
    async fn drop_database(&self, db: Database, report: &mut Report) {
        let sql = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", db.name);
        if let Err(e) = self.admin.batch_execute(&sql).await {
            report.line(format!("# {sql} failed: {e}"));
        }
    }

    /// The server settings that bound a durable commit.
    async fn settings(&self) -> Result<String> {
        let mut out = Vec::new();
        for name in [
            "server_version",
            "synchronous_commit",
            "fsync",
            "wal_sync_method",
        ] {
            let row = self
                .admin
                .query_one(&format!("SHOW {name}"), &[])
                .await
                .with_context(|| format!("SHOW {name}"))?;
            let value: String = row.get(0);
            out.push(format!("{name}={}", value.replace(' ', "_")));
        }
        Ok(out.join(" "))
    }
}

/// Connect without TLS: the scenario's own connections go to a loopback
/// server (`sslmode=disable`).
async fn connect(url: &str) -> Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .with_context(|| format!("connecting to {}", without_query(url)))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("loadgen: PostgreSQL connection ended: {e}");
        }
    });
    Ok(client)
}

fn without_query(url: &str) -> &str {
    url.split_once('?').map_or(url, |(base, _)| base)
}

/// The URL without libpq's `sslrootcert`, which the client library does
/// not know (the provider reads it itself).
fn client_url(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_string();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| !pair.is_empty() && !pair.starts_with("sslrootcert="))
        .collect();
    if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    }
}

/// `url` naming database `name` instead of its own.
fn with_database(url: &str, name: &str) -> Result<String> {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority = base
        .find("://")
        .map(|i| i + 3)
        .ok_or_else(|| anyhow!("--state-url {base} is not a postgres:// URL"))?;
    let path = base[authority..]
        .find('/')
        .map_or(base.len(), |i| authority + i);
    let mut out = format!("{}/{name}", &base[..path]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    Ok(out)
}

/// Let the database finish with the seeding before the timed window: the
/// first boot wrote the whole fleet in one transaction, and the autovacuum
/// that follows such a bulk write would otherwise land in the few seconds
/// measured. A running provider's tables are in that vacuumed state (the
/// fleet was seeded once, long ago). No CHECKPOINT: right after one, the
/// first write to every page logs the whole page, which a database in its
/// steady state does only once per checkpoint interval (5 minutes by
/// default).
async fn settle(reader: &tokio_postgres::Client) -> Result<()> {
    reader
        .batch_execute("VACUUM ANALYZE bigfleet_machines, bigfleet_fences")
        .await
        .context("vacuuming the state after the seeding")
}

/// The PostgreSQL store's highest committed round (each commit takes the
/// next number; numbers left unused are rare and only after a failure).
async fn last_round(reader: &tokio_postgres::Client) -> Result<i64> {
    Ok(reader
        .query_one("SELECT COALESCE(max(round), 0) FROM bigfleet_commits", &[])
        .await
        .context("reading the store's last committed round")?
        .get(0))
}

/// Run the whole scenario: durable Creates at every size, then the
/// takeover and the RSS at the largest.
pub async fn run(
    bin: &Path,
    state_url: &str,
    sizes: &[usize],
    boot_timeout: Duration,
    profile: &Profile,
    report: &mut Report,
) -> Result<()> {
    let server = Server::connect(state_url).await?;
    report.line(format!("pg_server {}", server.settings().await?));
    let mut pg_acks: Vec<f64> = Vec::new();
    for &size in sizes {
        for kind in [StateKind::Sqlite, StateKind::Postgres] {
            let acks = durable_creates(bin, &server, kind, size, boot_timeout, profile, report)
                .await
                .with_context(|| format!("durable Creates, {} at {size}", kind.name()))?;
            if kind == StateKind::Postgres {
                pg_acks.push(acks);
            }
        }
    }
    let slowest = pg_acks.iter().copied().fold(f64::INFINITY, f64::min);
    report.line(format!(
        "pg_acks_goal={PG_ACKS_GOAL:.0} met={} slowest_acks_per_s={slowest:.0} callers={CALLERS}",
        slowest >= PG_ACKS_GOAL
    ));
    let largest = sizes.iter().copied().max().unwrap_or(100_000);
    takeover(bin, &server, largest, boot_timeout, profile, report)
        .await
        .with_context(|| format!("takeover at {largest}"))
}

/// One provider with its state in `kind`: first boot (seeding `size`
/// machines), then 16 callers' Creates; the acks per second.
async fn durable_creates(
    bin: &Path,
    server: &Server,
    kind: StateKind,
    size: usize,
    boot_timeout: Duration,
    profile: &Profile,
    report: &mut Report,
) -> Result<f64> {
    let dir = tempfile::tempdir().context("creating a temp dir for --state")?;
    let db = match kind {
        StateKind::Sqlite => None,
        StateKind::Postgres => Some(server.fresh(&format!("create_{size}")).await?),
    };
    let sqlite_path = dir.path().join("state.db");
    let state: &OsStr = match &db {
        Some(db) => OsStr::new(&db.state_url),
        None => sqlite_path.as_os_str(),
    };
    let outcome = async {
        let provider = Provider::launch(
            bin,
            &Launch {
                seed_count: size,
                state: Some(state),
                replica: None,
                metrics_addr: "",
                until: provider_testkit::STARTUP_LINE,
                boot_timeout,
                cpu: profile.provider_cpu,
            },
        )
        .await
        .context("first boot")?;
        let bench = Bench::connect(&provider.addr, profile, provider.pid()).await?;
        let mut ids = bench.inventory().await?;
        let n = profile.create_cap_per_level.min(ids.len() / 2);
        if n == 0 {
            bail!("no SPECULATIVE machines to create");
        }
        ids.truncate(n);
        let reader = match &db {
            Some(db) => Some(connect(&db.reader_url).await?),
            None => None,
        };
        if let Some(reader) = &reader {
            settle(reader).await?;
        }
        let commits_before = match &reader {
            Some(reader) => Some(last_round(reader).await?),
            None => None,
        };
        let machine = CpuTicks::now();
        let (mut lat, wall, cpu) = run_concurrently(
            &bench.endpoint,
            CALLERS,
            CALLERS,
            provider.pid(),
            Arc::new(ids),
            bench.epoch,
            |mut c, id, epoch| async move { c.create(create_req(&id, epoch, 1)).await.map(|_| ()) },
        )
        .await?;
        let acks = n as f64 / wall.as_secs_f64();
        let machine = span_fields(machine);
        // Commits during the acks' window: they also carry the landings
        // (CREATING -> IDLE) of the Creates acknowledged so far.
        let commits = match (&reader, commits_before) {
            (Some(reader), Some(before)) => {
                let commits = last_round(reader).await? - before;
                format!(
                    " commits={commits} commits_per_s={:.0} acks_per_commit={:.2}",
                    commits as f64 / wall.as_secs_f64(),
                    n as f64 / (commits.max(1) as f64)
                )
            }
            _ => String::new(),
        };
        report.line(format!(
            "durable_create_acks_per_s={acks:.0} create_p50_us={} create_p99_us={} server_cpu_us_per_create={} callers={CALLERS} conns={CALLERS} creates={n} first_boot_ms={}{commits}{machine} size={size} state={}",
            us(lat.percentile(50.0)),
            us(lat.percentile(99.0)),
            cpu.us_per_op(n),
            ms(provider.startup),
            kind.name(),
        ));
        match provider.memory_kib() {
            Ok((hwm, _)) => report.line(format!(
                "rss_peak_mib={:.1} size={size} state={} after=boot+creates",
                hwm as f64 / 1024.0,
                kind.name()
            )),
            Err(e) => report.line(format!(
                "rss_peak_mib=skipped size={size} state={} reason={e:#}",
                kind.name()
            )),
        }
        drop(bench);
        provider.kill().await?;
        Ok(acks)
    }
    .await;
    if let Some(db) = db {
        server.drop_database(db, report).await;
    }
    outcome
}

/// Two replicas on one PostgreSQL state seeded with `size` machines; the
/// leader is killed (-9) `profile.takeover_rounds` times, the killed one
/// coming back as the next standby. Each round's time runs from the kill
/// to the standby's `/readyz` 200.
async fn takeover(
    bin: &Path,
    server: &Server,
    size: usize,
    boot_timeout: Duration,
    profile: &Profile,
    report: &mut Report,
) -> Result<()> {
    let db = server.fresh(&format!("takeover_{size}")).await?;
    let outcome = takeover_rounds(bin, &db, size, boot_timeout, profile, report).await;
    server.drop_database(db, report).await;
    outcome
}

async fn takeover_rounds(
    bin: &Path,
    db: &Database,
    size: usize,
    boot_timeout: Duration,
    profile: &Profile,
    report: &mut Report,
) -> Result<()> {
    let replica = |name: &'static str, until: &'static str| {
        let state = OsStr::new(&db.state_url);
        async move {
            Provider::launch(
                bin,
                &Launch {
                    seed_count: size,
                    state: Some(state),
                    replica: Some(name),
                    metrics_addr: "127.0.0.1:0",
                    until,
                    boot_timeout,
                    cpu: profile.provider_cpu,
                },
            )
            .await
            .with_context(|| format!("booting replica {name}"))
        }
    };
    let mut leader = replica("a", provider_testkit::STARTUP_LINE).await?;
    report.line(format!(
        "startup_ms={} size={size} state=postgres first_boot=true replica=a",
        ms(leader.startup)
    ));
    let mut names = ("a", "b");
    let mut standby = Some(replica(names.1, STANDBY_MARKER).await?);
    let mut longest = Duration::ZERO;
    for round in 1..=profile.takeover_rounds {
        let next = standby
            .take()
            .ok_or_else(|| anyhow!("no standby for round {round}"))?;
        let probes = next
            .metrics_addr
            .ok_or_else(|| anyhow!("replica {} logged no metrics_addr", names.1))?;
        if readyz(probes).await? == 200 {
            bail!("replica {} was ready before the leader died", names.1);
        }
        let died = Instant::now();
        leader.kill().await?;
        wait_ready(probes).await?;
        let took = died.elapsed();
        longest = longest.max(took);
        report.line(format!(
            "takeover_ms={} size={size} round={round} new_leader={}",
            ms(took),
            names.1
        ));
        leader = next;
        names = (names.1, names.0);
        if round < profile.takeover_rounds {
            standby = Some(replica(names.1, STANDBY_MARKER).await?);
        }
    }
    report.line(format!(
        "takeover_goal_ms={} met={} longest_takeover_ms={} rounds={} size={size}",
        TAKEOVER_GOAL.as_millis(),
        longest <= TAKEOVER_GOAL,
        ms(longest),
        profile.takeover_rounds,
    ));
    // The last leader serves the whole state it took over.
    let bench = Bench::connect(&leader.addr, profile, leader.pid()).await?;
    let machines = bench
        .client
        .clone()
        .list(full_filter())
        .await
        .context("List after the takeover")?
        .into_inner()
        .machines
        .len();
    if machines != size {
        bail!("the new leader lists {machines} machines, not {size}");
    }
    match leader.memory_kib() {
        Ok((hwm, _)) => report.line(format!(
            "rss_peak_mib={:.1} size={size} state=postgres after=takeover+full_list",
            hwm as f64 / 1024.0
        )),
        Err(e) => report.line(format!(
            "rss_peak_mib=skipped size={size} state=postgres reason={e:#}"
        )),
    }
    drop(bench);
    leader.kill().await?;
    Ok(())
}

/// The status `/readyz` answers now (0 when it cannot be reached).
async fn readyz(probes: SocketAddr) -> Result<u16> {
    tokio::task::spawn_blocking(move || {
        provider_testkit::http::get(probes, "/readyz").map_or(0, |r| r.status)
    })
    .await
    .context("the /readyz probe task")
}

/// Poll `/readyz` until it answers 200.
async fn wait_ready(probes: SocketAddr) -> Result<()> {
    let deadline = Instant::now() + TAKEOVER_LIMIT;
    while readyz(probes).await? != 200 {
        if Instant::now() > deadline {
            bail!("the standby was not ready {TAKEOVER_LIMIT:?} after the leader died");
        }
        tokio::time::sleep(READY_POLL).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_another_database_and_keeps_the_query() {
        let url = "postgres://bf@127.0.0.1:5432/postgres?sslmode=disable&sslrootcert=/x/ca.pem";
        assert_eq!(
            with_database(url, "bf_bench_1").unwrap(),
            "postgres://bf@127.0.0.1:5432/bf_bench_1?sslmode=disable&sslrootcert=/x/ca.pem"
        );
        assert_eq!(
            with_database("postgres://bf@h:1", "d").unwrap(),
            "postgres://bf@h:1/d"
        );
        assert!(with_database("not a url", "d").is_err());
    }

    #[test]
    fn client_url_drops_only_sslrootcert() {
        assert_eq!(
            client_url("postgres://bf@h/db?sslmode=disable&sslrootcert=/x/ca.pem"),
            "postgres://bf@h/db?sslmode=disable"
        );
        assert_eq!(
            client_url("postgres://bf@h/db?sslrootcert=/x"),
            "postgres://bf@h/db"
        );
        assert_eq!(client_url("postgres://bf@h/db"), "postgres://bf@h/db");
    }
}
