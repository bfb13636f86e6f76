// unary.wgsl: the unary family (src/plan/unary.rs defines each function and its derivative; the
// ids below are `Unary::id`), spliced before train.wgsl (unary_fwd, unary_bwd), step.wgsl and
// epilogue.wgsl (a bias add's GELU), so that every kernel computes them with the same
// instructions. Adding a function: its arm in `unary` and in `unary_grad`.

const UNARY_GELU: u32 = 0u;
const UNARY_SILU: u32 = 1u;
const UNARY_RELU: u32 = 2u;
const UNARY_SIGMOID: u32 = 3u;
const UNARY_TANH: u32 = 4u;

const SQRT_2_OVER_PI: f32 = 0.7978845608;

// tanh, clamped because some GPUs (SwiftShader in browsers) build tanh from exp and return NaN
// once exp overflows; tanh(10) already rounds to 1 in f32, so the clamp changes no result. The
// callers keep a NaN x's NaN through the products around it.
fn safe_tanh(u: f32) -> f32 {
    return tanh(clamp(u, -10.0, 10.0));
}

// tanh of the GELU argument.
fn gelu_tanh(x: f32) -> f32 {
    return safe_tanh(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x));
}

fn gelu(x: f32) -> f32 {
    return 0.5 * x * (1.0 + gelu_tanh(x));
}

// NaN, tested on the bits: a float compare may be compiled as if no NaN existed.
fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

// x < 0 and x > 0 decided on the bits: a device that flushes subnormals (Mesa 26's lavapipe)
// compares a subnormal as zero, where the host's definition sees its sign.
fn below_zero(x: f32) -> bool {
    let b = bitcast<u32>(x);
    return (b >> 31u) == 1u && (b & 0x7fffffffu) != 0u && !is_nan(x);
}

fn above_zero(x: f32) -> bool {
    let b = bitcast<u32>(x);
    return (b >> 31u) == 0u && (b & 0x7fffffffu) != 0u && !is_nan(x);
}

// tanh to a few units in the last place (the `tanh` function of the unary family): a device's
// builtin may build tanh from exp as (e^x - e^-x) / (e^x + e^-x), off by a unit of 1 where
// the result is small (lavapipe: 1e-5 relative at 0.005). Below 0.3 its odd series to x^13
// (the next term is under 1e-10 of x there), above 1 - 2 / (e^2|x| + 1), clamped as
// `safe_tanh`; a NaN kept.
fn tanh_accurate(x: f32) -> f32 {
    let a = abs(x);
    let z = x * x;
    let series = x * (1.0 + z * (-1.0 / 3.0 + z * (2.0 / 15.0 + z * (-17.0 / 315.0
        + z * (62.0 / 2835.0 + z * (-1382.0 / 155925.0 + z * (21844.0 / 6081075.0)))))));
    let e = exp(2.0 * min(a, 10.0));
    let large = sign(x) * (1.0 - 2.0 / (e + 1.0));
    return select(select(large, series, a < 0.3), x, is_nan(x));
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// f(x) of function `f` (`Unary::apply`).
fn unary(f: u32, x: f32) -> f32 {
    switch f {
        case UNARY_GELU: {
            return gelu(x);
        }
        case UNARY_SILU: {
            return x / (1.0 + exp(-x));
        }
        case UNARY_RELU: {
            return select(x, 0.0, below_zero(x));
        }
        case UNARY_SIGMOID: {
            return sigmoid(x);
        }
        case UNARY_TANH: {
            return tanh_accurate(x);
        }
        default: {
            return x;
        }
    }
}

// f' of function `f` in terms of what the backward reads (`Unary::grad`): dx = dy * f'(x), and
// for sigmoid and tanh, whose backward reads the forward's output y, y (1 - y) and 1 - y^2.
fn unary_grad(f: u32, x: f32) -> f32 {
    switch f {
        case UNARY_GELU: {
            let t = gelu_tanh(x);
            // x clamped where t is +-1 already (its term is 0): past |x| ~ 1e19, x^2 would
            // overflow and make that 0 a NaN, which the host's f64 does not.
            let xc = clamp(x, -100.0, 100.0);
            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * xc * xc);
            return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du;
        }
        case UNARY_SILU: {
            let s = sigmoid(x);
            return s * (1.0 + x * (1.0 - s));
        }
        case UNARY_RELU: {
            // PyTorch passes dy where the output is not <= 0 (a NaN's too).
            return select(0.0, 1.0, above_zero(x) || is_nan(x));
        }
        case UNARY_SIGMOID: {
            return x * (1.0 - x);
        }
        case UNARY_TANH: {
            return 1.0 - x * x;
        }
        default: {
            return 1.0;
        }
    }
}
