//! Verification of signed tokens, cached per job so the fast path verifies once per token.
//!
//! The same-generation fast path verifies once per (job, generation, signature), not once per
//! request.

use dashmap::DashMap;
use fence_core::{Generation, JobId, signing::TokenVerifier};

pub(crate) struct Signatures {
    verifier: TokenVerifier,
    verified: DashMap<JobId, (Generation, u64, Box<str>)>,
}

impl Signatures {
    pub(crate) fn new(verifier: TokenVerifier) -> Self {
        Self {
            verifier,
            verified: DashMap::new(),
        }
    }

    /// Whether `signature` is valid for `job` at `generation` ending at `expires_at_ms`; at
    /// most `capacity` jobs' verified tokens are remembered. The whole token is the cache's
    /// key: a remembered signature paired with another expiry is verified afresh (and fails).
    pub(crate) fn check(
        &self,
        job: &JobId,
        generation: Generation,
        expires_at_ms: u64,
        signature: &str,
        capacity: usize,
    ) -> bool {
        if let Some(hit) = self.verified.get(job)
            && hit.0 == generation
            && hit.1 == expires_at_ms
            && *hit.2 == *signature
        {
            return true;
        }
        if !self
            .verifier
            .verify(job, generation, expires_at_ms, signature)
        {
            return false;
        }
        if self.verified.len() >= capacity.max(1) {
            self.verified.clear(); // bounded: start over rather than grow
        }
        self.verified
            .insert(job.clone(), (generation, expires_at_ms, signature.into()));
        true
    }
}
