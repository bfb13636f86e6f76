// train.cu: the ops of the training step plan besides matmul, rounding and amax (which cast.cu
// and scale.cu serve). Needs formats.cuh. Host reference: src/backend/reference/ops.rs and
// the host interpreter in src/backend/reference/interp.rs; the WGSL twins are shaders/train.wgsl and step.wgsl.
//
// Row ops (layer norm, RMS norm, softmax, cross entropy) run one block per row and reduce with warp
// shuffles. Column reductions (bias and layer-norm parameter gradients) write one partial sum
// per chunk of rows and the last block of each column block to finish adds the chunks in order
// (one launch; an integer counter says which block is last); the embedding scatter-add is a
// counting sort of the ids then a sum over each id's own tokens. No float atomics anywhere: a
// step rerun gives the same bits, which is what makes a resumed run reproduce an
// uninterrupted one.

// Scalar slots the host writes before a step: S_<NAME>, generated from src/plan/scalar.rs
// into the header (src/backend/defs.rs).

// Rows per chunk of the column reductions (the launcher sizes the grid with the same value).
#define CHUNK_ROWS 256u

#define FULL_MASK 0xffffffffu
#define NEG_INF __uint_as_float(0xff800000u)

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// The sum of `v` over the block, in every thread (blockDim.x a multiple of 32). Every warp adds
// the warps' partials in the same order, so all threads get the same bits. Every thread of the
// block must call it.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    v = warp_sum(v);
    __syncthreads();  // the previous call's readers are done with `partial`
    if ((threadIdx.x & 31u) == 0u) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = (threadIdx.x & 31u) < (blockDim.x >> 5) ? partial[threadIdx.x & 31u] : 0.0f;
    return warp_sum(t);
}

__device__ float block_max(float v) {
    __shared__ float partial[32];
    v = warp_max(v);
    __syncthreads();
    if ((threadIdx.x & 31u) == 0u) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = (threadIdx.x & 31u) < (blockDim.x >> 5) ? partial[threadIdx.x & 31u] : NEG_INF;
    return warp_max(t);
}

