//! Number formats: round trips, rounding, overflow, saturation, subnormals, finfo constants, and
//! agreement with ml_dtypes (golden vectors from tests/data/make_golden.py).

use mantissa::format::{self, Format, MiniFloat, Overflow};

fn nan_or_eq(format: Format, got: u32, want: u32) -> bool {
    got == want || (format.decode(got).is_nan() && format.decode(want).is_nan())
}

#[test]
fn every_code_decodes_and_reencodes_to_itself() {
    for format in [Format::Bf16, Format::F16, Format::E4m3, Format::E5m2] {
        for code in 0..1u32 << format.storage_bits() {
            let x = format.decode(code);
            if x.is_nan() {
                assert!(
                    format.decode(format.encode(x, Overflow::Standard)).is_nan(),
                    "{format} {code:#x}"
                );
                continue;
            }
            assert_eq!(
                format.encode(x, Overflow::Standard),
                code,
                "{format} {code:#x} = {x:e}"
            );
            let saturated = if x.is_infinite() {
                format.encode(x.signum() * format.max(), Overflow::Standard)
            } else {
                code
            };
            assert_eq!(
                format.encode(x, Overflow::Saturate),
                saturated,
                "{format} {code:#x} = {x:e} (saturating)"
            );
        }
    }
}

#[test]
fn agrees_with_ml_dtypes_bit_for_bit() {
    let bytes = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/golden_casts.bin"
    ))
    .expect("golden file");
    let n = u32::from_le_bytes(bytes[0..4].try_into().unwrap()) as usize;
    let mut at = 4;
    let mut take = |len: usize| {
        let s = &bytes[at..at + len];
        at += len;
        s
    };
    let x: Vec<f32> = take(4 * n)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let u16s = |s: &[u8]| -> Vec<u32> {
        s.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
            .collect()
    };
    let bf16 = u16s(take(2 * n));
    let f16 = u16s(take(2 * n));
    let e4m3: Vec<u32> = take(n).iter().map(|&b| b as u32).collect();
    let e5m2: Vec<u32> = take(n).iter().map(|&b| b as u32).collect();
    for (format, want) in [
        (Format::Bf16, bf16),
        (Format::F16, f16),
        (Format::E4m3, e4m3),
        (Format::E5m2, e5m2),
    ] {
        let bad: Vec<String> = x
            .iter()
            .zip(&want)
            .filter(|(v, w)| !nan_or_eq(format, format.encode(**v, Overflow::Standard), **w))
            .take(5)
            .map(|(v, w)| {
                format!(
                    "{v:e} ({:#x}): ours {:#x}, ml_dtypes {w:#x}",
                    v.to_bits(),
                    format.encode(*v, Overflow::Standard)
                )
            })
            .collect();
        assert!(bad.is_empty(), "{format}: {bad:?}");
    }
}

/// The generic layout code is an independent implementation of bf16/f16 rounding: it must agree
/// with the `half` crate that `Format` uses for them.
#[test]
fn generic_layout_agrees_with_half() {
    let mut x: Vec<f32> = (0..200_000u32)
        .map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)))
        .collect();
    x.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        65504.0,
        65520.0,
        65519.996,
        3.3895314e38,
        3.4e38,
    ]);
    for v in x {
        for (layout, half_bits) in [
            (MiniFloat::F16, half::f16::from_f32(v).to_bits() as u32),
            (MiniFloat::BF16, half::bf16::from_f32(v).to_bits() as u32),
        ] {
            let ours = layout.encode(v, Overflow::Standard);
            assert!(
                ours == half_bits || (v.is_nan() && layout.decode(ours).is_nan()),
                "{v:e}: {ours:#x} vs half {half_bits:#x}"
            );
        }
    }
}

