//! The one step loop (`ModelTrainer`) that every built model trains through, the GPT among
//! them: checkpoints of a built model resume bit for bit, a checkpoint or an initial-weights
//! file of another model is refused with the names that differ, a data-parallel run of a built
//! model applies the one-rank update, the measured choices are made for any model, and a step
//! whose gradients are not finite is skipped under loss scaling and `Diverged` without it.

mod common;

use mantissa::Error;
use mantissa::backend::{Backend, Reference};
use mantissa::choice::{self, Chooser, ChosenBy};
use mantissa::dist::{Reducer, Reduction};
use mantissa::model::{Init, Model, ModelBuilder, ModelTrainer, RunOptions, Stepped};
use mantissa::policy::Preset;
use mantissa::policy::precision::PrecisionRequest;
use mantissa::train::checkpoint::{Checkpoint, Expected};
use mantissa::train::init::{read_params, write_params};
use mantissa::tune::AutotuneMode;
use pollster::FutureExt as _;

const VOCAB: usize = 7;
const SEQUENCES: usize = 2;
const T: usize = 4;

/// A small language model with every kind of state a run carries: dropout (its masks keyed by
/// the step), a layer norm, causal attention, linear layers with biases, a tied head.
/// `head` names the second linear layer's weight (another name makes another model).
fn language_model(head: &str) -> Model {
    language_model_of(head, true)
}

/// `language_model`, with its dropout or without.
fn language_model_of(head: &str, dropout: bool) -> Model {
    language_model_on(head, dropout, SEQUENCES)
}

/// `language_model_of` on a batch of `sequences`.
fn language_model_on(head: &str, dropout: bool, sequences: usize) -> Model {
    let c = 8;
    let mut m = ModelBuilder::new();
    let tokens = m.tokens(&[sequences, T]).unwrap();
    let targets = m.targets(&[sequences, T]).unwrap();
    let normal = Init::Normal { std: 0.2 };
    let wte = m.param("wte", &[VOCAB, c], normal, true).unwrap();
    let g = m.param("ln.g", &[c], Init::Ones, false).unwrap();
    let b = m.param("ln.b", &[c], Init::Zeros, false).unwrap();
    let qkv_w = m.param("attn.w", &[c, 3 * c], normal, true).unwrap();
    let qkv_b = m.param("attn.b", &[3 * c], Init::Zeros, false).unwrap();
    let proj_w = m.param(head, &[c, c], normal, true).unwrap();
    let proj_b = m.param("proj.b", &[c], Init::Zeros, false).unwrap();
    let x = m.embedding(wte, tokens).unwrap();
    let h = m.layer_norm(x, g, b).unwrap();
    let qkv = m.linear(h, qkv_w, qkv_b).unwrap();
    let heads = m.causal_attention(qkv, 2).unwrap();
    let heads = if dropout {
        m.dropout(heads, 0.25).unwrap()
    } else {
        heads
    };
    let h = m.linear(heads, proj_w, proj_b).unwrap();
    let x = m.add(x, h).unwrap();
    let logits = m.matmul(x, wte, true).unwrap();
    let loss = m.cross_entropy(logits, targets).unwrap();
    m.finish(loss).unwrap()
}

/// Batch `i`: token ids and next-token targets.
fn batch(i: u32) -> (Vec<u32>, Vec<u32>) {
    let n = (SEQUENCES * T) as u32;
    let ids = (0..n).map(|k| (k * 3 + i) % VOCAB as u32).collect();
    let targets = (0..n).map(|k| (k * 5 + 2 * i + 1) % VOCAB as u32).collect();
    (ids, targets)
}

fn trainer<'a>(b: &'a dyn Backend, preset: Preset, options: RunOptions<'a>) -> ModelTrainer<'a> {
    let mut t = ModelTrainer::with_options(
        b,
        language_model("proj.w"),
        &PrecisionRequest::of(preset),
        options,
    )
    .unwrap();
    t.adamw.lr = 1e-2;
    t.grad_clip = 1.0;
    t
}

/// `steps` steps from step `from`: each step's (loss bits, skipped).
fn train(t: &mut ModelTrainer, from: u32, steps: u32) -> Vec<(u64, bool)> {
    (from..from + steps)
        .map(|i| {
            let (ids, targets) = batch(i);
            let s = t.step(&ids, &targets).block_on().unwrap();
            (s.loss.to_bits(), s.skipped)
        })
        .collect()
}

