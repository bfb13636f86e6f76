//! The host reference against hand-worked cases: each algorithm's rounding, splitting, levels
//! and scales, worked out on paper below.

use mantissa::algorithm::{Algorithm, MatmulShape, Scaling};
use mantissa::backend::reference::matmul;
use mantissa::format::Format;

fn mm(alg: Algorithm, m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
    matmul(&MatmulShape::new(m, n, k), &alg, a, b).unwrap()
}

#[test]
fn f32_is_the_plain_product() {
    assert_eq!(
        mm(
            Algorithm::F32,
            2,
            2,
            2,
            &[1., 2., 3., 4.],
            &[5., 6., 7., 8.]
        ),
        vec![19., 22., 43., 50.]
    );
}

#[test]
fn tf32_bf16_f16_round_the_inputs() {
    let p = |e: i32| 2f32.powi(e);
    // 1 + 2^-12 is below tf32's half ulp at 1 (2^-11): it rounds to 1.
    assert_eq!(
        mm(Algorithm::Tf32, 1, 1, 1, &[1. + p(-12)], &[1.]),
        vec![1.]
    );
    assert_eq!(
        mm(Algorithm::F32, 1, 1, 1, &[1. + p(-12)], &[1.]),
        vec![1. + p(-12)]
    );
    // bf16: 1 + 2^-7 + 2^-9 rounds to 1 + 2^-7 (7 explicit bits).
    assert_eq!(
        mm(Algorithm::Bf16, 1, 1, 1, &[1. + p(-7) + p(-9)], &[1.]),
        vec![1. + p(-7)]
    );
    // f16 overflows to inf beyond 65520 and flushes below half its smallest subnormal.
    assert_eq!(
        mm(Algorithm::F16, 1, 1, 1, &[70000.], &[1.]),
        vec![f32::INFINITY]
    );
    assert_eq!(mm(Algorithm::F16, 1, 1, 1, &[1e-8], &[1.]), vec![0.]);
    // bf16 keeps f32's range: 70000 is fine (rounded to 70144 = 137 * 2^9).
    assert_eq!(mm(Algorithm::Bf16, 1, 1, 1, &[70000.], &[1.]), vec![70144.]);
}

#[test]
fn split_levels_add_what_each_promises() {
    let p = |e: i32| 2f32.powi(e);
    // x = 1 + 2^-10 + 2^-20 splits into h = 1, m = 2^-10, l = 2^-20.
    // L0 = hh = 1, L1 = hm + mh = 2^-9, L2 = mm + hl + lh = 2^-20 + 2^-19,
    // L3 = ml + lm = 2^-29, L4 = ll = 2^-40.
    let x = 1. + p(-10) + p(-20);
    assert_eq!(mm(Algorithm::Bf16x3, 1, 1, 1, &[x], &[x]), vec![1. + p(-9)]);
    assert_eq!(
        mm(Algorithm::Bf16x6, 1, 1, 1, &[x], &[x]),
        vec![1. + p(-9) + 3. * p(-20)]
    );
    // L3 and L4 lie below f32's half ulp at 1: x9 rounds to the same f32 as x6 here.
    assert_eq!(
        mm(Algorithm::Bf16x9, 1, 1, 1, &[x], &[x]),
        vec![1. + p(-9) + 3. * p(-20)]
    );
    // And x9's result is the f32 rounding of the exact product.
    let exact = (x as f64) * (x as f64);
    assert_eq!(mm(Algorithm::Bf16x9, 1, 1, 1, &[x], &[x])[0], exact as f32);
}

#[test]
fn non_finite_values_follow_the_split_rules() {
    // inf in A's row: h = inf, m = l = 0, lower levels use 0 for h: C = inf, never NaN.
    let a = [f32::INFINITY, 1.0];
    let b = [2.0, 3.0];
    for alg in [
        Algorithm::F32,
        Algorithm::Bf16x3,
        Algorithm::Bf16x6,
        Algorithm::Bf16x9,
    ] {
        assert_eq!(mm(alg, 1, 1, 2, &a, &b), vec![f32::INFINITY], "{alg}");
        assert_eq!(
            mm(alg, 1, 1, 2, &[f32::NEG_INFINITY, 1.0], &b),
            vec![f32::NEG_INFINITY],
            "{alg}"
        );
        // inf * 0 is NaN for every algorithm alike.
        assert!(mm(alg, 1, 1, 2, &a, &[0.0, 3.0])[0].is_nan(), "{alg}");
    }
    // A finite value whose bf16 rounding overflows becomes inf in the split algorithms.
    assert_eq!(
        mm(Algorithm::Bf16x3, 1, 1, 1, &[f32::MAX], &[0.5]),
        vec![f32::INFINITY]
    );
    // fp8: a non-finite input makes the outputs it touches NaN, and only those.
    let c = mm(
        Algorithm::fp8(Format::E4m3, Format::E4m3),
        2,
        1,
        1,
        &[f32::INFINITY, 1.0],
        &[1.0],
    );
    assert!(c[0].is_nan());
    assert_eq!(c[1], 1.0);
}

