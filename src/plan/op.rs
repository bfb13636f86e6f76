//! The ops of a plan: what each computes (the host reference is `backend::reference::ops`),
//! its operands, declared once (`Op::operands_mut`: how it reads and writes each, from which
//! its reads and writes, in-place updates, ids, 16-bit codes, held outputs and rounded reads
//! are derived), its name in errors and profiles, its lengths' checks and its cost. Everything
//! the `plan` module knows of a particular op is here.

use super::validate::Check;
use super::{Cost, Strided, TensorId, TensorInfo, Unary};
use crate::algorithm::{Algorithm, MatmulShape};
use crate::error::Result;
use crate::format::Format;

/// How a softmax reads its scores: `scale * s`, the product in f32 and held in `held`, as
/// autocast holds a tensor times a scalar in the tensor's own format (`att / sqrt(d)` of a
/// 16-bit `att` stays 16-bit; CUDA multiplies by the scalar's f32 reciprocal). The backward
/// holds the softmax's gradient in `held`, then its product with the scale again.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreScale {
    /// The factor on the scores (1 / sqrt(d) for attention).
    pub scale: f64,
    /// The format the scaled scores are held in (the compute format under autocast).
    pub held: Format,
}

/// What a softmax's mask (`ScoreMask`) does to the scores it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaskKind {
    /// Nonzero leaves the key out (an attention's key padding mask): its probability is 0.
    Keys,
    /// Added in f32 to the scaled scores as held (an attention bias, or a float mask whose
    /// -inf leaves a key out: PyTorch's float `attn_mask`).
    Bias,
}

/// A mask a softmax reads beside its scores: `mask` holds rows of t, score row r reading mask
/// row `row(r)` = (r / `block`) * `stride` + r % `period`. An attention's scores come a
/// sequence at a time (`block` = heads x t rows): a key padding mask [batch, t] is stride 1,
/// period 1 (every head's and query's row reads its sequence's row); a bias [t, t] stride 0,
/// period t; [heads, t, t] stride 0, period heads x t; [batch, t, t] stride t, period t;
/// [batch, heads, t, t] stride and period heads x t. A key left out has probability 0; a row
/// that sees no key (every one left out, or -inf) is 0 throughout (PyTorch's is NaN).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreMask {
    /// The mask, rows of t.
    pub mask: TensorId,
    /// How it applies.
    pub kind: MaskKind,
    /// Score rows a sequence takes.
    pub block: usize,
    /// Mask rows from one sequence's to the next's.
    pub stride: usize,
    /// Score rows after which the mask rows repeat within a sequence.
    pub period: usize,
}

impl ScoreMask {
    /// The mask row score row `r` reads.
    pub fn row(&self, r: usize) -> usize {
        r / self.block * self.stride + r % self.period
    }

    /// The mask rows `rows` score rows read (a whole number of blocks, `period` dividing one);
    /// None where they are not such.
    pub fn rows_read(&self, rows: usize) -> Option<usize> {
        let whole = self.block > 0 && rows.is_multiple_of(self.block);
        let within = self.period > 0 && self.block.is_multiple_of(self.period);
        (whole && within && rows > 0).then(|| self.row(rows - self.block) + self.period)
    }
}

/// Fused causal self-attention over the rows of a (B, T, 3C) q|k|v tensor (the flash-attention
/// scheme): b sequences of t tokens, h heads of d. Per head, P = causal softmax of scale * q.k^T
/// and out = P.v, computed as the unfused plan computes them: q.k^T and P.v under `algorithm`
/// (its inputs rounded, f32 accumulation), their results held in `compute`, the scaled scores
/// held in `compute` too (`score_scale`), P held in `probs`.
/// Only each row's (max, sum) of the softmax is kept for the backward, which recomputes P from
/// it, instead of the (B, H, T, T) probabilities.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attention {
    /// Sequences in the batch.
    pub b: usize,
    /// Tokens per sequence (the causal mask's width).
    pub t: usize,
    /// Heads.
    pub h: usize,
    /// Width of one head (C = h * d).
    pub d: usize,
    /// The factor on q.k^T (1 / sqrt(d) in the model).
    pub scale: f64,
    /// How q.k^T and P.v are computed (inputs rounded, f32 accumulation).
    pub algorithm: Algorithm,
    /// The format the probabilities P are held in.
    pub probs: Format,
    /// The format the matmul products and the scaled scores are held in.
    pub compute: Format,
}

impl Attention {
    /// Rows of all heads' scores: one (max, sum) pair each in `stats`, one sum(P * dP) in `delta`.
    pub fn score_rows(&self) -> usize {
        self.b * self.h * self.t
    }

    /// Elements of q|k|v (B, T, 3C).
    pub fn qkv_len(&self) -> usize {
        self.b * self.t * 3 * self.h * self.d
    }

    /// Elements of the output (B, T, C).
    pub fn out_len(&self) -> usize {
        self.b * self.t * self.h * self.d
    }

    /// How its softmax reads the scores (held, like them, in the compute format).
    pub fn score_scale(&self) -> ScoreScale {
        ScoreScale {
            scale: self.scale,
            held: self.compute,
        }
    }
}

