//! The model's ops, each whole in one place: its `ModelBuilder` method (the shapes it takes,
//! checked, an error naming the op and the shapes), its forward emission (the plan ops it
//! records, with the formats the step's `Precision` gives its class) and its backward rule (the
//! plan ops of its inputs' gradients, from its output's). A new op is a method and a `NodeOp`
//! here, beside its plan op and kernels. A rule hands each input's gradient to
//! `Emit::contribute`, which sums the gradients of a value read twice; parameter gradients go
//! straight into their `Grad` tensors where they are the first (`Emit::grad_out`).

use super::derive::{Emit, Saved};
use super::{Model, ModelBuilder, Node, Source, Var, refuse, shape_of};
use crate::algorithm::MatmulShape;
use crate::error::Result;
use crate::format::Format;
use crate::plan::{Attention, MaskKind, Op, ScoreMask, ScoreScale, Strided, TensorId, Unary};
use crate::policy::{Fp8Role, OpClass, OpKind};

/// One kind of model op.
pub(crate) trait NodeOp: std::fmt::Debug + Send + Sync {
    /// Its name and autocast class (one of `vocabulary()`).
    fn kind(&self) -> OpKind;

    /// Its name (the builder method's, the errors' and the autocast overrides').
    fn name(&self) -> &'static str {
        self.kind().name
    }

    /// A loss: its output is the scalar the step minimises (its gradient is the seed).
    fn is_loss(&self) -> bool {
        self.kind().loss
    }

    /// An fp8 linear layer (a slot of amaxes and scales per layer and role).
    fn is_linear(&self) -> bool {
        false
    }

    /// A loss's rows: the length of the batch's tokens and targets it implies.
    fn loss_rows(&self, _model: &Model, _node: &Node) -> usize {
        0
    }

    /// The head width of an attention op (whether a backend fuses it depends on it).
    fn attention_head_dim(&self) -> Option<usize> {
        None
    }

    /// Whether its input `input` is read as an additive bias alone (an attention's: -inf there
    /// leaves a key out).
    fn reads_as_bias(&self, _input: usize) -> bool {
        false
    }

    /// Whether its output may be overwritten once its readers have read it: not where the
    /// backward rule reads it, nor where it is another value's tensor (a view).
    fn output_overwritable(&self) -> bool {
        true
    }

    /// The format its output is held in, as autocast holds the tensor: its class's
    /// (`Precision::held`), an op that runs in its inputs' dtype keeping theirs (`cx.format`),
    /// several of them promoted.
    fn format(&self, cx: &Emit, node: &Node) -> Format {
        let inputs = node.inputs.iter().map(|&x| cx.format(x));
        let input = inputs.reduce(promote).unwrap_or(cx.p.stream);
        cx.p.held(self.kind(), input)
    }

    /// Records the forward ops; returns the output's tensor and what the backward reads.
    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved);

    /// Records the backward ops from `dy`, the gradient of the output (complete; read in
    /// `cx.dy_read`: its ops round it as they read it, or `cx.dy_rounded`), contributing each
    /// input's gradient with the format its values are held in.
    fn backward(&self, cx: &mut Emit, node: &Node, saved: &Saved, dy: TensorId);
}

/// The dtype PyTorch's type promotion gives an elementwise op of two tensors: theirs where
/// they agree, else f32 (f32 with a 16-bit one, or bf16 with f16).
fn promote(a: Format, b: Format) -> Format {
    if a == b { a } else { Format::F32 }
}

impl ModelBuilder {
    /// Rows of `table` (`[rows, c]`) picked by `ids` (tokens or constant ids): ids' shape + `[c]`.
    pub fn embedding(&mut self, table: Var, ids: Var) -> Result<Var> {
        let t = self.operand("embedding", table)?;
        let ids_value = self.read("embedding", ids)?;
        let (id_shape, source) = (ids_value.shape.clone(), ids_value.source.clone());
        let [rows, c] = t[..] else {
            return Err(refuse(
                "embedding",
                format!("table {} is not [rows, width]", shape_of(&t)),
            ));
        };
        match source {
            Source::Tokens => {}
            Source::Ids(values) => {
                if let Some(bad) = values.iter().find(|&&i| i as usize >= rows) {
                    return Err(refuse(
                        "embedding",
                        format!("id {bad} is outside table {}", shape_of(&t)),
                    ));
                }
            }
            _ => {
                return Err(refuse(
                    "embedding",
                    format!(
                        "ids {} must be the tokens or constant ids",
                        shape_of(&id_shape)
                    ),
                ));
            }
        }
        let mut shape = id_shape;
        shape.push(c);
        Ok(self.node(Box::new(Embedding { rows, c }), vec![table, ids], shape))
    }
}

#[derive(Debug)]
pub(crate) struct Embedding {
    pub rows: usize,
    pub c: usize,
}

impl Embedding {
    pub(crate) const KIND: OpKind = OpKind::new("embedding", OpClass::Input);
}

impl NodeOp for Embedding {
    fn kind(&self) -> OpKind {
        Embedding::KIND
    }

    fn format(&self, cx: &Emit, node: &Node) -> Format {
        cx.format(node.inputs[0])
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let (table, ids) = (cx.t(node.inputs[0]), cx.t(node.inputs[1]));
        let out = cx.g.temp(cx.len(node.out));
        cx.g.push(Op::Embedding {
            table,
            ids,
            out,
            c: self.c,
        });
        (out, vec![])
    }

    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        let (table, ids) = (node.inputs[0], cx.t(node.inputs[1]));
        let dy = cx.dy_rounded(dy);
        let out = cx.grad_out(table);
        cx.g.push(Op::EmbeddingBwd {
            dout: dy,
            ids,
            out,
            rows: self.rows,
            c: self.c,
        });
        cx.contribute(table, out, true, Format::F32);
    }
}

impl ModelBuilder {
    /// x (`[..., k]`) . w (`[k, m]`) + b (`[m]`): a linear layer (fp8 where the precision says so).
    pub fn linear(&mut self, x: Var, w: Var, b: Var) -> Result<Var> {
        let (xs, ws, bs) = (
            self.operand("linear", x)?,
            self.operand("linear", w)?,
            self.operand("linear", b)?,
        );
        let k = *xs.last().expect("shapes have an axis");
        match (&ws[..], &bs[..]) {
            ([wk, m], [bm]) if *wk == k && bm == m => {
                let mut shape = xs.clone();
                *shape.last_mut().expect("shapes have an axis") = *m;
                Ok(self.node(Box::new(Linear { k, m: *m }), vec![x, w, b], shape))
            }
            _ => Err(refuse(
                "linear",
                format!(
                    "x {} . w {} + b {}: w must be [{k}, m] and b [m]",
                    shape_of(&xs),
                    shape_of(&ws),
                    shape_of(&bs)
                ),
            )),
        }
    }
}

