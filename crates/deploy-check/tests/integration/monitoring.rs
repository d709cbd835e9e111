//! The alert rules and the Grafana dashboard under deploy/monitoring:
//! `promtool check rules` accepts the rules, `promtool test rules` passes
//! their unit tests (and fails when a rule is broken), every alert is tested
//! both firing and quiet, and rules and dashboard use only the metrics
//! docs/observability.md documents. The docs' alert table and rule excerpts
//! agree with the file.
//!
//! promtool comes from Debian's prometheus package; without it the promtool
//! checks are skipped, except under CI=true where they fail.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use deploy_check::monitoring::{
    alert_rules, catalogue, path, promql_metric_names, queryable_series, read, AlertRule, ALERTS,
    ALERTS_TEST, CHART_FILES, DASHBOARD, MACHINE_STATES,
};
use deploy_check::tools::{find_or_skip, PROMTOOL_INSTALL};
use serde_json::Value as Json;

fn promtool(check: &str) -> Option<PathBuf> {
    find_or_skip("promtool", PROMTOOL_INSTALL, check)
}

fn run(tool: &Path, args: &[&str], dir: &Path) -> Output {
    Command::new(tool)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("running {} {args:?}: {e}", tool.display()))
}

fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn rules() -> Vec<AlertRule> {
    alert_rules(&read(ALERTS))
}

fn observability() -> String {
    read("docs/observability.md")
}

#[test]
fn rules_pass_promtool_check_rules() {
    let Some(promtool) = promtool("promtool check rules") else {
        return;
    };
    let out = run(
        &promtool,
        &["check", "rules", ALERTS],
        &deploy_check::workspace_root(),
    );
    assert!(
        out.status.success(),
        "promtool check rules {ALERTS}:\n{}",
        output_text(&out)
    );
    let text = output_text(&out);
    assert!(
        text.contains(&format!("SUCCESS: {} rules found", rules().len())),
        "{text}"
    );
}

#[test]
fn rules_pass_their_unit_tests() {
    let Some(promtool) = promtool("promtool test rules") else {
        return;
    };
    let out = run(
        &promtool,
        &["test", "rules", ALERTS_TEST],
        &deploy_check::workspace_root(),
    );
    assert!(
        out.status.success(),
        "promtool test rules {ALERTS_TEST}:\n{}",
        output_text(&out)
    );
}

/// The unit tests are only worth something if a broken rule fails them.
#[test]
fn unit_tests_catch_broken_rules() {
    let Some(promtool) = promtool("promtool test rules (mutants)") else {
        return;
    };
    let original = read(ALERTS);
    let mutants = [
        // Alerting on the wrong state.
        (
            r#"bigfleet_proxmox_machines{state="FAILED"}"#,
            r#"bigfleet_proxmox_machines{state="IDLE"}"#,
        ),
        // Dropping the minimum error count pages on a single failed call.
        (
            r#"and sum without (outcome) (increase(bigfleet_proxmox_api_calls_total{outcome="error"}[15m])) >= 3"#,
            "",
        ),
        // `and` instead of `unless` never fires for a provider that never succeeded.
        (
            "\n          unless sum without (outcome)",
            "\n          and sum without (outcome)",
        ),
        // A shorter hold-down fires the Down alert on a blip.
        (
            "up{job=\"bigfleet-proxmox\"} == 0\n        for: 5m",
            "up{job=\"bigfleet-proxmox\"} == 0\n        for: 1m",
        ),
        // Counting fencing as a server error.
        ("Internal|Unknown|", "Internal|FailedPrecondition|Unknown|"),
        // Tolerating some identity refusals: one must already fire.
        (
            "(rate(bigfleet_proxmox_identity_rejected_total[5m])) > 0",
            "(rate(bigfleet_proxmox_identity_rejected_total[5m])) > 0.01",
        ),
    ];
    let tests = read(ALERTS_TEST);
    for (from, to) in mutants {
        assert!(
            original.contains(from),
            "mutant anchor not in {ALERTS}: {from}"
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("alerts.yaml"),
            original.replacen(from, to, 1),
        )
        .unwrap();
        std::fs::write(dir.path().join("alerts.test.yaml"), &tests).unwrap();
        let check = run(&promtool, &["check", "rules", "alerts.yaml"], dir.path());
        assert!(
            check.status.success(),
            "mutant {from:?} -> {to:?} must still be a valid rule file:\n{}",
            output_text(&check)
        );
        let out = run(
            &promtool,
            &["test", "rules", "alerts.test.yaml"],
            dir.path(),
        );
        assert!(
            !out.status.success(),
            "the rule unit tests pass with {from:?} replaced by {to:?}"
        );
    }
}

