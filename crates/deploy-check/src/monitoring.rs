//! What the monitoring checks share: the metric catalogue as
//! docs/observability.md states it, metric names referenced by PromQL
//! expressions and the alert rules file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// The alert rules file (the chart ships the same file as a PrometheusRule).
pub const ALERTS: &str = "deploy/monitoring/alerts.yaml";
/// The `promtool test rules` unit tests for [`ALERTS`].
pub const ALERTS_TEST: &str = "deploy/monitoring/alerts.test.yaml";
/// The Grafana dashboard.
pub const DASHBOARD: &str = "deploy/monitoring/dashboard.json";
/// Where the chart keeps the files `.Files.Get` reads; the paths above link here.
pub const CHART_FILES: &str = "deploy/helm/bigfleet-proxmox/files";

/// Machine state label values of `bigfleet_proxmox_machines`: the
/// `MachineState` wire names without the `MACHINE_STATE_` prefix.
pub const MACHINE_STATES: &[&str] = &[
    "SPECULATIVE",
    "CREATING",
    "IDLE",
    "CONFIGURING",
    "CONFIGURED",
    "DRAINING",
    "DELETING",
    "FAILED",
];

/// Prometheus' own per-target series, usable next to the provider's.
pub const SCRAPE_SERIES: &[&str] = &["up"];

/// One row of the metric table in docs/observability.md.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogueEntry {
    pub name: String,
    pub kind: String,
    pub labels: Vec<String>,
}

pub fn path(rel: &str) -> PathBuf {
    crate::workspace_root().join(rel)
}

pub fn read(rel: &str) -> String {
    std::fs::read_to_string(path(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The `| metric | type | labels | meaning |` table of observability.md.
pub fn catalogue(observability_md: &str) -> Vec<CatalogueEntry> {
    let mut out = Vec::new();
    for line in observability_md.lines() {
        let cells: Vec<&str> = line.trim().trim_matches('|').split('|').collect();
        if cells.len() < 4 {
            continue;
        }
        let name = cells[0].trim();
        let Some(name) = name.strip_prefix('`').and_then(|n| n.strip_suffix('`')) else {
            continue;
        };
        if !name.starts_with("bigfleet_proxmox_") {
            continue;
        }
        let labels = cells[2]
            .split(',')
            .map(|l| l.trim().trim_matches('`').to_owned())
            .filter(|l| !l.is_empty() && l != "—" && l != "-")
            .collect();
        out.push(CatalogueEntry {
            name: name.to_owned(),
            kind: cells[1].trim().to_owned(),
            labels,
        });
    }
    out
}

/// The `process_*` names observability.md lists in its prose.
pub fn documented_process_metrics(observability_md: &str) -> BTreeSet<String> {
    identifiers_with_prefix(observability_md, "process_")
}

fn identifiers_with_prefix(text: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices(prefix) {
        let before = text[..i].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        out.insert(name);
    }
    out
}

/// Every series name a query may use: the catalogue (histograms with their
/// `_bucket`, `_sum` and `_count` series), the documented process metrics and
/// Prometheus' `up`.
pub fn queryable_series(observability_md: &str) -> BTreeSet<String> {
    let mut out: BTreeSet<String> = SCRAPE_SERIES.iter().map(|s| s.to_string()).collect();
    for e in catalogue(observability_md) {
        if e.kind == "histogram" {
            for s in ["_bucket", "_sum", "_count"] {
                out.insert(format!("{}{s}", e.name));
            }
        } else {
            out.insert(e.name);
        }
    }
    out.extend(documented_process_metrics(observability_md));
    out
}

/// Aggregation operators, which may be followed by `by (...)` rather than `(`.
const PROMQL_AGGREGATIONS: &[&str] = &[
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "limitk",
    "limit_ratio",
];

const PROMQL_KEYWORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
];

/// Metric names a PromQL expression selects: identifiers outside label
/// matchers, strings, ranges and grouping lists that are neither functions,
/// aggregations nor keywords. Grafana variables (`$x`) are skipped.
pub fn promql_metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut out = BTreeSet::new();
    let mut i = 0;
    let mut skip_next_parens = false;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    if chars[i] == '\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                while i < chars.len() && chars[i] != close {
                    if chars[i] == '"' {
                        i += 1;
                        while i < chars.len() && chars[i] != '"' {
                            if chars[i] == '\\' {
                                i += 1;
                            }
                            i += 1;
                        }
                    }
                    i += 1;
                }
                i += 1;
            }
            '(' if skip_next_parens => {
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
                i += 1;
                skip_next_parens = false;
            }
            '$' => {
                i += 1;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
            }
            c if c.is_ascii_digit() || c == '.' => {
                // Numbers, durations (5m) and exponents (1e3).
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let next = chars[i..].iter().find(|c| !c.is_whitespace());
                let lower = word.to_ascii_lowercase();
                if matches!(
                    lower.as_str(),
                    "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
                ) {
                    skip_next_parens = true;
                } else if next == Some(&'(')
                    || PROMQL_KEYWORDS.contains(&lower.as_str())
                    || PROMQL_AGGREGATIONS.contains(&lower.as_str())
                {
                    // A function or aggregation, or a binary keyword.
                } else {
                    out.insert(word);
                }
            }
            _ => i += 1,
        }
    }
    out
}

/// One alerting rule of the rules file.
#[derive(Debug, Clone)]
pub struct AlertRule {
    pub alert: String,
    pub expr: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub raw: serde_yaml::Value,
}

fn string_map(v: &serde_yaml::Value) -> BTreeMap<String, String> {
    v.as_mapping()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.as_str()?.to_owned(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

/// The alerting rules of a Prometheus rule file, in file order.
pub fn alert_rules(rule_file: &str) -> Vec<AlertRule> {
    let doc: serde_yaml::Value = serde_yaml::from_str(rule_file).expect("rule file parses");
    let mut out = Vec::new();
    for group in doc["groups"].as_sequence().expect("groups: a list") {
        for rule in group["rules"].as_sequence().expect("rules: a list") {
            let Some(alert) = rule["alert"].as_str() else {
                continue;
            };
            out.push(AlertRule {
                alert: alert.to_owned(),
                expr: rule["expr"].as_str().expect("expr").to_owned(),
                labels: string_map(&rule["labels"]),
                annotations: string_map(&rule["annotations"]),
                raw: rule.clone(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn promql_names_skip_functions_labels_and_groupings() {
        let names = promql_metric_names(
            r#"sum by (op, le) (rate(a_bucket{op="x", instance=~"$instance"}[$__rate_interval]))
               / on (job) group_left (zone) sum without (outcome) (b_total offset 5m) > 0.25
               and histogram_quantile(0.9, c:rec) or vector(0) unless up{job="bigfleet-proxmox"} == 1e3"#,
        );
        let want: BTreeSet<String> = ["a_bucket", "b_total", "c:rec", "up"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(names, want);
    }

    #[test]
    fn catalogue_reads_the_docs_table() {
        let md = "| metric | type | labels | meaning |\n|---|---|---|---|\n\
                  | `bigfleet_proxmox_a_total` | counter | `op`, `outcome` | x |\n\
                  | `bigfleet_proxmox_b` | gauge | — | y |\n| `/metrics` | a | b | c |\n";
        let c = catalogue(md);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].labels, ["op", "outcome"]);
        assert!(c[1].labels.is_empty());
        assert_eq!(c[1].kind, "gauge");
    }
}
