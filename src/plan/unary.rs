//! The unary family: elementwise functions of one input (GELU, SiLU, ReLU, sigmoid, tanh),
//! each with its derivative. One plan op (`Op::Unary`, `Op::UnaryBwd`) and one kernel per
//! backend run all of them, the function chosen by its id; the host definitions here are the
//! reference's (in f64), `shaders/unary.wgsl` and `cuda/train.cu` (`unary`, `unary_grad`)
//! compute the same functions in f32 with the same ids. Adding a function: a variant and its
//! two formulas here, and an arm in each of those two kernel files.

use crate::error::{Error, Result};
use crate::policy::named_enum;
use std::fmt;
use std::str::FromStr;

/// An elementwise function of the unary family. Autocast runs each in its input's format,
/// computing in f32 (PyTorch's autocast lists none of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unary {
    /// GELU in its tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
    Gelu,
    /// SiLU (swish): x * sigmoid(x), computed as x / (1 + exp(-x)).
    Silu,
    /// ReLU: 0 where x < 0, else x (a NaN stays NaN, as PyTorch's).
    Relu,
    /// The logistic sigmoid 1 / (1 + exp(-x)).
    Sigmoid,
    /// The hyperbolic tangent.
    Tanh,
}

named_enum!(Unary, "unary function", [
    Gelu => "gelu",
    Silu => "silu",
    Relu => "relu",
    Sigmoid => "sigmoid",
    Tanh => "tanh",
]);

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

impl Unary {
    /// The id the kernels switch on (`UNARY_*` in shaders/unary.wgsl, cuda/train.cu).
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The name of its backward op (profiles, errors).
    pub fn backward_name(self) -> &'static str {
        match self {
            Unary::Gelu => "gelu backward",
            Unary::Silu => "silu backward",
            Unary::Relu => "relu backward",
            Unary::Sigmoid => "sigmoid backward",
            Unary::Tanh => "tanh backward",
        }
    }

    /// f(x), as the host reference defines it.
    pub fn apply(self, x: f64) -> f64 {
        match self {
            Unary::Gelu => 0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh()),
            Unary::Silu => x / (1.0 + (-x).exp()),
            Unary::Relu => {
                if x < 0.0 {
                    0.0
                } else {
                    x
                }
            }
            Unary::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            Unary::Tanh => x.tanh(),
        }
    }

    /// Whether the backward reads the forward's output y rather than its input x: sigmoid's
    /// and tanh's derivatives are PyTorch's, of the output as held (`sigmoid_backward`,
    /// `tanh_backward`): where y rounds to 1, 1 - y^2 is 0, as PyTorch's gradient is.
    pub fn reads_output(self) -> bool {
        matches!(self, Unary::Sigmoid | Unary::Tanh)
    }

    /// f' in terms of what the backward reads (`reads_output`): dx = dy * grad(v), v being x,
    /// or y for sigmoid (y (1 - y)) and tanh (1 - y^2).
    pub fn grad(self, v: f64) -> f64 {
        let x = v;
        match self {
            Unary::Gelu => {
                let t = (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh();
                let du = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x);
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
            }
            // PyTorch's silu_backward: s (1 + x (1 - s)).
            Unary::Silu => {
                let s = 1.0 / (1.0 + (-x).exp());
                s * (1.0 + x * (1.0 - s))
            }
            // PyTorch's threshold_backward passes dy where the output is not <= 0 (NaN too).
            Unary::Relu => {
                if x <= 0.0 {
                    0.0
                } else {
                    1.0
                }
            }
            Unary::Sigmoid => v * (1.0 - v),
            Unary::Tanh => 1.0 - v * v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_derivative_is_its_function_s_slope() {
        for &f in Unary::ALL {
            for x in [-3.1, -0.7, 0.3, 1.9, 4.2] {
                let h = 1e-6;
                let slope = (f.apply(x + h) - f.apply(x - h)) / (2.0 * h);
                // What the backward reads: x, or the output (`reads_output`).
                let v = if f.reads_output() { f.apply(x) } else { x };
                assert!(
                    (slope - f.grad(v)).abs() < 1e-6,
                    "{f} at {x}: {slope} vs {}",
                    f.grad(v)
                );
            }
        }
    }

    #[test]
    fn ids_follow_the_table_and_names_parse() {
        for (i, &f) in Unary::ALL.iter().enumerate() {
            assert_eq!(f.id() as usize, i);
            assert_eq!(f.name().parse::<Unary>().unwrap(), f);
        }
        assert!("softplus".parse::<Unary>().is_err());
        assert_eq!(Unary::Relu.apply(-0.5), 0.0);
        assert!(Unary::Relu.apply(f64::NAN).is_nan());
        assert_eq!(Unary::Relu.grad(f64::NAN), 1.0);
    }
}
