//! The lease protocol against a reference model: claims, renewals, releases, completions,
//! clock jumps (forward and back) and store restarts in any order. Every outcome must match
//! a small independent model of `docs/protocol.md` section 4, two owners never get the same
//! generation of a job, and a job's generation never decreases.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use fence_core::{Generation, JobId, Owner};
use fence_lease::{Clock, LeaseStore, ManualClock, Outcome, SledLeaseStore, Ttl};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Claim { owner: u8, job: u8, ttl_ms: u64 },
    Renew { owner: u8, job: u8, stale: bool },
    Release { owner: u8, job: u8, stale: bool },
    Complete { owner: u8, job: u8, stale: bool },
    Advance { ms: u64 },
    JumpBack { ms: u64 },
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    let who = (0u8..3, 0u8..2);
    prop_oneof![
        6 => (who.clone(), prop_oneof![Just(100u64), Just(1_000), Just(30_000)])
            .prop_map(|((owner, job), ttl_ms)| Op::Claim { owner, job, ttl_ms }),
        4 => (who.clone(), any::<bool>()).prop_map(|((owner, job), stale)| Op::Renew { owner, job, stale }),
        2 => (who.clone(), any::<bool>()).prop_map(|((owner, job), stale)| Op::Release { owner, job, stale }),
        1 => (who, any::<bool>()).prop_map(|((owner, job), stale)| Op::Complete { owner, job, stale }),
        4 => (1u64..2_000).prop_map(|ms| Op::Advance { ms }),
        1 => (1u64..2_000).prop_map(|ms| Op::JumpBack { ms }),
        1 => Just(Op::Restart),
    ]
}

/// The reference model: one job's lease as the contract describes it.
#[derive(Debug, Default, Clone)]
struct Model {
    generation: u64,
    owner: Option<u8>,
    until: u64,
    completed: bool,
}

#[derive(Debug, PartialEq, Eq)]
enum Seen {
    Granted(u64),
    Held(u8),
    Completed,
    Lost(Option<u8>, u64),
    Done,
}

impl Model {
    fn holds(&self, o: u8, g: u64) -> bool {
        !self.completed && self.owner == Some(o) && self.generation == g
    }

    fn claim(&mut self, o: u8, ttl: u64, now: u64) -> Seen {
        if self.completed {
            return Seen::Completed;
        }
        match self.owner {
            Some(h) if now < self.until && h == o => {
                // The holder's claim again: extended, never shortened (as a renewal).
                self.until = self.until.max(now + ttl);
                Seen::Granted(self.generation)
            }
            Some(h) if now < self.until => Seen::Held(h),
            _ => {
                self.generation += 1;
                self.owner = Some(o);
                self.until = now + ttl;
                Seen::Granted(self.generation)
            }
        }
    }
}

fn owner(o: u8) -> Owner {
    format!("owner-{o}").parse().unwrap()
}

fn owner_index(o: &Owner) -> u8 {
    o.as_str().trim_start_matches("owner-").parse().unwrap()
}

fn job(j: u8) -> JobId {
    format!("job-{j}").parse().unwrap()
}

fn lost(o: Option<Owner>, g: Generation) -> Seen {
    Seen::Lost(o.as_ref().map(owner_index), g.get())
}

/// Each owner claims with a key of its own, always the same.
fn key(o: u8) -> fence_lease::LeaseKey {
    fence_lease::LeaseKey::new(&format!("owner-{o}-{}", "k".repeat(22))).expect("a valid key")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn the_store_behaves_as_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(1_700_000_000_000);
        let open = || SledLeaseStore::open_with_clock(dir.path(), Arc::new(clock.clone())).unwrap();
        let mut store = Some(open());
        let mut models: BTreeMap<u8, Model> = BTreeMap::new();
        // (job, generation) -> the one owner ever granted it
        let mut granted: BTreeMap<(u8, u64), u8> = BTreeMap::new();
        let mut last_grant: BTreeMap<(u8, u8), u64> = BTreeMap::new();
        for op in ops {
            let s = store.as_ref().unwrap();
            let now = clock.now_ms();
            let generation_for = |o: u8, j: u8, stale: bool| {
                let g = last_grant.get(&(o, j)).copied().unwrap_or(1);
                Generation::new(if stale { g.saturating_sub(1) } else { g })
            };
            match op {
                Op::Claim { owner: o, job: j, ttl_ms } => {
                    let want = models.entry(j).or_default().claim(o, ttl_ms, now);
                    let got = match rt.block_on(s.claim(&job(j), &owner(o), &key(o), Ttl::from_millis(ttl_ms).unwrap())).unwrap() {
                        Outcome::Granted(g) => Seen::Granted(g.generation.get()),
                        Outcome::Held { owner, .. } => Seen::Held(owner_index(&owner)),
                        Outcome::Completed { .. } => Seen::Completed,
                        other => panic!("{other:?}"),
                    };
                    prop_assert_eq!(&got, &want);
                    if let Seen::Granted(g) = got {
                        let first = *granted.entry((j, g)).or_insert(o);
                        prop_assert_eq!(first, o, "generation {} of job {} granted to two owners", g, j);
                        last_grant.insert((o, j), g);
                    }
                }
                Op::Renew { owner: o, job: j, stale } => {
                    let g = generation_for(o, j, stale);
                    let m = models.entry(j).or_default();
                    let want = if m.holds(o, g.get()) {
                        m.until = now + 30_000;
                        Seen::Done
                    } else {
                        Seen::Lost(m.owner, m.generation)
                    };
                    let got = match rt.block_on(s.renew(&job(j), &owner(o), g, &key(o), Ttl::DEFAULT)).unwrap() {
                        Outcome::Granted(_) => Seen::Done,
                        Outcome::Lost { owner, generation } => lost(owner, generation),
                        other => panic!("{other:?}"),
                    };
                    prop_assert_eq!(got, want);
                }
                Op::Release { owner: o, job: j, stale } | Op::Complete { owner: o, job: j, stale } => {
                    let complete = matches!(op, Op::Complete { .. });
                    let g = generation_for(o, j, stale);
                    let m = models.entry(j).or_default();
                    let want = if m.holds(o, g.get()) {
                        if complete {
                            m.completed = true;
                        } else {
                            m.owner = None;
                            m.until = 0;
                        }
                        Seen::Done
                    } else {
                        Seen::Lost(m.owner, m.generation)
                    };
                    let outcome = if complete {
                        rt.block_on(s.complete(&job(j), &owner(o), g, &key(o)))
                    } else {
                        rt.block_on(s.release(&job(j), &owner(o), g, &key(o)))
                    };
                    let got = match outcome.unwrap() {
                        Outcome::Done(_) => Seen::Done,
                        Outcome::Lost { owner, generation } => lost(owner, generation),
                        other => panic!("{other:?}"),
                    };
                    prop_assert_eq!(got, want);
                }
                Op::Advance { ms } => clock.advance(Duration::from_millis(ms)),
                Op::JumpBack { ms } => clock.set_ms(now - ms),
                Op::Restart => {
                    drop(store.take());
                    store = Some(open());
                }
            }
            // Generations never decrease, and what the store reports is what the model says.
            for (j, m) in &models {
                let rec = rt.block_on(store.as_ref().unwrap().get(&job(*j))).unwrap();
                let g = rec.as_ref().map_or(0, |r| r.generation.get());
                prop_assert_eq!(g, m.generation, "job {}", j);
            }
        }
    }
}
