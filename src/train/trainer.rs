//! The training loop: presets, master weights, dynamic loss scaling, AdamW, evaluation.

use super::data::Corpus;
use super::exec::{self, StepExecutor};
use super::model::{Fp8Linear, Fp8Mode, Gpt, GptConfig, Precision};
use super::ops::{AdamW, round_to};
use super::plan::{Plan, Section, Stats, scalar};
use crate::algorithm::Algorithm;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::format::Format;
use crate::policy::{
    Autocast, DelayedScaling, LossScaler, Op, PrecisionClass, Preset, PresetSpec, StepDecision,
};
use web_time::Instant;

/// What to train and how.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    pub config: GptConfig,
    pub preset: Preset,
    pub matmul_precision: PrecisionClass,
    /// Pins the algorithm of every matmul-like op (overrides preset and precision class).
    pub algorithm: Option<Algorithm>,
    /// fp8 with current scaling instead of delayed scaling (transformer-engine preset).
    pub fp8_current: bool,
    /// Autocast overrides, "op=format,..." (e.g. "softmax=bf16").
    pub autocast_overrides: String,
    pub seed: u64,
    pub adamw: AdamW,
    /// Clip the global gradient norm to this (nanoGPT: 1.0); 0 disables.
    pub grad_clip: f32,
    /// Run the step plan device-resident where the backend can (else the host interpreter,
    /// one round trip per op).
    pub resident: bool,
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
        }
    }
}

/// One optimizer step, as the log shows it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepRecord {
    pub step: u32,
    pub loss: f64,
    /// The step was skipped: a gradient held inf/NaN (weights and optimizer state untouched).
    pub skipped: bool,
    pub loss_scale: Option<f32>,
    pub grad_norm: f64,
    pub dt_ms: f64,
    pub tokens_per_s: f64,
}

/// A model being trained under one preset on one backend.
pub struct Trainer<'a> {
    pub gpt: Gpt<'a>,
    pub corpus: &'a Corpus,
    pub options: TrainOptions,
    pub spec: PresetSpec,
    pub precision: Precision,
    /// Steps run (skipped ones included) and optimizer steps applied.
    pub step: u32,
    pub applied: u32,
    pub scaler: Option<LossScaler>,
    /// Runs the step plan and holds the weights (f32 master weights, or 16-bit in "true"
    /// presets) and the AdamW moments.
    exec: Box<dyn StepExecutor + 'a>,
}

/// Weights and AdamW moments, per parameter (`GptConfig::parameter_shapes` order).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainState {
    pub params: Vec<Vec<f32>>,
    pub adam_m: Vec<Vec<f32>>,
    pub adam_v: Vec<Vec<f32>>,
}

