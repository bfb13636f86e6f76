//! The model builder in JavaScript: `new ModelBuilder()`, its ops checked as they are added
//! (`mantissa::model::ModelBuilder`; an error names the op), and a built model trained on the
//! page's WebGPU adapter or on the host reference compiled to wasm (`Engine.model_trainer`).
//!
//! A value of the model is a frozen plain object `{builder, id, shape}`: it can be passed to any
//! number of ops and kept as long as the page likes (an exported Rust object would be consumed
//! when passed in a list, as `concat` takes them); `builder` tells one builder's values from
//! another's.

use crate::{claim, js_error, to_json};
use js_sys::{Array, Float32Array, Object, Promise, Reflect};
use mantissa::backend::Backend;
use mantissa::model::{self, Init, ModelTrainer, Var};
use mantissa::plan::Unary;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU32, Ordering};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

/// Records a model op by op; `Engine.model_trainer` takes it whole.
#[wasm_bindgen]
pub struct ModelBuilder {
    inner: Option<model::ModelBuilder>,
    /// This builder's number, unique on the page: its values carry it.
    serial: u32,
    /// The builder's values, by the `id` their JavaScript objects carry.
    vars: Vec<Var>,
}

impl ModelBuilder {
    fn builder(&mut self) -> Result<&mut model::ModelBuilder, JsValue> {
        self.inner
            .as_mut()
            .ok_or_else(|| js_error("this builder's model was handed to a trainer; build another"))
    }

    /// The builder's value that `v` (an `{id, shape}` object this builder returned) names.
    fn var(&self, op: &str, v: &JsValue) -> Result<Var, JsValue> {
        let number = |key: &str| {
            Reflect::get(v, &key.into())
                .ok()
                .and_then(|n| n.as_f64())
                .filter(|n| n.fract() == 0.0 && *n >= 0.0)
        };
        let id = number("id").filter(|_| number("builder") == Some(self.serial as f64));
        id.and_then(|id| self.vars.get(id as usize).copied())
            .ok_or_else(|| js_error(format!("{op}: not a value of this builder")))
    }

    /// The value an op returned, as a frozen `{id, shape}`; the op's error (naming it) thrown.
    fn out(&mut self, made: mantissa::Result<Var>) -> Result<JsValue, JsValue> {
        let var = made.map_err(js_error)?;
        let shape = self.builder()?.shape(var).map_err(js_error)?;
        let object = Object::new();
        let shape: Array = shape.iter().map(|&d| JsValue::from(d as f64)).collect();
        Reflect::set(&object, &"builder".into(), &self.serial.into())?;
        Reflect::set(&object, &"id".into(), &(self.vars.len() as f64).into())?;
        Reflect::set(&object, &"shape".into(), &Object::freeze(&shape))?;
        self.vars.push(var);
        Ok(Object::freeze(&object).into())
    }

    fn unary_of(&mut self, f: Unary, x: &JsValue) -> Result<JsValue, JsValue> {
        let x = self.var(&f.to_string(), x)?;
        let v = self.builder()?.unary(f, x);
        self.out(v)
    }

    fn pair(
        &mut self,
        op: &str,
        a: &JsValue,
        b: &JsValue,
        f: impl FnOnce(&mut model::ModelBuilder, Var, Var) -> mantissa::Result<Var>,
    ) -> Result<JsValue, JsValue> {
        let (a, b) = (self.var(op, a)?, self.var(op, b)?);
        let v = f(self.builder()?, a, b);
        self.out(v)
    }

    fn one(
        &mut self,
        op: &str,
        x: &JsValue,
        f: impl FnOnce(&mut model::ModelBuilder, Var) -> mantissa::Result<Var>,
    ) -> Result<JsValue, JsValue> {
        let x = self.var(op, x)?;
        let v = f(self.builder()?, x);
        self.out(v)
    }

