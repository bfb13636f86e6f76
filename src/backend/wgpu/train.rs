//! The training ops on wgpu (`shaders/train.wgsl`): one launcher for every entry point, and the
//! Backend overrides built on it. Each call uploads its operands and reads its results back;
//! the device-resident step plan (`plan.rs`) binds the same kernels to resident tensors.

use super::WgpuBackend;
use super::buffer::{Dispatch, check_binding, read_words, submit, upload};
use super::shaders::{Kernel, StepOp, TrainOp};
use crate::error::Result;
use bytemuck::{Pod, Zeroable};

/// The uniform of the train kernels (`TrainParams` in train.wgsl).
#[repr(C)]
#[derive(Clone, Copy, Default, Pod, Zeroable)]
pub struct TrainParams {
    /// Elements, or rows for row ops.
    pub n: u32,
    /// Row length (layer norm width, vocabulary, context t of the softmax).
    pub c: u32,
    /// Tokens of the embedding scatter-add.
    pub tokens: u32,
    /// The softmax scale.
    pub scale: f32,
}

/// The uniform of the step kernels (`StepParams` in step.wgsl).
#[repr(C)]
#[derive(Clone, Copy, Default, Pod, Zeroable)]
pub struct StepParams {
    pub n: u32,
    pub c: u32,
    pub format: u32,
    pub slot: u32,
    pub dims: [u32; 4],
    pub src: [u32; 4],
    pub dst: [u32; 4],
    pub extra: [u32; 4],
}

/// An output buffer of a kernel: fresh (zeroed) of a length, or holding initial values.
pub enum Out<'a> {
    Fresh(usize),
    Init(&'a [f32]),
    Unused,
}

/// A binding of a one-shot kernel run after its uniform: an input (read-only) or an output.
pub enum Bind<'a> {
    In(&'a [f32]),
    Out(Out<'a>),
}

impl WgpuBackend {
    /// Runs `kernel` once on uploaded operands: the uniform `params`, then `binds` in binding
    /// order, over `groups` workgroups; returns the outputs (the `Bind::Out`s, in order).
    pub(crate) async fn run_once<P: Pod>(
        &self,
        kernel: Kernel,
        params: &P,
        binds: [Bind<'_>; 6],
        groups: [u32; 3],
    ) -> Result<Vec<Vec<f32>>> {
        let gpu = &self.gpu;
        let what = kernel.entry_point();
        for b in &binds {
            if let Bind::In(x) | Bind::Out(Out::Init(x)) = b {
                check_binding(gpu, what, x.len() as u64 * 4)?;
            }
        }
        let outs = gpu
            .scoped(what, || {
                let buffers: Vec<(wgpu::Buffer, Option<usize>)> = binds
                    .iter()
                    .map(|b| {
                        let (words, len): (&[u32], Option<usize>) = match b {
                            Bind::In(x) => (bytemuck::cast_slice(x), None),
                            Bind::Out(Out::Init(x)) => (bytemuck::cast_slice(x), Some(x.len())),
                            Bind::Out(Out::Fresh(n)) => return (zeros(gpu, what, *n), Some(*n)),
                            Bind::Out(Out::Unused) => (&[], Some(0)),
                        };
                        (upload(gpu, what, words), len)
                    })
                    .collect();
                let uniform = super::buffer::uniform(gpu, params);
                let mut bound = vec![&uniform];
                bound.extend(buffers.iter().map(|(b, _)| b));
                let dispatch = Dispatch::new(gpu, gpu.pipeline(&kernel)?, &bound, groups);
                submit(gpu, &[], &[dispatch], None);
                Ok(buffers)
            })
            .await?;
        let mut results = Vec::new();
        for (b, len) in &outs {
            match len {
                Some(0) => results.push(Vec::new()),
                Some(n) => {
                    results.push(bytemuck::cast_slice(&read_words(gpu, b, *n).await?).to_vec())
                }
                None => {}
            }
        }
        Ok(results)
    }

    /// Runs one train kernel over `items` invocations and returns its three outputs.
    pub(crate) async fn train_op(
        &self,
        op: TrainOp,
        params: TrainParams,
        inputs: [&[f32]; 3],
        outputs: [Out<'_>; 3],
        items: usize,
    ) -> Result<[Vec<f32>; 3]> {
        let [i0, i1, i2] = inputs.map(Bind::In);
        let [o0, o1, o2] = outputs.map(Bind::Out);
        let groups = Dispatch::element_groups(&self.gpu, items)?;
        let outs = self
            .run_once(Kernel::Train(op), &params, [i0, i1, i2, o0, o1, o2], groups)
            .await?;
        let mut outs = outs.into_iter();
        Ok([(); 3].map(|_| outs.next().unwrap_or_default()))
    }

    /// Runs one step kernel (step.wgsl) on `scalars` (the plan's scalar slots) and returns the
    /// stats (`stats` values, zeroed first) and its outputs y, z, w.
    pub(crate) async fn step_op(
        &self,
        op: StepOp,
        params: StepParams,
        scalars: &[f32],
        (stats, x): (usize, &[f32]),
        outputs: [Out<'_>; 3],
        groups: [u32; 3],
    ) -> Result<[Vec<f32>; 4]> {
        let [y, z, w] = outputs.map(Bind::Out);
        let binds = [
            Bind::In(scalars),
            Bind::Out(Out::Fresh(stats)),
            Bind::In(x),
            y,
            z,
            w,
        ];
        let outs = self
            .run_once(Kernel::Step(op), &params, binds, groups)
            .await?;
        let mut outs = outs.into_iter();
        Ok([(); 4].map(|_| outs.next().unwrap_or_default()))
    }
}

/// A zeroed storage buffer of `n` words (at least one).
fn zeros(gpu: &super::device::Gpu, label: &str, n: usize) -> wgpu::Buffer {
    upload(gpu, label, &vec![0u32; n.max(1)])
}

/// Token ids as the f32 bit patterns the kernels read them as.
pub fn ids_as_f32(ids: &[u32]) -> Vec<f32> {
    ids.iter().map(|&i| f32::from_bits(i)).collect()
}
