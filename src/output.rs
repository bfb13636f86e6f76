//! Every file the tool writes goes through `write_file`: checkpoints, .npy matrices, raw casts,
//! train.json and loss.svg, report.json and report.html, bench JSON, the autotune and cubin
//! caches.
//!
//! - A regular file (or none yet) is written whole to a uniquely named temporary in the same
//!   directory (`tempfile`: created exclusively, with a random name no user file has), synced,
//!   then renamed over the target: a reader, another process included, sees the old file or the
//!   whole new one, and a failure leaves the old one as it was. The new file has the mode of
//!   the one it replaces, or 0666 less the umask, as any new file. A temporary still pending
//!   when SIGTERM, SIGINT or SIGHUP ends the process is removed first.
//! - An existing target that is not a regular file (a device such as `/dev/null` or
//!   `/dev/stdout`, a FIFO) is written in place: renaming over it would replace the node.
//! - `-` is standard output.
//! - A directory is refused.
//!
//! A target that cannot be written is `Error::Output` (exit 1); `check_writable` finds that
//! before a long run starts.

use crate::error::{Error, Result};
use std::io::Write;
use std::path::Path;

/// Writes `path` with what `fill` writes (see the module's promise).
pub fn write_file(path: &Path, fill: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    if path.as_os_str() == "-" {
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        fill(&mut out)?;
        return out.flush().map_err(|e| Error::output("standard output", e));
    }
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Err(Error::output(path, "is a directory")),
        Ok(m) if !m.is_file() => write_in_place(path, fill),
        _ => write_replacing(path, fill),
    }
}

/// Writes `bytes` to `path` (see `write_file`).
pub fn write_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    write_file(path, |w| {
        w.write_all(bytes).map_err(|e| Error::output(path, e))
    })
}

/// Refuses, before any work, a target `write_file` could not write: a directory, or a folder
/// that does not exist or takes no new files (a temporary is created there and removed). A
/// device or FIFO, and `-` (standard output), pass.
pub fn check_writable(path: &Path) -> Result<()> {
    if path.as_os_str() == "-" {
        return Ok(());
    }
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => return Err(Error::output(path, "is a directory")),
        // A device or FIFO is written in place; opening a FIFO would wait for its reader.
        Ok(m) if !m.is_file() => return Ok(()),
        // A regular file is replaced: what matters is its folder.
        _ => {}
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let dir = parent(path);
        temporary_beside(path, dir).map(drop)
    }
    #[cfg(target_arch = "wasm32")]
    Ok(())
}

/// A device or FIFO: opened for writing as it is, never truncated, replaced or removed.
fn write_in_place(path: &Path, fill: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| Error::output(path, e))?;
    let mut out = std::io::BufWriter::new(file);
    fill(&mut out)?;
    out.flush().map_err(|e| Error::output(path, e))
}

#[cfg(not(target_arch = "wasm32"))]
fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// The temporary of `path` in `dir`: `.NAME.` then random characters then `.tmp`, visibly ours
/// and never a name the user chose; NAME is cut to 64 bytes, so that a target whose name is
/// as long as the file system allows still has a temporary.
#[cfg(not(target_arch = "wasm32"))]
fn temporary_beside(path: &Path, dir: &Path) -> Result<tempfile::NamedTempFile> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "mantissa".into());
    let mut cut = name.len().min(64);
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    let prefix = format!(".{}.", &name[..cut]);
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".tmp");
    // 0666 at creation: the kernel takes the umask off, as for any new file.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    builder
        .tempfile_in(dir)
        .map_err(|e| Error::output(path, format!("cannot create a temporary beside it: {e}")))
}

