//! Turning a complete answer into a value or a [`PveError`]: the `data`
//! envelope of a 2xx body, and the message and per-parameter reasons of any
//! other status. Pure functions of the bytes received.

use std::collections::BTreeMap;

use http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{Cause, PveError};

/// The `data` field of a 2xx body, as `T`.
pub(super) fn decode_data<T: DeserializeOwned>(
    op: &'static str,
    bytes: &[u8],
) -> Result<T, PveError> {
    let mut v: Value = serde_json::from_slice(bytes).map_err(|e| PveError::Decode {
        op,
        message: format!("body is not JSON: {e}"),
        source: Some(Cause::new(e)),
    })?;
    let data = match v.get_mut("data") {
        Some(d) => d.take(),
        None => {
            return Err(PveError::Decode {
                op,
                message: "body has no \"data\" field".into(),
                source: None,
            })
        }
    };
    serde_json::from_value(data).map_err(|e| PveError::Decode {
        op,
        message: e.to_string(),
        source: Some(Cause::new(e)),
    })
}

/// Builds [`PveError::Api`]: the message comes from the body's `message` field
/// (newer PVE) or else the HTTP reason phrase, where PVE puts it.
pub(super) fn api_error(status: StatusCode, ext: &http::Extensions, bytes: &[u8]) -> PveError {
    let body: Option<Value> = serde_json::from_slice(bytes).ok();
    let body_msg = body
        .as_ref()
        .and_then(|b| b.get("message"))
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string);
    let reason = ext
        .get::<hyper::ext::ReasonPhrase>()
        .map(|r| String::from_utf8_lossy(r.as_bytes()).trim().to_string())
        .filter(|s| !s.is_empty());
    let message = body_msg
        .or(reason)
        .or_else(|| status.canonical_reason().map(str::to_string))
        .unwrap_or_else(|| format!("HTTP {}", status.as_u16()));
    let mut param_errors = BTreeMap::new();
    if let Some(Value::Object(errs)) = body.as_ref().and_then(|b| b.get("errors")) {
        for (k, v) in errs {
            let text = match v {
                Value::String(s) => s.trim().to_string(),
                other => other.to_string(),
            };
            param_errors.insert(k.clone(), text);
        }
    }
    PveError::Api {
        status: status.as_u16(),
        message,
        param_errors,
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn api_error_prefers_body_message_then_reason() {
        let mut ext = http::Extensions::new();
        ext.insert(hyper::ext::ReasonPhrase::from_static(
            b"VM 1 already exists",
        ));
        let e = api_error(StatusCode::INTERNAL_SERVER_ERROR, &ext, br#"{"data":null}"#);
        assert!(e.is_already_exists(), "{e}");
        let e = api_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &ext,
            br#"{"data":null,"message":"full text\n"}"#,
        );
        assert_eq!(e.to_string(), "PVE API error 500: full text");
        let e = api_error(StatusCode::NOT_FOUND, &http::Extensions::new(), b"");
        assert_eq!(e.to_string(), "PVE API error 404: Not Found");
    }

    #[test]
    fn decode_failures_keep_the_parser_error() {
        let e = decode_data::<u32>("nodes", b"<html>").unwrap_err();
        assert!(e.to_string().contains("body is not JSON"), "{e}");
        let source = e.source().expect("a decode failure has a cause");
        assert!(
            source.downcast_ref::<serde_json::Error>().is_some(),
            "{e:?}"
        );

        let e = decode_data::<u32>("nextid", br#"{"data":"x"}"#).unwrap_err();
        assert!(e
            .source()
            .is_some_and(|s| s.downcast_ref::<serde_json::Error>().is_some()));

        // No parser complained: the envelope is missing.
        let e = decode_data::<u32>("nodes", br#"{"other":1}"#).unwrap_err();
        assert_eq!(
            e.to_string(),
            "unexpected PVE response for nodes: body has no \"data\" field"
        );
        assert!(e.source().is_none());
    }
}