/// x . w + b: a linear layer, its matmuls fp8 where the precision says so.
#[derive(Debug)]
pub(crate) struct Linear {
    pub k: usize,
    pub m: usize,
}

impl Linear {
    pub(crate) const KIND: OpKind = OpKind::new("linear", OpClass::MatmulLike);
}

impl NodeOp for Linear {
    fn kind(&self) -> OpKind {
        Linear::KIND
    }

    fn is_linear(&self) -> bool {
        true
    }

    /// y = x . w + b as autocast's linear computes it (cuBLASLt's bias epilogue, or the GEMM
    /// with beta = 1 over the bias): the bias rounded to the compute format, added to the f32
    /// product, the sum rounded once to the compute format (the product is not rounded first).
    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let [x, w, b] = [0, 1, 2].map(|i| cx.t(node.inputs[i]));
        let layer = cx.next_linear();
        let n = cx.g.len(x) / self.k;
        let roles = (Fp8Role::Input, Fp8Role::Weight);
        let shape = MatmulShape::new(n, self.m, self.k);
        let y = cx.linear_mm((layer, roles), shape, (x, w), None, Format::F32);
        cx.g.push(Op::Add {
            x: b,
            y,
            out: y,
            held: Format::F32,
            y_held: Format::F32,
            x_held: cx.p.compute,
            residual: None,
            gelu: None,
        });
        cx.g.round(y, cx.p.compute);
        (y, vec![layer])
    }

    /// dW = x^T . dy and db = column sums of dy; dx = dy . W^T. The output is held in the
    /// compute format, and so is its gradient as autocast holds it: the bias gradient sums dy
    /// rounded to it (the matmuls round their operands to it already) and is held in it (the
    /// gradient of the bias's compute-format copy).
    fn backward(&self, cx: &mut Emit, node: &Node, saved: &Saved, dy: TensorId) {
        let [x, w, b] = [node.inputs[0], node.inputs[1], node.inputs[2]];
        let (tx, tw, layer) = (cx.t(x), cx.t(w), saved[0]);
        let n = cx.g.len(tx) / self.k;
        let compute = cx.p.compute;
        let db = cx.grad_out(b);
        cx.g.push(Op::ColumnSums {
            x: dy,
            out: db,
            c: self.m,
            x_held: cx.p.compute,
            held: Format::F32,
        });
        cx.g.round(db, compute);
        cx.contribute(b, db, true, compute);
        let dw = cx.grad_out(w);
        let roles = (Fp8Role::Input, Fp8Role::Grad);
        let shape = transposed_a(self.k, self.m, n);
        let operand = cx.dy_for(cx.p.linear_algorithm(roles), dy);
        cx.linear_mm((layer, roles), shape, (tx, operand), Some(dw), compute);
        cx.contribute(w, dw, true, compute);
        if !cx.needs_grad(x) {
            return;
        }
        let roles = (Fp8Role::Grad, Fp8Role::Weight);
        let shape = transposed_b(n, self.k, self.m);
        let operand = cx.dy_for(cx.p.linear_algorithm(roles), dy);
        let dx = cx.linear_mm((layer, roles), shape, (operand, tw), None, compute);
        cx.contribute(x, dx, true, compute);
    }
}

impl ModelBuilder {
    /// x ([..., k]) . w, w [k, m] (or [m, k] used transposed where `transpose_w`): a matmul in
    /// the step's matmul algorithm, not a linear layer (never fp8; e.g. a head tied to an
    /// embedding table).
    pub fn matmul(&mut self, x: Var, w: Var, transpose_w: bool) -> Result<Var> {
        let (xs, ws) = (self.operand("matmul", x)?, self.operand("matmul", w)?);
        let k = *xs.last().expect("shapes have an axis");
        let m = match (&ws[..], transpose_w) {
            ([wk, m], false) if *wk == k => *m,
            ([m, wk], true) if *wk == k => *m,
            _ => {
                return Err(refuse(
                    "matmul",
                    format!(
                        "x {} . w{} {}: w's {} axis must be {k}",
                        shape_of(&xs),
                        if transpose_w { "^T" } else { "" },
                        shape_of(&ws),
                        if transpose_w { "second" } else { "first" }
                    ),
                ));
            }
        };
        let mut shape = xs;
        *shape.last_mut().expect("shapes have an axis") = m;
        Ok(self.node(Box::new(Matmul { k, m, transpose_w }), vec![x, w], shape))
    }
}

/// x . w (or x . w^T) in the step's matmul algorithm.
#[derive(Debug)]
pub(crate) struct Matmul {
    pub k: usize,
    pub m: usize,
    pub transpose_w: bool,
}

impl Matmul {
    pub(crate) const KIND: OpKind = OpKind::new("matmul", OpClass::MatmulLike);
}

impl NodeOp for Matmul {
    fn kind(&self) -> OpKind {
        Matmul::KIND
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let (x, w) = (cx.t(node.inputs[0]), cx.t(node.inputs[1]));
        let n = cx.g.len(x) / self.k;
        let shape = MatmulShape::batched(1, (n, self.m, self.k), false, self.transpose_w);
        (cx.mm(shape, (x, w), None), vec![])
    }

    /// dx = dy . w^T (dy . w where transposed); dw = x^T . dy (dy^T . x).
    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        let (x, w) = (node.inputs[0], node.inputs[1]);
        let (tx, tw) = (cx.t(x), cx.t(w));
        let (n, k, m) = (cx.g.len(tx) / self.k, self.k, self.m);
        let (dy, compute) = (cx.dy_for(cx.p.matmul, dy), cx.p.compute);
        let (dx_shape, dw_shape, dw_operands) = if self.transpose_w {
            let dw = MatmulShape::batched(1, (m, k, n), true, false);
            (MatmulShape::new(n, k, m), dw, (dy, tx))
        } else {
            (transposed_b(n, k, m), transposed_a(k, m, n), (tx, dy))
        };
        if cx.needs_grad(x) {
            let dx = cx.mm(dx_shape, (dy, tw), None);
            cx.contribute(x, dx, true, compute);
        }
        let dw = cx.grad_out(w);
        cx.mm(dw_shape, dw_operands, Some(dw));
        cx.contribute(w, dw, true, compute);
    }
}

