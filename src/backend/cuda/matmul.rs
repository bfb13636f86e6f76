//! Matmul on the CUDA backend, one path per algorithm (the module docs of `cuda` say which).
//! Row-major operands meet column-major cuBLAS as C^T = op(B)^T . op(A)^T: B's buffer is
//! cuBLAS's first operand and A's its second, so nothing is transposed in memory.

use super::fp8::{self, Placement};
use super::split::{Arrangement, GemmCall, Out, PlaneMap, SplitLayout, Step};
use super::{CudaBackend, Module, format_id, train};
use crate::algorithm::{Algorithm, MatmulShape, Scaling};
use crate::error::{Error, Result};
use crate::format::Format;
use crate::plan::check_stored_operands;
use crate::tune::{AutotuneMode, TUNE_MIN_FLOPS, TUNE_RUNS, shape_class};
use cudarc::cublas::sys::{
    cublasComputeType_t as Compute, cublasGemmAlgo_t, cublasOperation_t as Op,
    cudaDataType_t as Type,
};
use cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use std::sync::atomic::Ordering;

/// C = op(A) . op(B) under `algorithm`, operands and result on the device: the operands
/// prepared into the algorithm's storage format, then the product.
pub(super) fn run(
    cb: &CudaBackend,
    shape: &MatmulShape,
    algorithm: &Algorithm,
    a: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
    c: &mut CudaSlice<f32>,
) -> Result<()> {
    run_stored(cb, shape, algorithm, (a, b), [Format::F32; 2], c)
}

/// `run` on operands stored as f32 values or, where `stored` says so, as the 16-bit codes of
/// the algorithm's operand format (a step plan's coded tensors, `Plan::store_codes`): the
/// GEMM reads those as they are.
pub(super) fn run_stored(
    cb: &CudaBackend,
    shape: &MatmulShape,
    algorithm: &Algorithm,
    (a, b): (&CudaSlice<f32>, &CudaSlice<f32>),
    stored: [Format; 2],
    c: &mut CudaSlice<f32>,
) -> Result<()> {
    if shape.c_len() == 0 {
        return Ok(());
    }
    check_stored_operands(algorithm, stored)?;
    let coded = stored.map(|f| f != Format::F32);
    check_sizes(shape)?;
    let path = split_path(cb, shape, algorithm, a, b)?.0;
    let mut prepared = prepare_on(cb, shape, algorithm, path, (a, b), coded)?;
    match product(cb, shape, algorithm, &mut prepared, c) {
        // cuBLASLt's fp8 GEMM failed (now off, said once): the f16 path from the operands.
        Err(_) if prepared.on_fp8_gemm() && cb.fp8_off.load(Ordering::Relaxed) => {
            let mut prepared = prepare(cb, shape, algorithm, a, b)?;
            product(cb, shape, algorithm, &mut prepared, c)
        }
        done => done,
    }
}

/// One operand in the storage format its algorithm's GEMM reads. Preparation and product are
/// apart so that operands already held in their format are not encoded again (the bench's
/// prepared mode times the product alone, as PyTorch's same-dtype GEMM is timed).
pub(super) enum Held<'a> {
    /// f32 values as given: SGEMM's operands, and the fused split kernel's (it splits as it
    /// loads).
    F32(&'a CudaSlice<f32>),
    /// tf32-rounded f32 values.
    Tf32(CudaSlice<f32>),
    /// bf16 codes.
    Bf16(Codes<'a>),
    /// f16 codes: f16 values, or fp8 values (exact in f16) on the f16 path.
    F16(Codes<'a>),
    /// bf16 planes laid out for one GEMM per level (split.rs).
    Planes(CudaSlice<u16>),
    /// fp8 codes in cuBLASLt's TN layout (fp8.rs).
    Fp8(CudaSlice<u8>),
}

/// 16-bit codes: encoded for the product, or an operand stored as codes already.
pub(super) enum Codes<'a> {
    Encoded(CudaSlice<u16>),
    Stored(CudaView<'a, u16>),
}

impl Codes<'_> {
    fn view(&self) -> CudaView<'_, u16> {
        match self {
            Codes::Encoded(x) => x.as_view(),
            Codes::Stored(x) => x.slice(..),
        }
    }
}

/// Both operands of one matmul, prepared, with what the product needs besides them.
pub(super) struct Prepared<'a> {
    a: Held<'a>,
    b: Held<'a>,
    /// fp8: the scales each operand was quantized with (C is divided by them).
    scales: Option<Fp8Scales>,
    /// cuBLASLt's fp8 GEMM of the operands (their layout is its).
    fp8_gemm: Option<fp8::Fp8Gemm>,
    /// Split GEMMs: how they are arranged, and their scratch (the lower levels' sum or the
    /// partial planes), made once here rather than in every product.
    split: Option<(Arrangement, Option<CudaSlice<f32>>)>,
}

impl Prepared<'_> {
    fn on_fp8_gemm(&self) -> bool {
        self.fp8_gemm.is_some()
    }
}

/// fp8 scales on the device, one per group of A and of B.
pub(super) struct Fp8Scales {
    a: CudaSlice<f32>,
    b: CudaSlice<f32>,
    rowwise: bool,
}

/// Prepares both operands of `shape` for `algorithm`: rounds, encodes, splits or quantizes
/// them (fp8: after their scales), as the path that will run the product reads them (split
/// algorithms: the path `split_path` chooses).
pub(super) fn prepare<'a>(
    cb: &CudaBackend,
    shape: &MatmulShape,
    algorithm: &Algorithm,
    a: &'a CudaSlice<f32>,
    b: &'a CudaSlice<f32>,
) -> Result<Prepared<'a>> {
    check_sizes(shape)?;
    let path = split_path(cb, shape, algorithm, a, b)?.0;
    prepare_on(cb, shape, algorithm, path, (a, b), [false; 2])
}

