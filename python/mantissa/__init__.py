"""mantissa: precision-controlled math that computes the same function on every GPU.

numpy in, numpy out. Any array-like is accepted: numpy arrays, objects exporting DLPack
(``__dlpack__``: PyTorch and JAX tensors on the host) or the buffer protocol, nested lists.

>>> import numpy as np, mantissa
>>> a = np.random.randn(256, 512).astype(np.float32)
>>> b = np.random.randn(512, 128).astype(np.float32)
>>> c = mantissa.matmul(a, b, algorithm="bf16x3", check=True)   # raises on a contract break

Errors: ``ValueError`` for bad input (shapes, dtypes, names, negative sizes), ``MemoryError``
where the host (or a device) has no memory for what was asked, ``RuntimeError`` for other
failures of the machine (no device, device faults); a result outside the numerics contract
raises ``ContractError`` (a ``RuntimeError``). Messages are the command-line tool's own lines.
"""

from __future__ import annotations

# Imported under private names: dir(mantissa) lists the public API only (__all__).
import json as _json
import os as _os
import tempfile as _tempfile
from pathlib import Path as _Path
from typing import Any as _Any
from typing import Optional as _Optional
from typing import Sequence as _Sequence
from typing import Tuple as _Tuple

import ml_dtypes as _ml_dtypes
import numpy as _np

from . import _native
from ._arrays import as_array as _as_array
from ._model import Comparison, ModelBuilder, ModelTrainer, Stepped, Var, compare

__all__ = [
    "BackendUnavailable",
    "Comparison",
    "ContractError",
    "ModelBuilder",
    "ModelTrainer",
    "Stepped",
    "Var",
    "amax_scale",
    "cast",
    "compare",
    "corpus_path",
    "decode",
    "devices",
    "export_init",
    "finfo",
    "matmul",
    "report",
    "split",
    "train",
]

__version__: str = _native.__version__

BackendUnavailable = _native.BackendUnavailable


class ContractError(RuntimeError):
    """A result outside the numerics contract of its algorithm (``check=True``)."""


# The numpy dtype of each format's codes: its own float dtype where numpy or ml_dtypes has one;
# tf32 has none and is returned as float32 values already rounded to tf32.
_DTYPES = {
    "f32": _np.dtype(_np.float32),
    "tf32": _np.dtype(_np.float32),
    "bf16": _np.dtype(_ml_dtypes.bfloat16),
    "f16": _np.dtype(_np.float16),
    "e4m3": _np.dtype(_ml_dtypes.float8_e4m3fn),
    "e5m2": _np.dtype(_ml_dtypes.float8_e5m2),
}
_CODES = {1: _np.uint8, 2: _np.uint16, 4: _np.uint32}


def _f32(x: _Any, what: str) -> _np.ndarray:
    a = _as_array(x)
    if a.dtype.kind not in "fiub" and a.dtype not in _DTYPES.values():
        raise ValueError(f"{what}: expected a float array, got dtype {a.dtype}")
    return _np.ascontiguousarray(a, dtype=_np.float32)


def _format_name(fmt: str) -> str:
    return _json.loads(_native.finfo_json(fmt))["name"]


def devices() -> dict:
    """What ``mantissa info`` shows, as data: the reference, CUDA (or why not), every wgpu
    adapter with its features, and the backend ``"auto"`` picks."""
    return _json.loads(_native.devices_json())


def finfo(name: str) -> dict:
    """The limits of a format (bits, eps, max, smallest normal and subnormal, ...), as
    ``torch.finfo`` reports them."""
    return _json.loads(_native.finfo_json(name))


def cast(x: _Any, fmt: str, saturate: bool = False) -> _np.ndarray:
    """Rounds ``x`` to format ``fmt`` (f32, tf32, bf16, f16, e4m3, e5m2; torch's names too),
    returning an array of the format's own dtype (_ml_dtypes.bfloat16, float8_e4m3fn,
    float8_e5m2, numpy float16; float32 for f32 and tf32). ``saturate`` clamps overflow to the
    largest finite value instead of the format's own rule (inf, or NaN for e4m3)."""
    a = _f32(x, "cast")
    name = _format_name(fmt)
    codes = _native.encode(a.tobytes(), name, bool(saturate))
    return _np.frombuffer(codes, dtype=_DTYPES[name]).reshape(a.shape).copy()


