//! The flags of `fence proxy`.
// The doc comments below are `--help` text first (see the parent module).
#![allow(rustdoc::invalid_html_tags)]

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::{Args, builder::BoolishValueParser};
use fence_core::Ttl;
use http::Method;

use super::{ListenArgs, StorageArgs, parse_forget_after, parse_ttl};
use crate::duration::{parse_duration, parse_timeout};

/// `--unknown-outcome-status`: the upstream statuses of unknown outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownStatuses(pub Vec<http::StatusCode>);

/// Parses `--unknown-outcome-status`: `none`, or comma-separated statuses from 500 to 599
/// (a 4xx says the request was refused, a 2xx or 3xx that it was done).
fn parse_unknown_statuses(s: &str) -> Result<UnknownStatuses, String> {
    if s.trim().eq_ignore_ascii_case("none") {
        return Ok(UnknownStatuses(Vec::new()));
    }
    let mut statuses = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        match part.parse::<u16>() {
            Ok(code @ 500..=599) => statuses
                .push(http::StatusCode::from_u16(code).map_err(|e| format!("{part:?}: {e}"))?),
            _ => {
                return Err(format!(
                    "{part:?} is not a 5xx status: give statuses from 500 to 599, comma-separated (like 502,504), or none"
                ));
            }
        }
    }
    statuses.dedup();
    Ok(UnknownStatuses(statuses))
}

