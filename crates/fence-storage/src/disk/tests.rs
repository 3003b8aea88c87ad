//! The durable database's tests: group commit, the directory lock, the log's replay after a crash.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
};

use super::*;

/// Small segments, checkpointed often: a crash test crosses many checkpoints.
const SMALL: Limits = Limits {
    age: Duration::from_millis(20),
    bytes: 64 << 10,
    stall: STALLED_AFTER,
};

/// The environment variable that makes [`acknowledged_writes_survive_a_killed_process`] the
/// child that writes until it is killed.
const CHILD: &str = "FENCE_DISK_CRASH_CHILD";

/// Writers, keys each writer cycles through.
const WRITERS: u64 = 8;
const KEYS: u64 = 50;

fn key(writer: u64, n: u64) -> [u8; 16] {
    let mut k = [0; 16];
    k[..8].copy_from_slice(&writer.to_be_bytes());
    k[8..].copy_from_slice(&(n % KEYS).to_be_bytes());
    k
}

/// The child: writers overwrite their keys with counts and print each count once it is
/// committed, until the process is killed.
async fn write_until_killed(dir: &str) -> ! {
    let db = DurableDb::open_with(Path::new(dir), SMALL).unwrap();
    let tree = db.tree("t").unwrap();
    for writer in 0..WRITERS {
        let (db, tree) = (db.clone(), tree.clone());
        tokio::spawn(async move {
            for n in 0.. {
                tree.insert(key(writer, n), &n.to_be_bytes()).unwrap();
                if n % 7 == 3 {
                    // Some writes removed again: a removal is acknowledged like a write.
                    tree.remove(key(writer, n)).unwrap();
                }
                db.commit().await.unwrap();
                println!("{writer} {n}");
            }
        });
    }
    std::future::pending().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_a_killed_process() {
    if let Ok(dir) = std::env::var(CHILD) {
        write_until_killed(&dir).await;
    }
    let dir = tempfile::tempdir().unwrap();
    for round in 0..3 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "disk::tests::acknowledged_writes_survive_a_killed_process",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, dir.path())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = seen.clone();
        let reader = std::thread::spawn(move || {
            let mut acked = std::collections::HashMap::new();
            for line in lines.map_while(Result::ok) {
                let mut words = line.split(' ').map(|w| w.parse::<u64>());
                if let (Some(Ok(writer)), Some(Ok(n))) = (words.next(), words.next()) {
                    acked.insert(key(writer, n), n);
                    counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            acked
        });
        // Long enough for many checkpoints (every 20 ms) and writes in the log behind them,
        // and for enough acknowledgements to judge however loaded the machine is (bounded:
        // a child that acknowledges nothing in a minute fails the assertion below).
        std::thread::sleep(Duration::from_millis(600 + 300 * round));
        let waiting = std::time::Instant::now();
        while seen.load(std::sync::atomic::Ordering::Relaxed) < 200
            && waiting.elapsed() < Duration::from_secs(60)
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        let acked = reader.join().unwrap();
        assert!(
            acked.len() > 20,
            "round {round}: the child acknowledged too little to judge"
        );
        let db = DurableDb::open(dir.path()).unwrap();
        let tree = db.tree("t").unwrap();
        for (k, n) in acked {
            let stored = tree
                .get(k)
                .unwrap()
                .map(|v| u64::from_be_bytes(v[..].try_into().unwrap()));
            // The acknowledged write, or the next one of the same key: a writer waits for its
            // commit before its next write, but the kill can come between a commit and its
            // line, so the key's next write (KEYS later) may be in flight, or done unseen.
            let removed = |n: u64| n % 7 == 3;
            match stored {
                Some(m) => assert!(
                    (m == n && !removed(n)) || m == n + KEYS,
                    "round {round}: {k:?} holds {m}, {n} was acknowledged"
                ),
                None => assert!(
                    removed(n) || removed(n + KEYS),
                    "round {round}: {k:?} is gone, {n} was acknowledged"
                ),
            }
        }
    }
}

/// A database that held `key` = `value` in tree `t` and was closed cleanly; and its log's
/// directory.
async fn closed_with(key: &str, value: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = DurableDb::open(dir.path()).unwrap();
        db.tree("t").unwrap().insert(key, value).unwrap();
        db.commit().await.unwrap();
    }
    let log_dir = dir.path().join(log::LOG_DIR);
    (dir, log_dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_close_leaves_no_log_and_a_torn_last_record_is_ignored() {
    let (dir, log_dir) = closed_with("a", "1").await;
    assert_eq!(
        std::fs::read_dir(&log_dir).unwrap().count(),
        0,
        "a clean close checkpoints and deletes the log"
    );
    // A log as a crash leaves it: a whole frame, then one cut short.
    let mut file = segment(7, &[(b"b", b"2")]);
    let whole = file.len();
    file.extend(&segment(7, &[(b"c", b"3")])[log::header(0).len()..]);
    std::fs::write(log_dir.join(format!("{:020}.log", 7)), &file[..whole + 5]).unwrap();
    let db = DurableDb::open(dir.path()).unwrap();
    let tree = db.tree("t").unwrap();
    assert_eq!(tree.get("a").unwrap().as_deref(), Some(&b"1"[..]));
    assert_eq!(
        tree.get("b").unwrap().as_deref(),
        Some(&b"2"[..]),
        "the whole record is replayed"
    );
    assert_eq!(tree.get("c").unwrap(), None, "the torn one is not");
    let left: Vec<_> = std::fs::read_dir(&log_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        left,
        [std::ffi::OsString::from(format!("{:020}.log", 8))],
        "replayed segments are deleted; the next one is numbered after them"
    );
}

/// A segment's file: its header, then one frame of segment `number` putting each (key, value)
/// in tree `t`.
fn segment(number: u64, puts: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut body = Vec::new();
    for (key, value) in puts {
        log::Op::Put {
            tree: b"t",
            key,
            value,
        }
        .encode(&mut body);
    }
    let mut out = log::header(SALT).to_vec();
    log::frame(number, SALT, &body, &mut out);
    out
}

const SALT: u64 = 77;

#[test]
fn a_segment_without_its_end_before_the_last_refuses_to_open() {
    let dir = tempfile::tempdir().unwrap();
    let log_dir = dir.path().join(log::LOG_DIR);
    std::fs::create_dir_all(&log_dir).unwrap();
    // Segment 1 cut short (damaged or lost its end), yet segment 2 exists.
    std::fs::write(
        log_dir.join(format!("{:020}.log", 1)),
        segment(1, &[(b"a", b"1")]),
    )
    .unwrap();
    std::fs::write(
        log_dir.join(format!("{:020}.log", 2)),
        segment(2, &[(b"b", b"2")]),
    )
    .unwrap();
    let err = DurableDb::open(dir.path()).unwrap_err();
    assert!(matches!(err, OpenError::Log { .. }), "{err:?}");
    assert!(
        crate::error_chain(&err).contains("00000000000000000001.log has no end"),
        "{}",
        crate::error_chain(&err)
    );
    // With its end, both are replayed.
    let mut ended = segment(1, &[(b"a", b"1")]);
    log::frame(1, SALT, &[], &mut ended);
    std::fs::write(log_dir.join(format!("{:020}.log", 1)), ended).unwrap();
    let db = DurableDb::open(dir.path()).unwrap();
    let tree = db.tree("t").unwrap();
    assert_eq!(tree.get("a").unwrap().as_deref(), Some(&b"1"[..]));
    assert_eq!(tree.get("b").unwrap().as_deref(), Some(&b"2"[..]));
}

/// The last segment with three frames, the first one's body damaged (a bit flipped on the
/// disk after it was synced): a crash only cuts the last frame short, so the whole frames
/// after it prove damage. Replaying up to the damage would drop the acknowledged writes of
/// frames 2 and 3 and delete the segment: the open is refused by name and the file kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_frame_before_whole_ones_in_the_last_segment_refuses_to_open() {
    let (dir, log_dir) = closed_with("a", "1").await;
    let path = log_dir.join(format!("{:020}.log", 4));
    let mut file = segment(4, &[(b"b", b"2")]);
    for (key, value) in [(b"c", b"3"), (b"d", b"4")] {
        file.extend(&segment(4, &[(key, value)])[log::header(0).len()..]);
    }
    // The last byte of the first frame's body (its value "2").
    let at = segment(4, &[(b"b", b"2")]).len() - 1;
    file[at] ^= 0x01;
    std::fs::write(&path, &file).unwrap();
    let err = DurableDb::open(dir.path()).unwrap_err();
    assert!(matches!(err, OpenError::Log { .. }), "{err:?}");
    let said = crate::error_chain(&err);
    assert!(
        said.contains("00000000000000000004.log is damaged: its frame at byte 16"),
        "{said}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), file, "the segment is kept");
}

/// A last segment whose header is not this build's, followed by frames (a log written by
/// another version of fence, or a damaged header): it was read as empty, then deleted with
/// the writes it held. The open is refused by name and the file kept. A segment file that
/// is zeros (a crash before its header was written) still opens, as nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_segment_of_another_format_refuses_to_open_and_one_of_zeros_opens() {
    let (dir, log_dir) = closed_with("a", "1").await;
    let path = log_dir.join(format!("{:020}.log", 3));
    let mut file = segment(3, &[(b"b", b"2")]);
    file[0] ^= 0x20;
    std::fs::write(&path, &file).unwrap();
    let err = DurableDb::open(dir.path()).unwrap_err();
    assert!(matches!(err, OpenError::Log { .. }), "{err:?}");
    let said = crate::error_chain(&err);
    assert!(
        said.contains(
            "00000000000000000003.log does not start with this build's header: it was written by another version of fence"
        ),
        "{said}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), file, "the segment is kept");
    std::fs::write(&path, [0; 4096]).unwrap();
    let db = DurableDb::open(dir.path()).unwrap();
    assert_eq!(
        db.tree("t").unwrap().get("a").unwrap().as_deref(),
        Some(&b"1"[..])
    );
}

/// A segment before the last one with a header of zeros: a crash leaves that only in the
/// last one, so it is damage, and the refusal says the header is damaged (it said the
/// segment had no end).
#[test]
fn a_segment_before_the_last_with_a_zeroed_header_is_named_as_damaged() {
    let dir = tempfile::tempdir().unwrap();
    let log_dir = dir.path().join(log::LOG_DIR);
    std::fs::create_dir_all(&log_dir).unwrap();
    let mut first = segment(1, &[(b"a", b"1")]);
    log::frame(1, SALT, &[], &mut first);
    first[..log::header(0).len()].fill(0);
    std::fs::write(log_dir.join(format!("{:020}.log", 1)), first).unwrap();
    std::fs::write(
        log_dir.join(format!("{:020}.log", 2)),
        segment(2, &[(b"b", b"2")]),
    )
    .unwrap();
    let said = crate::error_chain(&DurableDb::open(dir.path()).unwrap_err());
    assert!(
        said.contains("00000000000000000001.log has a damaged header"),
        "{said}"
    );
}

/// A segment file with the largest number (not one fence wrote: it would take 2^64 segments)
/// refuses the open by name, instead of a log whose next segment's number overflows (a panic
/// of the writer thread in a debug build, leaving every commit unanswered; in a release
/// build, segment 0, which the next checkpoint deletes while it is being written).
#[test]
fn a_segment_with_the_largest_number_refuses_to_open() {
    let dir = tempfile::tempdir().unwrap();
    let log_dir = dir.path().join(log::LOG_DIR);
    std::fs::create_dir_all(&log_dir).unwrap();
    std::fs::write(
        log_dir.join(format!("{:020}.log", u64::MAX)),
        segment(u64::MAX, &[(b"a", b"1")]),
    )
    .unwrap();
    let err = DurableDb::open(dir.path()).unwrap_err();
    assert!(matches!(err, OpenError::Log { .. }), "{err:?}");
    assert!(
        crate::error_chain(&err).contains("18446744073709551615.log has the largest number"),
        "{}",
        crate::error_chain(&err)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segments_before_a_gap_in_the_numbers_are_not_replayed() {
    let (dir, log_dir) = closed_with("k", "new").await;
    // As a power cut can leave a checkpoint's deletions: segment 1 (an older value of k,
    // flushed into sled before segment 2 was deleted) kept, 2 gone, 3 the live one.
    let mut old = segment(1, &[(b"k", b"old")]);
    log::frame(1, SALT, &[], &mut old);
    std::fs::write(log_dir.join(format!("{:020}.log", 1)), old).unwrap();
    std::fs::write(
        log_dir.join(format!("{:020}.log", 3)),
        segment(3, &[(b"l", b"x")]),
    )
    .unwrap();
    let db = DurableDb::open(dir.path()).unwrap();
    let tree = db.tree("t").unwrap();
    assert_eq!(
        tree.get("k").unwrap().as_deref(),
        Some(&b"new"[..]),
        "k went back to an older value"
    );
    assert_eq!(tree.get("l").unwrap().as_deref(), Some(&b"x"[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_with_nothing_unsynced_returns_at_once_and_checkpoints_delete_old_segments() {
    let dir = tempfile::tempdir().unwrap();
    let db = DurableDb::open_with(dir.path(), SMALL).unwrap();
    let tree = db.tree("t").unwrap();
    for i in 0u64..50 {
        tree.insert(i.to_be_bytes(), &[0u8; 100][..]).unwrap();
        db.commit().await.unwrap();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Nothing written since: no round trip to the writer thread.
    db.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    tree.insert("last", "x").unwrap();
    db.commit().await.unwrap();
    // The checkpoint runs in the background: looked for until it has, within 10 s (a fixed
    // pause would race it on a loaded machine).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let segments = loop {
        let segments = std::fs::read_dir(dir.path().join(log::LOG_DIR))
            .unwrap()
            .count();
        if segments <= 2 || std::time::Instant::now() >= deadline {
            break segments;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        segments <= 2,
        "{segments} segments left: checkpoints delete the ones behind"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_waiters_share_flushes_and_all_see_their_writes_after_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = DurableDb::open(dir.path()).unwrap();
        let tree = db.tree("t").unwrap();
        let mut tasks = Vec::new();
        for i in 0u64..200 {
            let (db, tree) = (db.clone(), tree.clone());
            tasks.push(tokio::spawn(async move {
                tree.insert(i.to_be_bytes(), &i.to_be_bytes()).unwrap();
                db.commit().await.unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    }
    let db = DurableDb::open(dir.path()).unwrap();
    assert_eq!(db.tree("t").unwrap().len(), 200);
}

#[test]
fn a_directory_in_use_is_refused_by_name_and_free_again_once_closed() {
    let dir = tempfile::tempdir().unwrap();
    let first = DurableDb::open(dir.path()).unwrap();
    // Another process holding it looks the same as another open file description.
    let err = DurableDb::open(dir.path()).unwrap_err();
    assert!(matches!(err, OpenError::Locked { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "another fence process is using the data directory {}; stop it or choose another directory",
            dir.path().display()
        )
    );
    drop(first);
    DurableDb::open(dir.path()).expect("unlocked once closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_printed_for_debugging_shows_no_stored_value() {
    let dir = tempfile::tempdir().unwrap();
    let db = DurableDb::open(dir.path()).unwrap();
    let tree = db.tree("t").unwrap();
    tree.insert("k", "a-stored-secret").unwrap();
    for printed in [format!("{db:?}"), format!("{tree:?}")] {
        assert!(!printed.contains("a-stored-secret"), "{printed}");
        // Bytes print as numbers in a Vec's Debug: not those either.
        let as_numbers = format!("{:?}", b"a-stored-secret");
        assert!(!printed.contains(&as_numbers[1..20]), "{printed}");
    }
    db.commit().await.unwrap();
    assert!(
        !format!("{db:?}").contains("a-stored-secret"),
        "nor once it is in sled"
    );
}

#[tokio::test]
// The guard held across awaits is the stalled disk: the log's writer, another thread,
// waits on it; nothing on this task does.
#[allow(clippy::await_holding_lock)]
async fn a_commit_gives_up_when_the_disk_stalls_and_the_write_lands_after() {
    let dir = tempfile::tempdir().unwrap();
    let db = DurableDb::open(dir.path()).unwrap();
    let tree = db.tree("t").unwrap();
    tree.insert("k", "before").unwrap();
    db.commit().await.unwrap();
    let stalled = db.stall_log();
    tree.insert("k", "during").unwrap();
    let within = Duration::from_millis(100);
    let asked = Instant::now();
    let failed = tokio::time::timeout(Duration::from_secs(5), db.commit_within(within))
        .await
        .expect("commit_within waited past its deadline");
    assert!(
        matches!(failed, Err(CommitError::TimedOut(d)) if d == within),
        "{failed:?}"
    );
    assert!(asked.elapsed() >= within);
    // The disk answers again: the write waited for lands, and commits succeed.
    drop(stalled);
    db.commit_within(Duration::from_secs(10)).await.unwrap();
    drop((tree, db));
    let db = DurableDb::open(dir.path()).unwrap();
    assert_eq!(
        db.tree("t").unwrap().get("k").unwrap().as_deref(),
        Some(&b"during"[..])
    );
}

// The guard held across awaits is the stalled disk, as above.
#[allow(clippy::await_holding_lock)]
#[tokio::test]
async fn commits_that_gave_up_do_not_pile_up_while_the_disk_stalls() {
    let dir = tempfile::tempdir().unwrap();
    let db = DurableDb::open(dir.path()).unwrap();
    let tree = db.tree("t").unwrap();
    let stalled = db.stall_log();
    tree.insert("k", "v").unwrap();
    for _ in 0..3 * log::PRUNE_FROM {
        let gave_up = db.commit_within(Duration::ZERO).await;
        assert!(
            matches!(gave_up, Err(CommitError::TimedOut(_))),
            "{gave_up:?}"
        );
    }
    assert!(
        db.log().waiting() <= log::PRUNE_FROM,
        "{} waiters kept for commits that gave up",
        db.log().waiting()
    );
    drop(stalled);
    db.commit_within(Duration::from_secs(10)).await.unwrap();
}

// The guard held across awaits is the stalled disk, as above.
#[allow(clippy::await_holding_lock)]
#[tokio::test]
async fn writes_are_refused_unapplied_while_the_disk_stalls_and_taken_again_after() {
    let dir = tempfile::tempdir().unwrap();
    let stall = Duration::from_millis(200);
    let db = DurableDb::open_with(dir.path(), Limits { stall, ..SMALL }).unwrap();
    let tree = db.tree("t").unwrap();
    tree.insert("a", "1").unwrap();
    db.commit().await.unwrap();
    let stalled = db.stall_log();
    // Within the limit a write is still taken (its commit waits for the disk).
    tree.insert("b", "1").unwrap();
    let waiting = {
        let db = db.clone();
        tokio::spawn(async move { db.commit_within(Duration::from_secs(30)).await })
    };
    // Past it, decisions are refused and not applied; bookkeeping beside a decision already
    // made is still taken.
    tokio::time::sleep(stall * 3).await;
    let refused = tree
        .compare_and_swap("c", None::<&[u8]>, Some("1"))
        .unwrap_err();
    let text = refused.to_string();
    assert!(
        matches!(&refused, sled::Error::Io(e) if e.kind() == std::io::ErrorKind::TimedOut)
            && text.contains("refused"),
        "{text}"
    );
    assert_eq!(tree.get("c").unwrap(), None);
    tree.insert("d", "1").unwrap();
    // The outcome of an effect that already ran is taken too: refused, it would be lost.
    tree.compare_and_swap_outcome("e", None::<&[u8]>, Some("1"))
        .unwrap()
        .unwrap();
    // The disk answers: the write taken before lands, and writes are taken again.
    drop(stalled);
    waiting.await.unwrap().unwrap();
    tree.compare_and_swap("c", None::<&[u8]>, Some("1"))
        .unwrap()
        .unwrap();
    db.commit().await.unwrap();
    drop((tree, db));
    let db = DurableDb::open(dir.path()).unwrap();
    let tree = db.tree("t").unwrap();
    for key in ["a", "b", "c", "d", "e"] {
        assert_eq!(tree.get(key).unwrap().as_deref(), Some(&b"1"[..]), "{key}");
    }
}

#[tokio::test]
async fn once_the_log_failed_no_write_is_applied() {
    let dir = tempfile::tempdir().unwrap();
    let db = DurableDb::open_with(dir.path(), SMALL).unwrap();
    let tree = db.tree("t").unwrap();
    tree.insert("b", "2").unwrap();
    db.log().fail_for_test();
    for swapped in [
        tree.compare_and_swap("a", None::<&[u8]>, Some("1")),
        // No stall check of its own: refused by the check under the log's lock.
        tree.compare_and_swap_outcome("a", None::<&[u8]>, Some("1")),
    ] {
        let text = swapped.unwrap_err().to_string();
        assert!(text.contains("failed earlier"), "{text}");
    }
    // Nor a plain write: none may change what readers see without a record behind it.
    for refused in [
        tree.insert("a", "1").map(drop),
        tree.remove("b").map(drop),
        tree.clear(),
    ] {
        let text = refused.unwrap_err().to_string();
        assert!(text.contains("failed earlier"), "{text}");
    }
    assert_eq!(tree.get("a").unwrap(), None);
    assert_eq!(tree.get("b").unwrap().as_deref(), Some(&b"2"[..]));
    assert!(db.commit().await.is_err());
}

/// A data directory fence creates is private to its user, whatever the umask: it holds stored
/// responses, checkpoints and lease keys' hashes, in files sled makes as the umask allows. One
/// that exists keeps the mode its owner gave it.
#[test]
fn a_new_data_directory_is_private_and_an_existing_one_keeps_its_mode() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let dir = tempfile::tempdir().unwrap();
    let new = dir.path().join("a/b");
    drop(DurableDb::open(&new).unwrap());
    assert_eq!(mode(&new), 0o700);
    assert_eq!(mode(&dir.path().join("a")), 0o700);
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o750)).unwrap();
    drop(DurableDb::open(&shared).unwrap());
    assert_eq!(mode(&shared), 0o750);
}
