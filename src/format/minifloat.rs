//! A generic binary floating-point layout (sign, exponent, mantissa) with exact rounding.
//!
//! Computation happens in f64, where every f32 and every value of these formats is exact, so the
//! code reads like the definition: find the spacing of representable values around |x|, round
//! |x| / spacing to the nearest integer (ties to even), then handle overflow.

use super::Overflow;

/// Field widths and special-value rules of a binary float format. The exponent bias is always
/// 2^(exp_bits - 1) - 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MiniFloat {
    /// Exponent field width in bits.
    pub exp_bits: u32,
    /// Explicit mantissa (fraction) bits.
    pub man_bits: u32,
    /// IEEE-like: the all-ones exponent holds inf and NaN. Otherwise ("fn" formats such as OCP
    /// e4m3fn) there is no inf and only the all-ones pattern S.1111.111 is NaN.
    pub ieee_specials: bool,
}

impl MiniFloat {
    /// IEEE binary32.
    pub const IEEE_F32: MiniFloat = MiniFloat {
        exp_bits: 8,
        man_bits: 23,
        ieee_specials: true,
    };
    /// NVIDIA TensorFloat-32: f32's exponent, 10 mantissa bits.
    pub const TF32: MiniFloat = MiniFloat {
        exp_bits: 8,
        man_bits: 10,
        ieee_specials: true,
    };
    /// bfloat16.
    pub const BF16: MiniFloat = MiniFloat {
        exp_bits: 8,
        man_bits: 7,
        ieee_specials: true,
    };
    /// IEEE binary16.
    pub const F16: MiniFloat = MiniFloat {
        exp_bits: 5,
        man_bits: 10,
        ieee_specials: true,
    };
    /// OCP e4m3fn: no inf, one NaN pattern, max 448.
    pub const E4M3FN: MiniFloat = MiniFloat {
        exp_bits: 4,
        man_bits: 3,
        ieee_specials: false,
    };
    /// OCP e5m2: IEEE-like, max 57344.
    pub const E5M2: MiniFloat = MiniFloat {
        exp_bits: 5,
        man_bits: 2,
        ieee_specials: true,
    };

    /// The exponent bias, 2^(exp_bits - 1) - 1.
    pub fn bias(&self) -> i32 {
        (1 << (self.exp_bits - 1)) - 1
    }

    fn exp_all_ones(&self) -> u32 {
        (1 << self.exp_bits) - 1
    }

    fn man_all_ones(&self) -> u32 {
        (1 << self.man_bits) - 1
    }

    /// Bits of a code: sign, exponent and mantissa.
    pub fn total_bits(&self) -> u32 {
        1 + self.exp_bits + self.man_bits
    }

    /// The largest unbiased exponent of a finite value.
    pub fn max_exponent(&self) -> i32 {
        let top = self.exp_all_ones() as i32 - self.bias();
        if self.ieee_specials { top - 1 } else { top }
    }

    /// The largest finite value.
    pub fn max_finite(&self) -> f64 {
        // IEEE: all mantissa bits set; fn formats: all but the last (all ones is NaN).
        let ulps_below_two = if self.ieee_specials { 1.0 } else { 2.0 };
        (2.0 - ulps_below_two * pow2(-(self.man_bits as i32))) * pow2(self.max_exponent())
    }

    /// The smallest positive normal value.
    pub fn min_normal(&self) -> f64 {
        pow2(1 - self.bias())
    }

    /// The smallest positive subnormal value.
    pub fn min_subnormal(&self) -> f64 {
        pow2(1 - self.bias() - self.man_bits as i32)
    }

    /// Machine epsilon: the spacing of values in [1, 2).
    pub fn eps(&self) -> f64 {
        pow2(-(self.man_bits as i32))
    }

    /// Canonical NaN: all-ones exponent and mantissa (the only NaN of e4m3fn; PyTorch's e5m2 NaN).
    pub fn nan_bits(&self, negative: bool) -> u32 {
        let sign = (negative as u32) << (self.exp_bits + self.man_bits);
        sign | (self.exp_all_ones() << self.man_bits) | self.man_all_ones()
    }

    /// The value of `x` rounded into this format: a finite value of the format, ±inf or NaN.
    pub fn round_value(&self, x: f32, overflow: Overflow) -> f64 {
        if x.is_nan() {
            return f64::NAN;
        }
        let sign = if x.is_sign_negative() { -1.0 } else { 1.0 };
        let a = (x as f64).abs();
        let rounded = if a.is_infinite() {
            f64::INFINITY
        } else {
            let spacing = if a < self.min_normal() {
                self.min_subnormal()
            } else {
                pow2(floor_log2(a) - self.man_bits as i32)
            };
            (a / spacing).round_ties_even() * spacing
        };
        let magnitude = if rounded <= self.max_finite() {
            rounded
        } else {
            match overflow {
                Overflow::Saturate => self.max_finite(),
                Overflow::Standard if self.ieee_specials => f64::INFINITY,
                Overflow::Standard => f64::NAN,
            }
        };
        sign * magnitude
    }

    /// Encodes `x` as this format's bit pattern.
    pub fn encode(&self, x: f32, overflow: Overflow) -> u32 {
        let v = self.round_value(x, overflow);
        let negative = x.is_sign_negative();
        let sign = (negative as u32) << (self.exp_bits + self.man_bits);
        if v.is_nan() {
            return self.nan_bits(negative);
        }
        let a = v.abs();
        if a.is_infinite() {
            return sign | (self.exp_all_ones() << self.man_bits);
        }
        if a < self.min_normal() {
            return sign | (a / self.min_subnormal()) as u32;
        }
        let e = floor_log2(a);
        let exp_field = (e + self.bias()) as u32;
        let man_field = ((a / pow2(e) - 1.0) * pow2(self.man_bits as i32)) as u32;
        sign | (exp_field << self.man_bits) | man_field
    }

    /// Decodes a bit pattern (in the low `total_bits` bits) exactly.
    pub fn decode(&self, bits: u32) -> f64 {
        let negative = (bits >> (self.exp_bits + self.man_bits)) & 1 == 1;
        let exp_field = (bits >> self.man_bits) & self.exp_all_ones();
        let man_field = bits & self.man_all_ones();
        let sign = if negative { -1.0 } else { 1.0 };
        if exp_field == self.exp_all_ones() {
            if self.ieee_specials {
                return if man_field == 0 {
                    sign * f64::INFINITY
                } else {
                    f64::NAN
                };
            }
            if man_field == self.man_all_ones() {
                return f64::NAN;
            }
        }
        let magnitude = if exp_field == 0 {
            man_field as f64 * self.min_subnormal()
        } else {
            (1.0 + man_field as f64 * self.eps()) * pow2(exp_field as i32 - self.bias())
        };
        sign * magnitude
    }
}

pub(crate) fn pow2(e: i32) -> f64 {
    2f64.powi(e)
}

/// floor(log2(a)) for a positive normal f64 (every nonzero f32 is one).
fn floor_log2(a: f64) -> i32 {
    ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023
}
