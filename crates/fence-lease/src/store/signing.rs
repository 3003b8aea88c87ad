//! A lease store that signs the fencing token of every lease it grants (contract section 6).

use fence_core::{Generation, JobId, Owner, signing::TokenSigner};

use super::{ClaimOutcome, FinishOutcome, LeaseRecord, LeaseStore, RenewOutcome, StoreError};
use crate::Ttl;

/// Wraps any [`LeaseStore`] so that every granted lease carries its signed token string.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use fence_core::signing::TokenSigner;
/// use fence_lease::{ClaimOutcome, LeaseStore, MemoryLeaseStore, SigningLeaseStore, Ttl};
///
/// let store = SigningLeaseStore::new(MemoryLeaseStore::new(), TokenSigner::from_seed([9; 32]));
/// let ClaimOutcome::Granted(g) = store.claim(&"j".parse()?, &"w".parse()?, Ttl::DEFAULT).await? else { panic!() };
/// assert!(g.token.unwrap().starts_with("1."));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SigningLeaseStore<S> {
    inner: S,
    signer: TokenSigner,
}

impl<S> SigningLeaseStore<S> {
    /// Signs the grants of `inner` with `signer`.
    pub fn new(inner: S, signer: TokenSigner) -> Self {
        Self { inner, signer }
    }

    /// The wrapped store.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: LeaseStore> LeaseStore for SigningLeaseStore<S> {
    async fn claim(
        &self,
        job: &JobId,
        owner: &Owner,
        ttl: Ttl,
    ) -> Result<ClaimOutcome, StoreError> {
        Ok(match self.inner.claim(job, owner, ttl).await? {
            ClaimOutcome::Granted(mut g) => {
                g.token = Some(self.signer.sign(job, g.generation));
                ClaimOutcome::Granted(g)
            }
            other => other,
        })
    }

    async fn renew(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
        ttl: Ttl,
    ) -> Result<RenewOutcome, StoreError> {
        Ok(match self.inner.renew(job, owner, generation, ttl).await? {
            RenewOutcome::Renewed(mut g) => {
                g.token = Some(self.signer.sign(job, g.generation));
                RenewOutcome::Renewed(g)
            }
            other => other,
        })
    }

    async fn release(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
    ) -> Result<FinishOutcome, StoreError> {
        self.inner.release(job, owner, generation).await
    }

    async fn complete(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
    ) -> Result<FinishOutcome, StoreError> {
        self.inner.complete(job, owner, generation).await
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        self.inner.get(job).await
    }
}
