//! The pieces of the `fence` command, as a library so tests can run them in-process.
//!
//! The lease server, the fencing proxy, `fence run`, the one-shot lease calls, key files and
//! the demo; [`cli`] holds every flag and help text.

pub mod backend;
pub mod calls;
pub mod cli;
pub mod demo;
pub mod duration;
pub mod keys;
pub mod proxy;
pub mod run;
pub mod serve;
pub mod server;
#[cfg(feature = "test-hooks")]
pub mod test_hooks;
