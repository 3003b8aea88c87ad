//! Signed fencing tokens (`docs/protocol.md` section 6): signing, verifying, PEM key files.
//!
//! A signed token is `<generation>.<expires_at_ms>.<signature>`: the signature is Ed25519
//! over `fence-token-v2 0x00 job 0x00 generation(8 bytes BE) expires_at_ms(8 bytes BE)`,
//! written base64url without padding (86 characters). Keys are the PEM files every tool
//! reads: PKCS#8 (`BEGIN PRIVATE KEY`) for the signer, SPKI (`BEGIN PUBLIC KEY`) for the
//! verifiers; `openssl genpkey -algorithm ed25519` makes them too.
//!
//! ```
//! use fence_core::{Generation, JobId, signing::{TokenSigner, TokenVerifier}};
//!
//! let signer = TokenSigner::from_seed([7; 32]);
//! let verifier = TokenVerifier::new([signer.verify_key()]);
//! let job: JobId = "invoice-42".parse()?;
//! let token = signer.sign(&job, Generation::new(8), 1_700_000_030_000);
//! let mut parts = token.split('.');
//! assert_eq!((parts.next(), parts.next()), (Some("8"), Some("1700000030000")));
//! let signature = parts.next().unwrap();
//! assert!(verifier.verify(&job, Generation::new(8), 1_700_000_030_000, signature));
//! assert!(!verifier.verify(&job, Generation::new(8), 1_700_000_099_999, signature));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::{
    fmt,
    path::{Path, PathBuf},
};

use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
use ed25519_dalek::{
    Signature, Signer, SigningKey, VerifyingKey,
    pkcs8::{
        DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey,
        spki::der::pem::LineEnding,
    },
};

#[cfg(test)]
use crate::SIGNATURE_LEN;
use crate::{Generation, JobId};

/// The bytes a token's signature covers.
pub fn message(job: &JobId, generation: Generation, expires_at_ms: u64) -> Vec<u8> {
    let mut m = Vec::with_capacity(14 + 1 + job.as_str().len() + 1 + 16);
    m.extend_from_slice(b"fence-token-v2");
    m.push(0);
    m.extend_from_slice(job.as_str().as_bytes());
    m.push(0);
    m.extend_from_slice(&generation.get().to_be_bytes());
    m.extend_from_slice(&expires_at_ms.to_be_bytes());
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
            .field("verify_key", &self.verify_key())
            .finish_non_exhaustive()
    }
}

/// A key file that cannot be used: each variant names the file and says why in one line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The file cannot be read.
    #[error("key file {}: cannot read it", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A private key file that its group or others can read.
    #[error("key file {}: it is readable by group or others (mode {mode:o}); a private key must be 0600: chmod 600 it", path.display())]
    Exposed {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A public key where a private one belongs, or the reverse.
    #[error("key file {}: it holds a {found} key, but a {wanted} key is needed here ({hint})", path.display())]
    WrongKind {
        /// The file.
        path: PathBuf,
        /// What it holds: `private` or `public`.
        found: &'static str,
        /// What is needed.
        wanted: &'static str,
        /// Which file to give instead.
        hint: &'static str,
    },
    /// Not a PEM Ed25519 key of the kind needed (truncated, another algorithm, not PEM).
    #[error("key file {}: not an Ed25519 {wanted} key in PEM ({detail})", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The kind needed: `private` or `public`.
        wanted: &'static str,
        /// What the decoder said.
        detail: String,
    },
}

/// The PEM text of `path`, refused when it holds the other kind of key than `wanted`
/// (`"private"` or `"public"`), with `hint` saying which file goes where.
fn read_pem(path: &Path, wanted: &'static str, hint: &'static str) -> Result<String, KeyError> {
    let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read {
        path: path.to_owned(),
        source,
    })?;
    let found = if text.contains("-----BEGIN PRIVATE KEY-----") {
        "private"
    } else if text.contains("-----BEGIN PUBLIC KEY-----") {
        "public"
    } else {
        wanted // neither: the key parser says what is wrong with it
    };
    if found != wanted {
        return Err(KeyError::WrongKind {
            path: path.to_owned(),
            found,
            wanted,
            hint,
        });
    }
    Ok(text)
}

impl TokenSigner {
    /// A signer from the raw 32-byte private key.
    pub fn from_seed(seed: [u8; 32]) -> Self {
        Self {
            key: SigningKey::from_bytes(&seed),
        }
    }

