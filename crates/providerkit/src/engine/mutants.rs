//! The hooks of the deliberately broken behaviours. Each has a `mutants`
//! build that can misbehave and a normal build that cannot; nothing else in
//! the engine is feature-gated.

use std::collections::HashMap;

use super::Engine;
use crate::error::KitError;
use crate::fence::Token;
use crate::model::TransitionError;

impl Engine {
    #[cfg(feature = "mutants")]
    pub(super) fn mutant_bump_on_reconcile(&self) -> bool {
        self.opts.mutants.bump_revision_on_reconcile
    }

    #[cfg(not(feature = "mutants"))]
    pub(super) fn mutant_bump_on_reconcile(&self) -> bool {
        false
    }

    #[cfg(feature = "mutants")]
    pub(super) fn fence_key<'a>(&self, id: &'a str) -> &'a str {
        if self.opts.mutants.fence_per_shard {
            ""
        } else {
            id
        }
    }

    #[cfg(not(feature = "mutants"))]
    pub(super) fn fence_key<'a>(&self, id: &'a str) -> &'a str {
        id
    }

    pub(super) fn out_of_position(&self, refusal: TransitionError) -> KitError {
        #[cfg(feature = "mutants")]
        if self.opts.mutants.out_of_position_failed_precondition {
            return KitError::Fenced(refusal.to_string());
        }
        KitError::Conflict(refusal)
    }

    #[cfg(feature = "mutants")]
    pub(super) fn stored_metadata(
        &self,
        metadata: &HashMap<String, String>,
    ) -> HashMap<String, String> {
        if self.opts.mutants.truncate_metadata {
            return metadata
                .iter()
                .take(8)
                .map(|(k, v)| (k.clone(), v.chars().take(16).collect()))
                .collect();
        }
        metadata.clone()
    }

    #[cfg(not(feature = "mutants"))]
    pub(super) fn stored_metadata(
        &self,
        metadata: &HashMap<String, String>,
    ) -> HashMap<String, String> {
        metadata.clone()
    }

    #[cfg(feature = "mutants")]
    pub(super) fn mutant_frozen_list_head(&self) -> bool {
        self.opts.mutants.frozen_list_head
    }

    #[cfg(not(feature = "mutants"))]
    pub(super) fn mutant_frozen_list_head(&self) -> bool {
        false
    }

    #[cfg(feature = "mutants")]
    pub(super) fn mutant_token_error(&self, token: &Token) -> Option<KitError> {
        (self.opts.mutants.reject_negative_tokens && (token.epoch < 0 || token.sequence < 0))
            .then(|| KitError::InvalidArgument("negative fencing token".into()))
    }

    #[cfg(not(feature = "mutants"))]
    pub(super) fn mutant_token_error(&self, _token: &Token) -> Option<KitError> {
        None
    }
}
