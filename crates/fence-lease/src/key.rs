//! Fresh lease keys from the operating system's random source.

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
}
