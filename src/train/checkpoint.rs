//! Checkpoints of any built model (the GPT's among them): parameters and AdamW state as
//! safetensors, each tensor named by its parameter ("param.NAME", "adam_m.NAME",
//! "adam_v.NAME"), the run's state in the metadata. Written atomically (temporary file, fsync,
//! rename), so a crash never leaves a truncated checkpoint; loading validates everything before
//! anything is used: the CRC-32 of the tensor bytes, finite weights and moments (the second
//! moment not negative), a positive finite loss scale, the parameters' names and shapes (a
//! checkpoint of another model is refused with the names that differ) and, for the GPT, its
//! configuration and vocabulary.

use super::data::Vocab;
use super::model::GptConfig;
use crate::error::{Error, Result};
use crate::input::Input;
use crate::model::{Model, ModelTrainer, TrainState};
use crate::policy::{DelayedScaling, Fp8State, Preset};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

/// Format 2 adds the checksum; format 1 (without it) still loads, with every other check.
const FORMAT: &str = "mantissa-checkpoint-2";
const FORMAT_1: &str = "mantissa-checkpoint-1";

/// The prefixes of a checkpoint's tensors: the parameters, AdamW's first and second moments.
const GROUPS: [&str; 3] = ["param", "adam_m", "adam_v"];

/// What a checkpoint holds besides the tensors.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CheckpointMeta {
    /// "mantissa-checkpoint-2" (format 1 still loads).
    pub format: String,
    /// The GPT's configuration and vocabulary, in a checkpoint of the GPT (absent in one of
    /// another built model).
    #[serde(flatten)]
    pub gpt: Option<GptMeta>,
    /// The precision preset's name.
    pub preset: String,
    /// The run's seed.
    pub seed: u64,
    /// Steps run, skipped ones included.
    pub step: u32,
    /// Optimizer steps applied (AdamW's step count).
    pub applied: u32,
    /// The dynamic loss scale, under a preset with loss scaling.
    pub loss_scale: Option<f32>,
    /// GradScaler's clean steps since the last growth or backoff, with loss scaling.
    pub growth_tracker: Option<u32>,
    /// fp8 delayed scaling: per linear layer, the state of its input, weight and gradient
    /// (absent in checkpoints of other presets, and of earlier versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<Vec<[SavedScaling; 3]>>,
    /// CRC-32 of the tensor bytes: the parameters, then AdamW's first and second moments, each
    /// in the parameters' declaration order (format 2 on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32: Option<u32>,
}

/// A GPT checkpoint's model: its configuration and the corpus's vocabulary.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GptMeta {
    /// The model configuration's name ("tiny", ...).
    pub config: String,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block.
    pub n_head: usize,
    /// Embedding width.
    pub n_embd: usize,
    /// Context length in tokens.
    pub block_size: usize,
    /// Sequences per step.
    pub batch_size: usize,
    /// The corpus's vocabulary, its characters in token order (empty under GPT-2's BPE).
    pub vocab: String,
    /// The tokenizer, where it is not a token per character ("gpt2"; absent in checkpoints
    /// written before there was another).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
}

impl GptMeta {
    /// `config` on a corpus of `vocab`.
    pub fn of(config: &GptConfig, vocab: &Vocab) -> GptMeta {
        let (tokenizer, chars) = vocab.saved();
        GptMeta {
            config: config.name.clone(),
            n_layer: config.n_layer,
            n_head: config.n_head,
            n_embd: config.n_embd,
            block_size: config.block_size,
            batch_size: config.batch_size,
            vocab: chars,
            tokenizer,
        }
    }
}

/// What a checkpoint must be of to be resumed: the parameters (names and shapes, in
/// declaration order), and for the GPT its configuration and vocabulary.
pub struct Expected<'e> {
    params: Vec<(String, Vec<usize>)>,
    gpt: Option<(&'e GptConfig, &'e Vocab)>,
}

