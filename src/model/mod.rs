//! Writing a model: parameters declared by name, shape, initialisation and weight decay, and a
//! forward pass written from ops (`ModelBuilder`); its training step derived from it
//! (`Model::plan`): the forward ops, the backward pass by reverse-mode differentiation over
//! the plan, GradScaler's unscale and check and the AdamW update, as one `plan::Plan` that
//! every executor runs.
//!
//! - `mod.rs`: the builder (parameters, inputs, `finish`), its values, and the finished model
//! - `ops.rs`: each op whole, in one place: its builder method (the shapes it takes, checked),
//!   its forward emission and its backward rule
//! - `layout.rs`: the ops that move values (transpose, concatenation), as ops.rs's
//! - `arith.rs`: sums and means over the last axis, scaling by a constant, subtraction
//! - `derive.rs`: the plan of a step: the forward ops, then each node's backward in reverse,
//!   the gradients of a value read twice summed in f32 and rounded once
//! - `run.rs`: a built model on a backend (its executor, losses, gradients, training steps)
//!
//! Each op declares its kind (`policy::OpKind`: its name and autocast class); `vocabulary()`
//! lists them, the one op vocabulary that autocast's overrides name. Each op takes its formats
//! from the step's `Precision`, as the policy decides them for every preset and override: a
//! matmul's output is held in the compute format, a layer norm's in the narrower of its class's
//! format and the stream's, a residual add's in the stream format, a gradient in the stream
//! format once complete.

mod arith;
mod derive;
mod layout;
mod ops;
mod run;

pub use derive::{PlanOptions, stores_codes};
pub use run::{ModelTrainer, Resize, RunOptions, Stepped, TrainState};

use crate::error::{Error, Result};
use crate::plan::Unary;
use crate::policy::OpKind;
use ops::NodeOp;
use std::sync::atomic::{AtomicU64, Ordering};

