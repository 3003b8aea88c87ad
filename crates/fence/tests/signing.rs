//! Signed tokens end to end: `fence keygen`, `fence server --signing-key`, `fence proxy
//! --verify-key`, and key files that cannot be used.

mod common;

use std::{os::unix::fs::PermissionsExt, path::Path, process::Command};

use common::*;

fn keygen(dir: &Path) {
    let out = fence(&["keygen", "--out", dir.to_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[test]
fn keygen_writes_a_private_key_only_its_owner_can_read_and_never_overwrites() {
    let dir = tempfile::tempdir().unwrap();
    keygen(dir.path());
    assert_eq!(mode(&dir.path().join("fence-signing.key")), 0o600);
    let public = std::fs::read_to_string(dir.path().join("fence-verify.pub")).unwrap();
    assert_eq!(
        public.trim_end().len(),
        44,
        "one line of padded base64 of 32 bytes: {public:?}"
    );
    let again = fence(&["keygen", "--out", dir.path().to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("never overwritten"));
}

#[test]
fn unusable_key_files_stop_server_and_proxy_at_start_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    keygen(&dir.path().join("keys"));
    let private = dir.path().join("keys/fence-signing.key");
    let write = |name: &str, contents: &str, mode: u32| {
        let p = dir.path().join(name);
        std::fs::write(&p, contents).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    };
    let open = write(
        "open.key",
        &std::fs::read_to_string(&private).unwrap(),
        0o644,
    );
    let garbage = write("garbage.key", "not base64 at all!\n", 0o600);
    let short = write("short.key", "AAAA\n", 0o600);
    let two_lines = write("two.key", "AAAA\nAAAA\n", 0o600);
    let missing = dir.path().join("missing.key");
    let data = dir.path().join("data");
    let cases: Vec<(&Path, &str)> = vec![
        (&missing, "cannot read it"),
        (&open, "readable by group or others"),
        (&garbage, "not standard padded base64"),
        (&short, "3 bytes long; an Ed25519 key is 32"),
        (&two_lines, "exactly one line"),
    ];
    for (key, want) in &cases {
        let out = Command::new(FENCE)
            .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(&data)
            .arg("--signing-key")
            .arg(key)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {stderr}", key.display());
        assert!(
            stderr.contains(&key.display().to_string()) && stderr.contains(want),
            "{}: {stderr} lacks {want:?}",
            key.display()
        );
    }
    for (key, want) in [
        (&missing, "cannot read it"),
        (&garbage, "not standard padded base64"),
        (&short, "3 bytes long"),
    ] {
        let out = Command::new(FENCE)
            .args([
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:9",
                "--data-dir",
            ])
            .arg(&data)
            .arg("--verify-key")
            .arg(key)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{}: {stderr}", key.display());
        assert!(
            stderr.contains(&key.display().to_string()) && stderr.contains(want),
            "{stderr}"
        );
    }
}

#[test]
fn worked_example_with_signing_at_both_ends_and_an_attacker() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    keygen(&keys);
    let (_server, server) = start_ready(&[
        "server",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        dir.path().join("leases").to_str().unwrap(),
        "--signing-key",
        keys.join("fence-signing.key").to_str().unwrap(),
    ]);
    let server = format!("http://{server}");
    let upstream = format!("http://{}", start_upstream());
    let (_proxy, proxy) = start_proxy_with(
        &upstream,
        &[
            "--data-dir",
            dir.path().join("proxy").to_str().unwrap(),
            "--verify-key",
            keys.join("fence-verify.pub").to_str().unwrap(),
        ],
    );
    let claim = |owner: &str, ttl: &str| {
        let out = fence(&[
            "claim",
            "--server",
            &server,
            "--job",
            "invoice-42",
            "--owner",
            owner,
            "--ttl",
            ttl,
        ]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let write = |token: &str| {
        http_status(
            &proxy,
            "POST",
            "/ledger",
            &[
                ("X-Fencing-Job", "invoice-42".to_owned()),
                ("X-Fencing-Token", token.to_owned()),
            ],
        )
    };
    let a = claim("worker-a", "300ms");
    let token_a = a["token"]
        .as_str()
        .expect("a signing server answers with a token")
        .to_owned();
    assert!(token_a.starts_with("1."), "{token_a}");
    assert_eq!(write(&token_a), 200);

    // An attacker who can reach the destination tries to lock the job out for good.
    assert_eq!(write("18446744073709551615"), 403);
    assert_eq!(
        write(&format!(
            "18446744073709551615.{}",
            token_a.split_once('.').unwrap().1
        )),
        403
    );
    assert_eq!(write(&token_a), 200, "the legitimate holder keeps writing");

    std::thread::sleep(std::time::Duration::from_millis(350)); // A's lease expires
    let b = claim("worker-b", "30s");
    let token_b = b["token"].as_str().unwrap().to_owned();
    assert!(token_b.starts_with("2."), "{token_b}");
    assert_eq!(write(&token_b), 200);
    assert_eq!(write(&token_a), 409, "A's stale signed token is fenced out");

    // fence run hands the signed string to its command.
    let out_file = dir.path().join("token");
    let script = format!("printf %s \"$FENCE_TOKEN\" > {}", out_file.display());
    let run = fence(&[
        "run",
        "--server",
        &server,
        "--job",
        "other-job",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(
        run.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let exported = std::fs::read_to_string(&out_file).unwrap();
    assert!(
        exported.starts_with("1.") && exported.len() == 2 + 86,
        "{exported}"
    );
}
