//! The frozen, append-only extension registry: 93 behaviors in 11 areas, transcribed from
//! the certification spec. Ids are never reused or renumbered; our own additions start at B1301.

use serde::Serialize;

/// The eleven registry areas, in spec order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
pub enum Area {
    Lifecycle,
    TransitionMatrix,
    Fencing,
    Concurrency,
    Metadata,
    FieldShape,
    ListRevision,
    TimeoutsFailure,
    Durability,
    ScaleSoak,
    PropertyFuzz,
}

impl Area {
    pub const ALL: [Area; 11] = [
        Area::Lifecycle,
        Area::TransitionMatrix,
        Area::Fencing,
        Area::Concurrency,
        Area::Metadata,
        Area::FieldShape,
        Area::ListRevision,
        Area::TimeoutsFailure,
        Area::Durability,
        Area::ScaleSoak,
        Area::PropertyFuzz,
    ];

    pub fn title(self) -> &'static str {
        match self {
            Area::Lifecycle => "Lifecycle & state machine",
            Area::TransitionMatrix => "Transition matrix / errors",
            Area::Fencing => "Fencing",
            Area::Concurrency => "Concurrency & idempotency",
            Area::Metadata => "Metadata",
            Area::FieldShape => "Field shape & cost",
            Area::ListRevision => "List, revision & pagination",
            Area::TimeoutsFailure => "Timeouts & failure",
            Area::Durability => "Durability / restart",
            Area::ScaleSoak => "Scale & soak",
            Area::PropertyFuzz => "Property / fuzz",
        }
    }
}

/// Profiles a behavior can belong to.
pub const PROFILES: [&str; 6] = ["core", "cloud", "spot", "fault", "durable", "scale"];

/// Capability gates named in the registry.
pub const GATES: [&str; 3] = ["Delete", "SinceRevision", "Fault"];

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Behavior {
    pub id: &'static str,
    pub area: Area,
    pub profiles: &'static [&'static str],
    /// Capability the behavior needs; when the endpoint lacks it the behavior skips-as-pass.
    pub gate: Option<&'static str>,
    pub assertion: &'static str,
}

impl Behavior {
    /// The behavior is required when the run claims any of its profiles.
    pub fn required_by(&self, claimed: &[String]) -> bool {
        self.profiles.iter().any(|p| claimed.iter().any(|c| c == p))
    }
}

const CORE: &[&str] = &["core"];
const CORE_CLOUD: &[&str] = &["core", "cloud"];
const CORE_SPOT: &[&str] = &["core", "spot"];
const FAULT: &[&str] = &["fault"];
const DURABLE: &[&str] = &["durable"];
const SCALE: &[&str] = &["scale"];

macro_rules! b {
    ($id:literal, $area:ident, $prof:expr, $gate:expr, $text:literal) => {
        Behavior {
            id: $id,
            area: Area::$area,
            profiles: $prof,
            gate: $gate,
            assertion: $text,
        }
    };
}

const DEL: Option<&str> = Some("Delete");
const REV: Option<&str> = Some("SinceRevision");
const FLT: Option<&str> = Some("Fault");

/// Expected number of behaviors per area, counted from the spec.
pub const AREA_COUNTS: [(Area, usize); 11] = [
    (Area::Lifecycle, 8),
    (Area::TransitionMatrix, 15),
    (Area::Fencing, 11),
    (Area::Concurrency, 9),
    (Area::Metadata, 5),
    (Area::FieldShape, 7),
    (Area::ListRevision, 9),
    (Area::TimeoutsFailure, 8),
    (Area::Durability, 7),
    (Area::ScaleSoak, 9),
    (Area::PropertyFuzz, 5),
];

