//! The training loop: presets, master weights, dynamic loss scaling, AdamW, evaluation.

use super::choice::{Candidate, Choice, Chooser, ChosenBy, Trials};
use super::data::{Batches, Corpus};
use super::model::{Gpt, GptConfig};
use crate::algorithm::Algorithm;
use crate::backend::reference::ops::round_to;
use crate::backend::{self, Backend};
use crate::dist::{self, Collective, Reducer, Reduction, Single};
use crate::error::{Error, Result, gib};
use crate::plan::exec::{GradientSum, Memory, Reduced, Timings, grad_norm, update_factor};
use crate::plan::scalar::StepScalars;
use crate::plan::{AdamW, Plan, Section, Stats, StepExecutor, Storage, TensorId};
use crate::policy::precision::PrecisionRequest;
use crate::policy::{
    Fp8Role, Fp8State, LossScaler, Precision, PrecisionClass, Preset, PresetSpec, StepDecision,
};
use crate::tune::AutotuneMode;
use web_time::Instant;

/// What to train and how.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// The model trained.
    pub config: GptConfig,
    /// The training preset: formats, master weights, loss scaling, fp8 (`Preset::spec`).
    pub preset: Preset,
    /// PyTorch's float32 matmul precision: the algorithm of the matmuls where the preset computes
    /// in f32 and no algorithm is pinned (`highest`, plain f32, by default).
    pub matmul_precision: PrecisionClass,
    /// Pins the algorithm of every matmul-like op (overrides preset and precision class).
    pub algorithm: Option<Algorithm>,
    /// fp8 with current scaling instead of delayed scaling (transformer-engine preset).
    pub fp8_current: bool,
    /// Autocast overrides, "op=format,..." (e.g. "softmax=bf16").
    pub autocast_overrides: String,
    /// Seed of the initial weights and of the sampled batches (batch `i` is drawn from `seed`
    /// and `i`, so a run is reproducible step by step).
    pub seed: u64,
    /// The optimizer's hyperparameters.
    pub adamw: AdamW,
    /// Clip the global gradient norm to this (nanoGPT: 1.0); 0 disables.
    pub grad_clip: f32,
    /// Run the step plan on the backend's own executor (device-resident on a GPU); false: on
    /// the host interpreter, the reference's executor, which runs the plan built for the backend
    /// (its precision, its fused attention) with the host reference's numbers.
    pub resident: bool,
    /// The most device memory the step plan's tensors may take, beside what the device has
    /// free (`--memory-limit`: to leave room on a shared GPU).
    pub memory_limit: Option<u64>,
    /// Attention as one fused op (`plan::Op::Attention`) or as separate ops; None: fused where
    /// the backend has a kernel for it (`Capabilities::fuses_attention`). Both compute the same
    /// function; fused on a resident executor without the kernel (wgpu) is an error.
    pub fused_attention: Option<bool>,
    /// The matmuls' 16-bit inputs (layer norm and GELU outputs) stored as 16-bit codes
    /// (`plan::Plan::store_codes`) or as f32; None: codes unless `MANTISSA_ACTIVATIONS=f32`.
    /// Both compute the same function.
    pub coded_activations: Option<bool>,
    /// Record each section of the step the second time it runs and replay the recording
    /// from then on (`plan::graph`: CUDA graphs, or the host interpreter's model of them), or
    /// not; None: timed both ways before the first step and the faster kept
    /// (`Trainer::choose`; with autotuning off, the executor's default: CUDA's
    /// `MANTISSA_CUDA_GRAPH`, the host's off). wgpu refuses `Some(true)`.
    pub graphs: Option<bool>,
}

impl TrainOptions {
    /// `preset` on `config` with everything else as nanoGPT and Lightning default it: matmul
    /// precision `highest`, no pinned algorithm, delayed fp8 scaling, AdamW defaults, clip 1.0.
    pub fn new(config: GptConfig, preset: Preset, seed: u64) -> TrainOptions {
        TrainOptions {
            config,
            preset,
            matmul_precision: PrecisionClass::Highest,
            algorithm: None,
            fp8_current: false,
            autocast_overrides: String::new(),
            seed,
            adamw: AdamW::default(),
            grad_clip: 1.0,
            resident: true,
            memory_limit: None,
            fused_attention: None,
            coded_activations: None,
            graphs: None,
        }
    }
}

/// `--attention`: auto (None: fused where the backend has a kernel for it), fused or unfused.
pub fn attention_choice(name: &str) -> Result<Option<bool>> {
    auto_or(name, "attention (--attention)", ["fused", "unfused"])
}

/// `--graphs`: auto (None: a measured choice, `TrainOptions::graphs`), on or off.
pub fn graphs_choice(name: &str) -> Result<Option<bool>> {
    auto_or(name, "graphs (--graphs)", ["on", "off"])
}

/// "auto" (None), or one of two names (Some(true) for the first).
fn auto_or(name: &str, kind: &'static str, [yes, no]: [&str; 2]) -> Result<Option<bool>> {
    match name.trim() {
        "auto" => Ok(None),
        n if n == yes => Ok(Some(true)),
        n if n == no => Ok(Some(false)),
        other => Err(Error::UnknownName {
            kind,
            given: other.into(),
            valid: ["auto", yes, no].map(String::from).to_vec(),
        }),
    }
}