impl<'e> Expected<'e> {
    /// A checkpoint of the GPT of `config` trained on a corpus of `vocab`.
    pub fn gpt(config: &'e GptConfig, vocab: &'e Vocab) -> Expected<'e> {
        Expected {
            params: config.parameter_shapes(),
            gpt: Some((config, vocab)),
        }
    }

    /// A checkpoint of a model with `model`'s parameters.
    pub fn model(model: &Model) -> Expected<'static> {
        Expected {
            params: (model.params().iter())
                .map(|p| (p.name.clone(), p.shape.clone()))
                .collect(),
            gpt: None,
        }
    }

    /// Values of every tensor the checkpoint holds.
    fn values(&self) -> u64 {
        (self.params.iter())
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum()
    }

    /// Refuses `meta` where it is of another GPT (configuration or vocabulary): `bad` words it.
    fn check_gpt(&self, meta: &CheckpointMeta, bad: impl Fn(String) -> Error) -> Result<()> {
        let Some((config, vocab)) = self.gpt else {
            return Ok(());
        };
        let Some(theirs) = &meta.gpt else {
            return Err(bad(format!(
                "it is a checkpoint of a built model, not of the GPT of config '{}'",
                config.name
            )));
        };
        let dims = (
            theirs.n_layer,
            theirs.n_head,
            theirs.n_embd,
            theirs.block_size,
        );
        let ours = (
            config.n_layer,
            config.n_head,
            config.n_embd,
            config.block_size,
        );
        if dims != ours {
            return Err(bad(format!(
                "it holds config '{}' (layers, heads, width, context = {dims:?}), this run is \
                 '{}' ({ours:?})",
                theirs.config, config.name
            )));
        }
        if (theirs.tokenizer.clone(), theirs.vocab.clone()) != vocab.saved() {
            return Err(bad(format!(
                "it was trained on a corpus with another vocabulary ({}; this corpus has {})",
                Vocab::describe_saved(theirs.tokenizer.as_deref(), &theirs.vocab),
                vocab.describe()
            )));
        }
        Ok(())
    }

    /// Refuses tensor names that are not this model's checkpoint's, saying which parameters
    /// the checkpoint has that the model lacks and which it lacks (at most 8 of each).
    fn check_names<'n>(
        &self,
        names: impl Iterator<Item = &'n str>,
        bad: impl Fn(String) -> Error,
    ) -> Result<()> {
        let ours: BTreeSet<String> = (self.params.iter())
            .flat_map(|(n, _)| GROUPS.map(|g| format!("{g}.{n}")))
            .collect();
        let theirs: BTreeSet<String> = names.map(str::to_owned).collect();
        match names_that_differ(&theirs, &ours) {
            None => Ok(()),
            Some(differ) => Err(bad(format!(
                "it is a checkpoint of another model: {differ}"
            ))),
        }
    }
}

/// What differs between the names a file holds (`theirs`) and a model's (`ours`): "it holds
/// a, b that the model has not; it lacks c" (at most 8 of each named); None where they agree.
pub(crate) fn names_that_differ(
    theirs: &BTreeSet<String>,
    ours: &BTreeSet<String>,
) -> Option<String> {
    let list = |names: Vec<&String>| {
        let shown: Vec<&str> = names.iter().take(8).map(|s| s.as_str()).collect();
        match names.len() {
            n if n > 8 => format!("{} and {} more", shown.join(", "), n - 8),
            _ => shown.join(", "),
        }
    };
    let extra: Vec<&String> = theirs.difference(ours).collect();
    let missing: Vec<&String> = ours.difference(theirs).collect();
    let mut said = vec![];
    if !extra.is_empty() {
        said.push(format!("it holds {} that the model has not", list(extra)));
    }
    if !missing.is_empty() {
        said.push(format!("it lacks {}", list(missing)));
    }
    (!said.is_empty()).then(|| said.join("; "))
}

