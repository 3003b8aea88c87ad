//! The flags of `fence tls`.
// The doc comments below are `--help` text first.
#![allow(rustdoc::invalid_html_tags)]

use std::path::PathBuf;

use clap::{Args, Subcommand};

/// `fence tls`.
#[derive(Subcommand, Debug)]
pub enum TlsCmd {
    /// Make a private CA and a server certificate (and client certificates on request) in
    /// DIR: ca.pem (every client's --ca-cert), ca-key.pem, server.pem (--tls-cert),
    /// server-key.pem (--tls-key), client-NAME.pem and client-NAME-key.pem. Keys are ECDSA
    /// P-256, mode 0600; nothing is ever overwritten.
    ///
    /// The server certificate is for the --name and --ip given, and always for localhost,
    /// 127.0.0.1 and ::1 (so checks on the server's own host work): name every address
    /// clients will use, as they check it. Keep
    /// ca-key.pem offline; with it, anyone can make certificates your clients trust.
    #[command(after_help = "\
Example:
  fence tls init /etc/fence/tls --name leases.internal --ip 10.0.0.5
  fence server --listen 0.0.0.0:7700 --tls-cert /etc/fence/tls/server.pem \\
    --tls-key /etc/fence/tls/server-key.pem --auth-file /etc/fence/clients --data-dir DIR
  fence claim --server https://leases.internal:7700 --ca-cert /etc/fence/tls/ca.pem --job j")]
    Init(TlsInitCmd),
}

/// The flags of `fence tls init`.
#[derive(Args, Debug)]
pub struct TlsInitCmd {
    /// Directory to write the files into (created if missing).
    pub dir: PathBuf,
    /// A DNS name the server is reached by; repeat for several (an address goes in --ip).
    #[arg(long, value_name = "DNS_NAME", value_parser = parse_dns_name)]
    pub name: Vec<String>,
    /// An IP address the server is reached by; repeat for several.
    #[arg(long, value_name = "IP")]
    pub ip: Vec<std::net::IpAddr>,
    /// Also make a client certificate signed by the same CA, for your own clients to present
    /// to peers of yours that check client certificates; repeat for several. fence itself
    /// presents none (not to its lease server, the proxy's upstream nor PostgreSQL), and its
    /// listeners do not ask for one.
    #[arg(long, value_name = "NAME")]
    pub client: Vec<String>,
    /// How long the server and client certificates are valid, in days (the CA: ten years).
    #[arg(long, default_value_t = 825, value_parser = clap::value_parser!(u32).range(1..=3650))]
    pub days: u32,
    /// Sign with this existing CA (its certificate, PEM) instead of making a new one: to
    /// renew a server certificate, add a name or a client, while clients keep trusting the
    /// ca.pem they have. Its certificate is copied into DIR as ca.pem; no ca-key.pem is
    /// written. Needs --ca-key.
    #[arg(long, value_name = "FILE", requires = "ca_key")]
    pub ca_cert: Option<PathBuf>,
    /// The existing CA's private key (PEM), kept wherever it is kept offline. Needs --ca-cert.
    #[arg(long, value_name = "FILE", requires = "ca_cert")]
    pub ca_key: Option<PathBuf>,
}

/// A DNS name for the server certificate. An IP address is refused, naming `--ip`: as a DNS
/// name in the certificate it would never match (clients check an address against the
/// certificate's IP addresses only), and `fence tls init` would have said nothing.
fn parse_dns_name(s: &str) -> Result<String, String> {
    if let Ok(ip) = s.parse::<std::net::IpAddr>() {
        return Err(format!(
            "{ip} is an IP address, which clients match against the certificate's addresses: give it with --ip {ip}"
        ));
    }
    let name = s.strip_prefix("*.").unwrap_or(s);
    let label_ok = |l: &str| {
        (1..=63).contains(&l.len())
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
    };
    if name.len() <= 253 && name.split('.').all(label_ok) {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is not a DNS name: dot-separated labels of letters, digits, '-' and '_' (such as leases.internal)"
        ))
    }
}
