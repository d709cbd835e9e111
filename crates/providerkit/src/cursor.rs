//! The List revision cursor: opaque, tamper-evident, bound to one boot.
//!
//! Layout (28 bytes): magic `BFR1` | boot nonce (8) | revision (8) | tag (8).
//! The tag is a keyed hash over nonce and revision with a per-process key,
//! so a mutated, truncated or foreign cursor fails to decode and the caller
//! gets a full list instead of a silently wrong delta. A cursor from before a
//! restart carries another nonce and decodes as foreign: a full re-list.

use std::hash::{BuildHasher, Hasher};

const MAGIC: &[u8; 4] = b"BFR1";
const LEN: usize = 28;

pub struct CursorCodec {
    nonce: u64,
    key: std::collections::hash_map::RandomState,
}

impl CursorCodec {
    pub fn new(nonce: u64) -> CursorCodec {
        CursorCodec {
            nonce,
            key: std::collections::hash_map::RandomState::new(),
        }
    }

    fn tag(&self, revision: u64) -> u64 {
        let mut hasher = self.key.build_hasher();
        hasher.write(MAGIC);
        hasher.write_u64(self.nonce);
        hasher.write_u64(revision);
        hasher.finish()
    }

    pub fn encode(&self, revision: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(LEN);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.nonce.to_be_bytes());
        out.extend_from_slice(&revision.to_be_bytes());
        out.extend_from_slice(&self.tag(revision).to_be_bytes());
        out
    }

    /// The revision in a cursor this codec issued; `None` for anything else.
    pub fn decode(&self, bytes: &[u8]) -> Option<u64> {
        if bytes.len() != LEN || &bytes[..4] != MAGIC {
            return None;
        }
        let word = |at: usize| -> Option<u64> {
            Some(u64::from_be_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
        };
        if word(4)? != self.nonce {
            return None;
        }
        let revision = word(12)?;
        (word(20)? == self.tag(revision)).then_some(revision)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_tampering() {
        let codec = CursorCodec::new(7);
        let cursor = codec.encode(42);
        assert_eq!(codec.decode(&cursor), Some(42));
        for i in 0..cursor.len() {
            let mut bad = cursor.clone();
            bad[i] ^= 0x01;
            assert_eq!(codec.decode(&bad), None, "byte {i} flipped still decoded");
        }
        assert_eq!(codec.decode(&cursor[..27]), None);
        assert_eq!(codec.decode(b""), None);
        assert_eq!(codec.decode(b"garbage"), None);
    }

    #[test]
    fn other_boot_is_foreign() {
        let before = CursorCodec::new(1);
        let after = CursorCodec::new(2);
        assert_eq!(after.decode(&before.encode(5)), None);
        // Same nonce, other key (another process): still foreign.
        assert_eq!(CursorCodec::new(1).decode(&before.encode(5)), None);
    }
}
