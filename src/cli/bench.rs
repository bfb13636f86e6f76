//! `mantissa bench matmul [--sizes ..] [--algorithms ..] [--backends ..] [--json FILE]`
//! `mantissa bench train [--config ..] [--precision ..] [--backends ..] [--json FILE]`

use super::parse_list;
use super::table::{Table, g};
use crate::algorithm::{Algorithm, MatmulShape};
use crate::backend::{self, BackendChoice, Operands};
use crate::bench::{
    MAX_BENCH_STEPS, MatmulBench, MatmulRecord, ProfileRow, StepProfile, TrainBench, TrainRecord,
};
use crate::error::{Error, Result};
use crate::policy::Preset;
use crate::train::{Choice, ChosenBy, attention_choice, graphs_choice};
use pollster::FutureExt as _;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// Matmul throughput (TFLOP/s), bytes per operand element and relative error.
    Matmul(MatmulArgs),
    /// Training steps: step time, tokens/s and peak memory per preset and backend.
    Train(TrainArgs),
}

#[derive(clap::Args)]
#[command(
    after_help = "Example:\n  mantissa bench train --config small --precision 32-true,bf16-mixed --backends cuda,wgpu --json bench-train.json"
)]
struct TrainArgs {
    /// Model size: tiny or small (the corpus's characters), gpt2 (GPT-2's BPE).
    #[arg(long, default_value = "tiny")]
    config: String,
    /// Presets, comma-separated, or "all".
    #[arg(long, default_value = "all")]
    precision: String,
    /// Backends, comma-separated: auto, reference, wgpu, cuda.
    #[arg(long, default_value = "auto")]
    backends: String,
    /// Steps run before timing (the first compiles the plan and tunes its matmuls).
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// Steps timed (the median is reported).
    #[arg(long, default_value_t = 10)]
    steps: u32,
    /// The training text.
    #[arg(long, default_value = "data/shakespeare.txt")]
    corpus: PathBuf,
    /// Sequences per step instead of the config's (tiny 16, small 64, gpt2 8).
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence instead of the config's (tiny 32, small 256, gpt2 1024).
    #[arg(long)]
    context: Option<usize>,
    /// Gradient accumulation: the batch in N micro-batches a step (`train --grad-accum`); N
    /// must divide the batch.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write the records as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// auto: causal attention fused or as separate ops, whichever runs the step faster here
    /// (both timed before the first step, the choice cached; MANTISSA_AUTOTUNE=off: fused where
    /// the backend prefers it, CUDA); fused or unfused to compare them.
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
    /// After the timed steps, run three more with every op timed, and print where a step's
    /// time goes (by part of the step and by op; every op in the JSON).
    #[arg(long)]
    profile: bool,
}

