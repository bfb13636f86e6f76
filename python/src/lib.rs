//! `mantissa._native`: the engine for Python. Arrays cross as little-endian bytes and structured
//! results as JSON; `python/mantissa/__init__.py` turns them into numpy arrays and dicts, so this
//! layer stays thin and holds no numpy dependency. Every call that computes releases the GIL.

use mantissa::algorithm::{Algorithm, MatmulShape, Scaling};
use mantissa::backend::{self, Backend, BackendChoice, BackendKind};
use mantissa::cli::parse_list;
use mantissa::error::{Error, ErrorClass};
use mantissa::format::{self, Format, Overflow};
use mantissa::policy::Preset;
use mantissa::report::{self, ReportConfig};
use mantissa::train::{Batches, Chooser, Corpus, GptConfig, TrainOptions, Trainer, init};
use mantissa::{measure, memory, plan::AdamW};
use pollster::FutureExt as _;
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::collections::HashMap;
use std::sync::Mutex;

mod model;

pyo3::create_exception!(
    _native,
    BackendUnavailable,
    PyRuntimeError,
    "A backend this machine cannot open (no such device, driver or adapter): the message says why."
);

/// A backend this machine cannot open is BackendUnavailable (a RuntimeError); bad input is a
/// ValueError; memory that ran out (the host's or a device's) a MemoryError;
/// everything else (the machine, a wrong result, a diverged run) a RuntimeError, as
/// `Error::class` sorts them. The message is the tool's own one line.
pub(crate) fn py_err(e: Error) -> PyErr {
    if let Error::BackendUnavailable { .. } = e {
        return BackendUnavailable::new_err(e.to_string());
    }
    if e.is_out_of_memory() {
        return PyMemoryError::new_err(e.to_string());
    }
    match e.class() {
        ErrorClass::BadInput => PyValueError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

fn floats(bytes: &[u8]) -> PyResult<Vec<f32>> {
    if !bytes.len().is_multiple_of(4) {
        return Err(PyValueError::new_err(
            "float32 data must be a multiple of 4 bytes",
        ));
    }
    Ok(bytemuck::pod_collect_to_vec(bytes))
}

pub(crate) fn parse<T: std::str::FromStr<Err = Error>>(s: &str) -> PyResult<T> {
    s.parse().map_err(py_err)
}

/// Backends opened once per process and choice: opening a GPU costs far more than most calls.
/// Each lives as long as the process (a trainer borrows its backend for as long as it lives).
pub(crate) fn open(choice: &str) -> PyResult<&'static dyn Backend> {
    static OPEN: Mutex<Option<HashMap<String, &'static dyn Backend>>> = Mutex::new(None);
    let choice: BackendChoice = parse(choice)?;
    let key = format!("{choice:?}");
    let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
    let cache = open.get_or_insert_with(HashMap::new);
    if let Some(&b) = cache.get(&key) {
        return Ok(b);
    }
    let b: &'static dyn Backend = Box::leak(backend::open(choice).block_on().map_err(py_err)?);
    cache.insert(key, b);
    Ok(b)
}

/// The backends compiled in, the reference, CUDA (or why not), every wgpu adapter, and the
/// backend `auto` picks, as JSON.
#[pyfunction]
fn devices_json(py: Python<'_>) -> PyResult<String> {
    py.detach(|| {
        let adapters = backend::wgpu::list_adapters().block_on();
        let cuda = match backend::open(BackendChoice::Only(BackendKind::Cuda)).block_on() {
            Ok(b) => {
                serde_json::json!({"present": true, "name": b.name(), "device": b.device_name()})
            }
            Err(e) => serde_json::json!({"present": false, "reason": e.to_string()}),
        };
        let auto = match open("auto") {
            Ok(b) => serde_json::json!(b.name()),
            Err(e) => serde_json::json!(format!("none: {e}")),
        };
        let wgpu_reason = adapters
            .is_empty()
            .then(|| backend::wgpu::no_adapter_reason().block_on());
        let json = serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "reference": {"name": "reference", "device": backend::Reference.device_name()},
            "cuda": cuda,
            "wgpu": adapters,
            "wgpu_reason": wgpu_reason,
            "auto": auto,
        });
        Ok(json.to_string())
    })
}

