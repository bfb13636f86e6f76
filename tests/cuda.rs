//! The CUDA kernels, compiled by NVRTC: PTX for Hopper, a cubin for a drawn one of the
//! architectures the backend supports (every one with MANTISSA_TEST_EXHAUSTIVE=1). NVRTC is a
//! compiler library and needs no GPU, so a broken `.cu` file fails here on any machine that has
//! it (CI installs it: scripts/setup.sh); elsewhere the test says why it is skipped. The
//! backend itself is checked by the conformance suite where a CUDA device exists.

#![cfg(feature = "cuda")]

use mantissa::backend::cuda::{self, Module, Target};
use mantissa::backend::sources::Sources;

/// Ampere, Ada and Hopper; the PTX of the newest also runs on later GPUs.
const ARCHITECTURES: [(i32, i32); 4] = [(8, 0), (8, 6), (8, 9), (9, 0)];

#[test]
fn every_cuda_kernel_compiles_with_nvrtc() {
    if !cuda::nvrtc_present() {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("CI installs NVRTC (scripts/setup.sh), but libnvrtc.so does not load");
        }
        eprintln!("SKIPPED every_cuda_kernel_compiles_with_nvrtc: libnvrtc.so not found");
        return;
    }
    // Each module's PTX for Hopper (NVRTC's front end: it says which kernels there are) and its
    // cubin (the front end and ptxas: what the backend loads) for one architecture drawn by the
    // seed, the modules compiled on threads (each compile takes seconds; every architecture's
    // cubin with MANTISSA_TEST_EXHAUSTIVE=1).
    let seed = common::seed("every_cuda_kernel_compiles_with_nvrtc");
    let hopper = ARCHITECTURES[ARCHITECTURES.len() - 1];
    let cubins = common::sample(&ARCHITECTURES, 1, seed);
    std::thread::scope(|s| {
        for module in Module::ALL {
            let cubins = &cubins;
            s.spawn(move || {
                let compile = |cc: (i32, i32), target| {
                    cuda::compile(module, cc, target).unwrap_or_else(|e| {
                        panic!("{module:?}: {target:?} for sm_{}{}: {e}", cc.0, cc.1)
                    })
                };
                for &cc in cubins {
                    assert!(!compile(cc, Target::Cubin).is_empty());
                }
                let ptx = String::from_utf8(compile(hopper, Target::Ptx)).unwrap();
                // MANTISSA_PTX_DIR=dir keeps the PTX (to read it, or to run ptxas on it).
                if let Ok(dir) = std::env::var("MANTISSA_PTX_DIR") {
                    let name = format!("{module:?}_sm{}{}.ptx", hopper.0, hopper.1)
                        .replace([' ', '{', '}', ':'], "");
                    std::fs::write(std::path::Path::new(&dir).join(name), &ptx).unwrap();
                }
                assert!(
                    ptx.matches(".entry").count() > 0,
                    "{module:?} for sm_{}{}: no kernels in the PTX",
                    hopper.0,
                    hopper.1
                );
            });
        }
    });
}

/// Compiled cubins are cached on disk under a name that says the module and architecture and a
/// hash of what shapes the binary: every module and architecture gets its own file.
#[test]
fn cubin_cache_paths_are_distinct_per_module_and_architecture() {
    if !cuda::nvrtc_present() {
        eprintln!("SKIPPED cubin cache paths: libnvrtc.so not found");
        return;
    }
    let mut seen = std::collections::HashSet::new();
    for cc in ARCHITECTURES {
        for module in Module::ALL {
            let Some(path) = cuda::cubin_cache_path(module, Sources::Builtin, cc) else {
                eprintln!("SKIPPED cubin cache paths: no cache directory (HOME unset)");
                return;
            };
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            assert!(
                name.contains(&format!("sm{}{}", cc.0, cc.1)) && name.ends_with(".cubin"),
                "{name}"
            );
            assert!(
                name.starts_with(module.file().trim_end_matches(".cu")),
                "{name}"
            );
            assert!(seen.insert(path), "{name} twice");
        }
    }
}

// The elementwise kernels run on the host (tests/cuda_host/harness.cpp compiles cast.cu and
// scale.cu as C++ with CUDA's built-ins defined), against the host reference: the CUDA port of
// the formats is checked bit for bit on every machine with a C++ compiler.

mod common;

use mantissa::format::{self, Format, Overflow};
use mantissa::measure;
use mantissa::measure::train_tolerance as tol;
use mantissa::plan::{MaskKind, ScoreMask, ScoreScale, Unary};

/// The ids the unary family's kernels take for GELU and SiLU (`Unary::id`).
const GELU: usize = Unary::Gelu as usize;
const SILU: usize = Unary::Silu as usize;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

fn harness() -> Option<&'static PathBuf> {
    static H: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = H.get_or_init(|| {
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda_host_harness");
        let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cuda_host/harness.cpp");
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        // The definitions the loader puts before every module, generated as NVRTC gets them.
        let defs = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mantissa_defs.cuh");
        std::fs::write(&defs, mantissa::backend::defs::cuda())
            .map_err(|e| format!("cannot write {}: {e}", defs.display()))?;
        let status = Command::new(&compiler)
            // No contraction (NVRTC runs with --fmad=false; attention.cu, with it on, is
            // checked within tolerances); the split kernel reads pairs of u16 through u32
            // pointers, as CUDA allows.
            .args([
                "-std=c++17",
                "-O2",
                "-ffp-contract=off",
                "-fno-strict-aliasing",
                "-include",
            ])
            .arg(&defs)
            .arg("-o")
            .arg(&out)
            .arg(src)
            .status()
            .map_err(|e| format!("no C++ compiler ({compiler}: {e})"))?;
        // A compiler that runs and fails is an error in the kernels or the harness, not an
        // absent tool: it fails the tests everywhere rather than skipping them.
        assert!(status.success(), "{compiler} failed on {src}");
        Ok(out)
    });
    match built {
        Ok(path) => Some(path),
        Err(why) => {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("CI needs a C++ compiler for the CUDA host harness: {why}");
            }
            eprintln!("SKIPPED CUDA kernels on the host: {why}");
            None
        }
    }
}

/// Runs `kernel` of cuda/ on the host over `input`.
fn run(harness: &PathBuf, kernel: &str, args: &[String], input: &[u32]) -> Vec<u32> {
    let mut child = Command::new(harness)
        .arg(kernel)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("harness starts");
    let mut stdin = child.stdin.take().unwrap();
    let bytes: Vec<u8> = input.iter().flat_map(|v| v.to_le_bytes()).collect();
    let writer = std::thread::spawn(move || stdin.write_all(&bytes).unwrap());
    let output = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(output.status.success(), "harness {kernel} {args:?} failed");
    output
        .stdout
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn format_id(f: Format) -> String {
    f.id().to_string()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn cuda_cast_kernels_match_the_host_reference() {
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_cast_kernels_match_the_host_reference");
    let mut values = measure::boundary_values();
    values.extend(measure::random_bits(20_000, seed));
    values.extend(measure::wide_range(5_000, seed + 1));
    values.extend(measure::normal(5_000, seed + 2));
    // NaNs whose payload lies in the bits bf16 drops (rounding them as numbers gives inf).
    values.extend([0x7f80_0001u32, 0xff80_0001, 0x7f80_7fff, 0x7f80_8000].map(f32::from_bits));
    let input = bits(&values);
    for f in Format::ALL {
        for overflow in [Overflow::Standard, Overflow::Saturate] {
            let sat = u32::from(overflow == Overflow::Saturate).to_string();
            let got = run(h, "encode", &[format_id(f), sat], &input);
            for (x, g) in values.iter().zip(&got) {
                let want = f.encode(*x, overflow);
                assert!(
                    measure::same_code(f, *g, want),
                    "encode {f} {overflow:?} {x:e} ({:#010x}): {g:#x}, host {want:#x}",
                    x.to_bits()
                );
            }
        }
        let rounded = run(h, "round_to", &[format_id(f)], &input);
        for (x, g) in values.iter().zip(&rounded) {
            let want = f.round(*x, Overflow::Standard);
            let g = f32::from_bits(*g);
            assert!(
                g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                "round_to {f} {x:e}: {g:e}, host {want:e}"
            );
        }
        if f.storage_bits() <= 16 {
            let codes: Vec<u32> = (0..1u32 << f.storage_bits()).collect();
            let got = run(h, "decode", &[format_id(f)], &codes);
            for (c, g) in codes.iter().zip(&got) {
                let (g, want) = (f32::from_bits(*g), f.decode(*c));
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "decode {f} {c:#x}: {g:e}, host {want:e}"
                );
            }
        }
        if f.storage_bits() == 16 {
            let got = run(h, "encode_16", &[format_id(f)], &input);
            for (x, g) in values.iter().zip(&got) {
                let want = f.encode(*x, Overflow::Standard);
                assert!(measure::same_code(f, *g, want), "encode_16 {f} {x:e}");
            }
        }
    }
    let planes = run(h, "split_bf16", &[], &input);
    let n = values.len();
    for (e, x) in values.iter().enumerate() {
        let want = format::split_bf16(*x).map(|p| Format::Bf16.encode(p, Overflow::Standard));
        let got = [planes[e], planes[n + e], planes[2 * n + e]];
        for p in 0..3 {
            assert!(
                measure::same_code(Format::Bf16, got[p], want[p]),
                "split {x:e} ({:#010x}): part {p} {:#x}, host {:#x}",
                x.to_bits(),
                got[p],
                want[p]
            );
        }
    }
}

#[test]
fn cuda_fp8_scaling_kernels_match_the_host_reference() {
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_fp8_scaling_kernels_match_the_host_reference");
    // Batches of 2 matrices of 7 x 13 (row-major; the kernels read them one value at a time)
    // and of 8 x 12 (four at a time), with extremes and non-finite values.
    for (batch, rows, cols) in [(2usize, 7usize, 13usize), (2, 8, 12)] {
        let mut x = measure::wide_range(batch * rows * cols, seed);
        x[3] = f32::INFINITY;
        x[20] = f32::NAN;
        x[40] = 1e-42; // subnormal
        x[100] = -f32::MAX;
        for row in 8..10 {
            for c in 0..cols {
                x[row * cols + c] = if c == 5 { 1e-41 } else { 0.0 };
            }
        }
        let batch_len = (rows * cols) as u32;
        // (div, modulus, groups per batch, group of element e): per row, per column, per tensor.
        type Layout<'a> = (u32, u32, u32, Box<dyn Fn(usize) -> usize + 'a>);
        let layouts: [Layout<'_>; 3] = [
            (
                cols as u32,
                rows as u32,
                rows as u32,
                Box::new(|e| e / cols),
            ),
            (
                1,
                cols as u32,
                cols as u32,
                Box::new(move |e| (e / (rows * cols)) * cols + e % cols),
            ),
            (batch_len, 1, 1, Box::new(move |e| e / (rows * cols))),
        ];
        for (div, modulus, per_batch, group) in layouts {
            let groups = batch * per_batch as usize;
            let args = [batch_len, div, modulus, per_batch, groups as u32].map(|v| v.to_string());
            let amax = run(h, "amax", &args, &bits(&x));
            for (g, got) in amax.iter().enumerate() {
                let want = format::amax((0..x.len()).filter(|&e| group(e) == g).map(|e| x[e]));
                assert_eq!(
                    f32::from_bits(*got),
                    want,
                    "amax of group {g} ({div}, {modulus})"
                );
            }
            for f in [Format::E4m3, Format::E5m2] {
                let scales = run(h, "scale_from_amax", &[f.max().to_string()], &amax);
                let scales: Vec<f32> = scales.into_iter().map(f32::from_bits).collect();
                for (a, s) in amax.iter().zip(&scales) {
                    let want = format::scale_for_amax(f32::from_bits(*a), f);
                    assert_eq!(s.to_bits(), want.to_bits(), "scale of amax {a:#x} for {f}");
                }
                let mut input = bits(&x);
                input.extend(bits(&scales));
                let q = run(
                    h,
                    "quantize_to_f16",
                    &[
                        &format_id(f),
                        &args[0],
                        &args[1],
                        &args[2],
                        &args[3],
                        &args[4],
                    ]
                    .map(|s| s.to_string()),
                    &input,
                );
                for (e, v) in x.iter().enumerate() {
                    let got = Format::F16.decode(q[e]);
                    let want = format::quantize_scaled(*v, scales[group(e)], f);
                    assert!(
                        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                        "quantize {f} {v:e} * {}: {got:e}, host {want:e}",
                        scales[group(e)]
                    );
                }
                // The same values as fp8 bytes in cuBLASLt's layout (src/backend/cuda/fp8.rs), the
                // operand taken as A and as B, stored plain and transposed: each element at its
                // place (row i of A, column j of B contiguous in K), the padding zero.
                for (as_a, transposed) in
                    [(true, false), (true, true), (false, false), (false, true)]
                {
                    let (m_or_n, k) = if as_a == transposed {
                        (cols, rows)
                    } else {
                        (rows, cols)
                    };
                    let g = cuda::fp8::Fp8Gemm {
                        m: m_or_n,
                        n: m_or_n,
                        k,
                        padded_k: k.div_ceil(cuda::fp8::K_ALIGN) * cuda::fp8::K_ALIGN,
                        batch,
                        a: f,
                        b: f,
                    };
                    let p = if as_a {
                        g.a_placement(transposed)
                    } else {
                        g.b_placement(transposed)
                    };
                    assert_eq!((p.rows, p.cols), (rows, cols));
                    let len = batch * p.batch_stride;
                    let mut fp8_args = args.to_vec();
                    fp8_args.insert(0, format_id(f));
                    fp8_args.extend(strings(&[
                        rows,
                        cols,
                        p.batch_stride,
                        p.row_stride,
                        p.col_stride,
                        len,
                    ]));
                    let bytes = run(h, "quantize_to_fp8", &fp8_args, &input);
                    let mut placed = vec![false; len];
                    for e in 0..x.len() {
                        let (b, r, c) = (e / (rows * cols), e % (rows * cols) / cols, e % cols);
                        let at = b * p.batch_stride + r * p.row_stride + c * p.col_stride;
                        placed[at] = true;
                        let (got, want) = (f.decode(bytes[at]), Format::F16.decode(q[e]));
                        assert!(
                            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                            "fp8 byte of {f} {:e} (A {as_a}, transposed {transposed}): {got:e}, f16 path {want:e}",
                            x[e]
                        );
                    }
                    assert!(
                        placed.iter().zip(&bytes).all(|(&p, &b)| p || b == 0),
                        "padding of {f} (A {as_a}, transposed {transposed}) is not zero"
                    );
                }
            }
        }
    }
}

