//! Host memory detection: `MemAvailable` from `/proc/meminfo` (the only I/O in this crate).
//! Device memory is detected by the backend and passed in.

use crate::units::Bytes;

/// `MemAvailable` of this host. `None` where `/proc/meminfo` is absent or unreadable.
pub fn host_mem_available() -> Option<Bytes> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

/// The `MemAvailable:   123456 kB` line, in bytes (checked).
pub fn parse_mem_available(meminfo: &str) -> Option<Bytes> {
    let line = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let mut parts = line.split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    let scale = match parts.next() {
        Some("kB") => 1024,
        None => 1,
        Some(_) => return None,
    };
    value.checked_mul(scale).map(Bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernel_format() {
        let text =
            "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   65536000 kB\n";
        assert_eq!(parse_mem_available(text), Some(Bytes(65_536_000 * 1024)));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: x kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: 5 MB\n"), None);
        let huge = format!("MemAvailable: {} kB\n", u64::MAX);
        assert_eq!(parse_mem_available(&huge), None);
    }

    #[test]
    fn this_host_reports_something_on_linux() {
        if std::path::Path::new("/proc/meminfo").exists() {
            assert!(host_mem_available().is_some_and(|b| b.0 > 0));
        }
    }
}