impl TrainOptions {
    /// What these options ask of the precision policy.
    pub fn precision_request(&self) -> PrecisionRequest<'_> {
        PrecisionRequest {
            preset: self.preset,
            matmul_precision: self.matmul_precision,
            algorithm: self.algorithm,
            fp8_current: self.fp8_current,
            autocast_overrides: &self.autocast_overrides,
        }
    }
}

/// One optimizer step, as the log shows it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepRecord {
    /// The number of this step, from 1 (skipped steps counted).
    pub step: u32,
    /// The loss of the step's batch (`Stats::LOSS`: the mean cross-entropy over its tokens),
    /// before the update.
    pub loss: f64,
    /// The step was skipped: a gradient held inf/NaN (weights and optimizer state untouched).
    pub skipped: bool,
    /// The loss scale after this step's update of the scaler (backed off where the step was
    /// skipped, grown after a run of clean steps): the scale the next step runs under. None
    /// where the preset does not scale the loss.
    pub loss_scale: Option<f32>,
    /// The global L2 norm of the unscaled gradients, before clipping (`grad_clip`).
    pub grad_norm: f64,
    /// Wall-clock milliseconds of the step: batch drawn, plan run, stats read back.
    pub dt_ms: f64,
    /// Tokens of the global batch per second of `dt_ms`.
    pub tokens_per_s: f64,
}

/// A model being trained under one preset on one backend.
pub struct Trainer<'a> {
    /// The model: its configuration and the backend it runs on.
    pub gpt: Gpt<'a>,
    /// The text the training and validation batches are drawn from (unless `use_batches` gives
    /// the training batches).
    pub corpus: &'a Corpus,
    /// The options the trainer was built with.
    pub options: TrainOptions,
    /// What the preset means (`Preset::spec`).
    pub spec: PresetSpec,
    /// The formats and algorithms of the step, as the preset, autocast and the options resolve
    /// them.
    pub precision: Precision,
    /// Delayed fp8 scaling's amax histories and scales (the one mutable precision state).
    pub fp8: Option<Fp8State>,
    /// Steps run (skipped ones included) and optimizer steps applied.
    pub step: u32,
    /// Optimizer steps applied (skipped steps not counted): AdamW's step count `t`.
    pub applied: u32,
    /// Dynamic loss scaling's state (GradScaler), where the preset scales the loss.
    pub scaler: Option<LossScaler>,
    /// Runs the step plan and holds the weights (f32 master weights, or 16-bit in "true"
    /// presets) and the AdamW moments.
    exec: Box<dyn StepExecutor + 'a>,
    /// The ranks of a data-parallel run (`Single` otherwise), and how they sum gradients.
    group: &'a dyn Collective,
    reduction: Reduction,
    /// The tensors a data-parallel step sums (`Plan::split_for_ranks`).
    summed: Vec<TensorId>,
    /// The last step's gradient reduction (None on one rank).
    pub reduced: Option<Reduced>,
    /// Training batches given in a file (`use_batches`), taken in order instead of sampled.
    batches: Option<Batches>,
    /// How attention came to be fused or not (`choose`).
    pub attention: Choice,
    /// How the step came to be recorded and replayed or not (`choose`).
    pub graphs: Choice,
}

/// The ways to run attention, as `Chooser::choose` names them: fused, then unfused.
const ATTENTION: [&str; 2] = ["fused", "unfused"];

/// The ways to run a step's sections, as `Chooser::choose` names them: launched op by op, or
/// recorded once and replayed (`plan::graph`).
const GRAPHS: [&str; 2] = ["off", "on"];

