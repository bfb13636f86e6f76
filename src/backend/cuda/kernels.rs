//! The kernels of `cuda/`, compiled by NVRTC at run time for the device's architecture (nothing
//! needs nvcc at build time) and loaded once per backend.
//!
//! Every module is the generated definitions (`backend::defs`), `formats.cuh`, the tensor-core
//! instructions (`mma.cuh`) where it uses them, then one `.cu` file, as the WGSL loader splices
//! `formats.wgsl`. Options keep float arithmetic IEEE (no flush to zero, divisions and square
//! roots rounded to nearest, no contraction into FMAs): the casts must match the host bit for bit.

use crate::backend::sources::Sources;
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use cudarc::nvrtc::result as nvrtc;
use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::sync::{Arc, Mutex};

/// One kernel module: a `.cu` file and the defines it is compiled with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    /// cast.cu: encode, decode, round_to, encode_16, split_bf16, quantize_to_f16.
    Cast,
    /// scale.cu: amax, scale_from_amax, descale.
    Scale,
    /// train.cu: the training step's ops besides matmul (layer norm, softmax, cross entropy,
    /// GELU, embeddings, column sums, copies, GradScaler's unscale, AdamW).
    Train,
    /// attention.cu: fused causal attention, forward and backward, per head size.
    Attention,
    /// matmul_split_bf16.cu with LEVELS = 2 (bf16x3), 3 (bf16x6) or 5 (bf16x9).
    SplitMatmul {
        /// Split levels: 2, 3 or 5.
        levels: usize,
    },
}

impl Module {
    /// Every module variant the backend can load (what the NVRTC test compiles).
    pub const ALL: [Module; 7] = [
        Module::Cast,
        Module::Scale,
        Module::Train,
        Module::Attention,
        Module::SplitMatmul { levels: 2 },
        Module::SplitMatmul { levels: 3 },
        Module::SplitMatmul { levels: 5 },
    ];

    /// The module's file under `cuda/`.
    pub fn file(self) -> &'static str {
        match self {
            Module::Cast => "cast.cu",
            Module::Scale => "scale.cu",
            Module::Train => "train.cu",
            Module::Attention => "attention.cu",
            Module::SplitMatmul { .. } => "matmul_split_bf16.cu",
        }
    }

    fn defines(self) -> Vec<String> {
        match self {
            Module::SplitMatmul { levels } => vec![format!("-DLEVELS={levels}")],
            _ => vec![],
        }
    }

    /// Whether the module uses the warp's tensor-core instructions (mma.cuh).
    fn uses_mma(self) -> bool {
        matches!(self, Module::Attention | Module::SplitMatmul { .. })
    }

    /// The source NVRTC compiles: the generated definitions (`backend::defs`), formats.cuh,
    /// mma.cuh where the module uses it, then the module's file (with `#line` so that compiler
    /// messages name the right file and line).
    pub fn source(self) -> String {
        self.source_in(Sources::Current)
    }

    /// The source NVRTC compiles, from `src`.
    pub fn source_in(self, src: Sources) -> String {
        let mma = if self.uses_mma() {
            format!("#line 1 \"mma.cuh\"\n{}\n", src.text("mma.cuh"))
        } else {
            String::new()
        };
        format!(
            "#line 1 \"defs.cuh (generated)\"\n{}\n#line 1 \"formats.cuh\"\n{}\n{mma}#line 1 \"{}\"\n{}",
            crate::backend::defs::cuda(),
            src.text("formats.cuh"),
            self.file(),
            src.text(self.file())
        )
    }

    /// The source files the module is built from (`backend::sources`).
    pub fn files(self) -> Vec<&'static str> {
        let mut files = vec!["formats.cuh", self.file()];
        if self.uses_mma() {
            files.push("mma.cuh");
        }
        files
    }

    /// The module as messages name it: its file, and its defines.
    pub fn describe(self) -> String {
        match self {
            Module::SplitMatmul { levels } => format!("{} (LEVELS={levels})", self.file()),
            _ => self.file().to_string(),
        }
    }
}

/// Whether the NVRTC library can be loaded here (cudarc panics on first use otherwise).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// What NVRTC produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Machine code for the device's own architecture (sm_XY). What the backend loads: the
    /// driver need not JIT it, so an NVRTC newer than the driver works (CUDA's minor-version
    /// compatibility covers binaries, not PTX).
    Cubin,
    /// PTX for compute_XY (to read, or for a driver to JIT).
    Ptx,
}