    /// The finished model and its loss, for a trainer; the builder is used up.
    pub(crate) fn finish(&mut self, loss: &JsValue) -> Result<model::Model, JsValue> {
        let loss = self.var("finish", loss)?;
        let builder = self.inner.take().ok_or_else(|| {
            js_error("this builder's model was handed to a trainer already; build another")
        })?;
        builder.finish(loss).map_err(js_error)
    }
}

#[wasm_bindgen]
impl ModelBuilder {
    #[wasm_bindgen(constructor)]
    pub fn new() -> ModelBuilder {
        static BUILDERS: AtomicU32 = AtomicU32::new(0);
        ModelBuilder {
            inner: Some(model::ModelBuilder::new()),
            serial: BUILDERS.fetch_add(1, Ordering::Relaxed),
            vars: vec![],
        }
    }

    /// Declares a parameter: `init` is "zeros", "ones" or "normal" (N(0, std^2)); `decay`:
    /// whether AdamW's weight decay applies to it.
    pub fn param(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        init: &str,
        std: f32,
        decay: bool,
    ) -> Result<JsValue, JsValue> {
        let init = Init::named(init, std).map_err(js_error)?;
        let v = self.builder()?.param(name, &shape, init, decay);
        self.out(v)
    }

    /// Token ids each step is given (`Uint32Array`).
    pub fn tokens(&mut self, shape: Vec<usize>) -> Result<JsValue, JsValue> {
        let v = self.builder()?.tokens(&shape);
        self.out(v)
    }

    /// Class targets each step is given (`Uint32Array`).
    pub fn targets(&mut self, shape: Vec<usize>) -> Result<JsValue, JsValue> {
        let v = self.builder()?.targets(&shape);
        self.out(v)
    }

    /// f32 values written before the steps that read them (`set_values`).
    pub fn values(&mut self, shape: Vec<usize>) -> Result<JsValue, JsValue> {
        let v = self.builder()?.values(&shape);
        self.out(v)
    }

    pub fn constant_ids(&mut self, shape: Vec<usize>, ids: Vec<u32>) -> Result<JsValue, JsValue> {
        let v = self.builder()?.constant_ids(&shape, ids);
        self.out(v)
    }

    pub fn embedding(&mut self, table: &JsValue, ids: &JsValue) -> Result<JsValue, JsValue> {
        self.pair("embedding", table, ids, |b, t, i| b.embedding(t, i))
    }

    /// x . w + b, w of shape [in, out].
    pub fn linear(&mut self, x: &JsValue, w: &JsValue, b: &JsValue) -> Result<JsValue, JsValue> {
        let bias = self.var("linear", b)?;
        self.pair("linear", x, w, |m, x, w| m.linear(x, w, bias))
    }

    pub fn matmul(
        &mut self,
        x: &JsValue,
        w: &JsValue,
        transpose_w: bool,
    ) -> Result<JsValue, JsValue> {
        self.pair("matmul", x, w, |b, x, w| b.matmul(x, w, transpose_w))
    }

    pub fn bmm(&mut self, a: &JsValue, b: &JsValue, transpose_b: bool) -> Result<JsValue, JsValue> {
        self.pair("bmm", a, b, |m, a, b| m.bmm(a, b, transpose_b))
    }

    pub fn transpose(&mut self, x: &JsValue) -> Result<JsValue, JsValue> {
        self.one("transpose", x, |b, x| b.transpose(x))
    }

    /// The values side by side along the last axis; `xs` is an array of values.
    pub fn concat(&mut self, xs: Array) -> Result<JsValue, JsValue> {
        let vars = (xs.iter())
            .map(|x| self.var("concat", &x))
            .collect::<Result<Vec<Var>, JsValue>>()?;
        let v = self.builder()?.concat(&vars);
        self.out(v)
    }

    /// Columns [start, start + length) of x's last axis.
    pub fn narrow(&mut self, x: &JsValue, start: usize, length: usize) -> Result<JsValue, JsValue> {
        self.one("narrow", x, |b, x| b.narrow(x, start, length))
    }

