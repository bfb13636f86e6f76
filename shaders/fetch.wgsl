// fetch.wgsl: `fn {{name}}(idx: u32) -> f32`, which decodes element `idx` of the operand array
// {{array}}, one piece per storage kind of an operand (src/backend/wgpu/shaders.rs, `Operand`),
// and `fn {{name}}4(quad: u32) -> vec4<f32>`, elements 4 quad .. 4 quad + 3 in one load where
// the operand is bound as quads (array<vec4<u32>>: f32 and tf32 loaded `Load::Quads*`).
// The loader writes the pieces of each operand's kind with its names in place (fetch_a over
// a_data, fetch_b over b_data), before matmul.wgsl.

// @@f32
fn {{name}}(idx: u32) -> f32 {
    return bitcast<f32>({{array}}[idx]);
}

// @@tf32
fn {{name}}(idx: u32) -> f32 {
    return bitcast<f32>(encode_format({{array}}[idx], FMT_TF32, false));
}

// @@bf16
fn {{name}}(idx: u32) -> f32 {
    return bitcast<f32>(unpack_code({{array}}[idx >> 1u], idx, FMT_BF16) << 16u);
}

// @@bf16_rounded
fn {{name}}(idx: u32) -> f32 {
    return bitcast<f32>(encode_format({{array}}[idx], FMT_BF16, false) << 16u);
}

// @@f16_rounded
fn {{name}}(idx: u32) -> f32 {
    return bitcast<f32>(decode_format(encode_format({{array}}[idx], FMT_F16, false), FMT_F16));
}

// @@f16_native
fn {{name}}(idx: u32) -> f32 {
    return f32({{array}}[idx]);
}

// @@f16_packed
// Decoded in integers, not by unpack2x16float: SwiftShader flushes f16 subnormals there, and
// the contract says they are values.
fn {{name}}(idx: u32) -> f32 {
    return bitcast<f32>(decode_format(unpack_code({{array}}[idx >> 1u], idx, FMT_F16), FMT_F16));
}

// @@fp8
fn {{name}}(idx: u32) -> f32 {
    return bitcast<f32>(decode_format(unpack_code({{array}}[idx >> 2u], idx, {{fmt}}), {{fmt}}));
}

// @@f32_quads
fn {{name}}(idx: u32) -> f32 {
    return bitcast<f32>({{array}}[idx >> 2u][idx & 3u]);
}

fn {{name}}4(quad: u32) -> vec4<f32> {
    return bitcast<vec4<f32>>({{array}}[quad]);
}

// @@tf32_quads
fn {{name}}(idx: u32) -> f32 {
    return bitcast<f32>(encode_format({{array}}[idx >> 2u][idx & 3u], FMT_TF32, false));
}

fn {{name}}4(quad: u32) -> vec4<f32> {
    let w = {{array}}[quad];
    return bitcast<vec4<f32>>(vec4<u32>(encode_format(w.x, FMT_TF32, false),
        encode_format(w.y, FMT_TF32, false), encode_format(w.z, FMT_TF32, false),
        encode_format(w.w, FMT_TF32, false)));
}

// @@no_quads
// Loaded element by element: matmul.wgsl never calls this for such an operand.
fn {{name}}4(quad: u32) -> vec4<f32> {
    return vec4<f32>({{name}}(4u * quad), {{name}}(4u * quad + 1u), {{name}}(4u * quad + 2u),
        {{name}}(4u * quad + 3u));
}
