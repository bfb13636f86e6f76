//! mantissa in the browser: the engine compiled to wasm32, running its WGSL kernels on the page's
//! WebGPU adapter. Everything the page shows comes from the same library code as the native
//! tools: `MatmulBench` (throughput, error against an f64 product, the contract check against
//! the host reference), `report::cast_checks`, `Format::describe` and the `Trainer`.
//!
//! Every export that touches the GPU returns a Promise: nothing blocks in the browser. Results
//! are JSON strings, parsed by the page (`www/app.js`).

// A training run's RefCell borrow spans its awaits by design (see `claim`).
#![allow(clippy::await_holding_refcell_ref)]

use js_sys::Promise;
use mantissa::backend::wgpu::autotune::{AutotuneMode, Autotuner, TileStore};
use mantissa::backend::wgpu::{WgpuBackend, WgpuOptions};
use mantissa::backend::{Backend, Operands};
use mantissa::bench::MatmulBench;
use mantissa::model::ModelTrainer;
use mantissa::policy::PrecisionClass;
use mantissa::policy::precision::PrecisionRequest;
use mantissa::report;
use mantissa::train::{Corpus, GptConfig, TrainOptions, Trainer};
use mantissa::{Algorithm, Format, Overflow, Preset};
use serde_json::json;
use std::cell::{RefCell, RefMut};
use std::rc::Rc;
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

mod model;
pub use model::{ModelBuilder, ModelRun};

fn js_error(e: impl std::fmt::Display) -> JsValue {
    JsError::new(&e.to_string()).into()
}

fn to_json(v: &impl serde::Serialize) -> Result<JsValue, JsValue> {
    serde_json::to_string(v)
        .map(JsValue::from)
        .map_err(js_error)
}

#[wasm_bindgen(start)]
fn start() {
    console_error_panic_hook::set_once();
}

/// Tuned matmul tiles in the page's localStorage, so that a reload (or another page of the same
/// origin) starts tuned. Nothing is captured: the storage is looked up on each use, so the
/// store is `Send + Sync` as the autotuner wants. Storage may be absent or full: best effort.
struct LocalStorage;

impl LocalStorage {
    const KEY: &str = "mantissa.autotune";

    fn storage() -> Option<web_sys::Storage> {
        web_sys::window()?.local_storage().ok()?
    }
}

impl TileStore for LocalStorage {
    fn load(&self) -> Option<String> {
        Self::storage()?.get_item(Self::KEY).ok()?
    }

    fn save(&self, json: &str) {
        if let Some(s) = Self::storage() {
            let _ = s.set_item(Self::KEY, json);
        }
    }
}

/// The engine on the page's adapter. The backend and the corpus live as long as the page.
#[wasm_bindgen]
pub struct Engine {
    backend: &'static WgpuBackend,
    corpus: Option<&'static Corpus>,
}

#[wasm_bindgen]
impl Engine {
    /// Opens the page's WebGPU adapter. Browsers always run WGSL with their own bounds checks,
    /// so the backend says so; f16 is read natively where `shader-f16` is offered, else packed.
    pub async fn open() -> Result<Engine, JsValue> {
        let options = WgpuOptions {
            runtime_checks: true,
            autotune: AutotuneMode::Fast,
            ..WgpuOptions::default()
        };
        let backend = WgpuBackend::open_nth(0, options)
            .await
            .map_err(js_error)?
            .with_tuner(Autotuner::with_store(
                AutotuneMode::Fast,
                Some(Box::new(LocalStorage)),
            ));
        Ok(Engine {
            backend: Box::leak(Box::new(backend)),
            corpus: None,
        })
    }

    /// Sets how hard the autotuner tries from now on: "off", "fast" or "full" (tiles chosen so
    /// far are kept; "off" runs default tiles).
    pub fn set_autotune(&self, mode: String) -> Result<(), JsValue> {
        self.backend.set_autotune(mode.parse().map_err(js_error)?);
        Ok(())
    }

    /// The autotuner's state: tiles chosen, and how many came from localStorage when the engine
    /// opened (JSON).
    pub fn autotune(&self) -> Result<JsValue, JsValue> {
        let (entries, loaded) = self.backend.autotune_entries();
        to_json(&json!({
            "entries": entries,
            "loaded": loaded,
            "stored": LocalStorage.load().is_some(),
        }))
    }

