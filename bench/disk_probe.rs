//! The disk's group-commit limit: how many small records per second can be made durable.
//!
//! ```text
//! cargo run --release --example disk_probe -- DIR SECONDS CLIENTS [WRITERS=1] [prefilled]
//! ```
//! One writer thread appends every record submitted so far to a file in DIR and calls
//! `fdatasync` once per batch; CLIENTS threads each submit a 64-byte record and wait until it
//! is durable, again and again, for SECONDS. Prints `disk CLIENTS records/s`: the most any
//! store that acknowledges a write only once it is on disk could do on this disk with that
//! many writers waiting at once, with nothing else in the way (no network, no parsing, no
//! index). `bench/limits.sh` sets fence's durable paths against it (issue 32).
//!
//! With WRITERS above 1, that many writer threads take batches in turn and overlap their
//! syncs (as fence's log does with two), appending in the order they took their batches and
//! acknowledging in that order: what the disk gives when syncs run side by side. With
//! `prefilled`, the file is filled with zeros to 16 MiB (and synced) first and written inside
//! that length, from its start again when full, as fence's log writes its kept segment files:
//! `fdatasync` then has no new size to record.

use std::{
    fs::File,
    io::Write,
    os::unix::fs::FileExt,
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

/// The length of a `prefilled` file, as fence's log segments.
const PREFILLED: u64 = 16 << 20;

#[derive(Default)]
struct State {
    pending: Vec<u8>,
    /// The last ticket handed out, and the last one on disk.
    issued: u64,
    durable: u64,
    stop: bool,
    /// Batches taken, and batches acknowledged (in that order).
    taken: u64,
    answered: u64,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
    /// Batches appended to the file and where the next goes (`prefilled`), and its signal.
    appended: Mutex<(u64, u64)>,
    appended_turn: Condvar,
}

/// One writer thread: takes batches in turn with the others, appends them in the order
/// taken, syncs, and acknowledges in that order, until stopped with nothing pending.
fn write_batches(shared: &Shared, file: &File, writers: usize, prefilled: bool) {
    let mut batch = Vec::new();
    loop {
        let (last, turn) = {
            let mut s = shared.state.lock().unwrap();
            while (s.pending.is_empty() || s.taken - s.answered >= writers as u64) && !s.stop {
                s = shared.work.wait(s).unwrap();
            }
            if s.pending.is_empty() {
                return;
            }
            std::mem::swap(&mut batch, &mut s.pending);
            s.taken += 1;
            (s.issued, s.taken - 1)
        };
        {
            // Appends land in the order batches were taken; clients are not held meanwhile
            // (the state's lock is not taken).
            let mut appended = shared.appended.lock().unwrap();
            while appended.0 != turn {
                appended = shared.appended_turn.wait(appended).unwrap();
            }
            if !prefilled {
                (&*file).write_all(&batch).expect("write");
            } else {
                if appended.1 + batch.len() as u64 > PREFILLED {
                    appended.1 = 0;
                }
                file.write_all_at(&batch, appended.1).expect("write");
                appended.1 += batch.len() as u64;
            }
            appended.0 += 1;
            shared.appended_turn.notify_all();
        }
        file.sync_data().expect("fdatasync");
        batch.clear();
        let mut s = shared.state.lock().unwrap();
        while s.answered != turn {
            s = shared.done.wait(s).unwrap();
        }
        s.answered += 1;
        s.durable = last;
        shared.done.notify_all();
        if writers > 1 {
            // A writer may wait for a free turn.
            shared.work.notify_all();
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dir, secs, clients, writers, prefilled) = match args.as_slice() {
        [dir, secs, clients] => (dir, secs, clients, "1", false),
        [dir, secs, clients, writers] => (dir, secs, clients, writers.as_str(), false),
        [dir, secs, clients, writers, p] if p == "prefilled" => {
            (dir, secs, clients, writers.as_str(), true)
        }
        _ => {
            eprintln!("usage: disk_probe DIR SECONDS CLIENTS [WRITERS=1] [prefilled]");
            std::process::exit(2);
        }
    };
    let secs: u64 = secs.parse().expect("SECONDS: a whole number");
    let clients: usize = clients.parse().expect("CLIENTS: a whole number");
    let writers: usize = writers
        .parse::<usize>()
        .expect("WRITERS: a whole number")
        .max(1);
    let path = std::path::Path::new(dir).join(format!("probe-{}.log", std::process::id()));
    let file = Arc::new(File::create(&path).expect("the probe file can be created"));
    if prefilled {
        file.write_all_at(&vec![0; PREFILLED as usize], 0)
            .expect("fill");
        file.sync_all().expect("fsync");
    }
    let shared = Arc::new(Shared {
        state: Mutex::new(State::default()),
        work: Condvar::new(),
        done: Condvar::new(),
        appended: Mutex::new((0, 0)),
        appended_turn: Condvar::new(),
    });
    let writer_threads: Vec<_> = (0..writers)
        .map(|_| {
            let (shared, file) = (shared.clone(), file.clone());
            std::thread::spawn(move || write_batches(&shared, &file, writers, prefilled))
        })
        .collect();
    let end = Instant::now() + Duration::from_secs(secs);
    let workers: Vec<_> = (0..clients)
        .map(|c| {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let mut acked = 0u64;
                let record = [b'a' + (c % 26) as u8; 64];
                while Instant::now() < end {
                    let mut s = shared.state.lock().unwrap();
                    s.pending.extend_from_slice(&record);
                    s.issued += 1;
                    let ticket = s.issued;
                    shared.work.notify_one();
                    while s.durable < ticket {
                        s = shared.done.wait(s).unwrap();
                    }
                    acked += 1;
                }
                acked
            })
        })
        .collect();
    let started = Instant::now();
    let acked: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    let took = started.elapsed().as_secs_f64();
    shared.state.lock().unwrap().stop = true;
    shared.work.notify_all();
    for writer in writer_threads {
        writer.join().unwrap();
    }
    let _ = std::fs::remove_file(&path);
    println!("disk {clients} {:.0}", acked as f64 / took);
}
