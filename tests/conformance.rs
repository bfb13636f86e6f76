//! The conformance suite: every op of every backend present against the host reference.
//!
//! Casts, splits and amax must agree bit for bit (NaN payloads aside); matmuls must keep the
//! non-finite pattern of the reference exactly and stay within the algorithm's accumulation
//! tolerance elsewhere, and their error against an f64 product must lie in the range the
//! numerics contract gives. Inputs are fresh random values (seed printed) plus edge cases, on
//! odd shapes (1, 3, 50, 783, one above the 64-wide tile), batched and transposed.

mod common;

use mantissa::algorithm::{Algorithm, MatmulShape, Scaling};
use mantissa::backend::Backend;
use mantissa::format::{self, Format, Overflow};
use mantissa::measure;
use mantissa::measure::train_tolerance as tol;
use mantissa::plan::ScoreScale;
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

/// Training ops refuse operands of the wrong length with an error, never a panic or a read past
/// a buffer: the same checks (`backend::check`) on every backend.
fn train_ops_bad_input(b: &dyn Backend) {
    let x = vec![0.5f32; 12];
    let opt = mantissa::plan::AdamW::default();
    fn refused<T>(what: &str, r: mantissa::Result<T>) {
        assert!(r.is_err(), "{what} accepted");
    }
    refused(
        "a short gain",
        b.layernorm_fwd(&x, &[1.0; 3], &[0.0; 4], 4).block_on(),
    );
    refused(
        "rows that do not divide",
        b.layernorm_fwd(&x, &[1.0; 5], &[0.0; 5], 5).block_on(),
    );
    refused(
        "short layer-norm stats",
        b.layernorm_bwd(&x, &x, &[1.0; 4], &[0.0; 2], &[1.0; 3], 4)
            .block_on(),
    );
    refused("a short GELU gradient", b.gelu_bwd(&x, &x[..5]).block_on());
    refused(
        "a short softmax gradient",
        b.causal_softmax_bwd(
            &x,
            &x[..8],
            2,
            ScoreScale {
                scale: 1.0,
                held: Format::F32,
            },
        )
        .block_on(),
    );
    refused(
        "too few targets",
        b.cross_entropy_fwd(&x, &[0, 1], 4).block_on(),
    );
    refused(
        "a target outside the vocabulary",
        b.cross_entropy_bwd(&x, &[0, 1, 4], 4, 1.0).block_on(),
    );
    let (mut p, mut m, mut v) = (x.clone(), vec![0.0; 11], vec![0.0; 12]);
    refused(
        "a short moment",
        b.adamw(&opt, &mut p, &x, &mut m, &mut v, 1, true)
            .block_on(),
    );
    refused(
        "a short embedding gradient",
        b.embedding_bwd(&x[..5], &[0, 1], 3, 3).block_on(),
    );
}