/// The CRC-32 of the state's tensors in checkpoint order.
pub fn checksum(params: &[Vec<f32>], adam_m: &[Vec<f32>], adam_v: &[Vec<f32>]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for t in params.iter().chain(adam_m).chain(adam_v) {
        h.update(bytemuck::cast_slice(t));
    }
    h.finalize()
}

/// The delayed-scaling state of one fp8 tensor, as a checkpoint keeps it (JSON numbers
/// round-trip f32 exactly).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SavedScaling {
    /// The amaxes, oldest first.
    pub history: Vec<f32>,
    /// The scale the next step quantizes with.
    pub scale: f32,
}

impl SavedScaling {
    fn of(s: &DelayedScaling) -> SavedScaling {
        SavedScaling {
            history: s.history.iter().copied().collect(),
            scale: s.scale,
        }
    }

    /// Puts the saved state into `s`, refusing values no run produces; a history longer than
    /// this run keeps keeps its newest entries.
    fn restore(&self, s: &mut DelayedScaling) -> std::result::Result<(), String> {
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return Err(format!("fp8 scale {}", self.scale));
        }
        if let Some(bad) = self.history.iter().find(|a| !(a.is_finite() && **a >= 0.0)) {
            return Err(format!("fp8 amax {bad}"));
        }
        let skip = self.history.len().saturating_sub(s.history_len);
        s.history = self.history[skip..].iter().copied().collect();
        s.scale = self.scale;
        Ok(())
    }
}

/// The longest safetensors header a checkpoint (or a file of initial weights) may have: its
/// metadata holds the vocabulary (a few KiB for Shakespeare) and the fp8 histories (a few
/// hundred KiB at most).
pub const MAX_HEADER_BYTES: u64 = 16 << 20;

/// A safetensors file (or standard input, `-`) opened through `input::Input` and its header read
/// alone: the 8-byte length, then the header, checked against the file's length before
/// anything else is read. Its tensors are read by `read` once the caller has checked the size
/// the header declares: a file longer or shorter than its header says, or a header claiming
/// more than the model holds, is refused unread (`/dev/zero`, a 2 GB sparse file). Checkpoints
/// (`CheckpointFile`) and initial weights (`init::read_init`) are read through it.
pub struct SafetensorsFile {
    input: Input,
    /// What was read: the length and the header.
    head: Vec<u8>,
    /// The safetensors header (tensor names, dtypes, shapes, offsets; metadata).
    pub header: safetensors::tensor::Metadata,
    /// Bytes of tensor data the header declares.
    pub data_len: u64,
    /// What a refusal says the file is not ("a usable checkpoint").
    usable_as: &'static str,
}

impl SafetensorsFile {
    /// Opens `path` and reads its header; a refusal says it is "not {usable_as}".
    pub fn open(path: &Path, usable_as: &'static str) -> Result<SafetensorsFile> {
        let bad = |why: String| Error::file(path, format!("not {usable_as}: {why}"));
        let mut input = Input::open(path)?;
        let mut head = input.read_exactly(8, "the safetensors header length")?;
        let n = u64::from_le_bytes(head[..8].try_into().unwrap_or_default());
        if n > MAX_HEADER_BYTES || input.len().is_some_and(|len| n > len.saturating_sub(8)) {
            return Err(bad(format!(
                "a header of {n} bytes, more than {}",
                match input.len() {
                    Some(len) if n > len.saturating_sub(8) =>
                        format!("the file's {len} bytes hold"),
                    _ => format!("the {MAX_HEADER_BYTES} a header may have"),
                }
            )));
        }
        head.extend(input.read_exactly(n, "the safetensors header")?);
        let header: safetensors::tensor::Metadata = serde_json::from_slice(&head[8..])
            .map_err(|e| bad(format!("corrupt or truncated header ({e})")))?;
        let data_len = header.data_len() as u64;
        let total = 8 + n + data_len;
        if let Some(len) = input.len()
            && len != total
        {
            return Err(bad(format!(
                "corrupt or truncated: the file holds {len} bytes, its header says {total}"
            )));
        }
        Ok(SafetensorsFile {
            input,
            head,
            header,
            data_len,
            usable_as,
        })
    }

