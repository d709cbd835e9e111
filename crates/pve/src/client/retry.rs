//! Which failed attempts may be repeated ([`RetryPolicy`] and its rules) and
//! how long to wait before the next one. The loop that applies them is
//! `PveClient::call` in the sibling `request` module.

use std::time::Duration;

use http::Method;
use rand::Rng;

use crate::error::{is_lock_timeout_text, PveError};

/// Retry policy. Only safe cases are ever retried:
/// * any call failing with a lock timeout (nothing was applied);
/// * any call whose connection could not be established (nothing was sent);
/// * any call answered 595 (pveproxy could not connect to the node) or
///   `599 Too many redirections` (pveproxy's proxied connection was stale;
///   the node never saw the request);
/// * GETs on transport errors, request timeouts, 502-504 and 596/597.
///
/// A POST/PUT/DELETE that may have reached the server is never retried.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Total attempts including the first; `1` disables retries.
    pub max_attempts: u32,
    /// Backoff before the first retry; doubles per retry up to `max_backoff`.
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 4,
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(8),
        }
    }
}

impl RetryPolicy {
    /// No retries.
    pub fn none() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// Jittered exponential backoff before retry number `retry` (1-based):
    /// uniformly in `[d/2, d]` with `d = min(max, initial * 2^(retry-1))`.
    pub fn backoff(&self, retry: u32) -> Duration {
        let exp = retry.saturating_sub(1).min(30);
        let d = self
            .initial_backoff
            .saturating_mul(1u32 << exp)
            .min(self.max_backoff);
        let half = d / 2;
        let jitter_ns = u64::try_from((d - half).as_nanos()).unwrap_or(u64::MAX);
        let extra = if jitter_ns == 0 {
            0
        } else {
            rand::rng().random_range(0..=jitter_ns)
        };
        half + Duration::from_nanos(extra)
    }
}

fn is_get(m: &Method) -> bool {
    *m == Method::GET
}

/// Whether a failed attempt may be repeated without risking a double apply.
pub(super) fn retryable(method: &Method, e: &PveError) -> bool {
    match e {
        PveError::Api {
            status, message, ..
        } => {
            is_lock_timeout_text(message)
                // 595: pveproxy could not connect to the node, nothing was sent.
                || *status == 595
                || e.is_proxy_redirect_loop()
                || (is_get(method) && matches!(status, 502..=504 | 596 | 597))
        }
        PveError::Transport { connect: true, .. } => true,
        PveError::Transport { .. } | PveError::Timeout { .. } => is_get(method),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::error::Cause;

    #[test]
    fn backoff_is_bounded_and_jittered() {
        let p = RetryPolicy {
            max_attempts: 10,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(1000),
        };
        for _ in 0..50 {
            let b1 = p.backoff(1);
            assert!(b1 >= Duration::from_millis(50) && b1 <= Duration::from_millis(100));
            let b3 = p.backoff(3);
            assert!(b3 >= Duration::from_millis(200) && b3 <= Duration::from_millis(400));
            let b9 = p.backoff(9);
            assert!(b9 >= Duration::from_millis(500) && b9 <= Duration::from_millis(1000));
        }
        assert_eq!(RetryPolicy::none().max_attempts, 1);
    }

    #[test]
    fn retry_rules() {
        let cause = |m: &str| Cause::new(std::io::Error::other(m.to_string()));
        let lock = PveError::Api {
            status: 500,
            message: "can't lock file '/var/lock/qemu-server/lock-1.conf' - got timeout".into(),
            param_errors: BTreeMap::new(),
        };
        let unreachable = PveError::Api {
            status: 595,
            message: "no route".into(),
            param_errors: BTreeMap::new(),
        };
        let sent = PveError::Transport {
            op: "x",
            message: "reset".into(),
            connect: false,
            source: cause("reset"),
        };
        let not_sent = PveError::Transport {
            op: "x",
            message: "refused".into(),
            connect: true,
            source: cause("refused"),
        };
        let tls = PveError::Tls {
            op: "x",
            message: "bad".into(),
            source: cause("bad"),
        };
        assert!(retryable(&Method::POST, &lock));
        assert!(retryable(&Method::GET, &unreachable));
        assert!(
            retryable(&Method::POST, &unreachable),
            "595: never reached the node"
        );
        let lost = PveError::Api {
            status: 596,
            message: "Connection timed out".into(),
            param_errors: BTreeMap::new(),
        };
        assert!(retryable(&Method::GET, &lost));
        assert!(
            !retryable(&Method::POST, &lost),
            "596 may have been applied"
        );
        assert!(retryable(&Method::GET, &sent));
        assert!(!retryable(&Method::POST, &sent));
        assert!(retryable(&Method::POST, &not_sent));
        assert!(!retryable(&Method::GET, &tls));
        let redirect = PveError::Api {
            status: 599,
            message: "Too many redirections".into(),
            param_errors: BTreeMap::new(),
        };
        assert!(
            retryable(&Method::POST, &redirect),
            "599: the node never saw it"
        );
    }
}
