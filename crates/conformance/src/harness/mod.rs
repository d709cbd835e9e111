//! The black-box harness: everything a behavior test needs to talk to an endpoint using only
//! the six wire RPCs.

mod caps;
mod codes;
mod ctx;
mod dial;
mod tokens;
mod trace;

pub use caps::{probe, Capabilities};
pub use codes::{
    code_of, describe, expect_code, expect_fp, expect_ok, expect_rejected_not_fp, RpcResult,
};
pub use ctx::{burst, connections, id_set, meta, test_rng, wait_for_state, Ctx, SharedCtx, Timing};
pub use dial::{dial, Client, TlsOpts};
pub use tokens::{configure_req, create_req, delete_req, drain_req, ShardSession, Token};
pub use trace::{fmt_states, is_stable, is_transitional, Trace};

/// What a passing test reports; failures are `Err`.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Pass,
    /// Passed, with a note (e.g. a sub-assertion outside the claimed profiles skipped-as-pass).
    PassWith(String),
    /// Not applicable to this endpoint (skip-as-pass), with the reason.
    Skip(String),
}

pub type TestResult = anyhow::Result<Outcome>;

#[cfg(test)]
mod tests {
    use bigfleet_proto::v1alpha1::{Machine, MachineState};
    use tonic::{Code, Status};

    use super::*;

    fn m(state: MachineState, cluster: &str) -> Machine {
        Machine {
            id: "m".into(),
            state: state as i32,
            cluster: cluster.into(),
            ..Default::default()
        }
    }

    #[test]
    fn trace_deduplicates_snapshots_and_states() {
        let mut t = Trace::default();
        t.push(m(MachineState::Idle, ""));
        t.push(m(MachineState::Idle, ""));
        t.push(m(MachineState::Configuring, "c"));
        t.push(m(MachineState::Configuring, "c2"));
        t.push(m(MachineState::Configured, "c2"));
        assert_eq!(t.snapshots.len(), 4);
        assert_eq!(
            t.states(),
            vec![
                MachineState::Idle,
                MachineState::Configuring,
                MachineState::Configured
            ]
        );
        assert_eq!(fmt_states(&t.states()), "IDLE→CONFIGURING→CONFIGURED");
    }

    #[test]
    fn sessions_mint_strictly_increasing_tokens() {
        let mut s = ShardSession::new("sh".into());
        let a = s.mint();
        let b = s.mint();
        assert!((b.epoch, b.seq) > (a.epoch, a.seq));
        assert_eq!(s.last(), b);
        s.new_epoch();
        let c = s.mint();
        assert_eq!((c.epoch, c.seq), (2, 1));
        assert!((c.epoch, c.seq) > (b.epoch, b.seq));
    }

    #[test]
    fn code_assertions_reject_failed_precondition_for_position_errors() {
        let fp: RpcResult<()> = Err(Status::failed_precondition("stale"));
        let ab: RpcResult<()> = Err(Status::aborted("out of position"));
        let ok: RpcResult<()> = Ok(());
        assert!(expect_rejected_not_fp(&fp, "x").is_err());
        assert!(expect_rejected_not_fp(&ok, "x").is_err());
        assert!(expect_rejected_not_fp(&ab, "x").is_ok());
        assert!(expect_fp(&fp, "x").is_ok());
        assert!(expect_fp(&ab, "x").is_err());
        assert!(expect_code(&ab, &[Code::Aborted, Code::Internal], "x").is_ok());
    }

    #[test]
    fn per_test_rng_depends_only_on_seed_and_id() {
        use rand::Rng;
        let draw = |seed: u64, id: &str| {
            let mut r = test_rng(seed, id);
            (0..4).map(|_| r.random::<u64>()).collect::<Vec<_>>()
        };
        assert_eq!(draw(7, "B312"), draw(7, "B312"));
        assert_ne!(draw(7, "B312"), draw(8, "B312"));
        assert_ne!(draw(7, "B312"), draw(7, "B1201"));
    }
}
