//! Crash test for the durable profile, black-box: the real binary with
//! `--state PATH` takes a random stream of fenced mutations from several
//! concurrent clients, is SIGKILLed at a random moment, restarts on the same
//! file, and must still hold everything it acknowledged: fencing marks,
//! operation ids (idempotent retries), cluster bindings with verbatim
//! shard_metadata, and the whole inventory, whose interrupted transitions
//! resume and land (nothing is left transitional).
//!
//! Each client owns a disjoint set of machines, so every machine sees one
//! request at a time and the model knows exactly which request (if any) was
//! in flight, with an unknown outcome, at the kill.
//!
//! A state a client has read back (Get/List) counts like an acknowledgement:
//! a crash must not take it back either.
//!
//! `BIGFLEET_CRASH_ITERATIONS` (default 50) sets the number of kills;
//! `BIGFLEET_CRASH_SEED` replays a run's decisions and kill delays (the seed
//! is printed first; thread interleavings still differ between runs).

// The integration binary's helpers; this campaign, a binary of its own
// (`make crash-1000` runs it by name), uses a few.
#[allow(dead_code)]
#[path = "integration/common.rs"]
mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bigfleet_proto::v1alpha1 as pb;
use pb::capacity_provider_client::CapacityProviderClient;
use pb::MachineState as S;
use provider_testkit::wait::Wait;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tonic::transport::Channel;
use tonic::Code;

type Client = CapacityProviderClient<Channel>;

const MACHINES: usize = 64;
const TASKS: usize = 4;
const SHARDS: [&str; 2] = ["shard-a", "shard-b"];
/// Kills on one state file before starting over with a fresh one: the fake
/// substrate forgets its VMs on restart, so restored machines fail their
/// next Configure/Drain and the healthy pool shrinks with every life.
const MAX_LIVES: usize = 3;
const MIN_HEALTHY: usize = 24;
/// Kill delay after the clients start, in milliseconds.
const KILL_WINDOW_MS: std::ops::RangeInclusive<u64> = 5..=300;

// ---------------------------------------------------------------- process