#[test]
fn ties_round_to_even() {
    // f16 spacing at 1 is 2^-10: 1 + 2^-11 is halfway between 1 (even) and 1 + 2^-10 (odd).
    assert_eq!(
        Format::F16.round(1.0 + 2f32.powi(-11), Overflow::Standard),
        1.0
    );
    assert_eq!(
        Format::F16.round(1.0 + 3.0 * 2f32.powi(-11), Overflow::Standard),
        1.0 + 2.0 * 2f32.powi(-10)
    );
    assert_eq!(
        Format::Bf16.round(1.0 + 2f32.powi(-8), Overflow::Standard),
        1.0
    );
    assert_eq!(
        Format::Bf16.round(1.0 + 3.0 * 2f32.powi(-8), Overflow::Standard),
        1.0 + 2.0 * 2f32.powi(-7)
    );
    assert_eq!(
        Format::Tf32.round(1.0 + 2f32.powi(-11), Overflow::Standard),
        1.0
    );
    assert_eq!(
        Format::Tf32.round(1.0 + 3.0 * 2f32.powi(-11), Overflow::Standard),
        1.0 + 2.0 * 2f32.powi(-10)
    );
    // e4m3 around 1: spacing 1/8. 1.0625 ties to 1.0; 1.1875 ties to 1.25.
    assert_eq!(Format::E4m3.round(1.0625, Overflow::Standard), 1.0);
    assert_eq!(Format::E4m3.round(1.1875, Overflow::Standard), 1.25);
    // e5m2 around 1: spacing 1/4. 1.125 ties to 1.0; 1.375 ties to 1.5.
    assert_eq!(Format::E5m2.round(1.125, Overflow::Standard), 1.0);
    assert_eq!(Format::E5m2.round(1.375, Overflow::Standard), 1.5);
    // Subnormal ties: e4m3's smallest subnormal is 2^-9; half of it ties to 0, 1.5x to 2^-8.
    assert_eq!(Format::E4m3.round(2f32.powi(-10), Overflow::Standard), 0.0);
    assert_eq!(
        Format::E4m3.round(3.0 * 2f32.powi(-10), Overflow::Standard),
        2f32.powi(-8)
    );
}

#[test]
fn overflow_and_saturation_on_both_sides_of_the_boundary() {
    // (format, max, value just below the rounding boundary, value at it)
    let cases = [
        (Format::F16, 65504.0f32, 65519.99, 65520.0),
        (Format::E5m2, 57344.0, 61439.99, 61440.0),
        // bf16 max is 0x7f7f; the tie with 2^128 is the f32 0x7f7f8000.
        (
            Format::Bf16,
            3.3895314e38,
            f32::from_bits(0x7f7f_7fff),
            f32::from_bits(0x7f7f_8000),
        ),
    ];
    for (f, max, below, at) in cases {
        assert_eq!(f.max(), max, "{f}");
        assert_eq!(f.round(below, Overflow::Standard), max, "{f} {below}");
        assert_eq!(f.round(at, Overflow::Standard), f32::INFINITY, "{f} {at}");
        assert_eq!(
            f.round(-at, Overflow::Standard),
            f32::NEG_INFINITY,
            "{f} -{at}"
        );
        assert_eq!(f.round(at, Overflow::Saturate), max, "{f} {at} saturating");
        assert_eq!(
            f.round(f32::INFINITY, Overflow::Saturate),
            max,
            "{f} inf saturating"
        );
        assert_eq!(
            f.round(f32::NEG_INFINITY, Overflow::Saturate),
            -max,
            "{f} -inf saturating"
        );
        assert!(
            f.round(f32::NAN, Overflow::Saturate).is_nan(),
            "{f} NaN stays NaN"
        );
    }
    // e4m3fn has no inf: overflow (and inf) become NaN; 464 is the tie between 448 and 480.
    assert_eq!(Format::E4m3.round(464.0, Overflow::Standard), 448.0);
    assert!(Format::E4m3.round(464.01, Overflow::Standard).is_nan());
    assert!(
        Format::E4m3
            .round(f32::INFINITY, Overflow::Standard)
            .is_nan()
    );
    assert_eq!(Format::E4m3.encode(-1e6, Overflow::Standard), 0xff);
    assert_eq!(Format::E4m3.encode(1e6, Overflow::Saturate), 0x7e);
    assert_eq!(Format::E4m3.encode(-1e6, Overflow::Saturate), 0xfe);
    assert_eq!(Format::E5m2.encode(f32::INFINITY, Overflow::Standard), 0x7c);
    // tf32 is carried in f32: its overflow to inf is f32's.
    assert_eq!(
        Format::Tf32.round(f32::MAX, Overflow::Standard),
        f32::INFINITY
    );
    assert_eq!(
        Format::Tf32.round(f32::MAX, Overflow::Saturate),
        Format::Tf32.max()
    );
}

#[test]
fn subnormals_on_both_sides() {
    let f16_min_sub = 2f32.powi(-24);
    assert_eq!(Format::F16.encode(f16_min_sub, Overflow::Standard), 1);
    assert_eq!(Format::F16.encode(f16_min_sub * 0.5, Overflow::Standard), 0); // tie to even (0)
    assert_eq!(
        Format::F16.encode(f16_min_sub * 0.51, Overflow::Standard),
        1
    );
    assert_eq!(
        Format::F16.encode(2f32.powi(-14) - f16_min_sub, Overflow::Standard),
        0x3ff
    ); // largest subnormal
    assert_eq!(
        Format::F16.encode(2f32.powi(-14), Overflow::Standard),
        0x400
    ); // smallest normal
    assert_eq!(Format::E5m2.decode(1), 2f32.powi(-16));
    assert_eq!(Format::E4m3.decode(1), 2f32.powi(-9));
    assert_eq!(Format::E4m3.decode(0x08), 2f32.powi(-6));
    // f32 subnormals keep their bits in bf16 (same exponent range) and round correctly.
    let tiny = f32::from_bits(0x0001_8000);
    assert_eq!(Format::Bf16.encode(tiny, Overflow::Standard), 0x0002); // 0x18000 -> tie -> even 0x2
    assert_eq!(Format::Bf16.decode(0x0001), f32::from_bits(0x0001_0000));
    // Negative zero keeps its sign.
    for f in Format::ALL {
        assert!(f.round(-0.0, Overflow::Standard).is_sign_negative(), "{f}");
    }
}

