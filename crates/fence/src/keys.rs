//! Key files for signed tokens: `fence keygen` (PKCS#8 and SPKI PEM), and loading them.

use std::{
    io::Write,
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use fence_core::signing::{TokenSigner, TokenVerifier, VerifyKey};

/// A fresh signer, its key drawn from the operating system's random source.
///
/// # Errors
/// When the OS has no random source to offer.
pub fn generate_signer() -> anyhow::Result<TokenSigner> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed)
        .map_err(|e| anyhow::anyhow!("the OS's random source failed: {e}"))?;
    Ok(TokenSigner::from_seed(seed))
}

/// `fence keygen --out DIR`: writes a new key pair, never overwriting a key.
///
/// # Errors
/// When `out` cannot be created, a key file already exists, or a file cannot be written.
pub fn keygen(out: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    // Both names checked before either is written: a private key whose public half could
    // not be written would be left behind, refusing every later run.
    for name in ["fence-signing.pem", "fence-verify.pem"] {
        let path = out.join(name);
        if path.symlink_metadata().is_ok() {
            anyhow::bail!(
                "cannot create {}: it is already there (an existing key is never overwritten; give another --out)",
                path.display()
            );
        }
    }
    let signer = generate_signer()?;
    let write = |name: &str, mode: u32, contents: String| -> anyhow::Result<PathBuf> {
        let path = out.join(name);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&path)
            .with_context(|| {
                format!(
                    "cannot create {} (an existing key is never overwritten)",
                    path.display()
                )
            })?;
        file.write_all(contents.as_bytes())?;
        file.sync_all()?;
        Ok(path)
    };
    let private = write("fence-signing.pem", 0o600, signer.to_pem())?;
    let public = write("fence-verify.pem", 0o644, signer.verify_key().to_pem())?;
    // The keys are written whatever stdout does: a closed pipe or a full disk there is said
    // on stderr, not a panic.
    let said = crate::calls::stdout_line(&format!(
        "private key: {} (give it to fence server --signing-key; keep it 0600)\n\
         public key:  {} (give it to fence proxy --verify-key)",
        private.display(),
        public.display()
    ));
    if let Err(e) = said {
        say!(
            "fence: wrote {} and {}, but cannot say so on stdout: {e}",
            private.display(),
            public.display()
        );
    }
    Ok(())
}

/// A verifier of every key in `files`; `None` when there are none.
///
/// # Errors
/// When a file is missing or not a public key.
pub fn load_verifier(files: &[PathBuf]) -> anyhow::Result<Option<TokenVerifier>> {
    if files.is_empty() {
        return Ok(None);
    }
    let keys = files
        .iter()
        .map(|f| VerifyKey::from_file(f))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(TokenVerifier::new(keys)))
}
