//! The JSON bodies the lease server answers with (PROTOCOL.md section 4), shared by the
//! server and its clients. Times are milliseconds; generations are JSON integers.

use serde::{Deserialize, Serialize};

use crate::{JobId, Owner};

/// The path of a lease operation: `/v1/leases/{job}` plus `/claim`, `/renew`, `/release`
/// or `/complete` (empty for a GET), with the job id percent-encoded.
pub fn lease_path(job: &JobId, op: &str) -> String {
    let mut path = String::from("/v1/leases/");
    for b in job.as_str().bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            path.push(char::from(b));
        } else {
            path.push_str(&format!("%{b:02X}"));
        }
    }
    if !op.is_empty() {
        path.push('/');
        path.push_str(op);
    }
    path
}

/// A granted lease: the answer to a successful claim or renewal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseBody {
    /// The job.
    pub job: JobId,
    /// The holder.
    pub owner: Owner,
    /// The generation: the fencing token.
    pub generation: u64,
    /// The duration granted.
    pub ttl_ms: u64,
    /// When it expires on the server's clock, in ms since the Unix epoch.
    pub expires_at_ms: u64,
    /// The signed token string, when the server signs tokens (contract section 6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// A job's lease record: the answer to release, complete and status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordBody {
    /// The job.
    pub job: JobId,
    /// The holder, last holder or completer; null when free.
    pub owner: Option<Owner>,
    /// The generation of the last claim.
    pub generation: u64,
    /// `free`, `held`, `expired` or `completed`.
    pub state: String,
    /// How long the lease has left (0 unless held).
    pub expires_in_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_percent_encode_the_job() {
        let job: JobId = "a/b%c?d#e f".replace(' ', "+").parse().unwrap();
        assert_eq!(
            lease_path(&job, "claim"),
            "/v1/leases/a%2Fb%25c%3Fd%23e%2Bf/claim"
        );
        assert_eq!(
            lease_path(&"x~_.-9".parse().unwrap(), ""),
            "/v1/leases/x~_.-9"
        );
    }
}
