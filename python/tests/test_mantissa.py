"""The Python package against independent truths: ml_dtypes for casts (every code, random bit
patterns), numpy float64 for matmuls (within the contract's tolerances), and the errors users
meet. Run on the installed wheel (scripts/test.sh installs it into a fresh venv)."""

import os
import pathlib

import ml_dtypes
import numpy as np
import pytest

import mantissa

SEED = int(os.environ.get("MANTISSA_TEST_SEED", np.random.SeedSequence().entropy % 2**63))
print(f"MANTISSA_TEST_SEED={SEED}")
RNG = np.random.default_rng(SEED)
REPO = pathlib.Path(__file__).resolve().parents[2]
CORPUS = str(REPO / "data" / "shakespeare.txt")

FORMATS = {
    "bf16": (ml_dtypes.bfloat16, np.uint16),
    "f16": (np.float16, np.uint16),
    "e4m3": (ml_dtypes.float8_e4m3fn, np.uint8),
    "e5m2": (ml_dtypes.float8_e5m2, np.uint8),
}


def same_bits(got, want):
    """Equal values, NaN where NaN (the payload aside), signed zeros kept."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_matches_ml_dtypes_on_every_code(fmt):
    dtype, codes_t = FORMATS[fmt]
    codes = np.arange(np.iinfo(codes_t).max + 1, dtype=np.int64).astype(codes_t)
    want = codes.view(dtype).astype(np.float32)
    same_bits(mantissa.decode(codes, fmt), want)
    same_bits(mantissa.decode(codes.view(dtype), fmt), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_matches_ml_dtypes_on_random_bits_and_edges(fmt):
    dtype, _ = FORMATS[fmt]
    bits = RNG.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate(
        [
            bits.view(np.float32),
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 65504, 65520, 448, 464,
                      57344, 61440, 3.4e38], dtype=np.float32),
        ]
    )
    got = mantissa.cast(x, fmt)
    assert got.dtype == np.dtype(dtype) and got.shape == x.shape
    # ml_dtypes rounds float32 -> 8-bit formats through float32 directly (round to nearest even,
    # overflow to inf, or NaN for e4m3fn): the same rule as the format's own.
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(dtype).astype(np.float32)
    same_bits(got.astype(np.float32), want)


def test_saturating_cast_clamps_to_the_largest_finite():
    got = mantissa.cast(np.array([1e6, -1e6, np.inf], np.float32), "e4m3", saturate=True)
    assert got.astype(np.float32).tolist() == [448.0, -448.0, 448.0]


def test_finfo_matches_ml_dtypes():
    for fmt, (dtype, _) in FORMATS.items():
        f, want = mantissa.finfo(fmt), ml_dtypes.finfo(dtype)
        assert f["max"] == float(want.max)
        assert f["eps"] == float(want.eps)
        assert f["bits"] == want.bits


def test_split_sums_back_and_each_plane_is_bf16():
    x = RNG.standard_normal(10_000).astype(np.float32)
    h, m, l = mantissa.split(x)
    assert h.dtype == np.dtype(ml_dtypes.bfloat16)
    total = h.astype(np.float64) + m.astype(np.float64) + l.astype(np.float64)
    assert np.all(np.abs(total - x) <= np.abs(x) * 2.0**-24)
    same_bits(h.astype(np.float32), x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_amax_scale_tensorwise_and_rowwise():
    x = RNG.standard_normal((7, 33)).astype(np.float32)
    amax, scale = mantissa.amax_scale(x, "e4m3")
    assert amax.tolist() == [np.abs(x).max()]
    assert np.isclose(amax[0] * scale[0], 448.0, rtol=1e-6)
    amax, scale = mantissa.amax_scale(x, "e5m2", "rowwise")
    assert np.array_equal(amax, np.abs(x).max(axis=1))
    assert np.allclose(amax * scale, 57344.0, rtol=1e-6)


def tolerance(algorithm, k):
    """The contract's accumulation tolerance relative to |A||B| (docs/design.md), generously
    bounded here: a unit roundoff of the algorithm's inputs times a few, plus f32 accumulation."""
    u = {"f32": 2**-24, "tf32": 2**-11, "bf16": 2**-8, "f16": 2**-11, "bf16x3": 2**-16,
         "bf16x6": 2**-21, "bf16x9": 2**-23, "e4m3": 2**-4, "e5m2": 2**-3}[algorithm]
    return 4 * u + 2 * k * 2**-24


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("algorithm", ["f32", "tf32", "bf16", "f16", "bf16x3", "bf16x6", "bf16x9", "e4m3"])
def test_matmul_matches_numpy_float64(backend, algorithm):
    m, k, n = 37, 70, 45  # no tile divides them
    a = RNG.standard_normal((m, k)).astype(np.float32)
    b = RNG.standard_normal((k, n)).astype(np.float32)
    c = mantissa.matmul(a, b, algorithm=algorithm, backend=backend, check=True)
    assert c.dtype == np.float32 and c.shape == (m, n)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    bound = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    assert np.all(np.abs(c - exact) <= tolerance(algorithm, k) * bound)


