//! State traces: what a machine was observed in, de-duplicated.

use bigfleet_proto::v1alpha1::{Machine, MachineState};

pub fn is_transitional(s: MachineState) -> bool {
    matches!(
        s,
        MachineState::Creating
            | MachineState::Configuring
            | MachineState::Draining
            | MachineState::Deleting
    )
}

pub fn is_stable(s: MachineState) -> bool {
    matches!(
        s,
        MachineState::Speculative | MachineState::Idle | MachineState::Configured
    )
}

/// The de-duplicated observations of one machine: a snapshot is kept only when it differs from
/// the previous one.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    pub snapshots: Vec<Machine>,
}

impl Trace {
    pub fn push(&mut self, m: Machine) {
        if self.snapshots.last() != Some(&m) {
            self.snapshots.push(m);
        }
    }
    /// De-duplicated state sequence.
    pub fn states(&self) -> Vec<MachineState> {
        let mut out: Vec<MachineState> = Vec::new();
        for m in &self.snapshots {
            let s = m.state();
            if out.last() != Some(&s) {
                out.push(s);
            }
        }
        out
    }
    pub fn last(&self) -> Option<&Machine> {
        self.snapshots.last()
    }
    pub fn extend(&mut self, other: Trace) {
        for m in other.snapshots {
            self.push(m);
        }
    }
}

pub fn fmt_states(s: &[MachineState]) -> String {
    s.iter()
        .map(|x| x.as_str_name().trim_start_matches("MACHINE_STATE_"))
        .collect::<Vec<_>>()
        .join("→")
}
