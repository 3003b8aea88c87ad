//! Fenced semaphores through `fence server` and `fence proxy` (contract section 15): at
//! most N slots granted, N fixed while held, a stale slot holder's write refused (409) at the
//! proxy once its slot is granted again, and `fence run --slots`.

mod common;

use std::time::Duration;

use common::*;

/// A semaphore claim of `resource` with `slots` slots by `owner` with a 3 s lease (the claims
/// that follow the first must find it held, on a loaded machine too): (status, the answer as
/// sent, its body as JSON).
fn claim_slot(
    addr: &str,
    resource: &str,
    owner: &str,
    slots: u32,
) -> (u16, String, serde_json::Value) {
    let body = format!(
        r#"{{"owner":"{owner}","lease_key":"{owner}-0123456789abcdefghijk","ttl_ms":3000,"slots":{slots}}}"#
    );
    let path = format!("/v1/semaphores/{resource}/claim");
    let (status, answer) = bearer_call(addr, "POST", &path, None, &body);
    let json = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    (
        status,
        answer.clone(),
        serde_json::from_str(json).unwrap_or_default(),
    )
}

fn body_of(answer: &str) -> serde_json::Value {
    serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap_or_default()).unwrap_or_default()
}

#[test]
fn a_stale_slot_holder_is_refused_at_the_proxy_once_its_slot_is_granted_again() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("server").display().to_string();
    let (_server, addr) = start_ready(&server_args(&data, &[]));
    let upstream = start_upstream();
    let (_proxy, proxy) = start_proxy(&dir.path().join("proxy"), &upstream);

    let (status, _, a) = claim_slot(&addr, "exports", "a", 2);
    assert_eq!(status, 200, "{a}");
    assert_eq!(
        (
            &a["job"],
            &a["resource"],
            &a["slot"],
            &a["slots"],
            &a["generation"]
        ),
        (
            &"exports#1".into(),
            &"exports".into(),
            &1.into(),
            &2.into(),
            &1.into()
        ),
        "{a}"
    );
    let (status, _, b) = claim_slot(&addr, "exports", "b", 2);
    assert_eq!((status, &b["job"]), (200, &"exports#2".into()), "{b}");
    // Full: the refusal names the slot that frees first.
    let (status, _, full) = claim_slot(&addr, "exports", "c", 2);
    assert_eq!(status, 409, "{full}");
    assert_eq!(full["type"], "urn:fence:lease-held", "{full}");
    assert!(
        full["job"].as_str().unwrap().starts_with("exports#"),
        "{full}"
    );
    assert!(
        full["detail"]
            .as_str()
            .unwrap()
            .contains("every slot of exports (2) is taken"),
        "{full}"
    );
    // Another number of slots while slots are held: refused with the one in force.
    let (status, _, size) = claim_slot(&addr, "exports", "d", 3);
    assert_eq!(status, 409, "{size}");
    assert_eq!(
        (&size["type"], &size["slots"]),
        (&"urn:fence:semaphore-size".into(), &2.into()),
        "{size}"
    );

    // a writes under slot 1, stalls past its lease; c gets slot 1 at generation 2.
    assert_eq!(fenced_post(&proxy, "/charge", "exports#1", "1"), 200);
    std::thread::sleep(Duration::from_millis(3_200));
    let (status, _, c) = claim_slot(&addr, "exports", "c", 2);
    assert_eq!(status, 200, "{c}");
    assert_eq!(
        (&c["job"], &c["generation"]),
        (&"exports#1".into(), &2.into()),
        "{c}"
    );
    assert_eq!(fenced_post(&proxy, "/charge", "exports#1", "2"), 200);
    // a wakes up and writes with its stale token: refused at the proxy.
    assert_eq!(fenced_post(&proxy, "/charge", "exports#1", "1"), 409);

    // A slot is not a plain job: its plain claim is a 400 that says why.
    let plain = r#"{"owner":"e","lease_key":"e-0123456789abcdefghijk"}"#;
    let (status, answer) = bearer_call(&addr, "POST", "/v1/leases/exports%231/claim", None, plain);
    assert_eq!(status, 400, "{answer}");
    assert!(
        body_of(&answer)["detail"]
            .as_str()
            .unwrap()
            .contains("semaphore"),
        "{answer}"
    );
    // Completing a slot releases it: a completed slot would be lost to the semaphore.
    let finish = r#"{"owner":"c","generation":2,"lease_key":"c-0123456789abcdefghijk"}"#;
    let (status, answer) = bearer_call(
        &addr,
        "POST",
        "/v1/leases/exports%231/complete",
        None,
        finish,
    );
    assert_eq!(
        (status, &body_of(&answer)["state"]),
        (200, &"free".into()),
        "{answer}"
    );
    // The listing shows the slots.
    let (status, answer) = bearer_call(&addr, "GET", "/v1/leases?prefix=exports%23", None, "");
    assert_eq!(status, 200, "{answer}");
    let jobs: Vec<String> = body_of(&answer)["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["job"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(jobs, ["exports#1", "exports#2"]);
    // Refused inputs.
    for (path, body, want) in [
        (
            "/v1/semaphores/a%23b/claim",
            r#"{"owner":"f","lease_key":"f-0123456789abcdefghijk","slots":1}"#,
            "'#'",
        ),
        (
            "/v1/semaphores/x/claim",
            r#"{"owner":"f","lease_key":"f-0123456789abcdefghijk","slots":0}"#,
            "slots",
        ),
        (
            "/v1/semaphores/x/claim",
            r#"{"owner":"f","lease_key":"f-0123456789abcdefghijk"}"#,
            "slots",
        ),
        (
            "/v1/semaphores/x/claim?wait=1s",
            r#"{"owner":"f","lease_key":"f-0123456789abcdefghijk","slots":1}"#,
            "no parameters",
        ),
    ] {
        let (status, answer) = bearer_call(&addr, "POST", path, None, body);
        assert_eq!(status, 400, "{path} {body}: {answer}");
        assert!(
            body_of(&answer)["detail"].as_str().unwrap().contains(want),
            "{answer}"
        );
    }
}

