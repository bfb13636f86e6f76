//! The step program: one step of a model (forward, backward, optimizer update) as a list of
//! ops on numbered tensors, built once per (model, precision, batch shape) and run by an
//! executor (`exec::StepExecutor`): the host interpreter (`backend::reference::interp`, a
//! backend's ops one round trip at a time) or a device executor that keeps every tensor
//! resident and replays the step as one submission (`backend::wgpu::plan`,
//! `backend::cuda::plan`).
//!
//! This layer sits below the backends and above the algorithms and formats: it names what a
//! step computes, never how a device computes it, and imports nothing from `backend` or `train`.
//!
//! - `mod.rs`: tensors, ops, sections, stats slots, storage sharing
//! - `scalar.rs`: the scalar slots the host writes before a step (AdamW, loss scale, fp8 scales)
//! - `exec.rs`: the executor contract every backend's executor implements
//!
//! What changes from step to step enters through two small arrays: `scalar` slots the host
//! writes before a step (loss scale, AdamW bias corrections, fp8 scales) and `Stats` slots the
//! device writes during it (loss, finite flags, squared gradient norms, fp8 amaxes), the only
//! thing read back.

pub mod exec;
pub mod graph;
pub mod scalar;

pub use exec::StepExecutor;
pub use scalar::AdamW;

use crate::algorithm::{Algorithm, MatmulShape};
use crate::error::Result;
use crate::format::{Format, Overflow};

/// A tensor of the plan (an index into `Plan::tensors`).
pub type TensorId = usize;

/// What a tensor holds, and so how long it lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorKind {
    /// Trained state, kept across steps: parameter i, its AdamW moments, its gradient.
    Param(usize),
    Moment1(usize),
    Moment2(usize),
    Grad(usize),
    /// The step's token ids and targets (u32 ids as f32 bit patterns).
    Tokens,
    Targets,
    /// Fixed when the plan is built (`Plan::constants`).
    Constant,
    /// A part of a gradient that a data-parallel step sums over its ranks before adding it in
    /// (`Plan::split_for_ranks`): kept between the step's two runs.
    Partial,
    /// Produced and consumed within a step.
    Temp,
}

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub len: usize,
    pub kind: TensorKind,
    /// What a device stores per element: f32, or the 16-bit codes of bf16 or f16 (two to a
    /// 4-byte word, the even element in the low half) for a tensor `Plan::store_codes` chose.
    /// Every executor reads and writes it as f32 values; a coded tensor's are its codes' values.
    pub stored: Format,
}

impl TensorInfo {
    /// 4-byte words of the tensor's storage.
    pub fn words(&self) -> usize {
        if self.stored.storage_bytes() == 2 {
            self.len.div_ceil(2)
        } else {
            self.len
        }
    }

    pub fn bytes(&self) -> u64 {
        self.words() as u64 * 4
    }

    /// `values` as the device stores them (a coded tensor's values rounded to its format, as
    /// its kernels round them when they store).
    pub fn to_words(&self, values: &[f32]) -> Vec<u32> {
        if self.stored.storage_bytes() != 2 {
            return values.iter().map(|x| x.to_bits()).collect();
        }
        let code = |x: Option<&f32>| x.map_or(0, |&x| self.stored.encode(x, Overflow::Standard));
        values
            .chunks(2)
            .map(|pair| code(pair.first()) | code(pair.get(1)) << 16)
            .collect()
    }

    /// The values of stored words (`to_words`' inverse).
    pub fn from_words(&self, words: &[u32]) -> Vec<f32> {
        if self.stored.storage_bytes() != 2 {
            return words.iter().map(|&w| f32::from_bits(w)).collect();
        }
        (0..self.len)
            .map(|e| self.stored.decode(words[e / 2] >> (16 * (e % 2)) & 0xffff))
            .collect()
    }
}

/// A strided copy over a 4-d index space (the attention head permutations): element
/// (i0, i1, i2, i3) < dims moves from `src_offset + sum(i * src)` to `dst_offset + sum(i * dst)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    pub dims: [u32; 4],
    pub src: [u32; 4],
    pub dst: [u32; 4],
    pub src_offset: u32,
    pub dst_offset: u32,
}

