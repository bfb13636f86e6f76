//! The training kernels on wgpu (`shaders/train.wgsl`, `shaders/step.wgsl`): their entry points
//! (`TrainOp`, `StepOp`), and what each op of a step plan launches (kernel, uniform,
//! invocations), defined here once, in `launch`; the device-resident step plan (`plan.rs`)
//! binds them to its tensors.

use super::buffer::Dispatch;
use super::device::Gpu;
use super::shaders::looped;
use super::shaders::{Kernel, span_flags};
use crate::error::Result;
use bytemuck::{Pod, Zeroable};

pub use super::entries::{
    ATT_BC, ATT_COOP_SUBGROUPS, ATT_LANES, ATT_MAX_D, StepOp, TrainOp, att_block_rows,
};

/// Bytes of workgroup memory attention_coop.wgsl's kernels take on `coop`'s tiles (its arrays:
/// the block's two sets of own rows and the streamed tile's two, f16 rows of the largest head
/// padded by 8; per subgroup the scores or output rows, dP, and P and dS^T; the query tile's
/// stats; the lanes' reductions).
pub fn coop_attention_bytes(coop: super::shaders::Coop) -> u32 {
    let (t, w) = (coop.size, ATT_COOP_SUBGROUPS);
    let kc = 2 * t;
    let row = (ATT_MAX_D + 8) * 2;
    2 * w * t * row
        + 2 * kc * row
        + w * t * ATT_MAX_D * 4
        + w * t * kc * 4
        + 2 * w * t * (kc + 8) * 2
        + 3 * kc * 4
        + 2 * w * coop.subgroup * 4
}

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
    /// Head size.
    pub d: u32,
    /// Format id the matmul inputs are rounded to.
    pub inputs: u32,
    /// Format id the probabilities are held in.
    pub probs: u32,
    /// Format id the matmul results and scaled scores are held in.
    pub compute: u32,
    /// Format id the op's output is held in (layer norm, a unary function, the cross entropy's gradient).
    pub held: u32,
    /// 1: the output goes to out2 as 16-bit codes of `held` (a coded tensor).
    pub coded: u32,
    /// Cross entropy: 1 writes the loss's gradient (the backward fused in), 0 the probabilities.
    pub grad: u32,
    /// The format id whose 16-bit codes the first input holds (a coded input: a unary function's x,
    /// fused attention's q|k|v); f32's id: it holds f32 values.
    pub x_stored: u32,
    /// The span [begin, end) of the op's long loop this dispatch runs (the tokens of the
    /// embedding scatter-add, of each id's, the chunks `sum_partials` adds), and SPAN_FIRST where its sums
    /// start at zero (else from the output, where the previous span left them): the whole
    /// loop, unless the adapter's loop budget splits it (budget.rs). Set by `launched`.
    pub begin: u32,
    /// The span's end (exclusive).
    pub end: u32,
    /// Flags: SPAN_FIRST where the sums start at zero.
    pub span: u32,
    /// RMS norm's eps.
    pub eps: f32,
    /// Format id the input an op rounds as it reads it is rounded to (`Op::rounded_read`: the
    /// norms' and the unary family's backward's dy, the softmax's scores, its backward's dp).
    pub read_held: u32,
    /// 1: layer norm's backward sums its third output's values (read: the gradient of x from
    /// its other reader) into dx, held in `held`.
    pub sum: u32,
    /// The unary family's function (`plan::Unary::id`).
    pub func: u32,
    /// 1: the softmax's rows are blocks of t x t scores, row i seeing columns 0..=i.
    pub causal: u32,
    /// What a row sum, or a broadcast's product, is divided by (1, or c for a mean).
    pub divisor: f32,
    /// Dropout's probability of dropping.
    pub drop_p: f32,
    /// Dropout's site.
    pub site: u32,
    /// Dropout's key, low word.
    pub key_lo: u32,
    /// Dropout's key, high word.
    pub key_hi: u32,
    /// The softmax's mask (the second input, `plan::ScoreMask`): 0 for none, 1 a key mask, 2 a
    /// bias.
    pub mask_kind: u32,
    /// Score rows a sequence takes (`ScoreMask::block`).
    pub mask_block: u32,
    /// Mask rows from one sequence's to the next's (`ScoreMask::stride`).
    pub mask_stride: u32,
    /// Score rows after which the mask rows repeat (`ScoreMask::period`).
    pub mask_period: u32,
    /// The embedding gather's table rows, where its last workgroup sorts the ids for the
    /// backward (0: it does not).
    pub sort_rows: u32,
}

