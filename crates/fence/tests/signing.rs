//! Signed tokens end to end: `fence keygen` (PEM), keys made by `openssl genpkey`, `fence
//! server --signing-key`, `fence proxy --verify-key`, and key files that cannot be used.

mod common;

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
};

use common::*;

fn keygen(dir: &Path) {
    let out = fence(&["keygen", "--out", dir.to_str().unwrap()]);
    assert_success(&out);
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// A key pair made by the system's `openssl` (Debian's), as an operator would make one.
fn openssl_pair(dir: &Path) -> (PathBuf, PathBuf) {
    let private = dir.join("openssl-signing.pem");
    let public = dir.join("openssl-verify.pem");
    let run = |args: &[&str]| {
        let openssl = Command::new("openssl").args(args).output();
        assert_success(&openssl.expect("openssl is installed (apt install openssl)"));
    };
    run(&[
        "genpkey",
        "-algorithm",
        "ed25519",
        "-out",
        private.to_str().unwrap(),
    ]);
    run(&[
        "pkey",
        "-in",
        private.to_str().unwrap(),
        "-pubout",
        "-out",
        public.to_str().unwrap(),
    ]);
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o600)).unwrap();
    (private, public)
}

#[test]
fn keygen_writes_pem_a_private_key_only_its_owner_can_read_and_never_overwrites() {
    let dir = tempfile::tempdir().unwrap();
    keygen(dir.path());
    let private = dir.path().join("fence-signing.pem");
    assert_eq!(mode(&private), 0o600);
    let private = std::fs::read_to_string(private).unwrap();
    assert!(
        private.starts_with("-----BEGIN PRIVATE KEY-----\n"),
        "{private}"
    );
    let public = std::fs::read_to_string(dir.path().join("fence-verify.pem")).unwrap();
    assert!(
        public.starts_with("-----BEGIN PUBLIC KEY-----\n"),
        "{public}"
    );
    // openssl reads both: they are standard PKCS#8 and SPKI.
    let out = Command::new("openssl")
        .args(["pkey", "-pubin", "-noout", "-text", "-in"])
        .arg(dir.path().join("fence-verify.pem"))
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ED25519 Public-Key"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let again = fence(&["keygen", "--out", dir.path().to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("never overwritten"));
}

fn start_fails(args: &[&str], key_flag: &str, key: &Path) -> (Option<i32>, String) {
    let out = Command::new(FENCE)
        .args(args)
        .arg(key_flag)
        .arg(key)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn unusable_key_files_stop_server_and_proxy_at_start_with_one_line_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    keygen(&dir.path().join("keys"));
    let private = dir.path().join("keys/fence-signing.pem");
    let public = dir.path().join("keys/fence-verify.pem");
    let write = |name: &str, contents: &str, mode: u32| {
        let p = dir.path().join(name);
        std::fs::write(&p, contents).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    };
    let private_text = std::fs::read_to_string(&private).unwrap();
    let public_text = std::fs::read_to_string(&public).unwrap();
    let open = write("open.pem", &private_text, 0o644);
    let garbage = write("garbage.pem", "not a key at all!\n", 0o600);
    let truncated_private = write(
        "truncated-signing.pem",
        &private_text[..private_text.len() / 2],
        0o600,
    );
    let truncated_public = write(
        "truncated-verify.pem",
        &public_text[..public_text.len() - 30],
        0o600,
    );
    // Other algorithms in the same PEM wrappers.
    let ec = dir.path().join("ec.pem");
    let status = Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
        ])
        .arg(&ec)
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::set_permissions(&ec, std::fs::Permissions::from_mode(0o600)).unwrap();
    let ec_public = dir.path().join("ec-pub.pem");
    let status = Command::new("openssl")
        .args(["pkey", "-pubout", "-in"])
        .arg(&ec)
        .arg("-out")
        .arg(&ec_public)
        .status()
        .unwrap();
    assert!(status.success());
    let missing = dir.path().join("missing.pem");
    let data = dir.path().join("data");
    let server = server_args(data.to_str().unwrap(), &[]);
    refused_at_start(
        &server,
        "--signing-key",
        &[
            (&missing, "cannot read it"),
            (&open, "readable by group or others"),
            (&public, "holds a public key, but a private key is needed"),
            (&garbage, "not an Ed25519 private key in PEM"),
            (&truncated_private, "not an Ed25519 private key in PEM"),
            (&ec, "not an Ed25519 private key in PEM"),
        ],
    );
    let proxy = proxy_args(
        "http://127.0.0.1:9",
        &["--data-dir", data.to_str().unwrap()],
    );
    refused_at_start(
        &proxy,
        "--verify-key",
        &[
            (&missing, "cannot read it"),
            (&private, "holds a private key, but a public key is needed"),
            (&garbage, "not an Ed25519 public key in PEM"),
            (&truncated_public, "not an Ed25519 public key in PEM"),
            (&ec_public, "not an Ed25519 public key in PEM"),
        ],
    );
}