#[cfg(not(target_arch = "wasm32"))]
fn write_replacing(path: &Path, fill: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let tmp = temporary_beside(path, parent(path))?;
    let _pending = pending::Pending::add(tmp.path());
    // The file it replaces keeps its mode (set as it is: no umask applies to a change).
    if let Ok(old) = std::fs::metadata(path) {
        tmp.as_file()
            .set_permissions(old.permissions())
            .map_err(|e| Error::output(path, e))?;
    }
    let mut out = std::io::BufWriter::new(tmp);
    fill(&mut out)?;
    let tmp = out
        .into_inner()
        .map_err(|e| Error::output(path, e.into_error()))?;
    tmp.as_file()
        .sync_all()
        .map_err(|e| Error::output(path, e))?;
    // On failure the temporary is removed when it drops; the target is untouched.
    tmp.persist(path)
        .map_err(|e| Error::output(path, e.error))?;
    Ok(())
}

#[cfg(target_arch = "wasm32")]
fn write_replacing(path: &Path, _fill: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    Err(Error::output(path, "the browser build writes no files"))
}

/// The temporaries being written, removed by a signal that ends the process (a drop does not
/// run then). The handler thread starts with the first temporary.
#[cfg(not(target_arch = "wasm32"))]
mod pending {
    use std::path::{Path, PathBuf};
    use std::sync::{Mutex, Once};

    static PATHS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

    /// A temporary listed while it lives.
    pub struct Pending(PathBuf);

    impl Pending {
        pub fn add(path: &Path) -> Pending {
            static HANDLER: Once = Once::new();
            HANDLER.call_once(start_handler);
            let path = path.to_path_buf();
            lock().push(path.clone());
            Pending(path)
        }
    }

    impl Drop for Pending {
        fn drop(&mut self) {
            lock().retain(|p| *p != self.0);
        }
    }

    fn lock() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
        PATHS.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// On SIGTERM, SIGINT or SIGHUP: the pending temporaries removed, then the signal's own
    /// default (the process ends as it would have).
    fn start_handler() {
        #[cfg(unix)]
        {
            use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
            let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP])
            else {
                return;
            };
            let _ = std::thread::Builder::new()
                .name("mantissa-output-cleanup".into())
                .spawn(move || {
                    if let Some(signal) = signals.forever().next() {
                        for path in lock().iter() {
                            let _ = std::fs::remove_file(path);
                        }
                        let _ = signal_hook::low_level::emulate_default_handler(signal);
                        std::process::exit(128 + signal);
                    }
                });
        }
    }
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
        let err = write_bytes(dir.path(), b"x").unwrap_err();
        assert!(matches!(err, Error::Output { .. }), "{err}");
        assert!(err.to_string().contains("is a directory"), "{err}");
        assert!(check_writable(dir.path()).is_err());
    }

    #[test]
    fn new_files_take_the_umask_and_replaced_files_keep_their_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        // The umask as the process has it (read back by setting it: restored at once).
        // SAFETY: umask only swaps the process's file-creation mask.
        let umask = unsafe {
            let m = libc::umask(0o022);
            libc::umask(m);
            m as u32
        };
        let new = dir.path().join("new.json");
        write_bytes(&new, b"{}").unwrap();
        assert_eq!(
            mode(&new),
            0o666 & !umask,
            "a new file: 0666 less the umask"
        );
        let kept = dir.path().join("kept.json");
        std::fs::write(&kept, "old").unwrap();
        std::fs::set_permissions(&kept, std::fs::Permissions::from_mode(0o640)).unwrap();
        write_bytes(&kept, b"new").unwrap();
        assert_eq!(mode(&kept), 0o640, "a replaced file keeps its mode");
    }

    #[test]
    fn a_name_as_long_as_the_file_system_allows_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format!("{}.json", "n".repeat(250)));
        write_bytes(&path, b"{}").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"{}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn check_writable_refuses_what_cannot_be_written_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        assert!(check_writable(&dir.path().join("report.json")).is_ok());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let missing = dir.path().join("no such folder").join("report.json");
        let e = check_writable(&missing).unwrap_err();
        assert!(matches!(e, Error::Output { .. }), "{e}");
        assert!(check_writable(Path::new("-")).is_ok());
        assert!(check_writable(Path::new("/dev/null")).is_ok());
    }
}
