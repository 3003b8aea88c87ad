//! The default owner name: `<hostname>-<pid>-<random>`, unique per process incarnation.

use fence_core::Owner;

/// A fresh owner name for this process: `<hostname>-<pid>-<random>`.
///
/// Bytes of the host name outside visible ASCII become `_`; the name is cut to fit the
/// 256-byte limit.
pub fn default_owner() -> Owner {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let host: String = host
        .trim()
        .chars()
        .take(200)
        .map(|c| if c.is_ascii_graphic() { c } else { '_' })
        .collect();
    let host = if host.is_empty() {
        "host".to_owned()
    } else {
        host
    };
    let name = format!("{host}-{}-{:016x}", std::process::id(), fastrand::u64(..));
    Owner::new(name).expect("sanitised to visible ASCII within 256 bytes")
}

#[cfg(test)]
mod tests {
    #[test]
    fn default_owners_differ_and_name_the_pid() {
        let (a, b) = (super::default_owner(), super::default_owner());
        assert_ne!(a, b);
        assert!(a.as_str().contains(&format!("-{}-", std::process::id())));
    }
}
