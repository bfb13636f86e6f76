//! fp8 scaling: the recipes (Transformer Engine's `Format`, `DelayedScaling` defaults), the
//! role of each operand of a linear layer and its format, and the one piece of mutable
//! precision state, delayed scaling's amax histories (`Fp8State`), kept apart from the static
//! decision (`Precision`).

use crate::error::{Error, Result};
use crate::format::{Format, scale_for_amax};
use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;

/// How fp8 formats are assigned to tensors (Transformer Engine's `Format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Formats {
    /// e4m3 for forward activations and weights, e5m2 for gradients.
    Hybrid,
    /// e4m3 everywhere.
    E4m3,
}

named_enum!(Fp8Formats, "fp8 format recipe", [Hybrid => "hybrid", E4m3 => "e4m3"]);

impl Fp8Formats {
    /// The format of forward tensors (activations and weights): e4m3 under both.
    pub fn forward(self) -> Format {
        Format::E4m3
    }
    /// The format of gradients: e5m2 under `Hybrid`, e4m3 under `E4m3`.
    pub fn backward(self) -> Format {
        match self {
            Fp8Formats::Hybrid => Format::E5m2,
            Fp8Formats::E4m3 => Format::E4m3,
        }
    }
}

/// How the amax history becomes one amax (Transformer Engine's `amax_compute_algo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AmaxCompute {
    /// The largest amax of the history.
    Max,
    /// The latest amax.
    MostRecent,
}

named_enum!(AmaxCompute, "amax compute algorithm", [Max => "max", MostRecent => "most_recent"]);

/// An fp8 scaling recipe.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub enum Fp8Recipe {
    /// Scales from an amax history (Transformer Engine's DelayedScaling).
    Delayed {
        /// Which fp8 format each tensor takes.
        formats: Fp8Formats,
        /// Steps of amax history kept (at least 1).
        history_len: usize,
        /// How the history becomes one amax.
        amax_compute: AmaxCompute,
        /// Powers of two of headroom: the scale is divided by 2^margin.
        margin: i32,
    },
    /// Scales from the current tensor, just in time.
    Current {
        /// The recipe's only choice: which fp8 format each tensor takes.
        formats: Fp8Formats,
    },
}

impl Default for Fp8Recipe {
    /// DelayedScaling's defaults: HYBRID, history 1024, max, margin 0.
    fn default() -> Self {
        Fp8Recipe::Delayed {
            formats: Fp8Formats::Hybrid,
            history_len: 1024,
            amax_compute: AmaxCompute::Max,
            margin: 0,
        }
    }
}

impl Fp8Recipe {
    /// Current scaling with the `Hybrid` formats.
    pub fn current() -> Fp8Recipe {
        Fp8Recipe::Current {
            formats: Fp8Formats::Hybrid,
        }
    }

    /// Which fp8 format each tensor takes.
    pub fn formats(&self) -> Fp8Formats {
        match self {
            Fp8Recipe::Delayed { formats, .. } | Fp8Recipe::Current { formats } => *formats,
        }
    }
}

/// The delayed-scaling state of one fp8 tensor: an amax history and the scale it gives.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DelayedScaling {
    /// The tensor's fp8 format (its FMAX sets the scale).
    pub format: Format,
    /// Steps of amax history kept.
    pub history_len: usize,
    /// How the history becomes one amax.
    pub amax_compute: AmaxCompute,
    /// Powers of two of headroom.
    pub margin: i32,
    /// The amaxes of the last `history_len` steps, oldest first (finite ones only).
    pub history: VecDeque<f32>,
    /// The scale the next step quantizes with.
    pub scale: f32,
}

impl DelayedScaling {
    /// Fresh state at scale 1 under a `Delayed` recipe; refused for current scaling and for an
    /// empty history.
    pub fn new(format: Format, recipe: &Fp8Recipe) -> Result<DelayedScaling> {
        match *recipe {
            Fp8Recipe::Delayed {
                history_len,
                amax_compute,
                margin,
                ..
            } if history_len > 0 => Ok(DelayedScaling {
                format,
                history_len,
                amax_compute,
                margin,
                history: VecDeque::with_capacity(history_len),
                scale: 1.0,
            }),
            Fp8Recipe::Delayed { .. } => Err(Error::invalid(
                "fp8 recipe",
                "amax history length must be at least 1",
            )),
            Fp8Recipe::Current { .. } => Err(Error::invalid(
                "fp8 recipe",
                "current scaling keeps no amax history",
            )),
        }
    }