/// The uniform of the step kernels (`StepParams` in step.wgsl).
#[repr(C)]
#[derive(Clone, Copy, Default, Pod, Zeroable)]
pub struct StepParams {
    /// Elements (the kernel's items; gradients for `unscale_reduce`).
    pub n: u32,
    /// x repeats every c elements (an add's bias width; n where elementwise); `unscale_partials`: 1
    /// where scalar POISON goes in; `unscale_reduce`: the most partials of one gradient.
    pub c: u32,
    /// Format id the result is held in (`round_to_format`, `add`, `add_into`, `strided_copy`;
    /// `adamw`'s parameters and moments).
    pub format: u32,
    /// Stats slot written (`mean_to_stat`).
    pub slot: u32,
    /// A strided copy's index space.
    pub dims: [u32; 4],
    /// A strided copy's source strides.
    pub src: [u32; 4],
    /// A strided copy's destination strides.
    pub dst: [u32; 4],
    /// Per-kernel operands: `add` (y's format, residual flag, residual's format), `add_into` (codes
    /// flag, y's format), the strided copy's offsets, `unscale_partials`' first partial, `adamw`'s
    /// gated gradients and how many of its values take weight decay (its first ones).
    pub extra: [u32; 4],
    /// A bias add's GELU: (1 if it has one, the format it is held in, 1 if stored as codes, 0).
    pub gelu: [u32; 4],
    /// The formats operands are rounded to as they are read: `add` and `add_into` (x's: a
    /// linear layer's bias in the compute format, 0, 0, 0).
    pub read: [u32; 4],
}

/// One launch of a train.wgsl kernel: which entry point, its uniform, and how many invocations.
#[derive(Clone, Copy)]
pub struct TrainLaunch {
    /// The entry point.
    pub op: TrainOp,
    /// Its uniform (`begin`, `end` and `span` are set by `launched`).
    pub params: TrainParams,
    /// Invocations, or rows of a row op (`rows`).
    pub items: usize,
    /// A row op: `Gpu::row_lanes` invocations to each of the `items` rows.
    pub rows: bool,
    /// Fused attention: the cooperative matrices its products may run on (attention_coop.wgsl,
    /// where its matmul inputs are f16 and its heads whole tiles), else SIMT (attention.wgsl).
    pub coop: Option<super::shaders::Coop>,
}

/// A launch as it is dispatched on a device: its kernel, workgroups, and the uniform of each
/// dispatch (one, or several where the adapter's loop budget splits the op's long loop:
/// budget.rs); `carry_words`: the dispatches pass per-invocation partial results on through
/// the step kernels' z and w (buffers of that many words bound there), else 0.
pub struct Launched<P> {
    /// The pipeline.
    pub kernel: Kernel,
    /// Workgroups of each dispatch.
    pub groups: [u32; 3],
    /// One uniform per dispatch, in order.
    pub params: Vec<P>,
    /// Words of the carried partial results (0: none).
    pub carry_words: usize,
}

/// What to do where a training op's loops do not fit the adapter's loop budget.
const SMALLER: &str = "use smaller sizes, or a device without such a limit";

/// What to do where fused attention's loops do not fit it.
const ATTENTION_ADVICE: &str =
    "record attention unfused (--attention unfused), or use a shorter context";

impl TrainLaunch {
    /// The launch on `gpu`, within its loop budget (budget.rs): a row op takes more lanes to a
    /// row where one lane a row would run too long, the long sums of the embedding
    /// scatter-add and `sum_partials` are split over dispatches, and an op that still does not
    /// fit is an error.
    pub fn launched(&self, gpu: &Gpu) -> Result<Launched<TrainParams>> {
        let p = self.params;
        let attention = self.op.is_attention();
        let name = self.op.entry_point();
        let what = match self.op {
            _ if self.rows => format!("{name} on rows of {}", p.c),
            _ if attention => format!("{name} over a context of {} with heads of {}", p.c, p.d),
            TrainOp::EmbeddingSort | TrainOp::EmbeddingSum => {
                format!("{name} over {} tokens", p.tokens)
            }
            TrainOp::SumPartials => format!("{name} over {} chunks of rows", p.tokens),
            _ => format!("{name} over {} items", self.items),
        };
        let lanes = if self.rows {
            self.row_lanes(gpu, &what)?
        } else {
            gpu.row_lanes
        };
        if let Some(coop) = self.on_coop(gpu) {
            return self.launched_on_coop(gpu, coop, &what);
        }
        let kernel = Kernel::Train(self.op, lanes);
        let lanes = if self.rows { lanes as usize } else { 1 };
        let mut invocations = self.items * lanes;
        // The norms' backward: its rows' workgroups, then its column reduction's.
        if self.op.has_column_partials() {
            invocations = invocations.next_multiple_of(256)
                + launch::column_invocations(p.n as usize, p.c as usize);
            gpu.check_loops(&what, self.loops(), SMALLER)?;
        }
        let groups = Dispatch::element_groups(gpu, invocations)?;
        let whole = TrainParams {
            begin: 0,
            end: p.tokens,
            span: span_flags(0, 1),
            ..p
        };
        let params = match self.op {
            // One pass per token (of the id's, the most being all of them) or chunk, and the
            // loop's exit.
            TrainOp::EmbeddingSum | TrainOp::SumPartials => {
                let ranges = gpu.loop_ranges(&what, 1, 1, p.tokens.into())?;
                let count = ranges.len();
                ranges
                    .into_iter()
                    .enumerate()
                    .map(|(i, (begin, end))| TrainParams {
                        begin: begin as u32,
                        end: end as u32,
                        span: span_flags(i, count),
                        ..p
                    })
                    .collect()
            }
            _ => {
                let advice = if attention { ATTENTION_ADVICE } else { SMALLER };
                if !self.rows {
                    gpu.check_loops(&what, self.loops(), advice)?;
                }
                vec![whole]
            }
        };
        Ok(Launched {
            kernel,
            groups,
            params,
            carry_words: 0,
        })
    }

