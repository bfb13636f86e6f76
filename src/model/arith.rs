//! Sums and means over the last axis, scaling by a constant and subtraction: `Op::RowSum`
//! forward and `Op::Broadcast` back (a sum's gradient repeated over its row; with one repeat,
//! a product with a constant); dropout (`Op::Dropout` both ways: the same mask on dy); rotary
//! position embeddings (`Op::Rotary` both ways: the opposite angles on dy). As in ops.rs, each
//! op whole: its builder method, its forward emission and its backward rule.

use super::derive::{Emit, Saved};
use super::ops::NodeOp;
use super::{ModelBuilder, Node, Var, refuse, shape_of};
use crate::error::Result;
use crate::format::Format;
use crate::plan::{Op, TensorId, rotary};
use crate::policy::{OpClass, OpKind};

impl ModelBuilder {
    /// The sum over the last axis of x [..., c]: [...] (`x.sum(-1)`; autocast runs it in f32,
    /// so it is held in the stream format).
    pub fn sum(&mut self, x: Var) -> Result<Var> {
        self.row_reduce("sum", x, false)
    }

    /// The mean over the last axis of x [..., c]: [...] (`x.mean(-1)`: the sum in f32 divided
    /// by c, held in x's format, as PyTorch's autocast leaves a mean).
    pub fn mean(&mut self, x: Var) -> Result<Var> {
        self.row_reduce("mean", x, true)
    }

    fn row_reduce(&mut self, op: &'static str, x: Var, mean: bool) -> Result<Var> {
        let s = self.operand(op, x)?;
        let [ref lead @ .., c] = s[..] else {
            unreachable!("operands have an axis")
        };
        if lead.is_empty() {
            return Err(refuse(
                op,
                format!(
                    "x {} has one axis, which would leave the scalar only a loss is: reshape \
                     it to [1, {c}]",
                    shape_of(&s)
                ),
            ));
        }
        let node = RowReduce { c, mean };
        Ok(self.node(Box::new(node), vec![x], lead.to_vec()))
    }

    /// x times the constant k, in f32 and held in x's format (`x * k` for a Python float).
    pub fn scale(&mut self, x: Var, k: f64) -> Result<Var> {
        let s = self.operand("scale", x)?;
        if !(k as f32).is_finite() {
            return Err(refuse("scale", format!("{k:?} is not finite in f32")));
        }
        Ok(self.node(Box::new(Scale { k: k as f32 }), vec![x], s))
    }

    /// Dropout of x (`torch.nn.functional.dropout` in training): each element kept with
    /// probability 1 - p and scaled by 1 / (1 - p), else 0, held in x's format. The masks are
    /// `plan::dropout`'s, keyed by the trainer's seed, the step and this dropout's place among
    /// the model's: the same bits on every backend. A trainer in evaluation mode
    /// (`ModelTrainer::training` off) passes x through instead.
    pub fn dropout(&mut self, x: Var, p: f64) -> Result<Var> {
        let s = self.operand("dropout", x)?;
        if !(0.0..1.0).contains(&p) || (p as f32) >= 1.0 {
            return Err(refuse("dropout", format!("p {p:?} is not in [0, 1)")));
        }
        let site = self
            .nodes
            .iter()
            .filter(|n| n.op.name() == "dropout")
            .count();
        let site = u32::try_from(site).map_err(|_| refuse("dropout", "too many dropouts"))?;
        let node = Dropout { p: p as f32, site };
        Ok(self.node(Box::new(node), vec![x], s))
    }

    /// Rotary position embeddings of x [batch, tokens, heads x d] (q or k, before attention):
    /// in each head, value i and value i + d/2 rotated by the angle p base^(-2i/d) at position
    /// p (`plan::rotary`: Hugging Face's `rotate_half` layout; base 10000 in most models),
    /// computed in f32 and held in x's format. d must be even.
    pub fn rotary(&mut self, x: Var, heads: usize, base: f64) -> Result<Var> {
        let s = self.operand("rotary", x)?;
        let [_, t, c] = s[..] else {
            return Err(refuse(
                "rotary",
                format!("x {} must be [batch, tokens, heads x d]", shape_of(&s)),
            ));
        };
        if heads == 0 || c % heads != 0 {
            return Err(refuse(
                "rotary",
                format!(
                    "x {} over {heads} heads: its width is not heads x d",
                    shape_of(&s)
                ),
            ));
        }
        let d = c / heads;
        if !(d.is_multiple_of(2) && base.is_finite() && base > 1.0) {
            return Err(refuse(
                "rotary",
                format!(
                    "x {} over {heads} heads of {d}: heads of an even width, at a base finite \
                     and > 1 (got {base:?})",
                    shape_of(&s)
                ),
            ));
        }
        let table = rotary::table(t, d, base)?;
        Ok(self.node(Box::new(Rotary { t, c, d, table }), vec![x], s))
    }

    /// a - b, of the same shape: a + (-1 . b), the same bits (negation is exact).
    pub fn sub(&mut self, a: Var, b: Var) -> Result<Var> {
        self.same_shapes(("sub", "-"), a, b)?;
        let minus_b = self.scale(b, -1.0)?;
        self.add(a, minus_b)
    }
}

/// A sum or mean of each row of c values.
#[derive(Debug)]
pub(crate) struct RowReduce {
    c: usize,
    mean: bool,
}

impl RowReduce {
    fn divisor(&self) -> f32 {
        if self.mean { self.c as f32 } else { 1.0 }
    }

