//! The GPT's training loop on a corpus: its options (presets, master weights, loss scaling,
//! AdamW), batches, evaluation and sampling, over the one step loop every built model has
//! (`model::ModelTrainer`).

use super::checkpoint::{Checkpoint, Expected, GptMeta};
use super::data::{Batches, Corpus};
use super::model::{Gpt, GptConfig};
use crate::algorithm::Algorithm;
use crate::backend::Backend;
use crate::choice::{Choice, Chooser};
use crate::dist::{self, Collective, Reduction, Single};
use crate::error::{Error, Result};
use crate::model::{ModelTrainer, Resize, RunOptions, TrainState};
use crate::plan::exec::{Memory, Timings};
use crate::plan::{AdamW, Plan, Section, StepExecutor};
use crate::policy::precision::PrecisionRequest;
use crate::policy::{PrecisionClass, Preset, PresetSpec};
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
    /// the backend prefers it (`Capabilities::fuses_attention`) until `Trainer::choose` times
    /// both. Both compute the same function; fused where the executor has no kernel for the
    /// heads (wgpu's hold at most 64 values) is an error when the plan is prepared.
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
    /// Gradient accumulation (`--grad-accum`): each rank runs its share of the batch in this
    /// many micro-batches, their gradients summed on the device before the one update
    /// (`RunOptions::micro_batches`); 1: the share whole. It must divide the share.
    pub grad_accum: usize,
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
            grad_accum: 1,
        }
    }
}

/// The sequences of each micro-batch of this rank's share of a batch of `batch` sequences
/// split into `micro` micro-batches (`TrainOptions::grad_accum`): refused where the ranks or
/// the micro-batches do not divide it.
pub fn micro_batch(batch: usize, group: &dyn Collective, micro: usize) -> Result<usize> {
    let share = dist::shard(batch, group.rank(), group.size())?.len();
    if micro == 0 || !share.is_multiple_of(micro) {
        return Err(Error::invalid(
            "gradient accumulation (--grad-accum)",
            format!(
                "{micro} micro-batches do not divide a share of {share} sequences (a batch of \
                 {batch} over {} rank(s)); take a divisor of {share}",
                group.size()
            ),
        ));
    }
    Ok(share / micro)
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

/// The GPT being trained under one preset on one backend, on batches of a corpus: the one step
/// loop (`ModelTrainer`, every built model's) on the GPT's model, with the corpus's batches,
/// evaluation and sampling.
pub struct Trainer<'a> {
    /// The model: its configuration and the backend it runs on.
    pub gpt: Gpt<'a>,
    /// The text the training and validation batches are drawn from (unless `use_batches` gives
    /// the training batches).
    pub corpus: &'a Corpus,
    /// The options the trainer was built with (its AdamW settings and clip are the caller's to
    /// change between steps).
    pub options: TrainOptions,
    /// What the preset means (`Preset::spec`).
    pub spec: PresetSpec,
    /// The step loop: the plan and its executor, the precision, the loss scaler, fp8 scaling,
    /// the steps run and applied, and the measured choices.
    pub run: ModelTrainer<'a>,
    /// Training batches given in a file (`use_batches`), taken in order instead of sampled.
    batches: Option<Batches>,
}

