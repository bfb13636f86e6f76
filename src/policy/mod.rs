//! The precision policy: the ONE place where precision decisions are made.
//!
//! - precision classes (PyTorch's `set_float32_matmul_precision`) and their resolution to an
//!   algorithm from what a backend accelerates;
//! - training presets by Lightning's names;
//! - autocast op classes (which format each op runs in);
//! - dynamic loss scaling with GradScaler's semantics;
//! - fp8 scaling recipes with Transformer Engine's defaults, and their mutable amax state
//!   (`fp8.rs`);
//! - the formats and algorithms of every op of a training step, decided from all of the above
//!   (`precision.rs`): nothing above this module decides precision again.

pub use fp8::{AmaxCompute, DelayedScaling, Fp8Formats, Fp8Linear, Fp8Recipe, Fp8Role, Fp8State};
pub use precision::Precision;

use crate::algorithm::Algorithm;
use crate::error::{Error, Result};
use crate::format::Format;
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// Implements Display, FromStr (with an error listing the valid names) and serde as strings for
/// a fieldless enum with a fixed table of names.
macro_rules! named_enum {
    ($ty:ident, $kind:literal, [$($variant:ident => $name:literal),+ $(,)?]) => {
        impl $ty {
            /// Every variant, in the order of the table of names.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];
            /// Its name (the CLI's, Python's and the reports'); `from_str` takes it in upper or lower case.
            pub fn name(self) -> &'static str {
                match self { $($ty::$variant => $name),+ }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
        impl FromStr for $ty {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                let key = s.trim().to_ascii_lowercase();
                $ty::ALL.iter().copied().find(|v| v.name() == key).ok_or_else(|| Error::UnknownName {
                    kind: $kind,
                    given: s.to_string(),
                    valid: $ty::ALL.iter().map(|v| v.name().to_string()).collect(),
                })
            }
        }
        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }
    };
}

// After the macro, so that the submodules can use it (and `plan::Unary`, through this).
pub(crate) use named_enum;

pub mod fp8;
pub mod precision;

/// PyTorch's float32 matmul precision classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PrecisionClass {
    /// Full f32 products: plain f32.
    Highest,
    /// tf32 where accelerated, else bf16x3 where accelerated, else f32.
    High,
    /// bf16 where accelerated; else as `High`.
    Medium,
}

named_enum!(PrecisionClass, "matmul precision", [Highest => "highest", High => "high", Medium => "medium"]);

/// What a backend runs fast: the algorithms it accelerates beyond plain f32 (tensor cores, or
/// cooperative matrices), and where its executor runs causal attention as one fused op.
/// Everything else is still computed, emulated with the same numerics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Capabilities {
    /// The algorithms this backend accelerates (compared by base name: an fp8 algorithm's scaling
    /// does not matter).
    pub accelerated: Vec<Algorithm>,
    /// Where its executor fuses causal attention.
    pub fused_attention: FusedAttention,
}

/// Where a backend's executor runs causal attention as one fused op (`plan::Op::Attention`):
/// under these algorithms, for heads of these sizes. Elsewhere (and where both are empty, the
/// default) a model records the unfused ops (copies, matmuls, softmax); both compute the same
/// function.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FusedAttention {
    /// Algorithms under which attention is fused.
    pub algorithms: Vec<Algorithm>,
    /// Head sizes (d) for which attention is fused.
    pub head_sizes: Vec<usize>,
}

impl Capabilities {
    /// Whether `algorithm` (by its base name) is among the accelerated ones.
    pub fn accelerates(&self, algorithm: Algorithm) -> bool {
        self.accelerated
            .iter()
            .any(|a| a.base_name() == algorithm.base_name())
    }

    /// Whether step plans run causal attention fused for heads of `head_dim` under `algorithm`.
    pub fn fuses_attention(&self, algorithm: &Algorithm, head_dim: usize) -> bool {
        let fused = &self.fused_attention;
        fused.algorithms.contains(algorithm) && fused.head_sizes.contains(&head_dim)
    }
}

impl PrecisionClass {
    /// `highest` -> f32. `high` -> tf32 where the backend accelerates it, else bf16x3 where
    /// accelerated (cooperative matrices have no tf32), else f32. `medium` ->
    /// bf16 where accelerated, else `high`'s choice. (docs/design.md, "Precision classes".)
    pub fn resolve(self, caps: &Capabilities) -> Algorithm {
        match self {
            PrecisionClass::Highest => Algorithm::F32,
            PrecisionClass::High if caps.accelerates(Algorithm::Tf32) => Algorithm::Tf32,
            // Without tf32 (WGSL on cooperative matrices): bf16x3 is at least as accurate.
            PrecisionClass::High if caps.accelerates(Algorithm::Bf16x3) => Algorithm::Bf16x3,
            PrecisionClass::High => Algorithm::F32,
            PrecisionClass::Medium if caps.accelerates(Algorithm::Bf16) => Algorithm::Bf16,
            PrecisionClass::Medium => PrecisionClass::High.resolve(caps),
        }
    }
}

