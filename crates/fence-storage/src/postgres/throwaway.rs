//! A throwaway PostgreSQL for tests on a machine with the binaries but no server running.
//!
//! With it `cargo test --workspace` is all a newcomer runs. The first test process that needs it makes a cluster with the local `initdb` in a
//! directory under the system's temporary directory, starts it with `pg_ctl` on a free
//! loopback port (trust auth, database `test`, no fsync) and starts a watchdog beside it. Every
//! test process after it, in this test binary or the next, finds the cluster running and
//! uses it. Each holds a shared lock on the directory's `users` file for as long as it runs;
//! the watchdog stops the cluster and removes its data once nobody has held that lock for
//! [`IDLE_SECS`] seconds. One exclusive `start.lock` orders starting against stopping.
//!
//! `initdb` refuses to run as root: as root, the cluster is made and run as the `postgres`
//! user (or `nobody`), through `runuser`.

use std::{
    fs::File,
    net::{SocketAddr, TcpListener, TcpStream},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::OnceLock,
    time::Duration,
};

/// How long the cluster outlives its last user, in seconds: long enough to span the gaps
/// between test binaries (doctests compile in between), short enough to clean up soon.
pub const IDLE_SECS: u32 = 30;

/// The package names to suggest when no server binaries are found.
const INSTALL: &str = "install PostgreSQL's server binaries (Debian/Ubuntu: apt install postgresql; Fedora: dnf install postgresql-server; macOS: brew install postgresql), or set DATABASE_URL to a database the tests may use";

/// The cluster this process found or started, with its shared lock on `users` (held until
/// the process exits).
static HELD: OnceLock<Result<Cluster, String>> = OnceLock::new();

#[derive(Debug)]
struct Cluster {
    url: String,
    dir: PathBuf,
    run_as: RunAs,
    bin: PathBuf,
    _users: File,
}

/// Who runs the cluster's programs: this user, or (as root) another one through `runuser`.
#[derive(Debug, Clone)]
enum RunAs {
    Me,
    User(String),
}

impl RunAs {
    fn command(&self, program: &Path) -> Command {
        match self {
            Self::Me => Command::new(program),
            Self::User(user) => {
                let mut c = Command::new("runuser");
                c.args(["-u", user, "--"]).arg(program);
                c
            }
        }
    }

    /// The words of [`command`](Self::command), for the watchdog's shell.
    fn prefix(&self) -> String {
        match self {
            Self::Me => String::new(),
            Self::User(user) => format!("runuser -u {user} -- "),
        }
    }
}

/// The throwaway cluster's URL, starting it if no test process has yet.
///
/// # Errors
/// A message saying what is missing or what failed (with the program's output).
pub fn url() -> Result<String, String> {
    HELD.get_or_init(find_or_start)
        .as_ref()
        .map(|c| c.url.clone())
        .map_err(Clone::clone)
}

/// Restarts the throwaway cluster at once (`pg_ctl restart -m immediate`), for tests of what
/// a database restart does; `false` when this process uses no throwaway cluster or the
/// restart failed.
pub fn restart() -> bool {
    let Some(Ok(c)) = HELD.get() else {
        return false;
    };
    let data = c.dir.join("data");
    c.run_as
        .command(&c.bin.join("pg_ctl"))
        .args(["-D"])
        .arg(&data)
        .args(["-m", "immediate", "-w", "-t", "60", "restart"])
        .arg("-l")
        .arg(c.dir.join("server.log"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn find_or_start() -> Result<Cluster, String> {
    let bin = server_binaries().ok_or_else(|| {
        format!("no PostgreSQL answers on 127.0.0.1:5432, DATABASE_URL is not set, and no initdb was found to start one for the tests: {INSTALL}")
    })?;
    let run_as = if running_as_root() {
        let user = ["postgres", "nobody"]
            .into_iter()
            .find(|u| id(u, "-u").is_some())
            .ok_or("running as root, and neither a postgres nor a nobody user exists to run initdb as (it refuses root)")?;
        RunAs::User(user.to_owned())
    } else {
        RunAs::Me
    };
    let user = std::env::var("USER").unwrap_or_else(|_| "user".into());
    let dir = std::env::temp_dir().join(format!("fence-test-postgres-{user}"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let start_lock = open(&dir.join("start.lock"))?;
    start_lock
        .lock()
        .map_err(|e| format!("cannot lock {}/start.lock: {e}", dir.display()))?;
    let users = open(&dir.join("users"))?;
    users
        .lock_shared()
        .map_err(|e| format!("cannot lock {}/users: {e}", dir.display()))?;
    let url = match running_port(&dir) {
        Some(port) => {
            if !watchdog_alive(&dir) {
                spawn_watchdog(&dir, &bin, &run_as)?;
            }
            test_url(port)
        }
        None => start(&dir, &bin, &run_as)?,
    };
    drop(start_lock);
    Ok(Cluster {
        url,
        dir,
        run_as,
        bin,
        _users: users,
    })
}

fn start(dir: &Path, bin: &Path, run_as: &RunAs) -> Result<String, String> {
    let data = dir.join("data");
    // Whatever an earlier run left (it crashed, or its watchdog was killed) goes first.
    let _ = std::fs::remove_dir_all(&data);
    let _ = std::fs::remove_file(dir.join("port"));
    if let RunAs::User(user) = run_as {
        let (uid, gid) = (id(user, "-u"), id(user, "-g"));
        let (Some(uid), Some(gid)) = (uid, gid) else {
            return Err(format!("cannot look up user {user}"));
        };
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))
            .map_err(|e| format!("cannot give {} to {user}: {e}", dir.display()))?;
    }
    run(
        run_as
            .command(&bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ]),
        "initdb",
    )?;
    let port = free_port()?;
    let options = format!(
        "-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={} -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=400",
        dir.display()
    );
    // PostgreSQL's TLS tests need ssl = on; Debian's snakeoil pair serves, where readable.
    let (cert, key) = (
        "/etc/ssl/certs/ssl-cert-snakeoil.pem",
        "/etc/ssl/private/ssl-cert-snakeoil.key",
    );
    let with_ssl = format!("{options} -c ssl=on -c ssl_cert_file={cert} -c ssl_key_file={key}");
    let pg_ctl = |options: &str| {
        run(
            run_as
                .command(&bin.join("pg_ctl"))
                .arg("-D")
                .arg(&data)
                .arg("-l")
                .arg(dir.join("server.log"))
                .args(["-w", "-t", "60", "-o", options, "start"]),
            "pg_ctl start",
        )
    };
    if !(Path::new(key).exists() && pg_ctl(&with_ssl).is_ok()) {
        pg_ctl(&options)?;
    }
    run(
        run_as.command(&bin.join("createdb")).args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-U",
            "postgres",
            "test",
        ]),
        "createdb",
    )?;
    std::fs::write(dir.join("port"), port.to_string())
        .map_err(|e| format!("cannot write {}/port: {e}", dir.display()))?;
    spawn_watchdog(dir, bin, run_as)?;
    Ok(test_url(port))
}

