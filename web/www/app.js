// The page: renders what the engine (wasm, ../src/lib.rs) computes on this adapter, and
// publishes every result as JSON (window.mantissaResults and <pre id="results">).
//
// URL parameters: auto (also train on load), n (matmul size), reps, steps, a / b (presets),
// tune (what the autotuner tunes: "all", the default; "none"; or a comma-separated list of
// matmul algorithms and "train"; the rest runs on default tiles), model (with auto: the
// presets the built-model panel trains under, comma-separated), msteps (its steps), chars
// (characters sampled after training; 160, each a forward pass).

import init, { Engine, ModelBuilder, loss_chart, presets } from "./pkg/mantissa_web.js";
import { twoSpirals, twoSpiralsModel } from "./spirals.js";

const params = new URLSearchParams(location.search);
const $ = (id) => document.getElementById(id);
const TRAIN_SEED = 1337; // `mantissa train`'s default, so native runs can be compared

const results = {
  status: "loading",
  adapter: null,
  matmul_size: null,
  matmul: [],
  report: null,
  casts: null,
  cast_view: null,
  training: null,
  models: [],
  errors: [],
};
window.mantissaResults = results;

const tuneList = (params.get("tune") || "all").split(",");
// The autotuner tunes `what` (an algorithm, or "train") or leaves it on default tiles.
function tuneFor(engine, what) {
  const on = tuneList.includes("all") || tuneList.includes(what);
  engine.set_autotune(on ? "fast" : "off");
}

function publish() {
  $("results").textContent = JSON.stringify(results, null, 2);
}

function fail(where, e) {
  const message = `${where}: ${e && e.message ? e.message : e}`;
  results.errors.push(message);
  console.error(message);
  publish();
  return message;
}

const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
const sci = (x, d = 2) => (x === null || x === undefined ? "-" : Number(x).toExponential(d));

// ---------- adapter ----------

function renderAdapter(a) {
  const s = a.summary;
  const yes = (b) => (b ? "yes" : "no");
  const classes = a.precision_classes.map(([c, alg]) => `${c} &rarr; ${alg}`).join(", ");
  $("adapter").innerHTML = `<dl>
    <dt>adapter</dt><dd><b>${esc(s.name)}</b> (${esc(s.device_type)}, ${esc(s.backend)})</dd>
    <dt>driver</dt><dd>${esc(s.driver || "-")}</dd>
    <dt>shader-f16</dt><dd>${yes(s.shader_f16)}; f16 operands are read <b>${esc(a.f16_read)}</b></dd>
    <dt>timestamps</dt><dd>${yes(s.timestamps)}${s.timestamps ? "" : " (times are wall clock)"}</dd>
    <dt>largest binding</dt><dd>${(s.max_storage_binding_bytes / 2 ** 20).toFixed(0)} MiB</dd>
    <dt>precision classes</dt><dd>${classes}</dd></dl>`;
}

// ---------- matmul table ----------

function bars(records, value, format, log) {
  const w = 460, row = 22, left = 90, h = records.length * row + 10;
  const vals = records.map(value).filter((v) => v > 0);
  if (!vals.length) return "";
  const hi = Math.max(...vals), lo = Math.min(...vals);
  const scale = (v) => {
    if (!(v > 0)) return 0;
    if (!log) return ((w - left - 70) * v) / hi;
    const a = Math.log10(lo) - 0.5, b = Math.log10(hi) + 0.2;
    return ((w - left - 70) * (Math.log10(v) - a)) / (b - a);
  };
  const items = records.map((r, i) => {
    const y = 5 + i * row, v = value(r), len = Math.max(1, scale(v));
    return `<text x="${left - 6}" y="${y + 14}" text-anchor="end">${esc(r.algorithm)}</text>
      <rect x="${left}" y="${y + 3}" width="${len}" height="${row - 8}" rx="2" fill="var(--accent)" opacity="0.8"/>
      <text x="${left + len + 4}" y="${y + 14}">${format(v)}</text>`;
  });
  return `<svg width="${w}" height="${h}" font-size="12" font-family="system-ui">${items.join("")}</svg>`;
}

