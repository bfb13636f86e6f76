//! `mantissa info | finfo | cast | matmul | bench`: the tools people use daily.

/// `println!` that returns an error instead of panicking: standard output that cannot be
/// written (a full disk, /dev/full) is `Error::Output`, exit 1. A closed pipe ends the process
/// quietly, as other Unix tools (`main` restores SIGPIPE's default).
macro_rules! say {
    () => {
        $crate::cli::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` as `say!` does it.
macro_rules! say_raw {
    ($($arg:tt)*) => {
        $crate::cli::write_stdout(format_args!($($arg)*))
    };
}

mod bench;
mod cast;
mod finfo;
mod info;
mod matmul;
mod report;
pub mod table;
mod train;

use crate::error::{Error, ErrorClass};
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

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
/// one-preset training run stops. docs/cli.md lists them.
pub fn main() -> i32 {
    // Rust ignores SIGPIPE, which turns `mantissa info | head -1` into a write error; the
    // default ends the process quietly when its reader is gone, as `cat` does.
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to its default, before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let command = Cli::command();
    let matches = command.clone().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // The flags given on the command line (arguments, not their groups), for the modes that
    // refuse those they do not use.
    if let (Command::Train(args), Some((name, sub))) = (&mut cli.command, matches.subcommand()) {
        let flags: Vec<String> = (command.find_subcommand(name).into_iter())
            .flat_map(|c| c.get_arguments().map(|a| a.get_id().to_string()))
            .collect();
        args.given = (sub.ids())
            .map(|id| id.to_string())
            .filter(|id| flags.contains(id))
            .filter(|id| sub.value_source(id) == Some(ValueSource::CommandLine))
            .collect();
    }
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
    // What is still buffered for standard output must reach it, or the run failed.
    let result = result.and_then(|code| {
        use std::io::Write;
        std::io::stdout()
            .flush()
            .map_err(|e| Error::output("standard output", e))?;
        Ok(code)
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("mantissa: error: {e}");
            exit_code(&e)
        }
    }
}

/// Set where standard output carries a command's data (an output named `-`): `say!` then
/// writes to standard error, so that nothing but the data reaches standard output.
static STDOUT_IS_DATA: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sends every message (`say!`) to standard error from now on: standard output is an output
/// (`-`) and carries its data alone.
pub(crate) fn messages_to_stderr() {
    STDOUT_IS_DATA.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Writes a message to standard output (`say!`), any failure as `Error::Output`; to standard
/// error where standard output carries data (`messages_to_stderr`).
pub(crate) fn write_stdout(args: std::fmt::Arguments) -> Result<(), Error> {
    use std::io::Write;
    if STDOUT_IS_DATA.load(std::sync::atomic::Ordering::Relaxed) {
        return std::io::stderr()
            .lock()
            .write_fmt(args)
            .map_err(|e| Error::output("standard error", e));
    }
    std::io::stdout()
        .lock()
        .write_fmt(args)
        .map_err(|e| Error::output("standard output", e))
}

/// The process exit code of an error: the one place that decides it (docs/cli.md's table). 1: the
/// machine (no device, device faults, out of memory, an output that cannot be written); 2: bad
/// input; 3: a result outside the contract; 4: a training run that stopped.
pub fn exit_code(e: &Error) -> i32 {
    match e.class() {
        ErrorClass::Machine => 1,
        ErrorClass::BadInput => 2,
        ErrorClass::ContractBreak => EXIT_CONTRACT,
        ErrorClass::Diverged => EXIT_STOPPED,
    }
}

/// Parses the comma-separated list of `flag`: a list that names nothing, an empty item
/// ("a,,b") or an item named twice is bad input, said with the flag's name.
pub fn parse_list<T>(flag: &'static str, s: &str) -> Result<Vec<T>, Error>
where
    T: std::str::FromStr<Err = Error> + PartialEq,
{
    parse_list_with(flag, s, str::parse)
}

/// `parse_list` with `parse` for each item.
pub fn parse_list_with<T: PartialEq>(
    flag: &'static str,
    s: &str,
    parse: impl Fn(&str) -> Result<T, Error>,
) -> Result<Vec<T>, Error> {
    if s.trim().is_empty() {
        return Err(Error::invalid(flag, "the list names nothing"));
    }
    let mut items: Vec<(T, &str)> = Vec::new();
    for text in s.split(',').map(str::trim) {
        if text.is_empty() {
            return Err(Error::invalid(
                flag,
                format!("'{s}' has an empty item (two commas, or one at an end)"),
            ));
        }
        let item = parse(text)?;
        if let Some((_, first)) = items.iter().find(|(seen, _)| *seen == item) {
            return Err(Error::invalid(
                flag,
                format!("'{text}' is named twice (as '{first}' before)"),
            ));
        }
        items.push((item, text));
    }
    Ok(items.into_iter().map(|(item, _)| item).collect())
}

/// The most timed repetitions `--reps` takes.
pub(crate) const MAX_REPS: usize = 10_000;

/// `--reps`: between 1 and `MAX_REPS`.
pub(crate) fn check_reps(reps: usize) -> Result<usize, Error> {
    if (1..=MAX_REPS).contains(&reps) {
        Ok(reps)
    } else {
        Err(Error::invalid(
            "--reps",
            format!("{reps}: between 1 and {MAX_REPS}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::parse_list;
    use crate::algorithm::{Algorithm, Scaling};
    use crate::error::Error;
    use crate::format::Format;

    #[test]
    fn lists_refuse_nothing_empty_items_and_repeats() {
        for bad in [
            "",
            " ",
            ",",
            "f32,",
            ",f32",
            "f32,,bf16",
            "f32,f32",
            "bf16x3, BF16X3",
        ] {
            let e = parse_list::<Algorithm>("--algorithms", bad).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::Invalid {
                        what: "--algorithms",
                        ..
                    }
                ),
                "'{bad}': {e}"
            );
        }
        let list: Vec<Algorithm> = parse_list("--algorithms", "f32, bf16x3").unwrap();
        assert_eq!(list, [Algorithm::F32, Algorithm::Bf16x3]);
    }

    #[test]
    fn given_scales_fit_in_a_list_and_print_back_as_they_parse() {
        let list: Vec<Algorithm> =
            parse_list("--algorithms", "e4m3:given=1/1,e4m3,e5m2:given=0.5/2").unwrap();
        let given =
            |a, b| Algorithm::fp8(Format::E4m3, Format::E4m3).with_scaling(Scaling::Given { a, b });
        assert_eq!(list[0], given(1.0, 1.0));
        assert_eq!(list[1], Algorithm::fp8(Format::E4m3, Format::E4m3));
        let printed: Vec<String> = list.iter().map(Algorithm::to_string).collect();
        assert_eq!(printed.join(","), "e4m3:given=1/1,e4m3,e5m2:given=0.5/2");
        let again: Vec<Algorithm> = parse_list("--algorithms", &printed.join(",")).unwrap();
        assert_eq!(again, list);
        // One algorithm may still write its scales with a comma.
        assert_eq!(
            "e4m3:given=1,1".parse::<Algorithm>().unwrap(),
            given(1.0, 1.0)
        );
        // Two scalings of one algorithm are two entries; the same scaling twice is a repeat.
        assert!(parse_list::<Algorithm>("--algorithms", "e4m3:given=1/1,e4m3:given=1/2").is_ok());
        assert!(parse_list::<Algorithm>("--algorithms", "e4m3:given=1/1,e4m3:given=1/1").is_err());
    }
}
