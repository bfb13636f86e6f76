// attention.cu: fused causal self-attention (plan::Op::Attention and AttentionBwd), forward and
// backward, in the flash-attention scheme: the (T x T) scores and probabilities of a head never
// reach memory; the forward keeps each score row's (max, sum) and the backward recomputes P from
// them. Needs formats.cuh and mma.cuh. Host reference: attention_fwd / attention_bwd in
// src/backend/reference/ops.rs, which define the op as the unfused ops compute it.
//
// Numerics are the unfused plan's, step for step: q, k, v (and the output's gradient) rounded to
// the algorithm's input format, products exact and summed in f32, every matmul result held in
// the compute format, P held in the probabilities' format then rounded to the input format
// where it multiplies v. The softmax is exact rather than online-rescaled: a first pass finds a
// row's max and sum, a second uses P = exp(z - max) / sum, the value the unfused softmax stores.
// The backward's sum(P * dP) is taken over P and dP as the unfused softmax backward takes it,
// not as dO . O (which differs by the roundings). Masked keys (j > i) add nothing. This module
// alone is compiled with --fmad=true (src/backend/cuda/kernels.rs): an FMA of two 16-bit or
// tf32 values rounds as their exact product's add does; under f32 it skips the product's
// rounding, within the reductions' tolerance.
//
// Two families of kernels, each compiled for head sizes 16, 32 and 64 (`_<D>` in its name;
// other sizes keep the unfused ops):
// - the 16-bit algorithms (bf16 or f16 inputs: bf16-mixed, 16-mixed, the *-true presets,
//   transformer-engine's attention) on tensor cores, below `attention_mma_fwd`: the
//   flash-attention-2 design (tiles in shared memory, mma.sync with f32 accumulators, one
//   thread block per query block in the forward and per key block in the backward);
// - the others (f32, tf32) in SIMT, one thread per row, right below.
//
// SIMT: one thread per query row (forward, dq) or key row (dk, dv), ATT_ROWS to a block, the
// other side streamed through shared tiles of ATT_TILE rows that every thread reads at the same
// address (broadcasts). dq, dk and dv are three kernels, each writing its third of dqkv whole,
// so there are no atomics and a step rerun gives the same bits. The row's vectors are registers
// (three of them in the backward, which at 128 would spill).

#define ATT_ROWS 64u
#define ATT_TILE 32u
#define ATT_POS_INF __uint_as_float(0x7f800000u)
#define ATT_NEG_INF __uint_as_float(0xff800000u)
#define ATT_NAN __uint_as_float(0x7fc00000u)

// What every attention kernel is told besides its pointers (`AttentionArg` in
// src/backend/cuda/train.rs): t tokens per sequence, h heads, the scores' scale, and the format
// ids of the matmul inputs, the stored probabilities and the held matmul results; `coded`: the
// forward's output is stored as 16-bit codes of `compute` (a plan's coded tensor);
// `qkv_stored`: q|k|v is stored as that format's codes (f32's id: as f32 values).
struct AttentionArg {
    u32 t;
    u32 h;
    float scale;
    u32 inputs;
    u32 probs;
    u32 compute;
    u32 coded;
    u32 qkv_stored;
};

// `held` (formats.cuh) is inlined where it rounds a score, a probability or a gradient of one,
// once per score.

// `held` as a call, for the loops unrolled over a row's D values (loads and stores): inlined
// copies of the encoder there made NVRTC take minutes for one module.
__device__ __noinline__ float held_each(float x, u32 fmt) { return held(x, fmt); }
__device__ __noinline__ void store_each(void* out, i64 e, float x, u32 fmt, u32 coded) {
    store_held(out, e, x, fmt, coded);
}
// Element e of an input stored in format `stored` (`load_stored`), held in `fmt`.
__device__ __noinline__ float load_each(const void* in, i64 e, u32 stored, u32 fmt) {
    return held(load_stored(in, e, stored), fmt);
}

