//! `sslrootcert` checked against `sslmode`: a root certificate is never read and then ignored.

use super::{Options, SetupError, SslMode};

/// A root certificate means verification: with `sslmode` unset, `disable`, `allow` or
/// `prefer` it would be read and never used (an unverified connection, or none encrypted),
/// so it is refused. `sslrootcert=system` (libpq 16) asks for the system's roots and, as in
/// libpq, `verify-full`: the default then, and a weaker mode is refused.
pub(super) fn check_root_cert(
    opts: &mut Options,
    mode_given: Option<&str>,
    system_roots: bool,
) -> Result<(), SetupError> {
    if system_roots {
        match mode_given {
            None => opts.ssl = SslMode::VerifyFull,
            Some(_) if opts.ssl == SslMode::VerifyFull => {}
            Some(mode) => {
                return Err(SetupError::RootCert(format!(
                    "sslrootcert=system needs sslmode=verify-full (as in libpq), not sslmode={mode}: give sslmode=verify-full, or leave sslmode out"
                )));
            }
        }
    } else if let Some(root) = &opts.root_cert
        && matches!(opts.ssl, SslMode::Disable | SslMode::Prefer)
    {
        return Err(SetupError::RootCert(format!(
            "sslrootcert={} with sslmode={}: the certificate would not be used, the connection not verified; give sslmode=verify-full (or verify-ca, or require)",
            root.display(),
            mode_given.unwrap_or("prefer (the default)")
        )));
    }
    Ok(())
}
