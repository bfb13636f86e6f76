//! The conformance suite: every op of every backend present against the host reference.
//!
//! Casts, splits and amax must agree bit for bit (NaN payloads aside); matmuls must keep the
//! non-finite pattern of the reference exactly and stay within the algorithm's accumulation
//! tolerance elsewhere, and their error against an f64 product must lie in the range the
//! numerics contract gives. Inputs are fresh random values (seed printed) plus edge cases, on
//! odd shapes (1, 3, 50, 783, one above the 64-wide tile), batched and transposed.

mod common;

use mantissa::algorithm::{Algorithm, MatmulShape, Scaling};
use mantissa::backend::{self, Backend, BackendKind};
use mantissa::format::{self, Format, Overflow};
use mantissa::measure;
use mantissa::measure::train_tolerance as tol;
use mantissa::plan::{
    AdamW, AdamWParam, MaskKind, Op, Outline, ScoreMask, ScoreScale, Section, Unary,
};
use pollster::FutureExt as _;

fn check_encode(b: &dyn Backend, seed: u64) {
    let mut values = measure::boundary_values();
    values.extend(measure::random_bits(20_000, seed));
    values.extend(measure::wide_range(5_000, seed + 1));
    values.extend(measure::normal(5_000, seed + 2));
    for format in Format::ALL {
        for overflow in [Overflow::Standard, Overflow::Saturate] {
            let got = b
                .encode(format, overflow, &values)
                .block_on()
                .expect("encode");
            assert_eq!(got.len(), values.len());
            let bad: Vec<String> = values
                .iter()
                .zip(&got)
                .filter(|(x, g)| !measure::same_code(format, **g, format.encode(**x, overflow)))
                .take(5)
                .map(|(x, g)| {
                    format!(
                        "{x:e} ({:#010x}) -> {g:#x}, host {:#x}",
                        x.to_bits(),
                        format.encode(*x, overflow)
                    )
                })
                .collect();
            assert!(
                bad.is_empty(),
                "{} encode {format} {overflow:?}: {bad:?}",
                b.name()
            );
        }
    }
}

fn check_decode(b: &dyn Backend) {
    for format in [Format::Bf16, Format::F16, Format::E4m3, Format::E5m2] {
        let codes: Vec<u32> = (0..1u32 << format.storage_bits()).collect();
        let got = b.decode(format, &codes).block_on().expect("decode");
        for (&c, &g) in codes.iter().zip(&got) {
            let want = format.decode(c);
            assert!(
                g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                "{} decode {format} {c:#x}: {g:e}, host {want:e}",
                b.name()
            );
        }
    }
}

fn check_split_and_amax(b: &dyn Backend, seed: u64) {
    let mut values = measure::boundary_values();
    values.extend(measure::random_bits(10_000, seed));
    values.extend(measure::normal(3_001, seed + 1));
    let planes = b.split_bf16(&values).block_on().expect("split");
    for (e, &x) in values.iter().enumerate() {
        let want = format::split_bf16(x);
        for p in 0..3 {
            let code = Format::Bf16.encode(want[p], Overflow::Standard);
            assert!(
                measure::same_code(Format::Bf16, planes[p][e], code),
                "{} split {x:e} part {p}: {:#x} vs {code:#x}",
                b.name(),
                planes[p][e]
            );
        }
    }
    for v in [
        &values[..],
        &measure::normal(777, seed)[..],
        &[f32::NAN, f32::INFINITY][..],
        &[0.0, -0.0][..],
        &[f32::from_bits(3)][..],
    ] {
        let want = format::amax(v.iter().copied());
        assert_eq!(
            b.amax(v).block_on().expect("amax").to_bits(),
            want.to_bits(),
            "{} amax",
            b.name()
        );
    }
}

fn casts(b: &dyn Backend) {
    let seed = common::seed("casts");
    check_encode(b, seed);
    check_decode(b);
    check_split_and_amax(b, seed);
}

use common::check_matmul;

fn shapes() -> Vec<MatmulShape> {
    let mut v = vec![
        MatmulShape::new(1, 1, 1),
        MatmulShape::new(3, 50, 7),
        MatmulShape::new(50, 3, 783),
        MatmulShape::new(65, 67, 129),
        // n a multiple of 4 and a long K: a shape cuBLASLt's fp8 GEMM takes (the ones above
        // take the CUDA f16 path), long enough for its accumulation to show (docs/h100.md).
        MatmulShape::new(48, 64, 1500),
    ];
    for (at, bt) in [(true, false), (false, true), (true, true)] {
        v.push(MatmulShape {
            batch: 3,
            m: 17,
            n: 66,
            k: 31,
            a_transposed: at,
            b_transposed: bt,
        });
    }
    v
}

fn algorithms() -> Vec<Algorithm> {
    let mut v = Algorithm::ALL.to_vec();
    v.push(Algorithm::fp8(Format::E4m3, Format::E4m3).with_scaling(Scaling::Rowwise));
    v.push(Algorithm::fp8(Format::E4m3, Format::E5m2).with_scaling(Scaling::Rowwise));
    v.push(
        Algorithm::fp8(Format::E5m2, Format::E5m2).with_scaling(Scaling::Given { a: 64.0, b: 0.5 }),
    );
    v
}

fn matmul_random(b: &dyn Backend) {
    let seed = common::seed("matmul_random");
    for (s, shape) in shapes().iter().enumerate() {
        let a = measure::normal(shape.a_len(), seed + 2 * s as u64);
        let bm = measure::normal(shape.b_len(), seed + 2 * s as u64 + 1);
        for alg in algorithms() {
            check_matmul(b, &alg, shape, &a, &bm, "N(0,1)");
        }
    }
}

fn matmul_edges(b: &dyn Backend) {
    let seed = common::seed("matmul_edges");
    let shape = MatmulShape::new(37, 29, 70);
    // Wide dynamic range, values near the small formats' overflow and underflow, f32
    // subnormals, and rows/columns holding inf and NaN.
    let mut a = measure::wide_range(shape.a_len(), seed);
    let mut bm = measure::normal(shape.b_len(), seed + 1);
    for (i, x) in a.iter_mut().enumerate().step_by(13) {
        *x = [65504.0, 70000.0, -448.0, 500.0, 1e-6, 3e-8, 1.0e-40, 5e37][i % 8];
    }
    // Values whose bf16 (and f16) rounding overflows, in rows 30.. only: rows 5, 9 and 20
    // below test the inf/NaN rules without them.
    for (r, x) in [
        (30, f32::MAX * 0.999),
        (31, -f32::MAX * 0.999),
        (32, 3.39e38),
    ] {
        a[r * shape.k + 4] = x;
    }
    a[5 * shape.k + 3] = f32::INFINITY; // row 5 holds +inf
    a[9 * shape.k] = f32::NEG_INFINITY; // row 9 holds -inf
    a[20 * shape.k + 7] = f32::NAN; // row 20 holds NaN
    for p in 0..shape.k {
        bm[p * shape.n + 11] = bm[p * shape.n + 11].abs() + 0.5; // column 11 positive: inf stays inf
    }
    bm[4 * shape.n + 2] = 0.0; // inf * 0 = NaN in row 5 / 9, column 2
    bm[6 * shape.n + 17] = f32::INFINITY; // column 17 holds inf
    // ... met by no subnormal in A: WGSL lets devices flush subnormal f32 arithmetic (Mesa
    // 26's lavapipe does), and inf * flushed 0 is NaN where the reference has inf.
    for r in 0..shape.m {
        let x = &mut a[r * shape.k + 6];
        if x.is_subnormal() {
            *x = 1e-6;
        }
    }
    for alg in algorithms() {
        check_matmul(b, &alg, &shape, &a, &bm, "edge cases");
    }
    // An inf in a row of A gives that row of C as +-inf (never NaN) for f32 and every split
    // algorithm, where B's column is positive.
    for alg in [
        Algorithm::F32,
        Algorithm::Bf16x3,
        Algorithm::Bf16x6,
        Algorithm::Bf16x9,
    ] {
        let c = b.matmul(&shape, &alg, &a, &bm).block_on().expect("matmul");
        assert_eq!(
            c[5 * shape.n + 11],
            f32::INFINITY,
            "{} {alg}: +inf row",
            b.name()
        );
        assert_eq!(
            c[9 * shape.n + 11],
            f32::NEG_INFINITY,
            "{} {alg}: -inf row",
            b.name()
        );
        assert!(c[20 * shape.n + 11].is_nan(), "{} {alg}: NaN row", b.name());
    }
}

fn matmul_error_bands(b: &dyn Backend) {
    let seed = common::seed("matmul_error_bands");
    let shape = MatmulShape::new(96, 80, 512);
    let a = measure::normal(shape.a_len(), seed);
    let bm = measure::normal(shape.b_len(), seed + 1);
    let exact = measure::exact_product(&shape, &a, &bm);
    let mut errors = std::collections::HashMap::new();
    for alg in algorithms() {
        let c = b.matmul(&shape, &alg, &a, &bm).block_on().expect("matmul");
        let err = measure::relative_error(&c, &exact);
        eprintln!("{} {alg}: relative error {err:.3e}", b.name());
        let (lo, hi) = alg.expected_error_n01();
        assert!(
            err >= lo && err <= hi,
            "{} {alg}: relative error {err:.3e} outside [{lo:.1e}, {hi:.1e}]",
            b.name()
        );
        errors.insert(alg.to_string(), err);
    }
    // Each split level adds accuracy: a dropped level would leave x6 at x3's error.
    assert!(
        errors["bf16x6"] < errors["bf16x3"] / 4.0,
        "{} bf16x6 does not improve on bf16x3: {errors:?}",
        b.name()
    );
    assert!(
        errors["bf16x3"] < errors["bf16"] / 100.0,
        "{} bf16x3 does not improve on bf16: {errors:?}",
        b.name()
    );
}