function renderMatmul() {
  const rows = results.matmul.map((r) => {
    const [lo, hi] = r.expected_error;
    const inBand = r.relative_error >= lo && r.relative_error <= hi;
    const contract = r.contract_breaks === null
      ? "not checked"
      : r.contract_breaks === 0 ? `<span class="ok">0</span>` : `<span class="fail">${r.contract_breaks}</span>`;
    return `<tr><td>${esc(r.algorithm)}</td><td>${(r.seconds * 1e3).toFixed(2)}</td>
      <td>${(r.tflops * 1e3).toFixed(2)}</td>
      <td class="${inBand ? "ok" : "fail"}">${sci(r.relative_error)}</td>
      <td>${sci(lo, 0)} .. ${sci(hi, 0)}</td><td>${contract}</td></tr>`;
  });
  $("matmul-table").tBodies[0].innerHTML = rows.join("");
  $("chart-speed").innerHTML = bars(results.matmul, (r) => r.tflops * 1e3, (v) => v.toFixed(1), false);
  $("chart-error").innerHTML = bars(results.matmul, (r) => r.relative_error, (v) => sci(v, 1), true);
}

async function runMatmul(engine, n, reps) {
  $("run-matmul").disabled = true;
  results.matmul = [];
  results.matmul_size = n;
  const seed = (Math.random() * 2 ** 31) >>> 0;
  for (const algorithm of Engine.algorithms()) {
    $("matmul-status").textContent = `${algorithm} at ${n}x${n}x${n}...`;
    try {
      tuneFor(engine, algorithm);
      const record = JSON.parse(await engine.bench(algorithm, n, reps, seed));
      record.seed = seed;
      results.matmul.push(record);
      renderMatmul();
    } catch (e) {
      fail(`matmul ${algorithm}`, e);
    }
    publish();
  }
  results.autotune = JSON.parse(engine.autotune());
  const t = results.autotune;
  $("matmul-status").textContent = `done (inputs seeded ${seed}; ${t.entries} tuned tiles, ${t.loaded} of them from this browser's storage)`;
  $("run-matmul").disabled = false;
}

// ---------- casts ----------

async function runCast(engine) {
  const text = $("cast-input").value;
  try {
    const view = JSON.parse(await engine.cast(text, $("cast-saturate").checked));
    results.cast_view = view;
    $("cast-status").textContent = "";
    $("cast-table").tBodies[0].innerHTML = view.rows.map(({ encoding: e, gpu_agrees }) => `<tr>
      <td>${esc(e.format)}</td><td class="mono">${esc(e.value)}</td>
      <td class="mono bits"><span class="s">${e.sign}</span> | <span class="e">${e.exponent}</span> | <span class="m">${e.mantissa}</span></td>
      <td class="mono">${e.hex}</td><td>${sci(e.relative_error)}</td>
      <td class="${gpu_agrees ? "ok" : "fail"}">${gpu_agrees ? "same bits" : "DIFFERS"}</td></tr>`).join("");
  } catch (e) {
    $("cast-status").textContent = e.message || String(e);
  }
  publish();
}

async function runReport(engine) {
  $("report-summary").textContent = "running every algorithm on every input family...";
  try {
    const report = JSON.parse(await engine.report((Math.random() * 2 ** 31) >>> 0));
    results.report = report;
    const casts = report.casts;
    const values = casts.reduce((n, c) => n + c.values, 0);
    const badCasts = casts.filter((c) => c.mismatches > 0);
    results.casts = casts;
    $("cast-checks").innerHTML = badCasts.length === 0
      ? `<span class="ok">All ${casts.length} cast, decode, split and amax kernels agree with the host bit for bit</span> (${values} values: every boundary, every fp8 and 16-bit code, random bit patterns).`
      : `<span class="fail">${badCasts.length} ops differ from the host:</span> ${badCasts.map((c) => esc(c.op + ": " + c.first_mismatch)).join("; ")}`;
    const families = report.families;
    const algorithms = [...new Set(report.matmuls.map((m) => m.algorithm))];
    const cell = (alg, fam) => report.matmuls
      .filter((m) => m.algorithm === alg && m.family === fam)
      .reduce((n, m) => n + m.contract_breaks + (m.whole_product.error <= m.whole_product.allowed ? 0 : 1), 0);
    $("report-table").tHead.innerHTML = `<tr><th>algorithm</th>${families.map((f) => `<th>${esc(f)}</th>`).join("")}</tr>`;
    $("report-table").tBodies[0].innerHTML = algorithms.map((a) => `<tr><td>${esc(a)}</td>${families.map((f) => {
      const n = cell(a, f);
      return `<td class="${n ? "fail" : "ok"}">${n}</td>`;
    }).join("")}</tr>`).join("");
    $("report-summary").innerHTML = report.passed
      ? `<span class="ok">PASSED</span>: ${report.matmuls.length} matmuls and ${casts.length} cast checks, no contract break (seed ${report.seed}).`
      : `<span class="fail">FAILED</span>: ${esc(report.failures.join("; "))} (seed ${report.seed}).`;
  } catch (e) {
    $("report-summary").textContent = fail("report", e);
  }
  publish();
}

