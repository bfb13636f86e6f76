//! Writing a model: parameters declared by name, shape, initialisation and weight decay, and a
//! forward pass written from ops (`ModelBuilder`); its training step derived from it
//! (`Model::plan`): the forward ops, the backward pass by reverse-mode differentiation over
//! the plan, GradScaler's unscale and check and the AdamW update, as one `plan::Plan` that
//! every executor runs.
//!
//! - `mod.rs`: the builder, its values and shape checks, and the finished model
//! - `ops.rs`: each op's forward emission and its backward rule, side by side
//! - `derive.rs`: the plan of a step: the forward ops, then each node's backward in reverse,
//!   the gradients of a value read twice summed in f32 and rounded once
//! - `run.rs`: a built model on a backend (its executor, losses, gradients, training steps)
//!
//! Each op takes its formats from the step's `Precision`, as the policy decides them for every
//! preset and autocast override: a matmul's output is held in the compute format, a layer
//! norm's in the narrower of its class's format and the stream's, a residual add's in the
//! stream format, a gradient in the stream format once complete.

mod derive;
mod ops;
mod run;

pub use derive::{PlanOptions, stores_codes};
pub use run::{ModelTrainer, Stepped};

use crate::error::{Error, Result};
use ops::NodeOp;
use std::sync::atomic::{AtomicU64, Ordering};

/// A value of a model being built (a parameter, an input or an op's output), as its builder
/// hands it out; only that builder's ops take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Var {
    builder: u64,
    index: usize,
}

/// How a parameter starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Every value 0 (biases).
    Zeros,
    /// Every value 1 (norm gains).
    Ones,
    /// N(0, std^2), drawn from the model's seed and the parameter's index.
    Normal {
        /// The standard deviation.
        std: f32,
    },
}

impl Init {
    /// The values of parameter `index` (of `len` elements) from the model's `seed`.
    pub fn draw(self, len: usize, seed: u64, index: usize) -> Vec<f32> {
        match self {
            Init::Zeros => vec![0.0; len],
            Init::Ones => vec![1.0; len],
            Init::Normal { std } => crate::measure::normal(len, seed.wrapping_add(index as u64))
                .into_iter()
                .map(|x| x * std)
                .collect(),
        }
    }
}

/// A declared parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    /// Its name, unique in the model (checkpoints and errors use it).
    pub name: String,
    /// Its shape, row-major.
    pub shape: Vec<usize>,
    /// How its values start.
    pub init: Init,
    /// Whether AdamW's weight decay applies to it.
    pub decay: bool,
}

impl Param {
    /// Its number of values.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether it has no values (never for a declared parameter: `param` refuses them).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where a value comes from.
#[derive(Clone, Debug)]
pub(crate) enum Source {
    Param(usize),
    /// The batch's token ids (the plan's `Tokens` tensor).
    Tokens,
    /// The batch's class ids, the cross entropy's targets (the plan's `Targets` tensor).
    Targets,
    /// f32 values the host writes before each run (input k of the model's values inputs, in
    /// declaration order: a plan tensor of kind `Input`).
    Values(usize),
    /// Ids fixed when the model is built (positions).
    Ids(Vec<u32>),
    /// Output of node i.
    Node(usize),
}

#[derive(Clone, Debug)]
pub(crate) struct Value {
    pub shape: Vec<usize>,
    pub source: Source,
}

impl Value {
    fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Ids: read by an embedding, with no gradient.
    fn is_ids(&self) -> bool {
        matches!(
            self.source,
            Source::Tokens | Source::Targets | Source::Ids(_)
        )
    }
}

/// An op of the model: what it computes (`NodeOp`), what it reads, what it writes.
#[derive(Debug)]
pub(crate) struct Node {
    pub op: Box<dyn NodeOp>,
    pub inputs: Vec<Var>,
    pub out: Var,
}

/// Records a model: parameters, inputs, and its forward pass op by op, each checked as it is
/// added (an error names the op and the shapes).
pub struct ModelBuilder {
    id: u64,
    params: Vec<Param>,
    values: Vec<Value>,
    nodes: Vec<Node>,
}

impl Default for ModelBuilder {
    fn default() -> Self {
        Self::new()
    }
}

/// A finished model: its parameters, values and ops, the loss the step minimises.
#[derive(Debug)]
pub struct Model {
    params: Vec<Param>,
    values: Vec<Value>,
    nodes: Vec<Node>,
    loss: usize,
}

fn shape_of(s: &[usize]) -> String {
    format!("{s:?}")
}

fn refuse(op: &str, why: impl std::fmt::Display) -> Error {
    Error::invalid("model", format!("{op}: {why}"))
}

impl ModelBuilder {
    /// A builder with nothing declared; its values are its own (another builder's ops refuse
    /// them).
    pub fn new() -> ModelBuilder {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        ModelBuilder {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            params: vec![],
            values: vec![],
            nodes: vec![],
        }
    }

