//! The training executor: every op's gradient against finite differences in f64, the model's
//! gradient against a directional derivative, and the training loop's promises (loss falls
//! below the unigram entropy, GradScaler skips and backs off, fp8 histories update, resuming
//! reproduces the uninterrupted run, bad checkpoints are refused).

mod common;

use mantissa::backend::reference::ops;
use mantissa::backend::{Backend, BackendKind, Reference};
use mantissa::choice;
use mantissa::measure;
use mantissa::plan::{Op, Section, Unary};
use mantissa::policy::{Fp8State, Preset};
use mantissa::train::*;
use pollster::FutureExt as _;

/// Checks d(sum(w . f(x)))/dx from `backward` against central differences of `forward`, in f64.
fn grad_check(
    name: &str,
    x: &[f64],
    forward: impl Fn(&[f64]) -> Vec<f64>,
    backward: impl Fn(&[f64], &[f64]) -> Vec<f64>,
) {
    let out = forward(x);
    let w: Vec<f64> = measure::normal(out.len(), 99)
        .iter()
        .map(|&v| v as f64)
        .collect();
    let analytic = backward(x, &w);
    let h = 1e-6;
    for i in 0..x.len() {
        let (mut xp, mut xm) = (x.to_vec(), x.to_vec());
        xp[i] += h;
        xm[i] -= h;
        let fp: f64 = forward(&xp).iter().zip(&w).map(|(a, b)| a * b).sum();
        let fm: f64 = forward(&xm).iter().zip(&w).map(|(a, b)| a * b).sum();
        let numeric = (fp - fm) / (2.0 * h);
        assert!(
            (numeric - analytic[i]).abs() <= 1e-6 * (1.0 + numeric.abs()),
            "{name}[{i}]: analytic {} numeric {numeric}",
            analytic[i]
        );
    }
}

fn randn(n: usize, seed: u64) -> Vec<f64> {
    measure::normal(n, seed)
        .into_iter()
        .map(|v| v as f64)
        .collect()
}

#[test]
fn op_gradients_match_finite_differences() {
    let c = 5;
    let (g, b) = (randn(c, 1), randn(c, 2));
    let x = randn(3 * c, 3);
    grad_check(
        "layernorm dx",
        &x,
        |x| ops::layernorm_fwd(x, &g, &b, c).0,
        |x, dy| {
            let (_, m, r) = ops::layernorm_fwd(x, &g, &b, c);
            ops::layernorm_bwd(dy, x, &g, &m, &r, c).0
        },
    );
    grad_check(
        "layernorm dg",
        &g,
        |g| ops::layernorm_fwd(&x, g, &b, c).0,
        |g, dy| {
            let (_, m, r) = ops::layernorm_fwd(&x, g, &b, c);
            ops::layernorm_bwd(dy, &x, g, &m, &r, c).1
        },
    );
    grad_check(
        "layernorm db",
        &b,
        |b| ops::layernorm_fwd(&x, &g, b, c).0,
        |b, dy| {
            let (_, m, r) = ops::layernorm_fwd(&x, &g, b, c);
            ops::layernorm_bwd(dy, &x, &g, &m, &r, c).2
        },
    );
    let eps = 1e-6;
    grad_check(
        "rmsnorm dx",
        &x,
        |x| ops::rmsnorm_fwd(x, &g, c, eps).0,
        |x, dy| ops::rmsnorm_bwd(dy, x, &g, &ops::rmsnorm_fwd(x, &g, c, eps).1, c).0,
    );
    grad_check(
        "rmsnorm dg",
        &g,
        |g| ops::rmsnorm_fwd(&x, g, c, eps).0,
        |g, dy| ops::rmsnorm_bwd(dy, &x, g, &ops::rmsnorm_fwd(&x, g, c, eps).1, c).1,
    );
    // The unary family, each function against its own forward (GELU's and SiLU's were
    // written out before the family; the formulas are src/plan/unary.rs's).
    for (k, &f) in Unary::ALL.iter().enumerate() {
        grad_check(
            f.name(),
            &randn(20, 4 + k as u64),
            |x| ops::unary_fwd(f, x),
            // The backward reads the output where the function's does (`reads_output`).
            |x, dy| match f.reads_output() {
                true => ops::unary_bwd(f, &ops::unary_fwd(f, x), dy),
                false => ops::unary_bwd(f, x, dy),
            },
        );
    }
    let other = randn(12, 10);
    grad_check(
        "mul",
        &randn(12, 11),
        |a| ops::mul(a, &other),
        |_, dy| ops::mul(dy, &other),
    );
    let target = randn(12, 12);
    grad_check(
        "mean squared error",
        &randn(12, 13),
        |p| vec![ops::mse_fwd(p, &target)],
        |p, dl| ops::mse_bwd(p, &target, dl[0]),
    );
    let t = 4;
    for causal in [true, false] {
        grad_check(
            if causal { "causal softmax" } else { "softmax" },
            &randn(2 * t * t, 5),
            |s| ops::softmax_fwd(s, t, 0.7, causal),
            |s, dp| ops::softmax_bwd(&ops::softmax_fwd(s, t, 0.7, causal), dp, t, 0.7, causal),
        );
    }
    let targets = [2u32, 0, 4];
    grad_check(
        "cross entropy",
        &randn(15, 6),
        |l| vec![ops::cross_entropy_fwd(l, &targets, 5).0],
        |l, dl| {
            ops::cross_entropy_bwd(
                &ops::cross_entropy_fwd(l, &targets, 5).1,
                &targets,
                5,
                dl[0],
            )
        },
    );
    let ids = [1u32, 3, 1];
    grad_check(
        "embedding",
        &randn(4 * 2, 7),
        |tab| ops::embedding_fwd(tab, &ids, 2),
        |_, d| ops::embedding_bwd(d, &ids, 4, 2),
    );
    grad_check(
        "bias",
        &randn(3, 8),
        |b| {
            let mut y = vec![0.5; 6];
            ops::add_bias(&mut y, b);
            y
        },
        |_, d| ops::column_sums(d, 3),
    );
}

/// A SwiGLU-style block under a mean squared error recorded from the new ops alone, its
/// backward as a model builder would record it (the product's backward as two products, SiLU's,
/// an add, RMS norm's): the gradient of the gain and of x within f32's finite differences of
/// the loss, on the host interpreter and the wgpu executor, the loss scaled and unscaled.
#[test]
fn a_plan_of_the_new_ops_differentiates_as_its_loss() {
    use mantissa::plan::{Op, Outline, PlanBuilder, TensorKind, scalar::StepScalars};
    let (rows, c) = (3, 6);
    let n = rows * c;
    let mut g = PlanBuilder::default();
    let input = |g: &mut PlanBuilder, len| g.tensor(len, TensorKind::Partial);
    let (x, gain, target) = (input(&mut g, n), input(&mut g, c), input(&mut g, n));
    let [h, a, prod, dprod, da, dh, dh_silu, dx] = [0; 8].map(|_| input(&mut g, n));
    let (rstd, dgain) = (input(&mut g, rows), input(&mut g, c));
    let held = mantissa::format::Format::F32;
    g.push(Op::RmsNorm {
        x,
        g: gain,
        out: h,
        stats: rstd,
        c,
        eps: 1e-6,
        held,
    });
    g.push(Op::Unary {
        f: Unary::Silu,
        x: h,
        out: a,
        held,
    });
    g.push(Op::Mul {
        a,
        b: h,
        out: prod,
        held,
    });
    g.push(Op::MseLoss {
        pred: prod,
        target,
        grad: dprod,
        held,
    });
    // d(a * h): dprod * h into a, dprod * a into h; a = SiLU(h) adds its own into h.
    g.push(Op::Mul {
        a: dprod,
        b: h,
        out: da,
        held,
    });
    g.push(Op::Mul {
        a: dprod,
        b: a,
        out: dh,
        held,
    });
    g.push(Op::UnaryBwd {
        f: Unary::Silu,
        x: h,
        dy: da,
        out: dh_silu,
        held: mantissa::format::Format::F32,
        dy_held: mantissa::format::Format::F32,
    });
    g.push(Op::add_in_place(dh_silu, dh));
    g.push(Op::RmsNormBwd {
        dy: dh,
        x,
        g: gain,
        stats: rstd,
        dx,
        dg: dgain,
        c,
        dy_held: mantissa::format::Format::F32,
    });
    let batch = (
        g.tensor(1, TensorKind::Tokens),
        g.tensor(1, TensorKind::Targets),
    );
    let ops = g.ops.len();
    let plan = g.finish(Outline::ops_alone(4, ops, batch, prod)).unwrap();
    let values = [
        (x, measure::normal(n, 21)),
        (gain, measure::normal(c, 22)),
        (target, measure::normal(n, 23)),
    ];
    let check = |b: &dyn Backend| {
        let mut exec = mantissa::backend::executor(b, plan.clone(), true).unwrap();
        for (t, v) in &values {
            exec.write(*t, v).block_on().unwrap();
        }
        let scalars = |loss_scale: f32| {
            StepScalars {
                adamw: &mantissa::plan::AdamW::default(),
                clip: 0.0,
                loss_scale,
                poison: 0.0,
                t: 1,
                parts: 1,
                part: 0,
                fp8: &[],
                eval: false,
            }
            .array(plan.rows(), plan.scalar_count())
        };
        let mut run = |section, loss_scale| {
            let stats = exec
                .run(section, &[0], &[0], &scalars(loss_scale))
                .block_on();
            let loss = stats.unwrap()[mantissa::plan::Stats::LOSS];
            let grads = [dx, dgain].map(|t| exec.read(t).block_on().unwrap());
            (loss, grads)
        };
        let (_, [gx, gg]) = run(Section::Backward, 1.0);
        // The loss scale multiplies the gradient alone.
        let (_, [sx, _]) = run(Section::Backward, 1024.0);
        for (i, (&s, &u)) in sx.iter().zip(&gx).enumerate() {
            assert!(
                (s / 1024.0 - u).abs() <= 1e-5 * (1.0 + u.abs()),
                "{}: dx[{i}] scaled",
                b.name()
            );
        }
        for (which, t, analytic) in [("x", x, &gx), ("gain", gain, &gg)] {
            let base = values.iter().find(|(id, _)| *id == t).unwrap().1.clone();
            for i in [0, base.len() / 2, base.len() - 1] {
                let h = 1e-2;
                let mut at = |delta: f32| {
                    let mut v = base.clone();
                    v[i] += delta;
                    exec.write(t, &v).block_on().unwrap();
                    let stats = exec
                        .run(Section::Forward, &[0], &[0], &scalars(1.0))
                        .block_on();
                    stats.unwrap()[mantissa::plan::Stats::LOSS]
                };
                let numeric = (at(h) - at(-h)) / (2.0 * h as f64);
                exec.write(t, &base).block_on().unwrap();
                let got = analytic[i] as f64;
                assert!(
                    (numeric - got).abs() <= 2e-3 * (1.0 + numeric.abs()),
                    "{}: d loss / d {which}[{i}]: {got}, finite differences {numeric}",
                    b.name()
                );
            }
        }
    };
    check(&Reference);
    common::on(
        common::wgpu(),
        "a_plan_of_the_new_ops_differentiates_as_its_loss",
        check,
    );
}

#[test]
fn head_permutations_are_inverses() {
    let (b, t, h, d) = (2, 3, 2, 4);
    let qkv: Vec<f32> = (0..b * t * 3 * h * d).map(|i| i as f32).collect();
    let [q, k, v] = ops::split_heads(&qkv, b, t, h, d);
    assert_eq!(ops::merge_qkv([&q, &k, &v], b, t, h, d), qkv);
    let rows = ops::heads_to_rows(&q, b, t, h, d);
    assert_eq!(ops::rows_to_heads(&rows, b, t, h, d), q);
    // q of batch 1, head 1, time 2 is qkv row (1, 2), columns h*d + d .. of the q part.
    let row = (t + 2) * 3 * h * d;
    assert_eq!(
        &q[((h + 1) * t + 2) * d..((h + 1) * t + 3) * d],
        &qkv[row + d..row + 2 * d]
    );
}

fn corpus() -> Corpus {
    Corpus::load(&common::repo_file("data/shakespeare.txt")).expect("corpus")
}

fn options(corpus: &Corpus, preset: Preset, seed: u64) -> TrainOptions {
    TrainOptions::new(
        GptConfig::named("tiny", corpus.vocab.len()).unwrap(),
        preset,
        seed,
    )
}

#[test]
fn model_gradient_matches_a_directional_derivative() {
    let corpus = corpus();
    let mut o = options(&corpus, Preset::True32, 3);
    o.config.n_embd = 16;
    o.config.block_size = 8;
    o.config.batch_size = 2;
    let mut t = Trainer::new(&Reference, &corpus, o).unwrap();
    let (ids, targets) = corpus.batch(false, 2, 8, 3, 0).unwrap();
    let params = t.state().block_on().unwrap().params;
    let (_, grads) = t
        .gpt
        .loss_and_gradients(&t.run.precision, &[], &params, &ids, &targets)
        .block_on()
        .unwrap();
    let dir: Vec<Vec<f32>> = params
        .iter()
        .enumerate()
        .map(|(i, q)| measure::normal(q.len(), 50 + i as u64))
        .collect();
    let along: f64 = grads
        .iter()
        .zip(&dir)
        .flat_map(|(g, d)| g.iter().zip(d))
        .map(|(g, d)| *g as f64 * *d as f64)
        .sum();
    let eps = 1e-3f32;
    let shifted = |s: f32| -> f64 {
        let q: Vec<Vec<f32>> = params
            .iter()
            .zip(&dir)
            .map(|(w, d)| w.iter().zip(d).map(|(w, d)| w + s * d).collect())
            .collect();
        t.gpt
            .loss(&t.run.precision, &[], &q, &ids, &targets)
            .block_on()
            .unwrap()
    };
    let numeric = (shifted(eps) - shifted(-eps)) / (2.0 * eps as f64);
    assert!(
        (numeric - along).abs() < 2e-2 * along.abs().max(1e-2),
        "directional derivative {numeric}, gradient gives {along}"
    );
}

#[test]
fn loss_falls_below_the_unigram_entropy() {
    let corpus = corpus();
    let entropy = corpus.unigram_entropy();
    // One of the three drawn by the seed (120 steps each; all with MANTISSA_TEST_EXHAUSTIVE=1):
    // the parity tests follow PyTorch's falling losses under each for 60-300 steps.
    let seed = common::seed("loss_falls_below_the_unigram_entropy");
    let presets = [Preset::True32, Preset::Mixed16, Preset::MixedBf16];
    for preset in common::sample(&presets, 1, seed) {
        let mut t = Trainer::new(&Reference, &corpus, options(&corpus, preset, 11)).unwrap();
        for _ in 0..120 {
            t.step().block_on().unwrap();
        }
        let val = t.evaluate(2).block_on().unwrap();
        assert!(
            val < entropy - 0.4,
            "{preset}: validation loss {val:.3} after 120 steps, unigram entropy {entropy:.3}"
        );
    }
}

/// Sampling hands each character on as it is drawn (`mantissa sample` prints it then): once per
/// character, together the text `sample` returns, and an error of the receiver ends the
/// sampling with that error.
#[test]
fn sampling_streams_each_character() {
    let corpus = corpus();
    let mut t = Trainer::new(&Reference, &corpus, options(&corpus, Preset::True32, 5)).unwrap();
    t.step().block_on().unwrap();
    let whole = t.sample("Th", 40, 0.8, 9).block_on().unwrap();
    let mut pieces = Vec::new();
    let streamed = t
        .sample_streaming("Th", 40, 0.8, 9, |c| {
            pieces.push(c.to_string());
            Ok(())
        })
        .block_on()
        .unwrap();
    assert_eq!(streamed, whole);
    assert_eq!(pieces.len(), 40, "one call per character: {pieces:?}");
    assert_eq!(pieces.concat(), whole, "the text after the prompt");
    let mut calls = 0;
    let stopped = t
        .sample_streaming("Th", 40, 0.8, 9, |_| {
            calls += 1;
            match calls {
                3 => Err(mantissa::Error::output(
                    "standard output",
                    std::io::Error::other("closed"),
                )),
                _ => Ok(()),
            }
        })
        .block_on();
    assert!(stopped.is_err(), "the receiver's error ends the sampling");
    assert_eq!(calls, 3);
}

