//! The flags of the small commands: `fence healthcheck` and `fence completions`.

use std::{path::PathBuf, time::Duration};

use clap::Args;

use crate::duration::parse_timeout;

/// The flags of `fence healthcheck`.
#[derive(Args, Debug)]
pub struct HealthcheckCmd {
    /// The server's or the proxy admin listener's base URL; /healthz is asked.
    #[arg(long, env = "FENCE_HEALTH_URL")]
    pub url: String,
    /// Trust only this CA (PEM) for an https:// URL.
    #[arg(long, value_name = "FILE", env = "FENCE_HEALTH_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
    /// Send the secret in FILE as `Authorization: Bearer`: a proxy's admin listener with
    /// --admin-auth-file needs one of its secrets (a lease server's /healthz needs none).
    #[arg(long, value_name = "FILE", env = "FENCE_HEALTH_AUTH_TOKEN_FILE")]
    pub auth_token_file: Option<PathBuf>,
    /// How long to wait for the answer.
    #[arg(long, default_value = "3s", allow_hyphen_values = true, value_parser = parse_timeout)]
    pub timeout: Duration,
}

/// The flags of `fence completions`.
#[derive(Args, Debug)]
pub struct CompletionsCmd {
    /// The shell: bash, zsh, fish, elvish or powershell.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}