/// The training ops against the host reference (`backend::reference::ops`) on odd shapes.
fn train_ops(b: &dyn Backend) {
    use mantissa::backend::reference::ops;
    let seed = common::seed("train_ops");
    // Rows narrower than a row's lanes on a GPU and wider than a workgroup; one chunk of rows
    // of the column reductions, and several with a partial last one.
    for (rows, c) in [(37, 50), (600, 300)] {
        let x = measure::normal(rows * c, seed);
        let (g, bias) = (measure::normal(c, seed + 1), measure::normal(c, seed + 2));
        let dy = measure::normal(rows * c, seed + 3);
        let what = |name: &str| format!("layernorm {name}, {rows} rows of {c}");
        let (y, mean, rstd) = b.layernorm_fwd(&x, &g, &bias, c).block_on().unwrap();
        let (wy, wm, wr) = ops::layernorm_fwd(&x, &g, &bias, c);
        common::close(&what("y"), &y, &wy, tol::ROW);
        common::close(&what("mean"), &mean, &wm, tol::ROW);
        common::close(&what("rstd"), &rstd, &wr, tol::ROW);
        let (dx, dg, db) = b
            .layernorm_bwd(&dy, &x, &g, &wm, &wr, c)
            .block_on()
            .unwrap();
        let (wdx, wdg, wdb) = ops::layernorm_bwd(&dy, &x, &g, &wm, &wr, c);
        common::close(&what("dx"), &dx, &wdx, tol::REDUCTION);
        common::close(&what("dg"), &dg, &wdg, tol::REDUCTION);
        common::close(&what("db"), &db, &wdb, tol::REDUCTION);
    }
    let (rows, c) = (37, 50);
    let x = measure::normal(rows * c, seed);
    let dy = measure::normal(rows * c, seed + 3);
    common::close(
        "gelu",
        &b.gelu_fwd(&x).block_on().unwrap(),
        &ops::gelu_fwd(&x),
        tol::ROW,
    );
    common::close(
        "gelu bwd",
        &b.gelu_bwd(&x, &dy).block_on().unwrap(),
        &ops::gelu_bwd(&x, &dy),
        tol::ROW,
    );
    // Contexts shorter and longer than a row op's workgroup; the scaled scores held in f32, and
    // in bf16 (their f32 product is the same bits on both sides, so the forward is as close as
    // f32's; a power-of-two scale makes the backward's two roundings one).
    for (t, scale) in [(13, 0.3), (300, 0.3), (13, 0.25)] {
        let s = measure::normal(3 * t * t, seed + 4);
        let dp = measure::normal(3 * t * t, seed + 5);
        for held in [Format::F32, Format::Bf16] {
            let k = ScoreScale { scale, held };
            let p = b.causal_softmax_fwd(&s, t, k).block_on().unwrap();
            let what = format!("softmax, t {t}, scores x {scale} held in {held}");
            common::close(
                &what,
                &p,
                &ops::causal_softmax_scaled_fwd(&s, t, k),
                tol::ROW,
            );
            let ds = b.causal_softmax_bwd(&p, &dp, t, k).block_on().unwrap();
            let want = ops::causal_softmax_scaled_bwd(&p, &dp, t, k);
            let what = format!("softmax bwd, t {t}, scores x {scale} held in {held}");
            match held {
                Format::F32 => common::close(&what, &ds, &want, tol::ROW),
                _ if scale == 0.25 => common::held_close(&what, &ds, &want, held, tol::ROW),
                _ => {}
            }
        }
    }
    let v = 76;
    let logits: Vec<f32> = measure::normal(rows * v, seed + 6)
        .iter()
        .map(|x| 3.0 * x)
        .collect();
    let targets: Vec<u32> = (0..rows as u32).map(|r| (r * 7 + 3) % v as u32).collect();
    let (loss, probs) = b
        .cross_entropy_fwd(&logits, &targets, v)
        .block_on()
        .unwrap();
    let (wloss, wprobs) = ops::cross_entropy_fwd(&logits, &targets, v);
    assert!(
        (loss - wloss).abs() <= tol::ROW as f64 * wloss,
        "cross entropy {loss} vs {wloss}"
    );
    common::close("cross entropy probs", &probs, &wprobs, tol::ROW);
    common::close(
        "cross entropy bwd",
        &b.cross_entropy_bwd(&wprobs, &targets, v, 1024.0)
            .block_on()
            .unwrap(),
        &ops::cross_entropy_bwd(&wprobs, &targets, v, 1024.0),
        tol::ROW,
    );
    let opt = mantissa::plan::AdamW::default();
    let grad = measure::normal(1001, seed + 7);
    let (mut p1, mut m1, mut v1) = (
        measure::normal(1001, seed + 8),
        vec![0.01f32; 1001],
        vec![0.001f32; 1001],
    );
    let (mut p2, mut m2, mut v2) = (p1.clone(), m1.clone(), v1.clone());
    b.adamw(&opt, &mut p1, &grad, &mut m1, &mut v1, 3, true)
        .block_on()
        .unwrap();
    ops::adamw(&opt, &mut p2, &grad, &mut m2, &mut v2, 3, true);
    common::close("adamw p", &p1, &p2, tol::ARITHMETIC);
    common::close("adamw m", &m1, &m2, tol::ARITHMETIC);
    common::close("adamw v", &v1, &v2, tol::ARITHMETIC);
    let (vocab, width) = (11, 7);
    let table = measure::normal(vocab * width, seed + 9);
    let ids: Vec<u32> = (0..29u32).map(|i| (i * 5 + 1) % vocab as u32).collect();
    let gathered = b.embedding_fwd(&table, &ids, width).block_on().unwrap();
    assert_eq!(
        gathered,
        ops::embedding_fwd(&table, &ids, width),
        "embedding gather is exact"
    );
    let dout = measure::normal(ids.len() * width, seed + 10);
    common::close(
        "embedding scatter-add",
        &b.embedding_bwd(&dout, &ids, vocab, width)
            .block_on()
            .unwrap(),
        &ops::embedding_bwd(&dout, &ids, vocab, width),
        tol::ROW,
    );
    assert!(
        b.embedding_fwd(&table, &[vocab as u32], width)
            .block_on()
            .is_err(),
        "an id outside the table is an error"
    );
    let mut grads = measure::normal(3001, seed + 11);
    let mut want = grads.clone();
    assert!(
        b.unscale_check(&mut grads, 1.0 / 1024.0)
            .block_on()
            .unwrap()
    );
    assert!(ops::unscale_check(&mut want, 1.0 / 1024.0));
    assert_eq!(grads, want, "unscaling is one exact f32 multiplication");
    grads[1234] = f32::INFINITY;
    assert!(
        !b.unscale_check(&mut grads, 0.5).block_on().unwrap(),
        "an inf gradient is reported"
    );
    grads[1234] = f32::NAN;
    assert!(
        !b.unscale_check(&mut grads, 0.5).block_on().unwrap(),
        "a NaN gradient is reported"
    );
}

// The reference is the truth the other backends are compared with: it runs only the tests
// that check it against something else (f64 products and published error bands, bad input).
backend_tests!(reference: matmul_error_bands, matmul_bad_input, train_ops_bad_input);
backend_tests!(wgpu: casts, matmul_random, matmul_edges, matmul_error_bands, matmul_bad_input, matmul_too_large, train_ops, train_ops_bad_input);
backend_tests!(wgpu_packed_f16: matmul_random, matmul_edges);
backend_tests!(wgpu_checked: casts, matmul_edges, train_ops);
backend_tests!(wgpu_gpu_rows: train_ops);
backend_tests!(cuda: casts, matmul_random, matmul_edges, matmul_error_bands, matmul_bad_input, train_ops, train_ops_bad_input);

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