impl ModelBuilder {
    /// The matrix products of two values' last two axes (`torch.matmul` of two activations,
    /// no broadcasting): a [..., m, k] . b [..., k, n] (b [..., n, k] used transposed where
    /// `transpose_b`), the leading axes the same, in the step's matmul algorithm (never fp8).
    pub fn bmm(&mut self, a: Var, b: Var, transpose_b: bool) -> Result<Var> {
        let (as_, bs) = (self.operand("bmm", a)?, self.operand("bmm", b)?);
        let bad = || {
            refuse(
                "bmm",
                format!(
                    "a {} . b{} {}: must be [..., m, k] and [..., {}] with the same leading axes",
                    shape_of(&as_),
                    if transpose_b { "^T" } else { "" },
                    shape_of(&bs),
                    if transpose_b { "n, k" } else { "k, n" }
                ),
            )
        };
        let (n_a, n_b) = (as_.len(), bs.len());
        if n_a < 2 || n_a != n_b || as_[..n_a - 2] != bs[..n_b - 2] {
            return Err(bad());
        }
        let (m, k) = (as_[n_a - 2], as_[n_a - 1]);
        let (bk, n) = match transpose_b {
            false => (bs[n_b - 2], bs[n_b - 1]),
            true => (bs[n_b - 1], bs[n_b - 2]),
        };
        if bk != k {
            return Err(bad());
        }
        let mut shape = as_.clone();
        shape[n_a - 1] = n;
        Self::checked_shape("bmm", &shape)?;
        let batch = as_[..n_a - 2].iter().product();
        let op = Bmm {
            batch,
            m,
            n,
            k,
            transpose_b,
        };
        Ok(self.node(Box::new(op), vec![a, b], shape))
    }
}

/// `batch` products a (m x k) . b (k x n, or n x k used transposed), both operands values.
#[derive(Debug)]
pub(crate) struct Bmm {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub transpose_b: bool,
}

impl Bmm {
    pub(crate) const KIND: OpKind = OpKind::new("bmm", OpClass::MatmulLike);
}

impl NodeOp for Bmm {
    fn kind(&self) -> OpKind {
        Bmm::KIND
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let (a, b) = (cx.t(node.inputs[0]), cx.t(node.inputs[1]));
        let (m, n, k) = (self.m, self.n, self.k);
        let shape = MatmulShape::batched(self.batch, (m, n, k), false, self.transpose_b);
        (cx.mm(shape, (a, b), None), vec![])
    }

    /// da = dy . b^T (dy . b where b is used transposed); db = a^T . dy (dy^T . a).
    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        let (a, b) = (node.inputs[0], node.inputs[1]);
        let (ta, tb) = (cx.t(a), cx.t(b));
        let (batch, m, n, k) = (self.batch, self.m, self.n, self.k);
        let (dy, compute) = (cx.dy_for(cx.p.matmul, dy), cx.p.compute);
        let shape = |(m, n, k), ta, tb| MatmulShape::batched(batch, (m, n, k), ta, tb);
        if cx.needs_grad(a) {
            let da = cx.mm(shape((m, k, n), false, !self.transpose_b), (dy, tb), None);
            cx.contribute(a, da, true, compute);
        }
        if cx.needs_grad(b) {
            let db = match self.transpose_b {
                false => cx.mm(shape((k, n, m), true, false), (ta, dy), None),
                true => cx.mm(shape((n, k, m), true, false), (dy, ta), None),
            };
            cx.contribute(b, db, true, compute);
        }
    }
}

impl ModelBuilder {
    /// Layer norm of x (`[..., c]`) over its last axis, gain g and bias b (`[c]`).
    pub fn layer_norm(&mut self, x: Var, g: Var, b: Var) -> Result<Var> {
        let (xs, gs, bs) = (
            self.operand("layer_norm", x)?,
            self.operand("layer_norm", g)?,
            self.operand("layer_norm", b)?,
        );
        let c = *xs.last().expect("shapes have an axis");
        if gs != [c] || bs != [c] {
            return Err(refuse(
                "layer_norm",
                format!(
                    "x {} with g {} and b {}: both must be [{c}]",
                    shape_of(&xs),
                    shape_of(&gs),
                    shape_of(&bs)
                ),
            ));
        }
        Ok(self.node(Box::new(LayerNorm { c }), vec![x, g, b], xs))
    }
}

#[derive(Debug)]
pub(crate) struct LayerNorm {
    pub c: usize,
}

impl LayerNorm {
    pub(crate) const KIND: OpKind = OpKind::new("layer_norm", OpClass::F32);
}

impl NodeOp for LayerNorm {
    fn kind(&self) -> OpKind {
        LayerNorm::KIND
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let [x, g, b] = [0, 1, 2].map(|i| cx.t(node.inputs[i]));
        let len = cx.g.len(x);
        let (out, stats) = (cx.g.temp(len), cx.g.temp(2 * len / self.c));
        cx.g.push(Op::LayerNorm {
            x,
            g,
            b,
            out,
            stats,
            c: self.c,
            held: Format::F32,
        });
        cx.g.round(out, cx.format(node.out));
        (out, vec![stats])
    }

    fn backward(&self, cx: &mut Emit, node: &Node, saved: &Saved, dy: TensorId) {
        let [x, g, b] = [node.inputs[0], node.inputs[1], node.inputs[2]];
        let (tx, tg) = (cx.t(x), cx.t(g));
        let dx = cx.g.temp(cx.g.len(tx));
        let dg = cx.grad_out(g);
        // One value as gain and bias: the bias's gradient is the second one's, in a tensor of
        // its own.
        let db = if g == b {
            cx.g.temp(self.c)
        } else {
            cx.grad_out(b)
        };
        cx.g.push(Op::LayerNormBwd {
            dy,
            x: tx,
            g: tg,
            stats: saved[0],
            dx,
            dg,
            db,
            c: self.c,
            dy_held: cx.dy_read,
            sum: None,
        });
        cx.contribute(g, dg, true, Format::F32);
        cx.contribute(b, db, true, Format::F32);
        cx.contribute(x, dx, true, Format::F32);
    }
}

impl ModelBuilder {
    /// f(x) of every element, for a function of the unary family (GELU, SiLU, ReLU, sigmoid,
    /// tanh: `plan::Unary`), held in x's format as is its gradient (autocast runs these in
    /// their input's dtype, usually a matmul's, computing in f32).
    pub fn unary(&mut self, f: Unary, x: Var) -> Result<Var> {
        let xs = self.operand(f.name(), x)?;
        Ok(self.node(Box::new(f), vec![x], xs))
    }

    /// GELU (tanh form) of every element.
    pub fn gelu(&mut self, x: Var) -> Result<Var> {
        self.unary(Unary::Gelu, x)
    }

    /// SiLU (x * sigmoid(x)) of every element.
    pub fn silu(&mut self, x: Var) -> Result<Var> {
        self.unary(Unary::Silu, x)
    }

