//! The WGSL loader: kernel families live in `shaders/*.wgsl`; a kernel's source is a generated
//! header (constants and the operand fetch functions of its variant), the shared
//! `formats.wgsl`, and the family's file. Every variant can be listed, so the test suite
//! validates them all with naga on any machine.

use crate::algorithm::Algorithm;
use crate::format::Format;
use std::fmt;

const FORMATS: &str = include_str!("../../../shaders/formats.wgsl");
const CAST: &str = include_str!("../../../shaders/cast.wgsl");
const SCALE: &str = include_str!("../../../shaders/scale.wgsl");
const SPLIT: &str = include_str!("../../../shaders/split.wgsl");
const MATMUL: &str = include_str!("../../../shaders/matmul.wgsl");
const TRAIN: &str = include_str!("../../../shaders/train.wgsl");

/// The training ops of `shaders/train.wgsl` (entry points of one module).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TrainOp {
    LayernormFwd,
    LayernormBwdX,
    LayernormBwdParams,
    GeluFwd,
    GeluBwd,
    CausalSoftmaxFwd,
    CausalSoftmaxBwd,
    CrossEntropyFwd,
    CrossEntropyBwd,
    Adamw,
    EmbeddingFwd,
    EmbeddingBwd,
    UnscaleCheck,
}

impl TrainOp {
    pub const ALL: [TrainOp; 13] = [
        TrainOp::LayernormFwd,
        TrainOp::LayernormBwdX,
        TrainOp::LayernormBwdParams,
        TrainOp::GeluFwd,
        TrainOp::GeluBwd,
        TrainOp::CausalSoftmaxFwd,
        TrainOp::CausalSoftmaxBwd,
        TrainOp::CrossEntropyFwd,
        TrainOp::CrossEntropyBwd,
        TrainOp::Adamw,
        TrainOp::EmbeddingFwd,
        TrainOp::EmbeddingBwd,
        TrainOp::UnscaleCheck,
    ];

    pub fn entry_point(self) -> &'static str {
        match self {
            TrainOp::LayernormFwd => "layernorm_fwd",
            TrainOp::LayernormBwdX => "layernorm_bwd_x",
            TrainOp::LayernormBwdParams => "layernorm_bwd_params",
            TrainOp::GeluFwd => "gelu_fwd",
            TrainOp::GeluBwd => "gelu_bwd",
            TrainOp::CausalSoftmaxFwd => "causal_softmax_fwd",
            TrainOp::CausalSoftmaxBwd => "causal_softmax_bwd",
            TrainOp::CrossEntropyFwd => "cross_entropy_fwd",
            TrainOp::CrossEntropyBwd => "cross_entropy_bwd",
            TrainOp::Adamw => "adamw",
            TrainOp::EmbeddingFwd => "embedding_fwd",
            TrainOp::EmbeddingBwd => "embedding_bwd",
            TrainOp::UnscaleCheck => "unscale_check",
        }
    }
}

/// How f16 operands are read: as `f16` values (`enable f16;`, needs SHADER_F16) or as packed
/// u32 words decoded in integer arithmetic (core WGSL, works everywhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum F16Read {
    Native,
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
    F16(F16Read),
    /// fp8 codes, four per word.
    Fp8(Format),
}

