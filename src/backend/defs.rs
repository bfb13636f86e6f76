//! The definitions every kernel shares with the host, generated from their one Rust definition
//! and spliced before each kernel's source (WGSL by `wgpu::shaders`, CUDA by `cuda::kernels`
//! and the host harness of the tests): no `.wgsl` or `.cu` file types a number of its own.
//!
//! - format ids (`FMT_F32` ...): `Format::id`;
//! - the step's scalar slots (`S_LR` ...): `plan::scalar::SLOTS`;
//! - the split-bf16 level terms: `algorithm::SPLIT_LEVELS` (CUDA: the `SPLIT_TERMS` macro; WGSL:
//!   the products of the SIMT kernel and the cooperative blocks, written out by the loader).

use crate::algorithm::SPLIT_LEVELS;
use crate::format::Format;
use crate::plan::scalar;
use std::fmt::Write;

fn upper(format: Format) -> String {
    format.name().to_ascii_uppercase()
}

/// The WGSL header: `const FMT_BF16: u32 = 2u;`, `const S_LR: u32 = 3u;`.
pub fn wgsl() -> String {
    let mut s = String::from("// generated from src/format and src/plan/scalar.rs\n");
    for f in Format::ALL {
        let _ = writeln!(s, "const FMT_{}: u32 = {}u;", upper(f), f.id());
    }
    for (name, slot) in scalar::SLOTS {
        let _ = writeln!(s, "const S_{name}: u32 = {slot}u;");
    }
    s
}

/// The CUDA header: the same constants as defines, and `SPLIT_TERMS(TERM)`, which expands to
/// `TERM(level, part of A, part of B)` for every product of the split levels (parts 0 = h,
/// 1 = m, 2 = l), in level order.
pub fn cuda() -> String {
    let mut s =
        String::from("// generated from src/format, src/plan/scalar.rs, src/algorithm.rs\n");
    for f in Format::ALL {
        let _ = writeln!(s, "#define FMT_{} {}u", upper(f), f.id());
    }
    for (name, slot) in scalar::SLOTS {
        let _ = writeln!(s, "#define S_{name} {slot}u");
    }
    s.push_str("#define SPLIT_TERMS(TERM)");
    for (level, terms) in SPLIT_LEVELS.iter().enumerate() {
        for (a, b) in terms.iter() {
            let _ = write!(s, " TERM({level}, {a}, {b})");
        }
    }
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_ids_are_positions_in_all() {
        for (i, f) in Format::ALL.iter().enumerate() {
            assert_eq!(f.id() as usize, i, "{f}");
        }
    }

    #[test]
    fn headers_carry_every_definition() {
        let (w, c) = (wgsl(), cuda());
        assert!(w.contains("const FMT_E4M3: u32 = 4u;") && c.contains("#define FMT_E4M3 4u"));
        assert!(w.contains("const S_CLIP: u32 = 10u;") && c.contains("#define S_CLIP 10u"));
        let terms: usize = SPLIT_LEVELS.iter().map(|l| l.len()).sum();
        assert_eq!(c.matches(" TERM(").count(), terms, "{c}");
    }
}