/// One op of a plan. Ops read and write tensors by id; the comments give what the op computes
/// (the host reference is `backend::reference::ops`).
#[derive(Clone, Debug)]
pub enum Op {
    /// out = rows of `table` (c wide) picked by `ids`.
    Embedding {
        /// The (rows, c) table of vectors.
        table: TensorId,
        /// One row index per output row (u32 ids as f32 bit patterns).
        ids: TensorId,
        /// The gathered rows, one per id (ids x c).
        out: TensorId,
        /// Width of a row.
        c: usize,
    },
    /// out (rows x c) = scatter-add of the rows of `dout` by `ids`.
    EmbeddingBwd {
        /// The gradient of the gathered rows (ids x c).
        dout: TensorId,
        /// The row index each gradient row adds into.
        ids: TensorId,
        /// The (rows, c) gradient of the table.
        out: TensorId,
        /// Rows of the table.
        rows: usize,
        /// Width of a row.
        c: usize,
    },
    /// Layer norm over rows of c, `out` held in `held`; `stats` holds (mean, rstd) per row.
    LayerNorm {
        /// The input (rows, c).
        x: TensorId,
        /// The gain (c).
        g: TensorId,
        /// The bias (c).
        b: TensorId,
        /// The normalized output (rows, c).
        out: TensorId,
        /// Two f32 per row, (mean, rstd), for the backward.
        stats: TensorId,
        /// Width of a row.
        c: usize,
        /// The format `out` is held in.
        held: Format,
    },
    /// The gradients dx, dg and db (dg and db summed over the rows) of `LayerNorm`, from its (mean,
    /// rstd) per row in `stats`.
    LayerNormBwd {
        /// The gradient of the output (rows, c).
        dy: TensorId,
        /// The forward's input (rows, c).
        x: TensorId,
        /// The forward's gain (c).
        g: TensorId,
        /// The forward's (mean, rstd) per row.
        stats: TensorId,
        /// The gradient of x (rows, c).
        dx: TensorId,
        /// The gradient of the gain (c).
        dg: TensorId,
        /// The gradient of the bias (c).
        db: TensorId,
        /// Width of a row.
        c: usize,
        /// Where Some((r, format)): dx + r held in that format is written instead of dx (the
        /// gradient of x from its other reader summed in: the add after the op folded in by
        /// `PlanBuilder::push`, one pass over dx, not two).
        sum: Option<(TensorId, Format)>,
        /// The format dy is rounded to as it is read (a matmul's product that autocast holds
        /// in the compute format: the rounding after the matmul folded in, `PlanBuilder::finish`).
        dy_held: Format,
    },
    /// out = f(x) of the unary family (GELU, SiLU, ReLU, sigmoid, tanh), held in `held`.
    Unary {
        /// The function.
        f: Unary,
        /// The input.
        x: TensorId,
        /// The output (x's length).
        out: TensorId,
        /// The format `out` is held in.
        held: Format,
    },
    /// out = dy * f'(x), held in `held` (f' in terms of what it reads: `Unary::grad`).
    UnaryBwd {
        /// The forward's function.
        f: Unary,
        /// The forward's input, or for sigmoid and tanh its output (`Unary::reads_output`).
        x: TensorId,
        /// The gradient of the forward's output.
        dy: TensorId,
        /// The gradient of x.
        out: TensorId,
        /// The format `out` is held in (autocast holds it in the compute format).
        held: Format,
        /// The format dy is rounded to as it is read (a matmul's product that autocast holds
        /// in the compute format: the rounding after the matmul folded in, `PlanBuilder::finish`).
        dy_held: Format,
    },
    /// RMS norm over rows of c (torch.nn.RMSNorm): out = x * rstd * g held in `held`, rstd =
    /// 1 / sqrt(mean(x^2) + eps); `stats` holds rstd per row.
    RmsNorm {
        /// The input (rows, c).
        x: TensorId,
        /// The gain (c).
        g: TensorId,
        /// The normalized output (rows, c).
        out: TensorId,
        /// One f32 per row, rstd, for the backward.
        stats: TensorId,
        /// Width of a row.
        c: usize,
        /// The epsilon added to mean(x^2).
        eps: f32,
        /// The format `out` is held in.
        held: Format,
    },
    /// dx and dg (summed over the rows) of `RmsNorm`, from its rstd per row in `stats`.
    RmsNormBwd {
        /// The gradient of the output (rows, c).
        dy: TensorId,
        /// The forward's input (rows, c).
        x: TensorId,
        /// The forward's gain (c).
        g: TensorId,
        /// The forward's rstd per row.
        stats: TensorId,
        /// The gradient of x (rows, c).
        dx: TensorId,
        /// The gradient of the gain (c).
        dg: TensorId,
        /// Width of a row.
        c: usize,
        /// The format dy is rounded to as it is read (a matmul's product that autocast holds
        /// in the compute format: the rounding after the matmul folded in, `PlanBuilder::finish`).
        dy_held: Format,
    },
    /// out = a * b elementwise (the same length), the f32 product held in `held`. Its backward
    /// is two of them: da = dy * b, db = dy * a.
    Mul {
        /// The left factor.
        a: TensorId,
        /// The right factor (a's length).
        b: TensorId,
        /// The product.
        out: TensorId,
        /// The format `out` is held in.
        held: Format,
    },
    /// out\[r\] = (the sum of row r's c values of x, in f32) / divisor, held in `held`: a sum
    /// (divisor 1) or a mean (divisor c) over the last axis.
    RowSum {
        /// The input (rows, c).
        x: TensorId,
        /// One value per row.
        out: TensorId,
        /// Width of a row.
        c: usize,
        /// What the sum is divided by.
        divisor: f32,
        /// The format `out` is held in.
        held: Format,
    },
    /// out\[e\] = x\[e / c\] * scale / divisor in f32, held in `held`: each of x's values
    /// repeated c times (a row sum's backward: scale 1; a mean's: divisor c), or with c = 1
    /// x times a constant.
    Broadcast {
        /// The input (out's length / c).
        x: TensorId,
        /// The output.
        out: TensorId,
        /// How many times each value repeats.
        c: usize,
        /// The factor on each value.
        scale: f32,
        /// What the product is divided by.
        divisor: f32,
        /// The format `out` is held in.
        held: Format,
    },
    /// out\[e\] = x\[e\] * (kept ? 1 / (1 - p) : 0) in f32, held in `held`: element e kept
    /// where Philox4x32-10 of (e, the step's scalar `STEP`, `site`, 0) under the seed's key
    /// draws a uniform >= p (`plan::dropout`). The backward is the same op on dy (the same
    /// mask at the same step).
    Dropout {
        /// The input.
        x: TensorId,
        /// The output (x's length).
        out: TensorId,
        /// The probability of dropping an element, in [0, 1).
        p: f32,
        /// The masks' key (`dropout::key`).
        seed: u64,
        /// Which dropout of the model (masks differ by site).
        site: u32,
        /// The format `out` is held in.
        held: Format,
    },
    /// Rotary position embeddings of rows of c = heads x d (`plan::rotary`): row r is the
    /// token at position r % t; each head's two halves are rotated pair by pair, pair j by the
    /// angle `table` gives for (position, j). The backward (`inverse`) rotates by the opposite
    /// angles. Computed in f32, held in `held`.
    Rotary {
        /// The input, rows of c.
        x: TensorId,
        /// cos and sin of every position's angles: t x d/2 pairs (`rotary::table`).
        table: TensorId,
        /// The output (x's length).
        out: TensorId,
        /// Positions per sequence.
        t: usize,
        /// Width of a row (heads x d).
        c: usize,
        /// Width of a head (even).
        d: usize,
        /// Rotate by the opposite angles (the backward).
        inverse: bool,
        /// The format `out` is held in.
        held: Format,
    },
    /// Softmax of `scale * x` (held as `ScoreScale` says) per row of t: causal (the rows are
    /// blocks of t x t scores, row i seeing columns 0..=i) or over every column.
    Softmax {
        /// The scores, rows of t.
        x: TensorId,
        /// The probabilities, rows of t (zero past the diagonal where causal).
        out: TensorId,
        /// Width of a row (the sequence's length where causal).
        t: usize,
        /// Whether row i of each t x t block sees columns 0..=i only.
        causal: bool,
        /// A mask the scores read (an attention's key padding mask or bias).
        mask: Option<ScoreMask>,
        /// The factor on the scores and the format the scaled scores are held in.
        scale: ScoreScale,
        /// The format the scores are rounded to as they are read (the product of the matmul
        /// before, which autocast holds in the compute format: its rounding folded in,
        /// `PlanBuilder::finish`).
        x_held: Format,
    },
    /// The gradient of the unscaled scores from the probabilities and their gradient: the softmax's
    /// backward, held and scaled as `ScoreScale` says.
    SoftmaxBwd {
        /// The forward's probabilities, rows of t.
        p: TensorId,
        /// The gradient of the probabilities.
        dp: TensorId,
        /// The gradient of the forward's (unscaled) scores.
        out: TensorId,
        /// Width of a row.
        t: usize,
        /// The forward's mask (`Softmax::causal`).
        causal: bool,
        /// The forward's score scale.
        scale: ScoreScale,
        /// The format dp is rounded to as it is read (as `Softmax`'s `x_held`).
        dp_held: Format,
    },
    /// out (B, T, C) = causal self-attention of `qkv` (`Attention`); `stats` gets each score
    /// row's (max of z, sum of exp(z - max)), z the scaled scores (`Attention::score_scale`).
    Attention {
        /// The (B, T, 3C) q|k|v input.
        qkv: TensorId,
        /// The (B, T, C) output.
        out: TensorId,
        /// Two f32 per score row (`Attention::score_rows`), (max, sum), for the backward.
        stats: TensorId,
        /// The shapes, scale, algorithm and formats.
        spec: Attention,
    },
    /// The gradient of `qkv` (B, T, 3C) from that of the output (B, T, C), P recomputed from
    /// `stats`; `delta` gets each score row's sum(P * dP) (the softmax backward's dot).
    AttentionBwd {
        /// The forward's (B, T, 3C) q|k|v.
        qkv: TensorId,
        /// The gradient of the forward's (B, T, C) output.
        dout: TensorId,
        /// The forward's (max, sum) per score row.
        stats: TensorId,
        /// One f32 per score row: sum(P * dP), written here.
        delta: TensorId,
        /// The gradient of q|k|v (B, T, 3C).
        dqkv: TensorId,
        /// The forward's shapes, scale, algorithm and formats.
        spec: Attention,
    },
    /// The loss of each row of v logits, their mean into `Stats::LOSS`, and the loss's gradient
    /// (softmax(logits) - onehot(targets)) * scalar `DLOSS_PER_ROW` into `grad`, held in `held`:
    /// the backward fused into the forward, so the probabilities never reach memory.
    CrossEntropy {
        /// The logits, rows of v.
        logits: TensorId,
        /// One target class per row (u32 ids as f32 bit patterns).
        targets: TensorId,
        /// The gradient of the logits (logits' length).
        grad: TensorId,
        /// Classes per row.
        v: usize,
        /// The format `grad` is held in.
        held: Format,
    },
    /// The mean squared error over every element, mean((pred - target)^2), into `Stats::LOSS`,
    /// and its gradient 2 (pred - target) * scalar `DLOSS` / n into `grad`, held in `held`
    /// (the backward fused into the forward, as `CrossEntropy`'s). `target` holds f32 values
    /// (the batch's `Targets` as f32 bit patterns, or any tensor of pred's length).
    MseLoss {
        /// The predictions.
        pred: TensorId,
        /// The target values, pred's length.
        target: TensorId,
        /// The gradient of pred (pred's length).
        grad: TensorId,
        /// The format `grad` is held in.
        held: Format,
    },
    /// out = op(a) . op(b) under `algorithm`, rounded to `held` as it is stored; an fp8
    /// algorithm with given scales takes them from the scalar slots `scales` (delayed scaling:
    /// they change every step).
    Matmul {
        /// The shape and transposes of a and b.
        shape: MatmulShape,
        /// How the product is computed (its formats, scaling and accumulation).
        algorithm: Algorithm,
        /// The left factor.
        a: TensorId,
        /// The right factor.
        b: TensorId,
        /// The product C (batch x m x n).
        out: TensorId,
        /// Scalar slots of a's and b's fp8 scales (delayed scaling), in place of those `algorithm`
        /// gives.
        scales: Option<[usize; 2]>,
        /// The format the product is held in (a weight gradient autocast holds in the compute
        /// format): the rounding after the product, done as it is stored
        /// (`PlanBuilder::finish` folds a `Round` of the product into it).
        held: Format,
    },
    /// x rounded to `format` in place (autocast holds x in `format`).
    Round {
        /// The tensor rounded.
        x: TensorId,
        /// The format its values are rounded to (they stay f32).
        format: Format,
    },
    /// out = y' + x' held in `held`, where y' is y rounded to `y_held` (a matmul's product
    /// that autocast holds in the compute format, rounded as the add reads it:
    /// `PlanBuilder::push`) and x' is x rounded to `x_held` (a linear layer's bias, which
    /// autocast casts to the compute format and adds to the f32 product before its one
    /// rounding, as cuBLASLt's bias epilogue), x repeated over y when shorter (a bias added to
    /// every row); then,
    /// with a `residual` (r, format), out + r held in that format (a block's residual
    /// connection after its projection's bias: one pass, not two). In place where `out` is `y`
    /// (as the model records it: `Plan::store_codes` gives a bias add whose output it stores
    /// as codes an output of its own). With `gelu` (g, format) and no residual, then also
    /// g = GELU(out as stored) held in that format (the MLP's bias add and its activation in
    /// one pass, folded by `PlanBuilder::push`; out stays the activation's input, which the
    /// backward pass reads).
    Add {
        /// The tensor added (y's length, or a divisor of it: a bias repeated over y's rows).
        x: TensorId,
        /// The tensor x is added to (a matmul's product).
        y: TensorId,
        /// The sum (y's length); may be `y` itself.
        out: TensorId,
        /// The format the sum is held in.
        held: Format,
        /// The format y is rounded to as the add reads it.
        y_held: Format,
        /// The format x is rounded to as the add reads it.
        x_held: Format,
        /// A residual (r, format): out + r held in that format, into `out`.
        residual: Option<(TensorId, Format)>,
        /// A GELU (g, format): g = GELU(out) held in that format.
        gelu: Option<(TensorId, Format)>,
    },
    /// out\[j\] = sum over rows of x'\[row, j\] in f32, held in `held`, x' being x rounded to
    /// `x_held` (a linear layer's bias gradient: autocast holds the layer's output, and so its
    /// gradient, in the compute format, and sums it into the compute format's bias).
    ColumnSums {
        /// The input (rows, c).
        x: TensorId,
        /// The column sums (c).
        out: TensorId,
        /// Width of a row.
        c: usize,
        /// The format x is rounded to as it is read.
        x_held: Format,
        /// The format the sums are held in.
        held: Format,
    },
    /// out[map.dst(e)] = x[map.src(e)], rounded to `held`.
    Copy {
        /// The source.
        x: TensorId,
        /// The destination.
        out: TensorId,
        /// Which element of x goes to which of out.
        map: Strided,
        /// The format the values are rounded to as they are copied (a matmul's product that
        /// autocast holds in the compute format, copied to or from heads: the rounding after
        /// the matmul folded in, `PlanBuilder::finish`).
        held: Format,
    },
    /// Stats slot `slot` = largest finite |x| (fp8 delayed scaling's amax).
    Amax {
        /// The tensor read.
        x: TensorId,
        /// The stats slot written.
        slot: usize,
    },
    /// GradScaler's unscale of every gradient at once (`grads[i]` is the stats' gradient i):
    /// g *= scalar `INVERSE_SCALE` (gradient 0's first element also gets scalar `POISON`, 0
    /// except when a test injects a fault), and each gradient's finite flag and squared norm
    /// into the stats. One op over the list, as a multi-tensor kernel runs it: a launch per
    /// gradient would cost more than the work on a model of many small tensors.
    UnscaleCheck {
        /// The gradients; gradient i of the stats is `grads[i]`.
        grads: Vec<TensorId>,
    },
    /// AdamW update of every parameter at once, applied only where every gradient is finite,
    /// with the gradients clipped to the global norm scalar `CLIP` (0: no clipping); each
    /// parameter and its moments computed in f32, then rounded to `held` as written.
    AdamW {
        /// One entry per parameter, in the order of the stats' gradients.
        params: Vec<AdamWParam>,
        /// The format the parameters and moments are held in (the preset's weights: f32 with
        /// master weights, else the 16-bit format), rounded as the update writes them.
        held: Format,
    },
}

