//! Test support shared across the workspace's tests. Each user names the
//! parts it needs as features, so that the crates that know nothing of
//! BigFleet (pve, pve-sim) build none of ours.
//!
//! With `provider`, what everything that boots the provider binary needs
//! (its own tests, the crash campaign, the deployment checks, the load
//! generator): the one start-up line the binary logs once it serves; and
//! an in-process engine with short deadlines (`engine`). The
//! certification runner does not use this on purpose: it is a black-box
//! client and waits for a List to answer, as the published runner does.
//!
//! Always: the fields read off a log line, in either log format; a GET to
//! the probes and `/metrics` ([`http`]); awaiting a condition instead of
//! sleeping ([`wait`]); the `tracing` events code under test emits
//! ([`logs`]); what the host has ([`host`]); a skip made visible ([`skip`]).
//!
//! With `proptest`, the fuzz targets' shared generators (`fuzz`).
//!
//! With `store-contract`, the `Store` contract suite every durable store
//! runs (`store_contract`). With `postgres`, a schema of its own per test in
//! the PostgreSQL test server named by `BIGFLEET_TEST_POSTGRES_URL`
//! (`postgres`).

#[cfg(feature = "provider")]
pub mod engine;
#[cfg(feature = "proptest")]
pub mod fuzz;
pub mod host;
pub mod http;
pub mod logs;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod skip;
#[cfg(feature = "store-contract")]
pub mod store_contract;
pub mod wait;

use std::net::SocketAddr;

/// The message of the line the provider logs once its gRPC listener
/// accepts calls (`msg="serving CapacityProvider"` with `addr=`,
/// `metrics_addr=`, ...).
#[cfg(feature = "provider")]
pub const STARTUP_LINE: &str = providerkit::service::STARTUP_MESSAGE;

/// Whether `line` is the start-up line, in the key=value or the JSON format.
#[cfg(feature = "provider")]
pub fn is_startup_line(line: &str) -> bool {
    line.contains(STARTUP_LINE)
}

/// The value of `key` on a log line: `key=value`, `key="quoted value"`, or
/// a JSON line's top-level or `fields` member.
pub fn field(line: &str, key: &str) -> Option<String> {
    if line.trim_start().starts_with('{') {
        let json: serde_json::Value = serde_json::from_str(line).ok()?;
        let v = json.get(key).or_else(|| json.get("fields")?.get(key))?;
        return Some(match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        });
    }
    let needle = format!(" {key}=");
    let start = line.find(&needle)? + needle.len();
    let rest = &line[start..];
    match rest.strip_prefix('"') {
        Some(quoted) => unquote(quoted),
        None => Some(rest.split(' ').next().unwrap_or(rest).to_string()),
    }
}

/// A quoted key=value value up to its closing quote, with the logfmt
/// writer's escapes (`\"`, `\\`, `\n`) undone; None if it never closes.
fn unquote(quoted: &str) -> Option<String> {
    let mut out = String::new();
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
    None
}

/// A socket address field of the start-up line (`addr`, `metrics_addr`).
pub fn addr_field(line: &str, key: &str) -> Result<SocketAddr, String> {
    let value = field(line, key).ok_or_else(|| format!("the line has no {key}= field: {line}"))?;
    value
        .parse()
        .map_err(|_| format!("{key}={value:?} on the start-up line is not host:port"))
}

#[cfg(all(test, feature = "provider"))]
mod tests {
    use super::*;

    #[test]
    fn reads_both_log_formats() {
        let kv = format!(
            r#"ts=x level=info msg="{STARTUP_LINE}" addr=127.0.0.1:46493 provider=proxmox metrics_addr="unavailable (0.0.0.0:9090 in use)""#
        );
        assert!(is_startup_line(&kv));
        assert_eq!(
            addr_field(&kv, "addr"),
            Ok("127.0.0.1:46493".parse().unwrap())
        );
        assert_eq!(
            field(&kv, "metrics_addr").as_deref(),
            Some("unavailable (0.0.0.0:9090 in use)")
        );
        assert!(addr_field(&kv, "metrics_addr").is_err());
        let json = format!(
            r#"{{"level":"INFO","fields":{{"message":"{STARTUP_LINE}","addr":"127.0.0.1:9","offerings":4}}}}"#
        );
        assert!(is_startup_line(&json));
        assert_eq!(field(&json, "addr").as_deref(), Some("127.0.0.1:9"));
        assert_eq!(field(&json, "offerings").as_deref(), Some("4"));
        assert_eq!(field("no fields here", "addr"), None);
        let escaped =
            r#"ts=x level=error msg="invalid configuration" error="--addr \"x\" is \\ bad" k=v"#;
        assert_eq!(
            field(escaped, "error").as_deref(),
            Some(r#"--addr "x" is \ bad"#)
        );
        assert_eq!(field(escaped, "k").as_deref(), Some("v"));
        assert_eq!(field(r#"ts=x msg="open"#, "msg"), None);
    }
}
