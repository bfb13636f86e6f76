//! Split-bf16 matmuls as cuBLAS bf16 GEMMs with f32 output: what tensor cores run at vendor
//! speed on every NVIDIA GPU, without a kernel to tune.
//!
//! Each operand is split once (`split_planes` in cuda/cast.cu) into bf16 planes laid out so that
//! every level is one GEMM over a contiguous stretch of K: A holds `[h, h', m, l]` side by side
//! along K (row i: `h(i, 0..K), h'(i, 0..K), ...`), B holds h first, then the other planes in
//! reverse: `[h; l; m; h']` (bf16x3, which has no l: `[h; m; h']`). h' is h with non-finite
//! values as 0 (the lower levels' factor: their terms use 0 there, docs/design.md). A level's
//! terms then pair A's slots `a..a+w` with B's `b..b+w` one to one: level 1 (h.m + m.h) is A's
//! `[h', m]` times B's `[m; h']`, level 2 A's `[h', m, l]` times B's `[l; m; h']`, and so on;
//! bf16x3's two levels together are A's `[h, h', m]` times B's `[h; m; h']`, whole.
//!
//! The GEMMs over those planes are arranged in one of three ways (`Arrangement`), each the
//! contract's sum (one f32 accumulator per level, the smallest level first) except where said:
//! - `PerLevel`: one GEMM per level. The lower levels are summed first, the smallest with
//!   beta 0 and each larger one added by cuBLAS's beta = 1 (in f32), and level 0 adds that sum
//!   with beta = 1 in its epilogue: C = L0 + (L1 + ...). Level 0 of bf16x6 and bf16x9 is
//!   promoted instead: GEMMs over K chunks of `PROMOTE_K`, each added to C with beta = 1, so
//!   that the tensor core's own accumulation never runs long enough to stall (it does near
//!   1e-5 relative); the lower levels then go into a scratch sum that is added last. The lower
//!   levels are 2^-8 and smaller, so their accumulation error is scaled down with them and
//!   they run whole.
//! - `Tripled` (bf16x3 for K up to `TRIPLED_MAX_K`): one GEMM over the 3K of h.h, h'.m and m.h',
//!   PyTorch's and JAX's own method. One accumulator for both levels: less accurate than
//!   `PerLevel` (see `TRIPLED_MAX_K` for how much, and why it is offered at all).
//! - `Partials` (bf16x6 and bf16x9 where level 0 is promoted): level 0's chunks as
//!   strided-batched GEMMs writing f32 partial planes, a few at a time, summed in chunk order by
//!   train.cu's `sum_partials` (the same sums as `PerLevel`'s beta = 1 chain, in the same
//!   order), the lower levels into the plane after the last chunk, so that the last sum adds
//!   them too: fewer launches for long K.
//!
//! `Step` is data: the backend runs it through cublasGemmStridedBatchedEx and `sum_partials`,
//! and tests/cuda.rs runs the same steps on the host over the planes the real split kernel wrote
//! (the NVRTC host harness), against the reference, so the layout and the offsets are checked
//! on machines without a GPU.

use crate::algorithm::{Algorithm, MatmulShape, SPLIT_LEVELS};
use crate::error::{Error, Result};
use std::ops::Range;

/// Level 0's K chunk for bf16x6 and bf16x9 (the fused kernel promotes at the same length).
pub const PROMOTE_K: usize = 256;

/// The longest K for which bf16x3 is offered as one K-tripled GEMM. Its one accumulator sums
/// 3K terms where the per-level GEMMs' largest sums K, and a tensor core's f32 accumulation
/// errs in proportion to the terms it adds (it truncates): on an H200 the K-tripled GEMM erred
/// by 2.1e-5 at K = 4096 and 4.2e-5 at 8192 on N(0,1) inputs (the per-level GEMMs 6.3e-6 and
/// 1.0e-5), and bf16x3's band is 3e-5 (`Algorithm::expected_error_n01`). Element by element
/// its error stays far inside the contract's tolerance on every family of the report's inputs
/// (tests/cuda.rs emulates it), so the band sets the limit: 4096, where it was measured inside.
pub const TRIPLED_MAX_K: usize = 4096;

