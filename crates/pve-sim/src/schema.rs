//! Request validation with PVE::JSONSchema's error strings, so clients see what
//! a real node answers. The simulator carries its own structural description
//! of every endpoint it serves (`api.json`: paths, methods, parameter names,
//! types, formats and limits); when the official PVE API schema is available
//! it validates against that as well.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use anyhow::{anyhow, Context, Result};
use parking_lot::Mutex;
use regex::Regex;
use serde_json::{Map, Value};

use crate::params::{parse_bool, Params};

/// Per-parameter error messages, as in PVE's `{"errors":{...}}`.
pub type ParamErrors = BTreeMap<String, String>;

/// The embedded endpoint description (see the module docs).
pub const EMBEDDED_API: &str = include_str!("api.json");

/// Env var naming the official schema file.
pub const SCHEMA_ENV: &str = "PVE_SIM_SCHEMA";

/// `(METHOD, path template) -> parameter definitions`.
pub type EndpointMap = HashMap<(String, String), Map<String, Value>>;

/// The validator: the embedded description, plus the official schema if loaded.
pub struct Schema {
    embedded: EndpointMap,
    official: Option<(PathBuf, EndpointMap)>,
    regex_cache: Mutex<HashMap<String, Option<Regex>>>,
}

/// Where the official schema is looked for when no path is given: `$PVE_SIM_SCHEMA`
/// (which must then exist), else `shared/spec/pve-api-schema.json` beside the
/// repository or in an ancestor of the cwd. `Ok(None)`: not present.
pub fn default_schema_path() -> Result<Option<PathBuf>> {
    if let Some(p) = std::env::var_os(SCHEMA_ENV).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        anyhow::ensure!(
            p.is_file(),
            "{SCHEMA_ENV}={} does not name a readable file",
            p.display()
        );
        return Ok(Some(p));
    }
    let rel = Path::new("shared/spec/pve-api-schema.json");
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut candidates: Vec<PathBuf> = manifest.ancestors().map(|a| a.join(rel)).collect();
    if let Ok(cwd) = std::env::current_dir() {
        candidates.extend(cwd.ancestors().map(|a| a.join(rel)));
    }
    Ok(candidates.into_iter().find(|p| p.is_file()))
}

/// Parse a document of the official schema's shape:
/// `{"endpoints": {PATH: {METHOD: {"parameters": {"properties": {...}}}}}}`.
pub fn parse_endpoints(text: &str) -> Result<EndpointMap> {
    let root: Value = serde_json::from_str(text)?;
    let eps = root
        .get("endpoints")
        .and_then(Value::as_object)
        .ok_or_else(|| anyhow!("schema has no \"endpoints\" object"))?;
    let mut endpoints = HashMap::new();
    for (path, methods) in eps {
        let Some(methods) = methods.as_object() else {
            continue;
        };
        for (method, def) in methods {
            let props = def
                .pointer("/parameters/properties")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            endpoints.insert((method.to_uppercase(), path.clone()), props);
        }
    }
    Ok(endpoints)
}

impl Schema {
    /// The embedded description only.
    pub fn embedded() -> Result<Self> {
        Ok(Self {
            embedded: parse_endpoints(EMBEDDED_API).context("parsing the embedded api.json")?,
            official: None,
            regex_cache: Mutex::new(HashMap::new()),
        })
    }

    /// The embedded description plus the official schema at `path`.
    pub fn with_official(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading PVE API schema {}", path.display()))?;
        let official = parse_endpoints(&text)
            .with_context(|| format!("parsing PVE API schema {}", path.display()))?;
        let mut s = Self::embedded()?;
        s.official = Some((path.to_path_buf(), official));
        Ok(s)
    }

    /// `explicit` if given, else the official schema when [`default_schema_path`]
    /// finds one, else the embedded description alone.
    pub fn load(explicit: Option<&Path>) -> Result<Self> {
        match explicit {
            Some(p) => Self::with_official(p),
            None => match default_schema_path()? {
                Some(p) => Self::with_official(&p),
                None => Self::embedded(),
            },
        }
    }

