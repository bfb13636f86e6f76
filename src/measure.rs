//! Inputs and error measures shared by the tests, the benchmarks and the report: seeded input
//! families, the exact f64 product, relative errors and the contract's tolerance check.

use crate::algorithm::{Algorithm, MatmulShape};
use crate::format::Format;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use rayon::prelude::*;

/// N(0,1) values.
pub fn normal(len: usize, seed: u64) -> Vec<f32> {
    let mut values = Vec::with_capacity(len);
    normal_into(&mut values, len, seed);
    values
}

/// `normal(len, seed)` appended to `values` (whose room the caller reserved).
pub fn normal_into(values: &mut Vec<f32>, len: usize, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    values.extend((0..len).map(|_| -> f32 { StandardNormal.sample(&mut rng) }));
}

/// Values of random sign with magnitudes spread log-uniformly over 2^-20..2^20.
pub fn wide_range(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len)
        .map(|_| {
            let e: f32 = rng.random_range(-20.0..20.0);
            let sign = if rng.random::<bool>() { 1.0 } else { -1.0 };
            sign * e.exp2()
        })
        .collect()
}

/// Uniform values in [lo, hi).
pub fn uniform(len: usize, lo: f32, hi: f32, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(lo..hi)).collect()
}

/// f32 values at and around every boundary of every format: zeros, subnormals of f32 and of the
/// small formats, smallest normals, ties, the largest finite values and just beyond, inf, NaN.
pub fn boundary_values() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::MAX,
        f32::MIN,
    ];
    v.extend([
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x007f_ffff),
        f32::from_bits(0x0040_0000),
    ]);
    for f in Format::ALL {
        let i = f.finfo();
        for base in [
            i.max,
            i.smallest_normal,
            i.smallest_subnormal,
            1.0,
            1.0 + i.eps / 2.0,
            1.0 + 1.5 * i.eps,
        ] {
            let b = base as f32;
            for x in [
                b,
                b.next_up(),
                b.next_down(),
                b * 0.5,
                b * 1.5,
                b * 2.0,
                b * 0.75,
            ] {
                v.extend([x, -x]);
            }
        }
        // Exactly halfway between max and the next (non-existent) value: rounds to inf/NaN.
        let half_ulp_above = (i.max + i.eps * 2f64.powi(i.max.log2().floor() as i32) / 2.0) as f32;
        v.extend([
            half_ulp_above,
            half_ulp_above.next_down(),
            half_ulp_above.next_up(),
        ]);
    }
    v
}

/// Random f32 with every exponent, both signs and random mantissas.
pub fn random_bits(n: usize, seed: u64) -> Vec<f32> {
    let words = uniform(n, 0.0, 1.0, seed);
    words
        .iter()
        .map(|&u| f32::from_bits((u as f64 * u32::MAX as f64) as u32))
        .collect()
}

/// Whether two codes of `format` are equal, NaN payloads aside.
pub fn same_code(format: Format, got: u32, want: u32) -> bool {
    got == want || (format.decode(got).is_nan() && format.decode(want).is_nan())
}

/// The product of the original f32 inputs in f64 (what every algorithm's error is measured
/// against).
pub fn exact_product(shape: &MatmulShape, a: &[f32], b: &[f32]) -> Vec<f64> {
    let (m, n, k) = (shape.m, shape.n, shape.k);
    let mut c = vec![0f64; shape.c_len()];
    c.par_chunks_mut(n.max(1))
        .enumerate()
        .for_each(|(row, out)| {
            let (batch, i) = (row / m.max(1), row % m.max(1));
            let a_row: Vec<f64> = (0..k)
                .map(|p| a[shape.a_index(batch, i, p)] as f64)
                .collect();
            for (j, o) in out.iter_mut().enumerate() {
                *o = (0..k)
                    .map(|p| a_row[p] * b[shape.b_index(batch, p, j)] as f64)
                    .sum();
            }
        });
    c
}