/// `fence ARGS FLAG KEY` for each (KEY, want): exit 2, one line naming the file and saying
/// `want`, no key material.
fn refused_at_start(args: &[&str], flag: &str, cases: &[(&PathBuf, &str)]) {
    for (key, want) in cases {
        let (code, stderr) = start_fails(args, flag, key);
        assert_eq!(code, Some(2), "{}: {stderr}", key.display());
        assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
        assert!(
            stderr.contains(&key.display().to_string()) && stderr.contains(want),
            "{}: {stderr} lacks {want:?}",
            key.display()
        );
        assert!(
            !stderr.contains("MC4CAQAw"),
            "key material echoed: {stderr}"
        );
    }
}

struct Cluster {
    _server: Proc,
    server: String,
    _proxy: Proc,
    proxy: String,
}

fn cluster(dir: &Path, signing: &Path, verify: &[&Path]) -> Cluster {
    cluster_with(dir, signing, verify, &[])
}

/// A key pair made by `fence keygen` in `dir/keys`, and a [`cluster_with`] that signs with
/// it and verifies with it, with `proxy_flags`.
fn keyed_cluster(dir: &Path, proxy_flags: &[&str]) -> Cluster {
    let keys = dir.join("keys");
    keygen(&keys);
    cluster_with(
        dir,
        &keys.join("fence-signing.pem"),
        &[&keys.join("fence-verify.pem")],
        proxy_flags,
    )
}

/// As [`cluster`], with more flags for the proxy.
fn cluster_with(dir: &Path, signing: &Path, verify: &[&Path], proxy_flags: &[&str]) -> Cluster {
    let (server_proc, server) = start_ready(&server_args(
        dir.join("leases").to_str().unwrap(),
        &["--signing-key", signing.to_str().unwrap()],
    ));
    let upstream = format!("http://{}", start_upstream());
    let mut extra = vec![
        "--data-dir".to_owned(),
        dir.join("proxy").to_str().unwrap().to_owned(),
    ];
    for key in verify {
        extra.push("--verify-key".into());
        extra.push(key.to_str().unwrap().into());
    }
    extra.extend(proxy_flags.iter().map(|f| (*f).to_owned()));
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let (proxy_proc, proxy) = start_proxy_with(&upstream, &extra);
    Cluster {
        _server: server_proc,
        server: format!("http://{server}"),
        _proxy: proxy_proc,
        proxy,
    }
}

fn claim(server: &str, job: &str, owner: &str, ttl: &str) -> serde_json::Value {
    let out = fence_line(&format!(
        "claim --server {} --job {} --owner {} --ttl {}",
        server, job, owner, ttl
    ));
    assert_success(&out);
    serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
}

fn write(proxy: &str, job: &str, token: &str) -> u16 {
    fenced_post(proxy, "/ledger", job, token)
}

