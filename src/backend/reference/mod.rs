//! The host reference: every op exactly as docs/design.md specifies it, accumulating in f64.
//! This is the truth every other backend is tested against, and it lives in one folder:
//!
//! - `matmul.rs`: the reference matmul of every algorithm (f64 accumulation per level)
//! - `ops.rs`: the training ops (layer norm, GELU, softmax, cross entropy, embeddings, AdamW),
//!   forward and backward
//! - `interp.rs`: the host interpreter of step plans (the reference's executor, and the
//!   cross-check of every device-resident one)

pub mod interp;
pub mod matmul;
pub mod ops;

pub use interp::HostExecutor;
pub use matmul::matmul;

use crate::algorithm::{Algorithm, MatmulShape};
use crate::backend::{Backend, BackendKind, check};
use crate::error::Result;
use crate::format::{self, Format, Overflow};
use crate::plan::{AdamW, Plan, ScoreScale, StepExecutor};
use crate::policy::Capabilities;
use rayon::prelude::*;

/// The host reference backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct Reference;

#[async_trait::async_trait]
impl Backend for Reference {
    fn kind(&self) -> BackendKind {
        BackendKind::Reference
    }

    fn name(&self) -> String {
        "reference".into()
    }

    fn device_name(&self) -> String {
        "host CPU, f64 accumulation".into()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    /// The host's memory: a step plan the host interpreter could not hold is refused first.
    fn memory_available(&self) -> Option<(u64, u64)> {
        crate::memory::host()
    }

    async fn matmul(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        a: &[f32],
        b: &[f32],
    ) -> Result<Vec<f32>> {
        matmul::matmul(shape, algorithm, a, b)
    }

    async fn encode(&self, format: Format, overflow: Overflow, x: &[f32]) -> Result<Vec<u32>> {
        Ok(x.par_iter().map(|&v| format.encode(v, overflow)).collect())
    }

    async fn decode(&self, format: Format, bits: &[u32]) -> Result<Vec<f32>> {
        Ok(bits.par_iter().map(|&b| format.decode(b)).collect())
    }

    async fn split_bf16(&self, x: &[f32]) -> Result<[Vec<u32>; 3]> {
        let parts: Vec<[f32; 3]> = x.par_iter().map(|&v| format::split_bf16(v)).collect();
        let plane = |p: usize| {
            parts
                .iter()
                .map(|s| Format::Bf16.encode(s[p], Overflow::Standard))
                .collect()
        };
        Ok([plane(0), plane(1), plane(2)])
    }

    async fn amax(&self, x: &[f32]) -> Result<f32> {
        Ok(format::amax(x.iter().copied()))
    }

    // The training ops: the host truth of `ops.rs`, with the input checks every backend makes.

    async fn layernorm_fwd(
        &self,
        x: &[f32],
        g: &[f32],
        b: &[f32],
        c: usize,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        check::layernorm_fwd(x, g, b, c)?;
        Ok(ops::layernorm_fwd(x, g, b, c))
    }

    async fn layernorm_bwd(
        &self,
        dy: &[f32],
        x: &[f32],
        g: &[f32],
        mean: &[f32],
        rstd: &[f32],
        c: usize,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        check::layernorm_bwd(dy, x, g, (mean, rstd), c)?;
        Ok(ops::layernorm_bwd(dy, x, g, mean, rstd, c))
    }

    async fn gelu_fwd(&self, x: &[f32]) -> Result<Vec<f32>> {
        Ok(ops::gelu_fwd(x))
    }

    async fn gelu_bwd(&self, x: &[f32], dy: &[f32]) -> Result<Vec<f32>> {
        check::gelu(x, Some(dy))?;
        Ok(ops::gelu_bwd(x, dy))
    }

    async fn causal_softmax_fwd(
        &self,
        scores: &[f32],
        t: usize,
        scale: ScoreScale,
    ) -> Result<Vec<f32>> {
        check::softmax(scores, None, t)?;
        Ok(ops::causal_softmax_scaled_fwd(scores, t, scale))
    }

    async fn causal_softmax_bwd(
        &self,
        p: &[f32],
        dp: &[f32],
        t: usize,
        scale: ScoreScale,
    ) -> Result<Vec<f32>> {
        check::softmax(p, Some(dp), t)?;
        Ok(ops::causal_softmax_scaled_bwd(p, dp, t, scale))
    }

    async fn cross_entropy_fwd(
        &self,
        logits: &[f32],
        targets: &[u32],
        v: usize,
    ) -> Result<(f64, Vec<f32>)> {
        check::cross_entropy(logits, targets, v)?;
        Ok(ops::cross_entropy_fwd(logits, targets, v))
    }

    async fn cross_entropy_bwd(
        &self,
        probs: &[f32],
        targets: &[u32],
        v: usize,
        dloss: f64,
    ) -> Result<Vec<f32>> {
        check::cross_entropy(probs, targets, v)?;
        Ok(ops::cross_entropy_bwd(probs, targets, v, dloss))
    }

    async fn adamw(
        &self,
        opt: &AdamW,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        t: u32,
        decay: bool,
    ) -> Result<()> {
        check::adamw(p, g, m, v)?;
        ops::adamw(opt, p, g, m, v, t, decay);
        Ok(())
    }

    async fn embedding_fwd(&self, table: &[f32], ids: &[u32], c: usize) -> Result<Vec<f32>> {
        check::embedding_fwd(table, ids, c)?;
        Ok(ops::embedding_fwd(table, ids, c))
    }

    async fn embedding_bwd(
        &self,
        dout: &[f32],
        ids: &[u32],
        rows: usize,
        c: usize,
    ) -> Result<Vec<f32>> {
        check::embedding_bwd(dout, ids, rows, c)?;
        Ok(ops::embedding_bwd(dout, ids, rows, c))
    }

    async fn unscale_check(&self, g: &mut [f32], inverse_scale: f32) -> Result<bool> {
        Ok(ops::unscale_check(g, inverse_scale))
    }

    /// The host interpreter over the reference ops: host memory is where the reference keeps
    /// its tensors.
    fn resident_executor<'a>(&'a self, plan: Plan) -> Result<Box<dyn StepExecutor + 'a>> {
        Ok(Box::new(HostExecutor::new(self, plan)))
    }
}