// The descaling of an fp8 product, acc / (sa * sb), stays finite wherever the quotient is: a
// product near f32's max with a tiny scale must not overflow on the way (it did on the H100
// when the kernel divided by one scale and then the other).
#[test]
fn cuda_unscale_is_the_quotient_by_both_scales() {
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_unscale_is_the_quotient_by_both_scales");
    let acc = measure::wide_range(600, seed);
    let amax = measure::wide_range(1200, seed ^ 0x5eed);
    let scale = |i: usize| format::scale_for_amax(amax[i].abs(), Format::E4m3);
    let mut triples: Vec<(f32, f32, f32)> = (0..600)
        .map(|i| (acc[i], scale(2 * i), scale(2 * i + 1)))
        .collect();
    triples.extend([
        (1.4e7, 448.0 / 1e38, 448.0 / 1e3), // the H100 case: the result is ~3e37
        (-2.5e5, 448.0 / 3e38, 448.0 / 3e38), // overflows for real: inf
        (3.0, 448.0 / 1e-30, 448.0 / 1e-12), // underflows to a subnormal, then to 0
        (0.0, 1e-30, 1e30),
        (f32::NAN, 1.0, 1.0),
        (f32::INFINITY, 2.0, 0.5),
    ]);
    let input: Vec<f32> = triples.iter().flat_map(|&(a, x, y)| [a, x, y]).collect();
    let got = run(h, "unscale", &[], &bits(&input));
    for (i, &(acc, sa, sb)) in triples.iter().enumerate() {
        let got = f32::from_bits(got[i]);
        let want = (acc as f64 / (sa as f64 * sb as f64)) as f32;
        if want.is_nan() || !want.is_finite() {
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{acc:e} / ({sa:e} * {sb:e}): {got:e}, want {want:e}"
            );
            continue;
        }
        // Two roundings (the mantissas' product, the quotient), exact exponent steps: within
        // 2 ulp, or 2 of the smallest subnormal where the result is subnormal.
        let ulp = (f32::from_bits(want.abs().to_bits() + 1) - want.abs()).max(f32::from_bits(1));
        assert!(
            ((got - want).abs() as f64) <= 2.0 * ulp as f64,
            "{acc:e} / ({sa:e} * {sb:e}): {got:e}, want {want:e}"
        );
    }
}

/// The descale of an fp8 product divides each element of C by its row's scale of A and its
/// column's of B (tensorwise: one of each per batch), as `unscale` does: the same bits, read
/// four at a time (rows of 8) and one at a time (rows of 7, and a buffer off its alignment).
#[test]
fn cuda_descale_divides_each_element_by_its_scales() {
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_descale_divides_each_element_by_its_scales");
    for (batch, rows, cols) in [(2usize, 5usize, 8usize), (3, 3, 7)] {
        let n = batch * rows * cols;
        let mut c = measure::wide_range(n, seed);
        c[1] = f32::INFINITY;
        c[6] = f32::NAN;
        for rowwise in [false, true] {
            let (a_groups, b_groups) = if rowwise { (rows, cols) } else { (1, 1) };
            let scale = |len: usize, s: u64| -> Vec<f32> {
                measure::wide_range(len, s)
                    .into_iter()
                    .map(|v| format::scale_for_amax(v.abs(), Format::E4m3))
                    .collect()
            };
            let (sa, sb) = (
                scale(batch * a_groups, seed + 1),
                scale(batch * b_groups, seed + 2),
            );
            let args = strings(&[n, rows, cols, a_groups, b_groups, sa.len()]);
            let got = run_f32(h, "descale", &args, &[&c, &sa, &sb]);
            let triples: Vec<f32> = (0..n)
                .flat_map(|e| {
                    let (t, i, j) = (e / (rows * cols), e / cols % rows, e % cols);
                    let i = if rowwise { i } else { 0 };
                    let j = if rowwise { j } else { 0 };
                    [c[e], sa[t * a_groups + i], sb[t * b_groups + j]]
                })
                .collect();
            let want = run(h, "unscale", &[], &bits(&triples));
            for e in 0..n {
                assert_eq!(
                    got[e].to_bits(),
                    want[e],
                    "{batch}x{rows}x{cols} rowwise {rowwise}, element {e}"
                );
            }
        }
    }
}

/// Runs a train.cu kernel on the host over the concatenation of `inputs`.
fn run_f32(h: &PathBuf, kernel: &str, args: &[String], inputs: &[&[f32]]) -> Vec<f32> {
    let input: Vec<u32> = inputs.iter().flat_map(|x| bits(x)).collect();
    run(h, kernel, args, &input)
        .into_iter()
        .map(f32::from_bits)
        .collect()
}

/// Checks that `codes` (one to a word) are the codes of the f32 values `held` in `format`.
fn same_codes(what: &str, codes: &[u32], held: &[f32], format: Format) {
    assert_eq!(codes.len(), held.len(), "{what}: lengths");
    for (i, (&code, &value)) in codes.iter().zip(held).enumerate() {
        let want = format.encode(value, mantissa::format::Overflow::Standard);
        assert!(
            code == want || (value.is_nan() && format.decode(code).is_nan()),
            "{what}: element {i} has code {code:#06x}, its held value {value:e} has {want:#06x}"
        );
    }
}

fn strings(values: &[usize]) -> Vec<String> {
    values.iter().map(|v| v.to_string()).collect()
}

fn id_bits(ids: &[u32]) -> Vec<f32> {
    ids.iter().map(|&i| f32::from_bits(i)).collect()
}

/// Values at the edges of the elementwise ops: NaN, infinities, signed zeros, f32 subnormals,
/// where exp(-x) overflows or underflows, and products that overflow or underflow.
fn elementwise_edges() -> Vec<f32> {
    vec![
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        1e-40,
        -1e-40,
        100.0,
        -100.0,
        88.8,
        -88.8,
        1e30,
        -1e30,
        1e-20,
        3.4e38,
    ]
}

/// The backward kernels that round their gradient dy as they read it (the norms', GELU's and
/// SiLU's: a plan folds the rounding of the matmul product into them) give the same bits as
/// the plain kernel on dy rounded first, dy over NaN, infinities, f16's overflow and
/// subnormals, rows not a multiple of a block; and the layer norm's backward summing a second
/// gradient into dx gives dx + r held in the format.
#[test]
fn cuda_backward_kernels_round_dy_as_they_read_it() {
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_backward_kernels_round_dy_as_they_read_it");
    let f32_ = Format::F32.id() as usize;
    let (rows, c) = (37, 150);
    let n = rows * c;
    let common::NormBackwardInputs {
        x,
        g,
        dy,
        stats,
        rstd,
    } = common::norm_backward_inputs(rows, c, seed);
    for format in [Format::Bf16, Format::F16] {
        let id = format.id() as usize;
        let rounded: Vec<f32> = dy
            .iter()
            .map(|&v| format.round(v, Overflow::Standard))
            .collect();
        // (kernel, its arguments rounding dy, plain, its inputs, with dy rounded first)
        type Case<'a> = (
            &'a str,
            Vec<usize>,
            Vec<usize>,
            Vec<&'a [f32]>,
            Vec<&'a [f32]>,
        );
        let cases: [Case; 4] = [
            (
                "layernorm_bwd",
                vec![rows, c, id, 0, f32_],
                vec![rows, c, f32_, 0, f32_],
                vec![&dy, &x, &g, &stats],
                vec![&rounded, &x, &g, &stats],
            ),
            (
                "rmsnorm_bwd",
                vec![rows, c, 1, id],
                vec![rows, c, 1, f32_],
                vec![&dy, &x, &g, &rstd],
                vec![&rounded, &x, &g, &rstd],
            ),
            (
                "unary_bwd",
                vec![GELU, n, f32_, f32_, id],
                vec![GELU, n, f32_, f32_, f32_],
                vec![&x, &dy],
                vec![&x, &rounded],
            ),
            (
                "unary_bwd",
                vec![SILU, n, f32_, f32_, id],
                vec![SILU, n, f32_, f32_, f32_],
                vec![&x, &dy],
                vec![&x, &rounded],
            ),
        ];
        for (kernel, folded, plain, inputs, inputs_rounded) in cases {
            let got = run_f32(h, kernel, &strings(&folded), &inputs);
            let want = run_f32(h, kernel, &strings(&plain), &inputs_rounded);
            common::same_or_nan(&format!("{kernel} rounding dy to {format}"), &got, &want);
        }
        // The layer norm's backward with a gradient summed into dx (the add after it folded
        // in): dx + r held in the format, dg and db as they were, bit for bit.
        let r = measure::normal(n, seed + 3);
        let plain = run_f32(
            h,
            "layernorm_bwd",
            &strings(&[rows, c, f32_, 0, f32_]),
            &[&dy, &x, &g, &stats],
        );
        let summed = run_f32(
            h,
            "layernorm_bwd",
            &strings(&[rows, c, f32_, 1, id]),
            &[&dy, &x, &g, &stats, &r],
        );
        let mut want = plain.clone();
        for (w, r) in want[..n].iter_mut().zip(&r) {
            *w = format.round(*w + r, Overflow::Standard);
        }
        common::same_or_nan(
            &format!("layernorm_bwd summing r in {format}"),
            &summed,
            &want,
        );
    }
}

