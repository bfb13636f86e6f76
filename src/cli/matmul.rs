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
    /// Left operand: a 2-D float32 .npy file (C or Fortran order); `-`: standard input.
    a: PathBuf,
    /// Right operand: a 2-D float32 .npy file; `-`: standard input.
    b: PathBuf,
    /// Algorithm: f32 tf32 bf16 f16 bf16x3 bf16x6 bf16x9 e4m3 e5m2 e4m3-e5m2 e5m2-e4m3
    /// (fp8 may add :tensorwise, :rowwise or :given=SA/SB).
    #[arg(long, default_value = "f32")]
    algorithm: String,
    /// auto, reference or wgpu.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Write C here as float32 .npy (written atomically; `-`: standard output).
    #[arg(long, short = 'o')]
    output: Option<PathBuf>,
    /// Print the relative error against an f64 product of the inputs, and check the result
    /// against the host reference's result of the same algorithm: element by element, and the
    /// whole product against its band (exit 3 outside either).
    #[arg(long)]
    check: bool,
}

pub fn run(args: Args) -> Result<()> {
    let algorithm: Algorithm = args.algorithm.parse()?;
    let choice: BackendChoice = args.backend.parse()?;
    if args.a.as_os_str() == "-" && args.b.as_os_str() == "-" {
        return Err(crate::Error::invalid(
            "arguments",
            "A and B cannot both be standard input",
        ));
    }
    // C written to standard output (`-o -`): the lines about it go to standard error.
    let to_stdout = args.output.as_ref().is_some_and(|p| p.as_os_str() == "-");
    let note = |line: String| {
        if to_stdout {
            eprintln!("{line}");
            Ok(())
        } else {
            say!("{line}")
        }
    };
    if let Some(path) = &args.output {
        crate::output::check_writable(path)?;
    }
    let a = read_matrix(&args.a)?;
    let b = read_matrix(&args.b)?;
    let shape = MatmulShape::from_operands((a.rows, a.cols), (b.rows, b.cols))?;
    // Every backend hands C back in host memory.
    let c_len = shape.checked_c_len()?;
    crate::memory::check("C", crate::memory::bytes_of::<f32>(c_len))?;
    let backend = backend::open(choice).block_on()?;
    let start = Instant::now();
    let c = backend
        .matmul(&shape, &algorithm, &a.data, &b.data)
        .block_on()?;
    let seconds = start.elapsed().as_secs_f64();
    note(format!(
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
    ))?;
    // A contract break still writes the result (it is what the user asked to inspect).
    let mut broken = None;
    if args.check {
        let want = backend::reference::matmul(&shape, &algorithm, &a.data, &b.data)?;
        let check = measure::check_product(&algorithm, &shape, (&a.data, &b.data), &c, &want)?;
        let whole = &check.whole;
        note(format!(
            "relative error vs f64 product: {:.3e}  (the reference {algorithm}: {:.3e}; band up to {:.3e})",
            whole.relative_error, whole.reference_error, whole.band
        ))?;
        if check.holds() {
            note(format!(
                "contract: OK (matches the reference {algorithm} element by element within its accumulation tolerance, and as a whole within its band)"
            ))?;
        } else {
            for line in check.findings() {
                note(format!("  {line}"))?;
            }
            broken = check.verdict(&algorithm).err();
        }
    }
    if let Some(path) = &args.output {
        write_matrix(path, &Matrix::new(shape.m, shape.n, c)?)?;
        note(format!("wrote {}", path.display()))?;
    }
    broken.map_or(Ok(()), Err)
}
