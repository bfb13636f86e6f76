//! Adapter choice, the device, the pipeline cache and error capture.

use super::shaders::{Binding, Coop, GPU_ROW_LANES, Kernel, bindings};
use crate::backend::sources::Sources;
use crate::error::{DeviceFault, Error, Result};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

/// What an error scope's pop resolves to.
type ScopeCheck = Pin<Box<dyn Future<Output = Option<wgpu::Error>> + Send>>;

/// An adapter as `mantissa info` lists it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AdapterSummary {
    /// The adapter's name ("unnamed ... adapter" where a browser hides it).
    pub name: String,
    /// The graphics API wgpu drives it through ("Vulkan", "Metal", "Dx12", "BrowserWebGpu").
    pub backend: String,
    /// The kind of adapter ("DiscreteGpu", "IntegratedGpu", "Cpu", ...).
    pub device_type: String,
    /// The driver and its version, in words.
    pub driver: String,
    /// Whether it offers SHADER_F16 (native f16 in WGSL).
    pub shader_f16: bool,
    /// Whether it offers subgroup operations.
    pub subgroups: bool,
    /// Subgroup size when the adapter has one fixed size (min = max), else 0.
    pub subgroup_size: u32,
    /// Whether it offers timestamp queries (kernels timed on the GPU, else by the wall clock).
    pub timestamps: bool,
    /// Cooperative-matrix configurations wgpu can use ("16x16x16 f16->f32").
    pub cooperative_matrix: Vec<String>,
    /// Why the matmuls do not run on cooperative matrices here (`coop_choice`); None where
    /// they may.
    pub coop_refused: Option<String>,
    /// The largest storage buffer binding, in bytes.
    pub max_storage_binding_bytes: u64,
    /// The largest buffer, in bytes.
    pub max_buffer_bytes: u64,
    /// Workgroup memory per workgroup, in bytes.
    pub max_workgroup_storage_bytes: u32,
    /// The most invocations one workgroup may have.
    pub max_invocations_per_workgroup: u32,
}

impl AdapterSummary {
    fn of(adapter: &wgpu::Adapter) -> AdapterSummary {
        let info = adapter.get_info();
        let features = adapter.features();
        let limits = adapter.limits();
        // Browsers may hide the adapter's name (privacy): say what kind of adapter it is.
        let name = if info.name.trim().is_empty() {
            format!("unnamed {:?} adapter", info.device_type)
        } else {
            info.name
        };
        AdapterSummary {
            name,
            backend: format!("{:?}", info.backend),
            device_type: format!("{:?}", info.device_type),
            driver: format!("{} {}", info.driver, info.driver_info)
                .trim()
                .to_string(),
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            subgroup_size: if info.subgroup_min_size == info.subgroup_max_size {
                info.subgroup_max_size
            } else {
                0
            },
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            cooperative_matrix: cooperative_configs(adapter)
                .iter()
                .map(|c| {
                    format!(
                        "{}x{}x{} {:?}->{:?}",
                        c.m_size, c.n_size, c.k_size, c.ab_type, c.cr_type
                    )
                    .to_lowercase()
                })
                .collect(),
            coop_refused: coop_of(adapter).err().map(|e| e.to_string()),
            max_storage_binding_bytes: limits.max_storage_buffer_binding_size,
            max_buffer_bytes: limits.max_buffer_size,
            max_workgroup_storage_bytes: limits.max_compute_workgroup_storage_size,
            max_invocations_per_workgroup: limits.max_compute_invocations_per_workgroup,
        }
    }
}

/// The adapter's cooperative-matrix configurations, when wgpu can use them at all.
fn cooperative_configs(adapter: &wgpu::Adapter) -> Vec<wgpu::CooperativeMatrixProperties> {
    if adapter
        .features()
        .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
    {
        adapter.cooperative_matrix_properties()
    } else {
        Vec::new()
    }
}

/// What of an adapter decides whether its matmuls run on cooperative matrices (`coop_choice`).
#[derive(Clone, Debug, PartialEq)]
pub struct CoopProperties {
    /// The smallest subgroup size.
    pub subgroup_min_size: u32,
    /// The largest subgroup size.
    pub subgroup_max_size: u32,
    /// Whether it offers SHADER_F16.
    pub shader_f16: bool,
    /// Its cooperative-matrix configurations (none without EXPERIMENTAL_COOPERATIVE_MATRIX).
    pub configs: Vec<wgpu::CooperativeMatrixProperties>,
}