fn matmul_bad_input(b: &dyn Backend) {
    let shape = MatmulShape::new(4, 5, 6);
    let err = b
        .matmul(&shape, &Algorithm::F32, &[0.0; 23], &[0.0; 30])
        .block_on()
        .expect_err("short A must fail");
    assert!(err.to_string().contains("expected 24"), "{err}");
    let err = b
        .matmul(&shape, &Algorithm::Bf16x3, &[0.0; 24], &[0.0; 31])
        .block_on()
        .expect_err("long B must fail");
    assert!(err.to_string().contains("expected 30"), "{err}");
    // Empty products are fine: k = 0 gives zeros.
    let c = b
        .matmul(&MatmulShape::new(2, 3, 0), &Algorithm::F32, &[], &[])
        .block_on()
        .expect("k = 0");
    assert_eq!(c, vec![0.0; 6]);
}

/// An operand beyond the device's storage-binding limit is a clear error, not a wgpu panic.
fn matmul_too_large(b: &dyn Backend) {
    let Some(limit) = b.device_name().contains("llvmpipe").then_some(128u64 << 20) else {
        common::skip(
            "matmul_too_large",
            &format!(
                "the storage-binding limit of {} is not known here (lavapipe: 128 MiB)",
                b.name()
            ),
        );
        return;
    };
    let k = 4100;
    let m = (limit as usize / 4) / k + 1;
    let shape = MatmulShape::new(m, 2, k);
    let a = vec![1.0f32; m * k];
    let err = b
        .matmul(&shape, &Algorithm::F32, &a, &vec![1.0; 2 * k])
        .block_on()
        .expect_err("A over the binding limit");
    let msg = err.to_string();
    assert!(
        msg.contains("operand A") && msg.contains("max_storage_buffer_binding_size"),
        "{msg}"
    );
    // The device is still usable afterwards.
    let c = b
        .matmul(
            &MatmulShape::new(2, 2, 2),
            &Algorithm::F32,
            &[1.0, 2.0, 3.0, 4.0],
            &[1.0, 0.0, 0.0, 1.0],
        )
        .block_on()
        .expect("small matmul");
    assert_eq!(c, vec![1.0, 2.0, 3.0, 4.0]);
}

/// Sums far longer than the 65535 loop iterations lavapipe's Mesa 22 lets one invocation run
/// (the wgpu backend splits them over dispatches there: src/backend/wgpu/budget.rs). Small
/// integers first (|x| <= 2): every partial sum is an integer below 2^24, exact in f32 in any
/// order, so C must be the exact product, and a term left out or summed twice shows; K = 2^20
/// for f32, 2^17 + 5 for the others (lavapipe sums a 2 x K x 3 product over a whole 64x64 tile:
/// seconds per 2^20). Then N(0,1) inputs, batched and transposed, K off every tile multiple,
/// against the reference within the contract, and the relative error of the whole product
/// against f64 within the algorithm's band, widened for the sequential f32 sum of K terms
/// (about 2^-24 sqrt(K / 6): the elementwise tolerance alone grows with K past what a missing
/// part of the sum changes).
fn matmul_long_k(b: &dyn Backend) {
    let seed = common::seed("matmul_long_k");
    let e4m3 = Algorithm::fp8(Format::E4m3, Format::E4m3);
    let unscaled = e4m3.with_scaling(Scaling::Given { a: 1.0, b: 1.0 });
    let small_ints = |len: usize, seed: u64| -> Vec<f32> {
        measure::normal(len, seed)
            .iter()
            .map(|x| (x * 1.2).round().clamp(-2.0, 2.0))
            .collect()
    };
    for (i, (alg, k)) in [
        (Algorithm::F32, 1 << 20),
        (Algorithm::Bf16x3, (1 << 17) + 5),
        (Algorithm::F16, (1 << 17) + 5),
        (unscaled, (1 << 17) + 5),
    ]
    .into_iter()
    .enumerate()
    {
        let shape = MatmulShape::new(2, 3, k);
        let a = small_ints(shape.a_len(), seed + 2 * i as u64);
        let bm = small_ints(shape.b_len(), seed + 2 * i as u64 + 1);
        let c = b
            .matmul(&shape, &alg, &a, &bm)
            .block_on()
            .unwrap_or_else(|e| panic!("{} {alg}: {e}", b.name()));
        let exact = measure::exact_product(&shape, &a, &bm);
        assert!(
            c.iter().zip(&exact).all(|(&x, &e)| x as f64 == e),
            "{} {alg}: small integers over K = {k} give {c:?}, exactly {exact:?}",
            b.name()
        );
    }
    // 128 outputs: the relative error of fewer is too noisy for the band (with 12, e4m3's
    // passed 8e-2 for about one seed in a hundred: a sum of 12 squares below a third of its
    // mean); a lavapipe tile of 64 x 64 computes them in the time of one.
    let shape = MatmulShape {
        batch: 2,
        m: 8,
        n: 8,
        k: (1 << 16) + 5,
        a_transposed: true,
        b_transposed: true,
    };
    let a = measure::normal(shape.a_len(), seed + 10);
    let bm = measure::normal(shape.b_len(), seed + 11);
    let exact = measure::exact_product(&shape, &a, &bm);
    let sequential = f32::EPSILON as f64 / 2.0 * (shape.k as f64 / 6.0).sqrt();
    for alg in [Algorithm::F32, Algorithm::Bf16x3, Algorithm::F16, e4m3] {
        let c = check_matmul(b, &alg, &shape, &a, &bm, "N(0,1), long K");
        let err = measure::relative_error(&c, &exact);
        let hi = alg.expected_error_n01().1.max(4.0 * sequential);
        assert!(
            err <= hi,
            "{} {alg} {shape:?}: relative error {err:.3e} above {hi:.1e}",
            b.name()
        );
    }
}