#[test]
fn finfo_equals_torch() {
    // torch.finfo(dtype): (max, smallest_normal, eps) as PyTorch prints them.
    let expected = [
        (Format::E4m3, 448.0, 0.015625, 0.125, 1.0),
        (Format::E5m2, 57344.0, 6.103515625e-05, 0.25, 1.0),
        (
            Format::Bf16,
            3.3895313892515355e38,
            1.1754943508222875e-38,
            0.0078125,
            0.01,
        ),
        (Format::F16, 65504.0, 6.103515625e-05, 0.0009765625, 0.001),
        (
            Format::F32,
            3.4028234663852886e38,
            1.1754943508222875e-38,
            1.1920928955078125e-07,
            1e-06,
        ),
    ];
    for (f, max, tiny, eps, resolution) in expected {
        let i = f.finfo();
        assert_eq!(i.max, max, "{f} max");
        assert_eq!(i.min, -max, "{f} min");
        assert_eq!(i.smallest_normal, tiny, "{f} smallest normal");
        assert_eq!(i.eps, eps, "{f} eps");
        assert!(
            (i.resolution - resolution).abs() < 1e-12,
            "{f} resolution {}",
            i.resolution
        );
    }
    assert_eq!(Format::E4m3.finfo().smallest_subnormal, 2f64.powi(-9));
    assert_eq!(Format::E5m2.finfo().smallest_subnormal, 2f64.powi(-16));
    assert_eq!(Format::F16.finfo().smallest_subnormal, 2f64.powi(-24));
    assert_eq!(Format::Bf16.finfo().smallest_subnormal, 2f64.powi(-133));
}

#[test]
fn split_is_exact_and_keeps_non_finite_in_h() {
    // (Exact where l stays above bf16's subnormal range, |x| >= about 2^-110.)
    for x in [
        1.0f32,
        std::f32::consts::PI,
        -1.2345678e-3,
        3.0e30,
        1.0e-30,
        65504.1,
    ] {
        let [h, m, l] = format::split_bf16(x);
        for p in [h, m, l] {
            assert_eq!(
                Format::Bf16.round(p, Overflow::Standard),
                p,
                "{x}: part {p} is not bf16"
            );
        }
        // h + m + l carries 24 significant bits: x exactly for normal x.
        assert_eq!((h as f64) + (m as f64) + (l as f64), x as f64, "{x}");
    }
    assert_eq!(format::split_bf16(f32::INFINITY), [f32::INFINITY, 0.0, 0.0]);
    let [h, m, l] = format::split_bf16(f32::NAN);
    assert!(h.is_nan() && m == 0.0 && l == 0.0);
    // A finite value whose bf16 rounding overflows becomes inf (documented in docs/design.md).
    assert_eq!(format::split_bf16(f32::MAX), [f32::INFINITY, 0.0, 0.0]);
}

#[test]
fn fp8_scaling_helpers() {
    assert_eq!(format::amax([1.0, -3.0, f32::NAN, f32::INFINITY, 2.0]), 3.0);
    assert_eq!(format::amax([f32::NAN]), 0.0);
    assert_eq!(format::scale_for_amax(0.0, Format::E4m3), 1.0);
    assert_eq!(format::scale_for_amax(2.0, Format::E4m3), 224.0);
    assert_eq!(format::scale_for_amax(1e-45, Format::E5m2), f32::MAX);
    assert!(format::quantize_scaled(f32::INFINITY, 1.0, Format::E4m3).is_nan());
    assert_eq!(format::quantize_scaled(1000.0, 1.0, Format::E4m3), 448.0);
    assert_eq!(format::quantize_scaled(3.0, 100.0, Format::E4m3), 288.0);
}

#[test]
fn names_parse_and_print_and_wrong_names_list_the_valid_ones() {
    for f in Format::ALL {
        assert_eq!(f.to_string().parse::<Format>().unwrap(), f);
    }
    assert_eq!("bfloat16".parse::<Format>().unwrap(), Format::Bf16);
    let err = "fp7".parse::<Format>().unwrap_err().to_string();
    assert!(
        err.contains("unknown format 'fp7'") && err.contains("e4m3") && err.contains("tf32"),
        "{err}"
    );
}
