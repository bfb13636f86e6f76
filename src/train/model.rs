//! The char-level GPT (nanoGPT's shape): token + position embeddings, pre-LayerNorm blocks with
//! causal multi-head self-attention and a GELU MLP, a final LayerNorm, and a head tied to the
//! token embedding.
//!
//! `Gpt::plan` records one training step (forward, backward, unscale and check, AdamW) as a
//! `Plan` of ops on tensors, once per (model, precision, batch shape); an executor runs it on a
//! backend. Matmul-like ops use the algorithm the precision policy chose; autocast is emulated
//! by rounding each tensor to the format it would be held in (`Precision`).

use super::data::Tokenizer;
use crate::backend::Backend;
use crate::error::{Error, Result};
pub use crate::model::stores_codes;
use crate::model::{Init, Model, ModelBuilder, PlanOptions};
use crate::plan::scalar::StepScalars;
use crate::plan::{AdamW, Plan, Section, Stats, StepExecutor};
use crate::policy::Precision;

/// Model and batch shape.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct GptConfig {
    /// The configuration's name ("tiny", "small", "gpt2"), as `--config` takes it.
    pub name: String,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block, each `head_dim` wide.
    pub n_head: usize,
    /// Width of the residual stream (the embedding dimension).
    pub n_embd: usize,
    /// Tokens per sequence: the context length, and the rows of the position embedding.
    pub block_size: usize,
    /// Sequences per step: the global batch, which the ranks of a data-parallel run divide.
    pub batch_size: usize,
    /// Distinct tokens: the corpus's characters, or GPT-2's tokens padded to a multiple of 64
    /// (the rows of the token embedding and the head).
    pub vocab_size: usize,
}

impl GptConfig {
    /// `tiny` (CI-sized) or `small` (nanoGPT shakespeare-char) on a corpus's characters, or
    /// `gpt2` (GPT-2 124M: 12 layers, 12 heads, 768 wide, context 1024) on GPT-2's BPE, its
    /// vocabulary padded to a multiple of 64 as nanoGPT pads it (50257 -> 50304: rows no
    /// target names, for the matmuls' tiles).
    pub fn named(name: &str, vocab_size: usize) -> Result<GptConfig> {
        let (n_layer, n_head, n_embd, block_size, batch_size) = match name {
            "tiny" => (2, 2, 64, 32, 16),
            "small" => (6, 6, 384, 256, 64),
            "gpt2" => (12, 12, 768, 1024, 8),
            _ => {
                return Err(Error::UnknownName {
                    kind: "model config",
                    given: name.into(),
                    valid: ["tiny", "small", "gpt2"].map(String::from).to_vec(),
                });
            }
        };
        let vocab_size = match GptConfig::tokenizer(name) {
            Tokenizer::Gpt2 => vocab_size.next_multiple_of(64),
            Tokenizer::Chars => vocab_size,
        };
        Ok(GptConfig {
            name: name.into(),
            n_layer,
            n_head,
            n_embd,
            block_size,
            batch_size,
            vocab_size,
        })
    }

    /// The tokenizer of the corpus config `name` trains on: GPT-2's BPE for `gpt2`, else a
    /// token per character.
    pub fn tokenizer(name: &str) -> Tokenizer {
        match name {
            "gpt2" => Tokenizer::Gpt2,
            _ => Tokenizer::Chars,
        }
    }