__device__ __forceinline__ bool is_finite_bits(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// ---- embeddings ----

// out[r, i] = table[ids[r], i]; n = rows * c.
extern "C" __global__ void embedding_fwd(const float* table, const u32* ids, float* out, i64 n,
                                         u32 c) {
    FOR_EACH(e, n) out[e] = table[(i64)ids[e / c] * c + e % c];
}

// The scatter-add as a sorted segment sum, in two launches: `embedding_sort` groups the token
// indices by id (a stable counting sort), then `embedding_sum` sums each id's rows of dout in
// token order. The sum is the host definition's to the bit (backend::reference::ops::
// embedding_bwd): f64 in token order, rounded to f32 once. No atomics: each id's sum is one
// thread's, so the work is O(tokens * c) whatever the ids, and the bits are fixed.

// Threads of the sort's one block (the launcher sizes its scratch with the same value).
#define SORT_THREADS 256u

// One block of SORT_THREADS. Thread t owns the tokens [t * per, (t + 1) * per) and counts
// them by id into counts[id * SORT_THREADS + t]; an exclusive scan of counts in that (id,
// thread) order gives each (id, thread) its first place, so that scattering the tokens in
// order, each thread its own, keeps every id's tokens in token order. offsets[id] (rows + 1 of
// them) is where id's tokens start in `sorted` (tokens of them), then where the last ends.
// Scratch: counts (rows * SORT_THREADS), offsets, sorted.
extern "C" __global__ void embedding_sort(const u32* ids, u32* counts, u32* offsets, u32* sorted,
                                          u32 rows, u32 tokens) {
    __shared__ u32 partial[SORT_THREADS];
    u32 t = threadIdx.x;
    u32 per = (tokens + SORT_THREADS - 1) / SORT_THREADS;
    u32 from = min(t * per, tokens), to = min(from + per, tokens);
    for (u32 id = 0; id < rows; id++) counts[(i64)id * SORT_THREADS + t] = 0;
    // Ids are checked against the table before a step (an id beyond it is left out here, so
    // that nothing is written out of bounds).
    for (u32 r = from; r < to; r++) {
        if (ids[r] < rows) counts[(i64)ids[r] * SORT_THREADS + t] += 1;
    }
    __syncthreads();
    // Exclusive scan of counts: each thread a contiguous slice, the slices' sums scanned by
    // thread 0, then each slice rewritten from its start.
    i64 total = (i64)rows * SORT_THREADS;
    i64 slice = (total + SORT_THREADS - 1) / SORT_THREADS;
    i64 lo = min((i64)t * slice, total), hi = min(lo + slice, total);
    u32 sum = 0;
    for (i64 e = lo; e < hi; e++) sum += counts[e];
    partial[t] = sum;
    __syncthreads();
    if (t == 0) {
        u32 run = 0;
        for (u32 i = 0; i < SORT_THREADS; i++) {
            u32 v = partial[i];
            partial[i] = run;
            run += v;
        }
        offsets[rows] = run;
    }
    __syncthreads();
    u32 run = partial[t];
    for (i64 e = lo; e < hi; e++) {
        u32 v = counts[e];
        counts[e] = run;
        run += v;
    }
    __syncthreads();
    for (u32 id = t; id < rows; id += SORT_THREADS) offsets[id] = counts[(i64)id * SORT_THREADS];
    __syncthreads();  // the offsets read before the scatter moves the places on
    for (u32 r = from; r < to; r++) {
        if (ids[r] < rows) sorted[counts[(i64)ids[r] * SORT_THREADS + t]++] = r;
    }
}

// out[id, cols] = the sum over id's tokens (offsets, sorted: `embedding_sort`) of their rows of
// dout, in token order, in f64. Block (id, span): each thread `width` adjacent columns (4: one
// 16-byte load a token, c a multiple of 4 and dout 16-byte aligned; else 1).
extern "C" __global__ void embedding_sum(const float* dout, const u32* offsets, const u32* sorted,
                                         float* out, u32 c, u32 width) {
    u32 id = blockIdx.x;
    u32 col = (blockIdx.y * blockDim.x + threadIdx.x) * width;
    if (col >= c) return;
    u32 from = offsets[id], to = offsets[id + 1];
    if (width == 4) {
        double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
#pragma unroll 4
        for (u32 k = from; k < to; k++) {
            float4 v = *(const float4*)(dout + (i64)sorted[k] * c + col);
            s0 += (double)v.x;
            s1 += (double)v.y;
            s2 += (double)v.z;
            s3 += (double)v.w;
        }
        float* o = out + (i64)id * c + col;
        o[0] = (float)s0;
        o[1] = (float)s1;
        o[2] = (float)s2;
        o[3] = (float)s3;
    } else {
        double s = 0.0;
#pragma unroll 4
        for (u32 k = from; k < to; k++) s += (double)dout[(i64)sorted[k] * c + col];
        out[(i64)id * c + col] = (float)s;
    }
}

// ---- layer norm (eps 1e-5), one block per row of c ----

// y is held in format `fmt` (f32: as computed).
extern "C" __global__ void layernorm_fwd(const float* x, const float* g, const float* b,
                                         void* y, float* stats, u32 c, u32 fmt, u32 coded) {
    const float* xr = x + (i64)blockIdx.x * c;
    float s = 0.0f;
    for (u32 i = threadIdx.x; i < c; i += blockDim.x) s += xr[i];
    float mean = block_sum(s) / (float)c;
    float q = 0.0f;
    for (u32 i = threadIdx.x; i < c; i += blockDim.x) {
        float d = xr[i] - mean;
        q += d * d;
    }
    float rstd = 1.0f / sqrtf(block_sum(q) / (float)c + 1e-5f);
    i64 row = (i64)blockIdx.x * c;
    for (u32 i = threadIdx.x; i < c; i += blockDim.x)
        store_held(y, row + i, (xr[i] - mean) * rstd * g[i] + b[i], fmt, coded);
    if (threadIdx.x == 0u) {
        stats[2 * (i64)blockIdx.x] = mean;
        stats[2 * (i64)blockIdx.x + 1] = rstd;
    }
}

// dx of one row: dx = rstd * (d - mean(d) - xhat * mean(d * xhat)), d = dy * g; dy rounded to
// `dy_fmt` as it is read (the rounding of the matmul product it is, folded in: so are the
// other backward kernels' dy).
// With `sum` (not null), dx + sum held in `sum_fmt` is written instead (the gradient of x from
// its other reader summed in: an add's sum, the same operands).
extern "C" __global__ void layernorm_bwd_x(const float* dy, const float* x, const float* g,
                                           const float* stats, float* dx, u32 c, u32 dy_fmt,
                                           const float* sum, u32 sum_fmt) {
    i64 base = (i64)blockIdx.x * c;
    float mean = stats[2 * (i64)blockIdx.x], rstd = stats[2 * (i64)blockIdx.x + 1];
    float sd = 0.0f, sdx = 0.0f;
    for (u32 i = threadIdx.x; i < c; i += blockDim.x) {
        float xhat = (x[base + i] - mean) * rstd;
        float d = held(dy[base + i], dy_fmt) * g[i];
        sd += d;
        sdx += d * xhat;
    }
    sd = block_sum(sd) / (float)c;
    sdx = block_sum(sdx) / (float)c;
    for (u32 i = threadIdx.x; i < c; i += blockDim.x) {
        float xhat = (x[base + i] - mean) * rstd;
        float d = held(dy[base + i], dy_fmt) * g[i];
        float v = rstd * (d - sd - xhat * sdx);
        dx[base + i] = sum ? held(v + sum[base + i], sum_fmt) : v;
    }
}

// Each of v's values held in `fmt` (`held`).
__device__ __forceinline__ float4 held4(float4 v, u32 fmt) {
    return {held(v.x, fmt), held(v.y, fmt), held(v.z, fmt), held(v.w, fmt)};
}

// ---- RMS norm (torch.nn.RMSNorm), one block per row of c ----
// `width` 4: 16-byte accesses (c a multiple of 4, and x, g, dy, dx and an f32 y 16-byte
// aligned: the launcher decides); else one value at a time. Either way each thread adds its
// own values in order, so the bits are fixed for a given width.

// y = x * rstd * g held in `fmt` (codes where `coded`), rstd = 1 / sqrt(mean(x^2) + eps) into
// rstds[row].
extern "C" __global__ void rmsnorm_fwd(const float* x, const float* g, void* y, float* rstds,
                                       u32 c, float eps, u32 fmt, u32 coded, u32 width) {
    i64 base = (i64)blockIdx.x * c;
    const float* xr = x + base;
    float q = 0.0f;
    if (width == 4u) {
        for (u32 k = threadIdx.x; k < c / 4u; k += blockDim.x) {
            float4 v = ((const float4*)xr)[k];
            q += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (u32 i = threadIdx.x; i < c; i += blockDim.x) q += xr[i] * xr[i];
    }
    float rstd = 1.0f / sqrtf(block_sum(q) / (float)c + eps);
    if (width == 4u && !coded) {
        float4* yr = (float4*)((float*)y + base);
        for (u32 k = threadIdx.x; k < c / 4u; k += blockDim.x) {
            float4 v = ((const float4*)xr)[k], gk = ((const float4*)g)[k];
            float4 o = {held(v.x * rstd * gk.x, fmt), held(v.y * rstd * gk.y, fmt),
                        held(v.z * rstd * gk.z, fmt), held(v.w * rstd * gk.w, fmt)};
            yr[k] = o;
        }
    } else {
        for (u32 i = threadIdx.x; i < c; i += blockDim.x)
            store_held(y, base + i, xr[i] * rstd * g[i], fmt, coded);
    }
    if (threadIdx.x == 0u) rstds[blockIdx.x] = rstd;
}

// dx of one row: dx = rstd * (d - xhat * mean(d * xhat)), d = dy * g, xhat = x * rstd.
extern "C" __global__ void rmsnorm_bwd_x(const float* dy, const float* x, const float* g,
                                         const float* rstds, float* dx, u32 c, u32 width,
                                         u32 dy_fmt) {
    i64 base = (i64)blockIdx.x * c;
    float rstd = rstds[blockIdx.x];
    float s = 0.0f;
    if (width == 4u) {
        for (u32 k = threadIdx.x; k < c / 4u; k += blockDim.x) {
            float4 d = held4(((const float4*)(dy + base))[k], dy_fmt), v = ((const float4*)(x + base))[k];
            float4 gk = ((const float4*)g)[k];
            s += d.x * gk.x * (v.x * rstd) + d.y * gk.y * (v.y * rstd) +
                 d.z * gk.z * (v.z * rstd) + d.w * gk.w * (v.w * rstd);
        }
    } else {
        for (u32 i = threadIdx.x; i < c; i += blockDim.x)
            s += held(dy[base + i], dy_fmt) * g[i] * (x[base + i] * rstd);
    }
    float mean = block_sum(s) / (float)c;
    if (width == 4u) {
        for (u32 k = threadIdx.x; k < c / 4u; k += blockDim.x) {
            float4 d = held4(((const float4*)(dy + base))[k], dy_fmt), v = ((const float4*)(x + base))[k];
            float4 gk = ((const float4*)g)[k];
            float4 o = {rstd * (d.x * gk.x - v.x * rstd * mean), rstd * (d.y * gk.y - v.y * rstd * mean),
                        rstd * (d.z * gk.z - v.z * rstd * mean), rstd * (d.w * gk.w - v.w * rstd * mean)};
            ((float4*)(dx + base))[k] = o;
        }
    } else {
        for (u32 i = threadIdx.x; i < c; i += blockDim.x)
            dx[base + i] = rstd * (held(dy[base + i], dy_fmt) * g[i] - x[base + i] * rstd * mean);
    }
}

// ---- column reductions: blocks of 32 columns x 8 row lanes, one chunk of rows per blockIdx.y

// Sums this thread's rows of the chunk for column `col`, then the 8 row lanes in order; the
// result is in threadIdx.y == 0. `value(r)` gives the element of row r.
template <typename F>
__device__ float chunk_column_sum(u32 rows, F value) {
    __shared__ float lanes[8][32];
    u32 start = blockIdx.y * CHUNK_ROWS;
    u32 end = min(start + CHUNK_ROWS, rows);
    float s = 0.0f;
    for (u32 r = start + threadIdx.y; r < end; r += 8u) s += value(r);
    __syncthreads();
    lanes[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    float t = 0.0f;
    if (threadIdx.y == 0u) {
        for (u32 k = 0; k < 8u; k++) t += lanes[k][threadIdx.x];
    }
    return t;
}

// Whether this block is the last of its column block's chunks to finish, so that it adds
// their partial sums up (one launch where a second one did it; NVIDIA's threadFenceReduction
// sample): each block's partials are fenced before it counts itself in, and the count goes
// back to zero for the next launch. `counters` holds one zero per column block between
// launches.
__device__ bool last_chunk(u32* counters) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0u && threadIdx.y == 0u) {
        last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1u;
        if (last) counters[blockIdx.x] = 0u;
    }
    __syncthreads();
    return last;
}

// out[j] for this block's columns: the chunks' partial sums in `plane` added in chunk order
// (`sum_partials`' order, wgpu's), read past L1 (other blocks wrote them), held in `fmt`.
__device__ void sum_chunks(const float* plane, float* out, u32 c, u32 fmt = FMT_F32) {
    u32 j = blockIdx.x * 32u + threadIdx.x;
    if (threadIdx.y != 0u || j >= c) return;
    float s = 0.0f;
    for (u32 k = 0; k < gridDim.y; k++) s += __ldcg(plane + (i64)k * c + j);
    out[j] = held(s, fmt);
}

// out[j] = sum over rows of x[row, j], x rounded to x_fmt as it is read (a linear layer's
// output gradient, held in the compute format), held in fmt: partial[chunk, j] over each
// chunk's rows, then the last chunk's block adds the chunks in order.
extern "C" __global__ void column_sums(const float* x, float* partial, float* out, u32* counters,
                                       u32 rows, u32 c, u32 x_fmt, u32 fmt) {
    u32 j = blockIdx.x * 32u + threadIdx.x;
    u32 jj = min(j, c - 1u);  // out-of-range columns compute a copy and write nothing
    float t = chunk_column_sum(rows, [&](u32 r) { return held(x[(i64)r * c + jj], x_fmt); });
    if (threadIdx.y == 0u && j < c) partial[(i64)blockIdx.y * c + j] = t;
    if (last_chunk(counters)) sum_chunks(partial, out, c, fmt);
}

// Layer norm's dg = sum dy * xhat and db = sum dy per column, through partials per chunk (dg's
// chunks first, then db's: 2 * chunks * c values) that the last chunk's block adds.
extern "C" __global__ void layernorm_bwd_columns(const float* dy, const float* x,
                                                 const float* stats, float* partial, float* dg,
                                                 float* db, u32* counters, u32 rows, u32 c,
                                                 u32 dy_fmt) {
    u32 j = blockIdx.x * 32u + threadIdx.x;
    u32 jj = min(j, c - 1u);
    float g = chunk_column_sum(rows, [&](u32 r) {
        i64 e = (i64)r * c + jj;
        return held(dy[e], dy_fmt) * ((x[e] - stats[2 * (i64)r]) * stats[2 * (i64)r + 1]);
    });
    float b = chunk_column_sum(rows, [&](u32 r) { return held(dy[(i64)r * c + jj], dy_fmt); });
    if (threadIdx.y == 0u && j < c) {
        partial[(i64)blockIdx.y * c + j] = g;
        partial[(i64)(gridDim.y + blockIdx.y) * c + j] = b;
    }
    if (last_chunk(counters)) {
        sum_chunks(partial, dg, c);
        sum_chunks(partial + (i64)gridDim.y * c, db, c);
    }
}

// RMS norm's dg = sum dy * xhat per column, through partials per chunk (chunks * c values)
// that the last chunk's block adds.
extern "C" __global__ void rmsnorm_bwd_columns(const float* dy, const float* x,
                                               const float* rstds, float* partial, float* dg,
                                               u32* counters, u32 rows, u32 c, u32 dy_fmt) {
    u32 j = blockIdx.x * 32u + threadIdx.x;
    u32 jj = min(j, c - 1u);
    float g = chunk_column_sum(rows, [&](u32 r) {
        i64 e = (i64)r * c + jj;
        return held(dy[e], dy_fmt) * (x[e] * rstds[r]);
    });
    if (threadIdx.y == 0u && j < c) partial[(i64)blockIdx.y * c + j] = g;
    if (last_chunk(counters)) sum_chunks(partial, dg, c);
}

// out[j] = sum over chunks of partial[chunk, j], in chunk order (the split GEMMs' planes:
// matmul.rs).
extern "C" __global__ void sum_partials(const float* partial, float* out, u32 chunks, u32 c) {
    FOR_EACH(j, c) {
        float s = 0.0f;
        for (u32 k = 0; k < chunks; k++) s += partial[(i64)k * c + j];
        out[j] = s;
    }
}

// ---- The unary family (src/plan/unary.rs defines each function and its derivative; the ids
// are `Unary::id`, shaders/unary.wgsl computes the same). Adding a function: its arm in `unary`
// and in `unary_grad`. ----

#define UNARY_GELU 0u
#define UNARY_SILU 1u
#define UNARY_RELU 2u
#define UNARY_SIGMOID 3u
#define UNARY_TANH 4u

#define SQRT_2_OVER_PI 0.7978845608f

__device__ __forceinline__ float gelu_tanh(float v) {
    return tanhf(SQRT_2_OVER_PI * (v + 0.044715f * v * v * v));
}

// The one GELU of `unary_fwd` and of a bias add's (`add`), so the two give the same bits.
__device__ __forceinline__ float gelu(float v) {
    return 0.5f * v * (1.0f + gelu_tanh(v));
}

__device__ __forceinline__ float sigmoid(float v) {
    return 1.0f / (1.0f + expf(-v));
}

// f(v) of function `f` (`Unary::apply`).
__device__ __forceinline__ float unary(u32 f, float v) {
    switch (f) {
        case UNARY_GELU: return gelu(v);
        case UNARY_SILU: return v / (1.0f + expf(-v));
        case UNARY_RELU: return v < 0.0f ? 0.0f : v;
        case UNARY_SIGMOID: return sigmoid(v);
        case UNARY_TANH: return tanhf(v);
        default: return v;
    }
}

// f' of function `f` in terms of what the backward reads (`Unary::grad`): dx = dy * f'(v), and
// for sigmoid and tanh, whose backward reads the forward's output y, y (1 - y) and 1 - y^2.
__device__ __forceinline__ float unary_grad(u32 f, float v) {
    switch (f) {
        case UNARY_GELU: {
            float t = gelu_tanh(v);
            // v clamped where t is +-1 already, as unary.wgsl's (an overflow of v^2 would make
            // the term's 0 a NaN).
            float vc = fminf(fmaxf(v, -100.0f), 100.0f);
            float du = SQRT_2_OVER_PI * (1.0f + 3.0f * 0.044715f * vc * vc);
            return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du;
        }
        case UNARY_SILU: {
            float s = sigmoid(v);
            return s * (1.0f + v * (1.0f - s));
        }
        // PyTorch passes dy where the output is not <= 0 (a NaN's too).
        case UNARY_RELU: return v <= 0.0f ? 0.0f : 1.0f;
        case UNARY_SIGMOID: return v * (1.0f - v);
        case UNARY_TANH: return 1.0f - v * v;
        default: return 1.0f;
    }
}

// y = f(x) held in format `fmt` (stored as codes where `coded`); x is stored in `x_fmt`
// (`load_stored`).
extern "C" __global__ void unary_fwd(const void* x, void* y, i64 n, u32 fmt, u32 coded, u32 x_fmt,
                                     u32 f) {
    FOR_EACH(e, n) store_held(y, e, unary(f, load_stored(x, e, x_fmt)), fmt, coded);
}

// dx = dy * f'(x) held in `fmt` (the rounding autocast gives it, in the same pass), dy rounded
// to `dy_fmt` as it is read.
extern "C" __global__ void unary_bwd(const void* x, const float* dy, float* dx, i64 n, u32 fmt,
                                     u32 x_fmt, u32 dy_fmt, u32 f) {
    FOR_EACH(e, n) dx[e] = held(held(dy[e], dy_fmt) * unary_grad(f, load_stored(x, e, x_fmt)), fmt);
}

// ---- elementwise product: out = a * b held in `fmt` (codes where `coded`) ----

extern "C" __global__ void elementwise_mul(const float* a, const float* b, void* out, i64 n,
                                           u32 fmt, u32 coded) {
    FOR_EACH(e, n) store_held(out, e, a[e] * b[e], fmt, coded);
}

// ---- dropout: src/plan/dropout.rs's mask, the first word of Philox4x32-10 of (part n + e,
// step, site, 0) under the seed's key as a uniform (its top 24 bits times 2^-24), kept where >= p ----

__device__ __forceinline__ u32 philox_first(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
    for (int round = 0; round < 10; round++) {
        u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c0;
}

// out[e] = x[e] * (kept ? scale : 0) held in `fmt`, the step and the batch's part from the
// scalars: the forward, and on dy the backward; x[e] held where the run evaluates (S_EVAL).
extern "C" __global__ void dropout(const float* x, float* out, const float* scalars, i64 n,
                                   float p, float scale, u32 site, u32 k0, u32 k1, u32 fmt) {
    u32 step = (u32)scalars[S_STEP];
    u32 first = (u32)scalars[S_PART] * (u32)n;
    bool eval = scalars[S_EVAL] != 0.0f;
    FOR_EACH(e, n) {
        float u = (float)(philox_first(first + (u32)e, step, site, 0u, k0, k1) >> 8) * (1.0f / 16777216.0f);
        out[e] = held(eval ? x[e] : x[e] * (u >= p ? scale : 0.0f), fmt);
    }
}

// ---- a sum or mean over the last axis, and its backward ----

// out[row] = (the sum of the row's c values) / divisor held in `fmt`, one block per row.
extern "C" __global__ void row_sums(const float* x, float* out, u32 c, float divisor, u32 fmt) {
    i64 base = (i64)blockIdx.x * c;
    float s = 0.0f;
    for (u32 j = threadIdx.x; j < c; j += blockDim.x) s += x[base + j];
    s = block_sum(s);
    if (threadIdx.x == 0) out[blockIdx.x] = held(s / divisor, fmt);
}

// out[e] = x[e / c] * scale / divisor held in `fmt`: each value repeated c times (a row sum's
// or mean's backward), or with c = 1 x times a constant.
extern "C" __global__ void broadcast(const float* x, float* out, i64 n, u32 c, float scale,
                                     float divisor, u32 fmt) {
    FOR_EACH(e, n) out[e] = held(x[e / c] * scale / divisor, fmt);
}

// ---- rotary position embeddings (src/plan/rotary.rs): rows of c = heads x d, row r at
// position r % t, each head's halves rotated pair by pair by the table's angles ((cos, sin) of
// pair i at position p at 2 (p d/2 + i)), by the opposite ones where `inverse` ----

extern "C" __global__ void rotary(const float* x, const float* table, float* out, i64 n, u32 c,
                                  u32 d, u32 t, u32 inverse, u32 fmt) {
    u32 half = d / 2;
    FOR_EACH(e, n) {
        i64 row = e / c;
        u32 k = (u32)(e % c) % d, i = k % half;
        const float* angle = table + ((i64)(row % t) * half + i) * 2;
        float cos_a = angle[0], sin_a = inverse ? -angle[1] : angle[1];
        float y = k < half ? x[e] * cos_a - x[e + half] * sin_a : x[e] * cos_a + x[e - half] * sin_a;
        out[e] = held(y, fmt);
    }
}

// ---- softmax of the scaled scores (plan::ScoreScale: scale * s held in `fmt`), one block per
// row of t; `causal`: row i of each t x t block sees columns 0..=i (the masked probabilities
// are 0), else every column ----

// The scores x rounded to `x_fmt` as they are read (the rounding of the matmul product they
// are, folded in). A mask (plan::ScoreMask; `kind` MASK_KEYS or MASK_BIAS, else none) holds
// rows of t, score row r reading row (r / block) * stride + r % period: a key mask leaves out
// the keys it marks nonzero, a bias is added to the scaled scores in f32. A row that sees no
// key (with a bias: -inf on every key seen) is 0 throughout.
#define MASK_KEYS 1u
#define MASK_BIAS 2u
extern "C" __global__ void softmax_fwd(const float* x, float* p, u32 t, float scale, u32 fmt,
                                       u32 x_fmt, u32 causal, const float* mask, u32 kind,
                                       u32 block, u32 stride, u32 period) {
    i64 base = (i64)blockIdx.x * t;
    u32 i = causal ? blockIdx.x % t : t - 1;
    const float* row = kind ? mask + ((i64)(blockIdx.x / block) * stride + blockIdx.x % period) * t
                            : nullptr;
    auto seen = [&](u32 j) { return j <= i && (kind != MASK_KEYS || row[j] == 0.0f); };
    auto z = [&](u32 j) {
        float z = held(held(x[base + j], x_fmt) * scale, fmt);
        return kind == MASK_BIAS ? z + row[j] : z;
    };
    float m = NEG_INF;
    for (u32 j = threadIdx.x; j <= i; j += blockDim.x)
        if (seen(j)) m = fmaxf(m, z(j));
    m = block_max(m);
    float s = 0.0f;
    for (u32 j = threadIdx.x; j <= i; j += blockDim.x)
        if (seen(j)) s += expf(z(j) - m);
    s = block_sum(s);
    bool none = kind == MASK_BIAS && m == NEG_INF;
    for (u32 j = threadIdx.x; j < t; j += blockDim.x)
        p[base + j] = seen(j) && !none ? expf(z(j) - m) / s : 0.0f;
}

// d(scores) = held(held(p * (dp - sum(p * dp))) * scale): the gradient of the held scaled
// scores, held, times the scale; dp rounded to `dp_fmt` as it is read.
extern "C" __global__ void softmax_bwd(const float* p, const float* dp, float* ds, u32 t,
                                       float scale, u32 fmt, u32 dp_fmt, u32 causal) {
    i64 base = (i64)blockIdx.x * t;
    u32 i = causal ? blockIdx.x % t : t - 1;
    auto g = [&](u32 j) { return held(dp[base + j], dp_fmt); };
    float dot = 0.0f;
    for (u32 j = threadIdx.x; j <= i; j += blockDim.x) dot += p[base + j] * g(j);
    dot = block_sum(dot);
    for (u32 j = threadIdx.x; j < t; j += blockDim.x)
        ds[base + j] = j <= i ? held(held(p[base + j] * (g(j) - dot), fmt) * scale, fmt) : 0.0f;
}

// ---- cross entropy ----

// Per row of v logits: the probabilities, and the row's loss into losses[row].
extern "C" __global__ void cross_entropy_fwd(const float* logits, const u32* targets,
                                             void* out, float* losses, const float* scalars,
                                             u32 v, u32 grad, u32 fmt, u32 coded) {
    i64 base = (i64)blockIdx.x * v;
    float m = NEG_INF;
    for (u32 i = threadIdx.x; i < v; i += blockDim.x) m = fmaxf(m, logits[base + i]);
    m = block_max(m);
    float s = 0.0f;
    for (u32 i = threadIdx.x; i < v; i += blockDim.x) s += expf(logits[base + i] - m);
    s = block_sum(s);
    u32 target = targets[blockIdx.x];
    // grad: the backward fused in, (p - onehot) * DLOSS_PER_ROW as cross_entropy_bwd computes it
    // from the stored p, held in `fmt` (as codes where `coded`); else the probabilities.
    float k = grad != 0u ? scalars[S_DLOSS_PER_ROW] : 0.0f;
    for (u32 i = threadIdx.x; i < v; i += blockDim.x) {
        float p = expf(logits[base + i] - m) / s;
        if (grad != 0u) store_held(out, base + i, (p - (i == target ? 1.0f : 0.0f)) * k, fmt, coded);
        else ((float*)out)[base + i] = p;
    }
    if (threadIdx.x == 0u) losses[blockIdx.x] = logf(s) + m - logits[base + target];
}

// stats[slot] = mean of x[0..n) (the mean loss). One block.
extern "C" __global__ void mean_to_stat(const float* x, float* stats, u32 n, u32 slot) {
    float s = 0.0f;
    for (u32 e = threadIdx.x; e < n; e += blockDim.x) s += x[e];
    s = block_sum(s);
    if (threadIdx.x == 0u) stats[slot] = s / (float)n;
}

// d = (p - onehot(target)) * scalars[S_DLOSS_PER_ROW] per row of v: the unfused definition of
// cross_entropy_fwd's gradient, which tests/cuda.rs checks it against on the host (a step plan
// runs the fused kernel).
extern "C" __global__ void cross_entropy_bwd(const float* probs, const u32* targets, float* d,
                                             const float* scalars, i64 n, u32 v) {
    float k = scalars[S_DLOSS_PER_ROW];
    FOR_EACH(e, n) {
        float onehot = targets[e / v] == (u32)(e % v) ? 1.0f : 0.0f;
        d[e] = (probs[e] - onehot) * k;
    }
}

// ---- mean squared error ----

// Per element of n: the loss's gradient 2 (pred - target) * scalars[S_DLOSS] / n held in
// `fmt`, and the squared error into squares[e] (their mean is mean_to_stat's).
extern "C" __global__ void mse_fwd(const float* pred, const float* target, float* grad,
                                   float* squares, const float* scalars, i64 n, u32 fmt) {
    float k = 2.0f * scalars[S_DLOSS] / (float)n;
    FOR_EACH(e, n) {
        float d = pred[e] - target[e];
        grad[e] = held(d * k, fmt);
        squares[e] = d * d;
    }
}

// ---- data movement ----

// out = held(y, y_fmt) + held(x, x_fmt) held in fmt, x repeated every c elements (c = n:
// elementwise; c = width: a bias per row, in the compute format); then, where r is not null,
// plus r held in r_fmt (a residual after a bias); stored as codes where `coded`. out may be y.
// Where g is not null, g = GELU of out's value, held in g_fmt (codes where `g_coded`): a bias
// add and the activation after it.
extern "C" __global__ void add(const float* x, const float* y, void* out, i64 n, u32 c, u32 y_fmt,
                               u32 x_fmt, u32 fmt, u32 coded, const float* r, u32 r_fmt, void* g,
                               u32 g_fmt, u32 g_coded) {
    FOR_EACH(e, n) {
        float v = held(y[e], y_fmt) + held(x[e % c], x_fmt);
        u32 f = fmt;
        if (r) {
            v = held(v, fmt) + r[e];
            f = r_fmt;
        }
        store_held(out, e, v, f, coded);
        if (g) store_held(g, e, gelu(held(v, f)), g_fmt, g_coded);
    }
}

// A 4-d strided copy (src/plan/mod.rs `Strided`): element (i0..i3) < dims moves from
// src_offset + i . src to dst_offset + i . dst.
struct Strided {
    u32 dims[4];
    u32 src[4];
    u32 dst[4];
    u32 src_offset;
    u32 dst_offset;
};

// The values rounded to `fmt` as they are copied (a rounding of the matmul product copied,
// folded in).
extern "C" __global__ void strided_copy(const float* x, float* y, i64 n, Strided map, u32 fmt) {
    FOR_EACH(e, n) {
        i64 rest = e, s = map.src_offset, d = map.dst_offset;
        for (int axis = 3; axis >= 0; axis--) {
            i64 i = rest % map.dims[axis];
            rest /= map.dims[axis];
            s += i * map.src[axis];
            d += i * map.dst[axis];
        }
        y[d] = held(x[s], fmt);
    }
}

// ---- GradScaler and AdamW ----

// The multi-tensor kernels (unscale and check, AdamW) run one launch over a table of tensors
// (apex's multi_tensor_apply): the table, written once when the plan is built, gives each tensor
// its pointers, length and a range of the grid's blocks; a block finds its tensor by bisection.
struct TensorBlocks {
    float* x[4];       // unscale: the gradient; AdamW: p, g, m, v
    i64 n;             // values of each
    u32 first_block;   // the tensor's blocks in the grid: [first_block, first_block + blocks)
    u32 blocks;
    u32 decay;         // AdamW: weight decay applies
    u32 pad;
};

// The entry of `table` (`count` tensors, in block order) whose blocks hold block `b`.
__device__ __forceinline__ u32 tensor_of_block(const TensorBlocks* table, u32 count, u32 b) {
    u32 lo = 0, hi = count;  // table[lo].first_block <= b < table[hi].first_block
    while (hi - lo > 1u) {
        u32 mid = (lo + hi) / 2u;
        if (table[mid].first_block <= b) lo = mid; else hi = mid;
    }
    return lo;
}

// Unscale of every gradient of the table: g = (g [+ POISON on element 0 of tensor 0]) *
// INVERSE_SCALE in place; per block, the squared norm and whether any result is inf or NaN into
// partial[2 b], partial[2 b + 1]. Each tensor's blocks stride over it as a launch of its own
// would (the split is fixed by the table, so the sums are too).
extern "C" __global__ void unscale_partials(const TensorBlocks* table, u32 count, float* partial,
                                            const float* scalars) {
    u32 i = tensor_of_block(table, count, blockIdx.x);
    const TensorBlocks t = table[i];
    float* g = t.x[0];
    i64 stride = (i64)t.blocks * blockDim.x;
    float inverse = scalars[S_INVERSE_SCALE];
    float s = 0.0f, bad = 0.0f;
    for (i64 e = (i64)(blockIdx.x - t.first_block) * blockDim.x + threadIdx.x; e < t.n; e += stride) {
        float v = g[e];
        if (i == 0u && e == 0) v += scalars[S_POISON];
        v *= inverse;
        g[e] = v;
        if (!is_finite_bits(v)) bad = 1.0f;
        s += v * v;
    }
    s = block_sum(s);
    bad = block_max(bad);
    if (threadIdx.x == 0u) {
        partial[2 * blockIdx.x] = s;
        partial[2 * blockIdx.x + 1] = bad;
    }
}

// Per tensor i of the table, stats[flags + i] = whether any of its blocks saw a non-finite
// value, stats[norms + i] = its squared norm (its blocks added in order). A thread per tensor.
extern "C" __global__ void unscale_finish(const TensorBlocks* table, u32 count,
                                          const float* partial, float* stats, u32 flags,
                                          u32 norms) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
        float s = 0.0f, bad = 0.0f;
        for (u32 b = table[i].first_block; b < table[i].first_block + table[i].blocks; b++) {
            s += partial[2 * b];
            bad = fmaxf(bad, partial[2 * b + 1]);
        }
        stats[flags + i] = bad;
        stats[norms + i] = s;
    }
}

