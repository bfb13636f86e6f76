//! The SIMT matmul's variants compute the same bits (every candidate tile of the autotuner,
//! one or two workgroup buffers, operands loaded in quads or element by element), and a tuned
//! choice is persisted and reused.

mod common;

use mantissa::backend::reference as host;
use mantissa::backend::wgpu::autotune::{AutotuneMode, Autotuner};
use mantissa::backend::wgpu::shaders::{GROUP_K, Tile};
use mantissa::backend::wgpu::{WgpuBackend, WgpuOptions};
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
    // f32 (both register blocks), bf16x9 (three planes, five levels), and three whose kernels
    // differ from those in how operands are decoded. Of each one's tiles, the default, one
    // single-buffered and one double-buffered drawn by the seed (`common::sample`: each tile
    // is a kernel to compile, seconds apiece on lavapipe; MANTISSA_TEST_EXHAUSTIVE=1 runs
    // every tile).
    for alg in [
        Algorithm::F32,
        Algorithm::F16,
        Algorithm::Bf16x3,
        Algorithm::Bf16x9,
        Algorithm::fp8(Format::E4m3, Format::E5m2).with_scaling(Scaling::Rowwise),
    ] {
        // Two workgroup buffers change only the K loop, the same code for every tile shape
        // (K = 77 takes an odd or even number of steps depending on the tile, so both ends of
        // that loop run across samples).
        // Tiles loading quads in blocks of four lines change only the loads
        // (`quad_loads_give_the_element_loads_bits`), and A transposed by B row-major loads
        // along lines: left out here.
        let all: Vec<Tile> = (b.tile_candidates(&alg).into_iter())
            .filter(|t| !t.quad_blocks)
            .collect();
        let (single, double): (Vec<Tile>, Vec<Tile>) =
            all.iter().copied().partition(|t| t.buffers == 1);
        assert!(single.len() > 3 && !double.is_empty(), "{alg}: {all:?}");
        let tiles: Vec<Tile> = (single[..1].iter().copied())
            .chain(common::sample(&single[1..], 1, seed))
            .chain(common::sample(&double, 1, seed))
            .collect();
        let want = b
            .matmul_on_tile(&shape, &alg, tiles[0], &a, &bm)
            .block_on()
            .unwrap();
        for &t in &tiles[1..] {
            let got = b
                .matmul_on_tile(&shape, &alg, t, &a, &bm)
                .block_on()
                .unwrap();
            assert!(
                common::same_bits(&got, &want),
                "{alg}: tile {t} differs from tile {}",
                tiles[0]
            );
        }
    }
}

/// The wgpu backend without runtime checks and with them (None, said, where there is none).
fn plain_and_checked(test: &str) -> Option<(WgpuBackend, WgpuBackend)> {
    let plain = common::fresh_wgpu(test, WgpuOptions::default())?;
    let checks = WgpuOptions {
        runtime_checks: true,
        ..WgpuOptions::default()
    };
    Some((plain, common::fresh_wgpu(test, checks)?))
}

/// Checked modules (the browser's, `MANTISSA_WGSL_CHECKS=on`) run the K step written out per k,
/// a step function per workgroup buffer: one and two buffers give the unchecked kernel's bits.
#[test]
fn checked_kernels_give_the_same_bits_with_one_and_two_buffers() {
    let test = "checked_kernels_give_the_same_bits_with_one_and_two_buffers";
    let Some((plain, checked)) = plain_and_checked(test) else {
        return;
    };
    let seed = common::seed(test);
    // K = 40: an odd number of steps of 8, an even number of 16 (and a partial last one).
    let shape = MatmulShape {
        batch: 1,
        m: 37,
        n: 70,
        k: 40,
        a_transposed: false,
        b_transposed: true,
    };
    let a = measure::wide_range(shape.a_len(), seed);
    let bm = measure::normal(shape.b_len(), seed + 1);
    for alg in [Algorithm::F32, Algorithm::Bf16x3] {
        let default = plain.tile_candidates(&alg)[0];
        let want = plain
            .matmul_on_tile(&shape, &alg, default, &a, &bm)
            .block_on()
            .unwrap();
        for tile in [default, default.with_buffers(2)] {
            let got = checked
                .matmul_on_tile(&shape, &alg, tile, &a, &bm)
                .block_on()
                .unwrap();
            assert!(
                common::same_bits(&got, &want),
                "{alg}: checked tile {tile} differs from unchecked {default}"
            );
        }
    }
}

