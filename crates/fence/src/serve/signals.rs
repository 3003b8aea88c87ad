//! The signals `fence server` and `fence proxy` answer: SIGINT and SIGTERM stop, SIGHUP reloads.

use crate::auth::Auth;

/// SIGINT and SIGTERM, caught from when this is made (before the "ready" line: one sent the
/// moment that line is read must not find the default action, which ends the process with
/// no drain and no last flush).
#[derive(Debug)]
pub struct StopSignals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Installs the handlers.
    ///
    /// # Errors
    /// When a signal handler cannot be installed.
    pub fn install() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
        })
    }

    /// Resolves on SIGINT or SIGTERM; from then on, a second one exits at once (128 plus its
    /// number: 130 or 143).
    pub async fn shutdown(mut self) {
        self.next().await;
        tracing::info!(
            "shutting down: finishing in-flight requests (a second signal stops at once)"
        );
        // An operator who will not wait for the grace: what was answered is on disk already
        // (the stores commit before they answer), so stopping now is a crash they asked for.
        tokio::spawn(async move {
            let signal = self.next().await;
            tracing::warn!("a second signal: stopping at once, open requests cut");
            std::process::exit(128 + signal);
        });
    }

    /// The next SIGINT or SIGTERM, by its number.
    async fn next(&mut self) -> i32 {
        tokio::select! {
            _ = self.int.recv() => 2,
            _ = self.term.recv() => 15,
        }
    }
}

/// Handles SIGHUP from here on: reloads `auth` when there is one (`flag` names its file),
/// else, unless `tls` reloads its certificate on it, logs that there is nothing to reload.
/// Without a handler the signal's default action ends the process at once, with no drain
/// and no last flush: a stray hang-up (a closed terminal, `docker kill -s HUP`, a log
/// rotation's script) must not do that to a server that took no auth file. Installed before
/// the store opens, so that a hang-up during a long start does not either.
pub(super) fn on_hangup(auth: Option<Auth>, flag: &'static str, tls: bool) -> std::io::Result<()> {
    if let Some(auth) = auth {
        auth.reload_on_sighup()?;
        return Ok(());
    }
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            if !tls {
                tracing::info!("SIGHUP: nothing to reload (no {flag}); going on");
            }
        }
    });
    Ok(())
}
