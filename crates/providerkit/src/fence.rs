//! Fencing tokens: accept iff strictly newer than the (shard, machine) mark,
//! ordered lexicographically as signed (epoch, sequence) pairs.

use crate::error::KitError;

/// A request's fencing token. An empty shard id with zero epoch and sequence
/// is "absent" and bypasses fencing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Token {
    pub shard_id: String,
    pub epoch: i64,
    pub sequence: i64,
}

impl Token {
    pub fn new(shard_id: impl Into<String>, epoch: i64, sequence: i64) -> Token {
        Token {
            shard_id: shard_id.into(),
            epoch,
            sequence,
        }
    }

    pub fn absent() -> Token {
        Token::new("", 0, 0)
    }

    pub fn is_absent(&self) -> bool {
        self.shard_id.is_empty() && self.epoch == 0 && self.sequence == 0
    }

    /// Shape check, done before any state is consulted. Epoch and sequence
    /// are signed and any value is legal: a negative one is ordered like
    /// any other, never rejected for its sign.
    pub fn validate(&self) -> Result<(), KitError> {
        if self.is_absent() {
            return Ok(());
        }
        if self.shard_id.is_empty() {
            return Err(KitError::InvalidArgument(format!(
                "fencing token has epoch {} / sequence {} but an empty shard_id",
                self.epoch, self.sequence
            )));
        }
        Ok(())
    }

    /// Lexicographic (epoch, sequence) order; `None` mark = first contact.
    pub fn is_newer_than(&self, mark: Option<(i64, i64)>) -> bool {
        match mark {
            None => true,
            Some(mark) => (self.epoch, self.sequence) > mark,
        }
    }
}
