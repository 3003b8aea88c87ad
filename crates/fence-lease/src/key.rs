//! Keys a worker uses: fresh lease keys from the OS's random source, derived idempotency keys.

use fence_core::secret::LeaseKey;

/// A new lease key: 32 bytes from the OS's random source, 43 base64url characters.
///
/// # Errors
/// When the OS cannot give random bytes (a system without a random source).
pub fn new_lease_key() -> Result<LeaseKey, getrandom::Error> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)?;
    Ok(LeaseKey::from_random(&bytes))
}

impl crate::LeaseView {
    /// The idempotency key of `step` of this job, for a third-party API that deduplicates by
    /// key but cannot check a fencing token: the same for every holder of every generation,
    /// so a new holder repeating a step a stale holder already sent is deduplicated by the
    /// API (for as long as it keeps keys). A semaphore slot's key is the slot's (`exports#1`):
    /// successive holders of one slot share it, whatever unit of work each does, so name the
    /// unit in `step` there. See
    /// [`IdempotencyKey::for_step`](fence_core::headers::IdempotencyKey::for_step).
    pub fn idempotency_key(&self, step: &str) -> fence_core::headers::IdempotencyKey {
        fence_core::headers::IdempotencyKey::for_step(self.job(), step)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_are_fresh_and_long_enough() {
        let (a, b) = (
            super::new_lease_key().unwrap(),
            super::new_lease_key().unwrap(),
        );
        assert_ne!(a, b);
        assert_eq!(a.expose().len(), 43);
    }

    #[tokio::test]
    async fn a_lease_derives_the_step_key_of_its_own_job() {
        let client = crate::LeaseClient::new(crate::MemoryLeaseStore::new());
        let job: fence_core::JobId = "invoice-42".parse().unwrap();
        let lease = client.claim(job.clone()).await.unwrap();
        let key = lease.idempotency_key("charge");
        assert_eq!(
            key,
            fence_core::headers::IdempotencyKey::for_step(&job, "charge")
        );
        assert_eq!(
            key.as_str(),
            "fence-94_3LSyI-83UpFvMYZSTMad586VO_w3O3VjtR9m8yGY"
        );
    }
}