pub static BEHAVIORS: &[Behavior] = &[
    b!("B101", Lifecycle, CORE, None, "Four full Speculative→Idle→Configured→Idle round-trips; at every return to Idle, cluster, shard_metadata and last_error are empty."),
    b!("B103", Lifecycle, CORE, None, "Mid-Configure, the only transitional state ever observed is CONFIGURING; it settles CONFIGURED."),
    b!("B104", Lifecycle, CORE, None, "Mid-Drain, only DRAINING is observed; it settles IDLE."),
    b!("B105", Lifecycle, CORE, None, "The de-duplicated state trace of Create→Configure→Drain only walks the four legal edges, never skipping a stable state."),
    b!("B106", Lifecycle, CORE, None, "cluster is non-empty while CONFIGURED (and already in any observed CONFIGURING window) and empty once a Drain settles."),
    b!("B107", Lifecycle, CORE, None, "At rest: host nil for SPECULATIVE, set for IDLE/CONFIGURED; a settled Get never shows a transitional state."),
    b!("B108", Lifecycle, CORE, None, "After a settled mutation, polling over a stability window never shows a spontaneous transitional state."),
    b!("B109", Lifecycle, CORE_CLOUD, DEL, "Mid-Delete only DELETING is observed; it settles SPECULATIVE."),
    b!("B201", TransitionMatrix, CORE, None, "Create on CONFIGURED: rejected with a non-FAILED_PRECONDITION code; stays CONFIGURED."),
    b!("B202", TransitionMatrix, CORE, None, "Configure on SPECULATIVE: rejected (non-FAILED_PRECONDITION); stays SPECULATIVE."),
    b!("B203", TransitionMatrix, CORE, None, "Drain on IDLE: never FAILED_PRECONDITION; stays IDLE (rejection, or idempotent no-op when a Drain op is on record)."),
    b!("B204", TransitionMatrix, CORE_CLOUD, None, "Delete out of position (SPECULATIVE/CONFIGURED): never FAILED_PRECONDITION; source state unchanged (rejection, UNIMPLEMENTED, or no-op on SPECULATIVE)."),
    b!("B205", TransitionMatrix, CORE, None, "Re-Configure on CONFIGURED and re-Create on IDLE are idempotent successes that change nothing."),
    b!("B206", TransitionMatrix, CORE, None, "Such a no-op returns the same non-empty operation_id as the original transition."),
    b!("B207", TransitionMatrix, CORE, None, "Create/Configure/Drain on an unknown id: NOT_FOUND (never FAILED_PRECONDITION, never a silent create)."),
    b!("B208", TransitionMatrix, CORE, None, "Get/Create/Configure/Drain with an empty id: INVALID_ARGUMENT."),
    b!("B209", TransitionMatrix, CORE, None, "A Configure with more metadata keys/bytes than accepted: echoed verbatim or INVALID_ARGUMENT, no partial transition."),
    b!("B210", TransitionMatrix, CORE, None, "Drain with negative grace_period_seconds: INVALID_ARGUMENT; stays CONFIGURED."),
    b!("B211", TransitionMatrix, CORE, None, "Negative epoch or sequence with a non-empty shard_id on first contact: INVALID_ARGUMENT (strict) or accepted (lenient), never FAILED_PRECONDITION. B1201/B1204 then require negative values to be ordered like any other once a mark exists, so be lenient."),
    b!("B212", TransitionMatrix, CORE, None, "int64::MAX epoch/sequence from a fresh shard: accepted, mark set, no overflow."),
    b!("B213", TransitionMatrix, CORE, None, "An oversized bootstrap_blob: accepted, or INVALID_ARGUMENT with no partial transition."),
    b!("B214", TransitionMatrix, CORE, None, "Distinct successive transitions on one machine mint distinct operation_ids."),
    b!("B215", TransitionMatrix, CORE_CLOUD, None, "Get of an unknown id: NOT_FOUND; Delete of an unknown id: NOT_FOUND or UNIMPLEMENTED."),
    b!("B301", Fencing, CORE, None, "A stale token aimed at a non-existent machine: FAILED_PRECONDITION (fence before not-found)."),
    b!("B302", Fencing, CORE, None, "Marks are isolated per (shard_id, machine_id): one shard never fences another; a high mark on one machine never fences a lower token on another machine of the same shard; each pair's own stale token is still rejected."),
    b!("B303", Fencing, CORE, None, "On one shard+machine, every not-strictly-newer token is FAILED_PRECONDITION and every strictly-newer one advances the mark (lexicographic; a higher epoch with a low sequence advances)."),
    b!("B305", Fencing, CORE, None, "Get/List keep succeeding through interleaved fenced-out mutations."),
    b!("B306", Fencing, CORE, None, "A stale-token replay of an applied Configure: FAILED_PRECONDITION, not the cached op."),
    b!("B307", Fencing, CORE, None, "Same for Drain."),
    b!("B308", Fencing, CORE, None, "Two zero-token Creates are both accepted (absent token bypasses fencing)."),
    b!("B309", Fencing, CORE, None, "A session's auto-advancing tokens are accepted in order across Create/Configure/Drain."),
    b!("B310", Fencing, CORE, None, "After a new epoch (sequence reset), a pre-restart token is FAILED_PRECONDITION and the new-epoch token is accepted."),
    b!("B311", Fencing, CORE, None, "A passing token whose op then fails (out of position) still advances the mark, so its own retry is fenced."),
    b!("B312", Fencing, CORE, None, "A randomized token stream on one shard matches the accept-iff-strictly-greater-than-running-max oracle."),
    b!("B401", Concurrency, CORE, None, "N parallel identical Creates: exactly one distinct operation_id; settles IDLE once."),
    b!("B402", Concurrency, CORE, None, "N parallel identical Configures: one stable operation_id; settles CONFIGURED once."),
    b!("B403", Concurrency, CORE, None, "N parallel identical Drains: one operation_id; settles IDLE once with cluster/metadata cleared."),
    b!("B404", Concurrency, CORE, None, "Racing conflicting mutations (Configure vs Drain) serialize: at most one succeeds; exactly one well-defined stable end state."),
    b!("B405", Concurrency, CORE, None, "Interleaved old-epoch zombie and new-epoch live tokens: the live epoch always wins, the zombie always gets FAILED_PRECONDITION."),
    b!("B406", Concurrency, CORE, None, "Concurrent retries to one target over distinct connections collapse to one operation_id."),
    b!("B407", Concurrency, CORE, None, "K machines driven to IDLE concurrently: distinct operation_ids, each reaches IDLE, no cross-machine bleed."),
    b!("B408", Concurrency, CORE, None, "In a parallel retry burst every ack's snapshot shows the same target-bound transitional or settled state (no torn snapshot)."),
    b!("B409", Concurrency, CORE_CLOUD, DEL, "N parallel identical Deletes: one operation_id; settles SPECULATIVE once."),
    b!("B501", Metadata, CORE, None, "A 55-key map with NUL, control bytes, unicode and empty values echoes byte-for-byte on Get and List(CONFIGURED), stable across reads."),
    b!("B502", Metadata, CORE, None, "Metadata and cluster clear when a Drain settles; a later Configure with a disjoint map shows no old key."),
    b!("B503", Metadata, CORE, None, "An oversized/many-key map is echoed verbatim or INVALID_ARGUMENT under a documented cap — never truncated or summarised."),
    b!("B504", Metadata, CORE, None, "In an observed CONFIGURING window the metadata is already visible verbatim; otherwise verbatim once CONFIGURED."),
    b!("B505", Metadata, CORE, None, "Mutating the caller's map after the ack does not change the stored copy."),
    b!("B801", FieldShape, CORE, None, "Every machine: non-UNSPECIFIED state, non-empty top-level instance_type; no instance-type/zone/capacity-type keys hidden in labels."),
    b!("B802", FieldShape, CORE_SPOT, None, "price_per_hour finite and ≥ 0; interruption_probability in [0,1]; SPOT machines > 0."),
    b!("B803", FieldShape, CORE, None, "host nil for SPECULATIVE, set for IDLE/CONFIGURED; cluster empty for SPECULATIVE/IDLE, non-empty for CONFIGURED."),
    b!("B804", FieldShape, CORE, None, "Where allocatable and resources are populated, both are non-empty maps (density computable)."),
    b!("B805", FieldShape, CORE, None, "HostRef.provider is identical across every observation through Idle→Configured→Idle."),
    b!("B806", FieldShape, CORE, None, "For a stable machine with a host: capacity_type non-UNSPECIFIED and zone non-empty."),
    b!("B807", FieldShape, CORE_CLOUD, DEL, "Idle → Delete → SPECULATIVE clears host, cluster and shard_metadata."),
    b!("B901", ListRevision, CORE, None, "Single-state filters return only that state; a multi-state filter returns exactly the union."),
    b!("B902", ListRevision, CORE, None, "max_results 1, 2, 3 never exceeded; 0 means no cap."),
    b!("B903", ListRevision, CORE, REV, "The revision advances after a mutation and a delta since the prior cursor includes the mutated machine."),
    b!("B904", ListRevision, CORE, REV, "A delta since the current revision with no mutation in between is empty."),
    b!("B905", ListRevision, CORE, REV, "Over many mutations the cursor is monotonic; a delta from any earlier cursor includes every machine mutated after it."),
    b!("B906", ListRevision, CORE, None, "A garbage, zero or non-cursor since_revision: full list, no error."),
    b!("B907", ListRevision, CORE, REV, "Paging via repeated max_results + since_revision visits the whole fleet with no duplicate and no skip."),
    b!("B908", ListRevision, CORE, REV, "Without client mutations, repeated delta Lists stay empty over a quiescent window (idle reconcile ticks bump nothing)."),
    b!("B909", ListRevision, CORE, REV, "The exact cursor bytes are accepted; a byte-mutated copy degrades to a full list, no error."),
    b!("B701", TimeoutsFailure, FAULT, FLT, "A Configure whose actuator errors: FAILED, non-empty last_error, no lingering CONFIGURING."),
    b!("B702", TimeoutsFailure, FAULT, FLT, "A Create whose actuator errors: FAILED with last_error."),
    b!("B703", TimeoutsFailure, FAULT, FLT, "A transition past its timeout: FAILED with a timeout-shaped last_error, never a silent revert."),
    b!("B704", TimeoutsFailure, FAULT, FLT, "A late completion after the failure is discarded: stays FAILED."),
    b!("B705", TimeoutsFailure, FAULT, FLT, "On FAILED, any re-issued mutation is rejected (non-FAILED_PRECONDITION); stays FAILED; last_error verbatim."),
    b!("B706", TimeoutsFailure, FAULT, FLT, "Drain with grace 0 against a failing actuator ends IDLE or FAILED-with-last_error, never stuck DRAINING."),
    b!("B707", TimeoutsFailure, FAULT, FLT, "A FAILED machine still answers Get/List with last_error verbatim across reads."),
    b!("B708", TimeoutsFailure, FAULT, FLT, "Node-join readiness gate: not CONFIGURED until the node is observed Ready; stays CONFIGURING meanwhile; FAILED with last_error if readiness never arrives within the Configure timeout."),
    b!("B1001", Durability, DURABLE, None, "A not-strictly-newer token is still FAILED_PRECONDITION after restart."),
    b!("B1002", Durability, DURABLE, None, "An idempotent retry of a pre-restart mutation returns the pre-restart operation_id."),
    b!("B1003", Durability, DURABLE, None, "A Configured machine keeps its cluster and verbatim metadata over Get and List."),
    b!("B1004", Durability, DURABLE, None, "The full inventory (ids and states) is recovered, nothing lost or duplicated."),
    b!("B1005", Durability, DURABLE, None, "Post-restart cursors and fresh operation_ids are well-formed; no operation_id is reused from before."),
    b!("B1006", Durability, DURABLE, None, "A transition cut by the kill recovers to FAILED with last_error, or a clean stable state — never transitional."),
    b!("B1007", Durability, DURABLE, None, "A brand-new shard_id's first low token is accepted after restart."),
    b!("B1101", ScaleSoak, SCALE, None, "With 10k–100k seeded machines, a full List returns every machine, each in shape."),
    b!("B1102", ScaleSoak, SCALE, None, "At scale, a delta after a bounded batch of mutations returns exactly the mutated set."),
    b!("B1103", ScaleSoak, SCALE, None, "At scale, paging the fleet via max_results + revision is set-complete over tens of thousands."),
    b!("B1104", ScaleSoak, SCALE, None, "A Configure/Drain churn soak keeps every invariant and leaks no cluster/metadata at Idle."),
    b!("B1105", ScaleSoak, SCALE, None, "Over a multi-minute soak the live count is conserved (created == deleted + resident)."),
    b!("B1106", ScaleSoak, SCALE, None, "Per-RPC latency histograms are kept; p99 for Get/List/Create stays within the declared budget at scale."),
    b!("B1107", ScaleSoak, SCALE, None, "Full-List latency grows sub-pathologically from baseline to 100k machines."),
    b!("B1108", ScaleSoak, SCALE, None, "Under K parallel walk-to-Idle at scale, throughput holds and every machine reaches IDLE with no operation_id collision."),
    b!("B1109", ScaleSoak, SCALE, None, "Through the soak, sampled steady machines never drift into a transitional or FAILED state without a client mutation."),
    b!("B1201", PropertyFuzz, CORE, None, "Random token streams on one shard match the lexicographic running-max oracle at every step."),
    b!("B1202", PropertyFuzz, CORE, None, "Random valid-UTF-8 metadata maps round-trip byte-identically on the next Get."),
    b!("B1203", PropertyFuzz, CORE, None, "Random valid/invalid lifecycle sequences follow the four-edge model: legal edges succeed, illegal ones reject (non-FAILED_PRECONDITION), no partial transition."),
    b!("B1204", PropertyFuzz, CORE, None, "Random interleavings of fenced mutations from several shards on shared machines: FAILED_PRECONDITION only ever for fencing, never for out-of-position or not-found."),
    b!("B1205", PropertyFuzz, CORE, None, "Random request shapes (empty/unknown id, negative grace, oversized metadata/blob, malformed token) get the frozen code discipline (INVALID_ARGUMENT / NOT_FOUND / UNIMPLEMENTED, never FAILED_PRECONDITION)."),
];

/// Looks a behavior up by id.
pub fn behavior(id: &str) -> Option<&'static Behavior> {
    BEHAVIORS.iter().find(|b| b.id == id)
}

/// Numeric part of an id ("B1203" -> 1203), for ordering and the B1301+ rule.
pub fn id_number(id: &str) -> Option<u32> {
    id.strip_prefix('B')?.parse().ok()
}