    /// For logs and startup output: `embedded` or `embedded+official:PATH`.
    pub fn source(&self) -> String {
        match &self.official {
            Some((p, _)) => format!("embedded+official:{}", p.display()),
            None => "embedded".into(),
        }
    }

    pub fn official_path(&self) -> Option<&Path> {
        self.official.as_ref().map(|(p, _)| p.as_path())
    }

    /// Whether the embedded description declares `method template`.
    pub fn has(&self, method: &str, template: &str) -> bool {
        self.embedded
            .contains_key(&(method.to_string(), template.to_string()))
    }

    /// Every `(METHOD, template)` the embedded description declares, sorted.
    pub fn endpoints(&self) -> Vec<(String, String)> {
        let mut v: Vec<_> = self.embedded.keys().cloned().collect();
        v.sort();
        v
    }

    /// Parameter definitions of one endpoint in the embedded description.
    pub fn embedded_params(&self, method: &str, template: &str) -> Option<&Map<String, Value>> {
        self.embedded
            .get(&(method.to_string(), template.to_string()))
    }

    /// Parameter definitions of one endpoint in the official schema, if loaded
    /// and declared there.
    pub fn official_params(&self, method: &str, template: &str) -> Option<&Map<String, Value>> {
        self.official
            .as_ref()
            .and_then(|(_, m)| m.get(&(method.to_string(), template.to_string())))
    }

