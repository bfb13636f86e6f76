//! Host memory is asked for, not assumed: every allocation whose size comes from outside (a
//! matmul's result, the reference's working set, the host interpreter's tensors, a file's
//! contents) is checked here first and becomes `Error::HostOutOfMemory` with the bytes it
//! needs, instead of the allocator aborting the process.
//!
//! Two checks, both cheap: the bytes against what the process may still take (`available`:
//! on Linux the least of `MemAvailable` + `SwapFree` of /proc/meminfo, what its address-space
//! limit `RLIMIT_AS` leaves beside what it has mapped, and what the memory limits of its cgroup
//! and the cgroup's ancestors leave beside their usage, v2 or v1; elsewhere none), then
//! `Vec::try_reserve_exact` for the buffer itself (which also catches sizes beyond the address
//! space).

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

/// The bytes this process may still allocate, where the system says: the least of the host's
/// available memory (`host`), what `RLIMIT_AS` leaves (`ulimit -v`: an allocation beyond it
/// fails, and `Vec` aborts), and what its cgroup's memory limits leave (beyond them the kernel
/// kills the process).
pub fn available() -> Option<u64> {
    let limits = [
        host().map(|(free, _)| free),
        address_space_left(),
        cgroup_left(),
    ];
    limits.into_iter().flatten().min()
}

/// What `RLIMIT_AS` leaves beside the address space mapped now (/proc/self/statm's size), where
/// there is a limit.
fn address_space_left() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct it is given, and nothing else.
        if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } != 0
            || limit.rlim_cur == libc::RLIM_INFINITY
        {
            return None;
        }
        let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
        let pages: u64 = statm.split_whitespace().next()?.parse().ok()?;
        // SAFETY: sysconf reads a constant of the system.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        let mapped = pages.saturating_mul(u64::try_from(page).ok()?);
        Some(limit.rlim_cur.saturating_sub(mapped))
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// What the memory limits of this process's cgroup and of its ancestors leave beside their
/// usage, the least of them (cgroup v2: memory.max and memory.current; v1: the memory
/// controller's memory.limit_in_bytes and memory.usage_in_bytes), where one is set.
fn cgroup_left() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        use std::path::{Path, PathBuf};
        let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let number = |path: PathBuf| -> Option<u64> {
            std::fs::read_to_string(path).ok()?.trim().parse().ok()
        };
        // (mount, path within it, limit file, usage file) of each hierarchy that has memory.
        let mut found = Vec::new();
        for line in groups.lines() {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            if controllers.is_empty() {
                found.push(("/sys/fs/cgroup", path, "memory.max", "memory.current"));
                found.push((
                    "/sys/fs/cgroup/unified",
                    path,
                    "memory.max",
                    "memory.current",
                ));
            } else if controllers.split(',').any(|c| c == "memory") {
                let (limit, usage) = ("memory.limit_in_bytes", "memory.usage_in_bytes");
                found.push(("/sys/fs/cgroup/memory", path, limit, usage));
            }
        }
        let mut least: Option<u64> = None;
        for (mount, path, limit, usage) in found {
            // The cgroup and its ancestors up to the mount (a container sees its own cgroup
            // as the mount's root).
            let mut dir = Path::new(mount).join(path.trim_start_matches('/'));
            loop {
                if let (Some(l), Some(u)) = (number(dir.join(limit)), number(dir.join(usage))) {
                    let left = l.saturating_sub(u);
                    least = Some(least.map_or(left, |m| m.min(left)));
                }
                if dir == Path::new(mount) || !dir.pop() || !dir.starts_with(mount) {
                    break;
                }
            }
        }
        least
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
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

    /// The address-space limit counts: under `ulimit -v` a size within MemAvailable but beyond
    /// the limit passed the check, and the allocations after it aborted the process (`memory
    /// allocation of N bytes failed`); it is refused with the bytes. A child process holds the
    /// limit, so the test's own is untouched.
    #[cfg(target_os = "linux")]
    #[test]
    fn the_address_space_limit_bounds_what_is_available() {
        const LIMIT: u64 = 6 << 30;
        if std::env::var_os("MANTISSA_RLIMIT_CHILD").is_some() {
            let left = address_space_left().expect("a limit is set");
            assert!(left < LIMIT, "{left}");
            assert!(available().is_some_and(|a| a <= left));
            let e = check("a buffer as large as the limit", Some(LIMIT)).unwrap_err();
            assert!(e.to_string().contains(&format!("{LIMIT} bytes")), "{e}");
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let mut child = std::process::Command::new(exe);
        child
            .args([
                "--exact",
                "memory::tests::the_address_space_limit_bounds_what_is_available",
                "--test-threads=1",
            ])
            .env("MANTISSA_RLIMIT_CHILD", "1");
        use std::os::unix::process::CommandExt;
        // SAFETY: setrlimit between fork and exec touches nothing the parent holds.
        unsafe {
            child.pre_exec(|| {
                let l = libc::rlimit {
                    rlim_cur: LIMIT,
                    rlim_max: LIMIT,
                };
                match libc::setrlimit(libc::RLIMIT_AS, &l) {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                }
            });
        }
        let out = child.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        assert!(text.contains("1 passed"), "{text}");
    }

    #[test]
    fn sizes_beyond_u64_are_refused() {
        assert!(check("nothing fits", None).is_err());
        assert_eq!(bytes_of::<f64>(usize::MAX), None);
    }
}
