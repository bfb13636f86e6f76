//! The portability report: it passes on the backends present, and it fails (the CI gate) when
//! a backend breaks the contract.

mod common;

use mantissa::algorithm::{Algorithm, MatmulShape};
use mantissa::backend::reference::HostExecutor;
use mantissa::backend::{Backend, BackendKind, Reference};
use mantissa::format::{Format, Overflow};
use mantissa::plan::{AdamW, Plan, ScoreScale, StepExecutor};
use mantissa::policy::Capabilities;
use mantissa::report::{self, Family, ReportConfig};
use pollster::FutureExt as _;

fn config(kinds: Vec<BackendKind>) -> ReportConfig {
    ReportConfig {
        kinds,
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

/// The reference with one deliberate fault in each of two ops (its training ops are the
/// reference's).
struct Faulty;

#[mantissa::backend::async_trait]
impl Backend for Faulty {
    fn kind(&self) -> BackendKind {
        BackendKind::Wgpu
    }
    fn name(&self) -> String {
        "faulty".into()
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
        let mut c = Reference.matmul(shape, algorithm, a, b).await?;
        if *algorithm == Algorithm::Bf16x3 {
            // A wrong element, far outside any tolerance even where the true value is near 0.
            c[0] = c[0] * 1.001 + 1.0;
        }
        if *algorithm == Algorithm::F32 {
            if let Some(v) = c.iter_mut().find(|v| v.is_infinite()) {
                *v = f32::NAN; // inf turned into NaN
            }
        }
        Ok(c)
    }
    async fn encode(
        &self,
        format: Format,
        overflow: Overflow,
        x: &[f32],
    ) -> mantissa::Result<Vec<u32>> {
        let mut codes = Reference.encode(format, overflow, x).await?;
        if format == Format::E5m2 && overflow == Overflow::Saturate {
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

    // The training ops as the reference computes them.
    async fn layernorm_fwd(&self, x: &[f32], g: &[f32], b: &[f32], c: usize) -> R<Vec3> {
        Reference.layernorm_fwd(x, g, b, c).await
    }
    async fn layernorm_bwd(
        &self,
        dy: &[f32],
        x: &[f32],
        g: &[f32],
        mean: &[f32],
        rstd: &[f32],
        c: usize,
    ) -> R<Vec3> {
        Reference.layernorm_bwd(dy, x, g, mean, rstd, c).await
    }
    async fn gelu_fwd(&self, x: &[f32]) -> R<Vec<f32>> {
        Reference.gelu_fwd(x).await
    }
    async fn gelu_bwd(&self, x: &[f32], dy: &[f32]) -> R<Vec<f32>> {
        Reference.gelu_bwd(x, dy).await
    }
    async fn causal_softmax_fwd(&self, x: &[f32], t: usize, scale: ScoreScale) -> R<Vec<f32>> {
        Reference.causal_softmax_fwd(x, t, scale).await
    }
    async fn causal_softmax_bwd(
        &self,
        p: &[f32],
        dp: &[f32],
        t: usize,
        s: ScoreScale,
    ) -> R<Vec<f32>> {
        Reference.causal_softmax_bwd(p, dp, t, s).await
    }
    async fn cross_entropy_fwd(&self, l: &[f32], t: &[u32], v: usize) -> R<(f64, Vec<f32>)> {
        Reference.cross_entropy_fwd(l, t, v).await
    }
    async fn cross_entropy_bwd(&self, p: &[f32], t: &[u32], v: usize, d: f64) -> R<Vec<f32>> {
        Reference.cross_entropy_bwd(p, t, v, d).await
    }
    #[allow(clippy::too_many_arguments)]
    async fn adamw(
        &self,
        opt: &AdamW,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        t: u32,
        decay: bool,
    ) -> R<()> {
        Reference.adamw(opt, p, g, m, v, t, decay).await
    }
    async fn embedding_fwd(&self, table: &[f32], ids: &[u32], c: usize) -> R<Vec<f32>> {
        Reference.embedding_fwd(table, ids, c).await
    }
    async fn embedding_bwd(&self, d: &[f32], ids: &[u32], rows: usize, c: usize) -> R<Vec<f32>> {
        Reference.embedding_bwd(d, ids, rows, c).await
    }
    async fn unscale_check(&self, g: &mut [f32], inverse_scale: f32) -> R<bool> {
        Reference.unscale_check(g, inverse_scale).await
    }
    fn resident_executor<'a>(&'a self, plan: Plan) -> R<Box<dyn StepExecutor + 'a>> {
        Ok(Box::new(HostExecutor::new(self, plan)))
    }
}

type R<T> = mantissa::Result<T>;
type Vec3 = (Vec<f32>, Vec<f32>, Vec<f32>);

#[test]
fn report_fails_when_a_backend_breaks_the_contract() {
    let backends: Vec<&dyn Backend> = vec![&Reference, &Faulty];
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
