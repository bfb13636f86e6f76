//! The input families of the report.

use crate::algorithm::MatmulShape;
use crate::error::{Error, Result};
use crate::measure;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// A family of matmul inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// N(0,1) entries.
    Normal,
    /// Random signs, magnitudes log-uniform over 2^-20..2^20.
    WideRange,
    /// A = [X X], B = [Y; -Y + 1e-3 Z]: every dot product cancels down to X . (1e-3 Z).
    Cancellation,
    /// Rows of A at each format's overflow and underflow thresholds; B is N(0,1).
    Extremes,
    /// N(0,1) with NaN and inf in a few rows of A and columns of B.
    NonFinite,
}

impl Family {
    /// Every family, in the report's order.
    pub const ALL: [Family; 5] = [
        Family::Normal,
        Family::WideRange,
        Family::Cancellation,
        Family::Extremes,
        Family::NonFinite,
    ];

    /// Its name in reports and on the command line ("normal", "wide-range", ...).
    pub fn name(self) -> &'static str {
        match self {
            Family::Normal => "normal",
            Family::WideRange => "wide-range",
            Family::Cancellation => "cancellation",
            Family::Extremes => "extremes",
            Family::NonFinite => "non-finite",
        }
    }

    /// The family named `s` (surrounding spaces ignored), or an error listing the names.
    pub fn parse(s: &str) -> Result<Family> {
        Family::ALL
            .into_iter()
            .find(|f| f.name() == s.trim())
            .ok_or_else(|| Error::UnknownName {
                kind: "input family",
                given: s.to_string(),
                valid: Family::ALL.iter().map(|f| f.name().to_string()).collect(),
            })
    }

    /// Row-major A (m x k) and B (k x n).
    pub fn inputs(self, shape: &MatmulShape, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let (m, n, k) = (shape.m, shape.n, shape.k);
        match self {
            Family::Normal => (
                measure::normal(m * k, seed),
                measure::normal(k * n, seed + 1),
            ),
            Family::WideRange => (
                measure::wide_range(m * k, seed),
                measure::wide_range(k * n, seed + 1),
            ),
            Family::Cancellation => {
                let half = (k / 2).max(1);
                let x = measure::normal(m * half, seed);
                let y = measure::normal(half * n, seed + 1);
                let z = measure::normal(k * n, seed + 2);
                let a = (0..m * k)
                    .map(|e| x[(e / k) * half + (e % k) % half])
                    .collect();
                let b = (0..k * n)
                    .map(|e| {
                        let (p, j) = (e / n, e % n);
                        if p < half {
                            y[p * n + j]
                        } else {
                            -y[(p - half) % half * n + j] + 1e-3 * z[e]
                        }
                    })
                    .collect();
                (a, b)
            }
            Family::Extremes => {
                // Each row of A sits at one threshold (within +-10%, random signs): f16's max
                // and just beyond it, e5m2's and e4m3's max, f32's max scaled so that a row's
                // sum still fits, f16's smallest normal and subnormal, e4m3's subnormals, f32's
                // smallest normal. B is N(0,1), so C's rows keep their row's magnitude.
                let levels = [
                    65504.0,
                    70000.0,
                    57344.0,
                    448.0,
                    f32::MAX / (8.0 * k as f32),
                    6.1e-5,
                    6.0e-8,
                    2.0e-3,
                    1.18e-38,
                ];
                let mut rng = StdRng::seed_from_u64(seed);
                let a = (0..m * k)
                    .map(|e| {
                        let sign = if rng.random::<bool>() { 1.0 } else { -1.0 };
                        sign * levels[(e / k) % levels.len()] * rng.random_range(0.9f32..1.1)
                    })
                    .collect();
                (a, measure::normal(k * n, seed + 1))
            }
            Family::NonFinite => {
                let mut a = measure::normal(m * k, seed);
                let mut b = measure::normal(k * n, seed + 1);
                let specials = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
                for (t, row) in (0..m).step_by(7).enumerate() {
                    a[row * k + (t * 5) % k] = specials[t % 3];
                }
                for (t, col) in (0..n).step_by(11).enumerate() {
                    b[((t * 3) % k) * n + col] = specials[(t + 1) % 3];
                }
                (a, b)
            }
        }
    }
}