// ---------- training ----------

function renderRuns(runs) {
  $("train-runs").innerHTML = runs.map((r, i) => {
    const last = r.steps[r.steps.length - 1];
    const state = r.stopped
      ? `<span class="fail">stopped at step ${r.steps.length + 1}</span>: ${esc(r.stopped)}`
      : last ? `step ${last.step}: loss <b>${last.loss.toFixed(4)}</b>${last.loss_scale ? `, loss scale ${last.loss_scale}` : ""}, ${last.dt_ms.toFixed(0)} ms/step, ${Math.round(last.tokens_per_s)} tokens/s` : "starting...";
    const val = r.val_loss === null || r.val_loss === undefined ? "" : `<br>validation loss <b>${r.val_loss.toFixed(4)}</b>`;
    return `<div class="run ${i ? "b" : "a"}"><h3>${esc(r.preset)}</h3>
      <div class="note">${esc(r.info.config)}; ${r.info.parameters} parameters; matmul ${esc(r.info.matmul)}, compute ${esc(r.info.compute)}${r.info.master_weights ? ", f32 master weights" : ""}${r.info.loss_scaling ? ", loss scaling" : ""}</div>
      <p>${state}${val}</p><div class="sample">${esc(r.sample || "")}</div></div>`;
  }).join("");
  const curves = runs.map((r) => ({
    label: r.preset,
    losses: r.steps.map((s) => [s.step, s.loss]),
    points: [],
  }));
  try {
    $("loss-chart").innerHTML = loss_chart("training loss (tiny GPT)", JSON.stringify(curves));
  } catch (e) {
    fail("loss chart", e);
  }
}

async function runTraining(engine, presetNames, steps) {
  $("run-train").disabled = true;
  tuneFor(engine, "train");
  const runs = presetNames.map((preset) => {
    const session = engine.trainer(preset, TRAIN_SEED);
    return { preset, session, info: JSON.parse(session.info()), steps: [], stopped: null, val_loss: null, sample: null };
  });
  const plain = () => runs.map(({ session, ...rest }) => rest);
  results.training = { seed: TRAIN_SEED, steps, runs: plain() };
  for (let i = 0; i < steps; i++) {
    for (const r of runs) {
      if (r.stopped) continue;
      try {
        r.steps.push(JSON.parse(await r.session.step()));
      } catch (e) {
        r.stopped = e.message || String(e);
      }
    }
    $("train-status").textContent = `step ${i + 1} of ${steps}`;
    renderRuns(runs);
    if (runs.every((r) => r.stopped)) break;
  }
  for (const r of runs) {
    if (r.stopped) continue;
    $("train-status").textContent = `evaluating and sampling ${r.preset}...`;
    try {
      r.val_loss = await r.session.evaluate(4);
      const chars = Number(params.get("chars") || 160);
      r.sample = "ROMEO:" + (await r.session.sample("ROMEO:", chars, 0.8, 1));
    } catch (e) {
      fail(`evaluating ${r.preset}`, e);
    }
    renderRuns(runs);
  }
  results.training = { seed: TRAIN_SEED, steps, runs: plain() };
  $("train-status").textContent = "done";
  $("run-train").disabled = false;
  publish();
}

// ---------- a model built in JavaScript ----------

