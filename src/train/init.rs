//! Initial weights from a file (`mantissa train --init`) and to one (`--export-init`), under
//! the engine's own names or under the `state_dict` names of the PyTorch model in
//! `scripts/anchors/torch_gpt.py`, so that a run can start from PyTorch's weights and PyTorch
//! from the engine's.
//!
//! The mapping (docs/training.md has the table): `tok.weight` is `wte` (and `head.weight`, tied
//! to it), `pos.weight` `wpe`, `blocks.{i}.ln1|ln2.weight|bias` `h{i}.ln1|ln2.g|b`,
//! `blocks.{i}.qkv|proj|fc|out.weight|bias` `h{i}.attn|proj|fc|fc2.w|b`, `ln.weight|bias`
//! `lnf.g|b`. PyTorch's linear weights are [out, in], the engine's [in, out]: they are
//! transposed on the way in and out. The engine's names are those of its checkpoints
//! (`param.wte`, ...): such a file is read as a checkpoint, every check of `--resume` made, and
//! its AdamW moments are left aside.

use super::checkpoint::{Checkpoint, Expected, SafetensorsFile, names_that_differ};
use super::data::Vocab;
use super::model::GptConfig;
use crate::error::{Error, Result};
use crate::model::Model;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

/// The PyTorch name of parameter `ours` (a `GptConfig::parameter_shapes` name) and whether
/// PyTorch stores it transposed ([out, in]).
pub fn torch_name(ours: &str) -> (String, bool) {
    fn renamed(part: &str) -> &str {
        match part {
            "attn" => "qkv",
            "fc2" => "out",
            "g" | "w" => "weight",
            "b" => "bias",
            other => other,
        }
    }
    match ours {
        "wte" => ("tok.weight".into(), false),
        "wpe" => ("pos.weight".into(), false),
        "lnf.g" => ("ln.weight".into(), false),
        "lnf.b" => ("ln.bias".into(), false),
        _ => {
            // h{i}.{module}.{param}
            let mut parts = ours.splitn(3, '.');
            let (layer, module, param) = (
                parts.next().unwrap_or_default(),
                parts.next().unwrap_or_default(),
                parts.next().unwrap_or_default(),
            );
            let name = format!(
                "blocks.{}.{}.{}",
                layer.trim_start_matches('h'),
                renamed(module),
                renamed(param)
            );
            (name, param == "w")
        }
    }
}

/// The tied head's weight in PyTorch's `state_dict`: the token embedding again.
const TORCH_HEAD: &str = "head.weight";
/// Prefix of the parameters in the engine's checkpoints (and of their moments, left aside).
const OURS: &str = "param.";
const MOMENTS: [&str; 2] = ["adam_m.", "adam_v."];

/// What a refused file is not.
const USABLE: &str = "usable as initial weights";

/// Reads initial weights for `config` from a safetensors file (see the module's header),
/// refusing a missing, extra, misshapen or non-finite tensor by name; a file under the engine's
/// names is one of its checkpoints, checked as `--resume` checks it (`Checkpoint::from_bytes`:
/// metadata, CRC-32, config, vocabulary). Returns them in `GptConfig::parameter_shapes` order
/// and layout, in f32 (f64 tensors rounded to nearest). The header is read first
/// (`SafetensorsFile`), and tensors beyond what such a file of `config` holds are refused
/// unread.
pub fn read_init(path: &Path, config: &GptConfig, vocab: &Vocab) -> Result<Vec<Vec<f32>>> {
    let file = SafetensorsFile::open(path, USABLE)?;
    // The most either naming holds: PyTorch's in f64 with the tied head written out, or a
    // checkpoint's parameters and two moments in f32.
    let values = config.parameter_count() as u64;
    let head = (config.vocab_size * config.n_embd) as u64;
    let limit = (8 * (values + head)).max(12 * values);
    if file.data_len > limit {
        return Err(file.bad(format!(
            "its tensors take {} bytes, more than initial weights of config '{}' do ({limit})",
            file.data_len, config.name
        )));
    }
    init_from_bytes(&file.read()?, path, config, vocab)
}

