//! The on-disk cache shared by the backends (autotuned tiles, compiled CUDA kernels): the
//! directory `MANTISSA_CACHE_DIR`, else `$XDG_CACHE_HOME/mantissa`, else `~/.cache/mantissa`;
//! none in the browser or without a home directory. A cache that cannot be read or written
//! costs work next time, never a result.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// The cache directory, when there is one.
pub fn dir() -> Option<PathBuf> {
    if cfg!(target_arch = "wasm32") {
        return None;
    }
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("MANTISSA_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("mantissa")))
        .or_else(|| env("HOME").map(|d| d.join(".cache").join("mantissa")))
}

/// The largest cache file read (a tile store is a few KiB, a cubin a few hundred).
pub const MAX_FILE_BYTES: u64 = 64 << 20;

/// The cache file `path`, through `input::Input`: None where there is none, and where it is
/// not a regular file (a FIFO would block every read), larger than `MAX_FILE_BYTES` or
/// unreadable, ignored with a warning on standard error.
pub fn read(path: &Path) -> Option<Vec<u8>> {
    read_within(path, MAX_FILE_BYTES)
}

/// `read` of a cache file of at most `limit` bytes (a corpus's tokens).
pub fn read_within(path: &Path, limit: u64) -> Option<Vec<u8>> {
    if std::fs::symlink_metadata(path).is_err() {
        return None;
    }
    let read = crate::input::Input::open_within(path, "cache file", limit)
        .and_then(|input| input.read_all("cache file", limit));
    match read {
        Ok(bytes) => Some(bytes),
        Err(e) => {
            eprintln!("mantissa: warning: cache ignored: {e}");
            None
        }
    }
}

/// Writes `bytes` to `path` in the cache (its directory created first) through
/// `output::write_bytes`: a reader, another process included, sees the old file or the whole
/// new one, never a torn one. Something there that is not a regular file (a FIFO, a device) is
/// left alone: the cache is not written.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::output(parent, e))?;
    }
    if let Ok(m) = std::fs::metadata(path)
        && !m.is_file()
    {
        return Err(Error::output(
            path,
            "not a regular file: the cache is not written",
        ));
    }
    crate::output::write_bytes(path, bytes)
}
