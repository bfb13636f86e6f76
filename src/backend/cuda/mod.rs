//! The CUDA fast path: cuBLAS GEMMs on tensor cores and NVRTC-compiled kernels (`cuda/*.cu`),
//! through cudarc with the CUDA libraries loaded at run time.
//!
//! The crate builds and runs where no CUDA exists: `probe` opens each library before anything
//! touches it (cudarc panics on first use of a missing one), and `open` turns every failure,
//! panics of the bindings included, into `BackendUnavailable`, so `--backend auto` falls back to
//! wgpu with the reason. Devices older than compute capability 8.0 are refused: the split and
//! bf16 algorithms need bf16 tensor cores (mma.sync m16n8k16), and wgpu runs those GPUs.
//!
//! Numerics (the contract of docs/design.md; the conformance suite checks it on a GPU):
//! - operands are rounded, split and quantized by our kernels, bit for bit as the host;
//! - f32 is cuBLAS SGEMM (not cuBLASLt, whose f32 path is TF32);
//! - tf32, bf16, f16: operands rounded by us, then cuBLAS with that compute type, f32 output
//!   (the tensor core's own tf32 truncation then sees values that are already tf32);
//! - bf16x3/x6/x9: operands split once into bf16 planes, then one cuBLAS bf16 GEMM per level
//!   (K concatenated over the level's terms), levels summed smallest first in f32, level 0
//!   promoted every 256 of K for x6 and x9 (`split.rs`, which also arranges bf16x3 as one
//!   K-tripled GEMM and x6/x9's level 0 as partial sums); or one fused kernel
//!   (`matmul_split_bf16.cu`) promoting every level every 256 of K; the tuner takes the fastest;
//! - fp8: quantized with our scales into f16 codes (every e4m3 and e5m2 value is an f16 value,
//!   so f16 tensor cores multiply them exactly) for an f16 GEMM; then the descale. With
//!   `MANTISSA_CUDA_FP8=cublaslt`, into fp8 bytes for cuBLASLt's fp8 GEMM (compute capability
//!   8.9 and later, `fp8.rs`): faster, but its accumulation is not the contract's (fp8.rs).

/// Launches kernel `$name` of `$module` with launch configuration `$cfg` and the arguments in
/// order.
macro_rules! launch {
    ($cb:expr, $module:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let cb: &CudaBackend = $cb;
        let f = cb.kernels.function($module, $name)?;
        cb.kernels.check_params(&f, $name, &[$( $crate::backend::cuda::ParamSize::param_size(&$arg) ),*])?;
        let mut builder = cb.stream.launch_builder(&f);
        $( builder.arg($arg); )*
        cb.count_launch();
        // SAFETY: every kernel of cuda/ checks its bounds against the sizes among its
        // arguments, and the callers pass buffers of at least those sizes.
        unsafe { builder.launch($cfg) }.map_err(|e| cb.device_error($name, e))?;
        Ok::<(), Error>(())
    }};
}

/// Launches the elementwise kernel `$name` of `$module` over `$n` elements with the arguments
/// in order (a grid-stride loop; nothing is launched for 0 elements).
macro_rules! launch_1d {
    ($cb:expr, $module:expr, $name:expr, $n:expr; $($arg:expr),* $(,)?) => {{
        let n: usize = $n;
        if n > 0 {
            launch!($cb, $module, $name, CudaBackend::config_1d(n); $($arg),*)?;
        }
        Ok::<(), Error>(())
    }};
}

pub mod fp8;
mod kernels;
mod matmul;
pub mod nccl;
mod plan;
pub mod split;
mod staging;
mod train;

use kernels::ParamSize;
pub use kernels::{Module, Target, compile, cubin_cache_path, nvrtc_present};
pub use matmul::{SplitPath, variant};
pub use plan::CudaPlan;