/// `prepare` with split algorithms on `path`; an operand `coded` is stored as the 16-bit codes
/// the bf16 or f16 GEMM reads (`check_stored_operands` held) and is viewed, not encoded.
fn prepare_on<'a>(
    cb: &CudaBackend,
    shape: &MatmulShape,
    algorithm: &Algorithm,
    path: SplitPath,
    (a, b): (&'a CudaSlice<f32>, &'a CudaSlice<f32>),
    coded: [bool; 2],
) -> Result<Prepared<'a>> {
    let plain = |a, b| Prepared {
        a,
        b,
        scales: None,
        fp8_gemm: None,
        split: None,
    };
    let (la, lb) = (shape.a_len(), shape.b_len());
    let codes = |x: &'a CudaSlice<f32>, len: usize, coded: bool, format: Format| {
        if !coded {
            return encode_16(cb, x, len, format).map(Codes::Encoded);
        }
        // SAFETY: a coded tensor's buffer holds its codes (two to each f32 word) and is at
        // least len.div_ceil(2) words long (TensorInfo::words); u16 has no invalid values.
        unsafe { x.transmute::<u16>(len) }
            .map(Codes::Stored)
            .ok_or_else(|| {
                Error::invalid(
                    "matmul operand",
                    format!("a buffer of {} words holds no {len} codes", x.len()),
                )
            })
    };
    Ok(match *algorithm {
        Algorithm::F32 => plain(Held::F32(a), Held::F32(b)),
        Algorithm::Tf32 => plain(
            Held::Tf32(round(cb, a, la, Format::Tf32)?),
            Held::Tf32(round(cb, b, lb, Format::Tf32)?),
        ),
        Algorithm::Bf16 => plain(
            Held::Bf16(codes(a, la, coded[0], Format::Bf16)?),
            Held::Bf16(codes(b, lb, coded[1], Format::Bf16)?),
        ),
        Algorithm::F16 => plain(
            Held::F16(codes(a, la, coded[0], Format::F16)?),
            Held::F16(codes(b, lb, coded[1], Format::F16)?),
        ),
        Algorithm::Bf16x3 | Algorithm::Bf16x6 | Algorithm::Bf16x9 => {
            match path.arrangement(&layout_of(algorithm)?, shape) {
                Some(arrangement) => split_planes(cb, shape, algorithm, arrangement, a, b)?,
                None => plain(Held::F32(a), Held::F32(b)),
            }
        }
        Algorithm::Fp8 {
            a: fa,
            b: fb,
            scaling,
        } => fp8_prepare(cb, shape, (fa, fb), scaling, a, b)?,
    })
}

/// C = op(A) . op(B) from operands `prepare` made for the same shape and algorithm.
pub(super) fn product(
    cb: &CudaBackend,
    s: &MatmulShape,
    algorithm: &Algorithm,
    p: &mut Prepared,
    c: &mut CudaSlice<f32>,
) -> Result<()> {
    if s.c_len() == 0 {
        return Ok(());
    }
    if s.k == 0 {
        // An empty sum: C is 0 on every path (no GEMM writes it, and C may be a reused buffer).
        let len = c.len();
        let mut out = c.try_slice_mut(0..s.c_len()).ok_or_else(|| {
            Error::invalid("matmul", format!("C holds {len} values, not {}", s.c_len()))
        })?;
        return cb
            .stream
            .memset_zeros(&mut out)
            .map_err(|e| cb.device_error("matmul", e));
    }
    let f32_compute = Compute::CUBLAS_COMPUTE_32F;
    match (&p.a, &p.b) {
        (Held::F32(a), Held::F32(b)) if algorithm.is_split() => {
            split_matmul(cb, s, algorithm.split_levels(), a, b, c)?
        }
        (Held::F32(a), Held::F32(b)) => gemm(cb, s, Type::CUDA_R_32F, *a, *b, c, f32_compute)?,
        (Held::Tf32(a), Held::Tf32(b)) => {
            let compute = Compute::CUBLAS_COMPUTE_32F_FAST_TF32;
            gemm(cb, s, Type::CUDA_R_32F, a, b, c, compute)?
        }
        (Held::Bf16(a), Held::Bf16(b)) => {
            let (a, b) = (a.view(), b.view());
            gemm(cb, s, Type::CUDA_R_16BF, &a, &b, c, f32_compute)?
        }
        (Held::F16(a), Held::F16(b)) => {
            let (a, b) = (a.view(), b.view());
            gemm(cb, s, Type::CUDA_R_16F, &a, &b, c, f32_compute)?
        }
        (Held::Planes(a), Held::Planes(b)) => {
            let Some((arrangement, scratch)) = p.split.as_mut() else {
                return Err(Error::invalid(
                    "split matmul",
                    "planes prepared without GEMMs",
                ));
            };
            split_gemms(cb, s, algorithm, *arrangement, (a, b), scratch.as_mut(), c)?
        }
        (Held::Fp8(a), Held::Fp8(b)) => {
            let (g, lt) = match (&p.fp8_gemm, cb.lt.get()) {
                (Some(g), Some(Ok(lt))) => (g, lt),
                _ => {
                    return Err(Error::invalid(
                        "fp8 GEMM",
                        "operands prepared without cuBLASLt",
                    ));
                }
            };
            fp8::gemm(cb, lt, g, a, b, c).map_err(|e| {
                cb.fp8_gemm_failed(e);
                cb.device_error("cuBLASLt fp8 GEMM", e)
            })?
        }
        _ => {
            return Err(Error::invalid(
                "matmul operands",
                format!("not prepared for {algorithm}"),
            ));
        }
    }
    if let Some(scales) = &p.scales {
        descale(cb, s, scales, c)?;
    }
    Ok(())
}

