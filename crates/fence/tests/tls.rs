//! HTTPS everywhere a byte crosses the network: `fence server` and `fence proxy` listeners,
//! the one-shot commands, `fence run`, the lease client library, and `fence proxy` in front
//! of an `https://` upstream, with certificates the test makes.

mod common;

use std::{process::Command, time::Duration};

use common::*;

fn start_tls_server(ca: &TestCa, dir: &std::path::Path) -> (Proc, String) {
    let mut args: Vec<String> = server_args(dir.to_str().unwrap(), &[])
        .into_iter()
        .map(String::from)
        .collect();
    args.extend(ca.server_args());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (proc, addr) = start_ready(&args);
    (proc, format!("https://{addr}"))
}

#[test]
fn the_lease_server_speaks_https_to_every_client() {
    let ca = TestCa::new();
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_tls_server(&ca, dir.path());
    let ca_path = ca.ca.to_str().unwrap();

    let (status, body) = curl(&ca.ca, &[&format!("{url}/healthz")]);
    assert_eq!(status, 200, "{body}");

    let out = fence_line(&format!(
        "claim --server {} --ca-cert {} --job j1 --ttl 30s",
        url, ca_path
    ));
    assert_success(&out);
    let lease = json(&out);
    assert_eq!(lease["generation"], 1);

    // The system's roots do not know the test's CA: refused, saying why, exit 1.
    let out = fence(&["status", "--server", &url, "--job", "j1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("certificate"), "{stderr}");
    // Plain HTTP to the TLS port gets nowhere, and the server keeps serving.
    let out = fence(&[
        "status",
        "--server",
        &url.replace("https", "http"),
        "--job",
        "j1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let out = fence_line(&format!(
        "status --server {} --ca-cert {} --job j1",
        url, ca_path
    ));
    assert_eq!(json(&out)["state"], "held");

    // fence run renews over HTTPS and completes: a command running past the lease (3 s, so
    // that one renewal answered late on a loaded machine does not lose it).
    let out = fence_line(&format!(
        "run --server {} --ca-cert {} --job j2 --ttl 3s -- sleep 4.5",
        url, ca_path
    ));
    assert_success(&out);
    let out = fence_line(&format!(
        "status --server {} --ca-cert {} --job j2",
        url, ca_path
    ));
    assert_eq!(json(&out)["state"], "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_client_library_claims_and_renews_over_https() {
    use fence_lease::{HttpLeaseStore, HttpOptions, LeaseClient, Ttl};
    let ca = TestCa::new();
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_tls_server(&ca, dir.path());
    let store = HttpLeaseStore::with_options(
        &url,
        HttpOptions {
            ca_cert: Some(ca.ca.clone()),
            ..HttpOptions::default()
        },
    )
    .unwrap();
    let client = LeaseClient::new(store).ttl(Ttl::from_millis(3_000).unwrap());
    let lease = client.claim("lib-job".parse().unwrap()).await.unwrap();
    let view = lease.view();
    tokio::time::sleep(Duration::from_millis(7_500)).await; // two leases long: renewed
    assert!(
        !view.is_lost(),
        "the keeper renewed over HTTPS: {:?}",
        view.loss_reason()
    );
    lease.complete().await.unwrap();

    // Without the CA the client cannot be sure who answers: the claim fails.
    let bare = HttpLeaseStore::new(&url).unwrap();
    let e = LeaseClient::new(bare)
        .claim("lib-job-2".parse().unwrap())
        .await
        .unwrap_err();
    assert!(
        fence_storage::error_chain(&e).contains("certificate"),
        "{e:?}"
    );
}

#[test]
fn the_proxy_serves_https_and_forwards_to_an_https_upstream() {
    let ca = TestCa::new();
    let dir = tempfile::tempdir().unwrap();
    // The lease server is the HTTPS upstream: what it answers proves the request got there.
    let (_upstream, upstream) = start_tls_server(&ca, &dir.path().join("leases"));
    let mut extra: Vec<String> = vec![
        "--data-dir".into(),
        dir.path().join("proxy").display().to_string(),
        "--upstream-ca-cert".into(),
        ca.ca.display().to_string(),
    ];
    extra.extend(ca.server_args());
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let (_proxy, proxy) = start_proxy_with(&upstream, &extra);
    let proxy = format!("https://{proxy}");

    let (status, body) = curl(&ca.ca, &[&format!("{proxy}/v1/leases/never")]);
    assert_eq!(status, 404, "the upstream's own answer: {body}");
    assert!(body.contains("urn:fence:unknown-job"), "{body}");
    let claim = |token: &str| {
        curl(
            &ca.ca,
            &[
                "-X",
                "POST",
                "-H",
                "X-Fencing-Job: proxied",
                "-H",
                &format!("X-Fencing-Token: {token}"),
                "-H",
                "content-type: application/json",
                "--data",
                r#"{"owner":"w","lease_key":"k0123456789abcdefghijk"}"#,
                &format!("{proxy}/v1/leases/proxied/claim"),
            ],
        )
    };
    let (status, body) = claim("5");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"generation\":1"), "{body}");
    let (status, body) = claim("4");
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("urn:fence:stale-token"), "{body}");
}

