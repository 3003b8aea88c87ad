//! `fence tls init`: a private CA and the certificates servers, proxies and clients need.
//!
//! One command, as `consul tls ca create` and `consul tls cert create` are two.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    time::{SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use crate::cli::TlsInitCmd;

/// What `init` wrote, for its summary and tests.
#[derive(Debug)]
pub struct Made {
    /// The CA's certificate: every client's `--ca-cert`.
    pub ca: PathBuf,
    /// The server certificate: `--tls-cert`.
    pub cert: PathBuf,
    /// Its key: `--tls-key`.
    pub key: PathBuf,
    /// Each client certificate and its key.
    pub clients: Vec<(PathBuf, PathBuf)>,
}

/// `fence tls init DIR`: writes `ca.pem` and `ca-key.pem` (a CA of its own, valid ten years),
/// `server.pem` and `server-key.pem` (for `--names` and `--ips`, valid `--days`), and
/// `client-NAME.pem` with `client-NAME-key.pem` for each `--client`. Keys are ECDSA P-256,
/// mode 0600. Nothing is ever overwritten: a file already there stops it before anything is
/// written.
///
/// # Errors
/// A usage error for a name that cannot be in a certificate or a file already there; an
/// error when a file cannot be written.
pub fn init(a: &TlsInitCmd) -> anyhow::Result<Made> {
    let dir = &a.dir;
    let file = |name: &str| dir.join(name);
    let mut wanted = vec![
        file("ca.pem"),
        file("ca-key.pem"),
        file("server.pem"),
        file("server-key.pem"),
    ];
    // `--client a --client a` is one client, not a second write that fails after the rest.
    let mut client_names: Vec<&String> = Vec::new();
    for client in &a.client {
        if !client_names.contains(&client) {
            client_names.push(client);
        }
    }
    for client in &client_names {
        check_client_name(client)?;
        wanted.push(file(&format!("client-{client}.pem")));
        wanted.push(file(&format!("client-{client}-key.pem")));
    }
    if let Some(there) = wanted.iter().find(|p| p.exists()) {
        return Err(crate::Usage::error(format!(
            "{} is already there: fence tls init never overwrites; give another directory",
            there.display()
        )));
    }
    // The machine itself is always named too: a health check, `fence healthcheck` or an
    // operator's curl on the server's own host then works without a name of its own.
    let mut names = a.name.clone();
    if !names.iter().any(|n| n.eq_ignore_ascii_case("localhost")) {
        names.push("localhost".into());
    }
    let mut ips = a.ip.clone();
    for local in [
        IpAddr::from([127, 0, 0, 1]),
        IpAddr::from([0u16, 0, 0, 0, 0, 0, 0, 1]),
    ] {
        if !ips.contains(&local) {
            ips.push(local);
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;

    let ca_key = KeyPair::generate().context("making the CA's key")?;
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.distinguished_name
        .push(DnType::CommonName, "fence private CA");
    set_validity(&mut ca, 3650);
    let ca_cert = ca.self_signed(&ca_key).context("signing the CA")?;
    let issuer = Issuer::new(ca, ca_key);

    let mut server = CertificateParams::default();
    server.distinguished_name.push(
        DnType::CommonName,
        names.first().cloned().unwrap_or_else(|| "fence".into()),
    );
    for name in &names {
        let san = SanType::DnsName(name.clone().try_into().map_err(|e| {
            crate::Usage::error(format!("--name {name:?} cannot be in a certificate: {e}"))
        })?);
        server.subject_alt_names.push(san);
    }
    server
        .subject_alt_names
        .extend(ips.iter().map(|ip| SanType::IpAddress(*ip)));
    server.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    set_validity(&mut server, a.days);
    let server_key = KeyPair::generate().context("making the server's key")?;
    let server_cert = server
        .signed_by(&server_key, &issuer)
        .context("signing the server certificate")?;

    write(&file("ca.pem"), &ca_cert.pem(), false)?;
    write(&file("ca-key.pem"), &issuer.key().serialize_pem(), true)?;
    write(&file("server.pem"), &server_cert.pem(), false)?;
    write(&file("server-key.pem"), &server_key.serialize_pem(), true)?;
    let mut clients = Vec::new();
    for client in client_names {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, client);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        set_validity(&mut params, a.days);
        let key = KeyPair::generate().context("making a client's key")?;
        let cert = params
            .signed_by(&key, &issuer)
            .with_context(|| format!("signing the certificate of client {client}"))?;
        let (c, k) = (
            file(&format!("client-{client}.pem")),
            file(&format!("client-{client}-key.pem")),
        );
        write(&c, &cert.pem(), false)?;
        write(&k, &key.serialize_pem(), true)?;
        clients.push((c, k));
    }
    Ok(Made {
        ca: file("ca.pem"),
        cert: file("server.pem"),
        key: file("server-key.pem"),
        clients,
    })
}

/// A client's name becomes part of a file name: letters, digits, `-`, `_` and `.`.
fn check_client_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(crate::Usage::error(format!(
            "--client {name:?}: a client's name is 1 to 64 of a-z, A-Z, 0-9, '-', '_' and '.' (not starting with '.')"
        )))
    }
}

/// Valid from a day ago (clocks that lag a little still accept it) to `days` from now.
fn set_validity(params: &mut CertificateParams, days: u32) {
    let today = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400);
    let (y, m, d) = civil(today.saturating_sub(1));
    params.not_before = rcgen::date_time_ymd(y, m, d);
    let (y, m, d) = civil(today + u64::from(days));
    params.not_after = rcgen::date_time_ymd(y, m, d);
}

/// The date (year, month, day) `days` after 1970-01-01 (Howard Hinnant's civil-from-days).
fn civil(days: u64) -> (i32, u8, u8) {
    let z = i64::try_from(days).unwrap_or(i64::MAX / 2) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (
        i32::try_from(year).unwrap_or(9999),
        u8::try_from(month).unwrap_or(1),
        u8::try_from(day).unwrap_or(1),
    )
}

/// Writes `text` to a new file (never over one), mode 0600 when `private`.
fn write(path: &Path, text: &str, private: bool) -> anyhow::Result<()> {
    use std::{io::Write, os::unix::fs::OpenOptionsExt};
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::civil;

    #[test]
    fn days_since_the_epoch_are_dates() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(59), (1970, 3, 1));
        assert_eq!(civil(11_016), (2000, 2, 29));
        assert_eq!(civil(20_790), (2026, 12, 3));
    }
}
