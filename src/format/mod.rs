//! Number formats: bit-exact encode/decode on the host, and `finfo`.
//!
//! Every backend must agree with this module bit for bit (NaN payloads aside). Rounding is
//! round-to-nearest-even everywhere; overflow follows docs/design.md: inf for formats that have it,
//! NaN for e4m3 (OCP e4m3fn, which has no inf). The saturating mode maps finite and infinite
//! overflow to the signed max and keeps NaN.

mod finfo;
mod minifloat;
mod raw;

pub use finfo::Finfo;
pub use minifloat::MiniFloat;
pub use raw::convert_raw;

use crate::error::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// A number format that values are stored or computed in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Format {
    /// IEEE binary32.
    F32,
    /// f32 with 10 explicit mantissa bits (NVIDIA TensorFloat-32), carried in an f32.
    Tf32,
    /// bfloat16: f32's 8 exponent bits, 7 mantissa bits.
    Bf16,
    /// IEEE binary16: 5 exponent bits, 10 mantissa bits, max 65504.
    F16,
    /// OCP e4m3fn: bias 7, no inf, NaN = S.1111.111, max 448.
    E4m3,
    /// OCP e5m2: bias 15, IEEE-like, max 57344.
    E5m2,
}

/// What happens to values beyond a format's range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Overflow {
    /// The format's own rule: inf where the format has inf, else NaN (e4m3).
    #[default]
    Standard,
    /// Finite and infinite overflow map to the signed max; NaN stays NaN.
    Saturate,
}

impl Format {
    /// Every format, in the order of their kernel ids (`id`).
    pub const ALL: [Format; 6] = [
        Format::F32,
        Format::Tf32,
        Format::Bf16,
        Format::F16,
        Format::E4m3,
        Format::E5m2,
    ];

    /// The id kernels know the format by (`FMT_<NAME>` in the generated kernel header,
    /// `backend::defs`): its position in `ALL`.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Its name, as the CLI and Python take it ("f32", "tf32", "bf16", "f16", "e4m3", "e5m2").
    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::Tf32 => "tf32",
            Format::Bf16 => "bf16",
            Format::F16 => "f16",
            Format::E4m3 => "e4m3",
            Format::E5m2 => "e5m2",
        }
    }

    /// The layout of the format as sign/exponent/mantissa fields and its special-value rules.
    pub fn layout(self) -> MiniFloat {
        match self {
            Format::F32 => MiniFloat::IEEE_F32,
            Format::Tf32 => MiniFloat::TF32,
            Format::Bf16 => MiniFloat::BF16,
            Format::F16 => MiniFloat::F16,
            Format::E4m3 => MiniFloat::E4M3FN,
            Format::E5m2 => MiniFloat::E5M2,
        }
    }

    /// Bits of one stored value (tf32 is carried in 32 bits but has 19 significant ones).
    pub fn storage_bits(self) -> u32 {
        match self {
            Format::F32 | Format::Tf32 => 32,
            Format::Bf16 | Format::F16 => 16,
            Format::E4m3 | Format::E5m2 => 8,
        }
    }

    /// The narrower of two formats (fewer mantissa bits; `other` where they tie): an f32-class
    /// op in a "true" preset still outputs 16-bit, and an override to 16-bit in a mixed preset
    /// narrows the f32 stream.
    pub fn narrower(self, other: Format) -> Format {
        if self.finfo().mantissa_bits >= other.finfo().mantissa_bits {
            other
        } else {
            self
        }
    }

    /// Bytes a value takes in storage (tf32: 4, carried in an f32).
    pub fn storage_bytes(self) -> usize {
        self.storage_bits() as usize / 8
    }

    /// Largest finite value.
    pub fn max(self) -> f32 {
        self.layout().max_finite() as f32
    }

    /// Encodes an f32 into this format's bit pattern (in the low `storage_bits` bits).
    /// tf32 is returned as the bits of the f32 that carries it.
    pub fn encode(self, x: f32, overflow: Overflow) -> u32 {
        match (self, overflow) {
            (Format::F32, Overflow::Standard) => x.to_bits(),
            // `half` rounds to nearest even and overflows to inf: exactly the standard rule.
            (Format::Bf16, Overflow::Standard) => half::bf16::from_f32(x).to_bits() as u32,
            (Format::F16, Overflow::Standard) => half::f16::from_f32(x).to_bits() as u32,
            (Format::Tf32, Overflow::Standard) => round_tf32_bits(x.to_bits()),
            (Format::Tf32, Overflow::Saturate) => {
                (self.layout().round_value(x, overflow) as f32).to_bits()
            }
            _ => self.layout().encode(x, overflow),
        }
    }

    /// Decodes a bit pattern of this format (low `storage_bits` bits) to f32, exactly.
    pub fn decode(self, bits: u32) -> f32 {
        match self {
            Format::F32 | Format::Tf32 => f32::from_bits(bits),
            Format::Bf16 => half::bf16::from_bits(bits as u16).to_f32(),
            Format::F16 => half::f16::from_bits(bits as u16).to_f32(),
            Format::E4m3 | Format::E5m2 => self.layout().decode(bits) as f32,
        }
    }

    /// Rounds an f32 to the nearest value of this format (encode then decode).
    pub fn round(self, x: f32, overflow: Overflow) -> f32 {
        self.decode(self.encode(x, overflow))
    }

    /// Its numeric limits, as `torch.finfo` gives them.
    pub fn finfo(self) -> Finfo {
        Finfo::of(self)
    }

    /// Bits of the canonical quiet NaN with the given sign.
    pub fn nan_bits(self, negative: bool) -> u32 {
        self.layout().nan_bits(negative)
    }

    /// `x` cast to this format, as `mantissa cast` and the browser's cast view show it.
    pub fn describe(self, x: f32, overflow: Overflow) -> Encoding {
        let code = self.encode(x, overflow);
        let value = self.decode(code);
        let l = self.layout();
        // tf32 is stored in f32's layout; show its 19 significant bits.
        let shown = if self == Format::Tf32 {
            code >> 13
        } else {
            code
        };
        let bits =
            |v: u32, n: u32| format!("{:0w$b}", v & ((1u64 << n) - 1) as u32, w = n as usize);
        let error = value as f64 - x as f64;
        Encoding {
            format: self,
            code,
            hex: format!("0x{:0w$x}", code, w = self.storage_bytes() * 2),
            sign: bits(shown >> (l.exp_bits + l.man_bits), 1),
            exponent: bits(shown >> l.man_bits, l.exp_bits),
            mantissa: bits(shown, l.man_bits),
            value,
            error: error.is_finite().then_some(error),
            relative_error: (x != 0.0 && x.is_finite() && error.is_finite())
                .then(|| error / x as f64),
        }
    }
}

