//! What `ctl` prints: state and code names, the table and JSON views, and
//! one-line error chains.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use bigfleet_proto::admin::{NodeRoom, StorageRoom, TimelineStep};
use bigfleet_proto::v1alpha1::{CapacityType, Machine, MachineState};
use serde::Serialize;
use tonic::Code;

use crate::error::CtlError;

/// `IDLE` for a known state, `UNKNOWN(n)` for a value this build does not know.
pub fn state_name(value: i32) -> String {
    match MachineState::try_from(value) {
        Ok(s) => s
            .as_str_name()
            .trim_start_matches("MACHINE_STATE_")
            .to_string(),
        Err(_) => format!("UNKNOWN({value})"),
    }
}

pub(crate) fn capacity_name(value: i32) -> String {
    match CapacityType::try_from(value) {
        Ok(c) => c
            .as_str_name()
            .trim_start_matches("CAPACITY_TYPE_")
            .to_string(),
        Err(_) => format!("UNKNOWN({value})"),
    }
}

/// The JSON shape of a machine: plain names, sorted maps.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct MachineView {
    pub id: String,
    pub state: String,
    pub host: Option<HostView>,
    pub instance_type: String,
    pub zone: String,
    pub capacity_type: String,
    pub price_per_hour: f64,
    pub interruption_probability: f64,
    pub resources: BTreeMap<String, String>,
    pub allocatable: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub cluster: String,
    pub shard_metadata: BTreeMap<String, String>,
    pub last_error: String,
}

#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct HostView {
    pub provider: String,
    #[serde(rename = "ref")]
    pub reference: String,
}

impl From<&Machine> for MachineView {
    fn from(m: &Machine) -> MachineView {
        let sorted = |map: &std::collections::HashMap<String, String>| {
            map.iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<BTreeMap<_, _>>()
        };
        MachineView {
            id: m.id.clone(),
            state: state_name(m.state),
            host: m.host.as_ref().map(|h| HostView {
                provider: h.provider.clone(),
                reference: h.r#ref.clone(),
            }),
            instance_type: m.instance_type.clone(),
            zone: m.zone.clone(),
            capacity_type: capacity_name(m.capacity_type),
            price_per_hour: m.price_per_hour,
            interruption_probability: m.interruption_probability,
            resources: m
                .resources
                .as_ref()
                .map(|r| sorted(&r.resources))
                .unwrap_or_default(),
            allocatable: m
                .allocatable
                .as_ref()
                .map(|r| sorted(&r.resources))
                .unwrap_or_default(),
            labels: sorted(&m.labels),
            cluster: m.cluster.clone(),
            shard_metadata: sorted(&m.shard_metadata),
            last_error: m.last_error.clone(),
        }
    }
}

#[derive(Serialize)]
pub(crate) struct AckView {
    pub(crate) operation_id: String,
    /// `null` when a waited-for Delete removed the machine entirely.
    pub(crate) machine: Option<MachineView>,
}

#[derive(Serialize)]
pub(crate) struct WatchLine {
    pub(crate) elapsed_ms: u128,
    pub(crate) machine: Option<MachineView>,
}

/// Escape control bytes so a hostile value cannot rewrite the terminal.
pub(crate) fn cell(text: &str) -> String {
    if text.is_empty() {
        return "-".into();
    }
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Left-aligned columns; the last column is not padded.
pub fn render_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let last = cells.len().saturating_sub(1);
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i == last {
                s.push_str(c);
            } else {
                s.push_str(c);
                let pad = widths[i] - c.chars().count() + 2;
                s.extend(std::iter::repeat_n(' ', pad));
            }
        }
        s.trim_end().to_string()
    };
    let mut out = line(header.to_vec());
    out.push('\n');
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
        out.push('\n');
    }
    out
}

