//! Behaviour knobs of the Proxmox substrate and their validation.

use std::time::Duration;

use crate::ConfigError;

/// Behaviour knobs of [`super::PveSubstrate`].
#[derive(Clone, Debug)]
pub struct PveOptions {
    /// Resource pool clones are placed in.
    pub pool: Option<String>,
    /// In-guest path of the bootstrap blob.
    pub bootstrap_path: String,
    /// argv run in the guest; the blob path is appended.
    pub bootstrap_exec: Vec<String>,
    /// Shell command that succeeds once the node is Ready; empty = no readiness gate.
    pub readiness_command: String,
    /// Shell command draining the node; `--grace-period` and `--timeout` are appended.
    pub drain_command: String,
    /// Concurrent clones per (target node, storage of the template's disks):
    /// the storage lock is what parallel clones contend on. At least 1.
    pub max_parallel_clones: usize,
    /// Bound on each PVE worker task (clone, start, stop, destroy).
    pub task_timeout: Duration,
    /// How long to wait for the guest agent to answer after a start.
    pub agent_timeout: Duration,
    /// Bound on the bootstrap hook (and blob upload helpers).
    pub exec_timeout: Duration,
    /// Bound on one readiness probe.
    pub readiness_timeout: Duration,
    /// Passed to the drain command as `--timeout`; the exec is awaited a little longer.
    pub drain_timeout: Duration,
    /// Poll period for tasks, agent pings and exec status.
    pub poll_interval: Duration,
    /// A VMID freed (or abandoned) by this process is not reused for this long.
    pub vmid_cooldown: Duration,
    /// VMIDs this provider allocates from (inclusive).
    pub vmid_range: (u32, u32),
}

impl Default for PveOptions {
    fn default() -> Self {
        PveOptions {
            pool: None,
            bootstrap_path: "/run/bigfleet-bootstrap".into(),
            bootstrap_exec: vec!["/bin/sh".into()],
            readiness_command: String::new(),
            drain_command:
                "kubectl drain \"$(hostname)\" --ignore-daemonsets --delete-emptydir-data".into(),
            max_parallel_clones: 2,
            task_timeout: Duration::from_secs(7 * 60),
            agent_timeout: Duration::from_secs(5 * 60),
            exec_timeout: Duration::from_secs(7 * 60),
            readiness_timeout: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(14 * 60),
            poll_interval: Duration::from_secs(1),
            vmid_cooldown: Duration::from_secs(10 * 60),
            vmid_range: (100, 999_999),
        }
    }
}

impl PveOptions {
    /// Rejects options the substrate cannot work with, naming the problem.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.bootstrap_path.trim().is_empty() || !self.bootstrap_path.starts_with('/') {
            return Err(ConfigError::Invalid(format!(
                "--bootstrap-path {:?} must be an absolute in-guest path",
                self.bootstrap_path
            )));
        }
        if self
            .bootstrap_exec
            .first()
            .is_none_or(|a| a.trim().is_empty())
        {
            return Err(ConfigError::Invalid(
                "--bootstrap-exec must name a program".into(),
            ));
        }
        if self.drain_command.trim().is_empty() {
            return Err(ConfigError::Invalid(
                "--drain-command must not be empty".into(),
            ));
        }
        if self.max_parallel_clones == 0 {
            return Err(ConfigError::Invalid(
                "--max-parallel-clones must be at least 1".into(),
            ));
        }
        let (lo, hi) = self.vmid_range;
        if lo < 100 || hi < lo {
            return Err(ConfigError::Invalid(format!(
                "VMID range {lo}-{hi} is invalid (PVE ids start at 100)"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_validation() {
        assert!(PveOptions::default().validate().is_ok());
        let bad = PveOptions {
            bootstrap_exec: vec![],
            ..PveOptions::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--bootstrap-exec"));
        let bad = PveOptions {
            max_parallel_clones: 0,
            ..PveOptions::default()
        };
        assert!(bad.validate().is_err());
    }
}