impl<'a> Trainer<'a> {
    /// Builds the step plan of `options` and its executor on `backend` (device-resident where
    /// the backend has one and `options.resident`), with nanoGPT's initial weights.
    pub fn new(
        backend: &'a dyn Backend,
        corpus: &'a Corpus,
        options: TrainOptions,
    ) -> Result<Trainer<'a>> {
        let spec = options.preset.spec();
        let precision = precision_for(backend, &spec, &options)?;
        let gpt = Gpt {
            config: options.config.clone(),
            backend,
        };
        let cfg = &options.config;
        let mut plan = gpt.plan(&precision, cfg.batch_size, cfg.block_size)?;
        for (i, mut p) in cfg.init(options.seed).into_iter().enumerate() {
            round_to(&mut p, spec.params);
            plan.constants.push((plan.state[i][0], p));
        }
        let exec = exec::executor(backend, plan, options.resident)?;
        Ok(Trainer {
            gpt,
            corpus,
            scaler: spec.loss_scaling.map(LossScaler::new),
            spec,
            precision,
            step: 0,
            applied: 0,
            exec,
            options,
        })
    }

    fn tokens_per_step(&self) -> usize {
        self.gpt.config.batch_size * self.gpt.config.block_size
    }

    /// How the steps run ("device-resident on ..., one submission per step").
    pub fn executor(&self) -> String {
        self.exec.describe()
    }

    /// Bytes of the step plan's tensors on the device (0 where the host holds them).
    pub fn device_bytes(&self) -> u64 {
        self.exec.device_bytes()
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

    /// One training step.
    pub async fn step(&mut self) -> Result<StepRecord> {
        self.step_injecting(0.0).await
    }

    /// One training step with `poison` added to the first element of the first (scaled)
    /// gradient before the check: tests inject inf and NaN faults through it.
    pub async fn step_injecting(&mut self, poison: f32) -> Result<StepRecord> {
        let start = Instant::now();
        let cfg = &self.gpt.config;
        let (ids, targets) = self.corpus.batch(
            false,
            cfg.batch_size,
            cfg.block_size,
            self.options.seed,
            self.step as u64,
        )?;
        self.gpt.check_batch(&ids, &targets, cfg.block_size)?;
        let scale = self.scaler.map(|s| s.scale).unwrap_or(1.0);
        let scalars = step_scalars(
            self.exec.plan(),
            &self.precision,
            &self.options.adamw,
            self.options.grad_clip,
            (scale, poison, self.applied + 1),
        );
        let stats = self
            .exec
            .run(Section::Step, &ids, &targets, &scalars)
            .await?;
        let layout = self.exec.plan().stats;
        let loss = stats[Stats::LOSS];
        self.step += 1;
        // Delayed scaling: this step's amaxes enter the histories; the next step's scales follow.
        if let Some(Fp8Mode::Delayed(states)) = &mut self.precision.fp8 {
            for (l, st) in states.iter_mut().enumerate() {
                st.input.record(stats[layout.amax(l, 0)] as f32);
                st.weight.record(stats[layout.amax(l, 1)] as f32);
                st.grad.record(stats[layout.amax(l, 2)] as f32);
            }
        }
        // The executor applied AdamW exactly where every gradient was finite.
        let finite = exec::update_factor(&layout, &stats, 0.0).is_some();
        let decision = match self.scaler.as_mut() {
            Some(s) => s.update(finite),
            None if !finite || !loss.is_finite() => {
                return Err(Error::invalid(
                    "training",
                    format!(
                        "{} at step {} under {} (no loss scaling): try bf16-mixed, or 16-mixed, which scales the loss",
                        if loss.is_finite() {
                            "non-finite gradients"
                        } else {
                            "NaN loss"
                        },
                        self.step,
                        self.options.preset
                    ),
                ));
            }
            None => StepDecision::Apply,
        };
        if decision == StepDecision::Apply {
            self.applied += 1;
        }
        let dt = start.elapsed().as_secs_f64();
        Ok(StepRecord {
            step: self.step,
            loss,
            skipped: decision == StepDecision::Skip,
            loss_scale: self.scaler.map(|s| s.scale),
            grad_norm: exec::grad_norm(&layout, &stats),
            dt_ms: dt * 1e3,
            tokens_per_s: self.tokens_per_step() as f64 / dt,
        })
    }

    /// Generates `count` characters after `prompt` (sampling at `temperature`; 0 is greedy).
    pub async fn sample(
        &mut self,
        prompt: &str,
        count: usize,
        temperature: f32,
        seed: u64,
    ) -> Result<String> {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let vocab = &self.corpus.vocab;
        let mut ids: Vec<u32> = prompt
            .chars()
            .filter_map(|ch| vocab.binary_search(&ch).ok().map(|i| i as u32))
            .collect();
        if ids.is_empty() {
            ids.push(vocab.binary_search(&'\n').unwrap_or(0) as u32);
        }
        let start = ids.len();
        let (t, v) = (self.gpt.config.block_size, self.gpt.config.vocab_size);
        let params = self.state().await?.params;
        for _ in 0..count {
            let context = &ids[ids.len().saturating_sub(t)..];
            let logits = self.gpt.logits(&self.precision, &params, context).await?;
            let last = &logits[(context.len() - 1) * v..context.len() * v];
            let next = if temperature <= 0.0 {
                last.iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(i, _)| i)
                    .unwrap_or(0)
            } else {
                let max = last.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let weights: Vec<f64> = last
                    .iter()
                    .map(|&l| (((l - max) / temperature) as f64).exp())
                    .collect();
                let mut pick = rng.random_range(0.0..weights.iter().sum::<f64>());
                weights
                    .iter()
                    .position(|&w| {
                        pick -= w;
                        pick <= 0.0
                    })
                    .unwrap_or(v - 1)
            };
            ids.push(next as u32);
        }
        Ok(self.corpus.decode(&ids[start..]))
    }

    /// Mean validation loss over `batches` fixed batches.
    pub async fn evaluate(&mut self, batches: usize) -> Result<f64> {
        let cfg = self.gpt.config.clone();
        let mut total = 0.0;
        for i in 0..batches.max(1) {
            let (ids, targets) = self.corpus.batch(
                true,
                cfg.batch_size,
                cfg.block_size,
                self.options.seed,
                i as u64,
            )?;
            let scalars = step_scalars(
                self.exec.plan(),
                &self.precision,
                &self.options.adamw,
                self.options.grad_clip,
                (1.0, 0.0, self.applied + 1),
            );
            let stats = self
                .exec
                .run(Section::Forward, &ids, &targets, &scalars)
                .await?;
            total += stats[Stats::LOSS];
        }
        Ok(total / batches.max(1) as f64)
    }
}

