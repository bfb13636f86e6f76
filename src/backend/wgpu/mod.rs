//! The wgpu backend: every op as WGSL compute shaders, on any adapter wgpu finds (Vulkan, Metal,
//! DX12; software adapters such as lavapipe included).
//!
//! - `device.rs`: adapter choice, device, pipeline cache, error capture
//! - `buffer.rs`: buffer pool, uploads, command recording, readback
//! - `shaders.rs`: the WGSL loader (variants, generated headers, naga validation)
//! - `cast.rs`: element kernels (casts, quantization, amax/scales, split)
//! - `matmul.rs`: operand preparation and the tiled matmul
//! - `train.rs`: the training kernel launches of the step plan's ops
//! - `plan.rs`: the device-resident step plan, the backend's executor
//! - `autotune.rs`: the matmul tile autotuner
//! - `budget.rs`: the adapter's loop budget, measured, and how kernels keep within it

pub mod arena;
pub mod autotune;
pub mod budget;
pub mod buffer;
pub mod cast;
pub mod device;
mod entries;
pub mod matmul;
pub mod plan;
pub mod shaders;
pub mod train;

use self::autotune::{AutotuneMode, Autotuner};
use self::buffer::{
    BufferPool, Region, Timer, check_binding, read_region, read_words, submit, upload,
};
use self::device::Gpu;
use self::matmul::OnDevice;
use self::shaders::{Coop, F16Read, MatmulVariant, Tile};
use super::{Backend, BackendKind, MatmulTiming, Operands, median};
use crate::algorithm::{Algorithm, MatmulShape};
use crate::backend::Reference;
use crate::backend::sources::Sources;
use crate::error::{Error, Result};
use crate::format::{Format, Overflow};
use crate::plan::{Plan, StepExecutor};
use crate::policy::Capabilities;
use web_time::Instant;

pub use device::{AdapterSummary, adapters, list_adapters, no_adapter_reason};

/// How f16 operands are read (`MANTISSA_F16`): `auto` reads them as `f16` where the adapter has
/// SHADER_F16 and packed otherwise; `native` insists (an error names the missing feature);
/// `packed` always uses the core-WGSL path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum F16Path {
    /// `f16` values where the adapter has SHADER_F16, else packed.
    #[default]
    Auto,
    /// `f16` values; an error where the adapter lacks SHADER_F16.
    Native,
    /// Packed u32 words decoded in integer arithmetic (core WGSL), on every adapter.
    Packed,
}

impl std::str::FromStr for F16Path {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(F16Path::Auto),
            "native" => Ok(F16Path::Native),
            "packed" => Ok(F16Path::Packed),
            _ => Err(Error::UnknownName {
                kind: "f16 path",
                given: s.to_string(),
                valid: ["auto", "native", "packed"].map(String::from).to_vec(),
            }),
        }
    }
}

/// Options of the wgpu backend.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WgpuOptions {
    /// How f16 operands are read.
    pub f16: F16Path,
    /// Keep wgpu's shader runtime checks (as browsers always do). Off natively by default: the
    /// kernels guard their own indices, and the checks cost up to 40x (../docs/wgpu.md).
    pub runtime_checks: bool,
    /// Fill outputs with NaN before kernels run, so an element a kernel fails to write shows
    /// up (tests use this; pooled buffers would otherwise hold an earlier, plausible result).
    pub poison_outputs: bool,
    /// Matmul tile autotuning (`autotune.rs`); off unless asked for (the CLI asks for `fast`).
    pub autotune: AutotuneMode,
    /// Use cooperative matrices where the adapter offers them (`MANTISSA_COOP=auto|off`).
    pub coop: bool,
    /// Run the SIMT kernel for the lines the cooperative kernel cannot take exactly. Only tests
    /// turn it off, to see which outputs the cooperative kernel computed (the rest stay
    /// unwritten).
    pub coop_fallback: bool,
    /// Lanes of the training row ops (`MANTISSA_ROW_LANES`, a power of two up to 256); None:
    /// the adapter's default (`Gpu::row_lanes`).
    pub row_lanes: Option<u32>,
    /// Treat the adapter as stopping a shader's loops after this many iterations per
    /// invocation, where it measures none or a larger budget (`budget.rs`). Only tests set it,
    /// so that the split dispatches run, and are checked, on any adapter.
    pub assume_loop_budget: Option<u32>,
    /// Treat the adapter's largest storage binding as this many bytes where it is larger, for
    /// the step plans' arenas (`arena.rs`). Only tests set it, so that arenas of several
    /// segments run, and are checked, with small models.
    pub assume_arena_binding: Option<u64>,
    /// Seconds one shape class's tile search may take (`MANTISSA_TUNE_SECONDS`).
    pub tune_seconds: f64,
    /// A step plan's bias gradients summed in their weight gradients' SIMT matmuls (plan.rs,
    /// `sums_fold_into`), not by column sums of their own (`MANTISSA_BIAS_GRAD_IN_MATMUL`):
    /// the same function to the bits of the sums' order. A switch until a GPU has timed the
    /// two ways.
    pub bias_grad_in_matmul: bool,
}

impl Default for WgpuOptions {
    fn default() -> Self {
        WgpuOptions {
            f16: F16Path::Auto,
            runtime_checks: false,
            poison_outputs: false,
            autotune: AutotuneMode::Off,
            coop: true,
            coop_fallback: true,
            row_lanes: None,
            assume_loop_budget: None,
            assume_arena_binding: None,
            tune_seconds: crate::tune::TUNE_SECONDS,
            bias_grad_in_matmul: true,
        }
    }
}