/// Parses `--unknown-outcome-grpc-status`: `none`, or comma-separated gRPC status codes
/// from 1 to 16 (0 is OK).
fn parse_unknown_grpc_statuses(s: &str) -> Result<fence_sink::GrpcStatuses, String> {
    if s.trim().eq_ignore_ascii_case("none") {
        return Ok(fence_sink::GrpcStatuses::NONE);
    }
    let codes = s
        .split(',')
        .map(|part| match part.trim().parse::<u32>() {
            Ok(code @ 1..=16) => Ok(code),
            _ => Err(format!(
                "{:?} is not a gRPC error code: give codes from 1 to 16, comma-separated (like 1,4), or none",
                part.trim()
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    fence_sink::GrpcStatuses::of(codes).ok_or_else(|| format!("{s:?}: codes run from 1 to 16"))
}

/// Parses `--idempotency-retention`: a duration of at least a second. Shorter keeps no
/// record long enough for a retry to be replayed, which is --no-idempotency said unclearly.
fn parse_retention(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_secs(1) {
        return Err(format!(
            "{s:?}: a retention under 1s keeps no answer for a retry to be replayed; give at least 1s, or --no-idempotency to turn replay off"
        ));
    }
    Ok(d)
}

/// The flags of `fence proxy`.
#[derive(Args, Debug)]
pub struct ProxyArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7800", env = "FENCE_LISTEN")]
    pub listen: SocketAddr,
    /// TLS and connection limits of both listeners (--listen and --admin-listen).
    #[command(flatten)]
    pub listener: ListenArgs,
    /// The service to protect: http://host:port[/prefix] or https://host:port[/prefix].
    #[arg(long, env = "FENCE_UPSTREAM", hide_env_values = true, value_parser = UpstreamParser)]
    pub upstream: http::Uri,
    /// Trust only this CA (PEM, one or more certificates) for an https:// upstream, instead
    /// of the system's roots.
    #[arg(long, value_name = "FILE", env = "FENCE_UPSTREAM_CA_CERT")]
    pub upstream_ca_cert: Option<PathBuf>,
    /// Where the fence records (highest generation per job, idempotency records) are kept.
    #[command(flatten)]
    pub storage: StorageArgs,
    /// Address of GET /metrics, GET /healthz, GET /readyz (store and upstream) and GET/POST
    /// /v1/fence/{job}, apart from the proxied paths. Two proxies
    /// on one host need two. Loopback only, unless the proxy serves TLS (--tls-cert) and the
    /// admin listener has --admin-auth-file: any other address is refused.
    #[arg(long, default_value = "127.0.0.1:7801", env = "FENCE_ADMIN_LISTEN")]
    pub admin_listen: SocketAddr,
    /// Clients of the admin listener, in the lease server's --auth-file format (name
    /// secret patterns; the patterns are not used); every admin request then needs
    /// Authorization: Bearer <secret>, else 401. Reloaded on SIGHUP.
    #[arg(long, value_name = "FILE", env = "FENCE_ADMIN_AUTH_FILE")]
    pub admin_auth_file: Option<PathBuf>,
    /// Methods that are fenced, comma separated, matched in any letter case (`post` is fenced
    /// with POST). Default: every method but GET, HEAD, OPTIONS and TRACE (in exactly those
    /// capitals), so a method this list does not know fails closed.
    #[arg(long, value_delimiter = ',', env = "FENCE_FENCE_METHODS")]
    pub fence_methods: Option<Vec<Method>>,
    /// Answer 428 to fenced requests without fencing headers (the default; so
    /// FENCE_REQUIRE_TOKEN=false does not turn it off: --allow-missing-token does). Refused
    /// beside --allow-missing-token.
    #[arg(long, value_parser = BoolishValueParser::new(), env = "FENCE_REQUIRE_TOKEN")]
    pub require_token: bool,
    /// Let fenced requests without fencing headers through (unfenced: their Idempotency-Key is
    /// not kept either, as records are per job).
    #[arg(long, value_parser = BoolishValueParser::new(), env = "FENCE_ALLOW_MISSING_TOKEN")]
    pub allow_missing_token: bool,
    /// Ignore Idempotency-Key headers (they are still checked for syntax).
    #[arg(long, value_parser = BoolishValueParser::new(), env = "FENCE_NO_IDEMPOTENCY")]
    pub no_idempotency: bool,
    /// How long completed idempotency records are kept (at least 1s; --no-idempotency turns
    /// replay off).
    #[arg(long, allow_hyphen_values = true, default_value = "24h", value_parser = parse_retention, env = "FENCE_IDEMPOTENCY_RETENTION")]
    pub idempotency_retention: Duration,
    /// Scope stored idempotent answers by this request header (repeatable; e.g.
    /// authorization, for a multi-tenant upstream): an answer is replayed only to a request
    /// with the same values, and the same key with others is 422. Off by default: derived
    /// keys must deduplicate across holders that send other credentials.
    #[arg(
        long,
        value_name = "HEADER",
        env = "FENCE_IDEMPOTENCY_SCOPE_HEADER",
        value_delimiter = ','
    )]
    pub idempotency_scope_header: Vec<http::HeaderName>,
    /// Largest response body stored for replay, in bytes.
    #[arg(long, default_value_t = 1 << 20, env = "FENCE_IDEMPOTENCY_MAX_BODY")]
    pub idempotency_max_body: usize,
    /// The most bytes the stored idempotency records may hold (default 4 GiB); past it a
    /// new key gets 503 overloaded with Retry-After 60 and is not sent upstream, while
    /// recorded keys still replay. Records cost retention x rate x answer size (24h at 50
    /// keyed requests/s of 1 MiB answers is 4 TB), and on sled they share --data-dir with the
    /// generations: a full disk fails every job. Once the records hold three quarters of it,
    /// a job whose own records hold a quarter of it gets no new keys either, so no one job
    /// fills it. Not applied to a PostgreSQL store.
    #[arg(long, value_name = "BYTES", default_value_t = 4 << 30, value_parser = clap::value_parser!(u64).range(1..), env = "FENCE_IDEMPOTENCY_MAX_STORED")]
    pub idempotency_max_stored: u64,
    /// How long a newer token waits for older in-flight requests before 503.
    #[arg(long, allow_hyphen_values = true, default_value = "10s", value_parser = parse_timeout, env = "FENCE_DRAIN_TIMEOUT")]
    pub drain_timeout: Duration,
    /// How long a request may take upstream before 504. After a restart, a job that had
    /// requests admitted within this (or --body-timeout, if longer; with idempotency plus
    /// the store timeout, 5 s, and --body-timeout again; plus --unknown-outcome-hold) before
    /// it lets no newer token through until they could no longer be running upstream.
    #[arg(long, allow_hyphen_values = true, default_value = "60s", value_parser = parse_timeout, env = "FENCE_UPSTREAM_TIMEOUT")]
    pub upstream_timeout: Duration,
    /// How long a fenced request's body may take to arrive, from admission. A slower body
    /// is cut: 408 body-timeout, and with Idempotency-Key the upstream never sees it; so one
    /// slow client delays a job's newer holder by this much at most.
    #[arg(long, allow_hyphen_values = true, default_value = "30s", value_parser = parse_timeout, env = "FENCE_BODY_TIMEOUT")]
    pub body_timeout: Duration,
    /// How long an upstream connection may sit unused and still be reused; an older one is
    /// not reused (it is closed when its worker next looks for one). Keep it below the
    /// upstream's own keep-alive timeout (Node 5s, gunicorn 2s, uvicorn 5s): a request
    /// written just as the upstream closes an idle connection gets no answer, a 502 of
    /// unknown outcome that holds its job for --unknown-outcome-hold.
    #[arg(long, allow_hyphen_values = true, default_value = "4s", value_parser = parse_timeout, env = "FENCE_UPSTREAM_IDLE_TIMEOUT")]
    pub upstream_idle_timeout: Duration,
    /// After an answer of unknown outcome (504, a 502 after the request was written, or the
    /// upstream's own answer with a status of --unknown-outcome-status), how
    /// long the request still counts as in flight for its job, so a newer generation does not
    /// pass while the upstream may still act on it. Default: --upstream-timeout.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration, env = "FENCE_UNKNOWN_OUTCOME_HOLD")]
    pub unknown_outcome_hold: Option<Duration>,
    /// The upstream's own answers that leave its outcome unknown, as the proxy's 504 does:
    /// comma-separated 5xx statuses, or `none`. The default fits a gateway in front of the
    /// service (nginx, envoy, a load balancer), whose 504 comes while the service may still be
    /// acting; such an answer holds its job for --unknown-outcome-hold and keeps its
    /// Idempotency-Key record in flight, so neither a newer token nor a retry runs beside it.
    /// Add 502 when the gateway's 502 may come after the service began (a reset mid-request):
    /// most come when it could not reach the service at all. A gRPC call's answer counts by
    /// its HTTP status here, and by its grpc-status below.
    #[arg(long, value_name = "STATUSES", default_value = "504", value_parser = parse_unknown_statuses, env = "FENCE_UNKNOWN_OUTCOME_STATUS")]
    pub unknown_outcome_status: UnknownStatuses,
    /// The upstream's gRPC statuses (in the answer's headers or trailers) that leave a
    /// call's outcome unknown: comma-separated codes from 1 to 16, or `none`. The default,
    /// CANCELLED and DEADLINE_EXCEEDED, is what a gRPC server answers after dropping the
    /// handler of a call whose deadline (grpc-timeout) ran out, wherever the handler was: a
    /// write it had sent may still commit. Such an answer holds its job for
    /// --unknown-outcome-hold and keeps its Idempotency-Key record in flight. Add 14
    /// (UNAVAILABLE) when a gateway (envoy) answers it after giving up on a service that may
    /// still act.
    #[arg(long, value_name = "CODES", default_value = "1,4", value_parser = parse_unknown_grpc_statuses, env = "FENCE_UNKNOWN_OUTCOME_GRPC_STATUS")]
    pub unknown_outcome_grpc_status: fence_sink::GrpcStatuses,
    /// The most bytes of bodies held in memory at once (buffered idempotent requests,
    /// responses captured for replay, replays); past it: 503 overloaded with Retry-After.
    #[arg(long, value_name = "BYTES", default_value_t = 256 << 20, value_parser = clap::value_parser!(u64).range(1..), env = "FENCE_MAX_BUFFERED_BYTES")]
    pub max_buffered_bytes: u64,
    /// Require signed tokens valid under this public key (SPKI PEM, from `fence keygen` or
    /// openssl); repeat it to accept several keys during a rotation. Unsigned or forged
    /// tokens get 403.
    #[arg(
        long,
        value_name = "FILE",
        env = "FENCE_VERIFY_KEY",
        value_delimiter = ','
    )]
    pub verify_key: Vec<PathBuf>,
    /// How far the lease server's clock may be ahead of this proxy's: with --verify-key, a
    /// token whose lease ended longer ago than this is 409 token-expired.
    #[arg(long, allow_hyphen_values = true, default_value = "5s", value_parser = parse_duration, env = "FENCE_CLOCK_SKEW")]
    pub clock_skew: Duration,
    /// Forget a job with no admitted request for this long, on disk and in memory (1s to
    /// 10 years; default: never). Needs --verify-key, and at least --max-lease-ttl plus
    /// twice --clock-skew: a stale write to a forgotten job is then still refused, as
    /// token-expired. On --data-dir, never sooner than --unknown-outcome-hold plus the later
    /// of --upstream-timeout and --body-timeout (with idempotency, plus the store timeout,
    /// 5 s, and --body-timeout again): what a crashed proxy passed on may run that long (the
    /// proxy logs the window it uses).
    #[arg(long, allow_hyphen_values = true, value_name = "DURATION", value_parser = parse_forget_after, env = "FENCE_FORGET_AFTER")]
    pub forget_after: Option<Duration>,
    /// Remove the data directory's `running` record before opening it when it is damaged (a
    /// directory that refuses to open because of it); one that reads is kept. Only safe once the longest request
    /// plus the hold of the proxy before has passed since it stopped: this one waits by its
    /// own timeouts alone. Needs --data-dir.
    #[arg(long)]
    pub clear_running_record: bool,
    /// The longest lease the lease server grants: keep it equal to the server's --max-ttl.
    /// With --verify-key, a token whose lease ends later than now plus this plus
    /// --clock-skew is refused (403 token-too-long-lived), so no lease-server setting can
    /// outlive --forget-after's window.
    #[arg(long, allow_hyphen_values = true, value_name = "TTL", default_value = "24h", value_parser = parse_ttl, env = "FENCE_MAX_LEASE_TTL")]
    pub max_lease_ttl: Ttl,
    /// Test hook (feature `test-hooks`, never in a shipped binary): fence nothing, the
    /// fault-injection harness's negative control.
    #[cfg(feature = "test-hooks")]
    #[arg(long, hide = true)]
    pub unsafe_no_fence: bool,
    /// Test hook (feature `test-hooks`): after a restart, let newer tokens pass at once,
    /// forgetting what the process before may have left running upstream: the negative
    /// control of the restart hold.
    #[cfg(feature = "test-hooks")]
    #[arg(long, hide = true)]
    pub unsafe_no_restart_hold: bool,
    /// Send the client's Host header upstream instead of the upstream's authority.
    #[arg(long, value_parser = BoolishValueParser::new(), env = "FENCE_PRESERVE_HOST")]
    pub preserve_host: bool,
    /// Add no `Via: <version> fence` to forwarded requests (RFC 9110 section 7.6.3); by
    /// default the proxy names itself there, as a proxy should.
    #[arg(long, value_parser = BoolishValueParser::new(), env = "FENCE_NO_VIA")]
    pub no_via: bool,
    /// Threads serving connections, each with its own upstream connection pool; a
    /// connection stays on one thread. Default: one per CPU core.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024), env = "FENCE_WORKERS")]
    pub workers: Option<u16>,
}

