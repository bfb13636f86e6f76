"""The model builder, its trainer and the precision comparison (``mantissa.ModelBuilder``,
``mantissa.ModelTrainer``, ``mantissa.compare``) over the engine's (``_native``).

The builder checks every op as it is added (the engine's own checks, a ``ValueError`` naming
the op) and keeps the calls, so that one description builds as many models as are asked of it:
a trainer finishes a fresh copy, and ``compare`` trains one per preset and backend.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import os
import ml_dtypes
import numpy as np

from . import _native
from ._arrays import as_array

# Float dtypes a values input or a parameter may come in (converted to float32 once).
_FLOATS = (np.dtype(ml_dtypes.bfloat16),)


def _floats(x: Any, what: str, shape: Tuple[int, ...]) -> np.ndarray:
    """``x`` as contiguous float32 of exactly ``shape``: the shape and dtype checked first."""
    a = as_array(x)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
    if a.dtype.kind != "f" and a.dtype not in _FLOATS:
        raise ValueError(f"{what}: expected a float array, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32)


def _ids(x: Any, what: str, shape: Optional[Tuple[int, ...]]) -> bytes:
    """Integer ids of ``shape`` as uint32 bytes (b"" where the model reads none)."""
    if x is None:
        return b""
    if shape is None:
        raise ValueError(f"{what}: the model reads no {what}; none may be given")
    a = as_array(x)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{what}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
    if a.dtype.kind not in "iu":
        raise ValueError(f"{what}: expected integer ids, got dtype {a.dtype}")
    if a.size and (a.min() < 0 or a.max() > 2**32 - 1):
        raise ValueError(f"{what}: ids must lie in 0..2^32-1, got {a.min()}..{a.max()}")
    return np.ascontiguousarray(a, dtype="<u4").tobytes()


def _shape(op: str, shape: Any) -> List[int]:
    """A shape: a sequence of whole numbers >= 0 (ValueError naming ``op`` otherwise)."""
    try:
        dims = list(shape)
    except TypeError:
        raise ValueError(f"{op}: shape {shape!r} is not a sequence of sizes") from None
    for d in dims:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or d < 0:
            raise ValueError(f"{op}: shape {shape!r} must hold whole numbers >= 0")
    return [int(d) for d in dims]


def _count(op: str, what: str, n: Any) -> int:
    """A whole number >= 0 (ValueError naming ``op`` and ``what`` otherwise)."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"{op}: {what} {n!r} must be a whole number >= 0")
    return int(n)


class Var:
    """A value of a model being built (a parameter, an input or an op's output); only the
    builder that made it takes it. ``shape`` is its shape as ops read it."""

    __slots__ = ("_builder", "_index", "shape")

    def __init__(self, builder: "ModelBuilder", index: int, shape: Sequence[int]):
        self._builder, self._index, self.shape = builder, index, tuple(shape)

    def __repr__(self) -> str:
        return f"Var(shape={self.shape})"


