//! A built model on a backend: its step plan under a precision preset in the backend's own
//! executor (device-resident where the backend has one), its parameters written in, and
//! training steps with GradScaler's loss scaling and fp8 delayed scaling as the preset asks.
//! The executor checks every batch (lengths, ids in range) before it runs.

use super::{Model, PlanOptions};
use crate::backend::reference::ops::round_to;
use crate::backend::{self, Backend};
use crate::error::{Error, Result};
use crate::plan::exec::{grad_norm, update_factor};
use crate::plan::scalar::StepScalars;
use crate::plan::{AdamW, Plan, Section, Stats, StepExecutor, TensorKind};
use crate::policy::precision::PrecisionRequest;
use crate::policy::{Fp8Role, Fp8State, LossScaler, Precision, StepDecision};
use std::borrow::Cow;

/// A run's token ids and class targets, as the plan takes them.
type Batch<'b> = (Cow<'b, [u32]>, Cow<'b, [u32]>);

/// What one training step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stepped {
    /// The batch's mean loss, before the update.
    pub loss: f64,
    /// A gradient held inf or NaN: nothing was updated (GradScaler backs its scale off).
    pub skipped: bool,
    /// The global norm of the unscaled gradients.
    pub grad_norm: f64,
}

/// A model being trained on a backend under one precision.
pub struct ModelTrainer<'a> {
    /// The model it trains.
    pub model: Model,
    /// The formats and algorithms the preset decided on this backend.
    pub precision: Precision,
    /// AdamW's settings for the steps to come (nanoGPT's by default).
    pub adamw: AdamW,
    /// Clip the global gradient norm to this; 0 disables.
    pub grad_clip: f32,
    /// GradScaler's dynamic loss scale, where the preset scales the loss (16-mixed).
    pub scaler: Option<LossScaler>,
    /// fp8 delayed scaling's amax histories and scales, where the preset has them.
    pub fp8: Option<Fp8State>,
    /// Optimizer steps applied.
    pub applied: u32,
    exec: Box<dyn StepExecutor + 'a>,
    /// Which values inputs `set_values` has written (a run reads only inputs given).
    values_set: Vec<bool>,
}

