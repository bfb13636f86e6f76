//! The kernels' source files: built into the binary from `shaders/` and `cuda/`, or read from
//! `MANTISSA_KERNEL_DIR` at run time, so that on a machine with a GPU one edits a shader and
//! reruns a release binary built beforehand (docs/wgpu.md, "Kernel iteration").
//!
//! The directory holds any of the files by name, flat or in `shaders/` and `cuda/` as in the
//! repository (`cp -r shaders cuda DIR`); a file it holds replaces the built-in copy, the others
//! stay built in. It is read once per process, and refused whole, with the file named, where it
//! is not a directory, a file is not UTF-8, a `.wgsl`, `.cu` or `.cuh` file is not one of the
//! kernels' (a misspelt name would otherwise change nothing, silently), a file is there twice,
//! or none of the kernels' files is there. What a backend does with a replaced kernel that does
//! not validate, compile or compute its numbers: the built-in one, said once
//! (`Sources::refuse`).

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

/// The environment variable naming the directory of replacement kernel sources.
pub const KERNEL_DIR_ENV: &str = "MANTISSA_KERNEL_DIR";

/// Which backend a source file belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// WGSL, under `shaders/`.
    Wgsl,
    /// CUDA, under `cuda/`.
    Cuda,
}

impl Family {
    /// The repository folder of its files.
    pub fn folder(self) -> &'static str {
        match self {
            Family::Wgsl => "shaders",
            Family::Cuda => "cuda",
        }
    }
}

/// One kernel source file and its built-in text.
pub struct SourceFile {
    /// Its file name ("matmul.wgsl").
    pub name: &'static str,
    /// Its backend.
    pub family: Family,
    builtin: &'static str,
}

macro_rules! files {
    ($($family:ident $folder:literal $name:literal),* $(,)?) => {
        /// Every kernel source file, as the repository holds it.
        pub const FILES: &[SourceFile] = &[$(SourceFile {
            name: $name,
            family: Family::$family,
            builtin: include_str!(concat!("../../", $folder, "/", $name)),
        }),*];
    };
}

files! {
    Wgsl "shaders" "formats.wgsl",
    Wgsl "shaders" "cast.wgsl",
    Wgsl "shaders" "scale.wgsl",
    Wgsl "shaders" "split.wgsl",
    Wgsl "shaders" "matmul.wgsl",
    Wgsl "shaders" "matmul_step.wgsl",
    Wgsl "shaders" "fetch.wgsl",
    Wgsl "shaders" "matmul_coop.wgsl",
    Wgsl "shaders" "coop_block.wgsl",
    Wgsl "shaders" "coop_pack.wgsl",
    Wgsl "shaders" "train.wgsl",
    Wgsl "shaders" "attention.wgsl",
    Wgsl "shaders" "attention_coop.wgsl",
    Wgsl "shaders" "step.wgsl",
    Wgsl "shaders" "unary.wgsl",
    Wgsl "shaders" "epilogue.wgsl",
    Wgsl "shaders" "loop_probe.wgsl",
    Cuda "cuda" "formats.cuh",
    Cuda "cuda" "mma.cuh",
    Cuda "cuda" "cast.cu",
    Cuda "cuda" "scale.cu",
    Cuda "cuda" "train.cu",
    Cuda "cuda" "attention.cu",
    Cuda "cuda" "matmul_split_bf16.cu",
}

/// The file named `name` (one of `FILES`).
fn file(name: &str) -> &'static SourceFile {
    FILES
        .iter()
        .find(|f| f.name == name)
        .unwrap_or_else(|| panic!("{name} is not a kernel source file"))
}

/// The kernel sources a kernel is built from: the built-in ones, or those with the replacements
/// `MANTISSA_KERNEL_DIR` holds.
#[derive(Clone, Copy, Debug)]
pub enum Sources {
    /// The files as built into the binary.
    Builtin,
    /// The files of `MANTISSA_KERNEL_DIR` where it holds them, else the built-in ones.
    Current,
}