    fn value(&mut self, shape: Vec<usize>, source: Source) -> Var {
        self.values.push(Value { shape, source });
        Var {
            builder: self.id,
            index: self.values.len() - 1,
        }
    }

    /// The value `v` as `op` reads it: an error where `v` is another builder's.
    fn read(&self, op: &str, v: Var) -> Result<&Value> {
        if v.builder != self.id || v.index >= self.values.len() {
            return Err(refuse(op, "reads a value this model did not declare"));
        }
        Ok(&self.values[v.index])
    }

    /// The shape of `v` as `op` reads it, which must not be ids (an embedding's or a loss's
    /// input only).
    fn operand(&self, op: &str, v: Var) -> Result<Vec<usize>> {
        let value = self.read(op, v)?;
        if value.shape.is_empty() {
            return Err(refuse(op, "reads the scalar loss, which ends the model"));
        }
        if value.is_ids() {
            return Err(refuse(
                op,
                format!("reads ids {} as values", shape_of(&value.shape)),
            ));
        }
        Ok(value.shape.clone())
    }

    fn checked_shape(op: &str, shape: &[usize]) -> Result<()> {
        let elements = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|&n| n > 0 && n <= u32::MAX as usize);
        if shape.is_empty() || elements.is_none() {
            return Err(refuse(
                op,
                format!(
                    "shape {} must have at least one axis and 1 to 2^32-1 elements",
                    shape_of(shape)
                ),
            ));
        }
        Ok(())
    }

    /// Declares a parameter; its name must be new.
    pub fn param(&mut self, name: &str, shape: &[usize], init: Init, decay: bool) -> Result<Var> {
        Self::checked_shape(&format!("param {name}"), shape)?;
        if self.params.iter().any(|p| p.name == name) {
            return Err(refuse(
                &format!("param {name}"),
                "a parameter of that name is already declared",
            ));
        }
        self.params.push(Param {
            name: name.into(),
            shape: shape.to_vec(),
            init,
            decay,
        });
        Ok(self.value(shape.to_vec(), Source::Param(self.params.len() - 1)))
    }

