//! The model builder: each op's derived backward against central differences of the loss, a
//! built model training on a backend, and bad models refused when they are built, with the op
//! and the shapes named.

mod common;

use mantissa::Error;
use mantissa::backend::{Backend, Reference};
use mantissa::model::{Init, Model, ModelBuilder, ModelTrainer, Var};
use mantissa::policy::Preset;
use mantissa::policy::precision::PrecisionRequest;
use pollster::FutureExt as _;

const VOCAB: usize = 5;

/// A one-op model: `rows` token ids picking rows of a table of `width` (the op's input, a
/// parameter), the op, and the cross entropy of what it gives against the targets.
struct OneOp {
    m: ModelBuilder,
    rows: Vec<usize>,
    tokens: Var,
    targets: Var,
    /// The values of each values input declared (`fixed`), in declaration order.
    values: Vec<Vec<f32>>,
}

impl OneOp {
    fn new(rows: &[usize]) -> OneOp {
        let mut m = ModelBuilder::new();
        OneOp {
            tokens: m.tokens(rows).unwrap(),
            targets: m.targets(rows).unwrap(),
            m,
            rows: rows.to_vec(),
            values: vec![],
        }
    }

    /// A values input of `shape` that every run reads as `values` (no gradient).
    fn fixed(&mut self, shape: &[usize], values: Vec<f32>) -> Var {
        self.values.push(values);
        self.m.values(shape).unwrap()
    }

    fn param(&mut self, name: &str, shape: &[usize]) -> Var {
        let init = Init::Normal { std: 1.0 };
        self.m.param(name, shape, init, false).unwrap()
    }

    /// The rows of a table `width` wide picked by the tokens.
    fn input(&mut self, name: &str, width: usize) -> Var {
        let table = self.param(name, &[VOCAB, width]);
        self.m.embedding(table, self.tokens).unwrap()
    }

    fn finish(mut self, logits: Var) -> (Model, usize, Vec<Vec<f32>>) {
        let loss = self.m.cross_entropy(logits, self.targets).unwrap();
        let n = self.rows.iter().product();
        (self.m.finish(loss).unwrap(), n, self.values)
    }
}

/// The gradient of the loss of `model` with respect to each of its parameters, from the plan
/// derived from it (the reference, 32-true), against central differences of the loss it runs
/// (the forward pass only), element by element.
fn check_gradients(name: &str, (model, n, values): (Model, usize, Vec<Vec<f32>>), fused: bool) {
    let seed = common::seed(name);
    let mut t = ModelTrainer::new(
        &Reference,
        model,
        &PrecisionRequest::of(Preset::True32),
        Some(fused),
        seed,
    )
    .unwrap();
    for (k, v) in values.iter().enumerate() {
        t.set_values(k, v).block_on().unwrap();
    }
    let ids: Vec<u32> = (0..n as u32)
        .map(|i| (i * 3 + seed as u32) % VOCAB as u32)
        .collect();
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 7 + 1) % VOCAB as u32).collect();
    // Every parameter at least 0.05 from zero, so that a kink there (ReLU's, where a parameter
    // is its input) lies outside the steps of `derivative`.
    let params: Vec<Vec<f32>> = (t.params().block_on().unwrap().into_iter())
        .map(|p| p.into_iter().map(|v| v + 0.05f32.copysign(v)).collect())
        .collect();
    t.set_params(&params).block_on().unwrap();
    let (loss, grads) = t.gradients(&ids, &targets).block_on().unwrap();
    let mut worst = 0f64;
    for (p, values) in params.iter().enumerate() {
        for e in 0..values.len() {
            let loss_at = |delta: f32| {
                let mut shifted = params.clone();
                shifted[p][e] += delta;
                t.set_params(&shifted).block_on().unwrap();
                t.loss(&ids, &targets).block_on().unwrap()
            };
            let numeric = derivative(loss_at, values[e]);
            let analytic = grads[p][e] as f64;
            let err = (numeric - analytic).abs() / (1.0 + numeric.abs());
            worst = worst.max(err);
            assert!(
                agrees(analytic, numeric, loss),
                "{name}: d loss / d param {p}[{e}]: derived {analytic}, central difference {numeric}"
            );
        }
    }
    eprintln!("{name}: largest relative gap {worst:.2e}");
}

/// The loss and its gradient run in f32 (the executors' arithmetic): a central difference
/// over h has a truncation error of order h^2 |f'''| and a rounding error of order
/// 1e-7 |f| / h. `derivative` cancels the h^2 term (Richardson: two steps, 1e-2 and 5e-3),
/// which deeper compositions (a gated unit, a norm after a product) need at 1e-2; what is left
/// is 1e-4 relative to 1 + |gradient| for the truncation, plus the rounding error
/// (`rounding_bound`). The host ops themselves are checked against f64 differences to 1e-6
/// (tests/train.rs).
const TOLERANCE: f64 = 1e-4;

/// The rounding error of `derivative`'s estimate where the loss is `loss`: each f32 loss is
/// off by a few ulps of it (4 EPSILON |loss|), and the extrapolation (4 D(5e-3) - D(1e-2)) / 3
/// of central differences D(h) = (L(x + h) - L(x - h)) / 2h carries (4 / 5e-3 + 1 / 1e-2) / 3
/// of that. (A loss near 4 gives 6e-4: the estimate of a gradient moved by about 1e-4 with the
/// seed, past a bound of 1e-4 alone, though the derived gradient was the one in the middle of
/// the estimates at every step size.)
fn rounding_bound(loss: f64) -> f64 {
    4.0 * f32::EPSILON as f64 * loss.abs() * (4.0 / 5e-3 + 1.0 / 1e-2) / 3.0
}

/// Whether the derived gradient `analytic` agrees with the estimate `numeric` of a loss near
/// `loss`: within `TOLERANCE` relative to 1 + |numeric|, plus `rounding_bound`.
fn agrees(analytic: f64, numeric: f64, loss: f64) -> bool {
    (numeric - analytic).abs() <= TOLERANCE * (1.0 + numeric.abs()) + rounding_bound(loss)
}

/// d loss / dx at `x` from the loss with x shifted by a delta (`loss_at`): central
/// differences over the shifts f32 holds, steps 1e-2 and 5e-3, extrapolated (Richardson).
fn derivative(mut loss_at: impl FnMut(f32) -> f64, x: f32) -> f64 {
    let mut central = |h: f32| {
        let (up, down) = (x + h, x - h);
        (loss_at(h) - loss_at(-h)) / (up as f64 - down as f64)
    };
    let (coarse, fine) = (central(1e-2), central(5e-3));
    (4.0 * fine - coarse) / 3.0
}

/// One test per op: `gradients!(name: |one_op| -> logits, fused)`.
macro_rules! gradients {
    ($($name:ident: $rows:expr, $fused:expr, $build:expr;)+) => {
        $(
            #[test]
            fn $name() {
                let mut one = OneOp::new(&$rows);
                let build: fn(&mut OneOp) -> Var = $build;
                let logits = build(&mut one);
                check_gradients(stringify!($name), one.finish(logits), $fused);
            }
        )+
    };
}

