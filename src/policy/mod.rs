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
    /// linear, matmul, bmm, attention scores: run in the compute format.
    MatmulLike,
    /// softmax, log-softmax, layer norm, RMS norm, cross entropy, mean squared error,
    /// sums/means, exp/log, pow: run in f32.
    F32,
    /// Everything else runs in the format of its inputs.
    Input,
}

/// An op the training executor runs, for autocast purposes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// A linear layer (x . W + b).
    Linear,
    /// A matrix product.
    Matmul,
    /// A batched matrix product.
    Bmm,
    /// Attention's scores q.k^T.
    AttentionScores,
    /// Softmax.
    Softmax,
    /// Log-softmax.
    LogSoftmax,
    /// Layer norm.
    LayerNorm,
    /// Cross entropy.
    CrossEntropy,
    /// A sum.
    Sum,
    /// A mean.
    Mean,
    /// exp.
    Exp,
    /// log.
    Log,
    /// pow.
    Pow,
    /// GELU.
    Gelu,
    /// An add (bias, residual).
    Add,
    /// An embedding lookup.
    Embedding,
    /// RMS norm.
    RmsNorm,
    /// Mean squared error.
    MseLoss,
    /// SiLU.
    Silu,
    /// An elementwise product.
    Mul,
}

named_enum!(Op, "op", [
    Linear => "linear",
    Matmul => "matmul",
    Bmm => "bmm",
    AttentionScores => "attention_scores",
    Softmax => "softmax",
    LogSoftmax => "log_softmax",
    LayerNorm => "layer_norm",
    CrossEntropy => "cross_entropy",
    Sum => "sum",
    Mean => "mean",
    Exp => "exp",
    Log => "log",
    Pow => "pow",
    Gelu => "gelu",
    Add => "add",
    Embedding => "embedding",
    RmsNorm => "rms_norm",
    MseLoss => "mse_loss",
    Silu => "silu",
    Mul => "mul",
]);

impl Op {
    /// Its autocast class, as PyTorch's autocast lists it.
    pub fn class(self) -> OpClass {
        match self {
            Op::Linear | Op::Matmul | Op::Bmm | Op::AttentionScores => OpClass::MatmulLike,
            Op::Softmax
            | Op::LogSoftmax
            | Op::LayerNorm
            | Op::CrossEntropy
            | Op::Sum
            | Op::Exp
            | Op::Log
            | Op::Pow
            | Op::RmsNorm
            | Op::MseLoss => OpClass::F32,
            Op::Gelu | Op::Add | Op::Embedding | Op::Silu | Op::Mul | Op::Mean => OpClass::Input,
        }
    }
}

/// Autocast: the format each op runs in under a preset, with per-op overrides.
#[derive(Clone, Debug, PartialEq)]
pub struct Autocast {
    /// The format matmul-like ops compute in.
    pub compute: Format,
    /// Per-op formats that replace the class's choice.
    pub overrides: BTreeMap<Op, Format>,
}

impl Autocast {
    /// Autocast computing matmul-like ops in `compute`, with no overrides.
    pub fn new(compute: Format) -> Autocast {
        Autocast {
            compute,
            overrides: BTreeMap::new(),
        }
    }

    /// Parses "op=format[,op=format...]" overrides, e.g. "softmax=bf16" (nothing: none). An
    /// empty item or an op named twice is refused.
    pub fn with_overrides(mut self, spec: &str) -> Result<Autocast> {
        if spec.trim().is_empty() {
            return Ok(self);
        }
        for item in spec.split(',').map(str::trim) {
            let (op, format) = item.split_once('=').ok_or_else(|| {
                Error::invalid(
                    "autocast override",
                    format!("'{item}': write OP=FORMAT, e.g. softmax=bf16"),
                )
            })?;
            let op: Op = op.parse()?;
            if self.overrides.insert(op, format.parse()?).is_some() {
                return Err(Error::invalid(
                    "autocast override",
                    format!("'{spec}' names {} twice", op.name()),
                ));
            }
        }
        Ok(self)
    }

    /// The format `op` runs in when its inputs are in `input`.
    pub fn format_for(&self, op: Op, input: Format) -> Format {
        if let Some(f) = self.overrides.get(&op) {
            return *f;
        }
        match op.class() {
            OpClass::MatmulLike => self.compute,
            OpClass::F32 => Format::F32,
            OpClass::Input => input,
        }
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