use super::{Backend, BackendKind, MatmulTiming, Operands};
use crate::algorithm::{Algorithm, MatmulShape};
use crate::error::{DeviceFault, Error, Result};
use crate::format::{Format, Overflow};
use crate::policy::{Capabilities, FusedAttention};
use crate::tune::{AutotuneMode, Tuner};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use kernels::Kernels;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// The oldest compute capability the backend runs on (Ampere: bf16 tensor cores).
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// What `mantissa info` shows of a CUDA device.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceInfo {
    /// The device's CUDA ordinal.
    pub ordinal: usize,
    /// The device's name.
    pub name: String,
    /// Compute capability (major, minor): (9, 0) on an H100.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub memory_bytes: usize,
    /// Streaming multiprocessors.
    pub multiprocessors: i32,
}

/// Checks that every CUDA library the backend uses can be loaded, without touching them.
pub fn probe() -> std::result::Result<(), String> {
    // SAFETY: each call only tries to open a shared library.
    let libraries = unsafe {
        [
            (
                cudarc::driver::sys::is_culib_present(),
                "the CUDA driver (libcuda.so): no NVIDIA driver installed",
            ),
            (
                cudarc::nvrtc::sys::is_culib_present(),
                "NVRTC (libnvrtc.so): install the CUDA toolkit, or pip's nvidia-cuda-nvrtc and add its lib directory to LD_LIBRARY_PATH",
            ),
            (
                cudarc::cublas::sys::is_culib_present(),
                "cuBLAS (libcublas.so): install the CUDA toolkit, or pip's nvidia-cublas and add its lib directory to LD_LIBRARY_PATH",
            ),
        ]
    };
    match libraries.iter().find(|(present, _)| !present) {
        Some((_, missing)) => Err(format!("cannot load {missing}")),
        None => Ok(()),
    }
}

fn unavailable(why: impl Into<String>) -> Error {
    Error::BackendUnavailable {
        backend: "cuda".into(),
        why: why.into(),
    }
}

/// The CUDA backend on one device: a context, one stream, a cuBLAS handle and the kernels.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Kernels,
    info: DeviceInfo,
    /// How split-bf16 matmuls run where `MANTISSA_CUDA_SPLIT` says (else the tuner chooses).
    split_path: Option<SplitPath>,
    /// The split-bf16 path tuned per (device, algorithm, shape class) (`MANTISSA_AUTOTUNE`).
    tuner: Tuner<SplitPath>,
    /// cuBLASLt, made on the first fp8 matmul that can use it (or why it could not be).
    lt: OnceLock<std::result::Result<fp8::Lt, String>>,
    /// Which GEMM multiplies fp8 operands (`MANTISSA_CUDA_FP8`).
    fp8_path: fp8::Fp8Path,
    /// Set when cuBLASLt's fp8 GEMM failed: fp8 then takes the f16 path for good.
    fp8_off: AtomicBool,
    /// Kernels launched and library GEMMs called since the device opened (profiles count an
    /// op's launches by the difference).
    launches: AtomicUsize,
}

impl CudaBackend {
    /// Opens device `ordinal`, or says why it cannot.
    pub fn open(ordinal: usize) -> Result<CudaBackend> {
        // A kernel directory that cannot be used is refused before anything opens.
        crate::backend::sources::replacements()?;
        probe().map_err(unavailable)?;
        // The bindings panic where a library lacks a symbol they expect (another CUDA version).
        std::panic::catch_unwind(|| Self::open_probed(ordinal)).unwrap_or_else(|_| {
            Err(unavailable(
                "the CUDA libraries failed to initialise (a version this build does not know?)",
            ))
        })
    }

    /// Opens device `device` modulo the devices the driver sees (a host's ranks spread over
    /// its GPUs), or says why it cannot.
    pub fn open_modulo(device: usize) -> Result<CudaBackend> {
        probe().map_err(unavailable)?;
        let count = std::panic::catch_unwind(CudaContext::device_count)
            .ok()
            .and_then(|c| c.ok())
            .map_or(1, |n| n.max(1) as usize);
        Self::open(device % count)
    }