/// torch.finfo's fields of a format, as JSON.
#[pyfunction]
fn finfo_json(name: &str) -> PyResult<String> {
    let f: Format = parse(name)?;
    let mut v =
        serde_json::to_value(f.finfo()).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    v["name"] = f.name().into();
    v["storage_bytes"] = f.storage_bytes().into();
    Ok(v.to_string())
}

/// Converts raw codes between formats (`format::convert_raw`, as `mantissa cast --raw`).
fn convert(
    py: Python<'_>,
    data: &[u8],
    from: Format,
    to: Format,
    overflow: Overflow,
) -> PyResult<Vec<u8>> {
    py.detach(|| {
        let mut out = Vec::with_capacity(data.len() / from.storage_bytes() * to.storage_bytes());
        format::convert_raw(&mut &data[..], &mut out, from, to, overflow).map_err(py_err)?;
        Ok(out)
    })
}

/// Encodes float32 values (bytes) into `fmt`: the codes, little-endian, in the format's storage
/// width.
#[pyfunction]
fn encode<'py>(
    py: Python<'py>,
    data: Vec<u8>,
    fmt: &str,
    saturate: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let overflow = if saturate {
        Overflow::Saturate
    } else {
        Overflow::Standard
    };
    let out = convert(py, &data, Format::F32, parse(fmt)?, overflow)?;
    Ok(PyBytes::new(py, &out))
}

/// Decodes codes of `fmt` (little-endian, storage width) to float32 bytes.
#[pyfunction]
fn decode<'py>(py: Python<'py>, codes: Vec<u8>, fmt: &str) -> PyResult<Bound<'py, PyBytes>> {
    let out = convert(py, &codes, parse(fmt)?, Format::F32, Overflow::Standard)?;
    Ok(PyBytes::new(py, &out))
}

/// The bf16 split x = h + m + l: three planes of bf16 codes (u16, little-endian).
#[pyfunction]
fn split<'py>(py: Python<'py>, data: Vec<u8>) -> PyResult<[Bound<'py, PyBytes>; 3]> {
    let x = floats(&data)?;
    let planes = py.detach(|| {
        let mut planes = [vec![], vec![], vec![]];
        for v in x {
            for (plane, part) in planes.iter_mut().zip(format::split_bf16(v)) {
                plane.extend_from_slice(
                    &(Format::Bf16.encode(part, Overflow::Standard) as u16).to_le_bytes(),
                );
            }
        }
        planes
    });
    Ok(planes.map(|p| PyBytes::new(py, &p)))
}

/// (amax, scale) per tensor (`tensorwise`: one of each) or per row of a rows x cols matrix
/// (`rowwise`), the scale mapping amax onto the format's largest finite value.
#[pyfunction]
fn amax_scale(
    data: Vec<u8>,
    rows: usize,
    cols: usize,
    fmt: &str,
    mode: &str,
) -> PyResult<(Vec<f32>, Vec<f32>)> {
    let f: Format = parse(fmt)?;
    let x = floats(&data)?;
    if rows.checked_mul(cols) != Some(x.len()) {
        return Err(PyValueError::new_err(format!(
            "{} values are not {rows}x{cols}",
            x.len()
        )));
    }
    let amaxes: Vec<f32> = match mode {
        "tensorwise" => vec![format::amax(x.iter().copied())],
        "rowwise" => x
            .chunks(cols.max(1))
            .map(|r| format::amax(r.iter().copied()))
            .collect(),
        other => {
            return Err(py_err(Error::UnknownName {
                kind: "scaling mode",
                given: other.into(),
                valid: vec!["tensorwise".into(), "rowwise".into()],
            }));
        }
    };
    let scales = amaxes
        .iter()
        .map(|&a| format::scale_for_amax(a, f))
        .collect();
    Ok((amaxes, scales))
}

