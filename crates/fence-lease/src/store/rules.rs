//! The lease rules as one pure function of (stored record, operation, now).
//!
//! Shared by every backend that decides in Rust, with the record's byte encoding.

use std::time::Duration;

use fence_core::{Generation, JobId, Owner, Ttl, lease_api::LeaseState};

use super::{Grant, LeaseOp, LeaseRecord, Outcome, StoreError};

/// A job's lease as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stored {
    pub(crate) generation: Generation,
    pub(crate) owner: Option<Owner>,
    pub(crate) lease_until_ms: u64,
    pub(crate) completed: bool,
}

/// What a decision does: the record to write (if any) and the answer.
pub(crate) type Decision<T> = Result<(Option<Stored>, T), StoreError>;

impl Stored {
    pub(crate) fn state(&self, now_ms: u64) -> LeaseState {
        if self.completed {
            LeaseState::Completed
        } else if self.owner.is_none() {
            LeaseState::Free
        } else if now_ms < self.lease_until_ms {
            LeaseState::Held
        } else {
            LeaseState::Expired
        }
    }

    pub(crate) fn record(&self, job: &JobId, now_ms: u64) -> LeaseRecord {
        let state = self.state(now_ms);
        let expires_in = match state {
            LeaseState::Held => Duration::from_millis(self.lease_until_ms - now_ms),
            _ => Duration::ZERO,
        };
        LeaseRecord {
            job: job.clone(),
            owner: self.owner.clone(),
            generation: self.generation,
            state,
            expires_in,
        }
    }

    /// Whether `owner` at `generation` may renew, release or complete.
    fn matches(&self, owner: &Owner, generation: Generation) -> bool {
        !self.completed && self.generation == generation && self.owner.as_ref() == Some(owner)
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let owner = self.owner.as_ref().map_or("", Owner::as_str).as_bytes();
        let mut out = Vec::with_capacity(18 + owner.len());
        out.push(1); // format version
        out.push(u8::from(self.completed) | (u8::from(self.owner.is_some()) << 1));
        out.extend_from_slice(&self.generation.get().to_be_bytes());
        out.extend_from_slice(&self.lease_until_ms.to_be_bytes());
        out.extend_from_slice(owner);
        out
    }

    pub(crate) fn decode(job: &JobId, bytes: &[u8]) -> Result<Self, StoreError> {
        let corrupt = |reason| StoreError::Corrupt {
            job: job.clone(),
            reason,
        };
        let [version, flags, rest @ ..] = bytes else {
            return Err(corrupt("record is too short"));
        };
        if *version != 1 {
            return Err(corrupt("unknown record format version"));
        }
        if rest.len() < 16 {
            return Err(corrupt("record is too short"));
        }
        let (generation, rest) = rest.split_at(8);
        let (until, owner) = rest.split_at(8);
        let owner = if flags & 2 != 0 {
            Some(Owner::from_bytes(owner).map_err(|_| corrupt("owner is not visible ASCII"))?)
        } else {
            None
        };
        Ok(Self {
            generation: Generation::new(u64::from_be_bytes(
                generation.try_into().expect("8 bytes"),
            )),
            owner,
            lease_until_ms: u64::from_be_bytes(until.try_into().expect("8 bytes")),
            completed: flags & 1 != 0,
        })
    }
}

fn grant(generation: Generation, ttl: Ttl, now_ms: u64) -> (u64, Grant) {
    let until = now_ms.saturating_add(ttl.as_millis());
    (
        until,
        Grant {
            generation,
            ttl,
            expires_at_ms: until,
            token: None,
        },
    )
}

