//! The operand checks of the Backend's training ops, one function per op, run by every backend
//! before it touches an operand: a wrong length is an error here, never a panic on the host or
//! a read past a buffer on a device. Each returns the row count the op works on.

use crate::error::{Error, Result};

/// Every id must name a row of a table with `rows` rows.
pub fn ids(ids: &[u32], rows: usize) -> Result<()> {
    match ids.iter().find(|&&i| i as usize >= rows) {
        Some(bad) => Err(Error::invalid(
            "embedding",
            format!("id {bad} is outside a table of {rows} rows"),
        )),
        None => Ok(()),
    }
}

fn length(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::LengthMismatch {
            what,
            expected,
            got,
        })
    }
}

/// Rows of a `rows x c` operand, refusing a length that is not a whole number of rows.
fn rows_of(what: &'static str, len: usize, c: usize) -> Result<usize> {
    if c == 0 || !len.is_multiple_of(c) {
        return Err(Error::invalid(
            what,
            format!("{len} values are not rows of {c}"),
        ));
    }
    Ok(len / c)
}

pub fn layernorm_fwd(x: &[f32], g: &[f32], b: &[f32], c: usize) -> Result<usize> {
    let rows = rows_of("layer norm", x.len(), c)?;
    length("layer norm gain", c, g.len())?;
    length("layer norm bias", c, b.len())?;
    Ok(rows)
}

pub fn layernorm_bwd(
    dy: &[f32],
    x: &[f32],
    g: &[f32],
    (mean, rstd): (&[f32], &[f32]),
    c: usize,
) -> Result<usize> {
    let rows = rows_of("layer norm", x.len(), c)?;
    length("layer norm gradient", x.len(), dy.len())?;
    length("layer norm gain", c, g.len())?;
    length("layer norm means", rows, mean.len())?;
    length("layer norm rstds", rows, rstd.len())?;
    Ok(rows)
}

/// GELU forward, or backward where `dy` is given.
pub fn gelu(x: &[f32], dy: Option<&[f32]>) -> Result<()> {
    dy.map_or(Ok(()), |dy| length("gelu gradient", x.len(), dy.len()))
}

/// Causal softmax over rows of `t`, forward, or backward where `dp` is given.
pub fn softmax(x: &[f32], dp: Option<&[f32]>, t: usize) -> Result<usize> {
    let rows = rows_of("causal softmax", x.len(), t)?;
    if let Some(dp) = dp {
        length("softmax gradient", x.len(), dp.len())?;
    }
    Ok(rows)
}

/// Cross entropy over rows of `v` (logits forward, probabilities backward).
pub fn cross_entropy(values: &[f32], targets: &[u32], v: usize) -> Result<usize> {
    let rows = rows_of("cross entropy", values.len(), v)?;
    length("cross entropy targets", rows, targets.len())?;
    ids(targets, v)?;
    Ok(rows)
}

pub fn adamw(p: &[f32], g: &[f32], m: &[f32], v: &[f32]) -> Result<()> {
    for (what, len) in [
        ("gradient", g.len()),
        ("first moment", m.len()),
        ("second moment", v.len()),
    ] {
        length(what, p.len(), len)?;
    }
    Ok(())
}

/// Rows of the `rows x c` table the ids gather from.
pub fn embedding_fwd(table: &[f32], token_ids: &[u32], c: usize) -> Result<usize> {
    let rows = rows_of("embedding table", table.len(), c)?;
    ids(token_ids, rows)?;
    Ok(rows)
}

pub fn embedding_bwd(dout: &[f32], token_ids: &[u32], rows: usize, c: usize) -> Result<()> {
    ids(token_ids, rows)?;
    length("embedding gradient", token_ids.len() * c, dout.len())
}
