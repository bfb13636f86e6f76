// cast.cu: casts between f32 and the stored formats, the bf16 split, and fp8 quantization with
// scales. Needs formats.cuh. The CUDA twin of shaders/cast.wgsl and shaders/split.wgsl.
//
// The conversions a matmul runs on its operands (round_to, encode_16, split_planes,
// quantize_to_f16) move bytes at the memory's speed: f32 in four at a time (16-byte loads)
// where the buffer allows, codes out four at a time (8-byte stores), over a grid sized to the
// device (src/backend/cuda/matmul.rs) that strides over the rest; the tail one at a time. The
// format is a template argument there, so that its rounding folds to a few integer
// operations; each kernel picks the instance once.

// f32 -> one code of `fmt` per element (Backend::encode).
extern "C" __global__ void encode(const u32* x, u32* out, i64 n, u32 fmt, u32 saturate) {
    FOR_EACH(e, n) out[e] = encode_format(x[e], fmt, saturate != 0u);
}

// Codes of `fmt` -> f32 bits (Backend::decode).
extern "C" __global__ void decode(const u32* codes, u32* out, i64 n, u32 fmt) {
    FOR_EACH(e, n) out[e] = decode_format(codes[e], fmt);
}

// x rounded to FMT, as f32 bits.
template <u32 FMT>
__device__ __forceinline__ u32 rounded(u32 x) {
    return decode_format_inline(encode_format_inline(x, FMT, false), FMT);
}

template <u32 FMT>
__device__ __forceinline__ void round_all(const u32* x, u32* out, i64 n) {
    i64 quads = aligned(x, 16) && aligned(out, 16) ? n / 4 : 0;
    FOR_EACH(q, quads) {
        uint4 v = ((const uint4*)x)[q];
        ((uint4*)out)[q] = make_uint4(rounded<FMT>(v.x), rounded<FMT>(v.y), rounded<FMT>(v.z),
                                      rounded<FMT>(v.w));
    }
    FOR_EACH_FROM(e, 4 * quads, n) out[e] = rounded<FMT>(x[e]);
}

// f32 -> f32 rounded to `fmt` (tf32 operands of the tf32 GEMM; a plan's roundings, in place:
// out may be x).
extern "C" __global__ void round_to(const u32* x, u32* out, i64 n, u32 fmt) {
    switch (fmt) {
        case FMT_TF32: round_all<FMT_TF32>(x, out, n); break;
        case FMT_BF16: round_all<FMT_BF16>(x, out, n); break;
        case FMT_F16: round_all<FMT_F16>(x, out, n); break;
        default: FOR_EACH(e, n) out[e] = decode_format(encode_format(x[e], fmt, false), fmt);
    }
}

// Four 16-bit codes in the order of their elements, as one 8-byte store.
__device__ __forceinline__ uint2 pack4(u32 a, u32 b, u32 c, u32 d) {
    return make_uint2(a | (b << 16), c | (d << 16));
}

template <u32 FMT>
__device__ __forceinline__ void encode_16_all(const u32* x, u16* out, i64 n) {
    i64 quads = aligned(x, 16) && aligned(out, 8) ? n / 4 : 0;
    FOR_EACH(q, quads) {
        uint4 v = ((const uint4*)x)[q];
        ((uint2*)out)[q] = pack4(encode_format_inline(v.x, FMT, false), encode_format_inline(v.y, FMT, false),
                                 encode_format_inline(v.z, FMT, false), encode_format_inline(v.w, FMT, false));
    }
    FOR_EACH_FROM(e, 4 * quads, n) out[e] = (u16)encode_format_inline(x[e], FMT, false);
}

// f32 -> 16-bit codes of `fmt`, bf16 or f16 (the operands of a bf16 or f16 GEMM).
extern "C" __global__ void encode_16(const u32* x, u16* out, i64 n, u32 fmt) {
    if (fmt == FMT_BF16) encode_16_all<FMT_BF16>(x, out, n);
    else encode_16_all<FMT_F16>(x, out, n);
}

// The bf16 split into three planes of codes, one u32 each (Backend::split_bf16).
extern "C" __global__ void split_bf16(const float* x, u32* planes, i64 n) {
    FOR_EACH(e, n) {
        Split s = split_bf16_one(x[e]);
        planes[e] = s.h;
        planes[n + e] = s.m;
        planes[2 * n + e] = s.l;
    }
}

// One operand of `split_planes` (src/backend/cuda/matmul.rs passes it by value): element
// (batch, r, c) of a batches x rows x cols operand, x[batch*sb + r*sr + c*sc], goes to
// out[batch*ob + r*orow + c + slot*os] in four planes: h (level 0's factor), h with
// non-finite values as 0 (the lower levels' factor: their terms use 0 there), m and l, their
// slots in `slots`; 0xffffffff: the plane is not written (bf16x3 has no l).
struct SplitOperand {
    const float* x;
    u16* out;
    i64 sb, sr, sc;
    i64 ob, orow, os;
    u32 batches, rows, cols;
    u32 slots[4];
};

// The four plane codes of x: h, h', m, l.
__device__ __forceinline__ void plane_codes(float x, u32 codes[4]) {
    Split s = split_bf16_one(x);
    codes[0] = s.h;
    codes[1] = finite_h(s);
    codes[2] = s.m;
    codes[3] = s.l;
}

