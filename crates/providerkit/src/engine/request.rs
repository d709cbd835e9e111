//! A mutation request's own part: its parameters per transition, and the
//! check of its shape against the documented input caps. The check comes
//! before anything is looked up, so a malformed request is refused whole:
//! nothing is truncated, and no fencing mark moves.

use std::collections::HashMap;
use std::time::Duration;

use super::options::{check_len, echo_prefix, EngineOptions, Limits};
use crate::error::KitError;
use crate::fence::Token;
use crate::model::TransitionKind;

/// Request parameters that differ per transition.
pub(super) enum Params {
    Create,
    Configure {
        cluster_id: String,
        bootstrap_blob: zeroize::Zeroizing<Vec<u8>>,
        shard_metadata: HashMap<String, String>,
    },
    Drain {
        grace: Duration,
    },
    Delete,
}

impl Params {
    pub(super) fn kind(&self) -> TransitionKind {
        match self {
            Params::Create => TransitionKind::Create,
            Params::Configure { .. } => TransitionKind::Configure,
            Params::Drain { .. } => TransitionKind::Drain,
            Params::Delete => TransitionKind::Delete,
        }
    }
}

/// The documented input caps a request is held to.
pub(super) struct InputCaps {
    limits: Limits,
    /// Mutant: a negative epoch or sequence is refused.
    #[cfg(feature = "mutants")]
    reject_negative_tokens: bool,
}

impl InputCaps {
    pub(super) fn new(opts: &EngineOptions) -> InputCaps {
        InputCaps {
            limits: opts.limits.clone(),
            #[cfg(feature = "mutants")]
            reject_negative_tokens: opts.mutants.reject_negative_tokens,
        }
    }

    /// Refuse, as INVALID_ARGUMENT, a request whose shape is wrong or
    /// whose parts exceed a cap.
    pub(super) fn check(&self, id: &str, token: &Token, params: &Params) -> Result<(), KitError> {
        if id.is_empty() {
            return Err(KitError::InvalidArgument(
                "machine_id must not be empty".into(),
            ));
        }
        let limits = &self.limits;
        check_len("machine_id", id, limits.max_machine_id_bytes)?;
        check_len("shard_id", &token.shard_id, limits.max_shard_id_bytes)?;
        token.validate()?;
        if let Some(e) = self.mutant_token_error(token) {
            return Err(e);
        }
        if let Params::Configure {
            cluster_id,
            bootstrap_blob,
            shard_metadata,
        } = params
        {
            if cluster_id.is_empty() {
                return Err(KitError::InvalidArgument(
                    "cluster_id must not be empty".into(),
                ));
            }
            check_len("cluster_id", cluster_id, limits.max_cluster_id_bytes)?;
            if bootstrap_blob.len() > limits.max_bootstrap_blob_bytes {
                return Err(KitError::InvalidArgument(format!(
                    "bootstrap_blob is {} bytes; the cap is {}",
                    bootstrap_blob.len(),
                    limits.max_bootstrap_blob_bytes
                )));
            }
            if shard_metadata.len() > limits.max_metadata_entries {
                return Err(KitError::InvalidArgument(format!(
                    "shard_metadata has {} entries; the cap is {}",
                    shard_metadata.len(),
                    limits.max_metadata_entries
                )));
            }
            for (key, value) in shard_metadata {
                check_len("a shard_metadata key", key, limits.max_metadata_key_bytes)?;
                if value.len() > limits.max_metadata_value_bytes {
                    return Err(KitError::InvalidArgument(format!(
                        "shard_metadata value for key {} is {} bytes; the cap is {} bytes",
                        echo_prefix(key),
                        value.len(),
                        limits.max_metadata_value_bytes
                    )));
                }
            }
            let bytes: usize = shard_metadata.iter().map(|(k, v)| k.len() + v.len()).sum();
            if bytes > limits.max_metadata_bytes {
                return Err(KitError::InvalidArgument(format!(
                    "shard_metadata is {bytes} bytes; the cap is {}",
                    limits.max_metadata_bytes
                )));
            }
        }
        Ok(())
    }

    /// A refusal of a token that the contract accepts (none, unmutated).
    #[cfg(feature = "mutants")]
    fn mutant_token_error(&self, token: &Token) -> Option<KitError> {
        (self.reject_negative_tokens && (token.epoch < 0 || token.sequence < 0))
            .then(|| KitError::InvalidArgument("negative fencing token".into()))
    }

    /// A refusal of a token that the contract accepts (none, unmutated).
    #[cfg(not(feature = "mutants"))]
    fn mutant_token_error(&self, _token: &Token) -> Option<KitError> {
        None
    }
}
