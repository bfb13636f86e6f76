// Runs the kernels of cuda/ (cast.cu, scale.cu, train.cu, attention.cu, matmul_split_bf16.cu and
// formats.cuh under them) on the host, so that their numerics are checked against the host
// reference on machines without a GPU (tests/cuda.rs). CUDA's built-ins are defined here with
// the semantics the kernels rely on (IEEE float arithmetic, as NVRTC compiles them: no flush to
// zero, no contraction). The elementwise kernels run as one thread over every element; `launch`
// runs a grid block by block with every thread of a block a coroutine. A thread runs until it
// reaches __syncthreads, which it passes once every live thread of the block has reached one,
// or a warp instruction (a shuffle, or the emulated mma.sync, ldmatrix), which it passes once
// every live lane of its warp has reached one: block reductions, warp-wide tensor-core
// fragments and the warps of a block between barriers run as they may on a GPU (each warp as
// far ahead of the others as it may go, so that a missing barrier shows), and a barrier or
// warp instruction that not all of its threads reach stops the run (a deadlock on a GPU).
// cp.async copies wait in a queue until the thread's cp.async.wait_group takes them, so a tile
// read before its wait reads what was there before.
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
#define __launch_bounds__(n)
#define __align__(n) __attribute__((aligned(n)))
// Blocks run one after the other, so a block's shared memory can be a static.
#define __shared__ static
// The warp's tensor-core instructions (cuda/mma.cuh on a GPU) are the emulations below.
#define MANTISSA_HOST_MMA
struct Dim3 {
    unsigned x, y, z;
};
static Dim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0}, blockDim = {1, 1, 1},
            gridDim = {1, 1, 1};
// CUDA's vector types, aligned as on the device (the kernels' 16- and 8-byte accesses).
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
static inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}
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
struct alignas(8) uint2 {
    unsigned x, y;
};
static inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
// The device's is ex2.approx of x log2(e): within a few ulp, flushing subnormal results (a
// macro: the C library declares a function of that name).
#define __expf(x) std::exp((float)(x))
static inline unsigned atomicMax(unsigned* p, unsigned v) {
    unsigned old = *p;
    if (v > old) *p = v;
    return old;
}
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
    unsigned old = *p;
    *p = old + v;
    return old;
}
// Blocks run one after the other here: every write is seen by the blocks after.
static inline void __threadfence() {}
static inline float __ldcg(const float* p) { return *p; }
using std::min;

// The block emulator: one coroutine per thread of the running block.
namespace emu {
// Where a thread stopped: running (or runnable), at a warp instruction, at __syncthreads.
enum Wait { RUN, WARP, BARRIER };
struct Copy {
    void* dst;
    const void* src;  // null: zeros
    size_t bytes;
};
struct Thread {
#if defined(__x86_64__)
    void* sp;  // the saved stack pointer (switch_stack)
#else
    ucontext_t ctx;
#endif
    Dim3 idx;
    bool done;
    Wait wait;
    // Warp instructions passed: their parity picks the half of a stage buffer the next one uses.
    unsigned warp_ops;
    // cp.async: the copies issued since the last commit, and the committed groups, oldest first.
    std::vector<Copy> open;
    std::vector<std::vector<Copy>> groups;
};
static std::vector<Thread> threads;
static std::vector<std::vector<char>> stacks;
static size_t running;
static std::function<void()> body;

#if defined(__x86_64__)
// A switch of coroutines: the callee-saved registers pushed on the running stack, the stack
// pointer saved in *save and `to` taken (swapcontext also saves the signal mask: a system
// call a switch, which made the warp instructions' emulation take most of the tests' time).
extern "C" void emu_switch_stack(void** save, void* to);
asm(R"(
    .text
    .globl emu_switch_stack
    .type emu_switch_stack, @function
emu_switch_stack:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch_stack, .-emu_switch_stack
)");
static void* scheduler;
static void to_scheduler() { emu_switch_stack(&threads[running].sp, scheduler); }
static void to_thread(size_t t) { emu_switch_stack(&scheduler, threads[t].sp); }
#else
static ucontext_t scheduler;
static void to_scheduler() { swapcontext(&threads[running].ctx, &scheduler); }
static void to_thread(size_t t) { swapcontext(&scheduler, &threads[t].ctx); }
#endif

static void entry() {
    body();
    threads[running].done = true;
    to_scheduler();  // never resumed
    std::abort();
}

// A fresh coroutine for thread t, to run `entry` on stack `stack`.
static void start(size_t t, std::vector<char>& stack) {
#if defined(__x86_64__)
    // What emu_switch_stack pops: six registers, then `entry` as the return address, above it
    // a return address for `entry` (which never returns), 16-byte aligned as after a call.
    uintptr_t top = ((uintptr_t)stack.data() + stack.size()) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;
    *--sp = (void*)&entry;
    for (int r = 0; r < 6; r++) *--sp = nullptr;
    threads[t].sp = sp;
#else
    Thread& th = threads[t];
    getcontext(&th.ctx);
    th.ctx.uc_stack.ss_sp = stack.data();
    th.ctx.uc_stack.ss_size = stack.size();
    th.ctx.uc_link = nullptr;
    makecontext(&th.ctx, entry, 0);
#endif
}

// Back to the scheduler until the thread may go on past `w`.
static void stop_at(Wait w) {
    threads[running].wait = w;
    to_scheduler();
}

// Every live lane of the calling thread's warp at a warp instruction. Returns the half of a
// stage buffer this instruction uses: a lane may stage the next instruction's operands before
// the others have read this one's, but not the one after (every lane must reach the next
// first), so two halves, alternating, suffice.
static unsigned warp_sync() {
    unsigned half = threads[running].warp_ops++ % 2;
    stop_at(WARP);
    return half;
}

// The half of the stage buffers the calling thread's next warp instruction uses.
static unsigned stage_half() { return threads[running].warp_ops % 2; }

static unsigned flat_thread() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

static void fail(const char* why) {
    std::fprintf(stderr, "block (%u, %u, %u): %s\n", blockIdx.x, blockIdx.y, blockIdx.z, why);
    std::exit(3);
}

// Lets the lanes of warp w (threads [w, w + 32)) that wait at a warp instruction go on, once
// every live lane of it is there.
static void release_warp(size_t w) {
    size_t end = std::min(threads.size(), w + 32);
    for (size_t t = w; t < end; t++)
        if (!threads[t].done && threads[t].wait != WARP) return;
    for (size_t t = w; t < end; t++) threads[t].wait = RUN;
}

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
                    th.wait = RUN;
                    th.warp_ops = 0;
                    start(t, stacks[t]);
                }
                // Each warp in turn runs as far as it can (its lanes in step, warp instruction
                // by warp instruction) before the next starts: the warps of a block drift
                // apart between barriers as far as they may, so that one reading what another
                // writes without a barrier between reads it unwritten. The order reverses at
                // each barrier.
                bool ascending = true;
                for (;;) {
                    for (size_t k = 0; k < count; k += 32) {
                        size_t w = ascending ? k : (count - 1) / 32 * 32 - k;
                        for (bool ran = true; ran;) {
                            ran = false;
                            for (size_t t = w; t < std::min(count, w + 32); t++) {
                                if (threads[t].done || threads[t].wait != RUN) continue;
                                running = t;
                                threadIdx = threads[t].idx;
                                to_thread(t);
                                ran = true;
                                if (threads[t].done && !(threads[t].open.empty() && threads[t].groups.empty()))
                                    fail("a thread ended with cp.async copies it never waited for");
                            }
                            release_warp(w);
                        }
                    }
                    size_t live = 0, at_barrier = 0;
                    for (auto& th : threads) {
                        live += !th.done;
                        at_barrier += !th.done && th.wait == BARRIER;
                    }
                    if (live == 0) break;
                    if (at_barrier != live)
                        fail("threads wait at a barrier or warp instruction that the others of their block or warp never reach");
                    for (auto& th : threads) th.wait = RUN;
                    ascending = !ascending;
                }
            }
    blockIdx = {0, 0, 0};
    threadIdx = {0, 0, 0};
    blockDim = gridDim = {1, 1, 1};
}
}  // namespace emu

