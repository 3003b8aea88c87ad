//! Does sled's page cache explain a store's resident memory rising while forgetting keeps
//! the data flat? Writes N records under churn (insert record i, delete record i - WINDOW,
//! as forgetting does), flushed in batches of 64 like fence's group commit, with sled's
//! cache at CACHE_MB or at its default (1 GiB), and prints the process's RSS as it goes. Run
//! it once per cache size: each run is a process of its own.
//!
//! ```text
//! cargo run --release --example sled_cache -- 2000000 100000 64
//! cargo run --release --example sled_cache -- 2000000 100000 default
//! ```
//! Used for the note on resident memory in BENCHMARKS.md (issue 16).

fn run(
    label: &str,
    records: u64,
    window: u64,
    cache: Option<u64>,
) -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let mut config = sled::Config::new().path(dir.path());
    if let Some(bytes) = cache {
        config = config.cache_capacity(bytes);
    }
    let db = config.open()?;
    let value = [7u8; 56];
    for i in 0..records {
        db.insert(format!("job-{i:012}"), &value[..])?;
        if i >= window {
            db.remove(format!("job-{:012}", i - window))?;
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
    let [records, window, cache] = args.as_slice() else {
        return Err("usage: sled_cache RECORDS WINDOW CACHE_MB|default".into());
    };
    let (records, window) = (records.parse()?, window.parse()?);
    match cache.as_str() {
        "default" => run("default 1G", records, window, None),
        mb => run(
            &format!("cache {mb}M"),
            records,
            window,
            Some(mb.parse::<u64>()? << 20),
        ),
    }
}
