// Runs the kernels of cuda/ (cast.cu, scale.cu, train.cu, matmul_split_bf16.cu and formats.cuh
// under them) on the host, so that their numerics are checked against the host reference on
// machines without a GPU (tests/cuda.rs). CUDA's built-ins are defined here with the semantics
// the kernels rely on (IEEE float arithmetic, as NVRTC compiles them: no flush to zero, no
// contraction). The elementwise kernels run as one thread over every element; `launch` runs a
// grid block by block with every thread of a block a coroutine (ucontext), switched at
// __syncthreads, warp shuffles and the emulated mma.sync, so that block reductions and warp-wide
// tensor-core fragments run as they do on a GPU.
//
// Usage: harness KERNEL ARGS... < input > output; input and output are arrays of u32.

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
// Blocks run one after the other, so a block's shared memory can be a static.
#define __shared__ static
struct Dim3 {
    unsigned x, y, z;
};
static Dim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0}, blockDim = {1, 1, 1},
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

// The block emulator: one coroutine per thread of the running block.
namespace emu {
struct Thread {
    ucontext_t ctx;
    Dim3 idx;
    bool done;
};
static ucontext_t scheduler;
static std::vector<Thread> threads;
static std::vector<std::vector<char>> stacks;
static size_t running;
static std::function<void()> body;
static float exchange[1024];

static void entry() {
    body();
    threads[running].done = true;
}

// Back to the scheduler, which runs every other thread of the block up to the same point.
static void yield() { swapcontext(&threads[running].ctx, &scheduler); }

static unsigned flat_thread() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

// Runs `kernel` over grid x block.
static void launch(Dim3 grid, Dim3 block, std::function<void()> kernel) {
    size_t count = (size_t)block.x * block.y * block.z;
    if (count > 1024) std::abort();
    body = std::move(kernel);
    gridDim = grid;
    blockDim = block;
    threads.assign(count, Thread{});
    stacks.resize(count);
    for (auto& s : stacks) s.resize(64 * 1024);
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                blockIdx = {bx, by, bz};
                for (size_t t = 0; t < count; t++) {
                    Thread& th = threads[t];
                    th.idx = {(unsigned)(t % block.x), (unsigned)((t / block.x) % block.y),
                              (unsigned)(t / ((size_t)block.x * block.y))};
                    th.done = false;
                    getcontext(&th.ctx);
                    th.ctx.uc_stack.ss_sp = stacks[t].data();
                    th.ctx.uc_stack.ss_size = stacks[t].size();
                    th.ctx.uc_link = &scheduler;
                    makecontext(&th.ctx, entry, 0);
                }
                // Rounds: every live thread runs to its next barrier (or its end).
                for (bool live = true; live;) {
                    live = false;
                    for (size_t t = 0; t < count; t++) {
                        if (threads[t].done) continue;
                        running = t;
                        threadIdx = threads[t].idx;
                        swapcontext(&scheduler, &threads[t].ctx);
                        live = live || !threads[t].done;
                    }
                }
            }
    blockIdx = {0, 0, 0};
    threadIdx = {0, 0, 0};
    blockDim = gridDim = {1, 1, 1};
}
}  // namespace emu

static inline void __syncthreads() { emu::yield(); }

// Every thread of the block takes part (the kernels call shuffles in block-uniform code).
static inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    unsigned t = emu::flat_thread();
    emu::exchange[t] = v;
    emu::yield();
    float r = emu::exchange[t ^ (unsigned)lane_mask];
    emu::yield();
    return r;
}

#include "../../cuda/formats.cuh"
#include "../../cuda/cast.cu"
// A span that is not a multiple of the block or of a row, so that spans start mid-group and
// the grid-stride loop over spans runs (the launch below: 2 blocks of 16).
#define AMAX_SPAN 40
#include "../../cuda/scale.cu"
#include "../../cuda/train.cu"
#include "../../cuda/attention.cu"

// ---- matmul_split_bf16.cu, with the warp's mma.sync emulated ----

