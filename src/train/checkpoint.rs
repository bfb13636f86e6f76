//! Checkpoints: parameters and AdamW state as safetensors, the run's state in the metadata.
//! Written atomically (temporary file, fsync, rename), so a crash never leaves a truncated
//! checkpoint; loading validates everything before anything is used.

use super::model::GptConfig;
use super::trainer::{TrainState, Trainer};
use crate::error::{Error, Result};
use crate::policy::Preset;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

const FORMAT: &str = "mantissa-checkpoint-1";

/// What a checkpoint holds besides the tensors.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CheckpointMeta {
    pub format: String,
    pub config: String,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub block_size: usize,
    pub batch_size: usize,
    pub vocab: String,
    pub preset: String,
    pub seed: u64,
    pub step: u32,
    pub applied: u32,
    pub loss_scale: Option<f32>,
    pub growth_tracker: Option<u32>,
}

/// The tensors and state of a checkpoint, validated.
pub struct Checkpoint {
    pub meta: CheckpointMeta,
    pub params: Vec<Vec<f32>>,
    pub adam_m: Vec<Vec<f32>>,
    pub adam_v: Vec<Vec<f32>>,
}

impl Checkpoint {
    /// Saves `trainer` (its state read back from the device) to `path` atomically.
    pub async fn save(trainer: &mut Trainer<'_>, path: &Path) -> Result<()> {
        let state = trainer.state().await?;
        let cfg = &trainer.gpt.config;
        let meta = CheckpointMeta {
            format: FORMAT.into(),
            config: cfg.name.clone(),
            n_layer: cfg.n_layer,
            n_head: cfg.n_head,
            n_embd: cfg.n_embd,
            block_size: cfg.block_size,
            batch_size: cfg.batch_size,
            vocab: trainer.corpus.vocab.iter().collect(),
            preset: trainer.options.preset.to_string(),
            seed: trainer.options.seed,
            step: trainer.step,
            applied: trainer.applied,
            loss_scale: trainer.scaler.map(|s| s.scale),
            growth_tracker: trainer.scaler.map(|s| s.growth_tracker),
        };
        let shapes = cfg.parameter_shapes();
        let bytes: Vec<(String, Vec<usize>, &[u8])> =
            shapes
                .iter()
                .zip(&state.params)
                .map(|((n, s), p)| {
                    (
                        format!("param.{n}"),
                        s.clone(),
                        bytemuck::cast_slice::<f32, u8>(p),
                    )
                })
                .chain(
                    shapes.iter().zip(&state.adam_m).map(|((n, s), p)| {
                        (format!("adam_m.{n}"), s.clone(), bytemuck::cast_slice(p))
                    }),
                )
                .chain(
                    shapes.iter().zip(&state.adam_v).map(|((n, s), p)| {
                        (format!("adam_v.{n}"), s.clone(), bytemuck::cast_slice(p))
                    }),
                )
                .collect();
        let views = bytes
            .iter()
            .map(|(n, s, b)| TensorView::new(Dtype::F32, s.clone(), b).map(|v| (n.clone(), v)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::file(path, format!("cannot serialise: {e}")))?;
        let json = serde_json::to_string(&meta).map_err(|e| Error::file(path, e))?;
        let data =
            safetensors::serialize(views, Some(HashMap::from([("mantissa".to_string(), json)])))
                .map_err(|e| Error::file(path, format!("cannot serialise: {e}")))?;
        let tmp = path.with_extension("safetensors.partial");
        let written = (|| -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&data)?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        written.map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::file(path, e)
        })
    }

    /// Loads and validates a checkpoint for `config` (the same shapes) and `vocab`.
    pub fn load(path: &Path, config: &GptConfig, vocab: &[char]) -> Result<Checkpoint> {
        let bytes = std::fs::read(path).map_err(|e| Error::file(path, e))?;
        let bad = |why: String| Error::file(path, format!("not a usable checkpoint: {why}"));
        let (_, header) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| bad(format!("corrupt or truncated ({e})")))?;
        let json = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get("mantissa"))
            .ok_or_else(|| bad("no mantissa metadata".into()))?;
        let meta: CheckpointMeta =
            serde_json::from_str(json).map_err(|e| bad(format!("metadata: {e}")))?;
        if meta.format != FORMAT {
            return Err(bad(format!("format {} (expected {FORMAT})", meta.format)));
        }
        let theirs = (meta.n_layer, meta.n_head, meta.n_embd, meta.block_size);
        let ours = (
            config.n_layer,
            config.n_head,
            config.n_embd,
            config.block_size,
        );
        if theirs != ours {
            return Err(bad(format!(
                "it holds config '{}' (layers, heads, width, context = {theirs:?}), this run is '{}' ({ours:?})",
                meta.config, config.name
            )));
        }
        if meta.vocab.chars().collect::<Vec<_>>() != vocab {
            return Err(bad(
                "it was trained on a corpus with another vocabulary".into()
            ));
        }
        let tensors = SafeTensors::deserialize(&bytes)
            .map_err(|e| bad(format!("corrupt or truncated ({e})")))?;
        let read = |prefix: &str| -> Result<Vec<Vec<f32>>> {
            config
                .parameter_shapes()
                .iter()
                .map(|(name, shape)| {
                    let key = format!("{prefix}.{name}");
                    let t = tensors
                        .tensor(&key)
                        .map_err(|_| bad(format!("tensor {key} is missing")))?;
                    if t.dtype() != Dtype::F32 || t.shape() != shape.as_slice() {
                        return Err(bad(format!(
                            "tensor {key} is {:?} {:?}, expected F32 {shape:?}",
                            t.dtype(),
                            t.shape()
                        )));
                    }
                    Ok(bytemuck::pod_collect_to_vec(t.data()))
                })
                .collect()
        };
        Ok(Checkpoint {
            params: read("param")?,
            adam_m: read("adam_m")?,
            adam_v: read("adam_v")?,
            meta,
        })
    }

    /// Puts the checkpoint's state into `trainer` (which must run the checkpoint's preset).
    pub async fn restore(self, trainer: &mut Trainer<'_>) -> Result<()> {
        let preset: Preset = self.meta.preset.parse()?;
        if preset != trainer.options.preset {
            return Err(Error::invalid(
                "resume",
                format!(
                    "the checkpoint was trained under {preset}, this run is {}",
                    trainer.options.preset
                ),
            ));
        }
        trainer
            .set_state(&TrainState {
                params: self.params,
                adam_m: self.adam_m,
                adam_v: self.adam_v,
            })
            .await?;
        trainer.step = self.meta.step;
        trainer.applied = self.meta.applied;
        if let (Some(s), Some(scale), Some(tracker)) = (
            trainer.scaler.as_mut(),
            self.meta.loss_scale,
            self.meta.growth_tracker,
        ) {
            s.scale = scale;
            s.growth_tracker = tracker;
        }
        Ok(())
    }
}