impl Operand {
    fn element_type(self) -> &'static str {
        match self {
            Operand::F16(F16Read::Native) => "f16",
            _ => "u32",
        }
    }

    /// `fn fetch_X(idx: u32) -> f32`: decodes the stored element with index `idx`.
    fn fetch_fn(self, name: &str, array: &str) -> String {
        let body = match self {
            Operand::F32 => format!("return bitcast<f32>({array}[idx]);"),
            Operand::Tf32 => {
                format!("return bitcast<f32>(encode_format({array}[idx], FMT_TF32, false));")
            }
            Operand::Bf16 => {
                format!(
                    "return bitcast<f32>(unpack_code({array}[idx >> 1u], idx, FMT_BF16) << 16u);"
                )
            }
            Operand::F16(F16Read::Native) => format!("return f32({array}[idx]);"),
            // Decoded in integers, not by unpack2x16float: SwiftShader flushes f16 subnormals
            // there, and the contract says they are values.
            Operand::F16(F16Read::Packed) => format!(
                "return bitcast<f32>(decode_format(unpack_code({array}[idx >> 1u], idx, FMT_F16), FMT_F16));"
            ),
            Operand::Fp8(f) => format!(
                "return bitcast<f32>(decode_format(unpack_code({array}[idx >> 2u], idx, {id}u), {id}u));",
                id = format_id(f)
            ),
        };
        format!("fn {name}(idx: u32) -> f32 {{\n    {body}\n}}\n")
    }

    /// Elements per 32-bit word in storage.
    pub fn per_word(self) -> usize {
        match self {
            Operand::F32 | Operand::Tf32 => 1,
            Operand::Bf16 | Operand::F16(_) => 2,
            Operand::Fp8(_) => 4,
        }
    }
}

/// The id of a format in `formats.wgsl` (its position in `Format::ALL`).
pub fn format_id(format: Format) -> u32 {
    Format::ALL.iter().position(|f| *f == format).unwrap_or(0) as u32
}

/// Workgroup tile of the matmul kernel (each invocation computes 4x4 outputs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Tile {
    pub bm: u32,
    pub bn: u32,
    pub bk: u32,
}

impl Tile {
    /// The tile used without autotuning: 64x64, with a k step that keeps workgroup memory
    /// within WebGPU's 16 KiB default for 1 to 3 planes.
    pub fn default_for(parts: u32) -> Tile {
        Tile {
            bm: 64,
            bn: 64,
            bk: if parts > 1 { 8 } else { 16 },
        }
    }

    /// Invocations per workgroup (4x4 outputs each).
    pub fn threads(self) -> u32 {
        (self.bm / 4) * (self.bn / 4)
    }

    /// Bytes of workgroup memory for operands of `parts` planes.
    pub fn workgroup_bytes(self, parts: u32) -> u32 {
        parts * self.bk * (self.bm + self.bn) * 4
    }

    /// Every tile the autotuner may try for operands of `parts` planes on a device with these
    /// limits, the default first. Each computes bit for bit the same result (every output
    /// element sums its k terms in order whatever the tile), so the choice is speed alone.
    pub fn candidates(parts: u32, max_threads: u32, max_workgroup_bytes: u32) -> Vec<Tile> {
        let mut out = vec![Tile::default_for(parts)];
        for bm in [32, 64, 128] {
            for bn in [32, 64, 128] {
                for bk in [8, 16, 32] {
                    let t = Tile { bm, bn, bk };
                    if t.threads() <= max_threads
                        && t.workgroup_bytes(parts) <= max_workgroup_bytes
                        && !out.contains(&t)
                    {
                        out.push(t);
                    }
                }
            }
        }
        out
    }
}

impl fmt::Display for Tile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}x{}", self.bm, self.bn, self.bk)
    }
}

/// One compiled variant of the matmul kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulVariant {
    pub a: Operand,
    pub b: Operand,
    pub parts: u32,
    pub levels: u32,
    pub fp8: bool,
    pub rowwise: bool,
    pub tile: Tile,
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
        }
    }

    pub fn uses_f16(&self) -> bool {
        matches!(self.a, Operand::F16(F16Read::Native))
            || matches!(self.b, Operand::F16(F16Read::Native))
    }

    pub fn workgroup_bytes(&self) -> u32 {
        self.tile.workgroup_bytes(self.parts)
    }

    /// The same variant on another tile.
    pub fn with_tile(self, tile: Tile) -> MatmulVariant {
        MatmulVariant { tile, ..self }
    }
}

