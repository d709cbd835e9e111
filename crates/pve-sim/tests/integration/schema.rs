//! The embedded endpoint description: it covers exactly the served routes, and
//! where the official PVE API schema is available, everything it declares
//! agrees with it.

use std::collections::BTreeSet;

use pve_sim::schema::{self, Schema};
use serde_json::{Map, Value};

#[test]
fn embedded_description_covers_exactly_the_served_routes() {
    let s = Schema::embedded().expect("embedded description parses");
    let declared: BTreeSet<(String, String)> = s.endpoints().into_iter().collect();
    let served: BTreeSet<(String, String)> = pve_sim::server::ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    assert_eq!(
        declared.difference(&served).collect::<Vec<_>>(),
        Vec::<&(String, String)>::new(),
        "declared but not served"
    );
    assert_eq!(
        served.difference(&declared).collect::<Vec<_>>(),
        Vec::<&(String, String)>::new(),
        "served but not declared"
    );
    // Every path parameter is declared as a required parameter.
    for (m, p) in &served {
        let props = s.embedded_params(m, p).expect("declared");
        for seg in p.split('/') {
            if let Some(name) = seg.strip_prefix('{').and_then(|x| x.strip_suffix('}')) {
                let def = props
                    .get(name)
                    .unwrap_or_else(|| panic!("{m} {p}: path parameter {name} undeclared"));
                assert!(def.get("optional").is_none(), "{m} {p}: {name} optional");
            }
        }
    }
}

#[test]
fn embedded_description_has_no_prose() {
    fn walk(v: &Value, names: bool, at: &str) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    if !names {
                        assert!(
                            !matches!(
                                k.as_str(),
                                "description" | "verbose_description" | "typetext"
                            ),
                            "prose key {k} at {at}"
                        );
                    }
                    // Children of a name map are definitions; a definition's
                    // `properties` and dict-valued `format` are name maps.
                    let child_names =
                        !names && (k == "properties" || (k == "format" && x.is_object()));
                    walk(x, child_names, &format!("{at}/{k}"));
                }
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, false, at)),
            _ => {}
        }
    }
    let doc: Value = serde_json::from_str(schema::EMBEDDED_API).expect("json");
    for (path, methods) in doc["endpoints"].as_object().expect("endpoints") {
        for (m, def) in methods.as_object().expect("methods") {
            walk(&def["parameters"], false, &format!("{m} {path}"));
        }
    }
}

/// A definition reduced to its structural facts (what the embedded file keeps).
fn structural(v: &Value, names: bool) -> Value {
    match v {
        Value::Object(m) => {
            let mut out = Map::new();
            for (k, x) in m {
                let prose = matches!(
                    k.as_str(),
                    "description"
                        | "verbose_description"
                        | "typetext"
                        | "format_description"
                        | "title"
                        | "renderer"
                        | "instance-types"
                        | "print_width"
                );
                if !names && prose {
                    continue;
                }
                // Defaults written as prose ("clone limit from datacenter ...").
                if !names && k == "default" && x.as_str().is_some_and(|s| s.contains(' ')) {
                    continue;
                }
                let child_names = !names && k == "format" && x.is_object();
                out.insert(k.clone(), structural(x, child_names));
            }
            Value::Object(out)
        }
        Value::Array(a) => Value::Array(a.iter().map(|x| structural(x, false)).collect()),
        other => other.clone(),
    }
}

#[test]
fn embedded_description_agrees_with_the_official_schema() {
    let path = match schema::default_schema_path() {
        Ok(Some(p)) => p,
        Ok(None) => {
            provider_testkit::skip::report(
                &provider_testkit::skip::current_test(),
                &format!(
                    "the official PVE API schema is not available (set {} or place it at \
                     ../shared/spec/pve-api-schema.json)",
                    schema::SCHEMA_ENV
                ),
            );
            return;
        }
        Err(e) => panic!("{e:#}"),
    };
    let s = Schema::with_official(&path).expect("official schema loads");
    let mut checked = 0;
    let mut not_official = Vec::new();
    let mut problems = Vec::new();
    for (m, p) in s.endpoints() {
        let ours = s.embedded_params(&m, &p).expect("declared");
        let Some(theirs) = s.official_params(&m, &p) else {
            not_official.push(format!("{m} {p}"));
            continue;
        };
        for (name, def) in ours {
            checked += 1;
            match theirs.get(name) {
                None => problems.push(format!("{m} {p}: parameter {name} is not official")),
                Some(off) => {
                    let off = structural(off, false);
                    if &off != def {
                        problems.push(format!(
                            "{m} {p}: parameter {name} differs:\n  embedded {def}\n  official {off}"
                        ));
                    }
                }
            }
        }
    }
    println!(
        "checked {checked} parameters against {}; endpoints this official file does not declare \
         (not checked): {not_official:?}",
        path.display()
    );
    assert!(checked > 0, "nothing compared");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn official_schema_env_must_name_a_file() {
    // A wrong explicit path is an error, not a silent fallback to embedded-only.
    let err = Schema::load(Some(std::path::Path::new(
        "/nonexistent/pve-api-schema.json",
    )))
    .err()
    .expect("missing file is an error");
    assert!(format!("{err:#}").contains("/nonexistent/pve-api-schema.json"));
}
