// The page: renders what the engine (wasm, ../src/lib.rs) computes on this adapter, and
// publishes every result as JSON (window.mantissaResults and <pre id="results">).
//
// URL parameters: auto (also train on load), n (matmul size), reps, steps, a / b (presets),
// tune (what the autotuner tunes: "all", the default; "none"; or a comma-separated list of
// matmul algorithms and "train"; the rest runs on default tiles).

import init, { Engine, loss_chart, presets } from "./pkg/mantissa_web.js";

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
      r.sample = "ROMEO:" + (await r.session.sample("ROMEO:", 160, 0.8, 1));
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
  const reps = Number(params.get("reps") || 3);

  let timer = null;
  $("cast-input").addEventListener("input", () => {
    clearTimeout(timer);
    timer = setTimeout(() => runCast(engine), 200);
  });
  $("cast-saturate").addEventListener("change", () => runCast(engine));
  $("run-matmul").addEventListener("click", () => runMatmul(engine, Number($("size").value), reps).then(publish));
  $("run-train").addEventListener("click", () =>
    runTraining(engine, [$("preset-a").value, $("preset-b").value], Number($("steps").value)));

  results.status = "running";
  publish();
  await runCast(engine);
  await runReport(engine);
  await runMatmul(engine, Number($("size").value), reps);
  if (params.has("auto")) {
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
