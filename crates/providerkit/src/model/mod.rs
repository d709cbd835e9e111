//! Lifecycle states, transition kinds and the persisted machine record,
//! with the record's lifecycle transitions as pure functions
//! ([`MachineRecord::begin`], [`MachineRecord::land_success`], ...; in
//! `transition.rs`).
//!
//! One file past 600 lines on purpose: the record, its hand-written wire
//! encoding and its decoding (with their round-trip tests) must change
//! together, field by field.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bigfleet_proto::raw::{EncodedMachine, RawMessage};
use bigfleet_proto::v1alpha1 as pb;
use prost::bytes::{Buf, BufMut, Bytes};
use prost::encoding::{
    decode_key, encode_key, hash_map, int32, message, skip_field, string, DecodeContext, WireType,
};
use prost::{DecodeError, Message};

mod transition;

pub use transition::{Begin, TransitionError};

/// A machine's lifecycle state (the wire enum without `UNSPECIFIED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    Speculative,
    Creating,
    Idle,
    Configuring,
    Configured,
    Draining,
    Deleting,
    Failed,
}

impl State {
    pub const ALL: [State; 8] = [
        State::Speculative,
        State::Creating,
        State::Idle,
        State::Configuring,
        State::Configured,
        State::Draining,
        State::Deleting,
        State::Failed,
    ];

    pub fn to_wire(self) -> pb::MachineState {
        match self {
            State::Speculative => pb::MachineState::Speculative,
            State::Creating => pb::MachineState::Creating,
            State::Idle => pb::MachineState::Idle,
            State::Configuring => pb::MachineState::Configuring,
            State::Configured => pb::MachineState::Configured,
            State::Draining => pb::MachineState::Draining,
            State::Deleting => pb::MachineState::Deleting,
            State::Failed => pb::MachineState::Failed,
        }
    }

    pub fn from_wire(value: i32) -> Option<State> {
        match pb::MachineState::try_from(value).ok()? {
            pb::MachineState::Unspecified => None,
            pb::MachineState::Speculative => Some(State::Speculative),
            pb::MachineState::Creating => Some(State::Creating),
            pb::MachineState::Idle => Some(State::Idle),
            pb::MachineState::Configuring => Some(State::Configuring),
            pb::MachineState::Configured => Some(State::Configured),
            pb::MachineState::Draining => Some(State::Draining),
            pb::MachineState::Deleting => Some(State::Deleting),
            pb::MachineState::Failed => Some(State::Failed),
        }
    }

    pub fn is_transitional(self) -> bool {
        matches!(
            self,
            State::Creating | State::Configuring | State::Draining | State::Deleting
        )
    }

    /// The transition a transitional state belongs to.
    pub fn transition(self) -> Option<TransitionKind> {
        match self {
            State::Creating => Some(TransitionKind::Create),
            State::Configuring => Some(TransitionKind::Configure),
            State::Draining => Some(TransitionKind::Drain),
            State::Deleting => Some(TransitionKind::Delete),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            State::Speculative => "SPECULATIVE",
            State::Creating => "CREATING",
            State::Idle => "IDLE",
            State::Configuring => "CONFIGURING",
            State::Configured => "CONFIGURED",
            State::Draining => "DRAINING",
            State::Deleting => "DELETING",
            State::Failed => "FAILED",
        }
    }
}

impl std::fmt::Display for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One of the four legal edges of the state machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TransitionKind {
    Create,
    Configure,
    Drain,
    Delete,
}

impl TransitionKind {
    pub const ALL: [TransitionKind; 4] = [
        TransitionKind::Create,
        TransitionKind::Configure,
        TransitionKind::Drain,
        TransitionKind::Delete,
    ];

    pub fn from_state(self) -> State {
        match self {
            TransitionKind::Create => State::Speculative,
            TransitionKind::Configure => State::Idle,
            TransitionKind::Drain => State::Configured,
            TransitionKind::Delete => State::Idle,
        }
    }

    pub fn via_state(self) -> State {
        match self {
            TransitionKind::Create => State::Creating,
            TransitionKind::Configure => State::Configuring,
            TransitionKind::Drain => State::Draining,
            TransitionKind::Delete => State::Deleting,
        }
    }

    pub fn to_state(self) -> State {
        match self {
            TransitionKind::Create => State::Idle,
            TransitionKind::Configure => State::Configured,
            TransitionKind::Drain => State::Idle,
            TransitionKind::Delete => State::Speculative,
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            TransitionKind::Create => "Create",
            TransitionKind::Configure => "Configure",
            TransitionKind::Drain => "Drain",
            TransitionKind::Delete => "Delete",
        }
    }

