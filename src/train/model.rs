//! The char-level GPT (nanoGPT's shape): token + position embeddings, pre-LayerNorm blocks with
//! causal multi-head self-attention and a GELU MLP, a final LayerNorm, and a head tied to the
//! token embedding.
//!
//! `Gpt::plan` records one training step (forward, backward, unscale and check, AdamW) as a
//! `Plan` of ops on tensors, once per (model, precision, batch shape); an executor runs it on a
//! backend. Matmul-like ops use the algorithm the precision policy chose; autocast is emulated
//! by rounding each tensor to the format it would be held in (`Precision`).

use crate::algorithm::{Algorithm, MatmulShape};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::format::Format;
use crate::measure;
use crate::plan::scalar::{self, StepScalars};
use crate::plan::{
    AdamW, AdamWParam, Attention, Op, Outline, Plan, PlanBuilder, ScoreScale, Section, Stats,
    StepExecutor, Strided, TensorId, TensorKind,
};
use crate::policy::{Fp8Role, Precision};

/// Model and batch shape.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct GptConfig {
    pub name: String,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub block_size: usize,
    pub batch_size: usize,
    pub vocab_size: usize,
}

impl GptConfig {
    /// `tiny` (CI-sized) or `small` (nanoGPT shakespeare-char).
    pub fn named(name: &str, vocab_size: usize) -> Result<GptConfig> {
        let (n_layer, n_head, n_embd, block_size, batch_size) = match name {
            "tiny" => (2, 2, 64, 32, 16),
            "small" => (6, 6, 384, 256, 64),
            _ => {
                return Err(Error::UnknownName {
                    kind: "model config",
                    given: name.into(),
                    valid: vec!["tiny".into(), "small".into()],
                });
            }
        };
        Ok(GptConfig {
            name: name.into(),
            n_layer,
            n_head,
            n_embd,
            block_size,
            batch_size,
            vocab_size,
        })
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Names and shapes of every parameter, in order.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (c, v, t) = (self.n_embd, self.vocab_size, self.block_size);
        let mut s = vec![
            ("wte".to_string(), vec![v, c]),
            ("wpe".to_string(), vec![t, c]),
        ];
        for l in 0..self.n_layer {
            for (name, shape) in [
                ("ln1.g", vec![c]),
                ("ln1.b", vec![c]),
                ("attn.w", vec![c, 3 * c]),
                ("attn.b", vec![3 * c]),
                ("proj.w", vec![c, c]),
                ("proj.b", vec![c]),
                ("ln2.g", vec![c]),
                ("ln2.b", vec![c]),
                ("fc.w", vec![c, 4 * c]),
                ("fc.b", vec![4 * c]),
                ("fc2.w", vec![4 * c, c]),
                ("fc2.b", vec![c]),
            ] {
                s.push((format!("h{l}.{name}"), shape));
            }
        }
        s.push(("lnf.g".into(), vec![c]));
        s.push(("lnf.b".into(), vec![c]));
        s
    }

    pub fn parameter_count(&self) -> usize {
        self.parameter_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// nanoGPT's initialisation: N(0, 0.02) weights, residual projections scaled by
    /// 1/sqrt(2 n_layer), zero biases, unit LayerNorm gains.
    pub fn init(&self, seed: u64) -> Vec<Vec<f32>> {
        self.parameter_shapes()
            .iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let len: usize = shape.iter().product();
                if name.ends_with(".g") {
                    vec![1.0; len]
                } else if name.ends_with(".b") {
                    vec![0.0; len]
                } else {
                    let std = if name.ends_with("proj.w") || name.ends_with("fc2.w") {
                        0.02 / (2.0 * self.n_layer as f32).sqrt()
                    } else {
                        0.02
                    };
                    measure::normal(len, seed.wrapping_add(i as u64))
                        .into_iter()
                        .map(|x| x * std)
                        .collect()
                }
            })
            .collect()
    }

    /// Whether AdamW's weight decay applies (matrices and embeddings, as nanoGPT).
    pub fn decays(&self) -> Vec<bool> {
        self.parameter_shapes()
            .iter()
            .map(|(_, s)| s.len() == 2)
            .collect()
    }
}

