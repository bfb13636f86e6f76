//! One error type for the whole library. Messages carry the numbers (shapes, sizes, limits) so a
//! user can act on them without a debugger.

use thiserror::Error;

/// The library's result: `Error` unless said otherwise.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every error the library returns. `class` sorts it into bad input, a failure of the machine, a
/// contract break or a diverged run (the CLI's exit code and the Python exception follow from it).
#[derive(Debug, Error)]
pub enum Error {
    /// A name (preset, format, algorithm, backend...) that is not one of the known ones.
    #[error("unknown {kind} '{given}'; valid: {}", valid.join(", "))]
    UnknownName {
        /// What the name names ("format", "preset").
        kind: &'static str,
        /// The name as given.
        given: String,
        /// The names that would have been accepted.
        valid: Vec<String>,
    },

    /// An argument out of its range or inconsistent with the others.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// The argument ("batch", "learning rate").
        what: &'static str,
        /// What is wrong with it, with the numbers.
        why: String,
    },

    /// Matmul operands whose inner dimensions differ.
    #[error(
        "matmul shapes do not match: A is {a_rows}x{a_cols}, B is {b_rows}x{b_cols} (A's columns must equal B's rows)"
    )]
    ShapeMismatch {
        /// Rows of A.
        a_rows: usize,
        /// Columns of A.
        a_cols: usize,
        /// Rows of B.
        b_rows: usize,
        /// Columns of B.
        b_cols: usize,
    },

    /// A buffer whose length is not the one its shape asks for.
    #[error("{what}: expected {expected} values, got {got}")]
    LengthMismatch {
        /// The buffer ("A", "the batch's ids").
        what: &'static str,
        /// Elements its shape asks for.
        expected: usize,
        /// Elements given.
        got: usize,
    },

    /// A hardware feature (shader-f16, cooperative matrices...) that the adapter lacks, where
    /// native execution was asked for instead of the emulated fallback.
    #[error(
        "{feature} is not offered by adapter '{adapter}' and native execution was requested; fallback: {fallback}"
    )]
    MissingFeature {
        /// The feature asked for.
        feature: &'static str,
        /// The adapter's name.
        adapter: String,
        /// What runs without it.
        fallback: &'static str,
    },

    /// An operand, buffer or dispatch larger than a limit of the device.
    #[error(
        "{what} needs {requested} bytes but {limit_name} on '{device}' is {limit} bytes; use smaller operands"
    )]
    TooLarge {
        /// The buffer.
        what: String,
        /// Bytes it needs.
        requested: u64,
        /// Bytes the device allows.
        limit: u64,
        /// The limit's name (as wgpu's `Limits` spells it).
        limit_name: &'static str,
        /// The device's name.
        device: String,
    },

    /// A kernel that would run more loop iterations per invocation than its adapter lets a
    /// shader run (`backend::wgpu::budget`), where the work cannot be split to fit.
    #[error(
        "{what} runs {iterations} loop iterations per invocation, but '{device}' stops a shader's loops after {budget} (half of which a kernel may plan on); {advice}"
    )]
    LoopBudget {
        /// The kernel and its shape.
        what: String,
        /// Loop iterations one invocation would run.
        iterations: u64,
        /// Loop iterations the adapter lets a shader run.
        budget: u32,
        /// The device's name.
        device: String,
        /// What to do instead.
        advice: String,
    },

    /// A backend (wgpu, CUDA, MPI) that cannot run here: no adapter or driver, or not built in.
    #[error("backend '{backend}' is not available: {why}")]
    BackendUnavailable {
        /// The backend's name.
        backend: String,
        /// Why it is absent.
        why: String,
    },

    /// A fault the device reported (other than running out of memory).
    #[error("GPU error on '{device}' during {op}: {fault}")]
    Device {
        /// The device's name.
        device: String,
        /// What was running (`during` prefixes the caller's context).
        op: String,
        /// The device library's own error.
        #[source]
        fault: Box<DeviceFault>,
    },

    /// The device ran out of memory: told apart by the fault's type, never by its text.
    #[error(
        "out of device memory on '{device}' during {op}{}: {fault}; use smaller operands or a smaller batch",
        total_bytes.map(|t| format!(" ({:.1} GiB in all)", t as f64 / (1u64 << 30) as f64)).unwrap_or_default()
    )]
    OutOfMemory {
        /// The device's name.
        device: String,
        /// What was running (`during` prefixes the caller's context).
        op: String,
        /// The device's total memory in bytes, where known.
        total_bytes: Option<u64>,
        /// The device library's own error.
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
        /// The device's name.
        device: String,
        /// The batch the plan was built for (sequences per step).
        batch: usize,
        /// Bytes of device memory the plan needs.
        needed_bytes: u64,
        /// What the plan may take, in words ("only 3.5 GiB are free").
        available: String,
        /// What to do instead (a smaller batch that fits, and what it needs).
        advice: String,
    },

    /// A kernel (WGSL, or CUDA C through NVRTC) that failed to compile: a defect of the library
    /// or of the driver, not of the input.
    #[error("shader '{kernel}' failed to compile:\n{log}")]
    ShaderCompile {
        /// The kernel's name.
        kernel: String,
        /// The compiler's log.
        log: String,
    },

    /// An input file that cannot be used: absent, not a regular file, larger than its format
    /// allows, malformed.
    #[error("{path}: {why}")]
    File {
        /// The file as given.
        path: String,
        /// What is wrong with it.
        why: String,
    },

    /// An output that cannot be written (a failure of the machine, not of the input).
    #[error("{path}: {why}")]
    Output {
        /// The file as given.
        path: String,
        /// Why it could not be written.
        why: String,
    },

    /// Host memory that the system does not have for a size asked from outside (`memory.rs`):
    /// `bytes` is None where the size does not even fit in 64 bits.
    #[error(
        "out of host memory: {what} needs {}{}; use smaller operands or a smaller batch",
        bytes.map_or("more than 2^64 bytes".to_string(), |b| format!("{b} bytes ({})", gib(b))),
        available.map_or(String::new(), |a| format!(", and {} are available", gib(a)))
    )]
    HostOutOfMemory {
        /// What the memory was for.
        what: String,
        /// Bytes asked for; None where the size overflows 64 bits.
        bytes: Option<u64>,
        /// Bytes the system has available, where known.
        available: Option<u64>,
    },

    /// A training run that cannot go on: its loss or gradients went non-finite with nothing to
    /// absorb it (no loss scaling). `step` counts from the run's start, resumed steps included.
    #[error("training under {preset} stopped at step {step}: {why}")]
    Diverged {
        /// The precision preset of the run.
        preset: String,
        /// The step that went non-finite, counted from the run's start.
        step: u32,
        /// What went non-finite.
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
        /// The algorithm whose contract broke.
        algorithm: String,
        /// Elements outside their tolerance.
        count: usize,
        /// The whole product's error outside its band, in words, where it is.
        whole: Option<String>,
    },

    /// Another rank of a data-parallel run failed; its message, and its error's class.
    #[error("rank {rank} failed: {message}")]
    Rank {
        /// The failed rank.
        rank: usize,
        /// Its error's class (this error takes it on).
        class: ErrorClass,
        /// Its error's message.
        message: String,
    },

    /// A collective between the ranks failed (the engine's own error).
    #[error("{engine} {op} failed: {why}")]
    Collective {
        /// The collective engine ("MPI", "NCCL").
        engine: &'static str,
        /// The collective that failed.
        op: String,
        /// The engine's message.
        why: String,
    },

    /// An I/O error with nothing more to add (a failure of the machine).
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// What a device reported, as the reporting library's own error: kept as the source of
/// `Error::Device` and `Error::OutOfMemory`, so callers can match on it.
#[derive(Debug, Error)]
pub enum DeviceFault {
    /// An error wgpu reported through its error scopes (validation, out of memory, internal).
    #[error(transparent)]
    Wgpu(#[from] wgpu::Error),
    /// The adapter refused a device.
    #[error(transparent)]
    RequestDevice(#[from] wgpu::RequestDeviceError),
    /// Waiting on the device failed.
    #[error(transparent)]
    Poll(#[from] wgpu::PollError),
    /// Mapping a buffer for reading failed.
    #[error(transparent)]
    Map(#[from] wgpu::BufferAsyncError),
    /// Reading a mapped range failed.
    #[error(transparent)]
    MapRange(#[from] wgpu::MapRangeError),
    /// An error of the CUDA driver.
    #[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
    #[error(transparent)]
    Cuda(#[from] cudarc::driver::DriverError),
    /// An error of cuBLAS.
    #[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
    #[error(transparent)]
    Cublas(#[from] cudarc::cublas::result::CublasError),
    /// An error of cuBLASLt.
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
    /// What kind of failure this is (a `Rank` error takes the failed rank's class).
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

    /// An `Invalid` error: `what` is the argument, `why` what is wrong with it.
    pub fn invalid(what: &'static str, why: impl Into<String>) -> Error {
        Error::Invalid {
            what,
            why: why.into(),
        }
    }

    /// A `File` error: an input file that cannot be used, and why.
    pub fn file(path: impl AsRef<std::path::Path>, why: impl std::fmt::Display) -> Error {
        Error::File {
            path: path.as_ref().display().to_string(),
            why: why.to_string(),
        }
    }

    /// An `Output` error: an output that cannot be written, and why.
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
