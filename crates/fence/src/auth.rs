//! Who may call the lease API: the clients of `--auth-file`, their secrets and their jobs.
//!
//! One client a line: `<name> <secret> <job-pattern>... [+revoke]`. A pattern is an exact job
//! id, or a prefix ending in `*` (`*` alone: every job). Blank lines and lines starting with
//! `#` are ignored. Secrets are kept as SHA-256 hashes and compared in constant time against
//! every client, so neither the answer nor its timing tells which client came closest; they
//! never appear in an error, a log line or a metric.
//!
//! ```
//! use fence::auth::AuthFile;
//!
//! let file = AuthFile::parse("billing s3cr3t-0123456789abcdef invoice-* reports\n")?;
//! let client = file.identify(b"s3cr3t-0123456789abcdef").expect("known");
//! assert_eq!(client.name(), "billing");
//! assert!(client.may(&"invoice-42".parse()?) && !client.may(&"payroll".parse()?));
//! assert!(file.identify(b"guess").is_none());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::{
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
};

use fence_core::{JobId, secret::SecretHash};

/// A client of the lease API.
#[derive(Debug)]
pub struct Client {
    name: String,
    secret: SecretHash,
    patterns: Vec<Pattern>,
    revoke: bool,
}

/// Which jobs a client may touch.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Pattern {
    Exact(JobId),
    Prefix(String),
}

impl Client {
    /// The client's name, for logs (never its secret).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the client may act on `job`.
    pub fn may(&self, job: &JobId) -> bool {
        self.patterns.iter().any(|p| match p {
            Pattern::Exact(j) => j == job,
            Pattern::Prefix(prefix) => job.as_str().starts_with(prefix.as_str()),
        })
    }

    /// What part of the job id space the client may list within `prefix` (every job when
    /// `None`): one scope per pattern that overlaps it, so a listing never reads, and never
    /// names in its `next` cursor, a job outside the client's patterns.
    pub fn scopes(&self, prefix: Option<&str>) -> Vec<Scope> {
        let q = prefix.unwrap_or_default();
        let mut scopes = Vec::new();
        for pattern in &self.patterns {
            match pattern {
                Pattern::Prefix(p) if q.starts_with(p.as_str()) => {
                    // The whole query range is visible: one scope is all it takes.
                    return vec![Scope::Prefix(q.to_owned())];
                }
                Pattern::Prefix(p) if p.starts_with(q) => scopes.push(Scope::Prefix(p.clone())),
                Pattern::Exact(j) if j.as_str().starts_with(q) => {
                    scopes.push(Scope::Exact(j.clone()))
                }
                _ => {}
            }
        }
        scopes
    }

    /// Whether the client may revoke leases (`+revoke` at the end of its line).
    pub fn may_revoke(&self) -> bool {
        self.revoke
    }
}

/// A part of the job id space a client may see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every job whose id starts with this.
    Prefix(String),
    /// This one job.
    Exact(JobId),
}

/// The parsed clients of an auth file.
#[derive(Debug, Default)]
pub struct AuthFile {
    clients: Vec<Client>,
}