    /// Width of one attention head: `n_embd / n_head`.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Names and shapes of every parameter, in order.
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (c, v, t) = (self.n_embd, self.vocab_size, self.block_size);
        let mut s = vec![
            ("wte".to_string(), vec![v, c]),
            ("wpe".to_string(), vec![t, c]),
        ];
        for l in 0..self.n_layer {
            for (name, shape) in [
                ("ln1.g", vec![c]),
                ("ln1.b", vec![c]),
                ("attn.w", vec![c, 3 * c]),
                ("attn.b", vec![3 * c]),
                ("proj.w", vec![c, c]),
                ("proj.b", vec![c]),
                ("ln2.g", vec![c]),
                ("ln2.b", vec![c]),
                ("fc.w", vec![c, 4 * c]),
                ("fc.b", vec![4 * c]),
                ("fc2.w", vec![4 * c, c]),
                ("fc2.b", vec![c]),
            ] {
                s.push((format!("h{l}.{name}"), shape));
            }
        }
        s.push(("lnf.g".into(), vec![c]));
        s.push(("lnf.b".into(), vec![c]));
        s
    }

    /// Trainable parameters: the elements of every tensor of `parameter_shapes`.
    pub fn parameter_count(&self) -> usize {
        self.parameter_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum()
    }

    /// nanoGPT's initialisation: N(0, 0.02) weights, residual projections scaled by
    /// 1/sqrt(2 n_layer), zero biases, unit LayerNorm gains.
    pub fn inits(&self) -> Vec<Init> {
        self.parameter_shapes()
            .iter()
            .map(|(name, _)| {
                if name.ends_with(".g") {
                    Init::Ones
                } else if name.ends_with(".b") {
                    Init::Zeros
                } else if name.ends_with("proj.w") || name.ends_with("fc2.w") {
                    Init::Normal {
                        std: 0.02 / (2.0 * self.n_layer as f32).sqrt(),
                    }
                } else {
                    Init::Normal { std: 0.02 }
                }
            })
            .collect()
    }

    /// The parameters' initial values (`inits`) drawn from `seed` (`HostOutOfMemory` where the
    /// host cannot hold them).
    pub fn init(&self, seed: u64) -> crate::error::Result<Vec<Vec<f32>>> {
        (self.parameter_shapes().iter().zip(self.inits()).enumerate())
            .map(|(i, ((_, shape), init))| init.draw(shape.iter().product(), seed, i))
            .collect()
    }

    /// The model on batches of `sequences` sequences of `t` tokens, written with the model
    /// builder: its step (backward pass included) is derived from this forward pass.
    pub fn model(&self, sequences: usize, t: usize) -> Result<Model> {
        let cfg = self;
        if t == 0 || t > cfg.block_size || sequences == 0 {
            return Err(Error::invalid(
                "batch",
                format!(
                    "{sequences} sequences of {t} tokens (context {})",
                    cfg.block_size
                ),
            ));
        }
        let (b, n) = (sequences, sequences * t);
        let mut m = ModelBuilder::new();
        let tokens = m.tokens(&[b, t])?;
        let targets = m.targets(&[b, t])?;
        let positions = m.constant_ids(&[b, t], (0..n).map(|i| (i % t) as u32).collect())?;
        let params = (cfg
            .parameter_shapes()
            .iter()
            .zip(cfg.inits())
            .zip(cfg.decays()))
        .map(|(((name, shape), init), decay)| m.param(name, shape, init, decay))
        .collect::<Result<Vec<_>>>()?;
        let (wte, wpe) = (params[0], params[1]);

        let token_rows = m.embedding(wte, tokens)?;
        let position_rows = m.embedding(wpe, positions)?;
        let mut x = m.add(token_rows, position_rows)?;
        for l in 0..cfg.n_layer {
            let w = |offset| params[2 + l * PER_LAYER + offset];
            let ln1 = m.layer_norm(x, w(LN1_G), w(LN1_B))?;
            let qkv = m.linear(ln1, w(ATTN_W), w(ATTN_B))?;
            let heads = m.causal_attention(qkv, cfg.n_head)?;
            let proj = m.linear(heads, w(PROJ_W), w(PROJ_B))?;
            let x_mid = m.add(x, proj)?;
            let ln2 = m.layer_norm(x_mid, w(LN2_G), w(LN2_B))?;
            let fc = m.linear(ln2, w(FC_W), w(FC_B))?;
            let act = m.gelu(fc)?;
            let fc2 = m.linear(act, w(FC2_W), w(FC2_B))?;
            x = m.add(x_mid, fc2)?;
        }
        let nl = params.len() - 2;
        let lnf = m.layer_norm(x, params[nl], params[nl + 1])?;
        // The head is tied to the token embedding: logits = lnf . wte^T.
        let logits = m.matmul(lnf, wte, true)?;
        let loss = m.cross_entropy(logits, targets)?;
        m.finish(loss)
    }

    /// Whether AdamW's weight decay applies (matrices and embeddings, as nanoGPT).
    pub fn decays(&self) -> Vec<bool> {
        self.parameter_shapes()
            .iter()
            .map(|(_, s)| s.len() == 2)
            .collect()
    }
}

/// Parameters per block, and each one's offset in a block's.
const PER_LAYER: usize = 12;
const LN1_G: usize = 0;
const LN1_B: usize = 1;
const ATTN_W: usize = 2;
const ATTN_B: usize = 3;
const PROJ_W: usize = 4;
const PROJ_B: usize = 5;
const LN2_G: usize = 6;
const LN2_B: usize = 7;
const FC_W: usize = 8;
const FC_B: usize = 9;
const FC2_W: usize = 10;
const FC2_B: usize = 11;

/// The GPT on a backend.
pub struct Gpt<'a> {
    /// The model's configuration.
    pub config: GptConfig,
    /// The backend its plans are built for and run on.
    pub backend: &'a dyn Backend,
}

