//! How much memory there is, checked before large allocations: an allocation that cannot be
//! satisfied is `Error::OutOfMemory`, never an abort of the process.
//!
//! The host figure is the smallest of what the kernel would give (`MemAvailable`), what the
//! process's cgroup still allows, and what its address-space limit (`ulimit -v`) leaves. Vectors
//! are then reserved with `try_reserve_exact`, so a limit this check cannot see still ends in
//! an error rather than an abort.

use crate::error::{Error, MemoryKind, Result};

/// Bytes the host can still give this process, or `None` where nothing says.
pub fn host_available() -> Option<usize> {
    [
        meminfo_available(),
        cgroup_available(),
        address_space_available(),
    ]
    .into_iter()
    .flatten()
    .min()
}

/// `Err(OutOfMemory)` when `bytes` (`None`: more than `usize` holds) exceed what the host has.
pub fn check_host(bytes: Option<usize>) -> Result<()> {
    let available = host_available();
    match (bytes, available) {
        (None, _) => Err(out_of_memory(MemoryKind::Host, usize::MAX, available)),
        (Some(b), Some(a)) if b > a => Err(out_of_memory(MemoryKind::Host, b, Some(a))),
        _ => Ok(()),
    }
}

/// Bytes of `n` values of `T` (`None` on overflow).
pub(crate) fn bytes_of<T>(n: usize) -> Option<usize> {
    n.checked_mul(std::mem::size_of::<T>())
}

/// A vector of `n` copies of `value`, or `OutOfMemory` when the host cannot hold it.
pub(crate) fn host_vec<T: Clone>(n: usize, value: T) -> Result<Vec<T>> {
    let bytes = bytes_of::<T>(n);
    check_host(bytes)?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        out_of_memory(
            MemoryKind::Host,
            bytes.unwrap_or(usize::MAX),
            host_available(),
        )
    })?;
    v.resize(n, value);
    Ok(v)
}

pub(crate) fn out_of_memory(kind: MemoryKind, needed: usize, available: Option<usize>) -> Error {
    Error::OutOfMemory {
        kind,
        needed,
        available,
    }
}

/// `MemAvailable` of /proc/meminfo.
fn meminfo_available() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// `memory.max - memory.current` of this process's cgroup (v2); `None` when unlimited.
fn cgroup_available() -> Option<usize> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let read = |f: &str| -> Option<usize> {
        std::fs::read_to_string(dir.join(f))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let max = read("memory.max")?; // "max" (unlimited) does not parse: None
    Some(max.saturating_sub(read("memory.current").unwrap_or(0)))
}

/// The address-space limit (`ulimit -v`) less the address space already mapped.
fn address_space_available() -> Option<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max address space"))?;
    let limit: usize = line.split_whitespace().nth(3)?.parse().ok()?; // "unlimited": None
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let vm_kib: usize = status
        .lines()
        .find(|l| l.starts_with("VmSize:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(limit.saturating_sub(vm_kib.saturating_mul(1024)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_impossible_host_allocation_is_an_error() {
        let e = host_vec::<f64>(1 << 60, 0.0).unwrap_err();
        assert!(
            matches!(
                e,
                Error::OutOfMemory {
                    kind: MemoryKind::Host,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("host"), "{e}");
        assert!(
            check_host(None).is_err(),
            "an overflowing size is never available"
        );
    }

    #[test]
    fn a_small_host_allocation_succeeds() {
        assert_eq!(host_vec(3, 7u16).unwrap(), [7, 7, 7]);
        check_host(Some(1 << 20)).unwrap();
        let avail = host_available().expect("Linux reports available memory");
        assert!(avail > 1 << 20, "{avail}");
    }
}