/// One parameter of an `Op::AdamW`: what it updates in place (the parameter and its moments),
/// its gradient, and whether weight decay applies to it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWParam {
    /// The parameter, updated in place.
    pub param: TensorId,
    /// Its gradient.
    pub grad: TensorId,
    /// Adam's first moment (the gradient's running mean), updated in place.
    pub m: TensorId,
    /// Adam's second moment (the squared gradient's running mean), updated in place.
    pub v: TensorId,
    /// Whether weight decay applies (to matrices and embeddings, not to biases and gains).
    pub decay: bool,
}

/// One operand of an op as the op declares it (`Op::operands_mut`): the tensor (`T`, a
/// `TensorId` or a place holding one), how the op reads it and how it writes it (both: updated
/// in place). `F` is a format the op keeps (a `Format`, or a place a fold may set it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Operand<T, F> {
    pub tensor: T,
    pub read: Option<Read<F>>,
    pub write: Option<Write<F>>,
    /// A second field of the op naming the same tensor (an add in place: its `out`, which is
    /// its `y`), renamed with it.
    pub same: Option<T>,
}

/// How an op reads an operand.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Read<F> {
    /// As f32 values.
    F32,
    /// As f32 values or as 16-bit codes it decodes (`Plan::store_codes`).
    Decoded,
    /// As ids (u32 bit patterns), each below a count of rows.
    Ids(IdRows),
    /// Rounded to a format as it reads (F32: not rounded), which a rounding of the operand
    /// right before the op may set (`PlanBuilder::finish`).
    Rounded(F),
    /// Rounded to this format by the op's definition, wherever it reads it.
    RoundedBy(Format),
}

