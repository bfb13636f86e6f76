// matmul_split_bf16.cu: f32 matmul emulated from split-bf16 products on tensor cores (bf16x3,
// bf16x6, bf16x9), one fused kernel. Needs formats.cuh; the loader defines LEVELS (2, 3 or 5).
//
// Each block computes a BM x BN tile of C. Operands are split on the tile load (no separate
// split pass, no bf16 planes in global memory): every f32 becomes h, m, l in shared memory,
// plus `hf`, h with non-finite values replaced by 0, which the lower levels use (docs/design.md:
// L1..L4 see 0 where h is not finite, so an inf meets no 0 * inf there). Each level's products
// go through mma.sync m16n8k16 (bf16 in, f32 accumulate) into that level's own accumulators.
// Tensor-core accumulation over a long K is not f32-exact (their own accumulation
// stalls near 1e-5 relative error over long K), so every PROMOTE of K the level partials are summed smallest first and added to an
// f32 total in ordinary registers, then restarted.
//
// Operands are addressed through strides, so one kernel serves plain, transposed and batched
// shapes; the tile loader walks along whichever index is contiguous in memory.

#ifndef LEVELS
#define LEVELS 2
#endif
#define BM 64
#define BN 64
#define BK 32
// Padding of each shared row: 40 u16 = 20 words, so the fragment loads of a warp hit 32
// different banks.
#define PAD 8
#define THREADS 128
#define WARPS_N 2
#define PROMOTE 256

#define P_H 0
#define P_HF 1
#define P_M 2
#define P_L 3
#if LEVELS == 2
#define PLANES 3
#else
#define PLANES 4
#endif

// mma_bf16 (c += a . b for one warp: a 16x16 bf16 fragment, b 16x8, c 16x8 f32) is mma.cuh's;
// the host harness (tests/cuda_host/harness.cpp) emulates it, so that this whole kernel runs on
// the host.

__device__ __forceinline__ void store_split(u16 (*tile)[BK + PAD], u32 row, u32 k, float x) {
    Split s = split_bf16_one(x);
    tile[0 * BM + row][k] = (u16)s.h;  // planes are BM (= BN) rows apart
    tile[1 * BM + row][k] = (u16)finite_h(s);
    tile[2 * BM + row][k] = (u16)s.m;
#if PLANES == 4
    tile[3 * BM + row][k] = (u16)s.l;
#endif
}

__device__ __forceinline__ u32 pair(const u16 (*tile)[BK + PAD], u32 plane, u32 row, u32 k) {
    return *reinterpret_cast<const u32*>(&tile[plane * BM + row][k]);
}