pub(crate) fn list_table(machines: &[Machine]) -> String {
    let rows: Vec<Vec<String>> = machines
        .iter()
        .map(|m| {
            vec![
                cell(&m.id),
                state_name(m.state),
                cell(m.host.as_ref().map(|h| h.r#ref.as_str()).unwrap_or("")),
                cell(&m.cluster),
                cell(&m.instance_type),
                cell(&m.zone),
                cell(&m.last_error),
            ]
        })
        .collect();
    render_table(
        &[
            "ID",
            "STATE",
            "HOST",
            "CLUSTER",
            "TYPE",
            "ZONE",
            "LAST_ERROR",
        ],
        &rows,
    )
}

pub(crate) fn map_cell(map: &BTreeMap<String, String>) -> String {
    if map.is_empty() {
        return "-".into();
    }
    map.iter()
        .map(|(k, v)| format!("{}={}", cell(k), cell(v)))
        .collect::<Vec<_>>()
        .join(",")
}

pub(crate) fn machine_details(m: &Machine) -> String {
    let v = MachineView::from(m);
    let host = v
        .host
        .as_ref()
        .map(|h| format!("{}/{}", cell(&h.provider), cell(&h.reference)))
        .unwrap_or_else(|| "-".into());
    let rows = [
        ("id", cell(&v.id)),
        ("state", v.state.clone()),
        ("host", host),
        ("instance_type", cell(&v.instance_type)),
        ("zone", cell(&v.zone)),
        ("capacity_type", v.capacity_type.clone()),
        ("price_per_hour", format!("{}", v.price_per_hour)),
        (
            "interruption_probability",
            format!("{}", v.interruption_probability),
        ),
        ("resources", map_cell(&v.resources)),
        ("allocatable", map_cell(&v.allocatable)),
        ("labels", map_cell(&v.labels)),
        ("cluster", cell(&v.cluster)),
        ("shard_metadata", map_cell(&v.shard_metadata)),
        ("last_error", cell(&v.last_error)),
    ];
    let mut out = String::new();
    for (k, val) in rows {
        out.push_str(&format!("{:<27}{val}\n", format!("{k}:")));
    }
    out
}

/// `ctl get --output json`: the machine, and its timeline when the
/// provider reports one.
#[derive(Serialize)]
pub(crate) struct MachineWithTimeline {
    #[serde(flatten)]
    pub(crate) machine: MachineView,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) timeline: Option<Vec<StepView>>,
}

/// One step of a machine's timeline (the Admin service's Timeline).
#[derive(Serialize, Debug, Clone, PartialEq)]
pub(crate) struct StepView {
    pub(crate) step: String,
    pub(crate) node: String,
    /// RFC 3339, UTC, milliseconds.
    pub(crate) started: String,
    pub(crate) duration_ms: u64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) upid: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) error: String,
    /// Under way: `duration_ms` is how long so far.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(crate) running: bool,
    /// A clone under way: how far its copy is, in percent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) copied_percent: Option<f64>,
}

impl From<&TimelineStep> for StepView {
    fn from(s: &TimelineStep) -> StepView {
        StepView {
            step: s.step.clone(),
            node: s.node.clone(),
            started: started_at(s.started_unix_ms),
            duration_ms: s.duration_ms,
            upid: s.upid.clone(),
            error: s.error.clone(),
            running: s.running,
            copied_percent: s.copied_percent,
        }
    }
}

/// Unix milliseconds as RFC 3339 in UTC with milliseconds.
fn started_at(unix_ms: i64) -> String {
    let ms = u64::try_from(unix_ms).unwrap_or(0);
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// The timeline below `ctl get`'s details: one row per step, oldest first.
pub(crate) fn timeline_table(steps: &[TimelineStep]) -> String {
    let mut out = String::from("timeline:\n");
    if steps.is_empty() {
        out.push_str("  (no steps recorded by this provider process)\n");
        return out;
    }
    out.push_str(&format!(
        "  {:<24}  {:<15}  {:<10}  {:>9}  {}\n",
        "STARTED", "STEP", "NODE", "TOOK", "TASK / ERROR"
    ));
    for s in steps {
        let v = StepView::from(s);
        let took = format!("{:.2}s", v.duration_ms as f64 / 1000.0);
        let tail = match (v.upid.is_empty(), v.error.is_empty()) {
            (_, false) => format!("error: {}", cell(&v.error)),
            (false, true) => cell(&v.upid),
            (true, true) => "-".to_string(),
        };
        // A step under way: its time so far, and said so.
        let tail = match (v.running, v.copied_percent) {
            (true, Some(percent)) => format!("running (so far), {percent:.0} % copied; {tail}"),
            (true, None) => format!("running (so far); {tail}"),
            (false, _) => tail,
        };
        out.push_str(&format!(
            "  {:<24}  {:<15}  {:<10}  {:>9}  {tail}\n",
            v.started,
            cell(&v.step),
            cell(&v.node),
            took
        ));
    }
    out
}

pub(crate) fn json<T: Serialize>(value: &T) -> Result<String, CtlError> {
    serde_json::to_string_pretty(value)
        .map(|s| s + "\n")
        .map_err(json_error)
}

pub(crate) fn json_error(e: serde_json::Error) -> CtlError {
    CtlError::output(format!("cannot encode JSON output: {e}")).caused_by(e)
}

pub(crate) fn emit(text: &str) -> Result<(), CtlError> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| CtlError::output(format!("cannot write to stdout: {e}")).caused_by(e))
}