    /// x cut along its last axis into parts `widths` wide, in order: an array of values.
    pub fn split(&mut self, x: &JsValue, widths: Vec<usize>) -> Result<Array, JsValue> {
        let x = self.var("split", x)?;
        let parts = self.builder()?.split(x, &widths).map_err(js_error)?;
        parts.into_iter().map(|v| self.out(Ok(v))).collect()
    }

    pub fn layer_norm(
        &mut self,
        x: &JsValue,
        g: &JsValue,
        b: &JsValue,
    ) -> Result<JsValue, JsValue> {
        let bias = self.var("layer_norm", b)?;
        self.pair("layer_norm", x, g, |m, x, g| m.layer_norm(x, g, bias))
    }

    pub fn rms_norm(&mut self, x: &JsValue, g: &JsValue, eps: f32) -> Result<JsValue, JsValue> {
        self.pair("rms_norm", x, g, |b, x, g| b.rms_norm(x, g, eps))
    }

    /// f(x) of every element for a function of the unary family, by name ("gelu", "silu",
    /// "relu", "sigmoid", "tanh").
    pub fn unary(&mut self, f: &str, x: &JsValue) -> Result<JsValue, JsValue> {
        let f: Unary = f.parse().map_err(js_error)?;
        self.unary_of(f, x)
    }

    pub fn gelu(&mut self, x: &JsValue) -> Result<JsValue, JsValue> {
        self.unary_of(Unary::Gelu, x)
    }

    pub fn silu(&mut self, x: &JsValue) -> Result<JsValue, JsValue> {
        self.unary_of(Unary::Silu, x)
    }

    pub fn relu(&mut self, x: &JsValue) -> Result<JsValue, JsValue> {
        self.unary_of(Unary::Relu, x)
    }

    pub fn sigmoid(&mut self, x: &JsValue) -> Result<JsValue, JsValue> {
        self.unary_of(Unary::Sigmoid, x)
    }

    pub fn tanh(&mut self, x: &JsValue) -> Result<JsValue, JsValue> {
        self.unary_of(Unary::Tanh, x)
    }

    pub fn add(&mut self, a: &JsValue, b: &JsValue) -> Result<JsValue, JsValue> {
        self.pair("add", a, b, |m, a, b| m.add(a, b))
    }

    pub fn sub(&mut self, a: &JsValue, b: &JsValue) -> Result<JsValue, JsValue> {
        self.pair("sub", a, b, |m, a, b| m.sub(a, b))
    }

    pub fn mul(&mut self, a: &JsValue, b: &JsValue) -> Result<JsValue, JsValue> {
        self.pair("mul", a, b, |m, a, b| m.mul(a, b))
    }

    pub fn scale(&mut self, x: &JsValue, k: f64) -> Result<JsValue, JsValue> {
        self.one("scale", x, |b, x| b.scale(x, k))
    }

    pub fn attention(&mut self, qkv: &JsValue, heads: usize) -> Result<JsValue, JsValue> {
        self.one("attention", qkv, |b, x| b.attention(x, heads))
    }

    pub fn causal_attention(&mut self, qkv: &JsValue, heads: usize) -> Result<JsValue, JsValue> {
        self.one("causal_attention", qkv, |b, x| b.causal_attention(x, heads))
    }

    /// `attention` leaving out the keys `key_mask` (a values input [batch, tokens], nonzero
    /// where the key is padding) masks.
    pub fn attention_masked(
        &mut self,
        qkv: &JsValue,
        heads: usize,
        key_mask: &JsValue,
    ) -> Result<JsValue, JsValue> {
        self.pair("attention_masked", qkv, key_mask, |b, x, m| {
            b.attention_masked(x, heads, m)
        })
    }

    /// `causal_attention` leaving out the keys `key_mask` masks.
    pub fn causal_attention_masked(
        &mut self,
        qkv: &JsValue,
        heads: usize,
        key_mask: &JsValue,
    ) -> Result<JsValue, JsValue> {
        self.pair("causal_attention_masked", qkv, key_mask, |b, x, m| {
            b.causal_attention_masked(x, heads, m)
        })
    }