/// What the contract's checks need of each element of C, computed once from the inputs in
/// f64 (as `exact_product`, and in one pass with it).
pub struct Magnitudes {
    /// The exact product.
    pub exact: Vec<f64>,
    /// |A| . |B| over the finite inputs: the magnitude that bounds accumulation-order
    /// differences, and, where it exceeds f32's range, says that f32 partial sums may
    /// overflow. (Infinite inputs count as 0 here: where they reach an output, the non-finite
    /// rules decide it.)
    pub abs: Vec<f64>,
    /// The largest partial sum of the element's K terms in their natural order (finite inputs).
    pub peak: Vec<f64>,
}

/// `Magnitudes` of A . B; its three buffers are asked of the host first (`memory`).
pub fn magnitudes(shape: &MatmulShape, a: &[f32], b: &[f32]) -> crate::Result<Magnitudes> {
    let len = shape.checked_c_len()?;
    let what = "the exact product and magnitudes of C (f64)";
    crate::memory::check(
        what,
        crate::memory::bytes_of::<f64>(len).and_then(|b| b.checked_mul(3)),
    )?;
    let mut m = Magnitudes {
        exact: crate::memory::host_buffer(what, len)?,
        abs: crate::memory::host_buffer(what, len)?,
        peak: crate::memory::host_buffer(what, len)?,
    };
    let (rows, k, n) = (shape.batch * shape.m, shape.k, shape.n.max(1));
    let finite = |x: f32| if x.is_finite() { x as f64 } else { 0.0 };
    m.exact
        .par_chunks_mut(n)
        .zip(m.abs.par_chunks_mut(n))
        .zip(m.peak.par_chunks_mut(n))
        .enumerate()
        .take(rows)
        .for_each(|(row, ((exact, abs), peak))| {
            let (batch, i) = (row / shape.m.max(1), row % shape.m.max(1));
            let a_row: Vec<f32> = (0..k).map(|p| a[shape.a_index(batch, i, p)]).collect();
            for j in 0..exact.len() {
                let (mut e, mut s, mut sum, mut top) = (0f64, 0f64, 0f64, 0f64);
                for (p, &x) in a_row.iter().enumerate() {
                    let y = b[shape.b_index(batch, p, j)];
                    e += x as f64 * y as f64;
                    let t = finite(x) * finite(y);
                    s += t.abs();
                    sum += t;
                    top = top.max(sum.abs());
                }
                (exact[j], abs[j], peak[j]) = (e, s, top);
            }
        });
    Ok(m)
}

/// The whole product against its band: beside the element-by-element tolerance, the root of
/// summed squares of C - reference over C, against `Algorithm::accumulation_band`. It sees what
/// the per-element bound (which grows as K |A||B|) cannot: a product missing part of its sum.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct WholeProduct {
    /// ||C - reference|| over the elements both have finite where no partial sum can overflow.
    pub error: f64,
    /// The band's bound on that norm.
    pub allowed: f64,
    /// Relative Frobenius error of C against the f64 product (`relative_error`).
    pub relative_error: f64,
    /// The same of the reference's result: the algorithm's own rounding of these inputs.
    pub reference_error: f64,
    /// The top of the band of `relative_error`: `reference_error` + `allowed` / ||exact||
    /// (inf where the exact product is all zeros).
    pub band: f64,
}

impl WholeProduct {
    /// Whether the whole product is within its band.
    pub fn holds(&self) -> bool {
        self.error <= self.allowed
    }
}

impl std::fmt::Display for WholeProduct {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "relative error {:.3e} against a band up to {:.3e} (||C - reference|| = {:.3e}, allowed {:.3e})",
            self.relative_error, self.band, self.error, self.allowed
        )
    }
}

/// The contract's verdict on a backend's result `got` against the reference's `want` of the same
/// algorithm: the elements outside the per-element tolerance (`compare_to_reference`) and the
/// whole product against its band.
#[derive(Clone, Debug)]
pub struct ContractCheck {
    /// The first elements outside the tolerance (up to 10).
    pub mismatches: Vec<Mismatch>,
    /// Elements outside the per-element tolerance.
    pub count: usize,
    /// The whole product against its band.
    pub whole: WholeProduct,
}

