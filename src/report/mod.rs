//! The precision portability report: every algorithm on every backend present, side by side.
//!
//! For each backend: the precision-class resolution; cast, split and amax agreement with the
//! reference (bit for bit, mismatches counted); for each algorithm and input family, the error
//! against an f64 product, where non-finite values went, contract breaks against the
//! reference's result of the same algorithm (element by element, and the whole product against
//! its band), and throughput. `Report::passed` is false when any backend breaks the contract,
//! or when a backend named explicitly was not checked (absent, or failed to open):
//! `Report::failures` says why in words.

mod html;
mod inputs;

pub use html::{LossCurve, loss_chart, render_html};
pub use inputs::Family;

use crate::algorithm::{Algorithm, MatmulShape, Scaling};
use crate::backend::{self, Backend, BackendKind, Operands, Reference};
use crate::error::{Error, Result};
use crate::format::{self, Format, Overflow};
use crate::measure;
use crate::policy::{PrecisionClass, Preset};
use crate::train::{Corpus, GptConfig, TrainOptions, Trainer};

/// A backend in the report, or why it is absent.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BackendEntry {
    /// Its short name (`Backend::name`).
    pub name: String,
    /// The device in words.
    pub device: String,
    /// Its kind ("reference", "wgpu", "cuda").
    pub kind: String,
    /// (class, algorithm) pairs: what highest/high/medium resolve to here.
    pub precision_classes: Vec<(String, String)>,
}

/// A backend the report did not check, and why.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Skipped {
    /// The backend's name (or kind, where no adapter was found).
    pub backend: String,
    /// Why it was absent or failed to open.
    pub reason: String,
}

/// Bit-level agreement of one cast-like op with the reference.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CastCheck {
    /// The backend's name.
    pub backend: String,
    /// "encode bf16", "encode e4m3 (saturating)", "decode f16", "split bf16", "amax".
    pub op: String,
    /// Values compared.
    pub values: usize,
    /// Values whose bits differ from the reference's (or missing).
    pub mismatches: usize,
    /// The first mismatch in words (input, got, want).
    pub first_mismatch: Option<String>,
}

/// One matmul measurement.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MatmulCheck {
    /// The backend's name.
    pub backend: String,
    /// The algorithm's name.
    pub algorithm: String,
    /// The input family's name.
    pub family: String,
    /// (m, n, k).
    pub shape: (usize, usize, usize),
    /// Relative Frobenius error against the f64 product (over entries where it is finite).
    pub relative_error: f64,
    /// Largest error in f32 ulps (`measure::max_ulp_error`).
    pub max_ulp_error: f64,
    /// Non-finite outputs of this backend and of the reference.
    pub nonfinite: usize,
    /// Non-finite outputs of the reference.
    pub nonfinite_reference: usize,
    /// Elements outside the contract (non-finite pattern or accumulation tolerance).
    pub contract_breaks: usize,
    /// The first break in words.
    pub first_break: Option<String>,
    /// The whole product against its band (`measure::WholeProduct`); outside it is a break
    /// even where every element is within its tolerance.
    pub whole_product: measure::WholeProduct,
    /// Throughput on the largest N(0,1) shape (None elsewhere).
    pub tflops: Option<f64>,
}

/// A short training run of the tiny GPT under one preset on one backend.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TrainingLine {
    /// The backend's name.
    pub backend: String,
    /// The preset's name.
    pub preset: String,
    /// The algorithm its matmuls resolved to.
    pub matmul_algorithm: String,
    /// Training loss per step.
    pub losses: Vec<f64>,
    /// The last step's loss; None where the run stopped early.
    pub final_loss: Option<f64>,
    /// Why the run stopped early, if it did (16-true's NaN, for example).
    pub stopped: Option<String>,
}

