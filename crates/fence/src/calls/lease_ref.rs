//! The lease a release, complete or renew acts on: from `--lease FILE` or from its flags.

use fence_core::{Generation, JobId, Owner, secret::LeaseKey};

use super::warn_if_others_may_read;
use crate::cli::FinishCmd;

/// The longest `--lease` file or stdin read, in bytes.
const MAX_LEASE_FILE: u64 = 64 * 1024;

/// The job in FENCE_JOB, where set: `--job`'s stand-in when no `--lease` file is given.
fn job_from_env() -> anyhow::Result<Option<JobId>> {
    match std::env::var("FENCE_JOB") {
        Ok(text) => text
            .parse()
            .map(Some)
            .map_err(|e| crate::Usage::error(format!("FENCE_JOB: {e}"))),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(crate::Usage::error(
            "FENCE_JOB is not valid UTF-8 (a job id is 1 to 256 visible ASCII characters)",
        )),
    }
}

/// The key in FENCE_LEASE_KEY, where set: `--lease-key`'s stand-in when no `--lease` file
/// is given (read here, not by clap, so that a key exported for another lease does not
/// conflict with `--lease`). Its value is never repeated in an error.
fn key_from_env() -> anyhow::Result<Option<LeaseKey>> {
    match std::env::var("FENCE_LEASE_KEY") {
        Ok(text) => crate::cli::parse_lease_key(&text)
            .map(Some)
            .map_err(|e| crate::Usage::error(format!("FENCE_LEASE_KEY: {e}"))),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(crate::Usage::error(
            "FENCE_LEASE_KEY is not valid UTF-8 (a lease key is base64url)",
        )),
    }
}

/// A lease a command acts on: from `--lease FILE` (the JSON `fence claim` printed) or from
/// `--job`, `--owner`, `--generation` and `--lease-key`.
#[derive(Debug)]
pub struct LeaseRef {
    /// The job.
    pub job: JobId,
    /// Its holder.
    pub owner: Owner,
    /// The generation held.
    pub generation: Generation,
    /// The proof of the lease.
    pub key: LeaseKey,
}

impl LeaseRef {
    /// The lease `a` names.
    ///
    /// # Errors
    /// A usage error naming the file and the field when `--lease` cannot be read or lacks a
    /// field, or names another job than `--job`.
    pub fn of(a: &FinishCmd) -> anyhow::Result<Self> {
        let Some(path) = &a.lease else {
            // clap requires the owner, generation and key when --lease is absent.
            let missing = || {
                crate::Usage::error(
                    "give --lease, or --job (or FENCE_JOB), --owner, --generation and --lease-key (or FENCE_LEASE_KEY)",
                )
            };
            let key = match &a.lease_key {
                Some(key) => Some(key.clone()),
                None => key_from_env()?,
            };
            let job = match &a.job {
                Some(job) => Some(job.clone()),
                None => job_from_env()?,
            };
            return Ok(Self {
                job: job.ok_or_else(missing)?,
                owner: a.owner.clone().ok_or_else(missing)?,
                generation: Generation::new(a.generation.ok_or_else(missing)?),
                key: key.ok_or_else(missing)?,
            });
        };
        // At most 64 KiB either way (a lease is a few hundred bytes): `--lease /dev/zero`
        // is refused, not read until memory runs out.
        let read_lease = |from: &mut dyn std::io::Read, source: &str| {
            let mut text = String::new();
            std::io::Read::read_to_string(
                &mut std::io::Read::take(from, MAX_LEASE_FILE + 1),
                &mut text,
            )
            .map_err(|e| crate::Usage::error(format!("cannot read {source}: {e}")))?;
            if text.len() as u64 > MAX_LEASE_FILE {
                return Err(crate::Usage::error(format!(
                    "{source} is longer than {MAX_LEASE_FILE} bytes: not the JSON `fence claim` printed"
                )));
            }
            Ok(text)
        };
        let (text, source) = if path.as_os_str() == "-" {
            let source = "--lease - (stdin)".to_owned();
            (read_lease(&mut std::io::stdin(), &source)?, source)
        } else {
            let source = format!("--lease {}", path.display());
            let mut file = std::fs::File::open(path)
                .map_err(|e| crate::Usage::error(format!("cannot read {source}: {e}")))?;
            // The file holds the lease key: whoever reads it may release or complete the job.
            warn_if_others_may_read(path, "--lease");
            (read_lease(&mut file, &source)?, source)
        };
        let lease = Self::parse(&text).map_err(|e| {
            crate::Usage::error(format!(
                "{source}: {e} (expected the JSON `fence claim` printed)"
            ))
        })?;
        if let Some(job) = &a.job
            && *job != lease.job
        {
            return Err(crate::Usage::error(format!(
                "{source} is a lease of job {}, not of --job {job}",
                lease.job
            )));
        }
        Ok(lease)
    }

    /// The lease in `text`, or what is wrong with it (never the key itself).
    fn parse(text: &str) -> Result<Self, String> {
        let value: serde_json::Value =
            serde_json::from_str(text.trim()).map_err(|e| format!("not JSON: {e}"))?;
        let field = |name: &str| {
            value
                .get(name)
                .ok_or_else(|| format!("no \"{name}\" field"))
        };
        let text_of = |name: &str| {
            field(name)?
                .as_str()
                .ok_or_else(|| format!("\"{name}\" is not a string"))
        };
        let job: JobId = text_of("job")?
            .parse()
            .map_err(|e| format!("\"job\": {e}"))?;
        let owner: Owner = text_of("owner")?
            .parse()
            .map_err(|e| format!("\"owner\": {e}"))?;
        let generation = field("generation")?
            .as_u64()
            .ok_or("\"generation\" is not an integer from 0 to 2^64 - 1")?;
        let key =
            LeaseKey::new(text_of("lease_key")?).map_err(|e| format!("\"lease_key\": {e}"))?;
        Ok(Self {
            job,
            owner,
            generation: Generation::new(generation),
            key,
        })
    }
}
