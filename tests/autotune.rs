//! The matmul autotuner: every candidate tile computes the same bits, and a tuned choice is
//! persisted and reused.

mod common;

use mantissa::backend::wgpu::WgpuOptions;
use mantissa::backend::wgpu::autotune::{AutotuneMode, Autotuner};
use mantissa::backend::{Backend, Operands};
use mantissa::{Algorithm, Format, MatmulShape, Scaling, measure};
use pollster::FutureExt as _;

#[test]
fn every_tile_gives_the_same_bits() {
    let Some(b) = common::fresh_wgpu("every_tile_gives_the_same_bits", WgpuOptions::default())
    else {
        return;
    };
    let seed = common::seed("every_tile_gives_the_same_bits");
    let shape = MatmulShape {
        batch: 2,
        m: 70,
        n: 45,
        k: 77,
        a_transposed: true,
        b_transposed: false,
    };
    let a = measure::wide_range(shape.a_len(), seed);
    let bm = measure::normal(shape.b_len(), seed + 1);
    // Every tile of f32 (both register blocks) and bf16x9 (three planes, five levels); every
    // third of the others, whose kernels differ from those only in how operands are decoded
    // (each tile is a kernel to compile, about a second apiece on lavapipe).
    for (alg, every) in [
        (Algorithm::F32, 1),
        (Algorithm::F16, 3),
        (Algorithm::Bf16x3, 3),
        (Algorithm::Bf16x9, 1),
        (
            Algorithm::fp8(Format::E4m3, Format::E5m2).with_scaling(Scaling::Rowwise),
            3,
        ),
    ] {
        let tiles: Vec<_> = b.tile_candidates(&alg).into_iter().step_by(every).collect();
        assert!(tiles.len() > 3, "{alg}: {tiles:?}");
        let want = b
            .matmul_on_tile(&shape, &alg, tiles[0], &a, &bm)
            .block_on()
            .unwrap();
        for &t in &tiles[1..] {
            let got = b
                .matmul_on_tile(&shape, &alg, t, &a, &bm)
                .block_on()
                .unwrap();
            let same = got
                .iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits());
            assert!(same, "{alg}: tile {t} differs from tile {}", tiles[0]);
        }
    }
}

#[test]
fn a_tuned_tile_is_persisted_and_reused() {
    let test = "a_tuned_tile_is_persisted_and_reused";
    let Some(b) = common::fresh_wgpu(test, WgpuOptions::default()) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("autotune.json");
    let b = b.with_tuner(Autotuner::new(AutotuneMode::Fast, Some(path.clone())));
    // Just over the least work that is tuned (autotune::TUNE_MIN_FLOPS).
    let shape = MatmulShape::new(160, 144, 96);
    let a = measure::normal(shape.a_len(), 1);
    let bm = measure::normal(shape.b_len(), 2);
    let timing = b
        .time_matmul(&shape, &Algorithm::F32, &a, &bm, 1, Operands::F32)
        .block_on()
        .unwrap();
    assert!(
        timing.variant.ends_with("(autotuned)"),
        "{}",
        timing.variant
    );
    let saved = std::fs::read_to_string(&path).expect("cache written");
    let entries: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&saved).unwrap();
    assert_eq!(entries.len(), 1, "{saved}");
    // A second tuner reads the choice instead of tuning again: the file stays as it was.
    let b = b.with_tuner(Autotuner::new(AutotuneMode::Fast, Some(path.clone())));
    let again = b
        .matmul(&shape, &Algorithm::F32, &a, &bm)
        .block_on()
        .unwrap();
    assert_eq!(again.len(), shape.c_len());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), saved);
    // A corrupt cache is ignored (and rewritten), never trusted.
    std::fs::write(&path, "{ not json").unwrap();
    let b = b.with_tuner(Autotuner::new(AutotuneMode::Fast, Some(path.clone())));
    b.matmul(&shape, &Algorithm::F32, &a, &bm)
        .block_on()
        .unwrap();
    assert!(
        serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&path).unwrap()).is_ok()
    );
    // A cache that parses but holds a tile that is not among today's candidates (edited by
    // hand, or written by another version) is re-tuned: the result stays right.
    let mut entries: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&saved).unwrap();
    for choice in entries.values_mut() {
        for dim in choice["choice"].as_object_mut().unwrap().values_mut() {
            if dim.is_number() {
                *dim = 7.into();
            }
        }
    }
    let hostile = serde_json::to_string(&entries).unwrap();
    std::fs::write(&path, &hostile).unwrap();
    let b = b.with_tuner(Autotuner::new(AutotuneMode::Fast, Some(path.clone())));
    let retuned = b
        .matmul(&shape, &Algorithm::F32, &a, &bm)
        .block_on()
        .unwrap();
    let same = retuned
        .iter()
        .zip(&again)
        .all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(same, "a hostile cached tile changed the result");
    let retuned = std::fs::read_to_string(&path).unwrap();
    assert_ne!(retuned, hostile);
    // A matmul under that work takes the default tile: nothing tuned, nothing stored.
    let small = MatmulShape::new(96, 80, 64);
    let (a, bm) = (
        measure::normal(small.a_len(), 3),
        measure::normal(small.b_len(), 4),
    );
    let timing = b
        .time_matmul(&small, &Algorithm::F32, &a, &bm, 1, Operands::F32)
        .block_on()
        .unwrap();
    assert!(!timing.variant.contains("autotuned"), "{}", timing.variant);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), retuned);
}
