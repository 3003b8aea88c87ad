//! Checkpoints under the generation (contract section 14): resuming from one, saving one.

use std::sync::Arc;

use fence_core::lease_api::Checkpoint;

use super::{FinishError, Lease, LossReason, Shared};
use crate::{LeaseOp, LeaseRecord, LeaseStore, Outcome, StoreError};

impl<S: LeaseStore> Lease<S> {
    /// The job's last checkpoint as the claim returned it, with the generation that saved it
    /// (a holder before this one, or this lease's own claim retried); `None` for a job that
    /// never saved one. Resume from it rather than from the start. Always `None` after
    /// [`LeaseClient::resume`](crate::LeaseClient::resume), which takes a lease over by
    /// renewing it: a worker that restarts should claim instead (the same owner and key get
    /// the same lease back, with the checkpoint).
    pub fn resumed_from(&self) -> Option<&Checkpoint> {
        self.resumed.as_ref()
    }

    /// Saves `data` as the job's checkpoint: see [`Checkpointer::save`].
    ///
    /// # Errors
    /// As [`Checkpointer::save`].
    pub async fn save_checkpoint(
        &self,
        data: impl Into<String>,
    ) -> Result<LeaseRecord, FinishError> {
        self.checkpointer().save(data).await
    }

    /// A handle that saves checkpoints of this lease, for a task of its own (it can outlive
    /// the lease: once the lease is finished or lost, it saves nothing).
    pub fn checkpointer(&self) -> Checkpointer<S> {
        Checkpointer {
            shared: self.view.shared.clone(),
            store: self.store.clone(),
        }
    }
}

/// Saves checkpoints of one lease: see [`Lease::checkpointer`].
#[derive(Debug)]
pub struct Checkpointer<S> {
    shared: Arc<Shared>,
    store: Arc<S>,
}

impl<S> Clone for Checkpointer<S> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            store: self.store.clone(),
        }
    }
}

impl<S: LeaseStore> Checkpointer<S> {
    /// Saves `data` as the job's checkpoint, under this lease: the store takes it only while
    /// this owner, generation and key still hold the job, so a stale holder's progress never
    /// replaces the current holder's. The next claim of the job returns it. Durable like every
    /// lease write; forgotten with the job. A lease server takes up to its
    /// `--max-checkpoint-bytes` (8 KiB by default) of UTF-8 text.
    ///
    /// # Errors
    /// [`FinishError::LostLocally`] without sending when the lease is lost here;
    /// [`FinishError::Lost`] or [`FinishError::KeyMismatch`] when the store refuses it (the
    /// lease is then lost: stop); [`FinishError::Store`] when the store fails or refuses the
    /// size.
    pub async fn save(&self, data: impl Into<String>) -> Result<LeaseRecord, FinishError> {
        let shared = &self.shared;
        if shared.token().is_none() {
            let reason = shared
                .reason
                .get()
                .cloned()
                .unwrap_or(LossReason::DeadlinePassed);
            return Err(FinishError::LostLocally(reason));
        }
        let op = LeaseOp::Checkpoint {
            owner: shared.owner.clone(),
            generation: shared.token.generation(),
            key: shared.key.clone(),
            data: data.into(),
        };
        match self.store.apply(&shared.job, op).await? {
            Outcome::Done(record) => Ok(record),
            Outcome::Lost { owner, generation } => {
                shared.lose(LossReason::Superseded {
                    owner: owner.clone(),
                    generation,
                });
                Err(FinishError::Lost { owner, generation })
            }
            Outcome::KeyMismatch => {
                shared.lose(LossReason::KeyRefused);
                Err(FinishError::KeyMismatch)
            }
            other => Err(FinishError::Store(StoreError::Protocol(format!(
                "the store answered a checkpoint with {other:?}"
            )))),
        }
    }
}
