//! The CUDA kernels, compiled by NVRTC for every architecture the backend supports. NVRTC is a
//! compiler library and needs no GPU, so a broken `.cu` file fails here on any machine that has
//! it (CI installs it: scripts/setup.sh); elsewhere the test says why it is skipped. The
//! backend itself is checked by the conformance suite where a CUDA device exists.

#![cfg(feature = "cuda")]

use mantissa::backend::cuda::{self, Module, Target};

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
    for cc in ARCHITECTURES {
        for module in Module::ALL {
            let compile = |target| {
                cuda::compile(module, cc, target)
                    .unwrap_or_else(|e| panic!("{target:?} for sm_{}{}: {e}", cc.0, cc.1))
            };
            // The cubin is what the backend loads (NVRTC runs ptxas for it); the PTX says
            // which kernels there are.
            assert!(!compile(Target::Cubin).is_empty());
            let ptx = String::from_utf8(compile(Target::Ptx)).unwrap();
            // MANTISSA_PTX_DIR=dir keeps the PTX (to read it, or to run ptxas on it).
            if let Ok(dir) = std::env::var("MANTISSA_PTX_DIR") {
                let name =
                    format!("{module:?}_sm{}{}.ptx", cc.0, cc.1).replace([' ', '{', '}', ':'], "");
                std::fs::write(std::path::Path::new(&dir).join(name), &ptx).unwrap();
            }
            let entries = ptx.matches(".entry").count();
            assert!(
                entries > 0,
                "{module:?} for sm_{}{}: no kernels in the PTX",
                cc.0,
                cc.1
            );
        }
    }
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
            let Some(path) = cuda::cubin_cache_path(module, cc) else {
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
use mantissa::plan::ScoreScale;
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
    // A batch of 2 matrices of 7 x 13 (row-major), with extremes and non-finite values.
    let (batch, rows, cols) = (2usize, 7usize, 13usize);
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
            for (as_a, transposed) in [(true, false), (true, true), (false, false), (false, true)] {
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

/// train.cu's kernels (block reductions included: the harness runs every thread of a block as
/// a coroutine) against `reference::ops`, with the tolerances of the conformance suite, on shapes
/// that are not multiples of the blocks, warps or chunks.
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
            &strings(&[rows, c]),
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
        let sums = run_f32(h, "column_sums", &strings(&[rows, c]), &[&x]);
        close("column sums", &sums, &ops::column_sums(&x, c), tol::ROW);
    }
    let x = measure::normal(1001, seed + 4);
    let dy = measure::normal(1001, seed + 5);
    let f32_ = Format::F32.id() as usize;
    close(
        "gelu",
        &run_f32(h, "gelu_fwd", &strings(&[x.len(), f32_, 0, f32_]), &[&x]),
        &ops::gelu_fwd(&x),
        tol::ROW,
    );
    let f16 = Format::F16.id() as usize;
    let held = run_f32(h, "gelu_fwd", &strings(&[x.len(), f16, 0, f32_]), &[&x]);
    common::held_close(
        "gelu held in f16",
        &held,
        &ops::gelu_fwd(&x),
        Format::F16,
        tol::ROW,
    );
    let coded = run(h, "gelu_fwd", &strings(&[x.len(), f16, 1, f32_]), &bits(&x));
    same_codes("gelu as f16 codes", &coded, &held, Format::F16);
    let gelu_bwd = run_f32(h, "gelu_bwd", &strings(&[x.len(), f32_]), &[&x, &dy]);
    close("gelu bwd", &gelu_bwd, &ops::gelu_bwd(&x, &dy), tol::ROW);
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
        let plain = run(h, "gelu_fwd", &strings(&[n, f32_, 0, f32_]), &bits(&values));
        let from_codes = run(h, "gelu_fwd", &strings(&[n, f32_, 0, id]), &codes);
        same(&format!("gelu of {format} codes"), &from_codes, &plain);
        let dy_bits = bits(&dy);
        let with = |x: &[u32]| [x, &dy_bits[..]].concat();
        let plain = run(h, "gelu_bwd", &strings(&[n, f32_]), &with(&bits(&values)));
        let from_codes = run(h, "gelu_bwd", &strings(&[n, id]), &with(&codes));
        same(&format!("gelu bwd of {format} codes"), &from_codes, &plain);
    }
    // Softmax rows shorter and longer than a block; heads of t x t; the scaled scores held in
    // f32 and in bf16 (a power-of-two scale: the backward's two roundings are one).
    for (heads, t, scale) in [(3, 13, 0.3), (1, 150, 0.3), (3, 13, 0.25)] {
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
            ];
            let p = run_f32(h, "softmax_fwd", &args, &[&s]);
            let want = ops::causal_softmax_scaled_fwd(&s, t, k);
            close(&format!("softmax, {held}"), &p, &want, tol::ROW);
            let ds = run_f32(h, "softmax_bwd", &args, &[&p, &dp]);
            let want = ops::causal_softmax_scaled_bwd(&p, &dp, t, k);
            let what = format!("softmax bwd, scores x {scale} held in {held}");
            match held {
                Format::F32 => close(&what, &ds, &want, tol::ROW),
                _ if scale == 0.25 => common::held_close(&what, &ds, &want, held, tol::ROW),
                _ => {}
            }
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
        let dout = measure::normal(ids.len() * width, seed + 10);
        close(
            "embedding scatter-add",
            &run_f32(h, "embedding_bwd", &args, &[&dout, &id_bits(&ids)]),
            &ops::embedding_bwd(&dout, &ids, vocab, width),
            tol::ROW,
        );
    }
    // Adds: a bias per row, and elementwise.
    let (y, bias) = (
        measure::normal(37 * 50, seed + 11),
        measure::normal(50, seed + 12),
    );
    // N C YFMT FMT CODED, no residual, no GELU.
    let add = |args: &[usize], x: &[f32]| {
        let args: Vec<usize> = args.iter().copied().chain([f32_, 0, 0, f32_, 0]).collect();
        run_f32(h, "add", &strings(&args), &[x, &y])
    };
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
        let args = [y.len(), 50, f32_, bf16, coded, f16, 1, 0, f32_, 0];
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
            |has_g: usize| strings(&[n, c, f32_, fmt, coded, f32_, 0, has_g, g_fmt, g_coded]);
        let input = [bits(&bias), bits(&y)].concat();
        let fused = run(h, "add", &args(1), &input);
        let sum = run(h, "add", &args(0), &input);
        assert_eq!(fused[..n], sum[..], "the add's own output, GELU or not");
        let x_fmt = if coded == 1 { fmt } else { f32_ };
        let gelu = run(h, "gelu_fwd", &strings(&[n, g_fmt, g_coded, x_fmt]), &sum);
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
    let mut args: Vec<u32> = [split.dims, split.src, split.dst].concat();
    args.extend([split.src_offset, split.dst_offset, split.len() as u32]);
    let args: Vec<String> = args.iter().map(|v| v.to_string()).collect();
    assert_eq!(run_f32(h, "strided_copy", &args, &[&qkv]), want);
    // GradScaler's unscale: exact; the flag for inf, NaN and an injected fault; the norm.
    for n in [3001, 70_000] {
        let g = measure::normal(n, seed + 14);
        let mut want = g.clone();
        assert!(ops::unscale_check(&mut want, 1.0 / 1024.0));
        let inverse = (1.0f32 / 1024.0).to_string();
        let out = run_f32(
            h,
            "unscale",
            &["0".into(), inverse.clone(), "0".into()],
            &[&g],
        );
        assert_eq!(
            &out[..n],
            &want[..],
            "unscaling is one exact multiplication"
        );
        assert_eq!(out[n], 0.0, "finite gradients flagged");
        let norm: f64 = want.iter().map(|&x| x as f64 * x as f64).sum();
        assert!(
            ((out[n + 1] as f64) - norm).abs() <= tol::ROW as f64 * norm,
            "squared norm {} vs {norm}",
            out[n + 1]
        );
        for (at, bad) in [(1234, f32::INFINITY), (n - 1, f32::NAN)] {
            let mut g = g.clone();
            g[at] = bad;
            let out = run_f32(
                h,
                "unscale",
                &["0".into(), inverse.clone(), "0".into()],
                &[&g],
            );
            assert_eq!(out[n], 1.0, "{bad} at {at} flagged");
        }
        let poisoned = ["1".into(), inverse, "inf".into()];
        assert_eq!(
            run_f32(h, "unscale", &poisoned, &[&g])[n],
            1.0,
            "fault injected"
        );
    }
    // AdamW: the update, the clip, and the skip on a flagged gradient.
    let opt = mantissa::plan::AdamW::default();
    let n = 1001;
    let (p, g) = (measure::normal(n, seed + 15), measure::normal(n, seed + 16));
    let (m, v) = (vec![0.01f32; n], vec![0.001f32; n]);
    let t = 3;
    let mut scalars = [0f32; 11];
    scalars[mantissa::plan::scalar::LR] = opt.lr;
    scalars[mantissa::plan::scalar::BETA1] = opt.beta1;
    scalars[mantissa::plan::scalar::BETA2] = opt.beta2;
    scalars[mantissa::plan::scalar::EPS] = opt.eps;
    scalars[mantissa::plan::scalar::WEIGHT_DECAY] = opt.weight_decay;
    scalars[mantissa::plan::scalar::BIAS_CORRECTION1] = (1.0 - (opt.beta1 as f64).powi(t)) as f32;
    scalars[mantissa::plan::scalar::BIAS_CORRECTION2] = (1.0 - (opt.beta2 as f64).powi(t)) as f32;
    // Two gradients in the stats (this one and another), squared norms 16 and 9: norm 5.
    let stats = [0.0, 0.0, 0.0, 16.0, 9.0];
    for (clip, flag, decay) in [(0.0, 0.0, true), (2.5, 0.0, false), (0.0, 1.0, true)] {
        scalars[mantissa::plan::scalar::CLIP] = clip;
        let mut st = stats;
        st[2] = flag;
        let out = run_f32(
            h,
            "adamw",
            &strings(&[n, 2, decay as usize]),
            &[&p, &g, &m, &v, &st, &scalars],
        );
        let (mut wp, mut wm, mut wv) = (p.clone(), m.clone(), v.clone());
        if flag == 0.0 {
            let factor = if clip > 0.0 { clip / 5.0 } else { 1.0 };
            let g: Vec<f32> = g.iter().map(|x| x * factor).collect();
            ops::adamw(&opt, &mut wp, &g, &mut wm, &mut wv, t as u32, decay);
        }
        let what = format!("adamw clip {clip} flag {flag}");
        close(&format!("{what} p"), &out[..n], &wp, tol::ARITHMETIC);
        close(&format!("{what} m"), &out[n..2 * n], &wm, tol::ARITHMETIC);
        close(&format!("{what} v"), &out[2 * n..], &wv, tol::ARITHMETIC);
    }
}

