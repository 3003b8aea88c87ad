//! The Dockerfile and the systemd units name flags, paths and variables that must exist: a
//! renamed flag would otherwise only show when an operator's service fails to start. The
//! units pass `systemd-analyze verify` and run together as shipped; nothing is built with
//! Docker here (no daemon), so every `--flag` the Dockerfile passes is checked against
//! `fence --help`.

mod common;

use std::{collections::BTreeSet, path::PathBuf, process::Command};

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

/// `--help` names every endpoint each listener serves (it once listed four of the server's
/// eleven, and neither the proxy's /readyz nor its /v1/fence/{job}), and says the demo
/// logs errors only.
#[test]
fn help_names_every_endpoint() {
    let help = |args: &[&str]| {
        let out = fence(args);
        assert_success(&out);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let server = help(&["server", "--help"]);
    for path in [
        "/v1/leases/{job}/claim|renew|release|complete|checkpoint|revoke",
        "/v1/semaphores/{resource}/claim",
        "GET /v1/leases/{job}",
        "GET /v1/leases",
        "/healthz",
        "/readyz",
        "/metrics",
        "/openapi.json",
    ] {
        assert!(server.contains(path), "fence server --help lacks {path}");
    }
    let proxy = help(&["proxy", "--help"]);
    for path in [
        "/metrics",
        "/healthz",
        "/readyz",
        "GET/POST /v1/fence/{job}",
    ] {
        assert!(proxy.contains(path), "fence proxy --help lacks {path}");
    }
    let demo = help(&["demo", "--help"]);
    assert!(demo.contains("Logs errors only"), "{demo}");
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
    let exec_form = |prefix: &str| -> Vec<String> {
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix}"));
        serde_json::from_str(line).unwrap_or_else(|e| panic!("{prefix} in exec form: {e}"))
    };
    assert_eq!(
        exec_form("ENTRYPOINT "),
        ["/usr/local/bin/fence-entrypoint"]
    );
    assert_eq!(exec_form("CMD "), ["server"]);
    assert!(text.contains("COPY contrib/docker/entrypoint.sh /usr/local/bin/fence-entrypoint"));
    assert!(text.contains(r#"CMD ["/usr/local/bin/fence-entrypoint", "healthcheck"]"#));
    // EXPOSEd ports are the ones the roles listen on beyond loopback; the admin port is not.
    let exposed = text
        .lines()
        .find_map(|l| l.strip_prefix("EXPOSE "))
        .unwrap();
    assert_eq!(
        exposed.split_whitespace().collect::<Vec<_>>(),
        ["7700", "7800"]
    );
    let ignore = repo(".dockerignore");
    for kept_out in ["target/", ".git/"] {
        assert!(
            ignore.lines().any(|l| l == kept_out),
            ".dockerignore lacks {kept_out}"
        );
    }
}

/// The image's entrypoint, run here as the image would run it (no Docker daemon on this
/// machine: the image itself is not built): each role starts with its defaults from the
/// mounted files, its health check passes, an operator's FENCE_* setting wins, and any other
/// command goes to fence as it is.
#[test]
fn the_image_entrypoint_starts_each_role_from_mounted_files() {
    let dir = tempfile::tempdir().unwrap();
    let (etc, state) = (dir.path().join("etc"), dir.path().join("state"));
    std::fs::create_dir_all(&state).unwrap();
    assert_success(&fence(&["keygen", "--out", etc.to_str().unwrap()]));
    assert_success(&fence(&[
        "tls",
        "init",
        etc.join("tls").to_str().unwrap(),
        "--name",
        "localhost",
    ]));
    std::fs::write(etc.join("clients"), "ops ops-0123456789abcdefghij *\n").unwrap();
    std::fs::set_permissions(
        etc.join("clients"),
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600),
    )
    .unwrap();
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../contrib/docker/entrypoint.sh");
    let entry = |args: &[&str]| {
        let mut c = Command::new("sh");
        c.arg(&script)
            .args(args)
            .env("FENCE_ETC", &etc)
            .env("FENCE_STATE", &state)
            .env("FENCE_BIN", FENCE)
            .env("RUST_LOG", "info");
        c
    };
    let health = || entry(&["healthcheck"]).output().unwrap();
    // The health check of the container whose state is in `state` passes.
    let assert_healthy = |state: &std::path::Path| {
        let out = entry(&["healthcheck"])
            .env("FENCE_STATE", state)
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    assert_eq!(health().status.code(), Some(1), "nothing started yet");

    // The server: the port given (beyond loopback it would be 0.0.0.0:7700), TLS, the auth
    // file and the signing key from the mounted files.
    let port = free_port();
    let mut server = entry(&["server"]);
    // The health check's CA from a path with a space in it.
    let spaced = dir.path().join("ca copy");
    std::fs::create_dir_all(&spaced).unwrap();
    std::fs::copy(etc.join("tls/ca.pem"), spaced.join("ca.pem")).unwrap();
    server
        .env("FENCE_LISTEN", format!("127.0.0.1:{port}"))
        .env("FENCE_HEALTH_CA_CERT", spaced.join("ca.pem"));
    let (_server, _, log) = start_command(server);
    let ready = log.wait_for("fence server ready");
    assert!(
        ready.contains("scheme=\"https\"") || ready.contains("scheme=https"),
        "{ready}"
    );
    assert!(
        ready.contains("signing=\"on\"") || ready.contains("signing=on"),
        "{ready}"
    );
    assert!(
        ready.contains("auth=\"on\"") || ready.contains("auth=on"),
        "{ready}"
    );
    let out = health();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A server whose port is given on the command line (FENCE_LISTEN says another): the
    // health check asks that one. An empty FENCE_TLS_CERT runs it without TLS (behind a
    // sidecar that ends TLS), and the health check asks over plain HTTP.
    let state4 = dir.path().join("state4");
    std::fs::create_dir_all(&state4).unwrap();
    let listen = format!("127.0.0.1:{}", free_port());
    let mut plain = entry(&["server", "--listen", &listen]);
    plain
        .env("FENCE_STATE", &state4)
        .env("FENCE_LISTEN", format!("127.0.0.1:{}", free_port()))
        .env("FENCE_TLS_CERT", "")
        .env("FENCE_TLS_KEY", "");
    let (_plain, _, log) = start_command(plain);
    let ready = log.wait_for("fence server ready");
    assert!(
        ready.contains("scheme=\"http\"") || ready.contains("scheme=http"),
        "{ready}"
    );
    assert_healthy(&state4);

    // The proxy, in a container of its own: its admin port on loopback, the verify key.
    let state2 = dir.path().join("state2");
    std::fs::create_dir_all(&state2).unwrap();
    let (proxy_port, admin_port) = (free_port(), free_port());
    let upstream = format!("http://{}", start_upstream());
    let mut proxy = entry(&["proxy"]);
    proxy
        .env("FENCE_STATE", &state2)
        .env("FENCE_LISTEN", format!("127.0.0.1:{proxy_port}"))
        .env("FENCE_ADMIN_LISTEN", format!("127.0.0.1:{admin_port}"))
        .env("FENCE_UPSTREAM", &upstream);
    let (_proxy, proxy_addr, log) = start_command(proxy);
    // Its first line says what is in force.
    let ready = log.wait_for("fence proxy ready");
    for said in [
        "signatures=\"required\"",
        "scheme=\"http\"",
        "idempotency=\"on\"",
    ] {
        let bare = said.replace('"', "");
        assert!(
            ready.contains(said) || ready.contains(&bare),
            "{said}: {ready}"
        );
    }
    assert_healthy(&state2);
    assert_eq!(
        fenced_post(&proxy_addr, "/w", "j", "5"),
        403,
        "the mounted verify key is in force: an unsigned token is refused"
    );

    // A proxy with TLS and an admin auth file: its admin port speaks TLS and wants a secret,
    // and the health check sends the mounted one over TLS. Without a secret to send, the
    // container does not start (it would only ever be unhealthy).
    let state3 = dir.path().join("state3");
    std::fs::create_dir_all(&state3).unwrap();
    let admin_auth = etc.join("admin-clients");
    std::fs::write(&admin_auth, "probe probe-0123456789abcdefghij *\n").unwrap();
    std::fs::set_permissions(
        &admin_auth,
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600),
    )
    .unwrap();
    let (proxy_port, admin_port) = (free_port(), free_port());
    let secured = || {
        let mut proxy = entry(&["proxy"]);
        proxy
            .env("FENCE_STATE", &state3)
            .env("FENCE_LISTEN", format!("127.0.0.1:{proxy_port}"))
            .env("FENCE_ADMIN_LISTEN", format!("127.0.0.1:{admin_port}"))
            .env("FENCE_UPSTREAM", &upstream)
            .env("FENCE_TLS_CERT", etc.join("tls/server.pem"))
            .env("FENCE_TLS_KEY", etc.join("tls/server-key.pem"))
            .env("FENCE_ADMIN_AUTH_FILE", &admin_auth);
        proxy
    };
    let mut refusing = secured()
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut ended = None;
    while ended.is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
        ended = refusing.try_wait().unwrap();
    }
    if ended.is_none() {
        let _ = refusing.kill();
    }
    let refused = refusing.wait_with_output().unwrap();
    assert_eq!(ended.and_then(|s| s.code()), Some(2));
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("health.secret"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    std::fs::write(etc.join("health.secret"), "probe-0123456789abcdefghij\n").unwrap();
    let (_secured, _, _log) = start_command(secured());
    assert_healthy(&state3);
    // The secret is what lets it through: the same check without one is refused.
    let out = Command::new(FENCE)
        .args([
            "healthcheck",
            "--url",
            &format!("https://localhost:{admin_port}"),
        ])
        .arg("--ca-cert")
        .arg(etc.join("tls/ca.pem"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("401"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Anything else is fence's own.
    let out = entry(&["idempotency-key", "--job", "j", "--step", "s"])
        .output()
        .unwrap();
    assert_success(&out);
}

#[test]
fn both_licenses_named_by_the_manifests_are_there() {
    assert!(repo("Cargo.toml").contains(r#"license = "MIT OR Apache-2.0""#));
    assert!(repo("LICENSE-MIT").contains("Permission is hereby granted"));
    assert!(repo("LICENSE-APACHE").contains("Apache License"));
}

/// The README's fenced code blocks of one language, each with the `## ` section it is in.
fn readme_blocks(lang: &str) -> Vec<(String, String)> {
    let text = repo("README.md");
    let mut blocks = Vec::new();
    let (mut section, mut current) = (String::new(), None::<String>);
    for line in text.lines() {
        match &mut current {
            None if line.starts_with("## ") => section = line[3..].to_owned(),
            None if line.trim_start().starts_with("```") => {
                let tag = line.trim_start().trim_start_matches('`');
                if tag.split(',').next() == Some(lang) {
                    current = Some(String::new());
                } else if !tag.is_empty() {
                    current = Some("\u{0}skip".to_owned());
                }
            }
            Some(block) if line.trim_start().starts_with("```") => {
                if !block.starts_with('\u{0}') {
                    blocks.push((section.clone(), std::mem::take(block)));
                }
                current = None;
            }
            Some(block) => {
                block.push_str(line);
                block.push('\n');
            }
            None => {}
        }
    }
    blocks
}

/// A shell block's commands: `\` continuations and multi-line quotes joined, comments and
/// blank lines dropped.
fn commands(block: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut command = String::new();
    for line in block.lines() {
        if command.is_empty() && (line.trim().is_empty() || line.trim_start().starts_with('#')) {
            continue;
        }
        command.push_str(line);
        command.push('\n');
        let open_quote = command.matches('\'').count() % 2 == 1;
        if !open_quote && !line.ends_with('\\') {
            out.push(command.trim_end().to_owned());
            command.clear();
        }
    }
    out
}

/// A free port on 127.0.0.1 (free when asked; the tests that use it start soon after).
///
/// Picked below the kernel's ephemeral range (32768 and up here): a port asked of the kernel
/// (`:0`) and given back can be handed at once to any other test binding `:0`, and the
/// README's server then fails to bind while `wait_port` finds the other process listening.
/// Never one whose digits hold a port the README names: the README's ports are replaced one
/// after another, and 27800 put in for 7710 became 2 and the proxy's port when 7800 was
/// replaced next (CI saw `--listen 127.0.0.1:230020`).
fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let seed = std::process::id().wrapping_mul(7_919)
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
    for _ in 0..12_000 {
        let n = seed.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed).wrapping_mul(97));
        let port = 20_000 + u16::try_from(n % 12_000).unwrap_or(0);
        let named = [
            "7443", "7700", "7710", "7800", "7801", "7810", "7811", "8080",
        ];
        if named.iter().any(|p| port.to_string().contains(p)) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port on 127.0.0.1 from 20000 to 31999");
}

/// Every `rust` block of the README is, line for line, part of an example that `cargo test`
/// builds: a renamed type or method breaks the build, not the reader.
#[test]
fn the_readme_rust_blocks_are_taken_from_examples_that_build() {
    let examples: Vec<(String, String)> =
        std::fs::read_dir(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
            .map(|p| {
                let text = std::fs::read_to_string(&p).unwrap();
                (p.display().to_string(), text)
            })
            .collect();
    let blocks = readme_blocks("rust");
    assert!(blocks.len() >= 2, "{blocks:?}");
    for (section, block) in blocks {
        let wanted: Vec<&str> = block
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        let found = examples.iter().find(|(_, text)| {
            let lines: BTreeSet<&str> = text.lines().map(str::trim).collect();
            wanted.iter().all(|l| lines.contains(l))
        });
        assert!(
            found.is_some(),
            "README ({section}): this block is not part of any example:\n{block}"
        );
    }
}

/// Every command of the README's shell blocks, run in a sandbox: the tour in one shell as a
/// reader would (its servers in the background), every other runnable block in a shell of its
/// own. Paths under /etc and /var/lib move to a temporary directory, the ports to free ones,
/// `leases.internal` to localhost with a test CA's certificate. A block that names a host the
/// sandbox cannot have (PostgreSQL on `db`) or elides flags with `...` has each of its fence
/// commands' flags checked against `--help` instead; `cargo` lines must be the ones `.ci/run`
/// and the harness's soak instructions stand behind.
#[test]
fn every_command_of_the_readme_runs() {
    let ca = TestCa::new();
    let sandbox = tempfile::tempdir().unwrap();
    let root = sandbox.path();
    for dir in ["etc/fence/tls", "var/lib/fence", "home", "work"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
    }
    for (from, to) in [
        (&ca.cert, "cert.pem"),
        (&ca.key, "key.pem"),
        (&ca.ca, "ca.pem"),
    ] {
        let target = root.join("etc/fence/tls").join(to);
        std::fs::copy(from, &target).unwrap();
        std::fs::set_permissions(
            &target,
            <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600),
        )
        .unwrap();
    }
    let [server, proxy, admin, upstream, tls] = [(); 5].map(|()| free_port());
    let [signed, signed_proxy, signed_admin] = [(); 3].map(|()| free_port());
    let moved = |text: &str| {
        text.replace("0.0.0.0:7443", &format!("127.0.0.1:{tls}"))
            .replace("localhost:7443", &format!("localhost:{tls}"))
            .replace("0.0.0.0:7700", &format!("127.0.0.1:{tls}"))
            .replace("leases.internal:7700", &format!("localhost:{tls}"))
            .replace("/etc/fence", &format!("{}/etc/fence", root.display()))
            .replace(
                "/var/lib/fence",
                &format!("{}/var/lib/fence", root.display()),
            )
            .replace("7710", &signed.to_string())
            .replace("7810", &signed_proxy.to_string())
            .replace("7811", &signed_admin.to_string())
            .replace("7700", &server.to_string())
            .replace("7801", &admin.to_string())
            .replace("7800", &proxy.to_string())
            .replace("8080", &upstream.to_string())
    };
    let allowed_cargo = [
        "cargo run --release -p fence -- demo",
        "cargo test --workspace",
        // The soak needs the test hooks, which only the workspace's test build turns on.
        "FENCE_SOAK_SECS=3600 FENCE_SOAK_SEED=42 cargo test -p fence --features test-hooks --test fault_injection -- --nocapture --exact fenced_run_has_no_violations",
    ];
    let ci = repo(".ci/run");
    assert!(
        ci.lines().any(|l| l.trim() == "cargo test --workspace"),
        "{ci}"
    );

    // Scripts to run: the tour as one, every other runnable block alone.
    let mut scripts: Vec<(String, Vec<String>)> = Vec::new();
    let mut checked = 0;
    for (section, block) in readme_blocks("sh") {
        let commands: Vec<String> = commands(&block)
            .into_iter()
            .map(|c| c.split("   #").next().unwrap().trim_end().to_owned())
            .collect();
        let (cargo, rest): (Vec<String>, Vec<String>) =
            commands.into_iter().partition(|c| c.contains("cargo "));
        for c in &cargo {
            let c = c.split('#').next().unwrap().trim();
            assert!(
                allowed_cargo.contains(&c),
                "README ({section}): unchecked {c:?}"
            );
        }
        if rest.is_empty() {
            continue;
        }
        if block.contains("...") || block.contains("@db/") {
            for c in rest.iter().filter(|c| c.starts_with("fence ")) {
                let words: Vec<&str> = c.split_whitespace().filter(|w| *w != "\\").collect();
                check_command(&format!("README ({section})"), &words);
                checked += 1;
            }
            continue;
        }
        match scripts.last_mut() {
            Some((s, commands)) if *s == section && section == "A 5-minute tour" => {
                commands.extend(rest);
            }
            _ => scripts.push((section, rest)),
        }
    }
    assert!(checked >= 4, "flag-checked only {checked} commands");
    assert!(scripts.len() >= 2, "{scripts:?}");

    let path = format!(
        "{}:{}",
        PathBuf::from(FENCE).parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut outputs = Vec::new();
    for (section, commands) in &scripts {
        let mut script = String::from(
            "set -eu\n\
             trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null' EXIT\n\
             wait_port() { for _ in $(seq 150); do (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.1; done; echo \"nothing listens on port $1\" >&2; return 1; }\n",
        );
        for (n, command) in commands.iter().enumerate() {
            let command = moved(command);
            let background = if command.starts_with("fence server") {
                let env = if command.contains("--listen") {
                    String::new()
                } else {
                    format!("FENCE_LISTEN=127.0.0.1:{server} ")
                };
                let port = listen_port(&command).unwrap_or(server);
                Some((format!("{env}{command}"), port))
            } else if command.starts_with("fence proxy") {
                let mut env = String::new();
                if !command.contains("--listen") {
                    env.push_str(&format!("FENCE_LISTEN=127.0.0.1:{proxy} "));
                }
                if !command.contains("--admin-listen") {
                    env.push_str(&format!("FENCE_ADMIN_LISTEN=127.0.0.1:{admin} "));
                }
                let port = listen_port(&command).unwrap_or(proxy);
                Some((format!("{env}{command}"), port))
            } else if command.starts_with("python3 -c") {
                Some((command.clone(), upstream))
            } else {
                None
            };
            match background {
                Some((command, port)) => script.push_str(&format!(
                    "{command} > bg-{n}.log 2>&1 &\nwait_port {port}\n"
                )),
                None => script.push_str(&format!("{command}\n")),
            }
        }
        // What the upstream received, for the checks below.
        script.push_str("cat bg-*.log >&2\n");
        // The tour runs as a reader runs it: not as root (as root, as `nobody`), in an empty
        // directory of its own, so nothing in it may need root's files or privileges.
        let tour = section == "A 5-minute tour";
        let work = root.join(if tour { "tour" } else { "work" });
        let mut bash = if tour && running_as_root() {
            std::fs::create_dir_all(&work).unwrap();
            let nobody = |which: &str| -> u32 {
                let out = Command::new("id").args([which, "nobody"]).output().unwrap();
                String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
            };
            for dir in [root.to_path_buf(), work.clone(), root.join("home")] {
                if dir != root {
                    std::os::unix::fs::chown(&dir, Some(nobody("-u")), Some(nobody("-g"))).unwrap();
                }
                let mode = if dir == root { 0o755 } else { 0o700 };
                std::fs::set_permissions(
                    &dir,
                    <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(mode),
                )
                .unwrap();
            }
            script.insert_str(0, &format!("export HOME={}\n", root.join("home").display()));
            let mut c = Command::new("runuser");
            c.args(["-u", "nobody", "--", "bash"]);
            c
        } else {
            std::fs::create_dir_all(&work).unwrap();
            Command::new("bash")
        };
        let out = bash
            .arg("-c")
            .arg(&script)
            .current_dir(&work)
            .env("PATH", &path)
            .env("HOME", root.join("home"))
            .env("RUST_LOG", "warn")
            .env_remove("FENCE_SERVER")
            .output()
            .unwrap();
        if tour {
            let left: Vec<_> = std::fs::read_dir(&work).unwrap().flatten().collect();
            assert!(!left.is_empty(), "the tour ran in {}", work.display());
        }
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "README ({section}) failed ({:?}):\n{script}\n---\n{text}",
            out.status
        );
        outputs.push(text);
    }
    let tour = &outputs[0];
    for expected in [
        "urn:fence:stale-token",
        r#"{"job":"invoice-42","highest":8,"in_flight":0}"#,
        // The revoke pushed to the sink, and the old holder's write refused after it.
        "job refund-9 is fenced at generation 2",
        "job refund-9: token 1 is below generation 2",
        "the job is completed",
        r#"/reports b'{"rows": 1234}"#,
        "\"generation\":1",
    ] {
        assert!(
            tour.contains(expected),
            "the tour lacks {expected:?}:\n{tour}"
        );
    }
}

fn running_as_root() -> bool {
    std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap()) == 0
}

fn listen_port(command: &str) -> Option<u16> {
    let rest = command.split("--listen ").nth(1)?;
    rest.split_whitespace()
        .next()?
        .rsplit(':')
        .next()?
        .parse()
        .ok()
}

/// The systemd units as shipped (issue 34): `systemd-analyze verify` accepts both, with the
/// binary where ExecStart expects it (under a root of the test's own), without a word; and
/// their ExecStart lines, run with the files their comments tell an operator to make (one
/// `fence keygen`, one `fence tls init`, the auth file), agree: the server signs, the proxy
/// verifies, and a holder's write goes through while a stale one is refused.
#[test]
fn the_systemd_units_verify_and_work_together_as_shipped() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    for dir in [
        "usr/local/bin",
        "usr/lib/systemd",
        "bin",
        "etc/systemd/system",
        "etc/fence",
        "var/lib",
    ] {
        std::fs::create_dir_all(r.join(dir)).unwrap();
    }
    std::fs::copy(FENCE, r.join("usr/local/bin/fence")).unwrap();
    std::fs::copy("/bin/kill", r.join("bin/kill")).unwrap();
    let copied = Command::new("cp")
        .args(["-r", "/usr/lib/systemd/system"])
        .arg(r.join("usr/lib/systemd/"))
        .status()
        .unwrap();
    assert!(
        copied.success(),
        "systemd's own units are needed (apt-get install systemd)"
    );
    let units = ["fence-server.service", "fence-proxy.service"];
    for unit in units {
        std::fs::write(
            r.join("etc/systemd/system").join(unit),
            repo(&format!("contrib/systemd/{unit}")),
        )
        .unwrap();
    }
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(format!("--root={}", r.display()))
        .args(units.map(|u| format!("/etc/systemd/system/{u}")))
        .output()
        .expect("systemd-analyze is installed (apt-get install systemd)");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {said}"
    );

    // What the comments say to make, under the test's root.
    let etc = r.join("etc/fence");
    assert_success(&fence(&["keygen", "--out", etc.to_str().unwrap()]));
    assert_success(&fence(&[
        "tls",
        "init",
        etc.join("tls").to_str().unwrap(),
        "--name",
        "localhost",
    ]));
    let secret = "billing-0123456789abcdef0123";
    std::fs::write(etc.join("clients"), format!("billing {secret} inv-*\n")).unwrap();
    std::fs::set_permissions(
        etc.join("clients"),
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o600),
    )
    .unwrap();
    let [server_port, proxy_port, admin_port] = [(); 3].map(|()| free_port());
    let exec = |unit: &str| -> Vec<String> {
        let text = repo(&format!("contrib/systemd/{unit}"));
        // A credential, if the unit loads one (the proxy's public key), read where it is.
        let credential = text
            .lines()
            .find_map(|l| l.strip_prefix("LoadCredential="))
            .and_then(|c| c.split_once(':'))
            .map(|(name, from)| (format!("%d/{name}"), from.to_owned()));
        let exec = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart=/usr/local/bin/fence "))
            .unwrap();
        let exec = match &credential {
            Some((name, from)) => exec.replace(name, from),
            None => exec.to_owned(),
        };
        exec.replace("/etc/fence", etc.to_str().unwrap())
            .replace("%S", r.join("var/lib").to_str().unwrap())
            .replace("0.0.0.0:7700", &format!("127.0.0.1:{server_port}"))
            .replace("127.0.0.1:7800", &format!("127.0.0.1:{proxy_port}"))
            .replace("127.0.0.1:7801", &format!("127.0.0.1:{admin_port}"))
            .split_whitespace()
            .map(String::from)
            .collect()
    };
    let server_args = exec("fence-server.service");
    let args: Vec<&str> = server_args.iter().map(String::as_str).collect();
    let (_server, _) = start_ready(&args);
    let upstream = format!("http://{}", start_upstream());
    let proxy_args = exec("fence-proxy.service");
    let mut proxy = Command::new(FENCE);
    proxy.args(&proxy_args).env("FENCE_UPSTREAM", &upstream);
    let (_proxy, proxy_addr, _log) = start_command(proxy);

    let secret_file = r.join("billing.secret");
    std::fs::write(&secret_file, secret).unwrap();
    let server = format!("https://localhost:{server_port}");
    let claim = |owner: &str| {
        let out = fence(&[
            "claim",
            "--server",
            &server,
            "--ca-cert",
            etc.join("tls/ca.pem").to_str().unwrap(),
            "--auth-token-file",
            secret_file.to_str().unwrap(),
            "--job",
            "inv-1",
            "--owner",
            owner,
            "--ttl",
            "1s",
        ]);
        assert_success(&out);
        json(&out)["token"]
            .as_str()
            .expect("a signed token")
            .to_owned()
    };
    let old = claim("a");
    assert_eq!(fenced_post(&proxy_addr, "/w", "inv-1", &old), 200);
    std::thread::sleep(std::time::Duration::from_millis(1_100));
    let new = claim("b");
    assert_eq!(fenced_post(&proxy_addr, "/w", "inv-1", &new), 200);
    assert_eq!(
        fenced_post(&proxy_addr, "/w", "inv-1", &old),
        409,
        "the stale holder"
    );
    assert_eq!(
        fenced_post(&proxy_addr, "/w", "inv-1", "99"),
        403,
        "an unsigned token"
    );
}
