// fetch.wgsl: `fn {{name}}(idx: u32) -> f32`, which decodes element `idx` of the operand array
// {{array}}, one piece per storage kind of an operand (src/backend/wgpu/shaders.rs, `Operand`).
// The loader writes the piece of each operand's kind with its names in place (fetch_a over
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