impl WgpuOptions {
    /// Options from `MANTISSA_F16`, `MANTISSA_WGSL_CHECKS` (on/off), `MANTISSA_COOP`
    /// (auto/off), `MANTISSA_BIAS_GRAD_IN_MATMUL` (on/off), `MANTISSA_ROW_LANES`, `MANTISSA_AUTOTUNE` (off/fast/full; fast when unset)
    /// and `MANTISSA_TUNE_SECONDS`.
    pub fn from_env() -> Result<WgpuOptions> {
        let mut o = WgpuOptions {
            autotune: AutotuneMode::from_env()?,
            tune_seconds: crate::tune::budget_from_env()?,
            ..WgpuOptions::default()
        };
        // `crate::env`'s rules: case and spaces aside, empty as unset, a typo refused with the
        // words the switch takes (it must not silently run the other way).
        use crate::env;
        if let Some(path) = env::word("MANTISSA_F16")? {
            o.f16 = path.parse()?;
        }
        o.coop = env::on("MANTISSA_COOP")?.unwrap_or(o.coop);
        o.row_lanes = env::number("MANTISSA_ROW_LANES")?;
        o.runtime_checks = env::on("MANTISSA_WGSL_CHECKS")?.unwrap_or(o.runtime_checks);
        o.bias_grad_in_matmul =
            env::on("MANTISSA_BIAS_GRAD_IN_MATMUL")?.unwrap_or(o.bias_grad_in_matmul);
        Ok(o)
    }
}

/// The wgpu backend on one adapter.
pub struct WgpuBackend {
    gpu: Gpu,
    pool: BufferPool,
    f16: F16Read,
    /// The cooperative-matrix configuration, where matmuls use it.
    coop: Option<Coop>,
    coop_fallback: bool,
    poison: bool,
    tuner: Autotuner,
    /// The most bytes an arena segment may bind (`arena.rs`).
    arena_binding: u64,
    /// `WgpuOptions::bias_grad_in_matmul`.
    pub(crate) bias_grad_in_matmul: bool,
}

impl WgpuBackend {
    /// Frees the pool's idle buffers and flushes queued uploads, and waits until the device
    /// has released both (a step plan's memory is then its own; a failed wait only delays
    /// the release).
    pub(crate) async fn release_idle(&self) {
        drop(self.pool.drain());
        self.gpu.queue.submit([]);
        let _ = self.gpu.idle().await;
    }

    /// The best adapter (discrete, integrated, then software), with options from the environment.
    pub async fn open_best() -> Result<WgpuBackend> {
        Self::open_nth(0, WgpuOptions::from_env()?).await
    }

