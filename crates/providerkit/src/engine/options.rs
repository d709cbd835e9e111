//! What an engine is built with: provider label, per-transition deadlines,
//! documented input caps, and (for the mutation check only) deliberately
//! broken behaviours. Each part of the engine takes what it needs of these
//! when it is built; the words every part's messages use for a cap or a
//! deadline are here beside them, so two parts never word one limit twice.

use std::time::Duration;

use crate::error::KitError;
use crate::model::TransitionKind;

/// Per-transition deadlines, measured from acceptance.
#[derive(Clone, Debug)]
pub struct Timeouts {
    pub create: Duration,
    pub configure: Duration,
    pub drain: Duration,
    pub delete: Duration,
    /// Pause between node-readiness probes after a successful configure.
    pub readiness_poll: Duration,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            create: Duration::from_secs(8 * 60),
            configure: Duration::from_secs(8 * 60),
            drain: Duration::from_secs(15 * 60),
            delete: Duration::from_secs(5 * 60),
            readiness_poll: Duration::from_secs(2),
        }
    }
}

impl Timeouts {
    pub fn for_kind(&self, kind: TransitionKind) -> Duration {
        match kind {
            TransitionKind::Create => self.create,
            TransitionKind::Configure => self.configure,
            TransitionKind::Drain => self.drain,
            TransitionKind::Delete => self.delete,
        }
    }
}

/// A deadline as messages word it: `8m`, `90s`, `1500ms`.
pub(crate) fn humanize(d: Duration) -> String {
    let secs = d.as_secs();
    if d.subsec_millis() != 0 || secs == 0 {
        format!("{}ms", d.as_millis())
    } else if secs.is_multiple_of(60) {
        format!("{}m", secs / 60)
    } else {
        format!("{secs}s")
    }
}

/// Documented input caps (docs/configuration.md, "Input caps", and the
/// proto comments). Beyond them a request is INVALID_ARGUMENT as a whole:
/// nothing is truncated and no transition starts. Every client-supplied
/// string and map has one, because whatever is accepted is held in memory,
/// written to the state file and echoed to every List caller.
#[derive(Clone, Debug)]
pub struct Limits {
    pub max_machine_id_bytes: usize,
    pub max_shard_id_bytes: usize,
    pub max_metadata_entries: usize,
    pub max_metadata_key_bytes: usize,
    pub max_metadata_value_bytes: usize,
    /// Sum of key and value lengths in bytes.
    pub max_metadata_bytes: usize,
    pub max_bootstrap_blob_bytes: usize,
    pub max_cluster_id_bytes: usize,
    /// Distinct shards that may hold a fencing mark on one machine id. Marks
    /// are never forgotten (fencing must survive), so without a cap a client
    /// minting shard ids grows the state without bound.
    pub max_shard_marks_per_machine: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_machine_id_bytes: 256,
            max_shard_id_bytes: 256,
            max_metadata_entries: 1024,
            max_metadata_key_bytes: 1024,
            max_metadata_value_bytes: 64 * 1024,
            max_metadata_bytes: 256 * 1024,
            max_bootstrap_blob_bytes: 1024 * 1024,
            max_cluster_id_bytes: 1024,
            max_shard_marks_per_machine: 64,
        }
    }
}

/// How much of an over-cap value an error message repeats: enough to
/// recognise it, never enough to bloat the status (clients drop statuses
/// above ~8 KiB).
pub const ECHO_PREFIX_CHARS: usize = 32;

/// The first [`ECHO_PREFIX_CHARS`] characters of `value`, quoted, with an
/// ellipsis when cut.
pub fn echo_prefix(value: &str) -> String {
    match value.char_indices().nth(ECHO_PREFIX_CHARS) {
        None => format!("{value:?}"),
        Some((end, _)) => format!("{:?}...", &value[..end]),
    }
}

/// INVALID_ARGUMENT when `value` is longer than `cap` bytes; the message
/// repeats only a short prefix of it.
pub(super) fn check_len(what: &str, value: &str, cap: usize) -> Result<(), KitError> {
    if value.len() <= cap {
        return Ok(());
    }
    Err(KitError::InvalidArgument(format!(
        "{what} is {} bytes (starts {}); the cap is {cap} bytes: use a shorter one",
        value.len(),
        echo_prefix(value)
    )))
}

/// Deliberately broken behaviours, compiled only for the certification
/// suite's mutation check (it proves the suite can fail). Each switch is
/// read by the one part it breaks, beside the code it breaks; a normal
/// build has neither the switches nor their hooks.
#[cfg(feature = "mutants")]
#[derive(Clone, Debug, Default)]
pub struct Mutants {
    /// Fencing marks are kept per shard, not per (shard, machine) (`Fences`).
    pub fence_per_shard: bool,
    /// Stored metadata is cut short (`Acceptor`).
    pub truncate_metadata: bool,
    /// An out-of-position request is FAILED_PRECONDITION (`Acceptor`).
    pub out_of_position_failed_precondition: bool,
    /// Every reconcile pass bumps every machine's revision (`Inventory`).
    pub bump_revision_on_reconcile: bool,
    /// A capped, cursor-less List always starts at the same head (`Lister`).
    pub frozen_list_head: bool,
    /// Tokens with a negative epoch or sequence are INVALID_ARGUMENT
    /// (`Acceptor`).
    pub reject_negative_tokens: bool,
}

#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Stamped on every `HostRef.provider`.
    pub provider: String,
    pub timeouts: Timeouts,
    pub limits: Limits,
    #[cfg(feature = "mutants")]
    pub mutants: Mutants,
}

impl Default for EngineOptions {
    fn default() -> EngineOptions {
        EngineOptions {
            provider: "proxmox".to_string(),
            timeouts: Timeouts::default(),
            limits: Limits::default(),
            #[cfg(feature = "mutants")]
            mutants: Mutants::default(),
        }
    }
}