template <int D>
__device__ __forceinline__ float dot(const float* a, const float* b) {
    float s = 0.0f;
#pragma unroll
    for (int d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

// A head's view of q|k|v (B, T, 3C) and of a (B, T, C) tensor: its rows 3C (C) apart.
struct Head {
    i64 qkv;  // offset of the head's q in token 0 of its sequence; k at + c, v at + 2c
    i64 rows;  // offset of the head's columns in token 0 of its sequence, (B, T, C)
    i64 row3;
    u32 c;
};

template <int D>
__device__ __forceinline__ Head head_of(AttentionArg a) {
    u32 bh = blockIdx.x, b = bh / a.h, c = a.h * (u32)D;
    Head hd;
    hd.row3 = 3 * (i64)c;
    hd.c = c;
    hd.qkv = (i64)b * a.t * hd.row3 + (i64)(bh % a.h) * D;
    hd.rows = (i64)b * a.t * c + (i64)(bh % a.h) * D;
    return hd;
}

// dst[r][d] = the d-th value of rows r0 + r (`stride` elements apart from element `base` of
// `src`, stored in format `stored`), rounded to `fmt`; rows at or past `end` are zero.
template <int D>
__device__ void load_tile(float (*dst)[D], const void* src, i64 base, i64 stride, u32 r0, u32 end,
                          u32 fmt, u32 stored) {
    for (u32 e = threadIdx.x; e < ATT_TILE * (u32)D; e += blockDim.x) {
        u32 r = e / (u32)D, d = e % (u32)D;
        dst[r][d] = r0 + r < end ? held(load_stored(src, base + (i64)(r0 + r) * stride + d, stored), fmt)
                                 : 0.0f;
    }
}

// The score of a query and a key as the unfused plan holds it, scaled as its softmax reads it
// (times the scale, held in the compute format): the z of every pass (the row's max and sum,
// and each recomputed P).
template <int D>
__device__ __forceinline__ float score(const float* q, const float* k, AttentionArg a) {
    return held(held(dot<D>(q, k), a.compute) * a.scale, a.compute);
}

// The gradient of a score from its probability and dP, as the unfused softmax backward holds
// it (held, times the scale, held), rounded to the matmul inputs' format.
__device__ __forceinline__ float score_grad(float p, float dp, float pdp, AttentionArg a) {
    return held(held(held(p * (dp - pdp), a.compute) * a.scale, a.compute), a.inputs);
}

// The stored probability of a score: the unfused softmax's exp(z - max) / sum, held in `probs`.
template <int D>
__device__ __forceinline__ float prob(const float* q, const float* k, float m, float l, AttentionArg a) {
    return held(expf(score<D>(q, k, a) - m) / l, a.probs);
}

template <int D>
__device__ void attention_fwd(const void* qkv, void* out, float* stats, AttentionArg a) {
    __shared__ float ks[ATT_TILE][D];
    __shared__ float vs[ATT_TILE][D];
    Head hd = head_of<D>(a);
    u32 first = blockIdx.y * blockDim.x, i = first + threadIdx.x;
    bool live = i < a.t;
    u32 end = min(a.t, first + blockDim.x);  // keys [0, end) reach the block's rows
    float q[D];
#pragma unroll
    for (int d = 0; d < D; d++) q[d] = live ? load_each(qkv, hd.qkv + i * hd.row3 + d, a.qkv_stored, a.inputs) : 0.0f;
    // Pass 1: the row's max and sum of exp(z - max), rescaled as the max grows.
    float m = ATT_NEG_INF, l = 0.0f;
    for (u32 j0 = 0; j0 < end; j0 += ATT_TILE) {
        load_tile<D>(ks, qkv, hd.qkv + hd.c, hd.row3, j0, end, a.inputs, a.qkv_stored);
        __syncthreads();
        if (live)
            for (u32 jj = 0; jj < ATT_TILE && j0 + jj <= i; jj++) {
                float z = score<D>(q, ks[jj], a);
                if (z > m) {
                    l = l * expf(m - z) + 1.0f;
                    m = z;
                } else {
                    l += expf(z - m);
                }
            }
        __syncthreads();
    }
    // The unfused sum is exp(inf - inf) = NaN for a row holding +inf: every P of it NaN.
    if (m == ATT_POS_INF) l = ATT_NAN;
    // Pass 2: out = P . v.
    float acc[D];
#pragma unroll
    for (int d = 0; d < D; d++) acc[d] = 0.0f;
    for (u32 j0 = 0; j0 < end; j0 += ATT_TILE) {
        load_tile<D>(ks, qkv, hd.qkv + hd.c, hd.row3, j0, end, a.inputs, a.qkv_stored);
        load_tile<D>(vs, qkv, hd.qkv + 2 * hd.c, hd.row3, j0, end, a.inputs, a.qkv_stored);
        __syncthreads();
        if (live)
            for (u32 jj = 0; jj < ATT_TILE && j0 + jj <= i; jj++) {
                float p = held(prob<D>(q, ks[jj], m, l, a), a.inputs);
#pragma unroll
                for (int d = 0; d < D; d++) acc[d] += p * vs[jj][d];
            }
        __syncthreads();
    }
    if (!live) return;
#pragma unroll
    for (int d = 0; d < D; d++) store_each(out, hd.rows + (i64)i * hd.c + d, acc[d], a.compute, a.coded);
    i64 row = (i64)blockIdx.x * a.t + i;
    stats[2 * row] = m;
    stats[2 * row + 1] = l;
}

// dq (the first third of dqkv) and each row's sum(P * dP) into `delta`.
template <int D>
__device__ void attention_bwd_q(const void* qkv, const float* dout, const float* stats,
                                float* delta, float* dqkv, AttentionArg a) {
    __shared__ float ks[ATT_TILE][D];
    __shared__ float vs[ATT_TILE][D];
    Head hd = head_of<D>(a);
    u32 first = blockIdx.y * blockDim.x, i = first + threadIdx.x;
    bool live = i < a.t;
    u32 end = min(a.t, first + blockDim.x);
    i64 row = (i64)blockIdx.x * a.t + i;
    float q[D], g[D], dq[D];
#pragma unroll
    for (int d = 0; d < D; d++) {
        q[d] = live ? load_each(qkv, hd.qkv + i * hd.row3 + d, a.qkv_stored, a.inputs) : 0.0f;
        g[d] = live ? held_each(dout[hd.rows + (i64)i * hd.c + d], a.inputs) : 0.0f;
        dq[d] = 0.0f;
    }
    float m = live ? stats[2 * row] : 0.0f, l = live ? stats[2 * row + 1] : 1.0f;
    float pdp = 0.0f;
    for (int pass = 0; pass < 2; pass++) {
        for (u32 j0 = 0; j0 < end; j0 += ATT_TILE) {
            load_tile<D>(ks, qkv, hd.qkv + hd.c, hd.row3, j0, end, a.inputs, a.qkv_stored);
            load_tile<D>(vs, qkv, hd.qkv + 2 * hd.c, hd.row3, j0, end, a.inputs, a.qkv_stored);
            __syncthreads();
            if (live)
                for (u32 jj = 0; jj < ATT_TILE && j0 + jj <= i; jj++) {
                    float p = prob<D>(q, ks[jj], m, l, a);
                    float dp = held(dot<D>(g, vs[jj]), a.compute);
                    if (pass == 0) {
                        pdp += p * dp;
                    } else {
                        float ds = score_grad(p, dp, pdp, a);
#pragma unroll
                        for (int d = 0; d < D; d++) dq[d] += ds * ks[jj][d];
                    }
                }
            __syncthreads();
        }
    }
    if (!live) return;
#pragma unroll
    for (int d = 0; d < D; d++) dqkv[hd.qkv + i * hd.row3 + d] = held_each(dq[d], a.compute);
    delta[row] = pdp;
}

// The key-side passes: for each key row j, the query rows i >= j streamed through shared tiles
// (q, the output's gradient, and the rows' statistics). KEYS: dk (needs v and delta);
// else dv.
template <int D, bool KEYS>
__device__ void attention_bwd_kv(const void* qkv, const float* dout, const float* stats,
                                 const float* delta, float* dqkv, AttentionArg a) {
    __shared__ float qs[ATT_TILE][D];
    __shared__ float gs[ATT_TILE][D];
    __shared__ float ms[ATT_TILE], ls[ATT_TILE], deltas[ATT_TILE];
    Head hd = head_of<D>(a);
    u32 first = blockIdx.y * blockDim.x, j = first + threadIdx.x;
    bool live = j < a.t;
    float k[D], v[D], acc[D];
#pragma unroll
    for (int d = 0; d < D; d++) {
        k[d] = live ? load_each(qkv, hd.qkv + hd.c + j * hd.row3 + d, a.qkv_stored, a.inputs) : 0.0f;
        v[d] = live && KEYS ? load_each(qkv, hd.qkv + 2 * hd.c + j * hd.row3 + d, a.qkv_stored, a.inputs) : 0.0f;
        acc[d] = 0.0f;
    }
    i64 rows = (i64)blockIdx.x * a.t;
    for (u32 i0 = first; i0 < a.t; i0 += ATT_TILE) {
        load_tile<D>(qs, qkv, hd.qkv, hd.row3, i0, a.t, a.inputs, a.qkv_stored);
        load_tile<D>(gs, dout, hd.rows, hd.c, i0, a.t, a.inputs, FMT_F32);
        for (u32 r = threadIdx.x; r < ATT_TILE; r += blockDim.x) {
            bool in = i0 + r < a.t;
            ms[r] = in ? stats[2 * (rows + i0 + r)] : 0.0f;
            ls[r] = in ? stats[2 * (rows + i0 + r) + 1] : 1.0f;
            deltas[r] = in && KEYS ? delta[rows + i0 + r] : 0.0f;
        }
        __syncthreads();
        if (live)
            for (u32 ii = 0; ii < ATT_TILE && i0 + ii < a.t; ii++) {
                if (i0 + ii < j) continue;
                float p = prob<D>(qs[ii], k, ms[ii], ls[ii], a);
                if (KEYS) {
                    float dp = held(dot<D>(gs[ii], v), a.compute);
                    float ds = score_grad(p, dp, deltas[ii], a);
#pragma unroll
                    for (int d = 0; d < D; d++) acc[d] += ds * qs[ii][d];
                } else {
                    float pin = held(p, a.inputs);
#pragma unroll
                    for (int d = 0; d < D; d++) acc[d] += pin * gs[ii][d];
                }
            }
        __syncthreads();
    }
    if (!live) return;
    i64 at = hd.qkv + (KEYS ? hd.c : 2 * hd.c) + j * hd.row3;
#pragma unroll
    for (int d = 0; d < D; d++) dqkv[at + d] = held_each(acc[d], a.compute);
}

#define ATTENTION_KERNELS(D)                                                                      \
    extern "C" __global__ void attention_fwd_##D(const void* qkv, void* out, float* stats,       \
                                                 AttentionArg a) {                                \
        attention_fwd<D>(qkv, out, stats, a);                                                     \
    }                                                                                             \
    extern "C" __global__ void attention_bwd_q_##D(const void* qkv, const float* dout,           \
                                                   const float* stats, float* delta, float* dqkv, \
                                                   AttentionArg a) {                              \
        attention_bwd_q<D>(qkv, dout, stats, delta, dqkv, a);                                     \
    }                                                                                             \
    extern "C" __global__ void attention_bwd_k_##D(const void* qkv, const float* dout,           \
                                                   const float* stats, const float* delta,        \
                                                   float* dqkv, AttentionArg a) {                 \
        attention_bwd_kv<D, true>(qkv, dout, stats, delta, dqkv, a);                              \
    }                                                                                             \
    extern "C" __global__ void attention_bwd_v_##D(const void* qkv, const float* dout,           \
                                                   const float* stats, float* dqkv,               \
                                                   AttentionArg a) {                              \
        attention_bwd_kv<D, false>(qkv, dout, stats, nullptr, dqkv, a);                           \
    }

