// coop_pack.wgsl: both operands of the cooperative-matrix matmul (matmul_coop.wgsl) as f16
// codes, row-major and zero-padded to whole tiles, so that 16x16 loads never leave the matrix,
// in one dispatch: A's words first, then B's. Needs formats.wgsl.
//
// parts = 0: f16(x) (the `f16` algorithm: the rounding is the algorithm's own).
// parts = 1..3: the bf16 planes of x (1: bf16(x); 2, 3: the split h, m, l), plane p times
// 2^(s + 8p) for the line's s (`shift_for_amax`): every plane then reaches up to f16's top
// binade, and all three are exact in f16 for |x| down to 2^-23 of the line's largest. A plane
// value that is not exact after scaling, or a non-finite x, flags its line: the SIMT kernel
// computes that line's outputs instead, so the algorithm's numbers never depend on f16's range.

struct PackParams {
    // The logical matrix (A: m x k, B: k x n) and its padded size.
    rows: u32,
    cols: u32,
    rows_p: u32,
    cols_p: u32,
    // Element strides of the logical matrix in `src`.
    src_batch: u32,
    src_row: u32,
    src_col: u32,
    // Words per plane in `dst`.
    plane_words: u32,
    words: u32,
    parts: u32,
    // Lines are rows (A) or columns (B); this operand's lines start at line_offset.
    by_row: u32,
    line_offset: u32,
    // What `src` holds: f32 bits (FMT_F32), or two 16-bit codes of this format a word (a step
    // plan's coded tensor).
    src_format: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

// A's packing, then B's.
struct PackPair {
    a: PackParams,
    b: PackParams,
}

@group(0) @binding(0) var<uniform> pair: PackPair;
@group(0) @binding(1) var<storage, read> src_a: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst_a: array<u32>;
@group(0) @binding(3) var<storage, read> amax_bits: array<u32>;
// One bit per line (line / 32, bit line % 32).
@group(0) @binding(4) var<storage, read_write> flags: array<atomic<u32>>;
@group(0) @binding(5) var<storage, read> src_b: array<u32>;
@group(0) @binding(6) var<storage, read_write> dst_b: array<u32>;

const SIDE_A: u32 = 0u;
const SIDE_B: u32 = 1u;

// Word e of operand `side`'s source.
fn src_word(side: u32, e: u32) -> u32 {
    if (side == SIDE_A) {
        return src_a[e];
    }
    return src_b[e];
}

// Word i of operand `side`'s packed planes.
fn set_dst(side: u32, i: u32, v: u32) {
    if (side == SIDE_A) {
        dst_a[i] = v;
    } else {
        dst_b[i] = v;
    }
}

// The f16 code of the bf16-exact value v (f32 bits) times 2^s, and whether it is exact
// (non-finite values are not: they go to the SIMT kernel).
fn f16_scaled(v: u32, s: i32) -> vec2<u32> {
    let sign = (v >> 16u) & 0x8000u;
    let mag = v & 0x7fffffffu;
    if (mag == 0u) {
        return vec2<u32>(sign, 1u);
    }
    if (mag >= 0x7f800000u) {
        return vec2<u32>(sign | 0x7c00u, 0u);
    }
    // mag = sig * 2^(e - 150), sig with its implicit bit.
    var e = i32(mag >> 23u);
    var sig = mag & 0x7fffffu;
    if (e == 0) {
        e = 1;
    } else {
        sig = sig | 0x800000u;
    }
    let lead = i32(firstLeadingBit(sig));
    let exponent = e - 150 + s + lead;
    if (exponent > 15) {
        return vec2<u32>(sign | 0x7c00u, 0u);
    }
    // In units of f16's quantum 2^q at that exponent (subnormals share 2^-24).
    let q = max(exponent, -14) - 10;
    let d = e - 150 + s - q;
    var units = 0u;
    var exact = true;
    if (d >= 0) {
        units = sig << u32(d);
    } else if (d > -25) {
        units = sig >> u32(-d);
        exact = (units << u32(-d)) == sig;
    } else {
        exact = false;
    }
    if (exponent >= -14) {
        return vec2<u32>(sign | (u32(exponent + 15) << 10u) | (units & 0x3ffu), u32(exact));
    }
    return vec2<u32>(sign | units, u32(exact));
}

@compute @workgroup_size(256)
fn coop_pack(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    let word = flat_index(wg, nwg, lid);
    if (word < pair.a.words) {
        pack_word(pair.a, SIDE_A, word);
    } else if (word - pair.a.words < pair.b.words) {
        pack_word(pair.b, SIDE_B, word - pair.a.words);
    }
}

// Word `word` of operand `side`'s packed planes, as `params` lays it out.
fn pack_word(params: PackParams, side: u32, word: u32) {
    // Two consecutive columns of one padded row (cols_p is even).
    let per_batch = params.rows_p * params.cols_p / 2u;
    let batch = word / per_batch;
    let within = word % per_batch;
    let r = within / (params.cols_p / 2u);
    let c0 = (within % (params.cols_p / 2u)) * 2u;
    var codes = vec3<u32>(0u);
    for (var t = 0u; t < 2u; t++) {
        let c = c0 + t;
        if (r >= params.rows || c >= params.cols) {
            continue;
        }
        let e = batch * params.src_batch + r * params.src_row + c * params.src_col;
        var x = src_word(side, e);
        if (params.src_format != FMT_F32) {
            x = decode_format(unpack_code(src_word(side, e >> 1u), e, params.src_format), params.src_format);
        }
        if (params.parts == 0u) {
            codes.x |= encode_format(x, FMT_F16, false) << (16u * t);
            continue;
        }
        let line = params.line_offset + select(batch * params.cols + c, batch * params.rows + r, params.by_row == 1u);
        let s = shift_for_amax(amax_bits[line]);
        let planes = split_one(x);
        var exact = true;
        for (var p = 0u; p < params.parts; p++) {
            // Plane p is about 2^(-8p) of x: shifting it 8p further keeps its low bits in f16.
            let scaled = f16_scaled(planes[p] << 16u, s + 8 * i32(p));
            exact = exact && scaled.y == 1u;
            codes[p] |= scaled.x << (16u * t);
        }
        if (!exact) {
            atomicOr(&flags[line / 32u], 1u << (line % 32u));
        }
    }
    for (var p = 0u; p < max(params.parts, 1u); p++) {
        set_dst(side, p * params.plane_words + word, codes[p]);
    }
}