/// A provider process on a state file; SIGKILLed on drop.
struct Proc {
    child: Child,
    addr: SocketAddr,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    fn start(state: &Path) -> Proc {
        let mut child = Command::new(common::BIN)
            .args([
                "--use-fake-backend",
                "--seed-count",
                &MACHINES.to_string(),
                "--addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "",
                "--state",
                common::path_str(state),
                "--fake-latency",
                "20ms",
                "--reconcile-interval",
                "0",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn bigfleet-proxmox");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if provider_testkit::is_startup_line(&line) {
                    let _ = tx.send(line.clone());
                }
                sink.lock().unwrap().push(line);
            }
        });
        // A closed stream (the child died) ends the wait at once.
        let line = rx.recv_timeout(common::STARTUP_DEADLINE);
        let addr = line
            .as_ref()
            .ok()
            .and_then(|l| provider_testkit::addr_field(l, "addr").ok());
        let Some(addr) = addr else {
            let _ = child.kill();
            let _ = child.wait();
            // The pipe closes with the child: the reader ends having read it all.
            let _ = reader.join();
            panic!(
                "the provider on {} did not start serving; stderr:\n{}",
                state.display(),
                lines.lock().unwrap().join("\n")
            );
        };
        Proc { child, addr, lines }
    }

    /// SIGKILL, then reap.
    fn kill(&mut self) {
        self.child.kill().expect("SIGKILL the provider");
        self.child.wait().expect("reap the provider");
    }

    fn stderr_tail(&self, n: usize) -> String {
        let lines = self.lines.lock().unwrap();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    async fn client(&self) -> Client {
        CapacityProviderClient::new(common::plain_channel(self.addr).await)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

fn start_blocking(state: &Path) -> Proc {
    tokio::task::block_in_place(|| Proc::start(state))
}

// ------------------------------------------------------------------ model

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Create,
    Configure,
    Drain,
    Delete,
}

impl Kind {
    fn via(self) -> S {
        match self {
            Kind::Create => S::Creating,
            Kind::Configure => S::Configuring,
            Kind::Drain => S::Draining,
            Kind::Delete => S::Deleting,
        }
    }

    fn to(self) -> S {
        match self {
            Kind::Create => S::Idle,
            Kind::Configure => S::Configured,
            Kind::Drain => S::Idle,
            Kind::Delete => S::Speculative,
        }
    }

    /// A legal new transition out of stable state `s`.
    fn out_of(s: S, rng: &mut StdRng) -> Option<Kind> {
        match s {
            S::Speculative => Some(Kind::Create),
            S::Idle if rng.random_bool(0.7) => Some(Kind::Configure),
            S::Idle => Some(Kind::Delete),
            S::Configured => Some(Kind::Drain),
            _ => None,
        }
    }
}

fn state_of(m: &pb::Machine) -> S {
    S::try_from(m.state).unwrap_or(S::Unspecified)
}

fn transitional(s: S) -> bool {
    matches!(s, S::Creating | S::Configuring | S::Draining | S::Deleting)
}

/// A fencing token; the derived order is the contract's lexicographic one.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug, Default)]
struct Tok {
    epoch: i64,
    seq: i64,
}

/// A token as sent; an empty shard is the absent token.
#[derive(Clone, Debug)]
struct Sent {
    shard: String,
    tok: Tok,
}

#[derive(Clone, Debug, PartialEq)]
struct Binding {
    cluster: String,
    metadata: HashMap<String, String>,
}

#[derive(Clone, Debug)]
struct Acked {
    kind: Kind,
    op: String,
    binding: Option<Binding>,
}

/// A request sent whose reply never came: it may or may not have applied.
#[derive(Clone, Debug)]
struct Intent {
    kind: Kind,
    binding: Option<Binding>,
}

/// What the test knows about one machine.
#[derive(Clone, Debug, Default)]
struct Track {
    id: String,
    /// The latest Get/List snapshot.
    base: Option<pb::Machine>,
    /// `base` was taken after `last_ack`, so it includes it.
    base_after_ack: bool,
    /// The latest acknowledged new transition (its operation id).
    last_ack: Option<Acked>,
    /// A new transition in flight at the kill.
    inflight: Option<Intent>,
    /// Highest token sent / acknowledged per shard.
    sent: BTreeMap<String, Tok>,
    acked: BTreeMap<String, Tok>,
}

impl Track {
    fn observe(&mut self, m: pb::Machine) {
        self.base = Some(m);
        self.base_after_ack = true;
    }

    /// A token strictly newer than any sent for this machine (so newer than
    /// any mark an unacknowledged request may have left), or absent.
    fn fresh_token(&mut self, rng: &mut StdRng, allow_absent: bool) -> Sent {
        if allow_absent && rng.random_bool(0.1) {
            return Sent {
                shard: String::new(),
                tok: Tok::default(),
            };
        }
        let shard = SHARDS[rng.random_range(0..SHARDS.len())].to_string();
        self.fresh_on(&shard, rng)
    }

    fn fresh_on(&mut self, shard: &str, rng: &mut StdRng) -> Sent {
        let tok = match self.sent.get(shard).copied() {
            None => Tok {
                epoch: rng.random_range(0..=3),
                seq: rng.random_range(1..=5),
            },
            // A higher epoch resets the sequence space.
            Some(p) if rng.random_bool(0.15) => Tok {
                epoch: p.epoch + rng.random_range(1..=2),
                seq: rng.random_range(0..=3),
            },
            Some(p) => Tok {
                epoch: p.epoch,
                seq: p.seq + rng.random_range(1..=3),
            },
        };
        self.sent.insert(shard.to_string(), tok);
        Sent {
            shard: shard.to_string(),
            tok,
        }
    }

    /// A token not strictly newer than an acknowledged one, if any.
    fn stale_token(&self, rng: &mut StdRng) -> Option<Sent> {
        if self.acked.is_empty() {
            return None;
        }
        let (shard, mark) = self
            .acked
            .iter()
            .nth(rng.random_range(0..self.acked.len()))?;
        let tok = match rng.random_range(0..3) {
            0 => *mark,
            1 if mark.seq > 0 => Tok {
                epoch: mark.epoch,
                seq: rng.random_range(0..mark.seq),
            },
            // An older epoch with any sequence, int64::MAX included.
            _ if mark.epoch > 0 => Tok {
                epoch: mark.epoch - 1,
                seq: i64::MAX,
            },
            _ => *mark,
        };
        Some(Sent {
            shard: shard.clone(),
            tok,
        })
    }

    fn note_acked(&mut self, sent: &Sent) {
        if sent.shard.is_empty() {
            return;
        }
        let e = self.acked.entry(sent.shard.clone()).or_default();
        *e = (*e).max(sent.tok);
    }
}

fn random_binding(rng: &mut StdRng) -> Binding {
    const KEYS: [&str; 6] = ["", "é", "\u{0}", "\t\n", "日本", "x-y.z/w"];
    const VALUES: [&str; 6] = ["", "v", "\u{1}\u{7f}", "zone=a", " padded ", "ünï\u{0}cøde"];
    let n = rng.random_range(0..=5);
    let metadata = (0..n)
        .map(|k| {
            let key = format!("k{k}{}", KEYS[rng.random_range(0..KEYS.len())]);
            let value = format!(
                "{}{}",
                VALUES[rng.random_range(0..VALUES.len())],
                rng.random_range(0..1000)
            );
            (key, value)
        })
        .collect();
    Binding {
        cluster: format!("cluster-{}", rng.random_range(0..5)),
        metadata,
    }
}

async fn send(
    client: &mut Client,
    id: &str,
    kind: Kind,
    binding: Option<&Binding>,
    t: &Sent,
) -> Result<pb::TransitionAck, tonic::Status> {
    let machine_id = id.to_string();
    let (shard_id, shard_epoch, sequence_number) = (t.shard.clone(), t.tok.epoch, t.tok.seq);
    let reply = match kind {
        Kind::Create => {
            client
                .create(pb::CreateRequest {
                    machine_id,
                    shard_id,
                    shard_epoch,
                    sequence_number,
                })
                .await
        }
        Kind::Configure => {
            let b = binding.cloned().unwrap_or(Binding {
                cluster: "cluster-probe".into(),
                metadata: HashMap::new(),
            });
            client
                .configure(pb::ConfigureRequest {
                    machine_id,
                    cluster_id: b.cluster,
                    bootstrap_blob: b"#!/bin/sh\necho join\n".to_vec(),
                    shard_id,
                    shard_epoch,
                    sequence_number,
                    shard_metadata: b.metadata,
                })
                .await
        }
        Kind::Drain => {
            client
                .drain(pb::DrainRequest {
                    machine_id,
                    grace_period_seconds: 0,
                    shard_id,
                    shard_epoch,
                    sequence_number,
                })
                .await
        }
        Kind::Delete => {
            client
                .delete(pb::DeleteRequest {
                    machine_id,
                    shard_id,
                    shard_epoch,
                    sequence_number,
                })
                .await
        }
    };
    reply.map(|r| r.into_inner())
}

/// Operation ids issued so far on one state file, across all its lives.
type Ops = Arc<Mutex<HashSet<String>>>;

fn mint(ops: &Ops, op: &str, ctx: &str, what: &str) {
    assert!(
        ops.lock().unwrap().insert(op.to_string()),
        "{ctx}: (e) operation id {op:?} for {what} was already issued before"
    );
}

// ------------------------------------------------------------------ drive

#[derive(Default)]
struct Stats {
    acks: u64,
    retries: u64,
    probes: u64,
}

/// One client: random legal mutations, idempotent retries and stale-token
/// probes on its own machines until `stop`.
async fn drive(
    mut client: Client,
    mut tracks: Vec<Track>,
    mut rng: StdRng,
    stop: Arc<AtomicBool>,
    ops: Ops,
    ctx: Arc<String>,
) -> (Vec<Track>, Stats) {
    let mut stats = Stats::default();
    let alive = |stop: &AtomicBool| !stop.load(Ordering::SeqCst);
    while alive(&stop) && !tracks.is_empty() {
        let i = rng.random_range(0..tracks.len());
        let t = &mut tracks[i];
        let m = match client.get(pb::MachineRef { id: t.id.clone() }).await {
            Ok(r) => r.into_inner(),
            Err(_) if !alive(&stop) => break,
            Err(e) => panic!("{ctx}: Get {} failed while the provider was up: {e}", t.id),
        };
        let s = state_of(&m);
        if let (
            S::Configured,
            Some(
                a @ Acked {
                    kind: Kind::Configure,
                    ..
                },
            ),
        ) = (s, &t.last_ack)
        {
            assert_eq!(
                Some(&Binding {
                    cluster: m.cluster.clone(),
                    metadata: m.shard_metadata.clone()
                }),
                a.binding.as_ref(),
                "{ctx}: (c) {} is CONFIGURED before any kill with a binding other than \
                 the acknowledged Configure's",
                t.id
            );
        }
        t.observe(m);
        // (kind, binding, token, is_retry, is_probe)
        let plan = if s == S::Failed {
            None
        } else if transitional(s) {
            match &t.last_ack {
                Some(a) if a.kind.via() == s && rng.random_bool(0.5) => Some((
                    a.kind,
                    a.binding.clone(),
                    t.fresh_token(&mut rng, true),
                    true,
                    false,
                )),
                _ => None,
            }
        } else {
            let roll: f64 = rng.random();
            let stale = t.stale_token(&mut rng);
            let retry_kind = t.last_ack.as_ref().filter(|a| a.kind.to() == s).cloned();
            match (roll, stale, retry_kind) {
                (r, Some(stale), _) if r < 0.1 => {
                    Kind::out_of(s, &mut rng).map(|k| (k, None, stale, false, true))
                }
                (r, _, Some(a)) if r < 0.2 => Some((
                    a.kind,
                    a.binding,
                    t.fresh_token(&mut rng, true),
                    true,
                    false,
                )),
                _ => Kind::out_of(s, &mut rng).map(|k| {
                    let b = (k == Kind::Configure).then(|| random_binding(&mut rng));
                    (k, b, t.fresh_token(&mut rng, true), false, false)
                }),
            }
        };
        let Some((kind, binding, token, retry, probe)) = plan else {
            // A client's random idle between requests: the workload's own
            // pacing, not a wait for anything.
            let pause = rng.random_range(0..4);
            tokio::time::sleep(Duration::from_millis(pause)).await;
            continue;
        };
        if !retry && !probe {
            t.inflight = Some(Intent {
                kind,
                binding: binding.clone(),
            });
        }
        match send(&mut client, &t.id, kind, binding.as_ref(), &token).await {
            Ok(ack) => {
                assert!(
                    !probe,
                    "{ctx}: (a) stale token {token:?} for {kind:?} on {} was accepted before \
                     any kill (operation {})",
                    t.id, ack.operation_id
                );
                stats.acks += 1;
                t.note_acked(&token);
                if retry {
                    stats.retries += 1;
                    let want = t.last_ack.as_ref().map(|a| a.op.as_str());
                    assert_eq!(
                        Some(ack.operation_id.as_str()),
                        want,
                        "{ctx}: (b) an idempotent {kind:?} retry on {} returned another \
                         operation id before any kill",
                        t.id
                    );
                } else {
                    mint(
                        &ops,
                        &ack.operation_id,
                        &ctx,
                        &format!("{kind:?} on {}", t.id),
                    );
                    t.last_ack = Some(Acked {
                        kind,
                        op: ack.operation_id,
                        binding,
                    });
                    t.base_after_ack = false;
                    t.inflight = None;
                }
            }
            Err(e) if probe && e.code() == Code::FailedPrecondition => stats.probes += 1,
            // Cut by the kill: the outcome stays unknown (`inflight`).
            Err(_) if !alive(&stop) => break,
            // The transition failed between our Get and the retry.
            Err(e) if retry && transitional(s) && e.code() != Code::FailedPrecondition => {
                let now = client.get(pb::MachineRef { id: t.id.clone() }).await;
                match now {
                    Ok(m) if state_of(m.get_ref()) == S::Failed => t.observe(m.into_inner()),
                    Err(_) if !alive(&stop) => break,
                    other => panic!(
                        "{ctx}: a {kind:?} retry on {} ({s:?}) was rejected ({e}) but the \
                         machine is not FAILED: {other:?}",
                        t.id
                    ),
                }
            }
            Err(e) => panic!(
                "{ctx}: {kind:?} on {} ({s:?}, token {token:?}, retry={retry}) was rejected \
                 while the provider was up: {e}",
                t.id
            ),
        }
    }
    (tracks, stats)
}

// ----------------------------------------------------------------- verify

/// One acceptable post-restart shape of a machine.
enum Outcome {
    /// Exactly this snapshot (state, host, binding, metadata, last_error).
    Exact(Box<pb::Machine>),
    /// A landed transition: this stable state, with this binding if CONFIGURED.
    Landed(S, Option<Binding>),
    /// FAILED with a non-empty last_error.
    Failed,
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Exact(m) => write!(f, "exactly [{}]", brief(m)),
            Outcome::Landed(s, b) => write!(f, "landed {s:?} with binding {b:?}"),
            Outcome::Failed => write!(f, "FAILED with a last_error"),
        }
    }
}

