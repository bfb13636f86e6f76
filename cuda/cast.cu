// cast.cu: casts between f32 and the stored formats, the bf16 split, and fp8 quantization with
// scales. Needs formats.cuh. The CUDA twin of shaders/cast.wgsl and shaders/split.wgsl.

// f32 -> one code of `fmt` per element (Backend::encode).
extern "C" __global__ void encode(const u32* x, u32* out, i64 n, u32 fmt, u32 saturate) {
    FOR_EACH(e, n) out[e] = encode_format(x[e], fmt, saturate != 0u);
}

// Codes of `fmt` -> f32 bits (Backend::decode).
extern "C" __global__ void decode(const u32* codes, u32* out, i64 n, u32 fmt) {
    FOR_EACH(e, n) out[e] = decode_format(codes[e], fmt);
}

// f32 -> f32 rounded to `fmt` (tf32 operands of the tf32 GEMM).
extern "C" __global__ void round_to(const u32* x, u32* out, i64 n, u32 fmt) {
    FOR_EACH(e, n) out[e] = decode_format(encode_format(x[e], fmt, false), fmt);
}

// f32 -> 16-bit codes (bf16 or f16 GEMM operands).
extern "C" __global__ void encode_16(const u32* x, u16* out, i64 n, u32 fmt) {
    FOR_EACH(e, n) out[e] = (u16)encode_format(x[e], fmt, false);
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

// The bf16 split of a matmul operand laid out for one cuBLAS GEMM per level
// (src/backend/cuda/split.rs): element (batch, r, c) of the operand, x[batch*sb + r*sr + c*sc],
// goes to out[batch*ob + r*orow + c*ocol + slot*os] in four planes: h (level 0's factor), h with
// non-finite values as 0 (the lower levels' factor: their terms use 0 there), m and l. A plane
// whose slot is 0xffffffff is not written (bf16x3 has no l). n = batches * rows * cols.
extern "C" __global__ void split_planes(const float* x, u16* out, i64 n, u32 rows, u32 cols,
                                        i64 sb, i64 sr, i64 sc, i64 ob, i64 orow, i64 ocol,
                                        i64 os, u32 slot_h, u32 slot_hf, u32 slot_m,
                                        u32 slot_l) {
    FOR_EACH(e, n) {
        i64 per = (i64)rows * cols, batch = e / per, r = (e % per) / cols, c = e % cols;
        Split s = split_bf16_one(x[batch * sb + r * sr + c * sc]);
        u16* o = out + batch * ob + r * orow + c * ocol;
        const u32 slots[4] = {slot_h, slot_hf, slot_m, slot_l};
        const u32 codes[4] = {s.h, finite_h(s), s.m, s.l};
        for (int p = 0; p < 4; p++) {
            if (slots[p] != 0xffffffffu) o[slots[p] * os] = (u16)codes[p];
        }
    }
}

// The fp8 code of sat_cast(v * scale) in layout `l`; a non-finite v gives NaN, so that every
// output it touches is NaN (docs/design.md).
__device__ __forceinline__ u32 fp8_code(float v, float scale, Layout l) {
    u32 bits = __float_as_uint(v);
    u32 code = nan_code(l) | ((bits >> 31) << (l.ebits + l.mbits));
    if ((bits & 0x7f800000u) != 0x7f800000u) {
        code = encode_bits(__float_as_uint(__fmul_rn(v, scale)), l, true);
    }
    return code;
}

// f32 -> sat_cast(x * s) in fp8 `fmt`, s = scales[group], written as the f16 code of the same
// value (every e4m3 and e5m2 value is an f16 value), so that f16 tensor cores multiply them
// exactly.
extern "C" __global__ void quantize_to_f16(const float* x, u16* out, i64 n, u32 fmt,
                                           const float* scales, u32 batch_len, u32 div,
                                           u32 modulus, u32 groups_per_batch) {
    Groups g = {batch_len, div, modulus, groups_per_batch};
    Layout l = layout_of(fmt);
    FOR_EACH(e, n) {
        u32 code = fp8_code(x[e], scales[group_of(e, g)], l);
        out[e] = (u16)encode_bits(decode_bits(code, l), layout_of(FMT_F16), false);
    }
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