/// The ops of users' models besides the GPT's (RMS norm, SiLU, the elementwise product, the
/// mean squared error) against `reference::ops`: RMS norm on rows wider and narrower than a
/// block, over more rows than a chunk of the column reduction, one value at a time and with
/// 16-byte accesses, on a row of zeros, a row holding NaN and one holding an infinity, held in
/// bf16 and stored as its codes; the elementwise ops over `elementwise_edges` too, SiLU also
/// reading its input as codes.
#[test]
fn cuda_model_ops_match_the_host_reference() {
    use mantissa::backend::reference::ops;
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_model_ops_match_the_host_reference");
    let f32_ = Format::F32.id() as usize;
    let (bf16, f16) = (Format::Bf16.id() as usize, Format::F16.id() as usize);
    let eps = 1e-6f32;
    for (rows, c) in [(37, 300), (300, 52), (5, 50)] {
        let mut x = measure::normal(rows * c, seed);
        x[c..2 * c].fill(0.0);
        let mut edges = x.clone();
        edges[2 * c + 3] = f32::NAN;
        edges[3 * c + 1] = f32::INFINITY;
        let g = measure::normal(c, seed + 1);
        let dy = measure::normal(rows * c, seed + 2);
        let n = rows * c;
        let fwd_args = |fmt: usize, coded: usize, width: usize| {
            let mut a = strings(&[rows, c]);
            a.push(eps.to_string());
            a.extend(strings(&[fmt, coded, width]));
            a
        };
        let widths: &[usize] = if c % 4 == 0 { &[1, 4] } else { &[1] };
        for &width in widths {
            let what = |name: &str| format!("rmsnorm {name}, {rows} rows of {c}, width {width}");
            for (values, edge) in [(&x, ""), (&edges, " with NaN and inf")] {
                let (y, rstd) = ops::rmsnorm_fwd(values, &g, c, eps);
                let out = run_f32(h, "rmsnorm_fwd", &fwd_args(f32_, 0, width), &[values, &g]);
                common::close_with_edges(&what(&format!("y{edge}")), &out[..n], &y, tol::ROW);
                common::close_with_edges(&what("rstd"), &out[n..], &rstd, tol::ROW);
                let args = strings(&[rows, c, width, f32_]);
                let out = run_f32(h, "rmsnorm_bwd", &args, &[&dy, values, &g, &rstd]);
                let (dx, dg) = ops::rmsnorm_bwd(&dy, values, &g, &rstd, c);
                let dx_what = what(&format!("dx{edge}"));
                common::close_with_edges(&dx_what, &out[..n], &dx, tol::REDUCTION);
                // A NaN row makes every column's dg NaN: compared on the finite rows.
                if edge.is_empty() {
                    common::close(&what("dg"), &out[n..], &dg, tol::REDUCTION);
                }
            }
        }
        // Held in bf16, and stored as its codes: the codes of the values held.
        let (y, _) = ops::rmsnorm_fwd(&x, &g, c, eps);
        let held = run_f32(h, "rmsnorm_fwd", &fwd_args(bf16, 0, 1), &[&x, &g]);
        common::held_close(
            "rmsnorm held in bf16",
            &held[..n],
            &y,
            Format::Bf16,
            tol::ROW,
        );
        let input: Vec<u32> = [&x, &g].iter().flat_map(|v| bits(v)).collect();
        let coded = run(h, "rmsnorm_fwd", &fwd_args(bf16, 1, 1), &input);
        same_codes(
            "rmsnorm as bf16 codes",
            &coded[..n],
            &held[..n],
            Format::Bf16,
        );
        assert_eq!(bits(&held[n..]), coded[n..], "rmsnorm rstd beside codes");
    }
    let mut x: Vec<f32> = measure::normal(1001, seed + 3)
        .iter()
        .map(|v| 4.0 * v)
        .collect();
    let finite = x.clone();
    x.extend(elementwise_edges());
    let dy = measure::normal(x.len(), seed + 4);
    let n = x.len();
    // Every function of the unary family, forward and backward, over the edges; held in f16,
    // stored as its codes, and reading its input as codes.
    for &f in Unary::ALL {
        let id_f = f.id() as usize;
        let y = run_f32(h, "unary_fwd", &strings(&[id_f, n, f32_, 0, f32_]), &[&x]);
        common::close_with_edges(f.name(), &y, &ops::unary_fwd(f, &x), tol::ROW);
        let dx = run_f32(
            h,
            "unary_bwd",
            &strings(&[id_f, n, f32_, f32_, f32_]),
            &[&x, &dy],
        );
        common::close_with_edges(
            f.backward_name(),
            &dx,
            &ops::unary_bwd(f, &x, &dy),
            tol::ROW,
        );
        let m = finite.len();
        let held = run_f32(
            h,
            "unary_fwd",
            &strings(&[id_f, m, f16, 0, f32_]),
            &[&finite],
        );
        let want = ops::unary_fwd(f, &finite);
        common::held_close(
            &format!("{f} held in f16"),
            &held,
            &want,
            Format::F16,
            tol::ROW,
        );
        let coded = run(
            h,
            "unary_fwd",
            &strings(&[id_f, m, f16, 1, f32_]),
            &bits(&finite),
        );
        same_codes(&format!("{f} as f16 codes"), &coded, &held, Format::F16);
        // Its input read as codes: the bits of the f32 values of those codes.
        for format in [Format::Bf16, Format::F16] {
            let codes: Vec<u32> = x
                .iter()
                .map(|&v| format.encode(v, Overflow::Standard))
                .collect();
            let values: Vec<f32> = codes.iter().map(|&c| format.decode(c)).collect();
            let id = format.id() as usize;
            let fwd = |x_fmt| strings(&[id_f, n, f32_, 0, x_fmt]);
            let plain = run_f32(h, "unary_fwd", &fwd(f32_), &[&values]);
            let from_codes = run(h, "unary_fwd", &fwd(id), &codes);
            let from_codes: Vec<f32> = from_codes.into_iter().map(f32::from_bits).collect();
            common::same_or_nan(&format!("{f} of {format} codes"), &from_codes, &plain);
            let with_dy: Vec<u32> = [codes.clone(), bits(&dy)].concat();
            let bwd = |x_fmt| strings(&[id_f, n, f32_, x_fmt, f32_]);
            let plain = run_f32(h, "unary_bwd", &bwd(f32_), &[&values, &dy]);
            let from_codes = run(h, "unary_bwd", &bwd(id), &with_dy);
            let from_codes: Vec<f32> = from_codes.into_iter().map(f32::from_bits).collect();
            let what = format!("{} of {format} codes", f.backward_name());
            common::same_or_nan(&what, &from_codes, &plain);
        }
    }
    // The product: f32's, bit for bit (the host multiplies as the kernel does); held in bf16
    // and stored as its codes.
    let mut a = measure::normal(1001, seed + 5);
    let mut b = measure::normal(1001, seed + 6);
    let edges = elementwise_edges();
    a.extend(&edges);
    b.extend(edges.iter().rev());
    let n = a.len();
    let product = run_f32(h, "elementwise_mul", &strings(&[n, f32_, 0]), &[&a, &b]);
    common::same_or_nan("product", &product, &ops::mul(&a, &b));
    let m = 1001;
    let held = run_f32(
        h,
        "elementwise_mul",
        &strings(&[m, bf16, 0]),
        &[&a[..m], &b[..m]],
    );
    let want = ops::mul(&a[..m], &b[..m]);
    common::held_close("product held in bf16", &held, &want, Format::Bf16, tol::ROW);
    let input: Vec<u32> = [&a[..m], &b[..m]].iter().flat_map(|v| bits(v)).collect();
    let coded = run(h, "elementwise_mul", &strings(&[m, bf16, 1]), &input);
    same_codes("product as bf16 codes", &coded, &held, Format::Bf16);
    // Dropout's masks, to the bit, at several steps, sites and seeds (plan::dropout).
    for (p, step, site, seed) in [
        (0.1f32, 1u32, 0u32, 7u64),
        (0.5, 9, 2, 1 << 40 | 5),
        (0.9, 123, 1, 3),
    ] {
        let [k0, k1] = mantissa::plan::dropout::key(seed);
        let args = [
            a.len().to_string(),
            p.to_string(),
            step.to_string(),
            site.to_string(),
            k0.to_string(),
            k1.to_string(),
            format_id(Format::F32),
        ];
        let got = run_f32(h, "dropout", &args, &[&a]);
        let want = mantissa::plan::dropout::apply(&a, (step, site, 0), [k0, k1], p);
        common::same_or_nan(&format!("dropout p {p} step {step}"), &got, &want);
        // Part 3 of a split batch: its elements counted from 3 n.
        let third = [&args[..], &["0".to_string(), "3".to_string()]].concat();
        let got = run_f32(h, "dropout", &third, &[&a]);
        let want = mantissa::plan::dropout::apply(&a, (step, site, 3), [k0, k1], p);
        common::same_or_nan(&format!("dropout p {p} step {step} part 3"), &got, &want);
        // Evaluating: the input itself.
        let evaluating = [&args[..], &["1".to_string()]].concat();
        let got = run_f32(h, "dropout", &evaluating, &[&a]);
        common::same_or_nan(&format!("dropout p {p} evaluating"), &got, &a);
    }
    // Rotary embeddings both ways at 300 positions (angles to 299 radians), 3 heads of 6.
    let (t, c, d) = (300, 18, 6);
    let x = measure::normal(2 * t * c, seed + 12);
    let table = mantissa::plan::rotary::table(t, d, 10000.0).unwrap();
    for inverse in [false, true] {
        let args = strings(&[2 * t, t, c, d, inverse as usize]);
        let args = [&args[..], &[format_id(Format::F32)]].concat();
        let got = run_f32(h, "rotary", &args, &[&x, &table]);
        let want = mantissa::plan::rotary::apply(&x, &table, (t, c, d), inverse);
        common::close(
            &format!("rotary (inverse {inverse})"),
            &got,
            &want,
            tol::ROW,
        );
    }
    // Row sums and means, rows shorter and longer than a block; their backward and a product
    // with a constant, to the bit, over the edges.
    for (rows, c) in [(37, 5), (3, 700)] {
        let x = measure::normal(rows * c, seed + 9);
        for divisor in [1.0f32, c as f32] {
            let args = [
                rows.to_string(),
                c.to_string(),
                divisor.to_string(),
                format_id(Format::F32),
            ];
            let got = run_f32(h, "row_sums", &args, &[&x]);
            let want = ops::row_sums(&x, c, divisor as f64);
            common::close(
                &format!("row sums of {rows} x {c} / {divisor}"),
                &got,
                &want,
                tol::REDUCTION,
            );
        }
    }
    for (c, scale, divisor) in [(7usize, 1.0f32, 1.0f32), (7, 1.0, 7.0), (1, -0.1, 1.0)] {
        let n = a.len() * c;
        let args = [
            n.to_string(),
            c.to_string(),
            scale.to_string(),
            divisor.to_string(),
            format_id(Format::F32),
        ];
        let got = run_f32(h, "broadcast", &args, &[&a]);
        let what = format!("broadcast x{c} * {scale} / {divisor}");
        common::same_or_nan(&what, &got, &ops::broadcast(&a, c, scale, divisor));
    }
    // The mean squared error and its gradient (the loss scale over the ranks 1024), over more
    // values than the mean's block; held in f32 and bf16.
    let (pred, target) = (
        measure::normal(1001, seed + 7),
        measure::normal(1001, seed + 8),
    );
    let dloss = 1024.0f32;
    let loss = ops::mse_fwd(&pred, &target);
    let want = ops::mse_bwd(&pred, &target, dloss as f64);
    for held in [Format::F32, Format::Bf16] {
        let args = [pred.len().to_string(), dloss.to_string(), format_id(held)];
        let out = run_f32(h, "mse_fwd", &args, &[&pred, &target]);
        let got = out[pred.len()] as f64;
        assert!(
            (got - loss).abs() <= tol::ROW as f64 * loss,
            "mean squared error {got} vs {loss}"
        );
        let what = format!("mean squared error's gradient held in {held}");
        common::held_close(&what, &out[..pred.len()], &want, held, tol::ROW);
    }
}