    /// A refusal of this file: "PATH: not {usable_as}: {why}".
    pub fn bad(&self, why: impl std::fmt::Display) -> Error {
        Error::file(self.input.path(), format!("not {}: {why}", self.usable_as))
    }

    /// The whole file (its tensors read, asked of the host first, and nothing after them).
    pub fn read(mut self) -> Result<Vec<u8>> {
        let data = self.input.read_exactly(self.data_len, "the tensors")?;
        self.input.expect_end("the tensors")?;
        let mut bytes =
            crate::memory::empty_with_capacity("the tensors", self.head.len() + data.len())?;
        bytes.extend_from_slice(&self.head);
        bytes.extend_from_slice(&data);
        Ok(bytes)
    }
}

/// A checkpoint file, its header read (`SafetensorsFile`) and its run state with it; the
/// tensors are read by `read` once their size is known to be what the run's model takes.
pub struct CheckpointFile {
    file: SafetensorsFile,
    /// The run state the header's metadata holds.
    pub meta: CheckpointMeta,
}

impl CheckpointFile {
    /// Opens a checkpoint and reads its header and metadata.
    pub fn open(path: &Path) -> Result<CheckpointFile> {
        let file = SafetensorsFile::open(path, "a usable checkpoint")?;
        let meta = file
            .header
            .metadata()
            .as_ref()
            .and_then(|m| m.get("mantissa"))
            .ok_or_else(|| file.bad("no mantissa metadata"))
            .and_then(|json| {
                serde_json::from_str(json).map_err(|e| file.bad(format!("metadata: {e}")))
            })?;
        Ok(CheckpointFile { file, meta })
    }

    /// The whole file, read once its header is known to be a checkpoint of `expected`: its
    /// model (the GPT's configuration and vocabulary; the parameters' names) and the size of
    /// its tensors. A checkpoint of another model is refused by what differs, unread.
    pub fn read(self, expected: &Expected) -> Result<Vec<u8>> {
        let bad = |why: String| self.file.bad(why);
        expected.check_gpt(&self.meta, bad)?;
        let tensors = self.file.header.tensors();
        expected.check_names(tensors.keys().map(String::as_str), bad)?;
        let want = 3 * 4 * expected.values();
        if self.file.data_len != want {
            return Err(bad(format!(
                "its tensors take {} bytes, this model's take {want}",
                self.file.data_len
            )));
        }
        self.file.read()
    }
}

/// A checkpoint, read and checked: its run state and tensors.
pub struct Checkpoint {
    /// The run state.
    pub meta: CheckpointMeta,
    /// The parameters, in declaration order.
    pub params: Vec<Vec<f32>>,
    /// AdamW's first moments.
    pub adam_m: Vec<Vec<f32>>,
    /// AdamW's second moments.
    pub adam_v: Vec<Vec<f32>>,
}

