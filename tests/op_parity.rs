//! Per-op parity with PyTorch (issue #53): every op and loss of the model builder, as a one-op
//! model under 32-true, bf16-mixed and 16-mixed on every backend present, against what PyTorch
//! computed for the same inputs (tests/data/op_parity.*, written by
//! scripts/anchors/torch_op_parity.py with CUDA's autocast lists as casts): the output, and the
//! gradient of every input from a fixed upstream gradient.
//!
//! A one-op model: each input a parameter holding the fixture's values (the batch's ids, targets
//! and values inputs aside). An input a model holds in the compute format (the output of a
//! matmul-like op: a linear's x, GELU's input, q|k|v, logits) is that parameter times an
//! identity matrix (a matmul, exact in every format: the values are the format's), so the op
//! reads it as a model's op would, and its gradient comes back rounded to the compute format as
//! the gradient of a 16-bit tensor is (PyTorch's leaf of that dtype). Then the op, and for an op
//! that is not a loss the mean squared error of its output against a values input, whose
//! gradient the test replaces with the fixture's upstream gradient (a copy inserted into the
//! derived plan right after the loss op): the op's backward rule runs from exactly PyTorch's
//! upstream gradient, whatever its forward gave.
//!
//! The tolerance, per output tensor, from what the fixture records of it (the format PyTorch
//! holds it in, the narrowest rounding on the way, the longest sum behind it):
//! - the f32 arithmetic may differ (summation order; the reference sums in f64): by at most
//!   `NOISE` sqrt(k) units of 2^-24 of the tensor's largest value for a sum of k terms, of the
//!   value itself for an elementwise op (k = 1);
//! - a value held in 16 bits may then round the other way where its f32 value lies within that
//!   noise of a rounding boundary: one step of the format, in at most a share of the elements
//!   that the noise gives (`flip_rate`); a 16-bit rounding inside the op (the scaled scores of
//!   a softmax) moves an output by at most one step of that format at the tensor's scale, in
//!   as many elements as a row.
//!
//! A semantic difference (rounding twice where PyTorch rounds once, a bias in another format)
//! moves far more elements than the noise can: the linear layer, 40 of 64.

mod common;

use mantissa::backend::{self, Backend, BackendKind};
use mantissa::format::Format;
use mantissa::model::{Init, Model, ModelBuilder, PlanOptions, Var};
use mantissa::plan::scalar::StepScalars;
use mantissa::plan::{AdamW, Op, Outline, Plan, PlanBuilder, Section, Stats, Strided};
use mantissa::plan::{TensorId, TensorKind};
use mantissa::policy::precision::PrecisionRequest;
use mantissa::policy::{Precision, Preset};
use pollster::FutureExt as _;
use serde_json::Value;
use std::collections::BTreeMap;

/// Every op and loss of the model builder: each must have a case in the fixtures (`dropout`
/// aside: PyTorch's masks come from another generator, so no run of it computes ours; `split`
/// aside: its parts are `narrow`s; `causal_attention_masked` and `causal_attention_biased`
/// aside: the causal mask of `causal_attention` with the key padding mask of `attention_masked`
/// or the bias of `attention_biased`).
const BUILDER_OPS: [&str; 30] = [
    "embedding",
    "linear",
    "matmul",
    "layer_norm",
    "rms_norm",
    "gelu",
    "silu",
    "add",
    "mul",
    "causal_attention",
    "causal_softmax",
    "reshape",
    "cross_entropy",
    "mse",
    "relu",
    "sigmoid",
    "tanh",
    "softmax",
    "sum",
    "mean",
    "scale",
    "sub",
    "transpose",
    "concat",
    "narrow",
    "bmm",
    "attention",
    "attention_masked",
    "attention_biased",
    "rotary",
];

const PRESETS: [&str; 3] = ["32-true", "bf16-mixed", "16-mixed"];

/// Units of 2^-24 per sqrt(term) that two f32 evaluations of the same sum (or function) may
/// differ by: a sum of k terms rounds k times, a random walk of sqrt(k) half-units at one
/// sigma; 8 covers four sigma and the few ulps of f32 library functions (tanh, exp).
const NOISE: f64 = 8.0;