// Splits row `line` (over batches and rows) of `o`, its columns shared out over the x
// dimension of the grid and the block: four at a time where the row and the planes allow it.
__device__ __forceinline__ void split_line(const SplitOperand& o, i64 line) {
    i64 batch = line / o.rows, r = line - batch * o.rows;
    const float* x = o.x + batch * o.sb + r * o.sr;
    u16* out = o.out + batch * o.ob + r * o.orow;
    u32 first = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
    bool by4 = o.sc == 1 && o.cols % 4u == 0u && o.sb % 4 == 0 && o.sr % 4 == 0 &&
               o.ob % 4 == 0 && o.orow % 4 == 0 && o.os % 4 == 0 && aligned(o.x, 16) &&
               aligned(o.out, 8);
    if (by4) {
        for (u32 q = first; q < o.cols / 4u; q += step) {
            float4 v = ((const float4*)x)[q];
            u32 c0[4], c1[4], c2[4], c3[4];
            plane_codes(v.x, c0);
            plane_codes(v.y, c1);
            plane_codes(v.z, c2);
            plane_codes(v.w, c3);
            for (int p = 0; p < 4; p++) {
                if (o.slots[p] != 0xffffffffu) {
                    uint2* plane = (uint2*)(out + o.slots[p] * o.os);
                    plane[q] = pack4(c0[p], c1[p], c2[p], c3[p]);
                }
            }
        }
        return;
    }
    for (u32 c = first; c < o.cols; c += step) {
        u32 codes[4];
        plane_codes(x[c * o.sc], codes);
        for (int p = 0; p < 4; p++) {
            if (o.slots[p] != 0xffffffffu) out[o.slots[p] * o.os + c] = (u16)codes[p];
        }
    }
}

// The bf16 split of both operands of a matmul, laid out for one cuBLAS GEMM per level
// (src/backend/cuda/split.rs), in one pass: the y dimensions of the grid and the block stride
// over the rows of A, then of B, their x dimensions over a row's columns (a block spans
// several short rows).
extern "C" __global__ void split_planes(SplitOperand a, SplitOperand b) {
    i64 lines_a = (i64)a.batches * a.rows, lines = lines_a + (i64)b.batches * b.rows;
    i64 first = (i64)blockIdx.y * blockDim.y + threadIdx.y, step = (i64)gridDim.y * blockDim.y;
    for (i64 line = first; line < lines; line += step) {
        if (line < lines_a) split_line(a, line);
        else split_line(b, line - lines_a);
    }
}

// The fp8 code of sat_cast(v * scale) in layout `l`; a non-finite v gives NaN, so that every
// output it touches is NaN (docs/design.md).
__device__ __forceinline__ u32 fp8_code(float v, float scale, Layout l) {
    u32 bits = __float_as_uint(v);
    u32 code = nan_code(l) | ((bits >> 31) << (l.ebits + l.mbits));
    if ((bits & 0x7f800000u) != 0x7f800000u) {
        code = encode_bits_inline(__float_as_uint(__fmul_rn(v, scale)), l, true);
    }
    return code;
}

// The f16 code of the fp8 value fp8_code gives (every e4m3 and e5m2 value is an f16 value).
template <u32 FMT>
__device__ __forceinline__ u32 f16_of_fp8(float v, float scale) {
    Layout l = layout_of(FMT);
    return encode_bits_inline(decode_bits_inline(fp8_code(v, scale, l), l), layout_of(FMT_F16), false);
}

template <u32 FMT>
__device__ __forceinline__ void quantize_f16_all(const float* x, u16* out, i64 n,
                                                 const float* scales, Groups g) {
    bool by4 = g.batch_len % 4u == 0u && aligned(x, 16) && aligned(out, 8);
    i64 quads = by4 ? n / 4 : 0;
    FOR_EACH(q, quads) {
        float4 v = ((const float4*)x)[q];
        u32 at[4];
        groups_of_4(4 * q, n, g, at);
        ((uint2*)out)[q] = pack4(f16_of_fp8<FMT>(v.x, scales[at[0]]), f16_of_fp8<FMT>(v.y, scales[at[1]]),
                                 f16_of_fp8<FMT>(v.z, scales[at[2]]), f16_of_fp8<FMT>(v.w, scales[at[3]]));
    }
    FOR_EACH_FROM(e, 4 * quads, n) out[e] = (u16)f16_of_fp8<FMT>(x[e], scales[group_of(e, g)]);
}

// f32 -> sat_cast(x * s) in fp8 `fmt` (e4m3 or e5m2), s = scales[group], written as the f16
// code of the same value, so that f16 tensor cores multiply them exactly.
extern "C" __global__ void quantize_to_f16(const float* x, u16* out, i64 n, u32 fmt,
                                           const float* scales, u32 batch_len, u32 div,
                                           u32 modulus, u32 groups_per_batch) {
    Groups g = {batch_len, div, modulus, groups_per_batch};
    if (fmt == FMT_E4M3) quantize_f16_all<FMT_E4M3>(x, out, n, scales, g);
    else quantize_f16_all<FMT_E5M2>(x, out, n, scales, g);
}

// The same quantization as fp8 bytes for cuBLASLt's fp8 GEMM (src/backend/cuda/fp8.rs): element
// e of the stored operand, (batch, r, c) of `rows` x `cols`, goes to
// out[batch*ob + r*orow + c*ocol] (the "TN" layout: each row of A and column of B contiguous
// in K; the padding stays as allocated, zero).
extern "C" __global__ void quantize_to_fp8(const float* x, u8* out, i64 n, u32 fmt,
                                           const float* scales, u32 batch_len, u32 div,
                                           u32 modulus, u32 groups_per_batch, u32 rows, u32 cols,
                                           i64 ob, i64 orow, i64 ocol) {
    Groups g = {batch_len, div, modulus, groups_per_batch};
    Layout l = layout_of(fmt);
    FOR_EACH(e, n) {
        i64 per = (i64)rows * cols, batch = e / per, r = (e % per) / cols, c = e % cols;
        out[batch * ob + r * orow + c * ocol] = (u8)fp8_code(x[e], scales[group_of(e, g)], l);
    }
}
