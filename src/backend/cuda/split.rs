//! Split-bf16 matmuls as cuBLAS bf16 GEMMs with f32 output, one per level: what tensor cores
//! run at vendor speed on every NVIDIA GPU, without a kernel to tune.
//!
//! Each operand is split once (`split_planes` in cuda/cast.cu) into bf16 planes laid out so that
//! every level is one GEMM over a contiguous stretch of K: A holds `[h, h', m, l]` side by side
//! along K (row i: `h(i, 0..K), h'(i, 0..K), ...`), B the same planes stacked in reverse,
//! `[l; m; h'; h]`. h' is h with non-finite values as 0 (the lower levels' factor: their terms
//! use 0 there, docs/design.md). A level's terms then pair A's slots `a..a+w` with B's
//! `b..b+w` one to one: level 1 (h.m + m.h) is A's `[h', m]` times B's `[m; h']`, level 2 is
//! A's `[h', m, l]` times B's `[l; m; h']`, and so on; bf16x3 drops l.
//!
//! The contract's sum: one f32 accumulator per level, smallest level first. The lower levels go
//! into a scratch sum (the smallest with beta 0, each larger one added by cuBLAS's beta = 1 in
//! f32), level 0 into C, and C += scratch last. Level 0 of bf16x6 and bf16x9 is promoted: GEMMs
//! over K chunks of `PROMOTE_K`, each added to C in f32 (beta = 1), so the tensor core's own
//! accumulation never runs long enough to stall (it does near 1e-5 relative); the lower levels
//! are 2^-8 and smaller, so their accumulation error is scaled down with them and they run whole.
//!
//! `GemmCall` is data: the backend runs it through cublasGemmStridedBatchedEx, and
//! tests/cuda.rs runs the same calls on the host over the planes the real split kernel wrote
//! (the NVRTC host harness), against the reference, so the layout and the offsets are checked
//! on machines without a GPU.

use crate::algorithm::{Algorithm, MatmulShape, SPLIT_LEVELS};
use crate::error::{Error, Result};

/// Level 0's K chunk for bf16x6 and bf16x9 (the fused kernel promotes at the same length).
pub const PROMOTE_K: usize = 256;

/// Planes of a split operand, in A's slot order.
pub const H: usize = 0;
/// h with non-finite values as 0.
pub const H_FINITE: usize = 1;
pub const M: usize = 2;
pub const L: usize = 3;

/// A slot a plane does not occupy (the kernel's "not written").
pub const NO_SLOT: u32 = u32::MAX;

/// How a split algorithm's planes are laid out and which levels it sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitLayout {
    /// bf16 parts of each operand the levels use (2: h, m; 3: h, m, l).
    pub parts: usize,
    /// Levels summed (2, 3 or 5).
    pub levels: usize,
}

/// Where a plane goes: one slot of K values per plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// A's first slot, B's first slot, and how many slots the level's GEMM sums over.
    pub a: usize,
    pub b: usize,
    pub width: usize,
}

/// Which buffer a GEMM writes: C, or the scratch sum of the lower levels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Out {
    C,
    Lower,
}

/// One strided-batched GEMM on row-major operands: for every batch `t`,
/// `out[t*c_stride + i*n + j] = sum_p A[a_offset + t*a_stride + i*lda + p]
/// * B[b_offset + t*b_stride + p*ldb + j] (+ out, where beta is 1)`, with `A` read transposed
/// (element (i, p) at `p*lda + i`) or B (element (p, j) at `j*ldb + p`) where said.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmCall {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    pub a_offset: usize,
    pub lda: usize,
    pub a_stride: usize,
    pub a_transposed: bool,
    pub b_offset: usize,
    pub ldb: usize,
    pub b_stride: usize,
    pub b_transposed: bool,
    pub c_stride: usize,
    /// 0: the GEMM's result replaces `out`; 1: it is added to it (in f32).
    pub beta: f32,
    pub out: Out,
}

impl GemmCall {
    /// The plain matmul of `shape` over its own operands.
    pub fn plain(shape: &MatmulShape) -> GemmCall {
        let (m, n, k) = (shape.m, shape.n, shape.k);
        GemmCall {
            m,
            n,
            k,
            batch: shape.batch,
            a_offset: 0,
            lda: if shape.a_transposed { m } else { k },
            a_stride: m * k,
            a_transposed: shape.a_transposed,
            b_offset: 0,
            ldb: if shape.b_transposed { k } else { n },
            b_stride: k * n,
            b_transposed: shape.b_transposed,
            c_stride: m * n,
            beta: 0.0,
            out: Out::C,
        }
    }