pub(crate) fn elapsed(d: Duration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}

/// gRPC's canonical upper-case code names, as operators see them in docs.
pub fn canonical_code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// `outer: inner: innermost`, skipping links that repeat what came before.
pub(crate) fn join_chain(
    first: String,
    mut next: Option<&(dyn std::error::Error + 'static)>,
) -> String {
    let mut parts: Vec<String> = vec![first];
    while let Some(e) = next {
        let text = e.to_string();
        if !text.is_empty() && parts.last().is_none_or(|p| !p.contains(&text)) {
            parts.push(text);
        }
        next = e.source();
    }
    parts.retain(|p| !p.is_empty());
    parts.join(": ")
}

pub(crate) fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    join_chain(err.to_string(), err.source())
}

/// The states a summary has a column for, in lifecycle order.
const SUMMARY_STATES: [MachineState; 8] = [
    MachineState::Speculative,
    MachineState::Creating,
    MachineState::Idle,
    MachineState::Configuring,
    MachineState::Configured,
    MachineState::Draining,
    MachineState::Deleting,
    MachineState::Failed,
];

/// One zone and instance type of `ctl summary`.
#[derive(Debug, Serialize, PartialEq)]
pub(crate) struct SummaryRow {
    pub(crate) zone: String,
    pub(crate) instance_type: String,
    /// State name -> machines in it (every state, zeros included).
    pub(crate) counts: BTreeMap<String, usize>,
    pub(crate) total: usize,
    /// The zone's memory room, when the provider reports it (NodeMemory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) room: Option<RowRoom>,
}

/// The node memory guard's room of a summary row's zone, and how many
/// more machines of the row's type fit there.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub(crate) struct RowRoom {
    pub(crate) memory_bytes: u64,
    pub(crate) committed_bytes: u64,
    pub(crate) limit_bytes: u64,
    /// `None` when the type is not offered in the zone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) fits: Option<u64>,
}

/// Adds each zone's room (from the provider's NodeMemory) to its rows.
pub(crate) fn attach_rooms(rows: &mut [SummaryRow], rooms: &[NodeRoom]) {
    for row in rows.iter_mut() {
        if let Some(room) = rooms.iter().find(|r| r.node == row.zone) {
            row.room = Some(RowRoom {
                memory_bytes: room.memory_bytes,
                committed_bytes: room.committed_bytes,
                limit_bytes: room.limit_bytes,
                fits: room
                    .fits
                    .iter()
                    .find(|f| f.instance_type == row.instance_type)
                    .map(|f| f.count),
            });
        }
    }
}

/// Bytes as GiB with one decimal.
fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
}

/// The per-zone room table under the summary: memory, committed, limit,
/// what is left, and how many more machines of each offered type fit.
pub(crate) fn room_table(rooms: &[NodeRoom]) -> String {
    let header = ["ZONE", "MEMORY", "COMMITTED", "LIMIT", "LEFT", "FITS"];
    let mut sorted: Vec<&NodeRoom> = rooms.iter().collect();
    sorted.sort_by(|a, b| a.node.cmp(&b.node));
    let body: Vec<Vec<String>> = sorted
        .into_iter()
        .map(|r| {
            let fits: Vec<String> = r
                .fits
                .iter()
                .map(|f| format!("{}={}", cell(&f.instance_type), f.count))
                .collect();
            vec![
                cell(&r.node),
                gib(r.memory_bytes),
                gib(r.committed_bytes),
                gib(r.limit_bytes),
                gib(r.limit_bytes.saturating_sub(r.committed_bytes)),
                fits.join(","),
            ]
        })
        .collect();
    render_table(&header, &body)
}

