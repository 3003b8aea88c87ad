//! The one-shot lease calls of the command line: claim, renew, release, complete, status, leases, revoke.

use anyhow::Context as _;
use fence_core::{
    JobId,
    lease_api::{
        Action, ClaimRequest, FinishRequest, ListBody, ListQuery, RecordBody, RenewRequest,
        RevokeRequest,
    },
    sink_api::{AdvanceRequest, FenceView, fence_path},
};
use fence_lease::{BearerToken, HttpLeaseStore, HttpOptions, StoreError};
use http::StatusCode;

mod lease_ref;
pub use lease_ref::LeaseRef;

use crate::cli::{
    ClaimCmd, FinishCmd, HealthcheckCmd, LeasesCmd, RenewCmd, RevokeCmd, ServerConn, ServerUrl,
};

/// What a one-shot call sends.
#[derive(Debug)]
pub enum Call {
    /// `fence claim`.
    Claim(ClaimCmd),
    /// `fence renew`.
    Renew(RenewCmd),
    /// `fence release`.
    Release(FinishCmd),
    /// `fence complete`.
    Complete(FinishCmd),
    /// `fence status`.
    Status(ServerUrl),
}

/// The bearer secret of `--auth-token-file`, or of `FENCE_AUTH_TOKEN`.
///
/// # Errors
/// When the file cannot be read, or the secret is not a valid bearer token.
pub fn bearer(file: Option<&std::path::Path>) -> anyhow::Result<Option<BearerToken>> {
    secret(file, "--auth-token-file", "FENCE_AUTH_TOKEN")
}

/// The bearer secret in `file` (given as `flag`), or else in the environment variable `var`.
fn secret(
    file: Option<&std::path::Path>,
    flag: &str,
    var: &str,
) -> anyhow::Result<Option<BearerToken>> {
    match file {
        Some(file) => {
            let token = read_secret(file, flag)?;
            // Only of a secret that is one: an unusable file's error stands alone.
            warn_if_others_may_read(file, flag);
            Ok(token)
        }
        None => match std::env::var(var) {
            Ok(token) => Ok(Some(
                BearerToken::new(token).with_context(|| format!("the bearer secret in {var}"))?,
            )),
            Err(_) => Ok(None),
        },
    }
}

/// The bearer secret in `file` (given as `flag`).
fn read_secret(file: &std::path::Path, flag: &str) -> anyhow::Result<Option<BearerToken>> {
    let token = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read {flag} {}", file.display()))?;
    Ok(Some(BearerToken::new(token).with_context(|| {
        format!("the bearer secret in {flag} {}", file.display())
    })?))
}

/// Says on stderr when group or others may read the secret in `file` (given as `flag`). Not
/// refused: a platform may mount it (a Kubernetes secret is 0644 by default).
fn warn_if_others_may_read(file: &std::path::Path, flag: &str) {
    if let Some(mode) = crate::open_to_others(file) {
        say!(
            "fence: warning: {flag} {}: group or others may read this secret (mode {mode:o}): chmod 600 it",
            file.display(),
        );
    }
}

/// The HTTP lease store a command talks to.
///
/// # Errors
/// When the URL, the CA file or the bearer secret cannot be used.
pub fn connect(conn: &ServerConn) -> anyhow::Result<HttpLeaseStore> {
    // Every failure here is in what the user gave (a URL, a CA file, a secret file): usage.
    let options = HttpOptions {
        ca_cert: conn.ca_cert.clone(),
        bearer: bearer(conn.auth_token_file.as_deref()).map_err(crate::Usage::from_error)?,
        ..HttpOptions::default()
    };
    HttpLeaseStore::with_options(&conn.server, options).map_err(crate::Usage::from_error)
}

/// The exit code of an answer: 0 on success, 3 on a held or lost lease or a completed job,
/// 2 on a refused request (400, 401, 403), 1 otherwise.
fn exit_code(status: StatusCode) -> i32 {
    match status.as_u16() {
        200 => 0,
        409 | 410 => 3,
        400 | 401 | 403 => 2,
        _ => 1,
    }
}

/// Writes `line` and a newline to stdout: false when the reader closed the pipe early
/// (`| head -1`), no error: it had what it wanted. Any other failure (a full disk) is
/// returned. (`println!` would panic on either.)
///
/// # Errors
/// When stdout cannot be written, but for a closed pipe.
pub fn stdout_line(line: &str) -> std::io::Result<bool> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}").and_then(|()| out.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e),
    }
}