/// A built model's run stopped after 3 steps, written to a checkpoint and resumed by a fresh
/// trainer, takes the steps the unbroken run takes, to the bit: losses, dropout masks (keyed by
/// the step), the loss scale, AdamW's moments and step count, the parameters. Under 16-mixed
/// (GradScaler's state) and bf16-mixed.
fn checkpoints_resume_bit_for_bit(b: &dyn Backend) {
    let dir = tempfile::tempdir().unwrap();
    for preset in [Preset::Mixed16, Preset::MixedBf16] {
        let mut unbroken = trainer(b, preset, RunOptions::new(11));
        let all = train(&mut unbroken, 0, 6);
        let mut first = trainer(b, preset, RunOptions::new(11));
        let mut losses = train(&mut first, 0, 3);
        let path = dir.path().join(format!("{preset}.safetensors"));
        Checkpoint::save(&mut first, None, &path)
            .block_on()
            .unwrap();
        drop(first);
        let mut resumed = trainer(b, preset, RunOptions::new(11));
        let ck = Checkpoint::load(&path, &Expected::model(&resumed.model)).unwrap();
        assert!(
            ck.meta.gpt.is_none(),
            "a built model's checkpoint holds no GPT configuration"
        );
        ck.restore(&mut resumed).block_on().unwrap();
        assert_eq!(resumed.steps, 3, "{preset}");
        losses.extend(train(&mut resumed, 3, 3));
        assert_eq!(
            losses,
            all,
            "{preset} on {}: losses differ after the resume",
            b.name()
        );
        assert_eq!(
            resumed.scaler.map(|s| s.scale.to_bits()),
            unbroken.scaler.map(|s| s.scale.to_bits()),
            "{preset}"
        );
        assert_eq!(resumed.applied, unbroken.applied, "{preset}");
        assert!(
            resumed.state().block_on().unwrap() == unbroken.state().block_on().unwrap(),
            "{preset} on {}: parameters or moments differ after the resume",
            b.name()
        );
    }
}

#[test]
fn checkpoints_resume_bit_for_bit_on_the_reference() {
    checkpoints_resume_bit_for_bit(&Reference);
}

#[test]
fn checkpoints_resume_bit_for_bit_on_wgpu() {
    common::on(
        common::wgpu(),
        "checkpoints_resume_bit_for_bit_on_wgpu",
        |b| checkpoints_resume_bit_for_bit(b),
    );
}

/// A checkpoint, and a file of initial parameters, of another model are refused with the
/// names that differ; the model's own initial parameters round-trip by name.
#[test]
fn another_models_files_are_refused_by_the_names_that_differ() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = trainer(&Reference, Preset::True32, RunOptions::new(3));
    train(&mut t, 0, 1);
    let ck = dir.path().join("ck.safetensors");
    Checkpoint::save(&mut t, None, &ck).block_on().unwrap();
    let other = language_model("out.w");
    let said = Checkpoint::load(&ck, &Expected::model(&other))
        .err()
        .expect("another model's checkpoint loaded")
        .to_string();
    assert!(
        said.contains("another model")
            && said.contains("param.proj.w")
            && said.contains("lacks")
            && said.contains("param.out.w"),
        "{said}"
    );
    // The same checkpoint is initial parameters for its own model (its moments left aside).
    let params = t.params().block_on().unwrap();
    assert_eq!(read_params(&ck, &t.model).unwrap(), params);
    let said = read_params(&ck, &other).unwrap_err().to_string();
    assert!(said.contains("param.out.w"), "{said}");
    // Parameters by name: written, read back, refused for the other model by name.
    let init = dir.path().join("init.safetensors");
    write_params(&init, &t.model, &params).unwrap();
    assert_eq!(read_params(&init, &t.model).unwrap(), params);
    let e = read_params(&init, &other).unwrap_err();
    assert_eq!(e.class(), mantissa::error::ErrorClass::BadInput, "{e}");
    let said = e.to_string();
    assert!(
        said.contains("it holds proj.w that the model has not") && said.contains("lacks out.w"),
        "{said}"
    );
    // A GPT's expectations refuse a built model's checkpoint, saying what it is.
    let config = mantissa::train::GptConfig::named("tiny", VOCAB).unwrap();
    let vocab = mantissa::train::Vocab::Chars("abcdefg".chars().collect());
    let said = Checkpoint::load(&ck, &Expected::gpt(&config, &vocab))
        .err()
        .expect("a built model's checkpoint loaded as the GPT's")
        .to_string();
    assert!(said.contains("built model"), "{said}");
}

