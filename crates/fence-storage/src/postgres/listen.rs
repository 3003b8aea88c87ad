//! `LISTEN` on a channel, kept up across lost connections.
//!
//! Several processes sharing one database tell each other this way that something changed
//! (a lease let go, say).
//!
//! [`listen`] starts a task holding one session of its own (not one of a pool: a pooled
//! connection would stop listening when given back) that forwards each notification's
//! payload as [`Notice::Payload`]. Whenever its session is new (at start and after a lost
//! connection, a restarted database, a failed liveness check), it says [`Notice::Missed`]
//! once `LISTEN` is in place: anything sent while nobody listened was lost, so whoever acts
//! on notices looks again at everything. When a session it listened on is lost it says
//! [`Notice::Lost`], so whoever relies on notices knows to look for itself meanwhile. The
//! task ends when the [`Listener`] is dropped.

use std::time::Duration;

use tokio::sync::broadcast;
use tokio_postgres::AsyncMessage;

use super::SetupError;
use crate::Notice;

/// How often the session is checked when quiet; a check that takes longer than this counts as
/// a lost connection.
const LIVENESS: Duration = Duration::from_secs(10);

/// How many notices wait for a slow receiver before it is told [`Notice::Missed`] instead.
const BACKLOG: usize = 4096;

/// A channel being listened to. Dropping it (with its clones) stops the listening task.
#[derive(Debug, Clone)]
pub struct Listener {
    notices: broadcast::Sender<Notice>,
    _task: std::sync::Arc<Abort>,
}

#[derive(Debug)]
struct Abort(tokio::task::AbortHandle);

impl Drop for Abort {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Listener {
    /// Notices from now on. A receiver that falls more than a few thousand behind gets
    /// `RecvError::Lagged` from tokio: treat it as [`Notice::Missed`].
    #[must_use]
    pub fn subscribe(&self) -> broadcast::Receiver<Notice> {
        self.notices.subscribe()
    }
}

/// A channel name for `what` (a qualified table name, say): `what` itself when it fits in
/// PostgreSQL's 63 bytes, else `fence_` and a 64-bit FNV-1a hash of it in hex, the same in
/// every build and process.
#[must_use]
pub fn channel_name(what: &str) -> String {
    if what.len() <= super::MAX_IDENT_LEN {
        return what.to_owned();
    }
    format!("fence_{:016x}", fnv1a(what))
}

/// 64-bit FNV-1a.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Listens on `channel` of the database at `url` (TLS and passwords as
/// [`connect_pool`](super::connect_pool) reads them), from a task on the current tokio
/// runtime. Connecting happens in the task, again and again with a growing pause (up to 5 s)
/// while the database cannot be reached, so a database that is down now is not an error.
///
/// # Errors
/// When `url` is not a valid connection string, or TLS cannot be set up.
///
/// # Panics
/// Outside a tokio runtime.
pub fn listen(url: &str, channel: &str) -> Result<Listener, SetupError> {
    let (config, tls) = super::session(url)?;
    let (notices, _) = broadcast::channel(BACKLOG);
    let statement = format!("LISTEN \"{}\"", channel.replace('"', "\"\""));
    let tx = notices.clone();
    let task = tokio::spawn(async move {
        let mut pause = Duration::from_millis(100);
        loop {
            if session_until_lost(&config, tls.clone(), &statement, &tx).await {
                let _ = tx.send(Notice::Lost);
                pause = Duration::from_millis(100);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    });
    Ok(Listener {
        notices,
        _task: std::sync::Arc::new(Abort(task.abort_handle())),
    })
}

/// One session: connects, listens, says [`Notice::Missed`], forwards notifications until the
/// connection is lost or fails a liveness check. True when it got as far as listening.
async fn session_until_lost(
    config: &tokio_postgres::Config,
    tls: tokio_postgres_rustls::MakeRustlsConnect,
    statement: &str,
    tx: &broadcast::Sender<Notice>,
) -> bool {
    let Ok(Ok((client, mut connection))) =
        tokio::time::timeout(super::POOL_TIMEOUT, config.connect(tls)).await
    else {
        return false;
    };
    let forward = tx.clone();
    let mut driver = tokio::spawn(async move {
        while let Some(Ok(message)) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            if let AsyncMessage::Notification(n) = message {
                let _ = forward.send(Notice::Payload(n.payload().to_owned()));
            }
        }
    });
    let listening = tokio::time::timeout(LIVENESS, client.batch_execute(statement)).await;
    if !matches!(listening, Ok(Ok(()))) {
        driver.abort();
        return false;
    }
    let _ = tx.send(Notice::Missed);
    loop {
        // The driver ends when the connection does; when quiet, the session is asked.
        if tokio::time::timeout(LIVENESS, &mut driver).await.is_ok() {
            return true;
        }
        let alive = tokio::time::timeout(LIVENESS, client.simple_query("SELECT 1")).await;
        if !matches!(alive, Ok(Ok(_))) {
            driver.abort();
            return true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_names_fit_and_are_stable() {
        assert_eq!(channel_name("fence.leases"), "fence.leases");
        let long = format!("{}.{}", "s".repeat(63), "t".repeat(63));
        let name = channel_name(&long);
        assert!(name.len() <= 63, "{name}");
        assert_eq!(name, channel_name(&long));
        assert_ne!(name, channel_name(&format!("{long}x")));
        // The published FNV-1a test vectors.
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a("foobar"), 0x8594_4171_f739_67e8);
    }
}