impl Strided {
    pub fn len(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row-major strides of `dims`.
    pub fn dense(dims: [u32; 4]) -> [u32; 4] {
        [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
    }

    /// The source and destination index of element `e` (row-major over `dims`).
    pub fn indices(&self, e: usize) -> (usize, usize) {
        let mut rest = e;
        let (mut s, mut d) = (self.src_offset as usize, self.dst_offset as usize);
        for axis in (0..4).rev() {
            let n = self.dims[axis] as usize;
            let i = rest % n;
            rest /= n;
            s += i * self.src[axis] as usize;
            d += i * self.dst[axis] as usize;
        }
        (s, d)
    }

    /// (B, T, 3C) -> one of q, k, v as (B, H, T, D).
    pub fn split_head(part: usize, b: usize, t: usize, h: usize, d: usize) -> Strided {
        let (b, t, h, d, c) = (b as u32, t as u32, h as u32, d as u32, (h * d) as u32);
        let dims = [b, h, t, d];
        Strided {
            dims,
            src: [t * 3 * c, d, 3 * c, 1],
            dst: Strided::dense(dims),
            src_offset: part as u32 * c,
            dst_offset: 0,
        }
    }

    /// The inverse of `split_head`: q, k or v (B, H, T, D) into its third of (B, T, 3C).
    pub fn merge_head(part: usize, b: usize, t: usize, h: usize, d: usize) -> Strided {
        let s = Strided::split_head(part, b, t, h, d);
        Strided {
            src: s.dst,
            dst: s.src,
            src_offset: s.dst_offset,
            dst_offset: s.src_offset,
            ..s
        }
    }

    /// (B, H, T, D) -> (B, T, H * D).
    pub fn heads_to_rows(b: usize, t: usize, h: usize, d: usize) -> Strided {
        let (b, t, h, d) = (b as u32, t as u32, h as u32, d as u32);
        let dims = [b, h, t, d];
        Strided {
            dims,
            src: Strided::dense(dims),
            dst: [t * h * d, d, h * d, 1],
            src_offset: 0,
            dst_offset: 0,
        }
    }

    /// (B, T, H * D) -> (B, H, T, D).
    pub fn rows_to_heads(b: usize, t: usize, h: usize, d: usize) -> Strided {
        let s = Strided::heads_to_rows(b, t, h, d);
        Strided {
            src: s.dst,
            dst: s.src,
            ..s
        }
    }

    /// The host copy.
    pub fn apply(&self, x: &[f32], out: &mut [f32]) {
        for e in 0..self.len() {
            let (s, d) = self.indices(e);
            out[d] = x[s];
        }
    }
}

/// How a softmax reads its scores: `scale * s`, the product in f32 and held in `held`, as
/// autocast holds a tensor times a scalar in the tensor's own format (`att / sqrt(d)` of a
/// 16-bit `att` stays 16-bit; CUDA multiplies by the scalar's f32 reciprocal). The backward
/// holds the softmax's gradient in `held`, then its product with the scale again.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScoreScale {
    pub scale: f64,
    pub held: Format,
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
    /// Causal softmax of `scale * x` (held as `ScoreScale` says) per row of t.
    Softmax {
        x: TensorId,
        out: TensorId,
        t: usize,
        scale: ScoreScale,
    },
    SoftmaxBwd {
        p: TensorId,
        dp: TensorId,
        out: TensorId,
        t: usize,
        scale: ScoreScale,
    },
    /// out (B, T, C) = causal self-attention of `qkv` (`Attention`); `stats` gets each score
    /// row's (max of z, sum of exp(z - max)), z the scaled scores (`Attention::score_scale`).
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
            _ => None,
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
            op => op.name().into(),
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

/// Where a plan's tensors live on a device: temporaries whose lives within a step do not
/// overlap share one buffer (a slot), so a step needs the memory of its widest point, not of
/// every intermediate at once. Everything else (trained state, tokens, constants, the logits the
/// host reads) keeps a buffer of its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Storage {
    /// The slot of each tensor.
    pub slot_of: Vec<usize>,
    /// 4-byte words of each slot (`TensorInfo::words` of its largest tensor).
    pub slots: Vec<usize>,
}

impl Storage {
    /// One slot per tensor (no sharing).
    pub fn separate(plan: &Plan) -> Storage {
        Storage {
            slot_of: (0..plan.tensors.len()).collect(),
            slots: plan.tensors.iter().map(TensorInfo::words).collect(),
        }
    }

    /// Bytes of all slots.
    pub fn bytes(&self) -> u64 {
        self.slots.iter().map(|&n| n as u64 * 4).sum()
    }

    /// For each op, the slots that hold nothing live while it runs: every tensor of such a
    /// slot is a temporary whose life (`Plan::temporary_lives`) lies wholly before or after
    /// the op. An op may use them for its own scratch (a matmul's operand planes): whatever
    /// it leaves there, the slot's next tensor is written whole before it is read.
    pub fn idle_slots(&self, plan: &Plan) -> Vec<Vec<usize>> {
        let lives = plan.temporary_lives();
        // Each slot's lives; None where a tensor that is no temporary holds it.
        let mut held: Vec<Option<Vec<(usize, usize)>>> = vec![Some(vec![]); self.slots.len()];
        for (t, &slot) in self.slot_of.iter().enumerate() {
            match (lives.get(t).copied().flatten(), held.get_mut(slot)) {
                (Some(life), Some(Some(slot_lives))) => slot_lives.push(life),
                (None, Some(slot)) => *slot = None,
                _ => {}
            }
        }
        (0..plan.ops.len())
            .map(|i| {
                (0..self.slots.len())
                    .filter(|&s| held[s].as_ref().is_some_and(|l| clear_of(l, (i, i))))
                    .collect()
            })
            .collect()
    }

