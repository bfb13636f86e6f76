//! `mantissa train` and `mantissa sample`.

use super::parse_list;
use crate::algorithm::Algorithm;
use crate::backend::{self, BackendChoice};
use crate::dist::{self, Collective, Reduction};
use crate::error::{Error, Result};
use crate::plan::AdamW;
use crate::plan::exec::{Memory, Reduced};
use crate::policy::{PrecisionClass, Preset};
use crate::train::checkpoint::{CheckpointFile, Expected};
use crate::train::trainer::{MAX_EVAL_BATCHES, MAX_SAMPLE_TOKENS, micro_batch};
use crate::train::{
    Batches, Checkpoint, Choice, Chooser, Corpus, GptConfig, StepRecord, TrainOptions, Trainer,
    attention_choice, graphs_choice, init,
};
use pollster::FutureExt as _;
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  mantissa train --config tiny --precision 32-true,16-mixed,bf16-mixed --steps 300\n  \
    mantissa train --config small --precision bf16-mixed --steps 2000 --backend wgpu --checkpoint-every 500\n  \
    mantissa train --config tiny --precision 16-mixed --steps 600 --resume runs/16-mixed.safetensors\n  \
    mantissa train --precision bf16-mixed --init tests/data/parity_tiny_init.safetensors --batches tests/data/parity_tiny_batches.npy\n  \
    mantissa train --config tiny --seed 1 --export-init init.safetensors   (our initial weights, PyTorch's names)\n  \
    mpirun -np 2 mantissa train --config small --precision bf16-mixed   (data parallel; build with --features mpi)"
)]
pub struct TrainArgs {
    /// Model size: tiny (CI-sized) or small (nanoGPT shakespeare-char, 10.8M parameters) on the
    /// corpus's characters; gpt2 (GPT-2 124M, context 1024) on GPT-2's byte-level BPE.
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
    /// Autocast overrides, e.g. softmax=bf16,layer_norm=bf16: of linear (every matmul-like op
    /// follows it) and of the f32 class's ops that hold an output.
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
    /// AdamW's epsilon (PyTorch's default 1e-8; 16-bit "true" presets often need 1e-4 or more,
    /// since their second moments underflow).
    #[arg(long, default_value_t = 1e-8)]
    adam_eps: f32,
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
    /// Start from these weights instead of the seeded ones: a safetensors file under the names
    /// of the engine's checkpoints (param.wte, ...; their moments are left aside) or the
    /// state_dict names of scripts/anchors/torch_gpt.py (tok.weight, blocks.0.qkv.weight, ...),
    /// f32 or f64 (docs/training.md).
    #[arg(long)]
    init: Option<PathBuf>,
    /// Train on these batches in order instead of sampled ones: a .npy integer array
    /// [steps, B, T+1] of token ids (x = the first T of a row, y = the last T).
    #[arg(long)]
    batches: Option<PathBuf>,
    /// Write the initial weights (seeded by --seed, or --init's) to this file under PyTorch's
    /// state_dict names and layouts, and stop: nothing is trained.
    #[arg(long)]
    export_init: Option<PathBuf>,
    /// resident: the backend's own executor (on a GPU the step plan lives on the device, one
    /// submission per step); host: the host interpreter runs the same plan with the reference's
    /// numbers (a cross-check of the backend's).
    #[arg(long, default_value = "resident")]
    executor: String,
    /// Under mpirun: how the ranks sum their gradients. auto: NCCL on device buffers where the
    /// backend is CUDA with one GPU per rank, else MPI on host buffers; mpi; nccl. Named (mpi,
    /// nccl), it also runs on one rank, as a check of the engine.
    #[arg(long, default_value = "auto")]
    reducer: String,
    /// Under mpirun: gradients summed per collective call, e.g. 16MiB (the default) or 512KiB.
    #[arg(long, default_value = "16MiB")]
    bucket_size: String,
    /// Under mpirun: on: where the executor can (the resident plans of wgpu and CUDA), each
    /// bucket is summed as soon as the backward pass is done with it, while the device runs the
    /// rest of the pass; off: after the whole pass. The sums are the same bits.
    #[arg(long, default_value = "on")]
    overlap_reduction: String,
    /// Sequences per step instead of the config's (tiny 16, small 64, gpt2 8); the ranks must
    /// divide it.
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence instead of the config's (tiny 32, small 256, gpt2 1024): the context,
    /// and the rows of the position embedding.
    #[arg(long)]
    context: Option<usize>,
    /// Gradient accumulation: each rank runs its share of the batch in N micro-batches, their
    /// gradients summed on the device before the one update (the batch's step, in the memory of
    /// a micro-batch); N must divide the share.
    #[arg(long, default_value_t = 1, value_name = "N")]
    grad_accum: usize,
    /// The most device memory the step plan may take, e.g. 12GiB or 500MiB (on CUDA it is also
    /// refused beyond what the device has free); a plan over it stops before allocating and
    /// names a batch that fits.
    #[arg(long)]
    memory_limit: Option<String>,
    /// auto: causal attention as one fused op or as separate ops (copies, matmuls, softmax),
    /// whichever runs the step faster here: both timed on the device before the first step and
    /// the choice cached (MANTISSA_AUTOTUNE=off: fused where the backend prefers it, CUDA);
    /// fused or unfused to choose (the same function either way).
    #[arg(long, default_value = "auto")]
    attention: String,
    /// auto: where the executor records (CUDA, the host interpreter), the step launched op by
    /// op and replayed from a recording are both timed before the first step and the faster
    /// kept (cached; MANTISSA_AUTOTUNE=off: the executor's default, CUDA's
    /// MANTISSA_CUDA_GRAPH); on: each section of the step recorded at its second run and
    /// replayed from then on (a CUDA graph; the host interpreter's model of one); off: launched
    /// op by op. wgpu records nothing and refuses on.
    #[arg(long, default_value = "auto")]
    graphs: String,
    /// The flags given on the command line (clap's ids), filled by `cli::main`: a mode refuses
    /// those it does not use (`--export-init` trains nothing).
    #[arg(skip)]
    pub(super) given: Vec<String>,
}