ATTENTION_KERNELS(16)
ATTENTION_KERNELS(32)
ATTENTION_KERNELS(64)

// ---- Tensor cores: the 16-bit algorithms ----
//
// The flash-attention-2 design (Dao 2023; Dao-AILab/flash-attention's flash_fwd_kernel.h and
// flash_bwd_kernel.h) on mma.sync m16n8k16 with f32 accumulators, q, k, v, the output's
// gradient, P and dS as bf16 or f16 codes (the algorithm's inputs), with this module's numerics
// (above), which take two passes where flash-attention 2 takes one:
// - forward (`attention_mma_fwd`): a block per (sequence x head, TC_ROWS query rows), 8 warps of
//   16 rows; q's fragments stay in registers; K and V tiles of TC_KEYS keys go through shared
//   memory (cp.async, the next tile loading while the warps compute). Pass 1 computes S = q.k^T
//   and each row's max and sum (online over the key blocks, in f32); pass 2 computes S again, P
//   from the final (max, sum), O += P.V. Key blocks above the diagonal are skipped, the
//   diagonal ones masked per element.
// - backward, three kernels: `attention_mma_delta`, the forward's geometry, computes S and
//   dP = dO.V^T over each row's keys and each row's sum(P * dP) (delta), and leaves dO as
//   codes of the inputs' format for the next kernel to copy by cp.async; `attention_mma_kv`, a
//   block per (sequence x head, split) with 4 warps of 16 keys, takes key blocks split,
//   split + splits, ... and for each loops over the query blocks (TC_KV_ROWS rows) at and below
//   its diagonal: S^T = K.q^T and dP^T = V.dO^T (keys in rows, so that P^T and dS^T are in
//   registers as the next products' A operands), dV += P^T.dO, dK += dS^T.q in registers, and
//   dS through shared memory for dQ = dS.K, which goes into the split's f32 partial of those
//   rows (stored by the split's first key block, added to by its later ones: one block writes
//   each partial, in key-block order); `attention_mma_dq` adds a row's partials in split order
//   and holds the sum in the compute format. No atomics: a step rerun gives the same bits.
// FLOPs: 3 products of (T x T/2 x D) in the forward and 7 in the backward against
// flash-attention 2's 2 and 5 (its softmax is online and its delta is rowsum(dO * O)).
//
// Tiles in shared memory are rows of 16-bit codes whose 16-byte chunks are swizzled (`swz`), so
// that ldmatrix reads them without bank conflicts. The 16-bit roundings are conversion
// instructions (mma.cuh's code16 and value16: formats.cuh's held for bf16 and f16).