// C[b] = op(A[b]) . op(B[b]); A's element (i, p) is A[b * a_batch + i * a_row + p * a_col],
// B's (p, j) is B[b * b_batch + p * b_row + j * b_col]; C is row-major M x N per batch.
extern "C" __global__ void __launch_bounds__(THREADS)
matmul_split_bf16(const float* A, const float* B, float* C, u32 M, u32 N, u32 K, i64 a_row,
                  i64 a_col, i64 a_batch, i64 b_row, i64 b_col, i64 b_batch) {
    static_assert(BM == BN, "planes are laid out BM rows apart in both tiles");
    static_assert(PROMOTE % BK == 0, "promotion happens at tile boundaries");
    __shared__ __align__(16) u16 As[PLANES * BM][BK + PAD];
    __shared__ __align__(16) u16 Bs[PLANES * BN][BK + PAD];

    const u32 tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const u32 g = lane >> 2, t = lane & 3u;
    const u32 wm = (warp / WARPS_N) * 32u, wn = (warp % WARPS_N) * 32u;
    const u32 row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;
    A += (i64)blockIdx.z * a_batch;
    B += (i64)blockIdx.z * b_batch;
    C += (i64)blockIdx.z * M * N;
    const bool a_k_contiguous = a_col == 1;
    const bool b_k_contiguous = b_row == 1;

    // [level or total][m16 tile][n8 tile][fragment element]
    float part[LEVELS][2][4][4];
    float total[2][4][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                total[mi][ni][q] = 0.0f;
#pragma unroll
                for (int l = 0; l < LEVELS; ++l) part[l][mi][ni][q] = 0.0f;
            }

    for (u32 k0 = 0; k0 < K; k0 += BK) {
#pragma unroll 4
        for (u32 r = 0; r < BM * BK / THREADS; ++r) {
            u32 e = tid + r * THREADS;
            u32 i = a_k_contiguous ? e / BK : e % BM;
            u32 p = a_k_contiguous ? e % BK : e / BM;
            float x = 0.0f;
            if (row0 + i < M && k0 + p < K) x = A[(i64)(row0 + i) * a_row + (i64)(k0 + p) * a_col];
            store_split(As, i, p, x);
        }
#pragma unroll 4
        for (u32 r = 0; r < BN * BK / THREADS; ++r) {
            u32 e = tid + r * THREADS;
            u32 j = b_k_contiguous ? e / BK : e % BN;
            u32 p = b_k_contiguous ? e % BK : e / BN;
            float x = 0.0f;
            if (col0 + j < N && k0 + p < K) x = B[(i64)(k0 + p) * b_row + (i64)(col0 + j) * b_col];
            store_split(Bs, j, p, x);
        }
        __syncthreads();

#pragma unroll
        for (u32 kk = 0; kk < BK; kk += 16) {
            u32 af[PLANES][2][4];
            u32 bf[PLANES][4][2];
#pragma unroll
            for (u32 pl = 0; pl < PLANES; ++pl) {
#pragma unroll
                for (u32 mi = 0; mi < 2; ++mi) {
                    u32 r = wm + mi * 16 + g, c = kk + 2 * t;
                    af[pl][mi][0] = pair(As, pl, r, c);
                    af[pl][mi][1] = pair(As, pl, r + 8, c);
                    af[pl][mi][2] = pair(As, pl, r, c + 8);
                    af[pl][mi][3] = pair(As, pl, r + 8, c + 8);
                }
#pragma unroll
                for (u32 ni = 0; ni < 4; ++ni) {
                    u32 r = wn + ni * 8 + g, c = kk + 2 * t;
                    bf[pl][ni][0] = pair(Bs, pl, r, c);
                    bf[pl][ni][1] = pair(Bs, pl, r, c + 8);
                }
            }
// One level term: the parts (0 = h, 1 = m, 2 = l) of the generated SPLIT_TERMS
// (src/algorithm.rs); h is P_H in L0 and P_HF, 0 where not finite, in the lower levels. Terms
// of levels past LEVELS are dead code; their indices are kept in bounds all the same.
#define PLANE(level, part) ((part) == 0 ? ((level) == 0 ? P_H : P_HF) : (part) == 1 ? P_M : P_L)
#define TERM(level, pa, pb)                                                  \
    if ((level) < LEVELS)                                                    \
        _Pragma("unroll") for (int mi = 0; mi < 2; ++mi)                     \
            _Pragma("unroll") for (int ni = 0; ni < 4; ++ni)                 \
                mma_bf16(part[(level) < LEVELS ? (level) : 0][mi][ni],       \
                         af[PLANE(level, pa) % PLANES][mi], bf[PLANE(level, pb) % PLANES][ni]);
            SPLIT_TERMS(TERM)
#undef TERM
#undef PLANE
        }
        __syncthreads();

        if ((k0 + BK) % PROMOTE == 0 || k0 + BK >= K) {
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        float s = part[LEVELS - 1][mi][ni][q];
                        part[LEVELS - 1][mi][ni][q] = 0.0f;
#pragma unroll
                        for (int l = LEVELS - 2; l >= 0; --l) {
                            s += part[l][mi][ni][q];
                            part[l][mi][ni][q] = 0.0f;
                        }
                        total[mi][ni][q] += s;
                    }
        }
    }

#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                u32 i = row0 + wm + mi * 16 + g + (q >= 2 ? 8u : 0u);
                u32 j = col0 + wn + ni * 8 + 2 * t + (q & 1);
                if (i < M && j < N) C[(i64)i * N + j] = total[mi][ni][q];
            }
}
