//! The benchmark harnesses behind `mantissa bench matmul|train`, `benches/matmul.rs` and
//! `benches/train.rs`.
//!
//! Matmul throughput is timed by the backend (GPU timestamps where the adapter has them, wall clock
//! otherwise) with operands resident on the device and their preparation (casts, splits, fp8
//! scaling) included. The error is measured on a sample of rows against an f64 product of the
//! original inputs, so large sizes stay cheap to check.

use crate::algorithm::{Algorithm, MatmulShape};
use crate::backend::{Backend, Operands, reference};
use crate::error::{Error, Result};
use crate::measure;
use crate::plan::exec::{Memory, Timings};
use crate::plan::{Cost, Op, Outline, Plan, PlanBuilder, Section, Strided, TensorKind};
use crate::policy::Preset;
use crate::train::{Choice, Chooser, Corpus, GptConfig, TrainOptions, Trainer};

/// One measurement.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MatmulRecord {
    /// The backend's name (`Backend::name`: `reference`, `wgpu:<adapter> (<api>)`,
    /// `cuda:<device>`).
    pub backend: String,
    /// The device in words (`Backend::device_name`).
    pub device: String,
    /// The algorithm's name, as `mantissa matmul --algorithm` takes it.
    pub algorithm: String,
    /// What the timing started from: f32 operands (their preparation timed too), or operands
    /// prepared in the algorithm's storage format (the product alone).
    pub operands: Operands,
    /// Rows of A and C.
    pub m: usize,
    /// Columns of B and C.
    pub n: usize,
    /// Columns of A, rows of B: the length of each dot product.
    pub k: usize,
    /// Median seconds of one matmul, from `operands`.
    pub seconds: f64,
    /// Throughput in TFLOP/s: 2·m·n·k / `seconds` / 1e12.
    pub tflops: f64,
    /// How the time was taken: "gpu-timestamps", "cuda-events" or "wall-clock".
    pub clock: &'static str,
    /// Timed matmuls the median is taken over.
    pub repetitions: usize,
    /// The kernel variant that ran (wgpu: its tile, and whether the autotuner chose it and
    /// the median time it timed it at).
    pub variant: String,
    /// The median seconds the autotuner timed the chosen variant at (from f32 operands, their
    /// preparation included), where it chose it.
    pub tuned_seconds: Option<f64>,
    /// Bytes one element of A occupies on the device (split: all planes).
    pub bytes_per_element_a: usize,
    /// Bytes one element of B occupies on the device (split: all planes).
    pub bytes_per_element_b: usize,
    /// Relative Frobenius error against the f64 product, over `error_rows` sampled rows.
    pub relative_error: f64,
    /// Largest error in f32 ulps over the sampled rows (`measure::max_ulp_error`).
    pub max_ulp_error: f64,
    /// Rows of C the errors were measured on (`MatmulBench::error_rows`, at most m).
    pub error_rows: usize,
    /// The range the contract of docs/design.md expects on N(0,1) inputs.
    pub expected_error: (f64, f64),
    /// Elements of C outside the contract's tolerance of the host reference implementation of
    /// the same algorithm (`mantissa report`'s check); none where the size was over the
    /// bench's `contract_check_limit`.
    pub contract_breaks: Option<usize>,
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct MatmulBench {
    /// Square sizes n (m = n = k), or explicit (m, n, k).
    pub shapes: Vec<(usize, usize, usize)>,
    /// The algorithms timed on each shape, in this order.
    pub algorithms: Vec<Algorithm>,
    /// Each (shape, algorithm) is timed from each of these.
    pub operands: Vec<Operands>,
    /// Timed matmuls per (shape, algorithm, operands); the median is recorded.
    pub repetitions: usize,
    /// Rows of C whose error is measured.
    pub error_rows: usize,
    /// Seed of the N(0,1) inputs (A from `seed`, B from `seed + 1`).
    pub seed: u64,
    /// Products of up to this many multiply-adds are also checked element by element against
    /// the host reference implementation of the algorithm (0: never).
    pub contract_check_limit: u64,
}

