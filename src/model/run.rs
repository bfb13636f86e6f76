//! The one training step loop, for every built model (the GPT's `train::Trainer` is one of its
//! users): the step plan under a precision preset in the backend's own executor
//! (device-resident where the backend has one), its parameters written in, and training steps
//! with GradScaler's loss scaling and fp8 delayed scaling as the preset asks; data parallel
//! over the ranks of a `Collective`; the measured attention and graph choices; the state a
//! checkpoint holds (`train::checkpoint`). Whether a step diverged, was skipped or applied is
//! decided here alone. The executor checks every batch (lengths, ids in range) before it runs.

use super::{Model, PlanOptions};
use crate::backend::reference::ops::round_to;
use crate::backend::{self, Backend};
use crate::choice::{Candidate, Choice, Chooser, ChosenBy, Trials};
use crate::dist::{Collective, Reducer, Reduction, Single};
use crate::error::{Error, Result, gib};
use crate::plan::exec::{
    GradientSum, Memory, Reduced, Timings, grad_norm, poison_then_sum, update_factor,
};
use crate::plan::scalar::StepScalars;
use crate::plan::{AdamW, Plan, Section, Stats, StepExecutor, Storage, TensorId, TensorKind};
use crate::policy::precision::PrecisionRequest;
use crate::policy::{Fp8Role, Fp8State, LossScaler, Precision, Preset, StepDecision};
use crate::tune::AutotuneMode;
use std::borrow::Cow;

/// A run's token ids and class targets, as the plan takes them.
type Batch<'b> = (Cow<'b, [u32]>, Cow<'b, [u32]>);

/// The model of another per-rank batch (sequences), where a model has one: the advice of a
/// plan that does not fit names the largest batch that does.
pub type Resize<'a> = Box<dyn Fn(usize) -> Result<Model> + Send + Sync + 'a>;

/// What one training step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stepped {
    /// The batch's mean loss, before the update (over every rank's rows).
    pub loss: f64,
    /// A gradient held inf or NaN under loss scaling: nothing was updated (GradScaler backs its
    /// scale off). Without loss scaling such a step is `Error::Diverged`.
    pub skipped: bool,
    /// The global norm of the unscaled gradients, before clipping.
    pub grad_norm: f64,
}

/// Weights and AdamW moments, per parameter (declaration order).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainState {
    /// The weights, one row-major vector per parameter (in a "true" preset, its 16-bit values
    /// as f32).
    pub params: Vec<Vec<f32>>,
    /// AdamW's first moments, one vector per parameter, shaped as its weights.
    pub adam_m: Vec<Vec<f32>>,
    /// AdamW's second moments, one vector per parameter, shaped as its weights.
    pub adam_v: Vec<Vec<f32>>,
}

/// How a trainer builds and runs its step, beside the model and the precision. Every choice
/// here leaves the function the step computes as it is.
pub struct RunOptions<'a> {
    /// Seed of the initial parameters and of dropout's masks.
    pub seed: u64,
    /// Attention as one fused op or as separate ops; None: a measured choice (`choose`), fused
    /// until then where the backend has the kernel for every attention op of the model.
    pub fused_attention: Option<bool>,
    /// The matmuls' 16-bit inputs stored as 16-bit codes or as f32; None: codes unless
    /// `MANTISSA_ACTIVATIONS=f32`.
    pub coded_activations: Option<bool>,
    /// Record each section of the step the second time it runs and replay it from then on
    /// (`plan::graph`), or not; None: a measured choice (`choose`), the executor's own until
    /// then. wgpu refuses `Some(true)`.
    pub graphs: Option<bool>,
    /// Run the plan on the backend's own executor (device-resident on a GPU); false: on the host
    /// interpreter, with the host reference's numbers.
    pub resident: bool,
    /// The most device memory the plan's tensors may take, beside what the device has free.
    pub memory_limit: Option<u64>,
    /// The ranks of a data-parallel run (`Single` alone): each runs the model on its slice of
    /// the global batch, and each step sums the gradients over the ranks as `reduction` says
    /// before the unscale, clip and AdamW, so that every rank applies the one-rank update.
    pub group: &'a dyn Collective,
    /// How the ranks sum the gradients. On one rank with a reducer named (`Reducer::Mpi`,
    /// `Reducer::Nccl`) the step still goes through the reduction.
    pub reduction: Reduction,
    /// The global batch in sequences and the model at another per-rank batch, where the model
    /// has them (the GPT's): a plan that does not fit is refused with the largest batch that
    /// does.
    pub resize: Option<(usize, Resize<'a>)>,
    /// The micro-batches a step runs this rank's batch in (gradient accumulation; 1: whole):
    /// the model is one micro-batch's, a step takes this many of them one after another, and
    /// their gradients are summed on the device before the one update (`Plan::accumulate`),
    /// so that the step is that of the batch run whole up to the order of additions.
    pub micro_batches: usize,
}

/// The world of a trainer that runs alone.
static ALONE: Single = Single;

impl RunOptions<'_> {
    /// One rank, the backend's own executor, attention and graphs chosen by measurement.
    pub fn new(seed: u64) -> RunOptions<'static> {
        RunOptions {
            seed,
            fused_attention: None,
            coded_activations: None,
            graphs: None,
            resident: true,
            memory_limit: None,
            group: &ALONE,
            reduction: Reduction::default(),
            resize: None,
            micro_batches: 1,
        }
    }

    /// The sum over the ranks of `ids` (the tensors a data-parallel step sums) as `reduction`
    /// says, each bucket summed while the backward pass runs on where `overlap`, `poison` (a
    /// test's fault) added first.
    fn gradient_sum<'s>(
        &'s self,
        ids: &'s [TensorId],
        overlap: bool,
        poison: Option<(TensorId, f32)>,
    ) -> GradientSum<'s> {
        GradientSum {
            ids,
            group: self.group,
            reducer: self.reduction.reducer,
            bucket: self.reduction.bucket_elements(),
            overlap,
            poison,
        }
    }
}

/// The ways to run attention, as `Chooser::choose` names them: fused, then unfused.
const ATTENTION: [&str; 2] = ["fused", "unfused"];

/// The ways to run a step's sections: launched op by op, or recorded once and replayed.
const GRAPHS: [&str; 2] = ["off", "on"];