/// train.cu's kernels (block reductions included: the harness runs every thread of a block as
/// a coroutine) against `reference::ops`, with the tolerances of the conformance suite, on shapes
/// that are not multiples of the blocks, warps or chunks.
/// The embedding backward (a counting sort of the ids, then each id's rows summed in token
/// order in f64) is the definition to the bit: on skewed ids (every token one id, ids absent
/// from the batch, a table larger than the batch), more tokens than the sort has threads, rows
/// narrower and wider than the sum's warp, with 16-byte loads and without, and a NaN and an
/// infinity in dout.
#[test]
fn cuda_embedding_backward_is_the_definition_to_the_bit() {
    use mantissa::backend::reference::ops;
    let Some(h) = harness() else { return };
    let seed = 0xE3B;
    let cases: [(&str, usize, usize, Vec<u32>); 5] = [
        (
            "mixed ids",
            11,
            7,
            (0..29u32).map(|i| (i * 5 + 1) % 11).collect(),
        ),
        ("every token one id", 3, 8, vec![2; 600]),
        (
            "table larger than the batch",
            300,
            12,
            (0..40u32).map(|i| (i * 7) % 5 * 61).collect(),
        ),
        (
            "one id most tokens",
            65,
            200,
            (0..700u32)
                .map(|i| if i % 10 < 7 { 4 } else { i % 65 })
                .collect(),
        ),
        (
            "wide rows",
            5,
            260,
            (0..29u32).map(|i| (i * 3) % 4).collect(),
        ),
    ];
    for (k, (what, vocab, width, ids)) in cases.into_iter().enumerate() {
        let mut dout = measure::normal(ids.len() * width, seed + k as u64);
        if k == 0 {
            dout[3] = f32::NAN;
            dout[width + 3] = f32::INFINITY;
        }
        let want = ops::embedding_bwd(&dout, &ids, vocab, width);
        for lanes in [1, 4].into_iter().filter(|&w| width % w == 0) {
            let args = strings(&[vocab, width, ids.len(), lanes]);
            let got = run_f32(h, "embedding_bwd", &args, &[&dout, &id_bits(&ids)]);
            let differ = (0..want.len()).find(|&i| {
                got[i].to_bits() != want[i].to_bits() && !(got[i].is_nan() && want[i].is_nan())
            });
            assert!(
                differ.is_none(),
                "embedding backward, {what}, {lanes} columns a thread: element {differ:?} differs"
            );
        }
    }
}