/// The most device memory `Partials` takes for its partial planes.
pub const PARTIALS_MAX_BYTES: usize = 512 << 20;

/// Planes of a split operand, in A's slot order.
pub const H: usize = 0;
/// h with non-finite values as 0.
pub const H_FINITE: usize = 1;
/// The middle part m = bf16(x - h).
pub const M: usize = 2;
/// The low part l = bf16(x - h - m).
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

/// Where cuda/cast.cu's `split_planes` reads and writes one operand of a matmul: element
/// (batch, r, c) of its `rows x cols` matrices at `x[batch*sb + r*sr + c*sc]` (`source`), its
/// planes' codes at `out[batch*ob + r*orow + c + slot*os]` (`out`), the slot of each plane
/// (`H`, `H_FINITE`, `M`, `L`) in `slots`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlaneMap {
    /// Rows of each matrix.
    pub rows: usize,
    /// Columns of each matrix.
    pub cols: usize,
    /// Strides (elements) of the source: per batch, per row, per column.
    pub source: [i64; 3],
    /// Strides (codes) of the planes: per batch, per row, per slot.
    pub out: [i64; 3],
    /// The slot of each plane (`H`, `H_FINITE`, `M`, `L`), or `NO_SLOT`.
    pub slots: [u32; 4],
}

/// Where a plane goes: one slot of K values per plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// A's first slot, B's first slot, and how many slots the GEMM sums over.
    pub a: usize,
    /// B's first slot.
    pub b: usize,
    /// Slots the GEMM sums over.
    pub width: usize,
}

/// How the GEMMs of a split matmul are arranged over its planes (the module's header says
/// what each computes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrangement {
    /// One GEMM per level, the smallest first (level 0 promoted in K chunks for bf16x6 and bf16x9).
    PerLevel,
    /// bf16x3 as one GEMM over 3K (one accumulator for both levels).
    Tripled,
    /// With room for `planes` partial planes.
    Partials {
        /// Partial planes the scratch buffer holds.
        planes: usize,
    },
}

/// Which buffer a GEMM writes: C, the scratch sum of the lower levels (`PerLevel` with level 0
/// promoted), or the partial planes (`Partials`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Out {
    /// The output C.
    C,
    /// The scratch sum of the lower levels.
    Lower,
    /// The partial planes.
    Partials,
}

/// One strided-batched GEMM on row-major operands: for every batch `t`,
/// `out[c_offset + t*c_stride + i*n + j] = sum_p A[a_offset + t*a_stride + i*lda + p]
/// * B[b_offset + t*b_stride + p*ldb + j] (+ out, where beta is 1)`, with `A` read transposed
/// (element (i, p) at `p*lda + i`) or B (element (p, j) at `j*ldb + p`) where said.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmCall {
    /// Rows of the output.
    pub m: usize,
    /// Columns of the output.
    pub n: usize,
    /// Terms summed per output element.
    pub k: usize,
    /// Independent GEMMs (strided batches).
    pub batch: usize,
    /// A's first element (elements from the buffer's start).
    pub a_offset: usize,
    /// A's leading dimension (elements between rows, or between columns where transposed).
    pub lda: usize,
    /// Elements between A's batches.
    pub a_stride: usize,
    /// A read transposed.
    pub a_transposed: bool,
    /// B's first element.
    pub b_offset: usize,
    /// B's leading dimension (elements between rows, or between columns where transposed).
    pub ldb: usize,
    /// Elements between B's batches.
    pub b_stride: usize,
    /// B read transposed.
    pub b_transposed: bool,
    /// The output's first element.
    pub c_offset: usize,
    /// Elements between the output's batches.
    pub c_stride: usize,
    /// 0: the GEMM's result replaces `out`; 1: it is added to it (in f32).
    pub beta: f32,
    /// The buffer written.
    pub out: Out,
}

