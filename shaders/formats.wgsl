// formats.wgsl: bit-exact encode/decode of every mantissa format, spliced into every kernel.
//
// Integer operations only: the results must equal the host `format` module bit for bit, and
// GPU float conversions are neither required to round to nearest even nor to keep subnormals.
// A format is a Layout (exponent bits, mantissa bits, IEEE specials or "fn" specials); the ids
// FMT_<NAME> come in the generated header (src/backend/defs.rs, from `Format::id`).

struct Layout {
    ebits: u32,
    mbits: u32,
    // IEEE-like: the all-ones exponent holds inf and NaN. Else (e4m3fn) no inf, NaN = S.1111.111.
    ieee: bool,
}

fn layout_of(fmt: u32) -> Layout {
    switch fmt {
        case FMT_TF32: { return Layout(8u, 10u, true); }
        case FMT_BF16: { return Layout(8u, 7u, true); }
        case FMT_F16: { return Layout(5u, 10u, true); }
        case FMT_E4M3: { return Layout(4u, 3u, false); }
        case FMT_E5M2: { return Layout(5u, 2u, true); }
        default: { return Layout(8u, 23u, true); }
    }
}

fn exp_ones(l: Layout) -> u32 {
    return (1u << l.ebits) - 1u;
}

fn man_ones(l: Layout) -> u32 {
    return (1u << l.mbits) - 1u;
}

fn max_code(l: Layout) -> u32 {
    if (l.ieee) {
        return ((exp_ones(l) - 1u) << l.mbits) | man_ones(l);
    }
    return (exp_ones(l) << l.mbits) | (man_ones(l) - 1u);
}

fn nan_code(l: Layout) -> u32 {
    return (exp_ones(l) << l.mbits) | man_ones(l);
}

// Encodes the f32 whose bits are `x` into layout `l` (not f32 itself), rounding to nearest
// even. Overflow gives inf (IEEE layouts) or NaN (fn layouts), or the signed max if `saturate`.
fn encode_bits(x: u32, l: Layout, saturate: bool) -> u32 {
    let sign = (x >> 31u) << (l.ebits + l.mbits);
    let e32 = (x >> 23u) & 0xffu;
    let m32 = x & 0x7fffffu;
    if (e32 == 0xffu) {
        if (m32 != 0u) {
            return sign | nan_code(l);
        }
        if (saturate) {
            return sign | max_code(l);
        }
        if (l.ieee) {
            return sign | (exp_ones(l) << l.mbits);
        }
        return sign | nan_code(l);
    }
    let bias = i32(exp_ones(l) >> 1u);
    var e = -126;
    var sig = m32;
    if (e32 != 0u) {
        e = i32(e32) - 127;
        sig = m32 | 0x800000u;
    }
    // Below the smallest normal the spacing stays that of the subnormals: shift further.
    let emin = 1 - bias;
    var shift = 23u - l.mbits;
    if (e < emin) {
        shift = shift + u32(min(emin - e, 30));
    }
    var q = 0u;
    if (shift <= 25u) {
        q = sig >> shift;
        let rem = sig & ((1u << shift) - 1u);
        let half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u) == 1u)) {
            q = q + 1u;
        }
    }
    // A rounding carry into the next binade lands in the exponent field by itself.
    var code = q;
    if (e >= emin) {
        code = (u32(e + bias) << l.mbits) + q - (1u << l.mbits);
    }
    if (code > max_code(l)) {
        if (saturate) {
            code = max_code(l);
        } else if (l.ieee) {
            code = exp_ones(l) << l.mbits;
        } else {
            code = nan_code(l);
        }
    }
    return sign | code;
}

// Decodes a code of layout `l` (not f32 itself) to the bits of the f32 with the same value.
fn decode_bits(code: u32, l: Layout) -> u32 {
    let sign = ((code >> (l.ebits + l.mbits)) & 1u) << 31u;
    let ef = (code >> l.mbits) & exp_ones(l);
    let mf = code & man_ones(l);
    if (ef == exp_ones(l) && (l.ieee || mf == man_ones(l))) {
        if (l.ieee && mf == 0u) {
            return sign | 0x7f800000u;
        }
        return sign | 0x7fffffffu;
    }
    let bias = i32(exp_ones(l) >> 1u);
    if (ef == 0u) {
        if (mf == 0u) {
            return sign;
        }
        // Subnormal: normalise around the leading one.
        let lead = firstLeadingBit(mf);
        let e = i32(lead) + 1 - bias - i32(l.mbits);
        if (e < -126) {
            // Still subnormal in f32 (bf16, tf32): the same mantissa, shifted into place.
            return sign | (mf << u32(150 - bias - i32(l.mbits)));
        }
        return sign | (u32(e + 127) << 23u) | ((mf ^ (1u << lead)) << (23u - lead));
    }
    return sign | (u32(i32(ef) - bias + 127) << 23u) | (mf << (23u - l.mbits));
}

