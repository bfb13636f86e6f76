//! The executor contract: what every backend's executor of a step plan implements (the host
//! interpreter, `backend::reference::interp`, and the device-resident plans of wgpu and CUDA),
//! and the checks and stats arithmetic they share.

use super::{Plan, Section, Stats, TensorId};
use crate::error::{Error, Result};

/// Runs a plan, holding its tensors (parameters and optimizer state included) between steps.
#[async_trait::async_trait]
pub trait StepExecutor: Send {
    fn plan(&self) -> &Plan;
    /// How the executor runs ("device-resident, one submission per step").
    fn describe(&self) -> String;
    /// Runs `section` of the plan on a batch with the step's scalars; returns the stats.
    async fn run(
        &mut self,
        section: Section,
        tokens: &[u32],
        targets: &[u32],
        scalars: &[f32],
    ) -> Result<Vec<f64>>;
    async fn read(&mut self, id: TensorId) -> Result<Vec<f32>>;
    async fn write(&mut self, id: TensorId, values: &[f32]) -> Result<()>;
    /// Bytes the executor holds on its device (0 on the host).
    fn device_bytes(&self) -> u64;
}

/// Checks the inputs of a run against the plan.
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
    (0..layout.grads)
        .map(|i| stats[layout.norm_sq(i)])
        .sum::<f64>()
        .sqrt()
}