#[test]
fn every_alert_is_tested_firing_and_quiet() {
    let tests: serde_yaml::Value = serde_yaml::from_str(&read(ALERTS_TEST)).unwrap();
    assert_eq!(
        tests["rule_files"][0].as_str(),
        Some("alerts.yaml"),
        "the tests load the rule file next to them"
    );
    let mut firing = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for t in tests["tests"].as_sequence().expect("tests: a list") {
        for case in t["alert_rule_test"].as_sequence().into_iter().flatten() {
            let name = case["alertname"].as_str().unwrap().to_owned();
            let exp = case["exp_alerts"].as_sequence().map_or(0, Vec::len);
            if exp > 0 {
                firing.insert(name);
            } else {
                quiet.insert(name);
            }
        }
    }
    let names: BTreeSet<String> = rules().into_iter().map(|r| r.alert).collect();
    for n in &names {
        assert!(firing.contains(n), "{ALERTS_TEST} never sees {n} fire");
        assert!(
            quiet.contains(n),
            "{ALERTS_TEST} never checks {n} stays quiet"
        );
    }
    for n in firing.union(&quiet) {
        assert!(
            names.contains(n),
            "{ALERTS_TEST} tests {n}, which {ALERTS} does not define"
        );
    }
}

#[test]
fn alerts_carry_severity_summary_and_description() {
    let rules = rules();
    assert!(rules.len() >= 8, "{} alerts", rules.len());
    let mut seen = BTreeSet::new();
    for r in &rules {
        assert!(seen.insert(r.alert.clone()), "{} defined twice", r.alert);
        assert!(
            r.alert.starts_with("BigFleetProxmox"),
            "{}: alert names start with BigFleetProxmox",
            r.alert
        );
        let sev = r.labels.get("severity").map(String::as_str);
        assert!(
            matches!(sev, Some("critical" | "warning" | "info")),
            "{}: severity {sev:?}",
            r.alert
        );
        for a in ["summary", "description"] {
            assert!(
                r.annotations.get(a).is_some_and(|s| !s.trim().is_empty()),
                "{}: no {a} annotation",
                r.alert
            );
        }
    }
    // The situations issue 16 names must each have an alert.
    for (what, needle) in [
        ("machines in FAILED", r#"state="FAILED""#),
        (
            "reconcile errors",
            r#"bigfleet_proxmox_reconcile_total{outcome="error"}"#,
        ),
        (
            "no successful reconcile",
            r#"bigfleet_proxmox_reconcile_total{outcome="success"}"#,
        ),
        ("Proxmox API errors", "bigfleet_proxmox_api_calls_total"),
        (
            "log lines dropped",
            "bigfleet_proxmox_log_lines_dropped_total",
        ),
        ("panics", "bigfleet_proxmox_panics_total"),
        (
            "callers refused for their identity",
            "bigfleet_proxmox_identity_rejected_total",
        ),
        (
            "disks a destroy could not remove",
            "bigfleet_proxmox_destroy_leftover_volumes_total",
        ),
        ("provider down", r#"up{job="bigfleet-proxmox"} == 0"#),
    ] {
        assert!(
            rules.iter().any(|r| r.expr.contains(needle)),
            "no alert for {what} (an expr containing {needle})"
        );
    }
}

#[test]
fn rules_use_only_documented_metrics_and_the_scrape_job() {
    let allowed = queryable_series(&observability());
    for r in rules() {
        let names = promql_metric_names(&r.expr);
        assert!(!names.is_empty(), "{}: no metric in {}", r.alert, r.expr);
        for m in names {
            assert!(
                allowed.contains(&m),
                "{}: {m} is not in docs/observability.md's catalogue",
                r.alert
            );
        }
        if r.expr.contains("up{") {
            assert!(
                r.expr.contains(r#"up{job="bigfleet-proxmox"}"#),
                "{}",
                r.alert
            );
        }
    }
    // Label values the rules match on are ones the provider emits.
    let text = read(ALERTS);
    for (i, _) in text.match_indices("state=\"") {
        let v: String = text[i + 7..].chars().take_while(|c| *c != '"').collect();
        assert!(MACHINE_STATES.contains(&v.as_str()), "unknown state {v}");
    }
}

#[test]
fn monitoring_paths_are_the_chart_files() {
    // deploy/monitoring/{alerts.yaml,dashboard.json} are links into the chart,
    // so the rule file, the PrometheusRule and the dashboard ConfigMap are one source.
    for (rel, file) in [(ALERTS, "alerts.yaml"), (DASHBOARD, "dashboard.json")] {
        let a = std::fs::canonicalize(path(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
        let b = std::fs::canonicalize(path(CHART_FILES).join(file)).unwrap();
        assert_eq!(a, b, "{rel} must link to {CHART_FILES}/{file}");
    }
}

fn dashboard() -> Json {
    serde_json::from_str(&read(DASHBOARD)).expect("dashboard.json parses")
}

/// Every panel, rows' nested panels included.
fn panels(d: &Json) -> Vec<&Json> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        out.push(p);
        for inner in p["panels"].as_array().into_iter().flatten() {
            out.push(inner);
        }
    }
    out
}

/// (panel title, refId, expr) of every query.
fn queries(d: &Json) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for p in panels(d) {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push((
                p["title"].as_str().unwrap_or_default().to_owned(),
                t["refId"].as_str().unwrap_or_default().to_owned(),
                t["expr"]
                    .as_str()
                    .expect("a target without expr")
                    .to_owned(),
            ));
        }
    }
    out
}

#[test]
fn dashboard_uses_only_documented_metrics() {
    let d = dashboard();
    let allowed = queryable_series(&observability());
    let mut used = BTreeSet::new();
    let mut exprs: Vec<String> = queries(&d).into_iter().map(|(_, _, e)| e).collect();
    for v in d["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"]["query"].as_str() {
            exprs.push(q.to_owned());
        }
    }
    for e in &exprs {
        // label_values(<selector>, label) is Grafana's; its selector is PromQL.
        let e = e
            .strip_prefix("label_values(")
            .and_then(|s| s.rsplit_once(','))
            .map_or(e.as_str(), |(sel, _)| sel);
        for m in promql_metric_names(e) {
            assert!(
                allowed.contains(&m),
                "dashboard query uses {m}, which docs/observability.md does not document: {e}"
            );
            used.insert(m);
        }
    }
    // It shows every provider metric family.
    for entry in catalogue(&observability()) {
        assert!(
            used.iter().any(|u| u.starts_with(&entry.name)),
            "the dashboard has no panel for {}",
            entry.name
        );
    }
}