/// Step `i` of each trainer on batch `i`, an inf injected into 16-mixed's third step (its
/// GradScaler skips it; the other presets would diverge); the steps and the poison.
fn steps_of(trainers: [&mut ModelTrainer; 2], preset: Preset, i: u32) -> ([Stepped; 2], f32) {
    let (ids, targets) = batch(i);
    let poison = match preset == Preset::Mixed16 && i == 2 {
        true => f32::INFINITY,
        false => 0.0,
    };
    let step = |t: &mut ModelTrainer| t.step_injecting(&ids, &targets, poison).block_on().unwrap();
    (trainers.map(step), poison)
}

/// A built model trained data parallel (two ranks of the same batch, its gradients summed in
/// buckets through the reduction engine) takes the one-rank steps bit for bit, a GradScaler skip
/// included, and records its reduction.
fn data_parallel_is_the_one_rank_run(b: &dyn Backend) {
    for preset in [Preset::MixedBf16, Preset::Mixed16] {
        let mut alone = trainer(b, preset, RunOptions::new(5));
        let options = RunOptions {
            group: &common::Twins,
            reduction: Reduction {
                reducer: Reducer::Mpi,
                bucket_bytes: 1024,
                overlap: true,
            },
            ..RunOptions::new(5)
        };
        let mut twins = trainer(b, preset, options);
        for i in 0..4 {
            let ([a, d], poison) = steps_of([&mut alone, &mut twins], preset, i);
            assert_eq!(
                (a.loss.to_bits(), a.grad_norm.to_bits(), a.skipped),
                (d.loss.to_bits(), d.grad_norm.to_bits(), d.skipped),
                "{preset} step {i} on {}",
                b.name()
            );
            assert_eq!(d.skipped, poison != 0.0, "{preset} step {i}");
        }
        let reduced = twins
            .reduced
            .clone()
            .expect("a data-parallel step records its sum");
        assert!(
            reduced.calls > 1 && reduced.engine.contains("twins"),
            "{reduced:?}"
        );
        assert!(alone.reduced.is_none());
        assert!(
            alone.state().block_on().unwrap() == twins.state().block_on().unwrap(),
            "{preset} on {}: the data-parallel run's state differs",
            b.name()
        );
    }
}

#[test]
fn data_parallel_is_the_one_rank_run_on_the_reference() {
    data_parallel_is_the_one_rank_run(&Reference);
}

#[test]
fn data_parallel_is_the_one_rank_run_on_wgpu() {
    common::on(common::wgpu(), "data_parallel_built_model_on_wgpu", |b| {
        data_parallel_is_the_one_rank_run(b)
    });
}

/// The measured choices are any model's: a model with causal attention times both ways (and
/// trains as the way chosen named), one without attention has nothing to choose.
#[test]
fn any_model_has_the_measured_choices() {
    let mut chooser = Chooser::new(AutotuneMode::Fast, None, choice::wall_clock());
    (chooser.warmup, chooser.runs) = (1, 3);
    let (ids, targets) = batch(0);
    let mut auto = trainer(&Reference, Preset::MixedBf16, RunOptions::new(9));
    let chosen = auto
        .choose(&chooser, &ids, &targets)
        .block_on()
        .unwrap()
        .clone();
    assert!(
        matches!(chosen.by, ChosenBy::Timed | ChosenBy::Cached),
        "{chosen:?}"
    );
    assert!(
        chosen.chosen == "fused" || chosen.chosen == "unfused",
        "{chosen:?}"
    );
    let named = RunOptions {
        fused_attention: Some(chosen.chosen == "fused"),
        ..RunOptions::new(9)
    };
    let mut named = trainer(&Reference, Preset::MixedBf16, named);
    assert_eq!(train(&mut auto, 0, 3), train(&mut named, 0, 3));
    // No attention: nothing to time.
    let mut m = ModelBuilder::new();
    let (tokens, targets_var) = (m.tokens(&[4]).unwrap(), m.targets(&[4]).unwrap());
    let wte = m
        .param("wte", &[VOCAB, 3], Init::Normal { std: 0.5 }, true)
        .unwrap();
    let x = m.embedding(wte, tokens).unwrap();
    let logits = m.matmul(x, wte, true).unwrap();
    let loss = m.cross_entropy(logits, targets_var).unwrap();
    let model = m.finish(loss).unwrap();
    let mut t = ModelTrainer::new(
        &Reference,
        model,
        &PrecisionRequest::of(Preset::True32),
        None,
        1,
    )
    .unwrap();
    let ids: Vec<u32> = vec![1, 2, 3, 4];
    let choice = t.choose(&chooser, &ids, &ids).block_on().unwrap();
    assert_eq!(
        (choice.chosen.as_str(), choice.by),
        ("none", ChosenBy::Default)
    );
}