/// The same training on a device backend (CUDA; on wgpu `matches_pytorch_step_for_step` checks
/// it step by step): bf16-mixed through the backend's resident plan learns, every matmul and
/// the layer norm, GELU, softmax, cross-entropy and AdamW kernels running on the device.
fn loss_falls(b: &dyn Backend) {
    {
        let corpus = corpus();
        let entropy = corpus.unigram_entropy();
        let mut t = Trainer::new(b, &corpus, options(&corpus, Preset::MixedBf16, 11)).unwrap();
        for _ in 0..60 {
            t.step().block_on().unwrap();
        }
        let val = t.evaluate(2).block_on().unwrap();
        assert!(
            val < entropy - 0.2,
            "bf16-mixed on {}: validation loss {val:.3} after 60 steps, unigram entropy {entropy:.3}",
            b.name()
        );
    }
}

#[test]
fn an_inf_gradient_skips_the_step_and_halves_the_scale() {
    let corpus = corpus();
    let mut t = Trainer::new(&Reference, &corpus, options(&corpus, Preset::Mixed16, 5)).unwrap();
    t.step().block_on().unwrap();
    let (state, applied) = (t.state().block_on().unwrap(), t.run.applied);
    let scale = t.run.scaler.unwrap().scale;
    let r = t.step_injecting(f32::INFINITY).block_on().unwrap();
    assert!(r.skipped);
    assert_eq!(t.run.scaler.unwrap().scale, scale / 2.0);
    assert_eq!(
        (t.state().block_on().unwrap(), t.run.applied),
        (state.clone(), applied),
        "weights and optimizer state untouched"
    );
    let r = t.step().block_on().unwrap();
    assert!(!r.skipped);
    assert_ne!(t.state().block_on().unwrap().params, state.params);
}

#[test]
fn a_nan_without_loss_scaling_stops_with_the_step_and_a_suggestion() {
    let corpus = corpus();
    let mut t = Trainer::new(&Reference, &corpus, options(&corpus, Preset::True32, 5)).unwrap();
    let err = t
        .step_injecting(f32::NAN)
        .block_on()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("step 1") && err.contains("32-true") && err.contains("16-mixed"),
        "{err}"
    );
}

#[test]
fn fp8_delayed_scaling_records_amax_histories() {
    let corpus = corpus();
    let mut t = Trainer::new(
        &Reference,
        &corpus,
        options(&corpus, Preset::TransformerEngine, 5),
    )
    .unwrap();
    for _ in 0..3 {
        t.step().block_on().unwrap();
    }
    let Some(Fp8State { layers: states }) = &t.run.fp8 else {
        panic!("transformer-engine uses delayed scaling")
    };
    assert_eq!(states.len(), 4 * t.gpt.config.n_layer);
    for s in states {
        assert_eq!(
            (
                s.input.history.len(),
                s.weight.history.len(),
                s.grad.history.len()
            ),
            (3, 3, 3)
        );
        let amax = s.input.history.iter().copied().fold(0.0, f32::max);
        assert_eq!(s.input.scale, 448.0 / amax, "s = FMAX / max(history)");
        assert_eq!(s.grad.format, mantissa::Format::E5m2);
    }
}

#[test]
fn resuming_from_a_checkpoint_reproduces_the_run() {
    let corpus = corpus();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ck.safetensors");
    // GradScaler's state, and fp8 delayed scaling's amax histories and scales, travel too.
    for preset in [Preset::Mixed16, Preset::TransformerEngine] {
        let mut straight = Trainer::new(&Reference, &corpus, options(&corpus, preset, 9)).unwrap();
        let losses: Vec<f64> = (0..6)
            .map(|_| straight.step().block_on().unwrap().loss)
            .collect();
        let mut first = Trainer::new(&Reference, &corpus, options(&corpus, preset, 9)).unwrap();
        for _ in 0..3 {
            first.step().block_on().unwrap();
        }
        first.save(&path).block_on().unwrap();
        let mut resumed = Trainer::new(&Reference, &corpus, options(&corpus, preset, 9)).unwrap();
        Checkpoint::load(&path, &Expected::gpt(&resumed.gpt.config, &corpus.vocab))
            .unwrap()
            .restore(&mut resumed.run)
            .block_on()
            .unwrap();
        let rest: Vec<f64> = (0..3)
            .map(|_| resumed.step().block_on().unwrap().loss)
            .collect();
        assert_eq!(rest, losses[3..].to_vec(), "{preset}");
    }
}

#[test]
fn bad_checkpoints_are_refused() {
    let corpus = corpus();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ck.safetensors");
    let mut t = Trainer::new(&Reference, &corpus, options(&corpus, Preset::True32, 1)).unwrap();
    t.save(&path).block_on().unwrap();
    let config = t.gpt.config.clone();
    let full = std::fs::read(&path).unwrap();
    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &full[..full.len() / 2]).unwrap();
    let err = Checkpoint::load(&truncated, &Expected::gpt(&config, &corpus.vocab))
        .err()
        .expect("truncated")
        .to_string();
    assert!(err.contains("corrupt or truncated"), "{err}");
    let mut other = config.clone();
    other.n_embd = 32;
    let err = Checkpoint::load(&path, &Expected::gpt(&other, &corpus.vocab))
        .err()
        .expect("other config")
        .to_string();
    assert!(err.contains("config"), "{err}");
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"\x08\x00\x00\x00\x00\x00\x00\x00{}").unwrap();
    assert!(Checkpoint::load(&junk, &Expected::gpt(&config, &corpus.vocab)).is_err());
    let mut t2 = Trainer::new(&Reference, &corpus, options(&corpus, Preset::MixedBf16, 1)).unwrap();
    let err = Checkpoint::load(&path, &Expected::gpt(&config, &corpus.vocab))
        .unwrap()
        .restore(&mut t2.run)
        .block_on()
        .expect_err("other preset")
        .to_string();
    assert!(err.contains("32-true"), "{err}");
    // fp8 state that no run produces, or for another number of layers: refused, and the
    // trainer keeps its own weights.
    let mut te = Trainer::new(
        &Reference,
        &corpus,
        options(&corpus, Preset::TransformerEngine, 1),
    )
    .unwrap();
    te.step().block_on().unwrap();
    let fp8_path = dir.path().join("fp8.safetensors");
    te.save(&fp8_path).block_on().unwrap();
    let before = te.state().block_on().unwrap();
    let mut bad = Checkpoint::load(&fp8_path, &Expected::gpt(&config, &corpus.vocab)).unwrap();
    bad.meta.fp8.as_mut().expect("fp8 state saved")[0][1].scale = -1.0;
    bad.params[0][0] += 1.0;
    let err = bad
        .restore(&mut te.run)
        .block_on()
        .expect_err("bad fp8 scale")
        .to_string();
    assert!(err.contains("fp8 scale -1"), "{err}");
    let mut short = Checkpoint::load(&fp8_path, &Expected::gpt(&config, &corpus.vocab)).unwrap();
    short.meta.fp8.as_mut().unwrap().pop();
    let err = short
        .restore(&mut te.run)
        .block_on()
        .expect_err("fp8 layers")
        .to_string();
    assert!(err.contains("linear layers"), "{err}");
    assert_eq!(te.state().block_on().unwrap(), before, "nothing restored");
}

#[test]
fn checkpoints_with_corrupt_bytes_or_impossible_state_are_refused() {
    let corpus = corpus();
    let dir = tempfile::tempdir().unwrap();
    let mut t = Trainer::new(&Reference, &corpus, options(&corpus, Preset::Mixed16, 1)).unwrap();
    t.step().block_on().unwrap();
    let config = t.gpt.config.clone();
    let load = |path: &std::path::Path| {
        Checkpoint::load(path, &Expected::gpt(&config, &corpus.vocab))
            .err()
            .map(|e| e.to_string())
    };
    let path = dir.path().join("ck.safetensors");
    t.save(&path).block_on().unwrap();
    assert_eq!(load(&path), None, "a good checkpoint loads");
    // One flipped bit in the tensor bytes (they end the file): the checksum says so.
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 1 - common::seed("checkpoints_with_corrupt_bytes") as usize % 4096;
    bytes[at] ^= 0x10;
    let flipped = dir.path().join("flipped.safetensors");
    std::fs::write(&flipped, &bytes).unwrap();
    let err = load(&flipped).expect("a flipped bit is refused");
    assert!(err.contains("CRC-32"), "{err}");
    // Values no run writes, with a checksum that matches them: refused all the same. `save`
    // refuses to write non-finite ones (a run stops instead), so the file is made by hand.
    let good = t.state().block_on().unwrap();
    let meta = mantissa::train::checkpoint::CheckpointFile::open(&path)
        .unwrap()
        .meta;
    type Spoil = fn(&mut TrainState);
    let cases: [(&str, Spoil); 3] = [
        ("param.", |s| s.params[1][3] = f32::NAN),
        ("adam_m.", |s| s.adam_m[0][0] = f32::INFINITY),
        ("adam_v.", |s| s.adam_v[2][1] = -1.0),
    ];
    for (what, spoil) in cases {
        let mut state = good.clone();
        spoil(&mut state);
        let crc32 =
            mantissa::train::checkpoint::checksum(&state.params, &state.adam_m, &state.adam_v);
        let meta = mantissa::train::checkpoint::CheckpointMeta {
            crc32: Some(crc32),
            ..meta.clone()
        };
        let path = dir.path().join("spoilt.safetensors");
        std::fs::write(
            &path,
            Checkpoint::bytes(
                &meta,
                &Expected::gpt(&config, &Vocab::Chars(vec![])),
                &state,
            )
            .unwrap(),
        )
        .unwrap();
        let err = load(&path).unwrap_or_else(|| panic!("{what}: accepted"));
        assert!(err.contains(what), "{what}: {err}");
        // Nor does the trainer take such a state from its caller: refused, nothing written.
        let set = t.set_state(&state).block_on();
        assert!(set.is_err(), "{what}: set_state took it");
        assert!(
            t.state().block_on().unwrap() == good,
            "{what}: a refused state was written"
        );
    }
    t.set_state(&good).block_on().unwrap();
    for scale in [0.0, -2.0, f32::INFINITY] {
        t.run.scaler.as_mut().unwrap().scale = scale;
        let path = dir.path().join("scale.safetensors");
        t.save(&path).block_on().unwrap();
        // JSON has no inf: it is written as null, and refused when the run is resumed.
        let err = load(&path).or_else(|| {
            let ck = Checkpoint::load(&path, &Expected::gpt(&config, &corpus.vocab)).unwrap();
            ck.restore(&mut t.run)
                .block_on()
                .err()
                .map(|e| e.to_string())
        });
        let err = err.unwrap_or_else(|| panic!("loss scale {scale}: accepted"));
        assert!(err.contains("loss scale"), "{err}");
    }
}

/// The trainer refuses settings no step can use, at its start and before each step (the
/// options are public): a NaN learning rate made every weight NaN after a step that said it
/// applied, a NaN clip skipped the update silently; and `sample` refuses a count beyond its
/// bound and a prompt character outside the vocabulary.
#[test]
fn the_trainer_refuses_settings_no_step_can_use() {
    let corpus = corpus();
    let mut o = options(&corpus, Preset::True32, 1);
    o.adamw.lr = f32::NAN;
    let e = Trainer::new(&Reference, &corpus, o.clone())
        .err()
        .expect("refused");
    assert!(e.to_string().contains("learning rate NaN"), "{e}");
    o.adamw.lr = 1e-3;
    let mut t = Trainer::new(&Reference, &corpus, o).unwrap();
    t.options.grad_clip = f32::NAN;
    let e = t.step().block_on().unwrap_err();
    assert!(e.to_string().contains("grad_clip"), "{e}");
    assert_eq!(t.run.steps, 0, "nothing ran");
    let e = t.sample("Th", 1 << 30, 0.8, 1).block_on().unwrap_err();
    assert!(e.to_string().contains("at most"), "{e}");
    let e = t.sample("Th€", 4, 0.8, 1).block_on().unwrap_err();
    assert!(e.to_string().contains("'€'"), "{e}");
}

#[test]
fn corpus_errors_are_clear() {
    let err = Corpus::load(std::path::Path::new("/nonexistent/corpus.txt"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/corpus.txt"), "{err}");
    assert!(
        Corpus::from_text("")
            .unwrap_err()
            .to_string()
            .contains("too short")
    );
}

#[test]
fn plan_copies_are_the_head_permutations() {
    use mantissa::plan::Strided;
    let (b, t, h, d) = (2, 3, 2, 4);
    let n = b * t * h * d;
    let qkv = measure::normal(3 * n, 7);
    let heads = ops::split_heads(&qkv, b, t, h, d);
    let mut merged = vec![0.0; 3 * n];
    for (part, want) in heads.iter().enumerate() {
        let mut got = vec![0.0; n];
        Strided::split_head(part, b, t, h, d).apply(&qkv, &mut got);
        assert_eq!(&got, want, "split part {part}");
        Strided::merge_head(part, b, t, h, d).apply(&got, &mut merged);
    }
    assert_eq!(merged, qkv);
    let mut rows = vec![0.0; n];
    Strided::heads_to_rows(b, t, h, d).apply(&heads[0], &mut rows);
    assert_eq!(rows, ops::heads_to_rows(&heads[0], b, t, h, d));
    let mut back = vec![0.0; n];
    Strided::rows_to_heads(b, t, h, d).apply(&rows, &mut back);
    assert_eq!(back, heads[0]);
}

/// Largest |a - b| / max(|b|, floor) over two states.
fn state_gap(a: &[Vec<f32>], b: &[Vec<f32>], floor: f32) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs() / y.abs().max(floor))
        .fold(0.0, f32::max)
}