/// Refuses sizes cuBLAS's 32-bit arguments cannot hold.
fn check_sizes(shape: &MatmulShape) -> Result<()> {
    for (what, v) in [
        ("m", shape.m),
        ("n", shape.n),
        ("k", shape.k),
        ("batch", shape.batch),
    ] {
        if v > i32::MAX as usize {
            return Err(Error::invalid(
                "matmul shape",
                format!("{what} = {v} exceeds cuBLAS's 32-bit sizes"),
            ));
        }
    }
    Ok(())
}

/// How split-bf16 matmuls run: cuBLAS bf16 GEMMs over split planes, one per level (split.rs;
/// vendor speed without tuning), bf16x3 as one K-tripled GEMM, bf16x6/x9's promoted level 0 as
/// partial sums, or the fused `mma.sync` kernel (`matmul_split_bf16.cu`, which promotes every
/// level in registers). The fastest that can run a shape is chosen per (device, algorithm,
/// shape class) and cached (`split_path`); `MANTISSA_CUDA_SPLIT` forces one (where it cannot run
/// a shape, that shape takes the per-level GEMMs), `auto` (the default) lets the tuner choose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SplitPath {
    /// Per-level cuBLAS bf16 GEMMs over split planes (`split.rs`): the default, and the fallback.
    #[default]
    Gemms,
    /// The fused `mma.sync` kernel (`matmul_split_bf16.cu`).
    Fused,
    /// bf16x3 as one K-tripled GEMM (up to `split::TRIPLED_MAX_K`).
    Tripled,
    /// bf16x6/x9's promoted level 0 as strided-batched partial sums.
    Partials,
}

impl SplitPath {
    const ALL: [SplitPath; 4] = [
        SplitPath::Gemms,
        SplitPath::Fused,
        SplitPath::Tripled,
        SplitPath::Partials,
    ];

    /// The path `MANTISSA_CUDA_SPLIT` forces, if any (none: unset or `auto`).
    pub fn from_env() -> Result<Option<SplitPath>> {
        match crate::env::word("MANTISSA_CUDA_SPLIT")? {
            None | Some("auto") => Ok(None),
            Some(path) => path.parse().map(Some),
        }
    }

    fn name(self) -> &'static str {
        match self {
            SplitPath::Gemms => "gemms",
            SplitPath::Fused => "fused",
            SplitPath::Tripled => "tripled",
            SplitPath::Partials => "partials",
        }
    }

    /// How this path arranges the GEMMs over split planes for `s` (none: the fused kernel,
    /// which reads f32), where it can run `s`.
    fn arrangement(self, layout: &SplitLayout, s: &MatmulShape) -> Option<Arrangement> {
        let offered = layout.arrangements(s);
        let wanted = |a: &&Arrangement| match self {
            SplitPath::Gemms => **a == Arrangement::PerLevel,
            SplitPath::Tripled => **a == Arrangement::Tripled,
            SplitPath::Partials => matches!(a, Arrangement::Partials { .. }),
            SplitPath::Fused => false,
        };
        offered.iter().find(wanted).copied()
    }

    /// The paths that can run a split matmul of `s` under `algorithm`, per-level GEMMs first.
    pub fn candidates(algorithm: &Algorithm, s: &MatmulShape) -> Vec<SplitPath> {
        let Some(layout) = SplitLayout::of(algorithm) else {
            return vec![SplitPath::Gemms];
        };
        SplitPath::ALL
            .into_iter()
            .filter(|p| *p == SplitPath::Fused || p.arrangement(&layout, s).is_some())
            .collect()
    }
}

impl std::str::FromStr for SplitPath {
    type Err = Error;
    fn from_str(s: &str) -> Result<SplitPath> {
        let given = s.trim().to_ascii_lowercase();
        if given == "cublas" {
            return Ok(SplitPath::Gemms);
        }
        SplitPath::ALL
            .into_iter()
            .find(|p| p.name() == given)
            .ok_or_else(|| Error::UnknownName {
                kind: "split-bf16 path (MANTISSA_CUDA_SPLIT)",
                given: s.to_string(),
                valid: std::iter::once("auto")
                    .chain(SplitPath::ALL.map(SplitPath::name))
                    .map(String::from)
                    .collect(),
            })
    }
}

/// The split paths tuning tries for `s`: those MANTISSA_TUNE_CANDIDATES lists under "cuda" that
/// can run it, in its order, or every one that can.
fn listed_split_paths(algorithm: &Algorithm, s: &MatmulShape) -> Result<Vec<SplitPath>> {
    let offered = SplitPath::candidates(algorithm, s);
    Ok(match crate::tune::listed::<SplitPath>("cuda")? {
        Some(listed) => listed.into_iter().filter(|p| offered.contains(p)).collect(),
        None => offered,
    })
}

/// The split path already settled for `shape` (see `split_path`), or the tuner's key under
/// which it is still to be tuned.
fn settled_split_path(
    cb: &CudaBackend,
    s: &MatmulShape,
    algorithm: &Algorithm,
) -> std::result::Result<(SplitPath, bool), String> {
    let candidates = SplitPath::candidates(algorithm, s);
    if let Some(path) = cb.split_path {
        let runs = candidates.contains(&path);
        return Ok((if runs { path } else { SplitPath::default() }, false));
    }
    if !algorithm.is_split() || cb.tuner.mode() == AutotuneMode::Off || s.flops() < TUNE_MIN_FLOPS {
        return Ok((SplitPath::default(), false));
    }
    let (major, minor) = cb.info.compute_capability;
    // A choice among the paths MANTISSA_TUNE_CANDIDATES lists is kept apart.
    let listed = match listed_split_paths(algorithm, s) {
        Ok(paths) if paths != candidates => format!(
            " | listed {}",
            paths.iter().map(|p| p.name()).collect::<Vec<_>>().join(",")
        ),
        _ => String::new(),
    };
    let key = format!(
        "{} | sm_{major}{minor} | {algorithm} | {}{listed}",
        cb.info.name,
        shape_class(s)
    );
    // A choice that is not among this shape's candidates (an older cache's, or one made for
    // another shape of the class) is tuned again.
    match cb.tuner.get(&key) {
        Some(path) if candidates.contains(&path) => Ok((path, true)),
        _ => Err(key),
    }
}

