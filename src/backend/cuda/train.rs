//! Launchers of `cuda/train.cu` and `cuda/attention.cu` (and of the casts and amax the step
//! needs), on device pointers: the launches of the device-resident step plan's ops (`plan.rs`).
//!
//! The launch geometry lives here and nowhere else; tests/cuda_host/harness.cpp runs the kernels
//! with the same geometry on the host.

use super::{CudaBackend, Module, format_id};
use crate::error::{Error, Result};
use crate::format::Format;
use crate::plan::{Attention, MaskKind, Op, ScoreMask, ScoreScale, Strided, Unary};
use cudarc::driver::{DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, sys::CUdeviceptr};

/// A device address (of f32 values unless said otherwise).
pub(super) type Ptr = CUdeviceptr;

/// Threads of the row kernels (one block per row).
const ROW_THREADS: u32 = 128;
/// Rows per chunk of the column reductions (`CHUNK_ROWS` in train.cu).
const CHUNK_ROWS: usize = 256;
/// Threads of the embedding backward's sort (`SORT_THREADS` in train.cu), and of its sum.
const SORT_THREADS: u32 = 256;
const SUM_THREADS: u32 = 32;
/// Elements per block of the unscale reduction, and its most blocks.
const UNSCALE_PER_BLOCK: usize = 1024;
const UNSCALE_BLOCKS: usize = 256;

/// `Strided` as train.cu takes it (by value).
#[repr(C)]
#[derive(Clone, Copy)]
struct StridedArg {
    dims: [u32; 4],
    src: [u32; 4],
    dst: [u32; 4],
    src_offset: u32,
    dst_offset: u32,
}

// SAFETY: a plain #[repr(C)] struct of u32s, laid out as train.cu's `Strided`.
unsafe impl DeviceRepr for StridedArg {}

impl super::ParamSize for &StridedArg {
    fn param_size(&self) -> usize {
        std::mem::size_of::<StridedArg>()
    }
}

impl CudaBackend {
    /// The address of a device buffer (one stream, so no event tracking is needed).
    pub(super) fn ptr<T>(&self, x: &impl DevicePtr<T>) -> Ptr {
        x.device_ptr(&self.stream).0
    }

