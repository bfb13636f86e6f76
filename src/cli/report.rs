//! `mantissa report [--backends all|LIST] [--sizes ..] [--out DIR]`

use super::parse_list;
use super::table::Table;
use crate::algorithm::Algorithm;
use crate::backend::BackendKind;
use crate::error::{Error, Result};
use crate::report::{self, Family, ReportConfig};
use pollster::FutureExt as _;
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(
    after_help = "Exit status: 0 when every backend named was checked and keeps the contract; 3 when \
    any breaks it, or a backend named in --backends is absent or failed to open (--backends all \
    skips those, saying why).\n\n\
    Example:\n  mantissa report --backends reference,wgpu --sizes 64,200 --out report"
)]
pub struct Args {
    /// Backends: all, or a list of reference, wgpu (every adapter), cuda.
    #[arg(long, default_value = "all")]
    backends: String,
    /// Matmul sizes: N (square) or MxNxK, comma-separated.
    #[arg(long, default_value = "64,131x67x200")]
    sizes: String,
    /// Algorithms, comma-separated, or "all" (fp8 with tensorwise and rowwise scaling).
    #[arg(long, default_value = "all")]
    algorithms: String,
    /// Input families: all, or a list of normal, wide-range, cancellation, extremes, non-finite.
    #[arg(long, default_value = "all")]
    families: String,
    /// Where report.json and report.html go.
    #[arg(long, default_value = "report")]
    out: PathBuf,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 2026)]
    seed: u64,
    /// Timed repetitions for throughput.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Steps of the tiny GPT per preset per backend for the training lines (0: none).
    #[arg(long, default_value_t = 30)]
    train_steps: u32,
    /// Presets of the training lines.
    #[arg(long, default_value = "32-true,bf16-mixed,16-mixed")]
    train_presets: String,
    /// The training text.
    #[arg(long, default_value = "data/shakespeare.txt")]
    corpus: PathBuf,
}