    /// The parameter declared as `name`.
    pub fn parameter(&self, name: &str) -> Result<Var> {
        let i = self
            .params
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| {
                refuse(
                    &format!("parameter {name}"),
                    format!(
                        "no parameter of that name is declared (declared: {})",
                        self.params
                            .iter()
                            .map(|p| p.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            })?;
        let index = self
            .values
            .iter()
            .position(|v| matches!(v.source, Source::Param(j) if j == i))
            .expect("every parameter has its value");
        Ok(Var {
            builder: self.id,
            index,
        })
    }

    fn input(&mut self, op: &str, shape: &[usize], source: Source) -> Result<Var> {
        Self::checked_shape(op, shape)?;
        let kind = std::mem::discriminant(&source);
        if self
            .values
            .iter()
            .any(|v| std::mem::discriminant(&v.source) == kind)
        {
            return Err(refuse(op, "a model has one such input"));
        }
        Ok(self.value(shape.to_vec(), source))
    }

    /// The batch's token ids, each run's input (one per model).
    pub fn tokens(&mut self, shape: &[usize]) -> Result<Var> {
        self.input("tokens", shape, Source::Tokens)
    }

    /// The batch's class ids, the cross entropy's targets (one per model).
    pub fn targets(&mut self, shape: &[usize]) -> Result<Var> {
        self.input("targets", shape, Source::Targets)
    }

    /// f32 values the host gives each run (`ModelTrainer::set_values`): features, regression
    /// targets. A model may have several, numbered in the order they are declared.
    pub fn values(&mut self, shape: &[usize]) -> Result<Var> {
        Self::checked_shape("values", shape)?;
        let k = (self.values.iter())
            .filter(|v| matches!(v.source, Source::Values(_)))
            .count();
        Ok(self.value(shape.to_vec(), Source::Values(k)))
    }

    /// Ids fixed when the model is built (e.g. each token's position).
    pub fn constant_ids(&mut self, shape: &[usize], ids: Vec<u32>) -> Result<Var> {
        Self::checked_shape("constant_ids", shape)?;
        if ids.len() != shape.iter().product::<usize>() {
            return Err(refuse(
                "constant_ids",
                format!("{} ids for shape {}", ids.len(), shape_of(shape)),
            ));
        }
        Ok(self.value(shape.to_vec(), Source::Ids(ids)))
    }

    fn node(&mut self, op: Box<dyn NodeOp>, inputs: Vec<Var>, shape: Vec<usize>) -> Var {
        let out = self.value(shape, Source::Node(self.nodes.len()));
        self.nodes.push(Node { op, inputs, out });
        out
    }

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
        Ok(self.node(
            Box::new(ops::Embedding { rows, c }),
            vec![table, ids],
            shape,
        ))
    }

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
                Ok(self.node(Box::new(ops::Linear { k, m: *m }), vec![x, w, b], shape))
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
        Ok(self.node(
            Box::new(ops::Matmul { k, m, transpose_w }),
            vec![x, w],
            shape,
        ))
    }

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
        Ok(self.node(Box::new(ops::LayerNorm { c }), vec![x, g, b], xs))
    }

    /// GELU (tanh form) of every element.
    pub fn gelu(&mut self, x: Var) -> Result<Var> {
        let xs = self.operand("gelu", x)?;
        Ok(self.node(Box::new(ops::Gelu), vec![x], xs))
    }

    /// a + b, of the same shape (a residual connection, or two embeddings).
    pub fn add(&mut self, a: Var, b: Var) -> Result<Var> {
        let (as_, bs) = (self.operand("add", a)?, self.operand("add", b)?);
        if as_ != bs {
            return Err(refuse(
                "add",
                format!("{} + {}: shapes differ", shape_of(&as_), shape_of(&bs)),
            ));
        }
        Ok(self.node(Box::new(ops::Add), vec![a, b], as_))
    }

    /// Causal self-attention of q|k|v ([b, t, 3c], each token's q, k, v side by side) over
    /// `heads` heads of c / heads: [b, t, c]. One fused op where the plan is asked for it
    /// (`PlanOptions::fused_attention`), else the separate ops (heads copied out, scores,
    /// causal softmax, P.v, heads copied back).
    pub fn causal_attention(&mut self, qkv: Var, heads: usize) -> Result<Var> {
        let s = self.operand("causal_attention", qkv)?;
        match s[..] {
            [b, t, c3] if heads > 0 && c3 % (3 * heads) == 0 => Ok(self.node(
                Box::new(ops::CausalAttention {
                    b,
                    t,
                    h: heads,
                    d: c3 / 3 / heads,
                }),
                vec![qkv],
                vec![b, t, c3 / 3],
            )),
            _ => Err(refuse(
                "causal_attention",
                format!(
                    "qkv {} over {heads} heads: must be [batch, tokens, 3 x heads x head width]",
                    shape_of(&s)
                ),
            )),
        }
    }

    /// Causal softmax of `scale * x` over the last axis of square [..., t, t] score matrices
    /// (row i sees columns 0..=i).
    pub fn causal_softmax(&mut self, x: Var, scale: f64) -> Result<Var> {
        let s = self.operand("causal_softmax", x)?;
        match s[..] {
            [.., r, t] if r == t && scale.is_finite() => {
                Ok(self.node(Box::new(ops::CausalSoftmax { t, scale }), vec![x], s))
            }
            _ => Err(refuse(
                "causal_softmax",
                format!(
                    "x {} times {scale}: must be [..., t, t] with a finite scale",
                    shape_of(&s)
                ),
            )),
        }
    }

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
        Ok(self.node(Box::new(ops::Reshape), vec![x], shape.to_vec()))
    }

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
        Ok(self.node(
            Box::new(ops::CrossEntropy { v }),
            vec![logits, targets],
            vec![],
        ))
    }

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
        Ok(self.node(Box::new(ops::RmsNorm { c, eps }), vec![x, g], xs))
    }

    /// SiLU (x * sigmoid(x)) of every element.
    pub fn silu(&mut self, x: Var) -> Result<Var> {
        let xs = self.operand("silu", x)?;
        Ok(self.node(Box::new(ops::Silu), vec![x], xs))
    }

    /// a * b elementwise, of the same shape (a gated unit's product).
    pub fn mul(&mut self, a: Var, b: Var) -> Result<Var> {
        let (as_, bs) = (self.operand("mul", a)?, self.operand("mul", b)?);
        if as_ != bs {
            return Err(refuse(
                "mul",
                format!("{} * {}: shapes differ", shape_of(&as_), shape_of(&bs)),
            ));
        }
        Ok(self.node(Box::new(ops::Mul), vec![a, b], as_))
    }

    /// The mean over every element of (pred - target)^2: a scalar loss. `target` (usually a
    /// values input) has pred's shape and takes no gradient.
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
        let rows = ps[..ps.len() - 1].iter().product();
        Ok(self.node(Box::new(ops::Mse { rows }), vec![pred, target], vec![]))
    }

    /// The model whose loss is `loss`: a scalar made by a loss op (cross entropy), that every
    /// parameter reaches, read with the tokens the batch gives.
    pub fn finish(self, loss: Var) -> Result<Model> {
        let value = self.read("finish", loss)?;
        let Source::Node(n) = value.source else {
            return Err(refuse(
                "finish",
                format!("the loss {} is not an op's output", shape_of(&value.shape)),
            ));
        };
        if !value.shape.is_empty() || !self.nodes[n].op.is_loss() {
            return Err(refuse(
                "finish",
                format!(
                    "the loss must be a scalar made by a loss op (cross_entropy, mse), not {}'s {}",
                    self.nodes[n].op.name(),
                    shape_of(&value.shape)
                ),
            ));
        }
        let model = Model {
            params: self.params,
            values: self.values,
            nodes: self.nodes,
            loss: n,
        };
        let live = model.live();
        for (i, p) in model.params.iter().enumerate() {
            let read = model.values.iter().enumerate().any(|(v, value)| {
                matches!(value.source, Source::Param(j) if j == i) && live.reads[v] > 0
            });
            if !read {
                return Err(refuse(
                    &format!("param {}", p.name),
                    format!("{} does not reach the loss", shape_of(&p.shape)),
                ));
            }
        }
        let tokens = model
            .values
            .iter()
            .find(|v| matches!(v.source, Source::Tokens));
        let reads_values = (model.values.iter().enumerate())
            .any(|(v, value)| matches!(value.source, Source::Values(_)) && live.reads[v] > 0);
        let rows = model.rows();
        match tokens {
            Some(t) if t.len() == rows => Ok(model),
            None if reads_values => Ok(model),
            _ => Err(refuse(
                "finish",
                format!(
                    "a model reads a batch: one tokens input of as many ids as the loss has rows ({rows}), or values inputs; got {}",
                    tokens.map_or("neither".into(), |t| format!(
                        "tokens {}",
                        shape_of(&t.shape)
                    ))
                ),
            )),
        }
    }
}