/// Every kind of op the builder records: the one op vocabulary (names and autocast classes)
/// that autocast's overrides name and the profiles show. (`sub` and `split` are built from
/// these: an add of a scaled value, narrows.)
pub fn vocabulary() -> Vec<OpKind> {
    use {arith::*, layout::*, ops::*};
    let mut kinds = vec![
        Embedding::KIND,
        Linear::KIND,
        Matmul::KIND,
        Bmm::KIND,
        LayerNorm::KIND,
        RmsNorm::KIND,
        Add::KIND,
        Mul::KIND,
        Reshape::KIND,
        CrossEntropy::KIND,
        Mse::KIND,
        Scale::KIND,
        Dropout::KIND,
        Rotary::KIND,
        Narrow::KIND,
        Transpose::KIND,
        Concat::KIND,
    ];
    kinds.extend(CausalAttention::KINDS);
    kinds.extend(Softmax::KINDS);
    kinds.extend(RowReduce::KINDS);
    kinds.extend(Unary::ALL.iter().map(|&f| ops::unary_kind(f)));
    kinds
}

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
    /// The initialisation named `name` ("zeros", "ones" or "normal", N(0, std^2)), as the
    /// Python and JavaScript builders take it.
    pub fn named(name: &str, std: f32) -> Result<Init> {
        match name {
            "zeros" => Ok(Init::Zeros),
            "ones" => Ok(Init::Ones),
            "normal" => Ok(Init::Normal { std }),
            other => Err(Error::UnknownName {
                kind: "initialisation",
                given: other.into(),
                valid: vec!["zeros".into(), "ones".into(), "normal".into()],
            }),
        }
    }

    /// The values of parameter `index` (of `len` elements) from the model's `seed`;
    /// `HostOutOfMemory` with the bytes where the host cannot hold them.
    pub fn draw(self, len: usize, seed: u64, index: usize) -> Result<Vec<f32>> {
        let mut values = crate::memory::empty_with_capacity("a parameter's initial values", len)?;
        match self {
            Init::Zeros => values.resize(len, 0.0),
            Init::Ones => values.resize(len, 1.0),
            Init::Normal { std } => {
                let seed = seed.wrapping_add(index as u64);
                crate::measure::normal_into(&mut values, len, seed);
                values.iter_mut().for_each(|x| *x *= std);
            }
        }
        Ok(values)
    }

    /// Refuses an initialisation that gives no usable values: a standard deviation that is
    /// not finite and >= 0 (NaN made every parameter NaN and every step skipped).
    fn check(self, param: &str) -> Result<()> {
        match self {
            Init::Normal { std } if !(std.is_finite() && std >= 0.0) => Err(refuse(
                &format!("param {param}"),
                format!("Init::Normal's std {std} is not finite and >= 0"),
            )),
            _ => Ok(()),
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

    /// Declares a parameter; its name must be new and not empty, its initialisation usable.
    pub fn param(&mut self, name: &str, shape: &[usize], init: Init, decay: bool) -> Result<Var> {
        if name.trim().is_empty() {
            return Err(refuse(
                "param",
                format!("{name:?} is no name: checkpoints and errors name parameters"),
            ));
        }
        Self::checked_shape(&format!("param {name}"), shape)?;
        init.check(name)?;
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

    /// The shape of `v`, a value of this builder (bindings show it; `[]` is the scalar loss).
    pub fn shape(&self, v: Var) -> Result<Vec<usize>> {
        Ok(self.read("shape", v)?.shape.clone())
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

    /// The name of a parameter that `v` is, or is computed from (None: it depends on inputs
    /// and constants alone). `v` was read by `read` (it is this builder's).
    pub(crate) fn parameter_behind(&self, v: Var) -> Option<&str> {
        // Values are declared in order: a node's inputs come before its output.
        let mut from: Vec<Option<usize>> = Vec::with_capacity(v.index + 1);
        for value in &self.values[..=v.index.min(self.values.len().saturating_sub(1))] {
            from.push(match value.source {
                Source::Param(i) => Some(i),
                Source::Node(n) => (self.nodes[n].inputs.iter()).find_map(|x| from[x.index]),
                _ => None,
            });
        }
        let param = from.get(v.index).copied().flatten()?;
        Some(self.params[param].name.as_str())
    }

    fn node(&mut self, op: Box<dyn NodeOp>, inputs: Vec<Var>, shape: Vec<usize>) -> Var {
        let out = self.value(shape, Source::Node(self.nodes.len()));
        self.nodes.push(Node { op, inputs, out });
        out
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
        self.reads(|s| matches!(s, Source::Tokens))
    }

    /// Whether the model reads the batch's class targets (a cross entropy's).
    pub fn reads_targets(&self) -> bool {
        self.reads(|s| matches!(s, Source::Targets))
    }

    /// Whether the model reads values input `k` (`ModelBuilder::values`).
    pub fn reads_values(&self, k: usize) -> bool {
        self.reads(|s| matches!(s, Source::Values(j) if *j == k))
    }

    /// Whether every op that reads values input `k` reads it as an additive bias (an
    /// attention's: `ModelBuilder::attention_biased`), whose -inf leaves a key out.
    pub fn values_read_as_bias(&self, k: usize) -> bool {
        let mut read = false;
        for node in &self.nodes {
            for (i, v) in node.inputs.iter().enumerate() {
                if matches!(self.values[v.index].source, Source::Values(j) if j == k) {
                    if !node.op.reads_as_bias(i) {
                        return false;
                    }
                    read = true;
                }
            }
        }
        read
    }

    fn reads(&self, source: impl Fn(&Source) -> bool) -> bool {
        let live = self.live();
        (self.values.iter().enumerate())
            .any(|(v, value)| source(&value.source) && live.reads[v] > 0)
    }

    /// Whether AdamW's weight decay applies, per parameter.
    pub fn decays(&self) -> Vec<bool> {
        self.params.iter().map(|p| p.decay).collect()
    }

    /// The initial values of the parameters: each `Init` drawn from `seed` and the
    /// parameter's index; `HostOutOfMemory` where the host cannot hold them.
    pub fn init(&self, seed: u64) -> Result<Vec<Vec<f32>>> {
        let values = self.params.iter().try_fold(0u64, |n, p| {
            n.checked_add(crate::memory::bytes_of::<f32>(p.len())?)
        });
        crate::memory::check("the model's parameters", values)?;
        self.params
            .iter()
            .enumerate()
            .map(|(i, p)| p.init.draw(p.len(), seed, i))
            .collect()
    }

    /// A checksum of what the model is: its parameters (names, shapes, initialisations), its
    /// inputs and its ops with what each reads; two models built alike have the same. Measured
    /// choices are cached under it.
    pub fn fingerprint(&self) -> u32 {
        let mut h = crc32fast::Hasher::new();
        for p in &self.params {
            h.update(format!("{} {:?} {:?} {};", p.name, p.shape, p.init, p.decay).as_bytes());
        }
        for v in &self.values {
            let source = match &v.source {
                Source::Ids(ids) => {
                    format!("ids {:08x}", crc32fast::hash(bytemuck::cast_slice(ids)))
                }
                other => format!("{other:?}"),
            };
            h.update(format!("{:?} {source};", v.shape).as_bytes());
        }
        for n in &self.nodes {
            let inputs: Vec<usize> = n.inputs.iter().map(|v| v.index).collect();
            h.update(format!("{:?} {inputs:?} {};", n.op, n.out.index).as_bytes());
        }
        h.update(&(self.loss as u64).to_le_bytes());
        h.finalize()
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
