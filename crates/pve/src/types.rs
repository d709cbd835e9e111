//! Request parameters and response shapes of the endpoints the provider uses,
//! plus lenient decoders for PVE's loosely typed JSON (booleans as `0`/`1`,
//! numbers as strings).
//!
//! One file past 600 lines on purpose: the shapes and the lenient decoders
//! they share are one vocabulary.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::tags::normalize_tags;

/// Lenient scalar decoding, usable directly or via `#[serde(deserialize_with)]`.
pub mod lenient {
    use super::*;
    use serde::de::Error;

    /// `true`/`false`, `0`/`1` (number or string), `"true"`/`"false"`, `"yes"`/`"no"`,
    /// `"on"`/`"off"`. Anything else is `None`.
    pub fn as_bool(v: &Value) -> Option<bool> {
        match v {
            Value::Bool(b) => Some(*b),
            Value::Number(n) => {
                let x = n.as_f64()?;
                if x == 0.0 {
                    Some(false)
                } else if x == 1.0 {
                    Some(true)
                } else {
                    None
                }
            }
            Value::String(s) => match s.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => Some(true),
                "0" | "false" | "no" | "off" => Some(false),
                _ => None,
            },
            _ => None,
        }
    }

    /// A non-negative integer as a JSON number (integral) or a numeric string.
    pub fn as_u64(v: &Value) -> Option<u64> {
        match v {
            Value::Number(n) => n.as_u64().or_else(|| {
                n.as_f64()
                    .filter(|x| x.fract() == 0.0 && *x >= 0.0 && *x <= u64::MAX as f64)
                    .map(|x| x as u64)
            }),
            Value::String(s) => s.trim().parse().ok(),
            _ => None,
        }
    }

    /// A signed integer as a JSON number (integral) or a numeric string.
    pub fn as_i64(v: &Value) -> Option<i64> {
        match v {
            Value::Number(n) => n.as_i64().or_else(|| {
                n.as_f64()
                    .filter(|x| x.fract() == 0.0 && x.abs() <= i64::MAX as f64)
                    .map(|x| x as i64)
            }),
            Value::String(s) => s.trim().parse().ok(),
            _ => None,
        }
    }

    /// A float as a JSON number or a numeric string.
    pub fn as_f64(v: &Value) -> Option<f64> {
        match v {
            Value::Number(n) => n.as_f64(),
            Value::String(s) => s.trim().parse().ok(),
            _ => None,
        }
    }

    fn describe(v: &Value) -> String {
        let s = v.to_string();
        if s.chars().count() > 40 {
            format!("{}...", s.chars().take(40).collect::<String>())
        } else {
            s
        }
    }

    fn opt<'de, D, T>(d: D, what: &str, f: fn(&Value) -> Option<T>) -> Result<Option<T>, D::Error>
    where
        D: Deserializer<'de>,
    {
        let v = Option::<Value>::deserialize(d)?;
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.trim().is_empty() => Ok(None),
            Some(v) => f(&v)
                .map(Some)
                .ok_or_else(|| D::Error::custom(format!("expected {what}, got {}", describe(&v)))),
        }
    }

    pub fn bool<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        Ok(opt(d, "a boolean", as_bool)?.unwrap_or(false))
    }
    pub fn opt_bool<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
        opt(d, "a boolean", as_bool)
    }
    pub fn u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        opt(d, "an unsigned integer", as_u64)?
            .ok_or_else(|| D::Error::custom("expected an unsigned integer, got nothing"))
    }
    pub fn opt_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        opt(d, "an unsigned integer", as_u64)
    }
    pub fn u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
        let v = u64(d)?;
        u32::try_from(v).map_err(|_| D::Error::custom(format!("{v} is out of range for u32")))
    }
    pub fn opt_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        match opt_u64(d)? {
            None => Ok(None),
            Some(v) => u32::try_from(v)
                .map(Some)
                .map_err(|_| D::Error::custom(format!("{v} is out of range for u32"))),
        }
    }
    pub fn opt_i64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
        opt(d, "an integer", as_i64)
    }
    pub fn opt_f64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        opt(d, "a number", as_f64)
    }
    /// A string; numbers are rendered (PVE sometimes sends numeric names/ids as numbers).
    pub fn opt_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        let v = Option::<Value>::deserialize(d)?;
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            Some(v) => Err(D::Error::custom(format!(
                "expected a string, got {}",
                describe(&v)
            ))),
        }
    }
    /// A config `description`. PVE stores it as `#` comment lines and returns
    /// every line, the last included, terminated by `\n`; that newline is an
    /// artefact of the storage, not part of what was written, so one is removed
    /// (the text reads back as sent).
    pub fn opt_description<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        Ok(opt_string(d)?.map(|mut s| {
            if s.ends_with('\n') {
                s.pop();
            }
            s
        }))
    }
    /// A PVE tag list string (`a;b`) normalised with [`crate::normalize_tags`].
    pub fn tags<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        Ok(opt_string(d)?
            .map(|s| normalize_tags(&s))
            .unwrap_or_default())
    }
    /// `memory` in a VM config: an integer, a numeric string, or a property string
    /// like `current=4096,...` (newer PVE). MiB.
    pub fn opt_memory<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        let Some(s) = opt_string(d)? else {
            return Ok(None);
        };
        let s = s.trim();
        if s.is_empty() {
            return Ok(None);
        }
        if let Ok(v) = s.parse() {
            return Ok(Some(v));
        }
        for part in s.split(',') {
            if let Some(v) = part.strip_prefix("current=") {
                if let Ok(v) = v.trim().parse() {
                    return Ok(Some(v));
                }
            }
        }
        Err(D::Error::custom(format!("unrecognised memory value {s:?}")))
    }
}

/// Parameters of `POST /nodes/{node}/qemu/{template}/clone`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CloneParams {
    pub newid: u32,
    /// DNS name of the new VM.
    pub name: Option<String>,
    pub description: Option<String>,
    pub pool: Option<String>,
    /// `Some(true)` for a full clone (templates default to a linked clone).
    pub full: Option<bool>,
    /// Target storage (full clones only).
    pub storage: Option<String>,
    /// Target node (only allowed when the template's disks are on shared storage).
    pub target: Option<String>,
}

