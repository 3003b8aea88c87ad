//! Signed fencing tokens (`docs/protocol.md` section 6): signing, verifying, key files.
//!
//! A signed token is `<generation>.<signature>`, where the signature is Ed25519 over
//! `fence-token-v1 0x00 job 0x00 generation(8 bytes, big-endian)`, written base64url without
//! padding. Keys are files of one line: the raw 32-byte key in standard base64 with padding.
//!
//! ```
//! use fence_core::{Generation, JobId, signing::{TokenSigner, TokenVerifier}};
//!
//! let signer = TokenSigner::from_seed([7; 32]);
//! let verifier = TokenVerifier::new([signer.verify_key()]);
//! let job: JobId = "invoice-42".parse()?;
//! let token = signer.sign(&job, Generation::new(8)); // "8.<86 characters>"
//! let (generation, signature) = token.split_once('.').unwrap();
//! assert_eq!(generation, "8");
//! assert!(verifier.verify(&job, Generation::new(8), signature));
//! assert!(!verifier.verify(&job, Generation::new(9), signature));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::{fmt, path::Path};

use base64::{
    Engine,
    engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD},
};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};

use crate::{Generation, JobId};

/// The bytes a token's signature covers.
pub fn message(job: &JobId, generation: Generation) -> Vec<u8> {
    let mut m = Vec::with_capacity(14 + 1 + job.as_str().len() + 1 + 8);
    m.extend_from_slice(b"fence-token-v1");
    m.push(0);
    m.extend_from_slice(job.as_str().as_bytes());
    m.push(0);
    m.extend_from_slice(&generation.get().to_be_bytes());
    m
}

/// Signs tokens with a private key.
#[derive(Clone)]
pub struct TokenSigner {
    key: SigningKey,
}

impl fmt::Debug for TokenSigner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenSigner")
            .field(
                "verify_key",
                &STANDARD.encode(self.key.verifying_key().as_bytes()),
            )
            .finish()
    }
}

impl TokenSigner {
    /// A signer from the raw 32-byte private key.
    pub fn from_seed(seed: [u8; 32]) -> Self {
        Self {
            key: SigningKey::from_bytes(&seed),
        }
    }

    /// Reads a private key file written by `fence keygen`. Refuses a file that its group or
    /// others can read.
    ///
    /// # Errors
    /// When the file is missing, unreadable, readable by group or others, or not one line of
    /// base64 encoding 32 bytes. The message names the file.
    pub fn from_file(path: &Path) -> Result<Self, KeyError> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let meta = std::fs::metadata(path)
                .map_err(|e| KeyError::new(path, format!("cannot read it: {e}")))?;
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(KeyError::new(
                    path,
                    format!(
                        "it is readable by group or others (mode {mode:o}); a private key must be 0600: chmod 600 it"
                    ),
                ));
            }
        }
        Ok(Self::from_seed(read_key(path)?))
    }

    /// The raw private key, for writing a key file.
    pub fn seed(&self) -> [u8; 32] {
        self.key.to_bytes()
    }

    /// The matching public key.
    pub fn verify_key(&self) -> VerifyKey {
        VerifyKey(self.key.verifying_key())
    }

    /// The signed token string for `job` at `generation`: `<generation>.<signature>`.
    pub fn sign(&self, job: &JobId, generation: Generation) -> String {
        let signature = self.key.sign(&message(job, generation));
        format!(
            "{generation}.{}",
            URL_SAFE_NO_PAD.encode(signature.to_bytes())
        )
    }
}

/// A public key that verifies tokens.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct VerifyKey(VerifyingKey);

impl fmt::Debug for VerifyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VerifyKey({})", STANDARD.encode(self.0.as_bytes()))
    }
}

impl VerifyKey {
    /// Reads a public key file written by `fence keygen`.
    ///
    /// # Errors
    /// When the file is missing, unreadable, not one line of base64 encoding 32 bytes, or
    /// not a valid Ed25519 public key. The message names the file.
    pub fn from_file(path: &Path) -> Result<Self, KeyError> {
        let bytes = read_key(path)?;
        VerifyingKey::from_bytes(&bytes)
            .map(Self)
            .map_err(|_| KeyError::new(path, "not a valid Ed25519 public key".into()))
    }

    /// A key from its raw 32 bytes.
    ///
    /// # Errors
    /// When the bytes are not a valid Ed25519 public key.
    pub fn from_bytes(bytes: [u8; 32]) -> Result<Self, ed25519_dalek::SignatureError> {
        VerifyingKey::from_bytes(&bytes).map(Self)
    }