impl CoopProperties {
    /// `adapter`'s.
    pub fn of(adapter: &wgpu::Adapter) -> CoopProperties {
        let info = adapter.get_info();
        CoopProperties {
            subgroup_min_size: info.subgroup_min_size,
            subgroup_max_size: info.subgroup_max_size,
            shader_f16: adapter.features().contains(wgpu::Features::SHADER_F16),
            configs: cooperative_configs(adapter),
        }
    }
}

/// Why an adapter's matmuls do not run on cooperative matrices (`coop_choice`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoCoop {
    /// Its back end cannot take the cooperative kernels: naga writes cooperative matrices to
    /// SPIR-V (Vulkan) and MSL (Metal) only; on DX12 their HLSL does not exist.
    Backend(wgpu::Backend),
    /// It offers no cooperative matrices.
    NotOffered,
    /// None of its configurations is square f16 x f16 -> f32 of 16 or 8.
    NoSquareF16,
    /// Its subgroup size is not fixed (a cooperative workgroup is sized in subgroups).
    SubgroupSize,
    /// It lacks SHADER_F16 (the cooperative kernels read f16).
    NoShaderF16,
}

impl std::fmt::Display for NoCoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoCoop::Backend(b) => write!(
                f,
                "wgpu's {b:?} back end cannot take the cooperative kernels (naga translates \
                 cooperative matrices to SPIR-V for Vulkan and MSL for Metal, not to HLSL or \
                 for a browser)"
            ),
            NoCoop::NotOffered => f.write_str("the adapter offers none"),
            NoCoop::NoSquareF16 => {
                f.write_str("no 16x16x16 or 8x8x8 f16->f32 configuration among the adapter's")
            }
            NoCoop::SubgroupSize => f.write_str("the adapter's subgroup size is not fixed"),
            NoCoop::NoShaderF16 => f.write_str("the adapter lacks shader-f16"),
        }
    }
}

/// The cooperative-matrix configuration the matmul kernels use on an adapter of `backend`
/// with `adapter`'s properties, or why they use none: the back end must take the cooperative
/// kernels (Vulkan, Metal; `shaders::translate` shows HLSL cannot), then square tiles with f16
/// operands and f32 accumulators (16x16x16 preferred, else 8x8x8), on a subgroup of one fixed
/// size (the kernel's workgroup is one subgroup), with shader-f16.
pub fn coop_choice(backend: wgpu::Backend, adapter: &CoopProperties) -> Result<Coop, NoCoop> {
    if !matches!(backend, wgpu::Backend::Vulkan | wgpu::Backend::Metal) {
        return Err(NoCoop::Backend(backend));
    }
    if adapter.configs.is_empty() {
        return Err(NoCoop::NotOffered);
    }
    if !adapter.shader_f16 {
        return Err(NoCoop::NoShaderF16);
    }
    if adapter.subgroup_min_size != adapter.subgroup_max_size || adapter.subgroup_max_size == 0 {
        return Err(NoCoop::SubgroupSize);
    }
    [16, 8]
        .into_iter()
        .find(|&t| {
            adapter.configs.iter().any(|c| {
                (c.m_size, c.n_size, c.k_size) == (t, t, t)
                    && c.ab_type == wgpu::CooperativeScalarType::F16
                    && c.cr_type == wgpu::CooperativeScalarType::F32
            })
        })
        .map(|size| Coop {
            size,
            subgroup: adapter.subgroup_max_size,
        })
        .ok_or(NoCoop::NoSquareF16)
}

/// `coop_choice` for `adapter`.
fn coop_of(adapter: &wgpu::Adapter) -> Result<Coop, NoCoop> {
    coop_choice(adapter.get_info().backend, &CoopProperties::of(adapter))
}

/// Environment variable that restricts adapters to those whose name contains its value.
pub const ADAPTER_ENV: &str = "WGPU_ADAPTER_NAME";

fn rank(device_type: wgpu::DeviceType) -> u8 {
    match device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

/// Every adapter wgpu finds, best first (discrete, integrated, virtual, software), filtered by
/// `WGPU_ADAPTER_NAME` when it is set. In the browser there is one: the page's WebGPU adapter.
pub async fn adapters() -> Vec<wgpu::Adapter> {
    let mut found = all_adapters().await;
    if let Some(filter) = adapter_filter() {
        found.retain(|a| a.get_info().name.to_ascii_lowercase().contains(&filter));
    }
    found
}

/// `WGPU_ADAPTER_NAME`, lower-cased, when it is set.
pub fn adapter_filter() -> Option<String> {
    std::env::var(ADAPTER_ENV)
        .ok()
        .map(|f| f.to_ascii_lowercase())
}

/// Every adapter wgpu finds, best first, whatever `WGPU_ADAPTER_NAME` says.
pub async fn all_adapters() -> Vec<wgpu::Adapter> {
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    #[cfg(target_arch = "wasm32")]
    let mut found: Vec<wgpu::Adapter> = instance
        .request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        })
        .await
        .into_iter()
        .collect();
    #[cfg(not(target_arch = "wasm32"))]
    let mut found = instance.enumerate_adapters(wgpu::Backends::all()).await;
    found.sort_by_key(|a| rank(a.get_info().device_type));
    found
}