/// One step of a split matmul, in order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Step {
    /// A GEMM.
    Gemm(GemmCall),
    /// C += the scratch sum of the lower levels, in f32.
    AddLower,
    /// The first `count` partial planes (of `batch * m * n` values each) summed in order,
    /// starting from 0 (train.cu's `sum_partials`): into C where `into_c`, else into plane 0,
    /// which then holds level 0's running sum for the next chunks.
    Sum {
        /// Partial planes summed.
        count: usize,
        /// Into C (the last sum), else into plane 0.
        into_c: bool,
    },
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
            c_offset: 0,
            c_stride: m * n,
            beta: 0.0,
            out: Out::C,
        }
    }

    /// The last element of A, of B and of the output the call touches, plus one (checked
    /// against the buffers' lengths before a launch).
    pub fn extents(&self) -> (usize, usize, usize) {
        if self.m == 0 || self.n == 0 || self.k == 0 || self.batch == 0 {
            return (0, 0, 0);
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
            self.c_offset + last_batch * self.c_stride + self.m * self.n,
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

    /// B's slot of each plane: h first, then A's other planes in reverse.
    pub fn b_slots(&self) -> [u32; 4] {
        let s = self.slots();
        std::array::from_fn(|p| match p {
            H => 0,
            p if p < s => (s - p) as u32,
            _ => NO_SLOT,
        })
    }

    /// The slots the terms of `levels` sum over, as one GEMM. Level 0 is h times h; a lower
    /// level's term (part x of A, part y of B) reads A's plane of part x (h' for h) and B's of
    /// part y, and the terms must pair A's and B's slots one to one along a contiguous stretch.
    pub fn span_over(&self, levels: Range<usize>) -> Result<Span> {
        if levels.is_empty() || levels.end > self.levels {
            return Err(Error::invalid(
                "split levels",
                format!("{levels:?} of {}", self.levels),
            ));
        }
        let (a, b) = (self.a_slots(), self.b_slots());
        let pairs: Vec<(usize, usize)> = levels
            .clone()
            .flat_map(|level| {
                let plane = move |part: usize| if level == 0 { H } else { part + 1 };
                SPLIT_LEVELS[level]
                    .iter()
                    .map(move |&(x, y)| (a[plane(x)] as usize, b[plane(y)] as usize))
            })
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
                format!("levels {levels:?}'s terms do not pair contiguous slots: {pairs:?}"),
            ));
        }
        Ok(Span {
            a: a0,
            b: b0,
            width,
        })
    }

    /// The slots level `level` sums over (`span_over` of it alone).
    pub fn span(&self, level: usize) -> Result<Span> {
        self.span_over(level..level + 1)
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

    /// How `split_planes` lays out A (m x k, row i of plane q at `i*slots*k + q*k`) and B
    /// (k x n, plane q's rows from `q*k*n`) of `shape`, transposed ones read as stored.
    pub fn plane_maps(&self, shape: &MatmulShape) -> [PlaneMap; 2] {
        let (m, n, k) = (shape.m as i64, shape.n as i64, shape.k as i64);
        let slots = self.slots() as i64;
        let (a_row, a_col) = if shape.a_transposed { (1, m) } else { (k, 1) };
        let (b_row, b_col) = if shape.b_transposed { (1, k) } else { (n, 1) };
        [
            PlaneMap {
                rows: shape.m,
                cols: shape.k,
                source: [m * k, a_row, a_col],
                out: [m * slots * k, slots * k, k],
                slots: self.a_slots(),
            },
            PlaneMap {
                rows: shape.k,
                cols: shape.n,
                source: [k * n, b_row, b_col],
                out: [slots * k * n, n, k * n],
                slots: self.b_slots(),
            },
        ]
    }

    /// Whether level 0 is summed in chunks of `PROMOTE_K` (bf16x6 and bf16x9 over longer K).
    pub fn promoted(&self, k: usize) -> bool {
        self.levels >= 3 && k > PROMOTE_K
    }

    /// How many partial planes `Partials` takes for `shape`: room for every chunk of level 0
    /// and the lower levels' plane where `PARTIALS_MAX_BYTES` allows, else at least four. None
    /// where level 0 is not promoted, or four planes do not fit.
    pub fn partial_planes(&self, shape: &MatmulShape) -> Option<usize> {
        let plane = shape.c_len();
        if !self.promoted(shape.k) || plane == 0 || plane > u32::MAX as usize {
            return None;
        }
        let wanted = shape.k.div_ceil(PROMOTE_K) + 1;
        let planes = wanted.min(PARTIALS_MAX_BYTES / (4 * plane));
        (planes >= wanted.min(4)).then_some(planes)
    }

    /// The arrangements this layout offers for `shape`, `PerLevel` first.
    pub fn arrangements(&self, shape: &MatmulShape) -> Vec<Arrangement> {
        let mut out = vec![Arrangement::PerLevel];
        if self.levels == 2 && shape.k <= TRIPLED_MAX_K {
            out.push(Arrangement::Tripled);
        }
        if let Some(planes) = self.partial_planes(shape) {
            out.push(Arrangement::Partials { planes });
        }
        out
    }

    /// The f32 values of scratch the arrangement needs besides C: the lower levels' sum, or
    /// the partial planes.
    pub fn scratch_len(&self, shape: &MatmulShape, arrangement: Arrangement) -> Result<usize> {
        Ok(match arrangement {
            Arrangement::PerLevel if self.promoted(shape.k) => shape.c_len(),
            Arrangement::PerLevel | Arrangement::Tripled => 0,
            Arrangement::Partials { planes } => planes
                .checked_mul(shape.c_len())
                .ok_or_else(|| Error::invalid("matmul shape", "partial planes overflow"))?,
        })
    }

    /// The steps of one matmul of `shape` in `arrangement`, in order.
    pub fn steps(&self, shape: &MatmulShape, arrangement: Arrangement) -> Result<Vec<Step>> {
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
            c_offset: 0,
            c_stride: m * n,
            beta: 0.0,
            out: Out::C,
        };
        // The GEMM of `span` over all of K (times its width).
        let over = |span: Span, beta: f32, out: Out, c_offset: usize| GemmCall {
            k: span.width * k,
            a_offset: span.a * k,
            b_offset: span.b * k * n,
            beta,
            out,
            c_offset,
            ..base
        };
        // The lower levels, smallest first, each added to the one below it.
        let lower = |out: Out, c_offset: usize| -> Result<Vec<Step>> {
            (1..self.levels)
                .rev()
                .map(|level| {
                    let beta = if level == self.levels - 1 { 0.0 } else { 1.0 };
                    Ok(Step::Gemm(over(self.span(level)?, beta, out, c_offset)))
                })
                .collect()
        };
        if k == 0 {
            return Ok(vec![]);
        }
        let mut steps = Vec::new();
        match arrangement {
            Arrangement::Tripled => {
                if self.levels != 2 {
                    return Err(Error::invalid(
                        "split arrangement",
                        "only bf16x3 sums its levels in one GEMM",
                    ));
                }
                steps.push(Step::Gemm(over(self.span_over(0..2)?, 0.0, Out::C, 0)));
            }
            Arrangement::PerLevel if !self.promoted(k) => {
                steps.extend(lower(Out::C, 0)?);
                let beta = if self.levels > 1 { 1.0 } else { 0.0 };
                steps.push(Step::Gemm(over(self.span(0)?, beta, Out::C, 0)));
            }
            Arrangement::PerLevel => {
                steps.extend(lower(Out::Lower, 0)?);
                let span = self.span(0)?;
                for start in (0..k).step_by(PROMOTE_K) {
                    steps.push(Step::Gemm(GemmCall {
                        k: PROMOTE_K.min(k - start),
                        a_offset: span.a * k + start,
                        b_offset: (span.b * k + start) * n,
                        beta: if start == 0 { 0.0 } else { 1.0 },
                        ..base
                    }));
                }
                steps.push(Step::AddLower);
            }
            Arrangement::Partials { planes } => {
                if !self.promoted(k) || planes < 3 {
                    return Err(Error::invalid(
                        "split arrangement",
                        format!("partial sums need level 0 in chunks and 3 planes, not {planes}"),
                    ));
                }
                let span = self.span(0)?;
                let plane = shape.c_len();
                let (chunks, full) = (k.div_ceil(PROMOTE_K), k / PROMOTE_K);
                // Chunks summed so far; planes holding a running sum (0 or 1).
                let (mut done, mut first) = (0, 0);
                loop {
                    let rest = chunks - done;
                    let last = first + rest < planes;
                    let take = if last { rest } else { planes - first };
                    for t in 0..shape.batch {
                        let (a_at, b_at) = (t * base.a_stride, t * base.b_stride);
                        let chunk = |count: usize, start: usize, len: usize, slot: usize| {
                            Step::Gemm(GemmCall {
                                k: len,
                                batch: count,
                                a_offset: a_at + span.a * k + start,
                                a_stride: PROMOTE_K,
                                b_offset: b_at + (span.b * k + start) * n,
                                b_stride: PROMOTE_K * n,
                                c_offset: slot * plane + t * m * n,
                                c_stride: plane,
                                out: Out::Partials,
                                ..base
                            })
                        };
                        let whole = take.min(full.saturating_sub(done));
                        if whole > 0 {
                            steps.push(chunk(whole, done * PROMOTE_K, PROMOTE_K, first));
                        }
                        if whole < take {
                            // The last chunk, shorter than the others.
                            steps.push(chunk(
                                1,
                                full * PROMOTE_K,
                                k - full * PROMOTE_K,
                                first + whole,
                            ));
                        }
                    }
                    if last {
                        let slot = first + take;
                        steps.extend(lower(Out::Partials, slot * plane)?);
                        steps.push(Step::Sum {
                            count: slot + 1,
                            into_c: true,
                        });
                        break;
                    }
                    steps.push(Step::Sum {
                        count: first + take,
                        into_c: false,
                    });
                    done += take;
                    first = 1;
                }
            }
        }
        Ok(steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPLITS: [Algorithm; 3] = [Algorithm::Bf16x3, Algorithm::Bf16x6, Algorithm::Bf16x9];

    #[test]
    fn every_level_pairs_contiguous_slots() {
        for alg in SPLITS {
            let layout = SplitLayout::of(&alg).unwrap();
            for (level, terms) in SPLIT_LEVELS.iter().enumerate().take(layout.levels) {
                let span = layout.span(level).unwrap();
                assert_eq!(span.width, terms.len(), "{alg} level {level}");
                assert!(span.a + span.width <= layout.slots());
                assert!(span.b + span.width <= layout.slots());
            }
            assert!(layout.span(layout.levels).is_err());
        }
        // Level 1 of bf16x9: A's [h', m] against B's [m; h'] (B is [h; l; m; h']).
        let x9 = SplitLayout::of(&Algorithm::Bf16x9).unwrap();
        let span = |a, b, width| Span { a, b, width };
        assert_eq!(x9.span(1).unwrap(), span(1, 2, 2));
        assert_eq!(x9.span(0).unwrap(), span(0, 0, 1));
        // bf16x3's two levels are one GEMM over all three slots (A [h, h', m], B [h; m; h']);
        // bf16x9's are not contiguous (l lies between h and m in B).
        let x3 = SplitLayout::of(&Algorithm::Bf16x3).unwrap();
        assert_eq!(x3.span_over(0..2).unwrap(), span(0, 0, 3));
        assert!(x9.span_over(0..2).is_err());
    }

    /// Every GEMM of every arrangement stays within the planes and its output.
    fn check_extents(alg: &Algorithm, shape: &MatmulShape, arrangement: Arrangement) -> Vec<Step> {
        let layout = SplitLayout::of(alg).unwrap();
        let (a_len, b_len) = layout.plane_lens(shape).unwrap();
        let steps = layout.steps(shape, arrangement).unwrap();
        let scratch = layout.scratch_len(shape, arrangement).unwrap();
        for step in &steps {
            if let Step::Gemm(c) = step {
                let (a, b, out) = c.extents();
                let out_len = match c.out {
                    Out::C => shape.c_len(),
                    Out::Lower | Out::Partials => scratch,
                };
                assert!(
                    a <= a_len && b <= b_len && out <= out_len,
                    "{alg} {arrangement:?}: {c:?}"
                );
            }
        }
        steps
    }

    fn gemms(steps: &[Step]) -> Vec<GemmCall> {
        steps
            .iter()
            .filter_map(|s| match s {
                Step::Gemm(c) => Some(*c),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn per_level_gemms_promote_level_zero_of_x6_and_x9_only() {
        let shape = MatmulShape {
            batch: 3,
            ..MatmulShape::new(17, 9, 600)
        };
        for alg in SPLITS {
            let layout = SplitLayout::of(&alg).unwrap();
            let steps = check_extents(&alg, &shape, Arrangement::PerLevel);
            let calls = gemms(&steps);
            let level0: Vec<_> = calls.iter().filter(|c| c.out == Out::C).collect();
            if layout.promoted(600) {
                assert_eq!(level0.len(), 600usize.div_ceil(PROMOTE_K), "{alg}");
                assert_eq!(level0.iter().map(|c| c.k).sum::<usize>(), 600);
                assert_eq!(steps.last(), Some(&Step::AddLower));
                assert_eq!(
                    layout.scratch_len(&shape, Arrangement::PerLevel).unwrap(),
                    3 * 17 * 9
                );
                assert_eq!(calls.len(), layout.levels - 1 + level0.len());
            } else {
                // bf16x3: level 1 into C, then level 0 added to it by its epilogue.
                assert_eq!(alg, Algorithm::Bf16x3);
                let betas: Vec<f32> = calls.iter().map(|c| c.beta).collect();
                assert_eq!(betas, [0.0, 1.0]);
                assert_eq!((calls[0].k, calls[1].k), (2 * 600, 600));
                assert!(calls.iter().all(|c| c.out == Out::C));
                assert_eq!(
                    layout.scratch_len(&shape, Arrangement::PerLevel).unwrap(),
                    0
                );
            }
        }
        // Up to one chunk of K, x6's levels all go into C, smallest first.
        let short = MatmulShape::new(5, 7, PROMOTE_K);
        let calls = gemms(&check_extents(
            &Algorithm::Bf16x6,
            &short,
            Arrangement::PerLevel,
        ));
        let summary: Vec<(usize, f32, Out)> = calls.iter().map(|c| (c.k, c.beta, c.out)).collect();
        let k = PROMOTE_K;
        assert_eq!(
            summary,
            [(3 * k, 0.0, Out::C), (2 * k, 1.0, Out::C), (k, 1.0, Out::C)]
        );
        assert!(
            SplitLayout::of(&Algorithm::Bf16x9)
                .unwrap()
                .plane_lens(&MatmulShape::new(1 << 20, 1 << 20, usize::MAX / 8))
                .is_err()
        );
    }

    #[test]
    fn the_tripled_gemm_is_one_call_over_three_k_for_bf16x3_alone() {
        let shape = MatmulShape {
            batch: 2,
            ..MatmulShape::new(33, 20, 300)
        };
        let steps = check_extents(&Algorithm::Bf16x3, &shape, Arrangement::Tripled);
        let call = GemmCall {
            m: 33,
            n: 20,
            k: 900,
            batch: 2,
            a_offset: 0,
            lda: 900,
            a_stride: 33 * 900,
            a_transposed: false,
            b_offset: 0,
            ldb: 20,
            b_stride: 900 * 20,
            b_transposed: false,
            c_offset: 0,
            c_stride: 33 * 20,
            beta: 0.0,
            out: Out::C,
        };
        assert_eq!(steps, [Step::Gemm(call)]);
        let x3 = SplitLayout::of(&Algorithm::Bf16x3).unwrap();
        assert_eq!(x3.scratch_len(&shape, Arrangement::Tripled).unwrap(), 0);
        for alg in [Algorithm::Bf16x6, Algorithm::Bf16x9] {
            let layout = SplitLayout::of(&alg).unwrap();
            assert!(layout.steps(&shape, Arrangement::Tripled).is_err(), "{alg}");
            assert!(!layout.arrangements(&shape).contains(&Arrangement::Tripled));
        }
        // Offered up to TRIPLED_MAX_K, not beyond.
        let at = |k| x3.arrangements(&MatmulShape::new(64, 64, k));
        assert!(at(TRIPLED_MAX_K).contains(&Arrangement::Tripled));
        assert!(!at(TRIPLED_MAX_K + 1).contains(&Arrangement::Tripled));
    }

    #[test]
    fn partial_sums_take_level_zero_in_groups_and_the_lower_levels_last() {
        let x6 = SplitLayout::of(&Algorithm::Bf16x6).unwrap();
        // 1100: four chunks of 256 and one of 76, two matmuls, three planes.
        let shape = MatmulShape {
            batch: 2,
            ..MatmulShape::new(5, 6, 1100)
        };
        let steps = check_extents(
            &Algorithm::Bf16x6,
            &shape,
            Arrangement::Partials { planes: 3 },
        );
        let plane = shape.c_len();
        let mut summary = vec![];
        for s in &steps {
            summary.push(match s {
                Step::Gemm(c) if c.out == Out::Partials && c.k <= PROMOTE_K => {
                    format!("{}x{} @{}", c.batch, c.k, c.c_offset / plane)
                }
                Step::Gemm(c) => format!("L{} @{}", c.k / 1100, c.c_offset / plane),
                Step::Sum { count, into_c } => format!("sum {count} {into_c}"),
                Step::AddLower => "add".into(),
            });
        }
        // Chunks 0-2 of each matmul into planes 0-2, summed into plane 0; chunks 3 and 4 (76
        // long) into planes 1 and 2, summed with plane 0 into it; the lower levels (L2 over
        // 3K, L1 over 2K) into plane 1, summed with plane 0 into C.
        let expect = [
            "3x256 @0",
            "3x256 @0",
            "sum 3 false",
            "1x256 @1",
            "1x76 @2",
            "1x256 @1",
            "1x76 @2",
            "sum 3 false",
            "L3 @1",
            "L2 @1",
            "sum 2 true",
        ];
        assert_eq!(summary, expect);
        // The second batch's chunks start one matmul further in A, B and the plane.
        let [Step::Gemm(t0), Step::Gemm(t1), ..] = steps[..] else {
            panic!("{steps:?}")
        };
        assert_eq!(t1.a_offset - t0.a_offset, 5 * 4 * 1100);
        assert_eq!(t1.b_offset - t0.b_offset, 4 * 1100 * 6);
        assert_eq!(t1.c_offset - t0.c_offset, 5 * 6);
        assert_eq!(
            (t0.a_stride, t0.b_stride, t0.c_stride),
            (PROMOTE_K, PROMOTE_K * 6, plane)
        );
        // Room for all: one group, one sum.
        let planes = x6.partial_planes(&shape).unwrap();
        assert_eq!(planes, 1100usize.div_ceil(PROMOTE_K) + 1);
        let steps = check_extents(&Algorithm::Bf16x6, &shape, Arrangement::Partials { planes });
        let sums: Vec<_> = steps
            .iter()
            .filter(|s| matches!(s, Step::Sum { .. }))
            .collect();
        assert_eq!(
            sums,
            [&Step::Sum {
                count: 6,
                into_c: true
            }]
        );
        // Not offered where level 0 is one chunk, nor for bf16x3, nor where four planes of C
        // exceed the budget.
        assert_eq!(x6.partial_planes(&MatmulShape::new(8, 8, PROMOTE_K)), None);
        let x3 = SplitLayout::of(&Algorithm::Bf16x3).unwrap();
        assert_eq!(x3.partial_planes(&shape), None);
        let side = ((PARTIALS_MAX_BYTES / 16) as f64).sqrt() as usize + 1;
        assert_eq!(x6.partial_planes(&MatmulShape::new(side, side, 4096)), None);
        assert!(
            x6.steps(&shape, Arrangement::Partials { planes: 2 })
                .is_err()
        );
    }
}