/// A kernel: one entry point of one family, with its variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    Encode,
    Decode,
    Quantize,
    Amax,
    ScaleFromAmax,
    SplitBf16,
    Matmul(MatmulVariant),
    Train(TrainOp),
}

impl Kernel {
    pub fn entry_point(&self) -> &'static str {
        match self {
            Kernel::Encode => "encode",
            Kernel::Decode => "decode",
            Kernel::Quantize => "quantize",
            Kernel::Amax => "amax",
            Kernel::ScaleFromAmax => "scale_from_amax",
            Kernel::SplitBf16 => "split_bf16",
            Kernel::Matmul(_) => "matmul",
            Kernel::Train(op) => op.entry_point(),
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
            Kernel::Train(op) => format!("train.{}", op.entry_point()),
            Kernel::Matmul(v) => format!(
                "matmul[{:?} x {:?}, parts {}, levels {}, fp8 {}, rowwise {}, tile {}x{}x{}]",
                v.a, v.b, v.parts, v.levels, v.fp8, v.rowwise, v.tile.bm, v.tile.bn, v.tile.bk
            ),
        }
    }

    pub fn needs_f16(&self) -> bool {
        matches!(self, Kernel::Matmul(v) if v.uses_f16())
    }

    /// The complete WGSL source of this kernel.
    pub fn source(&self) -> String {
        let family = match self {
            Kernel::Encode | Kernel::Decode | Kernel::Quantize => CAST,
            Kernel::Amax | Kernel::ScaleFromAmax => SCALE,
            Kernel::SplitBf16 => SPLIT,
            Kernel::Matmul(_) => MATMUL,
            Kernel::Train(_) => TRAIN,
        };
        let mut header = String::new();
        if self.needs_f16() {
            header.push_str("enable f16;\n\n");
        }
        if let Kernel::Matmul(v) = self {
            header.push_str(&format!(
                "const BM: u32 = {}u;\nconst BN: u32 = {}u;\nconst BK: u32 = {}u;\nconst PARTS: u32 = {}u;\n\
                 const LEVELS: u32 = {}u;\nconst FP8: bool = {};\nconst ROWWISE: bool = {};\n\
                 alias A_T = {};\nalias B_T = {};\n\n",
                v.tile.bm,
                v.tile.bn,
                v.tile.bk,
                v.parts,
                v.levels,
                v.fp8,
                v.rowwise,
                v.a.element_type(),
                v.b.element_type()
            ));
            header.push_str(&v.a.fetch_fn("fetch_a", "a_data"));
            header.push_str(&v.b.fetch_fn("fetch_b", "b_data"));
        }
        format!("// generated header\n{header}\n{FORMATS}\n{family}")
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
        ];
        kernels.extend(TrainOp::ALL.map(Kernel::Train));
        for f16 in [F16Read::Native, F16Read::Packed] {
            for alg in Algorithm::ALL {
                for scaling in [
                    crate::algorithm::Scaling::Tensorwise,
                    crate::algorithm::Scaling::Rowwise,
                ] {
                    let k = Kernel::Matmul(MatmulVariant::for_algorithm(
                        &alg.with_scaling(scaling),
                        f16,
                    ));
                    if !kernels.contains(&k) {
                        kernels.push(k);
                    }
                }
            }
        }
        kernels
    }
}

/// Parses and validates a kernel's WGSL with naga, and writes SPIR-V from it (the path wgpu
/// takes on Vulkan), returning the first error with its location.
pub fn validate(kernel: &Kernel) -> Result<(), String> {
    let source = kernel.source();
    let module = naga::front::wgsl::parse_str(&source).map_err(|e| e.emit_to_string(&source))?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .map_err(|e| e.emit_to_string(&source))?;
    naga::back::spv::write_vec(&module, &info, &naga::back::spv::Options::default(), None)
        .map_err(|e| format!("SPIR-V generation failed: {e}"))?;
    Ok(())
}