/// One value cast to one format: its code, bit fields and the error of the cast.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Encoding {
    /// The format cast to.
    pub format: Format,
    /// The code: the value's bits (tf32: the f32 bits).
    pub code: u32,
    /// The code in hex, zero-padded to the storage width.
    pub hex: String,
    /// The sign bit, in binary.
    pub sign: String,
    /// The exponent field, in binary.
    pub exponent: String,
    /// The mantissa field, in binary (tf32: its 10 bits).
    pub mantissa: String,
    /// The decoded value.
    pub value: f32,
    /// value - x (none where either is not finite).
    pub error: Option<f64>,
    /// error / x (none where x is 0 or either is not finite).
    pub relative_error: Option<f64>,
}

/// tf32 rounding on the f32 bit pattern: round to nearest even at bit 13, clear the low 13 bits.
/// A carry out of the largest binade gives inf, as IEEE rounding does. NaN stays NaN.
fn round_tf32_bits(bits: u32) -> u32 {
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return bits | 0x0040_0000; // quiet NaN, payload aside
    }
    let lsb = (bits >> 13) & 1;
    (bits + 0x0fff + lsb) & !0x1fff
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Format {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let key = s.trim().to_ascii_lowercase();
        let found = match key.as_str() {
            "float32" | "fp32" => Some(Format::F32),
            "bfloat16" => Some(Format::Bf16),
            "float16" | "fp16" | "half" => Some(Format::F16),
            "e4m3fn" | "float8_e4m3fn" | "fp8_e4m3" => Some(Format::E4m3),
            "float8_e5m2" | "fp8_e5m2" => Some(Format::E5m2),
            _ => Format::ALL.into_iter().find(|f| f.name() == key),
        };
        found.ok_or_else(|| Error::UnknownName {
            kind: "format",
            given: s.to_string(),
            valid: Format::ALL.iter().map(|f| f.name().to_string()).collect(),
        })
    }
}

impl From<Format> for String {
    fn from(f: Format) -> String {
        f.name().to_string()
    }
}

impl TryFrom<String> for Format {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

/// Splits an f32 into three bf16 parts, x = h + m + l (docs/design.md): h = bf16(x), m = bf16(x - h),
/// l = bf16(x - h - m). Each difference is exact in f32. Where h is not finite (x is inf/NaN, or
/// its bf16 rounding overflows), m = l = 0.
pub fn split_bf16(x: f32) -> [f32; 3] {
    let h = Format::Bf16.round(x, Overflow::Standard);
    if !h.is_finite() {
        return [h, 0.0, 0.0];
    }
    let r1 = x - h;
    let m = Format::Bf16.round(r1, Overflow::Standard);
    let l = Format::Bf16.round(r1 - m, Overflow::Standard);
    [h, m, l]
}

/// The fp8 quantization the matmul algorithms use: `sat_cast(x * s)`; a non-finite input gives
/// NaN so that every output it touches is NaN (docs/design.md). Returns the quantized value as f32.
pub fn quantize_scaled(x: f32, scale: f32, format: Format) -> f32 {
    if !x.is_finite() {
        return f32::NAN;
    }
    format.round(x * scale, Overflow::Saturate)
}

/// The current-scaling factor for values whose largest finite magnitude is `amax`:
/// s = FMAX / amax in f32, 1 where amax is 0, capped at f32::MAX (a subnormal amax would
/// otherwise give inf, and 0 * inf a NaN).
pub fn scale_for_amax(amax: f32, format: Format) -> f32 {
    if amax == 0.0 || !amax.is_finite() {
        return 1.0;
    }
    let s = format.max() / amax;
    if s.is_finite() { s } else { f32::MAX }
}

/// Largest finite magnitude in `values` (NaN and inf are ignored), 0 if there is none.
pub fn amax(values: impl IntoIterator<Item = f32>) -> f32 {
    values
        .into_iter()
        .filter(|v| v.is_finite())
        .fold(0.0f32, |m, v| m.max(v.abs()))
}
