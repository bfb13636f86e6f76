//! The cooperative-matrix matmul (`shaders/coop_pack.wgsl`, `shaders/matmul_coop.wgsl`) against
//! the host reference, on an adapter that offers cooperative matrices: on any machine through
//! `bash scripts/lavapipe-coop.sh cargo test --test coop` (Mesa 26's lavapipe, 8x8x8 tiles),
//! and on NVIDIA GPUs (16x16x16). Skipped, with the reason printed, where the adapter has none.
//! The conformance suite (tests/conformance.rs) runs on the same path there too.

mod common;

use mantissa::backend::Backend;
use mantissa::backend::reference as host;
use mantissa::backend::wgpu::shaders::{GROUP_K, Tile};
use mantissa::backend::wgpu::{WgpuBackend, WgpuOptions};
use mantissa::{Algorithm, MatmulShape, measure};
use pollster::FutureExt as _;

const COOP_ALGORITHMS: [Algorithm; 5] = [
    Algorithm::F16,
    Algorithm::Bf16,
    Algorithm::Bf16x3,
    Algorithm::Bf16x6,
    Algorithm::Bf16x9,
];

/// The wgpu backend when it runs matmuls on cooperative matrices (with or without the SIMT
/// fallback for flagged lines), else None (printed).
fn coop_backend(test: &str, fallback: bool) -> Option<WgpuBackend> {
    let options = WgpuOptions {
        poison_outputs: true,
        coop_fallback: fallback,
        ..WgpuOptions::default()
    };
    let b = common::fresh_wgpu(test, options)?;
    if !b.uses_coop() {
        eprintln!(
            "SKIPPED {test}: {} offers no cooperative matrices mantissa can use (coop matrix: {:?}); \
             run it through scripts/lavapipe-coop.sh",
            b.summary().name,
            b.summary().cooperative_matrix
        );
        return None;
    }
    Some(b)
}

fn check_on_tile(b: &WgpuBackend, alg: &Algorithm, tile: Tile, shape: &MatmulShape, seed: u64) {
    let a = measure::normal(shape.a_len(), seed);
    let bm = measure::normal(shape.b_len(), seed + 1);
    let got = b
        .matmul_on_tile(shape, alg, tile, &a, &bm)
        .block_on()
        .expect("matmul");
    common::assert_contract(
        &b.name(),
        alg,
        shape,
        &a,
        &bm,
        &got,
        &format!("block {tile}"),
    );
}

/// Sizes off every tile multiple, K beyond one promotion interval (256), batched and transposed.
fn shapes() -> [MatmulShape; 2] {
    [
        MatmulShape::new(37, 29, 300),
        MatmulShape {
            batch: 2,
            m: 19,
            n: 41,
            k: 23,
            a_transposed: true,
            b_transposed: true,
        },
    ]
}

/// Rows of C on 16 bytes (n a multiple of 4) and blocks both inside C and on its edges: the
/// inner blocks' tiles go straight from the accumulators into C, the edge blocks' through the
/// subgroup's tile of workgroup memory (`stores_straight` in matmul_coop.wgsl).
fn aligned_shape() -> MatmulShape {
    MatmulShape::new(70, 136, 40)
}

#[test]
fn coop_kernels_match_the_reference() {
    let Some(b) = coop_backend("coop_kernels_match_the_reference", true) else {
        return;
    };
    let seed = common::seed("coop_kernels_match_the_reference");
    for alg in COOP_ALGORITHMS {
        let v = b.variant(&alg);
        assert!(v.coop.is_some(), "{alg} should run on cooperative matrices");
        for (s, shape) in shapes().iter().chain([&aligned_shape()]).enumerate() {
            check_on_tile(&b, &alg, v.tile, shape, seed + 2 * s as u64);
        }
    }
}