impl MatmulBench {
    /// Runs every (algorithm, shape) on `backend`, calling `each` as records arrive.
    pub async fn run(
        &self,
        backend: &dyn Backend,
        mut each: impl FnMut(&MatmulRecord),
    ) -> Result<Vec<MatmulRecord>> {
        let mut out = Vec::new();
        for &(m, n, k) in &self.shapes {
            let shape = MatmulShape::new(m, n, k);
            // A, B and C on the host (their sizes are checked by `--sizes`' parser).
            let values = (m * k + k * n + m * n) as u64;
            crate::memory::check("the benchmark's operands", values.checked_mul(4))?;
            let a = measure::normal(m * k, self.seed);
            let b = measure::normal(k * n, self.seed + 1);
            for algorithm in &self.algorithms {
                let c = backend.matmul(&shape, algorithm, &a, &b).await?;
                let (relative_error, max_ulp_error, rows) =
                    sampled_error(&shape, &a, &b, &c, self.error_rows);
                // Elements outside their tolerance, and 1 for a whole product outside its band.
                let contract_breaks = if (m * n * k) as u64 <= self.contract_check_limit {
                    let want = reference::matmul(&shape, algorithm, &a, &b)?;
                    let check = measure::check_product(algorithm, &shape, (&a, &b), &c, &want)?;
                    Some(check.count + usize::from(!check.whole.holds()))
                } else {
                    None
                };
                drop(c);
                let (bytes_a, bytes_b) = algorithm.bytes_per_element();
                for &operands in &self.operands {
                    let timing = backend
                        .time_matmul(&shape, algorithm, &a, &b, self.repetitions, operands)
                        .await?;
                    if timing.operands != operands
                        && out.iter().any(|r: &MatmulRecord| {
                            r.operands == timing.operands
                                && r.algorithm == algorithm.to_string()
                                && (r.m, r.n, r.k) == (m, n, k)
                        })
                    {
                        // The backend times one way only, and that row is there already.
                        continue;
                    }
                    let record = MatmulRecord {
                        backend: backend.name(),
                        device: backend.device_name(),
                        algorithm: algorithm.to_string(),
                        operands: timing.operands,
                        m,
                        n,
                        k,
                        seconds: timing.seconds,
                        tflops: shape.flops() / timing.seconds / 1e12,
                        clock: timing.clock,
                        repetitions: timing.repetitions,
                        variant: timing.variant.clone(),
                        tuned_seconds: timing.tuned_seconds,
                        bytes_per_element_a: bytes_a,
                        bytes_per_element_b: bytes_b,
                        relative_error,
                        max_ulp_error,
                        error_rows: rows,
                        expected_error: algorithm.expected_error_n01(),
                        contract_breaks,
                    };
                    each(&record);
                    out.push(record);
                }
            }
        }
        Ok(out)
    }
}

/// Error of C against the f64 product over `rows` evenly spaced rows.
fn sampled_error(
    shape: &MatmulShape,
    a: &[f32],
    b: &[f32],
    c: &[f32],
    rows: usize,
) -> (f64, f64, usize) {
    let rows = rows.clamp(1, shape.m.max(1));
    let step = shape.m.max(1) / rows;
    let picked: Vec<usize> = (0..rows).map(|r| r * step).collect();
    let sub_a: Vec<f32> = picked
        .iter()
        .flat_map(|&i| a[i * shape.k..(i + 1) * shape.k].iter().copied())
        .collect();
    let sub_shape = MatmulShape::new(picked.len(), shape.n, shape.k);
    let exact = measure::exact_product(&sub_shape, &sub_a, b);
    let sub_c: Vec<f32> = picked
        .iter()
        .flat_map(|&i| c[i * shape.n..(i + 1) * shape.n].iter().copied())
        .collect();
    (
        measure::relative_error(&sub_c, &exact),
        measure::max_ulp_error(&sub_c, &exact),
        picked.len(),
    )
}

/// The most steps `TrainBench` times, and the most it warms up with (`bench train --steps`,
/// `--warmup`): each is a training step.
pub const MAX_BENCH_STEPS: u32 = 100_000;

