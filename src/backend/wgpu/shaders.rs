//! The WGSL loader: kernel families live in `shaders/*.wgsl`; a kernel's source is a generated
//! header (constants and the operand fetch functions of its variant), the shared
//! `formats.wgsl`, and the family's file. Every variant can be listed, so the test suite
//! validates them all with naga on any machine.

use crate::algorithm::{Algorithm, SPLIT_LEVELS};
use crate::backend::defs;
use crate::backend::sources::Sources;
use crate::format::Format;
use std::fmt;

pub use super::entries::{StepOp, TrainOp};

/// Loop iterations a loop of `n` passes costs: its passes and its exit test (`budget.rs`).
pub const fn looped(n: u64) -> u64 {
    n + 1
}

/// Lanes of a training row op's row on a GPU (`Gpu::row_lanes`): a row of a few hundred values
/// is a few loads a lane, four rows to a workgroup of 256.
pub const GPU_ROW_LANES: u32 = 64;

/// How f16 operands are read: as `f16` values (`enable f16;`, needs SHADER_F16) or as packed
/// u32 words decoded in integer arithmetic (core WGSL, works everywhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum F16Read {
    /// As `f16` values (`enable f16;`): needs SHADER_F16.
    Native,
    /// As packed u32 words decoded in integer arithmetic: core WGSL, runs everywhere.
    Packed,
}

/// How one matmul operand is stored and decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operand {
    /// f32 words.
    F32,
    /// f32 words rounded to tf32 as they are read.
    Tf32,
    /// bf16 codes, two per word (also the planes of the split algorithms).
    Bf16,
    /// f32 words rounded to bf16 as they are read: a plain bf16 operand held in f32 on SIMT
    /// (`MatmulVariant::reading`: no encoding pass before the product), and the cooperative
    /// kernel's SIMT fallback, which reads only the few flagged lines and so needs no bf16 copy
    /// of the operands beside the cooperative kernel's f16 planes.
    Bf16Rounded,
    /// f16 codes, read as `F16Read` says.
    F16(F16Read),
    /// f32 words rounded to f16 as they are read, in integers (no f16 arithmetic needed): a
    /// plain f16 operand held in f32 on SIMT (`MatmulVariant::reading`).
    F16Rounded,
    /// fp8 codes, four per word.
    Fp8(Format),
}

/// How the SIMT kernel loads an operand's tile from storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Load {
    /// Element by element: any layout, any size, any storage kind.
    #[default]
    Scalar,
    /// Four consecutive k in one 16-byte load (A row-major, B transposed; K a multiple of 4),
    /// spread over four k of the workgroup tile.
    QuadsAlongK,
    /// Four consecutive rows of A (transposed; M a multiple of 4) or columns of B (row-major;
    /// N a multiple of 4) in one load: one vec4 of the workgroup tile.
    QuadsAlongLines,
    /// As `QuadsAlongK`, four lines at a time: four quads (four lines by four k) turned in
    /// registers into four vec4s of the workgroup tile (one per k), 16-byte stores where
    /// `QuadsAlongK` writes each quad as four scalars (`Tile::quad_blocks`).
    QuadBlocksAlongK,
}

impl Load {
    /// How an operand of `kind` can be loaded: in quads where it holds one element per word
    /// and the dimension it is contiguous in (`along_k`, else rows or columns) is a multiple of
    /// 4 long (every quad is then aligned, inside the operand or past its end whole) and the
    /// bound buffer a whole number of quads; else element by element. Along K in blocks of
    /// four lines where `tile` asks for it.
    pub fn for_operand(
        kind: Operand,
        along_k: bool,
        contiguous: usize,
        buffer_bytes: u64,
        tile: Tile,
    ) -> Load {
        let one_per_word = matches!(kind, Operand::F32 | Operand::Tf32);
        if !one_per_word || !contiguous.is_multiple_of(4) || !buffer_bytes.is_multiple_of(16) {
            Load::Scalar
        } else if along_k && tile.quad_blocks {
            Load::QuadBlocksAlongK
        } else if along_k {
            Load::QuadsAlongK
        } else {
            Load::QuadsAlongLines
        }
    }

    /// Every way of loading, for the kernels' validation.
    pub const ALL: [Load; 4] = [
        Load::Scalar,
        Load::QuadsAlongK,
        Load::QuadsAlongLines,
        Load::QuadBlocksAlongK,
    ];

    fn id(self) -> u32 {
        match self {
            Load::Scalar => 0,
            Load::QuadsAlongK => 1,
            Load::QuadsAlongLines => 2,
            Load::QuadBlocksAlongK => 3,
        }
    }
}

impl Operand {
    fn element_type(self, load: Load) -> &'static str {
        match (self, load) {
            (_, Load::QuadsAlongK | Load::QuadsAlongLines | Load::QuadBlocksAlongK) => "vec4<u32>",
            (Operand::F16(F16Read::Native), _) => "f16",
            _ => "u32",
        }
    }

    /// `fn {name}(idx: u32) -> f32` and `fn {name}4(quad: u32) -> vec4<f32>` over `array`:
    /// fetch.wgsl's pieces for this kind, loaded as `load` says.
    fn fetch_fn(self, src: Sources, name: &str, array: &str, load: Load) -> String {
        let quads = load != Load::Scalar;
        let piece = match self {
            Operand::F32 if quads => "f32_quads",
            Operand::Tf32 if quads => "tf32_quads",
            Operand::F32 => "f32",
            Operand::Tf32 => "tf32",
            Operand::Bf16 => "bf16",
            Operand::Bf16Rounded => "bf16_rounded",
            Operand::F16Rounded => "f16_rounded",
            Operand::F16(F16Read::Native) => "f16_native",
            Operand::F16(F16Read::Packed) => "f16_packed",
            Operand::Fp8(_) => "fp8",
        };
        let fmt = match self {
            Operand::Fp8(f) => format!("FMT_{}", f.name().to_uppercase()),
            _ => String::new(),
        };
        let vars = [("name", name), ("array", array), ("fmt", fmt.as_str())];
        let mut out = template::fill(template::piece(src.text("fetch.wgsl"), piece), &vars);
        if !quads {
            out.push_str(&template::fill(
                template::piece(src.text("fetch.wgsl"), "no_quads"),
                &vars,
            ));
        }
        out
    }

    /// Elements per 32-bit word in storage.
    pub fn per_word(self) -> usize {
        match self {
            Operand::F32 | Operand::Tf32 | Operand::Bf16Rounded | Operand::F16Rounded => 1,
            Operand::Bf16 | Operand::F16(_) => 2,
            Operand::Fp8(_) => 4,
        }
    }
}

/// The id of a format in the kernels (`FMT_<NAME>`, generated by `backend::defs`).
pub fn format_id(format: Format) -> u32 {
    format.id()
}

/// Workgroup tile of the matmul kernel: `bm` x `bn` outputs per workgroup, `bk` of the inner
/// dimension per step, and `reg` x `reg` outputs per invocation (4, or 8 for single-plane
/// operands: four 4x4 blocks, a quarter of the workgroup memory reads per multiply-add).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Tile {
    /// Output rows per workgroup.
    pub bm: u32,
    /// Output columns per workgroup.
    pub bn: u32,
    /// Elements of the inner dimension per step.
    pub bk: u32,
    /// Outputs per invocation along each side (`reg` x `reg`).
    #[serde(default = "Tile::default_reg")]
    pub reg: u32,
    /// Cooperative kernel only: subgroups per workgroup. 1: the subgroup reads its tiles
    /// straight from storage; more: each K step of A and B is staged once in workgroup memory
    /// and the subgroups share it (each computing its part of the block).
    #[serde(default = "Tile::one")]
    pub warps: u32,
    /// SIMT kernel only: workgroup buffers per operand tile. 2: the next K step loads into one
    /// while the other is multiplied, one barrier per K step instead of two, for twice the
    /// workgroup memory.
    #[serde(default = "Tile::one")]
    pub buffers: u32,
    /// Cooperative kernel, staged blocks only: the next K step's loads from storage are issued
    /// into registers before this step's products and stored into workgroup memory after
    /// them, so that their latency hides behind the products.
    #[serde(default)]
    pub prefetch: bool,
    /// SIMT kernel only: f32 and tf32 operands contiguous in K (A row-major, B transposed)
    /// loaded four lines by four k a slot and stored as four vec4s of the workgroup tile
    /// (`Load::QuadBlocksAlongK`), rather than a quad spread over four k.
    #[serde(default)]
    pub quad_blocks: bool,
    /// Split-K: the workgroups that share an output tile's K, each summing whole groups of
    /// `GROUP_K` into planes that one more dispatch adds in group order (1: none). The same
    /// bits whatever the number (matmul.wgsl, "Summation order"); where K has fewer groups, or
    /// the planes do not fit, fewer.
    #[serde(default = "Tile::one")]
    pub splits: u32,
    /// On a device with cooperative matrices: the SIMT kernel (matmul.wgsl) on this tile
    /// instead of a cooperative block, where the tuner timed it faster for the shape class
    /// (on an H100 the f32 SIMT kernel outran the bf16 cooperative path, with its scaling
    /// passes, on every matmul of the training step: docs/h100.md). Both meet the algorithm's
    /// contract; their bits may differ, and the cached choice keeps a machine's runs alike.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub simt: bool,
    /// SIMT only: a bf16 or f16 operand held in f32 encoded by a pass of its own before the
    /// product, rather than rounded as the kernel reads it (`MatmulVariant::reading`, the
    /// default). The same bits either way; the tuner times both on the default SIMT tile.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub encoded: bool,
}

impl Tile {
    /// The tile used without autotuning: 64x64, with a k step that keeps workgroup memory
    /// within WebGPU's 16 KiB default for 1 to 3 planes.
    pub fn default_for(parts: u32) -> Tile {
        Tile {
            bm: 64,
            bn: 64,
            bk: if parts > 1 { 8 } else { 16 },
            reg: 4,
            warps: 1,
            buffers: 1,
            prefetch: false,
            quad_blocks: false,
            splits: 1,
            simt: false,
            encoded: false,
        }
    }

    fn default_reg() -> u32 {
        4
    }

    fn one() -> u32 {
        1
    }

    /// Invocations per workgroup.
    pub fn threads(self) -> u32 {
        (self.bm / self.reg) * (self.bn / self.reg)
    }

    /// Bytes of workgroup memory for operands of `parts` planes.
    pub fn workgroup_bytes(self, parts: u32) -> u32 {
        self.buffers * parts * self.bk * (self.bm + self.bn) * 4
    }

    /// The same tile with `buffers` workgroup buffers per operand.
    pub fn with_buffers(self, buffers: u32) -> Tile {
        Tile { buffers, ..self }
    }

    /// The same tile with its K split over `splits` workgroups (1: none).
    pub fn with_splits(self, splits: u32) -> Tile {
        Tile { splits, ..self }
    }

    /// The same tile as a SIMT tile chosen on a cooperative-matrix device (`simt`) or not.
    pub fn on_simt(self, simt: bool) -> Tile {
        Tile { simt, ..self }
    }

    /// The same tile encoding its f32-held 16-bit operands first (`encoded`) or not.
    pub fn with_encoded(self, encoded: bool) -> Tile {
        Tile { encoded, ..self }
    }