/// `read_init` over a file's bytes; `path` names it in errors.
pub fn init_from_bytes(
    bytes: &[u8],
    path: &Path,
    config: &GptConfig,
    vocab: &Vocab,
) -> Result<Vec<Vec<f32>>> {
    let bad = |why: String| Error::file(path, format!("not {USABLE}: {why}"));
    let (_, header) = SafeTensors::read_metadata(bytes)
        .map_err(|e| bad(format!("not a safetensors file, or truncated ({e})")))?;
    if let Some(saved) = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get("mantissa"))
        .and_then(|json| serde_json::from_str::<serde_json::Value>(json).ok())
        .and_then(|meta| meta.get("vocab")?.as_str().map(str::to_owned))
        && saved != vocab.saved().1
    {
        return Err(bad(
            "it was trained on a corpus with another vocabulary".into()
        ));
    }
    let tensors =
        SafeTensors::deserialize(bytes).map_err(|e| bad(format!("corrupt or truncated ({e})")))?;
    let names: BTreeSet<String> = tensors.names().into_iter().map(str::to_owned).collect();
    let torch = !names.iter().any(|n| n.starts_with(OURS));
    let shapes = config.parameter_shapes();
    // Each parameter's name in the file, and whether the file holds it transposed.
    let wanted: Vec<(String, bool)> = shapes
        .iter()
        .map(|(ours, _)| match torch {
            true => torch_name(ours),
            false => (format!("{OURS}{ours}"), false),
        })
        .collect();
    let known: BTreeSet<&str> = wanted.iter().map(|(n, _)| n.as_str()).collect();
    let extra: Vec<&String> = names
        .iter()
        .filter(|n| !known.contains(n.as_str()))
        .filter(|n| !(torch && *n == TORCH_HEAD))
        .filter(|n| torch || !MOMENTS.iter().any(|m| n.starts_with(m)))
        .collect();
    if let Some(name) = extra.first() {
        return Err(bad(format!(
            "tensor {name} is not a parameter of the model{} ({} in all: {}); it holds {}",
            if extra.len() > 1 {
                " (nor are others)"
            } else {
                ""
            },
            extra.len(),
            extra
                .iter()
                .take(4)
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            if torch {
                "PyTorch state_dict names (tok.weight, blocks.0.qkv.weight, ...)"
            } else {
                "the engine's checkpoint names (param.wte, param.h0.attn.w, ...)"
            }
        )));
    }
    if !torch {
        // The engine's names are its checkpoints': checked as `--resume` checks them (metadata,
        // format, CRC-32, config, vocabulary, finite values), the moments then left aside.
        return Checkpoint::from_bytes(bytes, path, &Expected::gpt(config, vocab))
            .map(|ck| ck.params);
    }
    let read = |name: &str, shape: &[usize], transposed: bool| {
        tensor_values(&tensors, name, shape, transposed, bad)
    };
    let params = shapes
        .iter()
        .zip(&wanted)
        .map(|((_, shape), (name, transposed))| read(name, shape, *transposed))
        .collect::<Result<Vec<_>>>()?;
    if torch && names.contains(TORCH_HEAD) {
        let head = read(TORCH_HEAD, &shapes[0].1, false)?;
        if head != params[0] {
            return Err(bad(format!(
                "tensor {TORCH_HEAD} differs from tok.weight; this model's head is tied to the \
                 token embedding"
            )));
        }
    }
    Ok(params)
}

/// Tensor `name` of `tensors` as f32 values of `shape` (stored [out, in] where `transposed`,
/// then transposed back), F32 or F64 (rounded to nearest; a finite value beyond f32's range is
/// refused), every value finite; `bad` words a refusal.
fn tensor_values(
    tensors: &SafeTensors,
    name: &str,
    shape: &[usize],
    transposed: bool,
    bad: impl Fn(String) -> Error,
) -> Result<Vec<f32>> {
    let t = tensors
        .tensor(name)
        .map_err(|_| bad(format!("tensor {name} is missing")))?;
    let stored: Vec<usize> = match transposed {
        true => shape.iter().rev().copied().collect(),
        false => shape.to_vec(),
    };
    if t.shape() != stored.as_slice() {
        return Err(bad(format!(
            "tensor {name} is {:?}, this model's is {stored:?}{}",
            t.shape(),
            if transposed { " ([out, in])" } else { "" }
        )));
    }
    let values: Vec<f32> = match t.dtype() {
        Dtype::F32 => bytemuck::pod_collect_to_vec(t.data()),
        Dtype::F64 => {
            let wide = bytemuck::pod_collect_to_vec::<u8, f64>(t.data());
            // A finite f64 beyond f32's range becomes inf: said as the value it was.
            if let Some(i) = wide
                .iter()
                .position(|x| x.is_finite() && !(*x as f32).is_finite())
            {
                return Err(bad(format!(
                    "{name}[{i}] is {:e}, beyond f32's range",
                    wide[i]
                )));
            }
            wide.into_iter().map(|x| x as f32).collect()
        }
        other => {
            return Err(bad(format!(
                "tensor {name} is {other:?}; initial weights are F32 or F64"
            )));
        }
    };
    if let Some(i) = values.iter().position(|x| !x.is_finite()) {
        return Err(bad(format!("{name}[{i}] is {}", values[i])));
    }
    Ok(match transposed {
        true => transpose(&values, stored[0], stored[1]),
        false => values,
    })
}

