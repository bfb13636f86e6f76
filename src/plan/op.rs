//! The ops of a plan: what each computes (the host reference is `backend::reference::ops`),
//! the tensors it reads and writes, and its name in errors and profiles.

use super::{Strided, TensorId};
use crate::algorithm::{Algorithm, MatmulShape};
use crate::format::Format;

/// Fused causal self-attention over the rows of a (B, T, 3C) q|k|v tensor (the flash-attention
/// scheme): b sequences of t tokens, h heads of d. Per head, P = causal softmax of scale * q.k^T
/// and out = P.v, computed as the unfused plan computes them: q.k^T and P.v under `algorithm`
/// (its inputs rounded, f32 accumulation), their results held in `compute`, P held in `probs`.
/// Only each row's (max, sum) of the softmax is kept for the backward, which recomputes P from
/// it, instead of the (B, H, T, T) probabilities.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attention {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub d: usize,
    pub scale: f64,
    pub algorithm: Algorithm,
    pub probs: Format,
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
}

/// One op of a plan. Ops read and write tensors by id; the comments give what the op computes
/// (the host reference is `backend::reference::ops`).
#[derive(Clone, Debug)]
pub enum Op {
    /// out = rows of `table` (c wide) picked by `ids`.
    Embedding {
        table: TensorId,
        ids: TensorId,
        out: TensorId,
        c: usize,
    },
    /// out (rows x c) = scatter-add of the rows of `dout` by `ids`.
    EmbeddingBwd {
        dout: TensorId,
        ids: TensorId,
        out: TensorId,
        rows: usize,
        c: usize,
    },
    /// Layer norm over rows of c, `out` held in `held`; `stats` holds (mean, rstd) per row.
    LayerNorm {
        x: TensorId,
        g: TensorId,
        b: TensorId,
        out: TensorId,
        stats: TensorId,
        c: usize,
        held: Format,
    },
    LayerNormBwd {
        dy: TensorId,
        x: TensorId,
        g: TensorId,
        stats: TensorId,
        dx: TensorId,
        dg: TensorId,
        db: TensorId,
        c: usize,
    },
    /// out = GELU(x) (tanh form), held in `held`.
    Gelu {
        x: TensorId,
        out: TensorId,
        held: Format,
    },
    GeluBwd {
        x: TensorId,
        dy: TensorId,
        out: TensorId,
    },
    /// Causal softmax of `scale * x` per row of t.
    Softmax {
        x: TensorId,
        out: TensorId,
        t: usize,
        scale: f64,
    },
    SoftmaxBwd {
        p: TensorId,
        dp: TensorId,
        out: TensorId,
        t: usize,
        scale: f64,
    },
    /// out (B, T, C) = causal self-attention of `qkv` (`Attention`); `stats` gets each score
    /// row's (max of scale * s, sum of exp(scale * s - max)).
    Attention {
        qkv: TensorId,
        out: TensorId,
        stats: TensorId,
        spec: Attention,
    },
    /// The gradient of `qkv` (B, T, 3C) from that of the output (B, T, C), P recomputed from
    /// `stats`; `delta` gets each score row's sum(P * dP) (the softmax backward's dot).
    AttentionBwd {
        qkv: TensorId,
        dout: TensorId,
        stats: TensorId,
        delta: TensorId,
        dqkv: TensorId,
        spec: Attention,
    },
    /// The loss of each row of v logits, their mean into `Stats::LOSS`, and the loss's gradient
    /// (softmax(logits) - onehot(targets)) * scalar `DLOSS_PER_ROW` into `grad`, held in `held`:
    /// the backward fused into the forward, so the probabilities never reach memory.
    CrossEntropy {
        logits: TensorId,
        targets: TensorId,
        grad: TensorId,
        v: usize,
        held: Format,
    },
    /// out = op(a) . op(b) under `algorithm`; an fp8 algorithm with given scales takes them
    /// from the scalar slots `scales` (delayed scaling: they change every step).
    Matmul {
        shape: MatmulShape,
        algorithm: Algorithm,
        a: TensorId,
        b: TensorId,
        out: TensorId,
        scales: Option<[usize; 2]>,
    },
    /// x rounded to `format` in place (autocast holds x in `format`).
    Round { x: TensorId, format: Format },
    /// out = y' + x held in `held`, where y' is y rounded to `y_held` (a matmul's product
    /// that autocast holds in the compute format, rounded as the add reads it:
    /// `PlanBuilder::push`), x repeated over y when shorter (a bias added to every row); then,
    /// with a `residual` (r, format), out + r held in that format (a block's residual
    /// connection after its projection's bias: one pass, not two). In place where `out` is `y`
    /// (as the model records it: `Plan::store_codes` gives a bias add whose output it stores
    /// as codes an output of its own). With `gelu` (g, format) and no residual, then also
    /// g = GELU(out as stored) held in that format (the MLP's bias add and its activation in
    /// one pass, folded by `PlanBuilder::push`; out stays the activation's input, which the
    /// backward pass reads).
    Add {
        x: TensorId,
        y: TensorId,
        out: TensorId,
        held: Format,
        y_held: Format,
        residual: Option<(TensorId, Format)>,
        gelu: Option<(TensorId, Format)>,
    },
    /// out[j] = sum over rows of x[row, j] (bias gradients).
    ColumnSums {
        x: TensorId,
        out: TensorId,
        c: usize,
    },
    /// out[map.dst(e)] = x[map.src(e)].
    Copy {
        x: TensorId,
        out: TensorId,
        map: Strided,
    },
    /// Stats slot `slot` = largest finite |x| (fp8 delayed scaling's amax).
    Amax { x: TensorId, slot: usize },
    /// GradScaler's unscale of gradient `index`: g *= scalar `INVERSE_SCALE` (gradient 0's
    /// first element also gets scalar `POISON`, 0 except when a test injects a fault), and its
    /// finite flag and squared norm into the stats.
    UnscaleCheck { grad: TensorId, index: usize },
    /// AdamW update of one parameter, applied only where every gradient is finite, with the
    /// gradient clipped to the global norm scalar `CLIP` (0: no clipping).
    AdamW {
        param: TensorId,
        grad: TensorId,
        m: TensorId,
        v: TensorId,
        decay: bool,
    },
}