gradients! {
    embedding_gradient: [4], false, |o| o.input("table", VOCAB);
    linear_gradient: [4], false, |o| {
        let x = o.input("x", 3);
        let (w, b) = (o.param("w", &[3, VOCAB]), o.param("b", &[VOCAB]));
        o.m.linear(x, w, b).unwrap()
    };
    matmul_gradient: [4], false, |o| {
        let x = o.input("x", 3);
        let w = o.param("w", &[3, VOCAB]);
        o.m.matmul(x, w, false).unwrap()
    };
    matmul_transposed_gradient: [4], false, |o| {
        let x = o.input("x", 3);
        let w = o.param("w", &[VOCAB, 3]);
        o.m.matmul(x, w, true).unwrap()
    };
    tied_weight_gradient: [4], false, |o| {
        // The table is read twice (rows picked, and the head): its gradients are summed.
        let x = o.input("table", 3);
        let table = o.m.parameter("table").unwrap();
        o.m.matmul(x, table, true).unwrap()
    };
    layer_norm_gradient: [4], false, |o| {
        let x = o.input("x", VOCAB);
        let (g, b) = (o.param("g", &[VOCAB]), o.param("b", &[VOCAB]));
        o.m.layer_norm(x, g, b).unwrap()
    };
    gelu_gradient: [4], false, |o| {
        let x = o.input("x", VOCAB);
        o.m.gelu(x).unwrap()
    };
    add_gradient: [4], false, |o| {
        let (x, y) = (o.input("x", VOCAB), o.input("y", VOCAB));
        o.m.add(x, y).unwrap()
    };
    add_to_itself_gradient: [4], false, |o| {
        let x = o.input("x", VOCAB);
        let y = o.m.gelu(x).unwrap();
        // y read twice by one op, and x by two: each gradient the sum of its two.
        let twice = o.m.add(y, y).unwrap();
        o.m.add(twice, x).unwrap()
    };
    param_read_by_add_gradient: [4], false, |o| {
        // The parameter's gradient is the add's output gradient itself (copied into its own).
        let x = o.input("x", VOCAB);
        let bias = o.param("bias", &[4, VOCAB]);
        o.m.add(x, bias).unwrap()
    };
    reshape_gradient: [2, 2], false, |o| {
        let x = o.input("x", VOCAB);
        o.m.reshape(x, &[4, VOCAB]).map(|x| o.m.reshape(x, &[2, 2, VOCAB]).unwrap()).unwrap()
    };
    causal_softmax_gradient: [2, 3], false, |o| {
        let x = o.input("x", 3);
        let x = o.m.causal_softmax(x, 0.7).unwrap();
        let w = o.param("w", &[3, VOCAB]);
        o.m.matmul(x, w, false).unwrap()
    };
    softmax_gradient: [2, 3], false, |o| {
        // Over every column of rows of 4 (not square: no mask).
        let x = o.input("x", 4);
        let x = o.m.softmax(x).unwrap();
        let w = o.param("w", &[4, VOCAB]);
        o.m.matmul(x, w, false).unwrap()
    };
    causal_attention_gradient: [2, 3], false, |o| {
        // Two heads of 2: q|k|v 12 wide, the output 4 wide.
        let x = o.input("qkv", 12);
        let y = o.m.causal_attention(x, 2).unwrap();
        let w = o.param("w", &[4, VOCAB]);
        o.m.matmul(y, w, false).unwrap()
    };
    attention_gradient: [2, 3], false, |o| {
        // Unmasked: every token sees the others; with the plan asked to fuse, still the
        // separate ops (the fused kernels are causal).
        let x = o.input("qkv", 12);
        let y = o.m.attention(x, 2).unwrap();
        let w = o.param("w", &[4, VOCAB]);
        o.m.matmul(y, w, false).unwrap()
    };
    attention_masked_gradient: [2, 4], true, |o| {
        // Sequence 0's last key is padding, sequence 1's first two; causal, and not.
        let mask = o.fixed(&[2, 4], vec![0., 0., 0., 1., 1., 1., 0., 0.]);
        let x = o.input("qkv", 12);
        let y = o.m.attention_masked(x, 2, mask).unwrap();
        let z = o.m.causal_attention_masked(x, 2, mask).unwrap();
        let y = o.m.add(y, z).unwrap();
        let w = o.param("w", &[4, VOCAB]);
        o.m.matmul(y, w, false).unwrap()
    };
    attention_biased_gradient: [2, 4], true, |o| {
        // A bias per head (ALiBi's slopes 0.5 and 0.25, -inf on key 2 of head 1), and one per
        // sequence under the causal mask (sequence 1's query 0 sees no key: 0).
        let mut per_head = vec![];
        for slope in [0.5f32, 0.25] {
            for e in 0..16usize {
                let (i, j) = (e / 4, e % 4);
                per_head.push(if slope == 0.25 && j == 2 {
                    f32::NEG_INFINITY
                } else {
                    -slope * i.abs_diff(j) as f32
                });
            }
        }
        let heads = o.fixed(&[2, 4, 4], per_head);
        let mut per_seq: Vec<f32> = (0..32).map(|e| 0.1 * (e % 7) as f32).collect();
        per_seq[16] = f32::NEG_INFINITY;
        let seqs = o.fixed(&[2, 4, 4], per_seq);
        let x = o.input("qkv", 12);
        let y = o.m.attention_biased(x, 2, heads).unwrap();
        let z = o.m.causal_attention_biased(x, 2, seqs).unwrap();
        let y = o.m.add(y, z).unwrap();
        let w = o.param("w", &[4, VOCAB]);
        o.m.matmul(y, w, false).unwrap()
    };
    attention_learned_bias_gradient: [2, 4], true, |o| {
        // Learned biases of every shape: [t, t] under the causal mask, [heads, t, t], one per
        // sequence computed from a parameter ([batch, t, t]) and [batch, heads, t, t].
        let x = o.input("qkv", 12);
        let shared = o.param("shared", &[4, 4]);
        let heads = o.param("heads", &[2, 4, 4]);
        let seqs = o.param("seqs", &[2, 4, 4]);
        let seqs = o.m.scale(seqs, 0.5).unwrap();
        let each = o.param("each", &[2, 2, 4, 4]);
        let mut y = o.m.causal_attention_biased(x, 2, shared).unwrap();
        for (bias, causal) in [(heads, false), (seqs, true), (each, false)] {
            let z = match causal {
                true => o.m.causal_attention_biased(x, 2, bias),
                false => o.m.attention_biased(x, 2, bias),
            };
            y = o.m.add(y, z.unwrap()).unwrap();
        }
        let w = o.param("w", &[4, VOCAB]);
        o.m.matmul(y, w, false).unwrap()
    };
    attention_fused_asked_gradient: [2, 3], true, |o| {
        let x = o.input("qkv", 12);
        let y = o.m.attention(x, 2).unwrap();
        let w = o.param("w", &[4, VOCAB]);
        o.m.matmul(y, w, false).unwrap()
    };
    rms_norm_gradient: [4], false, |o| {
        let x = o.input("x", VOCAB);
        let g = o.param("g", &[VOCAB]);
        o.m.rms_norm(x, g, 1e-6).unwrap()
    };
    silu_gradient: [4], false, |o| {
        let x = o.input("x", VOCAB);
        o.m.silu(x).unwrap()
    };
    relu_gradient: [4], false, |o| {
        let x = o.input("x", VOCAB);
        o.m.relu(x).unwrap()
    };
    sigmoid_gradient: [4], false, |o| {
        let x = o.input("x", VOCAB);
        o.m.sigmoid(x).unwrap()
    };
    tanh_gradient: [4], false, |o| {
        let x = o.input("x", VOCAB);
        o.m.tanh(x).unwrap()
    };
    transpose_gradient: [2, 3], false, |o| {
        // [2, 3, 3] with its last two axes swapped, then a head.
        let x = o.input("x", 3);
        let x = o.m.transpose(x).unwrap();
        let w = o.param("w", &[3, VOCAB]);
        o.m.matmul(x, w, false).unwrap()
    };
    concat_gradient: [4], false, |o| {
        // 2 + 3 columns, and one input twice: its two gradients summed.
        let (x, y) = (o.input("x", 2), o.input("y", 1));
        o.m.concat(&[x, y, x]).unwrap()
    };
    split_gradient: [4], false, |o| {
        // 7 columns cut 2 | 5: the wide part read alone, the narrow one beside an overlapping
        // narrow of x; columns 0..2 and 4..7 take two gradients, column 3 one (zeros elsewhere).
        let x = o.input("x", 7);
        let parts = o.m.split(x, &[2, 5]).unwrap();
        let overlap = o.m.narrow(x, 4, 3).unwrap();
        let side = o.m.concat(&[parts[0], overlap]).unwrap();
        o.m.add(parts[1], side).unwrap()
    };
    rotary_gradient: [2, 3], false, |o| {
        // Two heads of 4 at positions 0..3, a base small enough for angles of radians.
        let x = o.input("x", 8);
        let x = o.m.rotary(x, 2, 3.0).unwrap();
        let w = o.param("w", &[8, VOCAB]);
        o.m.matmul(x, w, false).unwrap()
    };
    bmm_gradient: [2, 3], false, |o| {
        // [2, 3, 3] . [2, 3, 5]: two products of activations.
        let (a, b) = (o.input("a", 3), o.input("b", VOCAB));
        o.m.bmm(a, b, false).unwrap()
    };
    bmm_transposed_gradient: [2, 3], false, |o| {
        // [2, 3, 4] . [2, 3, 4]^T = [2, 3, 3], then a head; a read by both sides.
        let (a, b) = (o.input("a", 4), o.input("b", 4));
        let s = o.m.bmm(a, b, true).unwrap();
        let s = o.m.bmm(s, a, false).unwrap();
        let w = o.param("w", &[4, VOCAB]);
        o.m.matmul(s, w, false).unwrap()
    };
    sum_gradient: [2, 3], false, |o| {
        // Rows of 4 summed into [2, 3], then a head over a width of 1.
        let x = o.input("x", 4);
        let x = o.m.sum(x).unwrap();
        let x = o.m.reshape(x, &[2, 3, 1]).unwrap();
        let w = o.param("w", &[1, VOCAB]);
        o.m.matmul(x, w, false).unwrap()
    };
    mean_gradient: [4], false, |o| {
        // [4, 3, 5] averaged over its last axis: [4, 3] (a width of 3 into the head).
        let x = o.input("x", 15);
        let x = o.m.reshape(x, &[4, 3, 5]).unwrap();
        let x = o.m.mean(x).unwrap();
        let w = o.param("w", &[3, VOCAB]);
        o.m.matmul(x, w, false).unwrap()
    };
    scale_and_sub_gradient: [4], false, |o| {
        let (x, y) = (o.input("x", VOCAB), o.input("y", VOCAB));
        let y = o.m.scale(y, 0.3).unwrap();
        o.m.sub(x, y).unwrap()
    };
    dropout_gradient: [4], false, |o| {
        // Half of the values dropped, the rest doubled: the same mask in the loss and its
        // gradient (the same step).
        let x = o.input("x", VOCAB);
        o.m.dropout(x, 0.5).unwrap()
    };
    mul_gradient: [4], false, |o| {
        let (x, y) = (o.input("x", VOCAB), o.input("y", VOCAB));
        o.m.mul(x, y).unwrap()
    };
    swiglu_gradient: [4], false, |o| {
        // silu(x . w_gate) * (x . w_up) . w_down, x read by both products.
        let x = o.input("x", 3);
        let (gate, up) = (o.param("gate", &[3, 4]), o.param("up", &[3, 4]));
        let down = o.param("down", &[4, VOCAB]);
        let g = o.m.matmul(x, gate, false).unwrap();
        let g = o.m.silu(g).unwrap();
        let u = o.m.matmul(x, up, false).unwrap();
        let h = o.m.mul(g, u).unwrap();
        o.m.matmul(h, down, false).unwrap()
    };
    fused_causal_attention_gradient: [2, 3], true, |o| {
        let x = o.input("qkv", 12);
        let y = o.m.causal_attention(x, 2).unwrap();
        let w = o.param("w", &[4, VOCAB]);
        o.m.matmul(y, w, false).unwrap()
    };
}