/// A CD-ROM drive of a VM config (`ide2: local:iso/x.iso,media=cdrom`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cdrom {
    /// The config key (`ide2`).
    pub key: String,
    /// `local:iso/x.iso`, `local-lvm:vm-9000-cloudinit`, `cdrom` (the
    /// host's drive) or `none`.
    pub volume: String,
}

impl Cdrom {
    /// The storage of a volume on a PVE storage; `None` for `cdrom`,
    /// `none` and paths.
    pub fn storage(&self) -> Option<&str> {
        let (storage, _) = self.volume.split_once(':')?;
        (!storage.is_empty() && !storage.starts_with('/')).then_some(storage)
    }

    /// The host's physical drive: PVE asks for `Sys.Console` on `/`.
    pub fn is_physical(&self) -> bool {
        self.volume == "cdrom"
    }

    /// A cloud-init drive, which PVE regenerates rather than copies.
    pub fn is_cloudinit(&self) -> bool {
        self.volume.contains("cloudinit")
    }
}

/// Parameters of `PUT`/`POST /nodes/{node}/qemu/{vmid}/config`. Unset fields are not sent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigParams {
    pub cores: Option<u32>,
    /// A clone copies its template's; `maxcpus` is `sockets` x `cores`.
    pub sockets: Option<u32>,
    /// MiB.
    pub memory: Option<u64>,
    /// MiB: the least memory host auto-ballooning may leave the guest; 0
    /// removes the balloon device. PVE refuses a `memory` below the
    /// balloon in force, so a smaller `memory` needs one sent with it.
    pub balloon: Option<u64>,
    /// At most 8 KiB.
    pub description: Option<String>,
    /// Sent joined with `;`; PVE normalises them (see [`crate::normalize_tags`]).
    pub tags: Option<Vec<String>>,
    /// Optimistic concurrency: fail if the config changed since this digest was read.
    pub digest: Option<String>,
    /// Keys to remove (`delete=protection`). PVE warns about, and skips, a
    /// key that is not set, so removing one that may be absent is safe.
    pub delete: Vec<String>,
    /// `hostpciN` entries to set, by `N` (`mapping=gpu,pcie=1`).
    pub hostpci: std::collections::BTreeMap<u32, String>,
}

