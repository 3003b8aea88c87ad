//! Does sled's page cache explain a store's resident memory rising while forgetting keeps
//! the data flat? Writes N records under churn (insert record i, delete record i - WINDOW,
//! as forgetting does), flushed in batches of 64 like fence's group commit, with sled's
//! cache at CACHE_MB or at its default (1 GiB), and prints the process's RSS as it goes. Run
//! it once per cache size: each run is a process of its own. KEYS `padded` (the default)
//! writes `job-000000000042`, in key order; `fence` writes keys as the sink store does: job
//! ids as clients make them (`j4711-42`, so new keys land all over the key space) and a
//! second tree of stamps (time, then job), one per record, removed with it.
//!
//! ```text
//! cargo run --release --example sled_cache -- 2000000 100000 64
//! cargo run --release --example sled_cache -- 2000000 100000 default
//! cargo run --release --example sled_cache -- 2000000 100000 default fence
//! ```
//! Used for the note on resident memory in BENCHMARKS.md (issue 16).

fn run(
    label: &str,
    records: u64,
    window: u64,
    cache: Option<u64>,
    fence_keys: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let mut config = sled::Config::new().path(dir.path());
    if let Some(bytes) = cache {
        config = config.cache_capacity(bytes);
    }
    let db = config.open()?;
    let stamps = db.open_tree("stamps")?;
    let value = [7u8; 56];
    let key = |i: u64| {
        if fence_keys {
            format!("j4711-{i}")
        } else {
            format!("job-{i:012}")
        }
    };
    let stamp = |i: u64| {
        [
            &(1_700_000_000_000 + i).to_be_bytes()[..],
            key(i).as_bytes(),
        ]
        .concat()
    };
    for i in 0..records {
        db.insert(key(i), &value[..])?;
        if fence_keys {
            stamps.insert(stamp(i), &[][..])?;
        }
        if i >= window {
            db.remove(key(i - window))?;
            if fence_keys {
                stamps.remove(stamp(i - window))?;
            }
        }
        if i % 64 == 63 {
            db.flush()?;
        }
        if (i + 1) % (records / 8) == 0 {
            let rss = fence_suite::resident_bytes().unwrap_or(0) / (1024 * 1024);
            println!(
                "{label:<12} {:>9} records written, {:>6} kept: RSS {rss} MiB",
                i + 1,
                db.len()
            );
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (records, window, cache, keys) = match args.as_slice() {
        [r, w, c] => (r, w, c, "padded"),
        [r, w, c, k] => (r, w, c, k.as_str()),
        _ => return Err("usage: sled_cache RECORDS WINDOW CACHE_MB|default [padded|fence]".into()),
    };
    let fence_keys = match keys {
        "padded" => false,
        "fence" => true,
        other => return Err(format!("KEYS is padded or fence, not {other}").into()),
    };
    let (records, window) = (records.parse()?, window.parse()?);
    match cache.as_str() {
        "default" => run(&format!("1G {keys}"), records, window, None, fence_keys),
        mb => run(
            &format!("{mb}M {keys}"),
            records,
            window,
            Some(mb.parse::<u64>()? << 20),
            fence_keys,
        ),
    }
}