/// The whole report, as `mantissa report` writes it (JSON, and HTML through `render_html`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    /// The crate's version that wrote it.
    pub version: &'static str,
    /// The seed of every random input.
    pub seed: u64,
    /// The matmul shapes (m, n, k).
    pub shapes: Vec<(usize, usize, usize)>,
    /// The input families' names.
    pub families: Vec<String>,
    /// The backends checked.
    pub backends: Vec<BackendEntry>,
    /// The backends absent or failed to open, with why.
    pub skipped: Vec<Skipped>,
    /// Cast, split and amax agreement, per backend and op.
    pub casts: Vec<CastCheck>,
    /// Every matmul check, per backend, algorithm, family and shape.
    pub matmuls: Vec<MatmulCheck>,
    /// The training-level comparison: tiny GPT, the same steps per preset per backend.
    pub training: Vec<TrainingLine>,
    /// Why training lines are missing, if they are.
    pub training_note: Option<String>,
    /// Elements, casts and whole products outside the contract.
    pub contract_breaks: usize,
    /// Why the report did not pass, in words (breaks, backends named but not checked); empty
    /// when it passed.
    pub failures: Vec<String>,
    /// Whether every backend kept the contract and every backend named was checked.
    pub passed: bool,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct ReportConfig {
    /// Backend kinds to include; wgpu means every adapter found.
    pub kinds: Vec<BackendKind>,
    /// Whether a backend of `kinds` that is absent (or fails to open) is skipped with its
    /// reason (`--backends all`); otherwise it fails the report, which checked nothing there.
    pub skip_absent: bool,
    /// The matmul shapes (m, n, k).
    pub shapes: Vec<(usize, usize, usize)>,
    /// The algorithms to check.
    pub algorithms: Vec<Algorithm>,
    /// The input families.
    pub families: Vec<Family>,
    /// The seed of every random input.
    pub seed: u64,
    /// Timed repetitions of the throughput measurement.
    pub repetitions: usize,
    /// Steps of the tiny GPT per preset per backend (0: no training lines).
    pub train_steps: u32,
    /// The presets of the training lines.
    pub train_presets: Vec<Preset>,
    /// The corpus the training lines train on (a text file).
    pub corpus: std::path::PathBuf,
}

impl ReportConfig {
    /// Every algorithm, with both current scalings for fp8.
    pub fn default_algorithms() -> Vec<Algorithm> {
        let mut v = Algorithm::ALL.to_vec();
        v.push(Algorithm::fp8(Format::E4m3, Format::E4m3).with_scaling(Scaling::Rowwise));
        v.push(Algorithm::fp8(Format::E4m3, Format::E5m2).with_scaling(Scaling::Rowwise));
        v
    }
}

/// Opens every backend of the requested kinds: the reference, every wgpu adapter, CUDA.
async fn open_backends(kinds: &[BackendKind]) -> (Vec<Box<dyn Backend>>, Vec<Skipped>) {
    let mut present: Vec<Box<dyn Backend>> = Vec::new();
    let mut skipped = Vec::new();
    for kind in kinds {
        match kind {
            BackendKind::Reference => present.push(Box::new(Reference)),
            BackendKind::Wgpu => {
                let adapters = backend::wgpu::list_adapters().await;
                if adapters.is_empty() {
                    skipped.push(Skipped {
                        backend: "wgpu".into(),
                        reason: "no adapter found".into(),
                    });
                }
                let options = match backend::wgpu::WgpuOptions::from_env() {
                    Ok(o) => o,
                    Err(e) => {
                        skipped.push(Skipped {
                            backend: "wgpu".into(),
                            reason: e.to_string(),
                        });
                        continue;
                    }
                };
                for (i, a) in adapters.iter().enumerate() {
                    match backend::wgpu::WgpuBackend::open_nth(i, options).await {
                        Ok(b) => present.push(Box::new(b)),
                        Err(e) => skipped.push(Skipped {
                            backend: format!("wgpu:{}", a.name),
                            reason: e.to_string(),
                        }),
                    }
                }
            }
            BackendKind::Cuda => {
                match backend::open(backend::BackendChoice::Only(BackendKind::Cuda)).await {
                    Ok(b) => present.push(b),
                    Err(e) => skipped.push(Skipped {
                        backend: "cuda".into(),
                        reason: e.to_string(),
                    }),
                }
            }
        }
    }
    (present, skipped)
}

/// Runs the report on the backends of `config.kinds` found here. `progress` receives a line
/// per step.
pub async fn run(config: &ReportConfig, progress: impl FnMut(&str)) -> Result<Report> {
    let (backends, skipped) = open_backends(&config.kinds).await;
    let backends: Vec<&dyn Backend> = backends.iter().map(|b| b.as_ref()).collect();
    run_on(&backends, skipped, config, progress).await
}

