//! Transport limits and input caps, on the provider binary: the HTTP/2
//! stream limit is advertised, a connection that never sends a byte is
//! closed, and an oversized id is refused with a status a standard client
//! can read.

use std::io::Read;
use std::time::{Duration, Instant};

use bigfleet_proto::v1alpha1::{CreateRequest, MachineRef};
use provider_testkit::wait::Wait;

use crate::common::Provider;

#[tokio::test]
async fn max_concurrent_streams_is_advertised() {
    let provider = Provider::start(&["--use-fake-backend"]);
    let tcp = tokio::net::TcpStream::connect(provider.grpc).await.unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(async move {
        let _ = connection.await;
    });
    // The server's SETTINGS arrive right after the handshake; ready()
    // resolves once the connection has processed them.
    let send = send.ready().await.unwrap();
    Wait::new("MAX_CONCURRENT_STREAMS of 64", Duration::from_secs(10))
        .every(Duration::from_millis(20))
        .try_ok(|| match send.current_max_send_streams() {
            64 => Ok(()),
            max => Err(max),
        })
        .await
        .unwrap_or_else(|t| panic!("MAX_CONCURRENT_STREAMS is {}, not 64", t.last));
}

#[test]
fn a_connection_that_sends_nothing_is_closed() {
    let provider = Provider::start(&["--use-fake-backend"]);
    let mut tcp = std::net::TcpStream::connect(provider.grpc).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let started = Instant::now();
    // The server writes its SETTINGS, then closes once the preface
    // deadline passes: read until end of stream (or a reset).
    let mut sink = Vec::new();
    let result = tcp.read_to_end(&mut sink);
    let waited = started.elapsed();
    if let Err(e) = &result {
        assert!(
            e.kind() != std::io::ErrorKind::WouldBlock && e.kind() != std::io::ErrorKind::TimedOut,
            "the silent connection was still open after {waited:?}"
        );
    }
    assert!(
        waited < Duration::from_secs(20),
        "closed only after {waited:?}"
    );
}

/// One peer holds at most `--max-connections-per-peer` connections: one
/// more is closed at once, and the others keep serving.
#[tokio::test]
async fn a_peer_past_its_connection_cap_is_closed() {
    use tokio::io::AsyncReadExt;
    let provider = Provider::start(&["--use-fake-backend", "--max-connections-per-peer", "2"]);
    let mut first = provider.client().await;
    let _second = provider.client().await;
    let mut third = tokio::net::TcpStream::connect(provider.grpc)
        .await
        .expect("the kernel accepts it");
    let mut sink = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut sink))
        .await
        .expect("closed at once, not after the preface deadline");
    assert!(sink.is_empty(), "the third connection was served: {read:?}");
    assert!(
        provider
            .logs
            .wait_for(Duration::from_secs(5), |l| l
                .contains("--max-connections-per-peer"))
            .is_some(),
        "{}",
        provider.stderr()
    );
    first
        .get(MachineRef { id: "x".into() })
        .await
        .map(|_| ())
        .or_else(|s| (s.code() == tonic::Code::NotFound).then_some(()).ok_or(s))
        .expect("the first connection still serves");
}

#[tokio::test]
async fn oversized_ids_get_a_short_readable_invalid_argument() {
    let provider = Provider::start(&["--use-fake-backend"]);
    let mut c = provider.client().await;
    let huge = "x".repeat(1024 * 1024);
    let status = c
        .get(MachineRef { id: huge.clone() })
        .await
        .expect_err("1 MiB id");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().len() < 300, "{}", status.message().len());
    assert!(
        status.message().contains("the cap is 256 bytes"),
        "{}",
        status.message()
    );
    let status = c
        .create(CreateRequest {
            machine_id: "m".into(),
            shard_id: huge,
            shard_epoch: 1,
            sequence_number: 1,
        })
        .await
        .expect_err("1 MiB shard id");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    // Refused from the gRPC length prefix, before the body is read.
    assert!(
        status
            .message()
            .starts_with("a Create request of 1048587 bytes was refused before decoding"),
        "{}",
        status.message()
    );
    assert!(
        status.message().contains("shard_id: 256 bytes"),
        "{}",
        status.message()
    );
    // Under the transport's cap, the engine's own cap speaks.
    let status = c
        .create(CreateRequest {
            machine_id: "m".into(),
            shard_id: "s".repeat(4096),
            shard_epoch: 1,
            sequence_number: 1,
        })
        .await
        .expect_err("4 KiB shard id");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().starts_with("shard_id is 4096 bytes"),
        "{}",
        status.message()
    );
}

/// The Core line of `/proc/PID/limits`: soft and hard limit.
fn core_limits(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max core file size"))
        .expect("a core limit line")
        .to_string();
    let words: Vec<&str> = line.split_whitespace().collect();
    (words[4].to_string(), words[5].to_string())
}

#[test]
fn the_serving_process_writes_no_core_file_unless_told_to() {
    // A core would hold the Proxmox token: the limit is 0, soft and hard.
    let provider = Provider::start(&["--use-fake-backend"]);
    assert_eq!(
        core_limits(provider.pid()),
        ("0".to_string(), "0".to_string())
    );
    drop(provider);
    // --core-dumps leaves the limit the environment set (this test's own).
    let ours = core_limits(std::process::id());
    let provider = Provider::start(&["--use-fake-backend", "--core-dumps"]);
    assert_eq!(core_limits(provider.pid()), ours);
}
