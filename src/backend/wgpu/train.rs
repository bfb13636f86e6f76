//! The training kernel launches on wgpu (`shaders/train.wgsl`, `shaders/step.wgsl`): what each
//! op launches (kernel, uniform, invocations) is defined here once, in `launch`, and used both by
//! the Backend's per-op training ops (`ops.rs`: operands uploaded for the call, `run_once`) and
//! by the device-resident step plan (`plan.rs`: the same launches bound to resident tensors).

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
    /// Fused attention: heads, head size, and the format ids of the matmul inputs, the stored
    /// probabilities and the held matmul results.
    pub h: u32,
    pub d: u32,
    pub inputs: u32,
    pub probs: u32,
    pub compute: u32,
    /// Format id the op's output is held in (layer norm, GELU, the cross entropy's gradient).
    pub held: u32,
    /// 1: the output goes to out2 as 16-bit codes of `held` (a coded tensor).
    pub coded: u32,
    /// Cross entropy: 1 writes the loss's gradient (the backward fused in), 0 the probabilities.
    pub grad: u32,
    /// The format id whose 16-bit codes the first input holds (a coded input: GELU's x,
    /// fused attention's q|k|v); f32's id: it holds f32 values.
    pub x_stored: u32,
    pub _pad: [u32; 3],
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
    /// A bias add's GELU: (1 if it has one, the format it is held in, 1 if stored as codes, 0).
    pub gelu: [u32; 4],
}

/// One launch of a train.wgsl kernel: which entry point, its uniform, and how many invocations.
#[derive(Clone, Copy)]
pub struct TrainLaunch {
    pub op: TrainOp,
    pub params: TrainParams,
    /// Invocations, or rows of a row op (`rows`).
    pub items: usize,
    /// A row op: `Gpu::row_lanes` invocations to each of the `items` rows.
    pub rows: bool,
}

impl TrainLaunch {
    /// The kernel on `gpu` (its row lanes).
    pub fn kernel(&self, gpu: &super::device::Gpu) -> Kernel {
        Kernel::Train(self.op, gpu.row_lanes)
    }

    pub fn groups(&self, gpu: &super::device::Gpu) -> Result<[u32; 3]> {
        let lanes = if self.rows { gpu.row_lanes as usize } else { 1 };
        Dispatch::element_groups(gpu, self.items * lanes)
    }
}

/// One launch of a step.wgsl kernel; `items` None runs one workgroup (the kernels that reduce
/// a whole tensor into the stats).
#[derive(Clone, Copy)]
pub struct StepLaunch {
    pub op: StepOp,
    pub params: StepParams,
    pub items: Option<usize>,
}

impl StepLaunch {
    pub fn groups(&self, gpu: &super::device::Gpu) -> Result<[u32; 3]> {
        match self.items {
            Some(items) => Dispatch::element_groups(gpu, items),
            None => Ok([1, 1, 1]),
        }
    }
}

/// The launches of every training op (the bindings of each are in the kernel files' order).
pub mod launch {
    use super::{StepLaunch, StepParams, TrainLaunch, TrainParams};
    use crate::backend::wgpu::shaders::{StepOp, TrainOp, format_id};
    use crate::format::Format;
    use crate::plan::{Attention, ScoreScale, Strided};

    fn train(op: TrainOp, n: usize, c: usize, items: usize) -> TrainLaunch {
        TrainLaunch {
            op,
            params: TrainParams {
                n: n as u32,
                c: c as u32,
                ..Default::default()
            },
            items,
            rows: false,
        }
    }

    /// A row op over `rows` rows of `c`, the device's row lanes to a row.
    fn row_op(op: TrainOp, rows: usize, c: usize) -> TrainLaunch {
        TrainLaunch {
            rows: true,
            ..train(op, rows, c, rows)
        }
    }

    /// Rows per chunk of a column reduction (`CHUNK_ROWS` in train.wgsl).
    const CHUNK_ROWS: usize = 256;

    /// Chunks of a column reduction over `rows` rows.
    fn chunks(rows: usize) -> usize {
        rows.div_ceil(CHUNK_ROWS)
    }