/// Runs the report on the given backends (the reference result is always the host module's).
pub async fn run_on(
    backends: &[&dyn Backend],
    skipped: Vec<Skipped>,
    config: &ReportConfig,
    mut progress: impl FnMut(&str),
) -> Result<Report> {
    for s in &skipped {
        progress(&format!("skipped {}: {}", s.backend, s.reason));
    }
    // The training text is read before any work: a missing one is an error, not missing lines.
    let corpus = if config.train_steps > 0 && !config.train_presets.is_empty() {
        Some(Corpus::load(&config.corpus)?)
    } else {
        None
    };
    let mut report = Report {
        version: env!("CARGO_PKG_VERSION"),
        seed: config.seed,
        shapes: config.shapes.clone(),
        families: config
            .families
            .iter()
            .map(|f| f.name().to_string())
            .collect(),
        backends: backends
            .iter()
            .map(|b| BackendEntry {
                name: b.name(),
                device: b.device_name(),
                kind: b.kind().to_string(),
                precision_classes: PrecisionClass::ALL
                    .iter()
                    .map(|c| (c.to_string(), c.resolve(&b.capabilities()).to_string()))
                    .collect(),
            })
            .collect(),
        skipped,
        casts: vec![],
        matmuls: vec![],
        training: vec![],
        training_note: None,
        contract_breaks: 0,
        failures: vec![],
        passed: false,
    };
    for b in backends {
        if b.kind() != BackendKind::Reference {
            progress(&format!("casts on {}", b.name()));
            report.casts.extend(cast_checks(*b, config.seed).await?);
        }
    }
    let largest = config
        .shapes
        .iter()
        .copied()
        .max_by_key(|(m, n, k)| m * n * k);
    for (s, &(m, n, k)) in config.shapes.iter().enumerate() {
        let shape = MatmulShape::new(m, n, k);
        for family in &config.families {
            let seed = config
                .seed
                .wrapping_add(1000 * s as u64 + 10 * *family as u64);
            let (a, bm) = family.inputs(&shape, seed);
            let magnitudes = measure::magnitudes(&shape, &a, &bm)?;
            for algorithm in &config.algorithms {
                let want = backend::reference::matmul(&shape, algorithm, &a, &bm)?;
                for b in backends {
                    progress(&format!(
                        "{} {algorithm} {} {m}x{n}x{k}",
                        b.name(),
                        family.name()
                    ));
                    let got = b.matmul(&shape, algorithm, &a, &bm).await?;
                    let (breaks, count) = measure::compare_to_reference(
                        algorithm,
                        &shape,
                        &got,
                        &want,
                        &magnitudes.abs,
                    );
                    let whole_product =
                        measure::whole_product(algorithm, shape.k, &got, &want, &magnitudes);
                    let tflops = if *family == Family::Normal && Some((m, n, k)) == largest {
                        let t = b
                            .time_matmul(
                                &shape,
                                algorithm,
                                &a,
                                &bm,
                                config.repetitions,
                                Operands::F32,
                            )
                            .await?;
                        Some(shape.flops() / t.seconds / 1e12)
                    } else {
                        None
                    };
                    report.matmuls.push(MatmulCheck {
                        backend: b.name(),
                        algorithm: algorithm.to_string(),
                        family: family.name().to_string(),
                        shape: (m, n, k),
                        relative_error: whole_product.relative_error,
                        max_ulp_error: measure::max_ulp_error(&got, &magnitudes.exact),
                        nonfinite: got.iter().filter(|v| !v.is_finite()).count(),
                        nonfinite_reference: want.iter().filter(|v| !v.is_finite()).count(),
                        contract_breaks: count,
                        first_break: breaks.first().map(|m| m.to_string()),
                        whole_product,
                        tflops,
                    });
                }
            }
        }
    }
    if let Some(corpus) = &corpus {
        for b in backends {
            for &preset in &config.train_presets {
                progress(&format!(
                    "training {preset} on {} for {} steps",
                    b.name(),
                    config.train_steps
                ));
                report
                    .training
                    .push(train_line(*b, corpus, preset, config).await?);
            }
        }
    } else {
        report.training_note = Some("training lines not requested (--train-steps 0)".into());
    }
    let whole_breaks = report
        .matmuls
        .iter()
        .filter(|m| !m.whole_product.holds())
        .count();
    let element_breaks: usize = report.matmuls.iter().map(|m| m.contract_breaks).sum();
    let cast_breaks: usize = report.casts.iter().map(|c| c.mismatches).sum();
    report.contract_breaks = cast_breaks + element_breaks + whole_breaks;
    if report.contract_breaks > 0 {
        report.failures.push(format!(
            "{} contract break(s): {cast_breaks} cast value(s), {element_breaks} matmul element(s), \
             {whole_breaks} whole product(s) outside their band",
            report.contract_breaks
        ));
    }
    if !config.skip_absent {
        for s in &report.skipped {
            report.failures.push(format!(
                "{} was named but not checked: {}",
                s.backend, s.reason
            ));
        }
    }
    if backends.is_empty() {
        report.failures.push("no backend was checked".into());
    }
    report.passed = report.failures.is_empty();
    Ok(report)
}

/// Values for the cast checks: every boundary of every format, random bit patterns, wide range.
fn cast_values(seed: u64) -> Vec<f32> {
    let mut v = measure::boundary_values();
    v.extend(measure::random_bits(20_000, seed));
    v.extend(measure::wide_range(5_000, seed + 1));
    v
}