impl Sources {
    /// The text of the file `name` (one of `FILES`; a name that is not is a bug, and panics).
    pub fn text(self, name: &str) -> &'static str {
        let builtin = file(name).builtin;
        match self {
            Sources::Builtin => builtin,
            Sources::Current => match replacements() {
                Ok(Some(r)) if !refused(name) => r.files.get(name).copied().unwrap_or(builtin),
                _ => builtin,
            },
        }
    }

    /// Whether any of `names` is replaced (so a kernel built from them differs from the
    /// built-in one).
    pub fn replaces_any(self, names: &[&str]) -> bool {
        matches!(self, Sources::Current)
            && matches!(replacements(), Ok(Some(r))
                if names.iter().any(|n| r.files.contains_key(n) && !refused(n)))
    }

    /// Refuses the replaced files among `names` for the rest of the process: their built-in
    /// copies are used from now on. Says so once, with `why` (a check the kernels built from
    /// them failed).
    pub fn refuse_files(names: &[&str], why: &str) {
        let Ok(Some(r)) = replacements() else {
            return;
        };
        let mut newly = Vec::new();
        if let Ok(mut refused) = REFUSED.lock() {
            for &name in names {
                if let Some((&file, _)) = r.files.get_key_value(name)
                    && !refused.contains(&file)
                {
                    refused.push(file);
                    newly.push(file);
                }
            }
        }
        if !newly.is_empty() {
            eprintln!(
                "warning: {KERNEL_DIR_ENV}: {} refused, the built-in copies run: {}",
                newly.join(", "),
                why.trim()
            );
        }
    }

    /// Says on standard error that `kernel` built from replaced sources was refused (`why`)
    /// and its built-in version runs instead: once per reason, so that one error in a file
    /// shared by many kernel variants is said once, for the first of them.
    pub fn refuse(kernel: &str, why: &str) {
        static SAID: Mutex<Vec<String>> = Mutex::new(Vec::new());
        if let Ok(mut said) = SAID.lock() {
            if said.iter().any(|w| w == why) {
                return;
            }
            said.push(why.to_string());
        }
        eprintln!(
            "warning: {KERNEL_DIR_ENV}: {kernel} from the replaced sources is refused (and any \
             other kernel that fails the same way), the built-in one runs: {}",
            why.trim()
        );
    }
}

/// Replaced files refused since (`Sources::refuse_files`).
static REFUSED: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

/// Whether the replaced file `name` has been refused.
fn refused(name: &str) -> bool {
    REFUSED.lock().is_ok_and(|r| r.contains(&name))
}

/// The files `MANTISSA_KERNEL_DIR` replaces, read once.
#[derive(Debug)]
pub struct Replacements {
    /// The directory, as given.
    pub dir: String,
    /// Replaced files by name, with their text.
    pub files: BTreeMap<&'static str, &'static str>,
    /// A short hash of the replaced files' names and texts: tuned choices made with them are
    /// stored apart from those of the built-in kernels (`tune::Tuner`).
    pub fingerprint: String,
}

/// The replacements `MANTISSA_KERNEL_DIR` names (None where it is unset or empty), read once per
/// process; an error names the directory or the file at fault.
pub fn replacements() -> Result<Option<&'static Replacements>> {
    static READ: OnceLock<std::result::Result<Option<&'static Replacements>, String>> =
        OnceLock::new();
    READ.get_or_init(|| match std::env::var(KERNEL_DIR_ENV) {
        Ok(dir) if !dir.trim().is_empty() => read_dir(&dir)
            .map(|r| Some(&*Box::leak(Box::new(r))))
            .map_err(|e| e.to_string()),
        _ => Ok(None),
    })
    .clone()
    .map_err(|why| Error::invalid(KERNEL_DIR_ENV, why))
}

/// Reads the replacement files of `dir` (native only: the browser has no directories).
#[cfg(not(target_arch = "wasm32"))]
pub fn read_dir(dir: &str) -> std::result::Result<Replacements, String> {
    use std::path::Path;
    let root = Path::new(dir);
    if !root.is_dir() {
        return Err(format!("{dir:?} is not a directory"));
    }
    let known = || FILES.iter().map(|f| f.name).collect::<Vec<_>>().join(", ");
    let mut files = BTreeMap::new();
    for (folder, family) in [
        (root.to_path_buf(), None),
        (root.join("shaders"), Some(Family::Wgsl)),
        (root.join("cuda"), Some(Family::Cuda)),
    ] {
        let Ok(entries) = std::fs::read_dir(&folder) else {
            continue;
        };
        let mut entries: Vec<_> = entries.filter_map(|e| e.ok()).collect();
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let kernel_like = [".wgsl", ".cu", ".cuh"].iter().any(|x| name.ends_with(x));
            if !kernel_like || !path.is_file() {
                continue;
            }
            let Some(f) = FILES
                .iter()
                .find(|f| f.name == name && family.is_none_or(|fam| fam == f.family))
            else {
                return Err(format!(
                    "{} is not a kernel source file of {}; the files are: {}",
                    path.display(),
                    family.map_or("mantissa", Family::folder),
                    known()
                ));
            };
            if files.contains_key(f.name) {
                return Err(format!(
                    "{} is there twice (flat and in {}/): keep one",
                    f.name,
                    f.family.folder()
                ));
            }
            let text =
                std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            files.insert(f.name, &*Box::leak(text.into_boxed_str()));
        }
    }
    if files.is_empty() {
        return Err(format!(
            "{dir:?} holds none of the kernel source files (flat, or in shaders/ and cuda/): {}",
            known()
        ));
    }
    let fingerprint = {
        let mut hash = crc32fast::Hasher::new();
        for (name, text) in &files {
            hash.update(name.as_bytes());
            hash.update(&[0]);
            hash.update(text.as_bytes());
            hash.update(&[0]);
        }
        format!("{:08x}", hash.finalize())
    };
    Ok(Replacements {
        dir: dir.to_string(),
        files,
        fingerprint,
    })
}

