//! A Helm-compatible renderer for the subset of the template language the
//! chart in `deploy/helm/` uses. (One file past 600 lines on purpose: the
//! render context, the functions and the schema check are one renderer.)
//!
//! Go text/template itself (actions, `if`/`else`/`range`/`with`, `define`,
//! `{{-`/`-}}` trimming, pipelines) comes from `gtmpl`. On top of it this
//! module supplies Helm's render context (`.Values`, `.Release`, `.Chart`),
//! the values merge, `include`, and the Sprig functions listed in
//! [`FUNCS`]. Output post-processing follows Helm: `<no value>` becomes the
//! empty string and every template file may hold several `---` documents.
//!
//! Like helm, the merged values are validated against the chart's
//! `values.schema.json` (JSON Schema) before anything renders.
//!
//! `.Files.Get "path"` is a method call, which gtmpl cannot evaluate; the
//! renderer rewrites it to a `filesGet` function over the chart's files
//! before parsing. `lookup` answers from [`Cluster`], empty by default, as
//! `helm template` does.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use gtmpl::{Context, Func, FuncError, Template, Value};
use sha2::{Digest, Sha256};

/// Errors loading or rendering a chart.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing {path} as YAML: {source}")]
    Yaml {
        path: PathBuf,
        source: serde_yaml::Error,
    },
    #[error("{path} is not a YAML mapping")]
    NotAMapping { path: PathBuf },
    #[error("parsing template {template}: {message}")]
    Parse { template: String, message: String },
    #[error("rendering template {template}: {message}")]
    Render { template: String, message: String },
    #[error("{path} is not a valid JSON Schema: {message}")]
    Schema { path: PathBuf, message: String },
    /// Helm's wording: "values don't meet the specifications of the schema(s)".
    #[error(
        "values don't meet the specifications of the schema(s) in the following chart(s):\n{chart}:\n{}",
        errors.iter().map(|e| format!("- {e}")).collect::<Vec<_>>().join("\n")
    )]
    Values { chart: String, errors: Vec<String> },
}

/// Objects `lookup` finds, keyed by (apiVersion, kind, namespace, name).
/// Empty by default: `helm template` and dry runs see no cluster either.
pub type Cluster = BTreeMap<(String, String, String, String), serde_yaml::Value>;

/// Release facts Helm exposes as `.Release`.
#[derive(Debug, Clone)]
pub struct Release {
    pub name: String,
    pub namespace: String,
}

impl Default for Release {
    fn default() -> Self {
        Release {
            name: "pve".to_owned(),
            namespace: "bigfleet".to_owned(),
        }
    }
}

/// A chart read from disk: metadata, default values and template sources.
#[derive(Debug, Clone)]
pub struct Chart {
    pub dir: PathBuf,
    pub metadata: serde_yaml::Mapping,
    pub values: serde_yaml::Value,
    /// `templates/*.yaml` as (file name, source), sorted by name.
    pub templates: Vec<(String, String)>,
    /// Concatenated `templates/_*.tpl` sources (named templates only).
    pub helpers: String,
    /// `templates/NOTES.txt`, if the chart has one.
    pub notes: Option<String>,
    /// `values.schema.json`, if the chart has one.
    pub schema: Option<serde_json::Value>,
    /// Files `.Files.Get` can read: everything outside `templates/` but the
    /// chart's own metadata, by path relative to the chart.
    pub files: BTreeMap<String, String>,
}

/// One rendered Kubernetes document and the template it came from.
#[derive(Debug, Clone)]
pub struct Document {
    pub template: String,
    pub yaml: String,
}

fn read(path: &Path) -> Result<String, Error> {
    fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_owned(),
        source,
    })
}

fn parse_yaml(path: &Path, text: &str) -> Result<serde_yaml::Value, Error> {
    serde_yaml::from_str(text).map_err(|source| Error::Yaml {
        path: path.to_owned(),
        source,
    })
}