/// C[b] = A[b] . B[b] (float32 bytes, row-major) under `algorithm` on `backend`. With `check`,
/// also the reference's result of the same algorithm and the contract's verdict: None where it
/// holds, else the break in words (elements outside their tolerance, the first few described,
/// and the whole product against its band).
#[pyfunction]
#[pyo3(signature = (a, b, batch, m, k, n, algorithm, backend, scales=None, check=false))]
#[allow(clippy::too_many_arguments)]
fn matmul<'py>(
    py: Python<'py>,
    a: &[u8],
    b: &[u8],
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    algorithm: &str,
    backend: &str,
    scales: Option<(f32, f32)>,
    check: bool,
) -> PyResult<(Bound<'py, PyBytes>, Option<String>)> {
    let mut alg: Algorithm = parse(algorithm)?;
    if let Some((sa, sb)) = scales {
        if !matches!(alg, Algorithm::Fp8 { .. }) {
            return Err(PyValueError::new_err(format!(
                "scales go with fp8 algorithms, not {alg}"
            )));
        }
        if !(sa.is_finite() && sa > 0.0 && sb.is_finite() && sb > 0.0) {
            return Err(PyValueError::new_err(format!(
                "scales ({sa}, {sb}) must be finite and positive"
            )));
        }
        alg = alg.with_scaling(Scaling::Given { a: sa, b: sb });
    }
    let shape = MatmulShape {
        batch,
        ..MatmulShape::new(m, n, k)
    };
    // The shapes before any copy of the operands.
    let values = |bytes: &[u8]| bytes.len() / 4;
    if !(a.len().is_multiple_of(4) && b.len().is_multiple_of(4)) {
        return Err(PyValueError::new_err(
            "float32 data must be a multiple of 4 bytes",
        ));
    }
    if shape.check(values(a), values(b)).is_err() {
        return Err(PyValueError::new_err(format!(
            "operands of {} and {} values do not make a {batch} x ({m}x{k} . {k}x{n}) product",
            values(a),
            values(b)
        )));
    }
    // C comes back in host memory, and the check holds three f64 magnitudes per element of it.
    let c_len = shape.checked_c_len().map_err(py_err)?;
    let per_element = if check { 4 + 4 + 3 * 8 } else { 4 };
    memory::check(
        "C",
        memory::bytes_of::<u8>(c_len).and_then(|b| b.checked_mul(per_element)),
    )
    .map_err(py_err)?;
    let (a, b) = (floats(a)?, floats(b)?);
    let device = open(backend)?;
    let (c, broken) = py.detach(|| -> PyResult<_> {
        let c = device
            .matmul(&shape, &alg, &a, &b)
            .block_on()
            .map_err(py_err)?;
        if !check {
            return Ok((c, None));
        }
        let want = backend::reference::matmul(&shape, &alg, &a, &b).map_err(py_err)?;
        let check = measure::check_product(&alg, &shape, (&a, &b), &c, &want).map_err(py_err)?;
        let broken = check.verdict(&alg).err().map(|e| {
            let mut lines = vec![e.to_string()];
            lines.extend(check.mismatches.iter().map(|m| m.to_string()));
            lines.join("; ")
        });
        Ok((c, broken))
    })?;
    Ok((PyBytes::new(py, bytemuck::cast_slice(&c)), broken))
}