/// Compiles `module` for compute capability `cc` (major, minor). Works without a GPU: NVRTC is
/// a compiler library (the cubin path runs ptxas inside it too), which is how the test suite
/// checks the kernels on any machine that has it.
pub fn compile(module: Module, cc: (i32, i32), target: Target) -> Result<Vec<u8>> {
    compile_in(module, Sources::Current, cc, target)
}

/// As `compile`, from the sources `src`.
pub fn compile_in(module: Module, src: Sources, cc: (i32, i32), target: Target) -> Result<Vec<u8>> {
    if !nvrtc_present() {
        return Err(Error::BackendUnavailable {
            backend: "cuda".into(),
            why: "the NVRTC library (libnvrtc.so) is not installed".into(),
        });
    }
    let options = options(module, cc, target);
    let failed = |log: String| Error::ShaderCompile {
        kernel: module.describe(),
        log,
    };
    let source = CString::new(module.source_in(src)).map_err(|e| failed(e.to_string()))?;
    let name = CString::new(module.file()).map_err(|e| failed(e.to_string()))?;
    let program = nvrtc::create_program(&source, Some(&name)).map_err(|e| failed(e.to_string()))?;
    // SAFETY: `program` was created above and is destroyed once, at the end; `source` and
    // `name` outlive it.
    unsafe {
        let compiled = nvrtc::compile_program(program, &options);
        let output = match compiled {
            Err(e) => {
                let log = nvrtc::get_program_log(program)
                    .map(|l| c_text(&l))
                    .unwrap_or_default();
                Err(failed(format!(
                    "{e}\n{}\n(options: {})",
                    log.trim(),
                    options.join(" ")
                )))
            }
            Ok(()) => match target {
                Target::Ptx => nvrtc::get_ptx(program)
                    .map(|p| c_text(&p).into_bytes())
                    .map_err(|e| failed(e.to_string())),
                Target::Cubin => cubin(program).map_err(|e| failed(e.to_string())),
            },
        };
        let _ = nvrtc::destroy_program(program);
        output
    }
}

/// NVRTC's options for `module` on compute capability `cc`.
fn options(module: Module, cc: (i32, i32), target: Target) -> Vec<String> {
    let arch = match target {
        Target::Cubin => format!("--gpu-architecture=sm_{}{}", cc.0, cc.1),
        Target::Ptx => format!("--gpu-architecture=compute_{}{}", cc.0, cc.1),
    };
    let mut options = vec![
        arch,
        "--std=c++17".to_string(),
        // IEEE float arithmetic: the casts must match the host bit for bit.
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
        // Attention's inner loops are dot products, summed within tolerance as cuBLAS sums
        // (its products of 16-bit or tf32 inputs are exact in f32, so an FMA rounds as the
        // add alone); it rounds with integer operations, which contraction does not touch.
        format!("--fmad={}", module == Module::Attention),
    ];
    options.extend(module.defines());
    options
}

/// NVRTC's version (major, minor), 0.0 where it does not say.
fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC writes two ints; only called once the library is known to load.
    let _ = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

/// Where the cubin of `module` for `cc` is cached: named by the module and architecture, and a
/// hash of everything that shapes the binary (source, options, NVRTC's version), so that an
/// edited kernel or another NVRTC never loads a stale binary. The hash is std's, which may
/// change between Rust releases: that costs one recompile.
pub fn cubin_cache_path(
    module: Module,
    src: Sources,
    cc: (i32, i32),
) -> Option<std::path::PathBuf> {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    module.source_in(src).hash(&mut h);
    options(module, cc, Target::Cubin).hash(&mut h);
    nvrtc_version().hash(&mut h);
    let name = module
        .describe()
        .replace([' ', '(', ')', '='], "")
        .replace(".cu", "-");
    crate::cache::dir().map(|d| {
        d.join("cuda").join(format!(
            "{name}sm{}{}-{:016x}.cubin",
            cc.0,
            cc.1,
            h.finish()
        ))
    })
}

/// The text of a NUL-terminated buffer from NVRTC.
fn c_text(buffer: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = buffer
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// # Safety
/// `program` must be a compiled NVRTC program that has not been destroyed.
unsafe fn cubin(
    program: cudarc::nvrtc::sys::nvrtcProgram,
) -> std::result::Result<Vec<u8>, nvrtc::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: as the caller promises; the buffer has the size NVRTC reports.
    unsafe {
        cudarc::nvrtc::sys::nvrtcGetCUBINSize(program, &mut size).result()?;
        let mut data = vec![0u8; size];
        cudarc::nvrtc::sys::nvrtcGetCUBIN(program, data.as_mut_ptr() as *mut _).result()?;
        Ok(data)
    }
}