/// The path a split-bf16 matmul of `shape` takes, and whether the tuner chose it: the forced
/// one; the GEMMs (untuned) when tuning is off or the product is under `TUNE_MIN_FLOPS`; else
/// the cached choice for (device, algorithm, shape class), or, the first time, the fastest of
/// the candidates timed on these operands (all meet the contract: the conformance suite and
/// the host harness run each). A candidate that fails to compile or run is dropped, and said.
fn split_path(
    cb: &CudaBackend,
    s: &MatmulShape,
    algorithm: &Algorithm,
    a: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
) -> Result<(SplitPath, bool)> {
    let key = match settled_split_path(cb, s, algorithm) {
        Ok(settled) => return Ok(settled),
        Err(key) => key,
    };
    let mut c = cb.zeros::<f32>(s.c_len())?;
    let mut search = cb.tuner.search(&key);
    for path in listed_split_paths(algorithm, s)? {
        if !search.open() {
            continue;
        }
        let once = |c: &mut CudaSlice<f32>| {
            let mut p = prepare_on(cb, s, algorithm, path, (a, b), [false; 2])?;
            product(cb, s, algorithm, &mut p, c)
        };
        // One untimed run: compiles the kernel, warms cuBLAS's heuristics.
        let timed = once(&mut c)
            .and_then(|()| cb.time_events(TUNE_RUNS, || once(&mut c)))
            .map(|mut times| crate::backend::median(&mut times));
        let name = format!("the split-bf16 path {}", path.name());
        search.record(path, &name, timed);
    }
    match search.finish()? {
        Some((path, _)) => {
            cb.tuner.put(key, path);
            Ok((path, true))
        }
        None => Ok((SplitPath::default(), false)),
    }
}

/// Which kernels run an algorithm on this backend (`mantissa info` shows it).
pub fn variant(cb: &CudaBackend, algorithm: &Algorithm) -> String {
    describe(cb, algorithm, cb.split_path.map(|p| (p, false)))
}

/// Which kernels ran a matmul of `shape` (benchmarks show it): split algorithms name the path
/// chosen for its shape class.
pub(super) fn variant_of_run(
    cb: &CudaBackend,
    shape: &MatmulShape,
    algorithm: &Algorithm,
) -> String {
    describe(cb, algorithm, settled_split_path(cb, shape, algorithm).ok())
}

/// The kernels of `algorithm`, split ones on `split` (none: chosen per shape class).
fn describe(cb: &CudaBackend, algorithm: &Algorithm, split: Option<(SplitPath, bool)>) -> String {
    let tuned = |t: bool| if t { " (autotuned)" } else { "" };
    match (algorithm, split) {
        (Algorithm::F32, _) => "cuBLAS SGEMM (CUDA cores)".into(),
        (Algorithm::Tf32, _) => "cuBLAS, TF32 tensor cores".into(),
        (Algorithm::Bf16, _) => "cuBLAS, bf16 tensor cores, f32 out".into(),
        (Algorithm::F16, _) => "cuBLAS, f16 tensor cores, f32 out".into(),
        (Algorithm::Fp8 { a, b, .. }, _) => {
            let lt = cb.fp8_path == fp8::Fp8Path::Cublaslt && !cb.fp8_off.load(Ordering::Relaxed);
            match fp8::Fp8Gemm::supported(*a, *b, cb.info.compute_capability) {
                Ok(_) if lt => {
                    "quantized to fp8 (rows of A, columns of B contiguous in K, padded to 16), \
                     cuBLASLt fp8 GEMM without fast accumulation, f32 out, descaled (n not a \
                     multiple of 4: the f16 path); MANTISSA_CUDA_FP8=cublaslt: the tensor \
                     core's accumulation, outside the contract"
                        .into()
                }
                _ => "quantized to fp8 values held as f16 (exact), cuBLAS f16 tensor cores, \
                      f32 accumulation, descaled (MANTISSA_CUDA_FP8=cublaslt: cuBLASLt's fp8 \
                      GEMM, faster, outside the contract)"
                    .into(),
            }
        }
        (a, Some((SplitPath::Gemms, t))) => format!(
            "split into bf16 planes, {} cuBLAS bf16 GEMMs (one per level, K concatenated), f32 \
             out{}{}",
            a.split_levels(),
            if a.split_levels() >= 3 {
                ", level 0 promoted every 256"
            } else {
                ", level 0 adding level 1 in its epilogue"
            },
            tuned(t)
        ),
        (_, Some((SplitPath::Tripled, t))) => format!(
            "split into bf16 planes, one cuBLAS bf16 GEMM over 3K (h.h + h.m + m.h, one f32 \
             accumulator; K up to {}){}",
            super::split::TRIPLED_MAX_K,
            tuned(t)
        ),
        (a, Some((SplitPath::Partials, t))) => format!(
            "split into bf16 planes, level 0 as strided-batched cuBLAS bf16 GEMMs over K chunks \
             of 256 into f32 partials summed in order with the {} lower levels' GEMMs{}",
            a.split_levels() - 1,
            tuned(t)
        ),
        (a, Some((SplitPath::Fused, t))) => format!(
            "matmul_split_bf16.cu, {} levels, mma.sync m16n8k16, tile 64x64x32, promoted every \
             256{}",
            a.split_levels(),
            tuned(t)
        ),
        (a, None) => format!(
            "split into bf16 planes: {} per-level cuBLAS GEMMs, {}or the fused mma.sync kernel, \
             the fastest per shape class (tuned; MANTISSA_CUDA_SPLIT={} forces one)",
            a.split_levels(),
            if a.split_levels() == 2 {
                "one K-tripled GEMM "
            } else {
                "level 0's chunks as partial sums "
            },
            SplitPath::ALL.map(SplitPath::name).join("|")
        ),
    }
}

