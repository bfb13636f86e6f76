//! The precision policy: class resolution, presets, autocast, GradScaler, delayed scaling.

use mantissa::algorithm::Algorithm;
use mantissa::format::Format;
use mantissa::policy::*;

#[test]
fn precision_classes_resolve_by_capabilities() {
    let simt = Capabilities::default();
    assert_eq!(PrecisionClass::Highest.resolve(&simt), Algorithm::F32);
    assert_eq!(PrecisionClass::High.resolve(&simt), Algorithm::F32);
    assert_eq!(PrecisionClass::Medium.resolve(&simt), Algorithm::F32);
    let tensor_cores = Capabilities {
        accelerated: vec![Algorithm::Tf32, Algorithm::Bf16, Algorithm::F16],
        ..Capabilities::default()
    };
    assert_eq!(
        PrecisionClass::Highest.resolve(&tensor_cores),
        Algorithm::F32
    );
    assert_eq!(PrecisionClass::High.resolve(&tensor_cores), Algorithm::Tf32);
    assert_eq!(
        PrecisionClass::Medium.resolve(&tensor_cores),
        Algorithm::Bf16
    );
    // medium falls back to high's choice.
    let tf32_only = Capabilities {
        accelerated: vec![Algorithm::Tf32],
        ..Capabilities::default()
    };
    assert_eq!(PrecisionClass::Medium.resolve(&tf32_only), Algorithm::Tf32);
    // WGSL on cooperative matrices: f16 operands, no tf32, so high is bf16x3.
    let coop = Capabilities {
        accelerated: vec![Algorithm::F16, Algorithm::Bf16, Algorithm::Bf16x3],
        ..Capabilities::default()
    };
    assert_eq!(PrecisionClass::High.resolve(&coop), Algorithm::Bf16x3);
    assert_eq!(PrecisionClass::Medium.resolve(&coop), Algorithm::Bf16);
}

#[test]
fn preset_names_and_specs() {
    for p in Preset::ALL {
        assert_eq!(p.name().parse::<Preset>().unwrap(), *p);
    }
    let err = "bf16-half".parse::<Preset>().unwrap_err().to_string();
    assert!(
        err.contains("bf16-mixed") && err.contains("transformer-engine"),
        "{err}"
    );
    let mixed16 = Preset::Mixed16.spec();
    assert_eq!(
        (mixed16.compute, mixed16.params, mixed16.master_weights),
        (Format::F16, Format::F32, true)
    );
    assert_eq!(mixed16.loss_scaling, Some(LossScaleConfig::default()));
    assert!(
        Preset::MixedBf16.spec().loss_scaling.is_none(),
        "bf16 presets do not scale by default"
    );
    assert_eq!(Preset::TrueBf16.spec().params, Format::Bf16);
    assert!(Preset::TransformerEngine.spec().fp8.is_some());
    assert_eq!(
        "HIGH".parse::<PrecisionClass>().unwrap(),
        PrecisionClass::High
    );
}

/// The kind of the builder's op `name` (`model::vocabulary`, the one op vocabulary).
fn kind(name: &str) -> OpKind {
    let vocabulary = mantissa::model::vocabulary();
    *(vocabulary.iter().find(|k| k.name == name)).unwrap_or_else(|| panic!("no op {name}"))
}

/// The precision of a bf16 step under `preset` and `overrides`, on the reference.
fn decide(preset: Preset, overrides: &str) -> mantissa::Result<Precision> {
    use mantissa::backend::{Backend, reference::Reference};
    let request = precision::PrecisionRequest {
        autocast_overrides: overrides,
        ..precision::PrecisionRequest::of(preset)
    };
    Precision::decide(
        &request,
        &Reference.capabilities(),
        &mantissa::model::vocabulary(),
    )
}

