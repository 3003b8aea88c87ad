//! `fence run`'s claim: waiting while the job (or every slot of a semaphore) is held.
//!
//! It waits no longer than `--wait`.

use std::{future::Future, time::Duration};

use fence_core::JobId;
use fence_lease::{Backoff, ClaimError, HttpLeaseStore, Lease, LeaseClient, StoreError};
use tokio::time::Instant;

use super::words::Repeats;

/// Claims `job`; the server holds the claim until the job frees (first come, first served).
pub(super) async fn claim_within(
    client: &LeaseClient<HttpLeaseStore>,
    job: &JobId,
    wait: Duration,
) -> anyhow::Result<Option<Lease<HttpLeaseStore>>> {
    within(&format!("job {job}"), "", wait, |left| {
        client.claim_waiting(job.clone(), left)
    })
    .await
}

/// Claims a slot of the semaphore `resource` of `slots` slots; the client asks again as
/// slots are due to free.
pub(super) async fn claim_slot_within(
    client: &LeaseClient<HttpLeaseStore>,
    resource: &JobId,
    slots: u32,
    wait: Duration,
) -> anyhow::Result<Option<Lease<HttpLeaseStore>>> {
    let what = format!("semaphore {resource} ({slots} slots)");
    let full = format!("every slot of {what} is taken: ");
    within(&what, &full, wait, |left| {
        client.claim_slot(resource.clone(), slots, left)
    })
    .await
}

/// Tries `claim` with what is left of `wait` until it gives a lease, says no for good, or
/// the wait is over (`None`, with the reason on stderr, after `full` when it names a
/// semaphore); store failures are retried with backoff until then.
async fn within<F>(
    what: &str,
    full: &str,
    wait: Duration,
    claim: impl Fn(Duration) -> F,
) -> anyhow::Result<Option<Lease<HttpLeaseStore>>>
where
    F: Future<Output = Result<Lease<HttpLeaseStore>, ClaimError>>,
{
    let give_up = Instant::now() + wait;
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut warnings = Repeats::default();
    loop {
        let left = give_up.saturating_duration_since(Instant::now());
        let pause = match claim(left).await {
            Ok(lease) => return Ok(Some(lease)),
            Err(ClaimError::Completed {
                job, generation, ..
            }) => {
                say!(
                    "fence run: job {job} is completed (generation {generation}); not running the command"
                );
                return Ok(None);
            }
            Err(e @ ClaimError::SemaphoreSize { .. }) => {
                say!("fence run: {e}; not running the command");
                return Ok(None);
            }
            Err(ClaimError::Held {
                job,
                owner,
                expires_in,
            }) => {
                if Instant::now() >= give_up {
                    say!(
                        "fence run: {full}job {job} is held by {owner} for another {expires_in:?}; gave up after --wait {wait:?}"
                    );
                    return Ok(None);
                }
                Duration::ZERO // the wait ended early: ask again
            }
            Err(ClaimError::LockDelay {
                job,
                owner,
                claimable_in,
            }) => {
                if Instant::now() >= give_up {
                    say!(
                        "fence run: {full}the lease of {owner} on job {job} expired and its lock-delay keeps the job for another {claimable_in:?}; gave up after --wait {wait:?}"
                    );
                    return Ok(None);
                }
                Duration::ZERO
            }
            // The job was held and the server had no waiting place for this claim (429): the
            // contract's "held within --wait", exit 3, saying why it did not wait in line.
            Err(ClaimError::Store(StoreError::TooManyWaiters {
                detail,
                retry_after,
            })) => {
                if Instant::now() >= give_up {
                    say!(
                        "fence run: {full}{what} stayed held, and the lease server's waiting places were full ({detail}); gave up after --wait {wait:?}"
                    );
                    return Ok(None);
                }
                retry_after.unwrap_or(Duration::from_secs(1))
            }
            Err(e @ ClaimError::Timing(_)) => return Err(e.into()),
            // A refusal that asking again cannot change (a bad request, a job at its last
            // generation, a secret the server does not accept): stop now, not at --wait.
            Err(ClaimError::Store(e)) if e.is_permanent() => {
                warnings.flush();
                return Err(anyhow::Error::new(e).context(format!("could not claim {what}")));
            }
            Err(e) => {
                if Instant::now() >= give_up {
                    warnings.flush();
                    return Err(anyhow::Error::new(e)
                        .context(format!("could not claim {what} within --wait {wait:?}")));
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
