//! The training ops besides matmul, forward and backward, as the host reference defines them.
//!
//! Each backward rule sits beside its forward op. The ops are generic over the float type so
//! that tests check every gradient with finite differences in f64; training runs them in f32
//! (accumulating reductions in f64). Shapes are row-major; `rows x c` means `rows` vectors of
//! length `c`.

use super::matmul::matmul_into;
use crate::algorithm::MatmulShape;
use crate::format::{Format, Overflow};
use crate::plan::{AdamW, Attention, MaskKind, ScoreMask, ScoreScale, Unary};
use num_traits::Float;

fn cast<T: Float>(x: f64) -> T {
    T::from(x).unwrap_or_else(T::nan)
}

fn f64_of<T: Float>(x: T) -> f64 {
    x.to_f64().unwrap_or(f64::NAN)
}

/// Layer norm over each row of length `c` (eps 1e-5): y = (x - mean) * rstd * g + b.
/// Returns y and the per-row mean and rstd the backward pass needs.
pub fn layernorm_fwd<T: Float>(x: &[T], g: &[T], b: &[T], c: usize) -> (Vec<T>, Vec<T>, Vec<T>) {
    let rows = x.len() / c;
    let mut y = vec![T::zero(); x.len()];
    let (mut means, mut rstds) = (Vec::with_capacity(rows), Vec::with_capacity(rows));
    for r in 0..rows {
        let xr = &x[r * c..(r + 1) * c];
        let mean = xr.iter().map(|&v| f64_of(v)).sum::<f64>() / c as f64;
        let var = xr.iter().map(|&v| (f64_of(v) - mean).powi(2)).sum::<f64>() / c as f64;
        let rstd = 1.0 / (var + 1e-5).sqrt();
        for i in 0..c {
            y[r * c + i] = cast::<T>((f64_of(xr[i]) - mean) * rstd) * g[i] + b[i];
        }
        means.push(cast(mean));
        rstds.push(cast(rstd));
    }
    (y, means, rstds)
}

/// Layer norm backward: (dx, dg, db).
pub fn layernorm_bwd<T: Float>(
    dy: &[T],
    x: &[T],
    g: &[T],
    mean: &[T],
    rstd: &[T],
    c: usize,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let rows = x.len() / c;
    let mut dx = vec![T::zero(); x.len()];
    let mut dg = vec![0f64; c];
    let mut db = vec![0f64; c];
    for r in 0..rows {
        let (m, s) = (f64_of(mean[r]), f64_of(rstd[r]));
        let mut sum_dxhat = 0f64;
        let mut sum_dxhat_xhat = 0f64;
        for i in 0..c {
            let xhat = (f64_of(x[r * c + i]) - m) * s;
            let d = f64_of(dy[r * c + i]);
            let dxhat = d * f64_of(g[i]);
            sum_dxhat += dxhat;
            sum_dxhat_xhat += dxhat * xhat;
            dg[i] += d * xhat;
            db[i] += d;
        }
        for i in 0..c {
            let xhat = (f64_of(x[r * c + i]) - m) * s;
            let dxhat = f64_of(dy[r * c + i]) * f64_of(g[i]);
            dx[r * c + i] =
                cast(s * (dxhat - sum_dxhat / c as f64 - xhat * sum_dxhat_xhat / c as f64));
        }
    }
    (
        dx,
        dg.into_iter().map(cast).collect(),
        db.into_iter().map(cast).collect(),
    )
}

/// RMS norm over each row of length `c` (torch.nn.RMSNorm): y = x * rstd * g, rstd =
/// 1 / sqrt(mean(x^2) + eps). Returns y and the per-row rstd the backward pass needs.
pub fn rmsnorm_fwd<T: Float>(x: &[T], g: &[T], c: usize, eps: f32) -> (Vec<T>, Vec<T>) {
    let rows = x.len() / c.max(1);
    let mut y = vec![T::zero(); x.len()];
    let mut rstds = Vec::with_capacity(rows);
    for r in 0..rows {
        let xr = &x[r * c..(r + 1) * c];
        let ms = xr.iter().map(|&v| f64_of(v).powi(2)).sum::<f64>() / c as f64;
        let rstd = 1.0 / (ms + eps as f64).sqrt();
        for i in 0..c {
            y[r * c + i] = cast::<T>(f64_of(xr[i]) * rstd) * g[i];
        }
        rstds.push(cast(rstd));
    }
    (y, rstds)
}