#[test]
fn every_coop_block_matches_the_reference() {
    let Some(b) = coop_backend("every_coop_block_matches_the_reference", true) else {
        return;
    };
    let seed = common::seed("every_coop_block_matches_the_reference");
    // The fewest and the most accumulators per block, f16 and bf16x9 (the same blocks with nine
    // planes' products): the default block and blocks drawn by the seed, of the kind with a K
    // step of one tile in one stage without prefetch (2 of f16's, 1 of bf16x9's) and of the
    // others (two tiles a K step, two stages, prefetch: seven combinations a block; 1 of
    // f16's). Each block is a kernel to compile, 10-25 s on lavapipe (every one with
    // MANTISSA_TEST_EXHAUSTIVE=1; the published designs' blocks run in the test below). K
    // steps, stages and prefetch change only the copy schedule and the sub-steps, the same code
    // for every block and algorithm.
    for (alg, plain_n, varied_n) in [(Algorithm::F16, 2, 1), (Algorithm::Bf16x9, 1, 0)] {
        let tiles = b.tile_candidates(&alg);
        let size = tiles[0].bk;
        // Blocks of one subgroup and blocks staged through workgroup memory for several, with
        // a K step of one tile and two, in one stage and in two.
        assert!(tiles.iter().any(|t| t.warps == 1) && tiles.iter().any(|t| t.warps > 1));
        assert!(tiles.iter().any(|t| t.warps > 1 && t.buffers == 2));
        assert!(tiles.iter().any(|t| t.warps > 1 && t.bk == 2 * size));
        assert!(tiles.iter().any(|t| t.prefetch && t.buffers == 1));
        assert!(tiles.iter().any(|t| t.prefetch && t.buffers == 2));
        // The largest block (16 x 8 tiles) where the adapter's workgroup memory holds it
        // (lavapipe's does; NVIDIA's 48 KiB does not hold it for 16 x 16 tiles).
        let largest = tiles.iter().any(|t| t.bm == 16 * size && t.bn == 8 * size);
        let planes = alg.split_parts().max(1) as u32;
        let staged = Tile::coop_designs(size)
            .into_iter()
            .find(|t| t.bm == 16 * size && t.bn == 8 * size)
            .expect("a published design of 16 x 8 tiles");
        let limit = b.summary().max_workgroup_storage_bytes;
        assert_eq!(largest, staged.coop_workgroup_bytes(size, planes) <= limit);
        let (plain, varied): (Vec<Tile>, Vec<Tile>) = tiles
            .iter()
            .copied()
            .partition(|t| t.buffers == 1 && t.bk == size && !t.prefetch);
        let drawn = common::sample(&plain, plain_n, seed)
            .into_iter()
            .chain(common::sample(&varied, varied_n, seed + 1));
        for tile in [tiles[0]]
            .into_iter()
            .chain(drawn.filter(|t| *t != tiles[0]))
        {
            check_on_tile(&b, &alg, tile, &shapes()[0], seed);
            check_on_tile(&b, &alg, tile, &aligned_shape(), seed + 1);
        }
    }
}