#[test]
fn cuda_training_kernels_match_the_host_reference() {
    use mantissa::backend::reference::ops;
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_training_kernels_match_the_host_reference");
    let close = common::close;
    // Layer norm: rows wider than a block (300 > 128 threads) and narrower (50), and more rows
    // than a chunk of the column reductions (300 > 256).
    for (rows, c) in [(37, 300), (300, 50)] {
        let x = measure::normal(rows * c, seed);
        let (g, b) = (measure::normal(c, seed + 1), measure::normal(c, seed + 2));
        let dy = measure::normal(rows * c, seed + 3);
        let f32_ = Format::F32.id() as usize;
        let out = run_f32(
            h,
            "layernorm_fwd",
            &strings(&[rows, c, f32_, 0]),
            &[&x, &g, &b],
        );
        let (y, mean, rstd) = ops::layernorm_fwd(&x, &g, &b, c);
        let stats: Vec<f32> = mean.iter().zip(&rstd).flat_map(|(&m, &r)| [m, r]).collect();
        close("layernorm y", &out[..rows * c], &y, tol::ROW);
        close("layernorm stats", &out[rows * c..], &stats, tol::ROW);
        // Held in bf16 (a bf16-true step's norm): every value a bf16, the same within one.
        let bf16 = Format::Bf16.id() as usize;
        let held = run_f32(
            h,
            "layernorm_fwd",
            &strings(&[rows, c, bf16, 0]),
            &[&x, &g, &b],
        );
        common::held_close(
            "layernorm y held in bf16",
            &held[..rows * c],
            &y,
            Format::Bf16,
            tol::ROW,
        );
        // Stored as bf16 codes (a plan's coded tensor): the codes of the values held above.
        let input: Vec<u32> = [&x, &g, &b].iter().flat_map(|v| bits(v)).collect();
        let coded = run(h, "layernorm_fwd", &strings(&[rows, c, bf16, 1]), &input);
        same_codes(
            "layernorm y as bf16 codes",
            &coded[..rows * c],
            &held[..rows * c],
            Format::Bf16,
        );
        assert_eq!(
            bits(&held[rows * c..]),
            coded[rows * c..],
            "layernorm stats beside codes"
        );
        let out = run_f32(
            h,
            "layernorm_bwd",
            &strings(&[rows, c, f32_, 0, f32_]),
            &[&dy, &x, &g, &stats],
        );
        let (dx, dg, db) = ops::layernorm_bwd(&dy, &x, &g, &mean, &rstd, c);
        close("layernorm dx", &out[..rows * c], &dx, tol::REDUCTION);
        close(
            "layernorm dg",
            &out[rows * c..rows * c + c],
            &dg,
            tol::REDUCTION,
        );
        close("layernorm db", &out[rows * c + c..], &db, tol::REDUCTION);
        let sums = run_f32(h, "column_sums", &strings(&[rows, c, f32_, f32_]), &[&x]);
        close("column sums", &sums, &ops::column_sums(&x, c), tol::ROW);
        // A linear layer's bias gradient: x rounded to bf16 as it is read, the sums held in
        // bf16. Within one step of bf16 of the definition's (the f32 sums' order), and bf16.
        let b16 = Format::Bf16;
        let id = b16.id() as usize;
        let sums = run_f32(h, "column_sums", &strings(&[rows, c, id, id]), &[&x]);
        let mut xr = x.clone();
        ops::round_to(&mut xr, b16);
        let mut want = ops::column_sums(&xr, c);
        ops::round_to(&mut want, b16);
        let mut rounded = sums.clone();
        ops::round_to(&mut rounded, b16);
        assert_eq!(rounded, sums, "column sums held in bf16");
        close(
            "column sums of bf16 x, held in bf16",
            &sums,
            &want,
            2.0 * tol::ROW + 1.0 / 128.0,
        );
        // The split GEMMs' planes added in order: f32 sums in chunk order, to the bit.
        let chunks = rows.div_ceil(64);
        let planes = measure::normal(chunks * c, seed + 7);
        let got = run_f32(h, "sum_partials", &strings(&[chunks, c]), &[&planes]);
        let want: Vec<f32> = (0..c)
            .map(|j| (0..chunks).fold(0.0f32, |s, k| s + planes[k * c + j]))
            .collect();
        common::same_or_nan("sum_partials", &got, &want);
    }
    let x = measure::normal(1001, seed + 4);
    let dy = measure::normal(1001, seed + 5);
    let f32_ = Format::F32.id() as usize;
    close(
        "gelu",
        &run_f32(
            h,
            "unary_fwd",
            &strings(&[GELU, x.len(), f32_, 0, f32_]),
            &[&x],
        ),
        &ops::unary_fwd(Unary::Gelu, &x),
        tol::ROW,
    );
    let f16 = Format::F16.id() as usize;
    let held = run_f32(
        h,
        "unary_fwd",
        &strings(&[GELU, x.len(), f16, 0, f32_]),
        &[&x],
    );
    common::held_close(
        "gelu held in f16",
        &held,
        &ops::unary_fwd(Unary::Gelu, &x),
        Format::F16,
        tol::ROW,
    );
    let coded = run(
        h,
        "unary_fwd",
        &strings(&[GELU, x.len(), f16, 1, f32_]),
        &bits(&x),
    );
    same_codes("gelu as f16 codes", &coded, &held, Format::F16);
    let gelu_bwd = run_f32(
        h,
        "unary_bwd",
        &strings(&[GELU, x.len(), f32_, f32_, f32_]),
        &[&x, &dy],
    );
    close(
        "gelu bwd",
        &gelu_bwd,
        &ops::unary_bwd(Unary::Gelu, &x, &dy),
        tol::ROW,
    );
    // GELU reading its input as codes (a plan's coded pre-GELU activations): the bits it
    // gives for the f32 values of those codes, forward and backward, over NaN, infinities and
    // f16's overflow and subnormals too.
    for format in [Format::Bf16, Format::F16] {
        let mut inputs = x.clone();
        inputs.extend(measure::boundary_values());
        let codes: Vec<u32> = inputs
            .iter()
            .map(|&v| format.encode(v, mantissa::format::Overflow::Standard))
            .collect();
        // What the tensor stored as f32 holds: each value as its code decodes.
        let values: Vec<f32> = codes.iter().map(|&c| format.decode(c)).collect();
        let dy = measure::normal(values.len(), seed + 18);
        let (n, id) = (values.len(), format.id() as usize);
        // The same bits, NaN for NaN (the host's NaN may carry another payload).
        let same = |what: &str, got: &[u32], want: &[u32]| {
            let nan = |b: u32| f32::from_bits(b).is_nan();
            let bad = got
                .iter()
                .zip(want)
                .position(|(&g, &w)| g != w && !(nan(g) && nan(w)));
            if let Some(i) = bad {
                panic!(
                    "{what}, element {i} ({:e}): {:#x}, not {:#x}",
                    values[i], got[i], want[i]
                );
            }
        };
        let plain = run(
            h,
            "unary_fwd",
            &strings(&[GELU, n, f32_, 0, f32_]),
            &bits(&values),
        );
        let from_codes = run(h, "unary_fwd", &strings(&[GELU, n, f32_, 0, id]), &codes);
        same(&format!("gelu of {format} codes"), &from_codes, &plain);
        let dy_bits = bits(&dy);
        let with = |x: &[u32]| [x, &dy_bits[..]].concat();
        let plain = run(
            h,
            "unary_bwd",
            &strings(&[GELU, n, f32_, f32_, f32_]),
            &with(&bits(&values)),
        );
        let from_codes = run(
            h,
            "unary_bwd",
            &strings(&[GELU, n, f32_, id, f32_]),
            &with(&codes),
        );
        same(&format!("gelu bwd of {format} codes"), &from_codes, &plain);
    }
    // Softmax rows shorter and longer than a block; heads of t x t; the scaled scores held in
    // f32 and in bf16 (a power-of-two scale: the backward's two roundings are one).
    // Causal, and over every column.
    let cases = [
        (3, 13, 0.3, true),
        (1, 150, 0.3, true),
        (3, 13, 0.25, true),
        (3, 13, 0.3, false),
        (1, 150, 0.25, false),
    ];
    for (heads, t, scale, causal) in cases {
        let rows = heads * t;
        let s = measure::normal(rows * t, seed + 6);
        let dp = measure::normal(rows * t, seed + 7);
        for held in [Format::F32, Format::Bf16] {
            let k = ScoreScale { scale, held };
            let args = [
                rows.to_string(),
                t.to_string(),
                scale.to_string(),
                format_id(held),
                format_id(Format::F32),
                (causal as u32).to_string(),
            ];
            let p = run_f32(h, "softmax_fwd", &args, &[&s]);
            let want = ops::softmax_scaled_fwd(&s, t, k, causal);
            close(
                &format!("softmax, {held}, causal {causal}"),
                &p,
                &want,
                tol::ROW,
            );
            // A key mask per head (t rows of scores each): every third key masked, and a
            // head with every key masked (its rows 0 throughout).
            let mask: Vec<f32> = (0..heads * t)
                .map(|e| f32::from(e % 3 == 1 || e / t == 1))
                .collect();
            let layout = |kind, stride, period| ScoreMask {
                mask: 0,
                kind,
                block: t,
                stride,
                period,
            };
            let with_mask = |m: ScoreMask| {
                let mut a = args.to_vec();
                let kind = match m.kind {
                    MaskKind::Keys => 1,
                    MaskKind::Bias => 2,
                };
                a.extend([kind, m.block, m.stride, m.period].map(|v| v.to_string()));
                a
            };
            let keys = layout(MaskKind::Keys, 1, 1);
            let got = run_f32(h, "softmax_fwd", &with_mask(keys), &[&s, &mask]);
            let want = ops::softmax_scaled_masked_fwd(&s, t, k, causal, Some((&mask, keys)));
            close(
                &format!("masked softmax, {held}, causal {causal}"),
                &got,
                &want,
                tol::ROW,
            );
            // A bias per head (the second -inf throughout: its rows 0), and one for all.
            let shared: Vec<f32> = (0..t * t)
                .map(|e| match e % 5 {
                    2 => f32::NEG_INFINITY,
                    _ => -0.5 * (e / t).abs_diff(e % t) as f32,
                })
                .collect();
            let mut per_head = shared.repeat(heads);
            if heads > 1 {
                per_head[t * t..2 * t * t].fill(f32::NEG_INFINITY);
            }
            for (bias, stride) in [(&shared, 0), (&per_head, t)] {
                let m = layout(MaskKind::Bias, stride, t);
                let got = run_f32(h, "softmax_fwd", &with_mask(m), &[&s, bias]);
                let want = ops::softmax_scaled_masked_fwd(&s, t, k, causal, Some((bias, m)));
                close(
                    &format!("biased softmax, stride {stride}, {held}, causal {causal}"),
                    &got,
                    &want,
                    tol::ROW,
                );
            }
            let ds = run_f32(h, "softmax_bwd", &args, &[&p, &dp]);
            let want = ops::softmax_scaled_bwd(&p, &dp, t, k, causal);
            let what = format!("softmax bwd, causal {causal}, scores x {scale} held in {held}");
            match held {
                Format::F32 => close(&what, &ds, &want, tol::ROW),
                _ if scale == 0.25 => common::held_close(&what, &ds, &want, held, tol::ROW),
                _ => {}
            }
            // The scores and dp rounded to bf16 as they are read: the bits of the kernels
            // reading them rounded first.
            let round = |x: &[f32]| -> Vec<f32> {
                x.iter()
                    .map(|&v| Format::Bf16.round(v, Overflow::Standard))
                    .collect()
            };
            let mut folded = args.clone();
            folded[4] = format_id(Format::Bf16);
            let (rs, rdp) = (round(&s), round(&dp));
            let what = format!("softmax rounding its scores to bf16, {held}");
            let got = run_f32(h, "softmax_fwd", &folded, &[&s]);
            common::same_or_nan(&what, &got, &run_f32(h, "softmax_fwd", &args, &[&rs]));
            let what = format!("softmax bwd rounding dp to bf16, {held}");
            let got = run_f32(h, "softmax_bwd", &folded, &[&p, &dp]);
            common::same_or_nan(&what, &got, &run_f32(h, "softmax_bwd", &args, &[&p, &rdp]));
        }
    }
    let (rows, v) = (37, 76);
    let logits: Vec<f32> = measure::normal(rows * v, seed + 8)
        .iter()
        .map(|x| 3.0 * x)
        .collect();
    let targets: Vec<u32> = (0..rows as u32).map(|r| (r * 7 + 3) % v as u32).collect();
    let out = run_f32(
        h,
        "cross_entropy_fwd",
        &strings(&[rows, v]),
        &[&logits, &id_bits(&targets)],
    );
    let (loss, probs) = ops::cross_entropy_fwd(&logits, &targets, v);
    close("cross entropy probs", &out[..rows * v], &probs, tol::ROW);
    let got = out[rows * v] as f64;
    assert!(
        (got - loss).abs() <= tol::ROW as f64 * loss,
        "cross entropy {got} vs {loss}"
    );
    let dloss = 1024.0;
    let args = [
        rows.to_string(),
        v.to_string(),
        ((dloss / rows as f64) as f32).to_string(),
    ];
    close(
        "cross entropy bwd",
        &run_f32(h, "cross_entropy_bwd", &args, &[&probs, &id_bits(&targets)]),
        &ops::cross_entropy_bwd(&probs, &targets, v, dloss),
        tol::ROW,
    );
    // The step plan's fused loss and gradient: the bits of the two kernels it replaces, with
    // the gradient held in each format.
    let inputs = [&logits[..], &id_bits(&targets)];
    let kernel_probs = &out[..rows * v];
    let unfused = run_f32(
        h,
        "cross_entropy_bwd",
        &args,
        &[kernel_probs, &id_bits(&targets)],
    );
    for held in [Format::F32, Format::Bf16, Format::F16] {
        let fused_args = [args.to_vec(), vec![format_id(held)]].concat();
        let fused = run_f32(h, "cross_entropy_fwd", &fused_args, &inputs);
        let mut unfused = unfused.clone();
        ops::round_to(&mut unfused, held);
        let differ = (0..rows * v).find(|&i| fused[i].to_bits() != unfused[i].to_bits());
        assert!(
            differ.is_none(),
            "fused cross entropy, gradient held in {held}: element {differ:?} differs"
        );
        assert_eq!(
            fused[rows * v].to_bits(),
            out[rows * v].to_bits(),
            "fused mean loss"
        );
        // Stored as codes (a plan's coded gradient, read only by 16-bit matmuls): the codes of
        // the held values.
        if held != Format::F32 {
            let coded_args = [fused_args.to_vec(), vec!["1".into()]].concat();
            let words: Vec<u32> = inputs.iter().flat_map(|x| bits(x)).collect();
            let coded = run(h, "cross_entropy_fwd", &coded_args, &words);
            same_codes(
                &format!("fused cross entropy, gradient as {held} codes"),
                &coded[..rows * v],
                &unfused,
                held,
            );
        }
    }
    // Embeddings: a row narrower and one wider than a block.
    for (vocab, width) in [(11, 7), (5, 200)] {
        let table = measure::normal(vocab * width, seed + 9);
        let ids: Vec<u32> = (0..29u32).map(|i| (i * 5 + 1) % vocab as u32).collect();
        let args = strings(&[vocab, width, ids.len()]);
        assert_eq!(
            run_f32(h, "embedding_fwd", &args, &[&table, &id_bits(&ids)]),
            ops::embedding_fwd(&table, &ids, width),
            "embedding gather is exact"
        );
    }
    // Adds: a bias per row, and elementwise.
    let (y, bias) = (
        measure::normal(37 * 50, seed + 11),
        measure::normal(50, seed + 12),
    );
    // N C YFMT FMT CODED, no residual, no GELU, x read as it is.
    let add_x = |args: &[usize], x: &[f32], x_fmt: usize| {
        let args: Vec<usize> = (args.iter().copied())
            .chain([f32_, 0, 0, f32_, 0, x_fmt])
            .collect();
        run_f32(h, "add", &strings(&args), &[x, &y])
    };
    let add = |args: &[usize], x: &[f32]| add_x(args, x, f32_);
    let mut want = y.clone();
    ops::add_bias(&mut want, &bias);
    assert_eq!(add(&[y.len(), 50, f32_, f32_, 0], &bias), want);
    // Held in bf16: the f32 sum rounded, bit for bit; stored as codes into a tensor of its own
    // (a plan's coded bias add): the codes of those values.
    ops::round_to(&mut want, Format::Bf16);
    let (bf16, f16) = (Format::Bf16.id() as usize, Format::F16.id() as usize);
    assert_eq!(add(&[y.len(), 50, f32_, bf16, 0], &bias), want);
    let coded = add(&[y.len(), 50, f32_, bf16, 1], &bias);
    let codes: Vec<u32> = coded.iter().map(|c| c.to_bits()).collect();
    same_codes("add as bf16 codes", &codes, &want, Format::Bf16);
    // y rounded to f16 as it is read (a matmul's product autocast holds), then held in bf16,
    // in place and as codes.
    let mut want = y.clone();
    ops::round_to(&mut want, Format::F16);
    ops::add_bias(&mut want, &bias);
    ops::round_to(&mut want, Format::Bf16);
    assert_eq!(add(&[y.len(), 50, f16, bf16, 0], &bias), want);
    let coded = add(&[y.len(), 50, f16, bf16, 1], &bias);
    let codes: Vec<u32> = coded.iter().map(|c| c.to_bits()).collect();
    same_codes("f16(y) + bias as bf16 codes", &codes, &want, Format::Bf16);
    // A linear layer's bias add: the bias rounded to bf16 as it is read, added to the f32
    // product, the sum rounded once (in place and as codes).
    let mut bias16 = bias.clone();
    ops::round_to(&mut bias16, Format::Bf16);
    let mut want = y.clone();
    ops::add_bias(&mut want, &bias16);
    ops::round_to(&mut want, Format::Bf16);
    assert_eq!(add_x(&[y.len(), 50, f32_, bf16, 0], &bias, bf16), want);
    let coded = add_x(&[y.len(), 50, f32_, bf16, 1], &bias, bf16);
    let codes: Vec<u32> = coded.iter().map(|c| c.to_bits()).collect();
    same_codes("y + bf16(bias) as bf16 codes", &codes, &want, Format::Bf16);
    let x = measure::normal(y.len(), seed + 17);
    let mut want = y.clone();
    want.iter_mut().zip(&x).for_each(|(a, b)| *a += b);
    assert_eq!(add(&[y.len(), y.len(), f32_, f32_, 0], &x), want);
    // A residual after the bias (one op for a block's projection bias and its residual
    // connection): held(held(y + bias, bf16) + r, f16), in place and as codes.
    let r = measure::normal(y.len(), seed + 18);
    let mut want = y.clone();
    ops::add_bias(&mut want, &bias);
    ops::round_to(&mut want, Format::Bf16);
    want.iter_mut().zip(&r).for_each(|(a, b)| *a += b);
    ops::round_to(&mut want, Format::F16);
    let with_r = |coded: usize| {
        let args = [y.len(), 50, f32_, bf16, coded, f16, 1, 0, f32_, 0, f32_];
        run_f32(h, "add", &strings(&args), &[&bias, &y, &r])
    };
    assert_eq!(with_r(0), want);
    let codes: Vec<u32> = with_r(1).iter().map(|c| c.to_bits()).collect();
    same_codes(
        "y + bias + residual as f16 codes",
        &codes,
        &want,
        Format::F16,
    );
    // A bias add and the GELU after it, one launch: the add's output as without the GELU,
    // and the GELU's exactly as gelu_fwd computes it from that output as stored (codes where
    // coded), on an odd length with NaN, infinities, values past f16's range and subnormals.
    let (n, c) = (91, 13);
    let mut y = measure::normal(n, seed + 19);
    y[..6].copy_from_slice(&[
        f32::NAN,
        f32::INFINITY,
        -f32::INFINITY,
        7.0e4,
        -9.0e4,
        1.0e-41,
    ]);
    let bias = measure::normal(c, seed + 20);
    for (coded, fmt, g_fmt, g_coded) in [
        (0, f32_, f32_, 0),
        (0, bf16, f16, 1),
        (1, bf16, bf16, 1),
        (1, f16, f32_, 0),
    ] {
        let args =
            |has_g: usize| strings(&[n, c, f32_, fmt, coded, f32_, 0, has_g, g_fmt, g_coded, f32_]);
        let input = [bits(&bias), bits(&y)].concat();
        let fused = run(h, "add", &args(1), &input);
        let sum = run(h, "add", &args(0), &input);
        assert_eq!(fused[..n], sum[..], "the add's own output, GELU or not");
        let x_fmt = if coded == 1 { fmt } else { f32_ };
        let gelu = run(
            h,
            "unary_fwd",
            &strings(&[GELU, n, g_fmt, g_coded, x_fmt]),
            &sum,
        );
        assert_eq!(
            fused[n..],
            gelu[..],
            "a bias add's GELU (coded {coded}, held {fmt}, GELU in {g_fmt}, coded {g_coded})"
        );
    }
    // The head permutations.
    let (b, t, heads, d) = (2, 5, 3, 4);
    let qkv = measure::normal(b * t * 3 * heads * d, seed + 13);
    let split = mantissa::plan::Strided::split_head(1, b, t, heads, d);
    let mut want = vec![0.0; split.len()];
    split.apply(&qkv, &mut want);
    let copy_args = |format: Format| -> Vec<String> {
        let mut args: Vec<u32> = [split.dims, split.src, split.dst].concat();
        args.extend([split.src_offset, split.dst_offset, split.len() as u32]);
        args.push(format.id());
        args.iter().map(|v| v.to_string()).collect()
    };
    assert_eq!(
        run_f32(h, "strided_copy", &copy_args(Format::F32), &[&qkv]),
        want
    );
    // Rounding as it copies (the rounding of the matmul product it copies, folded in).
    let held: Vec<f32> = want
        .iter()
        .map(|&v| Format::Bf16.round(v, Overflow::Standard))
        .collect();
    let got = run_f32(h, "strided_copy", &copy_args(Format::Bf16), &[&qkv]);
    common::same_or_nan("strided copy rounding to bf16", &got, &held);
    // GradScaler's unscale, one launch over many gradients (one of several blocks, one of
    // more than the most blocks a tensor takes): exact; each one's flag for inf, NaN and an
    // injected fault; each one's norm.
    let lens = [3001, 1, 70_000, 5, 1024, 300_001];
    let count = lens.len();
    let grads: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| measure::normal(n, seed + 14 + i as u64))
        .collect();
    let inverse = (1.0f32 / 1024.0).to_string();
    let unscale = |grads: &[Vec<f32>], poison: &str| {
        let mut args = vec![inverse.clone(), poison.to_string()];
        args.extend(lens.iter().map(|n| n.to_string()));
        let inputs: Vec<&[f32]> = grads.iter().map(|g| g.as_slice()).collect();
        run_f32(h, "unscale", &args, &inputs)
    };
    let total: usize = lens.iter().sum();
    let out = unscale(&grads, "0");
    let mut at = 0;
    for (i, g) in grads.iter().enumerate() {
        let mut want = g.clone();
        assert!(ops::unscale_check(&mut want, 1.0 / 1024.0));
        let n = want.len();
        assert!(
            common::same_bits(&out[at..at + n], &want),
            "unscaling gradient {i} is one exact multiplication"
        );
        at += n;
        assert_eq!(out[total + i], 0.0, "finite gradient {i} flagged");
        let norm: f64 = want.iter().map(|&x| x as f64 * x as f64).sum();
        let got = out[total + count + i] as f64;
        assert!(
            (got - norm).abs() <= tol::ROW as f64 * norm,
            "squared norm of gradient {i}: {got} vs {norm}"
        );
    }
    for (hit, at, bad) in [
        (2, 1234, f32::INFINITY),
        (5, 300_000, f32::NAN),
        (1, 0, f32::NAN),
    ] {
        let mut grads = grads.clone();
        grads[hit][at] = bad;
        let out = unscale(&grads, "0");
        let flags: Vec<f32> = out[total..total + count].to_vec();
        let want: Vec<f32> = (0..count).map(|i| (i == hit) as u8 as f32).collect();
        assert_eq!(
            flags, want,
            "{bad} at {at} of gradient {hit} flagged, alone"
        );
    }
    let flags = unscale(&grads, "inf")[total..total + count].to_vec();
    let want: Vec<f32> = (0..count).map(|i| (i == 0) as u8 as f32).collect();
    assert_eq!(flags, want, "fault injected into gradient 0");
    // AdamW, one launch over parameters (one whose four tensors are 16-byte aligned and span
    // three blocks, others not, one of a single value): the update, the clip, and the skip on
    // a flagged gradient; the state held in f32, and in bf16 and f16 as it is written.
    let opt = mantissa::plan::AdamW::default();
    let lens = [8196, 1001, 1, 6];
    let t = 3;
    let mut scalars = [0f32; 11];
    scalars[mantissa::plan::scalar::LR] = opt.lr;
    scalars[mantissa::plan::scalar::BETA1] = opt.beta1;
    scalars[mantissa::plan::scalar::BETA2] = opt.beta2;
    scalars[mantissa::plan::scalar::EPS] = opt.eps;
    scalars[mantissa::plan::scalar::WEIGHT_DECAY] = opt.weight_decay;
    scalars[mantissa::plan::scalar::BIAS_CORRECTION1] = (1.0 - (opt.beta1 as f64).powi(t)) as f32;
    scalars[mantissa::plan::scalar::BIAS_CORRECTION2] = (1.0 - (opt.beta2 as f64).powi(t)) as f32;
    let params: Vec<[Vec<f32>; 4]> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let seed = seed + 30 + 2 * i as u64;
            [
                measure::normal(n, seed),
                measure::normal(n, seed + 1),
                vec![0.01f32; n],
                vec![0.001f32; n],
            ]
        })
        .collect();
    // Two gradients in the stats (this one and another), squared norms 16 and 9: norm 5.
    let stats = [0.0, 0.0, 0.0, 16.0, 9.0];
    let f32_ = Format::F32;
    for (clip, flag, held) in [
        (0.0, 0.0, f32_),
        (2.5, 0.0, f32_),
        (0.0, 1.0, f32_),
        (0.0, 0.0, Format::Bf16),
        (2.5, 0.0, Format::F16),
    ] {
        scalars[mantissa::plan::scalar::CLIP] = clip;
        let mut st = stats;
        st[2] = flag;
        let decay = |i: usize| i.is_multiple_of(2);
        let mut args = vec!["2".to_string(), format_id(held)];
        for (i, n) in lens.iter().enumerate() {
            args.extend([n.to_string(), (decay(i) as u8).to_string()]);
        }
        let mut inputs: Vec<&[f32]> = params.iter().flatten().map(|x| x.as_slice()).collect();
        inputs.extend([&st[..], &scalars[..]]);
        let out = run_f32(h, "adamw", &args, &inputs);
        let mut at = 0;
        for (i, [p, g, m, v]) in params.iter().enumerate() {
            let (mut wp, mut wm, mut wv) = (p.clone(), m.clone(), v.clone());
            if flag == 0.0 {
                let factor = if clip > 0.0 { clip / 5.0 } else { 1.0 };
                let g: Vec<f32> = g.iter().map(|x| x * factor).collect();
                ops::adamw(&opt, &mut wp, &g, &mut wm, &mut wv, t as u32, decay(i));
            }
            let n = p.len();
            let what = format!("adamw of {i}, clip {clip} flag {flag} held in {held}");
            for (j, (name, want)) in [("p", &wp), ("m", &wm), ("v", &wv)].into_iter().enumerate() {
                let got = &out[at + j * n..at + (j + 1) * n];
                let what = format!("{what} {name}");
                if held == f32_ {
                    close(&what, got, want, tol::ARITHMETIC);
                } else {
                    common::held_close(&what, got, want, held, tol::ARITHMETIC);
                }
            }
            at += 3 * n;
        }
    }
}