/// The modules of one device, compiled and loaded on first use.
pub(super) struct Kernels {
    ctx: Arc<CudaContext>,
    cc: (i32, i32),
    device: String,
    loaded: Mutex<HashMap<Module, Arc<CudaModule>>>,
    /// Kernels whose parameter sizes a launch has already matched (`check_params`).
    checked: Mutex<HashSet<usize>>,
}

impl Kernels {
    pub(super) fn new(ctx: Arc<CudaContext>, cc: (i32, i32), device: String) -> Kernels {
        Kernels {
            ctx,
            cc,
            device,
            loaded: Mutex::new(HashMap::new()),
            checked: Mutex::new(HashSet::new()),
        }
    }

    /// The module's cubin from the cache when it holds one that loads, else compiled (and
    /// cached; a cache that cannot be written costs a compile next run).
    fn load(&self, module: Module) -> Result<Arc<CudaModule>> {
        // A module built from replaced sources (MANTISSA_KERNEL_DIR) that does not compile is
        // refused, said once, and the built-in one is loaded instead.
        match self.load_from(module, Sources::Current) {
            Err(e @ Error::ShaderCompile { .. })
                if Sources::Current.replaces_any(&module.files()) =>
            {
                Sources::refuse(&module.describe(), &e.to_string());
                self.load_from(module, Sources::Builtin)
            }
            loaded => loaded,
        }
    }

    fn load_from(&self, module: Module, src: Sources) -> Result<Arc<CudaModule>> {
        let path = cubin_cache_path(module, src, self.cc);
        let cached = path.as_deref().and_then(crate::cache::read);
        // A torn or foreign file fails to load, and is replaced.
        let load = |bytes: Vec<u8>| self.ctx.load_module(Ptx::from_binary(bytes));
        if let Some(m) = cached.and_then(|bytes| load(bytes).ok()) {
            return Ok(m);
        }
        let cubin = compile_in(module, src, self.cc, Target::Cubin)?;
        if let Some(p) = &path {
            let _ = crate::cache::write_atomic(p, &cubin);
        }
        load(cubin).map_err(|e| {
            Error::device(
                &self.device,
                format!("loading {}", module.describe()),
                e,
                None,
            )
        })
    }

    /// On the first launch of `f`, that each argument is as many bytes as the kernel's
    /// parameter: the driver copies the parameter's size from each argument, so an i32 where
    /// the kernel takes an i64 (an unsuffixed literal) reads past it, into an address that
    /// faults far from its cause. Drivers without the query (before CUDA 12.4) skip it.
    pub(super) fn check_params(&self, f: &CudaFunction, name: &str, given: &[usize]) -> Result<()> {
        use cudarc::driver::sys::{self, CUresult};
        let key = f.cu_function() as usize;
        let mut checked = self.checked.lock().unwrap_or_else(|p| p.into_inner());
        if checked.contains(&key) {
            return Ok(());
        }
        let mut version = 0;
        // SAFETY: plain queries of the loaded driver into locals.
        if unsafe { sys::cuDriverGetVersion(&mut version) } != CUresult::CUDA_SUCCESS
            || version < 12040
        {
            return Ok(());
        }
        let wrong = |why: String| Err(Error::invalid("kernel launch", format!("{name}: {why}")));
        for i in 0..=given.len() {
            let (mut offset, mut size) = (0usize, 0usize);
            // SAFETY: as above; f is a loaded function of this context.
            let r = unsafe { sys::cuFuncGetParamInfo(f.cu_function(), i, &mut offset, &mut size) };
            match (given.get(i), r) {
                (Some(&g), CUresult::CUDA_SUCCESS) if g != size => {
                    return wrong(format!("argument {i} is {g} bytes, the parameter {size}"));
                }
                (Some(_), CUresult::CUDA_SUCCESS) => {}
                (Some(_), _) => return wrong(format!("{} arguments, {i} parameters", given.len())),
                (None, CUresult::CUDA_SUCCESS) => {
                    return wrong(format!("{i} arguments for more parameters"));
                }
                (None, _) => {}
            }
        }
        checked.insert(key);
        Ok(())
    }

    /// The kernel `name` of `module`.
    pub(super) fn function(&self, module: Module, name: &str) -> Result<CudaFunction> {
        let loaded = {
            let mut cache = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
            match cache.get(&module) {
                Some(m) => m.clone(),
                None => {
                    let m = self.load(module)?;
                    cache.insert(module, m.clone());
                    m
                }
            }
        };
        loaded.load_function(name).map_err(|e| {
            let op = format!("kernel {name} of {}", module.describe());
            Error::device(&self.device, op, e, None)
        })
    }
}

/// The bytes a launch argument hands the kernel (`Kernels::check_params`): a device pointer for
/// buffers and views, the value's own size for scalars and parameter structs.
pub(super) trait ParamSize {
    fn param_size(&self) -> usize;
}