    pub fn from_name(name: &str) -> Option<TransitionKind> {
        TransitionKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// The catalogue facts of a slot: identical for every slot of an offering,
/// so one copy is shared by all of them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CatalogFacts {
    pub instance_type: String,
    pub zone: String,
    pub capacity_type: pb::CapacityType,
    pub price_per_hour: f64,
    pub interruption_probability: f64,
    pub resources: HashMap<String, String>,
    pub allocatable: HashMap<String, String>,
    pub labels: HashMap<String, String>,
}

impl CatalogFacts {
    /// Freeze the facts with their wire encoding, ready to share.
    pub fn share(self) -> SharedFacts {
        let mut head = Vec::new();
        string_field(4, &self.instance_type, &mut head);
        string_field(5, &self.zone, &mut head);
        int32_field(6, self.capacity_type as i32, &mut head);
        double_field(7, self.price_per_hour, &mut head);
        double_field(8, self.interruption_probability, &mut head);
        resources_field(9, &self.resources, &mut head);
        sorted_map_field(10, &self.labels, &mut head);
        let mut tail = Vec::new();
        resources_field(13, &self.allocatable, &mut tail);
        Arc::new(Facts {
            facts: self,
            head: head.into_boxed_slice(),
            tail: tail.into_boxed_slice(),
        })
    }
}

/// Facts shared between every machine of an offering.
pub type SharedFacts = Arc<Facts>;

/// [`CatalogFacts`] with their canonical encoding (map entries sorted), so
/// encoding a machine copies them and comparing two is a byte compare.
pub struct Facts {
    facts: CatalogFacts,
    /// `Machine` fields 4 to 10.
    head: Box<[u8]>,
    /// `Machine` field 13 (allocatable).
    tail: Box<[u8]>,
}

impl Facts {
    /// True when both describe the same catalogue facts.
    pub fn same_as(&self, other: &Facts) -> bool {
        self.head == other.head && self.tail == other.tail
    }
}

impl std::ops::Deref for Facts {
    type Target = CatalogFacts;
    fn deref(&self) -> &CatalogFacts {
        &self.facts
    }
}

impl std::fmt::Debug for Facts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.facts.fmt(f)
    }
}

impl PartialEq for Facts {
    fn eq(&self, other: &Facts) -> bool {
        self.same_as(other)
    }
}

fn string_field(tag: u32, value: &str, buf: &mut Vec<u8>) {
    if !value.is_empty() {
        encode_key(tag, WireType::LengthDelimited, buf);
        prost::encoding::encode_varint(value.len() as u64, buf);
        buf.extend_from_slice(value.as_bytes());
    }
}

fn int32_field(tag: u32, value: i32, buf: &mut Vec<u8>) {
    if value != 0 {
        int32::encode(tag, &value, buf);
    }
}

fn double_field(tag: u32, value: f64, buf: &mut Vec<u8>) {
    if value != 0.0 {
        prost::encoding::double::encode(tag, &value, buf);
    }
}

/// A `map<string,string>` field with entries in key order.
fn sorted_map_field(tag: u32, map: &HashMap<String, String>, buf: &mut Vec<u8>) {
    let mut entries: Vec<(&String, &String)> = map.iter().collect();
    entries.sort();
    for (key, value) in entries {
        let mut entry = Vec::with_capacity(key.len() + value.len() + 4);
        string_field(1, key, &mut entry);
        string_field(2, value, &mut entry);
        encode_key(tag, WireType::LengthDelimited, buf);
        prost::encoding::encode_varint(entry.len() as u64, buf);
        buf.extend_from_slice(&entry);
    }
}

/// A `Resources` message field (always present, as the engine sets it).
fn resources_field(tag: u32, map: &HashMap<String, String>, buf: &mut Vec<u8>) {
    let mut body = Vec::new();
    sorted_map_field(1, map, &mut body);
    encode_key(tag, WireType::LengthDelimited, buf);
    prost::encoding::encode_varint(body.len() as u64, buf);
    buf.extend_from_slice(&body);
}