/// The fixtures, read once: the manifest and the tensors by name.
struct Fixtures {
    manifest: Value,
    tensors: common::Tensors,
}

fn fixtures() -> &'static Fixtures {
    static F: std::sync::OnceLock<Fixtures> = std::sync::OnceLock::new();
    F.get_or_init(|| {
        let data = common::repo_file("tests/data");
        let json = std::fs::read_to_string(data.join("op_parity.json")).expect("op_parity.json");
        let bytes = std::fs::read(data.join("op_parity.safetensors")).expect("the tensors");
        Fixtures {
            manifest: serde_json::from_str(&json).expect("the manifest"),
            tensors: common::f32_tensors(&bytes).expect("the tensors"),
        }
    })
}

/// One input of a case.
#[derive(Clone, Debug)]
struct Input {
    name: String,
    shape: Vec<usize>,
    /// "f32", "compute" or "ids".
    format: String,
    /// "param", "tokens", "targets" or "values".
    kind: String,
    values: Vec<f32>,
}

/// What the fixture says of one output tensor under one preset.
#[derive(Clone, Debug)]
struct Check {
    held: Format,
    inner: Format,
    sum: usize,
    /// Per element, the magnitude of the terms of the f32 formula that computes it, where the
    /// fixture gives one (GELU's and SiLU's tails): what its f32 noise is relative to.
    scale: Option<Vec<f32>>,
}

/// A case with its tensors, each checked against the shape the manifest records.
#[derive(Clone, Debug)]
struct Case {
    name: String,
    op: String,
    attrs: Value,
    inputs: Vec<Input>,
    output_shape: Option<Vec<usize>>,
    /// The upstream gradient of the output (none for a loss).
    dy: Option<Vec<f32>>,
    /// Per preset: per tensor ("out", "grad/NAME"), PyTorch's values and how to check them.
    expected: BTreeMap<String, BTreeMap<String, (Vec<f32>, Check)>>,
}

impl Case {
    fn is_loss(&self) -> bool {
        self.dy.is_none()
    }
}

fn format_named(name: &str) -> Result<Format, String> {
    match name {
        "f32" => Ok(Format::F32),
        "bf16" => Ok(Format::Bf16),
        "f16" => Ok(Format::F16),
        other => Err(format!("format {other:?}")),
    }
}

fn shape_of(v: &Value) -> Result<Vec<usize>, String> {
    serde_json::from_value(v.clone()).map_err(|e| format!("shape {v}: {e}"))
}

/// The tensor `key` of case `name`, which must have `shape`: a fixture whose tensor does not
/// match the shape its manifest records is refused, the case's op named.
fn tensor(
    tensors: &common::Tensors,
    (op, name): (&str, &str),
    key: &str,
    shape: &[usize],
) -> Result<Vec<f32>, String> {
    let full = format!("{name}/{key}");
    let (got, values) = tensors
        .get(&full)
        .ok_or_else(|| format!("{op} (case {name}): the fixtures have no tensor {full}"))?;
    let len: usize = shape.iter().product();
    if got[..] != shape[..] || values.len() != len {
        return Err(format!(
            "{op} (case {name}): fixture {full} is {got:?}, the manifest records {shape:?}"
        ));
    }
    Ok(values.clone())
}