#[test]
fn an_https_upstream_the_proxy_cannot_verify_is_a_502_that_says_why() {
    let ca = TestCa::new();
    let dir = tempfile::tempdir().unwrap();
    let (_upstream, upstream) = start_tls_server(&ca, &dir.path().join("leases"));
    let (_proxy, proxy) = start_proxy_with(
        &upstream,
        &["--data-dir", dir.path().join("proxy").to_str().unwrap()],
    );
    let (status, body) = curl(&ca.ca, &[&format!("http://{proxy}/v1/leases/never")]);
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("certificate"), "{body}");
}

/// An https:// upstream whose certificate names another host: the 502 says the
/// certificate was not accepted, never which names it was or was not for (rustls's own
/// error says both); those go to the proxy's log.
#[test]
fn a_certificate_for_another_name_is_a_502_that_names_no_host() {
    let ca = TestCa::for_names(&["billing.internal"]);
    let dir = tempfile::tempdir().unwrap();
    let (_upstream, upstream) = start_tls_server(&ca, &dir.path().join("leases"));
    let (_proxy, proxy) = start_proxy_with(
        &upstream,
        &[
            "--data-dir",
            dir.path().join("proxy").to_str().unwrap(),
            "--upstream-ca-cert",
            ca.ca.to_str().unwrap(),
        ],
    );
    let (status, body) = curl(&ca.ca, &[&format!("http://{proxy}/v1/leases/never")]);
    assert_eq!(status, 502, "{body}");
    let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("certificate was not accepted"), "{detail}");
    for name in ["billing.internal", "127.0.0.1", "localhost"] {
        assert!(!detail.contains(name), "names {name}: {detail}");
    }
}

