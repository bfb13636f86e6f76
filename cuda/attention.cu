// attention.cu: fused causal self-attention (plan::Op::Attention and AttentionBwd), forward and
// backward, in the flash-attention scheme: the (T x T) scores and probabilities of a head never
// reach memory; the forward keeps each score row's (max, sum) and the backward recomputes P from
// them. Needs formats.cuh. Host reference: attention_fwd / attention_bwd in
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
// One thread per query row (forward, dq) or key row (dk, dv), ATT_ROWS to a block, the other
// side streamed through shared tiles of ATT_TILE rows that every thread reads at the same
// address (broadcasts). dq, dk and dv are three kernels, each writing its third of dqkv whole,
// so there are no atomics and a step rerun gives the same bits. Each kernel is compiled for
// head sizes 16, 32 and 64 (`_<D>` in its name): the row's vectors are registers (three of
// them in the backward, which at 128 would spill; other sizes keep the unfused ops).

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