    /// Validate `params` (path parameters included) for one endpoint against the
    /// embedded description, then the official schema where it declares the
    /// endpoint (the first message per parameter wins).
    pub fn validate(
        &self,
        method: &str,
        template: &str,
        params: &Params,
    ) -> Result<(), ParamErrors> {
        let Some(props) = self.embedded_params(method, template) else {
            let mut errors = ParamErrors::new();
            errors.insert(
                "_endpoint".into(),
                format!("{method} {template} is not in the API schema"),
            );
            return Err(errors);
        };
        let mut errors = self.validate_against(props, params);
        if let Some(official) = self.official_params(method, template) {
            for (k, v) in self.validate_against(official, params) {
                errors.entry(k).or_insert(v);
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    fn validate_against(&self, props: &Map<String, Value>, params: &Params) -> ParamErrors {
        let mut errors = ParamErrors::new();
        for (name, values) in &params.0 {
            let Some(def) = lookup_prop(props, name) else {
                errors.insert(
                    name.clone(),
                    "property is not defined in schema and the schema does not allow additional properties".into(),
                );
                continue;
            };
            if let Err(e) = self.check_values(def, values) {
                errors.insert(name.clone(), e);
            }
        }
        for (name, def) in props {
            if name.contains("[n]") {
                continue;
            }
            let optional = def.get("optional").map(truthy).unwrap_or(false);
            if !optional && !params.contains(name) {
                errors.insert(
                    name.clone(),
                    "property is missing and it is not optional".into(),
                );
            }
            if let Some(req) = def.get("requires").and_then(Value::as_str) {
                if params.contains(name) && !params.contains(req) && !errors.contains_key(req) {
                    errors.insert(
                        req.to_string(),
                        format!("missing property - '{name}' requires this property"),
                    );
                }
            }
        }
        errors
    }

    fn check_values(&self, def: &Value, values: &[String]) -> Result<(), String> {
        let ty = def.get("type").and_then(Value::as_str).unwrap_or("string");
        if ty == "array" {
            let items = def.get("items").cloned().unwrap_or(Value::Null);
            for v in values {
                self.check_scalar(&items, v)?;
            }
            return Ok(());
        }
        match values {
            [] => Err(format!("type check ('{ty}') failed - got empty value")),
            [one] => self.check_scalar(def, one),
            _ => Err(format!(
                "type check ('{ty}') failed - got {} values for a non-array parameter",
                values.len()
            )),
        }
    }

    fn check_scalar(&self, def: &Value, v: &str) -> Result<(), String> {
        let ty = def.get("type").and_then(Value::as_str).unwrap_or("string");
        match ty {
            "integer" => {
                let n: i64 = v
                    .trim()
                    .parse()
                    .map_err(|_| format!("type check ('integer') failed - got '{v}'"))?;
                check_range(def, n as f64)?;
            }
            "number" => {
                let n: f64 = v
                    .trim()
                    .parse()
                    .map_err(|_| format!("type check ('number') failed - got '{v}'"))?;
                check_range(def, n)?;
            }
            "boolean" => {
                parse_bool(v)
                    .ok_or_else(|| format!("type check ('boolean') failed - got '{v}'"))?;
            }
            _ => {}
        }
        if let Some(max) = def.get("maxLength").and_then(num) {
            if v.chars().count() as f64 > max {
                return Err(format!("value may only be {max} characters long"));
            }
        }
        if let Some(en) = def.get("enum").and_then(Value::as_array) {
            let allowed: Vec<&str> = en.iter().filter_map(Value::as_str).collect();
            if !allowed.contains(&v) {
                return Err(format!(
                    "value '{v}' does not have a value in the enumeration '{}'",
                    allowed.join(", ")
                ));
            }
        }
        if let Some(pat) = def.get("pattern").and_then(Value::as_str) {
            if let Some(false) = self.regex_match(pat, v) {
                return Err("value does not match the regex pattern".into());
            }
        }
        match def.get("format") {
            Some(Value::String(f)) => {
                check_named_format(f, v).map_err(|e| format!("invalid format - {e}"))
            }
            Some(Value::Object(dict)) => self
                .check_property_string(dict, v)
                .map_err(|e| format!("invalid format - {e}")),
            _ => Ok(()),
        }
    }

    /// `key=value,...` strings whose bare part belongs to the `default_key`.
    fn check_property_string(&self, dict: &Map<String, Value>, v: &str) -> Result<(), String> {
        let default_key = dict
            .iter()
            .find(|(_, d)| d.get("default_key").map(truthy).unwrap_or(false))
            .map(|(k, _)| k.clone());
        for part in v.split(',').filter(|p| !p.is_empty()) {
            let (key, val) = match part.split_once('=') {
                Some((k, val)) => (k.to_string(), val),
                None => match &default_key {
                    Some(k) => (k.clone(), part),
                    None => {
                        return Err(format!(
                            "value without key, but schema does not define a default key: '{part}'"
                        ))
                    }
                },
            };
            let mut def = dict.get(&key);
            if let Some(alias) = def.and_then(|d| d.get("alias")).and_then(Value::as_str) {
                def = dict.get(alias);
            }
            let def = def.ok_or_else(|| format!("property '{key}' is not defined in schema"))?;
            self.check_scalar(def, val)
                .map_err(|e| format!("{key}: {e}"))?;
        }
        Ok(())
    }

    fn regex_match(&self, pat: &str, v: &str) -> Option<bool> {
        let mut cache = self.regex_cache.lock();
        let re = cache
            .entry(pat.to_string())
            // Perl-only constructs fail to compile; such patterns are not enforced.
            .or_insert_with(|| Regex::new(&format!("^(?:{pat})$")).ok());
        re.as_ref().map(|r| r.is_match(v))
    }
}

pub fn lookup_prop<'a>(props: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    if let Some(d) = props.get(name) {
        return Some(d);
    }
    // `net[n]` defines net0, net1, ...
    let prefix = name.trim_end_matches(|c: char| c.is_ascii_digit());
    if prefix.len() < name.len() {
        return props.get(&format!("{prefix}[n]"));
    }
    None
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => parse_bool(s).unwrap_or(false),
        _ => false,
    }
}