    /// ReLU (max(x, 0), a NaN kept) of every element.
    pub fn relu(&mut self, x: Var) -> Result<Var> {
        self.unary(Unary::Relu, x)
    }

    /// The logistic sigmoid of every element.
    pub fn sigmoid(&mut self, x: Var) -> Result<Var> {
        self.unary(Unary::Sigmoid, x)
    }

    /// tanh of every element.
    pub fn tanh(&mut self, x: Var) -> Result<Var> {
        self.unary(Unary::Tanh, x)
    }
}

/// A function of the unary family: its name, and autocast's class of those (none is on
/// autocast's lists: each runs in its input's format).
pub(crate) fn unary_kind(f: Unary) -> OpKind {
    OpKind::new(f.name(), OpClass::Input)
}

impl NodeOp for Unary {
    fn kind(&self) -> OpKind {
        unary_kind(*self)
    }

    fn output_overwritable(&self) -> bool {
        !self.reads_output()
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let x = cx.t(node.inputs[0]);
        let out = cx.g.temp(cx.g.len(x));
        let held = Format::F32;
        cx.g.push(Op::Unary {
            f: *self,
            x,
            out,
            held,
        });
        cx.g.round(out, cx.format(node.out));
        (out, vec![])
    }

    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        let x = node.inputs[0];
        let tx = cx.t(x);
        // Sigmoid's and tanh's derivatives read the output as held (`Unary::reads_output`).
        let read = if self.reads_output() {
            cx.t(node.out)
        } else {
            tx
        };
        let out = cx.g.temp(cx.g.len(tx));
        cx.g.push(Op::UnaryBwd {
            f: *self,
            x: read,
            dy,
            out,
            held: Format::F32,
            dy_held: cx.dy_read,
        });
        cx.g.round(out, cx.format(x));
        cx.contribute(x, out, true, cx.format(x));
    }
}

impl ModelBuilder {
    /// a + b, of the same shape (a residual connection, or two embeddings).
    pub fn add(&mut self, a: Var, b: Var) -> Result<Var> {
        let shape = self.same_shapes(("add", "+"), a, b)?;
        Ok(self.node(Box::new(Add), vec![a, b], shape))
    }

    /// The shape of an elementwise op's two operands, which must be the same.
    pub(super) fn same_shapes(
        &self,
        (op, sign): (&str, &str),
        a: Var,
        b: Var,
    ) -> Result<Vec<usize>> {
        let (as_, bs) = (self.operand(op, a)?, self.operand(op, b)?);
        if as_ != bs {
            return Err(refuse(
                op,
                format!("{} {sign} {}: shapes differ", shape_of(&as_), shape_of(&bs)),
            ));
        }
        Ok(as_)
    }
}

/// a + b in f32, held in the operands' format (f32 where they differ: the residual stream plus
/// a 16-bit projection), in place into an operand nothing reads after it.
#[derive(Debug)]
pub(crate) struct Add;

impl Add {
    pub(crate) const KIND: OpKind = OpKind::new("add", OpClass::Input);
}

impl NodeOp for Add {
    fn kind(&self) -> OpKind {
        Add::KIND
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let (a, b) = (node.inputs[0], node.inputs[1]);
        let (ta, tb) = (cx.t(a), cx.t(b));
        let out = if a != b && cx.overwritable(a) {
            cx.g.push(Op::add_in_place(tb, ta));
            ta
        } else if a != b && cx.overwritable(b) {
            cx.g.push(Op::add_in_place(ta, tb));
            tb
        } else {
            let out = cx.g.temp(cx.g.len(ta));
            cx.g.push(Op::Add {
                x: ta,
                y: tb,
                out,
                held: Format::F32,
                y_held: Format::F32,
                x_held: Format::F32,
                residual: None,
                gelu: None,
            });
            out
        };
        cx.g.round(out, cx.format(node.out));
        (out, vec![])
    }

    /// Each operand's gradient is dy (each rounded to its operand's format once complete).
    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        let known = cx.dy_known;
        for &x in &node.inputs {
            cx.contribute(x, dy, false, known);
        }
    }
}

impl ModelBuilder {
    /// Causal self-attention of q|k|v ([b, t, 3c], each token's q, k, v side by side) over
    /// `heads` heads of c / heads: [b, t, c]. One fused op where the plan is asked for it
    /// (`PlanOptions::fused_attention`), else the separate ops (heads copied out, scores,
    /// causal softmax, P.v, heads copied back).
    pub fn causal_attention(&mut self, qkv: Var, heads: usize) -> Result<Var> {
        self.self_attention("causal_attention", qkv, heads, true, None)
    }

    /// Self-attention without a mask (every token sees every token: an encoder's), q|k|v and
    /// heads as `causal_attention`'s; always the separate ops (the fused kernels are causal).
    pub fn attention(&mut self, qkv: Var, heads: usize) -> Result<Var> {
        self.self_attention("attention", qkv, heads, false, None)
    }

    /// `attention` leaving out the keys `key_mask` masks: a values input [batch, tokens],
    /// nonzero where the key is padding (PyTorch's `key_padding_mask`). A masked key's
    /// probability is 0 in every head and query of its sequence; a query that sees no key
    /// attends to nothing (0, where PyTorch gives NaN). Always the separate ops.
    pub fn attention_masked(&mut self, qkv: Var, heads: usize, key_mask: Var) -> Result<Var> {
        let mask = Some((key_mask, MaskKind::Keys));
        self.self_attention("attention_masked", qkv, heads, false, mask)
    }

    /// `causal_attention` leaving out the keys `key_mask` masks (as `attention_masked`'s);
    /// always the separate ops.
    pub fn causal_attention_masked(
        &mut self,
        qkv: Var,
        heads: usize,
        key_mask: Var,
    ) -> Result<Var> {
        let mask = Some((key_mask, MaskKind::Keys));
        self.self_attention("causal_attention_masked", qkv, heads, true, mask)
    }

    /// `attention` with `bias` added to every head's scaled scores before the softmax (in f32,
    /// as PyTorch adds a float `attn_mask`): [tokens, tokens] for every sequence and head,
    /// [heads, tokens, tokens] per head (ALiBi's slopes), [batch, tokens, tokens] per sequence
    /// or [batch, heads, tokens, tokens]. A values input may hold -inf, which leaves a key out
    /// (a query that sees no key attends to nothing: 0, where PyTorch gives NaN); a parameter
    /// or an op's output gets its gradient (a learned relative position bias). Always the
    /// separate ops.
    pub fn attention_biased(&mut self, qkv: Var, heads: usize, bias: Var) -> Result<Var> {
        let mask = Some((bias, MaskKind::Bias));
        self.self_attention("attention_biased", qkv, heads, false, mask)
    }