/// The storage guard's table under the room table: each storage full
/// clones land on, its free space, the overcommit factor, what clones in
/// flight hold and what is left for new ones.
pub(crate) fn storage_table(storages: &[StorageRoom]) -> String {
    let header = ["STORAGE", "NODE", "FREE", "OVERCOMMIT", "IN FLIGHT", "LEFT"];
    let mut sorted: Vec<&StorageRoom> = storages.iter().collect();
    sorted.sort_by(|a, b| (&a.storage, &a.node).cmp(&(&b.storage, &b.node)));
    let body: Vec<Vec<String>> = sorted
        .into_iter()
        .map(|s| {
            vec![
                cell(&s.storage),
                if s.node.is_empty() {
                    "(shared)".to_string()
                } else {
                    cell(&s.node)
                },
                gib(s.avail_bytes),
                format!("{}", s.overcommit),
                gib(s.in_flight_bytes),
                gib(s.allowed_bytes.saturating_sub(s.in_flight_bytes)),
            ]
        })
        .collect();
    render_table(&header, &body)
}

pub(crate) fn summarize(machines: &[Machine]) -> Vec<SummaryRow> {
    let mut by: BTreeMap<(String, String), BTreeMap<String, usize>> = BTreeMap::new();
    for m in machines {
        let counts = by
            .entry((m.zone.clone(), m.instance_type.clone()))
            .or_insert_with(|| {
                SUMMARY_STATES
                    .iter()
                    .map(|s| (state_name(*s as i32), 0))
                    .collect()
            });
        *counts.entry(state_name(m.state)).or_insert(0) += 1;
    }
    by.into_iter()
        .map(|((zone, instance_type), counts)| SummaryRow {
            total: counts.values().sum(),
            zone,
            instance_type,
            counts,
            room: None,
        })
        .collect()
}

pub(crate) fn summary_table(rows: &[SummaryRow]) -> String {
    let mut header = vec!["ZONE", "TYPE"];
    let names: Vec<String> = SUMMARY_STATES
        .iter()
        .map(|s| state_name(*s as i32))
        .collect();
    header.extend(names.iter().map(String::as_str));
    header.push("TOTAL");
    let mut body: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let mut row = vec![cell(&r.zone), cell(&r.instance_type)];
            row.extend(
                names
                    .iter()
                    .map(|n| r.counts.get(n).copied().unwrap_or(0).to_string()),
            );
            row.push(r.total.to_string());
            row
        })
        .collect();
    let mut totals = vec!["(all)".to_string(), String::new()];
    totals.extend(names.iter().map(|n| {
        rows.iter()
            .map(|r| r.counts.get(n).copied().unwrap_or(0))
            .sum::<usize>()
            .to_string()
    }));
    totals.push(rows.iter().map(|r| r.total).sum::<usize>().to_string());
    body.push(totals);
    render_table(&header, &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(name: &str, upid: &str, error: &str, running: bool) -> TimelineStep {
        TimelineStep {
            step: name.into(),
            node: "pve1".into(),
            started_unix_ms: 1_700_000_000_000,
            duration_ms: 4200,
            upid: upid.into(),
            error: error.into(),
            running,
            copied_percent: None,
        }
    }

    #[test]
    fn a_step_under_way_says_so_in_the_table_and_in_json() {
        let mut copying = step("clone", "UPID:pve1:8", "", true);
        copying.copied_percent = Some(37.4);
        let steps = [
            step("clone_slot", "", "", false),
            step("clone", "UPID:pve1:7", "", true),
            copying,
        ];
        let table = timeline_table(&steps);
        let rows: Vec<&str> = table.lines().skip(2).collect();
        assert!(rows[0].ends_with("  -"), "{table}");
        assert!(!rows[0].contains("running"), "{table}");
        assert!(
            rows[1].contains("4.20s") && rows[1].ends_with("running (so far); UPID:pve1:7"),
            "{table}"
        );
        let json: Vec<serde_json::Value> = steps
            .iter()
            .map(|s| serde_json::to_value(StepView::from(s)).expect("JSON"))
            .collect();
        assert_eq!(
            json[0].get("running"),
            None,
            "only a step under way says it"
        );
        assert_eq!(json[1]["running"], true);
        assert_eq!(json[1]["duration_ms"], 4200);
        assert_eq!(json[1].get("copied_percent"), None);
        assert!(
            rows[2].ends_with("running (so far), 37 % copied; UPID:pve1:8"),
            "{table}"
        );
        assert_eq!(json[2]["copied_percent"], 37.4);
    }
}