/// The cases of the manifest with their tensors.
fn cases_of(manifest: &Value, tensors: &common::Tensors) -> Result<Vec<Case>, String> {
    let list = manifest["cases"]
        .as_array()
        .ok_or("the manifest has no cases")?;
    let mut cases = vec![];
    for c in list {
        let name = c["name"]
            .as_str()
            .ok_or("a case without a name")?
            .to_string();
        let op = c["op"].as_str().ok_or("a case without an op")?.to_string();
        let id = (op.as_str(), name.as_str());
        let mut inputs = vec![];
        for i in c["inputs"].as_array().ok_or("a case without inputs")? {
            let iname = i["name"].as_str().unwrap_or_default().to_string();
            let shape = shape_of(&i["shape"])?;
            let values = tensor(tensors, id, &format!("in/{iname}"), &shape)?;
            inputs.push(Input {
                name: iname,
                shape,
                format: i["format"].as_str().unwrap_or_default().to_string(),
                kind: i["kind"].as_str().unwrap_or_default().to_string(),
                values,
            });
        }
        let output_shape = match c.get("output_shape") {
            Some(s) => Some(shape_of(s)?),
            None => None,
        };
        let dy = match &output_shape {
            Some(s) => Some(tensor(tensors, id, "dy", s)?),
            None => None,
        };
        let mut expected = BTreeMap::new();
        for preset in PRESETS {
            let checks = c["presets"][preset]
                .as_object()
                .ok_or_else(|| format!("{op} (case {name}): no {preset} entry"))?;
            let mut per = BTreeMap::new();
            for (key, check) in checks {
                let shape = match key.strip_prefix("grad/") {
                    None => output_shape.clone().unwrap_or(vec![1]),
                    Some(input) => (inputs.iter().find(|i| i.name == input))
                        .ok_or_else(|| format!("{op} (case {name}): no input {input}"))?
                        .shape
                        .clone(),
                };
                let values = tensor(tensors, id, &format!("{preset}/{key}"), &shape)?;
                let scale = match check["scale"].as_bool() {
                    Some(true) => Some(tensor(tensors, id, &format!("scale/{key}"), &shape)?),
                    _ => None,
                };
                let check = Check {
                    held: format_named(check["held"].as_str().unwrap_or_default())?,
                    inner: format_named(check["inner"].as_str().unwrap_or_default())?,
                    sum: check["sum"].as_u64().unwrap_or(1) as usize,
                    scale,
                };
                per.insert(key.clone(), (values, check));
            }
            expected.insert(preset.to_string(), per);
        }
        cases.push(Case {
            name,
            op,
            attrs: c["attrs"].clone(),
            inputs,
            output_shape,
            dy,
            expected,
        });
    }
    Ok(cases)
}

fn cases() -> Vec<Case> {
    let fx = fixtures();
    cases_of(&fx.manifest, &fx.tensors).unwrap_or_else(|e| panic!("{e}"))
}

/// The one-op model of a case, and the values of its parameters in declaration order, with the
/// index of each input's parameter.
struct OneOp {
    model: Model,
    params: Vec<Vec<f32>>,
    /// (input name, parameter index) for the inputs that take a gradient.
    grads: Vec<(String, usize)>,
    ids: Vec<u32>,
    targets: Vec<u32>,
    /// The values inputs in declaration order.
    values: Vec<Vec<f32>>,
}

