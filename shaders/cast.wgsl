// cast.wgsl: casts between f32 and the stored formats, and fp8 quantization with scales.
// Needs formats.wgsl. Packed outputs: one invocation writes one whole word, so no atomics.

struct CastParams {
    // Number of elements.
    len: u32,
    format: u32,
    saturate: u32,
    // Which scale an element uses (quantize): group = (e / batch_len) * groups_per_batch
    // + ((e % batch_len) / div) % modulus. Tensorwise, per row and per column all fit.
    batch_len: u32,
    div: u32,
    modulus: u32,
    groups_per_batch: u32,
    // Where this operand's scales start in `scales`.
    scale_offset: u32,
}

@group(0) @binding(0) var<uniform> params: CastParams;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;
@group(0) @binding(3) var<storage, read> scales: array<f32>;

fn scale_group(e: u32) -> u32 {
    let within = e % params.batch_len;
    return (e / params.batch_len) * params.groups_per_batch + (within / params.div) % params.modulus;
}

// f32 -> packed codes of params.format: invocation i writes word i.
@compute @workgroup_size(256)
fn encode(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let word = flat_index(wg, nwg, lid);
    let per = per_word(params.format);
    let bits = 32u / per;
    if (word * per >= params.len) {
        return;
    }
    var packed = 0u;
    for (var t = 0u; t < per; t++) {
        let e = word * per + t;
        if (e < params.len) {
            packed |= encode_format(src[e], params.format, params.saturate != 0u) << (t * bits);
        }
    }
    dst[word] = packed;
}

// Packed codes of params.format -> f32 bits: invocation i writes element i.
@compute @workgroup_size(256)
fn decode(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) lid: u32) {
    let e = flat_index(wg, nwg, lid);
    if (e >= params.len) {
        return;
    }
    let per = per_word(params.format);
    dst[e] = decode_format(unpack_code(src[e / per], e, params.format), params.format);
}

// f32 -> fp8 codes of sat_cast(x * s), s from `scales` by group; a non-finite x gives NaN so
// that every output it touches is NaN (docs/design.md, fp8 scaling).
@compute @workgroup_size(256)
fn quantize(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let word = flat_index(wg, nwg, lid);
    if (word * 4u >= params.len) {
        return;
    }
    let l = layout_of(params.format);
    var packed = 0u;
    for (var t = 0u; t < 4u; t++) {
        let e = word * 4u + t;
        if (e < params.len) {
            let x = src[e];
            var code = nan_code(l) | ((x >> 31u) << 7u);
            if ((x & 0x7f800000u) != 0x7f800000u) {
                let y = bitcast<f32>(x) * scales[params.scale_offset + scale_group(e)];
                code = encode_bits(bitcast<u32>(y), l, true);
            }
            packed |= code << (t * 8u);
        }
    }
    dst[word] = packed;
}
