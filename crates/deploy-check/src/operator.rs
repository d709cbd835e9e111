//! The Prometheus Operator objects the chart renders (ServiceMonitor,
//! PrometheusRule), checked field by field against the shape the operator's
//! API reference documents for `monitoring.coreos.com/v1`.
//!
//! No package the project can install ships the operator's published CRD
//! schema (`kubernetes-validate` carries Kubernetes' own kinds only), so the
//! types below hold exactly the fields the chart sets, refuse any other
//! ([`check`] also refuses a field that would not survive a round trip, such
//! as a number where a string belongs), and the values whose form the API
//! reference constrains are checked against it: durations, relabel actions,
//! one of `alert`/`record` per rule.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

/// The API group and version of both kinds.
pub const API_VERSION: &str = "monitoring.coreos.com/v1";

/// monitoring.coreos.com/v1 ServiceMonitor, the fields the chart sets.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ServiceMonitor {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: ServiceMonitorSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ServiceMonitorSpec {
    pub namespace_selector: NamespaceSelector,
    pub selector: LabelSelector,
    pub endpoints: Vec<Endpoint>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NamespaceSelector {
    pub match_names: Vec<String>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Endpoint {
    pub port: String,
    pub path: String,
    pub interval: String,
    pub scrape_timeout: String,
    pub relabelings: Vec<RelabelConfig>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RelabelConfig {
    pub action: String,
    pub target_label: String,
    pub replacement: String,
}

/// monitoring.coreos.com/v1 PrometheusRule.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PrometheusRule {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: PrometheusRuleSpec,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrometheusRuleSpec {
    pub groups: Vec<RuleGroup>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleGroup {
    pub name: String,
    pub rules: Vec<Rule>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub alert: Option<String>,
    pub record: Option<String>,
    pub expr: String,
    #[serde(rename = "for")]
    pub for_: Option<String>,
    pub labels: Option<BTreeMap<String, String>>,
    pub annotations: Option<BTreeMap<String, String>>,
}

/// The relabel actions the API reference lists (either spelling).
pub const RELABEL_ACTIONS: &[&str] = &[
    "replace",
    "keep",
    "drop",
    "hashmod",
    "labelmap",
    "labeldrop",
    "labelkeep",
    "lowercase",
    "uppercase",
    "keepequal",
    "dropequal",
];

/// Why a rendered object does not have the documented shape.
#[derive(Debug, thiserror::Error)]
pub enum ShapeError {
    #[error("{object}: not a valid {kind}: {source}")]
    Invalid {
        object: String,
        kind: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "{object}: fields not in the documented {kind} (or of the wrong type): \
         rendered {rendered}, read back {read_back}"
    )]
    NotKept {
        object: String,
        kind: &'static str,
        rendered: Json,
        read_back: Json,
    },
    #[error("{object}: {field} is {value:?}, not a Duration (e.g. 30s, 1m30s, 2h; pattern (0|(N y)?(N w)?(N d)?(N h)?(N m)?(N s)?(N ms)?))")]
    Duration {
        object: String,
        field: String,
        value: String,
    },
    #[error("{object}: {field} is {value:?}, not a relabel action ({RELABEL_ACTIONS:?})")]
    RelabelAction {
        object: String,
        field: String,
        value: String,
    },
    #[error("{object}: {field} must have exactly one of `alert` and `record`")]
    RuleName { object: String, field: String },
    #[error("{object}: apiVersion is {value:?}, not {API_VERSION}")]
    ApiVersion { object: String, value: String },
    #[error("{object}: kind {kind:?} is not a Prometheus Operator kind this check knows")]
    UnknownKind { object: String, kind: String },
}

/// Whether `kind` is one of the operator's kinds [`check`] reads.
pub fn is_operator_kind(kind: &str) -> bool {
    matches!(kind, "ServiceMonitor" | "PrometheusRule")
}

/// Checks one rendered operator object (as JSON) against the documented shape.
pub fn check(object: &Json) -> Result<(), ShapeError> {
    let kind = object["kind"].as_str().unwrap_or_default();
    let name = format!(
        "{kind}/{}",
        object["metadata"]["name"].as_str().unwrap_or_default()
    );
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    if api_version != API_VERSION {
        return Err(ShapeError::ApiVersion {
            object: name,
            value: api_version.to_owned(),
        });
    }
    match kind {
        "ServiceMonitor" => {
            let sm: ServiceMonitor = strict(&name, "ServiceMonitor", object)?;
            for (i, ep) in sm.spec.endpoints.iter().enumerate() {
                let at = |f: &str| format!("spec.endpoints[{i}].{f}");
                duration(&name, &at("interval"), &ep.interval)?;
                duration(&name, &at("scrapeTimeout"), &ep.scrape_timeout)?;
                for (j, r) in ep.relabelings.iter().enumerate() {
                    if !RELABEL_ACTIONS.contains(&r.action.to_ascii_lowercase().as_str()) {
                        return Err(ShapeError::RelabelAction {
                            object: name,
                            field: at(&format!("relabelings[{j}].action")),
                            value: r.action.clone(),
                        });
                    }
                }
            }
            Ok(())
        }
        "PrometheusRule" => {
            let pr: PrometheusRule = strict(&name, "PrometheusRule", object)?;
            for (g, group) in pr.spec.groups.iter().enumerate() {
                for (r, rule) in group.rules.iter().enumerate() {
                    let at = format!("spec.groups[{g}].rules[{r}]");
                    if rule.alert.is_some() == rule.record.is_some() {
                        return Err(ShapeError::RuleName {
                            object: name,
                            field: at,
                        });
                    }
                    if let Some(d) = &rule.for_ {
                        duration(&name, &format!("{at}.for"), d)?;
                    }
                }
            }
            Ok(())
        }
        other => Err(ShapeError::UnknownKind {
            object: name,
            kind: other.to_owned(),
        }),
    }
}

/// Drops nulls, which typed objects legitimately omit on output.
pub fn strip_nulls(v: &mut Json) {
    match v {
        Json::Object(m) => {
            m.retain(|_, v| !v.is_null());
            m.values_mut().for_each(strip_nulls);
        }
        Json::Array(a) => a.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

/// Reads `object` as `T` and checks nothing was dropped or altered on the way.
fn strict<T: DeserializeOwned + Serialize>(
    name: &str,
    kind: &'static str,
    object: &Json,
) -> Result<T, ShapeError> {
    let typed: T =
        serde_json::from_value(object.clone()).map_err(|source| ShapeError::Invalid {
            object: name.to_owned(),
            kind,
            source,
        })?;
    let mut read_back = serde_json::to_value(&typed).map_err(|source| ShapeError::Invalid {
        object: name.to_owned(),
        kind,
        source,
    })?;
    strip_nulls(&mut read_back);
    let mut rendered = object.clone();
    strip_nulls(&mut rendered);
    if rendered != read_back {
        return Err(ShapeError::NotKept {
            object: name.to_owned(),
            kind,
            rendered,
            read_back,
        });
    }
    Ok(typed)
}

/// The operator's `Duration`: `0`, or number-unit pairs in the order
/// y, w, d, h, m, s, ms, each unit at most once.
pub fn is_duration(text: &str) -> bool {
    const UNITS: &[&str] = &["y", "w", "d", "h", "m", "s", "ms"];
    if text == "0" {
        return true;
    }
    let mut rest = text;
    let mut next_unit = 0;
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits == 0 {
            return false;
        }
        rest = &rest[digits..];
        // `ms` before `m`, so a minute is not read off a millisecond.
        let Some(unit) = (next_unit..UNITS.len())
            .filter(|&u| rest.starts_with(UNITS[u]))
            .max_by_key(|&u| UNITS[u].len())
        else {
            return false;
        };
        rest = &rest[UNITS[unit].len()..];
        next_unit = unit + 1;
    }
    !text.is_empty()
}

fn duration(object: &str, field: &str, value: &str) -> Result<(), ShapeError> {
    if is_duration(value) {
        Ok(())
    } else {
        Err(ShapeError::Duration {
            object: object.to_owned(),
            field: field.to_owned(),
            value: value.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_follow_the_documented_pattern() {
        for ok in [
            "0",
            "30s",
            "1m",
            "1m30s",
            "2h",
            "1d12h",
            "500ms",
            "1y2w3d4h5m6s7ms",
        ] {
            assert!(is_duration(ok), "{ok}");
        }
        for bad in [
            "", "30", "s", "1.5m", "30s1m", "1m1m", "-1s", "1 m", "10sec",
        ] {
            assert!(!is_duration(bad), "{bad}");
        }
    }

    fn service_monitor() -> Json {
        serde_json::json!({
            "apiVersion": API_VERSION,
            "kind": "ServiceMonitor",
            "metadata": {"name": "x"},
            "spec": {
                "namespaceSelector": {"matchNames": ["ns"]},
                "selector": {"matchLabels": {"a": "b"}},
                "endpoints": [{
                    "port": "metrics", "path": "/metrics", "interval": "30s",
                    "scrapeTimeout": "10s",
                    "relabelings": [{"action": "replace", "targetLabel": "job", "replacement": "j"}]
                }]
            }
        })
    }

    #[test]
    fn a_documented_service_monitor_passes_and_each_deviation_is_caught() {
        check(&service_monitor()).expect("the documented shape");
        let mut unknown = service_monitor();
        unknown["spec"]["endpoints"][0]["scrapeInterval"] = "30s".into();
        assert!(matches!(check(&unknown), Err(ShapeError::Invalid { .. })));
        let mut wrong_type = service_monitor();
        wrong_type["spec"]["endpoints"][0]["interval"] = 30.into();
        assert!(matches!(
            check(&wrong_type),
            Err(ShapeError::Invalid { .. })
        ));
        let mut bad_duration = service_monitor();
        bad_duration["spec"]["endpoints"][0]["scrapeTimeout"] = "10 seconds".into();
        assert!(matches!(
            check(&bad_duration),
            Err(ShapeError::Duration { .. })
        ));
        let mut bad_action = service_monitor();
        bad_action["spec"]["endpoints"][0]["relabelings"][0]["action"] = "rename".into();
        assert!(matches!(
            check(&bad_action),
            Err(ShapeError::RelabelAction { .. })
        ));
        let mut bad_version = service_monitor();
        bad_version["apiVersion"] = "monitoring.coreos.com/v1beta1".into();
        assert!(matches!(
            check(&bad_version),
            Err(ShapeError::ApiVersion { .. })
        ));
    }

    #[test]
    fn a_rule_needs_one_name_and_a_duration() {
        let rule = |rule: Json| {
            serde_json::json!({
                "apiVersion": API_VERSION, "kind": "PrometheusRule", "metadata": {"name": "r"},
                "spec": {"groups": [{"name": "g", "rules": [rule]}]}
            })
        };
        check(&rule(
            serde_json::json!({"alert": "A", "expr": "up == 0", "for": "5m"}),
        ))
        .expect("an alert");
        check(&rule(serde_json::json!({"record": "r:up", "expr": "up"}))).expect("a record");
        assert!(matches!(
            check(&rule(serde_json::json!({"expr": "up"}))),
            Err(ShapeError::RuleName { .. })
        ));
        assert!(matches!(
            check(&rule(
                serde_json::json!({"alert": "A", "expr": "up", "for": "five minutes"})
            )),
            Err(ShapeError::Duration { .. })
        ));
    }
}
