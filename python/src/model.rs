//! The model builder and its trainer for Python (`mantissa.ModelBuilder`,
//! `mantissa.ModelTrainer` wrap these): every op of `mantissa::model::ModelBuilder`, checked as
//! it is added, and a built model trained on a backend. Arrays cross as little-endian bytes in
//! the engine's layout; python/mantissa/_model.py checks shapes and dtypes, transposes
//! parameters declared in PyTorch's layout and turns bytes into numpy arrays.

use crate::{open, parse, py_err};
use mantissa::PrecisionClass;
use mantissa::backend::Backend;
use mantissa::model::{Init, ModelBuilder, ModelTrainer, RunOptions, Var};
use mantissa::plan::{AdamW, Unary};
use mantissa::policy::Preset;
use mantissa::policy::precision::PrecisionRequest;
use mantissa::train::checkpoint::{Checkpoint, Expected};
use mantissa::train::init;
use pollster::FutureExt as _;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

/// A value of a model being built: a parameter, an input or an op's output.
#[pyclass(name = "Var", module = "mantissa._native", frozen)]
#[derive(Clone)]
pub struct PyVar {
    var: Var,
    /// Its shape as the ops read it (`[]`: the scalar loss).
    #[pyo3(get)]
    shape: Vec<usize>,
}

#[pymethods]
impl PyVar {
    fn __repr__(&self) -> String {
        format!("Var(shape={:?})", self.shape)
    }
}

/// Records a model op by op (`mantissa::model::ModelBuilder`); a trainer takes it whole.
#[pyclass(name = "ModelBuilder", module = "mantissa._native")]
pub struct PyModelBuilder {
    inner: Option<ModelBuilder>,
}

impl PyModelBuilder {
    fn builder(&mut self) -> PyResult<&mut ModelBuilder> {
        self.inner.as_mut().ok_or_else(|| {
            PyValueError::new_err("this builder's model was handed to a trainer; build another")
        })
    }

    /// The value an op returned, with its shape; the op's error (naming it) as a ValueError.
    fn out(&mut self, made: mantissa::Result<Var>) -> PyResult<PyVar> {
        let var = made.map_err(py_err)?;
        let shape = self.builder()?.shape(var).map_err(py_err)?;
        Ok(PyVar { var, shape })
    }
}

#[pymethods]
impl PyModelBuilder {
    #[new]
    fn new() -> Self {
        PyModelBuilder {
            inner: Some(ModelBuilder::new()),
        }
    }

    /// Declares a parameter: `init` is "zeros", "ones" or "normal" (N(0, std^2)).
    #[pyo3(signature = (name, shape, init="normal", std=0.02, decay=true))]
    fn param(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        init: &str,
        std: f32,
        decay: bool,
    ) -> PyResult<PyVar> {
        let init = Init::named(init, std).map_err(py_err)?;
        let v = self.builder()?.param(name, &shape, init, decay);
        self.out(v)
    }

    fn tokens(&mut self, shape: Vec<usize>) -> PyResult<PyVar> {
        let v = self.builder()?.tokens(&shape);
        self.out(v)
    }

    fn targets(&mut self, shape: Vec<usize>) -> PyResult<PyVar> {
        let v = self.builder()?.targets(&shape);
        self.out(v)
    }

    fn values(&mut self, shape: Vec<usize>) -> PyResult<PyVar> {
        let v = self.builder()?.values(&shape);
        self.out(v)
    }

    fn constant_ids(&mut self, shape: Vec<usize>, ids: Vec<u32>) -> PyResult<PyVar> {
        let v = self.builder()?.constant_ids(&shape, ids);
        self.out(v)
    }

    fn embedding(&mut self, table: &PyVar, ids: &PyVar) -> PyResult<PyVar> {
        let v = self.builder()?.embedding(table.var, ids.var);
        self.out(v)
    }

    fn linear(&mut self, x: &PyVar, w: &PyVar, b: &PyVar) -> PyResult<PyVar> {
        let v = self.builder()?.linear(x.var, w.var, b.var);
        self.out(v)
    }

    #[pyo3(signature = (x, w, transpose_w=false))]
    fn matmul(&mut self, x: &PyVar, w: &PyVar, transpose_w: bool) -> PyResult<PyVar> {
        let v = self.builder()?.matmul(x.var, w.var, transpose_w);
        self.out(v)
    }

    fn layer_norm(&mut self, x: &PyVar, g: &PyVar, b: &PyVar) -> PyResult<PyVar> {
        let v = self.builder()?.layer_norm(x.var, g.var, b.var);
        self.out(v)
    }

