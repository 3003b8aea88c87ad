//! A lease store that signs the fencing token of every lease it grants (contract section 6).

use fence_core::{
    JobId, Owner,
    lease_api::{ListQuery, slot_job},
    secret::LeaseKey,
    signing::TokenSigner,
};

use super::{
    ClaimTerms, LeaseOp, LeaseRecord, LeaseStore, ListPage, Outcome, SlotClaim, StoreError,
};

/// Wraps any [`LeaseStore`] so that every granted lease carries its signed token string.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use fence_core::signing::TokenSigner;
/// use fence_lease::{LeaseStore, MemoryLeaseStore, Outcome, SigningLeaseStore, Ttl};
///
/// let store = SigningLeaseStore::new(MemoryLeaseStore::new(), TokenSigner::from_seed([9; 32]));
/// let key = fence_lease::new_lease_key()?;
/// let Outcome::Granted(g) = store.claim(&"j".parse()?, &"w".parse()?, &key, Ttl::DEFAULT).await? else { panic!() };
/// assert!(g.token.unwrap().starts_with(&format!("1.{}.", g.expires_at_ms)));
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
    async fn apply(&self, job: &JobId, op: LeaseOp) -> Result<Outcome, StoreError> {
        Ok(match self.inner.apply(job, op).await? {
            Outcome::Granted(mut g) => {
                g.token = Some(self.signer.sign(job, g.generation, g.expires_at_ms));
                Outcome::Granted(g)
            }
            Outcome::Revoked(mut r) => {
                if let Some(expires_at_ms) = r.expires_at_ms {
                    let generation = r.record.generation;
                    r.token = Some(self.signer.sign(job, generation, expires_at_ms));
                }
                Outcome::Revoked(r)
            }
            other => other,
        })
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        self.inner.get(job).await
    }

    /// Signs a granted slot's token for the slot's job, its fencing job.
    async fn claim_slot(
        &self,
        resource: &JobId,
        owner: &Owner,
        key: &LeaseKey,
        terms: ClaimTerms,
        slots: u32,
    ) -> Result<SlotClaim, StoreError> {
        let mut claim = self
            .inner
            .claim_slot(resource, owner, key, terms, slots)
            .await?;
        if let (Some(slot), Outcome::Granted(g)) = (claim.slot, &mut claim.outcome) {
            let job = slot_job(resource, slot);
            g.token = Some(self.signer.sign(&job, g.generation, g.expires_at_ms));
        }
        Ok(claim)
    }

    fn is_shared(&self) -> bool {
        self.inner.is_shared()
    }

    fn changes(&self) -> Option<tokio::sync::broadcast::Receiver<fence_storage::Notice>> {
        self.inner.changes()
    }

    async fn forget_idle(
        &self,
        idle_for: std::time::Duration,
        limit: usize,
    ) -> Result<usize, StoreError> {
        self.inner.forget_idle(idle_for, limit).await
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.inner.list(query).await
    }
}
