//! The unread-List scenario: clients that ask for full Lists and never read
//! the answers. Four HTTP/2 connections send 50 full Lists each and leave
//! every response unread (no flow-control window is ever released), so the
//! provider can send only the first 64 KiB per connection and must keep or
//! queue the rest. Reports the provider's resident set before, at its peak
//! and after the sockets close: the growth is what such clients can make it
//! hold.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;

use crate::provider::Provider;
use crate::Report;

pub const CONNECTIONS: usize = 4;
pub const LISTS_PER_CONNECTION: usize = 50;

/// RSS (KiB) once it has not grown for `quiet` (or after `limit`).
pub(crate) async fn settled_rss(
    provider: &Provider,
    quiet: Duration,
    limit: Duration,
) -> Result<u64> {
    let started = Instant::now();
    let (_, mut last) = provider.memory_kib()?;
    let mut since = Instant::now();
    while started.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (_, now) = provider.memory_kib()?;
        if now.abs_diff(last) > 512 {
            since = Instant::now();
        }
        last = now;
        if since.elapsed() >= quiet {
            break;
        }
    }
    Ok(last)
}

/// One connection with `lists` full Lists in flight, none of them read.
type Unread = (Vec<h2::client::ResponseFuture>, tokio::task::JoinHandle<()>);

async fn open_unread(addr: &str, lists: usize) -> Result<Unread> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    let (mut send, connection) = h2::client::handshake(tcp).await?;
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut pending = Vec::with_capacity(lists);
    for _ in 0..lists {
        send = send.ready().await?;
        let request = http::Request::post(format!(
            "http://{addr}/bigfleet.v1alpha1.CapacityProvider/List"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())?;
        let (response, mut body) = send.send_request(request, false)?;
        // An empty ListFilter: a full List. gRPC frame: flag 0, length 0.
        body.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true)?;
        pending.push(response);
    }
    Ok((pending, driver))
}

/// Runs the scenario on its own provider; returns the RSS growth (KiB).
pub async fn unread_lists(
    bin: &std::path::Path,
    size: usize,
    boot_timeout: Duration,
    cpu: Option<usize>,
    report: &mut Report,
) -> Result<u64> {
    let provider = Provider::spawn(bin, size, None, boot_timeout, cpu).await?;
    let before = settled_rss(
        &provider,
        Duration::from_millis(500),
        Duration::from_secs(5),
    )
    .await?;
    let mut held = Vec::new();
    for _ in 0..CONNECTIONS {
        held.push(open_unread(&provider.addr, LISTS_PER_CONNECTION).await?);
    }
    // Let the provider do all it will for these requests.
    let loaded = settled_rss(&provider, Duration::from_secs(2), Duration::from_secs(30)).await?;
    let (peak, _) = provider.memory_kib()?;
    // Close the sockets: abort each connection's driver (drops it).
    for (responses, driver) in held {
        driver.abort();
        drop(responses);
    }
    let after = settled_rss(&provider, Duration::from_secs(2), Duration::from_secs(30)).await?;
    let mib = |k: u64| k as f64 / 1024.0;
    report.line(format!(
        "unread_list_rss_before_mib={:.1} rss_loaded_mib={:.1} rss_peak_mib={:.1} growth_mib={:.1} \
         rss_after_close_mib={:.1} conns={CONNECTIONS} lists_per_conn={LISTS_PER_CONNECTION} size={size}",
        mib(before),
        mib(loaded),
        mib(peak),
        mib(peak.saturating_sub(before)),
        mib(after)
    ));
    provider.kill().await?;
    Ok(peak.saturating_sub(before))
}