class ModelBuilder:
    """Records a model: parameters (name, shape, initialisation, weight decay), inputs and a
    forward pass of ops ending in one loss (``cross_entropy`` or ``mse``). Each op is checked
    as it is added: a misused op raises ``ValueError`` naming it and the shapes. The builder is
    a description: ``ModelTrainer(builder)`` trains a model made from it, as often as asked.

    >>> b = mantissa.ModelBuilder()
    >>> x, y = b.values([64, 2]), b.values([64, 1])
    >>> w = b.param("fc.weight", [1, 2], transpose=True)   # torch.nn.Linear's [out, in]
    >>> pred = b.linear(x, w, b.param("fc.bias", [1], init="zeros", decay=False))
    >>> loss = b.mse(pred, y)
    """

    def __init__(self) -> None:
        self._native = _native.ModelBuilder()
        self._calls: List[Tuple[str, tuple]] = []  # replayed by _build
        self._vars: List[Any] = []  # the native values, by index
        # name -> (index, declared shape, transposed), in declaration order
        self._params: Dict[str, Tuple[int, Tuple[int, ...], bool]] = {}
        self._tokens: Optional[Tuple[int, ...]] = None
        self._targets: Optional[Tuple[int, ...]] = None
        self._values: List[Tuple[int, ...]] = []
        self._loss: Optional[Var] = None
        self._outputs: Tuple[int, ...] = ()

    # -- recording --

    def _arg(self, op: str, v: Any) -> Any:
        if isinstance(v, Var):
            if v._builder is not self:
                raise ValueError(f"{op}: reads a value of another ModelBuilder")
            return ("var", v._index)
        if isinstance(v, (list, tuple)) and v and all(isinstance(x, Var) for x in v):
            return ("vars", tuple(self._arg(op, x)[1] for x in v))
        return v

    def _call(self, op: str, *args: Any) -> Var:
        recorded = tuple(self._arg(op, a) for a in args)
        native = getattr(self._native, op)(*(_resolve(a, self._vars) for a in recorded))
        self._calls.append((op, recorded))
        self._vars.append(native)
        return Var(self, len(self._vars) - 1, native.shape)

    def _vars_of(self, op: str, **vs: Any) -> None:
        for name, v in vs.items():
            if not isinstance(v, Var):
                raise ValueError(f"{op}: {name} must be a Var made by this builder, got {type(v).__name__}")

    def _build(self) -> Tuple[Any, List[Any]]:
        """A fresh native builder holding the recorded model, and its values by index."""
        native, vars_ = _native.ModelBuilder(), []
        for op, args in self._calls:
            vars_.append(getattr(native, op)(*(_resolve(a, vars_) for a in args)))
        return native, vars_

    # -- parameters and inputs --

    def param(
        self,
        name: str,
        shape: Sequence[int],
        init: str = "normal",
        std: float = 0.02,
        decay: bool = True,
        transpose: bool = False,
    ) -> Var:
        """Declares parameter ``name`` (unique, not empty: state dicts and errors use it) of
        ``shape``, starting as ``init``: "zeros", "ones" or "normal" (N(0, std^2), drawn from
        the trainer's seed). ``decay``: AdamW's weight decay applies to it. ``transpose=True``
        (2-d only) keeps it as declared, e.g. ``torch.nn.Linear``'s weight ``[out, in]``, while
        ops read its transpose (``linear`` takes ``[in, out]``); state dicts, ``params`` and
        ``gradients`` give it as declared."""
        if not isinstance(name, str):
            raise ValueError(f"param: name {name!r} is not a string")
        dims = _shape(f"param {name}", shape)
        if transpose and len(dims) != 2:
            raise ValueError(f"param {name}: transpose=True needs a 2-d shape, got {tuple(dims)}")
        v = self._call("param", name, dims[::-1] if transpose else dims, str(init), float(std), bool(decay))
        self._params[name] = (v._index, tuple(dims), bool(transpose))
        return v

    def parameter(self, name: str) -> Var:
        """The parameter declared as ``name`` (ValueError naming the declared ones otherwise)."""
        if name not in self._params:
            raise ValueError(f"parameter {name}: not declared (declared: {', '.join(self._params)})")
        i, _, _ = self._params[name]
        return Var(self, i, self._vars[i].shape)

    def tokens(self, shape: Sequence[int]) -> Var:
        """The batch's token ids (one such input per model): ``tokens=`` of a step."""
        v = self._call("tokens", _shape("tokens", shape))
        self._tokens = v.shape
        return v

    def targets(self, shape: Sequence[int]) -> Var:
        """The batch's class ids, a cross entropy's targets (one per model): ``targets=``."""
        v = self._call("targets", _shape("targets", shape))
        self._targets = v.shape
        return v

    def values(self, shape: Sequence[int]) -> Var:
        """float32 values each step is given (features, regression targets): the step's
        positional arrays, in the order the inputs are declared."""
        v = self._call("values", _shape("values", shape))
        self._values.append(v.shape)
        return v

    def constant_ids(self, shape: Sequence[int], ids: Any) -> Var:
        """Ids fixed when the model is built (e.g. each token's position), for ``embedding``."""
        a = as_array(ids)
        if a.dtype.kind not in "iu" or (a.size and (a.min() < 0 or a.max() > 2**32 - 1)):
            raise ValueError(f"constant_ids: ids must be integers in 0..2^32-1, got dtype {a.dtype}")
        return self._call("constant_ids", _shape("constant_ids", shape), [int(i) for i in a.reshape(-1)])

    # -- ops --

    def embedding(self, table: Var, ids: Var) -> Var:
        """Rows of ``table`` [rows, c] picked by ``ids`` (tokens or constant ids): ids' shape + [c]."""
        self._vars_of("embedding", table=table, ids=ids)
        return self._call("embedding", table, ids)

    def linear(self, x: Var, w: Var, b: Var) -> Var:
        """x [..., k] . w [k, m] + b [m] (fp8 where the preset says so). A weight declared
        ``transpose=True`` as [m, k] (torch.nn.Linear's) is read as [k, m]."""
        self._vars_of("linear", x=x, w=w, b=b)
        return self._call("linear", x, w, b)

    def matmul(self, x: Var, w: Var, transpose_w: bool = False) -> Var:
        """x [..., k] . w [k, m] (or w [m, k] transposed where ``transpose_w``), in the step's
        matmul algorithm, never fp8 (e.g. a head tied to an embedding table)."""
        self._vars_of("matmul", x=x, w=w)
        return self._call("matmul", x, w, bool(transpose_w))

    def bmm(self, a: Var, b: Var, transpose_b: bool = False) -> Var:
        """The matrix products of two values' last two axes (``torch.matmul`` of two
        activations, no broadcasting): a [..., m, k] . b [..., k, n] (b [..., n, k] used
        transposed where ``transpose_b``), in the step's matmul algorithm."""
        self._vars_of("bmm", a=a, b=b)
        return self._call("bmm", a, b, bool(transpose_b))

    def transpose(self, x: Var) -> Var:
        """x [..., r, c] with its last two axes swapped (``x.transpose(-2, -1)``)."""
        self._vars_of("transpose", x=x)
        return self._call("transpose", x)

    def concat(self, xs: Sequence[Var]) -> Var:
        """The values side by side along the last axis (``torch.cat(xs, -1)``)."""
        xs = list(xs)
        self._vars_of("concat", **{f"xs[{i}]": x for i, x in enumerate(xs)})
        if not xs:
            raise ValueError("concat: takes one value or more, got none")
        return self._call("concat", xs)

    def narrow(self, x: Var, start: int, length: int) -> Var:
        """Columns ``[start, start + length)`` of x's last axis (``x.narrow(-1, start, length)``)."""
        self._vars_of("narrow", x=x)
        return self._call("narrow", x, _count("narrow", "start", start), _count("narrow", "length", length))

    def split(self, x: Var, widths: Sequence[int]) -> List[Var]:
        """x cut along its last axis into parts ``widths`` wide, in order (``torch.split(x,
        widths, -1)``); the widths must sum to x's last axis."""
        self._vars_of("split", x=x)
        widths = [_count("split", "widths", w) for w in widths]
        if not widths or 0 in widths or sum(widths) != x.shape[-1]:
            raise ValueError(
                f"split: widths {widths} of x {list(x.shape)}: one part or more, each one column "
                "or more, summing to its last axis")
        starts = [sum(widths[:i]) for i in range(len(widths))]
        return [self.narrow(x, s, w) for s, w in zip(starts, widths)]

    def layer_norm(self, x: Var, g: Var, b: Var) -> Var:
        """Layer norm of x [..., c] over its last axis with gain g and bias b [c] (eps 1e-5)."""
        self._vars_of("layer_norm", x=x, g=g, b=b)
        return self._call("layer_norm", x, g, b)

    def rms_norm(self, x: Var, g: Var, eps: float = 1e-6) -> Var:
        """RMS norm of x [..., c] with gain g [c]: x / sqrt(mean(x^2) + eps) * g (torch.nn.RMSNorm)."""
        self._vars_of("rms_norm", x=x, g=g)
        return self._call("rms_norm", x, g, float(eps))

    def unary(self, f: str, x: Var) -> Var:
        """f(x) of every element, f one of "gelu" (tanh form), "silu", "relu", "sigmoid", "tanh"
        (the unary family: held in x's format, computed in f32); an unknown name raises
        ValueError listing the valid ones."""
        self._vars_of(str(f), x=x)
        return self._call("unary", str(f), x)

    def gelu(self, x: Var) -> Var:
        """GELU, tanh form (``torch.nn.GELU(approximate="tanh")``), of every element."""
        return self.unary("gelu", x)

    def silu(self, x: Var) -> Var:
        """SiLU (x * sigmoid(x)) of every element."""
        return self.unary("silu", x)

    def relu(self, x: Var) -> Var:
        """ReLU of every element (``torch.relu``: 0 below zero, a NaN kept)."""
        return self.unary("relu", x)

    def sigmoid(self, x: Var) -> Var:
        """The logistic sigmoid of every element."""
        return self.unary("sigmoid", x)

    def tanh(self, x: Var) -> Var:
        """tanh of every element."""
        return self.unary("tanh", x)

    def add(self, a: Var, b: Var) -> Var:
        """a + b, of the same shape (a residual connection, two embeddings)."""
        self._vars_of("add", a=a, b=b)
        return self._call("add", a, b)

    def mul(self, a: Var, b: Var) -> Var:
        """a * b elementwise, of the same shape (a gated unit's product)."""
        self._vars_of("mul", a=a, b=b)
        return self._call("mul", a, b)

    def attention(self, qkv: Var, heads: int) -> Var:
        """Self-attention without a mask (an encoder's: every token sees every token) of q|k|v
        [batch, tokens, 3 x width] over ``heads`` heads: [batch, tokens, width]."""
        self._vars_of("attention", qkv=qkv)
        return self._call("attention", qkv, _count("attention", "heads", heads))

    def attention_masked(self, qkv: Var, heads: int, key_mask: Var) -> Var:
        """``attention`` leaving out padded keys: ``key_mask`` is a values input [batch,
        tokens], nonzero where the key is padding (``key_padding_mask`` of PyTorch's
        ``MultiheadAttention``). A query that sees no key gets 0 (PyTorch's is NaN)."""
        self._vars_of("attention_masked", qkv=qkv, key_mask=key_mask)
        heads = _count("attention_masked", "heads", heads)
        return self._call("attention_masked", qkv, heads, key_mask)

    def causal_attention_masked(self, qkv: Var, heads: int, key_mask: Var) -> Var:
        """``causal_attention`` leaving out padded keys (``key_mask`` as ``attention_masked``'s)."""
        self._vars_of("causal_attention_masked", qkv=qkv, key_mask=key_mask)
        heads = _count("causal_attention_masked", "heads", heads)
        return self._call("causal_attention_masked", qkv, heads, key_mask)

    def attention_biased(self, qkv: Var, heads: int, bias: Var) -> Var:
        """``attention`` with ``bias`` added to the scaled scores before the softmax (a float
        ``attn_mask`` of ``scaled_dot_product_attention``) of [tokens, tokens], [heads, tokens,
        tokens], [batch, tokens, tokens] or [batch, heads, tokens, tokens]: a values input,
        whose -inf leaves a key out (a query that sees no key gets 0; PyTorch's is NaN), or a
        parameter or an op's output, which gets a gradient (a learned position bias)."""
        self._vars_of("attention_biased", qkv=qkv, bias=bias)
        heads = _count("attention_biased", "heads", heads)
        return self._call("attention_biased", qkv, heads, bias)

    def causal_attention_biased(self, qkv: Var, heads: int, bias: Var) -> Var:
        """``causal_attention`` with ``bias`` added to the scores (as ``attention_biased``'s)."""
        self._vars_of("causal_attention_biased", qkv=qkv, bias=bias)
        heads = _count("causal_attention_biased", "heads", heads)
        return self._call("causal_attention_biased", qkv, heads, bias)

    def causal_attention(self, qkv: Var, heads: int) -> Var:
        """Causal self-attention of q|k|v [b, t, 3c] over ``heads`` heads of c / heads: [b, t, c]."""
        self._vars_of("causal_attention", qkv=qkv)
        if isinstance(heads, bool) or not isinstance(heads, (int, np.integer)) or heads < 0:
            raise ValueError(f"causal_attention: heads {heads!r} is not a whole number")
        return self._call("causal_attention", qkv, int(heads))

    def rotary(self, x: Var, heads: int, base: float = 10000.0) -> Var:
        """Rotary position embeddings of x [batch, tokens, heads x d] (q or k): in each head,
        values i and i + d/2 rotated by the angle p base^(-2i/d) at position p (Hugging
        Face's ``rotate_half`` layout), held in x's format; d must be even."""
        self._vars_of("rotary", x=x)
        return self._call("rotary", x, _count("rotary", "heads", heads), float(base))

    def dropout(self, x: Var, p: float) -> Var:
        """Dropout in training (``torch.nn.functional.dropout``): each element kept with
        probability 1 - p and scaled by 1 / (1 - p). The masks come from a counter-based
        generator keyed by the trainer's seed, the step and the dropout's place: the same bits
        on every backend (not PyTorch's masks). A trainer in ``eval()`` mode passes x through."""
        self._vars_of("dropout", x=x)
        return self._call("dropout", x, float(p))

    def sum(self, x: Var) -> Var:
        """The sum over the last axis (``x.sum(-1)``, in f32 as autocast runs it)."""
        self._vars_of("sum", x=x)
        return self._call("sum", x)

    def mean(self, x: Var) -> Var:
        """The mean over the last axis (``x.mean(-1)``: the sum divided by its length)."""
        self._vars_of("mean", x=x)
        return self._call("mean", x)

    def scale(self, x: Var, k: float) -> Var:
        """x times the constant k (``x * k``), held in x's format."""
        self._vars_of("scale", x=x)
        return self._call("scale", x, float(k))

    def sub(self, a: Var, b: Var) -> Var:
        """a - b, of the same shape."""
        self._vars_of("sub", a=a, b=b)
        return self._call("sub", a, b)

    def softmax(self, x: Var) -> Var:
        """Softmax over the last axis (``torch.softmax(x, -1)``, in f32 as autocast runs it)."""
        self._vars_of("softmax", x=x)
        return self._call("softmax", x)

    def causal_softmax(self, x: Var, scale: float) -> Var:
        """Causal softmax of ``scale * x`` over the last axis of square [..., t, t] scores."""
        self._vars_of("causal_softmax", x=x)
        return self._call("causal_softmax", x, float(scale))

    def reshape(self, x: Var, shape: Sequence[int]) -> Var:
        """x with another shape of as many elements (no copy)."""
        self._vars_of("reshape", x=x)
        return self._call("reshape", x, _shape("reshape", shape))

    def cross_entropy(self, logits: Var, targets: Var) -> Var:
        """The mean cross entropy of logits [..., v] against the targets input (the logits'
        shape without its last axis): the model's scalar loss."""
        self._vars_of("cross_entropy", logits=logits, targets=targets)
        return self._finish_with(self._call("cross_entropy", logits, targets), logits)

    def mse(self, pred: Var, target: Var) -> Var:
        """The mean over every element of (pred - target)^2 (``torch.nn.functional.mse_loss``):
        the model's scalar loss; ``target`` (a values input) takes no gradient."""
        self._vars_of("mse", pred=pred, target=target)
        return self._finish_with(self._call("mse", pred, target), pred)

    def _finish_with(self, loss: Var, outputs: Var) -> Var:
        self._loss, self._outputs = loss, outputs.shape
        return loss