fn test_url(port: u16) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/test")
}

/// The port of a cluster an earlier process started, if it answers.
fn running_port(dir: &Path) -> Option<u16> {
    let port: u16 = std::fs::read_to_string(dir.join("port"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    Some(port)
}

/// Starts the watchdog: once nobody has held `users` for [`IDLE_SECS`] seconds, it stops the
/// cluster and removes its data (under `start.lock`, so no process starts using it
/// meanwhile).
fn spawn_watchdog(dir: &Path, bin: &Path, run_as: &RunAs) -> Result<(), String> {
    let script = format!(
        r#"cd "$1" || exit 1
echo $$ > watchdog.pid
idle=0
while sleep 1; do
  exec 9>start.lock
  flock 9
  if flock -n -x users true; then idle=$((idle + 1)); else idle=0; fi
  if [ "$idle" -ge {IDLE_SECS} ]; then
    {prefix}"{pg_ctl}" -D "$1/data" -m immediate stop >/dev/null 2>&1
    rm -rf data port server.log watchdog.pid
    exit 0
  fi
  exec 9>&-
done"#,
        prefix = run_as.prefix(),
        pg_ctl = bin.join("pg_ctl").display(),
    );
    let mut watchdog = Command::new("sh");
    watchdog
        .args(["-c", &script, "fence-test-postgres-watchdog"])
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // Its own process group: a Ctrl-C to cargo test does not stop the cleanup.
    std::os::unix::process::CommandExt::process_group(&mut watchdog, 0);
    watchdog
        .spawn()
        .map_err(|e| format!("cannot start the throwaway PostgreSQL's watchdog (sh): {e}"))?;
    Ok(())
}

fn watchdog_alive(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("watchdog.pid"))
        .ok()
        .and_then(|pid| pid.trim().parse::<u32>().ok())
        .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists())
}

/// The directory of `initdb`, `pg_ctl` and `createdb`: on the PATH, else the newest of
/// Debian's `/usr/lib/postgresql/<version>/bin`, else what `pg_config --bindir` says.
fn server_binaries() -> Option<PathBuf> {
    let has = |dir: &Path| {
        ["initdb", "pg_ctl", "createdb"]
            .iter()
            .all(|p| dir.join(p).exists())
    };
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    if let Some(dir) = on_path.into_iter().find(|d| has(d)) {
        return Some(dir);
    }
    let mut debian: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let e = e.ok()?;
            let version = e.file_name().to_str()?.parse().ok()?;
            Some((version, e.path().join("bin")))
        })
        .filter(|(_, bin)| has(bin))
        .collect();
    debian.sort();
    if let Some((_, bin)) = debian.pop() {
        return Some(bin);
    }
    let out = Command::new("pg_config").arg("--bindir").output().ok()?;
    let dir = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    has(&dir).then_some(dir)
}

fn running_as_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// `id -u user` or `id -g user`.
fn id(user: &str, which: &str) -> Option<u32> {
    let out = Command::new("id").args([which, user]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8(out.stdout).ok()?.trim().parse().ok()
}

fn open(path: &Path) -> Result<File, String> {
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))
}

fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("cannot find a free port: {e}"))
}

/// Runs `command` to completion; an error with its output when it fails.
fn run(command: &mut Command, what: &str) -> Result<(), String> {
    let out = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {what} for the throwaway PostgreSQL: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{what} failed for the throwaway PostgreSQL ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    ))
}
