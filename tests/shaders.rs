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
