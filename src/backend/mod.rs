//! The Backend trait, the one seam between the precision policy and hardware, and the one
//! run-time choice among the backends.
//!
//! Contract: a backend computes every op with the numerics of `reference` (casts and splits bit
//! for bit, matmuls within `Algorithm::accumulation_tolerance`), reports failures as errors
//! (never plausible data), and never panics on user input. Adding a backend means implementing
//! this trait (device, capabilities, matmul, the casts, timing, and an executor of step plans:
//! every training op reaches a backend as a `plan::Op`) and passing the conformance suite in
//! `tests/`.

//!
//! Layers: this module sits below `train` and above `plan` (the step program a backend's
//! executor runs), `policy`, `algorithm` and `format`; it imports nothing from `train`.
//!
//! - `choice.rs`: the run-time choice of a backend and of a plan's executor
//! - `reference/`: the host truth (matmul, training ops, the host interpreter: its executor)
//! - `wgpu/`, `cuda/`: the device backends, with the same file names for the same roles
//!   (`plan.rs`: the executor, device-resident; `train.rs`: the training kernel launches of its
//!   ops; `cast.rs`: element kernels; `matmul.rs`)

pub mod choice;
#[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
pub mod cuda;
pub mod defs;
pub mod reference;
pub mod sources;
pub mod wgpu;

use crate::algorithm::{Algorithm, MatmulShape};
use crate::error::{Error, Result};
use crate::format::{Format, Overflow};
use crate::plan::{Plan, StepExecutor};
use crate::policy::Capabilities;
use std::fmt;
use std::str::FromStr;
use web_time::Instant;

/// Implementors of `Backend` mark their impl with this attribute (the trait's async ops).
pub use async_trait::async_trait;
pub use choice::{BACKEND_ENV, executor, open, open_cuda, open_device};
pub use reference::Reference;

/// The kinds of backend mantissa knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The host reference (`backend::reference`): defines every algorithm's numbers.
    Reference,
    /// wgpu: WGSL kernels on any GPU (Vulkan, Metal, DX12, the browser), or lavapipe on the CPU.
    Wgpu,
    /// CUDA: cuBLAS and NVRTC kernels on NVIDIA GPUs (the `cuda` feature).
    Cuda,
}

impl BackendKind {
    /// Every kind.
    pub const ALL: [BackendKind; 3] =
        [BackendKind::Reference, BackendKind::Wgpu, BackendKind::Cuda];
    /// Its name, as `--backend` takes it.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Reference => "reference",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the user asked for: a kind, or the best one found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// CUDA where it is built in and a device exists, else the best wgpu adapter (or
    /// `MANTISSA_BACKEND`, where set).
    #[default]
    Auto,
    /// This kind only; its absence is an error.
    Only(BackendKind),
}

impl FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let key = s.trim().to_ascii_lowercase();
        BackendKind::ALL
            .into_iter()
            .find(|k| k.name() == key)
            .ok_or_else(|| Error::UnknownName {
                kind: "backend",
                given: s.to_string(),
                valid: BackendKind::ALL.map(|k| k.name().to_string()).to_vec(),
            })
    }
}

impl FromStr for BackendChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(BackendChoice::Auto);
        }
        s.parse().map(BackendChoice::Only).map_err(|e| match e {
            Error::UnknownName { kind, given, valid } => Error::UnknownName {
                kind,
                given,
                valid: std::iter::once("auto".to_string()).chain(valid).collect(),
            },
            e => e,
        })
    }
}

/// fp8 scales of one batch: one per tensor (length 1) or one per row of A / column of B.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Scales {
    /// A's scales: one (tensorwise) or one per row of A.
    pub a: Vec<f32>,
    /// B's scales: one (tensorwise) or one per column of B.
    pub b: Vec<f32>,
    /// The inner dimension the scales were computed over.
    pub k: usize,
}

impl Fp8Scales {
    /// The scale of A's row `i`.
    pub fn a_for_row(&self, i: usize) -> f32 {
        if self.a.len() == 1 {
            self.a[0]
        } else {
            self.a[i]
        }
    }
    /// The scale of B's column `j`.
    pub fn b_for_col(&self, j: usize) -> f32 {
        if self.b.len() == 1 {
            self.b[0]
        } else {
            self.b[j]
        }
    }
}

/// What a timed matmul starts from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Operands {
    /// f32 operands on the device: their preparation (rounding, encoding, splitting, fp8
    /// scaling and quantization) is timed with the product. What a caller with f32 data pays.
    #[default]
    F32,
    /// Operands already held in the algorithm's storage format (bf16/f16 codes, tf32-rounded
    /// values, split planes, fp8 codes with their scales), as a training step holds them: the
    /// product alone is timed (for fp8, the descale with it). What PyTorch's same-dtype GEMM
    /// is compared with.
    Prepared,
}

