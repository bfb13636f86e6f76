//! The executor contract: what every backend's executor of a step plan implements (the host
//! interpreter, `backend::reference::interp`, and the device-resident plans of wgpu and CUDA),
//! and the checks and stats arithmetic they share.

use super::{Bucket, Plan, Section, Stats, TensorId};
use crate::dist::{Collective, Reducer};
use crate::error::{Error, Result};

/// What a step's gradient reduction did (train.json's `reduction`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Reduced {
    /// The engine and the buffers ("MPI (Open MPI v4.1.4), host buffers").
    pub engine: String,
    /// Bytes each rank contributed.
    #[serde(rename = "bytes_per_step")]
    pub bytes: u64,
    /// Collective calls made.
    #[serde(rename = "calls_per_step")]
    pub calls: usize,
    /// Whether the buckets were summed while the backward pass ran on
    /// (`StepExecutor::backward_summed`), or after it.
    #[serde(rename = "overlapped_with_backward")]
    pub overlapped: bool,
}

/// What a data-parallel step sums over its ranks, and how (`StepExecutor::backward_summed`).
pub struct GradientSum<'a> {
    /// The tensors to sum (`Plan::split_for_ranks`).
    pub ids: &'a [TensorId],
    /// The ranks the sum runs over.
    pub group: &'a dyn Collective,
    /// The engine that sums.
    pub reducer: Reducer,
    /// Values per bucket (`Plan::gradient_buckets`).
    pub bucket: usize,
    /// Sum each bucket as soon as the backward pass is done with it, where the executor can
    /// (false: after the whole pass).
    pub overlap: bool,
    /// A test's fault: this value is added to the first element of this tensor, on this rank,
    /// before the sum.
    pub poison: Option<(TensorId, f32)>,
}

impl GradientSum<'_> {
    /// Sums `flat`, the values of `bucket`'s members one after another, over the ranks (after
    /// adding the poison where the bucket holds its tensor).
    pub fn sum_bucket(
        &self,
        plan: &Plan,
        bucket: &Bucket,
        flat: &mut [f32],
        reduced: &mut Reduced,
    ) -> Result<()> {
        if let Some((id, value)) = self.poison {
            let mut at = 0;
            for &m in &bucket.ids {
                if m == id
                    && let Some(x) = flat.get_mut(at)
                {
                    *x += value;
                }
                at += tensor_len(plan, m)?;
            }
        }
        self.sum_flat(flat, reduced)
    }

    /// Sums `flat` over the ranks (one collective call), counted in `reduced`.
    fn sum_flat(&self, flat: &mut [f32], reduced: &mut Reduced) -> Result<()> {
        self.group.sum_f32(flat)?;
        reduced.bytes += flat.len() as u64 * 4;
        reduced.calls += 1;
        Ok(())
    }

    /// For an executor that sums through host buffers (`executor` describes it): the buckets
    /// to sum as the backward pass finishes them (`Plan::gradient_buckets`), or None where
    /// the sum is to come after the pass; an error for NCCL.
    pub fn host_buckets(&self, plan: &Plan, executor: String) -> Result<Option<Vec<Bucket>>> {
        if self.reducer == Reducer::Nccl {
            return Err(nccl_unavailable(executor));
        }
        match self.overlap {
            true => plan.gradient_buckets(self.ids, self.bucket).map(Some),
            false => Ok(None),
        }
    }

    /// The record of a host-buffer reduction over this group, before any call.
    pub fn on_host(&self, overlapped: bool) -> Reduced {
        Reduced {
            engine: format!("{}, host buffers", self.group.engine()),
            bytes: 0,
            calls: 0,
            overlapped,
        }
    }
}

/// The error for `Reducer::Nccl` on an executor that reduces through host buffers only.
pub fn nccl_unavailable(executor: String) -> Error {
    Error::BackendUnavailable {
        backend: "nccl".into(),
        why: format!(
            "{executor} reduces through host buffers only (NCCL needs the CUDA backend's resident \
             executor); use --reducer mpi"
        ),
    }
}

/// The memory a step takes (train.json's `memory`, `mantissa bench train`).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Memory {
    /// Bytes of the plan's tensors, temporaries sharing storage where their lives allow
    /// (`Storage::shared`): what the step needs at the least.
    pub plan_bytes: u64,
    /// The most the steps so far held at once: every buffer the executor allocated (the
    /// plan's tensors, kernel temporaries, parameters of launches, staging for readback), as
    /// `measured_by` says.
    pub peak_bytes: u64,
    /// Where the peak comes from ("the Vulkan allocator's report, sampled at every submission
    /// and readback").
    pub measured_by: String,
}