/// Index of each parameter in the flat list.
const PER_LAYER: usize = 12;
fn layer_param(l: usize, offset: usize) -> usize {
    2 + l * PER_LAYER + offset
}
const LN1_G: usize = 0;
const LN1_B: usize = 1;
const ATTN_W: usize = 2;
const ATTN_B: usize = 3;
const PROJ_W: usize = 4;
const PROJ_B: usize = 5;
const LN2_G: usize = 6;
const LN2_B: usize = 7;
const FC_W: usize = 8;
const FC_B: usize = 9;
const FC2_W: usize = 10;
const FC2_B: usize = 11;

/// What the forward pass keeps for the backward pass, per block (tensor ids).
struct BlockCache {
    x_in: TensorId,
    ln1: (TensorId, TensorId),
    attention: AttentionCache,
    y_rows: TensorId,
    x_mid: TensorId,
    ln2: (TensorId, TensorId),
    fc: TensorId,
    gelu: TensorId,
}

/// What the forward pass keeps of a block's attention for the backward pass.
enum AttentionCache {
    /// q, k, v by head and the probabilities (B, H, T, T).
    Unfused {
        q: TensorId,
        k: TensorId,
        v: TensorId,
        att: TensorId,
    },
    /// q|k|v as the projection wrote it and each score row's (max, sum).
    Fused {
        qkv: TensorId,
        stats: TensorId,
        spec: Attention,
    },
}

/// The GPT on a backend.
pub struct Gpt<'a> {
    pub config: GptConfig,
    pub backend: &'a dyn Backend,
}

/// Records the model's ops into a plan.
struct Recorder<'p> {
    g: PlanBuilder,
    p: &'p Precision,
    stats: Stats,
    state: Vec<[TensorId; 4]>,
}

