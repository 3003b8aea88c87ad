//! Fenced semaphores (contract section 15): a resource's N slots, each a lease of its own.
//!
//! A slot's fencing job is `{resource}#{slot}`.
//! `#` is reserved: a plain claim of a job id holding it is refused, so no plain job can
//! take a slot's place, and the only way to a slot is a semaphore claim, which keeps the
//! resource's N. Every other verb (renew, release, checkpoint, revoke, the sink's fence)
//! takes a slot's job id like any job id.

use serde::{Deserialize, Serialize};

use super::{BodyError, ClaimRequest, Fields, LeaseBody};
use crate::JobId;

/// The character between a resource and its slot number in a slot's job id.
pub const SLOT_SEPARATOR: char = '#';

/// The most slots a semaphore may have.
pub const MAX_SLOTS: u32 = 1_000;

/// The longest resource name: a slot's job id (`{resource}#{slot}`) stays within 256 bytes.
pub const MAX_RESOURCE_LEN: usize = 256 - 1 - 4;

/// Why a name cannot be a semaphore's resource.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceError {
    /// It holds the slot separator.
    #[error("a resource name cannot hold '#': it separates a resource from its slot number")]
    Separator,
    /// It is too long for its slots' job ids.
    #[error(
        "a resource name is at most {MAX_RESOURCE_LEN} bytes (its slots' job ids add '#' and up to 4 digits), got {0}"
    )]
    TooLong(usize),
}

/// Whether a plain claim may take `job`: no job id holding [`SLOT_SEPARATOR`] can be claimed
/// but through its semaphore.
pub fn reserved(job: &JobId) -> bool {
    job.as_str().contains(SLOT_SEPARATOR)
}

/// Checks that `resource` can name a semaphore.
///
/// # Errors
/// When it holds `#` or is longer than [`MAX_RESOURCE_LEN`].
pub fn check_resource(resource: &JobId) -> Result<(), ResourceError> {
    if reserved(resource) {
        Err(ResourceError::Separator)
    } else if resource.as_str().len() > MAX_RESOURCE_LEN {
        Err(ResourceError::TooLong(resource.as_str().len()))
    } else {
        Ok(())
    }
}

/// The job id of slot `slot` (1 to [`MAX_SLOTS`]) of `resource` (checked with
/// [`check_resource`]).
///
/// ```
/// use fence_core::lease_api::{slot_job, slot_of};
/// let slot = slot_job(&"exports".parse()?, 2);
/// assert_eq!(slot.as_str(), "exports#2");
/// assert_eq!(slot_of(&slot), Some(("exports", 2)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn slot_job(resource: &JobId, slot: u32) -> JobId {
    format!("{resource}{SLOT_SEPARATOR}{slot}")
        .parse()
        .expect("a checked resource and a slot number make a valid job id")
}

/// The resource and slot number of a slot's job id; `None` for any other job id.
pub fn slot_of(job: &JobId) -> Option<(&str, u32)> {
    let (resource, slot) = job.as_str().rsplit_once(SLOT_SEPARATOR)?;
    let number: u32 = slot.parse().ok()?;
    let canonical = !resource.is_empty()
        && !resource.contains(SLOT_SEPARATOR)
        && (1..=MAX_SLOTS).contains(&number)
        && !slot.starts_with('0')
        && slot.bytes().all(|b| b.is_ascii_digit());
    canonical.then_some((resource, number))
}

/// `POST /v1/semaphores/{resource}/claim`: a claim's fields and the number of slots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SemaphoreClaimRequest {
    /// The claim, as for a plain job.
    #[serde(flatten)]
    pub claim: ClaimRequest,
    /// How many slots the resource has (1 to [`MAX_SLOTS`]); fixed while any slot is in
    /// force (contract section 15).
    pub slots: u32,
}

impl SemaphoreClaimRequest {
    /// Parses a request body, strictly.
    ///
    /// # Errors
    /// When it is not a JSON object of exactly a claim's fields and `slots`, with valid values.
    pub fn from_json(bytes: &[u8]) -> Result<Self, BodyError> {
        const FIELDS: &[&str] = &["owner", "lease_key", "ttl_ms", "lock_delay_ms", "slots"];
        let f = Fields::parse(bytes, FIELDS)?;
        let slots = match f.u64("slots")? {
            None => return Err(BodyError::new("slots", "missing")),
            Some(n) if (1..=u64::from(MAX_SLOTS)).contains(&n) => n as u32,
            Some(n) => {
                return Err(BodyError::new(
                    "slots",
                    format!("must be an integer from 1 to {MAX_SLOTS}, got {n}"),
                ));
            }
        };
        Ok(Self {
            claim: ClaimRequest::from_fields(&f)?,
            slots,
        })
    }
}

/// A granted slot: the lease of the slot's job, with the resource, the slot number and the
/// number of slots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotBody {
    /// The slot's lease; its `job` is `{resource}#{slot}`, the fencing job of the slot.
    #[serde(flatten)]
    pub lease: LeaseBody,
    /// The resource.
    pub resource: JobId,
    /// The slot number, 1 to `slots`.
    pub slot: u32,
    /// How many slots the resource has.
    pub slots: u32,
}
