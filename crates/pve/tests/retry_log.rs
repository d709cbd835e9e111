//! A retried call is an INFO line per retry saying what (op, method,
//! path), where (the API's URL), which attempt of how many, and when the
//! next try comes: what the log of a pod that is live but not ready has to
//! say while it waits on the cluster.
//!
//! A binary of its own: it reads the events of one callsite, and tracing
//! caches each callsite's interest for the whole process, so another test
//! emitting the same line at the same moment could hide it from this one.

use std::time::Duration;

use pve::{PveClient, PveConfig, RetryPolicy};

#[tokio::test]
async fn each_retry_is_an_info_line_with_what_where_and_when() {
    let logs = provider_testkit::logs::capture();
    // A port nothing listens on: every attempt is refused at once, and a
    // refused connection is retried.
    let port = {
        let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        held.local_addr().expect("addr").port()
    };
    let url = format!("https://127.0.0.1:{port}/api2/json");
    let mut cfg = PveConfig::new(&url, "bigfleet@pve!autoscaler", "secret");
    cfg.fingerprints = vec![[0xAB; 32]];
    cfg.retry = RetryPolicy {
        max_attempts: 3,
        initial_backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(5),
    };
    let client = PveClient::new(cfg).expect("client");
    client.nodes().await.expect_err("nothing listens");
    let retries: Vec<_> = logs
        .events()
        .into_iter()
        .filter(|e| e.message == "retrying PVE call")
        .collect();
    assert_eq!(retries.len(), 2, "3 attempts, 2 retries: {retries:?}");
    for (i, e) in retries.iter().enumerate() {
        assert_eq!(e.level, tracing::Level::INFO, "{e:?}");
        assert_eq!(e.field("op"), Some("nodes"), "{e:?}");
        assert_eq!(e.field("method"), Some("GET"), "{e:?}");
        assert_eq!(e.field("path"), Some("/nodes"), "{e:?}");
        assert!(
            e.field("url")
                .is_some_and(|u| u.contains(&format!("127.0.0.1:{port}"))),
            "{e:?}"
        );
        let attempt = (i + 1).to_string();
        assert_eq!(e.field("attempt"), Some(attempt.as_str()), "{e:?}");
        assert_eq!(e.field("max_attempts"), Some("3"), "{e:?}");
        assert!(e.field("next_try_in_ms").is_some(), "{e:?}");
        assert!(e.field("error").is_some(), "{e:?}");
    }
}