/// The blocks of the published designs (`Tile::coop_designs`: what `fast` tuning tries first
/// on a GPU) on f16, bf16 and split bf16: off every tile multiple, batched and transposed, K
/// past one promotion, blocks inside C and on its edges, and lines beyond f16's range (the SIMT
/// fallback's), inf and NaN.
#[test]
fn the_published_designs_match_the_reference() {
    let test = "the_published_designs_match_the_reference";
    let Some(b) = coop_backend(test, true) else {
        return;
    };
    let seed = common::seed(test);
    let edges = MatmulShape::new(24, 20, 40);
    let mut a = measure::normal(edges.a_len(), seed);
    let mut bm = measure::normal(edges.b_len(), seed + 1);
    a[3 * edges.k] = 1e18;
    a[3 * edges.k + 1] = 1e-3;
    a[7 * edges.k + 2] = f32::INFINITY;
    bm[10 * edges.n + 5] = f32::NAN;
    // Two designs drawn on f16, one on bf16 and one on bf16x3 (each block a kernel to compile,
    // 25 s apiece on lavapipe; every one with MANTISSA_TEST_EXHAUSTIVE=1), others each run
    // (the seed names which): the same blocks with scaled planes, a fallback and split levels.
    for (alg, n) in [
        (Algorithm::F16, 2),
        (Algorithm::Bf16, 1),
        (Algorithm::Bf16x3, 1),
    ] {
        let tiles = b.tile_candidates(&alg);
        let size = tiles[0].bk;
        let designs: Vec<Tile> = Tile::coop_designs(size)
            .into_iter()
            .filter(|t| tiles.contains(t))
            .collect();
        assert!(!designs.is_empty(), "{alg}: no design fits");
        assert_eq!(
            &tiles[1..=designs.len()],
            &designs[..],
            "{alg}: designs first"
        );
        for tile in common::sample(&designs, n, seed) {
            for (s, shape) in shapes().iter().chain([&aligned_shape()]).enumerate() {
                check_on_tile(&b, &alg, tile, shape, seed + 2 + 2 * s as u64);
            }
            let got = b
                .matmul_on_tile(&edges, &alg, tile, &a, &bm)
                .block_on()
                .expect("matmul");
            common::assert_contract(
                &b.name(),
                &alg,
                &edges,
                &a,
                &bm,
                &got,
                &format!("block {tile}, lines beyond f16's range"),
            );
        }
    }
}

#[test]
fn the_coop_kernel_computes_every_output_of_in_range_lines() {
    // Without the SIMT fallback, outputs of flagged lines stay unwritten (NaN-poisoned): this
    // shows which outputs the cooperative kernel computed itself.
    let test = "the_coop_kernel_computes_every_output_of_in_range_lines";
    let Some(b) = coop_backend(test, false) else {
        return;
    };
    let seed = common::seed(test);
    // N(0,1) data: every line within range, so every output is the cooperative kernel's.
    let shape = MatmulShape::new(64, 48, 512);
    let a = measure::normal(shape.a_len(), seed);
    let bm = measure::normal(shape.b_len(), seed + 1);
    for alg in COOP_ALGORITHMS {
        common::check_matmul(&b, &alg, &shape, &a, &bm, "N(0,1), no fallback");
    }
    // Row 3 spans 2^60 (its small values' low bits do not fit f16), row 7 holds inf, column 5
    // NaN: those outputs are left to the fallback; every other one is computed here.
    let shape = MatmulShape::new(24, 20, 40);
    let mut a = measure::normal(shape.a_len(), seed + 2);
    let mut bm = measure::normal(shape.b_len(), seed + 3);
    a[3 * shape.k] = 1e18;
    a[7 * shape.k + 2] = f32::INFINITY;
    bm[10 * shape.n + 5] = f32::NAN;
    for alg in COOP_ALGORITHMS.into_iter().filter(|a| *a != Algorithm::F16) {
        let got = b.matmul(&shape, &alg, &a, &bm).block_on().expect("matmul");
        let want = host::matmul(&shape, &alg, &a, &bm).unwrap();
        for i in 0..shape.m {
            for j in 0..shape.n {
                let (g, w) = (got[i * shape.n + j], want[i * shape.n + j]);
                if i == 3 || i == 7 || j == 5 {
                    assert!(
                        g.is_nan(),
                        "{alg} C[{i},{j}] = {g}: a flagged line, left to the fallback"
                    );
                } else {
                    let tol = 1e-5 * (1.0 + w.abs());
                    assert!(
                        (g - w).abs() <= tol,
                        "{alg} C[{i},{j}] = {g}, reference {w}"
                    );
                }
            }
        }
    }
}