#define TC_KEYS 64u
#define TC_ROWS 128u
#define TC_KV_ROWS 64u

// Offset of element (r, 8 chunk) of a tile of W-wide rows of 16-bit codes in shared memory. A
// row's 16-byte chunks are permuted (XOR with a function of the row) so that the 8 rows of an
// 8x8 matrix that ldmatrix reads at one chunk lie in 8 different 16-byte bank groups.
template <int W>
__device__ __forceinline__ u32 swz(u32 r, u32 chunk) {
    static_assert(W == 16 || W == 32 || W == 64, "tiles of 16, 32 or 64 values a row");
    const u32 chunks = W / 8, rows_per_line = 8 / chunks;
    return r * W + (chunk ^ ((r / rows_per_line) % chunks)) * 8;
}

// The 8 values at element e (a multiple of 8) of an input stored as `stored` (f32, or bf16 or
// f16 codes): two 16-byte loads of f32 values, or one of codes.
__device__ __forceinline__ void load8(float* v, const void* src, i64 e, u32 stored) {
    if (stored == FMT_F32) {
        float4 x = ((const float4*)src)[e / 4], y = ((const float4*)src)[e / 4 + 1];
        v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
        v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
    } else {
        uint4 c = ((const uint4*)src)[e / 8];
        u32 w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
        for (int p = 0; p < 4; p++) {
            v[2 * p] = value16(w[p] & 0xffffu, stored);
            v[2 * p + 1] = value16(w[p] >> 16, stored);
        }
    }
}

// x held in f32, bf16 or f16 (`fmt`): formats.cuh's held for those three (tests/cuda.rs checks
// it bit for bit), without a branch, so that the unrolled loops that round every score stay
// straight-line code: round to nearest even on the bits (bf16 drops 16 of them, f16 13, f32
// none), f16's subnormals as a multiple of 2^-24 (by adding and taking away 0.75, whose ulp
// that is), f16's overflow to inf, NaN as it is.
__device__ __forceinline__ float held16(float x, u32 fmt) {
    const bool f16 = fmt == FMT_F16;
    const u32 k = fmt == FMT_BF16 ? 16u : f16 ? 13u : 0u, low = (1u << k) - 1u;
    const u32 b = __float_as_uint(x), mag = b & 0x7fffffffu;
    u32 r = (b + ((((low + 1u) >> 1) - 1u + ((b >> k) & 1u)) & low)) & ~low;
    if (f16 && (r & 0x7fffffffu) > 0x477fe000u) r = (b & 0x80000000u) | 0x7f800000u;  // > 65504
    float y = __uint_as_float(r);
    float tiny = (fabsf(x) + 0.75f) - 0.75f;
    y = f16 && mag < 0x38800000u ? copysignf(tiny, x) : y;  // below 2^-14
    return mag > 0x7f800000u ? x : y;
}

// Two values held in bf16 or f16 already, as a register of their codes (the lower in the low
// half).
__device__ __forceinline__ u32 pack16(float lo, float hi, u32 fmt) {
    return code_of_held(lo, fmt) | code_of_held(hi, fmt) << 16;
}

// Rows r0, r0 + 1, ... (`rows` of them) of a matrix whose row i holds W values from element
// base + i * stride of `src` (stored as `stored`), into a tile as codes of `fmt` (bf16 or f16);
// rows at or past `end` zero. Codes of `fmt` are copied by cp.async (the caller commits the
// group and waits for it); other values are rounded to `fmt` on the way.
template <int W>
__device__ void tile_load(u16* tile, u32 rows, const void* src, i64 base, i64 stride, u32 r0,
                          u32 end, u32 stored, u32 fmt) {
    const u32 chunks = W / 8;
    for (u32 c = threadIdx.x; c < rows * chunks; c += blockDim.x) {
        u32 r = c / chunks, k = c % chunks;
        bool in = r0 + r < end;
        i64 e = base + (i64)(in ? r0 + r : 0) * stride + 8 * k;
        u16* dst = tile + swz<W>(r, k);
        if (stored == fmt) {
            cp_async16(dst, (const u16*)src + e, in);
        } else {
            u32 w[4] = {0u, 0u, 0u, 0u};
            if (in) {
                float v[8];
                load8(v, src, e, stored);
#pragma unroll
                for (int p = 0; p < 4; p++) w[p] = code16(v[2 * p], fmt) | code16(v[2 * p + 1], fmt) << 16;
            }
            *(uint4*)dst = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

// The row address lane `lane` gives ldmatrix for the 16x16 block at (row, col) of a W-wide
// tile. rows_a: matrices (+0, +0), (+8, +0), (+0, +8), (+8, +8), the A operand's registers in
// order, and with .trans the B operand of a tile stored k-major (rows k, columns n): b0, b1 of
// columns col.., then of col + 8... rows_b: matrices (+0, +0), (+0, +8), (+8, +0), (+8, +8), the
// B operand of a tile stored n-major (rows n, columns k, no .trans): b0, b1 of rows row.., then
// of row + 8...
template <int W>
__device__ __forceinline__ const u16* rows_a(const u16* tile, u32 row, u32 col, u32 lane) {
    u32 m = lane / 8;
    return tile + swz<W>(row + (m % 2) * 8 + lane % 8, col / 8 + m / 2);
}

template <int W>
__device__ __forceinline__ const u16* rows_b(const u16* tile, u32 row, u32 col, u32 lane) {
    u32 m = lane / 8;
    return tile + swz<W>(row + (m / 2) * 8 + lane % 8, col / 8 + m % 2);
}

// A-operand fragments of the warp's 16 rows from `row` of a K-wide tile, k = 16 kk...
template <int K>
__device__ __forceinline__ void load_a(u32 (*a)[4], const u16* tile, u32 row, u32 lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) ldsm_x4(a[kk], rows_a<K>(tile, row, 16 * kk, lane));
}

// c (16 x 8 N8) += A (16 x K) . B with B[k][n] = tile[n0 + n][k] (a K-wide tile stored
// n-major): S = q.k^T, dP = dO.V^T and their transposes.
template <int K, int N8>
__device__ __forceinline__ void mma_nt(float (*c)[4], const u32 (*a)[4], const u16* tile,
                                       u32 lane, bool f16) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++)
#pragma unroll
        for (int np = 0; np < N8 / 2; np++) {
            u32 b[4];
            ldsm_x4(b, rows_b<K>(tile, 16 * np, 16 * kk, lane));
            mma16(c[2 * np], a[kk], b[0], b[1], f16);
            mma16(c[2 * np + 1], a[kk], b[2], b[3], f16);
        }
}

