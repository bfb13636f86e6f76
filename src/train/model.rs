//! The char-level GPT (nanoGPT's shape): token + position embeddings, pre-LayerNorm blocks with
//! causal multi-head self-attention and a GELU MLP, a final LayerNorm, and a head tied to the
//! token embedding.
//!
//! Matmuls go through the `Backend` trait with the algorithm the precision policy chose, and so
//! do embeddings, layer norm, GELU, causal softmax and cross entropy (device kernels on wgpu,
//! the host reference elsewhere); head permutations, bias sums, residual adds and the autocast
//! rounding run on the host. Autocast is emulated by rounding each tensor to the format it would be
//! held in (`Precision`).

use super::ops::{self, round_to};
use crate::algorithm::{Algorithm, MatmulShape, Scaling};
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::format::{self, Format};
use crate::measure;
use crate::policy::DelayedScaling;

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

/// fp8 state of one linear layer: delayed scaling of its input, weight and output gradient.
#[derive(Clone, Debug)]
pub struct Fp8Linear {
    pub input: DelayedScaling,
    pub weight: DelayedScaling,
    pub grad: DelayedScaling,
}

/// How the linear layers of a step compute in fp8.
#[derive(Clone, Debug)]
pub enum Fp8Mode {
    /// Scales from amax histories, one state per linear layer (4 per block).
    Delayed(Vec<Fp8Linear>),
    /// Scales from the current tensors (tensorwise, just in time).
    Current,
}

/// The formats of one step (what autocast and the preset decide).
#[derive(Clone, Debug)]
pub struct Precision {
    /// Algorithm of the matmul-like ops (linear, attention scores and values, head).
    pub matmul: Algorithm,
    /// Format matmul-like outputs and their elementwise successors (GELU) are held in.
    pub compute: Format,
    /// Format of everything else (residual stream, LayerNorm and softmax outputs, gradients):
    /// f32 in mixed presets, the 16-bit format in "true" presets.
    pub stream: Format,
    /// Formats of the f32-class ops (softmax, layer norm, cross entropy), after overrides.
    pub softmax: Format,
    pub layer_norm: Format,
    /// fp8 linear layers (transformer-engine), with e4m3 forward and e5m2 gradients.
    pub fp8: Option<Fp8Mode>,
}

/// What the forward pass keeps for the backward pass, per block.
struct BlockCache {
    x_in: Vec<f32>,
    ln1: (Vec<f32>, Vec<f32>, Vec<f32>),
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    y_rows: Vec<f32>,
    x_mid: Vec<f32>,
    ln2: (Vec<f32>, Vec<f32>, Vec<f32>),
    fc: Vec<f32>,
    gelu: Vec<f32>,
}

/// The GPT on a backend.
pub struct Gpt<'a> {
    pub config: GptConfig,
    pub backend: &'a dyn Backend,
}

/// Which fp8 tensor of a linear layer's three a matmul operand is.
#[derive(Clone, Copy)]
enum Fp8Role {
    Input,
    Weight,
    Grad,
}

