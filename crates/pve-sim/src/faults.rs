//! Fault injection and per-endpoint call counters.
//!
//! Endpoints are named `"METHOD /template"` exactly as in the API schema, e.g.
//! `"POST /nodes/{node}/qemu/{vmid}/clone"`; see [`crate::endpoints`].

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// One injected failure rule: the next `count` calls of `endpoint` answer
/// `status` with `message` (as reason phrase and body message).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FailRule {
    pub endpoint: String,
    pub count: u32,
    pub status: u16,
    pub message: String,
}

/// The next `count` worker tasks of type `kind` (`qmclone`, `qmstart`, ...)
/// fail with `message` before doing anything; `{newid}` in the message is
/// replaced by the clone's new VMID.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TaskFailRule {
    pub kind: String,
    pub count: u32,
    pub message: String,
}

#[derive(Default)]
struct Inner {
    fail: Vec<FailRule>,
    /// Applied first, then answered with the error (a lost answer).
    fail_after: Vec<FailRule>,
    fail_task: Vec<TaskFailRule>,
    /// Answered with the error at once, carried out after the delay.
    apply_late: Vec<(FailRule, Duration)>,
    late_applied: u64,
    latency: HashMap<String, Duration>,
    drop_exec_status: u32,
    counts: BTreeMap<String, u64>,
}

/// Shared fault state; cheap to clone via the owning `Arc`.
#[derive(Default)]
pub struct Faults {
    inner: Mutex<Inner>,
}

impl Faults {
    /// Fail the next `count` calls of `endpoint` with `status` + `message`.
    pub fn fail_next(&self, endpoint: &str, count: u32, status: u16, message: &str) {
        self.inner.lock().fail.push(FailRule {
            endpoint: endpoint.to_string(),
            count,
            status,
            message: message.to_string(),
        });
    }

    /// The next `count` calls of `endpoint` are carried out, then answered with
    /// `status` + `message`: what a client sees when pveproxy loses the node's
    /// answer (596/597) for a request the node has already run.
    pub fn fail_after_apply(&self, endpoint: &str, count: u32, status: u16, message: &str) {
        self.inner.lock().fail_after.push(FailRule {
            endpoint: endpoint.to_string(),
            count,
            status,
            message: message.to_string(),
        });
    }

    /// The next `count` calls of `endpoint` are answered with `status` +
    /// `message` at once and carried out `delay` later: pveproxy gave up on
    /// the node (596) while the node still had the request queued, so the
    /// effect lands after the client has concluded it never happened.
    pub fn apply_late(
        &self,
        endpoint: &str,
        count: u32,
        status: u16,
        message: &str,
        delay: Duration,
    ) {
        let rule = FailRule {
            endpoint: endpoint.to_string(),
            count,
            status,
            message: message.to_string(),
        };
        self.inner.lock().apply_late.push((rule, delay));
    }

    /// How many [`Faults::apply_late`] requests have been carried out so far.
    pub fn late_applied(&self) -> u64 {
        self.inner.lock().late_applied
    }

    /// The next `count` worker tasks of type `kind` fail with `message`
    /// (`{newid}` is replaced by a clone's new VMID). For clones nothing is
    /// left behind: this models a collision the worker finds before it
    /// creates anything (`unable to create VM {newid}: config file already
    /// exists`, `close (rename) atomic file '...' failed: File exists`, the
    /// new id's lock timing out).
    pub fn fail_next_task(&self, kind: &str, count: u32, message: &str) {
        self.inner.lock().fail_task.push(TaskFailRule {
            kind: kind.to_string(),
            count,
            message: message.to_string(),
        });
    }

    /// Add `delay` before every call of `endpoint` is handled (zero removes it).
    pub fn set_latency(&self, endpoint: &str, delay: Duration) {
        let mut g = self.inner.lock();
        if delay.is_zero() {
            g.latency.remove(endpoint);
        } else {
            g.latency.insert(endpoint.to_string(), delay);
        }
    }