#[derive(clap::Args)]
pub struct SampleArgs {
    /// A checkpoint written by `mantissa train`.
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text to continue.
    #[arg(long, default_value = "\n")]
    prompt: String,
    /// Tokens to generate (characters, or GPT-2 tokens for gpt2).
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
    /// Ranks of a data-parallel run (1 alone), and how the gradients were summed.
    ranks: usize,
    /// Micro-batches a rank's share of each step ran in (gradient accumulation; 1: whole).
    grad_accum: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    reduction: Option<Reduced>,
    unigram_entropy: f64,
    /// How the steps ran, and the memory they took (rank 0's, in a data-parallel run).
    executor: String,
    memory: Memory,
    /// How attention came to be fused or not, with the times of both where they were timed.
    attention: Choice,
    /// How the step came to be recorded and replayed or not (the same).
    graphs: Choice,
}

/// `MANTISSA_INJECT_INF=STEP[@RANK]`: an inf added to the first gradient at that step (on that
/// rank only, or on every rank), to test that loss scaling skips it on every rank alike.
pub const INJECT_ENV: &str = "MANTISSA_INJECT_INF";

fn injected(rank: usize) -> Result<Option<u32>> {
    let Ok(spec) = std::env::var(INJECT_ENV) else {
        return Ok(None);
    };
    let bad = || {
        Error::invalid(
            "MANTISSA_INJECT_INF",
            format!("'{spec}' is not STEP or STEP@RANK"),
        )
    };
    let (step, on) = match spec.split_once('@') {
        Some((s, r)) => (s, Some(r.trim().parse::<usize>().map_err(|_| bad())?)),
        None => (spec.as_str(), None),
    };
    let step: u32 = step.trim().parse().map_err(|_| bad())?;
    Ok(on.is_none_or(|r| r == rank).then_some(step))
}