    /// The partial sums a column reduction of `parts` sums per column over `rows` rows of `c`
    /// writes (the buffer `column_sums` and `layernorm_bwd` take as their partials).
    pub fn partials_len(rows: usize, c: usize, parts: usize) -> usize {
        parts * chunks(rows) * c
    }

    /// A column reduction's partial sums: one workgroup per 32 columns of a chunk of rows.
    fn column_partials(op: TrainOp, rows: usize, c: usize) -> TrainLaunch {
        train(op, rows, c, c.div_ceil(32) * chunks(rows) * 256)
    }

    /// The partials of `parts` sums per column added in chunk order.
    fn sum_partials(rows: usize, c: usize, parts: usize) -> TrainLaunch {
        let mut l = train(TrainOp::SumPartials, parts * c, c, parts * c);
        l.params.tokens = chunks(rows) as u32;
        l
    }

    /// The sums over `rows` rows of each of `c` columns: x -> partials, then partials -> sums.
    pub fn column_sums(rows: usize, c: usize) -> [TrainLaunch; 2] {
        [
            column_partials(TrainOp::ColumnPartials, rows, c),
            sum_partials(rows, c, 1),
        ]
    }

    /// Gathers `n` elements (rows of `c`): table, ids -> y.
    pub fn embedding_fwd(n: usize, c: usize) -> TrainLaunch {
        train(TrainOp::EmbeddingFwd, n, c, n)
    }

    /// Scatter-adds `tokens` rows into `rows x c`: dout, ids -> dtable.
    pub fn embedding_bwd(rows: usize, c: usize, tokens: usize) -> TrainLaunch {
        let mut l = train(TrainOp::EmbeddingBwd, rows * c, c, rows * c);
        l.params.tokens = tokens as u32;
        l
    }

    /// x, g, b -> y held in `held`, (mean, rstd) per row; y `coded` goes to the third output
    /// as 16-bit codes (c even).
    pub fn layernorm_fwd(rows: usize, c: usize, held: Format, coded: bool) -> TrainLaunch {
        let mut l = row_op(TrainOp::LayernormFwd, rows, c);
        l.params.held = format_id(held);
        l.params.coded = coded as u32;
        l
    }

    /// dy, x, g -> dx (stats read); then dy, x -> the partials of dg and db
    /// (`partials_len(rows, c, 2)`), and the partials -> dg, db.
    pub fn layernorm_bwd(rows: usize, c: usize) -> [TrainLaunch; 3] {
        [
            row_op(TrainOp::LayernormBwdX, rows, c),
            column_partials(TrainOp::LayernormBwdPartials, rows, c),
            sum_partials(rows, c, 2),
        ]
    }

    /// GELU of x, stored as `x_stored` (f32, or a coded tensor's codes), held in `held`; where
    /// `coded`, its 16-bit codes go to the third output, one word (two elements) per
    /// invocation.
    pub fn gelu_fwd(n: usize, held: Format, coded: bool, x_stored: Format) -> TrainLaunch {
        let items = if coded { n.div_ceil(2) } else { n };
        let mut l = train(TrainOp::GeluFwd, n, 0, items);
        l.params.held = format_id(held);
        l.params.coded = coded as u32;
        l.params.x_stored = format_id(x_stored);
        l
    }

    /// GELU's backward, x stored as in `gelu_fwd`, dy in in1.
    pub fn gelu_bwd(n: usize, x_stored: Format) -> TrainLaunch {
        let mut l = train(TrainOp::GeluBwd, n, 0, n);
        l.params.x_stored = format_id(x_stored);
        l
    }

    /// Causal softmax of the scaled `x` (`ScoreScale`: the scale, its product held in
    /// `held`) over rows of `t`.
    pub fn softmax_fwd(rows: usize, t: usize, scale: ScoreScale) -> TrainLaunch {
        let mut l = row_op(TrainOp::CausalSoftmaxFwd, rows, t);
        l.params.scale = scale.scale as f32;
        l.params.held = format_id(scale.held);
        l
    }