fn one_op(case: &Case) -> mantissa::Result<OneOp> {
    let mut m = ModelBuilder::new();
    let (mut params, mut grads, mut values) = (vec![], vec![], vec![]);
    let (mut ids, mut targets) = (vec![], vec![]);
    let mut vars: Vec<Var> = vec![];
    for input in &case.inputs {
        let var = match input.kind.as_str() {
            "param" => {
                let p = m.param(&input.name, &input.shape, Init::Zeros, false)?;
                grads.push((input.name.clone(), params.len()));
                params.push(input.values.clone());
                if input.format == "compute" {
                    let k = *input.shape.last().expect("an axis");
                    let eye =
                        m.param(&format!("{}.eye", input.name), &[k, k], Init::Zeros, false)?;
                    params.push((0..k * k).map(|e| (e / k == e % k) as u32 as f32).collect());
                    m.matmul(p, eye, false)?
                } else {
                    p
                }
            }
            "tokens" => {
                ids = input.values.iter().map(|&v| v as u32).collect();
                m.tokens(&input.shape)?
            }
            "targets" => {
                targets = input.values.iter().map(|&v| v as u32).collect();
                // A model reads a batch: tokens of the loss's rows, unread by the op.
                m.tokens(&input.shape)?;
                m.targets(&input.shape)?
            }
            "values" => {
                values.push(input.values.clone());
                m.values(&input.shape)?
            }
            other => panic!("{}: input kind {other:?}", case.name),
        };
        vars.push(var);
    }
    let a = &case.attrs;
    let v = |i: usize| vars[i];
    let y = match case.op.as_str() {
        "embedding" => m.embedding(v(0), v(1))?,
        "linear" => m.linear(v(0), v(1), v(2))?,
        "matmul" => m.matmul(v(0), v(1), a["transpose_w"].as_bool().unwrap_or(false))?,
        "layer_norm" => m.layer_norm(v(0), v(1), v(2))?,
        "rms_norm" => m.rms_norm(v(0), v(1), a["eps"].as_f64().unwrap_or(1e-5) as f32)?,
        "gelu" => m.gelu(v(0))?,
        "silu" => m.silu(v(0))?,
        "add" => m.add(v(0), v(1))?,
        "mul" => m.mul(v(0), v(1))?,
        "causal_attention" => {
            m.causal_attention(v(0), a["heads"].as_u64().unwrap_or(1) as usize)?
        }
        "causal_softmax" => m.causal_softmax(v(0), a["scale"].as_f64().unwrap_or(1.0))?,
        "reshape" => m.reshape(v(0), &shape_of(&a["shape"]).unwrap_or_default())?,
        "cross_entropy" => m.cross_entropy(v(0), v(1))?,
        "mse" => m.mse(v(0), v(1))?,
        "relu" => m.relu(v(0))?,
        "sigmoid" => m.sigmoid(v(0))?,
        "tanh" => m.tanh(v(0))?,
        "softmax" => m.softmax(v(0))?,
        "sum" => m.sum(v(0))?,
        "mean" => m.mean(v(0))?,
        "scale" => m.scale(v(0), a["k"].as_f64().unwrap_or(1.0))?,
        "sub" => m.sub(v(0), v(1))?,
        "transpose" => m.transpose(v(0))?,
        "concat" => m.concat(&vars)?,
        "narrow" => m.narrow(
            v(0),
            a["start"].as_u64().unwrap_or(0) as usize,
            a["length"].as_u64().unwrap_or(1) as usize,
        )?,
        "bmm" => m.bmm(v(0), v(1), a["transpose_b"].as_bool().unwrap_or(false))?,
        "attention" => m.attention(v(0), a["heads"].as_u64().unwrap_or(1) as usize)?,
        "attention_masked" => {
            m.attention_masked(v(0), a["heads"].as_u64().unwrap_or(1) as usize, v(1))?
        }
        "attention_biased" => {
            m.attention_biased(v(0), a["heads"].as_u64().unwrap_or(1) as usize, v(1))?
        }
        "rotary" => m.rotary(
            v(0),
            a["heads"].as_u64().unwrap_or(1) as usize,
            a["base"].as_f64().unwrap_or(10000.0),
        )?,
        other => panic!("{}: op {other:?} is not a builder op", case.name),
    };
    let loss = match case.output_shape.as_ref() {
        None => y,
        Some(shape) => {
            let target = m.values(shape)?;
            values.push(vec![0.0; shape.iter().product()]);
            m.mse(y, target)?
        }
    };
    Ok(OneOp {
        model: m.finish(loss)?,
        params,
        grads,
        ids,
        targets,
        values,
    })
}

/// `plan` with the gradient its mean squared error starts the backward pass from replaced by
/// `dy` (an input tensor written before the run, copied over the loss's gradient right after
/// the loss op): the op's backward then starts from exactly that gradient. Returns the plan and
/// the tensor to write `dy` into.
fn seeded(plan: &Plan, len: usize) -> (Plan, TensorId) {
    let mut ops = plan.ops().to_vec();
    let at = (ops.iter())
        .position(|op| matches!(op, Op::MseLoss { .. }))
        .expect("the loss");
    let Op::MseLoss { grad, .. } = ops[at] else {
        unreachable!()
    };
    let mut g = PlanBuilder {
        tensors: plan.tensors().to_vec(),
        ops: vec![],
        constants: plan.constants().to_vec(),
    };
    let dy = g.tensor(len, TensorKind::Input);
    let dims = [1, 1, 1, len as u32];
    ops.insert(
        at + 1,
        Op::Copy {
            x: dy,
            out: grad,
            map: Strided {
                dims,
                src: Strided::dense(dims),
                dst: Strided::dense(dims),
                src_offset: 0,
                dst_offset: 0,
            },
            held: Format::F32,
        },
    );
    g.ops = ops;
    let end = |s| plan.range_of(s).end + 1;
    let outline = Outline {
        forward: end(Section::Forward),
        backward: end(Section::Backward),
        gradients: end(Section::Gradients),
        tokens: plan.tokens(),
        targets: plan.targets(),
        logits: plan.logits(),
        state: plan.state().to_vec(),
        stats: plan.stats(),
    };
    (g.finish(outline).expect("the seeded plan"), dy)
}

