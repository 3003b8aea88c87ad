//! Checkpoints under the generation (contract section 14): the holder's saved progress.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{BodyError, Fields};
use crate::{Generation, Owner, secret::LeaseKey};

/// The largest checkpoint a lease server takes by default, in bytes of UTF-8 (its
/// `--max-checkpoint-bytes`).
pub const DEFAULT_MAX_CHECKPOINT_BYTES: usize = 8 << 10;

/// The largest checkpoint any lease server takes, in bytes of UTF-8.
pub const MAX_CHECKPOINT_BYTES: usize = 64 << 10;

/// The largest body of `POST /v1/leases/{job}/checkpoint`: the checkpoint, JSON-escaped (six
/// bytes a character at worst), and the other fields. Every other lease call keeps 16 KiB.
pub const MAX_CHECKPOINT_BODY: usize = 6 * MAX_CHECKPOINT_BYTES + 1024;

/// A saved checkpoint, as a claim returns it: the text, and the generation whose holder saved
/// it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The generation that saved it.
    pub generation: Generation,
    /// What the holder saved: any UTF-8 text, opaque to fence (base64 for bytes).
    pub data: String,
}

/// `POST /v1/leases/{job}/checkpoint`: the holder saves its progress with its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckpointRequest {
    /// The holder.
    pub owner: Owner,
    /// The generation it holds.
    pub generation: Generation,
    /// The key it claimed with.
    pub lease_key: LeaseKey,
    /// The checkpoint: UTF-8 text, at most the server's `--max-checkpoint-bytes` (8 KiB by
    /// default, 64 KiB at most) as UTF-8.
    pub checkpoint: String,
}

impl CheckpointRequest {
    /// Parses a request body, strictly; the size limit is the server's to check.
    ///
    /// # Errors
    /// When it is not a JSON object of exactly these fields with valid values.
    pub fn from_json(bytes: &[u8]) -> Result<Self, BodyError> {
        let f = Fields::parse(bytes, &["owner", "generation", "lease_key", "checkpoint"])?;
        let checkpoint = match f.0.get("checkpoint") {
            None => return Err(BodyError::new("checkpoint", "missing")),
            Some(Value::String(s)) => s.clone(),
            Some(_) => {
                return Err(BodyError::new(
                    "checkpoint",
                    "must be a string (base64-encode bytes)",
                ));
            }
        };
        Ok(Self {
            owner: f.owner()?,
            generation: f.generation()?,
            lease_key: f.lease_key()?,
            checkpoint,
        })
    }
}