    pub fn softmax_bwd(rows: usize, t: usize, scale: ScoreScale) -> TrainLaunch {
        let mut l = row_op(TrainOp::CausalSoftmaxBwd, rows, t);
        l.params.scale = scale.scale as f32;
        l.params.held = format_id(scale.held);
        l
    }

    /// Fused causal attention over `spec.score_rows()` rows: q|k|v -> out, each row's (max, sum).
    /// `coded`: the output goes to the third output as 16-bit codes of `spec.compute`;
    /// q|k|v is stored as `qkv_stored` (f32, or a coded tensor's codes).
    pub fn attention_fwd(spec: &Attention, coded: bool, qkv_stored: Format) -> TrainLaunch {
        let mut l = attention(TrainOp::AttentionFwd, spec, qkv_stored);
        l.params.coded = coded as u32;
        l
    }

    /// Its backward: dq with each row's sum(P * dP), then dk (which reads it), then dv, each
    /// into its third of dqkv (inputs q|k|v, the output's gradient, (max, sum); outputs dqkv,
    /// sum(P * dP)).
    pub fn attention_bwd(spec: &Attention, qkv_stored: Format) -> [TrainLaunch; 3] {
        [
            TrainOp::AttentionBwdQ,
            TrainOp::AttentionBwdK,
            TrainOp::AttentionBwdV,
        ]
        .map(|op| attention(op, spec, qkv_stored))
    }

    fn attention(op: TrainOp, spec: &Attention, qkv_stored: Format) -> TrainLaunch {
        let rows = spec.score_rows();
        let mut l = train(op, rows, spec.t, rows);
        l.params.scale = spec.scale as f32;
        l.params.h = spec.h as u32;
        l.params.d = spec.d as u32;
        l.params.inputs = format_id(spec.algorithm.operand_formats().0);
        l.params.probs = format_id(spec.probs);
        l.params.compute = format_id(spec.compute);
        l.params.x_stored = format_id(qkv_stored);
        l
    }

    /// logits, targets -> probabilities (or, with `grad` = the format it is held in, the loss's
    /// gradient scaled by scalar DLOSS_PER_ROW, the scalars bound as the third input), per-row
    /// losses.
    pub fn cross_entropy_fwd(rows: usize, v: usize, grad: Option<Format>) -> TrainLaunch {
        let mut l = row_op(TrainOp::CrossEntropyFwd, rows, v);
        if let Some(held) = grad {
            l.params.grad = 1;
            l.params.held = format_id(held);
        }
        l
    }

    fn step(op: StepOp, params: StepParams, items: Option<usize>) -> StepLaunch {
        StepLaunch { op, params, items }
    }

    /// The mean of `rows` per-row losses into stats slot `slot`.
    pub fn mean_to_stat(rows: usize, slot: usize) -> StepLaunch {
        let params = StepParams {
            n: rows as u32,
            slot: slot as u32,
            ..Default::default()
        };
        step(StepOp::MeanToStat, params, None)
    }

    /// probs, targets -> (probs - onehot) * scalar DLOSS_PER_ROW, over `n` elements.
    pub fn cross_entropy_bwd(n: usize, v: usize) -> StepLaunch {
        let params = StepParams {
            n: n as u32,
            c: v as u32,
            ..Default::default()
        };
        step(StepOp::CrossEntropyBwd, params, Some(n))
    }

    pub fn round(n: usize, format: Format) -> StepLaunch {
        let params = StepParams {
            n: n as u32,
            format: format_id(format),
            ..Default::default()
        };
        step(StepOp::Round, params, Some(n))
    }

    /// y (n) = y rounded to `y_held`, plus x (c, repeated over y), held in `held`; then, with
    /// a residual (bound as z) held in its format, plus it; or with a GELU (its format, and
    /// whether stored as codes), z = GELU(y).
    pub fn add(
        n: usize,
        c: usize,
        (y_held, held): (Format, Format),
        residual: Option<Format>,
        gelu: Option<(Format, bool)>,
    ) -> StepLaunch {
        let r_held = residual.unwrap_or(Format::F32);
        let params = StepParams {
            n: n as u32,
            c: c.max(1) as u32,
            format: format_id(held),
            extra: [
                0,
                format_id(y_held),
                residual.is_some() as u32,
                format_id(r_held),
            ],
            gelu: gelu_params(gelu),
            ..Default::default()
        };
        let items = match gelu {
            Some((_, true)) => n.div_ceil(2),
            _ => n,
        };
        step(StepOp::Add, params, Some(items))
    }

