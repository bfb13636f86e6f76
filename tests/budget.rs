//! The loop budget (src/backend/wgpu/budget.rs): measured when the device opens, and long loops
//! split over dispatches that compute the bits one dispatch would. The split paths run on any
//! adapter here: a backend told to assume a small budget splits sums of a few thousand terms,
//! and is compared bit for bit with one that runs them whole (on lavapipe's Mesa 22, whose
//! budget is 65535, sums this short run whole). K far past the real budget is the conformance
//! suite's (`matmul_long_k`); the cooperative kernel's split is tests/coop.rs's.

mod common;

use mantissa::algorithm::{Algorithm, MatmulShape};
use mantissa::backend::Backend;
use mantissa::backend::wgpu::{WgpuBackend, WgpuOptions};
use mantissa::measure;
use pollster::FutureExt as _;

/// The budget the split backends assume: half of it (what kernels plan on) holds a few dozen
/// K steps of the matmul kernel, so K = 3000 takes several dispatches.
const SMALL_BUDGET: u32 = 2000;

/// A backend that runs loops whole where the adapter allows, and one that assumes
/// `SMALL_BUDGET`, both with `checks` (the K step written out per k), on SIMT kernels.
fn pair(test: &str, checks: bool) -> Option<(WgpuBackend, WgpuBackend)> {
    let options = WgpuOptions {
        poison_outputs: true,
        runtime_checks: checks,
        coop: false,
        ..WgpuOptions::default()
    };
    let whole = common::fresh_wgpu(test, options)?;
    let split = common::fresh_wgpu(
        test,
        WgpuOptions {
            assume_loop_budget: Some(SMALL_BUDGET),
            ..options
        },
    )?;
    assert_eq!(
        split.loop_budget(),
        Some(
            whole
                .loop_budget()
                .map_or(SMALL_BUDGET, |b| b.min(SMALL_BUDGET))
        )
    );
    Some((whole, split))
}

/// Mesa's llvmpipe stops a shader's loops after 65535 iterations in Debian 12's Mesa 22 and
/// not at all in Mesa 26 (scripts/lavapipe-coop.sh); what the probe measures elsewhere is
/// printed.
#[test]
fn the_budget_is_what_the_driver_allows() {
    let test = "the_budget_is_what_the_driver_allows";
    let Some(b) = common::fresh_wgpu(test, WgpuOptions::default()) else {
        return;
    };
    let driver = &b.summary().driver;
    eprintln!("{}: {driver}: loop budget {:?}", b.name(), b.loop_budget());
    if driver.contains("llvmpipe") && driver.contains("Mesa 22.") {
        assert_eq!(b.loop_budget(), Some(65535), "{driver}");
    }
    if driver.contains("llvmpipe") && driver.contains("Mesa 26.") {
        assert_eq!(b.loop_budget(), None, "{driver}");
    }
}

/// Every algorithm (fp8 also rowwise and with given scales), K split into spans, computes the
/// bits of one span (N(0,1) inputs but for two rows of A in a wide range and an inf in a
/// third), batched and transposed; on
/// double-buffered tiles and 8x8 register blocks too (f32, bf16x3), and with the K step
/// written out (runtime checks) for a sample of them.
#[test]
fn a_split_k_gives_the_bits_of_one_dispatch() {
    let test = "a_split_k_gives_the_bits_of_one_dispatch";
    let seed = common::seed(test);
    let shapes = [
        MatmulShape::new(37, 29, 3000),
        MatmulShape {
            batch: 2,
            m: 19,
            n: 41,
            k: 3001,
            a_transposed: true,
            b_transposed: true,
        },
    ];
    for checks in [false, true] {
        let Some((whole, split)) = pair(test, checks) else {
            return;
        };
        for (s, shape) in shapes.iter().enumerate() {
            let (_, _, algorithms) = common::prepared_cases(shape, seed);
            let mut a = measure::normal(shape.a_len(), seed + 3 * s as u64);
            let lines = shape.batch * shape.m;
            let wide = measure::wide_range(shape.a_len() / lines, seed + 3 * s as u64 + 1);
            for line in [3, 11] {
                a[line * wide.len()..(line + 1) * wide.len()].copy_from_slice(&wide);
            }
            a[7 * wide.len() + 5] = f32::INFINITY;
            let b = measure::normal(shape.b_len(), seed + 3 * s as u64 + 2);
            for alg in algorithms {
                let name = alg.to_string();
                let sampled = ["f32", "bf16x6", "e4m3-e5m2:rowwise"].contains(&name.as_str());
                if checks && !sampled {
                    continue;
                }
                let candidates = split.tile_candidates(&alg);
                let mut tiles = vec![candidates[0]];
                if matches!(alg, Algorithm::F32 | Algorithm::Bf16x3) {
                    tiles.extend(candidates.iter().find(|t| t.buffers == 2));
                    tiles.extend(candidates.iter().find(|t| t.reg == 8));
                }
                for tile in tiles {
                    let spans = split.k_spans(shape, &alg, tile).unwrap();
                    assert!(spans.len() > 1, "{alg} {tile} {shape:?}: {spans:?}");
                    assert_eq!(whole.k_spans(shape, &alg, tile).unwrap().len(), 1);
                    let run = |on: &WgpuBackend| {
                        on.matmul_on_tile(shape, &alg, tile, &a, &b)
                            .block_on()
                            .unwrap()
                    };
                    let (one, parts) = (run(&whole), run(&split));
                    assert!(
                        common::same_bits(&one, &parts),
                        "{alg} tile {tile} {shape:?} (checks {checks}): {} spans differ from one",
                        spans.len()
                    );
                }
            }
        }
    }
}