/// Runs `mantissa train`; the exit code is `EXIT_STOPPED` when its one preset stopped.
///
/// Started by mpirun, every rank runs this: rank 0 alone prints and writes files. A failure
/// before the first step is agreed between the ranks (each exits with the failing rank's
/// message, rank 0 printing it); a failure during the steps ends every rank through the
/// engine's abort.
pub fn train(args: TrainArgs) -> Result<i32> {
    if let Some(path) = &args.export_init {
        return export_init(&args, path);
    }
    let world = dist::world()?;
    let group = world.as_ref();
    let result = train_ranks(args, group);
    if group.size() <= 1 {
        return result;
    }
    let code = match &result {
        Ok(code) => *code,
        Err(e) => {
            if group.rank() == 0 {
                eprintln!("mantissa: error: {e}");
            }
            super::exit_code(e)
        }
    };
    // No rank leaves before rank 0 has printed and written: a launcher ends the whole job
    // when any rank exits with a non-zero code.
    group.barrier()?;
    Ok(code)
}

/// A failure during the steps, this rank's alone: on a data-parallel rank it is printed with
/// the rank and every rank is ended; alone, it is returned.
fn abort_ranks(group: &dyn Collective, e: Error) -> Error {
    if group.size() > 1 {
        eprintln!("mantissa: error: rank {}: {e}", group.rank());
        group.abort(super::exit_code(&e));
    }
    e
}

fn train_ranks(args: TrainArgs, group: &dyn Collective) -> Result<i32> {
    let setup = prepare(&args, group)?;
    // A preset that diverges is kept in its run (every rank sees the same stats), not returned.
    match run_presets(&args, group, setup) {
        Ok(runs) if group.rank() == 0 => write_logs(&args, &runs),
        Ok(runs) => Ok(exit_of(&runs)),
        Err(e) => Err(abort_ranks(group, e)),
    }
}

/// What the arguments ask for, checked, and what was opened for it.
struct Setup {
    presets: Vec<Preset>,
    class: PrecisionClass,
    algorithm: Option<Algorithm>,
    fp8_current: bool,
    resident: bool,
    reduction: Reduction,
    /// The step whose first gradient gets an inf on this rank (`MANTISSA_INJECT_INF`).
    inject: Option<u32>,
    corpus: Corpus,
    config: GptConfig,
    backend: Box<dyn backend::Backend>,
    resume: Option<Checkpoint>,
    /// Initial weights (`--init`) and batches (`--batches`) read from files.
    init: Option<Vec<Vec<f32>>>,
    batches: Option<Batches>,
    memory_limit: Option<u64>,
    fused_attention: Option<bool>,
    graphs: Option<bool>,
}

/// Everything before the first step, on every rank, in phases the ranks agree on (so that a
/// rank that fails makes all of them stop with its message): the arguments, the corpus and
/// this rank's device; the checkpoint (read by rank 0, sent to the others, checked by each);
/// the output directory (rank 0).
fn prepare(args: &TrainArgs, group: &dyn Collective) -> Result<Setup> {
    let setup = dist::agree(group, check_and_open(args, group))?;
    let resume = match &args.resume {
        Some(path) => {
            // Header first: the tensors are read once their size is this model's.
            let read = match group.rank() {
                0 => CheckpointFile::open(path)
                    .and_then(|file| file.read(&Expected::gpt(&setup.config, &setup.corpus.vocab))),
                _ => Ok(vec![]),
            };
            let mut bytes = dist::agree(group, read)?;
            group.broadcast(&mut bytes, 0)?;
            let ck = Checkpoint::from_bytes(
                &bytes,
                path,
                &Expected::gpt(&setup.config, &setup.corpus.vocab),
            );
            Some(dist::agree(group, ck)?)
        }
        None => None,
    };
    // Every file the run will write is checked writable before the first step.
    let out = match group.rank() {
        0 => std::fs::create_dir_all(&args.out)
            .map_err(|e| Error::output(&args.out, e))
            .and_then(|()| {
                let logs = ["train.json", "loss.svg"].map(|name| args.out.join(name));
                let checkpoints = setup.presets.iter().map(|p| checkpoint_path(args, *p));
                logs.into_iter()
                    .chain(checkpoints)
                    .try_for_each(|path| crate::output::check_writable(&path))
            }),
        _ => Ok(()),
    };
    dist::agree(group, out)?;
    Ok(Setup { resume, ..setup })
}