/// What a run of a case gave: its output (a loss's value as one element) and the gradient of
/// each input that takes one, by name.
struct Got {
    values: BTreeMap<String, Vec<f32>>,
}

/// The case's one-op model under `preset` on `b`'s own executor, attention fused or not:
/// forward and backward with loss scale 1.
fn run(b: &dyn Backend, case: &Case, preset: Preset, fused: bool) -> Got {
    let one = one_op(case).unwrap_or_else(|e| panic!("{}: {e}", case.name));
    let vocabulary = mantissa::model::vocabulary();
    let request = PrecisionRequest::of(preset);
    let precision = Precision::decide(&request, &b.capabilities(), &vocabulary).unwrap();
    let options = PlanOptions {
        fused_attention: fused,
        coded: false,
        seed: 0,
    };
    let plan = one.model.plan(&precision, options).unwrap();
    let (plan, seed) = match &case.dy {
        Some(dy) => {
            let (plan, t) = seeded(&plan, dy.len());
            (plan, Some((t, dy.clone())))
        }
        None => (plan, None),
    };
    let state = plan.state().to_vec();
    let inputs: Vec<TensorId> = (0..plan.tensors().len())
        .filter(|&t| plan.tensors()[t].kind == TensorKind::Input)
        .collect();
    let rows = plan.rows();
    let scalars = StepScalars {
        adamw: &AdamW::default(),
        clip: 0.0,
        loss_scale: 1.0,
        poison: 0.0,
        t: 1,
        parts: 1,
        part: 0,
        fp8: &[],
        eval: false,
    }
    .array(rows, plan.scalar_count());
    let logits = plan.logits();
    let mut exec = backend::executor(b, plan, true).unwrap();
    for (i, p) in one.params.iter().enumerate() {
        exec.write(state[i][0], p).block_on().unwrap();
    }
    for (k, v) in one.values.iter().enumerate() {
        exec.write(inputs[k], v).block_on().unwrap();
    }
    if let Some((t, dy)) = &seed {
        exec.write(*t, dy).block_on().unwrap();
    }
    let or_zeros = |x: &[u32]| match x.is_empty() {
        true => vec![0; rows],
        false => x.to_vec(),
    };
    let stats = exec
        .run(
            Section::Gradients,
            &or_zeros(&one.ids),
            &or_zeros(&one.targets),
            &scalars,
        )
        .block_on()
        .unwrap_or_else(|e| panic!("{} {preset} on {}: {e}", case.name, b.name()));
    let mut values = BTreeMap::new();
    let out = match case.is_loss() {
        true => vec![stats[Stats::LOSS] as f32],
        false => exec.read(logits).block_on().unwrap(),
    };
    values.insert("out".to_string(), out);
    for (name, i) in &one.grads {
        let g = exec.read(state[*i][1]).block_on().unwrap();
        values.insert(format!("grad/{name}"), g);
    }
    Got { values }
}

/// Adjacent values of `format` around |x| are this far apart.
fn step(x: f64, format: Format) -> f64 {
    let info = format.finfo();
    let unit = (-(info.mantissa_bits as f64)).exp2();
    let x = x.abs().max(info.smallest_normal);
    (unit * x.log2().floor().exp2()).max(info.smallest_subnormal)
}

/// The share of elements held in `format` that f32 noise of relative size `noise` may round
/// the other way: the chance that a rounding boundary (spaced between half a unit and a unit of
/// the format, relative to the value) lies within the noise of the value.
fn flip_rate(noise: f64, format: Format) -> f64 {
    let unit = (-(format.finfo().mantissa_bits as f64)).exp2();
    (4.0 * noise / unit).min(1.0)
}

/// How `got` compares with PyTorch's `want`: the largest difference in units of what it may
/// differ by, the elements that differ beyond the f32 noise and how many may.
struct Compared {
    worst: f64,
    worst_at: usize,
    flips: usize,
    allowed_flips: usize,
    n: usize,
}