    fn rows_config(rows: usize) -> Result<LaunchConfig> {
        Ok(LaunchConfig {
            grid_dim: (grid_size("rows", rows)?, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    }
}

fn grid_size(what: &str, n: usize) -> Result<u32> {
    if n > i32::MAX as usize {
        return Err(Error::invalid(
            "training op",
            format!("{n} {what} exceed a CUDA grid"),
        ));
    }
    Ok(n as u32)
}

fn chunks(rows: usize) -> usize {
    rows.div_ceil(CHUNK_ROWS).max(1)
}

fn unscale_blocks(n: usize) -> usize {
    n.div_ceil(UNSCALE_PER_BLOCK).clamp(1, UNSCALE_BLOCKS)
}

/// Scratch values (f32) an op needs besides its operands.
pub(super) mod scratch {
    use crate::plan::{Op, TensorId};

    /// The scratch values `op` needs (`len`: the length of each of its tensors).
    pub fn of(op: &Op, len: impl Fn(TensorId) -> usize) -> usize {
        let rows = |x: TensorId, width: usize| len(x) / width.max(1);
        match *op {
            Op::CrossEntropy { logits, v, .. } => cross_entropy(rows(logits, v)),
            Op::LayerNormBwd { x, c, .. } => layernorm_bwd(rows(x, c), c),
            Op::RmsNormBwd { x, c, .. } => rmsnorm_bwd(rows(x, c), c),
            Op::MseLoss { pred, .. } => mse(len(pred)),
            Op::ColumnSums { x, c, .. } => column_sums(rows(x, c), c),
            Op::UnscaleCheck { ref grads } => grads.iter().map(|&g| unscale(len(g))).sum(),
            Op::AttentionBwd { ref spec, .. } => attention_bwd(spec),
            Op::EmbeddingBwd { ids, rows, .. } => embedding_bwd(rows, len(ids)),
            Op::Embedding { .. }
            | Op::LayerNorm { .. }
            | Op::Unary { .. }
            | Op::UnaryBwd { .. }
            | Op::RmsNorm { .. }
            | Op::Mul { .. }
            | Op::RowSum { .. }
            | Op::Broadcast { .. }
            | Op::Dropout { .. }
            | Op::Rotary { .. }
            | Op::Softmax { .. }
            | Op::SoftmaxBwd { .. }
            | Op::Attention { .. }
            | Op::Matmul { .. }
            | Op::Round { .. }
            | Op::Add { .. }
            | Op::Copy { .. }
            | Op::Amax { .. }
            | Op::AdamW { .. } => 0,
        }
    }

    /// Column sums of `rows x c`.
    pub fn column_sums(rows: usize, c: usize) -> usize {
        super::chunks(rows) * c
    }
    /// Layer norm's backward (dg and db partials).
    pub fn layernorm_bwd(rows: usize, c: usize) -> usize {
        2 * super::chunks(rows) * c
    }
    /// The embedding backward's sort (u32s): counts per (id, sort thread), where each id's
    /// tokens start, the token indices grouped by id.
    pub fn embedding_bwd(rows: usize, tokens: usize) -> usize {
        rows * super::SORT_THREADS as usize + rows + 1 + tokens
    }
    /// RMS norm's backward (dg partials).
    pub fn rmsnorm_bwd(rows: usize, c: usize) -> usize {
        super::chunks(rows) * c
    }
    /// The mean squared error (a squared error per element).
    pub fn mse(n: usize) -> usize {
        n
    }
    /// Cross entropy (a loss per row).
    pub fn cross_entropy(rows: usize) -> usize {
        rows
    }
    /// The unscale of `n` gradient values.
    pub fn unscale(n: usize) -> usize {
        2 * super::unscale_blocks(n)
    }
    /// Attention's backward on tensor cores: dq's partials, one (B, H, T, D) set per split,
    /// then the output's gradient as 16-bit codes (two to a value).
    pub fn attention_bwd(spec: &crate::plan::Attention) -> usize {
        if super::on_tensor_cores(spec) {
            super::attention_splits(spec.t) * spec.out_len() + spec.out_len().div_ceil(2)
        } else {
            0
        }
    }
}

pub(super) fn embedding_fwd(
    cb: &CudaBackend,
    table: Ptr,
    ids: Ptr,
    out: Ptr,
    tokens: usize,
    c: usize,
) -> Result<()> {
    let (n, c) = ((tokens * c) as i64, c as u32);
    launch_1d!(cb, Module::Train, "embedding_fwd", tokens * c as usize; &table, &ids, &out, &n, &c)
}

/// The embedding scatter-add as a sorted segment sum: `embedding_sort` (one block) groups the
/// token indices by id in `scratch` (`scratch::embedding_bwd`), then `embedding_sum` sums each
/// id's rows of dout in token order, a block per (id, span of columns).
pub(super) fn embedding_bwd(
    cb: &CudaBackend,
    [dout, ids, out]: [Ptr; 3],
    (rows, c, tokens): (usize, usize, usize),
    scratch: Ptr,
) -> Result<()> {
    if rows == 0 || c == 0 {
        return Ok(());
    }
    let (rows32, c32, tokens32) = (
        grid_size("rows", rows)?,
        c as u32,
        grid_size("tokens", tokens)?,
    );
    let counts = scratch;
    let offsets = counts + (rows * SORT_THREADS as usize * 4) as u64;
    let sorted = offsets + ((rows + 1) * 4) as u64;
    let sort = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (SORT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(cb, Module::Train, "embedding_sort", sort; &ids, &counts, &offsets, &sorted, &rows32, &tokens32)?;
    let width: u32 = if c % 4 == 0 && dout % 16 == 0 { 4 } else { 1 };
    let spans = c.div_ceil(width as usize).div_ceil(SUM_THREADS as usize);
    let sum = LaunchConfig {
        grid_dim: (rows32, grid_size("column spans", spans)?, 1),
        block_dim: (SUM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(cb, Module::Train, "embedding_sum", sum; &dout, &offsets, &sorted, &out, &c32, &width)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn layernorm_fwd(
    cb: &CudaBackend,
    [x, g, b, y, stats]: [Ptr; 5],
    (rows, c): (usize, usize),
    (held, coded): (Format, bool),
) -> Result<()> {
    if rows == 0 || c == 0 {
        return Ok(());
    }
    let (c, fmt, coded) = (c as u32, format_id(held), coded as u32);
    launch!(cb, Module::Train, "layernorm_fwd", CudaBackend::rows_config(rows)?; &x, &g, &b, &y, &stats, &c, &fmt, &coded)
}

/// dx (dy rounded to `dy_held` as it is read; with `sum` (r, format), dx + r held in that
/// format), then dg and db through per-chunk partials in `scratch` (`scratch::layernorm_bwd`)
/// and `counters` (`counters_for`).
pub(super) fn layernorm_bwd(
    cb: &CudaBackend,
    [dy, x, g, stats, dx, dg, db]: [Ptr; 7],
    (rows, c): (usize, usize),
    (dy_held, sum): (Format, Option<(Ptr, Format)>),
    (scratch, counters): (Ptr, Ptr),
) -> Result<()> {
    if rows == 0 || c == 0 {
        return Ok(());
    }
    let (c32, rows32, dy_fmt) = (c as u32, rows as u32, format_id(dy_held));
    // No sum: a null pointer, which the kernel reads as none.
    let (sum, sum_fmt) = sum.map_or((0, 0), |(p, f)| (p, format_id(f)));
    launch!(cb, Module::Train, "layernorm_bwd_x", CudaBackend::rows_config(rows)?; &dy, &x, &g, &stats, &dx, &c32, &dy_fmt, &sum, &sum_fmt)?;
    let chunks = chunks(rows);
    launch!(cb, Module::Train, "layernorm_bwd_columns", column_config(c, chunks)?; &dy, &x, &stats, &scratch, &dg, &db, &counters, &rows32, &c32, &dy_fmt)
}

/// 4 where RMS norm's kernels take 16-byte accesses: rows of a multiple of 4 values and every
/// pointer they access so 16-byte aligned; else 1.
fn quad_width(c: usize, ptrs: &[Ptr]) -> u32 {
    if c.is_multiple_of(4) && ptrs.iter().all(|p| p.is_multiple_of(16)) {
        4
    } else {
        1
    }
}

/// y = x * rstd * g held in `held` (codes where `coded`), rstd per row into `rstds`.
pub(super) fn rmsnorm_fwd(
    cb: &CudaBackend,
    [x, g, y, rstds]: [Ptr; 4],
    (rows, c, eps): (usize, usize, f32),
    (held, coded): (Format, bool),
) -> Result<()> {
    if rows == 0 || c == 0 {
        return Ok(());
    }
    let width = match coded {
        true => quad_width(c, &[x, g]),
        false => quad_width(c, &[x, g, y]),
    };
    let (c, fmt, coded) = (c as u32, format_id(held), coded as u32);
    launch!(cb, Module::Train, "rmsnorm_fwd", CudaBackend::rows_config(rows)?; &x, &g, &y, &rstds, &c, &eps, &fmt, &coded, &width)
}

/// dx, then dg through per-chunk partials in `scratch` (`scratch::rmsnorm_bwd`) and
/// `counters` (`counters_for`).
pub(super) fn rmsnorm_bwd(
    cb: &CudaBackend,
    [dy, x, g, rstds, dx, dg]: [Ptr; 6],
    (rows, c): (usize, usize),
    dy_held: Format,
    (scratch, counters): (Ptr, Ptr),
) -> Result<()> {
    if rows == 0 || c == 0 {
        return Ok(());
    }
    let width = quad_width(c, &[dy, x, g, dx]);
    let (c32, rows32, dy_fmt) = (c as u32, rows as u32, format_id(dy_held));
    launch!(cb, Module::Train, "rmsnorm_bwd_x", CudaBackend::rows_config(rows)?; &dy, &x, &g, &rstds, &dx, &c32, &width, &dy_fmt)?;
    let chunks = chunks(rows);
    launch!(cb, Module::Train, "rmsnorm_bwd_columns", column_config(c, chunks)?; &dy, &x, &rstds, &scratch, &dg, &counters, &rows32, &c32, &dy_fmt)
}

fn column_config(c: usize, chunks: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (
            grid_size("columns", c.div_ceil(32))?,
            grid_size("row chunks", chunks).and_then(|g| {
                if g > 65535 {
                    Err(Error::invalid(
                        "training op",
                        "too many rows for a column reduction",
                    ))
                } else {
                    Ok(g)
                }
            })?,
            1,
        ),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    })
}

/// out[j] = sum over rows of x[row, j], x rounded to `x_held` as it is read and the sums held
/// in `held`, through `scratch` (`scratch::column_sums`) and the zeros of `counters`
/// (`counters_for`), in one launch.
pub(super) fn column_sums(
    cb: &CudaBackend,
    [x, out]: [Ptr; 2],
    (rows, c): (usize, usize),
    (x_held, held): (Format, Format),
    (scratch, counters): (Ptr, Ptr),
) -> Result<()> {
    if c == 0 {
        return Ok(());
    }
    let (c32, rows32, chunks) = (c as u32, rows as u32, chunks(rows));
    let (x_fmt, fmt) = (format_id(x_held), format_id(held));
    launch!(cb, Module::Train, "column_sums", column_config(c, chunks)?; &x, &scratch, &out, &counters, &rows32, &c32, &x_fmt, &fmt)
}

/// The u32 counters (zeros between launches) the column reductions of `op` need: one per
/// block of 32 columns (`last_chunk` in train.cu).
pub(super) fn counters_for(op: &Op) -> usize {
    match *op {
        Op::ColumnSums { c, .. } | Op::LayerNormBwd { c, .. } | Op::RmsNormBwd { c, .. } => {
            c.div_ceil(32)
        }
        _ => 0,
    }
}

/// y = f(x) held in `held`; `coded`: y stores its 16-bit codes (a plan's coded tensor); x is
/// stored in `x_stored` (f32, or the codes of a coded tensor).
pub(super) fn unary_fwd(
    cb: &CudaBackend,
    f: Unary,
    [x, y]: [Ptr; 2],
    n: usize,
    (held, coded): (Format, bool),
    x_stored: Format,
) -> Result<()> {
    let (len, fmt, coded) = (n as i64, format_id(held), coded as u32);
    let (x_fmt, f) = (format_id(x_stored), f.id());
    launch_1d!(cb, Module::Train, "unary_fwd", n; &x, &y, &len, &fmt, &coded, &x_fmt, &f)
}

/// dx = dy * f'(x) held in `held`, dy rounded to `dy_held` as it is read, x stored in
/// `x_stored`.
pub(super) fn unary_bwd(
    cb: &CudaBackend,
    f: Unary,
    [x, dy, dx]: [Ptr; 3],
    n: usize,
    (held, dy_held): (Format, Format),
    x_stored: Format,
) -> Result<()> {
    let (len, fmt, x_fmt) = (n as i64, format_id(held), format_id(x_stored));
    let (dy_fmt, f) = (format_id(dy_held), f.id());
    launch_1d!(cb, Module::Train, "unary_bwd", n; &x, &dy, &dx, &len, &fmt, &x_fmt, &dy_fmt, &f)
}

/// out = a * b held in `held` (codes where `coded`).
pub(super) fn mul(
    cb: &CudaBackend,
    [a, b, out]: [Ptr; 3],
    n: usize,
    (held, coded): (Format, bool),
) -> Result<()> {
    let (len, fmt, coded) = (n as i64, format_id(held), coded as u32);
    launch_1d!(cb, Module::Train, "elementwise_mul", n; &a, &b, &out, &len, &fmt, &coded)
}

/// out = x times dropout's mask (`plan::dropout`) at the step in the scalars, held in `held`.
pub(super) fn dropout(
    cb: &CudaBackend,
    [x, out, scalars]: [Ptr; 3],
    n: usize,
    (p, seed, site): (f32, u64, u32),
    held: Format,
) -> Result<()> {
    let (len, scale, fmt) = (
        n as i64,
        crate::plan::dropout::keep_scale(p),
        format_id(held),
    );
    let [k0, k1] = crate::plan::dropout::key(seed);
    launch_1d!(cb, Module::Train, "dropout", n; &x, &out, &scalars, &len, &p, &scale, &site, &k0, &k1, &fmt)
}

/// x (rows of c = heads x d at t positions) rotated by the table's angles (the opposite ones
/// where `inverse`), held in `held` (`plan::rotary`).
pub(super) fn rotary(
    cb: &CudaBackend,
    [x, table, out]: [Ptr; 3],
    n: usize,
    (t, c, d, inverse): (usize, usize, usize, bool),
    held: Format,
) -> Result<()> {
    let (len, c, d, t) = (n as i64, c as u32, d as u32, t as u32);
    let (inverse, fmt) = (inverse as u32, format_id(held));
    launch_1d!(cb, Module::Train, "rotary", n; &x, &table, &out, &len, &c, &d, &t, &inverse, &fmt)
}

/// out[row] = the sum of each row of c values / `divisor`, held in `held`.
pub(super) fn row_sums(
    cb: &CudaBackend,
    [x, out]: [Ptr; 2],
    (rows, c, divisor): (usize, usize, f32),
    held: Format,
) -> Result<()> {
    if rows == 0 || c == 0 {
        return Ok(());
    }
    let (c, fmt) = (c as u32, format_id(held));
    launch!(cb, Module::Train, "row_sums", CudaBackend::rows_config(rows)?; &x, &out, &c, &divisor, &fmt)
}

/// out[e] = x[e / c] * scale / divisor held in `held`, over n values of out.
pub(super) fn broadcast(
    cb: &CudaBackend,
    [x, out]: [Ptr; 2],
    (n, c): (usize, usize),
    (scale, divisor): (f32, f32),
    held: Format,
) -> Result<()> {
    let (len, c, fmt) = (n as i64, c as u32, format_id(held));
    launch_1d!(cb, Module::Train, "broadcast", n; &x, &out, &len, &c, &scale, &divisor, &fmt)
}

/// The mean of the squared errors into stats[slot], and into `grad` the loss's gradient
/// 2 (pred - target) * scalars[DLOSS] / n held in `held`; `scratch` holds the squared errors
/// (`scratch::mse`).
pub(super) fn mse_fwd(
    cb: &CudaBackend,
    [pred, target, grad, stats]: [Ptr; 4],
    (slot, n): (usize, usize),
    scratch: Ptr,
    (scalars, held): (Ptr, Format),
) -> Result<()> {
    let (len, fmt) = (n as i64, format_id(held));
    let n32 = grid_size("values of a mean", n)?;
    launch_1d!(cb, Module::Train, "mse_fwd", n; &pred, &target, &grad, &scratch, &scalars, &len, &fmt)?;
    let slot = slot as u32;
    launch!(cb, Module::Train, "mean_to_stat", one_block(256); &scratch, &stats, &n32, &slot)
}

/// The softmax of the scaled scores x (rounded to `x_held` as they are read) into p, causal
/// or not, reading `mask` (on the device, with its layout) where there is one.
pub(super) fn softmax_fwd(
    cb: &CudaBackend,
    [x, p]: [Ptr; 2],
    (rows, t, scale, causal): (usize, usize, ScoreScale, bool),
    mask: Option<(Ptr, ScoreMask)>,
    x_held: Format,
) -> Result<()> {
    if rows == 0 || t == 0 {
        return Ok(());
    }
    let (t, k, fmt) = (t as u32, scale.scale as f32, format_id(scale.held));
    let (x_fmt, causal) = (format_id(x_held), causal as u32);
    // Without a mask the kernel reads none: x stands in for the pointer (and 1 for the
    // divisors).
    let (ptr, kind, [block, stride, period]) = match mask {
        None => (x, 0u32, [1, 0, 1]),
        Some((m, s)) => (
            m,
            match s.kind {
                MaskKind::Keys => 1,
                MaskKind::Bias => 2,
            },
            [s.block, s.stride, s.period].map(|v| v as u32),
        ),
    };
    launch!(cb, Module::Train, "softmax_fwd", CudaBackend::rows_config(rows)?; &x, &p, &t, &k, &fmt, &x_fmt, &causal, &ptr, &kind, &block, &stride, &period)
}

/// Its backward: p and dp (rounded to `dp_held` as it is read) -> the scores' gradient ds.
pub(super) fn softmax_bwd(
    cb: &CudaBackend,
    [p, dp, ds]: [Ptr; 3],
    (rows, t, scale, causal): (usize, usize, ScoreScale, bool),
    dp_held: Format,
) -> Result<()> {
    if rows == 0 || t == 0 {
        return Ok(());
    }
    let (t, k, fmt) = (t as u32, scale.scale as f32, format_id(scale.held));
    let (dp_fmt, causal) = (format_id(dp_held), causal as u32);
    launch!(cb, Module::Train, "softmax_bwd", CudaBackend::rows_config(rows)?; &p, &dp, &ds, &t, &k, &fmt, &dp_fmt, &causal)
}

/// The mean of the rows' losses into stats[slot], and into `out` the loss's gradient
/// (p - onehot) * scalars[DLOSS_PER_ROW] held in `held` (`grad`: the scalars and the format);
/// `scratch` holds the rows' losses (`scratch::cross_entropy`).
pub(super) fn cross_entropy_fwd(
    cb: &CudaBackend,
    [logits, targets, out, stats]: [Ptr; 4],
    (slot, rows, v): (usize, usize, usize),
    scratch: Ptr,
    (scalars, held, coded): (Ptr, Format, bool),
) -> Result<()> {
    if rows == 0 || v == 0 {
        return Ok(());
    }
    let (v32, grad, fmt, coded) = (v as u32, 1u32, format_id(held), coded as u32);
    launch!(cb, Module::Train, "cross_entropy_fwd", CudaBackend::rows_config(rows)?; &logits, &targets, &out, &scratch, &scalars, &v32, &grad, &fmt, &coded)?;
    let (rows32, slot) = (rows as u32, slot as u32);
    launch!(cb, Module::Train, "mean_to_stat", one_block(256); &scratch, &stats, &rows32, &slot)
}

fn one_block(threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// out = y rounded to `y_held`, plus x rounded to `x_held`, held in `held`, x (c elements)
/// repeated over y (n); then, where `r` is not null, plus r (n elements) held in `r_held`;
/// its 16-bit codes where `coded`. out may be y.
pub(super) fn add(
    cb: &CudaBackend,
    [x, y, out]: [Ptr; 3],
    (n, c): (usize, usize),
    (y_held, x_held, held, coded): (Format, Format, Format, bool),
    (r, r_held): (Ptr, Format),
    (g, g_held, g_coded): (Ptr, Format, bool),
) -> Result<()> {
    let (len, c, coded, g_coded) = (n as i64, c.max(1) as u32, coded as u32, g_coded as u32);
    let (y_fmt, x_fmt, fmt) = (format_id(y_held), format_id(x_held), format_id(held));
    let (r_fmt, g_fmt) = (format_id(r_held), format_id(g_held));
    launch_1d!(cb, Module::Train, "add", n;
        &x, &y, &out, &len, &c, &y_fmt, &x_fmt, &fmt, &coded, &r, &r_fmt, &g, &g_fmt, &g_coded)
}

/// y[map.dst(e)] = x[map.src(e)] rounded to `held`.
pub(super) fn strided_copy(
    cb: &CudaBackend,
    [x, y]: [Ptr; 2],
    map: &Strided,
    held: Format,
) -> Result<()> {
    let arg = StridedArg {
        dims: map.dims,
        src: map.src,
        dst: map.dst,
        src_offset: map.src_offset,
        dst_offset: map.dst_offset,
    };
    let (n, fmt) = (map.len() as i64, format_id(held));
    launch_1d!(cb, Module::Train, "strided_copy", map.len(); &x, &y, &n, &arg, &fmt)
}

/// A multi-tensor kernel's table (train.cu's `TensorBlocks`, 7 words a tensor): each tensor's
/// pointers (up to 4), length and range of the grid's blocks, written to the device once when
/// the plan is built (the tensors stay where they are).
pub(super) struct TensorTable {
    pub words: Vec<u64>,
    /// Tensors in the table.
    pub count: usize,
    /// Blocks of the grid, over all tensors.
    pub blocks: usize,
}

/// Words of train.cu's `TensorBlocks`.
const TABLE_WORDS: usize = 7;
/// Values per block of the multi-tensor AdamW (`ADAMW_CHUNK` in train.cu).
const ADAMW_CHUNK: usize = 4096;

impl TensorTable {
    /// The table of `tensors` (pointers, length, weight decay), each given `blocks_of(length)`
    /// blocks; an error where the grid would exceed CUDA's.
    fn new(
        tensors: impl IntoIterator<Item = ([Ptr; 4], usize, bool)>,
        blocks_of: fn(usize) -> usize,
    ) -> Result<TensorTable> {
        let mut table = TensorTable {
            words: Vec::new(),
            count: 0,
            blocks: 0,
        };
        for (ptrs, n, decay) in tensors {
            let blocks = blocks_of(n);
            grid_size("blocks of a multi-tensor launch", table.blocks + blocks)?;
            table.words.extend(ptrs);
            table.words.push(n as u64);
            table
                .words
                .push(table.blocks as u64 | (blocks as u64) << 32);
            table.words.push(decay as u64);
            table.blocks += blocks;
            table.count += 1;
        }
        debug_assert_eq!(table.words.len(), TABLE_WORDS * table.count);
        Ok(table)
    }

    /// The unscale's table: `grads` as `unscale` launched one at a time would split them.
    pub fn unscale(grads: impl IntoIterator<Item = (Ptr, usize)>) -> Result<TensorTable> {
        TensorTable::new(
            grads.into_iter().map(|(g, n)| ([g, 0, 0, 0], n, false)),
            unscale_blocks,
        )
    }

    /// AdamW's table: (p, g, m, v), length and weight decay per parameter.
    pub fn adamw(params: impl IntoIterator<Item = ([Ptr; 4], usize, bool)>) -> Result<TensorTable> {
        TensorTable::new(params, |n| n.div_ceil(ADAMW_CHUNK))
    }
}

/// Threads of a multi-tensor kernel's block.
const TABLE_THREADS: u32 = 256;

/// GradScaler's unscale of every gradient of `table` (on the device at `on_device`) in place,
/// POISON added to the first value of the first; their finite flags into stats[flags + i] and
/// squared norms into stats[norms + i]. `scratch`: `scratch::unscale` of the lengths.
pub(super) fn unscale(
    cb: &CudaBackend,
    (table, on_device): (&TensorTable, Ptr),
    [scalars, stats]: [Ptr; 2],
    (flags, norms): (usize, usize),
    scratch: Ptr,
) -> Result<()> {
    if table.count == 0 {
        return Ok(());
    }
    let cfg = |blocks: usize| LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (TABLE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let count = table.count as u32;
    launch!(cb, Module::Train, "unscale_partials", cfg(table.blocks); &on_device, &count, &scratch, &scalars)?;
    let (flags, norms) = (flags as u32, norms as u32);
    let finishers = table.count.div_ceil(TABLE_THREADS as usize);
    launch!(cb, Module::Train, "unscale_finish", cfg(finishers); &on_device, &count, &scratch, &stats, &flags, &norms)
}

/// AdamW on every parameter of `table` (on the device at `on_device`), gated on the `count`
/// gradients' flags in stats (see train.cu).
pub(super) fn adamw(
    cb: &CudaBackend,
    (table, on_device): (&TensorTable, Ptr),
    [stats, scalars]: [Ptr; 2],
    (count, held): (usize, Format),
) -> Result<()> {
    if table.blocks == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (table.blocks as u32, 1, 1),
        block_dim: (TABLE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (tensors, count, fmt) = (table.count as u32, count as u32, format_id(held));
    launch!(cb, Module::Train, "adamw", cfg; &on_device, &tensors, &stats, &scalars, &count, &fmt)
}

/// x rounded to `format` in place.
pub(super) fn round(cb: &CudaBackend, x: Ptr, n: usize, format: Format) -> Result<()> {
    let (len, fmt) = (n as i64, format_id(format));
    launch_1d!(cb, Module::Cast, "round_to", n; &x, &x, &len, &fmt)
}

/// The bits of stats[slot] = max(themselves, the largest finite |x|) (stats zeroed per step).
pub(super) fn amax_into(cb: &CudaBackend, x: Ptr, n: usize, stats: Ptr, slot: usize) -> Result<()> {
    let len = n as i64;
    let at = stats + (slot * 4) as u64;
    let (batch_len, div, modulus, per_batch) = (n.max(1) as u32, n.max(1) as u32, 1u32, 1u32);
    launch!(cb, Module::Scale, "amax", CudaBackend::config_amax(n); &x, &len, &at, &batch_len, &div, &modulus, &per_batch)
}

/// Query (or key) rows per block of the SIMT attention kernels (`ATT_ROWS` in attention.cu).
const ATTENTION_ROWS: u32 = 64;

/// The tensor-core attention kernels' geometry (attention.cu): query rows per block of the
/// forward and delta kernels (`TC_ROWS`, 8 warps), keys per block (`TC_KEYS`); the dk/dv
/// kernel's threads (4 warps of 16 keys) and most blocks per sequence and head, each adding the
/// dq of its key blocks into a partial of its own.
const TC_ROWS: usize = 128;
const TC_KEYS: usize = 64;
const TC_THREADS: u32 = 256;
const TC_KV_THREADS: u32 = 128;
const TC_SPLITS: usize = 4;

/// The head sizes attention.cu is compiled for.
pub(super) const ATTENTION_HEAD_SIZES: [usize; 3] = [16, 32, 64];

/// Whether `spec` runs on the tensor-core kernels: the algorithms whose inputs are 16-bit (bf16
/// or f16), with probabilities and matmul results held in f32, bf16 or f16 (the formats their
/// branch-free rounding knows); f32 and tf32 inputs, or another held format, take the SIMT ones.
fn on_tensor_cores(spec: &Attention) -> bool {
    let held = |f: Format| matches!(f, Format::F32 | Format::Bf16 | Format::F16);
    matches!(
        spec.algorithm.operand_formats().0,
        Format::Bf16 | Format::F16
    ) && held(spec.probs)
        && held(spec.compute)
}

/// The dk/dv kernel's blocks per sequence and head (dq partials).
fn attention_splits(t: usize) -> usize {
    t.div_ceil(TC_KEYS).clamp(1, TC_SPLITS)
}

/// The name of kernel `family` of attention.cu for head size `d` (`<family>_<d>`).
fn kernel(family: &str, d: usize) -> String {
    format!("{family}_{d}")
}

/// `AttentionArg` of attention.cu (by value).
#[repr(C)]
#[derive(Clone, Copy)]
struct AttentionArg {
    t: u32,
    h: u32,
    scale: f32,
    inputs: u32,
    probs: u32,
    compute: u32,
    /// 1: the forward's output is stored as 16-bit codes of `compute`.
    coded: u32,
    /// The format id q|k|v is stored in (f32, or a coded tensor's bf16/f16 codes).
    qkv_stored: u32,
}

// SAFETY: a plain #[repr(C)] struct of 4-byte fields, laid out as attention.cu's `AttentionArg`.
unsafe impl DeviceRepr for AttentionArg {}

impl super::ParamSize for &AttentionArg {
    fn param_size(&self) -> usize {
        std::mem::size_of::<AttentionArg>()
    }
}

/// A grid of a block per sequence and head (x) and `blocks` per head (y), of `threads` each.
fn attention_grid(spec: &Attention, blocks: usize, threads: u32) -> Result<LaunchConfig> {
    if blocks > 65535 {
        return Err(Error::invalid(
            "attention",
            format!(
                "a sequence of {} tokens needs {blocks} blocks of a CUDA grid's y (at most 65535)",
                spec.t
            ),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (
            grid_size("sequences x heads", spec.b * spec.h)?,
            blocks.max(1) as u32,
            1,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The attention kernels' argument, after checking that `spec` has kernels.
fn attention_arg(spec: &Attention, coded: bool, qkv_stored: Format) -> Result<AttentionArg> {
    if !ATTENTION_HEAD_SIZES.contains(&spec.d) {
        return Err(Error::invalid(
            "attention",
            format!(
                "head size {} has no fused kernel (sizes {ATTENTION_HEAD_SIZES:?})",
                spec.d
            ),
        ));
    }
    let (inputs, _) = spec.algorithm.operand_formats();
    Ok(AttentionArg {
        t: spec.t as u32,
        h: spec.h as u32,
        scale: spec.scale as f32,
        inputs: format_id(inputs),
        probs: format_id(spec.probs),
        compute: format_id(spec.compute),
        coded: coded as u32,
        qkv_stored: format_id(qkv_stored),
    })
}

/// Fused causal attention: out (B, T, C) and each score row's (max, sum) from q|k|v (B, T, 3C),
/// stored as `qkv_stored`; `coded`: out stores its 16-bit codes.
pub(super) fn attention_fwd(
    cb: &CudaBackend,
    [qkv, out, stats]: [Ptr; 3],
    spec: &Attention,
    (coded, qkv_stored): (bool, Format),
) -> Result<()> {
    if spec.score_rows() == 0 {
        return Ok(());
    }
    let arg = attention_arg(spec, coded, qkv_stored)?;
    let d = spec.d;
    if on_tensor_cores(spec) {
        let cfg = attention_grid(spec, spec.t.div_ceil(TC_ROWS), TC_THREADS)?;
        return launch!(cb, Module::Attention, &kernel("attention_mma_fwd", d), cfg; &qkv, &out, &stats, &arg);
    }
    let cfg = attention_grid(
        spec,
        spec.t.div_ceil(ATTENTION_ROWS as usize),
        ATTENTION_ROWS,
    )?;
    launch!(cb, Module::Attention, &kernel("attention_fwd", d), cfg; &qkv, &out, &stats, &arg)
}

/// Its backward into dqkv, and each row's sum(P * dP) into `delta`. On tensor cores: the delta
/// kernel (which also writes the output's gradient as codes), then dk and dv with dq's
/// partials, then dq from them, the partials and codes in `scratch` (`scratch::attention_bwd`);
/// else (SIMT) dq with delta, then dk (which reads delta) and dv.
pub(super) fn attention_bwd(
    cb: &CudaBackend,
    [qkv, dout, stats, delta, dqkv]: [Ptr; 5],
    spec: &Attention,
    qkv_stored: Format,
    scratch: Ptr,
) -> Result<()> {
    if spec.score_rows() == 0 {
        return Ok(());
    }
    let arg = attention_arg(spec, false, qkv_stored)?;
    let d = spec.d;
    if on_tensor_cores(spec) {
        let rows = spec.t.div_ceil(TC_ROWS);
        let splits = attention_splits(spec.t);
        let codes = scratch + (splits * spec.out_len() * 4) as u64;
        let cfg = attention_grid(spec, rows, TC_THREADS)?;
        launch!(cb, Module::Attention, &kernel("attention_mma_delta", d), cfg; &qkv, &dout, &stats, &delta, &codes, &arg)?;
        let cfg = attention_grid(spec, splits, TC_KV_THREADS)?;
        launch!(cb, Module::Attention, &kernel("attention_mma_kv", d), cfg; &qkv, &codes, &stats, &delta, &dqkv, &scratch, &arg)?;
        let (score_rows, splits) = (grid_size("score rows", spec.score_rows())?, splits as u32);
        return launch_1d!(cb, Module::Attention, &kernel("attention_mma_dq", d), spec.out_len() / 4;
            &scratch, &dqkv, &score_rows, &splits, &arg);
    }
    let cfg = attention_grid(
        spec,
        spec.t.div_ceil(ATTENTION_ROWS as usize),
        ATTENTION_ROWS,
    )?;
    launch!(cb, Module::Attention, &kernel("attention_bwd_q", d), cfg; &qkv, &dout, &stats, &delta, &dqkv, &arg)?;
    launch!(cb, Module::Attention, &kernel("attention_bwd_k", d), cfg; &qkv, &dout, &stats, &delta, &dqkv, &arg)?;
    launch!(cb, Module::Attention, &kernel("attention_bwd_v", d), cfg; &qkv, &dout, &stats, &dqkv, &arg)
}