/// The nodes a loss depends on, and how often each value is read by them.
pub(crate) struct Live {
    pub nodes: Vec<bool>,
    pub reads: Vec<usize>,
}

impl Model {
    /// The declared parameters, in declaration order (the order of the step's state).
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// Rows of the batch: the loss's rows (the cross entropy's targets; the mean squared
    /// error's predictions without their last axis), the length of the plan's tokens and
    /// targets.
    pub fn rows(&self) -> usize {
        self.nodes[self.loss]
            .op
            .loss_rows(self, &self.nodes[self.loss])
    }

    /// The shape of each values input, in declaration order (`ModelBuilder::values`).
    pub fn values_inputs(&self) -> Vec<Vec<usize>> {
        let mut inputs: Vec<(usize, Vec<usize>)> = (self.values.iter())
            .filter_map(|v| match v.source {
                Source::Values(k) => Some((k, v.shape.clone())),
                _ => None,
            })
            .collect();
        inputs.sort_by_key(|(k, _)| *k);
        inputs.into_iter().map(|(_, s)| s).collect()
    }

    /// Whether the model reads the batch's token ids.
    pub fn reads_tokens(&self) -> bool {
        let live = self.live();
        (self.values.iter().enumerate())
            .any(|(v, value)| matches!(value.source, Source::Tokens) && live.reads[v] > 0)
    }

    /// Whether AdamW's weight decay applies, per parameter.
    pub fn decays(&self) -> Vec<bool> {
        self.params.iter().map(|p| p.decay).collect()
    }

    /// The initial values of the parameters: each `Init` drawn from `seed` and the
    /// parameter's index.
    pub fn init(&self, seed: u64) -> Vec<Vec<f32>> {
        self.params
            .iter()
            .enumerate()
            .map(|(i, p)| p.init.draw(p.len(), seed, i))
            .collect()
    }

    /// The linear layers (fp8 state slots) of the step, in order.
    pub fn linear_layers(&self) -> usize {
        let live = self.live();
        (self.nodes.iter().zip(&live.nodes))
            .filter(|(n, live)| **live && n.op.is_linear())
            .count()
    }

    /// Each attention op's head width and q|k|v shape.
    pub fn attention_heads(&self) -> Vec<(usize, Vec<usize>)> {
        (self.nodes.iter())
            .filter_map(|n| {
                let d = n.op.attention_head_dim()?;
                Some((d, self.values[n.inputs[0].index].shape.clone()))
            })
            .collect()
    }

    pub(crate) fn live(&self) -> Live {
        let mut nodes = vec![false; self.nodes.len()];
        let mut reads = vec![0; self.values.len()];
        nodes[self.loss] = true;
        for i in (0..=self.loss).rev() {
            if !nodes[i] {
                continue;
            }
            for v in &self.nodes[i].inputs {
                reads[v.index] += 1;
                if let Source::Node(j) = self.values[v.index].source {
                    nodes[j] = true;
                }
            }
        }
        Live { nodes, reads }
    }
}
