//! The node memory guard: never start a VM that its node cannot hold.
//!
//! Proxmox VE does not refuse to start a VM that overcommits its node (QEMU
//! allocates lazily): an overcommitted node swaps or its OOM killer ends
//! QEMU processes, other people's VMs among them. So before any clone the
//! guard adds up, for the target node:
//!
//! - the configured memory (`maxmem`, the `memory` option; a balloon
//!   minimum does not reduce it) of every VM that runs there or is about to,
//!   whoever owns it, as the substrate's [`NodeView`] lists them;
//! - the provider's own Creates in flight there (their claims: not yet
//!   visible as running VMs);
//! - this Create;
//!
//! and refuses when the sum would pass `limit × the node's memory`.
//!
//! It is race-free without holding a lock across a clone: the view is read
//! first, then one short critical section per check compares and records
//! the claim, which lives until the Create's outcome lands ([`MemoryClaim`]
//! gives it back on drop). A claim given back while a check's view was
//! being read is still counted by that check, unless the view already shows
//! its VM: a VM that just started may be missing from a view read a moment
//! before, and counting it once too often is the safe error.
//!
//! The real substrate and the fake one feed the same guard, each with its
//! own view of the node, so the fake backend's lanes certify this code.
//!
//! One file (about 600 lines with its tests): the ledger, the view tickets
//! and the reservations share one private state, and each drop edits it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

const MIB: u64 = 1 << 20;

/// A VM that counts against its node: running, or about to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CountedVm {
    pub vmid: u32,
    pub name: Option<String>,
    /// Configured memory (`maxmem`), MiB.
    pub memory_mib: u64,
    /// A clone still being copied, with no name yet: it may be one a
    /// provider process that died started (see [`MemoryGuard::claim`]).
    pub unnamed_clone: bool,
}

/// What one read of the substrate says of a node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeView {
    /// The node's memory (`maxmem`), MiB.
    pub memory_mib: u64,
    /// Only the VMs that count (running or about to run; templates and
    /// stopped VMs do not), with the provider's own clones in flight left
    /// out: their claims count them.
    pub vms: Vec<CountedVm>,
}

/// What a Create asks of the guard.
#[derive(Clone, Debug)]
pub struct ClaimRequest {
    pub machine_id: String,
    pub node: String,
    pub instance_type: String,
    pub memory_mib: u64,
    /// The name its VM gets once cloned: a VM of that name in a view is
    /// this claim's, counted once.
    pub vm_name: String,
}

/// The room of one node as last checked.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryRoom {
    pub node: String,
    /// The node's memory, MiB.
    pub memory_mib: u64,
    /// Configured memory of the VMs that run or are about to, plus the
    /// provider's Creates in flight, MiB.
    pub committed_mib: u64,
    /// `limit × memory`, MiB (the whole memory when the guard is off).
    pub limit_mib: u64,
}

impl MemoryRoom {
    /// MiB still free under the limit.
    pub fn left_mib(&self) -> u64 {
        self.limit_mib.saturating_sub(self.committed_mib)
    }

    /// How many more machines of `memory_mib` fit under the limit.
    pub fn fits(&self, memory_mib: u64) -> u64 {
        self.left_mib().checked_div(memory_mib).unwrap_or(0)
    }
}

/// A Create the node has no room for.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error(
    "node {node} has no memory for machine {machine_id}: instance type {instance_type} needs \
     {needed_mib} MiB and {left_mib} MiB is left under the node memory limit ({committed_mib} MiB \
     committed to running and starting VMs and Creates in flight, of {limit_mib} MiB = \
     --node-memory-limit {ratio} x {memory_mib} MiB); create the machine on another node, or \
     free memory on this one"
)]
pub struct NoRoom {
    pub node: String,
    pub machine_id: String,
    pub instance_type: String,
    pub needed_mib: u64,
    pub left_mib: u64,
    pub committed_mib: u64,
    pub limit_mib: u64,
    pub ratio: f64,
    pub memory_mib: u64,
}

