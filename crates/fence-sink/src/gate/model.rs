//! The gate under shuttle: every schedule of a few requests of one job, searched with PCT.
//!
//! Each scenario is a handful of tasks on one job: requests that admit a token, run an
//! effect that spans several scheduling points and then finish; requests that give up part
//! way through their admission (a client going away, or the drain limit: the admission
//! future is dropped, and a bump it started finishes in a task of its own); and a sweeper
//! that collapses the job's gate to its idle form and evicts it between steps. The store
//! yields to the scheduler inside every call, so a bump and a load can be overtaken.
//!
//! Checked on every schedule:
//! - the ordering rule: no effect starts with a token below one that already started, and
//!   none starts while an effect of an older token is still running;
//! - no lost wake-up: the drain and store limits are an hour and no timer ever fires here,
//!   so a waiter nobody wakes is left blocked, which shuttle reports as a deadlock;
//! - no leak: once every task has finished, the job's gate counts nothing in flight, no bump
//!   is marked, and only the map holds it (an eviction could take it).
//!
//! Each deliberately broken variant of [`Mutant`] must be caught by one of the scenarios;
//! `each_broken_variant_is_caught` shows it.

use std::{
    future::{Future, poll_fn},
    panic::{AssertUnwindSafe, catch_unwind},
    pin::pin,
    sync::{Arc, Mutex},
    task::Poll,
    time::Duration,
};

use fence_core::{Generation, JobId};
use fence_storage::clock::ManualClock;
use shuttle::{
    Config, Runner,
    future::{block_on, spawn, yield_now},
    scheduler::{PctScheduler, RandomScheduler, Scheduler},
};

use super::{Admission, Gates, Limits, MUTANT, Mutant, Restart, cache::Slot};
use crate::{
    detach::under_shuttle,
    store::{GenerationStore, StoreError, Verdict},
};

/// One task of a scenario.
#[derive(Debug, Clone, Copy)]
enum Task {
    /// A request with `token`, sent after `after` scheduling points; with `gives_up`, its
    /// admission is dropped after that many polls unless it was decided first.
    Request {
        token: u64,
        after: u8,
        gives_up: Option<u8>,
    },
    /// `rounds` times: collapse the job's gate if it is quiet, then evict it if unheld.
    Sweep { rounds: u8 },
}

const fn req(token: u64) -> Task {
    later(token, 0)
}

const fn later(token: u64, after: u8) -> Task {
    Task::Request {
        token,
        after,
        gives_up: None,
    }
}

const fn quitter(token: u64, polls: u8) -> Task {
    Task::Request {
        token,
        after: 0,
        gives_up: Some(polls),
    }
}

/// A store like the memory store, that lets other tasks run inside every call.
#[derive(Debug, Default)]
struct Yielding {
    highest: Mutex<u64>,
    shared: bool,
}

impl GenerationStore for Yielding {
    async fn observe(&self, _: &JobId, token: Generation) -> Result<Verdict, StoreError> {
        yield_now().await;
        let verdict = {
            let mut highest = self.highest.lock().unwrap_or_else(|e| e.into_inner());
            if token.get() < *highest {
                Verdict::Stale {
                    highest: Generation::new(*highest),
                }
            } else {
                *highest = token.get();
                Verdict::Accepted
            }
        };
        yield_now().await; // the write is done; its answer is on its way
        Ok(verdict)
    }

    async fn highest(&self, _: &JobId) -> Result<Generation, StoreError> {
        yield_now().await;
        Ok(Generation::new(
            *self.highest.lock().unwrap_or_else(|e| e.into_inner()),
        ))
    }

    fn is_shared(&self) -> bool {
        self.shared
    }
}

/// The effects the inner service saw, checked as each one starts.
#[derive(Debug, Default)]
struct Effects {
    started: Vec<u64>,
    running: Vec<u64>,
}

impl Effects {
    fn start(&mut self, token: u64) {
        if let Some(&higher) = self.started.iter().find(|&&t| t > token) {
            panic!("token {token} reached the service after token {higher} did");
        }
        if let Some(&older) = self.running.iter().find(|&&t| t < token) {
            panic!("token {token} reached the service while token {older} still ran");
        }
        self.started.push(token);
        self.running.push(token);
    }

    fn end(&mut self, token: u64) {
        let at = self.running.iter().position(|&t| t == token);
        self.running
            .swap_remove(at.expect("an effect ends that started"));
    }
}

/// Scheduling points an effect spans.
const EFFECT_STEPS: usize = 4;

const LIMITS: Limits = Limits {
    max_cached_jobs: 16,
    store_timeout: Duration::from_secs(3600),
    drain_timeout: Duration::from_secs(3600),
    restart: Restart {
        longest_request: Duration::ZERO,
        body: Duration::ZERO,
        hold: Duration::ZERO,
        before_service: Duration::ZERO,
        after_answer: Duration::ZERO,
        heed_recorded: true,
    },
};

/// `fut`'s output, or `None` when it was not ready within `polls` polls (it is dropped then).
async fn within<F: Future>(fut: F, polls: Option<u8>) -> Option<F::Output> {
    let Some(polls) = polls else {
        return Some(fut.await);
    };
    let mut fut = pin!(fut);
    for _ in 0..polls {
        if let Poll::Ready(out) = poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await {
            return Some(out);
        }
        yield_now().await;
    }
    None
}