impl Memory {
    /// The peak over the plan's tensors (1.0: nothing beyond them).
    pub fn overhead(&self) -> f64 {
        self.peak_bytes as f64 / self.plan_bytes.max(1) as f64
    }
}

/// Where a step's time goes (`StepExecutor::run_timed`): the time of each op of the section
/// run, in plan order.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Timings {
    /// Index in the plan of the first op timed.
    pub first: usize,
    /// Seconds of op `first + i`.
    pub seconds: Vec<f64>,
    /// How the times were taken ("CUDA events recorded between consecutive launches").
    pub measured_by: String,
}

/// Runs a plan, holding its tensors (parameters and optimizer state included) between steps.
#[async_trait::async_trait]
pub trait StepExecutor: Send {
    /// The plan it runs.
    fn plan(&self) -> &Plan;
    /// How the executor runs ("device-resident, one submission per step").
    fn describe(&self) -> String;
    /// The device launches of each op of the plan as this executor runs it (kernels and
    /// library calls: several where an op is split over dispatches, 0 where it has nothing to
    /// do); None where ops are not launched on a device (the host interpreter) or before every
    /// op has run.
    fn launches(&self) -> Option<Vec<usize>> {
        None
    }
    /// Runs `section` of the plan on a batch with the step's scalars; returns the stats.
    async fn run(
        &mut self,
        section: Section,
        tokens: &[u32],
        targets: &[u32],
        scalars: &[f32],
    ) -> Result<Vec<f64>>;
    /// Runs `section` as `run` does (the same results, bit for bit) and times each op: where
    /// the step's time goes, for `mantissa bench train --profile`. Each executor says in
    /// `Timings::measured_by` what an op's time includes.
    async fn run_timed(
        &mut self,
        section: Section,
        tokens: &[u32],
        targets: &[u32],
        scalars: &[f32],
    ) -> Result<(Vec<f64>, Timings)>;
    /// The values of tensor `id` as f32 (a coded tensor's codes decoded).
    async fn read(&mut self, id: TensorId) -> Result<Vec<f32>>;
    /// Sets tensor `id` to `values` (rounded to its format where it is stored as codes).
    async fn write(&mut self, id: TensorId, values: &[f32]) -> Result<()>;
    /// The memory the steps so far took (on the host for the host interpreter).
    fn memory(&self) -> Memory;
    /// Allocates the plan's buffers and builds its kernels now, where the executor would
    /// otherwise do it at its first use (wgpu), so that a plan the device cannot hold fails
    /// before any step. Executors that allocate when they are created have nothing to do.
    async fn prepare(&mut self) -> Result<()> {
        Ok(())
    }

    /// Starts the peak of `memory` over from what the executor holds now: after a measured
    /// choice (`Trainer::choose`) whose other plan, since dropped, shared the device. Executors
    /// that count only their own buffers have nothing to forget.
    fn forget_peak(&mut self) {}

    /// Records each section of the plan the second time it runs and replays the recording
    /// from then on, or stops (`plan::graph`: CUDA graphs, or the host interpreter's model of
    /// them), where the plan allows it (`Graphs::for_plan`). An executor that records nothing
    /// (wgpu submits a step as its command buffers already) refuses `true`.
    fn record_sections(&mut self, on: bool) -> Result<()> {
        match on {
            true => Err(Error::invalid(
                "graphs",
                "only CUDA's executor and the host interpreter record sections to replay; this \
                 one submits each step as it is (graphs auto or off)",
            )),
            false => Ok(()),
        }
    }

    /// Sums tensors `sum.ids` over the ranks of `sum.group`, in place (a data-parallel step's
    /// gradients, after the backward pass). This default reduces host buffers through the group
    /// (MPI), in the buckets of `--bucket-size`; an executor whose device has its own engine
    /// (NCCL) overrides it for `Reducer::Auto` and `Reducer::Nccl`.
    async fn all_reduce(&mut self, sum: &GradientSum<'_>) -> Result<Reduced> {
        if sum.reducer == Reducer::Nccl {
            return Err(nccl_unavailable(self.describe()));
        }
        reduce_on_host(self, sum).await
    }

    /// A data-parallel step's first half: runs `Section::Backward`, and sums `sum.ids` over the
    /// ranks. This default runs the whole pass, then `all_reduce`; an executor that can sum a
    /// bucket (`Plan::gradient_buckets`) while its device runs on through the pass overrides
    /// it where `sum.overlap` asks. The sums are the same bits either way.
    async fn backward_summed(
        &mut self,
        tokens: &[u32],
        targets: &[u32],
        scalars: &[f32],
        sum: &GradientSum<'_>,
    ) -> Result<(Vec<f64>, Reduced)> {
        backward_then_sum(self, (tokens, targets, scalars), sum).await
    }
}