/// The device-resident plan (one submission per step, every op a kernel) against the host
/// interpreter, the reference's executor, running the same plan: per-step losses, gradients and
/// the weights and moments after the updates, under f32, both mixed presets, a "true" preset
/// and fp8 with delayed scaling, within what the device's arithmetic moves them.
fn resident_plan_matches_the_reference_executor(b: &dyn Backend) {
    {
        let corpus = corpus();
        for preset in [
            Preset::True32,
            Preset::MixedBf16,
            Preset::Mixed16,
            Preset::TrueBf16,
            Preset::TransformerEngine,
        ] {
            let mut o = options(&corpus, preset, 21);
            o.resident = true;
            let mut resident = Trainer::new(b, &corpus, o.clone()).unwrap();
            assert!(
                resident.executor().contains("device-resident"),
                "{}",
                resident.executor()
            );
            o.resident = false;
            let mut host = Trainer::new(b, &corpus, o).unwrap();
            steps_agree(&preset.to_string(), &mut resident, &mut host);
            let (sr, sh) = (
                resident.state().block_on().unwrap(),
                host.state().block_on().unwrap(),
            );
            // AdamW's first updates are about lr * sign(g): a gradient element near zero whose
            // sign rounds the other way moves its weight by 2 lr. Most weights must agree
            // closely, and none may be further apart than that.
            let diffs: Vec<f32> = sr
                .params
                .iter()
                .flatten()
                .zip(sh.params.iter().flatten())
                .map(|(x, y)| (x - y).abs())
                .collect();
            let lr = 1e-3f32;
            let max = diffs.iter().copied().fold(0.0, f32::max);
            let far = diffs.iter().filter(|&&d| d > lr / 10.0).count() as f64 / diffs.len() as f64;
            eprintln!(
                "{preset}: weights: max |diff| {max:e}, {:.3}% beyond lr/10",
                far * 100.0
            );
            assert!(
                max <= 6.0 * lr * 1.01,
                "{preset}: a weight moved {max} apart"
            );
            // fp8's steps are coarse: a gradient element the device's arithmetic moves across
            // an e5m2 rounding boundary changes by up to a quarter (its square by up to
            // (1 + 1/4)^2 - 1), and its later updates by more than lr/10 (the scales, from each
            // executor's own amaxes, differ too).
            let (most, v_gap) = match preset {
                Preset::TransformerEngine => (0.08, 0.6),
                _ => (0.02, 0.2),
            };
            assert!(
                far < most,
                "{preset}: {:.2}% of the weights differ by over lr/10",
                far * 100.0
            );
            let gap = state_gap(&sr.adam_v, &sh.adam_v, 1e-8);
            eprintln!("{preset}: second moments within {gap:.3}");
            assert!(gap < v_gap, "{preset}: second moments differ by {gap}");
            if let (Some(Fp8State { layers: a }), Some(Fp8State { layers: h })) =
                (&resident.run.fp8, &host.run.fp8)
            {
                for (a, h) in a.iter().zip(h) {
                    assert_eq!(a.input.history.len(), 3);
                    let rel = (a.grad.scale - h.grad.scale).abs() / h.grad.scale;
                    assert!(
                        rel < 0.2,
                        "fp8 gradient scales {} and {}",
                        a.grad.scale,
                        h.grad.scale
                    );
                }
            }
        }
    }
}

/// The device-resident plan's forward and backward passes are the plan's ops run one by one on
/// the same device, each alone in a plan of its own (the same kernels on the same stored
/// formats; the tensors' values carried between them on the host): the loss and every
/// gradient bit for bit, under bf16-mixed (coded tensors, folded adds) and transformer-engine
/// (fp8 with delayed scaling). What the resident plan adds to its ops (shared buffers, one
/// submission, operand planes in idle slots) changes no bit.
fn resident_plan_is_its_ops_one_by_one(b: &dyn Backend) {
    use mantissa::plan::{Op, Outline, PlanBuilder, TensorKind, scalar::StepScalars};
    let corpus = corpus();
    for preset in [Preset::MixedBf16, Preset::TransformerEngine] {
        let t = Trainer::new(b, &corpus, options(&corpus, preset, 29)).unwrap();
        let plan = t.plan().clone();
        let cfg = &t.gpt.config;
        let (ids, targets) = corpus
            .batch(false, cfg.batch_size, cfg.block_size, 29, 0)
            .unwrap();
        let scalars = StepScalars {
            adamw: &mantissa::plan::AdamW::default(),
            clip: 1.0,
            loss_scale: 1.0,
            poison: 0.0,
            t: 1,
            parts: 1,
            part: 0,
            fp8: &t.fp8_scales(),
            eval: false,
        }
        .array(plan.rows(), plan.scalar_count());
        let mut resident = mantissa::backend::executor(b, plan.clone(), true).unwrap();
        let stats = resident
            .run(Section::Backward, &ids, &targets, &scalars)
            .block_on()
            .unwrap();
        // The tensors' values between the ops: the plan's constants, zeros elsewhere.
        let mut values: Vec<Vec<f32>> = plan.tensors().iter().map(|t| vec![0.0; t.len]).collect();
        for (id, v) in plan.constants() {
            values[*id] = v.clone();
        }
        let mut loss = None;
        for op in plan.ops_of(Section::Backward) {
            let (reads, writes) = op.reads_writes();
            let mut g = PlanBuilder::default();
            let rows = plan.rows();
            let batch = (
                g.tensor(rows, TensorKind::Tokens),
                g.tensor(rows, TensorKind::Targets),
            );
            // Each tensor the op names, in a plan of its own: the batch as the batch, a
            // constant (the positions) as a constant, the rest kept whole and written first.
            let mut of = std::collections::HashMap::new();
            let mut written = vec![];
            for id in reads.iter().chain(&writes).copied() {
                if of.contains_key(&id) {
                    continue;
                }
                let info = &plan.tensors()[id];
                let new = if id == plan.tokens() {
                    batch.0
                } else if id == plan.targets() {
                    batch.1
                } else if info.kind == TensorKind::Constant && !writes.contains(&id) {
                    g.constant(values[id].clone())
                } else {
                    let new = g.tensor(info.len, TensorKind::Partial);
                    g.tensors[new].stored = info.stored;
                    written.push((new, id));
                    new
                };
                of.insert(id, new);
            }
            g.ops.push(op.map_tensors(|id| of[&id]));
            let mut outline = Outline::ops_alone(1, 1, batch, batch.0);
            outline.stats = plan.stats();
            let alone = g.finish(outline).unwrap();
            let mut exec = mantissa::backend::executor(b, alone, true).unwrap();
            for &(new, id) in &written {
                exec.write(new, &values[id]).block_on().unwrap();
            }
            let stats = exec
                .run(Section::Step, &ids, &targets, &scalars)
                .block_on()
                .unwrap();
            for id in writes {
                values[id] = exec.read(of[&id]).block_on().unwrap();
            }
            if let Op::CrossEntropy { .. } = op {
                loss = Some(stats[mantissa::plan::Stats::LOSS]);
            }
        }
        let loss = loss.expect("a cross entropy");
        assert_eq!(
            stats[mantissa::plan::Stats::LOSS].to_bits(),
            loss.to_bits(),
            "{preset}: the loss {} resident, {loss} op by op",
            stats[mantissa::plan::Stats::LOSS]
        );
        for (i, &[_, grad, _, _]) in plan.state().iter().enumerate() {
            let got = resident.read(grad).block_on().unwrap();
            assert!(
                common::same_bits(&got, &values[grad]),
                "{preset}: gradient {i} differs from the ops' one by one"
            );
        }
    }
}

/// Three steps of a device trainer and a host one that agree up to the device's arithmetic:
/// each step's loss within 1e-3 and gradient norm within 2e-2 relative, the same skips; then
/// the gradients within 5e-2 of the largest (returned: how far apart they are).
fn steps_agree(what: &str, device: &mut Trainer, host: &mut Trainer) -> f32 {
    for step in 0..3 {
        let (r, h) = (
            device.step().block_on().unwrap(),
            host.step().block_on().unwrap(),
        );
        assert!(
            (r.loss - h.loss).abs() < 1e-3 * h.loss,
            "{what} step {step}: loss {} on the device, {} on the host",
            r.loss,
            h.loss
        );
        assert!(
            (r.grad_norm - h.grad_norm).abs() < 2e-2 * h.grad_norm,
            "{what} step {step}: gradient norm {} on the device, {} on the host",
            r.grad_norm,
            h.grad_norm
        );
        assert_eq!(
            (r.skipped, device.run.applied),
            (h.skipped, host.run.applied)
        );
    }
    let (gd, gh) = (
        device.gradients().block_on().unwrap(),
        host.gradients().block_on().unwrap(),
    );
    let scale = gh.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    let gap = state_gap(&gd, &gh, scale);
    assert!(
        gap < 5e-2,
        "{what}: gradients differ by {gap} of the largest"
    );
    gap
}

/// A resident plan is on the device once prepared, before any step: the peak the executor
/// reports covers the plan's tensors; and after two steps, the step has allocated little
/// beyond them (at most 1.15x: the matmuls' operand planes go into slots idle during them
/// where they fit; since the loss's gradient is stored as codes, the plan is smaller and the
/// head's planes find no idle slot as large: the same peak over a smaller plan, 1.08-1.11x).
/// On a wgpu device of its own, since the allocator reports a whole device, and the other
/// tests of this file allocate and free on the shared one at the same time.
#[test]
fn resident_plan_holds_its_tensors_once_prepared() {
    let test = "resident_plan_holds_its_tensors_once_prepared";
    let Some(b) = common::fresh_wgpu(test, mantissa::backend::wgpu::WgpuOptions::default()) else {
        return;
    };
    let corpus = corpus();
    for preset in [Preset::Mixed16, Preset::MixedBf16, Preset::True32] {
        let mut t = Trainer::new(&b, &corpus, options(&corpus, preset, 5)).unwrap();
        t.prepare().block_on().unwrap();
        let memory = t.memory();
        assert!(
            memory.peak_bytes >= memory.plan_bytes,
            "{preset} prepared: {memory:?}"
        );
        for _ in 0..2 {
            t.step().block_on().unwrap();
        }
        let memory = t.memory();
        let ratio = memory.peak_bytes as f64 / memory.plan_bytes as f64;
        eprintln!("{preset}: peak {ratio:.3}x the plan ({memory:?})");
        assert!(ratio <= 1.15, "{preset} after two steps: {memory:?}");
    }
}

/// GradScaler's skip on the device: an inf injected into a scaled gradient leaves the resident
/// weights and moments bit for bit as they were and halves the scale; a checkpoint read back
/// from the device resumes the run exactly.
fn resident_plan_skips_non_finite_steps_and_resumes(b: &dyn Backend) {
    {
        let corpus = corpus();
        let mut t = Trainer::new(b, &corpus, options(&corpus, Preset::Mixed16, 5)).unwrap();
        // The plan is on the device before any step (so a plan too large fails here; its
        // memory is checked in `resident_plan_holds_its_tensors_once_prepared`).
        t.prepare().block_on().unwrap();
        t.step().block_on().unwrap();
        let (state, applied) = (t.state().block_on().unwrap(), t.run.applied);
        let scale = t.run.scaler.unwrap().scale;
        let r = t.step_injecting(f32::INFINITY).block_on().unwrap();
        assert!(r.skipped);
        assert_eq!(t.run.scaler.unwrap().scale, scale / 2.0);
        assert_eq!(
            (t.state().block_on().unwrap(), t.run.applied),
            (state, applied),
            "weights and optimizer state untouched on the device"
        );

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ck.safetensors");
        t.save(&path).block_on().unwrap();
        let straight: Vec<f64> = (0..2).map(|_| t.step().block_on().unwrap().loss).collect();
        let mut resumed = Trainer::new(b, &corpus, options(&corpus, Preset::Mixed16, 5)).unwrap();
        Checkpoint::load(&path, &Expected::gpt(&resumed.gpt.config, &corpus.vocab))
            .unwrap()
            .restore(&mut resumed.run)
            .block_on()
            .unwrap();
        let rest: Vec<f64> = (0..2)
            .map(|_| resumed.step().block_on().unwrap().loss)
            .collect();
        assert_eq!(rest, straight);
    }
}

/// A step with every op timed (`mantissa bench train --profile`) is the same step: the same
/// loss and gradient norm, and the same weights and moments after, bit for bit; its timings
/// cover every op of the plan, each finite and not negative, and the executor counts each op's
/// launches.
fn a_timed_step_is_the_step(b: &dyn Backend) {
    let corpus = corpus();
    let mut plain = Trainer::new(b, &corpus, options(&corpus, Preset::MixedBf16, 7)).unwrap();
    let mut timed = Trainer::new(b, &corpus, options(&corpus, Preset::MixedBf16, 7)).unwrap();
    for step in 0..2 {
        let r = plain.step().block_on().unwrap();
        let (t, timings) = timed.step_timed().block_on().unwrap();
        assert_eq!(
            (r.loss.to_bits(), r.grad_norm.to_bits()),
            (t.loss.to_bits(), t.grad_norm.to_bits()),
            "step {step}: loss {} and {}",
            r.loss,
            t.loss
        );
        let timings = timings.expect("a single-device step is timed");
        assert_eq!(
            (timings.first, timings.seconds.len()),
            (0, timed.plan().ops().len())
        );
        assert!(
            timings.seconds.iter().all(|s| s.is_finite() && *s >= 0.0),
            "{timings:?}"
        );
        assert!(timings.seconds.iter().sum::<f64>() > 0.0, "{timings:?}");
        // A device executor launches every op of the step at least once, but for a bias add
        // that runs in the store of the matmul before it (wgpu's epilogues: an add of that
        // matmul's product, in place or into codes) and a bias gradient that the weight gradient's matmul
        // after it sums (the column sums of its B); the host's launches nothing.
        match timed.launches() {
            None => assert_eq!(b.kind(), BackendKind::Reference, "launches not counted"),
            Some(launches) => {
                let ops = timed.plan().ops();
                assert_eq!(launches.len(), ops.len());
                let folded = |i: usize| match (i.checked_sub(1).map(|p| &ops[p]), &ops[i]) {
                    (Some(Op::Matmul { out, .. }), Op::Add { y, .. }) => y == out,
                    _ => matches!(
                        (&ops[i], ops.get(i + 1)),
                        (Op::ColumnSums { x, .. }, Some(Op::Matmul { b, .. })) if b == x
                    ),
                };
                let idle: Vec<_> = (launches.iter().enumerate())
                    .filter(|&(i, &n)| n == 0 && !folded(i))
                    .collect();
                assert!(idle.is_empty(), "ops that launched nothing: {idle:?}");
            }
        }
    }
    assert!(
        plain.state().block_on().unwrap() == timed.state().block_on().unwrap(),
        "the weights after timed steps differ"
    );
}

/// The matmuls' 16-bit inputs, the pre-GELU activations and fused attention's q|k|v stored as
/// codes (`Plan::store_codes`: the layer norms', GELUs' and fused attention's outputs, the
/// bias adds before GELU and attention, and the cross entropy's gradient where the vocabulary
/// is even, under the 16-bit presets) train bit for bit as the same plan stored
/// in f32: losses, gradient norms, weights and moments, while the plan's tensors take fewer
/// bytes. Under 32-true no tensor is coded; under transformer-engine the fp8 linears' inputs
/// are not (their amax is taken from f32), the final norm's output, read by the bf16 head, and
/// the pre-GELU activations are. Attention unfused under every preset, fused under the mixed
/// ones.
fn coded_activations_train_as_f32_storage(b: &dyn Backend) {
    use mantissa::plan::Storage;
    let corpus = corpus();
    // bf16-mixed unfused and two of the others drawn by the seed (each a plan's kernels to
    // compile on lavapipe; all with MANTISSA_TEST_EXHAUSTIVE=1).
    let others = [
        (Preset::MixedBf16, true),
        (Preset::Mixed16, false),
        (Preset::Mixed16, true),
        (Preset::TrueBf16, false),
        (Preset::True32, false),
        (Preset::TransformerEngine, false),
    ];
    let seed = common::seed("coded_activations_train_as_f32_storage");
    let drawn = common::sample(&others, 2, seed);
    for (preset, fused) in [(Preset::MixedBf16, false)].into_iter().chain(drawn) {
        let trainer = |coded: bool| {
            let mut o = options(&corpus, preset, 41);
            o.coded_activations = Some(coded);
            o.fused_attention = Some(fused);
            Trainer::new(b, &corpus, o).unwrap()
        };
        let (mut coded, mut plain) = (trainer(true), trainer(false));
        let layers = coded.gpt.config.n_layer;
        // The cross entropy's gradient, read by the bf16 head, where the vocabulary is even.
        let loss = usize::from(coded.gpt.config.vocab_size.is_multiple_of(2));
        let want = match preset {
            Preset::True32 => 0,
            // The final norm; each block's pre-GELU activations (the fc linear's bias add holds
            // bf16 under fp8 too).
            Preset::TransformerEngine => 1 + layers + loss,
            // Both norms, the pre-GELU activations and the GELU of each block, the final
            // norm; with attention fused, its q|k|v and its output.
            _ => 4 * layers + 1 + if fused { 2 * layers } else { 0 } + loss,
        };
        let preset = format!("{preset} (attention fused: {fused})");
        assert_eq!(
            (coded.coded_tensors(), plain.coded_tensors()),
            (want, 0),
            "{preset}"
        );
        let bytes = [&coded, &plain].map(|t| Storage::shared(t.plan()).bytes());
        if want > 0 {
            assert!(bytes[0] < bytes[1], "{preset}: coded {bytes:?} f32");
        }
        for step in 0..3 {
            let (c, p) = (
                coded.step().block_on().unwrap(),
                plain.step().block_on().unwrap(),
            );
            assert_eq!(
                (c.loss.to_bits(), c.grad_norm.to_bits(), c.skipped),
                (p.loss.to_bits(), p.grad_norm.to_bits(), p.skipped),
                "{preset} step {step}: losses {} and {}",
                c.loss,
                p.loss
            );
        }
        assert!(
            coded.state().block_on().unwrap() == plain.state().block_on().unwrap(),
            "{preset}: the weights or moments differ"
        );
    }
}