/// One strided-batched cublasGemmEx with f32 output over the shape's own operands; `ty` is the
/// operands' type.
fn gemm<T>(
    cb: &CudaBackend,
    s: &MatmulShape,
    ty: Type,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    c: &mut CudaSlice<f32>,
    compute: Compute,
) -> Result<()> {
    gemm_call(cb, &GemmCall::plain(s), ty, a, b, c, compute)
}

/// Runs `call` (split.rs says what it computes) with `c` as its output.
fn gemm_call<T>(
    cb: &CudaBackend,
    call: &GemmCall,
    ty: Type,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    c: &mut CudaSlice<f32>,
    compute: Compute,
) -> Result<()> {
    if call.k == 0 || call.m == 0 || call.n == 0 || call.batch == 0 {
        // Nothing to compute (`product` zeroes C for an empty sum).
        return Ok(());
    }
    let (a_end, b_end, c_end) = call.extents();
    if a_end > a.len() || b_end > b.len() || c_end > c.len() {
        return Err(Error::invalid(
            "cuBLAS GEMM",
            format!(
                "operands of {}, {} and {} elements reach {a_end}, {b_end} and {c_end}",
                a.len(),
                b.len(),
                c.len()
            ),
        ));
    }
    let int = |what: &str, v: usize| {
        i32::try_from(v).map_err(|_| {
            Error::invalid(
                "matmul shape",
                format!("{what} = {v} exceeds cuBLAS's 32-bit sizes"),
            )
        })
    };
    let (m, n, k) = (int("m", call.m)?, int("n", call.n)?, int("k", call.k)?);
    let (lda, ldb, batch) = (
        int("lda", call.lda)?,
        int("ldb", call.ldb)?,
        int("batch", call.batch)?,
    );
    // Row-major C = A . B is column-major C^T = B^T . A^T: B is cuBLAS's first operand.
    let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
    let (alpha, beta) = (1f32, call.beta);
    let size = std::mem::size_of::<T>() as u64;
    let stream = cb.stream.as_ref();
    let (pa, _ra) = a.device_ptr(stream);
    let (pb, _rb) = b.device_ptr(stream);
    let (pc, _rc) = c.device_ptr_mut(stream);
    let (pa, pb, pc) = (
        pa + call.a_offset as u64 * size,
        pb + call.b_offset as u64 * size,
        pc + call.c_offset as u64 * 4,
    );
    cb.count_launch();
    // SAFETY: every element the call reads or writes lies within the buffers (the extents
    // were checked above), and alpha/beta are host f32 as COMPUTE_32F* expects.
    unsafe {
        cudarc::cublas::result::gemm_strided_batched_ex(
            *cb.blas.handle(),
            op(call.b_transposed),
            op(call.a_transposed),
            n,
            m,
            k,
            &alpha as *const f32 as *const _,
            pb as *const _,
            ty,
            ldb,
            call.b_stride as i64,
            pa as *const _,
            ty,
            lda,
            call.a_stride as i64,
            &beta as *const f32 as *const _,
            pc as *mut _,
            Type::CUDA_R_32F,
            n,
            call.c_stride as i64,
            batch,
            compute,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| cb.device_error("cublasGemmEx", e))
}

/// One operand of cast.cu's `split_planes` (by value, laid out as its `SplitOperand`).
#[repr(C)]
#[derive(Clone, Copy)]
struct SplitOperand {
    x: u64,
    out: u64,
    sb: i64,
    sr: i64,
    sc: i64,
    ob: i64,
    orow: i64,
    os: i64,
    batches: u32,
    rows: u32,
    cols: u32,
    slots: [u32; 4],
}

// SAFETY: a plain #[repr(C)] struct of 8-byte then 4-byte fields, laid out as cast.cu's
// `SplitOperand` (96 bytes with the tail padding both add).
unsafe impl DeviceRepr for SplitOperand {}

impl super::ParamSize for &SplitOperand {
    fn param_size(&self) -> usize {
        std::mem::size_of::<SplitOperand>()
    }
}

/// Split-bf16 operands for the cuBLAS GEMMs (split.rs) in `arrangement`: both operands split
/// into their plane layouts in one launch, and the scratch the arrangement needs.
fn split_planes<'a>(
    cb: &CudaBackend,
    s: &MatmulShape,
    algorithm: &Algorithm,
    arrangement: Arrangement,
    a: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
) -> Result<Prepared<'a>> {
    let layout = layout_of(algorithm)?;
    let (a_len, b_len) = layout.plane_lens(s)?;
    // SAFETY (both): split_planes writes every slot of every element, and the layout has no
    // other elements.
    let pa = unsafe { cb.uninit::<u16>(a_len)? };
    let pb = unsafe { cb.uninit::<u16>(b_len)? };
    let [ma, mb] = layout.plane_maps(s);
    let operand = |x: &CudaSlice<f32>, planes, map: PlaneMap| SplitOperand {
        x: cb.ptr(x),
        out: planes,
        sb: map.source[0],
        sr: map.source[1],
        sc: map.source[2],
        ob: map.out[0],
        orow: map.out[1],
        os: map.out[2],
        batches: s.batch as u32,
        rows: map.rows as u32,
        cols: map.cols as u32,
        slots: map.slots,
    };
    let (oa, ob) = (operand(a, cb.ptr(&pa), ma), operand(b, cb.ptr(&pb), mb));
    let widest = s.k.max(s.n);
    let lines = s.batch * (s.m + s.k);
    launch!(cb, Module::Cast, "split_planes", config_lines(cb, lines, widest); &oa, &ob)?;
    // SAFETY: every arrangement writes its scratch before it reads it: the lower levels' sum
    // and every partial plane a sum reads by a GEMM with beta 0 (split.rs).
    let scratch = match layout.scratch_len(s, arrangement)? {
        0 => None,
        len => Some(unsafe { cb.uninit::<f32>(len)? }),
    };
    Ok(Prepared {
        a: Held::Planes(pa),
        b: Held::Planes(pb),
        scales: None,
        fp8_gemm: None,
        split: Some((arrangement, scratch)),
    })
}

