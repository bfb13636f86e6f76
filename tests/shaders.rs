//! naga validates every WGSL kernel variant and writes SPIR-V from it, and MSL and HLSL as
//! wgpu's Metal and DX12 back ends would: a broken shader fails `cargo test` on any machine,
//! GPU or not.

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
            for unrolled in [false, true] {
                let k = Kernel::Matmul(v.with_tile(tile).with_unrolled(unrolled));
                if let Err(e) = validate(&k) {
                    panic!("{}:\n{e}", k.label());
                }
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

/// A function of a SPIR-V module: its parameters' ids and its instructions after them, each as
/// (opcode, operands).
struct SpirvFunction {
    params: Vec<u32>,
    body: Vec<(u32, Vec<u32>)>,
}

const OP_NAME: u32 = 5;
const OP_EXT_INST_IMPORT: u32 = 11;
const OP_EXT_INST: u32 = 12;
const OP_FUNCTION: u32 = 54;
const OP_FUNCTION_PARAMETER: u32 = 55;
const OP_FUNCTION_END: u32 = 56;
const OP_LOOP_MERGE: u32 = 246;
const OP_BRANCH_CONDITIONAL: u32 = 250;
const OP_SWITCH: u32 = 251;
const GLSL_UMIN: u32 = 38;

fn spirv_string(words: &[u32]) -> String {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// The module's named functions, and the id of its GLSL.std.450 instruction set.
fn spirv_functions(words: &[u32]) -> (std::collections::HashMap<String, SpirvFunction>, u32) {
    let mut names = std::collections::HashMap::new();
    let mut functions = std::collections::HashMap::new();
    let mut glsl = u32::MAX;
    let mut current: Option<(u32, SpirvFunction)> = None;
    let mut at = 5; // past the header
    while at < words.len() {
        let (count, opcode) = ((words[at] >> 16) as usize, words[at] & 0xffff);
        assert!(
            count > 0 && at + count <= words.len(),
            "malformed SPIR-V at word {at}"
        );
        let ops = words[at + 1..at + count].to_vec();
        match opcode {
            OP_NAME => {
                names.insert(ops[0], spirv_string(&ops[1..]));
            }
            OP_EXT_INST_IMPORT if spirv_string(&ops[1..]) == "GLSL.std.450" => glsl = ops[0],
            OP_FUNCTION => {
                let f = SpirvFunction {
                    params: Vec::new(),
                    body: Vec::new(),
                };
                current = Some((ops[1], f));
            }
            OP_FUNCTION_PARAMETER => {
                if let Some((_, f)) = current.as_mut() {
                    f.params.push(ops[1]);
                }
            }
            OP_FUNCTION_END => {
                if let Some((id, f)) = current.take() {
                    functions.insert(names.get(&id).cloned().unwrap_or_default(), f);
                }
            }
            _ => {
                if let Some((_, f)) = current.as_mut() {
                    f.body.push((opcode, ops));
                }
            }
        }
        at += count;
    }
    (functions, glsl)
}

/// The claim that makes the checked SIMT kernel fast (docs/wgpu.md, "Runtime checks"): with
/// wgpu's runtime checks, naga clamps every index that is not a constant and bounds every
/// loop, which stops drivers unrolling. The loader writes the K step out, so in the checked
/// SPIR-V the step is straight-line code whose only clamps are on the invocation's own row and
/// column (parameters, the same at every k: a driver computes each once), and with those
/// clamps taken out it is the unchecked step instruction for instruction. What a tile load
/// slot runs has no loop either (the slots themselves are a loop: memory-bound, and once per
/// K step, not per k).
#[test]
fn checked_k_step_runs_the_unchecked_instructions() {
    use mantissa::backend::wgpu::shaders::{F16Read, Load, MatmulVariant, Tile, spirv};
    use mantissa::{Algorithm, Format};
    let wide = Tile {
        bm: 128,
        bn: 128,
        bk: 8,
        reg: 8,
        warps: 1,
        buffers: 1,
        prefetch: false,
        quad_blocks: false,
        splits: 1,
        simt: false,
        encoded: false,
    };
    let bf16x3 = MatmulVariant::for_algorithm(&Algorithm::Bf16x3, F16Read::Packed);
    let variants = [
        MatmulVariant::for_algorithm(&Algorithm::F32, F16Read::Packed),
        MatmulVariant::for_algorithm(&Algorithm::F32, F16Read::Packed).with_tile(wide),
        MatmulVariant::for_algorithm(&Algorithm::F16, F16Read::Native),
        MatmulVariant::for_algorithm(&Algorithm::Bf16x9, F16Read::Packed),
        MatmulVariant::for_algorithm(
            &Algorithm::fp8(Format::E4m3, Format::E5m2)
                .with_scaling(mantissa::algorithm::Scaling::Rowwise),
            F16Read::Packed,
        ),
        bf16x3.fallback(),
        // f32 loaded in quads, along K and along lines.
        MatmulVariant::for_algorithm(&Algorithm::F32, F16Read::Packed)
            .with_loads([Load::QuadsAlongK, Load::QuadsAlongLines]),
        MatmulVariant::for_algorithm(&Algorithm::Tf32, F16Read::Packed)
            .with_loads([Load::QuadsAlongLines, Load::QuadsAlongK]),
        // Along K in blocks of four lines, stored as vec4s.
        MatmulVariant::for_algorithm(&Algorithm::F32, F16Read::Packed)
            .with_loads([Load::QuadBlocksAlongK, Load::QuadBlocksAlongK]),
        // Two workgroup buffers: a step function per buffer, each at constant indices.
        bf16x3.with_tile(Tile::default_for(3).with_buffers(2)),
        MatmulVariant::for_algorithm(&Algorithm::F32, F16Read::Packed)
            .with_tile(wide.with_buffers(2)),
    ];
    for v in variants {
        // The looped step of the same variant is what the unrolled one replaces: checked, its
        // loop is bounded (so drivers keep it a loop).
        let steps: Vec<String> = (0..v.tile.buffers).map(|s| format!("k_step_{s}")).collect();
        let looped = spirv_functions(&spirv(&Kernel::Matmul(v), true).unwrap()).0;
        for name in &steps {
            assert_eq!(
                looped[name.as_str()]
                    .body
                    .iter()
                    .filter(|i| i.0 == OP_LOOP_MERGE)
                    .count(),
                1
            );
        }
        let k = Kernel::Matmul(v.with_unrolled(true));
        let label = k.label();
        let (checked, glsl) = spirv_functions(&spirv(&k, true).unwrap());
        let (unchecked, _) = spirv_functions(&spirv(&k, false).unwrap());
        let is_clamp = |(op, ops): &(u32, Vec<u32>)| {
            *op == OP_EXT_INST && ops[2] == glsl && ops[3] == GLSL_UMIN
        };
        let count =
            |f: &SpirvFunction, opcode: u32| f.body.iter().filter(|i| i.0 == opcode).count();
        for name in &steps {
            let step = &checked[name.as_str()];
            assert_eq!(
                count(step, OP_LOOP_MERGE),
                0,
                "{label}: a loop in the K step"
            );
            assert_eq!(
                count(step, OP_BRANCH_CONDITIONAL) + count(step, OP_SWITCH),
                0,
                "{label}: the K step branches"
            );
            let clamps: Vec<&Vec<u32>> = step
                .body
                .iter()
                .filter(|i| is_clamp(i))
                .map(|i| &i.1)
                .collect();
            // The checks are on (else this test would prove nothing), and each clamps a parameter.
            assert!(
                !clamps.is_empty(),
                "{label}: no clamp in the checked K step"
            );
            for ops in &clamps {
                assert!(
                    step.params.contains(&ops[4]),
                    "{label}: a clamp on %{} in the K step, not on the invocation's row or column",
                    ops[4]
                );
            }
            let opcodes = |f: &SpirvFunction| -> Vec<u32> {
                f.body
                    .iter()
                    .filter(|i| !is_clamp(i))
                    .map(|i| i.0)
                    .collect()
            };
            assert_eq!(
                opcodes(step),
                opcodes(&unchecked[name.as_str()]),
                "{label}: the checked K step differs from the unchecked one beyond its clamps"
            );
        }
        let quads = [
            "load_a_quads",
            "load_b_quads",
            "load_a_blocks",
            "load_b_blocks",
            "a_quad",
            "b_quad",
        ];
        for name in ["load_a", "load_b", "a_rows", "b_cols"]
            .into_iter()
            .chain(quads.into_iter().filter(|q| checked.contains_key(*q)))
        {
            assert_eq!(
                count(&checked[name], OP_LOOP_MERGE),
                0,
                "{label}: a loop in {name}"
            );
        }
        // The K loop itself is bounded: what the test looks for is there to be found.
        assert!(
            count(&checked["k_loop"], OP_LOOP_MERGE) > 0,
            "{label}: no K loop found"
        );
    }
}

/// No kernel holds a non-finite float constant (`bitcast<f32>` of an all-ones exponent) or a
/// decimal literal beyond f32's range (3.4028235e38 rounds to f32's max, but is above it):
/// browsers' WGSL compilers reject both, which naga accepts, and one such constant fails every
/// entry point of its module there.
#[test]
fn no_kernel_has_a_constant_beyond_f32() {
    for k in Kernel::all() {
        let source = k.source();
        for (at, _) in source.match_indices("bitcast<f32>(0x") {
            let digits: String = source[at + "bitcast<f32>(0x".len()..]
                .chars()
                .take_while(|c| c.is_ascii_hexdigit())
                .collect();
            let value = u32::from_str_radix(&digits, 16).map(f32::from_bits);
            assert!(
                value.is_ok_and(f32::is_finite),
                "{}: bitcast<f32>(0x{digits}) is not a finite constant",
                k.label()
            );
        }
        for literal in decimal_float_literals(&source) {
            let value: f64 = literal.trim_end_matches(['f', 'h']).parse().unwrap();
            assert!(
                value.abs() <= f32::MAX as f64,
                "{}: {literal} is beyond f32's range",
                k.label()
            );
        }
    }
}

/// The decimal float literals of WGSL source (digits with a point or an exponent, and the
/// f or h suffix), comments included.
fn decimal_float_literals(source: &str) -> Vec<&str> {
    let bytes = source.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let point = bytes[i] == b'.' && bytes.get(i + 1).is_some_and(u8::is_ascii_digit);
        let starts = (bytes[i].is_ascii_digit() || point)
            && (i == 0
                || !matches!(bytes[i - 1], b'_' | b'.' | b'0'..=b'9' | b'a'..=b'z' | b'A'..=b'Z'));
        if !starts {
            i += 1;
            continue;
        }
        let start = i;
        if bytes[i] == b'0' && matches!(bytes.get(i + 1), Some(b'x' | b'X')) {
            // Hex: skipped whole.
            i += 2;
            while i < bytes.len() && (bytes[i].is_ascii_hexdigit() || bytes[i] == b'.') {
                i += 1;
            }
            continue;
        }
        let mut float = false;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if bytes.get(i) == Some(&b'.') {
            float = true;
            i += 1;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
        }
        if matches!(bytes.get(i), Some(b'e' | b'E')) {
            let sign = usize::from(matches!(bytes.get(i + 1), Some(b'+' | b'-')));
            if bytes.get(i + 1 + sign).is_some_and(u8::is_ascii_digit) {
                float = true;
                i += 1 + sign;
                while i < bytes.len() && bytes[i].is_ascii_digit() {
                    i += 1;
                }
            }
        }
        if matches!(bytes.get(i), Some(b'f' | b'h')) {
            i += 1;
        }
        if float {
            out.push(&source[start..i]);
        }
    }
    out
}

#[test]
fn float_literals_are_found_as_wgsl_writes_them() {
    let source = "let a = 3.4028235e38; let b = 1e-5f; x1.5 0x1p3 2.0h v2 7 .5 1e // 1.25";
    assert_eq!(
        decimal_float_literals(source),
        ["3.4028235e38", "1e-5f", "2.0h", ".5", "1.25"]
    );
}

/// Whether `k` runs on cooperative matrices.
fn is_coop(k: &Kernel) -> bool {
    k.uses_coop()
}

/// Every kernel translates to MSL and HLSL with the options wgpu's Metal and DX12 back ends
/// pass naga, with runtime checks and without, except the cooperative kernels to HLSL, which
/// naga cannot write: the capability that chooses cooperative matrices must refuse DX12.
#[test]
fn every_kernel_translates_for_metal_and_dx12() {
    use mantissa::Algorithm;
    use mantissa::backend::wgpu::shaders::{F16Read, MatmulVariant, Target, translate};
    let kernels = Kernel::all();
    let mut failures = Vec::new();
    let mut refused = 0;
    for k in &kernels {
        for target in [Target::Msl, Target::Hlsl] {
            for checked in [false, true] {
                let got = translate(k, target, checked);
                let what = format!(
                    "{} to {target} ({}, runtime checks {checked})",
                    k.label(),
                    target.version(k)
                );
                match got {
                    Err(e) if target == Target::Hlsl && is_coop(k) => {
                        // Refused by the validator with its location, never written.
                        assert!(e.contains("COOPERATIVE_MATRIX"), "{what}: {e}");
                        refused += 1;
                    }
                    Err(e) => failures.push(format!("{what}:\n{e}")),
                    Ok(_) if target == Target::Hlsl && is_coop(k) => failures.push(format!(
                        "{what}: written, but HLSL has no cooperative matrices"
                    )),
                    Ok(text) => assert!(text.contains(k.entry_point()), "{what}:\n{text}"),
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} translations fail:\n{}",
        failures.len(),
        4 * kernels.len(),
        failures.join("\n\n")
    );
    let coop = kernels.iter().filter(|k| is_coop(k)).count();
    assert!(
        coop > 0 && refused == 2 * coop,
        "{refused} refused, {coop} cooperative kernels"
    );

    // The bindings where wgpu's layouts put them: the SIMT matmul's uniform, a, b, c, scales
    // and partial sums (device.rs) in Metal buffer slots in order, the sizes of its runtime
    // arrays after them; on DX12 registers by kind, num_workgroups' constants after the
    // uniforms.
    let k = Kernel::Matmul(MatmulVariant::for_algorithm(
        &Algorithm::F32,
        F16Read::Native,
    ));
    let msl = translate(&k, Target::Msl, false).expect("MSL");
    for slot in 0..=6 {
        assert!(
            msl.contains(&format!("[[buffer({slot})]]")),
            "{slot}:\n{msl}"
        );
    }
    let hlsl = translate(&k, Target::Hlsl, false).expect("HLSL");
    for (name, register) in [
        ("params", "b0"),
        ("a_data", "t0"),
        ("b_data", "t1"),
        ("c_data", "u0"),
        ("scales", "t2"),
        ("partials", "u1"),
        ("_NagaConstants", "b1"),
    ] {
        let line = hlsl.lines().find(|l| {
            l.contains("register(")
                && l.split_whitespace()
                    .any(|w| w.trim_end_matches(':') == name)
        });
        assert!(
            line.is_some_and(|l| l.contains(&format!("register({register})"))),
            "{name} not at {register}:\n{hlsl}"
        );
    }
}

/// The capability that puts matmuls on cooperative matrices (`device::coop_choice`) takes them
/// where the back end's language has them (SPIR-V, MSL) and refuses them on DX12, whose HLSL
/// does not, for an adapter that otherwise qualifies: there every algorithm's kernel is the
/// SIMT one, which translates; on Vulkan and Metal the chosen kernels translate too.
#[test]
fn cooperative_matrices_only_where_their_kernels_translate() {
    use mantissa::Algorithm;
    use mantissa::backend::wgpu::device::{CoopProperties, NoCoop, coop_choice};
    use mantissa::backend::wgpu::shaders::{Coop, F16Read, MatmulVariant, Target, translate};
    use wgpu::{Backend, CooperativeMatrixProperties, CooperativeScalarType as S};
    let config = |t: u32, ab: S, cr: S| CooperativeMatrixProperties {
        m_size: t,
        n_size: t,
        k_size: t,
        ab_type: ab,
        cr_type: cr,
        saturating_accumulation: false,
    };
    // An NVIDIA GPU as Vulkan (and DX12's WaveLaneCountMin/Max) reports it: subgroups of 32,
    // 16x16x16 f16 -> f32 among its configurations.
    let nvidia = CoopProperties {
        subgroup_min_size: 32,
        subgroup_max_size: 32,
        shader_f16: true,
        configs: vec![config(16, S::F16, S::F16), config(16, S::F16, S::F32)],
    };
    // An Apple7+ GPU: wgpu-hal's Metal configurations (8x8x8 only), on its SIMD groups of 32.
    let apple = CoopProperties {
        subgroup_min_size: 32,
        subgroup_max_size: 32,
        shader_f16: true,
        configs: vec![
            config(8, S::F32, S::F32),
            config(8, S::F16, S::F16),
            config(8, S::F16, S::F32),
        ],
    };
    let nv = Coop {
        size: 16,
        subgroup: 32,
    };
    let ap = Coop {
        size: 8,
        subgroup: 32,
    };
    assert_eq!(coop_choice(Backend::Vulkan, &nvidia), Ok(nv));
    assert_eq!(coop_choice(Backend::Metal, &apple), Ok(ap));
    for backend in [Backend::Dx12, Backend::BrowserWebGpu, Backend::Gl] {
        for adapter in [&nvidia, &apple] {
            assert_eq!(coop_choice(backend, adapter), Err(NoCoop::Backend(backend)));
        }
    }
    let why = NoCoop::Backend(Backend::Dx12).to_string();
    assert!(why.contains("Dx12") && why.contains("HLSL"), "{why}");
    // The adapter's own reasons, on a back end that takes the kernels.
    let without = |f: &dyn Fn(&mut CoopProperties)| {
        let mut a = nvidia.clone();
        f(&mut a);
        coop_choice(Backend::Vulkan, &a)
    };
    assert_eq!(without(&|a| a.configs.clear()), Err(NoCoop::NotOffered));
    assert_eq!(without(&|a| a.shader_f16 = false), Err(NoCoop::NoShaderF16));
    assert_eq!(
        without(&|a| a.configs.truncate(1)),
        Err(NoCoop::NoSquareF16)
    );
    // wgpu 30's Metal adapters report subgroup sizes 4 to 64 (metal/mod.rs, `expose`),
    // which no fixed-size workgroup of one subgroup can assume: refused, and said so.
    let metal_as_reported = CoopProperties {
        subgroup_min_size: 4,
        subgroup_max_size: 64,
        ..apple.clone()
    };
    assert_eq!(
        coop_choice(Backend::Metal, &metal_as_reported),
        Err(NoCoop::SubgroupSize)
    );

    // Each back end's chosen kernels, in its language: cooperative for the f16 and bf16
    // algorithms on Vulkan and Metal, SIMT for everything on DX12.
    for (backend, adapter, target) in [
        (Backend::Vulkan, &nvidia, None),
        (Backend::Metal, &apple, Some(Target::Msl)),
        (Backend::Dx12, &nvidia, Some(Target::Hlsl)),
    ] {
        let coop = coop_choice(backend, adapter).ok();
        for alg in [Algorithm::F16, Algorithm::Bf16x3, Algorithm::F32] {
            let v = MatmulVariant::chosen(&alg, coop, F16Read::Native);
            let on_coop = alg != Algorithm::F32 && backend != Backend::Dx12;
            assert_eq!(v.coop.is_some(), on_coop, "{backend:?} {alg}");
            let k = Kernel::Matmul(v);
            let got = match target {
                None => validate(&k),
                Some(t) => translate(&k, t, false).map(|_| ()),
            };
            if let Err(e) = got {
                panic!(
                    "{backend:?} chose {}, which does not translate:\n{e}",
                    k.label()
                );
            }
        }
    }
}