/// What `mantissa bench train` measures: whole training steps of one model under each preset,
/// each preset from a fresh model (the same seed).
#[derive(Clone, Debug)]
pub struct TrainBench {
    /// The model trained (the same for every preset).
    pub config: GptConfig,
    /// The presets run, in this order, each on a fresh model.
    pub presets: Vec<Preset>,
    /// Steps run before timing: the first compiles the plan and tunes its matmuls.
    pub warmup: u32,
    /// Steps timed (the median is reported).
    pub steps: u32,
    /// Seed of the initial weights and of the sampled batches (`TrainOptions::seed`).
    pub seed: u64,
    /// Attention fused or not (`TrainOptions::fused_attention`; None: auto, the faster of the
    /// two timed before the first step, or cached: `Trainer::choose`).
    pub attention: Option<bool>,
    /// Sections recorded and replayed or not (`TrainOptions::graphs`; None: the executor's
    /// default).
    pub graphs: Option<bool>,
    /// Steps run after the timed ones with every op timed (`StepProfile`); 0: none.
    pub profile: u32,
    /// Micro-batches a step runs the batch in (`TrainOptions::grad_accum`; 1: whole).
    pub grad_accum: usize,
}

/// One preset's training steps on one backend.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TrainRecord {
    /// The backend's name (`Backend::name`).
    pub backend: String,
    /// The device in words (`Backend::device_name`).
    pub device: String,
    /// The preset's name ("bf16-mixed", ...).
    pub preset: String,
    /// The model trained.
    pub config: GptConfig,
    /// Trainable parameters of the model (`GptConfig::parameter_count`).
    pub parameters: usize,
    /// How the steps ran ("device-resident on ..., one submission per step").
    pub executor: String,
    /// "fused" (one op per block and direction) or "unfused" (copies, matmuls, softmax).
    pub attention: String,
    /// How attention came to be fused or not (named, timed with both ways' times, cached).
    pub attention_choice: Choice,
    /// How the step came to be recorded and replayed or not (the same).
    pub graphs_choice: Choice,
    /// How many of the plan's tensors are stored as 16-bit codes (`Plan::store_codes`; 0 with
    /// `MANTISSA_ACTIVATIONS=f32` or where no matmul rounds its inputs to 16 bits).
    pub coded_tensors: usize,
    /// Tokens one step trains on: batch size × block size, every rank's together.
    pub tokens_per_step: usize,
    /// Micro-batches a step ran the batch in (gradient accumulation; 1: whole).
    pub micro_batches: usize,
    /// Seconds of the first step: plan compiled, matmuls tuned, buffers allocated.
    pub first_step_seconds: f64,
    /// Median wall-clock seconds of a timed step (batch drawn, plan run, stats read back).
    pub step_seconds: f64,
    /// The fastest and slowest timed step, in seconds.
    pub step_seconds_range: (f64, f64),
    /// Steps timed (`TrainBench::steps` less any after a divergence).
    pub steps_timed: usize,
    /// `tokens_per_step` / `step_seconds`.
    pub tokens_per_second: f64,
    /// The memory the steps took: the plan's tensors and the executor's peak.
    pub memory: Memory,
    /// What a step asks of the device: ops, launches, bytes and FLOPs.
    pub work: StepWork,
    /// The loss of the last step run.
    pub loss: f64,
    /// Why the preset stopped before the steps were done (a divergence; timings then cover
    /// the steps before it).
    pub stopped: Option<String>,
    /// Where the step's time goes, op by op (`TrainBench::profile`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<StepProfile>,
}

/// What one step of a plan asks of the device: its ops, the launches the executor makes of
/// them, and the bytes and FLOPs its ops cost by their definitions (`plan::Cost`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepWork {
    /// Ops in the whole plan.
    pub ops: usize,
    /// Kernels launched and library GEMMs called (None where the executor launches nothing on
    /// a device: the host reference runs each op as one host function).
    pub launches: Option<usize>,
    /// Standalone roundings among the ops (a rounding no op before it could take in).
    pub roundings: usize,
    /// Bytes the step's ops read and write by their definitions (`plan::Cost::bytes`).
    pub bytes: u64,
    /// Floating-point operations the step's ops do by their definitions (`plan::Cost::flops`).
    pub flops: u64,
}