/// Everything the engine knows about one machine; what a [`crate::Store`]
/// persists. Catalogue facts are shared per offering; the rest is the
/// machine's own.
#[derive(Clone, Debug, PartialEq)]
pub struct MachineRecord {
    pub id: String,
    pub state: State,
    pub host: Option<pb::HostRef>,
    pub facts: SharedFacts,
    pub last_error: String,
    pub cluster: String,
    pub shard_metadata: HashMap<String, String>,
    /// Revision of the last wire-visible change; unique across the fleet.
    pub rev: u64,
    /// Idempotency map: the operation id on record per transition kind.
    pub ops: [Option<String>; 4],
    /// The current transition's window, kept with the record so that a
    /// restart resumes the transition under its original deadline; None
    /// outside a transition (and on a record stored before windows were).
    pub in_flight: Option<InFlight>,
}

/// When a transition started and when it must have landed, in wall-clock
/// milliseconds since the Unix epoch: a deadline that outlives the process
/// has to be a wall-clock one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlight {
    pub started_ms: u64,
    pub deadline_ms: u64,
    /// A Drain's grace period as the shard asked for it (a resumed Drain
    /// runs again with it); 0 for the other transitions.
    pub grace_ms: u64,
}

impl InFlight {
    /// A window of `limit` from `now_ms`.
    pub fn starting(now_ms: u64, limit: Duration, grace: Duration) -> InFlight {
        InFlight {
            started_ms: now_ms,
            deadline_ms: now_ms.saturating_add(duration_ms(limit)),
            grace_ms: duration_ms(grace),
        }
    }

    /// The whole window: the transition's time limit when it began.
    pub fn limit(&self) -> Duration {
        Duration::from_millis(self.deadline_ms.saturating_sub(self.started_ms))
    }

    /// What is left of the window at `now_ms` (zero once it has passed).
    pub fn remaining(&self, now_ms: u64) -> Duration {
        Duration::from_millis(self.deadline_ms.saturating_sub(now_ms))
    }

    pub fn grace(&self) -> Duration {
        Duration::from_millis(self.grace_ms)
    }
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Milliseconds since the Unix epoch (0 for a clock set before it).
pub fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, duration_ms)
}