    /// Temporaries share slots where their lives (first to last op using them, over the whole
    /// step: `Plan::temporary_lives`) are disjoint. A slot takes the size of its largest
    /// tensor, so which tensors share decides the bytes: of two assignments, the one with fewer
    /// bytes is kept (`assign_slots`).
    pub fn shared(plan: &Plan) -> Storage {
        let n = plan.tensors.len();
        let lives = plan.temporary_lives();
        let temps: Vec<(TensorId, (usize, usize))> = (0..n)
            .filter_map(|t| lives[t].map(|life| (t, life)))
            .collect();
        let words = |t: TensorId| plan.tensors[t].words();
        let by_time = assign_slots(&temps, words, |&(t, (first, _))| (first, 0, t));
        let by_size = assign_slots(&temps, words, |&(t, (first, _))| {
            (0, usize::MAX - words(t), first)
        });
        let total = |(sizes, _): &(Vec<usize>, Vec<usize>)| sizes.iter().sum::<usize>();
        let (temp_slots, slot_of_temp) = if total(&by_size) < total(&by_time) {
            by_size
        } else {
            by_time
        };
        let mut storage = Storage {
            slot_of: vec![usize::MAX; n],
            slots: temp_slots,
        };
        for (&(t, _), &slot) in temps.iter().zip(&slot_of_temp) {
            storage.slot_of[t] = slot;
        }
        for t in 0..n {
            if storage.slot_of[t] == usize::MAX {
                storage.slots.push(words(t));
                storage.slot_of[t] = storage.slots.len() - 1;
            }
        }
        storage
    }
}

/// Whether no life of `lives` (first to last op, inclusive) shares an op with `life`.
fn clear_of(lives: &[(usize, usize)], (first, last): (usize, usize)) -> bool {
    lives.iter().all(|&(a, b)| b < first || last < a)
}

/// Slots for temporaries `temps` (each with its life, first to last op), taken in the order of
/// `key`: each goes to a slot none of whose tensors' lives overlap its own, the smallest that
/// holds it (else the largest, which grows to it), or to a new slot. Returns each slot's words
/// and each temporary's slot, in the order of `temps`. In order of first use, slots are reused
/// as soon as they are free (the plan's order of ops); in order of size, largest first, each
/// slot's size is set by its first tensor and smaller ones fill the gaps between its lives
/// (the "greedy by size" of TensorFlow Lite's shared-object planner).
fn assign_slots<K: Ord>(
    temps: &[(TensorId, (usize, usize))],
    words: impl Fn(TensorId) -> usize,
    key: impl Fn(&(TensorId, (usize, usize))) -> K,
) -> (Vec<usize>, Vec<usize>) {
    let mut order: Vec<usize> = (0..temps.len()).collect();
    order.sort_by_key(|&i| key(&temps[i]));
    let mut sizes: Vec<usize> = Vec::new();
    let mut lives: Vec<Vec<(usize, usize)>> = Vec::new();
    let mut slot_of = vec![0; temps.len()];
    for i in order {
        let (t, (first, last)) = temps[i];
        let len = words(t);
        let free = |s: &usize| clear_of(&lives[*s], (first, last));
        let best = (0..sizes.len()).filter(free).min_by_key(|&s| {
            if sizes[s] >= len {
                (0, sizes[s])
            } else {
                (1, usize::MAX - sizes[s])
            }
        });
        let s = best.unwrap_or_else(|| {
            sizes.push(0);
            lives.push(Vec::new());
            sizes.len() - 1
        });
        sizes[s] = sizes[s].max(len);
        lives[s].push((first, last));
        slot_of[i] = s;
    }
    (sizes, slot_of)
}

/// The 16-bit format a matmul under `algorithm` rounds both its operands to, and so reads as
/// stored codes of (`Plan::store_codes`): bf16 for `Algorithm::Bf16`, f16 for `Algorithm::F16`,
/// None for every other algorithm.
pub fn codes_read_by(algorithm: &Algorithm) -> Option<Format> {
    match algorithm {
        Algorithm::Bf16 => Some(Format::Bf16),
        Algorithm::F16 => Some(Format::F16),
        _ => None,
    }
}

/// Checks that a matmul under `algorithm` can read operands stored as `stored` (each f32, or
/// the codes `codes_read_by` names): what every executor checks before it hands codes to a
/// GEMM.
pub fn check_stored_operands(
    algorithm: &Algorithm,
    stored: [Format; 2],
) -> crate::error::Result<()> {
    let readable = |f: Format| f == Format::F32 || Some(f) == codes_read_by(algorithm);
    if stored.iter().all(|&f| readable(f)) {
        return Ok(());
    }
    Err(crate::error::Error::invalid(
        "matmul operands",
        format!("{algorithm} does not read operands stored as {stored:?}"),
    ))
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

/// Where each statistic of a step lies in the stats array.
#[derive(Clone, Copy, Debug)]
pub struct Stats {
    /// Gradient tensors (parameters).
    pub grads: usize,
    /// fp8 linear layers with amax slots.
    pub linears: usize,
}

impl Stats {
    /// Sum of the rows' cross-entropy losses.
    pub const LOSS: usize = 0;
    /// 1 where gradient i holds inf or NaN, else 0.
    pub fn flag(&self, i: usize) -> usize {
        1 + i
    }
    /// Squared norm of (unscaled) gradient i.
    pub fn norm_sq(&self, i: usize) -> usize {
        1 + self.grads + i
    }
    /// amax of linear layer `layer`'s input (role 0), weight (1) or gradient (2).
    pub fn amax(&self, layer: usize, role: usize) -> usize {
        1 + 2 * self.grads + 3 * layer + role
    }
    pub fn len(&self) -> usize {
        1 + 2 * self.grads + 3 * self.linears
    }
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// Tensors of a data-parallel step's gradient sum that the backward pass has finished with
/// once it has run `ops[..ready]` (`Plan::gradient_buckets`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub ready: usize,
    pub ids: Vec<TensorId>,
}

/// Which ops of the plan a run executes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Section {
    /// The forward pass: loss (and logits).
    Forward,
    /// Forward and backward: this batch's (scaled) gradients, before the unscale. A
    /// data-parallel step sums them over the ranks here, then runs `Update`.
    Backward,
    /// Forward, backward, unscale and finite check: the gradients, no update.
    Gradients,
    /// The rest of a step after `Backward`: unscale, finite check and the optimizer update of
    /// the gradients as they are (its stats hold no loss or amax).
    Update,
    /// Forward, backward and the optimizer update.
    Step,
}

/// A built plan.
#[derive(Clone, Debug)]
pub struct Plan {
    pub tensors: Vec<TensorInfo>,
    pub ops: Vec<Op>,
    /// `ops[..forward]` is the forward pass, `ops[..backward]` goes on to the scaled gradients,
    /// `ops[..gradients]` to the unscaled, checked gradients.
    pub forward: usize,
    pub backward: usize,
    pub gradients: usize,
    /// Rows of the batch (tokens), the loss's denominator.
    pub rows: usize,
    pub tokens: TensorId,
    pub targets: TensorId,
    pub logits: TensorId,
    /// Per parameter: (parameter, gradient, first moment, second moment).
    pub state: Vec<[TensorId; 4]>,
    pub constants: Vec<(TensorId, Vec<f32>)>,
    pub stats: Stats,
}

impl Plan {
    pub fn scalar_count(&self) -> usize {
        scalar::FP8 + 3 * self.stats.linears
    }

    /// The indices of the ops a run of `section` executes.
    pub fn range_of(&self, section: Section) -> std::ops::Range<usize> {
        match section {
            Section::Forward => 0..self.forward,
            Section::Backward => 0..self.backward,
            Section::Gradients => 0..self.gradients,
            Section::Update => self.backward..self.ops.len(),
            Section::Step => 0..self.ops.len(),
        }
    }