#define __launch_bounds__(n)
#define __align__(n) __attribute__((aligned(n)))
#define MANTISSA_HOST_MMA

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for the calling warp. Every lane stages
// its fragments; after a barrier each lane rebuilds the warp's A (16x16) and B (16x8) from them
// with the PTX ISA's fragment layouts (groupID = lane >> 2, t = lane % 4; a register holds two
// elements, the lower-indexed one in its low half) and computes its own four elements of D:
//   A: reg 0 (row g, cols 2t, 2t+1), reg 1 (row g+8, same cols), reg 2 (row g, cols 2t+8, +9),
//      reg 3 (row g+8, cols 2t+8, +9)
//   B: reg 0 (rows 2t, 2t+1, col g), reg 1 (rows 2t+8, 2t+9, col g)
//   C, D: c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, same cols)
// Products of bf16 values are exact in f32; they are added to C in k order in f32 (the
// hardware's order is its own: the tests allow for that).
static u32 mma_stage_a[32][32][4], mma_stage_b[32][32][2];

static float bf16_half(u32 reg, u32 upper) { return __uint_as_float((upper ? reg >> 16 : reg & 0xffffu) << 16); }

static void mma_bf16(float* c, const u32* a, const u32* b) {
    unsigned t = emu::flat_thread(), warp = t / 32, lane = t % 32;
    for (int i = 0; i < 4; i++) mma_stage_a[warp][lane][i] = a[i];
    for (int i = 0; i < 2; i++) mma_stage_b[warp][lane][i] = b[i];
    emu::yield();
    float A[16][16], B[16][8];
    for (u32 l = 0; l < 32; l++) {
        u32 g = l >> 2, q = l & 3u;
        const u32* ra = mma_stage_a[warp][l];
        const u32* rb = mma_stage_b[warp][l];
        for (u32 h = 0; h < 2; h++) {
            A[g][2 * q + h] = bf16_half(ra[0], h);
            A[g + 8][2 * q + h] = bf16_half(ra[1], h);
            A[g][2 * q + 8 + h] = bf16_half(ra[2], h);
            A[g + 8][2 * q + 8 + h] = bf16_half(ra[3], h);
            B[2 * q + h][g] = bf16_half(rb[0], h);
            B[2 * q + 8 + h][g] = bf16_half(rb[1], h);
        }
    }
    u32 g = lane >> 2, q = lane & 3u;
    for (u32 e = 0; e < 4; e++) {
        u32 row = g + (e >= 2 ? 8u : 0u), col = 2 * q + (e & 1u);
        float sum = c[e];
        for (u32 k = 0; k < 16; k++) sum += A[row][k] * B[k][col];
        c[e] = sum;
    }
    emu::yield();  // the stage is reused by the next call
}

// One instance of the kernel per LEVELS, each in its namespace under its own C name.
#define SPLIT_NS x3
#define SPLIT_NAME matmul_split_bf16_x3
#define LEVELS 2
#include "split_kernel.inc"
#define SPLIT_NS x6
#define SPLIT_NAME matmul_split_bf16_x6
#define LEVELS 3
#include "split_kernel.inc"
#define SPLIT_NS x9
#define SPLIT_NAME matmul_split_bf16_x9
#define LEVELS 5
#include "split_kernel.inc"

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

// ---- train.cu, launched with the CUDA backend's geometry (src/backend/cuda/train.rs) ----

// Threads of the row kernels; of the elementwise ones (on at most 3 blocks here, so that the
// grid-stride loops take several turns).
static const unsigned ROW_THREADS = 128, ELEMENT_THREADS = 256;

static Dim3 elementwise_grid(i64 n) { return {(unsigned)std::min<i64>((n + 255) / 256, 3), 1, 1}; }

// The input cut into consecutive arrays.
struct Inputs {
    const std::vector<u32>& in;
    size_t at = 0;
    float* f(size_t n) {
        if (at + n > in.size()) {
            std::fprintf(stderr, "input too short\n");
            std::exit(2);
        }
        float* p = (float*)(in.data() + at);
        at += n;
        return p;
    }
    u32* u(size_t n) { return (u32*)f(n); }
};

static std::vector<u32> bits_of(const std::vector<float>& v) {
    std::vector<u32> out(v.size());
    std::memcpy(out.data(), v.data(), 4 * v.size());
    return out;
}

