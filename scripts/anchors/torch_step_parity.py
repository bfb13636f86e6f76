"""Step-for-step parity with PyTorch: the anchor model (scripts/anchors/torch_gpt.py, nanoGPT's
recipe) trained from given initial weights on given batches, its per-step losses written down so
that `mantissa train --init INIT --batches BATCHES` can be compared with them step by step.

    python scripts/anchors/torch_step_parity.py [--out DIR] [--config tiny|small] [--steps 300]
        [--presets 32-true,bf16-mixed,16-mixed,bf16-true,16-true] [--init FILE] [--batches FILE]
        [--device cpu|cuda] [--dtype float32|float64]

writes into DIR (default tests/data):
- parity_CONFIG_init.safetensors: the initial weights under the model's `state_dict` names, f32
  (PyTorch's [out, in] layout; `head.weight` is `tok.weight`, which the head is tied to). Drawn as
  the anchor draws them (torch.manual_seed(1337)), or read from --init (e.g. the file
  `mantissa train --export-init` writes, to start PyTorch from the engine's seeded weights).
- parity_CONFIG_batches.npy: [steps, B, T+1] token ids of the project's corpus (the first 90% of
  data/shakespeare.txt, ids by sorted character); x is the first T of a row, y the last T. Drawn
  as the anchor draws them (a generator seeded 1337), or read from --batches.
- parity_CONFIG_torch.json: per preset, every step's loss, the loss scale after the step and
  the steps GradScaler skipped, with the PyTorch version and device that produced them; and
  (unless --inject-inf is empty) a short 16-mixed run named "16-mixed, inf at steps 3,4" with an
  inf added to the first element of the first gradient (tok.weight's, scaled) at those steps, as
  `Trainer::step_injecting` adds it, so that GradScaler's skips and backoff are compared too.

The fixtures tests/train.rs compares with (tiny, 300 steps, every preset) are regenerated with
`python scripts/anchors/torch_step_parity.py` (PyTorch, numpy and safetensors installed; about
ten minutes on two CPU cores); the JSON records the PyTorch version that wrote it. Then

    mantissa train --precision bf16-mixed --steps 300 --init tests/data/parity_tiny_init.safetensors \
        --batches tests/data/parity_tiny_batches.npy --out runs/parity   (--adam-eps 1e-4 for the true presets)
    python scripts/anchors/torch_step_parity.py --compare runs/parity/train.json

prints, per preset, the largest |loss - PyTorch's| at step 1, over steps 1-10 and over all steps,
and whether the loss scales and skipped steps are GradScaler's (docs/training.md has the figures).

Autocast. On a GPU (--device cuda) the mixed presets run under plain torch.autocast("cuda"). A
CPU's autocast follows the CPU's op lists, which run softmax and layer norm in bf16 where CUDA's
run them in f32, so on a CPU this script does not use autocast: it writes CUDA's lists out as
explicit casts (class `Casts`), exact on any device:
- matmul-like ops (linear, matmul): the inputs (and a linear's weight and bias) rounded to the
  compute dtype, the product (plus the bias) computed in f32 and its result held in the compute
  dtype, as a cuBLAS GEMM with f32 accumulation gives it; their gradients likewise (the backward
  of the casts rounds each gradient to the dtype its tensor had);
- f32-list ops (layer_norm, softmax, cross_entropy): computed in f32 from their inputs;
- everything else (embedding, add, the score scaling, masked_fill, GELU) in the dtype of its
  inputs: the scaling of a 16-bit score by 1/sqrt(head dim) is held in 16 bits, computed as
  CUDA does (a multiplication by the f32 reciprocal), and GELU of a 16-bit input is computed in
  f32 and held in 16 bits.
The "true" presets (the model itself in bf16 or f16, no autocast) run their matmuls the same way
(16-bit inputs, f32 accumulation, 16-bit output) and hold layer norm and softmax outputs in the
model's dtype. Weights are rounded to the model's dtype as .to() rounds them (to nearest even).

The recipe is torch_gpt.py's: AdamW betas (0.9, 0.99), eps 1e-8 (1e-4 for the 16-bit "true"
presets), weight decay 0.1 on 2-d parameters, the gradient norm clipped to 1.0, constant lr 1e-3,
GradScaler's defaults under 16-mixed (on the CPU too: torch.amp.GradScaler("cpu")).
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

CONFIGS = {"tiny": (16, 32, 2, 2, 64), "small": (64, 256, 6, 6, 384)}  # B, T, L, H, D
PRESETS = ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


class Casts:
    """How each op's operands and result are held (see the module's docstring). `compute`: the
    dtype matmul-like ops hold their results in (None: no casts, the ops run in their inputs'
    dtype); `held`: the dtype layer norm and softmax hold theirs in (f32 under the mixed presets,
    the model's dtype under the true ones)."""

    def __init__(self, compute=None, held=None):
        self.compute, self.held = compute, held

    def _in(self, t):
        return None if t is None else t.to(self.compute).float()

    def linear(self, x, w, b=None):
        if self.compute is None:
            return F.linear(x, w, b)
        return F.linear(self._in(x), self._in(w), self._in(b)).to(self.compute)

    def matmul(self, a, b):
        if self.compute is None:
            return a @ b
        return (self._in(a) @ self._in(b)).to(self.compute)

    def scale(self, x, s):
        if self.compute is None:
            return x / s
        # CUDA divides by a scalar as a multiplication by its f32 reciprocal.
        inverse = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(s, dtype=torch.float32)
        return (x.float() * inverse).to(x.dtype)

    def gelu(self, x):
        if self.compute is None:
            return F.gelu(x, approximate="tanh")
        return F.gelu(x.float(), approximate="tanh").to(x.dtype)

    def layer_norm(self, x, ln):
        if self.compute is None:
            return ln(x)
        y = F.layer_norm(x.float(), ln.normalized_shape, ln.weight.float(), ln.bias.float(), ln.eps)
        return y.to(self.held)

    def softmax(self, x):
        if self.compute is None:
            return x.softmax(-1)
        return x.float().softmax(-1).to(self.held)


NONE = Casts()


class Block(nn.Module):
    def __init__(s, D, H):
        super().__init__()
        s.D, s.H = D, H
        s.ln1, s.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        s.qkv, s.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        s.fc, s.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(s, x, c):
        b, t, _ = x.shape
        D, H = s.D, s.H
        q, k, v = c.linear(c.layer_norm(x, s.ln1), s.qkv.weight, s.qkv.bias).split(D, 2)
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in (q, k, v))
        att = c.scale(c.matmul(q, k.transpose(-2, -1)), math.sqrt(D // H))
        att = att.masked_fill(torch.ones(t, t, device=x.device, dtype=torch.bool).triu(1), float("-inf"))
        y = c.matmul(c.softmax(att), v).transpose(1, 2).reshape(b, t, D)
        x = x + c.linear(y, s.proj.weight, s.proj.bias)
        h = c.gelu(c.linear(c.layer_norm(x, s.ln2), s.fc.weight, s.fc.bias))
        return x + c.linear(h, s.out.weight, s.out.bias)


class GPT(nn.Module):
    """torch_gpt.py's model under RECIPE=nanogpt (head tied to the token embedding, tanh GELU),
    its ops written through `Casts`."""

    def __init__(s, V, T, L, H, D):
        super().__init__()
        s.tok, s.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        s.blocks = nn.ModuleList(Block(D, H) for _ in range(L))
        s.ln, s.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
        s.head.weight = s.tok.weight
        for name, p in s.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(s, idx, tgt, c=NONE):
        x = s.tok(idx) + s.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in s.blocks:
            x = blk(x, c)
        logits = c.linear(c.layer_norm(x, s.ln), s.head.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt.reshape(-1))


def corpus(root):
    text = open(os.path.join(root, "data", "shakespeare.txt")).read()
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    data = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)
    return data[: int(0.9 * len(data))], len(chars)


def draw_batches(data, steps, B, T):
    """The anchor's batches: B random windows of T + 1 tokens per step, generator seeded 1337."""
    g = torch.Generator().manual_seed(1337)
    out = np.empty((steps, B, T + 1), dtype=np.uint8 if int(data.max()) < 256 else np.int32)
    for s in range(steps):
        ix = torch.randint(len(data) - T - 1, (B,), generator=g)
        out[s] = torch.stack([data[i:i + T + 1] for i in ix]).numpy()
    return out


def train(preset, init, batches, shape, device, dtype, steps, inject=()):
    B, T, L, H, D = shape
    V = init["tok.weight"].shape[0]
    model = GPT(V, T, L, H, D)
    model.load_state_dict({k: v.to(torch.float32) for k, v in init.items()})
    model = model.to(device=device, dtype=dtype)
    casts, autocast = NONE, None
    if preset in ("16-true", "bf16-true"):
        model = model.to(DTYPES[preset.split("-")[0]])
        if device == "cpu":
            casts = Casts(DTYPES[preset.split("-")[0]], DTYPES[preset.split("-")[0]])
    elif preset in ("16-mixed", "bf16-mixed"):
        dt = DTYPES[preset.split("-")[0]]
        if device == "cpu":
            casts = Casts(dt, torch.float32)
        else:
            autocast = dt
    eps = 1e-4 if preset in ("16-true", "bf16-true") else 1e-8
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99), eps=eps)
    scaler = torch.amp.GradScaler(device, enabled=(preset == "16-mixed"))
    losses, scales, skipped = [], [], []
    for step in range(steps):
        rows = torch.from_numpy(batches[step].astype(np.int64)).to(device)
        x, y = rows[:, :T], rows[:, 1:]
        with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = model(x, y, casts)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if step + 1 in inject:
            model.tok.weight.grad.view(-1)[0] += float("inf")
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale() if scaler.is_enabled() else None
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        if scaler.is_enabled():
            scales.append(scaler.get_scale())
            # GradScaler backs off exactly when it skipped the step.
            skipped.append(scaler.get_scale() < before)
        if not math.isfinite(losses[-1]):
            break
    print(f"{preset:10s} loss {losses[0]:.6f} -> {losses[-1]:.6f} over {len(losses)} steps"
          + (f", skipped {sum(skipped)}, scale {scales[-1]}" if scales else ""), flush=True)
    return {"losses": losses, "loss_scales": scales or None,
            "skipped": [i + 1 for i, s in enumerate(skipped) if s], "adam_eps": eps}


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(root, "tests", "data"))
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--init", help="initial weights (safetensors, state_dict names) instead of drawn ones")
    ap.add_argument("--batches", help="batches (.npy [steps, B, T+1]) instead of drawn ones")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                    help="the model's dtype for 32-true (float64: how far f32 rounding alone moves the losses)")
    ap.add_argument("--json", help="where the losses go (default OUT/parity_CONFIG_torch.json)")
    ap.add_argument("--inject-inf", default="3,4",
                    help="steps of the extra 16-mixed run that get an inf gradient ('' for none)")
    ap.add_argument("--inject-steps", type=int, default=30, help="steps of that run")
    ap.add_argument("--compare", nargs="+", metavar="TRAIN_JSON",
                    help="compare these train.json logs of `mantissa train` with the losses in --json instead")
    a = ap.parse_args()
    if a.compare:
        return compare(a.json or os.path.join(a.out, f"parity_{a.config}_torch.json"), a.compare)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if a.dtype == "float64" and a.presets != "32-true":
        ap.error("--dtype float64 goes with --presets 32-true")
    shape = CONFIGS[a.config]
    B, T, L, H, D = shape
    data, V = corpus(root)
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"parity_{a.config}")
    if a.init:
        init = load_file(a.init)
        if "head.weight" not in init:
            init["head.weight"] = init["tok.weight"]
    else:
        torch.manual_seed(1337)
        init = {k: v.detach().clone() for k, v in GPT(V, T, L, H, D).state_dict().items()}
        save_file(init, base + "_init.safetensors", metadata={"torch": torch.__version__})
    if a.batches:
        batches = np.load(a.batches)
    else:
        batches = draw_batches(data, a.steps, B, T)
        np.save(base + "_batches.npy", batches)
    assert batches.shape[1:] == (B, T + 1) and len(batches) >= a.steps, batches.shape
    dtype = getattr(torch, a.dtype)
    runs = {p: train(p, init, batches, shape, a.device, dtype, a.steps) for p in a.presets.split(",")}
    if a.inject_inf and "16-mixed" in runs:
        inject = [int(s) for s in a.inject_inf.split(",")]
        steps = min(a.inject_steps, a.steps)
        runs[f"16-mixed, inf at steps {a.inject_inf}"] = train("16-mixed", init, batches, shape, a.device,
                                                             dtype, steps, inject)
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    out = a.json or base + "_torch.json"
    with open(out, "w") as f:
        json.dump({"torch": torch.__version__, "device": device, "dtype": a.dtype, "config": a.config,
                   "steps": a.steps, "autocast": "torch.autocast" if a.device != "cpu" else "CUDA's op lists as casts",
                   "runs": runs}, f, indent=0)
    print("wrote", out, file=sys.stderr)


def compare(torch_json, logs):
    """Per preset of each train.json: the largest |loss - PyTorch's| at step 1, over steps 1-10
    and over all steps run, and whether the loss scales and skipped steps are GradScaler's."""
    runs = json.load(open(torch_json))["runs"]
    print("| preset | backend | steps | step 1 | steps 1-10 | all | loss scales, skips |")
    print("|---|---|---|---|---|---|---|")
    for path in logs:
        for r in json.load(open(path)):
            theirs = runs[r["preset"]]
            ours = [s["loss"] for s in r["steps"]]
            n = min(len(ours), len(theirs["losses"]))
            d = [abs(a - b) for a, b in zip(ours[:n], theirs["losses"])]
            same = "-"
            if theirs["loss_scales"]:
                scales = [s["loss_scale"] for s in r["steps"][:n]] == theirs["loss_scales"][:n]
                skips = [s["step"] for s in r["steps"][:n] if s["skipped"]] == [s for s in theirs["skipped"] if s <= n]
                same = "same" if scales and skips else "DIFFER"
            print(f"| {r['preset']} | {r['backend']} | {n} | {d[0]:.1e} | {max(d[:10]):.1e} | {max(d):.1e} | {same} |")


if __name__ == "__main__":
    main()
