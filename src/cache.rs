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

/// Writes `bytes` to `path` in the cache (its directory created first) through
/// `output::write_bytes`: a reader, another process included, sees the old file or the whole
/// new one, never a torn one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::file(parent, e))?;
    }
    crate::output::write_bytes(path, bytes)
}