#[test]
fn lines_beyond_f16_range_fall_back_to_simt() {
    let Some(b) = coop_backend("lines_beyond_f16_range_fall_back_to_simt", true) else {
        return;
    };
    let seed = common::seed("lines_beyond_f16_range_fall_back_to_simt");
    let shape = MatmulShape::new(24, 20, 40);
    let mut a = measure::normal(shape.a_len(), seed);
    let mut bm = measure::normal(shape.b_len(), seed + 1);
    // Row 3: a dynamic range of 2^60 (its small values are not exact in f16 after scaling).
    // Row 7: +inf. Column 5: NaN. Row 11: huge but uniform (scaling alone handles it).
    // Column 9: values whose l plane underflows f16 after scaling.
    a[3 * shape.k] = 1e18;
    a[3 * shape.k + 1] = 1e-3;
    a[7 * shape.k + 2] = f32::INFINITY;
    bm[10 * shape.n + 5] = f32::NAN;
    for p in 0..shape.k {
        a[11 * shape.k + p] *= 1e30;
        bm[p * shape.n + 9] = 1.0 + (p as f32) * 1.0e-7;
    }
    for alg in COOP_ALGORITHMS {
        let c = common::check_matmul(&b, &alg, &shape, &a, &bm, "lines beyond f16's range");
        if alg != Algorithm::F16 {
            assert!(
                c[7 * shape.n].is_infinite() || c[7 * shape.n].is_nan(),
                "{alg}: inf row"
            );
            assert!(c[5].is_nan(), "{alg}: NaN column");
        }
    }
}

#[test]
fn coop_and_simt_agree_within_the_contract() {
    let Some(coop) = coop_backend("coop_and_simt_agree_within_the_contract", true) else {
        return;
    };
    let simt = common::fresh_wgpu(
        "coop_and_simt_agree_within_the_contract",
        WgpuOptions {
            coop: false,
            ..WgpuOptions::default()
        },
    )
    .expect("the same adapter without cooperative matrices");
    assert!(!simt.uses_coop());
    let seed = common::seed("coop_and_simt_agree_within_the_contract");
    let shape = MatmulShape::new(64, 48, 512);
    let a = measure::normal(shape.a_len(), seed);
    let bm = measure::normal(shape.b_len(), seed + 1);
    let exact = measure::exact_product(&shape, &a, &bm);
    for alg in COOP_ALGORITHMS {
        let c1 = common::check_matmul(&coop, &alg, &shape, &a, &bm, "coop");
        let c2 = common::check_matmul(&simt, &alg, &shape, &a, &bm, "simt");
        let (e1, e2) = (
            measure::relative_error(&c1, &exact),
            measure::relative_error(&c2, &exact),
        );
        eprintln!("{alg}: relative error coop {e1:.2e}, simt {e2:.2e}");
        assert!(
            e1 <= 2.0 * e2 + 1e-9,
            "{alg}: coop error {e1:e} vs simt {e2:e}"
        );
    }
}

/// What the bench times from prepared operands: the product's dispatches alone, over the
/// operands a whole run prepared, compute C again bit for bit (no dispatch of the product
/// depends on a clear or on a preparation it would repeat). On whatever this adapter runs:
/// SIMT kernels on Mesa 22's lavapipe, cooperative matrices with the SIMT fallback for flagged
/// lines on Mesa 26's (scripts/lavapipe-coop.sh).
#[test]
fn the_product_alone_recomputes_c_from_prepared_operands() {
    let test = "the_product_alone_recomputes_c_from_prepared_operands";
    let options = WgpuOptions {
        poison_outputs: true,
        ..WgpuOptions::default()
    };
    let Some(b) = common::fresh_wgpu(test, options) else {
        return;
    };
    let kernels = if b.uses_coop() {
        "cooperative matrices"
    } else {
        "SIMT"
    };
    eprintln!("{test}: {} on {kernels}", b.name());
    let seed = common::seed(test);
    let shape = shapes()[1];
    let (a, bm, algorithms) = common::prepared_cases(&shape, seed);
    for alg in algorithms {
        let tile = b.variant(&alg).tile;
        let (whole, again) = b
            .matmul_product_again(&shape, &alg, tile, &a, &bm)
            .block_on()
            .unwrap();
        assert!(
            common::same_bits(&whole, &again),
            "{alg} on {}: the product alone differs",
            b.name()
        );
    }
}