static inline void __syncthreads() { emu::stop_at(emu::BARRIER); }

// Every lane of the warp takes part (the kernels call shuffles in warp-uniform code).
static float shfl_stage[2][1024];
static inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    unsigned t = emu::flat_thread(), half = emu::stage_half();
    shfl_stage[half][t] = v;
    emu::warp_sync();
    return shfl_stage[half][t ^ (unsigned)lane_mask];
}

#include "../../cuda/formats.cuh"

// ---- The warp's tensor-core instructions (cuda/mma.cuh), emulated from the PTX ISA ----

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 for the calling warp. Every
// lane stages its fragments; once the warp is there, each lane rebuilds the rows of A (16x16)
// and the columns of B (16x8) it needs from them with the PTX ISA's fragment layouts (groupID
// = lane >> 2, t = lane % 4; a register holds two elements, the lower-indexed one in its low
// half) and computes its own four elements of D:
//   A: reg 0 (row g, cols 2t, 2t+1), reg 1 (row g+8, same cols), reg 2 (row g, cols 2t+8, +9),
//      reg 3 (row g+8, cols 2t+8, +9)
//   B: reg 0 (rows 2t, 2t+1, col g), reg 1 (rows 2t+8, 2t+9, col g)
//   C, D: c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, same cols)
// Products of 16-bit values are exact in f32; they are added to C in k order in f32 (the
// hardware's order is its own: the tests allow for that).
static u32 mma_stage_a[2][32][32][4], mma_stage_b[2][32][32][2];

static float half_of(u32 reg, u32 upper, u32 fmt) {
    return __uint_as_float(decode_format(upper ? reg >> 16 : reg & 0xffffu, fmt));
}

static void mma_16(float* c, const u32* a, const u32* b, u32 fmt) {
    unsigned t = emu::flat_thread(), warp = t / 32, lane = t % 32, half = emu::stage_half();
    for (int i = 0; i < 4; i++) mma_stage_a[half][warp][lane][i] = a[i];
    for (int i = 0; i < 2; i++) mma_stage_b[half][warp][lane][i] = b[i];
    emu::warp_sync();
    u32 g = lane >> 2, q = lane & 3u;
    // A[r][k] for this lane's rows g and g + 8, B[k][n] for its columns 2q and 2q + 1.
    float A[2][16], B[16][2];
    for (u32 l = 0; l < 32; l++) {
        u32 lg = l >> 2, lq = l & 3u;
        const u32* ra = mma_stage_a[half][warp][l];
        const u32* rb = mma_stage_b[half][warp][l];
        for (u32 h = 0; h < 2; h++) {
            if (lg == g) {
                A[0][2 * lq + h] = half_of(ra[0], h, fmt);
                A[1][2 * lq + h] = half_of(ra[1], h, fmt);
                A[0][2 * lq + 8 + h] = half_of(ra[2], h, fmt);
                A[1][2 * lq + 8 + h] = half_of(ra[3], h, fmt);
            }
            if (lg == 2 * q || lg == 2 * q + 1) {
                B[2 * lq + h][lg - 2 * q] = half_of(rb[0], h, fmt);
                B[2 * lq + 8 + h][lg - 2 * q] = half_of(rb[1], h, fmt);
            }
        }
    }
    for (u32 e = 0; e < 4; e++) {
        float sum = c[e];
        for (u32 k = 0; k < 16; k++) sum += A[e / 2][k] * B[k][e & 1u];
        c[e] = sum;
    }
}

static void mma_bf16(float* c, const u32* a, const u32* b) { mma_16(c, a, b, FMT_BF16); }
static void mma_f16(float* c, const u32* a, const u32* b) { mma_16(c, a, b, FMT_F16); }
static void mma16(float* c, const u32* a, u32 b0, u32 b1, bool f16) {
    u32 b[2] = {b0, b1};
    mma_16(c, a, b, f16 ? FMT_F16 : FMT_BF16);
}

// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16: lane 8 i + r gives the address of row r
// (8 16-bit values) of matrix i; register i of lane l receives row l / 4, elements 2 (l % 4)
// and + 1 of matrix i, or with .trans, of its transpose (column l / 4, rows 2 (l % 4), + 1).
static const u16* ldsm_stage[2][32][32];

static void ldsm_emulated(u32* r, const u16* row, bool trans) {
    unsigned t = emu::flat_thread(), warp = t / 32, lane = t % 32, half = emu::stage_half();
    ldsm_stage[half][warp][lane] = row;
    emu::warp_sync();
    u32 a = lane / 4, b = 2 * (lane % 4);
    for (u32 i = 0; i < 4; i++) {
        const u16* const* m = ldsm_stage[half][warp] + 8 * i;
        u32 lo = trans ? m[b][a] : m[a][b], hi = trans ? m[b + 1][a] : m[a][b + 1];
        r[i] = lo | hi << 16;
    }
    // Every lane reads before any goes on (and may write what the warp read), as the warp's
    // one instruction does.
    emu::warp_sync();
}

