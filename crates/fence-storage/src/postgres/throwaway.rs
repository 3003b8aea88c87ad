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
//! user (or `nobody`), through `runuser`; the directory itself stays root's, and only the
//! cluster's `data` and `run` (its socket) are that user's. The directory is named by user
//! id, must be the user's own and not writable by others, and the cluster asks for a random
//! password (scram) even on loopback, so other local users cannot use it. Linux only (it reads
//! `/proc` and uses util-linux's `flock`).

use std::{
    fs::File,
    net::TcpListener,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::OnceLock,
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

impl Cluster {
    fn pg_ctl(&self) -> Command {
        let mut c = self.run_as.command(&self.bin.join("pg_ctl"));
        c.arg("-D").arg(self.dir.join("data"));
        c
    }
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

    /// The user for the watchdog (`-` for this one).
    fn name(&self) -> &str {
        match self {
            Self::Me => "-",
            Self::User(user) => user,
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

/// Restarts the throwaway cluster at once (`pg_ctl restart -m immediate`, a crash and
/// recovery), for tests of what a database restart does: `None` when this process uses no throwaway cluster, else whether
/// the restart succeeded. It holds `start.lock` meanwhile, so no other process takes the
/// stopped cluster for a missing one.
pub fn restart() -> Option<bool> {
    let Some(Ok(c)) = HELD.get() else {
        return None;
    };
    let Ok(lock) = open(&c.dir.join("start.lock")) else {
        return Some(false);
    };
    if lock.lock().is_err() {
        return Some(false);
    }
    let done = c
        .pg_ctl()
        .arg("-l")
        .arg(c.dir.join("run/server.log"))
        .args(["-m", "immediate", "-w", "-t", "60", "restart"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    Some(done)
}

fn find_or_start() -> Result<Cluster, String> {
    let bin = server_binaries().ok_or_else(|| {
        format!("no PostgreSQL answers on 127.0.0.1:5432, DATABASE_URL is not set, and no initdb was found to start one for the tests: {INSTALL}")
    })?;
    if Command::new("flock").arg("--version").output().is_err() {
        return Err("the throwaway PostgreSQL needs util-linux's flock (apt install util-linux), or set DATABASE_URL".into());
    }
    let me =
        my_uid().ok_or("the throwaway PostgreSQL needs Linux's /proc (or set DATABASE_URL)")?;
    let run_as = if me == 0 {
        let user = ["postgres", "nobody"]
            .into_iter()
            .find(|u| id(u, "-u").is_some())
            .ok_or("running as root, and neither a postgres nor a nobody user exists to run initdb as (it refuses root)")?;
        RunAs::User(user.to_owned())
    } else {
        RunAs::Me
    };
    let dir = std::env::temp_dir().join(format!("fence-test-postgres-{me}"));
    own_dir(&dir, me, if me == 0 { 0o755 } else { 0o700 })?;
    let start_lock = open(&dir.join("start.lock"))?;
    start_lock
        .lock()
        .map_err(|e| format!("cannot lock {}/start.lock: {e}", dir.display()))?;
    let users = open(&dir.join("users"))?;
    users
        .lock_shared()
        .map_err(|e| format!("cannot lock {}/users: {e}", dir.display()))?;
    let mut cluster = Cluster {
        url: String::new(),
        dir,
        run_as,
        bin,
        _users: users,
    };
    cluster.url = match running(&cluster) {
        Some(url) => {
            if !watchdog_alive(&cluster.dir) {
                spawn_watchdog(&cluster)?;
            }
            url
        }
        None => start(&cluster)?,
    };
    drop(start_lock);
    Ok(cluster)
}

/// The URL of the cluster an earlier process started, when `pg_ctl status` says it runs.
fn running(c: &Cluster) -> Option<String> {
    let up = c
        .pg_ctl()
        .arg("status")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !up {
        return None;
    }
    let port = std::fs::read_to_string(c.dir.join("port")).ok()?;
    let password = std::fs::read_to_string(c.dir.join("password")).ok()?;
    Some(test_url(port.trim().parse().ok()?, password.trim()))
}

fn start(c: &Cluster) -> Result<String, String> {
    let (dir, data, run_dir) = (&c.dir, c.dir.join("data"), c.dir.join("run"));
    // A cluster that is not running is leftovers (a crash, a killed watchdog): start over.
    let _ = c
        .pg_ctl()
        .args(["-m", "immediate", "stop"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    for leftover in [&data, &run_dir] {
        let _ = std::fs::remove_dir_all(leftover);
    }
    for file in ["port", "password"] {
        let _ = std::fs::remove_file(dir.join(file));
    }
    for sub in [&data, &run_dir] {
        std::fs::create_dir(sub).map_err(|e| format!("cannot create {}: {e}", sub.display()))?;
        set_mode(sub, 0o700)?;
        if let RunAs::User(user) = &c.run_as {
            let (Some(uid), Some(gid)) = (id(user, "-u"), id(user, "-g")) else {
                return Err(format!("cannot look up user {user}"));
            };
            std::os::unix::fs::chown(sub, Some(uid), Some(gid))
                .map_err(|e| format!("cannot give {} to {user}: {e}", sub.display()))?;
        }
    }
    let password = random_hex()?;
    let pwfile = run_dir.join("pwfile");
    std::fs::write(&pwfile, format!("{password}\n"))
        .map_err(|e| format!("cannot write {}: {e}", pwfile.display()))?;
    if let RunAs::User(user) = &c.run_as {
        let (uid, gid) = (id(user, "-u"), id(user, "-g"));
        let _ = std::os::unix::fs::chown(&pwfile, uid, gid);
    }
    let made = run(
        c.run_as
            .command(&c.bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .arg(format!("--pwfile={}", pwfile.display()))
            .args([
                "-A",
                "scram-sha-256",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ]),
        "initdb",
    );
    let _ = std::fs::remove_file(&pwfile);
    made?;
    let port = free_port()?;
    // fsync off: the cluster lives for one test run and the machine is not expected to
    // crash under it. Commits stay synchronous, though: a commit is in the WAL before it is
    // answered, so a crash of PostgreSQL itself (the restart tests' `immediate`) loses none.
    let options = format!(
        "-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={} -c fsync=off -c max_connections=400",
        run_dir.display()
    );
    // PostgreSQL's TLS tests need ssl = on; Debian's snakeoil pair serves, where readable.
    let (cert, key) = (
        "/etc/ssl/certs/ssl-cert-snakeoil.pem",
        "/etc/ssl/private/ssl-cert-snakeoil.key",
    );
    let with_ssl = format!("{options} -c ssl=on -c ssl_cert_file={cert} -c ssl_key_file={key}");
    let pg_start = |options: &str| {
        run(
            c.pg_ctl()
                .arg("-l")
                .arg(run_dir.join("server.log"))
                .args(["-w", "-t", "60", "-o", options, "start"]),
            "pg_ctl start",
        )
    };
    if !(Path::new(key).exists() && pg_start(&with_ssl).is_ok()) {
        pg_start(&options)?;
    }
    // From here on a failure stops the server again: nothing is left running unwatched.
    let finish = || -> Result<(), String> {
        run(
            c.run_as
                .command(&c.bin.join("createdb"))
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &port.to_string(),
                    "-U",
                    "postgres",
                    "test",
                ])
                .env("PGPASSWORD", &password),
            "createdb",
        )?;
        write_private(&dir.join("password"), &password)?;
        write_private(&dir.join("port"), &port.to_string())?;
        spawn_watchdog(c)
    };
    if let Err(e) = finish() {
        let _ = c.pg_ctl().args(["-m", "immediate", "stop"]).output();
        return Err(e);
    }
    Ok(test_url(port, &password))
}

fn test_url(port: u16, password: &str) -> String {
    format!("postgres://postgres:{password}@127.0.0.1:{port}/test")
}

/// Starts the watchdog: once nobody has held `users` for [`IDLE_SECS`] seconds, it stops the
/// cluster and removes its data (under `start.lock`, so no process starts using it
/// meanwhile). Its pid goes to `watchdog.pid` before `start.lock` is let go.
fn spawn_watchdog(c: &Cluster) -> Result<(), String> {
    // Everything variable comes in as an argument: nothing is spliced into the script.
    let script = format!(
        r#"dir=$1 pg_ctl=$2 user=$3
cd "$dir" || exit 1
idle=0
while sleep 1; do
  exec 9<start.lock
  flock 9 || exit 1
  if flock -n -x users true; then idle=$((idle + 1)); else idle=0; fi
  if [ "$idle" -ge {IDLE_SECS} ]; then
    if [ "$user" = - ]; then "$pg_ctl" -D "$dir/data" -m immediate stop
    else runuser -u "$user" -- "$pg_ctl" -D "$dir/data" -m immediate stop; fi >/dev/null 2>&1
    rm -rf data run port password watchdog.pid
    exit 0
  fi
  exec 9<&-
done"#
    );
    let mut watchdog = Command::new("sh");
    watchdog
        .args(["-c", &script, "fence-test-postgres-watchdog"])
        .arg(&c.dir)
        .arg(c.bin.join("pg_ctl"))
        .arg(c.run_as.name())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // Its own process group: a Ctrl-C to cargo test does not stop the cleanup.
    std::os::unix::process::CommandExt::process_group(&mut watchdog, 0);
    let child = watchdog
        .spawn()
        .map_err(|e| format!("cannot start the throwaway PostgreSQL's watchdog (sh): {e}"))?;
    write_private(&c.dir.join("watchdog.pid"), &child.id().to_string())
}

fn watchdog_alive(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("watchdog.pid"))
        .ok()
        .and_then(|pid| pid.trim().parse::<u32>().ok())
        .is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists())
}

/// Makes `dir` if it is missing; either way it must be a directory (not a link) of `uid`
/// that nobody else can write, with `mode`.
fn own_dir(dir: &Path, uid: u32, mode: u32) -> Result<(), String> {
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let ours = meta.file_type().is_dir() && meta.uid() == uid;
    if !ours {
        return Err(format!(
            "{} is not a directory of user {uid}: remove it, or set DATABASE_URL",
            dir.display()
        ));
    }
    set_mode(dir, mode)
}

fn set_mode(path: &Path, mode: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("cannot set the mode of {}: {e}", path.display()))
}

/// Writes a file only this user can read.
fn write_private(path: &Path, text: &str) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(O_NOFOLLOW)
        .open(path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()));
    written.map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// `O_NOFOLLOW` on Linux: a link where a file is expected is refused, not followed.
const O_NOFOLLOW: i32 = 0o400_000;

fn random_hex() -> Result<String, String> {
    use std::io::Read as _;
    let mut bytes = [0u8; 16];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| format!("cannot read /dev/urandom: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn my_uid() -> Option<u32> {
    std::fs::metadata("/proc/self").ok().map(|m| m.uid())
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

/// `id -u user` or `id -g user`.
fn id(user: &str, which: &str) -> Option<u32> {
    let out = Command::new("id").args([which, user]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8(out.stdout).ok()?.trim().parse().ok()
}

fn open(path: &Path) -> Result<File, String> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o644)
        .custom_flags(O_NOFOLLOW)
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