def _resolve(a: Any, vars_: List[Any]) -> Any:
    """A recorded argument as the native builder takes it: a value ("var", i) or a list of
    them ("vars", (i, ...)) by index into `vars_`, anything else as it is."""
    if isinstance(a, tuple) and len(a) == 2 and a[0] == "var":
        return vars_[a[1]]
    if isinstance(a, tuple) and len(a) == 2 and a[0] == "vars":
        return [vars_[i] for i in a[1]]
    return a


class Stepped(NamedTuple):
    """What one training step did."""

    loss: float
    """The batch's mean loss, before the update."""
    skipped: bool
    """A gradient was inf or NaN: nothing was updated (GradScaler backs its scale off)."""
    grad_norm: float
    """The global norm of the unscaled gradients."""


class ModelTrainer:
    """A model built by ``builder`` trained on ``backend`` under precision ``preset``
    (32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, fp8 presets), with AdamW (``lr``,
    ``betas``, ``eps``, ``weight_decay`` on parameters declared with ``decay``; nanoGPT's
    settings by default), global-norm clipping (``grad_clip``, 0: off), GradScaler where the
    preset scales its loss. Parameters start from their ``init`` drawn from ``seed``; copy other
    weights in with ``load_state_dict``.

    A step takes the batch as the model reads it: the values inputs as positional float arrays
    (in declaration order), ``tokens=`` and ``targets=`` as integer arrays, each of its declared
    shape. numpy in (or anything with ``__dlpack__``), numpy out; the GIL is released while the
    engine runs. Bad input raises ``ValueError`` naming it, memory the host or device lacks
    ``MemoryError``, a device failure ``RuntimeError``.

    ``micro_batches=N`` accumulates gradients: the model is built on one micro-batch (the
    builder's shapes), and a step takes N of them one after another along the first axis (the
    arrays' first dimension N times the declared one), their gradients summed on the device
    before the one update: the step of the whole batch up to the order of additions."""

    def __init__(
        self,
        builder: ModelBuilder,
        loss: Optional[Var] = None,
        preset: str = "32-true",
        backend: str = "auto",
        seed: int = 0,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        grad_clip: float = 0.0,
        matmul_precision: str = "highest",
        fused_attention: Optional[bool] = None,
        micro_batches: int = 1,
    ) -> None:
        if not isinstance(builder, ModelBuilder):
            raise ValueError(f"ModelTrainer: expected a ModelBuilder, got {type(builder).__name__}")
        loss = loss if loss is not None else builder._loss
        if loss is None:
            raise ValueError("ModelTrainer: the builder has no loss (cross_entropy or mse)")
        if not isinstance(loss, Var) or loss._builder is not builder:
            raise ValueError("ModelTrainer: loss must be a Var of this builder")
        try:
            b1, b2 = (float(b) for b in betas)
        except (TypeError, ValueError):
            raise ValueError(f"ModelTrainer: betas {betas!r} is not a pair of numbers") from None
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
            raise ValueError(f"ModelTrainer: seed {seed!r} is not a whole number in 0..2^64-1")
        n = _count("ModelTrainer", "micro_batches", micro_batches)
        if n < 1:
            raise ValueError("ModelTrainer: micro_batches 0: a step runs its batch in at least one")
        native, vars_ = builder._build()
        self._t = _native.ModelTrainer(
            native, vars_[loss._index], str(preset), str(backend), int(seed), float(lr), (b1, b2),
            float(eps), float(weight_decay), float(grad_clip), str(matmul_precision), fused_attention,
            n,
        )
        self._params = dict(builder._params)  # name -> (index, declared shape, transposed)
        # A batch is `n` micro-batches along the first axis.
        whole = lambda shape: None if shape is None else (shape[0] * n, *shape[1:])  # noqa: E731
        self._tokens, self._targets = whole(builder._tokens), whole(builder._targets)
        self._values = [whole(v) for v in builder._values]
        self._outputs = builder._outputs
        self._reads_tokens, self._reads_targets = self._t.reads()

    # -- what it is --

    @property
    def preset(self) -> str:
        """The precision preset it trains under."""
        return self._t.preset

    @property
    def backend(self) -> str:
        """The backend it runs on."""
        return self._t.backend

    @property
    def matmul_algorithm(self) -> str:
        """The matmul algorithm the preset decided on this backend."""
        return self._t.matmul_algorithm

    @property
    def loss_scale(self) -> Optional[float]:
        """GradScaler's current loss scale (None where the preset does not scale its loss)."""
        return self._t.loss_scale

    @property
    def applied(self) -> int:
        """Optimizer steps applied so far (skipped ones not counted)."""
        return self._t.applied

    @property
    def steps(self) -> int:
        """Steps run so far (skipped ones counted)."""
        return self._t.steps

    @property
    def training(self) -> bool:
        """Whether dropout applies (``train()``) or passes its input through (``eval()``)."""
        return self._t.training

    def train(self, mode: bool = True) -> "ModelTrainer":
        """Training mode for the runs that follow (``torch.nn.Module.train``): dropout
        applies; ``mode=False`` is ``eval()``. Returns the trainer."""
        if not isinstance(mode, (bool, np.bool_)):
            raise ValueError(f"train: mode {mode!r} is not a bool")
        self._t.training = bool(mode)
        return self

    def eval(self) -> "ModelTrainer":
        """Evaluation mode for the runs that follow (``torch.nn.Module.eval``): dropout passes
        its input through, in ``loss``, ``gradients``, ``outputs`` and ``step`` alike."""
        return self.train(False)

    def save_checkpoint(self, path) -> None:
        """Writes a checkpoint of the run to ``path`` (safetensors, atomically): parameters,
        AdamW's moments, the step counts, the loss scale. ``load_checkpoint`` resumes it."""
        self._t.save_checkpoint(os.fspath(path))

    def load_checkpoint(self, path) -> None:
        """Resumes the run from a checkpoint of this model under this preset: the steps that
        follow are those of the run that wrote it, to the bit. Another model's checkpoint is
        refused with the names that differ."""
        self._t.load_checkpoint(os.fspath(path))

    def save_params(self, path) -> None:
        """Writes the parameters to ``path`` as safetensors under their names (float32), what
        ``load_params`` and ``safetensors.numpy.load_file`` read."""
        self._t.save_params(os.fspath(path))

    def load_params(self, path) -> None:
        """Sets the parameters by name from a safetensors file: tensors named as the
        parameters (float32 or float64, each of its parameter's shape), or a checkpoint of this
        model. A file of another model is refused with the names that differ; nothing is
        written then."""
        self._t.load_params(os.fspath(path))

    @property
    def param_names(self) -> List[str]:
        """The parameters' names, in declaration order."""
        return list(self._params)

    # -- batches --

    def set_values(self, k: int, values: Any) -> None:
        """Writes values input ``k`` (declaration order) for the runs that follow."""
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < len(self._values):
            raise ValueError(f"set_values: input {k!r}: the model has {len(self._values)} values inputs")
        a = _floats(values, f"values input {k}", self._values[k])
        self._t.set_values(int(k), a.tobytes())

    def _batch(self, values: Sequence[Any], tokens: Any, targets: Any) -> Tuple[bytes, bytes]:
        if values and len(values) != len(self._values):
            raise ValueError(
                f"the model has {len(self._values)} values inputs; {len(values)} arrays were given"
            )
        # Everything checked before anything is written.
        arrays = [_floats(v, f"values input {k}", self._values[k]) for k, v in enumerate(values)]
        ids = _ids(tokens, "tokens", self._tokens if self._reads_tokens else None)
        tgt = _ids(targets, "targets", self._targets if self._reads_targets else None)
        for k, a in enumerate(arrays):
            self._t.set_values(k, a.tobytes())
        return ids, tgt

    # -- running --

    def step(self, *values: Any, tokens: Any = None, targets: Any = None) -> Stepped:
        """One training step on a batch: forward, backward, (unscale and check,) the AdamW
        update where every gradient is finite."""
        ids, tgt = self._batch(values, tokens, targets)
        return Stepped(*self._t.step(ids, tgt))

    def loss(self, *values: Any, tokens: Any = None, targets: Any = None) -> float:
        """The batch's mean loss under the current parameters (nothing updated)."""
        ids, tgt = self._batch(values, tokens, targets)
        return self._t.loss(ids, tgt)

    def gradients(
        self, *values: Any, tokens: Any = None, targets: Any = None
    ) -> Tuple[float, Dict[str, np.ndarray]]:
        """The batch's mean loss and the gradient of each parameter (loss scale 1, nothing
        updated), by name, each shaped as declared."""
        ids, tgt = self._batch(values, tokens, targets)
        loss, grads = self._t.gradients(ids, tgt)
        return loss, dict(zip(self._params, (self._out(n, g) for n, g in zip(self._params, grads))))

    def outputs(self) -> np.ndarray:
        """What the loss read in the last forward pass (its logits or predictions), float32."""
        return np.frombuffer(self._t.outputs(), dtype=np.float32).reshape(self._outputs).copy()

    # -- parameters --

    def _out(self, name: str, raw: bytes) -> np.ndarray:
        _, shape, transposed = self._params[name]
        a = np.frombuffer(raw, dtype=np.float32)
        return (a.reshape(shape[::-1]).T if transposed else a.reshape(shape)).copy()

    def params(self) -> List[np.ndarray]:
        """The parameters' current values (float32, each shaped as declared), in declaration
        order."""
        return [self._out(n, p) for n, p in zip(self._params, self._t.params())]

    def set_params(self, params: Sequence[Any]) -> None:
        """Sets every parameter (declaration order, each of its declared shape, float, finite),
        held as the preset holds weights. All are checked before any is written."""
        params = list(params)
        if len(params) != len(self._params):
            raise ValueError(f"set_params: the model has {len(self._params)} parameters, got {len(params)}")
        raw = []
        for (name, (_, shape, transposed)), p in zip(self._params.items(), params):
            a = _floats(p, f"parameter {name}", shape)
            raw.append(np.ascontiguousarray(a.T if transposed else a).tobytes())
        self._t.set_params(raw)

    def state_dict(self) -> Dict[str, np.ndarray]:
        """The parameters by name (as declared: PyTorch's names and layouts where the model was
        declared with them), float32 numpy arrays."""
        return dict(zip(self._params, self.params()))

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Sets every parameter from ``state`` (name -> array: numpy, or torch tensors through
        DLPack), e.g. ``{k: v.detach().numpy() for k, v in module.state_dict().items()}``. Names
        missing from ``state`` or unknown to the model, shapes other than declared and non-float
        arrays raise ``ValueError`` naming them; nothing is written then."""
        if not hasattr(state, "keys"):
            raise ValueError(f"load_state_dict: expected a mapping of names to arrays, got {type(state).__name__}")
        missing = [n for n in self._params if n not in state]
        unexpected = [str(n) for n in state.keys() if n not in self._params]
        if missing or unexpected:
            raise ValueError(
                "load_state_dict: "
                + "; ".join(
                    part for part in (
                        f"missing {', '.join(missing)}" if missing else "",
                        f"unexpected {', '.join(unexpected)}" if unexpected else "",
                    ) if part
                )
            )
        self.set_params([state[n] for n in self._params])


# -- the precision comparison --


class Comparison:
    """Per-step losses of one model trained from the same weights on the same batches under
    several presets and backends. ``losses``: label ("PRESET@BACKEND") -> float64 array;
    ``baseline``: the first label; ``differences``: label -> |loss - baseline's| per step;
    ``largest``: label -> the largest of those; ``skipped``: label -> skipped steps (1-based);
    ``str()`` prints them side by side."""

    def __init__(
        self,
        losses: Dict[str, np.ndarray],
        skipped: Dict[str, List[int]],
        unavailable: Optional[Dict[str, str]] = None,
    ):
        self.losses = losses
        self.skipped = skipped
        # Runs whose backend this machine cannot open: label -> why (not compared).
        self.unavailable = dict(unavailable or {})
        self.baseline = next(iter(losses))
        base = losses[self.baseline]
        self.differences = {k: np.abs(v - base) for k, v in losses.items()}
        self.largest = {k: float(d.max()) if d.size else 0.0 for k, d in self.differences.items()}

    def to_dict(self) -> dict:
        """Plain lists and floats (JSON-ready)."""
        return {
            "baseline": self.baseline,
            "losses": {k: v.tolist() for k, v in self.losses.items()},
            "differences": {k: v.tolist() for k, v in self.differences.items()},
            "largest": dict(self.largest),
            "skipped": dict(self.skipped),
            "unavailable": dict(self.unavailable),
        }

    def __str__(self) -> str:
        labels = list(self.losses)
        width = max(12, *(len(k) for k in labels))
        head = "step " + " ".join(f"{k:>{width}}" for k in labels)
        rows = [head]
        steps = len(self.losses[self.baseline])
        shown = range(steps) if steps <= 20 else sorted({*range(5), *range(steps - 5, steps),
                                                         *range(0, steps, max(1, steps // 10))})
        for i in shown:
            rows.append(f"{i + 1:4d} " + " ".join(f"{self.losses[k][i]:>{width}.7f}" for k in labels))
        rows.append("max  " + " ".join(f"{self.largest[k]:>{width}.2e}" for k in labels))
        rows.append(f"(max: largest |loss - {self.baseline}| over {steps} steps)")
        rows.extend(f"{k}: skipped, {why}" for k, why in self.unavailable.items())
        return "\n".join(rows)

    def __repr__(self) -> str:
        return f"Comparison(baseline={self.baseline!r}, largest={self.largest!r})"


Batch = Union[Dict[str, Any], Sequence[Any]]


def _unpack(batch: Batch) -> Tuple[Sequence[Any], Any, Any]:
    """A batch: a dict {"values": [...], "tokens": ..., "targets": ...} or a sequence of the
    values inputs' arrays."""
    if isinstance(batch, dict):
        unknown = set(batch) - {"values", "tokens", "targets"}
        if unknown:
            raise ValueError(f"compare: a batch's keys are values, tokens and targets, not {sorted(unknown)}")
        return list(batch.get("values", ())), batch.get("tokens"), batch.get("targets")
    if isinstance(batch, (list, tuple)):
        return list(batch), None, None
    return [batch], None, None


