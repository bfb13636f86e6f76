//! A transformer block of the user's own design, written from the builder's ops: RMSNorm before
//! attention and before a SwiGLU MLP (silu(x . W_gate) * (x . W_up), then W_down), as LLaMA's
//! blocks are, in a small character-level language model on data/shakespeare.txt. Each op's
//! precision comes from the preset, and its backward is derived.
//!
//! `cargo run --release --example custom_block -- --backend wgpu --precision bf16-mixed`

mod common;

use mantissa::Result;
use mantissa::model::{Init, Model, ModelBuilder, ModelTrainer, Var};

/// Blocks, heads, width, context, sequences per batch.
const SHAPE: (usize, usize, usize, usize, usize) = (2, 4, 64, 64, 16);
/// SwiGLU's hidden width: 8/3 of the model's, as LLaMA sizes it.
const HIDDEN: usize = 8 * SHAPE.2 / 3;

/// One pre-norm block with RMSNorm and a SwiGLU MLP; its parameters named `name.*`.
fn block(m: &mut ModelBuilder, name: &str, x: Var) -> Result<Var> {
    let (_, heads, c, _, _) = SHAPE;
    let normal = Init::Normal { std: 0.02 };
    let matrix = |m: &mut ModelBuilder, part: &str, din, dout| {
        m.param(&format!("{name}.{part}"), &[din, dout], normal, true)
    };
    let attn_norm = m.param(&format!("{name}.attn_norm"), &[c], Init::Ones, false)?;
    let h = m.rms_norm(x, attn_norm, 1e-6)?;
    let qkv = matrix(m, "qkv", c, 3 * c)?;
    let qkv = m.matmul(h, qkv, false)?;
    let y = m.causal_attention(qkv, heads)?;
    let out = matrix(m, "out", c, c)?;
    let y = m.matmul(y, out, false)?;
    let x = m.add(x, y)?;
    let mlp_norm = m.param(&format!("{name}.mlp_norm"), &[c], Init::Ones, false)?;
    let h = m.rms_norm(x, mlp_norm, 1e-6)?;
    let (gate, up) = (matrix(m, "gate", c, HIDDEN)?, matrix(m, "up", c, HIDDEN)?);
    let gated = m.matmul(h, gate, false)?;
    let gated = m.silu(gated)?;
    let lifted = m.matmul(h, up, false)?;
    let h = m.mul(gated, lifted)?;
    let down = matrix(m, "down", HIDDEN, c)?;
    let y = m.matmul(h, down, false)?;
    m.add(x, y)
}

/// The language model: embeddings, the blocks, a final RMSNorm and an untied head.
fn model(v: usize) -> Result<Model> {
    let (blocks, _, c, t, b) = SHAPE;
    let mut m = ModelBuilder::new();
    let (tokens, targets) = (m.tokens(&[b, t])?, m.targets(&[b, t])?);
    let positions = m.constant_ids(&[b, t], (0..b * t).map(|i| (i % t) as u32).collect())?;
    let normal = Init::Normal { std: 0.02 };
    let wte = m.param("wte", &[v, c], normal, true)?;
    let wpe = m.param("wpe", &[t, c], normal, true)?;
    let (tok, pos) = (m.embedding(wte, tokens)?, m.embedding(wpe, positions)?);
    let mut x = m.add(tok, pos)?;
    for i in 0..blocks {
        x = block(&mut m, &format!("block{i}"), x)?;
    }
    let norm = m.param("norm", &[c], Init::Ones, false)?;
    let x = m.rms_norm(x, norm, 1e-6)?;
    let head = m.param("head", &[c, v], normal, true)?;
    let logits = m.matmul(x, head, false)?;
    let loss = m.cross_entropy(logits, targets)?;
    m.finish(loss)
}

fn main() {
    common::main(|args, backend| {
        let corpus = common::corpus()?;
        let mut t = ModelTrainer::new(
            backend,
            model(corpus.vocab.len())?,
            &args.request(),
            None,
            args.seed,
        )?;
        t.grad_clip = 1.0;
        let (_, _, _, context, batch) = SHAPE;
        let steps = args.steps.unwrap_or(300);
        common::train_on_corpus(&mut t, &corpus, (batch, context), steps, args.seed)
    })
}