fn num(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

fn check_range(def: &Value, n: f64) -> Result<(), String> {
    if let Some(min) = def.get("minimum").and_then(num) {
        if n < min {
            return Err(format!("value must have a minimum value of {min}"));
        }
    }
    if let Some(max) = def.get("maximum").and_then(num) {
        if n > max {
            return Err(format!("value must have a maximum value of {max}"));
        }
    }
    Ok(())
}

static NODE_RE: &str = r"^(?i:[a-z0-9](?:[a-z0-9\-]*[a-z0-9])?)$";
static DNS_RE: &str =
    r"^(?i:[a-z0-9](?:[a-z0-9\-]*[a-z0-9])?)(?:\.(?i:[a-z0-9](?:[a-z0-9\-]*[a-z0-9])?))*$";
static POOL_RE: &str = r"^[A-Za-z0-9_\-]+(?:/[A-Za-z0-9_\-]+){0,2}$";
static STORAGE_RE: &str = r"^(?i:[a-z][a-z0-9\-_.]*[a-z0-9])$";
static CONFIGID_RE: &str = r"^[a-z][a-z0-9_]+$";
static TAG_RE: &str = r"^(?i:[a-z0-9_][a-z0-9_\-+.]*)$";

static FORMAT_REGEXES: LazyLock<HashMap<&'static str, Regex>> = LazyLock::new(|| {
    [NODE_RE, DNS_RE, POOL_RE, STORAGE_RE, CONFIGID_RE, TAG_RE]
        .into_iter()
        .filter_map(|p| Regex::new(p).ok().map(|r| (p, r)))
        .collect()
});

fn matches(re: &'static str, v: &str) -> bool {
    // The constants above all compile (the unit tests exercise each).
    FORMAT_REGEXES.get(re).is_some_and(|r| r.is_match(v))
}

