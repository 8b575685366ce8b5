"""4-bit blocks for decode rows (kernels.cpu.q4): a half-stored matrix read as its affine 4-bit
blocks gives the float16 path's bits, in the kernel, the fused ops, a whole model and its streams."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch.kernels import cpu
from specbatch.kernels.cpu import half, q4
from specbatch.kernels.cpu.modules import FastLinear

from helpers import run_plain, run_scalar

ext = cpu.extension()
needs_q4 = pytest.mark.skipif(ext is None or cpu.status().isa != "avx512" or not half.supported(ext),
                              reason="4-bit blocks are read on AVX-512 CPUs only")


def _blocks(n: int, k: int, seed: int):
    """A float16 matrix that affine 4-bit blocks rebuild exactly, and those blocks."""
    w = mx.random.normal((n, k), key=mx.random.key(seed)).astype(mx.float16)
    qw, scales, biases = mx.quantize(w, group_size=32, bits=4)
    return mx.dequantize(qw, scales, biases, group_size=32, bits=4), qw, scales, biases


@needs_q4
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 150), groups=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_blocks_give_the_float16_paths_bits(n, groups, seed):
    w, qw, scales, biases = _blocks(n, 32 * groups, seed)
    xs = [mx.random.normal((rows, 32 * groups), key=mx.random.key(seed + rows)) for rows in (1, 2, 3, 4, 5)]
    before = [ext.small_linear(x, w) for x in xs]
    mx.eval(before)
    assert ext.q4_register(w, qw, scales, biases)
    try:
        for x, want in zip(xs, before):  # 1-4 rows read the blocks, 5 the float16 matrix
            assert mx.array_equal(ext.small_linear(x, w), want).item()
    finally:
        ext.q4_clear()


@needs_q4
def test_the_fused_ops_read_blocks_with_the_same_bits():
    keys = mx.random.split(mx.random.key(7), 4)
    mats = {name: _blocks(rows, cols, i) for i, (name, rows, cols) in
            enumerate((("q", 64, 64), ("k", 32, 64), ("v", 32, 64), ("g", 96, 64), ("u", 96, 64), ("d", 64, 96)))}
    x, r = mx.random.normal((1, 2, 64), key=keys[0]), mx.random.normal((1, 2, 64), key=keys[1])
    norm = mx.random.normal((64,), key=keys[2])
    inv, pos = mx.exp(-mx.arange(8, dtype=mx.float32)), mx.array([9], dtype=mx.int32)
    w = {name: parts[0] for name, parts in mats.items()}

    def run():
        out = [*ext.qkv_rope(x, w["q"], w["k"], w["v"], [], pos, inv, 4, 2, 16, False, 1.0),
               *ext.gate_up(x, w["g"], w["u"]), ext.mlp_block(x, r, norm, 1e-5, w["g"], w["u"], w["d"])]
        mx.eval(out)
        return out
    before = run()
    for parts in mats.values():
        assert ext.q4_register(*parts)
    try:
        assert all(mx.array_equal(a, b).item() for a, b in zip(run(), before))
    finally:
        ext.q4_clear()


@needs_q4
def test_blocks_that_do_not_rebuild_the_matrix_are_refused():
    w, qw, scales, biases = _blocks(40, 64, 3)
    assert not ext.q4_register((w.astype(mx.float32) * 1.5).astype(mx.float16), qw, scales, biases)
    assert not ext.q4_register(w, qw, scales * 2, biases)
    assert not ext.q4_register(w.astype(mx.float32), qw, scales, biases)  # only half-stored matrices
    assert not ext.q4_register(w[:, :32], qw, scales, biases)  # shapes that do not match


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny model shipped as 4-bit blocks, loaded with and without reading them."""
    import os

    from specbatch.kernels.models import load
    from specbatch.testing.tiny import build_tiny_model
    folder = build_tiny_model(tmp_path_factory.mktemp("q4") / "llama", "llama", seed=6, four_bit=True)
    ext and ext.q4_clear()
    os.environ[q4.ENV] = "0"
    try:
        plain = load(folder)
    finally:
        os.environ.pop(q4.ENV)
    assert ext is None or ext.q4_count() == 0
    blocks = load(folder)
    yield plain, blocks
    ext and ext.q4_clear()


@needs_q4
def test_a_model_reading_blocks_gives_the_float16_models_logits_and_streams(pair, tiny_draft):
    plain, blocks = pair
    assert ext.q4_count() == 2 * 7  # two layers' q, k, v, o, gate, up and down read blocks
    assert all(m.weight.dtype == mx.float16 for _, m in blocks.model.named_modules() if isinstance(m, FastLinear))
    for rows, positions in ((1, 1), (1, 2), (1, 3), (1, 4), (3, 1), (2, 1), (4, 1), (1, 5), (1, 40)):
        tokens = mx.random.randint(0, 200, (rows, positions), key=mx.random.key(rows * 100 + positions))
        assert mx.array_equal(plain.model(tokens), blocks.model(tokens)).item(), (rows, positions)
    from specbatch.tools.bench import kernels
    assert kernels.weight_bytes(blocks.model) < kernels.weight_bytes(plain.model)  # what a width-1 step reads
    for params in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 4}):
        assert run_plain(blocks, "blocks", max_tokens=20, **params) == run_plain(plain, "blocks", max_tokens=20, **params)
        assert run_scalar(blocks, tiny_draft, "blocks", k=2, max_tokens=20, **params)[0] == \
            run_scalar(plain, tiny_draft, "blocks", k=2, max_tokens=20, **params)[0]


def test_only_four_bit_affine_linears_are_collected(tmp_path):
    from mlx_lm.utils import load as mlx_load

    from specbatch.testing.tiny import build_tiny_model
    model, _ = mlx_load(str(build_tiny_model(tmp_path / "m", "llama", seed=1, four_bit=True)))
    found = q4.blocks_of(model)
    assert found and all(name.endswith(("proj",)) for name in found)
    assert all(parts[1].dtype == mx.float16 for parts in found.values())


@needs_q4
def test_a_models_blocks_are_released_with_it(tmp_path):
    import gc

    from specbatch.kernels.models import load
    from specbatch.testing.tiny import build_tiny_model
    before = ext.q4_count()
    loaded = load(build_tiny_model(tmp_path / "gone", "llama", seed=8, four_bit=True))
    assert ext.q4_count() == before + 2 * 7
    del loaded
    gc.collect()
    assert ext.q4_count() == before