/// A trainer's graphs choice: its executor's forward and backward pass run with recording
/// paused (`off`) or on, in turn; a recording made in the warm-up runs is kept for the timed
/// ones (`Graphs::set`).
struct GraphTrials<'t, 'a> {
    exec: &'t mut Box<dyn StepExecutor + 'a>,
    batch: (Vec<u32>, Vec<u32>, Vec<f32>),
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
/// index in `ATTENTION`) and the other once built; each times its forward and backward pass on
/// one batch (`Section::Backward`: the gradients written, the weights and moments untouched).
struct AttentionTrials<'t, 'a> {
    gpt: &'t Gpt<'a>,
    precision: &'t Precision,
    options: &'t TrainOptions,
    group: &'a dyn Collective,
    reduction: Reduction,
    current: (usize, &'t mut Box<dyn StepExecutor + 'a>),
    other: Option<(usize, Box<dyn StepExecutor + 'a>, Vec<TensorId>)>,
    batch: (Vec<u32>, Vec<u32>, Vec<f32>),
}

#[async_trait::async_trait(?Send)]
impl Trials for AttentionTrials<'_, '_> {
    async fn build(&mut self, i: usize) -> Result<()> {
        if i == self.current.0 || self.other.as_ref().is_some_and(|o| o.0 == i) {
            return Ok(());
        }
        let (sequences, fused) = (self.batch.0.len() / self.gpt.config.block_size, i == 0);
        let (group, reduction) = (self.group, self.reduction);
        let options = (self.gpt, self.precision, self.options);
        let (mut exec, summed) = build_executor(
            options.0, options.1, options.2, group, reduction, sequences, fused,
        )?;
        exec.prepare().await?;
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

/// The step plan of `options` for `gpt`, attention `fused` or not, its initial weights in it,
/// split for the ranks where the run sums gradients (the tensors summed returned), and its
/// executor (the backend's own, or the host interpreter where `options.resident` is false),
/// checked against the device's memory first and recording sections as `options.graphs` says.
fn build_executor<'a>(
    gpt: &Gpt<'a>,
    precision: &Precision,
    options: &TrainOptions,
    group: &dyn Collective,
    reduction: Reduction,
    sequences: usize,
    fused: bool,
) -> Result<(Box<dyn StepExecutor + 'a>, Vec<TensorId>)> {
    let cfg = &options.config;
    let coded = match options.coded_activations {
        Some(coded) => coded,
        None => super::model::stores_codes()?,
    };
    let mut plan = gpt.plan_with(precision, sequences, cfg.block_size, fused, coded)?;
    for (i, mut p) in cfg.init(options.seed)?.into_iter().enumerate() {
        round_to(&mut p, precision.weights);
        plan.constants.push((plan.state[i][0], p));
    }
    let summed = if group.size() > 1 || reduction.reducer != Reducer::Auto {
        plan.split_for_ranks()
    } else {
        vec![]
    };
    let mut exec = if options.resident {
        let fits = PlanFit::check(gpt, precision, options, group, &plan)?;
        backend::executor(gpt.backend, plan, true).map_err(|e| fits.explain(e))?
    } else {
        backend::executor(gpt.backend, plan, false)?
    };
    if let Some(on) = options.graphs {
        exec.record_sections(on)?;
    }
    Ok((exec, summed))
}

/// The world of a trainer that runs alone.
static ALONE: Single = Single;

/// Weights and AdamW moments, per parameter (`GptConfig::parameter_shapes` order).
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

impl<'a> Trainer<'a> {
    /// Builds the step plan of `options` for `backend` and its executor (the backend's own, or
    /// the host interpreter where `options.resident` is false), with nanoGPT's initial weights.
    pub fn new(
        backend: &'a dyn Backend,
        corpus: &'a Corpus,
        options: TrainOptions,
    ) -> Result<Trainer<'a>> {
        Trainer::data_parallel(backend, corpus, options, &ALONE, Reduction::default())
    }

    /// A trainer that is rank `group.rank()` of `group.size()` of one run: its plan takes its
    /// slice of each global batch (`options.config.batch_size` sequences, which the ranks must
    /// divide), and each step sums the gradients over the ranks as `reduction` says before the
    /// unscale, clip and AdamW, so that every rank applies the one-rank update. On one rank
    /// with a reducer named (`Reducer::Mpi`, `Reducer::Nccl`) the step still goes through the
    /// reduction (a check of the engine and of its overlap with the backward pass).
    pub fn data_parallel(
        backend: &'a dyn Backend,
        corpus: &'a Corpus,
        options: TrainOptions,
        group: &'a dyn Collective,
        reduction: Reduction,
    ) -> Result<Trainer<'a>> {
        let local = dist::shard(options.config.batch_size, group.rank(), group.size())?;
        check_settings(&options)?;
        let spec = options.preset.spec();
        let precision = Precision::decide(&options.precision_request(), &backend.capabilities())?;
        let fp8 = match &precision.fp8 {
            Some(recipe) => Fp8State::new(recipe, 4 * options.config.n_layer)?,
            None => None,
        };
        let gpt = Gpt {
            config: options.config.clone(),
            backend,
        };
        let fused = options.fused_attention.unwrap_or_else(|| {
            backend
                .capabilities()
                .fuses_attention(&precision.matmul, options.config.head_dim())
        });
        let attention = Choice::untimed(
            "attention",
            ATTENTION[usize::from(!fused)],
            match options.fused_attention {
                Some(_) => ChosenBy::Named,
                None => ChosenBy::Default,
            },
        );
        let graphs = match options.graphs {
            Some(on) => Choice::untimed("graphs", GRAPHS[usize::from(on)], ChosenBy::Named),
            None => Choice::untimed("graphs", "the executor's own", ChosenBy::Default),
        };
        let (exec, summed) = build_executor(
            &gpt,
            &precision,
            &options,
            group,
            reduction,
            local.len(),
            fused,
        )?;
        Ok(Trainer {
            gpt,
            corpus,
            scaler: spec.loss_scaling.map(LossScaler::new),
            spec,
            precision,
            fp8,
            step: 0,
            applied: 0,
            exec,
            options,
            group,
            reduction,
            summed,
            reduced: None,
            batches: None,
            attention,
            graphs,
        })
    }