    fn rms_norm(&mut self, x: &PyVar, g: &PyVar, eps: f32) -> PyResult<PyVar> {
        let v = self.builder()?.rms_norm(x.var, g.var, eps);
        self.out(v)
    }

    /// f(x) of every element for a function of the unary family, by name.
    fn unary(&mut self, f: &str, x: &PyVar) -> PyResult<PyVar> {
        let f: Unary = parse(f)?;
        let v = self.builder()?.unary(f, x.var);
        self.out(v)
    }

    fn add(&mut self, a: &PyVar, b: &PyVar) -> PyResult<PyVar> {
        let v = self.builder()?.add(a.var, b.var);
        self.out(v)
    }

    fn mul(&mut self, a: &PyVar, b: &PyVar) -> PyResult<PyVar> {
        let v = self.builder()?.mul(a.var, b.var);
        self.out(v)
    }

    fn bmm(&mut self, a: &PyVar, b: &PyVar, transpose_b: bool) -> PyResult<PyVar> {
        let v = self.builder()?.bmm(a.var, b.var, transpose_b);
        self.out(v)
    }

    fn transpose(&mut self, x: &PyVar) -> PyResult<PyVar> {
        let v = self.builder()?.transpose(x.var);
        self.out(v)
    }

    fn concat(&mut self, xs: Vec<PyRef<'_, PyVar>>) -> PyResult<PyVar> {
        let vars: Vec<Var> = xs.iter().map(|x| x.var).collect();
        let v = self.builder()?.concat(&vars);
        self.out(v)
    }

    fn narrow(&mut self, x: &PyVar, start: usize, length: usize) -> PyResult<PyVar> {
        let v = self.builder()?.narrow(x.var, start, length);
        self.out(v)
    }

    fn attention(&mut self, qkv: &PyVar, heads: usize) -> PyResult<PyVar> {
        let v = self.builder()?.attention(qkv.var, heads);
        self.out(v)
    }

    fn causal_attention(&mut self, qkv: &PyVar, heads: usize) -> PyResult<PyVar> {
        let v = self.builder()?.causal_attention(qkv.var, heads);
        self.out(v)
    }

    fn attention_masked(&mut self, qkv: &PyVar, heads: usize, key_mask: &PyVar) -> PyResult<PyVar> {
        let v = self
            .builder()?
            .attention_masked(qkv.var, heads, key_mask.var);
        self.out(v)
    }

    fn causal_attention_masked(
        &mut self,
        qkv: &PyVar,
        heads: usize,
        key_mask: &PyVar,
    ) -> PyResult<PyVar> {
        let v = (self.builder()?).causal_attention_masked(qkv.var, heads, key_mask.var);
        self.out(v)
    }

    fn attention_biased(&mut self, qkv: &PyVar, heads: usize, bias: &PyVar) -> PyResult<PyVar> {
        let v = self.builder()?.attention_biased(qkv.var, heads, bias.var);
        self.out(v)
    }

    fn causal_attention_biased(
        &mut self,
        qkv: &PyVar,
        heads: usize,
        bias: &PyVar,
    ) -> PyResult<PyVar> {
        let v = (self.builder()?).causal_attention_biased(qkv.var, heads, bias.var);
        self.out(v)
    }

    fn rotary(&mut self, x: &PyVar, heads: usize, base: f64) -> PyResult<PyVar> {
        let v = self.builder()?.rotary(x.var, heads, base);
        self.out(v)
    }

    fn dropout(&mut self, x: &PyVar, p: f64) -> PyResult<PyVar> {
        let v = self.builder()?.dropout(x.var, p);
        self.out(v)
    }

    fn sum(&mut self, x: &PyVar) -> PyResult<PyVar> {
        let v = self.builder()?.sum(x.var);
        self.out(v)
    }

    fn mean(&mut self, x: &PyVar) -> PyResult<PyVar> {
        let v = self.builder()?.mean(x.var);
        self.out(v)
    }

    fn scale(&mut self, x: &PyVar, k: f64) -> PyResult<PyVar> {
        let v = self.builder()?.scale(x.var, k);
        self.out(v)
    }

    fn sub(&mut self, a: &PyVar, b: &PyVar) -> PyResult<PyVar> {
        let v = self.builder()?.sub(a.var, b.var);
        self.out(v)
    }

    fn softmax(&mut self, x: &PyVar) -> PyResult<PyVar> {
        let v = self.builder()?.softmax(x.var);
        self.out(v)
    }

    fn causal_softmax(&mut self, x: &PyVar, scale: f64) -> PyResult<PyVar> {
        let v = self.builder()?.causal_softmax(x.var, scale);
        self.out(v)
    }