    /// The same tile loading f32 operands contiguous in K in blocks of four lines or not.
    pub fn with_quad_blocks(self, quad_blocks: bool) -> Tile {
        Tile {
            quad_blocks,
            ..self
        }
    }

    /// Every tile the autotuner may try for operands of `parts` planes on a device with these
    /// limits, the default first. Each computes bit for bit the same result (every output
    /// element sums its k terms in order whatever the tile), so the choice is speed alone.
    /// 8x8 register blocks serve single-plane operands only (split levels would need four
    /// times the accumulators). Each tile comes single-buffered, then double-buffered where
    /// the device's workgroup memory holds that.
    pub fn candidates(parts: u32, max_threads: u32, max_workgroup_bytes: u32) -> Vec<Tile> {
        let mut out = vec![Tile::default_for(parts)];
        let regs: &[u32] = if parts == 1 { &[4, 8] } else { &[4] };
        for &reg in regs {
            for bm in [32, 64, 128] {
                for bn in [32, 64, 128] {
                    for bk in [8, 16, 32] {
                        let t = Tile {
                            bm,
                            bn,
                            bk,
                            reg,
                            warps: 1,
                            buffers: 1,
                            prefetch: false,
                            quad_blocks: false,
                            splits: 1,
                            simt: false,
                            encoded: false,
                        };
                        if t.threads() < 32 || t.threads() > max_threads {
                            continue;
                        }
                        for t in [t, t.with_buffers(2)] {
                            if t.workgroup_bytes(parts) <= max_workgroup_bytes && !out.contains(&t)
                            {
                                out.push(t);
                            }
                        }
                    }
                }
            }
        }
        out
    }
}

impl Tile {
    /// The cooperative-matrix block without autotuning: 2x2 tiles per subgroup.
    pub fn coop_default(size: u32) -> Tile {
        Tile {
            bm: 2 * size,
            bn: 2 * size,
            bk: size,
            reg: 4,
            warps: 1,
            buffers: 1,
            prefetch: false,
            quad_blocks: false,
            splits: 1,
            simt: false,
            encoded: false,
        }
    }

    /// How the subgroups of a cooperative block of `size` x `size` tiles split it: (rows,
    /// columns) of subgroups, each taking an equal rectangle of whole tiles, the squarest such,
    /// more rows of subgroups on a tie (8 subgroups on 8 x 8 tiles: 4 x 2 of them, 2 x 4
    /// tiles each, as shmem.comp lays them out); None if `warps` does not divide the block's
    /// tiles.
    pub fn coop_warp_grid(self, size: u32) -> Option<(u32, u32)> {
        let (tr, tc) = (self.bm / size, self.bn / size);
        (1..=self.warps)
            .filter(|wr| self.warps.is_multiple_of(*wr))
            .map(|wr| (wr, self.warps / wr))
            .filter(|&(wr, wc)| tr.is_multiple_of(wr) && tc.is_multiple_of(wc))
            .min_by_key(|&(wr, wc)| ((tr / wr).abs_diff(tc / wc), std::cmp::Reverse(wr)))
    }

    /// Workgroup bytes of a cooperative block of `size` x `size` tiles over `planes` operand
    /// planes: one f32 tile per subgroup (where a tile passes on its way to C at the edges),
    /// and with several subgroups the f16 A and B tiles of one K step (rows padded by 8 halves
    /// against bank conflicts) per stage.
    pub fn coop_workgroup_bytes(self, size: u32, planes: u32) -> u32 {
        let staged = if self.warps > 1 {
            self.buffers * planes * (self.bm * (self.bk + 8) + self.bk * (self.bn + 8)) * 2
        } else {
            0
        };
        self.warps * size * size * 4 + staged
    }

    /// Blocks the autotuner may try on the cooperative-matrix kernel, the default first, then
    /// the published designs (`coop_designs`): one subgroup with 1, 2 or 4 tiles a side; or 4
    /// or 8 subgroups sharing a block of 4 or 8 tiles a side (8 subgroups also 16 x 8 tiles)
    /// staged through workgroup memory, a K step of one or two tiles, in one stage or two (the
    /// next K step copied while the current one is multiplied), each with and without prefetch
    /// (the next K step's loads in registers while the current one is multiplied).
    pub fn coop_candidates(
        size: u32,
        subgroup: u32,
        planes: u32,
        max_workgroup_bytes: u32,
        max_threads: u32,
    ) -> Vec<Tile> {
        let mut out = vec![Tile::coop_default(size)];
        let mut push = |t: Tile| {
            if t.coop_workgroup_bytes(size, planes) <= max_workgroup_bytes
                && t.warps * subgroup <= max_threads
                && t.coop_warp_grid(size).is_some()
                && !out.contains(&t)
            {
                out.push(t);
            }
        };
        Tile::coop_designs(size).into_iter().for_each(&mut push);
        for bm in [1, 2, 4] {
            for bn in [1, 2, 4] {
                push(Tile::coop_staged(size, (bm, bn, 1), 1, 1, false));
            }
        }
        for warps in [4, 8] {
            let mut blocks = vec![(4, 4), (4, 8), (8, 4), (8, 8)];
            if warps == 8 {
                blocks.push((16, 8));
            }
            for (bm, bn) in blocks {
                for bk in [1, 2] {
                    for buffers in [1, 2] {
                        for prefetch in [false, true] {
                            push(Tile::coop_staged(
                                size,
                                (bm, bn, bk),
                                warps,
                                buffers,
                                prefetch,
                            ));
                        }
                    }
                }
            }
        }
        out
    }

    /// A cooperative block of `tiles` (rows, columns, K step) tiles of `size`, on `warps`
    /// subgroups (staged through workgroup memory where several) in `buffers` stages.
    fn coop_staged(
        size: u32,
        tiles: (u32, u32, u32),
        warps: u32,
        buffers: u32,
        prefetch: bool,
    ) -> Tile {
        Tile {
            bm: tiles.0 * size,
            bn: tiles.1 * size,
            bk: tiles.2 * size,
            reg: 4,
            warps,
            buffers,
            prefetch,
            quad_blocks: false,
            splits: 1,
            simt: false,
            encoded: false,
        }
    }

    /// The staged blocks of the published cooperative-matrix GEMMs, likeliest on a GPU first:
    /// what `fast` tuning tries after the default (docs/wgpu.md).
    /// - NVIDIA's vk_cooperative_matrix_perf (`shmem.comp`): 8 subgroups, 4 rows by 2 columns
    ///   of them over 8 x 8 tiles (128 x 128 at T = 16), each 2 x 4 tiles of accumulators
    ///   reusing each A fragment across its columns; a K step of one tile for f32 accumulators
    ///   (our case: two tiles are its f16-accumulator step), the next step prefetched into
    ///   registers. Also in two stages (one barrier a step), with two tiles a step, and 16 x 8
    ///   tiles (256 x 128, 4 x 4 accumulators a subgroup).
    /// - llama.cpp's Vulkan coopmat1 matmul: 4 subgroups (128 invocations on NVIDIA) over
    ///   8 x 8 tiles, 4 x 4 tiles (64 x 64) each, a K step of one tile copied straight from
    ///   storage; and with prefetch.
    pub fn coop_designs(size: u32) -> Vec<Tile> {
        let s = |tiles, warps, buffers, prefetch| {
            Tile::coop_staged(size, tiles, warps, buffers, prefetch)
        };
        vec![
            s((8, 8, 1), 8, 1, true),
            s((8, 8, 1), 8, 2, true),
            s((8, 8, 2), 8, 1, true),
            s((16, 8, 1), 8, 1, true),
            s((8, 8, 1), 4, 1, false),
            s((8, 8, 1), 4, 1, true),
        ]
    }
}

impl fmt::Display for Tile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}x{}", self.bm, self.bn, self.bk)?;
        if self.reg != 4 {
            write!(f, " reg {0}x{0}", self.reg)?;
        }
        if self.warps != 1 {
            write!(f, " {} subgroups", self.warps)?;
        }
        if self.buffers == 2 {
            write!(f, " double-buffered")?;
        }
        if self.prefetch {
            write!(f, " prefetched")?;
        }
        if self.quad_blocks {
            write!(f, " quad blocks")?;
        }
        if self.splits > 1 {
            write!(f, " split-K {}", self.splits)?;
        }
        if self.simt {
            write!(f, " on SIMT")?;
        }
        if self.encoded {
            write!(f, " encoded first")?;
        }
        Ok(())
    }
}

/// A cooperative-matrix configuration: square `size` x `size` x `size` tiles (16 on NVIDIA, 8
/// on Apple and lavapipe), f16 operands, f32 accumulators, on subgroups of `subgroup` lanes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Coop {
    /// Tile side (M = N = K of one cooperative multiply).
    pub size: u32,
    /// Lanes of a subgroup.
    pub subgroup: u32,
}

/// One compiled variant of the matmul kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulVariant {
    /// How A is stored and decoded.
    pub a: Operand,
    /// How B is stored and decoded.
    pub b: Operand,
    /// bf16 planes per operand (1 without a split; 2 or 3: h, m, l).
    pub parts: u32,
    /// Split levels, each with its own accumulators (0 without a split).
    pub levels: u32,
    /// Whether the operands are fp8 codes with scales.
    pub fp8: bool,
    /// fp8 with one scale per row of A and column of B (else per tensor).
    pub rowwise: bool,
    /// The workgroup tile.
    pub tile: Tile,
    /// On cooperative matrices (`matmul_coop.wgsl`); else SIMT.
    pub coop: Option<Coop>,
    /// SIMT fallback of the cooperative kernel: only outputs of flagged lines.
    pub masked: bool,
    /// SIMT: the K step written out per k rather than looped, for modules with runtime checks
    /// (a bounded loop is not unrolled by drivers; matmul_step.wgsl).
    pub unrolled: bool,
    /// SIMT: how A's and B's tiles are loaded (quads where the layout and sizes allow).
    pub loads: [Load; 2],
    /// What the store does with each product besides storing it.
    pub store: Store,
    /// SIMT, one plane, one matrix: the sums of B's columns over K as well, into a binding of
    /// their own (a linear layer's bias gradient beside its weight gradient: cuBLASLt's
    /// `BGRADB` epilogue), summed as the products are (`column_step` in matmul.wgsl).
    pub column_sums: bool,
}

/// What a matmul kernel's store does with each product besides storing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Store {
    /// Nothing.
    Plain,
    /// Rounds it to the format the plan holds it in (`Op::Matmul`'s `held`; the format in the
    /// uniform's `epi.z`): no binding.
    Held,
    /// A linear layer's bias add, with its residual or GELU (epilogue.wgsl): three more
    /// bindings, the add's formats in the uniform.
    BiasAdd {
        /// C stored as the 16-bit codes of the sum's format, two a word (C's rows of even
        /// length), as a plan stores a coded tensor; else as f32 values.
        coded: bool,
    },
}

impl Store {
    /// Whether the store adds a bias (epilogue.wgsl's bindings).
    pub fn adds_bias(self) -> bool {
        matches!(self, Store::BiasAdd { .. })
    }

    /// Whether C is stored as 16-bit codes.
    pub fn coded(self) -> bool {
        matches!(self, Store::BiasAdd { coded: true })
    }
}