#[test]
fn dashboard_queries_parse_as_promql() {
    let Some(promtool) = promtool("dashboard PromQL through promtool check rules") else {
        return;
    };
    // Each query becomes a recording rule, with Grafana's variables filled in
    // the way Grafana would, so promtool parses the PromQL.
    let mut rules = Vec::new();
    for (title, ref_id, expr) in queries(&dashboard()) {
        let expr = expr
            .replace("$__rate_interval", "5m")
            .replace("$__interval", "1m")
            .replace("${instance}", ".+")
            .replace("$instance", ".+");
        assert!(!expr.contains('$'), "{title}: unknown variable in {expr}");
        let mut rule = serde_yaml::Mapping::new();
        let record = format!("dashboard:{}:{ref_id}", rules.len());
        rule.insert("record".into(), record.into());
        rule.insert("expr".into(), expr.into());
        rules.push(serde_yaml::Value::Mapping(rule));
    }
    let file = serde_yaml::to_string(
        &serde_yaml::from_str::<serde_yaml::Value>("groups: [{name: dashboard, rules: []}]")
            .map(|mut v| {
                v["groups"][0]["rules"] = serde_yaml::Value::Sequence(rules.clone());
                v
            })
            .unwrap(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("dashboard-rules.yaml"), file).unwrap();
    let out = run(
        &promtool,
        &["check", "rules", "dashboard-rules.yaml"],
        dir.path(),
    );
    assert!(
        out.status.success(),
        "a dashboard query is not valid PromQL:\n{}",
        output_text(&out)
    );
    assert!(output_text(&out).contains(&format!("SUCCESS: {} rules found", rules.len())));
}

#[test]
fn dashboard_is_importable() {
    let d = dashboard();
    assert_eq!(d["uid"], "bigfleet-proxmox");
    assert!(d["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(d["schemaVersion"].as_i64().unwrap() >= 36);
    // The data source is a variable, so the dashboard imports into any Grafana.
    let vars: BTreeMap<&str, &Json> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v["name"].as_str().unwrap(), v))
        .collect();
    assert_eq!(vars["datasource"]["type"], "datasource");
    assert_eq!(vars["datasource"]["query"], "prometheus");
    let mut ids = BTreeSet::new();
    for p in panels(&d) {
        let id = p["id"].as_i64().expect("panel id");
        assert!(ids.insert(id), "panel id {id} used twice");
        let g = &p["gridPos"];
        let (x, w) = (g["x"].as_i64().unwrap(), g["w"].as_i64().unwrap());
        assert!(
            x >= 0 && w > 0 && x + w <= 24,
            "panel {id} outside the grid"
        );
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "panel {id}");
        for t in p["targets"].as_array().expect("targets") {
            assert_eq!(t["datasource"]["uid"], "${datasource}", "panel {id}");
            let e = t["expr"].as_str().unwrap();
            if promql_metric_names(e).iter().any(|m| m != "up") || e.contains("up{") {
                assert!(
                    e.contains(r#"job="bigfleet-proxmox""#)
                        && e.contains(r#"instance=~"$instance""#),
                    "panel {id}: every selector filters on the job and $instance: {e}"
                );
            }
        }
    }
}

/// The `| alert | severity | ... |` table rows of observability.md.
fn documented_alerts(md: &str) -> BTreeMap<String, String> {
    md.lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.trim().trim_matches('|').split('|').collect();
            let name = cells.first()?.trim().strip_prefix('`')?.strip_suffix('`')?;
            let severity = cells.get(1)?.trim().to_owned();
            name.starts_with("BigFleetProxmox")
                .then(|| (name.to_owned(), severity))
        })
        .collect()
}