def test_batched_matmul_and_any_float_dtype_in():
    a = RNG.standard_normal((3, 8, 16)).astype(np.float16)
    b = RNG.standard_normal((3, 16, 5))  # float64
    c = mantissa.matmul(a, b, algorithm="f32", backend="reference")
    want = a.astype(np.float64) @ b.astype(np.float32).astype(np.float64)
    assert c.shape == (3, 8, 5)
    assert np.allclose(c, want, rtol=1e-5, atol=1e-5)


def test_fp8_given_scales():
    a = RNG.standard_normal((16, 32)).astype(np.float32) * 1000
    b = RNG.standard_normal((32, 8)).astype(np.float32)
    c = mantissa.matmul(a, b, algorithm="e4m3", backend="reference", scales=(0.25, 64.0), check=True)
    assert np.all(np.isfinite(c))


def test_matmul_keeps_nan_and_inf():
    a = np.ones((4, 4), np.float32)
    a[0, 0], a[1, 1] = np.nan, np.inf
    c = mantissa.matmul(a, np.ones((4, 4), np.float32), backend="reference", check=True)
    assert np.isnan(c[0]).all() and np.isposinf(c[1]).all() and np.isfinite(c[2:]).all()


def test_bad_input_raises_value_error_with_the_tools_message(tmp_path):
    with pytest.raises(ValueError, match="shapes do not match"):
        mantissa.matmul(np.ones((2, 3)), np.ones((4, 2)))
    with pytest.raises(ValueError, match="2-d or two 3-d"):
        mantissa.matmul(np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match="unknown algorithm 'bf17'"):
        mantissa.matmul(np.ones((2, 2)), np.ones((2, 2)), algorithm="bf17")
    with pytest.raises(ValueError, match="unknown backend"):
        mantissa.matmul(np.ones((2, 2)), np.ones((2, 2)), backend="tpu")
    with pytest.raises(ValueError, match="scales go with fp8"):
        mantissa.matmul(np.ones((2, 2)), np.ones((2, 2)), scales=(1.0, 1.0))
    with pytest.raises(ValueError, match="finite and positive"):
        mantissa.matmul(np.ones((2, 2)), np.ones((2, 2)), algorithm="e4m3", scales=(0.0, 1.0))
    with pytest.raises(ValueError, match="unknown format"):
        mantissa.cast([1.0], "f12")
    with pytest.raises(ValueError, match="expected a float array"):
        mantissa.cast(np.array(["a"]), "bf16")
    with pytest.raises(ValueError, match="bytes each"):
        mantissa.decode(np.zeros(3, np.uint32), "bf16")
    with pytest.raises(ValueError, match="unknown precision preset"):
        mantissa.train(precision=["64-true"], steps=1, backend="reference", corpus=CORPUS)
    with pytest.raises(ValueError, match="too short|fewer than a context"):
        short = tmp_path / "short.txt"
        short.write_text("abcdefghij" * 20)
        mantissa.train(steps=1, backend="reference", corpus=str(short), config="small")


def test_devices_lists_the_reference_and_a_choice():
    d = mantissa.devices()
    assert d["reference"]["name"] == "reference"
    assert "present" in d["cuda"]
    assert isinstance(d["wgpu"], list)
    assert d["auto"]


def test_report_as_a_dict():
    r = mantissa.report(backends=["reference"], sizes=[(33, 17, 65)])
    assert r["contract_breaks"] == 0
    assert r["matmuls"], r.keys()


def test_train_returns_per_step_losses():
    runs = mantissa.train(config="tiny", precision=["32-true", "bf16-mixed"], steps=5,
                          backend="reference", corpus=CORPUS)
    for preset in ("32-true", "bf16-mixed"):
        losses = runs[preset]["losses"]
        assert len(losses) == 5 and all(np.isfinite(losses)), runs
        assert runs[preset]["stopped"] is None
    # The same seed gives the same run.
    again = mantissa.train(config="tiny", precision="32-true", steps=5, backend="reference",
                           corpus=CORPUS)
    assert again["32-true"]["losses"] == runs["32-true"]["losses"]
    # The batch in micro-batches (gradient accumulation) takes the same steps, up to the order
    # of f32 additions; a count that does not divide the batch is refused.
    split = mantissa.train(config="tiny", precision="32-true", steps=5, backend="reference",
                           corpus=CORPUS, grad_accum=4)
    np.testing.assert_allclose(split["32-true"]["losses"], runs["32-true"]["losses"], rtol=1e-6)
    with pytest.raises(ValueError, match="grad-accum"):
        mantissa.train(config="tiny", steps=1, backend="reference", corpus=CORPUS, grad_accum=3)


