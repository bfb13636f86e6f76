"""Type stubs of the native layer: arrays cross as little-endian bytes, results as JSON."""

from typing import List, Optional, Sequence, Tuple

__version__: str

def devices_json() -> str: ...
def finfo_json(name: str) -> str: ...
def encode(data: bytes, fmt: str, saturate: bool) -> bytes: ...
def decode(codes: bytes, fmt: str) -> bytes: ...
def split(data: bytes) -> Tuple[bytes, bytes, bytes]: ...
def amax_scale(
    data: bytes, rows: int, cols: int, fmt: str, mode: str
) -> Tuple[List[float], List[float]]: ...
def matmul(
    a: bytes,
    b: bytes,
    batch: int,
    m: int,
    k: int,
    n: int,
    algorithm: str,
    backend: str,
    scales: Optional[Tuple[float, float]] = None,
    check: bool = False,
) -> Tuple[bytes, Optional[str]]: ...
def report_json(
    backends: str,
    sizes: Sequence[Tuple[int, int, int]],
    train_steps: int = 0,
    seed: int = 1,
    repetitions: int = 3,
    corpus: Optional[str] = None,
) -> str: ...
def train_json(
    corpus: str,
    config: str,
    precision: List[str],
    steps: int,
    backend: str,
    seed: int = 1337,
    lr: float = 1e-3,
    adam_eps: float = 1e-8,
    init: Optional[str] = None,
    batches: Optional[str] = None,
) -> str: ...
def export_init(
    path: str, corpus: str, config: str, seed: int = 1337, init: Optional[str] = None
) -> None: ...
