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
// AMAX_SPAN consecutive elements (coalesced: thread t reads t, t + 256, ...), each thread keeps
// a running max while its group stays the same, maxima of the span's first group meet in
// shared memory, and only the others (a group boundary inside the span) go to memory.
extern "C" __global__ void amax(const float* x, i64 n, u32* amax_bits, u32 batch_len, u32 div,
                                u32 modulus, u32 groups_per_batch) {
    Groups g = {batch_len, div, modulus, groups_per_batch};
    __shared__ u32 span_max;
    for (i64 s = (i64)blockIdx.x * AMAX_SPAN; s < n; s += (i64)gridDim.x * AMAX_SPAN) {
        if (threadIdx.x == 0) span_max = 0u;
        __syncthreads();
        u32 first = group_of(s, g);
        u32 group = first, run = 0u;
        for (i64 e = s + threadIdx.x; e < s + AMAX_SPAN && e < n; e += blockDim.x) {
            u32 magnitude = __float_as_uint(x[e]) & 0x7fffffffu;
            if (magnitude >= 0x7f800000u) continue;
            u32 ge = group_of(e, g);
            if (ge != group) {
                if (group == first) atomicMax(&span_max, run);
                else atomicMax(&amax_bits[group], run);
                group = ge;
                run = 0u;
            }
            if (magnitude > run) run = magnitude;
        }
        if (group == first) atomicMax(&span_max, run);
        else atomicMax(&amax_bits[group], run);
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
// `a_groups` is 1 (tensorwise) or `rows` scales per batch, `b_groups` 1 or `cols`.
extern "C" __global__ void descale(float* c, i64 n, u32 rows, u32 cols, const float* sa,
                                   u32 a_groups, const float* sb, u32 b_groups) {
    FOR_EACH(e, n) {
        i64 batch = e / ((i64)rows * cols);
        u32 within = (u32)(e % ((i64)rows * cols));
        u32 i = a_groups == 1u ? 0u : within / cols;
        u32 j = b_groups == 1u ? 0u : within % cols;
        c[e] = unscale(c[e], sa[batch * a_groups + i], sb[batch * b_groups + j]);
    }
}