impl MatmulVariant {
    /// The variant that computes `algorithm`, reading f16 as `f16`.
    pub fn for_algorithm(algorithm: &Algorithm, f16: F16Read) -> MatmulVariant {
        let operand = |f: Format| match f {
            Format::F32 => Operand::F32,
            Format::Tf32 => Operand::Tf32,
            Format::Bf16 => Operand::Bf16,
            Format::F16 => Operand::F16(f16),
            Format::E4m3 | Format::E5m2 => Operand::Fp8(f),
        };
        let (fa, fb) = algorithm.operand_formats();
        let parts = algorithm.split_parts().max(1) as u32;
        let tile = Tile::default_for(parts);
        MatmulVariant {
            a: operand(fa),
            b: operand(fb),
            parts,
            levels: algorithm.split_levels() as u32,
            fp8: algorithm.is_fp8(),
            rowwise: matches!(
                algorithm.scaling(),
                Some(crate::algorithm::Scaling::Rowwise)
            ),
            tile,
            coop: None,
            masked: false,
            unrolled: false,
            loads: [Load::Scalar; 2],
            store: Store::Plain,
            column_sums: false,
        }
    }

    /// The cooperative-matrix variant of `algorithm` on `coop`, for the
    /// algorithms whose operands are exact in f16: `f16`, and `bf16` and the split algorithms
    /// (bf16 planes scaled per line into f16's range, lines that do not fit go to the SIMT
    /// kernel). Others have no such variant.
    pub fn coop(algorithm: &Algorithm, coop: Coop) -> Option<MatmulVariant> {
        let (fa, fb) = algorithm.operand_formats();
        let operand = match (fa, fb) {
            (Format::F16, Format::F16) if !algorithm.is_split() => Operand::F16(F16Read::Native),
            (Format::Bf16, Format::Bf16) => Operand::Bf16,
            _ => return None,
        };
        Some(MatmulVariant {
            a: operand,
            b: operand,
            parts: algorithm.split_parts().max(1) as u32,
            levels: algorithm.split_levels() as u32,
            fp8: false,
            rowwise: false,
            tile: Tile::coop_default(coop.size),
            coop: Some(coop),
            masked: false,
            unrolled: false,
            loads: [Load::Scalar; 2],
            store: Store::Plain,
            column_sums: false,
        })
    }

    /// The variant that computes `algorithm` where the matmuls run on `coop` (None: on no
    /// cooperative matrices, as `device::coop_choice` decides): cooperative where the
    /// algorithm has such a variant, else SIMT, reading f16 as `f16` says.
    pub fn chosen(algorithm: &Algorithm, coop: Option<Coop>, f16: F16Read) -> MatmulVariant {
        coop.and_then(|c| MatmulVariant::coop(algorithm, c))
            .unwrap_or_else(|| MatmulVariant::for_algorithm(algorithm, f16))
    }

    /// Whether the cooperative kernel scales bf16 planes per line (and so needs the SIMT
    /// fallback for flagged lines).
    pub fn scaled(&self) -> bool {
        self.coop.is_some() && self.a == Operand::Bf16
    }

    /// Whether the kernel needs SHADER_F16 (cooperative matrices, or native f16 reads).
    pub fn uses_f16(&self) -> bool {
        self.coop.is_some()
            || matches!(self.a, Operand::F16(F16Read::Native))
            || matches!(self.b, Operand::F16(F16Read::Native))
    }

    /// Bytes of workgroup memory the kernel takes.
    pub fn workgroup_bytes(&self) -> u32 {
        match self.coop {
            Some(c) => self.tile.coop_workgroup_bytes(c.size, self.parts),
            None => self.tile.workgroup_bytes(self.parts),
        }
    }

    /// Invocations per workgroup.
    pub fn threads(&self) -> u32 {
        self.coop
            .map_or_else(|| self.tile.threads(), |c| c.subgroup * self.tile.warps)
    }

    /// The SIMT variant for operands stored as `stored`: a plain bf16 or f16 operand held in
    /// f32 is rounded as the kernel reads it (`Operand::Bf16Rounded`, `F16Rounded`) rather
    /// than encoded by a pass of its own first. On an H100 the f32 kernel, which reads as
    /// much, ran the step's weight gradients in 0.78 ms an op where encode-then-read took 1.0
    /// (docs/h100.md); the tuner times the encoded path beside it (`Tile::encoded`). The
    /// rounding is the encoder's, so the bits are the same (tests/autotune.rs,
    /// `sixteen_bit_reads_from_f32_give_the_codes_bits`).
    pub fn reading(self, stored: [Format; 2]) -> MatmulVariant {
        if self.coop.is_some() || self.parts > 1 {
            return self;
        }
        let rounded = |o: Operand, f: Format| match (o, f) {
            (Operand::Bf16, Format::F32) => Operand::Bf16Rounded,
            (Operand::F16(_), Format::F32) => Operand::F16Rounded,
            _ => o,
        };
        MatmulVariant {
            a: rounded(self.a, stored[0]),
            b: rounded(self.b, stored[1]),
            ..self
        }
    }

    /// `fallback` for operands stored as `stored`: a plain bf16 operand stored as bf16 codes
    /// (a step plan's coded tensor) is read as the packed codes it is.
    pub fn fallback_for(&self, stored: [Format; 2]) -> MatmulVariant {
        let mut v = self.fallback();
        let coded = |f: Format, o: Operand| if f == Format::Bf16 { Operand::Bf16 } else { o };
        v.a = coded(stored[0], v.a);
        v.b = coded(stored[1], v.b);
        v
    }

    /// The SIMT variant that computes the lines a cooperative variant flags: on split planes,
    /// or for plain bf16 on the f32 operands rounded as they are read.
    pub fn fallback(&self) -> MatmulVariant {
        let operand = if self.parts > 1 {
            Operand::Bf16
        } else {
            Operand::Bf16Rounded
        };
        MatmulVariant {
            a: operand,
            b: operand,
            tile: Tile::default_for(self.parts),
            coop: None,
            masked: true,
            ..*self
        }
    }

    /// The same variant with its K step written out per k (`unrolled`) or looped.
    pub fn with_unrolled(self, unrolled: bool) -> MatmulVariant {
        MatmulVariant { unrolled, ..self }
    }

    /// The same variant loading A and B as `loads` say.
    pub fn with_loads(self, loads: [Load; 2]) -> MatmulVariant {
        MatmulVariant { loads, ..self }
    }

    /// The same variant on another tile.
    pub fn with_tile(self, tile: Tile) -> MatmulVariant {
        MatmulVariant { tile, ..self }
    }

    /// The same variant with `store` in its store.
    pub fn with_store(self, store: Store) -> MatmulVariant {
        MatmulVariant { store, ..self }
    }

    /// The same variant summing B's columns as well or not.
    pub fn with_column_sums(self, column_sums: bool) -> MatmulVariant {
        MatmulVariant {
            column_sums,
            ..self
        }
    }

    /// Whether this kernel can sum B's columns as well (`column_sums`): SIMT on one plane of
    /// non-fp8 operands.
    pub fn can_sum_columns(&self) -> bool {
        self.coop.is_none() && !self.masked && self.parts == 1 && !self.fp8
    }

    /// Columns of B each invocation sums (`column_sums`; matmul.wgsl's `SUM_COLS`).
    fn sum_cols(&self) -> u64 {
        u64::from(self.tile.bn.div_ceil(self.tile.threads()))
    }

    /// The first binding of the epilogue's three (bias, residual, GELU), after the kernel's
    /// own: uniform, A, B, C, scales or amaxes, partial sums (and the flags of a cooperative
    /// kernel or its masked fallback).
    pub fn epilogue_binding(&self) -> u32 {
        if self.coop.is_some() || self.masked {
            7
        } else {
            6
        }
    }

    /// The column sums' binding (`column_sums`), after the kernel's own and the epilogue's.
    pub fn column_sums_binding(&self) -> u32 {
        self.epilogue_binding() + if self.store.adds_bias() { 3 } else { 0 }
    }

    /// Split levels, each with its own accumulators (1 without a split).
    pub fn level_count(&self) -> u32 {
        level_terms(self.levels).len() as u32
    }

    /// The loop iterations one invocation of this kernel runs (budget.rs), counted from the
    /// code the loader writes: every loop with its exit test, loops a compiler may unroll and
    /// loops of branches not taken included, so an upper bound.
    pub fn k_loops(&self) -> KLoops {
        let t = self.tile;
        let Some(coop) = self.coop else {
            let threads = u64::from(t.threads());
            // load_tiles: a loop over A's slots, one over B's.
            // Four lines at one k a slot, or four lines by four k (quad blocks).
            let slots = |lines: u32, load: Load| {
                let per_slot = if load == Load::QuadBlocksAlongK {
                    16
                } else {
                    4
                };
                (u64::from(lines) * u64::from(t.bk) / per_slot).div_ceil(threads)
            };
            let loads = looped(slots(t.bm, self.loads[0])) + looped(slots(t.bn, self.loads[1]));
            // k_step: its loop over the step's k, unless written out; column_step's, looped.
            let step = if self.unrolled {
                0
            } else {
                looped(t.bk.into())
            } + if self.column_sums {
                // column_step: its loop over the invocation's columns, each over the step's k.
                looped(self.sum_cols()) + self.sum_cols() * looped(t.bk.into())
            } else {
                0
            };
            // store_row, and the totals' and planes' rows: a loop over four outputs, once per
            // row of each 4x4 block (and level, for the totals and planes).
            let rows = 4 * if t.reg == 8 { 4 } else { 1 };
            let levels = u64::from(self.level_count());
            let row = looped(4);
            // A group: the pass of the groups' loop, k_loop's steps (two a pass with two
            // buffers, the first loaded before) and its exit, then its totals added and stored
            // (or its plane stored: fewer).
            let steps = u64::from(GROUP_K / t.bk);
            let k_loop = if t.buffers == 2 {
                loads + looped(steps / 2) + steps * (loads + step)
            } else {
                looped(steps) + steps * (loads + step)
            };
            // The MASKED flag scan, and the final store.
            let fixed = looped(u64::from(t.bm + t.bn).div_ceil(threads)) + rows * row;
            // A group's column sums zeroed, their totals added and stored: a loop each.
            let columns = if self.column_sums {
                3 * looped(self.sum_cols())
            } else {
                0
            };
            return KLoops {
                fixed,
                per_unit: 1 + k_loop + 2 * rows * levels * row + columns,
                unit_k: GROUP_K,
            };
        };
        let planes = u64::from(coop_planes(self));
        // stage_load and stage_store (a copy is both): each a loop over A's slots and one over
        // B's, each pass a loop over the planes.
        let copy = if t.warps > 1 {
            let (slots_a, slots_b) = coop_slots(self);
            let one = |slots: u32| looped(slots.into()) + u64::from(slots) * looped(planes);
            2 * (one(slots_a) + one(slots_b))
        } else {
            0
        };
        let steps = u64::from(COOP_PROMOTE_K / t.bk);
        let (wr, wc) = t.coop_warp_grid(coop.size).unwrap_or((1, 1));
        let tiles = u64::from((t.bm / coop.size / wr) * (t.bn / coop.size / wc));
        // store_tile's loop per tile, the first stage's copy (two stages, or prefetch), the promotion
        // loop's exit.
        let per_tile = u64::from(coop.size * coop.size).div_ceil(coop.subgroup.into());
        let first = if t.warps > 1 && (t.buffers == 2 || t.prefetch) {
            copy
        } else {
            0
        };
        // A group: its pass, and its promotion intervals' loop, each interval a pass, the K
        // loop over its steps, their copies.
        let intervals = u64::from(GROUP_K / COOP_PROMOTE_K);
        KLoops {
            fixed: tiles * looped(per_tile) + first + 1,
            per_unit: 1 + looped(intervals) + intervals * (1 + looped(steps) + steps * copy),
            unit_k: GROUP_K,
        }
    }
}

