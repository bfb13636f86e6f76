//! `finfo`: the constants of a format, equal to PyTorch's `torch.finfo`.

use super::Format;

/// The machine limits of a format, as `torch.finfo` reports them.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Finfo {
    /// The format described.
    pub format: Format,
    /// Bits of one stored value (tf32: 19 significant bits carried in 32).
    pub bits: u32,
    /// Exponent field width in bits.
    pub exponent_bits: u32,
    /// Explicit mantissa bits.
    pub mantissa_bits: u32,
    /// Largest finite value.
    pub max: f64,
    /// Most negative finite value (-max).
    pub min: f64,
    /// Smallest positive normal value (`tiny` / `smallest_normal`).
    pub smallest_normal: f64,
    /// Smallest positive subnormal value.
    pub smallest_subnormal: f64,
    /// Distance from 1.0 to the next larger value.
    pub eps: f64,
    /// Approximate decimal resolution, 10^-floor(-log10(eps)).
    pub resolution: f64,
}

impl Finfo {
    /// The limits of `format`.
    pub fn of(format: Format) -> Finfo {
        let layout = format.layout();
        let eps = layout.eps();
        let precision = (-eps.log10()).floor() as i32;
        Finfo {
            format,
            bits: layout.total_bits(),
            exponent_bits: layout.exp_bits,
            mantissa_bits: layout.man_bits,
            max: layout.max_finite(),
            min: -layout.max_finite(),
            smallest_normal: layout.min_normal(),
            smallest_subnormal: layout.min_subnormal(),
            eps,
            resolution: 10f64.powi(-precision),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::minifloat::pow2;
    #[test]
    fn bits_are_one_sign_plus_fields() {
        for f in Format::ALL {
            let i = Finfo::of(f);
            assert_eq!(i.bits, 1 + i.exponent_bits + i.mantissa_bits);
            assert_eq!(
                i.smallest_subnormal,
                i.smallest_normal * pow2(-(i.mantissa_bits as i32))
            );
        }
    }
}
