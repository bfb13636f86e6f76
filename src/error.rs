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

    #[error("GPU error on '{device}' during {op}: {fault}")]
    Device {
        device: String,
        op: String,
        #[source]
        fault: Box<DeviceFault>,
    },

    /// The device ran out of memory: told apart by the fault's type, never by its text.
    #[error(
        "out of device memory on '{device}' during {op}{}: {fault}; use smaller operands or a smaller batch",
        total_bytes.map(|t| format!(" ({:.1} GiB in all)", t as f64 / (1u64 << 30) as f64)).unwrap_or_default()
    )]
    OutOfMemory {
        device: String,
        op: String,
        total_bytes: Option<u64>,
        #[source]
        fault: Box<DeviceFault>,
    },

    /// A step plan that does not fit the device memory it may take, found before anything of
    /// it is allocated (or when the allocation failed).
    #[error(
        "the step plan needs {} of device memory on '{device}' for a batch of {batch}, {available}; {advice}",
        gib(*needed_bytes)
    )]
    PlanTooLarge {
        device: String,
        batch: usize,
        needed_bytes: u64,
        /// What the plan may take, in words ("only 3.5 GiB are free").
        available: String,
        /// What to do instead (a smaller batch that fits, and what it needs).
        advice: String,
    },

    #[error("shader '{kernel}' failed to compile:\n{log}")]
    ShaderCompile { kernel: String, log: String },

    /// An input file that cannot be used: absent, not a regular file, larger than its format
    /// allows, malformed.
    #[error("{path}: {why}")]
    File { path: String, why: String },

    /// An output that cannot be written (a failure of the machine, not of the input).
    #[error("{path}: {why}")]
    Output { path: String, why: String },

    /// Host memory that the system does not have for a size asked from outside (`memory.rs`):
    /// `bytes` is None where the size does not even fit in 64 bits.
    #[error(
        "out of host memory: {what} needs {}{}; use smaller operands or a smaller batch",
        bytes.map_or("more than 2^64 bytes".to_string(), |b| format!("{b} bytes ({})", gib(b))),
        available.map_or(String::new(), |a| format!(", and {} are available", gib(a)))
    )]
    HostOutOfMemory {
        what: String,
        bytes: Option<u64>,
        available: Option<u64>,
    },

    /// A training run that cannot go on: its loss or gradients went non-finite with nothing to
    /// absorb it (no loss scaling). `step` counts from the run's start, resumed steps included.
    #[error("training under {preset} stopped at step {step}: {why}")]
    Diverged {
        preset: String,
        step: u32,
        why: String,
    },

    /// A result outside the numerics contract (`matmul --check`): not bad input, a wrong answer.
    /// `count` elements outside their tolerance, and `whole`: the whole product outside its
    /// band, in words, where it is.
    #[error(
        "{} the {algorithm} contract against the reference{}",
        match (count, whole) {
            (0, Some(_)) => "the whole product breaks".to_string(),
            (n, Some(_)) => format!("{n} element(s) and the whole product break"),
            (n, None) => format!("{n} element(s) break"),
        },
        whole.as_ref().map_or(String::new(), |w| format!(": {w}"))
    )]
    ContractBreak {
        algorithm: String,
        count: usize,
        whole: Option<String>,
    },

    /// Another rank of a data-parallel run failed; its message, and its error's class.
    #[error("rank {rank} failed: {message}")]
    Rank {
        rank: usize,
        class: ErrorClass,
        message: String,
    },

    /// A collective between the ranks failed (the engine's own error).
    #[error("{engine} {op} failed: {why}")]
    Collective {
        engine: &'static str,
        op: String,
        why: String,
    },

    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// What a device reported, as the reporting library's own error: kept as the source of
