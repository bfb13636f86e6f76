//! The plan of a model's training step: its forward ops in order, then, walking the ops in
//! reverse, each one's backward rule (`ops::NodeOp::backward`) from its output's gradient once
//! that is complete; then GradScaler's unscale and check and the AdamW update.
//!
//! Each value is held in a format, as autocast holds the tensor (`NodeOp::format`), and so is
//! its gradient once complete: the gradients of a value read more than once (a tied weight, a
//! residual stream) are summed as they arrive, in f32, and rounded once, to the value's format;
//! a parameter's first gradient is written into its `Grad` tensor, the later ones added in.
//! The ops are recorded through `PlanBuilder::push` and `round` as a hand-written plan's would
//! be, so its folds (a rounding into the add that reads it, a residual into the bias add before
//! it, a GELU into its bias add) apply here too.

use super::{Model, Source, Var};
use crate::algorithm::{Algorithm, MatmulShape};
use crate::error::Result;
use crate::format::Format;
use crate::plan::scalar;
use crate::plan::{
    AdamWParam, Op, Outline, Plan, PlanBuilder, Stats, Strided, TensorId, TensorKind,
};
use crate::policy::{Fp8Role, Precision};

/// How a model's step plan is laid out; both choices leave the function it computes as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    /// Attention as one fused op (`plan::Op::Attention`; only where the backend has its
    /// kernel) or as separate ops.
    pub fused_attention: bool,
    /// The matmuls' 16-bit inputs stored as 16-bit codes (`Plan::store_codes`).
    pub coded: bool,
    /// The key of the model's dropout masks (`plan::dropout::key`): a trainer's seed.
    pub seed: u64,
}

/// A value's gradient so far.
struct Grad {
    t: TensorId,
    /// The tensor is this value's own (a later gradient may be added into it); else it is
    /// another value's too (an add's output gradient, handed to both operands).
    owned: bool,
    /// More than one gradient was summed into it (in f32).
    summed: bool,
    /// The format its values are known to be held in (f32: none known).
    known: Format,
}

/// What a forward emission keeps for its backward rule (tensors, an fp8 layer's index).
pub(crate) type Saved = Vec<usize>;

/// The plan being recorded, and where each value and gradient of the model lies in it.
pub(crate) struct Emit<'a> {
    pub g: PlanBuilder,
    pub p: &'a Precision,
    pub fused_attention: bool,
    /// The key of the dropout masks (`PlanOptions::seed`).
    pub seed: u64,
    model: &'a Model,
    reads: Vec<usize>,
    stats: Stats,
    state: Vec<[TensorId; 4]>,
    tensors: Vec<Option<TensorId>>,
    grads: Vec<Option<Grad>>,
    /// Whether a parameter's gradient flows through each value (none reaches the batch's
    /// inputs, constants, or values computed from them alone).
    needs: Vec<bool>,
    /// The format each value is held in, as autocast holds the tensor (its gradient is held
    /// in it too: a tensor's gradient has its dtype).
    formats: Vec<Format>,
    /// The format the backward rule being recorded reads its `dy` in: f32, or the format of
    /// its output where the gradient is a tensor shared with another value that holds it
    /// wider (an add's output gradient, f32, handed to a 16-bit operand), which the rule's
    /// ops round as they read it (`dy_held`, a matmul's operands) or `dy_rounded` copies.
    pub dy_read: Format,
    /// The format `dy`'s values are known to be held in (f32: none known).
    pub dy_known: Format,
    linears: usize,
}