/// The rows an operand read as ids indexes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum IdRows {
    Given(usize),
    /// The rows of `c` values in this tensor (an embedding's table).
    OfTable(TensorId, usize),
}

/// How an op writes an operand.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Write<F> {
    /// The format the values written are held in.
    pub held: Held<F>,
    /// Whether a kernel of the op stores the values as 16-bit codes of their held format.
    pub codes: bool,
    /// Elements written, where not all (a strided copy's).
    pub part: Option<usize>,
}

/// The format an op holds an output in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Held<F> {
    /// As the op computes it, in no format of its choosing.
    Computed,
    /// In a format of the op's choosing, F32 for none: a rounding of the output right after
    /// the op may set it (`PlanBuilder::round`).
    Chosen(F),
    /// In this format, by the op's definition.
    Defined(Format),
}

impl Held<Format> {
    /// The format, where the op holds its output in one.
    pub fn format(self) -> Option<Format> {
        match self {
            Held::Computed => None,
            Held::Chosen(f) | Held::Defined(f) => Some(f),
        }
    }
}

impl<'a> Operand<&'a mut TensorId, &'a mut Format> {
    fn reads(tensor: &'a mut TensorId, read: Read<&'a mut Format>) -> Self {
        Operand {
            tensor,
            read: Some(read),
            write: None,
            same: None,
        }
    }

    fn read(tensor: &'a mut TensorId) -> Self {
        Self::reads(tensor, Read::F32)
    }

    fn decoded(tensor: &'a mut TensorId) -> Self {
        Self::reads(tensor, Read::Decoded)
    }

    fn ids(tensor: &'a mut TensorId, rows: IdRows) -> Self {
        Self::reads(tensor, Read::Ids(rows))
    }

    fn rounded_read(tensor: &'a mut TensorId, format: &'a mut Format) -> Self {
        Self::reads(tensor, Read::Rounded(format))
    }

    fn read_rounded_by(tensor: &'a mut TensorId, format: Format) -> Self {
        Self::reads(tensor, Read::RoundedBy(format))
    }

    /// Written whole, as computed.
    fn write(tensor: &'a mut TensorId) -> Self {
        Operand {
            tensor,
            read: None,
            write: Some(Write {
                held: Held::Computed,
                codes: false,
                part: None,
            }),
            same: None,
        }
    }

    /// Read as f32 and written whole, in place.
    fn update(tensor: &'a mut TensorId) -> Self {
        Operand {
            read: Some(Read::F32),
            ..Self::write(tensor)
        }
    }

    fn written(mut self, set: impl FnOnce(&mut Write<&'a mut Format>)) -> Self {
        if let Some(w) = &mut self.write {
            set(w);
        }
        self
    }

    /// Held in a format of the op's choosing.
    fn held(self, format: &'a mut Format) -> Self {
        self.written(|w| w.held = Held::Chosen(format))
    }

    /// Held in `format` by the op's definition.
    fn defined(self, format: Format) -> Self {
        self.written(|w| w.held = Held::Defined(format))
    }

    fn codes(self, codes: bool) -> Self {
        self.written(|w| w.codes = codes)
    }

    fn part(self, elements: usize) -> Self {
        self.written(|w| w.part = Some(elements))
    }

    /// Names the same tensor in a second field too (`same`).
    fn same(self, also: &'a mut TensorId) -> Self {
        Operand {
            same: Some(also),
            ..self
        }
    }

    fn owned(self) -> Operand<TensorId, Format> {
        Operand {
            tensor: *self.tensor,
            same: self.same.map(|t| *t),
            read: self.read.map(|r| match r {
                Read::F32 => Read::F32,
                Read::Decoded => Read::Decoded,
                Read::Ids(rows) => Read::Ids(rows),
                Read::Rounded(f) => Read::Rounded(*f),
                Read::RoundedBy(f) => Read::RoundedBy(f),
            }),
            write: self.write.map(|w| Write {
                held: match w.held {
                    Held::Computed => Held::Computed,
                    Held::Chosen(f) => Held::Chosen(*f),
                    Held::Defined(f) => Held::Defined(f),
                },
                codes: w.codes,
                part: w.part,
            }),
        }
    }
}

impl Op {
    /// y += x in f32, x repeated over y when shorter (`PlanBuilder::round` may then give it a
    /// format to hold y in).
    pub fn add_in_place(x: TensorId, y: TensorId) -> Op {
        Op::Add {
            x,
            y,
            out: y,
            held: Format::F32,
            y_held: Format::F32,
            x_held: Format::F32,
            residual: None,
            gelu: None,
        }
    }