/// A small model written with the builder (embedding, a residual MLP block with a layer norm,
/// a head) learns a fixed batch under `preset` on `b`.
fn a_built_model_learns(b: &dyn Backend) {
    for preset in [Preset::True32, Preset::MixedBf16, Preset::Mixed16] {
        let (n, c) = (8, 16);
        let mut m = ModelBuilder::new();
        let tokens = m.tokens(&[n]).unwrap();
        let targets = m.targets(&[n]).unwrap();
        let normal = Init::Normal { std: 0.1 };
        let wte = m.param("wte", &[VOCAB, c], normal, true).unwrap();
        let g = m.param("ln.g", &[c], Init::Ones, false).unwrap();
        let bias = m.param("ln.b", &[c], Init::Zeros, false).unwrap();
        let w = m.param("fc.w", &[c, 2 * c], normal, true).unwrap();
        let wb = m.param("fc.b", &[2 * c], Init::Zeros, false).unwrap();
        let w2 = m.param("fc2.w", &[2 * c, c], normal, true).unwrap();
        let w2b = m.param("fc2.b", &[c], Init::Zeros, false).unwrap();
        let x = m.embedding(wte, tokens).unwrap();
        let h = m.layer_norm(x, g, bias).unwrap();
        let h = m.linear(h, w, wb).unwrap();
        let h = m.gelu(h).unwrap();
        let h = m.linear(h, w2, w2b).unwrap();
        let x = m.add(x, h).unwrap();
        let logits = m.matmul(x, wte, true).unwrap();
        let loss = m.cross_entropy(logits, targets).unwrap();
        let model = m.finish(loss).unwrap();
        let mut t = ModelTrainer::new(b, model, &PrecisionRequest::of(preset), None, 1).unwrap();
        t.adamw.lr = 3e-2;
        let ids: Vec<u32> = (0..n as u32).map(|i| i % VOCAB as u32).collect();
        let targets: Vec<u32> = (0..n as u32).map(|i| (i + 1) % VOCAB as u32).collect();
        let first = t.step(&ids, &targets).block_on().unwrap().loss;
        for _ in 0..30 {
            t.step(&ids, &targets).block_on().unwrap();
        }
        let last = t.loss(&ids, &targets).block_on().unwrap();
        assert!(
            last < first / 4.0,
            "{preset} on {}: loss {first} -> {last} after 31 steps",
            b.name()
        );
    }
}