impl Compared {
    fn passes(&self) -> bool {
        self.worst <= 1.0 && self.flips <= self.allowed_flips
    }
}

fn compare(got: &[f32], want: &[f32], check: &Check) -> Compared {
    let n = want.len();
    let k = check.sum.max(1) as f64;
    let largest = want.iter().fold(0f64, |m, &w| m.max((w as f64).abs()));
    let relative = NOISE * k.sqrt() * (-24f64).exp2();
    let sixteen = |f: Format| f != Format::F32;
    let (mut worst, mut worst_at, mut flips) = (0f64, 0, 0);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g as f64, w as f64);
        let scale = match (&check.scale, check.sum) {
            (Some(terms), _) => terms[i] as f64,
            (None, 0 | 1) => w.abs(),
            (None, _) => largest,
        };
        let noise = relative * scale + f64::from(f32::MIN_POSITIVE);
        let mut allowed = noise;
        if sixteen(check.held) {
            allowed += step(w, check.held);
        }
        if sixteen(check.inner) {
            allowed += step(largest, check.inner);
        }
        let diff = if g == w || (g.is_nan() && w.is_nan()) {
            0.0
        } else {
            (g - w).abs()
        };
        let units = if diff.is_nan() {
            f64::INFINITY
        } else {
            diff / allowed
        };
        if units > worst {
            (worst, worst_at) = (units, i);
        }
        flips += (diff > noise || diff.is_nan()) as usize;
    }
    let mut rate = 0.0;
    if sixteen(check.held) {
        rate += flip_rate(relative, check.held);
    }
    if sixteen(check.inner) {
        // One flip inside moves a row's worth of outputs.
        rate += flip_rate(relative, check.inner) * k;
    }
    let rate = rate.min(1.0);
    let expected = rate * n as f64;
    // The expected count, four standard deviations of a binomial count over it, and two.
    let allowed_flips = (expected + 4.0 * expected.sqrt() + 2.0) as usize;
    let allowed_flips = if rate == 0.0 { 0 } else { allowed_flips.min(n) };
    Compared {
        worst,
        worst_at,
        flips,
        allowed_flips,
        n,
    }
}