#[test]
fn worked_example_with_signing_at_both_ends_and_an_attacker() {
    let dir = tempfile::tempdir().unwrap();
    let c = keyed_cluster(dir.path(), &[]);
    let job = "invoice-42";
    let a = claim(&c.server, job, "worker-a", "300ms");
    let token_a = a["token"]
        .as_str()
        .expect("a signing server answers with a token")
        .to_owned();
    let parts: Vec<&str> = token_a.split('.').collect();
    assert_eq!(parts.len(), 3, "{token_a}");
    assert_eq!(parts[0], "1");
    assert_eq!(parts[1], a["expires_at_ms"].to_string(), "{a}");
    assert_eq!(parts[2].len(), 86);
    assert_eq!(write(&c.proxy, job, &token_a), 200);

    // An attacker who can reach the destination tries to lock the job out for good.
    assert_eq!(write(&c.proxy, job, "18446744073709551615"), 403);
    let forged = format!("18446744073709551615.{}.{}", parts[1], parts[2]);
    assert_eq!(write(&c.proxy, job, &forged), 403);
    let later = format!("1.{}.{}", u64::MAX, parts[2]);
    assert_eq!(
        write(&c.proxy, job, &later),
        403,
        "the expiry is signed too"
    );
    assert_eq!(write(&c.proxy, "other-job", &token_a), 403, "so is the job");
    assert_eq!(
        write(&c.proxy, job, &token_a),
        200,
        "the legitimate holder keeps writing"
    );

    std::thread::sleep(std::time::Duration::from_millis(350)); // A's lease expires
    let b = claim(&c.server, job, "worker-b", "30s");
    let token_b = b["token"].as_str().unwrap().to_owned();
    assert!(token_b.starts_with("2."), "{token_b}");
    assert_eq!(write(&c.proxy, job, &token_b), 200);
    assert_eq!(
        write(&c.proxy, job, &token_a),
        409,
        "A's stale signed token is fenced out"
    );

    // fence run hands the signed string to its command, and never prints it.
    let out_file = dir.path().join("token");
    let script = format!("printf %s \"$FENCE_TOKEN\" > {}", out_file.display());
    let run = fence(&[
        "run",
        "--server",
        &c.server,
        "--job",
        "other-job",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{stderr}");
    let exported = std::fs::read_to_string(&out_file).unwrap();
    let sig = exported.rsplit('.').next().unwrap();
    assert!(exported.starts_with("1.") && sig.len() == 86, "{exported}");
    assert!(
        !stderr.contains(sig),
        "fence run printed the token: {stderr}"
    );
}

/// Issue 30's attack through the binaries: the lease server grants an hour (its default
/// --max-ttl is a day), the proxy forgets after 3 s and was told leases last 1 s at most. A
/// token claiming an hour of life would outlive the proxy's memory of the job, so it is
/// refused (403 token-too-long-lived) before it can write; a lease within the proxy's bound
/// writes.
#[test]
fn a_signed_token_that_outlives_the_proxys_window_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let c = keyed_cluster(
        dir.path(),
        &[
            "--max-lease-ttl",
            "1s",
            "--clock-skew",
            "1s",
            "--forget-after",
            "3s",
        ],
    );
    let short = claim(&c.server, "j", "a", "1s");
    let short = short["token"].as_str().unwrap().to_owned();
    assert_eq!(write(&c.proxy, "j", &short), 200);
    let released = fence_line(&format!(
        "revoke --server {} --job j --reason test",
        c.server
    ));
    assert_success(&released);
    let long = claim(&c.server, "j", "b", "1h");
    let long = long["token"].as_str().unwrap().to_owned();
    let refused = exchange(
        &c.proxy,
        "POST",
        "/ledger",
        &[
            ("X-Fencing-Job", "j".to_owned()),
            ("X-Fencing-Token", long.clone()),
        ],
        "",
    );
    assert_eq!(refused.0, 403, "{}", refused.1);
    assert!(
        refused.1.contains("urn:fence:token-too-long-lived"),
        "{}",
        refused.1
    );
    // (After forgetting the same holds: fence-sink's tests/forget.rs, on paused time.)
    let fresh = claim(&c.server, "k", "c", "1s");
    assert_eq!(write(&c.proxy, "k", fresh["token"].as_str().unwrap()), 200);
}

#[test]
fn keys_made_by_openssl_sign_and_verify_and_rotation_accepts_both() {
    let dir = tempfile::tempdir().unwrap();
    let (private, public) = openssl_pair(dir.path());
    keygen(&dir.path().join("old"));
    let old_public = dir.path().join("old/fence-verify.pem");
    let c = cluster(dir.path(), &private, &[&old_public, &public]);
    let lease = claim(&c.server, "nightly", "w", "30s");
    let token = lease["token"].as_str().unwrap();
    assert_eq!(write(&c.proxy, "nightly", token), 200);
    // A token signed by a key the proxy does not know is refused.
    let other = tempfile::tempdir().unwrap();
    let (stranger, _) = openssl_pair(other.path());
    let c2 = cluster(other.path(), &stranger, &[]);
    let foreign = claim(&c2.server, "nightly", "w", "30s");
    let foreign = foreign["token"].as_str().unwrap();
    assert_eq!(write(&c.proxy, "nightly", foreign), 403);
}

/// `fence keepalive --token-file` (issue 34): each renewal of a signed lease signs a new
/// token with a later expiry, and the file always holds the current one, readable by its
/// owner only. A script that reads the file before each write keeps writing after the
/// claim's own token has expired.
#[test]
fn keepalive_keeps_the_current_signed_token_in_its_token_file() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().unwrap();
    // Clocks here agree: a token is expired 200 ms after its lease ends (default: 5 s).
    let c = keyed_cluster(dir.path(), &["--clock-skew", "200ms"]);
    let job = "kept-signed";
    // 3 s leases: a keepalive started slowly on a loaded machine still renews in time.
    let claimed = claim(&c.server, job, "script", "3s");
    let first = claimed["token"].as_str().unwrap().to_owned();
    let lease = dir.path().join("lease.json");
    std::fs::write(&lease, claimed.to_string()).unwrap();
    let token_file = dir.path().join("token");
    let mut kept = Command::new(FENCE)
        .args(["keepalive", "--server", &c.server, "--ttl", "3s", "--lease"])
        .arg(&lease)
        .arg("--token-file")
        .arg(&token_file)
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = kept.stdin.take().unwrap();
    let current = || {
        std::fs::read_to_string(&token_file)
            .map(|t| t.trim_end().to_owned())
            .unwrap_or_default()
    };
    // Past the claim's expiry (and the 200 ms skew), renewed at least once more.
    std::thread::sleep(std::time::Duration::from_millis(3_500));
    eventually(
        "a renewal's token in the file",
        std::time::Duration::from_secs(5),
        || {
            let now = current();
            !now.is_empty() && now != first
        },
    );
    let mode = std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert_ne!(
        write(&c.proxy, job, &first),
        200,
        "the claim's own token has expired"
    );
    assert_eq!(
        write(&c.proxy, job, &current()),
        200,
        "the file's token writes"
    );
    input.write_all(b"done\n").unwrap();
    drop(input);
    let out = kept.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
