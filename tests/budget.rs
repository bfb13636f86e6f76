//! The loop budget (src/backend/wgpu/budget.rs): measured when the device opens, and long loops
//! split over dispatches that compute the bits one dispatch would. The split paths run on any
//! adapter here: a backend told to assume a small budget splits sums of a few thousand terms,
//! and is compared bit for bit with one that runs them whole (on lavapipe's Mesa 22, whose
//! budget is 65535, sums this short run whole). K far past the real budget is the conformance
//! suite's (`matmul_long_k`); the cooperative kernel's split is tests/coop.rs's.

mod common;

use mantissa::algorithm::{Algorithm, MatmulShape};
use mantissa::backend::Backend;
use mantissa::backend::reference::ops;
use mantissa::backend::wgpu::{WgpuBackend, WgpuOptions};
use mantissa::format::Format;
use mantissa::measure;
use mantissa::measure::train_tolerance as tol;
use mantissa::plan::{Op, ScoreScale};
use pollster::FutureExt as _;

/// The budget the split backends of the training kernels assume: half of it (what kernels plan
/// on) holds sums of a few thousand terms.
const SMALL_BUDGET: u32 = 2000;

/// The budget the split backends of the matmul assume: half of it holds one or two summation
/// groups of K (`GROUP_K`; spans start at group boundaries), up to eight with the K step
/// written out (fewer loops), so K = 9000 (nine groups) takes several dispatches.
const MATMUL_BUDGET: u32 = 6000;

