// formats.cuh: bit-exact encode/decode of every mantissa format, spliced into every kernel
// (the CUDA twin of shaders/formats.wgsl; the host `format` module is the truth).
//
// Integer operations only for the roundings: tf32, e4m3 and e5m2 have no conversion
// instructions with these semantics. Float arithmetic elsewhere is IEEE: NVRTC is invoked
// without --ftz and with --prec-div, so subnormals are kept and divisions rounded to nearest.
// No headers: NVRTC then needs nothing but itself.

// The format ids FMT_<NAME> come in the generated header (src/backend/defs.rs).

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

struct Layout {
    u32 ebits;
    u32 mbits;
    // IEEE-like: the all-ones exponent holds inf and NaN. Else (e4m3fn) no inf, NaN = S.1111.111.
    bool ieee;
};

__device__ __forceinline__ Layout layout_of(u32 fmt) {
    switch (fmt) {
        case FMT_TF32: return Layout{8u, 10u, true};
        case FMT_BF16: return Layout{8u, 7u, true};
        case FMT_F16: return Layout{5u, 10u, true};
        case FMT_E4M3: return Layout{4u, 3u, false};
        case FMT_E5M2: return Layout{5u, 2u, true};
        default: return Layout{8u, 23u, true};
    }
}

__device__ __forceinline__ u32 exp_ones(Layout l) { return (1u << l.ebits) - 1u; }
__device__ __forceinline__ u32 man_ones(Layout l) { return (1u << l.mbits) - 1u; }
__device__ __forceinline__ u32 leading_bit(u32 x) { return 31u - (u32)__clz(x); }

__device__ __forceinline__ u32 max_code(Layout l) {
    if (l.ieee) return ((exp_ones(l) - 1u) << l.mbits) | man_ones(l);
    return (exp_ones(l) << l.mbits) | (man_ones(l) - 1u);
}

__device__ __forceinline__ u32 nan_code(Layout l) { return (exp_ones(l) << l.mbits) | man_ones(l); }

// Encodes the f32 whose bits are `x` into layout `l` (not f32 itself), rounding to nearest
// even. Overflow gives inf (IEEE layouts) or NaN (fn layouts), or the signed max if `saturate`.
// Inlined where the layout is a constant (the conversion kernels: the compiler folds it to a
// few operations), called elsewhere (`encode_bits`: inlined copies in the training kernels'
// unrolled loops made NVRTC take minutes).
__device__ __forceinline__ u32 encode_bits_inline(u32 x, Layout l, bool saturate) {
    u32 sign = (x >> 31) << (l.ebits + l.mbits);
    u32 e32 = (x >> 23) & 0xffu;
    u32 m32 = x & 0x7fffffu;
    if (e32 == 0xffu) {
        if (m32 != 0u) return sign | nan_code(l);
        if (saturate) return sign | max_code(l);
        if (l.ieee) return sign | (exp_ones(l) << l.mbits);
        return sign | nan_code(l);
    }
    int bias = (int)(exp_ones(l) >> 1);
    int e = -126;
    u32 sig = m32;
    if (e32 != 0u) {
        e = (int)e32 - 127;
        sig = m32 | 0x800000u;
    }
    // Below the smallest normal the spacing stays that of the subnormals: shift further.
    int emin = 1 - bias;
    u32 shift = 23u - l.mbits;
    if (e < emin) shift += (u32)min(emin - e, 30);
    u32 q = 0u;
    if (shift <= 25u) {
        q = sig >> shift;
        u32 rem = sig & ((1u << shift) - 1u);
        u32 half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u) == 1u)) q += 1u;
    }
    // A rounding carry into the next binade lands in the exponent field by itself.
    u32 code = q;
    if (e >= emin) code = ((u32)(e + bias) << l.mbits) + q - (1u << l.mbits);
    if (code > max_code(l)) {
        if (saturate) code = max_code(l);
        else if (l.ieee) code = exp_ones(l) << l.mbits;
        else code = nan_code(l);
    }
    return sign | code;
}