    /// `causal_attention` with `bias` added to the scores it sees (as `attention_biased`'s);
    /// always the separate ops.
    pub fn causal_attention_biased(&mut self, qkv: Var, heads: usize, bias: Var) -> Result<Var> {
        let mask = Some((bias, MaskKind::Bias));
        self.self_attention("causal_attention_biased", qkv, heads, true, mask)
    }

    fn self_attention(
        &mut self,
        op: &str,
        qkv: Var,
        heads: usize,
        causal: bool,
        mask: Option<(Var, MaskKind)>,
    ) -> Result<Var> {
        let s = self.operand(op, qkv)?;
        let [b, t, c3] = s[..] else {
            return Err(self.attention_refused(op, &s, heads));
        };
        if heads == 0 || heads > c3 / 3 || c3 % (3 * heads) != 0 {
            return Err(self.attention_refused(op, &s, heads));
        }
        let mut inputs = vec![qkv];
        let mut layout = None;
        if let Some((mask, kind)) = mask {
            let value = self.read(op, mask)?;
            let ht = heads * t;
            // (stride, period) of `ScoreMask` by the mask's shape.
            let (wanted, found) = match kind {
                MaskKind::Keys => ("the key mask", (value.shape == [b, t]).then_some((1, 1))),
                MaskKind::Bias => (
                    "the bias",
                    match value.shape[..] {
                        [i, j] if [i, j] == [t, t] => Some((0, t)),
                        [h, i, j] if [h, i, j] == [heads, t, t] => Some((0, ht)),
                        [n, i, j] if [n, i, j] == [b, t, t] => Some((t, t)),
                        [n, h, i, j] if [n, h, i, j] == [b, heads, t, t] => Some((ht, ht)),
                        _ => None,
                    },
                ),
            };
            let shapes = match kind {
                MaskKind::Keys => "[batch, tokens]",
                MaskKind::Bias => {
                    "[tokens, tokens], [heads, tokens, tokens], [batch, tokens, tokens] or \
                     [batch, heads, tokens, tokens]"
                }
            };
            // A key mask is data (0 or 1, no gradient); a bias may be learned or computed.
            let readable = match kind {
                MaskKind::Keys => matches!(value.source, super::Source::Values(_)),
                MaskKind::Bias => !value.is_ids() && !value.shape.is_empty(),
            };
            let what = match kind {
                MaskKind::Keys => "a values input",
                MaskKind::Bias => "a values input, a parameter or an op's output,",
            };
            let Some((stride, period)) = found.filter(|_| readable) else {
                return Err(refuse(
                    op,
                    format!(
                        "{wanted} {} must be {what} {shapes} of q|k|v {} over {heads} heads",
                        shape_of(&value.shape),
                        shape_of(&s)
                    ),
                ));
            };
            layout = Some(MaskLayout {
                kind,
                stride,
                period,
            });
            inputs.push(mask);
        }
        let attention = CausalAttention {
            b,
            t,
            h: heads,
            d: c3 / 3 / heads,
            causal,
            mask: layout,
        };
        Ok(self.node(Box::new(attention), inputs, vec![b, t, c3 / 3]))
    }

    fn attention_refused(&self, op: &str, s: &[usize], heads: usize) -> crate::error::Error {
        refuse(
            op,
            format!(
                "qkv {} over {heads} heads: must be [batch, tokens, 3 x heads x head width]",
                shape_of(s)
            ),
        )
    }
}

/// Self-attention, causal (fused, `Op::Attention`, or as separate ops, with the same
/// numerics) or unmasked (the separate ops).
#[derive(Debug)]
pub(crate) struct CausalAttention {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub d: usize,
    /// Row i of each score matrix sees keys 0..=i; else every key.
    pub causal: bool,
    /// A key padding mask or a bias, the node's second input, and how the scores read it (the
    /// separate ops always).
    pub mask: Option<MaskLayout>,
}

/// How an attention's scores read its mask (`ScoreMask`, a sequence's heads x t rows a block).
#[derive(Clone, Copy, Debug)]
pub(crate) struct MaskLayout {
    pub kind: MaskKind,
    pub stride: usize,
    pub period: usize,
}

impl CausalAttention {
    /// 1 / sqrt(d) as an f32, as CUDA computes the reciprocal of `att / sqrt(d)`'s divisor.
    fn scale(&self) -> f64 {
        (1.0 / (self.d as f64).sqrt() as f32) as f64
    }

    /// The format the probabilities are held in: softmax's (its override applies).
    fn probs(cx: &Emit) -> Format {
        cx.p.held(Softmax::KINDS[0], Format::F32)
    }

    fn spec(&self, cx: &Emit) -> Attention {
        let p = cx.p;
        Attention {
            b: self.b,
            t: self.t,
            h: self.h,
            d: self.d,
            scale: self.scale(),
            algorithm: p.matmul,
            probs: Self::probs(cx),
            compute: p.compute,
        }
    }

    /// How the unfused softmax reads the scores: times the scale, held in the compute format
    /// like the scores themselves (fused attention: `Attention::score_scale`).
    fn score_scale(&self, cx: &Emit) -> ScoreScale {
        ScoreScale {
            scale: self.scale(),
            held: cx.p.compute,
        }
    }
}

impl CausalAttention {
    /// The gradient of a bias the scores read (`MaskKind::Bias`): the softmax's gradient dz
    /// with respect to its input (the scaled scores plus the bias, in f32, as PyTorch adds an
    /// f32 `attn_mask`), summed over the score rows that read each bias row: over sequences
    /// and heads for [t, t], over sequences for [heads, t, t] (column sums of rows of one
    /// period), over heads for [batch, t, t] (a transpose puts them last), none for
    /// [batch, heads, t, t].
    fn bias_gradient(
        &self,
        cx: &mut Emit,
        bias: Var,
        layout: MaskLayout,
        att: TensorId,
        datt: TensorId,
    ) {
        let (b, h, t) = (self.b, self.h, self.t);
        let dz = cx.g.temp(b * h * t * t);
        cx.g.push(Op::SoftmaxBwd {
            p: att,
            dp: datt,
            out: dz,
            t,
            causal: self.causal,
            scale: ScoreScale {
                scale: 1.0,
                held: Format::F32,
            },
            dp_held: Format::F32,
        });
        let grad = if layout.stride == 0 {
            let out = cx.grad_out(bias);
            cx.g.push(Op::ColumnSums {
                x: dz,
                out,
                c: layout.period * t,
                x_held: Format::F32,
                held: Format::F32,
            });
            out
        } else if layout.stride == h * t {
            dz
        } else {
            let by_head = cx.g.temp(b * h * t * t);
            cx.g.copy(dz, by_head, Strided::transpose(b, h, t * t), Format::F32);
            let out = cx.grad_out(bias);
            cx.g.push(Op::RowSum {
                x: by_head,
                out,
                c: h,
                divisor: 1.0,
                held: Format::F32,
            });
            out
        };
        cx.contribute(bias, grad, true, Format::F32);
    }
}