/// K split into spans (where a loop budget calls for it: src/backend/wgpu/budget.rs) gives the
/// bits of one span on cooperative matrices: the f32 totals carried between spans, the SIMT
/// fallback of the flagged lines split too (rows of A beyond f16's range, an inf). Each block
/// runs on a backend told to assume a budget that holds a summation group (`GROUP_K`) of the
/// block and of its fallback a span, against one that runs K whole: every cooperative algorithm
/// on the default block, f16 also on a staged block (one or two stages, with or without
/// prefetch: drawn).
#[test]
fn a_split_k_gives_the_bits_of_one_dispatch_on_cooperative_matrices() {
    let test = "a_split_k_gives_the_bits_of_one_dispatch_on_cooperative_matrices";
    let Some(whole) = coop_backend(test, true) else {
        return;
    };
    let seed = common::seed(test);
    // Every algorithm's default block; f16 also on a staged block in one or two stages, with
    // or without prefetch, one of the four drawn by the seed (each block a kernel to compile on
    // a device of its own, 20 s on lavapipe; all four with MANTISSA_TEST_EXHAUSTIVE=1).
    let staged = common::sample(&[(1, false), (2, false), (1, true), (2, true)], 1, seed);
    for alg in COOP_ALGORITHMS {
        let tiles = whole.tile_candidates(&alg);
        let mut blocks = vec![tiles[0]];
        if alg == Algorithm::F16 {
            for &(buffers, prefetch) in &staged {
                blocks.extend(
                    tiles
                        .iter()
                        .find(|t| t.warps > 1 && t.buffers == buffers && t.prefetch == prefetch),
                );
            }
        }
        for tile in blocks {
            // Half the budget holds the block's fixed loops and one summation group (spans
            // start at group boundaries), and the SIMT fallback's; K is one group longer than
            // a span of the block holds.
            let variant = whole.variant(&alg).with_tile(tile);
            let loops = variant.k_loops();
            let simt = variant.fallback().k_loops();
            let usable = (loops.fixed + loops.per_unit).max(simt.fixed + simt.per_unit);
            let groups = (usable - loops.fixed) / loops.per_unit;
            let shape = MatmulShape::new(37, 29, (groups as usize + 1) * GROUP_K as usize + 5);
            // N(0,1), but for two rows of A beyond f16's range (flagged: the SIMT fallback's)
            // and an inf in a third.
            let mut a = measure::normal(shape.a_len(), seed);
            let wide = measure::wide_range(shape.k, seed + 1);
            for row in [3, 11] {
                a[row * shape.k..(row + 1) * shape.k].copy_from_slice(&wide);
            }
            a[20 * shape.k + 5] = f32::INFINITY;
            let bm = measure::normal(shape.b_len(), seed + 2);
            let options = WgpuOptions {
                poison_outputs: true,
                assume_loop_budget: Some(2 * usable as u32),
                ..WgpuOptions::default()
            };
            let Some(split) = common::fresh_wgpu(test, options) else {
                return;
            };
            let spans = split.k_spans(&shape, &alg, tile).unwrap();
            assert!(spans.len() > 1, "{alg} block {tile}: {spans:?}");
            let run = |on: &WgpuBackend| {
                on.matmul_on_tile(&shape, &alg, tile, &a, &bm)
                    .block_on()
                    .unwrap()
            };
            assert!(
                common::same_bits(&run(&whole), &run(&split)),
                "{alg} block {tile}: {} spans differ from one",
                spans.len()
            );
        }
    }
}