/// f32 and tf32 operands are loaded in quads (16 bytes) along the dimension they are contiguous
/// in when its length is a multiple of 4, else element by element. The same product inside a
/// larger one (K one longer with zeros, M and N one longer with other values) takes the
/// element-by-element loads, and adding a product 0 x 0 leaves every sum's bits as they are:
/// both give the same C, for every layout of A and B, checked and unchecked; so do quads along
/// K loaded four lines at a time (`Tile::quad_blocks`).
#[test]
fn quad_loads_give_the_element_loads_bits() {
    let test = "quad_loads_give_the_element_loads_bits";
    let Some((plain, checked)) = plain_and_checked(test) else {
        return;
    };
    let seed = common::seed(test);
    let (batch, m, n, k) = (2, 72, 68, 76);
    // A logical rows x cols matrix per batch, stored row-major or transposed.
    let lay =
        |rows: usize, cols: usize, transposed: bool, f: &dyn Fn(usize, usize, usize) -> f32| {
            let mut out = vec![0.0; batch * rows * cols];
            for bi in 0..batch {
                for r in 0..rows {
                    for c in 0..cols {
                        let at = if transposed {
                            c * rows + r
                        } else {
                            r * cols + c
                        };
                        out[bi * rows * cols + at] = f(bi, r, c);
                    }
                }
            }
            out
        };
    let a_values = measure::wide_range(batch * (m + 1) * k, seed);
    let b_values = measure::normal(batch * k * (n + 1), seed + 1);
    let a_at = |bi: usize, i: usize, p: usize| a_values[(bi * (m + 1) + i) * k + p];
    let b_at = |bi: usize, p: usize, j: usize| b_values[(bi * k + p) * (n + 1) + j];
    // On each backend, f32 or tf32 (their kernels differ in how operands round) and two of the
    // four layouts, drawn by the seed (`common::sample`; every one with
    // MANTISSA_TEST_EXHAUSTIVE=1).
    let layouts = [(false, false), (false, true), (true, false), (true, true)];
    for (i, (backend, which)) in [(&plain, "unchecked"), (&checked, "checked")]
        .into_iter()
        .enumerate()
    {
        let seed = seed + i as u64;
        for alg in common::sample(&[Algorithm::F32, Algorithm::Tf32], 1, seed) {
            for (a_t, b_t) in common::sample(&layouts, 2, seed) {
                let shape = |m, n, k| MatmulShape {
                    batch,
                    m,
                    n,
                    k,
                    a_transposed: a_t,
                    b_transposed: b_t,
                };
                let small = shape(m, n, k);
                let a = lay(m, k, a_t, &|bi, i, p| a_at(bi, i, p));
                let bm = lay(k, n, b_t, &|bi, p, j| b_at(bi, p, j));
                let quads = backend.matmul(&small, &alg, &a, &bm).block_on().unwrap();
                let large = shape(m + 1, n + 1, k + 1);
                let a = lay(m + 1, k + 1, a_t, &|bi, i, p| {
                    if p < k { a_at(bi, i, p) } else { 0.0 }
                });
                let bm = lay(k + 1, n + 1, b_t, &|bi, p, j| {
                    if p < k { b_at(bi, p, j) } else { 0.0 }
                });
                let elements = backend.matmul(&large, &alg, &a, &bm).block_on().unwrap();
                // Quads along K in blocks of four lines (the same small product), on the
                // default tile, and where A loads that way on a wide one with two buffers.
                let (a, bm) = (
                    lay(m, k, a_t, &|bi, i, p| a_at(bi, i, p)),
                    lay(k, n, b_t, &|bi, p, j| b_at(bi, p, j)),
                );
                let default = backend.tile_candidates(&alg)[0];
                let wide = Tile {
                    bm: 128,
                    bn: 64,
                    bk: 16,
                    reg: 8,
                    ..default
                };
                let tiles = if a_t {
                    vec![default]
                } else {
                    vec![default, wide.with_buffers(2)]
                };
                let blocks: Vec<Vec<f32>> = (tiles.into_iter())
                    .map(|t| {
                        backend
                            .matmul_on_tile(&small, &alg, t.with_quad_blocks(true), &a, &bm)
                            .block_on()
                            .unwrap()
                    })
                    .collect();
                assert!(
                    blocks.iter().all(|c| common::same_bits(c, &quads)),
                    "{which} {alg}, A{} B{}: quads in blocks of four lines differ",
                    if a_t { "^T" } else { "" },
                    if b_t { "^T" } else { "" },
                );
                for bi in 0..batch {
                    for i in 0..m {
                        for j in 0..n {
                            let q = quads[(bi * m + i) * n + j];
                            let e = elements[(bi * (m + 1) + i) * (n + 1) + j];
                            assert_eq!(
                                q.to_bits(),
                                e.to_bits(),
                                "{which} {alg}, A{} B{}: C[{bi}][{i}][{j}] {q} in quads, {e} element by element",
                                if a_t { "^T" } else { "" },
                                if b_t { "^T" } else { "" },
                            );
                        }
                    }
                }
            }
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
    // A search of a second: this test is about what is stored, not which tile wins.
    let fast = |path: &std::path::Path| {
        Autotuner::new(AutotuneMode::Fast, Some(path.to_path_buf())).with_budget(1.0)
    };
    let b = b.with_tuner(fast(&path));
    // Just over the least work that is tuned (autotune::TUNE_MIN_FLOPS).
    let shape = MatmulShape::new(160, 144, 96);
    let a = measure::normal(shape.a_len(), 1);
    let bm = measure::normal(shape.b_len(), 2);
    let timing = b
        .time_matmul(&shape, &Algorithm::F32, &a, &bm, 1, Operands::F32)
        .block_on()
        .unwrap();
    // The variant names the tile and the time the tuner timed it at.
    let tuned = timing.tuned_seconds.expect("the tuned time");
    assert!(
        timing
            .variant
            .ends_with(&format!("(autotuned at {:.3} ms)", tuned * 1e3)),
        "{}",
        timing.variant
    );
    let saved = std::fs::read_to_string(&path).expect("cache written");
    let entries: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&saved).unwrap();
    assert_eq!(entries.len(), 1, "{saved}");
    // (JSON's decimal text gives back the seconds to within an ulp.)
    let near = |x: Option<f64>| x.is_some_and(|x| (x - tuned).abs() <= 1e-12 * tuned);
    let stored = entries.values().next().unwrap();
    assert!(
        near(stored["seconds"].as_f64()),
        "{tuned} s, stored: {saved}"
    );
    // A second tuner reads the choice instead of tuning again: the file stays as it was.
    let b = b.with_tuner(fast(&path));
    let again = b
        .matmul(&shape, &Algorithm::F32, &a, &bm)
        .block_on()
        .unwrap();
    assert_eq!(again.len(), shape.c_len());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), saved);
    // The stored choice's time is shown again, from the store.
    let reread = b
        .time_matmul(&shape, &Algorithm::F32, &a, &bm, 1, Operands::F32)
        .block_on()
        .unwrap();
    assert!(near(reread.tuned_seconds), "{:?}", reread.tuned_seconds);
    assert_eq!(reread.variant, timing.variant);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), saved);
    // A corrupt cache is ignored (and rewritten), never trusted.
    std::fs::write(&path, "{ not json").unwrap();
    let b = b.with_tuner(fast(&path));
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
    let b = b.with_tuner(fast(&path));
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
    // A well-formed tile that is no longer a candidate (here 256 rows, beyond every
    // candidate: a choice an older version offered) is re-tuned too, and replaced by one.
    let mut entries: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&saved).unwrap();
    for choice in entries.values_mut() {
        choice["choice"]["bm"] = 256.into();
    }
    let stale = serde_json::to_string(&entries).unwrap();
    std::fs::write(&path, &stale).unwrap();
    let b = b.with_tuner(fast(&path));
    let timing = b
        .time_matmul(&shape, &Algorithm::F32, &a, &bm, 1, Operands::F32)
        .block_on()
        .unwrap();
    assert!(!timing.variant.contains("256x"), "{}", timing.variant);
    let retuned = std::fs::read_to_string(&path).unwrap();
    let entries: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&retuned).unwrap();
    let candidates = b.tile_candidates(&Algorithm::F32);
    for choice in entries.values() {
        let tile: Tile = serde_json::from_value(choice["choice"].clone()).unwrap();
        assert!(candidates.contains(&tile), "{tile} stored: {retuned}");
    }
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

