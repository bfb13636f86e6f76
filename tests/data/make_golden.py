"""Golden cast vectors from ml_dtypes (the semantics of JAX and of PyTorch's .to(dtype)).

Writes tests/data/golden_casts.bin: u32 count N, then N f32 inputs, then for each of bf16,
f16, e4m3fn, e5m2 the N codes (u16 for the 16-bit formats, u8 for fp8), little endian.
The inputs: every boundary neighbourhood of every format plus random bit patterns.
Run: python3 -m pip install ml_dtypes numpy && python3 tests/data/make_golden.py
"""
import pathlib
import numpy as np
import ml_dtypes

rng = np.random.default_rng(20261122)
edges = []
for dt in [ml_dtypes.bfloat16, np.float16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]:
    fi = ml_dtypes.finfo(dt)
    for base in [float(fi.max), float(fi.smallest_normal), float(fi.smallest_subnormal), 1.0]:
        for scale in [1.0, 0.5, 0.75, 1.5, 2.0, 1.0625, 1.03125, 1.0 + 2**-20]:
            edges += [base * scale, -base * scale]
    # every representable value and the midpoints between neighbours (ties)
    if np.dtype(dt).itemsize == 1:
        codes = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
    else:
        codes = np.arange(65536, dtype=np.uint16).view(dt).astype(np.float32)
    finite = np.sort(codes[np.isfinite(codes)])
    edges += list(finite)
    mids = (finite[:-1].astype(np.float64) + finite[1:]) / 2
    edges += list(mids.astype(np.float32))
edges += [0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38, 1e-45, 1.1754942e-38]
x = np.array(edges, dtype=np.float32)
bits = rng.integers(0, 2**32, size=50_000, dtype=np.uint64).astype(np.uint32)
x = np.concatenate([x, bits.view(np.float32)])
out = [np.array([len(x)], dtype="<u4").tobytes(), x.astype("<f4").tobytes()]
with np.errstate(all="ignore"):
    out.append(x.astype(ml_dtypes.bfloat16).view("<u2").tobytes())
    out.append(x.astype(np.float16).view("<u2").tobytes())
    out.append(x.astype(ml_dtypes.float8_e4m3fn).view("u1").tobytes())
    out.append(x.astype(ml_dtypes.float8_e5m2).view("u1").tobytes())
path = pathlib.Path(__file__).with_name("golden_casts.bin")
path.write_bytes(b"".join(out))
print(f"wrote {path} with {len(x)} inputs (ml_dtypes {ml_dtypes.__version__})")
