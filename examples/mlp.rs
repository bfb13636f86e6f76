//! A two-layer MLP that tells two interleaved spirals apart: points generated here (nothing to
//! download), the model written with the builder, trained full-batch with AdamW under a
//! precision preset, and its accuracy on the training points and on fresh ones. Under mpirun it
//! trains data parallel, each rank on its share of the points (build with `--features mpi`).
//!
//! `cargo run --release --example mlp -- --backend wgpu --precision bf16-mixed`
//! `mpirun -np 2 target/release/examples/mlp --backend reference`

mod common;

use mantissa::Result;
use mantissa::model::{Init, Model, ModelBuilder, ModelTrainer, RunOptions};

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
        // Under mpirun each rank trains the MLP of its share of the points, the gradients
        // summed over the ranks every step: the one-process training, data parallel. Alone,
        // the world is one rank and the share is every point.
        let world = mantissa::dist::world()?;
        let group = world.as_ref();
        let (points, labels) = spirals(args.seed);
        let n = labels.len();
        let ranks = group.size();
        let mine_rows = mantissa::dist::shard(n, group.rank(), ranks)?;
        let share = mine_rows.len();
        let mine = |all: &[u32]| all[mine_rows.clone()].to_vec();
        let mine_xy = |all: &[f32]| all[2 * mine_rows.start..2 * mine_rows.end].to_vec();
        let options = RunOptions {
            group,
            ..RunOptions::new(args.seed)
        };
        let mut t = ModelTrainer::with_options(backend, mlp(share)?, &args.request(), options)?;
        t.adamw.lr = 1e-2;
        t.adamw.weight_decay = 0.0;
        let (points, labels) = (mine_xy(&points), mine(&labels));
        pollster::block_on(t.set_values(0, &points))?;
        let steps = args.steps.unwrap_or(400);
        let lead = group.rank() == 0;
        let start = std::time::Instant::now();
        for step in 1..=steps {
            let s = pollster::block_on(t.step(&[], &labels))?;
            if lead && (step % 100 == 0 || step == steps) {
                println!("step {step:4}  loss {:.6}", s.loss);
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        // Points classified right, this rank's share of them, summed over the ranks.
        let mut right = [0.0; 2];
        pollster::block_on(t.loss(&[], &labels))?;
        right[0] = share as f64 * accuracy(&pollster::block_on(t.outputs())?, &labels);
        // Fresh points of the same spirals.
        let (fresh, fresh_labels) = spirals(args.seed + 1);
        let (fresh, fresh_labels) = (mine_xy(&fresh), mine(&fresh_labels));
        pollster::block_on(t.set_values(0, &fresh))?;
        pollster::block_on(t.loss(&[], &fresh_labels))?;
        right[1] = share as f64 * accuracy(&pollster::block_on(t.outputs())?, &fresh_labels);
        group.sum_f64(&mut right)?;
        if lead {
            println!(
                "accuracy {:.1}% on the {n} training points, {:.1}% on fresh ones ({steps} steps \
                 in {seconds:.1} s{})",
                100.0 * right[0] / n as f64,
                100.0 * right[1] / n as f64,
                if ranks > 1 {
                    format!(", {ranks} ranks")
                } else {
                    String::new()
                }
            );
        }
        group.barrier()
    })
}
