// gelu.wgsl: GELU in its tanh form, spliced before train.wgsl (gelu_fwd, gelu_bwd) and
// step.wgsl (a bias add's GELU), so the two compute it with the same instructions.

const SQRT_2_OVER_PI: f32 = 0.7978845608;

// tanh of the GELU argument. Clamped because some GPUs (SwiftShader in browsers) build tanh from
// exp and return NaN once exp overflows; tanh(10) already rounds to 1 in f32, so the clamp
// changes no result. A NaN x still propagates through the products around it.
fn gelu_tanh(x: f32) -> f32 {
    return tanh(clamp(SQRT_2_OVER_PI * (x + 0.044715 * x * x * x), -10.0, 10.0));
}

fn gelu(x: f32) -> f32 {
    return 0.5 * x * (1.0 + gelu_tanh(x));
}