// c (16 x 8 N8) += A (16 x K) . B with B[k][n] = tile[k][n] (an 8 N8-wide tile stored k-major):
// O += P.V, dV += P^T.dO, dK += dS^T.q, dQ = dS.K.
template <int K, int N8>
__device__ __forceinline__ void mma_nn(float (*c)[4], const u32 (*a)[4], const u16* tile,
                                       u32 lane, bool f16) {
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++)
#pragma unroll
        for (int np = 0; np < N8 / 2; np++) {
            u32 b[4];
            ldsm_x4_t(b, rows_a<8 * N8>(tile, 16 * kk, 16 * np, lane));
            mma16(c[2 * np], a[kk], b[0], b[1], f16);
            mma16(c[2 * np + 1], a[kk], b[2], b[3], f16);
        }
}

// A-operand fragments (k = 16 kk..) of 16 x (8 N8) accumulators, as codes of `fmt` (the values
// are held in it already, so this is exact).
template <int N8>
__device__ __forceinline__ void to_a(u32 (*a)[4], const float (*c)[4], u32 fmt) {
#pragma unroll
    for (int kk = 0; kk < N8 / 2; kk++) {
        a[kk][0] = pack16(c[2 * kk][0], c[2 * kk][1], fmt);
        a[kk][1] = pack16(c[2 * kk][2], c[2 * kk][3], fmt);
        a[kk][2] = pack16(c[2 * kk + 1][0], c[2 * kk + 1][1], fmt);
        a[kk][3] = pack16(c[2 * kk + 1][2], c[2 * kk + 1][3], fmt);
    }
}

// z of a score whose f32 sum is s (`score`: held, times the scale, held), and the stored
// probability of z in a row with (max m, 1 / sum): `prob`.
__device__ __forceinline__ float tc_z(float s, AttentionArg a) {
    return held16(held16(s, a.compute) * a.scale, a.compute);
}

__device__ __forceinline__ float tc_prob(float z, float m, float inv_l, AttentionArg a) {
    return held16(__expf(z - m) * inv_l, a.probs);
}

// Accumulator element e of n-tile nt lies in row (lane / 4 + 8 (e / 2)) and column
// (8 nt + 2 (lane % 4) + e % 2) of the warp's 16 x (8 N8) block.
__device__ __forceinline__ u32 acc_col(u32 nt, u32 e, u32 lane) { return 8 * nt + 2 * (lane % 4) + e % 2; }