impl CausalAttention {
    /// Without the causal mask (0) and with it (1).
    pub(crate) const KINDS: [OpKind; 2] = [
        OpKind::new("attention", OpClass::MatmulLike),
        OpKind::new("causal_attention", OpClass::MatmulLike),
    ];
}

impl NodeOp for CausalAttention {
    fn kind(&self) -> OpKind {
        CausalAttention::KINDS[self.causal as usize]
    }

    /// Only the causal attention without a key mask has fused kernels (and so a say in
    /// whether a plan fuses).
    fn attention_head_dim(&self) -> Option<usize> {
        (self.causal && self.mask.is_none()).then_some(self.d)
    }

    fn reads_as_bias(&self, input: usize) -> bool {
        input == 1 && self.mask.is_some_and(|m| m.kind == MaskKind::Bias)
    }

    /// Fused: q|k|v and each score row's (max, sum) kept. Unfused: q, k, v copied out by head,
    /// scores, softmax, P.v, the heads copied back into rows; q, k, v and P kept.
    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let qkv = cx.t(node.inputs[0]);
        let (b, t, h, d) = (self.b, self.t, self.h, self.d);
        if cx.fused_attention && self.attention_head_dim().is_some() {
            let spec = self.spec(cx);
            let (out, stats) = (cx.g.temp(spec.out_len()), cx.g.temp(2 * spec.score_rows()));
            cx.g.push(Op::Attention {
                qkv,
                out,
                stats,
                spec,
            });
            return (out, vec![stats]);
        }
        let n = b * t * h * d;
        let [q, k, v] = [0, 1, 2].map(|part| {
            let out = cx.g.temp(n);
            cx.g.copy(qkv, out, Strided::split_head(part, b, t, h, d), Format::F32);
            out
        });
        let scores = cx.mm(
            MatmulShape::batched(b * h, (t, t, d), false, true),
            (q, k),
            None,
        );
        let att = cx.g.temp(b * h * t * t);
        let mask = (node.inputs.get(1).zip(self.mask)).map(|(&mask, l)| ScoreMask {
            mask: cx.t(mask),
            kind: l.kind,
            block: h * t,
            stride: l.stride,
            period: l.period,
        });
        cx.g.push(Op::Softmax {
            x: scores,
            out: att,
            t,
            causal: self.causal,
            mask,
            scale: self.score_scale(cx),
            x_held: Format::F32,
        });
        cx.g.round(att, Self::probs(cx));
        let y = cx.mm(
            MatmulShape::batched(b * h, (t, d, t), false, false),
            (att, v),
            None,
        );
        let rows = cx.g.temp(n);
        cx.g.copy(y, rows, Strided::heads_to_rows(b, t, h, d), Format::F32);
        (rows, vec![q, k, v, att])
    }

    fn backward(&self, cx: &mut Emit, node: &Node, saved: &Saved, dy: TensorId) {
        let qkv = node.inputs[0];
        let (b, t, h, d) = (self.b, self.t, self.h, self.d);
        let dqkv = cx.g.temp(cx.len(qkv));
        if let [stats] = saved[..] {
            let spec = self.spec(cx);
            // It reads dout only as an operand of its products (`Op::reads_rounded`).
            let dy = cx.dy_for(spec.algorithm, dy);
            let delta = cx.g.temp(spec.score_rows());
            cx.g.push(Op::AttentionBwd {
                qkv: cx.t(qkv),
                dout: dy,
                stats,
                delta,
                dqkv,
                spec,
            });
        } else {
            let [q, k, v, att] = saved[..] else {
                unreachable!("unfused attention keeps q, k, v and P")
            };
            let dy_heads = cx.g.temp(b * t * h * d);
            cx.g.copy(dy, dy_heads, Strided::rows_to_heads(b, t, h, d), cx.dy_read);
            let bh = b * h;
            let shape = |m, n, k, ta, tb| MatmulShape::batched(bh, (m, n, k), ta, tb);
            let datt = cx.mm(shape(t, t, d, false, true), (dy_heads, v), None);
            let dv = cx.mm(shape(t, d, t, true, false), (att, dy_heads), None);
            let dscores = cx.g.temp(bh * t * t);
            cx.g.push(Op::SoftmaxBwd {
                p: att,
                dp: datt,
                out: dscores,
                t,
                causal: self.causal,
                scale: self.score_scale(cx),
                dp_held: Format::F32,
            });
            if let (Some(&bias), Some(layout)) = (node.inputs.get(1), self.mask)
                && layout.kind == MaskKind::Bias
                && cx.needs_grad(bias)
            {
                self.bias_gradient(cx, bias, layout, att, datt);
            }
            // Held in the compute format already (`ScoreScale::held`): no rounding after it.
            let dq = cx.mm(shape(t, d, t, false, false), (dscores, k), None);
            let dk = cx.mm(shape(t, d, t, true, false), (dscores, q), None);
            for (part, x) in [dq, dk, dv].into_iter().enumerate() {
                cx.g.copy(x, dqkv, Strided::merge_head(part, b, t, h, d), Format::F32);
            }
        }
        cx.contribute(qkv, dqkv, true, cx.p.compute);
    }
}

impl ModelBuilder {
    /// Causal softmax of `scale * x` over the last axis of square [..., t, t] score matrices
    /// (row i sees columns 0..=i), the scaled scores held in the compute format as attention
    /// holds them.
    pub fn causal_softmax(&mut self, x: Var, scale: f64) -> Result<Var> {
        let s = self.operand("causal_softmax", x)?;
        match s[..] {
            [.., r, t] if r == t && (scale as f32).is_finite() => {
                let op = Softmax {
                    t,
                    scale,
                    causal: true,
                };
                Ok(self.node(Box::new(op), vec![x], s))
            }
            _ => Err(refuse(
                "causal_softmax",
                format!(
                    "x {} times {scale:?}: must be [..., t, t] with a scale finite in f32",
                    shape_of(&s)
                ),
            )),
        }
    }

    /// Softmax over the last axis of x (`torch.softmax(x, -1)`, which autocast runs in f32),
    /// held in the softmax class's format.
    pub fn softmax(&mut self, x: Var) -> Result<Var> {
        let s = self.operand("softmax", x)?;
        let t = *s.last().expect("shapes have an axis");
        let op = Softmax {
            t,
            scale: 1.0,
            causal: false,
        };
        Ok(self.node(Box::new(op), vec![x], s))
    }
}

