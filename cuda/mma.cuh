// mma.cuh: the warp's tensor-core instructions as inline PTX, for the modules that use them
// (attention.cu, matmul_split_bf16.cu; src/backend/cuda/kernels.rs splices it after
// formats.cuh): mma.sync m16n8k16 on bf16 or f16 with f32 accumulators, ldmatrix, cp.async,
// and the 16-bit conversions. tests/cuda_host/harness.cpp defines MANTISSA_HOST_MMA and brings
// emulations of the same functions from the PTX ISA's definitions, so that the kernels run on
// the host.

#ifndef MANTISSA_HOST_MMA

// c += a . b for one warp: a 16x16 fragment, b 16x8, c 16x8 f32 (the PTX ISA's layouts).
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_f16(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ u32 shared_address(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// Four 8x8 matrices of 16-bit values from shared memory: lane 8 i + r gives the address of row
// r of matrix i (16 bytes); register i receives the lane's part of matrix i (.trans: of its
// transpose).
__device__ __forceinline__ void ldsm_x4(u32* r, const u16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row))
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4_t(u32* r, const u16* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row))
                 : "memory");
}

// 16 bytes from global to shared memory without passing through registers; zeros where
// `valid` is false (the source is then not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
                 "l"(src), "r"(valid ? 16u : 0u)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most N of the thread's committed groups of copies are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The code of x in bf16 or f16 (`fmt`), rounded to nearest even, overflowing to inf, NaN kept:
// formats.cuh's encode, in one instruction.
__device__ __forceinline__ u32 code16(float x, u32 fmt) {
    unsigned short h;
    if (fmt == FMT_F16) {
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    } else {
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    }
    return h;
}

// The code of a value held in bf16 or f16 (`fmt`) already: exact. bf16's is the upper half of
// the f32 bits, f16's a conversion (predicated: no branch).
__device__ __forceinline__ u32 code_of_held(float x, u32 fmt) {
    unsigned short h = (unsigned short)(__float_as_uint(x) >> 16);
    asm("{\n\t.reg .pred f16;\n\t"
        "setp.eq.u32 f16, %2, %3;\n\t"
        "@f16 cvt.rn.f16.f32 %0, %1;\n\t}"
        : "+h"(h)
        : "f"(x), "r"(fmt), "n"(FMT_F16));
    return h;
}

// The value of a bf16 or f16 code.
__device__ __forceinline__ float value16(u32 code, u32 fmt) {
    if (fmt == FMT_F16) {
        float x;
        asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"((unsigned short)code));
        return x;
    }
    return __uint_as_float(code << 16);
}

// c += a . b for one warp in bf16 or f16 (`f16`): mma_bf16 or mma_f16, predicated.
__device__ __forceinline__ void mma16(float* c, const u32* a, u32 b0, u32 b1, bool f16) {
    asm volatile(
        "{\n\t.reg .pred f16;\n\t"
        "setp.ne.u32 f16, %10, 0;\n\t"
        "@f16 mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n\t"
        "@!f16 mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n\t}"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"((u32)f16));
}

#endif
