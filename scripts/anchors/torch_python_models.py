"""PyTorch's runs of two small torch.nn models, the fixtures of the Python package's model tests
(python/tests/test_models.py builds the same models with mantissa.ModelBuilder, copies the
weights in with load_state_dict and compares; the tests need no PyTorch).

    /work/torch-venv/bin/python scripts/anchors/torch_python_models.py [--out DIR]

writes DIR/python_models.npz (default python/tests/data), per model (`mlp`: Linear, GELU (tanh),
Linear, GELU, Linear, mean squared error; `classifier`: Linear, LayerNorm, GELU, Linear, cross
entropy): its initial state_dict (`MODEL/init/NAME`: torch's own initialisation, seeded), 50
batches (`MODEL/x`, `MODEL/y`: [steps, rows, ...]), and per preset (32-true, bf16-mixed) the
loss of each of 50 AdamW steps (`MODEL/PRESET/losses`), step 1's gradient of every parameter
(`MODEL/PRESET/grad/NAME`) and PyTorch's own loss noise (`MODEL/PRESET/noise`: how far its
losses move when every weight moves by a relative 1e-7, the largest of 64 draws, over the 50
steps: at bf16-mixed one flipped bf16 rounding moves later losses by 1e-5 to 2e-4, a heavy tail
that 8 draws undersample by 8x). About a minute and a half on two CPU cores; about 150 kB.

The optimizer is mantissa.ModelTrainer's default: AdamW, lr 1e-3, betas (0.9, 0.99), eps 1e-8,
weight decay 0.1 on the weights (the test declares them with decay=True) and none on biases and
norm parameters. bf16-mixed is CUDA's autocast written out as casts on the CPU (the casts of
torch_op_parity.py, as tests/model_parity.rs uses them): linear layers take bf16 inputs,
weights and bias, accumulate in f32 and round once to bf16; GELU runs in bf16 through f32;
layer norm and the losses compute in f32.
"""
import argparse
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_op_parity import casts  # noqa: E402

STEPS = 50
PRESETS = ["32-true", "bf16-mixed"]
MLP = dict(rows=32, inputs=8, hidden=32, outputs=4)
CLS = dict(rows=32, inputs=8, hidden=32, classes=5)


def mlp_module():
    i, h, o = MLP["inputs"], MLP["hidden"], MLP["outputs"]
    return nn.Sequential(nn.Linear(i, h), nn.GELU(approximate="tanh"), nn.Linear(h, h),
                         nn.GELU(approximate="tanh"), nn.Linear(h, o))


def classifier_module():
    i, h, k = CLS["inputs"], CLS["hidden"], CLS["classes"]
    return nn.Sequential(nn.Linear(i, h), nn.LayerNorm(h), nn.GELU(approximate="tanh"),
                         nn.Linear(h, k))


def mlp_loss(c, p, x, y):
    """The Sequential's forward with its parameters `p` by state_dict name, under casts `c`."""
    h = c.gelu(c.linear(x, p["0.weight"], p["0.bias"]))
    h = c.gelu(c.linear(h, p["2.weight"], p["2.bias"]))
    pred = c.linear(h, p["4.weight"], p["4.bias"])
    return F.mse_loss(pred.float(), y)