impl Chart {
    /// Reads `Chart.yaml`, `values.yaml` and `templates/` from `dir`.
    pub fn load(dir: &Path) -> Result<Chart, Error> {
        let chart_path = dir.join("Chart.yaml");
        let metadata = match parse_yaml(&chart_path, &read(&chart_path)?)? {
            serde_yaml::Value::Mapping(m) => m,
            _ => return Err(Error::NotAMapping { path: chart_path }),
        };
        let values_path = dir.join("values.yaml");
        let values = parse_yaml(&values_path, &read(&values_path)?)?;
        if !values.is_mapping() {
            return Err(Error::NotAMapping { path: values_path });
        }

        let tdir = dir.join("templates");
        let entries = fs::read_dir(&tdir).map_err(|source| Error::Io {
            path: tdir.clone(),
            source,
        })?;
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| Error::Io {
                path: tdir.clone(),
                source,
            })?;
            if let Some(name) = entry.file_name().to_str() {
                names.push(name.to_owned());
            }
        }
        names.sort();
        let mut templates = Vec::new();
        let mut helpers = String::new();
        let mut notes = None;
        for name in names {
            let path = tdir.join(&name);
            if name.starts_with('_') && name.ends_with(".tpl") {
                helpers.push_str(&read(&path)?);
                helpers.push('\n');
            } else if name.ends_with(".yaml") || name.ends_with(".yml") {
                templates.push((name, read(&path)?));
            } else if name == "NOTES.txt" {
                notes = Some(read(&path)?);
            }
        }
        let schema_path = dir.join("values.schema.json");
        let schema = if schema_path.exists() {
            let text = read(&schema_path)?;
            let schema: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Error::Schema {
                    path: schema_path.clone(),
                    message: e.to_string(),
                })?;
            jsonschema::validator_for(&schema).map_err(|e| Error::Schema {
                path: schema_path.clone(),
                message: e.to_string(),
            })?;
            Some(schema)
        } else {
            None
        };
        let mut files = BTreeMap::new();
        collect_files(dir, dir, &mut files)?;
        Ok(Chart {
            dir: dir.to_owned(),
            metadata,
            values,
            templates,
            helpers,
            notes,
            schema,
            files,
        })
    }

    /// Validates values against `values.schema.json` as helm does before
    /// rendering; every violation is listed with its location.
    pub fn validate_values(&self, values: &serde_yaml::Value) -> Result<(), Error> {
        let Some(schema) = &self.schema else {
            return Ok(());
        };
        let path = self.dir.join("values.schema.json");
        let validator = jsonschema::validator_for(schema).map_err(|e| Error::Schema {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let instance = serde_json::to_value(values).map_err(|e| Error::Schema {
            path,
            message: format!("values are not representable as JSON: {e}"),
        })?;
        let errors: Vec<String> = validator
            .iter_errors(&instance)
            .map(|e| {
                let at = e.instance_path().to_string();
                format!("at '{}': {e}", if at.is_empty() { "/" } else { &at })
            })
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(Error::Values {
                chart: self
                    .metadata
                    .get("name")
                    .and_then(|n| n.as_str())
                    .unwrap_or("chart")
                    .to_owned(),
                errors,
            })
        }
    }

    /// The chart's default values deep-merged with `overrides` (Helm's
    /// `-f`/`--set` semantics: maps merge, everything else replaces, an
    /// explicit null deletes the key).
    pub fn merged_values(&self, overrides: &serde_yaml::Value) -> serde_yaml::Value {
        let mut values = self.values.clone();
        merge(&mut values, overrides);
        values
    }

    /// Renders every template with the merged values and returns the
    /// non-empty YAML documents in template-name order.
    pub fn render(
        &self,
        overrides: &serde_yaml::Value,
        release: &Release,
    ) -> Result<Vec<Document>, Error> {
        self.render_in(overrides, release, &Cluster::new())
    }

    /// [`Chart::render`] against a cluster `lookup` reads from.
    pub fn render_in(
        &self,
        overrides: &serde_yaml::Value,
        release: &Release,
        cluster: &Cluster,
    ) -> Result<Vec<Document>, Error> {
        let values = self.merged_values(overrides);
        self.validate_values(&values)?;
        let ctx = self.context(&values, release);
        self.install_thread_state(cluster);

        let mut docs = Vec::new();
        for (name, source) in &self.templates {
            let out = render_source(name, &self.helpers, source, ctx.clone())?;
            let out = out.replace("<no value>", "");
            for doc in split_documents(&out) {
                docs.push(Document {
                    template: name.clone(),
                    yaml: doc,
                });
            }
        }
        Ok(docs)
    }

    /// Renders `NOTES.txt` (the text Helm prints after an install); empty
    /// when the chart has none.
    pub fn render_notes(
        &self,
        overrides: &serde_yaml::Value,
        release: &Release,
    ) -> Result<String, Error> {
        let Some(source) = &self.notes else {
            return Ok(String::new());
        };
        let values = self.merged_values(overrides);
        self.validate_values(&values)?;
        let ctx = self.context(&values, release);
        self.install_thread_state(&Cluster::new());
        let out = render_source("NOTES.txt", &self.helpers, source, ctx)?;
        Ok(out.replace("<no value>", ""))
    }

    fn install_thread_state(&self, cluster: &Cluster) {
        HELPERS.with(|h| *h.borrow_mut() = self.helpers.clone());
        FILES.with(|f| *f.borrow_mut() = self.files.clone());
        CLUSTER.with(|c| *c.borrow_mut() = cluster.clone());
    }

    fn context(&self, values: &serde_yaml::Value, release: &Release) -> Value {
        let meta = |key: &str| {
            self.metadata
                .get(key)
                .map(yaml_to_value)
                .unwrap_or(Value::NoValue)
        };
        let mut chart = HashMap::new();
        chart.insert("Name".to_owned(), meta("name"));
        chart.insert("Version".to_owned(), meta("version"));
        chart.insert("AppVersion".to_owned(), meta("appVersion"));

        let mut rel = HashMap::new();
        rel.insert("Name".to_owned(), Value::from(release.name.as_str()));
        rel.insert(
            "Namespace".to_owned(),
            Value::from(release.namespace.as_str()),
        );
        rel.insert("Service".to_owned(), Value::from("Helm"));

        let mut root = HashMap::new();
        root.insert("Values".to_owned(), yaml_to_value(values));
        root.insert("Chart".to_owned(), Value::Map(chart));
        root.insert("Release".to_owned(), Value::Map(rel));
        Value::Map(root)
    }
}