impl MatmulVariant {
    /// Loop iterations per invocation of a split-K product's reduction over `planes` group
    /// planes (MODE_REDUCE): the loop over the planes after the first, each pass reading every
    /// accumulator's outputs (SIMT: a loop over four a row), then the final store.
    pub fn reduce_loops(&self, planes: u32) -> u64 {
        let t = self.tile;
        let levels = u64::from(self.level_count());
        let rest = u64::from(planes.saturating_sub(1));
        match self.coop {
            None => {
                let rows = 4 * if t.reg == 8 { 4 } else { 1 };
                let read = rows * levels * looped(4);
                // load_column_planes: per column, a loop over the planes after the first.
                let cols = self.sum_cols();
                let columns = if self.column_sums {
                    looped(cols) + cols * looped(rest)
                } else {
                    0
                };
                read + looped(rest) + rest * read + rows * looped(4) + columns
            }
            Some(coop) => {
                let (wr, wc) = t.coop_warp_grid(coop.size).unwrap_or((1, 1));
                let tiles = u64::from((t.bm / coop.size / wr) * (t.bn / coop.size / wc));
                let per_tile = u64::from(coop.size * coop.size).div_ceil(coop.subgroup.into());
                looped(rest) + tiles * looped(per_tile)
            }
        }
    }
}

/// A matmul kernel's loop iterations per invocation (`MatmulVariant::k_loops`): `fixed` per
/// dispatch, and `per_unit` for each `unit_k` of K it sums (so K is split at multiples of
/// `unit_k`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KLoops {
    /// Loop iterations per dispatch, whatever its K.
    pub fixed: u64,
    /// Loop iterations for each `unit_k` of K.
    pub per_unit: u64,
    /// The unit K is counted (and split) in.
    pub unit_k: u32,
}

/// A kernel: one entry point of one family, with its variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// f32 -> packed codes of a format (cast.wgsl).
    Encode,
    /// Packed codes of a format -> f32 (cast.wgsl).
    Decode,
    /// f32 -> fp8 codes of the scaled value, saturating (cast.wgsl).
    Quantize,
    /// The largest finite |x| per scaling group (scale.wgsl).
    Amax,
    /// The fp8 scale FMAX / amax per group (scale.wgsl).
    ScaleFromAmax,
    /// The bf16 split x = h + m + l into packed planes (split.wgsl).
    SplitBf16,
    /// An operand of the cooperative kernel as f16 codes padded to whole tiles (coop_pack.wgsl).
    CoopPack,
    /// The matmul kernel of a variant (matmul.wgsl, or matmul_coop.wgsl on cooperative matrices).
    Matmul(MatmulVariant),
    /// A train.wgsl kernel, for rows of this many lanes (`Gpu::row_lanes`).
    Train(TrainOp, u32),
    /// Fused attention on cooperative matrices (attention_coop.wgsl; one of the attention ops),
    /// for f16 matmul inputs.
    AttentionCoop(TrainOp, Coop),
    /// A step.wgsl kernel.
    Step(StepOp),
    /// The loop budget's probe (`budget.rs`).
    LoopProbe,
}

