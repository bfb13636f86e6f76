//! A character-level GPT (nanoGPT's shape, smaller) written with the builder: token and
//! position embeddings, pre-norm blocks of causal self-attention and a GELU MLP, a final layer
//! norm and a head tied to the token table. Trained on data/shakespeare.txt, then sampled.
//!
//! `cargo run --release --example char_gpt -- --backend wgpu --precision bf16-mixed --steps 300`

mod common;

use mantissa::Result;
use mantissa::model::{Init, Model, ModelBuilder, ModelTrainer, Var};

/// Layers, heads, width, context.
const SHAPE: (usize, usize, usize, usize) = (2, 4, 64, 64);
/// Sequences per batch.
const BATCH: usize = 16;

/// The GPT on batches of `b` sequences of `t` tokens over a vocabulary of `v`.
fn gpt(b: usize, t: usize, v: usize) -> Result<Model> {
    let (layers, heads, c, context) = SHAPE;
    let mut m = ModelBuilder::new();
    let (tokens, targets) = (m.tokens(&[b, t])?, m.targets(&[b, t])?);
    let positions = m.constant_ids(&[b, t], (0..b * t).map(|i| (i % t) as u32).collect())?;
    let weights = Init::Normal { std: 0.02 };
    let residual = Init::Normal {
        std: 0.02 / (2.0 * layers as f32).sqrt(),
    };
    let param = |m: &mut ModelBuilder, name: &str, shape: &[usize], init| {
        // Matrices and tables decay; gains and biases do not (nanoGPT).
        m.param(name, shape, init, shape.len() == 2)
    };
    let wte = param(&mut m, "wte", &[v, c], weights)?;
    let wpe = param(&mut m, "wpe", &[context, c], weights)?;
    let (tok, pos) = (m.embedding(wte, tokens)?, m.embedding(wpe, positions)?);
    let mut x = m.add(tok, pos)?;
    let norm = |m: &mut ModelBuilder, name: &str, x: Var| -> Result<Var> {
        let g = param(m, &format!("{name}.g"), &[c], Init::Ones)?;
        let bias = param(m, &format!("{name}.b"), &[c], Init::Zeros)?;
        m.layer_norm(x, g, bias)
    };
    let linear = |m: &mut ModelBuilder, name: &str, x: Var, (din, dout), init| {
        let w = param(m, &format!("{name}.w"), &[din, dout], init)?;
        let bias = param(m, &format!("{name}.b"), &[dout], Init::Zeros)?;
        m.linear(x, w, bias)
    };
    for l in 0..layers {
        let h = norm(&mut m, &format!("h{l}.ln1"), x)?;
        let qkv = linear(&mut m, &format!("h{l}.attn"), h, (c, 3 * c), weights)?;
        let y = m.causal_attention(qkv, heads)?;
        let y = linear(&mut m, &format!("h{l}.proj"), y, (c, c), residual)?;
        x = m.add(x, y)?;
        let h = norm(&mut m, &format!("h{l}.ln2"), x)?;
        let h = linear(&mut m, &format!("h{l}.fc"), h, (c, 4 * c), weights)?;
        let h = m.gelu(h)?;
        let h = linear(&mut m, &format!("h{l}.fc2"), h, (4 * c, c), residual)?;
        x = m.add(x, h)?;
    }
    let x = norm(&mut m, "lnf", x)?;
    let logits = m.matmul(x, wte, true)?;
    let loss = m.cross_entropy(logits, targets)?;
    m.finish(loss)
}

fn main() {
    common::main(|args, backend| {
        let corpus = common::corpus()?;
        let (v, context) = (corpus.vocab.len(), SHAPE.3);
        let mut t = ModelTrainer::new(
            backend,
            gpt(BATCH, context, v)?,
            &args.request(),
            None,
            args.seed,
        )?;
        t.grad_clip = 1.0;
        let steps = args.steps.unwrap_or(300);
        common::train_on_corpus(&mut t, &corpus, (BATCH, context), steps, args.seed)?;

        // Sampling: the same model on one sequence of the context, the trained weights in, each
        // next character drawn greedily from the last row's logits.
        let params = pollster::block_on(t.params())?;
        let mut s = ModelTrainer::new(backend, gpt(1, context, v)?, &args.request(), None, 0)?;
        pollster::block_on(s.set_params(&params))?;
        let mut text = corpus.val[..context].to_vec();
        for _ in 0..120 {
            let window = &text[text.len() - context..];
            pollster::block_on(s.loss(window, window))?;
            let logits = pollster::block_on(s.outputs())?;
            let last = &logits[(context - 1) * v..];
            let next = (0..v)
                .max_by(|&a, &b| last[a].total_cmp(&last[b]))
                .unwrap_or(0);
            text.push(next as u32);
        }
        println!("--- sample ---\n{}", corpus.decode(&text[context..]));
        Ok(())
    })
}
