// split.wgsl: the bf16 split x = h + m + l (DESIGN.md) into packed bf16 planes. Needs
// formats.wgsl. h = bf16(x), m = bf16(x - h), l = bf16(x - h - m); each difference is exact in
// f32 and computed in integers (`sub_exact`), so GPUs that flush subnormal arithmetic
// (SwiftShader in browsers) give the same bits. Where h is not finite, m = l = 0.

struct SplitParams {
    len: u32,
    // Words per plane; plane p starts at word p * plane_words.
    plane_words: u32,
    // Planes written: 2 (h, m) or 3 (h, m, l).
    parts: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> params: SplitParams;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

// x - y (f32 bits) where y is x rounded to fewer significant bits: same sign, exponents at most
// one apart, so the difference is exactly representable. +0 when they are equal (as IEEE's x - x).
fn sub_exact(x: u32, y: u32) -> u32 {
    let ex = (x >> 23u) & 0xffu;
    let ey = (y >> 23u) & 0xffu;
    let sx = (x & 0x7fffffu) | select(0u, 0x800000u, ex != 0u);
    let sy = (y & 0x7fffffu) | select(0u, 0x800000u, ey != 0u);
    // Both as integers times 2^(b - 150), b the smaller effective exponent.
    let bx = max(ex, 1u);
    let by = max(ey, 1u);
    let b = min(bx, by);
    var d = i32(sx << (bx - b)) - i32(sy << (by - b));
    if (d == 0) {
        return 0u;
    }
    var sign = x & 0x80000000u;
    if (d < 0) {
        sign ^= 0x80000000u;
        d = -d;
    }
    let ud = u32(d);
    let lead = firstLeadingBit(ud);
    if (i32(b) + i32(lead) - 23 >= 1) {
        // Normal: the leading bit becomes the implicit one (right shifts drop zeros only).
        let e = u32(i32(b) + i32(lead) - 23);
        var sig = ud << (23u - min(lead, 23u));
        if (lead > 23u) {
            sig = ud >> (lead - 23u);
        }
        return sign | (e << 23u) | (sig & 0x7fffffu);
    }
    // Subnormal: ud * 2^(b - 150) = (ud << (b - 1)) * 2^-149.
    return sign | (ud << (b - 1u));
}

fn split_one(x: u32) -> vec3<u32> {
    let l = layout_of(FMT_BF16);
    let h = encode_bits(x, l, false);
    if ((h & 0x7f80u) == 0x7f80u) {
        return vec3<u32>(h, 0u, 0u);
    }
    let r1 = sub_exact(x, h << 16u);
    let m = encode_bits(r1, l, false);
    let r2 = sub_exact(r1, m << 16u);
    return vec3<u32>(h, m, encode_bits(r2, l, false));
}

@compute @workgroup_size(256)
fn split_bf16(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let word = flat_index(wg, nwg, lid);
    if (word >= params.plane_words) {
        return;
    }
    var planes = vec3<u32>(0u);
    for (var t = 0u; t < 2u; t++) {
        let e = word * 2u + t;
        if (e < params.len) {
            planes |= split_one(src[e]) << vec3<u32>(t * 16u);
        }
    }
    dst[word] = planes.x;
    dst[params.plane_words + word] = planes.y;
    if (params.parts == 3u) {
        dst[2u * params.plane_words + word] = planes.z;
    }
}
