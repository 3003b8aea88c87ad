//! The password of a connection string that has none, found as libpq finds it.

use std::path::PathBuf;

/// The password of a `.pgpass`-format file for this host, port, database and user (`*`
/// matches anything; `\:` and `\\` are escapes), as libpq reads it.
pub(super) fn passfile_password(
    text: &str,
    host: &str,
    port: u16,
    db: &str,
    user: &str,
) -> Option<String> {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .find_map(|line| {
            let mut fields = Vec::new();
            let mut cur = String::new();
            let mut chars = line.chars();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => cur.extend(chars.next()),
                    ':' if fields.len() < 4 => fields.push(std::mem::take(&mut cur)),
                    c => cur.push(c),
                }
            }
            fields.push(cur);
            let [h, p, d, u, password] = <[String; 5]>::try_from(fields).ok()?;
            let port = port.to_string();
            let fits = |pattern: &str, value: &str| pattern == "*" || pattern == value;
            (fits(&h, host) && fits(&p, &port) && fits(&d, db) && fits(&u, user))
                .then_some(password)
        })
}

/// The password for `config` when the string has none: `PGPASSWORD`, else the passfile
/// (`passfile=`, `PGPASSFILE`, or `~/.pgpass`), as libpq does.
pub(super) fn fill_password(config: &mut tokio_postgres::Config, passfile: Option<PathBuf>) {
    if config.get_password().is_some() {
        return;
    }
    if let Ok(password) = std::env::var("PGPASSWORD") {
        config.password(password);
        return;
    }
    let file = passfile
        .or_else(|| std::env::var_os("PGPASSFILE").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".pgpass")));
    let Some(text) = file.and_then(|f| std::fs::read_to_string(f).ok()) else {
        return;
    };
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "localhost".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let user = config.get_user().unwrap_or_default().to_owned();
    let db = config.get_dbname().unwrap_or(&user).to_owned();
    if let Some(password) = passfile_password(&text, &host, port, &db, &user) {
        config.password(password);
    }
}