/// One Create's memory, counted from its admission until its outcome lands.
#[derive(Clone, Debug)]
struct Claim {
    memory_mib: u64,
    vm_name: String,
    /// Reservations sharing it (a repeated admission of the same machine,
    /// the Create that runs after its admission).
    holders: usize,
    /// Claimed by a Create resumed after a restart, whose clone may be in
    /// the view as an unnamed clone.
    resumed: bool,
}

#[derive(Default)]
struct NodeLedger {
    claims: HashMap<String, Claim>,
    /// Claims given back, with the read generation current then; kept for
    /// the checks whose view was read before.
    released: Vec<(u64, Claim)>,
    last: Option<MemoryRoom>,
}

#[derive(Default)]
struct Ledger {
    nodes: BTreeMap<String, NodeLedger>,
    /// Generations of the views being read now.
    reading: BTreeMap<u64, usize>,
}

/// The guard: per-node claims and the last room seen per node.
pub struct MemoryGuard {
    /// `--node-memory-limit`; 0 = off.
    ratio: f64,
    generation: AtomicU64,
    ledger: Mutex<Ledger>,
}

/// A view being read; the claims given back from now on are counted by the
/// check it serves.
pub struct ViewTicket {
    guard: Arc<MemoryGuard>,
    generation: u64,
}

impl Drop for ViewTicket {
    fn drop(&mut self) {
        let mut ledger = self.guard.ledger.lock();
        if let Some(n) = ledger.reading.get_mut(&self.generation) {
            *n -= 1;
            if *n == 0 {
                ledger.reading.remove(&self.generation);
            }
        }
        prune(&mut ledger);
    }
}

/// A Create's claim on its node's memory; given back on drop.
pub struct MemoryClaim {
    guard: Arc<MemoryGuard>,
    node: String,
    machine_id: String,
}

impl std::fmt::Debug for MemoryClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MemoryClaim({} on {})", self.machine_id, self.node)
    }
}

impl Drop for MemoryClaim {
    fn drop(&mut self) {
        let now = self.guard.generation.load(Ordering::SeqCst);
        let mut ledger = self.guard.ledger.lock();
        let Some(node) = ledger.nodes.get_mut(&self.node) else {
            return;
        };
        let gone = match node.claims.get_mut(&self.machine_id) {
            Some(claim) if claim.holders > 1 => {
                claim.holders -= 1;
                None
            }
            Some(_) => node.claims.remove(&self.machine_id),
            None => None,
        };
        if let Some(claim) = gone {
            node.released.push((now, claim));
        }
        prune(&mut ledger);
    }
}

/// Forgets the given-back claims no view being read can be missing.
fn prune(ledger: &mut Ledger) {
    let oldest = ledger.reading.keys().next().copied();
    for node in ledger.nodes.values_mut() {
        node.released
            .retain(|(released_at, _)| oldest.is_some_and(|g| g <= *released_at));
    }
}

impl MemoryGuard {
    /// `ratio`: the limit as a share of each node's memory; 0 turns the
    /// guard off (it still reports room).
    pub fn new(ratio: f64) -> Arc<MemoryGuard> {
        Arc::new(MemoryGuard {
            ratio,
            generation: AtomicU64::new(0),
            ledger: Mutex::new(Ledger::default()),
        })
    }

    pub fn enabled(&self) -> bool {
        self.ratio > 0.0
    }

    pub fn ratio(&self) -> f64 {
        self.ratio
    }

    /// Call before reading a node's view for [`MemoryGuard::claim`].
    pub fn reading(self: &Arc<Self>) -> ViewTicket {
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        *self.ledger.lock().reading.entry(generation).or_default() += 1;
        ViewTicket {
            guard: Arc::clone(self),
            generation,
        }
    }

    /// Whether `machine_id` holds a claim on `node` (admitted, in flight).
    pub fn holds(&self, node: &str, machine_id: &str) -> bool {
        self.ledger
            .lock()
            .nodes
            .get(node)
            .is_some_and(|n| n.claims.contains_key(machine_id))
    }