impl<'a> Trainer<'a> {
    /// Builds the step plan of `options` for `backend` and its executor (the backend's own, or
    /// the host interpreter where `options.resident` is false), with nanoGPT's initial weights.
    pub fn new(
        backend: &'a dyn Backend,
        corpus: &'a Corpus,
        options: TrainOptions,
    ) -> Result<Trainer<'a>> {
        Trainer::data_parallel(backend, corpus, options, &Single, Reduction::default())
    }

    /// A trainer that is rank `group.rank()` of `group.size()` of one run: its plan takes its
    /// slice of each global batch (`options.config.batch_size` sequences, which the ranks must
    /// divide), and each step sums the gradients over the ranks as `reduction` says
    /// (`RunOptions::group`).
    pub fn data_parallel(
        backend: &'a dyn Backend,
        corpus: &'a Corpus,
        options: TrainOptions,
        group: &'a dyn Collective,
        reduction: Reduction,
    ) -> Result<Trainer<'a>> {
        let cfg = &options.config;
        let micro = options.grad_accum;
        let sequences = micro_batch(cfg.batch_size, group, micro)?;
        let gpt = Gpt {
            config: cfg.clone(),
            backend,
        };
        let model = gpt.model(sequences, cfg.block_size)?;
        let resized = gpt.config.clone();
        let resize: Resize<'a> =
            Box::new(move |sequences| resized.model(sequences, resized.block_size));
        let run_options = RunOptions {
            seed: options.seed,
            fused_attention: options.fused_attention,
            coded_activations: options.coded_activations,
            graphs: options.graphs,
            resident: options.resident,
            memory_limit: options.memory_limit,
            group,
            reduction,
            resize: Some((cfg.batch_size, resize)),
            micro_batches: micro,
        };
        let mut run =
            ModelTrainer::with_options(backend, model, &options.precision_request(), run_options)?;
        run.adamw = options.adamw;
        run.grad_clip = options.grad_clip;
        run.check_settings()?;
        Ok(Trainer {
            gpt,
            corpus,
            spec: options.preset.spec(),
            options,
            run,
            batches: None,
        })
    }

    /// Starts from `params` (`GptConfig::parameter_shapes` order and layout, e.g. from
    /// `init::read_init`) instead of the seeded initial weights, held as the preset holds its
    /// weights (rounded to 16 bits in the "true" presets). Before the first step.
    pub async fn set_weights(&mut self, params: &[Vec<f32>]) -> Result<()> {
        self.run.set_params(params).await
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

    /// Allocates the step plan on the device and builds its kernels now rather than at the
    /// first step (`ModelTrainer::prepare`).
    pub async fn prepare(&mut self) -> Result<()> {
        self.run.prepare().await
    }

    /// The measured choices before the first step (`ModelTrainer::choose`), timed on this
    /// rank's slice of the first validation batch. Every rank calls this. Returns how attention
    /// was chosen (`run.graphs` says how the graphs were).
    pub async fn choose(&mut self, chooser: &Chooser) -> Result<&Choice> {
        let (ids, targets) = self.local_batch(true, 0)?;
        self.run.choose(chooser, &ids, &targets).await
    }

    /// Writes a checkpoint of the run to `path` (`Checkpoint::save`, with the GPT's
    /// configuration and the corpus's vocabulary).
    pub async fn save(&mut self, path: &std::path::Path) -> Result<()> {
        let gpt = GptMeta::of(&self.gpt.config, &self.corpus.vocab);
        Checkpoint::save(&mut self.run, Some(gpt), path).await
    }

    /// What a checkpoint this run resumes must be of (`Checkpoint::load`).
    pub fn expected(&self) -> Expected<'_> {
        Expected::gpt(&self.gpt.config, &self.corpus.vocab)
    }

    /// Steps run, skipped ones included.
    pub fn steps(&self) -> u32 {
        self.run.steps
    }

    /// Tokens of the global batch (every rank's).
    pub fn tokens_per_step(&self) -> usize {
        self.gpt.config.batch_size * self.gpt.config.block_size
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
        let group = self.run.group();
        let rows = dist::shard(cfg.batch_size, group.rank(), group.size())?;
        let span = rows.start * cfg.block_size..rows.end * cfg.block_size;
        Ok((ids[span.clone()].to_vec(), targets[span].to_vec()))
    }

    /// The step plan the trainer runs.
    pub fn plan(&self) -> &Plan {
        self.run.plan()
    }

    /// How the steps run ("device-resident on ..., one submission per step").
    pub fn executor(&self) -> String {
        self.run.executor()
    }

    /// The device launches of each op of the plan (`StepExecutor::launches`).
    pub fn launches(&self) -> Option<Vec<usize>> {
        self.run.launches()
    }

    /// Whether the step runs attention as one fused op (`plan::Op::Attention`).
    pub fn fused_attention(&self) -> bool {
        self.run.fused_attention()
    }

    /// How many tensors the plan stores as 16-bit codes (`Plan::store_codes`).
    pub fn coded_tensors(&self) -> usize {
        self.run.coded_tensors()
    }

    /// The memory the steps so far took (the plan's tensors, and the peak of everything).
    pub fn memory(&self) -> Memory {
        self.run.memory()
    }

    /// The weights and AdamW moments (read back from the device).
    pub async fn state(&mut self) -> Result<TrainState> {
        self.run.state().await
    }

    /// Replaces the weights and AdamW moments (`ModelTrainer::set_state`).
    pub async fn set_state(&mut self, state: &TrainState) -> Result<()> {
        self.run.set_state(state).await
    }

    /// The gradients of the last step (unscaled, before clipping), per parameter.
    pub async fn gradients(&mut self) -> Result<Vec<Vec<f32>>> {
        self.run.last_gradients().await
    }

    /// Delayed fp8 scaling's current scales per linear layer (empty without it).
    pub fn fp8_scales(&self) -> Vec<[f32; 3]> {
        self.run.fp8_scales()
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
        // The options are the caller's to change between steps: the step loop takes them now.
        self.run.adamw = self.options.adamw;
        self.run.grad_clip = self.options.grad_clip;
        let (ids, targets) = self.local_batch(false, self.run.steps as u64)?;
        self.gpt
            .check_batch(&ids, &targets, self.gpt.config.block_size)?;
        let (stepped, timings) = if timed {
            self.run.step_timed(&ids, &targets).await?
        } else {
            (self.run.step_injecting(&ids, &targets, poison).await?, None)
        };
        let dt = start.elapsed().as_secs_f64();
        let record = StepRecord {
            step: self.run.steps,
            loss: stepped.loss,
            skipped: stepped.skipped,
            loss_scale: self.run.scaler.map(|s| s.scale),
            grad_norm: stepped.grad_norm,
            dt_ms: dt * 1e3,
            tokens_per_s: self.tokens_per_step() as f64 / dt,
        };
        Ok((record, timings))
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
        let mut ids = self
            .corpus
            .encode(prompt)
            .map_err(|why| Error::invalid("prompt", why))?;
        if ids.is_empty() {
            ids.push(
                self.corpus
                    .encode("\n")
                    .ok()
                    .and_then(|n| n.first().copied())
                    .unwrap_or(0),
            );
        }
        // Drawn from the corpus's tokens, not the rows the head is padded with (gpt2).
        let tokens = self.corpus.vocab.len();
        // Bytes drawn that do not complete a character yet (a GPT-2 token may hold part of one).
        let mut pending = Vec::new();
        let start = ids.len();
        let (t, v) = (self.gpt.config.block_size, self.gpt.config.vocab_size);
        let params = self.run.params().await?;
        let fp8 = self.fp8_scales();
        // One executor per context length: once the context is full, every token reuses it.
        let mut exec: Option<(Box<dyn StepExecutor + '_>, Vec<f32>)> = None;
        for drawn in 0..count {
            let context = &ids[ids.len().saturating_sub(t)..];
            let (e, scalars) = match &mut exec {
                Some((e, s)) if e.plan().rows() == context.len() => (e, s),
                _ => {
                    let made = (self.gpt)
                        .executor(&self.run.precision, &fp8, &params, context, context)
                        .await?;
                    let (e, s) = exec.insert(made);
                    (e, s)
                }
            };
            e.run(Section::Forward, context, context, scalars).await?;
            let logits = e.read(e.plan().logits()).await?;
            let last = &logits[(context.len() - 1) * v..][..tokens.min(v)];
            let next = pick_token(last, temperature, &mut rng).map_err(|why| {
                Error::invalid(
                    "weights",
                    format!("sampling character {} of {count}: {why}", drawn + 1),
                )
            })?;
            ids.push(next as u32);
            pending.extend(self.corpus.decode_bytes(&ids[ids.len() - 1..]));
            let complete = match std::str::from_utf8(&pending) {
                Ok(_) => pending.len(),
                // Bytes that can never start a character are shown as U+FFFD now.
                Err(e) if e.error_len().is_some() => pending.len(),
                Err(e) => e.valid_up_to(),
            };
            if complete > 0 {
                each(&String::from_utf8_lossy(&pending[..complete]))?;
                pending.drain(..complete);
            }
        }
        Ok(self.corpus.decode(&ids[start..]))
    }

    /// The sum of this rank's losses over the first `batches` validation batches.
    async fn validation_losses(&mut self, batches: usize) -> Result<f64> {
        let mut total = 0.0;
        for i in 0..batches {
            let (ids, targets) = self.local_batch(true, i as u64)?;
            total += self.run.loss(&ids, &targets).await?;
        }
        Ok(total)
    }

    /// Mean validation loss over `batches` fixed batches (1 to `MAX_EVAL_BATCHES`), in
    /// evaluation mode (`ModelTrainer::training` off). A loss that is not finite stops the run:
    /// `Error::Diverged` at the step it follows (weights that overflowed in an update whose own
    /// loss was finite, as a huge learning rate makes them).
    pub async fn evaluate(&mut self, batches: usize) -> Result<f64> {
        if !(1..=MAX_EVAL_BATCHES).contains(&batches) {
            return Err(Error::invalid(
                "evaluation batches",
                format!("{batches}: between 1 and {MAX_EVAL_BATCHES}"),
            ));
        }
        // In evaluation mode (dropout off), the run's mode restored whatever happens.
        let training = std::mem::replace(&mut self.run.training, false);
        let summed = self.validation_losses(batches).await;
        self.run.training = training;
        let mut total = [summed?];
        // Each rank's loss is the mean over its slice: the batch's is the mean over the ranks.
        let group = self.run.group();
        group.sum_f64(&mut total)?;
        let loss = total[0] / (batches * group.size()) as f64;
        if !loss.is_finite() {
            let step = self.run.steps;
            return Err(Error::Diverged {
                preset: self.options.preset.to_string(),
                step,
                why: format!(
                    "validation loss {loss} after step {step}: the weights no longer give finite \
                     losses; try a smaller learning rate"
                ),
            });
        }
        Ok(loss)
    }
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