/// Named formats the simulated endpoints rely on; unknown names are not enforced.
fn check_named_format(format: &str, v: &str) -> Result<(), String> {
    match format {
        "pve-node" if !matches(NODE_RE, v) => {
            Err(format!("value '{v}' does not look like a valid node name"))
        }
        "dns-name" if !matches(DNS_RE, v) => {
            Err("value does not look like a valid DNS name".into())
        }
        "pve-poolid" if !matches(POOL_RE, v) => {
            Err(format!("pool name '{v}' contains illegal characters"))
        }
        "pve-storage-id" if !matches(STORAGE_RE, v) => {
            Err(format!("storage ID '{v}' contains illegal characters"))
        }
        "pve-configid" if !matches(CONFIGID_RE, v) => {
            Err(format!("invalid configuration ID '{v}'"))
        }
        "pve-configid-list" => {
            for id in split_list(v) {
                if !matches(CONFIGID_RE, id) {
                    return Err(format!("invalid configuration ID '{id}'"));
                }
            }
            Ok(())
        }
        "pve-vmid-list" => {
            for id in split_list(v) {
                if id.parse::<u32>().map(|n| n < 100).unwrap_or(true) {
                    return Err(format!("value '{id}' does not look like a valid VM ID"));
                }
            }
            Ok(())
        }
        "pve-tag-list" => {
            for tag in split_tags(v) {
                if !matches(TAG_RE, tag) {
                    return Err(format!("invalid tag '{tag}'"));
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

fn split_list(v: &str) -> impl Iterator<Item = &str> {
    v.split(|c: char| c == ',' || c == ';' || c.is_whitespace() || c == '\0')
        .filter(|s| !s.is_empty())
}

/// Tags are split on `;`, `,` or whitespace.
pub fn split_tags(v: &str) -> impl Iterator<Item = &str> {
    v.split(|c: char| c == ';' || c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
}

/// The stored form of a tag list under `style`.
pub fn normalize_tags_with(v: &str, style: crate::config::TagStyle) -> String {
    use crate::config::TagStyle;
    match style {
        TagStyle::Lowercase => normalize_tags(v),
        TagStyle::CaseSensitive => {
            let mut tags: Vec<&str> = split_tags(v).collect();
            tags.sort_unstable();
            tags.dedup();
            tags.join(";")
        }
        TagStyle::Verbatim => v.to_string(),
    }
}

/// PVE's stored form of a tag list: lowercased, sorted, de-duplicated, `;`-joined.
pub fn normalize_tags(v: &str) -> String {
    let mut tags: Vec<String> = split_tags(v).map(str::to_lowercase).collect();
    tags.sort();
    tags.dedup();
    tags.join(";")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> Schema {
        Schema::embedded().expect("embedded description loads")
    }

    fn params(pairs: &[(&str, &str)]) -> Params {
        let mut p = Params::default();
        for (k, v) in pairs {
            p.push(*k, *v);
        }
        p
    }

    #[test]
    fn named_formats() {
        for (f, good, bad) in [
            ("pve-node", "pve-1", "-pve"),
            ("dns-name", "bigfleet-a.example", "bad_name"),
            ("pve-poolid", "bigfleet", "big fleet"),
            ("pve-storage-id", "local-lvm", "1local"),
            ("pve-configid", "description", "Desc"),
            ("pve-tag-list", "a;B,c d", "ok;-bad"),
        ] {
            assert_eq!(check_named_format(f, good), Ok(()), "{f} {good}");
            assert!(check_named_format(f, bad).is_err(), "{f} {bad}");
        }
    }

    #[test]
    fn tag_styles() {
        use crate::config::TagStyle;
        assert_eq!(normalize_tags_with("B;a,B a", TagStyle::Lowercase), "a;b");
        assert_eq!(
            normalize_tags_with("B;a,B a", TagStyle::CaseSensitive),
            "B;a"
        );
        assert_eq!(
            normalize_tags_with("B;a,B a", TagStyle::Verbatim),
            "B;a,B a"
        );
    }

    #[test]
    fn tags_normalise() {
        assert_eq!(normalize_tags("B;a,c  a"), "a;b;c");
        assert_eq!(
            normalize_tags("bigfleet-X1;bigfleet"),
            "bigfleet;bigfleet-x1"
        );
    }

    #[test]
    fn clone_params_validate() {
        let s = schema();
        let t = "/nodes/{node}/qemu/{vmid}/clone";
        let ok = params(&[
            ("node", "pve1"),
            ("vmid", "9000"),
            ("newid", "101"),
            ("full", "1"),
            ("name", "bigfleet-a"),
        ]);
        assert_eq!(s.validate("POST", t, &ok), Ok(()));
        let bad = params(&[
            ("node", "pve1"),
            ("vmid", "9000"),
            ("newid", "abc"),
            ("bogus", "1"),
            ("name", "not_dns!"),
        ]);
        let errs = s.validate("POST", t, &bad).unwrap_err();
        assert_eq!(errs["newid"], "type check ('integer') failed - got 'abc'");
        assert!(errs["bogus"].contains("not defined in schema"));
        assert!(errs["name"].contains("DNS name"));
        let missing = params(&[("node", "pve1"), ("vmid", "9000")]);
        let errs = s.validate("POST", t, &missing).unwrap_err();
        assert_eq!(errs["newid"], "property is missing and it is not optional");
    }

    #[test]
    fn config_params_validate() {
        let s = schema();
        let t = "/nodes/{node}/qemu/{vmid}/config";
        let ok = params(&[
            ("node", "pve1"),
            ("vmid", "101"),
            ("memory", "4096"),
            ("tags", "a;B"),
            ("net0", "virtio,bridge=vmbr0"),
        ]);
        assert_eq!(s.validate("PUT", t, &ok), Ok(()));
        let long = "x".repeat(8193);
        let bad = params(&[
            ("node", "pve1"),
            ("vmid", "101"),
            ("memory", "8"),
            ("tags", "ok;-bad"),
            ("description", &long),
        ]);
        let errs = s.validate("PUT", t, &bad).unwrap_err();
        assert!(errs["memory"].contains("minimum"), "{errs:?}");
        assert!(errs["tags"].contains("invalid tag '-bad'"), "{errs:?}");
        assert!(errs["description"].contains("8192"), "{errs:?}");
    }
}