    /// The adapter, its features and how each precision class resolves on it (JSON).
    pub fn adapter(&self) -> Result<JsValue, JsValue> {
        let b = self.backend;
        let classes: Vec<(String, String)> = PrecisionClass::ALL
            .iter()
            .map(|c| (c.to_string(), c.resolve(&b.capabilities()).to_string()))
            .collect();
        to_json(&json!({
            "backend": b.name(),
            "device": b.device_name(),
            "summary": b.summary(),
            "f16_read": format!("{:?}", b.f16_read()).to_lowercase(),
            "precision_classes": classes,
        }))
    }

    /// The algorithms the matmul table runs, by name.
    pub fn algorithms() -> Vec<String> {
        Algorithm::ALL.iter().map(|a| a.to_string()).collect()
    }

    /// Times `algorithm` at n x n x n and measures its error against an f64 product and its
    /// agreement with the host reference (a Promise of a `MatmulRecord` as JSON).
    pub fn bench(&self, algorithm: String, n: usize, repetitions: usize, seed: u32) -> Promise {
        let backend = self.backend;
        future_to_promise(async move {
            let algorithm: Algorithm = algorithm.parse().map_err(js_error)?;
            let bench = MatmulBench {
                shapes: vec![(n, n, n)],
                algorithms: vec![algorithm],
                operands: vec![Operands::F32],
                repetitions,
                error_rows: 32,
                seed: seed as u64,
                // The full host reference in wasm takes about a second at 256^3.
                contract_check_limit: 1 << 24,
            };
            let records = bench.run(backend, |_| {}).await.map_err(js_error)?;
            to_json(&records.first())
        })
    }

    /// `mantissa report` on this adapter: every cast, decode, split and amax bit for bit, and
    /// every algorithm on every input family (normal, wide range, cancellation, extremes with
    /// subnormals and overflow, non-finite) at odd sizes, against the host reference (a
    /// Promise of the `Report` as JSON).
    pub fn report(&self, seed: u32) -> Promise {
        let backend: &'static dyn Backend = self.backend;
        future_to_promise(async move {
            let config = report::ReportConfig {
                kinds: vec![],
                skip_absent: false,
                shapes: vec![(64, 64, 64), (131, 67, 200)],
                algorithms: report::ReportConfig::default_algorithms(),
                families: report::Family::ALL.to_vec(),
                seed: seed as u64,
                repetitions: 1,
                train_steps: 0,
                train_presets: vec![],
                corpus: Default::default(),
            };
            let report = report::run_on(&[backend], vec![], &config, |_| {})
                .await
                .map_err(js_error)?;
            to_json(&report)
        })
    }

    /// `text` cast to every format: the host's encoding with its bit fields, and whether the
    /// GPU's encode kernel produced the same code (a Promise of JSON rows).
    pub fn cast(&self, text: String, saturate: bool) -> Promise {
        let backend = self.backend;
        future_to_promise(async move {
            let x: f32 = text.trim().parse().map_err(|_| {
                js_error(format!(
                    "'{text}' is not a number (write e.g. 3.14, 1e-5, inf, nan)"
                ))
            })?;
            let overflow = if saturate {
                Overflow::Saturate
            } else {
                Overflow::Standard
            };
            let mut rows = Vec::new();
            for format in Format::ALL {
                let host = format.describe(x, overflow);
                let gpu = backend
                    .encode(format, overflow, &[x])
                    .await
                    .map_err(js_error)?;
                rows.push(json!({
                    "encoding": host,
                    "gpu_code": gpu[0],
                    "gpu_agrees": mantissa::measure::same_code(format, gpu[0], host.code),
                }));
            }
            to_json(&json!({ "value": x, "rows": rows }))
        })
    }

    /// Loads the training text (the page fetches it); returns its statistics as JSON.
    pub fn load_corpus(&mut self, text: &str) -> Result<JsValue, JsValue> {
        let corpus = Corpus::from_text(text).map_err(js_error)?;
        let stats = json!({
            "characters": corpus.train.len() + corpus.val.len(),
            "vocab": corpus.vocab.len(),
            "unigram_entropy": corpus.unigram_entropy(),
        });
        self.corpus = Some(Box::leak(Box::new(corpus)));
        to_json(&stats)
    }

    /// A tiny GPT ready to train under `preset` ("16-mixed", "16-true", ...).
    pub fn trainer(&self, preset: String, seed: u32) -> Result<Session, JsValue> {
        let corpus = self
            .corpus
            .ok_or_else(|| js_error("load the corpus first (load_corpus)"))?;
        let preset: Preset = preset.parse().map_err(js_error)?;
        let config = GptConfig::named("tiny", corpus.vocab.len()).map_err(js_error)?;
        let options = TrainOptions::new(config, preset, seed as u64);
        let trainer = Trainer::new(self.backend, corpus, options).map_err(js_error)?;
        Ok(Session {
            trainer: Rc::new(RefCell::new(trainer)),
        })
    }
}

