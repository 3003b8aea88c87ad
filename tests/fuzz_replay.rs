//! Every checked-in fuzz corpus file (`fuzz/corpus/<target>/`) fed to its target's checks
//! (`fuzz/checks.rs`) on stable: an input that once found a bug, or that covers a path,
//! fails CI if it breaks again, without nightly or libFuzzer.

// The checks are `pub` for the fuzz crate, which exports them.
#[allow(unreachable_pub)]
#[path = "../fuzz/checks.rs"]
mod checks;

fn replay(target: &str, check: fn(&[u8])) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let outcome = std::panic::catch_unwind(|| check(&data));
        assert!(
            outcome.is_ok(),
            "{target}: {} fails its check",
            path.display()
        );
        files += 1;
    }
    assert!(files > 0, "{target}: the corpus is empty");
}

/// Every target's corpus through its check; a failure names the target and the file.
#[test]
fn every_corpus_replays_through_its_check() {
    type Check = fn(&[u8]);
    let targets: [(&str, Check); 6] = [
        ("headers", checks::headers),
        ("tokens", checks::tokens),
        ("token_parse", checks::token_parse),
        ("lease_api", checks::lease_api),
        ("sink_layer", checks::sink_layer),
        ("pem_and_auth", checks::pem_and_auth),
    ];
    for (target, check) in targets {
        replay(target, check);
    }
}