/// A search whose budget is spent keeps what it timed: with no seconds to spend, `full` times
/// the first candidate, the default tile, and stores it (it had run every tile of a large
/// product for minutes). Which tile is fastest is never asserted.
#[test]
fn a_spent_budget_keeps_the_first_tile_timed() {
    let test = "a_spent_budget_keeps_the_first_tile_timed";
    let Some(b) = common::fresh_wgpu(test, WgpuOptions::default()) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("autotune.json");
    let b = b.with_tuner(Autotuner::new(AutotuneMode::Full, Some(path.clone())).with_budget(0.0));
    let shape = MatmulShape::new(160, 144, 96);
    let (a, bm) = (
        measure::normal(shape.a_len(), 1),
        measure::normal(shape.b_len(), 2),
    );
    let c = b
        .matmul(&shape, &Algorithm::F32, &a, &bm)
        .block_on()
        .unwrap();
    assert_eq!(c.len(), shape.c_len());
    let saved: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("cache written")).unwrap();
    let chosen: Vec<Tile> = saved
        .values()
        .map(|v| serde_json::from_value(v["choice"].clone()).unwrap())
        .collect();
    assert_eq!(chosen, [b.tile_candidates(&Algorithm::F32)[0]]);
}

/// Backends without cooperative matrices that poison their outputs: plain, with runtime checks
/// (the K step written out), and one whose loop budget holds one group of the default f32 tile
/// and its fixed loops (K in a dispatch a group); None (printed) where wgpu is absent.
fn sums_backends(test: &str) -> Option<[WgpuBackend; 3]> {
    sums_backends_for(test, false)
}