/// A model being trained on a backend under one precision.
pub struct ModelTrainer<'a> {
    /// The model it trains (this rank's batch of it).
    pub model: Model,
    /// The preset the precision was decided from.
    pub preset: Preset,
    /// The formats and algorithms the preset decided on this backend.
    pub precision: Precision,
    /// AdamW's settings for the steps to come (nanoGPT's by default).
    pub adamw: AdamW,
    /// Clip the global gradient norm to this; 0 disables.
    pub grad_clip: f32,
    /// Dropout applies (true, the default) or passes its input through (false: evaluation,
    /// as after PyTorch's `model.eval()`), in every run that follows.
    pub training: bool,
    /// GradScaler's dynamic loss scale, where the preset scales the loss (16-mixed).
    pub scaler: Option<LossScaler>,
    /// fp8 delayed scaling's amax histories and scales, where the preset has them.
    pub fp8: Option<Fp8State>,
    /// Steps run, skipped ones included.
    pub steps: u32,
    /// Optimizer steps applied: AdamW's step count `t`.
    pub applied: u32,
    /// How attention came to be fused or not (`choose`).
    pub attention: Choice,
    /// How the step came to be recorded and replayed or not (`choose`).
    pub graphs: Choice,
    /// The last step's gradient reduction (None on one rank).
    pub reduced: Option<Reduced>,
    backend: &'a dyn Backend,
    options: RunOptions<'a>,
    exec: Box<dyn StepExecutor + 'a>,
    /// The tensors a data-parallel step sums (`Plan::split_for_ranks`).
    summed: Vec<TensorId>,
    /// The values inputs written (`set_values`): a copy of each while the attention choice may
    /// still build the plan the other way (to write into it), else empty.
    values: Vec<Option<Vec<f32>>>,
}

/// What builds a trainer's executors: the model, its precision, the backend and the options.
struct Builder<'t, 'a> {
    backend: &'a dyn Backend,
    model: &'t Model,
    precision: &'t Precision,
    options: &'t RunOptions<'a>,
}

impl<'a> Builder<'_, 'a> {
    fn plan_options(&self, fused_attention: bool) -> Result<PlanOptions> {
        Ok(PlanOptions {
            fused_attention,
            coded: match self.options.coded_activations {
                Some(coded) => coded,
                None => super::stores_codes()?,
            },
            seed: self.options.seed,
        })
    }

    /// The step plan, attention `fused` or not, with the initial parameters, split for the
    /// ranks where the run sums gradients (the tensors summed returned), and its executor,
    /// checked against the device's memory first and recording as `options.graphs` says.
    fn executor(&self, fused: bool) -> Result<(Box<dyn StepExecutor + 'a>, Vec<TensorId>)> {
        let mut plan = self.model.plan(self.precision, self.plan_options(fused)?)?;
        // The parameters are held twice on the host: as the plan's constants, and as the
        // executor's copy (the host interpreter's tensors, a device's upload).
        let params = (self.model.params().iter())
            .try_fold(0u64, |n, p| n.checked_add(p.len() as u64 * 4))
            .and_then(|bytes| bytes.checked_mul(2));
        crate::memory::check(
            "the model's parameters, in its plan and its executor",
            params,
        )?;
        for (i, p) in self.model.init(self.options.seed)?.into_iter().enumerate() {
            let p = held_as(self.precision.weights, &self.model.params()[i].name, p)?;
            plan.constants.push((plan.state[i][0], p));
        }
        let o = self.options;
        let summed = if o.group.size() > 1 || o.reduction.reducer != Reducer::Auto {
            plan.split_for_ranks()
        } else {
            vec![]
        };
        if o.micro_batches > 1 {
            let grads: Vec<TensorId> = plan.state.iter().map(|s| s[1]).collect();
            plan.accumulate(if summed.is_empty() { &grads } else { &summed })?;
        }
        let mut exec = if o.resident {
            let fit = self.fit(Storage::shared(&plan).bytes(), fused)?;
            backend::executor(self.backend, plan, true).map_err(|e| fit.explain(e))?
        } else {
            backend::executor(self.backend, plan, false)?
        };
        if let Some(on) = o.graphs {
            exec.record_sections(on)?;
        }
        Ok((exec, summed))
    }
}