thread_local! {
    // `include` is a plain function pointer in gtmpl, so the named templates
    // it may call are handed over through the rendering thread.
    static HELPERS: RefCell<String> = const { RefCell::new(String::new()) };
    // The same for `.Files.Get` and `lookup`.
    static FILES: RefCell<BTreeMap<String, String>> = const { RefCell::new(BTreeMap::new()) };
    static CLUSTER: RefCell<Cluster> = const { RefCell::new(BTreeMap::new()) };
}

/// Paths of the chart that are not `.Files`: metadata, values, schema,
/// templates and subcharts.
fn is_chart_metadata(rel: &str) -> bool {
    matches!(
        rel,
        "Chart.yaml" | "Chart.lock" | "values.yaml" | "values.schema.json" | ".helmignore"
    ) || rel.starts_with("templates/")
        || rel.starts_with("charts/")
}

/// Reads the chart's files (following symbolic links, as helm does).
fn collect_files(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) -> Result<(), Error> {
    let io = |source| Error::Io {
        path: dir.to_owned(),
        source,
    };
    let mut entries: Vec<_> = fs::read_dir(dir)
        .map_err(io)?
        .collect::<Result<_, _>>()
        .map_err(io)?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let rel = path
            .strip_prefix(root)
            .unwrap_or(&path)
            .to_string_lossy()
            .replace('\\', "/");
        if is_chart_metadata(&rel) {
            continue;
        }
        if path.is_dir() {
            collect_files(root, &path, out)?;
        } else if let Ok(text) = fs::read_to_string(&path) {
            out.insert(rel, text);
        }
    }
    Ok(())
}

/// The Helm/Sprig functions the chart may use, beyond Go's builtins.
pub const FUNCS: &[(&str, Func)] = &[
    ("include", include),
    ("required", required),
    ("fail", fail),
    ("default", default),
    ("empty", empty),
    ("quote", quote),
    ("toYaml", to_yaml),
    ("nindent", nindent),
    ("indent", indent),
    ("join", join),
    ("trunc", trunc),
    ("trimSuffix", trim_suffix),
    ("contains", contains),
    ("int", int),
    ("sub", sub),
    ("toString", to_string_fn),
    ("sha256sum", sha256sum),
    ("filesGet", files_get),
    ("lookup", lookup),
    ("dig", dig),
    ("dict", dict),
    ("keys", keys),
    ("sortAlpha", sort_alpha),
];