/// `sums_backends`, the tight one's budget a group of the kernel that sums B's columns too
/// where `column_sums` says.
fn sums_backends_for(test: &str, column_sums: bool) -> Option<[WgpuBackend; 3]> {
    let options = WgpuOptions {
        poison_outputs: true,
        coop: false,
        ..WgpuOptions::default()
    };
    let plain = common::fresh_wgpu(test, options)?;
    let checked = common::fresh_wgpu(
        test,
        WgpuOptions {
            runtime_checks: true,
            ..options
        },
    )?;
    let loops = (plain.variant(&Algorithm::F32))
        .with_column_sums(column_sums)
        .k_loops();
    let tight = common::fresh_wgpu(
        test,
        WgpuOptions {
            assume_loop_budget: Some(2 * (loops.fixed + loops.per_unit + 100) as u32),
            ..options
        },
    )?;
    Some([plain, checked, tight])
}

/// Split-K (`Tile::splits`) computes the unsplit product's bits (matmul.wgsl, "Summation
/// order"): K summed in groups of `GROUP_K`, each split's groups into their planes, the planes
/// added in group order as the running totals add them. Every algorithm (fp8 also rowwise and
/// with given scales; three a run besides f32 and bf16x3, drawn by the seed) on its default tile split 2, 3 and 5 ways (K has five groups; more splits
/// than groups take one each), f32 and bf16x3 also double-buffered and on 8x8 register blocks,
/// batched and transposed; rows of A in a wide range, an inf, a NaN, a row beyond f16's range.
/// With runtime checks (the K step written out) for a sample; on a backend whose loop budget
/// holds one group per dispatch (each split then sums one group), too. And the unsplit product
/// keeps its contract against the host reference: the grouped sum is the function. A NaN
/// is any NaN: where an output's sum meets two (an input's, and inf - inf's), the one an add
/// keeps follows the order the planes are added in, and WGSL leaves NaN payloads and signs
/// open (a seed of a clean CI run drew an f16 output 0xffc00000 split, 0x7fffffff whole).
#[test]
fn split_k_gives_the_unsplit_bits() {
    let test = "split_k_gives_the_unsplit_bits";
    let seed = common::seed(test);
    let shapes = [
        MatmulShape::new(37, 29, 4 * GROUP_K as usize + 77),
        MatmulShape {
            batch: 2,
            m: 19,
            n: 41,
            k: 4 * GROUP_K as usize + 1,
            a_transposed: true,
            b_transposed: true,
        },
    ];
    let Some([plain, checked, tight]) = sums_backends(test) else {
        return;
    };
    for (s, shape) in shapes.iter().enumerate() {
        let seed = seed + 10 * s as u64;
        let (_, _, algorithms) = common::prepared_cases(shape, seed);
        let mut a = measure::normal(shape.a_len(), seed);
        let line = shape.a_len() / (shape.batch * shape.m);
        let wide = measure::wide_range(line, seed + 1);
        a[3 * line..4 * line].copy_from_slice(&wide);
        for x in &mut a[5 * line..6 * line] {
            *x *= 1e6;
        }
        a[7 * line + 5] = f32::INFINITY;
        a[9 * line + 2] = f32::NAN;
        let b = measure::normal(shape.b_len(), seed + 2);
        // f32 and bf16x3 on several tiles, and three other algorithms drawn by the seed
        // (`common::sample`; every one with MANTISSA_TEST_EXHAUSTIVE=1).
        let many_tiles = |a: &Algorithm| matches!(a, Algorithm::F32 | Algorithm::Bf16x3);
        let others: Vec<Algorithm> = algorithms.into_iter().filter(|a| !many_tiles(a)).collect();
        let algorithms = [Algorithm::F32, Algorithm::Bf16x3]
            .into_iter()
            .chain(common::sample(&others, 3, seed));
        for alg in algorithms {
            let name = alg.to_string();
            let candidates = plain.tile_candidates(&alg);
            let mut tiles = vec![candidates[0]];
            if matches!(alg, Algorithm::F32 | Algorithm::Bf16x3) {
                tiles.extend(candidates.iter().find(|t| t.buffers == 2));
                tiles.extend(candidates.iter().find(|t| t.reg == 8));
            }
            for tile in tiles {
                let mut backends = vec![("plain", &plain)];
                if ["f32", "bf16x6", "e4m3-e5m2:rowwise"].contains(&name.as_str()) {
                    backends.push(("checked", &checked));
                }
                if alg == Algorithm::F32 && tile == candidates[0] {
                    backends.push(("one group a dispatch", &tight));
                }
                for (how, backend) in &backends {
                    let run = |t: Tile| {
                        backend
                            .matmul_on_tile(shape, &alg, t, &a, &b)
                            .block_on()
                            .unwrap()
                    };
                    let whole = run(tile);
                    if s == 0 && *how == "plain" && tile == candidates[0] {
                        common::assert_contract(how, &alg, shape, &a, &b, &whole, "grouped sums");
                    }
                    for splits in [2, 3, 5, 8] {
                        common::same_or_nan(
                            &format!("{alg} tile {tile} split {splits} ({how}) {shape:?}"),
                            &run(tile.with_splits(splits)),
                            &whole,
                        );
                    }
                }
            }
        }
    }
}