/// `GET /nodes/{node}/qemu/{vmid}/config`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct VmConfig {
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub name: Option<String>,
    /// As written: PVE's trailing storage newline is removed.
    #[serde(default, deserialize_with = "lenient::opt_description")]
    pub description: Option<String>,
    /// Normalised tag list.
    #[serde(default, deserialize_with = "lenient::tags")]
    pub tags: Vec<String>,
    #[serde(default, deserialize_with = "lenient::opt_u32")]
    pub cores: Option<u32>,
    #[serde(default, deserialize_with = "lenient::opt_u32")]
    pub sockets: Option<u32>,
    /// Hot-plugged vCPUs the guest boots with (below `sockets` x `cores`).
    #[serde(default, deserialize_with = "lenient::opt_u32")]
    pub vcpus: Option<u32>,
    /// MiB.
    #[serde(default, deserialize_with = "lenient::opt_memory")]
    pub memory: Option<u64>,
    /// MiB; `Some(0)`: no balloon device; `None`: as `memory`.
    #[serde(default, deserialize_with = "lenient::opt_u64")]
    pub balloon: Option<u64>,
    /// CPU model property string (`host`, `custom-gpu,flags=...`).
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub cpu: Option<String>,
    /// Raw agent property string, e.g. `1` or `enabled=1,fstrim_cloned_disks=1`.
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub agent: Option<String>,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub lock: Option<String>,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub digest: Option<String>,
    #[serde(default, deserialize_with = "lenient::opt_bool")]
    pub template: Option<bool>,
    /// Every other key, untouched.
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// Whether `key` names a VM disk slot (`scsiN`, `virtioN`, `sataN`, `ideN`,
/// `efidisk0`, `tpmstate0`). `unusedN` is not: full clones do not copy it.
fn is_disk_key(key: &str) -> bool {
    if key == "efidisk0" || key == "tpmstate0" {
        return true;
    }
    ["scsi", "virtio", "sata", "ide"].iter().any(|bus| {
        key.strip_prefix(bus)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// The storage id of one disk property string (`local-lvm:vm-9000-disk-0,size=32G`
/// or `file=local-lvm:...`). `None` for CD-ROMs, `none`, and pass-through
/// paths (`/dev/...`), which live on no PVE storage.
fn disk_storage(value: &str) -> Option<&str> {
    let mut file = None;
    for (i, part) in value.split(',').enumerate() {
        let part = part.trim();
        match part.split_once('=') {
            Some(("media", m)) if m.trim() == "cdrom" => return None,
            Some(("file", f)) => file = Some(f.trim()),
            // The first, key-less part is the volume.
            None if i == 0 => file = Some(part),
            _ => {}
        }
    }
    let (storage, _volume) = file?.split_once(':')?;
    let storage = storage.trim();
    (!storage.is_empty() && !storage.starts_with('/')).then_some(storage)
}

/// Bytes of a disk's `size=` option (`32G`, `512M`, `1T`, `4096K`, or bare
/// bytes). `None` when absent or unparsable.
fn disk_size(value: &str) -> Option<u64> {
    let size = value
        .split(',')
        .find_map(|p| p.trim().strip_prefix("size="))?
        .trim();
    let (num, shift) = match size.as_bytes().last()? {
        b'K' | b'k' => (&size[..size.len() - 1], 10),
        b'M' | b'm' => (&size[..size.len() - 1], 20),
        b'G' | b'g' => (&size[..size.len() - 1], 30),
        b'T' | b't' => (&size[..size.len() - 1], 40),
        _ => (size, 0),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(1u64 << shift);
    }
    // Fractional sizes (`1.5G`) appear after some resizes.
    let f: f64 = num.parse().ok()?;
    (f.is_finite() && f >= 0.0).then(|| (f * (1u64 << shift) as f64) as u64)
}

impl VmConfig {
    /// Disks that live on a PVE storage: `(key, storage, bytes)`, bytes 0
    /// when the config gives no size. CD-ROMs, `none` and pass-through
    /// devices are left out.
    pub fn disks(&self) -> Vec<(String, String, u64)> {
        self.other
            .iter()
            .filter(|(k, _)| is_disk_key(k))
            .filter_map(|(k, v)| {
                let v = v.as_str()?;
                let storage = disk_storage(v)?;
                Some((k.clone(), storage.to_string(), disk_size(v).unwrap_or(0)))
            })
            .collect()
    }

    /// The disk the VM boots from, `(key, storage, bytes)`: the first disk
    /// of `boot: order=...` (PVE 6.2 and later), else the legacy
    /// `bootdisk`, else the first of `scsi0`, `virtio0`, `sata0`, `ide0`
    /// the VM has. `None` for a VM without a disk on a storage.
    pub fn boot_disk(&self) -> Option<(String, String, u64)> {
        let disks = self.disks();
        let find = |key: &str| disks.iter().find(|(k, _, _)| k == key).cloned();
        let text = |key: &str| self.other.get(key).and_then(Value::as_str);
        if let Some(order) = text("boot").and_then(|b| {
            b.split(',')
                .find_map(|part| part.trim().strip_prefix("order="))
        }) {
            if let Some(d) = order.split(';').find_map(|key| find(key.trim())) {
                return Some(d);
            }
        }
        if let Some(d) = text("bootdisk").and_then(|k| find(k.trim())) {
            return Some(d);
        }
        ["scsi0", "virtio0", "sata0", "ide0"]
            .into_iter()
            .find_map(find)
    }

    /// The property strings of the VM's NICs (`netN`).
    pub(crate) fn nics(&self) -> impl Iterator<Item = &str> {
        self.other
            .iter()
            .filter(|(k, _)| {
                k.strip_prefix("net")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
            .filter_map(|(_, v)| v.as_str())
    }

    /// The bridges (or SDN VNets) the VM's NICs (`netN`) are on, sorted and
    /// deduplicated.
    pub fn bridges(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .nics()
            .filter_map(|v| {
                v.split(',')
                    .find_map(|part| part.trim().strip_prefix("bridge="))
                    .map(str::trim)
                    .filter(|b| !b.is_empty())
                    .map(str::to_string)
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// The VM's CD-ROM drives (`media=cdrom`), by key, in key order. They are
    /// not disks to copy, but qemu-server counts a volume on a storage as
    /// one of the VM's volumes: an ISO on `local` makes a VM "use local
    /// storage" for a clone to another node, and stops an offline migration.
    pub fn cdroms(&self) -> Vec<Cdrom> {
        self.other
            .iter()
            .filter(|(k, _)| is_disk_key(k))
            .filter_map(|(k, v)| {
                let v = v.as_str()?;
                let mut parts = v.split(',');
                let first = parts.next()?.trim();
                let file = first.strip_prefix("file=").unwrap_or(first);
                let is_cdrom = v.split(',').any(|p| p.trim() == "media=cdrom");
                is_cdrom.then(|| Cdrom {
                    key: k.clone(),
                    volume: file.to_string(),
                })
            })
            .collect()
    }

    /// The storage ids the VM's disks live on, sorted and deduplicated. Disk
    /// keys are read from [`VmConfig::other`]; CD-ROMs, `none` and
    /// pass-through devices are ignored. Empty for a VM without disks.
    pub fn disk_storages(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .other
            .iter()
            .filter(|(k, _)| is_disk_key(k))
            .filter_map(|(_, v)| v.as_str().and_then(disk_storage))
            .map(str::to_string)
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Whether the guest agent is enabled in the config (`agent: 1` or `enabled=1,...`).
    pub fn agent_enabled(&self) -> bool {
        let Some(a) = self.agent.as_deref() else {
            return false;
        };
        for part in a.split(',') {
            let (k, v) = match part.split_once('=') {
                Some((k, v)) => (k.trim(), v.trim()),
                None => ("enabled", part.trim()),
            };
            if k == "enabled" {
                return lenient::as_bool(&Value::String(v.to_string())).unwrap_or(false);
            }
        }
        false
    }
}

/// `GET /nodes/{node}/qemu/{vmid}/status/current`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct VmStatus {
    /// `running` or `stopped`.
    pub status: String,
    #[serde(default, deserialize_with = "lenient::opt_u32")]
    pub vmid: Option<u32>,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub qmpstatus: Option<String>,
    /// e.g. `clone` while a clone worker holds the config.
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub lock: Option<String>,
    /// Agent configured.
    #[serde(default, deserialize_with = "lenient::bool")]
    pub agent: bool,
    /// HA manager status object (e.g. `{"managed":1,"state":"started"}`).
    #[serde(default)]
    pub ha: Value,
    #[serde(default, deserialize_with = "lenient::tags")]
    pub tags: Vec<String>,
    #[serde(default, deserialize_with = "lenient::bool")]
    pub template: bool,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub name: Option<String>,
}

impl VmStatus {
    pub fn is_running(&self) -> bool {
        self.status == "running"
    }
    /// True if the HA manager manages this VM (start/stop only queue requests).
    pub fn ha_managed(&self) -> bool {
        self.ha
            .get("managed")
            .and_then(lenient::as_bool)
            .unwrap_or(false)
    }
}

/// `running` / `stopped` of a worker task.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskState {
    Running,
    Stopped,
}

/// One row of `GET /nodes/{node}/tasks`. A running task has `status:
/// "RUNNING"` (pve-manager sets it on every active row; older clients
/// and some proxies leave it out); a finished one has its exit status.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TaskSummary {
    pub upid: String,
    #[serde(default, rename = "type", deserialize_with = "lenient::opt_string")]
    pub task_type: Option<String>,
    /// The VMID (or other object) the task is about: for `qmclone`, the source.
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub id: Option<String>,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub user: Option<String>,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub status: Option<String>,
    /// When it ended (Unix seconds); only on a task that has ended.
    #[serde(default, deserialize_with = "lenient::opt_u64")]
    pub endtime: Option<u64>,
}

impl TaskSummary {
    /// Still running: listed as `RUNNING`, or without an exit status.
    /// Never only the latter: real PVE always fills it in, so a row read
    /// as finished would let a restarted provider clone a second VM
    /// beside the one a dead process's clone is still copying.
    pub fn is_running(&self) -> bool {
        self.status.as_deref().is_none_or(|s| s == "RUNNING")
    }

    /// The exit status of a task the row shows ended (`OK`, `WARNINGS: N`
    /// or the error text). `None` while it runs, and for a row that has
    /// an end time but no status: that task's own status says how it ended.
    pub fn exit_status(&self) -> Option<&str> {
        self.status
            .as_deref()
            .filter(|s| !s.is_empty() && *s != "RUNNING")
    }
}

/// `GET /nodes/{node}/tasks/{upid}/status`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TaskStatus {
    pub status: TaskState,
    /// `OK`, `WARNINGS: N` or the error text; only once stopped.
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub exitstatus: Option<String>,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub upid: Option<String>,
    #[serde(default, rename = "type", deserialize_with = "lenient::opt_string")]
    pub task_type: Option<String>,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub node: Option<String>,
}

impl TaskStatus {
    pub fn is_running(&self) -> bool {
        self.status == TaskState::Running
    }
    /// Stopped with `OK` or `WARNINGS: N`.
    pub fn succeeded(&self) -> bool {
        self.status == TaskState::Stopped && self.exitstatus.as_deref().is_some_and(exit_ok)
    }
}

/// `OK` and `WARNINGS: N` are both success.
pub fn exit_ok(exitstatus: &str) -> bool {
    let s = exitstatus.trim();
    s == "OK" || s.starts_with("WARNINGS:")
}

/// One line of `GET /nodes/{node}/tasks/{upid}/log`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TaskLogLine {
    #[serde(deserialize_with = "lenient::u64")]
    pub n: u64,
    #[serde(default)]
    pub t: String,
}

impl TaskLogLine {
    /// The exit status this line gives, when it is the line a worker ends
    /// its log with: `TASK OK` (`OK`), `TASK WARNINGS: N` (`WARNINGS: N`)
    /// or `TASK ERROR: <cause>` (the cause). PVE's own status read takes
    /// the exit status from the log's last line this way (pve-common
    /// `PVE::UPID::read_status`), so a log ending in one is that of an
    /// ended task, and says how it ended. `None` for any other line.
    pub fn exit_status(&self) -> Option<&str> {
        let rest = self.t.strip_prefix("TASK ")?;
        if rest == "OK" {
            return Some(rest);
        }
        if let Some(cause) = rest.strip_prefix("ERROR: ") {
            return (!cause.is_empty()).then_some(cause);
        }
        let count = rest.strip_prefix("WARNINGS: ")?;
        (!count.is_empty() && count.bytes().all(|b| b.is_ascii_digit())).then_some(rest)
    }

    /// A line that says why a task failed: PVE's workers write their cause
    /// as `ERROR: …` or a `… failed: …` line (a migration's exit status says
    /// only `migration aborted`).
    pub fn is_error(&self) -> bool {
        self.t.contains("ERROR") || self.t.contains("failed")
    }

    /// The volume a destroy could not free, when this line says so:
    /// qemu-server's `destroy_vm` goes on past a disk whose `vdisk_free`
    /// fails (RBD watchers, an LV or ZFS dataset in use) with `Could not
    /// remove disk '<volid>', check manually: <error>`, written by
    /// `log_warn` on PVE 9 (`WARN: ` in front, counted in `WARNINGS: N`)
    /// and by Perl's `warn` on PVE 8 (bare, the task still ends `OK`).
    pub fn unremoved_disk(&self) -> Option<&str> {
        let (_, rest) = self.t.split_once("Could not remove disk '")?;
        let (volid, _) = rest.split_once("', check manually")?;
        (!volid.is_empty()).then_some(volid)
    }

    /// How far a disk copy is, in percent, when this line reports it:
    /// qemu-server prints qemu-img's progress in a full clone's log as
    /// `transferred 204.8 MiB of 2.0 GiB (10.00%)` (`QemuImage::convert`)
    /// and a block job's (a clone of a running VM, a disk move) as
    /// `drive-scsi0: transferred 1.0 GiB of 32.0 GiB (3.12%) in 2s`
    /// (`BlockJob::qemumonitor_wait_blockjobs`).
    pub fn copy_percent(&self) -> Option<f64> {
        let t = self.t.trim();
        let rest = match t.split_once(": transferred ") {
            Some((job, rest)) if !job.contains(' ') => rest,
            _ => t.strip_prefix("transferred ")?,
        };
        let (_, tail) = rest.split_once(" of ")?;
        let (_, pct) = tail.split_once(" (")?;
        let (pct, _) = pct.split_once("%)")?;
        pct.parse::<f64>()
            .ok()
            .filter(|p| p.is_finite() && (0.0..=100.0).contains(p))
    }
}

/// One VM from `GET /cluster/resources?type=vm` (may be seconds stale; no description).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct ClusterVm {
    /// e.g. `qemu/101`.
    #[serde(default)]
    pub id: String,
    /// `qemu` or `lxc`.
    #[serde(default, rename = "type")]
    pub kind: String,
    #[serde(deserialize_with = "lenient::u32")]
    pub vmid: u32,
    #[serde(default)]
    pub node: String,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub name: Option<String>,
    /// `running`, `stopped`, or `unknown` for VMs on offline nodes.
    #[serde(default)]
    pub status: String,
    #[serde(default, deserialize_with = "lenient::bool")]
    pub template: bool,
    #[serde(default, deserialize_with = "lenient::tags")]
    pub tags: Vec<String>,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub pool: Option<String>,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub lock: Option<String>,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub hastate: Option<String>,
    /// Bytes.
    #[serde(default, deserialize_with = "lenient::opt_u64")]
    pub maxmem: Option<u64>,
    #[serde(default, deserialize_with = "lenient::opt_f64")]
    pub maxcpu: Option<f64>,
    /// The QEMU process of a running VM (`GET /nodes/{node}/qemu` has it;
    /// `/cluster/resources` does not): a new one each time it starts.
    #[serde(default, deserialize_with = "lenient::opt_u32")]
    pub pid: Option<u32>,
}

/// The cluster's VMs as one read sees them, with the nodes that were down
/// ([`crate::PveClient::cluster_vms`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClusterVms {
    pub vms: Vec<ClusterVm>,
    /// Nodes `GET /nodes` listed as anything but `online`, sorted.
    pub offline_nodes: Vec<String>,
}

impl ClusterVms {
    /// Whether `node` was down: its rows are PVE's last sample (or
    /// `unknown`), and a call to it would hang until the connect fails.
    pub fn is_offline(&self, node: &str) -> bool {
        self.offline_nodes.iter().any(|n| n == node)
    }
}

/// One node from `GET /nodes`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct NodeInfo {
    pub node: String,
    /// `online`, `offline` or `unknown`.
    #[serde(default)]
    pub status: String,
    #[serde(default, deserialize_with = "lenient::opt_f64")]
    pub cpu: Option<f64>,
    #[serde(default, deserialize_with = "lenient::opt_f64")]
    pub maxcpu: Option<f64>,
    #[serde(default, deserialize_with = "lenient::opt_u64")]
    pub mem: Option<u64>,
    #[serde(default, deserialize_with = "lenient::opt_u64")]
    pub maxmem: Option<u64>,
    #[serde(default, deserialize_with = "lenient::opt_u64")]
    pub uptime: Option<u64>,
    /// `AB:CD:...` SHA-256 of the node's certificate.
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub ssl_fingerprint: Option<String>,
}

/// One storage on one node: `GET /nodes/{node}/storage` (one row each,
/// `storage` set) or `GET /nodes/{node}/storage/{storage}/status`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct StorageStatus {
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub storage: Option<String>,
    /// Plugin type: `dir`, `lvm`, `lvmthin`, `zfspool`, `rbd`, `nfs`, ...
    #[serde(default, rename = "type")]
    pub kind: String,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub content: Option<String>,
    #[serde(default, deserialize_with = "lenient::bool")]
    pub shared: bool,
    #[serde(default, deserialize_with = "lenient::opt_bool")]
    pub active: Option<bool>,
    #[serde(default, deserialize_with = "lenient::opt_bool")]
    pub enabled: Option<bool>,
    /// Bytes.
    #[serde(default, deserialize_with = "lenient::opt_u64")]
    pub total: Option<u64>,
    #[serde(default, deserialize_with = "lenient::opt_u64")]
    pub used: Option<u64>,
    #[serde(default, deserialize_with = "lenient::opt_u64")]
    pub avail: Option<u64>,
}