impl Emit<'_> {
    /// The tensor of `v` (recorded before any op reads it).
    pub fn t(&self, v: Var) -> TensorId {
        self.tensors[v.index].expect("a value's op is recorded before its readers")
    }

    pub fn len(&self, v: Var) -> usize {
        self.model.values[v.index].len()
    }

    /// The format `v` is held in (`NodeOp::format` for an op's output).
    pub fn format(&self, v: Var) -> Format {
        self.formats[v.index]
    }

    /// `dy` as the rule being recorded reads it, where its ops cannot round it as they read it:
    /// a copy rounded to `dy_read` (`dy` itself where there is nothing to round).
    pub fn dy_rounded(&mut self, dy: TensorId) -> TensorId {
        if self.dy_read == Format::F32 {
            return dy;
        }
        let out = self.g.temp(self.g.len(dy));
        self.g
            .push(dense_copy(dy, out, self.g.len(dy), self.dy_read));
        out
    }

    /// `dy` for the operands of matmuls under `algorithm`: as it is where the algorithm rounds
    /// its operands to `dy_read` (bf16, f16), else `dy_rounded`. An fp8 linear layer quantizes
    /// dy from its f32 values, as it always has (Transformer Engine would see it in bf16
    /// first: a rounding not reproduced, which would cost a pass per layer).
    pub fn dy_for(&mut self, algorithm: Algorithm, dy: TensorId) -> TensorId {
        match (algorithm, self.dy_read) {
            (_, Format::F32) | (Algorithm::Bf16, Format::Bf16) | (Algorithm::F16, Format::F16) => {
                dy
            }
            (Algorithm::Fp8 { .. }, _) => dy,
            _ => self.dy_rounded(dy),
        }
    }

    /// The next fp8 linear layer's index.
    pub fn next_linear(&mut self) -> usize {
        self.linears += 1;
        self.linears - 1
    }

    /// Whether an op reading `v` may write its output over it: an op's output that only this
    /// op reads and whose own backward rule does not read.
    pub fn overwritable(&self, v: Var) -> bool {
        match self.model.values[v.index].source {
            Source::Node(j) => {
                self.model.nodes[j].op.output_overwritable() && self.reads[v.index] == 1
            }
            _ => false,
        }
    }

    /// Whether `v` takes a gradient: a parameter, or an op's output computed from one. A rule
    /// records no ops for an input's gradient that nothing needs.
    pub fn needs_grad(&self, v: Var) -> bool {
        self.needs[v.index]
    }

    fn param_of(&self, v: Var) -> Option<usize> {
        match self.model.values[v.index].source {
            Source::Param(i) => Some(i),
            _ => None,
        }
    }

    /// Where a rule writes a gradient of `v`: a parameter's `Grad` tensor if it is its first,
    /// else a temporary (`contribute` adds it in).
    pub fn grad_out(&mut self, v: Var) -> TensorId {
        match (self.param_of(v), &self.grads[v.index]) {
            (Some(i), None) => self.state[i][1],
            _ => self.g.temp(self.len(v)),
        }
    }

    /// Adds `t` to the gradient of `v` (`owned`: `t` is this gradient's alone and may be
    /// added into; `known`: the format its values are held in, f32 where none is). The sum is
    /// in f32, into a tensor of `v`'s own.
    pub fn contribute(&mut self, v: Var, t: TensorId, owned: bool, known: Format) {
        if !self.needs[v.index] {
            return;
        }
        let sum = match self.grads[v.index].take() {
            None => {
                self.grads[v.index] = Some(Grad {
                    t,
                    owned,
                    summed: false,
                    known,
                });
                return;
            }
            Some(e) if e.owned => {
                self.g.push(Op::add_in_place(t, e.t));
                e.t
            }
            Some(e) if owned => {
                self.g.push(Op::add_in_place(e.t, t));
                t
            }
            Some(e) => {
                let out = self.g.temp(self.len(v));
                self.g.push(Op::Add {
                    x: e.t,
                    y: t,
                    out,
                    held: Format::F32,
                    y_held: Format::F32,
                    x_held: Format::F32,
                    residual: None,
                    gelu: None,
                });
                out
            }
        };
        self.grads[v.index] = Some(Grad {
            t: sum,
            owned: true,
            summed: true,
            known: Format::F32,
        });
    }

    /// The complete gradient of `v`, held in `v`'s format as autocast holds a tensor's
    /// gradient (a sum, or a gradient its rule left in f32, rounded once): where the tensor
    /// is `v`'s own it is rounded in place (`PlanBuilder::round`: folded into the op that
    /// wrote it where it can); where it is shared with another value, `v`'s rule reads it
    /// rounded (`dy_read`). Returns it with the format the rule reads it in and the format its
    /// values are known to be held in; None where no gradient reaches `v`.
    fn complete(&mut self, v: Var) -> Option<(TensorId, Format, Format)> {
        let grad = self.grads[v.index].take()?;
        let want = self.formats[v.index];
        let known = if grad.summed { Format::F32 } else { grad.known };
        if want == Format::F32 || known == want {
            return Some((grad.t, Format::F32, known));
        }
        if grad.owned {
            self.g.round(grad.t, want);
            return Some((grad.t, Format::F32, want));
        }
        Some((grad.t, want, known))
    }

    /// A matmul into `out` (a fresh tensor when none), held in `held` (the compute format, or
    /// f32 for a product its bias add rounds: `ops::Linear`).
    pub fn mm_with(
        &mut self,
        shape: MatmulShape,
        (algorithm, scales): (Algorithm, Option<[usize; 2]>),
        (a, b): (TensorId, TensorId),
        out: Option<TensorId>,
        held: Format,
    ) -> TensorId {
        let out = out.unwrap_or_else(|| self.g.temp(shape.c_len()));
        self.g.push(Op::Matmul {
            shape,
            algorithm,
            a,
            b,
            out,
            scales,
            held: Format::F32,
        });
        self.g.round(out, held);
        out
    }

    /// A matmul in the step's matmul algorithm, held in the compute format.
    pub fn mm(
        &mut self,
        shape: MatmulShape,
        operands: (TensorId, TensorId),
        out: Option<TensorId>,
    ) -> TensorId {
        self.mm_with(shape, (self.p.matmul, None), operands, out, self.p.compute)
    }

    /// A matmul of linear layer `layer`: fp8 where the precision says so, with the scales of
    /// the operands' roles; delayed scaling records each tensor's amax once per step (input
    /// and weight in the forward matmul, the gradient where it meets the weight). Held in
    /// `held` (`mm_with`).
    pub fn linear_mm(
        &mut self,
        (layer, roles): (usize, (Fp8Role, Fp8Role)),
        shape: MatmulShape,
        (a, b): (TensorId, TensorId),
        out: Option<TensorId>,
        held: Format,
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
        self.mm_with(shape, (algorithm, scales), (a, b), out, held)
    }
}

