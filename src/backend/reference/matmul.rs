//! The reference matmul: every algorithm exactly as docs/design.md specifies it, accumulated
//! in f64.
//!
//! Written to be obviously right first: operands are prepared element by element with the
//! `format` module (rounding, splitting, scaling), then each output is a plain dot product in
//! f64 per level. Rows run in parallel (rayon).

use crate::algorithm::{Algorithm, MatmulShape, SPLIT_LEVELS, Scaling};
use crate::backend::Fp8Scales;
use crate::error::Result;
use crate::format::{self, Format, Overflow};
use crate::memory;
use rayon::prelude::*;

/// Operands of one batch, laid out for the dot products: A's logical rows (m x k) and B's
/// logical columns (n x k), each as one plane per part (1 part, or h/m/l for split algorithms).
struct Prepared {
    a: Vec<Vec<f64>>,
    b: Vec<Vec<f64>>,
}

/// C = A . B under `algorithm`, exactly as specified, accumulated in f64. C and the prepared
/// operands are asked of the host first (`memory`): a product too large for it is an error.
pub fn matmul(
    shape: &MatmulShape,
    algorithm: &Algorithm,
    a: &[f32],
    b: &[f32],
) -> Result<Vec<f32>> {
    shape.check(a.len(), b.len())?;
    // One batch's operands as rows and columns, and their planes in f64, asked for together
    // with C: C is allocated first, and a check of the operands alone passed where the two
    // did not fit (an abort under `ulimit -v`).
    let per_value = 4 + 8 * algorithm.split_parts().max(1) as u64;
    let c_len = shape.checked_c_len()?;
    let operands = (a.len() / shape.batch.max(1)).checked_add(b.len() / shape.batch.max(1));
    memory::check(
        "the reference's product and its prepared operands",
        operands
            .and_then(|e| (e as u64).checked_mul(per_value))
            .and_then(|bytes| bytes.checked_add(memory::bytes_of::<f32>(c_len)?)),
    )?;
    let mut c = memory::host_buffer::<f32>("the reference's C", c_len)?;
    matmul_into(shape, algorithm, a, b, &mut c);
    Ok(c)
}

/// `matmul` into `c` (of the shape's length), for callers that hold the buffer (the training
/// ops, whose sizes the step plan's check covers).
pub(crate) fn matmul_into(
    shape: &MatmulShape,
    algorithm: &Algorithm,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
) {
    let (m, n, k) = (shape.m, shape.n, shape.k);
    for batch in 0..shape.batch {
        let a_rows: Vec<f32> = (0..m * k)
            .map(|e| a[shape.a_index(batch, e / k, e % k)])
            .collect();
        let b_cols: Vec<f32> = (0..n * k)
            .map(|e| b[shape.b_index(batch, e % k, e / k)])
            .collect();
        let scales = Fp8Scales::compute(algorithm, &a_rows, &b_cols, m, n, k);
        let prepared = prepare(algorithm, &a_rows, &b_cols, &scales);
        let c_batch = &mut c[batch * m * n..(batch + 1) * m * n];
        c_batch
            .par_chunks_mut(n.max(1))
            .enumerate()
            .for_each(|(i, c_row)| {
                for (j, out) in c_row.iter_mut().enumerate() {
                    *out = output(algorithm, &prepared, &scales, i, j, k);
                }
            });
    }
}

/// Rounds, splits or quantizes the operands as the algorithm says.
fn prepare(algorithm: &Algorithm, a_rows: &[f32], b_cols: &[f32], scales: &Fp8Scales) -> Prepared {
    let to64 = |v: &[f32], f: &(dyn Fn(usize, f32) -> f32 + Sync)| -> Vec<f64> {
        v.par_iter()
            .enumerate()
            .map(|(e, &x)| f(e, x) as f64)
            .collect()
    };
    match *algorithm {
        Algorithm::F32 | Algorithm::Tf32 | Algorithm::Bf16 | Algorithm::F16 => {
            let (fa, fb) = algorithm.operand_formats();
            Prepared {
                a: vec![to64(a_rows, &|_, x| fa.round(x, Overflow::Standard))],
                b: vec![to64(b_cols, &|_, x| fb.round(x, Overflow::Standard))],
            }
        }
        Algorithm::Bf16x3 | Algorithm::Bf16x6 | Algorithm::Bf16x9 => {
            let planes = |v: &[f32]| -> Vec<Vec<f64>> {
                let parts: Vec<[f32; 3]> = v.par_iter().map(|&x| format::split_bf16(x)).collect();
                (0..3)
                    .map(|p| parts.iter().map(|s| s[p] as f64).collect())
                    .collect()
            };
            Prepared {
                a: planes(a_rows),
                b: planes(b_cols),
            }
        }
        Algorithm::Fp8 { a: fa, b: fb, .. } => {
            let k = scales.k;
            Prepared {
                a: vec![to64(a_rows, &|e, x| {
                    format::quantize_scaled(x, scales.a_for_row(e / k), fa)
                })],
                b: vec![to64(b_cols, &|e, x| {
                    format::quantize_scaled(x, scales.b_for_col(e / k), fb)
                })],
            }
        }
    }
}