/// Softmax of scaled rows, causal (square score matrices) or over every column, held in the
/// softmax class's format.
#[derive(Debug)]
pub(crate) struct Softmax {
    pub t: usize,
    pub scale: f64,
    pub causal: bool,
}

impl Softmax {
    /// The causal softmax reads attention's scores held in the compute format; the plain one
    /// reads x as it is held (autocast casts it to f32), times 1.
    fn score_scale(&self, cx: &Emit) -> ScoreScale {
        ScoreScale {
            scale: self.scale,
            held: if self.causal {
                cx.p.compute
            } else {
                Format::F32
            },
        }
    }
}

impl Softmax {
    /// Without the causal mask (0) and with it (1).
    pub(crate) const KINDS: [OpKind; 2] = [
        OpKind::new("softmax", OpClass::F32),
        OpKind::new("causal_softmax", OpClass::F32),
    ];
}

impl NodeOp for Softmax {
    fn kind(&self) -> OpKind {
        Softmax::KINDS[self.causal as usize]
    }

    fn output_overwritable(&self) -> bool {
        false
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let x = cx.t(node.inputs[0]);
        let out = cx.g.temp(cx.g.len(x));
        cx.g.push(Op::Softmax {
            x,
            out,
            t: self.t,
            causal: self.causal,
            mask: None,
            scale: self.score_scale(cx),
            x_held: Format::F32,
        });
        cx.g.round(out, cx.format(node.out));
        (out, vec![])
    }

    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        let x = node.inputs[0];
        let p = cx.t(node.out);
        let out = cx.g.temp(cx.g.len(p));
        let scale = self.score_scale(cx);
        cx.g.push(Op::SoftmaxBwd {
            p,
            dp: dy,
            out,
            t: self.t,
            causal: self.causal,
            scale,
            dp_held: cx.dy_read,
        });
        // Held in the scores' format already (`ScoreScale::held`): no rounding after it.
        cx.contribute(x, out, true, scale.held);
    }
}

impl ModelBuilder {
    /// x with another shape of the same elements (no op: the same tensor).
    pub fn reshape(&mut self, x: Var, shape: &[usize]) -> Result<Var> {
        let s = self.operand("reshape", x)?;
        Self::checked_shape("reshape", shape)?;
        if s.iter().product::<usize>() != shape.iter().product::<usize>() {
            return Err(refuse(
                "reshape",
                format!(
                    "{} to {}: element counts differ",
                    shape_of(&s),
                    shape_of(shape)
                ),
            ));
        }
        Ok(self.node(Box::new(Reshape), vec![x], shape.to_vec()))
    }
}

/// The same tensor under another shape.
#[derive(Debug)]
pub(crate) struct Reshape;

impl Reshape {
    pub(crate) const KIND: OpKind = OpKind::new("reshape", OpClass::Input);
}

impl NodeOp for Reshape {
    fn kind(&self) -> OpKind {
        Reshape::KIND
    }

    fn output_overwritable(&self) -> bool {
        false
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        (cx.t(node.inputs[0]), vec![])
    }

    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        let known = cx.dy_known;
        cx.contribute(node.inputs[0], dy, false, known);
    }
}

impl ModelBuilder {
    /// The mean over rows of the cross entropy of logits ([..., v]) against the targets
    /// (shaped as the logits' rows): a scalar loss.
    pub fn cross_entropy(&mut self, logits: Var, targets: Var) -> Result<Var> {
        let ls = self.operand("cross_entropy", logits)?;
        let target = self.read("cross_entropy", targets)?;
        let v = *ls.last().expect("shapes have an axis");
        if !matches!(target.source, Source::Targets) || target.shape[..] != ls[..ls.len() - 1] {
            return Err(refuse(
                "cross_entropy",
                format!(
                    "logits {} against {} {}: the targets input, shaped as the logits without their last axis",
                    shape_of(&ls),
                    if matches!(target.source, Source::Targets) {
                        "the targets"
                    } else {
                        "a value other than the targets input"
                    },
                    shape_of(&target.shape)
                ),
            ));
        }
        if self.nodes.iter().any(|n| n.op.is_loss()) {
            return Err(refuse("cross_entropy", "a model has one loss"));
        }
        Ok(self.node(Box::new(CrossEntropy { v }), vec![logits, targets], vec![]))
    }
}

/// The rows' mean cross entropy (into `Stats::LOSS`) and, in the same pass, its gradient
/// scaled by the loss scale: the backward starts from it.
#[derive(Debug)]
pub(crate) struct CrossEntropy {
    pub v: usize,
}

impl CrossEntropy {
    pub(crate) const KIND: OpKind = OpKind::loss("cross_entropy");
}

impl NodeOp for CrossEntropy {
    fn kind(&self) -> OpKind {
        CrossEntropy::KIND
    }

    fn loss_rows(&self, model: &Model, node: &Node) -> usize {
        model.values[node.inputs[1].index].len()
    }

    fn output_overwritable(&self) -> bool {
        false
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let (logits, targets) = (cx.t(node.inputs[0]), cx.t(node.inputs[1]));
        let grad = cx.g.temp(cx.g.len(logits));
        cx.g.push(Op::CrossEntropy {
            logits,
            targets,
            grad,
            v: self.v,
            held: Format::F32,
        });
        // Computed in f32; the gradient held in the logits' format (a matmul's: compute).
        cx.g.round(grad, cx.format(node.inputs[0]));
        (logits, vec![grad])
    }

    fn backward(&self, cx: &mut Emit, node: &Node, saved: &Saved, _: TensorId) {
        let x = node.inputs[0];
        cx.contribute(x, saved[0], true, cx.format(x));
    }
}

impl ModelBuilder {
    /// RMS norm of x (`[..., c]`) over its last axis with gain g (`[c]`) (torch.nn.RMSNorm):
    /// x / sqrt(mean(x^2) + eps) * g, eps finite and not negative.
    pub fn rms_norm(&mut self, x: Var, g: Var, eps: f32) -> Result<Var> {
        let (xs, gs) = (self.operand("rms_norm", x)?, self.operand("rms_norm", g)?);
        let c = *xs.last().expect("shapes have an axis");
        if gs != [c] || !(eps.is_finite() && eps >= 0.0) {
            return Err(refuse(
                "rms_norm",
                format!(
                    "x {} with g {} and eps {eps}: g must be [{c}], eps finite and not negative",
                    shape_of(&xs),
                    shape_of(&gs)
                ),
            ));
        }
        Ok(self.node(Box::new(RmsNorm { c, eps }), vec![x, g], xs))
    }
}