/// Why an auth file was refused; it names the line, never the secret on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthFileError {
    /// The file cannot be read.
    #[error("auth file {}: cannot read it", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Group or others may read the file.
    #[error("auth file {}: it is readable by group or others (mode {mode:o}); it holds secrets: chmod 600 it", path.display())]
    Exposed {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A line does not parse.
    #[error("auth file{}, line {line}: {reason}", path.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default())]
    Line {
        /// The file, once known.
        path: Option<PathBuf>,
        /// The line number, from 1.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// No client at all: nobody could call the API.
    #[error("auth file{}: no client in it; write one line per client: <name> <secret> <job-pattern>...", path.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default())]
    Empty {
        /// The file, once known.
        path: Option<PathBuf>,
    },
}

impl AuthFileError {
    fn in_file(self, file: &Path) -> Self {
        match self {
            Self::Line { line, reason, .. } => Self::Line {
                path: Some(file.to_owned()),
                line,
                reason,
            },
            Self::Empty { .. } => Self::Empty {
                path: Some(file.to_owned()),
            },
            other => other,
        }
    }
}

/// The shortest secret a client may have.
pub const MIN_SECRET_LEN: usize = 16;

/// The longest secret a client may have: fence's own clients send at most this many.
pub const MAX_SECRET_LEN: usize = 256;

impl AuthFile {
    /// Parses the text of an auth file.
    ///
    /// # Errors
    /// On the first line that does not parse (a missing pattern, a secret shorter than 16
    /// characters, a name or secret used twice, a pattern that is not a job id), or when no
    /// client is left.
    pub fn parse(text: &str) -> Result<Self, AuthFileError> {
        let mut clients: Vec<Client> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let bad = |reason: String| AuthFileError::Line {
                path: None,
                line: n + 1,
                reason,
            };
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut words = line.split_ascii_whitespace();
            let (Some(name), Some(secret)) = (words.next(), words.next()) else {
                return Err(bad(
                    "expected <name> <secret> <job-pattern>... [+revoke]".into()
                ));
            };
            // A line without its name reads the secret as the name, and a job pattern as
            // the secret: the pattern would then let in whoever guesses it, and the real
            // secret would be logged and answered as a client's name. Refused where it shows.
            if secret.ends_with('*') && secret.matches('*').count() == 1 {
                return Err(bad(
                    "the second word ends in '*' like a job pattern: is the client's name missing? (expected <name> <secret> <job-pattern>...; a secret of your own that ends in '*' must be changed)".into(),
                ));
            }
            if name.len() >= MIN_SECRET_LEN && name.ends_with('=') {
                return Err(bad(
                    "the first word is as long as a secret and ends in '=' like a base64 one: is the client's name missing? (expected <name> <secret> <job-pattern>...)".into(),
                ));
            }
            if secret.len() > MAX_SECRET_LEN {
                return Err(bad(format!(
                    "the secret (the second word) is {} characters; at most {MAX_SECRET_LEN} are sent by fence clients",
                    secret.len()
                )));
            }
            if secret.len() < MIN_SECRET_LEN {
                return Err(bad(format!(
                    "the secret (the second word) is {} characters; use at least {MIN_SECRET_LEN} random ones (head -c 32 /dev/urandom | base64)",
                    secret.len()
                )));
            }
            let mut patterns = Vec::new();
            let mut revoke = false;
            for word in words {
                if word.starts_with('#') {
                    // A job id may hold '#': a trailing comment would be read as patterns.
                    return Err(bad(format!(
                        "{word:?}: a comment takes a line of its own (starting with #); a pattern cannot start with #"
                    )));
                }
                if revoke {
                    return Err(bad(format!(
                        "{word:?} after +revoke: +revoke ends the line (name secret patterns... +revoke)"
                    )));
                }
                if word == "+revoke" {
                    revoke = true;
                } else if let Some(prefix) = word.strip_suffix('*') {
                    if prefix.contains('*') {
                        return Err(bad(format!("pattern {word:?}: '*' may only end a pattern")));
                    }
                    patterns.push(Pattern::Prefix(prefix.to_owned()));
                } else if word.contains('*') {
                    return Err(bad(format!("pattern {word:?}: '*' may only end a pattern")));
                } else {
                    let job =
                        JobId::new(word).map_err(|e| bad(format!("pattern {word:?}: {e}")))?;
                    patterns.push(Pattern::Exact(job));
                }
            }
            if patterns.is_empty() {
                return Err(bad(
                    "the client has no job pattern (expected <name> <secret> <job-pattern>...); give at least one (* for every job)".into(),
                ));
            }
            let secret = SecretHash::of(secret.as_bytes());
            if clients.iter().any(|c| c.name == name) {
                return Err(bad(format!("client {name} appears twice")));
            }
            if clients.iter().any(|c| c.secret == secret) {
                return Err(bad(format!(
                    "client {name} has the secret of another client; give each its own"
                )));
            }
            clients.push(Client {
                name: name.to_owned(),
                secret,
                patterns,
                revoke,
            });
        }
        if clients.is_empty() {
            return Err(AuthFileError::Empty { path: None });
        }
        Ok(Self { clients })
    }

    /// Reads and parses `path`, which only its owner may read.
    ///
    /// # Errors
    /// As [`parse`](Self::parse), naming the file, and when it cannot be read or its group or
    /// others can.
    pub fn load(path: &Path) -> Result<Self, AuthFileError> {
        let read = |source| AuthFileError::Read {
            path: path.to_owned(),
            source,
        };
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(path).map_err(read)?.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(AuthFileError::Exposed {
                    path: path.to_owned(),
                    mode,
                });
            }
        }
        let text = std::fs::read_to_string(path).map_err(read)?;
        Self::parse(&text).map_err(|e| e.in_file(path))
    }

    /// The client whose secret is `secret`, comparing against every client in constant time.
    pub fn identify(&self, secret: &[u8]) -> Option<&Client> {
        self.index_of(secret).map(|i| &self.clients[i])
    }

    /// Where [`identify`](Self::identify)'s client stands in the file.
    pub fn index_of(&self, secret: &[u8]) -> Option<usize> {
        let presented = SecretHash::of(secret);
        // No early exit: every client is compared, whatever matched.
        let mut found = None;
        for (i, client) in self.clients.iter().enumerate() {
            if client.secret == presented {
                found = Some(i);
            }
        }
        found
    }

    /// The client at `index` (from [`index_of`](Self::index_of)).
    ///
    /// # Panics
    /// When `index` is out of range.
    pub fn client(&self, index: usize) -> &Client {
        &self.clients[index]
    }

    /// How many clients there are.
    pub fn len(&self) -> usize {
        self.clients.len()
    }

    /// Whether there are none (never, for a parsed file).
    pub fn is_empty(&self) -> bool {
        self.clients.is_empty()
    }
}

/// The bearer secret of `headers`: exactly one `Authorization: Bearer <secret>`, not empty.
pub fn bearer_secret(headers: &http::HeaderMap) -> Option<&[u8]> {
    let mut values = headers.get_all(http::header::AUTHORIZATION).iter();
    let secret = match (values.next(), values.next()) {
        (Some(value), None) => value
            .as_bytes()
            .split_at_checked(7)
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case(b"bearer "))
            .map(|(_, secret)| secret.trim_ascii()),
        _ => None,
    };
    secret.filter(|s| !s.is_empty())
}