    /// Reads a PKCS#8 PEM private key (`fence keygen`'s `fence-signing.pem`, or one made by
    /// `openssl genpkey -algorithm ed25519`). Refuses a file that its group or others can
    /// read, and a public key.
    ///
    /// # Errors
    /// As [`KeyError`] says, naming the file.
    pub fn from_file(path: &Path) -> Result<Self, KeyError> {
        let hint = "give the signing key, fence-signing.pem, to fence server --signing-key";
        let text = read_pem(path, "private", hint)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(path)
                .map_err(|source| KeyError::Read {
                    path: path.to_owned(),
                    source,
                })?
                .permissions()
                .mode()
                & 0o777;
            if mode & 0o077 != 0 {
                return Err(KeyError::Exposed {
                    path: path.to_owned(),
                    mode,
                });
            }
        }
        SigningKey::from_pkcs8_pem(&text)
            .map(|key| Self { key })
            .map_err(|e| KeyError::Invalid {
                path: path.to_owned(),
                wanted: "private",
                detail: e.to_string(),
            })
    }

    /// The private key as PKCS#8 PEM, for writing a key file: version 1 without the public
    /// key, the form `openssl genpkey -algorithm ed25519` writes and every library reads.
    pub fn to_pem(&self) -> String {
        let bytes = ed25519_dalek::pkcs8::KeypairBytes {
            secret_key: self.key.to_bytes(),
            public_key: None,
        };
        // Encoding 32 bytes into PKCS#8 cannot fail.
        bytes
            .to_pkcs8_pem(LineEnding::LF)
            .map(|pem| pem.to_string())
            .unwrap_or_default()
    }

    /// The matching public key.
    pub fn verify_key(&self) -> VerifyKey {
        VerifyKey(self.key.verifying_key())
    }

    /// The signed token string for `job` at `generation`, for a lease that ends at
    /// `expires_at_ms`: `<generation>.<expires_at_ms>.<signature>`.
    pub fn sign(&self, job: &JobId, generation: Generation, expires_at_ms: u64) -> String {
        let signature = self.key.sign(&message(job, generation, expires_at_ms));
        format!(
            "{generation}.{expires_at_ms}.{}",
            URL_SAFE_NO_PAD.encode(signature.to_bytes())
        )
    }
}

/// A public key that verifies tokens.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct VerifyKey(VerifyingKey);

impl fmt::Debug for VerifyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "VerifyKey({})",
            URL_SAFE_NO_PAD.encode(self.0.as_bytes())
        )
    }
}

impl VerifyKey {
    /// Reads an SPKI PEM public key (`fence keygen`'s `fence-verify.pem`, or `openssl pkey
    /// -pubout`'s). Refuses a private key.
    ///
    /// # Errors
    /// As [`KeyError`] says, naming the file.
    pub fn from_file(path: &Path) -> Result<Self, KeyError> {
        let hint = "give the verify key, fence-verify.pem, to fence proxy --verify-key; keep the private key on the lease server";
        let text = read_pem(path, "public", hint)?;
        VerifyingKey::from_public_key_pem(&text)
            .map(Self)
            .map_err(|e| KeyError::Invalid {
                path: path.to_owned(),
                wanted: "public",
                detail: e.to_string(),
            })
    }

    /// A key from its raw 32 bytes.
    ///
    /// # Errors
    /// When the bytes are not a valid Ed25519 public key.
    pub fn from_bytes(bytes: [u8; 32]) -> Result<Self, ed25519_dalek::SignatureError> {
        VerifyingKey::from_bytes(&bytes).map(Self)
    }

    /// The key as SPKI PEM, for writing a key file.
    pub fn to_pem(&self) -> String {
        // Encoding 32 bytes into SPKI cannot fail.
        self.0.to_public_key_pem(LineEnding::LF).unwrap_or_default()
    }
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