/// The portability report on `backends` ("all" or a comma list) at `sizes` (m, n, k), as JSON.
#[pyfunction]
#[pyo3(signature = (backends, sizes, train_steps=0, seed=1, repetitions=3, corpus=None))]
fn report_json(
    py: Python<'_>,
    backends: &str,
    sizes: Vec<(usize, usize, usize)>,
    train_steps: u32,
    seed: u64,
    repetitions: usize,
    corpus: Option<String>,
) -> PyResult<String> {
    // "all" skips the kinds absent here; a kind named is required (`ReportConfig::skip_absent`).
    let skip_absent = backends.trim() == "all";
    let kinds: Vec<BackendKind> = if skip_absent {
        BackendKind::ALL.to_vec()
    } else {
        parse_list("backends", backends).map_err(py_err)?
    };
    if sizes.is_empty() {
        return Err(PyValueError::new_err("sizes names no size"));
    }
    for (i, &(m, n, k)) in sizes.iter().enumerate() {
        MatmulShape::check_requested(m, n, k)
            .map_err(|why| PyValueError::new_err(format!("sizes ({m}, {n}, {k}): {why}")))?;
        if sizes[..i].contains(&(m, n, k)) {
            return Err(PyValueError::new_err(format!(
                "sizes names ({m}, {n}, {k}) twice"
            )));
        }
    }
    if train_steps > 0 && corpus.is_none() {
        return Err(PyValueError::new_err(
            "train_steps needs a corpus (a path to a text file)",
        ));
    }
    let config = ReportConfig {
        kinds,
        skip_absent,
        shapes: sizes,
        algorithms: ReportConfig::default_algorithms(),
        families: report::Family::ALL.to_vec(),
        seed,
        repetitions: repetitions.clamp(1, 10_000),
        train_steps,
        train_presets: Preset::ALL.to_vec(),
        corpus: corpus.unwrap_or_default().into(),
    };
    py.detach(|| {
        let report = report::run(&config, |_| {}).block_on().map_err(py_err)?;
        serde_json::to_string(&report).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    })
}

/// Trains the char-level GPT on `corpus` under each preset for `steps` steps, from the seeded
/// weights or those in `init`, on sampled batches or those in `batches` (as `mantissa train
/// --init --batches`); per preset the per-step losses (as `mantissa train` logs them), the loss
/// scale after each step and the skipped steps (presets that scale their loss), why it
/// stopped, if it did, and how attention was chosen (`Trainer::choose`), as JSON.
#[pyfunction]
#[pyo3(signature = (corpus, config, precision, steps, backend, seed=1337, lr=1e-3, adam_eps=1e-8, init=None, batches=None, grad_accum=1))]
#[allow(clippy::too_many_arguments)]
fn train_json(
    py: Python<'_>,
    corpus: &str,
    config: &str,
    precision: Vec<String>,
    steps: u32,
    backend: &str,
    seed: u64,
    lr: f32,
    adam_eps: f32,
    init: Option<&str>,
    batches: Option<&str>,
    grad_accum: usize,
) -> PyResult<String> {
    if !(lr.is_finite() && lr > 0.0) {
        return Err(PyValueError::new_err(format!(
            "lr {lr} is not a finite positive learning rate"
        )));
    }
    if !(adam_eps.is_finite() && adam_eps > 0.0) {
        return Err(PyValueError::new_err(format!(
            "adam_eps {adam_eps} is not a finite positive epsilon"
        )));
    }
    let presets: Vec<Preset> = parse_list("precision", &precision.join(",")).map_err(py_err)?;
    let tokenizer = GptConfig::tokenizer(config);
    let corpus = Corpus::load_as(std::path::Path::new(corpus), tokenizer).map_err(py_err)?;
    let config = GptConfig::named(config, corpus.vocab.len()).map_err(py_err)?;
    corpus.check_context(config.block_size).map_err(py_err)?;
    let weights = init
        .map(|path| init::read_init(path.as_ref(), &config, &corpus.vocab))
        .transpose()
        .map_err(py_err)?;
    let (b, t, v) = (config.batch_size, config.block_size, corpus.vocab.len());
    let batches = batches
        .map(|path| Batches::load(path.as_ref(), b, t, v, steps))
        .transpose()
        .map_err(py_err)?;
    let device = open(backend)?;
    py.detach(|| {
        let mut runs = serde_json::Map::new();
        let chooser = Chooser::from_env().map_err(py_err)?;
        for preset in presets {
            let options = TrainOptions {
                adamw: AdamW {
                    lr,
                    eps: adam_eps,
                    ..AdamW::default()
                },
                grad_accum,
                ..TrainOptions::new(config.clone(), preset, seed)
            };
            let mut trainer = Trainer::new(device, &corpus, options).map_err(py_err)?;
            if let Some(w) = &weights {
                trainer.set_weights(w).block_on().map_err(py_err)?;
            }
            if let Some(b) = &batches {
                trainer.use_batches(b.clone()).map_err(py_err)?;
            }
            trainer.choose(&chooser).block_on().map_err(py_err)?;
            let (mut losses, mut scales, mut skipped) = (vec![], vec![], vec![]);
            let mut stopped = None;
            // Drawn only where standard error is a terminal.
            let bar = indicatif::ProgressBar::new(steps as u64).with_message(preset.to_string());
            while trainer.run.steps < steps {
                match trainer.step().block_on() {
                    Ok(r) => {
                        bar.set_position(r.step as u64);
                        losses.push(r.loss);
                        scales.extend(r.loss_scale);
                        if r.skipped {
                            skipped.push(r.step);
                        }
                    }
                    Err(e @ Error::Diverged { .. }) => {
                        stopped = Some(e.to_string());
                        break;
                    }
                    Err(e) => return Err(py_err(e)),
                }
            }
            bar.finish_and_clear();
            runs.insert(
                preset.to_string(),
                serde_json::json!({
                    "losses": losses,
                    "loss_scales": trainer.run.scaler.map(|_| scales),
                    "skipped": skipped,
                    "stopped": stopped,
                    "backend": device.name(),
                    "matmul_algorithm": trainer.run.precision.matmul.to_string(),
                    "attention": trainer.run.attention,
                    "graphs": trainer.run.graphs,
                }),
            );
        }
        Ok(serde_json::Value::Object(runs).to_string())
    })
}

