//! The half-sent-bodies guard: what callers who declare large requests and
//! never finish sending them can make the provider hold, and whether other
//! callers' Gets keep their latency meanwhile.
//!
//! Four HTTP/2 connections each open 64 streams that declare a large
//! message and send all of it but the last 1,000 bytes, twice: first as
//! Configures under the transport's cap (the largest body any caller may
//! send), then as the review's attack, Creates declaring 4,000,000 bytes.
//! The provider's resident set is read before and once it settles under
//! each attack, and Get p99 (open loop) at rest and under the first. The
//! guard fails when the growth passes [`RSS_GROWTH_LIMIT_MIB`] or Get p99
//! passes [`GET_P99_LIMIT`] of its value at rest (plus a millisecond of
//! slack for a sub-millisecond p99).

use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;

use crate::provider::Provider;
use crate::scenarios::{Bench, Profile};
use crate::stats::us;
use crate::unread::settled_rss;
use crate::Report;

const CONNECTIONS: usize = 4;
const STREAMS: usize = 64;
/// What the whole attack may add to the resident set.
pub const RSS_GROWTH_LIMIT_MIB: u64 = 100;
/// Get p99 under attack, as a multiple of Get p99 at rest: the attacker
/// and the Get client share the machine with the provider, so some of the
/// rise is theirs (the `client_send_lag` figure shows how much).
pub const GET_P99_LIMIT: f64 = 4.0;
const FLEET: usize = 1000;
const GET_RPS: u32 = 1000;
/// A Configure just under the transport's cap with the default input caps.
const CONFIGURE_DECLARED: usize = 1_300_000;
const CREATE_DECLARED: usize = 4_000_000;
const HELD_BACK: usize = 1000;

/// One attacking connection: its streams, held open, and its driver.
type Held = (
    Vec<(h2::client::ResponseFuture, h2::SendStream<Bytes>)>,
    tokio::task::JoinHandle<()>,
);

async fn half_send(addr: &str, rpc: &str, declared: usize) -> Result<Held> {
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    let (mut send, connection) = h2::client::handshake(tcp).await?;
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut streams = Vec::with_capacity(STREAMS);
    let len = u32::try_from(declared).context("declared length")?;
    let mut body = Vec::with_capacity(5 + declared - HELD_BACK);
    body.push(0);
    body.extend_from_slice(&len.to_be_bytes());
    body.resize(5 + declared - HELD_BACK, 0x41);
    let body = Bytes::from(body);
    for _ in 0..STREAMS {
        send = send.ready().await?;
        let request = http::Request::post(format!(
            "http://{addr}/bigfleet.v1alpha1.CapacityProvider/{rpc}"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())?;
        let (response, mut stream) = send.send_request(request, false)?;
        stream.send_data(body.clone(), false)?;
        streams.push((response, stream));
    }
    Ok((streams, driver))
}

/// Runs the guard on its own provider; `Ok(false)` when a limit was passed.
pub async fn run(
    bin: &std::path::Path,
    boot_timeout: Duration,
    profile: &Profile,
    report: &mut Report,
) -> Result<bool> {
    let provider = Provider::spawn(bin, FLEET, None, boot_timeout, profile.provider_cpu).await?;
    let bench = Bench::connect(&provider.addr, profile, provider.pid()).await?;
    let ids = bench.inventory().await?;
    let quiet = Duration::from_secs(2);
    let limit = Duration::from_secs(10);
    let before = settled_rss(
        &provider,
        Duration::from_millis(500),
        Duration::from_secs(5),
    )
    .await?;
    let at_rest = bench.open_loop_get(FLEET, &ids, GET_RPS, report).await?;
    let mut met = true;
    let mut held = Vec::new();
    for (rpc, declared) in [
        ("Configure", CONFIGURE_DECLARED),
        ("Create", CREATE_DECLARED),
    ] {
        for _ in 0..CONNECTIONS {
            held.push(half_send(&provider.addr, rpc, declared).await?);
        }
        let loaded = settled_rss(&provider, quiet, limit).await?;
        let growth_mib = loaded.saturating_sub(before) / 1024;
        let under = if rpc == "Configure" {
            Some(bench.open_loop_get(FLEET, &ids, GET_RPS, report).await?)
        } else {
            None
        };
        let rss_ok = growth_mib <= RSS_GROWTH_LIMIT_MIB;
        let get_ok = under.is_none_or(|under| {
            under.as_secs_f64() <= at_rest.as_secs_f64() * GET_P99_LIMIT + 0.001
        });
        met &= rss_ok && get_ok;
        report.line(format!(
            "half_sent_guard={rpc} declared={declared} conns={CONNECTIONS} streams={STREAMS} \
             rss_growth_mib={growth_mib} limit_mib={RSS_GROWTH_LIMIT_MIB} get_p99_rest_us={} \
             get_p99_under_us={} met={}",
            us(at_rest),
            under.map_or_else(|| "-".to_string(), |d| us(d).to_string()),
            rss_ok && get_ok
        ));
    }
    for (streams, driver) in held {
        driver.abort();
        drop(streams);
    }
    provider.kill().await?;
    Ok(met)
}
