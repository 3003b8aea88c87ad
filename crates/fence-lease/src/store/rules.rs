//! The lease rules as one pure function of (stored record, operation, now).
//!
//! Shared by every backend that decides in Rust, with the record's byte encoding.

use std::time::Duration;

use fence_core::{
    Generation, JobId, Owner, Ttl,
    lease_api::{Checkpoint, LeaseState},
    secret::{LeaseKey, SecretHash},
};

use super::{ClaimTerms, Grant, LeaseOp, LeaseRecord, Outcome, Revocation, StoreError};

/// A job's lease as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stored {
    pub(crate) generation: Generation,
    pub(crate) owner: Option<Owner>,
    /// The hash of the holder's lease key (meaningless once released).
    pub(crate) key: SecretHash,
    pub(crate) lease_until_ms: u64,
    /// When the record last changed (claim, renewal, release, completion), on the store's
    /// clock: what forgetting measures "unchanged for D" by.
    pub(crate) changed_ms: u64,
    pub(crate) completed: bool,
    /// The lock-delay the holder claimed with: once its lease *expires*, the job cannot be
    /// claimed until `lease_until_ms + lock_delay_ms` (contract section 12).
    pub(crate) lock_delay_ms: u64,
    /// The last checkpoint and the generation that saved it (contract section 14).
    pub(crate) checkpoint: Option<(Generation, String)>,
    /// A semaphore slot's: the resource's number of slots its holder claimed with, which
    /// stays in force while the slot is held (contract section 15); 0 for a plain job.
    pub(crate) slots: u32,
}

// A revoked record keeps `lease_until_ms`, the end of the lease it took away (its holder may
// act until then), with no owner: it is free, claimable at once, and counts as a slot in
// force until then (`Stored::keeps_slots`). A released one has 0 there.

/// What a decision does: the record to write (if any) and the answer.
pub(crate) type Decision<T> = Result<(Option<Stored>, T), StoreError>;

