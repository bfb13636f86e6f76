//! Matmul algorithms: their names and their specification (docs/design.md, "Matmul algorithms").
//!
//! An algorithm says what the f32 inputs become before they are multiplied and how the products
//! are accumulated. Every backend computes the same function up to accumulation order; the host
//! reference (`backend::reference`) is the executable form of this spec.

use crate::error::{Error, Result};
use crate::format::Format;
use std::fmt;
use std::str::FromStr;

/// f32's unit roundoff, 2^-24: the accumulators of every algorithm are f32.
pub const UNIT_ROUNDOFF_F32: f64 = f32::EPSILON as f64 / 2.0;

/// The generous factor of `Algorithm::accumulation_band` over the typical size of independent
/// rounding errors (about 0.2 u sqrt(K) peak for f32 sums of N(0,1), uniform or wide-range
/// products).
pub const BAND_FACTOR: f64 = 4.0;

/// How fp8 algorithms choose their scales (docs/design.md, "fp8 scaling").
#[derive(Clone, Copy, Debug, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub enum Scaling {
    /// One scale per operand, s = FMAX / amax(X), computed just in time.
    #[default]
    Tensorwise,
    /// One scale per row of A and per column of B.
    Rowwise,
    /// Scales handed in (for example by a delayed-scaling recipe).
    Given {
        /// A's scale: A times it is rounded to fp8 (the product is divided by it again).
        a: f32,
        /// B's scale, as A's.
        b: f32,
    },
}

impl fmt::Display for Scaling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scaling::Tensorwise => f.write_str("tensorwise"),
            Scaling::Rowwise => f.write_str("rowwise"),
            Scaling::Given { a, b } => write!(f, "given={a}/{b}"),
        }
    }
}

impl FromStr for Scaling {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if let Some(values) = s.strip_prefix("given=") {
            // SA/SB everywhere (lists split at commas); SA,SB where one algorithm is named.
            let parts: Vec<&str> = values.split(['/', ',']).collect();
            let parse = |t: &str| {
                t.trim()
                    .parse::<f32>()
                    .ok()
                    .filter(|v| v.is_finite() && *v > 0.0)
            };
            return match parts.as_slice() {
                [a, b] => match (parse(a), parse(b)) {
                    (Some(a), Some(b)) => Ok(Scaling::Given { a, b }),
                    _ => Err(Error::invalid(
                        "scaling",
                        format!("'{s}': scales must be finite and positive"),
                    )),
                },
                _ => Err(Error::invalid(
                    "scaling",
                    format!("'{s}': write given=SCALE_A/SCALE_B"),
                )),
            };
        }
        match s {
            "tensorwise" => Ok(Scaling::Tensorwise),
            "rowwise" => Ok(Scaling::Rowwise),
            _ => Err(Error::UnknownName {
                kind: "scaling",
                given: s.to_string(),
                valid: vec!["tensorwise".into(), "rowwise".into(), "given=SA/SB".into()],
            }),
        }
    }
}

/// A matmul algorithm, named after JAX/XLA's dot algorithm presets.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Algorithm {
    /// Plain f32 products, f32 accumulation.
    F32,
    /// Operands rounded to tf32 (10-bit mantissa), f32 accumulation.
    Tf32,
    /// Operands rounded to bf16, f32 accumulation.
    Bf16,
    /// Operands rounded to f16, f32 accumulation.
    F16,
    /// f32 emulated from split-bf16 products: levels L0 + L1.
    Bf16x3,
    /// Levels L0 + L1 + L2.
    Bf16x6,
    /// Levels L0..L4.
    Bf16x9,
    /// fp8-emulated: A in format `a`, B in format `b` (each e4m3 or e5m2), with scales.
    Fp8 {
        /// A's fp8 format.
        a: Format,
        /// B's fp8 format.
        b: Format,
        /// How the scales are chosen.
        scaling: Scaling,
    },
}

/// One product term of a split algorithm: (part of A, part of B), parts 0 = h, 1 = m, 2 = l.
pub type SplitTerm = (usize, usize);

/// The split levels of docs/design.md: L0 = hh; L1 = hm + mh; L2 = mm + hl + lh; L3 = ml + lm; L4 = ll.
pub const SPLIT_LEVELS: [&[SplitTerm]; 5] = [
    &[(0, 0)],
    &[(0, 1), (1, 0)],
    &[(1, 1), (0, 2), (2, 0)],
    &[(1, 2), (2, 1)],
    &[(2, 2)],
];

