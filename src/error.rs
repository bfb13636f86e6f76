//! One error type for the whole library. Messages carry the numbers (shapes, sizes, limits) so a
//! user can act on them without a debugger.

use thiserror::Error;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Error)]
pub enum Error {
    #[error("unknown {kind} '{given}'; valid: {}", valid.join(", "))]
    UnknownName {
        kind: &'static str,
        given: String,
        valid: Vec<String>,
    },

    #[error("invalid {what}: {why}")]
    Invalid { what: &'static str, why: String },

    #[error(
        "matmul shapes do not match: A is {a_rows}x{a_cols}, B is {b_rows}x{b_cols} (A's columns must equal B's rows)"
    )]
    ShapeMismatch {
        a_rows: usize,
        a_cols: usize,
        b_rows: usize,
        b_cols: usize,
    },

    #[error("{what}: expected {expected} values, got {got}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },

    #[error("{op} is not supported on {backend}: {why}")]
    Unsupported {
        op: String,
        backend: String,
        why: String,
    },

    #[error(
        "{feature} is not offered by adapter '{adapter}' and native execution was requested; fallback: {fallback}"
    )]
    MissingFeature {
        feature: &'static str,
        adapter: String,
        fallback: &'static str,
    },

    #[error(
        "{what} needs {requested} bytes but {limit_name} on '{device}' is {limit} bytes; use smaller operands"
    )]
    TooLarge {
        what: String,
        requested: u64,
        limit: u64,
        limit_name: &'static str,
        device: String,
    },

    #[error("backend '{backend}' is not available: {why}")]
    BackendUnavailable { backend: String, why: String },

    #[error("GPU error on '{device}': {message}")]
    Device { device: String, message: String },

    #[error("shader '{kernel}' failed to compile:\n{log}")]
    ShaderCompile { kernel: String, log: String },

    #[error("{path}: {why}")]
    File { path: String, why: String },

    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl Error {
    pub fn invalid(what: &'static str, why: impl Into<String>) -> Error {
        Error::Invalid {
            what,
            why: why.into(),
        }
    }

    pub fn file(path: impl AsRef<std::path::Path>, why: impl std::fmt::Display) -> Error {
        Error::File {
            path: path.as_ref().display().to_string(),
            why: why.to_string(),
        }
    }
}