#[test]
fn observability_doc_lists_every_alert() {
    let md = observability();
    assert!(
        md.contains("deploy/monitoring/alerts.yaml"),
        "observability.md points at the rules file"
    );
    let documented = documented_alerts(&md);
    let file: BTreeMap<String, String> = rules()
        .into_iter()
        .map(|r| (r.alert, r.labels["severity"].clone()))
        .collect();
    assert_eq!(
        documented, file,
        "the alert table in docs/observability.md (name | severity) differs from {ALERTS}"
    );
}

#[test]
fn observability_doc_rule_excerpts_match_the_file() {
    let md = observability();
    let by_name: BTreeMap<String, AlertRule> =
        rules().into_iter().map(|r| (r.alert.clone(), r)).collect();
    let mut quoted = 0;
    let mut in_yaml = false;
    let mut block = String::new();
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            if in_yaml && block.contains("- alert:") {
                let v: serde_yaml::Value = serde_yaml::from_str(&block)
                    .unwrap_or_else(|e| panic!("alert excerpt does not parse: {e}\n{block}"));
                let list = v["groups"][0]["rules"]
                    .as_sequence()
                    .or(v.as_sequence())
                    .expect("an excerpt is a rule list or a rule file");
                for r in list {
                    let name = r["alert"].as_str().expect("alert name");
                    let want = by_name.get(name).unwrap_or_else(|| {
                        panic!("observability.md quotes {name}, not in {ALERTS}")
                    });
                    assert_eq!(
                        r, &want.raw,
                        "observability.md's {name} differs from {ALERTS}; copy it from the file"
                    );
                    quoted += 1;
                }
            }
            in_yaml = !in_yaml && line.trim_start() == "```yaml";
            block.clear();
        } else if in_yaml {
            block.push_str(line);
            block.push('\n');
        }
    }
    assert!(quoted >= 1, "observability.md shows no alert rule excerpt");
}