    /// `attention` with `bias` ([tokens, tokens], [heads, tokens, tokens], [batch, tokens,
    /// tokens] or [batch, heads, tokens, tokens]: a values input, or a parameter or an op's
    /// output, which is learned) added to the scaled scores.
    pub fn attention_biased(
        &mut self,
        qkv: &JsValue,
        heads: usize,
        bias: &JsValue,
    ) -> Result<JsValue, JsValue> {
        self.pair("attention_biased", qkv, bias, |b, x, m| {
            b.attention_biased(x, heads, m)
        })
    }

    /// `causal_attention` with `bias` added to the scaled scores it sees.
    pub fn causal_attention_biased(
        &mut self,
        qkv: &JsValue,
        heads: usize,
        bias: &JsValue,
    ) -> Result<JsValue, JsValue> {
        self.pair("causal_attention_biased", qkv, bias, |b, x, m| {
            b.causal_attention_biased(x, heads, m)
        })
    }

    /// Rotary position embeddings of x [batch, tokens, heads x d] at `base` (10000 in most
    /// models).
    pub fn rotary(&mut self, x: &JsValue, heads: usize, base: f64) -> Result<JsValue, JsValue> {
        self.one("rotary", x, |b, x| b.rotary(x, heads, base))
    }

    pub fn dropout(&mut self, x: &JsValue, p: f64) -> Result<JsValue, JsValue> {
        self.one("dropout", x, |b, x| b.dropout(x, p))
    }

    pub fn sum(&mut self, x: &JsValue) -> Result<JsValue, JsValue> {
        self.one("sum", x, |b, x| b.sum(x))
    }

    pub fn mean(&mut self, x: &JsValue) -> Result<JsValue, JsValue> {
        self.one("mean", x, |b, x| b.mean(x))
    }

    pub fn softmax(&mut self, x: &JsValue) -> Result<JsValue, JsValue> {
        self.one("softmax", x, |b, x| b.softmax(x))
    }

    pub fn causal_softmax(&mut self, x: &JsValue, scale: f64) -> Result<JsValue, JsValue> {
        self.one("causal_softmax", x, |b, x| b.causal_softmax(x, scale))
    }

    pub fn reshape(&mut self, x: &JsValue, shape: Vec<usize>) -> Result<JsValue, JsValue> {
        self.one("reshape", x, |b, x| b.reshape(x, &shape))
    }

    /// The mean cross entropy of `logits` against class `targets`: a loss.
    pub fn cross_entropy(
        &mut self,
        logits: &JsValue,
        targets: &JsValue,
    ) -> Result<JsValue, JsValue> {
        self.pair("cross_entropy", logits, targets, |b, l, t| {
            b.cross_entropy(l, t)
        })
    }

    /// The mean squared error of `pred` against `target` (a values input): a loss.
    pub fn mse(&mut self, pred: &JsValue, target: &JsValue) -> Result<JsValue, JsValue> {
        self.pair("mse", pred, target, |b, p, t| b.mse(p, t))
    }
}

impl Default for ModelBuilder {
    fn default() -> Self {
        Self::new()
    }
}

/// A built model trained on one backend under one preset. Its methods return Promises; one at
/// a time (a second call while one runs is an error, not a queue).
#[wasm_bindgen]
pub struct ModelRun {
    run: Rc<RefCell<ModelTrainer<'static>>>,
}

impl ModelRun {
    pub(crate) fn new(trainer: ModelTrainer<'static>) -> ModelRun {
        ModelRun {
            run: Rc::new(RefCell::new(trainer)),
        }
    }
}