/// Whether a step applied, was skipped or diverged is decided in one place, for the GPT and
/// every built model alike: an inf in a gradient is a skipped step under loss scaling (the
/// scale backs off) and `Diverged` without it; either way nothing is updated.
#[test]
fn a_non_finite_gradient_skips_under_loss_scaling_and_diverges_without() {
    let (ids, targets) = batch(0);
    for preset in [Preset::Mixed16, Preset::True32, Preset::MixedBf16] {
        let mut t = trainer(&Reference, preset, RunOptions::new(2));
        let before = t.state().block_on().unwrap();
        let stepped = t.step_injecting(&ids, &targets, f32::INFINITY).block_on();
        match (preset, stepped) {
            (Preset::Mixed16, Ok(s)) => assert!(s.skipped, "{s:?}"),
            (Preset::Mixed16, Err(e)) => panic!("16-mixed: {e}"),
            (_, Err(e @ Error::Diverged { .. })) => {
                assert!(e.to_string().contains("non-finite gradients"), "{e}")
            }
            (_, other) => panic!("{preset}: {other:?}"),
        }
        assert_eq!((t.steps, t.applied), (1, 0), "{preset}");
        assert!(
            t.state().block_on().unwrap() == before,
            "{preset}: a parameter moved"
        );
    }
}

/// In evaluation mode (`training` off) dropout passes its input through: the model's loss and
/// gradients are the bits of the same model without its dropout; back in training, the masks
/// apply again.
fn evaluation_passes_dropout_through(b: &dyn Backend) {
    for preset in [Preset::True32, Preset::MixedBf16] {
        let request = PrecisionRequest::of(preset);
        let open = |dropout| {
            let model = language_model_of("proj.w", dropout);
            ModelTrainer::new(b, model, &request, None, 5).unwrap()
        };
        let (mut with, mut without) = (open(true), open(false));
        let (ids, targets) = batch(0);
        let training = with.loss(&ids, &targets).block_on().unwrap();
        with.training = false;
        let (evaluated, grads) = with.gradients(&ids, &targets).block_on().unwrap();
        let (plain, plain_grads) = without.gradients(&ids, &targets).block_on().unwrap();
        let what = format!("{} {preset}", b.name());
        assert_eq!(
            evaluated.to_bits(),
            plain.to_bits(),
            "{what}: evaluated loss"
        );
        assert_ne!(
            training, evaluated,
            "{what}: the masks changed nothing in training"
        );
        for (g, p) in grads.iter().zip(&plain_grads) {
            assert!(common::same_bits(g, p), "{what}: evaluated gradients");
        }
        with.training = true;
        let again = with.loss(&ids, &targets).block_on().unwrap();
        assert_eq!(
            again.to_bits(),
            training.to_bits(),
            "{what}: training again"
        );
    }
}

#[test]
fn evaluation_passes_dropout_through_on_the_reference() {
    evaluation_passes_dropout_through(&Reference);
}

#[test]
fn evaluation_passes_dropout_through_on_wgpu() {
    common::on(
        common::wgpu(),
        "evaluation_passes_dropout_through_on_wgpu",
        |b| evaluation_passes_dropout_through(b),
    );
}