/// Training ops whose loops run past the 65535 iterations lavapipe's Mesa 22 lets one
/// invocation run (the wgpu backend gives such rows more lanes, and splits such sums over
/// dispatches there: src/backend/wgpu/budget.rs), each alone in a plan run by the backend's
/// executor: rows of 30,000 values (layer norm, cross entropy: three passes over them, 90,000
/// iterations on one lane), the embedding scatter-add over 70,000 tokens, the unscale-and-check
/// of a gradient that takes each of its 256 lanes 70,000 passes (an inf in the last), layer
/// norm's column sums over 70,000 rows, RMS norm's rows of 40,000 (two passes, 80,000
/// iterations on one lane) and its dg over 70,000 rows; and an amax over 2^22 + 3 values with
/// the largest last, whose workgroups each take a fixed span.
fn train_ops_long_loops(b: &dyn Backend) {
    use mantissa::backend::reference::ops;
    let seed = common::seed("train_ops_long_loops");
    let one = [0u32];
    let layernorm = |x: &[f32], g: &[f32], bias: &[f32], dy: &[f32], c: usize| {
        let rows = x.len() / c;
        let mut p = common::OneOp::new(1);
        let (xi, gi, bi) = (
            p.input(x.to_vec()),
            p.input(g.to_vec()),
            p.input(bias.to_vec()),
        );
        let (out, stats) = (p.output(rows * c), p.output(2 * rows));
        let op = Op::LayerNorm {
            x: xi,
            g: gi,
            b: bi,
            out,
            stats,
            c,
            held: Format::F32,
        };
        let [fwd, _] = p.run_both(b, op, (&one, &one), 1.0, &[out, stats]);
        let mut p = common::OneOp::new(1);
        let (dyi, xi, gi, si) = (
            p.input(dy.to_vec()),
            p.input(x.to_vec()),
            p.input(g.to_vec()),
            p.input(fwd.outs[1].clone()),
        );
        let (dx, dg, db) = (p.output(rows * c), p.output(c), p.output(c));
        let op = Op::LayerNormBwd {
            dy: dyi,
            x: xi,
            g: gi,
            stats: si,
            dx,
            dg,
            db,
            c,
            dy_held: Format::F32,
            sum: None,
        };
        let [bwd, _] = p.run_both(b, op, (&one, &one), 1.0, &[dx, dg, db]);
        (fwd.outs, bwd.outs)
    };
    let (rows, c) = (2, 30_000);
    let x = measure::normal(rows * c, seed);
    let (g, bias) = (measure::normal(c, seed + 1), measure::normal(c, seed + 2));
    let dy = measure::normal(rows * c, seed + 3);
    let (fwd, bwd) = layernorm(&x, &g, &bias, &dy, c);
    let (wy, wm, wr) = ops::layernorm_fwd(&x, &g, &bias, c);
    // A row's mean and variance are f32 sums of 30,000 terms here, 30 times the ~1000 that
    // `tol::ROW` allows for (the host sums in f64): Mesa 26's lavapipe missed it by 2.5% for
    // seed 1795701065672120927 (1.03e-5 on a y of 0.022), so the reductions' tolerance.
    common::close("long layer norm y", &fwd[0], &wy, tol::REDUCTION);
    let rstd: Vec<f32> = fwd[1].iter().skip(1).step_by(2).copied().collect();
    common::close("long layer norm rstd", &rstd, &wr, tol::REDUCTION);
    let want = ops::layernorm_bwd(&dy, &x, &g, &wm, &wr, c);
    common::close("long layer norm dx", &bwd[0], &want.0, tol::REDUCTION);
    let targets = [3u32, c as u32 - 1];
    let mut p = common::OneOp::new(rows);
    let (li, grad) = (p.input(x.clone()), p.output(rows * c));
    let op = Op::CrossEntropy {
        logits: li,
        targets: p.batch.1,
        grad,
        v: c,
        held: Format::F32,
    };
    let [ran, _] = p.run_both(b, op, (&[0, 0], &targets), 1.0, &[grad]);
    let (wloss, wprobs) = ops::cross_entropy_fwd(&x, &targets, c);
    let loss = ran.stats[mantissa::plan::Stats::LOSS];
    assert!(
        (loss - wloss).abs() <= tol::ROW as f64 * (1.0 + wloss.abs()),
        "long cross entropy: loss {loss} vs {wloss}"
    );
    let want = ops::cross_entropy_bwd(&wprobs, &targets, c, 1.0);
    let per_row = |g: &[f32]| g.iter().map(|x| x * rows as f32).collect::<Vec<f32>>();
    common::close(
        "long cross entropy",
        &per_row(&ran.outs[0]),
        &per_row(&want),
        tol::ROW,
    );
    let (vocab, width, tokens) = (5, 2, 70_000);
    let ids: Vec<u32> = (0..tokens as u32)
        .map(|i| (i * 3 + i / 7) % vocab)
        .collect();
    let dout = measure::normal(tokens * width, seed + 4);
    // wgpu's kernels add an entry's tokens in token order in f32 (14,000 of them: the
    // reference's f64 sum is further off than ROW allows): so do these additions, to the bit.
    // CUDA's add them in token order in f64, as the definition does: its bits.
    let mut want = vec![0f32; vocab as usize * width];
    if b.kind() == BackendKind::Cuda {
        want = ops::embedding_bwd(&dout, &ids, vocab as usize, width);
    } else {
        for (r, &id) in ids.iter().enumerate() {
            for i in 0..width {
                want[id as usize * width + i] += dout[r * width + i];
            }
        }
    }
    let mut p = common::OneOp::new(tokens);
    let (di, out) = (p.input(dout), p.output(vocab as usize * width));
    let op = Op::EmbeddingBwd {
        dout: di,
        ids: p.batch.0,
        out,
        rows: vocab as usize,
        c: width,
    };
    let [ran, _] = p.run_both(b, op, (&ids, &vec![0; tokens]), 1.0, &[out]);
    assert!(
        common::same_bits(&ran.outs[0], &want),
        "embedding scatter-add over 70,000 tokens: {:?} vs {want:?}",
        ran.outs[0]
    );
    let mut grads = measure::normal(256 * 70_000, seed + 5);
    let last = grads.len() - 1;
    grads[last] = f32::INFINITY;
    let mut p = common::OneOp::new(1);
    p.grads = 1;
    let gi = p.input(grads.clone());
    let op = Op::UnscaleCheck { grads: vec![gi] };
    let [ran, _] = p.run_both(b, op, (&one, &one), 1024.0, &[gi]);
    assert!(!ops::unscale_check(&mut grads, 1.0 / 1024.0));
    assert_eq!(ran.stats[1], 1.0, "the inf in the last pass is seen");
    assert!(
        ran.outs[0] == grads,
        "every value of a long gradient is unscaled"
    );
    let (rows, c) = (70_000, 3);
    let (dy, x) = (
        measure::normal(rows * c, seed + 6),
        measure::normal(rows * c, seed + 7),
    );
    let (g, bias) = (measure::normal(c, seed + 8), vec![0.0; c]);
    let (_, bwd) = layernorm(&x, &g, &bias, &dy, c);
    let (_, wm, wr) = ops::layernorm_fwd(&x, &g, &bias, c);
    let want = ops::layernorm_bwd(&dy, &x, &g, &wm, &wr, c);
    common::close("dg over 70,000 rows", &bwd[1], &want.1, tol::REDUCTION);
    common::close("db over 70,000 rows", &bwd[2], &want.2, tol::REDUCTION);
    // RMS norm: rows of 40,000, and dg over 70,000 rows.
    let rmsnorm = |x: &[f32], g: &[f32], dy: &[f32], c: usize| {
        let rows = x.len() / c;
        let mut p = common::OneOp::new(1);
        let (xi, gi) = (p.input(x.to_vec()), p.input(g.to_vec()));
        let (out, stats) = (p.output(rows * c), p.output(rows));
        let op = Op::RmsNorm {
            x: xi,
            g: gi,
            out,
            stats,
            c,
            eps: 1e-6,
            held: Format::F32,
        };
        let [fwd, _] = p.run_both(b, op, (&one, &one), 1.0, &[out, stats]);
        let mut p = common::OneOp::new(1);
        let (dyi, xi, gi, si) = (
            p.input(dy.to_vec()),
            p.input(x.to_vec()),
            p.input(g.to_vec()),
            p.input(fwd.outs[1].clone()),
        );
        let (dx, dg) = (p.output(rows * c), p.output(c));
        let op = Op::RmsNormBwd {
            dy: dyi,
            x: xi,
            g: gi,
            stats: si,
            dx,
            dg,
            c,
            dy_held: Format::F32,
        };
        let [bwd, _] = p.run_both(b, op, (&one, &one), 1.0, &[dx, dg]);
        (fwd.outs, bwd.outs)
    };
    let (rows, c) = (2, 40_000);
    let x = measure::normal(rows * c, seed + 10);
    let (g, dy) = (
        measure::normal(c, seed + 11),
        measure::normal(rows * c, seed + 12),
    );
    let (fwd, bwd) = rmsnorm(&x, &g, &dy, c);
    let (wy, wr) = ops::rmsnorm_fwd(&x, &g, c, 1e-6);
    common::close("long rms norm y", &fwd[0], &wy, tol::ROW);
    common::close("long rms norm rstd", &fwd[1], &wr, tol::ROW);
    let want = ops::rmsnorm_bwd(&dy, &x, &g, &wr, c);
    common::close("long rms norm dx", &bwd[0], &want.0, tol::REDUCTION);
    let (rows, c) = (70_000, 3);
    let x = measure::normal(rows * c, seed + 13);
    let (g, dy) = (
        measure::normal(c, seed + 14),
        measure::normal(rows * c, seed + 15),
    );
    let (_, bwd) = rmsnorm(&x, &g, &dy, c);
    let (_, wr) = ops::rmsnorm_fwd(&x, &g, c, 1e-6);
    let want = ops::rmsnorm_bwd(&dy, &x, &g, &wr, c);
    common::close(
        "rms norm dg over 70,000 rows",
        &bwd[1],
        &want.1,
        tol::REDUCTION,
    );
    let mut values = measure::normal((1 << 22) + 3, seed + 9);
    let last = values.len() - 1;
    values[last] = 1000.0;
    assert_eq!(b.amax(&values).block_on().unwrap(), 1000.0, "amax");
}