fn allowed(t: &Track) -> Vec<Outcome> {
    let mut out = Vec::new();
    let exact = t
        .base
        .as_ref()
        .filter(|b| !transitional(state_of(b)) && (t.last_ack.is_none() || t.base_after_ack));
    match (exact, &t.last_ack) {
        (Some(b), _) => out.push(Outcome::Exact(Box::new(b.clone()))),
        (None, Some(a)) => {
            out.push(Outcome::Landed(a.kind.to(), a.binding.clone()));
            out.push(Outcome::Failed);
        }
        (None, None) => {}
    }
    if let Some(i) = &t.inflight {
        out.push(Outcome::Landed(i.kind.to(), i.binding.clone()));
        out.push(Outcome::Failed);
    }
    out
}

fn fits(o: &Outcome, m: &pb::Machine) -> bool {
    let s = state_of(m);
    match o {
        Outcome::Exact(b) => {
            s == state_of(b)
                && m.host == b.host
                && m.cluster == b.cluster
                && m.shard_metadata == b.shard_metadata
                && m.last_error == b.last_error
        }
        Outcome::Failed => s == S::Failed && !m.last_error.is_empty(),
        Outcome::Landed(want, binding) => {
            let bound = Binding {
                cluster: m.cluster.clone(),
                metadata: m.shard_metadata.clone(),
            };
            s == *want
                && match s {
                    S::Configured => m.host.is_some() && binding.as_ref() == Some(&bound),
                    S::Idle => {
                        m.host.is_some() && m.cluster.is_empty() && bound.metadata.is_empty()
                    }
                    S::Speculative => {
                        m.host.is_none() && m.cluster.is_empty() && bound.metadata.is_empty()
                    }
                    _ => false,
                }
        }
    }
}

