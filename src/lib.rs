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
//! - [`model`]: users' models: parameters and a forward pass written from ops, the step
//!   derived from it (reverse-mode differentiation over the plan), trained on any backend.
//! - [`train`]: the GPT (a user of [`model`]), its training loop and checkpoints.
//!
//! Layers, top to bottom (no import runs back up; docs/design.md draws them):
//! cli, web -> report, bench -> train -> model -> backend -> plan -> dist, policy -> algorithm ->
//! format.
//!
//! ## Quick start: training a model of your own
//!
//! Declare parameters and write the forward pass from the builder's ops ([`model`]); the
//! backward pass, GradScaler's loss scaling, fp8 scaling and the AdamW update are derived into
//! one step plan, run by any backend's executor under any precision preset. A two-layer MLP
//! learning XOR, on the host reference (a GPU: `backend::open(BackendChoice::Auto)`):
//!
//! ```
//! use mantissa::backend::Reference;
//! use mantissa::model::{Init, ModelBuilder, ModelTrainer};
//! use mantissa::policy::precision::PrecisionRequest;
//! use mantissa::Preset;
//! use pollster::block_on;
//!
//! // Four points, two features each; their classes.
//! let points = [0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0];
//! let classes = [0, 1, 1, 0];
//!
//! let mut m = ModelBuilder::new();
//! let x = m.values(&[4, 2])?;
//! let y = m.targets(&[4])?;
//! let w1 = m.param("w1", &[2, 16], Init::Normal { std: 1.0 }, true)?;
//! let b1 = m.param("b1", &[16], Init::Zeros, false)?;
//! let w2 = m.param("w2", &[16, 2], Init::Normal { std: 0.5 }, true)?;
//! let b2 = m.param("b2", &[2], Init::Zeros, false)?;
//! let h = m.linear(x, w1, b1)?;
//! let h = m.gelu(h)?;
//! let logits = m.linear(h, w2, b2)?;
//! let loss = m.cross_entropy(logits, y)?;
//! let model = m.finish(loss)?;
//!
//! let request = PrecisionRequest::of(Preset::MixedBf16);
//! let mut trainer = ModelTrainer::new(&Reference, model, &request, None, 7)?;
//! trainer.adamw.lr = 0.05;
//! block_on(trainer.set_values(0, &points))?;
//! let first = block_on(trainer.step(&[], &classes))?.loss;
//! for _ in 0..200 {
//!     block_on(trainer.step(&[], &classes))?;
//! }
//! let last = block_on(trainer.loss(&[], &classes))?;
//! assert!(last < first / 10.0, "{first} -> {last}");
//! # Ok::<(), mantissa::Error>(())
//! ```

// Every public item says what it is for (the crate is a library for users' models too).
#![deny(missing_docs)]

pub mod algorithm;
pub mod backend;
pub mod bench;
pub mod cache;
pub mod choice;
#[cfg(not(target_arch = "wasm32"))]
pub mod cli;
pub mod dist;
pub mod env;
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