    /// The cooperative matrices fused attention runs on: its `coop`, where its matmul inputs
    /// are f16 (every product's operands f16 by definition) and its heads whole tiles, at most
    /// four of them (the kernels' named output fragments: 64 on 16 x 16 tiles, 32 on 8 x 8).
    fn on_coop(&self, gpu: &Gpu) -> Option<super::shaders::Coop> {
        let p = &self.params;
        let limits = &gpu.limits;
        self.coop.filter(|c| {
            coop_attention_bytes(*c) <= limits.max_compute_workgroup_storage_size
                && ATT_COOP_SUBGROUPS * c.subgroup <= limits.max_compute_invocations_per_workgroup
                && self.op.is_attention()
                && p.inputs == crate::format::Format::F16.id()
                && p.d > 0
                && p.d.is_multiple_of(c.size)
                && p.d <= ATT_MAX_D.min(4 * c.size)
                && c.subgroup.is_multiple_of(c.size)
        })
    }

    /// Fused attention on cooperative matrices: a workgroup of `ATT_COOP_SUBGROUPS` subgroups
    /// for each block of that many tiles' rows of each (sequence, head).
    fn launched_on_coop(
        &self,
        gpu: &Gpu,
        coop: super::shaders::Coop,
        what: &str,
    ) -> Result<Launched<TrainParams>> {
        let p = self.params;
        let heads = (p.n / p.c.max(1)) as u64;
        let block = u64::from(ATT_COOP_SUBGROUPS * coop.size);
        let blocks = heads * u64::from(p.c).div_ceil(block);
        let max = u64::from(gpu.limits.max_compute_workgroups_per_dimension);
        let x = blocks.clamp(1, max);
        let y = blocks.div_ceil(x);
        if y > max {
            return Err(crate::error::Error::invalid(
                "fused attention",
                format!("{what}: {blocks} blocks of rows are more than a dispatch holds"),
            ));
        }
        // The SIMT kernel's count bounds this one's (its tiles are no shorter).
        gpu.check_loops(what, self.loops(), ATTENTION_ADVICE)?;
        Ok(Launched {
            kernel: Kernel::AttentionCoop(self.op, coop),
            groups: [x as u32, y as u32, 1],
            params: vec![TrainParams {
                begin: 0,
                end: p.tokens,
                span: span_flags(0, 1),
                ..p
            }],
            carry_words: 0,
        })
    }

    /// The loop iterations one invocation runs, from train.wgsl's structure (every loop with
    /// its exit test, both sides of a branch), for the ops whose loops the budget does not
    /// split: the column reductions' (fixed by their chunks) and fused attention's (over the
    /// context, each step over the head).
    fn loops(&self) -> u64 {
        let p = self.params;
        let (t, d) = (u64::from(p.c), u64::from(p.d));
        let head = looped(d);
        match self.op {
            // A chunk's rows in steps of 8, then lanes_sum's loop over the 8 lanes (twice for
            // layer norm's two sums).
            // (The norms' backward: its column reduction's; its rows' loops are `row_lanes`'.)
            TrainOp::ColumnPartials | TrainOp::RmsnormBwd => {
                looped(launch::CHUNK_ROWS as u64 / 8) + looped(8)
            }
            TrainOp::LayernormBwd => looped(launch::CHUNK_ROWS as u64 / 8) + 2 * looped(8),
            // Each lane's tokens counted and scattered; counts zeroed and its slice of them
            // scanned in two passes (rows each); lane 0's scan of the slices; the offsets.
            // (The gather's: its sort's, where it sorts.)
            TrainOp::EmbeddingSort | TrainOp::EmbeddingFwd => {
                let rows = match self.op {
                    TrainOp::EmbeddingSort => u64::from(p.n),
                    _ if p.sort_rows == 0 => return 0,
                    _ => u64::from(p.sort_rows),
                };
                let lanes = launch::SORT_LANES as u64;
                let per = u64::from(p.tokens).div_ceil(lanes);
                2 * looped(per) + 3 * looped(rows) + looped(lanes) + looped(rows.div_ceil(lanes))
            }
            // attention.wgsl's tiled kernels: the row's own vectors in; tiles of the other side,
            // each loaded by every invocation, this lane's rows of it (a score, and dP, over the
            // head), the block's rows' products (pairs of the head per lane); lanes combined;
            // the output. Every key of the context is a bound (the causal block sees fewer).
            TrainOp::AttentionFwd | TrainOp::AttentionBwdQ | TrainOp::AttentionBwdKv => {
                let (lanes, bc) = (u64::from(ATT_LANES), u64::from(ATT_BC));
                let pairs = u64::from(ATT_MAX_D / 2 / ATT_LANES);
                let tiles = t.div_ceil(bc);
                let load = looped((bc * d).div_ceil(256));
                let mine = looped(bc.div_ceil(lanes)) + bc.div_ceil(lanes) * 2 * head;
                let products = looped(bc) + bc * looped(pairs);
                let sweep = |loads: u64, products: u64| {
                    looped(tiles) + tiles * (loads * load + mine + products)
                };
                let own = 2 * head;
                let out = looped(pairs);
                match self.op {
                    TrainOp::AttentionFwd => {
                        own + sweep(1, 0) + 2 * looped(lanes) + sweep(2, products) + out
                    }
                    TrainOp::AttentionBwdQ => {
                        own + sweep(2, 0) + looped(lanes) + sweep(2, products) + out
                    }
                    _ => own + sweep(2, products) + out,
                }
            }
            _ => 0,
        }
    }