    /// z = y rounded to `y_held`, plus x, held in `held`, x (c values) repeated over y (n);
    /// where `coded`, its codes go to w instead, two to a word, and a GELU (its format, and
    /// whether stored as codes) of them to z.
    pub fn add_into(
        n: usize,
        c: usize,
        (y_held, held): (Format, Format),
        coded: bool,
        gelu: Option<(Format, bool)>,
    ) -> StepLaunch {
        let params = StepParams {
            n: n as u32,
            c: c.max(1) as u32,
            format: format_id(held),
            extra: [coded as u32, format_id(y_held), 0, 0],
            gelu: gelu_params(gelu),
            ..Default::default()
        };
        let items = if coded { n.div_ceil(2) } else { n };
        step(StepOp::AddInto, params, Some(items))
    }

    /// `StepParams::gelu` of an add's GELU (its format, and whether stored as codes), or of
    /// none.
    fn gelu_params(gelu: Option<(Format, bool)>) -> [u32; 4] {
        match gelu {
            Some((format, coded)) => [1, format_id(format), coded as u32, 0],
            None => [0; 4],
        }
    }

    pub fn strided_copy(map: &Strided) -> StepLaunch {
        let params = StepParams {
            n: map.len() as u32,
            dims: map.dims,
            src: map.src,
            dst: map.dst,
            extra: [map.src_offset, map.dst_offset, 0, 0],
            ..Default::default()
        };
        step(StepOp::StridedCopy, params, Some(map.len()))
    }

    /// GradScaler's unscale of `n` gradient values, its finite flag into stats slot `flag` and
    /// its squared norm into `norm`; `poisoned`: scalar POISON goes into the first element.
    pub fn unscale_check(n: usize, poisoned: bool, flag: usize, norm: usize) -> StepLaunch {
        let params = StepParams {
            n: n as u32,
            c: poisoned as u32,
            slot: flag as u32,
            extra: [norm as u32, 0, 0, 0],
            ..Default::default()
        };
        step(StepOp::UnscaleCheck, params, None)
    }

    /// AdamW on `n` values, applied only where the first `gated_on` gradients' flags are clear
    /// (0: always).
    pub fn adamw(n: usize, gated_on: usize, decay: bool) -> StepLaunch {
        let params = StepParams {
            n: n as u32,
            extra: [gated_on as u32, decay as u32, 0, 0],
            ..Default::default()
        };
        step(StepOp::Adamw, params, Some(n))
    }
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

    /// Runs one train kernel launch on uploaded operands and returns its three outputs.
    pub(crate) async fn train_op(
        &self,
        launch: TrainLaunch,
        inputs: [&[f32]; 3],
        outputs: [Out<'_>; 3],
    ) -> Result<[Vec<f32>; 3]> {
        let [i0, i1, i2] = inputs.map(Bind::In);
        let [o0, o1, o2] = outputs.map(Bind::Out);
        let groups = launch.groups(&self.gpu)?;
        let (kernel, params) = (launch.kernel(&self.gpu), launch.params);
        let outs = self
            .run_once(kernel, &params, [i0, i1, i2, o0, o1, o2], groups)
            .await?;
        let mut outs = outs.into_iter();
        Ok([(); 3].map(|_| outs.next().unwrap_or_default()))
    }

    /// Runs one step kernel launch (step.wgsl) on `scalars` (the plan's scalar slots) and
    /// returns the stats (`stats` values, zeroed first) and its outputs y, z, w.
    pub(crate) async fn step_op(
        &self,
        launch: StepLaunch,
        scalars: &[f32],
        (stats, x): (usize, &[f32]),
        outputs: [Out<'_>; 3],
    ) -> Result<[Vec<f32>; 4]> {
        let groups = launch.groups(&self.gpu)?;
        let (op, params) = (launch.op, launch.params);
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