static void ldsm_x4(u32* r, const u16* row) { ldsm_emulated(r, row, false); }
static void ldsm_x4_t(u32* r, const u16* row) { ldsm_emulated(r, row, true); }

// cp.async.cg.shared.global of 16 bytes (zeros where `valid` is false), commit_group and
// wait_group N: the copies land when the thread waits for them.
static void cp_async16(void* dst, const void* src, bool valid) {
    emu::threads[emu::running].open.push_back({dst, valid ? src : nullptr, 16});
}
static void cp_async_commit() {
    auto& th = emu::threads[emu::running];
    th.groups.push_back(std::move(th.open));
    th.open.clear();
}
template <int N>
static void cp_async_wait() {
    auto& th = emu::threads[emu::running];
    while (th.groups.size() > (size_t)N) {
        for (const emu::Copy& c : th.groups.front()) {
            if (c.src) std::memcpy(c.dst, c.src, c.bytes);
            else std::memset(c.dst, 0, c.bytes);
        }
        th.groups.erase(th.groups.begin());
    }
}

// The 16-bit conversions (cvt.rn: round to nearest even, overflow to inf) are formats.cuh's.
static u32 code16(float x, u32 fmt) { return encode_format(__float_as_uint(x), fmt, false); }
static float value16(u32 code, u32 fmt) { return __uint_as_float(decode_format(code, fmt)); }
// Of a value held in the format already (the kernels pass no other): the same code.
static u32 code_of_held(float x, u32 fmt) {
    if (value16(code16(x, fmt), fmt) != x && x == x) emu::fail("code_of_held of a value not held in its format");
    return code16(x, fmt);
}

#include "../../cuda/cast.cu"
// A span that is not a multiple of the block or of a row, so that spans start mid-group and
// the grid-stride loop over spans runs (the launch below: 2 blocks of 16).
#define AMAX_SPAN 40
#include "../../cuda/scale.cu"
#include "../../cuda/train.cu"
#include "../../cuda/attention.cu"

// ---- matmul_split_bf16.cu, on the emulated mma.sync ----

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

static i64 arg64(char** argv, int i) { return (i64)std::strtoll(argv[i], nullptr, 10); }

// Runs a conversion kernel, kernel(x, out), over a grid of 3 blocks of 32 threads (so that the
// grid-stride loops and the tails take several turns) on `in` and an output of `out_len` Ts,
// then again on copies of both one element off their alignment (the one-at-a-time path);
// exits with an error where the two differ.
template <typename T, typename F>
static std::vector<u32> both_alignments(const std::vector<u32>& in, size_t out_len, F kernel) {
    std::vector<T> plain(out_len + 1, 0), shifted_out(out_len + 1, 0);
    std::vector<u32> shifted_in(in.size() + 1);
    std::copy(in.begin(), in.end(), shifted_in.begin() + 1);
    emu::launch({3, 1, 1}, {32, 1, 1}, [&] { kernel(in.data(), plain.data()); });
    emu::launch({3, 1, 1}, {32, 1, 1}, [&] { kernel(shifted_in.data() + 1, shifted_out.data() + 1); });
    if (!std::equal(plain.begin(), plain.begin() + out_len, shifted_out.begin() + 1)) {
        std::fprintf(stderr, "aligned and unaligned buffers give different results\n");
        std::exit(3);
    }
    return std::vector<u32>(plain.begin(), plain.begin() + out_len);
}

// Reads one SplitOperand from argv[i..i+12): ROWS COLS SB SR SC OB OR OS SLOT_H SLOT_HF
// SLOT_M SLOT_L (the batches and the buffers are the caller's).
static SplitOperand split_operand(char** argv, int i, u32 batches) {
    SplitOperand o;
    o.rows = arg(argv, i);
    o.cols = arg(argv, i + 1);
    o.sb = arg64(argv, i + 2);
    o.sr = arg64(argv, i + 3);
    o.sc = arg64(argv, i + 4);
    o.ob = arg64(argv, i + 5);
    o.orow = arg64(argv, i + 6);
    o.os = arg64(argv, i + 7);
    for (int p = 0; p < 4; p++) o.slots[p] = arg(argv, i + 8 + p);
    o.batches = batches;
    return o;
}

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

// `n` floats in 16-byte-aligned memory (the kernels' 16-byte accesses need it): zeros, or a
// copy of `from`.
struct Aligned {
    std::vector<float4> v;
    explicit Aligned(size_t n) : v((n + 3) / 4, float4{0, 0, 0, 0}) {}
    Aligned(const float* from, size_t n) : Aligned(n) { std::memcpy(v.data(), from, 4 * n); }
    float* f() { return (float*)v.data(); }
};

// The zeros a column reduction's blocks count themselves in with, checked back at zero after.
struct Counters {
    std::vector<u32> v;
    explicit Counters(u32 c) : v((c + 31) / 32, 0u) {}
    u32* p() { return v.data(); }
    ~Counters() {
        for (u32 n : v)
            if (n != 0u) {
                std::fprintf(stderr, "a column reduction left its counter at %u\n", n);
                std::exit(3);
            }
    }
};