    /// Name of the op in errors and profiles.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Embedding { .. } => "embedding",
            Op::EmbeddingBwd { .. } => "embedding backward",
            Op::LayerNorm { .. } => "layer norm",
            Op::LayerNormBwd { .. } => "layer norm backward",
            Op::Unary { f, .. } => f.name(),
            Op::UnaryBwd { f, .. } => f.backward_name(),
            Op::RmsNorm { .. } => "rms norm",
            Op::RmsNormBwd { .. } => "rms norm backward",
            Op::Mul { .. } => "mul",
            Op::RowSum { .. } => "row sum",
            Op::Dropout { .. } => "dropout",
            Op::Rotary { inverse: false, .. } => "rotary",
            Op::Rotary { .. } => "rotary backward",
            Op::Broadcast { .. } => "broadcast",
            Op::MseLoss { .. } => "mean squared error",
            Op::Softmax { causal: true, .. } => "causal softmax",
            Op::Softmax { .. } => "softmax",
            Op::SoftmaxBwd { causal: true, .. } => "causal softmax backward",
            Op::SoftmaxBwd { .. } => "softmax backward",
            Op::Attention { .. } => "attention",
            Op::AttentionBwd { .. } => "attention backward",
            Op::CrossEntropy { .. } => "cross entropy",
            Op::Matmul { .. } => "matmul",
            Op::Round { .. } => "round",
            Op::Add { .. } => "add",
            Op::ColumnSums { .. } => "column sums",
            Op::Copy { .. } => "strided copy",
            Op::Amax { .. } => "amax",
            Op::UnscaleCheck { .. } => "unscale and check",
            Op::AdamW { .. } => "adamw",
        }
    }

    /// The op in a profile: its name, and what sets its cost apart where one name covers
    /// different work (a matmul's algorithm and shape, a rounding's format).
    pub fn label(&self) -> String {
        match self {
            Op::Matmul {
                shape, algorithm, ..
            } => {
                let batch = if shape.batch > 1 {
                    format!("{} x ", shape.batch)
                } else {
                    String::new()
                };
                let transposed = match (shape.a_transposed, shape.b_transposed) {
                    (false, false) => "",
                    (true, false) => ", A^T",
                    (false, true) => ", B^T",
                    (true, true) => ", A^T B^T",
                };
                format!(
                    "matmul {algorithm} {batch}{}x{}x{}{transposed}",
                    shape.m, shape.n, shape.k
                )
            }
            Op::Round { format, .. } => format!("round to {format}"),
            // Folded adds do more work than an add: say what they took in.
            Op::Add { gelu: Some(_), .. } => "add + gelu".into(),
            Op::Add {
                residual: Some(_), ..
            } => "add + residual".into(),
            op @ (Op::Embedding { .. }
            | Op::EmbeddingBwd { .. }
            | Op::LayerNorm { .. }
            | Op::LayerNormBwd { .. }
            | Op::Unary { .. }
            | Op::UnaryBwd { .. }
            | Op::RmsNorm { .. }
            | Op::RmsNormBwd { .. }
            | Op::Mul { .. }
            | Op::RowSum { .. }
            | Op::Dropout { .. }
            | Op::Rotary { .. }
            | Op::Broadcast { .. }
            | Op::MseLoss { .. }
            | Op::Softmax { .. }
            | Op::SoftmaxBwd { .. }
            | Op::Attention { .. }
            | Op::AttentionBwd { .. }
            | Op::CrossEntropy { .. }
            | Op::Add { .. }
            | Op::ColumnSums { .. }
            | Op::Copy { .. }
            | Op::Amax { .. }
            | Op::UnscaleCheck { .. }
            | Op::AdamW { .. }) => op.name().into(),
        }
    }
}

impl Op {
    /// The op's operands, each named once with how the op uses it: the one declaration from
    /// which every question below is answered (what it reads and writes, what it updates in
    /// place, decodes, reads as ids or rounds as it reads, the format it holds an output in and
    /// whether it can store it as 16-bit codes). A new op, or an operand property a fold needs,
    /// is declared here and nowhere else in the plan.
    fn operands_mut(&mut self) -> Vec<Operand<&mut TensorId, &mut Format>> {
        use Operand as O;
        match self {
            Op::Embedding { table, ids, out, c } => {
                let rows = IdRows::OfTable(*table, *c);
                vec![O::read(table), O::ids(ids, rows), O::write(out)]
            }
            Op::EmbeddingBwd {
                dout,
                ids,
                out,
                rows,
                ..
            } => {
                let rows = IdRows::Given(*rows);
                vec![O::read(dout), O::ids(ids, rows), O::write(out)]
            }
            Op::LayerNorm {
                x,
                g,
                b,
                out,
                stats,
                c,
                held,
            } => {
                // Rows of even width: no 4-byte word of codes spans two of them.
                let codes = *c % 2 == 0;
                let out = O::write(out).held(held).codes(codes);
                vec![O::read(x), O::read(g), O::read(b), out, O::write(stats)]
            }
            Op::LayerNormBwd {
                dy,
                x,
                g,
                stats,
                dx,
                dg,
                db,
                sum,
                dy_held,
                ..
            } => {
                let mut all = vec![
                    O::rounded_read(dy, dy_held),
                    O::read(x),
                    O::read(g),
                    O::read(stats),
                ];
                // dx is held in a format of the op's choosing where a gradient is summed in.
                match sum {
                    Some((r, held)) => all.extend([O::read(r), O::write(dx).held(held)]),
                    None => all.push(O::write(dx)),
                }
                all.extend([O::write(dg), O::write(db)]);
                all
            }
            Op::Unary { x, out, held, .. } => {
                vec![O::decoded(x), O::write(out).held(held).codes(true)]
            }
            Op::UnaryBwd {
                x,
                dy,
                out,
                held,
                dy_held,
                ..
            } => vec![
                O::decoded(x),
                O::rounded_read(dy, dy_held),
                O::write(out).held(held),
            ],
            Op::RmsNorm {
                x,
                g,
                out,
                stats,
                c,
                held,
                ..
            } => {
                let codes = *c % 2 == 0;
                let out = O::write(out).held(held).codes(codes);
                vec![O::read(x), O::read(g), out, O::write(stats)]
            }
            Op::RmsNormBwd {
                dy,
                x,
                g,
                stats,
                dx,
                dg,
                dy_held,
                ..
            } => vec![
                O::rounded_read(dy, dy_held),
                O::read(x),
                O::read(g),
                O::read(stats),
                O::write(dx),
                O::write(dg),
            ],
            Op::Mul { a, b, out, held } => {
                vec![O::read(a), O::read(b), O::write(out).held(held).codes(true)]
            }
            Op::RowSum { x, out, held, .. }
            | Op::Broadcast { x, out, held, .. }
            | Op::Dropout { x, out, held, .. }
            | Op::ColumnSums { x, out, held, .. } => vec![O::read(x), O::write(out).held(held)],
            Op::Rotary {
                x,
                table,
                out,
                held,
                ..
            } => vec![O::read(x), O::read(table), O::write(out).held(held)],
            Op::Softmax {
                x,
                out,
                mask,
                x_held,
                ..
            } => {
                let mut all = vec![O::rounded_read(x, x_held)];
                all.extend(mask.as_mut().map(|m| O::read(&mut m.mask)));
                all.push(O::write(out));
                all
            }
            Op::SoftmaxBwd {
                p,
                dp,
                out,
                dp_held,
                ..
            } => vec![O::read(p), O::rounded_read(dp, dp_held), O::write(out)],
            Op::Attention {
                qkv,
                out,
                stats,
                spec,
            } => {
                // Heads of even width: no 4-byte word of codes spans two of them.
                let out = O::write(out).defined(spec.compute).codes(spec.d % 2 == 0);
                vec![O::decoded(qkv), out, O::write(stats)]
            }
            Op::AttentionBwd {
                qkv,
                dout,
                stats,
                delta,
                dqkv,
                spec,
            } => {
                // dout is read only as an operand of its products, whose algorithm (bf16 or
                // f16, not split or scaled) rounds it.
                let dout = match spec.algorithm {
                    Algorithm::Bf16 | Algorithm::F16 => {
                        O::read_rounded_by(dout, spec.algorithm.operand_formats().0)
                    }
                    _ => O::read(dout),
                };
                vec![
                    O::decoded(qkv),
                    dout,
                    O::read(stats),
                    O::write(delta),
                    O::write(dqkv),
                ]
            }
            Op::CrossEntropy {
                logits,
                targets,
                grad,
                v,
                held,
            } => {
                let codes = *v % 2 == 0;
                let rows = IdRows::Given(*v);
                let grad = O::write(grad).held(held).codes(codes);
                vec![O::read(logits), O::ids(targets, rows), grad]
            }
            Op::MseLoss {
                pred,
                target,
                grad,
                held,
            } => vec![O::read(pred), O::read(target), O::write(grad).held(held)],
            // Codes a matmul reads where its algorithm rounds to their format
            // (`check_stored_operands`), a property of the algorithm and not of the operand.
            Op::Matmul {
                a, b, out, held, ..
            } => {
                vec![O::read(a), O::read(b), O::write(out).held(held)]
            }
            Op::Round { x, format } => vec![O::update(x).defined(*format)],
            Op::Add {
                x,
                y,
                out,
                held,
                residual,
                gelu,
                ..
            } => {
                // The sum's codes are stored beside y (the wgpu kernels bind a coded output
                // only so); with a residual, the op's output is the last sum, held as the
                // residual says.
                let in_place = *out == *y;
                let codes = !in_place && residual.is_none();
                let (residual, held) = match residual {
                    Some((r, held)) => (Some(O::read(r)), held),
                    None => (None, held),
                };
                let mut all = vec![O::read(x)];
                if in_place {
                    all.push(O::update(y).same(out).held(held));
                    all.extend(residual);
                } else {
                    all.push(O::read(y));
                    all.extend(residual);
                    all.push(O::write(out).held(held).codes(codes));
                }
                all.extend(
                    gelu.as_mut()
                        .map(|(g, held)| O::write(g).held(held).codes(true)),
                );
                all
            }
            Op::Copy { x, out, map, held } => {
                vec![O::rounded_read(x, held), O::write(out).part(map.len())]
            }
            Op::Amax { x, .. } => vec![O::read(x)],
            Op::UnscaleCheck { grads } => grads.iter_mut().map(O::update).collect(),
            Op::AdamW { params, .. } => params
                .iter_mut()
                .flat_map(|p| {
                    [
                        O::update(&mut p.param),
                        O::read(&mut p.grad),
                        O::update(&mut p.m),
                        O::update(&mut p.v),
                    ]
                })
                .collect(),
        }
    }