/// A product held in bf16 or f16 (`Op::Matmul`'s `held`: a weight gradient under the 16-bit
/// presets) is rounded in the kernel's store (epilogue.wgsl), the same bits as the product
/// rounded after: on the default tile, double-buffered and on 8x8 register blocks, split-K (the planes' sum rounds),
/// K in several dispatches (the last rounds), with runtime checks; values that round past
/// either format's range, ties, subnormals, inf and NaN.
#[test]
fn a_product_rounded_as_stored_is_the_product_rounded() {
    let test = "a_product_rounded_as_stored_is_the_product_rounded";
    let Some([plain, checked, tight]) = sums_backends(test) else {
        return;
    };
    let seed = common::seed(test);
    let shape = MatmulShape {
        batch: 2,
        m: 19,
        n: 41,
        k: 2 * GROUP_K as usize + 3,
        a_transposed: true,
        b_transposed: false,
    };
    let mut a = measure::normal(shape.a_len(), seed);
    let b = measure::normal(shape.b_len(), seed + 1);
    // A^T: a's element (p, i) of batch 0 at p * m + i. Row 2 of C past bf16's range, row 4
    // past f16's, row 6 tiny (f16 subnormals), row 8 inf, row 10 NaN.
    for p in 0..shape.k {
        a[p * shape.m + 2] *= 5.0e36;
        a[p * shape.m + 4] *= 9.0e3;
        a[p * shape.m + 6] *= 1.0e-7;
    }
    a[5 * shape.m + 8] = f32::INFINITY;
    a[7 * shape.m + 10] = f32::NAN;
    // f32 on several tiles and paths, and one of the 16-bit and split algorithms drawn by the
    // seed, with runtime checks too (`common::sample`: each case is pipelines to compile;
    // every one with MANTISSA_TEST_EXHAUSTIVE=1).
    let drawn = common::sample(
        &[Algorithm::Bf16, Algorithm::F16, Algorithm::Bf16x3],
        1,
        seed,
    );
    for alg in std::iter::once(Algorithm::F32).chain(drawn) {
        let candidates = plain.tile_candidates(&alg);
        let default = candidates[0];
        let mut cases = vec![
            ("plain", &plain, default),
            ("plain", &plain, default.with_splits(3)),
        ];
        if alg == Algorithm::F32 {
            let others = [
                candidates.iter().find(|t| t.buffers == 2),
                candidates.iter().find(|t| t.reg == 8),
            ];
            cases.extend(others.into_iter().flatten().map(|&t| ("plain", &plain, t)));
            cases.push(("one group a dispatch", &tight, default));
        }
        if alg != Algorithm::F32 {
            cases.push(("checked", &checked, default));
        }
        for (how, backend, tile) in cases {
            common::assert_rounded_store(backend, (&alg, tile), &shape, (&a, &b), how);
        }
    }
}