impl Kernel {
    /// The entry point's name in its WGSL module.
    pub fn entry_point(&self) -> &'static str {
        match self {
            Kernel::Encode => "encode",
            Kernel::Decode => "decode",
            Kernel::Quantize => "quantize",
            Kernel::Amax => "amax",
            Kernel::ScaleFromAmax => "scale_from_amax",
            Kernel::SplitBf16 => "split_bf16",
            Kernel::CoopPack => "coop_pack",
            Kernel::Matmul(v) if v.coop.is_some() => "matmul_coop",
            Kernel::Matmul(_) => "matmul",
            Kernel::Train(op, _) => op.entry_point(),
            Kernel::AttentionCoop(op, _) => match op {
                TrainOp::AttentionBwdQ => "attention_coop_bwd_q",
                TrainOp::AttentionBwdKv => "attention_coop_bwd_kv",
                _ => "attention_coop_fwd",
            },
            Kernel::Step(op) => op.entry_point(),
            Kernel::LoopProbe => "loop_probe",
        }
    }

    /// A readable name: "cast.encode", "matmul[Bf16 x Bf16, levels 2]".
    pub fn label(&self) -> String {
        match self {
            Kernel::Encode | Kernel::Decode | Kernel::Quantize => {
                format!("cast.{}", self.entry_point())
            }
            Kernel::Amax | Kernel::ScaleFromAmax => format!("scale.{}", self.entry_point()),
            Kernel::SplitBf16 => "split.split_bf16".into(),
            Kernel::CoopPack => "coop_pack.coop_pack".into(),
            Kernel::Train(op, lanes) => format!("train.{}[row lanes {lanes}]", op.entry_point()),
            Kernel::AttentionCoop(_, c) => format!(
                "attention_coop.{}[{1}x{1}x{1}, subgroup {2}]",
                self.entry_point(),
                c.size,
                c.subgroup
            ),
            Kernel::Step(op) => format!("step.{}", op.entry_point()),
            Kernel::LoopProbe => "loop_probe.loop_probe".into(),
            Kernel::Matmul(v) => format!(
                "{}[{:?} x {:?}, parts {}, levels {}, fp8 {}, rowwise {}, tile {}{}]",
                if v.coop.is_some() {
                    "matmul_coop"
                } else {
                    "matmul"
                },
                v.a,
                v.b,
                v.parts,
                v.levels,
                v.fp8,
                v.rowwise,
                v.tile,
                match (v.coop, v.masked) {
                    (Some(c), _) => format!(", {0}x{0}x{0}, subgroup {1}", c.size, c.subgroup),
                    (None, true) => ", masked".into(),
                    _ => String::new(),
                } + if v.unrolled { ", unrolled" } else { "" }
                    + match v.store {
                        Store::Plain => "",
                        Store::Held => ", held",
                        Store::BiasAdd { coded: false } => ", epilogue",
                        Store::BiasAdd { coded: true } => ", epilogue into codes",
                    }
                    + if v.column_sums { ", column sums" } else { "" }
                    + &match v.loads {
                        [Load::Scalar, Load::Scalar] => String::new(),
                        [a, b] => format!(", loads {a:?} x {b:?}"),
                    }
            ),
        }
    }

    /// Whether the kernel runs on cooperative matrices.
    pub fn uses_coop(&self) -> bool {
        matches!(self, Kernel::Matmul(v) if v.coop.is_some())
            || matches!(self, Kernel::AttentionCoop(..))
    }

    /// Whether the kernel needs SHADER_F16.
    pub fn needs_f16(&self) -> bool {
        matches!(self, Kernel::Matmul(v) if v.uses_f16())
            || matches!(self, Kernel::AttentionCoop(..))
    }

    /// The source files this kernel is built from (`backend::sources`).
    pub fn files(&self) -> Vec<&'static str> {
        let mut files = vec!["formats.wgsl"];
        files.extend_from_slice(match self {
            Kernel::Encode | Kernel::Decode | Kernel::Quantize => &["cast.wgsl"],
            Kernel::Amax | Kernel::ScaleFromAmax => &["scale.wgsl"],
            Kernel::SplitBf16 => &["split.wgsl"],
            Kernel::CoopPack => &["coop_pack.wgsl"],
            Kernel::Matmul(v) if v.coop.is_some() && v.store.adds_bias() => &[
                "matmul_coop.wgsl",
                "coop_block.wgsl",
                "epilogue.wgsl",
                "unary.wgsl",
            ],
            Kernel::Matmul(v) if v.coop.is_some() => &["matmul_coop.wgsl", "coop_block.wgsl"],
            Kernel::Matmul(v) if v.store.adds_bias() => &[
                "matmul.wgsl",
                "matmul_step.wgsl",
                "fetch.wgsl",
                "epilogue.wgsl",
                "unary.wgsl",
            ],
            Kernel::Matmul(_) => &["matmul.wgsl", "matmul_step.wgsl", "fetch.wgsl"],
            Kernel::Train(op, _) if op.is_attention() => {
                &["train.wgsl", "unary.wgsl", "attention.wgsl"]
            }
            Kernel::Train(..) => &["train.wgsl", "unary.wgsl"],
            Kernel::AttentionCoop(..) => &[
                "train.wgsl",
                "unary.wgsl",
                "attention.wgsl",
                "attention_coop.wgsl",
            ],
            Kernel::Step(_) => &["step.wgsl", "unary.wgsl"],
            Kernel::LoopProbe => &["loop_probe.wgsl"],
        });
        files
    }

    /// The complete WGSL source of this kernel, from the current sources (`MANTISSA_KERNEL_DIR`'s
    /// files where it replaces any).
    pub fn source(&self) -> String {
        self.source_in(Sources::Current)
    }

    /// The complete WGSL source of this kernel, from `src`.
    pub fn source_in(&self, src: Sources) -> String {
        self.composed(src).0
    }

    /// Where a line of the kernel's source comes from: the file and its line, or "generated"
    /// (the loader's header and written-out pieces).
    pub fn source_line(&self, src: Sources, line: usize) -> String {
        let (_, map) = self.composed(src);
        let Some(&(start, file)) = map.iter().rev().find(|(start, _)| *start <= line) else {
            return format!("generated line {line}");
        };
        match file {
            Some(f) => format!("{f}:{}", line - start + 1),
            None => format!("generated line {line}"),
        }
    }

    /// The kernel's source, and where each of its parts starts: (first line, the file it is,
    /// or None where the loader wrote it).
    fn composed(&self, src: Sources) -> (String, Vec<(usize, Option<&'static str>)>) {
        let family = src.text(self.files()[1]);
        let mut header = String::new();
        if self.needs_f16() {
            header.push_str("enable f16;\n\n");
        }
        if let Kernel::Matmul(v @ MatmulVariant { coop: Some(c), .. }) = self {
            header.push_str(&format!(
                "enable wgpu_cooperative_matrix;\n\nconst BM: u32 = {}u;\nconst BN: u32 = {}u;\n\
                 const T: u32 = {}u;\nconst BK: u32 = {}u;\nconst SG: u32 = {}u;\nconst WG: u32 = {}u;\n\
                 const SCALED: bool = {};\nalias OPERAND_T = {};\nconst GROUP_K: u32 = {}u;\n\n",
                v.tile.bm,
                v.tile.bn,
                c.size,
                v.tile.bk,
                c.subgroup,
                c.subgroup * v.tile.warps,
                v.scaled(),
                if v.tile.warps > 1 { "Octet" } else { "f16" },
                GROUP_K
            ));
            header.push_str(&span_consts());
            header.push_str(&epilogue_consts(v));
            header.push_str(&coop_block(src, v));
        } else if let Kernel::AttentionCoop(_, c) = self {
            use super::entries::{ATT_BC, ATT_COOP_SUBGROUPS, ATT_LANES, ATT_MAX_D};
            let t = c.size;
            header.push_str(&format!(
                "enable wgpu_cooperative_matrix;\n\nconst ROW_LANES: u32 = 1u;\n\
                 const ATT_MAX_D: u32 = {ATT_MAX_D}u;\nconst ATT_LANES: u32 = {ATT_LANES}u;\n\
                 const ATT_BC: u32 = {ATT_BC}u;\nconst T: u32 = {t}u;\nconst SG: u32 = {}u;\n\
                 const ATT_W: u32 = {ATT_COOP_SUBGROUPS}u;\nconst ATT_KC: u32 = {}u;\n\
                 alias CoopA = coop_mat{t}x{t}<f16, A>;\nalias CoopB = coop_mat{t}x{t}<f16, B>;\n\
                 alias CoopC = coop_mat{t}x{t}<f32, C>;\n\n",
                c.subgroup,
                2 * t
            ));
            header.push_str(&span_consts());
        } else if let Kernel::Train(op, lanes) = self {
            header.push_str(&format!("const ROW_LANES: u32 = {lanes}u;\n\n"));
            if op.is_attention() {
                use super::entries::{ATT_BC, ATT_LANES, ATT_MAX_D};
                header.push_str(&format!(
                    "const ATT_MAX_D: u32 = {ATT_MAX_D}u;\nconst ATT_LANES: u32 = {ATT_LANES}u;\n\
                     const ATT_BC: u32 = {ATT_BC}u;\n\n"
                ));
            }
            header.push_str(&span_consts());
        } else if let Kernel::Step(_) = self {
            header.push_str(&span_consts());
        } else if let Kernel::Matmul(v) = self {
            header.push_str(&format!(
                "const BM: u32 = {}u;\nconst BN: u32 = {}u;\nconst BK: u32 = {}u;\nconst BUFFERS: u32 = {}u;\nconst REG: u32 = {}u;\n\
                 const PARTS: u32 = {}u;\nconst LEVELS: u32 = {}u;\nconst FP8: bool = {};\nconst ROWWISE: bool = {};\n\
                 alias A_T = {};\nalias B_T = {};\nconst A_LOAD: u32 = {}u;\nconst B_LOAD: u32 = {}u;\n\n",
                v.tile.bm,
                v.tile.bn,
                v.tile.bk,
                v.tile.buffers,
                v.tile.reg,
                v.parts,
                v.levels,
                v.fp8,
                v.rowwise,
                v.a.element_type(v.loads[0]),
                v.b.element_type(v.loads[1]),
                v.loads[0].id(),
                v.loads[1].id()
            ));
            header.push_str(&format!("const GROUP_K: u32 = {GROUP_K}u;\n"));
            header.push_str(&v.a.fetch_fn(src, "fetch_a", "a_data", v.loads[0]));
            header.push_str(&v.b.fetch_fn(src, "fetch_b", "b_data", v.loads[1]));
            header.push_str(&span_consts());
            header.push_str(&epilogue_consts(v));
            header.push_str(&column_sums_consts(v));
            header.push_str(if v.masked {
                "const MASKED: bool = true;\n\
                 @group(0) @binding(6) var<storage, read> flags: array<u32>;\n\
                 fn flagged(line: u32) -> bool {\n    return (flags[line / 32u] & (1u << (line % 32u))) != 0u;\n}\n"
            } else {
                "const MASKED: bool = false;\nfn flagged(line: u32) -> bool {\n    return false;\n}\n"
            });
        }
        // Directives first (WGSL wants them before any declaration), then the definitions,
        // formats.wgsl and the family's file (after unary.wgsl for the training kernels, before
        // the written-out K step for the SIMT matmul).
        let (directives, rest): (Vec<&str>, Vec<&str>) =
            header.lines().partition(|l| l.starts_with("enable "));
        let mut parts: Vec<(Option<&'static str>, String)> = vec![(
            None,
            format!(
                "// generated header\n{}\n{}{}",
                directives.join("\n"),
                defs::wgsl(),
                rest.join("\n")
            ),
        )];
        parts.push((Some("formats.wgsl"), src.text("formats.wgsl").to_string()));
        if let Kernel::Train(..) | Kernel::Step(_) | Kernel::AttentionCoop(..) = self {
            parts.push((Some("unary.wgsl"), src.text("unary.wgsl").to_string()));
        }
        parts.push((Some(self.files()[1]), family.to_string()));
        // Fused attention after train.wgsl, whose uniform, bindings and helpers it uses.
        for file in self.files().into_iter().skip(2) {
            if file.starts_with("attention") {
                parts.push((Some(file), src.text(file).to_string()));
            }
        }
        if let Kernel::Matmul(v) = self
            && v.coop.is_none()
        {
            parts.push((None, k_step(src, v)));
        }
        if let Kernel::Matmul(v) = self
            && v.store.adds_bias()
        {
            for file in ["epilogue.wgsl", "unary.wgsl"] {
                parts.push((Some(file), src.text(file).to_string()));
            }
        }
        let mut text = String::new();
        let mut map = Vec::new();
        for (file, part) in parts {
            map.push((text.lines().count() + 1, file));
            text.push_str(&part);
            if !text.ends_with('\n') {
                text.push('\n');
            }
        }
        (text, map)
    }

    /// Every kernel variant the backend can build (for validation in tests).
    pub fn all() -> Vec<Kernel> {
        let mut kernels = vec![
            Kernel::Encode,
            Kernel::Decode,
            Kernel::Quantize,
            Kernel::Amax,
            Kernel::ScaleFromAmax,
            Kernel::SplitBf16,
            Kernel::CoopPack,
            Kernel::LoopProbe,
        ];
        // Rows of one lane (CPUs) and of a GPU's default.
        for lanes in [1, GPU_ROW_LANES] {
            kernels.extend(TrainOp::ALL.map(|op| Kernel::Train(op, lanes)));
        }
        kernels.extend(StepOp::ALL.map(Kernel::Step));
        // bf16 and f16 (both reads) read from f32 (`MatmulVariant::reading`) on either side or
        // both, with and without an epilogue.
        let reads = [
            (Algorithm::Bf16, F16Read::Native, Format::Bf16),
            (Algorithm::F16, F16Read::Native, Format::F16),
            (Algorithm::F16, F16Read::Packed, Format::F16),
        ];
        for (alg, f16, coded) in reads {
            let v = MatmulVariant::for_algorithm(&alg, f16);
            let f32_ = Format::F32;
            for stored in [[f32_, f32_], [f32_, coded], [coded, f32_]] {
                for store in [Store::Plain, Store::Held, Store::BiasAdd { coded: false }] {
                    let k = Kernel::Matmul(v.reading(stored).with_store(store));
                    if !kernels.contains(&k) {
                        kernels.push(k);
                    }
                }
            }
        }
        // Fused bias adds (epilogue.wgsl): SIMT f32, bf16 and f16 both ways, the cooperative f16
        // and bf16 kernels on both tile sizes, and the masked fallback of the scaled one.
        for f16 in [F16Read::Native, F16Read::Packed] {
            for alg in [Algorithm::F32, Algorithm::Bf16, Algorithm::F16] {
                let v = MatmulVariant::for_algorithm(&alg, f16);
                for v in [
                    v.with_store(Store::BiasAdd { coded: false }),
                    // Into a 16-bit coded output (a q|k|v projection or pre-GELU activations).
                    v.with_store(Store::BiasAdd { coded: true }),
                    // A weight gradient's product with its bias gradient, held or not.
                    v.reading([Format::F32; 2]).with_column_sums(true),
                    (v.reading([Format::F32; 2]))
                        .with_store(Store::Held)
                        .with_column_sums(true),
                ] {
                    if !kernels.contains(&Kernel::Matmul(v)) {
                        kernels.push(Kernel::Matmul(v));
                    }
                }
            }
        }
        for c in [
            Coop {
                size: 8,
                subgroup: 8,
            },
            Coop {
                size: 16,
                subgroup: 32,
            },
        ] {
            for alg in [Algorithm::F16, Algorithm::Bf16] {
                if let Some(v) = MatmulVariant::coop(&alg, c) {
                    for store in [
                        Store::Held,
                        Store::BiasAdd { coded: false },
                        Store::BiasAdd { coded: true },
                    ] {
                        kernels.push(Kernel::Matmul(v.with_store(store)));
                        if v.scaled() {
                            kernels.push(Kernel::Matmul(v.fallback().with_store(store)));
                        }
                    }
                }
            }
            for op in TrainOp::ALL.into_iter().filter(|op| op.is_attention()) {
                kernels.push(Kernel::AttentionCoop(op, c));
            }
        }
        // Cooperative variants for lavapipe's (and Apple's) 8x8 and NVIDIA's 16x16 tiles, and
        // their fallbacks.
        for alg in Algorithm::ALL {
            for c in [
                Coop {
                    size: 8,
                    subgroup: 8,
                },
                Coop {
                    size: 16,
                    subgroup: 32,
                },
            ] {
                if let Some(v) = MatmulVariant::coop(&alg, c) {
                    kernels.push(Kernel::Matmul(v));
                    if v.scaled() && !kernels.contains(&Kernel::Matmul(v.fallback())) {
                        kernels.push(Kernel::Matmul(v.fallback()));
                    }
                }
            }
        }
        for f16 in [F16Read::Native, F16Read::Packed] {
            for alg in Algorithm::ALL {
                for scaling in [
                    crate::algorithm::Scaling::Tensorwise,
                    crate::algorithm::Scaling::Rowwise,
                ] {
                    let v = MatmulVariant::for_algorithm(&alg.with_scaling(scaling), f16);
                    // Quad loads where the operands hold one element per word.
                    let quads = matches!(v.a, Operand::F32 | Operand::Tf32);
                    let all = Load::ALL;
                    let loads: Vec<[Load; 2]> = if quads {
                        all.iter().flat_map(|&a| all.map(|b| [a, b])).collect()
                    } else {
                        vec![[Load::Scalar; 2]]
                    };
                    for unrolled in [false, true] {
                        for &l in &loads {
                            let k = Kernel::Matmul(v.with_unrolled(unrolled).with_loads(l));
                            if !kernels.contains(&k) {
                                kernels.push(k);
                            }
                        }
                    }
                }
            }
        }
        kernels
    }
}

/// The length of K over which a matmul kernel sums each output in registers from zero: K is
/// summed in groups of this many terms, and the groups' sums are added in order, (((g0 + g1) +
/// g2) + ...), in f32 (docs/design.md, "Summation order"). Spans of K that the loop budget
/// splits off, and the splits of a split-K product, start at group boundaries, so neither
/// changes a bit: tiles and splits change speed alone.
pub const GROUP_K: u32 = 1024;

/// The span flags of a kernel whose long loop the loop budget may split over dispatches
/// (budget.rs): the dispatch's span is the first (its sums start at zero, else from the
/// partial sums the previous span left) and the last (the sums are finished, else left for the
/// next span). One span, both flags, where the budget does not split the loop.
pub const SPAN_FIRST: u32 = 1;
/// The span is the last: its sums are finished.
pub const SPAN_LAST: u32 = 2;

/// `params.span` of span `i` of `count`.
pub fn span_flags(i: usize, count: usize) -> u32 {
    let first = if i == 0 { SPAN_FIRST } else { 0 };
    let last = if i + 1 == count { SPAN_LAST } else { 0 };
    first | last
}