/// The training ops of a step plan, each alone in a plan run by the backend's executor,
/// against the host interpreter running the same plan (the reference's definitions,
/// `backend::reference::ops`), on odd shapes; on the reference, the host interpreter against
/// those definitions called directly.
fn train_ops(b: &dyn Backend) {
    use mantissa::backend::reference::ops;
    let seed = common::seed("train_ops");
    let on_reference = b.kind() == BackendKind::Reference;
    let name = b.name();
    // Each output of the backend's run within `tol` of the host interpreter's; on the
    // reference, the host interpreter's equal to the definition's.
    let agree = |what: &str, [got, host]: &[Vec<f32>; 2], want: &[f32], tol: f32| {
        if on_reference {
            assert!(
                common::same_bits(host, want),
                "{what}: the host interpreter is not the definition"
            );
        }
        common::close(&format!("{name} {what}"), got, host, tol);
    };
    let pair = |ran: &[common::Ran; 2], i: usize| [ran[0].outs[i].clone(), ran[1].outs[i].clone()];
    let ids = |n: usize| vec![0u32; n];
    // Rows narrower than a row's lanes on a GPU and wider than a workgroup; one chunk of rows
    // of the column reductions, and several with a partial last one.
    for (rows, c) in [(37, 50), (600, 300)] {
        let x = measure::normal(rows * c, seed);
        let (g, bias) = (measure::normal(c, seed + 1), measure::normal(c, seed + 2));
        let dy = measure::normal(rows * c, seed + 3);
        let what = |name: &str| format!("layernorm {name}, {rows} rows of {c}");
        let mut p = common::OneOp::new(1);
        let (xi, gi, bi) = (
            p.input(x.clone()),
            p.input(g.clone()),
            p.input(bias.clone()),
        );
        let (out, stats) = (p.output(rows * c), p.output(2 * rows));
        let op = Op::LayerNorm {
            x: xi,
            g: gi,
            b: bi,
            out,
            stats,
            c,
            held: Format::F32,
        };
        let ran = p.run_both(b, op, (&ids(1), &ids(1)), 1.0, &[out, stats]);
        let (wy, wm, wr) = ops::layernorm_fwd(&x, &g, &bias, c);
        let wstats: Vec<f32> = wm.iter().zip(&wr).flat_map(|(&m, &r)| [m, r]).collect();
        agree(&what("y"), &pair(&ran, 0), &wy, tol::ROW);
        agree(&what("(mean, rstd)"), &pair(&ran, 1), &wstats, tol::ROW);
        let mut p = common::OneOp::new(1);
        let (dyi, xi, gi, si) = (
            p.input(dy.clone()),
            p.input(x.clone()),
            p.input(g.clone()),
            p.input(wstats.clone()),
        );
        let (dx, dg, db) = (p.output(rows * c), p.output(c), p.output(c));
        let op = Op::LayerNormBwd {
            dy: dyi,
            x: xi,
            g: gi,
            stats: si,
            dx,
            dg,
            db,
            c,
            dy_held: Format::F32,
            sum: None,
        };
        let ran = p.run_both(b, op, (&ids(1), &ids(1)), 1.0, &[dx, dg, db]);
        let (wdx, wdg, wdb) = ops::layernorm_bwd(&dy, &x, &g, &wm, &wr, c);
        agree(&what("dx"), &pair(&ran, 0), &wdx, tol::REDUCTION);
        agree(&what("dg"), &pair(&ran, 1), &wdg, tol::REDUCTION);
        agree(&what("db"), &pair(&ran, 2), &wdb, tol::REDUCTION);
    }
    let (rows, c) = (37, 50);
    let x = measure::normal(rows * c, seed);
    let dy = measure::normal(rows * c, seed + 3);
    let mut p = common::OneOp::new(1);
    let (xi, out) = (p.input(x.clone()), p.output(rows * c));
    let gelu = Op::Unary {
        f: Unary::Gelu,
        x: xi,
        out,
        held: Format::F32,
    };
    let ran = p.run_both(b, gelu, (&ids(1), &ids(1)), 1.0, &[out]);
    agree(
        "gelu",
        &pair(&ran, 0),
        &ops::unary_fwd(Unary::Gelu, &x),
        tol::ROW,
    );
    let mut p = common::OneOp::new(1);
    let (xi, dyi, out) = (p.input(x.clone()), p.input(dy.clone()), p.output(rows * c));
    let op = Op::UnaryBwd {
        f: Unary::Gelu,
        x: xi,
        dy: dyi,
        out,
        held: Format::F32,
        dy_held: Format::F32,
    };
    let ran = p.run_both(b, op, (&ids(1), &ids(1)), 1.0, &[out]);
    agree(
        "gelu bwd",
        &pair(&ran, 0),
        &ops::unary_bwd(Unary::Gelu, &x, &dy),
        tol::ROW,
    );
    // The backward's output held in bf16 (the rounding autocast gives it, in the same pass):
    // bf16 values within one step of the host's f32 result, on every executor.
    let mut p = common::OneOp::new(1);
    let (xi, dyi, out) = (p.input(x.clone()), p.input(dy.clone()), p.output(rows * c));
    let op = Op::UnaryBwd {
        f: Unary::Gelu,
        x: xi,
        dy: dyi,
        out,
        held: Format::Bf16,
        dy_held: Format::F32,
    };
    let ran = p.run_both(b, op, (&ids(1), &ids(1)), 1.0, &[out]);
    let exact = ops::unary_bwd(Unary::Gelu, &x, &dy);
    for r in &ran {
        common::held_close(
            &format!("{} gelu bwd held in bf16", b.name()),
            &r.outs[0],
            &exact,
            Format::Bf16,
            tol::ROW,
        );
    }
    // Contexts shorter and longer than a row op's workgroup; the scaled scores held in f32, and
    // in bf16 (their f32 product is the same bits on both sides, so the forward is as close as
    // f32's; a power-of-two scale makes the backward's two roundings one).
    // Causal, and over every column.
    for (t, scale, causal) in [
        (13, 0.3, true),
        (300, 0.3, true),
        (13, 0.25, true),
        (13, 0.3, false),
        (300, 0.25, false),
    ] {
        let s = measure::normal(3 * t * t, seed + 4);
        let dp = measure::normal(3 * t * t, seed + 5);
        for held in [Format::F32, Format::Bf16] {
            let k = ScoreScale { scale, held };
            let what = |dir: &str| {
                format!("softmax{dir}, t {t}, causal {causal}, scores x {scale} held in {held}")
            };
            let mut p = common::OneOp::new(1);
            let (si, out) = (p.input(s.clone()), p.output(s.len()));
            let op = Op::Softmax {
                x: si,
                out,
                t,
                causal,
                mask: None,
                scale: k,
                x_held: Format::F32,
            };
            let ran = p.run_both(b, op, (&ids(1), &ids(1)), 1.0, &[out]);
            let want = ops::softmax_scaled_fwd(&s, t, k, causal);
            agree(&what(""), &pair(&ran, 0), &want, tol::ROW);
            // A key padding mask per block of t rows (a head): every third key masked, and
            // every key of the second block (its rows 0 throughout, not NaN).
            let mask: Vec<f32> = (0..3 * t)
                .map(|e| f32::from(e % 3 == 1 || e / t == 1))
                .collect();
            let keys = |mask| ScoreMask {
                mask,
                kind: MaskKind::Keys,
                block: t,
                stride: 1,
                period: 1,
            };
            let mut p = common::OneOp::new(1);
            let (si, mi, out) = (p.input(s.clone()), p.input(mask.clone()), p.output(s.len()));
            let op = Op::Softmax {
                x: si,
                out,
                t,
                causal,
                mask: Some(keys(mi)),
                scale: k,
                x_held: Format::F32,
            };
            let ran = p.run_both(b, op, (&ids(1), &ids(1)), 1.0, &[out]);
            let want = ops::softmax_scaled_masked_fwd(&s, t, k, causal, Some((&mask, keys(0))));
            assert!(want[t * t..2 * t * t].iter().all(|&v| v == 0.0));
            agree(&what(" with a key mask"), &pair(&ran, 0), &want, tol::ROW);
            // A bias [t, t] for every block, and one per block (the second -inf throughout:
            // its rows 0, not NaN): values of an ALiBi slope, -inf on every fifth key, large
            // values that dominate a row.
            let shared: Vec<f32> = (0..t * t)
                .map(|e| {
                    let (i, j) = (e / t, e % t);
                    match e % 5 {
                        2 => f32::NEG_INFINITY,
                        4 if i == 3 => 40.0,
                        _ => -0.5 * i.abs_diff(j) as f32,
                    }
                })
                .collect();
            let mut per_block = shared.repeat(3);
            per_block[t * t..2 * t * t].fill(f32::NEG_INFINITY);
            per_block[2 * t * t..].iter_mut().for_each(|v| *v *= 0.25);
            for (bias, stride) in [(&shared, 0), (&per_block, t)] {
                let layout = |mask| ScoreMask {
                    mask,
                    kind: MaskKind::Bias,
                    block: t,
                    stride,
                    period: t,
                };
                let mut p = common::OneOp::new(1);
                let (si, mi) = (p.input(s.clone()), p.input(bias.clone()));
                let out = p.output(s.len());
                let op = Op::Softmax {
                    x: si,
                    out,
                    t,
                    causal,
                    mask: Some(layout(mi)),
                    scale: k,
                    x_held: Format::F32,
                };
                let ran = p.run_both(b, op, (&ids(1), &ids(1)), 1.0, &[out]);
                let want =
                    ops::softmax_scaled_masked_fwd(&s, t, k, causal, Some((bias, layout(0))));
                if stride == t {
                    assert!(want[t * t..2 * t * t].iter().all(|&v| v == 0.0));
                }
                let what = what(&format!(" with a bias, stride {stride}"));
                agree(&what, &pair(&ran, 0), &want, tol::ROW);
            }
            let mut p = common::OneOp::new(1);
            let (pi, dpi, out) = (
                p.input(want.clone()),
                p.input(dp.clone()),
                p.output(s.len()),
            );
            let op = Op::SoftmaxBwd {
                p: pi,
                dp: dpi,
                out,
                t,
                causal,
                scale: k,
                dp_held: Format::F32,
            };
            let ran = p.run_both(b, op, (&ids(1), &ids(1)), 1.0, &[out]);
            let want = ops::softmax_scaled_bwd(&want, &dp, t, k, causal);
            let [got, host] = pair(&ran, 0);
            assert!(
                !on_reference || common::same_bits(&host, &want),
                "{}: the host interpreter is not the definition",
                what(" bwd")
            );
            match held {
                Format::F32 => common::close(&what(" bwd"), &got, &host, tol::ROW),
                _ if scale == 0.25 => {
                    common::held_close(&what(" bwd"), &got, &host, held, tol::ROW)
                }
                _ => {}
            }
        }
    }
    // The loss and its gradient (the fused op of a step plan), the loss scaled.
    let v = 76;
    let logits: Vec<f32> = measure::normal(rows * v, seed + 6)
        .iter()
        .map(|x| 3.0 * x)
        .collect();
    let targets: Vec<u32> = (0..rows as u32).map(|r| (r * 7 + 3) % v as u32).collect();
    let mut p = common::OneOp::new(rows);
    let (li, grad) = (p.input(logits.clone()), p.output(rows * v));
    let op = Op::CrossEntropy {
        logits: li,
        targets: p.batch.1,
        grad,
        v,
        held: Format::F32,
    };
    let ran = p.run_both(b, op, (&ids(rows), &targets), 1024.0, &[grad]);
    let (wloss, wprobs) = ops::cross_entropy_fwd(&logits, &targets, v);
    let [loss, host_loss] = [0, 1].map(|i| ran[i].stats[mantissa::plan::Stats::LOSS]);
    assert!(
        !on_reference || loss == wloss,
        "the host's loss {loss}, the definition's {wloss}"
    );
    assert!(
        (loss - host_loss).abs() <= tol::ROW as f64 * host_loss,
        "{name} cross entropy {loss} vs {host_loss}"
    );
    // The gradient is (p - onehot) times the loss scale over the rows: compared in units of
    // probability, as the probabilities themselves would be.
    let per_row = 1024.0 / rows as f32;
    let unscaled = |g: &[f32]| g.iter().map(|x| x / per_row).collect::<Vec<f32>>();
    let [got, host] = pair(&ran, 0);
    let want = ops::cross_entropy_bwd(&wprobs, &targets, v, 1024.0);
    agree(
        "cross entropy gradient / (loss scale / rows)",
        &[unscaled(&got), unscaled(&host)],
        &unscaled(&want),
        tol::ROW,
    );
    // AdamW at step 3 on moments of a run: one op over parameters of odd lengths (one value,
    // a vector's tail past 4-value groups, more than a CUDA block's chunk), weight decay on some;
    // the state held in f32, and in bf16 as the update writes it (the *-true presets).
    let opt = AdamW::default();
    let lens = [1001, 1, 7, 4099, 34];
    for held in [Format::F32, Format::Bf16] {
        let mut p = common::OneOp::new(1);
        let mut params = Vec::new();
        let mut start = Vec::new();
        for (k, &n) in lens.iter().enumerate() {
            let seed = seed + 7 + 3 * k as u64;
            let (p1, g1) = (measure::normal(n, seed), measure::normal(n, seed + 1));
            let (m1, v1) = (vec![0.01f32; n], vec![0.001f32; n]);
            params.push(AdamWParam {
                param: p.input(p1.clone()),
                grad: p.input(g1.clone()),
                m: p.input(m1.clone()),
                v: p.input(v1.clone()),
                decay: k % 2 == 0,
            });
            start.push((p1, g1, m1, v1));
        }
        let outs: Vec<_> = params.iter().flat_map(|a| [a.param, a.m, a.v]).collect();
        let decays: Vec<bool> = params.iter().map(|a| a.decay).collect();
        let op = Op::AdamW { params, held };
        let ran = p.run_both(b, op, (&ids(1), &ids(1)), 1.0, &outs);
        for (k, (mut p2, g, mut m2, mut v2)) in start.into_iter().enumerate() {
            ops::adamw(&opt, &mut p2, &g, &mut m2, &mut v2, 3, decays[k]);
            for (j, (name, want)) in [("p", &p2), ("m", &m2), ("v", &v2)].into_iter().enumerate() {
                let what = format!("adamw {name} of {k} held in {held}");
                let both = pair(&ran, 3 * k + j);
                if held == Format::F32 {
                    agree(&what, &both, want, tol::ARITHMETIC);
                } else {
                    for (got, who) in both.iter().zip([b.name(), "host".into()]) {
                        common::held_close(
                            &format!("{who}: {what}"),
                            got,
                            want,
                            held,
                            tol::ARITHMETIC,
                        );
                    }
                }
            }
        }
    }
    // Embeddings: the gather exact, the scatter-add of a reduction's order.
    let (vocab, width) = (11, 7);
    let table = measure::normal(vocab * width, seed + 9);
    let tokens: Vec<u32> = (0..29u32).map(|i| (i * 5 + 1) % vocab as u32).collect();
    let n = tokens.len();
    let mut p = common::OneOp::new(n);
    let (ti, out) = (p.input(table.clone()), p.output(n * width));
    let op = Op::Embedding {
        table: ti,
        ids: p.batch.0,
        out,
        c: width,
    };
    let ran = p.run_both(b, op, (&tokens, &ids(n)), 1.0, &[out]);
    let want = ops::embedding_fwd(&table, &tokens, width);
    assert_eq!(ran[0].outs[0], want, "{name}: embedding gather is exact");
    assert_eq!(ran[1].outs[0], want, "the host's gather");
    // The scatter-add on skewed ids too: every token one id, ids absent from the batch and a
    // table larger than the batch, one id taking most tokens. Each backend's bits, not a
    // tolerance (an f32 sum of 600 terms is further off the f64 definition than ROW allows):
    // the host interpreter's are the definition's, and so are CUDA's (each entry's tokens in
    // token order in f64); wgpu has no f64 and adds them in token order in f32.
    let cases: [(&str, usize, Vec<u32>); 4] = [
        ("mixed ids", vocab, tokens.clone()),
        ("every token one id", 3, vec![2; 600]),
        (
            "ids absent, a table larger than the batch",
            300,
            (0..40).map(|i| i % 5 * 61).collect(),
        ),
        (
            "one id most tokens",
            65,
            (0..700)
                .map(|i| if i % 10 < 7 { 4 } else { i % 65 })
                .collect(),
        ),
    ];
    for (k, (what, vocab, tokens)) in cases.into_iter().enumerate() {
        let n = tokens.len();
        let dout = measure::normal(n * width, seed + 10 + k as u64);
        let mut p = common::OneOp::new(n);
        let (di, out) = (p.input(dout.clone()), p.output(vocab * width));
        let op = Op::EmbeddingBwd {
            dout: di,
            ids: p.batch.0,
            out,
            rows: vocab,
            c: width,
        };
        let ran = p.run_both(b, op, (&tokens, &ids(n)), 1.0, &[out]);
        let want = ops::embedding_bwd(&dout, &tokens, vocab, width);
        assert!(
            common::same_bits(&ran[1].outs[0], &want),
            "embedding scatter-add, {what}: the host interpreter is not the definition"
        );
        let want = match b.kind() {
            BackendKind::Wgpu => {
                let mut in_f32 = vec![0f32; vocab * width];
                for (r, &id) in tokens.iter().enumerate() {
                    for i in 0..width {
                        in_f32[id as usize * width + i] += dout[r * width + i];
                    }
                }
                in_f32
            }
            BackendKind::Reference | BackendKind::Cuda => want,
        };
        assert!(
            common::same_bits(&ran[0].outs[0], &want),
            "{name}: embedding scatter-add, {what}: {:?} vs {want:?}",
            ran[0].outs[0]
        );
    }
    // GradScaler's unscale: one op over many gradients of odd lengths; one exact multiplication
    // each, and each one's finite flag (an inf in one, a NaN in another, both among many) and
    // squared norm.
    let lens: Vec<usize> = (0..24)
        .map(|i| (i * 397 + 1) % 3001 + 1)
        .chain([5000])
        .collect();
    let count = lens.len();
    for bad in [None, Some(f32::INFINITY), Some(f32::NAN)] {
        let mut grads: Vec<Vec<f32>> = (0..count)
            .map(|i| measure::normal(lens[i], seed + 11 + i as u64))
            .collect();
        let hit = match bad {
            Some(x) if x.is_nan() => 17,
            _ => 9,
        };
        if let Some(bad) = bad {
            let at = lens[hit] / 2;
            grads[hit][at] = bad;
        }
        let mut p = common::OneOp::new(1);
        p.grads = count;
        let ids_of: Vec<_> = grads.iter().map(|g| p.input(g.clone())).collect();
        let op = Op::UnscaleCheck {
            grads: ids_of.clone(),
        };
        let ran = p.run_both(b, op, (&ids(1), &ids(1)), 1024.0, &ids_of);
        for (i, g) in grads.iter_mut().enumerate() {
            let finite = ops::unscale_check(g, 1.0 / 1024.0);
            assert_eq!(finite, bad.is_none() || i != hit);
            let flags = [0, 1].map(|r| ran[r].stats[1 + i]);
            assert_eq!(
                flags,
                [f64::from(!finite as u8); 2],
                "{name}: finite flag of gradient {i} of {count}, {bad:?}"
            );
            for r in &ran {
                assert!(
                    common::same_bits(&r.outs[i], g),
                    "{name}: unscaling gradient {i} is one exact f32 multiplication"
                );
            }
            if finite {
                let [norm, host_norm] = [0, 1].map(|r| ran[r].stats[1 + count + i]);
                assert!(
                    (norm - host_norm).abs() <= tol::REDUCTION as f64 * host_norm,
                    "{name}: squared norm of gradient {i}: {norm} vs {host_norm}"
                );
            }
        }
    }
}