/// The buckets of a data-parallel step's gradient sum (`Plan::gradient_buckets`) on the tiny
/// GPT's rank plan: each tensor once, in buckets no larger than asked (but for a tensor larger
/// than that, alone), ready in order, and no op of the backward pass after a bucket's `ready`
/// reads or writes any of its tensors.
#[test]
fn gradient_buckets_hold_what_the_backward_pass_is_done_with() {
    use mantissa::dist::{Reducer, Reduction};
    let corpus = corpus();
    for preset in [Preset::True32, Preset::MixedBf16] {
        let reduction = Reduction {
            reducer: Reducer::Mpi,
            ..Reduction::default()
        };
        let t = Trainer::data_parallel(
            &Reference,
            &corpus,
            options(&corpus, preset, 3),
            &common::Twins,
            reduction,
        )
        .unwrap();
        let plan = t.plan();
        let summed: Vec<usize> = plan.state().iter().map(|s| s[1]).collect();
        for elements in [1, 1000, 5000, 1 << 30] {
            let buckets = plan.gradient_buckets(&summed, elements).unwrap();
            let mut seen: Vec<usize> = buckets.iter().flat_map(|b| b.ids.clone()).collect();
            seen.sort_unstable();
            let mut want = summed.clone();
            want.sort_unstable();
            assert_eq!(seen, want, "{preset}, buckets of {elements}");
            assert!(buckets.windows(2).all(|w| w[0].ready <= w[1].ready));
            for b in &buckets {
                let size: usize = b.ids.iter().map(|&id| plan.tensors()[id].len).sum();
                assert!(size <= elements || b.ids.len() == 1, "{preset}: {b:?}");
                for op in &plan.ops()[b.ready..plan.range_of(Section::Backward).end] {
                    let (reads, writes) = op.reads_writes();
                    assert!(
                        !b.ids
                            .iter()
                            .any(|id| reads.contains(id) || writes.contains(id)),
                        "{preset}: {} touches a tensor of {b:?}",
                        op.name()
                    );
                }
            }
            if elements == 1 << 30 {
                assert_eq!(buckets.len(), 1);
            } else {
                assert!(
                    buckets.len() > 2,
                    "{preset}, {elements}: {} buckets",
                    buckets.len()
                );
            }
        }
    }
}

/// The slots `Storage::idle_slots` lends an op (wgpu puts a matmul's operand planes there) hold
/// only step temporaries that the op neither reads nor writes and that are not live across it
/// (first touched after it, or last touched before it), on the tiny GPT's plans; and most ops
/// are offered some.
#[test]
fn idle_slots_hold_nothing_live() {
    use mantissa::plan::{Storage, TensorKind};
    let corpus = corpus();
    for preset in [Preset::True32, Preset::MixedBf16] {
        let t = Trainer::new(&Reference, &corpus, options(&corpus, preset, 3)).unwrap();
        let plan = t.plan();
        let storage = Storage::shared(plan);
        let mut touched: Vec<Vec<usize>> = vec![vec![]; plan.tensors().len()];
        for (i, op) in plan.ops().iter().enumerate() {
            let (reads, writes) = op.reads_writes();
            for t in reads.into_iter().chain(writes) {
                touched[t].push(i);
            }
        }
        let idle = storage.idle_slots(plan);
        assert_eq!(idle.len(), plan.ops().len());
        for (i, slots) in idle.iter().enumerate() {
            for &s in slots {
                for t in (0..plan.tensors().len()).filter(|&t| storage.slot_of[t] == s) {
                    let kind = plan.tensors()[t].kind;
                    assert!(
                        kind == TensorKind::Temp && t != plan.logits(),
                        "{preset}: op {i} is lent slot {s} of tensor {t} ({kind:?})"
                    );
                    let first = touched[t].iter().min().unwrap();
                    let last = touched[t].iter().max().unwrap();
                    assert!(
                        i < *first || *last < i,
                        "{preset}: op {i} ({}) is lent slot {s}, whose tensor {t} is used by ops \
                         {first} to {last}",
                        plan.ops()[i].name()
                    );
                }
            }
        }
        let offered = idle.iter().filter(|slots| !slots.is_empty()).count();
        assert!(
            offered * 2 > plan.ops().len(),
            "{preset}: {offered} of {} ops",
            plan.ops().len()
        );
    }
}

/// A data-parallel step whose buckets are summed as soon as the backward pass is done with
/// them (on wgpu and CUDA, while the device runs on) trains bit for bit as one that sums after the
/// pass: losses, gradient norms, an injected inf's skip (16-mixed), weights and moments, over buckets of
/// 4 KiB (a dozen and more per step) and of 16 MiB (one).
fn overlapped_reduction_is_the_reduction_after_the_pass(b: &dyn Backend) {
    use mantissa::dist::{Reducer, Reduction};
    let corpus = corpus();
    for (preset, bucket_bytes) in [
        (Preset::MixedBf16, 4096),
        (Preset::Mixed16, 4096),
        (Preset::True32, Reduction::DEFAULT_BUCKET_BYTES),
    ] {
        let trainer = |overlap: bool| {
            let reduction = Reduction {
                reducer: Reducer::Mpi,
                bucket_bytes,
                overlap,
            };
            Trainer::data_parallel(
                b,
                &corpus,
                options(&corpus, preset, 17),
                &common::Twins,
                reduction,
            )
            .unwrap()
        };
        let (mut early, mut late) = (trainer(true), trainer(false));
        // GradScaler's skip (16-mixed alone scales the loss; the others stop on an inf).
        let skip_at = (preset == Preset::Mixed16).then_some(2);
        for step in 0..4 {
            let poison = if skip_at == Some(step) {
                f32::INFINITY
            } else {
                0.0
            };
            let (e, l) = (
                early.step_injecting(poison).block_on().unwrap(),
                late.step_injecting(poison).block_on().unwrap(),
            );
            assert_eq!(
                (e.loss.to_bits(), e.grad_norm.to_bits(), e.skipped),
                (l.loss.to_bits(), l.grad_norm.to_bits(), l.skipped),
                "{preset} step {step}: losses {} and {}",
                e.loss,
                l.loss
            );
            assert_eq!(e.skipped, skip_at == Some(step), "{preset} step {step}");
        }
        let (re, rl) = (
            early.run.reduced.clone().unwrap(),
            late.run.reduced.clone().unwrap(),
        );
        // The same buckets (`--bucket-size`) either way, summed during or after the pass.
        assert_eq!((re.bytes, re.calls), (rl.bytes, rl.calls), "{preset}");
        if bucket_bytes == 4096 {
            assert!(re.calls > 10, "{preset}: {re:?}");
        }
        assert!(!rl.overlapped, "{preset}: {rl:?}");
        // Every device executor overlaps (wgpu's staging buffers, CUDA's page-locked ones);
        // the host interpreter's device is the host.
        assert_eq!(re.overlapped, b.name() != "reference", "{preset}: {re:?}");
        assert!(
            early.state().block_on().unwrap() == late.state().block_on().unwrap(),
            "{preset}: the weights or moments differ"
        );
    }
}

/// NCCL on one rank (a sum that changes nothing, through every call a world of eight makes):
/// its buckets launched on NCCL's stream while the backward pass runs on train bit for bit as
/// one sum after the pass, and the record says which was which. Needs a CUDA device and
/// libnccl.so.2 (`scripts/gpu-checks.sh dist`).
#[test]
fn nccl_overlapped_sums_are_the_sums_after_the_pass() {
    use mantissa::dist::{Reducer, Reduction, Single};
    let test = "nccl_overlapped_sums_are_the_sums_after_the_pass";
    let b = match common::cuda() {
        Ok(b) => b.as_ref(),
        Err(why) => return common::skip(test, &format!("backend absent: {why}")),
    };
    if let Err(why) = mantissa::backend::cuda::nccl::version() {
        return common::skip(test, &why.to_string());
    }
    let corpus = corpus();
    let trainer = |overlap: bool| {
        let reduction = Reduction {
            reducer: Reducer::Nccl,
            bucket_bytes: 4096,
            overlap,
        };
        let o = options(&corpus, Preset::MixedBf16, 23);
        Trainer::data_parallel(b, &corpus, o, &Single, reduction).unwrap()
    };
    let (mut early, mut late) = (trainer(true), trainer(false));
    for step in 0..4 {
        let (e, l) = (
            early.step().block_on().unwrap(),
            late.step().block_on().unwrap(),
        );
        assert_eq!(
            (e.loss.to_bits(), e.grad_norm.to_bits()),
            (l.loss.to_bits(), l.grad_norm.to_bits()),
            "step {step}"
        );
    }
    let (re, rl) = (
        early.run.reduced.clone().unwrap(),
        late.run.reduced.clone().unwrap(),
    );
    assert!(
        re.engine.starts_with("NCCL") && re.overlapped && re.calls > 10,
        "{re:?}"
    );
    assert!(rl.engine.starts_with("NCCL") && !rl.overlapped, "{rl:?}");
    assert!(early.state().block_on().unwrap() == late.state().block_on().unwrap());
}

#[test]
fn overlapped_reduction_is_the_reduction_after_the_pass_on_the_reference() {
    overlapped_reduction_is_the_reduction_after_the_pass(&Reference);
}

#[test]
fn coded_activations_train_as_f32_storage_on_the_reference() {
    coded_activations_train_as_f32_storage(&Reference);
}

#[test]
fn a_timed_step_is_the_step_on_the_reference() {
    a_timed_step_is_the_step(&Reference);
}

/// The host interpreter's model of CUDA graphs (`plan::graph`, `TrainOptions::graphs`): each
/// section recorded at its second run and replayed from then on, a launch's host arguments
/// frozen at the recording, the step's scalars read where the ops read them. Training with
/// recordings gives the bits of training without them through steps whose scalars change:
/// AdamW's bias corrections every step, an injected fault the recording must not keep or miss,
/// and 16-mixed's loss scale halved after it. Delayed fp8 scaling, whose matmuls take each
/// step's scales as launch arguments, is not recorded.
#[test]
fn recorded_steps_train_as_launched_ones_on_the_reference() {
    let corpus = corpus();
    for preset in [
        Preset::True32,
        Preset::Mixed16,
        Preset::MixedBf16,
        Preset::TransformerEngine,
    ] {
        let trainer = |graphs: bool| {
            let mut o = options(&corpus, preset, 31);
            o.graphs = Some(graphs);
            Trainer::new(&Reference, &corpus, o).unwrap()
        };
        let (mut recorded, mut launched) = (trainer(true), trainer(false));
        let replays = recorded.executor().contains("replayed as a recording");
        assert_eq!(
            replays,
            preset != Preset::TransformerEngine,
            "{preset}: {}",
            recorded.executor()
        );
        for step in 0..6 {
            // A fault where the loss is scaled (without, a non-finite step is an error).
            let fault = step == 3 && preset == Preset::Mixed16;
            let run = |t: &mut Trainer| match fault {
                true => t.step_injecting(f32::INFINITY).block_on().unwrap(),
                false => t.step().block_on().unwrap(),
            };
            let (r, l) = (run(&mut recorded), run(&mut launched));
            assert_eq!(r.loss.to_bits(), l.loss.to_bits(), "{preset} step {step}");
            assert_eq!(r.grad_norm.to_bits(), l.grad_norm.to_bits(), "{preset}");
            assert_eq!((r.skipped, l.skipped), (fault, fault), "{preset}");
        }
        let (a, b) = (
            recorded.state().block_on().unwrap(),
            launched.state().block_on().unwrap(),
        );
        assert!(a == b, "{preset}: the weights and moments after differ");
    }
}

/// `auto` attention (`Trainer::choose`) trains as the way it chose, named: the same losses,
/// gradient norms, weights and moments, bit for bit, whichever way won. Timed by the wall clock
/// (either may win), and by a clock under which every run takes as long (the tie goes to the
/// first, fused, which neither the reference nor wgpu prefers: the trainer swaps its plan and
/// carries over the weights it was given). The weights are given before the choice, as
/// `--init` does.
fn auto_attention_trains_as_the_chosen_way_named(b: &dyn Backend) {
    use mantissa::tune::AutotuneMode;
    let corpus = corpus();
    let ticks = || {
        let n = std::sync::atomic::AtomicU64::new(0);
        Box::new(move || n.fetch_add(1, std::sync::atomic::Ordering::Relaxed) as f64)
            as Box<dyn Fn() -> f64 + Send + Sync>
    };
    for (preset, clock) in [
        (Preset::MixedBf16, choice::wall_clock()),
        (Preset::True32, ticks()),
    ] {
        let mut chooser = Chooser::new(AutotuneMode::Fast, None, clock);
        (chooser.warmup, chooser.runs) = (1, 3);
        let given = options(&corpus, preset, 5).config.init(99).unwrap();
        let trainer = |fused: Option<bool>| {
            let mut o = options(&corpus, preset, 5);
            o.fused_attention = fused;
            let mut t = Trainer::new(b, &corpus, o).unwrap();
            t.set_weights(&given).block_on().unwrap();
            t
        };
        let mut auto = trainer(None);
        let choice = auto.choose(&chooser).block_on().unwrap().clone();
        assert_eq!(choice.by, ChosenBy::Timed, "{preset}: {choice}");
        assert!(
            choice.candidates.iter().all(|c| c.seconds.is_some()),
            "{preset}: both ways run here: {choice}"
        );
        let fused = choice.chosen == "fused";
        assert_eq!(auto.fused_attention(), fused, "{preset}: {choice}");
        let mut named = trainer(Some(fused));
        for step in 0..3 {
            let (a, n) = (
                auto.step().block_on().unwrap(),
                named.step().block_on().unwrap(),
            );
            assert_eq!(
                (a.loss.to_bits(), a.grad_norm.to_bits()),
                (n.loss.to_bits(), n.grad_norm.to_bits()),
                "{preset} step {step} ({choice}): loss {} and {}",
                a.loss,
                n.loss
            );
        }
        let (a, n) = (
            auto.state().block_on().unwrap(),
            named.state().block_on().unwrap(),
        );
        assert!(
            a == n,
            "{preset} ({choice}): the weights and moments after differ"
        );
    }
}

#[test]
fn auto_attention_trains_as_the_chosen_way_named_on_the_reference() {
    auto_attention_trains_as_the_chosen_way_named(&Reference);
}