#[test]
fn fence_run_takes_a_slot_and_releases_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().display().to_string();
    let (_server, addr) = start_ready(&server_args(&data, &[]));
    let url = format!("http://{addr}");
    let out = fence(&[
        "run",
        "--server",
        &url,
        "--job",
        "exp",
        "--slots",
        "2",
        "--",
        "sh",
        "-c",
        r#"printf '%s %s' "$FENCE_JOB" "$FENCE_RESOURCE""#,
    ]);
    assert_success(&out);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "exp#1 exp");
    // Released, not completed: the slot is free for the next run.
    let (status, answer) = bearer_call(&addr, "GET", "/v1/leases/exp%231", None, "");
    assert_eq!(
        (status, &body_of(&answer)["state"]),
        (200, &"free".into()),
        "{answer}"
    );
    // Asking to complete a slot is refused before anything is claimed or run.
    let ran = dir.path().join("ran");
    let out = fence(&[
        "run",
        "--server",
        &url,
        "--job",
        "exp",
        "--slots",
        "2",
        "--on-success",
        "complete",
        "--",
        "touch",
        &ran.display().to_string(),
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--on-success complete (or FENCE_ON_SUCCESS=complete) cannot be used"),
        "{stderr}"
    );
    assert!(!ran.exists(), "the command ran");
    let (_, answer) = bearer_call(&addr, "GET", "/v1/leases/exp%231", None, "");
    assert_eq!(body_of(&answer)["generation"], 1, "{answer}");

    // Both slots taken: not obtained (exit 3), saying why; another N: the N in force.
    let (s1, _, _) = claim_slot(&addr, "exp", "x", 2);
    let (s2, _, _) = claim_slot(&addr, "exp", "y", 2);
    assert_eq!((s1, s2), (200, 200));
    let out = fence(&[
        "run", "--server", &url, "--job", "exp", "--slots", "2", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("every slot of semaphore exp (2 slots) is taken"),
        "{stderr}"
    );
    let out = fence(&[
        "run", "--server", &url, "--job", "exp", "--slots", "3", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("has 2 slots while any is in force"),
        "{stderr}"
    );
    // With --wait, it runs once a slot frees (the 3 s leases expire).
    let out = fence(&[
        "run",
        "--server",
        &url,
        "--job",
        "exp",
        "--slots",
        "2",
        "--wait",
        "15s",
        "--",
        "sh",
        "-c",
        r#"printf '%s' "$FENCE_JOB""#,
    ]);
    assert_success(&out);
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("exp#"),
        "{out:?}"
    );
    let out = fence(&[
        "run", "--server", &url, "--job", "exp", "--slots", "1001", "--", "true",
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}
