//! The sink's admin API as types: a job's fence, and pushing a revoked generation to it.
//!
//! `fence proxy`'s admin listener serves them (contract sections 10 and 11); `fence revoke
//! --sink` is their client.
//!
//! ```
//! use fence_core::sink_api::AdvanceRequest;
//!
//! let push = AdvanceRequest::from_json(br#"{"token": "8.1700000000000.c2ln"}"#)?;
//! assert_eq!(push.token, "8.1700000000000.c2ln");
//! assert!(AdvanceRequest::from_json(br#"{"token": "8", "x": 1}"#).is_err());
//! # Ok::<(), fence_core::lease_api::BodyError>(())
//! ```

use serde::{Deserialize, Serialize};

use crate::{JobId, lease_api::BodyError};

/// The path of a job's fence on a sink's admin listener, `/v1/fence/{job}`, with the job id
/// percent-encoded.
pub fn fence_path(job: &JobId) -> String {
    format!(
        "/v1/fence/{}",
        crate::lease_api::percent_encode(job.as_str())
    )
}

/// The largest token string a push may carry, in bytes (a signed token is far shorter).
const MAX_TOKEN_LEN: usize = 1024;

/// `POST /v1/fence/{job}`: raise the job's highest generation to the one `token` carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdvanceRequest {
    /// The signed token of the generation to raise to, as the lease server gave it.
    pub token: String,
}

impl AdvanceRequest {
    /// Parses a request body, strictly.
    ///
    /// # Errors
    /// When it is not a JSON object with exactly a string `token` of at most 1024 bytes.
    pub fn from_json(bytes: &[u8]) -> Result<Self, BodyError> {
        let push: Self = serde_json::from_slice(bytes).map_err(|e| BodyError {
            field: "body".into(),
            reason: format!("must be {{\"token\": \"<signed token>\"}}: {e}"),
        })?;
        if push.token.len() > MAX_TOKEN_LEN {
            return Err(BodyError {
                field: "token".into(),
                reason: format!("longer than {MAX_TOKEN_LEN} bytes"),
            });
        }
        Ok(push)
    }
}

/// A job's fence as a sink sees it: the answer to `GET` and `POST /v1/fence/{job}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FenceView {
    /// The job.
    pub job: JobId,
    /// The highest generation the sink has accepted (or been pushed).
    pub highest: u64,
    /// Admitted requests still running (only in `GET`'s answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_flight: Option<usize>,
}