template <int D>
__device__ void attention_mma_fwd(const void* qkv, void* out, float* stats, AttentionArg a) {
    __shared__ __align__(16) u16 qs[TC_ROWS * D];
    __shared__ __align__(16) u16 kv[2][TC_KEYS * D];
    Head hd = head_of<D>(a);
    const bool f16 = a.inputs == FMT_F16;
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 q0 = blockIdx.y * TC_ROWS, end = min(a.t, q0 + TC_ROWS);
    const u32 blocks = (end + TC_KEYS - 1) / TC_KEYS;  // keys [0, end) reach the block's rows
    const u32 row[2] = {q0 + warp * 16 + lane / 4, q0 + warp * 16 + lane / 4 + 8};
    // Key block b's k (which = c) or v (2c) into kv[buf], as one group of copies.
    auto keys = [&](u32 buf, u32 b, u32 which) {
        tile_load<D>(kv[buf], TC_KEYS, qkv, hd.qkv + which, hd.row3, b * TC_KEYS, end,
                     a.qkv_stored, a.inputs);
        cp_async_commit();
    };
    tile_load<D>(qs, TC_ROWS, qkv, hd.qkv, hd.row3, q0, a.t, a.qkv_stored, a.inputs);
    cp_async_commit();
    keys(0, 0, hd.c);
    cp_async_wait<1>();
    __syncthreads();
    u32 qf[D / 16][4];
    load_a<D>(qf, qs, warp * 16, lane);
    // Pass 1: each row's max and sum of exp(z - max), online over the key blocks. A row's max
    // starts at -inf; exponents are taken against 0 while it is -inf, so that a -inf score
    // adds 0 (the final (max, sum) is the unfused softmax's whatever the order).
    float m[2] = {ATT_NEG_INF, ATT_NEG_INF}, l[2] = {0.0f, 0.0f};
    for (u32 b = 0; b < blocks; b++) {
        if (b + 1 < blocks) {
            keys((b + 1) % 2, b + 1, hd.c);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        float s[TC_KEYS / 8][4] = {};
        mma_nt<D, TC_KEYS / 8>(s, qf, kv[b % 2], lane, f16);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float z[TC_KEYS / 4], top = ATT_NEG_INF;
#pragma unroll
            for (u32 nt = 0; nt < TC_KEYS / 8; nt++)
#pragma unroll
                for (u32 h = 0; h < 2; h++) {
                    u32 j = b * TC_KEYS + acc_col(nt, h, lane);
                    float zj = j <= row[r] && row[r] < a.t ? tc_z(s[nt][2 * r + h], a) : ATT_NEG_INF;
                    z[2 * nt + h] = zj;
                    top = fmaxf(top, zj);
                }
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
            float next = fmaxf(m[r], top), base = next == ATT_NEG_INF ? 0.0f : next;
            float sum = 0.0f;
#pragma unroll
            for (u32 k = 0; k < TC_KEYS / 4; k++) sum += __expf(z[k] - base);
            l[r] = l[r] * (m[r] == ATT_NEG_INF ? 0.0f : __expf(m[r] - next)) + sum;
            m[r] = next;
        }
        __syncthreads();
    }
    float inv_l[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        // The unfused sum is exp(inf - inf) = NaN for a row whose max is infinite.
        if (m[r] == ATT_POS_INF || m[r] == ATT_NEG_INF) l[r] = ATT_NAN;
        inv_l[r] = 1.0f / l[r];
    }
    // Pass 2: O = P.V, with k of the block in kv[0] and its v in kv[1].
    float o[D / 8][4] = {};
    keys(0, 0, hd.c);
    for (u32 b = 0; b < blocks; b++) {
        cp_async_wait<0>();
        __syncthreads();  // k of block b is in; every warp is done with kv[1]
        keys(1, b, 2 * hd.c);
        float s[TC_KEYS / 8][4] = {};
        mma_nt<D, TC_KEYS / 8>(s, qf, kv[0], lane, f16);
#pragma unroll
        for (u32 nt = 0; nt < TC_KEYS / 8; nt++)
#pragma unroll
            for (u32 e = 0; e < 4; e++) {
                u32 j = b * TC_KEYS + acc_col(nt, e, lane), i = row[e / 2];
                float p = tc_prob(tc_z(s[nt][e], a), m[e / 2], inv_l[e / 2], a);
                s[nt][e] = j <= i && i < a.t ? held16(p, a.inputs) : 0.0f;
            }
        u32 pf[TC_KEYS / 16][4];
        to_a<TC_KEYS / 8>(pf, s, a.inputs);
        cp_async_wait<0>();
        __syncthreads();  // v of block b is in; every warp is done with kv[0]
        if (b + 1 < blocks) keys(0, b + 1, hd.c);
        mma_nn<TC_KEYS, D / 8>(o, pf, kv[1], lane, f16);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (row[r] >= a.t) continue;
        i64 at = hd.rows + (i64)row[r] * hd.c;
#pragma unroll
        for (u32 nt = 0; nt < D / 8; nt++) {
            i64 e = at + acc_col(nt, 0, lane);
            float x0 = held16(o[nt][2 * r], a.compute), x1 = held16(o[nt][2 * r + 1], a.compute);
            if (a.coded) {
                *(u32*)((u16*)out + e) = pack16(x0, x1, a.compute);
            } else {
                *(float2*)((float*)out + e) = make_float2(x0, x1);
            }
        }
        if (lane % 4 == 0) {
            i64 at_row = (i64)blockIdx.x * a.t + row[r];
            stats[2 * at_row] = m[r];
            stats[2 * at_row + 1] = l[r];
        }
    }
}

// Each row's sum(P * dP) into `delta`: the forward's geometry, S = q.k^T and dP = dO.V^T over
// the row's keys, P from the forward's (max, sum). Also dO as codes of the inputs' format into
// `gcodes`, (B H T) x D, for the dk/dv kernel, which reads each of its rows many times.
template <int D>
__device__ void attention_mma_delta(const void* qkv, const float* dout, const float* stats,
                                    float* delta, u16* gcodes, AttentionArg a) {
    __shared__ __align__(16) u16 xs[TC_ROWS * D];
    __shared__ __align__(16) u16 kv[2][TC_KEYS * D];
    Head hd = head_of<D>(a);
    const bool f16 = a.inputs == FMT_F16;
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 q0 = blockIdx.y * TC_ROWS, end = min(a.t, q0 + TC_ROWS);
    const u32 blocks = (end + TC_KEYS - 1) / TC_KEYS;
    const u32 row[2] = {q0 + warp * 16 + lane / 4, q0 + warp * 16 + lane / 4 + 8};
    auto keys = [&](u32 buf, u32 b, u32 which) {
        tile_load<D>(kv[buf], TC_KEYS, qkv, hd.qkv + which, hd.row3, b * TC_KEYS, end,
                     a.qkv_stored, a.inputs);
        cp_async_commit();
    };
    // q's fragments, then dO's through the same tile, while k of block 0 loads.
    tile_load<D>(xs, TC_ROWS, qkv, hd.qkv, hd.row3, q0, a.t, a.qkv_stored, a.inputs);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    u32 qf[D / 16][4], gf[D / 16][4];
    load_a<D>(qf, xs, warp * 16, lane);
    __syncthreads();
    keys(0, 0, hd.c);
    tile_load<D>(xs, TC_ROWS, dout, hd.rows, hd.c, q0, a.t, FMT_F32, a.inputs);
    __syncthreads();
    for (u32 c = threadIdx.x; c < TC_ROWS * (D / 8); c += blockDim.x) {
        u32 r = c / (D / 8), k = c % (D / 8);
        i64 at = ((i64)blockIdx.x * a.t + q0 + r) * D + 8 * k;
        if (q0 + r < a.t) *(uint4*)(gcodes + at) = *(const uint4*)(xs + swz<D>(r, k));
    }
    load_a<D>(gf, xs, warp * 16, lane);
    float m[2], inv_l[2], pdp[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; r++) {
        i64 at = (i64)blockIdx.x * a.t + row[r];
        m[r] = row[r] < a.t ? stats[2 * at] : 0.0f;
        inv_l[r] = row[r] < a.t ? 1.0f / stats[2 * at + 1] : 1.0f;
    }
    for (u32 b = 0; b < blocks; b++) {
        cp_async_wait<0>();
        __syncthreads();  // k of block b is in kv[0]; every warp is done with kv[1]
        keys(1, b, 2 * hd.c);
        float s[TC_KEYS / 8][4] = {}, dp[TC_KEYS / 8][4] = {};
        mma_nt<D, TC_KEYS / 8>(s, qf, kv[0], lane, f16);
        cp_async_wait<0>();
        __syncthreads();  // v of block b is in kv[1]; every warp is done with kv[0]
        if (b + 1 < blocks) keys(0, b + 1, hd.c);
        mma_nt<D, TC_KEYS / 8>(dp, gf, kv[1], lane, f16);
#pragma unroll
        for (u32 nt = 0; nt < TC_KEYS / 8; nt++)
#pragma unroll
            for (u32 e = 0; e < 4; e++) {
                u32 j = b * TC_KEYS + acc_col(nt, e, lane), r = e / 2;
                if (j <= row[r] && row[r] < a.t)
                    pdp[r] += tc_prob(tc_z(s[nt][e], a), m[r], inv_l[r], a) * held16(dp[nt][e], a.compute);
            }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        pdp[r] += __shfl_xor_sync(0xffffffffu, pdp[r], 1);
        pdp[r] += __shfl_xor_sync(0xffffffffu, pdp[r], 2);
        if (lane % 4 == 0 && row[r] < a.t) delta[(i64)blockIdx.x * a.t + row[r]] = pdp[r];
    }
}

