"""mantissa.ModelBuilder and ModelTrainer against PyTorch's runs of the same torch.nn models
(python/tests/data/python_models.npz, recorded by scripts/anchors/torch_python_models.py: the
tests need no PyTorch), and the errors users meet. Run on the installed wheel."""

import os
import pathlib
import threading

import numpy as np
import pytest

import mantissa

DATA = pathlib.Path(__file__).resolve().parent / "data" / "python_models.npz"
FIX = dict(np.load(DATA, allow_pickle=False))
STEPS = 50


def fixture_state(model):
    prefix = f"{model}/init/"
    return {k[len(prefix):]: v for k, v in FIX.items() if k.startswith(prefix)}


def build(model, state):
    """The torch.nn.Sequential of the anchor script, parameters by its state_dict names and
    layouts (Linear weights [out, in]: transpose=True), weights decayed and the rest not."""
    b = mantissa.ModelBuilder()
    x = b.values(FIX[f"{model}/x"].shape[1:])

    def p(name, **kw):
        shape = state[name].shape
        return b.param(name, shape, decay=len(shape) == 2, transpose=len(shape) == 2, **kw)

    if model == "mlp":
        y = b.values(FIX["mlp/y"].shape[1:])
        h = b.gelu(b.linear(x, p("0.weight"), p("0.bias")))
        h = b.gelu(b.linear(h, p("2.weight"), p("2.bias")))
        b.mse(b.linear(h, p("4.weight"), p("4.bias")), y)
    else:
        y = b.targets(FIX["classifier/y"].shape[1:])
        h = b.linear(x, p("0.weight"), p("0.bias"))
        h = b.gelu(b.layer_norm(h, p("1.weight"), p("1.bias")))
        b.cross_entropy(b.linear(h, p("3.weight"), p("3.bias")), y)
    return b


def batch(model, i):
    x, y = FIX[f"{model}/x"][i], FIX[f"{model}/y"][i]
    return ((x, y), {}) if model == "mlp" else ((x,), {"targets": y})


@pytest.mark.parametrize("model", ["mlp", "classifier"])
@pytest.mark.parametrize("preset", ["32-true", "bf16-mixed"])
def test_built_models_follow_pytorch_step_for_step(model, preset):
    state = fixture_state(model)
    t = mantissa.ModelTrainer(build(model, state), preset=preset, backend="reference")
    t.load_state_dict(state)
    args, kw = batch(model, 0)
    _, grads = t.gradients(*args, **kw)
    losses = np.array([t.step(*batch(model, i)[0], **batch(model, i)[1]).loss for i in range(STEPS)])
    want = FIX[f"{model}/{preset}/losses"]
    noise = float(FIX[f"{model}/{preset}/noise"])
    if preset == "32-true":
        # The bounds: PyTorch's f32 moves its own losses by ~5e-7 (noise), far below.
        loss_tol, grad_tol = 1e-5, 1e-5
    else:
        # bf16-mixed: two correct runs differ where a bf16 rounding falls on the other side, and
        # a flipped rounding moves the later losses. PyTorch moves its own losses by `noise` when
        # its weights move by one f32 rounding (the largest of 64 draws over the 50 steps: 2.4e-4
        # for the MLP, 7e-5 for the classifier), so no run can be held closer to it than that:
        # twice it (tests/model_parity.rs's rule). Step 1 has had no update to amplify a flip:
        # 2e-5 there. A gradient may differ by one bf16 rounding (2^-8) of the largest one.
        loss_tol, grad_tol = 2 * noise, 2**-8
        assert abs(losses[0] - want[0]) <= 2e-5
    np.testing.assert_array_less(np.abs(losses - want), loss_tol)
    for name, g in grads.items():
        w = FIX[f"{model}/{preset}/grad/{name}"]
        assert g.shape == w.shape, name
        assert np.abs(g - w).max() <= grad_tol * np.abs(w).max(), name


