//! fp8 matmuls through cuBLASLt's fp8 GEMM on GPUs with fp8 tensor cores (compute capability
//! 8.9 and later): operands quantized by our kernel straight into fp8 bytes, one GEMM with f32
//! output (`FAST_ACCUM` off, so partial sums are promoted), then our `descale`.
//!
//! This path is opt-in (`MANTISSA_CUDA_FP8=cublaslt`, `Fp8Path`): on an H100 the fp8 tensor
//! core accumulates between promotions in fewer bits than f32, and `mantissa report` measured
//! results 1e-4 to 7e-4 (relative) from the contract's f32 sum (docs/h100.md), outside its
//! bound. By default, and for what cuBLASLt's fp8 kernels do not take, the f16 path runs: fp8
//! values held as exact f16 codes, an f16 GEMM with f32 accumulation, which keeps the contract.
//!
//! cuBLASLt's fp8 kernels want the "TN" layout: every row of A and every column of B
//! contiguous in K, K's stride a multiple of 16 bytes. `quantize_to_fp8` (cuda/cast.cu) writes
//! that layout whatever the operands' own (transposed, batched), with K padded to 16 by zeros,
//! which add nothing to any product. `Fp8Gemm` is data, so tests/cuda.rs checks the layout on
//! the host harness against the f16 path's values.

use super::CudaBackend;
use crate::algorithm::MatmulShape;
use crate::format::Format;
use cudarc::cublas::sys::cublasOperation_t as Op;
use cudarc::cublaslt::result::CublasError as LtError;
use cudarc::cublaslt::sys as lt;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

/// Which GEMM multiplies fp8 operands on the CUDA backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fp8Path {
    /// fp8 values as exact f16 codes, cuBLAS f16 GEMM, f32 accumulation: the contract.
    #[default]
    F16,
    /// cuBLASLt's fp8 GEMM where the GPU and shape allow it: fp8 tensor-core speed, with the
    /// tensor core's own accumulation between promotions (outside the contract's bound).
    Cublaslt,
}

impl Fp8Path {
    /// The path `MANTISSA_CUDA_FP8` names (`f16`, the default, or `cublaslt`).
    pub fn from_env() -> crate::error::Result<Fp8Path> {
        Ok(match crate::env::word("MANTISSA_CUDA_FP8")? {
            Some("cublaslt") => Fp8Path::Cublaslt,
            _ => Fp8Path::F16,
        })
    }
}

/// K is padded to a multiple of this (16 bytes of fp8).
pub const K_ALIGN: usize = 16;

/// One fp8 GEMM: C (m x n, row-major, f32) = A . B over `padded_k`, from A's rows and B's
/// columns each `padded_k` bytes long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Gemm {
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// K rounded up to a multiple of `K_ALIGN` (the padding is zeros).
    pub padded_k: usize,
    /// Independent products.
    pub batch: usize,
    /// A's fp8 format.
    pub a: Format,
    /// B's fp8 format.
    pub b: Format,
}

/// Where element (r, c) of a stored operand of `rows` x `cols` goes among the fp8 bytes: at
/// `batch * batch_stride + r * row_stride + c * col_stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Rows of the stored operand.
    pub rows: usize,
    /// Columns of the stored operand.
    pub cols: usize,
    /// Bytes between batches.
    pub batch_stride: usize,
    /// Bytes between rows.
    pub row_stride: usize,
    /// Bytes between columns.
    pub col_stride: usize,
}

impl Fp8Gemm {
    /// The fp8 GEMM of `shape` with A in `a` and B in `b` on a GPU of compute capability `cc`,
    /// or why cuBLASLt's fp8 kernels cannot run it (the f16 path then does).
    pub fn plan(
        shape: &MatmulShape,
        a: Format,
        b: Format,
        cc: (i32, i32),
    ) -> std::result::Result<Fp8Gemm, String> {
        Fp8Gemm::supported(a, b, cc)?;
        if !shape.n.is_multiple_of(4) {
            return Err(format!(
                "C's rows (n = {}) are not a multiple of 16 bytes, as cuBLASLt's fp8 kernels need",
                shape.n
            ));
        }
        let padded_k = shape.k.div_ceil(K_ALIGN) * K_ALIGN;
        let fits = |v: usize| i32::try_from(v).is_ok();
        let bytes = |x: usize| {
            x.checked_mul(padded_k)
                .and_then(|v| v.checked_mul(shape.batch))
        };
        if ![shape.m, shape.n, padded_k, shape.batch]
            .into_iter()
            .all(fits)
            || bytes(shape.m).is_none()
            || bytes(shape.n).is_none()
        {
            return Err("sizes beyond cuBLASLt's 32-bit dimensions".into());
        }
        Ok(Fp8Gemm {
            m: shape.m,
            n: shape.n,
            k: shape.k,
            padded_k,
            batch: shape.batch,
            a,
            b,
        })
    }

