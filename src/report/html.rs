//! `report.html`: one self-contained page (inline CSS and SVG charts drawn with plotters), so
//! it opens offline with no CDN.

use super::{MatmulCheck, Report};
use plotters::prelude::*;
use std::fmt::Write;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn sci(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.2e}")
    } else {
        format!("{x}")
    }
}

/// Errors below this are drawn at it (exact results have error 0, which a log axis cannot show).
const FLOOR: f64 = 1e-9;
/// Non-finite errors are drawn at this height.
const CEILING: f64 = 10.0;
/// The axis goes higher than any bar: the legend sits in the band above CEILING.
const AXIS_TOP: f64 = 1e5;

/// Grouped bars of relative error per algorithm (groups) and backend (bars), log scale.
fn error_chart(
    title: &str,
    rows: &[&MatmulCheck],
    algorithms: &[String],
    backends: &[String],
) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1040, 400)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..algorithms.len() as f64, (FLOOR..AXIS_TOP).log_scale())
            .map_err(|e| e.to_string())?;
        // Short labels so that neighbours do not collide: "e4m3-e5m2:rowwise" -> "e4m3-e5m2:row".
        let labels: Vec<String> = algorithms
            .iter()
            .map(|a| a.replace(":rowwise", ":row").replace(":tensorwise", ""))
            .collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(algorithms.len() * 2 + 1)
            .x_label_formatter(&|x| {
                let i = x.floor() as usize;
                if (x - x.floor() - 0.5).abs() < 0.01 {
                    labels.get(i).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc("relative error vs f64 product")
            .y_labels(16)
            .y_label_formatter(&|y| {
                if *y <= CEILING * 1.01 {
                    format!("{y:.0e}")
                } else {
                    String::new()
                }
            })
            .draw()
            .map_err(|e| e.to_string())?;
        let width = 0.8 / backends.len().max(1) as f64;
        for (bi, backend) in backends.iter().enumerate() {
            let color = Palette99::pick(bi).mix(0.85);
            let bars: Vec<Rectangle<(f64, f64)>> = algorithms
                .iter()
                .enumerate()
                .filter_map(|(ai, alg)| {
                    let r = rows
                        .iter()
                        .find(|r| &r.backend == backend && &r.algorithm == alg)?;
                    let v = if r.relative_error.is_finite() {
                        r.relative_error.clamp(FLOOR, CEILING)
                    } else {
                        CEILING
                    };
                    let x0 = ai as f64 + 0.1 + bi as f64 * width;
                    Some(Rectangle::new(
                        [(x0, FLOOR), (x0 + width * 0.9, v)],
                        color.filled(),
                    ))
                })
                .collect();
            chart
                .draw_series(bars)
                .map_err(|e| e.to_string())?
                .label(backend.clone())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperMiddle)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// The whole page.
pub fn render_html(report: &Report) -> String {
    let mut h = String::new();
    let verdict = if report.passed {
        "<p class=ok>PASSED: every backend named was checked and keeps the numerics contract.</p>"
            .to_string()
    } else {
        format!(
            "<p class=bad>FAILED: {}.</p>",
            esc(&report.failures.join("; "))
        )
    };
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=utf-8><title>mantissa precision portability report</title>\
         <style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}table{{border-collapse:collapse;margin:1em 0}}\
         td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}}th{{background:#f0f0f0}}\
         .ok{{color:#070;font-weight:bold}}.bad{{color:#b00;font-weight:bold}}td.bad{{background:#fdd}}\
         code{{background:#f4f4f4}}</style></head><body>\
         <h1>mantissa precision portability report</h1>\
         <p>mantissa {} &middot; seed {} &middot; shapes {:?} &middot; input families {}</p>{verdict}",
        report.version,
        report.seed,
        report.shapes,
        esc(&report.families.join(", "))
    );

    h.push_str("<h2>Backends and precision classes</h2><table><tr><th>backend</th><th>device</th><th>highest</th><th>high</th><th>medium</th></tr>");
    for b in &report.backends {
        let class = |i: usize| {
            b.precision_classes
                .get(i)
                .map(|c| c.1.clone())
                .unwrap_or_default()
        };
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            esc(&b.name),
            esc(&b.device),
            class(0),
            class(1),
            class(2)
        );
    }
    for s in &report.skipped {
        let _ = write!(
            h,
            "<tr><td>{}</td><td colspan=4>skipped: {}</td></tr>",
            esc(&s.backend),
            esc(&s.reason)
        );
    }
    h.push_str("</table>");

    let backends: Vec<String> = report.backends.iter().map(|b| b.name.clone()).collect();
    let mut algorithms: Vec<String> = Vec::new();
    for m in &report.matmuls {
        if !algorithms.contains(&m.algorithm) {
            algorithms.push(m.algorithm.clone());
        }
    }
    if let Some(&(m, n, k)) = report.shapes.iter().max_by_key(|(m, n, k)| m * n * k) {
        h.push_str("<h2>Error by algorithm and backend</h2><p>Bars at the bottom are exact to 1e-9 or better; bars reaching 1e1 are inf or NaN (overflow, or non-finite inputs reaching the output). The error counts only entries whose exact value fits in f32.</p>");
        for family in &report.families {
            let rows: Vec<&MatmulCheck> = report
                .matmuls
                .iter()
                .filter(|r| &r.family == family && r.shape == (m, n, k))
                .collect();
            let title = format!("{family} inputs, {m}x{n}x{k}");
            match error_chart(&title, &rows, &algorithms, &backends) {
                Ok(svg) => h.push_str(&svg),
                Err(e) => {
                    let _ = write!(
                        h,
                        "<p class=bad>chart {} failed: {}</p>",
                        esc(&title),
                        esc(&e)
                    );
                }
            }
        }
    }

    h.push_str("<h2>Training: tiny GPT, the same steps per preset on each backend</h2>");
    if let Some(note) = &report.training_note {
        let _ = write!(h, "<p>{}</p>", esc(note));
    }
    if !report.training.is_empty() {
        let curves: Vec<LossCurve> = report
            .training
            .iter()
            .map(|t| LossCurve {
                label: format!(
                    "{} on {}",
                    t.preset,
                    t.backend.split(" (").next().unwrap_or(&t.backend)
                ),
                losses: t
                    .losses
                    .iter()
                    .enumerate()
                    .map(|(s, &l)| (s as u32 + 1, l))
                    .collect(),
                points: vec![],
            })
            .collect();
        match loss_chart("training loss (nats) by preset and backend", &curves) {
            Ok(svg) => h.push_str(&svg),
            Err(e) => {
                let _ = write!(h, "<p class=bad>loss chart failed: {}</p>", esc(&e));
            }
        }
        h.push_str("<p>The curves of one preset coincide where the backends agree.</p><table><tr><th>preset</th><th>backend</th><th>matmuls</th><th>steps</th><th>final loss</th><th>stopped</th></tr>");
        for t in &report.training {
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&t.preset),
                esc(&t.backend),
                esc(&t.matmul_algorithm),
                t.losses.len(),
                t.final_loss
                    .map(|l| format!("{l:.4}"))
                    .unwrap_or_else(|| "-".into()),
                esc(t.stopped.as_deref().unwrap_or(""))
            );
        }
        h.push_str("</table>");
    }
    h.push_str("<h2>Casts, splits and amax against the reference (bit for bit)</h2><table><tr><th>backend</th><th>op</th><th>values</th><th>mismatches</th><th>first mismatch</th></tr>");
    for c in &report.casts {
        let cls = if c.mismatches == 0 { "" } else { " class=bad" };
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td{cls}>{}</td><td>{}</td></tr>",
            esc(&c.backend),
            esc(&c.op),
            c.values,
            c.mismatches,
            esc(c.first_mismatch.as_deref().unwrap_or(""))
        );
    }
    h.push_str("</table>");

    h.push_str("<h2>Matmuls</h2><p>Contract breaks count elements whose non-finite pattern differs from the reference's result of the same algorithm, or whose value lies outside its accumulation tolerance. The band is the top of the relative error the whole product may reach: the reference's own (its rounding of the inputs) plus what f32 accumulation in another order may add; a product outside it (a sum missing terms) breaks the contract too.</p><table><tr><th>backend</th><th>algorithm</th><th>family</th><th>m x n x k</th><th>rel. error</th><th>band</th><th>max ulp</th><th>non-finite (ref.)</th><th>contract breaks</th><th>TFLOP/s</th></tr>");
    for r in &report.matmuls {
        let bad = |broken: bool| if broken { " class=bad" } else { "" };
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}x{}x{}</td><td{}>{}</td><td>{}</td><td>{}</td><td>{} ({})</td><td{} title=\"{}\">{}</td><td>{}</td></tr>",
            esc(&r.backend),
            esc(&r.algorithm),
            esc(&r.family),
            r.shape.0,
            r.shape.1,
            r.shape.2,
            bad(!r.whole_product.holds()),
            sci(r.relative_error),
            sci(r.whole_product.band),
            sci(r.max_ulp_error),
            r.nonfinite,
            r.nonfinite_reference,
            bad(r.contract_breaks > 0),
            esc(r.first_break.as_deref().unwrap_or("")),
            r.contract_breaks,
            r.tflops.map(|t| format!("{t:.3e}")).unwrap_or_default()
        );
    }
    h.push_str("</table>");
    h.push_str("</body></html>\n");
    h
}