/// A regression written with the builder on values inputs (features and targets written by
/// the host, no tokens): its derived gradient against central differences of its mean squared
/// error, and its outputs the predictions the loss read.
#[test]
fn a_regression_on_values_inputs_differentiates_and_outputs_its_predictions() {
    let (n, k) = (6, 3);
    let mut m = ModelBuilder::new();
    let (x, y) = (m.values(&[n, k]).unwrap(), m.values(&[n, 2]).unwrap());
    let normal = Init::Normal { std: 0.5 };
    let w = m.param("w", &[k, 4], normal, true).unwrap();
    let b = m.param("b", &[4], normal, false).unwrap();
    let w2 = m.param("w2", &[4, 2], normal, true).unwrap();
    let g = m.param("g", &[4], Init::Ones, false).unwrap();
    let h = m.linear(x, w, b).unwrap();
    let h = m.rms_norm(h, g, 1e-6).unwrap();
    let h = m.silu(h).unwrap();
    let pred = m.matmul(h, w2, false).unwrap();
    let loss = m.mse(pred, y).unwrap();
    let model = m.finish(loss).unwrap();
    assert_eq!(model.rows(), n);
    assert_eq!(model.values_inputs(), [vec![n, k], vec![n, 2]]);
    let seed = common::seed("regression_on_values");
    let mut t = ModelTrainer::new(
        &Reference,
        model,
        &PrecisionRequest::of(Preset::True32),
        None,
        seed,
    )
    .unwrap();
    let features = mantissa::measure::normal(n * k, seed + 1);
    let wanted = mantissa::measure::normal(n * 2, seed + 2);
    t.set_values(0, &features).block_on().unwrap();
    t.set_values(1, &wanted).block_on().unwrap();
    let params = t.params().block_on().unwrap();
    let (loss, grads) = t.gradients(&[], &[]).block_on().unwrap();
    // The loss is the mean squared error of the predictions the plan holds.
    let pred = t.outputs().block_on().unwrap();
    let mse: f64 = (pred.iter().zip(&wanted))
        .map(|(&p, &y)| (p as f64 - y as f64).powi(2))
        .sum::<f64>()
        / (n * 2) as f64;
    assert!((loss - mse).abs() <= 1e-6 * mse.max(1.0), "{loss} vs {mse}");
    for (p, values) in params.iter().enumerate() {
        for e in 0..values.len() {
            let loss_at = |delta: f32| {
                let mut shifted = params.clone();
                shifted[p][e] += delta;
                t.set_params(&shifted).block_on().unwrap();
                t.loss(&[], &[]).block_on().unwrap()
            };
            let numeric = derivative(loss_at, values[e]);
            let analytic = grads[p][e] as f64;
            assert!(
                agrees(analytic, numeric, loss),
                "d mse / d param {p}[{e}]: derived {analytic}, central difference {numeric}"
            );
        }
    }
    // Values of the wrong length, or an input the model does not have, are refused.
    refused(
        t.set_values(0, &features[1..]).block_on().unwrap_err(),
        &["values", "input 0", "[6, 3]"],
    );
    refused(
        t.set_values(2, &features).block_on().unwrap_err(),
        &["values", "input 2"],
    );
}

/// A gradient the preset holds in 16 bits is rounded by the op that writes it: at bf16-mixed,
/// no standalone rounding follows GELU's or SiLU's backward in a derived plan (of a matmul's
/// output, held in bf16; of an f32 value they would run in f32, as autocast runs them).
#[test]
fn activation_gradients_are_rounded_as_they_are_written() {
    use mantissa::plan::Op;
    use mantissa::policy::Precision;
    let mut o = OneOp::new(&[4]);
    let x = o.input("x", VOCAB);
    let w = o.param("w", &[VOCAB, VOCAB]);
    let x = o.m.matmul(x, w, false).unwrap();
    let g = o.m.gelu(x).unwrap();
    let s = o.m.silu(g).unwrap();
    let (model, ..) = o.finish(s);
    let p = Precision::decide(
        &PrecisionRequest::of(Preset::MixedBf16),
        &Reference.capabilities(),
        &mantissa::model::vocabulary(),
    )
    .unwrap();
    let options = mantissa::model::PlanOptions {
        fused_attention: false,
        coded: false,
        seed: 0,
    };
    let plan = model.plan(&p, options).unwrap();
    let ops = plan.ops();
    let mut backwards = 0;
    for (i, op) in ops.iter().enumerate() {
        if let Op::UnaryBwd { held, .. } = op {
            backwards += 1;
            assert_eq!(*held, mantissa::Format::Bf16, "{op:?}");
            assert!(
                !matches!(ops.get(i + 1), Some(Op::Round { .. })),
                "a rounding after {op:?}"
            );
        }
    }
    assert_eq!(backwards, 2);
}