fn render_source(name: &str, helpers: &str, source: &str, ctx: Value) -> Result<String, Error> {
    let mut tmpl = Template::with_name(name);
    tmpl.add_funcs(FUNCS);
    // Helm's `.Files.Get "p"` is a method call; gtmpl has only functions.
    let source = source
        .replace("$.Files.Get ", "filesGet ")
        .replace(".Files.Get ", "filesGet ");
    let text = format!("{helpers}{source}");
    tmpl.parse(&text).map_err(|e| Error::Parse {
        template: name.to_owned(),
        message: e.to_string(),
    })?;
    tmpl.render(&Context::from(ctx)).map_err(|e| Error::Render {
        template: name.to_owned(),
        message: e.to_string(),
    })
}

/// Splits rendered output on `---` lines, dropping documents that hold only
/// whitespace and comments (as Helm does).
pub fn split_documents(text: &str) -> Vec<String> {
    let mut docs = Vec::new();
    let mut cur = String::new();
    let mut flush = |cur: &mut String| {
        let meaningful = cur
            .lines()
            .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
        if meaningful {
            docs.push(std::mem::take(cur));
        } else {
            cur.clear();
        }
    };
    for line in text.lines() {
        if line.trim_end() == "---" {
            flush(&mut cur);
        } else {
            cur.push_str(line);
            cur.push('\n');
        }
    }
    flush(&mut cur);
    docs
}

/// Deep-merges `over` into `base` with Helm semantics.
pub fn merge(base: &mut serde_yaml::Value, over: &serde_yaml::Value) {
    match (base, over) {
        (serde_yaml::Value::Mapping(b), serde_yaml::Value::Mapping(o)) => {
            for (k, v) in o {
                if v.is_null() {
                    b.remove(k);
                } else if let Some(existing) = b.get_mut(k) {
                    merge(existing, v);
                } else {
                    b.insert(k.clone(), v.clone());
                }
            }
        }
        (b, o) => *b = o.clone(),
    }
}

/// Converts YAML to a template value. Numbers keep their integer-ness.
pub fn yaml_to_value(v: &serde_yaml::Value) -> Value {
    match v {
        serde_yaml::Value::Null => Value::Nil,
        serde_yaml::Value::Bool(b) => Value::Bool(*b),
        serde_yaml::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_yaml::Value::String(s) => Value::from(s.as_str()),
        serde_yaml::Value::Sequence(s) => Value::Array(s.iter().map(yaml_to_value).collect()),
        serde_yaml::Value::Mapping(m) => Value::Map(
            m.iter()
                .map(|(k, v)| (yaml_key(k), yaml_to_value(v)))
                .collect(),
        ),
        serde_yaml::Value::Tagged(t) => yaml_to_value(&t.value),
    }
}

fn yaml_key(k: &serde_yaml::Value) -> String {
    match k {
        serde_yaml::Value::String(s) => s.clone(),
        other => serde_yaml::to_string(other)
            .map(|s| s.trim_end().to_owned())
            .unwrap_or_default(),
    }
}

/// Converts a template value back to YAML; maps come out key-sorted, as
/// Helm's `toYaml` emits them.
pub fn value_to_yaml(v: &Value) -> serde_yaml::Value {
    match v {
        Value::NoValue | Value::Nil | Value::Function(_) => serde_yaml::Value::Null,
        Value::Bool(b) => serde_yaml::Value::Bool(*b),
        Value::String(s) => serde_yaml::Value::String(s.clone()),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                serde_yaml::Value::from(i)
            } else if let Some(u) = n.as_u64() {
                serde_yaml::Value::from(u)
            } else {
                serde_yaml::Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Value::Array(a) => serde_yaml::Value::Sequence(a.iter().map(value_to_yaml).collect()),
        Value::Map(m) | Value::Object(m) => {
            let sorted: BTreeMap<&String, &Value> = m.iter().collect();
            let mut out = serde_yaml::Mapping::new();
            for (k, v) in sorted {
                out.insert(serde_yaml::Value::String(k.clone()), value_to_yaml(v));
            }
            serde_yaml::Value::Mapping(out)
        }
    }
}

