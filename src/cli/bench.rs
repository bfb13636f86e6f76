//! `mantissa bench matmul [--sizes ..] [--algorithms ..] [--backends ..] [--json FILE]`

use super::parse_list;
use super::table::{Table, g};
use crate::algorithm::{Algorithm, MatmulShape};
use crate::backend::{self, BackendChoice};
use crate::bench::{MatmulBench, MatmulRecord};
use crate::error::{Error, Result};
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
    /// Backends, comma-separated: auto, reference, wgpu.
    #[arg(long, default_value = "auto")]
    backends: String,
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

/// The shapes of a `--sizes` list, which must name at least one.
pub(crate) fn parse_shapes(list: &str) -> Result<Vec<(usize, usize, usize)>> {
    let shapes = list
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(parse_shape)
        .collect::<Result<Vec<_>>>()?;
    if shapes.is_empty() {
        return Err(Error::invalid("--sizes", "names no size"));
    }
    Ok(shapes)
}

pub fn run(args: Args) -> Result<()> {
    let What::Matmul(args) = args.what;
    let algorithms: Vec<Algorithm> = if args.algorithms.trim() == "all" {
        Algorithm::ALL.to_vec()
    } else {
        parse_list(&args.algorithms)?
    };
    let shapes = parse_shapes(&args.sizes)?;
    let choices: Vec<BackendChoice> = parse_list(&args.backends)?;
    let bench = MatmulBench {
        shapes,
        algorithms,
        repetitions: args.reps.max(1),
        error_rows: args.error_rows,
        seed: 42,
        contract_check_limit: 0,
    };
    let mut records: Vec<MatmulRecord> = Vec::new();
    let mut table = Table::new(&[
        "backend",
        "algorithm",
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
                        "  {:<12} {:>5}x{}x{}  {:>10.3} ms  {:>8.4} TFLOP/s  err {:.2e}",
                        r.algorithm,
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
    print!("{}", table.render());
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&records)
            .map_err(|e| Error::invalid("json", e.to_string()))?;
        crate::output::write_bytes(path, text.as_bytes())?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
