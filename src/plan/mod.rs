//! The step program: one step of a model (forward, backward, optimizer update) as a list of
//! ops on numbered tensors, built once per (model, precision, batch shape) and run by an
//! executor (`exec::StepExecutor`): the host interpreter, the reference backend's executor
//! (`backend::reference::interp`: each op the host reference's definition), or a device executor
//! that keeps every tensor resident and replays the step as one submission
//! (`backend::wgpu::plan`, `backend::cuda::plan`). `plan::Op` is the only way an op reaches a
//! backend: every executor runs any plan `PlanBuilder::finish` made.
//!
//! This layer sits below the backends and above the algorithms and formats: it names what a
//! step computes, never how a device computes it, and imports nothing from `backend` or `train`.
//!
//! - `mod.rs`: the plan, its sections and its stats slots
//! - `tensor.rs`: the tensors, what each holds and how a device stores it
//! - `op.rs`: the ops, what each computes and the tensors it reads and writes
//! - `strided.rs`: the strided copies (attention's head permutations)
//! - `builder.rs`: recording a plan op by op, with the folds of one op into the one before
//! - `codes.rs`: the tensors a plan stores as 16-bit codes, and the operands a matmul reads so
//! - `storage.rs`: the temporaries' lives, and the device buffers they share
//! - `ranks.rs`: a rank's plan of a data-parallel step, and its gradient buckets
//! - `accumulate.rs`: a step over micro-batches, its gradients summed on the device
//! - `cost.rs`: the bytes and FLOPs each op costs by its definition (for profiles)
//! - `scalar.rs`: the scalar slots the host writes before a step (AdamW, loss scale, fp8 scales)
//! - `exec.rs`: the executor contract every backend's executor implements
//! - `graph.rs`: when an executor records a section and replays the recording
//!
//! What changes from step to step enters through two small arrays: `scalar` slots the host
//! writes before a step (loss scale, AdamW bias corrections, fp8 scales) and `Stats` slots the
//! device writes during it (loss, finite flags, squared gradient norms, fp8 amaxes), the only
//! thing read back.

pub mod exec;
pub mod graph;
pub mod scalar;

mod accumulate;
mod builder;
mod codes;
mod cost;
pub mod dropout;
mod op;
mod ranks;
pub mod rotary;
mod storage;
mod strided;
mod tensor;
mod unary;
mod validate;

pub use builder::{Outline, PlanBuilder};
pub use codes::{check_stored_operands, codes_read_by};
pub use cost::Cost;
pub use exec::StepExecutor;
pub use op::{AdamWParam, Attention, MaskKind, Op, ScoreMask, ScoreScale, step_algorithm};
pub use ranks::Bucket;
pub use scalar::AdamW;
pub use storage::Storage;
pub use strided::Strided;
pub use tensor::{TensorId, TensorInfo, TensorKind};
pub use unary::Unary;
pub use validate::IdLimits;

/// Where each statistic of a step lies in the stats array.
#[derive(Clone, Copy, Debug)]
pub struct Stats {
    /// Gradient tensors (parameters).
    pub grads: usize,
    /// fp8 linear layers with amax slots.
    pub linears: usize,
}

impl Stats {
    /// The step's loss: the mean cross entropy over the rows, or the mean squared error.
    pub const LOSS: usize = 0;
    /// 1 where gradient i holds inf or NaN, else 0.
    pub fn flag(&self, i: usize) -> usize {
        1 + i
    }
    /// Squared norm of (unscaled) gradient i.
    pub fn norm_sq(&self, i: usize) -> usize {
        1 + self.grads + i
    }
    /// amax of linear layer `layer`'s input (role 0), weight (1) or gradient (2).
    pub fn amax(&self, layer: usize, role: usize) -> usize {
        1 + 2 * self.grads + 3 * layer + role
    }
    /// Slots of the stats array.
    pub fn len(&self) -> usize {
        1 + 2 * self.grads + 3 * self.linears
    }
    /// Never: the loss slot is always there.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// Which ops of the plan a run executes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Section {
    /// The forward pass: loss (and logits).
    Forward,
    /// Forward and backward: this batch's (scaled) gradients, before the unscale. A
    /// data-parallel step sums them over the ranks here, then runs `Update`.
    Backward,
    /// Forward, backward, unscale and finite check: the gradients, no update.
    Gradients,
    /// The rest of a step after `Backward`: unscale, finite check and the optimizer update of
    /// the gradients as they are (its stats hold no loss or amax).
    Update,
    /// Forward, backward and the optimizer update.
    Step,
    /// After a micro-batch's `Backward`, the first of a step: its gradients kept aside
    /// (`Plan::accumulate`).
    Stash,
    /// After a later micro-batch's `Backward`, but the last: its gradients added to those kept.
    Accumulate,
    /// After the last micro-batch's `Backward`: the gradients kept added into its own, before
    /// the ranks' sum and `Update`.
    Gather,
}