fn arg<'a>(name: &str, args: &'a [Value], i: usize, n: usize) -> Result<&'a Value, FuncError> {
    if args.len() != n {
        return Err(FuncError::ExactlyXArgs(name.to_owned(), n));
    }
    args.get(i)
        .ok_or_else(|| FuncError::ExactlyXArgs(name.to_owned(), n))
}

fn as_str(name: &str, v: &Value) -> Result<String, FuncError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::NoValue | Value::Nil => Ok(String::new()),
        Value::Number(_) | Value::Bool(_) => Ok(v.to_string()),
        other => Err(FuncError::Generic(format!(
            "{name}: expected a string, got {other:?}"
        ))),
    }
}

fn as_int(name: &str, v: &Value) -> Result<i64, FuncError> {
    match v {
        Value::Number(n) => n
            .as_i64()
            .or_else(|| n.as_f64().map(|f| f as i64))
            .ok_or_else(|| FuncError::Generic(format!("{name}: {n:?} is not an integer"))),
        Value::String(s) => s
            .trim()
            .parse()
            .map_err(|_| FuncError::Generic(format!("{name}: {s:?} is not an integer"))),
        other => Err(FuncError::Generic(format!(
            "{name}: expected an integer, got {other:?}"
        ))),
    }
}

/// Sprig's notion of "empty": nil, false, 0, "", and empty collections.
fn is_empty(v: &Value) -> bool {
    match v {
        Value::NoValue | Value::Nil => true,
        Value::Bool(b) => !*b,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Map(m) | Value::Object(m) => m.is_empty(),
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::Function(_) => false,
    }
}

fn include(args: &[Value]) -> Result<Value, FuncError> {
    let name = as_str("include", arg("include", args, 0, 2)?)?;
    let ctx = arg("include", args, 1, 2)?.clone();
    let helpers = HELPERS.with(|h| h.borrow().clone());
    let source = format!("{{{{ template {} . }}}}", json_quote(&name));
    render_source(&format!("include {name}"), &helpers, &source, ctx)
        .map(|s| Value::from(s.replace("<no value>", "")))
        .map_err(|e| FuncError::Generic(e.to_string()))
}

fn required(args: &[Value]) -> Result<Value, FuncError> {
    let msg = as_str("required", arg("required", args, 0, 2)?)?;
    let val = arg("required", args, 1, 2)?;
    match val {
        Value::NoValue | Value::Nil => Err(FuncError::Generic(msg)),
        Value::String(s) if s.is_empty() => Err(FuncError::Generic(msg)),
        v => Ok(v.clone()),
    }
}

fn fail(args: &[Value]) -> Result<Value, FuncError> {
    Err(FuncError::Generic(as_str(
        "fail",
        arg("fail", args, 0, 1)?,
    )?))
}

fn default(args: &[Value]) -> Result<Value, FuncError> {
    // `x | default "d"` arrives as ["d", x]; a bare `default "d"` as ["d"].
    match args {
        [d] => Ok(d.clone()),
        [d, given] => Ok(if is_empty(given) {
            d.clone()
        } else {
            given.clone()
        }),
        _ => Err(FuncError::AtLeastXArgs("default".to_owned(), 1)),
    }
}

fn empty(args: &[Value]) -> Result<Value, FuncError> {
    Ok(Value::Bool(is_empty(arg("empty", args, 0, 1)?)))
}

fn json_quote(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""))
}

fn quote(args: &[Value]) -> Result<Value, FuncError> {
    let mut parts = Vec::new();
    for a in args {
        if matches!(a, Value::NoValue | Value::Nil) {
            continue;
        }
        parts.push(json_quote(&as_str("quote", a)?));
    }
    Ok(Value::from(parts.join(" ")))
}

fn to_yaml(args: &[Value]) -> Result<Value, FuncError> {
    let v = arg("toYaml", args, 0, 1)?;
    let y = value_to_yaml(v);
    let s = serde_yaml::to_string(&y).map_err(|e| FuncError::Generic(format!("toYaml: {e}")))?;
    // Helm trims the trailing newline so `toYaml | nindent` composes.
    Ok(Value::from(s.trim_end_matches('\n')))
}