/// `Error::Device` and `Error::OutOfMemory`, so callers can match on it.
#[derive(Debug, Error)]
pub enum DeviceFault {
    #[error(transparent)]
    Wgpu(#[from] wgpu::Error),
    #[error(transparent)]
    RequestDevice(#[from] wgpu::RequestDeviceError),
    #[error(transparent)]
    Poll(#[from] wgpu::PollError),
    #[error(transparent)]
    Map(#[from] wgpu::BufferAsyncError),
    #[error(transparent)]
    MapRange(#[from] wgpu::MapRangeError),
    #[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
    #[error(transparent)]
    Cuda(#[from] cudarc::driver::DriverError),
    #[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
    #[error(transparent)]
    Cublas(#[from] cudarc::cublas::result::CublasError),
    #[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
    #[error(transparent)]
    CublasLt(#[from] cudarc::cublaslt::result::CublasError),
    /// The device stopped answering (a closed channel, a lost device) with nothing more said.
    #[error("{0}")]
    Lost(&'static str),
}

impl DeviceFault {
    /// Whether the fault is the device running out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            DeviceFault::Wgpu(wgpu::Error::OutOfMemory { .. }) => true,
            #[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
            DeviceFault::Cuda(e) => e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            #[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
            DeviceFault::Cublas(e) => {
                e.0 == cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED
            }
            _ => false,
        }
    }
}

/// Bytes in GiB or MiB, as messages show them: "3.55 GiB", "7.5 MiB".
pub fn gib(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// What kind of failure an error is: the CLI's exit code and the Python exception type follow
/// from it, so both front ends classify alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    /// Unknown names, malformed files, mismatched shapes, arguments out of range.
    BadInput,
    /// No device, device faults, out of memory, files that cannot be read or written.
    Machine,
    /// A result outside the numerics contract.
    ContractBreak,
    /// A training run whose loss or gradients went non-finite.
    Diverged,
}

impl Error {
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::Device { .. }
            | Error::OutOfMemory { .. }
            | Error::PlanTooLarge { .. }
            | Error::ShaderCompile { .. }
            | Error::BackendUnavailable { .. }
            | Error::Collective { .. }
            | Error::Output { .. }
            | Error::HostOutOfMemory { .. }
            | Error::Io(_) => ErrorClass::Machine,
            Error::Rank { class, .. } => *class,
            Error::ContractBreak { .. } => ErrorClass::ContractBreak,
            Error::Diverged { .. } => ErrorClass::Diverged,
            _ => ErrorClass::BadInput,
        }
    }

    /// The same error with `context` before the op it names (device faults only).
    pub fn during(self, context: impl std::fmt::Display) -> Error {
        match self {
            Error::Device { device, op, fault } => Error::Device {
                device,
                op: format!("{context}: {op}"),
                fault,
            },
            Error::OutOfMemory {
                device,
                op,
                total_bytes,
                fault,
            } => Error::OutOfMemory {
                device,
                op: format!("{context}: {op}"),
                total_bytes,
                fault,
            },
            e => e,
        }
    }

    /// A fault of `device` during `op`: `OutOfMemory` where it is one (with the device's total
    /// memory where known), else `Device`.
    pub fn device(
        device: impl Into<String>,
        op: impl Into<String>,
        fault: impl Into<DeviceFault>,
        total_bytes: Option<u64>,
    ) -> Error {
        // Boxed: wgpu's errors are large, and every `Result` carries an `Error`.
        let (device, op, fault) = (device.into(), op.into(), Box::new(fault.into()));
        if fault.is_out_of_memory() {
            Error::OutOfMemory {
                device,
                op,
                total_bytes,
                fault,
            }
        } else {
            Error::Device { device, op, fault }
        }
    }

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

    pub fn output(path: impl AsRef<std::path::Path>, why: impl std::fmt::Display) -> Error {
        Error::Output {
            path: path.as_ref().display().to_string(),
            why: why.to_string(),
        }
    }

    /// Whether the error is memory running out, the host's or a device's (Python raises
    /// `MemoryError` for these).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            Error::OutOfMemory { .. } | Error::HostOutOfMemory { .. } | Error::PlanTooLarge { .. }
        )
    }
}