/// A weight gradient's product sums its bias gradient as well (B's column sums over K, read
/// as the product reads B: `matmul::Epilogue::column_sums`, cuBLASLt's BGRADB): the product's
/// bits unchanged, and each column summed as every output is (each group of `GROUP_K` in k
/// order from zero in f32, the groups added in order), then held: the same bits as that sum
/// on the host. f32, bf16 and f16 (dy rounded as read), the sums held in f32 and bf16, on the
/// default tile, split 3 ways, double-buffered, on 8x8 register blocks, a group a dispatch and
/// with runtime checks; a width no tile divides, columns with NaN, inf, values past bf16's and
/// f16's range and subnormals.
#[test]
fn a_weight_gradient_sums_its_bias_gradient() {
    let test = "a_weight_gradient_sums_its_bias_gradient";
    let Some([plain, checked, tight]) = sums_backends_for(test, true) else {
        return;
    };
    let seed = common::seed(test);
    let shape = MatmulShape {
        batch: 1,
        m: 19,
        n: 41,
        k: 2 * GROUP_K as usize + 3,
        a_transposed: true,
        b_transposed: false,
    };
    let a = measure::normal(shape.a_len(), seed);
    let mut dy = measure::normal(shape.b_len(), seed + 1);
    // dy is k x n: column 3 has a NaN, 5 an inf, 7 sums past bf16's and f16's range, 9 is
    // subnormal in f32 and f16, 11 holds every boundary value down its rows.
    let n = shape.n;
    dy[40 * n + 3] = f32::NAN;
    dy[1500 * n + 5] = f32::INFINITY;
    for p in 0..shape.k {
        dy[p * n + 7] = 3.0e38 * (1.0 - p as f32 * 1e-5);
        dy[p * n + 9] *= 1.0e-39;
    }
    for (p, v) in measure::boundary_values().into_iter().enumerate() {
        dy[(p * 37) % shape.k * n + 11] = v;
    }
    // The defined sum: per column, groups of GROUP_K from zero in k order, the groups' sums
    // added in order, of dy rounded to the algorithm's operand format; then held.
    let host_sums = |read: Format, held: Format| {
        let mut rounded = dy.clone();
        host::ops::round_to(&mut rounded, read);
        let mut sums: Vec<f32> = (0..n)
            .map(|j| {
                let mut total = None::<f32>;
                for group in (0..shape.k).collect::<Vec<_>>().chunks(GROUP_K as usize) {
                    let mut s = 0.0f32;
                    for &p in group {
                        s += rounded[p * n + j];
                    }
                    total = Some(total.map_or(s, |t| s + t));
                }
                total.unwrap_or(0.0)
            })
            .collect();
        host::ops::round_to(&mut sums, held);
        sums
    };
    // f32 (the sums in f32) and one of the 16-bit algorithms drawn by the seed (the sums and
    // the product held in bf16); on each, the default tile, split, a group a dispatch, checked
    // and one of the other tiles drawn (`common::sample`: each case is kernels to compile,
    // seconds apiece on lavapipe; MANTISSA_TEST_EXHAUSTIVE=1 runs every one).
    let sixteen = [
        (Algorithm::Bf16, Format::Bf16),
        (Algorithm::F16, Format::F16),
    ];
    let drawn = common::sample(&sixteen, 1, seed);
    for (alg, read) in std::iter::once((Algorithm::F32, Format::F32)).chain(drawn) {
        let candidates = plain.tile_candidates(&alg);
        let default = candidates[0];
        let mut cases = vec![
            ("plain", &plain, default),
            ("plain", &plain, default.with_splits(3)),
            ("a group a dispatch", &tight, default),
            ("checked", &checked, default),
        ];
        let others: Vec<Tile> = [
            candidates.iter().find(|t| t.buffers == 2),
            candidates.iter().find(|t| t.reg == 8),
        ]
        .into_iter()
        .flatten()
        .copied()
        .collect();
        let others = common::sample(&others, 1, seed);
        cases.extend(others.into_iter().map(|t| ("plain", &plain, t)));
        let held = if alg == Algorithm::F32 {
            Format::F32
        } else {
            Format::Bf16
        };
        for (how, backend, tile) in cases {
            let what = format!("{alg} tile {tile} ({how}) held in {held}");
            let (product, sums) = backend
                .matmul_and_column_sums(&shape, &alg, tile, (&a, &dy), (held, held))
                .block_on()
                .unwrap()
                .unwrap_or_else(|| panic!("{what}: the SIMT kernel did not sum the columns"));
            let alone = backend
                .matmul_rounded_on_tile(&shape, &alg, tile, (&a, &dy), held)
                .block_on()
                .unwrap();
            common::same_or_nan(&format!("{what}: product"), &product, &alone);
            common::same_or_nan(
                &format!("{what}: column sums"),
                &sums,
                &host_sums(read, held),
            );
        }
    }
}