impl StepWork {
    /// The work of a whole step of `plan` in `micro` micro-batches (1: the batch whole), given
    /// its executor's launches per op: as a step runs the plan's sections, the forward and
    /// backward pass once a micro-batch, the accumulation sections (`Plan::accumulate`: the
    /// first micro-batch's gradients kept, the middle ones' added, the last's gathered) and the
    /// update once.
    pub fn of(plan: &Plan, launches: Option<&[usize]>, micro: usize) -> StepWork {
        let runs = match micro {
            0 | 1 => vec![(Section::Step, 1)],
            n => vec![
                (Section::Backward, n),
                (Section::Stash, 1),
                (Section::Accumulate, n - 2),
                (Section::Gather, 1),
                (Section::Update, 1),
            ],
        };
        let (mut bytes, mut flops, mut launched) = (0, 0, 0);
        for &(section, times) in &runs {
            let range = plan.range_of(section);
            let cost = plan.cost(range.clone());
            bytes += times as u64 * cost.bytes;
            flops += times as u64 * cost.flops;
            launched += times * launches.map_or(0, |l| l[range].iter().sum());
        }
        StepWork {
            ops: plan.ops().len(),
            launches: launches.map(|_| launched),
            roundings: plan
                .ops()
                .iter()
                .filter(|op| matches!(op, Op::Round { .. }))
                .count(),
            bytes,
            flops,
        }
    }
}

/// The rates a device reaches on the plan's own ops at a size that keeps it busy, measured
/// where a profile is taken: what an op's achieved rate is a fraction of.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Limits {
    /// Bytes per second (read plus written) of a strided copy of `COPY_ELEMENTS` f32 in one
    /// dense run (None where it failed: the reason is in `limits_missing`).
    pub copy_bytes_per_second: Option<f64>,
    /// FLOP/s of a square matmul under each algorithm of the plan's matmuls, at the first
    /// size from 256 up (doubling, at most 4096) that takes `BUSY_SECONDS`.
    pub matmul: Vec<MatmulLimit>,
    /// Why a limit is missing.
    pub missing: Vec<String>,
}

/// The FLOP/s one algorithm reaches on a square matmul (`Limits::matmul`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct MatmulLimit {
    /// The algorithm's name.
    pub algorithm: String,
    /// The size of the square matmul timed (m = n = k).
    pub n: usize,
    /// 2·n³ / the median seconds of one matmul.
    pub flops_per_second: f64,
}

/// Elements of the copy `Limits` times (64 MiB each way in f32).
const COPY_ELEMENTS: usize = 16 << 20;
/// How long a limit's op should run to count as keeping the device busy.
const BUSY_SECONDS: f64 = 0.02;

impl Limits {
    /// The limits for `plan`'s ops on `backend`, each the median of a few timed runs.
    pub async fn measure(backend: &dyn Backend, plan: &Plan) -> Limits {
        let mut missing = Vec::new();
        let map = Strided {
            dims: [1, 1, 1, COPY_ELEMENTS as u32],
            src: [0, 0, 0, 1],
            dst: [0, 0, 0, 1],
            src_offset: 0,
            dst_offset: 0,
        };
        let copy = one_op(COPY_ELEMENTS, 0, |x, _, out| Op::Copy {
            x,
            out,
            map,
            held: crate::format::Format::F32,
        });
        let copy_bytes_per_second = match time_one_op(backend, copy).await {
            Ok(s) => Some((2 * 4 * COPY_ELEMENTS) as f64 / s),
            Err(e) => {
                missing.push(format!("copy: {e}"));
                None
            }
        };
        let mut algorithms: Vec<Algorithm> = Vec::new();
        for op in plan.ops() {
            if let Op::Matmul { algorithm, .. } = op
                && !algorithms.contains(algorithm)
            {
                algorithms.push(*algorithm);
            }
        }
        let mut matmul = Vec::new();
        for algorithm in algorithms {
            let mut n = 256;
            let timed = loop {
                let op = one_op(n * n, n * n, |a, b, out| Op::Matmul {
                    shape: MatmulShape::new(n, n, n),
                    algorithm,
                    a,
                    b,
                    out,
                    scales: None,
                    held: crate::format::Format::F32,
                });
                match time_one_op(backend, op).await {
                    Ok(s) if s < BUSY_SECONDS && n < 4096 => n *= 2,
                    other => break other,
                }
            };
            match timed {
                Ok(s) => matmul.push(MatmulLimit {
                    algorithm: algorithm.to_string(),
                    n,
                    flops_per_second: 2.0 * (n as f64).powi(3) / s,
                }),
                Err(e) => missing.push(format!("matmul {algorithm} at {n}: {e}")),
            }
        }
        Limits {
            copy_bytes_per_second,
            matmul,
            missing,
        }
    }

