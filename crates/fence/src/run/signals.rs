//! The signals `fence run` handles: those that stop it, and those it only passes on.

use nix::sys::signal::Signal;
use tokio::signal::unix::{Signal as Stream, SignalKind, signal};

/// The signals `fence run` passes on to the command's group; installed before anything is
/// spawned, so none of them can kill `fence run` and orphan the group.
pub(super) struct Signals {
    int: Stream,
    term: Stream,
    hup: Stream,
    /// Only passed on while the command runs (reopen logs, dump state, a resized
    /// terminal), ignored before and after it: they ask nothing of `fence run` itself.
    passed: [(Signal, Stream); 4],
}

impl Signals {
    pub(super) fn install() -> std::io::Result<Self> {
        let passed =
            |sig: Signal| Ok::<_, std::io::Error>((sig, signal(SignalKind::from_raw(sig as i32))?));
        Ok(Self {
            int: signal(SignalKind::interrupt())?,
            term: signal(SignalKind::terminate())?,
            hup: signal(SignalKind::hangup())?,
            passed: [
                passed(Signal::SIGUSR1)?,
                passed(Signal::SIGUSR2)?,
                passed(Signal::SIGQUIT)?,
                passed(Signal::SIGWINCH)?,
            ],
        })
    }

    /// The next signal that stops: SIGINT, SIGTERM or SIGHUP.
    pub(super) async fn next(&mut self) -> Signal {
        tokio::select! {
            _ = self.int.recv() => Signal::SIGINT,
            _ = self.term.recv() => Signal::SIGTERM,
            _ = self.hup.recv() => Signal::SIGHUP,
        }
    }

    /// The next signal of any kind, to pass on to the running command.
    pub(super) async fn next_to_pass(&mut self) -> Signal {
        let [(a, sa), (b, sb), (c, sc), (d, sd)] = &mut self.passed;
        tokio::select! {
            _ = self.int.recv() => Signal::SIGINT,
            _ = self.term.recv() => Signal::SIGTERM,
            _ = self.hup.recv() => Signal::SIGHUP,
            _ = sa.recv() => *a,
            _ = sb.recv() => *b,
            _ = sc.recv() => *c,
            _ = sd.recv() => *d,
        }
    }
}