/// The split matmuls' host cases: `first` with rows of A holding inf, NaN, an f32 subnormal
/// and a finite value whose bf16 rounding overflows, and a column of B holding -inf (the
/// split's rules for them), 2 x 33x20x40 with both operands transposed, and 17x70x90 with B
/// transposed; wide-range A, N(0,1) B.
fn split_cases(
    first: mantissa::algorithm::MatmulShape,
    seed: u64,
) -> Vec<(mantissa::algorithm::MatmulShape, Vec<f32>, Vec<f32>)> {
    let mut transposed = mantissa::algorithm::MatmulShape::new(33, 20, 40);
    transposed.batch = 2;
    transposed.a_transposed = true;
    transposed.b_transposed = true;
    let mut b_transposed = mantissa::algorithm::MatmulShape::new(17, 70, 90);
    b_transposed.b_transposed = true;
    [first, transposed, b_transposed]
        .into_iter()
        .enumerate()
        .map(|(s, shape)| {
            let seed = seed + 10 * s as u64;
            let mut a = measure::wide_range(shape.a_len(), seed);
            let mut b = measure::normal(shape.b_len(), seed + 1);
            if s == 0 {
                a[3 * shape.k + 5] = f32::INFINITY;
                a[7 * shape.k] = f32::NAN;
                a[11 * shape.k + 2] = 1e-40;
                a[13 * shape.k + 1] = -3.4e38;
                b[17 * shape.n + 4] = f32::NEG_INFINITY;
            }
            (shape, a, b)
        })
        .collect()
}

/// The fused split-bf16 tensor-core kernel, whole, on the host: the harness emulates the warp's
/// `mma.sync.m16n8k16` with the PTX ISA's fragment layouts, so the tiling, the split on the tile
/// load, the per-level accumulators, the promotion every 256 of K, the strides of transposed and
/// batched operands and the edge tiles are checked against the host reference's contract.
#[test]
fn cuda_split_kernel_meets_the_contract_on_the_host() {
    use mantissa::algorithm::{Algorithm, MatmulShape};
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_split_kernel_meets_the_contract_on_the_host");
    // K = 300 crosses a promotion (256); 70 x 45 leaves partial tiles.
    for (shape, a, b) in split_cases(MatmulShape::new(70, 45, 300), seed) {
        let shape = &shape;
        for (alg, levels) in [
            (Algorithm::Bf16x3, 2),
            (Algorithm::Bf16x6, 3),
            (Algorithm::Bf16x9, 5),
        ] {
            let args = [
                levels,
                shape.m,
                shape.n,
                shape.k,
                shape.batch,
                shape.a_transposed as usize,
                shape.b_transposed as usize,
            ];
            let got = run_f32(h, "split_matmul", &strings(&args), &[&a, &b]);
            common::assert_contract(
                "cuda split kernel (host)",
                &alg,
                shape,
                &a,
                &b,
                &got,
                "wide range",
            );
        }
    }
}

/// The split planes of both operands of `shape` as the real `split_planes` kernel writes them
/// on the host, in one launch, with the layout the backend passes (`SplitLayout::plane_maps`),
/// as the values of their bf16 codes.
fn host_planes(
    h: &PathBuf,
    layout: &mantissa::backend::cuda::split::SplitLayout,
    shape: &mantissa::algorithm::MatmulShape,
    a: &[f32],
    b: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let (a_len, b_len) = layout.plane_lens(shape).unwrap();
    let mut args = strings(&[shape.batch, a_len, b_len]);
    for map in layout.plane_maps(shape) {
        args.extend(strings(&[map.rows, map.cols]));
        args.extend(map.source.iter().chain(&map.out).map(|v| v.to_string()));
        args.extend(map.slots.iter().map(|v| v.to_string()));
    }
    let codes = run(h, "split_planes", &args, &[bits(a), bits(b)].concat());
    let values: Vec<f32> = codes.iter().map(|&c| Format::Bf16.decode(c)).collect();
    (values[..a_len].to_vec(), values[a_len..].to_vec())
}

/// f64 `s` as f32, rounded toward zero (overflow gives the largest finite value).
fn toward_zero(s: f64) -> f32 {
    let f = s as f32;
    if f.is_nan() || (f as f64).abs() <= s.abs() {
        return f;
    }
    if f.is_infinite() {
        return f32::MAX.copysign(f);
    }
    f32::from_bits(f.to_bits() - 1)
}

/// A tensor core's sum of products of bf16 values, as modelled here: the products exact, added
/// 16 at a time (one mma k-step) to an f32 accumulator, the result truncated (rounded toward
/// zero). On an H200 cuBLAS's bf16 GEMMs erred by 6.3e-6 / 1.0e-5 (bf16x3 as two GEMMs) and
/// 2.1e-5 / 4.2e-5 (one K-tripled GEMM) at n = 4096 / 8192 on N(0,1) inputs; this model gives
/// 7.0e-6 / 1.2e-5 and 2.8e-5 / 5.5e-5: a little worse than the hardware, as a check should be.
fn tensor_core_sum(products: impl Iterator<Item = f64>) -> f32 {
    let mut acc = 0f32;
    let mut block = 0f64;
    for (i, p) in products.enumerate() {
        block += p;
        if i % 16 == 15 {
            acc = toward_zero(acc as f64 + block);
            block = 0.0;
        }
    }
    toward_zero(acc as f64 + block)
}

/// The steps of a split matmul (src/backend/cuda/split.rs) run on the host over planes `va`
/// and `vb`: each GEMM's sums as `tensor_core_sum`, beta adding in f32, the lower levels' add
/// and the ordered sums of partial planes in f32 as their kernels do.
fn run_split_steps(
    layout: &mantissa::backend::cuda::split::SplitLayout,
    shape: &mantissa::algorithm::MatmulShape,
    arrangement: mantissa::backend::cuda::split::Arrangement,
    va: &[f32],
    vb: &[f32],
) -> Vec<f32> {
    use mantissa::backend::cuda::split::{Out, Step};
    let plane = shape.c_len();
    let mut c = vec![f32::NAN; plane];
    let mut scratch = vec![f32::NAN; layout.scratch_len(shape, arrangement).unwrap()];
    for step in layout.steps(shape, arrangement).unwrap() {
        match step {
            Step::Gemm(call) => {
                let (a_end, b_end, out_end) = call.extents();
                let out = if call.out == Out::C {
                    &mut c
                } else {
                    &mut scratch
                };
                assert!(
                    a_end <= va.len() && b_end <= vb.len() && out_end <= out.len(),
                    "{call:?}"
                );
                for t in 0..call.batch {
                    for i in 0..call.m {
                        for j in 0..call.n {
                            let sum = tensor_core_sum((0..call.k).map(|p| {
                                let x = va[call.a_offset + t * call.a_stride + i * call.lda + p];
                                let y = vb[call.b_offset + t * call.b_stride + p * call.ldb + j];
                                x as f64 * y as f64
                            }));
                            let o = &mut out[call.c_offset + t * call.c_stride + i * call.n + j];
                            *o = if call.beta == 0.0 { sum } else { sum + *o };
                        }
                    }
                }
            }
            Step::AddLower => c.iter_mut().zip(&scratch).for_each(|(c, l)| *c += l),
            Step::Sum { count, into_c } => {
                for e in 0..plane {
                    let s = (0..count).fold(0f32, |s, p| s + scratch[p * plane + e]);
                    if into_c {
                        c[e] = s;
                    } else {
                        scratch[e] = s;
                    }
                }
            }
        }
    }
    c
}