impl Recorder<'_> {
    fn param(&self, i: usize) -> TensorId {
        self.state[i][0]
    }

    fn grad(&self, i: usize) -> TensorId {
        self.state[i][1]
    }

    /// Causal attention as one op (`plan::Attention`), with the unfused ops' numerics.
    fn attention_fused(
        &mut self,
        qkv: TensorId,
        (b, t, h, d): (usize, usize, usize, usize),
        scale: f64,
    ) -> (AttentionCache, TensorId) {
        let p = self.p;
        let spec = Attention {
            b,
            t,
            h,
            d,
            scale,
            algorithm: p.matmul,
            probs: p.softmax.narrower(p.stream),
            compute: p.compute,
        };
        let (out, stats) = (
            self.g.temp(spec.out_len()),
            self.g.temp(2 * spec.score_rows()),
        );
        self.g.push(Op::Attention {
            qkv,
            out,
            stats,
            spec,
        });
        (AttentionCache::Fused { qkv, stats, spec }, out)
    }

    /// Causal attention as separate ops: q, k, v copied out by head, scores, softmax, P.v, and
    /// the heads copied back into rows (B, T, C).
    fn attention_unfused(
        &mut self,
        qkv: TensorId,
        (b, t, h, d): (usize, usize, usize, usize),
        scale: f64,
    ) -> (AttentionCache, TensorId) {
        let n = b * t;
        let c = h * d;
        let p = self.p;
        let [q, k, v] = [0, 1, 2].map(|part| {
            let out = self.g.temp(n * c);
            self.g.push(Op::Copy {
                x: qkv,
                out,
                map: Strided::split_head(part, b, t, h, d),
            });
            out
        });
        let scores = self.mm(MatmulShape::batched(b * h, (t, t, d), false, true), q, k);
        let att = self.g.temp(b * h * t * t);
        self.g.push(Op::Softmax {
            x: scores,
            out: att,
            t,
            scale: self.score_scale(scale),
        });
        self.g.round(att, p.softmax.narrower(p.stream));
        let y = self.mm(MatmulShape::batched(b * h, (t, d, t), false, false), att, v);
        let y_rows = self.g.temp(n * c);
        self.g.push(Op::Copy {
            x: y,
            out: y_rows,
            map: Strided::heads_to_rows(b, t, h, d),
        });
        (AttentionCache::Unfused { q, k, v, att }, y_rows)
    }

    /// The gradient of q|k|v (B, T, 3C) from that of the attention's output rows (B, T, C).
    fn attention_bwd(
        &mut self,
        cache: &AttentionCache,
        dy_rows: TensorId,
        (b, t, h, d): (usize, usize, usize, usize),
        scale: f64,
    ) -> TensorId {
        let n = b * t;
        let dqkv = self.g.temp(n * 3 * h * d);
        match *cache {
            AttentionCache::Fused { qkv, stats, spec } => {
                let delta = self.g.temp(spec.score_rows());
                self.g.push(Op::AttentionBwd {
                    qkv,
                    dout: dy_rows,
                    stats,
                    delta,
                    dqkv,
                    spec,
                });
            }
            AttentionCache::Unfused { q, k, v, att } => {
                let dy = self.g.temp(n * h * d);
                self.g.push(Op::Copy {
                    x: dy_rows,
                    out: dy,
                    map: Strided::rows_to_heads(b, t, h, d),
                });
                let bh = b * h;
                let datt = self.mm(MatmulShape::batched(bh, (t, t, d), false, true), dy, v);
                let dv = self.mm(MatmulShape::batched(bh, (t, d, t), true, false), att, dy);
                let dscores = self.g.temp(bh * t * t);
                self.g.push(Op::SoftmaxBwd {
                    p: att,
                    dp: datt,
                    out: dscores,
                    t,
                    scale: self.score_scale(scale),
                });
                self.g.round(dscores, self.p.compute);
                let dq = self.mm(
                    MatmulShape::batched(bh, (t, d, t), false, false),
                    dscores,
                    k,
                );
                let dk = self.mm(MatmulShape::batched(bh, (t, d, t), true, false), dscores, q);
                for (part, x) in [dq, dk, dv].into_iter().enumerate() {
                    self.g.push(Op::Copy {
                        x,
                        out: dqkv,
                        map: Strided::merge_head(part, b, t, h, d),
                    });
                }
            }
        }
        dqkv
    }

    /// How the unfused softmax reads the scores: times `scale`, held in the compute format like
    /// the scores themselves (fused attention: `Attention::score_scale`).
    fn score_scale(&self, scale: f64) -> ScoreScale {
        ScoreScale {
            scale,
            held: self.p.compute,
        }
    }

    /// A matmul into `out` (a fresh tensor when none), held in the compute format.
    fn mm_into(
        &mut self,
        shape: MatmulShape,
        algorithm: Algorithm,
        scales: Option<[usize; 2]>,
        (a, b): (TensorId, TensorId),
        out: Option<TensorId>,
    ) -> TensorId {
        let out = out.unwrap_or_else(|| self.g.temp(shape.c_len()));
        self.g.push(Op::Matmul {
            shape,
            algorithm,
            a,
            b,
            out,
            scales,
        });
        self.g.round(out, self.p.compute);
        out
    }

    fn mm(&mut self, shape: MatmulShape, a: TensorId, b: TensorId) -> TensorId {
        self.mm_into(shape, self.p.matmul, None, (a, b), None)
    }

    /// A matmul of linear layer `layer` (0..4 n_layer): fp8 where the preset says so, with the
    /// scales of the operands' roles; delayed scaling records each tensor's amax once per step
    /// (input and weight in the forward matmul, the gradient where it meets the weight).
    fn linear_mm(
        &mut self,
        layer: usize,
        roles: (Fp8Role, Fp8Role),
        shape: MatmulShape,
        (a, b): (TensorId, TensorId),
        out: Option<TensorId>,
    ) -> TensorId {
        let algorithm = self.p.linear_algorithm(roles);
        let mut scales = None;
        if self.p.delayed_fp8() {
            let slot = |r: Fp8Role| scalar::FP8 + 3 * layer + r as usize;
            let amax = |r: Fp8Role| self.stats.amax(layer, r as usize);
            match roles {
                (Fp8Role::Input, Fp8Role::Weight) => {
                    let (sa, sb) = (amax(Fp8Role::Input), amax(Fp8Role::Weight));
                    self.g.push(Op::Amax { x: a, slot: sa });
                    self.g.push(Op::Amax { x: b, slot: sb });
                }
                (Fp8Role::Grad, Fp8Role::Weight) => {
                    let s = amax(Fp8Role::Grad);
                    self.g.push(Op::Amax { x: a, slot: s });
                }
                _ => {}
            }
            scales = Some([slot(roles.0), slot(roles.1)]);
        }
        self.mm_into(shape, algorithm, scales, (a, b), out)
    }

    /// y = x . W + b, held in the compute format.
    fn linear_fwd(&mut self, lin: &Linear, x: TensorId) -> TensorId {
        let n = self.g.len(x) / lin.din;
        let w = self.param(lin.w);
        let y = self.linear_mm(
            lin.layer,
            (Fp8Role::Input, Fp8Role::Weight),
            MatmulShape::new(n, lin.dout, lin.din),
            (x, w),
            None,
        );
        let bias = self.param(lin.b);
        self.g.push(Op::add_in_place(bias, y));
        self.g.round(y, self.p.compute);
        y
    }

    /// Backward of `linear_fwd`: dW = x^T . dy and db = column sums of dy into the gradients;
    /// returns dx = dy . W^T.
    fn linear_bwd(&mut self, lin: &Linear, x: TensorId, dy: TensorId) -> TensorId {
        let n = self.g.len(x) / lin.din;
        let (db, dw, w) = (self.grad(lin.b), self.grad(lin.w), self.param(lin.w));
        self.g.push(Op::ColumnSums {
            x: dy,
            out: db,
            c: lin.dout,
        });
        self.linear_mm(
            lin.layer,
            (Fp8Role::Input, Fp8Role::Grad),
            transposed_a(lin.din, lin.dout, n),
            (x, dy),
            Some(dw),
        );
        self.linear_mm(
            lin.layer,
            (Fp8Role::Grad, Fp8Role::Weight),
            transposed_b(n, lin.din, lin.dout),
            (dy, w),
            None,
        )
    }

    /// Layer norm with parameters (g, b) over the width, its output narrowed as the preset
    /// says: (y, per-row (mean, rstd)).
    fn norm(&mut self, x: TensorId, (g, b): (usize, usize), c: usize) -> (TensorId, TensorId) {
        let len = self.g.len(x);
        let (out, stats) = (self.g.temp(len), self.g.temp(2 * len / c));
        let (g, b) = (self.param(g), self.param(b));
        self.g.push(Op::LayerNorm {
            x,
            g,
            b,
            out,
            stats,
            c,
            held: Format::F32,
        });
        self.g.round(out, self.p.layer_norm.narrower(self.p.stream));
        (out, stats)
    }

    /// Backward of `x + f(norm(x))` given d(norm output) and the gradient `residual` that passes
    /// around the block: dg and db of the norm (g, b) into the gradients; returns dx.
    fn norm_residual_bwd(
        &mut self,
        (g, b): (usize, usize),
        dnorm: TensorId,
        x: TensorId,
        stats: TensorId,
        residual: TensorId,
        c: usize,
    ) -> TensorId {
        let dx = self.g.temp(self.g.len(x));
        let (dg, db, g) = (self.grad(g), self.grad(b), self.param(g));
        self.g.push(Op::LayerNormBwd {
            dy: dnorm,
            x,
            g,
            stats,
            dx,
            dg,
            db,
            c,
        });
        self.g.push(Op::add_in_place(residual, dx));
        self.g.round(dx, self.p.stream);
        dx
    }
}