impl Gpt<'_> {
    async fn mm(
        &self,
        shape: MatmulShape,
        alg: &Algorithm,
        a: &[f32],
        b: &[f32],
        out: Format,
    ) -> Result<Vec<f32>> {
        let mut c = self.backend.matmul(&shape, alg, a, b).await?;
        round_to(&mut c, out);
        Ok(c)
    }

    /// A matmul of linear layer `layer` (0..4 n_layer): fp8 where the preset says so, with the
    /// scales of the operands' roles, recording their amax for delayed scaling.
    #[allow(clippy::too_many_arguments)]
    async fn linear_mm(
        &self,
        p: &mut Precision,
        layer: usize,
        roles: (Fp8Role, Fp8Role),
        shape: MatmulShape,
        a: &[f32],
        b: &[f32],
    ) -> Result<Vec<f32>> {
        let compute = p.compute;
        let alg = match &mut p.fp8 {
            None => p.matmul,
            Some(mode) => {
                let fmt = |r: Fp8Role| {
                    if matches!(r, Fp8Role::Grad) {
                        Format::E5m2
                    } else {
                        Format::E4m3
                    }
                };
                match mode {
                    Fp8Mode::Current => Algorithm::fp8(fmt(roles.0), fmt(roles.1)),
                    Fp8Mode::Delayed(states) => {
                        let state = &mut states[layer];
                        let pick = |s: &mut Fp8Linear, r: Fp8Role| -> f32 {
                            match r {
                                Fp8Role::Input => s.input.scale,
                                Fp8Role::Weight => s.weight.scale,
                                Fp8Role::Grad => s.grad.scale,
                            }
                        };
                        let (sa, sb) = (pick(state, roles.0), pick(state, roles.1));
                        // Each tensor's amax enters its history once per step: input and weight
                        // in the forward matmul, the gradient where it meets the weight.
                        match roles {
                            (Fp8Role::Input, Fp8Role::Weight) => {
                                state.input.record(format::amax(a.iter().copied()));
                                state.weight.record(format::amax(b.iter().copied()));
                            }
                            (Fp8Role::Grad, Fp8Role::Weight) => {
                                state.grad.record(format::amax(a.iter().copied()));
                            }
                            _ => {}
                        }
                        Algorithm::Fp8 {
                            a: fmt(roles.0),
                            b: fmt(roles.1),
                            scaling: Scaling::Given { a: sa, b: sb },
                        }
                    }
                }
            }
        };
        self.mm(shape, &alg, a, b, compute).await
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

    /// y = x . W + b, held in the compute format.
    async fn linear_fwd(
        &self,
        p: &mut Precision,
        params: &[Vec<f32>],
        lin: &Linear,
        x: &[f32],
    ) -> Result<Vec<f32>> {
        let n = x.len() / lin.din;
        let roles = (Fp8Role::Input, Fp8Role::Weight);
        let mut y = self
            .linear_mm(
                p,
                lin.layer,
                roles,
                MatmulShape::new(n, lin.dout, lin.din),
                x,
                &params[lin.w],
            )
            .await?;
        ops::add_bias(&mut y, &params[lin.b]);
        round_to(&mut y, p.compute);
        Ok(y)
    }

    /// Backward of `linear_fwd`: stores dW = x^T . dy and db = column sums of dy, returns
    /// dx = dy . W^T.
    async fn linear_bwd(
        &self,
        p: &mut Precision,
        params: &[Vec<f32>],
        lin: &Linear,
        x: &[f32],
        dy: &[f32],
        grads: &mut [Vec<f32>],
    ) -> Result<Vec<f32>> {
        let n = x.len() / lin.din;
        grads[lin.b] = ops::column_sums(dy, lin.dout);
        let dw_shape = transposed_a(lin.din, lin.dout, n);
        grads[lin.w] = self
            .linear_mm(
                p,
                lin.layer,
                (Fp8Role::Input, Fp8Role::Grad),
                dw_shape,
                x,
                dy,
            )
            .await?;
        let dx_shape = transposed_b(n, lin.din, lin.dout);
        self.linear_mm(
            p,
            lin.layer,
            (Fp8Role::Grad, Fp8Role::Weight),
            dx_shape,
            dy,
            &params[lin.w],
        )
        .await
    }

    /// Layer norm over the width, its output narrowed as the preset says: (y, mean, rstd).
    async fn norm(
        &self,
        p: &Precision,
        x: &[f32],
        g: &[f32],
        b: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let mut out = self
            .backend
            .layernorm_fwd(x, g, b, self.config.n_embd)
            .await?;
        round_to(&mut out.0, p.layer_norm.narrower(p.stream));
        Ok(out)
    }

    /// Backward of `x + f(norm(x))` given d(norm output) and the gradient `residual` that passes
    /// around the block: stores dg and db of the norm `(g, b)`, returns dx.
    #[allow(clippy::too_many_arguments)]
    async fn norm_residual_bwd(
        &self,
        params: &[Vec<f32>],
        (g, b): (usize, usize),
        dnorm: &[f32],
        x: &[f32],
        stats: &(Vec<f32>, Vec<f32>, Vec<f32>),
        residual: &[f32],
        stream: Format,
        grads: &mut [Vec<f32>],
    ) -> Result<Vec<f32>> {
        let (mut dx, dg, db) = self
            .backend
            .layernorm_bwd(dnorm, x, &params[g], &stats.1, &stats.2, self.config.n_embd)
            .await?;
        grads[g] = dg;
        grads[b] = db;
        add_residual(&mut dx, residual, stream);
        Ok(dx)
    }

    /// Runs the model on a batch of whole sequences: the loss, and per `pass` the logits or the
    /// gradients of `loss * loss_scale`.
    pub async fn run(
        &self,
        params: &[Vec<f32>],
        ids: &[u32],
        targets: &[u32],
        p: &mut Precision,
        loss_scale: f32,
        pass: Pass,
    ) -> Result<Output> {
        let cfg = &self.config;
        let (c, v, h, d) = (cfg.n_embd, cfg.vocab_size, cfg.n_head, cfg.head_dim());
        let n = ids.len();
        let t = cfg.block_size.min(n);
        if n == 0 || !n.is_multiple_of(t) || targets.len() != n {
            return Err(Error::invalid(
                "batch",
                format!("{n} tokens do not make whole sequences of {t}"),
            ));
        }
        let b = n / t;
        if let Some(bad) = ids.iter().chain(targets).find(|&&i| i as usize >= v) {
            return Err(Error::invalid(
                "batch",
                format!("token id {bad} is outside the vocabulary of {v}"),
            ));
        }
        let scale = 1.0 / (d as f64).sqrt();
        let (stream, compute) = (p.stream, p.compute);

        // Embeddings: token + position, in the stream format.
        let mut x = self.backend.embedding_fwd(&params[0], ids, c).await?;
        let pos: Vec<u32> = (0..n).map(|i| (i % t) as u32).collect();
        let wpe = self.backend.embedding_fwd(&params[1], &pos, c).await?;
        for (xi, pi) in x.iter_mut().zip(&wpe) {
            *xi += pi;
        }
        round_to(&mut x, stream);

        let mut caches = Vec::with_capacity(cfg.n_layer);
        for l in 0..cfg.n_layer {
            let w = |o: usize| &params[layer_param(l, o)];
            let [attn, proj, fc, fc2] = self.linears(l);
            let x_in = x.clone();
            let ln1 = self.norm(p, &x, w(LN1_G), w(LN1_B)).await?;
            let qkv = self.linear_fwd(p, params, &attn, &ln1.0).await?;
            let [q, k, vv] = ops::split_heads(&qkv, b, t, h, d);
            let scores = self
                .mm(bmm(b * h, t, t, d, false, true), &p.matmul, &q, &k, compute)
                .await?;
            let mut att = self.backend.causal_softmax_fwd(&scores, t, scale).await?;
            round_to(&mut att, p.softmax.narrower(stream));
            let y = self
                .mm(
                    bmm(b * h, t, d, t, false, false),
                    &p.matmul,
                    &att,
                    &vv,
                    compute,
                )
                .await?;
            let y_rows = ops::heads_to_rows(&y, b, t, h, d);
            add_residual(
                &mut x,
                &self.linear_fwd(p, params, &proj, &y_rows).await?,
                stream,
            );
            let x_mid = x.clone();
            let ln2 = self.norm(p, &x, w(LN2_G), w(LN2_B)).await?;
            let fc_out = self.linear_fwd(p, params, &fc, &ln2.0).await?;
            let mut gelu = self.backend.gelu_fwd(&fc_out).await?;
            round_to(&mut gelu, compute);
            add_residual(
                &mut x,
                &self.linear_fwd(p, params, &fc2, &gelu).await?,
                stream,
            );
            caches.push(BlockCache {
                x_in,
                ln1,
                q,
                k,
                v: vv,
                att,
                y_rows,
                x_mid,
                ln2,
                fc: fc_out,
                gelu,
            });
        }
        let nl = params.len() - 2;
        let lnf = self.norm(p, &x, &params[nl], &params[nl + 1]).await?;
        // Head tied to the token embedding: logits = lnf . wte^T, in the compute format.
        let head = bmm(1, n, v, c, false, true);
        let logits = self
            .mm(head, &p.matmul, &lnf.0, &params[0], compute)
            .await?;
        let (loss, probs) = self.backend.cross_entropy_fwd(&logits, targets, v).await?;
        match pass {
            Pass::Loss => {
                return Ok(Output {
                    loss,
                    grads: None,
                    logits: None,
                });
            }
            Pass::Logits => {
                return Ok(Output {
                    loss,
                    grads: None,
                    logits: Some(logits),
                });
            }
            Pass::Backward => {}
        }

        // Backward, in reverse; gradients are held in the stream format (16-bit in "true"
        // presets) and matmul gradients in the compute format.
        let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        let mut dlogits = self
            .backend
            .cross_entropy_bwd(&probs, targets, v, loss_scale as f64)
            .await?;
        round_to(&mut dlogits, compute);
        let mut dx = self
            .mm(
                MatmulShape::new(n, c, v),
                &p.matmul,
                &dlogits,
                &params[0],
                compute,
            )
            .await?;
        grads[0] = self
            .mm(
                bmm(1, v, c, n, true, false),
                &p.matmul,
                &dlogits,
                &lnf.0,
                compute,
            )
            .await?;
        let (dxl, dg, db) = self
            .backend
            .layernorm_bwd(&dx, &x, &params[nl], &lnf.1, &lnf.2, c)
            .await?;
        dx = dxl;
        round_to(&mut dx, stream);
        grads[nl] = dg;
        grads[nl + 1] = db;

        for l in (0..cfg.n_layer).rev() {
            let cache = &caches[l];
            let [attn, proj, fc, fc2] = self.linears(l);
            // MLP: x = x_mid + fc2(gelu(fc(ln2(x_mid)))).
            let dgelu = self
                .linear_bwd(p, params, &fc2, &cache.gelu, &dx, &mut grads)
                .await?;
            let mut dfc = self.backend.gelu_bwd(&cache.fc, &dgelu).await?;
            round_to(&mut dfc, compute);
            let dln2 = self
                .linear_bwd(p, params, &fc, &cache.ln2.0, &dfc, &mut grads)
                .await?;
            let ln2 = (layer_param(l, LN2_G), layer_param(l, LN2_B));
            let dxm = self
                .norm_residual_bwd(
                    params,
                    ln2,
                    &dln2,
                    &cache.x_mid,
                    &cache.ln2,
                    &dx,
                    stream,
                    &mut grads,
                )
                .await?;
            // Attention: x_mid = x_in + proj(attn(ln1(x_in))).
            let dy_rows = self
                .linear_bwd(p, params, &proj, &cache.y_rows, &dxm, &mut grads)
                .await?;
            let dy = ops::rows_to_heads(&dy_rows, b, t, h, d);
            let bh = b * h;
            let datt = self
                .mm(
                    bmm(bh, t, t, d, false, true),
                    &p.matmul,
                    &dy,
                    &cache.v,
                    compute,
                )
                .await?;
            let dv = self
                .mm(
                    bmm(bh, t, d, t, true, false),
                    &p.matmul,
                    &cache.att,
                    &dy,
                    compute,
                )
                .await?;
            let mut dscores = self
                .backend
                .causal_softmax_bwd(&cache.att, &datt, t, scale)
                .await?;
            round_to(&mut dscores, compute);
            let dq = self
                .mm(
                    bmm(bh, t, d, t, false, false),
                    &p.matmul,
                    &dscores,
                    &cache.k,
                    compute,
                )
                .await?;
            let dk = self
                .mm(
                    bmm(bh, t, d, t, true, false),
                    &p.matmul,
                    &dscores,
                    &cache.q,
                    compute,
                )
                .await?;
            let dqkv = ops::merge_qkv([&dq, &dk, &dv], b, t, h, d);
            let dln1 = self
                .linear_bwd(p, params, &attn, &cache.ln1.0, &dqkv, &mut grads)
                .await?;
            let ln1 = (layer_param(l, LN1_G), layer_param(l, LN1_B));
            dx = self
                .norm_residual_bwd(
                    params,
                    ln1,
                    &dln1,
                    &cache.x_in,
                    &cache.ln1,
                    &dxm,
                    stream,
                    &mut grads,
                )
                .await?;
        }
        // Embeddings: scatter-add into the token table (which also holds the head's gradient).
        let dwte = self.backend.embedding_bwd(&dx, ids, v, c).await?;
        for (g, e) in grads[0].iter_mut().zip(&dwte) {
            *g += e;
        }
        grads[1] = self
            .backend
            .embedding_bwd(&dx, &pos, cfg.block_size, c)
            .await?;
        for g in grads.iter_mut() {
            round_to(g, stream);
        }
        Ok(Output {
            loss,
            grads: Some(grads),
            logits: None,
        })
    }
}