/// A linear layer's bias add (and its GELU) in the matmul's store writes a 16-bit coded output
/// (a q|k|v projection's or the pre-GELU activations under the 16-bit presets: the plan's coded
/// twin of the product) as the codes of the values the f32-stored store writes, and both are
/// the add's definition over the product (`common::assert_bias_add_into_codes`). bf16 or f16
/// drawn, and f32; the default tile, and drawn: split 2 ways, a group a dispatch (the running
/// totals between groups, which codes cannot carry, in the partial sums) or runtime checks; K
/// of two groups, a width of even length that no tile divides, rows of NaN, inf, sums past
/// f16's range and subnormal in f16. A width of odd length is refused with the reason.
#[test]
fn a_bias_add_into_codes_stores_the_held_sums() {
    let test = "a_bias_add_into_codes_stores_the_held_sums";
    let Some([plain, checked, tight]) = sums_backends(test) else {
        return;
    };
    let seed = common::seed(test);
    let shape = MatmulShape::new(21, 46, GROUP_K as usize + 77);
    let k = shape.k;
    let mut a = measure::normal(shape.a_len(), seed);
    let b = measure::normal(shape.b_len(), seed + 1);
    let mut bias = measure::normal(shape.n, seed + 2);
    a[3 * k + 10] = f32::NAN;
    a[5 * k + 20] = f32::INFINITY;
    for p in 0..k {
        a[7 * k + p] *= 1.0e4;
        a[9 * k + p] *= 1.0e-7;
    }
    bias[4] = 7.0e4;
    bias[6] = 3.0e-6;
    let sixteen = [Algorithm::Bf16, Algorithm::F16];
    let drawn = common::sample(&sixteen, 1, seed);
    for (i, alg) in std::iter::once(Algorithm::F32).chain(drawn).enumerate() {
        // The default tile, and one of the others drawn (each is kernels to compile, seconds
        // apiece on lavapipe; MANTISSA_TEST_EXHAUSTIVE=1 runs every one).
        let default = plain.tile_candidates(&alg)[0];
        let others = [
            ("split", &plain, default.with_splits(2)),
            ("a group a dispatch", &tight, default),
            ("checked", &checked, default),
        ];
        let drawn = common::sample(&others, 1, seed + i as u64);
        for (how, backend, tile) in std::iter::once(("plain", &plain, default)).chain(drawn) {
            common::assert_bias_add_into_codes(backend, (&alg, tile), &shape, (&a, &b, &bias), how);
        }
    }
    let odd = MatmulShape::new(4, 5, 8);
    let (a, b, bias) = (vec![1.0; 32], vec![1.0; 40], vec![0.0; 5]);
    let formats = [Format::F32, Format::Bf16, Format::Bf16, Format::F32];
    let tile = plain.tile_candidates(&Algorithm::F32)[0];
    let err = plain
        .matmul_bias_add_on_tile(&odd, &Algorithm::F32, tile, (&a, &b), &bias, formats, true)
        .block_on()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("5 columns") && err.contains("16-bit codes"),
        "{err}"
    );
}

