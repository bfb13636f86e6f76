//! The training loop: presets, master weights, dynamic loss scaling, AdamW, evaluation.

use super::data::Corpus;
use super::model::{Fp8Linear, Fp8Mode, Gpt, GptConfig, Pass, Precision};
use super::ops::{AdamW, round_to};
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
    /// The weights the optimizer updates: f32 master weights, or 16-bit in "true" presets.
    pub params: Vec<Vec<f32>>,
    pub adam_m: Vec<Vec<f32>>,
    pub adam_v: Vec<Vec<f32>>,
    /// Steps run (skipped ones included) and optimizer steps applied.
    pub step: u32,
    pub applied: u32,
    pub scaler: Option<LossScaler>,
    decays: Vec<bool>,
}

impl<'a> Trainer<'a> {
    pub fn new(
        backend: &'a dyn Backend,
        corpus: &'a Corpus,
        options: TrainOptions,
    ) -> Result<Trainer<'a>> {
        let spec = options.preset.spec();
        let precision = precision_for(backend, &spec, &options)?;
        let mut params = options.config.init(options.seed);
        let zeros: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        for p in params.iter_mut() {
            round_to(p, spec.params);
        }
        let decays = options.config.decays();
        Ok(Trainer {
            gpt: Gpt {
                config: options.config.clone(),
                backend,
            },
            corpus,
            scaler: spec.loss_scaling.map(LossScaler::new),
            spec,
            precision,
            params,
            adam_m: zeros.clone(),
            adam_v: zeros,
            step: 0,
            applied: 0,
            decays,
            options,
        })
    }

    fn tokens_per_step(&self) -> usize {
        self.gpt.config.batch_size * self.gpt.config.block_size
    }

    /// One training step.
    pub async fn step(&mut self) -> Result<StepRecord> {
        self.step_with(|_| {}).await
    }

    /// One training step, with `hook` applied to the (scaled) gradients before they are
    /// checked: tests inject inf through it.
    pub async fn step_with(&mut self, hook: impl FnOnce(&mut [Vec<f32>])) -> Result<StepRecord> {
        let start = Instant::now();
        let cfg = &self.gpt.config;
        let (ids, targets) = self.corpus.batch(
            false,
            cfg.batch_size,
            cfg.block_size,
            self.options.seed,
            self.step as u64,
        )?;
        let scale = self.scaler.map(|s| s.scale).unwrap_or(1.0);
        let out = self
            .gpt
            .run(
                &self.params,
                &ids,
                &targets,
                &mut self.precision,
                scale,
                Pass::Backward,
            )
            .await?;
        let (loss, mut grads) = (out.loss, out.grads.unwrap_or_default());
        hook(&mut grads);
        self.step += 1;
        // Unscale in f32 and check (one fused op per gradient tensor).
        let inverse = 1.0 / scale;
        let mut finite = true;
        for g in grads.iter_mut() {
            finite &= self.gpt.backend.unscale_check(g, inverse).await?;
        }
        let norm2: f64 = grads
            .iter()
            .flatten()
            .map(|&x| (x as f64) * (x as f64))
            .sum();
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
        let grad_norm = norm2.sqrt();
        if decision == StepDecision::Apply {
            let clip = self.options.grad_clip as f64;
            if clip > 0.0 && grad_norm > clip {
                let f = (clip / grad_norm) as f32;
                grads.iter_mut().flatten().for_each(|x| *x *= f);
            }
            self.applied += 1;
            let state = self
                .params
                .iter_mut()
                .zip(self.adam_m.iter_mut())
                .zip(self.adam_v.iter_mut());
            for (((p, m), v), (g, &decay)) in state.zip(grads.iter().zip(&self.decays)) {
                self.gpt
                    .backend
                    .adamw(&self.options.adamw, p, g, m, v, self.applied, decay)
                    .await?;
                // Without master weights the weights and the optimizer state live in 16-bit.
                for t in [p, m, v] {
                    round_to(t, self.spec.params);
                }
            }
        }
        let dt = start.elapsed().as_secs_f64();
        Ok(StepRecord {
            step: self.step,
            loss,
            skipped: decision == StepDecision::Skip,
            loss_scale: self.scaler.map(|s| s.scale),
            grad_norm,
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
        for _ in 0..count {
            let context = &ids[ids.len().saturating_sub(t)..];
            let out = self
                .gpt
                .run(
                    &self.params,
                    context,
                    context,
                    &mut self.precision,
                    1.0,
                    Pass::Logits,
                )
                .await?;
            let logits = out.logits.unwrap_or_default();
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
            total += self
                .gpt
                .run(
                    &self.params,
                    &ids,
                    &targets,
                    &mut self.precision,
                    1.0,
                    Pass::Loss,
                )
                .await?
                .loss;
        }
        Ok(total / batches.max(1) as f64)
    }
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
    })
}