impl Gpt<'_> {
    /// The loss and the gradients (loss scale 1, no update) of `params` on a batch of whole
    /// sequences, by this backend's executor of that batch's plan.
    pub async fn loss_and_gradients(
        &self,
        p: &Precision,
        fp8: &[[f32; 3]],
        params: &[Vec<f32>],
        ids: &[u32],
        targets: &[u32],
    ) -> Result<(f64, Vec<Vec<f32>>)> {
        let (mut exec, scalars) = self.executor(p, fp8, params, ids, targets).await?;
        let stats = exec.run(Section::Gradients, ids, targets, &scalars).await?;
        let mut grads = Vec::new();
        for [_, g, _, _] in exec.plan().state.clone() {
            grads.push(exec.read(g).await?);
        }
        Ok((stats[Stats::LOSS], grads))
    }

    /// The loss of `params` on a batch of whole sequences.
    pub async fn loss(
        &self,
        p: &Precision,
        fp8: &[[f32; 3]],
        params: &[Vec<f32>],
        ids: &[u32],
        targets: &[u32],
    ) -> Result<f64> {
        let (mut exec, scalars) = self.executor(p, fp8, params, ids, targets).await?;
        let stats = exec.run(Section::Forward, ids, targets, &scalars).await?;
        Ok(stats[Stats::LOSS])
    }

    /// The logits (tokens x vocabulary) of one sequence of at most the context.
    pub async fn logits(
        &self,
        p: &Precision,
        fp8: &[[f32; 3]],
        params: &[Vec<f32>],
        ids: &[u32],
    ) -> Result<Vec<f32>> {
        let (mut exec, scalars) = self.executor(p, fp8, params, ids, ids).await?;
        exec.run(Section::Forward, ids, ids, &scalars).await?;
        let logits = exec.plan().logits;
        exec.read(logits).await
    }

    /// This backend's executor of the plan of batches shaped as `ids` (sequences of the
    /// context, or one shorter sequence) holding `params`, and unit scalars (`fp8`: delayed
    /// scaling's scales per linear layer; unit scales where empty).
    pub async fn executor(
        &self,
        p: &Precision,
        fp8: &[[f32; 3]],
        params: &[Vec<f32>],
        ids: &[u32],
        targets: &[u32],
    ) -> Result<(Box<dyn StepExecutor + '_>, Vec<f32>)> {
        let t = ids.len().min(self.config.block_size);
        self.check_batch(ids, targets, t)?;
        let plan = self.plan(p, ids.len() / t, t)?;
        if params.len() != plan.state.len() {
            return Err(Error::LengthMismatch {
                what: "parameter tensors",
                expected: plan.state.len(),
                got: params.len(),
            });
        }
        let scalars = StepScalars {
            adamw: &AdamW::default(),
            clip: 0.0,
            loss_scale: 1.0,
            poison: 0.0,
            t: 1,
            ranks: 1,
            fp8,
        }
        .array(plan.rows, plan.scalar_count());
        let ids_of = plan.state.clone();
        let mut exec = crate::backend::executor(self.backend, plan, true)?;
        for ([id, ..], values) in ids_of.iter().zip(params) {
            exec.write(*id, values).await?;
        }
        Ok((exec, scalars))
    }

    /// The four linear layers of block `l`: attention in-projection, out-projection, MLP in, MLP out.
    fn linears(&self, l: usize) -> [Linear; 4] {
        let c = self.config.n_embd;
        let linear = |i: usize, w: usize, b: usize, din: usize, dout: usize| Linear {
            layer: 4 * l + i,
            w: layer_param(l, w),
            b: layer_param(l, b),
            din,
            dout,
        };
        [
            linear(0, ATTN_W, ATTN_B, c, 3 * c),
            linear(1, PROJ_W, PROJ_B, c, c),
            linear(2, FC_W, FC_B, c, 4 * c),
            linear(3, FC2_W, FC2_B, 4 * c, c),
        ]
    }

    /// Checks a batch of `sequences` sequences of `t` tokens against the model.
    pub fn check_batch(&self, ids: &[u32], targets: &[u32], t: usize) -> Result<()> {
        let v = self.config.vocab_size;
        if t == 0 || t > self.config.block_size || ids.is_empty() || !ids.len().is_multiple_of(t) {
            return Err(Error::invalid(
                "batch",
                format!(
                    "{} tokens do not make whole sequences of {t} (context {})",
                    ids.len(),
                    self.config.block_size
                ),
            ));
        }
        if targets.len() != ids.len() {
            return Err(Error::invalid(
                "batch",
                format!("{} targets for {} tokens", targets.len(), ids.len()),
            ));
        }
        if let Some(bad) = ids.iter().chain(targets).find(|&&i| i as usize >= v) {
            return Err(Error::invalid(
                "batch",
                format!("token id {bad} is outside the vocabulary of {v}"),
            ));
        }
        Ok(())
    }

    /// The plan of one step on batches of `sequences` sequences of `t` tokens: the forward pass
    /// to the loss, the backward pass to the gradients of `loss * loss scale`, the unscale and
    /// finite check, and the AdamW update (held in `p.weights`). Attention is one fused op where
    /// the backend has a kernel for it (`Capabilities::fuses_attention`), else the unfused ops; the
    /// matmuls' 16-bit inputs are stored as codes unless `MANTISSA_ACTIVATIONS=f32`.
    pub fn plan(&self, p: &Precision, sequences: usize, t: usize) -> Result<Plan> {
        let fused =
            (self.backend.capabilities()).fuses_attention(&p.matmul, self.config.head_dim());
        self.plan_with(p, sequences, t, fused, stores_codes()?)
    }

    /// `plan`, with attention fused (`Op::Attention`) or not, and the matmuls' 16-bit inputs
    /// stored as codes (`Plan::store_codes`) or as f32, as asked. Both choices leave the
    /// function the step computes as it is.
    pub fn plan_with(
        &self,
        p: &Precision,
        sequences: usize,
        t: usize,
        fused_attention: bool,
        coded: bool,
    ) -> Result<Plan> {
        let cfg = &self.config;
        let (c, v, h, d) = (cfg.n_embd, cfg.vocab_size, cfg.n_head, cfg.head_dim());
        if t == 0 || t > cfg.block_size || sequences == 0 {
            return Err(Error::invalid(
                "batch",
                format!(
                    "{sequences} sequences of {t} tokens (context {})",
                    cfg.block_size
                ),
            ));
        }
        let (b, n) = (sequences, sequences * t);
        let stats = Stats {
            grads: cfg.parameter_shapes().len(),
            linears: 4 * cfg.n_layer,
        };
        let mut g = PlanBuilder::default();
        let state: Vec<[TensorId; 4]> = cfg
            .parameter_shapes()
            .iter()
            .enumerate()
            .map(|(i, (_, shape))| {
                let len = shape.iter().product();
                [
                    g.tensor(len, TensorKind::Param(i)),
                    g.tensor(len, TensorKind::Grad(i)),
                    g.tensor(len, TensorKind::Moment1(i)),
                    g.tensor(len, TensorKind::Moment2(i)),
                ]
            })
            .collect();
        let tokens = g.tensor(n, TensorKind::Tokens);
        let targets = g.tensor(n, TensorKind::Targets);
        let positions = g.constant((0..n).map(|i| f32::from_bits((i % t) as u32)).collect());
        let mut r = Recorder { g, p, stats, state };
        // 1 / sqrt(d) as an f32, as CUDA computes the reciprocal of `att / sqrt(d)`'s divisor.
        let scale = (1.0 / (d as f64).sqrt() as f32) as f64;
        let (stream, compute) = (p.stream, p.compute);

        // Embeddings: token + position, in the stream format.
        let (wte, wpe) = (r.param(0), r.param(1));
        let x = r.g.temp(n * c);
        let pe = r.g.temp(n * c);
        r.g.push(Op::Embedding {
            table: wte,
            ids: tokens,
            out: x,
            c,
        });
        r.g.push(Op::Embedding {
            table: wpe,
            ids: positions,
            out: pe,
            c,
        });
        r.g.push(Op::add_in_place(pe, x));
        r.g.round(x, stream);

        let mut x = x;
        let mut caches = Vec::with_capacity(cfg.n_layer);
        for l in 0..cfg.n_layer {
            let [attn, proj, fc, fc2] = self.linears(l);
            let x_in = x;
            let ln1 = r.norm(x, (layer_param(l, LN1_G), layer_param(l, LN1_B)), c);
            let qkv = r.linear_fwd(&attn, ln1.0);
            let (attention, y_rows) = if fused_attention {
                r.attention_fused(qkv, (b, t, h, d), scale)
            } else {
                r.attention_unfused(qkv, (b, t, h, d), scale)
            };
            // x_mid = x_in + proj(y), in the stream format.
            let x_mid = r.linear_fwd(&proj, y_rows);
            r.g.push(Op::add_in_place(x_in, x_mid));
            r.g.round(x_mid, stream);
            let ln2 = r.norm(x_mid, (layer_param(l, LN2_G), layer_param(l, LN2_B)), c);
            let fc_out = r.linear_fwd(&fc, ln2.0);
            let gelu = r.g.temp(n * 4 * c);
            r.g.push(Op::Gelu {
                x: fc_out,
                out: gelu,
                held: Format::F32,
            });
            r.g.round(gelu, compute);
            x = r.linear_fwd(&fc2, gelu);
            r.g.push(Op::add_in_place(x_mid, x));
            r.g.round(x, stream);
            caches.push(BlockCache {
                x_in,
                ln1,
                attention,
                y_rows,
                x_mid,
                ln2,
                fc: fc_out,
                gelu,
            });
        }
        let nl = r.state.len() - 2;
        let lnf = r.norm(x, (nl, nl + 1), c);
        // Head tied to the token embedding: logits = lnf . wte^T, in the compute format.
        let logits = r.mm(MatmulShape::batched(1, (n, v, c), false, true), lnf.0, wte);
        // The loss and its gradient in one op; the backward pass starts from the gradient.
        let dlogits = r.g.temp(n * v);
        r.g.push(Op::CrossEntropy {
            logits,
            targets,
            grad: dlogits,
            v,
            held: Format::F32,
        });
        r.g.round(dlogits, compute);
        let forward = r.g.ops.len();

        // Backward, in reverse; gradients are held in the stream format (16-bit in "true"
        // presets) and matmul gradients in the compute format.
        let dx = r.mm(MatmulShape::new(n, c, v), dlogits, wte);
        let dwte = r.grad(0);
        r.mm_into(
            MatmulShape::batched(1, (v, c, n), true, false),
            p.matmul,
            None,
            (dlogits, lnf.0),
            Some(dwte),
        );
        let dxl = r.g.temp(n * c);
        let (lnf_g, dg, db) = (r.param(nl), r.grad(nl), r.grad(nl + 1));
        r.g.push(Op::LayerNormBwd {
            dy: dx,
            x,
            g: lnf_g,
            stats: lnf.1,
            dx: dxl,
            dg,
            db,
            c,
        });
        r.g.round(dxl, stream);
        let mut dx = dxl;

        for l in (0..cfg.n_layer).rev() {
            let cache = &caches[l];
            let [attn, proj, fc, fc2] = self.linears(l);
            // MLP: x = x_mid + fc2(gelu(fc(ln2(x_mid)))).
            let dgelu = r.linear_bwd(&fc2, cache.gelu, dx);
            let dfc = r.g.temp(n * 4 * c);
            r.g.push(Op::GeluBwd {
                x: cache.fc,
                dy: dgelu,
                out: dfc,
            });
            r.g.round(dfc, compute);
            let dln2 = r.linear_bwd(&fc, cache.ln2.0, dfc);
            let ln2 = (layer_param(l, LN2_G), layer_param(l, LN2_B));
            let dxm = r.norm_residual_bwd(ln2, dln2, cache.x_mid, cache.ln2.1, dx, c);
            // Attention: x_mid = x_in + proj(attn(ln1(x_in))).
            let dy_rows = r.linear_bwd(&proj, cache.y_rows, dxm);
            let dqkv = r.attention_bwd(&cache.attention, dy_rows, (b, t, h, d), scale);
            let dln1 = r.linear_bwd(&attn, cache.ln1.0, dqkv);
            let ln1 = (layer_param(l, LN1_G), layer_param(l, LN1_B));
            dx = r.norm_residual_bwd(ln1, dln1, cache.x_in, cache.ln1.1, dxm, c);
        }
        // Embeddings: scatter-add into the token table (which also holds the head's gradient).
        let scatter = r.g.temp(v * c);
        r.g.push(Op::EmbeddingBwd {
            dout: dx,
            ids: tokens,
            out: scatter,
            rows: v,
            c,
        });
        r.g.push(Op::add_in_place(scatter, dwte));
        let dwpe = r.grad(1);
        r.g.push(Op::EmbeddingBwd {
            dout: dx,
            ids: positions,
            out: dwpe,
            rows: cfg.block_size,
            c,
        });
        for i in 0..r.state.len() {
            let grad = r.grad(i);
            r.g.round(grad, stream);
        }

        // GradScaler's unscale and check, then AdamW where every gradient is finite. Without
        // master weights the weights and the optimizer state live in 16-bit.
        let backward = r.g.ops.len();
        let grads = (0..r.state.len()).map(|i| r.grad(i)).collect();
        r.g.push(Op::UnscaleCheck { grads });
        let gradients = r.g.ops.len();
        let decays = cfg.decays();
        let params = r
            .state
            .iter()
            .zip(decays)
            .map(|(&[param, grad, m, v], decay)| AdamWParam {
                param,
                grad,
                m,
                v,
                decay,
            })
            .collect();
        r.g.push(Op::AdamW { params });
        for [param, _, m, v] in r.state.clone() {
            for x in [param, m, v] {
                r.g.round(x, p.weights);
            }
        }
        let mut plan = r.g.finish(Outline {
            forward,
            backward,
            gradients,
            tokens,
            targets,
            logits,
            state: r.state,
            stats: r.stats,
        })?;
        if coded {
            plan.store_codes();
        }
        Ok(plan)
    }
}

