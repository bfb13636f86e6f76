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

// The elementwise kernels run on the host (tests/cuda_host/harness.cpp compiles cast.cu and
// scale.cu as C++ with CUDA's built-ins defined), against the host reference: the CUDA port of
// the formats is checked bit for bit on every machine with a C++ compiler.

mod common;

use mantissa::format::{self, Format, Overflow};
use mantissa::measure;
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
        let status = Command::new(&compiler)
            .args(["-std=c++17", "-O2", "-ffp-contract=off", "-o"])
            .arg(&out)
            .arg(src)
            .status()
            .map_err(|e| format!("no C++ compiler ({compiler}: {e})"))?;
        if !status.success() {
            return Err(format!("{compiler} failed on {src}"));
        }
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
    Format::ALL
        .iter()
        .position(|g| *g == f)
        .unwrap()
        .to_string()
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
        }
    }
}
