//! Training, above the backends: a char-level GPT trained under each precision preset. The
//! model records its step as a `plan::Plan` under the precision `policy` decided, and the trainer
//! drives a backend's executor of it.
//!
//! - `model.rs`: the GPT, its configs, and the plan of its step under a `Precision`
//! - `trainer.rs`: master weights, loss scaling, fp8 amax state, evaluation, sampling
//! - `data.rs`: the character corpus, seeded batches, and batches given in a file
//! - `init.rs`: initial weights from and to a file, under the engine's or PyTorch's names
//! - `choice.rs`: measured choices (`auto`): both ways built and timed, the faster kept and
//!   cached
//! - `checkpoint.rs`: safetensors checkpoints of the weights, moments and run state

pub mod checkpoint;
pub mod data;
pub mod init;
pub mod model;
pub mod trainer;

pub use crate::choice::{Choice, Chooser, ChosenBy};
pub use crate::model::TrainState;
pub use checkpoint::{Checkpoint, Expected};
pub use data::{Batches, Corpus};
pub use model::{Gpt, GptConfig};
pub use trainer::{StepRecord, TrainOptions, Trainer, attention_choice, graphs_choice, pick_token};
