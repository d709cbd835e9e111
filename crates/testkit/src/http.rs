//! A minimal HTTP/1.1 client for the provider's plain-HTTP listener (the
//! probes and `/metrics`): one request per connection, no dependencies.

use std::collections::BTreeMap;
use std::io::{Error, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// An answer: the status code, the headers (names lowercased) and the body
/// (chunked bodies decoded).
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: BTreeMap<String, String>,
    pub body: String,
}

/// `GET path` on a fresh connection to `addr` (`Connection: close`), with
/// no `Accept` header, as `curl` sends it.
pub fn get(addr: SocketAddr, path: &str) -> std::io::Result<Response> {
    request(addr, path, "")
}

/// [`get`] with an `Accept` header: `/metrics` answers in the format it
/// asks for.
pub fn get_accepting(addr: SocketAddr, path: &str, accept: &str) -> std::io::Result<Response> {
    request(addr, path, &format!("Accept: {accept}\r\n"))
}

fn request(addr: SocketAddr, path: &str, headers: &str) -> std::io::Result<Response> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}Connection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    parse(raw)
}

fn parse(raw: Vec<u8>) -> std::io::Result<Response> {
    let bad = |what: &str| Error::new(ErrorKind::InvalidData, what.to_string());
    let text = String::from_utf8(raw).map_err(|e| Error::new(ErrorKind::InvalidData, e))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| bad("no header end"))?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad("no status code"))?;
    let headers: BTreeMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers
        .get("transfer-encoding")
        .is_some_and(|v| v.contains("chunked"));
    let body = if chunked {
        let mut out = String::new();
        let mut rest = body;
        loop {
            let (size, after) = rest.split_once("\r\n").ok_or_else(|| bad("bad chunk"))?;
            let size = usize::from_str_radix(size.trim(), 16).map_err(|_| bad("bad chunk size"))?;
            if size == 0 {
                break;
            }
            out.push_str(after.get(..size).ok_or_else(|| bad("short chunk"))?);
            rest = after.get(size + 2..).ok_or_else(|| bad("short chunk"))?;
        }
        out
    } else {
        body.to_string()
    };
    Ok(Response {
        status,
        headers,
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_plain_and_chunked_answers_and_refuses_truncated_ones() {
        let plain = parse(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nready"
                .to_vec(),
        )
        .expect("plain");
        assert_eq!(plain.status, 200);
        assert_eq!(plain.headers["content-type"], "text/plain");
        assert_eq!(plain.body, "ready");
        let chunked = parse(
            b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nnot \r\n5\r\nready\r\n0\r\n\r\n"
                .to_vec(),
        )
        .expect("chunked");
        assert_eq!((chunked.status, chunked.body.as_str()), (503, "not ready"));
        assert!(parse(b"HTTP/1.1 200 OK\r\n".to_vec()).is_err());
        assert!(
            parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\nshort".to_vec())
                .is_err()
        );
    }
}