/// Training presets, by PyTorch Lightning's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Preset {
    /// `32-true`: f32 everywhere.
    True32,
    /// `16-mixed`: f16 autocast, f32 master weights, dynamic loss scaling.
    Mixed16,
    /// `bf16-mixed`: bf16 autocast, f32 master weights.
    MixedBf16,
    /// `16-true`: f16 parameters and compute, no master weights.
    True16,
    /// `bf16-true`: bf16 parameters and compute, no master weights.
    TrueBf16,
    /// `transformer-engine`: bf16 autocast with f32 master weights, fp8 linear layers (the default
    /// `Fp8Recipe`).
    TransformerEngine,
}

named_enum!(Preset, "precision preset", [
    True32 => "32-true",
    Mixed16 => "16-mixed",
    MixedBf16 => "bf16-mixed",
    True16 => "16-true",
    TrueBf16 => "bf16-true",
    TransformerEngine => "transformer-engine",
]);

/// What a preset means for training.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PresetSpec {
    /// The preset described.
    pub preset: Preset,
    /// Format the autocast "matmul-like" ops compute in.
    pub compute: Format,
    /// Format the parameters the forward pass reads are kept in.
    pub params: Format,
    /// f32 master weights that the optimizer updates.
    pub master_weights: bool,
    /// Dynamic loss scaling, where the preset uses it.
    pub loss_scaling: Option<LossScaleConfig>,
    /// fp8 linear layers, where the preset uses them.
    pub fp8: Option<Fp8Recipe>,
}

impl Preset {
    /// What the preset means: its formats, master weights, loss scaling and fp8 recipe.
    pub fn spec(self) -> PresetSpec {
        let (compute, params, master_weights, loss_scaling, fp8) = match self {
            Preset::True32 => (Format::F32, Format::F32, false, None, None),
            Preset::Mixed16 => (
                Format::F16,
                Format::F32,
                true,
                Some(LossScaleConfig::default()),
                None,
            ),
            Preset::MixedBf16 => (Format::Bf16, Format::F32, true, None, None),
            Preset::True16 => (Format::F16, Format::F16, false, None, None),
            Preset::TrueBf16 => (Format::Bf16, Format::Bf16, false, None, None),
            // Transformer Engine runs under bf16 autocast; its linear layers compute in fp8.
            Preset::TransformerEngine => (
                Format::Bf16,
                Format::F32,
                true,
                None,
                Some(Fp8Recipe::default()),
            ),
        };
        PresetSpec {
            preset: self,
            compute,
            params,
            master_weights,
            loss_scaling,
            fp8,
        }
    }
}

/// Autocast op classes, as in PyTorch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// linear, matmul, bmm, attention: run in the compute format.
    MatmulLike,
    /// softmax, layer norm, RMS norm, sums, the losses: run in f32.
    F32,
    /// Everything else runs in the format of its inputs (two of them promoted).
    Input,
}

/// What autocast knows of an op of the model builder: its name and its class. The ops declare
/// their kinds (`model::vocabulary` lists them): the one op vocabulary, which autocast's
/// overrides name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OpKind {
    /// The op's name (the builder's, the profiles', the overrides').
    pub name: &'static str,
    /// Its autocast class.
    pub class: OpClass,
    /// A loss: its scalar is f32 under every preset.
    pub loss: bool,
}

impl OpKind {
    /// An op of `class` that is not a loss.
    pub const fn new(name: &'static str, class: OpClass) -> OpKind {
        OpKind {
            name,
            class,
            loss: false,
        }
    }

    /// A loss (autocast's f32 class).
    pub const fn loss(name: &'static str) -> OpKind {
        OpKind {
            name,
            class: OpClass::F32,
            loss: true,
        }
    }

    /// Whether a training step takes an override of its format: the linear layers' (the
    /// format every matmul-like op computes in) and each f32-class op that holds an output.
    fn overridable(&self) -> bool {
        match self.class {
            OpClass::MatmulLike => self.name == "linear",
            OpClass::F32 => !self.loss,
            OpClass::Input => false,
        }
    }
}

/// Autocast: the format each op runs in under a preset, with per-op overrides.
#[derive(Clone, Debug, PartialEq)]
pub struct Autocast {
    /// The format matmul-like ops compute in (the linear layers' override applied).
    pub compute: Format,
    /// The f32-class ops' formats that replace f32, by op name.
    pub overrides: BTreeMap<&'static str, Format>,
}