    /// Starts from `params` (`GptConfig::parameter_shapes` order and layout, e.g. from
    /// `init::read_init`) instead of the seeded initial weights, held as the preset holds its
    /// weights (rounded to 16 bits in the "true" presets). Before the first step.
    pub async fn set_weights(&mut self, params: &[Vec<f32>]) -> Result<()> {
        let shapes = self.gpt.config.parameter_shapes();
        if params.len() != shapes.len() {
            return Err(Error::LengthMismatch {
                what: "parameter tensors",
                expected: shapes.len(),
                got: params.len(),
            });
        }
        let ids = self.exec.plan().state.clone();
        for ((values, [p, ..]), (name, shape)) in params.iter().zip(ids).zip(shapes) {
            if values.len() != shape.iter().product::<usize>() {
                return Err(Error::invalid(
                    "initial weights",
                    format!(
                        "{name} holds {} values, its shape is {shape:?}",
                        values.len()
                    ),
                ));
            }
            let mut held = values.clone();
            round_to(&mut held, self.precision.weights);
            self.exec.write(p, &held).await?;
        }
        Ok(())
    }

    /// Takes the training batches from `batches` in order (batch i at step i + 1, resumed runs
    /// included) instead of sampling them; refused where its batch shape is not the run's.
    pub fn use_batches(&mut self, batches: Batches) -> Result<()> {
        let cfg = &self.gpt.config;
        if (batches.batch, batches.t) != (cfg.batch_size, cfg.block_size) {
            return Err(Error::invalid(
                "batches",
                format!(
                    "{} rows of {} tokens, this run's batches are {} rows of {}",
                    batches.batch, batches.t, cfg.batch_size, cfg.block_size
                ),
            ));
        }
        self.batches = Some(batches);
        Ok(())
    }

    /// Allocates the step plan on the device and builds its kernels (tuning their tiles) now
    /// rather than at the first step, so that a plan the device cannot hold stops here with
    /// the bytes it needs and a batch that fits, before anything is written.
    pub async fn prepare(&mut self) -> Result<()> {
        let prepared = self.exec.prepare().await;
        prepared.map_err(|e| {
            let fit = PlanFit {
                gpt: &self.gpt,
                precision: &self.precision,
                group: self.group,
                needed: Storage::shared(self.exec.plan()).bytes(),
            };
            fit.explain(e)
        })
    }

    /// The measured choices, before the first step: attention (`choose_attention`), then
    /// graphs (`choose_graphs`) for the attention chosen. Every rank calls this. Returns how
    /// attention was chosen (`graphs` says how the graphs were).
    pub async fn choose(&mut self, chooser: &Chooser) -> Result<&Choice> {
        self.choose_attention(chooser).await?;
        self.choose_graphs(chooser).await?;
        Ok(&self.attention)
    }

    /// Where graphs were left to `auto` (`TrainOptions::graphs` None) and the executor can
    /// record its sections (CUDA, the host interpreter): times the forward and backward pass
    /// launched op by op and replayed from a recording (`GraphTrials`), keeps the faster, or
    /// takes the cached choice. An executor that cannot record runs op by op, and says why.
    async fn choose_graphs(&mut self, chooser: &Chooser) -> Result<()> {
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
        let (ids, targets) = self.local_batch(true, 0)?;
        let scale = self.scaler.map(|s| s.scale).unwrap_or(1.0);
        let scalars = self.scalars(scale, 0.0);
        let key = format!("{} attention {}", self.choice_key(), self.attention.chosen);
        let mut trials = GraphTrials {
            exec: &mut self.exec,
            batch: (ids, targets, scalars),
        };
        let (chosen, choice) = chooser
            .choose("graphs", &key, &GRAPHS, 0, &mut trials, self.group)
            .await?;
        self.exec.record_sections(chosen == 1)?;
        self.graphs = choice;
        Ok(())
    }

    /// Where attention was left to `auto` (`TrainOptions::fused_attention` None): builds the
    /// step plan the other way too, times the forward and backward pass of each on the device
    /// (`Chooser::choose`: a validation batch, the update never run, so the run trains as it
    /// would with the chosen way named), and keeps the faster, its weights and moments those
    /// held now; or takes the cached choice. A way that fails to build or run is dropped (its
    /// reason in `attention`).
    async fn choose_attention(&mut self, chooser: &Chooser) -> Result<()> {
        if self.options.fused_attention.is_some() {
            return Ok(());
        }
        let current = usize::from(!self.fused_attention());
        let (ids, targets) = self.local_batch(true, 0)?;
        let scale = self.scaler.map(|s| s.scale).unwrap_or(1.0);
        let scalars = self.scalars(scale, 0.0);
        let key = self.choice_key();
        let mut trials = AttentionTrials {
            gpt: &self.gpt,
            precision: &self.precision,
            options: &self.options,
            group: self.group,
            reduction: self.reduction,
            current: (current, &mut self.exec),
            other: None,
            batch: (ids, targets, scalars),
        };
        let (chosen, choice) = chooser
            .choose(
                "attention",
                &key,
                &ATTENTION,
                current,
                &mut trials,
                self.group,
            )
            .await?;
        let other = trials.other.take();
        match other {
            Some((i, mut exec, summed)) if i == chosen => {
                // The weights and moments held now (set_weights, a resumed checkpoint) go along.
                let state = self.state().await?;
                std::mem::swap(&mut self.exec, &mut exec);
                self.summed = summed;
                self.set_state(&state).await?;
                drop(exec);
            }
            other => drop(other),
        }
        // The other plan, dropped now, is no part of the steps' memory.
        self.exec.forget_peak();
        self.attention = choice;
        Ok(())
    }