/// The format version of an encoded record: 3 added the lock-delay, the checkpoint and a
/// slot's number of slots (flag 8); 2 (without them) is still read, as no delay, no
/// checkpoint and a plain job.
const VERSION: u8 = 3;

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

    /// Whether forgetting may delete it: free, expired or completed, and unchanged for
    /// `idle_ms` (contract section 8). A held lease is never forgotten, nor an expired one
    /// whose lock-delay runs (forgetting it would let the next claim in at once), nor a job
    /// at the last generation (forgetting it would raise the floor there, and every job
    /// claimed after it would start exhausted).
    pub(crate) fn forgettable(&self, now_ms: u64, idle_ms: u64) -> bool {
        self.generation < Generation::LAST
            && self.state(now_ms) != LeaseState::Held
            && self.changed_ms.saturating_add(idle_ms) <= now_ms
            && self.lease_until_ms.saturating_add(idle_ms) <= now_ms
            && self.delay_left(now_ms).is_none()
    }

    /// Whether a semaphore's slot keeps its number of slots in force (contract section 15):
    /// with a holder, held or expired (the holder of an expired lease may still renew it
    /// while nobody claimed it since, as for any job); or revoked before the revoked lease
    /// would have ended (its holder may still act until then, and a claim of fewer slots
    /// would never take this slot again to fence it). Not once released or completed.
    pub(crate) fn keeps_slots(&self, now_ms: u64) -> bool {
        self.slots != 0 && !self.completed && (self.owner.is_some() || now_ms < self.lease_until_ms)
    }

    /// While the lease has expired and its lock-delay runs: how long until the job can be
    /// claimed. `None` when free, held, completed, or past the delay.
    pub(crate) fn delay_left(&self, now_ms: u64) -> Option<Duration> {
        let until = self.lease_until_ms.saturating_add(self.lock_delay_ms);
        (self.state(now_ms) == LeaseState::Expired && now_ms < until)
            .then(|| Duration::from_millis(until - now_ms))
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

    pub(crate) fn encode(&self) -> Vec<u8> {
        let owner = self.owner.as_ref().map_or("", Owner::as_str).as_bytes();
        let checkpoint = self.checkpoint.as_ref();
        let saved = checkpoint.map_or(0, |(_, data)| 12 + data.len());
        let mut out = Vec::with_capacity(2 + 32 + saved + 32 + owner.len());
        // A record without a lock-delay, a checkpoint or a number of slots keeps format 2,
        // which an older build still reads (a rollback loses nothing it knew of).
        let plain = self.lock_delay_ms == 0 && checkpoint.is_none() && self.slots == 0;
        out.push(if plain { 2 } else { VERSION });
        out.push(
            u8::from(self.completed)
                | (u8::from(self.owner.is_some()) << 1)
                | (u8::from(checkpoint.is_some()) << 2)
                | (u8::from(self.slots != 0) << 3),
        );
        out.extend_from_slice(&self.generation.get().to_be_bytes());
        out.extend_from_slice(&self.lease_until_ms.to_be_bytes());
        out.extend_from_slice(&self.changed_ms.to_be_bytes());
        if !plain {
            out.extend_from_slice(&self.lock_delay_ms.to_be_bytes());
        }
        if self.slots != 0 {
            out.extend_from_slice(&self.slots.to_be_bytes());
        }
        if let Some((generation, data)) = checkpoint {
            let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
            out.extend_from_slice(&generation.get().to_be_bytes());
            out.extend_from_slice(&len.to_be_bytes());
            out.extend_from_slice(&data.as_bytes()[..len as usize]);
        }
        out.extend_from_slice(self.key.as_bytes());
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
        // Version 2 has no lock-delay and no checkpoint: the key follows `changed` directly.
        let delay_len = match *version {
            2 if flags & !3 == 0 => 0,
            VERSION if flags & !15 == 0 => 8,
            2 | VERSION => return Err(corrupt("unknown flags")),
            _ => return Err(corrupt("unknown record format version")),
        };
        let u64_at = |at: usize| -> Result<u64, StoreError> {
            rest.get(at..at + 8)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_be_bytes)
                .ok_or_else(|| corrupt("record is too short"))
        };
        let (generation, until, changed) = (u64_at(0)?, u64_at(8)?, u64_at(16)?);
        let lock_delay_ms = if delay_len == 0 { 0 } else { u64_at(24)? };
        let mut key_at = 24 + delay_len;
        let slots = if flags & 8 != 0 {
            let slots = rest
                .get(key_at..key_at + 4)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_be_bytes)
                .ok_or_else(|| corrupt("record is too short"))?;
            if slots == 0 {
                return Err(corrupt("a slot's number of slots is 0"));
            }
            key_at += 4;
            slots
        } else {
            0
        };
        let checkpoint = if flags & 4 != 0 {
            let generation = Generation::new(u64_at(key_at)?);
            let len = rest
                .get(key_at + 8..key_at + 12)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_be_bytes)
                .ok_or_else(|| corrupt("record is too short"))?;
            let end = usize::try_from(len)
                .ok()
                .and_then(|len| (key_at + 12).checked_add(len))
                .ok_or_else(|| corrupt("record is too short"))?;
            let data = rest
                .get(key_at + 12..end)
                .ok_or_else(|| corrupt("record is too short"))?;
            let data = std::str::from_utf8(data)
                .map_err(|_| corrupt("checkpoint is not UTF-8"))?
                .to_owned();
            key_at = end;
            Some((generation, data))
        } else {
            None
        };
        let key: [u8; 32] = rest
            .get(key_at..key_at + 32)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| corrupt("record is too short"))?;
        let owner = if flags & 2 != 0 {
            let owner = rest.get(key_at + 32..).unwrap_or_default();
            Some(Owner::from_bytes(owner).map_err(|_| corrupt("owner is not visible ASCII"))?)
        } else {
            None
        };
        Ok(Self {
            generation: Generation::new(generation),
            owner,
            key: SecretHash::from_bytes(key),
            lease_until_ms: until,
            changed_ms: changed,
            completed: flags & 1 != 0,
            lock_delay_ms,
            checkpoint,
            slots,
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
            checkpoint: None,
        },
    )
}

/// A stored checkpoint as a claim returns it.
fn saved(s: &Stored) -> Option<Checkpoint> {
    s.checkpoint.as_ref().map(|(generation, data)| Checkpoint {
        generation: *generation,
        data: data.clone(),
    })
}