impl<'a> ModelTrainer<'a> {
    /// `model` under `request` on `backend`, its parameters drawn from `seed` (`Model::init`)
    /// and held as the preset holds weights. Attention is fused where `fused_attention` says,
    /// else where the backend has the kernel for every attention op of the model (the
    /// reference runs either); fused where a device has no kernel for the precision's matmul
    /// algorithm and the op's head width is refused, naming the op.
    pub fn new(
        backend: &'a dyn Backend,
        model: Model,
        request: &PrecisionRequest,
        fused_attention: Option<bool>,
        seed: u64,
    ) -> Result<ModelTrainer<'a>> {
        let caps = backend.capabilities();
        let precision = Precision::decide(request, &caps)?;
        let unfusable = (model.attention_heads().into_iter())
            .find(|&(d, _)| !caps.fuses_attention(&precision.matmul, d));
        // The reference's executor runs every op by its definition; a device needs a kernel.
        let host = backend.kind() == crate::backend::BackendKind::Reference;
        let fused = match (fused_attention, unfusable) {
            (Some(true), Some((d, shape))) if !host => {
                return Err(Error::invalid(
                    "model",
                    format!(
                        "causal_attention: qkv {shape:?} (heads of {d}) cannot be fused under {} on {}",
                        precision.matmul,
                        backend.name()
                    ),
                ));
            }
            (Some(fused), _) => fused,
            (None, unfusable) => unfusable.is_none(),
        };
        let options = PlanOptions {
            fused_attention: fused,
            coded: super::stores_codes()?,
            seed,
        };
        let mut plan = model.plan(&precision, options)?;
        // The parameters are held twice on the host: as the plan's constants, and as the
        // executor's copy (the host interpreter's tensors, a device's upload).
        let params = (model.params().iter())
            .try_fold(0u64, |n, p| n.checked_add(p.len() as u64 * 4))
            .and_then(|bytes| bytes.checked_mul(2));
        crate::memory::check(
            "the model's parameters, in its plan and its executor",
            params,
        )?;
        for (i, p) in model.init(seed)?.into_iter().enumerate() {
            let p = held_as(precision.weights, &model.params()[i].name, p)?;
            plan.constants.push((plan.state[i][0], p));
        }
        let fp8 = match &precision.fp8 {
            Some(recipe) => Fp8State::new(recipe, plan.stats.linears)?,
            None => None,
        };
        Ok(ModelTrainer {
            scaler: request.preset.spec().loss_scaling.map(LossScaler::new),
            values_set: vec![false; model.values_inputs().len()],
            model,
            precision,
            adamw: AdamW::default(),
            grad_clip: 0.0,
            fp8,
            applied: 0,
            exec: backend::executor(backend, plan, true)?,
        })
    }

    /// The step plan its executor runs.
    pub fn plan(&self) -> &Plan {
        self.exec.plan()
    }

    /// The scalars of a run at `loss_scale`, the settings checked first: AdamW's
    /// (`AdamW::check`), the clip finite and >= 0, the loss scale and fp8 scales finite and
    /// > 0 (a NaN among them poisoned the weights, or skipped every step, silently).
    fn scalars(&self, loss_scale: f32) -> Result<Vec<f32>> {
        self.adamw.check()?;
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return Err(Error::invalid(
                "grad_clip",
                format!(
                    "{} is not finite and >= 0 (0 disables clipping)",
                    self.grad_clip
                ),
            ));
        }
        let scale_ok = |s: f32| s.is_finite() && s > 0.0;
        if !scale_ok(loss_scale) {
            return Err(Error::invalid(
                "loss scale",
                format!("{loss_scale} is not finite and > 0"),
            ));
        }
        let fp8 = self.fp8.as_ref().map(Fp8State::scales).unwrap_or_default();
        if let Some((l, s)) = (fp8.iter().enumerate())
            .find_map(|(l, s)| s.iter().find(|&&s| !scale_ok(s)).map(|&s| (l, s)))
        {
            return Err(Error::invalid(
                "fp8 scales",
                format!("linear layer {l}'s scale {s} is not finite and > 0"),
            ));
        }
        let plan = self.exec.plan();
        Ok(StepScalars {
            adamw: &self.adamw,
            clip: self.grad_clip,
            loss_scale,
            poison: 0.0,
            t: self.applied + 1,
            ranks: 1,
            fp8: &fp8,
        }
        .array(plan.rows, plan.scalar_count()))
    }

    /// The batch as the plan takes it: token ids and class targets where the model reads them
    /// (a model that reads none is given none, empty slices, and runs on zeros there), and every
    /// values input it reads written (`set_values`). An empty slice for what the model reads
    /// (which trained on token 0), ids for a model that reads none, or a values input never
    /// written, is refused by name.
    fn batch<'b>(&self, ids: &'b [u32], targets: &'b [u32]) -> Result<Batch<'b>> {
        let rows = self.exec.plan().rows();
        let given = |x: &'b [u32], what: &'static str, reads: bool| match (reads, x.is_empty()) {
            (true, true) => Err(Error::invalid(
                what,
                format!("the model reads {what} ({rows} of them); none were given"),
            )),
            (false, false) => Err(Error::invalid(
                what,
                format!(
                    "the model reads no {what}; {} were given (pass an empty slice)",
                    x.len()
                ),
            )),
            (true, false) => Ok(Cow::Borrowed(x)),
            (false, true) => Ok(Cow::Owned(vec![0; rows])),
        };
        let ids = given(ids, "token ids", self.model.reads_tokens())?;
        let targets = given(targets, "class targets", self.model.reads_targets())?;
        if let Some(k) =
            (0..self.values_set.len()).find(|&k| !self.values_set[k] && self.model.reads_values(k))
        {
            return Err(Error::invalid(
                "values",
                format!("input {k} is read by the model but was never written (set_values)"),
            ));
        }
        Ok((ids, targets))
    }

    /// Writes values input `k` (`ModelBuilder::values`, in declaration order) for the runs
    /// that follow: `values` of its declared length.
    pub async fn set_values(&mut self, k: usize, values: &[f32]) -> Result<()> {
        let inputs = self.model.values_inputs();
        let plan = self.exec.plan();
        let tensor = (0..plan.tensors().len())
            .filter(|&t| plan.tensors()[t].kind == TensorKind::Input)
            .nth(k);
        let (Some(t), Some(shape)) = (tensor, inputs.get(k)) else {
            return Err(Error::invalid(
                "values",
                format!("input {k}: the model has {} values inputs", inputs.len()),
            ));
        };
        if values.len() != shape.iter().product::<usize>() {
            return Err(Error::invalid(
                "values",
                format!(
                    "input {k} is {shape:?} ({} values), got {}",
                    shape.iter().product::<usize>(),
                    values.len()
                ),
            ));
        }
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(Error::invalid(
                "values",
                format!("input {k}[{i}] is {}: values are finite", values[i]),
            ));
        }
        self.exec.write(t, values).await?;
        self.values_set[k] = true;
        Ok(())
    }

    /// What the loss reads of the last forward pass (its logits, or its predictions), as the
    /// plan holds them: the model's output.
    pub async fn outputs(&mut self) -> Result<Vec<f32>> {
        let logits = self.exec.plan().logits();
        self.exec.read(logits).await
    }

    /// One training step on a batch (token ids and class targets; empty where the model
    /// reads none: values inputs are written before, `set_values`): forward, backward,
    /// unscale and check, and the AdamW update where every gradient is finite.
    pub async fn step(&mut self, ids: &[u32], targets: &[u32]) -> Result<Stepped> {
        let scale = self.scaler.map_or(1.0, |s| s.scale);
        let scalars = self.scalars(scale)?;
        let (ids, targets) = self.batch(ids, targets)?;
        let stats = (self.exec)
            .run(Section::Step, &ids, &targets, &scalars)
            .await?;
        let layout = self.exec.plan().stats;
        if let Some(fp8) = &mut self.fp8 {
            fp8.record(|l, role: Fp8Role| stats[layout.amax(l, role as usize)] as f32);
        }
        let finite = update_factor(&layout, &stats, 0.0).is_some();
        let applied = match self.scaler.as_mut() {
            Some(s) => s.update(finite) == StepDecision::Apply,
            None => finite,
        };
        self.applied += applied as u32;
        Ok(Stepped {
            loss: stats[Stats::LOSS],
            skipped: !applied,
            grad_norm: grad_norm(&layout, &stats),
        })
    }

    /// The batch's mean loss under the current parameters.
    pub async fn loss(&mut self, ids: &[u32], targets: &[u32]) -> Result<f64> {
        let scalars = self.scalars(1.0)?;
        let (ids, targets) = self.batch(ids, targets)?;
        let stats = self
            .exec
            .run(Section::Forward, &ids, &targets, &scalars)
            .await?;
        Ok(stats[Stats::LOSS])
    }

    /// The batch's mean loss and its gradient with respect to each parameter (loss scale 1;
    /// nothing updated).
    pub async fn gradients(
        &mut self,
        ids: &[u32],
        targets: &[u32],
    ) -> Result<(f64, Vec<Vec<f32>>)> {
        let scalars = self.scalars(1.0)?;
        let (ids, targets) = self.batch(ids, targets)?;
        let stats = (self.exec)
            .run(Section::Gradients, &ids, &targets, &scalars)
            .await?;
        let mut grads = vec![];
        for [_, g, _, _] in self.exec.plan().state.clone() {
            grads.push(self.exec.read(g).await?);
        }
        Ok((stats[Stats::LOSS], grads))
    }

    /// The parameters' current values, in declaration order.
    pub async fn params(&mut self) -> Result<Vec<Vec<f32>>> {
        let mut values = vec![];
        for [p, _, _, _] in self.exec.plan().state.clone() {
            values.push(self.exec.read(p).await?);
        }
        Ok(values)
    }

    /// Sets every parameter (declaration order, each of its declared length, finite), held as
    /// the preset holds weights. Everything is checked before anything is written: a refused
    /// call leaves every parameter as it was.
    pub async fn set_params(&mut self, params: &[Vec<f32>]) -> Result<()> {
        let state = self.exec.plan().state.clone();
        if params.len() != state.len() {
            return Err(Error::LengthMismatch {
                what: "parameter tensors",
                expected: state.len(),
                got: params.len(),
            });
        }
        for (values, declared) in params.iter().zip(self.model.params()) {
            if values.len() != declared.len() {
                return Err(Error::invalid(
                    "parameters",
                    format!(
                        "{} is {:?} ({} values), got {}",
                        declared.name,
                        declared.shape,
                        declared.len(),
                        values.len()
                    ),
                ));
            }
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                return Err(Error::invalid(
                    "parameters",
                    format!(
                        "{}[{i}] is {}: parameters are finite",
                        declared.name, values[i]
                    ),
                ));
            }
        }
        let mut held = Vec::with_capacity(params.len());
        for (values, declared) in params.iter().zip(self.model.params()) {
            let mut v = crate::memory::empty_with_capacity("a parameter's values", values.len())?;
            v.extend_from_slice(values);
            held.push(self.held(&declared.name, v)?);
        }
        for ([p, ..], v) in state.iter().zip(held) {
            self.exec.write(*p, &v).await?;
        }
        Ok(())
    }

    /// `values` of parameter `name` as the preset holds weights (rounded to 16 bits in the
    /// "true" presets), refused where that overflows (1e5 is inf in f16).
    fn held(&self, name: &str, values: Vec<f32>) -> Result<Vec<f32>> {
        held_as(self.precision.weights, name, values)
    }
}

/// `values` of parameter `name` rounded to `weights` (the preset's format for them), refused
/// where a value becomes inf or NaN there.
fn held_as(weights: crate::format::Format, name: &str, mut values: Vec<f32>) -> Result<Vec<f32>> {
    round_to(&mut values, weights);
    match values.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(Error::invalid(
            "parameters",
            format!("{name}[{i}] overflows {weights}, the format the preset holds weights in"),
        )),
        None => Ok(values),
    }
}