    /// Whether cuBLASLt has an fp8 GEMM for A in `a` and B in `b` on a GPU of compute
    /// capability `cc`, whatever the shape.
    pub fn supported(a: Format, b: Format, cc: (i32, i32)) -> std::result::Result<(), String> {
        if cc < (8, 9) {
            return Err(format!(
                "fp8 tensor cores need compute capability 8.9 (this GPU has {}.{})",
                cc.0, cc.1
            ));
        }
        if a == Format::E5m2 && b == Format::E5m2 {
            return Err("cuBLASLt has no e5m2 x e5m2 GEMM".into());
        }
        Ok(())
    }

    /// Bytes of A's and B's fp8 operands.
    pub fn lens(&self) -> (usize, usize) {
        (
            self.batch * self.m * self.padded_k,
            self.batch * self.n * self.padded_k,
        )
    }

    /// A's placement: row i of A at `i * padded_k`, whether A is stored m x k or (transposed)
    /// k x m.
    pub fn a_placement(&self, transposed: bool) -> Placement {
        let (kp, m, k) = (self.padded_k, self.m, self.k);
        let (rows, cols, row_stride, col_stride) = if transposed {
            (k, m, 1, kp)
        } else {
            (m, k, kp, 1)
        };
        Placement {
            rows,
            cols,
            batch_stride: m * kp,
            row_stride,
            col_stride,
        }
    }

    /// B's placement: column j of B at `j * padded_k`, whether B is stored k x n or
    /// (transposed) n x k.
    pub fn b_placement(&self, transposed: bool) -> Placement {
        let (kp, n, k) = (self.padded_k, self.n, self.k);
        let (rows, cols, row_stride, col_stride) = if transposed {
            (n, k, kp, 1)
        } else {
            (k, n, 1, kp)
        };
        Placement {
            rows,
            cols,
            batch_stride: n * kp,
            row_stride,
            col_stride,
        }
    }
}

/// cuBLASLt's handle and workspace, made once per backend on first use.
pub(super) struct Lt {
    handle: lt::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
}

// SAFETY: the handle is used only on the backend's one stream, whose work is ordered; cuBLASLt
// handles may be shared between threads.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `Lt::new` and is destroyed once.
        let _ = unsafe { cudarc::cublaslt::result::destroy_handle(self.handle) };
    }
}

/// Bytes of workspace for cuBLASLt (NVIDIA's recommendation for Hopper).
const WORKSPACE: usize = 32 << 20;

impl Lt {
    pub(super) fn new(cb: &CudaBackend) -> std::result::Result<Lt, String> {
        let handle = cudarc::cublaslt::result::create_handle()
            .map_err(|e| format!("cuBLASLt did not initialise: {e}"))?;
        // SAFETY: cuBLASLt only ever writes the workspace; its contents need no initialising.
        let workspace = unsafe { cb.stream.alloc::<u8>(WORKSPACE) }.map_err(|e| {
            let _ = unsafe { cudarc::cublaslt::result::destroy_handle(handle) };
            format!("no memory for cuBLASLt's workspace: {e}")
        })?;
        Ok(Lt { handle, workspace })
    }
}

/// A cuBLASLt object destroyed when it goes out of scope.
struct Owned<T: Copy>(T, unsafe fn(T) -> std::result::Result<(), LtError>);

impl<T: Copy> Drop for Owned<T> {
    fn drop(&mut self) {
        // SAFETY: the object was created once and is destroyed once, after its last use.
        let _ = unsafe { (self.1)(self.0) };
    }
}

fn lt_type(f: Format) -> lt::cudaDataType {
    if f == Format::E5m2 {
        lt::cudaDataType::CUDA_R_8F_E5M2
    } else {
        lt::cudaDataType::CUDA_R_8F_E4M3
    }
}

/// Sets attribute `attr` of a descriptor to `value`.
macro_rules! set {
    ($f:path, $obj:expr, $attr:expr, $value:expr) => {{
        let v = $value;
        // SAFETY: `v` is the attribute's documented type, alive for the call.
        unsafe {
            $f(
                $obj,
                $attr,
                (&v) as *const _ as *const _,
                std::mem::size_of_val(&v),
            )
        }
    }};
}

