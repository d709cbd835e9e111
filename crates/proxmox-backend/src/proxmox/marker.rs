//! How a VM is recognised as ours: the managed tag, the per-machine tag,
//! the description marker naming the machine, and the clone's DNS-label
//! name; and a template replica by its tag and its marker naming the
//! source template.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether VMs get the bigfleet tags. The cluster's `user-tag-access` may
/// refuse new tags to the token; from then on VMs are marked by their
/// description marker only (the ownership proof anyway). Learnt by the
/// preflight or by the first refused marking, read by every marking.
#[derive(Default)]
pub(super) struct TagPolicy {
    restricted: AtomicBool,
}

impl TagPolicy {
    /// Tags are refused: mark by description only.
    pub(super) fn restricted(&self) -> bool {
        self.restricted.load(Ordering::Relaxed)
    }

    /// Records that tags are refused; `true` when this is news (so the
    /// caller warns once).
    pub(super) fn restrict(&self) -> bool {
        !self.restricted.swap(true, Ordering::Relaxed)
    }
}

/// Tag every VM we create carries.
pub const MANAGED_TAG: &str = "bigfleet";

/// The per-machine tag `bigfleet-<machine id>`, made a valid PVE tag (see
/// [`pve::sanitize_tag`]): it finds a machine's VM in the inventory without
/// reading configs.
pub fn machine_tag(machine_id: &str) -> String {
    pve::sanitize_tag(&format!("bigfleet-{machine_id}"))
}

/// The VM is recognisable as ours without reading its config.
pub(super) fn looks_managed(tags: &[String], name: Option<&str>) -> bool {
    tags.iter().any(|t| t == MANAGED_TAG) || name.is_some_and(|n| n.starts_with("bigfleet-"))
}

/// The description marker: `BigFleet managed VM. machine_id=<id> operation_id=<op>`.
pub fn marker_description(machine_id: &str, operation_id: &str) -> String {
    format!("BigFleet managed VM. machine_id={machine_id} operation_id={operation_id}")
}

/// The verbatim machine id from a description marker.
pub fn parse_marker(description: &str) -> Option<String> {
    if !description.contains("BigFleet managed VM") {
        return None;
    }
    description
        .split_whitespace()
        .find_map(|w| w.strip_prefix("machine_id="))
        .filter(|id| !id.is_empty())
        .map(str::to_string)
}

/// The verbatim operation id from a description marker.
pub fn parse_marker_operation(description: &str) -> Option<String> {
    parse_marker(description)?;
    description
        .split_whitespace()
        .find_map(|w| w.strip_prefix("operation_id="))
        .filter(|id| !id.is_empty())
        .map(str::to_string)
}

/// The ownership proof before anything is destroyed: the description marker
/// names `machine_id` (and `operation_id`, when one is given). Tags and
/// names only make a VM look managed; another process (or a person) can
/// carry them too.
pub fn owned_by(description: Option<&str>, machine_id: &str, operation_id: Option<&str>) -> bool {
    let Some(d) = description else {
        return false;
    };
    parse_marker(d).as_deref() == Some(machine_id)
        && operation_id.is_none_or(|op| parse_marker_operation(d).as_deref() == Some(op))
}

/// `bigfleet-<type>-<id>` as a DNS label: lowercase `[a-z0-9-]`, no leading,
/// trailing or repeated `-`, at most 63 characters.
pub fn vm_name(instance_type: &str, machine_id: &str) -> String {
    let raw = format!("bigfleet-{instance_type}-{machine_id}").to_ascii_lowercase();
    let mut out = String::with_capacity(raw.len());
    for c in raw.chars() {
        let c = if c.is_ascii_alphanumeric() { c } else { '-' };
        if c == '-' && (out.is_empty() || out.ends_with('-')) {
            continue;
        }
        out.push(c);
    }
    if out.len() > 63 {
        // Keep the tail (the slot index) distinguishable: `bigfleet-` + the last chars.
        let tail_len = 63 - "bigfleet-".len();
        let tail = &out[out.len() - tail_len..];
        out = format!("bigfleet-{}", tail.trim_start_matches('-'));
    }
    out.trim_end_matches('-').to_string()
}

/// Tag on every replica (discovery from the inventory; the marker is the proof).
pub const REPLICA_TAG: &str = "bigfleet-replica";

const MARKER_PREFIX: &str = "BigFleet template replica.";

