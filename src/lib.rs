//! mantissa: a portable mixed-precision compute engine.
//!
//! The same precision-controlled math on any GPU: matmul algorithms (f32, tf32, bf16, f16,
//! split-bf16 x3/x6/x9, fp8-emulated e4m3/e5m2 with scales) as WGSL shaders through wgpu, a host
//! reference that defines the numbers, and one precision-policy API over every backend.
//!
//! - [`format`](mod@format): bit-exact number formats and `finfo`.
//! - [`algorithm`]: matmul algorithms and their specification.
//! - [`policy`]: precision classes, presets, autocast, loss scaling, fp8 recipes.
//! - [`plan`]: the step program (ops on numbered tensors) and the executor contract.
//! - [`backend`]: the Backend trait, the host reference, the wgpu and CUDA backends, run-time
//!   choice.
//! - [`dist`]: the ranks of a data-parallel run and their collectives (MPI, NCCL).
//! - [`train`]: the GPT, its training loop and checkpoints, above the backends.
//!
//! Layers, top to bottom (no import runs back up; docs/design.md draws them):
//! cli, web -> report, bench -> train -> backend -> plan -> dist, policy -> algorithm -> format.

pub mod algorithm;
pub mod backend;
pub mod bench;
pub mod cache;
#[cfg(not(target_arch = "wasm32"))]
pub mod cli;
pub mod dist;
pub mod error;
pub mod format;
pub mod input;
pub mod measure;
pub mod memory;
pub mod model;
pub mod npy;
pub mod output;
pub mod plan;
pub mod policy;
pub mod report;
pub mod train;
pub mod tune;

pub use algorithm::{Algorithm, MatmulShape, Scaling};
pub use backend::{Backend, BackendChoice, BackendKind};
pub use error::{Error, Result};
pub use format::{Format, Overflow};
pub use npy::Matrix;
pub use policy::{Capabilities, PrecisionClass, Preset};