fn indent_lines(n: i64, s: &str) -> String {
    let pad = " ".repeat(usize::try_from(n).unwrap_or(0));
    let mut out = String::new();
    for (i, line) in s.split('\n').enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let _ = write!(out, "{pad}{line}");
    }
    out
}

fn nindent(args: &[Value]) -> Result<Value, FuncError> {
    let n = as_int("nindent", arg("nindent", args, 0, 2)?)?;
    let s = as_str("nindent", arg("nindent", args, 1, 2)?)?;
    Ok(Value::from(format!("\n{}", indent_lines(n, &s))))
}

fn indent(args: &[Value]) -> Result<Value, FuncError> {
    let n = as_int("indent", arg("indent", args, 0, 2)?)?;
    let s = as_str("indent", arg("indent", args, 1, 2)?)?;
    Ok(Value::from(indent_lines(n, &s)))
}

fn join(args: &[Value]) -> Result<Value, FuncError> {
    let sep = as_str("join", arg("join", args, 0, 2)?)?;
    match arg("join", args, 1, 2)? {
        Value::Array(items) => {
            let parts = items
                .iter()
                .map(|i| as_str("join", i))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Value::from(parts.join(&sep)))
        }
        Value::NoValue | Value::Nil => Ok(Value::from("")),
        other => Ok(Value::from(as_str("join", other)?)),
    }
}

fn trunc(args: &[Value]) -> Result<Value, FuncError> {
    let n = as_int("trunc", arg("trunc", args, 0, 2)?)?;
    let s = as_str("trunc", arg("trunc", args, 1, 2)?)?;
    let n = usize::try_from(n).unwrap_or(0);
    Ok(Value::from(s.chars().take(n).collect::<String>()))
}

fn trim_suffix(args: &[Value]) -> Result<Value, FuncError> {
    let suffix = as_str("trimSuffix", arg("trimSuffix", args, 0, 2)?)?;
    let s = as_str("trimSuffix", arg("trimSuffix", args, 1, 2)?)?;
    Ok(Value::from(s.strip_suffix(&suffix).unwrap_or(&s)))
}

/// Sprig's `contains SUBSTR S`: whether S holds SUBSTR.
fn contains(args: &[Value]) -> Result<Value, FuncError> {
    let needle = as_str("contains", arg("contains", args, 0, 2)?)?;
    let s = as_str("contains", arg("contains", args, 1, 2)?)?;
    Ok(Value::Bool(s.contains(&needle)))
}

fn int(args: &[Value]) -> Result<Value, FuncError> {
    let v = arg("int", args, 0, 1)?;
    if matches!(v, Value::NoValue | Value::Nil) {
        return Ok(Value::from(0i64));
    }
    Ok(Value::from(as_int("int", v)?))
}

/// Sprig's `sub A B`: A - B as 64-bit integers.
fn sub(args: &[Value]) -> Result<Value, FuncError> {
    let a = as_int("sub", arg("sub", args, 0, 2)?)?;
    let b = as_int("sub", arg("sub", args, 1, 2)?)?;
    Ok(Value::from(a.wrapping_sub(b)))
}

fn to_string_fn(args: &[Value]) -> Result<Value, FuncError> {
    Ok(Value::from(as_str(
        "toString",
        arg("toString", args, 0, 1)?,
    )?))
}

fn sha256sum(args: &[Value]) -> Result<Value, FuncError> {
    let s = as_str("sha256sum", arg("sha256sum", args, 0, 1)?)?;
    Ok(Value::from(hex::encode(Sha256::digest(s.as_bytes()))))
}

/// `.Files.Get "path"`: the file's content, or "" when the chart has none
/// (as helm answers).
fn files_get(args: &[Value]) -> Result<Value, FuncError> {
    let path = as_str("Files.Get", arg("Files.Get", args, 0, 1)?)?;
    Ok(Value::from(FILES.with(|f| {
        f.borrow().get(&path).cloned().unwrap_or_default()
    })))
}