/// `--upstream`'s parser. clap's own repeats a value it cannot use in its error, and an
/// upstream may carry a password (`http://user:secret@host`, even one whose `/` or space
/// keeps it from reading as user info): errors here never repeat it, and any `@` is refused
/// before the URL is read (user info is not supported).
#[derive(Clone, Copy, Debug)]
struct UpstreamParser;

impl clap::builder::TypedValueParser for UpstreamParser {
    type Value = http::Uri;

    fn parse_ref(
        &self,
        _cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<http::Uri, clap::Error> {
        use clap::error::ErrorKind;
        let refuse = |why: &str| {
            clap::Error::raw(
                ErrorKind::ValueValidation,
                format!("--upstream: {why} (the value is not repeated: it may hold a password)\n"),
            )
        };
        let text = value.to_str().ok_or_else(|| refuse("not UTF-8"))?;
        if text.contains('@') {
            return Err(refuse(
                "user info (user:password@) is not supported; give http://host:port[/prefix]",
            ));
        }
        text.parse()
            .map_err(|e| refuse(&format!("not a URL ({e}); give http://host:port[/prefix]")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_outcome_statuses_are_5xx_or_none() {
        let codes = |s: &str| {
            parse_unknown_statuses(s).map(|u| u.0.iter().map(|c| c.as_u16()).collect::<Vec<_>>())
        };
        assert_eq!(codes("502,504"), Ok(vec![502, 504]));
        assert_eq!(codes(" 504 "), Ok(vec![504]));
        assert_eq!(codes("NONE"), Ok(vec![]));
        for bad in ["", "404", "5O4", "502,,504", "600", "502;504"] {
            let e = parse_unknown_statuses(bad).expect_err(bad);
            assert!(e.contains("500 to 599"), "{bad}: {e}");
        }
    }

    #[test]
    fn unknown_outcome_grpc_statuses_are_error_codes_or_none() {
        let has = |set: fence_sink::GrpcStatuses, code: &'static str| {
            set.contains(&http::HeaderValue::from_static(code))
        };
        let set = parse_unknown_grpc_statuses("1, 4").unwrap();
        assert!(has(set, "1") && has(set, "4") && !has(set, "14") && !has(set, "0"));
        assert_eq!(
            parse_unknown_grpc_statuses("none"),
            Ok(fence_sink::GrpcStatuses::NONE)
        );
        for bad in ["", "0", "17", "1,,4", "DEADLINE_EXCEEDED", "-1"] {
            let e = parse_unknown_grpc_statuses(bad).expect_err(bad);
            assert!(e.contains("1 to 16"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_retention_keeps_answers_at_least_a_second() {
        assert!(
            parse_retention("0s")
                .unwrap_err()
                .contains("--no-idempotency")
        );
        assert!(parse_retention("999ms").is_err());
        assert_eq!(parse_retention("1s"), Ok(Duration::from_secs(1)));
    }
}