def decode(codes: _Any, fmt: str) -> _np.ndarray:
    """float32 values of ``codes`` in format ``fmt``: an array of the format's dtype, or raw
    unsigned integer codes of its width."""
    name = _format_name(fmt)
    width = finfo(name)["storage_bytes"]
    c = _as_array(codes)
    if c.dtype.itemsize != width:
        raise ValueError(f"{name} codes are {width} bytes each; got dtype {c.dtype}")
    c = _np.ascontiguousarray(c).view(_CODES[width])
    out = _native.decode(c.astype("<u%d" % width).tobytes(), name)
    return _np.frombuffer(out, dtype=_np.float32).reshape(c.shape).copy()


def split(x: _Any) -> _Tuple[_np.ndarray, _np.ndarray, _np.ndarray]:
    """The bf16 split x = h + m + l of split-bf16 algorithms: three bfloat16 arrays."""
    a = _f32(x, "split")
    planes = _native.split(a.tobytes())
    return tuple(
        _np.frombuffer(p, dtype=_ml_dtypes.bfloat16).reshape(a.shape).copy() for p in planes
    )


def amax_scale(x: _Any, fmt: str, mode: str = "tensorwise") -> _Tuple[_np.ndarray, _np.ndarray]:
    """fp8 scaling of ``x`` for format ``fmt``: (amax, scale) as float32 arrays, one element
    (``tensorwise``) or one per row of a 2-d ``x`` (``rowwise``); scale maps amax onto the
    format's largest finite value (x * scale is what is quantized)."""
    a = _f32(x, "amax_scale")
    if mode == "rowwise" and a.ndim != 2:
        raise ValueError(f"rowwise scaling needs a 2-d array, got shape {a.shape}")
    rows, cols = (a.shape if a.ndim == 2 else (1, a.size))
    amax, scale = _native.amax_scale(a.tobytes(), rows, cols, _format_name(fmt), mode)
    return _np.asarray(amax, dtype=_np.float32), _np.asarray(scale, dtype=_np.float32)


def matmul(
    a: _Any,
    b: _Any,
    algorithm: str = "f32",
    backend: str = "auto",
    scales: _Optional[_Tuple[float, float]] = None,
    check: bool = False,
) -> _np.ndarray:
    """``a @ b`` under a named algorithm (f32, tf32, bf16, f16, bf16x3, bf16x6, bf16x9, e4m3,
    e5m2, e4m3-e5m2, e5m2-e4m3; fp8 may add ``:rowwise``) on ``backend`` (auto, reference,
    wgpu, cuda), float32 out. 2-d (m, k) @ (k, n), or batched (B, m, k) @ (B, k, n). Any float
    dtype in (converted to float32 once, after the shapes are checked). ``scales=(sa, sb)``
    gives fp8 scales (finite, positive). ``check=True`` compares with the host reference's
    result of the same algorithm and raises ``ContractError`` on any element outside its
    tolerance, or a whole product outside its band (docs/design.md, "Tolerances"). A product
    the host has no memory for raises ``MemoryError``."""
    # Shapes first, before any copy of the data.
    x, y = _as_array(a), _as_array(b)
    if x.ndim != y.ndim or x.ndim not in (2, 3):
        raise ValueError(
            f"matmul takes two 2-d or two 3-d (batched) arrays, got shapes {x.shape} and {y.shape}"
        )
    batched = x.ndim == 3
    if not batched:
        x, y = x[None], y[None]
    if x.shape[0] != y.shape[0] or x.shape[2] != y.shape[1]:
        raise ValueError(f"matmul shapes do not match: {x.shape} and {y.shape}")
    batch, m, k = x.shape
    n = y.shape[2]
    if scales is not None:
        scales = _scales(scales)
    x, y = _f32(x, "a"), _f32(y, "b")
    c, broken = _native.matmul(
        x.tobytes(), y.tobytes(), batch, m, k, n, algorithm, backend, scales, bool(check)
    )
    out = _np.frombuffer(c, dtype=_np.float32).reshape(batch, m, n).copy()
    if broken:
        raise ContractError(broken)
    return out if batched else out[0]


def _scales(scales: _Any) -> _Tuple[float, float]:
    """``scales=(sa, sb)``: two finite positive numbers."""
    try:
        sa, sb = scales
        pair = (float(sa), float(sb))
    except (TypeError, ValueError):
        raise ValueError(f"scales must be a pair of numbers (sa, sb), got {scales!r}") from None
    if not all(_np.isfinite(v) and v > 0 for v in pair):
        raise ValueError(f"scales {pair} must be finite and positive")
    return pair


def _size(v: _Any, what: str) -> int:
    """A size: a whole number >= 0 (ValueError otherwise, negative ones included)."""
    if isinstance(v, (bool, _np.bool_)) or not isinstance(v, (int, _np.integer)):
        raise ValueError(f"{what}: {v!r} is not a whole number")
    if v < 0:
        raise ValueError(f"{what}: {v} is negative")
    return int(v)