    /// What a measured choice depends on besides itself: the device, the shape of this rank's
    /// step, the precision and how the plan is stored and run.
    fn choice_key(&self) -> String {
        let (cfg, o) = (&self.gpt.config, &self.options);
        let backend = self.gpt.backend;
        format!(
            "{} on {}: layers {} heads {} embd {} context {} batch {} of {} vocab {}; {} matmuls {} \
             codes {:?} graphs {:?} resident {}",
            backend.name(),
            backend.device_name(),
            cfg.n_layer,
            cfg.n_head,
            cfg.n_embd,
            cfg.block_size,
            cfg.batch_size / self.group.size().max(1),
            cfg.batch_size,
            cfg.vocab_size,
            o.preset,
            self.precision.matmul,
            o.coded_activations,
            o.graphs,
            o.resident,
        )
    }

    /// Tokens of the global batch (every rank's).
    pub fn tokens_per_step(&self) -> usize {
        self.gpt.config.batch_size * self.gpt.config.block_size
    }

    /// Whether steps sum their gradients over the ranks (several ranks, or a reducer named:
    /// `data_parallel`).
    fn reduces(&self) -> bool {
        !self.summed.is_empty()
    }

    /// This rank's slice of batch `index` of the training or validation split.
    fn local_batch(&self, validation: bool, index: u64) -> Result<(Vec<u32>, Vec<u32>)> {
        let cfg = &self.gpt.config;
        let (ids, targets) = match &self.batches {
            Some(given) if !validation => given.get(index as usize).ok_or_else(|| {
                Error::invalid(
                    "batches",
                    format!(
                        "step {} needs batch {}, the given batches hold {}",
                        index + 1,
                        index + 1,
                        given.len()
                    ),
                )
            })?,
            _ => self.corpus.batch(
                validation,
                cfg.batch_size,
                cfg.block_size,
                self.options.seed,
                index,
            )?,
        };
        let rows = dist::shard(cfg.batch_size, self.group.rank(), self.group.size())?;
        let span = rows.start * cfg.block_size..rows.end * cfg.block_size;
        Ok((ids[span.clone()].to_vec(), targets[span].to_vec()))
    }

    /// The step plan the trainer runs.
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
        let ops = &self.exec.plan().ops;
        ops.iter()
            .any(|op| matches!(op, crate::plan::Op::Attention { .. }))
    }

    /// How many tensors the plan stores as 16-bit codes (`Plan::store_codes`).
    pub fn coded_tensors(&self) -> usize {
        self.exec.plan().coded_tensors()
    }

    /// The memory the steps so far took (the plan's tensors, and the peak of everything).
    pub fn memory(&self) -> Memory {
        self.exec.memory()
    }

    /// The weights and AdamW moments (read back from the device).
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

    /// Replaces the weights and AdamW moments.
    pub async fn set_state(&mut self, state: &TrainState) -> Result<()> {
        let ids = self.exec.plan().state.clone();
        let tensors = [&state.params, &state.adam_m, &state.adam_v];
        if tensors.iter().any(|t| t.len() != ids.len()) {
            return Err(Error::LengthMismatch {
                what: "training state tensors",
                expected: ids.len(),
                got: state.params.len(),
            });
        }
        for (i, [p, _, m, v]) in ids.into_iter().enumerate() {
            self.exec.write(p, &state.params[i]).await?;
            self.exec.write(m, &state.adam_m[i]).await?;
            self.exec.write(v, &state.adam_v[i]).await?;
        }
        Ok(())
    }

    /// The gradients of the last step (unscaled, before clipping), per parameter.
    pub async fn gradients(&mut self) -> Result<Vec<Vec<f32>>> {
        let ids = self.exec.plan().state.clone();
        let mut grads = Vec::with_capacity(ids.len());
        for [_, g, _, _] in ids {
            grads.push(self.exec.read(g).await?);
        }
        Ok(grads)
    }

    /// Delayed fp8 scaling's current scales per linear layer (empty without it).
    pub fn fp8_scales(&self) -> Vec<[f32; 3]> {
        self.fp8.as_ref().map(Fp8State::scales).unwrap_or_default()
    }

    /// The scalars of the next step at `loss_scale`, with `poison` for the first gradient.
    fn scalars(&self, loss_scale: f32, poison: f32) -> Vec<f32> {
        let plan = self.exec.plan();
        StepScalars {
            adamw: &self.options.adamw,
            clip: self.options.grad_clip,
            loss_scale,
            poison,
            t: self.applied + 1,
            ranks: self.group.size(),
            fp8: &self.fp8_scales(),
        }
        .array(plan.rows, plan.scalar_count())
    }

    /// One training step.
    pub async fn step(&mut self) -> Result<StepRecord> {
        self.step_injecting(0.0).await
    }