impl StorageStatus {
    /// Whether a template's disk on this storage type can back a linked
    /// clone (PVE's `clone` volume feature; thick LVM and raw block
    /// storages cannot snapshot a base volume).
    pub fn supports_linked_clones(&self) -> bool {
        !matches!(
            self.kind.as_str(),
            "lvm" | "iscsi" | "iscsidirect" | "pbs" | "cephfs"
        )
    }
}

/// Parameters of `POST /nodes/{node}/qemu/{vmid}/migrate`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigrateParams {
    pub target: String,
    /// Live migration; offline (the VM stopped) when false.
    pub online: bool,
    /// Copy local disks along (needed online; offline PVE copies them anyway).
    pub with_local_disks: bool,
    /// Storage the local disks land on at the target (default: the same id).
    pub targetstorage: Option<String>,
}

/// One pool member.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct PoolMember {
    /// e.g. `qemu/101`.
    #[serde(default)]
    pub id: String,
    /// `qemu`, `lxc`, `openvz` or `storage`.
    #[serde(default, rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub node: String,
    #[serde(default, deserialize_with = "lenient::opt_u32")]
    pub vmid: Option<u32>,
    #[serde(default, deserialize_with = "lenient::opt_string")]
    pub storage: Option<String>,
}

/// `GET .../agent/exec-status?pid=N`. Output is present only once `exited`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct ExecStatus {
    #[serde(deserialize_with = "lenient::bool")]
    pub exited: bool,
    #[serde(default, deserialize_with = "lenient::opt_i64")]
    pub exitcode: Option<i64>,
    #[serde(default, deserialize_with = "lenient::opt_i64")]
    pub signal: Option<i64>,
    #[serde(default, rename = "out-data")]
    pub out_data: Option<String>,
    #[serde(default, rename = "err-data")]
    pub err_data: Option<String>,
    #[serde(default, rename = "out-truncated", deserialize_with = "lenient::bool")]
    pub out_truncated: bool,
    #[serde(default, rename = "err-truncated", deserialize_with = "lenient::bool")]
    pub err_truncated: bool,
}