__device__ u32 encode_bits(u32 x, Layout l, bool saturate) { return encode_bits_inline(x, l, saturate); }

// Decodes a code of layout `l` (not f32 itself) to the bits of the f32 with the same value
// (inlined and called as `encode_bits_inline` and `encode_bits`).
__device__ __forceinline__ u32 decode_bits_inline(u32 code, Layout l) {
    u32 sign = ((code >> (l.ebits + l.mbits)) & 1u) << 31;
    u32 ef = (code >> l.mbits) & exp_ones(l);
    u32 mf = code & man_ones(l);
    if (ef == exp_ones(l) && (l.ieee || mf == man_ones(l))) {
        if (l.ieee && mf == 0u) return sign | 0x7f800000u;
        return sign | 0x7fffffffu;
    }
    int bias = (int)(exp_ones(l) >> 1);
    if (ef == 0u) {
        if (mf == 0u) return sign;
        // Subnormal: normalise around the leading one.
        u32 lead = leading_bit(mf);
        int e = (int)lead + 1 - bias - (int)l.mbits;
        // Still subnormal in f32 (bf16, tf32): the same mantissa, shifted into place.
        if (e < -126) return sign | (mf << (u32)(150 - bias - (int)l.mbits));
        return sign | ((u32)(e + 127) << 23) | ((mf ^ (1u << lead)) << (23u - lead));
    }
    return sign | ((u32)((int)ef - bias + 127) << 23) | (mf << (23u - l.mbits));
}

__device__ u32 decode_bits(u32 code, Layout l) { return decode_bits_inline(code, l); }

