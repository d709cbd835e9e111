//! PVE task ids: `UPID:{node}:{pid}:{pstart}:{starttime}:{type}:{id}:{user}:`.

use std::fmt;
use std::str::FromStr;

use crate::error::PveError;

/// A parsed task id. `Display` gives back the exact original string.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Upid {
    raw: String,
    /// Node that runs the task (and must be asked for its status).
    pub node: String,
    pub pid: u32,
    pub pstart: u64,
    /// Unix seconds.
    pub starttime: u64,
    /// e.g. `qmclone`, `qmstart`, `qmdestroy`, `hastart`.
    pub task_type: String,
    /// Usually the VMID; may be empty.
    pub id: String,
    /// e.g. `bigfleet@pve!autoscaler`.
    pub user: String,
}

fn bad(raw: &str, why: impl fmt::Display) -> PveError {
    PveError::InvalidArgument(format!("malformed UPID {raw:?}: {why}"))
}

fn hex_field(raw: &str, name: &str, v: &str, min: usize, max: usize) -> Result<u64, PveError> {
    if v.len() < min || v.len() > max || !v.bytes().all(|b| b.is_ascii_hexdigit()) {
        let want = if min == max {
            format!("{min}")
        } else {
            format!("{min}-{max}")
        };
        return Err(bad(raw, format!("{name} {v:?} is not {want} hex digits")));
    }
    u64::from_str_radix(v, 16).map_err(|e| bad(raw, format!("{name}: {e}")))
}

impl Upid {
    /// Parses and validates a UPID (the trailing colon is required).
    pub fn parse(raw: &str) -> Result<Upid, PveError> {
        let rest = raw
            .strip_prefix("UPID:")
            .ok_or_else(|| bad(raw, "does not start with \"UPID:\""))?;
        let rest = rest
            .strip_suffix(':')
            .ok_or_else(|| bad(raw, "missing trailing ':'"))?;
        let f: Vec<&str> = rest.split(':').collect();
        if f.len() != 7 {
            return Err(bad(raw, format!("expected 7 fields, found {}", f.len())));
        }
        if f[0].is_empty() {
            return Err(bad(raw, "empty node"));
        }
        let pid = hex_field(raw, "pid", f[1], 8, 8)?;
        let pstart = hex_field(raw, "pstart", f[2], 8, 9)?;
        let starttime = hex_field(raw, "starttime", f[3], 8, 8)?;
        if f[4].is_empty() {
            return Err(bad(raw, "empty task type"));
        }
        if f[6].is_empty() {
            return Err(bad(raw, "empty user"));
        }
        Ok(Upid {
            raw: raw.to_string(),
            node: f[0].to_string(),
            pid: u32::try_from(pid).map_err(|e| bad(raw, e))?,
            pstart,
            starttime,
            task_type: f[4].to_string(),
            id: f[5].to_string(),
            user: f[6].to_string(),
        })
    }

    pub fn as_str(&self) -> &str {
        &self.raw
    }
}

impl fmt::Display for Upid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.raw)
    }
}

impl FromStr for Upid {
    type Err = PveError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Upid::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "UPID:pve1:00000ACD:00006AE8:679A423B:qmclone:112:bigfleet@pve!autoscaler:";

    #[test]
    fn parses_example() {
        let u = Upid::parse(GOOD).unwrap();
        assert_eq!(u.node, "pve1");
        assert_eq!(u.pid, 0xACD);
        assert_eq!(u.pstart, 0x6AE8);
        assert_eq!(u.starttime, 0x679A423B);
        assert_eq!(u.task_type, "qmclone");
        assert_eq!(u.id, "112");
        assert_eq!(u.user, "bigfleet@pve!autoscaler");
        assert_eq!(u.to_string(), GOOD);
    }

    #[test]
    fn nine_digit_pstart_and_empty_id() {
        let u = Upid::parse("UPID:n:0000000A:10006AE8F:679A423B:vzdump::root@pam:").unwrap();
        assert_eq!(u.pstart, 0x10006AE8F);
        assert_eq!(u.id, "");
    }

    #[test]
    fn rejects_malformed() {
        for (s, why) in [
            (
                "UPID:pve1:00000ACD:00006AE8:679A423B:qmclone:112:bigfleet@pve!autoscaler",
                "trailing",
            ),
            (
                "XPID:pve1:00000ACD:00006AE8:679A423B:qmclone:112:u@pve:",
                "UPID:",
            ),
            ("UPID:pve1:0ACD:00006AE8:679A423B:qmclone:112:u@pve:", "pid"),
            (
                "UPID:pve1:00000ACD:00006AE8:679A423B:qmclone:u@pve:",
                "7 fields",
            ),
            (
                "UPID:pve1:0000ZACD:00006AE8:679A423B:qmclone:112:u@pve:",
                "pid",
            ),
            (
                "UPID::00000ACD:00006AE8:679A423B:qmclone:112:u@pve:",
                "node",
            ),
            ("UPID:pve1:00000ACD:00006AE8:679A423B:qmclone:112::", "user"),
            ("", "UPID:"),
        ] {
            let e = Upid::parse(s).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("malformed UPID") && msg.contains(why),
                "{s}: {msg}"
            );
        }
    }
}
