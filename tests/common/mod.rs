//! Test helpers: the backends present on this machine, each test run once per backend with the
//! backend in its name, and absent backends reported as skipped with the reason.

#![allow(dead_code)]

use mantissa::algorithm::{Algorithm, MatmulShape};
use mantissa::backend::reference as host;
use mantissa::backend::wgpu::{F16Path, WgpuBackend, WgpuOptions};
use mantissa::backend::{Backend, Reference};
use mantissa::measure;
use mantissa::plan::{Op, Outline, Plan, PlanBuilder, TensorId, TensorKind};
use pollster::FutureExt as _;
use std::sync::OnceLock;

/// A backend under test, or why it is absent.
pub type Present = Result<Box<dyn Backend>, String>;

fn open_wgpu(options: WgpuOptions) -> Present {
    WgpuBackend::open_nth(0, options)
        .block_on()
        .map(|b| Box::new(b) as Box<dyn Backend>)
        .map_err(|e| e.to_string())
}

/// The wgpu backend with default options (f16 read natively where the adapter can).
pub fn wgpu() -> &'static Present {
    static B: OnceLock<Present> = OnceLock::new();
    B.get_or_init(|| {
        open_wgpu(WgpuOptions {
            poison_outputs: true,
            ..WgpuOptions::default()
        })
    })
}

/// The wgpu backend forced onto the packed-f16 path (core WGSL, as in browsers without
/// shader-f16).
pub fn wgpu_packed_f16() -> &'static Present {
    static B: OnceLock<Present> = OnceLock::new();
    B.get_or_init(|| {
        open_wgpu(WgpuOptions {
            f16: F16Path::Packed,
            runtime_checks: false,
            poison_outputs: true,
            ..WgpuOptions::default()
        })
    })
}

/// The wgpu backend with wgpu's shader runtime checks on (as browsers run WGSL).
pub fn wgpu_checked() -> &'static Present {
    static B: OnceLock<Present> = OnceLock::new();
    B.get_or_init(|| {
        open_wgpu(WgpuOptions {
            f16: F16Path::Auto,
            runtime_checks: true,
            poison_outputs: true,
            ..WgpuOptions::default()
        })
    })
}

/// The wgpu backend with the training row ops in a GPU's shape (`GPU_ROW_LANES` invocations
/// to a row, reducing in a tree), which a CPU adapter such as lavapipe otherwise runs one
/// invocation to a row.
pub fn wgpu_gpu_rows() -> &'static Present {
    static B: OnceLock<Present> = OnceLock::new();
    B.get_or_init(|| {
        open_wgpu(WgpuOptions {
            poison_outputs: true,
            row_lanes: Some(mantissa::backend::wgpu::shaders::GPU_ROW_LANES),
            ..WgpuOptions::default()
        })
    })
}

/// The CUDA backend on device 0, where this machine has one (and the build has the feature).
pub fn cuda() -> &'static Present {
    static B: OnceLock<Present> = OnceLock::new();
    B.get_or_init(|| mantissa::backend::open_cuda().map_err(|e| e.to_string()))
}

pub fn reference() -> &'static Present {
    static B: OnceLock<Present> = OnceLock::new();
    B.get_or_init(|| Ok(Box::new(Reference)))
}

/// One test per backend configuration, the backend in its name: `backend_tests!(wgpu: casts,
/// matmul_edges)` makes `wgpu::casts` and `wgpu::matmul_edges`, each running the function of
/// that name on `common::wgpu()` (or saying SKIPPED with the reason where it is absent). The
/// conformance and training suites both use it; a new backend is one line in each.
#[macro_export]
macro_rules! backend_tests {
    ($backend:ident: $($test:ident),+ $(,)?) => {
        mod $backend {
            $(
                #[test]
                fn $test() {
                    let name = concat!(stringify!($backend), "::", stringify!($test));
                    $crate::common::on($crate::common::$backend(), name, |b| super::$test(b));
                }
            )+
        }
    };
}

/// Says that `test` was skipped and why: on stderr, and in target/tmp/skipped.txt, which
/// scripts/test.sh prints after the run (the test harness hides a passing test's output).
pub fn skip(test: &str, why: &str) {
    let line = format!("SKIPPED {test}: {why}");
    eprintln!("{line}");
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("skipped.txt");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        // One write per line: tests run in parallel and append to the same file.
        use std::io::Write as _;
        let _ = f.write_all(format!("{line}\n").as_bytes());
    }
}

