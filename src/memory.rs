//! Host memory is asked for, not assumed: every allocation whose size comes from outside (a
//! matmul's result, the reference's working set, the host interpreter's tensors, a file's
//! contents) is checked here first and becomes `Error::HostOutOfMemory` with the bytes it
//! needs, instead of the allocator aborting the process.
//!
//! Two checks, both cheap: the bytes against what the host has available (Linux:
//! `MemAvailable` + `SwapFree` of /proc/meminfo; elsewhere none), then `Vec::try_reserve_exact`
//! for the buffer itself (which also catches sizes beyond the address space).

use crate::error::{Error, Result};

/// Host memory (available, in all) in bytes, where the system says (Linux: `MemAvailable` and
/// `MemTotal` of /proc/meminfo, each with the swap's free and total added): what a new
/// allocation can take without the kernel killing something.
pub fn host() -> Option<(u64, u64)> {
    #[cfg(target_os = "linux")]
    {
        let info = std::fs::read_to_string("/proc/meminfo").ok()?;
        let field = |name: &str| -> Option<u64> {
            let line = info.lines().find(|l| l.starts_with(name))?;
            let kib: u64 = line[name.len()..]
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            kib.checked_mul(1024)
        };
        let swap = |name| field(name).unwrap_or(0);
        Some((
            field("MemAvailable:")?.saturating_add(swap("SwapFree:")),
            field("MemTotal:")?.saturating_add(swap("SwapTotal:")),
        ))
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// The available half of `host()`.
pub fn available() -> Option<u64> {
    host().map(|(free, _)| free)
}

/// Refuses a working set of `bytes` (None: beyond u64) that the host cannot hold.
pub fn check(what: &str, bytes: Option<u64>) -> Result<()> {
    let fits = match (bytes, available()) {
        (None, _) => false,
        (Some(b), Some(free)) => b <= free,
        (Some(_), None) => true,
    };
    if fits {
        Ok(())
    } else {
        Err(Error::HostOutOfMemory {
            what: what.to_string(),
            bytes,
            available: available(),
        })
    }
}

/// Bytes of `count` values of `T`, None where that overflows.
pub fn bytes_of<T>(count: usize) -> Option<u64> {
    (count as u64).checked_mul(std::mem::size_of::<T>() as u64)
}

/// A host buffer of `len` default values (zeros), or `HostOutOfMemory` naming `what`.
pub fn host_buffer<T: Clone + Default>(what: &str, len: usize) -> Result<Vec<T>> {
    let mut v = empty_with_capacity(what, len)?;
    v.resize(len, T::default());
    Ok(v)
}

/// An empty vector with room for `len` values, or `HostOutOfMemory` naming `what`.
pub fn empty_with_capacity<T>(what: &str, len: usize) -> Result<Vec<T>> {
    check(what, bytes_of::<T>(len))?;
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| Error::HostOutOfMemory {
            what: what.to_string(),
            bytes: bytes_of::<T>(len),
            available: available(),
        })?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_impossible_buffer_is_an_error_not_an_abort() {
        let e = host_buffer::<f32>("a test buffer", usize::MAX / 2).unwrap_err();
        assert!(matches!(e, Error::HostOutOfMemory { .. }), "{e}");
        let text = e.to_string();
        assert!(text.contains("a test buffer"), "{text}");
        let e = host_buffer::<f32>("C", 1_000_000_000_000_000_000).unwrap_err();
        assert!(e.to_string().contains("4000000000000000000 bytes"), "{e}");
        assert_eq!(host_buffer::<f32>("small", 3).unwrap(), vec![0.0; 3]);
    }

    #[test]
    fn sizes_beyond_u64_are_refused() {
        assert!(check("nothing fits", None).is_err());
        assert_eq!(bytes_of::<f64>(usize::MAX), None);
    }
}
