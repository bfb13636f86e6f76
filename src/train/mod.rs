//! The training-step executor: a char-level GPT trained under each precision preset.
//!
//! - `ops.rs`: the training ops (layer norm, GELU, causal softmax, cross entropy, embeddings,
//!   AdamW), forward and backward, as the host reference defines them
//! - `model.rs`: the GPT, its configs, forward and backward under a `Precision`
//! - `data.rs`: the character corpus and seeded batches
//! - `trainer.rs`: presets, master weights, loss scaling, AdamW, evaluation
//!
//! Every op (matmuls, layer norm, GELU, causal softmax, cross entropy, embeddings, AdamW, the
//! fused unscale and finite check) runs on the chosen backend through the async `Backend`
//! trait, one round trip per op; head permutations, bias sums, residual adds and format rounding
//! run on the host (the device-resident step plan of DESIGN.md is the next step).

pub mod checkpoint;
pub mod data;
pub mod model;
pub mod ops;
pub mod trainer;

pub use checkpoint::Checkpoint;
pub use data::Corpus;
pub use model::{Gpt, GptConfig, Pass, Precision};
pub use trainer::{StepRecord, TrainOptions, Trainer};
