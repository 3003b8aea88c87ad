//! The `fence` command: lease server, fencing proxy, `fence run`, client calls and the demo.

use std::process::ExitCode;

use fence::{
    calls::{Call, call},
    cli::{Cmd, LogFormat},
    run,
};

/// Writes a line to stderr, ignoring a stderr that is gone (`eprintln!` would panic, and the
/// exit code would be 101 instead of the one the docs give).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

fn main() -> ExitCode {
    let cli = fence::cli::parse();
    // RUST_LOG, or the default (errors only for the demo, whose timeline log lines would cut
    // into), never with the database driver's statement parameters unless asked by name.
    let rust_log = std::env::var("RUST_LOG").ok();
    let (filter, said) =
        fence::log_filter::filter(rust_log.as_deref(), matches!(cli.command, Cmd::Demo));
    if let Some(said) = said {
        say!("{said}");
    }
    // A stderr that is gone (a pipe to a `tee` that exited) loses the lines: the subscriber
    // otherwise reports that with `eprintln!`, which panics, and the task that logged (a
    // lease's renewals under `fence run`) dies with it.
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .log_internal_errors(false);
    match cli.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            say!("fence: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    // keepalive and the watchdog read stdin on a blocking thread that may never return: the
    // runtime must not wait for it when they are done.
    let reads_stdin = matches!(cli.command, Cmd::Keepalive(_) | Cmd::Watchdog(_));
    let result = runtime.block_on(dispatch(cli.command));
    if reads_stdin {
        runtime.shutdown_background();
    }
    match result {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            let said = format!("{e:#}");
            say!("fence: {said}");
            if let Some(hint) = fence::hints::hint(&said) {
                say!("fence: hint: {hint}");
            }
            ExitCode::from(if e.is::<fence::Usage>() { 2 } else { 1 })
        }
    }
}

async fn dispatch(cmd: Cmd) -> anyhow::Result<i32> {
    match cmd {
        Cmd::Demo => fence::demo::run().await,
        Cmd::Keygen(a) => fence::keys::keygen(&a.out).map(|()| 0),
        Cmd::Server(a) => fence::serve::server(a).await.map(|()| 0),
        Cmd::Proxy(a) => fence::serve::proxy(*a).await.map(|()| 0),
        Cmd::Run(a) => {
            let a = *a;
            run::run(run::RunArgs {
                conn: a.at.conn,
                job: a.at.job,
                owner: a.owner,
                ttl: a.ttl,
                lock_delay: a.lock_delay,
                progress: a.progress_file.map(|f| (f, a.progress_within)),
                slots: a.slots,
                wait: a.wait,
                grace: a.grace,
                on_success: a.on_success,
                on_failure: a.on_failure,
                max_duration: a.max_duration.map(|d| {
                    let on = a.on_max_duration.unwrap_or(match a.on_failure {
                        fence::cli::OnFailure::Release => fence::cli::OnMaxDuration::Release,
                        fence::cli::OnFailure::Expire => fence::cli::OnMaxDuration::Expire,
                    });
                    (d, on)
                }),
                command: a.command,
            })
            .await
        }
        Cmd::Watchdog(a) => run::watchdog(a.grace, a.token_file).await,
        Cmd::Completions(a) => {
            let mut cmd = fence::cli::shown_commands();
            let mut script = Vec::new();
            clap_complete::generate(a.shell, &mut cmd, "fence", &mut script);
            print_all(&script, "the completion script")
        }
        Cmd::IdempotencyKey(a) => {
            let key = fence_core::headers::IdempotencyKey::for_step(&a.job, &a.step);
            print_all(format!("{key}\n").as_bytes(), "the idempotency key")
        }
        Cmd::Man => {
            let mut page = Vec::new();
            clap_mangen::Man::new(fence::cli::shown_commands())
                .render(&mut page)
                .map_err(|e| anyhow::anyhow!("cannot render the manual page: {e}"))?;
            print_all(&page, "the manual page")
        }
        Cmd::Leases(a) => fence::calls::leases(a).await,
        Cmd::Revoke(a) => fence::calls::revoke(a).await,
        Cmd::Claim(a) => call(Call::Claim(a)).await,
        Cmd::Renew(a) => call(Call::Renew(a)).await,
        Cmd::Release(a) => call(Call::Release(a)).await,
        Cmd::Complete(a) => call(Call::Complete(a)).await,
        Cmd::Status(a) => call(Call::Status(a.at)).await,
        Cmd::Keepalive(a) => fence::keepalive::keepalive(a).await,
        Cmd::Healthcheck(a) => fence::calls::healthcheck(a).await,
        Cmd::Tls(fence::cli::TlsCmd::Init(a)) => {
            let made = fence::tls_init::init(&a)?;
            let (what, ca_note) = if a.ca_key.is_some() {
                (
                    "a server certificate signed by the CA of --ca-cert",
                    "every client; the CA's own certificate, which they may already have",
                )
            } else {
                (
                    "a private CA and a server certificate",
                    "every client; keep ca-key.pem offline",
                )
            };
            let mut said = format!(
                "wrote {what} in {}:\n  --ca-cert {}   ({ca_note})\n  --tls-cert {} --tls-key {}   (the server or proxy)\n",
                a.dir.display(),
                made.ca.display(),
                made.cert.display(),
                made.key.display()
            );
            for (cert, key) in &made.clients {
                said.push_str(&format!(
                    "  client: {} and {}\n",
                    cert.display(),
                    key.display()
                ));
            }
            // The files are written whatever stdout does.
            print_all(said.as_bytes(), "the list of files written")
        }
    }
}

/// Writes `bytes` to stdout. A reader that closed the pipe early (`| head -1`) is no error:
/// it had what it wanted.
fn print_all(bytes: &[u8], what: &str) -> anyhow::Result<i32> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Ok(()) => Ok(0),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        Err(e) => Err(anyhow::anyhow!("cannot write {what}: {e}")),
    }
}
