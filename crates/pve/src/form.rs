//! Parameter lists encoded the way PVE's HTTP server decodes them: the same
//! `application/x-www-form-urlencoded` grammar for POST/PUT bodies and for
//! GET/DELETE query strings, arrays as repeated keys.

use percent_encoding::{percent_encode, AsciiSet, NON_ALPHANUMERIC};
use zeroize::Zeroize;

/// Everything except RFC 3986 unreserved characters is escaped. Escaping space as
/// `%20` (not `+`) and `+`/`=`/`&` as `%2B`/`%3D`/`%26` keeps values byte-exact.
const FORM: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Escapes one URL path segment (node names, UPIDs, pool ids).
pub fn encode_segment(s: &str) -> String {
    percent_encode(s.as_bytes(), FORM).to_string()
}

/// Bytes `v` takes once escaped with [`FORM`]: unreserved characters as
/// they are, every other byte as `%XX`.
fn encoded_len(v: &[u8]) -> usize {
    v.iter()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(b) {
                1
            } else {
                3
            }
        })
        .sum()
}

/// An ordered list of key/value parameters. Its values are wiped when it
/// is dropped: one may be a piece of the bootstrap blob (a file-write's
/// `content`), and a dropped `Vec` leaves its bytes in freed memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Params {
    pairs: Vec<(String, Vec<u8>)>,
}

impl Drop for Params {
    fn drop(&mut self) {
        self.wipe();
    }
}

impl Params {
    pub fn new() -> Self {
        Self::default()
    }

    /// Overwrites every value with zeros, as dropping does. Each value was
    /// copied in with `to_vec` (capacity = length), so its slice is all of
    /// its buffer.
    fn wipe(&mut self) {
        for (_, v) in &mut self.pairs {
            v.as_mut_slice().zeroize();
        }
    }

    /// Adds one key/value pair.
    pub fn push(&mut self, key: &str, value: impl AsRef<[u8]>) -> &mut Self {
        self.pairs.push((key.to_string(), value.as_ref().to_vec()));
        self
    }

    /// Adds the pair only when a value is present.
    pub fn push_opt<V: AsRef<[u8]>>(&mut self, key: &str, value: Option<V>) -> &mut Self {
        if let Some(v) = value {
            self.push(key, v);
        }
        self
    }

    /// Adds a PVE boolean (`1`/`0`).
    pub fn push_bool(&mut self, key: &str, value: bool) -> &mut Self {
        self.push(key, if value { "1" } else { "0" })
    }

    /// Adds an array parameter: the key repeated once per element, in order.
    pub fn push_array<I, V>(&mut self, key: &str, values: I) -> &mut Self
    where
        I: IntoIterator<Item = V>,
        V: AsRef<[u8]>,
    {
        for v in values {
            self.push(key, v);
        }
        self
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// The encoded `k=v&k=v` string (usable as a body or after `?`),
    /// allocated once at its final size: a string grown while encoding
    /// would leave copies of the values behind in the buffers it outgrew.
    pub fn encode(&self) -> String {
        let len = self
            .pairs
            .iter()
            .map(|(k, v)| encoded_len(k.as_bytes()) + 1 + encoded_len(v))
            .sum::<usize>()
            + self.pairs.len().saturating_sub(1);
        let mut out = String::with_capacity(len);
        for (i, (k, v)) in self.pairs.iter().enumerate() {
            if i > 0 {
                out.push('&');
            }
            out.extend(percent_encode(k.as_bytes(), FORM));
            out.push('=');
            out.extend(percent_encode(v, FORM));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_repeat_keys_and_specials_are_escaped() {
        let mut p = Params::new();
        p.push_array("command", ["/bin/sh", "-c", "echo a+b=c && x"]);
        p.push("input-data", "ü é\n");
        p.push_bool("full", true);
        assert_eq!(
            p.encode(),
            "command=%2Fbin%2Fsh&command=-c&command=echo%20a%2Bb%3Dc%20%26%26%20x\
             &input-data=%C3%BC%20%C3%A9%0A&full=1"
        );
    }

    #[test]
    fn segments() {
        assert_eq!(
            encode_segment("UPID:pve1:00000ACD:x:bigfleet@pve!a:"),
            "UPID%3Apve1%3A00000ACD%3Ax%3Abigfleet%40pve%21a%3A"
        );
        assert_eq!(encode_segment("pve-1.a_b"), "pve-1.a_b");
    }

    #[test]
    fn values_are_wiped_and_encoded_in_one_allocation() {
        let mut p = Params::new();
        p.push("file", "/run/bigfleet/bootstrap");
        p.push("content", "c2VjcmV0IHRva2Vu+/=");
        let body = p.encode();
        // Never grown: one allocation of the final size.
        assert_eq!(body.capacity(), body.len(), "{body}");
        p.wipe();
        for (_, v) in &p.pairs {
            assert!(!v.is_empty() && v.iter().all(|b| *b == 0), "{v:?}");
        }
    }

    #[test]
    fn push_opt_skips_none() {
        let mut p = Params::new();
        p.push_opt("a", None::<&str>).push_opt("b", Some("x"));
        assert_eq!(p.encode(), "b=x");
    }
}