/// Runs `f` on the backend, or says why it is skipped. In CI (CI=true) a missing wgpu
/// adapter fails the test instead: CI installs lavapipe, so its absence is a broken setup.
/// CUDA (tests under `cuda::`) is optional everywhere: CI machines have no NVIDIA GPU.
pub fn on(backend: &'static Present, test: &str, f: impl FnOnce(&dyn Backend)) {
    match backend {
        Ok(b) => f(b.as_ref()),
        Err(why) => {
            if std::env::var("CI").is_ok_and(|v| v == "true") && !test.starts_with("cuda::") {
                panic!("{test}: backend required in CI but absent: {why}");
            }
            skip(test, &format!("backend absent: {why}"));
        }
    }
}

/// A seed for fresh random inputs: `MANTISSA_TEST_SEED` when set (to reproduce a failure), else
/// new each run. Printed so that a failure can be replayed.
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var("MANTISSA_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("{test}: MANTISSA_TEST_SEED={seed}");
    seed
}

/// `n` of `items` drawn by `seed`, in their order, or all of them with
/// `MANTISSA_TEST_EXHAUSTIVE=1`. For tests of many kernel variants that compute the same
/// function: each variant is a kernel to compile, seconds apiece on lavapipe, and the 2-core CI
/// cannot compile them all; each run checks others, and the seed that a failure prints draws
/// the same sample again.
pub fn sample<T: Clone>(items: &[T], n: usize, seed: u64) -> Vec<T> {
    if std::env::var("MANTISSA_TEST_EXHAUSTIVE").is_ok_and(|v| v == "1") || items.len() <= n {
        return items.to_vec();
    }
    use rand::SeedableRng as _;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut kept = rand::seq::index::sample(&mut rng, items.len(), n).into_vec();
    kept.sort_unstable();
    kept.into_iter().map(|i| items[i].clone()).collect()
}

/// A fresh wgpu backend (for tests that need its own API), or None after printing why it is
/// skipped; in CI a missing adapter fails instead, as in `on`.
pub fn fresh_wgpu(test: &str, options: WgpuOptions) -> Option<WgpuBackend> {
    match WgpuBackend::open_nth(0, options).block_on() {
        Ok(b) => Some(b),
        Err(why) => {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{test}: backend required in CI but absent: {why}");
            }
            skip(test, &format!("backend absent: {why}"));
            None
        }
    }
}

/// Asserts that `got`, `who`'s C = A.B under `alg`, keeps the numerics contract against the
/// host reference: every element within its tolerance, and the whole product within its band
/// (measure::check_product).
#[allow(clippy::too_many_arguments)]
pub fn assert_contract(
    who: &str,
    alg: &Algorithm,
    shape: &MatmulShape,
    a: &[f32],
    b: &[f32],
    got: &[f32],
    what: &str,
) {
    let want = host::matmul(shape, alg, a, b).expect("the reference's product");
    let check = measure::check_product(alg, shape, (a, b), got, &want).expect("the check");
    assert!(
        check.holds(),
        "{who} {alg} {what} {shape:?}: {} of {} elements break the contract; {}",
        check.count,
        got.len(),
        check.findings().join("; ")
    );
}

/// A backend's matmul, checked against the reference's on one shape and input set.
pub fn check_matmul(
    backend: &dyn Backend,
    alg: &Algorithm,
    shape: &MatmulShape,
    a: &[f32],
    b: &[f32],
    what: &str,
) -> Vec<f32> {
    let got = backend
        .matmul(shape, alg, a, b)
        .block_on()
        .unwrap_or_else(|e| panic!("{} {alg} {what}: {e}", backend.name()));
    assert_contract(&backend.name(), alg, shape, a, b, &got, what);
    got
}

/// Every `got[i]` within `tol * (1 + |want[i]|)` of `want[i]`.
pub fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs reference {w}"
        );
    }
}

/// `close` where both values are finite; elsewhere the same non-finite value (NaN for NaN, the
/// same infinity).
pub fn close_with_edges(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let agree = match (g.is_finite(), w.is_finite()) {
            (true, true) => (g - w).abs() <= tol * (1.0 + w.abs()),
            _ => (g.is_nan() && w.is_nan()) || g == w,
        };
        assert!(agree, "{what}[{i}]: {g} vs reference {w}");
    }
}

