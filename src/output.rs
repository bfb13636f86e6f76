//! Every file the tool writes goes through `write_file`: checkpoints, .npy matrices, raw casts,
//! train.json and loss.svg, report.json and report.html, bench JSON, the autotune and cubin
//! caches.
//!
//! - A regular file (or none yet) is written whole to a uniquely named temporary in the same
//!   directory (`tempfile`: created exclusively, with a random name no user file has), synced,
//!   then renamed over the target: a reader, another process included, sees the old file or the
//!   whole new one, and a failure leaves the old one as it was.
//! - An existing target that is not a regular file (a device such as `/dev/null` or
//!   `/dev/stdout`, a FIFO) is written in place: renaming over it would replace the node.
//! - A directory is refused.

use crate::error::{Error, Result};
use std::io::Write;
use std::path::Path;

/// Writes `path` with what `fill` writes (see the module's promise).
pub fn write_file(path: &Path, fill: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Err(Error::file(path, "is a directory")),
        Ok(m) if !m.is_file() => write_in_place(path, fill),
        _ => write_replacing(path, fill),
    }
}

/// Writes `bytes` to `path` (see `write_file`).
pub fn write_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    write_file(path, |w| {
        w.write_all(bytes).map_err(|e| Error::file(path, e))
    })
}

/// A device or FIFO: opened for writing as it is, never truncated, replaced or removed.
fn write_in_place(path: &Path, fill: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| Error::file(path, e))?;
    let mut out = std::io::BufWriter::new(file);
    fill(&mut out)?;
    out.flush().map_err(|e| Error::file(path, e))
}

#[cfg(not(target_arch = "wasm32"))]
fn write_replacing(path: &Path, fill: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    // `.NAME.` then random characters: visibly ours, and never a name the user chose.
    let prefix = format!(".{}.", name.as_deref().unwrap_or("mantissa"));
    let tmp = tempfile::Builder::new()
        .prefix(&prefix)
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| Error::file(path, format!("cannot create a temporary beside it: {e}")))?;
    let mut out = std::io::BufWriter::new(tmp);
    fill(&mut out)?;
    let tmp = out
        .into_inner()
        .map_err(|e| Error::file(path, e.into_error()))?;
    tmp.as_file().sync_all().map_err(|e| Error::file(path, e))?;
    // On failure the temporary is removed when it drops; the target is untouched.
    tmp.persist(path).map_err(|e| Error::file(path, e.error))?;
    Ok(())
}

#[cfg(target_arch = "wasm32")]
fn write_replacing(path: &Path, _fill: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    Err(Error::file(path, "the browser build writes no files"))
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn replaces_a_regular_file_whole_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.json");
        std::fs::write(&path, "old").unwrap();
        write_bytes(&path, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "a temporary was left behind");
    }

    #[test]
    fn a_failed_write_keeps_the_old_file_and_a_users_partial_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.npy");
        let partial = dir.path().join("out.npy.partial");
        std::fs::write(&path, "old").unwrap();
        std::fs::write(&partial, "the user's").unwrap();
        let err = write_file(&path, |w| {
            w.write_all(b"half").unwrap();
            Err(Error::invalid("test", "fails midway"))
        });
        assert!(err.is_err());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "old");
        assert_eq!(std::fs::read_to_string(&partial).unwrap(), "the user's");
        write_bytes(&path, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&partial).unwrap(), "the user's");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }

    #[test]
    fn a_device_is_written_in_place_not_replaced() {
        use std::os::unix::fs::FileTypeExt;
        write_bytes(Path::new("/dev/null"), b"discarded").unwrap();
        let meta = std::fs::metadata("/dev/null").unwrap();
        assert!(
            meta.file_type().is_char_device(),
            "/dev/null is still a device"
        );
    }

    #[test]
    fn a_fifo_is_written_in_place() {
        use std::os::unix::fs::FileTypeExt;
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("SKIPPED a_fifo_is_written_in_place: no mkfifo");
            return;
        }
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read(fifo).unwrap())
        };
        write_bytes(&fifo, b"through the pipe").unwrap();
        assert_eq!(reader.join().unwrap(), b"through the pipe");
        let meta = std::fs::metadata(&fifo).unwrap();
        assert!(meta.file_type().is_fifo(), "the FIFO is still a FIFO");
    }

    #[test]
    fn a_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_bytes(dir.path(), b"x").unwrap_err().to_string();
        assert!(err.contains("is a directory"), "{err}");
    }
}
