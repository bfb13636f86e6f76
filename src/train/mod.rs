//! The training-step executor: a char-level GPT trained under each precision preset.
//!
//! - `ops.rs`: the training ops (layer norm, GELU, causal softmax, cross entropy, embeddings,
//!   AdamW), forward and backward, as the host reference defines them
//! - `plan.rs`: the step plan, ops on numbered tensors, and the scalar and stats slots that are
//!   all a step exchanges with the host
//! - `model.rs`: the GPT, its configs, and the plan of its step under a `Precision`
//! - `exec.rs`: the executor trait and the host interpreter (the backends' ops one by one);
//!   device-resident executors live with their backend (`backend::wgpu::plan`)
//! - `data.rs`: the character corpus and seeded batches
//! - `trainer.rs`: presets, master weights, loss scaling, fp8 histories, evaluation, sampling

pub mod checkpoint;
pub mod data;
pub mod exec;
pub mod model;
pub mod ops;
pub mod plan;
pub mod trainer;

pub use checkpoint::Checkpoint;
pub use data::Corpus;
pub use exec::StepExecutor;
pub use model::{Gpt, GptConfig, Precision};
pub use plan::{Plan, Section};
pub use trainer::{StepRecord, TrainOptions, TrainState, Trainer};