/// What changes from run to run is checked by every executor before anything runs: a batch of
/// the wrong length, token ids outside the table an embedding gathers from, target ids
/// outside the classes of the loss, scalars of the wrong count, values written of the wrong
/// length; each is an error, and the executor still runs a good batch after it. (A plan whose
/// tensors do not fit its ops is refused when it is made: `plan::validate`.)
/// The ops of users' models besides the GPT's (RMS norm, SiLU, the elementwise product, the
/// mean squared error), each alone in a plan run by the backend's executor, against the host
/// interpreter running the same plan (on the reference, the interpreter against the
/// definitions): rows narrower than a row's lanes on a GPU and wider than a workgroup, widths
/// not a multiple of 4, more rows than a chunk of the column reductions, a row of zeros, rows
/// holding NaN or an infinity, outputs held in bf16; the elementwise ops over NaN,
/// infinities, subnormals and where exp(-x) overflows; the loss against targets of its own and
/// against the batch's targets as f32 bit patterns.
fn model_ops(b: &dyn Backend) {
    use mantissa::backend::reference::ops;
    let seed = common::seed("model_ops");
    let on_reference = b.kind() == BackendKind::Reference;
    let name = b.name();
    let agree = |what: &str, [got, host]: &[Vec<f32>; 2], want: &[f32], tol: f32| {
        if on_reference {
            assert!(
                got.len() == want.len()
                    && got
                        .iter()
                        .chain(host)
                        .zip(want.iter().chain(want))
                        .all(|(g, w)| g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan())),
                "{what}: the host interpreter is not the definition"
            );
        }
        common::close_with_edges(&format!("{name} {what}"), got, host, tol);
    };
    let pair = |ran: &[common::Ran; 2], i: usize| [ran[0].outs[i].clone(), ran[1].outs[i].clone()];
    // An output stored as 16-bit codes (`Plan::store_codes`) holds the codes of the values the
    // op held: the same values as read back, NaN for NaN.
    let same_as_held = |what: &str, coded: &[Vec<f32>; 2], held: &[Vec<f32>; 2]| {
        for (c, h) in coded.iter().zip(held) {
            let differ = c
                .iter()
                .zip(h)
                .position(|(x, y)| x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()));
            assert!(
                differ.is_none(),
                "{name} {what} as codes: element {differ:?}"
            );
        }
    };
    let one = [0u32];
    let eps = 1e-6;
    for (rows, c) in [(37, 50), (600, 300), (5, 52)] {
        let mut x = measure::normal(rows * c, seed);
        x[c..2 * c].fill(0.0);
        let mut edges = x.clone();
        edges[2 * c + 3] = f32::NAN;
        edges[3 * c + 1] = f32::INFINITY;
        let g = measure::normal(c, seed + 1);
        let dy = measure::normal(rows * c, seed + 2);
        for (values, edge) in [(&x, ""), (&edges, " with NaN and inf")] {
            let what = |part: &str| format!("rms norm {part}{edge}, {rows} rows of {c}");
            let mut p = common::OneOp::new(1);
            let (xi, gi) = (p.input(values.clone()), p.input(g.clone()));
            let (out, stats) = (p.output(rows * c), p.output(rows));
            let op = Op::RmsNorm {
                x: xi,
                g: gi,
                out,
                stats,
                c,
                eps,
                held: Format::F32,
            };
            let ran = p.run_both(b, op, (&one, &one), 1.0, &[out, stats]);
            let (wy, wr) = ops::rmsnorm_fwd(values, &g, c, eps);
            agree(&what("y"), &pair(&ran, 0), &wy, tol::ROW);
            agree(&what("rstd"), &pair(&ran, 1), &wr, tol::ROW);
            let mut p = common::OneOp::new(1);
            let (dyi, xi, gi, si) = (
                p.input(dy.clone()),
                p.input(values.clone()),
                p.input(g.clone()),
                p.input(wr.clone()),
            );
            let (dx, dg) = (p.output(rows * c), p.output(c));
            let op = Op::RmsNormBwd {
                dy: dyi,
                x: xi,
                g: gi,
                stats: si,
                dx,
                dg,
                c,
                dy_held: Format::F32,
            };
            let ran = p.run_both(b, op, (&one, &one), 1.0, &[dx, dg]);
            let (wdx, wdg) = ops::rmsnorm_bwd(&dy, values, &g, &wr, c);
            agree(&what("dx"), &pair(&ran, 0), &wdx, tol::REDUCTION);
            agree(&what("dg"), &pair(&ran, 1), &wdg, tol::REDUCTION);
        }
        // Held in bf16 (a "true" preset's norm): every value a bf16, within one of f32's;
        // then stored as bf16 codes.
        let held_run = |coded: bool| {
            let mut p = common::OneOp::new(1);
            let (xi, gi) = (p.input(edges.clone()), p.input(g.clone()));
            let (out, stats) = (p.output(rows * c), p.output(rows));
            if coded {
                p.g.tensors[out].stored = Format::Bf16;
            }
            let op = Op::RmsNorm {
                x: xi,
                g: gi,
                out,
                stats,
                c,
                eps,
                held: Format::Bf16,
            };
            pair(&p.run_both(b, op, (&one, &one), 1.0, &[out]), 0)
        };
        let held = held_run(false);
        let what = format!("rms norm held in bf16, {rows} rows of {c}");
        // The rows without NaN or inf (rows 2 and 3 hold them).
        let finite_rows = |v: &[f32]| [&v[..2 * c], &v[4 * c..]].concat();
        common::held_close(
            &format!("{name} {what}"),
            &finite_rows(&held[0]),
            &finite_rows(&held[1]),
            Format::Bf16,
            tol::ROW,
        );
        same_as_held(&what, &held_run(true), &held);
    }
    // Every function of the unary family and its backward, over values to +-16 and the edges.
    let mut x: Vec<f32> = measure::normal(1000, seed + 3)
        .iter()
        .map(|v| 4.0 * v)
        .collect();
    x.extend([
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        1e-40,
        100.0,
        -100.0,
        88.8,
        -88.8,
        3.4e38,
    ]);
    let dy = measure::normal(x.len(), seed + 4);
    let n = x.len();
    for &f in Unary::ALL {
        // An odd count: stored as codes, the last word holds one.
        let run = |held: Format, coded: bool| {
            let mut p = common::OneOp::new(1);
            let (xi, out) = (p.input(x.clone()), p.output(n));
            if coded {
                p.g.tensors[out].stored = held;
            }
            let op = Op::Unary {
                f,
                x: xi,
                out,
                held,
            };
            pair(&p.run_both(b, op, (&one, &one), 1.0, &[out]), 0)
        };
        let exact = ops::unary_fwd(f, &x);
        for held in [Format::F32, Format::Bf16] {
            let mut want = exact.clone();
            ops::round_to(&mut want, held);
            let what = format!("{f} held in {held}");
            let ran = run(held, false);
            if held == Format::F32 {
                agree(&what, &ran, &want, tol::ROW);
                continue;
            }
            // Held in bf16, a device's f32 result may round to the bf16 value beside the host's
            // where the two f32 results straddle a rounding boundary: each within one step of
            // the host's f32 result; the non-finite ones (and those bf16 overflows) the host's.
            let is_finite = |i: usize| exact[i].is_finite() && want[i].is_finite();
            let finite: Vec<usize> = (0..x.len()).filter(|&i| is_finite(i)).collect();
            let pick = |v: &[f32]| finite.iter().map(|&i| v[i]).collect::<Vec<f32>>();
            for got in &ran {
                common::held_close(
                    &format!("{name} {what}"),
                    &pick(got),
                    &pick(&exact),
                    held,
                    tol::ROW,
                );
                let rest = (0..x.len()).filter(|&i| !is_finite(i));
                for i in rest {
                    let (g, w) = (got[i], want[i]);
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "{name} {what}[{i}]: {g} vs {w}"
                    );
                }
            }
        }
        let held = run(Format::Bf16, false);
        same_as_held(f.name(), &run(Format::Bf16, true), &held);
        let mut p = common::OneOp::new(1);
        let (xi, dyi, out) = (p.input(x.clone()), p.input(dy.clone()), p.output(n));
        let op = Op::UnaryBwd {
            f,
            x: xi,
            dy: dyi,
            out,
            held: Format::F32,
            dy_held: Format::F32,
        };
        let ran = p.run_both(b, op, (&one, &one), 1.0, &[out]);
        agree(
            f.backward_name(),
            &pair(&ran, 0),
            &ops::unary_bwd(f, &x, &dy),
            tol::ROW,
        );
    }
    // The product: f32's (one rounding, the same on every device but where one flushes a
    // subnormal), and held in bf16.
    let mut a = measure::normal(1000, seed + 5);
    let mut bv = measure::normal(1000, seed + 6);
    a.extend([
        f32::INFINITY,
        f32::INFINITY,
        f32::NAN,
        1e30,
        1e-20,
        0.0,
        -3.0,
    ]);
    bv.extend([0.0, -2.0, 1.0, 1e30, 1e-20, f32::NEG_INFINITY, 1e-39]);
    let mul_run = |held: Format, coded: bool| {
        let mut p = common::OneOp::new(1);
        let (ai, bi, out) = (p.input(a.clone()), p.input(bv.clone()), p.output(a.len()));
        if coded {
            p.g.tensors[out].stored = held;
        }
        let op = Op::Mul {
            a: ai,
            b: bi,
            out,
            held,
        };
        pair(&p.run_both(b, op, (&one, &one), 1.0, &[out]), 0)
    };
    for held in [Format::F32, Format::Bf16] {
        let mut want = ops::mul(&a, &bv);
        ops::round_to(&mut want, held);
        let what = format!("product held in {held}");
        agree(&what, &mul_run(held, false), &want, tol::ROW);
    }
    let held = mul_run(Format::Bf16, false);
    same_as_held("product", &mul_run(Format::Bf16, true), &held);
    // Sums and means of rows shorter and longer than a row op's lanes, held in f32 and bf16;
    // their backward (each value repeated over a row, divided by c for a mean) and a product
    // with a constant, over the edges, to the bit (two f32 roundings on every device).
    for (rows, c) in [(37, 5), (3, 700)] {
        let x = measure::normal(rows * c, seed + 9);
        for (divisor, held) in [
            (1.0, Format::F32),
            (c as f32, Format::F32),
            (1.0, Format::Bf16),
        ] {
            let mut p = common::OneOp::new(1);
            let (xi, out) = (p.input(x.clone()), p.output(rows));
            let op = Op::RowSum {
                x: xi,
                out,
                c,
                divisor,
                held,
            };
            let ran = p.run_both(b, op, (&one, &one), 1.0, &[out]);
            let mut want = ops::row_sums(&x, c, divisor as f64);
            let what = format!("row sums of {rows} x {c} / {divisor} held in {held}");
            if held == Format::F32 {
                agree(&what, &pair(&ran, 0), &want, tol::REDUCTION);
            } else {
                ops::round_to(&mut want, held);
                for r in &ran {
                    common::held_close(
                        &format!("{name} {what}"),
                        &r.outs[0],
                        &want,
                        held,
                        tol::REDUCTION,
                    );
                }
            }
        }
    }
    let mut v = measure::normal(300, seed + 10);
    v.extend([
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        1e-40,
        3e38,
    ]);
    for (c, scale, divisor, held) in [
        (7, 1.0, 1.0, Format::F32),
        (7, 1.0, 7.0, Format::F32),
        (1, -0.1, 1.0, Format::F32),
        (1, 3.0, 1.0, Format::Bf16),
    ] {
        let mut p = common::OneOp::new(1);
        let (xi, out) = (p.input(v.clone()), p.output(v.len() * c));
        let op = Op::Broadcast {
            x: xi,
            out,
            c,
            scale,
            divisor,
            held,
        };
        let ran = pair(&p.run_both(b, op, (&one, &one), 1.0, &[out]), 0);
        let mut want = ops::broadcast(&v, c, scale, divisor);
        ops::round_to(&mut want, held);
        for got in &ran {
            let what = format!("{name} broadcast x{c} * {scale} / {divisor} held in {held}");
            common::same_or_flushed(&what, got, &want);
        }
    }
    // Dropout: the mask of plan::dropout at the runner's step (3) and part (2: elements counted
    // from 2 n), to the bit, over the edges
    // (a dropped NaN or infinity is NaN, as x * 0), held in f32 and bf16, for several seeds
    // (one past 32 bits), sites and rates.
    for (p_drop, seed, site, held) in [
        (0.1, 7u64, 0u32, Format::F32),
        (0.5, 1 << 40 | 5, 3, Format::F32),
        (0.9, 11, 1, Format::Bf16),
        (0.0, 7, 0, Format::F32),
    ] {
        let mut p = common::OneOp::new(1);
        let (xi, out) = (p.input(v.clone()), p.output(v.len()));
        let op = Op::Dropout {
            x: xi,
            out,
            p: p_drop,
            seed,
            site,
            held,
        };
        let ran = pair(&p.run_both(b, op, (&one, &one), 1.0, &[out]), 0);
        let key = mantissa::plan::dropout::key(seed);
        let mut want = mantissa::plan::dropout::apply(&v, (3, site, 2), key, p_drop);
        ops::round_to(&mut want, held);
        for got in &ran {
            let what = format!("{name} dropout p {p_drop} seed {seed} site {site} held in {held}");
            common::same_or_flushed(&what, got, &want);
        }
    }
    // Rotary position embeddings, forward and backward: 2 sequences of 300 positions (angles up
    // to 299 radians: the table's), 3 heads of 6, rows 18 wide (not a multiple of a
    // workgroup); held in f32 (f32 products against the definition's f64) and in bf16.
    let (t, c, d) = (300, 18, 6);
    let x = measure::normal(2 * t * c, seed + 11);
    let table = mantissa::plan::rotary::table(t, d, 10000.0).unwrap();
    for (inverse, held) in [
        (false, Format::F32),
        (true, Format::F32),
        (true, Format::Bf16),
    ] {
        let mut p = common::OneOp::new(1);
        let (xi, ti) = (p.input(x.clone()), p.input(table.clone()));
        let out = p.output(x.len());
        let op = Op::Rotary {
            x: xi,
            table: ti,
            out,
            t,
            c,
            d,
            inverse,
            held,
        };
        let ran = pair(&p.run_both(b, op, (&one, &one), 1.0, &[out]), 0);
        let mut want = mantissa::plan::rotary::apply(&x, &table, (t, c, d), inverse);
        ops::round_to(&mut want, held);
        let what = format!("rotary (inverse {inverse}) held in {held}");
        if held == Format::F32 {
            agree(&what, &ran, &want, tol::ROW);
        } else {
            for got in &ran {
                common::held_close(&format!("{name} {what}"), got, &want, held, tol::ROW);
            }
        }
    }
    // The mean squared error and its gradient (the loss scaled), against targets of its own
    // (1001 values: more than a reduction's lanes), then against the batch's targets, f32
    // values as the bit patterns a batch brings (37 rows of one value).
    let loss_scale = 1024.0;
    for (n, from_batch) in [(1001, false), (37, true)] {
        let pred = measure::normal(n, seed + 7);
        let target = measure::normal(n, seed + 8);
        let target_bits: Vec<u32> = target.iter().map(|t| t.to_bits()).collect();
        let mut p = common::OneOp::new(if from_batch { n } else { 1 });
        let (pi, grad) = (p.input(pred.clone()), p.output(n));
        let ti = if from_batch {
            p.batch.1
        } else {
            p.input(target.clone())
        };
        let op = Op::MseLoss {
            pred: pi,
            target: ti,
            grad,
            held: Format::F32,
        };
        let batch_targets = if from_batch { target_bits } else { vec![0] };
        let batch_tokens = vec![0u32; batch_targets.len()];
        let ran = p.run_both(b, op, (&batch_tokens, &batch_targets), loss_scale, &[grad]);
        let what =
            format!("mean squared error over {n} values (targets from the batch: {from_batch})");
        let wloss = ops::mse_fwd(&pred, &target);
        let [loss, host_loss] = [0, 1].map(|i| ran[i].stats[mantissa::plan::Stats::LOSS]);
        assert!(
            !on_reference || loss == wloss,
            "{what}: the host's loss {loss}, the definition's {wloss}"
        );
        assert!(
            (loss - host_loss).abs() <= tol::ROW as f64 * host_loss,
            "{name} {what}: {loss} vs {host_loss}"
        );
        // In units of pred - target: the gradient over 2 * loss scale / n.
        let k = 2.0 * loss_scale / n as f32;
        let unscaled = |g: &[f32]| g.iter().map(|x| x / k).collect::<Vec<f32>>();
        let [got, host] = pair(&ran, 0);
        let want = ops::mse_bwd(&pred, &target, loss_scale as f64);
        agree(
            &format!("{what}: gradient / (2 loss scale / n)"),
            &[unscaled(&got), unscaled(&host)],
            &unscaled(&want),
            tol::ROW,
        );
    }
}