static void column_sums_of(const float* x, float* out, u32 rows, u32 c, u32 x_fmt, u32 fmt) {
    u32 chunks = std::max(1u, (rows + CHUNK_ROWS - 1) / CHUNK_ROWS);
    std::vector<float> partial((size_t)chunks * c);
    Counters counters(c);
    emu::launch({(c + 31) / 32, chunks, 1}, {32, 8, 1},
                [&] { column_sums(x, partial.data(), out, counters.p(), rows, c, x_fmt, fmt); });
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
    } else if (k == "layernorm_bwd" && argc == 7) {
        // ROWS C DYFMT SUM SUMFMT < dy x g stats [r] > dx dg db; SUM 1: dx + r held in SUMFMT.
        u32 rows = arg(argv, 2), c = arg(argv, 3), dy_fmt = arg(argv, 4), summed = arg(argv, 5);
        u32 sum_fmt = arg(argv, 6);
        size_t n = (size_t)rows * c;
        float *dy = input.f(n), *x = input.f(n), *g = input.f(c), *st = input.f(2 * rows);
        float* r = summed ? input.f(n) : nullptr;
        std::vector<float> dx(n), dg(c), db(c);
        emu::launch({rows, 1, 1}, row_block,
                    [&] { layernorm_bwd_x(dy, x, g, st, dx.data(), c, dy_fmt, r, sum_fmt); });
        u32 chunks = std::max(1u, (rows + CHUNK_ROWS - 1) / CHUNK_ROWS);
        std::vector<float> partial(2 * (size_t)chunks * c);
        Counters counters(c);
        emu::launch({(c + 31) / 32, chunks, 1}, {32, 8, 1}, [&] {
            layernorm_bwd_columns(dy, x, st, partial.data(), dg.data(), db.data(), counters.p(),
                                  rows, c, dy_fmt);
        });
        dx.insert(dx.end(), dg.begin(), dg.end());
        dx.insert(dx.end(), db.begin(), db.end());
        out = bits_of(dx);
    } else if (k == "rmsnorm_fwd" && argc == 8) {  // ROWS C EPS FMT CODED WIDTH < x g > y rstd
        // CODED: y as 16-bit codes, one to each output word; WIDTH 4: 16-byte accesses.
        u32 rows = arg(argv, 2), c = arg(argv, 3), fmt = arg(argv, 5), coded = arg(argv, 6);
        u32 width = arg(argv, 7);
        float eps = farg(argv, 4);
        size_t n = (size_t)rows * c;
        Aligned x(input.f(n), n), g(input.f(c), c), y(n);
        std::vector<float> rstd(rows);
        std::vector<unsigned short> codes(n);
        void* dst = coded ? (void*)codes.data() : (void*)y.f();
        emu::launch({rows, 1, 1}, row_block,
                    [&] { rmsnorm_fwd(x.f(), g.f(), dst, rstd.data(), c, eps, fmt, coded, width); });
        out = coded ? std::vector<u32>(codes.begin(), codes.end())
                    : bits_of(std::vector<float>(y.f(), y.f() + n));
        std::vector<u32> r = bits_of(rstd);
        out.insert(out.end(), r.begin(), r.end());
    } else if (k == "rmsnorm_bwd" && argc == 6) {  // ROWS C WIDTH DYFMT < dy x g rstd > dx dg
        u32 rows = arg(argv, 2), c = arg(argv, 3), width = arg(argv, 4), dy_fmt = arg(argv, 5);
        size_t n = (size_t)rows * c;
        Aligned dy(input.f(n), n), x(input.f(n), n), g(input.f(c), c), dx(n);
        float* rstd = input.f(rows);
        emu::launch({rows, 1, 1}, row_block,
                    [&] { rmsnorm_bwd_x(dy.f(), x.f(), g.f(), rstd, dx.f(), c, width, dy_fmt); });
        u32 chunks = std::max(1u, (rows + CHUNK_ROWS - 1) / CHUNK_ROWS);
        std::vector<float> partial((size_t)chunks * c), dg(c);
        Counters counters(c);
        emu::launch({(c + 31) / 32, chunks, 1}, {32, 8, 1}, [&] {
            rmsnorm_bwd_columns(dy.f(), x.f(), rstd, partial.data(), dg.data(), counters.p(), rows,
                                c, dy_fmt);
        });
        std::vector<float> both(dx.f(), dx.f() + n);
        both.insert(both.end(), dg.begin(), dg.end());
        out = bits_of(both);
    } else if (k == "dropout" && argc >= 9 && argc <= 11) {
        // N P STEP SITE KEYLO KEYHI FMT [EVAL [PART]] < x > out: the mask of step STEP (in the
        // scalars) for part PART of the batch, or none where EVAL is 1 (an evaluating run).
        i64 n = arg(argv, 2);
        float p = farg(argv, 3);
        u32 site = arg(argv, 5), k0 = arg(argv, 6), k1 = arg(argv, 7), fmt = arg(argv, 8);
        float* x = input.f(n);
        std::vector<float> y(n), scalars(16, 0.0f);
        scalars[S_STEP] = farg(argv, 4);
        scalars[S_EVAL] = argc >= 10 ? farg(argv, 9) : 0.0f;
        scalars[S_PART] = argc == 11 ? farg(argv, 10) : 0.0f;
        float scale = (float)(1.0 / (1.0 - (double)p));
        emu::launch(elementwise_grid(n), element_block, [&] {
            dropout(x, y.data(), scalars.data(), n, p, scale, site, k0, k1, fmt);
        });
        out = bits_of(y);
    } else if (k == "rotary" && argc == 8) {
        // ROWS T C D INVERSE FMT < x table > out (table: T x D/2 (cos, sin) pairs)
        u32 rows = arg(argv, 2), t = arg(argv, 3), c = arg(argv, 4), d = arg(argv, 5);
        u32 inverse = arg(argv, 6), fmt = arg(argv, 7);
        i64 n = (i64)rows * c;
        float* x = input.f(n);
        float* table = input.f((size_t)t * d);
        std::vector<float> y(n);
        emu::launch(elementwise_grid(n), element_block,
                    [&] { rotary(x, table, y.data(), n, c, d, t, inverse, fmt); });
        out = bits_of(y);
    } else if (k == "row_sums" && argc == 6) {  // ROWS C DIVISOR FMT < x > sums
        u32 rows = arg(argv, 2), c = arg(argv, 3), fmt = arg(argv, 5);
        float divisor = farg(argv, 4);
        float* x = input.f((size_t)rows * c);
        std::vector<float> y(rows);
        emu::launch({rows, 1, 1}, row_block, [&] { row_sums(x, y.data(), c, divisor, fmt); });
        out = bits_of(y);
    } else if (k == "broadcast" && argc == 7) {  // N C SCALE DIVISOR FMT < x (N / C) > out (N)
        i64 n = arg(argv, 2);
        u32 c = arg(argv, 3), fmt = arg(argv, 6);
        float scale = farg(argv, 4), divisor = farg(argv, 5);
        float* x = input.f(n / c);
        std::vector<float> y(n);
        emu::launch(elementwise_grid(n), element_block,
                    [&] { broadcast(x, y.data(), n, c, scale, divisor, fmt); });
        out = bits_of(y);
    } else if (k == "elementwise_mul" && argc == 5) {  // N FMT CODED < a b > out (codes one a word)
        i64 n = arg(argv, 2);
        u32 fmt = arg(argv, 3), coded = arg(argv, 4);
        float *a = input.f(n), *b = input.f(n);
        std::vector<float> y(n);
        std::vector<unsigned short> codes(n);
        void* dst = coded ? (void*)codes.data() : (void*)y.data();
        emu::launch(elementwise_grid(n), element_block,
                    [&] { elementwise_mul(a, b, dst, n, fmt, coded); });
        out = coded ? std::vector<u32>(codes.begin(), codes.end()) : bits_of(y);
    } else if (k == "mse_fwd" && argc == 5) {  // N S_DLOSS FMT < pred target > grad mean
        i64 n = arg(argv, 2);
        u32 fmt = arg(argv, 4);
        float *pred = input.f(n), *target = input.f(n);
        std::vector<float> grad(n), squares(n), stats(2), scalars(16, 0.0f);
        scalars[S_DLOSS] = farg(argv, 3);
        emu::launch(elementwise_grid(n), element_block, [&] {
            mse_fwd(pred, target, grad.data(), squares.data(), scalars.data(), n, fmt);
        });
        emu::launch({1, 1, 1}, {256, 1, 1},
                    [&] { mean_to_stat(squares.data(), stats.data(), (u32)n, 1); });
        grad.push_back(stats[1]);
        out = bits_of(grad);
    } else if (k == "column_sums" && argc == 6) {
        // ROWS C XFMT FMT < x > sums of x held in XFMT, held in FMT
        u32 rows = arg(argv, 2), c = arg(argv, 3), x_fmt = arg(argv, 4), fmt = arg(argv, 5);
        float* x = input.f((size_t)rows * c);
        std::vector<float> sums(c);
        column_sums_of(x, sums.data(), rows, c, x_fmt, fmt);
        out = bits_of(sums);
    } else if (k == "sum_partials" && argc == 4) {  // CHUNKS C < partial > sums
        u32 chunks = arg(argv, 2), c = arg(argv, 3);
        float* partial = input.f((size_t)chunks * c);
        std::vector<float> sums(c);
        emu::launch(elementwise_grid(c), element_block,
                    [&] { sum_partials(partial, sums.data(), chunks, c); });
        out = bits_of(sums);
    } else if ((k == "unary_fwd" || k == "unary_bwd") && argc == 7) {
        // unary_fwd F N FMT CODED XFMT < x > y; unary_bwd F N FMT XFMT DYFMT < x dy > dx (held
        // in FMT, dy rounded to DYFMT as it is read); F the function's id (`Unary::id`).
        // Codes travel one to each word: x where XFMT is not f32's (a coded input), y where
        // CODED.
        u32 f = arg(argv, 2);
        i64 n = arg(argv, 3);
        u32 x_fmt = arg(argv, k == "unary_fwd" ? 6 : 5);
        u32* words = input.u(n);
        std::vector<unsigned short> x_codes(words, words + n);
        const void* x = x_fmt == FMT_F32 ? (const void*)words : (const void*)x_codes.data();
        std::vector<float> y(n);
        if (k == "unary_fwd") {
            u32 fmt = arg(argv, 4), coded = arg(argv, 5);
            std::vector<unsigned short> codes(n);
            void* dst = coded ? (void*)codes.data() : (void*)y.data();
            emu::launch(elementwise_grid(n), element_block,
                        [&] { unary_fwd(x, dst, n, fmt, coded, x_fmt, f); });
            if (coded) {
                out = std::vector<u32>(codes.begin(), codes.end());
                return true;
            }
        } else {
            float* dy = input.f(n);
            u32 fmt = arg(argv, 4), dy_fmt = arg(argv, 6);
            emu::launch(elementwise_grid(n), element_block,
                        [&] { unary_bwd(x, dy, y.data(), n, fmt, x_fmt, dy_fmt, f); });
        }
        out = bits_of(y);
    } else if ((k == "softmax_fwd" || k == "softmax_bwd") && (argc == 7 || argc == 8 || argc == 12)) {
        // ROWS T SCALE FMT READFMT [CAUSAL [KIND BLOCK STRIDE PERIOD]] (the scores, or dp,
        // rounded to READFMT as they are read; causal unless CAUSAL is 0; KIND 1 (keys) or 2
        // (bias): the forward reads a mask after the scores, of as many rows of T as its layout
        // has the rows read)
        u32 rows = arg(argv, 2), t = arg(argv, 3), fmt = arg(argv, 5), read_fmt = arg(argv, 6);
        u32 causal = argc >= 8 ? arg(argv, 7) : 1;
        u32 kind = argc == 12 ? arg(argv, 8) : 0, block = argc == 12 ? arg(argv, 9) : 1,
            stride = argc == 12 ? arg(argv, 10) : 0, period = argc == 12 ? arg(argv, 11) : 1;
        float scale = farg(argv, 4);
        size_t n = (size_t)rows * t;
        float* x = input.f(n);
        std::vector<float> y(n);
        if (k == "softmax_fwd") {
            size_t mask_rows = (size_t)(rows / block - 1) * stride + period;
            float* mask = kind ? input.f(mask_rows * t) : nullptr;
            emu::launch({rows, 1, 1}, row_block, [&] {
                softmax_fwd(x, y.data(), t, scale, fmt, read_fmt, causal, mask, kind, block,
                            stride, period);
            });
        } else {
            float* dp = input.f(n);
            emu::launch({rows, 1, 1}, row_block,
                        [&] { softmax_bwd(x, dp, y.data(), t, scale, fmt, read_fmt, causal); });
        }
        out = bits_of(y);
    } else if (k == "cross_entropy_fwd" && (argc == 4 || argc == 6 || argc == 7)) {
        // ROWS V [S_DLOSS_PER_ROW FMT [CODED]] < logits targets > probs (or, given the scalar,
        // the gradient held in FMT; with CODED 1, its 16-bit codes, one to a word) mean
        u32 rows = arg(argv, 2), v = arg(argv, 3);
        u32 grad = argc >= 6, fmt = grad ? arg(argv, 5) : 0, coded = argc == 7 ? arg(argv, 6) : 0;
        float* logits = input.f((size_t)rows * v);
        u32* targets = input.u(rows);
        std::vector<float> y((size_t)rows * v), losses(rows), stats(2), scalars(16, 0.0f);
        std::vector<uint16_t> codes((size_t)rows * v);
        if (grad) scalars[S_DLOSS_PER_ROW] = farg(argv, 4);
        void* dst = coded ? (void*)codes.data() : (void*)y.data();
        emu::launch({rows, 1, 1}, row_block, [&] {
            cross_entropy_fwd(logits, targets, dst, losses.data(), scalars.data(), v, grad, fmt,
                              coded);
        });
        emu::launch({1, 1, 1}, {256, 1, 1}, [&] { mean_to_stat(losses.data(), stats.data(), rows, 1); });
        if (coded)
            for (size_t e = 0; e < codes.size(); e++) {
                u32 word = codes[e];
                memcpy(&y[e], &word, 4);
            }
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
    } else if (k == "embedding_bwd" && argc == 6) {  // ROWS C TOKENS WIDTH < dout ids
        // The launcher's two launches (src/backend/cuda/train.rs), each thread of the sum
        // WIDTH columns (4: 16-byte loads, c a multiple of 4).
        u32 rows = arg(argv, 2), c = arg(argv, 3), tokens = arg(argv, 4), width = arg(argv, 5);
        std::vector<float4> aligned(((size_t)tokens * c + 3) / 4);
        std::memcpy(aligned.data(), input.f((size_t)tokens * c), (size_t)tokens * c * 4);
        const float* dout = (const float*)aligned.data();
        u32* ids = input.u(tokens);
        std::vector<u32> counts((size_t)rows * SORT_THREADS), offsets(rows + 1), sorted(tokens);
        std::vector<float> y((size_t)rows * c);
        emu::launch({1, 1, 1}, {SORT_THREADS, 1, 1}, [&] {
            embedding_sort(ids, counts.data(), offsets.data(), sorted.data(), rows, tokens);
        });
        u32 spans = ((c + width - 1) / width + 31) / 32;
        emu::launch({rows, spans, 1}, {32, 1, 1}, [&] {
            embedding_sum(dout, offsets.data(), sorted.data(), y.data(), c, width);
        });
        out = bits_of(y);
    } else if (k == "add" && argc == 13) {
        // N C YFMT FMT CODED RFMT HAS_R HAS_G GFMT GCODED XFMT < x(c) y(n) [r(n)] > y held in
        // YFMT, plus x held in XFMT, held in FMT; then with HAS_R plus r held in RFMT (its codes,
        // one to each word, where CODED: written to a separate output, as a plan's coded bias
        // add does; else in place); then with HAS_G, the GELU of that, held in GFMT (codes where
        // GCODED)
        i64 n = arg(argv, 2);
        u32 c = arg(argv, 3), y_fmt = arg(argv, 4), fmt = arg(argv, 5), coded = arg(argv, 6);
        u32 r_fmt = arg(argv, 7), has_r = arg(argv, 8);
        u32 has_g = arg(argv, 9), g_fmt = arg(argv, 10), g_coded = arg(argv, 11);
        u32 x_fmt = arg(argv, 12);
        float *x = input.f(c), *y = input.f(n);
        const float* r = has_r ? input.f(n) : nullptr;
        std::vector<unsigned short> codes(n), g_codes(n);
        std::vector<float> g_values(n);
        void* dst = coded ? (void*)codes.data() : (void*)y;
        void* g = !has_g ? nullptr : g_coded ? (void*)g_codes.data() : (void*)g_values.data();
        emu::launch(elementwise_grid(n), element_block, [&] {
            add(x, y, dst, n, c, y_fmt, x_fmt, fmt, coded, r, r_fmt, g, g_fmt, g_coded);
        });
        out = coded ? std::vector<u32>(codes.begin(), codes.end()) : bits_of(std::vector<float>(y, y + n));
        if (has_g) {
            std::vector<u32> g_out = g_coded ? std::vector<u32>(g_codes.begin(), g_codes.end()) : bits_of(g_values);
            out.insert(out.end(), g_out.begin(), g_out.end());
        }
    } else if (k == "strided_copy" && argc == 18) {
        // DIMS*4 SRC*4 DST*4 SRC_OFF DST_OFF OUT_LEN FMT (the values rounded to FMT)
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
        u32 fmt = arg(argv, 17);
        emu::launch(elementwise_grid(n), element_block,
                    [&] { strided_copy(x, y.data(), n, map, fmt); });
        out = bits_of(y);
    } else if (k == "unscale" && argc >= 5) {  // S_INVERSE_SCALE S_POISON LEN... < g... > g... flags norms
        std::vector<float> scalars(16, 0.0f);
        scalars[S_INVERSE_SCALE] = farg(argv, 2);
        scalars[S_POISON] = farg(argv, 3);
        // The backend's table (TensorTable::unscale): per tensor, up to 256 blocks of 256, at
        // least 1024 elements each.
        std::vector<TensorBlocks> table;
        std::vector<float> y;
        u32 blocks = 0;
        for (int i = 4; i < argc; i++) {
            i64 n = arg64(argv, i);
            u32 b = (u32)std::max<i64>(1, std::min<i64>((n + 1023) / 1024, 256));
            table.push_back({{input.f(n), nullptr, nullptr, nullptr}, n, blocks, b, 0u, 0u});
            blocks += b;
        }
        u32 count = (u32)table.size();
        std::vector<float> partial(2 * blocks), stats(2 * count);
        emu::launch({blocks, 1, 1}, element_block,
                    [&] { unscale_partials(table.data(), count, partial.data(), scalars.data()); });
        emu::launch({(count + 255) / 256, 1, 1}, element_block, [&] {
            unscale_finish(table.data(), count, partial.data(), stats.data(), 0, count);
        });
        for (const TensorBlocks& t : table) y.insert(y.end(), t.x[0], t.x[0] + t.n);
        y.insert(y.end(), stats.begin(), stats.end());
        out = bits_of(y);
    } else if (k == "adamw" && argc >= 6 && argc % 2 == 0) {  // COUNT FMT (LEN DECAY)... < (p g m v)... stats scalars(11) > (p m v)...
        u32 count = arg(argv, 2), fmt = arg(argv, 3);
        // The backend's table (TensorTable::adamw): a block per ADAMW_CHUNK values.
        std::vector<TensorBlocks> table;
        u32 blocks = 0;
        for (int i = 4; i + 1 < argc; i += 2) {
            i64 n = arg64(argv, i);
            u32 b = (u32)((n + ADAMW_CHUNK - 1) / ADAMW_CHUNK);
            float *p = input.f(n), *g = input.f(n), *m = input.f(n), *v = input.f(n);
            table.push_back({{p, g, m, v}, n, blocks, b, arg(argv, i + 1), 0u});
            blocks += b;
        }
        float *stats = input.f(1 + 2 * count), *scalars = input.f(11);
        u32 tensors = (u32)table.size();
        emu::launch({blocks, 1, 1}, element_block,
                    [&] { adamw(table.data(), tensors, stats, scalars, count, fmt); });
        std::vector<float> y;
        for (const TensorBlocks& t : table)
            for (int j : {0, 2, 3}) y.insert(y.end(), t.x[j], t.x[j] + t.n);
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

// ---- attention.cu, launched as src/backend/cuda/train.rs does ----
// 16-bit inputs (bf16, f16), with P and the products held in f32, bf16 or f16, on the
// tensor-core kernels: the forward and delta kernels a block of
// 256 threads per (sequence x head, TC_ROWS rows); the dk/dv kernel a block of 128 per
// (sequence x head, split), min(ceil(T / TC_KEYS), 4) splits; the dq kernel elementwise over
// the rows' groups of 4 values. Otherwise the SIMT kernels: a block of ATT_ROWS threads per
// (sequence x head, ATT_ROWS rows), the backward dq (with delta), then dk, then dv.

typedef void (*AttFwd)(const void*, void*, float*, AttentionArg);
typedef void (*AttBwdQ)(const void*, const float*, const float*, float*, float*, AttentionArg);
typedef void (*AttBwdK)(const void*, const float*, const float*, const float*, float*, AttentionArg);
typedef void (*AttBwdV)(const void*, const float*, const float*, float*, AttentionArg);
typedef void (*AttMmaDelta)(const void*, const float*, const float*, float*, u16*, AttentionArg);
typedef void (*AttMmaKv)(const void*, const u16*, const float*, const float*, float*, float*, AttentionArg);
typedef void (*AttMmaDq)(const float*, float*, u32, u32, AttentionArg);
struct AttKernels {
    AttFwd fwd;
    AttBwdQ q;
    AttBwdK k;
    AttBwdV v;
    AttFwd mma_fwd;
    AttMmaDelta mma_delta;
    AttMmaKv mma_kv;
    AttMmaDq mma_dq;
};

#define ATT_KERNELS_OF(D)                                                                        \
    case D:                                                                                      \
        return {attention_fwd_##D,     attention_bwd_q_##D,     attention_bwd_k_##D,            \
                attention_bwd_v_##D,   attention_mma_fwd_##D,   attention_mma_delta_##D,        \
                attention_mma_kv_##D,  attention_mma_dq_##D};

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
// attention_bwd B T H D SCALE INPUTS PROBS COMPUTE CODED QKV [POISON] < qkv dout stats > dqkv
// delta (POISON: what dqkv, delta, dq's partials and the dO codes hold before the kernels run,
// NaN unless given, so that a value left unwritten or a partial read before it is written
// shows)
static bool run_attention(const std::string& k, int argc, char** argv, std::vector<u32>& in,
                          std::vector<u32>& out) {
    if (!(k == "attention_fwd" && argc == 12) && !(k == "attention_bwd" && (argc == 12 || argc == 13)))
        return false;
    u32 b = arg(argv, 2), t = arg(argv, 3), h = arg(argv, 4), d = arg(argv, 5);
    AttentionArg a{t,           h,           farg(argv, 6), arg(argv, 7),
                   arg(argv, 8), arg(argv, 9), arg(argv, 10), arg(argv, 11)};
    AttKernels f = attention_kernels(d);
    auto held16_knows = [](u32 f) { return f == FMT_F32 || f == FMT_BF16 || f == FMT_F16; };
    bool mma = (a.inputs == FMT_BF16 || a.inputs == FMT_F16) && held16_knows(a.probs) && held16_knows(a.compute);
    size_t rows = (size_t)b * h * t, n3 = rows * 3 * d, n1 = rows * d;
    Dim3 simt_grid = {b * h, (t + ATT_ROWS - 1) / ATT_ROWS, 1}, simt_block = {ATT_ROWS, 1, 1};
    Dim3 mma_grid = {b * h, (t + TC_ROWS - 1) / TC_ROWS, 1}, mma_block = {256, 1, 1};
    Inputs input{in};
    u32* qkv_words = input.u(n3);
    std::vector<unsigned short> qkv_codes(qkv_words, qkv_words + n3);
    const void* qkv = a.qkv_stored == FMT_F32 ? (const void*)qkv_words : (const void*)qkv_codes.data();
    if (k == "attention_fwd") {
        std::vector<float> y(n1), st(2 * rows);
        std::vector<unsigned short> codes(n1);
        void* dst = a.coded ? (void*)codes.data() : (void*)y.data();
        if (mma) emu::launch(mma_grid, mma_block, [&] { f.mma_fwd(qkv, dst, st.data(), a); });
        else emu::launch(simt_grid, simt_block, [&] { f.fwd(qkv, dst, st.data(), a); });
        out = a.coded ? std::vector<u32>(codes.begin(), codes.end()) : bits_of(y);
        std::vector<u32> stats = bits_of(st);
        out.insert(out.end(), stats.begin(), stats.end());
    } else {
        float *dout = input.f(n1), *st = input.f(2 * rows);
        float poison = argc == 13 ? farg(argv, 12) : std::nanf("");
        std::vector<float> dqkv(n3, poison), delta(rows, poison);
        if (mma) {
            u32 splits = std::min<u32>((t + TC_KEYS - 1) / TC_KEYS, 4);
            std::vector<float> part((size_t)splits * n1, poison);
            std::vector<u16> codes(n1, (u16)(__float_as_uint(poison) >> 16));
            emu::launch(mma_grid, mma_block,
                        [&] { f.mma_delta(qkv, dout, st, delta.data(), codes.data(), a); });
            emu::launch({b * h, splits, 1}, {128, 1, 1},
                        [&] { f.mma_kv(qkv, codes.data(), st, delta.data(), dqkv.data(), part.data(), a); });
            emu::launch(elementwise_grid(n1 / 4), {ELEMENT_THREADS, 1, 1},
                        [&] { f.mma_dq(part.data(), dqkv.data(), (u32)rows, splits, a); });
        } else {
            emu::launch(simt_grid, simt_block, [&] { f.q(qkv, dout, st, delta.data(), dqkv.data(), a); });
            emu::launch(simt_grid, simt_block, [&] { f.k(qkv, dout, st, delta.data(), dqkv.data(), a); });
            emu::launch(simt_grid, simt_block, [&] { f.v(qkv, dout, st, dqkv.data(), a); });
        }
        dqkv.insert(dqkv.end(), delta.begin(), delta.end());
        out = bits_of(dqkv);
    }
    return true;
}

// warp_check FMT < a (16 x 16) b (16 x 8) c (16 x 8) > d d: the warp's emulated instructions
// against their definition, the matrix product, as attention.cu uses them. One warp copies A,
// B^T (rows n; its rows 8..15 zero-filled) and B (rows k; its right half zero) from their codes
// in FMT (bf16 or f16) into swizzled shared tiles by cp.async, takes A's fragments by ldmatrix,
// and computes A B + C with mma.sync twice: B read n-major (mma_nt: ldmatrix) and k-major
// (mma_nn: ldmatrix .trans). A product's second n-tile (B's zero half) must stay zero; a value
// there makes its row NaN.
static bool run_warp_check(const std::string& k, int argc, char** argv, std::vector<u32>& in,
                           std::vector<u32>& out) {
    if (k != "warp_check" || argc != 3) return false;
    u32 fmt = arg(argv, 2);
    Inputs input{in};
    float *fa = input.f(256), *fb = input.f(128), *fc = input.f(128);
    std::vector<unsigned short> ga(256), gbt(128), gb(256, 0);
    for (u32 i = 0; i < 256; i++) ga[i] = (unsigned short)code16(fa[i], fmt);
    for (u32 kk = 0; kk < 16; kk++)
        for (u32 n = 0; n < 8; n++) {
            gbt[16 * n + kk] = (unsigned short)code16(fb[8 * kk + n], fmt);
            gb[16 * kk + n] = (unsigned short)code16(fb[8 * kk + n], fmt);
        }
    std::vector<float> d(2 * 128);
    emu::launch({1, 1, 1}, {32, 1, 1}, [&] {
        __shared__ __align__(16) u16 sa[256], sbt[256], sb[256];
        u32 lane = threadIdx.x;
        u16* chunk[3] = {sa + swz<16>(lane / 2, lane % 2), sbt + swz<16>(lane / 2, lane % 2),
                         sb + swz<16>(lane / 2, lane % 2)};
        cp_async16(chunk[0], ga.data() + 8 * lane, true);
        cp_async16(chunk[1], gbt.data() + 8 * (lane % 16), lane < 16);
        cp_async16(chunk[2], gb.data() + 8 * lane, true);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        u32 af[1][4];
        load_a<16>(af, sa, 0, lane);
        float c[2][2][4] = {};
        for (u32 w = 0; w < 2; w++)
            for (u32 e = 0; e < 4; e++) c[w][0][e] = fc[8 * (lane / 4 + 8 * (e / 2)) + acc_col(0, e, lane)];
        mma_nt<16, 2>(c[0], af, sbt, lane, fmt == FMT_F16);
        mma_nn<16, 2>(c[1], af, sb, lane, fmt == FMT_F16);
        for (u32 w = 0; w < 2; w++)
            for (u32 e = 0; e < 4; e++) {
                u32 at = 128 * w + 8 * (lane / 4 + 8 * (e / 2)) + acc_col(0, e, lane);
                d[at] = c[w][1][e] == 0.0f ? c[w][0][e] : std::nanf("");
            }
    });
    out = bits_of(d);
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
        u32 fmt = arg(argv, 2);
        out = both_alignments<u32>(in, n, [&](const u32* x, u32* o) { round_to(x, o, n, fmt); });
    } else if (k == "encode_16" && argc == 3) {
        u32 fmt = arg(argv, 2);
        out = both_alignments<u16>(in, n, [&](const u32* x, u16* o) { encode_16(x, o, n, fmt); });
    } else if (k == "held16" && argc == 3) {  // FMT: attention.cu's held16, f32, bf16 or f16
        for (i64 e = 0; e < n; e++) out[e] = __float_as_uint(held16(fin[e], arg(argv, 2)));
    } else if (k == "split_bf16" && argc == 2) {
        out.resize(3 * in.size());
        split_bf16(fin, out.data(), n);
    } else if (k == "split_planes" && argc == 29) {
        // BATCH A_LEN_OUT B_LEN_OUT, then A's and B's split_operand (12 each) < a b > A's
        // planes, B's planes. A grid of 2 x 3 blocks of 8 x 2 threads: rows and columns both
        // take several turns.
        u32 batch = arg(argv, 2);
        SplitOperand a = split_operand(argv, 5, batch), b = split_operand(argv, 17, batch);
        size_t a_in = (size_t)batch * a.rows * a.cols;
        std::vector<u16> pa(arg(argv, 3), 0), pb(arg(argv, 4), 0);
        a.x = fin;
        b.x = fin + a_in;
        a.out = pa.data();
        b.out = pb.data();
        emu::launch({2, 3, 1}, {8, 2, 1}, [&] { split_planes(a, b); });
        out.assign(pa.begin(), pa.end());
        out.insert(out.end(), pb.begin(), pb.end());
    } else if (k == "quantize_to_f16" && argc == 8) {
        // FMT BATCH_LEN DIV MODULUS GROUPS_PER_BATCH GROUPS; the scales are the last GROUPS
        // values of the input.
        u32 groups = arg(argv, 7);
        n -= groups;
        std::vector<u32> x(in.begin(), in.begin() + n);
        const float* scales = fin + n;
        out = both_alignments<u16>(x, n, [&](const u32* x, u16* o) {
            quantize_to_f16((const float*)x, o, n, arg(argv, 2), scales, arg(argv, 3),
                            arg(argv, 4), arg(argv, 5), arg(argv, 6));
        });
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
        // The span's threads read four values each where they can: both ways, the same.
        out.assign(arg(argv, 6), 0u);
        std::vector<u32> unaligned(arg(argv, 6), 0u), shifted(in.size() + 1);
        std::copy(in.begin(), in.end(), shifted.begin() + 1);
        for (auto [x, bits] : {std::pair{fin, &out}, {(const float*)shifted.data() + 1, &unaligned}}) {
            emu::launch({2, 1, 1}, {16, 1, 1}, [&] {
                amax(x, n, bits->data(), arg(argv, 2), arg(argv, 3), arg(argv, 4), arg(argv, 5));
            });
        }
        if (out != unaligned) return 3;
    } else if (k == "descale" && argc == 8) {
        // N ROWS COLS A_GROUPS B_GROUPS SA_LEN < c(N) sa(SA_LEN) sb > c, run aligned and one
        // element off (both must agree)
        i64 len = arg(argv, 2);
        u32 rows = arg(argv, 3), cols = arg(argv, 4), ag = arg(argv, 5), bg = arg(argv, 6);
        const float *sa = fin + len, *sb = sa + arg(argv, 7);
        std::vector<float> c(fin, fin + len), shifted(len + 1);
        std::copy(c.begin(), c.end(), shifted.begin() + 1);
        for (float* y : {c.data(), shifted.data() + 1}) {
            emu::launch({3, 1, 1}, {32, 1, 1}, [&] { descale(y, len, rows, cols, sa, ag, sb, bg); });
        }
        if (!std::equal(c.begin(), c.end(), shifted.begin() + 1, [](float x, float y) {
                return __float_as_uint(x) == __float_as_uint(y);
            }))
            return 3;
        out = bits_of(c);
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
    } else if (!run_train(k, argc, argv, in, out) && !run_attention(k, argc, argv, in, out) &&
               !run_warp_check(k, argc, argv, in, out)) {
        std::fprintf(stderr, "unknown kernel or arguments: %s\n", k.c_str());
        return 2;
    }
    write_all(out);
    return 0;
}
