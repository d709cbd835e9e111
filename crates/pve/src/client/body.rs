//! The request body the client sends: a form body may carry a piece of the
//! bootstrap blob (a file-write's `content`), so its buffer is wiped when
//! hyper is done with it and drops it. What hyper and rustls copy on the
//! way out (hyper's write buffer, TLS records) is theirs and is not wiped
//! (docs/security.md).

use bytes::Buf;
use zeroize::Zeroize;

/// Bytes to send, overwritten with zeros when dropped.
#[derive(Debug, Default)]
pub(crate) struct WipedBody {
    bytes: Vec<u8>,
    /// How much of `bytes` hyper has consumed.
    sent: usize,
}

impl WipedBody {
    /// Takes `bytes` over without copying them.
    pub(crate) fn new(bytes: Vec<u8>) -> WipedBody {
        WipedBody { bytes, sent: 0 }
    }

    /// Overwrites the whole buffer with zeros (its spare capacity too), as
    /// dropping does.
    fn wipe(&mut self) {
        let full = self.bytes.capacity();
        self.bytes.resize(full, 0);
        self.bytes.as_mut_slice().zeroize();
    }
}

impl Drop for WipedBody {
    fn drop(&mut self) {
        self.wipe();
    }
}

impl Buf for WipedBody {
    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.sent)
    }

    fn chunk(&self) -> &[u8] {
        self.bytes.get(self.sent..).unwrap_or_default()
    }

    fn advance(&mut self, cnt: usize) {
        self.sent = self.sent.saturating_add(cnt).min(self.bytes.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_is_read_as_sent_then_wiped() {
        let mut secret = b"content=c2VjcmV0".to_vec();
        secret.reserve(7);
        let mut body = WipedBody::new(secret);
        assert_eq!(body.chunk(), b"content=c2VjcmV0");
        body.advance(8);
        assert_eq!(body.remaining(), 8);
        assert_eq!(body.chunk(), b"c2VjcmV0");
        body.advance(100);
        assert_eq!(body.remaining(), 0);
        body.wipe();
        assert!(body.bytes.len() >= 16 + 7, "the spare capacity too");
        assert!(body.bytes.iter().all(|b| *b == 0), "{:?}", body.bytes);
    }
}