/// Split-bf16 as cuBLAS bf16 GEMMs (src/backend/cuda/split.rs), on the host: the real
/// `split_planes` kernel lays both operands out in one launch (transposed and batched ones
/// included; every code checked against the host's split), and the backend's own steps run over
/// those planes here (`run_split_steps`), in every arrangement the tuner may choose for the
/// shape, and in partial sums over three planes (groups whose running sum goes on in plane 0).
/// The layout, the offsets, the strides, the promotion chunks and the summation order are
/// checked against the host reference's contract, and the partial sums give the per-level
/// GEMMs' bits; only cuBLAS itself is left to a GPU.
#[test]
fn cuda_split_gemms_meet_the_contract_on_the_host() {
    use mantissa::algorithm::{Algorithm, MatmulShape};
    use mantissa::backend::cuda::split::{Arrangement, H, H_FINITE, L, M, SplitLayout};
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_split_gemms_meet_the_contract_on_the_host");
    // K = 600 crosses two promotions (256), and its rows and B's (n = 24) split four at a
    // time; 257 leaves a last chunk of one. The transposed cases split one at a time.
    let mut cases = split_cases(MatmulShape::new(30, 24, 600), seed);
    let short = MatmulShape::new(6, 8, 257);
    cases.push((
        short,
        measure::normal(short.a_len(), seed + 7),
        measure::wide_range(short.b_len(), seed + 8),
    ));
    for (shape, a, b) in cases {
        let shape = &shape;
        for alg in [Algorithm::Bf16x3, Algorithm::Bf16x6, Algorithm::Bf16x9] {
            let layout = SplitLayout::of(&alg).unwrap();
            let (va, vb) = host_planes(h, &layout, shape, &a, &b);
            // Every plane holds the host's split of its element, h' zero where h is not finite.
            for ((x, planes, len), map) in [(&a, &va, shape.a_len()), (&b, &vb, shape.b_len())]
                .into_iter()
                .zip(layout.plane_maps(shape))
            {
                let per = map.rows * map.cols;
                for e in 0..len {
                    let (batch, r, c) = (e / per, e % per / map.cols, e % map.cols);
                    let value = x[(batch as i64 * map.source[0]
                        + r as i64 * map.source[1]
                        + c as i64 * map.source[2]) as usize];
                    let [h, m, l] = format::split_bf16(value);
                    let want = [h, if h.is_finite() { h } else { 0.0 }, m, l];
                    let at =
                        (batch as i64 * map.out[0] + r as i64 * map.out[1] + c as i64) as usize;
                    for plane in [H, H_FINITE, M, L].into_iter().take(layout.slots()) {
                        let got = planes[at + map.slots[plane] as usize * map.out[2] as usize];
                        let want = want[plane];
                        assert!(
                            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                            "{alg} {shape:?}: plane {plane} of {value:e}: {got:e}, host {want:e}"
                        );
                    }
                }
            }
            let mut arrangements = layout.arrangements(shape);
            if layout.promoted(shape.k) {
                arrangements.push(Arrangement::Partials { planes: 3 });
            }
            let mut results = vec![];
            for arrangement in arrangements {
                let c = run_split_steps(&layout, shape, arrangement, &va, &vb);
                let who = format!("cuda split GEMMs (host, {arrangement:?})");
                common::assert_contract(&who, &alg, shape, &a, &b, &c, "wide range");
                results.push((arrangement, c));
            }
            // Level 0's partial sums are the per-level GEMMs' beta = 1 chain, in its order.
            let (per_level, others) = results.split_first().unwrap();
            for (arrangement, c) in others {
                if matches!(arrangement, Arrangement::Partials { .. }) {
                    let same = c
                        .iter()
                        .zip(&per_level.1)
                        .all(|(x, y)| x == y || (x.is_nan() && y.is_nan()));
                    assert!(
                        same,
                        "{alg} {shape:?}: {arrangement:?} differs from per level"
                    );
                }
            }
        }
    }
}

/// bf16x3 as one K-tripled GEMM (`Arrangement::Tripled`, PyTorch's method: one f32 accumulator
/// for h.h + h.m + m.h) keeps the contract element by element on every family of the report's
/// inputs (`mantissa report`'s default sizes, 256 and 1000x700x1500, on their first rows and
/// columns, which see the same K), with the tensor core's accumulation modelled as
/// `tensor_core_sum` does; its error on N(0,1) inputs stays inside bf16x3's band up to
/// `TRIPLED_MAX_K` and leaves it at twice that, which is why the tuner offers it no further.
#[test]
fn cuda_tripled_bf16x3_keeps_the_contract_up_to_its_k_limit() {
    use mantissa::algorithm::{Algorithm, MatmulShape};
    use mantissa::backend::cuda::split::{Arrangement, SplitLayout, TRIPLED_MAX_K};
    use mantissa::report::Family;
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_tripled_bf16x3_keeps_the_contract_up_to_its_k_limit");
    let alg = Algorithm::Bf16x3;
    let layout = SplitLayout::of(&alg).unwrap();
    let tripled = |shape: &MatmulShape, a: &[f32], b: &[f32]| {
        let (va, vb) = host_planes(h, &layout, shape, a, b);
        run_split_steps(&layout, shape, Arrangement::Tripled, &va, &vb)
    };
    for (f, family) in Family::ALL.into_iter().enumerate() {
        // (m, n, k, and the rows of A and columns of B checked: the error grows with K alone).
        for (m, n, k, kept) in [(256, 256, 256, 64), (1000, 700, 1500, 16)] {
            let (a, b) = family.inputs(&MatmulShape::new(m, n, k), seed + f as u64);
            let (rows, cols) = (kept, kept);
            let a: Vec<f32> = a[..rows * k].to_vec();
            let b: Vec<f32> = (0..k * cols).map(|e| b[e / cols * n + e % cols]).collect();
            let shape = MatmulShape::new(rows, cols, k);
            let c = tripled(&shape, &a, &b);
            let what = format!("{} {m}x{n}x{k}", family.name());
            common::assert_contract(
                "K-tripled GEMM (host model)",
                &alg,
                &shape,
                &a,
                &b,
                &c,
                &what,
            );
            // How much of the tolerance it takes, where both are finite (docs/cuda.md).
            let want = mantissa::backend::reference::matmul(&shape, &alg, &a, &b).unwrap();
            let abs = measure::magnitudes(&shape, &a, &b).unwrap().abs;
            let tol = alg.accumulation_tolerance(k);
            let floor = f32::MIN_POSITIVE as f64 * (k as f64 + 1.0);
            let worst = (0..c.len())
                .filter(|&e| c[e].is_finite() && want[e].is_finite())
                .map(|e| (c[e] as f64 - want[e] as f64).abs() / (tol * abs[e] + floor))
                .fold(0f64, f64::max);
            eprintln!("K-tripled bf16x3, {what}: largest error {worst:.3} of the tolerance");
        }
    }
    let (lo, hi) = alg.expected_error_n01();
    for (k, inside) in [(TRIPLED_MAX_K, true), (2 * TRIPLED_MAX_K, false)] {
        let shape = MatmulShape::new(32, 32, k);
        let a = measure::normal(shape.a_len(), seed + 100);
        let b = measure::normal(shape.b_len(), seed + 101);
        let error = measure::relative_error(
            &tripled(&shape, &a, &b),
            &measure::exact_product(&shape, &a, &b),
        );
        eprintln!(
            "K-tripled bf16x3 at K = {k}: relative error {error:.3e} (band {lo:.0e}..{hi:.0e})"
        );
        assert_eq!(error >= lo && error <= hi, inside, "K = {k}: {error:.3e}");
    }
}

/// The arguments of the harness's attention kernels for `spec` (q|k|v stored as f32, the
/// output not coded).
fn attention_args(spec: &mantissa::plan::Attention) -> Vec<String> {
    let (inputs, _) = spec.algorithm.operand_formats();
    [spec.b, spec.t, spec.h, spec.d]
        .iter()
        .map(|v| v.to_string())
        .chain([
            (spec.scale as f32).to_string(),
            format_id(inputs),
            format_id(spec.probs),
            format_id(spec.compute),
            "0".into(),
            format_id(Format::F32),
        ])
        .collect()
}

/// attention.cu's forward and backward on `qkv` and `dout` against the ops they replace
/// (`ops::attention_fwd`, `attention_bwd`; the backward reads the kernel's own statistics, as
/// the step plan does), and, where the plan may store them as 16-bit codes, the output as codes
/// of the compute format (the same values) and q|k|v as codes of the inputs' format (the bits
/// of the same kernels on the values those codes hold, stored as f32: on the tensor cores, the
/// cp.async path against the converting one). Returns the forward's output and statistics.
fn attention_matches(
    h: &PathBuf,
    spec: &mantissa::plan::Attention,
    qkv: &[f32],
    dout: &[f32],
) -> Vec<f32> {
    use mantissa::backend::reference::ops;
    let (inputs, _) = spec.algorithm.operand_formats();
    let what = |part: &str| {
        format!(
            "{} probs {} compute {} b={} t={} h={} d={} {part}",
            spec.algorithm, spec.probs, spec.compute, spec.b, spec.t, spec.h, spec.d
        )
    };
    let args = attention_args(spec);
    let tol = common::attention_tolerance(spec);
    let (rows, n3, n1) = (spec.score_rows(), spec.qkv_len(), spec.out_len());
    let fwd = run_f32(h, "attention_fwd", &args, &[qkv]);
    let (y, stats) = ops::attention_fwd(qkv, spec);
    assert_eq!(fwd.len(), n1 + 2 * rows);
    common::attention_close(&what("out"), &fwd[..n1], &y, tol);
    common::attention_close(&what("(max, sum)"), &fwd[n1..], &stats, tol);
    if spec.compute != Format::F32 {
        // Stored as codes of the held format (a plan's coded tensor): the same values.
        let mut coded_args = args.clone();
        coded_args[8] = "1".into();
        let coded = run(h, "attention_fwd", &coded_args, &bits(qkv));
        same_codes(
            &what("out as codes"),
            &coded[..n1],
            &fwd[..n1],
            spec.compute,
        );
        assert_eq!(
            coded[n1..],
            bits(&fwd[n1..]),
            "{}",
            what("stats beside codes")
        );
    }
    let bwd = run_f32(h, "attention_bwd", &args, &[qkv, dout, &fwd[n1..]]);
    let (dqkv, delta) = ops::attention_bwd(qkv, dout, spec);
    common::attention_close(&what("dqkv"), &bwd[..n3], &dqkv, tol);
    common::attention_close(&what("sum(P dP)"), &bwd[n3..], &delta, tol);
    if inputs == Format::Bf16 || inputs == Format::F16 {
        let codes: Vec<u32> = qkv
            .iter()
            .map(|&x| inputs.encode(x, Overflow::Standard))
            .collect();
        let values: Vec<f32> = codes.iter().map(|&c| inputs.decode(c)).collect();
        let mut coded_args = args.clone();
        coded_args[9] = format_id(inputs);
        let plain = run_f32(h, "attention_fwd", &args, &[&values]);
        let from_codes = run(h, "attention_fwd", &coded_args, &codes);
        assert_eq!(
            from_codes,
            bits(&plain),
            "{}",
            what("forward from q|k|v codes")
        );
        let rest = [bits(dout), bits(&plain[n1..])].concat();
        let plain = run(
            h,
            "attention_bwd",
            &args,
            &[bits(&values), rest.clone()].concat(),
        );
        let from_codes = run(h, "attention_bwd", &coded_args, &[codes, rest].concat());
        assert_eq!(from_codes, plain, "{}", what("backward from q|k|v codes"));
    }
    fwd
}