/// Every case under every preset on `b` (attention fused and not where the backend can),
/// compared with PyTorch's; one line per tensor, and a failure listing every tensor outside.
fn matches_pytorch_op_by_op(b: &dyn Backend) {
    let mut failures = vec![];
    for case in cases() {
        for preset in PRESETS {
            let p: Preset = preset.parse().unwrap();
            let attention: &[bool] = match case.op.as_str() {
                "causal_attention" => &[false, true],
                _ => &[false],
            };
            for &fused in attention {
                if fused && b.kind() == BackendKind::Cuda {
                    let d = case.inputs[0].shape[2]
                        / 3
                        / case.attrs["heads"].as_u64().unwrap() as usize;
                    let (request, caps) = (PrecisionRequest::of(p), b.capabilities());
                    let vocabulary = mantissa::model::vocabulary();
                    let precision = Precision::decide(&request, &caps, &vocabulary).unwrap();
                    if !b.capabilities().fuses_attention(&precision.matmul, d) {
                        continue;
                    }
                }
                let got = run(b, &case, p, fused);
                for (key, (want, check)) in &case.expected[preset] {
                    let what = format!(
                        "{} {:28} {preset:10} {:9} {key:12}",
                        b.name(),
                        case.name,
                        if fused { "fused" } else { "" }
                    );
                    let g = &got.values[key];
                    assert_eq!(g.len(), want.len(), "{what}: length");
                    let c = compare(g, want, check);
                    let line = format!(
                        "{what} held {:4} sum {:4}: largest {:.2} of its bound (at {}: {} vs PyTorch's {}), {} of {} beyond f32 noise (at most {})",
                        check.held.to_string(),
                        check.sum,
                        c.worst,
                        c.worst_at,
                        g[c.worst_at],
                        want[c.worst_at],
                        c.flips,
                        c.n,
                        c.allowed_flips
                    );
                    eprintln!("{line}");
                    if !c.passes() {
                        failures.push(line);
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} tensors differ from PyTorch's beyond rounding noise:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Every builder op and loss (`model::vocabulary`, and the methods built of them) has a case,
/// under every preset, with its output and every gradient: the fixtures cover what the builder
/// can build.
#[test]
fn every_builder_op_has_fixtures_under_three_presets() {
    let cases = cases();
    for op in BUILDER_OPS {
        let of_op: Vec<&Case> = cases.iter().filter(|c| c.op == op).collect();
        assert!(!of_op.is_empty(), "{op}: no fixture");
        for case in of_op {
            for preset in PRESETS {
                let keys: Vec<&String> = case.expected[preset].keys().collect();
                assert!(
                    keys.contains(&&"out".to_string()),
                    "{}: no output",
                    case.name
                );
                for input in case.inputs.iter().filter(|i| i.kind == "param") {
                    let key = format!("grad/{}", input.name);
                    assert!(keys.contains(&&key), "{} {preset}: no {key}", case.name);
                }
            }
        }
    }
    // An op added to the builder's vocabulary without fixtures fails here.
    for op in mantissa::model::vocabulary() {
        assert!(
            BUILDER_OPS.contains(&op.name) || op.name == "dropout",
            "{}: an op of the builder without a case here",
            op.name
        );
    }
    for case in &cases {
        assert!(
            BUILDER_OPS.contains(&case.op.as_str()),
            "{}: op {}",
            case.name,
            case.op
        );
    }
}

/// A fixture whose tensor does not have the shape its manifest records is refused, naming the
/// op; so is one whose tensor is missing.
#[test]
fn a_fixture_of_another_shape_is_refused_with_the_op_named() {
    let fx = fixtures();
    let mut manifest = fx.manifest.clone();
    let case = &mut manifest["cases"][0];
    let op = case["op"].as_str().unwrap().to_string();
    let shape = shape_of(&case["inputs"][0]["shape"]).unwrap();
    let mut wrong = shape.clone();
    wrong[0] += 1;
    case["inputs"][0]["shape"] = serde_json::json!(wrong);
    let err = cases_of(&manifest, &fx.tensors).expect_err("refused");
    assert!(
        err.starts_with(&format!("{op} (case ")) && err.contains(&format!("{wrong:?}")),
        "{err}"
    );
    let mut tensors = fx.tensors.clone();
    let name = fx.manifest["cases"][0]["name"].as_str().unwrap();
    tensors.remove(&format!("{name}/dy"));
    let err = cases_of(&fx.manifest, &tensors).expect_err("refused");
    assert!(err.starts_with(&format!("{op} (case {name})")), "{err}");
}

/// The tolerance tells a double rounding from noise: a bf16 output rounded twice (once to
/// bf16, then again after adding a value held in f32, the linear layer's old bias add) moves
/// far more elements than the noise allows, where the single rounding passes.
#[test]
fn the_tolerance_tells_a_second_rounding_from_noise() {
    let bf16 = Format::Bf16;
    let n = 4096;
    let y = mantissa::measure::normal(n, 53);
    let b = mantissa::measure::normal(n, 54);
    let round = |v: f64| bf16.decode(bf16.encode(v as f32, mantissa::format::Overflow::Standard));
    let once: Vec<f32> = y
        .iter()
        .zip(&b)
        .map(|(&y, &b)| round(y as f64 + round(b as f64) as f64))
        .collect();
    let twice: Vec<f32> = y
        .iter()
        .zip(&b)
        .map(|(&y, &b)| round(round(y as f64) as f64 + b as f64))
        .collect();
    let check = Check {
        held: bf16,
        inner: bf16,
        sum: 64,
        scale: None,
    };
    assert!(compare(&once, &once, &check).passes());
    let c = compare(&twice, &once, &check);
    assert!(
        !c.passes(),
        "{} of {} differ, {} allowed",
        c.flips,
        c.n,
        c.allowed_flips
    );
}

backend_tests!(reference: matches_pytorch_op_by_op);
backend_tests!(wgpu: matches_pytorch_op_by_op);
backend_tests!(wgpu_gpu_rows: matches_pytorch_op_by_op);
backend_tests!(cuda: matches_pytorch_op_by_op);