    /// The fraction of its limit an op costing `cost` reaches in `seconds`: of the copy rate
    /// for memory-bound ops, of its algorithm's matmul rate for products.
    pub fn fraction(&self, op: &Op, cost: Cost, seconds: f64) -> Option<f64> {
        let algorithm = match op {
            Op::Matmul { algorithm, .. } => Some(algorithm),
            Op::Attention { spec, .. } | Op::AttentionBwd { spec, .. } => Some(&spec.algorithm),
            _ => None,
        };
        let limit = match algorithm.filter(|_| cost.computes()) {
            Some(a) => {
                let name = a.to_string();
                let m = self.matmul.iter().find(|m| m.algorithm == name)?;
                return Some(cost.flops as f64 / seconds / m.flops_per_second);
            }
            None => self.copy_bytes_per_second?,
        };
        Some(cost.bytes as f64 / seconds / limit)
    }
}

/// A plan of one op on two inputs of `a` and `b` elements (zeros; `b` 0: none) and an output
/// of `a` elements: `op(a, b, out)`.
fn one_op(a: usize, b: usize, op: impl FnOnce(usize, usize, usize) -> Op) -> Result<Plan> {
    let mut g = PlanBuilder::default();
    let tokens = g.tensor(1, TensorKind::Tokens);
    let targets = g.tensor(1, TensorKind::Targets);
    let x = g.constant(vec![0.0; a]);
    let y = if b > 0 { g.constant(vec![0.0; b]) } else { x };
    let out = g.temp(a);
    g.push(op(x, y, out));
    g.finish(Outline::ops_alone(1, 1, (tokens, targets), out))
}

/// The median of three timed runs of a one-op plan on `backend` (after one untimed run that
/// compiles and tunes).
async fn time_one_op(backend: &dyn Backend, plan: Result<Plan>) -> Result<f64> {
    let plan = plan?;
    let scalars = vec![0.0; plan.scalar_count()];
    let mut exec = backend.executor(plan)?;
    exec.run(Section::Step, &[0], &[0], &scalars).await?;
    let mut times = Vec::new();
    for _ in 0..3 {
        let (_, t) = exec.run_timed(Section::Step, &[0], &[0], &scalars).await?;
        times.push(t.seconds.first().copied().unwrap_or(f64::NAN));
    }
    Ok(crate::backend::median(&mut times))
}

/// Where a step's time goes: each op's median time over the profiled steps, and the sums by
/// part of the step and by op label (`Op::label`: a matmul's algorithm and shape).
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepProfile {
    /// Steps profiled (the median of each op is over these).
    pub steps: usize,
    /// What an op's time includes (`Timings::measured_by`).
    pub measured_by: String,
    /// The sum of the ops' medians.
    pub total_seconds: f64,
    /// The device's rates on the plan's kinds of op, which each op's fraction is of.
    pub limits: Limits,
    /// Forward, backward, and the unscale, check and update.
    pub parts: Vec<ProfileRow>,
    /// By op label, most time first.
    pub labels: Vec<ProfileRow>,
    /// Every op, in plan order.
    pub ops: Vec<OpTime>,
}