/// The scalars of a step of `plan`: AdamW's hyper-parameters and bias corrections at step t,
/// the clip, the loss scale (and its inverse), `poison` for the first gradient element, and the
/// fp8 scales of delayed scaling.
pub(crate) fn step_scalars(
    plan: &Plan,
    precision: &Precision,
    o: &AdamW,
    clip: f32,
    (loss_scale, poison, t): (f32, f32, u32),
) -> Vec<f32> {
    let mut s = vec![0.0; plan.scalar_count()];
    s[scalar::DLOSS_PER_ROW] = (loss_scale as f64 / plan.rows as f64) as f32;
    s[scalar::INVERSE_SCALE] = 1.0 / loss_scale;
    s[scalar::POISON] = poison;
    for (slot, v) in scalar::adamw(o, t) {
        s[slot] = v;
    }
    s[scalar::CLIP] = clip;
    s[scalar::STEP] = t as f32;
    s[scalar::LOSS_SCALE] = loss_scale;
    if let Some(Fp8Mode::Delayed(states)) = &precision.fp8 {
        for (l, st) in states.iter().enumerate() {
            let at = scalar::FP8 + 3 * l;
            s[at..at + 3].copy_from_slice(&[st.input.scale, st.weight.scale, st.grad.scale]);
        }
    }
    s
}

/// The formats of each op under a preset, the matmul precision class and the overrides.
fn precision_for(backend: &dyn Backend, spec: &PresetSpec, o: &TrainOptions) -> Result<Precision> {
    let stream = if spec.master_weights || spec.compute == Format::F32 {
        Format::F32
    } else {
        spec.params
    };
    let autocast = Autocast::new(spec.compute).with_overrides(&o.autocast_overrides)?;
    let compute = autocast.format_for(Op::Linear, stream);
    let matmul = match (o.algorithm, compute) {
        (Some(a), _) => a,
        (None, Format::F32) => backend.resolve(o.matmul_precision),
        (None, Format::Bf16) => Algorithm::Bf16,
        (None, Format::F16) => Algorithm::F16,
        (None, other) => {
            return Err(Error::invalid(
                "autocast",
                format!("matmul-like ops cannot compute in {other}; use f32, bf16 or f16"),
            ));
        }
    };
    let fp8 = match spec.fp8 {
        None => None,
        Some(_) if o.fp8_current => Some(Fp8Mode::Current),
        Some(recipe) => {
            let formats = recipe.formats();
            let states = (0..4 * o.config.n_layer)
                .map(|_| {
                    Ok(Fp8Linear {
                        input: DelayedScaling::new(formats.forward(), &recipe)?,
                        weight: DelayedScaling::new(formats.forward(), &recipe)?,
                        grad: DelayedScaling::new(formats.backward(), &recipe)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Some(Fp8Mode::Delayed(states))
        }
    };
    Ok(Precision {
        matmul,
        compute,
        stream,
        softmax: autocast.format_for(Op::Softmax, stream),
        layer_norm: autocast.format_for(Op::LayerNorm, stream),
        fp8,
        weights: spec.params,
    })
}