impl Model {
    /// The plan of one step under `p`: the forward pass to the loss, the backward pass to the
    /// gradients of `loss * loss scale` (each parameter's in its `Grad` tensor, in the stream
    /// format), GradScaler's unscale and finite check, and the AdamW update (weights and
    /// moments held in `p.weights`). Checked by `PlanBuilder::finish`.
    pub fn plan(&self, p: &Precision, options: PlanOptions) -> Result<Plan> {
        let live = self.live();
        let mut g = PlanBuilder::default();
        let state: Vec<[TensorId; 4]> = (self.params.iter().enumerate())
            .map(|(i, param)| {
                let len = param.len();
                [
                    g.tensor(len, TensorKind::Param(i)),
                    g.tensor(len, TensorKind::Grad(i)),
                    g.tensor(len, TensorKind::Moment1(i)),
                    g.tensor(len, TensorKind::Moment2(i)),
                ]
            })
            .collect();
        let (mut tokens, mut targets) = (None, None);
        let mut inputs: Vec<(usize, TensorId)> = vec![];
        let tensors = (self.values.iter().enumerate())
            .map(|(i, value)| match &value.source {
                Source::Param(j) => Some(state[*j][0]),
                Source::Tokens => {
                    tokens = Some(g.tensor(value.len(), TensorKind::Tokens));
                    tokens
                }
                Source::Targets => {
                    targets = Some(g.tensor(value.len(), TensorKind::Targets));
                    targets
                }
                Source::Values(k) => {
                    let t = g.tensor(value.len(), TensorKind::Input);
                    inputs.push((*k, t));
                    Some(t)
                }
                Source::Ids(ids) if live.reads[i] > 0 => {
                    Some(g.constant(ids.iter().map(|&i| f32::from_bits(i)).collect()))
                }
                Source::Ids(_) | Source::Node(_) => None,
            })
            .collect();
        // A plan's batch is a tokens and a targets tensor of the loss's rows: a model that
        // reads neither (values inputs, a regression loss) still has them, unread.
        let rows = self.rows();
        let tokens = tokens.unwrap_or_else(|| g.tensor(rows, TensorKind::Tokens));
        let targets = targets.unwrap_or_else(|| g.tensor(rows, TensorKind::Targets));
        let mut needs = vec![false; self.values.len()];
        for (v, value) in self.values.iter().enumerate() {
            needs[v] = match value.source {
                Source::Param(_) => true,
                Source::Node(j) => self.nodes[j].inputs.iter().any(|x| needs[x.index]),
                _ => false,
            };
        }
        let stats = Stats {
            grads: self.params.len(),
            linears: self.linear_layers(),
        };
        // A parameter is held in the weights' format, a values input in the stream's (a "true"
        // preset's model takes its inputs in its dtype); an op's output as its op says.
        let formats = (self.values.iter())
            .map(|value| match value.source {
                Source::Param(_) => p.weights,
                Source::Values(_) => p.stream,
                _ => Format::F32,
            })
            .collect();
        let mut cx = Emit {
            g,
            p,
            fused_attention: options.fused_attention,
            seed: options.seed,
            model: self,
            reads: live.reads,
            stats,
            state,
            tensors,
            grads: (0..self.values.len()).map(|_| None).collect(),
            needs,
            formats,
            dy_read: Format::F32,
            dy_known: Format::F32,
            linears: 0,
        };
        let mut saved: Vec<Saved> = vec![vec![]; self.nodes.len()];
        for (i, node) in self.nodes.iter().enumerate() {
            cx.formats[node.out.index] = node.op.format(&cx, node);
            if live.nodes[i] {
                let (out, kept) = node.op.forward(&mut cx, node);
                cx.tensors[node.out.index] = Some(out);
                saved[i] = kept;
            }
        }
        let forward = cx.g.ops.len();
        let logits = cx.t(self.nodes[self.loss].inputs[0]);

        for (i, node) in self.nodes.iter().enumerate().rev() {
            if !live.nodes[i] {
                continue;
            }
            let dy = if node.op.is_loss() {
                // The loss op's own pass holds its gradient (times the loss scale).
                (cx.dy_read, cx.dy_known) = (Format::F32, Format::F32);
                TensorId::MAX
            } else {
                match cx.complete(node.out) {
                    Some((dy, read, known)) => {
                        (cx.dy_read, cx.dy_known) = (read, known);
                        dy
                    }
                    None => continue,
                }
            };
            node.op.backward(&mut cx, node, &saved[i], dy);
        }
        // Each parameter's gradient in its `Grad` tensor, held in the stream format (16-bit in
        // "true" presets).
        for (v, value) in self.values.iter().enumerate() {
            if let Source::Param(i) = value.source {
                let grad = cx.state[i][1];
                let got = cx.grads[v].take().map(|g| g.t);
                if let Some(t) = got.filter(|&t| t != grad) {
                    cx.g.push(dense_copy(t, grad, value.len(), Format::F32));
                }
            }
        }
        for i in 0..cx.state.len() {
            let grad = cx.state[i][1];
            cx.g.round(grad, p.stream);
        }

        // GradScaler's unscale and check, then AdamW where every gradient is finite. Without
        // master weights the weights and the optimizer state live in 16-bit. A model of no
        // parameters has neither (its step is its forward pass: the same loss everywhere).
        let backward = cx.g.ops.len();
        let grads: Vec<_> = cx.state.iter().map(|s| s[1]).collect();
        if !grads.is_empty() {
            cx.g.push(Op::UnscaleCheck { grads });
        }
        let gradients = cx.g.ops.len();
        let params: Vec<_> = (cx.state.iter().zip(self.decays()))
            .map(|(&[param, grad, m, v], decay)| AdamWParam {
                param,
                grad,
                m,
                v,
                decay,
            })
            .collect();
        if !params.is_empty() {
            cx.g.push(Op::AdamW {
                params,
                held: p.weights,
            });
        }
        let mut plan = cx.g.finish(Outline {
            forward,
            backward,
            gradients,
            tokens,
            targets,
            logits,
            state: cx.state,
            stats,
        })?;
        if options.coded {
            plan.store_codes();
        }
        Ok(plan)
    }
}

/// out = x, the first `len` values, rounded to `held` as they are copied.
fn dense_copy(x: TensorId, out: TensorId, len: usize, held: Format) -> Op {
    let dims = [1, 1, 1, len as u32];
    Op::Copy {
        x,
        out,
        map: Strided {
            dims,
            src: Strided::dense(dims),
            dst: Strided::dense(dims),
            src_offset: 0,
            dst_offset: 0,
        },
        held,
    }
}

/// Whether plans store the matmuls' 16-bit inputs as codes where nothing else says: yes, unless
/// `MANTISSA_ACTIVATIONS=f32` (to compare memory and step time with f32 storage).
pub fn stores_codes() -> Result<bool> {
    Ok(crate::env::word("MANTISSA_ACTIVATIONS")? != Some("f32"))
}