    /// One training step with `poison` added to the first element of the first (scaled)
    /// gradient before the check: tests inject inf and NaN faults through it.
    pub async fn step_injecting(&mut self, poison: f32) -> Result<StepRecord> {
        Ok(self.step_with(poison, false).await?.0)
    }

    /// One training step with each op of the plan timed (`StepExecutor::run_timed`): the same
    /// step as `step`, slower by the timing. A data-parallel step is not timed (None).
    pub async fn step_timed(&mut self) -> Result<(StepRecord, Option<Timings>)> {
        self.step_with(0.0, true).await
    }

    async fn step_with(
        &mut self,
        poison: f32,
        timed: bool,
    ) -> Result<(StepRecord, Option<Timings>)> {
        let start = Instant::now();
        // The options are the caller's to change between steps: checked before each.
        check_settings(&self.options)?;
        let (ids, targets) = self.local_batch(false, self.step as u64)?;
        self.gpt
            .check_batch(&ids, &targets, self.gpt.config.block_size)?;
        let scale = self.scaler.map(|s| s.scale).unwrap_or(1.0);
        let mut timings = None;
        let stats = if self.reduces() {
            self.reduced_step(&ids, &targets, scale, poison).await?
        } else {
            let scalars = self.scalars(scale, poison);
            let exec = &mut self.exec;
            if timed {
                let (stats, t) = exec
                    .run_timed(Section::Step, &ids, &targets, &scalars)
                    .await?;
                timings = Some(t);
                stats
            } else {
                exec.run(Section::Step, &ids, &targets, &scalars).await?
            }
        };
        let layout = self.exec.plan().stats;
        let loss = stats[Stats::LOSS];
        self.step += 1;
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
                    preset: self.options.preset.to_string(),
                    step: self.step,
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
        if decision == StepDecision::Apply {
            self.applied += 1;
        }
        let dt = start.elapsed().as_secs_f64();
        let record = StepRecord {
            step: self.step,
            loss,
            skipped: decision == StepDecision::Skip,
            loss_scale: self.scaler.map(|s| s.scale),
            grad_norm: grad_norm(&layout, &stats),
            dt_ms: dt * 1e3,
            tokens_per_s: self.tokens_per_step() as f64 / dt,
        };
        Ok((record, timings))
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
        let scalars = self.scalars(scale, 0.0);
        let layout = self.exec.plan().stats;
        let first = self.exec.plan().state.first().map(|s| s[1]);
        let sum = GradientSum {
            ids: &self.summed,
            group: self.group,
            reducer: self.reduction.reducer,
            bucket: self.reduction.bucket_elements(),
            overlap: self.reduction.overlap,
            poison: first.filter(|_| poison != 0.0).map(|g| (g, poison)),
        };
        let (mut stats, reduced) = self
            .exec
            .backward_summed(ids, targets, &scalars, &sum)
            .await?;
        self.reduced = Some(reduced);
        let ranks = self.group.size() as f64;
        let mut loss = [stats[Stats::LOSS]];
        self.group.sum_f64(&mut loss)?;
        stats[Stats::LOSS] = loss[0] / ranks;
        let amax = layout.amax(0, 0)..layout.len();
        self.group.max_f64(&mut stats[amax.clone()])?;
        let update = self
            .exec
            .run(Section::Update, ids, targets, &scalars)
            .await?;
        for i in 0..layout.grads {
            stats[layout.flag(i)] = update[layout.flag(i)];
            stats[layout.norm_sq(i)] = update[layout.norm_sq(i)];
        }
        // Identical sums give identical decisions; say so loudly if an engine's were not.
        let skipped = update_factor(&layout, &stats, 0.0).is_none() as u8 as f64;
        let norm = grad_norm(&layout, &stats);
        let mut seen = [skipped, -skipped, norm, -norm];
        self.group.max_f64(&mut seen)?;
        if seen[0] != -seen[1] || seen[2].to_bits() != (-seen[3]).to_bits() {
            return Err(Error::Collective {
                engine: "data-parallel step",
                op: format!("step {}", self.step + 1),
                why: format!(
                    "the ranks' summed gradients differ (skip flags {}..{}, norms {}..{}); the \
                     reduction was not the same on every rank",
                    -seen[1], seen[0], -seen[3], seen[2]
                ),
            });
        }
        Ok(stats)
    }

    /// Generates `count` characters after `prompt` (sampling at `temperature`; 0 is greedy).
    pub async fn sample(
        &mut self,
        prompt: &str,
        count: usize,
        temperature: f32,
        seed: u64,
    ) -> Result<String> {
        self.sample_streaming(prompt, count, temperature, seed, |_| Ok(()))
            .await
    }