    /// The op's operands (`operands_mut`) as values.
    pub(crate) fn operands(&self) -> Vec<Operand<TensorId, Format>> {
        let mut op = self.clone();
        op.operands_mut().into_iter().map(Operand::owned).collect()
    }

    /// The tensors the op reads and the ones it writes (a tensor updated in place is in both).
    pub fn reads_writes(&self) -> (Vec<TensorId>, Vec<TensorId>) {
        let all = self.operands();
        let named = |keep: fn(&Operand<TensorId, Format>) -> bool| {
            all.iter().filter(|o| keep(o)).map(|o| o.tensor).collect()
        };
        (named(|o| o.read.is_some()), named(|o| o.write.is_some()))
    }

    /// The tensors the op reads and writes as one (updates in place).
    pub(super) fn updated_in_place(&self) -> Vec<TensorId> {
        let all = self.operands().into_iter();
        all.filter(|o| o.read.is_some() && o.write.is_some())
            .map(|o| o.tensor)
            .collect()
    }

    /// Whether the op reads `t` as f32 or as 16-bit codes alike, decoding them
    /// (`Plan::store_codes`): a unary function's x (forward and backward) and fused
    /// attention's q|k|v.
    pub fn decodes(&self, t: TensorId) -> bool {
        self.operands()
            .iter()
            .any(|o| o.tensor == t && matches!(o.read, Some(Read::Decoded)))
    }

    /// The tensors the op reads as ids (u32 bit patterns), each with the rows it indexes
    /// (`len`: each tensor's length).
    pub(super) fn id_reads(&self, len: impl Fn(TensorId) -> usize) -> Vec<(TensorId, usize)> {
        let rows = |r| match r {
            IdRows::Given(rows) => rows,
            IdRows::OfTable(table, c) => len(table) / c.max(1),
        };
        let all = self.operands().into_iter();
        all.filter_map(|o| match o.read {
            Some(Read::Ids(r)) => Some((o.tensor, rows(r))),
            _ => None,
        })
        .collect()
    }

    /// The format this op leaves `t` held in where it writes all of `t` in a known format (a
    /// rounding, a held output: `held_output`, fused attention's output in its compute
    /// format); None otherwise.
    pub(crate) fn holds(&self, t: TensorId) -> Option<Format> {
        let all = self.operands().into_iter();
        all.filter(|o| o.tensor == t)
            .find_map(|o| o.write.and_then(|w| w.held.format()))
    }

    /// The output the op holds in a format of its own choosing (`PlanBuilder::round` folds a
    /// rounding into it, `PlanBuilder::finish` a product's), the last where several are (an
    /// add's GELU after its sum), and that format.
    pub(crate) fn held_output(&mut self) -> Option<(TensorId, &mut Format)> {
        let all = self.operands_mut().into_iter().rev();
        all.filter_map(|o| match o.write {
            Some(Write {
                held: Held::Chosen(format),
                ..
            }) => Some((*o.tensor, format)),
            _ => None,
        })
        .next()
    }

    /// Whether the op can write tensor `t` as 16-bit codes of `format`: it holds that output in
    /// `format` and has a kernel that stores codes.
    pub fn coded_output(&self, t: TensorId, format: Format) -> bool {
        self.operands().into_iter().any(|o| {
            o.tensor == t
                && o.write
                    .is_some_and(|w| w.codes && w.held.format() == Some(format))
        })
    }

    /// The format the op rounds its input `t` to as it reads it, where it can (the gradient
    /// read by a layer norm's, an RMS norm's or a unary function's backward; a strided copy's
    /// source; the softmax's scores and its backward's dp): `PlanBuilder::finish`
    /// folds a rounding of `t` right before the op into it.
    pub(crate) fn rounded_read(&mut self, t: TensorId) -> Option<&mut Format> {
        let all = self.operands_mut().into_iter();
        all.filter(|o| *o.tensor == t).find_map(|o| match o.read {
            Some(Read::Rounded(format)) => Some(format),
            _ => None,
        })
    }

    /// The format the op's own definition rounds its input `t` to wherever it reads it, so
    /// that a rounding of `t` to that format right before it changes nothing (the fused
    /// attention backward's dout).
    pub(crate) fn reads_rounded(&self, t: TensorId) -> Option<Format> {
        let all = self.operands().into_iter();
        all.filter(|o| o.tensor == t).find_map(|o| match o.read {
            Some(Read::RoundedBy(format)) => Some(format),
            _ => None,
        })
    }

    /// Elements of `t` the op writes: all of them (`len`) but where it writes part of it (a
    /// strided copy writes those its map reaches).
    pub(super) fn elements_written(&self, t: TensorId, len: usize) -> usize {
        let all = self.operands().into_iter();
        all.filter(|o| o.tensor == t)
            .find_map(|o| o.write.map(|w| w.part.unwrap_or(len)))
            .unwrap_or(0)
    }

    /// The op with every tensor id `t` it names replaced by `to(t)`.
    pub fn map_tensors(&self, mut to: impl FnMut(TensorId) -> TensorId) -> Op {
        let mut op = self.clone();
        for o in op.operands_mut() {
            *o.tensor = to(*o.tensor);
            if let Some(same) = o.same {
                *same = to(*same);
            }
        }
        op
    }
}

/// The algorithm a `Matmul` op runs in a step: an fp8 algorithm with scalar slots takes its
/// given scales from the step's scalars (delayed scaling), anything else runs as recorded.
pub fn step_algorithm(
    algorithm: Algorithm,
    scales: Option<[usize; 2]>,
    scalars: &[f32],
) -> Algorithm {
    match (algorithm, scales) {
        (Algorithm::Fp8 { a, b, .. }, Some([sa, sb])) => Algorithm::Fp8 {
            a,
            b,
            scaling: crate::algorithm::Scaling::Given {
                a: scalars[sa],
                b: scalars[sb],
            },
        },
        (alg, _) => alg,
    }
}

