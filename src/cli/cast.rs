//! `mantissa cast VALUE... [--to FORMAT,...]` and `mantissa cast --raw --from F --to F`.

use super::parse_list;
use super::table::{Table, g};
use crate::error::{Error, Result};
use crate::format::{Format, Overflow};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

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
    /// Raw input file (default, or `-`: standard input).
    #[arg(long, short = 'i', requires = "raw")]
    input: Option<PathBuf>,
    /// Raw output file, written atomically (default, or `-`: standard output).
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
        Some(list) => parse_list("--to", list)?,
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
    say_raw!("{}", t.render())?;
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
    // A regular file, or standard input (none, or `-`): opened by `input::Input`.
    let input = crate::input::Input::open(input.as_deref().unwrap_or(Path::new("-")))?;
    let name = match input.path().as_os_str() == "-" {
        true => "standard input".to_string(),
        false => input.path().display().to_string(),
    };
    check_length(input.len(), in_size, &name)?;
    let mut reader: Box<dyn Read> = Box::new(input);
    let convert = |w: &mut dyn Write| -> Result<()> {
        crate::format::convert_raw(&mut *reader, w, from, to, overflow)?;
        w.flush().map_err(Error::from)
    };
    // A file is written whole or not at all (output.rs); `-` or none is standard output.
    crate::output::write_file(output.as_deref().unwrap_or(Path::new("-")), convert)
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