/// The replica's description: `BigFleet template replica. source_vmid=<id>
/// source_digest=<digest> node=<node it is for>`.
pub fn replica_description(source_vmid: u32, source_digest: &str, node: &str) -> String {
    format!("{MARKER_PREFIX} source_vmid={source_vmid} source_digest={source_digest} node={node}")
}

/// The node a replica is for (a half-staged one may still be on the
/// template's node).
pub(super) fn replica_target(description: &str) -> Option<String> {
    parse_replica_marker(description)?;
    description
        .split_whitespace()
        .find_map(|w| w.strip_prefix("node="))
        .filter(|n| !n.is_empty())
        .map(str::to_string)
}

/// `(source vmid, source digest)` from a replica's description.
pub fn parse_replica_marker(description: &str) -> Option<(u32, String)> {
    if !description.trim_start().starts_with(MARKER_PREFIX) {
        return None;
    }
    let field = |k: &str| {
        description
            .split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .map(str::to_string)
    };
    let source = field("source_vmid=")?.parse().ok()?;
    Some((source, field("source_digest=")?))
}

/// `bigfleet-replica-<source>-<node>` as a DNS label.
pub(super) fn replica_name(source: u32, node: &str) -> String {
    let mut out = format!("bigfleet-replica-{source}-");
    for c in node.to_ascii_lowercase().chars() {
        out.push(if c.is_ascii_alphanumeric() { c } else { '-' });
    }
    out.truncate(63);
    out.trim_end_matches('-').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn machine_tags_are_valid_pve_tags() {
        let t = machine_tag("proxmox-dc1/OnDemand/pve.medium/pve1/007");
        assert_eq!(t, "bigfleet-proxmox-dc1-ondemand-pve.medium-pve1-007");
        assert!(pve::is_valid_tag(&t));
    }

    #[test]
    fn machine_tag_survives_normalisation() {
        let t = machine_tag("Cap/X/Y/007");
        assert_eq!(
            pve::normalize_tags(&format!("{MANAGED_TAG};{t}")),
            vec![MANAGED_TAG.to_string(), t]
        );
    }

    #[test]
    fn names_are_dns_labels() {
        let n = vm_name("pve.medium", "proxmox-dc1/OnDemand/pve.medium/pve1/007");
        assert_eq!(
            n,
            "bigfleet-pve-medium-proxmox-dc1-ondemand-pve-medium-pve1-007"
        );
        assert!(n.len() <= 63);
        let long = vm_name("t", &"x/".repeat(80));
        assert!(long.len() <= 63 && long.starts_with("bigfleet-") && !long.ends_with('-'));
        assert!(long
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'));
    }

    #[test]
    fn marker_round_trip() {
        let d = marker_description("Cap/OnDemand/t/z/001", "op-1");
        assert_eq!(parse_marker(&d).as_deref(), Some("Cap/OnDemand/t/z/001"));
        assert_eq!(
            parse_marker(&format!("{d}\n")).as_deref(),
            Some("Cap/OnDemand/t/z/001")
        );
        assert_eq!(parse_marker("machine_id=x but no marker"), None);
        assert_eq!(parse_marker("BigFleet managed VM. machine_id="), None);
    }

    #[test]
    fn ownership_needs_the_marker() {
        let d = format!("{}\n", marker_description("m/1", "op-7"));
        assert!(owned_by(Some(&d), "m/1", None));
        assert!(owned_by(Some(&d), "m/1", Some("op-7")));
        assert!(
            !owned_by(Some(&d), "m/1", Some("op-8")),
            "another operation's clone"
        );
        assert!(!owned_by(Some(&d), "m/2", None), "another machine");
        assert!(!owned_by(None, "m/1", None));
        assert!(!owned_by(
            Some("machine_id=m/1 operation_id=op-7"),
            "m/1",
            None
        ));
    }

    #[test]
    fn replica_markers_round_trip() {
        let d = replica_description(9000, "abc123", "pve2");
        assert_eq!(replica_target(&d).as_deref(), Some("pve2"));
        assert_eq!(parse_replica_marker(&d), Some((9000, "abc123".into())));
        assert_eq!(
            parse_replica_marker(&format!("{d}\n")),
            Some((9000, "abc123".into()))
        );
        assert_eq!(parse_replica_marker("my own copy of 9000"), None);
        assert_eq!(
            parse_replica_marker("BigFleet managed VM. machine_id=x operation_id=y"),
            None
        );
        assert_eq!(
            parse_replica_marker("BigFleet template replica. source_vmid=x"),
            None
        );
        assert_eq!(replica_name(9000, "PVE_2"), "bigfleet-replica-9000-pve-2");
    }
}
