//! What the sinks that forget idle jobs on a store recorded: the bounds every sink there checks.

use std::time::Duration;

/// What the sinks that forget idle jobs on a store have recorded together
/// (`PgStore::announce_forgetting` on PostgreSQL,
/// [`SledStore::recorded_settings`](crate::SledStore::recorded_settings) on sled). Every sink on the store decides for the jobs they forget, so each must check
/// tokens' expiry at least as strictly as they do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SinkSettings {
    /// Some sink forgets idle jobs (once recorded, for good).
    pub forgetting: bool,
    /// The smallest clock skew a forgetting sink allows.
    pub clock_skew: Duration,
    /// The shortest longest lease a forgetting sink accepts (`None`: none recorded, the
    /// default).
    pub max_lease_ttl: Option<Duration>,
}
