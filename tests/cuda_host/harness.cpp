// Runs the elementwise kernels of cuda/ (cast.cu, scale.cu and formats.cuh under them) on the
// host, so that their numerics are checked against the host reference on machines without a
// GPU (tests/cuda.rs). CUDA's built-ins are defined here with the semantics the kernels rely
// on (IEEE float arithmetic, as NVRTC compiles them: no flush to zero, no contraction), and a
// kernel's grid-stride loop runs as one thread over every element.
//
// Usage: harness KERNEL ARGS... < input > output; input and output are arrays of u32.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
struct Dim3 {
    unsigned x, y, z;
};
static const Dim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0}, blockDim = {1, 1, 1},
                  gridDim = {1, 1, 1};
static inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
static inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline unsigned atomicMax(unsigned* p, unsigned v) {
    unsigned old = *p;
    if (v > old) *p = v;
    return old;
}
using std::min;

#include "../../cuda/formats.cuh"
#include "../../cuda/cast.cu"
#include "../../cuda/scale.cu"

static std::vector<u32> read_all() {
    std::vector<u32> v;
    u32 buf[4096];
    size_t got;
    while ((got = std::fread(buf, 4, 4096, stdin)) > 0) v.insert(v.end(), buf, buf + got);
    return v;
}

static void write_all(const std::vector<u32>& v) { std::fwrite(v.data(), 4, v.size(), stdout); }

static u32 arg(char** argv, int i) { return (u32)std::strtoul(argv[i], nullptr, 10); }

static float farg(char** argv, int i) { return std::strtof(argv[i], nullptr); }

int main(int argc, char** argv) {
    if (argc < 2) return 2;
    std::string k = argv[1];
    std::vector<u32> in = read_all();
    i64 n = (i64)in.size();
    const float* fin = reinterpret_cast<const float*>(in.data());
    std::vector<u32> out(in.size());
    if (k == "encode" && argc == 4) {
        encode(in.data(), out.data(), n, arg(argv, 2), arg(argv, 3));
    } else if (k == "decode" && argc == 3) {
        decode(in.data(), out.data(), n, arg(argv, 2));
    } else if (k == "round_to" && argc == 3) {
        round_to(in.data(), out.data(), n, arg(argv, 2));
    } else if (k == "encode_16" && argc == 3) {
        std::vector<u16> o16(in.size());
        encode_16(in.data(), o16.data(), n, arg(argv, 2));
        out.assign(o16.begin(), o16.end());
    } else if (k == "split_bf16" && argc == 2) {
        out.resize(3 * in.size());
        split_bf16(fin, out.data(), n);
    } else if (k == "quantize_to_f16" && argc == 8) {
        // FMT BATCH_LEN DIV MODULUS GROUPS_PER_BATCH GROUPS; the scales are the last GROUPS
        // values of the input.
        u32 groups = arg(argv, 7);
        n -= groups;
        std::vector<u16> o16(n);
        quantize_to_f16(fin, o16.data(), n, arg(argv, 2), fin + n, arg(argv, 3), arg(argv, 4),
                        arg(argv, 5), arg(argv, 6));
        out.assign(o16.begin(), o16.end());
    } else if (k == "amax" && argc == 7) {
        // BATCH_LEN DIV MODULUS GROUPS_PER_BATCH GROUPS
        out.assign(arg(argv, 6), 0u);
        amax(fin, n, out.data(), arg(argv, 2), arg(argv, 3), arg(argv, 4), arg(argv, 5));
    } else if (k == "scale_from_amax" && argc == 3) {
        std::vector<float> s(in.size());
        scale_from_amax(in.data(), s.data(), (u32)n, farg(argv, 2));
        std::memcpy(out.data(), s.data(), 4 * s.size());
    } else {
        std::fprintf(stderr, "unknown kernel or arguments: %s\n", k.c_str());
        return 2;
    }
    write_all(out);
    return 0;
}