/// RMS norm over the last axis, held as the policy holds `rms_norm`'s output (autocast runs
/// it in f32; narrowed to the stream format in the true presets).
#[derive(Debug)]
pub(crate) struct RmsNorm {
    pub c: usize,
    pub eps: f32,
}

impl RmsNorm {
    pub(crate) const KIND: OpKind = OpKind::new("rms_norm", OpClass::F32);
}

impl NodeOp for RmsNorm {
    fn kind(&self) -> OpKind {
        RmsNorm::KIND
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let (x, g) = (cx.t(node.inputs[0]), cx.t(node.inputs[1]));
        let len = cx.g.len(x);
        let (out, stats) = (cx.g.temp(len), cx.g.temp(len / self.c));
        cx.g.push(Op::RmsNorm {
            x,
            g,
            out,
            stats,
            c: self.c,
            eps: self.eps,
            held: Format::F32,
        });
        cx.g.round(out, cx.format(node.out));
        (out, vec![stats])
    }

    fn backward(&self, cx: &mut Emit, node: &Node, saved: &Saved, dy: TensorId) {
        let (x, g) = (node.inputs[0], node.inputs[1]);
        let (tx, tg) = (cx.t(x), cx.t(g));
        let dx = cx.g.temp(cx.g.len(tx));
        let dg = cx.grad_out(g);
        cx.g.push(Op::RmsNormBwd {
            dy,
            x: tx,
            g: tg,
            stats: saved[0],
            dx,
            dg,
            c: self.c,
            dy_held: cx.dy_read,
        });
        cx.contribute(g, dg, true, Format::F32);
        cx.contribute(x, dx, true, Format::F32);
    }
}

impl ModelBuilder {
    /// a * b elementwise, of the same shape (a gated unit's product).
    pub fn mul(&mut self, a: Var, b: Var) -> Result<Var> {
        let shape = self.same_shapes(("mul", "*"), a, b)?;
        Ok(self.node(Box::new(Mul), vec![a, b], shape))
    }
}

/// a * b, held in its operands' format (autocast multiplies in its inputs' dtype, promoted
/// where they differ); its backward is two products: da = dy * b held in a's format, db =
/// dy * a in b's.
#[derive(Debug)]
pub(crate) struct Mul;

impl Mul {
    fn product(cx: &mut Emit, (a, b): (TensorId, TensorId), held: Format) -> TensorId {
        let out = cx.g.temp(cx.g.len(a));
        cx.g.push(Op::Mul {
            a,
            b,
            out,
            held: Format::F32,
        });
        cx.g.round(out, held);
        out
    }
}

impl Mul {
    pub(crate) const KIND: OpKind = OpKind::new("mul", OpClass::Input);
}

impl NodeOp for Mul {
    fn kind(&self) -> OpKind {
        Mul::KIND
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let (a, b) = (cx.t(node.inputs[0]), cx.t(node.inputs[1]));
        let held = cx.format(node.out);
        (Mul::product(cx, (a, b), held), vec![])
    }

    fn backward(&self, cx: &mut Emit, node: &Node, _: &Saved, dy: TensorId) {
        let (a, b) = (node.inputs[0], node.inputs[1]);
        let (ta, tb) = (cx.t(a), cx.t(b));
        let dy = cx.dy_rounded(dy);
        for (x, other) in [(a, tb), (b, ta)] {
            if cx.needs_grad(x) {
                let held = cx.format(x);
                let d = Mul::product(cx, (dy, other), held);
                cx.contribute(x, d, true, held);
            }
        }
    }
}

impl ModelBuilder {
    /// The mean over every element of (pred - target)^2: a scalar loss. `target` (usually a
    /// values input) has pred's shape and takes no gradient, so it may not be a parameter nor
    /// computed from one (whose gradient through it would be silently zero).
    pub fn mse(&mut self, pred: Var, target: Var) -> Result<Var> {
        let (ps, ts) = (self.operand("mse", pred)?, self.operand("mse", target)?);
        if ps != ts {
            return Err(refuse(
                "mse",
                format!(
                    "pred {} against target {}: shapes differ",
                    shape_of(&ps),
                    shape_of(&ts)
                ),
            ));
        }
        if self.nodes.iter().any(|n| n.op.is_loss()) {
            return Err(refuse("mse", "a model has one loss"));
        }
        if let Some(param) = self.parameter_behind(target) {
            return Err(refuse(
                "mse",
                format!(
                    "target {} is computed from parameter {param}, and a target takes no \
                     gradient; give a values input (or a constant) as the target",
                    shape_of(&ts)
                ),
            ));
        }
        let rows = ps[..ps.len() - 1].iter().product();
        Ok(self.node(Box::new(Mse { rows }), vec![pred, target], vec![]))
    }
}

/// The mean squared error over every element (into `Stats::LOSS`) and, in the same pass, its
/// gradient scaled by the loss scale, held in the compute format as the cross entropy's.
#[derive(Debug)]
pub(crate) struct Mse {
    pub rows: usize,
}

impl Mse {
    pub(crate) const KIND: OpKind = OpKind::loss("mse");
}

impl NodeOp for Mse {
    fn kind(&self) -> OpKind {
        Mse::KIND
    }

    fn loss_rows(&self, _: &Model, _: &Node) -> usize {
        self.rows
    }

    fn output_overwritable(&self) -> bool {
        false
    }

    fn forward(&self, cx: &mut Emit, node: &Node) -> (TensorId, Saved) {
        let (pred, target) = (cx.t(node.inputs[0]), cx.t(node.inputs[1]));
        let grad = cx.g.temp(cx.g.len(pred));
        cx.g.push(Op::MseLoss {
            pred,
            target,
            grad,
            held: Format::F32,
        });
        // Computed in f32; the gradient held in the predictions' format (a linear's: compute).
        cx.g.round(grad, cx.format(node.inputs[0]));
        (pred, vec![grad])
    }

    fn backward(&self, cx: &mut Emit, node: &Node, saved: &Saved, _: TensorId) {
        let x = node.inputs[0];
        cx.contribute(x, saved[0], true, cx.format(x));
    }
}

/// A^T . B for A stored rows x m (the weight gradient x^T . dy): m x n result, k = rows.
fn transposed_a(m: usize, n: usize, rows: usize) -> MatmulShape {
    MatmulShape::batched(1, (m, n, rows), true, false)
}

/// A . B^T for B stored n x k (dx = dy . W^T, W stored din x dout).
fn transposed_b(m: usize, n: usize, k: usize) -> MatmulShape {
    MatmulShape::batched(1, (m, n, k), false, true)
}