/// What a run of the model computes besides the loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Loss,
    Logits,
    Backward,
}

/// The results of a run.
pub struct Output {
    pub loss: f64,
    pub grads: Option<Vec<Vec<f32>>>,
    pub logits: Option<Vec<f32>>,
}

/// A linear layer of a block: its index among the fp8 states, parameter slots and widths.
struct Linear {
    layer: usize,
    w: usize,
    b: usize,
    din: usize,
    dout: usize,
}

/// A batched matmul shape (attention: one batch per sequence and head).
fn bmm(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a_transposed: bool,
    b_transposed: bool,
) -> MatmulShape {
    MatmulShape {
        batch,
        m,
        n,
        k,
        a_transposed,
        b_transposed,
    }
}

/// x += y, held in the stream format (the residual stream and its gradient).
fn add_residual(x: &mut [f32], y: &[f32], stream: Format) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
    round_to(x, stream);
}

/// A^T . B for A stored rows x m (the weight gradient x^T . dy): m x n result, k = rows.
fn transposed_a(m: usize, n: usize, rows: usize) -> MatmulShape {
    bmm(1, m, n, rows, true, false)
}

/// A . B^T for B stored n x k (dx = dy . W^T, W stored din x dout).
fn transposed_b(m: usize, n: usize, k: usize) -> MatmulShape {
    bmm(1, m, n, k, false, true)
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
