//! The List revision cursor: opaque, tamper-evident, bound to one boot.
//!
//! Two layouts, both ending in a keyed hash over everything before it (a
//! per-process key), so a mutated, truncated or foreign cursor fails to
//! decode and the caller gets a full list instead of a silently wrong delta.
//! A cursor from before a restart carries another nonce and decodes as
//! foreign: a full re-list.
//!
//! - `BFR1` | nonce (8) | revision (8) | tag (8): "machines changed after
//!   this revision" (28 bytes).
//! - `BFW1` | nonce (8) | start (8) | pos (8) | settled (8) | tag (8): the
//!   next page of a rotated walk over the whole fleet (44 bytes); see
//!   [`Walk`].

use std::hash::{BuildHasher, Hasher};

const SINCE_MAGIC: &[u8; 4] = b"BFR1";
const SINCE_LEN: usize = 28;
const WALK_MAGIC: &[u8; 4] = b"BFW1";
const WALK_LEN: usize = 44;

/// A capped List without a cursor starts at a rotating point of the
/// revision order (so successive picks spread over the fleet), and its
/// follow-up pages walk the rest of the order around to that point.
///
/// Phase one covers revisions above `start`, phase two revisions in
/// `(0, start]`. `settled` is `None` in phase one; in phase two it is the
/// fleet revision when phase one ended, which becomes the plain cursor the
/// walk hands back at its end, so any machine changed during phase two is
/// in the next delta.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Walk {
    pub start: u64,
    /// The revision of the last machine returned.
    pub pos: u64,
    pub settled: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cursor {
    /// Machines changed after this revision.
    Since(u64),
    Walk(Walk),
}

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

    fn tag(&self, magic: &[u8; 4], words: &[u64]) -> u64 {
        let mut hasher = self.key.build_hasher();
        hasher.write(magic);
        hasher.write_u64(self.nonce);
        for &w in words {
            hasher.write_u64(w);
        }
        hasher.finish()
    }

    fn seal(&self, magic: &[u8; 4], words: &[u64]) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + 8 * (words.len() + 2));
        out.extend_from_slice(magic);
        out.extend_from_slice(&self.nonce.to_be_bytes());
        for w in words {
            out.extend_from_slice(&w.to_be_bytes());
        }
        out.extend_from_slice(&self.tag(magic, words).to_be_bytes());
        out
    }

    /// A "changed after `revision`" cursor.
    pub fn encode(&self, revision: u64) -> Vec<u8> {
        self.seal(SINCE_MAGIC, &[revision])
    }

    pub fn encode_cursor(&self, cursor: Cursor) -> Vec<u8> {
        match cursor {
            Cursor::Since(revision) => self.encode(revision),
            // Phase one has no settled revision; 0 stands for it (a fleet
            // revision is never 0 once a walk has a page to continue).
            Cursor::Walk(w) => self.seal(WALK_MAGIC, &[w.start, w.pos, w.settled.unwrap_or(0)]),
        }
    }

    /// The cursor this codec issued; `None` for anything else.
    pub fn decode_cursor(&self, bytes: &[u8]) -> Option<Cursor> {
        let (magic, len) = match bytes.get(..4)? {
            m if m == SINCE_MAGIC => (SINCE_MAGIC, SINCE_LEN),
            m if m == WALK_MAGIC => (WALK_MAGIC, WALK_LEN),
            _ => return None,
        };
        if bytes.len() != len {
            return None;
        }
        let word = |at: usize| -> Option<u64> {
            Some(u64::from_be_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
        };
        if word(4)? != self.nonce {
            return None;
        }
        let words: Vec<u64> = (0..(len - 20) / 8)
            .map(|i| word(12 + 8 * i))
            .collect::<Option<_>>()?;
        if word(len - 8)? != self.tag(magic, &words) {
            return None;
        }
        Some(match words.as_slice() {
            [revision] => Cursor::Since(*revision),
            [start, pos, settled] => Cursor::Walk(Walk {
                start: *start,
                pos: *pos,
                settled: (*settled != 0).then_some(*settled),
            }),
            _ => return None,
        })
    }

    /// The revision in a "changed after" cursor this codec issued; `None`
    /// for anything else.
    pub fn decode(&self, bytes: &[u8]) -> Option<u64> {
        match self.decode_cursor(bytes)? {
            Cursor::Since(revision) => Some(revision),
            Cursor::Walk(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_tamper_evident(codec: &CursorCodec, cursor: &[u8]) {
        for i in 0..cursor.len() {
            let mut bad = cursor.to_vec();
            bad[i] ^= 0x01;
            assert_eq!(
                codec.decode_cursor(&bad),
                None,
                "byte {i} flipped still decoded"
            );
        }
        assert_eq!(codec.decode_cursor(&cursor[..cursor.len() - 1]), None);
    }

    #[test]
    fn round_trips_and_rejects_tampering() {
        let codec = CursorCodec::new(7);
        let cursor = codec.encode(42);
        assert_eq!(codec.decode(&cursor), Some(42));
        assert_tamper_evident(&codec, &cursor);
        assert_eq!(codec.decode(b""), None);
        assert_eq!(codec.decode(b"garbage"), None);
    }

    #[test]
    fn walk_cursors_round_trip_and_are_tamper_evident() {
        let codec = CursorCodec::new(7);
        for walk in [
            Walk {
                start: 10,
                pos: 12,
                settled: None,
            },
            Walk {
                start: 10,
                pos: 3,
                settled: Some(99),
            },
        ] {
            let bytes = codec.encode_cursor(Cursor::Walk(walk));
            assert_eq!(bytes.len(), WALK_LEN);
            assert_eq!(codec.decode_cursor(&bytes), Some(Cursor::Walk(walk)));
            // A walk is not a "changed after" cursor.
            assert_eq!(codec.decode(&bytes), None);
            assert_tamper_evident(&codec, &bytes);
        }
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