/// The lifecycle fields of a machine, for failure messages.
fn brief(m: &pb::Machine) -> String {
    format!(
        "{:?} host={:?} cluster={:?} shard_metadata={:?} last_error={:?}",
        state_of(m),
        m.host.as_ref().map(|h| &h.r#ref),
        m.cluster,
        m.shard_metadata,
        m.last_error
    )
}

fn property(o: &[Outcome]) -> &'static str {
    let configured = o.iter().any(|o| match o {
        Outcome::Exact(b) => state_of(b) == S::Configured,
        Outcome::Landed(s, _) => *s == S::Configured,
        Outcome::Failed => false,
    });
    if configured {
        "(c) binding/metadata or (d) state"
    } else {
        "(d) state"
    }
}

#[derive(Default)]
struct Checked {
    retries: u64,
    fence_probes: u64,
    failed_rejections: u64,
    fresh_mints: u64,
}

/// Check one machine after a restart against the model, then rebase the
/// model on what the provider now holds.
async fn verify_machine(
    mut client: Client,
    mut t: Track,
    post: pb::Machine,
    mut rng: StdRng,
    ops: Ops,
    ctx: Arc<String>,
    life: usize,
) -> (Track, Checked) {
    let mut checked = Checked::default();
    let id = t.id.clone();
    let s = state_of(&post);
    let outcomes = allowed(&t);
    assert!(
        outcomes.iter().any(|o| fits(o, &post)),
        "{ctx}: {} violated for machine {id}: after the restart it is {}\nbut the acknowledged \
         history allows only {outcomes:?}\nmodel: last_ack={:?} inflight={:?} \
         base_after_ack={} base={}",
        property(&outcomes),
        brief(&post),
        t.last_ack,
        t.inflight,
        t.base_after_ack,
        t.base.as_ref().map_or("none".into(), brief),
    );
    // Did the state come from the unacknowledged request? Then its op id is
    // unknown and `last_ack` no longer describes the machine.
    let from_inflight = t.inflight.as_ref().is_some_and(|i| i.kind.to() == s)
        && !t
            .base
            .as_ref()
            .is_some_and(|b| t.base_after_ack && state_of(b) == s);
    let mut keep_ack = None;
    if s == S::Failed {
        // FAILED rejects every mutation, never with FAILED_PRECONDITION.
        let kind = t.last_ack.as_ref().map_or(Kind::Create, |a| a.kind);
        let token = t.fresh_token(&mut rng, false);
        match send(&mut client, &id, kind, None, &token).await {
            Ok(ack) => panic!(
                "{ctx}: (d) FAILED machine {id} accepted {kind:?} after the restart: {ack:?}"
            ),
            Err(e) => assert_ne!(
                e.code(),
                Code::FailedPrecondition,
                "{ctx}: (a) a fresh token {token:?} on FAILED machine {id} was fenced: {e}"
            ),
        }
        t.note_acked(&token); // a passing token advances the mark even on rejection
        checked.failed_rejections += 1;
    } else if let Some(a) = t
        .last_ack
        .clone()
        .filter(|a| a.kind.to() == s && !from_inflight)
    {
        // (b): a retry of the acknowledged transition keeps its operation id.
        let token = t.fresh_token(&mut rng, true);
        let ack = send(&mut client, &id, a.kind, a.binding.as_ref(), &token)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "{ctx}: (b) retry of acknowledged {:?} {} on {id} ({s:?}) after the restart \
                     failed: {e}",
                    a.kind, a.op
                )
            });
        assert_eq!(
            ack.operation_id, a.op,
            "{ctx}: (b) retry of acknowledged {:?} on {id} ({s:?}) after the restart returned \
             another operation id",
            a.kind
        );
        assert_eq!(
            ack.machine.as_ref().map(state_of),
            Some(s),
            "{ctx}: (b) an idempotent retry on {id} changed its state"
        );
        t.note_acked(&token);
        checked.retries += 1;
        keep_ack = Some(a);
    }
    // (a): every acknowledged mark survived; tokens not newer are fenced.
    let marks: Vec<(String, Tok)> = t.acked.iter().map(|(k, v)| (k.clone(), *v)).collect();
    for (shard, mark) in marks {
        let older = if mark.seq > 0 {
            Tok {
                epoch: mark.epoch,
                seq: mark.seq - 1,
            }
        } else {
            Tok {
                epoch: mark.epoch - 1,
                seq: i64::MAX,
            }
        };
        // Negative values are INVALID_ARGUMENT, not stale: skip them.
        for tok in [mark, older].into_iter().filter(|t| t.epoch >= 0) {
            let kind = Kind::out_of(s, &mut rng).unwrap_or(Kind::Create);
            let stale = Sent {
                shard: shard.clone(),
                tok,
            };
            match send(&mut client, &id, kind, None, &stale).await {
                Err(e) if e.code() == Code::FailedPrecondition => checked.fence_probes += 1,
                other => panic!(
                    "{ctx}: (a) fencing mark lost: token {tok:?} on shard {shard} for {id} is \
                     not newer than acknowledged {mark:?}, yet {kind:?} after the restart \
                     answered {other:?}"
                ),
            }
        }
    }
    // (e): a transition started now gets an id never issued before, and a new
    // shard's first low token is accepted.
    let mut rebased_ack = keep_ack;
    let mut after_ack = true;
    if s == S::Speculative && rng.random_bool(0.2) {
        let shard = format!("shard-life-{life}");
        let token = Sent {
            shard: shard.clone(),
            tok: Tok { epoch: 0, seq: 1 },
        };
        t.sent.insert(shard, token.tok);
        let ack = send(&mut client, &id, Kind::Create, None, &token)
            .await
            .unwrap_or_else(|e| {
                panic!("{ctx}: (e) Create on SPECULATIVE {id} after the restart failed: {e}")
            });
        mint(
            &ops,
            &ack.operation_id,
            &ctx,
            &format!("Create on {id} after the restart"),
        );
        t.note_acked(&token);
        rebased_ack = Some(Acked {
            kind: Kind::Create,
            op: ack.operation_id,
            binding: None,
        });
        after_ack = false;
        checked.fresh_mints += 1;
    }
    t.base = Some(post);
    t.base_after_ack = after_ack;
    t.last_ack = rebased_ack;
    t.inflight = None;
    (t, checked)
}