    fn open_probed(ordinal: usize) -> Result<CudaBackend> {
        let count = CudaContext::device_count()
            .map_err(|e| unavailable(format!("the CUDA driver did not initialise: {e}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(unavailable(format!(
                "no CUDA device {ordinal} (the driver sees {count})"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| unavailable(e.to_string()))?;
        let attribute = |a| ctx.attribute(a).unwrap_or(0);
        use cudarc::driver::sys::CUdevice_attribute as A;
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().unwrap_or_else(|_| "CUDA device".into()),
            compute_capability: ctx
                .compute_capability()
                .map_err(|e| unavailable(e.to_string()))?,
            memory_bytes: ctx.total_mem().unwrap_or(0),
            multiprocessors: attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        };
        if info.compute_capability < MIN_COMPUTE_CAPABILITY {
            return Err(unavailable(format!(
                "{} has compute capability {}.{}; the CUDA backend needs {}.{} (bf16 tensor cores); wgpu runs this GPU",
                info.name,
                info.compute_capability.0,
                info.compute_capability.1,
                MIN_COMPUTE_CAPABILITY.0,
                MIN_COMPUTE_CAPABILITY.1
            )));
        }
        // SAFETY: the backend uses one stream, which orders every use of every buffer; cudarc's
        // per-buffer events (for work spread over several streams) would only cost time.
        unsafe { ctx.disable_event_tracking() };
        // A stream of its own: the legacy default stream cannot be captured into a CUDA graph
        // (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, seen on an H100 and an H200), so every
        // recording of a step failed there and ran op by op.
        let stream = ctx
            .new_stream()
            .map_err(|e| unavailable(format!("no CUDA stream could be created: {e}")))?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| unavailable(format!("cuBLAS did not initialise: {e}")))?;
        let kernels = Kernels::new(ctx.clone(), info.compute_capability, info.name.clone());
        Ok(CudaBackend {
            ctx,
            stream,
            blas,
            kernels,
            info,
            split_path: SplitPath::from_env()?,
            tuner: Tuner::new(
                AutotuneMode::from_env()?,
                Tuner::<SplitPath>::path_in_cache("cuda-tune.json"),
            )
            .with_budget(crate::tune::budget_from_env()?),
            lt: OnceLock::new(),
            fp8_path: fp8::Fp8Path::from_env()?,
            fp8_off: AtomicBool::new(false),
            launches: AtomicUsize::new(0),
        })
    }

    /// The matmul twice: whole, then its product alone over the operands a separate
    /// preparation made, C poisoned in between (both Cs). The second is what `time_matmul`
    /// times from `Operands::Prepared`; tests check that it is the first.
    pub fn matmul_product_again(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        a: &[f32],
        b: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        shape.check(a.len(), b.len())?;
        let (a, b) = (self.upload(a)?, self.upload(b)?);
        let mut c = self.zeros::<f32>(shape.c_len())?;
        matmul::run(self, shape, algorithm, &a, &b, &mut c)?;
        let whole = self.download(&c, shape.c_len())?;
        let mut prepared = matmul::prepare(self, shape, algorithm, &a, &b)?;
        let poison = vec![f32::NAN.to_bits() | 0x1234; shape.c_len().max(1)];
        self.stream
            .memcpy_htod(bytemuck::cast_slice::<u32, f32>(&poison), &mut c)
            .map_err(|e| self.device_error("poison", e))?;
        matmul::product(self, shape, algorithm, &mut prepared, &mut c)?;
        Ok((whole, self.download(&c, shape.c_len())?))
    }

    /// The device as `mantissa info` shows it.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// How split-bf16 matmuls run on this backend: the path `MANTISSA_CUDA_SPLIT` forces, or
    /// none (the faster per shape class, tuned).
    pub fn split_path(&self) -> Option<SplitPath> {
        self.split_path
    }