impl Checkpoint {
    /// Writes `run`'s state to `path` atomically (`gpt`: the GPT's configuration and
    /// vocabulary, where the model is the GPT). A parameter or moment that is not finite is
    /// `Error::Diverged`, and nothing is written.
    pub async fn save(run: &mut ModelTrainer<'_>, gpt: Option<GptMeta>, path: &Path) -> Result<()> {
        let state = run.state().await?;
        let names: Vec<&str> = run.model.params().iter().map(|p| p.name.as_str()).collect();
        let groups = [&state.params, &state.adam_m, &state.adam_v];
        for (prefix, tensors) in GROUPS.iter().zip(groups) {
            for (name, t) in names.iter().zip(tensors.iter()) {
                if let Some(i) = t.iter().position(|x| !x.is_finite()) {
                    return Err(Error::Diverged {
                        preset: run.preset.to_string(),
                        step: run.steps,
                        why: format!(
                            "{prefix}.{name}[{i}] is {} after step {}, so no checkpoint is \
                             written; try a smaller learning rate",
                            t[i], run.steps
                        ),
                    });
                }
            }
        }
        let meta = CheckpointMeta {
            format: FORMAT.into(),
            gpt,
            preset: run.preset.to_string(),
            seed: run.seed(),
            step: run.steps,
            applied: run.applied,
            loss_scale: run.scaler.map(|s| s.scale),
            growth_tracker: run.scaler.map(|s| s.growth_tracker),
            fp8: run.fp8.as_ref().map(|state| {
                (state.layers.iter())
                    .map(|l| l.roles().map(SavedScaling::of))
                    .collect()
            }),
            crc32: Some(checksum(&state.params, &state.adam_m, &state.adam_v)),
        };
        let expected = Expected::model(&run.model);
        let data =
            Checkpoint::bytes(&meta, &expected, &state).map_err(|e| Error::output(path, e))?;
        crate::output::write_bytes(path, &data)
    }

    /// The bytes of a checkpoint of `state` (of `expected`'s parameters) with `meta`.
    pub fn bytes(
        meta: &CheckpointMeta,
        expected: &Expected,
        state: &TrainState,
    ) -> std::result::Result<Vec<u8>, String> {
        let shapes = &expected.params;
        let groups = [&state.params, &state.adam_m, &state.adam_v];
        let mut views = Vec::new();
        for (prefix, tensors) in GROUPS.iter().zip(groups) {
            if tensors.len() != shapes.len() {
                return Err(format!(
                    "{} {prefix} tensors, the model has {}",
                    tensors.len(),
                    shapes.len()
                ));
            }
            for ((name, shape), t) in shapes.iter().zip(tensors.iter()) {
                let view = TensorView::new(Dtype::F32, shape.clone(), bytemuck::cast_slice(t))
                    .map_err(|e| format!("cannot serialise {prefix}.{name}: {e}"))?;
                views.push((format!("{prefix}.{name}"), view));
            }
        }
        let json = serde_json::to_string(meta).map_err(|e| e.to_string())?;
        safetensors::serialize(views, Some(HashMap::from([("mantissa".to_string(), json)])))
            .map_err(|e| format!("cannot serialise: {e}"))
    }

    /// Reads and checks a checkpoint of `expected` (`CheckpointFile`, `from_bytes`).
    pub fn load(path: &Path, expected: &Expected) -> Result<Checkpoint> {
        let bytes = CheckpointFile::open(path)?.read(expected)?;
        Checkpoint::from_bytes(&bytes, path, expected)
    }