#[derive(clap::Args)]
#[command(
    after_help = "Example:\n  mantissa bench matmul --sizes 512,1024 --algorithms f32,bf16x3,e4m3 --json bench.json"
)]
struct MatmulArgs {
    /// Square sizes n (m = n = k), comma-separated; or MxNxK.
    #[arg(long, default_value = "256,512")]
    sizes: String,
    /// Algorithms, comma-separated, or "all".
    #[arg(long, default_value = "all")]
    algorithms: String,
    /// Backends, comma-separated: auto, reference, wgpu, cuda.
    #[arg(long, default_value = "auto")]
    backends: String,
    /// What each timing starts from, comma-separated, or "all": f32 (operands as f32 on the
    /// device, their rounding/encoding/splitting/quantizing timed too) or prepared (operands
    /// already in the algorithm's storage format, as a training step holds them: the product
    /// alone, as PyTorch's same-dtype GEMM is timed).
    #[arg(long, default_value = "f32")]
    operands: String,
    /// Timed repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Rows of C whose error is measured against an f64 product.
    #[arg(long, default_value_t = 32)]
    error_rows: usize,
    /// Also write the records as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One `--sizes` item, N or MxNxK, checked by `MatmulShape::check_requested` before anything
/// is allocated.
pub(crate) fn parse_shape(s: &str) -> Result<(usize, usize, usize)> {
    let bad = |why: &str| Error::invalid("--sizes", format!("'{}': {why}", s.trim()));
    let dims: Vec<usize> = s
        .split('x')
        .map(|d| d.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| bad("write N or MxNxK with whole numbers"))?;
    let (m, n, k) = match dims[..] {
        [n] => (n, n, n),
        [m, n, k] => (m, n, k),
        _ => return Err(bad("write N or MxNxK")),
    };
    MatmulShape::check_requested(m, n, k).map_err(|why| bad(&why))?;
    Ok((m, n, k))
}

/// The shapes of a `--sizes` list (`parse_list`'s rules: at least one, none twice).
pub(crate) fn parse_shapes(list: &str) -> Result<Vec<(usize, usize, usize)>> {
    super::parse_list_with("--sizes", list, parse_shape)
}

pub fn run(args: Args) -> Result<()> {
    match args.what {
        What::Matmul(args) => matmul(args),
        What::Train(args) => train(args),
    }
}

fn train(args: TrainArgs) -> Result<()> {
    let presets: Vec<Preset> = if args.precision.trim() == "all" {
        Preset::ALL.to_vec()
    } else {
        parse_list("--precision", &args.precision)?
    };
    for (flag, n, least) in [("--steps", args.steps, 1), ("--warmup", args.warmup, 0)] {
        if !(least..=MAX_BENCH_STEPS).contains(&n) {
            return Err(Error::invalid(
                flag,
                format!("{n} steps: between {least} and {MAX_BENCH_STEPS}"),
            ));
        }
    }
    let choices: Vec<BackendChoice> = parse_list("--backends", &args.backends)?;
    if let Some(path) = &args.json {
        if path.as_os_str() == "-" {
            // The JSON is the data on standard output; the tables go to standard error.
            super::messages_to_stderr();
        }
        crate::output::check_writable(path)?;
    }
    let sizes = (args.context, args.batch);
    let (corpus, config) = super::train::corpus_and_config(&args.corpus, &args.config, sizes)?;
    corpus.check_context(config.block_size)?;
    let bench = TrainBench {
        config,
        presets,
        warmup: args.warmup,
        steps: args.steps,
        seed: args.seed,
        attention: attention_choice(&args.attention)?,
        graphs: graphs_choice(&args.graphs)?,
        profile: if args.profile { PROFILED_STEPS } else { 0 },
        grad_accum: args.grad_accum,
    };
    let mut records: Vec<TrainRecord> = Vec::new();
    for choice in choices {
        let backend = backend::open(choice).block_on()?;
        eprintln!(
            "benchmarking training steps on {} ...",
            backend.device_name()
        );
        records.extend(
            bench
                .run(backend.as_ref(), &corpus, |r| {
                    eprintln!(
                        "  {:<18} {:>9.2} ms/step  {:>10.0} tokens/s  peak {:.1} MiB{}\n    {}; {}",
                        r.preset,
                        r.step_seconds * 1e3,
                        r.tokens_per_second,
                        mib(r.memory.peak_bytes),
                        r.stopped
                            .as_deref()
                            .map_or(String::new(), |s| format!("  ({s})")),
                        r.attention_choice,
                        r.graphs_choice
                    );
                })
                .block_on()?,
        );
    }
    let mut table = Table::new(&[
        "backend",
        "preset",
        "attention",
        "ms/step",
        "range",
        "tokens/s",
        "first step s",
        "peak MiB",
        "x plan",
        "loss",
    ]);
    for r in &records {
        table.row(vec![
            r.backend.clone(),
            r.preset.clone(),
            format!("{} ({})", r.attention, chosen_by(&r.attention_choice)),
            format!("{:.2}", r.step_seconds * 1e3),
            format!(
                "{:.2}..{:.2}",
                r.step_seconds_range.0 * 1e3,
                r.step_seconds_range.1 * 1e3
            ),
            format!("{:.0}", r.tokens_per_second),
            format!("{:.2}", r.first_step_seconds),
            format!("{:.1}", mib(r.memory.peak_bytes)),
            format!("{:.2}", r.memory.overhead()),
            match &r.stopped {
                None => format!("{:.4}", r.loss),
                Some(_) => "stopped".into(),
            },
        ]);
    }
    say_raw!("{}", table.render())?;
    say_raw!("\n{}", work_table(&records))?;
    for r in &records {
        if let Some(p) = &r.profile {
            say_raw!("{}", profile_table(r, p))?;
        }
    }
    write_json(args.json.as_deref(), &records)
}

/// How a choice was made, for a table cell: "named", "cached", "timed 4.10/5.27 ms" (each
/// candidate's median, a dropped one as "-").
fn chosen_by(c: &Choice) -> String {
    match c.by {
        ChosenBy::Timed => format!(
            "timed {} ms",
            c.candidates
                .iter()
                .map(|k| k.seconds.map_or("-".into(), |s| format!("{:.2}", s * 1e3)))
                .collect::<Vec<_>>()
                .join("/")
        ),
        by => by.name().into(),
    }
}

/// What each record's step asks of its device: ops, launches, standalone roundings, and the
/// bytes and FLOPs of its ops by their definitions.
fn work_table(records: &[TrainRecord]) -> String {
    let mut table = Table::new(&[
        "backend",
        "preset",
        "ops/step",
        "launches/step",
        "roundings",
        "MB/step",
        "GFLOP/step",
    ]);
    for r in records {
        let w = &r.work;
        table.row(vec![
            r.backend.clone(),
            r.preset.clone(),
            w.ops.to_string(),
            w.launches.map_or("- (host)".into(), |l| l.to_string()),
            w.roundings.to_string(),
            format!("{:.1}", w.bytes as f64 / 1e6),
            format!("{:.2}", w.flops as f64 / 1e9),
        ]);
    }
    table.render()
}

/// Steps `--profile` times op by op (each op's median is reported).
const PROFILED_STEPS: u32 = 3;
/// Op labels a profile prints (the rest summed in one line; all are in the JSON).
const PROFILE_LINES: usize = 16;

/// Where a record's step time goes: by part of the step, then by op label, each with its
/// launches, its rate (GB/s, or TFLOP/s for products) and its fraction of the device's limit.
fn profile_table(r: &TrainRecord, p: &StepProfile) -> String {
    let share = |s: f64| format!("{:.1}%", 100.0 * s / p.total_seconds.max(f64::MIN_POSITIVE));
    let row = |l: &ProfileRow| {
        let rate = if l.flops > 0 {
            rate(l.flops as f64 / l.seconds, "FLOP/s")
        } else {
            rate(l.bytes as f64 / l.seconds, "B/s")
        };
        vec![
            l.name.clone(),
            l.ops.to_string(),
            l.launches.map_or("-".into(), |n| n.to_string()),
            format!("{:.3}", l.seconds * 1e3),
            share(l.seconds),
            rate,
            l.of_limit
                .map_or("-".into(), |f| format!("{:.0}%", 100.0 * f)),
        ]
    };
    let mut out = format!(
        "\nprofile of {} {} ({} attention; median of {} steps; {}): {:.2} ms of ops\n",
        r.backend,
        r.preset,
        r.attention,
        p.steps,
        p.measured_by,
        p.total_seconds * 1e3
    );
    let l = &p.limits;
    out.push_str(&format!(
        "limits: copy {}; matmul {}{}\n",
        l.copy_bytes_per_second
            .map_or("-".into(), |b| rate(b, "B/s")),
        l.matmul
            .iter()
            .map(|m| format!(
                "{} {} (n {})",
                m.algorithm,
                rate(m.flops_per_second, "FLOP/s"),
                m.n
            ))
            .collect::<Vec<_>>()
            .join(", "),
        l.missing
            .iter()
            .map(|m| format!("; missing {m}"))
            .collect::<String>()
    ));
    let header = ["", "ops", "launches", "ms", "share", "rate", "of limit"];
    let mut parts = Table::new(&header);
    for part in &p.parts {
        parts.row(row(part));
    }
    out.push_str(&parts.render());
    let mut labels = Table::new(&header);
    for l in p.labels.iter().take(PROFILE_LINES) {
        labels.row(row(l));
    }
    let rest = &p.labels[p.labels.len().min(PROFILE_LINES)..];
    if !rest.is_empty() {
        let sum = ProfileRow {
            name: format!("({} other kinds of op)", rest.len()),
            ops: rest.iter().map(|l| l.ops).sum(),
            launches: rest.iter().map(|l| l.launches).sum(),
            seconds: rest.iter().map(|l| l.seconds).sum(),
            bytes: rest.iter().map(|l| l.bytes).sum(),
            flops: rest.iter().map(|l| l.flops).sum(),
            of_limit: None,
        };
        labels.row(row(&sum));
    }
    out.push('\n');
    out.push_str(&labels.render());
    out
}

/// A rate with the SI prefix that gives it one to three digits before the point.
fn rate(per_second: f64, unit: &str) -> String {
    let (scale, prefix) = [(1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")]
        .into_iter()
        .find(|&(s, _)| per_second >= s)
        .unwrap_or((1.0, ""));
    format!("{:.2} {prefix}{unit}", per_second / scale)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

fn write_json(path: Option<&std::path::Path>, records: &impl serde::Serialize) -> Result<()> {
    if let Some(path) = path {
        let text = serde_json::to_string_pretty(records)
            .map_err(|e| Error::invalid("json", e.to_string()))?;
        crate::output::write_bytes(path, text.as_bytes())?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn matmul(args: MatmulArgs) -> Result<()> {
    let algorithms: Vec<Algorithm> = if args.algorithms.trim() == "all" {
        Algorithm::ALL.to_vec()
    } else {
        parse_list("--algorithms", &args.algorithms)?
    };
    let shapes = parse_shapes(&args.sizes)?;
    let choices: Vec<BackendChoice> = parse_list("--backends", &args.backends)?;
    let operands: Vec<Operands> = if args.operands.trim() == "all" {
        Operands::ALL.to_vec()
    } else {
        parse_list("--operands", &args.operands)?
    };
    if let Some(path) = &args.json {
        if path.as_os_str() == "-" {
            // The JSON is the data on standard output; the tables go to standard error.
            super::messages_to_stderr();
        }
        crate::output::check_writable(path)?;
    }
    let bench = MatmulBench {
        shapes,
        algorithms,
        operands,
        repetitions: super::check_reps(args.reps)?,
        error_rows: args.error_rows,
        seed: 42,
        contract_check_limit: 0,
    };
    let mut records: Vec<MatmulRecord> = Vec::new();
    let mut table = Table::new(&[
        "backend",
        "algorithm",
        "operands",
        "m x n x k",
        "ms",
        "TFLOP/s",
        "clock",
        "variant",
        "bytes/elem A,B",
        "rel. error",
        "expected (N(0,1))",
        "max ulp",
    ]);
    for choice in choices {
        let backend = backend::open(choice).block_on()?;
        eprintln!("benchmarking on {} ...", backend.device_name());
        records.extend(
            bench
                .run(backend.as_ref(), |r| {
                    eprintln!(
                        "  {:<12} {:<8} {:>5}x{}x{}  {:>10.3} ms  {:>8.4} TFLOP/s  err {:.2e}",
                        r.algorithm,
                        r.operands,
                        r.m,
                        r.n,
                        r.k,
                        r.seconds * 1e3,
                        r.tflops,
                        r.relative_error
                    );
                })
                .block_on()?,
        );
    }
    for r in &records {
        table.row(vec![
            r.backend.clone(),
            r.algorithm.clone(),
            r.operands.to_string(),
            format!("{}x{}x{}", r.m, r.n, r.k),
            format!("{:.3}", r.seconds * 1e3),
            g(r.tflops, 3),
            r.clock.to_string(),
            r.variant.clone(),
            format!("{},{}", r.bytes_per_element_a, r.bytes_per_element_b),
            format!("{:.2e}", r.relative_error),
            format!("{}..{}", g(r.expected_error.0, 2), g(r.expected_error.1, 2)),
            format!("{:.1}", r.max_ulp_error),
        ]);
    }
    say_raw!("{}", table.render())?;
    write_json(args.json.as_deref(), &records)
}