/// A step of micro-batches (gradient accumulation: the model built on one sequence, each step
/// taking two) is the step of the batch run whole: the same dropout masks (counted over the
/// whole batch), and over four steps the losses, gradient norms and then the gradients equal up
/// to the order of f32 additions (measured on both backends: losses within 6e-8 and gradients
/// 3.2e-7 at 32-true; f16's roundings of different sums give 4e-5 and 1.6e-3 at 16-mixed),
/// a GradScaler skip on the same step, and the same through a data-parallel sum (two ranks of
/// the same batch, each in micro-batches, at bf16-mixed). The parameters are not compared:
/// Adam turns the rounding noise of a gradient that is zero by definition (the key bias's:
/// softmax ignores a shift of a row) into steps of the learning rate.
fn micro_batches_take_the_whole_batch_s_step(b: &dyn Backend) {
    for (preset, (tolerance, gradients), twins) in [
        (Preset::True32, (1e-6, 1e-5), false),
        (Preset::Mixed16, (2e-4, 5e-3), false),
        (Preset::MixedBf16, (2e-4, 5e-3), true),
    ] {
        let mut whole = trainer(b, preset, RunOptions::new(5));
        let group: &dyn mantissa::dist::Collective = match twins {
            true => &common::Twins,
            false => &mantissa::dist::Single,
        };
        let options = RunOptions {
            micro_batches: SEQUENCES,
            group,
            ..RunOptions::new(5)
        };
        let model = language_model_on("proj.w", true, 1);
        let mut split =
            ModelTrainer::with_options(b, model, &PrecisionRequest::of(preset), options).unwrap();
        split.adamw.lr = 1e-2;
        split.grad_clip = 1.0;
        let what = format!("{preset} on {}", b.name());
        let close = |a: f64, b: f64| a == b || (a - b).abs() <= tolerance * a.abs().max(1.0);
        for i in 0..4 {
            let ([a, m], poison) = steps_of([&mut whole, &mut split], preset, i);
            assert!(
                close(a.loss, m.loss),
                "{what} step {i}: loss {} vs {}",
                a.loss,
                m.loss
            );
            assert!(
                close(a.grad_norm, m.grad_norm),
                "{what} step {i}: norm {a:?} vs {m:?}"
            );
            assert_eq!(
                (a.skipped, m.skipped),
                (poison != 0.0, poison != 0.0),
                "{what} step {i}"
            );
        }
        assert_eq!(
            (whole.applied, whole.scaler.map(|s| s.scale.to_bits())),
            (split.applied, split.scaler.map(|s| s.scale.to_bits())),
            "{what}"
        );
        if twins {
            assert!(
                split.reduced.as_ref().is_some_and(|r| r.calls > 0),
                "{what}: no sum"
            );
        }
        // The loss and the gradients outside a step are the whole batch's too.
        let (ids, targets) = batch(7);
        let (la, ga) = whole.gradients(&ids, &targets).block_on().unwrap();
        let (lm, gm) = split.gradients(&ids, &targets).block_on().unwrap();
        assert!(close(la, lm), "{what}: loss {la} vs {lm}");
        if !twins {
            for (g, (a, m)) in ga.iter().zip(&gm).enumerate() {
                let scale = a.iter().fold(0.0f32, |s, x| s.max(x.abs())).max(1e-3);
                let worst = a
                    .iter()
                    .zip(m)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    f64::from(worst / scale) <= gradients,
                    "{what}: gradient {g} differs by {worst}"
                );
            }
        }
    }
}

#[test]
fn micro_batches_take_the_whole_batch_s_step_on_the_reference() {
    micro_batches_take_the_whole_batch_s_step(&Reference);
}

#[test]
fn micro_batches_take_the_whole_batch_s_step_on_wgpu() {
    common::on(
        common::wgpu(),
        "micro_batches_take_the_whole_batch_s_step_on_wgpu",
        |b| micro_batches_take_the_whole_batch_s_step(b),
    );
}

/// Micro-batches: none is refused; a batch is every micro-batch's ids one after another, and
/// one of another length is refused saying so.
#[test]
fn micro_batches_refuse_what_they_cannot_take() {
    let model = || language_model_on("proj.w", false, 1);
    let request = PrecisionRequest::of(Preset::True32);
    let none = RunOptions {
        micro_batches: 0,
        ..RunOptions::new(1)
    };
    let e = ModelTrainer::with_options(&Reference, model(), &request, none)
        .err()
        .unwrap();
    assert!(e.to_string().contains("micro-batches"), "{e}");
    let three = RunOptions {
        micro_batches: 3,
        ..RunOptions::new(1)
    };
    let mut t = ModelTrainer::with_options(&Reference, model(), &request, three).unwrap();
    let (ids, targets) = batch(0);
    let e = t.step(&ids, &targets).block_on().unwrap_err().to_string();
    assert!(
        e.contains("12 token ids in 3 micro-batches of 4") && e.contains("got 8"),
        "{e}"
    );
    assert_eq!(t.steps, 0);
}