impl MachineRecord {
    pub fn new(id: String, facts: SharedFacts, rev: u64) -> MachineRecord {
        MachineRecord {
            id,
            state: State::Speculative,
            host: None,
            facts,
            last_error: String::new(),
            cluster: String::new(),
            shard_metadata: HashMap::new(),
            rev,
            ops: Default::default(),
            in_flight: None,
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn set_state(&mut self, state: State) {
        self.state = state;
    }

    pub fn op(&self, kind: TransitionKind) -> Option<&str> {
        self.ops[kind.index()].as_deref()
    }

    /// The wire `Machine` as a message tree (tests, tools; the server sends
    /// [`MachineRecord::encode_wire`] instead).
    pub fn to_wire(&self) -> pb::Machine {
        let f = &self.facts;
        pb::Machine {
            id: self.id.clone(),
            state: self.state.to_wire() as i32,
            host: self.host.clone(),
            instance_type: f.instance_type.clone(),
            zone: f.zone.clone(),
            capacity_type: f.capacity_type as i32,
            price_per_hour: f.price_per_hour,
            interruption_probability: f.interruption_probability,
            resources: Some(pb::Resources {
                resources: f.resources.clone(),
            }),
            labels: f.labels.clone(),
            last_error: self.last_error.clone(),
            allocatable: Some(pb::Resources {
                resources: f.allocatable.clone(),
            }),
            cluster: self.cluster.clone(),
            shard_metadata: self.shard_metadata.clone(),
        }
    }

    /// Length of the `Machine` encoding (no length prefix).
    pub fn wire_len(&self) -> usize {
        let mut len = self.facts.head.len() + self.facts.tail.len();
        if !self.id.is_empty() {
            len += string::encoded_len(1, &self.id);
        }
        len += int32::encoded_len(2, &(self.state.to_wire() as i32));
        if let Some(host) = &self.host {
            len += message::encoded_len(3, host);
        }
        if !self.last_error.is_empty() {
            len += string::encoded_len(12, &self.last_error);
        }
        if !self.cluster.is_empty() {
            len += string::encoded_len(14, &self.cluster);
        }
        len + hash_map::encoded_len(
            string::encoded_len,
            string::encoded_len,
            15,
            &self.shard_metadata,
        )
    }

    /// Append the `Machine` encoding, fields in number order (as prost does).
    pub fn encode_wire(&self, buf: &mut impl BufMut) {
        if !self.id.is_empty() {
            string::encode(1, &self.id, buf);
        }
        int32::encode(2, &(self.state.to_wire() as i32), buf);
        if let Some(host) = &self.host {
            message::encode(3, host, buf);
        }
        buf.put_slice(&self.facts.head);
        if !self.last_error.is_empty() {
            string::encode(12, &self.last_error, buf);
        }
        buf.put_slice(&self.facts.tail);
        if !self.cluster.is_empty() {
            string::encode(14, &self.cluster, buf);
        }
        hash_map::encode(
            string::encode,
            string::encoded_len,
            string::encode,
            string::encoded_len,
            15,
            &self.shard_metadata,
            buf,
        );
    }

    /// The `Machine` encoding as a server response.
    pub fn encoded(&self) -> EncodedMachine {
        let mut buf = Vec::with_capacity(self.wire_len());
        self.encode_wire(&mut buf);
        RawMessage(Bytes::from(buf))
    }

    /// Rebuild a record from a stored `Machine` encoding, sharing catalogue
    /// facts through `interner`.
    pub fn decode_wire(
        mut bytes: &[u8],
        rev: u64,
        ops: [Option<String>; 4],
        interner: &mut FactsInterner,
    ) -> Result<MachineRecord, RecordError> {
        let mut id = String::new();
        let mut state = 0i32;
        let mut host = None;
        let mut last_error = String::new();
        let mut cluster = String::new();
        let mut shard_metadata = HashMap::new();
        // The catalogue fields exactly as stored: the interner's key.
        let mut catalogue = std::mem::take(&mut interner.key);
        catalogue.clear();
        let ctx = DecodeContext::default();
        let mut fields = || -> Result<(), DecodeError> {
            while bytes.has_remaining() {
                let field_start = bytes;
                let (tag, wire_type) = decode_key(&mut bytes)?;
                match tag {
                    1 => string::merge(wire_type, &mut id, &mut bytes, ctx.clone())?,
                    2 => int32::merge(wire_type, &mut state, &mut bytes, ctx.clone())?,
                    3 => message::merge(
                        wire_type,
                        host.get_or_insert_with(pb::HostRef::default),
                        &mut bytes,
                        ctx.clone(),
                    )?,
                    12 => string::merge(wire_type, &mut last_error, &mut bytes, ctx.clone())?,
                    14 => string::merge(wire_type, &mut cluster, &mut bytes, ctx.clone())?,
                    15 => hash_map::merge(
                        string::merge,
                        string::merge,
                        &mut shard_metadata,
                        &mut bytes,
                        ctx.clone(),
                    )?,
                    4..=10 | 13 => {
                        skip_field(wire_type, tag, &mut bytes, ctx.clone())?;
                        let used = field_start.len() - bytes.len();
                        catalogue.extend_from_slice(&field_start[..used]);
                    }
                    _ => skip_field(wire_type, tag, &mut bytes, ctx.clone())?,
                }
            }
            Ok(())
        };
        fields().map_err(RecordError::Protobuf)?;
        let facts = interner.intern(&catalogue).map_err(RecordError::Protobuf);
        // The buffer is reused for the next record's key.
        interner.key = catalogue;
        let state = State::from_wire(state).ok_or(RecordError::State {
            id: id.clone(),
            state,
        })?;
        Ok(MachineRecord {
            facts: facts?,
            id,
            state,
            host,
            last_error,
            cluster,
            shard_metadata,
            rev,
            ops,
            in_flight: None,
        })
    }
}

/// Why a stored machine record could not be rebuilt.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("{0}")]
    Protobuf(#[source] DecodeError),
    #[error("machine {id:?} has no valid state ({state})")]
    State { id: String, state: i32 },
}

/// The canonical encoding of one set of facts (head, tail).
type CanonicalFacts = (Box<[u8]>, Box<[u8]>);

/// Shares catalogue facts between decoded records: one allocation per
/// distinct offering instead of three maps per machine.
#[derive(Default)]
pub struct FactsInterner {
    /// Stored bytes of the catalogue fields -> facts.
    by_stored: HashMap<Vec<u8>, SharedFacts>,
    /// Canonical encoding -> facts, for stores written with another map order.
    by_canonical: HashMap<CanonicalFacts, SharedFacts>,
    /// Scratch for the key of the record being decoded (one allocation per
    /// interner, not per record).
    key: Vec<u8>,
}

impl FactsInterner {
    pub fn new() -> FactsInterner {
        FactsInterner::default()
    }

    fn intern(&mut self, stored: &[u8]) -> Result<SharedFacts, DecodeError> {
        if let Some(facts) = self.by_stored.get(stored) {
            return Ok(facts.clone());
        }
        let m = pb::Machine::decode(stored)?;
        let facts = CatalogFacts {
            instance_type: m.instance_type,
            zone: m.zone,
            capacity_type: pb::CapacityType::try_from(m.capacity_type).unwrap_or_default(),
            price_per_hour: m.price_per_hour,
            interruption_probability: m.interruption_probability,
            resources: m.resources.map(|r| r.resources).unwrap_or_default(),
            allocatable: m.allocatable.map(|r| r.resources).unwrap_or_default(),
            labels: m.labels,
        }
        .share();
        let facts = self
            .by_canonical
            .entry((facts.head.clone(), facts.tail.clone()))
            .or_insert(facts)
            .clone();
        self.by_stored.insert(stored.to_vec(), facts.clone());
        Ok(facts)
    }

    /// How many distinct facts were seen.
    pub fn distinct(&self) -> usize {
        self.by_canonical.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> SharedFacts {
        CatalogFacts {
            instance_type: "pve.small".into(),
            zone: "pve1".into(),
            capacity_type: pb::CapacityType::OnDemand,
            price_per_hour: 0.0095,
            interruption_probability: 0.0,
            resources: [("cpu", "2"), ("memory", "4Gi"), ("pods", "110")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            allocatable: [("cpu", "2"), ("memory", "4Gi")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            labels: [("tier", "gold"), ("rack", "r1")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
        .share()
    }

    fn record() -> MachineRecord {
        let mut r = MachineRecord::new("proxmox/OnDemand/pve.small/pve1/007".into(), facts(), 9);
        r.state = State::Configured;
        r.host = Some(pb::HostRef {
            provider: "proxmox".into(),
            r#ref: "pve1/123".into(),
        });
        r.last_error = "earlier failure".into();
        r.cluster = "c-1".into();
        r.shard_metadata = [("a".to_string(), "1".to_string())].into();
        r.ops[TransitionKind::Configure.index()] = Some("op-1-2".into());
        r
    }

    #[test]
    fn encoding_decodes_to_the_same_machine_as_to_wire() {
        for r in [record(), MachineRecord::new("x".into(), facts(), 1)] {
            let bytes = r.encoded();
            assert_eq!(bytes.0.len(), r.wire_len());
            assert_eq!(pb::Machine::decode(bytes.0.as_ref()).unwrap(), r.to_wire());
        }
    }

    #[test]
    fn encoding_is_prost_encoding_when_maps_have_one_order() {
        // With at most one entry per map the order question does not arise,
        // so the bytes must match prost's exactly (same field order).
        let mut r = record();
        let mut f = (**r.facts).clone();
        f.labels = [("tier".to_string(), "gold".to_string())].into();
        f.resources = [("cpu".to_string(), "2".to_string())].into();
        f.allocatable = [("cpu".to_string(), "2".to_string())].into();
        r.facts = f.share();
        assert_eq!(r.encoded().0.to_vec(), r.to_wire().encode_to_vec());
    }

    #[test]
    fn decode_restores_the_record_and_shares_facts() {
        let mut interner = FactsInterner::new();
        let r = record();
        let ops = r.ops.clone();
        let a = MachineRecord::decode_wire(&r.encoded().0, 9, ops.clone(), &mut interner).unwrap();
        assert_eq!(a, r);
        // A record stored by prost (other map order) lands on the same facts.
        let other = r.to_wire().encode_to_vec();
        let b = MachineRecord::decode_wire(&other, 9, ops, &mut interner).unwrap();
        assert_eq!(b, r);
        assert!(Arc::ptr_eq(&a.facts, &b.facts));
        assert_eq!(interner.distinct(), 1);
    }

    #[test]
    fn decode_rejects_garbage_and_missing_state() {
        let mut interner = FactsInterner::new();
        assert!(MachineRecord::decode_wire(
            &[0x0a, 0x05, b'a'],
            1,
            Default::default(),
            &mut interner
        )
        .is_err());
        let no_state = pb::Machine {
            id: "m".into(),
            ..Default::default()
        }
        .encode_to_vec();
        let err = MachineRecord::decode_wire(&no_state, 1, Default::default(), &mut interner)
            .unwrap_err();
        assert!(err.to_string().contains("no valid state"), "{err}");
    }

    #[test]
    fn facts_compare_by_content_not_map_order() {
        let a = facts();
        let b = (**a).clone().share();
        assert!(!Arc::ptr_eq(&a, &b));
        assert!(a.same_as(&b));
        let mut changed = (**a).clone();
        changed.labels.insert("tier".into(), "silver".into());
        assert!(!a.same_as(&changed.share()));
    }
}
