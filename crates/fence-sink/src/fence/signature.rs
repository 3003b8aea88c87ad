//! Verification of signed tokens with a per-job cache, so the same-generation fast path
//! verifies once per (job, generation, signature), not once per request.

use dashmap::DashMap;
use fence_core::{Generation, JobId, signing::TokenVerifier};

pub(crate) struct Signatures {
    verifier: TokenVerifier,
    verified: DashMap<JobId, (Generation, Box<str>)>,
    capacity: usize,
}

impl Signatures {
    pub(crate) fn new(verifier: TokenVerifier, capacity: usize) -> Self {
        Self {
            verifier,
            verified: DashMap::new(),
            capacity: capacity.max(1),
        }
    }

    /// Whether `signature` is valid for `job` at `generation`.
    pub(crate) fn check(&self, job: &JobId, generation: Generation, signature: &str) -> bool {
        if let Some(hit) = self.verified.get(job) {
            if hit.0 == generation && *hit.1 == *signature {
                return true;
            }
        }
        if !self.verifier.verify(job, generation, signature) {
            return false;
        }
        if self.verified.len() >= self.capacity {
            self.verified.clear(); // bounded: start over rather than grow
        }
        self.verified
            .insert(job.clone(), (generation, signature.into()));
        true
    }
}