#[test]
fn unusable_tls_files_stop_the_start_with_one_line_and_exit_2() {
    let ca = TestCa::new();
    let other = TestCa::new();
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not PEM\n").unwrap();
    let missing = dir.path().join("missing.pem");
    let data = dir.path().join("data");
    for (cert, key, want) in [
        (&missing, &ca.key, missing.display().to_string()),
        (&ca.cert, &missing, missing.display().to_string()),
        (&garbage, &ca.key, garbage.display().to_string()),
        (&ca.cert, &garbage, garbage.display().to_string()),
        // A key that is not the certificate's.
        (&ca.cert, &other.key, "does not match".to_owned()),
    ] {
        let out = Command::new(FENCE)
            .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(&data)
            .arg("--tls-cert")
            .arg(cert)
            .arg("--tls-key")
            .arg(key)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
        assert!(stderr.contains(&want), "{stderr} lacks {want:?}");
    }
    // One without the other is a usage error too.
    let out = Command::new(FENCE)
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .arg("--tls-cert")
        .arg(&ca.cert)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// TLS in one command (issue 34): `fence tls init` makes a CA and a server certificate that
/// the server serves and the client verifies by name; the usual mistakes each get a hint: a
/// self-signed certificate from `openssl req -x509` (marked CA:TRUE) as --ca-cert, http:// to
/// a TLS port, an unknown issuer, the certificate given as the key. Nothing is overwritten,
/// and the server's own host is always in its certificate.
#[test]
fn tls_init_makes_what_a_tls_server_needs_and_mistakes_get_hints() {
    let dir = tempfile::tempdir().unwrap();
    let tls = dir.path().join("tls");
    let made = fence(&[
        "tls",
        "init",
        tls.to_str().unwrap(),
        "--name",
        "leases.internal",
        "--client",
        "billing",
        "--client",
        "billing",
    ]);
    assert_success(&made);
    // An address as a DNS name would never match: refused, naming --ip; so is a URL.
    for (name, want) in [
        ("10.0.0.5", "give it with --ip 10.0.0.5"),
        ("https://leases.internal", "is not a DNS name"),
    ] {
        let out = fence(&[
            "tls",
            "init",
            dir.path().join("other").to_str().unwrap(),
            "--name",
            name,
        ]);
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {said}");
        assert!(said.contains(want), "{name}: {said}");
        assert!(
            !dir.path().join("other").exists(),
            "{name}: files were written"
        );
    }
    let file = |name: &str| tls.join(name).to_str().unwrap().to_owned();
    for (name, mode) in [
        ("ca.pem", 0o644),
        ("ca-key.pem", 0o600),
        ("server.pem", 0o644),
        ("server-key.pem", 0o600),
        ("client-billing.pem", 0o644),
        ("client-billing-key.pem", 0o600),
    ] {
        let meta = std::fs::metadata(tls.join(name)).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
            mode,
            "{name}"
        );
    }
    let again = fence(&["tls", "init", tls.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(2), "never overwrites");
    // A key others may read is served, with a warning that says how to fix it.
    {
        use std::os::unix::fs::PermissionsExt;
        let open_key = dir.path().join("open-key.pem");
        std::fs::copy(tls.join("server-key.pem"), &open_key).unwrap();
        std::fs::set_permissions(&open_key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let data = dir.path().join("data-open-key");
        let (_server, _addr, log) = start_logged(
            &server_args(
                data.to_str().unwrap(),
                &[
                    "--tls-cert",
                    &file("server.pem"),
                    "--tls-key",
                    open_key.to_str().unwrap(),
                ],
            ),
            "info",
        );
        let said = log.wait_for("chmod 600");
        assert!(said.contains("--tls-key"), "{said}");
    }
    let data = dir.path().join("data");
    let (_server, addr) = start_ready(&server_args(
        data.to_str().unwrap(),
        &[
            "--tls-cert",
            &file("server.pem"),
            "--tls-key",
            &file("server-key.pem"),
        ],
    ));
    let port = addr.rsplit(':').next().unwrap().to_owned();
    // Only leases.internal was named: the server's own host is in the certificate anyway.
    for host in ["localhost", "127.0.0.1"] {
        let url = format!("https://{host}:{port}");
        let out = fence(&[
            "claim",
            "--server",
            &url,
            "--ca-cert",
            &file("ca.pem"),
            "--job",
            host,
        ]);
        assert_success(&out);
    }
    // curl, as an operator would check it.
    let (status, _) = curl(
        &tls.join("ca.pem"),
        &[&format!("https://localhost:{port}/healthz")],
    );
    assert_eq!(status, 200);

    let hint_of = |args: &[&str]| {
        let out = fence(args);
        assert_ne!(out.status.code(), Some(0), "{args:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let https = format!("https://127.0.0.1:{port}");
    let said = hint_of(&[
        "status",
        "--server",
        &format!("http://127.0.0.1:{port}"),
        "--job",
        "j",
    ]);
    assert!(
        said.contains("hint: the server answered in TLS: use https://"),
        "{said}"
    );
    let said = hint_of(&["status", "--server", &https, "--job", "j"]);
    assert!(
        said.contains("hint: the server's certificate is not signed by a CA"),
        "{said}"
    );
    // The server certificate of a self-signed openssl recipe, given as its own CA.
    let selfsigned = dir.path().join("self.pem");
    let openssl = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args(["-nodes", "-days", "30", "-subj", "/CN=localhost"])
        .args(["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"])
        .arg("-keyout")
        .arg(dir.path().join("self-key.pem"))
        .arg("-out")
        .arg(&selfsigned)
        .output()
        .expect("openssl is installed (apt-get install openssl)");
    assert!(openssl.status.success(), "{openssl:?}");
    let data = dir.path().join("data2");
    let (_self_server, self_addr) = start_ready(&server_args(
        data.to_str().unwrap(),
        &[
            "--tls-cert",
            selfsigned.to_str().unwrap(),
            "--tls-key",
            dir.path().join("self-key.pem").to_str().unwrap(),
        ],
    ));
    let said = hint_of(&[
        "status",
        "--server",
        &format!("https://{self_addr}"),
        "--ca-cert",
        selfsigned.to_str().unwrap(),
        "--job",
        "j",
    ]);
    assert!(
        said.contains("hint: the server's certificate is marked as a CA"),
        "{said}"
    );
    assert!(said.contains("fence tls init DIR"), "{said}");
    // The certificate given as the key.
    let out = fence(&[
        "server",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        dir.path().join("data3").to_str().unwrap(),
        "--tls-cert",
        &file("server.pem"),
        "--tls-key",
        &file("server.pem"),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("it holds a certificate, not a private key"),
        "{said}"
    );
}

/// Two CAs from `fence tls init` can sit in one bundle during a rotation: each has a name of
/// its own and the certificates they sign say which key signed them, so OpenSSL-based
/// clients (curl, Python, Node, psql), which pick an issuer by name, verify both. And the
/// directory it makes is nobody else's to write in, whatever the umask.
#[test]
fn two_tls_init_cas_share_a_bundle_and_the_directory_is_not_writable_by_others() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    for d in [&one, &two] {
        let made = Command::new("sh")
            .args(["-c", r#"umask 000 && exec "$0" tls init "$1""#, FENCE])
            .arg(d)
            .output()
            .unwrap();
        assert_success(&made);
        let mode = std::fs::metadata(d).unwrap().permissions().mode();
        assert_eq!(mode & 0o022, 0, "{}: mode {mode:o}", d.display());
    }
    // A directory that was there, which others may write in, is refused before anything is
    // written there.
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let refused = fence(&["tls", "init", open.to_str().unwrap()]);
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("chmod go-w"), "{said}");
    assert_eq!(
        std::fs::read_dir(&open).unwrap().count(),
        0,
        "written anyway"
    );
    let bundle = dir.path().join("bundle.pem");
    let mut both = std::fs::read(one.join("ca.pem")).unwrap();
    both.extend(std::fs::read(two.join("ca.pem")).unwrap());
    std::fs::write(&bundle, both).unwrap();
    for d in [&one, &two] {
        let verified = Command::new("openssl")
            .args(["verify", "-CAfile"])
            .arg(&bundle)
            .arg(d.join("server.pem"))
            .output()
            .unwrap();
        assert!(
            verified.status.success(),
            "{}: {}{}",
            d.display(),
            String::from_utf8_lossy(&verified.stdout),
            String::from_utf8_lossy(&verified.stderr)
        );
    }
}

/// `fence tls init DIR --ca-cert --ca-key` signs a new server certificate with a CA that
/// exists (a renewal, a new name) instead of making a new CA: clients keep the ca.pem they
/// have. A key that is not the certificate's stops it before anything is written.
#[test]
fn tls_init_with_an_existing_ca_renews_without_a_new_ca() {
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name);
    let arg = |name: &str| path(name).to_str().unwrap().to_owned();
    assert_success(&fence(&["tls", "init", &arg("first")]));
    assert_success(&fence(&["tls", "init", &arg("other")]));
    let renewed = fence(&[
        "tls",
        "init",
        &arg("renewed"),
        "--name",
        "leases.example",
        "--ca-cert",
        &arg("first/ca.pem"),
        "--ca-key",
        &arg("first/ca-key.pem"),
    ]);
    assert_success(&renewed);
    assert!(String::from_utf8_lossy(&renewed.stdout).contains("signed by the CA of --ca-cert"));
    assert_eq!(
        std::fs::read(path("renewed/ca.pem")).unwrap(),
        std::fs::read(path("first/ca.pem")).unwrap()
    );
    assert!(!path("renewed/ca-key.pem").exists());
    let verified = Command::new("openssl")
        .args([
            "verify",
            "-CAfile",
            &arg("first/ca.pem"),
            &arg("renewed/server.pem"),
        ])
        .output()
        .unwrap();
    assert!(
        verified.status.success(),
        "{}",
        String::from_utf8_lossy(&verified.stderr)
    );
    let names = Command::new("openssl")
        .args([
            "x509",
            "-noout",
            "-ext",
            "subjectAltName",
            "-in",
            &arg("renewed/server.pem"),
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&names.stdout).contains("leases.example"));

    // Another CA's key with this CA's certificate: refused, nothing written.
    let mismatched = fence(&[
        "tls",
        "init",
        &arg("mismatched"),
        "--ca-cert",
        &arg("first/ca.pem"),
        "--ca-key",
        &arg("other/ca-key.pem"),
    ]);
    assert_eq!(mismatched.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&mismatched.stderr).contains("does not verify"),
        "{}",
        String::from_utf8_lossy(&mismatched.stderr)
    );
    assert!(
        !path("mismatched").exists(),
        "nothing is written, not even DIR"
    );
    // A server's certificate is no CA; a CA ending before --days would (tls init's CAs run
    // 3650 days from yesterday); an unreadable key: each refused by what it is, exit 2.
    for (args, said) in [
        (
            vec![
                "--ca-cert",
                "first/server.pem",
                "--ca-key",
                "first/server-key.pem",
            ],
            "not a CA certificate",
        ),
        (
            vec![
                "--ca-cert",
                "first/ca.pem",
                "--ca-key",
                "first/ca-key.pem",
                "--days",
                "3650",
            ],
            "the CA ends in",
        ),
        (
            vec!["--ca-cert", "first/ca.pem", "--ca-key", "first/missing.pem"],
            "cannot read it",
        ),
    ] {
        let mut line = vec!["tls".to_owned(), "init".into(), arg("refused")];
        for a in args {
            line.push(if a.starts_with("--") {
                a.to_owned()
            } else if a.contains('/') {
                arg(a)
            } else {
                a.to_owned()
            });
        }
        let line: Vec<&str> = line.iter().map(String::as_str).collect();
        let out = fence(&line);
        assert_eq!(out.status.code(), Some(2), "{line:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(said), "{line:?}: {stderr}");
        assert!(!path("refused").exists(), "{line:?}");
    }
    // One without the other is a usage error.
    let half = fence(&[
        "tls",
        "init",
        &arg("half"),
        "--ca-cert",
        &arg("first/ca.pem"),
    ]);
    assert_eq!(half.status.code(), Some(2));
}

/// A CA that has ended, or has not begun, signs nothing: OpenSSL-based clients would refuse
/// every certificate it signed. Refused with exit 2 and why, nothing written.
#[test]
fn tls_init_refuses_a_ca_outside_its_validity() {
    let dir = tempfile::tempdir().unwrap();
    for (name, from, to) in [("ended", 2000, 2001), ("unbegun", 2100, 2110)] {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.not_before = rcgen::date_time_ymd(from, 1, 1);
        params.not_after = rcgen::date_time_ymd(to, 1, 1);
        let cert = params.self_signed(&key).unwrap();
        let cert_path = dir.path().join(format!("{name}.pem"));
        let key_path = dir.path().join(format!("{name}-key.pem"));
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        let out_dir = dir.path().join(format!("{name}-out"));
        let out = fence(&[
            "tls",
            "init",
            out_dir.to_str().unwrap(),
            "--ca-cert",
            cert_path.to_str().unwrap(),
            "--ca-key",
            key_path.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {stderr}");
        assert!(stderr.contains("not valid today"), "{name}: {stderr}");
        assert!(!out_dir.exists(), "{name}: nothing is written");
    }
}

/// An https server that takes connections but never answers the TLS handshake (a stopped
/// process; here a listener nobody accepts from, the kernel completing the TCP handshake):
/// the next server is asked after the attempt's share of the call's timeout (at most 2 s).
/// The share used to cover only the TCP connect, so every call waited out its whole 10 s
/// timeout on the first server and failed, never asking the healthy second one.
#[test]
fn a_server_that_never_answers_the_tls_handshake_is_passed_over() {
    let ca = TestCa::new();
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_tls_server(&ca, dir.path());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let stopped = format!("https://{}", listener.local_addr().unwrap());
    let started = std::time::Instant::now();
    let out = fence(&[
        "claim",
        "--server",
        &format!("{stopped},{url}"),
        "--ca-cert",
        ca.ca.to_str().unwrap(),
        "--job",
        "handshake",
    ]);
    let took = started.elapsed();
    drop(listener);
    assert_success(&out);
    assert!(
        took < Duration::from_secs(8),
        "the healthy server was asked only after {took:?} (the call's timeout is 10 s)"
    );
}

/// A self-signed certificate for localhost, its dates set by `dates`, and its key, written
/// into `dir` as `NAME.pem` and `NAME-key.pem`.
fn dated_certificate(
    dir: &std::path::Path,
    name: &str,
    dates: impl FnOnce(&mut rcgen::CertificateParams),
) -> (std::path::PathBuf, std::path::PathBuf) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    dates(&mut params);
    let cert = params.self_signed(&key).unwrap();
    let (cert_path, key_path) = (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}-key.pem")),
    );
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    (cert_path, key_path)
}

/// A listener certificate that has ended (or not begun) fails every handshake, so every
/// client's lease at once: the server and the proxy refuse it at start, exit 2 with one line
/// naming the file and the date; one ending within 30 days starts with a warning.
#[test]
fn a_listener_certificate_outside_its_dates_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    for (name, from, to, want, date) in [
        ("ended", 2000, 2001, "expired (notAfter", "2001"),
        ("unbegun", 2100, 2110, "not valid yet (notBefore", "2100"),
    ] {
        let (cert, key) = dated_certificate(dir.path(), name, |p| {
            p.not_before = rcgen::date_time_ymd(from, 1, 1);
            p.not_after = rcgen::date_time_ymd(to, 1, 1);
        });
        let tls = [
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--data-dir",
            data.to_str().unwrap(),
        ];
        let server = server_args(data.to_str().unwrap(), &tls[..4]);
        let proxy = proxy_args("http://127.0.0.1:9", &tls);
        for args in [server, proxy] {
            // A listener that starts anyway is stopped, and fails the test, rather than hang it.
            let out = Command::new("timeout")
                .arg("20")
                .arg(FENCE)
                .args(&args)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{name} {args:?}: {stderr}");
            assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
            for part in [want, &cert.display().to_string(), date] {
                assert!(stderr.contains(part), "{name}: {stderr} lacks {part:?}");
            }
        }
    }
    let (cert, key) = dated_certificate(dir.path(), "ending", |p| {
        let now = rcgen::date_time_ymd(1970, 1, 1)
            + std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
        let day = Duration::from_secs(86_400);
        p.not_before = now - day;
        p.not_after = now + 10 * day;
    });
    let (_server, _addr, log) = start_logged(
        &server_args(
            data.to_str().unwrap(),
            &[
                "--tls-cert",
                cert.to_str().unwrap(),
                "--tls-key",
                key.to_str().unwrap(),
            ],
        ),
        "info",
    );
    let said = log.wait_for("fewer than 30 days");
    assert!(
        said.contains("days_left=9") || said.contains("days_left=10"),
        "{said}"
    );
}

/// SIGHUP re-reads --tls-cert and --tls-key: a renewed certificate (here: of another CA) is
/// what the next handshake sees, without a restart; a pair that does not load (garbage, a key
/// that does not fit) keeps the one already loaded, with a warning saying why.
#[test]
fn sighup_reloads_the_listener_certificate_and_a_bad_one_keeps_the_old() {
    let (one, two) = (TestCa::new(), TestCa::new());
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("tls.pem"), dir.path().join("tls-key.pem"));
    std::fs::copy(&one.cert, &cert).unwrap();
    std::fs::copy(&one.key, &key).unwrap();
    let data = dir.path().join("data");
    let (server, addr, log) = start_logged(
        &server_args(
            data.to_str().unwrap(),
            &[
                "--tls-cert",
                cert.to_str().unwrap(),
                "--tls-key",
                key.to_str().unwrap(),
            ],
        ),
        "info",
    );
    let healthz = format!("https://{addr}/healthz");
    assert_eq!(curl(&one.ca, &[&healthz]).0, 200);
    std::fs::copy(&two.cert, &cert).unwrap();
    std::fs::copy(&two.key, &key).unwrap();
    assert_eq!(
        curl(&one.ca, &[&healthz]).0,
        200,
        "nothing changes before SIGHUP"
    );
    signal(&server, "-HUP");
    log.wait_for("TLS certificate reloaded");
    assert_eq!(
        curl(&two.ca, &[&healthz]).0,
        200,
        "the new certificate is served"
    );
    assert_ne!(curl(&one.ca, &[&healthz]).0, 200, "the old one is not");
    assert!(!log.text().contains("nothing to reload"), "{}", log.text());

    std::fs::write(&cert, "not PEM\n").unwrap();
    signal(&server, "-HUP");
    let said = log.wait_for("TLS certificate not reloaded");
    assert!(said.contains(cert.to_str().unwrap()), "{said}");
    assert_eq!(
        curl(&two.ca, &[&healthz]).0,
        200,
        "garbage keeps the old pair"
    );
    std::fs::copy(&one.cert, &cert).unwrap();
    signal(&server, "-HUP");
    let said = log.wait_for_nth("TLS certificate not reloaded", 2);
    assert!(said.contains("does not match"), "{said}");
    assert_eq!(
        curl(&two.ca, &[&healthz]).0,
        200,
        "a key that does not fit neither"
    );
}

/// Two clients whose files collide (`a`'s key is `a-key`'s certificate) are refused before
/// anything is written: the second write used to fail with half of DIR written, which every
/// rerun then refused. A dangling link named like an output is "already there" too.
#[test]
fn tls_init_refuses_colliding_clients_and_dangling_links_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("d");
    let out = fence(&[
        "tls",
        "init",
        out_dir.to_str().unwrap(),
        "--client",
        "a",
        "--client",
        "a-key",
    ]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("client-a-key.pem would be written twice"),
        "{said}"
    );
    let left = std::fs::read_dir(&out_dir).map_or(0, Iterator::count);
    assert_eq!(left, 0, "files were written");
    let linked = dir.path().join("linked");
    std::fs::create_dir(&linked).unwrap();
    std::os::unix::fs::symlink(dir.path().join("nowhere"), linked.join("server.pem")).unwrap();
    let out = fence(&["tls", "init", linked.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(said.contains("server.pem is already there"), "{said}");
    assert_eq!(
        std::fs::read_dir(&linked).unwrap().count(),
        1,
        "files were written"
    );
}

/// A directory that is there and owned by another user (not root): its owner could replace
/// ca.pem or server.pem, or chmod it; refused with exit 2, nothing written. (As root, the
/// test's directory is made another user's with chown.)
#[test]
fn tls_init_refuses_a_directory_of_another_user() {
    let dir = tempfile::tempdir().unwrap();
    let theirs = dir.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    let me = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m));
    let other = if me.ok() == Some(65_534) {
        65_533
    } else {
        65_534
    };
    if std::os::unix::fs::chown(&theirs, Some(other), None).is_err() {
        eprintln!("skipped: cannot chown (not root)");
        return;
    }
    let out = fence(&["tls", "init", theirs.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(said.contains(&format!("owned by uid {other}")), "{said}");
    assert_eq!(
        std::fs::read_dir(&theirs).unwrap().count(),
        0,
        "written anyway"
    );
}