    /// Lanes to a row of a row op: the device's (`Gpu::row_lanes`), doubled (up to a
    /// workgroup of 256) while a lane's share of the row would run more loop iterations than
    /// the budget allows.
    fn row_lanes(&self, gpu: &Gpu, what: &str) -> Result<u32> {
        let c = u64::from(self.params.c);
        // Loops over the row (each lane strides it) and reduction trees (row_sum, row_max).
        let (row_loops, trees) = match self.op {
            TrainOp::LayernormBwd => (2, 2),
            TrainOp::RmsnormBwd => (2, 1),
            TrainOp::SoftmaxFwd => (3, 2),
            TrainOp::SoftmaxBwd => (2, 1),
            // Layer norm's and the cross entropy's forward, and the most any row op has.
            _ => (4, 2),
        };
        let loops = |lanes: u32| {
            row_loops * looped(c.div_ceil(lanes.into())) + trees * looped(lanes.ilog2().into())
        };
        let mut lanes = gpu.row_lanes;
        while lanes < 256
            && gpu
                .usable_loop_iterations()
                .is_some_and(|usable| loops(lanes) > usable)
        {
            lanes *= 2;
        }
        gpu.check_loops(what, loops(lanes), SMALLER)?;
        Ok(lanes)
    }
}

/// One launch of a step.wgsl kernel; `items` None runs one workgroup (the kernels that reduce
/// a whole tensor into the stats).
#[derive(Clone, Copy)]
pub struct StepLaunch {
    /// The entry point.
    pub op: StepOp,
    /// Its uniform.
    pub params: StepParams,
    /// Invocations; None: one workgroup.
    pub items: Option<usize>,
}

/// Invocations of the step kernels that reduce a whole tensor in one workgroup.
const REDUCING_LANES: usize = 256;

impl StepLaunch {
    /// The launch on `gpu`, within its loop budget (budget.rs): a one-workgroup reduction
    /// (the loss's mean, the unscale-and-check) split over dispatches where its lanes' passes
    /// over the tensor would run too long, each lane's partial sum carried from one to the
    /// next in z and w; AdamW's loop over the gradients' flags checked.
    pub fn launched(&self, gpu: &Gpu) -> Result<Launched<StepParams>> {
        let p = self.params;
        let kernel = Kernel::Step(self.op);
        let groups = match self.items {
            Some(items) => Dispatch::element_groups(gpu, items)?,
            None => [1, 1, 1],
        };
        let what = format!("{} over {} values", self.op.entry_point(), p.n);
        let one = |params| Launched {
            kernel,
            groups,
            params: vec![params],
            carry_words: 0,
        };
        match self.op {
            StepOp::MeanToStat => {
                let passes = (p.n as usize).div_ceil(REDUCING_LANES) as u64;
                // The passes over the tensor, the loop's exit and the reduction tree's 8 steps.
                let ranges = gpu.loop_ranges(&what, 1 + looped(8), 1, passes)?;
                let count = ranges.len();
                let params = ranges
                    .into_iter()
                    .enumerate()
                    .map(|(i, (begin, end))| StepParams {
                        dims: [begin as u32, end as u32, span_flags(i, count), 0],
                        ..p
                    })
                    .collect();
                Ok(Launched {
                    kernel,
                    groups,
                    params,
                    carry_words: if count > 1 { REDUCING_LANES } else { 0 },
                })
            }
            StepOp::Adamw => {
                // A pass per gradient's flag and squared norm.
                gpu.check_loops(&what, looped(p.extra[0].into()), SMALLER)?;
                Ok(one(p))
            }
            StepOp::UnscalePartials => {
                // A span's passes, the loop's exit and the reduction tree's 8 steps.
                let passes = (launch::UNSCALE_SPAN / REDUCING_LANES) as u64;
                gpu.check_loops(&what, looped(passes) + looped(8), SMALLER)?;
                Ok(one(p))
            }
            StepOp::UnscaleReduce => {
                // Passes over the longest gradient's partials (`c`), then the tree.
                let passes = (p.c as u64).div_ceil(REDUCING_LANES as u64);
                gpu.check_loops(&what, looped(passes) + looped(8), SMALLER)?;
                Ok(one(p))
            }
            _ => Ok(one(p)),
        }
    }
}