/// Ops summed under one name.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ProfileRow {
    /// The part ("forward", ...) or the op label the row sums.
    pub name: String,
    /// Ops summed.
    pub ops: usize,
    /// Launches the ops make together (None where the executor launches nothing on a device).
    pub launches: Option<usize>,
    /// The sum of the ops' median seconds.
    pub seconds: f64,
    /// Bytes the ops read and write by their definitions.
    pub bytes: u64,
    /// Floating-point operations the ops do by their definitions.
    pub flops: u64,
    /// The fraction of the limit (`Limits`) the ops reach together (None where a limit is
    /// missing).
    pub of_limit: Option<f64>,
}

/// One op's median time, what it costs by its definition and what it reaches.
#[derive(Clone, Debug, serde::Serialize)]
pub struct OpTime {
    /// The op's index in the plan.
    pub index: usize,
    /// What the op is (`Op::label`: a matmul's algorithm and shape).
    pub label: String,
    /// Launches the executor makes of the op (None where it launches nothing on a device).
    pub launches: Option<usize>,
    /// Median seconds of the op over the profiled steps.
    pub seconds: f64,
    /// Bytes the op reads and writes by its definition (`plan::Cost::bytes`).
    pub bytes: u64,
    /// Floating-point operations the op does by its definition (`plan::Cost::flops`).
    pub flops: u64,
    /// Bytes read and written per second (`bytes` / `seconds`).
    pub bytes_per_second: f64,
    /// FLOP/s (`flops` / `seconds`; 0 for an op that computes no products).
    pub flops_per_second: f64,
    /// The fraction of its limit the op reaches (`Limits::fraction`; None where the limit is
    /// missing).
    pub of_limit: Option<f64>,
}

impl StepProfile {
    /// The profile of `runs`, each the timings of a whole step of `plan`, with the executor's
    /// `launches` per op and the device's `limits`; None without runs.
    pub fn of(
        plan: &Plan,
        runs: &[Timings],
        launches: Option<&[usize]>,
        limits: Limits,
    ) -> Option<StepProfile> {
        let first = runs.first()?;
        let ops: Vec<OpTime> = (0..first.seconds.len())
            .map(|i| {
                let mut times: Vec<f64> = runs
                    .iter()
                    .filter_map(|r| r.seconds.get(i))
                    .copied()
                    .collect();
                let seconds = crate::backend::median(&mut times);
                let index = first.first + i;
                let op = plan.ops().get(index);
                let cost = op.map_or(Cost::default(), |op| op.cost(plan.tensors()));
                OpTime {
                    index,
                    label: op.map_or_else(String::new, Op::label),
                    launches: launches.and_then(|l| l.get(index).copied()),
                    seconds,
                    bytes: cost.bytes,
                    flops: cost.flops,
                    bytes_per_second: cost.bytes as f64 / seconds,
                    flops_per_second: cost.flops as f64 / seconds,
                    of_limit: op.and_then(|op| limits.fraction(op, cost, seconds)),
                }
            })
            .collect();
        // Ops summed, their fraction the time-weighted mean of theirs (each op's share of the
        // time the ops would take at their limits).
        let sum = |name: String, within: Vec<&OpTime>| {
            let seconds: f64 = within.iter().map(|o| o.seconds).sum();
            let at_limit: Option<f64> = within.iter().map(|o| Some(o.of_limit? * o.seconds)).sum();
            ProfileRow {
                name,
                ops: within.len(),
                launches: within.iter().map(|o| o.launches).sum(),
                seconds,
                bytes: within.iter().map(|o| o.bytes).sum(),
                flops: within.iter().map(|o| o.flops).sum(),
                of_limit: at_limit.map(|t| t / seconds),
            }
        };
        let part = |name: &str, range: std::ops::Range<usize>| {
            sum(
                name.into(),
                ops.iter().filter(|o| range.contains(&o.index)).collect(),
            )
        };
        let parts = vec![
            part("forward", 0..plan.forward),
            part("backward", plan.forward..plan.backward),
            part("unscale, check and update", plan.range_of(Section::Update)),
        ];
        let mut names: Vec<&str> = Vec::new();
        for o in &ops {
            if !names.contains(&o.label.as_str()) {
                names.push(&o.label);
            }
        }
        let mut labels: Vec<ProfileRow> = names
            .into_iter()
            .map(|name| {
                sum(
                    name.into(),
                    ops.iter().filter(|o| o.label == name).collect(),
                )
            })
            .collect();
        labels.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        Some(StepProfile {
            steps: runs.len(),
            measured_by: first.measured_by.clone(),
            total_seconds: ops.iter().map(|o| o.seconds).sum(),
            limits,
            parts,
            labels,
            ops,
        })
    }
}

