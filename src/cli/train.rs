//! `mantissa train` and `mantissa sample`.

use super::parse_list;
use crate::algorithm::Algorithm;
use crate::backend::{self, BackendChoice};
use crate::error::{Error, Result};
use crate::plan::AdamW;
use crate::policy::{PrecisionClass, Preset};
use crate::train::{Checkpoint, Corpus, GptConfig, StepRecord, TrainOptions, Trainer};
use pollster::FutureExt as _;
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  mantissa train --config tiny --precision 32-true,16-mixed,bf16-mixed --steps 300\n  \
    mantissa train --config small --precision bf16-mixed --steps 2000 --backend wgpu --checkpoint-every 500\n  \
    mantissa train --config tiny --precision 16-mixed --steps 600 --resume runs/16-mixed.safetensors"
)]
pub struct TrainArgs {
    /// Model size: tiny (CI-sized) or small (nanoGPT shakespeare-char, 10.8M parameters).
    #[arg(long, default_value = "tiny")]
    config: String,
    /// Presets, comma-separated, run one after the other: 32-true, 16-mixed, bf16-mixed,
    /// 16-true, bf16-true, transformer-engine.
    #[arg(long, default_value = "32-true")]
    precision: String,
    /// Optimizer steps per preset (a resumed run continues up to this step).
    #[arg(long, default_value_t = 300)]
    steps: u32,
    /// auto, reference or wgpu.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// highest, high or medium: the f32 matmul precision class (32-true's matmuls).
    #[arg(long, default_value = "highest")]
    matmul_precision: String,
    /// Pin the algorithm of every matmul-like op (e.g. bf16x3), whatever the preset says.
    #[arg(long)]
    algorithm: Option<String>,
    /// fp8 scaling of transformer-engine: delayed (amax history) or current.
    #[arg(long, default_value = "delayed")]
    fp8_scaling: String,
    /// Autocast overrides, e.g. softmax=bf16,layer_norm=bf16.
    #[arg(long, default_value = "")]
    autocast_override: String,
    /// Steps between log lines with a validation loss.
    #[arg(long, default_value_t = 50)]
    eval_interval: u32,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 4)]
    eval_batches: usize,
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    #[arg(long, default_value_t = 1e-3)]
    lr: f32,
    /// The training text.
    #[arg(long, default_value = "data/shakespeare.txt")]
    corpus: PathBuf,
    /// Where the log (train.json), the loss chart (loss.svg) and checkpoints go.
    #[arg(long, default_value = "runs")]
    out: PathBuf,
    /// Save a checkpoint (OUT/PRESET.safetensors) every N steps and at the end; 0: only at the end.
    #[arg(long, default_value_t = 0)]
    checkpoint_every: u32,
    /// Resume from a checkpoint (one preset only).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// resident: the step plan lives on the device, one submission per step (where the
    /// backend has such an executor); host: the plan's ops one round trip at a time.
    #[arg(long, default_value = "resident")]
    executor: String,
}