/// One output element: the dot product of A's row i and B's column j, per the algorithm.
fn output(
    algorithm: &Algorithm,
    p: &Prepared,
    scales: &Fp8Scales,
    i: usize,
    j: usize,
    k: usize,
) -> f32 {
    if algorithm.is_split() {
        // One accumulator per level; the lower levels (L1..L4) use 0 where h is not finite.
        let mut levels = [0f64; 5];
        for (level, terms) in SPLIT_LEVELS
            .iter()
            .enumerate()
            .take(algorithm.split_levels())
        {
            for &(pa, pb) in terms.iter() {
                let (x, y) = (row(&p.a, pa, i, k), row(&p.b, pb, j, k));
                levels[level] += if level == 0 {
                    dot(x, y)
                } else {
                    dot_finite_h(x, y, pa, pb, p, i, j, k)
                };
            }
        }
        // Levels summed smallest first.
        let total = levels[..algorithm.split_levels()]
            .iter()
            .rev()
            .fold(0f64, |s, &l| s + l);
        return total as f32;
    }
    let acc = dot(row(&p.a, 0, i, k), row(&p.b, 0, j, k));
    match algorithm.scaling() {
        Some(_) => (acc / (scales.a_for_row(i) as f64 * scales.b_for_col(j) as f64)) as f32,
        None => acc as f32,
    }
}

/// Row `r` (of k values) of plane `part`.
fn row(planes: &[Vec<f64>], part: usize, r: usize, k: usize) -> &[f64] {
    &planes[part][r * k..(r + 1) * k]
}

/// A lower-level product term: where a factor is the h part and h is not finite, use 0.
#[allow(clippy::too_many_arguments)]
fn dot_finite_h(
    x: &[f64],
    y: &[f64],
    pa: usize,
    pb: usize,
    p: &Prepared,
    i: usize,
    j: usize,
    k: usize,
) -> f64 {
    let ha = &p.a[0][i * k..(i + 1) * k];
    let hb = &p.b[0][j * k..(j + 1) * k];
    let mut acc = 0f64;
    for e in 0..k {
        let xa = if pa == 0 && !ha[e].is_finite() {
            0.0
        } else {
            x[e]
        };
        let yb = if pb == 0 && !hb[e].is_finite() {
            0.0
        } else {
            y[e]
        };
        acc += xa * yb;
    }
    acc
}

/// Dot product in f64, four partial sums (the order is irrelevant at f64 precision for f32
/// inputs, and it lets the compiler vectorize).
fn dot(x: &[f64], y: &[f64]) -> f64 {
    let mut acc = [0f64; 4];
    let chunks = x.len() / 4;
    for c in 0..chunks {
        for l in 0..4 {
            acc[l] += x[4 * c + l] * y[4 * c + l];
        }
    }
    let mut tail = 0f64;
    for e in 4 * chunks..x.len() {
        tail += x[e] * y[e];
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

impl Fp8Scales {
    /// The scales an fp8 algorithm uses for one batch (empty for other algorithms).
    /// `a_rows` is m x k (A's logical rows), `b_cols` is n x k (B's logical columns).
    pub fn compute(
        algorithm: &Algorithm,
        a_rows: &[f32],
        b_cols: &[f32],
        m: usize,
        n: usize,
        k: usize,
    ) -> Fp8Scales {
        let Algorithm::Fp8 {
            a: fa,
            b: fb,
            scaling,
        } = *algorithm
        else {
            return Fp8Scales {
                a: vec![],
                b: vec![],
                k,
            };
        };
        let per = |v: &[f32], count: usize, f: Format| -> Vec<f32> {
            (0..count)
                .map(|r| {
                    format::scale_for_amax(format::amax(v[r * k..(r + 1) * k].iter().copied()), f)
                })
                .collect()
        };
        let (a, b) = match scaling {
            Scaling::Tensorwise => (
                vec![format::scale_for_amax(
                    format::amax(a_rows.iter().copied()),
                    fa,
                )],
                vec![format::scale_for_amax(
                    format::amax(b_cols.iter().copied()),
                    fb,
                )],
            ),
            Scaling::Rowwise => (per(a_rows, m, fa), per(b_cols, n, fb)),
            Scaling::Given { a, b } => (vec![a], vec![b]),
        };
        Fp8Scales { a, b, k }
    }
}
