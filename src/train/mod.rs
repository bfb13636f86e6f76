//! Training, above the backends: a char-level GPT trained under each precision preset. The
//! model records its step as a `plan::Plan` under the precision `policy` decided, and the trainer
//! drives a backend's executor of it.
//!
//! - `model.rs`: the GPT, its configs, and the plan of its step under a `Precision`
//! - `trainer.rs`: master weights, loss scaling, fp8 amax state, evaluation, sampling
//! - `data.rs`: the corpus as tokens (characters or GPT-2's BPE), seeded batches, and batches
//!   given in a file
//! - `tokens.rs`: GPT-2's byte-level BPE, and the cache of a corpus's tokens
//! - `init.rs`: initial weights from and to a file, under the engine's or PyTorch's names
//! - `checkpoint.rs`: safetensors checkpoints of the weights, moments and run state

pub mod checkpoint;
pub mod data;
pub mod init;
pub mod model;
mod tokens;
pub mod trainer;

pub use crate::choice::{Choice, Chooser, ChosenBy};
pub use crate::model::TrainState;
pub use checkpoint::{Checkpoint, Expected};
pub use data::{Batches, Corpus, Tokenizer, Vocab};
pub use model::{Gpt, GptConfig};
pub use trainer::{StepRecord, TrainOptions, Trainer, attention_choice, graphs_choice, pick_token};