// The panel's run: 256 points in [-4, 4]^2, 32 hidden units, AdamW at 0.03 (about 150 steps to
// separate the spirals under 32-true).
const SPIRALS = { perClass: 128, radius: 4, hidden: 32, lr: 0.03, seed: 1, dataSeed: 7 };
const GRID = 32; // boundary cells per side: GRID^2 is a whole number of batches
const EXTENT = 4.5; // the plane shown, [-EXTENT, EXTENT]^2
const BACKENDS = ["webgpu", "reference"];

// p(class 1) over the GRID x GRID lattice, as `run` computes it (forward passes of whole
// batches), and the run's accuracy on the training points, which it is given back.
async function predict(run, data) {
  const rows = data.classes.length;
  const none = new Uint32Array(0);
  const p = new Float32Array(GRID * GRID);
  const chunk = new Float32Array(2 * rows);
  const cellSize = (2 * EXTENT) / GRID;
  for (let start = 0; start < GRID * GRID; start += rows) {
    for (let i = 0; i < rows; i++) {
      const cell = start + i;
      chunk[2 * i] = -EXTENT + ((cell % GRID) + 0.5) * cellSize;
      chunk[2 * i + 1] = EXTENT - (Math.floor(cell / GRID) + 0.5) * cellSize;
    }
    await run.set_values(0, chunk);
    await run.loss(none, new Uint32Array(rows));
    const logits = await run.outputs();
    for (let i = 0; i < rows; i++) p[start + i] = 1 / (1 + Math.exp(logits[2 * i] - logits[2 * i + 1]));
  }
  await run.set_values(0, data.points);
  await run.loss(none, data.classes);
  const logits = await run.outputs();
  let correct = 0;
  for (let i = 0; i < rows; i++) correct += Number((logits[2 * i + 1] > logits[2 * i]) === (data.classes[i] === 1));
  return { p, accuracy: correct / rows };
}

function drawBoundary(canvas, p, data) {
  const ctx = canvas.getContext("2d");
  const px = canvas.width / GRID;
  for (let cell = 0; cell < GRID * GRID; cell++) {
    const q = p[cell];
    // Class 0 red, class 1 green (the chart's first two colours), pale by confidence.
    const mix = (a, b) => Math.round(255 - (255 - (q * b + (1 - q) * a)) * 0.6);
    ctx.fillStyle = `rgb(${mix(230, 46)}, ${mix(25, 150)}, ${mix(75, 60)})`;
    ctx.fillRect((cell % GRID) * px, Math.floor(cell / GRID) * px, px + 0.5, px + 0.5);
  }
  const at = (v) => ((v + EXTENT) / (2 * EXTENT)) * canvas.width;
  for (let i = 0; i < data.classes.length; i++) {
    ctx.beginPath();
    ctx.arc(at(data.points[2 * i]), canvas.height - at(data.points[2 * i + 1]), 2.5, 0, 2 * Math.PI);
    ctx.fillStyle = data.classes[i] ? "rgb(46, 150, 60)" : "rgb(230, 25, 75)";
    ctx.fill();
    ctx.strokeStyle = "white";
    ctx.lineWidth = 0.8;
    ctx.stroke();
  }
}

// The largest loss difference between the two runs over the steps both took.
function largestDifference(runs) {
  const [a, b] = runs.map((r) => r.losses);
  let worst = 0;
  for (let i = 0; i < Math.min(a.length, b.length); i++) worst = Math.max(worst, Math.abs(a[i][1] - b[i][1]));
  return worst;
}