/// How long resumed transitions get to land after a restart: the fake
/// backend's latency is milliseconds, so this is only a safety bound.
const RESUME_BOUND: Duration = Duration::from_secs(10);

async fn list_all(client: &mut Client, ctx: &str) -> Vec<pb::Machine> {
    client
        .list(pb::ListFilter::default())
        .await
        .unwrap_or_else(|e| panic!("{ctx}: List failed: {e}"))
        .into_inner()
        .machines
}

/// (d) then the per-machine checks, all machines concurrently.
async fn verify(
    client: &Client,
    tracks: Vec<Track>,
    ids: &BTreeSet<String>,
    rng: &mut StdRng,
    ops: &Ops,
    ctx: &Arc<String>,
    life: usize,
) -> (Vec<Track>, Checked) {
    // Interrupted transitions resume: each lands (a stable state, or FAILED
    // with a reason) within its deadline, here far inside RESUME_BOUND.
    // The last List either way: the checks below name what did not land.
    let listed = Wait::new("every interrupted transition to land", RESUME_BOUND)
        .every(Duration::from_millis(20))
        .try_ok_async(|| async {
            let listed = list_all(&mut client.clone(), ctx).await;
            if listed.iter().all(|m| !transitional(state_of(m))) {
                Ok(listed)
            } else {
                Err(listed)
            }
        })
        .await
        .unwrap_or_else(|t| t.last);
    let mut by_id = HashMap::new();
    for m in listed {
        let s = state_of(&m);
        assert!(
            !transitional(s) && s != S::Unspecified,
            "{ctx}: (d) machine {} is {s:?} {RESUME_BOUND:?} after the restart; interrupted \
             transitions must resume and land, or recover as FAILED",
            m.id
        );
        let id = m.id.clone();
        assert!(
            by_id.insert(id.clone(), m).is_none(),
            "{ctx}: (d) machine {id} is listed twice after the restart"
        );
    }
    let got: BTreeSet<String> = by_id.keys().cloned().collect();
    assert_eq!(
        &got, ids,
        "{ctx}: (d) the inventory after the restart is not the same set of machines"
    );
    let jobs = tracks.into_iter().map(|t| {
        let post = by_id.remove(&t.id).expect("listed");
        verify_machine(
            client.clone(),
            t,
            post,
            StdRng::seed_from_u64(rng.random()),
            ops.clone(),
            ctx.clone(),
            life,
        )
    });
    let mut total = Checked::default();
    let mut out = Vec::new();
    for (t, c) in futures::future::join_all(jobs).await {
        total.retries += c.retries;
        total.fence_probes += c.fence_probes;
        total.failed_rejections += c.failed_rejections;
        total.fresh_mints += c.fresh_mints;
        out.push(t);
    }
    (out, total)
}