/// One loss curve of a chart: the training loss per step, and evaluation points if any.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct LossCurve {
    /// The curve's name in the legend.
    pub label: String,
    /// (step, training loss) per step, steps from 1.
    pub losses: Vec<(u32, f64)>,
    /// (step, validation loss) points, drawn as markers.
    pub points: Vec<(u32, f64)>,
}

/// Loss curves as an SVG chart (used by the report and by `mantissa train`). Non-finite or
/// exploded losses (>= 10 nats) are left out so that a diverging run does not flatten the rest.
pub fn loss_chart(title: &str, curves: &[LossCurve]) -> Result<String, String> {
    let shown = |l: f64| l.is_finite() && l < 10.0;
    let all = || {
        curves
            .iter()
            .flat_map(|c| c.losses.iter().chain(&c.points))
            .map(|p| p.1)
            .filter(|l| shown(*l))
    };
    let hi = all().fold(1.0, f64::max).ceil();
    let lo = all().fold(hi, f64::min).floor().min(hi - 0.5);
    let last = curves
        .iter()
        .flat_map(|c| c.losses.last().map(|p| p.0))
        .max()
        .unwrap_or(1)
        .max(2);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1040, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0u32..last, lo..hi)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss (nats)")
            .draw()
            .map_err(|e| e.to_string())?;
        for (i, c) in curves.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let line: Vec<(u32, f64)> = c.losses.iter().copied().filter(|p| shown(p.1)).collect();
            chart
                .draw_series(LineSeries::new(line, color.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(c.label.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(3))
                });
            let points = c
                .points
                .iter()
                .filter(|p| shown(p.1))
                .map(|&p| Circle::new(p, 4, color.filled()));
            chart.draw_series(points).map_err(|e| e.to_string())?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.9))
            .draw()
            .map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}