/// The launches of every training op (the bindings of each are in the kernel files' order).
pub mod launch {
    use super::{StepLaunch, StepParams, TrainLaunch, TrainParams};
    use super::{StepOp, TrainOp};
    use crate::backend::wgpu::shaders::format_id;
    use crate::format::Format;
    use crate::plan::{Attention, MaskKind, ScoreMask, ScoreScale, Strided, Unary};

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
            coop: None,
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
    pub(super) const CHUNK_ROWS: usize = 256;

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
        train(op, rows, c, column_invocations(rows, c))
    }

    /// The invocations of a column reduction over `rows` rows of `c`.
    pub(super) fn column_invocations(rows: usize, c: usize) -> usize {
        c.div_ceil(32) * chunks(rows) * 256
    }

    /// The partials of `parts` sums per column added in chunk order.
    fn sum_partials(rows: usize, c: usize, parts: usize) -> TrainLaunch {
        let mut l = train(TrainOp::SumPartials, parts * c, c, parts * c);
        l.params.tokens = chunks(rows) as u32;
        l
    }

    /// The sums over `rows` rows of each of `c` columns, x rounded to `x_held` as it is read
    /// and the sums held in `held`: x -> partials, then partials -> sums.
    pub fn column_sums(
        rows: usize,
        c: usize,
        (x_held, held): (Format, Format),
    ) -> [TrainLaunch; 2] {
        let mut partials = column_partials(TrainOp::ColumnPartials, rows, c);
        partials.params.read_held = format_id(x_held);
        let mut sums = sum_partials(rows, c, 1);
        sums.params.held = format_id(held);
        [partials, sums]
    }

    /// Gathers `n` elements (rows of `c`): table, ids -> y.
    /// The gather of `n / c` rows of width `c`; with `sort_rows` (the table's rows), the ids
    /// sorted for the backward too (`embedding_sort_len`, the third output), in one more
    /// workgroup.
    pub fn embedding_fwd(n: usize, c: usize, sort_rows: Option<usize>) -> TrainLaunch {
        let mut l = train(TrainOp::EmbeddingFwd, n, c, n);
        if let Some(rows) = sort_rows {
            l.params.sort_rows = rows as u32;
            l.params.tokens = (n / c.max(1)) as u32;
            l.items = n.div_ceil(SORT_LANES) * SORT_LANES + SORT_LANES;
        }
        l
    }

    /// Invocations of the embedding backward's sort (`SORT_LANES` in train.wgsl).
    pub(super) const SORT_LANES: usize = 256;

    /// Words the embedding backward's sort writes: counts per (id, lane), where each id's
    /// tokens start, the token indices grouped by id.
    pub fn embedding_sort_len(rows: usize, tokens: usize) -> usize {
        rows * SORT_LANES + rows + 1 + tokens
    }

    /// Scatter-adds `tokens` rows into `rows x c`: ids -> the sort (`embedding_sort_len`),
    /// then dout, the sort -> dtable (the sort's workgroup size is the gather's, so that
    /// `embedding_fwd` may run it).
    pub fn embedding_bwd(rows: usize, c: usize, tokens: usize) -> [TrainLaunch; 2] {
        let mut sort = train(TrainOp::EmbeddingSort, rows, c, SORT_LANES);
        sort.params.tokens = tokens as u32;
        let mut sum = train(TrainOp::EmbeddingSum, rows * c, c, rows * c);
        sum.params.tokens = tokens as u32;
        [sort, sum]
    }

    /// x, g, b -> y held in `held`, (mean, rstd) per row; y `coded` goes to the third output
    /// as 16-bit codes (c even).
    pub fn layernorm_fwd(rows: usize, c: usize, held: Format, coded: bool) -> TrainLaunch {
        let mut l = row_op(TrainOp::LayernormFwd, rows, c);
        l.params.held = format_id(held);
        l.params.coded = coded as u32;
        l
    }

    /// dy, x, g -> dx (stats read) and the partials of dg and db (`partials_len(rows, c, 2)`,
    /// the fourth output) in one launch; then the partials -> dg, db; dy rounded to `dy_held`
    /// as it is read; with `sum`, dx + the third output's values (read) held in that format.
    pub fn layernorm_bwd(
        rows: usize,
        c: usize,
        dy_held: Format,
        sum: Option<Format>,
    ) -> [TrainLaunch; 2] {
        let mut l = row_op(TrainOp::LayernormBwd, rows, c);
        l.params.read_held = format_id(dy_held);
        if let Some(held) = sum {
            l.params.sum = 1;
            l.params.held = format_id(held);
        }
        [l, sum_partials(rows, c, 2)]
    }

    /// f(x) of the unary family, x stored as `x_stored` (f32, or a coded tensor's codes),
    /// held in `held`; where `coded`, its 16-bit codes go to the third output, one word (two
    /// elements) per invocation.
    pub fn unary_fwd(
        f: Unary,
        n: usize,
        held: Format,
        coded: bool,
        x_stored: Format,
    ) -> TrainLaunch {
        let items = if coded { n.div_ceil(2) } else { n };
        let mut l = train(TrainOp::UnaryFwd, n, 0, items);
        l.params.func = f.id();
        l.params.held = format_id(held);
        l.params.coded = coded as u32;
        l.params.x_stored = format_id(x_stored);
        l
    }

    /// dy * f'(x) held in `held`, x stored as in `unary_fwd`, dy in in1 (rounded to
    /// `dy_held` as it is read).
    pub fn unary_bwd(
        f: Unary,
        n: usize,
        held: Format,
        dy_held: Format,
        x_stored: Format,
    ) -> TrainLaunch {
        let mut l = train(TrainOp::UnaryBwd, n, 0, n);
        l.params.func = f.id();
        l.params.held = format_id(held);
        l.params.read_held = format_id(dy_held);
        l.params.x_stored = format_id(x_stored);
        l
    }

    /// x, g -> y held in `held`, rstd per row; y `coded` goes to the third output as 16-bit
    /// codes (c even).
    pub fn rmsnorm_fwd(rows: usize, c: usize, eps: f32, held: Format, coded: bool) -> TrainLaunch {
        let mut l = row_op(TrainOp::RmsnormFwd, rows, c);
        l.params.eps = eps;
        l.params.held = format_id(held);
        l.params.coded = coded as u32;
        l
    }

    /// dy, x, g -> dx (rstd read) and the partials of dg (`partials_len(rows, c, 1)`, the
    /// fourth output) in one launch; then the partials -> dg.
    pub fn rmsnorm_bwd(rows: usize, c: usize, dy_held: Format) -> [TrainLaunch; 2] {
        let mut l = row_op(TrainOp::RmsnormBwd, rows, c);
        l.params.read_held = format_id(dy_held);
        [l, sum_partials(rows, c, 1)]
    }

    /// x -> x times dropout's mask at the step in the scalars (bound third), held in `held`.
    pub fn dropout(n: usize, (p, seed, site): (f32, u64, u32), held: Format) -> TrainLaunch {
        let mut l = train(TrainOp::Dropout, n, 0, n);
        let [key_lo, key_hi] = crate::plan::dropout::key(seed);
        l.params.drop_p = p;
        l.params.scale = crate::plan::dropout::keep_scale(p);
        (l.params.site, l.params.key_lo, l.params.key_hi) = (site, key_lo, key_hi);
        l.params.held = format_id(held);
        l
    }

    /// x (rows of c = heads x d at t positions) -> rotated by the table's angles (by the
    /// opposite ones where `inverse`), held in `held` (`plan::rotary`).
    pub fn rotary(
        n: usize,
        (t, c, d): (usize, usize, usize),
        inverse: bool,
        held: Format,
    ) -> TrainLaunch {
        let mut l = train(TrainOp::Rotary, n, 0, n);
        (l.params.tokens, l.params.c, l.params.d) = (t as u32, c as u32, d as u32);
        l.params.grad = inverse as u32;
        l.params.held = format_id(held);
        l
    }

    /// x (rows of c) -> each row's sum / `divisor`, held in `held`.
    pub fn row_sums(rows: usize, c: usize, divisor: f32, held: Format) -> TrainLaunch {
        let mut l = row_op(TrainOp::RowSums, rows, c);
        l.params.divisor = divisor;
        l.params.held = format_id(held);
        l
    }

    /// x -> its values repeated c times over n outputs, times `scale` / `divisor`, held.
    pub fn broadcast(
        n: usize,
        c: usize,
        (scale, divisor): (f32, f32),
        held: Format,
    ) -> TrainLaunch {
        let mut l = train(TrainOp::Broadcast, n, c, n);
        l.params.scale = scale;
        l.params.divisor = divisor;
        l.params.held = format_id(held);
        l
    }

    /// a, b -> a * b held in `held`; where `coded`, its 16-bit codes go to the third output,
    /// one word (two elements) per invocation.
    pub fn mul(n: usize, held: Format, coded: bool) -> TrainLaunch {
        let items = if coded { n.div_ceil(2) } else { n };
        let mut l = train(TrainOp::Mul, n, 0, items);
        l.params.held = format_id(held);
        l.params.coded = coded as u32;
        l
    }

    /// pred, target, the scalars -> the mean squared error's gradient held in `held`, and each
    /// element's squared error (their mean is `mean_to_stat`'s).
    pub fn mse_fwd(n: usize, held: Format) -> TrainLaunch {
        let mut l = train(TrainOp::MseFwd, n, 0, n);
        l.params.held = format_id(held);
        l
    }

    /// Softmax of the scaled `x` (`ScoreScale`: the scale, its product held in `held`) over
    /// rows of `t`, causal or not, x rounded to `x_held` as it is read; `mask`: the mask bound
    /// as the second input, if any.
    pub fn softmax_fwd(
        rows: usize,
        (t, causal, mask): (usize, bool, Option<ScoreMask>),
        scale: ScoreScale,
        x_held: Format,
    ) -> TrainLaunch {
        let mut l = row_op(TrainOp::SoftmaxFwd, rows, t);
        l.params.causal = causal as u32;
        if let Some(m) = mask {
            l.params.mask_kind = match m.kind {
                MaskKind::Keys => 1,
                MaskKind::Bias => 2,
            };
            l.params.mask_block = m.block as u32;
            l.params.mask_stride = m.stride as u32;
            l.params.mask_period = m.period as u32;
        }
        l.params.scale = scale.scale as f32;
        l.params.held = format_id(scale.held);
        l.params.read_held = format_id(x_held);
        l
    }

    /// The backward of `softmax_fwd`: dp and the probabilities -> the gradient of the unscaled
    /// scores; dp rounded to `dp_held` as it is read.
    pub fn softmax_bwd(
        rows: usize,
        (t, causal): (usize, bool),
        scale: ScoreScale,
        dp_held: Format,
    ) -> TrainLaunch {
        let mut l = row_op(TrainOp::SoftmaxBwd, rows, t);
        l.params.causal = causal as u32;
        l.params.scale = scale.scale as f32;
        l.params.held = format_id(scale.held);
        l.params.read_held = format_id(dp_held);
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

    /// Its backward: dq with each row's sum(P * dP), then dk and dv (which read it), each into
    /// its third of dqkv (inputs q|k|v, the output's gradient, (max, sum); outputs dqkv,
    /// sum(P * dP)).
    pub fn attention_bwd(spec: &Attention, qkv_stored: Format) -> [TrainLaunch; 2] {
        [TrainOp::AttentionBwdQ, TrainOp::AttentionBwdKv].map(|op| attention(op, spec, qkv_stored))
    }

    /// A workgroup of 256 invocations for each block of `att_block_rows()` rows of each
    /// (sequence, head) (attention.wgsl).
    fn attention(op: TrainOp, spec: &Attention, qkv_stored: Format) -> TrainLaunch {
        let rows = spec.score_rows();
        let blocks = spec.b * spec.h * spec.t.div_ceil(super::att_block_rows() as usize);
        let mut l = train(op, rows, spec.t, blocks * 256);
        l.params.scale = spec.scale as f32;
        l.params.h = spec.h as u32;
        l.params.d = spec.d as u32;
        l.params.inputs = format_id(spec.algorithm.operand_formats().0);
        l.params.probs = format_id(spec.probs);
        l.params.compute = format_id(spec.compute);
        l.params.x_stored = format_id(qkv_stored);
        l
    }

    /// logits, targets -> the loss's gradient scaled by scalar DLOSS_PER_ROW (the scalars bound
    /// as the third input) held in `held`, per-row losses.
    pub fn cross_entropy_fwd(rows: usize, v: usize, held: Format, coded: bool) -> TrainLaunch {
        let mut l = row_op(TrainOp::CrossEntropyFwd, rows, v);
        l.params.grad = 1;
        l.params.held = format_id(held);
        l.params.coded = coded as u32;
        l
    }

    fn step(op: StepOp, params: StepParams, items: Option<usize>) -> StepLaunch {
        StepLaunch { op, params, items }
    }

    /// The mean of `rows` losses (per row, or per element) into stats slot `slot`.
    pub fn mean_to_stat(rows: usize, slot: usize) -> StepLaunch {
        let params = StepParams {
            n: rows as u32,
            slot: slot as u32,
            ..Default::default()
        };
        step(StepOp::MeanToStat, params, None)
    }

    /// `n` values rounded to `format` in place.
    pub fn round(n: usize, format: Format) -> StepLaunch {
        let params = StepParams {
            n: n as u32,
            format: format_id(format),
            ..Default::default()
        };
        step(StepOp::Round, params, Some(n))
    }

    /// y (n) = y rounded to `y_held`, plus x (c, repeated over y) rounded to `x_held`, held in
    /// `held`; then, with a residual (bound as z) held in its format, plus it; or with a GELU
    /// (its format, and whether stored as codes), z = GELU(y).
    pub fn add(
        n: usize,
        c: usize,
        (y_held, x_held, held): (Format, Format, Format),
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
            read: [format_id(x_held), 0, 0, 0],
            ..Default::default()
        };
        let items = match gelu {
            Some((_, true)) => n.div_ceil(2),
            _ => n,
        };
        step(StepOp::Add, params, Some(items))
    }

    /// z = y rounded to `y_held`, plus x rounded to `x_held`, held in `held`, x (c values)
    /// repeated over y (n); where `coded`, its codes go to w instead, two to a word, and a GELU
    /// (its format, and whether stored as codes) of them to z.
    pub fn add_into(
        n: usize,
        c: usize,
        (y_held, x_held, held): (Format, Format, Format),
        coded: bool,
        gelu: Option<(Format, bool)>,
    ) -> StepLaunch {
        let params = StepParams {
            n: n as u32,
            c: c.max(1) as u32,
            format: format_id(held),
            extra: [coded as u32, format_id(y_held), 0, 0],
            gelu: gelu_params(gelu),
            read: [format_id(x_held), 0, 0, 0],
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

    /// A strided copy of `map`'s elements (offsets in `extra`), rounded to `held`.
    pub fn strided_copy(map: &Strided, held: Format) -> StepLaunch {
        let params = StepParams {
            n: map.len() as u32,
            format: format_id(held),
            dims: map.dims,
            src: map.src,
            dst: map.dst,
            extra: [map.src_offset, map.dst_offset, 0, 0],
            ..Default::default()
        };
        step(StepOp::StridedCopy, params, Some(map.len()))
    }

    /// Elements of a gradient one workgroup of `unscale_partials` takes (UNSCALE_SPAN in
    /// step.wgsl).
    pub const UNSCALE_SPAN: usize = 4096;

    /// Workgroups (partial results) `unscale_partials` takes over a gradient of `n` values.
    pub fn unscale_spans(n: usize) -> usize {
        n.div_ceil(UNSCALE_SPAN).max(1)
    }

    /// GradScaler's unscale of a gradient of `n` values in place, its partial sums of squares
    /// and non-finite flags written from partial `first` on (`unscale_spans(n)` of them);
    /// `poisoned`: scalar POISON goes into the first element.
    pub fn unscale_partials(n: usize, poisoned: bool, first: usize) -> StepLaunch {
        let params = StepParams {
            n: n as u32,
            c: poisoned as u32,
            extra: [first as u32, 0, 0, 0],
            ..Default::default()
        };
        step(
            StepOp::UnscalePartials,
            params,
            Some(unscale_spans(n) * 256),
        )
    }

    /// As `unscale_partials`, over an arena segment of `n` values, `spans` workgroups each
    /// taking a row of the table bound as x: (first element, end, partial slot), a gradient's
    /// span (arena.rs); scalar POISON goes into the element `poison` where it is in this
    /// segment (the first gradient's first).
    pub fn unscale_partials_table(n: usize, spans: usize, poison: Option<usize>) -> StepLaunch {
        let params = StepParams {
            n: n as u32,
            c: poison.is_some() as u32,
            extra: [0, 1, poison.unwrap_or(0) as u32, 0],
            ..Default::default()
        };
        step(StepOp::UnscalePartials, params, Some(spans * 256))
    }

    /// Every gradient's partials summed into its flag and squared norm (`count` gradients, a
    /// table row of four words each; `longest`: the most partials of one gradient).
    pub fn unscale_reduce(count: usize, longest: usize) -> StepLaunch {
        let params = StepParams {
            n: count as u32,
            c: longest as u32,
            ..Default::default()
        };
        step(StepOp::UnscaleReduce, params, Some(count * 256))
    }

    /// AdamW on `n` values, weight decay on the first `decayed` of them, applied only where the
    /// first `gated_on` gradients' flags are clear (0: always).
    pub fn adamw(n: usize, gated_on: usize, decayed: usize, held: Format) -> StepLaunch {
        let params = StepParams {
            n: n as u32,
            format: format_id(held),
            extra: [gated_on as u32, decayed as u32, 0, 0],
            ..Default::default()
        };
        step(StepOp::Adamw, params, Some(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::wgpu::shaders::Coop;

    /// attention_coop.wgsl fits NVIDIA's 48 KiB of workgroup memory on 16 x 16 tiles and
    /// lavapipe's 32 KiB on 8 x 8 (the count is what `on_coop` checks against the device).
    #[test]
    fn cooperative_attention_fits_the_devices_workgroup_memory() {
        let nvidia = coop_attention_bytes(Coop {
            size: 16,
            subgroup: 32,
        });
        let lavapipe = coop_attention_bytes(Coop {
            size: 8,
            subgroup: 8,
        });
        assert!(
            nvidia <= 48 * 1024 && lavapipe <= 32 * 1024,
            "{nvidia} {lavapipe}"
        );
    }
}

#[cfg(test)]
mod uniform_layout {
    use super::*;
    use crate::backend::wgpu::shaders::assert_uniform_layout;

    /// Each uniform struct here is its kernel's, member for member (`assert_uniform_layout`).
    #[test]
    fn uniforms_match_their_wgsl_structs() {
        assert_uniform_layout!(
            "train.wgsl",
            TrainParams {
                n,
                c,
                tokens,
                scale,
                h,
                d,
                inputs,
                probs,
                compute,
                held,
                coded,
                grad,
                x_stored,
                begin,
                end,
                span,
                eps,
                read_held,
                sum,
                func,
                causal,
                divisor,
                drop_p,
                site,
                key_lo,
                key_hi,
                mask_kind,
                mask_block,
                mask_stride,
                mask_period,
                sort_rows
            }
        );
        assert_uniform_layout!(
            "step.wgsl",
            StepParams {
                n,
                c,
                format,
                slot,
                dims,
                src,
                dst,
                extra,
                gelu,
                read
            }
        );
    }
}
