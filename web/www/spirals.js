// The "your own model" panel's model and data, built in JavaScript with the engine's model
// builder (../src/model.rs). The page shows twoSpiralsModel's source as it runs it.

// Two interleaved spirals of `perClass` points each, 1.75 turns out to radius `radius`, with a
// little noise from a seeded generator (mulberry32): the same points on every page load.
export function twoSpirals(perClass, radius, seed) {
  let state = seed >>> 0;
  const uniform = () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 2 ** 32;
  };
  const points = new Float32Array(4 * perClass);
  const classes = new Uint32Array(2 * perClass);
  for (let c = 0; c < 2; c++) {
    for (let i = 0; i < perClass; i++) {
      const r = (i + 0.5) / perClass;
      const turn = 1.75 * 2 * Math.PI * r + c * Math.PI;
      const row = c * perClass + i;
      points[2 * row] = radius * (r * Math.sin(turn) + 0.02 * (uniform() - 0.5));
      points[2 * row + 1] = radius * (r * Math.cos(turn) + 0.02 * (uniform() - 0.5));
      classes[row] = c;
    }
  }
  return { points, classes };
}

// An MLP that tells the two spirals apart: 2 -> hidden -> hidden -> 2 classes, tanh between,
// trained on the mean cross entropy. `b` is a ModelBuilder; the loss it returns finishes it.
export function twoSpiralsModel(b, rows, hidden) {
  const layer = (name, x, inputs, outputs) => {
    const w = b.param(`${name}.w`, [inputs, outputs], "normal", 1 / Math.sqrt(inputs), true);
    const bias = b.param(`${name}.b`, [outputs], "zeros", 0, false);
    return b.linear(x, w, bias);
  };
  const points = b.values([rows, 2]); // written with set_values(0, ...)
  const classes = b.targets([rows]); // given to each step
  let h = b.tanh(layer("fc1", points, 2, hidden));
  h = b.tanh(layer("fc2", h, hidden, hidden));
  const logits = layer("out", h, hidden, 2);
  return b.cross_entropy(logits, classes);
}