    /// Seconds of `repetitions` runs of `f` on the stream, each between two CUDA events.
    fn time_events(
        &self,
        repetitions: usize,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<Vec<f64>> {
        let mut times = Vec::with_capacity(repetitions.max(1));
        for _ in 0..repetitions.max(1) {
            let event = |what| {
                self.ctx
                    .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(|e| self.device_error(what, e))
            };
            let (start, end) = (event("timer")?, event("timer")?);
            start
                .record(&self.stream)
                .map_err(|e| self.device_error("timer", e))?;
            f()?;
            end.record(&self.stream)
                .map_err(|e| self.device_error("timer", e))?;
            end.synchronize()
                .map_err(|e| self.device_error("timer", e))?;
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| self.device_error("timer", e))?;
            times.push(ms as f64 / 1e3);
        }
        Ok(times)
    }

    /// The cuBLASLt fp8 GEMM of `shape`, where it is asked for (`MANTISSA_CUDA_FP8=cublaslt`)
    /// and this GPU, the shape and cuBLASLt allow it.
    fn fp8_gemm(
        &self,
        shape: &MatmulShape,
        a: Format,
        b: Format,
    ) -> Option<(fp8::Fp8Gemm, &fp8::Lt)> {
        if self.fp8_path != fp8::Fp8Path::Cublaslt || self.fp8_off.load(Ordering::Relaxed) {
            return None;
        }
        let g = fp8::Fp8Gemm::plan(shape, a, b, self.info.compute_capability).ok()?;
        match self.lt.get_or_init(|| fp8::Lt::new(self)) {
            Ok(lt) => Some((g, lt)),
            Err(why) => {
                self.fp8_gemm_failed(why);
                None
            }
        }
    }

    /// cuBLASLt's fp8 GEMM failed: said once, and fp8 takes the f16 path from now on (the same
    /// products and accumulation, so results keep the contract).
    fn fp8_gemm_failed(&self, why: impl std::fmt::Display) {
        if !self.fp8_off.swap(true, Ordering::Relaxed) {
            eprintln!(
                "mantissa: cuBLASLt's fp8 GEMM is unavailable ({why}); fp8 matmuls take the f16 path"
            );
        }
    }

    /// CUDA devices the driver sees.
    pub fn device_count(&self) -> usize {
        CudaContext::device_count().map_or(1, |n| n.max(1) as usize)
    }

    /// `fault` during `what` as an error of this device: `OutOfMemory` (with the device's
    /// memory) where the fault is one, by its code.
    fn device_error(&self, what: &str, fault: impl Into<DeviceFault>) -> Error {
        Error::device(
            &self.info.name,
            what,
            fault,
            Some(self.info.memory_bytes as u64),
        )
    }

    /// The device's default memory pool, the context made current: cudarc's stream-ordered
    /// allocations come from it. None where the device has no such allocator.
    fn default_pool(&self) -> Option<cudarc::driver::sys::CUmemoryPool> {
        if !self.ctx.has_async_alloc() {
            return None;
        }
        self.ctx.bind_to_thread().ok()?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: the context is current and `pool` receives the handle.
        unsafe { cudarc::driver::sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }
            .result()
            .ok()?;
        Some(pool)
    }