    /// The last element of A and of B the call reads, plus one (checked against the buffers'
    /// lengths before a launch).
    pub fn extents(&self) -> (usize, usize) {
        if self.m == 0 || self.n == 0 || self.k == 0 || self.batch == 0 {
            return (0, 0);
        }
        let last_batch = self.batch - 1;
        let (ar, ac) = (self.m - 1, self.k - 1);
        let a_last = if self.a_transposed {
            ac * self.lda + ar
        } else {
            ar * self.lda + ac
        };
        let (br, bc) = (self.k - 1, self.n - 1);
        let b_last = if self.b_transposed {
            bc * self.ldb + br
        } else {
            br * self.ldb + bc
        };
        (
            self.a_offset + last_batch * self.a_stride + a_last + 1,
            self.b_offset + last_batch * self.b_stride + b_last + 1,
        )
    }
}

impl SplitLayout {
    /// The layout of a split algorithm (None for the others).
    pub fn of(algorithm: &Algorithm) -> Option<SplitLayout> {
        algorithm.is_split().then(|| SplitLayout {
            parts: algorithm.split_parts(),
            levels: algorithm.split_levels(),
        })
    }

    /// Slots per operand: h and the parts' planes (h', m, l).
    pub fn slots(&self) -> usize {
        self.parts + 1
    }

    /// A's slot of each plane (`H`, `H_FINITE`, `M`, `L`), `NO_SLOT` for an unused one.
    pub fn a_slots(&self) -> [u32; 4] {
        std::array::from_fn(|p| if p < self.slots() { p as u32 } else { NO_SLOT })
    }

    /// B's slot of each plane: A's order reversed.
    pub fn b_slots(&self) -> [u32; 4] {
        let s = self.slots();
        std::array::from_fn(|p| if p < s { (s - 1 - p) as u32 } else { NO_SLOT })
    }

    /// The slots level `level` sums over. Level 0 is h times h; a lower level's term
    /// (part x of A, part y of B) reads A's plane of part x (h' for h) and B's of part y, and
    /// the terms must pair A's and B's slots one to one along a contiguous stretch.
    pub fn span(&self, level: usize) -> Result<Span> {
        let terms = SPLIT_LEVELS
            .get(level)
            .filter(|_| level < self.levels)
            .ok_or_else(|| Error::invalid("split level", format!("{level} of {}", self.levels)))?;
        let plane = |part: usize| if level == 0 { H } else { part + 1 };
        let (a, b) = (self.a_slots(), self.b_slots());
        let pairs: Vec<(usize, usize)> = terms
            .iter()
            .map(|&(x, y)| (a[plane(x)] as usize, b[plane(y)] as usize))
            .collect();
        let a0 = pairs.iter().map(|p| p.0).min().unwrap_or(0);
        let b0 = pairs.iter().map(|p| p.1).min().unwrap_or(0);
        let width = pairs.len();
        let contiguous = pairs
            .iter()
            .all(|&(x, y)| x - a0 == y - b0 && x - a0 < width && x < self.slots());
        let distinct = (0..width).all(|t| pairs.iter().any(|&(x, _)| x - a0 == t));
        if !(contiguous && distinct) {
            return Err(Error::invalid(
                "split layout",
                format!("level {level}'s terms do not pair contiguous slots: {pairs:?}"),
            ));
        }
        Ok(Span {
            a: a0,
            b: b0,
            width,
        })
    }

    /// Elements of A's and B's plane buffers for `shape` (batch * m * slots * k, and
    /// batch * slots * k * n), checked against overflow.
    pub fn plane_lens(&self, shape: &MatmulShape) -> Result<(usize, usize)> {
        let too_large =
            || Error::invalid("matmul shape", "split planes would overflow memory sizes");
        let per = shape.k.checked_mul(self.slots()).ok_or_else(too_large)?;
        let a = [shape.batch, shape.m, per]
            .iter()
            .try_fold(1usize, |x, &y| x.checked_mul(y))
            .ok_or_else(too_large)?;
        let b = [shape.batch, shape.n, per]
            .iter()
            .try_fold(1usize, |x, &y| x.checked_mul(y))
            .ok_or_else(too_large)?;
        Ok((a, b))
    }