/// A model of the ops added with the unary family and the strided copies (ReLU, tanh,
/// sigmoid, transpose, bmm both ways, concat, split, softmax, unmasked attention, causal
/// attention with a key padding mask, attention with a bias per head and with a learned one, rotary embeddings, mean, sum, scale, sub, dropout: its
/// masks the same bits on every backend, step after step) takes the reference's losses on `b`, step for
/// step, at 32-true and bf16-mixed.
fn new_ops_train_as_on_the_reference(b: &dyn Backend) {
    let (batch, t, c) = (2, 4, 8);
    let build = || {
        let mut m = ModelBuilder::new();
        let tokens = m.tokens(&[batch, t]).unwrap();
        let targets = m.targets(&[batch, t]).unwrap();
        let normal = Init::Normal { std: 0.3 };
        let wte = m.param("wte", &[VOCAB, c], normal, true).unwrap();
        let wq = m.param("wq", &[c, c], normal, true).unwrap();
        let bq = m.param("bq", &[c], Init::Zeros, false).unwrap();
        let wk = m.param("wk", &[c, c], normal, true).unwrap();
        let head = m.param("head", &[2 * c, VOCAB], normal, true).unwrap();
        let x = m.embedding(wte, tokens).unwrap();
        let q = m.linear(x, wq, bq).unwrap();
        let q = m.relu(q).unwrap();
        let q = m.rotary(q, 2, 10.0).unwrap();
        let k = m.matmul(x, wk, false).unwrap();
        let k = m.tanh(k).unwrap();
        // Attention over q|k|v = q|k|x (two heads of 4): unmasked, and causal with a key
        // padding mask (sequence 1's first key padding: its first query sees no key).
        let qkv = m.concat(&[q, k, x]).unwrap();
        let a = m.attention(qkv, 2).unwrap();
        let mask = m.values(&[batch, t]).unwrap();
        let padded = m.causal_attention_masked(qkv, 2, mask).unwrap();
        let a = m.add(a, padded).unwrap();
        // And with a bias per head.
        let bias = m.values(&[2, t, t]).unwrap();
        let biased = m.attention_biased(qkv, 2, bias).unwrap();
        let a = m.add(a, biased).unwrap();
        // And with a learned bias [t, t], causal (its gradient: column sums of the softmax's).
        let learned = m.param("learned", &[t, t], Init::Zeros, false).unwrap();
        let relative = m.causal_attention_biased(qkv, 2, learned).unwrap();
        let a = m.add(a, relative).unwrap();
        let k = m.add(k, a).unwrap();
        let kt = m.transpose(k).unwrap();
        let s = m.bmm(q, kt, false).unwrap();
        let s = m.sigmoid(s).unwrap();
        let s = m.softmax(s).unwrap();
        let h = m.bmm(s, x, false).unwrap();
        let h = m.concat(&[h, x]).unwrap();
        // Cut and put back in the other order.
        let parts = m.split(h, &[3, 2 * c - 3]).unwrap();
        let h = m.concat(&[parts[1], parts[0]]).unwrap();
        // Each row minus a third of its mean, broadcast back over the row by a product.
        let mean = m.mean(h).unwrap();
        let mean = m.reshape(mean, &[batch, t, 1]).unwrap();
        let ones = m.param("ones", &[1, 2 * c], Init::Ones, false).unwrap();
        let mean = m.matmul(mean, ones, false).unwrap();
        let mean = m.scale(mean, 1.0 / 3.0).unwrap();
        let h = m.sub(h, mean).unwrap();
        let total = m.sum(h).unwrap();
        let total = m.reshape(total, &[batch, t, 1]).unwrap();
        let total = m.matmul(total, ones, false).unwrap();
        let h = m.add(h, total).unwrap();
        let h = m.dropout(h, 0.25).unwrap();
        let logits = m.matmul(h, head, false).unwrap();
        let loss = m.cross_entropy(logits, targets).unwrap();
        m.finish(loss).unwrap()
    };
    let ids: Vec<u32> = (0..(batch * t) as u32)
        .map(|i| (i * 3) % VOCAB as u32)
        .collect();
    let targets: Vec<u32> = (0..(batch * t) as u32)
        .map(|i| (i + 1) % VOCAB as u32)
        .collect();
    for (preset, tol) in [(Preset::True32, 1e-5), (Preset::MixedBf16, 2e-2)] {
        let losses = |on: &dyn Backend| {
            let mut tr =
                ModelTrainer::new(on, build(), &PrecisionRequest::of(preset), None, 7).unwrap();
            tr.adamw.lr = 1e-2;
            let mask = [0., 0., 0., 0., 1., 0., 0., 1.];
            tr.set_values(0, &mask).block_on().unwrap();
            let bias: Vec<f32> = (0..2 * t * t)
                .map(|e| match e % 7 {
                    3 => f32::NEG_INFINITY,
                    k => -0.3 * k as f32,
                })
                .collect();
            // -inf leaves a key out of a bias; +inf and NaN are refused, and -inf in the mask.
            for bad in [f32::INFINITY, f32::NAN] {
                let mut wrong = bias.clone();
                wrong[5] = bad;
                let e = tr.set_values(1, &wrong).block_on().unwrap_err();
                assert!(e.to_string().contains("a bias is finite or -inf"), "{e}");
            }
            let e = (tr.set_values(0, &[f32::NEG_INFINITY; 8]).block_on()).unwrap_err();
            assert!(e.to_string().contains("values are finite"), "{e}");
            tr.set_values(1, &bias).block_on().unwrap();
            (0..5)
                .map(|_| tr.step(&ids, &targets).block_on().unwrap().loss)
                .collect::<Vec<f64>>()
        };
        let (got, want) = (losses(b), losses(&Reference));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= tol * (1.0 + w.abs()),
                "{} {preset} step {i}: {got:?} vs the reference's {want:?}",
                b.name()
            );
        }
    }
}

/// A built model trains on ranks as alone (`RunOptions::group`): on `common::Twins`, whose sums
/// double exactly, the data-parallel step (`Plan::split_for_ranks`, the gradients summed on the
/// host as MPI sums them, the mean taken over the ranks) is the one-rank step bit for bit, step
/// after step, with a parameter whose gradient is an add's output gradient copied into its own
/// (`param_read_by_add_gradient`) and a learned attention bias among the gradients.
fn a_built_model_trains_on_ranks_as_alone(b: &dyn Backend) {
    use mantissa::dist::{Reducer, Reduction};
    use mantissa::model::RunOptions;
    let (batch, t, c) = (2, 4, 8);
    let build = || {
        let mut m = ModelBuilder::new();
        let tokens = m.tokens(&[batch, t]).unwrap();
        let targets = m.targets(&[batch, t]).unwrap();
        let normal = Init::Normal { std: 0.3 };
        let wte = m.param("wte", &[VOCAB, 3 * c], normal, true).unwrap();
        let pos = m.param("pos", &[batch, t, 3 * c], normal, false).unwrap();
        let relative = m.param("relative", &[t, t], Init::Zeros, false).unwrap();
        let head = m.param("head", &[c, VOCAB], normal, true).unwrap();
        let x = m.embedding(wte, tokens).unwrap();
        let x = m.add(x, pos).unwrap();
        let a = m.causal_attention_biased(x, 2, relative).unwrap();
        let logits = m.matmul(a, head, false).unwrap();
        let loss = m.cross_entropy(logits, targets).unwrap();
        m.finish(loss).unwrap()
    };
    let ids: Vec<u32> = (0..(batch * t) as u32)
        .map(|i| (i * 3) % VOCAB as u32)
        .collect();
    let targets: Vec<u32> = (0..(batch * t) as u32)
        .map(|i| (i + 2) % VOCAB as u32)
        .collect();
    for preset in [Preset::True32, Preset::MixedBf16] {
        let run = |ranks: bool| {
            let mut options = RunOptions::new(7);
            if ranks {
                options.group = &common::Twins;
                options.reduction = Reduction {
                    reducer: Reducer::Mpi,
                    ..Reduction::default()
                };
            }
            let request = PrecisionRequest::of(preset);
            let mut tr = ModelTrainer::with_options(b, build(), &request, options).unwrap();
            tr.adamw.lr = 1e-2;
            let losses: Vec<u64> = (0..4)
                .map(|_| tr.step(&ids, &targets).block_on().unwrap().loss.to_bits())
                .collect();
            (losses, tr.params().block_on().unwrap())
        };
        let (alone, split) = (run(false), run(true));
        assert_eq!(split.0, alone.0, "{} {preset}: the losses", b.name());
        let same = split
            .1
            .iter()
            .zip(&alone.1)
            .all(|(s, a)| common::same_bits(s, a));
        assert!(
            same,
            "{} {preset}: the parameters after the steps",
            b.name()
        );
    }
}

#[test]
fn a_built_model_learns_on_the_reference() {
    a_built_model_learns(&Reference);
}