#[derive(clap::Args)]
pub struct SampleArgs {
    /// A checkpoint written by `mantissa train`.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text to continue.
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Characters to generate.
    #[arg(long, default_value_t = 300)]
    tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    #[arg(long, default_value = "data/shakespeare.txt")]
    corpus: PathBuf,
    #[arg(long, default_value = "reference")]
    backend: String,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// One preset's run, as the JSON log holds it.
#[derive(serde::Serialize)]
struct Run {
    preset: String,
    backend: String,
    matmul_algorithm: String,
    config: GptConfig,
    parameters: usize,
    steps: Vec<StepRecord>,
    /// (step, validation loss)
    val: Vec<(u32, f64)>,
    stopped: Option<String>,
    /// The step at which it stopped (counting resumed steps).
    #[serde(skip_serializing_if = "Option::is_none")]
    stopped_at: Option<u32>,
    unigram_entropy: f64,
    /// How the steps ran, and the bytes the step plan's tensors take on the device.
    executor: String,
    device_bytes: u64,
}

/// Runs `mantissa train`; the exit code is `EXIT_STOPPED` when its one preset stopped.
pub fn train(args: TrainArgs) -> Result<i32> {
    // Arguments first, before anything is created.
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(Error::invalid(
            "--lr",
            format!("{} is not a finite positive learning rate", args.lr),
        ));
    }
    if args.eval_interval == 0 {
        return Err(Error::invalid("--eval-interval", "must be at least 1"));
    }
    let presets: Vec<Preset> = parse_list(&args.precision)?;
    if presets.is_empty() {
        return Err(Error::invalid("arguments", "--precision names no preset"));
    }
    if args.resume.is_some() && presets.len() != 1 {
        return Err(Error::invalid(
            "arguments",
            "--resume continues one preset; name exactly one in --precision",
        ));
    }
    let class: PrecisionClass = args.matmul_precision.parse()?;
    let algorithm: Option<Algorithm> = args.algorithm.as_deref().map(str::parse).transpose()?;
    let fp8_current = match args.fp8_scaling.as_str() {
        "delayed" => false,
        "current" => true,
        other => {
            return Err(Error::UnknownName {
                kind: "fp8 scaling",
                given: other.into(),
                valid: vec!["delayed".into(), "current".into()],
            });
        }
    };
    let resident = match args.executor.as_str() {
        "resident" => true,
        "host" => false,
        other => {
            return Err(Error::UnknownName {
                kind: "executor",
                given: other.into(),
                valid: vec!["resident".into(), "host".into()],
            });
        }
    };
    let corpus = Corpus::load(&args.corpus)?;
    let config = GptConfig::named(&args.config, corpus.vocab.len())?;
    corpus
        .check_context(config.block_size)
        .map_err(|e| Error::file(&args.corpus, e))?;
    let backend = backend::open(args.backend.parse::<BackendChoice>()?).block_on()?;
    std::fs::create_dir_all(&args.out).map_err(|e| Error::file(&args.out, e))?;
    // Validate the checkpoint before anything runs or is written.
    let resume = match &args.resume {
        Some(path) => Some(Checkpoint::load(path, &config, &corpus.vocab)?),
        None => None,
    };
    println!(
        "training {} ({} parameters, context {}, batch {}) on {}; unigram entropy {:.3}",
        config.name,
        config.parameter_count(),
        config.block_size,
        config.batch_size,
        backend.device_name(),
        corpus.unigram_entropy()
    );
    let mut runs = Vec::new();
    let mut resume = resume;
    for preset in presets {
        let options = TrainOptions {
            config: config.clone(),
            preset,
            matmul_precision: class,
            algorithm,
            fp8_current,
            autocast_overrides: args.autocast_override.clone(),
            seed: args.seed,
            adamw: AdamW {
                lr: args.lr,
                ..AdamW::default()
            },
            grad_clip: 1.0,
            resident,
        };
        let mut trainer = Trainer::new(backend.as_ref(), &corpus, options)?;
        if let Some(ck) = resume.take() {
            ck.restore(&mut trainer).block_on()?;
            println!("resumed {preset} at step {}", trainer.step);
        }
        println!(
            "-- {preset}: matmuls {} (compute {}), {}",
            trainer.precision.matmul,
            trainer.precision.compute,
            describe(&trainer)
        );
        println!("   {}", trainer.executor());
        let mut run = Run {
            preset: preset.to_string(),
            backend: backend.name(),
            matmul_algorithm: trainer.precision.matmul.to_string(),
            config: config.clone(),
            parameters: config.parameter_count(),
            steps: vec![],
            val: vec![],
            stopped: None,
            stopped_at: None,
            unigram_entropy: corpus.unigram_entropy(),
            executor: trainer.executor(),
            device_bytes: trainer.device_bytes(),
        };
        let bar = indicatif::ProgressBar::new(args.steps as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_position(trainer.step as u64);
        let checkpoint = args.out.join(format!("{preset}.safetensors"));
        while trainer.step < args.steps {
            let record = match trainer.step().block_on() {
                Ok(r) => r,
                // Divergence is the run's finding (kept in the log); any other error ends the tool.
                Err(e @ Error::Diverged { .. }) => {
                    bar.abandon();
                    println!("stopped: {e}");
                    if let Error::Diverged { step, why, .. } = &e {
                        run.stopped_at = Some(*step);
                        run.stopped = Some(why.clone());
                    }
                    break;
                }
                Err(e) => {
                    bar.abandon();
                    return Err(e);
                }
            };
            bar.set_position(record.step as u64);
            bar.set_message(format!("loss {:.4}", record.loss));
            let step = record.step;
            run.steps.push(record.clone());
            if step % args.eval_interval.max(1) == 0 || step == args.steps || step == 1 {
                let val = trainer.evaluate(args.eval_batches).block_on()?;
                run.val.push((step, val));
                bar.suspend(|| println!("{}", log_line(&record, val)));
            }
            if args.checkpoint_every > 0 && step % args.checkpoint_every == 0 {
                Checkpoint::save(&mut trainer, &checkpoint).block_on()?;
            }
        }
        bar.finish_and_clear();
        run.device_bytes = trainer.device_bytes();
        if run.device_bytes > 0 {
            println!(
                "   device memory of the step plan: {:.1} MiB",
                run.device_bytes as f64 / (1u64 << 20) as f64
            );
        }
        if run.stopped.is_none() {
            Checkpoint::save(&mut trainer, &checkpoint).block_on()?;
            println!("saved {}", checkpoint.display());
        }
        runs.push(run);
    }
    let summary: Vec<String> = runs
        .iter()
        .map(|r| match (r.stopped.as_ref(), r.val.last()) {
            (Some(why), _) => format!(
                "{}: stopped at step {} ({why})",
                r.preset,
                r.stopped_at.unwrap_or_default()
            ),
            (None, Some((s, v))) => format!("{}: val loss {v:.4} at step {s}", r.preset),
            (None, None) => format!("{}: no steps", r.preset),
        })
        .collect();
    println!("{}", summary.join("; "));
    let log = args.out.join("train.json");
    let json =
        serde_json::to_string_pretty(&runs).map_err(|e| Error::invalid("json", e.to_string()))?;
    crate::output::write_bytes(&log, json.as_bytes())?;
    let chart = args.out.join("loss.svg");
    let svg = crate::report::loss_chart(
        "training loss by precision preset (lines: train, dots: validation)",
        &runs
            .iter()
            .map(|r| crate::report::LossCurve {
                label: r.preset.clone(),
                losses: r.steps.iter().map(|s| (s.step, s.loss)).collect(),
                points: r.val.clone(),
            })
            .collect::<Vec<_>>(),
    )
    .map_err(|e| Error::invalid("chart", e))?;
    crate::output::write_bytes(&chart, svg.as_bytes())?;
    println!("wrote {} and {}", log.display(), chart.display());
    // One preset that stops is a failed run; when presets are compared, the comparison is the
    // result and its summary says which stopped.
    Ok(match runs.as_slice() {
        [one] if one.stopped.is_some() => super::EXIT_STOPPED,
        _ => 0,
    })
}

fn describe(t: &Trainer) -> String {
    let s = &t.spec;
    let mut parts = vec![format!("weights {}", s.params)];
    if s.master_weights {
        parts.push("f32 master weights".into());
    }
    if let Some(l) = &s.loss_scaling {
        parts.push(format!("loss scale {} (GradScaler)", l.init_scale));
    }
    if s.fp8.is_some() {
        parts.push(if t.options.fp8_current {
            "fp8 linears, current scaling".into()
        } else {
            "fp8 linears, delayed scaling".into()
        });
    }
    parts.join(", ")
}

/// nanoGPT-style: "step 100: loss 2.7370, val loss 2.7512, dt 95.20ms, 5.38k tok/s, scale 65536".
fn log_line(r: &StepRecord, val: f64) -> String {
    let mut line = format!(
        "step {:>5}: loss {:.4}, val loss {:.4}, dt {:.2}ms, {:.2}k tok/s",
        r.step,
        r.loss,
        val,
        r.dt_ms,
        r.tokens_per_s / 1e3
    );
    if let Some(s) = r.loss_scale {
        line.push_str(&format!(", scale {s}"));
    }
    if r.skipped {
        line.push_str(" (skipped: inf/NaN gradient)");
    }
    line
}

pub fn sample(args: SampleArgs) -> Result<()> {
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return Err(Error::invalid(
            "--temperature",
            format!("{} is not a finite temperature >= 0", args.temperature),
        ));
    }
    let corpus = Corpus::load(&args.corpus)?;
    let bytes = std::fs::read(&args.checkpoint).map_err(|e| Error::file(&args.checkpoint, e))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| {
        Error::file(
            &args.checkpoint,
            format!("not a usable checkpoint: corrupt or truncated ({e})"),
        )
    })?;
    let meta: crate::train::checkpoint::CheckpointMeta = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get("mantissa"))
        .and_then(|j| serde_json::from_str(j).ok())
        .ok_or_else(|| {
            Error::file(
                &args.checkpoint,
                "not a usable checkpoint: no mantissa metadata",
            )
        })?;
    let config = GptConfig::named(&meta.config, corpus.vocab.len())?;
    let ck = Checkpoint::load(&args.checkpoint, &config, &corpus.vocab)?;
    let preset: Preset = ck.meta.preset.parse()?;
    let backend = backend::open(args.backend.parse::<BackendChoice>()?).block_on()?;
    // Sampling needs no fp8 history: current scaling.
    let options = TrainOptions {
        fp8_current: true,
        ..TrainOptions::new(config, preset, meta.seed)
    };
    let mut trainer = Trainer::new(backend.as_ref(), &corpus, options)?;
    ck.restore(&mut trainer).block_on()?;
    let text = trainer
        .sample(&args.prompt, args.tokens, args.temperature, args.seed)
        .block_on()?;
    println!("{}{}", args.prompt, text);
    Ok(())
}