    /// A checkpoint of `expected` from the bytes of a file (`path` names it in errors), every
    /// check made: format, checksum, loss scale, counts, model, finite values.
    pub fn from_bytes(bytes: &[u8], path: &Path, expected: &Expected) -> Result<Checkpoint> {
        let bad = |why: String| Error::file(path, format!("not a usable checkpoint: {why}"));
        let (_, header) = SafeTensors::read_metadata(bytes)
            .map_err(|e| bad(format!("corrupt or truncated ({e})")))?;
        let json = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get("mantissa"))
            .ok_or_else(|| bad("no mantissa metadata".into()))?;
        let meta: CheckpointMeta =
            serde_json::from_str(json).map_err(|e| bad(format!("metadata: {e}")))?;
        if meta.format != FORMAT && meta.format != FORMAT_1 {
            return Err(bad(format!("format {} (expected {FORMAT})", meta.format)));
        }
        if meta.format == FORMAT && meta.crc32.is_none() {
            return Err(bad("no checksum".into()));
        }
        if let Some(scale) = meta.loss_scale
            && !(scale.is_finite() && scale > 0.0)
        {
            return Err(bad(format!(
                "loss scale {scale} (must be finite and positive)"
            )));
        }
        if meta.applied > meta.step {
            return Err(bad(format!(
                "{} applied updates in {} steps",
                meta.applied, meta.step
            )));
        }
        expected.check_gpt(&meta, bad)?;
        let tensors = SafeTensors::deserialize(bytes)
            .map_err(|e| bad(format!("corrupt or truncated ({e})")))?;
        expected.check_names(tensors.names().into_iter().map(|n: &str| n), bad)?;
        let read = |prefix: &str| -> Result<Vec<Vec<f32>>> {
            (expected.params.iter())
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
        let (params, adam_m, adam_v) = (read("param")?, read("adam_m")?, read("adam_v")?);
        if let Some(want) = meta.crc32 {
            let got = checksum(&params, &adam_m, &adam_v);
            if got != want {
                return Err(bad(format!(
                    "its tensor bytes are corrupt (CRC-32 {got:08x}, the header says {want:08x})"
                )));
            }
        }
        // Values no run writes: a NaN or inf anywhere, or a negative second moment.
        let names = &expected.params;
        let bad_value = |prefix: &str, tensors: &[Vec<f32>], ok: fn(f32) -> bool| {
            tensors.iter().zip(names).find_map(|(t, (name, _))| {
                let i = t.iter().position(|&x| !ok(x))?;
                Some(bad(format!("{prefix}.{name}[{i}] is {}", t[i])))
            })
        };
        let finite = |x: f32| x.is_finite();
        let second_moment = |x: f32| x.is_finite() && x >= 0.0;
        if let Some(e) = bad_value("param", &params, finite)
            .or_else(|| bad_value("adam_m", &adam_m, finite))
            .or_else(|| bad_value("adam_v", &adam_v, second_moment))
        {
            return Err(e);
        }
        Ok(Checkpoint {
            params,
            adam_m,
            adam_v,
            meta,
        })
    }