impl Op {
    /// Checks the op's tensors against its dims, and its stats and scalar slots (once, at
    /// `PlanBuilder::finish`): `check` gives each tensor's length and names the op in an error.
    pub(super) fn check_lengths(&self, check: &Check) -> Result<()> {
        let plan = check.plan;
        match *self {
            Op::Embedding { table, ids, out, c } => {
                check.rows("the table", table, ("c", c))?;
                check.holds("the output", out, check.len(ids) * c)
            }
            Op::EmbeddingBwd {
                dout,
                ids,
                out,
                rows,
                c,
            } => {
                check.holds("the output's gradient", dout, check.len(ids) * c)?;
                check.holds("the table's gradient", out, rows * c)
            }
            Op::LayerNorm {
                x,
                g,
                b,
                out,
                stats,
                c,
                ..
            } => {
                let rows = check.rows("x", x, ("c", c))?;
                check.holds("the gain", g, c)?;
                check.holds("the bias", b, c)?;
                check.holds("the output", out, check.len(x))?;
                check.holds("the (mean, rstd) pairs", stats, 2 * rows)
            }
            Op::LayerNormBwd {
                dy,
                x,
                g,
                stats,
                dx,
                dg,
                db,
                c,
                sum,
                ..
            } => {
                let rows = check.rows("x", x, ("c", c))?;
                check.holds("dy", dy, check.len(x))?;
                check.holds("the gain", g, c)?;
                check.holds("the (mean, rstd) pairs", stats, 2 * rows)?;
                check.holds("dx", dx, check.len(x))?;
                if let Some((r, _)) = sum {
                    check.holds("the gradient summed into dx", r, check.len(x))?;
                }
                check.holds("the gain's gradient", dg, c)?;
                check.holds("the bias's gradient", db, c)
            }
            Op::Unary { x, out, .. } => check.holds("the output", out, check.len(x)),
            Op::UnaryBwd { x, dy, out, .. } => {
                check.holds("dy", dy, check.len(x))?;
                check.holds("the output", out, check.len(x))
            }
            Op::RmsNorm {
                x,
                g,
                out,
                stats,
                c,
                eps,
                ..
            } => {
                let rows = check.rows("x", x, ("c", c))?;
                check.holds("the gain", g, c)?;
                check.holds("the output", out, check.len(x))?;
                check.holds("the rstd of each row", stats, rows)?;
                if !(eps.is_finite() && eps >= 0.0) {
                    return Err(check.fail(format!("eps {eps} is not a finite value >= 0")));
                }
                Ok(())
            }
            Op::RmsNormBwd {
                dy,
                x,
                g,
                stats,
                dx,
                dg,
                c,
                ..
            } => {
                let rows = check.rows("x", x, ("c", c))?;
                check.holds("dy", dy, check.len(x))?;
                check.holds("the gain", g, c)?;
                check.holds("the rstd of each row", stats, rows)?;
                check.holds("dx", dx, check.len(x))?;
                check.holds("the gain's gradient", dg, c)
            }
            Op::Mul { a, b, out, .. } => {
                check.holds("b", b, check.len(a))?;
                check.holds("the output", out, check.len(a))
            }
            Op::Dropout { x, out, p, .. } => {
                if !(0.0..1.0).contains(&p) {
                    return Err(check.fail(format!("p {p} is not in [0, 1)")));
                }
                check.holds("the output", out, check.len(x))
            }
            Op::Rotary {
                x,
                table,
                out,
                t,
                c,
                d,
                ..
            } => {
                let rows = check.rows("x", x, ("c", c))?;
                if d == 0 || d % 2 != 0 || c % d != 0 || t == 0 || rows % t != 0 {
                    return Err(check.fail(format!(
                        "rows of c = {c} as heads of d = {d} (even) at t = {t} positions: {rows} rows"
                    )));
                }
                check.holds("the table", table, t * d)?;
                check.holds("the output", out, check.len(x))
            }
            Op::RowSum {
                x, out, c, divisor, ..
            } => {
                let rows = check.rows("x", x, ("c", c))?;
                if !(divisor.is_finite() && divisor != 0.0) {
                    return Err(check.fail(format!("divisor {divisor} is not finite and nonzero")));
                }
                check.holds("the sums", out, rows)
            }
            Op::Broadcast {
                x,
                out,
                c,
                scale,
                divisor,
                ..
            } => {
                if c == 0 || !(scale.is_finite() && divisor.is_finite() && divisor != 0.0) {
                    return Err(check.fail(format!(
                        "repeats {c}, scale {scale} and divisor {divisor}: must be at least 1, \
                         finite, and finite and nonzero"
                    )));
                }
                let n = check.len(x).checked_mul(c);
                let n = n.ok_or_else(|| check.fail("its output's length overflows".into()))?;
                check.holds("the output", out, n)
            }
            Op::MseLoss {
                pred, target, grad, ..
            } => {
                if check.len(pred) == 0 {
                    return Err(check.fail(format!(
                        "the predictions (tensor {pred}) are empty: no mean to take"
                    )));
                }
                check.holds("the targets", target, check.len(pred))?;
                check.holds("the gradient", grad, check.len(pred))
            }
            Op::Softmax {
                x, out, t, mask, ..
            } => {
                let rows = check.rows("the scores", x, ("t", t))?;
                if let Some(m) = mask {
                    let Some(read) = m.rows_read(rows) else {
                        return Err(check.fail(format!(
                            "{rows} score rows do not read whole masks as {m:?} says"
                        )));
                    };
                    check.holds("the mask", m.mask, read * t)?;
                }
                check.holds("the output", out, check.len(x))
            }
            Op::SoftmaxBwd { p, dp, out, t, .. } => {
                check.rows("the probabilities", p, ("t", t))?;
                check.holds("their gradient", dp, check.len(p))?;
                check.holds("the output", out, check.len(p))
            }
            Op::Attention {
                qkv,
                out,
                stats,
                ref spec,
            } => {
                check.holds("q|k|v", qkv, spec.qkv_len())?;
                check.holds("the output", out, spec.out_len())?;
                check.holds("the (max, sum) pairs", stats, 2 * spec.score_rows())
            }
            Op::AttentionBwd {
                qkv,
                dout,
                stats,
                delta,
                dqkv,
                ref spec,
            } => {
                check.holds("q|k|v", qkv, spec.qkv_len())?;
                check.holds("the output's gradient", dout, spec.out_len())?;
                check.holds("the (max, sum) pairs", stats, 2 * spec.score_rows())?;
                check.holds("the sums of P dP", delta, spec.score_rows())?;
                check.holds("q|k|v's gradient", dqkv, spec.qkv_len())
            }
            Op::CrossEntropy {
                logits,
                targets,
                grad,
                v,
                ..
            } => {
                let rows = check.rows("the logits", logits, ("v", v))?;
                check.holds("the targets", targets, rows)?;
                check.holds("the gradient", grad, check.len(logits))
            }
            Op::Matmul {
                ref shape,
                a,
                b,
                out,
                scales,
                ..
            } => {
                shape
                    .check(check.len(a), check.len(b))
                    .map_err(|e| check.fail(format!("{e} (shape {shape:?})")))?;
                check.holds("the product", out, shape.c_len())?;
                match scales {
                    Some(slots) if slots.iter().any(|&s| s >= plan.scalar_count()) => Err(check
                        .fail(format!(
                            "its scales are scalar slots {slots:?} of {}",
                            plan.scalar_count()
                        ))),
                    _ => Ok(()),
                }
            }
            Op::Round { .. } => Ok(()),
            Op::Add {
                x,
                y,
                out,
                residual,
                gelu,
                ..
            } => {
                let n = check.len(y);
                if n > 0 && (check.len(x) == 0 || !n.is_multiple_of(check.len(x))) {
                    return Err(check.fail(format!(
                        "x (tensor {x}) has {} values, which do not repeat over y's {n}",
                        check.len(x)
                    )));
                }
                check.holds("the output", out, n)?;
                // The definition takes a GELU only without a residual; the wgpu kernels bind
                // a residual only in place, a GELU only in place or beside a coded output.
                if residual.is_some() && gelu.is_some() {
                    return Err(check.fail("an add takes a residual or a GELU, not both".into()));
                }
                if let Some((r, _)) = residual {
                    check.holds("the residual", r, n)?;
                    if out != y {
                        return Err(check.fail("an add with a residual writes in place".into()));
                    }
                }
                if let Some((g, _)) = gelu {
                    check.holds("the GELU's output", g, n)?;
                    if out != y && plan.tensors[out].stored == Format::F32 {
                        return Err(check.fail(
                            "an add with a GELU writes in place or into a coded tensor".into(),
                        ));
                    }
                }
                Ok(())
            }
            Op::ColumnSums { x, out, c, .. } => {
                check.rows("x", x, ("c", c))?;
                check.holds("the sums", out, c)
            }
            Op::Copy {
                x, out, ref map, ..
            } => {
                if map.is_empty() {
                    return Ok(());
                }
                // The last element's indices are the largest (the strides are not negative).
                let (src, dst) = map.indices(map.len() - 1);
                if src >= check.len(x) || dst >= check.len(out) {
                    return Err(check.fail(format!(
                        "the copy reaches element {src} of x (tensor {x}, {} values) and {dst} of \
                         the output (tensor {out}, {} values)",
                        check.len(x),
                        check.len(out)
                    )));
                }
                Ok(())
            }
            Op::Amax { slot, .. } if slot >= plan.stats.len() => {
                Err(check.fail(format!("stats slot {slot} of {}", plan.stats.len())))
            }
            Op::Amax { .. } => Ok(()),
            Op::UnscaleCheck { ref grads } if grads.len() > plan.stats.grads => {
                Err(check.fail(format!(
                    "{} gradients, the stats hold {}",
                    grads.len(),
                    plan.stats.grads
                )))
            }
            Op::UnscaleCheck { .. } => Ok(()),
            Op::AdamW { ref params, .. } => {
                for p in params {
                    let n = check.len(p.param);
                    check.holds("the gradient", p.grad, n)?;
                    check.holds("the first moment", p.m, n)?;
                    check.holds("the second moment", p.v, n)?;
                }
                Ok(())
            }
        }
    }
}