impl Op {
    /// The input this op's kernels may read as 16-bit codes (`Plan::store_codes`): GELU's x
    /// (forward and backward) and fused attention's q|k|v; every other input is read as f32.
    pub fn coded_input(&self) -> Option<TensorId> {
        match *self {
            Op::Gelu { x, .. } | Op::GeluBwd { x, .. } => Some(x),
            Op::Attention { qkv, .. } | Op::AttentionBwd { qkv, .. } => Some(qkv),
            Op::Embedding { .. }
            | Op::EmbeddingBwd { .. }
            | Op::LayerNorm { .. }
            | Op::LayerNormBwd { .. }
            | Op::Softmax { .. }
            | Op::SoftmaxBwd { .. }
            | Op::CrossEntropy { .. }
            | Op::Matmul { .. }
            | Op::Round { .. }
            | Op::Add { .. }
            | Op::ColumnSums { .. }
            | Op::Copy { .. }
            | Op::Amax { .. }
            | Op::UnscaleCheck { .. }
            | Op::AdamW { .. } => None,
        }
    }

    /// The output the op holds in a format of its own choosing (`PlanBuilder::round` folds a
    /// rounding into it) and that format: a layer norm's, GELU's, the cross entropy's gradient,
    /// an add's sum (with a residual, its last sum; with a GELU, the GELU).
    pub(crate) fn held_output(&mut self) -> Option<(TensorId, &mut Format)> {
        match self {
            Op::Add {
                out,
                residual: Some((_, held)),
                ..
            }
            | Op::Add {
                gelu: Some((out, held)),
                ..
            }
            | Op::Add { out, held, .. }
            | Op::LayerNorm { out, held, .. }
            | Op::Gelu { out, held, .. }
            | Op::CrossEntropy {
                grad: out, held, ..
            } => Some((*out, held)),
            Op::Embedding { .. }
            | Op::EmbeddingBwd { .. }
            | Op::LayerNormBwd { .. }
            | Op::GeluBwd { .. }
            | Op::Softmax { .. }
            | Op::SoftmaxBwd { .. }
            | Op::Attention { .. }
            | Op::AttentionBwd { .. }
            | Op::Matmul { .. }
            | Op::Round { .. }
            | Op::ColumnSums { .. }
            | Op::Copy { .. }
            | Op::Amax { .. }
            | Op::UnscaleCheck { .. }
            | Op::AdamW { .. } => None,
        }
    }

    /// The op with every tensor id `t` it names replaced by `to(t)`.
    pub fn map_tensors(&self, mut to: impl FnMut(TensorId) -> TensorId) -> Op {
        let mut op = self.clone();
        for t in op.tensors_mut() {
            *t = to(*t);
        }
        op
    }