fn train_ops_bad_input(b: &dyn Backend) {
    let (rows, vocab, width) = (4, 5, 3);
    let mut p = common::OneOp::new(rows);
    let table = p.input(measure::normal(vocab * width, 1));
    let (gathered, grad) = (p.output(rows * width), p.output(rows * width));
    p.g.push(Op::Embedding {
        table,
        ids: p.batch.0,
        out: gathered,
        c: width,
    });
    p.g.push(Op::CrossEntropy {
        logits: gathered,
        targets: p.batch.1,
        grad,
        v: width,
        held: Format::F32,
    });
    let batch = p.batch;
    let plan = p.g.finish(Outline::ops_alone(2, 2, batch, grad)).unwrap();
    let scalars = vec![1.0; plan.scalar_count()];
    let mut exec = backend::executor(b, plan, true).unwrap();
    let good = [0u32, 4, 2, 1];
    let mut refused = |what: &str, tokens: &[u32], targets: &[u32], scalars: &[f32]| {
        let err = exec.run(Section::Step, tokens, targets, scalars).block_on();
        assert!(err.is_err(), "{}: {what} accepted", b.name());
    };
    refused("a short batch", &good[..3], &[0, 1, 2], &scalars);
    refused(
        "a token outside the table",
        &[0, 5, 2, 1],
        &[0; 4],
        &scalars,
    );
    refused(
        "a target outside the classes",
        &good,
        &[0, 1, 3, 2],
        &scalars,
    );
    refused("too few scalars", &good, &[0; 4], &scalars[1..]);
    assert!(
        exec.write(table, &[0.5; 14]).block_on().is_err(),
        "a short write accepted"
    );
    assert!(
        exec.write(99, &[0.5]).block_on().is_err(),
        "a write to no tensor accepted"
    );
    let stats = exec
        .run(Section::Step, &good, &[0, 1, 2, 2], &scalars)
        .block_on()
        .expect("a good batch after bad ones");
    assert!(stats[mantissa::plan::Stats::LOSS].is_finite(), "{stats:?}");
}