// Encodes f32 bits into format `fmt` (f32 itself included: identity, or inf -> max when
// saturating). tf32 codes are returned as the bits of the f32 that carries them.
fn encode_format(x: u32, fmt: u32, saturate: bool) -> u32 {
    if (fmt == FMT_F32) {
        if (saturate && (x & 0x7fffffffu) == 0x7f800000u) {
            return (x & 0x80000000u) | 0x7f7fffffu;
        }
        return x;
    }
    let code = encode_bits(x, layout_of(fmt), saturate);
    if (fmt == FMT_TF32) {
        return decode_bits(code, layout_of(fmt));
    }
    return code;
}

// Decodes a code of format `fmt` to f32 bits (tf32 and f32 codes are f32 bits already).
fn decode_format(code: u32, fmt: u32) -> u32 {
    if (fmt == FMT_F32 || fmt == FMT_TF32) {
        return code;
    }
    return decode_bits(code, layout_of(fmt));
}

// x as a plan holds it in format `fmt`: rounded to it, kept as f32 (f32: itself).
fn held(x: f32, fmt: u32) -> f32 {
    if (fmt == FMT_F32) {
        return x;
    }
    return bitcast<f32>(decode_format(encode_format(bitcast<u32>(x), fmt, false), fmt));
}

// Elements per 32-bit word when stored packed: f32/tf32 one, bf16/f16 two, fp8 four.
fn per_word(fmt: u32) -> u32 {
    if (fmt >= FMT_E4M3) {
        return 4u;
    }
    if (fmt >= FMT_BF16) {
        return 2u;
    }
    return 1u;
}

// The code of packed element `e` within its word `w`.
fn unpack_code(w: u32, e: u32, fmt: u32) -> u32 {
    let per = per_word(fmt);
    if (per == 1u) {
        return w;
    }
    let bits = 32u / per;
    return (w >> ((e % per) * bits)) & ((1u << bits) - 1u);
}

// Flattened index of invocation `gid` in a 2-D grid of 256-wide workgroups (1-D dispatches
// larger than 65535 workgroups are folded into y).
fn flat_index(wg: vec3<u32>, num_wg: vec3<u32>, lid: u32) -> u32 {
    return (wg.y * num_wg.x + wg.x) * 256u + lid;
}

// The bf16 split (docs/design.md): each difference is exact in f32 and computed in integers
// (`sub_exact`), so GPUs that flush subnormal arithmetic (SwiftShader in browsers) give the same
// bits. Where h is not finite, m = l = 0.

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

// Cooperative-matrix operands are f16 scaled by 2^s per line (row of A, column of B), s chosen
// from the line's largest finite magnitude `amax` (f32 bits) so that it lands in [2^14, 2^15):
// bf16 values then stay below f16's max, and values down to 2^-31 of the largest are exact.
fn shift_for_amax(amax: u32) -> i32 {
    if (amax == 0u) {
        return 0;
    }
    var e = i32(amax >> 23u) - 127;
    if ((amax >> 23u) == 0u) {
        e = i32(firstLeadingBit(amax)) - 149;
    }
    return 14 - e;
}

// The word of two 16-bit codes of `fmt`: lo's in the low half (the even element), hi's above.
fn code_pair(lo: f32, hi: f32, fmt: u32) -> u32 {
    return encode_format(bitcast<u32>(lo), fmt, false) | (encode_format(bitcast<u32>(hi), fmt, false) << 16u);
}

// Element e of a tensor stored as 16-bit codes of `fmt`, from the word that holds it.
fn code_value(word: u32, e: u32, fmt: u32) -> f32 {
    return bitcast<f32>(decode_format((word >> (16u * (e & 1u))) & 0xffffu, fmt));
}