/// Whether plans store the matmuls' 16-bit inputs as codes where nothing else says: yes, unless
/// `MANTISSA_ACTIVATIONS=f32` (to compare memory and step time with f32 storage).
pub fn stores_codes() -> Result<bool> {
    match std::env::var("MANTISSA_ACTIVATIONS").as_deref() {
        Err(_) | Ok("codes") => Ok(true),
        Ok("f32") => Ok(false),
        Ok(other) => Err(Error::invalid(
            "MANTISSA_ACTIVATIONS",
            format!("{other:?}: expected codes (the default) or f32"),
        )),
    }
}

/// A linear layer of a block: its index among the fp8 states, parameter slots and widths.
struct Linear {
    layer: usize,
    w: usize,
    b: usize,
    din: usize,
    dout: usize,
}

/// A^T . B for A stored rows x m (the weight gradient x^T . dy): m x n result, k = rows.
fn transposed_a(m: usize, n: usize, rows: usize) -> MatmulShape {
    MatmulShape::batched(1, (m, n, rows), true, false)
}

/// A . B^T for B stored n x k (dx = dy . W^T, W stored din x dout).
fn transposed_b(m: usize, n: usize, k: usize) -> MatmulShape {
    MatmulShape::batched(1, (m, n, k), false, true)
}

trait Narrower {
    /// The narrower of two formats: an f32-class op in a "true" preset still outputs 16-bit,
    /// and an override to 16-bit in a mixed preset narrows the f32 stream.
    fn narrower(self, other: Format) -> Format;
}

impl Narrower for Format {
    fn narrower(self, other: Format) -> Format {
        if self.finfo().mantissa_bits >= other.finfo().mantissa_bits {
            other
        } else {
            self
        }
    }
}