/// A backend that runs loops whole where the adapter allows, and one that assumes `budget`,
/// both with `checks` (the K step written out per k), on SIMT kernels.
fn pair(test: &str, checks: bool, budget: u32) -> Option<(WgpuBackend, WgpuBackend)> {
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
            assume_loop_budget: Some(budget),
            ..options
        },
    )?;
    assert_eq!(
        split.loop_budget(),
        Some(whole.loop_budget().map_or(budget, |b| b.min(budget)))
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
/// written out (runtime checks) for a sample of them; every run checks f32, bf16x3 and a
/// sample of the rest.
#[test]
fn a_split_k_gives_the_bits_of_one_dispatch() {
    let test = "a_split_k_gives_the_bits_of_one_dispatch";
    let seed = common::seed(test);
    let shapes = [
        MatmulShape::new(37, 29, 9000),
        MatmulShape {
            batch: 2,
            m: 19,
            n: 41,
            k: 9001,
            a_transposed: true,
            b_transposed: true,
        },
    ];
    for checks in [false, true] {
        let Some((whole, split)) = pair(test, checks, MATMUL_BUDGET) else {
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
            // f32 and bf16x3 on several tiles and two others drawn by the seed; with checks,
            // f32 and one of bf16x6 and rowwise fp8 (`common::sample`: each is a kernel to
            // compile; every one with MANTISSA_TEST_EXHAUSTIVE=1).
            let seed = seed + 2 * s as u64 + checks as u64;
            let (always, others): (Vec<Algorithm>, Vec<Algorithm>) = match checks {
                false => (algorithms.into_iter())
                    .partition(|a| matches!(a, Algorithm::F32 | Algorithm::Bf16x3)),
                true => (algorithms.into_iter())
                    .filter(|a| {
                        ["f32", "bf16x6", "e4m3-e5m2:rowwise"].contains(&a.to_string().as_str())
                    })
                    .partition(|a| *a == Algorithm::F32),
            };
            let drawn = if checks { 1 } else { 2 };
            for alg in always
                .into_iter()
                .chain(common::sample(&others, drawn, seed))
            {
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

/// The training kernels' long loops split over dispatches give the bits of one: the embedding
/// scatter-add over many tokens, the column sums of layer norm's backward over many chunks of
/// rows, the unscale-and-check of a long gradient (its values and flag per op; its squared
/// norm, and the loss's mean over many rows, in a step plan's stats).
#[test]
fn split_training_loops_give_the_bits_of_one_dispatch() {
    let test = "split_training_loops_give_the_bits_of_one_dispatch";
    let seed = common::seed(test);
    let Some((whole, split)) = pair(test, false, SMALL_BUDGET) else {
        return;
    };
    let (vocab, width, tokens) = (7, 3, 5000);
    let ids: Vec<u32> = (0..tokens as u32)
        .map(|i| (i * 5 + i / 3) % vocab)
        .collect();
    let dout = measure::normal(tokens * width, seed);
    let scatter = |b: &WgpuBackend| {
        let mut p = common::OneOp::new(tokens);
        let (di, out) = (p.input(dout.clone()), p.output(vocab as usize * width));
        let op = Op::EmbeddingBwd {
            dout: di,
            ids: p.batch.0,
            out,
            rows: vocab as usize,
            c: width,
        };
        p.run(b, op, (&ids, &vec![0; tokens]), 1.0, &[out]).outs
    };
    assert!(common::same_bits(&scatter(&whole)[0], &scatter(&split)[0]));
    // 1100 chunks of 256 rows.
    let (rows, c) = (256 * 1100 - 3, 2);
    let (dy, x) = (
        measure::normal(rows * c, seed + 1),
        measure::normal(rows * c, seed + 2),
    );
    let g = measure::normal(c, seed + 3);
    let stats: Vec<f32> = (0..rows).flat_map(|_| [0.1, 1.5]).collect();
    let backward = |b: &WgpuBackend| layernorm_bwd(b, &dy, &x, &g, &stats, c);
    let (one, parts) = (backward(&whole), backward(&split));
    assert!(common::same_bits(&one[1], &parts[1]), "dg");
    assert!(common::same_bits(&one[2], &parts[2]), "db");
    // 2001 passes of the 256 lanes, an inf in the last.
    let mut grads = measure::normal(256 * 2000 + 7, seed + 4);
    let last = grads.len() - 2;
    for with_inf in [false, true] {
        if with_inf {
            grads[last] = f32::INFINITY;
        }
        let unscale = |b: &WgpuBackend| {
            let mut p = common::OneOp::new(1);
            p.grads = 1;
            let gi = p.input(grads.clone());
            let op = Op::UnscaleCheck { grads: vec![gi] };
            let ran = p.run(b, op, (&[0], &[0]), 1024.0, &[gi]);
            (ran.outs[0].clone(), ran.stats[1] == 0.0)
        };
        let (one, parts) = (unscale(&whole), unscale(&split));
        assert!(common::same_bits(&one.0, &parts.0));
        assert_eq!((one.1, parts.1), (!with_inf, !with_inf));
    }
    let plan_stats = |b: &WgpuBackend| reductions_plan(b, seed + 5);
    let (one, parts) = (plan_stats(&whole), plan_stats(&split));
    assert_eq!(
        one.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
        parts.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
        "the loss's mean, the gradient's flag and squared norm: {one:?} vs {parts:?}"
    );
}

/// Layer norm's backward alone in a plan on `b`: (dx, dg, db).
fn layernorm_bwd(
    b: &dyn Backend,
    dy: &[f32],
    x: &[f32],
    g: &[f32],
    stats: &[f32],
    c: usize,
) -> Vec<Vec<f32>> {
    let mut p = common::OneOp::new(1);
    let (dyi, xi, gi, si) = (
        p.input(dy.to_vec()),
        p.input(x.to_vec()),
        p.input(g.to_vec()),
        p.input(stats.to_vec()),
    );
    let (dx, dg, db) = (p.output(x.len()), p.output(c), p.output(c));
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
    p.run(b, op, (&[0], &[0]), 1.0, &[dx, dg, db]).outs
}

/// The stats of a step plan of two one-workgroup reductions over long inputs: the cross
/// entropy's loss (its mean over 256,003 rows: 1001 passes of the 256 lanes) and a gradient's
/// unscale-and-check (600,000 values).
fn reductions_plan(b: &dyn Backend, seed: u64) -> Vec<f64> {
    use mantissa::plan::{Outline, PlanBuilder, Section, TensorKind};
    let (rows, v, n) = (256_003, 3, 600_000);
    let mut g = PlanBuilder::default();
    let tokens = g.tensor(rows, TensorKind::Tokens);
    let targets = g.tensor(rows, TensorKind::Targets);
    let logits = g.constant(measure::normal(rows * v, seed));
    let grad = g.temp(rows * v);
    let dw = g.tensor(n, TensorKind::Grad(0));
    g.push(Op::CrossEntropy {
        logits,
        targets,
        grad,
        v,
        held: Format::F32,
    });
    g.push(Op::UnscaleCheck { grads: vec![dw] });
    let mut outline = Outline::ops_alone(1, 2, (tokens, targets), logits);
    outline.stats.grads = 1;
    let plan = g.finish(outline).unwrap();
    let scalars = vec![1.0; plan.scalar_count()];
    let ids: Vec<u32> = (0..rows as u32).map(|i| i % v as u32).collect();
    let mut exec = mantissa::backend::executor(b, plan, true).unwrap();
    exec.write(dw, &measure::normal(n, seed + 1))
        .block_on()
        .unwrap();
    exec.run(Section::Step, &ids, &ids, &scalars)
        .block_on()
        .unwrap()
}

/// Rows longer than one lane may run take more lanes to a row (a tree's order: against the
/// reference within its tolerance, as on a GPU's lanes): layer norm, causal softmax and cross
/// entropy forward and backward.
#[test]
fn rows_too_long_for_one_lane_take_more() {
    let test = "rows_too_long_for_one_lane_take_more";
    let seed = common::seed(test);
    let Some((_, split)) = pair(test, false, SMALL_BUDGET) else {
        return;
    };
    let (rows, c) = (3, 1500);
    let x = measure::normal(rows * c, seed);
    let (g, bias) = (measure::normal(c, seed + 1), measure::normal(c, seed + 2));
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
    let fwd = p.run(&split, op, (&[0], &[0]), 1.0, &[out, stats]).outs;
    let want = ops::layernorm_fwd(&x, &g, &bias, c);
    common::close("layer norm y", &fwd[0], &want.0, tol::ROW);
    let mean: Vec<f32> = fwd[1].iter().step_by(2).copied().collect();
    common::close("layer norm mean", &mean, &want.1, tol::ROW);
    let dy = measure::normal(rows * c, seed + 3);
    let bwd = layernorm_bwd(&split, &dy, &x, &g, &fwd[1], c);
    let want = ops::layernorm_bwd(&dy, &x, &g, &want.1, &want.2, c);
    common::close("layer norm dx", &bwd[0], &want.0, tol::REDUCTION);
    let t = 1200;
    let scores = measure::normal(t * t, seed + 4);
    let mut p = common::OneOp::new(1);
    let (si, out) = (p.input(scores.clone()), p.output(t * t));
    let op = Op::Softmax {
        x: si,
        out,
        t,
        causal: true,
        mask: None,
        scale: ScoreScale {
            scale: 0.125,
            held: Format::F32,
        },
        x_held: Format::F32,
    };
    let probs = p.run(&split, op, (&[0], &[0]), 1.0, &[out]).outs.remove(0);
    common::close(
        "softmax",
        &probs,
        &ops::softmax_fwd(&scores, t, 0.125, true),
        tol::ROW,
    );
    let dp = measure::normal(t * t, seed + 5);
    let mut p = common::OneOp::new(1);
    let (pi, dpi, out) = (p.input(probs.clone()), p.input(dp.clone()), p.output(t * t));
    let op = Op::SoftmaxBwd {
        p: pi,
        dp: dpi,
        out,
        t,
        causal: true,
        scale: ScoreScale {
            scale: 0.125,
            held: Format::F32,
        },
        dp_held: Format::F32,
    };
    common::close(
        "softmax backward",
        &p.run(&split, op, (&[0], &[0]), 1.0, &[out]).outs[0],
        &ops::softmax_bwd(&probs, &dp, t, 0.125, true),
        tol::ROW,
    );
    let targets: Vec<u32> = (0..rows as u32).map(|r| r * 7).collect();
    let mut p = common::OneOp::new(rows);
    let (li, grad) = (p.input(x.clone()), p.output(rows * c));
    let op = Op::CrossEntropy {
        logits: li,
        targets: p.batch.1,
        grad,
        v: c,
        held: Format::F32,
    };
    let ran = p.run(&split, op, (&vec![0; rows], &targets), rows as f32, &[grad]);
    let want = ops::cross_entropy_fwd(&x, &targets, c);
    let loss = ran.stats[mantissa::plan::Stats::LOSS];
    assert!((loss - want.0).abs() <= tol::ROW as f64 * (1.0 + want.0.abs()));
    // With the loss scale at the rows, the gradient is p - onehot.
    let onehot_less = ops::cross_entropy_bwd(&want.1, &targets, c, rows as f64);
    common::close("cross entropy", &ran.outs[0], &onehot_less, tol::ROW);
}

/// Fused attention whose loops over the context do not fit the budget is refused, naming what
/// to do instead; it is not split (its unfused ops are).
#[test]
fn fused_attention_beyond_the_budget_is_refused() {
    use mantissa::plan::{Attention, Outline, PlanBuilder, Section, TensorKind};
    let test = "fused_attention_beyond_the_budget_is_refused";
    let Some((_, split)) = pair(test, false, SMALL_BUDGET) else {
        return;
    };
    let spec = Attention {
        b: 1,
        t: 512,
        h: 1,
        d: 16,
        scale: 0.25,
        algorithm: Algorithm::F32,
        probs: Format::F32,
        compute: Format::F32,
    };
    let mut g = PlanBuilder::default();
    let tokens = g.tensor(spec.t, TensorKind::Tokens);
    let targets = g.tensor(spec.t, TensorKind::Targets);
    let qkv = g.constant(vec![0.5; spec.qkv_len()]);
    let (out, stats) = (g.temp(spec.out_len()), g.temp(2 * spec.score_rows()));
    g.push(Op::Attention {
        qkv,
        out,
        stats,
        spec,
    });
    let plan = g
        .finish(Outline::ops_alone(1, 1, (tokens, targets), out))
        .unwrap();
    let scalars = vec![0.0; plan.scalar_count()];
    let ids = vec![0u32; spec.t];
    let err = mantissa::backend::executor(&split, plan, true)
        .and_then(|mut exec| exec.run(Section::Step, &ids, &ids, &scalars).block_on())
        .expect_err("attention over 512 tokens under a budget of 2000");
    let msg = err.to_string();
    assert!(
        msg.contains("loop iterations") && msg.contains("--attention unfused"),
        "{msg}"
    );
    assert_eq!(err.class(), mantissa::error::ErrorClass::BadInput);
}