    /// The GEMMs of one matmul, in order: the lower levels into the scratch sum, smallest
    /// first; then level 0 into C (in chunks of `PROMOTE_K` for bf16x6 and bf16x9). C += the
    /// scratch sum comes after them (`needs_lower` says whether there is one).
    pub fn calls(&self, shape: &MatmulShape) -> Result<Vec<GemmCall>> {
        let (m, n, k) = (shape.m, shape.n, shape.k);
        let slots = self.slots();
        let base = GemmCall {
            m,
            n,
            k,
            batch: shape.batch,
            a_offset: 0,
            lda: slots * k,
            a_stride: m * slots * k,
            a_transposed: false,
            b_offset: 0,
            ldb: n,
            b_stride: slots * k * n,
            b_transposed: false,
            c_stride: m * n,
            beta: 0.0,
            out: Out::C,
        };
        let mut calls = Vec::new();
        if k == 0 {
            return Ok(calls);
        }
        for level in (1..self.levels).rev() {
            let span = self.span(level)?;
            calls.push(GemmCall {
                k: span.width * k,
                a_offset: span.a * k,
                b_offset: span.b * k * n,
                beta: if level == self.levels - 1 { 0.0 } else { 1.0 },
                out: Out::Lower,
                ..base
            });
        }
        let span = self.span(0)?;
        let chunk = if self.levels >= 3 { PROMOTE_K } else { k };
        for start in (0..k).step_by(chunk) {
            calls.push(GemmCall {
                k: chunk.min(k - start),
                a_offset: span.a * k + start,
                b_offset: (span.b * k + start) * n,
                beta: if start == 0 { 0.0 } else { 1.0 },
                out: Out::C,
                ..base
            });
        }
        Ok(calls)
    }

    /// Whether the lower levels' sum is added to C after the calls.
    pub fn needs_lower(&self) -> bool {
        self.levels > 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_level_pairs_contiguous_slots() {
        for alg in [Algorithm::Bf16x3, Algorithm::Bf16x6, Algorithm::Bf16x9] {
            let layout = SplitLayout::of(&alg).unwrap();
            for (level, terms) in SPLIT_LEVELS.iter().enumerate().take(layout.levels) {
                let span = layout.span(level).unwrap();
                assert_eq!(span.width, terms.len(), "{alg} level {level}");
                assert!(span.a + span.width <= layout.slots());
                assert!(span.b + span.width <= layout.slots());
            }
            assert!(layout.span(layout.levels).is_err());
        }
        // Level 1 of bf16x9: A's [h', m] against B's [m; h'] (B is [l; m; h'; h]).
        let x9 = SplitLayout::of(&Algorithm::Bf16x9).unwrap();
        assert_eq!(
            x9.span(1).unwrap(),
            Span {
                a: 1,
                b: 1,
                width: 2
            }
        );
        assert_eq!(
            x9.span(0).unwrap(),
            Span {
                a: 0,
                b: 3,
                width: 1
            }
        );
    }

    #[test]
    fn calls_stay_within_the_planes_and_promote_level_zero() {
        let shape = MatmulShape {
            batch: 3,
            ..MatmulShape::new(17, 9, 600)
        };
        for alg in [Algorithm::Bf16x3, Algorithm::Bf16x6, Algorithm::Bf16x9] {
            let layout = SplitLayout::of(&alg).unwrap();
            let (a_len, b_len) = layout.plane_lens(&shape).unwrap();
            let calls = layout.calls(&shape).unwrap();
            for c in &calls {
                let (a, b) = c.extents();
                assert!(a <= a_len && b <= b_len, "{alg}: {c:?}");
            }
            let level0: Vec<_> = calls.iter().filter(|c| c.out == Out::C).collect();
            let chunks = if layout.levels >= 3 {
                600usize.div_ceil(PROMOTE_K)
            } else {
                1
            };
            assert_eq!(level0.len(), chunks, "{alg}");
            assert_eq!(level0.iter().map(|c| c.k).sum::<usize>(), 600);
            assert_eq!(calls.len(), layout.levels - 1 + chunks);
        }
        assert!(
            SplitLayout::of(&Algorithm::Bf16x9)
                .unwrap()
                .plane_lens(&MatmulShape::new(1 << 20, 1 << 20, usize::MAX / 8))
                .is_err()
        );
    }
}
