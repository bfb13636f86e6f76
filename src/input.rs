//! Every file the tool reads comes through `Input::open`: .npy operands, checkpoints (train
//! --resume, sample --checkpoint), the corpus, raw cast input, the autotune and cubin caches.
//!
//! The file is looked at before it is read: `stat` first, and only a regular file is opened
//! (a FIFO, a device, a socket or a directory is refused with its path: `/dev/zero` as a
//! checkpoint would be read forever, a FIFO would wait for a writer). The open itself does not
//! block (`O_NONBLOCK`, so a path swapped for a FIFO after the `stat` cannot hang it), and the
//! opened file is checked again. Its length is known from then on, and every reader checks what
//! it is about to read against it and against its format's own limits before it allocates.
//!
//! `-` is standard input, read with the same limits (its length unknown unless it is a file).

use crate::error::{Error, Result};
use std::io::Read;
use std::path::{Path, PathBuf};

/// An input file (or standard input), opened and looked at.
pub struct Input {
    source: Source,
    path: PathBuf,
    len: Option<u64>,
}

enum Source {
    File(std::fs::File),
    Stdin(std::io::Stdin),
    Stream(Box<dyn Read + Send>),
}

impl Read for Input {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match &mut self.source {
            Source::File(f) => f.read(buf),
            Source::Stdin(s) => s.read(buf),
            Source::Stream(r) => r.read(buf),
        }
    }
}

/// What a path is, in words, where it is not a regular file.
fn not_regular(meta: &std::fs::Metadata) -> Option<&'static str> {
    let kind = meta.file_type();
    if kind.is_file() {
        return None;
    }
    if kind.is_dir() {
        return Some("is a directory, not a file");
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_fifo() {
            return Some("is a FIFO, not a regular file");
        }
        if kind.is_char_device() || kind.is_block_device() {
            return Some("is a device, not a regular file");
        }
        if kind.is_socket() {
            return Some("is a socket, not a regular file");
        }
    }
    Some("is not a regular file")
}

impl Input {
    /// Opens `path` for reading: a regular file, or standard input for `-`. Anything else is
    /// `Error::File` naming the path (exit 2).
    pub fn open(path: &Path) -> Result<Input> {
        if path.as_os_str() == "-" {
            return Ok(Input {
                source: Source::Stdin(std::io::stdin()),
                path: path.to_path_buf(),
                len: stdin_file_length(),
            });
        }
        let meta = std::fs::metadata(path).map_err(|e| Error::file(path, e))?;
        if let Some(why) = not_regular(&meta) {
            return Err(Error::file(path, why));
        }
        let mut options = std::fs::OpenOptions::new();
        options.read(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.custom_flags(libc::O_NONBLOCK);
        }
        let file = options.open(path).map_err(|e| Error::file(path, e))?;
        let meta = file.metadata().map_err(|e| Error::file(path, e))?;
        if let Some(why) = not_regular(&meta) {
            return Err(Error::file(path, why));
        }
        Ok(Input {
            source: Source::File(file),
            path: path.to_path_buf(),
            len: Some(meta.len()),
        })
    }

    /// A stream of unknown length named `name`, read as standard input is (the fuzz suite
    /// feeds the readers through it).
    pub fn from_reader(reader: impl Read + Send + 'static, name: &str) -> Input {
        Input {
            source: Source::Stream(Box::new(reader)),
            path: PathBuf::from(name),
            len: None,
        }
    }

    /// Opens `path` and refuses it, before reading, when it holds more than `limit` bytes
    /// (what its format or the tool allows `what` to hold).
    pub fn open_within(path: &Path, what: &str, limit: u64) -> Result<Input> {
        let input = Input::open(path)?;
        if let Some(len) = input.len
            && len > limit
        {
            return Err(Error::file(
                path,
                format!(
                    "holds {len} bytes, more than the {limit} a {what} may hold ({})",
                    crate::error::gib(limit)
                ),
            ));
        }
        Ok(input)
    }

    /// The opened file and its length, for readers that seek; standard input back as it is.
    pub fn into_file(self) -> std::result::Result<(std::fs::File, u64), Input> {
        match self.source {
            Source::File(f) => Ok((f, self.len.unwrap_or(0))),
            Source::Stdin(_) | Source::Stream(_) => Err(self),
        }
    }

    /// The path as given (`-` for standard input).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes in the file, where known (a file, or standard input redirected from one).
    pub fn len(&self) -> Option<u64> {
        self.len
    }