    /// The machines holding a claim on `node`.
    pub fn claimants(&self, node: &str) -> HashSet<String> {
        self.ledger
            .lock()
            .nodes
            .get(node)
            .map(|n| n.claims.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Another holder of a claim the machine already has on the node (its
    /// admission's, when the Create runs); `None` when it has none.
    pub fn rejoin(self: &Arc<Self>, node: &str, machine_id: &str) -> Option<MemoryClaim> {
        let mut ledger = self.ledger.lock();
        let claim = ledger.nodes.get_mut(node)?.claims.get_mut(machine_id)?;
        claim.holders += 1;
        Some(MemoryClaim {
            guard: Arc::clone(self),
            node: node.to_string(),
            machine_id: machine_id.to_string(),
        })
    }

    /// Checks the room of `req.node` against `view` (read under `ticket`)
    /// and claims the machine's memory there. A machine that already holds
    /// a claim on the node shares it, unchecked: it was admitted. With
    /// `force`, claims without checking (a Create resumed after a restart:
    /// admitted by the process before). Its clone, if the process before
    /// started one, may be in the view as an unnamed clone (PVE names a
    /// clone only when its copy ends), which cannot be told from another's:
    /// each resumed claim stands for one unnamed clone of the node, the
    /// smallest first, so that one is counted once.
    pub fn claim(
        self: &Arc<Self>,
        ticket: &ViewTicket,
        view: &NodeView,
        req: &ClaimRequest,
        force: bool,
    ) -> Result<MemoryClaim, NoRoom> {
        let mut ledger = self.ledger.lock();
        let node = ledger.nodes.entry(req.node.clone()).or_default();
        let reservation = || MemoryClaim {
            guard: Arc::clone(self),
            node: req.node.clone(),
            machine_id: req.machine_id.clone(),
        };
        if let Some(claim) = node.claims.get_mut(&req.machine_id) {
            claim.holders += 1;
            return Ok(reservation());
        }
        let room = self.room_of(&req.node, node, ticket.generation, view);
        node.last = Some(room.clone());
        if !force && self.enabled() && room.committed_mib + req.memory_mib > room.limit_mib {
            return Err(NoRoom {
                node: req.node.clone(),
                machine_id: req.machine_id.clone(),
                instance_type: req.instance_type.clone(),
                needed_mib: req.memory_mib,
                left_mib: room.left_mib(),
                committed_mib: room.committed_mib,
                limit_mib: room.limit_mib,
                ratio: self.ratio,
                memory_mib: room.memory_mib,
            });
        }
        node.claims.insert(
            req.machine_id.clone(),
            Claim {
                memory_mib: req.memory_mib,
                vm_name: req.vm_name.clone(),
                holders: 1,
                resumed: force,
            },
        );
        if let Some(last) = &mut node.last {
            last.committed_mib += req.memory_mib;
        }
        Ok(reservation())
    }

    /// Records the room `view` shows (start-up line, metrics) without
    /// claiming anything.
    pub fn observe(&self, node: &str, ticket: &ViewTicket, view: &NodeView) -> MemoryRoom {
        let mut ledger = self.ledger.lock();
        let entry = ledger.nodes.entry(node.to_string()).or_default();
        let room = self.room_of(node, entry, ticket.generation, view);
        entry.last = Some(room.clone());
        room
    }

    /// The room of every node as last checked or observed, by node name.
    pub fn rooms(&self) -> Vec<MemoryRoom> {
        self.ledger
            .lock()
            .nodes
            .values()
            .filter_map(|n| n.last.clone())
            .collect()
    }

    fn room_of(&self, name: &str, node: &NodeLedger, read_at: u64, view: &NodeView) -> MemoryRoom {
        let listed: HashSet<&str> = view.vms.iter().filter_map(|v| v.name.as_deref()).collect();
        let claimed: HashSet<&str> = node.claims.values().map(|c| c.vm_name.as_str()).collect();
        // A listed VM that is a claim's (by its name) is counted by the claim.
        let running: u64 = view
            .vms
            .iter()
            .filter(|v| !v.unnamed_clone)
            .filter(|v| v.name.as_deref().is_none_or(|n| !claimed.contains(n)))
            .map(|v| v.memory_mib)
            .sum();
        // Unnamed clones beyond those the resumed claims stand for.
        let mut unnamed: Vec<u64> = view
            .vms
            .iter()
            .filter(|v| v.unnamed_clone)
            .map(|v| v.memory_mib)
            .collect();
        unnamed.sort_unstable();
        let resumed = node.claims.values().filter(|c| c.resumed).count();
        let unnamed: u64 = unnamed.iter().skip(resumed).sum();
        let in_flight: u64 = node.claims.values().map(|c| c.memory_mib).sum();
        // Given back after this view was read, and not in it: it may be a VM
        // that started too late for the view.
        let just_landed: u64 = node
            .released
            .iter()
            .filter(|(at, c)| *at >= read_at && !listed.contains(c.vm_name.as_str()))
            .map(|(_, c)| c.memory_mib)
            .sum();
        let limit_mib = if self.enabled() {
            (view.memory_mib as f64 * self.ratio).floor() as u64
        } else {
            view.memory_mib
        };
        MemoryRoom {
            node: name.to_string(),
            memory_mib: view.memory_mib,
            committed_mib: running + unnamed + in_flight + just_landed,
            limit_mib,
        }
    }
}

/// A memory size as whole MiB: bytes, or a number with a binary unit,
/// `K`/`M`/`G`/`T` or `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024, as PVE writes
/// sizes). Decimal units (`GB`) are refused rather than guessed at.
pub fn parse_size_mib(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.trim() {
        "" | "B" => 0,
        "K" | "KiB" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        "T" | "TiB" => 40,
        "P" | "PiB" => 50,
        other => {
            return Err(format!(
                "size {t:?}: unit {other:?} is not one of K, M, G, T, P (powers of 1024, also \
                 written KiB ... PiB); give bytes or one of those, e.g. 16G"
            ))
        }
    };
    let n: u64 = num.parse().map_err(|_| {
        format!("size {t:?}: expected a whole number and an optional unit, e.g. 16G")
    })?;
    let bytes = n
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("size {t:?} does not fit in 64 bits of bytes"))?;
    if bytes < MIB {
        return Err(format!("size {t:?}: a node needs at least 1 MiB"));
    }
    Ok(bytes / MIB)
}

/// A node memory limit ratio: a finite share, 0 (off) or more.
pub fn parse_limit(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(r) if r.is_finite() && r >= 0.0 => Ok(r),
        _ => Err(format!(
            "{text:?} is not a share of a node's memory: give 0 (off) or a positive number such \
             as 1.0 (never commit more than the node has) or 0.9"
        )),
    }
}

/// Bytes (a `maxmem`) as whole MiB, rounded up: a VM never counts for less
/// than it has.
pub fn bytes_to_mib(bytes: u64) -> u64 {
    bytes.div_ceil(MIB)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(id: &str, mib: u64) -> ClaimRequest {
        ClaimRequest {
            machine_id: id.into(),
            node: "pve1".into(),
            instance_type: "pve.medium".into(),
            memory_mib: mib,
            vm_name: format!("vm-{id}"),
        }
    }

    fn view(vms: &[(&str, u64)]) -> NodeView {
        NodeView {
            memory_mib: 16 * 1024,
            vms: vms
                .iter()
                .enumerate()
                .map(|(i, (name, mib))| CountedVm {
                    vmid: 100 + i as u32,
                    name: Some(name.to_string()),
                    memory_mib: *mib,
                    unnamed_clone: false,
                })
                .collect(),
        }
    }

    #[test]
    fn claims_fill_the_node_and_refuse_past_the_limit() {
        let guard = MemoryGuard::new(1.0);
        let t = guard.reading();
        let v = view(&[("foreign", 4096)]);
        let held: Vec<_> = (0..3)
            .map(|i| guard.claim(&t, &v, &req(&format!("m{i}"), 4096), false))
            .collect::<Result<_, _>>()
            .expect("three fit beside the foreign VM");
        let refused = guard.claim(&t, &v, &req("m3", 4096), false).unwrap_err();
        assert_eq!((refused.left_mib, refused.committed_mib), (0, 16384));
        let text = refused.to_string();
        assert!(
            text.contains("node pve1")
                && text.contains("needs 4096 MiB")
                && text.contains("0 MiB is left"),
            "{text}"
        );
        // The same machine again shares its claim, unchecked.
        let again = guard
            .claim(&t, &v, &req("m0", 4096), false)
            .expect("shared");
        drop(held);
        assert!(guard.holds("pve1", "m0"), "still held by the second holder");
        drop(again);
        assert!(!guard.holds("pve1", "m0"));
    }

    #[test]
    fn a_claim_given_back_during_a_read_still_counts_unless_listed() {
        let guard = MemoryGuard::new(1.0);
        let early = guard.reading();
        let first = guard
            .claim(&early, &view(&[]), &req("a", 12 * 1024), false)
            .unwrap();
        let stale = guard.reading();
        // Landed: its VM runs, but the view read before does not show it.
        drop(first);
        assert!(guard
            .claim(&stale, &view(&[]), &req("b", 8 * 1024), false)
            .is_err());
        // A view that lists it counts it once.
        let listed = guard
            .claim(
                &stale,
                &view(&[("vm-a", 12 * 1024)]),
                &req("c", 4096),
                false,
            )
            .expect("fits exactly");
        drop(listed);
        drop((early, stale));
        // Read after the release: only what the view shows counts.
        let fresh = guard.reading();
        assert!(guard
            .claim(&fresh, &view(&[]), &req("d", 16 * 1024), false)
            .is_ok());
    }

    #[test]
    fn sizes_and_limits_parse() {
        assert_eq!(parse_size_mib("16G"), Ok(16 * 1024));
        assert_eq!(parse_size_mib("16GiB"), Ok(16 * 1024));
        assert_eq!(parse_size_mib("1048576"), Ok(1));
        assert_eq!(parse_size_mib("1024T"), Ok(1 << 30));
        for bad in ["16GB", "x", "", "1K", "99999999P"] {
            assert!(parse_size_mib(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_limit("0"), Ok(0.0));
        assert_eq!(parse_limit("1.0"), Ok(1.0));
        for bad in ["-1", "NaN", "inf", "one"] {
            assert!(parse_limit(bad).unwrap_err().contains("share"), "{bad}");
        }
    }

    #[test]
    fn a_resumed_claim_stands_for_one_unnamed_clone() {
        let guard = MemoryGuard::new(1.0);
        let t = guard.reading();
        let clone = |vmid, mib| CountedVm {
            vmid,
            name: None,
            memory_mib: mib,
            unnamed_clone: true,
        };
        let v = NodeView {
            memory_mib: 16 * 1024,
            vms: vec![clone(200, 512), clone(201, 2048)],
        };
        let _resumed = guard.claim(&t, &v, &req("r", 4096), true).expect("forced");
        // 4096 (the resumed claim) + 2048 (the other unnamed clone).
        let room = guard.observe("pve1", &t, &v);
        assert_eq!(room.committed_mib, 6144);
    }

    #[test]
    fn off_never_refuses_and_forced_claims_are_not_checked() {
        let off = MemoryGuard::new(0.0);
        let t = off.reading();
        let full = view(&[("big", 64 * 1024)]);
        assert!(off.claim(&t, &full, &req("m", 4096), false).is_ok());
        assert_eq!(
            off.rooms()[0].limit_mib,
            16 * 1024,
            "room is still reported"
        );
        let on = MemoryGuard::new(0.5);
        let t = on.reading();
        assert!(on.claim(&t, &view(&[]), &req("x", 9000), false).is_err());
        assert!(on.claim(&t, &view(&[]), &req("x", 9000), true).is_ok());
        let room = &on.rooms()[0];
        assert_eq!((room.limit_mib, room.committed_mib), (8192, 9000));
        assert_eq!(room.fits(1024), 0);
    }
}