    /// Puts the checkpoint's state into `run` (which must train the checkpoint's model under
    /// its preset): parameters, moments, the step counts, the loss scale and fp8 scaling, so
    /// that the steps that follow are those of the run that wrote it. Everything is checked
    /// before anything changes.
    pub async fn restore(self, run: &mut ModelTrainer<'_>) -> Result<()> {
        let preset: Preset = self.meta.preset.parse()?;
        if preset != run.preset {
            return Err(Error::invalid(
                "resume",
                format!(
                    "the checkpoint was trained under {preset}, this run is {}",
                    run.preset
                ),
            ));
        }
        // Read against another model's names, the counts or shapes differ (`set_state`).
        let count = run.model.params().len();
        if [&self.params, &self.adam_m, &self.adam_v]
            .iter()
            .any(|t| t.len() != count)
        {
            return Err(Error::LengthMismatch {
                what: "checkpoint tensors",
                expected: count,
                got: self.params.len(),
            });
        }
        // A preset that scales its loss needs the scale (JSON writes a non-finite one as null).
        if run.scaler.is_some()
            && (self.meta.loss_scale.is_none() || self.meta.growth_tracker.is_none())
        {
            return Err(Error::invalid(
                "resume",
                "the checkpoint holds no usable loss scale for a preset that scales its loss",
            ));
        }
        // Check the fp8 state before anything changes.
        let mut fp8 = run.fp8.clone();
        if let (Some(Fp8State { layers: states }), Some(saved)) = (&mut fp8, &self.meta.fp8) {
            if saved.len() != states.len() {
                return Err(Error::invalid(
                    "resume",
                    format!(
                        "the checkpoint holds fp8 state for {} linear layers, this model has {}",
                        saved.len(),
                        states.len()
                    ),
                ));
            }
            for (l, s) in states.iter_mut().zip(saved) {
                for (state, saved) in l.roles_mut().into_iter().zip(s) {
                    saved.restore(state).map_err(|why| {
                        Error::invalid("resume", format!("the checkpoint's {why} is not usable"))
                    })?;
                }
            }
        }
        run.set_state(&TrainState {
            params: self.params,
            adam_m: self.adam_m,
            adam_v: self.adam_v,
        })
        .await?;
        run.steps = self.meta.step;
        run.applied = self.meta.applied;
        if let (Some(s), Some(scale), Some(tracker)) = (
            run.scaler.as_mut(),
            self.meta.loss_scale,
            self.meta.growth_tracker,
        ) {
            s.scale = scale;
            s.growth_tracker = tracker;
        }
        run.fp8 = fp8;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint of `config` (zero state) over `vocab`, written to a file in `dir`, with
    /// `extra` tensors beside its own.
    fn file(
        dir: &Path,
        config: &GptConfig,
        vocab: &str,
        extra: &[(&str, Vec<f32>)],
    ) -> std::path::PathBuf {
        let zeros: Vec<Vec<f32>> = (config.parameter_shapes().iter())
            .map(|(_, s)| vec![0.0; s.iter().product()])
            .collect();
        let state = TrainState {
            params: zeros.clone(),
            adam_m: zeros.clone(),
            adam_v: zeros,
        };
        let meta = CheckpointMeta {
            format: FORMAT.into(),
            gpt: Some(GptMeta::of(config, &Vocab::Chars(vocab.chars().collect()))),
            preset: "32-true".into(),
            seed: 1,
            step: 0,
            applied: 0,
            loss_scale: None,
            growth_tracker: None,
            fp8: None,
            crc32: Some(checksum(&state.params, &state.adam_m, &state.adam_v)),
        };
        let mut bytes =
            Checkpoint::bytes(&meta, &Expected::gpt(config, &Vocab::Chars(vec![])), &state)
                .unwrap();
        if !extra.is_empty() {
            let read = SafeTensors::deserialize(&bytes).unwrap();
            let mut views: Vec<(String, TensorView)> = read.tensors();
            for (name, values) in extra {
                let view =
                    TensorView::new(Dtype::F32, vec![values.len()], bytemuck::cast_slice(values));
                views.push((name.to_string(), view.unwrap()));
            }
            let json = serde_json::to_string(&meta).unwrap();
            let metadata = HashMap::from([("mantissa".to_string(), json)]);
            bytes = safetensors::serialize(views, Some(metadata)).unwrap();
        }
        let path = dir.join("ck.safetensors");
        std::fs::write(&path, bytes).unwrap();
        path
    }

    /// A checkpoint of another vocabulary or model shape, or holding a tensor no checkpoint
    /// holds, is refused saying so, not by a count of bytes (round four: "its tensors take N
    /// bytes, config 'tiny' takes M").
    #[test]
    fn another_models_checkpoint_is_refused_by_what_differs() {
        let dir = tempfile::tempdir().unwrap();
        let tiny = GptConfig::named("tiny", 5).unwrap();
        let abcde = Vocab::Chars("abcde".chars().collect());
        let read = |path: &Path, config: &GptConfig| {
            let e = CheckpointFile::open(path)
                .and_then(|f| f.read(&Expected::gpt(config, &abcde)))
                .unwrap_err();
            assert_eq!(e.class(), crate::error::ErrorClass::BadInput, "{e}");
            e.to_string()
        };
        let path = file(dir.path(), &tiny, "abcdf", &[]);
        let said = read(&path, &tiny);
        assert!(said.contains("another vocabulary (5 characters"), "{said}");
        let path = file(dir.path(), &tiny, "abcde", &[]);
        let said = read(&path, &GptConfig::named("small", 5).unwrap());
        assert!(said.contains("it holds config 'tiny'"), "{said}");
        let path = file(dir.path(), &tiny, "abcde", &[("adam_q.wte", vec![0.0; 4])]);
        let said = read(&path, &tiny);
        assert!(
            said.contains("another model: it holds adam_q.wte that the model has not"),
            "{said}"
        );
        let path = file(dir.path(), &tiny, "abcde", &[]);
        assert!(Checkpoint::load(&path, &Expected::gpt(&tiny, &abcde)).is_ok());
    }
}