/// The arguments (before anything is created), the corpus, and this rank's device.
fn check_and_open(args: &TrainArgs, group: &dyn Collective) -> Result<Setup> {
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(Error::invalid(
            "--lr",
            format!("{} is not a finite positive learning rate", args.lr),
        ));
    }
    if !(args.adam_eps.is_finite() && args.adam_eps > 0.0) {
        return Err(Error::invalid(
            "--adam-eps",
            format!("{} is not a finite positive epsilon", args.adam_eps),
        ));
    }
    if args.eval_interval == 0 {
        return Err(Error::invalid("--eval-interval", "must be at least 1"));
    }
    if !(1..=MAX_EVAL_BATCHES).contains(&args.eval_batches) {
        return Err(Error::invalid(
            "--eval-batches",
            format!(
                "{} batches: between 1 and {MAX_EVAL_BATCHES}",
                args.eval_batches
            ),
        ));
    }
    let presets: Vec<Preset> = parse_list("--precision", &args.precision)?;
    if args.resume.as_deref().is_some_and(|r| r.as_os_str() == "-")
        && args.corpus.as_os_str() == "-"
    {
        return Err(Error::invalid(
            "arguments",
            "--resume and --corpus cannot both be standard input",
        ));
    }
    if args.resume.is_some() && args.init.is_some() {
        return Err(Error::invalid(
            "arguments",
            "--init starts a run from given weights, --resume continues one; name one of them",
        ));
    }
    if args.resume.is_some() && presets.len() != 1 {
        return Err(Error::invalid(
            "arguments",
            "--resume continues one preset; name exactly one in --precision",
        ));
    }
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
    let class: PrecisionClass = args.matmul_precision.parse()?;
    // Checked here, before anything is opened (the trainer applies them).
    let vocabulary = crate::model::vocabulary();
    crate::policy::Autocast::new(
        crate::format::Format::F32,
        &args.autocast_override,
        &vocabulary,
    )?;
    let algorithm: Option<Algorithm> = args.algorithm.as_deref().map(str::parse).transpose()?;
    let reduction = Reduction {
        reducer: args.reducer.parse()?,
        bucket_bytes: parse_bytes("--bucket-size", &args.bucket_size)?,
        overlap: match args.overlap_reduction.trim() {
            "on" => true,
            "off" => false,
            other => {
                return Err(Error::UnknownName {
                    kind: "--overlap-reduction setting",
                    given: other.into(),
                    valid: vec!["on".into(), "off".into()],
                });
            }
        },
    };
    let inject = injected(group.rank())?;
    let choice: BackendChoice = args.backend.parse()?;
    let (corpus, config) =
        corpus_and_config(&args.corpus, &args.config, (args.context, args.batch))?;
    let memory_limit = args
        .memory_limit
        .as_deref()
        .map(|m| parse_bytes("--memory-limit", m))
        .transpose()?;
    let fused_attention = attention_choice(&args.attention)?;
    let graphs = graphs_choice(&args.graphs)?;
    corpus
        .check_context(config.block_size)
        .map_err(|e| Error::file(&args.corpus, e))?;
    let init = args
        .init
        .as_deref()
        .map(|path| init::read_init(path, &config, &corpus.vocab))
        .transpose()?;
    let batches = args
        .batches
        .as_deref()
        .map(|path| {
            let (b, t, v) = (config.batch_size, config.block_size, corpus.vocab.len());
            Batches::load(path, b, t, v, args.steps)
        })
        .transpose()?;
    micro_batch(config.batch_size, group, args.grad_accum)?;
    let backend = backend::open_device(choice, group.local_rank()).block_on()?;
    Ok(Setup {
        presets,
        class,
        algorithm,
        fp8_current,
        resident,
        reduction,
        inject,
        corpus,
        config,
        backend,
        resume: None,
        init,
        batches,
        memory_limit,
        fused_attention,
        graphs,
    })
}

/// The largest `--batch`: far beyond any device's memory for `small`, and small enough that no
/// size computed from it overflows.
const MAX_BATCH: usize = 1 << 20;