impl<'a> ModelTrainer<'a> {
    /// `model` under `request` on `backend`, alone, its parameters drawn from `seed`
    /// (`Model::init`) and held as the preset holds weights; attention fused where
    /// `fused_attention` says (`RunOptions::fused_attention`).
    pub fn new(
        backend: &'a dyn Backend,
        model: Model,
        request: &PrecisionRequest,
        fused_attention: Option<bool>,
        seed: u64,
    ) -> Result<ModelTrainer<'a>> {
        let options = RunOptions {
            fused_attention,
            ..RunOptions::new(seed)
        };
        ModelTrainer::with_options(backend, model, request, options)
    }

    /// `model` under `request` on `backend`, built and run as `options` say. Attention is fused
    /// where `options.fused_attention` says, else where the backend prefers it for every
    /// attention op of the model (`Capabilities::fuses_attention`; the host interpreter runs
    /// either way); fused where the executor has no kernel for the op's heads is refused.
    pub fn with_options(
        backend: &'a dyn Backend,
        model: Model,
        request: &PrecisionRequest,
        options: RunOptions<'a>,
    ) -> Result<ModelTrainer<'a>> {
        if options.micro_batches == 0 {
            return Err(Error::invalid(
                "micro-batches",
                "0: a step runs its batch in at least one",
            ));
        }
        let caps = backend.capabilities();
        let precision = Precision::decide(request, &caps, &super::vocabulary())?;
        let heads = model.attention_heads();
        // Fused by default where the backend prefers it for every attention op of the model; a
        // fused op its executor has no kernel for is refused as the executor is built.
        let preferred = (heads.iter()).all(|(d, _)| caps.fuses_attention(&precision.matmul, *d));
        let fused = options.fused_attention.unwrap_or(preferred);
        let builder = Builder {
            backend,
            model: &model,
            precision: &precision,
            options: &options,
        };
        let (exec, summed) = builder.executor(fused)?;
        let fp8 = match &precision.fp8 {
            Some(recipe) => Fp8State::new(recipe, exec.plan().stats.linears)?,
            None => None,
        };
        let attention = match (heads.is_empty(), options.fused_attention) {
            (true, _) => Choice::untimed("attention", "none", ChosenBy::Default),
            (false, Some(_)) => {
                Choice::untimed("attention", ATTENTION[usize::from(!fused)], ChosenBy::Named)
            }
            (false, None) => Choice::untimed(
                "attention",
                ATTENTION[usize::from(!fused)],
                ChosenBy::Default,
            ),
        };
        let graphs = match options.graphs {
            Some(on) => Choice::untimed("graphs", GRAPHS[usize::from(on)], ChosenBy::Named),
            None => Choice::untimed("graphs", "the executor's own", ChosenBy::Default),
        };
        Ok(ModelTrainer {
            scaler: request.preset.spec().loss_scaling.map(LossScaler::new),
            preset: request.preset,
            values: vec![None; model.values_inputs().len()],
            model,
            precision,
            adamw: AdamW::default(),
            grad_clip: 0.0,
            training: true,
            fp8,
            steps: 0,
            applied: 0,
            attention,
            graphs,
            reduced: None,
            backend,
            options,
            exec,
            summed,
        })
    }

    fn builder(&self) -> Builder<'_, 'a> {
        Builder {
            backend: self.backend,
            model: &self.model,
            precision: &self.precision,
            options: &self.options,
        }
    }

    /// The backend it runs on.
    pub fn backend(&self) -> &'a dyn Backend {
        self.backend
    }

    /// The ranks of its run (`RunOptions::group`).
    pub fn group(&self) -> &'a dyn Collective {
        self.options.group
    }

    /// The seed of its initial parameters and dropout masks.
    pub fn seed(&self) -> u64 {
        self.options.seed
    }

    /// The step plan its executor runs.
    pub fn plan(&self) -> &Plan {
        self.exec.plan()
    }

    /// How the steps run ("device-resident on ..., one submission per step").
    pub fn executor(&self) -> String {
        self.exec.describe()
    }

    /// The device launches of each op of the plan (`StepExecutor::launches`).
    pub fn launches(&self) -> Option<Vec<usize>> {
        self.exec.launches()
    }

    /// Whether the step runs attention as one fused op (`plan::Op::Attention`).
    pub fn fused_attention(&self) -> bool {
        (self.exec.plan().ops.iter()).any(|op| matches!(op, crate::plan::Op::Attention { .. }))
    }

    /// How many tensors the plan stores as 16-bit codes (`Plan::store_codes`).
    pub fn coded_tensors(&self) -> usize {
        self.exec.plan().coded_tensors()
    }

    /// The memory the steps so far took (the plan's tensors, and the peak of everything).
    pub fn memory(&self) -> Memory {
        self.exec.memory()
    }

    /// Delayed fp8 scaling's current scales per linear layer (empty without it).
    pub fn fp8_scales(&self) -> Vec<[f32; 3]> {
        self.fp8.as_ref().map(Fp8State::scales).unwrap_or_default()
    }

    /// Allocates the step plan on the device and builds its kernels (tuning their tiles) now
    /// rather than at the first step, so that a plan the device cannot hold stops here with the
    /// bytes it needs (and, where the model can be resized, a batch that fits), before anything
    /// is written.
    pub async fn prepare(&mut self) -> Result<()> {
        let prepared = self.exec.prepare().await;
        prepared.map_err(|e| {
            let needed = Storage::shared(self.exec.plan()).bytes();
            let fused = self.fused_attention();
            let builder = self.builder();
            PlanFit {
                builder: &builder,
                needed,
                fused,
            }
            .explain(e)
        })
    }

    /// The measured choices, before the first step, timed on `ids` and `targets` (a batch as
    /// `step` takes it; nothing is updated): attention, then graphs for the attention chosen.
    /// Every rank calls this. Returns how attention was chosen (`graphs` says how the graphs
    /// were).
    pub async fn choose(
        &mut self,
        chooser: &Chooser,
        ids: &[u32],
        targets: &[u32],
    ) -> Result<&Choice> {
        let (ids, targets) = self.batch(ids, targets)?;
        // Timed on the first micro-batch, where a step has several.
        let rows = self.exec.plan().rows();
        let batch = (ids[..rows].to_vec(), targets[..rows].to_vec());
        self.choose_attention(chooser, &batch).await?;
        self.choose_graphs(chooser, &batch).await?;
        Ok(&self.attention)
    }

    /// Where attention was left to a measurement and the model has attention: builds the step
    /// plan the other way too, times the forward and backward pass of each on the device
    /// (`Chooser::choose`, the update never run, so the run trains as it would with the chosen
    /// way named), and keeps the faster, its parameters and moments those held now; or takes
    /// the cached choice. A way that fails to build or run is dropped (its reason in
    /// `attention`).
    async fn choose_attention(
        &mut self,
        chooser: &Chooser,
        batch: &(Vec<u32>, Vec<u32>),
    ) -> Result<()> {
        if !self.attention_pending() {
            return Ok(());
        }
        let current = usize::from(!self.fused_attention());
        let scale = self.scaler.map_or(1.0, |s| s.scale);
        let scalars = self.scalars(scale, 0.0)?;
        let key = self.choice_key();
        let group = self.options.group;
        let builder = Builder {
            backend: self.backend,
            model: &self.model,
            precision: &self.precision,
            options: &self.options,
        };
        let mut trials = AttentionTrials {
            builder,
            values: &self.values,
            current: (current, &mut self.exec),
            other: None,
            batch: (&batch.0, &batch.1, scalars),
        };
        let (chosen, choice) = chooser
            .choose("attention", &key, &ATTENTION, current, &mut trials, group)
            .await?;
        let other = trials.other.take();
        if let Some((i, mut exec, summed)) = other
            && i == chosen
        {
            // The parameters and moments held now (set_params, a resumed checkpoint) go along.
            let state = self.state().await?;
            std::mem::swap(&mut self.exec, &mut exec);
            self.summed = summed;
            self.set_state(&state).await?;
            drop(exec);
        }
        // The other plan, dropped now, is no part of the steps' memory.
        self.exec.forget_peak();
        self.attention = choice;
        Ok(())
    }

    /// Whether attention is still to be chosen by measurement (`choose_attention`): left to it,
    /// in a model with attention, and not chosen yet.
    fn attention_pending(&self) -> bool {
        self.options.fused_attention.is_none()
            && self.attention.by == ChosenBy::Default
            && !self.model.attention_heads().is_empty()
    }

    /// Where graphs were left to a measurement and the executor can record its sections (CUDA,
    /// the host interpreter): times the forward and backward pass launched op by op and
    /// replayed from a recording, keeps the faster, or takes the cached choice. An executor
    /// that cannot record runs op by op, and says why.
    async fn choose_graphs(
        &mut self,
        chooser: &Chooser,
        batch: &(Vec<u32>, Vec<u32>),
    ) -> Result<()> {
        if self.options.graphs.is_some() || chooser.mode() == AutotuneMode::Off {
            return Ok(());
        }
        if let Err(e) = self.exec.record_sections(true) {
            self.exec.record_sections(false).ok();
            self.graphs = Choice {
                candidates: vec![Candidate {
                    name: GRAPHS[1].into(),
                    seconds: None,
                    dropped: Some(e.to_string()),
                }],
                ..Choice::untimed("graphs", GRAPHS[0], ChosenBy::Default)
            };
            return Ok(());
        }
        let scale = self.scaler.map_or(1.0, |s| s.scale);
        let scalars = self.scalars(scale, 0.0)?;
        let key = format!("{} attention {}", self.choice_key(), self.attention.chosen);
        let group = self.options.group;
        let mut trials = GraphTrials {
            exec: &mut self.exec,
            batch: (&batch.0, &batch.1, scalars),
        };
        let (chosen, choice) = chooser
            .choose("graphs", &key, &GRAPHS, 0, &mut trials, group)
            .await?;
        self.exec.record_sections(chosen == 1)?;
        self.graphs = choice;
        Ok(())
    }

    /// What a measured choice depends on besides itself: the device, the model and this rank's
    /// share of the batch, the precision, and how the plan is stored and run.
    fn choice_key(&self) -> String {
        let (o, m) = (&self.options, &self.model);
        format!(
            "{} on {}: model {:08x} ({} parameters, {} rows a rank, {} ranks); {} matmuls {} \
             codes {:?} graphs {:?} resident {}",
            self.backend.name(),
            self.backend.device_name(),
            m.fingerprint(),
            m.params().iter().map(|p| p.len()).sum::<usize>(),
            m.rows(),
            o.group.size(),
            self.preset,
            self.precision.matmul,
            o.coded_activations,
            o.graphs,
            o.resident,
        )
    }

    /// Refuses settings no step can use: AdamW's (`AdamW::check`), and a clip that is not
    /// finite and >= 0 (a NaN learning rate made every weight NaN after a step that said it
    /// applied).
    pub fn check_settings(&self) -> Result<()> {
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
        Ok(())
    }

    /// The scalars of a run at `loss_scale` with `poison` added to the first gradient, the
    /// settings checked first: AdamW's (`AdamW::check`), the clip finite and >= 0, the loss
    /// scale and fp8 scales finite and > 0 (a NaN among them poisoned the weights, or skipped
    /// every step, silently).
    fn scalars(&self, loss_scale: f32, poison: f32) -> Result<Vec<f32>> {
        self.scalars_of(loss_scale, poison, 0)
    }

    /// `scalars` for micro-batch `micro` of this rank's batch.
    fn scalars_of(&self, loss_scale: f32, poison: f32, micro: usize) -> Result<Vec<f32>> {
        self.check_settings()?;
        let scale_ok = |s: f32| s.is_finite() && s > 0.0;
        if !scale_ok(loss_scale) {
            return Err(Error::invalid(
                "loss scale",
                format!("{loss_scale} is not finite and > 0"),
            ));
        }
        let fp8 = self.fp8_scales();
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
            poison,
            t: self.applied + 1,
            parts: self.options.group.size() * self.options.micro_batches,
            part: self.options.group.rank() * self.options.micro_batches + micro,
            fp8: &fp8,
            eval: !self.training,
        }
        .array(plan.rows, plan.scalar_count()))
    }

    /// The batch as the plan takes it: token ids and class targets where the model reads them
    /// (a model that reads none is given none, empty slices, and runs on zeros there), and every
    /// values input it reads written (`set_values`). An empty slice for what the model reads
    /// (which trained on token 0), ids for a model that reads none, or a values input never
    /// written, is refused by name.
    /// With micro-batches, the batch is theirs one after another (`RunOptions::micro_batches`).
    fn batch<'b>(&self, ids: &'b [u32], targets: &'b [u32]) -> Result<Batch<'b>> {
        let micro = self.options.micro_batches;
        let rows = self.exec.plan().rows() * micro;
        let split = match micro {
            1 => String::new(),
            n => format!(" in {n} micro-batches of {}", rows / n),
        };
        let given = |x: &'b [u32], what: &'static str, reads: bool| match (reads, x.is_empty()) {
            (true, true) => Err(Error::invalid(
                what,
                format!("the model reads {what} ({rows} of them{split}); none were given"),
            )),
            (false, false) => Err(Error::invalid(
                what,
                format!(
                    "the model reads no {what}; {} were given (pass an empty slice)",
                    x.len()
                ),
            )),
            (true, false) if x.len() != rows => Err(Error::invalid(
                what,
                format!(
                    "the model reads {rows} {what}{split} (a row of its loss each); got {}",
                    x.len()
                ),
            )),
            (true, false) => Ok(Cow::Borrowed(x)),
            (false, true) => Ok(Cow::Owned(vec![0; rows])),
        };
        let ids = given(ids, "token ids", self.model.reads_tokens())?;
        let targets = given(targets, "class targets", self.model.reads_targets())?;
        if let Some(k) =
            (0..self.values.len()).find(|&k| self.values[k].is_none() && self.model.reads_values(k))
        {
            return Err(Error::invalid(
                "values",
                format!("input {k} is read by the model but was never written (set_values)"),
            ));
        }
        Ok((ids, targets))
    }

    /// Writes values input `k` (`ModelBuilder::values`, in declaration order) for the runs
    /// that follow: `values` of its declared length (with micro-batches, that of each of them,
    /// one after another: `RunOptions::micro_batches`).
    pub async fn set_values(&mut self, k: usize, values: &[f32]) -> Result<()> {
        let inputs = self.model.values_inputs();
        let (Some(t), Some(shape)) = (input_tensor(self.exec.plan(), k), inputs.get(k)) else {
            return Err(Error::invalid(
                "values",
                format!("input {k}: the model has {} values inputs", inputs.len()),
            ));
        };
        let (len, micro) = (shape.iter().product::<usize>(), self.options.micro_batches);
        if values.len() != len * micro {
            let each = match micro {
                1 => String::new(),
                n => format!(" for each of {n} micro-batches: {} in all", n * len),
            };
            return Err(Error::invalid(
                "values",
                format!(
                    "input {k} is {shape:?} ({len} values{each}), got {}",
                    values.len()
                ),
            ));
        }
        // An attention's bias may leave keys out with -inf.
        let bias = self.model.values_read_as_bias(k);
        let allowed = |v: f32| v.is_finite() || (bias && v == f32::NEG_INFINITY);
        if let Some(i) = values.iter().position(|&v| !allowed(v)) {
            let finite = match bias {
                true => "a bias is finite or -inf",
                false => "values are finite",
            };
            return Err(Error::invalid(
                "values",
                format!("input {k}[{i}] is {}: {finite}", values[i]),
            ));
        }
        // A copy only for the micro-batches after the first, or while a plan may still be
        // built the other way (`choose`): none per batch otherwise.
        let mut kept = vec![];
        if micro > 1 || self.attention_pending() {
            kept = crate::memory::empty_with_capacity("a values input", values.len())?;
            kept.extend_from_slice(values);
        }
        self.exec.write(t, &values[..len]).await?;
        self.values[k] = Some(kept);
        Ok(())
    }

    /// Writes micro-batch `micro`'s part of each values input kept (`set_values`), where a
    /// step has several.
    async fn write_micro_values(&mut self, micro: usize) -> Result<()> {
        if self.options.micro_batches == 1 {
            return Ok(());
        }
        for (k, values) in self.values.iter().enumerate() {
            if let (Some(values), Some(t)) = (values, input_tensor(self.exec.plan(), k)) {
                let len = self.exec.plan().tensors()[t].len;
                self.exec
                    .write(t, &values[micro * len..(micro + 1) * len])
                    .await?;
            }
        }
        Ok(())
    }

    /// What the loss reads of the last forward pass (its logits, or its predictions), as the
    /// plan holds them: the model's output.
    pub async fn outputs(&mut self) -> Result<Vec<f32>> {
        let logits = self.exec.plan().logits();
        self.exec.read(logits).await
    }

    /// One training step on a batch (token ids and class targets; empty where the model
    /// reads none: values inputs are written before, `set_values`): forward, backward, the
    /// gradients summed over the ranks, unscale and check, and the AdamW update where every
    /// gradient is finite. A step with a gradient or loss that is not finite is skipped under
    /// loss scaling (GradScaler backs off) and is `Error::Diverged` without it, nothing
    /// updated either way.
    pub async fn step(&mut self, ids: &[u32], targets: &[u32]) -> Result<Stepped> {
        Ok(self.step_with(ids, targets, 0.0, false).await?.0)
    }

    /// `step` with `poison` added to the first element of this rank's first (scaled) gradient
    /// before the check: tests inject inf and NaN faults through it.
    pub async fn step_injecting(
        &mut self,
        ids: &[u32],
        targets: &[u32],
        poison: f32,
    ) -> Result<Stepped> {
        Ok(self.step_with(ids, targets, poison, false).await?.0)
    }

    /// `step` with each op of the plan timed (`StepExecutor::run_timed`): the same step, slower
    /// by the timing. A data-parallel step, or one of micro-batches, is not timed (None).
    pub async fn step_timed(
        &mut self,
        ids: &[u32],
        targets: &[u32],
    ) -> Result<(Stepped, Option<Timings>)> {
        self.step_with(ids, targets, 0.0, true).await
    }

    async fn step_with(
        &mut self,
        ids: &[u32],
        targets: &[u32],
        poison: f32,
        timed: bool,
    ) -> Result<(Stepped, Option<Timings>)> {
        let scale = self.scaler.map_or(1.0, |s| s.scale);
        let scalars = self.scalars(scale, poison)?;
        let (ids, targets) = self.batch(ids, targets)?;
        let mut timings = None;
        let stats = if self.options.micro_batches > 1 {
            self.accumulated_step(&ids, &targets, scale, poison).await?
        } else if !self.summed.is_empty() {
            self.reduced_step(&ids, &targets, scale, poison).await?
        } else if timed {
            let run = self.exec.run_timed(Section::Step, &ids, &targets, &scalars);
            let (stats, t) = run.await?;
            timings = Some(t);
            stats
        } else {
            (self.exec.run(Section::Step, &ids, &targets, &scalars)).await?
        };
        let layout = self.exec.plan().stats;
        let loss = stats[Stats::LOSS];
        self.steps += 1;
        // Delayed scaling: this step's amaxes enter the histories; the next step's scales follow.
        if let Some(fp8) = &mut self.fp8 {
            fp8.record(|l, role: Fp8Role| stats[layout.amax(l, role as usize)] as f32);
        }
        // The executor applied AdamW exactly where every gradient was finite.
        let finite = update_factor(&layout, &stats, 0.0).is_some();
        let decision = match self.scaler.as_mut() {
            Some(s) => s.update(finite),
            None if !finite || !loss.is_finite() => {
                return Err(Error::Diverged {
                    preset: self.preset.to_string(),
                    step: self.steps,
                    why: format!(
                        "{} with no loss scaling; try bf16-mixed, or 16-mixed, which scales the loss",
                        if loss.is_finite() {
                            "non-finite gradients"
                        } else {
                            "NaN loss"
                        }
                    ),
                });
            }
            None => StepDecision::Apply,
        };
        self.applied += u32::from(decision == StepDecision::Apply);
        let stepped = Stepped {
            loss,
            skipped: decision == StepDecision::Skip,
            grad_norm: grad_norm(&layout, &stats),
        };
        Ok((stepped, timings))
    }

    /// A data-parallel step: this rank's gradients, summed over the ranks, then the update of
    /// the sum (the same on every rank). Returns the step's stats as one rank would see them:
    /// the mean loss over the ranks, the largest amax, and the flags and norms of the summed
    /// gradients; checks that every rank took the same decision. `poison` (a test's fault)
    /// goes into this rank's own gradient before the sum.
    async fn reduced_step(
        &mut self,
        ids: &[u32],
        targets: &[u32],
        scale: f32,
        poison: f32,
    ) -> Result<Vec<f64>> {
        let scalars = self.scalars(scale, 0.0)?;
        let fault = self.fault(poison);
        let overlap = self.options.reduction.overlap;
        let sum = self.options.gradient_sum(&self.summed, overlap, fault);
        let (stats, reduced) = self
            .exec
            .backward_summed(ids, targets, &scalars, &sum)
            .await?;
        self.update_summed(stats, reduced, (ids, targets, &scalars))
            .await
    }

    /// A step of micro-batches (`RunOptions::micro_batches`): each one's backward pass, its
    /// gradients kept aside or added to those kept (`Plan::accumulate`), the last one's gathered
    /// with them; then the update as a step of the batch run whole takes it, after the sum over
    /// the ranks where there are several. The step's loss is the mean of the micro-batches'
    /// (each the mean over its rows), its amaxes the largest of theirs.
    async fn accumulated_step(
        &mut self,
        ids: &[u32],
        targets: &[u32],
        scale: f32,
        poison: f32,
    ) -> Result<Vec<f64>> {
        let n = self.options.micro_batches;
        let (rows, layout) = (self.exec.plan().rows(), self.exec.plan().stats);
        let amax = layout.amax(0, 0)..layout.len();
        let mut stats = vec![0.0; layout.len()];
        let summing = !self.summed.is_empty();
        let mut scalars = vec![];
        for k in 0..n {
            // Poisoned where the update reads it (one rank), or where the sum does (several).
            let poisoned = (scale, if summing { 0.0 } else { poison });
            let micro;
            (micro, scalars) = self
                .run_micro(Section::Backward, (ids, targets), k, poisoned)
                .await?;
            let (ids, targets) = (&ids[k * rows..(k + 1) * rows], &targets[k * rows..][..rows]);
            stats[Stats::LOSS] += micro[Stats::LOSS] / n as f64;
            for slot in amax.clone() {
                stats[slot] = stats[slot].max(micro[slot]);
            }
            let keep = match k {
                0 => Section::Stash,
                k if k + 1 < n => Section::Accumulate,
                _ => Section::Gather,
            };
            self.exec.run(keep, ids, targets, &scalars).await?;
        }
        let last = (
            &ids[(n - 1) * rows..],
            &targets[(n - 1) * rows..],
            &scalars[..],
        );
        if summing {
            // Summed once the last micro-batch's gradients are gathered: nothing to overlap.
            let fault = self.fault(poison);
            let sum = self.options.gradient_sum(&self.summed, false, fault);
            let reduced = poison_then_sum(self.exec.as_mut(), &sum).await?;
            return self.update_summed(stats, reduced, last).await;
        }
        let update = self.exec.run(Section::Update, last.0, last.1, last.2);
        let mut update = update.await?;
        update[Stats::LOSS] = stats[Stats::LOSS];
        update[amax.clone()].copy_from_slice(&stats[amax]);
        Ok(update)
    }

    /// `poison` (a test's fault) as a data-parallel sum adds it: to this rank's first gradient,
    /// None where it is 0.
    fn fault(&self, poison: f32) -> Option<(TensorId, f32)> {
        let first = self.exec.plan().state.first().map(|s| s[1]);
        first.filter(|_| poison != 0.0).map(|g| (g, poison))
    }

    /// The rest of a data-parallel step once this rank's gradients are summed over the ranks
    /// (`reduced`), its backward pass having given `stats`: the update of the sum, and the
    /// step's stats as one rank would see them (`reduced_step`).
    async fn update_summed(
        &mut self,
        mut stats: Vec<f64>,
        reduced: Reduced,
        (ids, targets, scalars): (&[u32], &[u32], &[f32]),
    ) -> Result<Vec<f64>> {
        self.reduced = Some(reduced);
        let layout = self.exec.plan().stats;
        let group = self.options.group;
        let ranks = group.size() as f64;
        let mut loss = [stats[Stats::LOSS]];
        group.sum_f64(&mut loss)?;
        stats[Stats::LOSS] = loss[0] / ranks;
        let amax = layout.amax(0, 0)..layout.len();
        group.max_f64(&mut stats[amax.clone()])?;
        let update = self
            .exec
            .run(Section::Update, ids, targets, scalars)
            .await?;
        for i in 0..layout.grads {
            stats[layout.flag(i)] = update[layout.flag(i)];
            stats[layout.norm_sq(i)] = update[layout.norm_sq(i)];
        }
        // Identical sums give identical decisions; say so loudly if an engine's were not.
        let skipped = update_factor(&layout, &stats, 0.0).is_none() as u8 as f64;
        let norm = grad_norm(&layout, &stats);
        let mut seen = [skipped, -skipped, norm, -norm];
        group.max_f64(&mut seen)?;
        if seen[0] != -seen[1] || seen[2].to_bits() != (-seen[3]).to_bits() {
            return Err(Error::Collective {
                engine: "data-parallel step",
                op: format!("step {}", self.steps + 1),
                why: format!(
                    "the ranks' summed gradients differ (skip flags {}..{}, norms {}..{}); the \
                     reduction was not the same on every rank",
                    -seen[1], seen[0], -seen[3], seen[2]
                ),
            });
        }
        Ok(stats)
    }

    /// This rank's batch's mean loss under the current parameters (with micro-batches, the
    /// mean of theirs).
    pub async fn loss(&mut self, ids: &[u32], targets: &[u32]) -> Result<f64> {
        let (ids, targets) = self.batch(ids, targets)?;
        let n = self.options.micro_batches;
        let mut loss = 0.0;
        for k in 0..n {
            let run = self.run_micro(Section::Forward, (&ids, &targets), k, (1.0, 0.0));
            loss += run.await?.0[Stats::LOSS] / n as f64;
        }
        Ok(loss)
    }

    /// Runs `section` on micro-batch `k` of a checked batch (`batch`; the batch itself where a
    /// step has one micro-batch): its values inputs written, its scalars at (loss scale,
    /// poison). Returns the run's stats and the scalars.
    async fn run_micro(
        &mut self,
        section: Section,
        (ids, targets): (&[u32], &[u32]),
        k: usize,
        (loss_scale, poison): (f32, f32),
    ) -> Result<(Vec<f64>, Vec<f32>)> {
        self.write_micro_values(k).await?;
        let scalars = self.scalars_of(loss_scale, poison, k)?;
        let span = k * self.exec.plan().rows()..(k + 1) * self.exec.plan().rows();
        let run = (self.exec).run(section, &ids[span.clone()], &targets[span], &scalars);
        Ok((run.await?, scalars))
    }

    /// This rank's batch's mean loss and its gradient with respect to each parameter (loss
    /// scale 1; nothing summed or updated). With micro-batches, each one's gradient is taken
    /// in turn and their sum formed on the host (in f64, rounded to f32 once).
    pub async fn gradients(
        &mut self,
        ids: &[u32],
        targets: &[u32],
    ) -> Result<(f64, Vec<Vec<f32>>)> {
        let (ids, targets) = self.batch(ids, targets)?;
        let n = self.options.micro_batches;
        let (mut loss, mut sums) = (0.0, Vec::<Vec<f64>>::new());
        for k in 0..n {
            let run = self.run_micro(Section::Gradients, (&ids, &targets), k, (1.0, 0.0));
            loss += run.await?.0[Stats::LOSS] / n as f64;
            let grads = self.last_gradients().await?;
            if n == 1 {
                return Ok((loss, grads));
            }
            sums.resize_with(grads.len(), Vec::new);
            for (sum, g) in sums.iter_mut().zip(grads) {
                sum.resize(g.len(), 0.0);
                sum.iter_mut().zip(g).for_each(|(s, g)| *s += f64::from(g));
            }
        }
        let grads = sums
            .into_iter()
            .map(|s| s.into_iter().map(|x| x as f32).collect());
        Ok((loss, grads.collect()))
    }

    /// The gradients the last run left (a step's: summed over the ranks, unscaled, before
    /// clipping), per parameter.
    pub async fn last_gradients(&mut self) -> Result<Vec<Vec<f32>>> {
        let mut grads = vec![];
        for [_, g, _, _] in self.exec.plan().state.clone() {
            grads.push(self.exec.read(g).await?);
        }
        Ok(grads)
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
        let held = self.checked("parameters", params, |_| true)?;
        let state = self.exec.plan().state.clone();
        for ([p, ..], v) in state.iter().zip(held) {
            self.exec.write(*p, &v).await?;
        }
        Ok(())
    }

    /// `tensors` (one per parameter, declaration order) checked against the parameters'
    /// lengths, finite and `ok`, and held as the preset holds weights; refused by name.
    fn checked(
        &self,
        what: &'static str,
        tensors: &[Vec<f32>],
        ok: fn(f32) -> bool,
    ) -> Result<Vec<Vec<f32>>> {
        let declared = self.model.params();
        if tensors.len() != declared.len() {
            return Err(Error::LengthMismatch {
                what: "parameter tensors",
                expected: declared.len(),
                got: tensors.len(),
            });
        }
        for (values, p) in tensors.iter().zip(declared) {
            if values.len() != p.len() {
                return Err(Error::invalid(
                    what,
                    format!(
                        "{} is {:?} ({} values), got {}",
                        p.name,
                        p.shape,
                        p.len(),
                        values.len()
                    ),
                ));
            }
            if let Some(i) = values.iter().position(|&v| !(v.is_finite() && ok(v))) {
                return Err(Error::invalid(
                    what,
                    format!("{}[{i}] is {}: not a value a run holds", p.name, values[i]),
                ));
            }
        }
        let mut held = Vec::with_capacity(tensors.len());
        for (values, p) in tensors.iter().zip(declared) {
            let mut v = crate::memory::empty_with_capacity("a parameter's values", values.len())?;
            v.extend_from_slice(values);
            held.push(held_as(self.precision.weights, &p.name, v)?);
        }
        Ok(held)
    }

    /// The parameters and AdamW moments (read back from the device).
    pub async fn state(&mut self) -> Result<TrainState> {
        let ids = self.exec.plan().state.clone();
        let mut state = TrainState {
            params: vec![],
            adam_m: vec![],
            adam_v: vec![],
        };
        for [p, _, m, v] in ids {
            state.params.push(self.exec.read(p).await?);
            state.adam_m.push(self.exec.read(m).await?);
            state.adam_v.push(self.exec.read(v).await?);
        }
        Ok(state)
    }

    /// Replaces the parameters and AdamW moments, all checked first (shapes, finite, second
    /// moments >= 0): a refused call changes nothing.
    pub async fn set_state(&mut self, state: &TrainState) -> Result<()> {
        let params = self.checked("parameters", &state.params, |_| true)?;
        let (m, v) = (&state.adam_m, &state.adam_v);
        self.checked("AdamW's first moments", m, |_| true)?;
        self.checked("AdamW's second moments", v, |x| x >= 0.0)?;
        let ids = self.exec.plan().state.clone();
        for (i, [p, _, m, v]) in ids.into_iter().enumerate() {
            self.exec.write(p, &params[i]).await?;
            self.exec.write(m, &state.adam_m[i]).await?;
            self.exec.write(v, &state.adam_v[i]).await?;
        }
        Ok(())
    }
}