impl Gpt<'_> {
    /// The loss and the gradients (loss scale 1, no update) of `params` on a batch of whole
    /// sequences, by this backend's executor of that batch's plan.
    pub async fn loss_and_gradients(
        &self,
        p: &Precision,
        fp8: &[[f32; 3]],
        params: &[Vec<f32>],
        ids: &[u32],
        targets: &[u32],
    ) -> Result<(f64, Vec<Vec<f32>>)> {
        let (mut exec, scalars) = self.executor(p, fp8, params, ids, targets).await?;
        let stats = exec.run(Section::Gradients, ids, targets, &scalars).await?;
        let mut grads = Vec::new();
        for [_, g, _, _] in exec.plan().state.clone() {
            grads.push(exec.read(g).await?);
        }
        Ok((stats[Stats::LOSS], grads))
    }

    /// The loss of `params` on a batch of whole sequences.
    pub async fn loss(
        &self,
        p: &Precision,
        fp8: &[[f32; 3]],
        params: &[Vec<f32>],
        ids: &[u32],
        targets: &[u32],
    ) -> Result<f64> {
        let (mut exec, scalars) = self.executor(p, fp8, params, ids, targets).await?;
        let stats = exec.run(Section::Forward, ids, targets, &scalars).await?;
        Ok(stats[Stats::LOSS])
    }

    /// The logits (tokens x vocabulary) of one sequence of at most the context.
    pub async fn logits(
        &self,
        p: &Precision,
        fp8: &[[f32; 3]],
        params: &[Vec<f32>],
        ids: &[u32],
    ) -> Result<Vec<f32>> {
        let (mut exec, scalars) = self.executor(p, fp8, params, ids, ids).await?;
        exec.run(Section::Forward, ids, ids, &scalars).await?;
        let logits = exec.plan().logits;
        exec.read(logits).await
    }

    /// This backend's executor of the plan of batches shaped as `ids` (sequences of the
    /// context, or one shorter sequence) holding `params`, and unit scalars (`fp8`: delayed
    /// scaling's scales per linear layer; unit scales where empty).
    pub async fn executor(
        &self,
        p: &Precision,
        fp8: &[[f32; 3]],
        params: &[Vec<f32>],
        ids: &[u32],
        targets: &[u32],
    ) -> Result<(Box<dyn StepExecutor + '_>, Vec<f32>)> {
        let t = ids.len().min(self.config.block_size);
        self.check_batch(ids, targets, t)?;
        let plan = self.plan(p, ids.len() / t, t)?;
        if params.len() != plan.state.len() {
            return Err(Error::LengthMismatch {
                what: "parameter tensors",
                expected: plan.state.len(),
                got: params.len(),
            });
        }
        let scalars = StepScalars {
            adamw: &AdamW::default(),
            clip: 0.0,
            loss_scale: 1.0,
            poison: 0.0,
            t: 1,
            parts: 1,
            part: 0,
            fp8,
            eval: true,
        }
        .array(plan.rows, plan.scalar_count());
        let ids_of = plan.state.clone();
        let mut exec = crate::backend::executor(self.backend, plan, true)?;
        for ([id, ..], values) in ids_of.iter().zip(params) {
            exec.write(*id, values).await?;
        }
        Ok((exec, scalars))
    }

    /// Checks a batch of `sequences` sequences of `t` tokens against the model.
    pub fn check_batch(&self, ids: &[u32], targets: &[u32], t: usize) -> Result<()> {
        let v = self.config.vocab_size;
        if t == 0 || t > self.config.block_size || ids.is_empty() || !ids.len().is_multiple_of(t) {
            return Err(Error::invalid(
                "batch",
                format!(
                    "{} tokens do not make whole sequences of {t} (context {})",
                    ids.len(),
                    self.config.block_size
                ),
            ));
        }
        if targets.len() != ids.len() {
            return Err(Error::invalid(
                "batch",
                format!("{} targets for {} tokens", targets.len(), ids.len()),
            ));
        }
        if let Some(bad) = ids.iter().chain(targets).find(|&&i| i as usize >= v) {
            return Err(Error::invalid(
                "batch",
                format!("token id {bad} is outside the vocabulary of {v}"),
            ));
        }
        Ok(())
    }

    /// The plan of one step on batches of `sequences` sequences of `t` tokens: the forward pass
    /// to the loss, the backward pass to the gradients of `loss * loss scale`, the unscale and
    /// finite check, and the AdamW update (held in `p.weights`). Attention is one fused op where
    /// the backend has a kernel for it (`Capabilities::fuses_attention`), else the unfused ops; the
    /// matmuls' 16-bit inputs are stored as codes unless `MANTISSA_ACTIVATIONS=f32`.
    pub fn plan(&self, p: &Precision, sequences: usize, t: usize) -> Result<Plan> {
        let fused =
            (self.backend.capabilities()).fuses_attention(&p.matmul, self.config.head_dim());
        self.plan_with(p, sequences, t, fused, stores_codes()?)
    }

    /// `plan`, with attention fused (`Op::Attention`) or not, and the matmuls' 16-bit inputs
    /// stored as codes (`Plan::store_codes`) or as f32, as asked. Both choices leave the
    /// function the step computes as it is.
    pub fn plan_with(
        &self,
        p: &Precision,
        sequences: usize,
        t: usize,
        fused_attention: bool,
        coded: bool,
    ) -> Result<Plan> {
        // The GPT has no dropout: no masks to key.
        let options = PlanOptions {
            fused_attention,
            coded,
            seed: 0,
        };
        self.model(sequences, t)?.plan(p, options)
    }

    /// The model on batches of `sequences` sequences of `t` tokens (`GptConfig::model`).
    pub fn model(&self, sequences: usize, t: usize) -> Result<Model> {
        self.config.model(sequences, t)
    }
}