    /// Every tensor id the op names.
    fn tensors_mut(&mut self) -> Vec<&mut TensorId> {
        match self {
            Op::Embedding {
                table, ids, out, ..
            } => vec![table, ids, out],
            Op::EmbeddingBwd { dout, ids, out, .. } => vec![dout, ids, out],
            Op::LayerNorm {
                x,
                g,
                b,
                out,
                stats,
                ..
            } => vec![x, g, b, out, stats],
            Op::LayerNormBwd {
                dy,
                x,
                g,
                stats,
                dx,
                dg,
                db,
                ..
            } => vec![dy, x, g, stats, dx, dg, db],
            Op::Gelu { x, out, .. } => vec![x, out],
            Op::GeluBwd { x, dy, out } => vec![x, dy, out],
            Op::Softmax { x, out, .. } => vec![x, out],
            Op::SoftmaxBwd { p, dp, out, .. } => vec![p, dp, out],
            Op::Attention {
                qkv, out, stats, ..
            } => vec![qkv, out, stats],
            Op::AttentionBwd {
                qkv,
                dout,
                stats,
                delta,
                dqkv,
                ..
            } => vec![qkv, dout, stats, delta, dqkv],
            Op::CrossEntropy {
                logits,
                targets,
                grad,
                ..
            } => vec![logits, targets, grad],
            Op::Matmul { a, b, out, .. } => vec![a, b, out],
            Op::Round { x, .. } => vec![x],
            Op::Add {
                x,
                y,
                out,
                residual,
                gelu,
                ..
            } => {
                let mut t = vec![x, y, out];
                t.extend(residual.as_mut().map(|(r, _)| r));
                t.extend(gelu.as_mut().map(|(g, _)| g));
                t
            }
            Op::ColumnSums { x, out, .. } => vec![x, out],
            Op::Copy { x, out, .. } => vec![x, out],
            Op::Amax { x, .. } => vec![x],
            Op::UnscaleCheck { grad, .. } => vec![grad],
            Op::AdamW {
                param, grad, m, v, ..
            } => vec![param, grad, m, v],
        }
    }

    /// y += x in f32, x repeated over y when shorter (`PlanBuilder::round` may then give it a
    /// format to hold y in).
    pub fn add_in_place(x: TensorId, y: TensorId) -> Op {
        Op::Add {
            x,
            y,
            out: y,
            held: Format::F32,
            y_held: Format::F32,
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
            Op::Gelu { .. } => "gelu",
            Op::GeluBwd { .. } => "gelu backward",
            Op::Softmax { .. } => "causal softmax",
            Op::SoftmaxBwd { .. } => "causal softmax backward",
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
            | Op::Gelu { .. }
            | Op::GeluBwd { .. }
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
    /// The tensors the op reads and the ones it writes (a tensor updated in place is in both).
    pub fn reads_writes(&self) -> (Vec<TensorId>, Vec<TensorId>) {
        match *self {
            Op::Embedding {
                table, ids, out, ..
            } => (vec![table, ids], vec![out]),
            Op::EmbeddingBwd { dout, ids, out, .. } => (vec![dout, ids], vec![out]),
            Op::LayerNorm {
                x,
                g,
                b,
                out,
                stats,
                ..
            } => (vec![x, g, b], vec![out, stats]),
            Op::LayerNormBwd {
                dy,
                x,
                g,
                stats,
                dx,
                dg,
                db,
                ..
            } => (vec![dy, x, g, stats], vec![dx, dg, db]),
            Op::Gelu { x, out, .. } => (vec![x], vec![out]),
            Op::GeluBwd { x, dy, out } => (vec![x, dy], vec![out]),
            Op::Softmax { x, out, .. } => (vec![x], vec![out]),
            Op::SoftmaxBwd { p, dp, out, .. } => (vec![p, dp], vec![out]),
            Op::Attention {
                qkv, out, stats, ..
            } => (vec![qkv], vec![out, stats]),
            Op::AttentionBwd {
                qkv,
                dout,
                stats,
                delta,
                dqkv,
                ..
            } => (vec![qkv, dout, stats], vec![delta, dqkv]),
            Op::CrossEntropy {
                logits,
                targets,
                grad,
                ..
            } => (vec![logits, targets], vec![grad]),
            Op::Matmul { a, b, out, .. } => (vec![a, b], vec![out]),
            Op::Round { x, .. } => (vec![x], vec![x]),
            Op::Add {
                x,
                y,
                out,
                residual,
                gelu,
                ..
            } => {
                let mut reads = vec![x, y];
                reads.extend(residual.map(|(r, _)| r));
                let mut writes = vec![out];
                writes.extend(gelu.map(|(g, _)| g));
                (reads, writes)
            }
            Op::ColumnSums { x, out, .. } => (vec![x], vec![out]),
            Op::Copy { x, out, .. } => (vec![x], vec![out]),
            Op::Amax { x, .. } => (vec![x], vec![]),
            Op::UnscaleCheck { grad, .. } => (vec![grad], vec![grad]),
            Op::AdamW {
                param, grad, m, v, ..
            } => (vec![param, grad, m, v], vec![param, m, v]),
        }
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
