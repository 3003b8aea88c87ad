//! TLS with rustls for every connection fence makes or takes: configurations from PEM files.
//!
//! One crypto provider (`ring`) and one place that reads certificates, so the lease client,
//! the proxy's upstream connections, PostgreSQL and the listeners verify the same way:
//! against the system's roots, or only against a CA file when one is given.
//!
//! ```no_run
//! use fence_storage::tls;
//!
//! let client = tls::client_config(None, &[b"http/1.1"])?; // system roots
//! let server = tls::server_config("cert.pem".as_ref(), "key.pem".as_ref(), &[b"h2", b"http/1.1"])?;
//! # let _ = (client, server);
//! # Ok::<(), tls::TlsError>(())
//! ```

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use rustls::{
    ClientConfig, RootCertStore, ServerConfig,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime, pem::PemObject},
    server::ResolvesServerCert,
    sign::CertifiedKey,
};

/// Why a TLS configuration could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    #[error("{what} {}: {reason}", path.display())]
    File {
        /// `certificate file`, `key file` or `CA file`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong, in words.
        reason: String,
    },
    /// rustls refused the configuration (a key that does not match the certificate, say).
    #[error("TLS configuration refused")]
    Rustls(#[source] rustls::Error),
}

/// The crypto provider every configuration uses.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn file_error(what: &'static str, path: &Path, reason: impl ToString) -> TlsError {
    TlsError::File {
        what,
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

/// The certificates in a PEM file, at least one.
///
/// # Errors
/// When the file cannot be read, is not PEM or holds no certificate.
pub fn certificates(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(what, path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(what, path, e))?;
    if certs.is_empty() {
        return Err(file_error(what, path, "no CERTIFICATE in it"));
    }
    Ok(certs)
}

/// A server configuration: the certificate chain and its private key (PEM), offering the
/// `alpn` protocols in order.
///
/// # Errors
/// When a file cannot be read or parsed, or the key does not fit the certificate.
pub fn server_config(cert: &Path, key: &Path, alpn: &[&[u8]]) -> Result<ServerConfig, TlsError> {
    let pair = Arc::new(certified_key(cert, key)?);
    server_config_with(Arc::new(Fixed(pair)), alpn)
}

/// A server configuration that takes its certificate from `resolver` at each handshake (one
/// that can be swapped while the listener runs), offering the `alpn` protocols in order.
///
/// # Errors
/// When the provider refuses the protocol versions (it does not).
pub fn server_config_with(
    resolver: Arc<dyn ResolvesServerCert>,
    alpn: &[&[u8]],
) -> Result<ServerConfig, TlsError> {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Rustls)?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// The certificate chain in `cert` and its private key in `key` (PEM), checked to fit
/// together.
///
/// # Errors
/// When a file cannot be read or parsed, or the key does not fit the certificate.
pub fn certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let chain = certificates("certificate file", cert)?;
    let key_path = key;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        // The usual mix-up: the certificate given where its key belongs.
        let holds_certificate = std::fs::read_to_string(key)
            .is_ok_and(|text| text.contains("-----BEGIN CERTIFICATE-----"));
        if holds_certificate {
            file_error(
                "key file",
                key,
                "it holds a certificate, not a private key: give the key (-----BEGIN PRIVATE KEY-----, e.g. server-key.pem of `fence tls init`) here and the certificate to --tls-cert",
            )
        } else {
            file_error("key file", key, e)
        }
    })?;
    CertifiedKey::from_der(chain, key, &provider()).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => file_error(
            "key file",
            key_path,
            format!(
                "it does not match the certificate in {} (give the key the certificate was issued for)",
                cert.display()
            ),
        ),
        other => file_error("key file", key_path, other),
    })
}

/// One certificate for every handshake.
#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl ResolvesServerCert for Fixed {
    fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// The roots a client trusts: every certificate of `ca` when given (and only those, as
/// curl's `--cacert` and libpq's `sslrootcert` mean), else the system's (`/etc/ssl/certs`
/// and friends).
///
/// # Errors
/// When `ca` cannot be read or holds no certificate, or the system has no roots.
pub fn roots(ca: Option<&Path>) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    match ca {
        Some(ca) => {
            for cert in certificates("CA file", ca)? {
                roots.add(cert).map_err(|e| file_error("CA file", ca, e))?;
            }
        }
        None => {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        }
    }
    if roots.is_empty() {
        return Err(TlsError::File {
            what: "CA file",
            path: ca.map_or_else(|| PathBuf::from("(system roots)"), Path::to_owned),
            reason: "no trusted root certificate found; give one with --ca-cert".into(),
        });
    }
    Ok(roots)
}

/// A client configuration that verifies servers against [`roots`] and offers `alpn`.
///
/// # Errors
/// As [`roots`].
pub fn client_config(ca: Option<&Path>, alpn: &[&[u8]]) -> Result<ClientConfig, TlsError> {
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Rustls)?
        .with_root_certificates(roots(ca)?)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// A client configuration that verifies the server's certificate against [`roots`] but not
/// its host name: libpq's `sslmode=verify-ca`.
///
/// # Errors
/// As [`roots`].
pub fn any_name_config(ca: Option<&Path>) -> Result<ClientConfig, TlsError> {
    let provider = provider();
    let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots(ca)?),
        provider.clone(),
    )
    .build()
    .map_err(|e| TlsError::File {
        what: "CA file",
        path: ca.map_or_else(|| PathBuf::from("(system roots)"), Path::to_owned),
        reason: e.to_string(),
    })?;
    lenient_config(provider, Some(webpki))
}

/// A client configuration that encrypts but does not verify the server's certificate: what
/// libpq's `sslmode=require` means. It protects against eavesdropping, not against a server
/// that impersonates the real one; `verify-full` does both.
///
/// # Errors
/// When the provider refuses the protocol versions (it does not).
pub fn encrypt_only_config() -> Result<ClientConfig, TlsError> {
    lenient_config(provider(), None)
}

fn lenient_config(
    provider: Arc<CryptoProvider>,
    chain: Option<Arc<rustls::client::WebPkiServerVerifier>>,
) -> Result<ClientConfig, TlsError> {
    let verifier = Lenient {
        chain,
        provider: provider.clone(),
    };
    Ok(ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Rustls)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth())
}

/// Checks less than a full verification: with `chain`, the certificate chain but not the
/// host name (`verify-ca`); without, nothing about the certificate (`require`). Either way
/// the handshake's signatures are checked, so the server must hold the certificate's key.
#[derive(Debug)]
struct Lenient {
    chain: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        use rustls::{CertificateError, Error};
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let algorithms = &self.provider.signature_verification_algorithms;
        rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