/// `--graphs auto`: where the executor records its sections (the host interpreter here, CUDA),
/// both ways are timed and the run trains bit for bit as with the choice named; where it does
/// not (wgpu), the step runs op by op and the choice says why, nothing timed.
fn auto_graphs_train_as_the_choice_named(b: &dyn Backend) {
    use mantissa::tune::AutotuneMode;
    let corpus = corpus();
    let mut chooser = Chooser::new(AutotuneMode::Fast, None, choice::wall_clock());
    (chooser.warmup, chooser.runs) = (1, 3);
    let trainer = |graphs: Option<bool>| {
        let mut o = options(&corpus, Preset::MixedBf16, 5);
        (o.fused_attention, o.graphs) = (Some(false), graphs);
        Trainer::new(b, &corpus, o).unwrap()
    };
    let mut auto = trainer(None);
    auto.choose(&chooser).block_on().unwrap();
    let choice = auto.run.graphs.clone();
    if b.kind() == BackendKind::Wgpu {
        assert_eq!(
            (choice.by, choice.chosen.as_str()),
            (ChosenBy::Default, "off")
        );
        let on = &choice.candidates[0];
        assert!(
            on.dropped
                .as_deref()
                .is_some_and(|why| why.contains("record")),
            "{choice}"
        );
        return;
    }
    assert_eq!(choice.by, ChosenBy::Timed, "{choice}");
    assert!(
        choice.candidates.iter().all(|c| c.seconds.is_some()),
        "both ways run here: {choice}"
    );
    let mut named = trainer(Some(choice.chosen == "on"));
    for step in 0..3 {
        let (a, n) = (
            auto.step().block_on().unwrap(),
            named.step().block_on().unwrap(),
        );
        assert_eq!(
            (a.loss.to_bits(), a.grad_norm.to_bits()),
            (n.loss.to_bits(), n.grad_norm.to_bits()),
            "step {step} ({choice})"
        );
    }
    assert!(
        auto.state().block_on().unwrap() == named.state().block_on().unwrap(),
        "{choice}: the weights and moments after differ"
    );
}

#[test]
fn auto_graphs_train_as_the_choice_named_on_the_reference() {
    auto_graphs_train_as_the_choice_named(&Reference);
}

// The device backends' training tests (the reference runs the tests above, and is what the
// resident plans are compared with).
// `loss_falls` is not among wgpu's: 60 steps on lavapipe take a minute, and
// `matches_pytorch_step_for_step` follows PyTorch's falling losses there step by step.
backend_tests!(
    wgpu: losses_are_the_recorded_ones,
    overlapped_reduction_is_the_reduction_after_the_pass,
    a_timed_step_is_the_step,
    auto_attention_trains_as_the_chosen_way_named,
    auto_graphs_train_as_the_choice_named,
    fused_cross_entropy_is_the_loss_and_its_gradient,
    coded_outputs_are_the_held_values,
    coded_activations_train_as_f32_storage,
    held_outputs_match_their_definition,
    resident_plan_matches_the_reference_executor,
    resident_plan_is_its_ops_one_by_one,
    resident_plan_skips_non_finite_steps_and_resumes,
    resident_fused_attention_matches_its_definition,
    fused_attention_ops_match_their_definition,
    matches_pytorch_step_for_step
);
backend_tests!(
    cuda: loss_falls,
    overlapped_reduction_is_the_reduction_after_the_pass,
    a_timed_step_is_the_step,
    auto_attention_trains_as_the_chosen_way_named,
    auto_graphs_train_as_the_choice_named,
    fused_cross_entropy_is_the_loss_and_its_gradient,
    coded_outputs_are_the_held_values,
    coded_activations_train_as_f32_storage,
    held_outputs_match_their_definition,
    resident_plan_matches_the_reference_executor,
    resident_plan_is_its_ops_one_by_one,
    resident_plan_skips_non_finite_steps_and_resumes,
    resident_fused_attention_matches_its_definition,
    fused_attention_ops_match_their_definition,
    matches_pytorch_step_for_step
);

/// A device's fused attention kernels (wgpu: shaders/attention.wgsl, CUDA: cuda/attention.cu) in a
/// plan of their two ops alone, run by its resident executor: the output, each row's (max, sum),
/// dqkv and each row's sum(P * dP) read back against the op's definition (`ops::attention_fwd`,
/// `attention_bwd`), under the formats of 32-true, bf16-mixed and 16-true, on heads that do not
/// fill a workgroup.
fn fused_attention_ops_match_their_definition(b: &dyn Backend) {
    use mantissa::algorithm::Algorithm;
    use mantissa::format::Format;
    use mantissa::plan::{Attention, Op, PlanBuilder, TensorKind};
    let seed = common::seed("fused_attention_ops_match_their_definition");
    let (f32_, bf16, f16) = (Format::F32, Format::Bf16, Format::F16);
    // The last case, tiny's bf16-mixed attention, has integer scores: its row maxes are the
    // definition's to the bit, which the scaled scores' rounding to bf16 decides.
    let cases = [
        (2, 37, 3, 16, Algorithm::F32, f32_, f32_),
        (1, 70, 2, 32, Algorithm::Bf16, f32_, bf16),
        (1, 45, 1, 64, Algorithm::F16, f16, f16),
        (2, 32, 2, 32, Algorithm::Bf16, f32_, bf16),
        // Heads that leave a tiled kernel's lanes part of a pair, or none (d = 9, 20), and a
        // context of several blocks and tiles of rows, none whole.
        (1, 83, 2, 20, Algorithm::F32, f32_, f32_),
        (2, 19, 3, 9, Algorithm::Bf16, f32_, bf16),
        // f16 heads of whole 8 x 8 and 16 x 16 tiles: on cooperative matrices where the device
        // has them (attention_coop.wgsl: Mesa 26's lavapipe in CI), blocks and tiles not whole.
        (2, 50, 2, 16, Algorithm::F16, f16, f16),
        (1, 37, 2, 32, Algorithm::F16, f32_, f16),
    ];
    let fused = b.capabilities().fused_attention;
    for (case, &(sequences, t, h, d, algorithm, probs, compute)) in cases.iter().enumerate() {
        // Heads the backend fuses no kernel for (CUDA's are 16, 32 and 64) are refused when
        // the plan runs; a model records the unfused ops for them instead.
        if !fused.head_sizes.is_empty() && !fused.head_sizes.contains(&d) {
            eprintln!(
                "case {case}: head size {d} is not among {:?}: not run",
                fused.head_sizes
            );
            continue;
        }
        let exact = case == 3;
        let spec = Attention {
            b: sequences,
            t,
            h,
            d,
            scale: 1.0 / (d as f64).sqrt(),
            algorithm,
            probs,
            compute,
        };
        let s = seed + 10 * case as u64;
        let (qkv_values, dout_values) = (
            match exact {
                true => common::integer_scores_qkv(&spec, s),
                false => measure::normal(spec.qkv_len(), s),
            },
            measure::normal(spec.out_len(), s + 1),
        );
        let mut g = PlanBuilder::default();
        let tokens = g.tensor(sequences * t, TensorKind::Tokens);
        let targets = g.tensor(sequences * t, TensorKind::Targets);
        let qkv = g.constant(qkv_values.clone());
        let dout = g.constant(dout_values.clone());
        let (out, stats) = (g.temp(spec.out_len()), g.temp(2 * spec.score_rows()));
        let (delta, dqkv) = (g.temp(spec.score_rows()), g.temp(spec.qkv_len()));
        g.push(Op::Attention {
            qkv,
            out,
            stats,
            spec,
        });
        g.push(Op::AttentionBwd {
            qkv,
            dout,
            stats,
            delta,
            dqkv,
            spec,
        });
        // The output keeps a buffer of its own, as the logits do.
        let mut exec = run_ops_alone(b, g, 1, (tokens, targets), out);
        let read = |exec: &mut Box<dyn mantissa::plan::StepExecutor + '_>, id| {
            exec.read(id).block_on().unwrap()
        };
        let (y, row_stats) = ops::attention_fwd(&qkv_values, &spec);
        let (grad, dots) = ops::attention_bwd(&qkv_values, &dout_values, &spec);
        let tol = common::attention_tolerance(&spec);
        let what = |part: &str| format!("{} {algorithm} d={d} t={t}: {part}", b.name());
        common::attention_close(&what("out"), &read(&mut exec, out), &y, tol);
        let got_stats = read(&mut exec, stats);
        common::attention_close(&what("(max, sum)"), &got_stats, &row_stats, tol);
        if exact {
            common::same_row_maxes(&what("row maxes"), &got_stats, &row_stats);
        }
        common::attention_close(&what("dqkv"), &read(&mut exec, dqkv), &grad, tol);
        common::attention_close(&what("sum(P dP)"), &read(&mut exec, delta), &dots, tol);
    }
}

/// A plan of the ops `g` recorded alone (no training state; the first `forward` of them the
/// forward pass; `kept` keeps a buffer of its own, as the logits do), run once by `b`'s resident
/// executor on zero tokens and scalars; returns the executor, to read the tensors back.
fn run_ops_alone<'a>(
    b: &'a dyn Backend,
    g: mantissa::plan::PlanBuilder,
    forward: usize,
    io: (usize, usize),
    kept: usize,
) -> Box<dyn mantissa::plan::StepExecutor + 'a> {
    let plan = plan_of_ops(g, forward, io, kept);
    let scalars = vec![0.0; plan.scalar_count()];
    let ids = vec![0u32; plan.rows()];
    run_plan_alone(b, plan, (&ids, &scalars)).0
}

/// The plan of the ops `g` recorded alone (`run_ops_alone`).
fn plan_of_ops(
    g: mantissa::plan::PlanBuilder,
    forward: usize,
    batch: (usize, usize),
    kept: usize,
) -> mantissa::plan::Plan {
    let ops = g.ops.len();
    g.finish(mantissa::plan::Outline::ops_alone(
        forward, ops, batch, kept,
    ))
    .unwrap()
}

/// `plan` run once by `b`'s resident executor on `ids` (as tokens and targets) with `scalars`:
/// the executor, to read the tensors back, and the step's stats.
fn run_plan_alone<'a>(
    b: &'a dyn Backend,
    plan: mantissa::plan::Plan,
    (ids, scalars): (&[u32], &[f32]),
) -> (Box<dyn mantissa::plan::StepExecutor + 'a>, Vec<f64>) {
    let mut exec = mantissa::backend::executor(b, plan, true).unwrap();
    let stats = exec
        .run(Section::Step, ids, ids, scalars)
        .block_on()
        .unwrap();
    (exec, stats)
}

/// The ops a rounding folds into (`PlanBuilder::round`) hold their output on the device: a
/// plan of a layer norm held in bf16, GELU held in f16 and a bias added to it held in bf16, run
/// by the device's resident executor, against the ops' definitions (every value one of the
/// format's, within one step of the host's); and an add that rounds its input as it reads it
/// and adds a residual after the bias (`PlanBuilder::push`'s folds), bit for bit.
fn held_outputs_match_their_definition(b: &dyn Backend) {
    use mantissa::format::Format;
    use mantissa::plan::{Op, PlanBuilder, TensorKind};
    let seed = common::seed("held_outputs_match_their_definition");
    let (rows, c) = (37, 300);
    let values = |n, s| measure::normal(n, seed + s);
    let (x_values, g_values, b_values) = (values(rows * c, 0), values(c, 1), values(c, 2));
    let mut p = PlanBuilder::default();
    let tokens = p.tensor(rows, TensorKind::Tokens);
    let targets = p.tensor(rows, TensorKind::Targets);
    let (x, g, bias) = (
        p.constant(x_values.clone()),
        p.constant(g_values.clone()),
        p.constant(b_values.clone()),
    );
    let (norm, stats, y) = (p.temp(rows * c), p.temp(2 * rows), p.temp(rows * c));
    let f32_ = Format::F32;
    p.push(Op::LayerNorm {
        x,
        g,
        b: bias,
        out: norm,
        stats,
        c,
        held: f32_,
    });
    p.round(norm, Format::Bf16);
    p.push(Op::Unary {
        f: Unary::Gelu,
        x,
        out: y,
        held: f32_,
    });
    p.round(y, Format::F16);
    p.push(Op::add_in_place(bias, y));
    p.round(y, Format::Bf16);
    // A product rounded to bf16 (here a copy of x, whose rounding cannot fold into it), then
    // the bias added and held in f16: the add rounds it as it reads it. Kept, so that its
    // buffer is its own.
    let z = p.tensor(rows * c, TensorKind::Partial);
    let dims = [1, 1, rows as u32, c as u32];
    let dense = mantissa::plan::Strided::dense(dims);
    p.push(Op::Copy {
        x,
        out: z,
        map: mantissa::plan::Strided {
            dims,
            src: dense,
            dst: dense,
            src_offset: 0,
            dst_offset: 0,
        },
        held: Format::F32,
    });
    p.round(z, Format::Bf16);
    p.push(Op::add_in_place(bias, z));
    p.round(z, Format::F16);
    // Then a residual (g's values repeated over the rows) added in the same op, held in bf16.
    let r = p.constant(g_values.repeat(rows));
    p.push(Op::add_in_place(r, z));
    p.round(z, Format::Bf16);
    assert!(
        !p.ops.iter().any(|op| matches!(op, Op::Round { .. })),
        "every rounding folds into its op: {:?}",
        p.ops
    );
    assert!(
        matches!(
            p.ops.last(),
            Some(Op::Add {
                y_held: Format::Bf16,
                held: Format::F16,
                residual: Some((_, Format::Bf16)),
                ..
            })
        ),
        "{:?}",
        p.ops.last()
    );
    // The norm keeps a buffer of its own, as the logits do.
    let mut exec = run_ops_alone(b, p, 3, (tokens, targets), norm);
    let (want_norm, _, _) = ops::layernorm_fwd(&x_values, &g_values, &b_values, c);
    let got = exec.read(norm).block_on().unwrap();
    let row = measure::train_tolerance::ROW;
    common::held_close(
        "layer norm held in bf16",
        &got,
        &want_norm,
        Format::Bf16,
        row,
    );
    // GELU held in f16, the bias added in f32 and held in bf16: within a bf16 step of the sum
    // the host computes from its own f16 GELU. Where the host's f32 GELU lies so near an f16
    // rounding boundary that the device's (which differs in its last bits) may round to the
    // other side, one f16 step more: where the bias cancels most of the GELU, that step is
    // larger than the sum's.
    let gelu = ops::unary_fwd(Unary::Gelu, &x_values);
    let mut want = gelu.clone();
    ops::round_to(&mut want, Format::F16);
    ops::add_bias(&mut want, &b_values);
    let got = exec.read(y).block_on().unwrap();
    let step =
        |f: Format, v: f32| (v.abs() as f64 * f.finfo().eps).max(f.finfo().smallest_subnormal);
    let f16 = |v: f32| Format::F16.round(v, mantissa::format::Overflow::Standard);
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        let bf16 = Format::Bf16.round(g, mantissa::format::Overflow::Standard);
        assert_eq!(
            bf16.to_bits(),
            g.to_bits(),
            "gelu + bias[{i}] = {g} is not a bf16"
        );
        let near_boundary = f16(gelu[i] * (1.0 + 1e-5)) != f16(gelu[i] * (1.0 - 1e-5));
        let f16_step = if near_boundary {
            step(Format::F16, gelu[i])
        } else {
            0.0
        };
        let allowed = step(Format::Bf16, w) + f16_step + (row * (1.0 + w.abs())) as f64;
        assert!(
            ((g - w).abs() as f64) <= allowed,
            "gelu + bias held in bf16[{i}]: {g}, the reference {w} (allowed {allowed})"
        );
    }
    // Sums of the same f32 values: bit for bit.
    let mut want = x_values.clone();
    ops::round_to(&mut want, Format::Bf16);
    ops::add_bias(&mut want, &b_values);
    ops::round_to(&mut want, Format::F16);
    ops::add_bias(&mut want, &g_values);
    ops::round_to(&mut want, Format::Bf16);
    let got = exec.read(z).block_on().unwrap();
    assert!(
        common::same_bits(&got, &want),
        "bf16(x) + bias held in f16, plus a residual held in bf16, differs from its definition"
    );
}

