//! Waiting on a machine: `--wait` polling with progress lines, Ctrl-C, and
//! `watch`.

use std::time::{Duration, Instant};

use bigfleet_proto::v1alpha1::{Machine, MachineState};
use tonic::Code;

use crate::args::{Output, Wait};
use crate::dial::Session;
use crate::error::CtlError;
use crate::render::{cell, elapsed, emit, json_error, state_name, MachineView, WatchLine};

/// One `--wait` line: the state, and while a transition is under way what
/// it waits for, as far as Get tells: the operation, how long the machine
/// has been in this state, its host and the `last_error` the provider
/// reports (none until the step fails or times out).
pub(crate) fn progress_line(
    total: Duration,
    id: &str,
    m: &Machine,
    rpc: &str,
    target: MachineState,
    in_state: Duration,
) -> String {
    let mut line = format!(
        "[{:>8}] {}: {}",
        elapsed(total),
        cell(id),
        state_name(m.state)
    );
    let transitional = [
        MachineState::Creating,
        MachineState::Configuring,
        MachineState::Draining,
        MachineState::Deleting,
    ]
    .iter()
    .any(|s| *s as i32 == m.state);
    if transitional && m.state != target as i32 {
        let host = m
            .host
            .as_ref()
            .filter(|h| !h.r#ref.is_empty())
            .map(|h| format!("host {}/{}", cell(&h.provider), cell(&h.r#ref)))
            .unwrap_or_else(|| "no host yet".to_string());
        let error = if m.last_error.is_empty() {
            "no error reported so far".to_string()
        } else {
            format!("last_error: {}", cell(&m.last_error))
        };
        // Whole seconds: the first line, just after the RPC, says no "for 0s".
        let secs = in_state.as_secs();
        if secs > 0 {
            line.push_str(&format!(
                " for {}",
                humantime::format_duration(Duration::from_secs(secs))
            ));
        }
        line.push_str(&format!(
            ", waiting for the provider's {rpc} to reach {} ({host}; {error})",
            state_name(target as i32)
        ));
    } else if !m.last_error.is_empty() {
        line.push_str(&format!(" ({})", cell(&m.last_error)));
    }
    line
}

/// Ctrl-C, registered at creation: a bare `ctrl_c()` future only installs
/// its handler when first polled, so an early Ctrl-C would kill the process.
pub(crate) struct Interrupt {
    #[cfg(unix)]
    signal: tokio::signal::unix::Signal,
}

impl Interrupt {
    pub(crate) fn new() -> Result<Interrupt, CtlError> {
        #[cfg(unix)]
        {
            let signal = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
                .map_err(|e| {
                    CtlError::outcome(format!("cannot install the Ctrl-C handler: {e}"))
                        .caused_by(e)
                })?;
            Ok(Interrupt { signal })
        }
        #[cfg(not(unix))]
        {
            Ok(Interrupt {})
        }
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        {
            if self.signal.recv().await.is_none() {
                std::future::pending::<()>().await;
            }
        }
        #[cfg(not(unix))]
        {
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Poll until `target` (or FAILED); `None` when a Delete made Get answer
/// NOT_FOUND, i.e. the slot itself is gone.
pub(crate) async fn wait_for(
    session: &mut Session,
    rpc: &str,
    id: &str,
    target: MachineState,
    accepted: Machine,
    opts: &Wait,
) -> Result<Option<Machine>, CtlError> {
    let start = Instant::now();
    let mut ctrl_c = Interrupt::new()?;
    let mut current = accepted;
    // When the machine entered its current state, as far as this poll saw.
    let mut state_since = Instant::now();
    let line = |m: &Machine, since: Instant| {
        progress_line(start.elapsed(), id, m, rpc, target, since.elapsed())
    };
    eprintln!("{}", line(&current, state_since));
    // A long transition is not silent: a line at least this often.
    let mut last_line = Instant::now();
    loop {
        if current.state == target as i32 {
            return Ok(Some(current));
        }
        if current.state == MachineState::Failed as i32 {
            return Err(CtlError::outcome(format!(
                "{} landed in FAILED after {}: {}",
                cell(id),
                elapsed(start.elapsed()),
                cell(&current.last_error)
            )));
        }
        if start.elapsed() >= opts.wait_timeout {
            return Err(CtlError::outcome(format!(
                "gave up after --wait-timeout {}: {} is still {} (the transition continues on \
                 the provider)",
                humantime::format_duration(opts.wait_timeout),
                cell(id),
                state_name(current.state)
            )));
        }
        tokio::select! {
            _ = tokio::time::sleep(opts.poll_interval) => {}
            _ = ctrl_c.recv() => {
                return Err(CtlError::outcome(format!(
                    "interrupted while {} was {} (the transition continues on the provider)",
                    cell(id),
                    state_name(current.state)
                )));
            }
        }
        let next = match session.get(id).await {
            Ok(m) => m,
            Err(s) if s.code() == Code::NotFound && target == MachineState::Speculative => {
                eprintln!("[{:>8}] {}: gone", elapsed(start.elapsed()), cell(id));
                return Ok(None);
            }
            Err(s) => return Err(session.status_error(&format!("Get {}", cell(id)), &s)),
        };
        if next.state != current.state {
            state_since = Instant::now();
        }
        if next.state != current.state || last_line.elapsed() >= HEARTBEAT {
            eprintln!("{}", line(&next, state_since));
            last_line = Instant::now();
        }
        current = next;
    }
}

/// How often `--wait` says where a machine is when nothing changes.
pub(crate) const HEARTBEAT: Duration = Duration::from_secs(10);

pub(crate) async fn watch(
    session: &mut Session,
    output: Output,
    id: &str,
    interval: Duration,
    until: Option<MachineState>,
) -> Result<(), CtlError> {
    let start = Instant::now();
    let mut ctrl_c = Interrupt::new()?;
    let mut last: Option<i32> = None;
    loop {
        let machine = match session.get(id).await {
            Ok(m) => Some(m),
            // A machine we already saw can vanish when its slot is gone.
            Err(s) if s.code() == Code::NotFound && last.is_some() => None,
            Err(s) => return Err(session.status_error(&format!("Get {}", cell(id)), &s)),
        };
        let state = machine.as_ref().map(|m| m.state);
        if state.is_none() || state != last {
            let text = match output {
                Output::Json => {
                    let line = WatchLine {
                        elapsed_ms: start.elapsed().as_millis(),
                        machine: machine.as_ref().map(MachineView::from),
                    };
                    serde_json::to_string(&line).map_err(json_error)? + "\n"
                }
                Output::Table => {
                    let mut line = format!(
                        "[{:>8}] {}: {}",
                        elapsed(start.elapsed()),
                        cell(id),
                        state.map(state_name).unwrap_or_else(|| "gone".into())
                    );
                    if let Some(m) = &machine {
                        if m.state == MachineState::Failed as i32 && !m.last_error.is_empty() {
                            line.push_str(&format!(" ({})", cell(&m.last_error)));
                        }
                    }
                    line + "\n"
                }
            };
            emit(&text)?;
        }
        let Some(state) = state else {
            return match until {
                None | Some(MachineState::Speculative) => Ok(()),
                Some(u) => Err(CtlError::outcome(format!(
                    "{} is gone; it will never reach {}",
                    cell(id),
                    state_name(u as i32)
                ))),
            };
        };
        last = Some(state);
        if let Some(u) = until {
            if state == u as i32 {
                return Ok(());
            }
            if state == MachineState::Failed as i32 {
                return Err(CtlError::outcome(format!(
                    "{} is FAILED and will not reach {}",
                    cell(id),
                    state_name(u as i32)
                )));
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = ctrl_c.recv() => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bigfleet_proto::v1alpha1::HostRef;

    fn configuring(last_error: &str) -> Machine {
        Machine {
            id: "m1".into(),
            state: MachineState::Configuring as i32,
            host: Some(HostRef {
                provider: "proxmox".into(),
                r#ref: "pve1/101".into(),
            }),
            last_error: last_error.into(),
            ..Machine::default()
        }
    }

    #[test]
    fn a_transition_line_says_what_it_waits_for() {
        let line = progress_line(
            Duration::from_secs(70),
            "m1",
            &configuring(""),
            "Configure",
            MachineState::Configured,
            Duration::from_secs(65),
        );
        assert_eq!(
            line,
            "[  70.00s] m1: CONFIGURING for 1m 5s, waiting for the provider's Configure to \
             reach CONFIGURED (host proxmox/pve1/101; no error reported so far)"
        );
        let line = progress_line(
            Duration::from_secs(3),
            "m1",
            &configuring("agent not running"),
            "Configure",
            MachineState::Configured,
            Duration::from_secs(3),
        );
        assert!(
            line.ends_with("(host proxmox/pve1/101; last_error: agent not running)"),
            "{line}"
        );
    }

    #[test]
    fn settled_states_print_bare() {
        let mut m = configuring("");
        m.state = MachineState::Configured as i32;
        let line = progress_line(
            Duration::from_secs(1),
            "m1",
            &m,
            "Configure",
            MachineState::Configured,
            Duration::ZERO,
        );
        assert_eq!(line, "[   1.00s] m1: CONFIGURED");
        m.state = MachineState::Failed as i32;
        m.last_error = "readiness timed out".into();
        let line = progress_line(
            Duration::from_secs(1),
            "m1",
            &m,
            "Configure",
            MachineState::Configured,
            Duration::ZERO,
        );
        assert_eq!(line, "[   1.00s] m1: FAILED (readiness timed out)");
    }
}