/// How [`crate::PveClient::agent_file_write`] sends content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileEncoding {
    /// `encode=1`: content is sent as text and PVE base64-encodes it for the
    /// agent. Any bytes arrive unchanged (each is sent as the character of the
    /// same code point, which is what PVE's encoding turns back into that byte).
    PveEncodes,
    /// `encode=0`: the client base64-encodes the bytes itself (safe for binary).
    Base64,
}

#[cfg(test)]
mod tests {
    #[test]
    fn copy_percent_reads_qemu_imgs_and_a_block_jobs_progress() {
        let line = |t: &str| TaskLogLine { n: 1, t: t.into() };
        assert_eq!(
            line("transferred 204.8 MiB of 2.0 GiB (10.00%)").copy_percent(),
            Some(10.0)
        );
        assert_eq!(
            line("drive-scsi0: transferred 1.0 GiB of 32.0 GiB (3.12%) in 2s").copy_percent(),
            Some(3.12)
        );
        assert_eq!(
            line("drive-scsi0: transferred 32.0 GiB of 32.0 GiB (100.00%) in 41s, ready")
                .copy_percent(),
            Some(100.0)
        );
        for other in [
            "create full clone of drive scsi0 (local-lvm:base-9000-disk-0)",
            "transferred 1.0 GiB of 2.0 GiB (lots%)",
            "transferred 3.0 GiB of 2.0 GiB (150.00%)",
            "migration status: active (transferred 1.0 GiB of 2.0 GiB (50.00%))",
            "TASK OK",
        ] {
            assert_eq!(line(other).copy_percent(), None, "{other}");
        }
    }

    #[test]
    fn a_task_row_is_running_when_pve_says_running_or_says_nothing() {
        let row = |status: serde_json::Value| -> super::TaskSummary {
            serde_json::from_value(serde_json::json!({
                "upid": "UPID:pve1:0000A1B2:0001C3D4:6750A000:qmclone:9000:root@pam:",
                "type": "qmclone", "id": "9000", "status": status,
            }))
            .expect("row")
        };
        assert!(row(serde_json::json!("RUNNING")).is_running());
        assert!(row(serde_json::Value::Null).is_running());
        assert!(!row(serde_json::json!("OK")).is_running());
        assert!(!row(serde_json::json!("unable to create VM 130")).is_running());
        assert!(!row(serde_json::json!("WARNINGS: 1")).is_running());
    }