    /// The first and last op using each temporary whose storage may be shared or freed between
    /// its uses (None for every other tensor): a temporary qualifies if the step writes it
    /// before reading it (its first op writes it whole, or strided copies cover it before its
    /// first read); one that would read a stale value (none in this model) keeps its storage.
    /// The logits stay too: the host reads them after the step.
    pub fn temporary_lives(&self) -> Vec<Option<(usize, usize)>> {
        let n = self.tensors.len();
        let (mut first, mut last) = (vec![usize::MAX; n], vec![0usize; n]);
        let mut written = vec![0usize; n];
        let mut shareable = vec![true; n];
        for (i, op) in self.ops.iter().enumerate() {
            let (reads, writes) = op.reads_writes();
            for &t in &reads {
                // Read before the step wrote it whole: it must keep its value between steps.
                if written[t] < self.tensors[t].len {
                    shareable[t] = false;
                }
            }
            for &t in reads.iter().chain(&writes) {
                first[t] = first[t].min(i);
                last[t] = i;
            }
            for &t in &writes {
                written[t] += match op {
                    Op::Copy { map, .. } => map.len(),
                    _ => self.tensors[t].len,
                };
            }
        }
        (0..n)
            .map(|t| {
                (self.tensors[t].kind == TensorKind::Temp
                    && t != self.logits
                    && shareable[t]
                    && first[t] != usize::MAX)
                    .then_some((first[t], last[t]))
            })
            .collect()
    }

    /// The ops a run of `section` executes.
    pub fn ops_of(&self, section: Section) -> &[Op] {
        &self.ops[self.range_of(section)]
    }

    /// Makes this plan a rank's plan of a data-parallel step, whose ranks sum their gradients
    /// between `Section::Backward` and `Section::Update`; returns the tensors to sum. Each
    /// gradient's first write (a matmul's dW, a column sum's db) stays in the backward pass;
    /// what finishes it (its roundings, and the additions of further parts, such as the token
    /// embedding's scatter into the tied head's gradient) moves to the start of the update, and
    /// the added parts are summed with the gradients. The ranks then round their sums once, as
    /// one rank rounds its one product, so the step is the one-rank step up to the order of f32
    /// additions (PyTorch's DDP instead sums gradients already rounded per rank). A gradient
    /// finished in any other way keeps its ops where they are and is summed as it is.
    pub fn split_for_ranks(&mut self) -> Vec<TensorId> {
        let backward = &self.ops[..self.backward];
        let mut first = vec![usize::MAX; self.tensors.len()];
        for (i, op) in backward.iter().enumerate() {
            for w in op.reads_writes().1 {
                first[w] = first[w].min(i);
            }
        }
        let is_grad = |t: TensorId| matches!(self.tensors[t].kind, TensorKind::Grad(_));
        // The ops that finish gradient g after its first write, if all are movable.
        let mut finishing = vec![false; backward.len()];
        let mut parts = vec![];
        for g in (0..self.tensors.len()).filter(|&g| is_grad(g) && first[g] != usize::MAX) {
            let later: Vec<usize> = (first[g] + 1..backward.len())
                .filter(|&i| backward[i].reads_writes().1.contains(&g))
                .collect();
            let movable = later.iter().all(|&i| match backward[i] {
                Op::Round { .. } => true,
                // A part added in: a temporary no later op of the pass touches.
                Op::Add {
                    x,
                    y,
                    out,
                    residual: None,
                    gelu: None,
                    ..
                } => {
                    y == g
                        && out == g
                        && self.tensors[x].kind == TensorKind::Temp
                        && backward[i + 1..]
                            .iter()
                            .all(|op| !op.reads_writes().0.contains(&x))
                }
                _ => false,
            });
            if movable {
                for &i in &later {
                    finishing[i] = true;
                    if let Op::Add { x, .. } = backward[i] {
                        parts.push(x);
                    }
                }
            }
        }
        let (mut kept, mut moved) = (vec![], vec![]);
        for (i, op) in self.ops.drain(..self.backward).enumerate() {
            if finishing[i] {
                moved.push(op)
            } else {
                kept.push(op)
            }
        }
        self.backward = kept.len();
        self.ops.splice(0..0, kept.into_iter().chain(moved));
        for &x in &parts {
            self.tensors[x].kind = TensorKind::Partial;
        }
        let mut sum: Vec<TensorId> = self.state.iter().map(|s| s[1]).collect();
        sum.extend(parts);
        sum
    }

    /// Groups `ids` (the tensors a data-parallel step sums, `split_for_ranks`) into buckets of
    /// at most `elements` values, in the order the backward pass finishes with them: a tensor
    /// is ready after the last op of `Section::Backward` that reads or writes it, a bucket
    /// after its last member. The buckets come in increasing `ready`, each id in exactly one;
    /// a tensor larger than `elements` is a bucket of its own. A step may sum bucket i over the
    /// ranks, and write the sum back, while the pass runs on from `ready` (as PyTorch's DDP
    /// launches a bucket's all-reduce once its gradients are ready): no later op of the pass
    /// touches its members.
    pub fn gradient_buckets(&self, ids: &[TensorId], elements: usize) -> Result<Vec<Bucket>> {
        let mut ready = vec![0; self.tensors.len()];
        for (i, op) in self.ops[..self.backward].iter().enumerate() {
            let (reads, writes) = op.reads_writes();
            for t in reads.into_iter().chain(writes) {
                ready[t] = i + 1;
            }
        }
        let mut order = Vec::with_capacity(ids.len());
        for &id in ids {
            exec::tensor_len(self, id)?;
            order.push((ready[id], id));
        }
        // Stable: tensors ready after the same op keep the caller's order.
        order.sort_by_key(|&(r, _)| r);
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut size = 0;
        for (r, id) in order {
            let len = self.tensors[id].len;
            match buckets.last_mut() {
                Some(b) if size + len <= elements.max(1) => {
                    b.ids.push(id);
                    b.ready = r;
                    size += len;
                }
                _ => {
                    buckets.push(Bucket {
                        ready: r,
                        ids: vec![id],
                    });
                    size = len;
                }
            }
        }
        Ok(buckets)
    }

