//! Fencing tokens, per-shard sessions that mint them, and the request
//! builders that carry them.

use std::collections::HashMap;

use bigfleet_proto::v1alpha1::{ConfigureRequest, CreateRequest, DeleteRequest, DrainRequest};

/// A fencing token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub shard: String,
    pub epoch: i64,
    pub seq: i64,
}

impl Token {
    /// The absent token (bypasses fencing).
    pub fn none() -> Token {
        Token {
            shard: String::new(),
            epoch: 0,
            seq: 0,
        }
    }
    pub fn new(shard: &str, epoch: i64, seq: i64) -> Token {
        Token {
            shard: shard.to_string(),
            epoch,
            seq,
        }
    }
}

/// Mints monotonic tokens for one shard: (epoch, 1), (epoch, 2), ...; `new_epoch` resets the sequence.
#[derive(Debug, Clone)]
pub struct ShardSession {
    pub shard: String,
    pub epoch: i64,
    pub seq: i64,
}

impl ShardSession {
    pub fn new(shard: String) -> Self {
        ShardSession {
            shard,
            epoch: 1,
            seq: 0,
        }
    }
    pub fn mint(&mut self) -> Token {
        self.seq += 1;
        Token::new(&self.shard, self.epoch, self.seq)
    }
    /// The most recently minted token (a replay of it is stale).
    pub fn last(&self) -> Token {
        Token::new(&self.shard, self.epoch, self.seq)
    }
    pub fn new_epoch(&mut self) {
        self.epoch += 1;
        self.seq = 0;
    }
}

pub fn create_req(id: &str, t: &Token) -> CreateRequest {
    CreateRequest {
        machine_id: id.into(),
        shard_id: t.shard.clone(),
        shard_epoch: t.epoch,
        sequence_number: t.seq,
    }
}

pub fn configure_req(
    id: &str,
    cluster: &str,
    meta: &HashMap<String, String>,
    t: &Token,
) -> ConfigureRequest {
    ConfigureRequest {
        machine_id: id.into(),
        cluster_id: cluster.into(),
        bootstrap_blob: b"#bfconf bootstrap\n".to_vec(),
        shard_id: t.shard.clone(),
        shard_epoch: t.epoch,
        sequence_number: t.seq,
        shard_metadata: meta.clone(),
    }
}

pub fn drain_req(id: &str, grace: i64, t: &Token) -> DrainRequest {
    DrainRequest {
        machine_id: id.into(),
        grace_period_seconds: grace,
        shard_id: t.shard.clone(),
        shard_epoch: t.epoch,
        sequence_number: t.seq,
    }
}

pub fn delete_req(id: &str, t: &Token) -> DeleteRequest {
    DeleteRequest {
        machine_id: id.into(),
        shard_id: t.shard.clone(),
        shard_epoch: t.epoch,
        sequence_number: t.seq,
    }
}