/// Operands and algorithms for checking that the product alone over prepared operands
/// computes C again (the bench's `Operands::Prepared`): A in a wide range (lines beyond f16's
/// range, flagged for the fallback on cooperative matrices) with an inf, B normal; every
/// algorithm, fp8 also rowwise and with given scales.
pub fn prepared_cases(shape: &MatmulShape, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<Algorithm>) {
    use mantissa::algorithm::Scaling;
    use mantissa::format::Format;
    let mut a = measure::wide_range(shape.a_len(), seed);
    let b = measure::normal(shape.b_len(), seed + 1);
    a[5] = f32::INFINITY;
    let mut algorithms = Algorithm::ALL.to_vec();
    algorithms.extend([
        Algorithm::fp8(Format::E4m3, Format::E5m2).with_scaling(Scaling::Rowwise),
        Algorithm::fp8(Format::E4m3, Format::E4m3).with_scaling(Scaling::Given { a: 4.0, b: 0.5 }),
    ]);
    (a, b, algorithms)
}

/// Whether two results are the same bits everywhere.
pub fn same_bits(x: &[f32], y: &[f32]) -> bool {
    x.len() == y.len() && x.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits())
}

/// A product rounded to bf16 and to f16 as `b`'s kernel stores it on `tile`
/// (`WgpuBackend::matmul_rounded_on_tile`, a step plan's `Op::Matmul` holding its product) is
/// the unrounded product on the same tile rounded on the host, bit for bit (NaN as NaN).
pub fn assert_rounded_store(
    b: &WgpuBackend,
    (alg, tile): (&Algorithm, mantissa::backend::wgpu::shaders::Tile),
    shape: &MatmulShape,
    (a, bm): (&[f32], &[f32]),
    what: &str,
) {
    use mantissa::format::Format;
    let product = b
        .matmul_on_tile(shape, alg, tile, a, bm)
        .block_on()
        .unwrap();
    for held in [Format::Bf16, Format::F16] {
        let mut want = product.clone();
        host::ops::round_to(&mut want, held);
        let got = b
            .matmul_rounded_on_tile(shape, alg, tile, (a, bm), held)
            .block_on()
            .unwrap();
        let differ: Vec<usize> = (0..want.len())
            .filter(|&i| {
                got[i].to_bits() != want[i].to_bits() && !(got[i].is_nan() && want[i].is_nan())
            })
            .collect();
        assert!(
            differ.is_empty(),
            "{what}: {alg} tile {tile} {shape:?} held in {held}: {} outputs differ from the \
             product rounded on the host, first {:?}",
            differ.len(),
            differ.first().map(|&i| (i, got[i], want[i]))
        );
    }
}

/// A linear layer's bias add and GELU in the store of `b`'s kernel on `tile`
/// (`WgpuBackend::matmul_bias_add_on_tile`, as a step plan folds the add after its matmul),
/// the sum held in bf16 and in f16 (the product read as held in f16, the bias in the sum's
/// format), the GELU in f32 and in the sum's format: C stored as codes is the sum stored as
/// f32 bit for bit (NaN as NaN), and both are the add's definition over the unrounded
/// product on the same tile; the GELU's codes are the GELU stored as f32 values, held.
pub fn assert_bias_add_into_codes(
    b: &WgpuBackend,
    (alg, tile): (&Algorithm, mantissa::backend::wgpu::shaders::Tile),
    shape: &MatmulShape,
    (a, bm, bias): (&[f32], &[f32], &[f32]),
    what: &str,
) {
    use mantissa::format::Format;
    let product = b
        .matmul_on_tile(shape, alg, tile, a, bm)
        .block_on()
        .unwrap();
    for held in [Format::Bf16, Format::F16] {
        let mut rounded_bias = bias.to_vec();
        host::ops::round_to(&mut rounded_bias, held);
        let mut want = product.clone();
        host::ops::round_to(&mut want, Format::F16);
        for (i, w) in want.iter_mut().enumerate() {
            *w += rounded_bias[i % shape.n];
        }
        host::ops::round_to(&mut want, held);
        for gelu in [Format::F32, held] {
            let formats = [Format::F16, held, held, gelu];
            let run = |coded| {
                b.matmul_bias_add_on_tile(shape, alg, tile, (a, bm), bias, formats, coded)
                    .block_on()
                    .unwrap()
            };
            let ((sums, gelus), (coded_sums, coded_gelus)) = (run(false), run(true));
            let case = format!("{what}: {alg} tile {tile} {shape:?}, held in {held}, GELU {gelu}");
            same_or_nan(&format!("{case}: the sums stored as f32"), &sums, &want);
            same_or_nan(
                &format!("{case}: the sums stored as codes"),
                &coded_sums,
                &want,
            );
            same_or_nan(
                &format!("{case}: the GELU stored as codes"),
                &coded_gelus,
                &gelus,
            );
        }
    }
}