/// A plan, checked (`PlanBuilder::finish` makes one): every executor runs it as it is. Its parts
/// are read through the methods of the same names; within the crate, the transformations that
/// keep it valid (`store_codes`, `split_for_ranks`) and the trainer's initial values of its
/// parameters (`constants`) change them.
#[derive(Clone, Debug)]
pub struct Plan {
    pub(crate) tensors: Vec<TensorInfo>,
    pub(crate) ops: Vec<Op>,
    /// `ops[..forward]` is the forward pass, `ops[..backward]` goes on to the scaled gradients,
    /// `ops[..gradients]` to the unscaled, checked gradients.
    pub(crate) forward: usize,
    pub(crate) backward: usize,
    pub(crate) gradients: usize,
    /// Rows of the batch (tokens), the loss's denominator.
    pub(crate) rows: usize,
    pub(crate) tokens: TensorId,
    pub(crate) targets: TensorId,
    pub(crate) logits: TensorId,
    /// Per parameter: (parameter, gradient, first moment, second moment).
    pub(crate) state: Vec<[TensorId; 4]>,
    pub(crate) constants: Vec<(TensorId, Vec<f32>)>,
    pub(crate) stats: Stats,
    /// The bounds of a run's token and target ids (`exec::check_inputs`).
    pub(crate) ids: IdLimits,
    /// The tensors a step over micro-batches accumulates and their accumulators
    /// (`Plan::accumulate`); their sections' ops follow the step's.
    pub(crate) accumulated: Vec<(TensorId, TensorId)>,
}

impl Plan {
    /// The plan's tensors; a `TensorId` indexes them.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The plan's ops, in the order they run.
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// Rows of the batch: its tokens (and targets), the loss's denominator.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The tensor a run writes its tokens into.
    pub fn tokens(&self) -> TensorId {
        self.tokens
    }

    /// The tensor a run writes its targets into.
    pub fn targets(&self) -> TensorId {
        self.targets
    }

    /// The tensor the host reads after the forward pass (the logits), kept whole after it.
    pub fn logits(&self) -> TensorId {
        self.logits
    }

    /// Per parameter: (parameter, gradient, first moment, second moment).
    pub fn state(&self) -> &[[TensorId; 4]] {
        &self.state
    }

    /// The tensors with values fixed when the plan was built (or given before its first run).
    pub fn constants(&self) -> &[(TensorId, Vec<f32>)] {
        &self.constants
    }

    /// Where each statistic of a run lies in the stats array.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// Slots of the scalars array a step takes: the fixed slots, then three fp8 scales per linear
    /// layer.
    pub fn scalar_count(&self) -> usize {
        scalar::FP8 + 3 * self.stats.linears
    }

    /// The indices of the ops a run of `section` executes.
    pub fn range_of(&self, section: Section) -> std::ops::Range<usize> {
        let step = self.ops.len() - self.accumulation_ops();
        match section {
            Section::Forward => 0..self.forward,
            Section::Backward => 0..self.backward,
            Section::Gradients => 0..self.gradients,
            Section::Update => self.backward..step,
            Section::Step => 0..step,
            Section::Stash | Section::Accumulate | Section::Gather => {
                self.accumulation_range(section).unwrap_or(step..step)
            }
        }
    }

    /// The ops a run of `section` executes.
    pub fn ops_of(&self, section: Section) -> &[Op] {
        &self.ops[self.range_of(section)]
    }

    /// The plan's tensors as an executor's description gives them: their bytes in `storage`,
    /// unshared, and how many are stored as 16-bit codes.
    pub fn describe_tensors(&self, storage: &Storage) -> String {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        format!(
            "{:.1} MiB of tensors ({:.1} MiB unshared; {} stored as 16-bit codes)",
            mib(storage.bytes()),
            mib(self.tensor_bytes()),
            self.coded_tensors()
        )
    }

    /// Bytes of every tensor of the plan (device memory of a resident executor, temporaries of
    /// the kernels aside).
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorInfo::bytes).sum()
    }
}