    /// `sample`, handing each character to `each` as soon as it is drawn (`mantissa sample`
    /// prints them as they come); an error of `each` ends the sampling. A prompt character
    /// outside the corpus's vocabulary is refused (it cannot condition the model), and so is a
    /// temperature that is not finite and >= 0; logits that are not finite (weights that
    /// overflow) end the sampling with an error naming the character (`pick_token`).
    pub async fn sample_streaming(
        &mut self,
        prompt: &str,
        count: usize,
        temperature: f32,
        seed: u64,
        mut each: impl FnMut(&str) -> Result<()>,
    ) -> Result<String> {
        use rand::SeedableRng;
        if count > MAX_SAMPLE_TOKENS {
            return Err(Error::invalid(
                "characters to sample",
                format!("{count}: at most {MAX_SAMPLE_TOKENS}"),
            ));
        }
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(Error::invalid(
                "temperature",
                format!("{temperature} is not a finite temperature >= 0"),
            ));
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let vocab = &self.corpus.vocab;
        let mut ids = self
            .corpus
            .encode(prompt)
            .map_err(|why| Error::invalid("prompt", why))?;
        if ids.is_empty() {
            ids.push(vocab.binary_search(&'\n').unwrap_or(0) as u32);
        }
        let start = ids.len();
        let (t, v) = (self.gpt.config.block_size, self.gpt.config.vocab_size);
        let params = self.state().await?.params;
        let fp8 = self.fp8_scales();
        // One executor per context length: once the context is full, every token reuses it.
        let mut exec: Option<(Box<dyn StepExecutor + '_>, Vec<f32>)> = None;
        for drawn in 0..count {
            let context = &ids[ids.len().saturating_sub(t)..];
            let (e, scalars) = match &mut exec {
                Some((e, s)) if e.plan().rows() == context.len() => (e, s),
                _ => {
                    let made = (self.gpt)
                        .executor(&self.precision, &fp8, &params, context, context)
                        .await?;
                    let (e, s) = exec.insert(made);
                    (e, s)
                }
            };
            e.run(Section::Forward, context, context, scalars).await?;
            let logits = e.read(e.plan().logits()).await?;
            let last = &logits[(context.len() - 1) * v..context.len() * v];
            let next = pick_token(last, temperature, &mut rng).map_err(|why| {
                Error::invalid(
                    "weights",
                    format!("sampling character {} of {count}: {why}", drawn + 1),
                )
            })?;
            ids.push(next as u32);
            each(&self.corpus.decode(&ids[ids.len() - 1..]))?;
        }
        Ok(self.corpus.decode(&ids[start..]))
    }

    /// Mean validation loss over `batches` fixed batches (1 to `MAX_EVAL_BATCHES`). A loss
    /// that is not finite stops the run: `Error::Diverged` at the step it follows (weights that
    /// overflowed in an update whose own loss was finite, as a huge learning rate makes them).
    pub async fn evaluate(&mut self, batches: usize) -> Result<f64> {
        if !(1..=MAX_EVAL_BATCHES).contains(&batches) {
            return Err(Error::invalid(
                "evaluation batches",
                format!("{batches}: between 1 and {MAX_EVAL_BATCHES}"),
            ));
        }
        let mut total = [0.0];
        for i in 0..batches {
            let (ids, targets) = self.local_batch(true, i as u64)?;
            let scalars = self.scalars(1.0, 0.0);
            let stats = self
                .exec
                .run(Section::Forward, &ids, &targets, &scalars)
                .await?;
            total[0] += stats[Stats::LOSS];
        }
        // Each rank's loss is the mean over its slice: the batch's is the mean over the ranks.
        self.group.sum_f64(&mut total)?;
        let loss = total[0] / (batches * self.group.size()) as f64;
        if !loss.is_finite() {
            return Err(Error::Diverged {
                preset: self.options.preset.to_string(),
                step: self.step,
                why: format!(
                    "validation loss {loss} after step {}: the weights no longer give finite \
                     losses; try a smaller learning rate",
                    self.step
                ),
            });
        }
        Ok(loss)
    }
}

/// Refuses settings no step can use: AdamW's (`AdamW::check`), and a clip that is not finite
/// and >= 0 (a NaN learning rate made every weight NaN after a step that said it applied).
fn check_settings(options: &TrainOptions) -> Result<()> {
    options.adamw.check()?;
    if !(options.grad_clip.is_finite() && options.grad_clip >= 0.0) {
        return Err(Error::invalid(
            "grad_clip",
            format!(
                "{} is not finite and >= 0 (0 disables clipping)",
                options.grad_clip
            ),
        ));
    }
    Ok(())
}

/// The most characters `sample` generates (each is a forward pass of the model).
pub const MAX_SAMPLE_TOKENS: usize = 100_000;

/// The most validation batches one evaluation runs (`--eval-batches`): each is a forward pass.
pub const MAX_EVAL_BATCHES: usize = 10_000;

/// The next token after `logits` (one per vocabulary entry, finite): the largest at
/// temperature 0 (the first of equals), else drawn from softmax(logits / temperature) with
/// `rng` (`temperature` finite and > 0). Logits that are not all finite (a model whose weights
/// overflow) are refused, with how many are inf or NaN: there is no distribution to draw from.
pub fn pick_token(
    logits: &[f32],
    temperature: f32,
    rng: &mut impl rand::Rng,
) -> std::result::Result<usize, String> {
    use rand::RngExt;
    let bad = logits.iter().filter(|l| !l.is_finite()).count();
    if bad > 0 || logits.is_empty() {
        return Err(format!(
            "{bad} of the {} logits are inf or NaN: the weights overflow (a run that diverged)",
            logits.len()
        ));
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let first_max = logits.iter().position(|&l| l == max).unwrap_or(0);
    if temperature <= 0.0 {
        return Ok(first_max);
    }
    // In f64: a difference of two finite f32 logits, over a finite temperature, is finite or
    // -inf, its exponential in [0, 1], and the largest logit's weight is 1.
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| ((l as f64 - max as f64) / temperature as f64).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    if !(total.is_finite() && total >= 1.0) {
        return Ok(first_max);
    }
    let mut pick = rng.random_range(0.0..total);
    Ok(weights
        .iter()
        .position(|&w| {
            pick -= w;
            pick < 0.0
        })
        .unwrap_or(first_max))
}

/// Whether a step plan fits the device memory it may take (what the device has free, where
/// the backend can say, and `TrainOptions::memory_limit`), checked before it allocates; and
/// what to say if it does not fit or its allocation fails: the bytes needed and available,
/// and the largest batch that fits (plans of smaller batches are built on the host to find
/// it).
struct PlanFit<'a> {
    gpt: &'a Gpt<'a>,
    precision: &'a Precision,
    group: &'a dyn Collective,
    needed: u64,
}

impl<'a> PlanFit<'a> {
    fn check(
        gpt: &'a Gpt<'a>,
        precision: &'a Precision,
        options: &TrainOptions,
        group: &'a dyn Collective,
        plan: &Plan,
    ) -> Result<PlanFit<'a>> {
        let fit = PlanFit {
            gpt,
            precision,
            group,
            needed: Storage::shared(plan).bytes(),
        };
        let free = gpt.backend.memory_available();
        let limits = [
            free.map(|(f, t)| (f, format!("and only {} of {} are free", gib(f), gib(t)))),
            options
                .memory_limit
                .map(|l| (l, format!("over the limit of {} (--memory-limit)", gib(l)))),
        ];
        let tightest = limits.into_iter().flatten().min_by_key(|(bytes, _)| *bytes);
        match tightest {
            Some((cap, available)) if fit.needed > cap => Err(fit.too_large(available, Some(cap))),
            _ => Ok(fit),
        }
    }

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
    /// divide) whose plan `measure`s within `cap` (without a cap, half).
    fn advise(&self, available: String, cap: Option<u64>, measure: fn(&Plan) -> u64) -> Error {
        let batch = self.gpt.config.batch_size;
        let ranks = self.group.size();
        let mut smaller = Vec::new();
        let mut b = batch / 2;
        while b >= ranks && b.is_multiple_of(ranks) {
            if let Some(bytes) = self.plan_at(b / ranks).map(|p| measure(&p)) {
                smaller.push((b, bytes));
                if cap.is_none_or(|c| bytes <= c) {
                    break;
                }
            }
            b /= 2;
        }
        let advice = match smaller.last() {
            Some(&(b, bytes)) if cap.is_none_or(|c| bytes <= c) => {
                format!("a batch of {b} needs {}: try --batch {b}", gib(bytes))
            }
            Some(&(b, bytes)) => format!(
                "even a batch of {b} needs {}: use a smaller model or more devices",
                gib(bytes)
            ),
            None => "use a smaller model or more devices".into(),
        };
        Error::PlanTooLarge {
            device: self.gpt.backend.name(),
            batch,
            needed_bytes: self.needed,
            available,
            advice,
        }
    }

