//! What `fence run` does with the job at the command's end: its success, failure or time limit.

use clap::ValueEnum;

/// What `fence run` does with the job when the command exits 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnSuccess {
    /// Complete it: it can never be claimed again.
    Complete,
    /// Release it: it can be claimed again (a nightly job).
    Release,
}

/// What `fence run` does with the job when the command exits non-zero (or is killed by a
/// signal) while the lease still holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnFailure {
    /// Release it: the next run may start at once.
    Release,
    /// Stop renewing and let the lease run out: nobody can claim the job until its end and
    /// the lock-delay after it have passed (for a command whose failed effect may still
    /// land, such as a write that timed out).
    Expire,
}

/// What `fence run` does with the job when `--max-duration` stops the command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnMaxDuration {
    /// Release it.
    Release,
    /// Stop renewing and let the lease run out.
    Expire,
}