def test_state_dict_round_trips_in_torchs_names_and_layouts():
    state = fixture_state("mlp")
    t = mantissa.ModelTrainer(build("mlp", state), backend="reference")
    t.load_state_dict(state)
    got = t.state_dict()
    assert list(got) == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    for name, v in state.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], v)
    assert [p.shape for p in t.params()] == [v.shape for v in state.values()]
    # outputs: the predictions of the last forward pass, as numpy computes them.
    x, y = FIX["mlp/x"][0], FIX["mlp/y"][0]
    t.loss(x, y)
    gelu = lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))  # noqa: E731
    s = {k: v.astype(np.float64) for k, v in state.items()}
    h = gelu(x @ s["0.weight"].T + s["0.bias"])
    h = gelu(h @ s["2.weight"].T + s["2.bias"])
    np.testing.assert_allclose(t.outputs(), h @ s["4.weight"].T + s["4.bias"], atol=1e-5)


def test_unary_functions_compute_what_numpy_computes():
    """relu, sigmoid and tanh (and the family by name) in a built model's forward pass, against
    numpy in f64; an unknown function is refused with the valid names."""
    state = fixture_state("mlp")
    b = mantissa.ModelBuilder()
    x = b.values(FIX["mlp/x"].shape[1:])
    y = b.values(FIX["mlp/y"].shape[1:])

    def p(name):
        return b.param(name, state[name].shape, transpose=len(state[name].shape) == 2)

    h = b.relu(b.linear(x, p("0.weight"), p("0.bias")))
    h = b.tanh(b.sigmoid(b.linear(h, p("2.weight"), p("2.bias"))))
    b.mse(b.linear(b.unary("silu", h), p("4.weight"), p("4.bias")), y)
    with pytest.raises(ValueError, match="softplus.*gelu, silu, relu, sigmoid, tanh"):
        b.unary("softplus", h)
    t = mantissa.ModelTrainer(b, backend="reference")
    t.load_state_dict(state)
    xv = FIX["mlp/x"][0]
    t.loss(xv, FIX["mlp/y"][0])
    s = {k: v.astype(np.float64) for k, v in state.items()}
    h = np.maximum(xv @ s["0.weight"].T + s["0.bias"], 0)
    h = np.tanh(1 / (1 + np.exp(-(h @ s["2.weight"].T + s["2.bias"]))))
    h = h / (1 + np.exp(-h))
    np.testing.assert_allclose(t.outputs(), h @ s["4.weight"].T + s["4.bias"], atol=1e-5)


def test_bmm_transpose_softmax_concat_and_arithmetic_compute_what_numpy_computes():
    b = mantissa.ModelBuilder()
    x = b.values([2, 3, 4])
    y = b.values([2, 3, 7])
    h = b.matmul(x, b.param("w", [4, 4]))
    with pytest.raises(ValueError, match=r"attention: qkv \[2, 3, 4\] over 3 heads"):
        b.attention(x, 3)
    s = b.softmax(b.transpose(b.bmm(h, x, transpose_b=True)))
    c = b.concat([s, x])
    m = b.mean(c)
    b.mse(b.sub(c, b.scale(c, 0.5)), y)
    assert m.shape == (2, 3) and b.sum(c).shape == (2, 3)
    with pytest.raises(ValueError, match=r"bmm: a \[2, 3, 4\] \. b \[2, 3, 7\]"):
        b.bmm(x, y)
    with pytest.raises(ValueError, match="concat: xs\\[1\\] must be a Var"):
        b.concat([x, np.zeros(3)])
    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 4)).astype(np.float32)
    xv = rng.standard_normal((2, 3, 4)).astype(np.float32)
    yv = rng.standard_normal((2, 3, 7)).astype(np.float32)
    t = mantissa.ModelTrainer(b, backend="reference")
    t.load_state_dict({"w": w})
    t.loss(xv, yv)
    x64 = xv.astype(np.float64)
    scores = (x64 @ w.astype(np.float64)) @ x64.transpose(0, 2, 1)
    st = scores.transpose(0, 2, 1)
    st = np.exp(st - st.max(-1, keepdims=True))
    want = np.concatenate([st / st.sum(-1, keepdims=True), x64], axis=-1)
    want = want - 0.5 * want
    np.testing.assert_allclose(t.outputs(), want, atol=1e-5)