/// C = A . B for the quantized operands `qa`, `qb` (placed as `a_placement`/`b_placement`
/// say), f32 accumulation with every partial sum promoted, f32 out.
pub(super) fn gemm(
    cb: &CudaBackend,
    lt_: &Lt,
    g: &Fp8Gemm,
    qa: &CudaSlice<u8>,
    qb: &CudaSlice<u8>,
    c: &mut CudaSlice<f32>,
) -> std::result::Result<(), LtError> {
    use cudarc::cublaslt::result as r;
    use lt::cublasLtMatmulDescAttributes_t as D;
    use lt::cublasLtMatrixLayoutAttribute_t as L;
    let (m, n, kp) = (g.m as u64, g.n as u64, g.padded_k as u64);
    // Column-major, as cuBLASLt sees row-major C = A . B: C^T (n x m) = B^T . A^T, with B's
    // columns (our fp8 B, n rows of kp) as its first operand, transposed: the "TN" form.
    let desc = Owned(
        r::create_matmul_desc(
            lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt::cudaDataType::CUDA_R_32F,
        )?,
        r::destroy_matmul_desc,
    );
    set!(
        r::set_matmul_desc_attribute,
        desc.0,
        D::CUBLASLT_MATMUL_DESC_TRANSA,
        Op::CUBLAS_OP_T as i32
    )?;
    set!(
        r::set_matmul_desc_attribute,
        desc.0,
        D::CUBLASLT_MATMUL_DESC_TRANSB,
        Op::CUBLAS_OP_N as i32
    )?;
    set!(
        r::set_matmul_desc_attribute,
        desc.0,
        D::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
        0i8
    )?;
    let layout = |ty, rows: u64, cols: u64, ld: u64, stride: u64| {
        let l = Owned(
            r::create_matrix_layout(ty, rows, cols, ld as i64)?,
            r::destroy_matrix_layout,
        );
        set!(
            r::set_matrix_layout_attribute,
            l.0,
            L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
            g.batch as i32
        )?;
        set!(
            r::set_matrix_layout_attribute,
            l.0,
            L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
            stride as i64
        )?;
        Ok::<_, LtError>(l)
    };
    let la = layout(lt_type(g.b), kp, n, kp, n * kp)?;
    let lb = layout(lt_type(g.a), kp, m, kp, m * kp)?;
    let lc = layout(lt::cudaDataType::CUDA_R_32F, n, m, n, m * n)?;
    let pref = Owned(r::create_matmul_pref()?, r::destroy_matmul_pref);
    set!(
        r::set_matmul_pref_attribute,
        pref.0,
        lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        WORKSPACE as u64
    )?;
    // SAFETY: the descriptors are alive; the heuristic reads only them.
    let heuristic = unsafe {
        r::get_matmul_algo_heuristic(lt_.handle, desc.0, la.0, lb.0, lc.0, lc.0, pref.0)
    }?;
    let (alpha, beta) = (1f32, 0f32);
    let stream = cb.stream.as_ref();
    let (pa, _ra) = qb.device_ptr(stream);
    let (pb, _rb) = qa.device_ptr(stream);
    let (pc, _rc) = c.device_ptr_mut(stream);
    let (pw, _rw) = lt_.workspace.device_ptr(stream);
    cb.count_launch();
    // SAFETY: the operands hold batch * n * kp and batch * m * kp bytes and C batch * m * n
    // floats (`Fp8Gemm::lens`, the caller's allocations), as the layouts describe; the
    // workspace is WORKSPACE bytes, as the preference said.
    unsafe {
        r::matmul(
            lt_.handle,
            desc.0,
            &alpha as *const f32 as *const _,
            &beta as *const f32 as *const _,
            pa as *const _,
            la.0,
            pb as *const _,
            lb.0,
            pc as *const _,
            lc.0,
            pc as *mut _,
            lc.0,
            &heuristic.algo,
            pw as *mut _,
            WORKSPACE,
            cb.stream.cu_stream() as lt::cudaStream_t,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_gemms_are_planned_only_where_cublaslt_takes_them() {
        let shape = MatmulShape::new(5, 8, 20);
        let hopper = (9, 0);
        let g = Fp8Gemm::plan(&shape, Format::E4m3, Format::E5m2, hopper).unwrap();
        assert_eq!(g.padded_k, 32);
        assert_eq!(g.lens(), (5 * 32, 8 * 32));
        assert!(Fp8Gemm::plan(&shape, Format::E4m3, Format::E4m3, (8, 6)).is_err());
        assert!(Fp8Gemm::plan(&shape, Format::E5m2, Format::E5m2, hopper).is_err());
        assert!(
            Fp8Gemm::plan(
                &MatmulShape::new(5, 6, 20),
                Format::E4m3,
                Format::E4m3,
                hopper
            )
            .is_err()
        );
        assert!(
            Fp8Gemm::plan(
                &MatmulShape::new(1 << 31, 8, 16),
                Format::E4m3,
                Format::E4m3,
                hopper
            )
            .is_err()
        );
        // Every stored element lands in its own byte, within the operand, short of the padding.
        for transposed in [false, true] {
            for p in [g.a_placement(transposed), g.b_placement(transposed)] {
                let mut seen = std::collections::HashSet::new();
                for r in 0..p.rows {
                    for c in 0..p.cols {
                        let at = r * p.row_stride + c * p.col_stride;
                        assert!(at < p.batch_stride && seen.insert(at), "{p:?}");
                        assert!(at % g.padded_k < g.k);
                    }
                }
            }
        }
    }
}