/// Tensors by name: (shape, values).
pub type StateDict = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// `params` (in `GptConfig::parameter_shapes` order and layout) as PyTorch's `state_dict` of
/// the anchor model: its names, [out, in] linear weights, `head.weight` a copy of
/// `tok.weight`; name-sorted, f32.
pub fn torch_state_dict(config: &GptConfig, params: &[Vec<f32>]) -> Result<StateDict> {
    let shapes = config.parameter_shapes();
    if params.len() != shapes.len() {
        return Err(Error::LengthMismatch {
            what: "parameter tensors",
            expected: shapes.len(),
            got: params.len(),
        });
    }
    let mut out = BTreeMap::new();
    for ((ours, shape), values) in shapes.iter().zip(params) {
        let (name, transposed) = torch_name(ours);
        let entry = match transposed {
            true => (
                vec![shape[1], shape[0]],
                transpose(values, shape[0], shape[1]),
            ),
            false => (shape.clone(), values.clone()),
        };
        out.insert(name, entry);
    }
    out.insert(TORCH_HEAD.into(), (shapes[0].1.clone(), params[0].clone()));
    Ok(out)
}

/// Writes `params` as `torch_state_dict` to a safetensors file (atomically), which
/// `model.load_state_dict(safetensors.torch.load_file(path))` loads into the anchor model.
pub fn write_torch_init(path: &Path, config: &GptConfig, params: &[Vec<f32>]) -> Result<()> {
    let state = torch_state_dict(config, params)?;
    let views = state
        .iter()
        .map(|(name, (shape, values))| {
            TensorView::new(Dtype::F32, shape.clone(), bytemuck::cast_slice(values))
                .map(|v| (name.clone(), v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::file(path, format!("cannot serialise: {e}")))?;
    let meta = HashMap::from([(
        "format".to_string(),
        "state_dict of scripts/anchors/torch_gpt.py (nanoGPT recipe)".to_string(),
    )]);
    let data = safetensors::serialize(views, Some(meta))
        .map_err(|e| Error::file(path, format!("cannot serialise: {e}")))?;
    crate::output::write_bytes(path, &data)
}

/// A built model's parameters by name from a safetensors file (`--init` for any model): its
/// tensors named as the model's parameters (`Param::name`; F32 or F64, each of its parameter's
/// shape, finite), or one of the model's checkpoints (`param.NAME`, ...: every check of a
/// resume made, the moments left aside). A file of another model is refused with the names
/// that differ; tensors beyond what such a file of the model holds are refused unread.
/// Returns them in declaration order.
pub fn read_params(path: &Path, model: &Model) -> Result<Vec<Vec<f32>>> {
    let file = SafetensorsFile::open(path, USABLE)?;
    let values: u64 = model.params().iter().map(|p| p.len() as u64).sum();
    // The most either holds: the parameters in f64, or a checkpoint's three tensors each in f32.
    if file.data_len > 12 * values {
        return Err(file.bad(format!(
            "its tensors take {} bytes, more than the model's parameters do ({})",
            file.data_len,
            12 * values
        )));
    }
    let bytes = file.read()?;
    let bad = |why: String| Error::file(path, format!("not {USABLE}: {why}"));
    let tensors =
        SafeTensors::deserialize(&bytes).map_err(|e| bad(format!("corrupt or truncated ({e})")))?;
    let names: BTreeSet<String> = tensors.names().into_iter().map(str::to_owned).collect();
    let expected = Expected::model(model);
    if names.iter().any(|n| n.starts_with(OURS)) {
        return Checkpoint::from_bytes(&bytes, path, &expected).map(|ck| ck.params);
    }
    let ours: BTreeSet<String> = model.params().iter().map(|p| p.name.clone()).collect();
    if let Some(differ) = names_that_differ(&names, &ours) {
        return Err(bad(format!(
            "its tensors are not the model's parameters: {differ}"
        )));
    }
    (model.params().iter())
        .map(|p| tensor_values(&tensors, &p.name, &p.shape, false, bad))
        .collect()
}

/// Writes `params` (a built model's, declaration order) to `path` as safetensors under the
/// parameters' names, f32 (what `read_params` reads), atomically.
pub fn write_params(path: &Path, model: &Model, params: &[Vec<f32>]) -> Result<()> {
    let declared = model.params();
    if params.len() != declared.len() {
        return Err(Error::LengthMismatch {
            what: "parameter tensors",
            expected: declared.len(),
            got: params.len(),
        });
    }
    let views = (declared.iter().zip(params))
        .map(|(p, values)| {
            TensorView::new(Dtype::F32, p.shape.clone(), bytemuck::cast_slice(values))
                .map(|v| (p.name.clone(), v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::file(path, format!("cannot serialise: {e}")))?;
    let data = safetensors::serialize(views, None)
        .map_err(|e| Error::file(path, format!("cannot serialise: {e}")))?;
    crate::output::write_bytes(path, &data)
}

/// A row-major rows x cols matrix transposed.
fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for i in 0..rows {
        for j in 0..cols {
            out[j * rows + i] = x[i * cols + j];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> GptConfig {
        GptConfig::named("tiny", 5).unwrap()
    }

    #[test]
    fn every_parameter_has_a_distinct_torch_name() {
        let names: BTreeSet<String> = config()
            .parameter_shapes()
            .iter()
            .map(|(n, _)| torch_name(n).0)
            .collect();
        assert_eq!(names.len(), config().parameter_shapes().len());
        assert!(names.contains("blocks.1.out.weight"));
        assert!(names.contains("blocks.0.ln2.bias"));
        assert_eq!(torch_name("h1.fc2.w"), ("blocks.1.out.weight".into(), true));
        assert_eq!(
            torch_name("h0.ln1.g"),
            ("blocks.0.ln1.weight".into(), false)
        );
    }

    /// Bytes of a safetensors file holding `tensors` as `dtype` (F32 or F64).
    fn file(tensors: &[(String, Vec<usize>, Vec<f32>)], dtype: Dtype) -> Vec<u8> {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, v)| match dtype {
                Dtype::F64 => v.iter().flat_map(|&x| (x as f64).to_le_bytes()).collect(),
                _ => bytemuck::cast_slice(v).to_vec(),
            })
            .collect();
        let views = tensors
            .iter()
            .zip(&bytes)
            .map(|((n, s, _), b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()));
        safetensors::serialize(views, None).unwrap()
    }

    /// PyTorch's names in f32 and f64, and the engine's checkpoint names with moments beside
    /// them, all read back as the weights written.
    #[test]
    fn both_namings_read_back_the_weights() {
        let cfg = config();
        let params = cfg.init(3).unwrap();
        let vocab = Vocab::Chars("abcde".chars().collect());
        let path = Path::new("init.safetensors");
        let torch: Vec<_> = torch_state_dict(&cfg, &params)
            .unwrap()
            .into_iter()
            .map(|(n, (s, v))| (n, s, v))
            .collect();
        for dtype in [Dtype::F32, Dtype::F64] {
            let read = init_from_bytes(&file(&torch, dtype), path, &cfg, &vocab).unwrap();
            assert!(read == params, "{dtype:?}");
        }
        let ours = checkpoint(&cfg, &params, &vocab, |_| {});
        let read = init_from_bytes(&ours, path, &cfg, &vocab).unwrap();
        assert!(read == params);
        // The engine's names beside PyTorch's: the PyTorch one is the extra.
        let mut mixed: Vec<_> = ["param", "adam_m", "adam_v"]
            .iter()
            .flat_map(|prefix| {
                let shapes = cfg.parameter_shapes();
                shapes
                    .into_iter()
                    .zip(params.clone())
                    .map(move |((n, s), v)| (format!("{prefix}.{n}"), s, v))
            })
            .collect();
        mixed.push(torch[0].clone());
        let err = init_from_bytes(&file(&mixed, Dtype::F32), path, &cfg, &vocab).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("tensor {} is not", torch[0].0)),
            "{err}"
        );
    }

    /// The bytes of a checkpoint of `cfg` holding `params` (moments zero) over `vocab`, its
    /// metadata changed by `edit` after its checksum is taken.
    fn checkpoint(
        cfg: &GptConfig,
        params: &[Vec<f32>],
        vocab: &Vocab,
        edit: impl FnOnce(&mut crate::train::checkpoint::CheckpointMeta),
    ) -> Vec<u8> {
        use crate::train::TrainState;
        use crate::train::checkpoint::{CheckpointMeta, Expected, GptMeta, checksum};
        let zeros: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        let state = TrainState {
            params: params.to_vec(),
            adam_m: zeros.clone(),
            adam_v: zeros,
        };
        let mut meta = CheckpointMeta {
            format: "mantissa-checkpoint-2".into(),
            gpt: Some(GptMeta::of(cfg, vocab)),
            preset: "32-true".into(),
            seed: 1,
            step: 1,
            applied: 1,
            loss_scale: None,
            growth_tracker: None,
            fp8: None,
            crc32: Some(checksum(&state.params, &state.adam_m, &state.adam_v)),
        };
        edit(&mut meta);
        Checkpoint::bytes(&meta, &Expected::gpt(cfg, vocab), &state).unwrap()
    }

    /// Initial weights under the engine's names are read as `--resume` reads a checkpoint:
    /// a flipped bit, metadata missing, unreadable or naming another shape of model, or another
    /// vocabulary, are refused by name (`--init` took them all, the CRC-32 unchecked).
    #[test]
    fn engine_names_are_checked_as_a_checkpoint_is() {
        let cfg = config();
        let params = cfg.init(3).unwrap();
        let vocab = Vocab::Chars("abcde".chars().collect());
        let path = Path::new("ck.safetensors");
        let refused = |bytes: &[u8], words: &str| {
            let e = init_from_bytes(bytes, path, &cfg, &vocab).unwrap_err();
            assert!(e.to_string().contains(words), "{words}: {e}");
            assert_eq!(e.class(), crate::error::ErrorClass::BadInput, "{e}");
        };
        let good = checkpoint(&cfg, &params, &vocab, |_| {});
        // One bit of param.wte's first value flipped (the data follows the header).
        let mut flipped = good.clone();
        let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
        let at = 8 + n + 4 * (params.iter().map(Vec::len).sum::<usize>());
        flipped[at.min(good.len() - 1)] ^= 1;
        refused(&flipped, "CRC-32");
        refused(
            &checkpoint(&cfg, &params, &vocab, |m| {
                m.gpt.as_mut().unwrap().n_layer = 6
            }),
            "config",
        );
        refused(
            &checkpoint(&cfg, &params, &vocab, |m| {
                m.gpt.as_mut().unwrap().vocab = "abcdf".into()
            }),
            "vocabulary",
        );
        refused(
            &checkpoint(&cfg, &params, &vocab, |m| m.crc32 = None),
            "checksum",
        );
        // No metadata at all: the tensors alone, under the engine's names.
        let bare: Vec<_> = ["param", "adam_m", "adam_v"]
            .iter()
            .flat_map(|prefix| {
                let shapes = cfg.parameter_shapes();
                shapes
                    .into_iter()
                    .zip(params.clone())
                    .map(move |((n, s), v)| (format!("{prefix}.{n}"), s, v))
            })
            .collect();
        refused(&file(&bare, Dtype::F32), "no mantissa metadata");
    }

    /// An f64 weight beyond f32's range is refused as the value it is (it was said to be inf).
    #[test]
    fn an_f64_weight_beyond_f32_is_named_as_it_is() {
        let cfg = config();
        let params = cfg.init(3).unwrap();
        let vocab = Vocab::Chars("abcde".chars().collect());
        let mut torch: Vec<_> = torch_state_dict(&cfg, &params)
            .unwrap()
            .into_iter()
            .map(|(n, (s, v))| (n, s, v))
            .collect();
        let bytes = |torch: &[(String, Vec<usize>, Vec<f32>)], big: f64| {
            // As `file` writes F64, with one value set beyond f32's range.
            let mut bytes = file(torch, Dtype::F64);
            let at = bytes.len() - 8;
            bytes[at..].copy_from_slice(&big.to_le_bytes());
            bytes
        };
        torch.sort_by(|a, b| a.0.cmp(&b.0));
        let e = init_from_bytes(&bytes(&torch, 1e300), Path::new("w"), &cfg, &vocab).unwrap_err();
        assert!(
            e.to_string().contains("is 1e300, beyond f32's range"),
            "{e}"
        );
    }

    #[test]
    fn transpose_swaps_rows_and_columns() {
        assert_eq!(
            transpose(&[1., 2., 3., 4., 5., 6.], 2, 3),
            [1., 4., 2., 5., 3., 6.]
        );
    }
}