def compare(
    model: Union[ModelBuilder, Callable[[], ModelBuilder]],
    batches: Sequence[Batch],
    presets: Sequence[str] = ("32-true", "bf16-mixed"),
    backends: Sequence[str] = ("reference",),
    steps: Optional[int] = None,
    init: Optional[Dict[str, Any]] = None,
    seed: int = 0,
    **trainer: Any,
) -> Comparison:
    """Trains ``model`` (a ModelBuilder, or a function returning one) for ``steps`` steps
    (default: one per batch; batches are reused in order where fewer) under every preset on
    every backend, each run from the same weights (``init``, a state dict; else the seeded
    initial weights, as 32-true holds them) on the same batches, and returns the per-step
    losses side by side with their largest differences from the first run (``Comparison``).
    ``trainer``: further ``ModelTrainer`` settings (lr, betas, weight_decay, grad_clip, ...).
    A backend this machine cannot open is skipped, its reason in ``Comparison.unavailable``;
    ``BackendUnavailable`` where no run can open its backend."""
    if isinstance(presets, str):
        presets = [presets]
    if isinstance(backends, str):
        backends = [backends]
    if not presets or not backends:
        raise ValueError("compare: presets and backends must each name at least one")
    batches = list(batches)
    if not batches:
        raise ValueError("compare: no batches given")
    n = len(batches) if steps is None else steps
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"compare: steps {steps!r} is not a whole number >= 1")
    runs = [(p, b) for b in backends for p in presets]
    labels = [f"{p}@{b}" for p, b in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"compare: a preset and backend named twice in {labels}")
    losses: Dict[str, np.ndarray] = {}
    skipped: Dict[str, List[int]] = {}
    unavailable: Dict[str, str] = {}
    start = None if init is None else dict(init)
    for (preset, backend), label in zip(runs, labels):
        builder = model() if callable(model) and not isinstance(model, ModelBuilder) else model
        try:
            t = ModelTrainer(builder, preset=preset, backend=backend, seed=seed, **trainer)
        except _native.BackendUnavailable as e:
            # A backend this machine lacks is skipped with its reason, as the test suites do.
            unavailable[label] = str(e)
            continue
        if start is None:
            # One starting point for every run: the first's weights (f32 unless a "true"
            # preset rounded them).
            start = t.state_dict()
        t.load_state_dict(start)
        got, skip = [], []
        for i in range(int(n)):
            values, tokens, targets = _unpack(batches[i % len(batches)])
            s = t.step(*values, tokens=tokens, targets=targets)
            got.append(s.loss)
            if s.skipped:
                skip.append(i + 1)
        losses[label], skipped[label] = np.asarray(got, dtype=np.float64), skip
    if not losses:
        raise _native.BackendUnavailable(
            "compare: no run could open its backend: "
            + "; ".join(f"{k}: {why}" for k, why in unavailable.items())
        )
    return Comparison(losses, skipped, unavailable)