def test_train_from_pytorchs_weights_and_batches_matches_its_losses(tmp_path):
    """The fixtures of scripts/anchors/torch_step_parity.py: PyTorch's initial weights and
    batches, and its losses; a few steps of each mixed preset, step for step, with GradScaler's
    scales (tests/train.rs holds all 300 steps to the issue's bounds)."""
    import json

    data = REPO / "tests" / "data"
    init, batches = str(data / "parity_tiny_init.safetensors"), str(data / "parity_tiny_batches.npy")
    torch = json.loads((data / "parity_tiny_torch.json").read_text())["runs"]
    runs = mantissa.train(config="tiny", precision=["32-true", "16-mixed"], steps=4,
                          backend="reference", corpus=CORPUS, init=init, batches=batches)
    for preset, bound in (("32-true", 1e-5), ("16-mixed", 1e-3)):
        theirs = torch[preset]
        assert np.max(np.abs(np.subtract(runs[preset]["losses"], theirs["losses"][:4]))) <= bound
    assert runs["16-mixed"]["loss_scales"] == torch["16-mixed"]["loss_scales"][:4]
    assert runs["16-mixed"]["skipped"] == [] and runs["32-true"]["loss_scales"] is None
    # Our seeded weights under PyTorch's names start the same run as the seed itself.
    exported = str(tmp_path / "init.safetensors")
    mantissa.export_init(exported, config="tiny", seed=7, corpus=CORPUS)
    seeded = mantissa.train(config="tiny", precision="32-true", steps=2, backend="reference",
                            corpus=CORPUS, seed=7)
    started = mantissa.train(config="tiny", precision="32-true", steps=2, backend="reference",
                             corpus=CORPUS, seed=7, init=exported)
    assert started["32-true"]["losses"] == seeded["32-true"]["losses"]
    with pytest.raises(ValueError, match="parity_tiny_batches.npy.*fewer than the 301 steps"):
        mantissa.train(steps=301, backend="reference", corpus=CORPUS, batches=batches)
    import struct

    header = json.dumps({"pos.weight": {"dtype": "F32", "shape": [32, 64], "data_offsets": [0, 8192]}})
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(8192))
    with pytest.raises(ValueError, match="bad.safetensors.*tensor tok.weight is missing"):
        mantissa.train(steps=1, backend="reference", corpus=CORPUS, init=str(bad))


def test_a_product_the_host_cannot_hold_raises_memory_error():
    # (1e9, 0) @ (0, 1e9): no data in, 4e18 bytes out. It killed the interpreter.
    a = np.zeros((10**9, 0), np.float32)
    b = np.zeros((0, 10**9), np.float32)
    for backend in ("reference", "auto"):
        with pytest.raises(MemoryError, match="out of host memory"):
            mantissa.matmul(a, b, backend=backend)
    # The interpreter lives on.
    assert mantissa.matmul(np.ones((2, 2)), np.ones((2, 2)), backend="reference")[0, 0] == 2


def test_shapes_are_checked_before_any_copy():
    # A view far larger than memory if it were copied to float32: refused on its shape alone.
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.float64), shape=(10**6, 10**6),
                                           strides=(0, 0))
    with pytest.raises(ValueError, match="shapes do not match"):
        mantissa.matmul(huge, np.ones((3, 2), np.float32))


def test_scales_and_sizes_are_validated():
    a, b = np.ones((2, 2), np.float32), np.ones((2, 2), np.float32)
    for bad in [(1.0,), (1.0, 2.0, 3.0), 1.0, ("x", 1.0), (float("nan"), 1.0), (-1.0, 1.0),
                (1.0, float("inf"))]:
        with pytest.raises(ValueError, match="scales"):
            mantissa.matmul(a, b, algorithm="e4m3", scales=bad)
    with pytest.raises(ValueError, match="negative"):
        mantissa.report(backends=["reference"], sizes=[(-1, 2, 3)])
    with pytest.raises(ValueError, match="negative"):
        mantissa.train(steps=-1, backend="reference", corpus=CORPUS)
    with pytest.raises(ValueError, match="names nothing"):
        mantissa.report(backends=[], sizes=[(2, 2, 2)])
    with pytest.raises(ValueError, match="twice"):
        mantissa.report(backends=["reference", "reference"], sizes=[(2, 2, 2)])
    with pytest.raises(ValueError, match="twice"):
        mantissa.train(precision=["32-true", "32-true"], steps=1, backend="reference",
                       corpus=CORPUS)


def test_a_named_backend_that_is_absent_fails_the_report():
    if mantissa.devices()["cuda"]["present"]:
        pytest.skip("CUDA is present here")
    r = mantissa.report(backends=["reference", "cuda"], sizes=[(8, 8, 8)])
    assert not r["passed"]
    assert any("cuda was named but not checked" in f for f in r["failures"]), r["failures"]


def test_check_holds_on_a_long_honest_product():
    # check=True also bounds the whole product (its band): a long honest sum stays inside it.
    a = RNG.standard_normal((2, 65536)).astype(np.float32)
    b = RNG.standard_normal((65536, 2)).astype(np.float32)
    c = mantissa.matmul(a, b, algorithm="bf16", backend="reference", check=True)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    assert np.linalg.norm(c - exact) / np.linalg.norm(exact) < 0.05