#[test]
fn a_built_model_trains_on_ranks_as_alone_on_the_reference() {
    a_built_model_trains_on_ranks_as_alone(&Reference);
}

backend_tests!(wgpu: a_built_model_learns, a_model_of_no_parameters_steps_to_its_loss, new_ops_train_as_on_the_reference, a_built_model_trains_on_ranks_as_alone);
backend_tests!(cuda: a_built_model_learns, new_ops_train_as_on_the_reference);

fn refused(e: Error, words: &[&str]) {
    let text = e.to_string();
    assert_eq!(e.class(), mantissa::error::ErrorClass::BadInput, "{text}");
    for w in words {
        assert!(text.contains(w), "{text:?} does not name {w:?}");
    }
}

#[test]
fn bad_models_are_refused_with_the_op_and_shapes() {
    let mut m = ModelBuilder::new();
    let tokens = m.tokens(&[4]).unwrap();
    let targets = m.targets(&[4]).unwrap();
    let wte = m.param("wte", &[VOCAB, 6], Init::Zeros, true).unwrap();
    let x = m.embedding(wte, tokens).unwrap();
    // An undeclared parameter, a value of another model, a duplicate name.
    refused(m.parameter("wpe").unwrap_err(), &["wpe", "wte"]);
    let mut other = ModelBuilder::new();
    let foreign = other.param("w", &[6, VOCAB], Init::Zeros, true).unwrap();
    refused(
        m.matmul(x, foreign, false).unwrap_err(),
        &["matmul", "did not declare"],
    );
    refused(
        m.param("wte", &[2], Init::Zeros, true).unwrap_err(),
        &["wte", "already"],
    );
    // Mismatched shapes.
    let w = m.param("w", &[5, VOCAB], Init::Zeros, true).unwrap();
    let b = m.param("b", &[VOCAB], Init::Zeros, false).unwrap();
    refused(
        m.linear(x, w, b).unwrap_err(),
        &["linear", "[4, 6]", "[5, 5]", "[5]"],
    );
    refused(m.add(x, b).unwrap_err(), &["add", "[4, 6]", "[5]"]);
    refused(
        m.layer_norm(x, b, b).unwrap_err(),
        &["layer_norm", "[4, 6]", "[5]"],
    );
    refused(
        m.causal_attention(x, 4).unwrap_err(),
        &["causal_attention", "[4, 6]"],
    );
    refused(
        m.reshape(x, &[5, 5]).unwrap_err(),
        &["reshape", "[4, 6]", "[5, 5]"],
    );
    refused(m.embedding(wte, x).unwrap_err(), &["embedding"]);
    refused(m.gelu(tokens).unwrap_err(), &["gelu", "ids", "[4]"]);
    refused(
        m.param("empty", &[0, 3], Init::Zeros, true).unwrap_err(),
        &["empty", "[0, 3]"],
    );
    let w = m.param("head", &[6, VOCAB], Init::Zeros, true).unwrap();
    let logits = m.matmul(x, w, false).unwrap();
    refused(
        m.cross_entropy(logits, tokens).unwrap_err(),
        &["cross_entropy", "[4, 5]"],
    );
    // A loss that is not a scalar, a loss op's output read on.
    let loss = m.cross_entropy(logits, targets).unwrap();
    refused(m.gelu(loss).unwrap_err(), &["gelu", "loss"]);
    // The new ops' shapes, and a second loss.
    refused(
        m.rms_norm(x, b, 1e-6).unwrap_err(),
        &["rms_norm", "[4, 6]", "[5]"],
    );
    let g = m.param("g", &[6], Init::Ones, false).unwrap();
    refused(
        m.rms_norm(x, g, f32::NAN).unwrap_err(),
        &["rms_norm", "eps NaN"],
    );
    refused(m.mul(x, logits).unwrap_err(), &["mul", "[4, 6]", "[4, 5]"]);
    refused(m.silu(targets).unwrap_err(), &["silu", "ids"]);
    refused(m.relu(tokens).unwrap_err(), &["relu", "ids"]);
    refused(m.sum(b).unwrap_err(), &["sum", "[5]", "one axis"]);
    refused(m.attention(x, 4).unwrap_err(), &["attention", "[4, 6]"]);
    let seq = m.values(&[2, 3, 6]).unwrap();
    refused(
        m.rotary(x, 1, 1e4).unwrap_err(),
        &["rotary", "[4, 6]", "[batch, tokens"],
    );
    refused(
        m.rotary(seq, 4, 1e4).unwrap_err(),
        &["rotary", "4 heads", "not heads x d"],
    );
    refused(
        m.rotary(seq, 2, 1e4).unwrap_err(),
        &["rotary", "2 heads of 3", "even"],
    );
    refused(m.rotary(seq, 0, 1e4).unwrap_err(), &["rotary", "0 heads"]);
    for base in [1.0, f64::NAN, f64::INFINITY, -3.0] {
        refused(m.rotary(seq, 3, base).unwrap_err(), &["rotary", "base"]);
    }
    let seqs = m.values(&[2, 2, 6]).unwrap();
    let wrong = m.values(&[2, 3]).unwrap();
    refused(
        m.attention_masked(seqs, 1, wrong).unwrap_err(),
        &[
            "attention_masked",
            "key mask [2, 3]",
            "[batch, tokens]",
            "[2, 2, 6]",
        ],
    );
    let computed = m.sum(seqs).unwrap();
    refused(
        m.causal_attention_masked(seqs, 1, computed).unwrap_err(),
        &["causal_attention_masked", "key mask [2, 2]", "values input"],
    );
    refused(
        m.attention_masked(x, 1, wrong).unwrap_err(),
        &["attention_masked", "qkv [4, 6]"],
    );
    // A bias of another shape.
    for shape in [&[3, 2][..], &[3, 2, 2], &[2, 2, 2, 3], &[1, 1, 2, 2]] {
        let bias = m.values(shape).unwrap();
        refused(
            m.attention_biased(seqs, 1, bias).unwrap_err(),
            &[
                "attention_biased",
                "the bias",
                "[tokens, tokens]",
                "[2, 2, 6]",
            ],
        );
    }
    let ok = m.values(&[2, 2]).unwrap();
    let attention = m.causal_attention_biased(seqs, 1, ok);
    assert!(attention.is_ok(), "{attention:?}");
    // A computed bias is read (and gets a gradient: `attention_learned_bias_gradient`); ids
    // are not a bias.
    let attention = m.causal_attention_biased(seqs, 1, computed);
    assert!(attention.is_ok(), "{attention:?}");
    refused(
        m.causal_attention_biased(seqs, 1, targets).unwrap_err(),
        &["causal_attention_biased", "a parameter or an op's output"],
    );
    for p in [1.0, -0.1, f64::NAN, 0.999_999_999] {
        refused(m.dropout(x, p).unwrap_err(), &["dropout", "not in [0, 1)"]);
    }
    refused(m.mean(targets).unwrap_err(), &["mean", "ids"]);
    refused(m.scale(x, f64::INFINITY).unwrap_err(), &["scale", "inf"]);
    refused(
        m.scale(x, 1e39).unwrap_err(),
        &["scale", "not finite in f32"],
    );
    refused(m.sub(x, logits).unwrap_err(), &["sub", "[4, 6]", "[4, 5]"]);
    refused(
        m.transpose(b).unwrap_err(),
        &["transpose", "[5]", "two axes"],
    );
    refused(m.concat(&[]).unwrap_err(), &["concat", "none"]);
    refused(m.narrow(x, 5, 2).unwrap_err(), &["narrow", "[5, 5 + 2)"]);
    refused(m.narrow(x, 0, 0).unwrap_err(), &["narrow", "one column"]);
    refused(m.narrow(x, usize::MAX, 2).unwrap_err(), &["narrow"]);
    refused(
        m.split(x, &[2, 3]).unwrap_err(),
        &["split", "[2, 3]", "summing"],
    );
    refused(m.split(x, &[]).unwrap_err(), &["split", "[]"]);
    refused(m.split(x, &[0, 6]).unwrap_err(), &["split", "[0, 6]"]);
    refused(m.split(x, &[usize::MAX, 7]).unwrap_err(), &["split"]);
    let row = m.reshape(x, &[1, 4, 6]).unwrap();
    refused(
        m.concat(&[x, row]).unwrap_err(),
        &["concat", "[4, 6]", "[1, 4, 6]"],
    );
    refused(
        m.bmm(x, logits, false).unwrap_err(),
        &["bmm", "[4, 6]", "[4, 5]"],
    );
    refused(m.bmm(b, b, true).unwrap_err(), &["bmm", "b^T", "[5]"]);
    refused(m.mse(x, logits).unwrap_err(), &["mse", "[4, 6]", "[4, 5]"]);
    refused(m.mse(x, x).unwrap_err(), &["mse", "one loss"]);
    let mut again = ModelBuilder::new();
    let tokens = again.tokens(&[4]).unwrap();
    again.targets(&[4]).unwrap();
    let wte = again.param("wte", &[VOCAB, 6], Init::Zeros, true).unwrap();
    let x = again.embedding(wte, tokens).unwrap();
    refused(
        again.finish(x).unwrap_err(),
        &["finish", "scalar", "[4, 6]"],
    );
    // A parameter that does not reach the loss (w, b and head's first use aside).
    refused(
        m.finish(loss).unwrap_err(),
        &["param w", "does not reach the loss"],
    );
}

