"""How much does precision move my model's training? A torch.nn MLP, the same model written with
mantissa.ModelBuilder, PyTorch's initial weights copied in with one call, and the per-step
losses of every preset side by side (mantissa.compare), with PyTorch's own f32 run beside them.

    pip install torch mantissa   # (mantissa: the wheel scripts/test.sh builds)
    python python/examples/compare_torch.py [--steps 50] [--backends reference,auto]
"""
import argparse

import numpy as np
import torch
import torch.nn as nn

import mantissa

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--steps", type=int, default=50)
ap.add_argument("--backends", default="reference")
ap.add_argument("--presets", default="32-true,bf16-mixed,16-mixed,bf16-true")
args = ap.parse_args()

ROWS, IN, HIDDEN, OUT = 64, 8, 64, 4
torch.manual_seed(0)
module = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(approximate="tanh"),
                       nn.Linear(HIDDEN, HIDDEN), nn.GELU(approximate="tanh"),
                       nn.Linear(HIDDEN, OUT))
state = {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def builder():
    """The same model: parameters under the module's state_dict names and layouts."""
    b = mantissa.ModelBuilder()
    x, y = b.values([ROWS, IN]), b.values([ROWS, OUT])
    h = x
    for i, (n_in, n_out) in zip((0, 2, 4), [(IN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, OUT)]):
        w = b.param(f"{i}.weight", [n_out, n_in], transpose=True)  # nn.Linear's [out, in]
        bias = b.param(f"{i}.bias", [n_out], init="zeros", decay=False)
        h = b.linear(h, w, bias)
        if i < 4:
            h = b.gelu(h)
    b.mse(h, y)
    return b


g = torch.Generator().manual_seed(1)
a = torch.randn(IN, OUT, generator=g)
batches = []
for _ in range(args.steps):
    x = torch.randn(ROWS, IN, generator=g)
    batches.append((x.numpy(), (2 * torch.tanh(x @ a) + 0.5).numpy()))

# PyTorch's own run: AdamW as ModelTrainer's defaults (lr 1e-3, betas (0.9, 0.99), weight decay
# 0.1 on the weights only).
decay = [p for n, p in module.named_parameters() if n.endswith("weight")]
rest = [p for n, p in module.named_parameters() if not n.endswith("weight")]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                         {"params": rest, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.99))
torch_losses = []
for x, y in batches:
    opt.zero_grad()
    loss = nn.functional.mse_loss(module(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    opt.step()
    torch_losses.append(loss.item())

result = mantissa.compare(builder, batches, presets=args.presets.split(","),
                          backends=args.backends.split(","), init=state)
print(result)
base = result.losses[result.baseline]
print(f"\nPyTorch f32 against {result.baseline}: largest |difference| "
      f"{np.abs(np.array(torch_losses) - base).max():.2e} over {args.steps} steps")