    /// The step plan of `sequences` per rank, built on the host.
    fn plan_at(&self, sequences: usize) -> Option<Plan> {
        (self.gpt)
            .plan(self.precision, sequences, self.gpt.config.block_size)
            .ok()
    }
}

/// The bytes of the largest tensor of `plan`.
fn largest_tensor(plan: &Plan) -> u64 {
    plan.tensors().iter().map(|t| t.bytes()).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::pick_token;
    use rand::SeedableRng;

    /// Sampling cannot panic on any logits: non-finite ones are refused with a count, and
    /// finite ones at any temperature give a token in range (`random_range(0.0..NaN)` panicked
    /// on the logits of weights that overflow).
    #[test]
    fn any_logits_give_a_token_or_an_error() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for bad in [
            vec![f32::INFINITY, 1.0],
            vec![f32::NAN, 0.0, 2.0],
            vec![f32::NEG_INFINITY, 0.0],
            vec![f32::INFINITY, f32::INFINITY],
            vec![],
        ] {
            for t in [0.0, 0.8] {
                let e = pick_token(&bad, t, &mut rng).unwrap_err();
                assert!(e.contains("inf or NaN"), "{bad:?}: {e}");
            }
        }
        let extreme = [3e38, -3e38, 3e38, f32::MIN_POSITIVE];
        for t in [0.0, 1e-45, 1e-30, 0.8, 1e30, f32::MAX] {
            for _ in 0..100 {
                let i = pick_token(&extreme, t, &mut rng).unwrap();
                assert!(i < extreme.len(), "{t}: {i}");
                if t < 1.0 {
                    assert!(i == 0 || i == 2, "{t}: the largest logits only, got {i}");
                }
            }
        }
        assert_eq!(pick_token(&[1.0, 5.0, 5.0], 0.0, &mut rng), Ok(1));
    }
}