/// A matmul variant's EPILOGUE constant and `epilogue` (what `Store` says): the product as it
/// is, the product held (`params.epi.z`), or the bias add's first binding (epilogue.wgsl
/// follows); C's element type, and `store_codes` where epilogue.wgsl does not bring it.
fn epilogue_consts(v: &MatmulVariant) -> String {
    let epilogue = match v.store {
        Store::Plain => {
            "const EPILOGUE: bool = false;\nfn epilogue(e: u32, col: u32, v: f32) -> f32 {\n    \
                         return v;\n}\n"
                .into()
        }
        Store::Held => {
            "const EPILOGUE: bool = true;\nfn epilogue(e: u32, col: u32, v: f32) -> f32 {\n    \
                        return held(v, params.epi.z);\n}\n"
                .into()
        }
        Store::BiasAdd { .. } => format!(
            "const EPILOGUE: bool = true;\nconst EPI_BINDING: u32 = {}u;\n",
            v.epilogue_binding()
        ),
    };
    let codes = if v.store.adds_bias() {
        ""
    } else {
        "fn store_codes(e: u32, col: u32, v: vec2<f32>, mine: vec2<bool>) {}\n"
    };
    let c_type = if v.store.coded() { "u32" } else { "f32" };
    format!(
        "{epilogue}const CODED: bool = {};\nalias C_T = {c_type};\n{codes}",
        v.store.coded()
    )
}

/// A SIMT matmul variant's COLUMN_SUMS constant, and where it sums B's columns their binding
/// and its accessors; else accessors that are never called.
fn column_sums_consts(v: &MatmulVariant) -> String {
    if v.column_sums {
        format!(
            "const COLUMN_SUMS: bool = true;\n\
             @group(0) @binding({}) var<storage, read_write> column_sums: array<f32>;\n\
             fn column_total(col: u32) -> f32 {{\n    return column_sums[col];\n}}\n\
             fn set_column_total(col: u32, v: f32) {{\n    column_sums[col] = v;\n}}\n",
            v.column_sums_binding()
        )
    } else {
        "const COLUMN_SUMS: bool = false;\nfn column_total(col: u32) -> f32 {\n    return 0.0;\n}\n\
         fn set_column_total(col: u32, v: f32) {}\n"
            .into()
    }
}

/// The span flags as the kernels' headers declare them.
fn span_consts() -> String {
    format!("const SPAN_FIRST: u32 = {SPAN_FIRST}u;\nconst SPAN_LAST: u32 = {SPAN_LAST}u;\n")
}

/// The split levels as products of planes (0 = h, 1 = m, 2 = l): `levels` (0: no split, L0
/// only; 2, 3 or 5) of `algorithm::SPLIT_LEVELS`.
fn level_terms(levels: u32) -> &'static [&'static [(usize, usize)]] {
    &SPLIT_LEVELS[..(levels.max(1) as usize)]
}

/// matmul_step.wgsl's pieces written out for a SIMT variant: its accumulators (a vec4 per
/// level, 4x4 block and row), `k_step_0` (and `k_step_1` with two buffers: every product of
/// every level at each k of the K step in that buffer, written once per k where the variant is
/// unrolled, else in a loop over k), `k_loop` (the K steps, with their loads and barriers) and
/// `store_tiles`.
fn k_step(src: Sources, v: &MatmulVariant) -> String {
    use template::{fill, piece};
    let put = |out: &mut String, name: &str, vars: &[(&str, &str)]| {
        out.push_str(&fill(piece(src.text("matmul_step.wgsl"), name), vars));
    };
    let n = |x: u32| x.to_string();
    let levels = level_terms(v.levels);
    let tile = v.tile;
    // The 4x4 blocks as (block row, block column); REG 8 only on single-level variants.
    let blocks: &[(&str, &str)] = if tile.reg == 8 {
        &[("ty", "tx"), ("ty", "tx2"), ("ty2", "tx"), ("ty2", "tx2")]
    } else {
        &[("ty", "tx")]
    };
    let each_accumulator = || {
        (0..levels.len() as u32)
            .flat_map(move |l| (0..blocks.len() as u32).map(move |q| (l, q)))
            .flat_map(|(l, q)| (0..4u32).map(move |r| (l, q, r)))
    };
    let mut f = String::new();
    for (l, q, r) in each_accumulator() {
        put(
            &mut f,
            "accumulator",
            &[("l", &n(l)), ("q", &n(q)), ("r", &n(r))],
        );
    }
    put(&mut f, "zero_begin", &[]);
    for (l, q, r) in each_accumulator() {
        put(&mut f, "zero", &[("l", &n(l)), ("q", &n(q)), ("r", &n(r))]);
    }
    put(&mut f, "end", &[]);
    // A step function per workgroup buffer; buffer s starts at s * PARTS * BK.
    for s in 0..tile.buffers {
        let base = s * v.parts * tile.bk;
        put(&mut f, "step_begin", &[("s", &n(s))]);
        // (the index of k in the buffer, the suffix of its values): constants when unrolled,
        // else the loop's.
        let ks: Vec<(String, String)> = if v.unrolled {
            (0..tile.bk)
                .map(|kk| (format!("{}u", base + kk), n(kk)))
                .collect()
        } else {
            put(&mut f, "k_loop", &[]);
            let at = if base == 0 {
                "kk".into()
            } else {
                format!("{base}u + kk")
            };
            vec![(at, "k".into())]
        };
        for (k, kk) in &ks {
            let at: [(&str, &str); 2] = [("k", k), ("kk", kk)];
            put(&mut f, "k_begin", &at);
            if blocks.len() > 1 {
                put(&mut f, "k_wide", &at);
            }
            if levels.len() > 1 {
                put(&mut f, "k_split", &at);
                for p in 1..v.parts {
                    put(&mut f, "k_plane", &[("p", &n(p)), ("k", k), ("kk", kk)]);
                }
            }
            // L0 multiplies h as loaded (inf and NaN included), in every block.
            for (q, (row, col)) in blocks.iter().enumerate() {
                let a = format!("{}_{kk}", if *row == "ty" { "ah" } else { "ah2" });
                let b = format!("{}_{kk}", if *col == "tx" { "bh" } else { "bh2" });
                put(
                    &mut f,
                    "product",
                    &[("l", "0"), ("q", &n(q as u32)), ("a", &a), ("b", &b)],
                );
            }
            for (l, terms) in levels.iter().enumerate().skip(1) {
                for (pa, pb) in terms.iter() {
                    let (a, b) = (format!("a{pa}_{kk}"), format!("b{pb}_{kk}"));
                    put(
                        &mut f,
                        "product",
                        &[("l", &n(l as u32)), ("q", "0"), ("a", &a), ("b", &b)],
                    );
                }
            }
        }
        if !v.unrolled {
            put(&mut f, "k_loop_end", &[]);
        }
        put(&mut f, "step_end", &[]);
    }
    put(
        &mut f,
        if tile.buffers == 2 {
            "loop_double"
        } else {
            "loop_single"
        },
        &[],
    );
    put(&mut f, "store_begin", &[]);
    for (q, (row, col)) in blocks.iter().enumerate() {
        for r in 0..4u32 {
            let acc = |l: usize| format!("acc_{l}_{q}_{r}");
            let mut sum = acc(levels.len() - 1);
            for l in (0..levels.len() - 1).rev() {
                sum = format!("({sum} + {})", acc(l));
            }
            put(
                &mut f,
                "store",
                &[("row", row), ("col", col), ("r", &n(r)), ("sum", &sum)],
            );
        }
    }
    put(&mut f, "end", &[]);
    // Between groups of K: every accumulator added to and stored as the running totals, into
    // its group's plane, or (split-K's reduction) the planes' sums in group order.
    let each = |f: &mut String, piece: &str| {
        for (l, q, r) in each_accumulator() {
            let (row, col) = blocks[q as usize];
            let vars = [
                ("l", &*n(l)),
                ("q", &n(q)),
                ("r", &n(r)),
                ("row", row),
                ("col", col),
            ];
            put(f, piece, &vars);
        }
    };
    for (begin, piece) in [
        ("add_totals_begin", "add_total"),
        ("store_totals_begin", "store_total"),
        ("store_plane_begin", "store_plane"),
    ] {
        put(&mut f, begin, &[]);
        each(&mut f, piece);
        put(&mut f, "end", &[]);
    }
    put(&mut f, "load_planes_begin", &[]);
    each(&mut f, "load_plane_first");
    put(&mut f, "load_planes_loop", &[]);
    each(&mut f, "load_plane_add");
    put(&mut f, "load_planes_loop_end", &[]);
    put(&mut f, "end", &[]);
    f
}

/// Partial sums on cooperative matrices are promoted into f32 totals every this many of K.
pub const COOP_PROMOTE_K: u32 = 256;

/// Operand planes a cooperative variant reads: those its split levels' products name.
fn coop_planes(v: &MatmulVariant) -> u32 {
    level_terms(v.levels)
        .iter()
        .flat_map(|l| l.iter().map(|&(a, b)| a.max(b)))
        .max()
        .unwrap_or(0) as u32
        + 1
}

/// The octets (eight halves, one 16-byte load) of one plane of A and of B each invocation of a
/// staged cooperative block moves per K step.
fn coop_slots(v: &MatmulVariant) -> (u32, u32) {
    let group = v.coop.map_or(1, |c| c.subgroup) * v.tile.warps;
    let octets = |lines: u32| (lines * v.tile.bk / 8).div_ceil(group);
    (octets(v.tile.bm), octets(v.tile.bn))
}