/// Fused attention where the executor has no kernel for the heads (wgpu's hold at most 64
/// values) is refused as the plan is prepared (`prepare`, or the first step), saying so.
#[test]
fn fused_attention_where_a_device_has_no_kernel_is_refused() {
    common::on(common::wgpu(), "fused_attention_refused", |b| {
        let mut o = OneOp::new(&[2, 3]);
        let x = o.input("qkv", 3 * 80);
        let y = o.m.causal_attention(x, 1).unwrap();
        let w = o.param("w", &[80, VOCAB]);
        let logits = o.m.matmul(y, w, false).unwrap();
        let (model, ..) = o.finish(logits);
        let e = ModelTrainer::new(
            b,
            model,
            &PrecisionRequest::of(Preset::True32),
            Some(true),
            1,
        )
        .and_then(|mut t| t.prepare().block_on())
        .expect_err("refused");
        refused(e, &["attention", "heads of at most 64, not 80"]);
    });
}

/// tokens [4] -> embedding [VOCAB, 3] -> matmul -> logits [4, VOCAB]; cross entropy.
fn language_model() -> Model {
    let mut m = ModelBuilder::new();
    let (tokens, targets) = (m.tokens(&[4]).unwrap(), m.targets(&[4]).unwrap());
    let wte = m.param("wte", &[VOCAB, 3], Init::Normal { std: 0.5 }, true);
    let x = m.embedding(wte.unwrap(), tokens).unwrap();
    let w = m.param("w", &[3, VOCAB], Init::Normal { std: 0.5 }, true);
    let logits = m.matmul(x, w.unwrap(), false).unwrap();
    let loss = m.cross_entropy(logits, targets).unwrap();
    m.finish(loss).unwrap()
}

/// values x [4, 3] -> linear -> mse against values y [4, 2].
fn regression(init: Init) -> mantissa::Result<Model> {
    let mut m = ModelBuilder::new();
    let (x, y) = (m.values(&[4, 3])?, m.values(&[4, 2])?);
    let w = m.param("w", &[3, 2], init, true)?;
    let b = m.param("b", &[2], Init::Zeros, false)?;
    let pred = m.linear(x, w, b)?;
    let loss = m.mse(pred, y)?;
    m.finish(loss)
}

