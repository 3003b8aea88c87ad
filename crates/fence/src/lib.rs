//! The pieces of the `fence` command, as a library so tests can run them in-process: the
//! lease server, the fencing proxy, `fence run`, the client commands and the demo.

pub mod duration;
pub mod server;