// bf16 of the f32 whose bits are `x`, rounded to nearest even, overflow to inf, NaN to the
// quiet NaN of its sign: `encode_bits` for bf16 (whose exponent is f32's, so subnormals and
// the carry into the exponent need nothing more) in four operations, as the split and the
// bf16 GEMM operands take it once or three times per element.
__device__ __forceinline__ u32 bf16_rne(u32 x) {
    if ((x & 0x7fffffffu) > 0x7f800000u) return (x >> 16) | 0x7fffu;
    return (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
}

// Encodes f32 bits into format `fmt` (f32 itself included: identity, or inf -> max when
// saturating). tf32 codes are returned as the bits of the f32 that carries them. Inlined where
// `fmt` is a constant (the conversion kernels' templates), called elsewhere.
__device__ __forceinline__ u32 encode_format_inline(u32 x, u32 fmt, bool saturate) {
    if (fmt == FMT_F32) {
        if (saturate && (x & 0x7fffffffu) == 0x7f800000u) return (x & 0x80000000u) | 0x7f7fffffu;
        return x;
    }
    if (fmt == FMT_BF16 && !saturate) return bf16_rne(x);
    u32 code = encode_bits_inline(x, layout_of(fmt), saturate);
    if (fmt == FMT_TF32) return decode_bits_inline(code, layout_of(fmt));
    return code;
}

__device__ u32 encode_format(u32 x, u32 fmt, bool saturate) { return encode_format_inline(x, fmt, saturate); }

// Decodes a code of format `fmt` to f32 bits (tf32 and f32 codes are f32 bits already); the
// inlined twin as above.
__device__ __forceinline__ u32 decode_format_inline(u32 code, u32 fmt) {
    if (fmt == FMT_F32 || fmt == FMT_TF32) return code;
    return decode_bits_inline(code, layout_of(fmt));
}

__device__ __forceinline__ u32 decode_format(u32 code, u32 fmt) {
    if (fmt == FMT_F32 || fmt == FMT_TF32) return code;
    return decode_bits(code, layout_of(fmt));
}

// x as a plan holds it in format `fmt`: rounded to it, kept as f32 (f32: itself).
__device__ __forceinline__ float held(float x, u32 fmt) {
    if (fmt == FMT_F32) return x;
    return __uint_as_float(decode_format(encode_format(__float_as_uint(x), fmt, false), fmt));
}

// Stores element e of an output held in format `fmt`: as f32 (`held`), or where `coded` (a
// plan's coded tensor, bf16 or f16) as its 16-bit code, two bytes an element.
__device__ __forceinline__ void store_held(void* out, i64 e, float x, u32 fmt, u32 coded) {
    if (coded) {
        ((unsigned short*)out)[e] = (unsigned short)encode_format(__float_as_uint(x), fmt, false);
    } else {
        ((float*)out)[e] = held(x, fmt);
    }
}

// Loads element e of an input stored in format `fmt`: f32 values where `fmt` is f32, else (a
// plan's coded tensor, bf16 or f16) 16-bit codes, decoded exactly.
__device__ __forceinline__ float load_stored(const void* in, i64 e, u32 fmt) {
    if (fmt == FMT_F32) return ((const float*)in)[e];
    return __uint_as_float(decode_format(((const unsigned short*)in)[e], fmt));
}

__device__ __forceinline__ u32 bf16_of(float x) { return bf16_rne(__float_as_uint(x)); }

__device__ __forceinline__ float bf16_value(u32 code) { return __uint_as_float(code << 16); }

// The bf16 split x = h + m + l (docs/design.md): h = bf16(x), m = bf16(x - h), l = bf16(x - h - m).
// The differences are exact in f32 (IEEE subtraction, subnormals kept). Where h is not finite,
// m = l = 0. Returns the three bf16 codes.
struct Split {
    u32 h, m, l;
};

__device__ __forceinline__ Split split_bf16_one(float x) {
    Split s;
    s.h = bf16_of(x);
    if ((s.h & 0x7f80u) == 0x7f80u) {
        s.m = 0u;
        s.l = 0u;
        return s;
    }
    float r1 = x - bf16_value(s.h);
    s.m = bf16_of(r1);
    s.l = bf16_of(r1 - bf16_value(s.m));
    return s;
}

// h with non-finite values as 0: the lower levels' factor (their terms use 0 there).
__device__ __forceinline__ u32 finite_h(Split s) { return (s.h & 0x7f80u) == 0x7f80u ? 0u : s.h; }

// Which scale element e of an operand uses: group = (e / batch_len) * groups_per_batch
// + ((e % batch_len) / div) % modulus. Tensorwise, per row and per column all fit.
struct Groups {
    u32 batch_len;
    u32 div;
    u32 modulus;
    u32 groups_per_batch;
};

__device__ __forceinline__ u32 group_of(i64 e, Groups g) {
    i64 within = e % g.batch_len;
    return (u32)(e / g.batch_len) * g.groups_per_batch + (u32)((within / g.div) % g.modulus);
}

// The groups of elements e..e+3 of n (e a multiple of 4 and batch_len too, so that the four
// lie in one batch): one division by the batch where there are several, then 32-bit steps.
__device__ __forceinline__ void groups_of_4(i64 e, i64 n, Groups g, u32 out[4]) {
    u32 batch = n > (i64)g.batch_len ? (u32)(e / g.batch_len) : 0u;
    u32 within = (u32)(e - (i64)batch * g.batch_len);
    u32 line = within / g.div, at = within - line * g.div;
    for (int i = 0; i < 4; i++) {
        out[i] = batch * g.groups_per_batch + line % g.modulus;
        if (++at == g.div) {
            at = 0u;
            line++;
        }
    }
}

// Whether `p` is a multiple of `bytes` (a power of two): where 16-byte loads and 8-byte
// stores may go.
__device__ __forceinline__ bool aligned(const void* p, u32 bytes) {
    return ((unsigned long long)p & (unsigned long long)(bytes - 1u)) == 0ull;
}

// A grid-stride loop over n elements.
#define FOR_EACH(e, n) \
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < (i64)(n); e += (i64)gridDim.x * blockDim.x)

// A grid-stride loop over the last n - from of n elements (the tail after a loop over quads).
#define FOR_EACH_FROM(e, from, n) \
    for (i64 e = (i64)(from) + (i64)blockIdx.x * blockDim.x + threadIdx.x; e < (i64)(n); e += (i64)gridDim.x * blockDim.x)