    fn reshape(&mut self, x: &PyVar, shape: Vec<usize>) -> PyResult<PyVar> {
        let v = self.builder()?.reshape(x.var, &shape);
        self.out(v)
    }

    fn cross_entropy(&mut self, logits: &PyVar, targets: &PyVar) -> PyResult<PyVar> {
        let v = self.builder()?.cross_entropy(logits.var, targets.var);
        self.out(v)
    }

    fn mse(&mut self, pred: &PyVar, target: &PyVar) -> PyResult<PyVar> {
        let v = self.builder()?.mse(pred.var, target.var);
        self.out(v)
    }
}

/// A built model trained on a backend under one precision preset.
#[pyclass(name = "ModelTrainer", module = "mantissa._native")]
pub struct PyModelTrainer {
    // Locked while the GIL is released: a second Python thread on the same trainer waits.
    t: Mutex<ModelTrainer<'static>>,
    device: &'static dyn Backend,
    preset: Preset,
}

impl PyModelTrainer {
    fn lock(&self) -> MutexGuard<'_, ModelTrainer<'static>> {
        self.t.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn u32s(bytes: &[u8], what: &str) -> PyResult<Vec<u32>> {
    if !bytes.len().is_multiple_of(4) {
        return Err(PyValueError::new_err(format!(
            "{what}: uint32 data must be a multiple of 4 bytes"
        )));
    }
    Ok(bytemuck::pod_collect_to_vec(bytes))
}

fn f32s(bytes: &[u8], what: &str) -> PyResult<Vec<f32>> {
    if !bytes.len().is_multiple_of(4) {
        return Err(PyValueError::new_err(format!(
            "{what}: float32 data must be a multiple of 4 bytes"
        )));
    }
    Ok(bytemuck::pod_collect_to_vec(bytes))
}

fn bytes<'py>(py: Python<'py>, v: &[f32]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, bytemuck::cast_slice(v))
}