    /// Bytes the stream-ordered allocator holds now and held at most since `reset_peak`.
    fn pool_usage(&self) -> Option<(u64, u64)> {
        use cudarc::driver::sys::{self, CUmemPool_attribute as Attr};
        let pool = self.default_pool()?;
        let read = |attr: Attr| {
            let mut value = 0u64;
            // SAFETY: both attributes read are 64-bit counters written to `value`.
            unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&raw mut value).cast()) }
                .result()
                .ok()
                .map(|()| value)
        };
        Some((
            read(Attr::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            read(Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        ))
    }

    /// Starts the allocator's high-water mark again from what it holds now.
    fn reset_peak(&self) {
        use cudarc::driver::sys::{self, CUmemPool_attribute as Attr};
        if let Some(pool) = self.default_pool() {
            let mut zero = 0u64;
            // SAFETY: setting USED_MEM_HIGH (a 64-bit counter) to 0 resets it.
            let _ = unsafe {
                sys::cuMemPoolSetAttribute(
                    pool,
                    Attr::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    (&raw mut zero).cast(),
                )
            };
        }
    }

    fn upload<T: DeviceRepr>(&self, x: &[T]) -> Result<CudaSlice<T>> {
        self.stream
            .clone_htod(x)
            .map_err(|e| self.device_error("upload", e))
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros(len.max(1))
            .map_err(|e| self.device_error(&format!("allocating {len} values"), e))
    }

    /// `len` values left as the allocator gives them.
    ///
    /// # Safety
    /// The caller writes every value before anything reads it.
    unsafe fn uninit<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: passed on to the caller.
        unsafe { self.stream.alloc(len.max(1)) }
            .map_err(|e| self.device_error(&format!("allocating {len} values"), e))
    }

    fn download<T: DeviceRepr>(&self, x: &CudaSlice<T>, len: usize) -> Result<Vec<T>> {
        let mut v = self
            .stream
            .clone_dtoh(x)
            .map_err(|e| self.device_error("download", e))?;
        self.stream
            .synchronize()
            .map_err(|e| self.device_error("synchronize", e))?;
        v.truncate(len);
        Ok(v)
    }

    /// Notes one kernel launch or library GEMM call (`launches`).
    fn count_launch(&self) {
        self.launches.fetch_add(1, Ordering::Relaxed);
    }

    /// Kernels launched and library GEMMs called so far.
    fn launched(&self) -> usize {
        self.launches.load(Ordering::Relaxed)
    }

    /// The launch of an elementwise kernel (a grid-stride loop over `n` elements).
    fn config_1d(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.div_ceil(256).min(1 << 20) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// The launch of scale.cu's `amax` over `n` elements: blocks of 256 threads, each taking
    /// spans of `AMAX_SPAN` (4096) consecutive elements.
    fn config_amax(n: usize) -> LaunchConfig {
        const AMAX_SPAN: usize = 4096;
        LaunchConfig {
            grid_dim: (n.div_ceil(AMAX_SPAN).clamp(1, 1 << 16) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn to_bits(x: &[f32]) -> &[u32] {
        bytemuck::cast_slice(x)
    }
}

#[async_trait::async_trait]
impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn name(&self) -> String {
        format!("cuda:{}", self.info.name)
    }

    fn device_name(&self) -> String {
        let (major, minor) = self.info.compute_capability;
        format!(
            "{} (sm_{major}{minor}, {:.1} GiB, {} SMs)",
            self.info.name,
            self.info.memory_bytes as f64 / (1u64 << 30) as f64,
            self.info.multiprocessors
        )
    }

    /// Tensor cores run every algorithm but f32 (fp8 as exact f16 products). attention.cu
    /// fuses attention under the algorithms that round their inputs and sum exact products in
    /// f32 (not the split or fp8 ones), for the head sizes it is compiled for;
    /// `MANTISSA_CUDA_ATTENTION=unfused` keeps the unfused ops (to compare the two).
    fn capabilities(&self) -> Capabilities {
        // A value other than fused or unfused was refused when the backend opened
        // (`env::check_all`).
        let wanted = crate::env::word("MANTISSA_CUDA_ATTENTION").ok().flatten() != Some("unfused");
        let fused_attention = match wanted {
            true => FusedAttention {
                algorithms: vec![
                    Algorithm::F32,
                    Algorithm::Tf32,
                    Algorithm::Bf16,
                    Algorithm::F16,
                ],
                head_sizes: train::ATTENTION_HEAD_SIZES.to_vec(),
            },
            false => FusedAttention::default(),
        };
        Capabilities {
            accelerated: Algorithm::ALL
                .into_iter()
                .filter(|a| *a != Algorithm::F32)
                .collect(),
            fused_attention,
        }
    }

    async fn matmul(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        a: &[f32],
        b: &[f32],
    ) -> Result<Vec<f32>> {
        shape.check(a.len(), b.len())?;
        let (a, b) = (self.upload(a)?, self.upload(b)?);
        let mut c = self.zeros::<f32>(shape.c_len())?;
        matmul::run(self, shape, algorithm, &a, &b, &mut c)?;
        self.download(&c, shape.c_len())
    }

    async fn time_matmul(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        a: &[f32],
        b: &[f32],
        repetitions: usize,
        operands: Operands,
    ) -> Result<MatmulTiming> {
        shape.check(a.len(), b.len())?;
        let (a, b) = (self.upload(a)?, self.upload(b)?);
        let mut c = self.zeros::<f32>(shape.c_len())?;
        // One untimed run compiles the kernels and warms cuBLAS's heuristics (and settles
        // which path fp8 takes).
        matmul::run(self, shape, algorithm, &a, &b, &mut c)?;
        let mut prepared = match operands {
            Operands::Prepared => Some(matmul::prepare(self, shape, algorithm, &a, &b)?),
            Operands::F32 => None,
        };
        let mut times = self.time_events(repetitions, || match &mut prepared {
            Some(p) => matmul::product(self, shape, algorithm, p, &mut c),
            None => matmul::run(self, shape, algorithm, &a, &b, &mut c),
        })?;
        Ok(MatmulTiming {
            seconds: super::median(&mut times),
            operands,
            clock: "cuda-events",
            repetitions: times.len(),
            variant: matmul::variant_of_run(self, shape, algorithm),
            tuned_seconds: None,
        })
    }

    async fn encode(&self, format: Format, overflow: Overflow, x: &[f32]) -> Result<Vec<u32>> {
        let input = self.upload(Self::to_bits(x))?;
        let mut out = self.zeros::<u32>(x.len())?;
        let (n, fmt, saturate) = (x.len() as i64, format_id(format), overflow_flag(overflow));
        launch_1d!(self, Module::Cast, "encode", x.len(); &input, &mut out, &n, &fmt, &saturate)?;
        self.download(&out, x.len())
    }

    async fn decode(&self, format: Format, bits: &[u32]) -> Result<Vec<f32>> {
        let input = self.upload(bits)?;
        let mut out = self.zeros::<f32>(bits.len())?;
        let (n, fmt) = (bits.len() as i64, format_id(format));
        launch_1d!(self, Module::Cast, "decode", bits.len(); &input, &mut out, &n, &fmt)?;
        self.download(&out, bits.len())
    }

    async fn split_bf16(&self, x: &[f32]) -> Result<[Vec<u32>; 3]> {
        let input = self.upload(x)?;
        let mut planes = self.zeros::<u32>(3 * x.len())?;
        let n = x.len() as i64;
        launch_1d!(self, Module::Cast, "split_bf16", x.len(); &input, &mut planes, &n)?;
        let all = self.download(&planes, 3 * x.len())?;
        let plane = |p: usize| all[p * x.len()..(p + 1) * x.len()].to_vec();
        Ok([plane(0), plane(1), plane(2)])
    }

    async fn amax(&self, x: &[f32]) -> Result<f32> {
        let input = self.upload(x)?;
        let mut bits = self.zeros::<u32>(1)?;
        matmul::amax_groups(
            self,
            &input,
            x.len(),
            &mut bits,
            matmul::Groups::whole(x.len()),
        )?;
        Ok(f32::from_bits(self.download(&bits, 1)?[0]))
    }

    fn memory_available(&self) -> Option<(u64, u64)> {
        self.ctx.bind_to_thread().ok()?;
        let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
        Some((free as u64, total as u64))
    }

    /// The device-resident step plan (`plan.rs`).
    fn executor<'a>(
        &'a self,
        plan: crate::plan::Plan,
    ) -> Result<Box<dyn crate::plan::StepExecutor + 'a>> {
        Ok(Box::new(CudaPlan::new(self, plan)?))
    }
}

/// The id of a format in the kernels (`FMT_<NAME>`, generated by `backend::defs`).
fn format_id(format: Format) -> u32 {
    format.id()
}

fn overflow_flag(overflow: Overflow) -> u32 {
    u32::from(overflow == Overflow::Saturate)
}