/// Prints the server's answer as it came on stdout and, when it refused, the problem's
/// detail as one line on stderr for the person at the terminal. An error when stdout cannot
/// be written.
fn print_answer(status: StatusCode, answer: &str) -> std::io::Result<bool> {
    let printed = stdout_line(answer);
    if status != StatusCode::OK {
        let problem: Option<serde_json::Value> = serde_json::from_str(answer).ok();
        let detail = problem
            .as_ref()
            .and_then(|p| p.get("detail")?.as_str())
            .unwrap_or("(no problem detail in the answer)");
        say!("fence: the server answered {status}: {detail}");
    }
    printed
}

/// Makes the call, prints the server's answer as it came (a claim's with its lease key),
/// and returns the exit code.
///
/// # Errors
/// When the server URL is invalid or the server cannot be reached.
pub async fn call(call: Call) -> anyhow::Result<i32> {
    let (mut key, mut claim_owner) = (None, None);
    type At<'a> = (&'a ServerConn, JobId);
    let (at, action, body): (At<'_>, Option<Action>, Option<serde_json::Value>) = match &call {
        Call::Claim(a) => {
            let owner = a.owner.clone().unwrap_or_else(fence_lease::default_owner);
            claim_owner = Some(owner.clone());
            let lease_key = fence_lease::new_lease_key()
                .map_err(|e| anyhow::anyhow!("the OS's random source failed: {e}"))?;
            key = Some(lease_key.clone());
            let body = ClaimRequest {
                owner,
                lease_key,
                ttl: a.ttl,
                lock_delay: a.lock_delay,
            };
            (
                (&a.at.conn, a.at.job.clone()),
                Some(Action::Claim),
                Some(serde_json::to_value(body)?),
            )
        }
        Call::Renew(a) => {
            let lease = LeaseRef::of(&a.lease)?;
            let body = RenewRequest {
                owner: lease.owner,
                generation: lease.generation,
                lease_key: lease.key,
                ttl: a.ttl,
            };
            (
                (&a.lease.conn, lease.job),
                Some(Action::Renew),
                Some(serde_json::to_value(body)?),
            )
        }
        Call::Release(a) | Call::Complete(a) => {
            let action = if matches!(call, Call::Complete(_)) {
                Action::Complete
            } else {
                Action::Release
            };
            let lease = LeaseRef::of(a)?;
            let body = FinishRequest {
                owner: lease.owner,
                generation: lease.generation,
                lease_key: lease.key,
            };
            (
                (&a.conn, lease.job),
                Some(action),
                Some(serde_json::to_value(body)?),
            )
        }
        Call::Status(at) => ((&at.conn, at.job.clone()), None, None),
    };
    let (conn, job) = at;
    let server = connect(conn)?;
    let (status, answer) = match server.call(&job, action, body.as_ref()).await {
        Ok(answered) => answered,
        Err(e) => {
            if let Some(owner) = &claim_owner
                && outcome_unknown(&e)
            {
                say!("fence: {}", server_failure(&e));
                unknown_claim(&job, owner, server.base_url());
                return Ok(1);
            }
            return answered_or_unreachable(e, server.base_url());
        }
    };
    let granted = key.is_some() && status == StatusCode::OK;
    let printed = match (key, status) {
        // The lease key is shown here and nowhere else, so a script can pass it on.
        (Some(key), StatusCode::OK) => {
            let mut lease: serde_json::Map<String, serde_json::Value> =
                serde_json::from_slice(&answer).context("the server's answer is not JSON")?;
            lease.insert("lease_key".into(), key.expose().into());
            serde_json::to_string(&lease)?
        }
        _ => String::from_utf8_lossy(&answer).trim_end().to_owned(),
    };
    let printed = print_answer(status, &printed).and_then(|written| {
        // A reader gone before a granted claim's answer took its lease key with it.
        if written || !granted {
            Ok(())
        } else {
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
    });
    if let Err(e) = printed {
        if granted {
            // Granted, but the lease key (shown nowhere else) did not reach the caller.
            say!(
                "fence: the claim was granted, but its answer could not be written to stdout ({e}): \
                 its lease key is lost with this command; the lease ends at its TTL"
            );
        } else {
            say!("fence: the answer could not be written to stdout: {e}");
        }
        return Ok(1);
    }
    Ok(exit_code(status))
}

/// After a claim of unknown outcome: the lease key existed only in this process and is not
/// printed unless granted, so the server's advice (retry with the same key) cannot be
/// followed here; says what can.
fn unknown_claim(job: &JobId, owner: &fence_core::Owner, server: &str) {
    say!(
        "fence: whether the claim was granted is unknown, and its lease key is gone with this \
         command; `fence status --server {server} --job {job}` shows whether owner {owner} holds \
         it (such a lease ends at its TTL), or claim again once the store is back"
    );
}