impl ContractCheck {
    /// Whether every element and the whole product are within the contract.
    pub fn holds(&self) -> bool {
        self.count == 0 && self.whole.holds()
    }

    /// The breaks in words (up to the first 10 elements, then the band), empty where it holds.
    pub fn findings(&self) -> Vec<String> {
        let mut lines: Vec<String> = self.mismatches.iter().map(|m| m.to_string()).collect();
        if !self.whole.holds() {
            lines.push(format!(
                "the whole product is outside its band: {}",
                self.whole
            ));
        }
        lines
    }

    /// `ContractBreak` where the check failed.
    pub fn verdict(&self, algorithm: &Algorithm) -> crate::Result<()> {
        if self.holds() {
            return Ok(());
        }
        Err(crate::Error::ContractBreak {
            algorithm: algorithm.to_string(),
            count: self.count,
            whole: (!self.whole.holds()).then(|| self.whole.to_string()),
        })
    }
}

/// Checks `got` against the reference result `want` of `algorithm` on inputs `a`, `b`: element
/// by element and as a whole (docs/design.md, "Tolerances").
pub fn check_product(
    algorithm: &Algorithm,
    shape: &MatmulShape,
    (a, b): (&[f32], &[f32]),
    got: &[f32],
    want: &[f32],
) -> crate::Result<ContractCheck> {
    let m = magnitudes(shape, a, b)?;
    let (mismatches, count) = compare_to_reference(algorithm, shape, got, want, &m.abs);
    let whole = whole_product(algorithm, shape.k, got, want, &m);
    Ok(ContractCheck {
        mismatches,
        count,
        whole,
    })
}

/// The whole-product half of `check_product`.
pub fn whole_product(
    algorithm: &Algorithm,
    k: usize,
    got: &[f32],
    want: &[f32],
    m: &Magnitudes,
) -> WholeProduct {
    let floor = f32::MIN_POSITIVE as f64 * (k as f64 + 1.0);
    let (mut error, mut allowed, mut norm) = (0f64, 0f64, 0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (exact, abs, peak) = (m.exact[i], m.abs[i], m.peak[i]);
        // Non-finite results and possible overflows are the per-element check's.
        if !(g.is_finite() && w.is_finite() && exact.is_finite() && abs <= f32::MAX as f64) {
            continue;
        }
        error += (g as f64 - w as f64).powi(2);
        allowed += (algorithm.accumulation_band(k, exact, abs, peak) + floor).powi(2);
        norm += exact * exact;
    }
    let (error, allowed, norm) = (error.sqrt(), allowed.sqrt(), norm.sqrt());
    let reference_error = relative_error(want, &m.exact);
    WholeProduct {
        error,
        allowed,
        relative_error: relative_error(got, &m.exact),
        reference_error,
        band: if norm > 0.0 {
            reference_error + allowed / norm
        } else {
            f64::INFINITY
        },
    }
}

/// Whether an exact value can be an f32 result at all (finite and within f32's range).
fn representable(e: f64) -> bool {
    e.abs() <= f32::MAX as f64
}

/// Relative Frobenius error ||C - exact|| / ||exact|| over the entries whose exact value is
/// representable in f32 (an entry beyond f32's range is an overflow, counted elsewhere).
pub fn relative_error(c: &[f32], exact: &[f64]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &e) in c.iter().zip(exact) {
        if representable(e) {
            num += (x as f64 - e).powi(2);
            den += e * e;
        }
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Largest error in units of f32 ulps, each at the larger of the exact value's magnitude and
/// C's RMS magnitude (so that entries that cancel to near zero do not count ulps of nothing).
pub fn max_ulp_error(c: &[f32], exact: &[f64]) -> f64 {
    let finite: Vec<f64> = exact
        .iter()
        .copied()
        .filter(|e| representable(*e))
        .collect();
    let rms = (finite.iter().map(|e| e * e).sum::<f64>() / finite.len().max(1) as f64).sqrt();
    let ulp = |v: f64| -> f64 {
        let v = (v as f32).abs().max(f32::MIN_POSITIVE);
        (v.next_up() - v) as f64
    };
    c.iter()
        .zip(exact)
        .filter(|(_, e)| representable(**e))
        .map(|(&x, &e)| (x as f64 - e).abs() / ulp(e.abs().max(rms)))
        .fold(0.0, f64::max)
}

/// A difference between a result and the reference that breaks the contract.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    /// The element's index in C (row-major).
    pub index: usize,
    /// The backend's value.
    pub got: f32,
    /// The reference's value.
    pub want: f32,
    /// The largest difference the contract allows there.
    pub allowed: f64,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "C[{}] = {:e}, reference {:e} (allowed difference {:e})",
            self.index, self.got, self.want, self.allowed
        )
    }
}