/// The inputs of a norm's backward over `rows` rows of `c`: x, the gain g, a gradient dy whose
/// first values are `measure::boundary_values` (NaN, infinities, f16's overflow and
/// subnormals), and each row's layer-norm (mean, rstd) pair and RMS-norm rstd.
pub struct NormBackwardInputs {
    pub x: Vec<f32>,
    pub g: Vec<f32>,
    pub dy: Vec<f32>,
    pub stats: Vec<f32>,
    pub rstd: Vec<f32>,
}

pub fn norm_backward_inputs(rows: usize, c: usize, seed: u64) -> NormBackwardInputs {
    let mut dy = measure::normal(rows * c, seed + 2);
    for (v, e) in dy.iter_mut().zip(measure::boundary_values()) {
        *v = e;
    }
    NormBackwardInputs {
        x: measure::normal(rows * c, seed),
        g: measure::normal(c, seed + 1),
        dy,
        stats: (0..rows).flat_map(|r| [0.1 * r as f32, 1.5]).collect(),
        rstd: (0..rows).map(|r| 1.0 + 0.01 * r as f32).collect(),
    }
}

/// Asserts the same bits, NaN for NaN (the host's NaN may carry another payload).
pub fn same_or_nan(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let differ = got
        .iter()
        .zip(want)
        .position(|(g, w)| g.to_bits() != w.to_bits() && !(g.is_nan() && w.is_nan()));
    if let Some(i) = differ {
        panic!("{what}, element {i}: {:e}, not {:e}", got[i], want[i]);
    }
}

/// `same_or_nan`, but where the wanted value is subnormal a device may give zero (one that
/// flushes subnormals, as Mesa 26's lavapipe does).
pub fn same_or_flushed(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let differ = got.iter().zip(want).position(|(g, w)| {
        let flushed = w.abs() < f32::MIN_POSITIVE && *g == 0.0;
        g.to_bits() != w.to_bits() && !(g.is_nan() && w.is_nan()) && !flushed
    });
    if let Some(i) = differ {
        panic!("{what}, element {i}: {:e}, not {:e}", got[i], want[i]);
    }
}

/// Elementwise tolerance of fused attention against its definition (`ops::attention_fwd`,
/// `attention_bwd`): where a value is held in a 16-bit format, the kernel's f32 sums and the
/// reference's f64 sums can round to neighbouring values, and such a flip in a score or a
/// probability moves what follows by an ulp or two of that format (tf32 included: P is rounded
/// to it where it multiplies v); with f32 alone, the reductions' order (`train_tolerance::REDUCTION`).
pub fn attention_tolerance(spec: &mantissa::plan::Attention) -> f32 {
    let (inputs, _) = spec.algorithm.operand_formats();
    let eps = [inputs, spec.probs, spec.compute]
        .iter()
        .filter(|&&f| f != mantissa::format::Format::F32)
        .map(|f| f.finfo().eps as f32)
        .fold(0.0, f32::max);
    mantissa::measure::train_tolerance::REDUCTION.max(4.0 * eps)
}

/// Each value within `tol (1 + |want|)`, non-finite values where the reference has the same
/// ones (NaN for NaN, the same infinity), and the whole within `tol / 4` relative in norm.
pub fn attention_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (mut diff, mut norm) = (0f64, 0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if !w.is_finite() || !g.is_finite() {
            let same = (w.is_nan() && g.is_nan()) || g == w;
            assert!(same, "{what}[{i}]: {g} vs reference {w}");
            continue;
        }
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs reference {w} (tolerance {tol})"
        );
        diff += ((g - w) as f64).powi(2);
        norm += (w as f64).powi(2);
    }
    let rel = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
    assert!(
        rel <= (tol / 4.0) as f64,
        "{what}: relative error {rel:.3e} in norm"
    );
}