/// `fn coop_block(batch, row0, col0, lindex)` of a cooperative variant: coop_block.wgsl's pieces written
/// out over its levels, tiles and planes (one named accumulator each: WGSL has no arrays of
/// cooperative matrices to index).
fn coop_block(src: Sources, v: &MatmulVariant) -> String {
    use template::{fill, piece};
    let t = v.coop.map_or(16, |c| c.size);
    let staged = v.tile.warps > 1;
    let (wr, wc) = v.tile.coop_warp_grid(t).unwrap_or((1, 1));
    // Tiles per subgroup, a side.
    let (tm, tn) = (v.tile.bm / t / wr, v.tile.bn / t / wc);
    let mat = format!("coop_mat{t}x{t}");
    let levels = level_terms(v.levels);
    let planes = coop_planes(v);
    let tiles = || (0..tm).flat_map(move |r| (0..tn).map(move |c| (r, c)));
    let n = |x: u32| x.to_string();
    let (t_s, planes_s, promote) = (n(t), planes.to_string(), n(COOP_PROMOTE_K));
    let zero = format!("{mat}<f32, C>()");
    let levels_s = n(levels.len() as u32);
    let shared: [(&str, &str); 6] = [
        ("t", &t_s),
        ("mat", &mat),
        ("zero", &zero),
        ("planes", &planes_s),
        ("promote", &promote),
        ("levels", &levels_s),
    ];
    let put = |out: &mut String, name: &str, vars: &[(&str, &str)]| {
        let all: Vec<(&str, &str)> = shared.iter().chain(vars).copied().collect();
        out.push_str(&fill(piece(src.text("coop_block.wgsl"), name), &all));
    };
    // Each accumulator piece once per level and tile.
    let per_tile = |out: &mut String, name: &str| {
        for l in 0..levels.len() {
            for (r, c) in tiles() {
                put(
                    out,
                    name,
                    &[("l", &n(l as u32)), ("r", &n(r)), ("c", &n(c))],
                );
            }
        }
    };
    let mut f = String::new();
    if staged {
        let bk = v.tile.bk;
        let (sa, sb) = (n(bk + 8), n(v.tile.bn + 8));
        let a_len = n(planes * v.tile.bm * (bk + 8));
        let b_len = n(planes * bk * (v.tile.bn + 8));
        let stages = n(v.tile.buffers);
        let (slots_a, slots_b) = coop_slots(v);
        let (slots_a, slots_b) = (n(slots_a), n(slots_b));
        let vars = [
            ("sa", &*sa),
            ("sb", &sb),
            ("a_len", &a_len),
            ("b_len", &b_len),
            ("stages", &stages),
            ("slots_a", &slots_a),
            ("slots_b", &slots_b),
        ];
        put(&mut f, "stage_memory", &vars);
    }
    put(&mut f, "begin", &[]);
    if staged {
        let (wc, tm, tn) = (n(wc), n(tm), n(tn));
        put(
            &mut f,
            "origin_staged",
            &[("wc", &wc), ("tm", &tm), ("tn", &tn)],
        );
        if v.tile.buffers == 2 || v.tile.prefetch {
            put(&mut f, "stage_first", &[]);
        }
    } else {
        put(&mut f, "origin_single", &[]);
    }
    per_tile(&mut f, "total");
    put(&mut f, "totals_init_begin", &[]);
    per_tile(&mut f, "totals_init");
    put(&mut f, "groups_begin", &[]);
    per_tile(&mut f, "group_zero");
    put(&mut f, "promote_loop", &[]);
    per_tile(&mut f, "part");
    put(&mut f, "k_loop", &[]);
    if staged && v.tile.prefetch {
        let cur = if v.tile.buffers == 2 {
            "(k0 / BK) % 2u"
        } else {
            "0u"
        };
        put(&mut f, "prefetch_load", &[("cur", cur)]);
    } else if staged {
        let copy = if v.tile.buffers == 2 {
            "stage_next"
        } else {
            "stage_copy"
        };
        put(&mut f, copy, &[]);
    }
    // The K step in sub-steps of one tile (a staged K step may hold two), each in its own
    // block, since fragments are named values.
    for sub in 0..(v.tile.bk / t).max(1) {
        let sub = n(sub);
        put(&mut f, "sub_begin", &[]);
        for p in 0..planes {
            for r in 0..tm {
                let (p, row, r) = (n(p), n(t * r), n(r));
                let vars = [("p", &*p), ("r", &r), ("row", &row), ("s", &sub)];
                put(
                    &mut f,
                    if staged { "load_a_staged" } else { "load_a" },
                    &vars,
                );
            }
            for c in 0..tn {
                let (p, col, c) = (n(p), n(t * c), n(c));
                let vars = [("p", &*p), ("c", &c), ("col", &col), ("s", &sub)];
                put(
                    &mut f,
                    if staged { "load_b_staged" } else { "load_b" },
                    &vars,
                );
            }
        }
        for (l, terms) in levels.iter().enumerate() {
            for (r, c) in tiles() {
                for &(pa, pb) in terms.iter() {
                    let (l, r, c) = (n(l as u32), n(r), n(c));
                    let (pa, pb) = (pa.to_string(), pb.to_string());
                    let vars = [("l", &*l), ("r", &r), ("c", &c), ("pa", &pa), ("pb", &pb)];
                    put(&mut f, "product", &vars);
                }
            }
        }
        put(&mut f, "sub_end", &[]);
    }
    if staged {
        let release = match (v.tile.prefetch, v.tile.buffers) {
            (false, _) => "stage_release",
            (true, 2) => "prefetch_store_double",
            (true, _) => "prefetch_store_single",
        };
        put(&mut f, release, &[]);
    }
    put(&mut f, "k_loop_end", &[]);
    per_tile(&mut f, "promote");
    put(&mut f, "promote_loop_end", &[]);
    put(&mut f, "group_end", &[]);
    per_tile(&mut f, "plane_store");
    put(&mut f, "totals_add_begin", &[]);
    per_tile(&mut f, "total_add");
    put(&mut f, "groups_end", &[]);
    put(&mut f, "reduce_begin", &[]);
    per_tile(&mut f, "reduce_first");
    put(&mut f, "reduce_loop", &[]);
    per_tile(&mut f, "reduce_add");
    put(&mut f, "reduce_end", &[]);
    for (r, c) in tiles() {
        // Smallest level first. Scaled planes carry 2^(8p) more than plane 0 (coop_pack.wgsl),
        // so level l's terms all carry 2^(8l): undone exactly before the sum.
        let level = |l: usize| {
            if v.scaled() && l > 0 {
                format!("(total_{l}_{r}_{c} * 0x1p-{}f)", 8 * l)
            } else {
                format!("total_{l}_{r}_{c}")
            }
        };
        let mut sum = level(levels.len() - 1);
        for l in (0..levels.len() - 1).rev() {
            sum = format!("({sum} + {})", level(l));
        }
        let vars = [("r", &*n(r)), ("c", &n(c)), ("sum", &sum)];
        put(&mut f, "store", &vars);
        // Codes go through `staging` and `store_tile`, two to a word.
        if !v.store.coded() {
            put(&mut f, "store_straight", &vars);
        }
        put(&mut f, "store_staged", &vars);
    }
    put(&mut f, "end", &[]);
    f
}

/// Kernel templates: a `.wgsl` file of pieces, each headed `// @@name`, with `{{key}}` where
/// the loader puts a value (the text before the first piece is the file's commentary).
mod template {
    /// The piece `name` of `file` (empty where there is none: naga then rejects the kernel,
    /// and `tests/shaders.rs` names it).
    pub fn piece<'a>(file: &'a str, name: &str) -> &'a str {
        let head = format!("// @@{name}\n");
        let Some(start) = file.find(&head).map(|i| i + head.len()) else {
            return "";
        };
        let end = file[start..]
            .find("// @@")
            .map_or(file.len(), |i| start + i);
        &file[start..end]
    }

    /// `text` with every `{{key}}` replaced by its value.
    pub fn fill(text: &str, vars: &[(&str, &str)]) -> String {
        let mut out = text.to_string();
        for (key, value) in vars {
            out = out.replace(&format!("{{{{{key}}}}}"), value);
        }
        out
    }
}

/// Parses and validates a kernel's WGSL with naga, and writes SPIR-V from it (the path wgpu
/// takes on Vulkan), returning the first error with its location.
pub fn validate(kernel: &Kernel) -> Result<(), String> {
    spirv(kernel, true).map(|_| ())
}

/// As `validate`, for the kernel's source from `src`; the error's locations name the file and
/// its line ("matmul.wgsl:120:5") where the line is one of a file's.
pub fn validate_in(kernel: &Kernel, src: Sources) -> Result<(), String> {
    spirv_of(&kernel.source_in(src), true)
        .map(|_| ())
        .map_err(|log| {
            // naga names the module "wgsl": `wgsl:LINE:COLUMN`.
            let mut out = String::new();
            let mut rest = log.as_str();
            while let Some(at) = rest.find("wgsl:") {
                out.push_str(&rest[..at]);
                let after = &rest[at + 5..];
                let digits = after.bytes().take_while(u8::is_ascii_digit).count();
                match after[..digits].parse::<usize>() {
                    Ok(line) => out.push_str(&kernel.source_line(src, line)),
                    Err(_) => out.push_str("wgsl:"),
                }
                rest = &after[digits..];
            }
            out.push_str(rest);
            // The excerpt's gutter numbers the composed source's lines: left blank, the
            // location above says where the line is.
            out.lines()
                .map(|l| {
                    let digits = l.trim_start();
                    let n = digits.bytes().take_while(u8::is_ascii_digit).count();
                    if n > 0 && digits[n..].starts_with(" │") {
                        format!("{}{}", " ".repeat(l.len() - digits.len() + n), &digits[n..])
                    } else {
                        l.to_string()
                    }
                })
                .collect::<Vec<_>>()
                .join("\n")
        })
}

/// The SPIR-V wgpu's Vulkan backend writes for `kernel`, with its runtime checks (`checked`:
/// every index that is not a constant clamped, a counter on every loop, as on a device without
/// robust buffer access) or without (a trusted module).
pub fn spirv(kernel: &Kernel, checked: bool) -> Result<Vec<u32>, String> {
    spirv_of(&kernel.source(), checked)
}

/// The WGSL `source` parsed and validated with `capabilities`, or the first error with its
/// location.
fn module_of(
    source: &str,
    capabilities: naga::valid::Capabilities,
) -> Result<(naga::Module, naga::valid::ModuleInfo), String> {
    let module = naga::front::wgsl::parse_str(source).map_err(|e| e.emit_to_string(source))?;
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), capabilities)
        .validate(&module)
        .map_err(|e| e.emit_to_string(source))?;
    Ok((module, info))
}

/// wgpu's bounds-check policies for a module with its runtime checks (`checked`) or without.
fn bounds_checks(checked: bool) -> naga::proc::BoundsCheckPolicies {
    use naga::proc::{BoundsCheckPolicies, BoundsCheckPolicy};
    let policy = if checked {
        BoundsCheckPolicy::Restrict
    } else {
        BoundsCheckPolicy::Unchecked
    };
    BoundsCheckPolicies {
        index: policy,
        buffer: policy,
        image_load: policy,
        binding_array: BoundsCheckPolicy::Unchecked,
    }
}

/// The SPIR-V of the WGSL `source` (as `spirv`).
fn spirv_of(source: &str, checked: bool) -> Result<Vec<u32>, String> {
    let (module, info) = module_of(source, naga::valid::Capabilities::all())?;
    let options = naga::back::spv::Options {
        bounds_check_policies: bounds_checks(checked),
        force_loop_bounding: checked,
        // Names on functions, so that tests can find them in the module.
        flags: naga::back::spv::WriterFlags::DEBUG | naga::back::spv::Options::default().flags,
        ..Default::default()
    };
    naga::back::spv::write_vec(&module, &info, &options, None)
        .map_err(|e| format!("SPIR-V generation failed: {e}"))
}

/// A shading language wgpu translates kernels into on a back end other than Vulkan's SPIR-V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// Metal Shading Language: wgpu's Metal back end (macOS, iOS).
    Msl,
    /// HLSL, compiled by DXC: wgpu's DX12 back end (Windows).
    Hlsl,
}

impl Target {
    /// The MSL version or HLSL shader model `kernel` is translated at: the lowest wgpu's back
    /// end runs it at, where naga refuses most (it refuses by version, never the other way).
    /// wgpu-hal picks the newest version the OS or DXC offers (`metal/adapter.rs`,
    /// `dx12/adapter.rs`). Metal: cooperative matrices from MSL 2.3 (wgpu offers them from
    /// there), else 1.2 (macOS 10.12 and iOS 10, Rust's oldest Apple targets). DX12: shader
    /// model 6.0 (wgpu exposes no adapter below it), 6.2 where the kernel reads f16 (wgpu's
    /// condition for SHADER_F16).
    pub fn version(self, kernel: &Kernel) -> String {
        match self {
            Target::Msl => {
                let (major, minor) = msl_version(kernel);
                format!("MSL {major}.{minor}")
            }
            Target::Hlsl => format!(
                "shader model {}",
                shader_model(kernel).to_str().replace('_', ".")
            ),
        }
    }
}

/// The MSL version `kernel` is translated at (`Target::version`).
fn msl_version(kernel: &Kernel) -> (u8, u8) {
    if kernel.uses_coop() { (2, 3) } else { (1, 2) }
}

