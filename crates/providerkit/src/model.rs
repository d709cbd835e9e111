//! Lifecycle states, transition kinds and the persisted machine record.

use bigfleet_proto::v1alpha1 as pb;

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

/// Everything the engine knows about one machine; what a [`crate::Store`]
/// persists. The wire view is kept ready-made in `machine` so reads are a
/// clone, not a conversion.
#[derive(Clone, Debug, PartialEq)]
pub struct MachineRecord {
    /// The wire view (state, host, cluster, metadata, catalogue facts).
    pub machine: pb::Machine,
    /// Revision of the last wire-visible change; unique across the fleet.
    pub rev: u64,
    /// Idempotency map: the operation id on record per transition kind.
    pub ops: [Option<String>; 4],
}

impl MachineRecord {
    pub fn id(&self) -> &str {
        &self.machine.id
    }

    pub fn state(&self) -> State {
        State::from_wire(self.machine.state).unwrap_or(State::Failed)
    }

    pub fn set_state(&mut self, state: State) {
        self.machine.state = state.to_wire() as i32;
    }

    pub fn op(&self, kind: TransitionKind) -> Option<&str> {
        self.ops[kind.index()].as_deref()
    }
}