fn layout_of(algorithm: &Algorithm) -> Result<SplitLayout> {
    SplitLayout::of(algorithm)
        .ok_or_else(|| Error::invalid("split matmul", format!("{algorithm} does not split")))
}

/// A split-bf16 matmul as cuBLAS bf16 GEMMs over the planes in `arrangement`, with the sums
/// between them (split.rs's steps).
fn split_gemms(
    cb: &CudaBackend,
    s: &MatmulShape,
    algorithm: &Algorithm,
    arrangement: Arrangement,
    (pa, pb): (&CudaSlice<u16>, &CudaSlice<u16>),
    mut scratch: Option<&mut CudaSlice<f32>>,
    c: &mut CudaSlice<f32>,
) -> Result<()> {
    let layout = layout_of(algorithm)?;
    let compute = Compute::CUBLAS_COMPUTE_32F;
    let no_scratch = || Error::invalid("split matmul", "no scratch prepared for its sums");
    for step in layout.steps(s, arrangement)? {
        match step {
            Step::Gemm(call) => {
                let out = match call.out {
                    Out::C => &mut *c,
                    Out::Lower | Out::Partials => scratch.as_deref_mut().ok_or_else(no_scratch)?,
                };
                gemm_call(cb, &call, Type::CUDA_R_16BF, pa, pb, out, compute)?;
            }
            Step::AddLower => {
                let lower = scratch.as_deref().ok_or_else(no_scratch)?;
                // `add` repeats x every u32 elements: C += lower in place, in f32, in pieces
                // that fit one.
                const PIECE: usize = 1 << 30;
                for start in (0..s.c_len()).step_by(PIECE) {
                    let len = PIECE.min(s.c_len() - start);
                    let x = cb.ptr(&lower.slice(start..start + len));
                    let y = cb.ptr(&c.slice(start..start + len));
                    let f32_ = (Format::F32, Format::F32, Format::F32, false);
                    let none = (0, Format::F32);
                    train::add(
                        cb,
                        [x, y, y],
                        (len, len),
                        f32_,
                        none,
                        (0, Format::F32, false),
                    )?;
                }
            }
            Step::Sum { count, into_c } => {
                let partials = scratch.as_deref().ok_or_else(no_scratch)?;
                let plane = s.c_len();
                if partials.len() < count * plane || c.len() < plane {
                    return Err(Error::invalid(
                        "split matmul",
                        format!("{count} partial planes of {plane} exceed the scratch or C"),
                    ));
                }
                let from = cb.ptr(partials);
                let into = if into_c { cb.ptr(c) } else { from };
                let (count, len) = (count as u32, plane as u32);
                launch_1d!(cb, Module::Train, "sum_partials", plane; &from, &into, &count, &len)?;
            }
        }
    }
    Ok(())
}