#[pymethods]
impl PyModelTrainer {
    /// Finishes `builder`'s model at `loss` (the builder is used up) and opens it on `backend`
    /// under `preset`, its parameters drawn from `seed`. The settings are checked first.
    #[new]
    #[pyo3(signature = (builder, loss, preset="32-true", backend="auto", seed=0, lr=1e-3,
        betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, grad_clip=0.0,
        matmul_precision="highest", fused_attention=None, micro_batches=1))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        builder: &mut PyModelBuilder,
        loss: &PyVar,
        preset: &str,
        backend: &str,
        seed: u64,
        lr: f32,
        betas: (f32, f32),
        eps: f32,
        weight_decay: f32,
        grad_clip: f32,
        matmul_precision: &str,
        fused_attention: Option<bool>,
        micro_batches: usize,
    ) -> PyResult<Self> {
        let preset: Preset = parse(preset)?;
        let matmul_precision: PrecisionClass = parse(matmul_precision)?;
        let adamw = AdamW {
            lr,
            beta1: betas.0,
            beta2: betas.1,
            eps,
            weight_decay,
        };
        adamw.check().map_err(py_err)?;
        if !(grad_clip.is_finite() && grad_clip >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "grad_clip {grad_clip} is not finite and >= 0 (0 disables clipping)"
            )));
        }
        let model = builder
            .inner
            .take()
            .ok_or_else(|| {
                PyValueError::new_err("this builder's model was handed to a trainer already")
            })?
            .finish(loss.var)
            .map_err(py_err)?;
        let device = open(backend)?;
        let request = PrecisionRequest {
            preset,
            matmul_precision,
            algorithm: None,
            fp8_current: false,
            autocast_overrides: "",
        };
        let options = RunOptions {
            fused_attention,
            micro_batches,
            ..RunOptions::new(seed)
        };
        let mut t = py
            .detach(|| ModelTrainer::with_options(device, model, &request, options))
            .map_err(py_err)?;
        t.adamw = adamw;
        t.grad_clip = grad_clip;
        Ok(PyModelTrainer {
            t: Mutex::new(t),
            device,
            preset,
        })
    }

    /// (name, shape) of each parameter, in declaration order, as the ops read them.
    fn param_info(&self) -> Vec<(String, Vec<usize>)> {
        (self.lock().model.params().iter())
            .map(|p| (p.name.clone(), p.shape.clone()))
            .collect()
    }

    /// The shape of each values input, in declaration order.
    fn values_inputs(&self) -> Vec<Vec<usize>> {
        self.lock().model.values_inputs()
    }

    /// Whether the model reads token ids, class targets.
    fn reads(&self) -> (bool, bool) {
        let t = self.lock();
        (t.model.reads_tokens(), t.model.reads_targets())
    }

    #[getter]
    fn preset(&self) -> String {
        self.preset.to_string()
    }

    #[getter]
    fn backend(&self) -> String {
        self.device.name().to_string()
    }

    #[getter]
    fn matmul_algorithm(&self) -> String {
        self.lock().precision.matmul.to_string()
    }

    /// GradScaler's current loss scale (None where the preset does not scale its loss).
    #[getter]
    fn loss_scale(&self) -> Option<f32> {
        self.lock().scaler.map(|s| s.scale)
    }

    /// Optimizer steps applied so far.
    #[getter]
    fn applied(&self) -> u32 {
        self.lock().applied
    }

    /// Steps run so far, skipped ones included.
    #[getter]
    fn steps(&self) -> u32 {
        self.lock().steps
    }

    /// Whether dropout applies (training) or passes its input through (evaluation).
    #[getter]
    fn training(&self) -> bool {
        self.lock().training
    }

    #[setter]
    fn set_training(&self, on: bool) {
        self.lock().training = on;
    }

    /// Writes a checkpoint of the run (parameters, AdamW's moments, the step counts, the loss
    /// scale) to `path`, atomically.
    fn save_checkpoint(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        py.detach(|| Checkpoint::save(&mut self.lock(), None, &path).block_on())
            .map_err(py_err)
    }

    /// Resumes the run from a checkpoint of this model under this preset: the steps that
    /// follow are those of the run that wrote it. Another model's is refused with the names
    /// that differ.
    fn load_checkpoint(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        py.detach(|| {
            let mut t = self.lock();
            let ck = Checkpoint::load(&path, &Expected::model(&t.model))?;
            ck.restore(&mut t).block_on()
        })
        .map_err(py_err)
    }

    /// Writes the parameters to `path` as safetensors under their names (what `load_params`
    /// and PyTorch's `load_file` read).
    fn save_params(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        py.detach(|| {
            let mut t = self.lock();
            let params = t.params().block_on()?;
            init::write_params(&path, &t.model, &params)
        })
        .map_err(py_err)
    }

    /// Sets the parameters by name from a safetensors file (tensors named as the parameters,
    /// F32 or F64, or a checkpoint of this model); a file of another model is refused with the
    /// names that differ, and nothing is written.
    fn load_params(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        py.detach(|| {
            let mut t = self.lock();
            let params = init::read_params(&path, &t.model)?;
            t.set_params(&params).block_on()
        })
        .map_err(py_err)
    }

    fn set_values(&self, py: Python<'_>, k: usize, values: &[u8]) -> PyResult<()> {
        let values = f32s(values, "values")?;
        py.detach(|| self.lock().set_values(k, &values).block_on())
            .map_err(py_err)
    }

    /// One training step: (loss, skipped, grad_norm).
    fn step(&self, py: Python<'_>, ids: &[u8], targets: &[u8]) -> PyResult<(f64, bool, f64)> {
        let (ids, targets) = (u32s(ids, "tokens")?, u32s(targets, "targets")?);
        let s = py
            .detach(|| self.lock().step(&ids, &targets).block_on())
            .map_err(py_err)?;
        Ok((s.loss, s.skipped, s.grad_norm))
    }

    fn loss(&self, py: Python<'_>, ids: &[u8], targets: &[u8]) -> PyResult<f64> {
        let (ids, targets) = (u32s(ids, "tokens")?, u32s(targets, "targets")?);
        py.detach(|| self.lock().loss(&ids, &targets).block_on())
            .map_err(py_err)
    }

    fn gradients<'py>(
        &self,
        py: Python<'py>,
        ids: &[u8],
        targets: &[u8],
    ) -> PyResult<(f64, Vec<Bound<'py, PyBytes>>)> {
        let (ids, targets) = (u32s(ids, "tokens")?, u32s(targets, "targets")?);
        let (loss, grads) = py
            .detach(|| self.lock().gradients(&ids, &targets).block_on())
            .map_err(py_err)?;
        Ok((loss, grads.iter().map(|g| bytes(py, g)).collect()))
    }

    fn outputs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let out = py
            .detach(|| self.lock().outputs().block_on())
            .map_err(py_err)?;
        Ok(bytes(py, &out))
    }

    fn params<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let params = py
            .detach(|| self.lock().params().block_on())
            .map_err(py_err)?;
        Ok(params.iter().map(|p| bytes(py, p)).collect())
    }

    fn set_params(&self, py: Python<'_>, params: Vec<Vec<u8>>) -> PyResult<()> {
        let params = (params.iter())
            .map(|p| f32s(p, "parameters"))
            .collect::<PyResult<Vec<_>>>()?;
        py.detach(|| self.lock().set_params(&params).block_on())
            .map_err(py_err)
    }
}