/// A device's fused cross entropy (the loss and its gradient in one op, as a step plan holds
/// it): the mean loss and the gradient held in f32, bf16 and f16 against the two ops it
/// replaces (`ops::cross_entropy_fwd`, `cross_entropy_bwd`, then the rounding), on a vocabulary
/// of the corpus's odd size and one wider than a workgroup, with rows of large logits.
fn fused_cross_entropy_is_the_loss_and_its_gradient(b: &dyn Backend) {
    use mantissa::format::Format;
    use mantissa::plan::{Op, PlanBuilder, Stats, TensorKind, scalar};
    let seed = common::seed("fused_cross_entropy_is_the_loss_and_its_gradient");
    let rows = 37;
    for (case, v) in [65usize, 300].into_iter().enumerate() {
        let mut logits: Vec<f32> = measure::normal(rows * v, seed + case as u64)
            .iter()
            .map(|x| 3.0 * x)
            .collect();
        // A row far from zero, and one whose largest logit is far above the rest.
        logits[..v].iter_mut().for_each(|x| *x += 1.0e4);
        logits[v] = 3.0e4;
        let targets: Vec<u32> = (0..rows as u32).map(|r| (r * 7 + 3) % v as u32).collect();
        let dloss = 1024.0;
        for held in [Format::F32, Format::Bf16, Format::F16] {
            let mut p = PlanBuilder::default();
            let tokens = p.tensor(rows, TensorKind::Tokens);
            let target_ids = p.tensor(rows, TensorKind::Targets);
            let (x, grad) = (p.constant(logits.clone()), p.temp(rows * v));
            p.push(Op::CrossEntropy {
                logits: x,
                targets: target_ids,
                grad,
                v,
                held: Format::F32,
            });
            p.round(grad, held);
            assert_eq!(p.ops.len(), 1, "the rounding folds into the op");
            let plan = plan_of_ops(p, 1, (tokens, target_ids), grad);
            let mut scalars = vec![0.0; plan.scalar_count()];
            scalars[scalar::DLOSS_PER_ROW] = (dloss / rows as f64) as f32;
            let (mut exec, stats) = run_plan_alone(b, plan, (&targets, &scalars));
            let (loss, probs) = ops::cross_entropy_fwd(&logits, &targets, v);
            let row = measure::train_tolerance::ROW as f64;
            let got = stats[Stats::LOSS];
            assert!(
                (got - loss).abs() <= row * loss,
                "v {v}: mean loss {got}, the reference {loss}"
            );
            let mut want = ops::cross_entropy_bwd(&probs, &targets, v, dloss);
            ops::round_to(&mut want, held);
            let got = exec.read(grad).block_on().unwrap();
            let what = format!("v {v}: the loss's gradient held in {held}");
            common::held_close(&what, &got, &want, held, row as f32);
        }
    }
}

/// `x` with NaN, infinities, a value whose GELU overflows f16 and bf16's neighbourhood of it,
/// and ones whose GELU is subnormal in f16, at its start.
fn edge_cases(mut x: Vec<f32>) -> Vec<f32> {
    let edges = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1.0e5,
        3.0e38,
        1.0e-6,
        -2.0e-7,
    ];
    x[..edges.len()].copy_from_slice(&edges);
    x
}

/// A device's layer norm, GELU, bias add and cross entropy's gradient storing 16-bit codes (a
/// plan's coded tensors, `Plan::store_codes`) store the codes of the values they hold as f32:
/// read back, the coded outputs equal the f32 ones bit for bit (bf16 and f16; a GELU and an add
/// of odd length, whose last word holds one code, over NaN, infinities, overflow and subnormal
/// results); and GELU and its backward reading the coded sum give the bits they give reading
/// the f32 one.
fn coded_outputs_are_the_held_values(b: &dyn Backend) {
    use mantissa::format::Format;
    use mantissa::plan::{Op, PlanBuilder, TensorKind};
    let seed = common::seed("coded_outputs_are_the_held_values");
    let (rows, c, n) = (37, 300, 1001);
    let values = |n, s| measure::normal(n, seed + s);
    let mut p = PlanBuilder::default();
    let tokens = p.tensor(rows, TensorKind::Tokens);
    let targets = p.tensor(rows, TensorKind::Targets);
    let (x, g, bias, z) = (
        p.constant(values(rows * c, 0)),
        p.constant(values(c, 1)),
        p.constant(values(c, 2)),
        p.constant(edge_cases(values(n, 3).iter().map(|v| 4.0 * v).collect())),
    );
    let (short_bias, dy) = (p.constant(values(7, 4)), p.constant(values(n, 5)));
    let stats = p.temp(2 * rows);
    let (mut pairs, mut fused) = (vec![], vec![]);
    for format in [Format::Bf16, Format::F16] {
        // Outputs kept whole after the step (not shared with other temporaries).
        let outs = [0, 1].map(|_| {
            [
                p.tensor(rows * c, TensorKind::Partial),
                p.tensor(n, TensorKind::Partial),
            ]
        });
        for [norm, y] in outs {
            p.push(Op::LayerNorm {
                x,
                g,
                b: bias,
                out: norm,
                stats,
                c,
                held: format,
            });
            p.push(Op::Unary {
                f: Unary::Gelu,
                x: z,
                out: y,
                held: format,
            });
        }
        for id in outs[1] {
            p.tensors[id].stored = format;
        }
        pairs.extend((0..2).map(|i| (format, outs[0][i], outs[1][i])));
        // The cross entropy of x's rows (x as logits, a vocabulary of c) and its gradient, held
        // in the format, stored in f32 and as codes.
        let grads = [0, 1].map(|_| p.tensor(rows * c, TensorKind::Partial));
        p.tensors[grads[1]].stored = format;
        for grad in grads {
            p.push(Op::CrossEntropy {
                logits: x,
                targets,
                grad,
                v: c,
                held: format,
            });
        }
        pairs.push((format, grads[0], grads[1]));
        // A bias add into a tensor of its own (odd length, the bias repeated every 7), once
        // stored in f32 and once as codes; GELU and its backward reading each.
        let kept = |p: &mut PlanBuilder| p.tensor(n, TensorKind::Partial);
        let [sum, coded_sum, gelu, coded_gelu, d, coded_d] = [0; 6].map(|_| kept(&mut p));
        p.tensors[coded_sum].stored = format;
        for (input, out) in [(sum, gelu), (coded_sum, coded_gelu)] {
            // z rounded to f16 as the add reads it, on both paths.
            p.push(Op::Add {
                x: short_bias,
                y: z,
                out: input,
                held: format,
                y_held: Format::F16,
                x_held: format,
                residual: None,
                gelu: None,
            });
            p.push(Op::Unary {
                f: Unary::Gelu,
                x: input,
                out,
                held: format,
            });
        }
        pairs.extend([(format, sum, coded_sum), (format, gelu, coded_gelu)]);
        p.push(Op::UnaryBwd {
            f: Unary::Gelu,
            x: sum,
            dy,
            out: d,
            held: Format::F32,
            dy_held: Format::F32,
        });
        p.push(Op::UnaryBwd {
            f: Unary::Gelu,
            x: coded_sum,
            dy,
            out: coded_d,
            held: Format::F32,
            dy_held: Format::F32,
        });
        pairs.push((format, d, coded_d));
        // A bias add and its GELU as one op (`Op::Add`'s gelu) against the two ops: in place
        // (as `PlanBuilder::push` folds them) and into a coded output (as `Plan::store_codes`
        // then makes it), the GELU held in f32, or in the format and stored as its codes.
        let copy = mantissa::plan::Strided::dense([1, 1, 1, n as u32]);
        for gelu_held in [Format::F32, format] {
            let [y_one, y_two, g_one, g_two, s_one, s_two, h_one, h_two] =
                [0; 8].map(|_| kept(&mut p));
            for t in [s_one, s_two] {
                p.tensors[t].stored = format;
            }
            for t in [g_one, g_two, h_one, h_two] {
                p.tensors[t].stored = gelu_held;
            }
            for y in [y_one, y_two] {
                p.push(Op::Copy {
                    x: z,
                    out: y,
                    map: mantissa::plan::Strided {
                        dims: [1, 1, 1, n as u32],
                        src: copy,
                        dst: copy,
                        src_offset: 0,
                        dst_offset: 0,
                    },
                    held: Format::F32,
                });
            }
            let add = |y, out, gelu| Op::Add {
                x: short_bias,
                y,
                out,
                held: format,
                y_held: Format::F16,
                x_held: format,
                residual: None,
                gelu,
            };
            let gelu = |x, out| Op::Unary {
                f: Unary::Gelu,
                x,
                out,
                held: gelu_held,
            };
            p.push(add(y_one, y_one, None));
            p.push(gelu(y_one, g_one));
            assert!(
                matches!(p.ops.last(), Some(Op::Add { gelu: Some((g, _)), .. }) if *g == g_one),
                "the GELU folds into the add before it"
            );
            p.ops.extend([add(y_two, y_two, None), gelu(y_two, g_two)]);
            p.ops.extend([
                add(z, s_one, Some((h_one, gelu_held))),
                add(z, s_two, None),
                gelu(s_two, h_two),
            ]);
            fused.extend([
                (y_two, y_one),
                (g_two, g_one),
                (s_two, s_one),
                (h_two, h_one),
            ]);
        }
    }
    let ops = p.ops.len();
    // The cross entropy's gradient scaled as a step of `rows` rows scales it; targets spread
    // over the vocabulary.
    let plan = plan_of_ops(p, ops, (tokens, targets), stats);
    let mut scalars = vec![0.0; plan.scalar_count()];
    scalars[mantissa::plan::scalar::DLOSS_PER_ROW] = 1024.0 / rows as f32;
    let ids: Vec<u32> = (0..rows as u32).map(|r| (r * 37) % c as u32).collect();
    let (mut exec, _) = run_plan_alone(b, plan, (&ids, &scalars));
    let mut check = |want: usize, got: usize, what: &dyn Fn(usize, f32, f32) -> String| {
        let (want, got) = (
            exec.read(want).block_on().unwrap(),
            exec.read(got).block_on().unwrap(),
        );
        assert_eq!(want.len(), got.len());
        let same =
            |i: usize| want[i].to_bits() == got[i].to_bits() || want[i].is_nan() && got[i].is_nan();
        if let Some(i) = (0..want.len()).find(|&i| !same(i)) {
            panic!("{}", what(i, got[i], want[i]));
        }
    };
    for (format, held, coded) in pairs {
        check(held, coded, &|i, got, want| {
            format!("{format} tensor {coded}: element {i} is {got:e} coded, {want:e} held")
        });
    }
    for (two, one) in fused {
        check(two, one, &|i, got, want| {
            format!(
                "tensor {one}: element {i} is {got:e} from the add with its GELU, {want:e} from the two ops"
            )
        });
    }
}

/// A device's fused attention kernels (wgpu: shaders/attention.wgsl, CUDA: cuda/attention.cu) in a
/// resident plan against the host interpreter of the same plan, which runs the fused op's
/// definition (the unfused ops on the host): losses, gradient norms and gradients after three
/// steps, under a preset with f32 and one with 16-bit held values.
fn resident_fused_attention_matches_its_definition(b: &dyn Backend) {
    let corpus = corpus();
    for preset in [Preset::True32, Preset::MixedBf16, Preset::TrueBf16] {
        let trainer = |resident: bool| {
            let mut o = options(&corpus, preset, 23);
            o.fused_attention = Some(true);
            o.resident = resident;
            Trainer::new(b, &corpus, o).unwrap()
        };
        let (mut device, mut host) = (trainer(true), trainer(false));
        let gap = steps_agree(&format!("{preset}, fused"), &mut device, &mut host);
        eprintln!(
            "{preset}: fused attention on {}: gradients within {gap:.2e}",
            b.name()
        );
    }
}

#[test]
fn executors_refuse_batches_of_the_wrong_shape() {
    let corpus = corpus();
    let t = Trainer::new(&Reference, &corpus, options(&corpus, Preset::True32, 1)).unwrap();
    let plan = t.gpt.plan(&t.run.precision, 2, 8).unwrap();
    let scalars = vec![0.0; plan.scalar_count()];
    let mut exec = mantissa::backend::executor(&Reference, plan, true).unwrap();
    let err = exec
        .run(Section::Step, &[1, 2, 3], &[1, 2, 3], &scalars)
        .block_on()
        .unwrap_err()
        .to_string();
    assert!(err.contains("16 tokens"), "{err}");
    let err = exec
        .run(Section::Step, &[0; 16], &[0; 16], &[])
        .block_on()
        .unwrap_err()
        .to_string();
    assert!(err.contains("scalars"), "{err}");
}

/// Temporaries share device buffers only where that cannot change a result: every temporary is
/// written whole before the step reads it, tensors of one op never share, tensors sharing a
/// buffer live at disjoint times, and trained state, inputs, constants and the logits keep
/// their own. (The resident-plan tests above run the shared storage against the host.)
#[test]
fn plan_storage_shares_only_disjoint_temporaries() {
    use mantissa::plan::{Op, Storage, TensorKind};
    let corpus = corpus();
    for preset in [Preset::True32, Preset::MixedBf16, Preset::TransformerEngine] {
        let t = Trainer::new(&Reference, &corpus, options(&corpus, preset, 1)).unwrap();
        let c = &t.gpt.config;
        let plan = t
            .gpt
            .plan(&t.run.precision, c.batch_size, c.block_size)
            .unwrap();
        let storage = Storage::shared(&plan);
        let n = plan.tensors().len();
        let (mut first, mut last, mut written) = (vec![usize::MAX; n], vec![0; n], vec![0; n]);
        for (i, op) in plan.ops().iter().enumerate() {
            let (reads, writes) = op.reads_writes();
            for &x in &reads {
                if plan.tensors()[x].kind == TensorKind::Temp {
                    assert!(
                        written[x] >= plan.tensors()[x].len,
                        "{preset}: op {i} ({}) reads temporary {x} before the step wrote it",
                        op.name()
                    );
                }
            }
            let mut slots: Vec<usize> = reads
                .iter()
                .chain(&writes)
                .map(|&x| storage.slot_of[x])
                .collect();
            let distinct: std::collections::BTreeSet<_> = reads.iter().chain(&writes).collect();
            slots.sort();
            slots.dedup();
            assert_eq!(
                slots.len(),
                distinct.len(),
                "{preset}: op {i} shares a buffer"
            );
            for &x in reads.iter().chain(&writes) {
                first[x] = first[x].min(i);
                last[x] = i;
            }
            for &x in &writes {
                written[x] += match op {
                    Op::Copy { map, .. } => map.len(),
                    _ => plan.tensors()[x].len,
                };
            }
        }
        for x in 0..n {
            // Slots are counted in 4-byte words (a coded tensor takes half its length).
            assert!(storage.slots[storage.slot_of[x]] >= plan.tensors()[x].words());
            for y in x + 1..n {
                if storage.slot_of[x] != storage.slot_of[y] {
                    continue;
                }
                for z in [x, y] {
                    assert!(
                        plan.tensors()[z].kind == TensorKind::Temp && z != plan.logits(),
                        "{preset}: tensor {z} ({:?}) shares a buffer",
                        plan.tensors()[z].kind
                    );
                }
                assert!(
                    last[x] < first[y] || last[y] < first[x],
                    "{preset}: tensors {x} and {y} share a buffer while both live"
                );
            }
        }
        let (shared, separate) = (storage.bytes(), plan.tensor_bytes());
        eprintln!("{preset}: {shared} bytes shared, {separate} separate");
        assert!(
            shared < separate * 7 / 10,
            "{preset}: {shared} of {separate} bytes"
        );
    }
}

