//! `POST /v1/semaphores/{resource}/claim`: a slot of a fenced semaphore (contract section 15).

use std::{sync::Arc, time::Instant};

use axum::{
    Extension,
    body::Body,
    extract::{Path, State, rejection::PathRejection},
    http::{HeaderMap, Uri},
    response::Response,
};
use fence_core::{
    Problem, ProblemType,
    lease_api::{Action, LeaseBody, SemaphoreClaimRequest, SlotBody, check_resource, slot_job},
};
use fence_lease::{ClaimTerms, LeaseStore, Outcome};
use fence_sink::PeerAddr;

use super::{
    AppState,
    answer::{Asking, answer, bad, finish, json, store_error},
    guard::authorize,
    handlers::{job_of, parse},
};

/// Claims a slot: the slot's lease with the resource, the slot number and the number of
/// slots; 409 `lease-held` (or `lock-delay`) naming the slot that frees first when every
/// slot is taken; 409 `semaphore-size` with the number in force while slots have holders (held
/// or expired) or revoked leases not yet ended under another. With an auth file, the client's patterns must cover every slot's job id.
pub(super) async fn claim<S: LeaseStore>(
    State(app): State<Arc<AppState<S>>>,
    uri: Uri,
    headers: HeaderMap,
    peer: Option<Extension<PeerAddr>>,
    path: Result<Path<String>, PathRejection>,
    body: Body,
) -> Response {
    let started = Instant::now();
    let answered = async {
        let resource = job_of(path.map(|Path(r)| r))
            .map_err(|p| bad(p.detail.replace("job (in the path)", "resource (in the path)")))?;
        check_resource(&resource).map_err(|e| bad(format!("resource: {e}")))?;
        let caller = authorize(app.options.auth.as_ref(), &headers, None)?;
        if let Some(query) = uri.query() {
            return Err(bad(format!(
                "{query}: a semaphore claim takes no parameters (it does not wait at the server: claim again after Retry-After)"
            )));
        }
        let SemaphoreClaimRequest { claim, slots } =
            parse(body, SemaphoreClaimRequest::from_json).await?;
        if let Some(caller) = &caller
            && let Some(slot) = (1..=slots).find(|&k| !caller.client().may(&slot_job(&resource, k)))
        {
            return Err(Problem::new(
                ProblemType::Forbidden,
                format!(
                    "client {} may not claim slots of {resource}: slot job {} is outside its job patterns (a pattern such as {resource}#* covers them all)",
                    caller.client().name(),
                    slot_job(&resource, slot)
                ),
            )
            .with_job(resource));
        }
        let terms = ClaimTerms {
            ttl: app.options.max_ttl.map_or(claim.ttl, |max| claim.ttl.min(max)),
            lock_delay: claim.lock_delay.or(app.options.lock_delay),
        };
        let owner = claim.owner;
        let decided = app
            .store
            .claim_slot(&resource, &owner, &claim.lease_key, terms, slots)
            .await
            .map_err(|e| store_error(&resource, &e))?;
        let client = caller.as_ref().map(|c| c.client().name().to_owned());
        match (decided.slot, decided.outcome) {
            (_, Outcome::SemaphoreSize { slots: in_force }) => {
                // Logged once, by the refusal log (`mark_authenticated`).
                Err(Problem::new(
                    ProblemType::SemaphoreSize,
                    format!(
                        "semaphore {resource} has {in_force} slots while any slot is in force (has a holder, held or expired, or was revoked before its lease would have ended); this claim asked for {slots}: claim with {in_force}, or with another number once no slot is so"
                    ),
                )
                .with_job(resource)
                .with_slots(in_force))
            }
            (Some(slot), Outcome::Granted(g)) => {
                let job = slot_job(&resource, slot);
                tracing::info!(job = %job, resource = %resource, slot, slots, generation = g.generation.get(), owner = %owner, ttl_ms = g.ttl.as_millis(), "semaphore slot granted");
                Ok(json(&SlotBody {
                    lease: LeaseBody {
                        job,
                        owner,
                        generation: g.generation,
                        ttl_ms: g.ttl.as_millis(),
                        expires_at_ms: g.expires_at_ms,
                        token: g.token,
                        checkpoint: g.checkpoint,
                    },
                    resource,
                    slot,
                    slots,
                }))
            }
            (Some(slot), refused) => {
                let asking = Asking {
                    owner: Some(&owner),
                    generation: None,
                    action: Action::Claim,
                    reason: None,
                    client,
                    peer: peer.map(|Extension(PeerAddr(addr))| addr.ip()),
                };
                let job = slot_job(&resource, slot);
                answer(job, &asking, refused).map_err(|mut p| {
                    if p.kind == ProblemType::LeaseHeld {
                        p.detail = format!(
                            "every slot of {resource} ({slots}) is taken; slot {slot} frees first, in {} ms",
                            p.expires_in_ms.unwrap_or(0)
                        );
                    }
                    p
                })
            }
            (None, other) => Err(Problem::new(
                ProblemType::Internal,
                format!("a semaphore claim was answered with {other:?} and no slot"),
            )),
        }
    }
    .await;
    finish("claim_slot", started, answered)
}