/// RMS norm backward: (dx, dg); dx = rstd * (d - xhat * mean(d * xhat)), d = dy * g,
/// xhat = x * rstd; dg summed over the rows in f64.
pub fn rmsnorm_bwd<T: Float>(dy: &[T], x: &[T], g: &[T], rstd: &[T], c: usize) -> (Vec<T>, Vec<T>) {
    let rows = x.len() / c.max(1);
    let mut dx = vec![T::zero(); x.len()];
    let mut dg = vec![0f64; c];
    for r in 0..rows {
        let s = f64_of(rstd[r]);
        let mut sum_dxhat_xhat = 0f64;
        for i in 0..c {
            let xhat = f64_of(x[r * c + i]) * s;
            let d = f64_of(dy[r * c + i]);
            sum_dxhat_xhat += d * f64_of(g[i]) * xhat;
            dg[i] += d * xhat;
        }
        for i in 0..c {
            let xhat = f64_of(x[r * c + i]) * s;
            let dxhat = f64_of(dy[r * c + i]) * f64_of(g[i]);
            dx[r * c + i] = cast(s * (dxhat - xhat * sum_dxhat_xhat / c as f64));
        }
    }
    (dx, dg.into_iter().map(cast).collect())
}

/// f(x) of every element (`Unary::apply`, in f64).
pub fn unary_fwd<T: Float>(f: Unary, x: &[T]) -> Vec<T> {
    x.iter().map(|&v| cast(f.apply(f64_of(v)))).collect()
}

/// dx = dy * f' (`Unary::grad`, in f64) of what the backward reads: x, or for sigmoid and
/// tanh the forward's output (`Unary::reads_output`).
pub fn unary_bwd<T: Float>(f: Unary, x: &[T], dy: &[T]) -> Vec<T> {
    x.iter()
        .zip(dy)
        .map(|(&v, &d)| cast(f64_of(d) * f.grad(f64_of(v))))
        .collect()
}

/// Elementwise product of two tensors of one length. Its backward is two products: da = dy * b,
/// db = dy * a.
pub fn mul<T: Float>(a: &[T], b: &[T]) -> Vec<T> {
    a.iter().zip(b).map(|(&x, &y)| x * y).collect()
}

/// The sum of each row of c values (in f64) divided by `divisor`: a sum (1) or a mean (c)
/// over the last axis.
pub fn row_sums<T: Float>(x: &[T], c: usize, divisor: f64) -> Vec<T> {
    x.chunks(c)
        .map(|row| cast(row.iter().map(|&v| f64_of(v)).sum::<f64>() / divisor))
        .collect()
}

/// Each value of x repeated c times, times `scale` and divided by `divisor` in f32 (a row
/// sum's or mean's backward; with c = 1, x times a constant): the kernels' two roundings.
pub fn broadcast(x: &[f32], c: usize, scale: f32, divisor: f32) -> Vec<f32> {
    x.iter()
        .flat_map(|&v| std::iter::repeat_n(v * scale / divisor, c))
        .collect()
}

/// Mean squared error over every element: mean((pred - target)^2), summed in f64.
pub fn mse_fwd<T: Float>(pred: &[T], target: &[T]) -> f64 {
    let sum: f64 = pred
        .iter()
        .zip(target)
        .map(|(&p, &t)| (f64_of(p) - f64_of(t)).powi(2))
        .sum();
    sum / pred.len() as f64
}

/// d(mean squared error * dloss)/dpred = 2 (pred - target) * dloss / n.
pub fn mse_bwd<T: Float>(pred: &[T], target: &[T], dloss: f64) -> Vec<T> {
    let n = pred.len() as f64;
    pred.iter()
        .zip(target)
        .map(|(&p, &t)| cast(2.0 * (f64_of(p) - f64_of(t)) * dloss / n))
        .collect()
}