#[wasm_bindgen]
impl Engine {
    /// `builder`'s model, finished at `loss` (the builder is used up), trained under `preset`
    /// on `backend`: "webgpu" (this adapter) or "reference" (the host reference, in wasm),
    /// its parameters drawn from `seed`, AdamW at learning rate `lr`. The same model, preset
    /// and seed give the same initial weights on both.
    pub fn model_trainer(
        &self,
        builder: &mut ModelBuilder,
        loss: &JsValue,
        preset: String,
        backend: String,
        seed: u32,
        lr: f32,
    ) -> Result<ModelRun, JsValue> {
        let preset: Preset = preset.parse().map_err(js_error)?;
        let backend = model::backend_named(&backend, self.backend)?;
        let model = builder.finish(loss)?;
        let request = PrecisionRequest::of(preset);
        let mut trainer =
            ModelTrainer::new(backend, model, &request, None, seed as u64).map_err(js_error)?;
        trainer.adamw.lr = lr;
        trainer.adamw.check().map_err(js_error)?;
        Ok(ModelRun::new(trainer))
    }
}

/// The precision presets the training panel offers, by name.
#[wasm_bindgen]
pub fn presets() -> Vec<String> {
    Preset::ALL.iter().map(|p| p.to_string()).collect()
}

/// Loss curves as SVG, drawn by the same code as `mantissa train` and `mantissa report`.
/// `curves`: JSON `[{"label": .., "losses": [[step, loss], ..], "points": [[step, loss], ..]}]`.
#[wasm_bindgen]
pub fn loss_chart(title: &str, curves: &str) -> Result<String, JsValue> {
    let curves: Vec<report::LossCurve> = serde_json::from_str(curves).map_err(js_error)?;
    report::loss_chart(title, &curves).map_err(js_error)
}

/// One training run. Its methods return Promises; one at a time (a second call while one runs
/// is an error, not a queue).
#[wasm_bindgen]
pub struct Session {
    trainer: Rc<RefCell<Trainer<'static>>>,
}

/// The run for one call. The borrow is held across the call's awaits on purpose: it is the
/// lock that turns a second, overlapping call into an error instead of a corrupted step.
fn claim<T>(run: &Rc<RefCell<T>>) -> Result<RefMut<'_, T>, JsValue> {
    run.try_borrow_mut()
        .map_err(|_| js_error("this run is busy with another call"))
}

#[wasm_bindgen]
impl Session {
    /// Preset, matmul algorithm and model size (JSON).
    pub fn info(&self) -> Result<JsValue, JsValue> {
        let t = self.trainer.borrow();
        let c = &t.gpt.config;
        to_json(&json!({
            "preset": t.options.preset.to_string(),
            "matmul": t.run.precision.matmul.to_string(),
            "compute": t.run.precision.compute.to_string(),
            "master_weights": t.spec.master_weights,
            "loss_scaling": t.run.scaler.is_some(),
            "parameters": c.parameter_count(),
            "config": format!("{} layers, {} heads, width {}, context {}, batch {}",
                c.n_layer, c.n_head, c.n_embd, c.block_size, c.batch_size),
        }))
    }

    /// One training step (a Promise of a `StepRecord` as JSON; rejected when the run stops).
    pub fn step(&self) -> Promise {
        let run = self.trainer.clone();
        future_to_promise(async move {
            let mut t = claim(&run)?;
            let record = t.step().await.map_err(js_error)?;
            to_json(&record)
        })
    }

    /// Mean validation loss over `batches` fixed batches.
    pub fn evaluate(&self, batches: usize) -> Promise {
        let run = self.trainer.clone();
        future_to_promise(async move {
            let mut t = claim(&run)?;
            let loss = t.evaluate(batches).await.map_err(js_error)?;
            Ok(JsValue::from(loss))
        })
    }

    /// `count` characters generated after `prompt`.
    pub fn sample(&self, prompt: String, count: usize, temperature: f32, seed: u32) -> Promise {
        let run = self.trainer.clone();
        future_to_promise(async move {
            let mut t = claim(&run)?;
            let text = t
                .sample(&prompt, count, temperature, seed as u64)
                .await
                .map_err(js_error)?;
            Ok(JsValue::from(text))
        })
    }
}