/// The plan's tensor of values input `k` (its `k`-th `Input`).
fn input_tensor(plan: &Plan, k: usize) -> Option<TensorId> {
    (0..plan.tensors().len())
        .filter(|&t| plan.tensors()[t].kind == TensorKind::Input)
        .nth(k)
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

/// A trainer's graphs choice: its executor's forward and backward pass run with recording
/// paused (`off`) or on, in turn; a recording made in the warm-up runs is kept for the timed
/// ones (`Graphs::set`).
struct GraphTrials<'t, 'a> {
    exec: &'t mut Box<dyn StepExecutor + 'a>,
    batch: (&'t [u32], &'t [u32], Vec<f32>),
}

#[async_trait::async_trait(?Send)]
impl Trials for GraphTrials<'_, '_> {
    async fn build(&mut self, i: usize) -> Result<()> {
        self.exec.record_sections(i == 1)
    }

    async fn run(&mut self, i: usize) -> Result<()> {
        self.exec.record_sections(i == 1)?;
        let (ids, targets, scalars) = &self.batch;
        self.exec
            .run(Section::Backward, ids, targets, scalars)
            .await?;
        Ok(())
    }
}

/// The two step plans of a trainer's attention choice: the one it holds (`current`, by its
/// index in `ATTENTION`) and the other once built, with the values inputs written so far;
/// each times its forward and backward pass on one batch (`Section::Backward`: the gradients
/// written, the weights and moments untouched).
struct AttentionTrials<'t, 'a> {
    builder: Builder<'t, 'a>,
    values: &'t [Option<Vec<f32>>],
    current: (usize, &'t mut Box<dyn StepExecutor + 'a>),
    other: Option<(usize, Box<dyn StepExecutor + 'a>, Vec<TensorId>)>,
    batch: (&'t [u32], &'t [u32], Vec<f32>),
}

#[async_trait::async_trait(?Send)]
impl Trials for AttentionTrials<'_, '_> {
    async fn build(&mut self, i: usize) -> Result<()> {
        if i == self.current.0 || self.other.as_ref().is_some_and(|o| o.0 == i) {
            return Ok(());
        }
        let (mut exec, summed) = self.builder.executor(i == 0)?;
        exec.prepare().await?;
        for (k, values) in self.values.iter().enumerate() {
            if let (Some(values), Some(t)) = (values, input_tensor(exec.plan(), k))
                && !values.is_empty()
            {
                // The first micro-batch's, where a step has several.
                let len = exec.plan().tensors()[t].len;
                exec.write(t, &values[..len]).await?;
            }
        }
        self.other = Some((i, exec, summed));
        Ok(())
    }

    async fn run(&mut self, i: usize) -> Result<()> {
        let exec = match &mut self.other {
            Some((j, exec, _)) if *j == i => exec,
            _ => &mut *self.current.1,
        };
        let (ids, targets, scalars) = &self.batch;
        exec.run(Section::Backward, ids, targets, scalars).await?;
        Ok(())
    }
}

/// What to say where a step plan does not fit the device memory it may take (what the device
/// has free, where the backend can say, and `RunOptions::memory_limit`), checked before it
/// allocates, or where its allocation failed: the bytes needed and available, and, where the
/// model can be resized (`RunOptions::resize`), the largest batch that fits (plans of smaller
/// batches are built on the host to find it).
struct PlanFit<'f> {
    builder: &'f Builder<'f, 'f>,
    needed: u64,
    fused: bool,
}

impl Builder<'_, '_> {
    /// The plan of `needed` bytes (attention `fused`) checked against what the device has free
    /// and the memory limit.
    fn fit(&self, needed: u64, fused: bool) -> Result<PlanFit<'_>> {
        let fit = PlanFit {
            builder: self,
            needed,
            fused,
        };
        let free = self.backend.memory_available();
        let limits = [
            free.map(|(f, t)| (f, format!("and only {} of {} are free", gib(f), gib(t)))),
            (self.options.memory_limit)
                .map(|l| (l, format!("over the limit of {} (--memory-limit)", gib(l)))),
        ];
        let tightest = limits.into_iter().flatten().min_by_key(|(bytes, _)| *bytes);
        match tightest {
            Some((cap, available)) if needed > cap => Err(fit.too_large(available, Some(cap))),
            _ => Ok(fit),
        }
    }
}

