// scale.cu: amax reductions, fp8 current-scaling factors and the descaling of fp8 products.
// Needs formats.cuh. The CUDA twin of shaders/scale.wgsl.
//
// amax uses atomicMax on the bits of |x|: for non-negative floats the integer order of the
// bits is the value order, so the reduction is exact and independent of float modes.

extern "C" __global__ void amax(const float* x, i64 n, u32* amax_bits, u32 batch_len, u32 div,
                                u32 modulus, u32 groups_per_batch) {
    Groups g = {batch_len, div, modulus, groups_per_batch};
    FOR_EACH(e, n) {
        u32 magnitude = __float_as_uint(x[e]) & 0x7fffffffu;
        if (magnitude < 0x7f800000u) atomicMax(&amax_bits[group_of(e, g)], magnitude);
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

// C[b][i][j] /= (sa * sb) for the scales of row i of A and column j of B in batch b;
// `a_groups` is 1 (tensorwise) or `rows` scales per batch, `b_groups` 1 or `cols`. Divided one
// at a time so that no product of scales overflows.
extern "C" __global__ void descale(float* c, i64 n, u32 rows, u32 cols, const float* sa,
                                   u32 a_groups, const float* sb, u32 b_groups) {
    FOR_EACH(e, n) {
        i64 batch = e / ((i64)rows * cols);
        u32 within = (u32)(e % ((i64)rows * cols));
        u32 i = a_groups == 1u ? 0u : within / cols;
        u32 j = b_groups == 1u ? 0u : within % cols;
        float a = sa[batch * a_groups + i];
        float b = sb[batch * b_groups + j];
        c[e] = __fdiv_rn(__fdiv_rn(c[e], a), b);
    }
}
