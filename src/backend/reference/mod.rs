//! The host reference: every op exactly as docs/design.md specifies it, accumulating in f64.
//! This is the truth every other backend is tested against, and it lives in one folder:
//!
//! - `matmul.rs`: the reference matmul of every algorithm (f64 accumulation per level)
//! - `ops.rs`: the training ops (layer norm, GELU, softmax, cross entropy, embeddings, AdamW),
//!   forward and backward
//! - `interp.rs`: the host interpreter of step plans (the reference's executor, whose numbers
//!   every device-resident one is compared with)

pub mod interp;
pub mod matmul;
pub mod ops;

pub use interp::HostExecutor;
pub use matmul::matmul;

use crate::algorithm::{Algorithm, MatmulShape};
use crate::backend::{Backend, BackendKind};
use crate::error::Result;
use crate::format::{self, Format, Overflow};
use crate::plan::{Plan, StepExecutor};
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

    /// The host's memory, as this process may take it (`memory::available`: the address-space
    /// and cgroup limits too): a step plan the host interpreter could not hold is refused first.
    fn memory_available(&self) -> Option<(u64, u64)> {
        let (free, total) = crate::memory::host()?;
        Some((crate::memory::available().unwrap_or(free), total))
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

    /// The host interpreter: host memory is where the reference keeps its tensors.
    fn executor<'a>(&'a self, plan: Plan) -> Result<Box<dyn StepExecutor + 'a>> {
        Ok(Box::new(HostExecutor::new(plan)?))
    }
}