impl Operands {
    /// Both, in the order benchmarks list them.
    pub const ALL: [Operands; 2] = [Operands::F32, Operands::Prepared];

    /// Its name, as `--operands` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Operands::F32 => "f32",
            Operands::Prepared => "prepared",
        }
    }
}

impl fmt::Display for Operands {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Operands {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Operands::ALL
            .into_iter()
            .find(|o| o.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| Error::UnknownName {
                kind: "operands",
                given: s.to_string(),
                valid: Operands::ALL.map(|o| o.name().to_string()).to_vec(),
            })
    }
}

/// Timing of a repeated matmul, as a benchmark reports it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MatmulTiming {
    /// Median seconds of one matmul.
    pub seconds: f64,
    /// What was timed: from f32 operands (preparation included), or the product alone from
    /// prepared ones. A backend that cannot time the product alone says `F32` whatever was
    /// asked (the reference: one host function does both).
    pub operands: Operands,
    /// How the time was taken: "gpu-timestamps" or "wall-clock".
    pub clock: &'static str,
    /// Timed matmuls the median is taken over.
    pub repetitions: usize,
    /// Which kernel variant ran ("simt, tile 64x64x16 (autotuned at 1.234 ms)", "coop-matrix
    /// 16x16x16, subgroup 32, block 32x32x16"; "host" on the reference).
    pub variant: String,
    /// The median seconds the autotuner timed the chosen variant at, from f32 operands (their
    /// preparation included), where it chose it (wgpu) and the time was stored.
    pub tuned_seconds: Option<f64>,
}

/// The one seam between policy and hardware. Operands and results are row-major f32 on the host;
/// a backend moves them to and from its device.
///
/// Every op is async, because a GPU answers when it is done: in the browser nothing may block
/// (a readback resolves from the page's event loop), natively callers use `pollster::block_on`.
#[async_trait::async_trait]
pub trait Backend: Send + Sync {
    /// Which kind of backend this is.
    fn kind(&self) -> BackendKind;
    /// Short name shown in tables: "reference", "wgpu:llvmpipe (Vulkan)", "cuda:NVIDIA H100".
    fn name(&self) -> String;
    /// The device in words.
    fn device_name(&self) -> String;
    /// What the backend runs fast: the algorithms it accelerates (which drive the
    /// precision-class resolution, `PrecisionClass::resolve`) and where its executor fuses
    /// attention into one op.
    fn capabilities(&self) -> Capabilities;
    /// Device memory (free, in all) in bytes, where the backend can say (CUDA; wgpu has no
    /// such query): a step plan that cannot fit is refused before it allocates.
    fn memory_available(&self) -> Option<(u64, u64)> {
        None
    }

    /// C = op(A) . op(B) under `algorithm`.
    async fn matmul(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        a: &[f32],
        b: &[f32],
    ) -> Result<Vec<f32>>;

    /// Encodes f32 values into `format` (one bit pattern per value, in the low bits).
    async fn encode(&self, format: Format, overflow: Overflow, x: &[f32]) -> Result<Vec<u32>>;
    /// Decodes bit patterns of `format` to f32.
    async fn decode(&self, format: Format, bits: &[u32]) -> Result<Vec<f32>>;
    /// The bf16 split x = h + m + l, as three planes of bf16 bit patterns.
    async fn split_bf16(&self, x: &[f32]) -> Result<[Vec<u32>; 3]>;
    /// Largest finite magnitude (0 if none).
    async fn amax(&self, x: &[f32]) -> Result<f32>;

    /// Times `repetitions` matmuls from `operands`. The default times whole calls on the wall
    /// clock (preparation included, whatever `operands` asks); device backends override it to
    /// keep operands resident and time the device work only.
    async fn time_matmul(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        a: &[f32],
        b: &[f32],
        repetitions: usize,
        operands: Operands,
    ) -> Result<MatmulTiming> {
        let _ = operands;
        let mut times = Vec::with_capacity(repetitions);
        for _ in 0..repetitions.max(1) {
            let start = Instant::now();
            self.matmul(shape, algorithm, a, b).await?;
            times.push(start.elapsed().as_secs_f64());
        }
        Ok(MatmulTiming {
            seconds: median(&mut times),
            operands: Operands::F32,
            clock: "wall-clock",
            repetitions: times.len(),
            variant: "host".into(),
            tuned_seconds: None,
        })
    }

    /// The backend's executor of a step plan: the one way an op reaches the backend
    /// (`plan::Op`). Its tensors are kept where the backend computes (device-resident on a GPU,
    /// each step one submission; host memory on the reference, whose executor, the host
    /// interpreter, defines every op's numbers). Any plan `PlanBuilder::finish` made runs, or
    /// is refused here with the op the device cannot run.
    fn executor<'a>(&'a self, plan: Plan) -> Result<Box<dyn StepExecutor + 'a>>;
}

/// The median of `values` (the upper one of an even count; NaN where empty), sorting them in place.
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}