// ------------------------------------------------------------------- test

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not an unsigned integer")),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_state_survives_kill_9() {
    let seed = env_u64("BIGFLEET_CRASH_SEED").unwrap_or_else(|| rand::rng().random());
    let iterations = env_u64("BIGFLEET_CRASH_ITERATIONS").unwrap_or(50) as usize;
    eprintln!(
        "crash test: seed={seed} iterations={iterations} (replay: BIGFLEET_CRASH_SEED={seed})"
    );
    let began = Instant::now();
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut kills, mut acks, mut retries, mut probes) = (0usize, 0u64, 0u64, 0u64);
    let mut checked = Checked::default();
    let mut fresh_files = 0;
    while kills < iterations {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        fresh_files += 1;
        // Operation ids are unique per state file, across all its lives.
        let ops: Ops = Arc::default();
        let mut proc = start_blocking(&path);
        let mut client = proc.client().await;
        let first = list_all(&mut client, &format!("seed={seed} fresh file")).await;
        let ids: BTreeSet<String> = first.iter().map(|m| m.id.clone()).collect();
        assert_eq!(
            ids.len(),
            MACHINES,
            "seed={seed}: the seeded fleet has duplicate ids"
        );
        let mut tracks: Vec<Track> = first
            .into_iter()
            .map(|m| Track {
                id: m.id.clone(),
                base: Some(m),
                base_after_ack: true,
                ..Track::default()
            })
            .collect();
        for life in 1..=MAX_LIVES {
            kills += 1;
            let ctx = Arc::new(format!("seed={seed} iteration={kills} life={life}"));
            // Drive: disjoint machine sets per client.
            let stop = Arc::new(AtomicBool::new(false));
            let mut parts: Vec<Vec<Track>> = (0..TASKS).map(|_| Vec::new()).collect();
            for (n, t) in tracks.drain(..).enumerate() {
                parts[n % TASKS].push(t);
            }
            let tasks: Vec<_> = parts
                .into_iter()
                .map(|part| {
                    tokio::spawn(drive(
                        client.clone(),
                        part,
                        StdRng::seed_from_u64(rng.random()),
                        stop.clone(),
                        ops.clone(),
                        ctx.clone(),
                    ))
                })
                .collect();
            // The kill lands at a random point of the workload: the delay is
            // the experiment, there is nothing to wait for.
            let delay = rng.random_range(KILL_WINDOW_MS);
            tokio::time::sleep(Duration::from_millis(delay)).await;
            stop.store(true, Ordering::SeqCst);
            proc.kill();
            for task in tasks {
                let (part, stats) = task.await.unwrap_or_else(|e| {
                    panic!("{ctx}: a client task failed (see its panic above): {e}")
                });
                tracks.extend(part);
                acks += stats.acks;
                retries += stats.retries;
                probes += stats.probes;
            }
            // Restart on the same file and check.
            proc = start_blocking(&path);
            client = proc.client().await;
            let stderr_ctx = Arc::new(format!(
                "{ctx} (killed after {delay}ms; provider stderr tail:\n{}\n)",
                proc.stderr_tail(8)
            ));
            let (t, c) = verify(&client, tracks, &ids, &mut rng, &ops, &stderr_ctx, life).await;
            tracks = t;
            checked.retries += c.retries;
            checked.fence_probes += c.fence_probes;
            checked.failed_rejections += c.failed_rejections;
            checked.fresh_mints += c.fresh_mints;
            let healthy = tracks
                .iter()
                .filter(|t| t.base.as_ref().is_some_and(|b| state_of(b) != S::Failed))
                .count();
            if kills >= iterations || healthy < MIN_HEALTHY {
                break;
            }
        }
    }
    eprintln!(
        "crash test: seed={seed} kills={kills} state files={fresh_files} in {:?}; before the \
         kills: {acks} acks ({retries} idempotent retries, {probes} stale tokens fenced); after \
         restarts: {} same-id retries, {} stale tokens fenced, {} FAILED rejections, {} fresh \
         ids minted",
        began.elapsed(),
        checked.retries,
        checked.fence_probes,
        checked.failed_rejections,
        checked.fresh_mints
    );
    // The checks above must have had something to bite on.
    assert!(
        acks >= kills as u64,
        "seed={seed}: only {acks} acknowledged operations in {kills} runs"
    );
    assert!(checked.retries > 0 && checked.fence_probes > 0 && checked.fresh_mints > 0);
}

