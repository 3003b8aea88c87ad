//! The Dockerfile and the systemd units name flags, paths and variables that must exist: a
//! renamed flag would otherwise only show when an operator's service fails to start. Nothing
//! is built with Docker here; every `--flag` they pass is checked against `fence --help`.

mod common;

use std::{collections::BTreeSet, path::PathBuf};

use common::*;

fn repo(path: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The flags and `FENCE_*` variables `fence SUBCOMMAND --help` documents.
fn documented(subcommand: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let out = fence(&[subcommand, "--help"]);
    assert_success(&out);
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    let words = |prefix: &str| {
        help.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
            .filter(|w| w.starts_with(prefix) && w.len() > prefix.len())
            .map(String::from)
            .collect::<BTreeSet<_>>()
    };
    (words("--"), words("FENCE_"))
}

/// Checks every `--flag` of a `fence SUB ...` command line against the help of SUB.
fn check_command(origin: &str, words: &[&str]) {
    let at = words
        .iter()
        .position(|w| w.ends_with("/fence") || *w == "fence")
        .unwrap_or_else(|| panic!("{origin}: no fence command in {words:?}"));
    let subcommand = words[at + 1];
    let (flags, _) = documented(subcommand);
    for flag in words[at + 2..].iter().filter(|w| w.starts_with("--")) {
        assert!(
            flags.contains(*flag),
            "{origin}: `fence {subcommand}` has no {flag} (see fence {subcommand} --help)"
        );
    }
}

#[test]
fn the_systemd_units_use_flags_fence_has() {
    for unit in ["fence-server.service", "fence-proxy.service"] {
        let text = repo(&format!("contrib/systemd/{unit}"));
        let exec = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .unwrap_or_else(|| panic!("{unit}: no ExecStart"));
        let words: Vec<&str> = exec.split_whitespace().collect();
        assert_eq!(words[0], "/usr/local/bin/fence", "{unit}");
        check_command(unit, &words);
        for needed in [
            "ProtectSystem=strict",
            "StateDirectory=",
            "NoNewPrivileges=yes",
        ] {
            assert!(text.contains(needed), "{unit} lacks {needed}");
        }
        assert!(
            text.contains("DynamicUser=yes") || text.contains("User=fence"),
            "{unit}: a user of its own"
        );
    }
    // The proxy's upstream comes from FENCE_UPSTREAM in its environment file.
    let (_, vars) = documented("proxy");
    assert!(vars.contains("FENCE_UPSTREAM"), "{vars:?}");
    assert!(repo("contrib/systemd/fence-proxy.service").contains("FENCE_UPSTREAM="));
}

#[test]
fn the_dockerfile_builds_the_dist_profile_and_runs_as_a_user() {
    let text = repo("Dockerfile");
    let manifest = repo("Cargo.toml");
    assert!(
        manifest.contains("[profile.dist]"),
        "the profile the Dockerfile builds"
    );
    assert!(text.contains("--profile dist") && text.contains("/src/target/dist/fence"));
    assert!(text.contains("USER fence"), "not root");
    let cmd = text
        .lines()
        .find_map(|l| l.strip_prefix("CMD "))
        .expect("a CMD");
    let cmd: Vec<String> = serde_json::from_str(cmd).expect("CMD in exec form");
    let entry = text
        .lines()
        .find_map(|l| l.strip_prefix("ENTRYPOINT "))
        .expect("an ENTRYPOINT");
    let entry: Vec<String> = serde_json::from_str(entry).unwrap();
    let words: Vec<&str> = entry.iter().chain(&cmd).map(String::as_str).collect();
    check_command("Dockerfile", &words);
    for port in ["7700", "7800", "7801"] {
        assert!(text.contains(port), "EXPOSE {port}");
    }
}

#[test]
fn both_licenses_named_by_the_manifests_are_there() {
    assert!(repo("Cargo.toml").contains(r#"license = "MIT OR Apache-2.0""#));
    assert!(repo("LICENSE-MIT").contains("Permission is hereby granted"));
    assert!(repo("LICENSE-APACHE").contains("Apache License"));
}