static void column_sums_of(const float* x, float* out, u32 rows, u32 c) {
    u32 chunks = std::max(1u, (rows + CHUNK_ROWS - 1) / CHUNK_ROWS);
    std::vector<float> partial((size_t)chunks * c);
    emu::launch({(c + 31) / 32, chunks, 1}, {32, 8, 1},
                [&] { column_partials(x, partial.data(), rows, c); });
    emu::launch(elementwise_grid(c), {ELEMENT_THREADS, 1, 1},
                [&] { sum_partials(partial.data(), out, chunks, c); });
}

// Runs train.cu kernel `k`; false if `k` is not one of them.
static bool run_train(const std::string& k, int argc, char** argv, std::vector<u32>& in,
                      std::vector<u32>& out) {
    Inputs input{in};
    Dim3 row_block = {ROW_THREADS, 1, 1}, element_block = {ELEMENT_THREADS, 1, 1};
    if (k == "layernorm_fwd" && argc == 6) {  // ROWS C FMT CODED < x g b > y stats
        // CODED: y as 16-bit codes, one to each output word.
        u32 rows = arg(argv, 2), c = arg(argv, 3), fmt = arg(argv, 4), coded = arg(argv, 5);
        float *x = input.f((size_t)rows * c), *g = input.f(c), *b = input.f(c);
        std::vector<float> y((size_t)rows * c), st(2 * rows);
        std::vector<unsigned short> codes((size_t)rows * c);
        void* dst = coded ? (void*)codes.data() : (void*)y.data();
        emu::launch({rows, 1, 1}, row_block, [&] { layernorm_fwd(x, g, b, dst, st.data(), c, fmt, coded); });
        out = coded ? std::vector<u32>(codes.begin(), codes.end()) : bits_of(y);
        std::vector<u32> stats = bits_of(st);
        out.insert(out.end(), stats.begin(), stats.end());
    } else if (k == "layernorm_bwd" && argc == 4) {  // ROWS C < dy x g stats > dx dg db
        u32 rows = arg(argv, 2), c = arg(argv, 3);
        size_t n = (size_t)rows * c;
        float *dy = input.f(n), *x = input.f(n), *g = input.f(c), *st = input.f(2 * rows);
        std::vector<float> dx(n), dg(c), db(c);
        emu::launch({rows, 1, 1}, row_block, [&] { layernorm_bwd_x(dy, x, g, st, dx.data(), c); });
        u32 chunks = std::max(1u, (rows + CHUNK_ROWS - 1) / CHUNK_ROWS);
        std::vector<float> partial(2 * (size_t)chunks * c);
        emu::launch({(c + 31) / 32, chunks, 1}, {32, 8, 1},
                    [&] { layernorm_bwd_partials(dy, x, st, partial.data(), rows, c); });
        emu::launch(elementwise_grid(c), element_block,
                    [&] { sum_partials(partial.data(), dg.data(), chunks, c); });
        emu::launch(elementwise_grid(c), element_block, [&] {
            sum_partials(partial.data() + (size_t)chunks * c, db.data(), chunks, c);
        });
        dx.insert(dx.end(), dg.begin(), dg.end());
        dx.insert(dx.end(), db.begin(), db.end());
        out = bits_of(dx);
    } else if (k == "column_sums" && argc == 4) {  // ROWS C < x > sums
        u32 rows = arg(argv, 2), c = arg(argv, 3);
        float* x = input.f((size_t)rows * c);
        std::vector<float> sums(c);
        column_sums_of(x, sums.data(), rows, c);
        out = bits_of(sums);
    } else if ((k == "gelu_fwd" && argc == 6) || (k == "gelu_bwd" && argc == 4)) {
        // gelu_fwd N FMT CODED XFMT < x > y; gelu_bwd N XFMT < x dy > dx. Codes travel one to
        // each word: x where XFMT is not f32's (a coded input), y where CODED.
        i64 n = arg(argv, 2);
        u32 x_fmt = arg(argv, k == "gelu_fwd" ? 5 : 3);
        u32* words = input.u(n);
        std::vector<unsigned short> x_codes(words, words + n);
        const void* x = x_fmt == FMT_F32 ? (const void*)words : (const void*)x_codes.data();
        std::vector<float> y(n);
        if (k == "gelu_fwd") {
            u32 fmt = arg(argv, 3), coded = arg(argv, 4);
            std::vector<unsigned short> codes(n);
            void* dst = coded ? (void*)codes.data() : (void*)y.data();
            emu::launch(elementwise_grid(n), element_block,
                        [&] { gelu_fwd(x, dst, n, fmt, coded, x_fmt); });
            if (coded) {
                out = std::vector<u32>(codes.begin(), codes.end());
                return true;
            }
        } else {
            float* dy = input.f(n);
            emu::launch(elementwise_grid(n), element_block,
                        [&] { gelu_bwd(x, dy, y.data(), n, x_fmt); });
        }
        out = bits_of(y);
    } else if ((k == "softmax_fwd" || k == "softmax_bwd") && argc == 6) {  // ROWS T SCALE FMT
        u32 rows = arg(argv, 2), t = arg(argv, 3), fmt = arg(argv, 5);
        float scale = farg(argv, 4);
        size_t n = (size_t)rows * t;
        float* x = input.f(n);
        std::vector<float> y(n);
        if (k == "softmax_fwd") {
            emu::launch({rows, 1, 1}, row_block, [&] { causal_softmax_fwd(x, y.data(), t, scale, fmt); });
        } else {
            float* dp = input.f(n);
            emu::launch({rows, 1, 1}, row_block,
                        [&] { causal_softmax_bwd(x, dp, y.data(), t, scale, fmt); });
        }
        out = bits_of(y);
    } else if (k == "cross_entropy_fwd" && (argc == 4 || argc == 6)) {
        // ROWS V [S_DLOSS_PER_ROW FMT] < logits targets > probs (or, given the scalar, the
        // gradient held in FMT) mean
        u32 rows = arg(argv, 2), v = arg(argv, 3);
        u32 grad = argc == 6, fmt = grad ? arg(argv, 5) : 0;
        float* logits = input.f((size_t)rows * v);
        u32* targets = input.u(rows);
        std::vector<float> y((size_t)rows * v), losses(rows), stats(2), scalars(16, 0.0f);
        if (grad) scalars[S_DLOSS_PER_ROW] = farg(argv, 4);
        emu::launch({rows, 1, 1}, row_block, [&] {
            cross_entropy_fwd(logits, targets, y.data(), losses.data(), scalars.data(), v, grad, fmt);
        });
        emu::launch({1, 1, 1}, {256, 1, 1}, [&] { mean_to_stat(losses.data(), stats.data(), rows, 1); });
        y.push_back(stats[1]);
        out = bits_of(y);
    } else if (k == "cross_entropy_bwd" && argc == 5) {  // ROWS V S_DLOSS_PER_ROW < probs targets
        u32 rows = arg(argv, 2), v = arg(argv, 3);
        i64 n = (i64)rows * v;
        float* probs = input.f(n);
        u32* targets = input.u(rows);
        std::vector<float> scalars(16, 0.0f), d(n);
        scalars[S_DLOSS_PER_ROW] = farg(argv, 4);
        emu::launch(elementwise_grid(n), element_block,
                    [&] { cross_entropy_bwd(probs, targets, d.data(), scalars.data(), n, v); });
        out = bits_of(d);
    } else if (k == "embedding_fwd" && argc == 5) {  // ROWS C TOKENS < table ids
        u32 rows = arg(argv, 2), c = arg(argv, 3), tokens = arg(argv, 4);
        float* table = input.f((size_t)rows * c);
        u32* ids = input.u(tokens);
        i64 n = (i64)tokens * c;
        std::vector<float> y(n);
        emu::launch(elementwise_grid(n), element_block, [&] { embedding_fwd(table, ids, y.data(), n, c); });
        out = bits_of(y);
    } else if (k == "embedding_bwd" && argc == 5) {  // ROWS C TOKENS < dout ids
        u32 rows = arg(argv, 2), c = arg(argv, 3), tokens = arg(argv, 4);
        float* dout = input.f((size_t)tokens * c);
        u32* ids = input.u(tokens);
        std::vector<float> y((size_t)rows * c);
        emu::launch({rows, 1, 1}, row_block, [&] { embedding_bwd(dout, ids, y.data(), c, tokens); });
        out = bits_of(y);
    } else if (k == "add" && argc == 12) {
        // N C YFMT FMT CODED RFMT HAS_R HAS_G GFMT GCODED < x(c) y(n) [r(n)] > y held in YFMT,
        // plus x, held in FMT; then with HAS_R plus r held in RFMT (its codes, one to each word,
        // where CODED: written to a separate output, as a plan's coded bias add does; else in
        // place); then with HAS_G, the GELU of that, held in GFMT (codes where GCODED)
        i64 n = arg(argv, 2);
        u32 c = arg(argv, 3), y_fmt = arg(argv, 4), fmt = arg(argv, 5), coded = arg(argv, 6);
        u32 r_fmt = arg(argv, 7), has_r = arg(argv, 8);
        u32 has_g = arg(argv, 9), g_fmt = arg(argv, 10), g_coded = arg(argv, 11);
        float *x = input.f(c), *y = input.f(n);
        const float* r = has_r ? input.f(n) : nullptr;
        std::vector<unsigned short> codes(n), g_codes(n);
        std::vector<float> g_values(n);
        void* dst = coded ? (void*)codes.data() : (void*)y;
        void* g = !has_g ? nullptr : g_coded ? (void*)g_codes.data() : (void*)g_values.data();
        emu::launch(elementwise_grid(n), element_block, [&] {
            add(x, y, dst, n, c, y_fmt, fmt, coded, r, r_fmt, g, g_fmt, g_coded);
        });
        out = coded ? std::vector<u32>(codes.begin(), codes.end()) : bits_of(std::vector<float>(y, y + n));
        if (has_g) {
            std::vector<u32> g_out = g_coded ? std::vector<u32>(g_codes.begin(), g_codes.end()) : bits_of(g_values);
            out.insert(out.end(), g_out.begin(), g_out.end());
        }
    } else if (k == "strided_copy" && argc == 17) {  // DIMS*4 SRC*4 DST*4 SRC_OFF DST_OFF OUT_LEN
        Strided map;
        for (int i = 0; i < 4; i++) {
            map.dims[i] = arg(argv, 2 + i);
            map.src[i] = arg(argv, 6 + i);
            map.dst[i] = arg(argv, 10 + i);
        }
        map.src_offset = arg(argv, 14);
        map.dst_offset = arg(argv, 15);
        i64 n = (i64)map.dims[0] * map.dims[1] * map.dims[2] * map.dims[3];
        float* x = input.f(in.size());
        std::vector<float> y(arg(argv, 16), 0.0f);
        emu::launch(elementwise_grid(n), element_block, [&] { strided_copy(x, y.data(), n, map); });
        out = bits_of(y);
    } else if (k == "unscale" && argc == 5) {  // POISONED S_INVERSE_SCALE S_POISON < g > g flag norm
        i64 n = (i64)in.size();
        float* g = input.f(n);
        std::vector<float> scalars(16, 0.0f), stats(2);
        scalars[S_INVERSE_SCALE] = farg(argv, 3);
        scalars[S_POISON] = farg(argv, 4);
        // The backend's geometry: up to 256 blocks of 256, at least 1024 elements each.
        u32 blocks = (u32)std::max<i64>(1, std::min<i64>((n + 1023) / 1024, 256));
        std::vector<float> partial(2 * blocks);
        emu::launch({blocks, 1, 1}, element_block,
                    [&] { unscale_partials(g, partial.data(), scalars.data(), n, arg(argv, 2)); });
        emu::launch({1, 1, 1}, {1, 1, 1},
                    [&] { unscale_finish(partial.data(), blocks, stats.data(), 0, 1); });
        std::vector<float> y(g, g + n);
        y.insert(y.end(), stats.begin(), stats.end());
        out = bits_of(y);
    } else if (k == "adamw" && argc == 5) {  // N COUNT DECAY < p g m v stats scalars(11)
        i64 n = arg(argv, 2);
        u32 count = arg(argv, 3);
        float *p = input.f(n), *g = input.f(n), *m = input.f(n), *v = input.f(n);
        float *stats = input.f(1 + 2 * count), *scalars = input.f(11);
        emu::launch(elementwise_grid(n), element_block,
                    [&] { adamw(p, g, m, v, stats, scalars, n, count, arg(argv, 4)); });
        std::vector<float> y(p, p + n);
        y.insert(y.end(), m, m + n);
        y.insert(y.end(), v, v + n);
        out = bits_of(y);
    } else if (k == "split_matmul" && argc == 9) {  // LEVELS M N K BATCH A_T B_T < a b > c
        u32 levels = arg(argv, 2), m = arg(argv, 3), n = arg(argv, 4), kk = arg(argv, 5),
            batch = arg(argv, 6);
        bool at = arg(argv, 7) != 0, bt = arg(argv, 8) != 0;
        float *a = input.f((size_t)batch * m * kk), *b = input.f((size_t)batch * kk * n);
        std::vector<float> c((size_t)batch * m * n, 0.0f);
        // The strides the backend passes (src/backend/cuda/matmul.rs, split_matmul).
        i64 a_row = at ? 1 : kk, a_col = at ? m : 1, b_row = bt ? 1 : n, b_col = bt ? kk : 1;
        i64 a_batch = (i64)m * kk, b_batch = (i64)kk * n;
        Dim3 grid = {(n + 63) / 64, (m + 63) / 64, batch};
        auto run = [&](auto kernel) {
            emu::launch(grid, {128, 1, 1}, [&] {
                kernel(a, b, c.data(), m, n, kk, a_row, a_col, a_batch, b_row, b_col, b_batch);
            });
        };
        if (levels == 2) run(x3::matmul_split_bf16_x3);
        else if (levels == 3) run(x6::matmul_split_bf16_x6);
        else if (levels == 5) run(x9::matmul_split_bf16_x9);
        else return false;
        out = bits_of(c);
    } else {
        return false;
    }
    return true;
}