// The reference is the truth the other backends are compared with: it runs only the tests
// that check it against something else (f64 products and published error bands, bad input).
/// The backward ops that round their gradient dy as they read it (the norms', GELU's and
/// SiLU's), a strided copy rounding its source, the softmax its scores and its backward dp (a
/// plan folds the rounding of the matmul product before them in, `PlanBuilder::finish`) give,
/// on each executor, the same bits as the op reading dy rounded first: dy over NaN,
/// infinities, f16's overflow and subnormals, rows longer than a workgroup and not a multiple
/// of it.
fn backward_ops_round_dy_as_they_read_it(b: &dyn Backend) {
    let seed = common::seed("backward_ops_round_dy_as_they_read_it");
    let (rows, c) = (37, 300);
    let n = rows * c;
    let common::NormBackwardInputs {
        x,
        g,
        dy,
        stats,
        rstd,
    } = common::norm_backward_inputs(rows, c, seed);
    for format in [Format::Bf16, Format::F16] {
        let rounded: Vec<f32> = dy
            .iter()
            .map(|&v| format.round(v, mantissa::format::Overflow::Standard))
            .collect();
        for kernel in [
            "layer norm",
            "rms norm",
            "gelu",
            "silu",
            "strided copy",
            "softmax",
            "softmax backward",
        ] {
            // The op reading `dy_values` and rounding them to `dy_held`: its outputs.
            let run = |dy_values: &[f32], dy_held: Format| {
                let mut p = common::OneOp::new(1);
                let dy = p.input(dy_values.to_vec());
                let xi = p.input(x.clone());
                let (op, outs) = match kernel {
                    "layer norm" | "rms norm" => {
                        let (gi, (dx, dg, db)) =
                            (p.input(g.clone()), (p.output(n), p.output(c), p.output(c)));
                        if kernel == "layer norm" {
                            let stats = p.input(stats.clone());
                            let op = Op::LayerNormBwd {
                                dy,
                                x: xi,
                                g: gi,
                                stats,
                                dx,
                                dg,
                                db,
                                c,
                                dy_held,
                                sum: None,
                            };
                            (op, vec![dx, dg, db])
                        } else {
                            let stats = p.input(rstd.clone());
                            let op = Op::RmsNormBwd {
                                dy,
                                x: xi,
                                g: gi,
                                stats,
                                dx,
                                dg,
                                c,
                                dy_held,
                            };
                            (op, vec![dx, dg])
                        }
                    }
                    // Scores (dy's values) in 37 causal rows of 300, or dp.
                    "softmax" | "softmax backward" => {
                        let out = p.output(n);
                        let scale = ScoreScale {
                            scale: 0.3,
                            held: Format::Bf16,
                        };
                        let op = if kernel == "softmax" {
                            Op::Softmax {
                                x: dy,
                                out,
                                t: c,
                                causal: true,
                                mask: None,
                                scale,
                                x_held: dy_held,
                            }
                        } else {
                            let probs = p.input(x.iter().map(|v| v.abs() / 300.0).collect());
                            Op::SoftmaxBwd {
                                p: probs,
                                dp: dy,
                                out,
                                t: c,
                                causal: true,
                                scale,
                                dp_held: dy_held,
                            }
                        };
                        (op, vec![out])
                    }
                    // A head's third of (37, 1, 3 x 4 heads x 25) q|k|v, rounded as copied.
                    "strided copy" => {
                        let map = mantissa::plan::Strided::split_head(1, rows, 1, 4, 25);
                        let out = p.output(map.len());
                        let op = Op::Copy {
                            x: dy,
                            out,
                            map,
                            held: dy_held,
                        };
                        (op, vec![out])
                    }
                    _ => {
                        let out = p.output(n);
                        let held = Format::F32;
                        let op = if kernel == "gelu" {
                            Op::UnaryBwd {
                                f: Unary::Gelu,
                                x: xi,
                                dy,
                                out,
                                held,
                                dy_held,
                            }
                        } else {
                            Op::UnaryBwd {
                                f: Unary::Silu,
                                x: xi,
                                dy,
                                out,
                                held,
                                dy_held,
                            }
                        };
                        (op, vec![out])
                    }
                };
                p.run_both(b, op, (&[0], &[0]), 1.0, &outs)
            };
            let folded = run(&dy, format);
            let plain = run(&rounded, Format::F32);
            for (executor, (got, want)) in folded.iter().zip(&plain).enumerate() {
                for (i, (got, want)) in got.outs.iter().zip(&want.outs).enumerate() {
                    let what = format!(
                        "{} {kernel} backward rounding dy to {format} (executor {executor}, output {i})",
                        b.name()
                    );
                    common::same_or_nan(&what, got, want);
                }
            }
        }
    }
}

