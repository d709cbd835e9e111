//! The List budget is fair between connections, on the binary: a client
//! that sends many full Lists and never reads them holds only its share,
//! and another client's full List completes meanwhile.

use std::time::Duration;

use bigfleet_proto::v1alpha1::ListFilter;
use bytes::Bytes;

use crate::common::Provider;

/// Full Lists on one HTTP/2 connection whose bodies are never read.
const UNREAD: usize = 20;

#[tokio::test]
async fn a_client_that_never_reads_does_not_starve_another() {
    // 20k machines: a full List is ~2.5 MB, so the 32 MiB budget would hold
    // about 12 of the slow client's Lists without a per-connection share.
    let provider = Provider::start(&["--use-fake-backend", "--seed-count", "20000"]);
    let addr = provider.grpc;
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut send, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut pending = Vec::with_capacity(UNREAD);
    for _ in 0..UNREAD {
        send = send.ready().await.expect("stream");
        let request = http::Request::post(format!(
            "http://{addr}/bigfleet.v1alpha1.CapacityProvider/List"
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("request");
        let (response, mut body) = send.send_request(request, false).expect("send");
        // An empty ListFilter (a full List): gRPC frame flag 0, length 0.
        body.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true)
            .expect("send body");
        pending.push(response);
    }
    // Headers come once a List holds its budget and is encoded; the body
    // is never read. Once the first is out, all the slow client's Lists
    // hold or wait for budget.
    let (first, _, pending) = tokio::time::timeout(
        Duration::from_secs(30),
        futures::future::select_all(pending),
    )
    .await
    .expect("one of the slow client's Lists is answered");
    let first = first.expect("response headers");
    assert_eq!(first.status(), 200);

    let mut c = provider.client().await;
    let list = tokio::time::timeout(Duration::from_secs(30), c.list(ListFilter::default()))
        .await
        .expect("another client's full List completes while the first never reads")
        .expect("List");
    assert_eq!(list.into_inner().machines.len(), 20_000);

    drop(first);
    drop(pending);
    driver.abort();
}