function renderModel(record) {
  const line = (r) => {
    const last = r.losses[r.losses.length - 1];
    const state = r.stopped ? `<span class="fail">stopped</span>: ${esc(r.stopped)}`
      : last ? `step ${last[0]}: loss <b>${last[1].toFixed(4)}</b>` : "starting...";
    // The first step compiles the run's kernels; the rate is the steps after it.
    const ms = r.losses.length > 1
      ? ` (${(r.seconds * 1e3 / (r.losses.length - 1)).toFixed(1)} ms/step after the first, ${(r.first_seconds * 1e3).toFixed(0)} ms)`
      : "";
    const acc = r.accuracy === null ? "" : `, ${(100 * r.accuracy).toFixed(1)}% of the points right`;
    return `<b>${esc(r.backend)}</b> (${esc(r.info.device)}; matmul ${esc(r.info.matmul)}): ${state}${acc}${ms}`;
  };
  $("model-summary").innerHTML = record.runs.map(line).join("<br>") +
    `<br>largest loss difference between the two: <b>${sci(record.largest_difference)}</b>`;
  const curves = record.runs.map((r) => ({ label: `${r.backend} ${record.preset}`, losses: r.losses, points: [] }));
  try {
    $("model-chart").innerHTML = loss_chart(`two spirals, ${record.preset}`, JSON.stringify(curves));
  } catch (e) {
    fail("model loss chart", e);
  }
}

async function runModel(engine, preset, steps) {
  $("run-model").disabled = true;
  $("model-preset").value = preset;
  const data = twoSpirals(SPIRALS.perClass, SPIRALS.radius, SPIRALS.dataSeed);
  const rows = data.classes.length;
  const record = { preset, steps, lr: SPIRALS.lr, seed: SPIRALS.seed, runs: [], largest_difference: 0 };
  const live = [];
  try {
    for (const backend of BACKENDS) {
      const b = new ModelBuilder();
      const loss = twoSpiralsModel(b, rows, SPIRALS.hidden);
      const run = engine.model_trainer(b, loss, preset, backend, SPIRALS.seed, SPIRALS.lr);
      b.free();
      await run.set_values(0, data.points);
      live.push(run);
      record.runs.push({ backend, info: JSON.parse(run.info()), losses: [], stopped: null, accuracy: null, first_seconds: 0, seconds: 0 });
    }
  } catch (e) {
    $("model-status").textContent = fail(`building the model under ${preset}`, e);
    $("run-model").disabled = false;
    return;
  }
  results.models.push(record);
  const none = new Uint32Array(0);
  const redraw = async () => {
    for (const [k, r] of record.runs.entries()) {
      if (r.stopped) continue;
      const { p, accuracy } = await predict(live[k], data);
      r.accuracy = accuracy;
      drawBoundary($(`boundary-${r.backend}`), p, data);
    }
  };
  for (let i = 1; i <= steps; i++) {
    for (const [k, r] of record.runs.entries()) {
      if (r.stopped) continue;
      const start = performance.now();
      try {
        r.losses.push([i, JSON.parse(await live[k].step(none, data.classes)).loss]);
      } catch (e) {
        r.stopped = e.message || String(e);
      }
      const seconds = (performance.now() - start) / 1e3;
      if (i === 1) r.first_seconds = seconds;
      else r.seconds += seconds;
    }
    record.largest_difference = largestDifference(record.runs);
    $("model-status").textContent = `${preset}: step ${i} of ${steps}`;
    if (i % 25 === 0 || i === steps) await redraw();
    renderModel(record);
    if (record.runs.every((r) => r.stopped)) break;
  }
  for (const run of live) run.free();
  $("model-status").textContent = "done";
  $("run-model").disabled = false;
  publish();
}

// Misuses of the builder and of a run: each must throw an error that names what was wrong,
// and leave the page working (the test checks the messages).
async function refusals(engine) {
  const out = [];
  const attempt = async (what, f) => {
    try {
      await f();
      out.push({ what, error: null });
    } catch (e) {
      out.push({ what, error: e.message || String(e) });
    }
  };
  const b = new ModelBuilder();
  const x = b.values([4, 3]);
  const w = b.param("w", [5, 2], "normal", 0.1, true);
  const bias = b.param("b", [2], "zeros", 0, false);
  await attempt("linear of mismatched shapes", () => b.linear(x, w, bias));
  const other = new ModelBuilder();
  other.values([4, 3]);
  await attempt("a value of another builder", () => other.tanh(x));
  await attempt("an unknown unary function", () => b.unary("swish", x));
  await attempt("an unknown initialisation", () => b.param("v", [2], "uniform", 1, true));
  const ok = new ModelBuilder();
  const points = ok.values([4, 2]);
  const loss = ok.cross_entropy(
    ok.linear(points, ok.param("w", [2, 2], "normal", 0.5, true), ok.param("b", [2], "zeros", 0, false)),
    ok.targets([4]));
  await attempt("an unknown backend", () => engine.model_trainer(new ModelBuilder(), loss, "32-true", "cuda", 1, 0.01));
  const run = engine.model_trainer(ok, loss, "32-true", "webgpu", 1, 0.01);
  await attempt("a builder used twice", () => engine.model_trainer(ok, loss, "32-true", "webgpu", 1, 0.01));
  await attempt("values of the wrong length", () => run.set_values(0, new Float32Array(7)));
  await run.set_values(0, new Float32Array([0, 1, 1, 0, 1, 1, 0, 0]));
  await attempt("targets of the wrong length", () => run.step(new Uint32Array(0), new Uint32Array(3)));
  await attempt("a target outside the classes", () => run.step(new Uint32Array(0), new Uint32Array([0, 1, 2, 0])));
  await attempt("a step after the refusals", () => run.step(new Uint32Array(0), new Uint32Array([0, 1, 1, 0])));
  run.free();
  results.refusals = out;
  publish();
}