/// The layer norm's backward summing a second gradient r into dx (the add after it, folded in
/// by `PlanBuilder::push`) writes dx + r held in the format, and dg and db as without it: on
/// each executor, bit for bit against its own plain dx summed on the host, r over NaN,
/// infinities and f16's overflow and subnormals.
fn layer_norm_backward_sums_a_second_gradient(b: &dyn Backend) {
    let seed = common::seed("layer_norm_backward_sums_a_second_gradient");
    let (rows, c) = (37, 300);
    let n = rows * c;
    // r, the gradient summed in, carries the edge values.
    let common::NormBackwardInputs {
        x, g, dy: r, stats, ..
    } = common::norm_backward_inputs(rows, c, seed);
    let dy = measure::normal(n, seed + 3);
    for format in [Format::F32, Format::Bf16, Format::F16] {
        let run = |sum: bool| {
            let mut p = common::OneOp::new(1);
            let (dyi, xi, gi, si) = (
                p.input(dy.clone()),
                p.input(x.clone()),
                p.input(g.clone()),
                p.input(stats.clone()),
            );
            let ri = p.input(r.clone());
            let (dx, dg, db) = (p.output(n), p.output(c), p.output(c));
            let op = Op::LayerNormBwd {
                dy: dyi,
                x: xi,
                g: gi,
                stats: si,
                dx,
                dg,
                db,
                c,
                sum: sum.then_some((ri, format)),
                dy_held: Format::F32,
            };
            p.run_both(b, op, (&[0], &[0]), 1.0, &[dx, dg, db])
        };
        let (summed, plain) = (run(true), run(false));
        for (executor, (got, plain)) in summed.iter().zip(&plain).enumerate() {
            let mut want = plain.outs.clone();
            for (w, r) in want[0].iter_mut().zip(&r) {
                *w = format.round(*w + r, Overflow::Standard);
            }
            for (i, (got, want)) in got.outs.iter().zip(&want).enumerate() {
                let what = format!(
                    "{} layer norm backward summing r in {format} (executor {executor}, output {i})",
                    b.name()
                );
                common::same_or_nan(&what, got, want);
            }
        }
    }
}

backend_tests!(reference: matmul_error_bands, matmul_bad_input, matmul_long_k, train_ops, train_ops_bad_input, model_ops, backward_ops_round_dy_as_they_read_it, layer_norm_backward_sums_a_second_gradient);
backend_tests!(wgpu: casts, matmul_random, matmul_edges, matmul_error_bands, matmul_bad_input, matmul_too_large, matmul_long_k, train_ops, train_ops_long_loops, train_ops_bad_input, model_ops, backward_ops_round_dy_as_they_read_it, layer_norm_backward_sums_a_second_gradient);
backend_tests!(wgpu_packed_f16: matmul_random, matmul_edges);
// Runtime checks clamp each load's index: matmul_edges and the ops check them; a long K splits
// over dispatches as without them (matmul_long_k on wgpu), and took a minute here on lavapipe.
backend_tests!(wgpu_checked: casts, matmul_edges, train_ops, model_ops);
backend_tests!(wgpu_gpu_rows: train_ops, model_ops, backward_ops_round_dy_as_they_read_it, layer_norm_backward_sums_a_second_gradient);
backend_tests!(cuda: casts, matmul_random, matmul_edges, matmul_error_bands, matmul_bad_input, matmul_long_k, train_ops, train_ops_long_loops, train_ops_bad_input, model_ops, backward_ops_round_dy_as_they_read_it, layer_norm_backward_sums_a_second_gradient);

/// The product alone over prepared operands (what the bench times from `Operands::Prepared`)
/// computes C again bit for bit, for every algorithm and path of the CUDA backend.
#[cfg(feature = "cuda")]
mod prepared {
    mod cuda {
        use super::super::common;
        use mantissa::algorithm::MatmulShape;
        use mantissa::backend::cuda::CudaBackend;

        #[test]
        fn the_product_alone_recomputes_c() {
            let test = "prepared::cuda::the_product_alone_recomputes_c";
            let b = match CudaBackend::open(0) {
                Ok(b) => b,
                Err(e) => return common::skip(test, &format!("backend absent: {e}")),
            };
            let seed = common::seed(test);
            let shape = MatmulShape {
                batch: 2,
                m: 70,
                n: 44,
                k: 300,
                a_transposed: true,
                b_transposed: false,
            };
            let (a, bm, algorithms) = common::prepared_cases(&shape, seed);
            for alg in algorithms {
                let (whole, again) = b.matmul_product_again(&shape, &alg, &a, &bm).unwrap();
                assert!(
                    common::same_bits(&whole, &again),
                    "{alg}: the product alone differs"
                );
            }
        }
    }
}