    /// Whether `signature` (the third part of a token, base64url without padding) is a valid
    /// signature of `job` at `generation` ending at `expires_at_ms` under one of the keys.
    /// Anything that does not decode to exactly 64 bytes is invalid.
    pub fn verify(
        &self,
        job: &JobId,
        generation: Generation,
        expires_at_ms: u64,
        signature: &str,
    ) -> bool {
        let Ok(bytes) = URL_SAFE_NO_PAD.decode(signature) else {
            return false;
        };
        let Ok(bytes) = <[u8; 64]>::try_from(bytes.as_slice()) else {
            return false;
        };
        let signature = Signature::from_bytes(&bytes);
        let message = message(job, generation, expires_at_ms);
        self.keys
            .iter()
            .any(|k| k.0.verify_strict(&message, &signature).is_ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published test vectors of `docs/protocol.md`: (private key seed, job, generation,
    /// expiry).
    const VECTORS: &[([u8; 32], &str, u64, u64)] = &[
        ([0; 32], "invoice-42", 7, 1_700_000_030_000),
        ([1; 32], "job/with:odd~chars", 1, 0),
        ([0xff; 32], "x", u64::MAX, u64::MAX),
    ];

    /// A signer's Debug names its public key, which an operator can compare with the
    /// proxies' --verify-key, and never its private key (logs are read by many).
    #[test]
    fn debug_shows_the_public_key_only() {
        let signer = TokenSigner::from_seed([9; 32]);
        let public = URL_SAFE_NO_PAD.encode(signer.verify_key().0.as_bytes());
        let private = URL_SAFE_NO_PAD.encode([9u8; 32]);
        let shown = format!("{signer:?}");
        assert_eq!(
            shown,
            format!("TokenSigner {{ verify_key: VerifyKey({public}), .. }}")
        );
        assert!(!shown.contains(&private), "{shown}");
    }

    #[test]
    fn vectors_are_stable() {
        let want = include_str!("../tests/vectors.txt");
        let mut got = String::new();
        for (seed, job, generation, expires) in VECTORS {
            let signer = TokenSigner::from_seed(*seed);
            let job: JobId = job.parse().unwrap();
            let token = signer.sign(&job, Generation::new(*generation), *expires);
            let signature = token.rsplit('.').next().unwrap();
            assert_eq!(signature.len(), SIGNATURE_LEN);
            assert!(TokenVerifier::new([signer.verify_key()]).verify(
                &job,
                Generation::new(*generation),
                *expires,
                signature
            ));
            got.push_str(&format!(
                "{}{}job {job}\ngeneration {generation}\nexpires_at_ms {expires}\ntoken {token}\n\n",
                signer.to_pem(),
                signer.verify_key().to_pem()
            ));
        }
        if std::env::var_os("FENCE_BLESS_VECTORS").is_some() {
            // Only when the token format itself changes, on purpose: writes the new vectors.
            std::fs::write(
                concat!(env!("CARGO_MANIFEST_DIR"), "/tests/vectors.txt"),
                &got,
            )
            .unwrap();
            return;
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
        let sig = |s: &TokenSigner, j: &str, g: u64, e: u64| {
            let token = s.sign(&j.parse().unwrap(), Generation::new(g), e);
            token.rsplit('.').next().unwrap().to_owned()
        };
        let good = sig(&signer, "j", 5, 9);
        assert!(v.verify(&job, Generation::new(5), 9, &good));
        for bad in [
            sig(&other, "j", 5, 9),                         // wrong key
            sig(&signer, "k", 5, 9),                        // another job
            sig(&signer, "j", 6, 9),                        // another generation
            sig(&signer, "j", 5, 10),                       // another expiry
            good[..good.len() - 1].to_owned(),              // truncated
            format!("{good}=="),                            // padded
            good.replace('-', "+").replace('_', "/") + "+", // not base64url
            String::new(),
            "!!!".into(),
        ] {
            assert!(!v.verify(&job, Generation::new(5), 9, &bad), "{bad:?}");
        }
    }

    #[test]
    fn pem_files_round_trip_and_the_wrong_kind_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("fence-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let signer = TokenSigner::from_seed([5; 32]);
        let private = dir.join("signing.pem");
        let public = dir.join("verify.pem");
        std::fs::write(&private, signer.to_pem()).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&public, signer.verify_key().to_pem()).unwrap();
        assert!(signer.to_pem().starts_with("-----BEGIN PRIVATE KEY-----\n"));
        assert!(
            signer
                .verify_key()
                .to_pem()
                .starts_with("-----BEGIN PUBLIC KEY-----\n")
        );
        let read = TokenSigner::from_file(&private).unwrap();
        assert_eq!(read.verify_key(), signer.verify_key());
        assert_eq!(VerifyKey::from_file(&public).unwrap(), signer.verify_key());
        assert!(matches!(
            VerifyKey::from_file(&private),
            Err(KeyError::WrongKind {
                found: "private",
                ..
            })
        ));
        assert!(matches!(
            TokenSigner::from_file(&public),
            Err(KeyError::WrongKind {
                found: "public",
                ..
            })
        ));
        let pem = signer.to_pem();
        std::fs::write(&private, &pem[..pem.len() / 2]).unwrap();
        assert!(matches!(
            TokenSigner::from_file(&private),
            Err(KeyError::Invalid { .. })
        ));
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::write(&private, &pem).unwrap();
        assert!(matches!(
            TokenSigner::from_file(&private),
            Err(KeyError::Exposed { mode: 0o644, .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
