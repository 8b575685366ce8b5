"""The fused projections against the separate kernels (bit for bit), and the llama-family
layers that call them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch.kernels import cpu
from specbatch.kernels.cpu import fused

needs_kernels = pytest.mark.skipif(not cpu.status().active, reason=f"CPU kernels inactive: {cpu.status().why}")


def _inv(half: int) -> mx.array:
    return mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * 0.3)


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 4), length=st.integers(1, 8), kv=st.integers(1, 3), group=st.integers(1, 3),
       d=st.sampled_from([16, 64]), partial=st.booleans(), positions=st.sampled_from(["int", "rows", "explicit"]),
       bias=st.booleans(), traditional=st.booleans(), norm=st.booleans(), seed=st.integers(0, 2**16))
def test_qkv_rope_is_the_separate_kernels_bit_for_bit(b, length, kv, group, d, partial, positions, bias,
                                                      traditional, norm, seed):
    if b * length > cpu.MAX_ROWS:
        return
    rng = np.random.default_rng(seed)
    normal = lambda *shape: mx.array(rng.standard_normal(shape), dtype=mx.float32)  # noqa: E731
    k_in, hq = 48, kv * group
    x, wq, wk, wv = normal(b, length, k_in), normal(hq * d, k_in), normal(kv * d, k_in), normal(kv * d, k_in)
    biases = [normal(hq * d), normal(kv * d), normal(kv * d)] if bias else []
    dims = d // 2 if partial else d
    pos = {"int": mx.array([int(rng.integers(0, 500))], dtype=mx.int32),
           "rows": mx.array(rng.integers(-3, 500, size=b), dtype=mx.int32),
           "explicit": mx.array(rng.integers(0, 500, size=(b, length)), dtype=mx.int32)}[positions]
    inv = _inv(dims // 2)
    nw = normal(k_in)  # the block's input norm, folded in where handed over
    q, k, v = cpu.extension().qkv_rope(x, wq, wk, wv, biases, pos, inv, hq, kv, dims, traditional, 1.0,
                                       [nw] if norm else [], 1e-5)
    xn = cpu.rms_norm(x, nw, 1e-5) if norm else x

    def alone(i, w, heads, rotate):
        y = cpu.linear(xn, w) + biases[i] if bias else cpu.linear(xn, w)
        y = y.reshape(b, length, heads, d).transpose(0, 2, 1, 3)
        return cpu.rope(y, pos, inv, dims, traditional, 1.0) if rotate else mx.contiguous(y)
    for got, want in ((q, alone(0, wq, hq, True)), (k, alone(1, wk, kv, True)), (v, alone(2, wv, kv, False))):
        assert mx.array_equal(got, want).item()


@needs_kernels
def test_gate_up_is_two_linears_and_both_fused_ops_have_gradients():
    x, wg, wu = mx.random.normal((3, 2, 40)), mx.random.normal((24, 40)), mx.random.normal((24, 40))
    g, u = cpu.extension().gate_up(x, wg, wu)
    assert mx.array_equal(g, cpu.linear(x, wg)).item() and mx.array_equal(u, cpu.linear(x, wu)).item()
    ours = mx.grad(lambda x, wg: sum(o.sum() ** 2 for o in cpu.extension().gate_up(x, wg, wu)), argnums=(0, 1))(x, wg)
    plain = mx.grad(lambda x, wg: ((x @ wg.T).sum() ** 2 + (x @ wu.T).sum() ** 2), argnums=(0, 1))(x, wg)
    for a, b in zip(ours, plain):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-3).item()
    xq, w = mx.random.normal((1, 2, 16)), mx.random.normal((16, 16))
    pos, inv = mx.array([3], dtype=mx.int32), _inv(4)

    def loss(x, fuse):
        if fuse:
            q, k, v = cpu.extension().qkv_rope(x, w, w, w, [], pos, inv, 2, 2, 8, False, 1.0)
        else:
            y = (x @ w.T).reshape(1, 2, 2, 8).transpose(0, 2, 1, 3)
            q = k = mx.fast.rope(y, 8, traditional=False, base=None, scale=1.0, offset=3, freqs=1 / inv)
            v = y
        return (q * 1.5 + k * 0.5 + v).sum()
    assert mx.allclose(mx.grad(lambda x: loss(x, True))(xq), mx.grad(lambda x: loss(x, False))(xq), atol=1e-4).item()
    nw = mx.random.normal((16,))

    def normed(x, nw, fuse):  # the input norm folded into qkv_rope: gradients for x and its weight
        if fuse:
            return sum(o.sum() for o in cpu.extension().qkv_rope(x, w, w, w, [], pos, inv, 2, 2, 8, False, 1.0, [nw], 1e-5))
        return sum(o.sum() for o in cpu.extension().qkv_rope(mx.fast.rms_norm(x, nw, 1e-5), w, w, w, [], pos, inv,
                                                             2, 2, 8, False, 1.0))
    for a, b in zip(mx.grad(lambda x, n: normed(x, n, True), argnums=(0, 1))(xq, nw),
                    mx.grad(lambda x, n: normed(x, n, False), argnums=(0, 1))(xq, nw)):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item()


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 4), length=st.integers(1, 8), k=st.integers(1, 70), i=st.integers(1, 90),
       seed=st.integers(0, 2**16))
def test_mlp_block_is_the_separate_kernels_bit_for_bit(b, length, k, i, seed):
    if b * length > cpu.MAX_ROWS:
        return
    rng = np.random.default_rng(seed)
    normal = lambda *shape: mx.array(rng.standard_normal(shape), dtype=mx.float32)  # noqa: E731
    x, r, norm = normal(b, length, k), normal(b, length, k), normal(k)
    wg, wu, wd = normal(i, k), normal(i, k), normal(k, i)
    h, n = cpu.add_rms_norm(x, r, norm, 1e-5)
    g, u = cpu.extension().gate_up(n, wg, wu)
    want = h + cpu.linear(cpu.swiglu(g, u), wd)
    assert mx.array_equal(cpu.mlp_block(x, r, norm, 1e-5, wg, wu, wd), want).item()


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 32), k=st.integers(1, 70), j=st.integers(1, 90), seed=st.integers(0, 2**16),
       half_weights=st.booleans())
def test_mlp_block_projecting_attention_is_o_proj_then_the_block_bit_for_bit(rows, k, j, seed, half_weights):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: mx.array(rng.standard_normal(shape), dtype=mx.float32)  # noqa: E731
    x, heads, norm = normal(1, rows, k), normal(1, rows, j), normal(k)
    wg, wu, wd, wo = normal(2 * k, k), normal(2 * k, k), normal(k, 2 * k), normal(k, j)
    if half_weights and cpu.half.supported(cpu.extension()):  # float16-exact values stored half
        wg, wu, wd, wo = (w.astype(mx.float16) for w in (wg, wu, wd, wo))
    want = cpu.mlp_block(x, cpu.linear(heads, wo), norm, 1e-5, wg, wu, wd)
    assert mx.array_equal(cpu.mlp_block(x, heads, norm, 1e-5, wg, wu, wd, wo), want).item()


@needs_kernels
def test_mlp_block_projecting_attention_has_gradients_and_checks_shapes():
    x, heads, norm = mx.random.normal((2, 3, 24)), mx.random.normal((2, 3, 16)), mx.random.normal((24,))
    wg, wu, wd = mx.random.normal((40, 24)) * 0.2, mx.random.normal((40, 24)) * 0.2, mx.random.normal((24, 40)) * 0.2
    wo = mx.random.normal((24, 16)) * 0.2

    def plain(heads, wo):
        h = x + heads @ wo.T
        n = mx.fast.rms_norm(h, norm, 1e-5)
        g, u = n @ wg.T, n @ wu.T
        return h + (g * mx.sigmoid(g) * u) @ wd.T
    loss = lambda f: lambda a, w: (f(a, w) ** 2).sum()  # noqa: E731
    ours = mx.grad(loss(lambda a, w: cpu.mlp_block(x, a, norm, 1e-5, wg, wu, wd, w)), argnums=(0, 1))(heads, wo)
    theirs = mx.grad(loss(plain), argnums=(0, 1))(heads, wo)
    for a, b in zip(ours, theirs):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-3).item()
    with pytest.raises(ValueError, match="wo"):
        cpu.extension().mlp_block(x, heads, norm, 1e-5, wg, wu, wd, wo.T)
    with pytest.raises(ValueError, match="wo"):
        cpu.extension().mlp_block(x, heads[:, :2], norm, 1e-5, wg, wu, wd, wo)


@needs_kernels
def test_mlp_block_has_gradients_and_leaves_wide_inputs_to_the_modules():
    x, r, norm = mx.random.normal((2, 3, 24)), mx.random.normal((2, 3, 24)), mx.random.normal((24,))
    wg, wu, wd = mx.random.normal((40, 24)) * 0.2, mx.random.normal((40, 24)) * 0.2, mx.random.normal((24, 40)) * 0.2

    def plain(x, wd):
        h = x + r
        n = mx.fast.rms_norm(h, norm, 1e-5)
        g, u = n @ wg.T, n @ wu.T
        return h + (g * mx.sigmoid(g) * u) @ wd.T
    ours = mx.grad(lambda x, wd: (cpu.mlp_block(x, r, norm, 1e-5, wg, wu, wd) ** 2).sum(), argnums=(0, 1))(x, wd)
    theirs = mx.grad(lambda x, wd: (plain(x, wd) ** 2).sum(), argnums=(0, 1))(x, wd)
    for a, b in zip(ours, theirs):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-3).item()
    wide = mx.random.normal((1, cpu.MAX_ROWS + 1, 24))
    assert cpu.mlp_block(wide, wide, norm, 1e-5, wg, wu, wd) is None
    with pytest.raises(ValueError, match="at most 32 rows"):
        cpu.extension().mlp_block(wide, wide, norm, 1e-5, wg, wu, wd)
    with pytest.raises(ValueError, match="wd"):
        cpu.extension().mlp_block(x, r, norm, 1e-5, wg, wu, wg)


@needs_kernels
def test_a_swapped_llama_decodes_the_same_bits_fused_or_not(tiny, monkeypatch):
    from mlx_lm.models.cache import make_prompt_cache
    model = tiny.model
    prompt, step = mx.array([[3, 5, 7, 9, 11]], dtype=mx.int32), mx.array([[13, 2]], dtype=mx.int32)

    def run():
        cache = make_prompt_cache(model)
        model(prompt, cache=cache)
        return model(step, cache=cache)
    assert type(model.layers[0].self_attn).__name__.startswith("Fast")
    # the block: its add and norm fused (tapped, where another test kept its layers' outputs)
    assert type(model.layers[0]).__name__.removeprefix("Tapped").startswith("Fast")
    calls = []
    original = fused.attention_call
    monkeypatch.setattr(fused, "attention_call", lambda *a, **k: calls.append(1) or original(*a, **k))
    blocks = []
    original_block = fused.mlp_block
    monkeypatch.setattr(fused, "mlp_block", lambda *a: blocks.append(1) or original_block(*a))
    with_fusion = run()
    assert calls and blocks  # the fused paths ran
    monkeypatch.setattr(fused, "attention_call", lambda *a, **k: None)
    monkeypatch.setattr(fused, "block_call", lambda *a, **k: None)  # the add and the norm apart
    # the separate kernels: two small linears, then the same activation kernel
    monkeypatch.setattr(fused, "mlp_call", lambda self, x: self.down_proj(cpu.swiglu(self.gate_proj(x), self.up_proj(x))))
    assert mx.array_equal(run(), with_fusion).item()


@needs_kernels
def test_a_dense_caches_buffer_is_read_in_place_with_the_sliced_views_bits(tiny):
    """An mlx-lm ``KVCache`` with room is written as its own call writes it and attention reads
    its buffer's first keys (no slice nodes); a subclass takes the cache's own call: same bits."""
    from mlx_lm.models.cache import KVCache

    class Sliced(KVCache):  # not the exact type: update_and_fetch and its sliced views
        pass
    model = tiny.model
    prompt = mx.array([[3, 5, 7, 9, 11]], dtype=mx.int32)
    outs = {}
    for name, kind in (("in_place", KVCache), ("sliced", Sliced)):
        cache = [kind() for _ in model.layers]
        got = [model(prompt, cache=cache)]
        for step in ([[13]], [[2, 4, 6]], [[8]]):  # a decode step, a verify, another step
            got.append(model(mx.array(step, dtype=mx.int32), cache=cache))
        mx.eval(got)
        outs[name] = got
        assert cache[0].offset == 10
    assert all(mx.array_equal(a, b).item() for a, b in zip(outs["in_place"], outs["sliced"]))


@needs_kernels
def test_rows_past_the_small_m_kernels_take_the_modules_own_linears(tiny):
    attn = tiny.model.layers[0].self_attn
    wide = mx.random.normal((1, cpu.MAX_ROWS + 1, tiny.model.args.hidden_size))
    assert fused.attention_call(attn, wide) is None
    mlp = tiny.model.layers[0].mlp  # wide rows: the module's two linears, then the kernels' swiglu
    expected = mlp.down_proj(cpu.swiglu(mlp.gate_proj(wide), mlp.up_proj(wide)))
    assert mx.array_equal(fused.mlp_call(mlp, wide), expected).item()
    with cpu.disabled():
        assert fused.attention_call(attn, wide[:, :2]) is None