macro_rules! value_params {
    ($($t:ty),*) => {$(
        impl ParamSize for &$t {
            fn param_size(&self) -> usize {
                std::mem::size_of::<$t>()
            }
        }
    )*};
}
value_params!(i32, u32, i64, u64, f32, usize);

macro_rules! pointer_params {
    ($($t:ty),*) => {$(
        impl<T> ParamSize for $t {
            fn param_size(&self) -> usize {
                std::mem::size_of::<u64>()
            }
        }
    )*};
}
pointer_params!(
    &cudarc::driver::CudaSlice<T>,
    &mut cudarc::driver::CudaSlice<T>,
    &cudarc::driver::CudaView<'_, T>,
    &mut cudarc::driver::CudaViewMut<'_, T>
);

#[cfg(test)]
mod tests {
    use super::Module;

    /// The text from `open` (just past an opening bracket) to its closing bracket, split at
    /// the top level's commas and semicolons: (pieces before the first `;`, pieces after).
    fn top_level(text: &str) -> (Vec<String>, Vec<String>) {
        let (mut depth, mut piece) = (0i32, String::new());
        let (mut head, mut tail, mut after) = (vec![], vec![], false);
        for ch in text.chars() {
            match ch {
                '(' | '[' | '{' => depth += 1,
                ')' | ']' | '}' if depth == 0 => break,
                ')' | ']' | '}' => depth -= 1,
                ',' | ';' if depth == 0 => {
                    let done = std::mem::take(&mut piece).trim().to_string();
                    if after {
                        tail.push(done)
                    } else {
                        head.push(done)
                    }
                    after |= ch == ';';
                    continue;
                }
                _ => {}
            }
            piece.push(ch);
        }
        let last = piece.trim().to_string();
        if !last.is_empty() {
            if after {
                tail.push(last)
            } else {
                head.push(last)
            }
        }
        (head, tail)
    }

    /// Each `extern "C" __global__` kernel of a module: its name and parameter count.
    fn kernels(module: Module) -> Vec<(String, usize)> {
        let text = super::Sources::Builtin.text(module.file());
        text.match_indices("__global__ void ")
            .map(|(at, m)| {
                let rest = &text[at + m.len()..];
                let open = rest.find('(').expect("a kernel's parameter list");
                let params = top_level(&rest[open + 1..]).0;
                (rest[..open].trim().to_string(), params.len())
            })
            .collect()
    }

    /// Every launch of a kernel named by a literal in the CUDA backend's sources passes as many
    /// arguments as the kernel has parameters. A launch with too few reads its missing
    /// arguments from whatever follows them (the driver's own check, `check_params`, needs a
    /// device); this catches it without one.
    #[test]
    fn every_launch_passes_its_kernel_s_parameters() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/backend/cuda");
        let mut launches = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let source = std::fs::read_to_string(&path).unwrap();
            for (at, m) in source
                .match_indices("launch_1d!(")
                .chain(source.match_indices("launch!("))
            {
                let (head, args) = top_level(&source[at + m.len()..]);
                let [_, module, name, ..] = &head[..] else {
                    continue;
                };
                // A literal name, or attention's per head size: `&kernel("family", d)`, whose
                // kernels attention.cu defines by macro as `family_##D` (and launch_1d!'s own
                // use of launch!, whose name is its parameter).
                if name.starts_with('$') {
                    continue;
                }
                let name = if let Some(n) = name.strip_prefix('"').and_then(|n| n.strip_suffix('"'))
                {
                    n.to_string()
                } else if let Some(family) = name
                    .strip_prefix("&kernel(\"")
                    .and_then(|n| n.split('"').next())
                {
                    format!("{family}_##D")
                } else {
                    panic!(
                        "{}: a launch of kernel {name}, neither a literal nor kernel(..)",
                        path.display()
                    );
                };
                let module = match module.as_str() {
                    "Module::Cast" => Module::Cast,
                    "Module::Scale" => Module::Scale,
                    "Module::Train" => Module::Train,
                    "Module::Attention" => Module::Attention,
                    other => panic!("{}: a launch from module {other}", path.display()),
                };
                let found = kernels(module);
                let Some((_, params)) = found.iter().find(|(k, _)| *k == name) else {
                    panic!("{}: no kernel {name} in {}", path.display(), module.file());
                };
                assert_eq!(
                    args.len(),
                    *params,
                    "{}: {name} launched with {args:?}, {params} parameters in {}",
                    path.display(),
                    module.file()
                );
                launches += 1;
            }
        }
        assert!(launches >= 30, "only {launches} launches found");
    }
}