#[wasm_bindgen]
impl ModelRun {
    /// Backend, preset, matmul algorithm, parameters and plan size (JSON).
    pub fn info(&self) -> Result<JsValue, JsValue> {
        let t = claim(&self.run)?;
        let params = t.model.params();
        to_json(&serde_json::json!({
            "backend": t.backend().name(),
            "device": t.backend().device_name(),
            "preset": t.preset.to_string(),
            "matmul": t.precision.matmul.to_string(),
            "compute": t.precision.compute.to_string(),
            "loss_scaling": t.scaler.is_some(),
            "parameters": params.iter().map(|p| p.len()).sum::<usize>(),
            "names": params.iter().map(|p| p.name.clone()).collect::<Vec<_>>(),
            "plan_ops": t.plan().ops().len(),
            "executor": t.executor(),
        }))
    }

    /// Training mode (dropout applies; the default) or evaluation (dropout passes its input
    /// through), for the runs that follow.
    pub fn set_training(&self, on: bool) -> Result<(), JsValue> {
        claim(&self.run)?.training = on;
        Ok(())
    }

    /// Writes values input `k` (declaration order) for the steps that follow.
    pub fn set_values(&self, k: usize, values: Vec<f32>) -> Promise {
        let run = self.run.clone();
        future_to_promise(async move {
            let mut t = claim(&run)?;
            t.set_values(k, &values).await.map_err(js_error)?;
            Ok(JsValue::UNDEFINED)
        })
    }

    /// One training step on a batch (token ids and class targets, empty where the model reads
    /// none): a Promise of `{loss, skipped, grad_norm, loss_scale}` as JSON, rejected when the
    /// step diverges (a non-finite gradient without loss scaling).
    pub fn step(&self, ids: Vec<u32>, targets: Vec<u32>) -> Promise {
        let run = self.run.clone();
        future_to_promise(async move {
            let mut t = claim(&run)?;
            let s = t.step(&ids, &targets).await.map_err(js_error)?;
            to_json(&serde_json::json!({
                "loss": s.loss,
                "skipped": s.skipped,
                "grad_norm": s.grad_norm,
                "loss_scale": t.scaler.as_ref().map(|s| s.scale),
            }))
        })
    }

    /// The batch's mean loss without a step (the forward pass; `outputs` then reads it).
    pub fn loss(&self, ids: Vec<u32>, targets: Vec<u32>) -> Promise {
        let run = self.run.clone();
        future_to_promise(async move {
            let mut t = claim(&run)?;
            let loss = t.loss(&ids, &targets).await.map_err(js_error)?;
            Ok(JsValue::from(loss))
        })
    }

    /// What the loss read in the last forward pass (its logits or predictions): a Promise of a
    /// `Float32Array`.
    pub fn outputs(&self) -> Promise {
        let run = self.run.clone();
        future_to_promise(async move {
            let mut t = claim(&run)?;
            let out = t.outputs().await.map_err(js_error)?;
            Ok(Float32Array::from(&out[..]).into())
        })
    }

    /// The parameters by name: a Promise of an object of `Float32Array`s.
    pub fn params(&self) -> Promise {
        let run = self.run.clone();
        future_to_promise(async move {
            let mut t = claim(&run)?;
            let values = t.params().await.map_err(js_error)?;
            let object = Object::new();
            for (p, v) in t.model.params().iter().zip(&values) {
                Reflect::set(
                    &object,
                    &p.name.as_str().into(),
                    &Float32Array::from(&v[..]),
                )?;
            }
            Ok(object.into())
        })
    }
}

/// The backend a built model runs on: the page's adapter, or the host reference in wasm.
pub(crate) fn backend_named(
    name: &str,
    gpu: &'static dyn Backend,
) -> Result<&'static dyn Backend, JsValue> {
    static REFERENCE: mantissa::backend::reference::Reference =
        mantissa::backend::reference::Reference;
    match name {
        "webgpu" => Ok(gpu),
        "reference" => Ok(&REFERENCE),
        other => Err(js_error(format!(
            "backend '{other}': the page runs \"webgpu\" (its adapter) or \"reference\" (the host reference in wasm)"
        ))),
    }
}
