//! A two-layer MLP that tells two interleaved spirals apart: points generated here (nothing to
//! download), the model written with the builder, trained full-batch with AdamW under a
//! precision preset, and its accuracy on the training points and on fresh ones.
//!
//! `cargo run --release --example mlp -- --backend wgpu --precision bf16-mixed`

mod common;

use mantissa::Result;
use mantissa::model::{Init, Model, ModelBuilder, ModelTrainer};

/// Points of each spiral.
const PER_CLASS: usize = 256;
const HIDDEN: usize = 64;

/// `2 PER_CLASS` points (x, y) on two spirals, a quarter turn apart, with a little noise, and
/// each one's spiral (0 or 1).
fn spirals(seed: u64) -> (Vec<f32>, Vec<u32>) {
    let noise = mantissa::measure::normal(4 * PER_CLASS, seed);
    let (mut points, mut labels) = (vec![], vec![]);
    for i in 0..2 * PER_CLASS {
        let (class, j) = (i % 2, i / 2);
        let r = j as f32 / PER_CLASS as f32;
        let angle = 3.0 * std::f32::consts::PI * r + std::f32::consts::PI * class as f32;
        points.push(r * angle.cos() + 0.02 * noise[2 * i]);
        points.push(r * angle.sin() + 0.02 * noise[2 * i + 1]);
        labels.push(class as u32);
    }
    (points, labels)
}

/// points [n, 2] -> linear, GELU, linear, GELU, linear -> logits [n, 2]; cross entropy.
fn mlp(n: usize) -> Result<Model> {
    let mut m = ModelBuilder::new();
    let (x, labels) = (m.values(&[n, 2])?, m.targets(&[n])?);
    let mut h = x;
    for (i, (din, dout)) in [(2, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 2)]
        .into_iter()
        .enumerate()
    {
        let std = (2.0 / din as f32).sqrt();
        let w = m.param(
            &format!("fc{i}.w"),
            &[din, dout],
            Init::Normal { std },
            true,
        )?;
        let b = m.param(&format!("fc{i}.b"), &[dout], Init::Zeros, false)?;
        h = m.linear(h, w, b)?;
        if dout == HIDDEN {
            h = m.gelu(h)?;
        }
    }
    let loss = m.cross_entropy(h, labels)?;
    m.finish(loss)
}

/// The share of rows whose larger logit is their label's.
fn accuracy(logits: &[f32], labels: &[u32]) -> f64 {
    let right = (logits.chunks(2).zip(labels))
        .filter(|&(l, &y)| (l[1] > l[0]) as u32 == y)
        .count();
    right as f64 / labels.len() as f64
}

fn main() {
    common::main(|args, backend| {
        let (points, labels) = spirals(args.seed);
        let n = labels.len();
        let mut t = ModelTrainer::new(backend, mlp(n)?, &args.request(), None, args.seed)?;
        t.adamw.lr = 1e-2;
        t.adamw.weight_decay = 0.0;
        pollster::block_on(t.set_values(0, &points))?;
        let steps = args.steps.unwrap_or(400);
        let start = std::time::Instant::now();
        for step in 1..=steps {
            let s = pollster::block_on(t.step(&[], &labels))?;
            if step % 100 == 0 || step == steps {
                println!("step {step:4}  loss {:.4}", s.loss);
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        pollster::block_on(t.loss(&[], &labels))?;
        let trained = accuracy(&pollster::block_on(t.outputs())?, &labels);
        // Fresh points of the same spirals.
        let (fresh, fresh_labels) = spirals(args.seed + 1);
        pollster::block_on(t.set_values(0, &fresh))?;
        pollster::block_on(t.loss(&[], &fresh_labels))?;
        let held_out = accuracy(&pollster::block_on(t.outputs())?, &fresh_labels);
        println!(
            "accuracy {:.1}% on the {n} training points, {:.1}% on fresh ones ({steps} steps in {seconds:.1} s)",
            100.0 * trained,
            100.0 * held_out
        );
        Ok(())
    })
}