/// The narrowest window of the random test, aimed at on purpose: Creates
/// land in a burst, clients poll Get, and the provider is SIGKILLed the
/// moment any poll sees a landing. A landing a client has seen must survive
/// (it must not come back as "interrupted while CREATING").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_landing_seen_by_get_survives_an_immediate_kill() {
    const ROUNDS: usize = 20;
    for round in 1..=ROUNDS {
        let ctx = format!("round {round}/{ROUNDS}");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        let mut proc = start_blocking(&path);
        let client = proc.client().await;
        let ids: Vec<String> = list_all(&mut client.clone(), &ctx)
            .await
            .into_iter()
            .map(|m| m.id)
            .collect();
        let absent = Sent {
            shard: String::new(),
            tok: Tok::default(),
        };
        let creates = ids.iter().map(|id| {
            let mut c = client.clone();
            let absent = absent.clone();
            async move { send(&mut c, id, Kind::Create, None, &absent).await }
        });
        for r in futures::future::join_all(creates).await {
            r.unwrap_or_else(|e| panic!("{ctx}: Create before the kill failed: {e}"));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let seen: Arc<Mutex<HashMap<String, pb::Machine>>> = Arc::default();
        let landed = Arc::new(tokio::sync::Notify::new());
        let pollers: Vec<_> = ids
            .iter()
            .map(|id| {
                let (mut c, id) = (client.clone(), id.clone());
                let (stop, seen, landed) = (stop.clone(), seen.clone(), landed.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::SeqCst) {
                        let Ok(m) = c.get(pb::MachineRef { id: id.clone() }).await else {
                            break;
                        };
                        let m = m.into_inner();
                        if state_of(&m) == S::Idle {
                            seen.lock().unwrap().insert(id, m);
                            landed.notify_one();
                            break;
                        }
                    }
                })
            })
            .collect();
        landed.notified().await;
        stop.store(true, Ordering::SeqCst);
        proc.kill();
        for p in pollers {
            p.await.expect("poller");
        }
        proc = start_blocking(&path);
        let after: HashMap<String, pb::Machine> = list_all(&mut proc.client().await, &ctx)
            .await
            .into_iter()
            .map(|m| (m.id.clone(), m))
            .collect();
        let seen = seen.lock().unwrap().clone();
        let lost: Vec<String> = seen
            .iter()
            .filter(|(id, m)| {
                after
                    .get(*id)
                    .is_none_or(|a| state_of(a) != S::Idle || a.host != m.host)
            })
            .map(|(id, _)| {
                format!(
                    "{id}: seen [{}], after restart [{}]",
                    brief(&seen[id]),
                    after.get(id).map_or("missing".into(), brief)
                )
            })
            .collect();
        assert!(
            lost.is_empty(),
            "{ctx}: (c/d) {} of {} landings a Get returned before the kill were not durable:\n{}",
            lost.len(),
            seen.len(),
            lost.join("\n")
        );
        drop(proc);
    }
}

