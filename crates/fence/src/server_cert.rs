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
            "--tls-cert: the certificate ends in fewer than {WARN_DAYS} days; every new connection will fail from then on: renew it (fence tls init DIR --ca-cert --ca-key) and send SIGHUP"
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
    if now < validity.not_before {
        return Err(usage(format!(
            "the certificate is not valid yet (notBefore {}): every handshake would fail; check this host's clock, or give a certificate valid now",
            validity.not_before
        )));
    }
    Ok((validity.not_after.timestamp() - now.timestamp()) / 86_400)
}