/// The launch of a kernel striding over `lines` rows of up to `width` elements (read four at a
/// time): a row's columns over the x dimensions of the grid and the block, the rows over their
/// y dimensions (a block spans several rows where they are short), as many blocks as the device
/// keeps resident.
fn config_lines(cb: &CudaBackend, lines: usize, width: usize) -> LaunchConfig {
    let quads = width.div_ceil(4).max(1);
    let tx = quads.next_power_of_two().clamp(32, THREADS);
    let ty = THREADS / tx;
    let x = quads.div_ceil(tx).clamp(1, 64);
    let y = (resident_blocks(cb) / x).clamp(1, lines.div_ceil(ty).clamp(1, 65535));
    LaunchConfig {
        grid_dim: (x as u32, y as u32, 1),
        block_dim: (tx as u32, ty as u32, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads of a block of the conversion kernels.
const THREADS: usize = 256;

/// Blocks of `THREADS` the device keeps resident at once (2048 threads per multiprocessor on
/// every architecture the backend runs on, 1536 on 8.6 and 8.9): a grid that strides over its
/// elements with these keeps every multiprocessor busy without launching idle blocks.
fn resident_blocks(cb: &CudaBackend) -> usize {
    let per_sm = match cb.info.compute_capability {
        (8, 6) | (8, 9) => 6,
        _ => 8,
    };
    cb.info.multiprocessors.max(1) as usize * per_sm
}

/// The launch of an elementwise conversion over `n` elements read four at a time: a
/// grid-stride loop over as many blocks as the device keeps resident, fewer for small `n`.
fn config_convert(cb: &CudaBackend, n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            n.div_ceil(4 * THREADS).clamp(1, resident_blocks(cb)) as u32,
            1,
            1,
        ),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The first `len` values of x rounded to `format` (operands are addressed by the shape's
/// lengths, never the buffers': a resident plan's buffers may be larger than its tensors).
fn round(
    cb: &CudaBackend,
    x: &CudaSlice<f32>,
    len: usize,
    format: Format,
) -> Result<CudaSlice<f32>> {
    // SAFETY: round_to writes all `len` values.
    let mut out = unsafe { cb.uninit::<f32>(len)? };
    let (n, fmt) = (len as i64, format_id(format));
    if len > 0 {
        launch!(cb, Module::Cast, "round_to", config_convert(cb, len); x, &mut out, &n, &fmt)?;
    }
    Ok(out)
}

fn encode_16(
    cb: &CudaBackend,
    x: &CudaSlice<f32>,
    len: usize,
    format: Format,
) -> Result<CudaSlice<u16>> {
    // SAFETY: encode_16 writes all `len` values.
    let mut out = unsafe { cb.uninit::<u16>(len)? };
    let (n, fmt) = (len as i64, format_id(format));
    if len > 0 {
        launch!(cb, Module::Cast, "encode_16", config_convert(cb, len); x, &mut out, &n, &fmt)?;
    }
    Ok(out)
}

/// The fused split-bf16 kernel: one block per 64 x 64 tile of C and batch.
fn split_matmul(
    cb: &CudaBackend,
    s: &MatmulShape,
    levels: usize,
    a: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
    c: &mut CudaSlice<f32>,
) -> Result<()> {
    const TILE: usize = 64;
    if s.batch > 65535 || s.m.div_ceil(TILE) > 65535 {
        return Err(Error::invalid(
            "matmul shape",
            format!(
                "batch {} or m {} exceeds the split kernel's grid",
                s.batch, s.m
            ),
        ));
    }
    let f = cb
        .kernels
        .function(Module::SplitMatmul { levels }, "matmul_split_bf16")?;
    let (m, n, k) = (s.m as i64, s.n as i64, s.k as i64);
    // Strides of A's (i, p) and B's (p, j), and of a batch.
    let (a_row, a_col) = if s.a_transposed { (1, m) } else { (k, 1) };
    let (b_row, b_col) = if s.b_transposed { (1, k) } else { (n, 1) };
    let (a_batch, b_batch) = (m * k, k * n);
    let dims = (s.m as u32, s.n as u32, s.k as u32);
    let mut launch = cb.stream.launch_builder(&f);
    launch
        .arg(a)
        .arg(b)
        .arg(c)
        .arg(&dims.0)
        .arg(&dims.1)
        .arg(&dims.2)
        .arg(&a_row)
        .arg(&a_col)
        .arg(&a_batch)
        .arg(&b_row)
        .arg(&b_col)
        .arg(&b_batch);
    let cfg = LaunchConfig {
        grid_dim: (
            s.n.div_ceil(TILE) as u32,
            s.m.div_ceil(TILE) as u32,
            s.batch as u32,
        ),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the kernel reads A and B only at indices below batch * m * k and batch * k * n
    // (bounds-checked per element) and writes C below batch * m * n.
    unsafe { launch.launch(cfg) }
        .map(|_| ())
        .map_err(|e| cb.device_error("matmul_split_bf16", e))
}

/// Which scale group an element of an operand falls in (cuda/formats.cuh, `Groups`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Groups {
    batch_len: u32,
    div: u32,
    modulus: u32,
    per_batch: u32,
}

impl Groups {
    /// One group for all `len` values.
    pub(super) fn whole(len: usize) -> Groups {
        Groups {
            batch_len: len.max(1) as u32,
            div: len.max(1) as u32,
            modulus: 1,
            per_batch: 1,
        }
    }

    /// One group per batch of `rows x cols` (tensorwise scaling), or per line: per row of a
    /// row-major `rows x cols` matrix (`along_rows`) or per column.
    fn of(rows: usize, cols: usize, lines: Option<bool>) -> Groups {
        let batch_len = (rows * cols).max(1) as u32;
        match lines {
            None => Groups {
                batch_len,
                div: batch_len,
                modulus: 1,
                per_batch: 1,
            },
            Some(true) => Groups {
                batch_len,
                div: cols.max(1) as u32,
                modulus: rows.max(1) as u32,
                per_batch: rows.max(1) as u32,
            },
            Some(false) => Groups {
                batch_len,
                div: 1,
                modulus: cols.max(1) as u32,
                per_batch: cols.max(1) as u32,
            },
        }
    }
}

/// amax of every group of `x` (its first `len` values) into `bits` (f32 bits, zeroed).
pub(super) fn amax_groups(
    cb: &CudaBackend,
    x: &CudaSlice<f32>,
    len: usize,
    bits: &mut CudaSlice<u32>,
    g: Groups,
) -> Result<()> {
    let n = len as i64;
    launch!(cb, Module::Scale, "amax", CudaBackend::config_amax(len); x, &n, bits, &g.batch_len, &g.div, &g.modulus, &g.per_batch)
}

/// fp8 operands: scales (current, per tensor or per line; or given), then quantization into
/// fp8 bytes for cuBLASLt's fp8 GEMM where the GPU and the shape allow (fp8.rs), else into
/// f16 codes of the fp8 values for an f16 GEMM (the same products, the same f32 accumulation).
fn fp8_prepare<'a>(
    cb: &CudaBackend,
    s: &MatmulShape,
    (fa, fb): (Format, Format),
    scaling: Scaling,
    a: &CudaSlice<f32>,
    b: &CudaSlice<f32>,
) -> Result<Prepared<'a>> {
    // A's rows are its stored rows unless transposed (then its stored columns); B's columns are
    // its stored columns unless transposed (then its stored rows).
    let rowwise = scaling == Scaling::Rowwise;
    let (a_rows, a_cols) = if s.a_transposed {
        (s.k, s.m)
    } else {
        (s.m, s.k)
    };
    let (b_rows, b_cols) = if s.b_transposed {
        (s.n, s.k)
    } else {
        (s.k, s.n)
    };
    let ga = Groups::of(a_rows, a_cols, rowwise.then_some(!s.a_transposed));
    let gb = Groups::of(b_rows, b_cols, rowwise.then_some(s.b_transposed));
    let scales = |x: &CudaSlice<f32>, len: usize, g: Groups, format: Format, given: Option<f32>| {
        let count = s.batch * g.per_batch as usize;
        if let Some(v) = given {
            return cb.upload(&vec![v; count]);
        }
        let mut bits = cb.zeros::<u32>(count)?;
        amax_groups(cb, x, len, &mut bits, g)?;
        // SAFETY: scale_from_amax writes all `count` scales.
        let mut out = unsafe { cb.uninit::<f32>(count)? };
        let (groups, fmax) = (count as u32, format.max());
        launch_1d!(cb, Module::Scale, "scale_from_amax", count; &bits, &mut out, &groups, &fmax)?;
        Ok(out)
    };
    let (given_a, given_b) = match scaling {
        Scaling::Given { a, b } => (Some(a), Some(b)),
        _ => (None, None),
    };
    let sa = scales(a, s.a_len(), ga, fa, given_a)?;
    let sb = scales(b, s.b_len(), gb, fb, given_b)?;
    let (a_held, b_held, fp8_gemm) = match cb.fp8_gemm(s, fa, fb) {
        Some((g, _)) => {
            let place = |x: &CudaSlice<f32>,
                         format: Format,
                         scales: &CudaSlice<f32>,
                         gr: Groups,
                         p: Placement,
                         bytes: usize| {
                // Zeroed: K's padding must add nothing.
                let mut out = cb.zeros::<u8>(bytes)?;
                let len = s.batch * p.rows * p.cols;
                let (n, fmt, rows, cols) =
                    (len as i64, format_id(format), p.rows as u32, p.cols as u32);
                let (ob, or, oc) = (
                    p.batch_stride as i64,
                    p.row_stride as i64,
                    p.col_stride as i64,
                );
                launch_1d!(cb, Module::Cast, "quantize_to_fp8", len; x, &mut out, &n, &fmt, scales,
                    &gr.batch_len, &gr.div, &gr.modulus, &gr.per_batch, &rows, &cols, &ob, &or, &oc)?;
                Ok::<_, Error>(Held::Fp8(out))
            };
            let (a_bytes, b_bytes) = g.lens();
            let qa = place(a, fa, &sa, ga, g.a_placement(s.a_transposed), a_bytes)?;
            let qb = place(b, fb, &sb, gb, g.b_placement(s.b_transposed), b_bytes)?;
            (qa, qb, Some(g))
        }
        None => {
            let quantize = |x: &CudaSlice<f32>,
                            len: usize,
                            format: Format,
                            scales: &CudaSlice<f32>,
                            g: Groups| {
                // SAFETY: quantize_to_f16 writes all `len` values.
                let mut out = unsafe { cb.uninit::<u16>(len)? };
                let (n, fmt) = (len as i64, format_id(format));
                if len > 0 {
                    launch!(cb, Module::Cast, "quantize_to_f16", config_convert(cb, len); x, &mut out, &n, &fmt, scales, &g.batch_len, &g.div, &g.modulus, &g.per_batch)?;
                }
                Ok::<_, Error>(Held::F16(Codes::Encoded(out)))
            };
            let qa = quantize(a, s.a_len(), fa, &sa, ga)?;
            let qb = quantize(b, s.b_len(), fb, &sb, gb)?;
            (qa, qb, None)
        }
    };
    Ok(Prepared {
        a: a_held,
        b: b_held,
        scales: Some(Fp8Scales {
            a: sa,
            b: sb,
            rowwise,
        }),
        fp8_gemm,
        split: None,
    })
}

/// C /= (A's scale of its row) * (B's scale of its column).
fn descale(
    cb: &CudaBackend,
    s: &MatmulShape,
    scales: &Fp8Scales,
    c: &mut CudaSlice<f32>,
) -> Result<()> {
    let n = s.c_len() as i64;
    let (rows, cols) = (s.m as u32, s.n as u32);
    let (a_groups, b_groups) = match scales.rowwise {
        true => (rows, cols),
        false => (1, 1),
    };
    launch!(cb, Module::Scale, "descale", config_convert(cb, s.c_len()); c, &n, &rows, &cols, &scales.a, &a_groups, &scales.b, &b_groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_paths_parse_and_persist_by_name() {
        assert_eq!("Fused".parse::<SplitPath>().unwrap(), SplitPath::Fused);
        assert_eq!("cublas".parse::<SplitPath>().unwrap(), SplitPath::Gemms);
        assert_eq!("tripled".parse::<SplitPath>().unwrap(), SplitPath::Tripled);
        let err = "tuned".parse::<SplitPath>().unwrap_err().to_string();
        assert!(
            err.contains("auto") && err.contains("fused") && err.contains("partials"),
            "{err}"
        );
        for path in SplitPath::ALL {
            let json = serde_json::to_string(&path).unwrap();
            assert_eq!(json, format!("\"{}\"", path.name()));
            assert_eq!(serde_json::from_str::<SplitPath>(&json).unwrap(), path);
        }
    }

    /// The tuner times only the paths that can run a shape: the K-tripled GEMM for bf16x3 up
    /// to its K limit, partial sums where level 0 of bf16x6/x9 is promoted.
    #[test]
    fn split_candidates_follow_the_shape() {
        use super::super::split::TRIPLED_MAX_K;
        use SplitPath::*;
        let at = |alg, k| SplitPath::candidates(&alg, &MatmulShape::new(512, 512, k));
        assert_eq!(
            at(Algorithm::Bf16x3, TRIPLED_MAX_K),
            [Gemms, Fused, Tripled]
        );
        assert_eq!(at(Algorithm::Bf16x3, TRIPLED_MAX_K + 1), [Gemms, Fused]);
        assert_eq!(at(Algorithm::Bf16x6, 4096), [Gemms, Fused, Partials]);
        assert_eq!(at(Algorithm::Bf16x9, 256), [Gemms, Fused]);
        assert_eq!(at(Algorithm::F32, 4096), [Gemms]);
        // Partial planes of a very wide C would not fit their budget.
        let wide = MatmulShape::new(1 << 15, 1 << 15, 4096);
        assert_eq!(
            SplitPath::candidates(&Algorithm::Bf16x6, &wide),
            [Gemms, Fused]
        );
    }
}
