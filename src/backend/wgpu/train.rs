//! The training ops on wgpu (`shaders/train.wgsl`): one launcher for every entry point, and the
//! Backend overrides built on it. Each call uploads its operands and reads its results back;
//! the device-resident step plan (`plan.rs`) binds the same kernels to resident tensors.

use super::WgpuBackend;
use super::buffer::{Dispatch, check_binding, read_words, submit, upload};
use super::shaders::{Kernel, TrainOp};
use crate::error::Result;
use bytemuck::{Pod, Zeroable};

/// The uniform of every train kernel (see `TrainParams` in train.wgsl).
#[repr(C)]
#[derive(Clone, Copy, Default, Pod, Zeroable)]
pub struct TrainParams {
    pub n: u32,
    pub c: u32,
    pub step: u32,
    pub decay: u32,
    pub f: [f32; 7],
    pub _pad: u32,
}

/// An output buffer of a train kernel: fresh (zeroed) of a length, or holding initial values.
pub enum Out<'a> {
    Fresh(usize),
    Init(&'a [f32]),
    Unused,
}

impl WgpuBackend {
    /// Runs one train kernel over `items` invocations and returns its three outputs.
    pub(crate) async fn train_op(
        &self,
        op: TrainOp,
        params: TrainParams,
        inputs: [&[f32]; 3],
        outputs: [Out<'_>; 3],
        items: usize,
    ) -> Result<[Vec<f32>; 3]> {
        let gpu = &self.gpu;
        for x in inputs {
            check_binding(gpu, op.entry_point(), x.len() as u64 * 4)?;
        }
        let (outs, lens) = gpu
            .scoped(op.entry_point(), || {
                let ins: Vec<wgpu::Buffer> = inputs
                    .iter()
                    .map(|x| upload(gpu, op.entry_point(), bytemuck::cast_slice(x)))
                    .collect();
                let lens: Vec<usize> = outputs
                    .iter()
                    .map(|o| match o {
                        Out::Fresh(n) => *n,
                        Out::Init(x) => x.len(),
                        Out::Unused => 0,
                    })
                    .collect();
                let outs: Vec<wgpu::Buffer> = outputs
                    .iter()
                    .map(|o| match o {
                        Out::Init(x) => upload(gpu, op.entry_point(), bytemuck::cast_slice(x)),
                        Out::Fresh(n) => upload(gpu, op.entry_point(), &vec![0u32; *n]),
                        Out::Unused => upload(gpu, op.entry_point(), &[]),
                    })
                    .collect();
                let uniform = super::buffer::uniform(gpu, &params);
                let pipeline = gpu.pipeline(&Kernel::Train(op))?;
                let dispatch = Dispatch::new(
                    gpu,
                    pipeline,
                    &[
                        &uniform, &ins[0], &ins[1], &ins[2], &outs[0], &outs[1], &outs[2],
                    ],
                    Dispatch::element_groups(gpu, items)?,
                );
                submit(gpu, &[], &[dispatch], None);
                Ok((outs, lens))
            })
            .await?;
        let mut results: [Vec<f32>; 3] = Default::default();
        for (i, (b, &len)) in outs.iter().zip(&lens).enumerate() {
            if len > 0 {
                results[i] = bytemuck::cast_slice(&read_words(gpu, b, len).await?).to_vec();
            }
        }
        Ok(results)
    }
}

/// Token ids as the f32 bit patterns the kernels read them as.
pub fn ids_as_f32(ids: &[u32]) -> Vec<f32> {
    ids.iter().map(|&i| f32::from_bits(i)).collect()
}
