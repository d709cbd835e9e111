//! PVE worker tasks: UPIDs, status and logs.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

/// One worker task as `/nodes/{node}/tasks/{upid}/...` reports it.
#[derive(Clone, Debug)]
pub struct Task {
    pub upid: String,
    pub node: String,
    pub pid: u32,
    pub pstart: u32,
    pub starttime: u64,
    pub kind: String,
    pub id: String,
    pub user: String,
    /// `None` while running; then `OK`, `WARNINGS: N` or the error text.
    pub exitstatus: Option<String>,
    /// When it finished (seconds since the epoch).
    pub endtime: Option<u64>,
    pub log: Vec<String>,
    /// For a clone worker: the VMID it creates.
    pub newid: Option<u32>,
}

impl Task {
    pub fn new(node: &str, pid: u32, pstart: u32, kind: &str, id: &str, user: &str) -> Self {
        let starttime = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let upid = format_upid(node, pid, pstart, starttime, kind, id, user);
        Self {
            upid,
            node: node.to_string(),
            pid,
            pstart,
            starttime,
            kind: kind.to_string(),
            id: id.to_string(),
            user: user.to_string(),
            exitstatus: None,
            endtime: None,
            log: Vec::new(),
            newid: None,
        }
    }

    /// The fields the task's status and its task-list row share.
    fn fields_json(&self) -> Value {
        json!({
            "upid": self.upid,
            "node": self.node,
            "pid": self.pid,
            "pstart": self.pstart,
            "starttime": self.starttime,
            "type": self.kind,
            "id": self.id,
            "user": self.user,
        })
    }

    pub fn status_json(&self) -> Value {
        let mut v = self.fields_json();
        v["status"] = json!(if self.exitstatus.is_some() {
            "stopped"
        } else {
            "running"
        });
        if let Some(es) = &self.exitstatus {
            v["exitstatus"] = json!(es);
        }
        v
    }

    /// One row of a node's task list: a running task has `status:
    /// "RUNNING"` (pve-manager `PVE/API2/Tasks.pm` `node_tasks` sets it on
    /// every active row without one), a finished one its exit status and
    /// `endtime`.
    pub fn list_json(&self) -> Value {
        let mut v = self.fields_json();
        match &self.exitstatus {
            Some(es) => {
                v["status"] = json!(es);
                v["endtime"] = json!(self.endtime.unwrap_or(self.starttime));
            }
            None => v["status"] = json!("RUNNING"),
        }
        v
    }

    /// Log lines `[{n, t}]` from line `start` (0-based), at most `limit`.
    /// An ended task's log ends with its worker's last line, which its
    /// status is read from (pve-common `PVE::UPID::read_status`); a worker
    /// that died without one (its node powered off) leaves none, and its
    /// status reads `unexpected status` for that very reason.
    pub fn log_json(&self, start: usize, limit: usize) -> Value {
        let mut lines: Vec<String> = self.log.clone();
        match &self.exitstatus {
            Some(es) if es == "unexpected status" => {}
            Some(es) if es == "OK" => lines.push("TASK OK".into()),
            Some(es) if es.starts_with("WARNINGS") => lines.push(format!("TASK {es}")),
            Some(es) => lines.push(format!("TASK ERROR: {es}")),
            None => {}
        }
        let rows: Vec<Value> = lines
            .iter()
            .enumerate()
            .skip(start)
            .take(limit)
            .map(|(i, t)| json!({"n": i + 1, "t": t}))
            .collect();
        Value::Array(rows)
    }
}

/// `UPID:{node}:{pid}:{pstart}:{starttime}:{type}:{id}:{user}:` (hex fields, 8 digits).
pub fn format_upid(
    node: &str,
    pid: u32,
    pstart: u32,
    starttime: u64,
    kind: &str,
    id: &str,
    user: &str,
) -> String {
    format!("UPID:{node}:{pid:08X}:{pstart:08X}:{starttime:08X}:{kind}:{id}:{user}:")
}

/// Node named inside a UPID, if it parses.
pub fn upid_node(upid: &str) -> Option<&str> {
    let mut parts = upid.split(':');
    if parts.next()? != "UPID" {
        return None;
    }
    let node = parts.next()?;
    // pid, pstart, starttime, type, id, user, trailing empty
    let rest: Vec<&str> = parts.collect();
    if rest.len() != 7 || !rest[6].is_empty() {
        return None;
    }
    for hex in &rest[..3] {
        u64::from_str_radix(hex, 16).ok()?;
    }
    Some(node)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upid_round_trip() {
        let u = format_upid(
            "pve1",
            0xACD,
            0x6AE8,
            0x679A423B,
            "qmclone",
            "112",
            "bigfleet@pve!autoscaler",
        );
        assert_eq!(
            u,
            "UPID:pve1:00000ACD:00006AE8:679A423B:qmclone:112:bigfleet@pve!autoscaler:"
        );
        assert_eq!(upid_node(&u), Some("pve1"));
        assert_eq!(upid_node("UPID:pve1:zz"), None);
    }
}