    /// Whether the input is known to hold no bytes (its length known and 0).
    pub fn is_empty(&self) -> bool {
        self.len == Some(0)
    }

    /// Reads exactly `count` bytes into a buffer asked of the host first (`memory`); a shorter
    /// input is `Error::File` saying so.
    pub fn read_exactly(&mut self, count: u64, what: &str) -> Result<Vec<u8>> {
        let len = usize::try_from(count).map_err(|_| {
            Error::file(
                &self.path,
                format!("{what}: {count} bytes do not fit in memory"),
            )
        })?;
        let mut buf = crate::memory::empty_with_capacity::<u8>(what, len)?;
        let got = self
            .by_ref()
            .take(count)
            .read_to_end(&mut buf)
            .map_err(|e| Error::file(&self.path, e))?;
        if (got as u64) < count {
            return Err(Error::file(
                &self.path,
                format!("truncated: {what} of {count} bytes, only {got} there"),
            ));
        }
        Ok(buf)
    }

    /// Refuses an input that goes on after `what`, its last part.
    pub fn expect_end(&mut self, what: &str) -> Result<()> {
        let mut byte = [0u8; 1];
        match self.read(&mut byte) {
            Ok(0) => Ok(()),
            Ok(_) => Err(Error::file(
                &self.path,
                format!("longer than its header says: bytes follow {what}"),
            )),
            Err(e) => Err(Error::file(&self.path, e)),
        }
    }

    /// Reads the whole input, refusing more than `limit` bytes (`what` names the input in the
    /// message); its buffer is asked of the host first.
    pub fn read_all(mut self, what: &str, limit: u64) -> Result<Vec<u8>> {
        let expected = self.len.unwrap_or(0).min(limit);
        let mut buf =
            crate::memory::empty_with_capacity::<u8>(what, usize::try_from(expected).unwrap_or(0))?;
        let got = self
            .by_ref()
            .take(limit.saturating_add(1))
            .read_to_end(&mut buf)
            .map_err(|e| Error::file(&self.path, e))?;
        if got as u64 > limit {
            return Err(Error::file(
                &self.path,
                format!(
                    "more than the {limit} bytes a {what} may hold ({})",
                    crate::error::gib(limit)
                ),
            ));
        }
        Ok(buf)
    }
}

/// The size of standard input when it is a regular file (a shell redirect), so that a bad
/// length is caught before anything is read or written.
pub fn stdin_file_length() -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::fd::AsFd;
        let fd = std::io::stdin().as_fd().try_clone_to_owned().ok()?;
        let meta = std::fs::File::from(fd).metadata().ok()?;
        meta.is_file().then_some(meta.len())
    }
    #[cfg(not(unix))]
    {
        None
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_are_opened() {
        let dir = tempfile::tempdir().unwrap();
        for (path, why) in [
            (Path::new("/dev/zero"), "is a device"),
            (Path::new("/dev/null"), "is a device"),
            (dir.path(), "is a directory"),
        ] {
            let e = Input::open(path).err().expect("refused");
            assert!(matches!(e, Error::File { .. }), "{e}");
            assert!(e.to_string().contains(why), "{e}");
            assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        }
        let fifo = dir.path().join("pipe");
        if std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success())
        {
            // No writer: opening it for reading would block; it is refused at once instead.
            let e = Input::open(&fifo).err().expect("refused");
            assert!(e.to_string().contains("is a FIFO"), "{e}");
        }
        let file = dir.path().join("x.txt");
        std::fs::write(&file, "12345").unwrap();
        let input = Input::open(&file).unwrap();
        assert_eq!(input.len(), Some(5));
        assert_eq!(input.read_all("text", 5).unwrap(), b"12345");
        let e = Input::open_within(&file, "test input", 4).err().unwrap();
        assert!(e.to_string().contains("more than the 4"), "{e}");
        assert!(Input::open(&dir.path().join("absent")).is_err());
    }

    #[test]
    fn exact_reads_refuse_short_and_long_inputs() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("x.bin");
        std::fs::write(&file, [1u8, 2, 3, 4]).unwrap();
        let mut input = Input::open(&file).unwrap();
        assert_eq!(input.read_exactly(3, "the head").unwrap(), [1, 2, 3]);
        assert!(input.expect_end("the head").is_err());
        let mut input = Input::open(&file).unwrap();
        let e = input.read_exactly(5, "the data").unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        let mut input = Input::open(&file).unwrap();
        input.read_exactly(4, "all").unwrap();
        input.expect_end("all").unwrap();
    }
}