    /// The key file contents: one line of standard base64.
    pub fn to_file_contents(&self) -> String {
        format!("{}\n", STANDARD.encode(self.0.as_bytes()))
    }
}

/// The key file contents of a private key: one line of standard base64.
pub fn private_key_file_contents(signer: &TokenSigner) -> String {
    format!("{}\n", STANDARD.encode(signer.seed()))
}

/// Verifies signed tokens under any of a set of keys (several during a rotation).
#[derive(Debug, Clone)]
pub struct TokenVerifier {
    keys: Vec<VerifyKey>,
}

impl TokenVerifier {
    /// A verifier accepting signatures by any of `keys`.
    pub fn new(keys: impl IntoIterator<Item = VerifyKey>) -> Self {
        Self {
            keys: keys.into_iter().collect(),
        }
    }

    /// Whether `signature` (the part after the `.`, base64url without padding) is a valid
    /// signature of `job` at `generation` under one of the keys. Anything that does not
    /// decode to exactly 64 bytes is invalid.
    pub fn verify(&self, job: &JobId, generation: Generation, signature: &str) -> bool {
        let Ok(bytes) = URL_SAFE_NO_PAD.decode(signature) else {
            return false;
        };
        let Ok(bytes) = <[u8; 64]>::try_from(bytes.as_slice()) else {
            return false;
        };
        let signature = Signature::from_bytes(&bytes);
        let message = message(job, generation);
        self.keys
            .iter()
            .any(|k| k.0.verify_strict(&message, &signature).is_ok())
    }
}

/// A key file that cannot be used; the message names the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyError {
    message: String,
}

impl KeyError {
    fn new(path: &Path, why: String) -> Self {
        Self {
            message: format!("key file {}: {why}", path.display()),
        }
    }
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for KeyError {}

fn read_key(path: &Path) -> Result<[u8; 32], KeyError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| KeyError::new(path, format!("cannot read it: {e}")))?;
    let line = text.trim_end_matches(['\n', '\r']);
    if line.contains(['\n', '\r']) || line.is_empty() {
        return Err(KeyError::new(
            path,
            "expected exactly one line of base64".into(),
        ));
    }
    let bytes = STANDARD
        .decode(line)
        .map_err(|e| KeyError::new(path, format!("not standard padded base64: {e}")))?;
    <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| {
        KeyError::new(
            path,
            format!(
                "the key is {} bytes long; an Ed25519 key is 32",
                bytes.len()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published test vectors of docs/protocol.md: (private key seed, job, generation, token).
    pub(crate) const VECTORS: &[([u8; 32], &str, u64)] = &[
        ([0; 32], "invoice-42", 7),
        ([1; 32], "job/with:odd~chars", 1),
        ([0xff; 32], "x", u64::MAX),
    ];

    #[test]
    fn vectors_are_stable() {
        let want = include_str!("../tests/vectors.txt");
        let mut got = String::new();
        for (seed, job, generation) in VECTORS {
            let signer = TokenSigner::from_seed(*seed);
            let job: JobId = job.parse().unwrap();
            let token = signer.sign(&job, Generation::new(*generation));
            let (_, signature) = token.split_once('.').unwrap();
            assert!(TokenVerifier::new([signer.verify_key()]).verify(
                &job,
                Generation::new(*generation),
                signature
            ));
            got.push_str(&format!(
                "private {}public {}job {job}\ngeneration {generation}\ntoken {token}\n\n",
                private_key_file_contents(&signer),
                signer.verify_key().to_file_contents()
            ));
        }
        assert_eq!(
            got, want,
            "the published vectors changed; that breaks every other implementation"
        );
    }

    #[test]
    fn forgeries_fail() {
        let signer = TokenSigner::from_seed([3; 32]);
        let other = TokenSigner::from_seed([4; 32]);
        let v = TokenVerifier::new([signer.verify_key()]);
        let job: JobId = "j".parse().unwrap();
        let sig = |s: &TokenSigner, j: &str, g: u64| {
            s.sign(&j.parse().unwrap(), Generation::new(g))
                .split_once('.')
                .unwrap()
                .1
                .to_owned()
        };
        let good = sig(&signer, "j", 5);
        assert!(v.verify(&job, Generation::new(5), &good));
        for bad in [
            sig(&other, "j", 5),                            // wrong key
            sig(&signer, "k", 5),                           // another job
            sig(&signer, "j", 6),                           // another generation
            good[..good.len() - 1].to_owned(),              // truncated
            format!("{good}=="),                            // padded
            good.replace('-', "+").replace('_', "/") + "+", // not base64url
            String::new(),
            "!!!".into(),
        ] {
            assert!(!v.verify(&job, Generation::new(5), &bad), "{bad:?}");
        }
    }
}
