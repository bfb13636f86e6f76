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

import json
import os
from typing import Any, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

from . import _native

__all__ = [
    "ContractError",
    "amax_scale",
    "cast",
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


class ContractError(RuntimeError):
    """A result outside the numerics contract of its algorithm (``check=True``)."""


# The numpy dtype of each format's codes: its own float dtype where numpy or ml_dtypes has one;
# tf32 has none and is returned as float32 values already rounded to tf32.
_DTYPES = {
    "f32": np.dtype(np.float32),
    "tf32": np.dtype(np.float32),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f16": np.dtype(np.float16),
    "e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
_CODES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _as_array(x: Any) -> np.ndarray:
    """Any array-like as a numpy array (DLPack first, then the buffer protocol / sequences)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError):
            pass  # a device tensor numpy cannot read: fall back to its own conversion
    return np.asarray(x)


def _f32(x: Any, what: str) -> np.ndarray:
    a = _as_array(x)
    if a.dtype.kind not in "fiub" and a.dtype not in _DTYPES.values():
        raise ValueError(f"{what}: expected a float array, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _format_name(fmt: str) -> str:
    return json.loads(_native.finfo_json(fmt))["name"]


def devices() -> dict:
    """What ``mantissa info`` shows, as data: the reference, CUDA (or why not), every wgpu
    adapter with its features, and the backend ``"auto"`` picks."""
    return json.loads(_native.devices_json())


def finfo(name: str) -> dict:
    """The limits of a format (bits, eps, max, smallest normal and subnormal, ...), as
    ``torch.finfo`` reports them."""
    return json.loads(_native.finfo_json(name))


def cast(x: Any, fmt: str, saturate: bool = False) -> np.ndarray:
    """Rounds ``x`` to format ``fmt`` (f32, tf32, bf16, f16, e4m3, e5m2; torch's names too),
    returning an array of the format's own dtype (ml_dtypes.bfloat16, float8_e4m3fn,
    float8_e5m2, numpy float16; float32 for f32 and tf32). ``saturate`` clamps overflow to the
    largest finite value instead of the format's own rule (inf, or NaN for e4m3)."""
    a = _f32(x, "cast")
    name = _format_name(fmt)
    codes = _native.encode(a.tobytes(), name, bool(saturate))
    return np.frombuffer(codes, dtype=_DTYPES[name]).reshape(a.shape).copy()


def decode(codes: Any, fmt: str) -> np.ndarray:
    """float32 values of ``codes`` in format ``fmt``: an array of the format's dtype, or raw
    unsigned integer codes of its width."""
    name = _format_name(fmt)
    width = finfo(name)["storage_bytes"]
    c = _as_array(codes)
    if c.dtype.itemsize != width:
        raise ValueError(f"{name} codes are {width} bytes each; got dtype {c.dtype}")
    c = np.ascontiguousarray(c).view(_CODES[width])
    out = _native.decode(c.astype("<u%d" % width).tobytes(), name)
    return np.frombuffer(out, dtype=np.float32).reshape(c.shape).copy()


def split(x: Any) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The bf16 split x = h + m + l of split-bf16 algorithms: three bfloat16 arrays."""
    a = _f32(x, "split")
    planes = _native.split(a.tobytes())
    return tuple(
        np.frombuffer(p, dtype=ml_dtypes.bfloat16).reshape(a.shape).copy() for p in planes
    )


def amax_scale(x: Any, fmt: str, mode: str = "tensorwise") -> Tuple[np.ndarray, np.ndarray]:
    """fp8 scaling of ``x`` for format ``fmt``: (amax, scale) as float32 arrays, one element
    (``tensorwise``) or one per row of a 2-d ``x`` (``rowwise``); scale maps amax onto the
    format's largest finite value (x * scale is what is quantized)."""
    a = _f32(x, "amax_scale")
    if mode == "rowwise" and a.ndim != 2:
        raise ValueError(f"rowwise scaling needs a 2-d array, got shape {a.shape}")
    rows, cols = (a.shape if a.ndim == 2 else (1, a.size))
    amax, scale = _native.amax_scale(a.tobytes(), rows, cols, _format_name(fmt), mode)
    return np.asarray(amax, dtype=np.float32), np.asarray(scale, dtype=np.float32)


def matmul(
    a: Any,
    b: Any,
    algorithm: str = "f32",
    backend: str = "auto",
    scales: Optional[Tuple[float, float]] = None,
    check: bool = False,
) -> np.ndarray:
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
    out = np.frombuffer(c, dtype=np.float32).reshape(batch, m, n).copy()
    if broken:
        raise ContractError(broken)
    return out if batched else out[0]


def _scales(scales: Any) -> Tuple[float, float]:
    """``scales=(sa, sb)``: two finite positive numbers."""
    try:
        sa, sb = scales
        pair = (float(sa), float(sb))
    except (TypeError, ValueError):
        raise ValueError(f"scales must be a pair of numbers (sa, sb), got {scales!r}") from None
    if not all(np.isfinite(v) and v > 0 for v in pair):
        raise ValueError(f"scales {pair} must be finite and positive")
    return pair


def _size(v: Any, what: str) -> int:
    """A size: a whole number >= 0 (ValueError otherwise, negative ones included)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{what}: {v!r} is not a whole number")
    if v < 0:
        raise ValueError(f"{what}: {v} is negative")
    return int(v)


def report(
    backends: Sequence[str] = ("reference", "wgpu"),
    sizes: Sequence[Tuple[int, int, int]] = ((256, 256, 256),),
    train_steps: int = 0,
    corpus: Optional[str] = None,
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
    return json.loads(
        _native.report_json(
            names, shapes, _size(train_steps, "train_steps"), _size(seed, "seed"), 3, corpus
        )
    )


def train(
    config: str = "tiny",
    precision: Sequence[str] = ("32-true",),
    steps: int = 100,
    backend: str = "auto",
    corpus: Optional[str] = None,
    seed: int = 1337,
    lr: float = 1e-3,
    adam_eps: float = 1e-8,
    init: Optional[str] = None,
    batches: Optional[str] = None,
) -> dict:
    """Trains the char-level GPT (``tiny`` or ``small``) under each precision preset, as
    ``mantissa train`` does; returns ``{preset: {"losses": [...], "loss_scales": [...] or None,
    "skipped": [steps], "stopped": None or why, "backend": ..., "matmul_algorithm": ...}}``.
    ``corpus``: a text file (by default the ``MANTISSA_CORPUS`` environment variable, else
    ``data/shakespeare.txt``). ``init``: start from these weights (safetensors, the engine's
    checkpoint names or the PyTorch anchor's state_dict names, as ``mantissa train --init``);
    ``batches``: train on these batches in order (an integer ``.npy`` [steps, B, T+1], as
    ``--batches``). The losses, scales and skipped steps compare one to one with those of
    ``scripts/anchors/torch_step_parity.py``."""
    if isinstance(precision, str):
        precision = [precision]
    path = corpus or os.environ.get("MANTISSA_CORPUS", "data/shakespeare.txt")
    return json.loads(
        _native.train_json(
            path, config, list(precision), _size(steps, "steps"), backend, _size(seed, "seed"),
            float(lr), float(adam_eps), init, batches,
        )
    )


def export_init(
    path: str,
    config: str = "tiny",
    seed: int = 1337,
    corpus: Optional[str] = None,
    init: Optional[str] = None,
) -> None:
    """Writes the initial weights a ``train`` run of ``config`` and ``seed`` starts from (or
    those of ``init``) to ``path`` under the PyTorch anchor's state_dict names and layouts, which
    ``model.load_state_dict(safetensors.torch.load_file(path))`` loads (as ``mantissa train
    --export-init``)."""
    path_corpus = corpus or os.environ.get("MANTISSA_CORPUS", "data/shakespeare.txt")
    _native.export_init(path, path_corpus, config, int(seed), init)
