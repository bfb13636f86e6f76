//! `mantissa matmul A.npy B.npy --algorithm NAME [--backend B] [-o C.npy] [--check]`

use crate::algorithm::{Algorithm, MatmulShape};
use crate::backend::{self, BackendChoice};
use crate::error::Result;
use crate::measure;
use crate::npy::{Matrix, read_matrix, write_matrix};
use pollster::FutureExt as _;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
#[command(
    after_help = "Example:\n  mantissa matmul a.npy b.npy --algorithm bf16x3 --backend wgpu --check -o c.npy"
)]
pub struct Args {
    /// Left operand: a 2-D float32 .npy file (C or Fortran order).
    a: PathBuf,
    /// Right operand: a 2-D float32 .npy file.
    b: PathBuf,
    /// Algorithm: f32 tf32 bf16 f16 bf16x3 bf16x6 bf16x9 e4m3 e5m2 e4m3-e5m2 e5m2-e4m3
    /// (fp8 may add :tensorwise, :rowwise or :given=SA,SB).
    #[arg(long, default_value = "f32")]
    algorithm: String,
    /// auto, reference or wgpu.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Write C here as float32 .npy (written atomically).
    #[arg(long, short = 'o')]
    output: Option<PathBuf>,
    /// Print the relative error against an f64 product of the inputs, and check the result
    /// against the host reference's result of the same algorithm.
    #[arg(long)]
    check: bool,
}

pub fn run(args: Args) -> Result<()> {
    let algorithm: Algorithm = args.algorithm.parse()?;
    let choice: BackendChoice = args.backend.parse()?;
    let a = read_matrix(&args.a)?;
    let b = read_matrix(&args.b)?;
    let shape = MatmulShape::from_operands((a.rows, a.cols), (b.rows, b.cols))?;
    let backend = backend::open(choice).block_on()?;
    let start = Instant::now();
    let c = backend
        .matmul(&shape, &algorithm, &a.data, &b.data)
        .block_on()?;
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "C = A . B: {}x{} . {}x{} -> {}x{}  algorithm {}  backend {}  {:.3} ms ({:.2} GFLOP/s, upload and readback included)",
        a.rows,
        a.cols,
        b.rows,
        b.cols,
        shape.m,
        shape.n,
        algorithm,
        backend.name(),
        seconds * 1e3,
        shape.flops() / seconds / 1e9
    );
    // A contract break still writes the result (it is what the user asked to inspect).
    let mut broken = None;
    if args.check {
        let exact = measure::exact_product(&shape, &a.data, &b.data);
        let (lo, hi) = algorithm.expected_error_n01();
        println!(
            "relative error vs f64 product: {:.3e}  (max {:.1} ulp; {} on N(0,1) inputs: {:.1e}..{:.1e})",
            measure::relative_error(&c, &exact),
            measure::max_ulp_error(&c, &exact),
            algorithm,
            lo,
            hi
        );
        let want = backend::reference::matmul(&shape, &algorithm, &a.data, &b.data);
        let abs = measure::abs_product(&shape, &a.data, &b.data);
        let (mismatches, count) =
            measure::compare_to_reference(&algorithm, &shape, &c, &want, &abs);
        if count == 0 {
            println!(
                "contract: OK (matches the reference {algorithm} within its accumulation tolerance)"
            );
        } else {
            for m in &mismatches {
                println!("  {m}");
            }
            broken = Some(crate::Error::ContractBreak {
                algorithm: algorithm.to_string(),
                count,
            });
        }
    }
    if let Some(path) = &args.output {
        write_matrix(path, &Matrix::new(shape.m, shape.n, c)?)?;
        println!("wrote {}", path.display());
    }
    broken.map_or(Ok(()), Err)
}
