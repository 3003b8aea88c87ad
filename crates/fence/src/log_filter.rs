//! The log filter `fence` starts with: `RUST_LOG` or a default, never a database driver's debug lines.
//!
//! At debug, tokio-postgres logs every statement with its parameters: the idempotent answers
//! the proxy stores, the checkpoints the server keeps. A `RUST_LOG` that would let its debug
//! events through (`debug`, `trace`, `tokio=debug`) gets `tokio_postgres=info` added, unless
//! it names `tokio_postgres` itself: an operator who asks for them gets them. A directive for
//! one of its modules (`tokio_postgres::connection=warn`, the default's) does not count:
//! more specific, it still wins over the added one for that module, and the rest of the
//! driver stays at info.

use tracing_subscriber::{EnvFilter, filter::LevelFilter};

/// The target whose debug events carry statement parameters.
const DRIVER: &str = "tokio_postgres";

/// The filter when `RUST_LOG` is unset or blank: info (PostgreSQL's NOTICEs, a migration's
/// "already exists, skipping", are not news), or for the demo, which prints a timeline of
/// its own, errors only.
pub fn default_directives(demo: bool) -> &'static str {
    if demo {
        "error"
    } else {
        "info,tokio_postgres::connection=warn"
    }
}

/// `asked` (a `RUST_LOG` value), with `tokio_postgres=info` added when it would let
/// tokio-postgres's debug events through without naming it.
pub fn directives(asked: &str) -> String {
    let mut names_driver = false;
    let mut verbose_for_driver = false;
    for directive in asked.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let (target, level) = match directive.split_once('=') {
            Some((target, level)) => (target, level.parse().unwrap_or(LevelFilter::TRACE)),
            None => match directive.parse::<LevelFilter>() {
                Ok(level) => ("", level),
                // A target alone enables all its events.
                Err(_) => (directive, LevelFilter::TRACE),
            },
        };
        // `target[span{field}]`: the target is what comes before the span.
        let target = target.split('[').next().unwrap_or("").trim();
        if target == DRIVER {
            names_driver = true;
        } else if DRIVER.starts_with(target) && level > LevelFilter::INFO {
            // A bare level, a span without a target, or a target the driver's starts with.
            verbose_for_driver = true;
        }
    }
    if verbose_for_driver && !names_driver {
        format!("{asked},{DRIVER}=info")
    } else {
        asked.to_owned()
    }
}

/// The filter for `RUST_LOG` (`None` or blank: [`default_directives`]), and what to say on
/// stderr when it does not parse: it is then replaced by the default, not silently.
pub fn filter(rust_log: Option<&str>, demo: bool) -> (EnvFilter, Option<String>) {
    let default = default_directives(demo);
    match rust_log {
        Some(asked) if !asked.trim().is_empty() => match EnvFilter::try_new(directives(asked)) {
            Ok(filter) => (filter, None),
            Err(e) => (
                EnvFilter::new(default),
                Some(format!(
                    "fence: RUST_LOG={asked:?} is not a log filter ({e}); logging {default:?}"
                )),
            ),
        },
        _ => (EnvFilter::new(default), None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verbose_filter_keeps_the_driver_at_info_unless_it_names_it() {
        for (asked, want) in [
            ("debug", "debug,tokio_postgres=info"),
            ("trace", "trace,tokio_postgres=info"),
            ("info,fence=debug", "info,fence=debug"),
            ("fence=debug", "fence=debug"),
            ("tokio=debug", "tokio=debug,tokio_postgres=info"),
            ("tokio_postgres", "tokio_postgres"),
            ("debug,tokio_postgres=debug", "debug,tokio_postgres=debug"),
            (
                "debug,tokio_postgres::query=trace",
                "debug,tokio_postgres::query=trace,tokio_postgres=info",
            ),
            (
                "debug,tokio_postgres::connection=warn",
                "debug,tokio_postgres::connection=warn,tokio_postgres=info",
            ),
            ("[request]=debug", "[request]=debug,tokio_postgres=info"),
            ("warn", "warn"),
            ("info", "info"),
        ] {
            assert_eq!(directives(asked), want, "RUST_LOG={asked}");
        }
    }

    /// What the driver would log at debug (a statement with its parameters) is not
    /// enabled by `RUST_LOG=debug`; fence's own debug events are.
    #[test]
    fn rust_log_debug_enables_fence_debug_but_not_the_drivers() {
        use tracing_subscriber::layer::SubscriberExt;
        // Also the default's module directive with the level raised.
        for asked in ["debug", "debug,tokio_postgres::connection=warn"] {
            let (filter, said) = filter(Some(asked), false);
            assert_eq!(said, None);
            let subscriber = tracing_subscriber::registry().with(filter);
            tracing::subscriber::with_default(subscriber, || {
                assert!(tracing::enabled!(target: "fence::server", tracing::Level::DEBUG));
                assert!(
                    !tracing::enabled!(target: "tokio_postgres::query", tracing::Level::DEBUG),
                    "{asked}"
                );
                assert!(tracing::enabled!(target: "tokio_postgres::query", tracing::Level::INFO));
            });
        }
    }

    #[test]
    fn a_filter_that_does_not_parse_is_said_and_the_default_used() {
        let (filter, said) = filter(Some("fence=loud"), false);
        let said = said.expect("a warning");
        assert!(said.contains("not a log filter"), "{said}");
        assert!(
            said.contains("\"info,tokio_postgres::connection=warn\""),
            "{said}"
        );
        assert_eq!(
            filter.to_string(),
            EnvFilter::new(default_directives(false)).to_string()
        );
        assert_eq!(super::filter(Some("  "), true).0.to_string(), "error");
    }
}