def report(
    backends: _Sequence[str] = ("reference", "wgpu"),
    sizes: _Sequence[_Tuple[int, int, int]] = ((256, 256, 256),),
    train_steps: int = 0,
    corpus: _Optional[str] = None,
    seed: int = 1,
) -> dict:
    """The portability report (``mantissa report``) as a dict: per backend, algorithm, input
    family and size, the errors against an f64 product and the contract verdict, cast checks,
    timings, and (``train_steps`` > 0, with a ``corpus`` text file) short training curves."""
    names = ",".join(backends) if not isinstance(backends, str) else backends
    shapes = []
    for s in sizes:
        dims = tuple(_size(v, "sizes") for v in s)
        if len(dims) != 3:
            raise ValueError(f"sizes: {s!r} is not (m, n, k)")
        shapes.append(dims)
    return _json.loads(
        _native.report_json(
            names, shapes, _size(train_steps, "train_steps"), _size(seed, "seed"), 3, corpus
        )
    )


def train(
    config: str = "tiny",
    precision: _Sequence[str] = ("32-true",),
    steps: int = 100,
    backend: str = "auto",
    corpus: _Optional[str] = None,
    seed: int = 1337,
    lr: float = 1e-3,
    adam_eps: float = 1e-8,
    init: _Optional[str] = None,
    batches: _Optional[str] = None,
    text: _Optional[str] = None,
    grad_accum: int = 1,
) -> dict:
    """Trains the char-level GPT (``tiny`` or ``small``) under each precision preset, as
    ``mantissa train`` does; returns ``{preset: {"losses": [...], "loss_scales": [...] or None,
    "skipped": [steps], "stopped": None or why, "backend": ..., "matmul_algorithm": ...}}``.
    ``corpus``: a text file (by default ``corpus_path()``: the ``MANTISSA_CORPUS`` environment
    variable, else the Shakespeare corpus the package ships); ``text``: the corpus as a string
    instead. ``init``: start from these weights (safetensors, the engine's
    checkpoint names or the PyTorch anchor's state_dict names, as ``mantissa train --init``);
    ``batches``: train on these batches in order (an integer ``.npy`` [steps, B, T+1], as
    ``--batches``). ``grad_accum``: each step's batch run in this many micro-batches, their
    gradients summed on the device before the one update (``--grad-accum``; it must divide the
    batch). The losses, scales and skipped steps compare one to one with those of
    ``scripts/anchors/torch_step_parity.py``."""
    if isinstance(precision, str):
        precision = [precision]
    if text is not None and corpus is not None:
        raise ValueError("train: give corpus (a path) or text, not both")
    if text is None:
        return _train(corpus or corpus_path(), config, precision, steps, backend, seed, lr,
                      adam_eps, init, batches, grad_accum)
    # The engine reads its corpus from a file (its size checked before it is read).
    with _tempfile.TemporaryDirectory() as tmp:
        path = _os.path.join(tmp, "corpus.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(str(text))
        return _train(path, config, precision, steps, backend, seed, lr, adam_eps, init, batches,
                      grad_accum)


def _train(path, config, precision, steps, backend, seed, lr, adam_eps, init, batches,
           grad_accum) -> dict:
    return _json.loads(
        _native.train_json(
            path, config, list(precision), _size(steps, "steps"), backend, _size(seed, "seed"),
            float(lr), float(adam_eps), init, batches, _size(grad_accum, "grad_accum"),
        )
    )


def corpus_path() -> str:
    """The default corpus of ``train`` and ``export_init``: the ``MANTISSA_CORPUS``
    environment variable, else the Shakespeare text shipped in the package (1.1 MB), which
    works from any directory."""
    return _os.environ.get("MANTISSA_CORPUS") or str(_Path(__file__).parent / "data" / "shakespeare.txt")


def export_init(
    path: str,
    config: str = "tiny",
    seed: int = 1337,
    corpus: _Optional[str] = None,
    init: _Optional[str] = None,
) -> None:
    """Writes the initial weights a ``train`` run of ``config`` and ``seed`` starts from (or
    those of ``init``) to ``path`` under the PyTorch anchor's state_dict names and layouts, which
    ``model.load_state_dict(safetensors.torch.load_file(path))`` loads (as ``mantissa train
    --export-init``)."""
    path_corpus = corpus or corpus_path()
    _native.export_init(path, path_corpus, config, int(seed), init)


# `from __future__ import annotations` binds this name; it is no part of the API.
del annotations