/// attention.cu's SIMT kernels (f32 and tf32 inputs: dq, dk, dv each writing its third of a
/// NaN-poisoned dqkv) against the ops they replace, under the algorithms and held formats of
/// the presets that use them, on sequences that are not multiples of the kernels' blocks (64
/// rows) or tiles (32), every head size compiled (16, 32, 64).
#[test]
fn cuda_attention_kernels_match_the_unfused_ops_on_the_host() {
    use mantissa::algorithm::Algorithm;
    use mantissa::backend::reference::ops;
    use mantissa::plan::Attention;
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_attention_kernels_match_the_unfused_ops_on_the_host");
    let (f32_, bf16) = (Format::F32, Format::Bf16);
    // (b, t, h, d, algorithm, probs, compute): 32-true, tf32 (32-true under `high`), an f32
    // matmul under bf16-mixed (`--algorithm f32`: its output held, and stored, as bf16).
    // The last case holds its scores in bf16 at a scale that is not a power of two, with
    // integer scores: each row's max is the definition's to the bit (`same_row_maxes`).
    let cases = [
        (2, 37, 3, 16, Algorithm::F32, f32_, f32_),
        (1, 70, 2, 32, Algorithm::Tf32, f32_, f32_),
        (1, 45, 1, 64, Algorithm::F32, f32_, bf16),
        (1, 45, 2, 32, Algorithm::F32, f32_, bf16),
    ];
    for (case, &(b, t, heads, d, algorithm, probs, compute)) in cases.iter().enumerate() {
        let spec = Attention {
            b,
            t,
            h: heads,
            d,
            scale: 1.0 / (d as f64).sqrt(),
            algorithm,
            probs,
            compute,
        };
        let s = seed + 10 * case as u64;
        let exact = case == 3;
        let qkv = match exact {
            true => common::integer_scores_qkv(&spec, s),
            false => measure::normal(spec.qkv_len(), s),
        };
        let dout = measure::normal(spec.out_len(), s + 1);
        let fwd = attention_matches(h, &spec, &qkv, &dout);
        if exact {
            let stats = ops::attention_fwd(&qkv, &spec).1;
            common::same_row_maxes("SIMT row maxes", &fwd[spec.out_len()..], &stats);
        }
    }
    // Non-finite scores: a query holding inf makes its row's scores +-inf or NaN, so the
    // unfused softmax gives that row NaN (exp(inf - inf)) and leaves the other rows alone; the
    // fused forward must give the same pattern. (The backward is checked on finite values
    // only: the unfused one multiplies the masked zeros of P by inf, and the fused one never
    // reads masked scores; docs/training.md.)
    let spec = Attention {
        b: 1,
        t: 40,
        h: 2,
        d: 16,
        scale: 0.25,
        algorithm: Algorithm::F32,
        probs: f32_,
        compute: f32_,
    };
    let mut qkv = measure::normal(spec.qkv_len(), seed + 99);
    let c3 = 3 * spec.h * spec.d;
    qkv[7 * c3 + 3] = f32::INFINITY; // q of token 7, head 0
    qkv[20 * c3 + spec.d + 1] = f32::NAN; // q of token 20, head 1
    qkv[30 * c3 + 5] = 1e-40; // a subnormal
    let out = run_f32(h, "attention_fwd", &attention_args(&spec), &[&qkv]);
    let (y, stats) = ops::attention_fwd(&qkv, &spec);
    common::attention_close("non-finite out", &out[..spec.out_len()], &y, tol::REDUCTION);
    assert!(y.iter().any(|v| v.is_nan()) && y.iter().any(|v| v.is_finite()));
    common::attention_close(
        "non-finite stats",
        &out[spec.out_len()..],
        &stats,
        tol::REDUCTION,
    );
}

/// attention.cu's tensor-core kernels (bf16 and f16 inputs: mma.sync, ldmatrix and cp.async
/// emulated by the harness) against the ops they replace, under the four presets that use
/// them, on B H = 3 heads whose sequences are not multiples of the query blocks (128 rows),
/// the key blocks (64) or the dk/dv kernel's splits (T = 300: 5 key blocks on 4 splits, so a
/// split adds a second key block's dq to its partial), every head size compiled. Under
/// 16-mixed some queries are large enough that their scores overflow f16: those rows are NaN,
/// forward and backward, where the unfused ops give NaN; under 16-true a query's scores against
/// a whole key block overflow to -inf before its finite ones. Also: the backward gives the same bits
/// whatever dqkv, delta and the dq partials held before it (NaN or a number: nothing is read
/// before it is written), and a NaN in one head's q makes NaN in that head alone.
#[test]
fn cuda_tensor_core_attention_matches_the_unfused_ops_on_the_host() {
    use mantissa::algorithm::Algorithm;
    use mantissa::backend::reference::ops;
    use mantissa::plan::Attention;
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_tensor_core_attention_matches_the_unfused_ops_on_the_host");
    let (f32_, bf16, f16) = (Format::F32, Format::Bf16, Format::F16);
    // (b, t, h, d, algorithm, probs, compute): bf16-mixed, 16-mixed, bf16-true, 16-true.
    // The last case, tiny's bf16-mixed attention, has integer scores: each row's max is the
    // definition's to the bit (`same_row_maxes`), which the scaled scores' rounding decides.
    let cases = [
        (1, 150, 3, 64, Algorithm::Bf16, f32_, bf16),
        (3, 150, 1, 64, Algorithm::F16, f32_, f16),
        (1, 70, 3, 32, Algorithm::Bf16, bf16, bf16),
        (1, 300, 1, 16, Algorithm::F16, f16, f16),
        (2, 32, 2, 32, Algorithm::Bf16, f32_, bf16),
    ];
    for (case, &(b, t, heads, d, algorithm, probs, compute)) in cases.iter().enumerate() {
        let spec = Attention {
            b,
            t,
            h: heads,
            d,
            scale: 1.0 / (d as f64).sqrt(),
            algorithm,
            probs,
            compute,
        };
        let s = seed + 10 * case as u64;
        let mut qkv = match case {
            4 => common::integer_scores_qkv(&spec, s),
            _ => measure::normal(spec.qkv_len(), s),
        };
        let dout = measure::normal(spec.out_len(), s + 1);
        let c3 = 3 * heads * d;
        if case == 1 {
            // Queries 20..24 of sequence 1, times 5000: still f16 values (below 65504, its
            // largest), but their scores, ~ 5000 sqrt(d) = 4e4 across, often past it.
            for i in 20..24 {
                let row = (t + i) * c3;
                qkv[row..row + d].iter_mut().for_each(|x| *x *= 5e3);
            }
        }
        if case == 3 {
            // Query 200 (all 1000) against keys 0..64 (all -5): scores of -80000, -inf in f16,
            // a whole key block of them before the row's finite ones; the unfused softmax
            // gives them P = 0 and the row is finite.
            qkv[200 * c3..200 * c3 + d].fill(1000.0);
            for j in 0..64 {
                qkv[j * c3 + c3 / 3..j * c3 + c3 / 3 + d].fill(-5.0);
            }
        }
        let fwd = attention_matches(h, &spec, &qkv, &dout);
        if case == 4 {
            let stats = ops::attention_fwd(&qkv, &spec).1;
            common::same_row_maxes("tensor-core row maxes", &fwd[spec.out_len()..], &stats);
        }
        if case == 3 {
            let row = &fwd[200 * d..201 * d];
            assert!(row.iter().all(|x| x.is_finite()), "query 200: {row:?}");
        }
        if case == 1 {
            let nan_rows = (0..spec.score_rows())
                .filter(|&r| fwd[spec.out_len() + 2 * r + 1].is_nan())
                .count();
            assert!(nan_rows > 0, "no score overflowed f16");
        }
        // The same bits whatever the outputs and partials held before.
        let args = attention_args(&spec);
        let input = [&qkv[..], &dout, &fwd[spec.out_len()..]];
        let poisoned = |value: &str| {
            let mut with = args.clone();
            with.push(value.into());
            run(h, "attention_bwd", &with, &input.map(bits).concat())
        };
        assert_eq!(
            poisoned("nan"),
            poisoned("7"),
            "{algorithm} d={d}: a backward that reads what it did not write"
        );
    }
    // NaN in q of token 30 of head 1 of 3 (bf16-mixed): its row of head 1 is NaN in the
    // forward, and every value of heads 0 and 2 is what the unfused ops give, forward and
    // backward. (Within head 1 the backward differs from the unfused ops at masked positions,
    // which they multiply by the NaN: docs/training.md.)
    let spec = Attention {
        b: 1,
        t: 100,
        h: 3,
        d: 64,
        scale: 0.125,
        algorithm: Algorithm::Bf16,
        probs: f32_,
        compute: bf16,
    };
    let (c, d) = (spec.h * spec.d, spec.d);
    let mut qkv = measure::normal(spec.qkv_len(), seed + 99);
    qkv[30 * 3 * c + d + 7] = f32::NAN;
    let dout = measure::normal(spec.out_len(), seed + 98);
    let tol = common::attention_tolerance(&spec);
    let args = attention_args(&spec);
    let fwd = run_f32(h, "attention_fwd", &args, &[&qkv]);
    let (y, stats) = ops::attention_fwd(&qkv, &spec);
    let n1 = spec.out_len();
    common::attention_close("NaN head: out", &fwd[..n1], &y, tol);
    common::attention_close("NaN head: (max, sum)", &fwd[n1..], &stats, tol);
    let nan: Vec<usize> = (0..n1).filter(|&e| fwd[e].is_nan()).collect();
    assert_eq!(
        nan,
        (30 * c + d..30 * c + 2 * d).collect::<Vec<_>>(),
        "NaN outside its row"
    );
    let bwd = run_f32(h, "attention_bwd", &args, &[&qkv, &dout, &fwd[n1..]]);
    let (dqkv, _) = ops::attention_bwd(&qkv, &dout, &spec);
    // Heads 0 and 2: columns [0, d) and [2d, 3d) of each of q, k and v.
    let other_heads = |x: &[f32]| -> Vec<f32> {
        x.chunks(c)
            .flat_map(|row| [&row[..d], &row[2 * d..]].concat())
            .collect()
    };
    common::attention_close(
        "NaN head: dqkv of the other heads",
        &other_heads(&bwd[..spec.qkv_len()]),
        &other_heads(&dqkv),
        tol,
    );
}

/// attention.cu's held16 (the tensor-core kernels' rounding, without branches) is formats.cuh's
/// held, bit for bit, for f32, bf16 and f16 on boundary values (f16's overflow and
/// subnormals, NaN, infinities), random bit patterns and wide-range values.
#[test]
fn cuda_attention_rounding_is_the_formats_on_the_host() {
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_attention_rounding_is_the_formats_on_the_host");
    let mut values = measure::boundary_values();
    values.extend([
        65504.0,
        65519.996,
        65520.0,
        -65520.0,
        6.097555e-5,
        2.9802322e-8,
    ]);
    values.extend(measure::random_bits(20_000, seed));
    values.extend(measure::wide_range(20_000, seed + 1));
    for f in [Format::F32, Format::Bf16, Format::F16] {
        let got = run(h, "held16", &[format_id(f)], &bits(&values));
        for (x, g) in values.iter().zip(&got) {
            let (g, want) = (f32::from_bits(*g), f.round(*x, Overflow::Standard));
            assert!(
                g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                "held16 {f} {x:e} ({:#010x}): {g:e}, host {want:e}",
                x.to_bits()
            );
        }
    }
}

/// The harness's emulations of the warp's tensor-core instructions (cp.async, ldmatrix with
/// and without .trans, mma.sync on bf16 and f16), composed as attention.cu composes them
/// (swizzled tiles, its fragment addresses, mma_nt and mma_nn), compute A B + C: the emulations
/// follow the PTX ISA's layouts consistently, so a kernel built on them is checked on the host.
#[test]
fn cuda_warp_instructions_compute_the_product_on_the_host() {
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_warp_instructions_compute_the_product_on_the_host");
    for f in [Format::Bf16, Format::F16] {
        let held = |x: Vec<f32>| -> Vec<f32> {
            x.into_iter()
                .map(|v| f.round(v, Overflow::Standard))
                .collect()
        };
        let a = held(measure::normal(256, seed));
        let b = held(measure::normal(128, seed + 1));
        let c = measure::normal(128, seed + 2);
        let d = run_f32(h, "warp_check", &[format_id(f)], &[&a, &b, &c]);
        for (way, d) in ["n-major", "k-major"].iter().zip(d.chunks(128)) {
            for i in 0..16 {
                for n in 0..8 {
                    let terms = (0..16).map(|k| a[16 * i + k] as f64 * b[8 * k + n] as f64);
                    let want = c[8 * i + n] as f64 + terms.clone().sum::<f64>();
                    let size = c[8 * i + n].abs() as f64 + terms.map(f64::abs).sum::<f64>();
                    let got = d[8 * i + n] as f64;
                    assert!(
                        (got - want).abs() <= 1e-6 * size,
                        "{f}, B {way}: D[{i}][{n}] = {got}, want {want}"
                    );
                }
            }
        }
    }
}