impl TrainBench {
    /// Runs every preset on `backend`, calling `each` as records arrive. A preset that
    /// diverges is recorded with the steps it ran; any other failure ends the bench.
    pub async fn run(
        &self,
        backend: &dyn Backend,
        corpus: &Corpus,
        mut each: impl FnMut(&TrainRecord),
    ) -> Result<Vec<TrainRecord>> {
        for (flag, n, least) in [("--steps", self.steps, 1), ("--warmup", self.warmup, 0)] {
            if !(least..=MAX_BENCH_STEPS).contains(&n) {
                return Err(Error::invalid(
                    flag,
                    format!("{n} steps: between {least} and {MAX_BENCH_STEPS}"),
                ));
            }
        }
        // Within the bounds above: no sum overflows.
        let runs = self.warmup.max(1) + self.steps;
        let mut out = Vec::new();
        let chooser = Chooser::from_env()?;
        for &preset in &self.presets {
            let options = TrainOptions {
                fused_attention: self.attention,
                graphs: self.graphs,
                grad_accum: self.grad_accum,
                ..TrainOptions::new(self.config.clone(), preset, self.seed)
            };
            let mut trainer = Trainer::new(backend, corpus, options)?;
            trainer.choose(&chooser).await?;
            let (mut first, mut timed, mut loss, mut stopped) = (0.0, vec![], f64::NAN, None);
            for i in 0..runs {
                match trainer.step().await {
                    Ok(r) => {
                        loss = r.loss;
                        if i == 0 {
                            first = r.dt_ms / 1e3;
                        } else if i >= self.warmup.max(1) {
                            timed.push(r.dt_ms / 1e3);
                        }
                    }
                    Err(e @ Error::Diverged { .. }) => {
                        stopped = Some(e.to_string());
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
            // Profiled steps follow the timed ones, unless the preset stopped.
            let profiled = if stopped.is_none() { self.profile } else { 0 };
            let mut runs = Vec::new();
            for _ in 0..profiled {
                match trainer.step_timed().await {
                    Ok((r, Some(t))) => {
                        loss = r.loss;
                        runs.push(t);
                    }
                    Ok((_, None)) => break,
                    Err(e @ Error::Diverged { .. }) => {
                        stopped = Some(e.to_string());
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
            let launches = trainer.launches();
            let profile = match runs.is_empty() {
                true => None,
                false => {
                    let limits = Limits::measure(backend, trainer.plan()).await;
                    StepProfile::of(trainer.plan(), &runs, launches.as_deref(), limits)
                }
            };
            timed.sort_by(f64::total_cmp);
            let median = timed.get(timed.len() / 2).copied().unwrap_or(f64::NAN);
            let tokens = trainer.tokens_per_step();
            let record = TrainRecord {
                backend: backend.name(),
                device: backend.device_name(),
                preset: preset.to_string(),
                config: self.config.clone(),
                parameters: self.config.parameter_count(),
                executor: trainer.executor(),
                attention: if trainer.fused_attention() {
                    "fused"
                } else {
                    "unfused"
                }
                .into(),
                attention_choice: trainer.run.attention.clone(),
                graphs_choice: trainer.run.graphs.clone(),
                coded_tensors: trainer.coded_tensors(),
                tokens_per_step: tokens,
                first_step_seconds: first,
                step_seconds: median,
                step_seconds_range: (
                    timed.first().copied().unwrap_or(f64::NAN),
                    timed.last().copied().unwrap_or(f64::NAN),
                ),
                steps_timed: timed.len(),
                tokens_per_second: tokens as f64 / median,
                memory: trainer.memory(),
                micro_batches: self.grad_accum,
                work: StepWork::of(trainer.plan(), launches.as_deref(), self.grad_accum),
                loss,
                stopped,
                profile,
            };
            each(&record);
            out.push(record);
        }
        Ok(out)
    }
}
