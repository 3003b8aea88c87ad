//! What `fence run` says on stderr: how the command ended, and repeated warnings counted.

use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::Instant;

use super::{EXIT_LOST, EXIT_MAX_DURATION, EXIT_NOT_OBTAINED};

/// How the command ended, in words for fence run's last line: a signal is named as one (not
/// "exited 137"), and a code that is also one of fence run's own (1, 2, 3, 75, 124, or
/// 128+N as for a signal) is flagged as the command's, so a script reading only the exit
/// code knows to look here.
pub(super) fn ended_how(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = status.signal() {
        let name = Signal::try_from(sig)
            .map_or_else(|_| format!("signal {sig}"), |s| s.as_str().to_owned());
        let core = if status.core_dumped() {
            ", core dumped"
        } else {
            ""
        };
        return format!(
            "was killed by {name} (signal {sig}{core}; exit code {})",
            128 + sig
        );
    }
    let code = status.code().unwrap_or(1);
    let own = matches!(
        code,
        1 | 2 | EXIT_NOT_OBTAINED | EXIT_LOST | EXIT_MAX_DURATION
    ) || code > 128;
    if own {
        format!("exited {code} (the command's own code, not fence run's)")
    } else {
        format!("exited {code}")
    }
}

/// A warning said once, then its repeats counted: said again with the count at most every
/// [`Repeats::EVERY`], so a server that is down does not fill the terminal (or a log).
#[derive(Default)]
pub(super) struct Repeats {
    last: Option<(String, Instant)>,
    again: u32,
}

impl Repeats {
    const EVERY: Duration = Duration::from_secs(10);

    pub(super) fn say(&mut self, line: String) {
        if let Some((last, at)) = &self.last
            && *last == line
            && at.elapsed() < Self::EVERY
        {
            self.again += 1;
            return;
        }
        self.flush();
        say!("{line}");
        self.last = Some((line, Instant::now()));
    }

    /// Says how often the last warning came again since it was said, if it did.
    pub(super) fn flush(&mut self) {
        if self.again > 0 {
            say!(
                "fence run: (the warning above came {} more times)",
                self.again
            );
            self.again = 0;
        }
    }
}
