//! `fence tls init`: a private CA and the certificates servers, proxies and clients need.
//!
//! One command, as `consul tls ca create` and `consul tls cert create` are two.

use std::{
    net::IpAddr,
    os::unix::fs::{DirBuilderExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::Arc,
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
/// mode 0600. With `--ca-cert` and `--ca-key` the certificates are signed by that CA
/// instead: its certificate is copied as `ca.pem` and no `ca-key.pem` is written. Nothing is
/// ever overwritten: a file already there stops it before anything is written.
///
/// # Errors
/// A usage error for a name that cannot be in a certificate, a file already there, or a
/// `--ca-cert`/`--ca-key` that is unreadable, not a CA valid today, not the pair's key
/// (PKCS#8 PEM, as `tls init` writes), or ending before `--days` would; an error when a
/// file cannot be written.
pub fn init(a: &TlsInitCmd) -> anyhow::Result<Made> {
    let dir = &a.dir;
    let file = |name: &str| dir.join(name);
    let mut wanted = vec![file("ca.pem"), file("server.pem"), file("server-key.pem")];
    if a.ca_key.is_none() {
        wanted.push(file("ca-key.pem"));
    }
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
    // `--client a --client a-key`: client-a-key.pem would be a's key and a-key's
    // certificate, and the second write would fail with half of DIR written.
    for (i, path) in wanted.iter().enumerate() {
        if wanted[..i].contains(path) {
            return Err(crate::Usage::error(format!(
                "{} would be written twice (as one client's key and another's certificate): rename a --client",
                path.display()
            )));
        }
    }
    // A link is there too, even one that leads nowhere: writing would fail on it later.
    if let Some(there) = wanted.iter().find(|p| p.symlink_metadata().is_ok()) {
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

    let (issuer, ca_pem, ca_key_pem) = match (&a.ca_cert, &a.ca_key) {
        (Some(cert), Some(key)) => {
            let (issuer, pem, days_left) = existing_ca(cert, key)?;
            if i64::from(a.days) > days_left {
                return Err(crate::Usage::error(format!(
                    "--ca-cert {}: the CA ends in {days_left} days, before a certificate of --days {} would; give --days {days_left} or less, or make a new CA",
                    cert.display(),
                    a.days
                )));
            }
            (issuer, pem, None)
        }
        _ => {
            let (issuer, pem) = new_ca()?;
            let key = issuer.key().serialize_pem();
            (issuer, pem, Some(key))
        }
    };
    // Nobody else may write in it (replace ca.pem or server.pem), whatever the umask.
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .with_context(|| format!("cannot create {}", dir.display()))?;
    // One that was there already is checked: whoever may write in it may replace the
    // certificates (and read the keys through a link planted before they are written).
    let meta = std::fs::metadata(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    let mode = meta.permissions().mode();
    // Its owner may chmod it, and replace what is written, as well.
    let (owner, me) = (
        std::os::unix::fs::MetadataExt::uid(&meta),
        nix::unistd::geteuid().as_raw(),
    );
    if owner != me && owner != 0 {
        return Err(crate::Usage::error(format!(
            "{}: owned by uid {owner}, not by this user (uid {me}) or root, who could replace ca.pem or server.pem; name a directory of your own",
            dir.display()
        )));
    }
    if mode & 0o022 != 0 {
        return Err(crate::Usage::error(format!(
            "{}: group or others may write in it (mode {:o}), and so replace ca.pem or server.pem; chmod go-w it, or name another directory",
            dir.display(),
            mode & 0o7777
        )));
    }

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
    server.use_authority_key_identifier_extension = true;
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    set_validity(&mut server, a.days);
    let server_key = KeyPair::generate().context("making the server's key")?;
    let server_cert = server
        .signed_by(&server_key, &issuer)
        .context("signing the server certificate")?;

    write(&file("ca.pem"), &ca_pem, false)?;
    if let Some(key) = &ca_key_pem {
        write(&file("ca-key.pem"), key, true)?;
    }
    write(&file("server.pem"), &server_cert.pem(), false)?;
    write(&file("server-key.pem"), &server_key.serialize_pem(), true)?;
    let mut clients = Vec::new();
    for client in client_names {
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, client);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
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

/// A new CA, valid ten years, with a name of its own; and its certificate (PEM).
fn new_ca() -> anyhow::Result<(Issuer<'static, KeyPair>, String)> {
    let ca_key = KeyPair::generate().context("making the CA's key")?;
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    // A name of its own per CA: OpenSSL-based clients (curl, Python, Node, psql) pick a
    // certificate's issuer by name, so two CAs of one name in a bundle (during a rotation)
    // would fail every certificate of one of them.
    let id = std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0u8);
    ca.distinguished_name
        .push(DnType::CommonName, format!("fence private CA {id:016x}"));
    set_validity(&mut ca, 3650);
    let ca_cert = ca.self_signed(&ca_key).context("signing the CA")?;
    Ok((Issuer::new(ca, ca_key), ca_cert.pem()))
}

/// The CA in `cert` and `key` (PEM files), checked to be a CA valid today whose key is `key`
/// (what it signs verifies); its certificate (PEM), and the whole days it has left.
fn existing_ca(cert: &Path, key: &Path) -> anyhow::Result<(Issuer<'static, KeyPair>, String, i64)> {
    let usage = |what: String| crate::Usage::error(what);
    let read = |flag: &str, path: &Path| {
        std::fs::read_to_string(path)
            .map_err(|e| usage(format!("{flag} {}: cannot read it: {e}", path.display())))
    };
    let pem = read("--ca-cert", cert)?;
    let key_pem = read("--ca-key", key)?;
    // What a verifier does not check of a trusted root, and OpenSSL-based clients do: that
    // it is a CA, and valid today.
    let days_left = {
        let not_ca = |why: String| usage(format!("--ca-cert {}: {why}", cert.display()));
        let (_, parsed) = x509_parser::pem::parse_x509_pem(pem.as_bytes())
            .map_err(|e| not_ca(format!("not a certificate in PEM: {e}")))?;
        let parsed = parsed
            .parse_x509()
            .map_err(|e| not_ca(format!("not a certificate in PEM: {e}")))?;
        if !parsed.is_ca() {
            return Err(not_ca(
                "not a CA certificate (no basicConstraints CA:true): give the CA's ca.pem, not a server's certificate".into(),
            ));
        }
        let validity = parsed.validity();
        if !validity.is_valid() {
            return Err(not_ca(format!(
                "the CA is not valid today (from {} to {}): make a new CA",
                validity.not_before, validity.not_after
            )));
        }
        (validity.not_after.timestamp() - x509_parser::time::ASN1Time::now().timestamp()) / 86_400
    };
    let signing_key = KeyPair::from_pem(&key_pem).map_err(|e| {
        usage(format!(
            "--ca-key {}: not a private key in PEM: {e}",
            key.display()
        ))
    })?;
    let issuer = Issuer::from_ca_cert_pem(&pem, signing_key).map_err(|e| {
        usage(format!(
            "--ca-cert {}: not a CA certificate in PEM: {e}",
            cert.display()
        ))
    })?;
    // A test leaf, verified as a client would: a key that is not the certificate's stops
    // here instead of in every client later.
    let mut probe = CertificateParams::new(vec!["localhost".to_owned()])
        .context("making a test certificate")?;
    probe.use_authority_key_identifier_extension = true;
    let probe_key = KeyPair::generate().context("making a test key")?;
    let leaf = probe
        .signed_by(&probe_key, &issuer)
        .context("signing a test certificate")?;
    let roots = fence_storage::tls::roots(Some(cert)).map_err(|e| {
        usage(format!(
            "--ca-cert {}: {}",
            cert.display(),
            fence_storage::error_chain(&e)
        ))
    })?;
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        fence_storage::tls::provider(),
    )
    .build()
    .context("checking the CA")?;
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("a valid name");
    let now = rustls::pki_types::UnixTime::now();
    rustls::client::danger::ServerCertVerifier::verify_server_cert(
        verifier.as_ref(),
        leaf.der(),
        &[],
        &name,
        &[],
        now,
    )
        .map_err(|e| {
            usage(format!(
                "--ca-cert {} with --ca-key {}: what they sign does not verify ({e}): is the key the certificate's?",
                cert.display(),
                key.display()
            ))
        })?;
    Ok((issuer, pem, days_left))
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