// dK and dV of the key blocks split, split + splits, ... (split = blockIdx.y, splits =
// gridDim.y) into dqkv, and their dQ into the split's partial: `part` holds splits x (B H T) x D
// f32 values, of which this block writes the rows at and below its first key block. dO comes
// as the delta kernel's codes (`gcodes`).
template <int D>
__device__ void attention_mma_kv(const void* qkv, const u16* gcodes, const float* stats,
                                 const float* delta, float* dqkv, float* part, AttentionArg a) {
    static_assert(TC_KV_ROWS == TC_KEYS, "a key block's diagonal starts a query block");
    __shared__ __align__(16) u16 ks[TC_KEYS * D];
    __shared__ __align__(16) u16 vs[TC_KEYS * D];
    __shared__ __align__(16) u16 qs[TC_KV_ROWS * D];
    __shared__ __align__(16) u16 gs[TC_KV_ROWS * D];
    __shared__ __align__(16) u16 ds[TC_KV_ROWS * TC_KEYS];
    // The query rows' max, 1 / sum and sum(P * dP).
    __shared__ float rm[TC_KV_ROWS], rl[TC_KV_ROWS], rd[TC_KV_ROWS];
    Head hd = head_of<D>(a);
    const bool f16 = a.inputs == FMT_F16;
    const u32 warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u32 blocks = (a.t + TC_KEYS - 1) / TC_KEYS, split = blockIdx.y;
    const i64 rows = (i64)blockIdx.x * a.t;  // the head's first score row
    float* partial = part + ((i64)split * gridDim.x * a.t + rows) * D;
    // Query block qb's q, dO (one group of copies) and statistics.
    auto queries = [&](u32 qb) {
        u32 i0 = qb * TC_KV_ROWS;
        tile_load<D>(qs, TC_KV_ROWS, qkv, hd.qkv, hd.row3, i0, a.t, a.qkv_stored, a.inputs);
        tile_load<D>(gs, TC_KV_ROWS, gcodes, rows * D, D, i0, a.t, a.inputs, a.inputs);
        cp_async_commit();
        for (u32 r = threadIdx.x; r < TC_KV_ROWS; r += blockDim.x) {
            bool in = i0 + r < a.t;
            rm[r] = in ? stats[2 * (rows + i0 + r)] : 0.0f;
            rl[r] = in ? 1.0f / stats[2 * (rows + i0 + r) + 1] : 1.0f;
            rd[r] = in ? delta[rows + i0 + r] : 0.0f;
        }
    };
    for (u32 kb = split; kb < blocks; kb += gridDim.y) {
        const u32 j0 = kb * TC_KEYS;
        const u32 key[2] = {j0 + warp * 16 + lane / 4, j0 + warp * 16 + lane / 4 + 8};
        tile_load<D>(ks, TC_KEYS, qkv, hd.qkv + hd.c, hd.row3, j0, a.t, a.qkv_stored, a.inputs);
        tile_load<D>(vs, TC_KEYS, qkv, hd.qkv + 2 * hd.c, hd.row3, j0, a.t, a.qkv_stored, a.inputs);
        queries(kb);
        float dk[D / 8][4] = {}, dv[D / 8][4] = {};
        u32 kf[D / 16][4], vf[D / 16][4];
        for (u32 qb = kb; qb < blocks; qb++) {
            const u32 i0 = qb * TC_KV_ROWS;
            cp_async_wait<0>();
            __syncthreads();  // the tiles are in; every warp is done with ds
            if (qb == kb) {
                load_a<D>(kf, ks, warp * 16, lane);
                load_a<D>(vf, vs, warp * 16, lane);
            }
            // S^T and dP^T: the warp's 16 keys in rows, the block's query rows in columns.
            float s[TC_KV_ROWS / 8][4] = {}, dp[TC_KV_ROWS / 8][4] = {};
            mma_nt<D, TC_KV_ROWS / 8>(s, kf, qs, lane, f16);
            mma_nt<D, TC_KV_ROWS / 8>(dp, vf, gs, lane, f16);
#pragma unroll
            for (u32 nt = 0; nt < TC_KV_ROWS / 8; nt++)
#pragma unroll
                for (u32 e = 0; e < 4; e++) {
                    u32 c = acc_col(nt, e, lane), i = i0 + c;
                    bool in = key[e / 2] <= i && i < a.t;
                    float p = in ? tc_prob(tc_z(s[nt][e], a), rm[c], rl[c], a) : 0.0f;
                    // `score_grad`: the softmax's gradient held, times the scale, held.
                    float g = held16(p * (held16(dp[nt][e], a.compute) - rd[c]), a.compute);
                    g = held16(g * a.scale, a.compute);
                    s[nt][e] = held16(p, a.inputs);
                    dp[nt][e] = in ? held16(g, a.inputs) : 0.0f;
                    // dS (rows i) for dQ.
                    u32 j = warp * 16 + lane / 4 + 8 * (e / 2);
                    ds[swz<TC_KEYS>(c, j / 8) + j % 8] = (u16)code_of_held(dp[nt][e], a.inputs);
                }
            u32 pa[TC_KV_ROWS / 16][4], da[TC_KV_ROWS / 16][4];
            to_a<TC_KV_ROWS / 8>(pa, s, a.inputs);
            to_a<TC_KV_ROWS / 8>(da, dp, a.inputs);
            mma_nn<TC_KV_ROWS, D / 8>(dv, pa, gs, lane, f16);
            mma_nn<TC_KV_ROWS, D / 8>(dk, da, qs, lane, f16);
            __syncthreads();  // ds is written; every warp is done with qs, gs and the statistics
            if (qb + 1 < blocks) queries(qb + 1);
            // dQ of the block's query rows (16 a warp) over this key block.
            u32 df[TC_KEYS / 16][4];
            load_a<TC_KEYS>(df, ds, warp * 16, lane);
            float dq[D / 8][4] = {};
            mma_nn<TC_KEYS, D / 8>(dq, df, ks, lane, f16);
#pragma unroll
            for (int r = 0; r < 2; r++) {
                u32 i = i0 + warp * 16 + lane / 4 + 8 * r;
                if (i >= a.t) continue;
#pragma unroll
                for (u32 nt = 0; nt < D / 8; nt++) {
                    float2* at = (float2*)(partial + (i64)i * D + acc_col(nt, 0, lane));
                    float2 add = make_float2(dq[nt][2 * r], dq[nt][2 * r + 1]);
                    if (kb != split) {
                        float2 had = *at;
                        add = make_float2(had.x + add.x, had.y + add.y);
                    }
                    *at = add;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (key[r] >= a.t) continue;
            i64 at = hd.qkv + hd.c + (i64)key[r] * hd.row3;
#pragma unroll
            for (u32 nt = 0; nt < D / 8; nt++) {
                i64 e = at + acc_col(nt, 0, lane);
                *(float2*)(dqkv + e) = make_float2(held16(dk[nt][2 * r], a.compute), held16(dk[nt][2 * r + 1], a.compute));
                *(float2*)(dqkv + e + hd.c) = make_float2(held16(dv[nt][2 * r], a.compute), held16(dv[nt][2 * r + 1], a.compute));
            }
        }
        __syncthreads();  // every warp is done with ks before the next key block loads
    }
}

// dq (the first third of dqkv): each row's partials added in split order (the splits at or
// below its query block), held in the compute format. `rows` = B H T.
template <int D>
__device__ void attention_mma_dq(const float* part, float* dqkv, u32 rows, u32 splits, AttentionArg a) {
    FOR_EACH(e, (i64)rows * (D / 4)) {
        i64 row = e / (D / 4);
        u32 c = 4 * (u32)(e % (D / 4)), i = (u32)(row % a.t), bh = (u32)(row / a.t);
        u32 last = min(splits, i / TC_KEYS + 1);
        float4 sum = *(const float4*)(part + row * D + c);
        for (u32 s = 1; s < last; s++) {
            float4 p = *(const float4*)(part + ((i64)s * rows + row) * D + c);
            sum.x += p.x, sum.y += p.y, sum.z += p.z, sum.w += p.w;
        }
        i64 at = ((i64)(bh / a.h) * a.t + i) * 3 * a.h * D + (bh % a.h) * D + c;
        float4 dq;
        dq.x = held16(sum.x, a.compute), dq.y = held16(sum.y, a.compute);
        dq.z = held16(sum.z, a.compute), dq.w = held16(sum.w, a.compute);
        *(float4*)(dqkv + at) = dq;
    }
}

#define ATTENTION_MMA_KERNELS(D)                                                                  \
    extern "C" __global__ void attention_mma_fwd_##D(const void* qkv, void* out, float* stats,   \
                                                     AttentionArg a) {                            \
        attention_mma_fwd<D>(qkv, out, stats, a);                                                 \
    }                                                                                             \
    extern "C" __global__ void attention_mma_delta_##D(const void* qkv, const float* dout,       \
                                                       const float* stats, float* delta,          \
                                                       u16* gcodes, AttentionArg a) {             \
        attention_mma_delta<D>(qkv, dout, stats, delta, gcodes, a);                               \
    }                                                                                             \
    extern "C" __global__ void attention_mma_kv_##D(const void* qkv, const u16* gcodes,          \
                                                    const float* stats, const float* delta,       \
                                                    float* dqkv, float* part, AttentionArg a) {   \
        attention_mma_kv<D>(qkv, gcodes, stats, delta, dqkv, part, a);                            \
    }                                                                                             \
    extern "C" __global__ void attention_mma_dq_##D(const float* part, float* dqkv, u32 rows,    \
                                                    u32 splits, AttentionArg a) {                 \
        attention_mma_dq<D>(part, dqkv, rows, splits, a);                                         \
    }

ATTENTION_MMA_KERNELS(16)
ATTENTION_MMA_KERNELS(32)
ATTENTION_MMA_KERNELS(64)