pub fn run(args: Args) -> Result<i32> {
    // `all` skips the kinds absent here (with the reason); a kind named is required.
    let skip_absent = args.backends.trim() == "all";
    let kinds: Vec<BackendKind> = if skip_absent {
        BackendKind::ALL.to_vec()
    } else {
        parse_list("--backends", &args.backends).map_err(|e| match e {
            Error::UnknownName { kind, given, valid } => Error::UnknownName {
                kind,
                given,
                valid: std::iter::once("all".to_string()).chain(valid).collect(),
            },
            e => e,
        })?
    };
    let algorithms: Vec<Algorithm> = if args.algorithms.trim() == "all" {
        ReportConfig::default_algorithms()
    } else {
        parse_list("--algorithms", &args.algorithms)?
    };
    let families: Vec<Family> = if args.families.trim() == "all" {
        Family::ALL.to_vec()
    } else {
        super::parse_list_with("--families", &args.families, Family::parse)?
    };
    let shapes = super::bench::parse_shapes(&args.sizes)?;
    let train_presets = parse_list("--train-presets", &args.train_presets)?;
    let config = ReportConfig {
        kinds,
        skip_absent,
        shapes,
        algorithms,
        families,
        seed: args.seed,
        repetitions: super::check_reps(args.reps)?,
        train_steps: args.train_steps,
        train_presets,
        corpus: args.corpus.clone(),
    };
    let json_path = args.out.join("report.json");
    let html_path = args.out.join("report.html");
    // Where the report goes is checked before it runs.
    std::fs::create_dir_all(&args.out).map_err(|e| Error::output(&args.out, e))?;
    crate::output::check_writable(&json_path)?;
    crate::output::check_writable(&html_path)?;
    let report = report::run(&config, |line| eprintln!("  {line}")).block_on()?;

    let mut t = Table::new(&["backend", "highest", "high", "medium", "device"]);
    for b in &report.backends {
        let c = |i: usize| {
            b.precision_classes
                .get(i)
                .map(|c| c.1.clone())
                .unwrap_or_default()
        };
        t.row(vec![b.name.clone(), c(0), c(1), c(2), b.device.clone()]);
    }
    for s in &report.skipped {
        t.row(vec![
            s.backend.clone(),
            "-".into(),
            "-".into(),
            "-".into(),
            format!("skipped: {}", s.reason),
        ]);
    }
    say!("{}", t.render())?;

    let mut t = Table::new(&["backend", "casts checked", "values", "mismatches"]);
    for b in &report.backends {
        let checks: Vec<_> = report
            .casts
            .iter()
            .filter(|c| c.backend == b.name)
            .collect();
        if !checks.is_empty() {
            let values: usize = checks.iter().map(|c| c.values).sum();
            let bad: usize = checks.iter().map(|c| c.mismatches).sum();
            t.row(vec![
                b.name.clone(),
                checks.len().to_string(),
                values.to_string(),
                bad.to_string(),
            ]);
        }
    }
    say!("{}", t.render())?;

    // Relative error per algorithm (rows) and backend x family (columns), largest shape.
    let largest = report
        .shapes
        .iter()
        .copied()
        .max_by_key(|(m, n, k)| m * n * k);
    let mut header = vec!["algorithm".to_string()];
    let mut columns = Vec::new();
    for b in &report.backends {
        for f in &report.families {
            header.push(format!("{} {f}", short(&b.name)));
            columns.push((b.name.clone(), f.clone()));
        }
    }
    let mut t = Table::new(&header.iter().map(String::as_str).collect::<Vec<_>>());
    let mut seen = Vec::new();
    for m in &report.matmuls {
        if seen.contains(&m.algorithm) {
            continue;
        }
        seen.push(m.algorithm.clone());
        let mut row = vec![m.algorithm.clone()];
        for (b, f) in &columns {
            let cell = report
                .matmuls
                .iter()
                .find(|r| {
                    &r.backend == b
                        && &r.family == f
                        && r.algorithm == m.algorithm
                        && Some(r.shape) == largest
                })
                .map(|r| {
                    let broken = r.contract_breaks > 0 || !r.whole_product.holds();
                    format!(
                        "{:.1e}{}",
                        r.relative_error,
                        if broken { " BREAK" } else { "" }
                    )
                })
                .unwrap_or_default();
            row.push(cell);
        }
        t.row(row);
    }
    if let Some((m, n, k)) = largest {
        say!(
            "relative error vs f64 product at {m}x{n}x{k} (BREAK: outside the contract against the reference)"
        )?;
    }
    say!("{}", t.render())?;
    if let Some(note) = &report.training_note {
        say!("training: {note}")?;
    }
    if !report.training.is_empty() {
        let mut t = Table::new(&[
            "preset",
            "backend",
            "matmuls",
            "steps",
            "final loss",
            "stopped",
        ]);
        for l in &report.training {
            t.row(vec![
                l.preset.clone(),
                short(&l.backend),
                l.matmul_algorithm.clone(),
                l.losses.len().to_string(),
                l.final_loss
                    .map(|x| format!("{x:.4}"))
                    .unwrap_or_else(|| "-".into()),
                l.stopped.clone().unwrap_or_default(),
            ]);
        }
        say!("training: tiny GPT, final losses side by side")?;
        say!("{}", t.render())?;
    }

    let json =
        serde_json::to_string_pretty(&report).map_err(|e| Error::invalid("json", e.to_string()))?;
    crate::output::write_bytes(&json_path, json.as_bytes())?;
    crate::output::write_bytes(&html_path, report::render_html(&report).as_bytes())?;
    say!("wrote {} and {}", json_path.display(), html_path.display())?;
    if report.passed {
        say!("PASSED: every backend named was checked and keeps the numerics contract")?;
        return Ok(0);
    }
    for m in report
        .matmuls
        .iter()
        .filter(|m| m.contract_breaks > 0)
        .take(10)
    {
        say!(
            "  break: {} {} {} {}x{}x{}: {} element(s), e.g. {}",
            m.backend,
            m.algorithm,
            m.family,
            m.shape.0,
            m.shape.1,
            m.shape.2,
            m.contract_breaks,
            m.first_break.as_deref().unwrap_or("")
        )?;
    }
    for m in report
        .matmuls
        .iter()
        .filter(|m| !m.whole_product.holds())
        .take(10)
    {
        say!(
            "  break: {} {} {} {}x{}x{}: the whole product is outside its band: {}",
            m.backend,
            m.algorithm,
            m.family,
            m.shape.0,
            m.shape.1,
            m.shape.2,
            m.whole_product
        )?;
    }
    for c in report.casts.iter().filter(|c| c.mismatches > 0).take(10) {
        say!(
            "  break: {} {}: {} mismatch(es), e.g. {}",
            c.backend,
            c.op,
            c.mismatches,
            c.first_mismatch.as_deref().unwrap_or("")
        )?;
    }
    say!("FAILED: {}", report.failures.join("; "))?;
    Ok(super::EXIT_CONTRACT)
}

/// "wgpu:llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan)" -> "wgpu:llvmpipe".
fn short(name: &str) -> String {
    name.split(" (").next().unwrap_or(name).to_string()
}
