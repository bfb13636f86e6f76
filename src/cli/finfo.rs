//! `mantissa finfo [FORMAT...]`

use super::table::{Table, g};
use crate::error::Result;
use crate::format::{Finfo, Format};

#[derive(clap::Args)]
pub struct Args {
    /// Formats to show (default: all): f32 tf32 bf16 f16 e4m3 e5m2.
    formats: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let formats: Vec<Format> = if args.formats.is_empty() {
        Format::ALL.to_vec()
    } else {
        args.formats
            .iter()
            .map(|f| f.parse())
            .collect::<Result<_>>()?
    };
    let infos: Vec<Finfo> = formats.iter().map(|f| f.finfo()).collect();
    if args.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&infos)
                .map_err(|e| crate::Error::invalid("json", e.to_string()))?
        )?;
        return Ok(());
    }
    let mut t = Table::new(&[
        "format",
        "bits",
        "exp",
        "mant",
        "max",
        "min",
        "smallest normal",
        "smallest subnormal",
        "eps",
        "resolution",
    ]);
    for i in infos {
        t.row(vec![
            i.format.to_string(),
            i.bits.to_string(),
            i.exponent_bits.to_string(),
            i.mantissa_bits.to_string(),
            g(i.max, 6),
            g(i.min, 6),
            g(i.smallest_normal, 6),
            g(i.smallest_subnormal, 6),
            g(i.eps, 6),
            g(i.resolution, 6),
        ]);
    }
    say_raw!("{}", t.render())?;
    Ok(())
}
