//! `mantissa info | finfo | cast | matmul | bench`: the tools people use daily.

mod bench;
mod cast;
mod finfo;
mod info;
mod matmul;
mod report;
pub mod table;
mod train;

use crate::error::{Error, ErrorClass};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "mantissa",
    version,
    about = "Portable mixed-precision compute: the same precision-controlled math on any GPU",
    long_about = "Portable mixed-precision compute: the same precision-controlled math on any GPU.\n\n\
                  Formats: f32, tf32, bf16, f16, e4m3, e5m2. Matmul algorithms: f32, tf32, bf16, f16, \
                  bf16x3, bf16x6, bf16x9, e4m3, e5m2, e4m3-e5m2, e5m2-e4m3 (fp8 take :tensorwise, \
                  :rowwise or :given=SA,SB).\n\nBackends: reference (host, f64 accumulation, the truth \
                  every backend is tested against) and wgpu (WGSL on any Vulkan/Metal/DX12 GPU, or the \
                  lavapipe software GPU). MANTISSA_BACKEND overrides --backend auto."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Version, backends, GPU adapters with their features and limits, and which algorithm each
    /// precision class (highest/high/medium) resolves to on each.
    Info(info::Args),
    /// The limits of number formats, as torch.finfo reports them.
    Finfo(finfo::Args),
    /// Shows how values are encoded in each format, or converts raw binary data (--raw).
    Cast(cast::Args),
    /// Multiplies two float32 .npy matrices with a named algorithm.
    Matmul(matmul::Args),
    /// Measures matmul throughput and error per backend, algorithm and size.
    Bench(bench::Args),
    /// Every algorithm on every backend present, side by side: errors, non-finite handling,
    /// bit-exact casts, throughput. Writes report.json and report.html; exits 3 if any backend
    /// breaks the numerics contract.
    Report(report::Args),
    /// Trains the char-level GPT under one or more precision presets; writes a JSON log, a
    /// loss chart (SVG) and safetensors checkpoints.
    Train(Box<train::TrainArgs>),
    /// Generates text from a checkpoint written by `mantissa train`.
    Sample(train::SampleArgs),
}

/// Exit code: a result outside the numerics contract (`report`, `matmul --check`).
pub const EXIT_CONTRACT: i32 = 3;
/// Exit code: a `train` run of one preset stopped (non-finite loss or gradients).
pub const EXIT_STOPPED: i32 = 4;

/// Runs the tool and returns the process exit code: 0 on success, 1 for failures of the
/// machine (no device, device errors, out of memory, files that cannot be written), 2 for bad
/// input (unknown names, malformed files, mismatched shapes, out-of-range arguments),
/// `EXIT_CONTRACT` (3) when a result breaks the numerics contract, `EXIT_STOPPED` (4) when a
/// one-preset training run stops. README.md lists them.
pub fn main() -> i32 {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info(a) => info::run(a).map(|_| 0),
        Command::Finfo(a) => finfo::run(a).map(|_| 0),
        Command::Cast(a) => cast::run(a).map(|_| 0),
        Command::Matmul(a) => matmul::run(a).map(|_| 0),
        Command::Bench(a) => bench::run(a).map(|_| 0),
        Command::Report(a) => report::run(a),
        Command::Train(a) => train::train(*a),
        Command::Sample(a) => train::sample(a).map(|_| 0),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("mantissa: error: {e}");
            exit_code(&e)
        }
    }
}

pub(crate) fn exit_code(e: &Error) -> i32 {
    match e.class() {
        ErrorClass::Machine => 1,
        ErrorClass::BadInput => 2,
        ErrorClass::ContractBreak => EXIT_CONTRACT,
        ErrorClass::Diverged => EXIT_STOPPED,
    }
}

/// Splits a comma-separated list and parses each item.
pub(crate) fn parse_list<T: std::str::FromStr<Err = Error>>(s: &str) -> Result<Vec<T>, Error> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::parse)
        .collect()
}
