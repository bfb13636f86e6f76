//! `mantissa cast VALUE... [--to FORMAT,...]` and `mantissa cast --raw --from F --to F`.

use super::parse_list;
use super::table::{Table, g};
use crate::error::{Error, Result};
use crate::format::{Format, Overflow};
use std::io::{Read, Write};
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(
    after_help = "Examples:\n  mantissa cast 3.141 3.1415 3.142 --to f16\n  \
    mantissa cast 1e-5 500 --to e4m3,e5m2 --saturate\n  \
    mantissa cast --raw --from f32 --to bf16 < x.f32 > x.bf16"
)]
pub struct Args {
    /// Values to show (decimal, inf, -inf, nan); each is first rounded to the nearest f32.
    values: Vec<String>,
    /// Target formats, comma-separated (default: all).
    #[arg(long)]
    to: Option<String>,
    /// Source format of --raw data.
    #[arg(long)]
    from: Option<String>,
    /// Map overflow (and inf) to the signed max instead of inf/NaN.
    #[arg(long)]
    saturate: bool,
    /// Convert raw little-endian binary data: f32 (and tf32) 4 bytes, bf16/f16 2, e4m3/e5m2 1.
    #[arg(long)]
    raw: bool,
    /// Raw input file (default: standard input).
    #[arg(long, short = 'i', requires = "raw")]
    input: Option<PathBuf>,
    /// Raw output file, written atomically (default: standard output).
    #[arg(long, short = 'o', requires = "raw")]
    output: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    let overflow = if args.saturate {
        Overflow::Saturate
    } else {
        Overflow::Standard
    };
    if args.raw {
        let from: Format = args
            .from
            .as_deref()
            .ok_or_else(|| Error::invalid("arguments", "--raw needs --from FORMAT"))?
            .parse()?;
        let to: Format = args
            .to
            .as_deref()
            .ok_or_else(|| Error::invalid("arguments", "--raw needs --to FORMAT"))?
            .parse()?;
        if !args.values.is_empty() {
            return Err(Error::invalid(
                "arguments",
                "--raw reads values from the input, not the command line",
            ));
        }
        return raw(from, to, overflow, args.input, args.output);
    }
    if args.from.is_some() {
        return Err(Error::invalid("arguments", "--from goes with --raw"));
    }
    if args.values.is_empty() {
        return Err(Error::invalid(
            "arguments",
            "give values to cast, e.g. mantissa cast 3.141 --to f16",
        ));
    }
    let formats: Vec<Format> = match &args.to {
        Some(list) => parse_list(list)?,
        None => Format::ALL.to_vec(),
    };
    let mut t = Table::new(&[
        "value",
        "format",
        "encoded",
        "bits (sign | exponent | mantissa)",
        "hex",
        "error",
        "rel. error",
    ]);
    for text in &args.values {
        let x: f32 = text.trim().parse().map_err(|_| {
            Error::invalid(
                "value",
                format!("'{text}' is not a number (write e.g. 3.14, 1e-5, inf, nan)"),
            )
        })?;
        for &f in &formats {
            let e = f.describe(x, overflow);
            let show = |v: Option<f64>| v.map_or("-".into(), |v| g(v, 3));
            t.row(vec![
                text.clone(),
                f.to_string(),
                g(e.value as f64, 9),
                format!("{} | {} | {}", e.sign, e.exponent, e.mantissa),
                e.hex,
                show(e.error),
                show(e.relative_error),
            ]);
        }
    }
    print!("{}", t.render());
    Ok(())
}

fn raw(
    from: Format,
    to: Format,
    overflow: Overflow,
    input: Option<PathBuf>,
    output: Option<PathBuf>,
) -> Result<()> {
    let in_size = from.storage_bytes();
    let mut reader: Box<dyn Read> = match &input {
        Some(p) => {
            let f = std::fs::File::open(p).map_err(|e| Error::file(p, e))?;
            check_length(
                f.metadata().map(|m| m.len()).ok(),
                in_size,
                &p.display().to_string(),
            )?;
            Box::new(f)
        }
        None => {
            check_length(stdin_file_length(), in_size, "standard input")?;
            Box::new(std::io::stdin().lock())
        }
    };
    let mut convert = |w: &mut dyn Write| -> Result<()> {
        crate::format::convert_raw(&mut *reader, w, from, to, overflow)?;
        w.flush().map_err(Error::from)
    };
    // A file is written whole or not at all (output.rs); `-` or none is standard output.
    match output.filter(|p| p.as_os_str() != "-") {
        Some(p) => crate::output::write_file(&p, convert),
        None => convert(&mut std::io::BufWriter::new(std::io::stdout().lock())),
    }
}

fn check_length(len: Option<u64>, size: usize, what: &str) -> Result<()> {
    match len {
        Some(n) if n % size as u64 != 0 => Err(Error::invalid(
            "raw input",
            format!("{what} holds {n} bytes, not a multiple of the element size {size}"),
        )),
        _ => Ok(()),
    }
}

/// The size of standard input when it is a regular file (a shell redirect), so that a bad length
/// is caught before anything is written.
fn stdin_file_length() -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::fd::AsFd;
        let fd = std::io::stdin().as_fd().try_clone_to_owned().ok()?;
        let meta = std::fs::File::from(fd).metadata().ok()?;
        meta.is_file().then_some(meta.len())
    }
    #[cfg(not(unix))]
    {
        None
    }
}