impl Algorithm {
    /// Every algorithm with its default scaling, in the order tables list them.
    pub const ALL: [Algorithm; 11] = [
        Algorithm::F32,
        Algorithm::Tf32,
        Algorithm::Bf16,
        Algorithm::F16,
        Algorithm::Bf16x3,
        Algorithm::Bf16x6,
        Algorithm::Bf16x9,
        Algorithm::fp8(Format::E4m3, Format::E4m3),
        Algorithm::fp8(Format::E5m2, Format::E5m2),
        Algorithm::fp8(Format::E4m3, Format::E5m2),
        Algorithm::fp8(Format::E5m2, Format::E4m3),
    ];

    /// An fp8 algorithm with tensorwise current scaling.
    pub const fn fp8(a: Format, b: Format) -> Algorithm {
        Algorithm::Fp8 {
            a,
            b,
            scaling: Scaling::Tensorwise,
        }
    }

    /// The same algorithm with another fp8 scaling (no effect on the others).
    pub fn with_scaling(self, scaling: Scaling) -> Algorithm {
        match self {
            Algorithm::Fp8 { a, b, .. } => Algorithm::Fp8 { a, b, scaling },
            other => other,
        }
    }

    /// The name without the scaling suffix: "bf16x3", "e4m3", "e4m3-e5m2".
    pub fn base_name(&self) -> String {
        match self {
            Algorithm::F32 => "f32".into(),
            Algorithm::Tf32 => "tf32".into(),
            Algorithm::Bf16 => "bf16".into(),
            Algorithm::F16 => "f16".into(),
            Algorithm::Bf16x3 => "bf16x3".into(),
            Algorithm::Bf16x6 => "bf16x6".into(),
            Algorithm::Bf16x9 => "bf16x9".into(),
            Algorithm::Fp8 { a, b, .. } if a == b => a.name().into(),
            Algorithm::Fp8 { a, b, .. } => format!("{a}-{b}"),
        }
    }

    /// The formats the operands are stored in on a device (the split algorithms store three
    /// bf16 planes each).
    pub fn operand_formats(&self) -> (Format, Format) {
        match *self {
            Algorithm::F32 => (Format::F32, Format::F32),
            Algorithm::Tf32 => (Format::Tf32, Format::Tf32),
            Algorithm::Bf16 | Algorithm::Bf16x3 | Algorithm::Bf16x6 | Algorithm::Bf16x9 => {
                (Format::Bf16, Format::Bf16)
            }
            Algorithm::F16 => (Format::F16, Format::F16),
            Algorithm::Fp8 { a, b, .. } => (a, b),
        }
    }

    /// Number of split levels (0 for algorithms that do not split).
    pub fn split_levels(&self) -> usize {
        match self {
            Algorithm::Bf16x3 => 2,
            Algorithm::Bf16x6 => 3,
            Algorithm::Bf16x9 => 5,
            _ => 0,
        }
    }

    /// How many bf16 parts (h, m, l) of each operand the levels use.
    pub fn split_parts(&self) -> usize {
        match self.split_levels() {
            0 => 0,
            2 => 2,
            _ => 3,
        }
    }

    /// Whether it is a split-bf16 algorithm (bf16x3, x6, x9).
    pub fn is_split(&self) -> bool {
        self.split_levels() > 0
    }

    /// Whether it is an fp8 algorithm.
    pub fn is_fp8(&self) -> bool {
        matches!(self, Algorithm::Fp8 { .. })
    }

    /// The scales' choice of an fp8 algorithm; None for the others.
    pub fn scaling(&self) -> Option<Scaling> {
        match self {
            Algorithm::Fp8 { scaling, .. } => Some(*scaling),
            _ => None,
        }
    }

    /// Bytes one operand element occupies on a device.
    pub fn bytes_per_element(&self) -> (usize, usize) {
        let (a, b) = self.operand_formats();
        let parts = self.split_parts().max(1);
        (a.storage_bytes() * parts, b.storage_bytes() * parts)
    }

    /// Range of the relative Frobenius error against an f64 product of the original inputs that
    /// this algorithm gives on N(0,1) inputs with inner dimension up to a few thousand. The low
    /// end proves the inputs really were rounded; the high end that nothing else was lost. Derived
    /// from the formats' unit roundoff (input rounding dominates) and f32 accumulation (~sqrt(K)
    /// ulps); docs/design.md quotes PyTorch's figures at n = 4096 inside each range.
    pub fn expected_error_n01(&self) -> (f64, f64) {
        match self {
            Algorithm::F32 => (0.0, 1e-5),
            Algorithm::Tf32 | Algorithm::F16 => (1.5e-4, 8e-4),
            Algorithm::Bf16 => (1e-3, 5e-3),
            Algorithm::Bf16x3 => (1e-6, 3e-5),
            Algorithm::Bf16x6 | Algorithm::Bf16x9 => (0.0, 4e-6),
            Algorithm::Fp8 { a, b, .. } => match (a, b) {
                (Format::E4m3, Format::E4m3) => (1e-2, 8e-2),
                (Format::E5m2, Format::E5m2) => (2e-2, 1.6e-1),
                _ => (1.5e-2, 1.2e-1),
            },
        }
    }