/// Every op of the builder is in the class PyTorch's CUDA autocast lists give the torch op it
/// computes: the lower-precision list (linear, matmul, bmm; attention is two bmms), the f32
/// list (softmax, layer_norm, rms_norm, sum, cross_entropy, mse_loss), and the rest in their
/// inputs' dtype; the losses are f32 under every preset.
#[test]
fn every_op_is_in_autocasts_class() {
    let matmul_like = ["linear", "matmul", "bmm", "attention", "causal_attention"];
    let f32_list = ["softmax", "causal_softmax", "layer_norm", "rms_norm", "sum"];
    let losses = ["cross_entropy", "mse"];
    let vocabulary = mantissa::model::vocabulary();
    assert!(vocabulary.len() >= 25, "{vocabulary:?}");
    for op in &vocabulary {
        let class = if matmul_like.contains(&op.name) {
            OpClass::MatmulLike
        } else if f32_list.contains(&op.name) || losses.contains(&op.name) {
            OpClass::F32
        } else {
            OpClass::Input
        };
        assert_eq!(
            (op.class, op.loss),
            (class, losses.contains(&op.name)),
            "{op:?}"
        );
        let twins = vocabulary.iter().filter(|o| o.name == op.name).count();
        assert_eq!(twins, 1, "{} is in the vocabulary {twins} times", op.name);
    }
    for name in [
        "gelu", "silu", "relu", "sigmoid", "tanh", "add", "mul", "mean", "concat",
    ] {
        assert_eq!(kind(name).class, OpClass::Input, "{name}");
    }
}

/// The format a step holds each op's output in: the class's under a mixed preset, the 16-bit
/// stream's for the f32 class under a "true" one (losses stay f32), and the overrides'.
#[test]
fn autocast_classes_and_overrides() {
    let p = decide(Preset::MixedBf16, "").unwrap();
    for (op, input, held) in [
        ("linear", Format::F32, Format::Bf16),
        ("causal_attention", Format::F32, Format::Bf16),
        ("softmax", Format::Bf16, Format::F32),
        ("layer_norm", Format::Bf16, Format::F32),
        ("rms_norm", Format::Bf16, Format::F32),
        ("sum", Format::Bf16, Format::F32),
        ("mse", Format::Bf16, Format::F32),
        ("gelu", Format::Bf16, Format::Bf16),
        ("silu", Format::Bf16, Format::Bf16),
        ("add", Format::F32, Format::F32),
        ("mul", Format::F16, Format::F16),
        ("mean", Format::Bf16, Format::Bf16),
    ] {
        assert_eq!(
            p.held(kind(op), input),
            held,
            "{op} of {input} under bf16-mixed"
        );
    }
    let p = decide(Preset::TrueBf16, "").unwrap();
    assert_eq!(p.held(kind("layer_norm"), Format::Bf16), Format::Bf16);
    assert_eq!(p.held(kind("softmax"), Format::Bf16), Format::Bf16);
    assert_eq!(p.held(kind("cross_entropy"), Format::Bf16), Format::F32);
    let p = decide(Preset::MixedBf16, "rms_norm=bf16").unwrap();
    assert_eq!(p.held(kind("rms_norm"), Format::F32), Format::Bf16);
    assert_eq!(p.held(kind("layer_norm"), Format::F32), Format::F32);
    let p = decide(Preset::MixedBf16, "softmax=bf16, LINEAR=f32, sum=f16").unwrap();
    assert_eq!(p.held(kind("softmax"), Format::F32), Format::Bf16);
    assert_eq!(p.held(kind("causal_softmax"), Format::F32), Format::F32);
    assert_eq!(p.held(kind("sum"), Format::F32), Format::F16);
    assert_eq!((p.compute, p.matmul), (Format::F32, Algorithm::F32));
    for (spec, says) in [
        ("softmax", "OP=FORMAT"),
        ("softmax=bf16,", "OP=FORMAT"),
        ("softmax=bf16,softmax=f16", "twice"),
        ("softmax=e4m3", "f32, bf16 or f16"),
        ("linear=e4m3", "cannot compute in e4m3"),
    ] {
        let err = decide(Preset::MixedBf16, spec).unwrap_err();
        let said = err.to_string();
        assert!(said.contains(says), "{spec}: {said}");
        assert_eq!(mantissa::cli::exit_code(&err), 2, "{said}");
    }
    // An op the builder does not have is refused (bad input), the name given and every op of
    // the vocabulary named.
    let err = decide(Preset::MixedBf16, "softmux=f32").unwrap_err();
    let said = err.to_string();
    assert!(said.contains("softmux"), "{said}");
    for op in mantissa::model::vocabulary() {
        assert!(said.contains(op.name), "{said} does not name {}", op.name);
    }
    assert_eq!(mantissa::cli::exit_code(&err), 2, "{said}");
}