    /// What a task watch takes from a `source=all` row: an exit status only
    /// from a row that has one; an archived row without one (or an empty
    /// one) is no verdict, and the task's own status is read instead.
    #[test]
    fn a_task_row_gives_an_exit_status_only_when_it_has_one() {
        let row = |extra: serde_json::Value| -> super::TaskSummary {
            let mut v = serde_json::json!({
                "upid": "UPID:pve1:0000A1B2:0001C3D4:6750A000:qmstart:130:root@pam:",
                "type": "qmstart", "id": "130",
            });
            for (k, x) in extra.as_object().expect("fields") {
                v[k] = x.clone();
            }
            serde_json::from_value(v).expect("row")
        };
        let ended = row(serde_json::json!({"status": "OK", "endtime": 1_733_400_000}));
        assert_eq!(ended.exit_status(), Some("OK"));
        assert_eq!(ended.endtime, Some(1_733_400_000));
        let failed =
            row(serde_json::json!({"status": "VM 130 already running", "endtime": "1733400000"}));
        assert_eq!(failed.exit_status(), Some("VM 130 already running"));
        assert_eq!(
            failed.endtime,
            Some(1_733_400_000),
            "a string number is read too"
        );
        assert_eq!(
            row(serde_json::json!({"status": "RUNNING"})).exit_status(),
            None
        );
        let silent = row(serde_json::json!({"endtime": 1_733_400_000}));
        assert_eq!(silent.exit_status(), None);
        assert!(silent.endtime.is_some());
        assert_eq!(
            row(serde_json::json!({"status": "", "endtime": 1})).exit_status(),
            None
        );
    }

    #[test]
    fn a_destroy_log_names_the_disks_it_could_not_free_on_pve_8_and_9() {
        let line = |t: &str| super::TaskLogLine { n: 1, t: t.into() };
        // PVE 9 (`log_warn`) and PVE 8 (Perl's `warn`).
        for t in [
            "WARN: Could not remove disk 'ceph-pool:vm-130-disk-0', check manually: \
             rbd rm 'vm-130-disk-0' error: rbd: error: image still has watchers",
            "Could not remove disk 'ceph-pool:vm-130-disk-0', check manually: \
             rbd rm 'vm-130-disk-0' error: rbd: error: image still has watchers",
        ] {
            assert_eq!(
                line(t).unremoved_disk(),
                Some("ceph-pool:vm-130-disk-0"),
                "{t}"
            );
        }
        for t in [
            "Removing image: 100% complete...done.",
            "WARN: rbd rm 'vm-130-disk-0' error: rbd: error: image still has watchers",
            "Could not remove disk '', check manually: x",
            "Could not remove disk 'local-lvm:vm-1-disk-0",
        ] {
            assert_eq!(line(t).unremoved_disk(), None, "{t}");
        }
    }

    #[test]
    fn a_task_logs_last_line_says_how_it_ended() {
        let line = |t: &str| super::TaskLogLine { n: 9, t: t.into() };
        assert_eq!(line("TASK OK").exit_status(), Some("OK"));
        assert_eq!(line("TASK WARNINGS: 2").exit_status(), Some("WARNINGS: 2"));
        assert_eq!(
            line("TASK ERROR: VM 130 is running - destroy failed").exit_status(),
            Some("VM 130 is running - destroy failed")
        );
        for t in [
            "purging VM 130 from related configurations..",
            "TASK",
            "TASK OK but more",
            "TASK WARNINGS: ",
            "TASK WARNINGS: two",
            "TASK ERROR: ",
            " TASK OK",
            "no content",
        ] {
            assert_eq!(line(t).exit_status(), None, "{t}");
        }
    }

    use super::*;
    use serde_json::json;

    #[test]
    fn lenient_scalars() {
        for (v, want) in [
            (json!(1), Some(true)),
            (json!(0), Some(false)),
            (json!("1"), Some(true)),
            (json!("0"), Some(false)),
            (json!(true), Some(true)),
            (json!("false"), Some(false)),
            (json!(2), None),
            (json!("maybe"), None),
        ] {
            assert_eq!(lenient::as_bool(&v), want, "{v}");
        }
        assert_eq!(lenient::as_u64(&json!("123")), Some(123));
        assert_eq!(lenient::as_u64(&json!(123)), Some(123));
        assert_eq!(lenient::as_u64(&json!(4.0)), Some(4));
        assert_eq!(lenient::as_u64(&json!(4.5)), None);
        assert_eq!(lenient::as_u64(&json!("x")), None);
        assert_eq!(lenient::as_f64(&json!("0.25")), Some(0.25));
    }

    #[test]
    fn description_loses_pves_storage_newline() {
        let c: VmConfig =
            serde_json::from_value(json!({"description": "marker=1\nline 2\n"})).unwrap();
        assert_eq!(c.description.as_deref(), Some("marker=1\nline 2"));
        // Servers that return it verbatim are read the same way.
        let c: VmConfig = serde_json::from_value(json!({"description": "marker=1"})).unwrap();
        assert_eq!(c.description.as_deref(), Some("marker=1"));
    }

    #[test]
    fn cluster_vm_lenient() {
        let v: ClusterVm = serde_json::from_value(json!({
            "id": "qemu/101", "type": "qemu", "vmid": "101", "node": "pve1", "name": 5,
            "status": "running", "template": "1", "tags": "BigFleet;b,a", "maxmem": "4294967296",
            "maxcpu": 2, "hastate": "started"
        }))
        .unwrap();
        assert_eq!(v.vmid, 101);
        assert!(v.template);
        assert_eq!(v.tags, vec!["a", "b", "bigfleet"]);
        assert_eq!(v.name.as_deref(), Some("5"));
        assert_eq!(v.maxmem, Some(4294967296));
        assert_eq!(v.maxcpu, Some(2.0));
        assert_eq!(v.pool, None);

        let err = serde_json::from_value::<ClusterVm>(json!({"vmid": "abc"})).unwrap_err();
        assert!(
            err.to_string().contains("expected an unsigned integer"),
            "{err}"
        );
        let err = serde_json::from_value::<ClusterVm>(json!({"vmid": 1, "template": "perhaps"}))
            .unwrap_err();
        assert!(err.to_string().contains("expected a boolean"), "{err}");
    }

