//! The char-level GPT (nanoGPT's shape): token + position embeddings, pre-LayerNorm blocks with
//! causal multi-head self-attention and a GELU MLP, a final LayerNorm, and a head tied to the
//! token embedding.
//!
//! Matmuls go through the `Backend` trait with the algorithm the precision policy chose, and so
//! do layer norm, GELU, causal softmax and cross entropy (device kernels on wgpu, the host
//! reference elsewhere); embeddings, head permutations, bias sums and the autocast rounding
//! run on the host. Autocast is emulated by rounding each tensor to the format it would be
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
    fn mm(
        &self,
        shape: MatmulShape,
        alg: &Algorithm,
        a: &[f32],
        b: &[f32],
        out: Format,
    ) -> Result<Vec<f32>> {
        let mut c = self.backend.matmul(&shape, alg, a, b)?;
        round_to(&mut c, out);
        Ok(c)
    }

    /// A matmul of linear layer `layer` (0..4 n_layer): fp8 where the preset says so, with the
    /// scales of the operands' roles, recording their amax for delayed scaling.
    #[allow(clippy::too_many_arguments)]
    fn linear_mm(
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
        self.mm(shape, &alg, a, b, compute)
    }

    /// Runs the model on a batch of whole sequences: the loss, and per `pass` the logits or the
    /// gradients of `loss * loss_scale`.
    pub fn run(
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
        let mut x = ops::embedding_fwd(&params[0], ids, c);
        let pos: Vec<u32> = (0..n).map(|i| (i % t) as u32).collect();
        let wpe = ops::embedding_fwd(&params[1], &pos, c);
        for (xi, pi) in x.iter_mut().zip(&wpe) {
            *xi += pi;
        }
        round_to(&mut x, stream);

        let mut caches = Vec::with_capacity(cfg.n_layer);
        for l in 0..cfg.n_layer {
            let w = |o: usize| &params[layer_param(l, o)];
            let x_in = x.clone();
            let mut ln1 = self.backend.layernorm_fwd(&x, w(LN1_G), w(LN1_B), c)?;
            round_to(&mut ln1.0, p.layer_norm.narrower(stream));
            let mut qkv = self.linear_mm(
                p,
                4 * l,
                (Fp8Role::Input, Fp8Role::Weight),
                MatmulShape::new(n, 3 * c, c),
                &ln1.0,
                w(ATTN_W),
            )?;
            ops::add_bias(&mut qkv, w(ATTN_B));
            round_to(&mut qkv, compute);
            let [q, k, vv] = ops::split_heads(&qkv, b, t, h, d);
            let bh = b * h;
            let scores = self.mm(
                MatmulShape {
                    batch: bh,
                    m: t,
                    n: t,
                    k: d,
                    a_transposed: false,
                    b_transposed: true,
                },
                &p.matmul,
                &q,
                &k,
                compute,
            )?;
            let mut att = self.backend.causal_softmax_fwd(&scores, t, scale)?;
            round_to(&mut att, p.softmax.narrower(stream));
            let y = self.mm(
                MatmulShape {
                    batch: bh,
                    m: t,
                    n: d,
                    k: t,
                    a_transposed: false,
                    b_transposed: false,
                },
                &p.matmul,
                &att,
                &vv,
                compute,
            )?;
            let y_rows = ops::heads_to_rows(&y, b, t, h, d);
            let mut proj = self.linear_mm(
                p,
                4 * l + 1,
                (Fp8Role::Input, Fp8Role::Weight),
                MatmulShape::new(n, c, c),
                &y_rows,
                w(PROJ_W),
            )?;
            ops::add_bias(&mut proj, w(PROJ_B));
            round_to(&mut proj, compute);
            for (xi, pi) in x.iter_mut().zip(&proj) {
                *xi += pi;
            }
            round_to(&mut x, stream);
            let x_mid = x.clone();
            let mut ln2 = self.backend.layernorm_fwd(&x, w(LN2_G), w(LN2_B), c)?;
            round_to(&mut ln2.0, p.layer_norm.narrower(stream));
            let mut fc = self.linear_mm(
                p,
                4 * l + 2,
                (Fp8Role::Input, Fp8Role::Weight),
                MatmulShape::new(n, 4 * c, c),
                &ln2.0,
                w(FC_W),
            )?;
            ops::add_bias(&mut fc, w(FC_B));
            round_to(&mut fc, compute);
            let mut gelu = self.backend.gelu_fwd(&fc)?;
            round_to(&mut gelu, compute);
            let mut fc2 = self.linear_mm(
                p,
                4 * l + 3,
                (Fp8Role::Input, Fp8Role::Weight),
                MatmulShape::new(n, c, 4 * c),
                &gelu,
                w(FC2_W),
            )?;
            ops::add_bias(&mut fc2, w(FC2_B));
            round_to(&mut fc2, compute);
            for (xi, fi) in x.iter_mut().zip(&fc2) {
                *xi += fi;
            }
            round_to(&mut x, stream);
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
                fc,
                gelu,
            });
        }
        let nl = params.len() - 2;
        let mut lnf = self
            .backend
            .layernorm_fwd(&x, &params[nl], &params[nl + 1], c)?;
        round_to(&mut lnf.0, p.layer_norm.narrower(stream));
        // Head tied to the token embedding: logits = lnf . wte^T, in the compute format.
        let head = MatmulShape {
            batch: 1,
            m: n,
            n: v,
            k: c,
            a_transposed: false,
            b_transposed: true,
        };
        let logits = self.mm(head, &p.matmul, &lnf.0, &params[0], compute)?;
        let (loss, probs) = self.backend.cross_entropy_fwd(&logits, targets, v)?;
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
            .cross_entropy_bwd(&probs, targets, v, loss_scale as f64)?;
        round_to(&mut dlogits, compute);
        let mut dx = self.mm(
            MatmulShape::new(n, c, v),
            &p.matmul,
            &dlogits,
            &params[0],
            compute,
        )?;
        grads[0] = self.mm(
            MatmulShape {
                batch: 1,
                m: v,
                n: c,
                k: n,
                a_transposed: true,
                b_transposed: false,
            },
            &p.matmul,
            &dlogits,
            &lnf.0,
            compute,
        )?;
        let (dxl, dg, db) = self
            .backend
            .layernorm_bwd(&dx, &x, &params[nl], &lnf.1, &lnf.2, c)?;
        dx = dxl;
        round_to(&mut dx, stream);
        grads[nl] = dg;
        grads[nl + 1] = db;

        for l in (0..cfg.n_layer).rev() {
            let cache = &caches[l];
            let w = |o: usize| &params[layer_param(l, o)];
            // MLP: x = x_mid + fc2(gelu(fc(ln2(x_mid)))).
            let dfc2 = dx.clone();
            grads[layer_param(l, FC2_B)] = ops::column_sums(&dfc2, c);
            grads[layer_param(l, FC2_W)] = self.linear_mm(
                p,
                4 * l + 3,
                (Fp8Role::Input, Fp8Role::Grad),
                transposed_a(4 * c, c, n),
                &cache.gelu,
                &dfc2,
            )?;
            let mut dgelu = self.linear_mm(
                p,
                4 * l + 3,
                (Fp8Role::Grad, Fp8Role::Weight),
                transposed_b(n, 4 * c, c),
                &dfc2,
                w(FC2_W),
            )?;
            round_to(&mut dgelu, compute);
            let mut dfc = self.backend.gelu_bwd(&cache.fc, &dgelu)?;
            round_to(&mut dfc, compute);
            grads[layer_param(l, FC_B)] = ops::column_sums(&dfc, 4 * c);
            grads[layer_param(l, FC_W)] = self.linear_mm(
                p,
                4 * l + 2,
                (Fp8Role::Input, Fp8Role::Grad),
                transposed_a(c, 4 * c, n),
                &cache.ln2.0,
                &dfc,
            )?;
            let dln2 = self.linear_mm(
                p,
                4 * l + 2,
                (Fp8Role::Grad, Fp8Role::Weight),
                transposed_b(n, c, 4 * c),
                &dfc,
                w(FC_W),
            )?;
            let (mut dxm, dg2, db2) = self.backend.layernorm_bwd(
                &dln2,
                &cache.x_mid,
                w(LN2_G),
                &cache.ln2.1,
                &cache.ln2.2,
                c,
            )?;
            grads[layer_param(l, LN2_G)] = dg2;
            grads[layer_param(l, LN2_B)] = db2;
            for (a, bb) in dxm.iter_mut().zip(&dx) {
                *a += bb;
            }
            round_to(&mut dxm, stream);
            // Attention: x_mid = x_in + proj(attn(ln1(x_in))).
            grads[layer_param(l, PROJ_B)] = ops::column_sums(&dxm, c);
            grads[layer_param(l, PROJ_W)] = self.linear_mm(
                p,
                4 * l + 1,
                (Fp8Role::Input, Fp8Role::Grad),
                transposed_a(c, c, n),
                &cache.y_rows,
                &dxm,
            )?;
            let dy_rows = self.linear_mm(
                p,
                4 * l + 1,
                (Fp8Role::Grad, Fp8Role::Weight),
                transposed_b(n, c, c),
                &dxm,
                w(PROJ_W),
            )?;
            let dy = ops::rows_to_heads(&dy_rows, b, t, h, d);
            let bh = b * h;
            let mut datt = self.mm(
                MatmulShape {
                    batch: bh,
                    m: t,
                    n: t,
                    k: d,
                    a_transposed: false,
                    b_transposed: true,
                },
                &p.matmul,
                &dy,
                &cache.v,
                compute,
            )?;
            let dv = self.mm(
                MatmulShape {
                    batch: bh,
                    m: t,
                    n: d,
                    k: t,
                    a_transposed: true,
                    b_transposed: false,
                },
                &p.matmul,
                &cache.att,
                &dy,
                compute,
            )?;
            round_to(&mut datt, compute);
            let mut dscores = self
                .backend
                .causal_softmax_bwd(&cache.att, &datt, t, scale)?;
            round_to(&mut dscores, compute);
            let dq = self.mm(
                MatmulShape {
                    batch: bh,
                    m: t,
                    n: d,
                    k: t,
                    a_transposed: false,
                    b_transposed: false,
                },
                &p.matmul,
                &dscores,
                &cache.k,
                compute,
            )?;
            let dk = self.mm(
                MatmulShape {
                    batch: bh,
                    m: t,
                    n: d,
                    k: t,
                    a_transposed: true,
                    b_transposed: false,
                },
                &p.matmul,
                &dscores,
                &cache.q,
                compute,
            )?;
            let dqkv = ops::merge_qkv([&dq, &dk, &dv], b, t, h, d);
            grads[layer_param(l, ATTN_B)] = ops::column_sums(&dqkv, 3 * c);
            grads[layer_param(l, ATTN_W)] = self.linear_mm(
                p,
                4 * l,
                (Fp8Role::Input, Fp8Role::Grad),
                transposed_a(c, 3 * c, n),
                &cache.ln1.0,
                &dqkv,
            )?;
            let dln1 = self.linear_mm(
                p,
                4 * l,
                (Fp8Role::Grad, Fp8Role::Weight),
                transposed_b(n, c, 3 * c),
                &dqkv,
                w(ATTN_W),
            )?;
            let (mut dxi, dg1, db1) = self.backend.layernorm_bwd(
                &dln1,
                &cache.x_in,
                w(LN1_G),
                &cache.ln1.1,
                &cache.ln1.2,
                c,
            )?;
            grads[layer_param(l, LN1_G)] = dg1;
            grads[layer_param(l, LN1_B)] = db1;
            for (a, bb) in dxi.iter_mut().zip(&dxm) {
                *a += bb;
            }
            round_to(&mut dxi, stream);
            dx = dxi;
        }
        // Embeddings: scatter-add into the token table (which also holds the head's gradient).
        let dwte = ops::embedding_bwd(&dx, ids, v, c);
        for (g, e) in grads[0].iter_mut().zip(&dwte) {
            *g += e;
        }
        grads[1] = ops::embedding_bwd(&dx, &pos, cfg.block_size, c);
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

/// A^T . B for A stored rows x m (the weight gradient x^T . dy): m x n result, k = rows.
fn transposed_a(m: usize, n: usize, rows: usize) -> MatmulShape {
    MatmulShape {
        batch: 1,
        m,
        n,
        k: rows,
        a_transposed: true,
        b_transposed: false,
    }
}

/// A . B^T for B stored n x k (dy . W^T with W stored k_out... as n x k).
fn transposed_b(m: usize, n: usize, k: usize) -> MatmulShape {
    MatmulShape {
        batch: 1,
        m,
        n,
        k,
        a_transposed: false,
        b_transposed: true,
    }
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