/// Decides `op` on the stored record `cur` at `now_ms`.
pub(crate) fn decide(
    job: &JobId,
    cur: Option<&Stored>,
    op: &LeaseOp,
    now_ms: u64,
) -> Decision<Outcome> {
    match op {
        LeaseOp::Claim { owner, ttl } => claim(job, cur, owner, *ttl, now_ms),
        LeaseOp::Renew {
            owner,
            generation,
            ttl,
        } => Ok(held_by(cur, owner, *generation).map_or_else(
            |lost| (None, lost),
            |s| {
                let (until, g) = grant(*generation, *ttl, now_ms);
                let new = Stored {
                    lease_until_ms: until,
                    ..s.clone()
                };
                (Some(new), Outcome::Granted(g))
            },
        )),
        LeaseOp::Release { owner, generation } | LeaseOp::Complete { owner, generation } => {
            let complete = matches!(op, LeaseOp::Complete { .. });
            Ok(held_by(cur, owner, *generation).map_or_else(
                |lost| (None, lost),
                |s| {
                    let new = if complete {
                        Stored {
                            completed: true,
                            lease_until_ms: now_ms.min(s.lease_until_ms),
                            ..s.clone()
                        }
                    } else {
                        Stored {
                            owner: None,
                            lease_until_ms: 0,
                            ..s.clone()
                        }
                    };
                    let record = new.record(job, now_ms);
                    (Some(new), Outcome::Done(record))
                },
            ))
        }
    }
}

/// The stored record when `owner` at `generation` may renew, release or complete it;
/// otherwise the `Lost` answer naming who holds it now.
fn held_by<'a>(
    cur: Option<&'a Stored>,
    owner: &Owner,
    generation: Generation,
) -> Result<&'a Stored, Outcome> {
    match cur {
        Some(s) if s.matches(owner, generation) => Ok(s),
        Some(s) => Err(Outcome::Lost {
            owner: s.owner.clone(),
            generation: s.generation,
        }),
        None => Err(Outcome::Lost {
            owner: None,
            generation: Generation::ZERO,
        }),
    }
}

fn claim(
    job: &JobId,
    cur: Option<&Stored>,
    owner: &Owner,
    ttl: Ttl,
    now_ms: u64,
) -> Decision<Outcome> {
    let current = cur.map_or(Generation::ZERO, |s| s.generation);
    if let Some(s) = cur {
        match s.state(now_ms) {
            LeaseState::Completed => {
                let completed = Outcome::Completed {
                    owner: s.owner.clone(),
                    generation: s.generation,
                };
                return Ok((None, completed));
            }
            LeaseState::Held if s.owner.as_ref() == Some(owner) => {
                // The holder claims again (a retry after a lost answer): same generation, extended.
                let (until, g) = grant(s.generation, ttl, now_ms);
                let new = Stored {
                    lease_until_ms: until,
                    ..s.clone()
                };
                return Ok((Some(new), Outcome::Granted(g)));
            }
            LeaseState::Held => {
                let held = Outcome::Held {
                    owner: s.owner.clone().expect("held implies an owner"),
                    expires_in: Duration::from_millis(s.lease_until_ms - now_ms),
                };
                return Ok((None, held));
            }
            _ => {}
        }
    }
    let generation = current
        .next()
        .ok_or_else(|| StoreError::GenerationExhausted(job.clone()))?;
    let (until, g) = grant(generation, ttl, now_ms);
    let new = Stored {
        generation,
        owner: Some(owner.clone()),
        lease_until_ms: until,
        completed: false,
    };
    Ok((Some(new), Outcome::Granted(g)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_round_trips_and_rejects_garbage() {
        let job: JobId = "j".parse().unwrap();
        for s in [
            Stored {
                generation: Generation::new(u64::MAX),
                owner: Some("w".parse().unwrap()),
                lease_until_ms: 5,
                completed: true,
            },
            Stored {
                generation: Generation::ZERO,
                owner: None,
                lease_until_ms: 0,
                completed: false,
            },
        ] {
            assert_eq!(Stored::decode(&job, &s.encode()).unwrap(), s);
        }
        for bad in [
            &b""[..],
            &[1],
            &[2, 0],
            &[1, 0, 0, 0],
            &[1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, b' '],
        ] {
            assert!(Stored::decode(&job, bad).is_err(), "{bad:?}");
        }
    }
}
