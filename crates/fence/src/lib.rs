//! The pieces of the `fence` command, as a library so tests can run them in-process: the
//! lease server, the fencing proxy, `fence run`, the client calls and the demo.

pub mod demo;
pub mod duration;
pub mod http_client;
pub mod proxy;
pub mod run;
pub mod server;

/// `error: cause: cause`, for one-line logs and problem details.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}