/// `lookup apiVersion kind namespace name`: the object from [`Cluster`], or
/// an empty map when it does not exist (helm's answer, and all that
/// `helm template` ever sees).
fn lookup(args: &[Value]) -> Result<Value, FuncError> {
    let mut key = Vec::new();
    for i in 0..4 {
        key.push(as_str("lookup", arg("lookup", args, i, 4)?)?);
    }
    let key = (
        key[0].clone(),
        key[1].clone(),
        key[2].clone(),
        key[3].clone(),
    );
    Ok(CLUSTER.with(|c| {
        c.borrow()
            .get(&key)
            .map(yaml_to_value)
            .unwrap_or_else(|| Value::Map(HashMap::new()))
    }))
}

/// Sprig's `dig "k1" "k2" default map`: walks nested maps, else the default.
fn dig(args: &[Value]) -> Result<Value, FuncError> {
    if args.len() < 3 {
        return Err(FuncError::AtLeastXArgs("dig".to_owned(), 3));
    }
    let (keys, rest) = args.split_at(args.len() - 2);
    let (default, mut cur) = (&rest[0], &rest[1]);
    for k in keys {
        let k = as_str("dig", k)?;
        match cur {
            Value::Map(m) | Value::Object(m) => match m.get(&k) {
                Some(v) => cur = v,
                None => return Ok(default.clone()),
            },
            _ => return Ok(default.clone()),
        }
    }
    Ok(cur.clone())
}

/// Sprig's `dict "k1" v1 "k2" v2`.
fn dict(args: &[Value]) -> Result<Value, FuncError> {
    let pairs = args.chunks_exact(2);
    if !pairs.remainder().is_empty() {
        return Err(FuncError::Generic(
            "dict: expected key/value pairs".to_owned(),
        ));
    }
    let mut m = HashMap::new();
    for pair in pairs {
        m.insert(as_str("dict", &pair[0])?, pair[1].clone());
    }
    Ok(Value::Map(m))
}

/// Sprig's `keys map...`: the maps' keys, in no particular order (Go's map
/// order, like Sprig); pipe through `sortAlpha` for a stable one.
fn keys(args: &[Value]) -> Result<Value, FuncError> {
    if args.is_empty() {
        return Err(FuncError::AtLeastXArgs("keys".to_owned(), 1));
    }
    let mut out = Vec::new();
    for a in args {
        match a {
            Value::Map(m) | Value::Object(m) => out.extend(m.keys().cloned().map(Value::from)),
            Value::NoValue | Value::Nil => {}
            other => {
                return Err(FuncError::Generic(format!(
                    "keys: expected a map, got {other:?}"
                )))
            }
        }
    }
    Ok(Value::Array(out))
}