    /// Records this step's amax and computes the scale for the next step:
    /// s = FMAX / amax / 2^margin, amax taken from the history by `amax_compute`.
    /// A non-finite amax (an overflowing step) is not recorded.
    pub fn record(&mut self, amax: f32) -> f32 {
        if amax.is_finite() {
            if self.history.len() == self.history_len {
                self.history.pop_front();
            }
            self.history.push_back(amax.abs());
        }
        let amax = match self.amax_compute {
            AmaxCompute::Max => self.history.iter().copied().fold(0.0, f32::max),
            AmaxCompute::MostRecent => self.history.back().copied().unwrap_or(0.0),
        };
        let scale = scale_for_amax(amax, self.format) / 2f32.powi(self.margin);
        self.scale = if amax > 0.0 && scale.is_finite() {
            scale
        } else {
            self.scale
        };
        self.scale
    }
}

/// Which of a linear layer's three fp8 tensors a matmul operand is (the index of its scale and
/// amax slots).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Role {
    /// The layer's input (activation), forward format.
    Input = 0,
    /// The layer's weight, forward format.
    Weight = 1,
    /// The gradient of the layer's output, backward format.
    Grad = 2,
}

impl Fp8Role {
    /// The format of this role under `formats`: forward tensors (input, weight) in the forward
    /// format, gradients in the backward one.
    pub fn format(self, formats: Fp8Formats) -> Format {
        match self {
            Fp8Role::Input | Fp8Role::Weight => formats.forward(),
            Fp8Role::Grad => formats.backward(),
        }
    }
}

/// fp8 state of one linear layer: delayed scaling of its input, weight and output gradient.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Fp8Linear {
    /// Delayed scaling of the input.
    pub input: DelayedScaling,
    /// Delayed scaling of the weight.
    pub weight: DelayedScaling,
    /// Delayed scaling of the output gradient.
    pub grad: DelayedScaling,
}

impl Fp8Linear {
    /// The three states in role order.
    pub fn roles_mut(&mut self) -> [&mut DelayedScaling; 3] {
        [&mut self.input, &mut self.weight, &mut self.grad]
    }

    /// The three states in role order.
    pub fn roles(&self) -> [&DelayedScaling; 3] {
        [&self.input, &self.weight, &self.grad]
    }
}

/// The mutable state of delayed fp8 scaling over a run: one `Fp8Linear` per linear layer.
/// Each step's amaxes enter the histories, and the scales of the next step follow.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Fp8State {
    /// One entry per linear layer, in the model's order.
    pub layers: Vec<Fp8Linear>,
}

impl Fp8State {
    /// Fresh state for `linears` layers under `recipe`: None for current scaling, which keeps
    /// no history.
    pub fn new(recipe: &Fp8Recipe, linears: usize) -> Result<Option<Fp8State>> {
        if let Fp8Recipe::Current { .. } = recipe {
            return Ok(None);
        }
        let formats = recipe.formats();
        let layers = (0..linears)
            .map(|_| {
                Ok(Fp8Linear {
                    input: DelayedScaling::new(Fp8Role::Input.format(formats), recipe)?,
                    weight: DelayedScaling::new(Fp8Role::Weight.format(formats), recipe)?,
                    grad: DelayedScaling::new(Fp8Role::Grad.format(formats), recipe)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(Fp8State { layers }))
    }

    /// Records one step's amaxes, `amax(layer, role)`.
    pub fn record(&mut self, amax: impl Fn(usize, Fp8Role) -> f32) {
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let [i, w, g] = layer.roles_mut();
            i.record(amax(l, Fp8Role::Input));
            w.record(amax(l, Fp8Role::Weight));
            g.record(amax(l, Fp8Role::Grad));
        }
    }

    /// The scales the next step quantizes with, (input, weight, gradient) per layer.
    pub fn scales(&self) -> Vec<[f32; 3]> {
        self.layers
            .iter()
            .map(|l| [l.input.scale, l.weight.scale, l.grad.scale])
            .collect()
    }
}