    #[test]
    fn vm_config_and_status() {
        let c: VmConfig = serde_json::from_value(json!({
            "cores": "4", "memory": "8192", "agent": "enabled=1,fstrim_cloned_disks=1",
            "digest": "abc", "tags": "b;a", "scsi0": "local-lvm:vm-1-disk-0"
        }))
        .unwrap();
        assert_eq!(c.cores, Some(4));
        assert_eq!(c.memory, Some(8192));
        assert!(c.agent_enabled());
        assert_eq!(c.tags, vec!["a", "b"]);
        assert!(c.other.contains_key("scsi0"));
        let c: VmConfig =
            serde_json::from_value(json!({"memory": "current=2048", "agent": "0"})).unwrap();
        assert_eq!(c.memory, Some(2048));
        assert!(!c.agent_enabled());

        let s: VmStatus = serde_json::from_value(json!({
            "status": "running", "agent": 1, "ha": {"managed": 1}, "template": "", "lock": "clone"
        }))
        .unwrap();
        assert!(s.is_running() && s.agent && s.ha_managed() && !s.template);
        assert_eq!(s.lock.as_deref(), Some("clone"));
    }

    #[test]
    fn disk_storages_of_a_realistic_config() {
        let c: VmConfig = serde_json::from_value(json!({
            "name": "tmpl-9000", "template": 1, "cores": 2, "memory": "2048",
            "scsihw": "virtio-scsi-single", "boot": "order=scsi0;ide2",
            "scsi0": "local-lvm:base-9000-disk-0,iothread=1,size=32G",
            "scsi1": "ceph-pool:base-9000-disk-2,size=100G",
            "virtio3": "file=nfs-images:9000/base-9000-disk-3.qcow2,size=8G",
            "sata0": "local-lvm:base-9000-disk-4,size=4G",
            "efidisk0": "local-zfs:base-9000-disk-1,efitype=4m,pre-enrolled-keys=1,size=1M",
            "tpmstate0": "local-zfs:base-9000-disk-5,size=4M,version=v2.0",
            "ide2": "local:iso/debian-12.iso,media=cdrom,size=628M",
            "ide0": "none,media=cdrom",
            "ide1": "cdrom,media=cdrom",
            "sata1": "/dev/disk/by-id/ata-WDC_WD40,size=3907018584K",
            "unused0": "other-store:vm-9000-disk-9",
            "scsihw0": "not-a-disk:x",
            "net0": "virtio=BC:24:11:00:23:28,bridge=vmbr0",
            "digest": "0123456789abcdef0123456789abcdef01234567"
        }))
        .unwrap();
        assert_eq!(
            c.disk_storages(),
            vec!["ceph-pool", "local-lvm", "local-zfs", "nfs-images"]
        );
        assert!(c.template == Some(true));
        // CD-ROMs are not disks, but each is seen with its volume.
        assert_eq!(c.cdroms().len(), 3);
        let by_key = |k: &str| c.cdroms().into_iter().find(|cd| cd.key == k).unwrap();
        assert_eq!(by_key("ide2").storage(), Some("local"));
        assert_eq!(
            by_key("ide0").storage(),
            None,
            "an empty drive is on no storage"
        );
        assert!(by_key("ide1").is_physical() && by_key("ide1").storage().is_none());
        assert!(!by_key("ide2").is_cloudinit());
    }

    #[test]
    fn bridges_of_every_nic() {
        let c: VmConfig = serde_json::from_value(json!({
            "net0": "virtio=BC:24:11:00:23:28,bridge=vmbr0,firewall=1",
            "net1": "e1000=BC:24:11:00:23:29, bridge=vnet7 ,tag=20",
            "net2": "virtio=BC:24:11:00:23:30,bridge=vmbr0",
            "net3": "virtio=BC:24:11:00:23:31",
            "netx": "bridge=not-a-nic",
            "scsi0": "local-lvm:vm-1-disk-0,size=8G"
        }))
        .unwrap();
        assert_eq!(c.bridges(), vec!["vmbr0", "vnet7"]);
    }

    #[test]
    fn the_boot_disk_follows_the_boot_order_then_bootdisk_then_the_first_bus() {
        let cfg = |v: serde_json::Value| -> VmConfig { serde_json::from_value(v).unwrap() };
        let disks = json!({
            "scsi0": "local-lvm:vm-1-disk-0,size=8G",
            "virtio1": "ceph:vm-1-disk-1,size=32G",
            "ide2": "local:iso/x.iso,media=cdrom",
        });
        let with = |extra: serde_json::Value| {
            let mut v = disks.clone();
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            cfg(v)
        };
        let key = |c: &VmConfig| c.boot_disk().map(|(k, _, bytes)| (k, bytes >> 30));
        // The CD-ROM first in the order is not a disk on a storage.
        assert_eq!(
            key(&with(json!({"boot": "order=ide2;virtio1;scsi0;net0"}))),
            Some(("virtio1".into(), 32))
        );
        assert_eq!(
            key(&with(json!({"bootdisk": "virtio1"}))),
            Some(("virtio1".into(), 32))
        );
        assert_eq!(key(&with(json!({}))), Some(("scsi0".into(), 8)));
        assert_eq!(key(&cfg(json!({"ide2": "none,media=cdrom"}))), None);
    }

    #[test]
    fn disk_storages_single_disk_and_none() {
        let c: VmConfig = serde_json::from_value(json!({
            "scsi0": "local-lvm:vm-9000-disk-0,size=32G", "ide2": "none,media=cdrom"
        }))
        .unwrap();
        assert_eq!(c.disk_storages(), vec!["local-lvm"]);

        // No disks at all (only a CD-ROM and a NIC).
        let c: VmConfig = serde_json::from_value(json!({
            "name": "diskless", "memory": 512, "ide2": "local:iso/netboot.iso,media=cdrom",
            "net0": "virtio=BC:24:11:00:00:01,bridge=vmbr0"
        }))
        .unwrap();
        assert!(c.disk_storages().is_empty());
        let c: VmConfig = serde_json::from_value(json!({})).unwrap();
        assert!(c.disk_storages().is_empty());
    }

