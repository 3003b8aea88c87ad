//! `fence keepalive`: keeps a lease claimed elsewhere renewed until stdin closes or a signal.

use std::time::Duration;

use anyhow::Context as _;

use fence_lease::{ClaimError, LeaseClient};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    signal::unix::{SignalKind, signal},
};

use crate::{
    calls::{LeaseRef, connect},
    cli::KeepaliveCmd,
    run::{EXIT_LOST, token_file::KeptTokenFile},
};

/// `fence keepalive`: resumes the lease (one renewal at once), then renews it in the
/// background, copying stdin to stdout, until stdin closes or SIGTERM, SIGINT or SIGHUP
/// arrives (exit 0, the lease still held) or the lease is lost (exit 75).
///
/// # Errors
/// A usage error for a bad `--lease` or `--lease -` (stdin is keepalive's lifeline); an
/// error when the server cannot be reached at start.
pub async fn keepalive(a: KeepaliveCmd) -> anyhow::Result<i32> {
    if a.lease
        .lease
        .as_deref()
        .is_some_and(|p| p.as_os_str() == "-")
    {
        return Err(crate::Usage::error(
            "keepalive reads stdin until it closes, so its --lease must be a file, not -",
        ));
    }
    let lease = LeaseRef::of(&a.lease)?;
    let store = connect(&a.lease.conn)?;
    let client = LeaseClient::new(store).owner(lease.owner).ttl(a.ttl);
    let (job, generation) = (lease.job.clone(), lease.generation);
    // Caught from before the first round trip: a SIGTERM that arrives while the lease is
    // resumed (a slow server, a loaded machine) is kept for the loop below, and stops
    // keepalive with what it says, instead of killing it by the default action.
    let (mut term, mut int, mut hup) = (
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
        signal(SignalKind::hangup())?,
    );
    let resumed = tokio::select! {
        resumed = client.resume(lease.job, lease.generation, lease.key) => resumed,
        // A stop asked for while the lease is resumed (a slow or unreachable server) stops
        // at once, as before the handlers were installed this early: keepalive never
        // releases, so the lease, if held, runs to its TTL.
        _ = term.recv() => return Ok(stopped_resuming(&job, generation)),
        _ = int.recv() => return Ok(stopped_resuming(&job, generation)),
        _ = hup.recv() => return Ok(stopped_resuming(&job, generation)),
    };
    let held = match resumed {
        Ok(held) => held,
        Err(e @ ClaimError::NotHeld { .. }) => {
            say!("fence keepalive: {e}");
            return Ok(EXIT_LOST);
        }
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!(
                "could not renew job {job} (generation {generation})"
            )));
        }
    };
    let said_lost = || {
        let why = held
            .loss_reason()
            .map_or_else(|| "lost".to_owned(), |r| r.to_string());
        say!("fence keepalive: the lease of job {job} (generation {generation}) is lost: {why}");
        Ok(EXIT_LOST)
    };
    // The token file is written before anything is said or copied: a script that waits
    // for keepalive's first output finds it there. Emptied when this returns, however.
    let _token_file = match &a.token_file {
        Some(path) => {
            let updates = held.tokens();
            let Some(token) = held.token_string() else {
                return said_lost();
            };
            let shown = path.display().to_string();
            Some(
                KeptTokenFile::start(path.clone(), &token, updates)
                    .with_context(|| format!("cannot write --token-file {shown}"))?,
            )
        }
        None => None,
    };
    let mut stdin = tokio::io::stdin();
    let mut stdout = Some(tokio::io::stdout());
    let mut buf = vec![0u8; 16 * 1024];
    let lost = held.lost();
    tokio::pin!(lost);
    'copying: loop {
        tokio::select! {
            () = &mut lost => return said_lost(),
            read = stdin.read(&mut buf) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    // A reader that went away is no reason to stop renewing; one that stalls
                    // (a full pipe) holds back neither the loss's exit nor a signal's stop.
                    if let Some(out) = &mut stdout {
                        let copied = tokio::select! {
                            () = &mut lost => return said_lost(),
                            _ = term.recv() => break 'copying,
                            _ = int.recv() => break 'copying,
                            _ = hup.recv() => break 'copying,
                            copied = async {
                                out.write_all(&buf[..n]).await?;
                                out.flush().await
                            } => copied,
                        };
                        if copied.is_err() {
                            stdout = None;
                        }
                    }
                }
            },
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = hup.recv() => break,
        }
    }
    // One last look: a lease lost just now is reported as lost, not as kept.
    if held.is_lost() {
        return said_lost();
    }
    let left = held
        .deadline()
        .saturating_duration_since(tokio::time::Instant::now());
    say!(
        "fence keepalive: stopped renewing job {job} (generation {generation}); it is still held for about {}{}",
        humantime::format_duration(Duration::from_millis(left.as_millis() as u64)),
        if a.token_file.is_some() {
            ", and --token-file is emptied"
        } else {
            ""
        }
    );
    // Dropping the lease stops its keeper; it neither releases nor completes.
    drop(held);
    Ok(0)
}

/// Says that keepalive stopped before its first renewal answered; exit 0, as any stop.
fn stopped_resuming(job: &fence_core::JobId, generation: fence_core::Generation) -> i32 {
    say!(
        "fence keepalive: stopped before the lease of job {job} (generation {generation}) was renewed; if it is held, it ends at its TTL"
    );
    0
}
