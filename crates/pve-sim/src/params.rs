//! Request parameters as PVE sees them: a multimap merged from the query string,
//! the body (form-urlencoded or JSON) and the path. Arrays are repeated keys.

use std::collections::BTreeMap;

use serde::Serialize;

/// Parameters of one request; values are kept as the strings PVE would parse.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Params(pub BTreeMap<String, Vec<String>>);

impl Params {
    /// Append a value for `key` (repeated keys form an array).
    pub fn push(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.0.entry(key.into()).or_default().push(value.into());
    }

    /// First value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.first()).map(String::as_str)
    }

    /// All values of `key`.
    pub fn all(&self, key: &str) -> &[String] {
        self.0.get(key).map(Vec::as_slice).unwrap_or(&[])
    }

    pub fn contains(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }

    /// PVE boolean (`1/0/true/false/yes/no/on/off`); `None` when absent.
    /// Values were validated against the schema before handlers read them.
    pub fn bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(parse_bool)
    }

    pub fn u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(|v| v.trim().parse().ok())
    }

    /// Parse a form-urlencoded string, appending to `self`. With
    /// `semicolon_separates`, a raw `;` separates pairs like `&` (as PVE's form
    /// decoding does), so a value containing `;` must be sent as `%3B`.
    pub fn extend_form(&mut self, input: &[u8], semicolon_separates: bool) {
        let pieces: Vec<&[u8]> = if semicolon_separates {
            input.split(|b| *b == b'&' || *b == b';').collect()
        } else {
            vec![input]
        };
        for piece in pieces {
            for (k, v) in form_urlencoded::parse(piece) {
                self.push(k.into_owned(), v.into_owned());
            }
        }
    }

    /// Merge a JSON object body: arrays become repeated keys, scalars strings.
    pub fn extend_json(&mut self, body: &serde_json::Value) -> Result<(), String> {
        let obj = body
            .as_object()
            .ok_or_else(|| "JSON body must be an object".to_string())?;
        for (k, v) in obj {
            match v {
                serde_json::Value::Array(items) => {
                    // An empty array still names the key, so "required" checks see it.
                    self.0.entry(k.clone()).or_default();
                    for item in items {
                        self.push(k.clone(), json_scalar(item)?);
                    }
                }
                serde_json::Value::Null => {}
                other => self.push(k.clone(), json_scalar(other)?),
            }
        }
        Ok(())
    }
}

fn json_scalar(v: &serde_json::Value) -> Result<String, String> {
    match v {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Number(n) => Ok(n.to_string()),
        serde_json::Value::Bool(b) => Ok(if *b { "1" } else { "0" }.to_string()),
        _ => Err("nested JSON values are not supported".to_string()),
    }
}

/// PVE's boolean parser.
pub fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}