/// The split matmuls' host cases: `first` with rows of A holding inf, NaN and an f32
/// subnormal and a column of B holding -inf (the split's rules for them), 2 x 33x20x40 with
/// both operands transposed, and 17x70x90 with B transposed; wide-range A, N(0,1) B.
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

/// Split-bf16 as cuBLAS bf16 GEMMs, one per level (src/backend/cuda/split.rs), on the host: the
/// real `split_planes` kernel lays both operands out (transposed and batched ones included),
/// and the backend's own GEMM calls run over those planes here (each product sum rounded to f32
/// as the tensor core's accumulator is, beta adding in f32), then C += the lower levels. The
/// layout, the offsets, the strides, the promotion chunks and the summation order are checked
/// against the host reference's contract; only cuBLAS itself is left to a GPU.
#[test]
fn cuda_split_gemms_meet_the_contract_on_the_host() {
    use mantissa::algorithm::{Algorithm, MatmulShape};
    use mantissa::backend::cuda::split::{GemmCall, H, H_FINITE, L, M, Out, SplitLayout};
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_split_gemms_meet_the_contract_on_the_host");
    let bf16 = |code: u32| Format::Bf16.decode(code);
    // K = 600 crosses two promotions (256).
    for (shape, a, b) in split_cases(MatmulShape::new(30, 25, 600), seed) {
        let shape = &shape;
        for alg in [Algorithm::Bf16x3, Algorithm::Bf16x6, Algorithm::Bf16x9] {
            let layout = SplitLayout::of(&alg).unwrap();
            let (a_len, b_len) = layout.plane_lens(shape).unwrap();
            let (m, n, k, slots) = (shape.m, shape.n, shape.k, layout.slots());
            // The strides the backend passes (src/backend/cuda/matmul.rs, split_gemms).
            let (a_row, a_col) = if shape.a_transposed { (1, m) } else { (k, 1) };
            let (b_row, b_col) = if shape.b_transposed { (1, k) } else { (n, 1) };
            let split = |x: &[f32],
                         (rows, cols): (usize, usize),
                         source: [usize; 3],
                         out: [usize; 4],
                         slot: [u32; 4],
                         len: usize| {
                let mut args = strings(&[rows, cols, shape.batch]);
                args.extend(strings(&source));
                args.extend(strings(&out));
                args.extend(slot.iter().map(|s| s.to_string()));
                args.push(len.to_string());
                run(h, "split_planes", &args, &bits(x))
            };
            let pa = split(
                &a,
                (m, k),
                [m * k, a_row, a_col],
                [m * slots * k, slots * k, 1, k],
                layout.a_slots(),
                a_len,
            );
            let pb = split(
                &b,
                (k, n),
                [k * n, b_row, b_col],
                [slots * k * n, n, 1, k * n],
                layout.b_slots(),
                b_len,
            );
            // Every plane holds the host's split, h' zero where h is not finite.
            for (batch, i, p) in [
                (0, 0, 0),
                (shape.batch - 1, m - 1, k - 1),
                (0, m / 2, k / 3),
            ] {
                let x = a[shape.a_index(batch, i, p)];
                let want =
                    format::split_bf16(x).map(|v| Format::Bf16.encode(v, Overflow::Standard));
                let h_finite = if bf16(want[0]).is_finite() {
                    want[0]
                } else {
                    0
                };
                let codes = [want[0], h_finite, want[1], want[2]];
                let at = |plane: usize| {
                    pa[batch * m * slots * k
                        + i * slots * k
                        + layout.a_slots()[plane] as usize * k
                        + p]
                };
                for plane in [H, H_FINITE, M, L].into_iter().take(slots) {
                    assert_eq!(at(plane), codes[plane], "{alg} A plane {plane} of {x:e}");
                }
            }
            let (va, vb): (Vec<f32>, Vec<f32>) = (
                pa.iter().map(|&c| bf16(c)).collect(),
                pb.iter().map(|&c| bf16(c)).collect(),
            );
            let mut c = vec![0f32; shape.c_len()];
            let mut lower = vec![0f32; shape.c_len()];
            let calls: Vec<GemmCall> = layout.calls(shape).unwrap();
            for call in &calls {
                let (a_end, b_end) = call.extents();
                assert!(a_end <= va.len() && b_end <= vb.len(), "{alg}: {call:?}");
                let out = if call.out == Out::C {
                    &mut c
                } else {
                    &mut lower
                };
                for t in 0..call.batch {
                    for i in 0..call.m {
                        for j in 0..call.n {
                            let sum: f64 = (0..call.k)
                                .map(|p| {
                                    let x =
                                        va[call.a_offset + t * call.a_stride + i * call.lda + p];
                                    let y =
                                        vb[call.b_offset + t * call.b_stride + p * call.ldb + j];
                                    x as f64 * y as f64
                                })
                                .sum();
                            let o = &mut out[t * call.c_stride + i * call.n + j];
                            *o = if call.beta == 0.0 {
                                sum as f32
                            } else {
                                sum as f32 + *o
                            };
                        }
                    }
                }
            }
            if layout.needs_lower() {
                c.iter_mut().zip(&lower).for_each(|(c, l)| *c += l);
            }
            common::assert_contract(
                "cuda split GEMMs (host)",
                &alg,
                shape,
                &a,
                &b,
                &c,
                "wide range",
            );
        }
    }
}