    /// Stores as 16-bit codes (`TensorInfo::stored`) the pre-GELU activations and fused
    /// attention's q|k|v that a bias add holds in bf16 or f16 (`store_bias_adds_as_codes`), and
    /// each temporary written by one layer norm, GELU (a bias add's included) or fused
    /// attention and read only by matmuls that round it to bf16, or only by
    /// matmuls that round it to f16 (`Algorithm::Bf16`, `Algorithm::F16`): its writer rounds
    /// it as it stores (a layer norm's or GELU's `held` becomes that format; attention must
    /// hold its output in it already), so the matmuls read the values they would have rounded
    /// from half the bytes, and need not encode them. The writer must hold its output in f32 or
    /// in that same format (one rounding either way). A layer norm's rows, and attention's
    /// heads, must be of even width, so that no 4-byte word spans two of them (wgpu stores
    /// each one's words whole). Returns the tensors so stored.
    pub fn store_codes(&mut self) -> Vec<TensorId> {
        let n = self.tensors.len();
        let (mut writers, mut readers) = (vec![vec![]; n], vec![vec![]; n]);
        for (i, op) in self.ops.iter().enumerate() {
            let (reads, writes) = op.reads_writes();
            for t in reads {
                readers[t].push(i);
            }
            for t in writes {
                writers[t].push(i);
            }
        }
        let rounds_to = |op: &Op| match op {
            Op::Matmul {
                algorithm,
                scales: None,
                ..
            } => codes_read_by(algorithm),
            _ => None,
        };
        let mut coded = vec![];
        for t in 0..n {
            if self.tensors[t].kind != TensorKind::Temp || t == self.logits {
                continue;
            }
            let [w] = writers[t][..] else { continue };
            let Some(&first) = readers[t].first() else {
                continue;
            };
            let Some(format) = rounds_to(&self.ops[first]) else {
                continue;
            };
            if !readers[t]
                .iter()
                .all(|&i| rounds_to(&self.ops[i]) == Some(format))
            {
                continue;
            }
            let one_rounding = |held: Format| held == Format::F32 || held == format;
            match &mut self.ops[w] {
                Op::LayerNorm { out, held, c, .. }
                    if *out == t && *c % 2 == 0 && one_rounding(*held) =>
                {
                    *held = format
                }
                Op::Gelu { out, held, .. }
                | Op::Add {
                    gelu: Some((out, held)),
                    ..
                } if *out == t && one_rounding(*held) => *held = format,
                // Fused attention holds its output in `compute` already; heads of even width
                // keep each word within one head's row.
                Op::Attention { out, spec, .. }
                    if *out == t && spec.compute == format && spec.d % 2 == 0 => {}
                _ => continue,
            }
            self.tensors[t].stored = format;
            coded.push(t);
        }
        coded.extend(self.store_bias_adds_as_codes());
        coded
    }

    /// The second rule of `store_codes`: a temporary y that an in-place bias add holding bf16
    /// or f16 writes last, and that after it only ops that decode codes read (GELU and its
    /// backward: the MLP's pre-GELU activations; fused attention forward and backward: the
    /// q|k|v projection; all held until the backward pass), gets a coded twin: the add writes
    /// its output as codes into a new temporary, which those readers read instead, while y,
    /// the matmul's f32 product the add reads, dies at the add. The values are the add's held
    /// values either way. Returns the new tensors.
    fn store_bias_adds_as_codes(&mut self) -> Vec<TensorId> {
        let mut coded = vec![];
        for a in 0..self.ops.len() {
            let Op::Add {
                y,
                out,
                held,
                residual: None,
                ..
            } = self.ops[a]
            else {
                continue;
            };
            let candidate = out == y
                && matches!(held, Format::Bf16 | Format::F16)
                && self.tensors[y].kind == TensorKind::Temp
                && self.tensors[y].stored == Format::F32
                && y != self.logits;
            if !candidate {
                continue;
            }
            let later = &self.ops[a + 1..];
            // Every later op reads y, if at all, as its input that may be coded, and touches
            // it no other way.
            let decodes = |op: &Op| {
                let (reads, writes) = op.reads_writes();
                let as_coded = (op.coded_input() == Some(y)) as usize;
                reads.iter().filter(|&&t| t == y).count() == as_coded && !writes.contains(&y)
            };
            let read_later = later.iter().any(|op| op.reads_writes().0.contains(&y));
            if !read_later || !later.iter().all(decodes) {
                continue;
            }
            let twin = self.tensors.len();
            self.tensors.push(TensorInfo {
                len: self.tensors[y].len,
                kind: TensorKind::Temp,
                stored: held,
            });
            if let Op::Add { out, .. } = &mut self.ops[a] {
                *out = twin;
            }
            for op in &mut self.ops[a + 1..] {
                if let Op::Gelu { x, .. }
                | Op::GeluBwd { x, .. }
                | Op::Attention { qkv: x, .. }
                | Op::AttentionBwd { qkv: x, .. } = op
                    && *x == y
                {
                    *x = twin;
                }
            }
            debug_assert!(
                self.ops[a + 1..]
                    .iter()
                    .all(|op| !op.reads_writes().0.contains(&y))
            );
            coded.push(twin);
        }
        coded
    }

    /// How many tensors the plan stores as 16-bit codes (`store_codes`).
    pub fn coded_tensors(&self) -> usize {
        let coded = self.tensors.iter().filter(|t| t.stored != Format::F32);
        coded.count()
    }

    /// The plan's tensors as an executor's description gives them: their bytes in `storage`,
    /// unshared, and how many are stored as 16-bit codes.
    pub fn describe_tensors(&self, storage: &Storage) -> String {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        format!(
            "{:.1} MiB of tensors ({:.1} MiB unshared; {} stored as 16-bit codes)",
            mib(storage.bytes()),
            mib(self.tensor_bytes()),
            self.coded_tensors()
        )
    }

    /// Bytes of every tensor of the plan (device memory of a resident executor, temporaries of
    /// the kernels aside).
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorInfo::bytes).sum()
    }
}