async fn request(gates: Arc<Gates<Yielding>>, effects: Arc<Mutex<Effects>>, task: Task) {
    let job = JobId::new("job").expect("a valid job id");
    match task {
        Task::Request {
            token,
            after,
            gives_up,
        } => {
            for _ in 0..after {
                yield_now().await;
            }
            let clock = ManualClock::new(0);
            let admit = gates.admit(&job, Generation::new(token), LIMITS, &clock);
            match within(admit, gives_up).await {
                Some(Admission::Admitted(guard)) => {
                    effects.lock().expect("effects").start(token);
                    for _ in 0..EFFECT_STEPS {
                        yield_now().await;
                    }
                    effects.lock().expect("effects").end(token);
                    drop(guard);
                }
                Some(Admission::Stale { .. }) | None => {}
                Some(other) => panic!("token {token}: {other:?}, with no limit that could end"),
            }
        }
        Task::Sweep { rounds } => {
            for _ in 0..rounds {
                yield_now().await;
                gates.collapse_idle(vec![job.clone()]);
                yield_now().await;
                gates.let_go(&job);
            }
        }
    }
}

/// One execution of `tasks`, under whatever schedule shuttle picks.
fn scenario(tasks: &[Task], shared: bool, time: &tokio::runtime::Runtime) {
    // Timers register with a runtime that is never driven: with limits of an hour, none fires.
    let _time = time.enter();
    under_shuttle::start();
    // Detached futures go back to tokio however this execution ends (a failing schedule
    // panics out of it).
    struct Stop;
    impl Drop for Stop {
        fn drop(&mut self) {
            under_shuttle::stop();
        }
    }
    let _stop = Stop;
    let store = Yielding {
        shared,
        ..Yielding::default()
    };
    let gates = Arc::new(Gates::new(Arc::new(store)));
    let effects = Arc::new(Mutex::new(Effects::default()));
    let handles: Vec<_> = tasks
        .iter()
        .map(|&task| spawn(request(gates.clone(), effects.clone(), task)))
        .collect();
    block_on(async {
        for handle in handles {
            handle.await.expect("a task of the scenario");
        }
        loop {
            let detached = under_shuttle::take();
            if detached.is_empty() {
                break;
            }
            for handle in detached {
                handle.await.expect("a detached bump");
            }
        }
    });
    let job = JobId::new("job").expect("a valid job id");
    if let Some(slot) = gates.map.get(&job)
        && let Slot::Active(gate) = &*slot
    {
        let s = gate.lock();
        assert_eq!(
            (s.current, s.draining, s.bumping),
            (0, 0, None),
            "the gate still counts requests or a bump once all have finished"
        );
        assert_eq!(
            Arc::strong_count(gate),
            1,
            "a gate is held by nobody's request"
        );
    }
}

fn runtime() -> Arc<tokio::runtime::Runtime> {
    Arc::new(
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime for timers"),
    )
}

fn explore(scheduler: impl Scheduler + 'static, tasks: &'static [Task], shared: bool) {
    let time = runtime();
    let mut config = Config::new();
    config.stack_size = 1 << 20;
    Runner::new(scheduler, config).run(move || scenario(tasks, shared, &time));
}

/// A newer token while older ones run, the job's gate collapsed and evicted between steps:
/// the window between a waiter's wake-up and its next poll is where a fold goes wrong.
const SWEPT: &[Task] = &[req(1), later(2, 1), later(3, 6), Task::Sweep { rounds: 4 }];
/// Requests of one generation and above it giving up part way, some while their bump runs,
/// and the gate swept meanwhile.
const GIVING_UP: &[Task] = &[
    req(1),
    quitter(2, 2),
    req(2),
    quitter(3, 3),
    Task::Sweep { rounds: 3 },
];
/// Tokens arriving newest first, one newer bump abandoned at once.
const DESCENDING: &[Task] = &[req(3), req(2), quitter(4, 1), req(1), req(4)];
/// A store other sinks share: every admission asks it, and a stale answer lowers nothing.
const SHARED: &[Task] = &[req(1), req(2), quitter(2, 1), Task::Sweep { rounds: 2 }];

/// Schedules per scheduler and scenario; `FENCE_GATE_MODEL_ITERATIONS` asks for a deeper run.
fn iterations() -> usize {
    std::env::var("FENCE_GATE_MODEL_ITERATIONS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(5_000)
}

/// For the broken variants: each is found within a few hundred schedules of this seed.
const ITERATIONS: usize = 5_000;

#[test]
fn every_scenario_keeps_the_order_wakes_every_waiter_and_leaks_nothing() {
    for (tasks, shared) in [
        (SWEPT, false),
        (GIVING_UP, false),
        (DESCENDING, false),
        (SHARED, true),
    ] {
        explore(PctScheduler::new(3, iterations()), tasks, shared);
        explore(RandomScheduler::new(iterations()), tasks, shared);
    }
}

/// What a panic said.
fn message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

/// Each broken variant, with what the check meant for it says when it finds it.
const BROKEN: [(Mutant, &str); 3] = [
    (Mutant::CollapseHeld, "reached the service"),
    (Mutant::EvictHeld, "reached the service"),
    (Mutant::DrainUnnotified, "deadlock"),
];

#[test]
fn each_broken_variant_is_caught() {
    for (mutant, finding) in BROKEN {
        MUTANT.with(|m| m.set(Some(mutant)));
        let caught = catch_unwind(AssertUnwindSafe(|| {
            explore(RandomScheduler::new_from_seed(7, ITERATIONS), SWEPT, false);
        }));
        MUTANT.with(|m| m.set(None));
        let said = message(&*caught.expect_err("the model check missed a broken variant"));
        assert!(
            said.contains(finding),
            "{mutant:?} was caught, but not by the check meant for it: {said}"
        );
    }
}