/// The largest `--context`: 64 Ki tokens.
const MAX_CONTEXT: usize = 1 << 16;

/// The corpus at `path`, tokenized as config `name` trains on it, and the config with
/// `context` and `batch` (`--context`, `--batch`: each checked to be in range) in place of
/// its own.
pub(super) fn corpus_and_config(
    path: &std::path::Path,
    name: &str,
    (context, batch): (Option<usize>, Option<usize>),
) -> Result<(Corpus, GptConfig)> {
    let corpus = Corpus::load_as(path, GptConfig::tokenizer(name))?;
    let mut config = GptConfig::named(name, corpus.vocab.len())?;
    for (flag, given, max, what, field) in [
        (
            "--context",
            context,
            MAX_CONTEXT,
            "tokens",
            &mut config.block_size,
        ),
        (
            "--batch",
            batch,
            MAX_BATCH,
            "sequences",
            &mut config.batch_size,
        ),
    ] {
        if let Some(n) = given {
            if !(1..=max).contains(&n) {
                return Err(Error::invalid(
                    flag,
                    format!("{n} {what}: between 1 and {max}"),
                ));
            }
            *field = n;
        }
    }
    Ok((corpus, config))
}

/// "12GiB", "500 MiB", "2.5GB", "1000000": bytes (binary units KiB..TiB, decimal KB..TB).
fn parse_bytes(flag: &'static str, text: &str) -> Result<u64> {
    let bad = || {
        Error::invalid(
            flag,
            format!("'{text}' is not a size such as 12GiB, 500MiB or 2000000000"),
        )
    };
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = (&t[..split], t[split..].trim());
    let value: f64 = number.parse().map_err(|_| bad())?;
    let scale = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024f64,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(bad()),
    };
    let bytes = value * scale;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(bad());
    }
    Ok(bytes as u64)
}