/// Split-K on cooperative matrices computes the unsplit product's bits (matmul_coop.wgsl,
/// "Summation order"): each split's groups' f32 totals into their planes, the planes added in
/// group order as the running totals add them. Every cooperative algorithm on the default
/// block split 2 and 3 ways, f16 also on staged blocks in one and two stages, with and without
/// prefetch; batched; a row of A beyond f16's range (the SIMT fallback's, unsplit), an inf, a
/// NaN. And the unsplit product keeps its contract against the host reference.
#[test]
fn split_k_gives_the_unsplit_bits_on_cooperative_matrices() {
    let test = "split_k_gives_the_unsplit_bits_on_cooperative_matrices";
    let Some(b) = coop_backend(test, true) else {
        return;
    };
    let seed = common::seed(test);
    let shape = MatmulShape {
        batch: 2,
        m: 37,
        n: 29,
        k: 3 * GROUP_K as usize + 45,
        a_transposed: false,
        b_transposed: false,
    };
    let mut a = measure::normal(shape.a_len(), seed);
    let k = shape.k;
    let wide = measure::wide_range(k, seed + 1);
    a[3 * k..4 * k].copy_from_slice(&wide);
    a[20 * k + 5] = f32::INFINITY;
    a[41 * k + 7] = f32::NAN;
    let bm = measure::normal(shape.b_len(), seed + 2);
    for alg in COOP_ALGORITHMS {
        let tiles = b.tile_candidates(&alg);
        let mut blocks = vec![tiles[0]];
        if alg == Algorithm::F16 {
            for (buffers, prefetch) in [(1, false), (2, false), (1, true), (2, true)] {
                blocks.extend(
                    tiles
                        .iter()
                        .find(|t| t.warps > 1 && t.buffers == buffers && t.prefetch == prefetch),
                );
            }
        }
        for tile in blocks {
            let run = |t: Tile| {
                b.matmul_on_tile(&shape, &alg, t, &a, &bm)
                    .block_on()
                    .unwrap()
            };
            let whole = run(tile);
            if tile == tiles[0] {
                common::assert_contract("coop", &alg, &shape, &a, &bm, &whole, "grouped sums");
            }
            for splits in [2, 3] {
                assert!(
                    common::same_bits(&run(tile.with_splits(splits)), &whole),
                    "{alg} block {tile} split {splits}: not the unsplit bits"
                );
            }
        }
    }
}

/// A product held in bf16 or f16 (`Op::Matmul`'s `held`) is rounded as the cooperative kernel
/// stores it, and as its SIMT fallback stores the flagged lines (a row of 1e18 and 1e-3, an
/// inf, a NaN): the same bits as the unrounded product rounded after; on edge blocks, blocks
/// inside an aligned C (which otherwise store straight from the accumulators) and split-K.
#[test]
fn a_product_rounded_as_stored_is_the_product_rounded_on_cooperative_matrices() {
    let test = "a_product_rounded_as_stored_is_the_product_rounded_on_cooperative_matrices";
    let Some(b) = coop_backend(test, true) else {
        return;
    };
    let seed = common::seed(test);
    // f16 and one of the bf16 algorithms drawn by the seed (their kernels compile for seconds on
    // lavapipe; all five with MANTISSA_TEST_EXHAUSTIVE=1).
    let mut algorithms = vec![COOP_ALGORITHMS[0]];
    algorithms.extend(common::sample(&COOP_ALGORITHMS[1..], 1, seed));
    let long = MatmulShape::new(37, 29, 2 * GROUP_K as usize + 45);
    for (s, shape) in shapes().iter().chain([&aligned_shape(), &long]).enumerate() {
        let mut a = measure::normal(shape.a_len(), seed + 2 * s as u64);
        let mut bm = measure::normal(shape.b_len(), seed + 2 * s as u64 + 1);
        let k = shape.k;
        if !shape.a_transposed {
            a[3 * k] = 1e18;
            a[3 * k + 1] = 1e-3;
            for p in 0..k {
                a[5 * k + p] *= 9.0e3;
            }
            a[7 * k + 2] = f32::INFINITY;
        }
        bm[shape.b_len() / 2] = f32::NAN;
        for &alg in &algorithms {
            let tile = b.tile_candidates(&alg)[0];
            let mut tiles = vec![tile];
            if shape.k > GROUP_K as usize {
                tiles.push(tile.with_splits(2));
            }
            for tile in tiles {
                common::assert_rounded_store(&b, (&alg, tile), shape, (&a, &bm), "coop");
            }
        }
    }
}