/// Decides `op` on the stored record `cur` at `now_ms`. `floor` is the highest generation the
/// store has forgotten: a job with no record is claimed at `floor + 1`.
pub(crate) fn decide(
    job: &JobId,
    cur: Option<&Stored>,
    floor: Generation,
    op: &LeaseOp,
    now_ms: u64,
) -> Decision<Outcome> {
    op.check(job)?;
    match op {
        LeaseOp::Claim {
            owner,
            key,
            ttl,
            lock_delay,
        } => {
            let terms = ClaimTerms {
                ttl: *ttl,
                lock_delay: *lock_delay,
            };
            claim(job, cur, floor, owner, key, (terms, 0), now_ms)
        }
        LeaseOp::Revoke => revoke(job, cur, now_ms),
        LeaseOp::Checkpoint {
            owner,
            generation,
            key,
            data,
        } => Ok(held_by(cur, owner, *generation, key).map_or_else(
            |refused| (None, refused),
            |s| {
                let new = Stored {
                    checkpoint: Some((*generation, data.clone())),
                    changed_ms: now_ms,
                    ..s.clone()
                };
                let record = new.record(job, now_ms);
                (Some(new), Outcome::Done(record))
            },
        )),
        LeaseOp::Renew {
            owner,
            generation,
            key,
            ttl,
        } => Ok(held_by(cur, owner, *generation, key).map_or_else(
            |refused| (None, refused),
            |s| {
                // Never earlier than the end already granted: a holder whose renewal's
                // answer is lost keeps the deadline of its last grant.
                let (until, mut g) = grant(*generation, *ttl, now_ms);
                let until = until.max(s.lease_until_ms);
                g.expires_at_ms = until;
                let new = Stored {
                    lease_until_ms: until,
                    changed_ms: now_ms,
                    ..s.clone()
                };
                (Some(new), Outcome::Granted(g))
            },
        )),
        LeaseOp::Release {
            owner,
            generation,
            key,
        }
        | LeaseOp::Complete {
            owner,
            generation,
            key,
        } => {
            let complete = matches!(op, LeaseOp::Complete { .. });
            Ok(held_by(cur, owner, *generation, key).map_or_else(
                |refused| (None, refused),
                |s| {
                    // A semaphore's slot is released, never completed (section 15).
                    let new = if complete && s.slots == 0 {
                        Stored {
                            completed: true,
                            lease_until_ms: now_ms.min(s.lease_until_ms),
                            changed_ms: now_ms,
                            ..s.clone()
                        }
                    } else {
                        Stored {
                            owner: None,
                            lease_until_ms: 0,
                            changed_ms: now_ms,
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

/// An operator's revoke: any record but a completed one goes free at the next generation.
fn revoke(job: &JobId, cur: Option<&Stored>, now_ms: u64) -> Decision<Outcome> {
    let Some(s) = cur else {
        return Ok((None, Outcome::Unknown));
    };
    if s.completed {
        let completed = Outcome::Completed {
            owner: s.owner.clone(),
            generation: s.generation,
        };
        return Ok((None, completed));
    }
    let generation = s
        .generation
        .next()
        .ok_or_else(|| StoreError::GenerationExhausted(job.clone()))?;
    // The revoked lease's end stays (see `Stored`): free at once, yet a slot in force.
    let new = Stored {
        generation,
        owner: None,
        changed_ms: now_ms,
        ..s.clone()
    };
    let revoked = Revocation {
        record: new.record(job, now_ms),
        expires_at_ms: Some(s.lease_until_ms.max(now_ms)),
        token: None,
    };
    Ok((Some(new), Outcome::Revoked(revoked)))
}

/// The stored record when `owner` at `generation` with `key` may renew, release or complete
/// it; otherwise the answer: `Lost` naming who holds it now, or `KeyMismatch` when owner and
/// generation hold it but the key is not theirs.
fn held_by<'a>(
    cur: Option<&'a Stored>,
    owner: &Owner,
    generation: Generation,
    key: &LeaseKey,
) -> Result<&'a Stored, Outcome> {
    match cur {
        Some(s)
            if !s.completed && s.generation == generation && s.owner.as_ref() == Some(owner) =>
        {
            if s.key == key.hash() {
                Ok(s)
            } else {
                Err(Outcome::KeyMismatch)
            }
        }
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

/// The claim rule, for a plain job (`slots` 0) or a semaphore's slot.
pub(super) fn claim(
    job: &JobId,
    cur: Option<&Stored>,
    floor: Generation,
    owner: &Owner,
    key: &LeaseKey,
    (terms, slots): (ClaimTerms, u32),
    now_ms: u64,
) -> Decision<Outcome> {
    let ttl = terms.ttl;
    // At most the longest lease (24 h), whoever asks.
    let delay = terms
        .lock_delay
        .unwrap_or_default()
        .min(Ttl::MAX.as_duration());
    let lock_delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
    let current = cur.map_or(floor, |s| s.generation);
    if let Some(s) = cur {
        match s.state(now_ms) {
            LeaseState::Completed => {
                let completed = Outcome::Completed {
                    owner: s.owner.clone(),
                    generation: s.generation,
                };
                return Ok((None, completed));
            }
            LeaseState::Held if s.owner.as_ref() == Some(owner) && s.key == key.hash() => {
                // The holder claims again with its key (a retry after a lost answer): same
                // generation, extended, never shortened. A retry asking less (or capped lower by
                // another server's --max-ttl) that runs after a longer grant must not end the
                // lease before the end its holder was told: another owner would get the next
                // generation while the holder still acts under this one (as a renewal).
                let (until, mut g) = grant(s.generation, ttl, now_ms);
                let until = until.max(s.lease_until_ms);
                g.expires_at_ms = until;
                g.checkpoint = saved(s);
                let new = Stored {
                    lease_until_ms: until,
                    changed_ms: now_ms,
                    ..s.clone()
                };
                return Ok((Some(new), Outcome::Granted(g)));
            }
            LeaseState::Held => {
                let held = Outcome::Held {
                    owner: s.owner.clone().expect("held implies an owner"),
                    generation: s.generation,
                    expires_in: Duration::from_millis(s.lease_until_ms - now_ms),
                    lock_delay: false,
                };
                return Ok((None, held));
            }
            _ => {}
        }
        if let Some(left) = s.delay_left(now_ms) {
            let delayed = Outcome::Held {
                owner: s.owner.clone().expect("expired implies an owner"),
                generation: s.generation,
                expires_in: left,
                lock_delay: true,
            };
            return Ok((None, delayed));
        }
    }
    let generation = current
        .next()
        .ok_or_else(|| StoreError::GenerationExhausted(job.clone()))?;
    let (until, mut g) = grant(generation, ttl, now_ms);
    g.checkpoint = cur.and_then(saved);
    let new = Stored {
        generation,
        owner: Some(owner.clone()),
        key: key.hash(),
        lease_until_ms: until,
        changed_ms: now_ms,
        completed: false,
        lock_delay_ms,
        checkpoint: cur.and_then(|s| s.checkpoint.clone()),
        slots,
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
                generation: Generation::LAST,
                owner: Some("w".parse().unwrap()),
                key: SecretHash::of(b"k"),
                lease_until_ms: 5,
                changed_ms: 3,
                completed: true,
                lock_delay_ms: 7,
                checkpoint: Some((Generation::new(3), "step 4 of 9: ünïcode".to_owned())),
                slots: 3,
            },
            Stored {
                generation: Generation::ZERO,
                owner: None,
                key: SecretHash::from_bytes([0; 32]),
                lease_until_ms: 0,
                changed_ms: 0,
                completed: false,
                lock_delay_ms: 0,
                checkpoint: None,
                slots: 0,
            },
        ] {
            assert_eq!(Stored::decode(&job, &s.encode()).unwrap(), s);
            let encoded = s.encode();
            for cut in 0..encoded.len() {
                let _ = Stored::decode(&job, &encoded[..cut]); // never panics
            }
        }
        let mut spaced = vec![2, 2];
        spaced.extend_from_slice(&[0; 56]);
        spaced.push(b' ');
        for bad in [&b""[..], &[2], &[1, 0], &[4, 0], &[2, 0, 0, 0], &spaced] {
            assert!(Stored::decode(&job, bad).is_err(), "{bad:?}");
        }
    }

    /// A job at the last generation stays (one record), so the floor never reaches it.
    #[test]
    fn a_job_at_the_last_generation_is_never_forgotten() {
        let idle = Stored {
            generation: Generation::new(u64::MAX - 1),
            owner: None,
            key: SecretHash::from_bytes([0; 32]),
            lease_until_ms: 0,
            changed_ms: 0,
            completed: true,
            lock_delay_ms: 0,
            checkpoint: None,
            slots: 0,
        };
        assert!(idle.forgettable(10_000, 1_000));
        let last = Stored {
            generation: Generation::LAST,
            ..idle
        };
        assert!(!last.forgettable(10_000, 1_000));
    }

    #[test]
    fn a_record_of_format_2_reads_as_one_without_lock_delay() {
        let job: JobId = "j".parse().unwrap();
        let mut v2 = vec![2, 2];
        for n in [9u64, 5, 3] {
            v2.extend_from_slice(&n.to_be_bytes());
        }
        v2.extend_from_slice(&[1; 32]);
        v2.extend_from_slice(b"w");
        let s = Stored::decode(&job, &v2).unwrap();
        assert_eq!(
            s,
            Stored {
                generation: Generation::new(9),
                owner: Some("w".parse().unwrap()),
                key: SecretHash::from_bytes([1; 32]),
                lease_until_ms: 5,
                changed_ms: 3,
                completed: false,
                lock_delay_ms: 0,
                checkpoint: None,
                slots: 0,
            }
        );
        // And a record without a delay or a checkpoint is written in format 2 again, so a
        // rollback to a build that reads only format 2 loses nothing it knew of.
        assert_eq!(s.encode(), v2);
        let delayed = Stored {
            lock_delay_ms: 1,
            ..s
        };
        assert_eq!(delayed.encode()[0], 3);
        let mut bad_flag = v2.clone();
        bad_flag[1] |= 4; // a checkpoint flag in format 2
        assert!(Stored::decode(&job, &bad_flag).is_err());
    }
}