    /// Elementwise tolerance between two implementations of this algorithm that differ only in
    /// accumulation order: |C1 - C2| <= tol * (|A| |B|) (the product of absolute values). A
    /// summation of K terms in f32 in any order errs by at most about K ulps of that magnitude;
    /// the split levels add one rounding each, fp8 a division by the scales.
    pub fn accumulation_tolerance(&self, k: usize) -> f64 {
        2.0 * (k as f64 + self.extra_roundings()) * UNIT_ROUNDOFF_F32
    }

    /// Roundings beyond the K additions: the result's, one per split level, fp8's unscaling.
    fn extra_roundings(&self) -> f64 {
        self.split_levels() as f64 + if self.is_fp8() { 8.0 } else { 2.0 }
    }

    /// The whole-product band (docs/design.md, "Tolerances"): how far, in the root of summed
    /// squares over C, two implementations of this algorithm that differ only in accumulation
    /// order may be apart. Per element, from the exact value `exact`, |A||B| `abs` and the
    /// largest partial sum `peak` of its K terms:
    ///
    /// 2u (F sqrt(n) peak + n exact^2 / abs), n = K + the extra roundings, F = `BAND_FACTOR`.
    ///
    /// A sum of n terms in f32 adds n roundings of at most u times a partial sum. Where they are
    /// independent (terms of random sign and value) they grow as sqrt(n): the first term. Where
    /// they repeat (terms of one sign and nearly one value, as in a matrix of constants) they
    /// add up coherently, to about n u |C|: the second term, which exact^2 / abs makes vanish
    /// for terms of random sign (|C| ~ abs / sqrt(K) there) and equal to n |C| for terms of one
    /// sign. A product missing a fraction f of its terms of random sign is off by about
    /// sqrt(f) |C|, far outside this band for any f a wrong kernel drops.
    pub fn accumulation_band(&self, k: usize, exact: f64, abs: f64, peak: f64) -> f64 {
        let n = k as f64 + self.extra_roundings();
        let coherent = if abs > 0.0 { exact * exact / abs } else { 0.0 };
        2.0 * UNIT_ROUNDOFF_F32 * (BAND_FACTOR * n.sqrt() * peak + n * coherent)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.base_name())?;
        match self {
            Algorithm::Fp8 { scaling, .. } if *scaling != Scaling::Tensorwise => {
                write!(f, ":{scaling}")
            }
            _ => Ok(()),
        }
    }
}

impl FromStr for Algorithm {
    type Err = Error;
    /// `NAME[:SCALING]`, e.g. "bf16x3", "e4m3", "e4m3-e5m2:rowwise", "e5m2:given=0.5/2" (or
    /// "e5m2:given=0.5,2" where one algorithm is named, not a list).
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim().to_ascii_lowercase();
        let (name, scaling) = match s.split_once(':') {
            Some((name, scaling)) => (name, Some(scaling.parse::<Scaling>()?)),
            None => (s.as_str(), None),
        };
        let found = Algorithm::ALL.into_iter().find(|a| a.base_name() == name);
        match (found, scaling) {
            (Some(alg), None) => Ok(alg),
            (Some(alg @ Algorithm::Fp8 { .. }), Some(scaling)) => Ok(alg.with_scaling(scaling)),
            (Some(alg), Some(_)) => Err(Error::invalid(
                "algorithm",
                format!("'{s}': only fp8 algorithms take a scaling, {alg} does not"),
            )),
            (None, _) => Err(Error::UnknownName {
                kind: "algorithm",
                given: s.clone(),
                valid: Algorithm::ALL.iter().map(|a| a.base_name()).collect(),
            }),
        }
    }
}

impl From<Algorithm> for String {
    fn from(a: Algorithm) -> String {
        a.to_string()
    }
}

impl TryFrom<String> for Algorithm {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

/// The shape of a (batched) matmul C\[b\] = op(A\[b\]) . op(B\[b\]), every operand row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulShape {
    /// Independent products (1 for a plain matmul).
    pub batch: usize,
    /// Rows of C and of op(A).
    pub m: usize,
    /// Columns of C and of op(B).
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// A is stored as k x m (and used transposed).
    pub a_transposed: bool,
    /// B is stored as n x k (and used transposed).
    pub b_transposed: bool,
}

