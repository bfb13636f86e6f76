//! The portability report: it passes on the backends present, and it fails (the CI gate) when
//! a backend breaks the contract.

mod common;

use mantissa::algorithm::{Algorithm, MatmulShape};
use mantissa::backend::reference::HostExecutor;
use mantissa::backend::{Backend, BackendKind, Reference};
use mantissa::format::{Format, Overflow};
use mantissa::measure;
use mantissa::plan::{Plan, StepExecutor};
use mantissa::policy::Capabilities;
use mantissa::report::{self, Family, ReportConfig};
use pollster::FutureExt as _;

fn config(kinds: Vec<BackendKind>) -> ReportConfig {
    ReportConfig {
        kinds,
        // An absent wgpu is skipped here (the test says so; CI requires it).
        skip_absent: true,
        shapes: vec![(19, 23, 70)],
        algorithms: ReportConfig::default_algorithms(),
        families: Family::ALL.to_vec(),
        seed: common::seed("report"),
        repetitions: 1,
        train_steps: 3,
        train_presets: vec![mantissa::Preset::True32, mantissa::Preset::Mixed16],
        corpus: concat!(env!("CARGO_MANIFEST_DIR"), "/data/shakespeare.txt").into(),
    }
}

#[test]
fn report_passes_on_reference_and_wgpu() {
    let report = report::run(
        &config(vec![BackendKind::Reference, BackendKind::Wgpu]),
        |_| {},
    )
    .block_on()
    .expect("report");
    let wgpu_present = report.backends.iter().any(|b| b.kind == "wgpu");
    if !wgpu_present && std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI must run the report on lavapipe: {:?}", report.skipped);
    }
    assert!(
        report.passed,
        "contract breaks: {:?} {:?}",
        report
            .casts
            .iter()
            .filter(|c| c.mismatches > 0)
            .collect::<Vec<_>>(),
        report
            .matmuls
            .iter()
            .filter(|m| m.contract_breaks > 0)
            .collect::<Vec<_>>()
    );
    let algorithms = ReportConfig::default_algorithms().len();
    assert_eq!(
        report.matmuls.len(),
        report.backends.len() * algorithms * Family::ALL.len()
    );
    assert_eq!(report.training.len(), 2 * report.backends.len());
    for line in &report.training {
        assert_eq!(line.losses.len(), 3, "{line:?}");
        assert!(
            line.final_loss.is_some_and(|l| l.is_finite() && l < 5.0),
            "{line:?}"
        );
    }
    let html = report::render_html(&report);
    assert!(
        html.contains("<svg")
            && html.contains("PASSED")
            && !html.contains("http://cdn")
            && !html.contains("<script src")
    );
}

/// A backend computing what the reference does except where `matmul` says otherwise (and one
/// wrong bit in e5m2's saturating encode where `faulty_encode`); its training ops are the
/// reference's.
struct Fake {
    name: &'static str,
    matmul: fn(&MatmulShape, &Algorithm, &[f32], &[f32]) -> Vec<f32>,
    faulty_encode: bool,
}

fn reference_matmul(shape: &MatmulShape, alg: &Algorithm, a: &[f32], b: &[f32]) -> Vec<f32> {
    mantissa::backend::reference::matmul(shape, alg, a, b).unwrap()
}

/// The reference with one deliberate fault in each of two ops.
const FAULTY: Fake = Fake {
    name: "faulty",
    matmul: |shape, algorithm, a, b| {
        let mut c = reference_matmul(shape, algorithm, a, b);
        if *algorithm == Algorithm::Bf16x3 {
            // A wrong element, far outside any tolerance even where the true value is near 0.
            c[0] = c[0] * 1.001 + 1.0;
        }
        if *algorithm == Algorithm::F32
            && let Some(v) = c.iter_mut().find(|v| v.is_infinite())
        {
            *v = f32::NAN; // inf turned into NaN
        }
        c
    },
    faulty_encode: true,
};

/// The reference's product over the first 7/8 of K only: a kernel that stops summing early,
/// as wgpu's did on lavapipe past 32768 terms.
const DROPPING: Fake = Fake {
    name: "dropping",
    matmul: |shape, algorithm, a, b| {
        let kept = shape.k * 7 / 8;
        let (m, n, k) = (shape.m, shape.n, shape.k);
        let a: Vec<f32> = (0..m * kept)
            .map(|e| a[(e / kept) * k + e % kept])
            .collect();
        reference_matmul(&MatmulShape::new(m, n, kept), algorithm, &a, &b[..kept * n])
    },
    faulty_encode: false,
};

