//! naga validates every WGSL kernel variant and writes SPIR-V from it: a broken shader fails
//! `cargo test` on any machine, GPU or not.

use mantissa::backend::wgpu::shaders::{Kernel, validate};

#[test]
fn every_kernel_variant_validates() {
    let kernels = Kernel::all();
    assert!(
        kernels.len() > 20,
        "expected every cast, scale, split and matmul variant, got {}",
        kernels.len()
    );
    let failures: Vec<String> = kernels
        .iter()
        .filter_map(|k| validate(k).err().map(|e| format!("{}:\n{e}", k.label())))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} kernels fail:\n{}",
        failures.len(),
        kernels.len(),
        failures.join("\n\n")
    );
}

#[test]
fn workgroup_memory_fits_the_webgpu_default() {
    for k in Kernel::all() {
        if let Kernel::Matmul(v) = k {
            assert!(
                v.workgroup_bytes() <= 16 * 1024,
                "{}: {} bytes of workgroup memory",
                k.label(),
                v.workgroup_bytes()
            );
        }
    }
}

#[test]
fn validation_reports_errors_with_their_location() {
    // The validator itself must catch a broken shader (and say where), or the test above proves
    // nothing: check it on a deliberately broken module.
    let broken = "@compute @workgroup_size(1) fn main() { let x: u32 = 1.5; }";
    let err = naga::front::wgsl::parse_str(broken)
        .map(|_| ())
        .map_err(|e| e.emit_to_string(broken));
    assert!(err.is_err_and(|e| e.contains("1.5") || e.contains("type")));
}

#[test]
fn every_autotuner_tile_validates() {
    use mantissa::backend::wgpu::shaders::{F16Read, MatmulVariant, Tile};
    use mantissa::{Algorithm, Format};
    // The largest limits a native device offers here; browsers get the subset within 256
    // invocations and 16 KiB.
    for alg in [
        Algorithm::F32,
        Algorithm::Bf16x9,
        Algorithm::fp8(Format::E5m2, Format::E4m3),
    ] {
        let v = MatmulVariant::for_algorithm(&alg, F16Read::Packed);
        for tile in Tile::candidates(v.parts, 1024, 32 * 1024) {
            let k = Kernel::Matmul(v.with_tile(tile));
            if let Err(e) = validate(&k) {
                panic!("{}:\n{e}", k.label());
            }
        }
    }
}

#[test]
fn every_cooperative_block_validates() {
    use mantissa::Algorithm;
    use mantissa::backend::wgpu::shaders::{Coop, MatmulVariant, Tile};
    // 8x8 tiles on subgroups of 8 (lavapipe; Apple has 8x8 on 32) and 16x16 on 32 (NVIDIA).
    for coop in [
        Coop {
            size: 8,
            subgroup: 8,
        },
        Coop {
            size: 16,
            subgroup: 32,
        },
    ] {
        for alg in [Algorithm::F16, Algorithm::Bf16x9] {
            let v = MatmulVariant::coop(&alg, coop).expect("a cooperative variant");
            for tile in
                Tile::coop_candidates(coop.size, coop.subgroup, v.parts.max(1), 48 * 1024, 1024)
            {
                let k = Kernel::Matmul(v.with_tile(tile));
                if let Err(e) = validate(&k) {
                    panic!("{}:\n{e}", k.label());
                }
            }
        }
    }
    assert!(
        MatmulVariant::coop(
            &Algorithm::F32,
            Coop {
                size: 16,
                subgroup: 32
            }
        )
        .is_none()
    );
}

/// Format ids, scalar slots and split terms are defined once in Rust and generated into every
/// kernel (`backend::defs`): no kernel file defines its own copy, every kernel's source carries
/// the generated values, and the split kernels take their products from the generated lists.
#[test]
fn kernels_take_shared_definitions_from_the_generated_header() {
    use mantissa::backend::defs;
    use mantissa::format::Format;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for dir in ["shaders", "cuda"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            for line in text.lines().map(str::trim) {
                let defines = ["const FMT_", "#define FMT_", "const S_", "#define S_"]
                    .iter()
                    .any(|p| line.starts_with(p));
                assert!(!defines, "{} defines its own {line:?}", path.display());
            }
        }
    }
    let wgsl = defs::wgsl();
    for f in Format::ALL {
        let want = format!("const FMT_{}: u32 = {}u;", f.name().to_uppercase(), f.id());
        assert!(wgsl.contains(&want), "{want}");
    }
    for (name, slot) in mantissa::plan::scalar::SLOTS {
        assert!(wgsl.contains(&format!("const S_{name}: u32 = {slot}u;")));
        assert!(defs::cuda().contains(&format!("#define S_{name} {slot}u")));
    }
    for k in Kernel::all() {
        let src = k.source();
        assert!(src.starts_with("// generated header\n") && src.contains(&wgsl));
        assert!(
            !src.contains("{{"),
            "{}: a template marker is left",
            k.label()
        );
    }
    let split = std::fs::read_to_string(root.join("cuda/matmul_split_bf16.cu")).unwrap();
    assert!(split.contains("SPLIT_TERMS(TERM)") && !split.contains("TERM(0, P_H, P_H)"));
}