    /// The `index`-th adapter of `list_adapters()`.
    pub async fn open_nth(index: usize, options: WgpuOptions) -> Result<WgpuBackend> {
        let adapters = device::adapters().await;
        let Some(adapter) = adapters.get(index) else {
            let why = if adapters.is_empty() {
                device::no_adapter_reason().await
            } else {
                format!("adapter {index} requested, {} found", adapters.len())
            };
            return Err(Error::BackendUnavailable {
                backend: "wgpu".into(),
                why,
            });
        };
        let mut gpu = Gpu::open(adapter, options.runtime_checks, options.row_lanes).await?;
        budget::measure_into(&mut gpu, options.assume_loop_budget).await?;
        let has_f16 = gpu.features.contains(wgpu::Features::SHADER_F16);
        let f16 = match options.f16 {
            F16Path::Packed => F16Read::Packed,
            F16Path::Auto if !has_f16 => F16Read::Packed,
            F16Path::Auto => F16Read::Native,
            F16Path::Native if has_f16 => F16Read::Native,
            F16Path::Native => {
                return Err(Error::MissingFeature {
                    feature: "shader-f16",
                    adapter: gpu.summary.name.clone(),
                    fallback: "packed f16 (MANTISSA_F16=packed or auto)",
                });
            }
        };
        // The cooperative kernels read f16 natively; MANTISSA_F16=packed keeps everything packed.
        let coop = gpu.coop.filter(|_| options.coop && f16 == F16Read::Native);
        let limits = &gpu.limits;
        let binding = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size);
        let arena_binding = options
            .assume_arena_binding
            .map_or(binding, |b| b.min(binding));
        let software = gpu.software;
        let backend = WgpuBackend {
            arena_binding,
            bias_grad_in_matmul: options.bias_grad_in_matmul,
            gpu,
            pool: BufferPool::default(),
            f16,
            coop,
            coop_fallback: options.coop_fallback,
            poison: options.poison_outputs,
            tuner: Autotuner::new(
                autotune::mode_on(options.autotune, software),
                Autotuner::default_path(),
            )
            .with_budget(options.tune_seconds),
        };
        backend.check_replaced_matmuls().await?;
        Ok(backend)
    }

    /// Where MANTISSA_KERNEL_DIR replaces a file the matmuls are built from, every algorithm's
    /// default kernel here must first meet its contract against the host reference, on fresh
    /// N(0,1) operands with a row beyond f16's range, an inf and a NaN, K past one group of
    /// `shaders::GROUP_K`, batched; and where it replaces one their stores' epilogues are
    /// built from too, the bias add (`check_replaced_epilogue`). Where one does not, the
    /// replaced files are refused and the built-in ones run (`Sources::refuse_files`, said
    /// once).
    async fn check_replaced_matmuls(&self) -> Result<()> {
        use autotune::MATMUL_FILES as FILES;
        const EPILOGUE_FILES: [&str; 2] = ["epilogue.wgsl", "unary.wgsl"];
        let products = Sources::Current.replaces_any(&FILES);
        if !products && !Sources::Current.replaces_any(&EPILOGUE_FILES) {
            return Ok(());
        }
        let seed = web_time::SystemTime::now()
            .duration_since(web_time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        if products && !self.check_replaced_products(seed).await? {
            return Ok(());
        }
        if let Err(e) = self.check_replaced_epilogue(seed).await {
            let files: Vec<&str> = FILES.iter().chain(&EPILOGUE_FILES).copied().collect();
            Sources::refuse_files(
                &files,
                &format!("a bias add in the store (seed {seed}): {e}"),
            );
            self.gpu.forget_pipelines();
        }
        Ok(())
    }

    /// `check_replaced_matmuls`' products: whether every algorithm met its contract (else the
    /// matmul files are refused).
    async fn check_replaced_products(&self, seed: u64) -> Result<bool> {
        let shape = MatmulShape {
            batch: 2,
            m: 37,
            n: 45,
            k: shaders::GROUP_K as usize + 77,
            a_transposed: false,
            b_transposed: false,
        };
        let mut a = crate::measure::normal(shape.a_len(), seed);
        let b = crate::measure::normal(shape.b_len(), seed ^ 0x9e37_79b9);
        // Row 3 of A beyond f16's range; an inf and a NaN.
        for x in &mut a[3 * shape.k..4 * shape.k] {
            *x *= 1e6;
        }
        a[5 * shape.k + 1] = f32::INFINITY;
        a[9 * shape.k + 2] = f32::NAN;
        for algorithm in Algorithm::ALL {
            let tile = self.variant(&algorithm).tile;
            let checked = async {
                let got = self
                    .matmul_on_tile(&shape, &algorithm, tile, &a, &b)
                    .await?;
                let want = Reference.matmul(&shape, &algorithm, &a, &b).await?;
                crate::measure::check_product(&algorithm, &shape, (&a, &b), &got, &want)?
                    .verdict(&algorithm)
            };
            if let Err(e) = checked.await {
                Sources::refuse_files(
                    &autotune::MATMUL_FILES,
                    &format!("{algorithm} on its default tile (seed {seed}): {e}"),
                );
                // Pipelines built from the refused files are built again from the built-in ones.
                self.gpu.forget_pipelines();
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// A linear layer's bias add and GELU in the store of the bf16 algorithm's default kernel
    /// (`matmul_bias_add_on_tile`), as a step plan runs q|k|v's and the pre-GELU activations'
    /// under bf16-mixed: stored as f32 and as codes, the sums must be the add's definition over
    /// the product (bit for bit, NaN as NaN) and the GELU's codes the f32 GELU's values.
    async fn check_replaced_epilogue(&self, seed: u64) -> Result<()> {
        let shape = MatmulShape::new(37, 46, shaders::GROUP_K as usize + 77);
        let normal = |n, s| crate::measure::normal(n, seed ^ s);
        let (mut a, b, bias) = (
            normal(shape.a_len(), 1),
            normal(shape.b_len(), 2),
            normal(shape.n, 3),
        );
        a[5 * shape.k + 1] = f32::INFINITY;
        a[9 * shape.k + 2] = f32::NAN;
        let algorithm = Algorithm::Bf16;
        let tile = self.variant(&algorithm).tile;
        let product = self
            .matmul_on_tile(&shape, &algorithm, tile, &a, &b)
            .await?;
        let round = |x: f32| Format::Bf16.round(x, crate::format::Overflow::Standard);
        let sums: Vec<f32> = (product.iter().enumerate())
            .map(|(i, &p)| round(round(p) + round(bias[i % shape.n])))
            .collect();
        let same = |x: &[f32], y: &[f32]| {
            (x.iter().zip(y))
                .position(|(x, y)| x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()))
        };
        let mut gelus = None;
        for coded in [false, true] {
            let stored = if coded { "codes" } else { "f32" };
            let (got, gelu) = self
                .matmul_bias_add_on_tile(
                    &shape,
                    &algorithm,
                    tile,
                    (&a, &b),
                    &bias,
                    [Format::Bf16; 4],
                    coded,
                )
                .await?;
            if let Some(i) = same(&got, &sums) {
                let why = format!(
                    "stored as {stored}, output {i} is {:e}, where the product plus the bias is {:e}",
                    got[i], sums[i]
                );
                return Err(Error::invalid("MANTISSA_KERNEL_DIR", why));
            }
            if let Some(i) = gelus.as_ref().and_then(|g: &Vec<f32>| same(&gelu, g)) {
                let why = format!(
                    "its GELU as codes is {:e} at {i}, as f32 {:e}",
                    gelu[i],
                    gelus.unwrap()[i]
                );
                return Err(Error::invalid("MANTISSA_KERNEL_DIR", why));
            }
            gelus = Some(gelu);
        }
        Ok(())
    }

    /// The autotuner's (choices held, choices loaded from its store at the start).
    pub fn autotune_entries(&self) -> (usize, usize) {
        self.tuner.entries()
    }

    /// Tunes from now on in `mode` (choices made so far are kept; `off` runs default tiles).
    pub fn set_autotune(&self, mode: AutotuneMode) {
        self.tuner.set_mode(mode);
    }

    /// The same backend with another autotuner (tests and tools that pick the cache file).
    pub fn with_tuner(mut self, tuner: Autotuner) -> WgpuBackend {
        self.tuner = tuner;
        self
    }

    /// The kernel variant that computes `algorithm` here (before tile choice): cooperative
    /// where the device offers it and the algorithm has such a variant, else SIMT.
    pub fn variant(&self, algorithm: &Algorithm) -> MatmulVariant {
        MatmulVariant::chosen(algorithm, self.coop, self.f16)
    }

    /// The variant that runs `algorithm` on `tile`: the SIMT kernel where the tile says so
    /// (`Tile::simt`), else `variant`'s.
    pub fn variant_on(&self, algorithm: &Algorithm, tile: Tile) -> MatmulVariant {
        let v = match tile.simt {
            true => MatmulVariant::for_algorithm(algorithm, self.f16),
            false => self.variant(algorithm),
        };
        v.with_tile(tile.on_simt(false).with_encoded(false))
    }

    /// Whether `variant` can run on `tile` here (a tile listed in MANTISSA_TUNE_CANDIDATES):
    /// a cooperative block must be one of `offered` (this device's candidates); a SIMT tile
    /// needs a register block of 4 (or 8 for one-plane operands) dividing its sides, a K step
    /// a multiple of 4, one or two buffers, and the device's invocations and workgroup memory.
    pub fn fits(
        &self,
        variant: &MatmulVariant,
        tile: Tile,
        offered: &[Tile],
    ) -> std::result::Result<(), String> {
        if variant.coop.is_some() && !tile.simt {
            if !(1..=64).contains(&tile.splits) {
                return Err("between 1 and 64 splits of K".into());
            }
            return if offered.contains(&tile.with_splits(1)) {
                Ok(())
            } else {
                Err("not one of this device's cooperative blocks (Tile::coop_candidates)".into())
            };
        }
        let limits = &self.gpu.limits;
        let why = if !(tile.reg == 4 || (tile.reg == 8 && variant.parts <= 1)) {
            "a register block of 4, or 8 for one-plane operands".to_string()
        } else if tile.bm == 0
            || tile.bn == 0
            || !tile.bm.is_multiple_of(tile.reg)
            || !tile.bn.is_multiple_of(tile.reg)
        {
            format!(
                "sides that are multiples of its register block ({})",
                tile.reg
            )
        } else if tile.bk == 0 || !tile.bk.is_multiple_of(4) {
            "a K step that is a multiple of 4".into()
        } else if !(1..=64).contains(&tile.splits) {
            "between 1 and 64 splits of K".into()
        } else if !(tile.buffers == 1 || tile.buffers == 2) || tile.warps != 1 || tile.prefetch {
            "one or two buffers, one subgroup, no prefetch (those are cooperative blocks')".into()
        } else if tile.threads() > limits.max_compute_invocations_per_workgroup {
            format!(
                "at most {} invocations (it has {})",
                limits.max_compute_invocations_per_workgroup,
                tile.threads()
            )
        } else if tile.workgroup_bytes(variant.parts) > limits.max_compute_workgroup_storage_size {
            format!(
                "at most {} bytes of workgroup memory (it takes {})",
                limits.max_compute_workgroup_storage_size,
                tile.workgroup_bytes(variant.parts)
            )
        } else {
            return Ok(());
        };
        Err(format!("the SIMT kernel needs {why}"))
    }

    /// The tiles the autotuner may choose from for `algorithm` on this device, default first.
    pub fn tile_candidates(&self, algorithm: &Algorithm) -> Vec<Tile> {
        let v = self.variant(algorithm);
        let limits = &self.gpu.limits;
        if let Some(c) = v.coop {
            return Tile::coop_candidates(
                c.size,
                c.subgroup,
                v.parts.max(1),
                limits.max_compute_workgroup_storage_size,
                limits.max_compute_invocations_per_workgroup,
            );
        }
        let tiles = Tile::candidates(
            v.parts,
            limits.max_compute_invocations_per_workgroup,
            limits.max_compute_workgroup_storage_size,
        );
        // f32 and tf32 operands contiguous in K may load four lines by four k a slot: every
        // tile again that way, after the others (the way they load otherwise stays a candidate).
        let quads = |o| matches!(o, shaders::Operand::F32 | shaders::Operand::Tf32);
        if !(quads(v.a) || quads(v.b)) {
            return tiles;
        }
        let blocks: Vec<Tile> = tiles.iter().map(|t| t.with_quad_blocks(true)).collect();
        tiles.into_iter().chain(blocks).collect()
    }

    /// On a cooperative-matrix device, the SIMT tiles the autotuner also times for
    /// `algorithm` (`Tile::simt`), the SIMT default first; none elsewhere (`tile_candidates`
    /// are SIMT tiles there).
    pub fn simt_candidates(&self, algorithm: &Algorithm) -> Vec<Tile> {
        if self.variant(algorithm).coop.is_none() {
            return Vec::new();
        }
        let limits = &self.gpu.limits;
        let v = MatmulVariant::for_algorithm(algorithm, self.f16);
        Tile::candidates(
            v.parts,
            limits.max_compute_invocations_per_workgroup,
            limits.max_compute_workgroup_storage_size,
        )
        .into_iter()
        .map(|t| t.on_simt(true))
        .collect()
    }

    /// The SIMT default tile encoding its f32-held 16-bit operands first (`Tile::encoded`),
    /// which the autotuner times beside the same tile reading them rounded; none where
    /// `algorithm`'s SIMT operands read f32 as they are (f32, tf32, split, fp8).
    pub fn encoded_candidates(&self, algorithm: &Algorithm) -> Vec<Tile> {
        let v = MatmulVariant::for_algorithm(algorithm, self.f16);
        if v.reading([Format::F32; 2]) == v {
            return Vec::new();
        }
        let simt = self.variant(algorithm).coop.is_some();
        vec![Tile::default_for(v.parts).on_simt(simt).with_encoded(true)]
    }

    /// The spans of K that the product's dispatches of `algorithm` on `tile` sum (of the K
    /// padded to the tile on cooperative matrices): one, unless the adapter's loop budget
    /// splits K (budget.rs).
    pub fn k_spans(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        tile: Tile,
    ) -> Result<Vec<(u32, u32)>> {
        let v = self.variant_on(algorithm, tile);
        let k = shape.k as u32;
        match v.coop {
            Some(_) => matmul::k_spans(&self.gpu, &v, k.next_multiple_of(tile.bk)),
            None => matmul::k_spans(&self.gpu, &v.with_unrolled(self.gpu.runtime_checks), k),
        }
    }

    /// Whether matmuls of eligible algorithms run on cooperative matrices here.
    pub fn uses_coop(&self) -> bool {
        self.coop.is_some()
    }

    /// C = op(A) . op(B) on a given tile, bypassing the autotuner: every tile must give the
    /// same bits (tests check it), and experiments time them.
    pub async fn matmul_on_tile(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        tile: Tile,
        a: &[f32],
        b: &[f32],
    ) -> Result<Vec<f32>> {
        shape.check(a.len(), b.len())?;
        if shape.c_len() == 0 || shape.k == 0 {
            return Ok(vec![0.0; shape.c_len()]);
        }
        let (ab, bb) = self.upload_operands(a, b).await?;
        self.multiply(shape, algorithm, tile, &ab, &bb).await
    }

    /// The matmul on `tile` of operands held on the device as `stored` says: f32 values, or
    /// their codes (encoded on the host, overflow to inf), as a step plan holds its tensors.
    /// Tests hold it to the product of the same values held in f32.
    pub async fn matmul_held(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        tile: Tile,
        (a, b): (&[f32], &[f32]),
        stored: [Format; 2],
    ) -> Result<Vec<f32>> {
        shape.check(a.len(), b.len())?;
        let hold = |what: &str, x: &[f32], format: Format| match format {
            Format::F32 => self.upload_f32(what, x),
            _ => {
                let codes: Vec<u32> = x
                    .iter()
                    .map(|&v| format.encode(v, crate::format::Overflow::Standard))
                    .collect();
                let words = pack(&codes, format);
                check_binding(&self.gpu, what, words.len() as u64 * 4)?;
                Ok(upload(&self.gpu, what, bytemuck::cast_slice(&words)))
            }
        };
        let (ab, bb) = self
            .gpu
            .scoped("matmul operands", || {
                Ok((
                    hold("operand A", a, stored[0])?,
                    hold("operand B", b, stored[1])?,
                ))
            })
            .await?;
        let (ra, rb) = (Region::whole(&ab), Region::whole(&bb));
        let on = OnDevice {
            a: &ra,
            b: &rb,
            stored,
        };
        self.product_on_tile(shape, algorithm, tile, on, Format::F32)
            .await
    }

    /// The matmul on `tile` twice: whole, then its product's dispatches alone over the
    /// operands the whole run prepared, C poisoned in between (both Cs). The second is what
    /// `time_matmul` times from `Operands::Prepared`; tests check that it is the first.
    pub async fn matmul_product_again(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        tile: Tile,
        a: &[f32],
        b: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        shape.check(a.len(), b.len())?;
        let (ab, bb) = self.upload_operands(a, b).await?;
        let run = self
            .gpu
            .scoped("matmul", || {
                let run = self.record_on_tile(
                    shape,
                    algorithm,
                    tile,
                    OnDevice::f32(&Region::whole(&ab), &Region::whole(&bb)),
                    &matmul::Epilogue::plain(),
                )?;
                let clears: Vec<&wgpu::Buffer> = run.clears.iter().collect();
                submit(&self.gpu, &clears, &run.dispatches, None);
                Ok(run)
            })
            .await?;
        let whole = read_region(&self.gpu, &run.c, shape.c_len()).await;
        self.poison(&run.c.buffer, shape.c_len());
        let product = run.product_dispatches();
        self.gpu
            .scoped("matmul product", || {
                submit(&self.gpu, &[], &product, None);
                Ok(())
            })
            .await?;
        let again = read_region(&self.gpu, &run.c, shape.c_len()).await;
        self.pool.give(run.into_buffers());
        let floats = |w: Vec<u32>| bytemuck::cast_slice(&w).to_vec();
        Ok((floats(whole?), floats(again?)))
    }

    /// Records the matmul of operands on the device on `tile`, with this backend's f16 read
    /// and cooperative matrices, its buffers from the backend's pool, its store doing what
    /// `epilogue` says.
    fn record_on_tile(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        tile: Tile,
        operands: OnDevice<'_>,
        epilogue: &matmul::Epilogue,
    ) -> Result<matmul::MatmulRun> {
        matmul::record(
            &self.gpu,
            matmul::Pools::one(&self.pool),
            shape,
            algorithm,
            self.f16,
            self.coop.map(|c| (c, self.coop_fallback)),
            Some(tile),
            operands,
            None,
            Some(epilogue),
        )
    }

    /// The matmul of f32 operands on the device, on `tile`, read back.
    async fn multiply(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        tile: Tile,
        a: &wgpu::Buffer,
        b: &wgpu::Buffer,
    ) -> Result<Vec<f32>> {
        self.product_on_tile(
            shape,
            algorithm,
            tile,
            OnDevice::f32(&Region::whole(a), &Region::whole(b)),
            Format::F32,
        )
        .await
    }

    /// C = op(A) . op(B) on a given tile, rounded to `held` as the kernel stores it (a step
    /// plan's `Op::Matmul` holding its product: epilogue.wgsl): tests hold it to the unrounded
    /// product rounded on the host.
    pub async fn matmul_rounded_on_tile(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        tile: Tile,
        (a, b): (&[f32], &[f32]),
        held: Format,
    ) -> Result<Vec<f32>> {
        shape.check(a.len(), b.len())?;
        let (ab, bb) = self.upload_operands(a, b).await?;
        let (ra, rb) = (Region::whole(&ab), Region::whole(&bb));
        let on = OnDevice::f32(&ra, &rb);
        self.product_on_tile(shape, algorithm, tile, on, held).await
    }

    /// The matmul of f32 operands on `tile` (one matrix) with B's column sums as well, as a
    /// weight gradient's product sums its bias gradient (`matmul::Epilogue::column_sums`):
    /// the product held in `held`, the sums in `sums_held`; None where the tile's kernel cannot
    /// sum columns. Tests hold both to the product alone and to the sums on the host.
    pub async fn matmul_and_column_sums(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        tile: Tile,
        (a, b): (&[f32], &[f32]),
        (held, sums_held): (Format, Format),
    ) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
        shape.check(a.len(), b.len())?;
        let (ab, bb) = self.upload_operands(a, b).await?;
        let (ra, rb) = (Region::whole(&ab), Region::whole(&bb));
        let sums = self.pool.take(&self.gpu, shape.n.max(1) as u64 * 4)?;
        let sums_region = Region::whole(&sums);
        let run = self
            .gpu
            .scoped("matmul and column sums", || {
                let epilogue = matmul::Epilogue {
                    column_sums: Some((&sums_region, sums_held)),
                    ..matmul::Epilogue::held(held)
                };
                let on = OnDevice::f32(&ra, &rb);
                let run = self.record_on_tile(shape, algorithm, tile, on, &epilogue)?;
                if self.poison {
                    self.poison(&run.c.buffer, shape.c_len());
                    self.poison(&sums, shape.n);
                }
                let clears: Vec<&wgpu::Buffer> = run.clears.iter().collect();
                submit(&self.gpu, &clears, &run.dispatches, None);
                Ok(run)
            })
            .await?;
        let summed = run.columns_summed;
        let product = read_region(&self.gpu, &run.c, shape.c_len()).await;
        let column_sums = read_region(&self.gpu, &sums_region, shape.n).await;
        self.pool.give(run.into_buffers().chain([sums]));
        let floats = |w: Vec<u32>| bytemuck::cast_slice::<u32, f32>(&w).to_vec();
        let (product, column_sums) = (floats(product?), floats(column_sums?));
        Ok(summed.then_some((product, column_sums)))
    }

    /// The matmul of f32 operands on `tile` with a linear layer's bias add in its store
    /// (`matmul::Epilogue`, as a step plan folds the add after its matmul): C = (C' held in
    /// `y_held` + the bias held in `x_held`) held in `held`, and a GELU of C held in `gelu`.
    /// Where `coded`, C and a 16-bit GELU are stored as codes (a plan's coded tensors), else as
    /// f32; both are read back as values. Tests hold the codes to the f32 values.
    #[allow(clippy::too_many_arguments)]
    pub async fn matmul_bias_add_on_tile(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        tile: Tile,
        (a, b): (&[f32], &[f32]),
        bias: &[f32],
        [y_held, x_held, held, gelu]: [Format; 4],
        coded: bool,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        shape.check(a.len(), b.len())?;
        if bias.len() != shape.n {
            let why = format!("{} values for {} columns", bias.len(), shape.n);
            return Err(Error::invalid("bias", why));
        }
        let (ab, bb) = self.upload_operands(a, b).await?;
        let (ra, rb) = (Region::whole(&ab), Region::whole(&bb));
        let bias = Region::whole(&self.upload_f32("bias", bias)?);
        let len = shape.c_len();
        let codes = |f: Format| coded && f != Format::F32;
        let words = |f: Format| if codes(f) { len.div_ceil(2) } else { len };
        let gelu_out = self.pool.take(&self.gpu, words(gelu).max(1) as u64 * 4)?;
        let gelu_region = Region::whole(&gelu_out);
        let run = self
            .gpu
            .scoped("matmul with a bias add", || {
                let epilogue = matmul::Epilogue {
                    bias: Some(&bias),
                    y_held,
                    x_held,
                    coded,
                    residual: None,
                    gelu: Some((&gelu_region, gelu, codes(gelu))),
                    ..matmul::Epilogue::held(held)
                };
                let on = OnDevice::f32(&ra, &rb);
                let run = self.record_on_tile(shape, algorithm, tile, on, &epilogue)?;
                if self.poison {
                    self.poison(&run.c.buffer, words(held));
                    self.poison(&gelu_out, words(gelu));
                }
                let clears: Vec<&wgpu::Buffer> = run.clears.iter().collect();
                submit(&self.gpu, &clears, &run.dispatches, None);
                Ok(run)
            })
            .await?;
        let sums = read_region(&self.gpu, &run.c, words(held)).await;
        let gelus = read_region(&self.gpu, &gelu_region, words(gelu)).await;
        self.pool.give(run.into_buffers().chain([gelu_out]));
        let values = |words: Vec<u32>, f: Format| -> Vec<f32> {
            match codes(f) {
                true => (0..len)
                    .map(|e| f.decode(words[e / 2] >> (16 * (e % 2)) & 0xffff))
                    .collect(),
                false => bytemuck::cast_slice(&words).to_vec(),
            }
        };
        Ok((values(sums?, held), values(gelus?, gelu)))
    }

    /// The matmul of operands on the device (f32 values or 16-bit codes), on `tile`, rounded
    /// to `held` as stored, read back.
    async fn product_on_tile(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        tile: Tile,
        operands: OnDevice<'_>,
        held: Format,
    ) -> Result<Vec<f32>> {
        let run = self
            .gpu
            .scoped("matmul", || {
                let held = matmul::Epilogue::held(held);
                let run = self.record_on_tile(shape, algorithm, tile, operands, &held)?;
                if self.poison {
                    self.poison(&run.c.buffer, shape.c_len());
                }
                let clears: Vec<&wgpu::Buffer> = run.clears.iter().collect();
                submit(&self.gpu, &clears, &run.dispatches, None);
                Ok(run)
            })
            .await?;
        let words = read_region(&self.gpu, &run.c, shape.c_len()).await;
        self.pool.give(run.into_buffers());
        Ok(bytemuck::cast_slice(&words?).to_vec())
    }

    /// Times `repetitions` runs of the matmul of device operands on `tile`, after one warm-up
    /// run (pipelines, first-touch allocation; it also prepares the operands): the median
    /// seconds, the clock ("gpu-timestamps" or "wall-clock") and the runs timed. From
    /// `Operands::Prepared`, the timed runs are the product's dispatches alone.
    #[allow(clippy::too_many_arguments)]
    async fn time_on_tile(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        tile: Tile,
        on_device: OnDevice<'_>,
        repetitions: usize,
        operands: Operands,
    ) -> Result<(f64, &'static str, usize)> {
        let run = self
            .gpu
            .scoped("timed matmul", || {
                let plain = matmul::Epilogue::plain();
                self.record_on_tile(shape, algorithm, tile, on_device, &plain)
            })
            .await?;
        let clears: Vec<&wgpu::Buffer> = run.clears.iter().collect();
        let product = run.product_dispatches();
        let timer = Timer::new(&self.gpu, 1);
        let mut times = Vec::new();
        for rep in 0..=repetitions {
            let start = Instant::now();
            self.gpu
                .scoped("timed matmul", || {
                    match operands {
                        Operands::Prepared if rep > 0 => {
                            submit(&self.gpu, &[], &product, timer.as_ref())
                        }
                        _ => submit(&self.gpu, &clears, &run.dispatches, timer.as_ref()),
                    }
                    Ok(())
                })
                .await?;
            self.gpu.idle().await?;
            let wall = start.elapsed().as_secs_f64();
            let t = match &timer {
                Some(t) => t.read_seconds(&self.gpu).await?[0],
                None => wall,
            };
            if rep > 0 {
                times.push(t);
            }
        }
        self.pool.give(run.into_buffers());
        let clock = if timer.is_some() {
            "gpu-timestamps"
        } else {
            "wall-clock"
        };
        Ok((median(&mut times), clock, times.len()))
    }

    /// The adapter as `mantissa info` lists it.
    pub fn summary(&self) -> &AdapterSummary {
        &self.gpu.summary
    }

    /// How this backend reads f16 operands.
    pub fn f16_read(&self) -> F16Read {
        self.f16
    }

    /// Whether shaders keep wgpu's runtime bounds checks.
    pub fn runtime_checks(&self) -> bool {
        self.gpu.runtime_checks
    }

    /// Loop iterations one invocation may run here before the driver stops its loops (None:
    /// no such limit); long loops are split to stay within half of it (`budget.rs`).
    pub fn loop_budget(&self) -> Option<u32> {
        self.gpu.loop_budget
    }

    /// Fills the first `words` words of `buffer` with NaN.
    fn poison(&self, buffer: &wgpu::Buffer, words: usize) {
        let nan = vec![f32::NAN.to_bits() | 0x1234; words.max(1)];
        self.gpu
            .queue
            .write_buffer(buffer, 0, bytemuck::cast_slice(&nan));
    }

    /// Both matmul operands, as f32 on the device.
    async fn upload_operands(&self, a: &[f32], b: &[f32]) -> Result<(wgpu::Buffer, wgpu::Buffer)> {
        self.gpu
            .scoped("matmul operands", || {
                Ok((
                    self.upload_f32("operand A", a)?,
                    self.upload_f32("operand B", b)?,
                ))
            })
            .await
    }

    fn upload_f32(&self, what: &str, x: &[f32]) -> Result<wgpu::Buffer> {
        check_binding(&self.gpu, what, x.len() as u64 * 4)?;
        Ok(upload(&self.gpu, what, bytemuck::cast_slice(x)))
    }

    /// Runs one element kernel over `x` and reads `out_words` words back.
    async fn element_op(
        &self,
        what: &str,
        x: &[u32],
        out_words: usize,
        make: impl FnOnce(&wgpu::Buffer, &wgpu::Buffer) -> Result<Vec<buffer::Dispatch>>,
    ) -> Result<Vec<u32>> {
        check_binding(&self.gpu, what, x.len().max(out_words) as u64 * 4)?;
        let dst = self
            .gpu
            .scoped(what, || {
                let src = upload(&self.gpu, what, x);
                let dst = self.pool.take(&self.gpu, out_words as u64 * 4)?;
                if self.poison {
                    self.poison(&dst, out_words);
                }
                let dispatches = make(&src, &dst)?;
                submit(&self.gpu, &[], &dispatches, None);
                Ok(dst)
            })
            .await?;
        let out = read_words(&self.gpu, &dst, out_words).await;
        self.pool.give([dst]);
        out
    }
}

/// Unpacks packed codes (1, 2 or 4 per word) into one code per u32.
fn unpack(words: &[u32], format: Format, len: usize) -> Vec<u32> {
    let per = 4 / format.storage_bytes();
    let bits = 32 / per;
    let mask = if bits == 32 {
        u32::MAX
    } else {
        (1u32 << bits) - 1
    };
    (0..len)
        .map(|e| (words[e / per] >> ((e % per) * bits)) & mask)
        .collect()
}

/// Packs one code per u32 into words (1, 2 or 4 per word).
fn pack(codes: &[u32], format: Format) -> Vec<u32> {
    let per = 4 / format.storage_bytes();
    let bits = 32 / per;
    codes
        .chunks(per)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u32, |w, (t, &v)| w | (v << (t * bits)))
        })
        .collect()
}