/// A training step takes overrides of the ops whose format it holds by op (linear, the f32
/// class's ops that hold an output); an override of any other op would change nothing and is
/// refused, naming the op and the ones it takes.
#[test]
fn a_step_refuses_overrides_it_would_not_honour() {
    let p = decide(
        Preset::MixedBf16,
        "softmax=bf16,layer_norm=bf16,rms_norm=f16,linear=f32",
    )
    .unwrap();
    let held = |op| p.held(kind(op), Format::F32);
    assert_eq!(
        (
            held("softmax"),
            held("layer_norm"),
            held("rms_norm"),
            p.compute
        ),
        (Format::Bf16, Format::Bf16, Format::F16, Format::F32)
    );
    for (op, follows) in [
        ("gelu", "its input's"),
        ("mul", "its input's"),
        ("matmul", "the linear layers'"),
        ("causal_attention", "the linear layers'"),
        ("cross_entropy", "f32"),
    ] {
        let err = decide(Preset::MixedBf16, &format!("{op}=f32")).unwrap_err();
        let said = err.to_string();
        let takes = "linear, layer_norm, rms_norm, softmax, causal_softmax, sum";
        for part in [op, follows, takes] {
            assert!(said.contains(part), "{said} does not say {part}");
        }
        assert_eq!(mantissa::cli::exit_code(&err), 2, "{said}");
    }
}

#[test]
fn grad_scaler_backs_off_skips_and_grows() {
    let mut s = LossScaler::new(LossScaleConfig::default());
    assert_eq!(s.scale, 65536.0);
    assert_eq!(s.update(false), StepDecision::Skip);
    assert_eq!(s.scale, 32768.0);
    for step in 0..1999 {
        assert_eq!(s.update(true), StepDecision::Apply);
        assert_eq!(
            s.scale, 32768.0,
            "no growth before 2000 clean steps (step {step})"
        );
    }
    s.update(true);
    assert_eq!(s.scale, 65536.0, "2000 clean steps double the scale");
    // An overflow resets the count of clean steps.
    for _ in 0..1500 {
        s.update(true);
    }
    s.update(false);
    for _ in 0..1999 {
        s.update(true);
    }
    assert_eq!(s.scale, 32768.0);
    assert_eq!(s.inverse(), 1.0 / 32768.0);
}

#[test]
fn delayed_scaling_keeps_an_amax_history() {
    let recipe = Fp8Recipe::default();
    let Fp8Recipe::Delayed {
        formats,
        history_len,
        amax_compute,
        margin,
    } = recipe
    else {
        panic!("default is delayed")
    };
    assert_eq!(
        (formats, history_len, amax_compute, margin),
        (Fp8Formats::Hybrid, 1024, AmaxCompute::Max, 0)
    );
    assert_eq!(formats.forward(), Format::E4m3);
    assert_eq!(formats.backward(), Format::E5m2);
    let short = Fp8Recipe::Delayed {
        formats,
        history_len: 3,
        amax_compute: AmaxCompute::Max,
        margin: 1,
    };
    let mut d = DelayedScaling::new(Format::E4m3, &short).unwrap();
    // s = 448 / amax / 2^margin, amax = max over the last 3 steps.
    assert_eq!(d.record(4.0), 448.0 / 4.0 / 2.0);
    assert_eq!(d.record(2.0), 448.0 / 4.0 / 2.0);
    assert_eq!(d.record(1.0), 448.0 / 4.0 / 2.0);
    assert_eq!(d.record(1.0), 448.0 / 2.0 / 2.0, "4.0 left the history");
    assert_eq!(
        d.record(f32::INFINITY),
        448.0 / 2.0 / 2.0,
        "an overflowing step is not recorded"
    );
    assert_eq!(d.history.len(), 3);
    assert!(DelayedScaling::new(Format::E4m3, &Fp8Recipe::current()).is_err());
}
