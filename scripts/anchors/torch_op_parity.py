"""Per-op parity with PyTorch: every op and loss of the model builder (src/model/ops.rs) run by
PyTorch under 32-true, bf16-mixed and 16-mixed, its output and every input's gradient written
down, so that tests/op_parity.rs can run the same op as a one-op model on every backend and
compare (issue #53).

    python scripts/anchors/torch_op_parity.py [--out DIR]

writes into DIR (default tests/data):
- op_parity.safetensors: per case, its inputs (`CASE/in/NAME`, f32, the same under every
  preset), the fixed upstream gradient of its output (`CASE/dy`; none for a loss), and per
  preset PyTorch's output (`CASE/PRESET/out`; a loss's value as one element) and the gradient
  of every input that takes one (`CASE/PRESET/grad/NAME`), all f32.
- op_parity.json: the manifest: per case its op, attributes, inputs (shape, the format a model
  holds each in, whether it is a parameter, the tokens, the targets or a values input) and, per
  preset and output tensor, the format PyTorch holds it in (`held`, checked against the
  values), the narrowest format of a rounding inside the op before it (`inner`: attention's
  scores, a softmax's scaled scores; f32 where none), the length of the longest sum behind it
  (`sum`) and whether the fixtures give the magnitudes of its f32 formula's terms
  (`CASE/scale/KEY`: GELU's and SiLU's tails, layer norm's rows): what the test's tolerance is
  derived from. With the PyTorch version that wrote it.
- model_parity.safetensors and model_parity.json: two whole models from a trained state
  ("whole models" below, tests/model_parity.rs): their parameters (`MODEL/init/NAME`), 10
  batches, and per preset step 1's gradients (`MODEL/PRESET/grad/NAME`), 10 steps' losses and
  loss scales, and PyTorch's own loss noise.

About two minutes on two CPU cores (most of it the models' noise, 16 reruns of each); the
fixtures are about 1.5 MB. Regenerate with `python scripts/anchors/torch_op_parity.py` (torch,
numpy and safetensors installed) whenever a case is added; tests/op_parity.rs reads the
manifest, so it needs no change for a new case of a known op.

Autocast is CUDA's, written out as casts on the CPU as in torch_step_parity.py (its class
`Casts`, which this script extends with SiLU, RMS norm and the elementwise product): a
matmul-like op (linear, matmul, attention's two products) takes its inputs, weight and bias
rounded to the compute dtype, accumulates in f32 and rounds once (cuBLASLt's bias epilogue, or
the GEMM with beta = 1 over the bias); layer norm, softmax, cross entropy and the mean squared
error compute in f32; everything else (embedding, add, mul, GELU, SiLU, the score scaling) runs
in its inputs' dtype, an add of an f32 and a 16-bit tensor in f32 (type promotion). RMS norm is
in none of CUDA's lists: its input, the residual stream, is f32, so it runs in f32.

The inputs are held as a model holds them: `compute` inputs (a linear's x, GELU's input, q|k|v,
logits: outputs of matmul-like ops) in the compute dtype, as leaves of that dtype whose
gradients PyTorch then holds in it too; `f32` inputs (weights, biases, gains: master weights;
the residual stream) in f32. `compute` values are drawn representable in both bf16 and f16, so
that one set of inputs serves every preset. The upstream gradient is drawn the same way (a
16-bit op's output gradient is held in 16 bits; the engine's losses hold theirs in the compute
format). Values are not trivial: biases and gains away from 0 and 1, rows offset from zero,
magnitudes over many binades (down to f16's subnormals), rows of 3, 50 and 783 values, 257 rows
(one past the 256-row chunks of the column sums), 17 tokens (one past a 16-wide tile).
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_step_parity import Casts  # noqa: E402

PRESETS = ["32-true", "bf16-mixed", "16-mixed"]
DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


class OpCasts(Casts):
    """torch_step_parity's casts, with the ops of users' models."""

    def silu(self, x):
        if self.compute is None:
            return F.silu(x)
        return F.silu(x.float()).to(x.dtype)

    def mul(self, a, b):
        if self.compute is None:
            return a * b
        # Both in one 16-bit dtype: CUDA multiplies in f32 and rounds once.
        return (a.float() * b.float()).to(a.dtype)

    def rms_norm(self, x, g, eps):
        if self.compute is None:
            return F.rms_norm(x, (x.shape[-1],), g, eps)
        return F.rms_norm(x.float(), (x.shape[-1],), g.float(), eps).to(self.held)


def casts(preset):
    dt = DTYPES.get(preset)
    return OpCasts(dt, torch.float32) if dt else OpCasts()


# ---- values ----

def both16(x):
    """x rounded to a value bf16 and f16 both hold (8 significant bits, f16's range)."""
    x = torch.as_tensor(x, dtype=torch.float32).clamp(-6e4, 6e4)
    y = x.to(torch.float16).to(torch.bfloat16).float()
    assert torch.equal(y.to(torch.float16).float(), y), "not representable in f16"
    return y


def wide(g, shape, lo, hi, zeros=0.0):
    """Random signs, magnitudes log-uniform over binades lo..hi (2^lo to 2^hi), a share of zeros."""
    n = math.prod(shape)
    mag = torch.exp2(torch.empty(n).uniform_(lo, hi, generator=g))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = mag * sign
    x[torch.rand(n, generator=g) < zeros] = 0.0
    return x.reshape(shape)


def normal(g, shape, std=1.0, mean=0.0):
    return torch.randn(shape, generator=g) * std + mean


def row_scaled(g, shape, lo, hi, offset=0.0):
    """Rows of N(0, 1) plus a row offset N(0, offset^2), each row scaled by 2^u, u uniform in
    lo..hi (an offset a few times the row's spread: the f32 mean and variance stay well
    conditioned, as in a residual stream)."""
    x = torch.randn(shape, generator=g) + torch.randn(shape[:-1] + (1,), generator=g) * offset
    s = torch.exp2(torch.empty(shape[:-1] + (1,)).uniform_(lo, hi, generator=g))
    return x * s


def gains(g, shape):
    """Gains away from 1: magnitudes 0.5 to 2.5, a few negative."""
    x = torch.empty(shape).uniform_(0.5, 2.5, generator=g)
    return torch.where(torch.rand(shape, generator=g) < 0.15, -x, x)


# ---- the cases ----
#
# A case: its op and attributes, its inputs as (name, values, format, kind) with format "f32"
# or "compute" and kind "param" (takes a gradient), "tokens", "targets" or "values", and the
# function computing the output from the inputs under the casts. `held` names, per output
# tensor, the format PyTorch's autocast leaves it in ("compute" or "f32": out, and grad/NAME),
# `inner` the narrowest rounding on the way ("compute" where a 16-bit rounding precedes an f32
# output), `sum` the longest sum behind each.

def case(name, op, inputs, fn, held, sums, attrs=None, inner=None, dy=(-10, 2), scale=None):
    return dict(name=name, op=op, inputs=inputs, fn=fn, held=held, sums=sums, attrs=attrs or {},
                inner=inner or {}, dy=dy, scale=scale)


def gelu_terms(x, dy):
    """The magnitudes of the terms of GELU's f32 formulas (tanh form) and of its gradient's,
    with the error tanh's argument carries: what an f32 evaluation's rounding error is
    relative to (f64)."""
    x, dy = x.double(), dy.double()
    c = math.sqrt(2 / math.pi)
    u = c * (x + 0.044715 * x ** 3)
    t, du = torch.tanh(u), c * (1 + 3 * 0.044715 * x ** 2)
    dt = t.abs() + (1 - t * t) * u.abs()
    out = 0.5 * x.abs() * (1 + dt)
    d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du
    grad = dy.abs() * (0.5 * (1 + dt) + 0.5 * x.abs() * du * (1 + t * t + 2 * t.abs() * dt) + d.abs())
    return {"out": out, "grad/x": grad}


def layer_norm_terms(x, g, b, dy):
    """The same for layer norm: x - mean in f32 is off by units of the row's largest |x|, which
    its standard deviation then divides, a row's condition kappa = max |x| / std; so are the
    normalized values everything else reads (f64)."""
    x, g, b, dy = x.double(), g.double(), b.double(), dy.double()
    mean = x.mean(-1, keepdim=True)
    std = (x.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    xhat = (x - mean) / std
    kappa = x.abs().amax(-1, keepdim=True) / std + 1
    d = dy * g
    out = g.abs() * (kappa + xhat.abs()) + b.abs()
    dx = (d.abs() + d.abs().mean(-1, keepdim=True) * (1 + xhat.abs())) * kappa / std
    dg = (dy.abs() * (kappa + xhat.abs())).amax(0)
    return {"out": out, "grad/x": dx, "grad/g": dg, "grad/b": dy.abs().amax(0)}


def silu_terms(x, dy):
    """The same for SiLU, x sigmoid(x), and its gradient dy s (1 + x (1 - s))."""
    x, dy = x.double(), dy.double()
    s = torch.sigmoid(x)
    ds = 1 + x.abs() * (1 - s)  # exp(-x)'s argument error, relative
    out = x.abs() * s * ds
    d = s * (1 + x * (1 - s))
    grad = dy.abs() * ((s + x.abs() * s * (1 - s)) * (1 + ds) + d.abs())
    return {"out": out, "grad/x": grad}


def sigmoid_terms(x, dy):
    """The same for the sigmoid 1 / (1 + exp(-x)) (exp's error relative to its argument, as
    SiLU's) and its gradient from the output, dy y (1 - y): y's last unit moves 1 - y by a
    unit of 1 where y nears 1."""
    x, dy = x.double(), dy.double()
    s = torch.sigmoid(x)
    ds = 1 + x.abs() * (1 - s)
    return {"out": s * ds, "grad/x": dy.abs() * (s * (1 - s) + s * ds * (1 + s))}


def tanh_terms(x, dy):
    """The same for tanh (the value itself) and its gradient from the output, dy (1 - y^2):
    y's last unit moves 1 - y^2 by two units of 1 where |y| nears 1."""
    x, dy = x.double(), dy.double()
    t = torch.tanh(x)
    return {"out": t.abs(), "grad/x": dy.abs() * (1 - t * t + 2 * t * t)}


def cases(g):
    out = []

    # embedding: ids with repeats (the backward's scatter-add sums them), the table f32.
    table = normal(g, (40, 24), 0.7)
    ids = torch.randint(0, 40, (2, 33), generator=g)
    ids[0, :8] = 7  # one row picked 8 times
    out.append(case("embedding", "embedding",
                    [("table", table, "f32", "param"), ("ids", ids, "ids", "tokens")],
                    lambda c, t, i: F.embedding(i, t),
                    {"out": "f32", "grad/table": "f32"}, {"out": 1, "grad/table": 66}))

    # linear: x (a matmul's output, compute) . w + b (master weights, f32).
    for name, (n, k, m), bias in [("linear_bias_rows", (257, 3, 12), 1.0),
                                  ("linear_long_k", (2, 783, 4), 0.5),
                                  ("linear_zero_bias", (5, 50, 33), 0.0)]:
        x = both16(row_scaled(g, (n, k), -4, 4))
        w = normal(g, (k, m), 1 / math.sqrt(k))
        b = normal(g, (m,), bias)
        held = {"out": "compute", "grad/x": "compute", "grad/w": "compute", "grad/b": "compute"}
        out.append(case(name, "linear",
                        [("x", x, "compute", "param"), ("w", w, "f32", "param"),
                         ("b", b, "f32", "param")],
                        lambda c, x, w, b: c.linear(x, w.t(), b), held,
                        {"out": k, "grad/x": m, "grad/w": n, "grad/b": n},
                        {"bias": "zero" if bias == 0 else "normal"}))

    # matmul: x . w, and x . w^T (a head tied to an embedding table).
    for name, transpose in [("matmul", False), ("matmul_transposed", True)]:
        x = both16(row_scaled(g, (5, 50), -3, 3))
        w = normal(g, (33, 50) if transpose else (50, 33), 0.2)
        held = {"out": "compute", "grad/x": "compute", "grad/w": "compute"}
        out.append(case(name, "matmul",
                        [("x", x, "compute", "param"), ("w", w, "f32", "param")],
                        (lambda c, x, w: c.matmul(x, w.t())) if transpose
                        else (lambda c, x, w: c.matmul(x, w)),
                        held, {"out": 50, "grad/x": 33, "grad/w": 5},
                        {"transpose_w": transpose}))

    # layer norm and RMS norm of the residual stream (f32): rows offset from zero, scaled over
    # binades; gains away from 1, biases away from 0.
    for rows, c in [(257, 3), (5, 50), (2, 783)]:
        x = row_scaled(g, (rows, c), -6, 6, offset=2.0)
        ln_g, ln_b = gains(g, (c,)), normal(g, (c,), 0.5)
        held = {"out": "f32", "grad/x": "f32", "grad/g": "f32", "grad/b": "f32"}
        out.append(case(f"layer_norm_{rows}x{c}", "layer_norm",
                        [("x", x, "f32", "param"), ("g", ln_g, "f32", "param"),
                         ("b", ln_b, "f32", "param")],
                        lambda cs, x, g_, b_: cs.layer_norm(x, _LN(g_, b_)), held,
                        {"out": c, "grad/x": c, "grad/g": rows, "grad/b": rows},
                        scale=lambda x, dy, g_=ln_g, b_=ln_b: layer_norm_terms(x, g_, b_, dy)))
        x = row_scaled(g, (rows, c), -6, 6, offset=1.0)
        rg = gains(g, (c,))
        held = {"out": "f32", "grad/x": "f32", "grad/g": "f32"}
        out.append(case(f"rms_norm_{rows}x{c}", "rms_norm",
                        [("x", x, "f32", "param"), ("g", rg, "f32", "param")],
                        lambda cs, x, g_: cs.rms_norm(x, g_, 1e-5), held,
                        {"out": c, "grad/x": c, "grad/g": rows}, {"eps": 1e-5}))

    # GELU and SiLU of a matmul's output (compute): magnitudes from f16's subnormals to 4096
    # (SiLU's negative ones to 64: below about -88 f32's exp(-x) overflows and PyTorch's SiLU is
    # 0 where the value is not). Their f32 formulas lose the small values of the tails to
    # cancellation (GELU's 1 + tanh(u)), so each value's tolerance is measured against its
    # terms' magnitudes (`scale`).
    for op in ["gelu", "silu"]:
        x = wide(g, (1, 783), -20, 12, zeros=0.01)
        if op == "silu":
            x = torch.where(x < -64, -torch.exp2(torch.empty(x.shape).uniform_(-20, 6, generator=g)), x)
        x = both16(x)
        out.append(case(op, op, [("x", x, "compute", "param")],
                        (lambda c, x: c.gelu(x)) if op == "gelu" else (lambda c, x: c.silu(x)),
                        {"out": "compute", "grad/x": "compute"}, {"out": 1, "grad/x": 1},
                        scale=gelu_terms if op == "gelu" else silu_terms))

    # add: the residual stream (f32) plus a projection's output (compute), f32 by promotion; and
    # two matmul outputs (both compute), which PyTorch adds in their dtype.
    a = normal(g, (1, 783), 3.0)
    b = both16(wide(g, (1, 783), -16, 10))
    out.append(case("add_residual", "add",
                    [("a", a, "f32", "param"), ("b", b, "compute", "param")],
                    lambda c, a, b: a + b,
                    {"out": "f32", "grad/a": "f32", "grad/b": "compute"},
                    {"out": 1, "grad/a": 1, "grad/b": 1}))
    a = both16(wide(g, (1, 783), -12, 10))
    b = both16(wide(g, (1, 783), -12, 10))
    out.append(case("add_compute", "add",
                    [("a", a, "compute", "param"), ("b", b, "compute", "param")],
                    lambda c, a, b: a + b,
                    {"out": "compute", "grad/a": "compute", "grad/b": "compute"},
                    {"out": 1, "grad/a": 1, "grad/b": 1}))

    # mul: a gated unit's silu(gate) * up (both compute); products into f16's subnormals.
    a = both16(wide(g, (1, 783), -12, 7))
    b = both16(wide(g, (1, 783), -12, 7))
    out.append(case("mul", "mul", [("a", a, "compute", "param"), ("b", b, "compute", "param")],
                    lambda c, a, b: c.mul(a, b),
                    {"out": "compute", "grad/a": "compute", "grad/b": "compute"},
                    {"out": 1, "grad/a": 1, "grad/b": 1}, dy=(-8, 2)))

    # The ops that run in their inputs' dtype, on other formats than a model usually gives
    # them: GELU and SiLU of an f32 value (a norm's output) stay f32; a product of an f32 and a
    # 16-bit value is f32 (promotion) and the 16-bit one's gradient 16-bit; RMS norm of a
    # 16-bit value (an activation) computes in f32, its input's gradient 16-bit; the mean
    # squared error of f32 predictions gives an f32 gradient.
    x = normal(g, (3, 50), 2.0)
    for op in ["gelu", "silu"]:
        out.append(case(f"{op}_of_f32", op, [("x", x, "f32", "param")],
                        (lambda c, x: c.gelu(x)) if op == "gelu" else (lambda c, x: c.silu(x)),
                        {"out": "f32", "grad/x": "f32"}, {"out": 1, "grad/x": 1},
                        scale=gelu_terms if op == "gelu" else silu_terms))
    a, b = normal(g, (3, 50), 2.0), both16(normal(g, (3, 50), 2.0))
    out.append(case("mul_mixed", "mul", [("a", a, "f32", "param"), ("b", b, "compute", "param")],
                    lambda c, a, b: a * b,
                    {"out": "f32", "grad/a": "f32", "grad/b": "compute"},
                    {"out": 1, "grad/a": 1, "grad/b": 1}))
    x, rg = both16(row_scaled(g, (3, 50), -2, 2, offset=1.0)), gains(g, (50,))
    out.append(case("rms_norm_of_compute", "rms_norm", [("x", x, "compute", "param"), ("g", rg, "f32", "param")],
                    lambda cs, x, g_: cs.rms_norm(x, g_, 1e-5),
                    {"out": "f32", "grad/x": "compute", "grad/g": "f32"},
                    {"out": 50, "grad/x": 50, "grad/g": 3}, {"eps": 1e-5}))
    pred, target = normal(g, (3, 50), 2.0), normal(g, (3, 50), 2.0)
    out.append(case("mse_of_f32", "mse", [("pred", pred, "f32", "param"), ("target", target, "f32", "values")],
                    lambda c, p, t: F.mse_loss(p.float(), t),
                    {"out": "f32", "grad/pred": "f32"}, {"out": 150, "grad/pred": 1}))

    # causal attention over q|k|v (a linear's output, compute): 17 tokens, heads of 16 and 32.
    for bsz, t, h, d in [(2, 17, 2, 16), (1, 33, 1, 32)]:
        qkv = both16(normal(g, (bsz, t, 3 * h * d), 1.0))
        qkv[..., : 2 * h * d] *= 2.0  # sharper scores
        out.append(case(f"causal_attention_{t}x{d}", "causal_attention",
                        [("qkv", qkv, "compute", "param")],
                        lambda c, qkv, h=h: attention(c, qkv, h),
                        {"out": "compute", "grad/qkv": "compute"}, {"out": max(t, d), "grad/qkv": max(t, d)},
                        {"heads": h}, inner={"out": "compute", "grad/qkv": "compute"}))

    # causal softmax of scores (compute) times a scale that is not a power of two.
    x = both16(normal(g, (2, 2, 17, 17), 3.0))
    out.append(case("causal_softmax", "causal_softmax", [("x", x, "compute", "param")],
                    lambda c, x: causal_softmax(c, x, 0.3),
                    {"out": "f32", "grad/x": "compute"}, {"out": 17, "grad/x": 17}, {"scale": 0.3},
                    inner={"out": "compute", "grad/x": "compute"}))

    # reshape of an f32 value (the same tensor under another shape).
    x = normal(g, (6, 35), 2.0)
    out.append(case("reshape", "reshape", [("x", x, "f32", "param")],
                    lambda c, x: x.reshape(5, 42), {"out": "f32", "grad/x": "f32"},
                    {"out": 1, "grad/x": 1}, {"shape": [5, 42]}))

    # cross entropy of logits (compute): the corpus's vocabulary of 65 and a row of 783.
    for rows, v in [(9, 65), (3, 783)]:
        logits = both16(normal(g, (rows, v), 3.0))
        tgt = torch.randint(0, v, (rows,), generator=g)
        out.append(case(f"cross_entropy_{rows}x{v}", "cross_entropy",
                        [("logits", logits, "compute", "param"), ("targets", tgt, "ids", "targets")],
                        lambda c, l, t: F.cross_entropy(l.float(), t),
                        {"out": "f32", "grad/logits": "compute"}, {"out": rows * v, "grad/logits": v}))

    # mean squared error of predictions (a linear's output, compute) against f32 targets.
    pred = both16(normal(g, (9, 50), 2.0))
    target = normal(g, (9, 50), 2.0)
    out.append(case("mse", "mse", [("pred", pred, "compute", "param"), ("target", target, "f32", "values")],
                    lambda c, p, t: F.mse_loss(p.float(), t),
                    {"out": "f32", "grad/pred": "compute"}, {"out": 450, "grad/pred": 1}))
    return out


def masks_cases(g):
    """Attention with a bias (after the ops of later_cases), drawn from a generator of its own
    so that the earlier cases stay what they were."""
    out = []
    bsz, t, h, d = 2, 17, 2, 16
    qkv = both16(normal(g, (bsz, t, 3 * h * d), 1.0))
    qkv[..., : 2 * h * d] *= 2.0
    # A bias per head: ALiBi's slopes 1/2 and 1/4 of |i - j|, -inf on every fifth key of head 1
    # (a window), a few large values that take a row over.
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    dist = (i - j).abs().float()
    bias = torch.stack([-0.5 * dist, -0.25 * dist])
    bias[1][(j % 5 == 2).expand(t, t)] = float("-inf")
    bias[0, 3, 7] = 30.0
    out.append(case(f"attention_biased_{t}x{d}", "attention_biased",
                    [("qkv", qkv, "compute", "param"), ("bias", bias, "f32", "values")],
                    lambda c, qkv, m: attention(c, qkv, h, causal=False, bias=m),
                    {"out": "compute", "grad/qkv": "compute"}, {"out": t, "grad/qkv": t},
                    {"heads": h}, inner={"out": "compute", "grad/qkv": "compute"}))
    # A learned bias [t, t] that every sequence and head shares (a relative position bias): its
    # gradient is the softmax's, in f32, summed over them.
    qkv = both16(normal(g, (bsz, t, 3 * h * d), 1.0))
    learned = normal(g, (t, t), 1.0)
    out.append(case(f"attention_learned_bias_{t}x{d}", "attention_biased",
                    [("qkv", qkv, "compute", "param"), ("bias", learned, "f32", "param")],
                    lambda c, qkv, m: attention(c, qkv, h, causal=False, bias=m),
                    {"out": "compute", "grad/qkv": "compute", "grad/bias": "f32"},
                    {"out": t, "grad/qkv": t, "grad/bias": t},
                    {"heads": h}, inner={"out": "compute", "grad/qkv": "compute"}))
    return out


def later_cases(g):
    """The ops added since the first cases (issue #50), drawn from a generator of their own so
    that the first cases' inputs and upstream gradients stay what they were."""
    out = []
    # ReLU, sigmoid and tanh of a linear's output (compute: CUDA computes in f32 and rounds
    # once, its backward reads the rounded output for sigmoid and tanh, as `OutputGrad` writes
    # out); softmax over the last axis (f32
    # class); sum (f32 class) and mean (its input's dtype) over the last axis; a scale by a
    # constant; a subtraction; a transpose, a concatenation and a narrow; batched products of
    # two activations; attention without the causal mask and with a key padding mask; rotary
    # embeddings of an f32 value (Hugging Face's `rotate_half` with its f32 cos and sin).
    x = both16(wide(g, (1, 783), -8, 4, zeros=0.01))
    for op, terms in [("relu", None), ("sigmoid", sigmoid_terms), ("tanh", tanh_terms)]:
        out.append(case(op, op, [("x", x, "compute", "param")],
                        lambda c, x, op=op: unary(c, op, x),
                        {"out": "compute", "grad/x": "compute"}, {"out": 1, "grad/x": 1},
                        scale=terms))
    x = both16(normal(g, (3, 4, 50), 3.0))
    out.append(case("softmax", "softmax", [("x", x, "compute", "param")],
                    lambda c, x: c.softmax(x),
                    {"out": "f32", "grad/x": "compute"}, {"out": 50, "grad/x": 50},
                    dy=(-4, 2)))
    x = normal(g, (3, 4, 50), 2.0, mean=0.5)
    for op in ["sum", "mean"]:
        out.append(case(f"{op}_of_f32", op, [("x", x, "f32", "param")],
                        (lambda c, x: x.sum(-1)) if op == "sum" else (lambda c, x: x.mean(-1)),
                        {"out": "f32", "grad/x": "f32"}, {"out": 50, "grad/x": 1}))
    x = both16(normal(g, (3, 4, 50), 2.0, mean=0.5))
    out.append(case("sum_of_compute", "sum", [("x", x, "compute", "param")],
                    lambda c, x: x.sum(-1) if c.compute is None else x.float().sum(-1),
                    {"out": "f32", "grad/x": "compute"}, {"out": 50, "grad/x": 1}))
    x = both16(wide(g, (3, 50), -10, 8))
    out.append(case("scale", "scale", [("x", x, "compute", "param")],
                    lambda c, x: x * 0.3 if c.compute is None else (x.float() * torch.tensor(0.3)).to(x.dtype),
                    {"out": "compute", "grad/x": "compute"}, {"out": 1, "grad/x": 1}, {"k": 0.3}))
    a, b = normal(g, (3, 50), 3.0), both16(wide(g, (3, 50), -12, 6))
    out.append(case("sub_mixed", "sub", [("a", a, "f32", "param"), ("b", b, "compute", "param")],
                    lambda c, a, b: a - b,
                    {"out": "f32", "grad/a": "f32", "grad/b": "compute"},
                    {"out": 1, "grad/a": 1, "grad/b": 1}))
    x = normal(g, (2, 5, 7), 2.0)
    out.append(case("transpose", "transpose", [("x", x, "f32", "param")],
                    lambda c, x: x.transpose(-2, -1), {"out": "f32", "grad/x": "f32"},
                    {"out": 1, "grad/x": 1}))
    a, b = normal(g, (3, 5), 2.0), normal(g, (3, 7), 2.0)
    out.append(case("concat", "concat", [("a", a, "f32", "param"), ("b", b, "f32", "param")],
                    lambda c, a, b: torch.cat([a, b], -1),
                    {"out": "f32", "grad/a": "f32", "grad/b": "f32"},
                    {"out": 1, "grad/a": 1, "grad/b": 1}))
    x = normal(g, (3, 12), 2.0)
    out.append(case("narrow", "narrow", [("x", x, "f32", "param")],
                    lambda c, x: x.narrow(-1, 4, 5), {"out": "f32", "grad/x": "f32"},
                    {"out": 1, "grad/x": 1}, {"start": 4, "length": 5}))
    for transpose_b in [False, True]:
        a = both16(normal(g, (2, 17, 33), 1.0))
        b = both16(normal(g, (2, 9, 33) if transpose_b else (2, 33, 9), 1.0))
        out.append(case(f"bmm{'_transposed' if transpose_b else ''}", "bmm",
                        [("a", a, "compute", "param"), ("b", b, "compute", "param")],
                        lambda c, a, b, t=transpose_b: c.matmul(a, b.transpose(-2, -1) if t else b),
                        {"out": "compute", "grad/a": "compute", "grad/b": "compute"},
                        {"out": 33, "grad/a": 9, "grad/b": 17}, {"transpose_b": transpose_b}))
    bsz, t, h, d = 2, 17, 2, 16
    qkv = both16(normal(g, (bsz, t, 3 * h * d), 1.0))
    qkv[..., : 2 * h * d] *= 2.0
    out.append(case(f"attention_{t}x{d}", "attention", [("qkv", qkv, "compute", "param")],
                    lambda c, qkv: attention(c, qkv, h, causal=False),
                    {"out": "compute", "grad/qkv": "compute"}, {"out": t, "grad/qkv": t},
                    {"heads": h}, inner={"out": "compute", "grad/qkv": "compute"}))
    mask = torch.zeros(bsz, t)
    mask[0, 11:] = 1.0  # the first sequence's last 6 keys are padding
    mask[1, ::3] = 1.0  # every third key of the second
    out.append(case(f"attention_masked_{t}x{d}", "attention_masked",
                    [("qkv", qkv, "compute", "param"), ("mask", mask, "f32", "values")],
                    lambda c, qkv, m: attention(c, qkv, h, causal=False, keys=m),
                    {"out": "compute", "grad/qkv": "compute"}, {"out": t, "grad/qkv": t},
                    {"heads": h}, inner={"out": "compute", "grad/qkv": "compute"}))
    x = normal(g, (2, 9, 2 * 8), 1.0)
    out.append(case("rotary_of_f32", "rotary", [("x", x, "f32", "param")],
                    lambda c, x: rotary(x, 2, 10000.0), {"out": "f32", "grad/x": "f32"},
                    {"out": 2, "grad/x": 2}, {"heads": 2, "base": 10000.0}))
    # mean of a 16-bit value: in its dtype (autocast lists sum, not mean), summed in f32.
    x = both16(normal(g, (3, 4, 50), 2.0, mean=0.5))
    out.append(case("mean_of_compute", "mean", [("x", x, "compute", "param")],
                    lambda c, x: x.mean(-1) if c.compute is None else x.float().mean(-1).to(x.dtype),
                    {"out": "compute", "grad/x": "compute"}, {"out": 50, "grad/x": 1}))
    return out


class OutputGrad(torch.autograd.Function):
    """f(x) computed in f32 and rounded once to x's dtype, its backward from the rounded output
    y in f32 (`dfdy(y)`), rounded to the gradient's dtype: CUDA's sigmoid and tanh of a 16-bit
    tensor (opmath float, `sigmoid_backward`/`tanh_backward` reading the output)."""

    @staticmethod
    def forward(ctx, x, f, dfdy):
        y = f(x.float()).to(x.dtype)
        ctx.save_for_backward(y)
        ctx.dfdy = dfdy
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return (dy.float() * ctx.dfdy(y.float())).to(dy.dtype), None, None


def unary(c, op, x):
    if op == "relu":
        return torch.relu(x)
    if op == "sigmoid":
        return OutputGrad.apply(x, torch.sigmoid, lambda y: y * (1 - y))
    return OutputGrad.apply(x, torch.tanh, lambda y: 1 - y * y)


def rotary(x, heads, base):
    """Hugging Face's rotary embeddings of x [b, t, heads * d] (rotate_half), cos and sin as
    LlamaRotaryEmbedding computes them in f32."""
    b, t, width = x.shape
    d = width // heads
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(t, dtype=torch.int64).float(), inv_freq)
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
    q = x.view(b, t, heads, d)
    half = torch.cat((-q[..., d // 2:], q[..., : d // 2]), -1)
    return (q * cos + half * sin).reshape(b, t, width)


class _LN:
    """What Casts.layer_norm reads of an nn.LayerNorm."""

    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias
        self.normalized_shape, self.eps = (weight.shape[0],), 1e-5

    def __call__(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def attention(c, qkv, h, causal=True, keys=None, bias=None):
    """torch_step_parity's Block attention: scores and P.v matmul-like, the scaled scores held
    as the scores, the softmax f32 (mixed); without the causal mask where `causal` is false,
    the keys where `keys` [b, t] is nonzero left out, `bias` (f32, broadcast to [b, h, t, t])
    added to the scaled scores (a 16-bit tensor plus an f32 one: f32, as
    scaled_dot_product_attention adds a float attn_mask)."""
    b, t, c3 = qkv.shape
    width = c3 // 3
    q, k, v = qkv.split(width, 2)
    q, k, v = (z.view(b, t, h, width // h).transpose(1, 2) for z in (q, k, v))
    att = c.scale(c.matmul(q, k.transpose(-2, -1)), math.sqrt(width // h))
    if causal:
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    if keys is not None:
        att = att.masked_fill(keys.bool()[:, None, None, :], float("-inf"))
    if bias is not None:
        att = att + bias
    return c.matmul(c.softmax(att), v).transpose(1, 2).reshape(b, t, width)


def causal_softmax(c, x, scale):
    """softmax(scale * x) over row i's columns 0..=i, scale * x held as x (a 16-bit tensor times
    a Python float: CUDA multiplies by the f32 scalar and rounds)."""
    t = x.shape[-1]
    s = torch.tensor(scale, dtype=torch.float32)
    y = x * s if c.compute is None else (x.float() * s).to(x.dtype)
    y = y.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return c.softmax(y)


def representable(x, fmt):
    if fmt == "f32":
        return True
    dt = {"bf16": torch.bfloat16, "f16": torch.float16}[fmt]
    return bool(torch.equal(x.to(dt).float(), x))


def run(cs, preset, dy):
    """The case under `preset`: its output and every parameter input's gradient (f32)."""
    c = casts(preset)
    compute = c.compute or torch.float32
    leaves, args = {}, []
    for name, values, fmt, kind in cs["inputs"]:
        if kind == "param":
            dt = compute if fmt == "compute" else torch.float32
            leaf = values.detach().to(dt, copy=True).requires_grad_()
            leaves[name] = leaf
            args.append(leaf)
        else:
            args.append(values)
    y = cs["fn"](c, *args)
    if dy is None:
        y.backward()
    else:
        assert y.shape == dy.shape, (cs["name"], y.shape, dy.shape)
        y.backward(dy.to(y.dtype))
    got = {"out": y.detach().float() if y.dim() else y.detach().float().reshape(1)}
    for name, leaf in leaves.items():
        got[f"grad/{name}"] = leaf.grad.float()
    # What the fixture says PyTorch holds each tensor in, checked against the values.
    held = {}
    for key, value in got.items():
        fmt = NAMES[compute] if cs["held"][key] == "compute" else "f32"
        assert representable(value, fmt), f"{cs['name']} {preset} {key}: not {fmt}"
        held[key] = fmt
    return got, held


# ---- whole models ----
#
# Two models written with the builder's ops, the same functions of the same parameters (the
# engine's names and layouts: a linear's w is [in, out]) as tests/op_parity.rs builds them: a
# small language model (token and position embeddings, two pre-norm blocks of RMS norm, causal
# attention and a SwiGLU MLP, linear layers with biases, a final RMS norm and a head tied to the
# token embedding; cross entropy) and a regression MLP (linear, GELU, RMS norm, linear, SiLU,
# linear; mean squared error). Each is drawn with biases and gains perturbed by N(0, 0.1^2) and
# trained in f32 (40 steps of AdamW at lr 3e-3 on batches of its own); from that state,
# per preset: the gradient of every parameter on batch 0 at loss scale 1, and 10 steps of the
# engine's recipe (ModelTrainer's defaults: AdamW lr 1e-3, betas (0.9, 0.99), eps 1e-8, weight
# decay 0.1 on the parameters declared with it, no clipping; GradScaler's defaults at 16-mixed).

LM = dict(vocab=None, context=32, batch=8, width=32, heads=2, blocks=2, hidden=64, eps=1e-6)
MLP = dict(rows=64, inputs=8, hidden=32, outputs=4, eps=1e-6)


def lm_params(g):
    """(name, shape, decay, std or the constant) in declaration order."""
    c, h, v, t = LM["width"], LM["hidden"], LM["vocab"], LM["context"]
    out = [("wte", (v, c), True, 0.02), ("wpe", (t, c), True, 0.02)]
    for i in range(LM["blocks"]):
        out += [(f"h{i}.attn_norm", (c,), False, 1.0),
                (f"h{i}.qkv.w", (c, 3 * c), True, 0.02), (f"h{i}.qkv.b", (3 * c,), False, 0.0),
                (f"h{i}.out.w", (c, c), True, 0.02), (f"h{i}.out.b", (c,), False, 0.0),
                (f"h{i}.mlp_norm", (c,), False, 1.0),
                (f"h{i}.gate.w", (c, h), True, 0.02), (f"h{i}.gate.b", (h,), False, 0.0),
                (f"h{i}.up.w", (c, h), True, 0.02), (f"h{i}.up.b", (h,), False, 0.0),
                (f"h{i}.down.w", (h, c), True, 0.02), (f"h{i}.down.b", (c,), False, 0.0)]
    return out + [("norm", (c,), False, 1.0)]


def mlp_params(g):
    i, h, o = MLP["inputs"], MLP["hidden"], MLP["outputs"]
    return [("fc0.w", (i, h), True, (2 / i) ** 0.5), ("fc0.b", (h,), False, 0.0),
            ("norm", (h,), False, 1.0),
            ("fc1.w", (h, h), True, (2 / h) ** 0.5), ("fc1.b", (h,), False, 0.0),
            ("fc2.w", (h, o), True, (2 / h) ** 0.5), ("fc2.b", (o,), False, 0.0)]


def draw(spec, g):
    """Initial values: N(0, std^2) for matrices; gains 1 and biases 0, each plus N(0, 0.1^2)
    (the state pretraining starts from is not a fresh one either)."""
    return {n: (torch.randn(s, generator=g) * std if len(s) == 2
                else torch.full(s, std) + 0.1 * torch.randn(s, generator=g))
            for n, s, _, std in spec}


def lm_loss(c, p, batch):
    """The language model's mean cross entropy on batch [B, T + 1] of ids."""
    b, t1 = batch.shape
    t, heads, eps = t1 - 1, LM["heads"], LM["eps"]
    tokens, targets = batch[:, :t], batch[:, 1:]
    x = F.embedding(tokens, p["wte"]) + F.embedding(torch.arange(t).expand(b, t), p["wpe"])
    for i in range(LM["blocks"]):
        q = lambda n: p[f"h{i}.{n}"]  # noqa: E731
        h = c.rms_norm(x, q("attn_norm"), eps)
        y = attention(c, c.linear(h, q("qkv.w").t(), q("qkv.b")), heads)
        x = x + c.linear(y, q("out.w").t(), q("out.b"))
        h = c.rms_norm(x, q("mlp_norm"), eps)
        gated = c.silu(c.linear(h, q("gate.w").t(), q("gate.b")))
        m = c.mul(gated, c.linear(h, q("up.w").t(), q("up.b")))
        x = x + c.linear(m, q("down.w").t(), q("down.b"))
    logits = c.matmul(c.rms_norm(x, p["norm"], eps), p["wte"].t())
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mlp_loss(c, p, batch):
    """The MLP's mean squared error on batch (x [N, inputs], y [N, outputs])."""
    x, y = batch
    h = c.gelu(c.linear(x, p["fc0.w"].t(), p["fc0.b"]))
    h = c.rms_norm(h, p["norm"], MLP["eps"])
    h = c.silu(c.linear(h, p["fc1.w"].t(), p["fc1.b"]))
    pred = c.linear(h, p["fc2.w"].t(), p["fc2.b"])
    return F.mse_loss(pred.float(), y)


def corpus_ids(root):
    """The corpus's first 200,000 characters as ids of its sorted characters, and how many
    there are."""
    text = open(os.path.join(root, "data", "shakespeare.txt")).read()
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    return torch.tensor([stoi[ch] for ch in text[:200_000]], dtype=torch.long), len(chars)


def lm_batches(g, n, ids):
    t = LM["context"] + 1
    starts = torch.randint(len(ids) - t, (n, LM["batch"]), generator=g)
    return [torch.stack([ids[s:s + t] for s in row]) for row in starts]


def mlp_batches(g, n):
    a = torch.randn(MLP["inputs"], MLP["outputs"], generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(MLP["rows"], MLP["inputs"], generator=g)
        y = 2 * torch.tanh(x @ a) + 0.5 + 0.1 * torch.randn(MLP["rows"], MLP["outputs"], generator=g)
        out.append((x, y))
    return out


def optimizer(spec, p, lr):
    decay = {n for n, _, d, _ in spec if d}
    groups = [{"params": [p[n] for n, *_ in spec if n in decay], "weight_decay": 0.1},
              {"params": [p[n] for n, *_ in spec if n not in decay], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99), eps=1e-8)


def leaves(init):
    return {n: v.detach().clone().requires_grad_() for n, v in init.items()}


def pretrain(spec, loss_fn, init, batches):
    """40 steps at 32-true, lr 3e-3: the trained state the runs start from."""
    p = leaves(init)
    opt = optimizer(spec, p, 3e-3)
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss_fn(NONE_CASTS, p, batch).backward()
        opt.step()
    return {n: v.detach().clone() for n, v in p.items()}


NONE_CASTS = OpCasts()


def model_run(spec, loss_fn, init, batches, preset, steps=10):
    """Step 1's gradients at loss scale 1, then `steps` steps of the recipe under `preset`."""
    c = casts(preset)
    p = leaves(init)
    loss = loss_fn(c, p, batches[0])
    loss.backward()
    grads = {n: v.grad.detach().clone() for n, v in p.items()}
    first = loss.item()
    p = leaves(init)
    opt = optimizer(spec, p, 1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=(preset == "16-mixed"))
    losses, scales = [], []
    for batch in batches[:steps]:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(c, p, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        if scaler.is_enabled():
            scales.append(scaler.get_scale())
    assert losses[0] == first, (losses[0], first)
    return grads, losses, scales or None


def noise(spec, loss_fn, init, runs, preset, draws=16, relative=1e-7):
    """How far PyTorch's own losses move from its run when every weight is perturbed by a
    relative N(0, relative^2) (rounding noise: 1e-7 is about two f32 units), the largest over
    `draws` draws: at step 1, and over all steps. Below this no run can be told apart from
    PyTorch's by its losses; the test holds the engine to the issue's bounds or twice this,
    whichever is larger."""
    base = model_run(spec, loss_fn, init, runs, preset)[1]
    first, most = 0.0, 0.0
    for k in range(draws):
        g = torch.Generator().manual_seed(7000 + k)
        moved = {n: v * (1 + relative * torch.randn(v.shape, generator=g)) for n, v in init.items()}
        d = [abs(a - b) for a, b in zip(model_run(spec, loss_fn, moved, runs, preset)[1], base)]
        first, most = max(first, d[0]), max(most, max(d))
    return {"step1": first, "steps": most, "draws": draws, "relative": relative}


def models(root, tensors):
    """The whole-model fixtures: tensors into `tensors`, and the manifest's entries."""
    g = torch.Generator().manual_seed(1053)
    ids, LM["vocab"] = corpus_ids(root)
    entries = {}
    for name, spec, loss_fn, batches in [
            ("lm", lm_params(g), lm_loss, lambda n: lm_batches(g, n, ids)),
            ("mlp", mlp_params(g), mlp_loss, lambda n: mlp_batches(g, n))]:
        init = pretrain(spec, loss_fn, draw(spec, g), batches(40))
        runs = batches(10)
        for n, v in init.items():
            tensors[f"{name}/init/{n}"] = v.clone().contiguous()
        for k, batch in enumerate(runs):
            if name == "lm":
                tensors[f"{name}/batch/{k}"] = batch.float().contiguous()
            else:
                tensors[f"{name}/batch/{k}/x"] = batch[0].clone().contiguous()
                tensors[f"{name}/batch/{k}/y"] = batch[1].clone().contiguous()
        entry = {"params": [{"name": n, "shape": list(s), "decay": d} for n, s, d, _ in spec],
                 "config": LM if name == "lm" else MLP, "presets": {}}
        for preset in PRESETS:
            grads, losses, scales = model_run(spec, loss_fn, init, runs, preset)
            for n, v in grads.items():
                tensors[f"{name}/{preset}/grad/{n}"] = v.clone().contiguous()
            spread = noise(spec, loss_fn, init, runs, preset)
            entry["presets"][preset] = {"losses": losses, "loss_scales": scales, "noise": spread}
            print(f"{name:4s} {preset:10s} loss {losses[0]:.6f} -> {losses[-1]:.6f}, noise "
                  f"{spread['step1']:.1e} at step 1, {spread['steps']:.1e} over the steps", flush=True)
        biases = max(init[n].abs().max().item() for n, *_ in spec if n.endswith(".b"))
        print(f"{name:4s} trained state: largest |bias| {biases:.3f}", flush=True)
        entries[name] = entry
    return entries


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(root, "tests", "data"))
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    tensors = {}
    entries = models(root, tensors)
    path = os.path.join(a.out, "model_parity.safetensors")
    save_file(tensors, path, metadata={"torch": torch.__version__})
    with open(os.path.join(a.out, "model_parity.json"), "w") as f:
        json.dump({"torch": torch.__version__, "autocast": "CUDA's op lists as casts",
                   "models": entries}, f, indent=1)
    total = sum(t.numel() for t in tensors.values())
    print(f"wrote {path}: {total} values ({os.path.getsize(path) / 1e6:.2f} MB)", file=sys.stderr)
    g = torch.Generator().manual_seed(53)
    tensors, manifest = {}, []
    for cs in (cases(g) + later_cases(torch.Generator().manual_seed(50))
               + masks_cases(torch.Generator().manual_seed(51))):
        name = cs["name"]
        is_loss = cs["op"] in ("cross_entropy", "mse")
        dy = None
        entry = {"name": name, "op": cs["op"], "attrs": cs["attrs"], "inputs": [], "presets": {}}
        for iname, values, fmt, kind in cs["inputs"]:
            tensors[f"{name}/in/{iname}"] = values.float().clone().contiguous()
            entry["inputs"].append({"name": iname, "shape": list(values.shape), "format": fmt,
                                    "kind": kind})
        if not is_loss:
            probe = cs["fn"](casts("32-true"), *[v for _, v, _, _ in cs["inputs"]])
            dy = both16(wide(g, tuple(probe.shape), *cs["dy"], zeros=0.0))
            tensors[f"{name}/dy"] = dy.clone().contiguous()
            entry["output_shape"] = list(probe.shape)
        scaled = []
        if cs["scale"]:
            for key, value in cs["scale"](cs["inputs"][0][1], dy).items():
                tensors[f"{name}/scale/{key}"] = value.float().clone().contiguous()
                scaled.append(key)
        for preset in PRESETS:
            got, held = run(cs, preset, dy)
            for key, value in got.items():
                tensors[f"{name}/{preset}/{key}"] = value.clone().contiguous()
            inner = {k: (NAMES[DTYPES[preset]] if preset in DTYPES else "f32") for k in cs["inner"]}
            entry["presets"][preset] = {
                k: {"held": held[k], "inner": inner.get(k, "f32"), "sum": cs["sums"][k],
                    "scale": k in scaled} for k in got
            }
        manifest.append(entry)
        print(f"{name:28s} " + "  ".join(
            f"{p}: out {tensors[f'{name}/{p}/out'].reshape(-1)[:1].item():+.6e}" for p in PRESETS), flush=True)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "op_parity.safetensors")
    save_file(tensors, path, metadata={"torch": torch.__version__})
    with open(os.path.join(a.out, "op_parity.json"), "w") as f:
        json.dump({"torch": torch.__version__, "autocast": "CUDA's op lists as casts",
                   "presets": PRESETS, "cases": manifest}, f, indent=1)
    total = sum(t.numel() for t in tensors.values())
    print(f"wrote {path}: {len(manifest)} cases, {total} values ({os.path.getsize(path) / 1e6:.2f} MB)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