#[mantissa::backend::async_trait]
impl Backend for Fake {
    fn kind(&self) -> BackendKind {
        BackendKind::Wgpu
    }
    fn name(&self) -> String {
        self.name.into()
    }
    fn device_name(&self) -> String {
        "a backend with bugs".into()
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
    async fn matmul(
        &self,
        shape: &MatmulShape,
        algorithm: &Algorithm,
        a: &[f32],
        b: &[f32],
    ) -> mantissa::Result<Vec<f32>> {
        Ok((self.matmul)(shape, algorithm, a, b))
    }
    async fn encode(
        &self,
        format: Format,
        overflow: Overflow,
        x: &[f32],
    ) -> mantissa::Result<Vec<u32>> {
        let mut codes = Reference.encode(format, overflow, x).await?;
        if self.faulty_encode && format == Format::E5m2 && overflow == Overflow::Saturate {
            codes[3] ^= 1; // one wrong bit
        }
        Ok(codes)
    }
    async fn decode(&self, format: Format, bits: &[u32]) -> mantissa::Result<Vec<f32>> {
        Reference.decode(format, bits).await
    }
    async fn split_bf16(&self, x: &[f32]) -> mantissa::Result<[Vec<u32>; 3]> {
        Reference.split_bf16(x).await
    }
    async fn amax(&self, x: &[f32]) -> mantissa::Result<f32> {
        Reference.amax(x).await
    }

    /// The reference's executor: training on this backend is the reference's.
    fn executor<'a>(&'a self, plan: Plan) -> R<Box<dyn StepExecutor + 'a>> {
        Ok(Box::new(HostExecutor::new(plan)?))
    }
}

type R<T> = mantissa::Result<T>;

#[test]
fn report_fails_when_a_backend_breaks_the_contract() {
    let backends: Vec<&dyn Backend> = vec![&Reference, &FAULTY];
    let report = report::run_on(
        &backends,
        vec![],
        &ReportConfig {
            train_steps: 0,
            ..config(vec![])
        },
        |_| {},
    )
    .block_on()
    .expect("report");
    assert!(!report.passed);
    let bad_casts: Vec<_> = report
        .casts
        .iter()
        .filter(|c| c.mismatches > 0)
        .map(|c| c.op.clone())
        .collect();
    assert_eq!(bad_casts, vec!["encode e5m2 (saturating)".to_string()]);
    let bad: Vec<_> = report
        .matmuls
        .iter()
        .filter(|m| m.contract_breaks > 0)
        .map(|m| (m.algorithm.clone(), m.family.clone()))
        .collect();
    assert!(
        bad.iter().all(|(a, _)| a == "bf16x3" || a == "f32"),
        "{bad:?}"
    );
    assert!(
        bad.contains(&("bf16x3".to_string(), "normal".to_string())),
        "{bad:?}"
    );
    assert!(
        bad.contains(&("f32".to_string(), "non-finite".to_string())),
        "{bad:?}"
    );
    assert!(report::render_html(&report).contains("FAILED"));
}

#[test]
fn a_product_missing_part_of_its_sum_breaks_the_contract() {
    // K long enough that the element-by-element bound, which grows as K |A||B|, misses the
    // missing eighth of sums of random sign for some algorithms: the whole product's band does
    // not, for any algorithm or family.
    let backends: Vec<&dyn Backend> = vec![&Reference, &DROPPING];
    let families = vec![Family::Normal, Family::WideRange, Family::Cancellation];
    let report = report::run_on(
        &backends,
        vec![],
        &ReportConfig {
            shapes: vec![(2, 3, 65536)],
            families: families.clone(),
            train_steps: 0,
            ..config(vec![])
        },
        |_| {},
    )
    .block_on()
    .expect("report");
    assert!(!report.passed);
    let (dropping, reference): (Vec<_>, Vec<_>) =
        report.matmuls.iter().partition(|m| m.backend == "dropping");
    assert_eq!(
        dropping.len(),
        ReportConfig::default_algorithms().len() * families.len()
    );
    // Where every output is non-finite (f16 and e4m3 on wide-range inputs overflow), the
    // non-finite pattern is what is checked; everywhere else the band sees the drop.
    let finite = |m: &&&report::MatmulCheck| m.nonfinite_reference < 6;
    assert!(dropping.iter().filter(finite).count() > 30);
    for m in dropping.iter().filter(finite) {
        assert!(!m.whole_product.holds(), "not seen: {m:?}");
    }
    assert!(
        dropping.iter().any(|m| m.contract_breaks == 0),
        "every product was caught element by element: the test no longer shows the band's use"
    );
    for m in &reference {
        assert!(
            m.whole_product.holds(),
            "the reference outside its band: {m:?}"
        );
    }
    assert!(
        report.failures.iter().any(|f| f.contains("whole product")),
        "{:?}",
        report.failures
    );
    assert!(report::render_html(&report).contains("FAILED"));
}