/// The browser has no directories to read kernels from.
#[cfg(target_arch = "wasm32")]
pub fn read_dir(dir: &str) -> std::result::Result<Replacements, String> {
    Err(format!(
        "{dir:?}: kernel sources cannot be read from a directory in the browser"
    ))
}

/// A line for `mantissa info`: which files are replaced, from where.
pub fn describe() -> String {
    match replacements() {
        Ok(None) => "built in".into(),
        Ok(Some(r)) => format!(
            "{} file(s) from {} (fingerprint {}): {}",
            r.files.len(),
            r.dir,
            r.fingerprint,
            r.files.keys().copied().collect::<Vec<_>>().join(", ")
        ),
        Err(e) => format!("refused: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_is_listed_once_and_the_builtin_text_is_the_repository_file() {
        for (i, f) in FILES.iter().enumerate() {
            assert!(FILES[..i].iter().all(|g| g.name != f.name), "{}", f.name);
            let path = format!(
                "{}/{}/{}",
                env!("CARGO_MANIFEST_DIR"),
                f.family.folder(),
                f.name
            );
            assert_eq!(std::fs::read_to_string(&path).unwrap(), f.builtin, "{path}");
        }
        // And every kernel file of the repository is listed.
        for folder in ["shaders", "cuda"] {
            let dir = format!("{}/{folder}", env!("CARGO_MANIFEST_DIR"));
            for e in std::fs::read_dir(dir).unwrap() {
                let name = e.unwrap().file_name().to_string_lossy().into_owned();
                if [".wgsl", ".cu", ".cuh"].iter().any(|x| name.ends_with(x)) {
                    assert!(FILES.iter().any(|f| f.name == name), "{folder}/{name}");
                }
            }
        }
    }

    #[test]
    fn a_directory_replaces_the_files_it_holds_and_refuses_what_it_cannot_use() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_str().unwrap().to_string();
        // Empty: refused, naming the files it should hold.
        let e = read_dir(&path).unwrap_err();
        assert!(
            e.contains("none of the kernel source files") && e.contains("matmul.wgsl"),
            "{e}"
        );
        // Flat and in the repository's folders.
        std::fs::write(dir.path().join("unary.wgsl"), "// mine\n").unwrap();
        std::fs::create_dir(dir.path().join("cuda")).unwrap();
        std::fs::write(dir.path().join("cuda/train.cu"), "// mine too\n").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not a kernel").unwrap();
        let r = read_dir(&path).unwrap();
        assert_eq!(
            r.files.keys().copied().collect::<Vec<_>>(),
            ["train.cu", "unary.wgsl"]
        );
        assert_eq!(r.files["unary.wgsl"], "// mine\n");
        let fingerprint = r.fingerprint.clone();
        std::fs::write(dir.path().join("unary.wgsl"), "// mine, edited\n").unwrap();
        assert_ne!(read_dir(&path).unwrap().fingerprint, fingerprint);
        // A misspelt kernel would change nothing: refused with its path and the names.
        std::fs::write(dir.path().join("matmull.wgsl"), "").unwrap();
        let e = read_dir(&path).unwrap_err();
        assert!(
            e.contains("matmull.wgsl") && e.contains("matmul_coop.wgsl"),
            "{e}"
        );
        std::fs::remove_file(dir.path().join("matmull.wgsl")).unwrap();
        // A WGSL file in cuda/ is not a CUDA kernel.
        std::fs::write(dir.path().join("cuda/step.wgsl"), "").unwrap();
        let e = read_dir(&path).unwrap_err();
        assert!(e.contains("step.wgsl") && e.contains("of cuda"), "{e}");
        std::fs::remove_file(dir.path().join("cuda/step.wgsl")).unwrap();
        // The same file twice.
        std::fs::write(dir.path().join("train.cu"), "").unwrap();
        let e = read_dir(&path).unwrap_err();
        assert!(e.contains("train.cu is there twice"), "{e}");
        std::fs::remove_file(dir.path().join("train.cu")).unwrap();
        // Not UTF-8.
        std::fs::write(dir.path().join("step.wgsl"), [0xff, 0xfe]).unwrap();
        let e = read_dir(&path).unwrap_err();
        assert!(e.contains("step.wgsl"), "{e}");
        // Not a directory.
        let e = read_dir(&format!("{path}/unary.wgsl")).unwrap_err();
        assert!(e.contains("not a directory"), "{e}");
    }
}
