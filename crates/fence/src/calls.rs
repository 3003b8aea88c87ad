//! The one-shot lease calls of the command line: claim, renew, release, complete, status.

use anyhow::Context as _;
use fence_core::{
    JobId,
    lease_api::{Action, ClaimRequest, FinishRequest, RenewRequest},
};
use fence_lease::HttpLeaseStore;

use crate::cli::{ClaimCmd, FinishCmd, RenewCmd, ServerUrl};

/// What a one-shot call sends.
#[derive(Debug)]
pub enum Call {
    /// `fence claim`.
    Claim(ClaimCmd),
    /// `fence renew`.
    Renew(RenewCmd),
    /// `fence release`.
    Release(FinishCmd),
    /// `fence complete`.
    Complete(FinishCmd),
    /// `fence status`.
    Status(ServerUrl),
}

/// Makes the call, prints the server's answer as it came, and returns the exit code: 0 on
/// success, 3 on a held or lost lease or a completed job, 2 on a 400, 1 otherwise.
///
/// # Errors
/// When the server URL is invalid or the server cannot be reached.
pub async fn call(call: Call) -> anyhow::Result<i32> {
    let (at, action, body): (&ServerUrl, Option<Action>, Option<serde_json::Value>) = match &call {
        Call::Claim(a) => {
            let owner = a.owner.clone().unwrap_or_else(fence_lease::default_owner);
            let body = ClaimRequest { owner, ttl: a.ttl };
            (
                &a.at,
                Some(Action::Claim),
                Some(serde_json::to_value(body)?),
            )
        }
        Call::Renew(a) => {
            let body = RenewRequest {
                owner: a.lease.owner.clone(),
                generation: fence_core::Generation::new(a.lease.generation),
                ttl: a.ttl,
            };
            (
                &a.lease.at,
                Some(Action::Renew),
                Some(serde_json::to_value(body)?),
            )
        }
        Call::Release(a) | Call::Complete(a) => {
            let action = if matches!(call, Call::Complete(_)) {
                Action::Complete
            } else {
                Action::Release
            };
            let body = FinishRequest {
                owner: a.owner.clone(),
                generation: fence_core::Generation::new(a.generation),
            };
            (&a.at, Some(action), Some(serde_json::to_value(body)?))
        }
        Call::Status(at) => (at, None, None),
    };
    let server = HttpLeaseStore::new(&at.server)?;
    let job: &JobId = &at.job;
    let (status, answer) = server
        .call(job, action, body.as_ref())
        .await
        .with_context(|| format!("cannot reach {}", server.base_url()))?;
    println!("{}", String::from_utf8_lossy(&answer).trim_end());
    Ok(match status.as_u16() {
        200 => 0,
        409 | 410 => 3,
        400 => 2,
        _ => 1,
    })
}