    /// A sum (0) or a mean (1): autocast lists `sum` (f32), not `mean` (PyTorch's mean of a
    /// 16-bit tensor is 16-bit, summed in f32).
    pub(crate) const KINDS: [OpKind; 2] = [
        OpKind::new("sum", OpClass::F32),
        OpKind::new("mean", OpClass::Input),
    ];
}

impl NodeOp for RowReduce {
    fn kind(&self) -> OpKind {
        RowReduce::KINDS[self.mean as usize]
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let x = cx.t(node.inputs[0]);
        let out = cx.g.temp(cx.g.len(x) / self.c);
        cx.g.push(Op::RowSum {
            x,
            out,
            c: self.c,
            divisor: self.divisor(),
            held: Format::F32,
        });
        cx.g.round(out, cx.format(node.out));
        (out, vec![])
    }

    /// dx: each row's dy repeated over the row (divided by c for a mean), held in x's format.
    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        let x = node.inputs[0];
        let dy = cx.dy_rounded(dy);
        let dx = cx.g.temp(cx.len(x));
        cx.g.push(Op::Broadcast {
            x: dy,
            out: dx,
            c: self.c,
            scale: 1.0,
            divisor: self.divisor(),
            held: Format::F32,
        });
        cx.g.round(dx, cx.format(x));
        cx.contribute(x, dx, true, cx.format(x));
    }
}

/// x times a constant.
#[derive(Debug)]
pub(crate) struct Scale {
    k: f32,
}

impl Scale {
    /// x times k into a new tensor, held in `held` (f32: then rounded by the caller).
    fn times(&self, cx: &mut Emit, x: TensorId) -> TensorId {
        let out = cx.g.temp(cx.g.len(x));
        cx.g.push(Op::Broadcast {
            x,
            out,
            c: 1,
            scale: self.k,
            divisor: 1.0,
            held: Format::F32,
        });
        out
    }
}

impl Scale {
    pub(crate) const KIND: OpKind = OpKind::new("scale", OpClass::Input);
}

impl NodeOp for Scale {
    fn kind(&self) -> OpKind {
        Scale::KIND
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let out = self.times(cx, cx.t(node.inputs[0]));
        cx.g.round(out, cx.format(node.out));
        (out, vec![])
    }

    /// dx = dy * k, held in x's format.
    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        let x = node.inputs[0];
        let dy = cx.dy_rounded(dy);
        let dx = self.times(cx, dy);
        cx.g.round(dx, cx.format(x));
        cx.contribute(x, dx, true, cx.format(x));
    }
}

/// Dropout: x times a mask of `plan::dropout`, and dy times the same mask.
#[derive(Debug)]
pub(crate) struct Dropout {
    p: f32,
    site: u32,
}

impl Dropout {
    fn apply(&self, cx: &mut Emit, x: TensorId) -> TensorId {
        let out = cx.g.temp(cx.g.len(x));
        cx.g.push(Op::Dropout {
            x,
            out,
            p: self.p,
            seed: cx.seed,
            site: self.site,
            held: Format::F32,
        });
        out
    }
}

impl Dropout {
    pub(crate) const KIND: OpKind = OpKind::new("dropout", OpClass::Input);
}

impl NodeOp for Dropout {
    fn kind(&self) -> OpKind {
        Dropout::KIND
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let out = self.apply(cx, cx.t(node.inputs[0]));
        cx.g.round(out, cx.format(node.out));
        (out, vec![])
    }

    /// dx = dy times the forward's mask and scale, held in x's format.
    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        let x = node.inputs[0];
        let dy = cx.dy_rounded(dy);
        let dx = self.apply(cx, dy);
        cx.g.round(dx, cx.format(x));
        cx.contribute(x, dx, true, cx.format(x));
    }
}

/// Rotary position embeddings over rows of c = heads x d at t positions.
#[derive(Debug)]
pub(crate) struct Rotary {
    t: usize,
    c: usize,
    d: usize,
    /// `rotary::table` of t positions of d / 2 pairs (a constant of the plan).
    table: Vec<f32>,
}

impl Rotary {
    fn rotate(&self, cx: &mut Emit, x: TensorId, table: TensorId, inverse: bool) -> TensorId {
        let out = cx.g.temp(cx.g.len(x));
        cx.g.push(Op::Rotary {
            x,
            table,
            out,
            t: self.t,
            c: self.c,
            d: self.d,
            inverse,
            held: Format::F32,
        });
        out
    }
}

impl Rotary {
    pub(crate) const KIND: OpKind = OpKind::new("rotary", OpClass::Input);
}

impl NodeOp for Rotary {
    fn kind(&self) -> OpKind {
        Rotary::KIND
    }

    /// The table is a constant of the plan, kept for the backward.
    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let table = cx.g.constant(self.table.clone());
        let out = self.rotate(cx, cx.t(node.inputs[0]), table, false);
        cx.g.round(out, cx.format(node.out));
        (out, vec![table])
    }

    /// dx = dy rotated by the opposite angles, held in x's format.
    fn backward(&self, cx: &mut Emit, node: &Node, saved: &Saved, dy: TensorId) {
        let x = node.inputs[0];
        let dy = cx.dy_rounded(dy);
        let dx = self.rotate(cx, dy, saved[0], true);
        cx.g.round(dx, cx.format(x));
        cx.contribute(x, dx, true, cx.format(x));
    }
}