/// The step's update is two multi-tensor ops, whatever the preset: one unscale-and-check over
/// every gradient (in the stats' order) and one AdamW over every parameter with its gradient,
/// moments and weight decay, so that a backend can launch each once.
#[test]
fn the_update_is_one_unscale_and_one_adamw_over_every_parameter() {
    use mantissa::plan::{AdamWParam, Op};
    let corpus = corpus();
    for preset in [Preset::True32, Preset::MixedBf16, Preset::TrueBf16] {
        let t = Trainer::new(&Reference, &corpus, options(&corpus, preset, 3)).unwrap();
        let plan = t.gpt.plan(&t.run.precision, 2, 8).unwrap();
        let state = plan.state();
        let unscales: Vec<_> = (plan.ops().iter())
            .filter_map(|op| match op {
                Op::UnscaleCheck { grads } => Some(grads.clone()),
                _ => None,
            })
            .collect();
        let grads: Vec<_> = state.iter().map(|s| s[1]).collect();
        assert_eq!(
            unscales,
            [grads],
            "{preset}: one unscale over every gradient"
        );
        let updates: Vec<_> = (plan.ops().iter())
            .filter_map(|op| match op {
                Op::AdamW { params, .. } => Some(params.clone()),
                _ => None,
            })
            .collect();
        let decays = t.gpt.config.decays();
        let want: Vec<_> = (state.iter().zip(decays))
            .map(|(&[param, grad, m, v], decay)| AdamWParam {
                param,
                grad,
                m,
                v,
                decay,
            })
            .collect();
        assert_eq!(updates, [want], "{preset}: one AdamW over every parameter");
    }
}

/// A rank's plan of a data-parallel step (`Plan::split_for_ranks`) holds the same ops, with
/// only what finishes the gradients (roundings, the embedding's scatter into the tied head's
/// gradient) moved after the backward pass, and a bias gradient's rounding, which its column
/// sum does as it writes it in one rank's plan (and of a weight gradient, which its matmul
/// rounds as it stores it), an op of its own there; run as `Backward` then
/// `Update` on one rank it gives the very bits of the whole step, in every preset.
#[test]
fn a_rank_plan_is_the_step_split_at_the_gradient_sum() {
    use mantissa::format::Format;
    use mantissa::plan::{Op, TensorKind};
    let corpus = corpus();
    for preset in [
        Preset::True32,
        Preset::MixedBf16,
        Preset::TrueBf16,
        Preset::TransformerEngine,
    ] {
        let t = Trainer::new(&Reference, &corpus, options(&corpus, preset, 3)).unwrap();
        let whole = t.gpt.plan(&t.run.precision, 2, 8).unwrap();
        let mut split = whole.clone();
        let summed = split.split_for_ranks();
        let grads = whole.state().len();
        assert_eq!(
            summed.len(),
            grads + 1,
            "{preset}: the gradients and the scatter"
        );
        let part = summed[grads];
        assert_eq!(split.tensors()[part].kind, TensorKind::Partial);
        let names = |ops: &[Op]| {
            let mut n = vec![];
            for op in ops {
                // A gradient held as written (a column sum's, a weight gradient's product) as
                // the unheld op and its rounding.
                let mut unheld = op.clone();
                let rounding = match &mut unheld {
                    Op::ColumnSums { out, held, .. } | Op::Matmul { out, held, .. }
                        if *held != Format::F32
                            && matches!(whole.tensors()[*out].kind, TensorKind::Grad(_)) =>
                    {
                        let format = std::mem::replace(held, Format::F32);
                        Some(Op::Round { x: *out, format })
                    }
                    _ => None,
                };
                n.push(format!("{unheld:?}"));
                n.extend(rounding.map(|r| format!("{r:?}")));
            }
            n.sort();
            n
        };
        assert_eq!(
            names(whole.ops()),
            names(split.ops()),
            "{preset}: the same ops"
        );
        for op in &split.ops()
            [split.range_of(Section::Update).start..split.range_of(Section::Gradients).end]
        {
            assert!(
                matches!(
                    op,
                    Op::Round { .. } | Op::Add { .. } | Op::UnscaleCheck { .. }
                ),
                "{preset}: {op:?} after the sum"
            );
        }
        for op in split.ops_of(Section::Backward) {
            if let Op::Round { x, .. } = op {
                assert!(!summed.contains(x), "{preset}: {x} rounded before the sum");
            }
        }
        let (ids, targets) = corpus.batch(false, 2, 8, 3, 0).unwrap();
        let scalars = mantissa::plan::scalar::StepScalars {
            adamw: &mantissa::plan::AdamW::default(),
            clip: 1.0,
            loss_scale: 1024.0,
            poison: 0.0,
            t: 1,
            parts: 1,
            part: 0,
            fp8: &t.fp8_scales(),
            eval: false,
        }
        .array(whole.rows(), whole.scalar_count());
        let mut a = mantissa::backend::executor(&Reference, whole.clone(), true).unwrap();
        let mut b = mantissa::backend::executor(&Reference, split.clone(), true).unwrap();
        for (i, p) in t.gpt.config.init(3).unwrap().into_iter().enumerate() {
            a.write(whole.state()[i][0], &p).block_on().unwrap();
            b.write(whole.state()[i][0], &p).block_on().unwrap();
        }
        let sa = a
            .run(Section::Step, &ids, &targets, &scalars)
            .block_on()
            .unwrap();
        let sb = b
            .run(Section::Backward, &ids, &targets, &scalars)
            .block_on()
            .unwrap();
        let ub = b
            .run(Section::Update, &ids, &targets, &scalars)
            .block_on()
            .unwrap();
        assert_eq!(sa[0].to_bits(), sb[0].to_bits(), "{preset}: loss");
        for i in 1..sa.len().min(1 + 2 * grads) {
            assert_eq!(sa[i].to_bits(), ub[i].to_bits(), "{preset}: stat {i}");
        }
        for &[p, g, m, v] in whole.state() {
            for id in [p, g, m, v] {
                let (x, y) = (
                    a.read(id).block_on().unwrap(),
                    b.read(id).block_on().unwrap(),
                );
                assert!(
                    x.iter().zip(&y).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{preset}: tensor {id}"
                );
            }
        }
    }
}

/// Fused attention (`Op::Attention`, what CUDA runs) is defined as the unfused ops compute it:
/// on the reference backend a fused plan trains bit for bit as the unfused one under every
/// preset (losses, gradient norms, gradients, weights, moments), and its tensors take less
/// memory, since it keeps each score row's (max, sum) instead of the (B, H, T, T) probabilities.
#[test]
fn fused_attention_trains_as_the_unfused_ops() {
    use mantissa::plan::{Op, Storage};
    let corpus = corpus();
    let bits = |x: &[Vec<f32>]| -> Vec<u32> { x.iter().flatten().map(|v| v.to_bits()).collect() };
    for preset in [
        Preset::True32,
        Preset::MixedBf16,
        Preset::Mixed16,
        Preset::TrueBf16,
        Preset::TransformerEngine,
    ] {
        let trainer = |fused: bool| {
            let mut o = options(&corpus, preset, 31);
            o.fused_attention = Some(fused);
            Trainer::new(&Reference, &corpus, o).unwrap()
        };
        let (mut fused, mut unfused) = (trainer(true), trainer(false));
        let c = &fused.gpt.config;
        let plans = [true, false].map(|f| {
            fused
                .gpt
                .plan_with(&fused.run.precision, c.batch_size, c.block_size, f, true)
                .unwrap()
        });
        let attention_ops = |p: &mantissa::plan::Plan| {
            p.ops()
                .iter()
                .filter(|op| matches!(op, Op::Attention { .. } | Op::AttentionBwd { .. }))
                .count()
        };
        assert_eq!(attention_ops(&plans[0]), 2 * c.n_layer);
        assert_eq!(attention_ops(&plans[1]), 0);
        let bytes = plans.each_ref().map(|p| Storage::shared(p).bytes());
        assert!(bytes[0] < bytes[1], "{preset}: fused {bytes:?} unfused");
        for step in 0..3 {
            let (f, u) = (
                fused.step().block_on().unwrap(),
                unfused.step().block_on().unwrap(),
            );
            assert_eq!(
                f.loss.to_bits(),
                u.loss.to_bits(),
                "{preset} step {step}: loss"
            );
            assert_eq!(
                f.grad_norm.to_bits(),
                u.grad_norm.to_bits(),
                "{preset} step {step}"
            );
            assert_eq!(f.skipped, u.skipped);
        }
        let (gf, gu) = (
            fused.gradients().block_on().unwrap(),
            unfused.gradients().block_on().unwrap(),
        );
        assert!(bits(&gf) == bits(&gu), "{preset}: gradients differ");
        let (sf, su) = (
            fused.state().block_on().unwrap(),
            unfused.state().block_on().unwrap(),
        );
        assert!(
            bits(&sf.params) == bits(&su.params),
            "{preset}: weights differ"
        );
        assert!(
            bits(&sf.adam_v) == bits(&su.adam_v),
            "{preset}: moments differ"
        );
    }
}

// ---- Step for step with PyTorch (docs/training.md, "Step for step with PyTorch") ----
//
// tests/data/parity_tiny_*: the anchor model's initial weights (PyTorch's names), its 300
// batches and the losses PyTorch trained them to under each preset, written by
// scripts/anchors/torch_step_parity.py (PyTorch on a CPU, CUDA's autocast lists as casts). Runs
// start from those weights on those batches and compare every step's loss with PyTorch's.
// What CI runs, 2 CPU cores: all 300 steps of 32-true and bf16-mixed on the reference (about
// 30 and 45 s), 60 of 16-mixed and a 30-step 16-mixed run with inf gradients injected at steps
// 3 and 4, the first step of bf16-true and 16-true; on a device (lavapipe in CI, about 0.2 s a
// step), 40 steps of 32-true and bf16-mixed and the injected run. docs/training.md has the
// figures of all 300 steps of every preset on the reference and lavapipe.

/// The fixtures, read once.
struct Parity {
    corpus: Corpus,
    init: Vec<Vec<f32>>,
    batches: Batches,
    torch: serde_json::Value,
}

fn parity() -> &'static Parity {
    static P: std::sync::OnceLock<Parity> = std::sync::OnceLock::new();
    P.get_or_init(|| {
        let data = common::repo_file("tests/data");
        let corpus = corpus();
        let cfg = GptConfig::named("tiny", corpus.vocab.len()).unwrap();
        let init = init::read_init(
            &data.join("parity_tiny_init.safetensors"),
            &cfg,
            &corpus.vocab,
        )
        .expect("the fixture's initial weights");
        let (b, t, v) = (cfg.batch_size, cfg.block_size, corpus.vocab.len());
        let batches = Batches::load(&data.join("parity_tiny_batches.npy"), b, t, v, 300)
            .expect("the fixture's batches");
        let json = std::fs::read_to_string(data.join("parity_tiny_torch.json")).unwrap();
        Parity {
            corpus,
            init,
            batches,
            torch: serde_json::from_str(&json).unwrap(),
        }
    })
}

/// `steps` steps of `tiny` under `preset` on `b` from the fixture's weights and batches, with
/// PyTorch's AdamW epsilon for the preset, and an inf added to the first gradient at the steps
/// in `inject` (1-based).
fn parity_run(b: &dyn Backend, run: &str, steps: u32, inject: &[u32]) -> Vec<StepRecord> {
    let p = parity();
    let theirs = &p.torch["runs"][run];
    let preset: Preset = run.split(',').next().unwrap().parse().unwrap();
    let mut options = options(&p.corpus, preset, 1337);
    options.adamw.eps = theirs["adam_eps"].as_f64().expect("adam_eps") as f32;
    let mut trainer = Trainer::new(b, &p.corpus, options).unwrap();
    trainer.set_weights(&p.init).block_on().unwrap();
    trainer.use_batches(p.batches.clone()).unwrap();
    (1..=steps)
        .map(|s| {
            let poison = if inject.contains(&s) {
                f32::INFINITY
            } else {
                0.0
            };
            trainer.step_injecting(poison).block_on().unwrap()
        })
        .collect()
}

/// Checks `ours` against PyTorch's run `run`: step s's loss within the bound of the first
/// `(last step, bound)` of `bounds` that covers s, and (where PyTorch scaled the loss) the same
/// loss scale after every step and the same skipped steps. Prints the largest differences.
fn parity_check(what: &str, run: &str, ours: &[StepRecord], bounds: &[(usize, f64)]) {
    let theirs = &parity().torch["runs"][run];
    let losses: Vec<f64> = serde_json::from_value(theirs["losses"].clone()).unwrap();
    assert!(
        ours.len() <= losses.len(),
        "{what}: PyTorch ran {} steps",
        losses.len()
    );
    let mut worst = vec![0f64; bounds.len()];
    for (i, r) in ours.iter().enumerate() {
        let diff = (r.loss - losses[i]).abs();
        let k = bounds.iter().position(|&(last, _)| i < last).unwrap();
        worst[k] = worst[k].max(diff);
        assert!(
            diff <= bounds[k].1,
            "{what}: step {} loss {} vs PyTorch's {} (|difference| {diff:.2e} > {:.0e})",
            r.step,
            r.loss,
            losses[i],
            bounds[k].1
        );
    }
    let worst: Vec<String> = worst.iter().map(|w| format!("{w:.2e}")).collect();
    eprintln!("{what}: largest |loss - PyTorch's| per range {bounds:?}: {worst:?}");
    if let Some(scales) = theirs["loss_scales"].as_array() {
        for (i, r) in ours.iter().enumerate() {
            assert_eq!(
                r.loss_scale.map(f64::from),
                scales[i].as_f64(),
                "{what}: loss scale after step {}",
                r.step
            );
        }
        let skipped: Vec<u32> = serde_json::from_value(theirs["skipped"].clone()).unwrap();
        let ours_skipped: Vec<u32> = ours.iter().filter(|r| r.skipped).map(|r| r.step).collect();
        let n = ours.len() as u32;
        let theirs_skipped: Vec<u32> = skipped.into_iter().filter(|&s| s <= n).collect();
        assert_eq!(ours_skipped, theirs_skipped, "{what}: skipped steps");
    }
}

/// The issue's targets: 32-true within 1e-5 at every step (PyTorch f32 vs f64: 1e-6).
const F32_BOUNDS: [(usize, f64); 1] = [(300, 1e-5)];
/// bf16-mixed: step 1 within 2e-5, steps 1-10 within 3e-4, all within 3e-3.
const BF16_MIXED_BOUNDS: [(usize, f64); 3] = [(1, 2e-5), (10, 3e-4), (300, 3e-3)];
/// 16-mixed: every step within 1e-3 (and GradScaler's scales and skips, checked apart).
const F16_MIXED_BOUNDS: [(usize, f64); 1] = [(300, 1e-3)];
/// The injected run: GradScaler's skips at steps 3 and 4.
const INJECTED: &str = "16-mixed, inf at steps 3,4";

#[test]
fn parity_32_true_matches_pytorch_for_300_steps() {
    let ours = parity_run(&Reference, "32-true", 300, &[]);
    parity_check("reference 32-true", "32-true", &ours, &F32_BOUNDS);
}

#[test]
fn parity_bf16_mixed_matches_pytorch_for_300_steps() {
    let ours = parity_run(&Reference, "bf16-mixed", 300, &[]);
    parity_check(
        "reference bf16-mixed",
        "bf16-mixed",
        &ours,
        &BF16_MIXED_BOUNDS,
    );
}

#[test]
fn parity_16_mixed_scales_and_skips_as_gradscaler() {
    let ours = parity_run(&Reference, "16-mixed", 60, &[]);
    parity_check("reference 16-mixed", "16-mixed", &ours, &F16_MIXED_BOUNDS);
    let ours = parity_run(&Reference, INJECTED, 30, &[3, 4]);
    assert_eq!(
        ours.iter().filter(|r| r.skipped).count(),
        2,
        "the injected steps are skipped"
    );
    parity_check(
        "reference 16-mixed, inf at 3, 4",
        INJECTED,
        &ours,
        &F16_MIXED_BOUNDS,
    );
}

