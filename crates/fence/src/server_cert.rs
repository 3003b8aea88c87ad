//! The listeners' TLS certificate: its dates checked at start, and reloaded on SIGHUP.
//!
//! A certificate outside its dates fails every new handshake, so every client of the server
//! (and every `fence run` renewing through it) at once: it is refused at start, warned about
//! when it ends within [`WARN_DAYS`], and a renewed one is taken on SIGHUP without a restart.
//! A new pair that cannot be used keeps the old one; connections already open keep theirs.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
};

use rustls::{server::ResolvesServerCert, sign::CertifiedKey};

/// Fewer days than this left on the certificate is warned about, at start and at reload.
pub const WARN_DAYS: i64 = 30;

/// How far a certificate's notBefore may be ahead of this host's clock, in seconds.
const NOT_BEFORE_LEEWAY_S: i64 = 300;

/// The certificate and key files of `--tls-cert` and `--tls-key`, and the pair read last.
#[derive(Debug)]
pub struct ServerCert {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
}

impl ServerCert {
    /// Reads and checks the pair.
    ///
    /// # Errors
    /// As [`read`].
    pub fn load(cert: &Path, key: &Path) -> anyhow::Result<Arc<Self>> {
        let pair = read(cert, key)?;
        Ok(Arc::new(Self {
            cert: cert.to_owned(),
            key: key.to_owned(),
            current: RwLock::new(Arc::new(pair)),
        }))
    }

    /// Reads the files again and serves the new pair to the handshakes from now on; a pair
    /// that cannot be used leaves the old one.
    ///
    /// # Errors
    /// As [`read`].
    pub fn reload(&self) -> anyhow::Result<()> {
        let pair = read(&self.cert, &self.key)?;
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(pair);
        Ok(())
    }

    /// Reloads on every SIGHUP from now on, logging what it did.
    ///
    /// # Errors
    /// When the signal handler cannot be installed.
    pub fn reload_on_sighup(self: &Arc<Self>) -> std::io::Result<()> {
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
        let this = self.clone();
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                match this.reload() {
                    Ok(()) => tracing::info!(
                        file = %this.cert.display(),
                        days_left = this.days_left().unwrap_or(-1),
                        "SIGHUP: TLS certificate reloaded; new connections get it"
                    ),
                    Err(e) => tracing::warn!(
                        error = format!("{e:#}"),
                        "SIGHUP: TLS certificate not reloaded; the one already loaded stays"
                    ),
                }
            }
        });
        Ok(())
    }
}

impl ServerCert {
    /// The whole days the certificate served now has left; `None` when it cannot be read
    /// or has ended.
    fn days_left(&self) -> Option<i64> {
        let current = self
            .current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let leaf = current.end_entity_cert().ok()?;
        days_left(&self.cert, leaf.as_ref()).ok()
    }

    /// Looks at the served certificate's dates once a day from now on: a process started
    /// with 60 days left would otherwise reach the end without a word, every new handshake
    /// failing from then on.
    pub fn watch_dates(self: &Arc<Self>) {
        let this = self.clone();
        tokio::spawn(async move {
            let day = std::time::Duration::from_secs(86_400);
            let mut daily = tokio::time::interval_at(tokio::time::Instant::now() + day, day);
            loop {
                daily.tick().await;
                match this.days_left() {
                    Some(left) if left >= WARN_DAYS => {}
                    Some(left) => tracing::warn!(
                        file = %this.cert.display(),
                        days_left = left,
                        "--tls-cert: the certificate served ends in fewer than {WARN_DAYS} days; renew it and send SIGHUP"
                    ),
                    None => tracing::error!(
                        file = %this.cert.display(),
                        "--tls-cert: the certificate served has ended: every new connection fails; renew it and send SIGHUP"
                    ),
                }
            }
        });
    }
}

impl ResolvesServerCert for ServerCert {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let current = self
            .current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Some(current.clone())
    }
}

/// The pair in `cert` and `key`, checked to fit together and to be within its dates today;
/// a warning is logged when it ends within [`WARN_DAYS`].
///
/// # Errors
/// A usage error when a file cannot be read or parsed, the key does not fit, or the
/// certificate has ended or not yet begun.
pub fn read(cert: &Path, key: &Path) -> anyhow::Result<CertifiedKey> {
    let pair = fence_storage::tls::certified_key(cert, key).map_err(crate::Usage::from_error)?;
    let leaf = pair
        .end_entity_cert()
        .map_err(|e| crate::Usage::error(format!("--tls-cert {}: {e}", cert.display())))?;
    let days_left = days_left(cert, leaf.as_ref())?;
    if days_left < WARN_DAYS {
        tracing::warn!(
            file = %cert.display(),
            days_left,
            "--tls-cert: the certificate ends in fewer than {WARN_DAYS} days; every new connection will fail from then on: renew it (fence tls init NEWDIR --ca-cert CA --ca-key CAKEY, then move NEWDIR/server.pem and server-key.pem onto --tls-cert and --tls-key) and send SIGHUP"
        );
    }
    Ok(pair)
}

/// The whole days `der` (the certificate of the file `cert`) has left; an error when it is
/// outside its dates.
fn days_left(cert: &Path, der: &[u8]) -> anyhow::Result<i64> {
    let usage =
        |what: String| crate::Usage::error(format!("--tls-cert {}: {what}", cert.display()));
    let (_, parsed) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| usage(format!("not a certificate: {e}")))?;
    let validity = parsed.validity();
    let now = x509_parser::time::ASN1Time::now();
    if now > validity.not_after {
        return Err(usage(format!(
            "the certificate expired (notAfter {}): every handshake would fail; renew it (fence tls init DIR --ca-cert --ca-key) and give the new one",
            validity.not_after
        )));
    }
    // A certificate issued this instant (cert-manager does not backdate) on a host whose
    // clock is a little behind is taken: refusing a reload would keep the old one until it
    // expires. Its clients judge its dates by their own clocks anyway.
    let starts = validity
        .not_before
        .timestamp()
        .saturating_sub(NOT_BEFORE_LEEWAY_S);
    if now.timestamp() < starts {
        return Err(usage(format!(
            "the certificate is not valid yet (notBefore {}): every handshake would fail; check this host's clock, or give a certificate valid now",
            validity.not_before
        )));
    }
    Ok((validity.not_after.timestamp() - now.timestamp()) / 86_400)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate whose notBefore is a little ahead of this host's clock (issued this
    /// instant elsewhere) is taken; one an hour ahead is not.
    #[test]
    fn a_certificate_issued_a_moment_ahead_is_taken() {
        let dir = tempfile::tempdir().unwrap();
        let pair = |ahead: u64| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
            let since_epoch = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            let now = rcgen::date_time_ymd(1970, 1, 1) + since_epoch;
            params.not_before = now + std::time::Duration::from_secs(ahead);
            params.not_after = now + std::time::Duration::from_secs(90 * 86_400);
            let cert = params.self_signed(&key).unwrap();
            let (c, k) = (
                dir.path().join(format!("c{ahead}.pem")),
                dir.path().join(format!("k{ahead}.pem")),
            );
            std::fs::write(&c, cert.pem()).unwrap();
            std::fs::write(&k, key.serialize_pem()).unwrap();
            (c, k)
        };
        let (c, k) = pair(60);
        read(&c, &k).expect("a minute ahead is taken");
        let (c, k) = pair(3_600);
        let refused = read(&c, &k).unwrap_err().to_string();
        assert!(refused.contains("not valid yet"), "{refused}");
    }
}