/// Records a plan.
#[derive(Default)]
pub struct PlanBuilder {
    pub tensors: Vec<TensorInfo>,
    pub ops: Vec<Op>,
    pub constants: Vec<(TensorId, Vec<f32>)>,
}

impl PlanBuilder {
    pub fn tensor(&mut self, len: usize, kind: TensorKind) -> TensorId {
        self.tensors.push(TensorInfo {
            len,
            kind,
            stored: Format::F32,
        });
        self.tensors.len() - 1
    }

    pub fn temp(&mut self, len: usize) -> TensorId {
        self.tensor(len, TensorKind::Temp)
    }

    pub fn constant(&mut self, values: Vec<f32>) -> TensorId {
        let id = self.tensor(values.len(), TensorKind::Constant);
        self.constants.push((id, values));
        id
    }

    pub fn len(&self, id: TensorId) -> usize {
        self.tensors[id].len
    }

    /// Records `op`, folding it into the op before where one pass does both with the same
    /// values: an add into y right after y's rounding rounds y as it reads it (`Op::Add`'s
    /// `y_held`); an add of r into y in place right after an in-place add into y (a residual
    /// after a bias) becomes that add's `residual`; a GELU of an in-place add's output right
    /// after it becomes that add's `gelu`.
    pub fn push(&mut self, mut op: Op) {
        if let Op::Add { x, y, y_held, .. } = &mut op
            && *y_held == Format::F32
            && *x != *y
            && let Some(&Op::Round { x: rounded, format }) = self.ops.last()
            && rounded == *y
        {
            *y_held = format;
            self.ops.pop();
        }
        if let Op::Gelu { x, out, held } = op
            && x != out
            && let Some(Op::Add {
                y,
                out: sum,
                residual: None,
                gelu: gelu @ None,
                ..
            }) = self.ops.last_mut()
            // In place, as the model records a bias add (`Plan::store_codes` may then give it
            // a coded output of its own).
            && *sum == x
            && *y == x
        {
            *gelu = Some((out, held));
            return;
        }
        if let Op::Add {
            x: r,
            y,
            out,
            held: Format::F32,
            y_held: Format::F32,
            residual: None,
            gelu: None,
        } = op
            && out == y
            && r != y
            // Not a gradient: `Plan::split_for_ranks` moves its adds one by one.
            && !matches!(self.tensors.get(y).map(|t| t.kind), Some(TensorKind::Grad(_)))
            && let Some(Op::Add {
                y: before,
                out: written,
                residual: residual @ None,
                gelu: None,
                ..
            }) = self.ops.last_mut()
            && *before == y
            && *written == y
        {
            *residual = Some((r, Format::F32));
            return;
        }
        self.ops.push(op);
    }

    /// Rounds x to `format` in place (nothing for f32): the op just pushed holds its output in
    /// `format` where it wrote x and can (a layer norm, GELU, an add, the cross entropy's
    /// gradient: one pass over x instead of two), else a `Round` op follows.
    pub fn round(&mut self, x: TensorId, format: Format) {
        if format == Format::F32 {
            return;
        }
        match self.ops.last_mut() {
            // An add with a residual holds its last sum in the residual's format; one with a
            // GELU holds the GELU in its own.
            Some(Op::Add {
                out,
                residual: Some((_, held)),
                ..
            })
            | Some(Op::Add {
                gelu: Some((out, held)),
                ..
            })
            | Some(
                Op::LayerNorm { out, held, .. }
                | Op::Gelu { out, held, .. }
                | Op::Add { out, held, .. }
                | Op::CrossEntropy {
                    grad: out, held, ..
                },
            ) if *out == x && *held == Format::F32 => *held = format,
            _ => self.push(Op::Round { x, format }),
        }
    }
}

