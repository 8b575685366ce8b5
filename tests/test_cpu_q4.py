"""4-bit blocks for decode and verify rows (kernels.cpu.q4): a linear holding its blocks' float32
values (q * scale + bias, one rounding) read as those blocks gives the float32 path's bits at every
row count, in the kernel, the fused ops, a whole model and its streams."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch.kernels import cpu
from specbatch.kernels.cpu import q4
from specbatch.kernels.cpu.modules import FastLinear

from helpers import run_plain, run_scalar

ext = cpu.extension()
needs_q4 = pytest.mark.skipif(not q4.reads_here(ext), reason="4-bit blocks are read where the kernels run")


def _blocks(n: int, k: int, seed: int):
    """A float32 matrix holding affine 4-bit blocks' values (float16 scales and biases, widened
    before the arithmetic, as MLX's quantized_matmul takes them), and those blocks."""
    w = mx.random.normal((n, k), key=mx.random.key(seed)).astype(mx.float16)
    qw, scales, biases = mx.quantize(w, group_size=32, bits=4)
    values = mx.dequantize(qw, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=4)
    return values, qw, scales, biases


@needs_q4
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 150), groups=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_blocks_give_the_float32_paths_bits_at_every_row_count(n, groups, seed):
    w, qw, scales, biases = _blocks(n, 32 * groups, seed)
    x = mx.random.normal((33, 32 * groups), key=mx.random.key(seed + 1))
    counts = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33)  # 1-4: one pass; 5-32: passes of up to 8; 33: the matrix
    before = [ext.small_linear(x[:m], w) for m in counts]
    mx.eval(before)
    assert ext.q4_register(w, qw, scales, biases)
    try:
        for m, want in zip(counts, before):
            assert mx.array_equal(ext.small_linear(x[:m], w), want).item(), m
    finally:
        ext.q4_clear()


@needs_q4
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    w, qw, scales, biases = _blocks(70, 96, 5)
    assert ext.q4_register(w, qw, scales, biases)
    try:
        x = mx.random.normal((32, 96), key=mx.random.key(2))
        alone = mx.concatenate([ext.small_linear(x[i:i + 1], w) for i in range(32)])
        for m in (2, 4, 6, 8, 13, 32):
            assert mx.array_equal(ext.small_linear(x[:m], w), alone[:m]).item(), m
    finally:
        ext.q4_clear()


def test_the_values_are_what_mlxs_quantized_matmul_multiplies():
    w, qw, scales, biases = _blocks(48, 128, 9)
    x = mx.random.normal((3, 128), key=mx.random.key(4))
    ours = x @ w.T
    theirs = mx.quantized_matmul(x, qw, scales, biases, transpose=True, group_size=32, bits=4)
    assert mx.allclose(ours, theirs, rtol=1e-6, atol=1e-5).item()
    rounded = mx.dequantize(qw, scales, biases, group_size=32, bits=4)  # float16 arithmetic: other values
    assert not mx.array_equal(rounded.astype(mx.float32), w).item()


@needs_q4
def test_the_fused_ops_read_blocks_with_the_same_bits():
    keys = mx.random.split(mx.random.key(7), 4)
    mats = {name: _blocks(rows, cols, i) for i, (name, rows, cols) in
            enumerate((("q", 64, 64), ("k", 32, 64), ("v", 32, 64), ("g", 96, 64), ("u", 96, 64), ("d", 64, 96)))}
    x, r = mx.random.normal((1, 6, 64), key=keys[0]), mx.random.normal((1, 6, 64), key=keys[1])
    norm = mx.random.normal((64,), key=keys[2])
    inv, pos = mx.exp(-mx.arange(8, dtype=mx.float32)), mx.array([9], dtype=mx.int32)
    w = {name: parts[0] for name, parts in mats.items()}

    def run(rows):
        xs, rs = x[:, :rows], r[:, :rows]
        out = [*ext.qkv_rope(xs, w["q"], w["k"], w["v"], [], pos, inv, 4, 2, 16, False, 1.0),
               *ext.gate_up(xs, w["g"], w["u"]), ext.mlp_block(xs, rs, norm, 1e-5, w["g"], w["u"], w["d"])]
        mx.eval(out)
        return out
    before = {rows: run(rows) for rows in (1, 2, 6)}
    for parts in mats.values():
        assert ext.q4_register(*parts)
    try:
        for rows, want in before.items():
            assert all(mx.array_equal(a, b).item() for a, b in zip(run(rows), want)), rows
    finally:
        ext.q4_clear()