/// Values a kernel held in `format`: each one a value of the format, and within one step of
/// it (its epsilon relative, or its smallest subnormal) of the host's f32 result `want`, beyond
/// the f32 computations' own difference (`tol * (1 + |want|)`, as `close`).
pub fn held_close(
    what: &str,
    got: &[f32],
    want: &[f32],
    format: mantissa::format::Format,
    tol: f32,
) {
    assert_eq!(got.len(), want.len(), "{what}");
    let info = format.finfo();
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let rounded = format.round(g, mantissa::format::Overflow::Standard);
        assert_eq!(
            rounded.to_bits(),
            g.to_bits(),
            "{what}[{i}] = {g} is not a {format} value"
        );
        let step = (w.abs() as f64 * info.eps).max(info.smallest_subnormal);
        let allowed = step + (tol * (1.0 + w.abs())) as f64;
        assert!(
            ((g - w).abs() as f64) <= allowed,
            "{what}[{i}]: {g}, the reference {w} (one step: {step}, allowed {allowed})"
        );
    }
}

/// A plan of one op on tensors of given values (`plan::Op` is the only way an op reaches a
/// backend): run once by a backend's executor and by the host interpreter, the reference's.
pub struct OneOp {
    pub g: PlanBuilder,
    pub batch: (TensorId, TensorId),
    pub values: Vec<(TensorId, Vec<f32>)>,
    /// `plan::Stats` of the plan (`UnscaleCheck` takes a gradient's slots).
    pub grads: usize,
}

/// What a run of a `OneOp` gave: the values of the tensors asked for, and the stats.
pub struct Ran {
    pub outs: Vec<Vec<f32>>,
    pub stats: Vec<f64>,
}

impl OneOp {
    /// A plan whose batch has `rows` tokens and targets.
    pub fn new(rows: usize) -> OneOp {
        let mut g = PlanBuilder::default();
        let batch = (
            g.tensor(rows, TensorKind::Tokens),
            g.tensor(rows, TensorKind::Targets),
        );
        OneOp {
            g,
            batch,
            values: vec![],
            grads: 0,
        }
    }

    /// A tensor the run starts from `values` (written before it) and that keeps its values
    /// after it (not a temporary).
    pub fn input(&mut self, values: Vec<f32>) -> TensorId {
        let t = self.output(values.len());
        self.values.push((t, values));
        t
    }

    /// A tensor the op writes, kept after the run to be read back.
    pub fn output(&mut self, len: usize) -> TensorId {
        self.g.tensor(len, TensorKind::Partial)
    }

    /// The plan of `op`.
    pub fn plan(mut self, op: Op) -> (Plan, Vec<(TensorId, Vec<f32>)>) {
        self.g.push(op);
        let mut outline = Outline::ops_alone(1, 1, self.batch, self.batch.0);
        outline.stats.grads = self.grads;
        (self.g.finish(outline).expect("a valid plan"), self.values)
    }

    /// `op` run once by `b`'s executor and by the host interpreter on the batch (tokens, targets)
    /// with `scalars` (`StepScalars` of `loss_scale`, AdamW at step 3, part 2, no clip); the values of
    /// `outs` after it.
    pub fn run_both(
        self,
        b: &dyn Backend,
        op: Op,
        batch: (&[u32], &[u32]),
        loss_scale: f32,
        outs: &[TensorId],
    ) -> [Ran; 2] {
        let (plan, values) = self.plan(op);
        [true, false].map(|resident| run_plan(b, &plan, &values, resident, batch, loss_scale, outs))
    }

    /// `op` run once by `b`'s own executor alone (`run_both`'s first).
    pub fn run(
        self,
        b: &dyn Backend,
        op: Op,
        batch: (&[u32], &[u32]),
        loss_scale: f32,
        outs: &[TensorId],
    ) -> Ran {
        let (plan, values) = self.plan(op);
        run_plan(b, &plan, &values, true, batch, loss_scale, outs)
    }
}

fn run_plan(
    b: &dyn Backend,
    plan: &Plan,
    values: &[(TensorId, Vec<f32>)],
    resident: bool,
    (tokens, targets): (&[u32], &[u32]),
    loss_scale: f32,
    outs: &[TensorId],
) -> Ran {
    let scalars = mantissa::plan::scalar::StepScalars {
        adamw: &mantissa::plan::AdamW::default(),
        clip: 0.0,
        loss_scale,
        poison: 0.0,
        t: 3,
        parts: 1,
        part: 2,
        fp8: &[],
        eval: false,
    }
    .array(plan.rows(), plan.scalar_count());
    let mut exec = mantissa::backend::executor(b, plan.clone(), resident).unwrap();
    for (t, v) in values {
        exec.write(*t, v).block_on().unwrap();
    }
    let stats = exec
        .run(mantissa::plan::Section::Step, tokens, targets, &scalars)
        .block_on()
        .unwrap_or_else(|e| panic!("{} on {}: {e}", plan.ops()[0].name(), b.name()));
    let outs = outs
        .iter()
        .map(|&t| exec.read(t).block_on().unwrap())
        .collect();
    Ran { outs, stats }
}