/// Trains each preset in turn; rank 0 prints and writes checkpoints.
fn run_presets(args: &TrainArgs, group: &dyn Collective, setup: Setup) -> Result<Vec<Run>> {
    let leader = group.rank() == 0;
    // Rank 0 prints; standard output that cannot be written ends the run (exit 1).
    let tell = |line: String| if leader { say!("{line}") } else { Ok(()) };
    let (corpus, config, backend) = (&setup.corpus, &setup.config, setup.backend.as_ref());
    tell(format!(
        "training {} ({} parameters, context {}, batch {}) on {}; unigram entropy {:.3}",
        config.name,
        config.parameter_count(),
        config.block_size,
        config.batch_size,
        backend.device_name(),
        corpus.unigram_entropy()
    ))?;
    for (what, path) in [("initial weights", &args.init), ("batches", &args.batches)] {
        if let Some(path) = path {
            tell(format!("{what} from {}", path.display()))?;
        }
    }
    if group.size() > 1 {
        tell(format!(
            "data parallel: {} ranks ({}), {} sequences of the batch each; rank 0 on {}",
            group.size(),
            group.engine(),
            config.batch_size / group.size(),
            backend.name()
        ))?;
    }
    if args.grad_accum > 1 {
        tell(format!(
            "gradient accumulation: {} micro-batches of {} sequences a step on each rank",
            args.grad_accum,
            config.batch_size / group.size() / args.grad_accum
        ))?;
    }
    let chooser = Chooser::from_env()?;
    let mut runs = Vec::new();
    let mut resume = setup.resume;
    for &preset in &setup.presets {
        let options = TrainOptions {
            config: config.clone(),
            preset,
            matmul_precision: setup.class,
            algorithm: setup.algorithm,
            fp8_current: setup.fp8_current,
            autocast_overrides: args.autocast_override.clone(),
            seed: args.seed,
            adamw: AdamW {
                lr: args.lr,
                eps: args.adam_eps,
                ..AdamW::default()
            },
            grad_clip: 1.0,
            resident: setup.resident,
            memory_limit: setup.memory_limit,
            fused_attention: setup.fused_attention,
            coded_activations: None,
            graphs: setup.graphs,
            grad_accum: args.grad_accum,
        };
        // Every rank builds its plan (its device may run out of memory): agreed.
        let built = Trainer::data_parallel(backend, corpus, options, group, setup.reduction)
            .and_then(|mut t| {
                t.prepare().block_on()?;
                if let Some(weights) = &setup.init {
                    t.set_weights(weights).block_on()?;
                }
                if let Some(batches) = &setup.batches {
                    t.use_batches(batches.clone())?;
                }
                if let Some(ck) = resume.take() {
                    ck.restore(&mut t.run).block_on()?;
                }
                Ok(t)
            });
        let mut trainer = dist::agree(group, built)?;
        let chosen = trainer.choose(&chooser).block_on().map(|c| c.to_string());
        let chosen = dist::agree(group, chosen)?;
        if trainer.run.steps > 0 {
            tell(format!("resumed {preset} at step {}", trainer.run.steps))?;
        }
        tell(format!(
            "-- {preset}: matmuls {} (compute {}), {}",
            trainer.run.precision.matmul,
            trainer.run.precision.compute,
            describe(&trainer)
        ))?;
        tell(format!("   {}", trainer.executor()))?;
        tell(format!("   {chosen}; {}", trainer.run.graphs))?;
        let mut run = Run {
            preset: preset.to_string(),
            backend: backend.name(),
            matmul_algorithm: trainer.run.precision.matmul.to_string(),
            config: config.clone(),
            parameters: config.parameter_count(),
            steps: vec![],
            val: vec![],
            stopped: None,
            stopped_at: None,
            ranks: group.size(),
            grad_accum: args.grad_accum,
            reduction: None,
            unigram_entropy: corpus.unigram_entropy(),
            executor: trainer.executor(),
            memory: trainer.memory(),
            attention: trainer.run.attention.clone(),
            graphs: trainer.run.graphs.clone(),
        };
        let bar = if leader {
            indicatif::ProgressBar::new(args.steps as u64)
        } else {
            indicatif::ProgressBar::hidden()
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_position(trainer.run.steps as u64);
        let checkpoint = checkpoint_path(args, preset);
        // A checkpoint refused on rank 0 alone (weights that overflowed) ends every rank of a
        // data-parallel run, exit 4; alone, it stops the run as a divergence does.
        let alone = group.size() <= 1;
        while trainer.run.steps < args.steps {
            let poison = match setup.inject {
                Some(s) if s == trainer.run.steps + 1 => f32::INFINITY,
                _ => 0.0,
            };
            let stepped = step_once(args, &mut trainer, &mut run, poison, &bar, &tell);
            let saved = stepped.and_then(|step| match leader && args.checkpoint_every > 0 {
                true if step % args.checkpoint_every == 0 => {
                    trainer.save(&checkpoint).block_on().map_err(|e| (e, alone))
                }
                _ => Ok(()),
            });
            match saved {
                Ok(()) => {}
                // Divergence is the run's finding (kept in the log); any other error ends the tool.
                Err((e @ Error::Diverged { .. }, true)) => {
                    bar.abandon();
                    tell(format!("stopped: {e}"))?;
                    if let Error::Diverged { step, why, .. } = &e {
                        run.stopped_at = Some(*step);
                        run.stopped = Some(why.clone());
                    }
                    break;
                }
                Err((e, _)) => {
                    bar.abandon();
                    return Err(e);
                }
            }
        }
        bar.finish_and_clear();
        run.memory = trainer.memory();
        let m = &run.memory;
        tell(format!(
            "   memory: peak {:.1} MiB, {:.2}x the plan's tensors ({:.1} MiB); {}",
            m.peak_bytes as f64 / (1u64 << 20) as f64,
            m.overhead(),
            m.plan_bytes as f64 / (1u64 << 20) as f64,
            m.measured_by
        ))?;
        if leader && run.stopped.is_none() {
            match trainer.save(&checkpoint).block_on() {
                Ok(()) => tell(format!("saved {}", checkpoint.display()))?,
                Err(e @ Error::Diverged { .. }) if alone => {
                    tell(format!("stopped: {e}"))?;
                    if let Error::Diverged { step, why, .. } = &e {
                        run.stopped_at = Some(*step);
                        run.stopped = Some(why.clone());
                    }
                }
                Err(e) => return Err(e),
            }
        }
        runs.push(run);
    }
    Ok(runs)
}

/// One step of a run, its log line and its evaluation where due; returns the step's number.
/// A non-finite loss or validation loss is `Error::Diverged` (the same on every rank: true
/// with it).
fn step_once(
    args: &TrainArgs,
    trainer: &mut Trainer,
    run: &mut Run,
    poison: f32,
    bar: &indicatif::ProgressBar,
    tell: &dyn Fn(String) -> Result<()>,
) -> std::result::Result<u32, (Error, bool)> {
    let record = trainer
        .step_injecting(poison)
        .block_on()
        .map_err(|e| (e, true))?;
    if let (None, Some(r)) = (&run.reduction, &trainer.run.reduced) {
        bar.suspend(|| {
            tell(format!(
                "   gradients summed by {}: {:.2} MiB per step in {} call(s), {}",
                r.engine,
                r.bytes as f64 / (1u64 << 20) as f64,
                r.calls,
                if r.overlapped {
                    "each as the backward pass finished its gradients"
                } else {
                    "after the backward pass"
                }
            ))
        })
        .map_err(|e| (e, false))?;
        run.reduction = Some(r.clone());
    }
    bar.set_position(record.step as u64);
    bar.set_message(format!("loss {:.4}", record.loss));
    let step = record.step;
    run.steps.push(record.clone());
    if step % args.eval_interval.max(1) == 0 || step == args.steps || step == 1 {
        let val = (trainer.evaluate(args.eval_batches).block_on()).map_err(|e| (e, true))?;
        run.val.push((step, val));
        bar.suspend(|| tell(log_line(&record, val)))
            .map_err(|e| (e, false))?;
    }
    Ok(step)
}

/// Where a preset's checkpoint goes.
fn checkpoint_path(args: &TrainArgs, preset: Preset) -> PathBuf {
    args.out.join(format!("{preset}.safetensors"))
}

/// The summary line, train.json and loss.svg (rank 0); the exit code.
fn write_logs(args: &TrainArgs, runs: &[Run]) -> Result<i32> {
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
    say!("{}", summary.join("; "))?;
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
    say!("wrote {} and {}", log.display(), chart.display())?;
    Ok(exit_of(runs))
}

/// One preset that stops is a failed run; when presets are compared, the comparison is the
/// result and its summary says which stopped.
fn exit_of(runs: &[Run]) -> i32 {
    match runs {
        [one] if one.stopped.is_some() => super::EXIT_STOPPED,
        _ => 0,
    }
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

/// What `--export-init` reads: the corpus (its vocabulary), the config, and the weights from
/// `--init`, `--resume` or `--seed`; it trains nothing, so every other flag is refused by name.
const EXPORT_USES: [&str; 6] = ["export_init", "config", "corpus", "seed", "init", "resume"];

/// `--export-init`: the initial weights a run would start from (seeded by `--seed`, read from
/// `--init`, or a checkpoint's under `--resume`, checked as `--resume` checks it), under
/// PyTorch's names. Its messages go to standard error where the file is standard output (`-`).
fn export_init(args: &TrainArgs, path: &std::path::Path) -> Result<i32> {
    let flag = |id: &str| format!("--{}", id.replace('_', "-"));
    if let Some(unused) = args
        .given
        .iter()
        .find(|id| !EXPORT_USES.contains(&id.as_str()))
    {
        return Err(Error::invalid(
            "--export-init",
            format!(
                "{} is not used when exporting initial weights (nothing is trained); the \
                 export reads {}",
                flag(unused),
                EXPORT_USES[1..]
                    .iter()
                    .map(|id| flag(id))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    let given = |id: &str| args.given.iter().any(|g| g == id);
    if args.init.is_some() && args.resume.is_some() {
        return Err(Error::invalid(
            "--export-init",
            "--init and --resume both name the weights to export; name one of them",
        ));
    }
    if given("seed") && (args.init.is_some() || args.resume.is_some()) {
        return Err(Error::invalid(
            "--export-init",
            "--seed draws the weights, which --init or --resume already name; leave it out",
        ));
    }
    if path.as_os_str() == "-" {
        super::messages_to_stderr();
    }
    crate::output::check_writable(path)?;
    let (corpus, config) =
        corpus_and_config(&args.corpus, &args.config, (args.context, args.batch))?;
    let params = match (&args.init, &args.resume) {
        (Some(from), _) => init::read_init(from, &config, &corpus.vocab)?,
        (None, Some(ck)) => {
            let bytes = CheckpointFile::open(ck)?.read(&Expected::gpt(&config, &corpus.vocab))?;
            Checkpoint::from_bytes(&bytes, ck, &Expected::gpt(&config, &corpus.vocab))?.params
        }
        (None, None) => config.init(args.seed)?,
    };
    init::write_torch_init(path, &config, &params)?;
    say!(
        "wrote {} ({} initial weights of {}{}, PyTorch state_dict names)",
        path.display(),
        config.parameter_count(),
        config.name,
        match &args.resume {
            Some(ck) => format!(" from {}", ck.display()),
            None => String::new(),
        }
    )?;
    Ok(0)
}

pub fn sample(args: SampleArgs) -> Result<()> {
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return Err(Error::invalid(
            "--temperature",
            format!("{} is not a finite temperature >= 0", args.temperature),
        ));
    }
    if args.tokens > MAX_SAMPLE_TOKENS {
        return Err(Error::invalid(
            "--tokens",
            format!("{}: at most {MAX_SAMPLE_TOKENS}", args.tokens),
        ));
    }
    if args.checkpoint.as_os_str() == "-" && args.corpus.as_os_str() == "-" {
        return Err(Error::invalid(
            "arguments",
            "--checkpoint and --corpus cannot both be standard input",
        ));
    }
    let choice = args.backend.parse::<BackendChoice>()?;
    // Read first (a special file refused before the checkpoint is opened), tokenized once the
    // checkpoint names its tokenizer.
    let text = Corpus::read_text(&args.corpus)?;
    // The header alone names the config; the tensors are read once their size is its size.
    let file = CheckpointFile::open(&args.checkpoint)?;
    let Some(gpt) = &file.meta.gpt else {
        return Err(Error::file(
            &args.checkpoint,
            "not a checkpoint of the GPT: a built model's checkpoint holds no configuration to sample",
        ));
    };
    let corpus = Corpus::from_file_text(&text, GptConfig::tokenizer(&gpt.config))
        .map_err(|e| Error::file(&args.corpus, e))?;
    drop(text);
    // Checked before anything is echoed: a character the model does not know cannot condition it.
    corpus
        .encode(&args.prompt)
        .map_err(|why| Error::invalid("--prompt", why))?;
    let mut config = GptConfig::named(&gpt.config, corpus.vocab.len())?;
    // The context it was trained with (`train --context`), which its position embedding holds.
    config.block_size = gpt.block_size;
    let seed = file.meta.seed;
    let bytes = file.read(&Expected::gpt(&config, &corpus.vocab))?;
    let ck = Checkpoint::from_bytes(
        &bytes,
        &args.checkpoint,
        &Expected::gpt(&config, &corpus.vocab),
    )?;
    drop(bytes);
    let preset: Preset = ck.meta.preset.parse()?;
    let backend = backend::open(choice).block_on()?;
    // Sampling needs no fp8 history: current scaling.
    let options = TrainOptions {
        fp8_current: true,
        ..TrainOptions::new(config, preset, seed)
    };
    let mut trainer = Trainer::new(backend.as_ref(), &corpus, options)?;
    ck.restore(&mut trainer.run).block_on()?;
    // Each character as it is drawn.
    let flushed = |text: &str| {
        say_raw!("{text}")?;
        use std::io::Write;
        std::io::stdout()
            .flush()
            .map_err(|e| Error::output("standard output", e))
    };
    flushed(&args.prompt)?;
    trainer
        .sample_streaming(
            &args.prompt,
            args.tokens,
            args.temperature,
            args.seed,
            flushed,
        )
        .block_on()?;
    say!()
}