    #[test]
    fn disk_key_and_value_parsing() {
        for k in [
            "scsi0",
            "scsi30",
            "virtio15",
            "sata5",
            "ide3",
            "efidisk0",
            "tpmstate0",
        ] {
            assert!(is_disk_key(k), "{k}");
        }
        for k in [
            "scsi", "scsihw", "virtio", "unused0", "net0", "efidisk1", "ide2x",
        ] {
            assert!(!is_disk_key(k), "{k}");
        }
        assert_eq!(disk_storage("local-lvm:vm-1-disk-0"), Some("local-lvm"));
        assert_eq!(
            disk_storage("media=disk,file=ceph:vm-1-disk-0"),
            Some("ceph")
        );
        assert_eq!(disk_storage("ceph:vm-1-disk-0,media=cdrom"), None);
        assert_eq!(disk_storage("none"), None);
        assert_eq!(disk_storage("/dev/sdb"), None);
        assert_eq!(disk_storage(""), None);
    }

    #[test]
    fn exec_status_and_task() {
        let e: ExecStatus = serde_json::from_value(json!({
            "exited": 1, "exitcode": 3, "out-data": "hi", "err-truncated": "1"
        }))
        .unwrap();
        assert!(e.exited && e.err_truncated && !e.out_truncated);
        assert_eq!(e.exitcode, Some(3));
        assert!(exit_ok("OK") && exit_ok("WARNINGS: 2") && !exit_ok("clone failed: x"));
        let t: TaskStatus =
            serde_json::from_value(json!({"status": "stopped", "exitstatus": "WARNINGS: 1"}))
                .unwrap();
        assert!(t.succeeded());
    }
}

/// The token's privileges per ACL path, as `GET /access/permissions`
/// answers (`{"/pool/p": {"VM.Audit": 1, ...}}`; the value is the propagate
/// flag, and a listed privilege is held either way).
pub type Permissions = BTreeMap<String, std::collections::BTreeSet<String>>;

/// Who may set tags that no guest carries yet: the datacenter option
/// `user-tag-access` (`user-allow`). Holders of `Sys.Modify` on `/` may
/// always set any tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TagAccess {
    /// `free` (PVE's default): any tag.
    Free,
    /// `existing`: tags some guest already carries, or listed.
    Existing(Vec<String>),
    /// `list`: only the listed tags.
    List(Vec<String>),
    /// `none`: no tag changes at all.
    None,
}

impl TagAccess {
    /// Whether per-guest tags that no guest carries yet are refused (to a
    /// token without `Sys.Modify` on `/`).
    pub fn refuses_new_tags(&self) -> bool {
        !matches!(self, TagAccess::Free)
    }
}

/// `GET /cluster/options`: the datacenter options the provider reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterOptions {
    /// `None` when the answer leaves `user-tag-access` out: PVE's default
    /// (`free`) when the token holds `Sys.Audit` on `/`, but unknown
    /// without it, since PVE then returns only `console`, `tag-style` and
    /// `allowed-tags` (pve-manager `API2/Cluster.pm`).
    pub tag_access: Option<TagAccess>,
}

impl ClusterOptions {
    /// Parses the answer. `user-tag-access` comes parsed (`{"user-allow":
    /// "existing", "user-allow-list": ["a"]}`); a raw property string
    /// (`user-allow=list,user-allow-list=a;b`) is accepted too. An unknown
    /// `user-allow` means PVE's default, `free`; an absent option is `None`.
    pub fn from_value(v: &Value) -> ClusterOptions {
        if v.get("user-tag-access").is_none() {
            return ClusterOptions { tag_access: None };
        }
        let mut allow = String::from("free");
        let mut list: Vec<String> = Vec::new();
        let split = |s: &str| -> Vec<String> {
            s.split(';')
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .map(str::to_string)
                .collect()
        };
        match v.get("user-tag-access") {
            Some(Value::Object(o)) => {
                if let Some(a) = o.get("user-allow").and_then(Value::as_str) {
                    allow = a.trim().to_string();
                }
                match o.get("user-allow-list") {
                    Some(Value::Array(items)) => {
                        list = items
                            .iter()
                            .filter_map(Value::as_str)
                            .map(str::to_string)
                            .collect()
                    }
                    Some(Value::String(s)) => list = split(s),
                    _ => {}
                }
            }
            Some(Value::String(s)) => {
                for part in s.split(',') {
                    match part.split_once('=') {
                        Some(("user-allow", a)) => allow = a.trim().to_string(),
                        Some(("user-allow-list", l)) => list = split(l),
                        None if !part.trim().is_empty() => allow = part.trim().to_string(),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
        let tag_access = match allow.as_str() {
            "existing" => TagAccess::Existing(list),
            "list" => TagAccess::List(list),
            "none" => TagAccess::None,
            _ => TagAccess::Free,
        };
        ClusterOptions {
            tag_access: Some(tag_access),
        }
    }
}

#[cfg(test)]
mod options_tests {
    use super::*;

    #[test]
    fn user_tag_access_parsed_or_raw() {
        let absent = ClusterOptions::from_value(&serde_json::json!({"keyboard": "en-us"}));
        assert_eq!(absent.tag_access, None, "not known from the answer alone");
        let free = ClusterOptions::from_value(&serde_json::json!({
            "user-tag-access": {"user-allow": "free"}
        }));
        assert_eq!(free.tag_access, Some(TagAccess::Free));
        assert!(!TagAccess::Free.refuses_new_tags());
        let parsed = ClusterOptions::from_value(&serde_json::json!({
            "user-tag-access": {"user-allow": "list", "user-allow-list": ["a", "b"]}
        }));
        assert_eq!(
            parsed.tag_access,
            Some(TagAccess::List(vec!["a".into(), "b".into()]))
        );
        let raw = ClusterOptions::from_value(&serde_json::json!({
            "user-tag-access": "user-allow=existing,user-allow-list=x;y"
        }));
        assert_eq!(
            raw.tag_access,
            Some(TagAccess::Existing(vec!["x".into(), "y".into()]))
        );
        assert!(raw.tag_access.is_some_and(|t| t.refuses_new_tags()));
        let none = ClusterOptions::from_value(&serde_json::json!({
            "user-tag-access": {"user-allow": "none"}
        }));
        assert_eq!(none.tag_access, Some(TagAccess::None));
    }
}
