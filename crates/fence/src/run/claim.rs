//! `fence run`'s claim: waiting at the server while the job is held, within `--wait`.

use std::time::Duration;

use fence_core::JobId;
use fence_lease::{Backoff, ClaimError, HttpLeaseStore, Lease, LeaseClient};
use tokio::time::Instant;

use super::words::Repeats;

pub(super) async fn claim_within(
    client: &LeaseClient<HttpLeaseStore>,
    job: &JobId,
    wait: Duration,
) -> anyhow::Result<Option<Lease<HttpLeaseStore>>> {
    let give_up = Instant::now() + wait;
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut warnings = Repeats::default();
    loop {
        // The server holds the claim until the job frees (first come, first served).
        let left = give_up.saturating_duration_since(Instant::now());
        let pause = match client.claim_waiting(job.clone(), left).await {
            Ok(lease) => return Ok(Some(lease)),
            Err(ClaimError::Completed { generation, .. }) => {
                eprintln!(
                    "fence run: job {job} is completed (generation {generation}); not running the command"
                );
                return Ok(None);
            }
            Err(ClaimError::Held {
                owner, expires_in, ..
            }) => {
                if Instant::now() >= give_up {
                    eprintln!(
                        "fence run: job {job} is held by {owner} for another {expires_in:?}; gave up after --wait {wait:?}"
                    );
                    return Ok(None);
                }
                Duration::ZERO // the server's wait ended early: ask again
            }
            Err(ClaimError::LockDelay {
                owner,
                claimable_in,
                ..
            }) => {
                if Instant::now() >= give_up {
                    eprintln!(
                        "fence run: the lease of {owner} on job {job} expired and its lock-delay keeps the job for another {claimable_in:?}; gave up after --wait {wait:?}"
                    );
                    return Ok(None);
                }
                Duration::ZERO
            }
            Err(e @ ClaimError::Timing(_)) => return Err(e.into()),
            Err(e) => {
                if Instant::now() >= give_up {
                    warnings.flush();
                    return Err(anyhow::Error::new(e)
                        .context(format!("could not claim {job} within --wait {wait:?}")));
                }
                warnings.say(format!(
                    "fence run: claim failed, retrying: {}",
                    fence_storage::error_chain(&e)
                ));
                backoff.next_pause()
            }
        };
        tokio::time::sleep(
            pause
                .min(give_up.saturating_duration_since(Instant::now()))
                .max(Duration::from_millis(10)),
        )
        .await;
    }
}