// ---------- main ----------

async function main() {
  await init();
  let engine;
  try {
    engine = await Engine.open();
  } catch (e) {
    $("adapter").innerHTML = `<span class="fail">No WebGPU here:</span> ${esc(e.message || e)}. Use a browser with WebGPU (Chrome, Edge, Firefox 141+, Safari 26+).`;
    fail("opening WebGPU", e);
    results.status = "error";
    publish();
    return;
  }
  results.adapter = JSON.parse(engine.adapter());
  renderAdapter(results.adapter);
  try {
    const text = await (await fetch("shakespeare.txt")).text();
    results.corpus = JSON.parse(engine.load_corpus(text));
  } catch (e) {
    fail("loading the corpus", e);
  }

  const names = presets();
  for (const [id, chosen] of [["preset-a", params.get("a") || "16-true"], ["preset-b", params.get("b") || "16-mixed"]]) {
    $(id).innerHTML = names.map((p) => `<option${p === chosen ? " selected" : ""}>${p}</option>`).join("");
  }
  if (params.get("n")) {
    // A size the list does not offer joins it (a select silently takes no unknown value).
    const n = String(Number(params.get("n")));
    if (![...$("size").options].some((o) => o.value === n)) $("size").add(new Option(n));
    $("size").value = n;
  }
  if (params.get("steps")) $("steps").value = params.get("steps");
  $("model-preset").innerHTML = names.map((p) => `<option${p === "bf16-mixed" ? " selected" : ""}>${p}</option>`).join("");
  if (params.get("msteps")) $("model-steps").value = params.get("msteps");
  $("model-code").textContent = twoSpiralsModel.toString();
  const reps = Number(params.get("reps") || 3);

  let timer = null;
  $("cast-input").addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(() => runCast(engine), 200);
  });
  $("cast-saturate").addEventListener("change", () => runCast(engine));
  $("run-matmul").addEventListener("click", () => runMatmul(engine, Number($("size").value), reps).then(publish));
  $("run-model").addEventListener("click", () =>
    runModel(engine, $("model-preset").value, Number($("model-steps").value)));
  $("run-train").addEventListener("click", () =>
    runTraining(engine, [$("preset-a").value, $("preset-b").value], Number($("steps").value)));

  results.status = "running";
  publish();
  await runCast(engine);
  await runReport(engine);
  await runMatmul(engine, Number($("size").value), reps);
  if (params.has("auto")) {
    await refusals(engine);
    for (const preset of (params.get("model") || $("model-preset").value).split(",")) {
      await runModel(engine, preset, Number($("model-steps").value));
    }
    await runTraining(engine, [$("preset-a").value, $("preset-b").value], Number($("steps").value));
    results.autotune = JSON.parse(engine.autotune());
    // A second engine starts from the tiles the first stored, as a reload would.
    try {
      results.autotune_reopened = JSON.parse((await Engine.open()).autotune());
    } catch (e) {
      fail("reopening the engine", e);
    }
  }
  results.status = "done";
  publish();
}

main().catch((e) => {
  fail("page", e);
  results.status = "error";
  publish();
});