    /// The next `count` exec-status replies that carry `exited: 1` are consumed
    /// (the agent forgets the pid) and the caller gets a timeout error instead.
    pub fn drop_exec_status_replies(&self, count: u32) {
        self.inner.lock().drop_exec_status += count;
    }

    /// Remove every injected fault (counters are kept).
    pub fn clear(&self) {
        let mut g = self.inner.lock();
        g.fail.clear();
        g.fail_after.clear();
        g.fail_task.clear();
        g.apply_late.clear();
        g.latency.clear();
        g.drop_exec_status = 0;
    }

    /// Calls seen for `endpoint` since start or the last reset.
    pub fn call_count(&self, endpoint: &str) -> u64 {
        self.inner.lock().counts.get(endpoint).copied().unwrap_or(0)
    }

    /// All counters.
    pub fn counts(&self) -> BTreeMap<String, u64> {
        self.inner.lock().counts.clone()
    }

    pub fn reset_counts(&self) {
        self.inner.lock().counts.clear();
    }

    /// Count a call and return the injected latency and failure for it, if any.
    pub(crate) fn on_call(&self, endpoint: &str) -> (Option<Duration>, Option<(u16, String)>) {
        let mut g = self.inner.lock();
        *g.counts.entry(endpoint.to_string()).or_default() += 1;
        let latency = g.latency.get(endpoint).copied();
        let mut fail = None;
        if let Some(pos) = g
            .fail
            .iter()
            .position(|r| r.endpoint == endpoint && r.count > 0)
        {
            let rule = &mut g.fail[pos];
            rule.count -= 1;
            fail = Some((rule.status, rule.message.clone()));
            if rule.count == 0 {
                g.fail.remove(pos);
            }
        }
        (latency, fail)
    }

    /// The post-apply failure for this call of `endpoint`, if one is due.
    pub(crate) fn take_fail_after(&self, endpoint: &str) -> Option<(u16, String)> {
        take_rule(&mut self.inner.lock().fail_after, endpoint)
    }

    /// The late-apply rule for this call of `endpoint`, if one is due.
    pub(crate) fn take_apply_late(&self, endpoint: &str) -> Option<(u16, String, Duration)> {
        let mut g = self.inner.lock();
        let pos = g
            .apply_late
            .iter()
            .position(|(r, _)| r.endpoint == endpoint && r.count > 0)?;
        let (rule, delay) = &mut g.apply_late[pos];
        rule.count -= 1;
        let out = (rule.status, rule.message.clone(), *delay);
        if rule.count == 0 {
            g.apply_late.remove(pos);
        }
        Some(out)
    }

    pub(crate) fn note_late_applied(&self) {
        self.inner.lock().late_applied += 1;
    }

    /// The injected failure for the next worker of type `kind`, if any.
    pub(crate) fn take_task_failure(&self, kind: &str) -> Option<String> {
        let mut g = self.inner.lock();
        let pos = g
            .fail_task
            .iter()
            .position(|r| r.kind == kind && r.count > 0)?;
        let rule = &mut g.fail_task[pos];
        rule.count -= 1;
        let msg = rule.message.clone();
        if rule.count == 0 {
            g.fail_task.remove(pos);
        }
        Some(msg)
    }

    /// Whether to swallow this exited exec-status reply.
    pub(crate) fn take_exec_status_drop(&self) -> bool {
        let mut g = self.inner.lock();
        if g.drop_exec_status > 0 {
            g.drop_exec_status -= 1;
            true
        } else {
            false
        }
    }
}

fn take_rule(rules: &mut Vec<FailRule>, endpoint: &str) -> Option<(u16, String)> {
    let pos = rules
        .iter()
        .position(|r| r.endpoint == endpoint && r.count > 0)?;
    let rule = &mut rules[pos];
    rule.count -= 1;
    let out = (rule.status, rule.message.clone());
    if rule.count == 0 {
        rules.remove(pos);
    }
    Some(out)
}