/// The HLSL shader model `kernel` is translated at (`Target::version`).
fn shader_model(kernel: &Kernel) -> naga::back::hlsl::ShaderModel {
    if kernel.needs_f16() {
        naga::back::hlsl::ShaderModel::V6_2
    } else {
        naga::back::hlsl::ShaderModel::V6_0
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Target::Msl => "MSL",
            Target::Hlsl => "HLSL",
        })
    }
}

/// The source wgpu's Metal or DX12 back end hands its driver for `kernel` (`target`), with its
/// runtime checks (`checked`) or without (a trusted module), as `spirv` for Vulkan: the options
/// are wgpu-hal 30's for a compute pipeline (`metal/device.rs` `load_shader`, `dx12/device.rs`
/// `load_shader` and `create_pipeline_layout`): the module validated against what naga's
/// writer for `target` supports (so a kernel it cannot write, as cooperative matrices in
/// HLSL, is an error, with its location where naga has one, rather than a panic in the
/// writer), specialised to the entry point,
/// the kernel's bindings (`bindings`) mapped to Metal buffer slots or to DX12
/// registers as wgpu lays them out, at `Target::version`. What the drivers' compilers would
/// refuse is not checked here.
pub fn translate(kernel: &Kernel, target: Target, checked: bool) -> Result<String, String> {
    let source = kernel.source();
    let capabilities = match target {
        Target::Msl => naga::back::msl::supported_capabilities(),
        Target::Hlsl => naga::back::hlsl::supported_capabilities(),
    };
    let (module, info) = module_of(&source, capabilities).map_err(|e| {
        // Valid WGSL that names what the target's language lacks (its error may carry no
        // source span: say which language).
        match module_of(&source, naga::valid::Capabilities::all()) {
            Ok(_) => format!("naga cannot write this kernel in {target}:\n{e}"),
            Err(_) => e,
        }
    })?;
    let entry = kernel.entry_point();
    let stage = naga::ShaderStage::Compute;
    // wgpu keeps the one entry point (and what it uses) of a module of several.
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        &module,
        &info,
        Some((stage, entry)),
        &naga::back::PipelineConstants::default(),
    )
    .map_err(|e| format!("{target}: specialising {entry}: {e}"))?;
    let bindings = bindings(kernel);
    let at = |binding: usize| naga::ResourceBinding {
        group: 0,
        binding: binding as u32,
    };
    let failed = |e: &dyn fmt::Display| {
        format!(
            "{target} ({}) generation failed for {entry}: {e}",
            target.version(kernel)
        )
    };
    match target {
        Target::Msl => {
            use naga::back::msl;
            // One buffer slot per binding in order, then the slot of the runtime arrays'
            // sizes (wgpu sets it aside where a layout holds a storage buffer).
            let mut resources = msl::BindingMap::default();
            for (i, b) in bindings.iter().enumerate() {
                let target = msl::BindTarget {
                    buffer: Some(i as msl::Slot),
                    mutable: matches!(b, Binding::ReadWrite),
                    ..Default::default()
                };
                resources.insert(at(i), target);
            }
            let storage = bindings.iter().any(|b| !matches!(b, Binding::Uniform));
            let resources = msl::EntryPointResources {
                resources,
                immediates_buffer: None,
                sizes_buffer: storage.then_some(bindings.len() as msl::Slot),
            };
            let options = msl::Options {
                lang_version: msl_version(kernel),
                per_entry_point_map: [(entry.to_string(), resources)].into(),
                inline_samplers: Vec::new(),
                spirv_cross_compatibility: false,
                fake_missing_bindings: false,
                bounds_check_policies: bounds_checks(checked),
                // The pipelines ask for none (device.rs: every kernel writes workgroup memory
                // before reading it).
                zero_initialize_workgroup_memory: false,
                force_loop_bounding: checked,
                // Task shaders' only: nothing here.
                task_dispatch_limits: None,
                mesh_shader_primitive_indices_clamp: checked,
                emit_int_div_checks: checked,
                ray_query_initialization_tracking: checked,
            };
            let pipeline = msl::PipelineOptions {
                entry_point: Some((stage, entry.to_string())),
                allow_and_force_point_size: false,
                vertex_pulling_transform: true,
                vertex_buffer_mappings: Vec::new(),
                binding_array_length_map: Default::default(),
            };
            let (text, translated) =
                msl::write_string(&module, &info, &options, &pipeline).map_err(|e| failed(&e))?;
            match translated.entry_point_names.first() {
                Some(Ok(_)) => Ok(text),
                Some(Err(e)) => Err(failed(e)),
                None => Err(failed(&"no entry point written")),
            }
        }
        Target::Hlsl => {
            use naga::back::hlsl;
            // Registers by kind in binding order, space 0: uniforms b#, read-only storage t#,
            // read-write storage u#; then the special constants (num_workgroups), which wgpu
            // places after the group's uniforms in every pipeline layout.
            let mut binding_map = hlsl::BindingMap::default();
            let mut next = [0u32; 3];
            for (i, b) in bindings.iter().enumerate() {
                let kind = match b {
                    Binding::Uniform => 0,
                    Binding::Read => 1,
                    Binding::ReadWrite => 2,
                };
                let register = next[kind];
                next[kind] += 1;
                binding_map.insert(
                    at(i),
                    hlsl::BindTarget {
                        register,
                        ..Default::default()
                    },
                );
            }
            let options = hlsl::Options {
                shader_model: shader_model(kernel),
                binding_map,
                fake_missing_bindings: false,
                special_constants_binding: Some(hlsl::BindTarget {
                    register: next[0],
                    ..Default::default()
                }),
                zero_initialize_workgroup_memory: false,
                restrict_indexing: checked,
                force_loop_bounding: checked,
                // Task shaders' only: nothing here.
                task_dispatch_limits: None,
                mesh_shader_primitive_indices_clamp: checked,
                ray_query_initialization_tracking: checked,
                ..Default::default()
            };
            let pipeline = hlsl::PipelineOptions {
                entry_point: Some((stage, entry.to_string())),
            };
            let mut text = String::new();
            let reflection = hlsl::Writer::new(&mut text, &options, &pipeline)
                .write(&module, &info, None)
                .map_err(|e| failed(&e))?;
            match reflection.entry_point_names.first() {
                Some(Ok(_)) => Ok(text),
                Some(Err(e)) => Err(failed(e)),
                None => Err(failed(&"no entry point written")),
            }
        }
    }
}
/// The members (name, byte offset; padding, named `pad*` or `_pad*`, left out) and the size of
/// struct `name` as naga lays it out in the first kernel built from `file`: what a uniform
/// struct written on the Rust side must match (`assert_uniform_layout`).
#[cfg(test)]
pub(super) fn wgsl_struct(file: &str, name: &str) -> (Vec<(String, u32)>, u32) {
    let kernel = Kernel::all()
        .into_iter()
        .find(|k| k.files().contains(&file))
        .unwrap_or_else(|| panic!("no kernel is built from {file}"));
    let source = kernel.source();
    let module = naga::front::wgsl::parse_str(&source).expect("the built-in kernels parse");
    let found = module.types.iter().find_map(|(_, ty)| match &ty.inner {
        naga::TypeInner::Struct { members, span } if ty.name.as_deref() == Some(name) => {
            Some((members.clone(), *span))
        }
        _ => None,
    });
    let (members, span) = found.unwrap_or_else(|| panic!("no struct {name} in {file}"));
    let named = members
        .into_iter()
        .filter_map(|m| {
            let n = m.name?;
            (!n.trim_start_matches('_').starts_with("pad")).then_some((n, m.offset))
        })
        .collect();
    (named, span)
}

/// Asserts that the Rust struct `$ty` (a kernel's uniform) has the named members of the WGSL
/// struct of the same name in `$file`, at the same byte offsets, and its size: the two are
/// written by hand on both sides, and a member added, moved or renamed on one side alone would
/// hand the kernel other numbers without any error.
#[cfg(test)]
macro_rules! assert_uniform_layout {
    ($file:literal, $ty:ident { $($field:ident),* $(,)? }) => {{
        let (wgsl, size) = $crate::backend::wgpu::shaders::wgsl_struct($file, stringify!($ty));
        let rust: Vec<(String, u32)> = vec![$(
            (stringify!($field).to_string(), std::mem::offset_of!($ty, $field) as u32)
        ),*];
        assert_eq!(rust, wgsl, "{} in Rust and in {}", stringify!($ty), $file);
        assert_eq!(std::mem::size_of::<$ty>(), size as usize, "{}'s size", stringify!($ty));
    }};
}
#[cfg(test)]
pub(super) use assert_uniform_layout;

/// Bindings of a kernel family, in binding order.
#[derive(Clone, Copy)]
pub(crate) enum Binding {
    Uniform,
    Read,
    ReadWrite,
}

pub(crate) fn bindings(kernel: &Kernel) -> &'static [Binding] {
    use Binding::*;
    match kernel {
        Kernel::Encode | Kernel::Decode | Kernel::Quantize => &[Uniform, Read, ReadWrite, Read],
        Kernel::Amax | Kernel::ScaleFromAmax => &[Uniform, Read, ReadWrite, ReadWrite, Read],
        Kernel::SplitBf16 => &[Uniform, Read, ReadWrite],
        Kernel::CoopPack => &[Uniform, Read, ReadWrite, Read, ReadWrite, Read, ReadWrite],
        // a, b, c, scales (SIMT) or amax_bits (cooperative), the partial sums between spans of
        // K, and flags (cooperative, SIMT fallback).
        // ... and with a fused bias add (epilogue.wgsl), its bias, residual and GELU.
        Kernel::Matmul(v) if (v.coop.is_some() || v.masked) && v.store.adds_bias() => &[
            Uniform, Read, Read, ReadWrite, Read, ReadWrite, Read, Read, Read, ReadWrite,
        ],
        Kernel::Matmul(v) if v.coop.is_some() || v.masked => {
            &[Uniform, Read, Read, ReadWrite, Read, ReadWrite, Read]
        }
        Kernel::Matmul(v) if v.store.adds_bias() && v.column_sums => &[
            Uniform, Read, Read, ReadWrite, Read, ReadWrite, Read, Read, ReadWrite, ReadWrite,
        ],
        Kernel::Matmul(v) if v.store.adds_bias() => &[
            Uniform, Read, Read, ReadWrite, Read, ReadWrite, Read, Read, ReadWrite,
        ],
        // ... and with B's column sums.
        Kernel::Matmul(v) if v.column_sums => {
            &[Uniform, Read, Read, ReadWrite, Read, ReadWrite, ReadWrite]
        }
        Kernel::Matmul(_) => &[Uniform, Read, Read, ReadWrite, Read, ReadWrite],
        // in0..2, out0..2; the norms' backward, its column partials too (out3).
        Kernel::Train(op, _) if op.has_column_partials() => &[
            Uniform, Read, Read, Read, ReadWrite, ReadWrite, ReadWrite, ReadWrite,
        ],
        Kernel::Train(..) | Kernel::AttentionCoop(..) => {
            &[Uniform, Read, Read, Read, ReadWrite, ReadWrite, ReadWrite]
        }
        // scalars, stats, x, y, z, w.
        Kernel::Step(_) => &[
            Uniform, Read, ReadWrite, Read, ReadWrite, ReadWrite, ReadWrite,
        ],
        Kernel::LoopProbe => &[ReadWrite],
    }
}