/// The 16-bit "true" presets: the first step within 1e-3 (their optimizer's arithmetic differs
/// from PyTorch's after it: docs/training.md).
#[test]
fn parity_true_presets_first_step() {
    for preset in ["bf16-true", "16-true"] {
        let ours = parity_run(&Reference, preset, 1, &[]);
        parity_check(&format!("reference {preset}"), preset, &ours, &[(1, 1e-3)]);
    }
}

/// A device's resident plan, fewer steps (lavapipe takes about 0.2 s a step).
fn matches_pytorch_step_for_step(b: &dyn Backend) {
    let name = b.name();
    for (preset, bounds) in [
        ("32-true", &F32_BOUNDS[..]),
        ("bf16-mixed", &BF16_MIXED_BOUNDS),
    ] {
        let ours = parity_run(b, preset, 24, &[]);
        parity_check(&format!("{name} {preset}"), preset, &ours, bounds);
    }
    let ours = parity_run(b, INJECTED, 12, &[3, 4]);
    parity_check(
        &format!("{name} {INJECTED}"),
        INJECTED,
        &ours,
        &F16_MIXED_BOUNDS,
    );
}

/// The per-step losses of `tiny` under every preset (on the reference, with attention fused and
/// unfused; on a device, as its resident plan runs it), to the bit, against
/// tests/data/train_losses.json: the step a model records is the one these losses were recorded
/// from. `MANTISSA_RECORD_LOSSES=1` rewrites this backend's entries instead of comparing.
fn losses_are_the_recorded_ones(b: &dyn Backend) {
    const STEPS: usize = 2;
    let path = common::repo_file("tests/data/train_losses.json");
    let mut recorded: std::collections::BTreeMap<String, Vec<u64>> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|_| "{}".into()))
            .unwrap();
    let record = std::env::var("MANTISSA_RECORD_LOSSES").is_ok_and(|v| v == "1");
    let corpus = corpus();
    let kind = match b.kind() {
        mantissa::backend::BackendKind::Reference => "reference",
        // A CPU adapter gives a row op's row one lane; a GPU's sum in another order, and
        // Mesa 26's lavapipe runs the 16-bit matmuls on cooperative matrices: recorded on
        // Debian 12's (Mesa 22), where CI runs the suite.
        mantissa::backend::BackendKind::Wgpu
            if b.name().contains("llvmpipe") && b.device_name().contains("Mesa 22.") =>
        {
            "wgpu"
        }
        _ => {
            let why = format!(
                "losses are recorded on the reference and Mesa 22's lavapipe, not {}",
                b.device_name()
            );
            return common::skip("losses_are_the_recorded_ones", &why);
        }
    };
    let attention: &[bool] = if b.kind() == mantissa::backend::BackendKind::Reference {
        &[true, false]
    } else {
        &[false]
    };
    let mut failures = vec![];
    for &preset in Preset::ALL {
        for &fused in attention {
            let mut o = options(&corpus, preset, 7);
            o.fused_attention = Some(fused);
            let mut t = Trainer::new(b, &corpus, o).unwrap();
            let losses: Vec<u64> = (0..STEPS)
                .map(|_| t.step().block_on().unwrap().loss.to_bits())
                .collect();
            let key = format!("{kind} {preset} fused={fused}");
            if record {
                recorded.insert(key, losses);
            } else if recorded.get(&key) != Some(&losses) {
                failures.push(format!(
                    "{key}: losses {:?}, recorded {:?}",
                    losses
                        .iter()
                        .map(|&l| f64::from_bits(l))
                        .collect::<Vec<_>>(),
                    recorded
                        .get(&key)
                        .map(|r| r.iter().map(|&l| f64::from_bits(l)).collect::<Vec<_>>())
                ));
            }
        }
    }
    if record {
        let text = serde_json::to_string_pretty(&recorded).unwrap();
        std::fs::write(&path, text + "\n").unwrap();
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn losses_are_the_recorded_ones_on_the_reference() {
    losses_are_the_recorded_ones(&Reference);
}

/// The step plan of `small` under every preset, attention fused and not, and of `gpt2` (its
/// batch of 8 x 1024 tokens, GPT-2's padded vocabulary) at 32-true and bf16-mixed, fused, has
/// at most the ops, tensor bytes and shared storage bytes recorded in
/// tests/data/train_plans.json (`MANTISSA_RECORD_LOSSES=1` rewrites it): a change to how the
/// model is recorded costs no op and no memory unseen. (Plans only: nothing is allocated.)
#[test]
fn small_plans_are_no_larger_than_recorded() {
    let path = common::repo_file("tests/data/train_plans.json");
    let mut recorded: std::collections::BTreeMap<String, [u64; 3]> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|_| "{}".into()))
            .unwrap();
    let record = std::env::var("MANTISSA_RECORD_LOSSES").is_ok_and(|v| v == "1");
    let corpus = corpus();
    let mut failures = vec![];
    let gpt2 = [Preset::True32, Preset::MixedBf16].map(|p| ("gpt2", p, 50257, true));
    let small = (Preset::ALL.iter())
        .flat_map(|&p| [true, false].map(|fused| ("small", p, corpus.vocab.len(), fused)));
    for (config, preset, vocab, fused) in small.chain(gpt2) {
        let mut o = options(&corpus, preset, 7);
        o.config = GptConfig::named(config, vocab).unwrap();
        let vocabulary = mantissa::model::vocabulary();
        let p = mantissa::policy::Precision::decide(
            &o.precision_request(),
            &Reference.capabilities(),
            &vocabulary,
        )
        .unwrap();
        let gpt = Gpt {
            config: o.config.clone(),
            backend: &Reference,
        };
        let plan = gpt
            .plan_with(&p, o.config.batch_size, o.config.block_size, fused, true)
            .unwrap();
        let shared = mantissa::plan::Storage::shared(&plan).bytes();
        let got = [plan.ops().len() as u64, plan.tensor_bytes(), shared];
        let key = format!("{config} {preset} fused={fused}");
        if record {
            recorded.insert(key, got);
        } else if !recorded
            .get(&key)
            .is_some_and(|r| got.iter().zip(r).all(|(g, r)| g <= r))
        {
            failures.push(format!(
                "{key}: [ops, tensor bytes, storage bytes] {got:?}, recorded {:?}",
                recorded.get(&key)
            ));
        }
    }
    if record {
        let text = serde_json::to_string_pretty(&recorded).unwrap();
        std::fs::write(&path, text + "\n").unwrap();
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The trained state in arenas (src/backend/wgpu/arena.rs): a backend told that its largest
/// binding holds 64 KiB, whose arenas take several segments (tiny's embedding alone is 16 KiB;
/// AdamW and the unscale a dispatch or two a segment), trains `tiny` as one whose arenas are
/// one segment, bit for bit, under 16-mixed and bf16-mixed: losses, gradient norms and (16-mixed)
/// a skipped step (an inf added to the first gradient, in its segment), then weights and
/// moments. And the update takes a few dispatches where a buffer per tensor took one per
/// tensor: AdamW at most two a segment, the unscale one a segment and its reduction.
/// wgpu's bias gradients summed by column sums of their own (`MANTISSA_BIAS_GRAD_IN_MATMUL=off`,
/// the alternative a GPU times against the default) train `tiny` under bf16-mixed to the bits
/// of those summed in the weight gradients' matmuls (the sums are held in bf16, so their
/// order does not show), with two launches more for each bias.
#[test]
fn bias_gradients_summed_apart_train_as_in_the_matmul() {
    use mantissa::backend::wgpu::WgpuOptions;
    let test = "bias_gradients_summed_apart_train_as_in_the_matmul";
    let Some(folded) = common::fresh_wgpu(test, WgpuOptions::default()) else {
        return;
    };
    let apart = WgpuOptions {
        bias_grad_in_matmul: false,
        ..WgpuOptions::default()
    };
    let Some(apart) = common::fresh_wgpu(test, apart) else {
        return;
    };
    let corpus = corpus();
    let preset = Preset::MixedBf16;
    let mut a = Trainer::new(&folded, &corpus, options(&corpus, preset, 5)).unwrap();
    let mut b = Trainer::new(&apart, &corpus, options(&corpus, preset, 5)).unwrap();
    for step in 0..2 {
        let (ra, rb) = (a.step().block_on().unwrap(), b.step().block_on().unwrap());
        assert_eq!(
            (ra.loss.to_bits(), ra.grad_norm.to_bits()),
            (rb.loss.to_bits(), rb.grad_norm.to_bits()),
            "step {step}"
        );
    }
    let biases = (a.plan().ops().iter())
        .filter(|op| matches!(op, Op::ColumnSums { .. }))
        .count();
    let total = |t: &Trainer| {
        t.launches()
            .expect("wgpu counts its launches")
            .iter()
            .sum::<usize>()
    };
    assert!(biases > 0);
    assert_eq!(total(&b), total(&a) + 2 * biases);
}

#[test]
fn arena_segments_train_as_one_segment() {
    use mantissa::backend::wgpu::WgpuOptions;
    let test = "arena_segments_train_as_one_segment";
    let Some(one) = common::fresh_wgpu(test, WgpuOptions::default()) else {
        return;
    };
    let options_many = WgpuOptions {
        assume_arena_binding: Some(64 << 10),
        ..WgpuOptions::default()
    };
    let Some(many) = common::fresh_wgpu(test, options_many) else {
        return;
    };
    let corpus = corpus();
    for preset in [Preset::Mixed16, Preset::MixedBf16] {
        let mut a = Trainer::new(&one, &corpus, options(&corpus, preset, 5)).unwrap();
        let mut b = Trainer::new(&many, &corpus, options(&corpus, preset, 5)).unwrap();
        for step in 0..3 {
            let (ra, rb) = match step {
                1 if preset == Preset::Mixed16 => (
                    a.step_injecting(f32::INFINITY).block_on().unwrap(),
                    b.step_injecting(f32::INFINITY).block_on().unwrap(),
                ),
                _ => (a.step().block_on().unwrap(), b.step().block_on().unwrap()),
            };
            assert_eq!(
                (ra.loss.to_bits(), ra.grad_norm.to_bits(), ra.skipped),
                (rb.loss.to_bits(), rb.grad_norm.to_bits(), rb.skipped),
                "{preset:?} step {step}"
            );
            assert_eq!(ra.skipped, step == 1 && preset == Preset::Mixed16);
        }
        assert_eq!(
            a.state().block_on().unwrap(),
            b.state().block_on().unwrap(),
            "{preset:?}: weights and moments"
        );
        // The update's dispatches: the unscale-and-check and AdamW ops' launches.
        let update = |t: &Trainer| {
            let launches = t.launches().expect("wgpu counts its launches");
            let ops = t.plan().ops();
            let of = |name: &str| -> usize {
                (ops.iter().zip(&launches))
                    .filter(|(op, _)| op.name() == name)
                    .map(|(_, &n)| n)
                    .sum()
            };
            (of("unscale and check"), of("adamw"))
        };
        let params = a
            .plan()
            .ops()
            .iter()
            .filter(|op| op.name() == "adamw")
            .count();
        assert_eq!(params, 1);
        let (unscale, adamw) = update(&a);
        assert!(
            unscale <= 2 && adamw <= 2,
            "one segment: {unscale} + {adamw}"
        );
        let (unscale_many, adamw_many) = update(&b);
        assert!(
            unscale_many > 2 && adamw_many > 2 && unscale_many < 2 * 30,
            "several segments: {unscale_many} + {adamw_many}"
        );
    }
}

/// `--grad-accum`: the GPT's batch of 16 in 4 micro-batches of 4 takes the steps of the batch
/// run whole (losses within 1e-6 over three steps at 32-true, and the same validation loss);
/// a count that does not divide the batch, or 0, is refused naming the share and its divisors.
#[test]
fn gradient_accumulation_trains_the_gpt_as_the_whole_batch() {
    let corpus = corpus();
    let mut whole = Trainer::new(&Reference, &corpus, options(&corpus, Preset::True32, 3)).unwrap();
    let split = TrainOptions {
        grad_accum: 4,
        ..options(&corpus, Preset::True32, 3)
    };
    let mut split = Trainer::new(&Reference, &corpus, split).unwrap();
    assert_eq!(split.plan().rows(), whole.plan().rows() / 4);
    for step in 1..=3 {
        let (a, m) = (
            whole.step().block_on().unwrap(),
            split.step().block_on().unwrap(),
        );
        assert!(
            (a.loss - m.loss).abs() <= 1e-6 * a.loss,
            "step {step}: {} vs {}",
            a.loss,
            m.loss
        );
        assert_eq!(a.tokens_per_s.is_finite(), m.tokens_per_s.is_finite());
    }
    let (a, m) = (
        whole.evaluate(2).block_on().unwrap(),
        split.evaluate(2).block_on().unwrap(),
    );
    assert!((a - m).abs() <= 1e-6 * a, "validation {a} vs {m}");
    for bad in [3, 0, 32] {
        let o = TrainOptions {
            grad_accum: bad,
            ..options(&corpus, Preset::True32, 3)
        };
        let e = Trainer::new(&Reference, &corpus, o)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("--grad-accum") && e.contains("share of 16 sequences"),
            "{bad}: {e}"
        );
    }
}

/// `--config gpt2`: GPT-2 124M (124,475,904 parameters with its vocabulary of 50257 padded to
/// 50304, as nanoGPT counts them with the position embedding) on GPT-2's BPE of the corpus. At a
/// batch of one sequence of 16 tokens, two bf16-mixed steps on the host reference and on wgpu
/// give the same losses (the same function everywhere), the first near ln 50304 (a uniform
/// guess over the head's rows), the second lower.
#[test]
fn gpt2_is_the_same_function_on_the_reference_and_wgpu() {
    use mantissa::train::{Tokenizer, Vocab};
    let corpus =
        Corpus::load_as(&common::repo_file("data/shakespeare.txt"), Tokenizer::Gpt2).unwrap();
    assert_eq!(corpus.vocab, Vocab::Gpt2);
    // GPT-2's tokens of the corpus's first words ("HAMLET, PRINCE OF DENMARK").
    assert_eq!(corpus.train[..4], [33363, 28882, 11, 4810]);
    let mut config = GptConfig::named("gpt2", corpus.vocab.len()).unwrap();
    assert_eq!(
        (config.vocab_size, config.parameter_count()),
        (50304, 124_475_904)
    );
    (config.batch_size, config.block_size) = (1, 16);
    let losses = |b: &dyn Backend| {
        let options = TrainOptions {
            graphs: Some(false),
            fused_attention: Some(false),
            ..TrainOptions::new(config.clone(), Preset::MixedBf16, 7)
        };
        let mut t = Trainer::new(b, &corpus, options).unwrap();
        [(); 2].map(|_| t.step().block_on().unwrap().loss)
    };
    let on_reference = losses(&Reference);
    let uniform = (50304f64).ln();
    assert!((on_reference[0] - uniform).abs() < 0.5, "{on_reference:?}");
    assert!(on_reference[1] < on_reference[0], "{on_reference:?}");
    common::on(common::wgpu(), "gpt2_on_wgpu", |b| {
        // The f32 token embedding (and head) is 147 MiB: an adapter that binds less at once
        // (lavapipe of Mesa 22, a browser's default of 128 MiB) refuses the plan, naming why.
        let options = TrainOptions::new(config.clone(), Preset::MixedBf16, 7);
        let prepared = Trainer::new(b, &corpus, options).and_then(|mut t| t.prepare().block_on());
        if let Err(e) = prepared {
            let said = e.to_string();
            assert!(said.contains("max_storage_buffer_binding_size"), "{said}");
            common::skip("gpt2_on_wgpu", &format!("{}: {said}", b.name()));
            return;
        }
        let on_wgpu = losses(b);
        for (r, w) in on_reference.iter().zip(&on_wgpu) {
            assert!((r - w).abs() < 2e-3 * r, "{on_reference:?} vs {on_wgpu:?}");
        }
    });
}