class _Norm:
    """What Casts.layer_norm reads of an nn.LayerNorm: its shape, weight, bias and eps."""

    def __init__(self, w, b):
        self.normalized_shape, self.weight, self.bias, self.eps = (w.shape[0],), w, b, 1e-5

    def __call__(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def classifier_loss(c, p, x, y):
    h = c.linear(x, p["0.weight"], p["0.bias"])
    h = c.gelu(c.layer_norm(h, _Norm(p["1.weight"], p["1.bias"])))
    logits = c.linear(h, p["3.weight"], p["3.bias"])
    return F.cross_entropy(logits.float(), y)


def batches(name, g):
    if name == "mlp":
        a = torch.randn(MLP["inputs"], MLP["outputs"], generator=g)
        x = torch.randn(STEPS, MLP["rows"], MLP["inputs"], generator=g)
        y = 2 * torch.tanh(x @ a) + 0.5 + 0.1 * torch.randn(STEPS, MLP["rows"], MLP["outputs"], generator=g)
        return x, y
    a = torch.randn(CLS["inputs"], CLS["classes"], generator=g)
    x = torch.randn(STEPS, CLS["rows"], CLS["inputs"], generator=g)
    y = (x @ a + 0.5 * torch.randn(STEPS, CLS["rows"], CLS["classes"], generator=g)).argmax(-1)
    return x, y


def run(loss_fn, init, xs, ys, preset):
    """Step 1's gradients, then 50 AdamW steps under `preset`: (grads, losses)."""
    c = casts(preset)
    p = {n: v.detach().clone().requires_grad_() for n, v in init.items()}
    decay = [v for n, v in p.items() if n.endswith("weight") and v.dim() == 2]
    rest = [v for n, v in p.items() if not (n.endswith("weight") and v.dim() == 2)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99), eps=1e-8)
    losses, grads = [], None
    for x, y in zip(xs, ys):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(c, p, x, y)
        loss.backward()
        if grads is None:
            grads = {n: v.grad.detach().clone() for n, v in p.items()}
        opt.step()
        losses.append(loss.item())
    return grads, losses


def noise(loss_fn, init, xs, ys, preset, draws=64, relative=1e-7):
    """How far PyTorch's losses move when every weight moves by a relative N(0, 1e-7^2) (about
    one f32 rounding), the largest over `draws` draws and the steps: PyTorch against itself."""
    base = run(loss_fn, init, xs, ys, preset)[1]
    most = 0.0
    for k in range(draws):
        g = torch.Generator().manual_seed(9000 + k)
        moved = {n: v * (1 + relative * torch.randn(v.shape, generator=g)) for n, v in init.items()}
        most = max(most, max(abs(a - b) for a, b in zip(run(loss_fn, moved, xs, ys, preset)[1], base)))
    return most


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(root, "python", "tests", "data"))
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(51)
    out = {"torch": np.array(torch.__version__)}
    for name, make, loss_fn in [("mlp", mlp_module, mlp_loss),
                                ("classifier", classifier_module, classifier_loss)]:
        module = make()  # torch's own initialisation, seeded above
        init = {n: v.detach().clone() for n, v in module.state_dict().items()}
        xs, ys = batches(name, torch.Generator().manual_seed(52))
        # The functional forward is the module's (no casts at 32-true).
        want = module(xs[0])
        got = (mlp_loss if name == "mlp" else classifier_loss)
        if name == "mlp":
            assert torch.allclose(F.mse_loss(want, ys[0]), got(casts("32-true"), init, xs[0], ys[0]))
        else:
            assert torch.allclose(F.cross_entropy(want, ys[0]), got(casts("32-true"), init, xs[0], ys[0]))
        for n, v in init.items():
            out[f"{name}/init/{n}"] = v.numpy()
        out[f"{name}/x"] = xs.numpy()
        out[f"{name}/y"] = ys.numpy().astype(np.int64 if name == "classifier" else np.float32)
        for preset in PRESETS:
            grads, losses = run(loss_fn, init, xs, ys, preset)
            for n, v in grads.items():
                out[f"{name}/{preset}/grad/{n}"] = v.numpy()
            out[f"{name}/{preset}/losses"] = np.array(losses, dtype=np.float64)
            out[f"{name}/{preset}/noise"] = np.array(noise(loss_fn, init, xs, ys, preset))
            print(f"{name:10s} {preset:10s} loss {losses[0]:.6f} -> {losses[-1]:.6f}, "
                  f"noise {float(out[f'{name}/{preset}/noise']):.1e}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "python_models.npz")
    np.savez_compressed(path, **out)
    print(f"wrote {path} ({os.path.getsize(path) / 1e3:.0f} kB)", file=sys.stderr)


if __name__ == "__main__":
    main()