/// attention.cu's fused causal attention, forward and backward (dq, dk, dv, each writing its
/// third of a NaN-poisoned dqkv), against the ops it replaces (`ops::attention_fwd`,
/// `attention_bwd`), under the algorithms and held formats of the presets, on sequences that
/// are not multiples of the kernels' blocks (64 rows) or tiles (32), every head size compiled
/// (16, 32, 64).
#[test]
fn cuda_attention_kernels_match_the_unfused_ops_on_the_host() {
    use mantissa::algorithm::Algorithm;
    use mantissa::backend::reference::ops;
    use mantissa::plan::Attention;
    let Some(h) = harness() else { return };
    let seed = common::seed("cuda_attention_kernels_match_the_unfused_ops_on_the_host");
    let (f32_, bf16, f16) = (Format::F32, Format::Bf16, Format::F16);
    // (b, t, h, d, algorithm, probs, compute): 32-true, bf16-mixed, 16-true, tf32 (32-true
    // under `high`), bf16-true.
    let cases = [
        (2, 37, 3, 16, Algorithm::F32, f32_, f32_),
        (1, 70, 2, 32, Algorithm::Bf16, f32_, bf16),
        (1, 45, 1, 64, Algorithm::F16, f16, f16),
        (1, 33, 2, 16, Algorithm::Tf32, f32_, f32_),
        (2, 9, 2, 64, Algorithm::Bf16, bf16, bf16),
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
        let what = |part: &str| format!("{algorithm} d={d} t={t} {part}");
        let s = seed + 10 * case as u64;
        let qkv = measure::normal(spec.qkv_len(), s);
        let dout = measure::normal(spec.out_len(), s + 1);
        let (inputs, _) = algorithm.operand_formats();
        let args: Vec<String> = [b, t, heads, d]
            .iter()
            .map(|v| v.to_string())
            .chain([
                (spec.scale as f32).to_string(),
                format_id(inputs),
                format_id(probs),
                format_id(compute),
                "0".into(),
                format_id(f32_),
            ])
            .collect();
        let tol = common::attention_tolerance(&spec);
        let (rows, n3, n1) = (spec.score_rows(), spec.qkv_len(), spec.out_len());
        let out = run_f32(h, "attention_fwd", &args, &[&qkv]);
        let (y, stats) = ops::attention_fwd(&qkv, &spec);
        common::attention_close(&what("out"), &out[..n1], &y, tol);
        common::attention_close(&what("(max, sum)"), &out[n1..], &stats, tol);
        assert_eq!(out.len(), n1 + 2 * rows);
        if compute != f32_ {
            // Stored as codes of the held format (a plan's coded tensor): the same values.
            let mut coded_args = args.clone();
            coded_args[8] = "1".into();
            let coded = run(h, "attention_fwd", &coded_args, &bits(&qkv));
            same_codes(&what("out as codes"), &coded[..n1], &out[..n1], compute);
            assert_eq!(
                coded[n1..],
                bits(&out[n1..]),
                "{}",
                what("stats beside codes")
            );
        }
        // The backward reads the kernel's own statistics, as the step plan does.
        let out = run_f32(h, "attention_bwd", &args, &[&qkv, &dout, &out[n1..]]);
        let (dqkv, delta) = ops::attention_bwd(&qkv, &dout, &spec);
        common::attention_close(&what("dqkv"), &out[..n3], &dqkv, tol);
        common::attention_close(&what("sum(P dP)"), &out[n3..], &delta, tol);
        if inputs == bf16 || inputs == f16 {
            // q|k|v stored as codes of the matmul inputs' format (a plan's coded tensor): the
            // bits of the same kernels on the values those codes hold, stored as f32.
            let codes: Vec<u32> = qkv
                .iter()
                .map(|&x| inputs.encode(x, Overflow::Standard))
                .collect();
            let values: Vec<f32> = codes.iter().map(|&c| inputs.decode(c)).collect();
            let mut coded_args = args.clone();
            coded_args[9] = format_id(inputs);
            let plain = run_f32(h, "attention_fwd", &args, &[&values]);
            let (plain_bits, n_out) = (bits(&plain), plain.len());
            let from_codes = run(h, "attention_fwd", &coded_args, &codes);
            assert_eq!(
                from_codes,
                plain_bits,
                "{}",
                what("forward from q|k|v codes")
            );
            let rest = [bits(&dout), bits(&plain[n1..n_out])].concat();
            let plain = run(
                h,
                "attention_bwd",
                &args,
                &[bits(&values), rest.clone()].concat(),
            );
            let from_codes = run(h, "attention_bwd", &coded_args, &[codes, rest].concat());
            assert_eq!(from_codes, plain, "{}", what("backward from q|k|v codes"));
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
    let args = ["1", "40", "2", "16", "0.25", "0", "0", "0", "0", "0"].map(String::from);
    let out = run_f32(h, "attention_fwd", &args, &[&qkv]);
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