/// A linear layer's bias add and GELU in the cooperative kernel's store, into 16-bit codes as
/// into f32 (`common::assert_bias_add_into_codes`): the SIMT fallback's flagged lines (a row of
/// 1e18, an inf) written into the words the cooperative kernel wrote the other half of; a NaN;
/// edge blocks and split-K; one of the scaled bf16 algorithms drawn (they have the fallback;
/// f16's store is the same code without it; all four with MANTISSA_TEST_EXHAUSTIVE=1).
#[test]
fn a_bias_add_into_codes_stores_the_held_sums_on_cooperative_matrices() {
    let test = "a_bias_add_into_codes_stores_the_held_sums_on_cooperative_matrices";
    let Some(b) = coop_backend(test, true) else {
        return;
    };
    let seed = common::seed(test);
    let algorithms = common::sample(&COOP_ALGORITHMS[1..], 1, seed);
    let shape = MatmulShape::new(37, 30, GROUP_K as usize + 45);
    let k = shape.k;
    let mut a = measure::normal(shape.a_len(), seed);
    let mut bm = measure::normal(shape.b_len(), seed + 1);
    let bias = measure::normal(shape.n, seed + 2);
    a[3 * k] = 1e18;
    a[7 * k + 2] = f32::INFINITY;
    // B's column 5 flagged (beyond f16's range): its codes share words with column 4's, which
    // the cooperative kernel writes.
    bm[9 * shape.n + 5] = 1e18;
    bm[shape.b_len() / 2] = f32::NAN;
    for alg in algorithms {
        let tile = b.tile_candidates(&alg)[0];
        for tile in [tile, tile.with_splits(2)] {
            common::assert_bias_add_into_codes(&b, (&alg, tile), &shape, (&a, &bm, &bias), "coop");
        }
    }
}

/// A SIMT tile on a cooperative-matrix device (`Tile::simt`: what the tuner times beside the
/// cooperative blocks, and keeps where it is faster) runs matmul.wgsl: within the contract on
/// every input family's edges, and bit for bit what a backend without cooperative matrices
/// computes on the same tile; the tuner's candidates hold the SIMT default.
#[test]
fn simt_tiles_run_beside_cooperative_blocks() {
    let Some(b) = coop_backend("simt_tiles_run_beside_cooperative_blocks", true) else {
        return;
    };
    let plain = WgpuBackend::open_nth(
        0,
        WgpuOptions {
            coop: false,
            poison_outputs: true,
            ..WgpuOptions::default()
        },
    )
    .block_on()
    .expect("the same adapter without cooperative matrices");
    let seed = common::seed("simt_tiles_run_beside_cooperative_blocks");
    for alg in COOP_ALGORITHMS {
        let simt = b.simt_candidates(&alg);
        assert!(!simt.is_empty() && simt.iter().all(|t| t.simt), "{alg}");
        assert_eq!(
            simt[0],
            plain.tile_candidates(&alg)[0].on_simt(true),
            "{alg}"
        );
        assert!(b.variant_on(&alg, simt[0]).coop.is_none(), "{alg}");
        assert!(
            b.variant_on(&alg, simt[0].on_simt(false)).coop.is_some(),
            "{alg}"
        );
        for (s, shape) in shapes().iter().chain([&aligned_shape()]).enumerate() {
            let at = seed + 2 * s as u64;
            check_on_tile(&b, &alg, simt[0], shape, at);
            let a = measure::normal(shape.a_len(), at);
            let bm = measure::normal(shape.b_len(), at + 1);
            let got = b
                .matmul_on_tile(shape, &alg, simt[0], &a, &bm)
                .block_on()
                .unwrap();
            let want = plain
                .matmul_on_tile(shape, &alg, simt[0].on_simt(false), &a, &bm)
                .block_on()
                .unwrap();
            let differ = got
                .iter()
                .zip(&want)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            assert_eq!(differ, 0, "{alg} {shape:?}: SIMT tile on a coop device");
        }
    }
}