/// q|k|v (B, T, 3C) of `spec` whose q and k are small integers (-3..=3) and v N(0, 1): every
/// score is an integer that f32 sums hold exactly in any order, so a fused kernel's scaled
/// scores (`plan::ScoreScale`: times the scale, held) are its definition's to the bit, and so is
/// each row's max (`same_row_maxes`), whichever way the kernel sums.
pub fn integer_scores_qkv(spec: &mantissa::plan::Attention, seed: u64) -> Vec<f32> {
    let c = spec.h * spec.d;
    let ints = measure::uniform(spec.qkv_len(), -3.5, 3.5, seed);
    let normal = measure::normal(spec.qkv_len(), seed + 1);
    (0..spec.qkv_len())
        .map(|e| match e % (3 * c) < 2 * c {
            true => ints[e].round(),
            false => normal[e],
        })
        .collect()
}

/// Each score row's max (the even entries of an attention's (max, sum) stats) bit for bit.
pub fn same_row_maxes(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (r, (g, w)) in got.iter().zip(want).step_by(2).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}: row {r}'s max {g} vs {w}");
    }
}

/// A safetensors file's tensors by name (shape, values), every one f32 (the parity fixtures).
pub type Tensors = std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// The tensors of safetensors `bytes`, each of which must be f32.
pub fn f32_tensors(bytes: &[u8]) -> Result<Tensors, String> {
    use safetensors::tensor::{Dtype, SafeTensors};
    let st = SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    let mut out = Tensors::new();
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(format!("{name}: {:?}, not f32", view.dtype()));
        }
        let values = (view.data().chunks_exact(4))
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        out.insert(name, (view.shape().to_vec(), values));
    }
    Ok(out)
}

/// A file of the repository, `rel` from its root: where the tests were built, or, where that
/// path is gone (a test executable carried to another machine, run from the repository's root
/// there), the same path from the current directory.
pub fn repo_file(rel: &str) -> std::path::PathBuf {
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    match built.exists() {
        true => built,
        false => std::path::PathBuf::from(rel),
    }
}

/// Runs the test `name` of this test binary again in a child process whose address space is
/// limited to `bytes` (`ulimit -v`), and returns its output; in that child, returns None (the
/// test's body then runs there). An abort in the child (an allocation that failed) is its exit
/// status, not the whole suite's.
#[cfg(target_os = "linux")]
pub fn under_address_limit(name: &str, bytes: u64) -> Option<std::process::Output> {
    const CHILD: &str = "MANTISSA_TEST_ADDRESS_LIMIT";
    if std::env::var_os(CHILD).is_some() {
        return None;
    }
    use std::os::unix::process::CommandExt;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap());
    child
        .args(["--exact", name, "--test-threads=1", "--nocapture"])
        .env(CHILD, "1");
    // SAFETY: setrlimit between fork and exec touches nothing the parent holds.
    unsafe {
        child.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            match libc::setrlimit(libc::RLIMIT_AS, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    Some(child.output().unwrap())
}

/// Two ranks that hold the same batch: every sum doubles (exactly, in f32), so a data-parallel
/// step on it is deterministic (the mean over the ranks is each rank's own gradient: the run
/// trains as one rank alone), and a bucket summed before the backward pass is done with it
/// shows (a later write or read of the tensor sees, or overwrites, the doubled value).
pub struct Twins;

impl mantissa::dist::Collective for Twins {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        2
    }
    fn local_rank(&self) -> usize {
        0
    }
    fn local_size(&self) -> usize {
        1
    }
    fn engine(&self) -> String {
        "twins".into()
    }
    fn sum_f32(&self, values: &mut [f32]) -> mantissa::Result<()> {
        values.iter_mut().for_each(|x| *x *= 2.0);
        Ok(())
    }
    fn sum_f64(&self, values: &mut [f64]) -> mantissa::Result<()> {
        values.iter_mut().for_each(|x| *x *= 2.0);
        Ok(())
    }
    fn max_f64(&self, _: &mut [f64]) -> mantissa::Result<()> {
        Ok(())
    }
    fn broadcast(&self, _: &mut Vec<u8>, _: usize) -> mantissa::Result<()> {
        Ok(())
    }
    fn barrier(&self) -> mantissa::Result<()> {
        Ok(())
    }
    fn abort(&self, _: i32) {}
}