/// Sprig's `sortAlpha list`: the items as strings, sorted.
fn sort_alpha(args: &[Value]) -> Result<Value, FuncError> {
    let mut items = match arg("sortAlpha", args, 0, 1)? {
        Value::Array(items) => items
            .iter()
            .map(|i| as_str("sortAlpha", i))
            .collect::<Result<Vec<_>, _>>()?,
        Value::NoValue | Value::Nil => Vec::new(),
        other => vec![as_str("sortAlpha", other)?],
    };
    items.sort_unstable();
    Ok(Value::Array(items.into_iter().map(Value::from).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, values: &str) -> Result<String, Error> {
        let v: serde_yaml::Value = serde_yaml::from_str(values).unwrap();
        let mut root = HashMap::new();
        root.insert("Values".to_owned(), yaml_to_value(&v));
        HELPERS.with(|h| {
            *h.borrow_mut() = r#"{{- define "greet" -}}hi {{ .name }}{{- end -}}"#.to_owned()
        });
        let helpers = HELPERS.with(|h| h.borrow().clone());
        render_source("t", &helpers, src, Value::Map(root))
    }

    #[test]
    fn go_template_constructs() {
        let out = render(
            "a: {{ .Values.a | quote }}\n{{- if .Values.b }}\nb: yes\n{{- else }}\nb: no\n{{- end }}\nl:{{ range .Values.l }} {{ . }}{{ end }}\n",
            "a: x\nb: false\nl: [1, 2]\n",
        )
        .unwrap();
        assert_eq!(out, "a: \"x\"\nb: no\nl: 1 2\n");
    }

    #[test]
    fn helm_functions() {
        let out = render(
            "{{ include \"greet\" .Values }}|{{ .Values.missing | default \"d\" }}|{{ join \",\" .Values.l }}|{{ .Values.m | toYaml | nindent 2 }}",
            "name: bob\nl: [p, q]\nm: {z: 1, a: [x]}\n",
        )
        .unwrap();
        assert_eq!(out, "hi bob|d|p,q|\n  a:\n  - x\n  z: 1");
    }

    #[test]
    fn contains_finds_a_substring() {
        let out = render(
            "{{ if contains \"?\" .Values.u }}q{{ else }}n{{ end }}{{ contains \"x\" .Values.v }}",
            "u: a?b\nv: abc\n",
        )
        .unwrap();
        assert_eq!(out, "qfalse");
    }

    #[test]
    fn required_and_fail_abort_with_the_message() {
        let err = render("{{ required \"need x\" .Values.x }}", "y: 1\n").unwrap_err();
        assert!(err.to_string().contains("need x"), "{err}");
        let err = render("{{ required \"need x\" .Values.x }}", "x: \"\"\n").unwrap_err();
        assert!(err.to_string().contains("need x"), "{err}");
        let err = render("{{ fail \"boom\" }}", "{}\n").unwrap_err();
        assert!(err.to_string().contains("boom"), "{err}");
    }

    #[test]
    fn merge_follows_helm() {
        let mut base: serde_yaml::Value =
            serde_yaml::from_str("a: {b: 1, c: 2}\nd: [1]\n").unwrap();
        let over: serde_yaml::Value =
            serde_yaml::from_str("a: {b: 5, c: null}\nd: [2, 3]\n").unwrap();
        merge(&mut base, &over);
        let want: serde_yaml::Value = serde_yaml::from_str("a: {b: 5}\nd: [2, 3]\n").unwrap();
        assert_eq!(base, want);
    }

    #[test]
    fn files_get_lookup_dig_and_dict() {
        FILES.with(|f| {
            *f.borrow_mut() = [("files/a.txt".to_owned(), "hello".to_owned())]
                .into_iter()
                .collect()
        });
        let secret: serde_yaml::Value = serde_yaml::from_str("data: {k: djE=}\n").unwrap();
        CLUSTER.with(|c| {
            *c.borrow_mut() = [(
                ("v1".into(), "Secret".into(), "ns".into(), "s".into()),
                secret,
            )]
            .into_iter()
            .collect()
        });
        let out = render(
            concat!(
                "{{ .Files.Get \"files/a.txt\" }}|{{ $.Files.Get \"files/none\" }}|",
                "{{ dig \"data\" \"k\" \"-\" (lookup \"v1\" \"Secret\" \"ns\" \"s\") }}|",
                "{{ dig \"data\" \"k\" \"-\" (lookup \"v1\" \"Secret\" \"ns\" \"other\") }}|",
                "{{ include \"greet\" (dict \"name\" \"ann\") }}"
            ),
            "{}\n",
        )
        .unwrap();
        assert_eq!(out, "hello||djE=|-|hi ann");
    }

    #[test]
    fn keys_sort_alpha_and_index_walk_a_map_in_order() {
        // Go's map order is random: only `keys | sortAlpha` is stable.
        let src = "{{- $m := .Values.m -}}{{- range $i, $k := keys $m | sortAlpha -}}{{ if $i }},{{ end }}{{ $k }}={{ index $m $k }}{{- end -}}";
        for _ in 0..8 {
            let out = render(src, "m: {pve3: c, pve1: a, pve10: d, pve2: b}\n").unwrap();
            assert_eq!(out, "pve1=a,pve10=d,pve2=b,pve3=c");
        }
        assert_eq!(render(src, "m: {}\n").unwrap(), "");
        assert!(render("{{ keys .Values.l }}", "l: [1]\n").is_err());
    }

    #[test]
    fn split_drops_empty_documents() {
        let docs = split_documents("---\n# only a comment\n---\na: 1\n---\n\n");
        assert_eq!(docs, vec!["a: 1\n".to_owned()]);
    }
}
