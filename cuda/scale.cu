// scale.cu: amax reductions, fp8 current-scaling factors and the descaling of fp8 products.
// Needs formats.cuh. The CUDA twin of shaders/scale.wgsl.
//
// amax uses atomicMax on the bits of |x|: for non-negative floats the integer order of the
// bits is the value order, so the reduction is exact and independent of float modes (and of
// the order of the atomics).

// Elements per block of 256 threads in `amax` (the launch: matmul::amax_config).
#ifndef AMAX_SPAN
#define AMAX_SPAN 4096
#endif

// One atomic per element on one address serialises: on the H100 a tensorwise amax of 16M
// values took 10 ms, twenty times the f16 GEMM it scales. So each block takes spans of
// AMAX_SPAN consecutive elements (coalesced: thread t reads t, t + 256, ...; four at a time,
// 4t..4t+3, where the buffer and the groups allow), each thread keeps a running max while its
// group stays the same, maxima of the span's first group meet in shared memory, and only the
// others (a group boundary inside the span) go to memory.
struct RunningMax {
    u32 first, group, run;
};

__device__ __forceinline__ void running_max(RunningMax& m, u32* span_max, u32* amax_bits,
                                            float v, u32 group) {
    u32 magnitude = __float_as_uint(v) & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) return;
    if (group != m.group) {
        if (m.group == m.first) atomicMax(span_max, m.run);
        else atomicMax(&amax_bits[m.group], m.run);
        m.group = group;
        m.run = 0u;
    }
    if (magnitude > m.run) m.run = magnitude;
}

extern "C" __global__ void amax(const float* x, i64 n, u32* amax_bits, u32 batch_len, u32 div,
                                u32 modulus, u32 groups_per_batch) {
    Groups g = {batch_len, div, modulus, groups_per_batch};
    __shared__ u32 span_max;
    bool by4 = batch_len % 4u == 0u && n % 4 == 0 && aligned(x, 16);
    for (i64 s = (i64)blockIdx.x * AMAX_SPAN; s < n; s += (i64)gridDim.x * AMAX_SPAN) {
        if (threadIdx.x == 0) span_max = 0u;
        __syncthreads();
        u32 first = group_of(s, g);
        RunningMax m = {first, first, 0u};
        i64 end = min(s + (i64)AMAX_SPAN, n);
        if (by4) {
            for (i64 e = s + 4 * (i64)threadIdx.x; e < end; e += 4 * (i64)blockDim.x) {
                float4 v = ((const float4*)x)[e / 4];
                u32 at[4];
                groups_of_4(e, n, g, at);
                running_max(m, &span_max, amax_bits, v.x, at[0]);
                running_max(m, &span_max, amax_bits, v.y, at[1]);
                running_max(m, &span_max, amax_bits, v.z, at[2]);
                running_max(m, &span_max, amax_bits, v.w, at[3]);
            }
        } else {
            for (i64 e = s + threadIdx.x; e < end; e += blockDim.x) {
                running_max(m, &span_max, amax_bits, x[e], group_of(e, g));
            }
        }
        if (m.group == first) atomicMax(&span_max, m.run);
        else atomicMax(&amax_bits[m.group], m.run);
        __syncthreads();
        if (threadIdx.x == 0 && span_max != 0u) atomicMax(&amax_bits[first], span_max);
        __syncthreads();
    }
}

// s = FMAX / amax per group (IEEE division), capped at f32's max; 1 where the group holds no
// nonzero finite value. As format::scale_for_amax.
extern "C" __global__ void scale_from_amax(const u32* amax_bits, float* scales, u32 groups,
                                           float fmax) {
    FOR_EACH(g, groups) {
        u32 a = amax_bits[g];
        float s = 1.0f;
        if (a != 0u) {
            s = __fdiv_rn(fmax, __uint_as_float(a));
            if (__float_as_uint(s) == 0x7f800000u) s = __uint_as_float(0x7f7fffffu);
        }
        scales[g] = s;
    }
}

// acc / (sa * sb) without an intermediate overflow or underflow (as `unscale` in
// shaders/matmul.wgsl): the scales' mantissas divide acc (a factor in [1, 4)), their exponents
// are applied in two halves, so the intermediate leaves f32's range only when the result does.
// Dividing by one scale and then the other overflows when the result is near f32's max and sa
// is small (found on the H100: a product of ~1e38 came out inf).
__device__ __forceinline__ float unscale(float acc, float sa, float sb) {
    int ea, eb;
    float fa = frexpf(sa, &ea), fb = frexpf(sb, &eb);
    float x = __fdiv_rn(acc, __fmul_rn(fa, fb));
    int total = -(ea + eb);
    int half = total / 2;
    return ldexpf(ldexpf(x, half), total - half);
}

// C[b][i][j] /= (sa * sb) for the scales of row i of A and column j of B in batch b;
// `a_groups` is 1 (tensorwise) or `rows` scales per batch, `b_groups` 1 or `cols`. Four at a
// time where a row holds a multiple of four (the four then share a row).
__device__ __forceinline__ float descaled(float acc, i64 e, i64 n, u32 rows, u32 cols,
                                          const float* sa, u32 a_groups, const float* sb,
                                          u32 b_groups) {
    i64 per = (i64)rows * cols;
    i64 batch = n > per ? e / per : 0;
    u32 within = (u32)(e - batch * per);
    u32 i = a_groups == 1u ? 0u : within / cols;
    u32 j = b_groups == 1u ? 0u : within % cols;
    return unscale(acc, sa[batch * a_groups + i], sb[batch * b_groups + j]);
}

extern "C" __global__ void descale(float* c, i64 n, u32 rows, u32 cols, const float* sa,
                                   u32 a_groups, const float* sb, u32 b_groups) {
    i64 quads = cols % 4u == 0u && aligned(c, 16) ? n / 4 : 0;
    FOR_EACH(q, quads) {
        float4 v = ((float4*)c)[q];
        i64 e = 4 * q;
        v.x = descaled(v.x, e, n, rows, cols, sa, a_groups, sb, b_groups);
        v.y = descaled(v.y, e + 1, n, rows, cols, sa, a_groups, sb, b_groups);
        v.z = descaled(v.z, e + 2, n, rows, cols, sa, a_groups, sb, b_groups);
        v.w = descaled(v.w, e + 3, n, rows, cols, sa, a_groups, sb, b_groups);
        ((float4*)c)[q] = v;
    }
    FOR_EACH_FROM(e, 4 * quads, n) c[e] = descaled(c[e], e, n, rows, cols, sa, a_groups, sb, b_groups);
}
