//! What the examples share: their command line (`--backend`, `--precision`, `--steps`,
//! `--seed`), the backend it opens, and the process exit code of an error (the CLI's: 1 for
//! the machine, 2 for bad input).

use mantissa::backend::{self, Backend, BackendChoice};
use mantissa::policy::precision::PrecisionRequest;
use mantissa::{Preset, Result};

/// An example's command line.
#[derive(clap::Parser, Debug)]
pub struct Args {
    /// auto (CUDA where present, else the best wgpu adapter), reference, wgpu or cuda.
    #[arg(long, default_value = "auto")]
    pub backend: BackendChoice,
    /// A precision preset: 32-true, bf16-mixed, 16-mixed, bf16-true, 16-true,
    /// transformer-engine.
    #[arg(long, default_value = "32-true")]
    pub precision: Preset,
    /// Training steps (the example's own number where not given).
    #[arg(long)]
    pub steps: Option<u32>,
    /// Seeds the data and the parameters' initial values.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

impl Args {
    /// The precision the example asks for: its preset, the defaults for everything else.
    pub fn request(&self) -> PrecisionRequest<'static> {
        PrecisionRequest::of(self.precision)
    }
}

/// Parses the command line, opens its backend and runs `example` there; an error is printed
/// and ends the process with the CLI's exit code.
pub fn main(example: impl FnOnce(&Args, &dyn Backend) -> Result<()>) {
    use clap::Parser;
    let args = Args::parse();
    let ran = pollster::block_on(backend::open(args.backend)).and_then(|b| {
        eprintln!(
            "{} on {}, {}",
            env!("CARGO_CRATE_NAME"),
            b.device_name(),
            args.precision
        );
        example(&args, b.as_ref())
    });
    if let Err(e) = ran {
        eprintln!("error: {e}");
        std::process::exit(mantissa::cli::exit_code(&e));
    }
}

/// The corpus the language-model examples train on (data/shakespeare.txt of the repository).
#[allow(dead_code)]
pub fn corpus() -> Result<mantissa::train::Corpus> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/shakespeare.txt");
    mantissa::train::Corpus::load(&path)
}

/// Trains `t` on `steps` batches of `b` sequences of `t_len` tokens from `corpus`, printing the
/// loss now and then, and the validation loss before and after.
#[allow(dead_code)]
pub fn train_on_corpus(
    t: &mut mantissa::model::ModelTrainer,
    corpus: &mantissa::train::Corpus,
    (b, t_len): (usize, usize),
    steps: u32,
    seed: u64,
) -> Result<()> {
    let val = |t: &mut mantissa::model::ModelTrainer| -> Result<f64> {
        let (ids, targets) = corpus.batch(true, b, t_len, seed, 0)?;
        pollster::block_on(t.loss(&ids, &targets))
    };
    let before = val(t)?;
    let start = std::time::Instant::now();
    for step in 1..=steps {
        let (ids, targets) = corpus.batch(false, b, t_len, seed, step as u64)?;
        let s = pollster::block_on(t.step(&ids, &targets))?;
        if step % 50 == 0 || step == steps {
            println!(
                "step {step:4}  loss {:.4}{}",
                s.loss,
                if s.skipped { "  (skipped)" } else { "" }
            );
        }
    }
    println!(
        "validation loss {before:.4} -> {:.4} ({steps} steps in {:.1} s)",
        val(t)?,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