/// A bf16 or f16 operand held in f32 (a step plan's gradients) is rounded as the SIMT kernel
/// reads it (`MatmulVariant::reading`), not encoded by a pass first: the same bits as the same
/// values held as codes, either side or both, transposed or not, on values that round both
/// ways, ties, subnormals, values that overflow the format, inf and NaN.
#[test]
fn sixteen_bit_reads_from_f32_give_the_codes_bits() {
    let test = "sixteen_bit_reads_from_f32_give_the_codes_bits";
    let Some(b) = common::fresh_wgpu(test, WgpuOptions::default()) else {
        return;
    };
    let seed = common::seed(test);
    let edges = [
        1.0 + f32::EPSILON * 64.0, // a tie between two bf16 values: to even
        1.0 + f32::EPSILON * 192.0,
        1.0 + f32::EPSILON * 2048.0, // a tie between two f16 values
        -3.0e38,                     // past bf16's largest finite after rounding: -inf
        70000.0,                     // past f16's
        1.0e-40,                     // subnormal in f32 (and bf16)
        3.0e-6,                      // subnormal in f16
        f32::INFINITY,
        f32::NAN,
    ];
    let f32_ = Format::F32;
    assert!(b.encoded_candidates(&Algorithm::F32).is_empty());
    for (alg, coded) in [
        (Algorithm::Bf16, Format::Bf16),
        (Algorithm::F16, Format::F16),
    ] {
        assert_eq!(
            b.encoded_candidates(&alg),
            [b.tile_candidates(&alg)[0].with_encoded(true)],
            "{alg}"
        );
        for (s, (a_t, b_t)) in [(false, false), (true, false), (false, true), (true, true)]
            .into_iter()
            .enumerate()
        {
            let shape = MatmulShape {
                batch: 2,
                m: 37,
                n: 29,
                k: 70,
                a_transposed: a_t,
                b_transposed: b_t,
            };
            let at = seed + 10 * s as u64;
            let mut a = measure::normal(shape.a_len(), at);
            let mut bm = measure::normal(shape.b_len(), at + 1);
            let (la, lb) = (a.len(), bm.len());
            for (i, e) in edges.iter().enumerate() {
                a[(i * 131) % la] = *e;
                bm[(i * 97 + 5) % lb] = -*e;
            }
            let tile = b.tile_candidates(&alg)[0];
            let held = |stored| {
                b.matmul_held(&shape, &alg, tile, (&a, &bm), stored)
                    .block_on()
                    .unwrap()
            };
            let codes = held([coded, coded]);
            for stored in [[f32_, f32_], [f32_, coded], [coded, f32_]] {
                let got = held(stored);
                let differ = got
                    .iter()
                    .zip(&codes)
                    .filter(|(x, y)| x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()))
                    .count();
                assert_eq!(
                    differ, 0,
                    "{alg} {shape:?} held as {stored:?}: {differ} outputs differ"
                );
            }
            // The tuner's other candidate (`Tile::encoded`): encoded by a pass first, the same
            // bits again.
            let encoded = b
                .matmul_held(&shape, &alg, tile.with_encoded(true), (&a, &bm), [f32_; 2])
                .block_on()
                .unwrap();
            let differ = encoded
                .iter()
                .zip(&codes)
                .filter(|(x, y)| x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()))
                .count();
            assert_eq!(
                differ, 0,
                "{alg} {shape:?} encoded first: {differ} outputs differ"
            );
        }
    }
}
