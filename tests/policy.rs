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

#[test]
fn autocast_classes_and_overrides() {
    let ac = Autocast::new(Format::Bf16);
    assert_eq!(ac.format_for(Op::Linear, Format::F32), Format::Bf16);
    assert_eq!(
        ac.format_for(Op::AttentionScores, Format::F32),
        Format::Bf16
    );
    assert_eq!(ac.format_for(Op::Softmax, Format::Bf16), Format::F32);
    assert_eq!(ac.format_for(Op::LayerNorm, Format::Bf16), Format::F32);
    assert_eq!(ac.format_for(Op::Gelu, Format::Bf16), Format::Bf16);
    assert_eq!(ac.format_for(Op::Add, Format::F32), Format::F32);
    // PyTorch's lists: rms_norm and mse_loss in f32, silu and mul in their input's format.
    assert_eq!(ac.format_for(Op::RmsNorm, Format::Bf16), Format::F32);
    assert_eq!(ac.format_for(Op::MseLoss, Format::Bf16), Format::F32);
    assert_eq!(ac.format_for(Op::Silu, Format::Bf16), Format::Bf16);
    assert_eq!(ac.format_for(Op::Mul, Format::F16), Format::F16);
    let norm = Autocast::new(Format::Bf16)
        .with_overrides("rms_norm=bf16")
        .unwrap();
    assert_eq!(norm.format_for(Op::RmsNorm, Format::F32), Format::Bf16);
    let ac = ac.with_overrides("softmax=bf16, linear=f32").unwrap();
    assert_eq!(ac.format_for(Op::Softmax, Format::F32), Format::Bf16);
    assert_eq!(ac.format_for(Op::Linear, Format::F32), Format::F32);
    let err = Autocast::new(Format::F16)
        .with_overrides("softmax")
        .unwrap_err()
        .to_string();
    assert!(err.contains("OP=FORMAT"), "{err}");
    // An op the policy does not know is refused (bad input), the name given and every known
    // one named.
    let err = Autocast::new(Format::F16)
        .with_overrides("softmux=f32")
        .unwrap_err();
    let said = err.to_string();
    assert!(said.contains("softmux"), "{said}");
    for op in Op::ALL {
        assert!(said.contains(op.name()), "{said} does not name {op}");
    }
    assert_eq!(mantissa::cli::exit_code(&err), 2, "{said}");
}

/// A training step takes overrides of the ops whose format it holds by op (linear, softmax,
/// layer norm, RMS norm); an override of any other op would change nothing and is refused,
/// naming the op and the ones it takes.
#[test]
fn a_step_refuses_overrides_it_would_not_honour() {
    use mantissa::backend::{Backend, reference::Reference};
    use mantissa::policy::precision::PrecisionRequest;
    let caps = Reference.capabilities();
    let decide = |overrides: &'static str| {
        let request = PrecisionRequest {
            autocast_overrides: overrides,
            ..PrecisionRequest::of(Preset::MixedBf16)
        };
        Precision::decide(&request, &caps)
    };
    let p = decide("softmax=bf16,layer_norm=bf16,rms_norm=f16,linear=f32").unwrap();
    assert_eq!(
        (p.softmax, p.layer_norm, p.rms_norm, p.compute),
        (Format::Bf16, Format::Bf16, Format::F16, Format::F32)
    );
    for (op, follows) in [
        ("gelu", "its input's"),
        ("mul", "its input's"),
        ("attention_scores", "the linear layers'"),
        ("cross_entropy", "f32"),
    ] {
        let err = decide(Box::leak(format!("{op}=f32").into_boxed_str())).unwrap_err();
        let said = err.to_string();
        for part in [op, follows, "linear, softmax, layer_norm, rms_norm"] {
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