#[test]
fn fp8_tensorwise_scales_worked_by_hand() {
    // A = [1 2]: amax 2, s_a = 448 / 2 = 224; q_a = [224, 448] (both exact in e4m3).
    // B = [3; 0.5]: amax 3, s_b = 448 / 3 = 149.33333 (f32); q_b = [448.00002 -> 448,
    // 74.666664 -> 72 (e4m3 spacing is 8 in [64, 128))].
    // C = (224 * 448 + 448 * 72) / (224 * s_b).
    let s_b = 448f32 / 3f32;
    let want = ((224. * 448. + 448. * 72.) / (224f64 * s_b as f64)) as f32;
    let c = mm(
        Algorithm::fp8(Format::E4m3, Format::E4m3),
        1,
        1,
        2,
        &[1., 2.],
        &[3., 0.5],
    );
    assert_eq!(c, vec![want]);
    assert!((c[0] - 4.0).abs() < 0.05, "{c:?}: close to the exact 4");
}

#[test]
fn fp8_rowwise_keeps_small_rows_and_given_scales_are_used() {
    // Tensorwise: s_a = 448 / 1000 = 0.448; row 0: 1 * 0.448 -> e4m3 0.4375 (spacing 1/32 in
    // [0.25, 0.5)); s_b = 448, q_b = 448: C[0] = 0.4375 * 448 / (0.448 * 448) = 0.9765625.
    let tensorwise = Algorithm::fp8(Format::E4m3, Format::E4m3);
    let c = mm(tensorwise, 2, 1, 1, &[1., 1000.], &[1.]);
    let want0 = (0.4375f64 * 448. / (0.448f32 as f64 * 448.)) as f32;
    assert_eq!(c[0], want0);
    // Rowwise: row 0 gets its own scale 448, so 1 is exact; row 1 has s = 448 / 1000 in f32
    // (0.44800001), q = 448, C = 448 * 448 / (s * 448) = 999.99994.
    let c = mm(
        tensorwise.with_scaling(Scaling::Rowwise),
        2,
        1,
        1,
        &[1., 1000.],
        &[1.],
    );
    assert_eq!(c, vec![1., (448f64 / (448f32 / 1000f32) as f64) as f32]);
    // Given scales: q_a = sat(3 * 2) = 6, q_b = sat(5 * 0.5) = 2.5 (e5m2: 2.5 exact),
    // C = 6 * 2.5 / (2 * 0.5) = 15.
    let given =
        Algorithm::fp8(Format::E4m3, Format::E5m2).with_scaling(Scaling::Given { a: 2.0, b: 0.5 });
    assert_eq!(mm(given, 1, 1, 1, &[3.], &[5.]), vec![15.]);
    // Saturation: 1000 * 2 saturates to 448 in e4m3: C = 448 * 1 / 2 = 224.
    let given =
        Algorithm::fp8(Format::E4m3, Format::E4m3).with_scaling(Scaling::Given { a: 2.0, b: 1.0 });
    assert_eq!(mm(given, 1, 1, 1, &[1000.], &[1.]), vec![224.]);
}

#[test]
fn batched_and_transposed_operands() {
    // Two batches; A transposed (stored k x m), B transposed (stored n x k).
    let shape = MatmulShape {
        batch: 2,
        m: 2,
        n: 1,
        k: 2,
        a_transposed: true,
        b_transposed: true,
    };
    // batch 0: A = [[1, 2], [3, 4]] stored transposed as [1, 3, 2, 4]; B = [5; 6] stored as [5, 6].
    // batch 1: A = identity, B = [7; 8].
    let a = [1., 3., 2., 4., 1., 0., 0., 1.];
    let b = [5., 6., 7., 8.];
    assert_eq!(
        matmul(&shape, &Algorithm::F32, &a, &b).unwrap(),
        vec![17., 39., 7., 8.]
    );
}

#[test]
fn algorithm_names_parse_print_and_reject() {
    for alg in Algorithm::ALL {
        assert_eq!(alg.to_string().parse::<Algorithm>().unwrap(), alg);
    }
    let r: Algorithm = "e4m3-e5m2:rowwise".parse().unwrap();
    assert_eq!(
        r,
        Algorithm::fp8(Format::E4m3, Format::E5m2).with_scaling(Scaling::Rowwise)
    );
    assert_eq!(r.to_string(), "e4m3-e5m2:rowwise");
    let g: Algorithm = "e5m2:given=0.5,2".parse().unwrap();
    assert_eq!(g.to_string(), "e5m2:given=0.5/2");
    let err = "bf16x4".parse::<Algorithm>().unwrap_err().to_string();
    assert!(
        err.contains("unknown algorithm 'bf16x4'")
            && err.contains("bf16x3")
            && err.contains("e5m2-e4m3"),
        "{err}"
    );
    assert!("bf16x3:rowwise".parse::<Algorithm>().is_err());
    assert!("e4m3:given=0,1".parse::<Algorithm>().is_err());
}