/// The library refuses what the CLI refuses (the round-four probe: each of these trained on
/// zeros, was skipped silently, poisoned the weights or gave a zero gradient): an empty batch
/// for a model that reads one, ids for a model that reads none, values never written, settings
/// that are NaN or infinite (initialisation, learning rate, clip, loss scale, parameters,
/// values, a softmax's scale), a target computed from a parameter, a nameless parameter; and a
/// refused `set_params` leaves every parameter as it was.
#[test]
fn the_api_refuses_what_the_cli_refuses() {
    let b: &dyn Backend = &Reference;
    let new = |model| {
        ModelTrainer::new(b, model, &PrecisionRequest::of(Preset::True32), None, 1).unwrap()
    };
    let mut lm = new(language_model());
    let (ids, targets) = ([0, 1, 2, 3], [1, 2, 3, 4]);
    refused(
        lm.step(&[], &targets).block_on().unwrap_err(),
        &["token ids", "none"],
    );
    refused(
        lm.step(&ids, &[]).block_on().unwrap_err(),
        &["class targets", "none"],
    );
    refused(
        lm.loss(&[], &targets).block_on().unwrap_err(),
        &["token ids"],
    );
    refused(
        lm.gradients(&ids, &[]).block_on().unwrap_err(),
        &["class targets"],
    );
    assert_eq!(lm.applied, 0, "nothing ran");
    // Settings no step can use, each refused before the step runs.
    lm.adamw.lr = f32::NAN;
    refused(
        lm.step(&ids, &targets).block_on().unwrap_err(),
        &["learning rate NaN"],
    );
    lm.adamw.lr = 1e-3;
    lm.adamw.beta2 = 1.0;
    refused(
        lm.step(&ids, &targets).block_on().unwrap_err(),
        &["beta2 1"],
    );
    lm.adamw.beta2 = 0.99;
    for clip in [-1.0, f32::INFINITY, f32::NAN] {
        lm.grad_clip = clip;
        refused(
            lm.step(&ids, &targets).block_on().unwrap_err(),
            &["grad_clip"],
        );
    }
    lm.grad_clip = 0.0;
    let before = lm.params().block_on().unwrap();
    // A refused set_params writes nothing: not the first tensor before the bad second one.
    let (good, short) = (vec![7.0; before[0].len()], vec![0.0; before[1].len() - 1]);
    refused(
        lm.set_params(&[good.clone(), short])
            .block_on()
            .unwrap_err(),
        &["w is [3, 5]"],
    );
    let mut nan = before[1].clone();
    nan[2] = f32::NAN;
    refused(
        lm.set_params(&[good, nan]).block_on().unwrap_err(),
        &["w[2] is NaN"],
    );
    assert!(
        lm.params().block_on().unwrap() == before,
        "a refused call changed the model"
    );
    let stepped = lm.step(&ids, &targets).block_on().unwrap();
    assert!(stepped.loss.is_finite() && !stepped.skipped, "{stepped:?}");

    // A values model: ids given to it, values never written, values that are not finite.
    let mut reg = new(regression(Init::Normal { std: 0.5 }).unwrap());
    refused(
        reg.step(&[], &[]).block_on().unwrap_err(),
        &["input 0", "never written"],
    );
    reg.set_values(0, &[1.0; 12]).block_on().unwrap();
    refused(
        reg.loss(&[], &[]).block_on().unwrap_err(),
        &["input 1", "never written"],
    );
    let mut y = [0.5; 8];
    y[3] = f32::INFINITY;
    refused(
        reg.set_values(1, &y).block_on().unwrap_err(),
        &["input 1[3] is inf"],
    );
    reg.set_values(1, &[0.5; 8]).block_on().unwrap();
    refused(
        reg.step(&[9, 9, 9, 9], &[]).block_on().unwrap_err(),
        &["reads no token ids", "4 were given"],
    );
    refused(
        reg.step(&[], &[1000; 4]).block_on().unwrap_err(),
        &["reads no class targets"],
    );
    assert!(reg.step(&[], &[]).block_on().unwrap().loss.is_finite());
    // A loss scale or an initialisation that is not finite.
    let mut mixed = ModelTrainer::new(
        b,
        regression(Init::Normal { std: 0.5 }).unwrap(),
        &PrecisionRequest::of(Preset::Mixed16),
        None,
        1,
    )
    .unwrap();
    mixed.set_values(0, &[1.0; 12]).block_on().unwrap();
    mixed.set_values(1, &[1.0; 8]).block_on().unwrap();
    mixed.scaler.as_mut().unwrap().scale = f32::NAN;
    refused(
        mixed.step(&[], &[]).block_on().unwrap_err(),
        &["loss scale", "NaN"],
    );
    for std in [f32::NAN, f32::INFINITY, -1.0] {
        refused(
            regression(Init::Normal { std }).unwrap_err(),
            &["param w", "std"],
        );
    }
    // A 16-bit preset holds weights in 16 bits: one that overflows there is refused by name.
    let e = ModelTrainer::new(
        b,
        regression(Init::Normal { std: 1e6 }).unwrap(),
        &PrecisionRequest::of(Preset::True16),
        None,
        1,
    )
    .err()
    .expect("refused");
    refused(e, &["overflows f16"]);

    // Models refused as they are built.
    let mut m = ModelBuilder::new();
    let (x, y) = (m.values(&[2, 3]).unwrap(), m.values(&[2, 3]).unwrap());
    refused(
        m.param("", &[2], Init::Zeros, true).unwrap_err(),
        &["no name"],
    );
    let w = m
        .param("w", &[3, 3], Init::Normal { std: 1.0 }, true)
        .unwrap();
    let p = m.param("p", &[2, 3], Init::Ones, false).unwrap();
    let h = m.matmul(x, w, false).unwrap();
    refused(m.mse(h, p).unwrap_err(), &["mse", "parameter p"]);
    refused(m.mse(h, h).unwrap_err(), &["mse", "parameter w"]);
    let scores = m.values(&[1, 3, 3]).unwrap();
    for scale in [1e300, f64::NAN, f64::INFINITY] {
        refused(
            m.causal_softmax(scores, scale).unwrap_err(),
            &["causal_softmax", "finite in f32"],
        );
    }
    let qkv = m.values(&[1, 2, 12]).unwrap();
    refused(
        m.causal_attention(qkv, usize::MAX).unwrap_err(),
        &["causal_attention"],
    );
    assert!(m.mse(h, y).is_ok(), "a values target is a target");
}

/// A model of no parameters has nothing to train: its step is its forward pass, with the loss
/// `loss()` gives, on every backend (wgpu's step said 0 where the reference said 1), and a
/// gradient norm of +0 (it was -0.0, an empty f64 sum).
fn a_model_of_no_parameters_steps_to_its_loss(b: &dyn Backend) {
    for preset in [Preset::True32, Preset::MixedBf16] {
        let mut m = ModelBuilder::new();
        let (x, y) = (m.values(&[2, 3]).unwrap(), m.values(&[2, 3]).unwrap());
        let g = m.gelu(x).unwrap();
        let loss = m.mse(g, y).unwrap();
        let model = m.finish(loss).unwrap();
        let mut t = ModelTrainer::new(b, model, &PrecisionRequest::of(preset), None, 1).unwrap();
        t.set_values(0, &[1.0; 6]).block_on().unwrap();
        t.set_values(1, &[0.0; 6]).block_on().unwrap();
        let loss = t.loss(&[], &[]).block_on().unwrap();
        // GELU(1)^2, as the preset rounds it.
        assert!((loss - 0.7076).abs() < 3e-3, "{preset}: {loss}");
        let stepped = t.step(&[], &[]).block_on().unwrap();
        assert_eq!(stepped.loss, loss, "{preset}: {stepped:?}");
        assert!(!stepped.skipped, "{preset}");
        assert_eq!(stepped.grad_norm.to_bits(), 0f64.to_bits(), "{preset}");
    }
}

#[test]
fn a_model_of_no_parameters_steps_to_its_loss_on_the_reference() {
    a_model_of_no_parameters_steps_to_its_loss(&Reference);
}

/// A parameter larger than the process may allocate is `HostOutOfMemory` with its bytes, not
/// an abort: under a 2 GiB address-space limit, 4 GiB of initial values aborted the process in
/// `Init::draw` ("memory allocation of 4294967296 bytes failed"), and 1 GiB in the copy an
/// executor makes of the plan's constants. The bytes asked for are the parameters' twice: the
/// plan's and the executor's.
#[cfg(target_os = "linux")]
#[test]
fn a_parameter_beyond_memory_is_an_error_not_an_abort() {
    let name = "a_parameter_beyond_memory_is_an_error_not_an_abort";
    if let Some(out) = common::under_address_limit(name, 2 << 30) {
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains("1 passed"), "{text}");
        return;
    }
    for side in [1 << 15, 1 << 14] {
        let mut m = ModelBuilder::new();
        let (x, y) = (m.values(&[1, side]).unwrap(), m.values(&[1, side]).unwrap());
        let w = m.param("w", &[side, side], Init::Normal { std: 0.01 }, true);
        let h = m.matmul(x, w.unwrap(), false).unwrap();
        let loss = m.mse(h, y).unwrap();
        let model = m.finish(loss).unwrap();
        let e = ModelTrainer::new(
            &Reference,
            model,
            &PrecisionRequest::of(Preset::True32),
            None,
            1,
        )
        .err()
        .expect("refused");
        let bytes = 2 * (side * side * 4) as u64;
        assert!(e.is_out_of_memory(), "{e}");
        assert!(e.to_string().contains("the model's parameters"), "{e}");
        assert!(e.to_string().contains(&format!("{bytes} bytes")), "{e}");
    }
}