// ---- attention.cu, launched as src/backend/cuda/train.rs does: a block of ATT_ROWS threads per
// (sequence x head, ATT_ROWS rows); the backward is dq (with delta), then dk, then dv ----

typedef void (*AttFwd)(const void*, void*, float*, AttentionArg);
typedef void (*AttBwdQ)(const void*, const float*, const float*, float*, float*, AttentionArg);
typedef void (*AttBwdK)(const void*, const float*, const float*, const float*, float*, AttentionArg);
typedef void (*AttBwdV)(const void*, const float*, const float*, float*, AttentionArg);
struct AttKernels {
    AttFwd fwd;
    AttBwdQ q;
    AttBwdK k;
    AttBwdV v;
};

#define ATT_KERNELS_OF(D) \
    case D: return {attention_fwd_##D, attention_bwd_q_##D, attention_bwd_k_##D, attention_bwd_v_##D};

static AttKernels attention_kernels(u32 d) {
    switch (d) {
        ATT_KERNELS_OF(16)
        ATT_KERNELS_OF(32)
        ATT_KERNELS_OF(64)
        default:
            std::fprintf(stderr, "no attention kernel for head size %u\n", d);
            std::exit(2);
    }
}

// attention_fwd B T H D SCALE INPUTS PROBS COMPUTE CODED QKV < qkv > out stats (CODED: out as
// 16-bit codes of COMPUTE, one to each output word; QKV: the format q|k|v is stored in, its
// codes one to each input word where it is not f32's)
// attention_bwd B T H D SCALE INPUTS PROBS COMPUTE CODED QKV < qkv dout stats > dqkv delta
static bool run_attention(const std::string& k, int argc, char** argv, std::vector<u32>& in,
                          std::vector<u32>& out) {
    if ((k != "attention_fwd" && k != "attention_bwd") || argc != 12) return false;
    u32 b = arg(argv, 2), t = arg(argv, 3), h = arg(argv, 4), d = arg(argv, 5);
    AttentionArg a{t,           h,           farg(argv, 6), arg(argv, 7),
                   arg(argv, 8), arg(argv, 9), arg(argv, 10), arg(argv, 11)};
    AttKernels f = attention_kernels(d);
    size_t rows = (size_t)b * h * t, n3 = rows * 3 * d, n1 = rows * d;
    Dim3 grid = {b * h, (t + ATT_ROWS - 1) / ATT_ROWS, 1}, block = {ATT_ROWS, 1, 1};
    Inputs input{in};
    u32* qkv_words = input.u(n3);
    std::vector<unsigned short> qkv_codes(qkv_words, qkv_words + n3);
    const void* qkv = a.qkv_stored == FMT_F32 ? (const void*)qkv_words : (const void*)qkv_codes.data();
    if (k == "attention_fwd") {
        std::vector<float> y(n1), st(2 * rows);
        std::vector<unsigned short> codes(n1);
        void* dst = a.coded ? (void*)codes.data() : (void*)y.data();
        emu::launch(grid, block, [&] { f.fwd(qkv, dst, st.data(), a); });
        out = a.coded ? std::vector<u32>(codes.begin(), codes.end()) : bits_of(y);
        std::vector<u32> stats = bits_of(st);
        out.insert(out.end(), stats.begin(), stats.end());
    } else {
        float *dout = input.f(n1), *st = input.f(2 * rows);
        // Poisoned, so that a third of dqkv left unwritten shows.
        std::vector<float> dqkv(n3, std::nanf("")), delta(rows);
        emu::launch(grid, block, [&] { f.q(qkv, dout, st, delta.data(), dqkv.data(), a); });
        emu::launch(grid, block, [&] { f.k(qkv, dout, st, delta.data(), dqkv.data(), a); });
        emu::launch(grid, block, [&] { f.v(qkv, dout, st, dqkv.data(), a); });
        dqkv.insert(dqkv.end(), delta.begin(), delta.end());
        out = bits_of(dqkv);
    }
    return true;
}

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
    } else if (k == "split_planes" && argc == 17) {
        // ROWS COLS BATCH SB SR SC OB OR OC OS SLOT_H SLOT_HF SLOT_M SLOT_L OUT_LEN
        u32 rows = arg(argv, 2), cols = arg(argv, 3), batch = arg(argv, 4);
        std::vector<u16> o16(arg(argv, 16), 0);
        split_planes(fin, o16.data(), (i64)batch * rows * cols, rows, cols, arg(argv, 5),
                     arg(argv, 6), arg(argv, 7), arg(argv, 8), arg(argv, 9), arg(argv, 10),
                     arg(argv, 11), arg(argv, 12), arg(argv, 13), arg(argv, 14), arg(argv, 15));
        out.assign(o16.begin(), o16.end());
    } else if (k == "quantize_to_f16" && argc == 8) {
        // FMT BATCH_LEN DIV MODULUS GROUPS_PER_BATCH GROUPS; the scales are the last GROUPS
        // values of the input.
        u32 groups = arg(argv, 7);
        n -= groups;
        std::vector<u16> o16(n);
        quantize_to_f16(fin, o16.data(), n, arg(argv, 2), fin + n, arg(argv, 3), arg(argv, 4),
                        arg(argv, 5), arg(argv, 6));
        out.assign(o16.begin(), o16.end());
    } else if (k == "quantize_to_fp8" && argc == 14) {
        // FMT BATCH_LEN DIV MODULUS GROUPS_PER_BATCH GROUPS ROWS COLS OB OR OC OUT_LEN; the
        // scales are the last GROUPS values of the input.
        u32 groups = arg(argv, 7);
        n -= groups;
        std::vector<u8> o8(arg(argv, 13), 0);
        quantize_to_fp8(fin, o8.data(), n, arg(argv, 2), fin + n, arg(argv, 3), arg(argv, 4),
                        arg(argv, 5), arg(argv, 6), arg(argv, 8), arg(argv, 9), arg(argv, 10),
                        arg(argv, 11), arg(argv, 12));
        out.assign(o8.begin(), o8.end());
    } else if (k == "amax" && argc == 7) {
        // BATCH_LEN DIV MODULUS GROUPS_PER_BATCH GROUPS
        out.assign(arg(argv, 6), 0u);
        emu::launch({2, 1, 1}, {16, 1, 1}, [&] {
            amax(fin, n, out.data(), arg(argv, 2), arg(argv, 3), arg(argv, 4), arg(argv, 5));
        });
    } else if (k == "unscale" && argc == 2) {
        // (acc, sa, sb) triples in; one result each, the rest of `out` zero.
        std::vector<u32> r(in.size(), 0u);
        for (i64 e = 0; e + 2 < n; e += 3)
            r[e / 3] = __float_as_uint(unscale(fin[e], fin[e + 1], fin[e + 2]));
        out = r;
    } else if (k == "scale_from_amax" && argc == 3) {
        std::vector<float> s(in.size());
        scale_from_amax(in.data(), s.data(), (u32)n, farg(argv, 2));
        std::memcpy(out.data(), s.data(), 4 * s.size());
    } else if (!run_train(k, argc, argv, in, out) && !run_attention(k, argc, argv, in, out)) {
        std::fprintf(stderr, "unknown kernel or arguments: %s\n", k.c_str());
        return 2;
    }
    write_all(out);
    return 0;
}