fn count_mismatches<T: Copy>(
    backend: &dyn Backend,
    op: String,
    inputs: &[T],
    got: &[u32],
    want: &[u32],
    same: impl Fn(u32, u32) -> bool,
    show: impl Fn(T) -> String,
) -> CastCheck {
    let mut first = None;
    let mut mismatches = got.len().abs_diff(want.len());
    for ((x, &g), &w) in inputs.iter().zip(got).zip(want) {
        if !same(g, w) {
            mismatches += 1;
            first.get_or_insert_with(|| format!("{} -> {g:#x}, reference {w:#x}", show(*x)));
        }
    }
    CastCheck {
        backend: backend.name(),
        op,
        values: inputs.len(),
        mismatches,
        first_mismatch: first,
    }
}

/// Every cast, decode, split and amax of `b` against the host formats, on boundary values
/// and random bit patterns.
pub async fn cast_checks(b: &dyn Backend, seed: u64) -> Result<Vec<CastCheck>> {
    let values = cast_values(seed);
    let show = |x: f32| format!("{x:e} ({:#010x})", x.to_bits());
    let mut out = Vec::new();
    for format in Format::ALL {
        for overflow in [Overflow::Standard, Overflow::Saturate] {
            let got = b.encode(format, overflow, &values).await?;
            let want: Vec<u32> = values.iter().map(|&x| format.encode(x, overflow)).collect();
            let op = format!(
                "encode {format}{}",
                if overflow == Overflow::Saturate {
                    " (saturating)"
                } else {
                    ""
                }
            );
            out.push(count_mismatches(
                b,
                op,
                &values,
                &got,
                &want,
                |g, w| measure::same_code(format, g, w),
                show,
            ));
        }
    }
    for format in [Format::Bf16, Format::F16, Format::E4m3, Format::E5m2] {
        let codes: Vec<u32> = (0..1u32 << format.storage_bits()).collect();
        let got: Vec<u32> = b
            .decode(format, &codes)
            .await?
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let want: Vec<u32> = codes.iter().map(|&c| format.decode(c).to_bits()).collect();
        let same =
            |g: u32, w: u32| g == w || (f32::from_bits(g).is_nan() && f32::from_bits(w).is_nan());
        out.push(count_mismatches(
            b,
            format!("decode {format}"),
            &codes,
            &got,
            &want,
            same,
            |c| format!("{c:#x}"),
        ));
    }
    let planes = b.split_bf16(&values).await?;
    for (p, name) in ["h", "m", "l"].iter().enumerate() {
        let want: Vec<u32> = values
            .iter()
            .map(|&x| Format::Bf16.encode(format::split_bf16(x)[p], Overflow::Standard))
            .collect();
        let op = format!("split bf16 ({name})");
        out.push(count_mismatches(
            b,
            op,
            &values,
            &planes[p],
            &want,
            |g, w| measure::same_code(Format::Bf16, g, w),
            show,
        ));
    }
    let got = b.amax(&values).await?;
    let want = format::amax(values.iter().copied());
    out.push(CastCheck {
        backend: b.name(),
        op: "amax".into(),
        values: values.len(),
        mismatches: (got.to_bits() != want.to_bits()) as usize,
        first_mismatch: (got.to_bits() != want.to_bits())
            .then(|| format!("{got:e}, reference {want:e}")),
    });
    Ok(out)
}

/// Trains the tiny GPT for `config.train_steps` steps under `preset` on `backend`.
async fn train_line(
    backend: &dyn Backend,
    corpus: &Corpus,
    preset: Preset,
    config: &ReportConfig,
) -> Result<TrainingLine> {
    let options = TrainOptions::new(
        GptConfig::named("tiny", corpus.vocab.len())?,
        preset,
        config.seed,
    );
    let mut trainer = Trainer::new(backend, corpus, options)?;
    let mut line = TrainingLine {
        backend: backend.name(),
        preset: preset.to_string(),
        matmul_algorithm: trainer.run.precision.matmul.to_string(),
        losses: vec![],
        final_loss: None,
        stopped: None,
    };
    for _ in 0..config.train_steps {
        match trainer.step().await {
            Ok(r) => line.losses.push(r.loss),
            // A diverged preset is a finding; a device fault is not.
            Err(e @ Error::Diverged { .. }) => {
                line.stopped = Some(e.to_string());
                break;
            }
            Err(e) => return Err(e),
        }
    }
    if line.stopped.is_none() {
        line.final_loss = line.losses.last().copied();
    }
    Ok(line)
}