def test_dropout_masks_are_the_same_on_every_backend_and_refuse_a_bad_rate():
    b = mantissa.ModelBuilder()
    x = b.values([64, 8])
    y = b.values([64, 8])
    with pytest.raises(ValueError, match=r"dropout: p 1\.0 is not in \[0, 1\)"):
        b.dropout(x, 1.0)
    b.mse(b.dropout(b.matmul(x, b.param("w", [8, 8])), 0.5), y)
    rng = np.random.default_rng(3)
    xv, yv = rng.standard_normal((2, 64, 8)).astype(np.float32)
    outs = []
    for backend in ["reference", "auto"]:  # auto: wgpu where a Vulkan device (lavapipe) is
        t = mantissa.ModelTrainer(b, backend=backend, seed=9)
        t.step(xv, yv)
        t.loss(xv, yv)
        outs.append(t.outputs())
    dropped = outs[0] == 0
    assert 0.3 < dropped.mean() < 0.7
    np.testing.assert_array_equal(outs[1] == 0, dropped)


def test_micro_batches_take_the_whole_batch_s_steps():
    """``micro_batches=2``: the model built on 8 rows, a step takes 16 (two micro-batches along
    the first axis), their gradients summed before the update: the steps of the model built on
    16 rows, dropout's masks included, up to the order of f32 additions."""
    def regression(rows):
        b = mantissa.ModelBuilder()
        x, y = b.values([rows, 8]), b.values([rows, 8])
        b.mse(b.dropout(b.matmul(x, b.param("w", [8, 8])), 0.25), y)
        return b
    rng = np.random.default_rng(11)
    whole = mantissa.ModelTrainer(regression(16), backend="reference", seed=4, lr=1e-2)
    split = mantissa.ModelTrainer(regression(8), backend="reference", seed=4, lr=1e-2,
                                  micro_batches=2)
    for _ in range(4):
        xv, yv = rng.standard_normal((2, 16, 8)).astype(np.float32)
        a, m = whole.step(xv, yv), split.step(xv, yv)
        assert abs(a.loss - m.loss) <= 1e-6 * a.loss, (a, m)
    np.testing.assert_allclose(split.state_dict()["w"], whole.state_dict()["w"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"expected shape \(16, 8\), got \(8, 8\)"):
        split.step(xv[:8], yv[:8])
    with pytest.raises(ValueError, match="micro_batches"):
        mantissa.ModelTrainer(regression(8), backend="reference", micro_batches=0)


def _dropout_regression(name="w"):
    b = mantissa.ModelBuilder()
    x = b.values([16, 8])
    y = b.values([16, 8])
    b.mse(b.dropout(b.matmul(x, b.param(name, [8, 8])), 0.25), y)
    return b


def test_checkpoints_resume_bit_for_bit_and_params_load_by_name(tmp_path):
    rng = np.random.default_rng(5)
    xv, yv = rng.standard_normal((2, 16, 8)).astype(np.float32)
    unbroken = mantissa.ModelTrainer(_dropout_regression(), preset="16-mixed", backend="reference", seed=4)
    losses = [unbroken.step(xv, yv).loss for _ in range(4)]
    first = mantissa.ModelTrainer(_dropout_regression(), preset="16-mixed", backend="reference", seed=4)
    resumed_losses = [first.step(xv, yv).loss for _ in range(2)]
    first.save_checkpoint(tmp_path / "ck.safetensors")
    resumed = mantissa.ModelTrainer(_dropout_regression(), preset="16-mixed", backend="reference", seed=4)
    resumed.load_checkpoint(tmp_path / "ck.safetensors")
    assert resumed.steps == 2
    resumed_losses += [resumed.step(xv, yv).loss for _ in range(2)]
    assert resumed_losses == losses
    assert resumed.loss_scale == unbroken.loss_scale
    # Another model's checkpoint and parameters are refused by the names that differ.
    other = mantissa.ModelTrainer(_dropout_regression("v"), backend="reference")
    with pytest.raises(ValueError, match=r"another model.*lacks adam_m\.v, adam_v\.v, param\.v"):
        other.load_checkpoint(tmp_path / "ck.safetensors")
    resumed.save_params(tmp_path / "params.safetensors")
    with pytest.raises(ValueError, match=r"it holds w that the model has not; it lacks v"):
        other.load_params(tmp_path / "params.safetensors")
    fresh = mantissa.ModelTrainer(_dropout_regression(), backend="reference", seed=99)
    fresh.load_params(tmp_path / "params.safetensors")
    np.testing.assert_array_equal(fresh.state_dict()["w"], resumed.state_dict()["w"])


def test_load_state_dict_names_what_is_missing_unexpected_or_misshapen():
    state = fixture_state("mlp")
    t = mantissa.ModelTrainer(build("mlp", state), backend="reference")
    before = t.state_dict()
    partial = dict(state)
    del partial["2.bias"]
    with pytest.raises(ValueError, match=r"missing 2\.bias"):
        t.load_state_dict(partial)
    with pytest.raises(ValueError, match=r"unexpected 9\.weight"):
        t.load_state_dict({**state, "9.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"parameter 0\.weight: expected shape \(32, 8\), got \(8, 32\)"):
        t.load_state_dict({**state, "0.weight": state["0.weight"].T})
    with pytest.raises(ValueError, match=r"parameter 0\.bias: expected a float array"):
        t.load_state_dict({**state, "0.bias": np.zeros(32, np.int64)})
    with pytest.raises(ValueError, match=r"4\.bias\[0\] is NaN"):
        t.load_state_dict({**state, "4.bias": np.full(4, np.nan, np.float32)})
    # Nothing was written by a refused call.
    for name, v in t.state_dict().items():
        np.testing.assert_array_equal(v, before[name])


class Exporter:
    """An array that only speaks DLPack (a host torch or JAX tensor, as numpy sees it)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_batches_are_checked_and_dlpack_is_taken():
    state = fixture_state("classifier")
    t = mantissa.ModelTrainer(build("classifier", state), backend="reference")
    x, y = FIX["classifier/x"][0], FIX["classifier/y"][0]
    loss = t.loss(Exporter(x), targets=Exporter(y))
    assert loss == t.loss(x, targets=y)
    with pytest.raises(ValueError, match=r"values input 0: expected shape \(32, 8\), got \(32, 9\)"):
        t.step(np.zeros((32, 9), np.float32), targets=y)
    with pytest.raises(ValueError, match="values input 0: expected a float array, got dtype int64"):
        t.step(np.zeros((32, 8), np.int64), targets=y)
    with pytest.raises(ValueError, match="targets: expected integer ids, got dtype float32"):
        t.step(x, targets=y.astype(np.float32))
    with pytest.raises(ValueError, match=r"targets: expected shape \(32,\)"):
        t.step(x, targets=y[:5])
    with pytest.raises(ValueError, match="1 values inputs; 2 arrays"):
        t.step(x, x, targets=y)
    with pytest.raises(ValueError, match="tokens: the model reads no tokens"):
        t.step(x, tokens=y, targets=y)
    with pytest.raises(ValueError, match="class targets|target"):
        t.step(x, targets=np.full(32, 5))  # five classes: 0..4
    with pytest.raises(ValueError, match="class targets"):
        t.step(x)
    assert t.applied == 0  # no refused step updated anything


def test_split_and_narrow_cut_the_last_axis_as_torch_does():
    b = mantissa.ModelBuilder()
    x = b.values([2, 3, 7])
    y = b.values([2, 3, 7])
    first, second = b.split(x, [2, 5])
    assert first.shape == (2, 3, 2) and second.shape == (2, 3, 5)
    # The parts put back the other way, with a narrow of x beside them.
    c = b.concat([second, b.narrow(x, 1, 3), first])
    b.mse(b.narrow(c, 0, 7), y)
    with pytest.raises(ValueError, match=r"split: widths \[2, 4\] of x \[2, 3, 7\]"):
        b.split(x, [2, 4])
    with pytest.raises(ValueError, match="split: widths -1 must be a whole number"):
        b.split(x, [-1, 8])
    with pytest.raises(ValueError, match=r"narrow: columns \[6, 6 \+ 2\)"):
        b.narrow(x, 6, 2)
    xv = np.random.default_rng(2).standard_normal((2, 3, 7)).astype(np.float32)
    t = mantissa.ModelTrainer(b, backend="reference")
    t.loss(xv, np.zeros((2, 3, 7), np.float32))
    np.testing.assert_array_equal(t.outputs(), np.concatenate([xv[..., 2:], xv[..., 1:3]], -1))


def _attention(x, heads, bias):
    """Unmasked attention of q|k|v x [batch, tokens, 3 width] in f64, `bias` [batch, heads,
    tokens, tokens] (broadcast) added to the scaled scores; a query that sees no key gets 0."""
    batch, t, c3 = x.shape
    d = c3 // 3 // heads
    want = np.zeros((batch, t, c3 // 3))
    bias = np.broadcast_to(bias, (batch, heads, t, t))
    for s in range(batch):
        for h in range(heads):
            q, k, v = (x[s, :, p * heads * d + h * d: p * heads * d + (h + 1) * d].astype(np.float64)
                       for p in range(3))
            z = q @ k.T * np.float32(1 / np.sqrt(d)) + bias[s, h]
            top = z.max(-1, keepdims=True)
            e = np.where(np.isneginf(top), 0.0, np.exp(z - np.where(np.isneginf(top), 0.0, top)))
            total = e.sum(-1, keepdims=True)
            want[s, :, h * d: (h + 1) * d] = np.divide(e, total, out=np.zeros_like(e), where=total > 0) @ v
    return want


def test_a_key_padding_mask_leaves_the_padded_keys_out():
    b = mantissa.ModelBuilder()
    qkv, mask, y = b.values([2, 3, 12]), b.values([2, 3]), b.values([2, 3, 4])
    b.mse(b.attention_masked(qkv, 2, mask), y)
    with pytest.raises(ValueError, match=r"attention_masked: the key mask \[2, 3, 4\]"):
        b.attention_masked(qkv, 2, y)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 12)).astype(np.float32)
    # Sequence 0 pads its last key; sequence 1 pads every key (its queries attend to nothing).
    m = np.array([[0, 0, 1], [1, 1, 1]], np.float32)
    t = mantissa.ModelTrainer(b, backend="reference")
    t.loss(x, m, np.zeros((2, 3, 4), np.float32))
    bias = np.where(m != 0, -np.inf, 0.0)[:, None, None, :]
    np.testing.assert_allclose(t.outputs(), _attention(x, 2, bias), atol=1e-6)


def test_an_attention_bias_is_added_to_the_scaled_scores():
    b = mantissa.ModelBuilder()
    qkv, bias, y = b.values([2, 3, 12]), b.values([2, 3, 3]), b.values([2, 3, 4])
    b.mse(b.attention_biased(qkv, 2, bias), y)
    with pytest.raises(ValueError, match=r"attention_biased: the bias \[2, 3, 4\]"):
        b.attention_biased(qkv, 2, y)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 12)).astype(np.float32)
    # A bias per head (ALiBi's slopes), -inf leaving key 2 out of head 1.
    dist = np.abs(np.arange(3)[:, None] - np.arange(3)[None, :]).astype(np.float32)
    m = np.stack([-0.5 * dist, -0.25 * dist])
    m[1][:, 2] = -np.inf
    t = mantissa.ModelTrainer(b, backend="reference")
    t.loss(x, m, np.zeros((2, 3, 4), np.float32))
    np.testing.assert_allclose(t.outputs(), _attention(x, 2, m[None]), atol=1e-6)
    with pytest.raises(ValueError, match="a bias is finite or -inf"):
        t.loss(x, np.full((2, 3, 3), np.nan, np.float32), np.zeros((2, 3, 4), np.float32))


def test_a_learned_attention_bias_gets_its_gradient():
    # A relative position bias [tokens, tokens] as a parameter, shared by sequences and heads.
    b = mantissa.ModelBuilder()
    qkv, y = b.values([2, 3, 12]), b.values([2, 3, 4])
    bias = b.param("bias", [3, 3], init="normal", std=0.5)
    b.mse(b.causal_attention_biased(qkv, 2, bias), y)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 12)).astype(np.float32)
    target = rng.standard_normal((2, 3, 4)).astype(np.float32)
    t = mantissa.ModelTrainer(b, backend="reference")
    (m,) = t.params()
    _, grads = t.gradients(x, target)
    causal = np.where(np.tri(3) > 0, 0.0, -np.inf)

    def loss(m):
        return ((_attention(x, 2, (m + causal)[None, None]) - target) ** 2).mean()

    # Central differences of the f64 reference's loss.
    want = np.zeros((3, 3))
    for i in range(3):
        for j in range(3):
            e = np.zeros((3, 3))
            e[i, j] = 1e-5
            want[i, j] = (loss(m + e) - loss(m - e)) / 2e-5
    assert np.all(want[np.triu_indices(3, 1)] == 0)
    np.testing.assert_allclose(grads["bias"], want, atol=1e-5)


def test_rotary_embeddings_rotate_as_hugging_faces_rotate_half():
    b = mantissa.ModelBuilder()
    x, y = b.values([2, 5, 8]), b.values([2, 5, 8])
    b.mse(b.rotary(x, 2, base=100.0), y)
    with pytest.raises(ValueError, match="rotary: .* 8 heads of 1: heads of an even width"):
        b.rotary(x, 8)
    xv = np.random.default_rng(6).standard_normal((2, 5, 8)).astype(np.float32)
    t = mantissa.ModelTrainer(b, backend="reference")
    t.loss(xv, np.zeros((2, 5, 8), np.float32))
    # Hugging Face: inv_freq = 1 / base^(arange(0, d, 2) / d) in f32, freqs = positions x
    # inv_freq in f32, q * cos + rotate_half(q) * sin over heads of d = 4.
    inv_freq = (1.0 / (100.0 ** (np.arange(0, 4, 2) / 4))).astype(np.float32)
    freqs = np.arange(5, dtype=np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], -1).astype(np.float64)
    q = xv.reshape(2, 5, 2, 4).astype(np.float64)
    half = np.concatenate([-q[..., 2:], q[..., :2]], -1)
    want = q * np.cos(emb)[None, :, None, :] + half * np.sin(emb)[None, :, None, :]
    np.testing.assert_allclose(t.outputs(), want.reshape(2, 5, 8), atol=1e-6)


def test_eval_mode_passes_dropout_through():
    def mlp(dropout):
        b = mantissa.ModelBuilder()
        x, y = b.values([8, 4]), b.values([8, 3])
        h = b.tanh(b.linear(x, b.param("w", [4, 6]), b.param("b", [6], init="zeros")))
        if dropout:
            h = b.dropout(h, 0.5)
        b.mse(b.linear(h, b.param("v", [6, 3]), b.param("c", [3], init="zeros")), y)
        return b
    rng = np.random.default_rng(8)
    x, y = rng.standard_normal((8, 4)), rng.standard_normal((8, 3))
    t = mantissa.ModelTrainer(mlp(True), backend="reference", seed=2)
    plain = mantissa.ModelTrainer(mlp(False), backend="reference", seed=2)
    assert t.training
    dropped = t.loss(x, y)
    assert t.eval() is t and not t.training
    assert t.loss(x, y) == plain.loss(x, y) != dropped
    t.train()
    assert t.training and t.loss(x, y) == dropped
    with pytest.raises(ValueError, match="train: mode 'yes' is not a bool"):
        t.train("yes")


def test_misused_ops_raise_value_errors_naming_the_op():
    b = mantissa.ModelBuilder()
    x = b.values([4, 3])
    w = b.param("w", [3, 2])
    with pytest.raises(ValueError, match=r"linear: x \[4, 3\] \. w \[3, 2\] \+ b \[3\]"):
        b.linear(x, w, b.param("b", [3]))
    with pytest.raises(ValueError, match="param w: a parameter of that name is already declared"):
        b.param("w", [3, 2])
    with pytest.raises(ValueError, match="unknown initialisation 'uniform'"):
        b.param("u", [2], init="uniform")
    with pytest.raises(ValueError, match="param t: transpose=True needs a 2-d shape"):
        b.param("t", [2], transpose=True)
    with pytest.raises(ValueError, match="param n: shape"):
        b.param("n", [2, -1])
    with pytest.raises(ValueError, match="gelu: x must be a Var"):
        b.gelu(np.zeros(3))
    other = mantissa.ModelBuilder().values([4, 3])
    with pytest.raises(ValueError, match="add: reads a value of another ModelBuilder"):
        b.add(x, other)
    with pytest.raises(ValueError, match="add: .* shapes differ"):
        b.add(x, b.values([4, 2]))
    with pytest.raises(ValueError, match="cross_entropy: .*targets"):
        b.cross_entropy(x, x)
    with pytest.raises(ValueError, match="causal_attention"):
        b.causal_attention(x, 2)
    with pytest.raises(ValueError, match="reshape: .* element counts differ"):
        b.reshape(x, [5])
    with pytest.raises(ValueError, match="parameter v: not declared"):
        b.parameter("v")
    with pytest.raises(ValueError, match="the builder has no loss"):
        mantissa.ModelTrainer(b, backend="reference")
    loss = b.mse(b.matmul(x, w), b.values([4, 2]))
    # "b" was declared and never read: finishing names it.
    with pytest.raises(ValueError, match="param b: .* does not reach the loss"):
        mantissa.ModelTrainer(b, backend="reference")
    with pytest.raises(ValueError, match="unknown precision preset 'bf17-mixed'"):
        mantissa.ModelTrainer(b, loss, preset="bf17-mixed", backend="reference")
    with pytest.raises(ValueError, match="learning rate|lr"):
        mantissa.ModelTrainer(b, loss, lr=float("nan"), backend="reference")


def test_a_model_the_host_cannot_hold_raises_memory_error():
    # 64 layers of 65535 x 65535 weights: 1.1 TB of parameters, refused before any is drawn.
    b = mantissa.ModelBuilder()
    h = b.values([1, 65535])
    for i in range(64):
        h = b.matmul(h, b.param(f"w{i}", [65535, 65535]))
    b.mse(h, b.values([1, 65535]))
    with pytest.raises(MemoryError, match="out of host memory"):
        mantissa.ModelTrainer(b, backend="reference")
    # The interpreter lives on, and so do other models.
    state = fixture_state("mlp")
    assert np.isfinite(mantissa.ModelTrainer(build("mlp", state), backend="reference").loss(*batch("mlp", 0)[0]))


def lm():
    """A small language model with every op the builder has."""
    b = mantissa.ModelBuilder()
    bs, t, c, v, heads = 2, 8, 16, 11, 2
    tokens, targets = b.tokens([bs, t]), b.targets([bs, t])
    wte = b.param("wte", [v, c])
    pos = b.constant_ids([bs, t], np.tile(np.arange(t), bs))
    x = b.add(b.embedding(wte, tokens), b.embedding(b.param("wpe", [t, c]), pos))
    h = b.layer_norm(x, b.param("ln.g", [c], init="ones", decay=False), b.param("ln.b", [c], init="zeros", decay=False))
    qkv = b.linear(h, b.param("qkv.w", [c, 3 * c]), b.param("qkv.b", [3 * c], init="zeros", decay=False))
    x = b.add(x, b.causal_attention(qkv, heads))
    h = b.rms_norm(x, b.param("rms.g", [c], init="ones", decay=False), 1e-6)
    gate = b.silu(b.matmul(h, b.param("gate", [4 * c, c], transpose=False), transpose_w=True))
    up = b.gelu(b.matmul(h, b.param("up", [c, 4 * c])))
    x = b.add(x, b.matmul(b.mul(gate, up), b.param("down", [4 * c, c])))
    # A scores matrix through causal_softmax and reshape, added back in.
    s = b.causal_softmax(b.reshape(b.matmul(x, b.param("sq", [c, t])), [bs, t, t]), 0.5)
    x = b.add(x, b.matmul(s, b.param("sv", [t, c])))
    b.cross_entropy(b.matmul(x, wte, transpose_w=True), targets)
    return b


def test_every_op_trains_and_the_builder_makes_many_models():
    b = lm()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 11, size=(2, 9))
    kw = dict(tokens=ids[:, :-1], targets=ids[:, 1:])
    t = mantissa.ModelTrainer(b, backend="reference", lr=1e-2, seed=3)
    first = [t.step(**kw).loss for _ in range(20)]
    assert first[-1] < first[0] - 0.1
    again = mantissa.ModelTrainer(b, backend="reference", lr=1e-2, seed=3)
    assert [again.step(**kw).loss for _ in range(3)] == first[:3]
    assert t.outputs().shape == (2, 8, 11)
    with pytest.raises(ValueError, match="token ids|outside|vocab|range"):
        t.step(tokens=np.full((2, 8), 11), targets=ids[:, 1:])


def test_compare_trains_every_preset_from_the_same_weights():
    state = fixture_state("mlp")
    batches = [(FIX["mlp/x"][i], FIX["mlp/y"][i]) for i in range(10)]
    r = mantissa.compare(lambda: build("mlp", state), batches, presets=["32-true", "bf16-mixed"],
                         backends=["reference"], init=state)
    assert list(r.losses) == ["32-true@reference", "bf16-mixed@reference"]
    assert r.baseline == "32-true@reference" and r.largest["32-true@reference"] == 0
    np.testing.assert_allclose(r.losses["32-true@reference"], FIX["mlp/32-true/losses"][:10], atol=1e-5)
    np.testing.assert_allclose(r.losses["bf16-mixed@reference"], FIX["mlp/bf16-mixed/losses"][:10], atol=2e-4)
    assert 0 < r.largest["bf16-mixed@reference"] < 1e-2
    assert "bf16-mixed@reference" in str(r) and r.to_dict()["largest"] == r.largest
    # A builder (not a factory) works too, and 12 steps reuse the 10 batches in order.
    again = mantissa.compare(build("mlp", state), batches, presets="32-true", steps=12, init=state)
    np.testing.assert_array_equal(again.losses["32-true@reference"][:10], r.losses["32-true@reference"])
    with pytest.raises(ValueError, match="named twice"):
        mantissa.compare(build("mlp", state), batches, presets=["32-true", "32-true"])
    with pytest.raises(ValueError, match="no batches"):
        mantissa.compare(build("mlp", state), [])


def test_compare_skips_a_backend_this_machine_lacks():
    # CUDA is absent on a machine without an NVIDIA driver: its run is skipped with the
    # reason, the others compared; where CUDA is present its run is compared like any other.
    state = fixture_state("mlp")
    batches = [(FIX["mlp/x"][i], FIX["mlp/y"][i]) for i in range(3)]
    r = mantissa.compare(build("mlp", state), batches, presets="32-true",
                         backends=["reference", "cuda"], init=state)
    assert list(r.losses)[0] == "32-true@reference"
    if "32-true@cuda" in r.losses:
        assert r.unavailable == {}
    else:
        assert list(r.unavailable) == ["32-true@cuda"] and "cuda" in r.unavailable["32-true@cuda"]
        assert "32-true@cuda: skipped" in str(r) and r.to_dict()["unavailable"] == r.unavailable
        # No run that can open its backend: an error, not an empty comparison.
        with pytest.raises(mantissa.BackendUnavailable, match="no run could open"):
            mantissa.compare(build("mlp", state), batches, presets="32-true", backends="cuda")


def test_steps_release_the_gil():
    # Two threads step two trainers at once (each step releases the GIL and locks its own
    # trainer): the same losses, no deadlock, no error.
    state = fixture_state("mlp")
    trainers = [mantissa.ModelTrainer(build("mlp", state), backend="reference") for _ in range(2)]
    losses = [[], []]

    def work(k):
        for i in range(20):
            losses[k].append(trainers[k].step(*batch("mlp", i)[0]).loss)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert losses[0] == losses[1] and len(losses[0]) == 20


def test_the_package_lists_its_api_and_trains_from_any_directory(tmp_path):
    public = [n for n in dir(mantissa) if not n.startswith("_")]
    assert sorted(public) == sorted(mantissa.__all__)
    for leaked in ("np", "os", "json", "Any", "annotations", "ml_dtypes"):
        assert leaked not in public
    # The shipped corpus, from a directory without data/.
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert os.path.isfile(mantissa.corpus_path())
        runs = mantissa.train(steps=1, backend="reference")
        assert np.isfinite(runs["32-true"]["losses"][0])
        runs = mantissa.train(steps=1, backend="reference", text="to be or not to be " * 400)
        assert np.isfinite(runs["32-true"]["losses"][0])
    finally:
        os.chdir(cwd)
