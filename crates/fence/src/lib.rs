//! The pieces of the `fence` command, as a library so tests can run them in-process.
//!
//! The lease server, the fencing proxy, `fence run`, the one-shot lease calls, key files and
//! the demo; [`cli`] holds every flag and help text.

/// `eprintln!` that never panics: a stderr that is gone (a pipe to a `tee` that exited) must
/// not end a command midway (`fence run` with its command's group still running) or turn its
/// exit code into 101; the line is lost.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

/// `println!` that never panics: a stdout that is gone (`fence demo | head`) ends nothing
/// the command does, and a line it could not write is not an error worth a panic.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

pub mod auth;
pub mod backend;
pub mod calls;
pub mod cli;
pub mod demo;
pub mod duration;
pub mod hints;
pub mod keepalive;
pub mod keys;
pub mod listen;
pub mod log_filter;
mod probe;
pub mod proxy;
pub mod run;
pub mod serve;
pub mod server;
pub mod server_cert;
pub mod telemetry;
#[cfg(feature = "test-hooks")]
pub mod test_hooks;
pub mod tls_init;

/// The permission bits (`0o777`) of `path` when its group or others hold any of them: a
/// secret others may read, a directory others may enter. `None` when it is private, or when
/// it cannot be looked at (whoever reads it then says why).
pub(crate) fn open_to_others(path: &std::path::Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o077 != 0).then_some(mode)
}

/// A mistake in how `fence` was called: a flag's value or a file it names cannot be used.
/// The command prints it as one line and exits 2.
#[derive(Debug)]
pub struct Usage(String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

impl Usage {
    /// A usage error saying `message`.
    pub fn error(message: impl Into<String>) -> anyhow::Error {
        anyhow::Error::new(Self(message.into()))
    }

    /// `e`, with its causes on one line, as a usage error.
    pub fn from_error(e: impl Into<anyhow::Error>) -> anyhow::Error {
        let e: anyhow::Error = e.into();
        if e.is::<Self>() {
            return e;
        }
        Self::error(format!("{e:#}"))
    }
}