/// The last column row `row` of a softmax over rows of t sees: with `causal`, the rows are
/// blocks of t x t scores and row i sees columns 0..=i; without, every column.
fn last_seen(row: usize, t: usize, causal: bool) -> usize {
    if causal { row % t } else { t - 1 }
}

/// Softmax of `scale * scores` over rows of t, `causal` or not (`last_seen`); the masked
/// probabilities are 0.
pub fn softmax_fwd<T: Float>(scores: &[T], t: usize, scale: f64, causal: bool) -> Vec<T> {
    softmax_masked_fwd(scores, t, scale, causal, None)
}

/// `softmax_fwd` reading a mask (`plan::ScoreMask`: its rows of t, and which row each score
/// row reads): a key mask leaves out the keys it marks nonzero, a bias is added to the scaled
/// scores in f32 (its -inf leaves a key out). A key left out has probability 0; a row that sees
/// no key is 0 throughout.
pub fn softmax_masked_fwd<T: Float>(
    scores: &[T],
    t: usize,
    scale: f64,
    causal: bool,
    mask: Option<(&[f32], ScoreMask)>,
) -> Vec<T> {
    let mut p = vec![T::zero(); scores.len()];
    for (row, out) in p.chunks_mut(t).enumerate() {
        let i = last_seen(row, t, causal);
        let mask_row = mask.map(|(m, s)| (&m[s.row(row) * t..][..t], s.kind));
        let seen: Vec<usize> = (0..=i)
            .filter(|&j| !matches!(mask_row, Some((m, MaskKind::Keys)) if m[j] != 0.0))
            .collect();
        let z = |j: usize| {
            let z = f64_of(scores[row * t + j]) * scale;
            match mask_row {
                // The sum in f32, as a device adds the bias to the scores it holds.
                Some((m, MaskKind::Bias)) => (z as f32 + m[j]) as f64,
                _ => z,
            }
        };
        let max = seen.iter().map(|&j| z(j)).fold(f64::NEG_INFINITY, f64::max);
        // A bias of -inf on every key it sees leaves the row none.
        if max == f64::NEG_INFINITY && matches!(mask_row, Some((_, MaskKind::Bias))) {
            continue;
        }
        let e: Vec<f64> = seen.iter().map(|&j| (z(j) - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        for (&j, ej) in seen.iter().zip(&e) {
            out[j] = cast(ej / sum);
        }
    }
    p
}

/// Backward of `softmax_fwd` with respect to the (unscaled) scores.
pub fn softmax_bwd<T: Float>(p: &[T], dp: &[T], t: usize, scale: f64, causal: bool) -> Vec<T> {
    let mut ds = vec![T::zero(); p.len()];
    for (row, out) in ds.chunks_mut(t).enumerate() {
        let i = last_seen(row, t, causal);
        let (pr, dr) = (&p[row * t..row * t + i + 1], &dp[row * t..row * t + i + 1]);
        let dot: f64 = pr
            .iter()
            .zip(dr)
            .map(|(&a, &b)| f64_of(a) * f64_of(b))
            .sum();
        for j in 0..=i {
            out[j] = cast(scale * f64_of(pr[j]) * (f64_of(dr[j]) - dot));
        }
    }
    ds
}

/// The scores a softmax reads (`ScoreScale`): `scale * s` computed in f32, held in `held`.
pub fn scaled_scores(s: &[f32], scale: ScoreScale) -> Vec<f32> {
    let k = scale.scale as f32;
    let mut z: Vec<f32> = s.iter().map(|&x| x * k).collect();
    round_to(&mut z, scale.held);
    z
}

/// `softmax_fwd` of the scores as `scaled_scores` holds them.
pub fn softmax_scaled_fwd(scores: &[f32], t: usize, scale: ScoreScale, causal: bool) -> Vec<f32> {
    softmax_masked_fwd(&scaled_scores(scores, scale), t, 1.0, causal, None)
}

/// `softmax_masked_fwd` of the scores as `scaled_scores` holds them.
pub fn softmax_scaled_masked_fwd(
    scores: &[f32],
    t: usize,
    scale: ScoreScale,
    causal: bool,
    mask: Option<(&[f32], ScoreMask)>,
) -> Vec<f32> {
    softmax_masked_fwd(&scaled_scores(scores, scale), t, 1.0, causal, mask)
}

/// The backward of `softmax_scaled_fwd` with respect to the unscaled scores: the softmax's
/// gradient (the gradient of the held scaled scores) held, then scaled and held again.
pub fn softmax_scaled_bwd(
    p: &[f32],
    dp: &[f32],
    t: usize,
    scale: ScoreScale,
    causal: bool,
) -> Vec<f32> {
    let mut ds = softmax_bwd(p, dp, t, 1.0, causal);
    round_to(&mut ds, scale.held);
    scaled_scores(&ds, scale)
}

/// Mean softmax cross-entropy of `rows x v` logits against `targets`; returns the loss and the
/// probabilities the backward pass needs.
pub fn cross_entropy_fwd<T: Float>(logits: &[T], targets: &[u32], v: usize) -> (f64, Vec<T>) {
    let mut probs = vec![T::zero(); logits.len()];
    let mut loss = 0f64;
    for (r, &target) in targets.iter().enumerate() {
        let l = &logits[r * v..(r + 1) * v];
        let max = l
            .iter()
            .map(|&x| f64_of(x))
            .fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = l.iter().map(|&x| (f64_of(x) - max).exp()).sum();
        for i in 0..v {
            probs[r * v + i] = cast((f64_of(l[i]) - max).exp() / sum);
        }
        loss += sum.ln() + max - f64_of(l[target as usize]);
    }
    (loss / targets.len() as f64, probs)
}

/// d(mean loss * dloss)/dlogits = (probs - onehot(target)) * dloss / rows.
pub fn cross_entropy_bwd<T: Float>(probs: &[T], targets: &[u32], v: usize, dloss: f64) -> Vec<T> {
    let n = targets.len() as f64;
    let mut d: Vec<T> = probs.iter().map(|&p| cast(f64_of(p) * dloss / n)).collect();
    for (r, &target) in targets.iter().enumerate() {
        let i = r * v + target as usize;
        d[i] = cast(f64_of(d[i]) - dloss / n);
    }
    d
}

/// Rows of `table` (vocab x c) gathered by `ids`.
pub fn embedding_fwd<T: Float>(table: &[T], ids: &[u32], c: usize) -> Vec<T> {
    ids.iter()
        .flat_map(|&id| {
            table[id as usize * c..(id as usize + 1) * c]
                .iter()
                .copied()
        })
        .collect()
}

/// Scatter-add of `dout` rows into a `rows x c` gradient table.
pub fn embedding_bwd<T: Float>(dout: &[T], ids: &[u32], rows: usize, c: usize) -> Vec<T> {
    let mut d = vec![0f64; rows * c];
    for (r, &id) in ids.iter().enumerate() {
        for i in 0..c {
            d[id as usize * c + i] += f64_of(dout[r * c + i]);
        }
    }
    d.into_iter().map(cast).collect()
}

/// Adds the bias `b` (length c) to every row of x.
pub fn add_bias<T: Float>(x: &mut [T], b: &[T]) {
    let c = b.len();
    for row in x.chunks_mut(c) {
        for (v, &bi) in row.iter_mut().zip(b) {
            *v = *v + bi;
        }
    }
}

/// Column sums of a `rows x c` matrix (the bias gradient).
pub fn column_sums<T: Float>(x: &[T], c: usize) -> Vec<T> {
    let mut s = vec![0f64; c];
    for row in x.chunks(c) {
        for (acc, &v) in s.iter_mut().zip(row) {
            *acc += f64_of(v);
        }
    }
    s.into_iter().map(cast).collect()
}

/// (B, T, 3C) -> q, k, v as (B, H, T, D) each, D = C / H.
pub fn split_heads(qkv: &[f32], b: usize, t: usize, h: usize, d: usize) -> [Vec<f32>; 3] {
    let c = h * d;
    let mut out = [
        vec![0f32; b * t * c],
        vec![0f32; b * t * c],
        vec![0f32; b * t * c],
    ];
    for bi in 0..b {
        for ti in 0..t {
            for (part, o) in out.iter_mut().enumerate() {
                for hi in 0..h {
                    let src = (bi * t + ti) * 3 * c + part * c + hi * d;
                    let dst = ((bi * h + hi) * t + ti) * d;
                    o[dst..dst + d].copy_from_slice(&qkv[src..src + d]);
                }
            }
        }
    }
    out
}

/// The inverse of `split_heads` (and the backward of it): q, k, v (B, H, T, D) -> (B, T, 3C).
pub fn merge_qkv(parts: [&[f32]; 3], b: usize, t: usize, h: usize, d: usize) -> Vec<f32> {
    let c = h * d;
    let mut out = vec![0f32; b * t * 3 * c];
    for bi in 0..b {
        for ti in 0..t {
            for (part, p) in parts.iter().enumerate() {
                for hi in 0..h {
                    let dst = (bi * t + ti) * 3 * c + part * c + hi * d;
                    let src = ((bi * h + hi) * t + ti) * d;
                    out[dst..dst + d].copy_from_slice(&p[src..src + d]);
                }
            }
        }
    }
    out
}

/// (B, H, T, D) -> (B, T, C); `heads_to_rows(x)` and `rows_to_heads(x)` are each other's inverse
/// (and backward).
pub fn heads_to_rows(x: &[f32], b: usize, t: usize, h: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for bi in 0..b {
        for hi in 0..h {
            for ti in 0..t {
                let src = ((bi * h + hi) * t + ti) * d;
                let dst = (bi * t + ti) * h * d + hi * d;
                out[dst..dst + d].copy_from_slice(&x[src..src + d]);
            }
        }
    }
    out
}

/// The inverse of `heads_to_rows`: (B, T, H*D) rows into (B, H, T, D) heads.
pub fn rows_to_heads(x: &[f32], b: usize, t: usize, h: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for bi in 0..b {
        for hi in 0..h {
            for ti in 0..t {
                let dst = ((bi * h + hi) * t + ti) * d;
                let src = (bi * t + ti) * h * d + hi * d;
                out[dst..dst + d].copy_from_slice(&x[src..src + d]);
            }
        }
    }
    out
}

/// Fused causal self-attention (`plan::Attention`), defined as the ops it replaces compute it:
/// q, k, v split into heads, scores = q.k^T under the algorithm and held in the compute format,
/// P = causal softmax of the scaled scores z (`Attention::score_scale`) held in `probs`,
/// out = P.v held in the compute format, back to (B, T, C). Also each score row's (max of z,
/// sum of exp(z - max)), the statistics a fused kernel keeps instead of P.
pub fn attention_fwd(qkv: &[f32], spec: &Attention) -> (Vec<f32>, Vec<f32>) {
    let Attention { b, t, h, d, .. } = *spec;
    let (scores, p, [_, _, v]) = attention_probs(qkv, spec);
    let mut stats = Vec::with_capacity(2 * spec.score_rows());
    let z = scaled_scores(&scores, spec.score_scale());
    for (row, s) in z.chunks(t).enumerate() {
        let z: Vec<f64> = s[..=row % t].iter().map(|&x| x as f64).collect();
        let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = z.iter().map(|&x| (x - max).exp()).sum();
        stats.extend([max as f32, sum as f32]);
    }
    let y = held(bmm(spec, d, t, false, false), spec, &p, &v);
    (heads_to_rows(&y, b, t, h, d), stats)
}

/// The backward of `attention_fwd`: the gradient of q|k|v (B, T, 3C) from that of the output
/// (B, T, C), as the unfused backward computes it (dP = dy.v^T, dv = P^T.dy, dS = softmax
/// backward, dq = dS.k, dk = dS^T.q, each held in the compute format), and each score row's
/// sum(P * dP).
pub fn attention_bwd(qkv: &[f32], dout: &[f32], spec: &Attention) -> (Vec<f32>, Vec<f32>) {
    let Attention { b, t, h, d, .. } = *spec;
    let (_, p, [q, k, v]) = attention_probs(qkv, spec);
    let dy = rows_to_heads(dout, b, t, h, d);
    let dp = held(bmm(spec, t, d, false, true), spec, &dy, &v);
    let dv = held(bmm(spec, d, t, true, false), spec, &p, &dy);
    let ds = softmax_scaled_bwd(&p, &dp, t, spec.score_scale(), true);
    let dq = held(bmm(spec, d, t, false, false), spec, &ds, &k);
    let dk = held(bmm(spec, d, t, true, false), spec, &ds, &q);
    let delta = (0..spec.score_rows())
        .map(|row| {
            let r = row * t..row * t + row % t + 1;
            let dot: f64 = p[r.clone()]
                .iter()
                .zip(&dp[r])
                .map(|(&a, &g)| a as f64 * g as f64)
                .sum();
            dot as f32
        })
        .collect();
    (merge_qkv([&dq, &dk, &dv], b, t, h, d), delta)
}

/// The scores (held in the compute format), the probabilities (held in `probs`) and q, k, v by
/// head.
fn attention_probs(qkv: &[f32], spec: &Attention) -> (Vec<f32>, Vec<f32>, [Vec<f32>; 3]) {
    let Attention { b, t, h, d, .. } = *spec;
    let heads = split_heads(qkv, b, t, h, d);
    let scores = held(bmm(spec, t, d, false, true), spec, &heads[0], &heads[1]);
    let mut p = softmax_scaled_fwd(&scores, t, spec.score_scale(), true);
    round_to(&mut p, spec.probs);
    (scores, p, heads)
}

/// One matmul per (sequence, head) of t rows: t x n x k.
fn bmm(
    spec: &Attention,
    n: usize,
    k: usize,
    a_transposed: bool,
    b_transposed: bool,
) -> MatmulShape {
    let batch = spec.b * spec.h;
    MatmulShape::batched(batch, (spec.t, n, k), a_transposed, b_transposed)
}

/// a.b under the attention's algorithm, held in its compute format.
fn held(shape: MatmulShape, spec: &Attention, a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut c = vec![0f32; shape.c_len()];
    matmul_into(&shape, &spec.algorithm, a, b, &mut c);
    round_to(&mut c, spec.compute);
    c
}

/// Multiplies gradients by `inverse_scale` in place (GradScaler's unscale) and says whether all
/// of them are finite.
pub fn unscale_check(g: &mut [f32], inverse_scale: f32) -> bool {
    let mut finite = true;
    for x in g.iter_mut() {
        *x *= inverse_scale;
        finite &= x.is_finite();
    }
    finite
}

/// Rounds values to `format` in place (autocast: a tensor held in a narrower format). f32 is a
/// no-op.
pub fn round_to(x: &mut [f32], format: Format) {
    if format != Format::F32 {
        for v in x.iter_mut() {
            *v = format.round(*v, Overflow::Standard);
        }
    }
}

/// One AdamW update of `p` (and its moments) with bias correction at step `t` (1-based);
/// `decay` applies weight decay (decoupled, as torch.optim.AdamW) to this tensor.
#[allow(clippy::too_many_arguments)]
pub fn adamw(
    opt: &AdamW,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    t: u32,
    decay: bool,
) {
    let (bc1, bc2) = opt.bias_corrections(t);
    let step = opt.lr as f64 / bc1;
    let wd = if decay {
        opt.lr * opt.weight_decay
    } else {
        0.0
    };
    for i in 0..p.len() {
        m[i] = opt.beta1 * m[i] + (1.0 - opt.beta1) * g[i];
        v[i] = opt.beta2 * v[i] + (1.0 - opt.beta2) * g[i] * g[i];
        let denom = (v[i] as f64 / bc2).sqrt() + opt.eps as f64;
        p[i] = (p[i] as f64 * (1.0 - wd as f64) - step * m[i] as f64 / denom) as f32;
    }
}
