//! The disk's group-commit limit: how many small records per second can be made durable.
//!
//! ```text
//! cargo run --release --example disk_probe -- DIR SECONDS CLIENTS
//! ```
//! One writer thread appends every record submitted so far to a file in DIR and calls
//! `fdatasync` once per batch; CLIENTS threads each submit a 64-byte record and wait until it
//! is durable, again and again, for SECONDS. Prints `disk CLIENTS records/s`: the most any
//! store that acknowledges a write only once it is on disk could do on this disk with that
//! many writers waiting at once, with nothing else in the way (no network, no parsing, no
//! index). `bench/limits.sh` sets fence's durable paths against it (issue 32).

use std::{
    fs::File,
    io::Write,
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

#[derive(Default)]
struct State {
    pending: Vec<u8>,
    /// The last ticket handed out, and the last one on disk.
    issued: u64,
    durable: u64,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, secs, clients] = args.as_slice() else {
        eprintln!("usage: disk_probe DIR SECONDS CLIENTS");
        std::process::exit(2);
    };
    let secs: u64 = secs.parse().expect("SECONDS: a whole number");
    let clients: usize = clients.parse().expect("CLIENTS: a whole number");
    let path = std::path::Path::new(dir).join(format!("probe-{}.log", std::process::id()));
    let mut file = File::create(&path).expect("the probe file can be created");
    let shared = Arc::new(Shared {
        state: Mutex::new(State::default()),
        work: Condvar::new(),
        done: Condvar::new(),
    });
    let writer = {
        let shared = shared.clone();
        std::thread::spawn(move || {
            let mut batch = Vec::new();
            loop {
                let last = {
                    let mut s = shared.state.lock().unwrap();
                    while s.pending.is_empty() && !s.stop {
                        s = shared.work.wait(s).unwrap();
                    }
                    if s.pending.is_empty() {
                        return;
                    }
                    std::mem::swap(&mut batch, &mut s.pending);
                    s.issued
                };
                file.write_all(&batch).expect("write");
                file.sync_data().expect("fdatasync");
                batch.clear();
                shared.state.lock().unwrap().durable = last;
                shared.done.notify_all();
            }
        })
    };
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
    writer.join().unwrap();
    let _ = std::fs::remove_file(&path);
    println!("disk {clients} {:.0}", acked as f64 / took);
}
