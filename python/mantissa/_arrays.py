"""Array conversion shared by the package's modules (not public)."""

from __future__ import annotations

from typing import Any

import numpy as np


def as_array(x: Any) -> np.ndarray:
    """Any array-like as a numpy array (DLPack first, then the buffer protocol / sequences)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError):
            pass  # a device tensor numpy cannot read: fall back to its own conversion
    return np.asarray(x)