/// C = A.B as an honest f32 kernel computes it for the algorithms that round their inputs once
/// (f32, tf32, bf16, f16): each product exact, summed in f32 in the order `order` gives the
/// terms (`lanes` accumulators, each over every `lanes`-th term, then added up).
fn f32_sums(alg: &Algorithm, shape: &MatmulShape, a: &[f32], b: &[f32], lanes: usize) -> Vec<f32> {
    let (fa, fb) = alg.operand_formats();
    let (m, n, k) = (shape.m, shape.n, shape.k);
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = vec![0f32; lanes];
            for p in 0..k {
                let x = fa.round(a[i * k + p], Overflow::Standard);
                let y = fb.round(b[p * n + j], Overflow::Standard);
                acc[p % lanes] = x.mul_add(y, acc[p % lanes]);
            }
            c[i * n + j] = acc.iter().sum();
        }
    }
    c
}

#[test]
fn honest_f32_sums_stay_inside_the_band_and_a_dropped_eighth_does_not() {
    let k = 100_000;
    let shape = MatmulShape::new(2, 2, k);
    let seed = common::seed("honest_f32_sums");
    let constants = |v: f32| vec![v; 2 * k];
    let inputs: Vec<(&str, Vec<f32>, Vec<f32>)> = vec![
        // Repeated values round alike: their rounding errors add up, as K u |C|.
        ("constants", constants(0.1), constants(0.1)),
        (
            "one sign",
            measure::uniform(2 * k, 0.0, 1.0, seed),
            measure::uniform(2 * k, 0.0, 1.0, seed + 1),
        ),
        (
            "N(0,1)",
            measure::normal(2 * k, seed),
            measure::normal(2 * k, seed + 1),
        ),
        (
            "wide range",
            measure::wide_range(2 * k, seed),
            measure::wide_range(2 * k, seed + 1),
        ),
        (
            "cancelling constants",
            constants(0.1),
            (0..2 * k)
                .map(|e| if e / 2 < k / 2 { 0.1 } else { -0.1 })
                .collect(),
        ),
    ];
    for (what, a, b) in &inputs {
        for alg in [
            Algorithm::F32,
            Algorithm::Tf32,
            Algorithm::Bf16,
            Algorithm::F16,
        ] {
            let want = mantissa::backend::reference::matmul(&shape, &alg, a, b).unwrap();
            for lanes in [1, 4, 7] {
                let got = f32_sums(&alg, &shape, a, b, lanes);
                let check = measure::check_product(&alg, &shape, (a, b), &got, &want).unwrap();
                assert!(
                    check.holds(),
                    "{what} {alg} in {lanes} lane(s): {:?}",
                    check.findings()
                );
            }
        }
        // The same harness sees a sum that stops at 7/8 of K where terms have random signs.
        if *what == "N(0,1)" || *what == "wide range" {
            let alg = Algorithm::F32;
            let want = mantissa::backend::reference::matmul(&shape, &alg, a, b).unwrap();
            let got = (DROPPING.matmul)(&shape, &alg, a, b);
            let check = measure::check_product(&alg, &shape, (a, b), &got, &want).unwrap();
            assert!(
                !check.whole.holds(),
                "{what}: a dropped eighth not seen: {}",
                check.whole
            );
        }
    }
}

#[test]
fn the_gate_fails_on_a_backend_named_but_not_checked() {
    let absent = || {
        vec![report::Skipped {
            backend: "cuda".into(),
            reason: "no NVIDIA driver".into(),
        }]
    };
    let run = |backends: Vec<&dyn Backend>, skipped, skip_absent| {
        let config = ReportConfig {
            skip_absent,
            algorithms: vec![Algorithm::F32],
            families: vec![Family::Normal],
            train_steps: 0,
            ..config(vec![])
        };
        report::run_on(&backends, skipped, &config, |_| {})
            .block_on()
            .expect("report")
    };
    let named = run(vec![&Reference], absent(), false);
    assert!(!named.passed);
    assert!(
        named
            .failures
            .iter()
            .any(|f| f.contains("cuda was named but not checked")),
        "{:?}",
        named.failures
    );
    assert!(report::render_html(&named).contains("FAILED"));
    // `--backends all` skips what is absent, saying why.
    let all = run(vec![&Reference], absent(), true);
    assert!(all.passed && all.skipped.len() == 1, "{:?}", all.failures);
    // Nothing checked is no pass.
    assert!(!run(vec![], vec![], true).passed);
}

#[test]
fn a_missing_corpus_is_an_error_not_missing_training_lines() {
    let e = report::run_on(
        &[&Reference],
        vec![],
        &ReportConfig {
            corpus: "/nonexistent/corpus.txt".into(),
            algorithms: vec![Algorithm::F32],
            ..config(vec![])
        },
        |_| {},
    )
    .block_on()
    .expect_err("refused");
    assert!(e.to_string().contains("/nonexistent/corpus.txt"), "{e}");
}