/// Why no adapter was found: the filter that matched nothing (with the adapters that exist),
/// or no driver at all.
pub async fn no_adapter_reason() -> String {
    let all = all_adapters().await;
    match adapter_filter() {
        Some(filter) if !all.is_empty() => format!(
            "{ADAPTER_ENV}='{filter}' matches none of the adapters found: {}",
            all.iter()
                .map(|a| format!("'{}'", a.get_info().name))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        _ => "wgpu found no adapter (no Vulkan, Metal or DX12 driver; on Debian install \
              mesa-vulkan-drivers and libvulkan1 for the lavapipe software GPU)"
            .to_string(),
    }
}

/// Summaries of every adapter, best first.
pub async fn list_adapters() -> Vec<AdapterSummary> {
    adapters().await.iter().map(AdapterSummary::of).collect()
}

/// A compiled kernel with its bind group layout.
pub struct Pipeline {
    /// The compute pipeline.
    pub pipeline: wgpu::ComputePipeline,
    /// The layout its bind groups follow.
    pub layout: wgpu::BindGroupLayout,
}

/// A kernel's place in the pipeline cache: empty until its first build succeeds.
type PipelineSlot = Arc<Mutex<Option<Arc<Pipeline>>>>;

/// The device and everything cached on it.
pub struct Gpu {
    /// The wgpu device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// The adapter as `mantissa info` lists it.
    pub summary: AdapterSummary,
    /// The features the device was opened with.
    pub features: wgpu::Features,
    /// The limits the device was opened with.
    pub limits: wgpu::Limits,
    /// Whether shaders keep wgpu's runtime bounds checks (as browsers always do).
    pub runtime_checks: bool,
    /// The cooperative-matrix shape, where the device offers one mantissa can use.
    pub coop: Option<Coop>,
    /// A software adapter (wgpu's `DeviceType::Cpu`: lavapipe, SwiftShader, WARP): it compiles
    /// a kernel in seconds and emulates what GPUs accelerate.
    pub software: bool,
    /// Lanes of each row of the training row ops (train.wgsl's `ROW_LANES`): `GPU_ROW_LANES`
    /// on GPUs, whose lanes then read neighbouring values; 1 on CPU adapters (lavapipe), which
    /// run a workgroup's invocations as SIMD lanes of one thread and pay for every barrier.
    pub row_lanes: u32,
    /// Loop iterations one invocation may run before the driver stops its loops, measured
    /// when the device opens (`budget.rs`); None where there is no such limit.
    pub loop_budget: Option<u32>,
    /// Each kernel's slot: the first thread to need it builds it under the slot's own lock,
    /// so that threads asking for the same kernel at once wait for that one build instead of
    /// compiling it again (seconds apiece on a software adapter); other kernels build alongside.
    pipelines: Mutex<HashMap<Kernel, PipelineSlot>>,
    /// Pipelines built but whose error scope has not been read yet (see `pipeline`).
    unchecked_builds: Mutex<Vec<(Kernel, ScopeCheck)>>,
    uncaptured: Arc<Mutex<Option<wgpu::Error>>>,
}

impl Gpu {
    /// Opens a device on `adapter` with every limit it offers and the features mantissa uses;
    /// its loop budget is measured next (`budget::measure_into`).
    pub async fn open(
        adapter: &wgpu::Adapter,
        runtime_checks: bool,
        row_lanes: Option<u32>,
    ) -> Result<Gpu> {
        // A kernel directory that cannot be used is refused before anything opens.
        crate::backend::sources::replacements()?;
        let summary = AdapterSummary::of(adapter);
        let software = adapter.get_info().device_type == wgpu::DeviceType::Cpu;
        let row_lanes = row_lanes.unwrap_or(if software { 1 } else { GPU_ROW_LANES });
        let coop = coop_of(adapter).ok();
        let mut wanted = wgpu::Features::SHADER_F16 | wgpu::Features::TIMESTAMP_QUERY;
        if coop.is_some() {
            wanted |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        }
        let features = adapter.features() & wanted;
        let limits = adapter.limits();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("mantissa"),
                required_features: features,
                required_limits: limits.clone(),
                experimental_features: if coop.is_some() {
                    // SAFETY: the one experimental feature requested is cooperative matrices;
                    // their kernels are validated by naga and checked against the host
                    // reference in the test suite (tests/coop.rs).
                    unsafe { wgpu::ExperimentalFeatures::enabled() }
                } else {
                    wgpu::ExperimentalFeatures::disabled()
                },
                memory_hints: wgpu::MemoryHints::Performance,
                trace: wgpu::Trace::Off,
            })
            .await
            .map_err(|e| Error::device(&summary.name, "opening the device", e, None))?;
        // Errors outside an error scope must not panic: record them, report them on the next op.
        let uncaptured = Arc::new(Mutex::new(None));
        let sink = uncaptured.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            if let Ok(mut slot) = sink.lock() {
                slot.get_or_insert(e);
            }
        }));
        Ok(Gpu {
            device,
            queue,
            summary,
            features,
            limits,
            runtime_checks,
            coop,
            software,
            row_lanes,
            loop_budget: None,
            pipelines: Mutex::new(HashMap::new()),
            unchecked_builds: Mutex::new(Vec::new()),
            uncaptured,
        })
    }

    /// The adapter's name.
    pub fn name(&self) -> &str {
        &self.summary.name
    }

    /// `fault` during `op` as an error of this device (`OutOfMemory` where it is one).
    fn fault(&self, op: impl Into<String>, fault: impl Into<DeviceFault>) -> Error {
        Error::device(&self.summary.name, op, fault, None)
    }

    /// Runs `f` (recording and submitting work, never waiting) inside validation and
    /// out-of-memory error scopes; the returned future resolves to `f`'s result, or to an
    /// `Error` for anything the device reported. wgpu's scope guards are tied to the thread, so
    /// the scopes close before anything is awaited; their verdicts are awaited after.
    pub fn scoped<'a, T: Send + 'a>(
        &'a self,
        what: &str,
        f: impl FnOnce() -> Result<T>,
    ) -> impl Future<Output = Result<T>> + Send + 'a {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let result = f();
        let validation = validation.pop();
        let oom = oom.pop();
        let what = what.to_string();
        async move {
            self.check_builds().await?;
            if let Some(e) = oom.await {
                return Err(self.fault(what, e));
            }
            if let Some(e) = validation.await {
                return Err(self.fault(what, e));
            }
            if let Some(e) = self.uncaptured.lock().ok().and_then(|mut s| s.take()) {
                return Err(self.fault(what, e));
            }
            result
        }
    }

    /// Reads the error scopes of pipelines built since the last check; a pipeline the device
    /// rejected leaves the cache and comes back as a `ShaderCompile` error.
    async fn check_builds(&self) -> Result<()> {
        let pending = match self.unchecked_builds.lock() {
            Ok(mut p) => std::mem::take(&mut *p),
            Err(_) => Vec::new(),
        };
        let mut first_error = None;
        for (kernel, check) in pending {
            if let Some(e) = check.await {
                // Its slot goes with it: the next use builds the kernel again.
                if let Ok(mut m) = self.pipelines.lock() {
                    m.remove(&kernel);
                }
                first_error.get_or_insert(Error::ShaderCompile {
                    kernel: kernel.label(),
                    log: e.to_string(),
                });
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Bytes the device's memory allocator has handed out (every live buffer, and those
    /// awaiting release), where the backend reports it (Vulkan and DX12; not Metal, GL or a
    /// browser).
    pub fn allocated_bytes(&self) -> Option<u64> {
        self.device
            .generate_allocator_report()
            .map(|r| r.total_allocated_bytes)
    }

    /// Resolves when the device has finished all submitted work.
    pub async fn idle(&self) -> Result<()> {
        #[cfg(not(target_arch = "wasm32"))]
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| self.fault("waiting for the GPU", e))?;
        #[cfg(target_arch = "wasm32")]
        {
            let (tx, rx) = futures_channel::oneshot::channel();
            self.queue.on_submitted_work_done(move || {
                let _ = tx.send(());
            });
            rx.await.map_err(|_| {
                self.fault(
                    "waiting for the GPU",
                    DeviceFault::Lost("the device was lost"),
                )
            })?;
        }
        Ok(())
    }

    /// The compiled pipeline of `kernel`, built on first use and cached.
    pub fn pipeline(&self, kernel: &Kernel) -> Result<Arc<Pipeline>> {
        let slot = {
            let mut slots = self.pipelines.lock().unwrap_or_else(|e| e.into_inner());
            slots.entry(*kernel).or_default().clone()
        };
        let mut built = slot.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = built.as_ref() {
            return Ok(p.clone());
        }
        if kernel.needs_f16() && !self.features.contains(wgpu::Features::SHADER_F16) {
            return Err(Error::MissingFeature {
                feature: "shader-f16",
                adapter: self.summary.name.clone(),
                fallback: "packed f16 (MANTISSA_F16=packed)",
            });
        }
        if kernel.uses_coop() && self.coop.is_none() {
            return Err(Error::MissingFeature {
                feature: "cooperative matrices (f16 -> f32)",
                adapter: self.summary.name.clone(),
                fallback: "the SIMT kernels (MANTISSA_COOP=off)",
            });
        }
        let pipeline = Arc::new(self.build(kernel)?);
        *built = Some(pipeline.clone());
        Ok(pipeline)
    }

    /// Forgets every pipeline built so far: the next use of a kernel builds it again (from the
    /// sources current then).
    pub fn forget_pipelines(&self) {
        if let Ok(mut m) = self.pipelines.lock() {
            m.clear();
        }
    }

    fn build(&self, kernel: &Kernel) -> Result<Pipeline> {
        let label = kernel.label();
        // Validate first: a shader that fails must come back as an error with its log. One
        // built from replaced sources (MANTISSA_KERNEL_DIR) that fails is refused, said once,
        // and the built-in one is built instead.
        let mut src = Sources::Current;
        if let Err(log) = super::shaders::validate_in(kernel, src) {
            if !src.replaces_any(&kernel.files()) {
                return Err(Error::ShaderCompile { kernel: label, log });
            }
            Sources::refuse(&label, &log);
            src = Sources::Builtin;
            super::shaders::validate_in(kernel, src).map_err(|log| Error::ShaderCompile {
                kernel: label.clone(),
                log,
            })?;
        }
        let source = kernel.source_in(src);
        // The build gets its own scopes so that its errors are told apart from the op's; their
        // verdict is read by the enclosing op (`check_builds`), since nothing may block here.
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let built = {
            let desc = wgpu::ShaderModuleDescriptor {
                label: Some(&label),
                source: wgpu::ShaderSource::Wgsl(source.as_str().into()),
            };
            let module = if self.runtime_checks {
                self.device.create_shader_module(desc)
            } else {
                // SAFETY: every kernel guards its own indices (tile loads and stores check the
                // matrix bounds; element kernels check `len`), and the host sizes every buffer
                // from the same parameters it passes to the kernel (see `matmul.rs`, `ops.rs`).
                unsafe {
                    self.device
                        .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
                }
            };
            let entries: Vec<wgpu::BindGroupLayoutEntry> = bindings(kernel)
                .iter()
                .enumerate()
                .map(|(i, b)| wgpu::BindGroupLayoutEntry {
                    binding: i as u32,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: match b {
                        Binding::Uniform => wgpu::BindingType::Buffer {
                            ty: wgpu::BufferBindingType::Uniform,
                            has_dynamic_offset: false,
                            min_binding_size: None,
                        },
                        Binding::Read | Binding::ReadWrite => wgpu::BindingType::Buffer {
                            ty: wgpu::BufferBindingType::Storage {
                                read_only: matches!(b, Binding::Read),
                            },
                            has_dynamic_offset: false,
                            min_binding_size: None,
                        },
                    },
                    count: None,
                })
                .collect();
            let layout = self
                .device
                .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                    label: Some(&label),
                    entries: &entries,
                });
            let pipeline_layout =
                self.device
                    .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                        label: Some(&label),
                        bind_group_layouts: &[Some(&layout)],
                        immediate_size: 0,
                    });
            let pipeline = self
                .device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(&label),
                    layout: Some(&pipeline_layout),
                    module: &module,
                    entry_point: Some(kernel.entry_point()),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants: &[],
                        // Every kernel writes workgroup memory before reading it.
                        zero_initialize_workgroup_memory: false,
                    },
                    cache: None,
                });
            Pipeline { pipeline, layout }
        };
        let validation = validation.pop();
        let oom = oom.pop();
        let check: ScopeCheck = Box::pin(async move {
            let v = validation.await;
            let o = oom.await;
            v.or(o)
        });
        if let Ok(mut pending) = self.unchecked_builds.lock() {
            pending.push((*kernel, check));
        }
        Ok(built)
    }
}