/// Writes the initial weights of `config` seeded by `seed` (or read from `init`) to `path`
/// under the PyTorch anchor's state_dict names and layouts (`mantissa train --export-init`).
#[pyfunction]
#[pyo3(signature = (path, corpus, config, seed=1337, init=None))]
fn export_init(
    path: &str,
    corpus: &str,
    config: &str,
    seed: u64,
    init: Option<&str>,
) -> PyResult<()> {
    let tokenizer = GptConfig::tokenizer(config);
    let corpus = Corpus::load_as(std::path::Path::new(corpus), tokenizer).map_err(py_err)?;
    let config = GptConfig::named(config, corpus.vocab.len()).map_err(py_err)?;
    let params = match init {
        Some(from) => init::read_init(from.as_ref(), &config, &corpus.vocab).map_err(py_err)?,
        None => config.init(seed).map_err(py_err)?,
    };
    init::write_torch_init(path.as_ref(), &config, &params).map_err(py_err)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(devices_json, m)?)?;
    m.add_function(wrap_pyfunction!(finfo_json, m)?)?;
    m.add_function(wrap_pyfunction!(encode, m)?)?;
    m.add_function(wrap_pyfunction!(decode, m)?)?;
    m.add_function(wrap_pyfunction!(split, m)?)?;
    m.add_function(wrap_pyfunction!(amax_scale, m)?)?;
    m.add_function(wrap_pyfunction!(matmul, m)?)?;
    m.add_function(wrap_pyfunction!(report_json, m)?)?;
    m.add_function(wrap_pyfunction!(train_json, m)?)?;
    m.add_function(wrap_pyfunction!(export_init, m)?)?;
    m.add(
        "BackendUnavailable",
        m.py().get_type::<BackendUnavailable>(),
    )?;
    m.add_class::<model::PyVar>()?;
    m.add_class::<model::PyModelBuilder>()?;
    m.add_class::<model::PyModelTrainer>()?;
    Ok(())
}