/// The current auth file of a server, reloaded on SIGHUP.
#[derive(Debug, Clone)]
pub struct Auth {
    path: PathBuf,
    current: Arc<RwLock<Arc<AuthFile>>>,
}

impl Auth {
    /// Loads `path`.
    ///
    /// # Errors
    /// As [`AuthFile::load`].
    pub fn load(path: &Path) -> Result<Self, AuthFileError> {
        Ok(Self {
            path: path.to_owned(),
            current: Arc::new(RwLock::new(Arc::new(AuthFile::load(path)?))),
        })
    }

    /// Whether `headers` carry exactly one `Authorization: Bearer <secret>` with a secret
    /// of the file as of now.
    pub fn knows(&self, headers: &http::HeaderMap) -> bool {
        self.name_of(headers).is_some()
    }

    /// The name of the client whose secret `headers` carry, if one does.
    pub fn name_of(&self, headers: &http::HeaderMap) -> Option<String> {
        let secret = bearer_secret(headers)?;
        let file = self.current();
        file.index_of(secret)
            .map(|i| file.client(i).name().to_owned())
    }

    /// The clients as of now.
    pub fn current(&self) -> Arc<AuthFile> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Reads the file again; a file that does not load keeps the clients as they were, and
    /// the error says why.
    ///
    /// # Errors
    /// As [`AuthFile::load`].
    pub fn reload(&self) -> Result<usize, AuthFileError> {
        let file = AuthFile::load(&self.path)?;
        let clients = file.len();
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(file);
        Ok(clients)
    }

    /// Reloads on every SIGHUP until the process ends, logging what happened.
    ///
    /// # Errors
    /// When the signal handler cannot be installed.
    pub fn reload_on_sighup(&self) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
        let auth = self.clone();
        Ok(tokio::spawn(async move {
            while hup.recv().await.is_some() {
                match auth.reload() {
                    Ok(clients) => {
                        tracing::info!(clients, path = %auth.path.display(), "auth file reloaded")
                    }
                    Err(e) => {
                        tracing::warn!(error = %fence_storage::error_chain(&e), "auth file not reloaded; the clients stay as they were")
                    }
                }
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_and_bad_ones_say_where_without_the_secret() {
        let file = AuthFile::parse(
            "# clients\n\nops 0123456789abcdef-ops * +revoke\nbilling 0123456789abcdef-bill inv-* x\n",
        )
        .unwrap();
        assert_eq!(file.len(), 2);
        let ops = file.identify(b"0123456789abcdef-ops").unwrap();
        assert!(ops.may_revoke() && ops.may(&"anything".parse().unwrap()));
        let billing = file.identify(b"0123456789abcdef-bill").unwrap();
        assert!(!billing.may_revoke());
        assert!(billing.may(&"inv-1".parse().unwrap()) && billing.may(&"x".parse().unwrap()));
        assert!(!billing.may(&"xy".parse().unwrap()) && !billing.may(&"in".parse().unwrap()));
        assert!(file.identify(b"0123456789abcdef").is_none());
        for (text, want) in [
            ("a", "line 1: expected"),
            ("a 0123456789abcdef", "no job pattern"),
            ("a short *", "is 5 characters"),
            ("a 0123456789abcdef a*b", "'*' may only end"),
            ("a 0123456789abcdef * +revoke x", "+revoke ends the line"),
            (
                "# ok\na 0123456789abcdef * # billing",
                "line 2: \"#\": a comment takes a line of its own",
            ),
            (&format!("a {} *", "s".repeat(257)), "at most 256"),
            ("a 0123456789abcdef \u{7f}", "pattern"),
            (
                "a 0123456789abcdef *\nb 0123456789abcdef *",
                "line 2: client b has the secret",
            ),
            (
                "a 0123456789abcdef *\na 0123456789abcdeX *",
                "line 2: client a appears twice",
            ),
            ("# nothing\n", "no client"),
            // The name left out: the secret stands where the name goes, and is not echoed.
            (
                "0123456789abcdef-secret inv-*",
                "is the client's name missing",
            ),
            (
                "0123456789abcdef-secret invoice-reports-2024-*",
                "is the client's name missing",
            ),
            (
                "0123456789abcdef-secret invoice-reports-2024-* payroll-*",
                "is the client's name missing",
            ),
            (
                "MDEyMzQ1Njc4OWFiY2RlZg== payroll-7-0123456789 other-job",
                "ends in '=' like a base64 one",
            ),
        ] {
            let e = AuthFile::parse(text).unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
            assert!(!e.contains("0123456789abcde"), "a secret leaked: {e}");
        }
        // A secret holding '*' other than as a pattern's end, and a short name ending in
        // '=', are a name and a secret as written.
        let file = AuthFile::parse("team= 0123456789*abcdef-sec *").unwrap();
        assert!(file.identify(b"0123456789*abcdef-sec").is_some());
    }
}