#[cfg(test)]
impl PlanBuilder {
    /// The plan of the ops pushed, for tests: the forward pass up to op `forward`, the
    /// backward pass and the gradients up to `backward`; no trained state.
    pub(crate) fn test_plan(
        self,
        (forward, backward): (usize, usize),
        rows: usize,
        [tokens, targets, logits]: [TensorId; 3],
        linears: usize,
    ) -> Plan {
        Plan {
            tensors: self.tensors,
            ops: self.ops,
            forward,
            backward,
            gradients: backward,
            rows,
            tokens,
            targets,
            logits,
            state: vec![],
            constants: self.constants,
            stats: Stats { grads: 0, linears },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer norm of width `c` (output held in `held`) read by a matmul under `algorithm`,
    /// and by `extra` if given: (plan, the norm's output).
    fn norm_then_matmul(
        c: usize,
        held: Format,
        algorithm: Algorithm,
        extra: bool,
    ) -> (Plan, TensorId) {
        let mut g = PlanBuilder::default();
        let rows = 3;
        let x = g.tensor(rows * c, TensorKind::Tokens);
        let (gain, bias) = (g.constant(vec![1.0; c]), g.constant(vec![0.0; c]));
        let (out, stats, w) = (
            g.temp(rows * c),
            g.temp(2 * rows),
            g.constant(vec![0.5; c * 2]),
        );
        let y = g.temp(rows * 2);
        g.push(Op::LayerNorm {
            x,
            g: gain,
            b: bias,
            out,
            stats,
            c,
            held,
        });
        let shape = MatmulShape::new(rows, 2, c);
        g.push(Op::Matmul {
            shape,
            algorithm,
            a: out,
            b: w,
            out: y,
            scales: None,
        });
        if extra {
            g.push(Op::Amax { x: out, slot: 0 });
        }
        let plan = g.test_plan((0, 0), rows, [x, x, y], 1);
        (plan, out)
    }

    #[test]
    fn codes_only_where_every_reader_rounds_to_them() {
        let (f32_, bf16, f16) = (Format::F32, Format::Bf16, Format::F16);
        for (c, held, algorithm, extra, coded) in [
            (4, f32_, Algorithm::Bf16, false, Some(bf16)),
            (4, f16, Algorithm::F16, false, Some(f16)),
            // Held in f16, read as bf16: two roundings, not one.
            (4, f16, Algorithm::Bf16, false, None),
            (4, f32_, Algorithm::F32, false, None),
            (4, f32_, Algorithm::Tf32, false, None),
            (4, f32_, Algorithm::Bf16x3, false, None),
            // A reader other than a matmul reads f32.
            (4, f32_, Algorithm::Bf16, true, None),
            // Rows of odd width would share words.
            (5, f32_, Algorithm::Bf16, false, None),
        ] {
            let (mut plan, out) = norm_then_matmul(c, held, algorithm, extra);
            let bytes = Storage::shared(&plan).bytes();
            let stored = plan.store_codes();
            let case = format!("width {c}, held {held}, read by {algorithm}, extra reader {extra}");
            match coded {
                Some(format) => {
                    assert_eq!(stored, vec![out], "{case}");
                    assert_eq!(plan.tensors[out].stored, format, "{case}");
                    assert!(matches!(plan.ops[0], Op::LayerNorm { held, .. } if held == format));
                    assert_eq!(
                        Storage::shared(&plan).bytes(),
                        bytes - 3 * c as u64 * 2,
                        "{case}"
                    );
                }
                None => {
                    assert!(stored.is_empty(), "{case}");
                    assert!(matches!(plan.ops[0], Op::LayerNorm { held: h, .. } if h == held));
                }
            }
        }
    }

    /// A matmul's product y, a bias added into it in place (held in `held`), then GELU (folded
    /// into the add: it writes the activation, tensor 4, too) and its backward reading y, and
    /// `extra` besides (a reader or writer of y that does not decode codes). y is tensor 3, the
    /// add op 1.
    fn bias_add_then_gelu(held: Format, extra: Option<fn(TensorId, TensorId) -> Op>) -> Plan {
        let mut g = PlanBuilder::default();
        let (rows, c) = (3, 4);
        let x = g.tensor(rows * c, TensorKind::Tokens);
        let (w, bias) = (g.constant(vec![0.5; c * c]), g.constant(vec![0.1; c]));
        let (y, act, dx) = (g.temp(rows * c), g.temp(rows * c), g.temp(rows * c));
        g.push(Op::Matmul {
            shape: MatmulShape::new(rows, c, c),
            algorithm: Algorithm::Bf16,
            a: x,
            b: w,
            out: y,
            scales: None,
        });
        g.push(Op::add_in_place(bias, y));
        g.round(y, held);
        g.push(Op::Gelu {
            x: y,
            out: act,
            held,
        });
        assert!(matches!(
            g.ops[..],
            [_, Op::Add { gelu: Some((a, h)), .. }] if a == act && h == held
        ));
        if let Some(extra) = extra {
            g.push(extra(y, dx));
        }
        g.push(Op::GeluBwd {
            x: y,
            dy: act,
            out: dx,
        });
        let ops = g.ops.len();
        g.test_plan((2, ops), rows, [x, x, dx], 0)
    }

    #[test]
    fn pre_gelu_codes_only_where_only_gelu_reads_them() {
        let amax: fn(TensorId, TensorId) -> Op = |y, _| Op::Amax { x: y, slot: 0 };
        let overwrite: fn(TensorId, TensorId) -> Op = |y, _| Op::Round {
            x: y,
            format: Format::F16,
        };
        for (held, extra, coded) in [
            (Format::Bf16, None, true),
            (Format::F16, None, true),
            // Not rounded: codes would not hold the values.
            (Format::F32, None, false),
            (Format::Bf16, Some(amax), false),
            (Format::Bf16, Some(overwrite), false),
        ] {
            let mut plan = bias_add_then_gelu(held, extra);
            let y = 3;
            let bytes = Storage::shared(&plan).bytes();
            let stored = plan.store_codes();
            let case = format!("held {held}, extra op {}", extra.is_some());
            if !coded {
                assert!(stored.is_empty(), "{case}: {stored:?}");
                assert!(
                    matches!(plan.ops[1], Op::Add { out, .. } if out == y),
                    "{case}"
                );
                continue;
            }
            let twin = plan.tensors.len() - 1;
            assert_eq!(stored, vec![twin], "{case}");
            assert_eq!(plan.tensors[twin].stored, held, "{case}");
            assert!(matches!(
                plan.ops[1],
                Op::Add { y: from, out, gelu: Some((4, _)), .. } if from == y && out == twin
            ));
            assert!(
                matches!(plan.ops[2], Op::GeluBwd { x, .. } if x == twin),
                "{case}"
            );
            // y lives from the matmul to the add alone now; its twin adds at most its own
            // bytes, half of y's.
            assert_eq!(plan.temporary_lives()[y], Some((0, 1)), "{case}");
            assert!(Storage::shared(&plan).bytes() <= bytes + 12 * 2, "{case}");
        }
    }

    #[test]
    fn an_add_right_after_its_input_s_rounding_rounds_it_as_it_reads() {
        let (bf16, f16) = (Format::Bf16, Format::F16);
        let mut g = PlanBuilder::default();
        let (bias, y, other) = (g.temp(4), g.temp(16), g.temp(16));
        g.push(Op::Round { x: y, format: bf16 });
        g.push(Op::add_in_place(bias, y));
        g.round(y, f16);
        assert!(matches!(
            g.ops[..],
            [Op::Add {
                x,
                y: read,
                out,
                held,
                y_held,
                residual: None,
                gelu: None,
            }] if x == bias && read == y && out == y && held == f16 && y_held == bf16
        ));
        // Not after another tensor's rounding, nor the sum of a tensor with itself.
        for (rounded, x) in [(other, bias), (y, y)] {
            let mut g = PlanBuilder::default();
            for len in [4, 16, 16] {
                g.temp(len);
            }
            g.push(Op::Round {
                x: rounded,
                format: bf16,
            });
            g.push(Op::add_in_place(x, y));
            assert!(
                matches!(g.ops[..], [Op::Round { .. }, Op::Add { y_held, .. }] if y_held == Format::F32)
            );
        }
    }

    #[test]
    fn a_residual_after_a_bias_is_one_add() {
        let (bf16, f32_) = (Format::Bf16, Format::F32);
        let mut g = PlanBuilder::default();
        let (bias, y, r) = (g.temp(4), g.temp(16), g.temp(16));
        g.push(Op::add_in_place(bias, y));
        g.round(y, bf16);
        g.push(Op::add_in_place(r, y));
        g.round(y, Format::F16);
        let [op] = &g.ops[..] else {
            panic!("{:?}", g.ops)
        };
        assert!(matches!(
            *op,
            Op::Add {
                x,
                held,
                residual: Some((res, Format::F16)),
                ..
            } if x == bias && held == bf16 && res == r
        ));
        assert_eq!(op.reads_writes(), (vec![bias, y, r], vec![y]));
        // Not into a gradient (`split_for_ranks` moves its adds one by one), nor after an add
        // that was not in place or already took a residual.
        let mut g = PlanBuilder::default();
        let (bias, dw, r) = (g.temp(4), g.tensor(16, TensorKind::Grad(0)), g.temp(16));
        g.push(Op::add_in_place(bias, dw));
        g.push(Op::add_in_place(r, dw));
        assert_eq!(g.ops.len(), 2);
        let mut g = PlanBuilder::default();
        let (bias, y, out, r) = (g.temp(4), g.temp(16), g.temp(16), g.temp(16));
        g.push(Op::Add {
            x: bias,
            y,
            out,
            held: f32_,
            y_held: f32_,
            residual: None,
            gelu: None,
        });
        g.push(Op::add_in_place(r, y));
        g.push(Op::add_in_place(bias, out));
        g.push(Op::add_in_place(r, out));
        g.push(Op::add_in_place(r, out));
        assert_eq!(g.ops.len(), 4, "{:?}", g.ops);
    }

    #[test]
    fn a_gelu_right_after_its_bias_add_is_that_add_s() {
        let (bf16, f16) = (Format::Bf16, Format::F16);
        let mut g = PlanBuilder::default();
        let (bias, y, act, r) = (g.temp(4), g.temp(16), g.temp(16), g.temp(16));
        g.push(Op::add_in_place(bias, y));
        g.round(y, bf16);
        g.push(Op::Gelu {
            x: y,
            out: act,
            held: Format::F32,
        });
        g.round(act, f16);
        let [op] = &g.ops[..] else {
            panic!("{:?}", g.ops)
        };
        assert!(matches!(
            *op,
            Op::Add { out, held, gelu: Some((a, f)), .. } if out == y && held == bf16 && a == act && f == f16
        ));
        assert_eq!(op.reads_writes(), (vec![bias, y], vec![y, act]));
        // A residual after it stays an add of its own (an add takes a GELU or a residual).
        g.push(Op::add_in_place(r, y));
        assert_eq!(g.ops.len(), 2, "{:?}", g.ops);
        // Not after an add with a residual, nor one into a tensor of its own, nor of another
        // tensor than the add wrote.
        let mut g = PlanBuilder::default();
        let (bias, y, act, r) = (g.temp(4), g.temp(16), g.temp(16), g.temp(16));
        let gelu = |x| Op::Gelu {
            x,
            out: act,
            held: bf16,
        };
        g.push(Op::add_in_place(bias, y));
        g.push(Op::add_in_place(r, y));
        g.push(gelu(y));
        let out = g.temp(16);
        g.push(Op::Add {
            x: bias,
            y,
            out,
            held: bf16,
            y_held: Format::F32,
            residual: None,
            gelu: None,
        });
        g.push(gelu(out));
        g.push(Op::add_in_place(bias, r));
        g.push(gelu(y));
        assert_eq!(g.ops.len(), 6, "{:?}", g.ops);
        assert!(
            g.ops
                .iter()
                .all(|op| !matches!(op, Op::Add { gelu: Some(_), .. }))
        );
    }

    #[test]
    fn executors_refuse_codes_their_matmul_would_not_read() {
        let (f32_, bf16, f16) = (Format::F32, Format::Bf16, Format::F16);
        assert!(check_stored_operands(&Algorithm::Bf16, [bf16, f32_]).is_ok());
        assert!(check_stored_operands(&Algorithm::F16, [f32_, f16]).is_ok());
        assert!(check_stored_operands(&Algorithm::F32, [f32_, f32_]).is_ok());
        for (algorithm, stored) in [
            (Algorithm::Bf16, [f16, f32_]),
            (Algorithm::F16, [f32_, bf16]),
            (Algorithm::F32, [bf16, f32_]),
            (Algorithm::Bf16x3, [bf16, bf16]),
        ] {
            let err = check_stored_operands(&algorithm, stored)
                .unwrap_err()
                .to_string();
            assert!(err.contains("does not read operands stored as"), "{err}");
        }
    }

    #[test]
    fn coded_words_round_trip_and_pack_two_codes() {
        let info = |len, stored| TensorInfo {
            len,
            kind: TensorKind::Temp,
            stored,
        };
        let values = [1.0f32, -2.5, 3.0e-3, f32::INFINITY, 65504.0];
        for format in [Format::Bf16, Format::F16] {
            let t = info(values.len(), format);
            let words = t.to_words(&values);
            assert_eq!((words.len(), t.words(), t.bytes()), (3, 3, 12));
            assert_eq!(words[0] & 0xffff, format.encode(1.0, Overflow::Standard));
            assert_eq!(words[0] >> 16, format.encode(-2.5, Overflow::Standard));
            let back = t.from_words(&words);
            let want: Vec<f32> = values
                .iter()
                .map(|&x| format.round(x, Overflow::Standard))
                .collect();
            assert_eq!(back, want, "{format}");
        }
        let t = info(values.len(), Format::F32);
        assert_eq!(t.from_words(&t.to_words(&values)), values);
        assert_eq!(t.bytes(), 20);
    }
}