/// `StepExecutor::backward_summed` without overlap: the whole backward pass, then the sum
/// (`all_reduce`).
pub async fn backward_then_sum<E: StepExecutor + ?Sized>(
    exec: &mut E,
    (tokens, targets, scalars): (&[u32], &[u32], &[f32]),
    sum: &GradientSum<'_>,
) -> Result<(Vec<f64>, Reduced)> {
    let stats = exec
        .run(Section::Backward, tokens, targets, scalars)
        .await?;
    Ok((stats, poison_then_sum(exec, sum).await?))
}

/// `sum.poison` (a test's fault) added to its tensor, then the sum over the ranks
/// (`all_reduce`) of gradients the device holds complete.
pub async fn poison_then_sum<E: StepExecutor + ?Sized>(
    exec: &mut E,
    sum: &GradientSum<'_>,
) -> Result<Reduced> {
    if let Some((id, value)) = sum.poison {
        let mut g = exec.read(id).await?;
        if let Some(x) = g.first_mut() {
            *x += value;
        }
        exec.write(id, &g).await?;
    }
    exec.all_reduce(sum).await
}

/// Sums tensors `sum.ids` of `exec` over the ranks through host buffers, a bucket
/// (`Plan::gradient_buckets`) to a collective call. The poison, if any, is already in them.
pub async fn reduce_on_host<E: StepExecutor + ?Sized>(
    exec: &mut E,
    sum: &GradientSum<'_>,
) -> Result<Reduced> {
    let mut reduced = sum.on_host(false);
    for bucket in exec.plan().gradient_buckets(sum.ids, sum.bucket)? {
        let mut flat = Vec::new();
        for &id in &bucket.ids {
            flat.extend(exec.read(id).await?);
        }
        sum.sum_flat(&mut flat, &mut reduced)?;
        let mut at = 0;
        for &id in &bucket.ids {
            let len = tensor_len(exec.plan(), id)?;
            exec.write(id, &flat[at..at + len]).await?;
            at += len;
        }
    }
    Ok(reduced)
}

/// Checks the inputs of a run against the plan: the batch's length, every token and target id
/// within the tables and classes the ops index with it (`Plan::ids`), the scalars' count.
pub fn check_inputs(plan: &Plan, tokens: &[u32], targets: &[u32], scalars: &[f32]) -> Result<()> {
    let want = plan.tensors[plan.tokens].len;
    if tokens.len() != want || targets.len() != want {
        return Err(Error::invalid(
            "batch",
            format!(
                "the step plan takes {want} tokens and targets, got {} and {}",
                tokens.len(),
                targets.len()
            ),
        ));
    }
    for (what, ids, limit) in [
        ("token", tokens, plan.ids.tokens),
        ("target", targets, plan.ids.targets),
    ] {
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= limit) {
            return Err(Error::invalid(
                "batch",
                format!("{what} id {bad} is outside the {limit} rows the step plan indexes"),
            ));
        }
    }
    if scalars.len() != plan.scalar_count() {
        return Err(Error::LengthMismatch {
            what: "step scalars",
            expected: plan.scalar_count(),
            got: scalars.len(),
        });
    }
    Ok(())
}

/// The length of tensor `id` of `plan`.
pub fn tensor_len(plan: &Plan, id: TensorId) -> Result<usize> {
    plan.tensors.get(id).map(|t| t.len).ok_or_else(|| {
        Error::invalid(
            "step plan",
            format!("no tensor {id} (the plan has {})", plan.tensors.len()),
        )
    })
}

/// Checks values written into tensor `id` of `plan`.
pub fn check_write(plan: &Plan, id: TensorId, values: &[f32]) -> Result<()> {
    let len = tensor_len(plan, id)?;
    if values.len() != len {
        return Err(Error::LengthMismatch {
            what: "plan tensor",
            expected: len,
            got: values.len(),
        });
    }
    Ok(())
}

/// The factor AdamW multiplies the gradients by: None where a gradient is not finite (the
/// step is skipped), else the global-norm clip factor (1 when within `clip` or `clip` is 0).
pub fn update_factor(layout: &Stats, stats: &[f64], clip: f32) -> Option<f32> {
    if (0..layout.grads).any(|i| stats[layout.flag(i)] != 0.0) {
        return None;
    }
    let norm = grad_norm(layout, stats);
    let clip = clip as f64;
    Some(if clip > 0.0 && norm > clip {
        (clip / norm) as f32
    } else {
        1.0
    })
}

/// The global norm of the unscaled gradients.
pub fn grad_norm(layout: &Stats, stats: &[f64]) -> f64 {
    // From +0: an empty f64 sum is -0.0, the norm of no gradients 0.
    (0..layout.grads)
        .map(|i| stats[layout.norm_sq(i)])
        .fold(0.0, |a, b| a + b)
        .sqrt()
}