// One AdamW value: m, v and p updated from gradient g (already clipped) in f32, then held in
// format `fmt` (the preset's weights).
struct AdamwStep {
    float beta1, beta2, wd, step, bc2, eps;
    u32 fmt;
    __device__ __forceinline__ void apply(float& p, float g, float& m, float& v) const {
        m = beta1 * m + (1.0f - beta1) * g;
        v = beta2 * v + (1.0f - beta2) * g * g;
        p = held(p * (1.0f - wd) - step * m / (sqrtf(v / bc2) + eps), fmt);
        m = held(m, fmt);
        v = held(v, fmt);
    }
};

// AdamW on every parameter of the table (x = p, g, m, v), each block a chunk of
// ADAMW_CHUNK values of its tensor; skipped unless every gradient's finite flag
// (stats[1 .. 1 + count)) is clear; the gradients clipped to the global norm CLIP (squared
// norms at stats[1 + count .. 1 + 2 count)). 16-byte accesses where the four are aligned.
#define ADAMW_CHUNK 4096
extern "C" __global__ void adamw(const TensorBlocks* table, u32 tensors, const float* stats,
                                 const float* scalars, u32 count, u32 fmt) {
    __shared__ float gate[2];  // whether every gradient is finite, and the clip factor
    if (threadIdx.x == 0u) {
        float norm_sq = 0.0f, finite = 1.0f;
        for (u32 i = 0; i < count; i++) {
            if (stats[1 + i] != 0.0f) finite = 0.0f;
            norm_sq += stats[1 + count + i];
        }
        float norm = sqrtf(norm_sq), clip = scalars[S_CLIP];
        gate[0] = finite;
        gate[1] = clip > 0.0f && norm > clip ? clip / norm : 1.0f;
    }
    __syncthreads();
    if (gate[0] == 0.0f) return;
    float factor = gate[1];
    const TensorBlocks t = table[tensor_of_block(table, tensors, blockIdx.x)];
    float lr = scalars[S_LR];
    AdamwStep a = {scalars[S_BETA1], scalars[S_BETA2],
                   t.decay != 0u ? lr * scalars[S_WEIGHT_DECAY] : 0.0f,
                   lr / scalars[S_BIAS_CORRECTION1], scalars[S_BIAS_CORRECTION2], scalars[S_EPS],
                   fmt};
    float *p = t.x[0], *m = t.x[2], *v = t.x[3];
    const float* g = t.x[1];
    i64 from = (i64)(blockIdx.x - t.first_block) * ADAMW_CHUNK;
    i64 to = min(from + ADAMW_CHUNK, t.n);
    bool quads = (((unsigned long long)p | (unsigned long long)g | (unsigned long long)m |
                   (unsigned long long)v) & 15ull) == 0ull;
    i64 e = from;
    if (quads) {
        for (i64 q = from / 4 + threadIdx.x; q < to / 4; q += blockDim.x) {
            float4 pq = ((float4*)p)[q], gq = ((const float4*)g)[q];
            float4 mq = ((float4*)m)[q], vq = ((float4*)v)[q];
            a.apply(pq.x, gq.x * factor, mq.x, vq.x);
            a.apply(pq.y, gq.y * factor, mq.y, vq.y);
            a.apply(pq.z, gq.z * factor, mq.z, vq.z);
            a.apply(pq.w, gq.w * factor, mq.w, vq.w);
            ((float4*)p)[q] = pq;
            ((float4*)m)[q] = mq;
            ((float4*)v)[q] = vq;
        }
        e = to / 4 * 4;
    }
    for (i64 k = e + threadIdx.x; k < to; k += blockDim.x) a.apply(p[k], g[k] * factor, m[k], v[k]);
}