/// Checks a backend's result against the reference result of the same algorithm: non-finite
/// values exactly where the reference has them (same inf sign; NaN for NaN), finite values
/// within the algorithm's accumulation tolerance of |A||B|. Returns the mismatches (first 10)
/// and their total count.
///
/// One exception, inherent in f32 accumulation: where |A||B| exceeds f32's range, partial sums
/// may overflow in an order-dependent way (inf - inf = NaN in f32 where the f64 reference stays
/// finite or keeps one inf). There, a NaN reference still needs a NaN, and any other reference
/// value accepts an inf or NaN result.
pub fn compare_to_reference(
    algorithm: &Algorithm,
    shape: &MatmulShape,
    got: &[f32],
    want: &[f32],
    abs_prod: &[f64],
) -> (Vec<Mismatch>, usize) {
    let tol = algorithm.accumulation_tolerance(shape.k);
    // Subnormal f32 arithmetic may flush to zero on GPUs: allow that much absolute error.
    let floor = f32::MIN_POSITIVE as f64 * (shape.k as f64 + 1.0);
    let mut mismatches = Vec::new();
    let mut count = 0;
    for (index, ((&g, &w), &mag)) in got.iter().zip(want).zip(abs_prod).enumerate() {
        let allowed = tol * mag + floor;
        let may_overflow = mag > f32::MAX as f64;
        let ok = if w.is_nan() {
            g.is_nan()
        } else if may_overflow && !g.is_finite() {
            true
        } else if w.is_infinite() {
            g == w
        } else {
            g.is_finite() && ((g as f64 - w as f64).abs() <= allowed)
        };
        if !ok {
            count += 1;
            if mismatches.len() < 10 {
                mismatches.push(Mismatch {
                    index,
                    got: g,
                    want: w,
                    allowed,
                });
            }
        }
    }
    if got.len() != want.len() {
        count += got.len().abs_diff(want.len());
    }
    (mismatches, count)
}

/// Tolerances of the training ops, relative as `|got - want| <= tol (1 + |want|)` against the
/// host reference (`backend::reference::ops`), from what the contract leaves free: the order of
/// a reduction, and the device's exp, tanh and sqrt (WGSL and CUDA allow a few ulps there; the
/// matmul has its own, `Algorithm::accumulation_tolerance`). docs/design.md, "Tolerances".
pub mod train_tolerance {
    /// Ops through exp or tanh, and sums of one row or column in f32 against the reference's
    /// f64: GELU, causal softmax, cross entropy, layer-norm forward, column sums, the embedding
    /// scatter-add (a few ulps of the device's exp and tanh, amplified by a row's
    /// normalisation; sums of at most ~1000 terms near N(0,1), whose f32 rounding reaches
    /// ~1e-6 where they cancel).
    pub const ROW: f32 = 1e-5;
    /// Backward reductions over both rows and columns in another order (layer-norm dx, dg, db):
    /// each output sums products of two rounded row terms.
    pub const REDUCTION: f32 = 1e-4;
    /// Elementwise f32 arithmetic in the reference's order with f64 where the reference has it
    /// (AdamW's update): an ulp or two.
    pub const ARITHMETIC: f32 = 1e-6;
}