@needs_q4
def test_blocks_that_do_not_rebuild_the_matrix_are_refused():
    w, qw, scales, biases = _blocks(40, 64, 3)
    assert not ext.q4_register(w * 1.5, qw, scales, biases)
    assert not ext.q4_register(w, qw, scales * 2, biases)
    assert not ext.q4_register(w.astype(mx.float16), qw, scales, biases)  # rounded: not the blocks' values
    assert not ext.q4_register(w[:, :32], qw, scales, biases)  # shapes that do not match
    assert not ext.q4_register(w, qw, scales.astype(mx.float32), biases)  # blocks as a checkpoint ships them


def _unregistered(model: nn.Module) -> nn.Module:
    """``model`` with its blocks forgotten: its float32 matrices read as they are stored."""
    for _, m in model.named_modules():
        if q4.reads_blocks(m):
            ext.q4_forget(m["weight"])
            del m._sb_q4_bytes
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny model shipped as 4-bit blocks, loaded twice: one reads the blocks, the other its
    float32 matrices (the same values)."""
    from specbatch.kernels.models import load
    from specbatch.testing.tiny import build_tiny_model
    folder = build_tiny_model(tmp_path_factory.mktemp("q4") / "llama", "llama", seed=6, four_bit=True)
    ext and ext.q4_clear()
    blocks = load(folder)
    assert ext is None or ext.q4_count() == 2 * 7  # two layers' q, k, v, o, gate, up and down
    plain = load(folder)
    _unregistered(plain.model)
    yield plain, blocks
    ext and ext.q4_clear()


@needs_q4
def test_a_model_reading_blocks_gives_its_float32_matrices_logits_and_streams(pair, tiny_draft):
    plain, blocks = pair
    assert ext.q4_count() == 2 * 7
    assert all(m.weight.dtype == mx.float32 for _, m in blocks.model.named_modules() if isinstance(m, FastLinear))
    for rows, positions in ((1, 1), (1, 2), (1, 3), (1, 4), (3, 1), (2, 1), (4, 1), (1, 5), (8, 2), (1, 40)):
        tokens = mx.random.randint(0, 200, (rows, positions), key=mx.random.key(rows * 100 + positions))
        assert mx.array_equal(plain.model(tokens), blocks.model(tokens)).item(), (rows, positions)
    from specbatch.tools.bench import kernels
    assert kernels.weight_bytes(blocks.model) < kernels.weight_bytes(plain.model) / 2  # what a width-1 step reads
    for params in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 4}):
        assert run_plain(blocks, "blocks", max_tokens=20, **params) == run_plain(plain, "blocks", max_tokens=20, **params)
        assert run_scalar(blocks, tiny_draft, "blocks", k=2, max_tokens=20, **params)[0] == \
            run_scalar(plain, tiny_draft, "blocks", k=2, max_tokens=20, **params)[0]


def test_without_the_block_kernel_mlx_lms_dequantization_stands(tmp_path, monkeypatch):
    """``SPECBATCH_Q4=0`` (or a CPU without AVX-512): the linears hold mlx-lm's float16-arithmetic
    values, half-stored where the kernels widen float16."""
    from specbatch.kernels.cpu import half
    from specbatch.kernels.models import load
    from specbatch.testing.tiny import build_tiny_model
    monkeypatch.setenv(q4.ENV, "0")
    loaded = load(build_tiny_model(tmp_path / "m", "llama", seed=6, four_bit=True))
    linears = [m for _, m in loaded.model.named_modules() if isinstance(m, FastLinear)]
    assert linears and not any(q4.reads_blocks(m) for m in linears)
    if half.supported(ext):
        assert all(m.weight.dtype == mx.float16 for m in linears)


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


@needs_q4
def test_the_avx2_tile_passes_the_same_checks():
    """The 8-lane tile (each value one FMA, no table) gives the AVX2 float32 path's bits."""
    from helpers import assert_passes_on_avx2
    assert_passes_on_avx2(__file__)
