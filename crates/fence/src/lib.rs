//! The pieces of the `fence` command, as a library so tests can run them in-process: the
//! lease server, the fencing proxy, `fence run`, the client calls and the demo.

pub mod demo;
pub mod duration;
pub mod http_client;
pub mod proxy;
pub mod run;
pub mod server;