impl Autocast {
    /// Autocast computing matmul-like ops in `compute`, under "op=format[,op=format...]"
    /// overrides (e.g. "softmax=bf16"; nothing: none) of the ops of `vocabulary`. Refused: an
    /// empty item, an op named twice, an op not in the vocabulary (the error lists them), and an
    /// override a step would not honour (of an op whose format follows another's: a matmul-like
    /// op other than linear, a loss, an op that runs in its input's format).
    pub fn new(compute: Format, spec: &str, vocabulary: &[OpKind]) -> Result<Autocast> {
        let mut autocast = Autocast {
            compute,
            overrides: BTreeMap::new(),
        };
        if spec.trim().is_empty() {
            return Ok(autocast);
        }
        for item in spec.split(',').map(str::trim) {
            let (name, format) = item.split_once('=').ok_or_else(|| {
                Error::invalid(
                    "autocast override",
                    format!("'{item}': write OP=FORMAT, e.g. softmax=bf16"),
                )
            })?;
            let name = name.trim().to_ascii_lowercase();
            let op = *(vocabulary.iter().find(|op| op.name == name)).ok_or_else(|| {
                Error::UnknownName {
                    kind: "op",
                    given: name.clone(),
                    valid: vocabulary.iter().map(|op| op.name.to_string()).collect(),
                }
            })?;
            if !op.overridable() {
                let honoured: Vec<&str> = (vocabulary.iter())
                    .filter(|op| op.overridable())
                    .map(|op| op.name)
                    .collect();
                return Err(Error::invalid(
                    "autocast override",
                    format!(
                        "{name}: a training step takes no override of it (its format follows {}); \
                         it takes overrides of {}",
                        match op.class {
                            OpClass::MatmulLike => "the linear layers'",
                            OpClass::F32 => "f32, as every loss's",
                            OpClass::Input => "its input's",
                        },
                        honoured.join(", ")
                    ),
                ));
            }
            let format: Format = format.parse()?;
            if op.class == OpClass::F32
                && !matches!(format, Format::F32 | Format::Bf16 | Format::F16)
            {
                return Err(Error::invalid(
                    "autocast override",
                    format!("{name}={format}: an output is held in f32, bf16 or f16"),
                ));
            }
            if op.class == OpClass::MatmulLike {
                autocast.compute = format;
            }
            if autocast.overrides.insert(op.name, format).is_some() {
                return Err(Error::invalid(
                    "autocast override",
                    format!("'{spec}' names {name} twice"),
                ));
            }
        }
        autocast.overrides.retain(|name, _| *name != "linear");
        Ok(autocast)
    }
}

/// Dynamic loss scaling configuration; the defaults are PyTorch GradScaler's.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct LossScaleConfig {
    /// The scale of the first step.
    pub init_scale: f32,
    /// Factor the scale grows by after `growth_interval` clean steps.
    pub growth_factor: f32,
    /// Factor the scale shrinks by on a step with inf/NaN gradients.
    pub backoff_factor: f32,
    /// Clean steps in a row before the scale grows.
    pub growth_interval: u32,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        LossScaleConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// The state of dynamic loss scaling, updated once per step as GradScaler.update() does.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct LossScaler {
    /// The constants of the scaling.
    pub config: LossScaleConfig,
    /// The current scale the loss is multiplied by.
    pub scale: f32,
    /// Clean steps since the last growth or backoff.
    pub growth_tracker: u32,
}

/// Whether the optimizer may apply this step's gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepDecision {
    /// Every gradient is finite: the optimizer applies the step.
    Apply,
    /// A gradient held inf/NaN: weights and optimizer state stay untouched.
    Skip,
}

impl LossScaler {
    /// The scaler at its initial scale.
    pub fn new(config: LossScaleConfig) -> LossScaler {
        LossScaler {
            config,
            scale: config.init_scale,
            growth_tracker: 0,
        }
    }

    /// Records whether this step's gradients were all finite and updates the scale: backoff on
    /// inf/NaN (the step is skipped), growth after `growth_interval` clean steps in a row.
    pub fn update(&mut self, grads_finite: bool) -> StepDecision {
        if !grads_finite {
            self.scale *= self.config.backoff_factor;
            self.growth_tracker = 0;
            return StepDecision::Skip;
        }
        self.growth_tracker += 1;
        if self.growth_tracker == self.config.growth_interval {
            let grown = self.scale * self.config.growth_factor;
            // GradScaler keeps the old scale if growth would overflow.
            if grown.is_finite() {
                self.scale = grown;
            }
            self.growth_tracker = 0;
        }
        StepDecision::Apply
    }

    /// The factor that turns scaled gradients back into true ones.
    pub fn inverse(&self) -> f32 {
        1.0 / self.scale
    }
}