/// One writer per state, enforced on the database file: with the first
/// provider alive a second one is refused (naming the first's pid) even
/// after `<state>.lock` is deleted; once the first is killed -9, the next
/// one starts on the same state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_provider_is_refused_even_without_the_lock_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("state.db");
    let mut first = start_blocking(&path);
    let first_pid = format!("pid {}", first.child.id());
    std::fs::remove_file(dir.path().join("state.db.lock")).expect("the .lock file exists");

    let second = tokio::task::block_in_place(|| {
        common::run_to_exit(
            &[
                "--use-fake-backend",
                "--addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "",
                "--state",
                common::path_str(&path),
            ],
            common::STARTUP_DEADLINE,
        )
    });
    assert!(
        !second.status.success(),
        "a second provider on a held state must exit:\n{}",
        second.stderr
    );
    assert!(
        second.stderr.contains("in use by another provider process")
            && second.stderr.contains(&first_pid),
        "the refusal names the holder ({first_pid}):\n{}",
        second.stderr
    );
    assert!(
        !second.stderr.contains(provider_testkit::STARTUP_LINE),
        "{}",
        second.stderr
    );
    // The first one still serves its state.
    list_all(&mut first.client().await, "first after the refusal").await;

    first.kill();
    let third = start_blocking(&path);
    let lines = third.lines.lock().unwrap().join("\n");
    assert!(
        lines.contains("state loaded"),
        "the killed provider's state is loaded:\n{lines}"
    );
}