/// The most elements one operand (or the result) of a shape asked for by name (`--sizes`, the
/// report's sizes) may have: 2^31 f32 values, 8 GiB, more than any benchmark or report needs.
pub const MAX_OPERAND_ELEMENTS: usize = 1 << 31;

impl MatmulShape {
    /// Why m x n x k is not a shape to allocate (a zero dimension, an operand beyond
    /// `MAX_OPERAND_ELEMENTS`), checked with overflow-checked arithmetic before anything exists.
    pub fn check_requested(m: usize, n: usize, k: usize) -> std::result::Result<(), String> {
        if m == 0 || n == 0 || k == 0 {
            return Err("every dimension must be at least 1".into());
        }
        let fits = |a: usize, b: usize| a.checked_mul(b).is_some_and(|e| e <= MAX_OPERAND_ELEMENTS);
        if !(fits(m, k) && fits(k, n) && fits(m, n)) {
            return Err(format!(
                "an operand would exceed {MAX_OPERAND_ELEMENTS} elements"
            ));
        }
        Ok(())
    }

    /// A plain m x n x k product: one batch, no transposes.
    pub fn new(m: usize, n: usize, k: usize) -> MatmulShape {
        MatmulShape {
            batch: 1,
            m,
            n,
            k,
            a_transposed: false,
            b_transposed: false,
        }
    }

    /// `batch` products of m x n x k, A stored k x m when `a_transposed`, B stored n x k when
    /// `b_transposed` (attention: one batch per sequence and head).
    pub fn batched(
        batch: usize,
        (m, n, k): (usize, usize, usize),
        a_transposed: bool,
        b_transposed: bool,
    ) -> MatmulShape {
        MatmulShape {
            batch,
            m,
            n,
            k,
            a_transposed,
            b_transposed,
        }
    }

    /// The shape of C = A . B for A with `a` = (rows, cols) and B with `b` = (rows, cols).
    pub fn from_operands(a: (usize, usize), b: (usize, usize)) -> Result<MatmulShape> {
        if a.1 != b.0 {
            return Err(Error::ShapeMismatch {
                a_rows: a.0,
                a_cols: a.1,
                b_rows: b.0,
                b_cols: b.1,
            });
        }
        Ok(MatmulShape::new(a.0, b.1, a.1))
    }

    /// Elements of A (every batch).
    pub fn a_len(&self) -> usize {
        self.batch * self.m * self.k
    }
    /// Elements of B (every batch).
    pub fn b_len(&self) -> usize {
        self.batch * self.k * self.n
    }
    /// Elements of C (every batch).
    pub fn c_len(&self) -> usize {
        self.batch * self.m * self.n
    }

    /// Index of A's logical element (batch, row i, column p) in its row-major storage.
    pub fn a_index(&self, batch: usize, i: usize, p: usize) -> usize {
        let base = batch * self.m * self.k;
        if self.a_transposed {
            base + p * self.m + i
        } else {
            base + i * self.k + p
        }
    }

    /// Index of B's logical element (batch, row p, column j) in its row-major storage.
    pub fn b_index(&self, batch: usize, p: usize, j: usize) -> usize {
        let base = batch * self.k * self.n;
        if self.b_transposed {
            base + j * self.k + p
        } else {
            base + p * self.n + j
        }
    }

    /// Floating-point operations of the product, 2 m n k per batch (the convention of TFLOP/s
    /// figures).
    pub fn flops(&self) -> f64 {
        2.0 * self.batch as f64 * self.m as f64 * self.n as f64 * self.k as f64
    }

    /// Checks that the operand slices have the lengths this shape needs, and that C's length
    /// can be counted (the result's host buffer is asked for where it is made, `memory`).
    pub fn check(&self, a_len: usize, b_len: usize) -> Result<()> {
        let product = |x: usize, y: usize, z: usize| x.checked_mul(y)?.checked_mul(z);
        for (what, expected, got) in [
            (
                "matmul operand A",
                product(self.batch, self.m, self.k),
                a_len,
            ),
            (
                "matmul operand B",
                product(self.batch, self.k, self.n),
                b_len,
            ),
        ] {
            if expected != Some(got) {
                return Err(Error::LengthMismatch {
                    what,
                    expected: expected.unwrap_or(usize::MAX),
                    got,
                });
            }
        }
        self.checked_c_len().map(|_| ())
    }

    /// C's length, or `HostOutOfMemory` where it does not fit in the address space.
    pub fn checked_c_len(&self) -> Result<usize> {
        self.batch
            .checked_mul(self.m)
            .and_then(|x| x.checked_mul(self.n))
            .ok_or_else(|| Error::HostOutOfMemory {
                what: format!("C of {} x {}x{}", self.batch, self.m, self.n),
                bytes: None,
                available: None,
            })
    }
}