impl PlanFit<'_> {
    /// `e` as `PlanTooLarge` where the plan's allocation ran out of memory, or one of its
    /// tensors is larger than a device limit allows (a binding's size on wgpu): a limit of the
    /// machine (exit 1), with a batch that fits.
    fn explain(&self, e: Error) -> Error {
        match e {
            Error::OutOfMemory { total_bytes, .. } => {
                let available = match total_bytes {
                    Some(t) => format!("and the device ({} in all) could not allocate it", gib(t)),
                    None => "and the device could not allocate it".into(),
                };
                self.too_large(available, None)
            }
            Error::TooLarge {
                what,
                requested,
                limit,
                limit_name,
                ..
            } => {
                let available = format!(
                    "and {what} needs {}, more than {limit_name} ({}) allows",
                    gib(requested),
                    gib(limit)
                );
                self.advise(available, Some(limit), largest_tensor)
            }
            e => e,
        }
    }

    fn too_large(&self, available: String, cap: Option<u64>) -> Error {
        self.advise(available, cap, |plan| Storage::shared(plan).bytes())
    }

    /// `PlanTooLarge` saying `available`, with the largest batch (halving, one the ranks
    /// divide) whose plan `measure`s within `cap` (without a cap, half), where the model can be
    /// resized.
    fn advise(&self, available: String, cap: Option<u64>, measure: fn(&Plan) -> u64) -> Error {
        let b = self.builder;
        let (ranks, micro) = (b.options.group.size(), b.options.micro_batches);
        // A plan's rows are one micro-batch of one rank's share of the batch.
        let shares = ranks * micro;
        let Some((batch, resize)) = &b.options.resize else {
            return Error::PlanTooLarge {
                device: b.backend.name(),
                batch: b.model.rows(),
                needed_bytes: self.needed,
                available,
                advice: "build the model on a smaller batch, or use more devices".into(),
            };
        };
        // The bytes of the plan of micro-batches of `sequences`, its gradients accumulated or not.
        let plan_at = |sequences, accumulated: bool| {
            let options = b.plan_options(self.fused).ok()?;
            let mut plan = resize(sequences)
                .and_then(|m| m.plan(b.precision, options))
                .ok()?;
            if accumulated {
                let grads: Vec<TensorId> = plan.state().iter().map(|s| s[1]).collect();
                plan.accumulate(&grads).ok()?;
            }
            Some(measure(&plan))
        };
        let fits = |bytes: u64| cap.is_none_or(|c| bytes <= c);
        let mut smaller = Vec::new();
        let mut n = batch / 2;
        while n >= shares && n.is_multiple_of(shares) {
            if let Some(bytes) = plan_at(n / shares, micro > 1) {
                smaller.push((n, bytes));
                if fits(bytes) {
                    break;
                }
            }
            n /= 2;
        }
        let advice = match smaller.last() {
            Some(&(n, bytes)) if fits(bytes) => {
                // The batch kept in micro-batches of the size that fits, where they fit with
                // their accumulators.
                let keep = match plan_at(n / shares, true) {
                    Some(acc) if fits(acc) => format!(
                        ", or --grad-accum {} to keep the batch of {batch} in micro-batches of \
                         that size ({})",
                        micro * batch / n,
                        gib(acc)
                    ),
                    _ => String::new(),
                };
                format!("a batch of {n} needs {}: try --batch {n}{keep}", gib(bytes))
            }
            Some(&(n, bytes)) => format!(
                "even a batch of {n} needs {}: use a smaller model or more devices",
                gib(bytes)
            ),
            None => "use a smaller model or more devices".into(),
        };
        Error::PlanTooLarge {
            device: b.backend.name(),
            batch: *batch,
            needed_bytes: self.needed,
            available,
            advice,
        }
    }
}

/// The bytes of the largest tensor of `plan`.
fn largest_tensor(plan: &Plan) -> u64 {
    plan.tensors().iter().map(|t| t.bytes()).max().unwrap_or(0)
}