/// Whether a call that failed so may have reached the server and taken effect: a 502, 503 or
/// 504 answer, no answer in time, or an exchange cut after the connection was made.
fn outcome_unknown(e: &StoreError) -> bool {
    match e {
        StoreError::Unavailable { .. } | StoreError::Timeout(_) => true,
        StoreError::Io(source) => !is_connect(source.as_ref()),
        _ => false,
    }
}

/// Whether `source` is a failure to connect (nothing was sent).
fn is_connect(source: &(dyn std::error::Error + 'static)) -> bool {
    source
        .downcast_ref::<hyper_util::client::legacy::Error>()
        .is_some_and(hyper_util::client::legacy::Error::is_connect)
}

/// A lease server's failure in the server's words, for a call of unknown outcome.
fn server_failure(e: &StoreError) -> String {
    match e {
        StoreError::Unavailable { status, detail, .. } => {
            format!("the server answered {status}: {detail}")
        }
        StoreError::Io(source) => format!(
            "the exchange with the server failed after it was sent: {}",
            fence_storage::error_chain(source.as_ref())
        ),
        other => other.to_string(),
    }
}

/// The exit of a call that failed with `e`: a 502, 503 or 504 is the server's (or a
/// gateway's) answer, told in its words with exit 1; anything else, an unreachable server.
fn answered_or_unreachable(e: StoreError, server: &str) -> anyhow::Result<i32> {
    if let StoreError::Unavailable { status, detail, .. } = &e {
        say!("fence: the server answered {status}: {detail}");
        return Ok(1);
    }
    Err(anyhow::Error::new(e).context(format!("cannot reach {server}")))
}

/// `fence leases`: every page, one record a line.
///
/// # Errors
/// When the server cannot be reached or answers something else than a page.
pub async fn leases(a: LeasesCmd) -> anyhow::Result<i32> {
    let server = connect(&a.conn)?;
    let state = match a.state.as_deref() {
        Some(s) => Some(
            serde_json::from_value(serde_json::Value::String(s.to_owned()))
                .with_context(|| format!("--state {s}"))?,
        ),
        None => None,
    };
    let mut query = ListQuery {
        state,
        prefix: a.prefix,
        after: None,
        limit: Some(fence_core::lease_api::MAX_LIST_LIMIT),
    };
    loop {
        let path = format!("/v1/leases?{}", query.to_query());
        let (status, answer) = match server.send(&path, None::<&()>).await {
            Ok(answered) => answered,
            Err(e) => return answered_or_unreachable(e, server.base_url()),
        };
        if status != StatusCode::OK {
            print_answer(status, String::from_utf8_lossy(&answer).trim_end())
                .context("cannot write the answer to stdout")?;
            return Ok(exit_code(status));
        }
        let page: ListBody =
            serde_json::from_slice(&answer).context("the server's answer is not a page")?;
        for lease in &page.leases {
            let written = stdout_line(&serde_json::to_string(lease)?)
                .context("cannot write the leases to stdout")?;
            if !written {
                return Ok(0); // its reader had what it wanted
            }
        }
        match page.next {
            Some(next) => query.after = Some(next),
            None => return Ok(0),
        }
    }
}

/// `fence revoke`: revokes the lease, prints the record, then pushes the signed token of the
/// new generation to each `--sink`, saying on stderr what each answered.
///
/// # Errors
/// When a URL is unusable or the server cannot be reached.
pub async fn revoke(a: RevokeCmd) -> anyhow::Result<i32> {
    // Every sink URL, and the sinks' secret, is checked before anything is revoked.
    let options = HttpOptions {
        ca_cert: a.sink_ca_cert.clone().or_else(|| a.at.conn.ca_cert.clone()),
        bearer: secret(
            a.sink_auth_token_file.as_deref(),
            "--sink-auth-token-file",
            "FENCE_SINK_AUTH_TOKEN",
        )
        .map_err(crate::Usage::from_error)?,
        ..HttpOptions::default()
    };
    let sinks = a
        .sink
        .iter()
        .map(|url| {
            // The error names the URL (without a user or password): not repeated here.
            HttpLeaseStore::with_options(url, options.clone())
                .context("--sink")
                .map_err(crate::Usage::from_error)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let server = connect(&a.at.conn)?;
    let body = RevokeRequest { reason: a.reason };
    let (status, answer) = match server
        .call(&a.at.job, Some(Action::Revoke), Some(&body))
        .await
    {
        Ok(answered) => answered,
        Err(e) if outcome_unknown(&e) => {
            // Retrying is safe: a second revoke only fences one generation higher.
            say!(
                "fence: {}; whether the revoke took effect is unknown: run it again",
                server_failure(&e)
            );
            return Ok(1);
        }
        Err(e) => return answered_or_unreachable(e, server.base_url()),
    };
    // The revoke took effect whatever stdout does: its pushes to the sinks still go.
    if let Err(e) = print_answer(status, String::from_utf8_lossy(&answer).trim_end()) {
        say!("fence: the answer could not be written to stdout: {e}");
    }
    if status != StatusCode::OK || sinks.is_empty() {
        return Ok(exit_code(status));
    }
    let record: RecordBody =
        serde_json::from_slice(&answer).context("the server's answer is not a lease record")?;
    let Some(token) = record.token else {
        say!(
            "fence: the server signs no tokens (no --signing-key), so there is nothing a sink would trust to push; the lease is revoked, and the sinks refuse the old holder once the next holder writes"
        );
        return Ok(1);
    };
    // All at once: a revoked free job's token ends at the revoke (section 11), so a sink
    // reached only after others timed out could refuse it as expired.
    let push = std::sync::Arc::new(AdvanceRequest { token });
    let mut pushes = tokio::task::JoinSet::new();
    for (n, sink) in sinks.into_iter().enumerate() {
        let (path, push) = (fence_path(&a.at.job), push.clone());
        pushes.spawn(async move {
            let sent = sink.send(&path, Some(&*push)).await;
            (n, sink.base_url().to_owned(), sent)
        });
    }
    let mut answers = pushes.join_all().await;
    answers.sort_by_key(|(n, _, _)| *n);
    let job = &a.at.job;
    let mut code = 0;
    for (_, url, sent) in answers {
        match sent {
            Ok((StatusCode::OK, bytes)) => match serde_json::from_slice::<FenceView>(&bytes) {
                Ok(view) => say!(
                    "fence: {url}: job {job} is fenced at generation {}",
                    view.highest
                ),
                Err(e) => {
                    say!("fence: {url}: answered 200 but not a fence view: {e}");
                    code = 1;
                }
            },
            Ok((status, bytes)) => {
                let problem: Option<fence_core::Problem> = serde_json::from_slice(&bytes).ok();
                let detail = problem.map_or_else(
                    || String::from_utf8_lossy(&bytes).into_owned(),
                    |p| p.detail,
                );
                say!("fence: {url}: the push was refused, {status}: {detail}");
                code = 1;
            }
            Err(e) => {
                say!("fence: {url}: the push failed: {}", sink_failure(&e));
                code = 1;
            }
        }
    }
    Ok(code)
}

/// Why a push to a sink failed, in a sink's words: the HTTP client is the lease client,
/// whose errors speak of "the lease store" and "the lease server".
fn sink_failure(e: &StoreError) -> String {
    match e {
        StoreError::Timeout(limit) => {
            format!("the sink did not answer within {limit:?} (it may have taken the push)")
        }
        StoreError::Io(source) => {
            let chain = fence_storage::error_chain(source.as_ref());
            if is_connect(source.as_ref()) {
                format!("the sink could not be reached: {chain}")
            } else {
                format!("the exchange with the sink failed (it may have taken the push): {chain}")
            }
        }
        // A 502, 503 or 504: the sink (or a gateway in front of it) answered, and could not
        // decide, or not in time.
        StoreError::Unavailable { status, detail, .. } => {
            format!("the sink answered {status}: {detail}")
        }
        other => fence_storage::error_chain(other),
    }
}

/// `fence healthcheck`: 0 when `GET {url}/healthz` answers 200, else 1 with what it answered.
///
/// # Errors
/// A usage error for an unusable URL or CA file.
pub async fn healthcheck(a: HealthcheckCmd) -> anyhow::Result<i32> {
    let bearer = match a.auth_token_file.as_deref() {
        Some(file) => {
            // Not warned of here: a platform's 0644 secret would say so at every probe.
            read_secret(file, "--auth-token-file").map_err(crate::Usage::from_error)?
        }
        None => None,
    };
    let options = HttpOptions {
        ca_cert: a.ca_cert.clone(),
        bearer,
        timeout: a.timeout,
    };
    let target = HttpLeaseStore::with_options(&a.url, options).map_err(crate::Usage::from_error)?;
    match target.send("/healthz", None::<&()>).await {
        Ok((StatusCode::OK, _)) => Ok(0),
        Ok((status, body)) => {
            say!(
                "fence healthcheck: {}/healthz answered {status}: {}",
                target.base_url(),
                String::from_utf8_lossy(&body).trim_end()
            );
            Ok(1)
        }
        Err(e) => {
            // The URL may be a proxy's admin listener: "lease store I/O failed" would
            // mislead, so a transport failure is told by its cause alone.
            let why = match &e {
                StoreError::Io(cause) => fence_storage::error_chain(cause.as_ref()),
                StoreError::Timeout(within) => format!("no answer within {within:?}"),
                other => fence_storage::error_chain(other),
            };
            say!("fence healthcheck: {}/healthz: {why}", target.base_url());
            Ok(1)
        }
    }
}
