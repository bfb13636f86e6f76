// formats.wgsl: bit-exact encode/decode of every mantissa format, spliced into every kernel.
//
// Integer operations only: the results must equal the host `format` module bit for bit, and
// GPU float conversions are neither required to round to nearest even nor to keep subnormals.
// A format is a Layout (exponent bits, mantissa bits, IEEE specials or "fn" specials); the ids
// below are `Format`'s order in src/format/mod.rs.

const FMT_F32: u32 = 0u;
const FMT_TF32: u32 = 1u;
const FMT_BF16: u32 = 2u;
const FMT_F16: u32 = 3u;
const FMT_E4M3: u32 = 4u;
const FMT_E5M2: u32 = 5u;

struct Layout {
    ebits: u32,
    mbits: u32,
    // IEEE-like: the all-ones exponent holds inf and NaN. Else (e4m3fn) no inf, NaN = S.1111.111.
    ieee: bool,
}

fn layout_of(fmt: u32) -> Layout {
    switch fmt {
        case 1u: { return Layout(8u, 10u, true); }
        case 2u: { return Layout(8u, 7u, true); }
        case 3u: { return Layout(5u, 10u, true); }
        case 4u: { return Layout(4u, 3u, false); }
        case 5u: { return Layout(5u, 2u, true); }
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