#[async_trait::async_trait]
impl Backend for WgpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Wgpu
    }

    fn name(&self) -> String {
        format!(
            "wgpu:{} ({})",
            self.gpu.summary.name, self.gpu.summary.backend
        )
    }

    fn device_name(&self) -> String {
        let s = &self.gpu.summary;
        format!(
            "{} [{}, {}, {}]",
            s.name, s.backend, s.device_type, s.driver
        )
    }

    /// The device-resident step plan (`plan.rs`).
    fn executor<'a>(&'a self, plan: Plan) -> Result<Box<dyn StepExecutor + 'a>> {
        Ok(Box::new(plan::ResidentPlan::new(self, plan)))
    }

    /// SIMT kernels make nothing faster than f32. Cooperative matrices on a hardware GPU
    /// accelerate f16 operands, so bf16 and the split algorithms on them (emulated on a CPU
    /// adapter such as lavapipe: not an acceleration there). Attention stays unfused by
    /// default (train.wgsl's fused kernels serve `--attention fused`, heads of at most 64).
    fn capabilities(&self) -> Capabilities {
        if self.coop.is_none() || self.gpu.software {
            return Capabilities::default();
        }
        Capabilities {
            accelerated: vec![
                Algorithm::F16,
                Algorithm::Bf16,
                Algorithm::Bf16x3,
                Algorithm::Bf16x6,
                Algorithm::Bf16x9,
            ],
            ..Capabilities::default()
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
        if shape.c_len() == 0 || shape.k == 0 {
            return Ok(vec![0.0; shape.c_len()]);
        }
        let (ab, bb) = self.upload_operands(a, b).await?;
        let (tile, ..) = self
            .tile_for(
                shape,
                algorithm,
                OnDevice::f32(&Region::whole(&ab), &Region::whole(&bb)),
            )
            .await?;
        self.multiply(shape, algorithm, tile, &ab, &bb).await
    }

    async fn encode(&self, format: Format, overflow: Overflow, x: &[f32]) -> Result<Vec<u32>> {
        let words = cast::packed_words(format, x.len());
        let saturate = overflow == Overflow::Saturate;
        let packed = self
            .element_op("encode", bytemuck::cast_slice(x), words, |src, dst| {
                Ok(vec![cast::encode(
                    &self.gpu,
                    src,
                    dst,
                    x.len(),
                    format,
                    saturate,
                )?])
            })
            .await?;
        Ok(unpack(&packed, format, x.len()))
    }

    async fn decode(&self, format: Format, bits: &[u32]) -> Result<Vec<f32>> {
        let packed = pack(bits, format);
        let out = self
            .element_op("decode", &packed, bits.len(), |src, dst| {
                Ok(vec![cast::decode(&self.gpu, src, dst, bits.len(), format)?])
            })
            .await?;
        Ok(bytemuck::cast_slice(&out).to_vec())
    }

    async fn split_bf16(&self, x: &[f32]) -> Result<[Vec<u32>; 3]> {
        let plane_words = cast::packed_words(Format::Bf16, x.len());
        let out = self
            .element_op(
                "split_bf16",
                bytemuck::cast_slice(x),
                3 * plane_words,
                |src, dst| Ok(vec![cast::split_bf16(&self.gpu, src, dst, x.len(), 3)?.0]),
            )
            .await?;
        let plane = |p: usize| {
            unpack(
                &out[p * plane_words..(p + 1) * plane_words],
                Format::Bf16,
                x.len(),
            )
        };
        Ok([plane(0), plane(1), plane(2)])
    }

    async fn amax(&self, x: &[f32]) -> Result<f32> {
        if x.is_empty() {
            return Ok(0.0);
        }
        let (amax_bits, scale) = self
            .gpu
            .scoped("amax", || {
                let src = self.upload_f32("amax input", x)?;
                let amax_bits = self.pool.take(&self.gpu, 4)?;
                let scale = self.pool.take(&self.gpu, 4)?;
                let x = cast::Grouped {
                    src: &src,
                    stored: Format::F32,
                    len: x.len(),
                    grouping: cast::Grouping::per_batch(1, x.len()),
                    offset: 0,
                };
                let both = (&amax_bits, &scale);
                let [amax, _] = cast::current_scales(&self.gpu, both, (x, Format::E4m3), None)?;
                submit(&self.gpu, &[&amax_bits], &[amax], None);
                Ok((amax_bits, scale))
            })
            .await?;
        let out = read_words(&self.gpu, &amax_bits, 1).await;
        self.pool.give([amax_bits, scale]);
        Ok(f32::from_bits(out?[0]))
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
        let (ab, bb) = self.upload_operands(a, b).await?;
        let (tile, tuned, tuned_seconds) = self
            .tile_for(
                shape,
                algorithm,
                OnDevice::f32(&Region::whole(&ab), &Region::whole(&bb)),
            )
            .await?;
        let (seconds, clock, repetitions) = self
            .time_on_tile(
                shape,
                algorithm,
                tile,
                OnDevice::f32(&Region::whole(&ab), &Region::whole(&bb)),
                repetitions.max(1),
                operands,
            )
            .await?;
        Ok(MatmulTiming {
            seconds,
            operands,
            clock,
            repetitions,
            variant: format!(
                "{}{}{}",
                match self.variant_on(algorithm, tile).coop {
                    Some(c) => format!(
                        "coop-matrix {0}x{0}x{0}, subgroup {1}, block ",
                        c.size, c.subgroup
                    ),
                    None => "simt, tile ".into(),
                },
                tile.on_simt(false),
                match (tuned, tuned_seconds) {
                    (true, Some(s)) => format!(" (autotuned at {:.3} ms)", s * 1e3),
                    (true, None) => " (autotuned)".into(),
                    (false, _) => String::new(),
                }
            ),
            tuned_seconds,
        })
    }
}