impl Op {
    /// What the op costs on the plan's `tensors` (`Cost`).
    pub fn cost(&self, tensors: &[TensorInfo]) -> Cost {
        let bytes = |id: TensorId| tensors.get(id).map_or(0, TensorInfo::bytes);
        // `elements` of tensor `id`, at its stored width.
        let part = |id: TensorId, elements: usize| {
            tensors
                .get(id)
                .map_or(0, |t| elements as u64 * t.stored.storage_bytes() as u64)
        };
        let (reads, writes) = self.reads_writes();
        let whole = || reads.iter().chain(&writes).map(|&t| bytes(t)).sum::<u64>();
        match *self {
            // A gather reads the rows it picks, not the table.
            Op::Embedding { ids, out, .. } => Cost {
                bytes: bytes(ids) + 2 * bytes(out),
                flops: 0,
            },
            // The strided copies move their map's elements, which may be a part of either side.
            Op::Copy { x, out, map, .. } => Cost {
                bytes: part(x, map.len()) + part(out, map.len()),
                flops: 0,
            },
            Op::Matmul { shape, .. } => Cost {
                bytes: whole(),
                flops: 2 * (shape.batch * shape.m * shape.n * shape.k) as u64,
            },
            // Causal: q.k^T and P.v over the t (t + 1) / 2 pairs at and below the diagonal; the
            // backward recomputes the scores and takes four more products (dP, dV, dQ, dK).
            Op::Attention { spec, .. } | Op::AttentionBwd { spec, .. } => {
                let pairs = (spec.b * spec.h * spec.t * (spec.t + 1) / 2) as u64;
                let products = if matches!(self, Op::Attention { .. }) {
                    2
                } else {
                    5
                };
                Cost {
                    bytes: whole(),
                    flops: products * 2 * pairs * spec.d as u64,
                }
            }
            Op::EmbeddingBwd { .. }
            | Op::LayerNorm { .. }
            | Op::LayerNormBwd { .. }
            | Op::RmsNorm { .. }
            | Op::RmsNormBwd { .. }
            | Op::Mul { .. }
            | Op::RowSum { .. }
            | Op::Dropout { .. }
            | Op::Rotary { .. }
            | Op::Broadcast { .. }
            | Op::MseLoss { .. }
            | Op::Unary { .. }
            | Op::UnaryBwd { .. }
            | Op::Softmax { .. }
            | Op::SoftmaxBwd { .. }
            | Op::CrossEntropy { .. }
            | Op::Round { .. }
            | Op::Add { .. }
            | Op::ColumnSums { .. }
            | Op::Amax { .. }
            | Op::UnscaleCheck { .. }
            | Op::AdamW { .. } => Cost {
                bytes: whole(),
                flops: 0,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Renaming reaches every field that names a tensor, the second name of a tensor updated
    /// in place included, and the operands' properties follow the tensors.
    #[test]
    fn map_tensors_renames_every_field() {
        let bf16 = Format::Bf16;
        let add_with = |residual, gelu| Op::Add {
            x: 0,
            y: 1,
            out: 1,
            held: bf16,
            y_held: Format::F32,
            x_held: Format::F32,
            residual,
            gelu,
        };
        let (add, gelu) = (
            add_with(Some((2, bf16)), None),
            add_with(None, Some((3, bf16))),
        );
        let adamw = Op::AdamW {
            params: vec![AdamWParam {
                param: 0,
                grad: 1,
                m: 2,
                v: 3,
                decay: true,
            }],
            held: Format::F32,
        };
        for op in [add, gelu, adamw] {
            let moved = op.map_tensors(|t| t + 10);
            let (reads, writes) = op.reads_writes();
            let plus = |v: Vec<TensorId>| v.into_iter().map(|t| t + 10).collect::<Vec<_>>();
            assert_eq!(moved.reads_writes(), (plus(reads), plus(writes)), "{op:?}");
            let back = moved.map_tensors(|t| t - 10);
            assert_eq!(format!("{back:?}"), format!("{op:?}"));
            assert_eq!(moved.updated_in_place(), plus(op.updated_in_place()));
            for t in 0..4 {
                assert_eq!(moved.holds(t + 10), op.holds(t), "{op:?} {t}");
            }
        }
        // An add in place names y twice (y and out): both renamed, one operand.
        let Op::Add { y, out, .. } = Op::add_in_place(0, 1).map_tensors(|t| t + 10) else {
            unreachable!()
        };
        assert_eq!((y, out), (11, 11));
    }
}
