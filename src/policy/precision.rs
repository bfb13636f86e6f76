//! The precision of a training step, decided once from the preset, the matmul precision class,
//! a pinned algorithm, the fp8 recipe and the autocast overrides, against what the backend
//! accelerates. The model records its step from this decision and never re-decides it.

use super::PresetSpec;
use super::{Autocast, Capabilities, Fp8Recipe, Fp8Role, OpClass, OpKind, PrecisionClass, Preset};
use crate::algorithm::{Algorithm, Scaling};
use crate::error::{Error, Result};
use crate::format::Format;
use std::collections::BTreeMap;

/// The formats and algorithms of one training step (what autocast and the preset decide).
#[derive(Clone, Debug, PartialEq)]
pub struct Precision {
    /// Algorithm of the matmul-like ops (linear, attention scores and values, head).
    pub matmul: Algorithm,
    /// Format matmul-like outputs and their elementwise successors (GELU, SiLU, the elementwise
    /// product: autocast runs them in their input's format) are held in.
    pub compute: Format,
    /// Format of everything else (residual stream, LayerNorm and softmax outputs, gradients):
    /// f32 in mixed presets, the 16-bit format in "true" presets.
    pub stream: Format,
    /// The formats that replace f32 for f32-class ops, by op name (autocast's overrides; the
    /// losses always compute in f32).
    pub overrides: BTreeMap<&'static str, Format>,
    /// fp8 linear layers (transformer-engine): the recipe, current or delayed scaling.
    pub fp8: Option<Fp8Recipe>,
    /// Format of the weights and AdamW moments (f32 master weights, or 16-bit in "true"
    /// presets).
    pub weights: Format,
}

/// What a run asks for; `Precision::decide` turns it into the step's precision.
#[derive(Clone, Debug)]
pub struct PrecisionRequest<'a> {
    /// The training preset.
    pub preset: Preset,
    /// The precision class the matmuls resolve from (where no algorithm is pinned).
    pub matmul_precision: PrecisionClass,
    /// Pins the algorithm of every matmul-like op (overrides preset and precision class).
    pub algorithm: Option<Algorithm>,
    /// fp8 with current scaling instead of the preset's delayed scaling.
    pub fp8_current: bool,
    /// Autocast overrides, "op=format,..." (e.g. "softmax=bf16").
    pub autocast_overrides: &'a str,
}

impl PrecisionRequest<'static> {
    /// `preset` with everything else as PyTorch defaults it: matmul precision `highest`, no
    /// pinned algorithm, the preset's delayed fp8 scaling, no autocast overrides.
    pub fn of(preset: Preset) -> PrecisionRequest<'static> {
        PrecisionRequest {
            preset,
            matmul_precision: PrecisionClass::Highest,
            algorithm: None,
            fp8_current: false,
            autocast_overrides: "",
        }
    }
}

impl Precision {
    /// The precision of a step under `request` on a backend with `caps`, whose overrides name
    /// ops of `vocabulary` (`model::vocabulary()`).
    pub fn decide(
        request: &PrecisionRequest,
        caps: &Capabilities,
        vocabulary: &[OpKind],
    ) -> Result<Precision> {
        let spec: PresetSpec = request.preset.spec();
        let stream = if spec.master_weights || spec.compute == Format::F32 {
            Format::F32
        } else {
            spec.params
        };
        let autocast = Autocast::new(spec.compute, request.autocast_overrides, vocabulary)?;
        let compute = autocast.compute;
        let matmul = match (request.algorithm, compute) {
            (Some(a), _) => a,
            (None, Format::F32) => request.matmul_precision.resolve(caps),
            (None, Format::Bf16) => Algorithm::Bf16,
            (None, Format::F16) => Algorithm::F16,
            (None, other) => {
                return Err(Error::invalid(
                    "autocast",
                    format!("matmul-like ops cannot compute in {other}; use f32, bf16 or f16"),
                ));
            }
        };
        let fp8 = spec.fp8.map(|recipe| {
            if request.fp8_current {
                Fp8Recipe::Current {
                    formats: recipe.formats(),
                }
            } else {
                recipe
            }
        });
        Ok(Precision {
            matmul,
            compute,
            stream,
            overrides: autocast.overrides,
            fp8,
            weights: spec.params,
        })
    }

    /// The format the output of an op of kind `op` is held in, its inputs held in `input`:
    /// autocast's choice by the op's class and the overrides, the f32 class narrowed to the
    /// stream format in "true" presets (their losses stay f32).
    pub fn held(&self, op: OpKind, input: Format) -> Format {
        match op.class {
            OpClass::MatmulLike => self.compute,
            OpClass::F32 if op.loss => Format::F32,
            OpClass::F32 => (self.overrides.get(op.name).copied())
                .unwrap_or(Format::F32)
                .narrower(self.stream),
            OpClass::Input => input,
        }
    }

    /// Whether the fp8 linear layers take their scales from amax histories (the step then
    /// records the amaxes and reads the scales from its scalars).
    pub fn delayed_fp8(&self) -> bool {
        matches!(self.fp8, Some(Fp8Recipe::Delayed { .. }))
    }

    /// The algorithm of a linear layer's matmul whose operands play `roles`: the step's matmul
    /// algorithm, or fp8 in the roles' formats (tensorwise current scaling; under delayed
    /// scaling, given scales that each step fills from its scalars).
    pub fn linear_algorithm(&self, roles: (Fp8Role, Fp8Role)) -> Algorithm {
        let Some(recipe) = self.fp8 else {
            return self.matmul;
        };
        let formats = recipe.formats();
        let (a, b) = (roles.0.format(formats), roles.1.format(formats));
        match recipe {
            Fp8Recipe::Current { .. } => Algorithm::fp8(a, b),
            Fp8Recipe::Delayed { .. } => Algorithm::Fp8 {
                a,
                b,
                scaling: Scaling::Given { a: 1.0, b: 1.0 },
            },
        }
    }
}
